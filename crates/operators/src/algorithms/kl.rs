//! KL estimators between the actor and the reference, and the per-token
//! reward that carries the KL penalty and the scalar score.

use super::stats::Tokens;
use super::Flavor;

/// Which estimator of KL(π‖π_ref) per token (J. Schulman, "Approximating
/// KL divergence"; verl's `kl_penalty` names them).
///
/// Config spelling (`algorithm.kl_estimator`): `k1`, `k2` (or `mse`), `k3`,
/// `abs`, `k1+`, `k3+`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// k1 = log π − log π_ref.
    #[default]
    K1,
    /// k2 = (log π − log π_ref)² / 2 (verl also calls it `mse`).
    #[serde(alias = "mse")]
    K2,
    /// k3 = exp(log π_ref − log π) − 1 + (log π − log π_ref): unbiased, always ≥ 0.
    K3,
    /// `abs` = |log π − log π_ref|.
    Abs,
    /// `k1+`: the value of k1, the gradient of k2 (verl's straight-through
    /// `k2 − sg[k2] + sg[k1]`: k1's expected gradient is not KL's, k2's is).
    #[serde(rename = "k1+")]
    K1Plus,
    /// `k3+`: the value of k3, the gradient of k2.
    #[serde(rename = "k3+")]
    K3Plus,
}

impl KlEstimator {
    /// The estimator whose value this one takes (k1+ → k1, k3+ → k3).
    pub fn value_of(self) -> KlEstimator {
        match self {
            KlEstimator::K1Plus => KlEstimator::K1,
            KlEstimator::K3Plus => KlEstimator::K3,
            KlEstimator::K1 | KlEstimator::K2 | KlEstimator::K3 | KlEstimator::Abs => self,
        }
    }

    /// Whether the gradient is k2's while the value is another's.
    pub fn straight_through(self) -> bool {
        matches!(self, KlEstimator::K1Plus | KlEstimator::K3Plus)
    }
}

/// One token's KL estimate from the actor's `logprob` and the reference's `ref_logprob`.
///
/// With `r = logprob − ref_logprob`:
/// - OpenRLHF: k1 = r, k2 = r²/2, k3 = e^(−r) − 1 + r, and **every** estimator
///   is clamped to [−10, 10] (`abs` = |r| likewise; OpenRLHF has no `abs`).
/// - verl: k1 = r, k2 = r²/2 and abs = |r| unclamped; k3 with `x = clamp(−r, −20, 20)`
///   is `e^x − x − 1`, clamped to [−10, 10].
///
/// k1+ and k3+ have the values of k1 and k3 ([`kl_tensor`] gives them k2's gradient).
pub fn kl(logprob: f64, ref_logprob: f64, estimator: KlEstimator, flavor: Flavor) -> f64 {
    let r = logprob - ref_logprob;
    // k1+ and k3+ take k1's and k3's values (`KlEstimator::value_of`).
    let k = match estimator {
        KlEstimator::K1 | KlEstimator::K1Plus => r,
        KlEstimator::K2 => 0.5 * r * r,
        KlEstimator::Abs => r.abs(),
        KlEstimator::K3 | KlEstimator::K3Plus => match flavor {
            Flavor::OpenRlhf => (-r).exp() - 1.0 + r,
            Flavor::Verl => {
                let x = (-r).clamp(-20.0, 20.0);
                x.exp() - x - 1.0
            }
        },
    };
    match (flavor, estimator) {
        (Flavor::OpenRlhf, _) | (Flavor::Verl, KlEstimator::K3 | KlEstimator::K3Plus) => {
            k.clamp(-10.0, 10.0)
        }
        (
            Flavor::Verl,
            KlEstimator::K1 | KlEstimator::K1Plus | KlEstimator::K2 | KlEstimator::Abs,
        ) => k,
    }
}

/// [`kl`] for every token of a token matrix (no masking: callers mask).
pub fn kl_tokens(
    logprobs: &Tokens,
    ref_logprobs: &Tokens,
    estimator: KlEstimator,
    flavor: Flavor,
) -> Vec<Vec<f64>> {
    logprobs
        .iter()
        .zip(ref_logprobs)
        .map(|(lp, rp)| {
            lp.iter()
                .zip(rp)
                .map(|(a, b)| kl(*a, *b, estimator, flavor))
                .collect()
        })
        .collect()
}

/// Per-token rewards: `−kl_coef · kl` on every token, plus the scalar
/// `score` of each response (clamped to `clip` first, if given) on its last
/// token whose mask is 1 (the last position if the mask is all 0), as
/// OpenRLHF's `compute_reward` places it. A non-positive `kl_coef` counts
/// as 0. (verl's `compute_rewards` is the same with `clip = None`, given
/// token-level scores that already hold the score on the last token.)
pub fn token_rewards(
    score: &[f64],
    kl: &Tokens,
    mask: &Tokens,
    kl_coef: f64,
    clip: Option<(f64, f64)>,
) -> Vec<Vec<f64>> {
    let coef = kl_coef.max(0.0);
    score
        .iter()
        .zip(kl.iter().zip(mask))
        .map(|(&s, (k, m))| {
            let s = match clip {
                Some((lo, hi)) => s.clamp(lo, hi),
                None => s,
            };
            let mut row: Vec<f64> = k.iter().map(|x| -coef * x).collect();
            let last = m
                .iter()
                .rposition(|&x| x > 0.0)
                .unwrap_or(row.len().saturating_sub(1));
            if let Some(slot) = row.get_mut(last) {
                *slot += s;
            }
            row
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimators_by_hand() {
        let (lp, rp) = (-1.0, -1.5); // r = 0.5
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            assert!((kl(lp, rp, KlEstimator::K1, flavor) - 0.5).abs() < 1e-12);
            assert!((kl(lp, rp, KlEstimator::K2, flavor) - 0.125).abs() < 1e-12);
            let k3 = (-0.5f64).exp() - 1.0 + 0.5;
            assert!((kl(lp, rp, KlEstimator::K3, flavor) - k3).abs() < 1e-12);
        }
        // k3 is non-negative and zero at r = 0.
        assert_eq!(kl(-2.0, -2.0, KlEstimator::K3, Flavor::OpenRlhf), 0.0);
        assert!(kl(-3.0, -1.0, KlEstimator::K3, Flavor::Verl) > 0.0);
    }

    #[test]
    fn clamping_differs_between_flavors() {
        // r = 15: OpenRLHF clamps k1 and k2 to 10, verl does not.
        assert_eq!(kl(0.0, -15.0, KlEstimator::K1, Flavor::OpenRlhf), 10.0);
        assert_eq!(kl(0.0, -15.0, KlEstimator::K1, Flavor::Verl), 15.0);
        assert_eq!(kl(0.0, -15.0, KlEstimator::K2, Flavor::Verl), 112.5);
        // r = −30: k3 explodes; both clamp the result to 10.
        assert_eq!(kl(-30.0, 0.0, KlEstimator::K3, Flavor::OpenRlhf), 10.0);
        assert_eq!(kl(-30.0, 0.0, KlEstimator::K3, Flavor::Verl), 10.0);
        assert_eq!(kl(-30.0, 0.0, KlEstimator::K1, Flavor::OpenRlhf), -10.0);
    }

    #[test]
    fn score_lands_on_the_last_unmasked_token_after_clipping() {
        let kl = vec![vec![0.1, 0.2, 0.3, 0.4], vec![1.0, 1.0]];
        let mask = vec![vec![1.0, 1.0, 1.0, 0.0], vec![0.0, 0.0]];
        let r = token_rewards(&[20.0, 3.0], &kl, &mask, 0.5, Some((-10.0, 10.0)));
        assert_eq!(r[0], vec![-0.05, -0.1, -0.15 + 10.0, -0.2]);
        assert_eq!(
            r[1],
            vec![-0.5, -0.5 + 3.0],
            "all-zero mask: the last position"
        );
        let r = token_rewards(&[2.0], &kl[..1], &mask[..1], -1.0, None);
        assert_eq!(
            r[0],
            vec![0.0, 0.0, 2.0, 0.0],
            "negative coefficients count as 0"
        );
    }
}

/// [`kl`] on tensors (differentiable in `logprobs`), elementwise; k1+ and
/// k3+ are `k2 − sg[k2] + sg[k]`: their value, k2's gradient `r`.
pub fn kl_tensor(
    logprobs: &tch::Tensor,
    ref_logprobs: &tch::Tensor,
    estimator: KlEstimator,
    flavor: Flavor,
) -> tch::Tensor {
    let r = logprobs - ref_logprobs;
    // k1+ and k3+ take k1's and k3's values (`KlEstimator::value_of`).
    let k = match (flavor, estimator) {
        (Flavor::OpenRlhf, KlEstimator::K1 | KlEstimator::K1Plus) => r.clamp(-10.0, 10.0),
        (Flavor::OpenRlhf, KlEstimator::K2) => (r.square() / 2.0).clamp(-10.0, 10.0),
        (Flavor::OpenRlhf, KlEstimator::Abs) => r.abs().clamp(-10.0, 10.0),
        (Flavor::OpenRlhf, KlEstimator::K3 | KlEstimator::K3Plus) => {
            ((-&r).exp() - 1.0 + &r).clamp(-10.0, 10.0)
        }
        (Flavor::Verl, KlEstimator::K1 | KlEstimator::K1Plus) => r.shallow_clone(),
        (Flavor::Verl, KlEstimator::K2) => r.square() * 0.5,
        (Flavor::Verl, KlEstimator::Abs) => r.abs(),
        (Flavor::Verl, KlEstimator::K3 | KlEstimator::K3Plus) => {
            let x = (-&r).clamp(-20.0, 20.0);
            (x.exp() - &x - 1.0).clamp(-10.0, 10.0)
        }
    };
    if estimator.straight_through() {
        let k2 = r.square() * 0.5;
        &k2 - k2.detach() + k.detach()
    } else {
        k
    }
}

/// OpenRLHF 0.11's `unbiased_gradient` KL loss term: the value of `kl`
/// (an estimator's, [`kl_tensor`]) with the gradient of
/// `w · ½ (log π − log π_ref)²`, `w = min(exp(log π − log π_old), 10)` held
/// constant — the importance-weighted reverse-KL gradient
/// `E_{π_old}[w · k1 · ∇log π]`, the same for every estimator, which then
/// differ in value only (a straight-through term).
pub fn kl_unbiased_gradient(
    kl: &tch::Tensor,
    logprobs: &tch::Tensor,
    ref_logprobs: &tch::Tensor,
    old_logprobs: &tch::Tensor,
) -> tch::Tensor {
    let w = (logprobs - old_logprobs).exp().clamp_max(10.0).detach();
    let r = logprobs - ref_logprobs;
    let surrogate = w * r.square() * 0.5;
    kl.detach() + &surrogate - surrogate.detach()
}

#[cfg(test)]
mod tensor_tests {
    use super::*;

    const ALL: [KlEstimator; 6] = [
        KlEstimator::K1,
        KlEstimator::K2,
        KlEstimator::K3,
        KlEstimator::Abs,
        KlEstimator::K1Plus,
        KlEstimator::K3Plus,
    ];

    #[test]
    fn straight_through_estimators_take_k2s_gradient() {
        let lp = [-1.0f64, -3.0, 0.2, -0.7];
        let rp = [-1.5f64, -1.0, -0.3, -0.7];
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            for (plus, plain) in [
                (KlEstimator::K1Plus, KlEstimator::K1),
                (KlEstimator::K3Plus, KlEstimator::K3),
            ] {
                let lpt = tch::Tensor::from_slice(&lp).set_requires_grad(true);
                let rpt = tch::Tensor::from_slice(&rp);
                let k = kl_tensor(&lpt, &rpt, plus, flavor);
                let value = Vec::<f64>::try_from(k.detach()).unwrap();
                k.sum(tch::Kind::Double).backward();
                let grad = Vec::<f64>::try_from(lpt.grad()).unwrap();
                for i in 0..4 {
                    // ∂(r²/2)/∂log π = r.
                    assert!((grad[i] - (lp[i] - rp[i])).abs() < 1e-12, "{plus:?} {i}");
                    assert!((value[i] - kl(lp[i], rp[i], plain, flavor)).abs() < 1e-12);
                }
            }
        }
        // abs by hand: |r|, unclamped in verl, clamped in OpenRLHF.
        assert_eq!(kl(-1.0, 2.0, KlEstimator::Abs, Flavor::Verl), 3.0);
        assert_eq!(kl(-20.0, 0.0, KlEstimator::Abs, Flavor::Verl), 20.0);
        assert_eq!(kl(-20.0, 0.0, KlEstimator::Abs, Flavor::OpenRlhf), 10.0);
    }

    #[test]
    fn tensor_estimators_match_the_scalar_ones() {
        let lp = [-1.0f64, -3.0, 0.0, -30.0];
        let rp = [-1.5f64, -1.0, -15.0, 0.0];
        let lpt = tch::Tensor::from_slice(&lp);
        let rpt = tch::Tensor::from_slice(&rp);
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            for est in ALL {
                let got = Vec::<f64>::try_from(kl_tensor(&lpt, &rpt, est, flavor)).unwrap();
                for i in 0..4 {
                    assert!(
                        (got[i] - kl(lp[i], rp[i], est, flavor)).abs() < 1e-12,
                        "{flavor:?} {est:?} {i}"
                    );
                }
            }
        }
    }
}
