//! The timely operator that runs one stage on every worker of its role.
//!
//! Inputs: the stage's data edge (exchanged by each batch's `dest`) and, for
//! a generator, the weights edge. Outputs: the data it sends on, its metric
//! rows, and, for a learner, weights messages for the generators.
//!
//! The operator keeps one capability per output at `next_end`, the first
//! step it has not yet ended, and walks the steps densely: once the data
//! input's frontier has passed step `s` and every batch of `s` has been
//! handed to the stage, it asks for `end_step(s)` — also for steps in which no
//! batch reached this worker, so a stage is told of every step. A generator
//! hands a batch of step `s` over only once the weights frontier has passed
//! `s` and every version that arrived at or before `s` is whole and queued
//! to load (a note's payload may still be on its way); a learner only once
//! every earlier step has ended.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use timely::dataflow::channels::pact::Exchange;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::operators::Capability;
use timely::dataflow::Stream;
use timely::progress::frontier::{Antichain, MutableAntichain};

use crate::control::OperatorEnv;
use crate::engine_thread::{Done, Executor, Job, StageKind, StageRunner, Versions};
use crate::metrics::{names, MetricRow};
use crate::stage::StageFactory;
use crate::weights_edge::{
    self as weights_edge, now_ns, Across, Awaited, Reassembly, WeightsBody, WeightsMessage,
    WeightsTransport,
};
use crate::{Batch, PolicyVersion, Step};

/// How long an inline stage may keep running queued jobs in one activation.
const INLINE_SLICE: Duration = Duration::from_millis(1);

/// Everything the operator needs to know about its stage.
#[derive(Clone)]
pub(crate) struct StageOpConfig {
    pub name: String,
    pub kind: StageKind,
    pub factory: StageFactory,
    pub workers: Vec<usize>,
    pub offload: Option<usize>,
    pub first_step: Step,
    pub version: PolicyVersion,
    pub max_staleness: u64,
    pub transport: Arc<dyn WeightsTransport>,
    /// The largest bucket of weights sent to another process.
    pub weights_bucket_bytes: usize,
    /// Workers that receive this learner's weights.
    pub generators: Vec<usize>,
    /// Whether the pipeline has a learner (which publishes a version every step).
    pub learns: bool,
}

/// The streams a stage operator produces.
pub(crate) struct StageStreams<'scope> {
    pub data: Stream<'scope, Step, Vec<Batch>>,
    pub metrics: Stream<'scope, Step, Vec<MetricRow>>,
    pub weights: Option<Stream<'scope, Step, Vec<WeightsMessage>>>,
}

/// Builds the operator for `cfg` reading `input` (and `weights` for a generator).
pub(crate) fn stage_operator<'scope>(
    input: Stream<'scope, Step, Vec<Batch>>,
    weights: Option<Stream<'scope, Step, Vec<WeightsMessage>>>,
    cfg: StageOpConfig,
    env: OperatorEnv,
) -> StageStreams<'scope> {
    let scope = input.scope();
    let mut builder = OperatorBuilder::new(format!("Stage({})", cfg.name), scope);
    let mut data_in = builder.new_input(input, Exchange::new(|b: &Batch| u64::from(b.dest)));
    let (data_out, data) = builder.new_output::<Vec<Batch>>();
    let (metrics_out, metrics) = builder.new_output::<Vec<MetricRow>>();
    let (weights_out, weights_stream) = builder.new_output::<Vec<WeightsMessage>>();
    // The weights input gates when batches may be processed but produces no
    // output itself: it is connected to no output. Were it connected, the
    // learner's capabilities would flow around the cycle into its own input
    // frontier and the loop would never drain.
    let no_outputs: Vec<(usize, Antichain<Step>)> = Vec::new();
    let mut weights_in = weights.map(|w| {
        builder.new_input_connection(
            w,
            Exchange::new(|m: &WeightsMessage| u64::from(m.dest)),
            no_outputs,
        )
    });
    let mut data_out = OutputBuilder::from(data_out);
    let mut metrics_out = OutputBuilder::from(metrics_out);
    let mut weights_out = OutputBuilder::from(weights_out);

    let me = scope.index();
    let address = builder.operator_info().address.to_vec();
    let activator = scope.worker().sync_activator_for(address.clone());
    let wake_on_weights = scope.worker().sync_activator_for(address.clone());
    let reschedule = scope.activator_for(address.into());
    let hosts = cfg.workers.contains(&me);
    let is_learner = cfg.kind == StageKind::Learn;

    builder.build(move |mut caps: Vec<Capability<Step>>| {
        let mut state = OpState::new(&cfg, me, env.threads);
        if hosts {
            if cfg.kind == StageKind::Generate {
                env.shared.weights.watch(me, wake_on_weights);
            }
            for cap in caps.iter_mut() {
                cap.downgrade(&cfg.first_step);
            }
            match state.start(&cfg, &env, activator) {
                Ok(executor) => state.executor = Some(executor),
                Err(err) => env.fail(err),
            }
        } else {
            // Not this worker's role: hold nothing, so the frontier flows past.
            caps.clear();
        }
        move |frontiers: &[MutableAntichain<Step>]| {
            if env.aborted() || state.executor.is_none() {
                data_in.for_each(|_, data| data.clear());
                if let Some(w) = weights_in.as_mut() {
                    w.for_each(|_, data| data.clear());
                }
                // The capabilities stay held until the driver drops the
                // dataflow, after the failure's grace: a peer process hears
                // of the failure before its frontiers pass a step this
                // operator never finished (a generator would otherwise see
                // a version pass without weights and report that instead).
                state.awaiting.clear();
                return;
            }
            // Weights first: a frontier past `s` means every message at or
            // before `s` is here (the bytes of a payload fetched or shelved
            // for this worker maybe not yet: `awaiting` holds those back).
            if let Some(w) = weights_in.as_mut() {
                w.for_each(|cap, data| {
                    let Some(&time) = cap.least() else { return };
                    for message in data.drain(..) {
                        if let Some(message) = state.receive(message, time, &env) {
                            state.load(message, now_ns());
                        }
                    }
                });
            }
            data_in.for_each(|cap, data| {
                let Some(&step) = cap.least() else { return };
                state.max_seen = Some(state.max_seen.map_or(step, |m| m.max(step)));
                for batch in data.drain(..) {
                    state.pending.entry(step).or_default().push_back(batch.data);
                }
            });
            if weights_in.is_some() {
                state.take_awaited(&env);
            }

            state.advance(cfg.kind, frontiers, &mut caps);
            let Emitted {
                data,
                metrics,
                reschedule: again,
            } = state.run_jobs(&cfg, &env, &caps);
            if again {
                reschedule.activate();
            }
            let mut data_session = data_out.activate();
            for (cap, batches) in data {
                data_session
                    .session(&cap)
                    .give_iterator(batches.into_iter().map(|data| Batch {
                        dest: me as u32,
                        data,
                    }));
            }
            let mut metrics_session = metrics_out.activate();
            for (cap, rows) in metrics {
                metrics_session
                    .session(&cap)
                    .give_iterator(rows.into_iter());
            }
            let mut weights_session = weights_out.activate();
            // Published weights leave one bucket per activation, each its own
            // timely message: a bucket is on the wire (and being landed)
            // while the next is serialised, and no buffer holds them all.
            let mut sent_bucket = false;
            while let Some((_, message)) = state.outgoing.front() {
                let bucket = matches!(message.body, WeightsBody::Bucket(_));
                if bucket && sent_bucket {
                    reschedule.activate();
                    break;
                }
                let (cap, message) = state.outgoing.pop_front().expect("just looked");
                weights_session.session(&cap).give(message);
                sent_bucket |= bucket;
            }
        }
    });

    // Every stage operator has the same three outputs; only a learner's
    // weights output is connected to the weights edge.
    StageStreams {
        data,
        metrics,
        weights: is_learner.then_some(weights_stream),
    }
}

/// How a learner's published `body` crosses to the other processes: over
/// the direct channel (set up in a cluster unless the run chose timely's)
/// when it is inline and another process receives it (offered once for
/// all of them), else in buckets.
fn across(
    cfg: &StageOpConfig,
    env: &OperatorEnv,
    body: &WeightsBody,
) -> Result<Across, crate::GraphError> {
    let buckets = Across::Buckets(cfg.weights_bucket_bytes);
    let receivers = weights_edge::receiving_processes(&cfg.generators, env.threads, env.process);
    match body {
        WeightsBody::Inline(payload) if env.shared.wire.enabled() && receivers > 0 => {
            Ok(Across::Wire(env.shared.wire.offer(payload, receivers)?))
        }
        WeightsBody::Inline(_)
        | WeightsBody::External
        | WeightsBody::Bucket(_)
        | WeightsBody::Shelved
        | WeightsBody::Wire(_) => Ok(buckets),
    }
}

/// What one activation's finished jobs send: batches and metric rows
/// under their capabilities, and whether the operator must run again soon.
#[derive(Default)]
struct Emitted {
    data: Vec<(Capability<Step>, Vec<RecordBatch>)>,
    metrics: Vec<(Capability<Step>, Vec<MetricRow>)>,
    reschedule: bool,
}

/// The operator's bookkeeping between activations.
struct OpState {
    me: usize,
    executor: Option<Executor>,
    pending: BTreeMap<Step, VecDeque<RecordBatch>>,
    jobs: JobQueue,
    next_end: Step,
    max_seen: Option<Step>,
    ending: BTreeMap<Step, Vec<Capability<Step>>>,
    newest_weights: PolicyVersion,
    queue_peak: u64,
    /// Weights arriving in buckets from another process.
    reassembly: Reassembly,
    /// The generator workers of this worker's process (itself among them).
    local_generators: Vec<usize>,
    /// Versions announced to this generator whose payload is not yet whole.
    awaiting: Awaited,
    /// Published weights not yet sent, with the capability they go under.
    outgoing: VecDeque<(Capability<Step>, WeightsMessage)>,
}

impl OpState {
    /// Schedules what the frontiers allow and ends the steps they passed,
    /// until nothing changes; then holds the capabilities at the first step
    /// not ended, or drops them once the data input is closed and drained.
    fn advance(
        &mut self,
        kind: StageKind,
        frontiers: &[MutableAntichain<Step>],
        caps: &mut Vec<Capability<Step>>,
    ) {
        let data_frontier = &frontiers[0];
        let weights_frontier = frontiers.get(1);
        loop {
            let before = (self.next_end, self.jobs.len());
            self.schedule(kind, weights_frontier);
            self.end_complete_steps(data_frontier, caps);
            if before == (self.next_end, self.jobs.len()) {
                break;
            }
        }
        match data_frontier.frontier().first() {
            Some(_) => {
                for cap in caps.iter_mut() {
                    cap.downgrade(&self.next_end);
                }
            }
            None if self.pending.is_empty() && self.max_seen.is_none_or(|m| self.next_end > m) => {
                caps.clear()
            }
            None => {}
        }
    }

    /// Hands the queued jobs to the executor and takes what it finished:
    /// the batches and metric rows to send, under their capabilities, and
    /// the weights a learner published (queued in `outgoing`).
    ///
    /// An engine thread answers later and wakes the operator. Inline jobs
    /// run here, back to back while they are quick. After a long job, or
    /// once a step has ended, the operator yields (`reschedule`): the output
    /// and the released step leave now, and other operators on this worker
    /// run, before the next (maybe long) job starts.
    fn run_jobs(
        &mut self,
        cfg: &StageOpConfig,
        env: &OperatorEnv,
        caps: &[Capability<Step>],
    ) -> Emitted {
        let mut out = Emitted::default();
        let started = Instant::now();
        let mut ended_a_step = false;
        let inline = matches!(self.executor, Some(Executor::Inline { .. }));
        loop {
            let executor = self
                .executor
                .as_mut()
                .expect("checked by the caller: this worker hosts the stage");
            while let Some(job) = self.jobs.pop() {
                if let Err(job) = executor.try_submit(job) {
                    self.jobs.push_front(job);
                    break;
                }
            }
            let depth = self.pending.values().map(VecDeque::len).sum::<usize>()
                + self.jobs.len()
                + executor.in_flight();
            self.queue_peak = self.queue_peak.max(depth as u64);
            for done in executor.poll() {
                ended_a_step |= self.finished(done, depth, cfg, env, caps, &mut out);
            }
            if !inline || self.jobs.is_empty() || env.aborted() {
                break;
            }
            if ended_a_step || started.elapsed() >= INLINE_SLICE {
                out.reschedule = true;
                break;
            }
        }
        out
    }

    /// Takes one finished job into `out`; true when it ended a step.
    fn finished(
        &mut self,
        done: Done,
        depth: usize,
        cfg: &StageOpConfig,
        env: &OperatorEnv,
        caps: &[Capability<Step>],
        out: &mut Emitted,
    ) -> bool {
        match done {
            Done::Output { step, batches } | Done::Streamed { step, batches } => {
                let cap = match self.ending.get(&step) {
                    Some(held) => held[0].clone(),
                    None => caps[0].delayed(&step),
                };
                out.data.push((cap, batches));
                false
            }
            Done::Ended {
                step,
                batches,
                published,
                mut metrics,
            } => {
                let Some(held) = self.ending.remove(&step) else {
                    return true;
                };
                out.data.push((held[0].clone(), batches));
                metrics.push(MetricRow::new(
                    step,
                    self.me as u32,
                    &cfg.name,
                    names::QUEUE_PEAK,
                    None,
                    self.queue_peak as f64,
                ));
                self.queue_peak = depth as u64;
                out.metrics.push((held[1].clone(), metrics));
                if let Some((version, body)) = published {
                    let sent_at = now_ns();
                    let across = match across(cfg, env, &body) {
                        Ok(across) => across,
                        Err(err) => {
                            env.fail(err);
                            // Held until the dataflow is dropped (see `stage_operator`).
                            self.ending.insert(step, held);
                            return true;
                        }
                    };
                    let messages = weights_edge::address(
                        &cfg.generators,
                        env.threads,
                        env.process,
                        (version, step, sent_at),
                        &body,
                        &across,
                    );
                    tracing::debug!(version, messages = messages.len(), "weights published");
                    self.outgoing
                        .extend(messages.into_iter().map(|m| (held[2].clone(), m)));
                }
                true
            }
            Done::Loaded => false,
            Done::Failed(err) => {
                env.fail(err);
                false
            }
        }
    }

    fn new(cfg: &StageOpConfig, me: usize, threads: usize) -> Self {
        let process = |w: usize| w / threads.max(1);
        OpState {
            me,
            local_generators: cfg
                .generators
                .iter()
                .copied()
                .filter(|&g| process(g) == process(me))
                .collect(),
            executor: None,
            pending: BTreeMap::new(),
            jobs: JobQueue::default(),
            next_end: cfg.first_step,
            max_seen: None,
            ending: BTreeMap::new(),
            newest_weights: cfg.version,
            queue_peak: 0,
            reassembly: Reassembly::default(),
            awaiting: Awaited::default(),
            outgoing: VecDeque::new(),
        }
    }

    /// Queues `message` (whole since `arrived_ns`) to be loaded, unless a
    /// version as new is loaded or queued already.
    fn load(&mut self, message: WeightsMessage, arrived_ns: u64) {
        if message.version > self.newest_weights {
            self.newest_weights = message.version;
            self.awaiting.settled_through(message.version);
            self.jobs.push(Job::LoadWeights {
                message,
                arrived_ns,
            });
        }
    }

    /// Queues the awaited versions that are whole on the shelf now. A
    /// version that will not come fails the run once a batch waits for it.
    fn take_awaited(&mut self, env: &OperatorEnv) {
        let pending = &self.pending;
        let (whole, failed) = self.awaiting.take(&env.shared.weights, self.me, |time| {
            pending.range(time..).next().is_some()
        });
        for (message, arrived_ns) in whole {
            self.load(message, arrived_ns);
        }
        if let Some(why) = failed {
            env.fail(crate::GraphError::Runtime(why));
        }
    }

    /// A weights message, arrived at `time`, as this generator loads it
    /// (`None`: not yet). Buckets are collected until the payload is whole,
    /// which is then shelved for the process's other generators; a note of
    /// where to fetch the payload starts the fetch for the whole process; a
    /// fetched or shelved payload is awaited ([`OpState::take_awaited`]).
    fn receive(
        &mut self,
        message: WeightsMessage,
        time: Step,
        env: &OperatorEnv,
    ) -> Option<WeightsMessage> {
        let bucket = match &message.body {
            WeightsBody::Bucket(bucket) => bucket,
            WeightsBody::Inline(_) | WeightsBody::External => return Some(message),
            WeightsBody::Shelved | WeightsBody::Wire(_) => {
                if let WeightsBody::Wire(note) = &message.body {
                    let takers = self.local_generators.clone();
                    weights_edge::fetch_for_process(&env.shared, note, &message, takers);
                }
                if message.version > self.newest_weights {
                    self.awaiting.insert(time, message);
                }
                return None;
            }
        };
        let first = self.reassembly.is_empty();
        let payload = match self.reassembly.add(bucket) {
            Ok(payload) => payload,
            Err(err) => {
                env.fail(err);
                return None;
            }
        };
        if first {
            tracing::debug!(
                version = message.version,
                since_sent_s = now_ns().saturating_sub(message.sent_at_ns) as f64 * 1e-9,
                "first weights bucket"
            );
        }
        let payload = payload?;
        tracing::debug!(
            version = message.version,
            bytes = payload.len(),
            since_sent_s = now_ns().saturating_sub(message.sent_at_ns) as f64 * 1e-9,
            "weights whole"
        );
        let others = self
            .local_generators
            .iter()
            .copied()
            .filter(|&g| g != self.me)
            .collect();
        env.shared
            .weights
            .put(message.version, payload.clone(), now_ns(), others);
        Some(WeightsMessage {
            body: WeightsBody::Inline(payload),
            ..message
        })
    }

    fn start(
        &self,
        cfg: &StageOpConfig,
        env: &OperatorEnv,
        activator: timely::scheduling::SyncActivator,
    ) -> Result<Executor, crate::GraphError> {
        let worker = env
            .worker_info(&cfg.workers)
            .expect("started only on the stage's workers");
        let versions = Versions {
            initial: cfg.version,
            first_step: cfg.first_step,
            max_staleness: cfg.max_staleness,
            fed: cfg.kind == StageKind::Generate && cfg.learns,
        };
        let (name, kind, factory, transport) = (
            cfg.name.clone(),
            cfg.kind,
            cfg.factory.clone(),
            cfg.transport.clone(),
        );
        let build = move || StageRunner::build(&name, kind, &factory, worker, versions, transport);
        match cfg.offload {
            None => Ok(Executor::inline(build()?)),
            Some(capacity) => Executor::spawn(&cfg.name, capacity, activator, build),
        }
    }

    /// Moves batches whose step may run now from `pending` to the job queue.
    fn schedule(&mut self, kind: StageKind, weights_frontier: Option<&MutableAntichain<Step>>) {
        while let Some((&step, _)) = self.pending.first_key_value() {
            let ready = match kind {
                StageKind::Plain => true,
                StageKind::Generate => {
                    weights_frontier.is_some_and(|w| !w.less_equal(&step))
                        && !self.awaiting.blocks(step)
                }
                StageKind::Learn => step <= self.next_end,
            };
            if !ready {
                break;
            }
            let batches = self.pending.remove(&step).expect("key just read");
            for batch in batches {
                self.jobs.push(Job::Process { step, batch });
            }
        }
    }

    /// Asks for `end_step` on every step the data frontier has passed whose batches are all handed over.
    fn end_complete_steps(
        &mut self,
        data_frontier: &MutableAntichain<Step>,
        caps: &[Capability<Step>],
    ) {
        if caps.is_empty() {
            return;
        }
        loop {
            let step = self.next_end;
            let passed = match data_frontier.frontier().first() {
                Some(&f) => step < f,
                // Input closed: end every step up to the last one that brought data.
                None => self.max_seen.is_some_and(|m| step <= m),
            };
            if !passed || self.pending.contains_key(&step) {
                return;
            }
            self.jobs.push(Job::EndStep { step });
            self.ending
                .insert(step, caps.iter().map(|c| c.delayed(&step)).collect());
            self.next_end += 1;
        }
    }
}

/// Jobs not yet handed to the executor, in the order they should run:
/// weights loads first (a generator should use the newest weights it has),
/// then by step, and within a step in arrival order — so `end_step(s)`,
/// queued after the last batch of `s`, runs before any batch of `s + 1` and
/// step `s` completes downstream as early as possible.
#[derive(Default)]
struct JobQueue {
    jobs: BTreeMap<(u8, Step, u64), Job>,
    seq: u64,
    front: Option<Job>,
}

impl JobQueue {
    fn push(&mut self, job: Job) {
        let key = match &job {
            Job::LoadWeights { .. } => (0, 0, self.seq),
            Job::Process { step, .. } | Job::EndStep { step } => (1, *step, self.seq),
        };
        self.seq += 1;
        self.jobs.insert(key, job);
    }

    /// Puts back a job the executor could not take, to be tried first next time.
    fn push_front(&mut self, job: Job) {
        self.front = Some(job);
    }

    fn pop(&mut self) -> Option<Job> {
        self.front
            .take()
            .or_else(|| self.jobs.pop_first().map(|(_, job)| job))
    }

    fn len(&self) -> usize {
        self.jobs.len() + usize::from(self.front.is_some())
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
