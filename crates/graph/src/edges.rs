//! The operators at the ends of data edges: routing into an exchange, and sinks.
//!
//! Every consumer of a stream (stage or sink) reads it through [`route`],
//! which splits and addresses batches for the consumer's [`Partition`] over
//! its role's workers; the consumer's exchange pact then moves each batch to
//! its `dest`. Keeping routing on the consuming side lets one stream feed a
//! stage and any number of sinks, each with its own partitioning.

use std::collections::BTreeSet;

use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::{Exchange, Pipeline};
use timely::dataflow::operators::Operator;
use timely::dataflow::Stream;

use crate::commit::{CommitHold, NextCommit};
use crate::control::OperatorEnv;
use crate::error::call_user;
use crate::stage::Sink;
use crate::StageError;
use crate::{Batch, GraphError, Router, Step};

/// Re-addresses every batch of `stream` with `router`, for consumer `consumer`.
pub(crate) fn route<'scope>(
    stream: Stream<'scope, Step, Vec<Batch>>,
    consumer: &str,
    mut router: Router,
    env: OperatorEnv,
) -> Stream<'scope, Step, Vec<Batch>> {
    let consumer = consumer.to_string();
    stream.unary::<CapacityContainerBuilder<Vec<Batch>>, _, _, _>(
        Pipeline,
        &format!("Route({consumer})"),
        move |_, _| {
            move |input, output| {
                input.for_each(|cap, data| {
                    let mut session = output.session(&cap);
                    for batch in data.drain(..) {
                        if env.aborted() {
                            continue;
                        }
                        match router.route(batch.data, &consumer) {
                            Ok(pieces) => session.give_iterator(pieces.into_iter()),
                            Err(err) => env.fail(err),
                        }
                    }
                });
            }
        },
    )
}

/// Feeds `stream` (already routed) into `sink` on the workers that hold one.
///
/// `sink.end_step(s)` follows the last batch of every step `s` that brought
/// data to this worker; `sink.commit(c)` follows every commit point `c` the
/// input passes (see [`crate::commit`]); `finish` follows the end of the
/// stream. The returned stream carries no data: its frontier trails the
/// sink's commits, for the run's probe.
pub(crate) fn sink_operator<'scope>(
    stream: Stream<'scope, Step, Vec<Batch>>,
    name: &str,
    mut sink: Option<Box<dyn Sink>>,
    env: OperatorEnv,
    commits: Option<NextCommit>,
    first_step: Step,
) -> Stream<'scope, Step, Vec<()>> {
    let name = name.to_string();
    let mut open_steps: BTreeSet<Step> = BTreeSet::new();
    stream.unary_frontier::<CapacityContainerBuilder<Vec<()>>, _, _, _>(
        Exchange::new(|b: &Batch| u64::from(b.dest)),
        &format!("Sink({name})"),
        move |cap, _| {
            let mut hold = match &sink {
                Some(_) => CommitHold::new(cap, commits, first_step),
                None => CommitHold::none(),
            };
            move |(input, frontier), _output| {
                // A failed or aborted sink keeps its hold: no later commit may count.
                let Some(target) = sink.as_mut().filter(|_| !env.aborted()) else {
                    input.for_each(|_, data| data.clear());
                    return;
                };
                let fail = |step: Option<Step>, cause: StageError| {
                    GraphError::stage(name.clone(), step, env.index, cause)
                };
                let mut failed = None;
                input.for_each(|cap, data| {
                    let Some(&step) = cap.least() else { return };
                    open_steps.insert(step);
                    for batch in data.drain(..) {
                        if failed.is_none() {
                            if let Err(cause) = call_user(|| target.write(step, &batch.data)) {
                                failed = Some(fail(Some(step), cause));
                            }
                        }
                    }
                });
                while let Some(&step) = open_steps.first() {
                    if frontier.less_equal(&step) || failed.is_some() {
                        break;
                    }
                    open_steps.remove(&step);
                    if let Err(cause) = call_user(|| target.end_step(step)) {
                        failed = Some(fail(Some(step), cause));
                    }
                }
                if failed.is_none() {
                    if let Err(err) = hold.advance(frontier, |step| {
                        call_user(|| target.commit(step)).map_err(|m| fail(Some(step), m))
                    }) {
                        failed = Some(err);
                    }
                }
                if failed.is_none() && frontier.is_empty() && open_steps.is_empty() {
                    if let Err(cause) = call_user(|| target.finish()) {
                        failed = Some(fail(None, cause));
                    }
                    sink = None;
                }
                if let Some(err) = failed {
                    sink = None;
                    env.fail(err);
                }
            }
        },
    )
}
