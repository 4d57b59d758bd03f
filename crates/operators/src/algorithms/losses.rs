//! Policy and value losses on tch tensors `[B, T]` (one row per response,
//! `mask` 1.0 on the tokens that count), with the aggregation modes of
//! OpenRLHF and verl and the off-policy corrections for stale samples.

use tch::{Kind, Tensor};

use super::Flavor;

/// How a `[B, T]` loss matrix becomes a scalar.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Aggregation {
    /// `Σ m·ℓ / Σ m` over the whole batch.
    #[default]
    TokenMean,
    /// Mean over responses of each response's token mean `Σ_t m·ℓ / Σ_t m`.
    /// Both OpenRLHF (`aggregate_loss`) and verl (`agg_loss`) divide by
    /// `Σ_t m + 1e-8` and average over non-empty responses only.
    SeqMeanTokenMean,
    /// Mean over responses of each response's token sum. verl averages over
    /// non-empty responses only; the OpenRLHF flavor (which has no such
    /// mode) over all.
    SeqMeanTokenSum,
    /// `Σ_responses Σ_t m·ℓ / T` (Dr.GRPO's constant normaliser, T = the padded length).
    SeqMeanTokenSumNorm,
}

/// Aggregates `loss` under `mask` (see [`Aggregation`]).
pub fn aggregate(loss: &Tensor, mask: &Tensor, mode: Aggregation, flavor: Flavor) -> Tensor {
    let masked = loss * mask;
    match mode {
        Aggregation::TokenMean => masked.sum(Kind::Double) / mask.sum(Kind::Double),
        Aggregation::SeqMeanTokenMean => {
            let count = mask.sum_dim_intlist(-1, false, Kind::Double);
            let sums = masked.sum_dim_intlist(-1, false, Kind::Double);
            let seq = sums / (&count + 1e-8);
            let nonempty = count.gt(0.0).to_kind(Kind::Double);
            (seq * &nonempty).sum(Kind::Double) / nonempty.sum(Kind::Double)
        }
        Aggregation::SeqMeanTokenSum => {
            let sums = masked.sum_dim_intlist(-1, false, Kind::Double);
            match flavor {
                Flavor::OpenRlhf => sums.mean(Kind::Double),
                Flavor::Verl => {
                    let count = mask.sum_dim_intlist(-1, false, Kind::Double);
                    let nonempty = count.gt(0.0).to_kind(Kind::Double);
                    (sums * &nonempty).sum(Kind::Double) / nonempty.sum(Kind::Double)
                }
            }
        }
        Aggregation::SeqMeanTokenSumNorm => masked.sum(Kind::Double) / mask.size()[1] as f64,
    }
}

fn masked_mean(x: &Tensor, mask: &Tensor) -> Tensor {
    (x * mask).sum(Kind::Double) / mask.sum(Kind::Double)
}

/// The kind to accumulate per-response sums of `x` in: at least float32,
/// double for double inputs.
fn sum_kind(x: &Tensor) -> Kind {
    match x.kind() {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

/// The ratio's granularity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RatioLevel {
    /// PPO: a ratio per token, `exp(clamp(log π − log π_old, −20, 20))`.
    #[default]
    Token,
    /// GSPO: one ratio per response, `exp(Σ m (log π − log π_old) / max(Σ m, 1))`:
    /// unclamped in OpenRLHF, the exponent clamped to at most 10 in verl
    /// (`compute_policy_loss_gspo`).
    Sequence,
}

/// Truncated importance weights for samples whose behaviour policy (the
/// generator's, `behaviour_logprobs`) differs from the proximal one
/// (`old_logprobs`, recomputed by the learner): the decoupled PPO objective
/// multiplies each token's loss by a weight of `ρ = exp(log π_old − log π_behaviour)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ImportanceCorrection {
    /// TIS: weight `clamp(ρ, low, high)`.
    Tis {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// IcePop: weight `ρ` where `low ≤ ρ ≤ high`, 0 elsewhere.
    IcePop {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Sequence mask: a response whose geometric-mean ratio
    /// `exp(mean_t log ρ)` falls outside [low, high] is dropped; the others
    /// are weighted by the per-token `ρ`.
    SequenceMask {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
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
    /// Whose definitions to follow where they differ.
    pub flavor: Flavor,
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
            flavor: Flavor::OpenRlhf,
        }
    }
}

impl PolicyLossConfig {
    /// verl's defaults: ε = 0.2, dual clip c = 3, token mean.
    pub fn verl() -> Self {
        PolicyLossConfig {
            dual_clip: Some(3.0),
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
    /// Mean, min and max of the importance weights over masked tokens (1
    /// without correction, and with OpenRLHF's GSPO, which weights none).
    pub weight_stats: (f64, f64, f64),
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
/// multiplied by the importance weight (if a correction is set) and
/// aggregated under `mask`. All inputs `[B, T]`; `behaviour_logprobs` is
/// needed only with a correction.
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
    let log_ratio = logprobs - old_logprobs;
    let sequence = cfg.ratio_level == RatioLevel::Sequence;
    // OpenRLHF's GSPO folds the correction into the ratio (against the behaviour policy).
    let gspo_behaviour = match (cfg.flavor, sequence, cfg.correction) {
        (Flavor::OpenRlhf, true, Some(_)) => behaviour_logprobs,
        _ => None,
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
            let mean = match cfg.flavor {
                Flavor::OpenRlhf => mean,
                Flavor::Verl => mean.clamp_max(10.0),
            };
            mean.exp() * mask
        }
    };
    let surr1 = &ratio * advantages;
    let surr2 = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages;
    let clipped = surr1.minimum(&surr2);
    let dual_clip = match (cfg.flavor, sequence) {
        (Flavor::Verl, true) => None,
        _ => cfg.dual_clip,
    };
    let mut loss = match dual_clip {
        None => -&clipped,
        Some(c) => {
            let lower = clipped.maximum(&(advantages * c));
            -clipped.where_self(&advantages.ge(0.0), &lower)
        }
    };
    let mut weight_stats = (1.0, 1.0, 1.0);
    if let (Some(correction), Some(behaviour), None) =
        (cfg.correction, behaviour_logprobs, gspo_behaviour)
    {
        let _guard = tch::no_grad_guard();
        let log_rho = old_logprobs - behaviour;
        let rho = log_rho.exp();
        let weight = match correction {
            ImportanceCorrection::Tis { low, high } => rho.clamp(low, high),
            ImportanceCorrection::IcePop { low, high } => {
                &rho * rho.ge(low).logical_and(&rho.le(high)).to_kind(rho.kind())
            }
            ImportanceCorrection::SequenceMask { low, high } => {
                let kind = sum_kind(&log_rho);
                let count = mask.sum_dim_intlist(-1, true, kind);
                let seq = ((&log_rho * mask).sum_dim_intlist(-1, true, kind) / count).exp();
                &rho * seq.ge(low).logical_and(&seq.le(high)).to_kind(rho.kind())
            }
        };
        let valid = mask.gt(0.0);
        let w = weight.masked_select(&valid);
        if w.numel() > 0 {
            weight_stats = (
                w.mean(Kind::Double).double_value(&[]),
                w.min().double_value(&[]),
                w.max().double_value(&[]),
            );
        }
        loss *= weight.detach();
    }
    let clip_fraction =
        masked_mean(&surr2.lt_tensor(&surr1).to_kind(Kind::Float), mask).double_value(&[]);
    let kl_log_ratio = match (cfg.flavor, cfg.ratio_level) {
        (Flavor::Verl, RatioLevel::Token) => log_ratio.clamp(-20.0, 20.0),
        _ => log_ratio,
    };
    let approx_kl = masked_mean(&(-kl_log_ratio).detach(), mask).double_value(&[]);
    PolicyLoss {
        loss: aggregate(&loss, mask, cfg.aggregation, cfg.flavor),
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
            let fraction = masked_mean(&clipped.gt_tensor(&plain).to_kind(Kind::Float), mask)
                .double_value(&[]);
            (plain.maximum(&clipped), fraction)
        }
        None => (plain, 0.0),
    };
    (
        aggregate(&loss, mask, aggregation, flavor) * 0.5,
        clip_fraction,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(rows: &[&[f32]]) -> Tensor {
        let (b, n) = (rows.len() as i64, rows[0].len() as i64);
        Tensor::from_slice(&rows.concat()).view([b, n])
    }

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
    fn aggregation_modes_by_hand() {
        let loss = t(&[&[1.0, 2.0, 3.0], &[4.0, 0.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0]]);
        let v = |m, f| aggregate(&loss, &mask, m, f).double_value(&[]);
        assert!((v(Aggregation::TokenMean, Flavor::OpenRlhf) - 10.0 / 4.0).abs() < 1e-9);
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            assert!(
                (v(Aggregation::SeqMeanTokenMean, flavor)
                    - (6.0 / (3.0 + 1e-8) + 4.0 / (1.0 + 1e-8)) / 2.0)
                    .abs()
                    < 1e-9
            );
        }
        assert!((v(Aggregation::SeqMeanTokenSum, Flavor::Verl) - (6.0 + 4.0) / 2.0).abs() < 1e-9);
        assert!((v(Aggregation::SeqMeanTokenSumNorm, Flavor::Verl) - 10.0 / 3.0).abs() < 1e-9);
        // OpenRLHF's sequence mean skips empty responses.
        let mask2 = t(&[&[1.0, 1.0, 1.0], &[0.0, 0.0, 0.0]]);
        assert!(
            (aggregate(
                &loss,
                &mask2,
                Aggregation::SeqMeanTokenMean,
                Flavor::OpenRlhf
            )
            .double_value(&[])
                - 6.0 / (3.0 + 1e-8))
                .abs()
                < 1e-9
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
        assert!((out.weight_stats.2 - 1.5).abs() < 1e-5);
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
}
