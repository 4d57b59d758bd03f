//! The dataflow every worker builds: route → stage for every stage of the
//! pipeline, its sinks, the weights edge from the learner back to the
//! generator, and the metrics collector; a probe on everything whose
//! completion ends a step.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::Exchange;
use timely::dataflow::operators::{Concatenate, ConnectLoop, Input, Operator, Probe};
use timely::dataflow::{InputHandle, ProbeHandle, Scope, Stream};

use crate::commit::CommitHold;
use crate::control::OperatorEnv;
use crate::edges::{route, sink_operator};
use crate::engine_thread::StageKind;
use crate::error::call_user;
use crate::execution::RunSettings;
use crate::metrics::MetricRow;
use crate::pipeline::{Node, SinkSpec};
use crate::stage::Sink;
use crate::stage_op::{stage_operator, StageOpConfig};
use crate::weights_edge::weights_edge;
use crate::{Batch, GraphError, Pipeline, Router, Step};

/// The worker that collects every metric row (and writes the metrics file).
pub(crate) const METRICS_WORKER: usize = 0;

/// The input of the chain: the source's batches.
pub(crate) type BatchInput = InputHandle<Step, CapacityContainerBuilder<Vec<Batch>>>;

/// Builds this worker's chain from `input`, with its probe on the chain's
/// end, every sink and the metrics collector (which keeps its rows in
/// `collected`, on [`METRICS_WORKER`]).
pub(crate) fn build_dataflow<'scope>(
    scope: Scope<'scope, Step>,
    pipeline: &Pipeline,
    settings: &RunSettings,
    env: &OperatorEnv,
    input: &mut BatchInput,
    probe: &ProbeHandle<Step>,
    collected: &Rc<RefCell<Vec<MetricRow>>>,
) -> Result<(), GraphError> {
    let chain = stage_chain(scope, pipeline, settings, env, input)?;
    chain.data.probe_with(probe);
    let metrics_done = metrics_collector(scope, chain.metrics, settings, env, collected);
    for done in chain.commits.into_iter().chain([metrics_done]) {
        done.probe_with(probe);
    }
    Ok(())
}

/// What the chain of stages and sinks puts out.
struct Chain<'scope> {
    /// The last stage's batches.
    data: Stream<'scope, Step, Vec<Batch>>,
    /// Every stage's metric rows.
    metrics: Vec<Stream<'scope, Step, Vec<MetricRow>>>,
    /// Every sink's completion (a step is committed once they pass it).
    commits: Vec<Stream<'scope, Step, Vec<()>>>,
}

/// The pipeline's nodes in declaration order, each stage after a router to
/// its role's workers; the generator reads the weights edge the learner
/// feeds (closed empty without a learner).
fn stage_chain<'scope>(
    scope: Scope<'scope, Step>,
    pipeline: &Pipeline,
    settings: &RunSettings,
    env: &OperatorEnv,
    input: &mut BatchInput,
) -> Result<Chain<'scope>, GraphError> {
    let index = scope.index();
    let placement = &settings.placement;
    let generators = match pipeline.nodes.iter().find_map(|n| match n {
        Node::Stage(s) if s.kind == StageKind::Generate => Some(&s.role),
        Node::Stage(_) | Node::Sink(_) => None,
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
    let mut chain = Chain {
        data: scope.input_from(input),
        metrics: Vec::new(),
        commits: Vec::new(),
    };
    for node in &pipeline.nodes {
        match node {
            Node::Stage(spec) => {
                let workers = placement.workers(&spec.role)?;
                let routed = route(
                    chain.data,
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
                chain.metrics.push(out.metrics);
                if let Some(w) = out.weights {
                    if let Some(handle) = weights_handle.take() {
                        w.connect_loop(handle);
                    }
                }
                chain.data = out.data;
            }
            Node::Sink(spec) => {
                let workers = placement.workers(&spec.role)?;
                let routed = route(
                    chain.data.clone(),
                    &spec.name,
                    Router::new(spec.partition.clone(), workers.clone(), index),
                    env.clone(),
                );
                let sink = open_sink(spec, &workers, env);
                chain.commits.push(sink_operator(
                    routed,
                    &spec.name,
                    sink,
                    env.clone(),
                    settings.commit_points(),
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
    Ok(chain)
}

/// The sink of `spec` on this worker, if `workers` (its role's) hold it; a
/// factory's error fails the run and leaves no sink.
fn open_sink(spec: &SinkSpec, workers: &[usize], env: &OperatorEnv) -> Option<Box<dyn Sink>> {
    let info = env.worker_info(workers)?;
    match call_user(|| (spec.factory)(&info)) {
        Ok(sink) => Some(sink),
        Err(cause) => {
            env.fail(GraphError::stage(spec.name.clone(), None, env.index, cause));
            None
        }
    }
}

/// The metrics collector: every stage's metric rows go to
/// [`METRICS_WORKER`], which keeps them in `collected` for the report,
/// hands them to the run's observers, and writes the metrics file at every
/// commit point (and now and then between them, for live readers). Its
/// output completes a step once the step's rows are written.
fn metrics_collector<'scope>(
    scope: Scope<'scope, Step>,
    metric_streams: Vec<Stream<'scope, Step, Vec<MetricRow>>>,
    settings: &RunSettings,
    env: &OperatorEnv,
    collected: &Rc<RefCell<Vec<MetricRow>>>,
) -> Stream<'scope, Step, Vec<()>> {
    let (index, metrics_worker) = (scope.index(), METRICS_WORKER);
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
    let (commits, first_step) = (settings.commit_points(), settings.first_step);
    let env = env.clone();
    scope
        .concatenate(metric_streams)
        .unary_frontier::<CapacityContainerBuilder<Vec<()>>, _, _, _>(
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
        )
}
