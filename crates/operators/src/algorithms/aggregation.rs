//! How a `[B, T]` loss matrix becomes a scalar: the aggregation modes of
//! OpenRLHF and verl, normalised over the whole optimizer step, and the
//! masked reductions the losses, objectives and corrections share.

use tch::{Kind, Tensor};

use super::Flavor;

/// `Σ m·x / Σ m` (0 for an empty mask).
pub(super) fn masked_mean(x: &Tensor, mask: &Tensor) -> Tensor {
    (x * mask).sum(Kind::Double) / mask.sum(Kind::Double).clamp_min(1.0)
}

/// The kind to accumulate per-response sums of `x` in: at least float32,
/// double for double inputs.
pub(super) fn sum_kind(x: &Tensor) -> Kind {
    match x.kind() {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

/// How a `[B, T]` loss matrix becomes a scalar.
///
/// Every mode normalises over the whole optimizer step (all micro-batches
/// and data-parallel ranks: [`StepScale`]), as verl 0.9's `agg_loss` does
/// with its `batch_num_tokens` / `global_batch_size`, so how a step is split
/// does not change the update. Config spelling (`algorithm.aggregation`):
/// the variant's name in kebab case, e.g. `seq-mean-token-sum-norm`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// `Σ m·ℓ / Σ m` over the whole step.
    #[default]
    TokenMean,
    /// Mean over responses of each response's token mean `Σ_t m·ℓ / (Σ_t m + 1e-8)`,
    /// over non-empty responses only (OpenRLHF's `aggregate_loss` and verl's `agg_loss`).
    SeqMeanTokenMean,
    /// Mean over responses of each response's token sum. verl averages over
    /// non-empty responses only; the OpenRLHF flavor (which has no such
    /// mode) over all.
    SeqMeanTokenSum,
    /// Dr.GRPO: `Σ_i Σ_t m·ℓ / (N · T)` with `N` the non-empty responses of
    /// the step and `T` the loss scale factor ([`StepScale::loss_scale_factor`]:
    /// a constant replicates the paper; verl's default is the padded response length).
    SeqMeanTokenSumNorm,
    /// `Σ m·ℓ`: no normalisation at all.
    TokenSum,
}

/// The denominators of one optimizer step's loss, counted over every
/// micro-batch and data-parallel rank of the step. With them,
/// [`aggregate_in_step`] of each micro-batch sums to the aggregate of the
/// whole step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScale {
    /// Valid tokens `Σ m`.
    pub tokens: f64,
    /// Responses.
    pub sequences: f64,
    /// Responses with at least one valid token.
    pub nonempty: f64,
    /// `T` of [`Aggregation::SeqMeanTokenSumNorm`].
    pub loss_scale_factor: f64,
}

impl StepScale {
    /// The scale of a step made of `mask` alone; `T` defaults to its padded width.
    pub fn of(mask: &Tensor, loss_scale_factor: Option<f64>) -> Self {
        let counts = mask.sum_dim_intlist(-1, false, Kind::Double);
        StepScale {
            tokens: counts.sum(Kind::Double).double_value(&[]),
            sequences: mask.size()[0] as f64,
            nonempty: counts.gt(0.0).sum(Kind::Double).double_value(&[]),
            loss_scale_factor: loss_scale_factor.unwrap_or(mask.size()[1] as f64),
        }
    }

    /// Adds another part of the step (`T` stays this one's).
    pub fn add(&mut self, other: &StepScale) {
        self.tokens += other.tokens;
        self.sequences += other.sequences;
        self.nonempty += other.nonempty;
    }

    /// The counts as numbers to all-reduce (`tokens`, `sequences`, `nonempty`).
    pub fn counts(&self) -> [f64; 3] {
        [self.tokens, self.sequences, self.nonempty]
    }
}

/// Aggregates `loss` under `mask` as a step of its own (see [`Aggregation`];
/// `T` = the padded width).
pub fn aggregate(loss: &Tensor, mask: &Tensor, mode: Aggregation, flavor: Flavor) -> Tensor {
    aggregate_in_step(loss, mask, mode, flavor, &StepScale::of(mask, None))
}

/// This micro-batch's share of the step's aggregate: its masked sums over
/// the step's denominators (a denominator of 0 counts as 1: an empty step
/// contributes 0).
pub fn aggregate_in_step(
    loss: &Tensor,
    mask: &Tensor,
    mode: Aggregation,
    flavor: Flavor,
    scale: &StepScale,
) -> Tensor {
    let masked = loss * mask;
    let per = |d: f64| if d > 0.0 { d } else { 1.0 };
    match mode {
        Aggregation::TokenMean => masked.sum(Kind::Double) / per(scale.tokens),
        Aggregation::TokenSum => masked.sum(Kind::Double),
        Aggregation::SeqMeanTokenMean => {
            let count = mask.sum_dim_intlist(-1, false, Kind::Double);
            let sums = masked.sum_dim_intlist(-1, false, Kind::Double);
            let nonempty = count.gt(0.0).to_kind(Kind::Double);
            (sums / (&count + 1e-8) * nonempty).sum(Kind::Double) / per(scale.nonempty)
        }
        Aggregation::SeqMeanTokenSum => {
            let responses = match flavor {
                Flavor::OpenRlhf => scale.sequences,
                Flavor::Verl => scale.nonempty,
            };
            masked.sum(Kind::Double) / per(responses)
        }
        Aggregation::SeqMeanTokenSumNorm => {
            masked.sum(Kind::Double) / (per(scale.nonempty) * per(scale.loss_scale_factor))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::algorithms::test_rows as t;

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
        // Dr.GRPO: Σ / (N · T), N = 2 non-empty responses, T = 3 (the padded width).
        assert!((v(Aggregation::SeqMeanTokenSumNorm, Flavor::Verl) - 10.0 / 6.0).abs() < 1e-9);
        assert!((v(Aggregation::TokenSum, Flavor::Verl) - 10.0).abs() < 1e-9);
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
    fn micro_batches_of_a_step_add_up_to_the_step() {
        let loss = t(&[
            &[1.0, 2.0, 3.0],
            &[4.0, 0.0, 0.0],
            &[0.5, 0.5, 0.0],
            &[9.0, 9.0, 9.0],
        ])
        .to_kind(Kind::Double);
        let mask = t(&[
            &[1.0, 1.0, 1.0],
            &[1.0, 0.0, 0.0],
            &[1.0, 1.0, 0.0],
            &[0.0, 0.0, 0.0],
        ])
        .to_kind(Kind::Double);
        let modes = [
            Aggregation::TokenMean,
            Aggregation::SeqMeanTokenMean,
            Aggregation::SeqMeanTokenSum,
            Aggregation::SeqMeanTokenSumNorm,
            Aggregation::TokenSum,
        ];
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            for mode in modes {
                let scale = StepScale::of(&mask, Some(5.0));
                let whole = aggregate_in_step(&loss, &mask, mode, flavor, &scale).double_value(&[]);
                let parts: f64 = [(0, 1), (1, 3), (3, 4)]
                    .iter()
                    .map(|&(a, b)| {
                        aggregate_in_step(
                            &loss.narrow(0, a, b - a),
                            &mask.narrow(0, a, b - a),
                            mode,
                            flavor,
                            &scale,
                        )
                        .double_value(&[])
                    })
                    .sum();
                assert!((whole - parts).abs() < 1e-12, "{mode:?} {flavor:?}");
            }
        }
        // Dr.GRPO with a user-set T = 5: Σ = 11, 3 non-empty responses.
        let scale = StepScale::of(&mask, Some(5.0));
        let v = aggregate_in_step(
            &loss,
            &mask,
            Aggregation::SeqMeanTokenSumNorm,
            Flavor::Verl,
            &scale,
        );
        assert!((v.double_value(&[]) - 11.0 / 15.0).abs() < 1e-12);
        // OpenRLHF's token-sum mean counts the empty response, verl's does not.
        let open = aggregate(&loss, &mask, Aggregation::SeqMeanTokenSum, Flavor::OpenRlhf);
        let verl = aggregate(&loss, &mask, Aggregation::SeqMeanTokenSum, Flavor::Verl);
        assert!((open.double_value(&[]) - 11.0 / 4.0).abs() < 1e-12);
        assert!((verl.double_value(&[]) - 11.0 / 3.0).abs() < 1e-12);
    }
}
