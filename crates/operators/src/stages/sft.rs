//! `SftTrainer`: supervised fine-tuning, the token-mean negative
//! log-likelihood of each row's target text (plus the end-of-turn token)
//! after its prompt, with AdamW, micro-batches, a warm-up schedule and
//! checkpoints. Rows pass on unchanged (with `sft_loss` per step recorded).

use arrow::array::RecordBatch;
use weir_gpu::collective::GroupMember;
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::{Model, Tokenizer};
use weir_graph::{StageError, StepBuffer, StepContext, StepStage};

use super::learner::LrSchedule;
use crate::algorithms::{aggregate_in_step, Aggregation, Flavor};
use crate::checkpoint::CheckpointPlan;
use crate::data::columns::token_lists;
use crate::error::OperatorError;
use crate::rollout::col;
use crate::training::sequences::response_backward;
use crate::training::sequences::response_targets;
use crate::training::train_step::{step_scale, TrainerCore};

/// SFT settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SftConfig {
    /// AdamW (learning rate included).
    pub adamw: AdamWConfig,
    /// The learning-rate schedule over steps.
    pub schedule: LrSchedule,
    /// Gradient-norm clip.
    pub max_grad_norm: Option<f64>,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// Recompute layer activations in the backward pass (less memory).
    pub gradient_checkpointing: bool,
    /// Response positions the output head runs on at a time (0: all at once).
    pub logprob_chunk: usize,
}

/// The SFT trainer stage.
pub struct SftTrainer {
    core: TrainerCore,
    tokenizer: Tokenizer,
    cfg: SftConfig,
    target_column: String,
    held: StepBuffer,
    /// The last step's loss.
    pub last_loss: f64,
}

impl SftTrainer {
    /// Trains `model` to produce `row[target_column]` + eos after each prompt.
    pub fn new(
        model: Model,
        tokenizer: Tokenizer,
        target_column: &str,
        cfg: SftConfig,
    ) -> Result<Self, StageError> {
        Ok(SftTrainer {
            core: TrainerCore::new(model, cfg.adamw, cfg.schedule, cfg.max_grad_norm)?,
            tokenizer,
            cfg,
            target_column: target_column.to_string(),
            held: super::rows_in_order(),
            last_loss: f64::NAN,
        })
    }

    /// Trains as one rank of data-parallel trainers: each rank takes its
    /// share of a step's rows, the ranks sum their gradients (weighted by
    /// the step's target tokens over all ranks) before the optimizer step,
    /// so their weights stay equal; rank 0 saves the checkpoints and
    /// records the metrics. Every rank calls this together: they start from
    /// rank 0's weights.
    pub fn with_data_parallel(mut self, member: GroupMember) -> Result<Self, StageError> {
        self.core.join_data_parallel(member)?;
        Ok(self)
    }

    /// Saves checkpoints as `plan` says.
    pub fn with_checkpoints(mut self, plan: CheckpointPlan) -> Self {
        self.core.save_with(plan);
        self
    }

    /// The optimizer (to restore its state on resume).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        self.core.optimizer_mut()
    }

    /// The model being trained.
    pub fn model(&self) -> &Model {
        self.core.model()
    }

    /// One optimizer step on `batch`, outside a pipeline (its errors name
    /// the stage `sft`); returns (loss, grad norm).
    pub fn train_step(&mut self, batch: &RecordBatch) -> Result<(f64, f64), StageError> {
        self.train_rows(Some(batch), "sft")
    }

    /// [`SftTrainer::train_step`] as stage `stage`; a data-parallel rank
    /// that got no rows this step passes `None` and still takes part in the
    /// ranks' sums.
    fn train_rows(
        &mut self,
        batch: Option<&RecordBatch>,
        stage: &str,
    ) -> Result<(f64, f64), StageError> {
        let (prompts, targets) = match batch {
            Some(b) => (
                token_lists(b, col::PROMPT_TOKENS, stage)?,
                response_targets(b, &self.target_column, &self.tokenizer, stage)?,
            ),
            None => (Vec::new(), Vec::new()),
        };
        // Token mean over the whole step: every micro-batch and rank.
        let scale = step_scale(self.core.member(), targets.iter().map(Vec::len), None)?;
        let cfg = &self.cfg;
        let mut stats = [0.0];
        let grad_norm = self.core.step(&mut stats, |model, stats| {
            for start in (0..prompts.len()).step_by(cfg.micro_batch.max(1)) {
                let end = (start + cfg.micro_batch.max(1)).min(prompts.len());
                stats[0] += response_backward(
                    model,
                    &prompts[start..end],
                    &targets[start..end],
                    1.0,
                    Default::default(),
                    cfg.gradient_checkpointing,
                    cfg.logprob_chunk,
                    false,
                    |f| {
                        let nll = -f.logprobs;
                        let loss = aggregate_in_step(
                            &nll,
                            &f.mask,
                            Aggregation::TokenMean,
                            Flavor::OpenRlhf,
                            &scale,
                        );
                        let value = loss.double_value(&[]);
                        Ok((loss, value))
                    },
                )?;
            }
            Ok(())
        })?;
        let loss_sum = stats[0];
        self.last_loss = loss_sum;
        Ok((loss_sum, grad_norm))
    }
}

impl StepStage for SftTrainer {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        // A data-parallel rank without rows still joins the ranks' sums.
        if !self.core.runs(rows.is_some()) {
            return Ok(Vec::new());
        }
        let (loss, grad_norm) = self
            .train_rows(rows.as_ref(), ctx.stage())
            .map_err(|e| OperatorError::step(ctx.step, e))?;
        if self.core.leads() {
            ctx.record("loss", loss);
            ctx.record("grad_norm", grad_norm);
            ctx.record("lr", self.core.optimizer().lr());
        }
        self.core.save_if_due(ctx.step, ctx.step + 1)?;
        Ok(rows.into_iter().collect())
    }
}
