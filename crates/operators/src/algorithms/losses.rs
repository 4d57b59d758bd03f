//! Policy and value losses on tch tensors `[B, T]` (one row per response,
//! `mask` 1.0 on the tokens that count), aggregated over the step
//! ([`super::aggregation`]) and weighted by the off-policy corrections for
//! stale samples ([`super::corrections`]).

use tch::{Kind, Tensor};

pub use super::aggregation::{aggregate, aggregate_in_step, Aggregation, StepScale};
use super::aggregation::{masked_mean, sum_kind};
pub use super::corrections::{
    correction_weights, importance_weights, ImportanceCorrection, WeightStats,
};
pub use super::objectives::PolicyObjective;
use super::objectives::{objective_loss, ObjectiveLoss};
use super::Flavor;
use super::RejectionChain;

/// The ratio's granularity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RatioLevel {
    /// PPO: a ratio per token, `exp(clamp(log π − log π_old, −20, 20))`.
    #[default]
    Token,
    /// GSPO (arXiv 2507.18071): one ratio per response,
    /// `s_i = exp(Σ_t m (log π − log π_old) / max(Σ_t m, 1))`.
    /// - OpenRLHF (`PolicyLoss`, `policy_loss_type = "gspo"`): `s_i` itself,
    ///   differentiated through the mean, so each token's gradient spreads
    ///   over the whole response; unclamped.
    /// - verl (`compute_policy_loss_gspo`): the straight-through token ratio
    ///   `s_i,t = sg[s_i] · π(y_t) / sg[π(y_t)]`, the exponent clamped to at
    ///   most 10: the value is `s_i`, and `∂s_i,t / ∂log π_t = s_i`, so an
    ///   unclipped token's gradient is its own advantage's.
    ///
    /// The two agree when the advantage is constant within a response (GRPO).
    /// Both anchors aggregate GSPO with `seq-mean-token-mean`.
    Sequence,
}

/// Settings of the clipped policy loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyLossConfig {
    /// ε_low: the ratio is clipped below at 1 − ε_low.
    pub clip_low: f64,
    /// ε_high: clipped above at 1 + ε_high (> ε_low is DAPO's clip-higher).
    pub clip_high: f64,
    /// Dual clip c > 1: for negative advantages the loss is at most −c·A.
    /// OpenRLHF: off unless asked; verl: always on with c = 3 for token
    /// ratios, never applied to sequence (GSPO) ratios.
    pub dual_clip: Option<f64>,
    /// Token (PPO) or sequence (GSPO) ratios.
    pub ratio_level: RatioLevel,
    /// How the loss matrix is reduced.
    pub aggregation: Aggregation,
    /// Off-policy correction, if any.
    pub correction: Option<ImportanceCorrection>,
    /// Rejection criteria every token must pass besides (verl's
    /// `rollout_rs`; empty: none).
    pub rejection: RejectionChain,
    /// What the correction's weights are divided by: the step's mean
    /// weight under verl's batch normalisation, which the learner measures
    /// before the step's first update (1: none).
    pub weight_normalizer: f64,
    /// Whose definitions to follow where they differ.
    pub flavor: Flavor,
    /// `T` of [`Aggregation::SeqMeanTokenSumNorm`] (verl's `loss_scale_factor`;
    /// `None`: the padded response length of the step).
    pub loss_scale_factor: Option<f64>,
    /// The objective: PPO's clipped ratio (default) or another of verl's.
    pub objective: PolicyObjective,
}

impl Default for PolicyLossConfig {
    /// OpenRLHF's defaults: ε = 0.2 both sides, no dual clip, token ratios, token mean.
    fn default() -> Self {
        PolicyLossConfig {
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: None,
            ratio_level: RatioLevel::Token,
            aggregation: Aggregation::TokenMean,
            correction: None,
            rejection: RejectionChain::default(),
            weight_normalizer: 1.0,
            flavor: Flavor::OpenRlhf,
            loss_scale_factor: None,
            objective: PolicyObjective::Clipped,
        }
    }
}

impl PolicyLossConfig {
    /// The weights its correction and rejection chain put on each token
    /// ([`correction_weights`]); `None` without either, or without the
    /// behaviour log-probs they read.
    fn weights(&self, old: &Tensor, behaviour: Option<&Tensor>, mask: &Tensor) -> Option<Tensor> {
        let behaviour = behaviour?;
        correction_weights(
            self.correction,
            self.weight_normalizer,
            &self.rejection,
            old,
            behaviour,
            mask,
        )
    }

    /// Whether the loss weighs stale rows: a correction, a rejection chain, or both.
    pub fn corrects(&self) -> bool {
        self.correction.is_some() || !self.rejection.is_empty()
    }

    /// verl's defaults: ε = 0.2, dual clip c = 3, token mean.
    pub fn verl() -> Self {
        PolicyLossConfig {
            dual_clip: Flavor::Verl.default_dual_clip(),
            flavor: Flavor::Verl,
            ..Default::default()
        }
    }
}

/// The loss and what the learner logs about it.
#[derive(Debug)]
pub struct PolicyLoss {
    /// The scalar loss (differentiable in `logprobs`).
    pub loss: Tensor,
    /// Fraction of tokens where the clipped branch was taken.
    pub clip_fraction: f64,
    /// `masked_mean(log π_old − log π)`: the approximate KL to the proximal policy.
    pub approx_kl: f64,
    /// The importance weights over the valid tokens (all 1 without
    /// correction, and with OpenRLHF's GSPO, which weights none).
    pub weight_stats: WeightStats,
}

impl PolicyLoss {
    /// The loss as a number.
    pub fn loss_value(&self) -> f64 {
        self.loss.double_value(&[])
    }
}

/// The clipped surrogate policy loss.
///
/// `ratio = exp(log π − log π_old)` (per [`RatioLevel`]), `s1 = ratio·A`,
/// `s2 = clamp(ratio, 1 − ε_low, 1 + ε_high)·A`, `ℓ = −min(s1, s2)`; with a
/// dual clip c, for `A < 0`: `ℓ = −max(min(s1, s2), c·A)` (not with
/// sequence ratios in verl, whose GSPO loss has no dual clip). Then ℓ is
/// multiplied by the importance weight `w` (if a correction is set; `w` is
/// a constant to autograd, so `∂(w·ℓ) = w·∂ℓ`, as in OpenRLHF's
/// `vllm_is.detach()` and verl's `rollout_is_weights`) and aggregated under
/// `mask` as a step of its own ([`policy_loss_in_step`] takes the step's
/// scale). All inputs `[B, T]`; `behaviour_logprobs` is needed only with a
/// correction.
///
/// OpenRLHF's GSPO with a correction instead takes the sequence ratio
/// against the behaviour policy, `exp(mean_t (log π − log π_behaviour))`,
/// and applies no importance weight (the correction's kind and bounds are
/// unused). `approx_kl` is the masked mean of `log π_old − log π`, with the
/// log-ratio clamped to [−20, 20] for verl's token ratios.
pub fn policy_loss(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    behaviour_logprobs: Option<&Tensor>,
    cfg: &PolicyLossConfig,
) -> PolicyLoss {
    let scale = StepScale::of(mask, cfg.loss_scale_factor);
    policy_loss_in_step(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        behaviour_logprobs,
        cfg,
        &scale,
    )
}

/// [`policy_loss`] of one micro-batch of a step whose denominators are
/// `scale` ([`aggregate_in_step`]): the losses of a step's micro-batches
/// (and ranks) add up to the loss of the whole step.
pub fn policy_loss_in_step(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    behaviour_logprobs: Option<&Tensor>,
    cfg: &PolicyLossConfig,
    scale: &StepScale,
) -> PolicyLoss {
    let log_ratio = logprobs - old_logprobs;
    if cfg.objective != PolicyObjective::Clipped {
        return other_objective(
            logprobs,
            old_logprobs,
            &log_ratio,
            advantages,
            mask,
            behaviour_logprobs,
            cfg,
            scale,
        );
    }
    let sequence = cfg.ratio_level == RatioLevel::Sequence;
    // OpenRLHF's GSPO folds the correction into the ratio (against the behaviour policy).
    let gspo_behaviour = match (cfg.flavor, sequence, cfg.correction) {
        (Flavor::OpenRlhf, true, Some(_)) => behaviour_logprobs,
        (Flavor::OpenRlhf, false, _) | (Flavor::OpenRlhf, true, None) | (Flavor::Verl, _, _) => {
            None
        }
    };
    let ratio = match cfg.ratio_level {
        RatioLevel::Token => log_ratio.clamp(-20.0, 20.0).exp(),
        RatioLevel::Sequence => {
            let seq_log_ratio = match gspo_behaviour {
                Some(behaviour) => logprobs - behaviour,
                None => log_ratio.shallow_clone(),
            };
            let kind = sum_kind(&seq_log_ratio);
            let count = mask.sum_dim_intlist(-1, true, kind).clamp_min(1.0);
            let mean = (&seq_log_ratio * mask).sum_dim_intlist(-1, true, kind) / count;
            match cfg.flavor {
                Flavor::OpenRlhf => mean.exp() * mask,
                // Straight-through: the value of the sequence ratio, the gradient of each token's own.
                Flavor::Verl => (logprobs - logprobs.detach() + mean.detach())
                    .clamp_max(10.0)
                    .exp(),
            }
        }
    };
    let surr1 = &ratio * advantages;
    let surr2 = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages;
    let clipped = surr1.minimum(&surr2);
    let dual_clip = match (cfg.flavor, sequence) {
        (Flavor::Verl, true) => None,
        (Flavor::OpenRlhf, _) | (Flavor::Verl, false) => cfg.dual_clip,
    };
    let loss = match dual_clip {
        None => -&clipped,
        Some(c) => {
            let lower = clipped.maximum(&(advantages * c));
            -clipped.where_self(&advantages.ge(0.0), &lower)
        }
    };
    let mut weight_stats = WeightStats::default();
    // OpenRLHF's GSPO weighs its ratio itself.
    let weight = match gspo_behaviour {
        None => cfg.weights(old_logprobs, behaviour_logprobs, mask),
        Some(_) => None,
    };
    let loss = if let Some(weight) = weight {
        weight_stats = WeightStats::of(&weight, mask);
        // Outside any no-grad guard: autograd must see the product.
        loss * weight
    } else {
        loss
    };
    let clip_fraction =
        masked_mean(&surr2.lt_tensor(&surr1).to_kind(Kind::Float), mask).double_value(&[]);
    let kl_log_ratio = match (cfg.flavor, cfg.ratio_level) {
        (Flavor::Verl, RatioLevel::Token) => log_ratio.clamp(-20.0, 20.0),
        (Flavor::OpenRlhf, RatioLevel::Token | RatioLevel::Sequence)
        | (Flavor::Verl, RatioLevel::Sequence) => log_ratio,
    };
    let approx_kl = masked_mean(&(-kl_log_ratio).detach(), mask).double_value(&[]);
    PolicyLoss {
        loss: aggregate_in_step(&loss, mask, cfg.aggregation, cfg.flavor, scale),
        clip_fraction,
        approx_kl,
        weight_stats,
    }
}

/// [`policy_loss_in_step`] for the objectives of [`PolicyObjective`] other
/// than the clipped one: the objective's loss, weighted by the correction
/// (GMPO: by the geometric mean of a response's weights, as verl does) and
/// aggregated over the step (GMPO: averaged over the step's responses).
#[allow(clippy::too_many_arguments)]
fn other_objective(
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    log_ratio: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    behaviour_logprobs: Option<&Tensor>,
    cfg: &PolicyLossConfig,
    scale: &StepScale,
) -> PolicyLoss {
    let (loss, clip_fraction) = objective_loss(
        cfg.objective,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        behaviour_logprobs,
        (cfg.clip_low, cfg.clip_high),
    );
    let weight = cfg.weights(old_logprobs, behaviour_logprobs, mask);
    let weight_stats = weight
        .as_ref()
        .map_or_else(WeightStats::default, |w| WeightStats::of(w, mask));
    let loss = match loss {
        ObjectiveLoss::Tokens(loss) => {
            let loss = match &weight {
                Some(w) => loss * w,
                None => loss,
            };
            aggregate_in_step(&loss, mask, cfg.aggregation, cfg.flavor, scale)
        }
        ObjectiveLoss::Responses(loss) => {
            let loss = match &weight {
                Some(w) => {
                    let count = mask.sum_dim_intlist(-1, false, Kind::Double) + 1e-8;
                    let log_w = ((w + 1e-10).log() * mask).sum_dim_intlist(-1, false, Kind::Double);
                    loss * (log_w / count).exp()
                }
                None => loss,
            };
            let responses = if scale.sequences > 0.0 {
                scale.sequences
            } else {
                1.0
            };
            loss.sum(Kind::Double) / responses
        }
    };
    let approx_kl = masked_mean(&(-log_ratio).detach(), mask).double_value(&[]);
    PolicyLoss {
        loss,
        clip_fraction,
        approx_kl,
        weight_stats,
    }
}

/// The clipped value loss: `v_c = V_old + clamp(V − V_old, −ε, ε)`,
/// `ℓ = max((V − R)², (v_c − R)²)` (or `(V − R)²` without clipping), and
/// `0.5 ·` its aggregate — identical in OpenRLHF and verl. Returns the loss
/// and the fraction of tokens where the clipped branch was larger. verl
/// computes `v_c` as `clamp(V, V_old − ε, V_old + ε)` (exactly `V` inside
/// the range, so rounding in `V_old + (V − V_old)` cannot count an unclipped
/// token as clipped); OpenRLHF computes it as written above.
pub fn value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    clip: Option<f64>,
    aggregation: Aggregation,
    flavor: Flavor,
) -> (Tensor, f64) {
    let scale = StepScale::of(mask, None);
    let (loss, clipped) = value_loss_in_step(
        values,
        old_values,
        returns,
        mask,
        clip,
        aggregation,
        flavor,
        &scale,
    );
    let fraction = if scale.tokens > 0.0 {
        clipped / scale.tokens
    } else {
        0.0
    };
    (loss, fraction)
}

/// [`value_loss`] of one part (a micro-batch, a data-parallel rank's rows)
/// of a step whose denominators are `scale`, so that the parts' losses add
/// up to the step's; the second value is the number of valid tokens where
/// the clipped branch was larger (its fraction is that over `scale.tokens`).
#[allow(clippy::too_many_arguments)]
pub fn value_loss_in_step(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    clip: Option<f64>,
    aggregation: Aggregation,
    flavor: Flavor,
    scale: &StepScale,
) -> (Tensor, f64) {
    let plain = (values - returns).square();
    let (loss, clip_fraction) = match clip {
        Some(eps) => {
            let clipped_values = match flavor {
                Flavor::OpenRlhf => old_values + (values - old_values).clamp(-eps, eps),
                // verl's clip_by_value: exactly V inside the range.
                Flavor::Verl => values
                    .minimum(&(old_values + eps))
                    .maximum(&(old_values - eps)),
            };
            let clipped = (clipped_values - returns).square();
            let count = (clipped.gt_tensor(&plain).to_kind(Kind::Float) * mask)
                .sum(Kind::Double)
                .double_value(&[]);
            (plain.maximum(&clipped), count)
        }
        None => (plain, 0.0),
    };
    (
        aggregate_in_step(&loss, mask, aggregation, flavor, scale) * 0.5,
        clip_fraction,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::algorithms::test_rows as t;

    #[test]
    fn clipped_loss_by_hand() {
        // Ratios e^0.5 ≈ 1.65 (clipped to 1.2 for A > 0) and e^−0.5 ≈ 0.61 (clipped to 0.8 for A < 0).
        let lp = t(&[&[0.0, 0.0]]);
        let old = t(&[&[-0.5, 0.5]]);
        let adv = t(&[&[1.0, -2.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        let out = policy_loss(&lp, &old, &adv, &mask, None, &PolicyLossConfig::default());
        let l0 = -(1.2f64); // −min(1.65·1, 1.2·1)
        let l1 = 2.0 * 0.8f64; // −min(0.61·(−2), 0.8·(−2)) = 1.6
        assert!((out.loss.double_value(&[]) - (l0 + l1) / 2.0).abs() < 1e-5);
        assert!((out.clip_fraction - 1.0).abs() < 1e-9);
        assert!((out.approx_kl - 0.0).abs() < 1e-9);
    }

    #[test]
    fn dual_clip_bounds_the_loss_of_negative_advantages() {
        // A huge ratio with a negative advantage: −min(s1, s2) = 20·ratio… capped at −c·A = 3·1.
        let lp = t(&[&[3.0]]);
        let old = t(&[&[0.0]]);
        let adv = t(&[&[-1.0]]);
        let mask = t(&[&[1.0]]);
        let free = policy_loss(&lp, &old, &adv, &mask, None, &PolicyLossConfig::default());
        assert!((free.loss.double_value(&[]) - 3.0f64.exp()).abs() < 1e-4);
        let dual = policy_loss(&lp, &old, &adv, &mask, None, &PolicyLossConfig::verl());
        assert!((dual.loss.double_value(&[]) - 3.0).abs() < 1e-6);
    }

    #[test]
    fn the_clipped_loss_has_no_gradient_outside_the_trust_region() {
        let lp = t(&[&[0.5, -0.5, 0.05]]).set_requires_grad(true);
        let old = t(&[&[0.0, 0.0, 0.0]]);
        let adv = t(&[&[1.0, -1.0, 1.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0]]);
        let out = policy_loss(&lp, &old, &adv, &mask, None, &PolicyLossConfig::default());
        out.loss.backward();
        let g = Vec::<f32>::try_from(lp.grad().flatten(0, -1)).unwrap();
        assert_eq!(
            g[0], 0.0,
            "ratio 1.65 > 1.2 with A > 0: clipped, no gradient"
        );
        assert_eq!(
            g[1], 0.0,
            "ratio 0.61 < 0.8 with A < 0: clipped, no gradient"
        );
        assert!(
            g[2] < 0.0,
            "inside the region the gradient pushes the ratio up for A > 0"
        );
    }

    #[test]
    fn gspo_uses_one_ratio_per_response() {
        let lp = t(&[&[0.3, -0.1, 9.0]]);
        let old = t(&[&[0.0, 0.0, 0.0]]);
        let adv = t(&[&[1.0, 1.0, 1.0]]);
        let mask = t(&[&[1.0, 1.0, 0.0]]);
        let cfg = PolicyLossConfig {
            ratio_level: RatioLevel::Sequence,
            clip_high: 10.0,
            ..Default::default()
        };
        let out = policy_loss(&lp, &old, &adv, &mask, None, &cfg);
        let ratio = (0.1f64).exp(); // mean of 0.3 and −0.1 over the two masked tokens
        assert!((out.loss.double_value(&[]) + ratio).abs() < 1e-5);
    }

    #[test]
    fn importance_corrections_weight_or_drop_stale_tokens() {
        let lp = t(&[&[-1.0, -1.0]]);
        let old = t(&[&[-1.0, -1.0]]);
        let behaviour = t(&[&[-1.0 - 2.0f32.ln(), -1.0 + 2.0f32.ln()]]); // ρ = 2 and 0.5
        let adv = t(&[&[1.0, 1.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        let tis = PolicyLossConfig {
            correction: Some(ImportanceCorrection::Tis {
                low: 0.0,
                high: 1.5,
            }),
            ..Default::default()
        };
        let out = policy_loss(&lp, &old, &adv, &mask, Some(&behaviour), &tis);
        assert!((out.loss.double_value(&[]) + (1.5 + 0.5) / 2.0).abs() < 1e-5);
        assert!((out.weight_stats.max - 1.5).abs() < 1e-5);
        let icepop = PolicyLossConfig {
            correction: Some(ImportanceCorrection::IcePop {
                low: 0.6,
                high: 1.5,
            }),
            ..Default::default()
        };
        let out = policy_loss(&lp, &old, &adv, &mask, Some(&behaviour), &icepop);
        assert!(
            out.loss.double_value(&[]).abs() < 1e-6,
            "both tokens outside [0.6, 1.5]: dropped"
        );
        // Sequence mask: geometric mean of 2 and 0.5 is 1, inside: weights stay per token.
        let seq = PolicyLossConfig {
            correction: Some(ImportanceCorrection::SequenceMask {
                low: 0.5,
                high: 2.0,
            }),
            ..Default::default()
        };
        let out = policy_loss(&lp, &old, &adv, &mask, Some(&behaviour), &seq);
        assert!((out.loss.double_value(&[]) + (2.0 + 0.5) / 2.0).abs() < 1e-5);
    }

    #[test]
    fn value_loss_by_hand() {
        let v = t(&[&[1.0, 0.0]]);
        let old = t(&[&[0.0, 0.0]]);
        let ret = t(&[&[0.0, 1.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        // Token 0: plain 1, clipped v_c = 0.5 → 0.25; max 1. Token 1: plain 1, clipped 1; max 1.
        let (loss, frac) = value_loss(
            &v,
            &old,
            &ret,
            &mask,
            Some(0.5),
            Aggregation::TokenMean,
            Flavor::OpenRlhf,
        );
        assert!((loss.double_value(&[]) - 0.5).abs() < 1e-9);
        assert_eq!(frac, 0.0);
        let v = t(&[&[-1.0, 0.0]]);
        // Token 0 moved away from the return: plain 1, clipped (−0.5 − 0)² = 0.25 → 1; unclipped also 1.
        let (loss, _) = value_loss(
            &v,
            &old,
            &ret,
            &mask,
            None,
            Aggregation::TokenMean,
            Flavor::Verl,
        );
        assert!((loss.double_value(&[]) - 0.5).abs() < 1e-9);
    }

    fn grad_of(lp: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Vec<f64> {
        let lp = lp.detach().to_kind(Kind::Double).set_requires_grad(true);
        f(&lp).backward();
        Vec::<f64>::try_from(lp.grad().flatten(0, -1)).unwrap()
    }

    #[test]
    fn a_correction_weights_the_gradient_not_only_the_value() {
        // Token ratios inside the trust region, so every token has a gradient.
        let lp = t(&[&[-1.0, -0.9, -1.2], &[-0.5, -2.0, -0.7]]).to_kind(Kind::Double);
        let old = t(&[&[-1.05, -0.95, -1.1], &[-0.45, -2.05, -0.75]]).to_kind(Kind::Double);
        let behaviour = t(&[&[-0.4, -1.6, -1.1], &[-0.2, -2.5, -0.75]]).to_kind(Kind::Double);
        let adv = t(&[&[1.0, -0.5, 2.0], &[-1.0, 0.3, 0.7]]).to_kind(Kind::Double);
        let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]).to_kind(Kind::Double);
        let corrections = [
            ImportanceCorrection::Tis {
                low: 0.0,
                high: 1.5,
            },
            ImportanceCorrection::IcePop {
                low: 0.6,
                high: 1.5,
            },
            ImportanceCorrection::SequenceMask {
                low: 0.0,
                high: 10.0,
            },
        ];
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            let plain = PolicyLossConfig {
                flavor,
                ..Default::default()
            };
            let g0 = grad_of(&lp, |lp| {
                policy_loss(lp, &old, &adv, &mask, Some(&behaviour), &plain).loss
            });
            for correction in corrections {
                let cfg = PolicyLossConfig {
                    correction: Some(correction),
                    ..plain
                };
                let g = grad_of(&lp, |lp| {
                    policy_loss(lp, &old, &adv, &mask, Some(&behaviour), &cfg).loss
                });
                let w = importance_weights(correction, &old, &behaviour, &mask);
                let w = Vec::<f64>::try_from(w.flatten(0, -1)).unwrap();
                assert!(w.iter().any(|w| (w - 1.0).abs() > 0.1), "{w:?}");
                for i in 0..g.len() {
                    assert!(
                        (g[i] - w[i] * g0[i]).abs() < 1e-12,
                        "{correction:?} {flavor:?} token {i}: {} vs {} × {}",
                        g[i],
                        w[i],
                        g0[i]
                    );
                }
            }
        }
    }

    #[test]
    fn verl_gspo_gives_each_token_its_own_advantage() {
        // Per-token advantages (GAE-like); ratios near 1, so nothing is clipped.
        let lp = t(&[&[-1.0, -0.9, -1.2, -3.0]]).to_kind(Kind::Double);
        let old = t(&[&[-1.02, -0.88, -1.21, -3.0]]).to_kind(Kind::Double);
        let adv = t(&[&[1.0, -0.5, 2.0, 7.0]]).to_kind(Kind::Double);
        let mask = t(&[&[1.0, 1.0, 1.0, 0.0]]).to_kind(Kind::Double);
        let base = PolicyLossConfig {
            ratio_level: RatioLevel::Sequence,
            aggregation: Aggregation::SeqMeanTokenMean,
            ..Default::default()
        };
        let verl = PolicyLossConfig {
            flavor: Flavor::Verl,
            ..base
        };
        let s = (((&lp - &old) * &mask).sum(Kind::Double).double_value(&[]) / 3.0).exp();
        let g = grad_of(&lp, |lp| {
            policy_loss(lp, &old, &adv, &mask, None, &verl).loss
        });
        // ℓ = mean_t −A_t · s_i,t, ∂ℓ/∂log π_t = −A_t · s_i / 3.
        for (i, a) in [1.0, -0.5, 2.0].iter().enumerate() {
            assert!((g[i] + a * s / 3.0).abs() < 1e-8, "token {i}: {}", g[i]);
        }
        assert_eq!(g[3], 0.0, "a masked token has no gradient");
        // OpenRLHF differentiates through the mean: every token gets the mean advantage.
        let g = grad_of(&lp, |lp| {
            policy_loss(lp, &old, &adv, &mask, None, &base).loss
        });
        let spread = -(1.0 - 0.5 + 2.0) / 3.0 * s / 3.0;
        for (i, gi) in g.iter().take(3).enumerate() {
            assert!((gi - spread).abs() < 1e-8, "token {i}: {gi}");
        }
        // Both take the sequence ratio's value.
        let v = policy_loss(&lp, &old, &adv, &mask, None, &verl).loss_value();
        assert!((v + (1.0 - 0.5 + 2.0) / 3.0 * s).abs() < 1e-8, "{v}");
    }
}
