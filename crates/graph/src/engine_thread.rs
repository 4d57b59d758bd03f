//! Where a stage's calls run: inline on its worker, or on an engine thread.
//!
//! A [`StageRunner`] wraps one stage instance and does the engine's share of
//! every call: it stamps `policy_version` on a generator's output, stamps
//! `learner_version` and `staleness` on a learner's input (and checks the
//! bound), versions published weights, catches panics, and times the calls.
//!
//! An [`Executor`] runs the runner's jobs. `Inline` runs them on the worker
//! thread, in the operator's activation. `Thread` runs them on a dedicated
//! engine thread fed through a bounded queue: the operator stops handing over
//! jobs when the queue is full (backpressure inside a step), keeps running
//! other operators meanwhile, and is woken by a `SyncActivator` when results
//! are ready. The stage instance is built on the engine thread itself, so it
//! may hold thread-affine resources.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, RecordBatch, UInt64Array};
use timely::scheduling::SyncActivator;

use crate::batch::{u64_column, with_column, with_u64_column};
use crate::error::call_user;
use crate::metrics::{names, MetricRow};
use crate::stage::{Stage, StageFactory, StepContext, WorkerInfo};
use crate::weights_edge::{now_unix_s, WeightsBody, WeightsMessage, WeightsTransport};
use crate::{columns, GraphError, PolicyVersion, StageError, Step};

/// What the engine adds around a stage's calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageKind {
    /// A plain transformation.
    Plain,
    /// A generator: takes the weights edge, stamps `policy_version`.
    Generate,
    /// A learner: consumes steps in order, stamps `learner_version`/`staleness`, publishes weights.
    Learn,
}

/// A unit of work for a stage.
pub(crate) enum Job {
    Process {
        step: Step,
        batch: RecordBatch,
    },
    EndStep {
        step: Step,
    },
    /// Load a weights version; `arrived_ns`: when it was whole at this worker.
    LoadWeights {
        message: WeightsMessage,
        arrived_ns: u64,
    },
}

/// What loading one weights version took.
#[derive(Debug)]
struct WeightsLoad {
    /// From the learner's send until the payload was whole in this process.
    transfer_s: f64,
    /// Inside the stage's `load_weights` (the generator's pause).
    load_s: f64,
    bytes: usize,
}

/// Per-step figures a runner collects.
#[derive(Default, Debug)]
pub(crate) struct StepStats {
    busy_s: f64,
    batches_in: u64,
    rows_in: u64,
    rows_out: u64,
    staleness: BTreeMap<u64, u64>,
    recorded: Vec<(String, f64)>,
    recorded_under: Vec<(String, String, f64)>,
}

/// A finished job.
pub(crate) enum Done {
    Output {
        step: Step,
        batches: Vec<RecordBatch>,
    },
    Ended {
        step: Step,
        batches: Vec<RecordBatch>,
        published: Option<(PolicyVersion, WeightsBody)>,
        metrics: Vec<MetricRow>,
    },
    Loaded,
    /// Rows a streaming stage finished between jobs (no job of its own).
    Streamed {
        step: Step,
        batches: Vec<RecordBatch>,
    },
    Failed(GraphError),
}

/// The policy versions a stage instance starts from and sees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Versions {
    /// The version the run starts from, at `first_step`.
    pub initial: PolicyVersion,
    /// The run's first step.
    pub first_step: Step,
    /// The staleness bound.
    pub max_staleness: u64,
    /// A generator fed by a learner (which publishes a version every step).
    pub fed: bool,
}

impl Versions {
    /// For a generator fed by a learner: the oldest version it is sure to
    /// hold when it starts the step after `step`. The learner's step `s`
    /// publishes version `initial + (s − first_step) + 1` at time
    /// `s + max_staleness + 1` on the weights edge, and a generator starts a
    /// step only once the edge's frontier has passed it, so before step
    /// `step + 1` it has the version of the learner's step `step − k`, if
    /// that step exists. (Versions may arrive sooner; never later.)
    pub(crate) fn held_before_next(&self, step: Step) -> Option<PolicyVersion> {
        let from = self.first_step.checked_add(self.max_staleness)?;
        (self.fed && step >= from).then(|| self.initial + (step - from) + 1)
    }
}

/// One stage instance plus the engine's bookkeeping around it.
pub(crate) struct StageRunner {
    name: Arc<str>,
    kind: StageKind,
    stage: Box<dyn Stage>,
    worker: WorkerInfo,
    version: PolicyVersion,
    versions: Versions,
    transport: Arc<dyn WeightsTransport>,
    steps: BTreeMap<Step, StepStats>,
    transfers: Vec<WeightsLoad>,
}

impl StageRunner {
    pub(crate) fn build(
        name: &str,
        kind: StageKind,
        factory: &StageFactory,
        worker: WorkerInfo,
        versions: Versions,
        transport: Arc<dyn WeightsTransport>,
    ) -> Result<Self, GraphError> {
        let stage = guarded(name, None, worker.index, || factory(&worker))?;
        Ok(StageRunner {
            name: name.into(),
            kind,
            stage,
            worker,
            version: versions.initial,
            versions,
            transport,
            steps: BTreeMap::new(),
            transfers: Vec::new(),
        })
    }

    pub(crate) fn run(&mut self, job: Job) -> Done {
        match self.try_run(job) {
            Ok(done) => done,
            Err(err) => Done::Failed(err),
        }
    }

    fn try_run(&mut self, job: Job) -> Result<Done, GraphError> {
        match job {
            Job::Process { step, batch } => {
                let stats = self.steps.entry(step).or_default();
                stats.batches_in += 1;
                stats.rows_in += batch.num_rows() as u64;
                let batch = match self.kind {
                    StageKind::Learn => self.stamp_learner_input(step, batch)?,
                    StageKind::Plain | StageKind::Generate => batch,
                };
                let mut ctx = StepContext::new(
                    self.stage_name(),
                    step,
                    self.worker,
                    self.sampling_version(),
                    false,
                );
                let started = Instant::now();
                let out = guarded(&self.name, Some(step), self.worker.index, || {
                    self.stage.process(&mut ctx, batch)
                });
                let stats = self.steps.entry(step).or_default();
                stats.busy_s += started.elapsed().as_secs_f64();
                stats.recorded.append(&mut ctx.recorded);
                stats.recorded_under.append(&mut ctx.recorded_under);
                let batches = self.finish_output(step, out?)?;
                Ok(Done::Output { step, batches })
            }
            Job::EndStep { step } => {
                if self.stage.streaming() {
                    self.stage.input_ended(step);
                }
                let mut ctx = StepContext::new(
                    self.stage_name(),
                    step,
                    self.worker,
                    self.version,
                    self.kind == StageKind::Learn,
                );
                ctx.weights_retired = self
                    .versions
                    .held_before_next(step)
                    .is_some_and(|next| self.version < next);
                let started = Instant::now();
                let out = guarded(&self.name, Some(step), self.worker.index, || {
                    self.stage.end_step(&mut ctx)
                });
                let busy = started.elapsed().as_secs_f64();
                let batches = self.finish_output(step, out?)?;
                // A learner's step makes the next version whether or not this
                // worker publishes it (of data-parallel learners, one does).
                if self.kind == StageKind::Learn {
                    self.version += 1;
                }
                let published = match ctx.published.take() {
                    Some(weights) => {
                        Some((self.version, self.transport.pack(self.version, &weights)?))
                    }
                    None => None,
                };
                let mut stats = self.steps.remove(&step).unwrap_or_default();
                stats.busy_s += busy;
                stats.recorded.append(&mut ctx.recorded);
                stats.recorded_under.append(&mut ctx.recorded_under);
                Ok(Done::Ended {
                    step,
                    batches,
                    published,
                    metrics: self.step_metrics(step, stats),
                })
            }
            Job::LoadWeights {
                message,
                arrived_ns,
            } => {
                if message.version <= self.version {
                    return Ok(Done::Loaded);
                }
                let weights = self.transport.unpack(message.version, &message.body)?;
                let step = message.step;
                let started = Instant::now();
                guarded(&self.name, Some(step), self.worker.index, || {
                    self.stage.load_weights(message.version, &weights)
                })?;
                self.version = message.version;
                self.transfers.push(WeightsLoad {
                    transfer_s: arrived_ns.saturating_sub(message.sent_at_ns) as f64 * 1e-9,
                    load_s: started.elapsed().as_secs_f64(),
                    bytes: weights.len(),
                });
                Ok(Done::Loaded)
            }
        }
    }

    /// The stage's name in the pipeline.
    fn stage_name(&self) -> Arc<str> {
        self.name.clone()
    }

    /// The version of the weights the stage works with: for a generator,
    /// the one it samples with, which a streaming one may hold back from the
    /// last it was sent until its sequences end ([`Stage::policy_version`]).
    fn sampling_version(&self) -> PolicyVersion {
        self.stage.policy_version().unwrap_or(self.version)
    }

    /// True when the stage streams ([`Stage::streaming`]).
    pub(crate) fn streaming(&self) -> bool {
        self.stage.streaming()
    }

    /// Whether a streaming stage holds rows of `step` or earlier.
    pub(crate) fn holds(&self, step: Step) -> bool {
        self.stage.holds(step)
    }

    /// Tells a streaming stage that `step`'s input is complete.
    pub(crate) fn input_ended(&mut self, step: Step) {
        self.stage.input_ended(step);
    }

    /// One piece of a streaming stage's work; its busy time counts to the
    /// oldest step the stage holds.
    pub(crate) fn advance(&mut self) -> Vec<Done> {
        let step = self.steps.keys().copied().find(|&s| self.stage.holds(s));
        let started = Instant::now();
        let out = guarded(&self.name, step, self.worker.index, || self.stage.advance());
        if let Some(step) = step {
            self.steps.entry(step).or_default().busy_s += started.elapsed().as_secs_f64();
        }
        let mut by_step: BTreeMap<Step, Vec<RecordBatch>> = BTreeMap::new();
        match out {
            Ok(rows) => {
                for (step, batch) in rows {
                    by_step.entry(step).or_default().push(batch);
                }
            }
            Err(err) => return vec![Done::Failed(err)],
        }
        by_step
            .into_iter()
            .map(|(step, batches)| match self.finish_output(step, batches) {
                Ok(batches) => Done::Streamed { step, batches },
                Err(err) => Done::Failed(err),
            })
            .collect()
    }

    /// Adds `learner_version` and `staleness` to a learner's input, checking the bound.
    fn stamp_learner_input(
        &mut self,
        step: Step,
        batch: RecordBatch,
    ) -> Result<RecordBatch, GraphError> {
        let policy = u64_column(&batch, columns::POLICY_VERSION, &self.name)?;
        let mut staleness = Vec::with_capacity(policy.len());
        for &pv in policy.values() {
            let s = self.version.saturating_sub(pv);
            if s > self.versions.max_staleness {
                return Err(GraphError::StalenessViolated {
                    step,
                    learner_version: self.version,
                    policy_version: pv,
                    staleness: s,
                    max_staleness: self.versions.max_staleness,
                });
            }
            staleness.push(s);
        }
        let stats = self.steps.entry(step).or_default();
        for &s in &staleness {
            *stats.staleness.entry(s).or_insert(0) += 1;
        }
        let batch = with_u64_column(&batch, columns::LEARNER_VERSION, self.version)?;
        with_column(
            &batch,
            columns::STALENESS,
            Arc::new(UInt64Array::from(staleness)) as ArrayRef,
        )
    }

    fn finish_output(
        &mut self,
        step: Step,
        batches: Vec<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, GraphError> {
        // A generator that stamps its own rows (a streaming one: the oldest
        // token's version) keeps its stamps.
        let batches = match self.kind {
            StageKind::Generate => batches
                .iter()
                .map(|b| match b.column_by_name(columns::POLICY_VERSION) {
                    Some(_) => Ok(b.clone()),
                    None => with_u64_column(b, columns::POLICY_VERSION, self.version),
                })
                .collect::<Result<Vec<_>, _>>()?,
            StageKind::Plain | StageKind::Learn => batches,
        };
        self.steps.entry(step).or_default().rows_out +=
            batches.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        Ok(batches)
    }

    fn step_metrics(&mut self, step: Step, stats: StepStats) -> Vec<MetricRow> {
        let w = self.worker.index as u32;
        let row = |metric: &str, label: Option<String>, value: f64| {
            MetricRow::new(step, w, &self.name, metric, label, value)
        };
        let mut rows = vec![
            row(names::BUSY_S, None, stats.busy_s),
            row(names::BATCHES_IN, None, stats.batches_in as f64),
            row(names::ROWS_IN, None, stats.rows_in as f64),
            row(names::ROWS_OUT, None, stats.rows_out as f64),
            row(names::DONE_UNIX_S, None, now_unix_s()),
        ];
        if self.kind == StageKind::Generate {
            rows.push(row(
                names::POLICY_VERSION,
                None,
                self.sampling_version() as f64,
            ));
        }
        for (s, n) in &stats.staleness {
            rows.push(row(names::STALENESS, Some(s.to_string()), *n as f64));
        }
        for (name, value) in &stats.recorded {
            rows.push(row(name, None, *value));
        }
        for (stage, name, value) in &stats.recorded_under {
            rows.push(MetricRow::new(step, w, stage, name, None, *value));
        }
        for load in std::mem::take(&mut self.transfers) {
            rows.push(row(names::WEIGHTS_TRANSFER_S, None, load.transfer_s));
            rows.push(row(names::WEIGHTS_LOAD_S, None, load.load_s));
            rows.push(row(names::WEIGHTS_BYTES, None, load.bytes as f64));
        }
        tracing::debug!(stage = %self.name, step, worker = w, busy_s = stats.busy_s, rows_in = stats.rows_in, rows_out = stats.rows_out, version = self.version, "step ended");
        rows
    }
}

/// Runs a stage call, turning an error or a panic into a [`GraphError::Stage`].
fn guarded<R>(
    stage: &str,
    step: Option<Step>,
    worker: usize,
    call: impl FnOnce() -> Result<R, StageError>,
) -> Result<R, GraphError> {
    call_user(call).map_err(|cause| GraphError::stage(stage, step, worker, cause))
}

/// Runs a runner's jobs inline or on an engine thread.
pub(crate) enum Executor {
    /// On the worker thread, one job per activation, so each job's output
    /// leaves (and other operators run) before the next job starts.
    Inline {
        runner: Box<StageRunner>,
        slot: Option<Job>,
    },
    /// On an engine thread behind a bounded queue.
    Thread {
        jobs: SyncSender<Job>,
        results: Receiver<Done>,
        in_flight: usize,
    },
}

impl Executor {
    /// Runs jobs on the worker thread, one per activation.
    pub(crate) fn inline(runner: StageRunner) -> Self {
        Executor::Inline {
            runner: Box::new(runner),
            slot: None,
        }
    }

    /// Starts an engine thread with a queue of `capacity` jobs that builds the
    /// stage with `build` and wakes the operator through `activator`.
    pub(crate) fn spawn(
        name: &str,
        capacity: usize,
        activator: SyncActivator,
        build: impl FnOnce() -> Result<StageRunner, GraphError> + Send + 'static,
    ) -> Result<Self, GraphError> {
        let (jobs_tx, jobs_rx) = mpsc::sync_channel::<Job>(capacity.max(1));
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        std::thread::Builder::new()
            .name(format!("weir:{name}"))
            .spawn(move || {
                let mut runner = match build() {
                    Ok(runner) => runner,
                    Err(err) => {
                        let _ = done_tx.send(Done::Failed(err));
                        let _ = activator.activate();
                        return;
                    }
                };
                if runner.streaming() {
                    stream_jobs(&mut runner, &jobs_rx, &done_tx, &activator);
                    return;
                }
                for job in jobs_rx {
                    if done_tx.send(runner.run(job)).is_err() || activator.activate().is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| {
                GraphError::Runtime(format!("starting the engine thread of `{name}`: {e}"))
            })?;
        Ok(Executor::Thread {
            jobs: jobs_tx,
            results: done_rx,
            in_flight: 0,
        })
    }

    /// Hands over a job, or gives it back when the queue is full.
    pub(crate) fn try_submit(&mut self, job: Job) -> Result<(), Job> {
        match self {
            Executor::Inline { slot, .. } => match slot {
                Some(_) => Err(job),
                None => {
                    *slot = Some(job);
                    Ok(())
                }
            },
            Executor::Thread {
                jobs, in_flight, ..
            } => match jobs.try_send(job) {
                Ok(()) => {
                    *in_flight += 1;
                    Ok(())
                }
                Err(TrySendError::Full(job)) => Err(job),
                // The engine thread ended (it failed and reported it); drop the job.
                Err(TrySendError::Disconnected(_)) => Ok(()),
            },
        }
    }

    /// Results ready now; inline, this runs the job handed over.
    pub(crate) fn poll(&mut self) -> Vec<Done> {
        match self {
            Executor::Inline { runner, slot } => {
                let mut out: Vec<Done> =
                    slot.take().map(|job| runner.run(job)).into_iter().collect();
                // Inline, a streaming stage runs its rows to the end at once.
                while runner.streaming() && runner.holds(Step::MAX) {
                    let done = runner.advance();
                    let failed = done.iter().any(|d| matches!(d, Done::Failed(_)));
                    out.extend(done);
                    if failed {
                        break;
                    }
                }
                out
            }
            Executor::Thread {
                results, in_flight, ..
            } => {
                let out: Vec<Done> = results.try_iter().collect();
                let answers = out
                    .iter()
                    .filter(|d| !matches!(d, Done::Streamed { .. }))
                    .count();
                *in_flight = in_flight.saturating_sub(answers);
                out
            }
        }
    }

    /// Jobs handed over and not yet finished.
    pub(crate) fn in_flight(&self) -> usize {
        match self {
            Executor::Inline { slot, .. } => usize::from(slot.is_some()),
            Executor::Thread { in_flight, .. } => *in_flight,
        }
    }
}

/// An engine thread's loop for a streaming stage: jobs first while any
/// wait (batches join the pool, new weights apply between two passes),
/// otherwise one pass of the stage; `end_step(s)` waits until the stage no
/// longer holds rows of `s`. Blocks only when the stage holds nothing.
fn stream_jobs(
    runner: &mut StageRunner,
    jobs: &Receiver<Job>,
    done: &mpsc::Sender<Done>,
    activator: &SyncActivator,
) {
    let mut ending: std::collections::VecDeque<Step> = std::collections::VecDeque::new();
    let send = |d: Done| done.send(d).is_ok() && activator.activate().is_ok();
    loop {
        let job = if runner.holds(Step::MAX) {
            match jobs.try_recv() {
                Ok(job) => Some(job),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        };
        let results = match job {
            Some(Job::EndStep { step }) => {
                runner.input_ended(step);
                ending.push_back(step);
                // No answer comes until the step is filled: wake the operator
                // so that it hands over the jobs behind this one (the next
                // step's rows) now, not when the pool next emits rows.
                if activator.activate().is_err() {
                    return;
                }
                Vec::new()
            }
            Some(job) => vec![runner.run(job)],
            None => runner.advance(),
        };
        for d in results {
            let failed = matches!(d, Done::Failed(_));
            if !send(d) || failed {
                return;
            }
        }
        while let Some(&step) = ending.front() {
            if runner.holds(step) {
                break;
            }
            ending.pop_front();
            if !send(runner.run(Job::EndStep { step })) {
                return;
            }
        }
    }
}
