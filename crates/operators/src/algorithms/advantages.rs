//! Advantages and returns: GAE, group-relative baselines (GRPO, Dr.GRPO,
//! RLOO, REINFORCE++-baseline), discounted returns (REINFORCE++), and the
//! whitening applied after them.

use std::collections::BTreeMap;

use super::stats::{mean_std, Tokens};
use super::Flavor;

/// A group-relative estimator got a group it cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GroupError {
    /// OpenRLHF needs at least two samples per prompt for group baselines.
    #[error("group {group} has {size} sample(s); group baselines need at least 2 per prompt")]
    TooSmall {
        /// The group id.
        group: u64,
        /// Its number of samples.
        size: usize,
    },
    /// `scores` and `groups` differ in length.
    #[error("{scores} scores but {groups} group ids")]
    Length {
        /// Number of scores.
        scores: usize,
        /// Number of group ids.
        groups: usize,
    },
    /// ReMax needs one greedy baseline response per prompt.
    #[error("group {group} has {found} greedy baseline response(s); ReMax needs exactly 1")]
    Baseline {
        /// The group id.
        group: u64,
        /// Greedy responses found in it.
        found: usize,
    },
}

/// Group ids for OpenRLHF's grouping: consecutive blocks of `n` samples.
pub fn block_groups(samples: usize, n: usize) -> Vec<u64> {
    (0..samples).map(|i| (i / n.max(1)) as u64).collect()
}

fn members(scores: &[f64], groups: &[u64]) -> Result<BTreeMap<u64, Vec<usize>>, GroupError> {
    if scores.len() != groups.len() {
        return Err(GroupError::Length {
            scores: scores.len(),
            groups: groups.len(),
        });
    }
    let mut by_group: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, g) in groups.iter().enumerate() {
        by_group.entry(*g).or_default().push(i);
    }
    Ok(by_group)
}

/// ReMax (arXiv 2310.10505; verl `compute_remax_outcome_advantage`): each
/// token's return, the sum of the masked token rewards from it to the end,
/// minus the reward of the prompt's greedy response on every valid token:
/// `A_t = Σ_{t' ≥ t} m_{t'} r_{t'} − b · m_t`. With the score on the last
/// token only (rewards without a KL term) this is `score − b` on every
/// token. Returns `(advantages, returns)`.
pub fn remax(
    token_rewards: &[Vec<f64>],
    masks: &[Vec<f64>],
    baselines: &[f64],
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut advantages = Vec::with_capacity(token_rewards.len());
    let mut returns = Vec::with_capacity(token_rewards.len());
    for ((r, m), b) in token_rewards.iter().zip(masks).zip(baselines) {
        let mut ret = vec![0.0; r.len()];
        let mut running = 0.0;
        for t in (0..r.len()).rev() {
            running += r[t] * m[t];
            ret[t] = running;
        }
        advantages.push(ret.iter().zip(m).map(|(g, m)| g - b * m).collect());
        returns.push(ret);
    }
    (advantages, returns)
}

/// For each of `scores`, the score of its group's greedy response
/// (`greedy[i]` marks those): ReMax's baseline. Each group needs exactly one.
pub fn greedy_baselines(
    scores: &[f64],
    groups: &[u64],
    greedy: &[bool],
) -> Result<Vec<f64>, GroupError> {
    let mut out = vec![0.0; scores.len()];
    for (group, idx) in members(scores, groups)? {
        let found: Vec<usize> = idx.iter().copied().filter(|&i| greedy[i]).collect();
        if found.len() != 1 {
            return Err(GroupError::Baseline {
                group,
                found: found.len(),
            });
        }
        for &i in &idx {
            out[i] = scores[found[0]];
        }
    }
    Ok(out)
}

/// Generalised advantage estimation over token rewards `r`, values `V`, mask `m`.
///
/// `δ_t = r_t + γ V_{t+1} − V_t`, `A_t = δ_t + γλ A_{t+1}`, returns `R_t = A_t + V_t`.
/// - OpenRLHF: `r` and `V` are multiplied by the mask first and the recursion
///   runs over every position (a masked interior token is a step with
///   r = V = 0); `R = A + m·V`.
/// - verl: masked tokens are skipped — at a masked `t`, the carried `V_{t+1}`
///   and `A_{t+1}` pass through unchanged (its own `A_t` is still written);
///   `R = A + V`. verl then whitens the advantages ([`whiten_advantages`]).
pub fn gae(
    rewards: &Tokens,
    values: &Tokens,
    mask: &Tokens,
    gamma: f64,
    lambda: f64,
    flavor: Flavor,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut advantages = Vec::with_capacity(rewards.len());
    let mut returns = Vec::with_capacity(rewards.len());
    for ((r, v), m) in rewards.iter().zip(values).zip(mask) {
        let len = r.len();
        let mut adv = vec![0.0; len];
        match flavor {
            Flavor::OpenRlhf => {
                let (mut next_value, mut last) = (0.0, 0.0);
                for t in (0..len).rev() {
                    let (rt, vt) = (r[t] * m[t], v[t] * m[t]);
                    let delta = rt + gamma * next_value - vt;
                    last = delta + gamma * lambda * last;
                    adv[t] = last;
                    next_value = vt;
                }
                returns.push(
                    adv.iter()
                        .zip(v.iter().zip(m))
                        .map(|(a, (v, m))| a + v * m)
                        .collect(),
                );
            }
            Flavor::Verl => {
                let (mut next_value, mut last) = (0.0, 0.0);
                for t in (0..len).rev() {
                    let delta = r[t] + gamma * next_value - v[t];
                    let candidate = delta + gamma * lambda * last;
                    next_value = v[t] * m[t] + (1.0 - m[t]) * next_value;
                    last = candidate * m[t] + (1.0 - m[t]) * last;
                    adv[t] = last;
                }
                returns.push(adv.iter().zip(v).map(|(a, v)| a + v).collect());
            }
        }
        advantages.push(adv);
    }
    (advantages, returns)
}

/// Discounted returns `G_t = r_t + γ G_{t+1}` (REINFORCE++; its advantages
/// are these returns, whitened).
/// - OpenRLHF: rewards are multiplied by the mask, then `G` runs over every
///   position (a masked token is a step with reward 0 that still discounts).
/// - verl (`compute_reinforce_plus_plus_outcome_advantage`, 0.9): returns
///   are updated on unmasked tokens only. At a masked token `G_t = 0` and
///   the running return passes through unchanged (no reward, no discount),
///   so the tokens before a masked interior span (a multi-turn observation)
///   still receive the rewards after it; trailing padding stays 0.
pub fn discounted_returns(
    rewards: &Tokens,
    mask: &Tokens,
    gamma: f64,
    flavor: Flavor,
) -> Vec<Vec<f64>> {
    rewards
        .iter()
        .zip(mask)
        .map(|(r, m)| {
            let mut out = vec![0.0; r.len()];
            let mut g = 0.0;
            for t in (0..r.len()).rev() {
                match flavor {
                    Flavor::OpenRlhf => {
                        g = r[t] * m[t] + gamma * g;
                        out[t] = g;
                    }
                    Flavor::Verl if m[t] > 0.0 => {
                        g = r[t] + gamma * g;
                        out[t] = g;
                    }
                    Flavor::Verl => {}
                }
            }
            out
        })
        .collect()
}

/// GRPO's group-relative advantage of each response's scalar score:
/// `(s − mean_g) / (std_g + ε)`, or `s − mean_g` without `std` scaling
/// (Dr.GRPO, and REINFORCE++-baseline's shaping). The std is unbiased
/// (n − 1) in both. `groups[i]` is sample `i`'s group id ([`block_groups`]
/// gives OpenRLHF's consecutive blocks).
/// - OpenRLHF: ε = 1e-9; a group of one sample is an error.
/// - verl: ε = 1e-6; a group of one sample has mean 0 and std 1.
pub fn grpo(
    scores: &[f64],
    groups: &[u64],
    scale_by_std: bool,
    flavor: Flavor,
) -> Result<Vec<f64>, GroupError> {
    let eps = match flavor {
        Flavor::OpenRlhf => 1e-9,
        Flavor::Verl => 1e-6,
    };
    let mut out = vec![0.0; scores.len()];
    for (group, idx) in members(scores, groups)? {
        let xs: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
        let (mean, std) = match (xs.len(), flavor) {
            (1, Flavor::OpenRlhf) => return Err(GroupError::TooSmall { group, size: 1 }),
            (1, Flavor::Verl) => (0.0, 1.0),
            (_, Flavor::OpenRlhf | Flavor::Verl) => mean_std(&xs, true),
        };
        for &i in &idx {
            out[i] = if scale_by_std {
                (scores[i] - mean) / (std + eps)
            } else {
                scores[i] - mean
            };
        }
    }
    Ok(out)
}

/// GDPO's combined score (group reward-decoupled normalisation, arXiv
/// 2601.05242; verl 0.9 `compute_gdpo_outcome_advantage`): each reward
/// term normalised within its group on its own ([`grpo`] under verl's
/// semantics, by the std or not), then summed with the terms' weights,
/// `Σ_k w_k · Â_k`. verl then whitens that sum over the step's response
/// tokens ([`whiten_advantages_over`], verl's flavor): see [`gdpo`].
/// `terms[i]` holds row `i`'s score of every term, in `weights`' order.
pub fn gdpo_combined(
    terms: &[Vec<f64>],
    weights: &[f64],
    groups: &[u64],
    scale_by_std: bool,
) -> Result<Vec<f64>, GroupError> {
    let mut combined = vec![0.0; terms.len()];
    for (k, weight) in weights.iter().enumerate() {
        let scores: Vec<f64> = terms.iter().map(|row| row[k]).collect();
        let normalised = grpo(&scores, groups, scale_by_std, Flavor::Verl)?;
        for (sum, a) in combined.iter_mut().zip(normalised) {
            *sum += weight * a;
        }
    }
    Ok(combined)
}

/// GDPO's advantages on one worker: [`gdpo_combined`] on every response
/// token, whitened over the step's tokens (`mask`), zero off the mask.
pub fn gdpo(
    terms: &[Vec<f64>],
    weights: &[f64],
    groups: &[u64],
    mask: &Tokens,
    scale_by_std: bool,
) -> Result<Vec<Vec<f64>>, GroupError> {
    let alone = |_: &mut [f64]| Ok::<(), GroupError>(());
    gdpo_over(terms, weights, groups, mask, scale_by_std, alone)
}

/// [`gdpo`] of a step whose rows are split over data-parallel ranks (each
/// holding whole groups): `sum` adds the whitening's sums up over every
/// rank, as in [`whiten_advantages_over`].
pub fn gdpo_over<E: From<GroupError>>(
    terms: &[Vec<f64>],
    weights: &[f64],
    groups: &[u64],
    mask: &Tokens,
    scale_by_std: bool,
    sum: impl FnMut(&mut [f64]) -> Result<(), E>,
) -> Result<Vec<Vec<f64>>, E> {
    let combined = gdpo_combined(terms, weights, groups, scale_by_std)?;
    let tokens: Vec<Vec<f64>> = combined
        .iter()
        .zip(mask)
        .map(|(a, m)| m.iter().map(|k| a * k).collect())
        .collect();
    let whitened = whiten_advantages_over(&tokens, mask, false, Flavor::Verl, sum)?;
    Ok(whitened
        .into_iter()
        .zip(mask)
        .map(|(row, m)| row.iter().zip(m).map(|(a, k)| a * k).collect())
        .collect())
}

/// The optimal token baseline (verl 0.9 `compute_optimal_token_baseline_advantage`
/// and, for episodes whose responses hold tool output,
/// `compute_multi_turn_optimal_token_baseline_advantage`): a baseline per
/// position `k` of a group's generated tokens, weighted by each path's
/// accumulated variance,
/// `b_k = Σ_i G_i W_{i,k} / (Σ_i W_{i,k} + 1e-8)`, `W_{i,k} = Σ_{j ≤ k} (1 − 2π_{i,j} + Σ_v π_{i,j}(v)²)`,
/// where `k` counts only the model's own tokens (`masks`), `π_{i,j}` is the
/// sampled token's probability and `Σ π²` that of its whole distribution
/// (both the sampler's), and `G_i` the response's reward (the outcome
/// reward is every position's reward-to-go). `A_{i,k} = G_i − b_k`. A group
/// of one has baseline 0; so do the positions of a group's single longest
/// response past its second longest (verl's `handle_zero_tail`). Returns
/// per-token advantages on `masks`' positions, 0 on the others.
pub fn optimal_token_baseline(
    rewards: &[f64],
    logprobs: &Tokens,
    sum_pi_squared: &Tokens,
    masks: &Tokens,
    groups: &[u64],
) -> Result<Vec<Vec<f64>>, GroupError> {
    // Each row's generated positions and their accumulated path variance.
    let mut positions: Vec<Vec<usize>> = Vec::with_capacity(rewards.len());
    let mut variance: Vec<Vec<f64>> = Vec::with_capacity(rewards.len());
    for ((lp, sq), m) in logprobs.iter().zip(sum_pi_squared).zip(masks) {
        let kept: Vec<usize> = (0..m.len()).filter(|&t| m[t] > 0.0).collect();
        let mut total = 0.0;
        let w = kept
            .iter()
            .map(|&t| {
                total += 1.0 - 2.0 * lp[t].exp() + sq[t];
                total
            })
            .collect();
        positions.push(kept);
        variance.push(w);
    }
    let mut advantages: Vec<Vec<f64>> = masks.iter().map(|m| vec![0.0; m.len()]).collect();
    for (_, rows) in members(rewards, groups)? {
        let rows: Vec<usize> = rows
            .into_iter()
            .filter(|&i| !positions[i].is_empty())
            .collect();
        let longest = rows.iter().map(|&i| positions[i].len()).max().unwrap_or(0);
        let mut baseline = vec![0.0; longest];
        if rows.len() > 1 {
            let (mut weighted, mut weights) = (vec![0.0; longest], vec![0.0; longest]);
            for &i in &rows {
                for (k, w) in variance[i].iter().enumerate() {
                    weighted[k] += rewards[i] * w;
                    weights[k] += w;
                }
            }
            for k in 0..longest {
                baseline[k] = weighted[k] / (weights[k] + 1e-8);
            }
        }
        // The single longest response's tail past the second longest: no baseline.
        let mut lengths: Vec<usize> = rows.iter().map(|&i| positions[i].len()).collect();
        lengths.sort_unstable();
        let tail = match lengths[..] {
            [.., second, first] if first > second => rows
                .iter()
                .copied()
                .find(|&i| positions[i].len() == first)
                .map(|i| (i, second)),
            _ => None,
        };
        for &i in &rows {
            for (k, &t) in positions[i].iter().enumerate() {
                let b = match tail {
                    Some((row, from)) if row == i && k >= from => 0.0,
                    _ => baseline[k],
                };
                advantages[i][t] = rewards[i] - b;
            }
        }
    }
    Ok(advantages)
}

/// OPO's optimal baseline (arXiv 2505.23585; verl
/// `compute_opo_outcome_advantage`): each score minus its group's
/// length-weighted mean score, `s_i − Σ_g |y_j| s_j / Σ_g |y_j|`, with
/// `|y|` the response length in tokens. A group of one sample has baseline 0.
pub fn opo(scores: &[f64], lengths: &[usize], groups: &[u64]) -> Result<Vec<f64>, GroupError> {
    let mut out = vec![0.0; scores.len()];
    for (_, idx) in members(scores, groups)? {
        let baseline = if idx.len() == 1 {
            0.0
        } else {
            let total: f64 = idx.iter().map(|&i| lengths[i] as f64).sum();
            let weighted: f64 = idx.iter().map(|&i| lengths[i] as f64 * scores[i]).sum();
            weighted / total
        };
        for &i in &idx {
            out[i] = scores[i] - baseline;
        }
    }
    Ok(out)
}

/// Pass@k advantages in GRPO's form (arXiv 2503.19595; verl
/// `compute_grpo_passk_outcome_advantage`): in each group only the best
/// response gets an advantage, `r_max − r_second`, divided by the group's
/// (unbiased) std + ε (ε = 1e-6) when `scale_by_std`; every other response
/// gets 0. Among equal best scores the first gets it (the advantage is then
/// 0 anyway). Groups need at least two samples.
pub fn grpo_passk(
    scores: &[f64],
    groups: &[u64],
    scale_by_std: bool,
) -> Result<Vec<f64>, GroupError> {
    let mut out = vec![0.0; scores.len()];
    for (group, idx) in members(scores, groups)? {
        if idx.len() < 2 {
            return Err(GroupError::TooSmall {
                group,
                size: idx.len(),
            });
        }
        let mut order = idx.clone();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let (best, second) = (order[0], order[1]);
        let mut advantage = scores[best] - scores[second];
        if scale_by_std {
            let xs: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
            advantage /= mean_std(&xs, true).1 + 1e-6;
        }
        out[best] = advantage;
    }
    Ok(out)
}

/// GPG's advantages (arXiv 2504.02546; verl `compute_gpg_outcome_advantage`):
/// `α (s − mean_g) / f_norm` with `α = B / max(1, #{s ≠ 0})` over the `B`
/// scores given (the step), `f_norm = 1`; a group of one sample has mean 0.
pub fn gpg(scores: &[f64], groups: &[u64]) -> Result<Vec<f64>, GroupError> {
    let (total, nonzero) = gpg_counts(scores);
    gpg_with_alpha(scores, groups, gpg_alpha(total, nonzero))
}

/// GPG's counts over `scores`: `(B, #{s ≠ 0})` (to be summed over the
/// data-parallel ranks that share a step).
pub fn gpg_counts(scores: &[f64]) -> (f64, f64) {
    let nonzero = scores.iter().filter(|s| **s != 0.0).count();
    (scores.len() as f64, nonzero as f64)
}

/// GPG's `α = B / max(1, #{s ≠ 0})` from a step's counts.
pub fn gpg_alpha(total: f64, nonzero: f64) -> f64 {
    total / nonzero.max(1.0)
}

/// [`gpg`] with a given `α` (the whole step's, when the step is split over ranks).
pub fn gpg_with_alpha(scores: &[f64], groups: &[u64], alpha: f64) -> Result<Vec<f64>, GroupError> {
    let mut out = vec![0.0; scores.len()];
    for (_, idx) in members(scores, groups)? {
        let mean = if idx.len() == 1 {
            0.0
        } else {
            idx.iter().map(|&i| scores[i]).sum::<f64>() / idx.len() as f64
        };
        for &i in &idx {
            out[i] = alpha * (scores[i] - mean);
        }
    }
    Ok(out)
}

/// RLOO: each score minus the mean of the *other* samples of its group,
/// `s_i − (Σ_g s − s_i) / (n − 1)` (= `(n s_i − Σ_g s) / (n − 1)`, verl's form).
/// - OpenRLHF: a group of one sample is an error.
/// - verl: a group of one sample keeps its score.
pub fn rloo(scores: &[f64], groups: &[u64], flavor: Flavor) -> Result<Vec<f64>, GroupError> {
    let mut out = vec![0.0; scores.len()];
    for (group, idx) in members(scores, groups)? {
        let n = idx.len();
        if n == 1 {
            match flavor {
                Flavor::OpenRlhf => return Err(GroupError::TooSmall { group, size: 1 }),
                Flavor::Verl => {
                    out[idx[0]] = scores[idx[0]];
                    continue;
                }
            }
        }
        let sum: f64 = idx.iter().map(|&i| scores[i]).sum();
        for &i in &idx {
            out[i] = scores[i] - (sum - scores[i]) / (n as f64 - 1.0);
        }
    }
    Ok(out)
}

/// Whitening of advantages over the whole batch, applied to every position
/// (padding included; the loss mask removes it later).
/// - OpenRLHF: `mean = ΣmA / Σm`, biased `var = Σm(A − mean)² / Σm`,
///   `A ← (A − mean) / sqrt(max(var, 1e-8))`; with `mean_only`, `A − mean`.
///   OpenRLHF applies it after GAE, REINFORCE++ and REINFORCE++-baseline
///   only (not after RLOO, GRPO, Dr.GRPO).
/// - verl: `masked_whiten`: unbiased var, `A ← (A − mean) / sqrt(var + 1e-8)`.
pub fn whiten_advantages(
    advantages: &Tokens,
    mask: &Tokens,
    mean_only: bool,
    flavor: Flavor,
) -> Vec<Vec<f64>> {
    let alone = |_: &mut [f64]| Ok::<(), std::convert::Infallible>(());
    match whiten_advantages_over(advantages, mask, mean_only, flavor, alone) {
        Ok(whitened) => whitened,
        Err(never) => match never {},
    }
}

/// [`whiten_advantages`] of a step whose rows are split over data-parallel
/// ranks: `sum` adds its numbers up over every rank (in place, the same
/// result on each), so the mean and variance are the whole step's. It is
/// called twice (the mean's sums, then the variance's; once with
/// `mean_only`), on every rank, whether or not the rank holds rows. On one
/// rank (`sum` leaving its numbers as they are) it is [`whiten_advantages`].
pub fn whiten_advantages_over<E>(
    advantages: &Tokens,
    mask: &Tokens,
    mean_only: bool,
    flavor: Flavor,
    mut sum: impl FnMut(&mut [f64]) -> Result<(), E>,
) -> Result<Vec<Vec<f64>>, E> {
    // The sums of `masked_mean` and `masked_var`, in their order.
    let mut first = [0.0, 0.0];
    for (v, m) in advantages.iter().zip(mask) {
        for (x, k) in v.iter().zip(m) {
            first[0] += x * k;
            first[1] += k;
        }
    }
    sum(&mut first)?;
    let [total, count] = first;
    let mean = if count == 0.0 { 0.0 } else { total / count };
    let scale = if mean_only {
        1.0
    } else {
        let mut squares = [0.0];
        for (v, m) in advantages.iter().zip(mask) {
            for (x, k) in v.iter().zip(m) {
                squares[0] += (x - mean) * (x - mean) * k;
            }
        }
        sum(&mut squares)?;
        let biased = if count == 0.0 {
            0.0
        } else {
            squares[0] / count
        };
        match flavor {
            Flavor::OpenRlhf => 1.0 / biased.max(1e-8).sqrt(),
            Flavor::Verl => {
                let unbiased = if count > 1.0 {
                    biased * count / (count - 1.0)
                } else {
                    biased
                };
                1.0 / (unbiased + 1e-8).sqrt()
            }
        }
    };
    Ok(advantages
        .iter()
        .map(|row| row.iter().map(|a| (a - mean) * scale).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::stats::{masked_mean, masked_var};

    #[test]
    fn remax_subtracts_the_greedy_reward_from_each_return() {
        // Two responses; the second has a masked interior token.
        let r = vec![vec![0.0, 0.0, 1.0], vec![0.5, 0.0, 0.0, 2.0]];
        let m = vec![vec![1.0, 1.0, 1.0], vec![1.0, 0.0, 1.0, 1.0]];
        let (a, g) = remax(&r, &m, &[0.25, 1.0]);
        assert_eq!(g, vec![vec![1.0, 1.0, 1.0], vec![2.5, 2.0, 2.0, 2.0]]);
        assert_eq!(a, vec![vec![0.75, 0.75, 0.75], vec![1.5, 2.0, 1.0, 1.0]]);
        let b = greedy_baselines(
            &[1.0, 0.0, 3.0, 2.0, 5.0],
            &[7, 7, 7, 8, 8],
            &[false, true, false, true, false],
        )
        .unwrap();
        assert_eq!(b, vec![0.0, 0.0, 0.0, 2.0, 2.0]);
        let err = greedy_baselines(&[1.0, 0.0], &[7, 7], &[false, false]).unwrap_err();
        assert!(err.to_string().contains("group 7 has 0 greedy"), "{err}");
    }

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn gae_by_hand() {
        // One response of 3 tokens, γ = 0.9, λ = 0.8, reward on the last token.
        let r = vec![vec![0.0, 0.0, 1.0]];
        let v = vec![vec![0.5, 0.4, 0.3]];
        let m = vec![vec![1.0, 1.0, 1.0]];
        let (a, ret) = gae(&r, &v, &m, 0.9, 0.8, Flavor::OpenRlhf);
        let d2 = 1.0 - 0.3;
        let d1 = 0.0 + 0.9 * 0.3 - 0.4;
        let d0 = 0.0 + 0.9 * 0.4 - 0.5;
        let a2 = d2;
        let a1 = d1 + 0.72 * a2;
        let a0 = d0 + 0.72 * a1;
        close(&a[0], &[a0, a1, a2]);
        close(&ret[0], &[a0 + 0.5, a1 + 0.4, a2 + 0.3]);
        // With a full mask both flavors agree.
        let (av, rv) = gae(&r, &v, &m, 0.9, 0.8, Flavor::Verl);
        close(&av[0], &a[0]);
        close(&rv[0], &ret[0]);
    }

    #[test]
    fn gae_with_gamma_lambda_one_is_reward_to_go_minus_values() {
        let r = vec![vec![0.1, -0.2, 0.3, 1.0], vec![0.5, 0.0]];
        let v = vec![vec![0.2, 0.1, -0.3, 0.4], vec![0.7, 0.1]];
        let m = vec![vec![1.0; 4], vec![1.0, 1.0]];
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            let (a, ret) = gae(&r, &v, &m, 1.0, 1.0, flavor);
            for i in 0..2 {
                let togo: Vec<f64> = (0..r[i].len()).map(|t| r[i][t..].iter().sum()).collect();
                let want: Vec<f64> = togo.iter().zip(&v[i]).map(|(g, v)| g - v).collect();
                close(&a[i], &want);
                close(&ret[i], &togo);
            }
        }
    }

    #[test]
    fn masked_interior_tokens_follow_each_flavor() {
        // Token 1 is masked (an observation inside a multi-turn response).
        let r = vec![vec![0.0, 5.0, 1.0]];
        let v = vec![vec![0.2, 9.0, 0.3]];
        let m = vec![vec![1.0, 0.0, 1.0]];
        let (a, _) = gae(&r, &v, &m, 1.0, 1.0, Flavor::OpenRlhf);
        // OpenRLHF: the masked step has r = V = 0 and still chains.
        close(&a[0], &[1.0 - 0.2, 1.0, 1.0 - 0.3]);
        let (a, _) = gae(&r, &v, &m, 1.0, 1.0, Flavor::Verl);
        // verl: the masked step is skipped: A_0 = r_0 + V_2 − V_0 + (A_2 − ... ) = (0 + 0.3 − 0.2) + (1 − 0.3).
        close(&a[0], &[0.3 - 0.2 + 0.7, 0.7, 0.7]);
        let g = discounted_returns(&r, &m, 1.0, Flavor::OpenRlhf);
        close(&g[0], &[1.0, 1.0, 1.0]);
        let g = discounted_returns(&r, &m, 1.0, Flavor::Verl);
        // verl 0.9: the masked token's return is 0 and its reward unused;
        // the return after it reaches token 0 unchanged.
        close(&g[0], &[1.0, 0.0, 1.0]);
        // Gaps with discounting: γ applies once per unmasked token, none across a gap.
        let r = vec![vec![0.5, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0]];
        let m = vec![vec![1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]];
        let g = discounted_returns(&r, &m, 0.5, Flavor::Verl);
        let g5 = 1.0;
        let g3 = 2.0 + 0.5 * g5;
        close(&g[0], &[0.5 + 0.5 * g3, 0.0, 0.0, g3, 0.0, g5, 0.0]);
    }

    #[test]
    fn opo_passk_and_gpg_by_hand() {
        let scores = [1.0, 0.0, 0.5, 2.0, 2.0, 7.0];
        let lengths = [2, 6, 4, 1, 3, 5];
        let groups = [0, 0, 0, 1, 1, 2];
        // OPO: group 0's baseline (2·1 + 6·0 + 4·0.5) / 12 = 1/3; group 1's (2 + 6) / 4 = 2.
        close(
            &opo(&scores, &lengths, &groups).unwrap(),
            &[2.0 / 3.0, -1.0 / 3.0, 0.5 - 1.0 / 3.0, 0.0, 0.0, 7.0],
        );
        // Pass@k: only the best of a group gets r_max − r_second (÷ std + 1e-6).
        let g = [0, 0, 0, 1, 1];
        close(
            &grpo_passk(&scores[..5], &g, false).unwrap(),
            &[0.5, 0.0, 0.0, 0.0, 0.0],
        );
        let std = mean_std(&[1.0, 0.0, 0.5], true).1;
        close(
            &grpo_passk(&scores[..5], &g, true).unwrap(),
            &[0.5 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0],
        );
        assert!(
            grpo_passk(&scores, &groups, true).is_err(),
            "a group of one"
        );
        // GPG: α = 6 / 5 non-zero scores; the singleton keeps α · s.
        let a = 6.0 / 5.0;
        close(
            &gpg(&scores, &groups).unwrap(),
            &[a * 0.5, a * -0.5, 0.0, 0.0, 0.0, a * 7.0],
        );
    }

    #[test]
    fn grpo_sums_to_zero_per_group_and_matches_by_hand() {
        let scores = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5];
        let groups = block_groups(8, 4);
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            let a = grpo(&scores, &groups, true, flavor).unwrap();
            for g in 0..2 {
                let s: f64 = a[g * 4..g * 4 + 4].iter().sum();
                assert!(s.abs() < 1e-9, "group {g} sums to {s}");
            }
        }
        let a = grpo(&scores, &groups, true, Flavor::OpenRlhf).unwrap();
        let std = (1.0f64 / 3.0).sqrt(); // [1,0,0,1]: mean 0.5, unbiased var 1/3
        assert!((a[0] - 0.5 / (std + 1e-9)).abs() < 1e-12);
        let dr = grpo(&scores, &groups, false, Flavor::OpenRlhf).unwrap();
        close(&dr[..4], &[0.5, -0.5, -0.5, 0.5]);
        // Groups by id, in any order (verl); a singleton keeps its score.
        let a = grpo(&[2.0, 5.0, 4.0], &[7, 3, 7], false, Flavor::Verl).unwrap();
        close(&a, &[-1.0, 5.0, 1.0]); // group 3 is a singleton: mean 0 in verl
        assert!(matches!(
            grpo(&[1.0], &[0], true, Flavor::OpenRlhf),
            Err(GroupError::TooSmall { .. })
        ));
        close(
            &grpo(&[3.0], &[0], true, Flavor::Verl).unwrap(),
            &[3.0 / (1.0 + 1e-6)],
        );
    }

    #[test]
    fn rloo_baseline_excludes_the_sample() {
        let scores = [1.0, 2.0, 6.0];
        let a = rloo(&scores, &[0, 0, 0], Flavor::OpenRlhf).unwrap();
        close(&a, &[1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5]);
        // Changing a sample's own score moves its baseline not at all.
        let b = rloo(&[10.0, 2.0, 6.0], &[0, 0, 0], Flavor::Verl).unwrap();
        assert!(((10.0 - b[0]) - (1.0 - a[0])).abs() < 1e-12);
        assert!(rloo(&[1.0, 2.0], &[0, 1], Flavor::OpenRlhf).is_err());
        close(
            &rloo(&[1.0, 2.0], &[0, 1], Flavor::Verl).unwrap(),
            &[1.0, 2.0],
        );
    }

    #[test]
    fn whitening_over_ranks_is_whitening_of_the_whole_step() {
        let a = vec![vec![1.0, 2.0, 3.0], vec![-4.0, 0.5], vec![7.0]];
        let m = vec![vec![1.0, 1.0, 0.0], vec![1.0, 1.0], vec![1.0]];
        for flavor in [Flavor::OpenRlhf, Flavor::Verl] {
            for mean_only in [false, true] {
                let whole = whiten_advantages(&a, &m, mean_only, flavor);
                // The reference computation, by the masked statistics.
                let mean = masked_mean(&a, &m);
                let scale = match (mean_only, flavor) {
                    (true, _) => 1.0,
                    (false, Flavor::OpenRlhf) => 1.0 / masked_var(&a, &m, false).max(1e-8).sqrt(),
                    (false, Flavor::Verl) => 1.0 / (masked_var(&a, &m, true) + 1e-8).sqrt(),
                };
                for (row, w) in a.iter().zip(&whole) {
                    for (x, y) in row.iter().zip(w) {
                        assert!(((x - mean) * scale - y).abs() < 1e-12);
                    }
                }
                // Two ranks: rows 0..1 and 1..3, the sums exchanged by hand.
                let parts = [(0..1), (1..3)];
                let firsts: Vec<[f64; 2]> = parts
                    .iter()
                    .map(|r| {
                        let mut s = [0.0; 2];
                        for (v, k) in a[r.clone()].iter().zip(&m[r.clone()]) {
                            for (x, w) in v.iter().zip(k) {
                                s[0] += x * w;
                                s[1] += w;
                            }
                        }
                        s
                    })
                    .collect();
                let total = [firsts[0][0] + firsts[1][0], firsts[0][1] + firsts[1][1]];
                let mut squares = [0.0; 2];
                let mean = total[0] / total[1];
                for (i, r) in parts.iter().enumerate() {
                    for (v, k) in a[r.clone()].iter().zip(&m[r.clone()]) {
                        for (x, w) in v.iter().zip(k) {
                            squares[i] += (x - mean) * (x - mean) * w;
                        }
                    }
                }
                for (i, r) in parts.iter().enumerate() {
                    let mut round = 0;
                    let sum = |xs: &mut [f64]| {
                        if round == 0 {
                            xs.copy_from_slice(&total);
                        } else {
                            xs[0] = squares[0] + squares[1];
                        }
                        round += 1;
                        Ok::<(), ()>(())
                    };
                    let part = whiten_advantages_over(
                        &a[r.clone()],
                        &m[r.clone()],
                        mean_only,
                        flavor,
                        sum,
                    )
                    .unwrap();
                    for (p, w) in part.iter().flatten().zip(whole[r.clone()].iter().flatten()) {
                        assert!((p - w).abs() < 1e-12, "rank {i}: {p} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn whitening_flavors_differ_only_in_the_variance() {
        let a = vec![vec![1.0, 2.0, 3.0, 50.0]];
        let m = vec![vec![1.0, 1.0, 1.0, 0.0]];
        let o = whiten_advantages(&a, &m, false, Flavor::OpenRlhf);
        let v = whiten_advantages(&a, &m, false, Flavor::Verl);
        let so = (2.0f64 / 3.0).sqrt();
        close(&o[0][..3], &[-1.0 / so, 0.0, 1.0 / so]);
        let sv = (1.0f64 + 1e-8).sqrt();
        close(&v[0][..3], &[-1.0 / sv, 0.0, 1.0 / sv]);
        assert!(
            (o[0][3] - 48.0 / so).abs() < 1e-9,
            "padding is transformed too"
        );
        close(
            &whiten_advantages(&a, &m, true, Flavor::OpenRlhf)[0],
            &[-1.0, 0.0, 1.0, 48.0],
        );
    }
}
