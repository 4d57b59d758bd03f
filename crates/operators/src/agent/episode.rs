//! One episode: turns of the model, each answered by the tools it calls,
//! as one token trajectory with what each token is.
//!
//! The episode's response grows turn by turn. A turn is what the policy
//! samples, kept exactly as sampled ([`TokenKind::Generated`]); if it
//! calls tools, their answers are rendered by the chat template and
//! appended ([`super::observe::appended`]: the boundary after the turn's
//! end-of-turn token, [`TokenKind::Boundary`], then the observation up to
//! the next turn's generation prompt, [`TokenKind::Observation`]), and the
//! next turn samples after them. Nothing is decoded and encoded again: a
//! turn's text is decoded only to read its tool calls and to render what
//! follows it.
//!
//! Budgets (see [`Budgets`]): at most `max_turns` turns; one token budget
//! for the whole response, observations included, each turn's sampling
//! clamped to what remains; a tool's output or an environment's
//! observation (each message's content) longer than
//! `max_observation_tokens` cut, with a marker. An observation that fits
//! the budget exactly is kept; one that does not fit ends the episode
//! ([`Finish::Length`]) with nothing of it appended.

use weir_gpu::tokenizer::Tokenizer;

use super::environment::EnvFault;
use super::observe::ObserveError;
use super::tool_calls::ToolCallParser;
use super::tools::Tool;
use crate::rollout::TokenKind;

/// An episode's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// Turns of the model at most.
    pub max_turns: usize,
    /// Tokens of the whole response (generated, boundary and observation).
    pub max_tokens: usize,
    /// Tokens of one tool's output or environment observation, past which
    /// it is cut with a marker.
    pub max_observation_tokens: usize,
}

/// Why an episode ended (`finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model answered without calling a tool.
    Stop,
    /// The token budget ran out (in a turn, or before an observation that
    /// would not fit).
    Length,
    /// The last allowed turn called a tool (or left the environment going).
    MaxTurns,
    /// The environment failed (the error is [`Episode::env_error`]).
    EnvError,
    /// A tool call failed and [`OnError::End`] ends the episode on it.
    ToolError,
    /// A tool or the environment did not answer in time (an environment
    /// always ends the episode then: its state is lost with its call).
    Timeout,
}

/// What a failed tool call or environment step does to its episode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The error becomes the observation the model reads next (a tool's,
    /// as its result; an environment's, as raw text), and the episode goes on.
    #[default]
    Observe,
    /// The episode ends on it ([`Finish::ToolError`], [`Finish::EnvError`],
    /// [`Finish::Timeout`]).
    End,
}

impl Finish {
    /// The name in the rollout log's `finish_reason`.
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::MaxTurns => "max_turns",
            Finish::EnvError => "env_error",
            Finish::ToolError => "tool_error",
            Finish::Timeout => "timeout",
        }
    }

    /// The end of an episode that ends on the environment's `fault`.
    pub fn of_fault(fault: &EnvFault) -> Self {
        match fault {
            EnvFault::Error(_) | EnvFault::Protocol(_) => Finish::EnvError,
            EnvFault::Timeout(_) => Finish::Timeout,
        }
    }
}

/// One turn as the policy sampled it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The tokens, the end-of-turn token included when the turn ended on it.
    pub tokens: Vec<i64>,
    /// Each token's log-prob under the distribution it was sampled from.
    pub logprobs: Vec<f32>,
    /// Each token's `Σ π²` of that distribution (empty unless the sampling
    /// parameters ask for it).
    pub sum_pi_squared: Vec<f32>,
    /// Whether the turn ended on an end-of-turn token (else: its budget).
    pub stopped: bool,
}

/// What samples an episode's turns: the model, or a script in tests.
pub trait TurnPolicy {
    /// A turn after `context` (the prompt and the response so far), of at
    /// most `max_new` tokens.
    fn sample(&mut self, context: &[i64], max_new: usize) -> Result<Sampled, String>;
}

/// Turns sampled by a model: each with the sampling parameters (its end-of-turn
/// ids as `eos_token_ids`) from its own random stream, (`stream`, turn).
pub struct ModelPolicy<'a> {
    model: &'a weir_gpu::Model,
    params: weir_gpu::SamplingParams,
    stream: u64,
    turns: u64,
    backend: weir_gpu::generate::Backend,
}

impl<'a> ModelPolicy<'a> {
    /// Samples `model`'s turns with `params` (one sample each; its
    /// `max_new_tokens` caps each turn, within what the episode has left)
    /// from the streams of `stream`.
    pub fn new(model: &'a weir_gpu::Model, params: weir_gpu::SamplingParams, stream: u64) -> Self {
        ModelPolicy {
            model,
            params,
            stream,
            turns: 0,
            backend: weir_gpu::generate::Backend::Auto,
        }
    }

    /// Samples on `backend` (libtorch, or weir's CPU kernels where they apply).
    pub fn on(mut self, backend: weir_gpu::generate::Backend) -> Self {
        self.backend = backend;
        self
    }
}

impl TurnPolicy for ModelPolicy<'_> {
    fn sample(&mut self, context: &[i64], max_new: usize) -> Result<Sampled, String> {
        let params = weir_gpu::SamplingParams {
            // A turn's own cap, within what the episode has left.
            max_new_tokens: max_new.min(self.params.max_new_tokens),
            n: 1,
            ..self.params.clone()
        };
        let stream = self.stream ^ (self.turns << 48);
        self.turns += 1;
        let generation = weir_gpu::generate::generate_on(
            self.model,
            &[context.to_vec()],
            &[stream],
            &params,
            self.backend,
        )
        .map_err(|e| e.to_string())?
        .pop()
        .ok_or("the model sampled no turn")?;
        Ok(Sampled {
            stopped: generation.finish_reason == weir_gpu::generate::FinishReason::Stop,
            tokens: generation.tokens,
            logprobs: generation.logprobs,
            sum_pi_squared: generation.sum_pi_squared,
        })
    }
}

/// One tool call of an episode and what it answered.
#[derive(Clone, Debug, PartialEq)]
pub struct CallRecord {
    /// The turn that made it.
    pub turn: usize,
    /// The tool's name (empty for a call that could not be read).
    pub tool: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
    /// The answer's text, as the model read it (cut when it was).
    pub output: String,
    /// Whether the call succeeded.
    pub ok: bool,
    /// Seconds the tool took to answer.
    pub seconds: f64,
}

/// An episode's response and what each token of it is.
#[derive(Clone, Debug, PartialEq)]
pub struct Episode {
    /// The response's tokens.
    pub tokens: Vec<i64>,
    /// What each token is.
    pub kinds: Vec<TokenKind>,
    /// The turn each token belongs to (an observation: the turn it answers).
    pub turns: Vec<u32>,
    /// Each generated token's log-prob; `None` on the others.
    pub logprobs: Vec<Option<f32>>,
    /// Each generated token's `Σ π²` where the sampler recorded it; 0 on
    /// the others.
    pub sum_pi_squared: Vec<f32>,
    /// Every tool call, in order.
    pub calls: Vec<CallRecord>,
    /// Turns the model took.
    pub turns_taken: usize,
    /// Each turn's reward from the environment (0 where it gave none).
    pub turn_rewards: Vec<f64>,
    /// What the environment said when it failed.
    pub env_error: Option<String>,
    /// The prompt's tokens when the environment's reset rewrote the prompt.
    pub prompt: Option<Vec<i64>>,
    /// Why it ended.
    pub finish: Finish,
}

impl Episode {
    pub(crate) fn empty() -> Self {
        Episode {
            tokens: Vec::new(),
            kinds: Vec::new(),
            turns: Vec::new(),
            logprobs: Vec::new(),
            sum_pi_squared: Vec::new(),
            calls: Vec::new(),
            turns_taken: 0,
            turn_rewards: Vec::new(),
            env_error: None,
            prompt: None,
            finish: Finish::Length,
        }
    }

    pub(crate) fn push(
        &mut self,
        tokens: &[i64],
        kind: TokenKind,
        turn: usize,
        sampled: Option<(&[f32], &[f32])>,
    ) {
        self.tokens.extend_from_slice(tokens);
        self.kinds.extend(std::iter::repeat_n(kind, tokens.len()));
        self.turns
            .extend(std::iter::repeat_n(turn as u32, tokens.len()));
        let (logprobs, squares) = sampled.unzip();
        match logprobs {
            Some(lp) => self.logprobs.extend(lp.iter().map(|&x| Some(x))),
            None => self
                .logprobs
                .extend(std::iter::repeat_n(None, tokens.len())),
        }
        let squares = squares.unwrap_or_default();
        self.sum_pi_squared
            .extend((0..tokens.len()).map(|i| squares.get(i).copied().unwrap_or(0.0)));
    }

    /// The positions of each turn's generated tokens, turn by turn.
    pub fn generated_by_turn(&self) -> Vec<Vec<usize>> {
        let mut turns = vec![Vec::new(); self.turns_taken];
        for (i, (&kind, &turn)) in self.kinds.iter().zip(&self.turns).enumerate() {
            if kind == TokenKind::Generated {
                turns[turn as usize].push(i);
            }
        }
        turns
    }

    /// How many tokens of each kind: (generated, observation, boundary).
    pub fn counts(&self) -> (usize, usize, usize) {
        let count = |k| self.kinds.iter().filter(|&&x| x == k).count();
        (
            count(TokenKind::Generated),
            count(TokenKind::Observation),
            count(TokenKind::Boundary),
        )
    }
}

/// What an episode needs besides its policy: the tokenizer and chat
/// template, how tool calls are written, the tools, and the limits.
pub struct EpisodeRunner<'a> {
    /// The checkpoint's tokenizer (and its chat template).
    pub tokenizer: &'a Tokenizer,
    /// How the model writes tool calls.
    pub parser: &'a dyn ToolCallParser,
    /// The tools it may call.
    pub tools: &'a [Box<dyn Tool>],
    /// The token that ends a turn, as text (`<|im_end|>`, `<|eot_id|>`).
    pub end_of_turn: String,
    /// The limits.
    pub budgets: Budgets,
    /// What a failed call or step does.
    pub on_error: OnError,
}

/// Why an episode could not be run (not the model's or a tool's failure).
#[derive(Debug, thiserror::Error)]
pub enum EpisodeError {
    /// Sampling a turn failed.
    #[error("sampling turn {turn}: {message}")]
    Policy {
        /// The turn.
        turn: usize,
        /// What failed.
        message: String,
    },
    /// The environment answered outside its protocol.
    #[error("{0}")]
    Environment(String),
    /// What went wrong in one row's episode.
    #[error("row {row}: {error}")]
    InRow {
        /// The row of the batch.
        row: usize,
        /// What went wrong.
        error: Box<EpisodeError>,
    },
    /// Rendering or tokenizing what follows a turn failed.
    #[error("after turn {turn}: {source}")]
    Observe {
        /// The turn.
        turn: usize,
        /// What failed.
        source: ObserveError,
    },
}

impl EpisodeRunner<'_> {
    /// `text` cut to `max_observation_tokens` tokens, with a marker saying
    /// how many were left out; text that fits exactly is kept whole.
    pub(crate) fn cut(&self, text: &str) -> Result<String, weir_gpu::ModelError> {
        let limit = self.budgets.max_observation_tokens;
        let tokens = self.tokenizer.encode(text, false)?;
        if tokens.len() <= limit {
            return Ok(text.to_string());
        }
        let kept = self.tokenizer.decode(&tokens[..limit], false)?;
        Ok(format!(
            "{kept}\n[… {} more tokens of output not shown]",
            tokens.len() - limit
        ))
    }
}

#[cfg(test)]
#[path = "episode_tests.rs"]
mod tests;
