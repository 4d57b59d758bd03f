//! verl 0.9's rejection sampling of rows whose behaviour policy strayed
//! from the proximal one: a chain of criteria, each a divergence statistic
//! at a level, every one of which a token must pass to stay in the loss.

use tch::Tensor;

/// The per-token divergence estimate of `log ρ = log π_old − log π_behaviour`
/// (clamped to ±20 first, as verl's `SAFETY_BOUND`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Divergence {
    /// K1 = −log ρ, kept inside a band [ln low, ln high].
    K1,
    /// K2 = ½ (log ρ)², kept at most `high`.
    K2,
    /// K3 = ρ − 1 − log ρ, kept at most `high`.
    K3,
}

/// Where a criterion reads its statistic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Each token on its own.
    Token,
    /// A response's sum over its tokens (one verdict for the response).
    SequenceSum,
    /// A response's mean over its tokens: `Σ / (tokens + 1e-8)`.
    SequenceMean,
    /// A response's largest token value (0 for a response without tokens).
    SequenceMax,
}

/// One criterion of a chain: verl's `rollout_rs` option (`token_k1`,
/// `seq_sum_k3`, `seq_max_k2`, …) with its threshold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Criterion {
    /// The statistic.
    pub divergence: Divergence,
    /// Its level.
    pub level: Level,
    /// K1's band on the ratio, `[low, high]` (its statistic is compared
    /// with `[ln low, ln high]`); K2 and K3 read `high` only.
    pub low: f64,
    /// The upper bound.
    pub high: f64,
}

/// The most criteria a chain holds: every distinct option of verl's.
const MOST: usize = 11;

/// A chain of rejection criteria (verl's comma-separated `rollout_rs`):
/// a token stays in the loss only if every criterion keeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RejectionChain {
    criteria: [Option<Criterion>; MOST],
}

impl RejectionChain {
    /// The chain `options` (verl's spelling: `token_k1`, `token_k2`,
    /// `token_k3`, `seq_sum_k1`…`seq_sum_k3`, `seq_mean_k1`…`seq_mean_k3`,
    /// `seq_max_k2`, `seq_max_k3`, comma-separated; empty: none) with
    /// `thresholds`: one spec shared by all, or one per option, comma
    /// separated; a K1 option takes `low_high` or `high` (low = 1/high),
    /// the others a single upper bound; every bound positive.
    pub fn parse(options: &str, thresholds: &str) -> Result<Self, String> {
        let mut names: Vec<&str> = Vec::new();
        for name in options.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        let mut chain = RejectionChain::default();
        if names.is_empty() {
            return Ok(chain);
        }
        let specs: Vec<&str> = thresholds
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let specs = match specs.len() {
            0 => return Err("a threshold is needed for each rejection criterion".into()),
            1 => vec![specs[0]; names.len()],
            n if n == names.len() => specs,
            n => {
                return Err(format!(
                    "{n} thresholds for {} criteria: give one shared or one each",
                    names.len()
                ))
            }
        };
        for (slot, (name, spec)) in chain.criteria.iter_mut().zip(names.iter().zip(specs)) {
            *slot = Some(Criterion::parse(name, spec)?);
        }
        Ok(chain)
    }

    /// Whether the chain has no criterion.
    pub fn is_empty(&self) -> bool {
        self.criteria[0].is_none()
    }

    /// The criteria in order.
    pub fn criteria(&self) -> impl Iterator<Item = &Criterion> {
        self.criteria.iter().flatten()
    }

    /// 1 where every criterion keeps the token, 0 elsewhere (and on
    /// padding), from `log ρ = old − behaviour` under `mask`; no gradient.
    pub fn keep(
        &self,
        old_logprobs: &Tensor,
        behaviour_logprobs: &Tensor,
        mask: &Tensor,
    ) -> Tensor {
        let _guard = tch::no_grad_guard();
        let log_rho = (old_logprobs - behaviour_logprobs)
            .detach()
            .clamp(-20.0, 20.0);
        let kind = log_rho.kind();
        // A copy: `to_kind` of a mask already of that kind is the mask
        // itself, which the products below must not change.
        let mut keep = mask.to_kind(kind).copy();
        let on = mask.to_kind(kind);
        for c in self.criteria() {
            let token = match c.divergence {
                Divergence::K1 => -&log_rho,
                Divergence::K2 => log_rho.square() * 0.5,
                Divergence::K3 => log_rho.exp() - 1.0 - &log_rho,
            };
            let statistic = match c.level {
                Level::Token => token,
                Level::SequenceSum => (&token * &on).sum_dim_intlist(-1, true, kind),
                Level::SequenceMean => {
                    (&token * &on).sum_dim_intlist(-1, true, kind)
                        / (on.sum_dim_intlist(-1, true, kind) + 1e-8)
                }
                Level::SequenceMax => {
                    let masked = token.masked_fill(&on.eq(0.0), f64::NEG_INFINITY);
                    let (max, _) = masked.max_dim(-1, true);
                    max.where_self(&max.ne(f64::NEG_INFINITY), &max.zeros_like())
                }
            };
            let kept = match c.divergence {
                Divergence::K1 => statistic
                    .ge(c.low.ln())
                    .logical_and(&statistic.le(c.high.ln())),
                Divergence::K2 | Divergence::K3 => statistic.le(c.high),
            };
            keep *= kept.to_kind(kind).expand_as(&log_rho);
        }
        keep
    }
}

impl Criterion {
    fn parse(name: &str, spec: &str) -> Result<Self, String> {
        let (level, divergence) = match name {
            "token_k1" => (Level::Token, Divergence::K1),
            "token_k2" => (Level::Token, Divergence::K2),
            "token_k3" => (Level::Token, Divergence::K3),
            "seq_sum_k1" => (Level::SequenceSum, Divergence::K1),
            "seq_sum_k2" => (Level::SequenceSum, Divergence::K2),
            "seq_sum_k3" => (Level::SequenceSum, Divergence::K3),
            "seq_mean_k1" => (Level::SequenceMean, Divergence::K1),
            "seq_mean_k2" => (Level::SequenceMean, Divergence::K2),
            "seq_mean_k3" => (Level::SequenceMean, Divergence::K3),
            "seq_max_k2" => (Level::SequenceMax, Divergence::K2),
            "seq_max_k3" => (Level::SequenceMax, Divergence::K3),
            other => {
                return Err(format!(
                    "`{other}` is not a rejection criterion (token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3)"
                ))
            }
        };
        let number = |s: &str| -> Result<f64, String> {
            match s.trim().parse::<f64>() {
                Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
                _ => Err(format!("{name}: `{s}` is not a positive number")),
            }
        };
        let (low, high) = match (divergence, spec.split_once('_')) {
            (Divergence::K1, Some((low, high))) => (number(low)?, number(high)?),
            (Divergence::K1, None) => {
                let high = number(spec)?;
                (1.0 / high, high)
            }
            (_, Some(_)) => {
                return Err(format!(
                    "{name}: `{spec}`: only K1 criteria take a low_high band; give one upper bound"
                ))
            }
            (_, None) => (0.0, number(spec)?),
        };
        if low > high {
            return Err(format!(
                "{name}: `{spec}`: the low bound is above the high one"
            ));
        }
        Ok(Criterion {
            divergence,
            level,
            low,
            high,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_parse_as_verl_spells_them_and_refuse_what_it_refuses() {
        let chain = RejectionChain::parse("token_k1, seq_max_k2,token_k1", "1.25").unwrap();
        let criteria: Vec<Criterion> = chain.criteria().copied().collect();
        // Duplicates once; one threshold shared; a K1 `high` alone means [1/high, high].
        assert_eq!(criteria.len(), 2);
        assert_eq!((criteria[0].low, criteria[0].high), (0.8, 1.25));
        assert_eq!(criteria[1].level, Level::SequenceMax);
        assert_eq!((criteria[1].low, criteria[1].high), (0.0, 1.25));
        let chain = RejectionChain::parse("seq_sum_k1,token_k3", "0.5_2,0.01").unwrap();
        let criteria: Vec<Criterion> = chain.criteria().copied().collect();
        assert_eq!((criteria[0].low, criteria[0].high), (0.5, 2.0));
        assert_eq!(criteria[1].high, 0.01);
        assert!(RejectionChain::parse("", "").unwrap().is_empty());
        for (options, thresholds, says) in [
            ("seq_max_k1", "2", "not a rejection criterion"),
            (
                "token_k2",
                "0.1_0.2",
                "only K1 criteria take a low_high band",
            ),
            ("token_k1", "2_0.5", "the low bound is above the high one"),
            ("token_k3", "-1", "not a positive number"),
            ("token_k1,token_k2,token_k3", "1,2", "3 criteria"),
            ("token_k1", "", "a threshold is needed"),
        ] {
            let err = RejectionChain::parse(options, thresholds).unwrap_err();
            assert!(err.contains(says), "{options} {thresholds}: {err}");
        }
    }

    #[test]
    fn a_token_stays_only_if_every_criterion_keeps_it() {
        // log ρ per token: response 0 (0.1, 1.0), response 1 (−0.05, 0.05), pad.
        let old = Tensor::from_slice(&[0.1f64, 1.0, 0.0, -0.05, 0.05, 0.0]).view([2, 3]);
        let behaviour = Tensor::zeros([2, 3], (tch::Kind::Double, tch::Device::Cpu));
        let mask = Tensor::from_slice(&[1.0f64, 1.0, 0.0, 1.0, 1.0, 0.0]).view([2, 3]);
        let keep = |options, thresholds| {
            let chain = RejectionChain::parse(options, thresholds).unwrap();
            Vec::<f64>::try_from(chain.keep(&old, &behaviour, &mask).flatten(0, -1)).unwrap()
        };
        // K2 per token: 0.005, 0.5 | 0.00125, 0.00125.
        assert_eq!(keep("token_k2", "0.1"), [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
        // Its largest token drops response 0 whole.
        assert_eq!(keep("seq_max_k2", "0.1"), [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
        // K1 = −log ρ in [ln 0.5, ln 2]: ρ = e is out; chained, both must keep.
        assert_eq!(keep("token_k1", "0.5_2"), [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
        assert_eq!(keep("token_k1", "0.97_2"), [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        assert_eq!(
            keep("token_k1,seq_max_k2", "0.5_2,0.1"),
            [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
        );
        // The caller's mask is left as it was (the loss aggregates over it).
        let after = Vec::<f64>::try_from(mask.flatten(0, -1)).unwrap();
        assert_eq!(after, [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]);
    }
}
