//! Generalized knowledge distillation over a teacher's top-k tokens: at
//! each response position the teacher records its `k` most likely tokens
//! and their log-probs `t_i`; the student's log-probs of the same tokens
//! `s_i` come from its training forward, and the loss term is a
//! divergence between the two on that support, differentiated through the
//! student's whole distribution (Agarwal et al., "On-Policy Distillation
//! of Language Models: Learning from Self-Generated Mistakes", 2024).
//!
//! With `P = exp(t)`, `Q = exp(s)` and `KL(a ‖ b) = Σ_i a_i (log a_i − log b_i)`,
//! GKD's generalized Jensen–Shannon divergence of weight β (as TRL's
//! `GKDTrainer.generalized_jsd_loss` takes it) is
//!
//! ```text
//! β = 0:   KL(P ‖ Q)                                  (forward KL)
//! β = 1:   KL(Q ‖ P)                                  (reverse KL)
//! else:    β·KL(P ‖ M) + (1 − β)·KL(Q ‖ M),   M = β·P + (1 − β)·Q
//! ```
//!
//! The support leaves out the mass outside the teacher's top k. With
//! [`TopKTail::Add`] both distributions get one more outcome, "any other
//! token", of mass `1 − Σ_i exp(·_i)` (`log(−expm1(logsumexp))`, its sum
//! capped at `−1e−7` as verl's SDPO top-k loss caps it), so the divergence
//! is a proper one of two distributions over k + 1 outcomes: never
//! negative, zero only when the student matches the teacher on the support
//! and off it, and equal to the whole-vocabulary divergence when k is the
//! vocabulary. With [`TopKTail::Drop`] the sums run over the k tokens
//! only, and β = 0 is verl 0.9's `forward_kl_topk`
//! (`verl/trainer/distillation/fsdp/losses.py::compute_forward_kl_topk`,
//! then clamped at 0 as `losses.py::compute_forward_kl_topk` clamps it: the
//! partial sums can fall below). Every value is clamped at 0, as verl's.

use tch::{Kind, Tensor};

/// What the divergence does with the probability mass outside the teacher's top k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopKTail {
    /// One more outcome for all other tokens, on both sides.
    Add,
    /// Sums over the k tokens alone.
    Drop,
}

/// The top-k distillation loss term of the learner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GkdLoss {
    /// Tokens the teacher recorded at each position.
    pub k: usize,
    /// GKD's β: 0 forward KL, 1 reverse KL, between a generalized JSD.
    pub beta: f64,
    /// The term's weight in the loss.
    pub coef: f64,
    /// The mass outside the top k.
    pub tail: TopKTail,
}

/// `log(1 − Σ_i exp(x_i))` over the last dimension, kept dimension, the
/// sum's log capped at `−1e−7`.
fn tail_log(x: &Tensor) -> Tensor {
    let log_sum = x.logsumexp([-1i64].as_slice(), true).clamp_max(-1e-7);
    (-log_sum.expm1()).log()
}

/// `Σ_i exp(a_i) (a_i − b_i)` over the last dimension.
fn kl(a: &Tensor, b: &Tensor) -> Tensor {
    (a.exp() * (a - b)).sum_dim_intlist(-1, false, a.kind())
}

/// The divergence at each position `[..]` between the student's log-probs
/// `student` and the teacher's `teacher` of the teacher's top-k tokens
/// `[.., k]`, of weight `beta`, with `tail` (module docs); differentiable
/// in `student`. Runs in float32 or better.
pub fn topk_divergence(student: &Tensor, teacher: &Tensor, beta: f64, tail: TopKTail) -> Tensor {
    let kind = if student.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let (mut s, mut t) = (student.to_kind(kind), teacher.to_kind(kind));
    if tail == TopKTail::Add {
        s = Tensor::cat(&[&s, &tail_log(&s)], -1);
        t = Tensor::cat(&[&t, &tail_log(&t)], -1);
    }
    let d = if beta == 0.0 {
        kl(&t, &s)
    } else if beta == 1.0 {
        kl(&s, &t)
    } else {
        let m = Tensor::stack(&[&t + beta.ln(), &s + (1.0 - beta).ln()], 0)
            .logsumexp([0i64].as_slice(), false);
        kl(&t, &m) * beta + kl(&s, &m) * (1.0 - beta)
    };
    d.clamp_min(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: &[i64]) -> Tensor {
        Tensor::from_slice(v).view(shape)
    }

    /// With k the whole vocabulary the tail is empty and the divergence is
    /// GKD's over the full distributions, computed here by hand from the
    /// probabilities; dropping the tail gives the same.
    #[test]
    fn over_the_whole_vocabulary_it_is_gkds_divergence() {
        let p = [0.5, 0.3, 0.2];
        let q = [0.2, 0.2, 0.6];
        let log = |v: &[f64]| t(&v.iter().map(|x| x.ln()).collect::<Vec<_>>(), &[1, 3]);
        let kl_by_hand =
            |a: &[f64], b: &[f64]| -> f64 { a.iter().zip(b).map(|(a, b)| a * (a / b).ln()).sum() };
        for beta in [0.0, 0.3, 0.5, 1.0] {
            let m: Vec<f64> = p
                .iter()
                .zip(&q)
                .map(|(p, q)| beta * p + (1.0 - beta) * q)
                .collect();
            let want = match beta {
                0.0 => kl_by_hand(&p, &q),
                1.0 => kl_by_hand(&q, &p),
                _ => beta * kl_by_hand(&p, &m) + (1.0 - beta) * kl_by_hand(&q, &m),
            };
            for tail in [TopKTail::Add, TopKTail::Drop] {
                let got = topk_divergence(&log(&q), &log(&p), beta, tail).double_value(&[0]);
                assert!(
                    (got - want).abs() < 1e-6,
                    "β {beta} {tail:?}: {got} vs {want}"
                );
            }
        }
    }

    /// On a support of two of three tokens, the tail adds the third as one
    /// outcome; dropped, the forward KL is the partial sum, clamped at 0.
    #[test]
    fn the_tail_is_the_mass_off_the_support() {
        let (p, q) = ([0.6, 0.3], [0.3, 0.3]);
        let logs = |v: [f64; 2]| t(&[v[0].ln(), v[1].ln()], &[1, 2]);
        let added = topk_divergence(&logs(q), &logs(p), 0.0, TopKTail::Add).double_value(&[0]);
        let want = 0.6 * (0.6f64 / 0.3).ln() + 0.3 * 0.0 + 0.1 * (0.1f64 / 0.4).ln();
        assert!((added - want).abs() < 1e-9, "{added} vs {want}");
        let dropped = topk_divergence(&logs(q), &logs(p), 0.0, TopKTail::Drop).double_value(&[0]);
        assert!((dropped - 0.6 * 2f64.ln()).abs() < 1e-9);
        // The student holding more of the support than the teacher: below 0, clamped.
        let below = topk_divergence(&logs(p), &logs([0.3, 0.2]), 0.0, TopKTail::Drop);
        assert_eq!(below.double_value(&[0]), 0.0);
    }
}
