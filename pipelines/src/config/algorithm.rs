//! `[algorithm]`: the loss, the optimizer and the estimators' settings: the
//! section, its defaults, its rows of the key table and its checks.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::validate::bad;
use super::{
    Aggregation, ConfigError, CorrectionChoice, DistillTask, Flavor, GkdTail, KlEstimator,
    PolicyLossChoice, PreferenceChoice, ScheduleChoice,
};
use crate::PipelineKind;

/// `[algorithm]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// Peak learning rate.
    pub lr: f64,
    /// The weight of distillation's per-token term in the advantage.
    pub distill_coef: f64,
    /// The task advantage distillation adds its term to.
    pub distill_task: DistillTask,
    /// GKD's β of the top-k distillation term.
    pub gkd_beta: f64,
    /// The weight of the top-k distillation term in the loss.
    pub gkd_coef: f64,
    /// The mass outside the teacher's top k.
    pub gkd_tail: GkdTail,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// `constant` or `cosine`.
    pub schedule: ScheduleChoice,
    /// The cosine floor as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// AdamW weight decay.
    pub weight_decay: f64,
    /// Gradient-norm clip (0: off).
    pub max_grad_norm: f64,
    /// Rows per forward/backward pass.
    pub micro_batch: usize,
    /// Padded tokens per forward/backward pass of the actor's learner, rows sorted by length (0: off).
    pub micro_batch_tokens: usize,
    /// Recompute layer activations in the backward pass (actor learner, SFT).
    pub gradient_checkpointing: bool,
    /// Run a micro-batch's rows end to end as one sequence (actor learner).
    pub packing: bool,
    /// Response positions the output head runs on at a time in log-prob passes (0: all at once).
    pub logprob_chunk: usize,
    /// Optimizer passes over each step's rows.
    pub ppo_epochs: usize,
    /// Optimizer steps per pass (the step's rows in this many mini-batches).
    pub mini_batches: usize,
    /// ε_low of the clipped ratio.
    pub clip_low: f64,
    /// ε_high (> clip_low: DAPO's clip-higher).
    pub clip_high: f64,
    /// Dual-clip c for negative advantages (0: off).
    pub dual_clip: f64,
    /// β of the KL to the reference (in the loss for group estimators, in the reward for ppo / reinforce_pp).
    pub kl_coef: f64,
    /// `k1`, `k2` (`mse`), `k3`, `abs`, `k1+`, `k3+`.
    pub kl_estimator: KlEstimator,
    /// The KL the adaptive controller steers the in-reward coefficient
    /// towards (0: `kl_coef` stays fixed).
    pub kl_target: f64,
    /// Responses over which the adaptive controller spreads a full adjustment.
    pub kl_horizon: f64,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// `token-mean`, `seq-mean-token-mean`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`, `token-sum`.
    pub aggregation: Aggregation,
    /// T of `seq-mean-token-sum-norm` (0: `generate.max_new_tokens`, the padded response length).
    pub loss_scale_factor: f64,
    /// `ppo`, `gspo`, `cispo`, `sapo`, `gmpo`, `gpg`, `reinforce`, `clip_cov`, `kl_cov`.
    pub policy_loss: PolicyLossChoice,
    /// SAPO's τ for positive advantages.
    pub sapo_tau_pos: f64,
    /// SAPO's τ for other advantages.
    pub sapo_tau_neg: f64,
    /// Clip-Cov: the fraction of tokens whose gradient is cut.
    pub clip_cov_ratio: f64,
    /// Clip-Cov: the covariance's lower bound.
    pub clip_cov_lb: f64,
    /// Clip-Cov: the covariance's upper bound.
    pub clip_cov_ub: f64,
    /// KL-Cov: the fraction of tokens penalised.
    pub kl_cov_ratio: f64,
    /// KL-Cov: the penalty's coefficient.
    pub kl_cov_coef: f64,
    /// REINFORCE: the cap of its importance ratio to the behaviour policy.
    pub reinforce_is_cap: f64,
    /// DRO: β of the quadratic log-ratio penalty.
    pub dro_beta: f64,
    /// GDPO: each reward term normalised within its group on its own.
    pub gdpo: bool,
    /// `openrlhf` or `verl` semantics where they differ.
    pub flavor: Flavor,
    /// Discount γ (ppo's GAE, reinforce_pp's returns).
    pub gamma: f64,
    /// GAE's λ (ppo).
    pub lambda: f64,
    /// The critic's learning rate (ppo).
    pub critic_lr: f64,
    /// Value clipping (ppo; 0: off).
    pub value_clip: f64,
    /// β of the preference losses (dpo).
    pub beta: f64,
    /// `dpo`, `cdpo` or `ipo` (dpo).
    pub preference_loss: PreferenceChoice,
    /// ε of cDPO: the probability a preference label is flipped.
    pub label_smoothing: f64,
    /// Off-policy correction of stale rows (`CorrectionChoice`).
    pub correction: CorrectionChoice,
    /// The correction's lower bound on the importance ratio.
    pub correction_low: f64,
    /// The correction's upper bound.
    pub correction_high: f64,
    /// Divide the correction's weights by their mean over the step.
    pub correction_batch_normalize: bool,
    /// verl's rejection criteria, comma-separated (`token_k1,seq_max_k2`; none: off).
    #[serde(with = "none_if_empty")]
    pub rejection: Option<String>,
    /// Their thresholds, one shared or one per criterion (`0.5_2.0,0.01`).
    pub rejection_threshold: String,
    /// The KL loss term's gradient as OpenRLHF's `unbiased_gradient`.
    pub kl_unbiased_gradient: bool,
}

impl Default for AlgorithmSection {
    fn default() -> Self {
        AlgorithmSection {
            lr: 1e-4,
            distill_coef: 1.0,
            distill_task: DistillTask::None,
            gkd_beta: 0.5,
            gkd_coef: 1.0,
            gkd_tail: GkdTail::Add,
            warmup_steps: 0,
            schedule: ScheduleChoice::Constant,
            min_lr_ratio: 0.1,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            micro_batch: 64,
            micro_batch_tokens: 0,
            gradient_checkpointing: false,
            packing: false,
            logprob_chunk: 1024,
            ppo_epochs: 1,
            mini_batches: 1,
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: 0.0,
            kl_coef: 0.04,
            kl_estimator: KlEstimator::K3,
            kl_target: 0.0,
            kl_horizon: 10_000.0,
            entropy_coef: 0.0,
            aggregation: Aggregation::TokenMean,
            loss_scale_factor: 0.0,
            policy_loss: PolicyLossChoice::Ppo,
            sapo_tau_pos: 1.0,
            sapo_tau_neg: 1.05,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            kl_cov_coef: 0.1,
            reinforce_is_cap: 2.0,
            dro_beta: 0.05,
            gdpo: false,
            flavor: Flavor::OpenRlhf,
            gamma: 1.0,
            lambda: 1.0,
            critic_lr: 5e-5,
            value_clip: 0.5,
            beta: 0.1,
            preference_loss: PreferenceChoice::Dpo,
            label_smoothing: 0.0,
            correction: CorrectionChoice::None,
            correction_low: 0.0,
            correction_high: 2.0,
            correction_batch_normalize: false,
            rejection: None,
            rejection_threshold: "2.0".into(),
            kl_unbiased_gradient: false,
        }
    }
}

/// `[algorithm]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("algorithm", "distill_coef", Distill, "The weight of on-policy distillation's per-token term in the advantage: coef · (log π_teacher − log π_student) of each sampled token (the student's behaviour log-prob), whose policy gradient lowers the reverse KL to the teacher on the student's samples; added to the task's advantage when algorithm.distill_task names one."),
    key("algorithm", "gkd_beta", Distill, "GKD's β of the top-k term (teacher.top_k > 0): 0 the forward KL(teacher ‖ student), 1 the reverse KL(student ‖ teacher), between them the generalized Jensen–Shannon divergence β·KL(teacher ‖ M) + (1 − β)·KL(student ‖ M), M = β·teacher + (1 − β)·student (TRL's GKDTrainer's beta)."),
    key("algorithm", "gkd_coef", Distill, "The weight of the top-k distillation term in the loss (teacher.top_k > 0), aggregated over generated tokens as the KL term is."),
    key("algorithm", "gkd_tail", Distill, "The probability mass outside the teacher's top k: \"add\" (one more outcome, any other token, on both sides: a proper divergence, never negative) or \"drop\" (sums over the k tokens only; with gkd_beta = 0 verl 0.9's forward_kl_topk). Either way each position's value is clamped at 0."),
    key("algorithm", "distill_task", Distill, "The task advantage distillation adds its term to: \"none\" (the term alone; the rewards are still computed and logged), \"grpo\", \"dr_grpo\" or \"rloo\" (that group estimator's advantage of the reward)."),
    key("algorithm", "lr", All, "Peak learning rate. The defaults suit small models (the demo's); real checkpoints train at about 1e-6 (RL) or 1e-5 (SFT), and a run warns when a default meets a checkpoint past 50M weights."),
    key("algorithm", "warmup_steps", All, "Linear warm-up steps."),
    key("algorithm", "schedule", All, "\"constant\" or \"cosine\" (decays to min_lr_ratio · lr at the last step)."),
    key("algorithm", "min_lr_ratio", All, "The cosine floor as a fraction of lr."),
    key("algorithm", "weight_decay", All, "AdamW weight decay."),
    key("algorithm", "max_grad_norm", All, "Gradient-norm clip (0: off)."),
    key("algorithm", "micro_batch", RlAndSft, "Rows per forward/backward pass (gradients accumulate over a step)."),
    key("algorithm", "micro_batch_tokens", Rl, "A token budget per forward/backward pass of the actor's learner: a mini-batch's rows are sorted by length and cut into micro-batches of at most micro_batch rows whose padded size (rows × longest prompt + response) stays within it, so long-tailed responses cost their own tokens rather than the longest row's width (verl's use_dynamic_bsz; 0: off, rows in order)."),
    key("algorithm", "logprob_chunk", RlAndSft, "Response positions the output head runs on at a time in the log-prob passes (learner, reference, SFT) when a micro-batch holds more: at most this many × vocabulary logits exist at once, forward and backward (the gradient through the head is computed chunk by chunk); the same values and gradients. 0: all positions at once."),
    key("algorithm", "packing", Rl, "Run each micro-batch of the actor's learner (and its proximal pass), each batch of the reference (where it runs on libtorch: weir's CPU kernels never pad) and each of the critic's passes as one sequence without padding (verl's remove-padding, OpenRLHF's packing_samples): rows end to end, attention within each row (rows of similar lengths share one attention call), a prompt that rows of the micro-batch share (a group's) packed once and attended to by each of their responses, the output head run at the real response positions only; with algorithm.micro_batch_tokens a micro-batch holds rows up to that many tokens in all (a longer row is an error naming the key). The same log-probs, values, losses and gradients."),
    key("algorithm", "gradient_checkpointing", RlAndSft, "Keep one hidden state per layer and recompute the rest in the backward pass (actor learner and SFT): less memory, one more forward pass, the same gradients."),
    key("algorithm", "ppo_epochs", Rl, "Optimizer passes over each step's rows."),
    key("algorithm", "mini_batches", Rl, "Optimizer steps per pass over a step's rows: the rows split into this many mini-batches, each normalised over its own rows (verl's ppo_mini_batch_size = rows / mini_batches); the critic takes the same ones."),
    key("algorithm", "clip_low", Rl, "ε_low: the ratio is clipped below at 1 − ε_low (dppo_tv / dppo_kl: the divergence a token with A ≤ 0 may move by)."),
    key("algorithm", "clip_high", Rl, "ε_high: clipped above at 1 + ε_high (> clip_low: DAPO's clip-higher; dppo_tv / dppo_kl: the divergence a token with A > 0 may move by)."),
    key("algorithm", "dual_clip", Rl, "Dual-clip c > 1 for negative advantages (0: off; under flavor = \"verl\", verl's c = 3, which verl always applies; dppo_tv / dppo_kl: the cap of the truncated ratio, verl's clip_ratio_c, default 3 under flavor = \"verl\", else 20)."),
    key("algorithm", "kl_coef", Rl, "β of the KL to the reference: in the loss for grpo / dr_grpo / rloo, in the reward for ppo / reinforce_pp* / remax, measured there on the generator's log-probs (those of the distribution it sampled from: with generate.top_p < 1 or top_k, the truncated one's, as verl's rollout log-probs in bypass mode); 0 drops the reference."),
    key("algorithm", "kl_target", InRewardKl, "ppo / reinforce_pp*: the KL the adaptive controller steers kl_coef towards after each step, β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (0: fixed)."),
    key("algorithm", "kl_horizon", InRewardKl, "Responses over which the adaptive KL controller spreads a full adjustment."),
    key("algorithm", "kl_unbiased_gradient", Group, "OpenRLHF 0.11's unbiased_gradient for the KL loss term: the estimator's value, but the gradient of w·½(log π − log π_ref)² with w = min(π/π_old, 10) held constant — the importance-weighted reverse-KL gradient, the same for every estimator."),
    key("algorithm", "kl_estimator", Rl, "The KL estimator (verl's names): \"k1\" (log-ratio), \"k2\" or \"mse\" (half its square), \"k3\" (Schulman's unbiased, non-negative one), \"abs\"; with the KL in the loss also \"k1+\" and \"k3+\" (the value of k1 / k3, the gradient of k2). Default \"k3\" with the KL in the loss (grpo and the other group pipelines, as TRL and OpenRLHF's GRPO recipes), \"k1\" with it in the reward (ppo, reinforce_pp*, remax, as OpenRLHF and verl default: only k1's expectation under the policy has the KL's gradient there)."),
    key("algorithm", "entropy_coef", Rl, "Entropy bonus coefficient."),
    key("algorithm", "aggregation", Rl, "How the per-token loss becomes a scalar, normalised over the whole step (all micro-batches and data-parallel ranks): \"token-mean\" (Σ loss / tokens), \"seq-mean-token-mean\" (mean over responses of each one's token mean), \"seq-mean-token-sum\" (mean over responses of each one's token sum), \"seq-mean-token-sum-norm\" (Dr.GRPO: Σ loss / (responses · loss_scale_factor)) or \"token-sum\"."),
    key("algorithm", "loss_scale_factor", Rl, "T of \"seq-mean-token-sum-norm\": a constant replicates Dr.GRPO exactly (0: generate.max_new_tokens, the padded response length)."),
    key("algorithm", "policy_loss", Rl, "The policy objective: \"ppo\" (a clipped ratio per token), \"gspo\" (one ratio per response), \"cispo\" (the clipped ratio, without gradient, weights every token's −A·log π), \"sapo\" (a smooth sigmoid gate instead of the clip), \"gmpo\" (the geometric mean of the sign-clipped token ratios; averages per response), \"gpg\" (−A·log π), \"reinforce\" (−A·log π weighted by the truncated ratio π / π_behaviour, without gradient), \"clip_cov\" / \"kl_cov\" (PPO, or −A·r, with the gradient cut or a KL penalty on the few highest-covariance tokens), \"dppo_tv\" / \"dppo_kl\" (DPPO: −A·log π weighted by the truncated ratio without gradient, each token dropped once its probability has moved further than clip_low / clip_high in total variation or binary KL, in its advantage's direction), \"dro\" (−A·log π + ½β(log π − log π_old)², β = dro_beta). gspo and sapo need aggregation = \"seq-mean-token-mean\", as verl has them."),
    key("algorithm", "sapo_tau_pos", Rl, "SAPO's gate temperature τ for positive advantages."),
    key("algorithm", "sapo_tau_neg", Rl, "SAPO's gate temperature τ for other advantages."),
    key("algorithm", "clip_cov_ratio", Rl, "Clip-Cov: the fraction of tokens whose gradient is cut."),
    key("algorithm", "clip_cov_lb", Rl, "Clip-Cov: tokens qualify with a covariance (A − Ā)(log π − mean log π) above this bound…"),
    key("algorithm", "clip_cov_ub", Rl, "… and below this one."),
    key("algorithm", "kl_cov_ratio", Rl, "KL-Cov: the fraction of tokens (those of largest covariance) given the KL penalty."),
    key("algorithm", "kl_cov_coef", Rl, "KL-Cov: the penalty's coefficient on |log π − log π_old|."),
    key("algorithm", "dro_beta", Rl, "DRO: β of the quadratic penalty ½β(log π − log π_old)² (verl's policy_loss.dro_beta, which has no default; 0.05 is the value of verl's own test)."),
    key("algorithm", "gdpo", GrpoFamily, "GDPO (verl 0.9's gdpo estimator): each [[reward.terms]] term's own score normalised within its group on its own (grpo: by the std; dr_grpo: centred), summed with the terms' weights (an episode's environment rewards one more term of weight 1), then whitened over the whole step's generated tokens, under verl's semantics whatever algorithm.flavor: a term with a small spread is not drowned by a large one. Needs reward.kind = \"terms\"; the reward shaping keys (overlong, stop-properly, on_finish), which change only the summed reward, are refused."),
    key("algorithm", "reinforce_is_cap", Rl, "REINFORCE: its importance ratio π / π_behaviour is truncated at this value (verl's rollout_is_threshold)."),
    key("algorithm", "flavor", Rl, "\"openrlhf\" or \"verl\": whose semantics where the two differ (KL clamping, GAE and REINFORCE++ returns over masked tokens, whitening, GSPO's gradient, group edge cases, the score clip, the dual clip, how the critic's loss and the KL and entropy terms aggregate, the entropy's temperature)."),
    key("algorithm", "gamma", Returns, "Discount γ of ppo's GAE and reinforce_pp's returns."),
    key("algorithm", "lambda", Ppo, "λ of ppo's GAE."),
    key("algorithm", "critic_lr", Ppo, "The critic's learning rate (ppo), on the same schedule as the actor's (warm-up, decay)."),
    key("algorithm", "value_clip", Ppo, "Value clipping (ppo; 0: off)."),
    key("algorithm", "beta", Dpo, "β of the preference losses (dpo): the implicit reward is β · (log π − log π_ref)."),
    key("algorithm", "preference_loss", Dpo, "\"dpo\", \"cdpo\" (with label_smoothing) or \"ipo\"."),
    key("algorithm", "label_smoothing", Dpo, "ε of cDPO: the probability that a preference label is flipped."),
    key("algorithm", "correction", Rl, "Off-policy correction for stale rows, with ρ = π_old / π_behaviour per token: \"none\", \"tis\" (weight clamp(ρ)), \"icepop\" (weight ρ, 0 outside the bounds), \"seq-mask\" (weight ρ, responses whose geometric-mean ρ is outside dropped), \"seq-tis\" (each response weighted by its whole ratio Πρ, clamped), \"seq-icepop\" (each response weighted by Πρ, dropped where Πρ is outside the bounds: verl's sequence-level IcePop), \"geo-rejection\" (verl's seq_mean_k1: responses whose mean K1, −mean log ρ, is outside [ln correction_low, ln correction_high] dropped, the rest weight 1; on the geometric-mean ρ that band is [1/correction_high, 1/correction_low]), \"k3-rejection\" (responses whose mean K3 of ρ exceeds correction_high dropped), \"binary-kl\" / \"tv\" (OpenRLHF's divergence gates: with p, q the sampled token's behaviour and proximal probabilities, tokens whose binary KL p ln(p/q) + (1−p) ln((1−p)/(1−q)), or |p − q|, exceeds correction_high weigh 0, the rest ρ), \"seq-binary-kl\" / \"seq-tv\" (the same gate on each response's mean: FlashREINFORCE's trust region). Recorded as is_weight_mean/min/max and is_masked_fraction."),
    key("algorithm", "correction_low", Rl, "The correction's lower bound on ρ."),
    key("algorithm", "correction_high", Rl, "The correction's upper bound on ρ (on the divergence, for the gates)."),
    key("algorithm", "correction_batch_normalize", Rl, "Divide the correction's weights by their mean over the step's valid tokens (per response for seq-tis and seq-icepop) on every rank, as verl's rollout_is_batch_normalize (tis, icepop, seq-tis, seq-icepop); the learner's proximal pass then always runs, and the mean is recorded as is_weight_normalizer."),
    key("algorithm", "rejection", Rl, "verl 0.9's rejection sampling (rollout_rs), criteria joined by commas, every one of which a token must pass (with or without a correction; empty: off): \"token_k1\" (−log ρ in [ln low, ln high]), \"token_k2\" (½(log ρ)² ≤ high), \"token_k3\" (ρ − 1 − log ρ ≤ high), \"seq_sum_k1\" … \"seq_sum_k3\" (a response's sum), \"seq_mean_k1\" … \"seq_mean_k3\" (its mean), \"seq_max_k2\", \"seq_max_k3\" (its largest token); log ρ clamped to ±20."),
    key("algorithm", "rejection_threshold", Rl, "The rejection criteria's thresholds, verl's spelling: one shared by all or one per criterion, joined by commas; a K1 criterion takes \"low_high\" (bounds on ρ) or \"high\" (low = 1/high), the others one upper bound, e.g. \"0.5_2.0,0.01\" (default \"2.0\": K1 within [0.5, 2], K2 and K3 at most 2)."),
];

impl AlgorithmSection {
    /// GKD's top-k term: β in [0, 1], a finite weight (the caller checks
    /// them for distill only, once `[teacher]` passes).
    pub(super) fn check_gkd(&self) -> Result<(), ConfigError> {
        let a = self;
        if !(0.0..=1.0).contains(&a.gkd_beta) {
            return bad(
                "algorithm.gkd_beta",
                a.gkd_beta.to_string(),
                "GKD's β lies in [0, 1] (0 the forward KL, 1 the reverse KL)",
            );
        }
        if !a.gkd_coef.is_finite() {
            return bad(
                "algorithm.gkd_coef",
                a.gkd_coef.to_string(),
                "must be a finite number",
            );
        }
        Ok(())
    }

    /// `[algorithm]`: the policy loss, its objective and corrections.
    pub(super) fn check_policy_loss(&self) -> Result<(), ConfigError> {
        let a = self;
        if !(a.lr > 0.0 && a.lr.is_finite()) {
            return bad(
                "algorithm.lr",
                a.lr.to_string(),
                "must be a positive number",
            );
        }
        if !(a.loss_scale_factor >= 0.0 && a.loss_scale_factor.is_finite()) {
            return bad(
                "algorithm.loss_scale_factor",
                a.loss_scale_factor.to_string(),
                "must be ≥ 0 (0: generate.max_new_tokens)",
            );
        }
        if matches!(
            a.policy_loss,
            PolicyLossChoice::Gspo | PolicyLossChoice::Sapo
        ) && a.aggregation != Aggregation::SeqMeanTokenMean
        {
            return bad(
                "algorithm.aggregation",
                format!("{:?}", a.aggregation),
                &format!(
                    "algorithm.policy_loss = {:?} averages per response, as verl has it: set \"seq-mean-token-mean\"",
                    a.policy_loss
                ),
            );
        }
        for (key, value) in [
            ("algorithm.sapo_tau_pos", a.sapo_tau_pos),
            ("algorithm.sapo_tau_neg", a.sapo_tau_neg),
            ("algorithm.clip_cov_ratio", a.clip_cov_ratio),
            ("algorithm.kl_cov_ratio", a.kl_cov_ratio),
            ("algorithm.reinforce_is_cap", a.reinforce_is_cap),
            ("algorithm.dro_beta", a.dro_beta),
        ] {
            if !(value > 0.0 && value.is_finite()) {
                return bad(key, value.to_string(), "must be > 0");
            }
        }
        if a.policy_loss == PolicyLossChoice::Reinforce && a.correction != CorrectionChoice::None {
            return bad(
                "algorithm.correction",
                format!("{:?}", a.correction),
                "algorithm.policy_loss = \"reinforce\" carries its own importance ratio (algorithm.reinforce_is_cap): set correction = \"none\"",
            );
        }
        if a.clip_cov_lb >= a.clip_cov_ub {
            return bad(
                "algorithm.clip_cov_lb",
                a.clip_cov_lb.to_string(),
                &format!("must be below algorithm.clip_cov_ub = {}", a.clip_cov_ub),
            );
        }
        for (key, value) in [("algorithm.gamma", a.gamma), ("algorithm.lambda", a.lambda)] {
            if !(0.0..=1.0).contains(&value) {
                return bad(key, value.to_string(), "must be in [0, 1]");
            }
        }
        if let Some(options) = &a.rejection {
            let thresholds = a.rejection_threshold.as_str();
            if let Err(why) = weir_operators::algorithms::RejectionChain::parse(options, thresholds)
            {
                let key =
                    if why.contains("threshold") || why.contains("number") || why.contains("bound")
                    {
                        "algorithm.rejection_threshold"
                    } else {
                        "algorithm.rejection"
                    };
                let value = if key == "algorithm.rejection" {
                    options
                } else {
                    thresholds
                };
                return bad(key, format!("{value:?}"), &why);
            }
        }
        if a.correction != CorrectionChoice::None
            && !(a.correction_low >= 0.0 && a.correction_low <= a.correction_high)
        {
            return bad(
                "algorithm.correction_low",
                a.correction_low.to_string(),
                &format!(
                    "must be in [0, algorithm.correction_high = {}]",
                    a.correction_high
                ),
            );
        }
        Ok(())
    }

    /// Rows per pass and passes: at least 1.
    pub(super) fn check_passes(&self) -> Result<(), ConfigError> {
        let a = self;
        if a.micro_batch == 0 {
            return bad("algorithm.micro_batch", "0".into(), "must be at least 1");
        }
        if a.ppo_epochs == 0 {
            return bad("algorithm.ppo_epochs", "0".into(), "must be at least 1");
        }
        Ok(())
    }

    /// The updates: clipping, the KL, the preference losses.
    pub(super) fn check_updates(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let a = self;
        if a.clip_low < 0.0 || a.clip_low >= 1.0 {
            return bad(
                "algorithm.clip_low",
                a.clip_low.to_string(),
                "must be in [0, 1)",
            );
        }
        if a.clip_high < 0.0 {
            return bad(
                "algorithm.clip_high",
                a.clip_high.to_string(),
                "must be ≥ 0",
            );
        }
        if a.dual_clip != 0.0 && a.dual_clip <= 1.0 {
            return bad(
                "algorithm.dual_clip",
                a.dual_clip.to_string(),
                "must be > 1 (or 0: off)",
            );
        }
        if a.kl_coef < 0.0 {
            return bad("algorithm.kl_coef", a.kl_coef.to_string(), "must be ≥ 0");
        }
        if !(a.kl_target >= 0.0 && a.kl_target.is_finite()) {
            return bad(
                "algorithm.kl_target",
                a.kl_target.to_string(),
                "must be ≥ 0",
            );
        }
        if !(a.kl_horizon > 0.0 && a.kl_horizon.is_finite()) {
            return bad(
                "algorithm.kl_horizon",
                a.kl_horizon.to_string(),
                "must be > 0",
            );
        }
        if a.beta.is_nan() || a.beta <= 0.0 {
            return bad("algorithm.beta", a.beta.to_string(), "must be > 0");
        }
        if matches!(a.kl_estimator, KlEstimator::K1Plus | KlEstimator::K3Plus)
            && !pipeline.is_group()
        {
            return bad(
                "algorithm.kl_estimator",
                format!("{:?}", a.kl_estimator),
                "a straight-through estimator differs from its plain one only in its gradient: it needs the KL in the loss (grpo, dr_grpo, rloo), not in the reward",
            );
        }
        if a.preference_loss == PreferenceChoice::Cdpo && a.label_smoothing == 0.0 {
            return bad(
                "algorithm.preference_loss",
                "\"cdpo\"".into(),
                "with algorithm.label_smoothing = 0, cDPO is DPO: set label_smoothing in (0, 0.5)",
            );
        }
        if !(0.0..0.5).contains(&a.label_smoothing) {
            return bad(
                "algorithm.label_smoothing",
                a.label_smoothing.to_string(),
                "must be in [0, 0.5)",
            );
        }
        Ok(())
    }
}
