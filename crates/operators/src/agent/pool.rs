//! The episode pool: episodes whose turns decode in one pool of sequences
//! (continuous batching, `weir_gpu::Streamer`). An episode whose turn
//! called a tool, or whose environment must answer, leaves the pool while
//! its call runs on one of `max_concurrency` threads, and the others go on
//! decoding; it comes back with its observation, its context prefilled
//! again. An episode with an environment holds one instance from its
//! reset to its close; episodes wait for a free instance when every one is
//! taken.
//!
//! [`EpisodePool`] is the engine: episodes join it by key
//! ([`EpisodePool::add`]) and [`EpisodePool::tick`] runs one decode pass
//! and takes the calls that came back, naming the episodes that ended.
//! [`run_episodes`] runs a batch's episodes to their ends with it; the
//! streaming episode generator ([`super::stream`]) keeps one across
//! batches and steps, its weights changing between passes.
//!
//! [`Schedule::Lockstep`] is what batch-level frameworks do instead (TRL's
//! tool loop): every episode's turn `t` decodes as one batch, then every
//! call runs, then turn `t + 1`; it is here so that the two can be
//! measured side by side (`cargo bench --bench agentic`).
//!
//! Each turn samples from its own random stream (the row's stream and the
//! turn), as [`super::episode::ModelPolicy`] does, so a row's episode is
//! the same whichever schedule runs it.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use weir_gpu::generate::{Backend, FinishReason};
use weir_gpu::{Model, OnNewWeights, Request, SamplingParams, Streamer};

use super::environment::{EnvFault, Environment};
use super::episode::{Episode, EpisodeError, EpisodeRunner, Sampled};
use super::tools::{Tool, ToolOutput};
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
    /// How long a call may be out before the pool gives up on it (a
    /// backstop for tools and environments that do not time themselves
    /// out): its episode goes on as after a timeout, and the thread and
    /// environment instance it holds are left to it.
    pub call_deadline: Option<Duration>,
    /// When turns start.
    pub schedule: Schedule,
    /// Where the turns decode.
    pub backend: Backend,
}

/// The random stream of `row`'s turn `turn`.
pub fn turn_stream(row: u64, turn: usize) -> u64 {
    row ^ ((turn as u64) << 48)
}

/// A call on its way to a thread: the episode, what it asks (`None`:
/// close its environment), and the episode's environment.
struct Job {
    key: u64,
    work: Option<Work>,
    environment: Option<Box<dyn Environment>>,
}

/// A call back from a thread.
struct Done {
    key: u64,
    answered: Option<Answered>,
    environment: Option<Box<dyn Environment>>,
}

/// Threads that answer calls, as long as the pool lives.
struct CallThreads {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Done>,
}

impl CallThreads {
    fn start(tools: Arc<Vec<Box<dyn Tool>>>, threads: usize) -> Result<Self, EpisodeError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let (answers, done) = mpsc::channel::<Done>();
        let queue = Arc::new(Mutex::new(queue));
        for _ in 0..threads.max(1) {
            let (queue, answers, tools) = (queue.clone(), answers.clone(), tools.clone());
            std::thread::Builder::new()
                .name("weir:episode-calls".into())
                .spawn(move || loop {
                    let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(Job {
                        key,
                        work: asked,
                        mut environment,
                    }) = job
                    else {
                        return;
                    };
                    let answered = match asked {
                        Some(asked) => Some(work(&tools, environment.as_deref_mut(), asked)),
                        None => {
                            if let Some(env) = environment.as_deref_mut() {
                                env.close();
                            }
                            None
                        }
                    };
                    let back = Done {
                        key,
                        answered,
                        environment,
                    };
                    if answers.send(back).is_err() {
                        return;
                    }
                })
                .map_err(|e| policy_error(0, e))?;
        }
        Ok(CallThreads { jobs, done })
    }
}

/// An episode in the pool.
struct Entry {
    input: EpisodeInput,
    state: Option<EpisodeState>,
    environment: Option<Box<dyn Environment>>,
    /// The policy version of each response token so far (an observation's:
    /// the version of the token before it).
    versions: Vec<u32>,
    /// Whether each token's context was computed under its own version
    /// (`kv_recomputed`): a turn that rejoins the pool has its whole
    /// context prefilled again, under the weights of its first token.
    recomputed: Vec<bool>,
    /// Whether its first turn drew a token yet.
    started: bool,
    done: bool,
}

/// Episodes decoding in one pool, their calls answered on threads.
pub struct EpisodePool {
    streamer: Streamer,
    calls: CallThreads,
    entries: HashMap<u64, Entry>,
    /// Environments no episode holds.
    free: Vec<Box<dyn Environment>>,
    with_environment: bool,
    /// Episodes not started (waiting for an environment), in arrival order.
    waiting: VecDeque<u64>,
    /// Turns held for the next lockstep round.
    held: Vec<Request>,
    /// Calls out (not counting closes).
    working: usize,
    /// Closes out.
    closing: usize,
    schedule: Schedule,
    /// Each call out: when the pool gives up on it, and what it asked.
    deadlines: HashMap<u64, (Instant, Work)>,
    call_deadline: Option<Duration>,
    /// Calls given up on, whose answers are dropped when they come.
    abandoned: std::collections::HashSet<u64>,
    /// Episodes whose first turn drew its first token since the last
    /// [`EpisodePool::take_started`], with the version then.
    started: Vec<(u64, u32)>,
    /// Episodes that ended since the last [`EpisodePool::tick`].
    ended: Vec<u64>,
}

impl EpisodePool {
    /// A pool of `max_inflight` sequences of `model` sampling with `params`
    /// (one sample each; `eos_token_ids` end a turn) at policy `version`,
    /// new weights reaching its sequences as `on_new_weights` says; calls
    /// answered by `tools` or by one of `environments` (each episode holds
    /// one while it runs).
    pub fn new(
        model: &Model,
        params: &SamplingParams,
        max_inflight: usize,
        (on_new_weights, version): (OnNewWeights, u32),
        tools: Arc<Vec<Box<dyn Tool>>>,
        environments: Vec<Box<dyn Environment>>,
        settings: PoolSettings,
    ) -> Result<Self, EpisodeError> {
        let streamer = Streamer::new(
            model,
            params.clone(),
            max_inflight,
            on_new_weights,
            version,
            settings.backend,
        )
        .map_err(|e| policy_error(0, e))?;
        Ok(EpisodePool {
            streamer,
            calls: CallThreads::start(tools, settings.max_concurrency)?,
            entries: HashMap::new(),
            with_environment: !environments.is_empty(),
            free: environments,
            waiting: VecDeque::new(),
            held: Vec::new(),
            working: 0,
            closing: 0,
            schedule: settings.schedule,
            deadlines: HashMap::new(),
            call_deadline: settings.call_deadline,
            abandoned: Default::default(),
            started: Vec::new(),
            ended: Vec::new(),
        })
    }

    /// The policy version the pool samples with.
    pub fn version(&self) -> u32 {
        self.streamer.version()
    }

    /// The decode pool (for its version and new weights).
    pub fn streamer(&mut self) -> &mut Streamer {
        &mut self.streamer
    }

    /// The pool's environments, when no episode holds one.
    pub fn into_environments(self) -> Vec<Box<dyn Environment>> {
        self.free
    }

    /// Whether anything is under way: sequences to decode, calls out,
    /// turns held for a round, or episodes waiting to start.
    pub fn busy(&self) -> bool {
        !self.streamer.is_idle()
            || self.working + self.closing > 0
            || !self.held.is_empty()
            || !self.waiting.is_empty()
    }

    /// Whether sequences are decoding (not counting those queued to start).
    pub fn decoding(&self) -> bool {
        self.streamer.live() > 0
    }

    /// Queues the episode `key`; it starts when an environment is free (at once without one).
    pub fn add(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
        key: u64,
        input: EpisodeInput,
    ) -> Result<(), EpisodeError> {
        let entry = Entry {
            input,
            state: None,
            environment: None,
            versions: Vec::new(),
            recomputed: Vec::new(),
            started: false,
            done: false,
        };
        self.entries.insert(key, entry);
        self.waiting.push_back(key);
        self.start_waiting(runner, model)
    }

    /// Episodes whose first turn drew its first token since the last call,
    /// with the policy version then.
    pub fn take_started(&mut self) -> Vec<(u64, u32)> {
        std::mem::take(&mut self.started)
    }

    /// The ended episode `key`, leaving the pool, with its tokens' policy
    /// versions and whether each token's context was computed under its
    /// version.
    pub fn take(&mut self, key: u64) -> Option<(Episode, Vec<u32>, Vec<bool>)> {
        let entry = self.entries.get(&key)?;
        if !entry.done || entry.environment.is_some() {
            return None;
        }
        let entry = self.entries.remove(&key)?;
        Some((
            entry.state?.into_episode(),
            entry.versions,
            entry.recomputed,
        ))
    }

    /// One pass: a decode pass when sequences are in flight, then the
    /// calls that came back; waits up to `wait` for a call when nothing
    /// decodes. Returns the episodes that ended.
    pub fn tick(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
        wait: Duration,
    ) -> Result<Vec<u64>, EpisodeError> {
        if self.schedule == Schedule::Lockstep
            && self.working == 0
            && self.streamer.is_idle()
            && !self.held.is_empty()
        {
            let round = std::mem::take(&mut self.held);
            self.submit(model, round)?;
        }
        if !self.streamer.is_idle() {
            let finished = self
                .streamer
                .advance(model)
                .map_err(|e| policy_error(0, e))?;
            for (key, version) in self.streamer.take_started() {
                if let Some(entry) = self.entries.get_mut(&key) {
                    if !entry.started {
                        entry.started = true;
                        self.started.push((key, version));
                    }
                }
            }
            for f in finished {
                let key = f.key;
                let sampled = Sampled {
                    stopped: f.generation.finish_reason == FinishReason::Stop,
                    tokens: f.generation.tokens,
                    logprobs: f.generation.logprobs,
                    sum_pi_squared: f.generation.sum_pi_squared,
                };
                let entry = self
                    .entries
                    .get_mut(&key)
                    .expect("a decoded key is in the pool");
                let state = entry.state.as_mut().expect("a decoding episode started");
                let rejoined = state.episode().turns_taken > 0;
                let next = runner.sampled(state, sampled).map_err(|e| in_row(key, e))?;
                // The turn's tokens kept, each with the version that drew it.
                let kept =
                    (state.episode().tokens.len() - entry.versions.len()).min(f.versions.len());
                let first = f.versions.first().copied();
                entry.versions.extend_from_slice(&f.versions[..kept]);
                entry.recomputed.extend((0..kept).map(|i| {
                    f.recomputed.get(i).copied().unwrap_or(false)
                        || (rejoined && Some(f.versions[i]) == first)
                }));
                self.follow(model, key, next)?;
            }
            while let Ok(done) = self.calls.done.try_recv() {
                self.back(runner, model, done)?;
            }
        } else if self.working + self.closing > 0 {
            // Nothing to decode: wait for a call to come back (or to be due).
            let due = self.deadlines.values().map(|(at, _)| *at).min();
            let wait = due.map_or(wait, |at| {
                wait.min(at.saturating_duration_since(Instant::now()))
            });
            match self.calls.done.recv_timeout(wait) {
                Ok(done) => self.back(runner, model, done)?,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(policy_error(0, "the call threads ended"))
                }
            }
        } else if self.held.is_empty() && !self.waiting.is_empty() {
            let stuck = self.waiting.len();
            return Err(policy_error(
                0,
                format!("{stuck} episode(s) wait for an environment and none will free"),
            ));
        }
        self.give_up_on_overdue(runner, model)?;
        Ok(std::mem::take(&mut self.ended))
    }

    /// Calls out past their deadline: each episode goes on as after a
    /// timeout (its tool calls timed out, its environment's reset or step a
    /// timeout), and the call's answer is dropped when it comes.
    fn give_up_on_overdue(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
    ) -> Result<(), EpisodeError> {
        let now = Instant::now();
        let overdue: Vec<u64> = self
            .deadlines
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(key, _)| *key)
            .collect();
        for key in overdue {
            let (_, asked) = self.deadlines.remove(&key).expect("listed above");
            self.working -= 1;
            self.abandoned.insert(key);
            let seconds = self.call_deadline.unwrap_or_default().as_secs_f64();
            let why = format!("no answer within {seconds} s: the pool gave up on the call");
            let answered = match asked {
                Work::Tools(calls) => Answered::Tools(
                    calls
                        .iter()
                        .map(|_| (ToolOutput::timed_out(format!("error: {why}")), seconds))
                        .collect(),
                ),
                Work::Reset(..) => Answered::Reset(Err(EnvFault::Timeout(why))),
                Work::Step(_) => Answered::Step(Err(EnvFault::Timeout(why))),
            };
            self.answer(runner, model, key, answered)?;
        }
        Ok(())
    }

    /// Starts waiting episodes while there are environments for them.
    fn start_waiting(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
    ) -> Result<(), EpisodeError> {
        while let Some(&key) = self.waiting.front() {
            let environment = if self.with_environment {
                let Some(env) = self.free.pop() else {
                    return Ok(());
                };
                Some(env)
            } else {
                None
            };
            self.waiting.pop_front();
            let entry = self
                .entries
                .get_mut(&key)
                .expect("a waiting key is in the pool");
            let row = environment.as_ref().map(|_| &entry.input.row);
            let (state, next) = runner
                .begin(&entry.input.messages, &entry.input.prompt, row)
                .map_err(|e| in_row(key, e))?;
            entry.state = Some(state);
            entry.environment = environment;
            self.follow(model, key, next)?;
        }
        Ok(())
    }

    /// Does what episode `key` needs next.
    fn follow(&mut self, model: &Model, key: u64, next: Next) -> Result<(), EpisodeError> {
        let entry = self
            .entries
            .get_mut(&key)
            .expect("a followed key is in the pool");
        match next {
            Next::Sample {
                context,
                max_new,
                turn,
            } => {
                let request = Request {
                    key,
                    prompt: context,
                    stream: turn_stream(entry.input.stream, turn),
                    greedy: false,
                    max_new_tokens: Some(max_new),
                };
                match self.schedule {
                    Schedule::Streaming => self.submit(model, vec![request])?,
                    Schedule::Lockstep => self.held.push(request),
                }
            }
            Next::Answer(asked) => {
                self.working += 1;
                if let Some(deadline) = self.call_deadline {
                    self.deadlines
                        .insert(key, (Instant::now() + deadline, asked.clone()));
                }
                self.send(key, Some(asked));
            }
            Next::Done => {
                entry.done = true;
                self.ended.push(key);
                if entry.environment.is_some() {
                    self.closing += 1;
                    self.send(key, None);
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, key: u64, work: Option<Work>) {
        let entry = self
            .entries
            .get_mut(&key)
            .expect("a sending key is in the pool");
        let job = Job {
            key,
            work,
            environment: entry.environment.take(),
        };
        // The threads live as long as the pool; a send fails only once they panicked.
        let _ = self.calls.jobs.send(job);
    }

    fn submit(&mut self, model: &Model, requests: Vec<Request>) -> Result<(), EpisodeError> {
        self.streamer
            .submit(model, requests)
            .map_err(|e| policy_error(0, e))
    }

    /// Takes a call's answer (or a closed environment back).
    fn back(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
        done: Done,
    ) -> Result<(), EpisodeError> {
        let key = done.key;
        if self.abandoned.remove(&key) {
            // Given up on: the episode went on without it; its environment
            // (if it holds one) serves others again.
            self.free.extend(done.environment);
            return self.start_waiting(runner, model);
        }
        let Some(answered) = done.answered else {
            self.closing -= 1;
            self.free.extend(done.environment);
            return self.start_waiting(runner, model);
        };
        self.working -= 1;
        self.deadlines.remove(&key);
        let entry = self
            .entries
            .get_mut(&key)
            .expect("an answered key is in the pool");
        entry.environment = done.environment;
        self.answer(runner, model, key, answered)
    }

    /// Gives episode `key` what answered its call; what follows.
    fn answer(
        &mut self,
        runner: &EpisodeRunner<'_>,
        model: &Model,
        key: u64,
        answered: Answered,
    ) -> Result<(), EpisodeError> {
        let entry = self
            .entries
            .get_mut(&key)
            .expect("an answered key is in the pool");
        let state = entry.state.as_mut().expect("an answered episode started");
        let next = runner
            .answered(state, answered)
            .map_err(|e| in_row(key, e))?;
        // What followed the turn: drawn by no policy, it takes the version
        // of the token before it.
        let last = entry
            .versions
            .last()
            .copied()
            .unwrap_or(self.streamer.version());
        let added = state.episode().tokens.len() - entry.versions.len();
        entry.versions.extend(std::iter::repeat_n(last, added));
        entry.recomputed.extend(std::iter::repeat_n(false, added));
        self.follow(model, key, next)
    }
}

/// Runs `inputs` as episodes of `runner`, their turns sampled by `model`
/// with `params` (one sample each; `eos_token_ids` end a turn), each with
/// one of `environments` when there are any (returned to the list once
/// every episode closed its own). The episodes in input order.
pub fn run_episodes(
    runner: &EpisodeRunner<'_>,
    model: &Model,
    params: &SamplingParams,
    inputs: &[EpisodeInput],
    tools: Arc<Vec<Box<dyn Tool>>>,
    environments: &mut Vec<Box<dyn Environment>>,
    settings: PoolSettings,
) -> Result<Vec<Episode>, EpisodeError> {
    let n = inputs.len();
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut pool = EpisodePool::new(
        model,
        params,
        n,
        (OnNewWeights::Finish, 0),
        tools,
        std::mem::take(environments),
        settings,
    )?;
    let outcome = (|| {
        for (i, input) in inputs.iter().enumerate() {
            pool.add(runner, model, i as u64, input.clone())?;
        }
        let mut episodes: Vec<Option<Episode>> = (0..n).map(|_| None).collect();
        let mut left = n;
        while left > 0 || pool.busy() {
            for key in pool.tick(runner, model, Duration::from_secs(3600))? {
                let (episode, _, _) = pool.take(key).expect("an ended episode is there");
                episodes[key as usize] = Some(episode);
                left -= 1;
            }
        }
        Ok(episodes
            .into_iter()
            .map(|e| e.expect("every episode ended"))
            .collect())
    })();
    // Whatever happened, the environments come back to the caller: those
    // still out come back as their calls end.
    while pool.working + pool.closing > 0 {
        match pool.calls.done.recv() {
            Ok(done) => {
                pool.free.extend(done.environment);
                if pool.abandoned.remove(&done.key) {
                    continue;
                }
                if done.answered.is_some() {
                    pool.working -= 1;
                } else {
                    pool.closing -= 1;
                }
            }
            Err(_) => break,
        }
    }
    let held: Vec<Box<dyn Environment>> = pool
        .entries
        .values_mut()
        .filter_map(|e| e.environment.take())
        .collect();
    pool.free.extend(held);
    *environments = pool.into_environments();
    outcome
}

/// `error` of the episode `key` (its row, for a batch's pool; a streaming
/// stage names the row of the key's batch).
fn in_row(key: u64, error: EpisodeError) -> EpisodeError {
    EpisodeError::InRow {
        row: key as usize,
        error: Box::new(error),
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

    /// The arith checkpoint and its tokenizer.
    fn arith() -> (Model, weir_gpu::Tokenizer) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/arith-sft");
        let model = Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
        (model, weir_gpu::Tokenizer::load(&dir).unwrap())
    }

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
        let (model, tokenizer) = arith();
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
                call_deadline: None,
                schedule,
                backend: Backend::Auto,
            };
            let episodes = run_episodes(
                &runner,
                &model,
                &params,
                &inputs,
                Arc::new(Vec::new()),
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

    /// Sleeps through its step.
    struct Hangs;

    impl Environment for Hangs {
        fn reset(&mut self, _row: &Value, _prompt: &str) -> Result<Option<String>, EnvFault> {
            Ok(None)
        }

        fn step(&mut self, _action: &str) -> Result<EnvStep, EnvFault> {
            std::thread::sleep(std::time::Duration::from_secs(5));
            Ok(EnvStep {
                observation: Observation::Text(String::new()),
                reward: 1.0,
                done: true,
            })
        }
    }

    #[test]
    fn a_call_past_its_deadline_is_given_up_on_and_its_episode_ends_as_a_timeout() {
        let (model, tokenizer) = arith();
        let params = SamplingParams {
            max_new_tokens: 16,
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            seed: 3,
            ..Default::default()
        };
        let runner = EpisodeRunner {
            tokenizer: &tokenizer,
            parser: &Hermes,
            tools: &[],
            end_of_turn: "<|im_end|>".into(),
            budgets: Budgets {
                max_turns: 2,
                max_tokens: 16,
                max_observation_tokens: 8,
            },
            on_error: OnError::Observe,
        };
        let messages = vec![json!({"role": "user", "content": "1+2="})];
        let inputs = vec![EpisodeInput {
            prompt: tokenizer
                .encode_conversation(&messages, None, true)
                .unwrap(),
            messages,
            stream: 1,
            row: json!({}),
        }];
        let mut environments: Vec<Box<dyn Environment>> = vec![Box::new(Hangs)];
        let settings = PoolSettings {
            max_concurrency: 1,
            call_deadline: Some(std::time::Duration::from_millis(200)),
            schedule: Schedule::Streaming,
            backend: Backend::Auto,
        };
        let episodes = run_episodes(
            &runner,
            &model,
            &params,
            &inputs,
            Arc::new(Vec::new()),
            &mut environments,
            settings,
        )
        .unwrap();
        let episode = &episodes[0];
        assert_eq!(episode.finish, crate::agent::episode::Finish::Timeout);
        let error = episode.env_error.as_deref().unwrap_or("");
        assert!(error.contains("the pool gave up on the call"), "{error}");
        assert!(
            environments.is_empty(),
            "the hanging instance is left to its call"
        );
    }
}
