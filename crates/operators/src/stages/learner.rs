//! `Learner`: one policy update per step with the clipped loss over the
//! step's rows, AdamW with gradient clipping, micro-batches with gradient
//! accumulation, then the next weights version published on the weights edge.
//!
//! Log-probs: the proximal ("old") log-probs are the learner's own, computed
//! before the update; the behaviour log-probs (the generator's, possibly
//! from an older version) enter only through the importance correction, if
//! one is configured — the decoupled PPO objective.

use arrow::array::RecordBatch;

use tch::{Kind, Tensor};
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::Model;
use weir_graph::{Stage, StageError, StepBuffer, StepContext, WeightsPayload};

use super::columns::{float_lists, token_lists};
use super::sequences::pack;
use crate::algorithms::{aggregate, kl_tensor, policy_loss, KlEstimator, PolicyLossConfig};
use crate::rollout::col;

/// Learner settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearnerConfig {
    /// AdamW settings (learning rate included).
    pub adamw: AdamWConfig,
    /// Gradient-norm clip.
    pub max_grad_norm: Option<f64>,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// The policy loss.
    pub policy: PolicyLossConfig,
    /// Sampling temperature the log-probs are computed at.
    pub temperature: f64,
    /// β of the KL-to-reference loss term (needs `ref_logprobs`; 0 turns it off).
    pub kl_coef: f64,
    /// The KL estimator of that term.
    pub kl_estimator: KlEstimator,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            adamw: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            micro_batch: 16,
            policy: PolicyLossConfig::default(),
            temperature: 1.0,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
        }
    }
}

/// What the last update measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpdateStats {
    /// The policy loss (token mean over the step).
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Fraction of tokens clipped.
    pub clip_fraction: f64,
    /// Mean KL to the reference (0 without a reference).
    pub kl: f64,
}

/// The actor's learner.
pub struct Learner {
    model: Model,
    optimizer: Optimizer,
    cfg: LearnerConfig,
    held: StepBuffer,
    last: UpdateStats,
}

impl Learner {
    /// A learner training `model`.
    pub fn new(model: Model, cfg: LearnerConfig) -> Result<Self, StageError> {
        let optimizer = Optimizer::adamw(&model, cfg.adamw)?;
        Ok(Learner {
            model,
            optimizer,
            cfg,
            held: StepBuffer::new(),
            last: UpdateStats::default(),
        })
    }

    /// What the last update measured.
    pub fn last_update(&self) -> UpdateStats {
        self.last
    }
}

/// Log-probs `[B, R]` of each row's response tokens given its prompt (at
/// `temperature`), with the response mask `[B, R]` (R = the longest response).
pub fn response_logprobs(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<(Tensor, Tensor), StageError> {
    let pad = model.config.pad_token_id.unwrap_or(0).max(0);
    let packed = pack(prompts, responses, pad, model.device());
    let lp = model.token_logprobs(&packed.ids, Some(&packed.mask), temperature)?;
    Ok((lp.gather(1, &packed.index, false), packed.response_mask))
}

fn padded(rows: &[Vec<f64>], width: usize, device: tch::Device) -> Tensor {
    let mut flat = Vec::with_capacity(rows.len() * width);
    for r in rows {
        flat.extend(
            r.iter()
                .map(|x| *x as f32)
                .chain(std::iter::repeat_n(0.0, width - r.len().min(width))),
        );
    }
    Tensor::from_slice(&flat)
        .view([rows.len() as i64, width as i64])
        .to_device(device)
}

impl Stage for Learner {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.held.push(ctx.step, batch);
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let Some(batch) = self.held.take(ctx.step)? else {
            // No rows reached this learner: still publish, so versions stay in step.
            ctx.publish_weights(WeightsPayload::from(
                self.model.export_snapshot(ctx.version + 1)?,
            ))?;
            return Ok(Vec::new());
        };
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, "learn")?;
        let responses = token_lists(&batch, col::RESPONSE_TOKENS, "learn")?;
        let advantages = float_lists(&batch, col::ADVANTAGES, "learn")?;
        let behaviour = float_lists(&batch, col::BEHAVIOR_LOGPROBS, "learn")?;
        let references = if self.cfg.kl_coef > 0.0 {
            Some(float_lists(&batch, col::REF_LOGPROBS, "learn")?)
        } else {
            None
        };
        let total_tokens: usize = responses.iter().map(Vec::len).sum::<usize>().max(1);
        let device = self.model.device();
        self.optimizer.zero_grad();
        let (mut loss_sum, mut clip_sum, mut kl_sum) = (0.0, 0.0, 0.0);
        for start in (0..batch.num_rows()).step_by(self.cfg.micro_batch.max(1)) {
            let end = (start + self.cfg.micro_batch.max(1)).min(batch.num_rows());
            let (lp, mask) = response_logprobs(
                &self.model,
                &prompts[start..end],
                &responses[start..end],
                self.cfg.temperature,
            )?;
            let width = lp.size()[1] as usize;
            let adv = padded(&advantages[start..end], width, device);
            let behaviour_t = padded(&behaviour[start..end], width, device);
            let old = lp.detach();
            let out = policy_loss(&lp, &old, &adv, &mask, Some(&behaviour_t), &self.cfg.policy);
            let mut loss = out.loss.shallow_clone();
            if let Some(refs) = &references {
                // KL to the reference as a loss term (GRPO's β · KL), aggregated like the policy loss.
                let ref_t = padded(&refs[start..end], width, device);
                let kl = aggregate(
                    &kl_tensor(&lp, &ref_t, self.cfg.kl_estimator, self.cfg.policy.flavor),
                    &mask,
                    self.cfg.policy.aggregation,
                    self.cfg.policy.flavor,
                );
                kl_sum += kl.double_value(&[]) * mask.sum(Kind::Double).double_value(&[])
                    / total_tokens as f64;
                loss += kl * self.cfg.kl_coef;
            }
            // Token mean over the whole step: weight each micro-batch by its share of tokens.
            let tokens = mask.sum(Kind::Double).double_value(&[]);
            let share = tokens / total_tokens as f64;
            loss_sum += loss.double_value(&[]) * share;
            (&loss * share).backward();
            clip_sum += out.clip_fraction * share;
        }
        let grad_norm = self.optimizer.step(self.cfg.max_grad_norm);
        if !loss_sum.is_finite() || !grad_norm.is_finite() {
            return Err(format!(
                "step {}: the loss ({loss_sum}) or gradient norm ({grad_norm}) is not finite",
                ctx.step
            )
            .into());
        }
        self.last = UpdateStats {
            loss: loss_sum,
            grad_norm,
            clip_fraction: clip_sum,
            kl: kl_sum,
        };
        tracing::info!(
            step = ctx.step,
            loss = loss_sum,
            grad_norm,
            clip_fraction = clip_sum,
            "policy update"
        );
        for (name, value) in [
            ("loss", loss_sum),
            ("grad_norm", grad_norm),
            ("clip_fraction", clip_sum),
            ("kl", kl_sum),
        ] {
            ctx.record(name, value);
        }
        ctx.publish_weights(WeightsPayload::from(
            self.model.export_snapshot(ctx.version + 1)?,
        ))?;
        Ok(vec![batch])
    }
}
