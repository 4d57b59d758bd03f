//! Running a pipeline: one thread, N threads, or N processes (timely's cluster mode).
//!
//! Every worker builds the same dataflow and runs the same driver loop: feed
//! the source under [`Admission`] (backpressure), step the dataflow (parking
//! when idle), and watch the control stream. The control stream is a small
//! broadcast side-dataflow that carries heartbeats and failures between all
//! workers of all processes, so that
//! - a stage error on any worker stops every worker of every process with
//!   that one error (naming the stage and the step), and
//! - a peer process that stops answering (no heartbeat for `peer_timeout`) or
//!   whose connection breaks ends the run with [`GraphError::PeerLost`].

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use timely::communication::Config as CommunicationConfig;
use timely::dataflow::channels::pact::{Exchange, Pipeline as LocalPact};
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::{Concatenate, ConnectLoop, Input, Operator, Probe};
use timely::dataflow::{InputHandle, ProbeHandle, Scope};
use timely::worker::Worker;
use timely::WorkerConfig;

use crate::edges::{route, sink_operator};
use crate::engine_thread::StageKind;
use crate::error::{call_user, panic_message};
use crate::metrics::MetricRow;
use crate::pipeline::Node;
use crate::stage::{SourceContext, WorkerInfo};
use crate::stage_op::{stage_operator, StageOpConfig};
use crate::weights_edge::{weights_edge, InlineTransport, WeightsTransport};
use crate::{
    Admission, Batch, GraphError, Pipeline, Placement, PolicyVersion, Router, RunReport, Step,
};

/// How many workers, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Execution {
    /// `n` worker threads in this process (`Threads(1)`: a single thread).
    Threads(usize),
    /// One of several processes (timely cluster mode).
    Cluster {
        /// Worker threads per process.
        threads: usize,
        /// This process's id, `0..hosts.len()`.
        process: usize,
        /// `host:port` of every process, in process-id order.
        hosts: Vec<String>,
    },
}

impl Execution {
    /// A cluster of `processes` processes: addresses from `hostfile` (one
    /// `host:port` per line), or `localhost:2101..` when `None`.
    pub fn cluster(
        threads: usize,
        processes: usize,
        process: usize,
        hostfile: Option<&Path>,
    ) -> Result<Self, GraphError> {
        if processes == 0 || threads == 0 {
            return Err(GraphError::Execution(
                "processes and threads must be at least 1".into(),
            ));
        }
        if process >= processes {
            return Err(GraphError::Execution(format!(
                "process id {process} is not below the process count {processes}"
            )));
        }
        if processes == 1 {
            return Ok(Execution::Threads(threads));
        }
        let hosts: Vec<String> = match hostfile {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| GraphError::io(path, e))?;
                let hosts: Vec<String> = text
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from)
                    .collect();
                if let Some((i, bad)) = hosts.iter().enumerate().find(|(_, h)| !h.contains(':')) {
                    return Err(GraphError::Execution(format!(
                        "{}: line {}: `{bad}` is not host:port",
                        path.display(),
                        i + 1
                    )));
                }
                if hosts.len() < processes {
                    return Err(GraphError::Execution(format!(
                        "{}: {} addresses for {processes} processes",
                        path.display(),
                        hosts.len()
                    )));
                }
                hosts.into_iter().take(processes).collect()
            }
            None => (0..processes)
                .map(|i| format!("localhost:{}", 2101 + i))
                .collect(),
        };
        Ok(Execution::Cluster {
            threads,
            process,
            hosts,
        })
    }

    /// Total workers over all processes.
    pub fn total_workers(&self) -> usize {
        match self {
            Execution::Threads(n) => *n,
            Execution::Cluster { threads, hosts, .. } => threads * hosts.len(),
        }
    }

    /// This process's id.
    pub fn process(&self) -> usize {
        match self {
            Execution::Threads(_) => 0,
            Execution::Cluster { process, .. } => *process,
        }
    }

    fn local_workers(&self) -> usize {
        match self {
            Execution::Threads(n) => (*n).max(1),
            Execution::Cluster { threads, .. } => *threads,
        }
    }

    fn processes(&self) -> usize {
        match self {
            Execution::Threads(_) => 1,
            Execution::Cluster { hosts, .. } => hosts.len(),
        }
    }

    fn communication(&self) -> CommunicationConfig {
        match self {
            Execution::Threads(0 | 1) => CommunicationConfig::Thread,
            Execution::Threads(n) => CommunicationConfig::Process(*n),
            Execution::Cluster {
                threads,
                process,
                hosts,
            } => CommunicationConfig::Cluster {
                threads: *threads,
                process: *process,
                addresses: hosts.clone(),
                report: false,
                zerocopy: false,
            },
        }
    }
}

/// Everything about a run that is not the pipeline itself.
#[derive(Clone)]
pub struct RunSettings {
    /// Threads and processes.
    pub execution: Execution,
    /// Which workers run which role.
    pub placement: Placement,
    /// k: a generator at step s holds a version ≥ s − k; at most k + 1 steps are in flight.
    pub max_staleness: u64,
    /// Steps to run (`None`: until the source is exhausted).
    pub steps: Option<u64>,
    /// The first step (a resumed run continues its counter).
    pub first_step: Step,
    /// The policy version the generators and the learner start from.
    pub initial_version: PolicyVersion,
    /// How long a silent peer process is tolerated, and how long start-up
    /// may wait for peers to connect.
    pub peer_timeout: Duration,
    /// Where to write every metric row as Parquet (process of worker 0), if anywhere.
    pub metrics_path: Option<PathBuf>,
    /// How weights cross the weights edge.
    pub transport: Arc<dyn WeightsTransport>,
}

impl RunSettings {
    /// Settings with k = 0, an unbounded number of steps, a 60 s peer timeout
    /// and the inline weights transport.
    pub fn new(execution: Execution, placement: Placement) -> Self {
        RunSettings {
            execution,
            placement,
            max_staleness: 0,
            steps: None,
            first_step: 0,
            initial_version: 0,
            peer_timeout: Duration::from_secs(60),
            metrics_path: None,
            transport: Arc::new(InlineTransport),
        }
    }

    /// Sets `max_staleness`.
    pub fn max_staleness(mut self, k: u64) -> Self {
        self.max_staleness = k;
        self
    }

    /// Sets the number of steps.
    pub fn steps(mut self, steps: u64) -> Self {
        self.steps = Some(steps);
        self
    }

    /// Sets the peer timeout.
    pub fn peer_timeout(mut self, timeout: Duration) -> Self {
        self.peer_timeout = timeout;
        self
    }

    /// Sets where metrics are written.
    pub fn metrics_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.metrics_path = Some(path.into());
        self
    }
}

/// Messages of the control side-dataflow.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Control {
    Heartbeat { process: usize },
    Failed { process: usize, error: GraphError },
}

/// State shared by the workers of one process.
struct RunShared {
    aborted: AtomicBool,
    error: Mutex<Option<GraphError>>,
    last_heard: Mutex<Vec<Instant>>,
}

impl RunShared {
    fn new(processes: usize) -> Self {
        RunShared {
            aborted: AtomicBool::new(false),
            error: Mutex::new(None),
            last_heard: Mutex::new(vec![Instant::now(); processes]),
        }
    }

    /// Records `err` as the run's error if it is the first; aborts the run.
    fn record(&self, err: GraphError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(err);
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    fn error(&self) -> Option<GraphError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn heard_from(&self, process: usize) {
        let mut heard = self.last_heard.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = heard.get_mut(process) {
            *t = Instant::now();
        }
    }

    /// The first peer silent for longer than `timeout`, if any.
    fn silent_peer(&self, me: usize, timeout: Duration) -> Option<(usize, Duration)> {
        let heard = self.last_heard.lock().unwrap_or_else(|p| p.into_inner());
        heard
            .iter()
            .enumerate()
            .filter(|(p, _)| *p != me)
            .map(|(p, t)| (p, t.elapsed()))
            .find(|(_, e)| *e > timeout)
    }
}

/// What an operator needs from its surroundings: where it runs and how to fail.
#[derive(Clone)]
pub(crate) struct OperatorEnv {
    shared: Arc<RunShared>,
    outbox: Rc<RefCell<Vec<GraphError>>>,
    pub index: usize,
    pub peers: usize,
    pub process: usize,
}

impl OperatorEnv {
    /// Fails the run: this process stops at once, the driver tells the others.
    pub(crate) fn fail(&self, err: GraphError) {
        tracing::debug!(%err, "run failed");
        self.shared.record(err.clone());
        self.outbox.borrow_mut().push(err);
    }

    pub(crate) fn aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::Relaxed)
    }
}

/// What one worker hands back.
struct WorkerOutcome {
    steps: u64,
    peak_in_flight: u64,
    metrics: Vec<MetricRow>,
}

/// How long a worker parks when idle before checking heartbeats and aborts.
const PARK: Duration = Duration::from_millis(20);
/// After a failure, how long a worker keeps stepping so the news reaches its peers.
const FAILURE_GRACE: Duration = Duration::from_millis(300);

/// Runs `pipeline` with `settings` to completion. Returns the run's report
/// or its first error; never hangs on a failed stage or a lost peer.
pub fn run(pipeline: &Pipeline, settings: &RunSettings) -> Result<RunReport, GraphError> {
    let workers = settings.execution.total_workers();
    if workers == 0 {
        return Err(GraphError::Execution(
            "at least one worker is needed".into(),
        ));
    }
    if settings.placement.worker_count() != workers {
        return Err(GraphError::Execution(format!(
            "the placement spans {} workers but the execution has {workers}",
            settings.placement.worker_count()
        )));
    }
    pipeline.validate(&settings.placement)?;
    quiet_network_panics();

    let (builders, others) = connect(&settings.execution, settings.peer_timeout)?;
    let shared = Arc::new(RunShared::new(settings.execution.processes()));
    let started = Instant::now();
    let local_workers = settings.execution.local_workers();
    let (report_tx, report_rx) = std::sync::mpsc::channel::<Result<WorkerOutcome, GraphError>>();
    let guards = {
        let (pipeline, settings, shared) = (pipeline.clone(), settings.clone(), shared.clone());
        timely::execute::execute_from(builders, others, WorkerConfig::default(), move |worker| {
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                drive_worker(worker, &pipeline, &settings, &shared)
            }));
            let outcome = match outcome {
                Ok(result) => result,
                Err(payload) => Err(runtime_panic(&panic_message(payload.as_ref()))),
            };
            if let Err(err) = &outcome {
                shared.record(err.clone());
                // Tear down what is left so timely does not wait on it.
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    for id in worker.installed_dataflows() {
                        worker.drop_dataflow(id);
                    }
                }));
            }
            let _ = report_tx.send(outcome);
        })
        .map_err(GraphError::Runtime)?
    };

    // Outcomes arrive over a channel rather than from `join`, because joining
    // also joins timely's network threads, which block for as long as a hung
    // peer keeps its connection open.
    let mut outcomes = Vec::new();
    let mut aborted_at: Option<Instant> = None;
    while outcomes.len() < local_workers {
        match report_rx.recv_timeout(PARK * 5) {
            Ok(outcome) => outcomes.push(outcome),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if shared.aborted.load(Ordering::SeqCst) {
                    let since = *aborted_at.get_or_insert_with(Instant::now);
                    if since.elapsed() > FAILURE_GRACE * 10 {
                        break;
                    }
                }
            }
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    if let Some(err) = shared.error() {
        // Join in the background: with a live peer this ends at once; with a
        // hung one it never does, and the run must not wait for it.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let _ = std::thread::Builder::new()
            .name("weir:join".into())
            .spawn(move || {
                let _ = catch_unwind(AssertUnwindSafe(|| guards.join()));
                let _ = done_tx.send(());
            });
        let _ = done_rx.recv_timeout(FAILURE_GRACE * 3);
        return Err(err);
    }
    // A connection that broke after the last step makes join panic: a lost peer.
    catch_unwind(AssertUnwindSafe(|| guards.join()))
        .map_err(|payload| runtime_panic(&panic_message(payload.as_ref())))?;
    if outcomes.len() < local_workers {
        return Err(GraphError::Runtime(format!(
            "{} of {local_workers} workers ended without a result",
            local_workers - outcomes.len()
        )));
    }
    let mut steps = 0;
    let mut peak = 0;
    let mut metrics = Vec::new();
    for outcome in outcomes {
        let outcome = outcome?;
        steps = steps.max(outcome.steps);
        peak = peak.max(outcome.peak_in_flight);
        metrics.extend(outcome.metrics);
    }
    let report = RunReport::from_metrics(metrics, steps, wall_s, peak);
    if let Some(path) = &settings.metrics_path {
        if !report.metrics.is_empty() {
            report.write_parquet(path)?;
        }
    }
    Ok(report)
}

/// A panic that reached the driver: a broken connection to a peer, or a bug.
fn runtime_panic(message: &str) -> GraphError {
    if is_network_panic(message) {
        GraphError::PeerLost {
            peer: "a peer process".into(),
            reason: format!("connection broken ({message})"),
        }
    } else {
        GraphError::Runtime(format!("worker panicked: {message}"))
    }
}

type Allocators = (
    Vec<timely::communication::allocator::AllocatorBuilder>,
    Box<dyn std::any::Any + Send>,
);

/// Builds timely's allocators, giving up when peers do not connect within `timeout`.
fn connect(execution: &Execution, timeout: Duration) -> Result<Allocators, GraphError> {
    let config = execution.communication();
    if !matches!(config, CommunicationConfig::Cluster { .. }) {
        return config.try_build().map_err(GraphError::Runtime);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("weir:connect".into())
        .spawn(move || {
            let _ = tx.send(config.try_build());
        })
        .map_err(|e| GraphError::Runtime(format!("starting the connection thread: {e}")))?;
    match rx.recv_timeout(timeout) {
        Ok(result) => result.map_err(GraphError::Runtime),
        Err(_) => Err(GraphError::PeerLost {
            peer: "some peer process".into(),
            reason: format!("did not connect within {:.0} s (is every process started, with the same hostfile?)", timeout.as_secs_f64()),
        }),
    }
}

/// True for the panics timely raises when a connection to a peer breaks.
fn is_network_panic(message: &str) -> bool {
    [
        "timely communication error",
        "MergeQueue poisoned",
        "Send thread panic",
        "Recv thread panic",
    ]
    .iter()
    .any(|m| message.contains(m))
}

/// Filters timely's network-thread panic messages from stderr: the run turns
/// them into a [`GraphError::PeerLost`] and reports that instead.
fn quiet_network_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = panic_message(info.payload());
            if is_network_panic(&message) {
                return;
            }
            previous(info);
        }));
    });
}

/// Builds the dataflow on this worker and drives it to completion.
fn drive_worker(
    worker: &mut Worker,
    pipeline: &Pipeline,
    settings: &RunSettings,
    shared: &Arc<RunShared>,
) -> Result<WorkerOutcome, GraphError> {
    let index = worker.index();
    let process = settings.execution.process();
    let env = OperatorEnv {
        shared: shared.clone(),
        outbox: Rc::new(RefCell::new(Vec::new())),
        index,
        peers: worker.peers(),
        process,
    };
    let metrics_worker = 0;
    let collected: Rc<RefCell<Vec<MetricRow>>> = Rc::new(RefCell::new(Vec::new()));

    let mut input =
        InputHandle::<Step, timely::container::CapacityContainerBuilder<Vec<Batch>>>::new();
    let mut control =
        InputHandle::<Step, timely::container::CapacityContainerBuilder<Vec<Control>>>::new();
    let probe = ProbeHandle::<Step>::new();
    let dataflow = worker.next_dataflow_index();
    worker.dataflow::<Step, _, _>(|scope| {
        build_dataflow(
            scope,
            pipeline,
            settings,
            &env,
            &mut input,
            &probe,
            metrics_worker,
            &collected,
        )?;
        let shared = shared.clone();
        scope
            .input_from(&mut control)
            .broadcast()
            .sink(LocalPact, "Control", move |(input, _)| {
                input.for_each(|_, data| {
                    for message in data.drain(..) {
                        match message {
                            Control::Heartbeat { process } => shared.heard_from(process),
                            Control::Failed { process, error } => {
                                shared.heard_from(process);
                                shared.record(error);
                            }
                        }
                    }
                });
            });
        Ok::<(), GraphError>(())
    })?;

    let source_spec = pipeline
        .source
        .as_ref()
        .expect("validated: the pipeline has a source");
    let source_workers = settings.placement.workers(&source_spec.role)?;
    let mut source = None;
    if let Some(rank) = source_workers.iter().position(|&w| w == index) {
        let info = WorkerInfo {
            index,
            peers: worker.peers(),
            process,
            rank,
            role_size: source_workers.len(),
        };
        match call_user(|| (source_spec.factory)(&info)) {
            Ok(s) => source = Some((s, info)),
            Err(message) => env.fail(GraphError::Stage {
                stage: "source".into(),
                step: None,
                worker: index,
                message,
            }),
        }
    }
    let mut input = Some(input);
    input
        .as_mut()
        .expect("just set")
        .advance_to(settings.first_step);
    if source.is_none() {
        input = None;
    }

    let mut admission = Admission::new(settings.first_step, settings.steps, settings.max_staleness);
    let heartbeat_every =
        (settings.peer_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut last_heartbeat: Option<Instant> = None;
    let mut failure: Option<(GraphError, Instant)> = None;

    loop {
        // Failures raised here go to every worker of every process.
        for error in env.outbox.borrow_mut().drain(..) {
            control.send(Control::Failed { process, error });
        }
        if env.aborted() {
            let error = shared
                .error()
                .unwrap_or_else(|| GraphError::Runtime("aborted".into()));
            let since = failure.get_or_insert_with(|| (error, Instant::now())).1;
            control.flush();
            if since.elapsed() >= FAILURE_GRACE {
                break;
            }
            worker.step_or_park(Some(PARK));
            continue;
        }
        if settings.execution.processes() > 1 {
            if let Some((peer, silent)) = shared.silent_peer(process, settings.peer_timeout) {
                env.fail(GraphError::PeerLost {
                    peer: format!("process {peer}"),
                    reason: format!(
                        "no heartbeat for {:.1} s (peer timeout {:.1} s)",
                        silent.as_secs_f64(),
                        settings.peer_timeout.as_secs_f64()
                    ),
                });
                continue;
            }
            if last_heartbeat.is_none_or(|t| t.elapsed() >= heartbeat_every) {
                control.send(Control::Heartbeat { process });
                control.flush();
                last_heartbeat = Some(Instant::now());
            }
        }

        let first_incomplete = probe.with_frontier(|f| f.first().copied());
        if let (Some(handle), Some((src, info))) = (input.as_mut(), source.as_mut()) {
            if admission.exhausted() {
                input = None;
            } else if admission.may_admit(first_incomplete) {
                let step = admission.next_step();
                let ctx = SourceContext {
                    step,
                    worker: *info,
                };
                match call_user(|| src.next_step(&ctx)) {
                    Ok(Some(batches)) => {
                        admission.admit(first_incomplete);
                        for data in batches {
                            handle.send(Batch {
                                dest: index as u32,
                                data,
                            });
                        }
                        handle.advance_to(step + 1);
                    }
                    Ok(None) => input = None,
                    Err(message) => env.fail(GraphError::Stage {
                        stage: "source".into(),
                        step: Some(step),
                        worker: index,
                        message,
                    }),
                }
                continue;
            }
        }
        if input.is_none() && first_incomplete.is_none() {
            break;
        }
        worker.step_or_park(Some(PARK));
    }

    if let Some((error, _)) = failure {
        drop(input);
        drop(control);
        worker.drop_dataflow(dataflow);
        return Err(error);
    }

    // The chain is done here; close the control input and let the peers finish.
    drop(control);
    let deadline = Instant::now() + settings.peer_timeout;
    while worker.installed_dataflows().contains(&dataflow) {
        if env.aborted() || Instant::now() > deadline {
            let error = shared.error().unwrap_or_else(|| GraphError::PeerLost {
                peer: "some peer process".into(),
                reason: format!(
                    "did not finish within {:.0} s of this process finishing",
                    settings.peer_timeout.as_secs_f64()
                ),
            });
            worker.drop_dataflow(dataflow);
            return Err(error);
        }
        worker.step_or_park(Some(PARK));
    }
    let steps = admission.next_step() - settings.first_step;
    let metrics = std::mem::take(&mut *collected.borrow_mut());
    Ok(WorkerOutcome {
        steps,
        peak_in_flight: admission.peak_in_flight(),
        metrics,
    })
}

/// Builds the chain: route → stage for every stage, sinks where declared,
/// the weights edge from the learner to the generator, the probe, and the
/// metrics collector.
#[allow(clippy::too_many_arguments)]
fn build_dataflow<'scope>(
    scope: Scope<'scope, Step>,
    pipeline: &Pipeline,
    settings: &RunSettings,
    env: &OperatorEnv,
    input: &mut InputHandle<Step, timely::container::CapacityContainerBuilder<Vec<Batch>>>,
    probe: &ProbeHandle<Step>,
    metrics_worker: usize,
    collected: &Rc<RefCell<Vec<MetricRow>>>,
) -> Result<(), GraphError> {
    let index = scope.index();
    let placement = &settings.placement;
    let generators = match pipeline.nodes.iter().find_map(|n| match n {
        Node::Stage(s) if s.kind == StageKind::Generate => Some(&s.role),
        _ => None,
    }) {
        Some(role) => placement.workers(role)?,
        None => Vec::new(),
    };
    let (weights_handle, weights_stream) = weights_edge(scope, settings.max_staleness);
    let mut weights_handle = Some(weights_handle);
    let mut weights_stream = Some(weights_stream);
    let mut metric_streams = Vec::new();
    let mut stream = scope.input_from(input);

    for node in &pipeline.nodes {
        match node {
            Node::Stage(spec) => {
                let workers = placement.workers(&spec.role)?;
                let routed = route(
                    stream,
                    &spec.name,
                    Router::new(spec.partition.clone(), workers.clone(), index),
                    env.clone(),
                );
                let weights = (spec.kind == StageKind::Generate)
                    .then(|| weights_stream.take())
                    .flatten();
                let cfg = StageOpConfig {
                    name: spec.name.clone(),
                    kind: spec.kind,
                    factory: spec.factory.clone(),
                    workers,
                    offload: spec.offload,
                    first_step: settings.first_step,
                    version: settings.initial_version,
                    max_staleness: settings.max_staleness,
                    transport: settings.transport.clone(),
                    generators: generators.clone(),
                };
                let out = stage_operator(routed, weights, cfg, env.clone());
                metric_streams.push(out.metrics);
                if let Some(w) = out.weights {
                    if let Some(handle) = weights_handle.take() {
                        w.connect_loop(handle);
                    }
                }
                stream = out.data;
            }
            Node::Sink(spec) => {
                let workers = placement.workers(&spec.role)?;
                let routed = route(
                    stream.clone(),
                    &spec.name,
                    Router::new(spec.partition.clone(), workers.clone(), index),
                    env.clone(),
                );
                let sink = match workers.iter().position(|&w| w == index) {
                    Some(rank) => {
                        let info = WorkerInfo {
                            index,
                            peers: env.peers,
                            process: env.process,
                            rank,
                            role_size: workers.len(),
                        };
                        match call_user(|| (spec.factory)(&info)) {
                            Ok(sink) => Some(sink),
                            Err(message) => {
                                env.fail(GraphError::Stage {
                                    stage: spec.name.clone(),
                                    step: None,
                                    worker: index,
                                    message,
                                });
                                None
                            }
                        }
                    }
                    None => None,
                };
                sink_operator(routed, &spec.name, sink, env.clone());
            }
        }
    }
    if let Some(handle) = weights_handle.take() {
        // No learner: the weights edge carries nothing, but timely needs it closed.
        timely::dataflow::operators::generic::operator::empty::<Step, Vec<crate::WeightsMessage>>(
            scope,
        )
        .connect_loop(handle);
    }
    stream.probe_with(probe);

    // Every metric row goes to the metrics worker, which keeps them for the report.
    let collected = collected.clone();
    scope.concatenate(metric_streams).sink(
        Exchange::new(move |_: &MetricRow| metrics_worker as u64),
        "Metrics",
        move |(input, _)| {
            input.for_each(|_, rows| collected.borrow_mut().append(rows));
        },
    );
    Ok(())
}
