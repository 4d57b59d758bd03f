//! Picking one token from a row of logits, the same processors in the same
//! order as the libtorch path (`sampling::pick`): temperature, top-k, top-p,
//! then an inverse-CDF draw with the sequence's own uniform number.

use super::math;
use crate::sampling::{Pick, SamplingParams};

/// Reusable buffers for [`pick`].
#[derive(Debug, Default)]
pub struct Picker {
    probs: Vec<f32>,
    order: Vec<u32>,
}

impl Picker {
    /// Picks a token from `logits` (overwritten) with uniform `u` in [0, 1);
    /// returns it and its log-prob under the distribution it was drawn from
    /// (and, with `params.sum_pi_squared`, that distribution's `Σ π²`).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    pub unsafe fn pick(&mut self, logits: &mut [f32], params: &SamplingParams, u: f32) -> Pick {
        let vocab = logits.len();
        if params.greedy {
            // The first of the largest, as argmax does.
            let mut best = 0;
            for (i, &v) in logits.iter().enumerate() {
                if v > logits[best] {
                    best = i;
                }
            }
            let logp = logits[best] - self.log_sum_exp(logits);
            return Pick {
                token: best as i64,
                logprob: logp,
                sum_pi_squared: self.sum_squares(params),
            };
        }
        let temperature = params.temperature as f32;
        for v in logits.iter_mut() {
            *v /= temperature;
        }
        if let Some(k) = params.top_k.filter(|&k| k < vocab) {
            self.probs.clear();
            self.probs.extend_from_slice(logits);
            let (_, kth, _) = self
                .probs
                .select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            let kth = *kth;
            for v in logits.iter_mut() {
                if *v < kth {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(p) = params.top_p.filter(|&p| p < 1.0) {
            self.order.clear();
            self.order.extend(0..vocab as u32);
            self.order
                .sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            let top = logits[self.order[0] as usize];
            let total: f64 = self
                .exp_shifted(logits, top)
                .iter()
                .map(|&e| e as f64)
                .sum();
            // Drop a token when the tokens before it already reach p (as HF's
            // and vLLM's top-p: the smallest set of mass ≥ p); the first always stays.
            let mut before = 0.0f64;
            for &i in &self.order {
                let i = i as usize;
                let prob = self.probs[i] as f64 / total;
                if before >= p {
                    logits[i] = f32::NEG_INFINITY;
                }
                before += prob;
            }
        }
        let lse = self.log_sum_exp(logits);
        // Inverse CDF: the first token whose cumulative probability exceeds u·total.
        let mut total = 0.0f64;
        for &e in &self.probs {
            total += e as f64;
        }
        let target = u as f64 * total;
        let mut cumulative = 0.0f64;
        let mut token = vocab - 1;
        for (i, &e) in self.probs.iter().enumerate() {
            cumulative += e as f64;
            if cumulative > target {
                token = i;
                break;
            }
        }
        Pick {
            token: token as i64,
            logprob: logits[token] - lse,
            sum_pi_squared: self.sum_squares(params),
        }
    }

    /// `Σ π²` of the distribution whose shifted exponentials
    /// [`Picker::log_sum_exp`] left in `self.probs` (0 unless asked for).
    fn sum_squares(&self, params: &SamplingParams) -> f32 {
        if !params.sum_pi_squared {
            return 0.0;
        }
        let (mut total, mut squares) = (0.0f64, 0.0f64);
        for &e in &self.probs {
            total += e as f64;
            squares += e as f64 * e as f64;
        }
        (squares / (total * total)) as f32
    }

    /// `exp(x − shift)` of every logit into `self.probs` (−∞ gives 0).
    unsafe fn exp_shifted(&mut self, logits: &[f32], shift: f32) -> &[f32] {
        self.probs.clear();
        self.probs.extend(logits.iter().map(|&v| v - shift));
        math::exp_in_place(&mut self.probs);
        for (e, &v) in self.probs.iter_mut().zip(logits) {
            if v == f32::NEG_INFINITY {
                *e = 0.0;
            }
        }
        &self.probs
    }

    /// `log softmax(logits)[target]`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    pub unsafe fn log_prob(&mut self, logits: &[f32], target: usize) -> f32 {
        logits[target] - self.log_sum_exp(logits)
    }

    /// `log Σ exp(logits)`; leaves the shifted exponentials in `self.probs`.
    unsafe fn log_sum_exp(&mut self, logits: &[f32]) -> f32 {
        let top = math::max(logits);
        let sum: f64 = self
            .exp_shifted(logits, top)
            .iter()
            .map(|&e| e as f64)
            .sum();
        top + sum.ln() as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Σ π²` is that of the distribution a token is drawn from (after the
    /// temperature and the truncations; greedy: the plain softmax), on the
    /// libtorch path and the CPU kernels' picker alike.
    #[test]
    fn sum_pi_squared_is_that_of_the_sampled_distribution() {
        let logits = [1.5f32, 0.2, -0.7, 2.0, 0.0];
        let by_hand = |t: f64, keep: usize| {
            let mut x: Vec<f64> = logits.iter().map(|&l| f64::from(l) / t).collect();
            x.sort_by(|a, b| b.total_cmp(a));
            x.truncate(keep);
            let z: f64 = x.iter().map(|v| v.exp()).sum();
            x.iter().map(|v| (v.exp() / z).powi(2)).sum::<f64>()
        };
        let cases = [
            (false, 0.7, None, by_hand(0.7, 5)),
            (false, 1.3, Some(3), by_hand(1.3, 3)),
            (true, 1.0, None, by_hand(1.0, 5)),
        ];
        for (greedy, temperature, top_k, want) in cases {
            let params = SamplingParams {
                greedy,
                temperature,
                top_k,
                sum_pi_squared: true,
                ..Default::default()
            };
            let rows = tch::Tensor::from_slice(&logits).view([1, -1]);
            let (_, _, squares) = crate::sampling::pick(&rows, &params, &[0.3]);
            let got = Vec::<f32>::try_from(squares.unwrap()).unwrap()[0];
            assert!(
                (f64::from(got) - want).abs() < 1e-6,
                "libtorch {got} vs {want}"
            );
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                let mut row = logits.to_vec();
                // SAFETY: AVX2 and FMA were just detected.
                let pick = unsafe { Picker::default().pick(&mut row, &params, 0.3) };
                let got = f64::from(pick.sum_pi_squared);
                assert!((got - want).abs() < 1e-6, "cpu {got} vs {want}");
            }
        }
    }

    /// Top-p keeps the smallest set of tokens whose mass reaches p (HF's
    /// and vLLM's rule), a tie at the boundary included, on the CPU
    /// kernels' picker and on the libtorch path alike.
    #[test]
    fn top_p_keeps_the_smallest_set_that_reaches_p() {
        // (logits, top_p, how many tokens may be drawn, the first token's log-prob)
        let cases = [
            (vec![0.0f32; 4], 0.5, 2, (0.5f64).ln()),
            (vec![2f32.ln(), 0.0, 0.0], 0.75, 2, (2.0f64 / 3.0).ln()),
            (vec![2f32.ln(), 0.0, 0.0], 0.8, 3, (0.5f64).ln()),
        ];
        for (logits, p, kept, first) in cases {
            let params = SamplingParams {
                top_p: Some(p),
                top_k: None,
                temperature: 1.0,
                ..Default::default()
            };
            let uniforms: Vec<f32> = (0..200).map(|i| i as f32 / 200.0).collect();
            let rows = tch::Tensor::from_slice(&logits)
                .view([1, -1])
                .repeat([uniforms.len() as i64, 1]);
            let (tokens, logps, _) = crate::sampling::pick(&rows, &params, &uniforms);
            let tokens = Vec::<i64>::try_from(tokens).unwrap();
            let logps = Vec::<f32>::try_from(logps).unwrap();
            let drawn: std::collections::BTreeSet<i64> = tokens.iter().copied().collect();
            assert_eq!(drawn.len(), kept, "libtorch, p {p}: {drawn:?}");
            let at = tokens.iter().position(|&t| t == 0).unwrap();
            assert!(
                (f64::from(logps[at]) - first).abs() < 1e-6,
                "libtorch, p {p}"
            );
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                let mut picker = Picker::default();
                let mut drawn = std::collections::BTreeSet::new();
                for &u in &uniforms {
                    let mut row = logits.clone();
                    // SAFETY: AVX2 and FMA were just detected.
                    let Pick {
                        token,
                        logprob: logp,
                        ..
                    } = unsafe { picker.pick(&mut row, &params, u) };
                    drawn.insert(token);
                    if token == 0 {
                        assert!((f64::from(logp) - first).abs() < 1e-6, "cpu, p {p}");
                    }
                }
                assert_eq!(drawn.len(), kept, "cpu, p {p}: {drawn:?}");
            }
        }
    }
}
