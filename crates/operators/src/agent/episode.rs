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

use serde_json::{json, Value};
use weir_gpu::tokenizer::Tokenizer;

use super::environment::{EnvFault, EnvStep, Environment, Observation};
use super::observe::{appended, ObserveError};
use super::tool_calls::ToolCallParser;
use super::tools::{answer, schemas, Tool};
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
}

/// One turn as the policy sampled it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The tokens, the end-of-turn token included when the turn ended on it.
    pub tokens: Vec<i64>,
    /// Each token's log-prob under the distribution it was sampled from.
    pub logprobs: Vec<f32>,
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
    fn empty() -> Self {
        Episode {
            tokens: Vec::new(),
            kinds: Vec::new(),
            turns: Vec::new(),
            logprobs: Vec::new(),
            calls: Vec::new(),
            turns_taken: 0,
            turn_rewards: Vec::new(),
            env_error: None,
            prompt: None,
            finish: Finish::Length,
        }
    }

    fn push(&mut self, tokens: &[i64], kind: TokenKind, turn: usize, logprobs: Option<&[f32]>) {
        self.tokens.extend_from_slice(tokens);
        self.kinds.extend(std::iter::repeat_n(kind, tokens.len()));
        self.turns
            .extend(std::iter::repeat_n(turn as u32, tokens.len()));
        match logprobs {
            Some(lp) => self.logprobs.extend(lp.iter().map(|&x| Some(x))),
            None => self
                .logprobs
                .extend(std::iter::repeat_n(None, tokens.len())),
        }
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
    /// Runs one episode from the conversation `messages`, whose rendering
    /// with the generation prompt is `prompt` (the prompt's tokens), its
    /// turns answered by the tools they call.
    pub fn run(
        &self,
        policy: &mut dyn TurnPolicy,
        messages: &[Value],
        prompt: &[i64],
    ) -> Result<Episode, EpisodeError> {
        self.run_in(policy, None, messages, prompt)
    }

    /// [`EpisodeRunner::run`], each turn answered by `environment` when
    /// there is one (reset before the first turn with the row `row` and
    /// the prompt's text, closed after the last): its observation follows
    /// the turn, its reward is the turn's, and it may end the episode. A
    /// reset that rewrites the prompt's text (OpenRLHF's agents may) gives
    /// the episode a new prompt, that text tokenized alone
    /// ([`Episode::prompt`]); one that returns it unchanged keeps `prompt`.
    pub fn run_with(
        &self,
        policy: &mut dyn TurnPolicy,
        environment: &mut dyn Environment,
        row: &Value,
        messages: &[Value],
        prompt: &[i64],
    ) -> Result<Episode, EpisodeError> {
        let observe = |source| EpisodeError::Observe { turn: 0, source };
        let text = self
            .tokenizer
            .decode(prompt, false)
            .map_err(|e| observe(e.into()))?;
        let rewritten = match environment.reset(row, &text) {
            Ok(Some(new)) if new != text => Some(
                self.tokenizer
                    .encode(&new, false)
                    .map_err(|e| observe(e.into()))?,
            ),
            Ok(_) => None,
            Err(fault) => {
                environment.close();
                return Ok(Episode {
                    finish: fault.finish(),
                    env_error: Some(format!("reset: {}", fault.message())),
                    ..Episode::empty()
                });
            }
        };
        let start = rewritten.as_deref().unwrap_or(prompt);
        let episode = self.run_in(policy, Some(&mut *environment), messages, start);
        environment.close();
        let mut episode = episode?;
        episode.prompt = rewritten;
        Ok(episode)
    }

    fn run_in(
        &self,
        policy: &mut dyn TurnPolicy,
        mut environment: Option<&mut dyn Environment>,
        messages: &[Value],
        prompt: &[i64],
    ) -> Result<Episode, EpisodeError> {
        let budgets = self.budgets;
        let schemas = (!self.tools.is_empty()).then(|| schemas(self.tools));
        let mut history = messages.to_vec();
        let mut context = prompt.to_vec();
        let mut episode = Episode::empty();
        for turn in 0..budgets.max_turns {
            let left = budgets.max_tokens.saturating_sub(episode.tokens.len());
            if left == 0 {
                episode.finish = Finish::Length;
                return Ok(episode);
            }
            let sampled = policy
                .sample(&context, left)
                .map_err(|message| EpisodeError::Policy { turn, message })?;
            if sampled.logprobs.len() != sampled.tokens.len() {
                return Err(EpisodeError::Policy {
                    turn,
                    message: format!(
                        "{} tokens came with {} log-probs",
                        sampled.tokens.len(),
                        sampled.logprobs.len()
                    ),
                });
            }
            let n = sampled.tokens.len().min(left);
            episode.push(
                &sampled.tokens[..n],
                TokenKind::Generated,
                turn,
                Some(&sampled.logprobs[..n]),
            );
            context.extend_from_slice(&sampled.tokens[..n]);
            episode.turns_taken = turn + 1;
            episode.turn_rewards.push(0.0);
            if !sampled.stopped || n < sampled.tokens.len() {
                episode.finish = Finish::Length;
                return Ok(episode);
            }
            let observe = |source| EpisodeError::Observe { turn, source };
            let text = self
                .tokenizer
                .decode(&sampled.tokens, false)
                .map_err(|e| observe(e.into()))?;
            let content = text
                .strip_suffix(self.end_of_turn.as_str())
                .unwrap_or(&text);
            if let Some(environment) = environment.as_deref_mut() {
                let step = match environment.step(content) {
                    Ok(step) => step,
                    Err(fault) => {
                        episode.env_error = Some(format!("turn {turn}: {}", fault.message()));
                        match (&fault, self.on_error) {
                            (EnvFault::Error(e), OnError::Observe) => EnvStep {
                                observation: Observation::Text(format!("\nerror: {e}\n")),
                                reward: 0.0,
                                done: false,
                            },
                            _ => {
                                episode.finish = fault.finish();
                                return Ok(episode);
                            }
                        }
                    }
                };
                episode.turn_rewards[turn] = step.reward;
                if step.done {
                    episode.finish = Finish::Stop;
                    return Ok(episode);
                }
                if turn + 1 == budgets.max_turns {
                    episode.finish = Finish::MaxTurns;
                    return Ok(episode);
                }
                let (boundary, observation, said) = match step.observation {
                    Observation::Text(text) => {
                        let text = self.cut(&text).map_err(|e| observe(e.into()))?;
                        let tokens = self
                            .tokenizer
                            .encode(&text, false)
                            .map_err(|e| observe(e.into()))?;
                        (Vec::new(), tokens, Vec::new())
                    }
                    Observation::Messages(mut said) => {
                        for message in &mut said {
                            if let Some(Value::String(content)) = message.get_mut("content") {
                                *content = self.cut(content).map_err(|e| observe(e.into()))?;
                            }
                        }
                        let next = appended(
                            self.tokenizer,
                            &history,
                            &text,
                            &self.end_of_turn,
                            &said,
                            schemas.as_deref(),
                        )
                        .map_err(observe)?;
                        (next.boundary, next.observation, said)
                    }
                };
                if boundary.len() + observation.len() > budgets.max_tokens - episode.tokens.len() {
                    episode.finish = Finish::Length;
                    return Ok(episode);
                }
                episode.push(&boundary, TokenKind::Boundary, turn, None);
                episode.push(&observation, TokenKind::Observation, turn, None);
                context.extend_from_slice(&boundary);
                context.extend_from_slice(&observation);
                history.push(json!({"role": "assistant", "content": content}));
                history.extend(said);
                continue;
            }
            let calls = self.parser.parse(content);
            if calls.is_empty() {
                episode.finish = Finish::Stop;
                return Ok(episode);
            }
            if turn + 1 == budgets.max_turns {
                episode.finish = Finish::MaxTurns;
                return Ok(episode);
            }
            let mut answers = Vec::with_capacity(calls.len());
            for call in &calls {
                let clock = std::time::Instant::now();
                let output = answer(self.tools, call);
                let seconds = clock.elapsed().as_secs_f64();
                let text = self.cut(&output.text).map_err(|e| observe(e.into()))?;
                let (tool, arguments) = match call {
                    Ok(c) => (
                        c.name.clone(),
                        Value::Object(c.arguments.clone()).to_string(),
                    ),
                    Err(m) => (String::new(), m.text.clone()),
                };
                answers.push(json!({"role": "tool", "name": tool, "content": text}));
                episode.calls.push(CallRecord {
                    turn,
                    tool,
                    arguments,
                    output: text,
                    ok: output.ok,
                    seconds,
                });
                if !output.ok && self.on_error == OnError::End {
                    episode.finish = if output.timed_out {
                        Finish::Timeout
                    } else {
                        Finish::ToolError
                    };
                    return Ok(episode);
                }
            }
            let next = appended(
                self.tokenizer,
                &history,
                &text,
                &self.end_of_turn,
                &answers,
                schemas.as_deref(),
            )
            .map_err(observe)?;
            let room = budgets.max_tokens - episode.tokens.len();
            if next.boundary.len() + next.observation.len() > room {
                episode.finish = Finish::Length;
                return Ok(episode);
            }
            episode.push(&next.boundary, TokenKind::Boundary, turn, None);
            episode.push(&next.observation, TokenKind::Observation, turn, None);
            context.extend_from_slice(&next.boundary);
            context.extend_from_slice(&next.observation);
            history.push(json!({"role": "assistant", "content": content}));
            history.extend(answers);
        }
        // Only a budget of zero turns gets here.
        Ok(episode)
    }

    /// `text` cut to `max_observation_tokens` tokens, with a marker saying
    /// how many were left out; text that fits exactly is kept whole.
    fn cut(&self, text: &str) -> Result<String, weir_gpu::ModelError> {
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
