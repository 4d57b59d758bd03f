//! Off-policy corrections for stale rows: the importance weights that
//! multiply a token's loss (constants to autograd), as OpenRLHF and verl 0.9
//! name them, and what is recorded about them.

use tch::{Kind, Tensor};

use super::aggregation::sum_kind;

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
    /// are weighted by the per-token `ρ` (OpenRLHF's `seq-mask-tis`).
    SequenceMask {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Sequence TIS (verl's `rollout_is = "sequence"`): every token of a
    /// response weighted by `clamp(exp(clamp(Σ_t log ρ, −20, 20)), low, high)`,
    /// the response's whole ratio (unbiased, high variance).
    SequenceTis {
        /// Lower bound.
        low: f64,
        /// Upper bound (verl's `rollout_is_threshold`).
        high: f64,
    },
    /// Geometric-mean rejection (verl's `rollout_rs = "seq_mean_k1"`): a
    /// response is kept, with weight 1, iff its mean K1 estimate
    /// `mean_t −log ρ` (log ρ clamped to ±20) lies in `[ln low, ln high]`,
    /// else dropped (weight 0). On the geometric-mean ratio that is
    /// `1/high ≤ exp(mean_t log ρ) ≤ 1/low`: the bounds are on
    /// π_behaviour / π_old, as verl reads them.
    GeometricRejection {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// Sequence IcePop (verl's `rollout_is = "sequence"` with a
    /// `"low_high"` threshold): every token of a response weighted by the
    /// response's whole ratio `exp(clamp(Σ_t log ρ, −20, 20))` where it lies
    /// in [low, high], and dropped (weight 0) where it does not.
    SequenceIcePop {
        /// Lower bound.
        low: f64,
        /// Upper bound.
        high: f64,
    },
    /// OpenRLHF 0.11's divergence gating (`is_correction_gating =
    /// "binary_kl"` or `"tv"`, mode `mask`): with p and q the probabilities
    /// of the sampled token under the behaviour and the proximal policy
    /// (`exp` of their log-probs, each clamped to [1e-6, 1 − 1e-6]), the
    /// statistic is the binary KL `p ln(p/q) + (1−p) ln((1−p)/(1−q))` or
    /// the total variation `|p − q|` — per token, or with `sequence` its
    /// mean over the response's tokens; a token whose statistic lies in
    /// [0, high] keeps its weight ρ, the others weigh 0 (a trust region;
    /// FlashREINFORCE gates the sequence mean of the binary KL).
    DivergenceGate {
        /// The divergence.
        divergence: GateDivergence,
        /// Gate whole responses by their mean.
        sequence: bool,
        /// The largest divergence kept.
        high: f64,
    },
    /// K3 rejection (verl's `rollout_rs = "seq_mean_k3"`): a response is
    /// kept, with weight 1, iff its mean K3 estimate `mean_t (ρ − 1 − log ρ)`
    /// (log ρ clamped to ±20) is at most `high`.
    K3Rejection {
        /// The largest mean K3 kept.
        high: f64,
    },
}

impl ImportanceCorrection {
    /// Whether its weights are one per response (sequence TIS and IcePop),
    /// as verl's batch normaliser counts them.
    pub fn per_response(&self) -> bool {
        matches!(
            self,
            ImportanceCorrection::SequenceTis { .. } | ImportanceCorrection::SequenceIcePop { .. }
        )
    }

    /// Whether verl normalises its weights over the batch
    /// (`rollout_is_batch_normalize` applies to its IS weights: TIS and
    /// IcePop, per token or per response).
    pub fn batch_normalizable(&self) -> bool {
        matches!(
            self,
            ImportanceCorrection::Tis { .. }
                | ImportanceCorrection::IcePop { .. }
                | ImportanceCorrection::SequenceTis { .. }
                | ImportanceCorrection::SequenceIcePop { .. }
        )
    }
}

/// The sum and the count whose ratio is verl's batch normaliser of
/// `weights` (`rollout_is_batch_normalize`): over the valid tokens of
/// `mask`, or with `per_response` over the responses that have a token,
/// each counted by its mean weight (over its tokens + 1e-8). Sums of a
/// step's micro-batches and ranks add up to the step's.
pub fn weight_sums(weights: &Tensor, mask: &Tensor, per_response: bool) -> (f64, f64) {
    let _guard = tch::no_grad_guard();
    let kind = Kind::Double;
    let (w, m) = (weights.to_kind(kind), mask.to_kind(kind));
    if !per_response {
        let sum = (&w * &m).sum(kind).double_value(&[]);
        return (sum, m.sum(kind).double_value(&[]));
    }
    let count = m.sum_dim_intlist(-1, false, kind);
    let mean = (&w * &m).sum_dim_intlist(-1, false, kind) / (&count + 1e-8);
    let valid = count.gt(0.0).to_kind(kind);
    (
        (mean * &valid).sum(kind).double_value(&[]),
        valid.sum(kind).double_value(&[]),
    )
}

/// verl's batch normaliser from a step's [`weight_sums`]: the mean weight,
/// `sum / (count + 1e-8)` per token or `sum / max(count, 1e-8)` per
/// response; 1 (the weights left as they are) where it is at most 1e-8.
pub fn batch_normalizer(sum: f64, count: f64, per_response: bool) -> f64 {
    let mean = if per_response {
        sum / count.max(1e-8)
    } else {
        sum / (count + 1e-8)
    };
    if mean > 1e-8 {
        mean
    } else {
        1.0
    }
}

/// A divergence between the sampled token's probabilities under two
/// policies: what an [`ImportanceCorrection::DivergenceGate`] reads, and
/// DPPO's trust region ([`super::PolicyObjective::Dppo`]) bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateDivergence {
    /// The binary KL between the sampled token's two probabilities.
    BinaryKl,
    /// Their total variation, `|p − q|`.
    Tv,
}

/// The importance weights of a micro-batch over its valid tokens: mean,
/// min, max, and the fraction that is 0 (dropped tokens).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightStats {
    /// Mean weight.
    pub mean: f64,
    /// Smallest weight.
    pub min: f64,
    /// Largest weight.
    pub max: f64,
    /// Fraction of tokens with weight 0.
    pub masked: f64,
}

impl Default for WeightStats {
    /// No correction: every weight 1.
    fn default() -> Self {
        WeightStats {
            mean: 1.0,
            min: 1.0,
            max: 1.0,
            masked: 0.0,
        }
    }
}

impl WeightStats {
    /// The statistics of `weight` over the tokens where `mask` is set.
    pub fn of(weight: &Tensor, mask: &Tensor) -> Self {
        let w = weight.masked_select(&mask.gt(0.0));
        if w.numel() == 0 {
            return WeightStats::default();
        }
        WeightStats {
            mean: w.mean(Kind::Double).double_value(&[]),
            min: w.min().double_value(&[]),
            max: w.max().double_value(&[]),
            masked: w
                .eq(0.0)
                .to_kind(Kind::Double)
                .mean(Kind::Double)
                .double_value(&[]),
        }
    }
}

/// The weights a policy loss multiplies in, when it corrects at all: those
/// of `correction` (every weight 1 without one), divided by `normalizer`
/// (verl's batch normalisation; 1: none), times the keep mask of the
/// `rejection` chain (verl's `rollout_is` weights and `rollout_rs` mask
/// together); `None` when neither is set.
pub fn correction_weights(
    correction: Option<ImportanceCorrection>,
    normalizer: f64,
    rejection: &crate::algorithms::RejectionChain,
    old_logprobs: &Tensor,
    behaviour_logprobs: &Tensor,
    mask: &Tensor,
) -> Option<Tensor> {
    let weights = correction.map(|c| {
        let w = importance_weights(c, old_logprobs, behaviour_logprobs, mask);
        if normalizer == 1.0 {
            w
        } else {
            w / normalizer
        }
    });
    if rejection.is_empty() {
        return weights;
    }
    let keep = rejection.keep(old_logprobs, behaviour_logprobs, mask);
    Some(match weights {
        Some(w) => w * keep,
        None => keep,
    })
}

/// The importance weights of `correction` (no gradient): `ρ = exp(log π_old − log π_behaviour)`
/// per token, then as [`ImportanceCorrection`] says.
pub fn importance_weights(
    correction: ImportanceCorrection,
    old_logprobs: &Tensor,
    behaviour_logprobs: &Tensor,
    mask: &Tensor,
) -> Tensor {
    let _guard = tch::no_grad_guard();
    let log_rho = (old_logprobs - behaviour_logprobs).detach();
    let rho = log_rho.exp();
    let inside =
        |x: &Tensor, low: f64, high: f64| x.ge(low).logical_and(&x.le(high)).to_kind(rho.kind());
    let kind = sum_kind(&log_rho);
    // verl's rejection statistics: per response, the mean over its tokens
    // of an estimator of log ρ clamped to ±20 (a response without tokens: 0).
    let response_mean = |estimate: Tensor| {
        let count = mask.sum_dim_intlist(-1, true, kind).clamp_min(1.0);
        (estimate * mask).sum_dim_intlist(-1, true, kind) / count
    };
    let safe = || log_rho.clamp(-20.0, 20.0);
    match correction {
        ImportanceCorrection::Tis { low, high } => rho.clamp(low, high),
        ImportanceCorrection::IcePop { low, high } => &rho * inside(&rho, low, high),
        ImportanceCorrection::SequenceMask { low, high } => {
            let count = mask.sum_dim_intlist(-1, true, kind);
            let seq = ((&log_rho * mask).sum_dim_intlist(-1, true, kind) / count).exp();
            &rho * inside(&seq, low, high)
        }
        ImportanceCorrection::SequenceTis { low, high } => {
            let total = (&log_rho * mask).sum_dim_intlist(-1, true, kind);
            total
                .clamp(-20.0, 20.0)
                .exp()
                .clamp(low, high)
                .expand_as(&rho)
                * mask
        }
        ImportanceCorrection::GeometricRejection { low, high } => {
            // K1 = −log ρ.
            let mean = response_mean(-safe());
            inside(&mean, low.ln(), high.ln()).expand_as(&rho) * mask
        }
        ImportanceCorrection::SequenceIcePop { low, high } => {
            let total = (&log_rho * mask).sum_dim_intlist(-1, true, kind);
            let whole = total.clamp(-20.0, 20.0).exp().expand_as(&rho) * mask;
            &whole * inside(&whole, low, high)
        }
        ImportanceCorrection::DivergenceGate {
            divergence,
            sequence,
            high,
        } => {
            let p = behaviour_logprobs.detach().exp().clamp(1e-6, 1.0 - 1e-6);
            let q = old_logprobs.detach().exp().clamp(1e-6, 1.0 - 1e-6);
            let token = match divergence {
                GateDivergence::BinaryKl => {
                    let (not_p, not_q): (Tensor, Tensor) = (1.0 - &p, 1.0 - &q);
                    &p * (&p / &q).log() + &not_p * (&not_p / &not_q).log()
                }
                GateDivergence::Tv => (&p - &q).abs(),
            };
            let statistic = if sequence {
                (&token * mask).sum_dim_intlist(-1, true, kind)
                    / mask.sum_dim_intlist(-1, true, kind)
            } else {
                token
            };
            &rho * inside(&statistic, 0.0, high).expand_as(&rho)
        }
        ImportanceCorrection::K3Rejection { high } => {
            // K3 = ρ − 1 − log ρ.
            let log_rho = safe();
            let mean = response_mean(log_rho.exp() - 1.0 - &log_rho);
            mean.le(high).to_kind(rho.kind()).expand_as(&rho) * mask
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_corrections_weigh_or_reject_whole_responses() {
        // Response 0: log ρ = (ln 2, ln 2): product 4, geometric mean 2.
        // Response 1: log ρ = (0, 0, pad): product 1, geometric mean 1.
        let ln2 = 2.0f64.ln();
        let old = Tensor::from_slice(&[ln2, ln2, 0.0, 0.0, 0.0, 0.0]).view([2, 3]);
        let behaviour = Tensor::zeros([2, 3], (Kind::Double, tch::Device::Cpu));
        let mask = Tensor::from_slice(&[1.0f64, 1.0, 0.0, 1.0, 1.0, 0.0]).view([2, 3]);
        let w = |c| {
            Vec::<f64>::try_from(importance_weights(c, &old, &behaviour, &mask).flatten(0, -1))
                .unwrap()
        };
        let near = |a: &[f64], b: &[f64]| {
            assert!(
                a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9),
                "{a:?} vs {b:?}"
            );
        };
        near(
            &w(ImportanceCorrection::SequenceTis {
                low: 0.0,
                high: 3.0,
            }),
            &[3.0, 3.0, 0.0, 1.0, 1.0, 0.0],
        );
        near(
            &w(ImportanceCorrection::GeometricRejection {
                low: 0.6,
                high: 1.5,
            }),
            &[0.0, 0.0, 0.0, 1.0, 1.0, 0.0],
        );
        // The band is on the mean K1 = −mean log ρ, as verl's seq_mean_k1:
        // response 0's geometric-mean ρ of 2 is kept by [0.4, 0.6] (its
        // K1, −ln 2, is in [ln 0.4, ln 0.6]), not by [1.9, 2.1].
        near(
            &w(ImportanceCorrection::GeometricRejection {
                low: 0.4,
                high: 0.6,
            }),
            &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        );
        near(
            &w(ImportanceCorrection::GeometricRejection {
                low: 1.9,
                high: 2.1,
            }),
            &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        );
        // Mean K3 of response 0: 2 − 1 − ln 2 ≈ 0.307; response 1: 0.
        near(
            &w(ImportanceCorrection::K3Rejection { high: 0.3 }),
            &[0.0, 0.0, 0.0, 1.0, 1.0, 0.0],
        );
        near(
            &w(ImportanceCorrection::K3Rejection { high: 0.31 }),
            &[1.0, 1.0, 0.0, 1.0, 1.0, 0.0],
        );
        let stats = WeightStats::of(
            &importance_weights(
                ImportanceCorrection::GeometricRejection {
                    low: 0.6,
                    high: 1.5,
                },
                &old,
                &behaviour,
                &mask,
            ),
            &mask,
        );
        assert_eq!(
            (stats.masked, stats.mean, stats.min, stats.max),
            (0.5, 0.5, 0.0, 1.0)
        );
    }
}
