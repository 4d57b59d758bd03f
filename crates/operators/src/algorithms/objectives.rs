//! Policy objectives beside PPO's clipped ratio, as verl 0.9 registers them
//! (`verl/trainer/ppo/core_algos.py`, `register_policy_loss`): CISPO, SAPO,
//! GMPO, GPG / REINFORCE, Clip-Cov and KL-Cov. Each takes `[B, T]` tensors
//! like [`super::policy_loss`] and returns its loss matrix (or, for GMPO,
//! one loss per response), which the caller weights by the off-policy
//! correction and aggregates over the step.

use tch::{Kind, Tensor};

use super::aggregation::masked_mean;
use super::corrections::GateDivergence;

/// Which objective [`super::policy_loss`] optimises.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum PolicyObjective {
    /// PPO's clipped surrogate (per token, or per response with
    /// [`super::RatioLevel::Sequence`]: GSPO).
    #[default]
    Clipped,
    /// CISPO (MiniMax-M1, arXiv 2506.13585; verl `compute_policy_loss_cispo`):
    /// `ℓ = −sg[clamp(r, 1 − ε_low, 1 + ε_high)] · A · log π`, with
    /// `r = exp(clamp(log π − log π_old, −20, 20))`: the clipped ratio
    /// weights the gradient of every token, none is dropped.
    Cispo,
    /// SAPO (arXiv 2511.20347; verl `compute_policy_loss_sapo`): a smooth
    /// gate instead of the clip, `ℓ = −f(r) · A` with
    /// `f(r) = σ(τ (r − 1)) · 4 / τ`, `τ = tau_pos` where `A > 0`, else `tau_neg`.
    Sapo {
        /// τ for positive advantages (verl: 1.0).
        tau_pos: f64,
        /// τ for other advantages (verl: 1.05).
        tau_neg: f64,
    },
    /// GMPO (arXiv 2507.20673; verl `compute_policy_loss_geo_mean`): one
    /// loss per response, `−Ā_i · exp(mean_t sgn(A) · min(sgn(A)·δ_t,
    /// sgn(A)·clamp(δ_t, −ε_low, ε_high)))` with `δ = log π − log π_old` and
    /// `Ā_i` the response's mean advantage; averaged over all responses
    /// (verl ignores the aggregation mode).
    GeoMean,
    /// GPG (arXiv 2504.02546; verl `compute_policy_loss_gpg`): `ℓ = −A · log π`,
    /// no ratio and no clip.
    PolicyGradient,
    /// Vanilla REINFORCE with an importance ratio (verl
    /// `compute_policy_loss_reinforce` in its bypass mode, where the old
    /// policy is the rollout's): `ℓ = −sg[min(π / π_behaviour, cap)] · A · log π`,
    /// the current policy over the one that sampled the tokens, truncated
    /// at `cap` (verl's `rollout_is_threshold`, 2 by default).
    Reinforce {
        /// The largest importance ratio.
        cap: f64,
    },
    /// Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for
    /// Reasoning LMs"; verl `compute_policy_loss_clip_cov`): PPO's loss with
    /// the gradient cut on `max(1, ⌊ratio · Σm⌋)` tokens drawn among those the
    /// clip left alone whose covariance `(A − Ā)(log π − mean log π)` lies
    /// in `(lb, ub)`. verl draws them with `torch.randperm`; weir with a
    /// fixed hash of each token's position, so runs repeat.
    ClipCov {
        /// Fraction of tokens to cut (verl: 0.0002).
        ratio: f64,
        /// Lower covariance bound (verl: 1.0).
        lb: f64,
        /// Upper covariance bound (verl: 5.0).
        ub: f64,
    },
    /// DPPO (Divergence PPO, arXiv 2602.04879; verl 0.9
    /// `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`): the
    /// trust region on the sampled token's probability instead of the
    /// ratio. `ℓ = −A · sg[min(r, cap)] · log π · v`, where `v` drops a token
    /// whose move leaves the region in the direction its advantage pushes:
    /// for `A > 0`, `π − π_old ≤ ε_high` (TV) or `D ≤ ε_high ∨ π ≤ π_old`
    /// (binary KL); else `π − π_old ≥ −ε_low` or `D ≤ ε_low ∨ π ≥ π_old`,
    /// with `D = π_old log(π_old/π) + (1 − π_old) log((1 − π_old + 1e-8) /
    /// (1 − π + 1e-8))`; `r = exp(clamp(log π − log π_old, −20, 20))`. The
    /// clip fraction is the share of dropped tokens.
    Dppo {
        /// Total variation or binary KL.
        divergence: GateDivergence,
        /// The truncation of the ratio (verl's `clip_ratio_c`).
        cap: f64,
    },
    /// KL-Cov (same paper; verl `compute_policy_loss_kl_cov`): the
    /// unclipped `−A · r`, plus `coef · |log π − log π_old|` on the
    /// `max(1, ⌊ratio · n⌋)` valid tokens of largest covariance.
    KlCov {
        /// Fraction of tokens penalised (verl: 0.0002).
        ratio: f64,
        /// The penalty's coefficient (verl's `ppo_kl_coef`: 0.1).
        coef: f64,
    },
    /// DRO (Direct Reward Optimization with a quadratic log-ratio penalty;
    /// verl 0.9 `compute_policy_loss_dro`): `ℓ = −(A · log π − ½ β (log π −
    /// log π_old)²)`, no clip.
    Dro {
        /// β of the quadratic penalty (verl's `policy_loss.dro_beta`).
        beta: f64,
    },
}

/// What an objective produced.
pub(super) enum ObjectiveLoss {
    /// A loss per token `[B, T]`.
    Tokens(Tensor),
    /// A loss per response `[B]` (GMPO), averaged over the step's responses.
    Responses(Tensor),
}

/// The loss of `objective` (not [`PolicyObjective::Clipped`]) and its clip
/// fraction, before the correction's weight and the aggregation.
pub(super) fn objective_loss(
    objective: PolicyObjective,
    logprobs: &Tensor,
    old_logprobs: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    behaviour_logprobs: Option<&Tensor>,
    (clip_low, clip_high): (f64, f64),
) -> (ObjectiveLoss, f64) {
    let log_ratio = &(logprobs - old_logprobs);
    match objective {
        PolicyObjective::Clipped => unreachable!("the clipped loss is policy_loss's own"),
        PolicyObjective::Cispo => {
            let ratio = log_ratio.clamp(-20.0, 20.0).exp();
            let clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach();
            let fraction = masked_mean(&ratio.ne_tensor(&clipped).to_kind(Kind::Float), mask);
            let loss = -(clipped * advantages * logprobs);
            (ObjectiveLoss::Tokens(loss), fraction.double_value(&[]))
        }
        PolicyObjective::Sapo { tau_pos, tau_neg } => {
            let ratio = log_ratio.clamp(-20.0, 20.0).exp();
            let positive = advantages.gt(0.0);
            let tau = Tensor::full_like(advantages, tau_neg).where_self(
                &positive.logical_not(),
                &Tensor::full_like(advantages, tau_pos),
            );
            let gate = ((ratio - 1.0) * &tau).sigmoid() * 4.0 / tau;
            (ObjectiveLoss::Tokens(-(gate * advantages)), 0.0)
        }
        PolicyObjective::GeoMean => {
            let sign = advantages.sign();
            let clamped = log_ratio.clamp(-clip_low, clip_high);
            let kept = (&sign * log_ratio).minimum(&(&sign * &clamped)) * &sign;
            let count = mask.sum_dim_intlist(-1, false, Kind::Double) + 1e-8;
            let ratio = ((kept * mask).sum_dim_intlist(-1, false, Kind::Double) / &count).exp();
            let mean_advantage =
                (advantages * mask).sum_dim_intlist(-1, false, Kind::Double) / count;
            let clipped = log_ratio
                .ne_tensor(&clamped)
                .logical_and(&advantages.gt(0.0));
            let fraction = masked_mean(&clipped.to_kind(Kind::Float), mask);
            (
                ObjectiveLoss::Responses(-(mean_advantage * ratio)),
                fraction.double_value(&[]),
            )
        }
        PolicyObjective::PolicyGradient => (ObjectiveLoss::Tokens(-(advantages * logprobs)), 0.0),
        PolicyObjective::Reinforce { cap } => {
            let weight = match behaviour_logprobs {
                Some(b) => (logprobs.detach() - b)
                    .clamp(-20.0, 20.0)
                    .exp()
                    .clamp_max(cap),
                None => Tensor::ones_like(logprobs),
            };
            let fraction = masked_mean(&weight.ge(cap).to_kind(Kind::Float), mask);
            (
                ObjectiveLoss::Tokens(-(weight * advantages * logprobs)),
                fraction.double_value(&[]),
            )
        }
        PolicyObjective::ClipCov { ratio, lb, ub } => {
            let r = log_ratio.exp();
            let pg1 = -(advantages * &r);
            let pg2 = -(advantages * r.clamp(1.0 - clip_low, 1.0 + clip_high));
            let valid = mask.gt(0.0);
            let by_clip = pg2.gt_tensor(&pg1).logical_and(&valid);
            let cov = covariance(advantages, logprobs, mask);
            let candidates = cov
                .gt(lb)
                .logical_and(&cov.lt(ub))
                .logical_and(&valid)
                .logical_and(&by_clip.logical_not());
            let count = ((ratio * mask.sum(Kind::Double).double_value(&[])) as i64).max(1);
            let cut = drawn(&candidates, count);
            let keep = cut.logical_not().to_kind(pg1.kind());
            let fraction = masked_mean(&cut.to_kind(Kind::Float), mask);
            (
                ObjectiveLoss::Tokens(pg1.maximum(&pg2) * keep),
                fraction.double_value(&[]),
            )
        }
        PolicyObjective::Dppo { divergence, cap } => {
            let ratio = log_ratio.clamp(-20.0, 20.0).exp();
            let truncated = ratio.clamp_max(cap).detach();
            let (lp, old_lp) = (logprobs.detach(), old_logprobs.detach());
            let (prob, old_prob) = (lp.exp(), old_lp.exp());
            let (up, down) = match divergence {
                GateDivergence::Tv => {
                    let moved = &prob - &old_prob;
                    (moved.le(clip_high), moved.ge(-clip_low))
                }
                GateDivergence::BinaryKl => {
                    let d = &old_prob * (&old_lp - &lp)
                        + (-&old_prob + 1.0)
                            * ((-&old_prob + 1.0 + 1e-8) / (-&prob + 1.0 + 1e-8)).log();
                    (
                        d.le(clip_high).logical_or(&prob.le_tensor(&old_prob)),
                        d.le(clip_low).logical_or(&prob.ge_tensor(&old_prob)),
                    )
                }
            };
            let valid = up
                .where_self(&advantages.gt(0.0), &down)
                .to_kind(logprobs.kind());
            let fraction = masked_mean(&(-&valid + 1.0), mask);
            let loss = -(advantages * truncated * logprobs * valid);
            (ObjectiveLoss::Tokens(loss), fraction.double_value(&[]))
        }
        PolicyObjective::KlCov { ratio, coef } => {
            let r = log_ratio.exp();
            let pg = -(advantages * &r);
            let cov = covariance(advantages, logprobs, mask);
            let valid = mask.gt(0.0);
            let n = valid.sum(Kind::Int64).int64_value(&[]);
            let k = ((n as f64 * ratio) as i64).max(1).min(n);
            let top = if n > 0 {
                let ranked = cov.where_self(&valid, &Tensor::full_like(&cov, f64::NEG_INFINITY));
                let threshold = ranked.flatten(0, -1).topk(k, 0, true, true).0.get(k - 1);
                ranked.ge_tensor(&threshold).logical_and(&valid)
            } else {
                valid.shallow_clone()
            };
            let penalty = log_ratio.abs() * coef * top.to_kind(pg.kind());
            (ObjectiveLoss::Tokens(pg + penalty), 0.0)
        }
        PolicyObjective::Dro { beta } => {
            let loss = -(advantages * logprobs - log_ratio.square() * (0.5 * beta));
            (ObjectiveLoss::Tokens(loss), 0.0)
        }
    }
}

/// `(A − mean A)(log π − mean log π)` per token, the means over `mask`, no gradient.
fn covariance(advantages: &Tensor, logprobs: &Tensor, mask: &Tensor) -> Tensor {
    let _guard = tch::no_grad_guard();
    let lp = logprobs.detach();
    (advantages - masked_mean(advantages, mask)) * (&lp - masked_mean(&lp, mask))
}

/// `count` of the `candidates` (a boolean `[B, T]`), chosen by a fixed
/// hash of their position (all of them when there are fewer).
fn drawn(candidates: &Tensor, count: i64) -> Tensor {
    let flat = Vec::<bool>::try_from(candidates.flatten(0, -1).to_kind(Kind::Bool))
        .expect("a boolean mask converts");
    let mut picked: Vec<(u64, usize)> = flat
        .iter()
        .enumerate()
        .filter(|(_, c)| **c)
        .map(|(i, _)| (splitmix(i as u64), i))
        .collect();
    picked.sort_unstable();
    let mut out = vec![false; flat.len()];
    for (_, i) in picked.into_iter().take(count as usize) {
        out[i] = true;
    }
    Tensor::from_slice(&out)
        .view(candidates.size().as_slice())
        .to_device(candidates.device())
}

/// SplitMix64's finaliser: a fixed, well-mixed hash of `x`.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::super::{policy_loss, Aggregation, PolicyLossConfig};
    use super::*;

    fn t(rows: &[&[f64]]) -> Tensor {
        let (b, n) = (rows.len() as i64, rows[0].len() as i64);
        Tensor::from_slice(&rows.concat()).view([b, n])
    }

    /// The loss and its gradient in `lp` under `cfg`.
    fn run(
        lp: &Tensor,
        old: &Tensor,
        adv: &Tensor,
        mask: &Tensor,
        cfg: &PolicyLossConfig,
    ) -> (f64, Vec<f64>) {
        let lp = lp.detach().set_requires_grad(true);
        let out = policy_loss(&lp, old, adv, mask, None, cfg);
        out.loss.backward();
        (
            out.loss_value(),
            Vec::<f64>::try_from(lp.grad().flatten(0, -1)).unwrap(),
        )
    }

    fn cfg(objective: PolicyObjective) -> PolicyLossConfig {
        PolicyLossConfig {
            objective,
            aggregation: Aggregation::TokenMean,
            ..Default::default()
        }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} vs {b}");
    }

    #[test]
    fn cispo_keeps_the_gradient_of_clipped_tokens() {
        // Ratios e^0.5 (clipped to 1.2) and 1; A = 1 and −2.
        let lp = t(&[&[-1.0, -2.0]]);
        let old = t(&[&[-1.5, -2.0]]);
        let adv = t(&[&[1.0, -2.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        let (loss, g) = run(&lp, &old, &adv, &mask, &cfg(PolicyObjective::Cispo));
        // ℓ = −c · A · log π per token: c = 1.2, A = 1, log π = −1; c = 1, A = −2, log π = −2.
        close(loss, (1.2 - 4.0) / 2.0);
        close(g[0], -1.2 / 2.0);
        close(g[1], 2.0 / 2.0);
    }

    #[test]
    fn sapo_gates_smoothly_and_matches_the_policy_gradient_at_ratio_one() {
        let lp = t(&[&[-1.0, -2.0, -0.5]]);
        let old = t(&[&[-1.0, -2.0, -1.0]]);
        let adv = t(&[&[1.0, -2.0, 1.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0]]);
        let (tau_pos, tau_neg) = (1.0, 1.05);
        let (loss, g) = run(
            &lp,
            &old,
            &adv,
            &mask,
            &cfg(PolicyObjective::Sapo { tau_pos, tau_neg }),
        );
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let r2 = 0.5f64.exp();
        let gate = [
            2.0 / tau_pos,
            2.0 / tau_neg,
            sigmoid(tau_pos * (r2 - 1.0)) * 4.0 / tau_pos,
        ];
        close(
            loss,
            -(gate[0] * 1.0 + gate[1] * -2.0 + gate[2] * 1.0) / 3.0,
        );
        // At r = 1, ∂f/∂log π = σ'(0) · 4 = 1: the plain policy gradient −A.
        close(g[0], -1.0 / 3.0);
        close(g[1], 2.0 / 3.0);
        // At r = e^0.5: −A · 4 σ(τ(r − 1))(1 − σ(τ(r − 1))) · r.
        let s = sigmoid(tau_pos * (r2 - 1.0));
        close(g[2], -4.0 * s * (1.0 - s) * r2 / 3.0);
    }

    #[test]
    fn gmpo_takes_the_geometric_mean_of_sign_clipped_ratios() {
        // Response 0: A = 1, δ = (0.5, −0.1): δ = 0.5 is clipped to ε_high = 0.2 (A > 0).
        // Response 1: A = −1, δ = (−0.5, 0.3, pad): −0.5 is clipped to −ε_low = −0.2.
        let lp = t(&[&[0.5, -0.1, 0.0], &[-0.5, 0.3, 9.0]]);
        let old = t(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
        let adv = t(&[&[1.0, 1.0, 0.0], &[-1.0, -1.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 0.0], &[1.0, 1.0, 0.0]]);
        let (loss, g) = run(&lp, &old, &adv, &mask, &cfg(PolicyObjective::GeoMean));
        let n: f64 = 2.0 + 1e-8;
        let r0 = ((0.2 - 0.1) / n).exp();
        let r1 = ((-0.2 + 0.3) / n).exp();
        let a = 2.0 / n;
        close(loss, (-(a * r0) + a * r1) / 2.0);
        assert_eq!(g[0], 0.0, "the clipped token has no gradient");
        close(g[1], -a * r0 / n / 2.0);
        assert_eq!(g[3], 0.0);
        close(g[4], a * r1 / n / 2.0);
        assert_eq!(g[5], 0.0, "padding");
    }

    #[test]
    fn the_policy_gradient_loss_is_minus_a_log_pi() {
        let lp = t(&[&[-1.0, -2.0]]);
        let old = t(&[&[-3.0, 0.0]]);
        let adv = t(&[&[0.5, -1.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        let (loss, g) = run(
            &lp,
            &old,
            &adv,
            &mask,
            &cfg(PolicyObjective::PolicyGradient),
        );
        close(loss, (0.5 - 2.0) / 2.0);
        close(g[0], -0.25);
        close(g[1], 0.5);
    }

    #[test]
    fn reinforce_weights_by_the_truncated_ratio_to_the_behaviour_policy() {
        // π / π_behaviour = e^0.5 ≈ 1.65 and e^1.5 ≈ 4.5 (truncated to the cap 2).
        let lp = t(&[&[-1.0, -1.0]]).set_requires_grad(true);
        let old = t(&[&[-1.0, -1.0]]);
        let behaviour = t(&[&[-1.5, -2.5]]);
        let adv = t(&[&[1.0, -1.0]]);
        let mask = t(&[&[1.0, 1.0]]);
        let out = policy_loss(
            &lp,
            &old,
            &adv,
            &mask,
            Some(&behaviour),
            &cfg(PolicyObjective::Reinforce { cap: 2.0 }),
        );
        let w0 = 0.5f64.exp();
        close(out.loss_value(), (w0 * 1.0 - 2.0 * 1.0) / 2.0);
        out.loss.backward();
        let g = Vec::<f64>::try_from(lp.grad().flatten(0, -1)).unwrap();
        close(g[0], -w0 / 2.0);
        close(g[1], 2.0 / 2.0);
        close(out.clip_fraction, 0.5);
    }

    #[test]
    fn clip_cov_cuts_the_gradient_of_a_high_covariance_token() {
        // Covariances: token 0 is far above the others; with bounds (1, 5) only it qualifies.
        let lp = t(&[&[0.0, -2.0, -2.0, -2.0]]);
        let old = lp.shallow_clone();
        let adv = t(&[&[2.0, 0.0, 0.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0, 1.0]]);
        let cov = covariance(&adv, &lp, &mask);
        let c = Vec::<f64>::try_from(cov.flatten(0, -1)).unwrap();
        assert!(
            c[0] > 1.0 && c[0] < 5.0 && c[1..].iter().all(|x| *x < 1.0),
            "{c:?}"
        );
        let clip_cov = cfg(PolicyObjective::ClipCov {
            ratio: 0.0002,
            lb: 1.0,
            ub: 5.0,
        });
        let (_, g) = run(&lp, &old, &adv, &mask, &clip_cov);
        assert_eq!(g[0], 0.0, "one token (the minimum of 1) is cut");
        let (_, plain) = run(&lp, &old, &adv, &mask, &cfg(PolicyObjective::Clipped));
        close(plain[0], -0.5);
    }

    #[test]
    fn kl_cov_penalises_the_largest_covariance_token() {
        let lp = t(&[&[0.0, -4.0, -4.0, -4.0]]);
        let old = t(&[&[0.5, -4.0, -4.0, -4.0]]);
        let adv = t(&[&[4.0, 0.0, 1.0, 0.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0, 1.0]]);
        let kl_cov = cfg(PolicyObjective::KlCov {
            ratio: 0.0002,
            coef: 0.1,
        });
        let (loss, g) = run(&lp, &old, &adv, &mask, &kl_cov);
        let r0 = (-0.5f64).exp();
        close(loss, (-4.0 * r0 + 0.1 * 0.5 - 1.0) / 4.0);
        // ∂/∂log π of −A r + coef |δ| at δ = −0.5: −A r − coef.
        close(g[0], (-4.0 * r0 - 0.1) / 4.0);
        close(g[2], -1.0 / 4.0);
    }
}
