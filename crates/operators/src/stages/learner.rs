//! `Learner`: one policy update per step with the clipped loss over the
//! step's rows, AdamW with gradient clipping, micro-batches with gradient
//! accumulation, then the next weights version published on the weights edge.
//!
//! Log-probs: the proximal ("old") log-probs are the learner's own, computed
//! before the update (by a no-grad pass when the step makes several
//! optimizer steps; else the training forward's own, detached); the
//! behaviour log-probs (the generator's, possibly from an older version)
//! enter only through the importance correction, if one is configured — the
//! decoupled PPO objective.

use arrow::array::RecordBatch;

use tch::{Kind, Tensor};
use weir_gpu::collective::{sum_scalars, GroupMember};
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::Model;
use weir_graph::{StageError, StepBuffer, StepContext, StepStage, WeightsPayload};

use crate::algorithms::corrections::{batch_normalizer, weight_sums};
use crate::algorithms::{
    aggregate_in_step, importance_weights, kl_tensor, kl_unbiased_gradient, policy_loss_in_step,
    topk_divergence, GkdLoss, KlEstimator, PolicyLossConfig, StepScale, WeightStats,
};
use crate::checkpoint::CheckpointPlan;
use crate::error::OperatorError;
use crate::rollout::col;
use crate::training::learn_rows::{padded, top_grid, LearnRows};
use crate::training::sequences::{response_backward, response_logprobs, ResponseForward};
pub use crate::training::train_step::LrSchedule;
use crate::training::train_step::{step_scale_counted, TrainerCore};
use weir_gpu::logprobs::HeadReads;

/// Learner settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LearnerConfig {
    /// AdamW settings (learning rate included).
    pub adamw: AdamWConfig,
    /// Gradient-norm clip.
    pub max_grad_norm: Option<f64>,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// A token budget per forward/backward pass (0: off): each mini-batch's
    /// rows are sorted by length and cut into micro-batches of at most
    /// `micro_batch` rows whose padded size (rows × the longest prompt +
    /// response) stays within it, a single longer row alone (verl's
    /// `use_dynamic_bsz`). Long-tailed lengths then cost their tokens, not
    /// the longest row's width times the row count; the step's loss and
    /// gradients are the same sums (each micro-batch is normalised by the
    /// step's counts).
    pub micro_batch_tokens: usize,
    /// The policy loss.
    pub policy: PolicyLossConfig,
    /// Divide the correction's weights by their mean over the step (verl's
    /// `rollout_is_batch_normalize`; TIS and IcePop, per token or per
    /// response): measured on the proximal pass, which then always runs,
    /// over every rank's rows, and recorded as `is_weight_normalizer`.
    pub normalize_weights: bool,
    /// Sampling temperature the log-probs are computed at.
    pub temperature: f64,
    /// β of the KL-to-reference loss term (needs `ref_logprobs`; 0 turns it off).
    pub kl_coef: f64,
    /// The KL estimator of that term.
    pub kl_estimator: KlEstimator,
    /// The term's gradient as OpenRLHF's `unbiased_gradient` has it
    /// ([`crate::algorithms::kl_unbiased_gradient`]): the estimator's value,
    /// the importance-weighted reverse-KL gradient.
    pub kl_unbiased_gradient: bool,
    /// Passes over each step's rows; the proximal log-probs are those
    /// before the first pass.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass: the step's rows split into this many
    /// mini-batches (verl's `ppo_mini_batch_size` = rows / mini_batches),
    /// each normalised over its own rows on every rank.
    pub mini_batches: usize,
    /// The learning-rate schedule over optimizer steps.
    pub schedule: LrSchedule,
    /// Entropy bonus: `loss − coef · entropy`, the entropy aggregated like
    /// the policy loss (OpenRLHF's `entropy_loss_coef`, verl's `entropy_coeff`;
    /// 0 = off, the entropy is still logged).
    pub entropy_coef: f64,
    /// Recompute layer activations in the backward pass instead of keeping
    /// them: less memory for one more forward pass, the same gradients.
    pub gradient_checkpointing: bool,
    /// Run each micro-batch's rows end to end as one sequence, attention
    /// within each row, no padding ([`crate::training::sequences::pack_flat`]); with
    /// `micro_batch_tokens`, a micro-batch holds rows up to that many tokens
    /// in all. The same losses and gradients.
    pub packing: bool,
    /// Response positions the output head runs on at a time in the
    /// log-prob passes (0: all at once): bounds the logits' memory.
    pub logprob_chunk: usize,
    /// Distillation over a teacher's top-k tokens (`teacher_topk_ids`,
    /// `teacher_topk_logprobs`): `coef ·` the divergence at each generated
    /// token, aggregated as the KL term, added to the loss
    /// ([`crate::algorithms::gkd`]).
    pub gkd: Option<GkdLoss>,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            adamw: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            micro_batch: 16,
            micro_batch_tokens: 0,
            policy: PolicyLossConfig::default(),
            normalize_weights: false,
            temperature: 1.0,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            kl_unbiased_gradient: false,
            ppo_epochs: 1,
            mini_batches: 1,
            schedule: LrSchedule::Constant { warmup: 0 },
            entropy_coef: 0.0,
            gradient_checkpointing: false,
            packing: false,
            logprob_chunk: 0,
            gkd: None,
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
    /// Mean per-token entropy of the policy over the response tokens.
    pub entropy: f64,
    /// Mean response length in tokens.
    pub response_length: f64,
    /// Importance weights of the off-policy correction (the mean and the
    /// fraction dropped over every rank; min and max this rank's), if one is configured.
    pub importance_weights: Option<WeightStats>,
    /// Mean reward of the step's rows, when they carry one.
    pub reward: Option<f64>,
    /// Mean top-k divergence to the teacher per generated token (0 without [`LearnerConfig::gkd`]).
    pub gkd: f64,
}

/// The actor's learner.
pub struct Learner {
    core: TrainerCore,
    cfg: LearnerConfig,
    held: StepBuffer,
    last: UpdateStats,
    /// Run the proximal pass even where the training forward's log-probs
    /// serve (tests hold the two alike).
    proximal_pass_always: bool,
    /// The last step's weight normaliser, when the weights are normalised.
    normalizer: Option<f64>,
}

impl Learner {
    /// A learner training `model`.
    pub fn new(model: Model, cfg: LearnerConfig) -> Result<Self, StageError> {
        Ok(Learner {
            core: TrainerCore::new(model, cfg.adamw, cfg.schedule, cfg.max_grad_norm)?,
            cfg,
            held: super::rows_in_order(),
            last: UpdateStats::default(),
            proximal_pass_always: false,
            normalizer: None,
        })
    }

    /// Trains as one rank of data-parallel learners: each rank takes its
    /// share of a step's rows, the ranks sum their gradients (weighted by
    /// the step's token count over all ranks) before every optimizer step,
    /// so their weights stay equal; rank 0 publishes the weights, saves the
    /// checkpoints and records the metrics, which cover every rank's rows.
    /// Every rank calls this together: they start from rank 0's weights.
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

    /// What the last update measured.
    pub fn last_update(&self) -> UpdateStats {
        self.last
    }

    /// The model being trained.
    pub fn model(&self) -> &Model {
        self.core.model()
    }

    /// What the learner records of its last update, as metrics of its
    /// stage: the loss, gradient norm, clip fraction, entropy, learning
    /// rate, the KL when it is a loss term (a KL in the reward is the
    /// advantage stage's), the importance weights' statistics when a
    /// correction is on, and what the rows looked like (mean reward and
    /// response length). A run's `metrics.parquet` holds them per step and
    /// `weir replay` compares its own with them; the engine adds what
    /// depends on the moment (`row_latency_s`, `weights_bytes`).
    pub fn update_metrics(&self) -> Vec<(&'static str, f64)> {
        let u = self.last;
        let mut out = vec![
            ("loss", u.loss),
            ("grad_norm", u.grad_norm),
            ("clip_fraction", u.clip_fraction),
            ("entropy", u.entropy),
            ("lr", self.core.optimizer().lr()),
        ];
        if self.cfg.kl_coef > 0.0 {
            out.push(("kl", u.kl));
        }
        if self.cfg.gkd.is_some() {
            out.push(("gkd_divergence", u.gkd));
        }
        if let Some(w) = u.importance_weights {
            out.extend([
                ("is_weight_mean", w.mean),
                ("is_weight_min", w.min),
                ("is_weight_max", w.max),
                ("is_masked_fraction", w.masked),
            ]);
        }
        if let Some(normalizer) = self.normalizer {
            out.push(("is_weight_normalizer", normalizer));
        }
        if let Some(reward) = u.reward {
            out.push(("reward", reward));
        }
        out.push(("response_length", u.response_length));
        out
    }

    /// The correction whose weights are normalised over the step, if they are.
    fn normalized_correction(&self) -> Option<crate::algorithms::ImportanceCorrection> {
        self.cfg
            .policy
            .correction
            .filter(|c| self.cfg.normalize_weights && c.batch_normalizable())
    }

    /// verl's batch normaliser of the correction's weights: their mean over
    /// the step's valid tokens (or responses) on every rank, from the
    /// proximal log-probs of each micro-batch.
    fn weight_normalizer(
        &self,
        rows: &LearnRows,
        ranges: &[Vec<(usize, usize)>],
        proximal: Option<&Vec<Vec<Tensor>>>,
    ) -> Result<Option<f64>, StageError> {
        let Some(correction) = self.normalized_correction() else {
            return Ok(None);
        };
        let proximal = proximal.ok_or("normalised weights need the proximal pass")?;
        let per_response = correction.per_response();
        let mut sums = [0.0, 0.0];
        for (mini, olds) in ranges.iter().zip(proximal) {
            for (&(start, end), old) in mini.iter().zip(olds) {
                let (width, device) = (old.size()[1] as usize, old.device());
                let behaviour = padded(&rows.behaviour[start..end], width, device);
                let mask = padded(&rows.generated[start..end], width, device);
                let weights = importance_weights(correction, old, &behaviour, &mask);
                let (sum, count) = weight_sums(&weights, &mask, per_response);
                sums[0] += sum;
                sums[1] += count;
            }
        }
        sum_scalars(self.core.member(), &mut sums)?;
        Ok(Some(batch_normalizer(sums[0], sums[1], per_response)))
    }
}

/// Mean seconds from each row's `started_unix_s` to now (`None` without the column).
fn row_latency_s(rows: &RecordBatch) -> Option<f64> {
    let started = rows
        .column_by_name(col::STARTED_UNIX_S)?
        .as_any()
        .downcast_ref::<arrow::array::Float64Array>()?;
    if started.is_empty() {
        return None;
    }
    let now = weir_graph::weights_edge::now_unix_s();
    Some(started.values().iter().map(|s| now - s).sum::<f64>() / started.len() as f64)
}

impl Learner {
    /// One policy update (`ppo_epochs` optimizer steps) on `batch`'s rows,
    /// outside a pipeline (its errors name the stage `learn`); what it
    /// measured is also kept for [`Learner::last_update`].
    pub fn update(&mut self, batch: &RecordBatch) -> Result<UpdateStats, StageError> {
        self.update_rows(Some(batch), "learn")
    }

    /// [`Learner::update`] for one data-parallel rank, which may have got
    /// no rows of the step (`None`) and still takes part in the ranks'
    /// sums, as in a pipeline; `false` when it had nothing to do (no rows,
    /// no ranks).
    pub fn update_as_rank(&mut self, batch: Option<&RecordBatch>) -> Result<bool, StageError> {
        if !self.core.runs(batch.is_some()) {
            return Ok(false);
        }
        self.update_rows(batch, "learn")?;
        Ok(true)
    }

    /// Whether this learner records the step's metrics (rank 0, or the only one).
    pub fn leads(&self) -> bool {
        self.core.leads()
    }

    /// [`Learner::update`] as stage `stage`; a data-parallel rank that got
    /// no rows this step passes `None` and still takes part in the ranks' sums.
    fn update_rows(
        &mut self,
        batch: Option<&RecordBatch>,
        stage: &str,
    ) -> Result<UpdateStats, StageError> {
        let vocab = self.core.model().config.vocab_size;
        let mut rows = LearnRows::read(batch, self.cfg.kl_coef > 0.0, self.cfg.gkd, vocab, stage)?;
        // Over every rank: rows, the rewards' sum and how many there were.
        let mut step_totals = [
            rows.len() as f64,
            rows.rewards.as_ref().map_or(0.0, |r| r.iter().sum()),
            rows.rewards.as_ref().map_or(0, Vec::len) as f64,
        ];
        let member = self.core.member();
        sum_scalars(member, &mut step_totals)?;
        let minis = self.cfg.mini_batches.max(1);
        let ranges = if self.cfg.packing {
            rows.packed_micro_batches(minis, self.cfg.micro_batch, self.cfg.micro_batch_tokens)?
        } else {
            rows.micro_batches(minis, self.cfg.micro_batch, self.cfg.micro_batch_tokens)
        };
        let proximal = self.proximal_logprobs(&rows, &ranges)?;
        self.normalizer = self.weight_normalizer(&rows, &ranges, proximal.as_ref())?;
        self.cfg.policy.weight_normalizer = self.normalizer.unwrap_or(1.0);
        // The weights change at the first optimizer step: the CPU kernels'
        // packing of them is not needed beside the backward passes.
        self.core.model().release_cpu_packing();
        // Each mini-batch's loss is normalised by its own counts over every rank.
        let scales: Vec<_> = (0..minis)
            .map(|k| {
                let (lo, hi) = rows.mini_batch(k, minis);
                let counted = crate::data::columns::generated_counts(&rows.generated[lo..hi]);
                let lengths = rows.responses[lo..hi].iter().map(Vec::len);
                step_scale_counted(
                    member,
                    counted.into_iter().zip(lengths),
                    self.cfg.policy.loss_scale_factor,
                )
            })
            .collect::<Result<_, _>>()?;
        let step_tokens: f64 = scales.iter().map(|s| s.tokens).sum();
        // The last pass's figures, averaged over its mini-batches.
        let mut pass = PassFigures::default();
        for _epoch in 0..self.cfg.ppo_epochs.max(1) {
            pass = PassFigures::default();
            for (k, (mini, scale)) in ranges.iter().zip(&scales).enumerate() {
                let olds = proximal.as_ref().map(|p| p[k].as_slice());
                let figures = self.mini_batch_step(&rows, mini, olds, scale)?;
                pass.add(&figures, minis);
            }
        }
        // The weights' mean is over every rank; min and max stay this rank's.
        let weights = pass.bounds.map(|(min, max)| WeightStats {
            mean: pass.weight_mean,
            min,
            max,
            masked: pass.masked,
        });
        self.last = UpdateStats {
            loss: pass.loss,
            grad_norm: pass.grad_norm,
            clip_fraction: pass.clip_fraction,
            kl: pass.kl,
            entropy: pass.entropy,
            response_length: step_tokens / step_totals[0].max(1.0),
            reward: (step_totals[2] > 0.0).then(|| step_totals[1] / step_totals[2]),
            importance_weights: weights,
            gkd: pass.gkd,
        };
        Ok(self.last)
    }

    /// The proximal policy: log-probs before this step's first update, per
    /// mini-batch and micro-batch; `None` where the training forward's own
    /// serve. With one optimizer step over the step's rows (one pass, one
    /// mini-batch), every micro-batch's training forward runs on exactly
    /// those weights, so its own log-probs, detached, are the proximal ones
    /// (the ratio is 1 at the update, as TRL's is at `num_iterations = 1`)
    /// and no pass of their own is needed. Adapter dropout makes the
    /// training forward another policy: then the pass runs.
    fn proximal_logprobs(
        &self,
        rows: &LearnRows,
        ranges: &[Vec<(usize, usize)>],
    ) -> Result<Option<Vec<Vec<Tensor>>>, StageError> {
        let dropout = self.core.model().lora().is_some_and(|l| l.dropout > 0.0);
        let one_update = self.cfg.ppo_epochs.max(1) == 1
            && ranges.len() == 1
            && !dropout
            && !self.proximal_pass_always
            && self.normalized_correction().is_none();
        if one_update {
            return Ok(None);
        }
        let _guard = tch::no_grad_guard();
        let passes = ranges.iter().map(|mini| {
            mini.iter()
                .map(|&(start, end)| {
                    response_logprobs(
                        self.core.model(),
                        &rows.prompts[start..end],
                        &rows.responses[start..end],
                        self.cfg.temperature,
                        self.cfg.logprob_chunk,
                        self.cfg.packing,
                    )
                    .map(|(lp, _)| lp)
                })
                .collect::<Result<Vec<_>, _>>()
        });
        Ok(Some(passes.collect::<Result<_, _>>()?))
    }

    /// One optimizer step on the micro-batches `mini` of `rows`, the loss
    /// normalised by `scale`; `olds` are their proximal log-probs (`None`:
    /// the training forward's own). Returns what the step measured, summed
    /// over the ranks.
    fn mini_batch_step(
        &mut self,
        rows: &LearnRows,
        mini: &[(usize, usize)],
        olds: Option<&[Tensor]>,
        scale: &StepScale,
    ) -> Result<PassFigures, StageError> {
        let mut bounds = None;
        let mut stats = [0.0; 7];
        let cfg = &self.cfg;
        let grad_norm = self.core.step(&mut stats, |model, stats| {
            for (j, &(start, end)) in mini.iter().enumerate() {
                let terms = MicroBatch {
                    cfg,
                    rows,
                    range: (start, end),
                    old: olds.map(|o| &o[j]),
                    scale,
                    device: model.device(),
                };
                let micro_loss =
                    |fwd: ResponseForward| Ok((terms.loss(fwd, stats, &mut bounds), ()));
                let support = rows.top.as_ref().map(|top| {
                    let width = rows.responses[start..end].iter().map(Vec::len).max();
                    let width = width.unwrap_or(1).max(1);
                    top_grid(&top.ids[start..end], width, top.k, model.device())
                });
                let reads = HeadReads {
                    entropy_at: Some(cfg.policy.flavor.entropy_temperature(cfg.temperature)),
                    support: support.as_ref(),
                    top_k: 0,
                    top_below: None,
                };
                response_backward(
                    model,
                    &rows.prompts[start..end],
                    &rows.responses[start..end],
                    cfg.temperature,
                    reads,
                    cfg.gradient_checkpointing,
                    cfg.logprob_chunk,
                    cfg.packing,
                    micro_loss,
                )?;
            }
            Ok(())
        })?;
        let [loss, clip_fraction, kl, entropy, weight_mean, masked, gkd] = stats;
        Ok(PassFigures {
            gkd,
            loss,
            clip_fraction,
            kl,
            entropy,
            weight_mean,
            masked,
            grad_norm,
            bounds,
        })
    }
}

/// What an optimizer step measured, or their mean over a pass's
/// mini-batches: the loss, the clip fraction, the KL to the reference, the
/// entropy, the mean importance weight and the fraction it masked, the
/// gradient norm, and the importance weights' bounds on this rank.
#[derive(Clone, Copy, Debug, Default)]
struct PassFigures {
    gkd: f64,
    loss: f64,
    clip_fraction: f64,
    kl: f64,
    entropy: f64,
    weight_mean: f64,
    masked: f64,
    grad_norm: f64,
    bounds: Option<(f64, f64)>,
}

impl PassFigures {
    /// Adds one of `minis` mini-batches' figures to the pass's mean.
    fn add(&mut self, step: &PassFigures, minis: usize) {
        let m = minis as f64;
        self.gkd += step.gkd / m;
        self.loss += step.loss / m;
        self.clip_fraction += step.clip_fraction / m;
        self.kl += step.kl / m;
        self.entropy += step.entropy / m;
        self.weight_mean += step.weight_mean / m;
        self.masked += step.masked / m;
        self.grad_norm += step.grad_norm / m;
        self.bounds = widen(self.bounds, step.bounds);
    }
}

/// The hull of two optional ranges.
fn widen(a: Option<(f64, f64)>, b: Option<(f64, f64)>) -> Option<(f64, f64)> {
    match (a, b) {
        (None, b) => b,
        (a, None) => a,
        (Some((l, h)), Some((m, k))) => Some((l.min(m), h.max(k))),
    }
}

/// One micro-batch's rows and what its loss is normalised by.
struct MicroBatch<'a> {
    cfg: &'a LearnerConfig,
    rows: &'a LearnRows,
    range: (usize, usize),
    /// Its proximal log-probs (`None`: the training forward's, detached).
    old: Option<&'a Tensor>,
    scale: &'a StepScale,
    device: tch::Device,
}

impl MicroBatch<'_> {
    /// The micro-batch's share of the step's loss from its training forward
    /// `fwd`: the policy loss, the KL to the reference (GRPO's β · KL) and
    /// the entropy bonus. Adds its figures to `stats` (loss, clip fraction,
    /// KL, entropy, mean importance weight, masked fraction: each a share
    /// of the step's) and widens the importance weights' `bounds`.
    fn loss(
        &self,
        fwd: ResponseForward,
        stats: &mut [f64],
        bounds: &mut Option<(f64, f64)>,
    ) -> Tensor {
        let (cfg, scale, (start, end)) = (self.cfg, self.scale, self.range);
        let total_tokens = scale.tokens.max(1.0);
        let lp = fwd.logprobs;
        let width = lp.size()[1] as usize;
        // Real tokens the model generated: an episode's observation and
        // boundary tokens are in the forward pass but in no loss or count.
        let mask = fwd.mask * padded(&self.rows.generated[start..end], width, self.device);
        let old = self.old.map_or_else(|| lp.detach(), Tensor::shallow_clone);
        let adv = padded(&self.rows.advantages[start..end], width, self.device);
        let behaviour = padded(&self.rows.behaviour[start..end], width, self.device);
        let (agg, flavor) = (cfg.policy.aggregation, cfg.policy.flavor);
        let side = flavor.term_aggregation(agg);
        let out = policy_loss_in_step(&lp, &old, &adv, &mask, Some(&behaviour), &cfg.policy, scale);
        let mut loss = out.loss.shallow_clone();
        let share = mask.sum(Kind::Double).double_value(&[]) / total_tokens;
        if let Some(refs) = &self.rows.references {
            // KL to the reference as a loss term (GRPO's β · KL).
            let ref_t = padded(&refs[start..end], width, self.device);
            let mut kl = kl_tensor(&lp, &ref_t, cfg.kl_estimator, flavor);
            if cfg.kl_unbiased_gradient {
                kl = kl_unbiased_gradient(&kl, &lp, &ref_t, &old);
            }
            stats[2] += (kl.detach() * &mask).sum(Kind::Double).double_value(&[]) / total_tokens;
            loss += aggregate_in_step(&kl, &mask, side, flavor, scale) * cfg.kl_coef;
        }
        if let (Some(gkd), Some(student), Some(top)) = (cfg.gkd, &fwd.support, &self.rows.top) {
            // Distillation over the teacher's top k (GKD's divergence).
            let k = gkd.k as i64;
            let teacher = padded(&top.logprobs[start..end], width * gkd.k, self.device).view([
                -1,
                width as i64,
                k,
            ]);
            let d = topk_divergence(student, &teacher, gkd.beta, gkd.tail);
            stats[6] += (d.detach() * &mask).sum(Kind::Double).double_value(&[]) / total_tokens;
            loss += aggregate_in_step(&d, &mask, side, flavor, scale) * gkd.coef;
        }
        if let Some(entropy) = &fwd.entropy {
            if cfg.entropy_coef != 0.0 {
                let bonus = aggregate_in_step(entropy, &mask, side, flavor, scale);
                loss -= bonus * cfg.entropy_coef;
            }
            stats[3] += (entropy.detach() * &mask)
                .sum(Kind::Double)
                .double_value(&[])
                / total_tokens;
        }
        stats[0] += loss.double_value(&[]);
        stats[1] += out.clip_fraction * share;
        if cfg.policy.corrects() {
            let w = out.weight_stats;
            stats[4] += w.mean * share;
            stats[5] += w.masked * share;
            *bounds = widen(*bounds, Some((w.min, w.max)));
        }
        loss
    }
}

impl StepStage for Learner {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let mut out = Vec::new();
        // From a row's start (its generation) to its training, on average.
        let latency = rows.as_ref().and_then(row_latency_s);
        // A data-parallel rank without rows still joins the ranks' sums.
        if self.core.runs(rows.is_some()) {
            self.update_rows(rows.as_ref(), ctx.stage())
                .map_err(|e| OperatorError::step(ctx.step, e))?;
            if let Some(batch) = rows {
                out.push(batch);
            }
        }
        let leads = self.core.leads();
        if leads && (!out.is_empty() || self.core.member().is_some()) {
            let u = self.last;
            tracing::info!(
                step = ctx.step,
                loss = u.loss,
                grad_norm = u.grad_norm,
                clip_fraction = u.clip_fraction,
                entropy = u.entropy,
                "policy update"
            );
            for (name, value) in self.update_metrics() {
                ctx.record(name, value);
            }
            if let Some(latency) = latency {
                ctx.record("row_latency_s", latency);
            }
        }
        if leads || self.core.member().is_some() {
            // Each rank's own: its share, with the optimizer sharded over the ranks.
            let state = self.core.optimizer().state_bytes();
            ctx.record("optimizer_state_bytes", state as f64);
        }
        if leads {
            // Published even when no rows reached this learner: the generators
            // wait for each version.
            let snapshot = self.core.model().export_snapshot(ctx.version + 1)?;
            // What the weights edge carries (a LoRA actor's: its adapters only).
            ctx.record("weights_bytes", snapshot.len() as f64);
            ctx.publish_weights(WeightsPayload::from(snapshot))?;
        }
        // Every rank: a sharded optimizer's ranks hand their state to rank 0.
        self.core.save_if_due(ctx.step, ctx.version + 1)?;
        Ok(out)
    }
}

#[cfg(test)]
#[path = "learner_tests.rs"]
mod tests;
