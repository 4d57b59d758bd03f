//! An episode as a state machine, so that whoever drives it decides when
//! its turns are sampled and its calls answered: [`EpisodeRunner::run`]
//! does both in line, one episode at a time; the episode pool
//! ([`super::pool`]) samples the turns of many in one decode pool and
//! answers their calls on other threads meanwhile.
//!
//! [`EpisodeRunner::begin`] gives the first [`Next`]; each sampled turn
//! goes to [`EpisodeRunner::sampled`] and each answer to
//! [`EpisodeRunner::answered`], each giving the next, until
//! [`Next::Done`]. [`work`] answers a [`Work`]: the calls of a turn against
//! the tools, or the environment's reset, step or close.

use serde_json::{json, Value};

use super::environment::{EnvFault, EnvStep, Environment, Observation};
use super::episode::{
    CallRecord, Episode, EpisodeError, EpisodeRunner, Finish, OnError, Sampled, TurnPolicy,
};
use super::observe::appended;
use super::tool_calls::{MalformedCall, ToolCall};
use super::tools::{answer, schemas, Tool, ToolOutput};
use crate::rollout::TokenKind;

/// What an episode needs next.
#[derive(Debug, PartialEq)]
pub enum Next {
    /// Its turn `turn`: at most `max_new` tokens sampled after `context`.
    Sample {
        /// The prompt and the response so far.
        context: Vec<i64>,
        /// What the budget leaves for this turn.
        max_new: usize,
        /// The turn, from 0.
        turn: usize,
    },
    /// Something answered off the decode path.
    Answer(Work),
    /// It is over.
    Done,
}

/// What a tool or the environment is asked.
#[derive(Clone, Debug, PartialEq)]
pub enum Work {
    /// The calls read from a turn.
    Tools(Vec<Result<ToolCall, MalformedCall>>),
    /// The environment's reset for the row (its columns as JSON) and the prompt's text.
    Reset(Value, String),
    /// The environment's step on a turn's text.
    Step(String),
}

/// What answered a [`Work`].
#[derive(Clone, Debug, PartialEq)]
pub enum Answered {
    /// Each call's output and the seconds it took.
    Tools(Vec<(ToolOutput, f64)>),
    /// The reset's rewritten prompt, if any.
    Reset(Result<Option<String>, EnvFault>),
    /// The step's answer.
    Step(Result<EnvStep, EnvFault>),
}

/// Answers `work` with `tools`, or with `environment` (which a reset or a
/// step needs).
pub fn work(
    tools: &[Box<dyn Tool>],
    environment: Option<&mut (dyn Environment + '_)>,
    work: Work,
) -> Answered {
    match (work, environment) {
        (Work::Tools(calls), _) => Answered::Tools(
            calls
                .iter()
                .map(|call| {
                    let clock = std::time::Instant::now();
                    let output = answer(tools, call);
                    (output, clock.elapsed().as_secs_f64())
                })
                .collect(),
        ),
        (Work::Reset(row, prompt), Some(env)) => Answered::Reset(env.reset(&row, &prompt)),
        (Work::Step(action), Some(env)) => Answered::Step(env.step(&action)),
        (Work::Reset(..), None) => Answered::Reset(Err("no environment to reset".into())),
        (Work::Step(_), None) => Answered::Step(Err("no environment to step".into())),
    }
}

/// An episode under way.
pub struct EpisodeState {
    history: Vec<Value>,
    context: Vec<i64>,
    episode: Episode,
    /// Whether an environment answers the turns.
    environment: bool,
    /// The last turn's text as sampled (its end-of-turn token included).
    text: String,
    /// The calls the last turn made.
    calls: Vec<Result<ToolCall, MalformedCall>>,
    /// The prompt's text, as an environment's reset received it.
    prompt_text: String,
    done: bool,
}

impl EpisodeState {
    /// The episode so far (whole once [`Next::Done`]).
    pub fn episode(&self) -> &Episode {
        &self.episode
    }

    /// The episode, ending it.
    pub fn into_episode(self) -> Episode {
        self.episode
    }

    /// Whether it is over.
    pub fn is_done(&self) -> bool {
        self.done
    }

    fn end(&mut self, finish: Finish) -> Next {
        self.episode.finish = finish;
        self.done = true;
        Next::Done
    }

    /// The content of the last turn: its text without the end-of-turn token.
    fn content<'a>(&'a self, end_of_turn: &str) -> &'a str {
        self.text.strip_suffix(end_of_turn).unwrap_or(&self.text)
    }
}

impl EpisodeRunner<'_> {
    /// Starts an episode from the conversation `messages`, rendered with
    /// the generation prompt as `prompt`; with `environment` (the row
    /// `row`), its reset comes first.
    pub fn begin(
        &self,
        messages: &[Value],
        prompt: &[i64],
        environment: Option<&Value>,
    ) -> Result<(EpisodeState, Next), EpisodeError> {
        let mut state = EpisodeState {
            history: messages.to_vec(),
            context: prompt.to_vec(),
            episode: Episode::empty(),
            environment: environment.is_some(),
            text: String::new(),
            calls: Vec::new(),
            prompt_text: String::new(),
            done: false,
        };
        let next = match environment {
            Some(row) => {
                state.prompt_text = self
                    .tokenizer
                    .decode(prompt, false)
                    .map_err(|e| observe_error(0, e.into()))?;
                Next::Answer(Work::Reset(row.clone(), state.prompt_text.clone()))
            }
            None => self.next_turn(&mut state),
        };
        Ok((state, next))
    }

    /// The next turn, or the end when no budget is left.
    fn next_turn(&self, state: &mut EpisodeState) -> Next {
        let turn = state.episode.turns_taken;
        if turn == self.budgets.max_turns {
            // Only a budget of zero turns gets here.
            return state.end(Finish::Length);
        }
        let left = self
            .budgets
            .max_tokens
            .saturating_sub(state.episode.tokens.len());
        if left == 0 {
            return state.end(Finish::Length);
        }
        Next::Sample {
            context: state.context.clone(),
            max_new: left,
            turn,
        }
    }

    /// Takes the turn the policy sampled; what follows it.
    pub fn sampled(
        &self,
        state: &mut EpisodeState,
        sampled: Sampled,
    ) -> Result<Next, EpisodeError> {
        let turn = state.episode.turns_taken;
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
        let left = self
            .budgets
            .max_tokens
            .saturating_sub(state.episode.tokens.len());
        let n = sampled.tokens.len().min(left);
        state.episode.push(
            &sampled.tokens[..n],
            TokenKind::Generated,
            turn,
            Some((
                &sampled.logprobs[..n],
                &sampled.sum_pi_squared[..n.min(sampled.sum_pi_squared.len())],
            )),
        );
        state.context.extend_from_slice(&sampled.tokens[..n]);
        state.episode.turns_taken = turn + 1;
        state.episode.turn_rewards.push(0.0);
        if !sampled.stopped || n < sampled.tokens.len() {
            return Ok(state.end(Finish::Length));
        }
        state.text = self
            .tokenizer
            .decode(&sampled.tokens, false)
            .map_err(|e| observe_error(turn, e.into()))?;
        let content = state.content(&self.end_of_turn).to_string();
        if state.environment {
            return Ok(Next::Answer(Work::Step(content)));
        }
        let calls = self.parser.parse(&content);
        if calls.is_empty() {
            return Ok(state.end(Finish::Stop));
        }
        if turn + 1 == self.budgets.max_turns {
            return Ok(state.end(Finish::MaxTurns));
        }
        state.calls = calls.clone();
        Ok(Next::Answer(Work::Tools(calls)))
    }

    /// Takes what answered the episode's last [`Work`]; what follows.
    pub fn answered(
        &self,
        state: &mut EpisodeState,
        answered: Answered,
    ) -> Result<Next, EpisodeError> {
        match answered {
            Answered::Reset(reset) => self.after_reset(state, reset),
            Answered::Step(step) => self.after_step(state, step),
            Answered::Tools(outputs) => self.after_tools(state, outputs),
        }
    }

    fn after_reset(
        &self,
        state: &mut EpisodeState,
        reset: Result<Option<String>, EnvFault>,
    ) -> Result<Next, EpisodeError> {
        match reset {
            Ok(Some(text)) => {
                if text != state.prompt_text {
                    let tokens = self
                        .tokenizer
                        .encode(&text, false)
                        .map_err(|e| observe_error(0, e.into()))?;
                    state.context.clone_from(&tokens);
                    state.episode.prompt = Some(tokens);
                }
            }
            Ok(None) => {}
            Err(EnvFault::Protocol(e)) => return Err(EpisodeError::Environment(e)),
            Err(fault) => {
                state.episode.env_error = Some(format!("reset: {}", fault.message()));
                return Ok(state.end(Finish::of_fault(&fault)));
            }
        }
        Ok(self.next_turn(state))
    }

    fn after_step(
        &self,
        state: &mut EpisodeState,
        step: Result<EnvStep, EnvFault>,
    ) -> Result<Next, EpisodeError> {
        let turn = state.episode.turns_taken - 1;
        let step = match step {
            Ok(step) => step,
            Err(EnvFault::Protocol(e)) => return Err(EpisodeError::Environment(e)),
            Err(fault) => {
                state.episode.env_error = Some(format!("turn {turn}: {}", fault.message()));
                match (&fault, self.on_error) {
                    (EnvFault::Error(e), OnError::Observe) => EnvStep {
                        observation: Observation::Text(format!("\nerror: {e}\n")),
                        reward: 0.0,
                        done: false,
                    },
                    (EnvFault::Error(_), OnError::End)
                    | (EnvFault::Timeout(_) | EnvFault::Protocol(_), _) => {
                        return Ok(state.end(Finish::of_fault(&fault)))
                    }
                }
            }
        };
        state.episode.turn_rewards[turn] = step.reward;
        if step.done {
            return Ok(state.end(Finish::Stop));
        }
        if turn + 1 == self.budgets.max_turns {
            return Ok(state.end(Finish::MaxTurns));
        }
        let observe = |source| observe_error(turn, source);
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
                    &state.history,
                    &state.text,
                    &self.end_of_turn,
                    &said,
                    self.schemas().as_deref(),
                )
                .map_err(observe)?;
                (next.boundary, next.observation, said)
            }
        };
        Ok(self.append(state, turn, &boundary, &observation, said))
    }

    fn after_tools(
        &self,
        state: &mut EpisodeState,
        outputs: Vec<(ToolOutput, f64)>,
    ) -> Result<Next, EpisodeError> {
        let turn = state.episode.turns_taken - 1;
        let calls = std::mem::take(&mut state.calls);
        let mut answers = Vec::with_capacity(calls.len());
        for (call, (output, seconds)) in calls.iter().zip(outputs) {
            let text = self
                .cut(&output.text)
                .map_err(|e| observe_error(turn, e.into()))?;
            let (tool, arguments) = match call {
                Ok(c) => (
                    c.name.clone(),
                    Value::Object(c.arguments.clone()).to_string(),
                ),
                Err(m) => (String::new(), m.text.clone()),
            };
            answers.push(json!({"role": "tool", "name": tool, "content": text}));
            state.episode.calls.push(CallRecord {
                turn,
                tool,
                arguments,
                output: text,
                ok: output.ok,
                seconds,
            });
            if !output.ok && self.on_error == OnError::End {
                let finish = if output.timed_out {
                    Finish::Timeout
                } else {
                    Finish::ToolError
                };
                return Ok(state.end(finish));
            }
        }
        let next = appended(
            self.tokenizer,
            &state.history,
            &state.text,
            &self.end_of_turn,
            &answers,
            self.schemas().as_deref(),
        )
        .map_err(|e| observe_error(turn, e))?;
        Ok(self.append(state, turn, &next.boundary, &next.observation, answers))
    }

    /// The tools' schemas, as the prompt was rendered with them.
    fn schemas(&self) -> Option<Vec<Value>> {
        (!self.tools.is_empty()).then(|| schemas(self.tools))
    }

    /// Appends what follows turn `turn` (the boundary, the observation, and
    /// the messages `said` to the conversation), or ends the episode when
    /// it does not fit the budget; then the next turn.
    fn append(
        &self,
        state: &mut EpisodeState,
        turn: usize,
        boundary: &[i64],
        observation: &[i64],
        said: Vec<Value>,
    ) -> Next {
        let room = self.budgets.max_tokens - state.episode.tokens.len();
        if boundary.len() + observation.len() > room {
            return state.end(Finish::Length);
        }
        state
            .episode
            .push(boundary, TokenKind::Boundary, turn, None);
        state
            .episode
            .push(observation, TokenKind::Observation, turn, None);
        state.context.extend_from_slice(boundary);
        state.context.extend_from_slice(observation);
        let content = state.content(&self.end_of_turn).to_string();
        state
            .history
            .push(json!({"role": "assistant", "content": content}));
        state.history.extend(said);
        self.next_turn(state)
    }
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
        let episode = self.run_in(policy, Some((&mut *environment, row)), messages, prompt);
        environment.close();
        episode
    }

    /// The episode's turns sampled and answered in line, one after another.
    fn run_in(
        &self,
        policy: &mut dyn TurnPolicy,
        mut environment: Option<(&mut dyn Environment, &Value)>,
        messages: &[Value],
        prompt: &[i64],
    ) -> Result<Episode, EpisodeError> {
        let row = environment.as_ref().map(|(_, row)| *row);
        let (mut state, mut next) = self.begin(messages, prompt, row)?;
        loop {
            next = match next {
                Next::Sample {
                    context,
                    max_new,
                    turn,
                } => {
                    let sampled = policy
                        .sample(&context, max_new)
                        .map_err(|message| EpisodeError::Policy { turn, message })?;
                    self.sampled(&mut state, sampled)?
                }
                Next::Answer(w) => {
                    let env = environment.as_mut().map(|(env, _)| &mut **env);
                    let answered = work(self.tools, env, w);
                    self.answered(&mut state, answered)?
                }
                Next::Done => return Ok(state.into_episode()),
            };
        }
    }
}

fn observe_error(turn: usize, source: super::observe::ObserveError) -> EpisodeError {
    EpisodeError::Observe { turn, source }
}
