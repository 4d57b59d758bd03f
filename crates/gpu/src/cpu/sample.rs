//! Picking one token from a row of logits, the same processors in the same
//! order as the libtorch path (`generate::pick`): temperature, top-k, top-p,
//! then an inverse-CDF draw with the sequence's own uniform number.

use super::math;
use crate::generate::SamplingParams;

/// Reusable buffers for [`pick`].
#[derive(Debug, Default)]
pub struct Picker {
    probs: Vec<f32>,
    order: Vec<u32>,
}

impl Picker {
    /// Picks a token from `logits` (overwritten) with uniform `u` in [0, 1);
    /// returns it and its log-prob under the distribution it was drawn from.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    pub unsafe fn pick(
        &mut self,
        logits: &mut [f32],
        params: &SamplingParams,
        u: f32,
    ) -> (i64, f32) {
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
            return (best as i64, logp);
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
            // Drop a token when the tokens before it already reach p; the first always stays.
            let mut before = 0.0f64;
            for &i in &self.order {
                let i = i as usize;
                let prob = self.probs[i] as f64 / total;
                if before > p {
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
        (token as i64, logits[token] - lse)
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
