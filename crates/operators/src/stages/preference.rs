//! Training on preference pairs: rows carry a prompt and two responses
//! (dataset columns, `chosen` and `rejected` by default), tokenised here
//! with the end-of-turn token appended.
//!
//! - [`RewardTrainer`]: a Bradley–Terry reward model, `−log σ(r_c − r_r)`,
//!   the score read at each sequence's last token.
//! - [`DpoTrainer`]: DPO and its variants against a frozen reference, with
//!   `h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))`
//!   (sequence log-probs summed over response tokens):
//!   DPO `−log σ(β h)`; cDPO (label smoothing ε) `−(1 − ε) log σ(β h) − ε log σ(−β h)`;
//!   IPO `(h − 1/(2β))²`. The implicit rewards are `β (log π − log π_ref)`.

use arrow::array::RecordBatch;
use tch::{Kind, Tensor};
use weir_gpu::collective::{sum_scalars, GroupMember};

use crate::training::train_step::TrainerCore;
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::{Model, Tokenizer};
use weir_graph::{StageError, StepBuffer, StepContext, StepStage};

use super::learner::LrSchedule;
use crate::checkpoint::CheckpointPlan;
use crate::data::columns::{strings, token_lists};
use crate::error::OperatorError;
use crate::rollout::col;
use crate::training::sequences::response_forward;
use crate::training::sequences::{pack_for, response_targets};

/// Settings shared by the preference trainers.
#[derive(Clone, Debug, PartialEq)]
pub struct PairConfig {
    /// AdamW (learning rate included).
    pub adamw: AdamWConfig,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Gradient-norm clip.
    pub max_grad_norm: Option<f64>,
    /// The chosen response's column.
    pub chosen: String,
    /// The rejected response's column.
    pub rejected: String,
    /// A column with each pair's margin `m` (reward model only): the loss
    /// becomes OpenRLHF's `PairWiseLoss` with margin, `−log σ(r_c − r_r − m)`.
    pub margin: Option<String>,
}

/// Prompt tokens and the tokenised chosen and rejected responses of a batch.
struct Pairs {
    prompts: Vec<Vec<i64>>,
    chosen: Vec<Vec<i64>>,
    rejected: Vec<Vec<i64>>,
    /// Each pair's margin, if the config names a margin column.
    margins: Option<Vec<f64>>,
}

fn pairs(
    batch: &RecordBatch,
    tok: &Tokenizer,
    cfg: &PairConfig,
    stage: &str,
) -> Result<Pairs, StageError> {
    let margins = match &cfg.margin {
        Some(name) => Some(
            strings(batch, name, stage)?
                .iter()
                .enumerate()
                .map(|(row, text)| match text.trim().parse::<f64>() {
                    Ok(m) if m.is_finite() => Ok(m),
                    _ => Err(format!(
                        "column `{name}`, row {row} of the step: margin {text:?} is not a finite number"
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
        None => None,
    };
    Ok(Pairs {
        prompts: token_lists(batch, col::PROMPT_TOKENS, stage)?,
        chosen: response_targets(batch, &cfg.chosen, tok, stage)?,
        rejected: response_targets(batch, &cfg.rejected, tok, stage)?,
        margins,
    })
}

/// The state every pair trainer keeps.
struct Trainer {
    core: TrainerCore,
    tokenizer: Tokenizer,
    cfg: PairConfig,
    held: StepBuffer,
}

impl Trainer {
    fn new(model: Model, tokenizer: Tokenizer, cfg: PairConfig) -> Result<Self, StageError> {
        Ok(Trainer {
            core: TrainerCore::new(model, cfg.adamw, cfg.schedule, cfg.max_grad_norm)?,
            tokenizer,
            cfg,
            held: super::rows_in_order(),
        })
    }

    /// This step's pairs (stage `stage`'s input), and their count over
    /// every rank.
    fn pairs(
        &self,
        rows: Option<&RecordBatch>,
        stage: &str,
    ) -> Result<(Option<Pairs>, f64), StageError> {
        let pairs = rows
            .map(|b| pairs(b, &self.tokenizer, &self.cfg, stage))
            .transpose()?;
        let mut total = [pairs.as_ref().map_or(0, |p| p.prompts.len()) as f64];
        sum_scalars(self.core.member(), &mut total)?;
        Ok((pairs, total[0].max(1.0)))
    }

    /// One optimizer step on `loss` (this rank's pairs' summed losses over
    /// the pairs of every rank; none without rows); `sums` (the summed loss
    /// first, then the statistics) come back summed over the ranks. Returns
    /// the gradient norm.
    fn step(&mut self, loss: Option<&Tensor>, sums: &mut [f64]) -> Result<f64, StageError> {
        self.core.step(sums, |_, _| {
            if let Some(loss) = loss {
                loss.backward();
            }
            Ok(())
        })
    }

    /// Records the step's metrics (rank 0 of data-parallel ranks) and saves a due checkpoint.
    fn finish(&self, ctx: &mut StepContext, metrics: &[(&str, f64)]) -> Result<(), StageError> {
        if self.core.leads() {
            for (name, value) in metrics {
                ctx.record(name, *value);
            }
        }
        self.core.save_if_due(ctx.step, ctx.step + 1)
    }
}

/// The summed value of a scalar tensor, or 0 without one.
fn value(t: Option<&Tensor>) -> f64 {
    t.map_or(0.0, |t| t.double_value(&[]))
}

/// Scores at the last token of each `prompt ++ response` row, `[B]`.
pub fn last_token_scores(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<Tensor, StageError> {
    let packed = pack_for(model, prompts, responses)?;
    let scores = model
        .position_scores(&packed.ids, None)?
        .select(2, 0)
        .to_kind(Kind::Float);
    let last: Vec<i64> = prompts
        .iter()
        .zip(responses)
        .map(|(p, r)| (p.len() + r.len()) as i64 - 1)
        .collect();
    let last = Tensor::from_slice(&last)
        .to_device(model.device())
        .unsqueeze(1);
    Ok(scores.gather(1, &last, false).squeeze_dim(1))
}

/// The Bradley–Terry reward-model trainer.
pub struct RewardTrainer(Trainer);

impl RewardTrainer {
    /// Trains `model` (a score head: a reward model, or `Model::load_critic` of an LM).
    pub fn new(model: Model, tokenizer: Tokenizer, cfg: PairConfig) -> Result<Self, StageError> {
        if model.config.head != weir_gpu::Head::SequenceClassification {
            return Err(format!(
                "{}: a reward model needs a score head",
                model.source.display()
            )
            .into());
        }
        Ok(RewardTrainer(Trainer::new(model, tokenizer, cfg)?))
    }

    /// Saves checkpoints as `plan` says.
    pub fn with_checkpoints(mut self, plan: CheckpointPlan) -> Self {
        self.0.core.save_with(plan);
        self
    }

    /// The optimizer (to restore on resume).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        self.0.core.optimizer_mut()
    }

    /// Trains as one rank of data-parallel trainers (see `Learner::with_data_parallel`).
    pub fn with_data_parallel(mut self, member: GroupMember) -> Result<Self, StageError> {
        self.0.core.join_data_parallel(member)?;
        Ok(self)
    }
}

impl StepStage for RewardTrainer {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.0.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let t = &mut self.0;
        if !t.core.runs(rows.is_some()) {
            return Ok(Vec::new());
        }
        let (p, total) = t.pairs(rows.as_ref(), ctx.stage())?;
        // Sums over this rank's pairs, each divided by every rank's pair count.
        let (mut loss, mut correct, mut margins) = (None, None, None);
        if let Some(p) = &p {
            let chosen = last_token_scores(t.core.model(), &p.prompts, &p.chosen)?;
            let rejected = last_token_scores(t.core.model(), &p.prompts, &p.rejected)?;
            let margin = &chosen - &rejected;
            let wanted = p.margins.as_ref().map(|m| {
                Tensor::from_slice(m)
                    .to_kind(margin.kind())
                    .to_device(margin.device())
            });
            loss =
                Some(pairwise_loss(&chosen, &rejected, wanted.as_ref()).sum(Kind::Float) / total);
            correct = Some(margin.gt(0.0).to_kind(Kind::Float).sum(Kind::Float) / total);
            margins = Some(margin.detach().sum(Kind::Float) / total);
        }
        let mut sums = [
            value(loss.as_ref()),
            value(correct.as_ref()),
            value(margins.as_ref()),
        ];
        let norm = t
            .step(loss.as_ref(), &mut sums)
            .map_err(|e| OperatorError::step(ctx.step, e))?;
        let metrics = [
            ("loss", sums[0]),
            ("accuracy", sums[1]),
            ("margin", sums[2]),
            ("grad_norm", norm),
        ];
        t.finish(ctx, &metrics)?;
        Ok(rows.into_iter().collect())
    }
}

/// The Bradley–Terry loss of each pair, `−log σ(r_c − r_r)`, or with a
/// margin `m` per pair `−log σ(r_c − r_r − m)` (OpenRLHF's `PairWiseLoss`).
pub fn pairwise_loss(chosen: &Tensor, rejected: &Tensor, margin: Option<&Tensor>) -> Tensor {
    let diff = chosen - rejected;
    let diff = match margin {
        Some(m) => diff - m,
        None => diff,
    };
    -diff.log_sigmoid()
}

/// Which preference objective [`DpoTrainer`] minimises.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PreferenceLoss {
    /// DPO: `−log σ(β h)`.
    Dpo,
    /// Conservative DPO with label smoothing ε.
    Cdpo {
        /// The probability that a label is flipped.
        label_smoothing: f64,
    },
    /// IPO: `(h − 1/(2β))²`.
    Ipo,
}

/// `loss(h)` per pair for `beta`.
pub fn preference_loss(h: &Tensor, beta: f64, loss: PreferenceLoss) -> Tensor {
    match loss {
        PreferenceLoss::Dpo => -(h * beta).log_sigmoid(),
        PreferenceLoss::Cdpo { label_smoothing: e } => {
            -(h * beta).log_sigmoid() * (1.0 - e) - (h * -beta).log_sigmoid() * e
        }
        PreferenceLoss::Ipo => (h - 1.0 / (2.0 * beta)).square(),
    }
}

/// The DPO-family trainer.
pub struct DpoTrainer {
    trainer: Trainer,
    reference: Model,
    beta: f64,
    loss: PreferenceLoss,
}

/// Summed log-probs of each row's response tokens, `[B]`.
fn sequence_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
) -> Result<Tensor, StageError> {
    let f = response_forward(model, prompts, responses, 1.0, None)?;
    Ok((f.logprobs * f.mask).sum_dim_intlist(-1, false, Kind::Float))
}

impl DpoTrainer {
    /// Trains `policy` against the frozen `reference`.
    pub fn new(
        policy: Model,
        reference: Model,
        tokenizer: Tokenizer,
        cfg: PairConfig,
        beta: f64,
        loss: PreferenceLoss,
    ) -> Result<Self, StageError> {
        Ok(DpoTrainer {
            trainer: Trainer::new(policy, tokenizer, cfg)?,
            reference,
            beta,
            loss,
        })
    }

    /// Saves checkpoints as `plan` says.
    pub fn with_checkpoints(mut self, plan: CheckpointPlan) -> Self {
        self.trainer.core.save_with(plan);
        self
    }

    /// The optimizer (to restore on resume).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        self.trainer.core.optimizer_mut()
    }

    /// Trains as one rank of data-parallel trainers (see `Learner::with_data_parallel`).
    pub fn with_data_parallel(mut self, member: GroupMember) -> Result<Self, StageError> {
        self.trainer.core.join_data_parallel(member)?;
        Ok(self)
    }
}

impl StepStage for DpoTrainer {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.trainer.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let t = &mut self.trainer;
        if !t.core.runs(rows.is_some()) {
            return Ok(Vec::new());
        }
        let (p, total) = t.pairs(rows.as_ref(), ctx.stage())?;
        // Sums over this rank's pairs, each divided by every rank's pair count.
        let mut loss = None;
        let mut stats = [0.0; 4];
        if let Some(p) = &p {
            let (ref_c, ref_r) = {
                let _guard = tch::no_grad_guard();
                (
                    sequence_logprobs(&self.reference, &p.prompts, &p.chosen)?,
                    sequence_logprobs(&self.reference, &p.prompts, &p.rejected)?,
                )
            };
            let _training = t.core.model().training();
            let chosen = sequence_logprobs(t.core.model(), &p.prompts, &p.chosen)? - ref_c;
            let rejected = sequence_logprobs(t.core.model(), &p.prompts, &p.rejected)? - ref_r;
            let h = &chosen - &rejected;
            let share = |x: &Tensor| x.sum(Kind::Float).double_value(&[]) / total;
            stats = [
                self.beta * share(&h),
                self.beta * share(&chosen),
                self.beta * share(&rejected),
                share(&h.gt(0.0).to_kind(Kind::Float)),
            ];
            loss = Some(preference_loss(&h, self.beta, self.loss).sum(Kind::Float) / total);
        }
        let mut sums = [value(loss.as_ref()), stats[0], stats[1], stats[2], stats[3]];
        let norm = t
            .step(loss.as_ref(), &mut sums)
            .map_err(|e| OperatorError::step(ctx.step, e))?;
        let metrics = [
            ("loss", sums[0]),
            ("grad_norm", norm),
            ("reward_margin", sums[1]),
            ("reward_chosen", sums[2]),
            ("reward_rejected", sums[3]),
            ("accuracy", sums[4]),
        ];
        t.finish(ctx, &metrics)?;
        Ok(rows.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pairwise_loss_subtracts_the_margin() {
        let c = Tensor::from_slice(&[2.0f64, 0.0]);
        let r = Tensor::from_slice(&[1.0f64, 1.0]);
        let m = Tensor::from_slice(&[1.0f64, -1.0]);
        let plain = Vec::<f64>::try_from(pairwise_loss(&c, &r, None)).unwrap();
        let shifted = Vec::<f64>::try_from(pairwise_loss(&c, &r, Some(&m))).unwrap();
        let nls = |x: f64| (1.0 + (-x).exp()).ln();
        assert!((plain[0] - nls(1.0)).abs() < 1e-12 && (plain[1] - nls(-1.0)).abs() < 1e-12);
        // With the margin the differences become 1 − 1 = 0 and −1 + 1 = 0: log 2 each.
        for x in shifted {
            assert!((x - std::f64::consts::LN_2).abs() < 1e-12);
        }
    }

    #[test]
    fn preference_losses_by_hand() {
        let h = Tensor::from_slice(&[0.0f64, 2.0, -1.0]);
        let at = |t: &Tensor, i: i64| t.double_value(&[i]);
        let ln2 = std::f64::consts::LN_2;
        let dpo = preference_loss(&h, 0.5, PreferenceLoss::Dpo);
        assert!((at(&dpo, 0) - ln2).abs() < 1e-12);
        assert!((at(&dpo, 1) - (1.0 + (-1.0f64).exp()).ln()).abs() < 1e-12);
        let cdpo = preference_loss(
            &h,
            0.5,
            PreferenceLoss::Cdpo {
                label_smoothing: 0.25,
            },
        );
        let sp = |x: f64| (1.0 + (-x).exp()).ln();
        assert!((at(&cdpo, 2) - (0.75 * sp(-0.5) + 0.25 * sp(0.5))).abs() < 1e-12);
        let ipo = preference_loss(&h, 0.5, PreferenceLoss::Ipo);
        assert!((at(&ipo, 1) - 1.0).abs() < 1e-12, "(2 − 1)²");
        assert!((at(&ipo, 2) - 4.0).abs() < 1e-12, "(−1 − 1)²");
    }
}

#[cfg(test)]
#[path = "pair_loss_tests.rs"]
mod pair_loss_tests;
