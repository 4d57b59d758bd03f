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
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::Pipeline as LocalPact;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::{Input, Operator};
use timely::dataflow::{InputHandle, ProbeHandle};
use timely::worker::Worker;
use timely::WorkerConfig;

use crate::collective::{collective_path, Collectives};
use crate::commit::CommitTracker;
use crate::control::{quiet_network_panics, runtime_panic, Control, OperatorEnv, RunShared};
use crate::dataflow::{build_dataflow, BatchInput, METRICS_WORKER};
use crate::engine_thread::StageKind;
use crate::error::{call_user, panic_message};
use crate::execution::connect;
pub use crate::execution::{Execution, RunSettings};
use crate::metrics::MetricRow;
use crate::pipeline::Node;
use crate::stage::{Source, SourceContext, WorkerInfo};
use crate::{Admission, Batch, GraphError, Pipeline, RunReport, Step};

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

impl Pipeline {
    /// Runs the pipeline with `settings` to completion; see [`run`].
    pub fn run(&self, settings: &RunSettings) -> Result<RunReport, GraphError> {
        run(self, settings)
    }
}

/// Sets up the direct weights channel, between processes of a cluster only.
fn configure_wire(shared: &RunShared, settings: &RunSettings) {
    if let (Some(host), crate::WeightsChannel::Direct { port }) =
        (settings.execution.host(), settings.weights_channel)
    {
        shared.wire.configure(crate::weights_edge::WireConfig {
            host: host.to_string(),
            port,
            process: settings.execution.process(),
            fingerprint: settings.fingerprint,
            secret: settings.cluster_secret.clone(),
            encrypt: settings.encrypt,
            timeout: settings.peer_timeout,
            // Versions in flight at once: up to k + 1, and the one being sent.
            offered: settings.max_staleness as usize + 3,
            max_payload: settings.max_weights_bytes,
        });
    }
}

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

    let ((builders, others), run_value) = connect(
        &settings.execution,
        settings.connect_timeout,
        settings.cluster_secret.as_ref(),
        settings.fingerprint,
        settings.encrypt,
    )?;
    // What the heartbeats and weight fetches prove from here on: the
    // settings and this run, so nothing recorded from an earlier run verifies.
    let settings = &RunSettings {
        fingerprint: crate::mesh::session_fingerprint(settings.fingerprint, run_value),
        ..settings.clone()
    };
    let shared = Arc::new(RunShared::new(settings.execution.processes()));
    configure_wire(&shared, settings);
    crate::weights_edge::allow_payloads_of(settings.max_weights_bytes);
    // The process whose learner sends weights to another listens before its
    // first step; a port it cannot have then fails every process before any
    // work (each worker reports it, see `drive_worker`).
    let opening = if shared.wire.enabled() && offers_weights(pipeline, settings)? {
        shared.wire.listen().err()
    } else {
        None
    };
    let local = settings.execution.process() * settings.execution.local_workers();
    let collectives = Collectives::register(
        shared.clone(),
        local..local + settings.execution.local_workers(),
    );
    let started = Instant::now();
    let local_workers = settings.execution.local_workers();
    let (report_tx, report_rx) = std::sync::mpsc::channel::<Result<WorkerOutcome, GraphError>>();
    let guards = {
        let (pipeline, settings, shared) = (pipeline.clone(), settings.clone(), shared.clone());
        let collectives = collectives.clone();
        timely::execute::execute_from(builders, others, WorkerConfig::default(), move |worker| {
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                drive_worker(
                    worker,
                    &pipeline,
                    &settings,
                    &shared,
                    &collectives,
                    opening.clone(),
                )
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

/// Builds the dataflow on this worker and drives it to completion.
fn drive_worker(
    worker: &mut Worker,
    pipeline: &Pipeline,
    settings: &RunSettings,
    shared: &Arc<RunShared>,
    collectives: &Arc<Collectives>,
    opening: Option<GraphError>,
) -> Result<WorkerOutcome, GraphError> {
    let index = worker.index();
    let process = settings.execution.process();
    let env = OperatorEnv {
        shared: shared.clone(),
        outbox: Rc::new(RefCell::new(Vec::new())),
        index,
        peers: worker.peers(),
        process,
        run: collectives.run(),
        steps: settings.run_steps(),
        threads: settings.execution.local_workers(),
    };
    let prior = if index == METRICS_WORKER {
        settings.prior_metrics.clone()
    } else {
        Vec::new()
    };
    let collected: Rc<RefCell<Vec<MetricRow>>> = Rc::new(RefCell::new(prior));
    let mut input = BatchInput::new();
    let mut control = ControlInput::new();
    let probe = ProbeHandle::<Step>::new();
    let dataflow = worker.next_dataflow_index();
    worker.dataflow::<Step, _, _>(|scope| {
        build_dataflow(
            scope, pipeline, settings, &env, &mut input, &probe, &collected,
        )?;
        collective_path(scope, collectives);
        let (shared, fingerprint) = (shared.clone(), settings.fingerprint);
        let secret = settings.cluster_secret.clone();
        scope
            .input_from(&mut control)
            .broadcast()
            .sink(LocalPact, "Control", move |(input, _)| {
                input.for_each(|_, data| {
                    for message in data.drain(..) {
                        shared.receive(message, process, fingerprint, secret.as_ref());
                    }
                });
            });
        Ok::<(), GraphError>(())
    })?;
    // Sent as this worker's failure before any heartbeat, so no peer admits
    // this process, and every one stops with this error.
    if let Some(error) = opening {
        env.fail(error);
    }
    input.advance_to(settings.first_step);
    let source = open_source(pipeline, settings, &env)?;
    let mut driver = Driver {
        settings,
        env: &env,
        control,
        fed: source.map(|source| (input, source)),
        admission: Admission::new(settings.first_step, settings.steps, settings.max_staleness),
        commits: match (settings.commit_points(), &settings.on_commit) {
            (Some(points), Some(on_commit)) => Some(CommitTracker::new(
                points,
                on_commit.clone(),
                settings.first_step,
            )),
            _ => None,
        },
        last_heartbeat: None,
        failure: None,
        source_done: false,
    };
    driver.drive(worker, &probe);
    let Driver {
        control,
        fed,
        admission,
        failure,
        ..
    } = driver;
    if let Some((error, _)) = failure {
        drop(fed);
        drop(control);
        worker.drop_dataflow(dataflow);
        return Err(error);
    }
    // The chain is done here (every rank's last round too): close the
    // control input and the collectives' side-path, and let the peers finish.
    drop(control);
    collectives.close(index);
    await_peers(worker, dataflow, &env, settings)?;
    let steps = admission.next_step() - settings.first_step;
    let metrics = std::mem::take(&mut *collected.borrow_mut());
    Ok(WorkerOutcome {
        steps,
        peak_in_flight: admission.peak_in_flight(),
        metrics,
    })
}

/// A source on its worker, with the worker's place in the source's role.
type OpenSource = (Box<dyn Source>, WorkerInfo);

/// The input of the control side-dataflow.
type ControlInput = InputHandle<Step, CapacityContainerBuilder<Vec<Control>>>;

/// The pipeline's source on this worker, with the worker's place in the
/// source's role, if the role holds this worker; a factory's error fails
/// the run and leaves no source.
fn open_source(
    pipeline: &Pipeline,
    settings: &RunSettings,
    env: &OperatorEnv,
) -> Result<Option<OpenSource>, GraphError> {
    let spec = pipeline
        .source
        .as_ref()
        .expect("validated: the pipeline has a source");
    let workers = settings.placement.workers(&spec.role)?;
    let Some(info) = env.worker_info(&workers) else {
        return Ok(None);
    };
    match call_user(|| (spec.factory)(&info)) {
        Ok(source) => Ok(Some((source, info))),
        Err(cause) => {
            env.fail(GraphError::stage("source", None, env.index, cause));
            Ok(None)
        }
    }
}

/// One worker's driver loop: feeding the source under backpressure, the
/// commit points, heartbeats to and from the peer processes, and spreading
/// a failure before stopping.
struct Driver<'a> {
    settings: &'a RunSettings,
    env: &'a OperatorEnv,
    control: ControlInput,
    /// The chain's input and the source that feeds it, on a worker of the
    /// source's role until every step is complete.
    fed: Option<(BatchInput, OpenSource)>,
    admission: Admission,
    commits: Option<CommitTracker>,
    last_heartbeat: Option<Instant>,
    /// The failure being spread, and since when.
    failure: Option<(GraphError, Instant)>,
    /// The source has no more steps (its input closes once they are complete).
    source_done: bool,
}

impl Driver<'_> {
    /// Steps `worker` until every step is complete, or until a failure has
    /// had its grace period to reach the peers.
    fn drive(&mut self, worker: &mut Worker, probe: &ProbeHandle<Step>) {
        loop {
            self.relay_failures();
            if self.env.aborted() {
                if self.failure_spread() {
                    break;
                }
                worker.step_or_park(Some(PARK));
                continue;
            }
            if !self.keep_in_touch() {
                continue;
            }
            let first_incomplete = probe.with_frontier(|f| f.first().copied());
            if !self.commit(first_incomplete) || self.feed(first_incomplete) {
                continue;
            }
            if self.fed.is_none() && first_incomplete.is_none() {
                break;
            }
            worker.step_or_park(Some(PARK));
        }
    }

    /// Sends the failures raised here to every worker of every process.
    fn relay_failures(&mut self) {
        let process = self.env.process;
        for error in self.env.outbox.borrow_mut().drain(..) {
            self.control.send(Control::Failed { process, error });
        }
    }

    /// After an abort: holds the run's error while it spreads; true once
    /// `FAILURE_GRACE` has passed.
    fn failure_spread(&mut self) -> bool {
        let error = self
            .env
            .shared
            .error()
            .unwrap_or_else(|| GraphError::Runtime("aborted".into()));
        let since = self
            .failure
            .get_or_insert_with(|| (error, Instant::now()))
            .1;
        self.control.flush();
        since.elapsed() >= FAILURE_GRACE
    }

    /// With several processes: fails the run when a peer fell silent
    /// (false), and sends this process's heartbeat when one is due.
    fn keep_in_touch(&mut self) -> bool {
        let (settings, process) = (self.settings, self.env.process);
        if settings.execution.processes() <= 1 {
            return true;
        }
        if let Some((peer, silent)) = self.env.shared.silent_peer(process, settings.peer_timeout) {
            self.env.fail(GraphError::PeerLost {
                peer: format!("process {peer}"),
                reason: format!(
                    "no heartbeat for {:.1} s (peer timeout {:.1} s)",
                    silent.as_secs_f64(),
                    settings.peer_timeout.as_secs_f64()
                ),
            });
            return false;
        }
        let every =
            (settings.peer_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        if self.last_heartbeat.is_none_or(|t| t.elapsed() >= every) {
            let nonce = crate::cluster_secret::nonce(process);
            self.control.send(Control::Heartbeat {
                process,
                fingerprint: settings.fingerprint,
                nonce,
                proof: settings
                    .cluster_secret
                    .as_ref()
                    .map(|s| s.proof(process, settings.fingerprint, nonce)),
            });
            self.control.flush();
            self.last_heartbeat = Some(Instant::now());
        }
        true
    }

    /// Tells the commit tracker how far the steps are complete; false when
    /// its callback failed the run.
    fn commit(&mut self, first_incomplete: Option<Step>) -> bool {
        let Some(tracker) = self.commits.as_mut() else {
            return true;
        };
        match tracker.reached(first_incomplete) {
            Ok(()) => true,
            Err(message) => {
                self.env.fail(GraphError::stage(
                    "commit",
                    None,
                    self.env.index,
                    message.into(),
                ));
                false
            }
        }
    }

    /// Asks the source for the next step when backpressure admits one (true:
    /// it asked), or closes the input once the source's steps are complete.
    fn feed(&mut self, first_incomplete: Option<Step>) -> bool {
        if self.fed.is_none() {
            return false;
        }
        if self.source_done || self.admission.exhausted() {
            // The input stays at the step after the last until every step
            // is complete, so each operator's frontier passes each step
            // before the input closes: a worker that saw no data of the
            // last steps still ends them (data-parallel ranks end every
            // step together).
            if first_incomplete.is_none_or(|f| f >= self.admission.next_step()) {
                self.fed = None;
            }
            return false;
        }
        let (settings, process) = (self.settings, self.env.process);
        if settings.execution.processes() > 1 && !self.env.shared.all_admitted(process) {
            // No step starts before every peer has shown it belongs (same
            // settings, the cluster secret).
            return false;
        }
        if !self.admission.may_admit(first_incomplete) {
            return false;
        }
        let Some((input, (source, info))) = self.fed.as_mut() else {
            return false;
        };
        let step = self.admission.next_step();
        let ctx = SourceContext {
            step,
            worker: *info,
        };
        match call_user(|| source.next_step(&ctx)) {
            Ok(Some(batches)) => {
                self.admission.admit(first_incomplete);
                for data in batches {
                    input.send(Batch {
                        dest: self.env.index as u32,
                        data,
                    });
                }
                input.advance_to(step + 1);
            }
            Ok(None) => self.source_done = true,
            Err(cause) => self.env.fail(GraphError::stage(
                "source",
                Some(step),
                self.env.index,
                cause,
            )),
        }
        true
    }
}

/// Steps `worker` until its `dataflow` ends, every peer done too; a failure
/// or a peer that does not finish within the peer timeout is the error.
fn await_peers(
    worker: &mut Worker,
    dataflow: usize,
    env: &OperatorEnv,
    settings: &RunSettings,
) -> Result<(), GraphError> {
    let deadline = Instant::now() + settings.peer_timeout;
    while worker.installed_dataflows().contains(&dataflow) {
        if env.aborted() || Instant::now() > deadline {
            let error = env.shared.error().unwrap_or_else(|| GraphError::PeerLost {
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
    Ok(())
}

/// Whether this process holds the learner's first worker (the one that
/// publishes, by the learners' convention: rank 0) and a generator in
/// another process receives its weights over the direct channel. Another
/// learner worker that publishes starts its server at its first offer.
fn offers_weights(pipeline: &Pipeline, settings: &RunSettings) -> Result<bool, GraphError> {
    let role = |kind: StageKind| {
        pipeline.nodes.iter().find_map(|n| match n {
            Node::Stage(s) if s.kind == kind => Some(&s.role),
            Node::Stage(_) | Node::Sink(_) => None,
        })
    };
    let (Some(learner), Some(generator)) = (role(StageKind::Learn), role(StageKind::Generate))
    else {
        return Ok(false);
    };
    let threads = settings.execution.local_workers().max(1);
    let process = settings.execution.process();
    let learns_here = settings
        .placement
        .workers(learner)?
        .first()
        .is_some_and(|&w| w / threads == process);
    let generators = settings.placement.workers(generator)?;
    Ok(learns_here && crate::weights_edge::receiving_processes(&generators, threads, process) > 0)
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use arrow::array::RecordBatch;

    use super::*;
    use crate::synthetic::SyntheticPrompts;
    use crate::{Partition, Placement, StepContext};

    /// A stage whose every batch fails with an I/O error.
    struct Failing;

    impl crate::Stage for Failing {
        fn process(
            &mut self,
            ctx: &mut StepContext,
            _: RecordBatch,
        ) -> Result<Vec<RecordBatch>, crate::StageError> {
            Err(Box::new(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{}: reward.json is missing", ctx.stage()),
            )))
        }
    }

    #[test]
    fn a_stage_error_stays_the_run_error_source() {
        let pipeline = Pipeline::new("failing")
            .source("rollout", |_| Ok(SyntheticPrompts::new(2)))
            .stage("score", "rollout", Partition::RoundRobin, |_| Ok(Failing));
        let settings = RunSettings::new(
            Execution::Threads(1),
            Placement::new(1).assign("rollout", [0]),
        )
        .steps(2);
        let err = pipeline.run(&settings).unwrap_err();
        let GraphError::Stage {
            stage,
            step,
            message,
            ..
        } = &err
        else {
            panic!("not a stage error: {err}");
        };
        assert_eq!((stage.as_str(), *step), ("score", Some(0)));
        // The stage knows the name the pipeline gave it.
        assert_eq!(message, "score: reward.json is missing");
        let cause = err.source().expect("the stage's error is the source");
        let io = cause
            .downcast_ref::<std::io::Error>()
            .expect("the source is the stage's own error, by type");
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    }
}
