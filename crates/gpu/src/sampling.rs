//! How tokens are picked: the sampling settings and their limits, a
//! generated sequence, the per-sequence random streams, and the pick itself
//! (temperature, then top-k, then top-p, as transformers orders its
//! processors). Every decoder backend samples through here.

use tch::{Kind, Tensor};

use crate::error::ModelError;

/// How to pick tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Always take the most likely token (ignores the sampling settings).
    pub greedy: bool,
    /// Logits are divided by this before sampling.
    pub temperature: f64,
    /// Keep only the k most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p (`None`: all).
    pub top_p: Option<f64>,
    /// Samples per prompt.
    pub n: usize,
    /// Seed of the sampling streams.
    pub seed: u64,
    /// Token ids that end a sequence (the id is kept in the output).
    pub eos_token_ids: Vec<i64>,
    /// Generate exactly `max_new_tokens`, never stopping at an eos id.
    pub ignore_eos: bool,
    /// Record each token's `Σ_v π(v)²` of the distribution it was drawn
    /// from ([`Generation::sum_pi_squared`]; the optimal token baseline's
    /// path variance needs it).
    pub sum_pi_squared: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_new_tokens: 64,
            greedy: false,
            temperature: 1.0,
            top_k: None,
            top_p: None,
            n: 1,
            seed: 0,
            eos_token_ids: Vec::new(),
            ignore_eos: false,
            sum_pi_squared: false,
        }
    }
}

/// Why sampling cannot use `temperature`, if it cannot: below 0.01 the
/// logits divided by it overflow or the sampled distribution's log-probs
/// lose all precision (vLLM raises it to 0.01). Every place that takes a
/// temperature from a user checks it here.
pub fn temperature_error(temperature: f64) -> Option<&'static str> {
    (!(temperature.is_finite() && temperature >= 0.01))
        .then_some("must be finite and at least 0.01")
}

/// Why `top_p` is not a nucleus mass, if it is not: it must lie in (0, 1]
/// (1: no nucleus filter). Every place that takes a top-p from a user
/// checks it here.
pub fn top_p_error(top_p: f64) -> Option<&'static str> {
    (!(top_p > 0.0 && top_p <= 1.0)).then_some("must be in (0, 1]")
}

impl SamplingParams {
    pub(crate) fn validate(&self) -> Result<(), ModelError> {
        if let Some(why) = temperature_error(self.temperature).filter(|_| !self.greedy) {
            return Err(ModelError::Input(format!(
                "temperature {}: {why}",
                self.temperature
            )));
        }
        if let Some((p, why)) = self.top_p.and_then(|p| Some((p, top_p_error(p)?))) {
            return Err(ModelError::Input(format!("top_p {p}: {why}")));
        }
        if self.top_k == Some(0) {
            return Err(ModelError::Input("top_k must be at least 1".into()));
        }
        if self.n == 0 {
            return Err(ModelError::Input(
                "n (samples per prompt) must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced an eos id.
    Stop,
    /// It reached `max_new_tokens`.
    Length,
}

impl FinishReason {
    /// `stop` or `length`.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One generated sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Index of its prompt.
    pub prompt: usize,
    /// Index of the sample for that prompt.
    pub sample: usize,
    /// The new tokens (an eos id, if it stopped on one, included).
    pub tokens: Vec<i64>,
    /// log-prob of each new token under the distribution it was drawn from.
    pub logprobs: Vec<f32>,
    /// `Σ_v π(v)²` of the distribution each new token was drawn from (only
    /// with [`SamplingParams::sum_pi_squared`]; empty otherwise).
    pub sum_pi_squared: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

impl Generation {
    /// No tokens yet for `n` samples of each of `prompts` prompts, ordered by (prompt, sample).
    pub(crate) fn empty_rows(prompts: usize, n: usize) -> Vec<Self> {
        (0..prompts)
            .flat_map(|p| (0..n).map(move |s| Generation::empty(p, s)))
            .collect()
    }

    pub(crate) fn empty(prompt: usize, sample: usize) -> Self {
        Generation {
            prompt,
            sample,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            sum_pi_squared: Vec::new(),
            finish_reason: FinishReason::Length,
        }
    }

    /// Appends a token; false when the sequence has ended (an eos id, or
    /// `max_new_tokens` reached).
    pub(crate) fn record(&mut self, pick: Pick, params: &SamplingParams) -> bool {
        let token = pick.token;
        self.tokens.push(token);
        self.logprobs.push(pick.logprob);
        if params.sum_pi_squared {
            self.sum_pi_squared.push(pick.sum_pi_squared);
        }
        if !params.ignore_eos && params.eos_token_ids.contains(&token) {
            self.finish_reason = FinishReason::Stop;
            return false;
        }
        self.tokens.len() < params.max_new_tokens
    }
}

/// One picked token.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pick {
    /// The token id.
    pub token: i64,
    /// Its log-prob under the distribution it was drawn from.
    pub logprob: f32,
    /// `Σ_v π(v)²` of that distribution (with
    /// [`SamplingParams::sum_pi_squared`]; 0 otherwise).
    pub sum_pi_squared: f32,
}

/// Which implementation runs a generation (config spelling,
/// `generate.backend`: `auto`, `torch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// weir's CPU kernels (`cpu::engine`) for a float32 causal LM on a CPU
    /// with AVX2 and FMA; libtorch otherwise.
    #[default]
    Auto,
    /// libtorch ops, on any device and dtype.
    Torch,
}

/// Picks one token per row of `logits` `[B, V]`; returns the tokens, their
/// log-probs under the distribution they were drawn from and, with
/// `params.sum_pi_squared`, that distribution's `Σ_v π(v)²`.
pub(crate) fn pick(
    logits: &Tensor,
    params: &SamplingParams,
    uniforms: &[f32],
) -> (Tensor, Tensor, Option<Tensor>) {
    let logits = logits.to_kind(if logits.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    });
    let kind = logits.kind();
    let squares = |logp: &Tensor| {
        params
            .sum_pi_squared
            .then(|| (logp * 2.0).exp().sum_dim_intlist(-1, false, kind))
    };
    if params.greedy {
        let tokens = logits.argmax(-1, false);
        let all = logits.log_softmax(-1, kind);
        let logp = all.gather(-1, &tokens.unsqueeze(-1), false).squeeze_dim(-1);
        return (tokens, logp, squares(&all));
    }
    let mut scaled = logits / params.temperature;
    let vocab = scaled.size()[1];
    if let Some(k) = params.top_k.filter(|&k| (k as i64) < vocab) {
        let (top, _) = scaled.topk(k as i64, -1, true, true);
        let kth = top.narrow(1, k as i64 - 1, 1);
        scaled = scaled.masked_fill(&scaled.lt_tensor(&kth), f64::NEG_INFINITY);
    }
    if let Some(p) = params.top_p.filter(|&p| p < 1.0) {
        let (sorted, order) = scaled.sort(-1, true);
        let probs = sorted.softmax(-1, kind);
        // Drop a token when the tokens before it already reach p (as HF's
        // and vLLM's top-p: the smallest set of mass ≥ p); the first always stays.
        let before = probs.cumsum(-1, kind) - &probs;
        let drop_sorted = before.ge(p);
        let drop = drop_sorted.zeros_like().scatter(-1, &order, &drop_sorted);
        scaled = scaled.masked_fill(&drop, f64::NEG_INFINITY);
    }
    let logp = scaled.log_softmax(-1, kind);
    let cdf = logp.exp().cumsum(-1, kind);
    let total = cdf.narrow(1, vocab - 1, 1);
    let u = Tensor::from_slice(uniforms)
        .to_device(cdf.device())
        .to_kind(kind)
        .view([-1, 1])
        * &total;
    // First index whose cumulative probability exceeds u: an inverse-CDF draw.
    let tokens = u
        .searchsorted(&cdf, false, true, "right", None::<Tensor>)
        .clamp_max(vocab - 1)
        .squeeze_dim(-1);
    let chosen = logp
        .gather(-1, &tokens.unsqueeze(-1), false)
        .squeeze_dim(-1);
    (tokens, chosen, squares(&logp))
}

/// A small, seedable random stream (splitmix64 → xorshift64*).
pub(crate) struct Stream(u64);

impl Stream {
    pub(crate) fn new(seed: u64, prompt: u64, sample: u64) -> Self {
        let mut s = Stream(seed ^ 0x9e37_79b9_7f4a_7c15);
        s.0 = s.mix(
            prompt.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ sample.wrapping_mul(0x94d0_49bb_1331_11eb),
        );
        if s.0 == 0 {
            s.0 = 1;
        }
        s
    }

    fn mix(&self, x: u64) -> u64 {
        let mut z = self.0.wrapping_add(x).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}
