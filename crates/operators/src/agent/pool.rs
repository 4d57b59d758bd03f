//! The episode pool: a batch's episodes run together. Their turns decode
//! in one pool of sequences (continuous batching, `weir_gpu::Streamer`);
//! an episode whose turn called a tool, or whose environment must answer,
//! leaves the pool while its call runs on one of `max_concurrency`
//! threads, and the others go on decoding; it comes back with its
//! observation, its context prefilled again. An episode with an
//! environment holds one instance from its reset to its close; episodes
//! wait for a free instance when every one is taken.
//!
//! [`Schedule::Lockstep`] is what batch-level frameworks do instead (TRL's
//! tool loop): every episode's turn `t` decodes as one batch, then every
//! call runs, then turn `t + 1`; it is here so that the two can be
//! measured side by side (`cargo bench --bench agentic`).
//!
//! Each turn samples from its own random stream (the row's stream and the
//! turn), as [`super::episode::ModelPolicy`] does, so a row's episode is
//! the same whichever schedule runs it.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use weir_gpu::generate::{Backend, FinishReason};
use weir_gpu::{Model, OnNewWeights, Request, SamplingParams, Streamer};

use super::environment::Environment;
use super::episode::{Episode, EpisodeError, EpisodeRunner, Sampled};
use super::turns::{work, Answered, EpisodeState, Next, Work};

/// When an episode's next turn may start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Schedule {
    /// As soon as its observation is in.
    #[default]
    Streaming,
    /// When every episode's turn and every call of the round have ended.
    Lockstep,
}

/// One episode to run.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeInput {
    /// The conversation its prompt renders.
    pub messages: Vec<Value>,
    /// The prompt's tokens.
    pub prompt: Vec<i64>,
    /// The row's random stream.
    pub stream: u64,
    /// The row (its columns as JSON), for an environment's reset.
    pub row: Value,
}

/// How the pool runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolSettings {
    /// Calls (tools, environment steps) running at once.
    pub max_concurrency: usize,
    /// When turns start.
    pub schedule: Schedule,
    /// Where the turns decode.
    pub backend: Backend,
}

/// A call on its way to a thread, or back: the episode, what it asks
/// (`None`: close its environment), and the episode's environment.
struct Job {
    episode: usize,
    work: Option<Work>,
    environment: Option<Box<dyn Environment>>,
}

struct Done {
    episode: usize,
    answered: Option<Answered>,
    environment: Option<Box<dyn Environment>>,
}

/// The random stream of `row`'s turn `turn`.
pub fn turn_stream(row: u64, turn: usize) -> u64 {
    row ^ ((turn as u64) << 48)
}

/// Runs `inputs` as episodes of `runner`, their turns sampled by `model`
/// with `params` (one sample each; `eos_token_ids` end a turn), each with
/// one of `environments` when there are any (each is returned to the
/// list once its episode closes it). The episodes in input order.
pub fn run_episodes(
    runner: &EpisodeRunner<'_>,
    model: &Model,
    params: &SamplingParams,
    inputs: &[EpisodeInput],
    environments: &mut Vec<Box<dyn Environment>>,
    settings: PoolSettings,
) -> Result<Vec<Episode>, EpisodeError> {
    let n = inputs.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let with_environment = !environments.is_empty();
    let streamer = Streamer::new(
        model,
        params.clone(),
        n,
        OnNewWeights::Finish,
        0,
        settings.backend,
    )
    .map_err(|e| EpisodeError::Policy {
        turn: 0,
        message: e.to_string(),
    })?;
    let (jobs, queue) = mpsc::channel::<Job>();
    let (answers, results) = mpsc::channel::<Done>();
    let queue = Arc::new(Mutex::new(queue));
    let tools = runner.tools;
    std::thread::scope(|scope| {
        for _ in 0..settings.max_concurrency.max(1) {
            let (queue, answers) = (queue.clone(), answers.clone());
            scope.spawn(move || loop {
                let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
                let Ok(Job {
                    episode,
                    work: asked,
                    mut environment,
                }) = job
                else {
                    return;
                };
                let answered = match asked {
                    Some(asked) => Some(work(tools, environment.as_deref_mut(), asked)),
                    None => {
                        if let Some(env) = environment.as_deref_mut() {
                            env.close();
                        }
                        None
                    }
                };
                let done = Done {
                    episode,
                    answered,
                    environment,
                };
                if answers.send(done).is_err() {
                    return;
                }
            });
        }
        drop(answers);
        let mut pool = Pool {
            runner,
            model,
            inputs,
            streamer,
            states: (0..n).map(|_| None).collect(),
            environments: (0..n).map(|_| None).collect(),
            free: std::mem::take(environments),
            waiting: (0..n).collect(),
            held: Vec::new(),
            jobs,
            working: 0,
            closing: 0,
            ended: 0,
            with_environment,
            schedule: settings.schedule,
        };
        let outcome = pool.run(&results);
        // Whatever happened, the environments come back to the caller.
        drop(pool.jobs);
        for done in results.iter() {
            pool.free.extend(done.environment);
        }
        pool.free.extend(pool.environments.into_iter().flatten());
        *environments = pool.free;
        outcome?;
        Ok(pool
            .states
            .into_iter()
            .map(|s| s.expect("every episode ran").into_episode())
            .collect())
    })
}

struct Pool<'r, 'a> {
    runner: &'r EpisodeRunner<'a>,
    model: &'r Model,
    inputs: &'r [EpisodeInput],
    streamer: Streamer,
    states: Vec<Option<EpisodeState>>,
    /// The environment each episode holds.
    environments: Vec<Option<Box<dyn Environment>>>,
    /// Environments no episode holds.
    free: Vec<Box<dyn Environment>>,
    /// Episodes not started (waiting for an environment).
    waiting: VecDeque<usize>,
    /// Turns held for the next lockstep round.
    held: Vec<Request>,
    jobs: mpsc::Sender<Job>,
    /// Calls out (not counting closes).
    working: usize,
    /// Closes out.
    closing: usize,
    ended: usize,
    with_environment: bool,
    schedule: Schedule,
}

impl Pool<'_, '_> {
    fn run(&mut self, results: &mpsc::Receiver<Done>) -> Result<(), EpisodeError> {
        self.start_waiting()?;
        let n = self.inputs.len();
        while self.ended < n || self.closing > 0 {
            if self.schedule == Schedule::Lockstep
                && self.working == 0
                && self.streamer.is_idle()
                && !self.held.is_empty()
            {
                let round = std::mem::take(&mut self.held);
                self.submit(round)?;
            }
            if !self.streamer.is_idle() {
                let finished = self
                    .streamer
                    .advance(self.model)
                    .map_err(|e| policy_error(0, e))?;
                for f in finished {
                    let i = f.key as usize;
                    let sampled = Sampled {
                        stopped: f.generation.finish_reason == FinishReason::Stop,
                        tokens: f.generation.tokens,
                        logprobs: f.generation.logprobs,
                    };
                    let state = self.states[i].as_mut().expect("a decoding episode started");
                    let next = self
                        .runner
                        .sampled(state, sampled)
                        .map_err(|e| in_row(i, e))?;
                    self.follow(i, next)?;
                }
                while let Ok(done) = results.try_recv() {
                    self.take(done)?;
                }
            } else if self.working + self.closing > 0 {
                // Nothing to decode: wait for a call to come back.
                let done = results
                    .recv()
                    .map_err(|_| policy_error(0, "the call threads ended"))?;
                self.take(done)?;
            } else if self.held.is_empty() {
                let stuck = self.waiting.len();
                return Err(policy_error(
                    0,
                    format!("{stuck} episode(s) wait for an environment and none will free"),
                ));
            }
        }
        Ok(())
    }

    /// Starts waiting episodes while there are environments for them.
    fn start_waiting(&mut self) -> Result<(), EpisodeError> {
        while let Some(&i) = self.waiting.front() {
            let row = if self.with_environment {
                let Some(env) = self.free.pop() else {
                    return Ok(());
                };
                self.environments[i] = Some(env);
                Some(&self.inputs[i].row)
            } else {
                None
            };
            self.waiting.pop_front();
            let input = &self.inputs[i];
            let (state, next) = self
                .runner
                .begin(&input.messages, &input.prompt, row)
                .map_err(|e| in_row(i, e))?;
            self.states[i] = Some(state);
            self.follow(i, next)?;
        }
        Ok(())
    }

    /// Does what episode `i` needs next.
    fn follow(&mut self, i: usize, next: Next) -> Result<(), EpisodeError> {
        match next {
            Next::Sample {
                context,
                max_new,
                turn,
            } => {
                let request = Request {
                    key: i as u64,
                    prompt: context,
                    stream: turn_stream(self.inputs[i].stream, turn),
                    greedy: false,
                    max_new_tokens: Some(max_new),
                };
                match self.schedule {
                    Schedule::Streaming => self.submit(vec![request])?,
                    Schedule::Lockstep => self.held.push(request),
                }
            }
            Next::Answer(asked) => {
                self.working += 1;
                self.send(i, Some(asked));
            }
            Next::Done => {
                self.ended += 1;
                if self.environments[i].is_some() {
                    self.closing += 1;
                    self.send(i, None);
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, episode: usize, work: Option<Work>) {
        let job = Job {
            episode,
            work,
            environment: self.environments[episode].take(),
        };
        // The threads live as long as the pool; a send fails only once they panicked.
        let _ = self.jobs.send(job);
    }

    fn submit(&mut self, requests: Vec<Request>) -> Result<(), EpisodeError> {
        self.streamer
            .submit(self.model, requests)
            .map_err(|e| policy_error(0, e))
    }

    /// Takes a call's answer (or a closed environment back).
    fn take(&mut self, done: Done) -> Result<(), EpisodeError> {
        let i = done.episode;
        match done.answered {
            Some(answered) => {
                self.working -= 1;
                self.environments[i] = done.environment;
                let state = self.states[i]
                    .as_mut()
                    .expect("an answered episode started");
                let next = self
                    .runner
                    .answered(state, answered)
                    .map_err(|e| in_row(i, e))?;
                self.follow(i, next)
            }
            None => {
                self.closing -= 1;
                self.free.extend(done.environment);
                self.start_waiting()
            }
        }
    }
}

fn in_row(row: usize, source: EpisodeError) -> EpisodeError {
    EpisodeError::InRow {
        row,
        error: Box::new(source),
    }
}

fn policy_error(turn: usize, e: impl ToString) -> EpisodeError {
    EpisodeError::Policy {
        turn,
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::environment::{EnvFault, EnvStep, Observation};
    use crate::agent::episode::{Budgets, ModelPolicy, OnError};
    use crate::agent::tool_calls::Hermes;
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Three turns of raw-text feedback, each worth its turn's index; it
    /// counts the episodes it serves at once, and the most it ever saw.
    struct Counted {
        steps: usize,
        busy: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        resets: Arc<AtomicUsize>,
    }

    impl Environment for Counted {
        fn reset(&mut self, _row: &Value, _prompt: &str) -> Result<Option<String>, EnvFault> {
            let now = self.busy.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            self.resets.fetch_add(1, Ordering::SeqCst);
            self.steps = 0;
            Ok(None)
        }

        fn step(&mut self, _action: &str) -> Result<EnvStep, EnvFault> {
            self.steps += 1;
            std::thread::sleep(std::time::Duration::from_millis(5));
            Ok(EnvStep {
                observation: Observation::Text(" again:".into()),
                reward: self.steps as f64,
                done: self.steps == 3,
            })
        }

        fn close(&mut self) {
            self.busy.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn streaming_lockstep_and_one_at_a_time_give_the_same_episodes_within_the_instances() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/arith-sft");
        let model = Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
        let tokenizer = weir_gpu::Tokenizer::load(&dir).unwrap();
        let params = SamplingParams {
            max_new_tokens: 40,
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            temperature: 1.0,
            seed: 3,
            ..Default::default()
        };
        let tools: Vec<Box<dyn crate::agent::tools::Tool>> = Vec::new();
        let runner = EpisodeRunner {
            tokenizer: &tokenizer,
            parser: &Hermes,
            tools: &tools,
            end_of_turn: "<|im_end|>".into(),
            budgets: Budgets {
                max_turns: 4,
                max_tokens: 40,
                max_observation_tokens: 8,
            },
            on_error: OnError::Observe,
        };
        let inputs: Vec<EpisodeInput> = (0..6)
            .map(|i| {
                let messages = vec![json!({"role": "user", "content": format!("{i}+{}=", 2 * i)})];
                EpisodeInput {
                    prompt: tokenizer
                        .encode_conversation(&messages, None, true)
                        .unwrap(),
                    messages,
                    stream: 100 + i as u64,
                    row: json!({"i": i}),
                }
            })
            .collect();
        let (busy, most, resets) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let instances = |n: usize| -> Vec<Box<dyn Environment>> {
            (0..n)
                .map(|_| {
                    Box::new(Counted {
                        steps: 0,
                        busy: busy.clone(),
                        most: most.clone(),
                        resets: resets.clone(),
                    }) as Box<dyn Environment>
                })
                .collect()
        };
        let mut runs = Vec::new();
        for schedule in [Schedule::Streaming, Schedule::Lockstep] {
            let mut environments = instances(2);
            let settings = PoolSettings {
                max_concurrency: 4,
                schedule,
                backend: Backend::Auto,
            };
            let episodes = run_episodes(
                &runner,
                &model,
                &params,
                &inputs,
                &mut environments,
                settings,
            )
            .unwrap();
            assert_eq!(environments.len(), 2, "every instance comes back");
            runs.push(episodes);
        }
        assert_eq!(resets.load(Ordering::SeqCst), 12, "one reset per episode");
        assert_eq!(
            most.load(Ordering::SeqCst),
            2,
            "never more episodes than instances"
        );
        assert_eq!(busy.load(Ordering::SeqCst), 0, "every episode closed");
        // One at a time, in line, with the model's own turns.
        let one_by_one: Vec<Episode> = inputs
            .iter()
            .map(|input| {
                let mut policy = ModelPolicy::new(&model, params.clone(), input.stream);
                let mut env = instances(1).pop().unwrap();
                runner
                    .run_with(
                        &mut policy,
                        env.as_mut(),
                        &input.row,
                        &input.messages,
                        &input.prompt,
                    )
                    .unwrap()
            })
            .collect();
        runs.push(one_by_one);
        let multi_turn = runs[0].iter().filter(|e| e.turns_taken > 1).count();
        assert!(multi_turn > 0, "some episode got past its first turn");
        for run in &runs[1..] {
            for (a, b) in runs[0].iter().zip(run) {
                assert_eq!(a.tokens, b.tokens);
                assert_eq!(a.kinds, b.kinds);
                assert_eq!(a.turn_rewards, b.turn_rewards);
                assert_eq!(a.finish, b.finish);
                for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                    match (x, y) {
                        (Some(x), Some(y)) => assert!((x - y).abs() < 1e-4, "{x} vs {y}"),
                        (None, None) => {}
                        _ => panic!("log-probs on different tokens"),
                    }
                }
            }
        }
    }
}
