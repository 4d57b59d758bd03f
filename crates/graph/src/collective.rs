//! Collectives over timely: the all-reduce of data-parallel ranks placed on
//! any workers of any processes.
//!
//! A stage that trains as one rank of several joins a group of workers
//! ([`join`]) and calls [`GroupHandle::all_reduce`] with its float32 values
//! (gradients) and f64 scalars (token counts, statistics). The values travel
//! on timely's own channels, so a multi-process CPU run needs nothing but
//! its cluster: a *reduce-scatter* (rank `c` receives every rank's `c`-th
//! chunk of the values, in pieces of at most [`PIECE`] values, and sums it),
//! then an *all-gather* (each rank sends its summed chunk to every other).
//! Every chunk is summed in rank order, starting from rank 0's, which is the
//! order [`weir_gpu`'s in-process group] sums in: the same ranks give the same
//! bits whether they share a process or not. Scalars go to every rank, and
//! each sums them in rank order. The two halves are also collectives of
//! their own, with chunks of any lengths: [`GroupHandle::reduce_scatter`]
//! and [`GroupHandle::all_gather`], which a trainer that shards its
//! optimizer state over the ranks (ZeRO) runs around its update.
//!
//! How it runs: each worker's dataflow holds a small side-path, `Collective`
//! out (a source that drains the worker's outbox when an engine thread
//! activates it) → exchange by destination worker → `Collective` in (which
//! files each piece in the destination's inbox and wakes its waiters).
//! Pieces for a worker of the same process skip timely and go straight to
//! its inbox. A rank waiting for a piece checks every 50 ms whether the run
//! has failed (a stage error anywhere, a lost peer: both abort the run on
//! every process), so a rank that dies ends its peers' wait with an error
//! within the peer timeout, never a hang.
//!
//! [`weir_gpu`'s in-process group]: https://docs.rs/weir-gpu
//!
//! # Examples
//! Two ranks of a one-process run sum their values; a stage would call
//! [`join`] from its factory with the [`WorkerInfo`] it was given.
//! ```
//! use std::sync::{Arc, Mutex};
//! use weir_graph::collective::join;
//! use weir_graph::{Execution, Partition, Pipeline, Placement, RunSettings, Stage, StageError, StepContext};
//! use weir_graph::synthetic::SyntheticPrompts;
//! use arrow::array::RecordBatch;
//!
//! struct Sum(weir_graph::collective::GroupHandle, Arc<Mutex<Vec<f32>>>);
//! impl Stage for Sum {
//!     fn process(&mut self, _: &mut StepContext, _: RecordBatch) -> Result<Vec<RecordBatch>, StageError> {
//!         Ok(Vec::new())
//!     }
//!     fn end_step(&mut self, _: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
//!         let mine = vec![self.0.rank() as f32 + 1.0; 3];
//!         let (sums, _) = self.0.all_reduce(mine, vec![])?;
//!         self.1.lock().unwrap().extend(sums);
//!         Ok(Vec::new())
//!     }
//! }
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let out = seen.clone();
//! let pipeline = Pipeline::new("sum")
//!     .source("train", |_| Ok(SyntheticPrompts::new(2)))
//!     .stage("sum", "train", Partition::RoundRobin, move |w| {
//!         Ok(Sum(join(w, "sum", &[0, 1])?, out.clone()))
//!     })
//!     .offload(2);
//! let placement = Placement::new(2).assign("train", [0, 1]);
//! weir_graph::run::run(&pipeline, &RunSettings::new(Execution::Threads(2), placement).steps(1)).unwrap();
//! assert_eq!(*seen.lock().unwrap(), vec![3.0; 6]);
//! ```

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use timely::dataflow::channels::pact::Exchange;
use timely::dataflow::operators::generic::operator::source;
use timely::dataflow::operators::Operator;
use timely::dataflow::Scope;
use timely::scheduling::SyncActivator;

use crate::control::RunShared;
use crate::stage::WorkerInfo;
use crate::{StageError, Step};

/// The most values one message carries (16 MiB of float32), so that no
/// single serialised message of a large model's gradients is huge.
pub const PIECE: usize = 4 << 20;

/// How often a waiting rank checks whether the run has failed.
const POLL: Duration = Duration::from_millis(50);

/// Which part of a round a piece belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
enum Phase {
    /// A sender's share of the receiver's chunk, to be summed.
    Scatter,
    /// The sender's summed chunk.
    Gather,
    /// The sender's scalars.
    Scalars,
}

/// Float32 values as raw little-endian bytes on the wire (serde would
/// otherwise write them one by one).
#[derive(Clone, Debug, Default, PartialEq)]
struct Values(Vec<f32>);

impl Serialize for Values {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut bytes = Vec::with_capacity(self.0.len() * 4);
        for v in &self.0 {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        serializer.serialize_bytes(&bytes)
    }
}

impl<'de> Deserialize<'de> for Values {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = serde_bytes::ByteBuf::deserialize(deserializer)?;
        if bytes.len() % 4 != 0 {
            return Err(serde::de::Error::custom(format!(
                "{} bytes are not a whole number of float32 values",
                bytes.len()
            )));
        }
        Ok(Values(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
}

/// One message of a round, addressed to one worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Piece {
    /// The global index of the receiving worker.
    to: u32,
    key: Key,
    /// The sender's value and scalar counts (ranks must agree).
    lengths: (u64, u32),
    values: Values,
    scalars: Vec<f64>,
}

/// What a receiver waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Key {
    group: u64,
    round: u64,
    phase: Phase,
    from_rank: u32,
    index: u32,
}

/// One worker's received pieces.
#[derive(Default)]
struct Inbox {
    pieces: Mutex<HashMap<Key, Piece>>,
    arrived: Condvar,
}

/// The collectives of one run in one process: each local worker's inbox
/// and outbox, and the activator of its `Collective` out operator.
pub(crate) struct Collectives {
    run: u64,
    shared: Arc<RunShared>,
    local: Range<usize>,
    inboxes: Vec<Inbox>,
    outboxes: Vec<Mutex<Vec<Piece>>>,
    activators: Mutex<Vec<Option<SyncActivator>>>,
    /// Local workers whose `Collective` out operator should let go of its capability.
    closed: Mutex<Vec<bool>>,
}

/// The collectives of the runs in this process, by run id.
static RUNS: Mutex<Vec<(u64, Weak<Collectives>)>> = Mutex::new(Vec::new());
static NEXT_RUN: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Collectives {
    /// Registers a run whose local workers are `local` (global indices).
    pub(crate) fn register(shared: Arc<RunShared>, local: Range<usize>) -> Arc<Self> {
        let run = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
        let n = local.len();
        let this = Arc::new(Collectives {
            run,
            shared,
            local,
            inboxes: (0..n).map(|_| Inbox::default()).collect(),
            outboxes: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            activators: Mutex::new((0..n).map(|_| None).collect()),
            closed: Mutex::new(vec![false; n]),
        });
        let mut runs = lock(&RUNS);
        runs.retain(|(_, w)| w.strong_count() > 0);
        runs.push((run, Arc::downgrade(&this)));
        this
    }

    /// The id stages find this run's collectives under ([`WorkerInfo::run`]).
    pub(crate) fn run(&self) -> u64 {
        self.run
    }

    fn find(run: u64) -> Option<Arc<Self>> {
        lock(&RUNS)
            .iter()
            .find(|(id, _)| *id == run)
            .and_then(|(_, w)| w.upgrade())
    }

    fn slot(&self, worker: usize) -> Option<usize> {
        self.local
            .contains(&worker)
            .then(|| worker - self.local.start)
    }

    /// Sends `piece` from local worker `from`: straight into the inbox of a
    /// local receiver, else through `from`'s `Collective` out operator.
    fn send(&self, from: usize, piece: Piece) {
        if let Some(to) = self.slot(piece.to as usize) {
            self.deposit(to, piece);
            return;
        }
        let slot = self.slot(from).expect("a rank sends from its own worker");
        lock(&self.outboxes[slot]).push(piece);
        if let Some(a) = &lock(&self.activators)[slot] {
            // An error means the operator is gone: the run is ending, and
            // the waiting rank learns it from the run's abort.
            let _ = a.activate();
        }
    }

    fn deposit(&self, slot: usize, piece: Piece) {
        let inbox = &self.inboxes[slot];
        lock(&inbox.pieces).insert(piece.key, piece);
        inbox.arrived.notify_all();
    }

    /// Waits in local worker `slot`'s inbox for `key`; fails when the run fails.
    fn take(&self, slot: usize, key: Key) -> Result<Piece, String> {
        let inbox = &self.inboxes[slot];
        let mut pieces = lock(&inbox.pieces);
        loop {
            if let Some(piece) = pieces.remove(&key) {
                return Ok(piece);
            }
            if self.shared.aborted.load(Ordering::SeqCst) {
                return Err(match self.shared.error() {
                    Some(err) => format!("the run stopped: {err}"),
                    None => "the run stopped".into(),
                });
            }
            pieces = inbox
                .arrived
                .wait_timeout(pieces, POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Lets local worker `worker`'s `Collective` out operator end (the run is over here).
    pub(crate) fn close(&self, worker: usize) {
        if let Some(slot) = self.slot(worker) {
            lock(&self.closed)[slot] = true;
            if let Some(a) = &lock(&self.activators)[slot] {
                let _ = a.activate();
            }
        }
    }
}

/// Builds worker `scope.index()`'s side-path of `collectives`: its outbox
/// into timely, exchanged by destination, into the destination's inbox.
pub(crate) fn collective_path(scope: Scope<'_, Step>, collectives: &Arc<Collectives>) {
    let me = scope.index();
    let slot = collectives
        .slot(me)
        .expect("a worker builds its own process's collectives");
    let out = collectives.clone();
    let pieces = source::<_, timely::container::CapacityContainerBuilder<Vec<Piece>>, _, _>(
        scope,
        "Collective out",
        move |cap, info| {
            let activator = scope.worker().sync_activator_for(info.address.to_vec());
            lock(&out.activators)[slot] = Some(activator);
            let mut cap = Some(cap);
            move |output| {
                let drained = std::mem::take(&mut *lock(&out.outboxes[slot]));
                if let Some(cap) = &cap {
                    if !drained.is_empty() {
                        let mut session = output.session(cap);
                        for piece in drained {
                            session.give(piece);
                        }
                    }
                }
                if lock(&out.closed)[slot] {
                    cap = None;
                }
            }
        },
    );
    let into = collectives.clone();
    pieces.sink(
        Exchange::new(|p: &Piece| u64::from(p.to)),
        "Collective in",
        move |(input, _)| {
            input.for_each(|_, data| {
                for piece in data.drain(..) {
                    if let Some(slot) = into.slot(piece.to as usize) {
                        into.deposit(slot, piece);
                    }
                }
            });
        },
    );
}

/// Rank `rank` of a group of data-parallel workers.
pub struct GroupHandle {
    collectives: Arc<Collectives>,
    group: u64,
    /// The group's workers (global indices) in rank order.
    workers: Vec<usize>,
    rank: usize,
    round: AtomicU64,
}

impl std::fmt::Debug for GroupHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupHandle")
            .field("group", &self.group)
            .field("workers", &self.workers)
            .field("rank", &self.rank)
            .finish()
    }
}

/// Joins the group of `workers` (global worker indices, in rank order) named
/// `name` from worker `w`, which must be one of them. Every member must join
/// under the same name and list; different names keep groups apart (a
/// learner's and a critic's on the same workers). The stage that holds the
/// handle must be offloaded (`Pipeline::offload`; learners always are): a
/// rank waits for its peers, and must not stop its worker meanwhile.
pub fn join(w: &WorkerInfo, name: &str, workers: &[usize]) -> Result<GroupHandle, StageError> {
    let rank = workers
        .iter()
        .position(|&x| x == w.index)
        .ok_or_else(|| format!("worker {} is not one of the group {workers:?}", w.index))?;
    let collectives = Collectives::find(w.run).ok_or_else(|| {
        format!(
            "worker {} belongs to no running engine run: a data-parallel group needs one",
            w.index
        )
    })?;
    Ok(GroupHandle {
        collectives,
        group: group_id(name, workers),
        workers: workers.to_vec(),
        rank,
        round: AtomicU64::new(0),
    })
}

/// The workers of `w`'s process (global indices), as its run placed them.
pub fn local_workers(w: &WorkerInfo) -> Option<Range<usize>> {
    Collectives::find(w.run).map(|c| c.local.clone())
}

/// A stable id for a group: FNV-1a over its name and workers.
fn group_id(name: &str, workers: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = name
        .bytes()
        .chain(workers.iter().flat_map(|w| (*w as u64).to_le_bytes()));
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The offsets that cut `n` values into `ranks` chunks of (nearly) equal
/// length: rank `c` owns `bounds[c]..bounds[c + 1]` of an all-reduce.
fn even_bounds(n: usize, ranks: usize) -> Vec<usize> {
    (0..=ranks).map(|c| n * c / ranks).collect()
}

/// `range` cut into pieces of at most [`PIECE`] values.
fn pieces(range: Range<usize>) -> impl Iterator<Item = (u32, Range<usize>)> {
    let start = range.start;
    (0..range.len().div_ceil(PIECE)).map(move |i| {
        let from = start + i * PIECE;
        (i as u32, from..(from + PIECE).min(range.end))
    })
}

impl GroupHandle {
    /// This member's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.workers.len()
    }

    /// Waits for every rank and returns the element-wise sums of their
    /// `values` and `scalars`, the same bits on every rank (each summed in
    /// rank order). Fails when the ranks' lengths differ or the run stops.
    pub fn all_reduce(
        &self,
        values: Vec<f32>,
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        self.round_of("all-reduce", |round| self.reduce(round, values, scalars))
    }

    /// Waits for every rank and returns this rank's chunk,
    /// `bounds[rank]..bounds[rank + 1]`, of the element-wise sums of their
    /// `values`, and the sums of their `scalars` (ZeRO's reduce-scatter: a
    /// rank keeps the sums of the values it owns). `bounds` are the ranks'
    /// offsets into `values`, `size() + 1` of them from 0 to its length, the
    /// same on every rank. The bits are [`GroupHandle::all_reduce`]'s.
    pub fn reduce_scatter(
        &self,
        values: Vec<f32>,
        bounds: &[usize],
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        self.round_of("reduce-scatter", |round| {
            check_bounds(bounds, self.size(), values.len())?;
            self.scatter(round, &values, bounds, scalars)
        })
    }

    /// Waits for every rank and returns every rank's `chunk` end to end:
    /// rank `r`'s is `bounds[r]..bounds[r + 1]` of the result (ZeRO's
    /// all-gather of the parameters each rank updated). A rank may own
    /// nothing (an empty chunk), so one rank's values reach all: a broadcast.
    pub fn all_gather(&self, chunk: Vec<f32>, bounds: &[usize]) -> Result<Vec<f32>, String> {
        self.round_of("all-gather", |round| {
            let n = *bounds.last().unwrap_or(&0);
            check_bounds(bounds, self.size(), n)?;
            let mine = bounds[self.rank]..bounds[self.rank + 1];
            if chunk.len() != mine.len() {
                return Err(format!(
                    "rank {} owns {} values, handed in {}",
                    self.rank,
                    mine.len(),
                    chunk.len()
                ));
            }
            let mut values = vec![0.0; n];
            values[mine].copy_from_slice(&chunk);
            self.gather(round, &mut values, bounds)?;
            Ok(values)
        })
    }

    /// Runs `body` as the next round, from an engine thread.
    fn round_of<T>(
        &self,
        what: &str,
        body: impl FnOnce(u64) -> Result<T, String>,
    ) -> Result<T, String> {
        if std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("timely:work"))
        {
            // Waiting here would stop this worker's own side of the exchange.
            return Err(format!(
                "data-parallel group (rank {}): an {what} must run on an engine thread \
                 (offload the stage), not on a timely worker",
                self.rank
            ));
        }
        let round = self.round.fetch_add(1, Ordering::Relaxed);
        body(round).map_err(|why| format!("data-parallel group (rank {}): {why}", self.rank))
    }

    fn reduce(
        &self,
        round: u64,
        mut values: Vec<f32>,
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        let ranks = self.size();
        if ranks == 1 {
            return Ok((values, scalars));
        }
        let n = values.len();
        let bounds = even_bounds(n, ranks);
        let (sum, totals) = self.scatter(round, &values, &bounds, scalars)?;
        values[bounds[self.rank]..bounds[self.rank + 1]].copy_from_slice(&sum);
        self.gather(round, &mut values, &bounds)?;
        Ok((values, totals))
    }

    /// Sends, receives and files the pieces of one phase of a round.
    fn link(&self, round: u64, lengths: (u64, u32)) -> Result<Link<'_>, String> {
        let worker = self.workers[self.rank];
        let slot = self
            .collectives
            .slot(worker)
            .ok_or("a rank runs in its worker's process")?;
        Ok(Link {
            group: self,
            round,
            lengths,
            worker,
            slot,
        })
    }

    /// The reduce-scatter half of a round: every rank's chunk
    /// `bounds[c]..bounds[c + 1]` of `values` goes to rank `c`, which sums
    /// it in rank order from rank 0's; the scalars go to every rank.
    fn scatter(
        &self,
        round: u64,
        values: &[f32],
        bounds: &[usize],
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String> {
        let (ranks, me) = (self.size(), self.rank);
        let chunk = |c: usize| bounds[c]..bounds[c + 1];
        if ranks == 1 {
            return Ok((values.to_vec(), scalars));
        }
        let link = self.link(round, (values.len() as u64, scalars.len() as u32))?;
        for c in (0..ranks).filter(|&c| c != me) {
            for (i, range) in pieces(chunk(c)) {
                link.send(c, Phase::Scatter, i, values[range].to_vec(), Vec::new());
            }
            link.send(c, Phase::Scalars, 0, Vec::new(), scalars.clone());
        }
        // This rank's chunk, summed in rank order from rank 0's.
        let mine = chunk(me);
        let mut sum: Vec<f32> = Vec::with_capacity(mine.len());
        for r in 0..ranks {
            for (i, range) in pieces(mine.clone()) {
                let received;
                let part: &[f32] = if r == me {
                    &values[range.clone()]
                } else {
                    received = link.receive(Phase::Scatter, r, i)?;
                    &received.values.0
                };
                if r == 0 {
                    sum.extend_from_slice(part);
                } else {
                    let at = range.start - mine.start;
                    for (s, v) in sum[at..at + part.len()].iter_mut().zip(part) {
                        *s += *v;
                    }
                }
            }
        }
        let mut totals = Vec::new();
        for r in 0..ranks {
            let received;
            let part: &[f64] = if r == me {
                &scalars
            } else {
                received = link.receive(Phase::Scalars, r, 0)?;
                &received.scalars
            };
            if r == 0 {
                totals = part.to_vec();
            } else {
                totals.iter_mut().zip(part).for_each(|(t, v)| *t += v);
            }
        }
        Ok((sum, totals))
    }

    /// The all-gather half of a round: this rank's chunk of `values` goes
    /// to every other rank, and theirs fill the rest of `values`.
    fn gather(&self, round: u64, values: &mut [f32], bounds: &[usize]) -> Result<(), String> {
        let (ranks, me) = (self.size(), self.rank);
        if ranks == 1 {
            return Ok(());
        }
        let chunk = |c: usize| bounds[c]..bounds[c + 1];
        let link = self.link(round, (values.len() as u64, 0))?;
        for c in (0..ranks).filter(|&c| c != me) {
            for (i, range) in pieces(chunk(me)) {
                link.send(c, Phase::Gather, i, values[range].to_vec(), Vec::new());
            }
        }
        for c in (0..ranks).filter(|&c| c != me) {
            for (i, range) in pieces(chunk(c)) {
                let piece = link.receive(Phase::Gather, c, i)?;
                if piece.values.0.len() != range.len() {
                    return Err(format!(
                        "rank {c} sent {} values for {}",
                        piece.values.0.len(),
                        range.len()
                    ));
                }
                values[range].copy_from_slice(&piece.values.0);
            }
        }
        Ok(())
    }
}

/// Checks that `bounds` cut `n` values into `ranks` chunks.
fn check_bounds(bounds: &[usize], ranks: usize, n: usize) -> Result<(), String> {
    let ordered = bounds.windows(2).all(|w| w[0] <= w[1]);
    if bounds.len() != ranks + 1 || bounds[0] != 0 || bounds[ranks] != n || !ordered {
        return Err(format!(
            "chunk bounds {bounds:?} do not cut {n} values among {ranks} ranks"
        ));
    }
    Ok(())
}

/// One rank's side of one round: where its pieces go and come from.
struct Link<'a> {
    group: &'a GroupHandle,
    round: u64,
    /// The sender's value and scalar counts (ranks must agree).
    lengths: (u64, u32),
    worker: usize,
    slot: usize,
}

impl Link<'_> {
    fn key(&self, phase: Phase, from_rank: usize, index: u32) -> Key {
        Key {
            group: self.group.group,
            round: self.round,
            phase,
            from_rank: from_rank as u32,
            index,
        }
    }

    fn send(&self, to: usize, phase: Phase, index: u32, values: Vec<f32>, scalars: Vec<f64>) {
        let piece = Piece {
            to: self.group.workers[to] as u32,
            key: self.key(phase, self.group.rank, index),
            lengths: self.lengths,
            values: Values(values),
            scalars,
        };
        self.group.collectives.send(self.worker, piece)
    }

    fn receive(&self, phase: Phase, from: usize, index: u32) -> Result<Piece, String> {
        let key = self.key(phase, from, index);
        let piece = self.group.collectives.take(self.slot, key)?;
        if piece.lengths != self.lengths {
            return Err(format!(
                "rank {from} handed in {} values and {} scalars, rank {} {} and {}",
                piece.lengths.0, piece.lengths.1, self.group.rank, self.lengths.0, self.lengths.1
            ));
        }
        Ok(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_and_pieces_cover_every_value_once() {
        for (n, ranks) in [(0, 2), (1, 3), (10, 3), (2 * PIECE + 5, 2)] {
            let mut seen = vec![0u8; n];
            let bounds = even_bounds(n, ranks);
            for c in 0..ranks {
                for (_, r) in pieces(bounds[c]..bounds[c + 1]) {
                    assert!(r.len() <= PIECE);
                    r.for_each(|i| seen[i] += 1);
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "n {n} ranks {ranks}");
        }
    }

    #[test]
    fn values_cross_processes_as_raw_bytes() {
        let v = Values(vec![1.5, -2.0, f32::MIN_POSITIVE]);
        let bytes = bincode::serialize(&v).unwrap();
        assert_eq!(bytes.len(), 8 + 12);
        let back: Values = bincode::deserialize(&bytes).unwrap();
        assert_eq!(back, v);
    }

    /// Ranks on threads of one process: sums in rank order, every round, any size.
    #[test]
    fn ranks_sum_in_rank_order_over_many_rounds() {
        let shared = Arc::new(RunShared::new(1));
        let c = Collectives::register(shared, 0..3);
        let w = |index| WorkerInfo {
            index,
            peers: 3,
            process: 0,
            rank: index,
            role_size: 3,
            run: c.run(),
            steps: crate::RunSteps::default(),
        };
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let g = join(&w(i), "g", &[0, 1, 2]).unwrap();
                std::thread::spawn(move || {
                    (0..20)
                        .map(|round| {
                            let n = 7 + round;
                            let v = (0..n).map(|j| (i * 100 + j) as f32 + 0.1).collect();
                            g.all_reduce(v, vec![i as f64, 1.0]).unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for round in 0..20 {
            let n = 7 + round;
            let expect: Vec<f32> = (0..n)
                .map(|j| {
                    let x = |i: usize| (i * 100 + j) as f32 + 0.1;
                    x(0) + x(1) + x(2)
                })
                .collect();
            for r in &results {
                assert_eq!(r[round].0, expect);
                assert_eq!(r[round].1, vec![3.0, 3.0]);
            }
        }
    }

    /// A reduce-scatter and an all-gather with uneven chunks (one empty)
    /// give the all-reduce's bits, chunk by chunk.
    #[test]
    fn reduce_scatter_then_all_gather_is_the_all_reduce() {
        let shared = Arc::new(RunShared::new(1));
        let c = Collectives::register(shared, 0..3);
        let w = |index| WorkerInfo {
            index,
            peers: 3,
            process: 0,
            rank: index,
            role_size: 3,
            run: c.run(),
            steps: crate::RunSteps::default(),
        };
        let bounds = [0, 5, 5, 11];
        let value = |i: usize, j: usize| (i as f32 + 1.0) * 0.37 + j as f32 * 1e-3;
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let g = join(&w(i), "g", &[0, 1, 2]).unwrap();
                std::thread::spawn(move || {
                    let v: Vec<f32> = (0..11).map(|j| value(i, j)).collect();
                    let (all, _) = g.all_reduce(v.clone(), vec![]).unwrap();
                    let (chunk, totals) = g.reduce_scatter(v, &bounds, vec![i as f64]).unwrap();
                    let gathered = g.all_gather(chunk.clone(), &bounds).unwrap();
                    let wrong = g.all_gather(vec![0.0; 3], &bounds).unwrap_err();
                    (all, chunk, totals, gathered, wrong)
                })
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let (all, chunk, totals, gathered, wrong) = h.join().unwrap();
            assert_eq!(chunk, all[bounds[i]..bounds[i + 1]]);
            assert_eq!(totals, vec![3.0]);
            assert_eq!(gathered, all);
            assert!(wrong.contains("handed in 3"), "{wrong}");
        }
    }

    #[test]
    fn mismatched_lengths_and_a_stopped_run_are_errors() {
        let shared = Arc::new(RunShared::new(1));
        let c = Collectives::register(shared.clone(), 0..2);
        let w = |index| WorkerInfo {
            index,
            peers: 2,
            process: 0,
            rank: index,
            role_size: 2,
            run: c.run(),
            steps: crate::RunSteps::default(),
        };
        let (a, b) = (
            join(&w(0), "g", &[0, 1]).unwrap(),
            join(&w(1), "g", &[0, 1]).unwrap(),
        );
        let other = std::thread::spawn(move || {
            let err = b.all_reduce(vec![1.0, 2.0], vec![]).unwrap_err();
            // The next round waits for a rank that never comes: the run's failure ends it.
            (err, b.all_reduce(vec![1.0], vec![]).unwrap_err())
        });
        let err = a.all_reduce(vec![1.0], vec![]).unwrap_err();
        assert!(err.contains("rank 1 handed in 2 values"), "{err}");
        std::thread::sleep(Duration::from_millis(100));
        shared.record(crate::GraphError::Runtime("peer gone".into()));
        let (first, second) = other.join().unwrap();
        assert!(first.contains("rank 0 handed in 1 values"), "{first}");
        assert!(
            second.contains("the run stopped") && second.contains("peer gone"),
            "{second}"
        );
        assert!(join(&w(2), "g", &[0, 1])
            .unwrap_err()
            .to_string()
            .contains("not one of"));
        let detached = WorkerInfo::single();
        assert!(join(&detached, "g", &[0]).is_err());
    }
}
