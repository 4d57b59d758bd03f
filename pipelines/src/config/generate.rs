//! `[generate]`: how the generator samples: the section, its defaults, its
//! rows of the key table and its checks.

use serde::{Deserialize, Serialize};
use weir_gpu::{SamplingParams, Tokenizer};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::{Backend, ConfigError, OnNewWeights};

/// `[generate]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerateSection {
    /// Most new tokens per response.
    pub max_new_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling (1.0: off).
    pub top_p: f64,
    /// Top-k sampling (0: off).
    pub top_k: usize,
    /// Streaming generation: sequences in flight at most, across batches
    /// and steps (0: batch by batch).
    pub max_inflight: usize,
    /// What in-flight sequences do when new weights arrive.
    pub on_new_weights: OnNewWeights,
    /// A long-tail workload: per-response token budgets from a Pareto
    /// distribution of this shape, eos ignored (0: off).
    pub long_tail: f64,
    /// Generate every response to `max_new_tokens`, past the end tokens (a
    /// throughput setting, as TRL's `suppress_tokens` of the eos id;
    /// evaluation still stops at them).
    pub ignore_eos: bool,
    /// Which runtime decodes: `auto` or `torch`.
    pub backend: Backend,
    /// A test hook, no key: a streaming generator waits before a
    /// sequence's this-many-th token until newer weights arrive
    /// ([`weir_operators::stages::generate::StreamingGenerate::holding_for_weights_at`]).
    #[doc(hidden)]
    #[serde(skip)]
    pub hold_for_weights_at: Option<usize>,
}

impl Default for GenerateSection {
    fn default() -> Self {
        GenerateSection {
            max_new_tokens: 8,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_inflight: 0,
            on_new_weights: OnNewWeights::Finish,
            long_tail: 0.0,
            ignore_eos: false,
            backend: Backend::Auto,
            hold_for_weights_at: None,
        }
    }
}

impl GenerateSection {
    /// How the generator samples: these keys with the tokenizer's end tokens
    /// and the run's seed.
    pub fn sampling(&self, tok: &Tokenizer, seed: u64) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: (self.top_p < 1.0).then_some(self.top_p),
            top_k: (self.top_k > 0).then_some(self.top_k),
            eos_token_ids: tok.eos_token_ids().to_vec(),
            seed,
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
    }
}

/// `[generate]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("generate", "max_new_tokens", Rl, "Most new tokens per response."),
    key("generate", "temperature", Rl, "Sampling temperature."),
    key("generate", "top_p", Rl, "Nucleus sampling (1.0: off)."),
    key("generate", "top_k", Rl, "Top-k sampling (0: off)."),
    key("generate", "max_inflight", Rl, "Streaming generation: a pool of this many sequences advances token by token across batches and steps; a finished sequence's slot is refilled at once and a group's rows leave as soon as its last sample ends (0: each batch generated whole). With [agent], episodes stream so: one leaves the pool while its call is out and rejoins with its observation, each token's version recorded. At run.max_staleness = 0 no step starts before its weights, so it overlaps no steps and only caps the sequences decoded at once (a warning at the start says so)."),
    key("generate", "long_tail", Rl, "A long-tail workload for asynchronous experiments: each response gets its own token budget, drawn from a Pareto distribution of this shape between max_new_tokens / 64 and max_new_tokens, and eos ids are ignored, so lengths within a step spread as reasoning traces do (0: off; 1 is a heavy tail)."),
    key("generate", "ignore_eos", Rl, "Generate every response to max_new_tokens, past the tokenizer's end tokens (a throughput setting, like TRL's suppress_tokens of the eos id); evaluation still stops at the end tokens."),
    key("generate", "backend", Rl, "Which runtime decodes: \"auto\" (weir's CPU kernels for a float32 model on an AVX2 CPU, libtorch elsewhere) or \"torch\" (libtorch ops everywhere: on a CPU, the path a GPU runs; the same tokens within rounding)."),
    key("generate", "on_new_weights", Rl, "What a streaming generator's in-flight sequences do when new weights arrive: \"finish\" (on the weights they started with; nothing new starts meanwhile), \"keep\" (continue under the new weights over their KV cache), \"recompute\" (their prompt and tokens so far are run again under the new weights)."),
];

impl GenerateSection {
    /// Tokens to generate, a temperature, a nucleus and a tail the sampler takes.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if self.max_new_tokens == 0 {
            return bad("generate.max_new_tokens", "0".into(), "must be at least 1");
        }
        if let Some(why) = weir_gpu::temperature_error(self.temperature) {
            return bad("generate.temperature", self.temperature.to_string(), why);
        }
        if !(self.long_tail.is_finite() && self.long_tail >= 0.0) {
            return bad(
                "generate.long_tail",
                self.long_tail.to_string(),
                "must be ≥ 0 (0: off)",
            );
        }
        if let Some(why) = weir_gpu::top_p_error(self.top_p) {
            return bad("generate.top_p", self.top_p.to_string(), why);
        }
        Ok(())
    }
}
