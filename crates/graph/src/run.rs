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

use timely::dataflow::channels::pact::{Exchange, Pipeline as LocalPact};
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::{Concatenate, ConnectLoop, Input, Operator, Probe};
use timely::dataflow::{InputHandle, ProbeHandle, Scope};
use timely::worker::Worker;
use timely::WorkerConfig;

use crate::collective::{collective_path, Collectives};
use crate::commit::{CommitHold, CommitTracker};
use crate::control::{quiet_network_panics, runtime_panic, Control, OperatorEnv, RunShared};
use crate::edges::{route, sink_operator};
use crate::engine_thread::StageKind;
use crate::error::{call_user, panic_message};
use crate::execution::connect;
pub use crate::execution::{Execution, RunSettings};
use crate::metrics::MetricRow;
use crate::pipeline::Node;
use crate::stage::{SourceContext, WorkerInfo};
use crate::stage_op::{stage_operator, StageOpConfig};
use crate::weights_edge::weights_edge;
use crate::{Admission, Batch, GraphError, Pipeline, Router, RunReport, Step};

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

    let (builders, others) = connect(&settings.execution, settings.connect_timeout)?;
    let shared = Arc::new(RunShared::new(settings.execution.processes()));
    // The direct weights channel, between processes of a cluster only.
    if let (Some(host), crate::WeightsChannel::Direct { port }) =
        (settings.execution.host(), settings.weights_channel)
    {
        shared.wire.configure(crate::weights_edge::WireConfig {
            host: host.to_string(),
            port,
            process: settings.execution.process(),
            fingerprint: settings.fingerprint,
            secret: settings.cluster_secret.clone(),
            timeout: settings.peer_timeout,
            // Versions in flight at once: up to k + 1, and the one being sent.
            offered: settings.max_staleness as usize + 3,
        });
    }
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
        threads: settings.execution.local_workers(),
    };
    let metrics_worker = 0;
    let prior = if index == metrics_worker {
        settings.prior_metrics.clone()
    } else {
        Vec::new()
    };
    let collected: Rc<RefCell<Vec<MetricRow>>> = Rc::new(RefCell::new(prior));

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
        collective_path(scope, collectives);
        let shared = shared.clone();
        let own_fingerprint = settings.fingerprint;
        let secret = settings.cluster_secret.clone();
        scope
            .input_from(&mut control)
            .broadcast()
            .sink(LocalPact, "Control", move |(input, _)| {
                input.for_each(|_, data| {
                    for message in data.drain(..) {
                        match message {
                            Control::Heartbeat {
                                process: peer,
                                fingerprint,
                                nonce,
                                proof,
                            } => {
                                shared.heard_from(peer);
                                let proven = match (&secret, &proof) {
                                    (Some(s), Some(p)) => s.verifies(peer, fingerprint, nonce, p),
                                    (None, None) => true,
                                    _ => false,
                                };
                                if !proven {
                                    let what = match (&secret, &proof) {
                                        (Some(_), None) => format!(
                                            "process {peer} has no cluster secret, this process ({process}) has one"
                                        ),
                                        (None, Some(_)) => format!(
                                            "process {peer} has a cluster secret, this process ({process}) has none"
                                        ),
                                        _ => format!(
                                            "process {peer} has another cluster secret than this process ({process})"
                                        ),
                                    };
                                    shared.record(GraphError::Execution(format!(
                                        "{what}: start every process with the same \
                                         WEIR_CLUSTER_SECRET or --cluster-secret-file"
                                    )));
                                } else if fingerprint != own_fingerprint {
                                    shared.record(GraphError::Execution(format!(
                                        "process {peer} runs different settings than process {process} \
                                         (fingerprint {fingerprint:016x}, here {own_fingerprint:016x}): \
                                         start every process with the same config, flags and weir build"
                                    )));
                                } else {
                                    shared.admit(peer);
                                }
                            }
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
    // Sent as this worker's failure before any heartbeat, so no peer admits
    // this process, and every one stops with this error.
    if let Some(error) = opening {
        env.fail(error);
    }

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
            run: env.run,
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
    let mut commits = match (&settings.commit_points, &settings.on_commit) {
        (Some(points), Some(on_commit)) => Some(CommitTracker::new(
            points.clone(),
            on_commit.clone(),
            settings.first_step,
        )),
        _ => None,
    };
    let heartbeat_every =
        (settings.peer_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut last_heartbeat: Option<Instant> = None;
    let mut failure: Option<(GraphError, Instant)> = None;
    // The source has no more steps (its input closes once they are complete).
    let mut source_done = false;

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
                let nonce = crate::cluster_secret::nonce(process);
                control.send(Control::Heartbeat {
                    process,
                    fingerprint: settings.fingerprint,
                    nonce,
                    proof: settings
                        .cluster_secret
                        .as_ref()
                        .map(|s| s.proof(process, settings.fingerprint, nonce)),
                });
                control.flush();
                last_heartbeat = Some(Instant::now());
            }
        }

        let first_incomplete = probe.with_frontier(|f| f.first().copied());
        if let Some(tracker) = commits.as_mut() {
            if let Err(message) = tracker.reached(first_incomplete) {
                env.fail(GraphError::Stage {
                    stage: "commit".into(),
                    step: None,
                    worker: index,
                    message,
                });
                continue;
            }
        }
        if let (Some(handle), Some((src, info))) = (input.as_mut(), source.as_mut()) {
            if source_done || admission.exhausted() {
                // The input stays at the step after the last until every step
                // is complete, so each operator's frontier passes each step
                // before the input closes: a worker that saw no data of the
                // last steps still ends them (data-parallel ranks end every
                // step together).
                if first_incomplete.is_none_or(|f| f >= admission.next_step()) {
                    input = None;
                }
            } else if settings.execution.processes() > 1 && !shared.all_admitted(process) {
                // No step starts before every peer has shown it belongs
                // (same settings, the cluster secret).
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
                    Ok(None) => source_done = true,
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

    // The chain is done here (every rank's last round too): close the
    // control input and the collectives' side-path, and let the peers finish.
    drop(control);
    collectives.close(index);
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
    let learns = pipeline
        .nodes
        .iter()
        .any(|n| matches!(n, Node::Stage(s) if s.kind == StageKind::Learn));
    let (weights_handle, weights_stream) = weights_edge(scope, settings.max_staleness);
    let mut weights_handle = Some(weights_handle);
    let mut weights_stream = Some(weights_stream);
    let mut metric_streams = Vec::new();
    let mut commit_streams = Vec::new();
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
                    weights_bucket_bytes: settings.weights_bucket_bytes,
                    generators: generators.clone(),
                    learns,
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
                            run: env.run,
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
                commit_streams.push(sink_operator(
                    routed,
                    &spec.name,
                    sink,
                    env.clone(),
                    settings.commit_points.clone(),
                    settings.first_step,
                ));
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

    // Every metric row goes to the metrics worker, which keeps them for the
    // report and writes the file at every commit point (and now and then
    // between them, for live readers).
    let collected = collected.clone();
    let observer = settings.observer.clone();
    let flush_to = settings.metrics_path.clone();
    let flush_every = settings.metrics_flush;
    let writes = index == metrics_worker && flush_to.is_some();
    let step_observer = settings
        .step_observer
        .clone()
        .filter(|_| index == metrics_worker);
    let mut by_step: std::collections::BTreeMap<Step, Vec<MetricRow>> = Default::default();
    let (commits, first_step) = (settings.commit_points.clone(), settings.first_step);
    let env = env.clone();
    let metrics_done = scope
        .concatenate(metric_streams)
        .unary_frontier::<timely::container::CapacityContainerBuilder<Vec<()>>, _, _, _>(
            Exchange::new(move |_: &MetricRow| metrics_worker as u64),
            "Metrics",
            move |cap, _| {
                let mut hold = if writes {
                    CommitHold::new(cap, commits, first_step)
                } else {
                    CommitHold::none()
                };
                let mut flushed = Instant::now();
                let mut flush_error_logged = false;
                move |(input, frontier), _output| {
                    let mut arrived = false;
                    input.for_each(|_, rows| {
                        if let Some(observe) = &observer {
                            observe(rows);
                        }
                        arrived = true;
                        if step_observer.is_some() {
                            for row in rows.iter() {
                                by_step.entry(row.step).or_default().push(row.clone());
                            }
                        }
                        collected.borrow_mut().append(rows);
                    });
                    if let Some(observe) = &step_observer {
                        while let Some(entry) = by_step.first_entry() {
                            if frontier.less_equal(entry.key()) {
                                break;
                            }
                            let (step, rows) = entry.remove_entry();
                            observe(step, &rows);
                        }
                    }
                    let Some(path) = flush_to.as_ref().filter(|_| writes && !env.aborted()) else {
                        return;
                    };
                    let write = || {
                        crate::metrics::rows_to_batch(&collected.borrow())
                            .and_then(|b| crate::parquet_log::write_parquet_atomically(path, &[b]))
                    };
                    // One write covers every commit point passed at once. A
                    // failed write keeps the hold: no later checkpoint counts.
                    let mut written = false;
                    let commit = |_| match std::mem::replace(&mut written, true) {
                        true => Ok(()),
                        false => write(),
                    };
                    if let Err(err) = hold.advance(frontier, commit) {
                        env.fail(err);
                        return;
                    }
                    if arrived && flushed.elapsed() >= flush_every {
                        flushed = Instant::now();
                        if let (Err(e), false) = (write(), flush_error_logged) {
                            tracing::warn!(path = %path.display(), error = %e, "writing metrics");
                            flush_error_logged = true;
                        }
                    }
                }
            },
        );
    commit_streams.push(metrics_done);
    for done in commit_streams {
        done.probe_with(probe);
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
            _ => None,
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
