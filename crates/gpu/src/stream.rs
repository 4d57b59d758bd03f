//! Continuous batching: a pool of up to `max_inflight` sequences that all
//! advance one token per call. A finished sequence leaves at once and its
//! slot goes to the next waiting request, which is prefilled in the same
//! call as the others' decode step, but in a forward pass of its own on
//! both backends (a call that admits requests reads the weights twice; a
//! fused ragged pass is not built yet). New weights may be applied to
//! the model between two calls; [`OnNewWeights`] says what happens to the
//! sequences in flight, and every token records the policy version that
//! sampled it.
//!
//! The scheduler ([`Streamer`]) is the same for both backends; a backend
//! ([`Slots`]) only runs forward passes over cache slots and picks tokens:
//! weir's CPU kernels (one cache slot per sequence, no padding) or libtorch
//! (`TorchSlots`: a slot cache, each row a sequence of its own length;
//! rows join and leave without the others being copied).

use std::collections::VecDeque;
use std::str::FromStr;

use crate::error::ModelError;
use crate::model::Model;
use crate::sampling::SamplingParams;
use crate::sampling::{Backend, Generation, Stream};
use crate::slots::{Slots, TorchSlots};

/// What the sequences in flight do when new weights arrive (config
/// spelling, `generate.on_new_weights`: `finish`, `keep`, `recompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNewWeights {
    /// They finish on the weights they started with; no new sequence starts
    /// until they have (the caller holds the new weights back until
    /// [`Streamer::live`] is 0).
    #[default]
    Finish,
    /// They continue on the new weights over their existing KV cache
    /// (PipelineRL).
    Keep,
    /// Each one's prompt and tokens so far are run again under the new
    /// weights before its next token (AReaL).
    Recompute,
}

impl OnNewWeights {
    /// The config spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            OnNewWeights::Finish => "finish",
            OnNewWeights::Keep => "keep",
            OnNewWeights::Recompute => "recompute",
        }
    }
}

impl FromStr for OnNewWeights {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "finish" => Ok(OnNewWeights::Finish),
            "keep" => Ok(OnNewWeights::Keep),
            "recompute" => Ok(OnNewWeights::Recompute),
            other => Err(format!(
                "`{other}` is not a weight-update policy (finish, keep, recompute)"
            )),
        }
    }
}

/// A sequence to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The caller's key, returned with the result.
    pub key: u64,
    /// The prompt's token ids.
    pub prompt: Vec<i64>,
    /// Its random stream (as `stream_ids` in [`crate::generate_with_ids`], sample 0).
    pub stream: u64,
    /// Greedy whatever the sampling settings (ReMax's baseline rows).
    pub greedy: bool,
    /// Its own token budget, below the sampling settings' `max_new_tokens`.
    pub max_new_tokens: Option<usize>,
}

impl Request {
    fn limit(&self, params: &SamplingParams) -> usize {
        self.max_new_tokens
            .map_or(params.max_new_tokens, |m| m.min(params.max_new_tokens))
    }
}

/// A finished sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    /// The request's key.
    pub key: u64,
    /// Tokens, behaviour log-probs and why it ended (`prompt`/`sample` are 0).
    pub generation: Generation,
    /// The policy version that sampled each token.
    pub versions: Vec<u32>,
    /// Whether each token's context had been recomputed under its version
    /// (`recompute`); false for a context built up under older weights too.
    pub recomputed: Vec<bool>,
}

/// Counters since the last [`Streamer::take_stats`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStats {
    /// Forward passes run.
    pub passes: u64,
    /// Sequences in flight summed over the passes.
    pub inflight: u64,
    /// Tokens sampled.
    pub tokens: u64,
    /// Sequences prefilled again under new weights.
    pub recomputed: u64,
}

/// One sequence in flight.
struct Sequence {
    request: Request,
    slot: usize,
    generation: Generation,
    versions: Vec<u32>,
    recomputed: Vec<bool>,
    stream: Stream,
    /// The cache holds the prompt and every token but the last.
    cached: bool,
    /// Its context was run again under the current weights.
    context_recomputed: bool,
}

impl Sequence {
    /// Prompt and tokens so far.
    fn context(&self) -> Vec<i64> {
        let mut c = self.request.prompt.clone();
        c.extend_from_slice(&self.generation.tokens);
        c
    }
}

/// Continuous batching over a model; see the module docs.
pub struct Streamer {
    /// The sampling settings, and the same greedy (for greedy requests).
    params: [SamplingParams; 2],
    max_inflight: usize,
    on_new_weights: OnNewWeights,
    slots: Box<dyn Slots>,
    waiting: VecDeque<Request>,
    live: Vec<Sequence>,
    free: Vec<usize>,
    version: u32,
    recompute: bool,
    admitting: bool,
    stats: StreamStats,
    /// Requests whose first token was drawn (or that ended without one)
    /// since the last [`Streamer::take_started`], with the version then.
    started: Vec<(u64, u32)>,
}

impl Streamer {
    /// A pool of `max_inflight` sequences on `model` sampling with `params`
    /// (`n` is ignored: one sequence per request), starting at policy `version`.
    pub fn new(
        model: &Model,
        params: SamplingParams,
        max_inflight: usize,
        on_new_weights: OnNewWeights,
        version: u32,
        backend: Backend,
    ) -> Result<Self, ModelError> {
        params.validate()?;
        if max_inflight == 0 {
            return Err(ModelError::Input("max_inflight must be at least 1".into()));
        }
        let slots: Box<dyn Slots> = if backend == Backend::Auto && model.runs_on_cpu_kernels() {
            #[cfg(target_arch = "x86_64")]
            {
                Box::new(crate::cpu::run::CpuSlots::new(max_inflight))
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("the CPU kernels apply only on x86-64")
        } else {
            model.check_weights_held()?;
            Box::new(TorchSlots::new(model))
        };
        Ok(Streamer {
            params: [
                SamplingParams {
                    n: 1,
                    ..params.clone()
                },
                SamplingParams {
                    n: 1,
                    greedy: true,
                    ..params
                },
            ],
            max_inflight,
            on_new_weights,
            slots,
            waiting: VecDeque::new(),
            live: Vec::new(),
            free: (0..max_inflight).rev().collect(),
            version,
            recompute: false,
            admitting: true,
            stats: StreamStats::default(),
            started: Vec::new(),
        })
    }

    /// Whether a sequence in flight has drawn exactly `tokens` tokens, all
    /// under the current weights.
    pub fn reached(&self, tokens: usize) -> bool {
        self.live
            .iter()
            .any(|s| s.versions.len() == tokens && s.versions.iter().all(|&v| v == self.version))
    }

    /// Queues requests; they start, oldest first, as slots free up.
    pub fn submit(&mut self, model: &Model, requests: Vec<Request>) -> Result<(), ModelError> {
        let prompts: Vec<Vec<i64>> = requests.iter().map(|r| r.prompt.clone()).collect();
        model.check_token_ids(&prompts, &[])?;
        self.waiting.extend(requests);
        Ok(())
    }

    /// The pool's size.
    pub fn max_inflight(&self) -> usize {
        self.max_inflight
    }

    /// Sequences in flight.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Requests not started yet.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Nothing in flight and nothing waiting.
    pub fn is_idle(&self) -> bool {
        self.live.is_empty() && self.waiting.is_empty()
    }

    /// Keys of the requests in flight or waiting.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.live
            .iter()
            .map(|s| s.request.key)
            .chain(self.waiting.iter().map(|r| r.key))
    }

    /// The policy version tokens are recorded under.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Whether waiting requests may start (a caller holding new weights
    /// back under [`OnNewWeights::Finish`] stops admission meanwhile).
    pub fn set_admitting(&mut self, admitting: bool) {
        self.admitting = admitting;
    }

    /// The policy.
    pub fn on_new_weights(&self) -> OnNewWeights {
        self.on_new_weights
    }

    /// The caller applied weights of `version` to the model: the next
    /// tokens are sampled under them; under [`OnNewWeights::Recompute`] the
    /// sequences in flight are prefilled again first.
    pub fn weights_changed(&mut self, version: u32) {
        self.version = version;
        self.slots.weights_changed();
        if self.on_new_weights == OnNewWeights::Recompute && !self.live.is_empty() {
            self.recompute = true;
        }
    }

    /// Counters since the last call.
    pub fn take_stats(&mut self) -> StreamStats {
        std::mem::take(&mut self.stats)
    }

    /// The requests whose first token was drawn since the last call, each
    /// with the policy version that drew it (a request with no token budget
    /// ends at once: the version then), in the order they started.
    pub fn take_started(&mut self) -> Vec<(u64, u32)> {
        std::mem::take(&mut self.started)
    }

    /// One forward pass: waiting requests start in free slots, every
    /// sequence in flight gets one token; returns the sequences that ended.
    pub fn advance(&mut self, model: &Model) -> Result<Vec<Finished>, ModelError> {
        if self.recompute {
            self.recompute = false;
            self.slots.clear(model);
            for s in &mut self.live {
                s.cached = false;
                s.context_recomputed = true;
                self.stats.recomputed += 1;
            }
        }
        let mut empty = Vec::new();
        while self.admitting && self.live.len() < self.max_inflight {
            let Some(request) = self.waiting.pop_front() else {
                break;
            };
            if request.limit(&self.params[0]) == 0 {
                self.started.push((request.key, self.version));
                empty.push(Finished {
                    key: request.key,
                    generation: Generation::empty(0, 0),
                    versions: Vec::new(),
                    recomputed: Vec::new(),
                });
                continue;
            }
            let slot = self.free.pop().expect("a free slot per missing sequence");
            self.live.push(Sequence {
                stream: Stream::new(self.params[0].seed, request.stream, 0),
                request,
                slot,
                generation: Generation::empty(0, 0),
                versions: Vec::new(),
                recomputed: Vec::new(),
                cached: false,
                context_recomputed: false,
            });
        }
        if self.live.is_empty() {
            return Ok(empty);
        }
        let positions = self
            .live
            .iter()
            .map(|s| s.request.prompt.len() + s.request.limit(&self.params[0]))
            .max()
            .unwrap_or(1);
        let kept: Vec<(usize, usize)> = self
            .live
            .iter()
            .filter(|s| s.cached)
            .map(|s| {
                (
                    s.slot,
                    s.request.prompt.len() + s.generation.tokens.len() - 1,
                )
            })
            .collect();
        self.slots.reserve(model, positions, &kept)?;

        // Steps first, then prefills: the order the backend's logits come in.
        let mut order: Vec<usize> = (0..self.live.len())
            .filter(|&i| self.live[i].cached)
            .collect();
        let steps: Vec<(usize, i64, usize)> = order
            .iter()
            .map(|&i| {
                let s = &self.live[i];
                let last = *s
                    .generation
                    .tokens
                    .last()
                    .expect("a cached sequence has a token");
                (
                    s.slot,
                    last,
                    s.request.prompt.len() + s.generation.tokens.len() - 1,
                )
            })
            .collect();
        let fresh: Vec<usize> = (0..self.live.len())
            .filter(|&i| !self.live[i].cached)
            .collect();
        let contexts: Vec<Vec<i64>> = fresh.iter().map(|&i| self.live[i].context()).collect();
        let prefills: Vec<(usize, &[i64])> = fresh
            .iter()
            .zip(&contexts)
            .map(|(&i, c)| (self.live[i].slot, c.as_slice()))
            .collect();
        self.slots.forward(model, &steps, &prefills)?;
        order.extend(&fresh);

        let greedy: Vec<bool> = order.iter().map(|&i| self.live[i].request.greedy).collect();
        let uniforms: Vec<f32> = order
            .iter()
            .map(|&i| self.live[i].stream.next_f32())
            .collect();
        let picks = self.slots.pick(&self.params, &greedy, &uniforms)?;
        self.stats.passes += 1;
        self.stats.inflight += self.live.len() as u64;
        self.stats.tokens += picks.len() as u64;

        let mut ended = vec![false; self.live.len()];
        for (&i, &pick) in order.iter().zip(&picks) {
            let s = &mut self.live[i];
            let params = &self.params[usize::from(s.request.greedy)];
            s.cached = true;
            if s.versions.is_empty() {
                self.started.push((s.request.key, self.version));
            }
            s.versions.push(self.version);
            s.recomputed.push(s.context_recomputed);
            let more = s.generation.record(pick, params);
            ended[i] = !more || s.generation.tokens.len() >= s.request.limit(params);
        }
        let (done, live): (Vec<_>, Vec<_>) = std::mem::take(&mut self.live)
            .into_iter()
            .zip(ended)
            .partition(|(_, e)| *e);
        self.live = live.into_iter().map(|(s, _)| s).collect();
        let freed: Vec<usize> = done.iter().map(|(s, _)| s.slot).collect();
        self.slots.free(&freed)?;
        self.free.extend(freed);
        if self.is_idle() {
            self.slots.clear(model);
        }
        empty.extend(done.into_iter().map(|(s, _)| Finished {
            key: s.request.key,
            generation: s.generation,
            versions: s.versions,
            recomputed: s.recomputed,
        }));
        Ok(empty)
    }
}
