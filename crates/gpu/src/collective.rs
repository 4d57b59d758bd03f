//! Data-parallel training: the ranks of a group sum their gradients (and a
//! few statistics). A [`GroupMember`] is one rank of either
//! - a [`HostGroup`], whose ranks share this process: values travel as
//!   float32 tensors and are summed on rank 0's device (on CUDA devices
//!   device to device, by peer copies, never through host memory; on the
//!   CPU nothing is copied but the sums); or
//! - a group whose ranks live in several processes, reached through a
//!   [`HostReduce`] the caller provides (weir's pipelines give one over the
//!   engine's own channels, `weir_graph::collective`): values go through
//!   host memory as float32.
//!
//! Both sum in rank order from rank 0's values, so the same ranks give the
//! same bits whichever way they are connected.
//!
//! A round is an all-reduce: every rank hands in its values and waits; the
//! last to arrive adds them up, in rank order, so every rank receives the
//! same bits and the ranks' optimizers stay identical. A rank that leaves
//! (its [`GroupMember`] is dropped, as when its stage fails or the run
//! stops) closes the group, and whoever waits gets an error instead of
//! hanging.
//!
//! # Examples
//! ```
//! use tch::Tensor;
//! use weir_gpu::collective::HostGroup;
//!
//! let group = HostGroup::new(2);
//! let (a, b) = (group.member(0), group.member(1));
//! let other = std::thread::spawn(move || {
//!     let (values, _) = b.all_reduce(Tensor::from_slice(&[1.0f32, 2.0]), vec![10.0]).unwrap();
//!     Vec::<f32>::try_from(values).unwrap()
//! });
//! let (values, scalars) = a.all_reduce(Tensor::from_slice(&[0.5f32, 0.5]), vec![1.0]).unwrap();
//! assert_eq!(Vec::<f32>::try_from(values).unwrap(), [1.5, 2.5]);
//! assert_eq!(scalars.as_slice(), &[11.0]);
//! assert_eq!(other.join().unwrap(), [1.5, 2.5]);
//! ```

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use tch::{Kind, Tensor};

/// What a round sums: values (gradients: a flat float32 tensor, on rank
/// 0's device) and scalars (statistics, in f64).
pub type Sums = (Tensor, Arc<Vec<f64>>);

/// The ranks of one data-parallel trainer in this process.
#[derive(Debug)]
pub struct HostGroup {
    size: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Round {
    /// Rounds completed.
    generation: u64,
    /// Each rank's values for the round being collected.
    deposits: Vec<Option<(Tensor, Vec<f64>)>>,
    /// The sums of round `generation`, while ranks are still taking them.
    result: Option<Sums>,
    /// Ranks that took `result`.
    taken: usize,
    /// Why the group closed, once a rank left.
    closed: Option<String>,
}

impl HostGroup {
    /// A group of `size` ranks.
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(HostGroup {
            size: size.max(1),
            state: Mutex::new(Round {
                deposits: (0..size.max(1)).map(|_| None).collect(),
                ..Round::default()
            }),
            changed: Condvar::new(),
        })
    }

    /// Rank `rank`'s handle (`rank < size`).
    pub fn member(self: &Arc<Self>, rank: usize) -> GroupMember {
        assert!(rank < self.size, "rank {rank} of a group of {}", self.size);
        GroupMember {
            link: Link::Local {
                group: self.clone(),
                rank,
            },
            shard_optimizer: false,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close(&self, why: String) {
        let mut round = self.lock();
        round.closed.get_or_insert(why);
        self.changed.notify_all();
    }

    /// One round: every rank deposits `values` and `scalars`; the last to
    /// arrive combines them (`sum` in rank order, else end to end), and
    /// every rank takes the result.
    fn round(
        &self,
        rank: usize,
        values: Tensor,
        scalars: Vec<f64>,
        sum: bool,
    ) -> Result<Sums, String> {
        let mut round = self.lock();
        // Wait until the previous round's sums are taken and this rank's slot is free.
        while round.result.is_some() || round.deposits[rank].is_some() {
            if let Some(why) = &round.closed {
                return Err(why.clone());
            }
            round = self.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(why) = &round.closed {
            return Err(why.clone());
        }
        let generation = round.generation;
        round.deposits[rank] = Some((values, scalars));
        if round.deposits.iter().all(Option::is_some) {
            let combined = if sum {
                sum_in_rank_order(&mut round.deposits)
            } else {
                concatenate(&mut round.deposits)
            };
            match combined {
                Ok(sums) => round.result = Some(sums),
                Err(why) => {
                    // The others are waiting for this round: they fail with the same reason.
                    round.closed.get_or_insert(why.clone());
                    self.changed.notify_all();
                    return Err(why);
                }
            }
            round.taken = 0;
            self.changed.notify_all();
        }
        loop {
            if round.generation == generation {
                if let Some((values, scalars)) = &round.result {
                    let sums = (values.shallow_clone(), scalars.clone());
                    round.taken += 1;
                    if round.taken == self.size {
                        round.result = None;
                        round.generation += 1;
                        self.changed.notify_all();
                    }
                    return Ok(sums);
                }
            }
            if let Some(why) = &round.closed {
                return Err(why.clone());
            }
            round = self.changed.wait(round).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Adds the deposits up in rank order, on rank 0's device, and empties them.
fn sum_in_rank_order(deposits: &mut [Option<(Tensor, Vec<f64>)>]) -> Result<Sums, String> {
    let _guard = tch::no_grad_guard();
    let mut taken = deposits
        .iter_mut()
        .map(|d| d.take().expect("all deposited"));
    let (first, mut scalars) = taken.next().expect("a group has a rank");
    // A copy: the sums accumulate in place, never in a rank's own tensor.
    let mut values = first.to_kind(Kind::Float).reshape([-1]).copy();
    for (rank, (v, s)) in taken.enumerate() {
        if v.numel() != values.numel() || s.len() != scalars.len() {
            return Err(format!(
                "rank {} handed in {} values and {} scalars, rank 0 {} and {}",
                rank + 1,
                v.numel(),
                s.len(),
                values.numel(),
                scalars.len()
            ));
        }
        let device = values.device();
        values += v.reshape([-1]).to_device(device).to_kind(Kind::Float);
        scalars.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
    }
    Ok((values, Arc::new(scalars)))
}

/// The ranks' values end to end in rank order, on rank 0's device, and their
/// scalars summed; empties the deposits.
fn concatenate(deposits: &mut [Option<(Tensor, Vec<f64>)>]) -> Result<Sums, String> {
    let _guard = tch::no_grad_guard();
    let taken: Vec<(Tensor, Vec<f64>)> = deposits
        .iter_mut()
        .map(|d| d.take().expect("all deposited"))
        .collect();
    let device = taken[0].0.device();
    let parts: Vec<Tensor> = taken
        .iter()
        .map(|(v, _)| v.to_kind(Kind::Float).reshape([-1]).to_device(device))
        .collect();
    let mut scalars = taken[0].1.clone();
    for (_, s) in &taken[1..] {
        scalars.iter_mut().zip(s).for_each(|(a, b)| *a += b);
    }
    Ok((Tensor::cat(&parts, 0), Arc::new(scalars)))
}

/// The all-reduce of a group whose ranks live in several processes, over
/// host memory: every rank hands in as many values and scalars, and gets
/// back their element-wise sums, added in rank order from rank 0's.
pub trait HostReduce: Send + std::fmt::Debug {
    /// This member's rank.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Waits for every rank; fails when a rank is gone or lengths differ.
    fn all_reduce(
        &self,
        values: Vec<f32>,
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String>;
    /// Waits for every rank; returns this rank's chunk
    /// `bounds[rank]..bounds[rank + 1]` of the sums of the ranks' `values`
    /// (the all-reduce's bits), and the sums of their scalars.
    fn reduce_scatter(
        &self,
        values: Vec<f32>,
        bounds: &[usize],
        scalars: Vec<f64>,
    ) -> Result<(Vec<f32>, Vec<f64>), String>;
    /// Waits for every rank; returns the ranks' chunks end to end (rank
    /// `r`'s of length `bounds[r + 1] - bounds[r]`).
    fn all_gather(&self, chunk: Vec<f32>, bounds: &[usize]) -> Result<Vec<f32>, String>;
}

/// One rank of a data-parallel group; dropping a [`HostGroup`]'s member closes that group.
#[derive(Debug)]
pub struct GroupMember {
    link: Link,
    shard_optimizer: bool,
}

#[derive(Debug)]
enum Link {
    Local { group: Arc<HostGroup>, rank: usize },
    Remote(Box<dyn HostReduce>),
}

impl GroupMember {
    /// A rank of a group reached through `reduce` (ranks in several processes).
    pub fn over(reduce: Box<dyn HostReduce>) -> Self {
        GroupMember {
            link: Link::Remote(reduce),
            shard_optimizer: false,
        }
    }

    /// This rank's trainers shard their optimizer state over the group
    /// (ZeRO stages 1 and 2, `placement.shard_optimizer`): see
    /// [`crate::optim::Optimizer::shard`].
    pub fn sharding_optimizer(mut self, shard: bool) -> Self {
        self.shard_optimizer = shard;
        self
    }

    /// Whether trainers of this rank shard their optimizer state over the group.
    pub fn shards_optimizer(&self) -> bool {
        self.shard_optimizer
    }

    /// This member's rank.
    pub fn rank(&self) -> usize {
        match &self.link {
            Link::Local { rank, .. } => *rank,
            Link::Remote(r) => r.rank(),
        }
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        match &self.link {
            Link::Local { group, .. } => group.size,
            Link::Remote(r) => r.size(),
        }
    }

    /// Waits for every rank and returns the element-wise sums of their
    /// `values` (any shape and device, summed flat in float32) and
    /// `scalars`, the same bits on every rank. Fails when a rank has left
    /// the group or the ranks' lengths differ.
    pub fn all_reduce(&self, values: Tensor, scalars: Vec<f64>) -> Result<Sums, String> {
        self.all_reduce_parts(&[values], scalars)
    }

    /// [`GroupMember::all_reduce`] of `parts` laid end to end (flat): in
    /// one process they are joined on the first part's device; across
    /// processes each is copied once into the host buffer that travels.
    pub fn all_reduce_parts(&self, parts: &[Tensor], scalars: Vec<f64>) -> Result<Sums, String> {
        match &self.link {
            Link::Local { group, rank } => group
                .round(*rank, joined(parts), scalars, true)
                .map_err(|why| format!("data-parallel group: {why}")),
            Link::Remote(reduce) => {
                let (sums, scalars) = reduce.all_reduce(host_values(parts)?, scalars)?;
                Ok((Tensor::from_slice(&sums), Arc::new(scalars)))
            }
        }
    }
}

impl GroupMember {
    /// Waits for every rank and returns this rank's chunk
    /// `bounds[rank]..bounds[rank + 1]` of the element-wise sums of their
    /// values, `parts` laid end to end (float32, on the first part's
    /// device: the bits of [`GroupMember::all_reduce`]), and the sums of
    /// their `scalars`. `bounds` (`size() + 1` offsets from 0 to the
    /// values' length) must be the same on every rank.
    pub fn reduce_scatter(
        &self,
        parts: &[Tensor],
        bounds: &[usize],
        scalars: Vec<f64>,
    ) -> Result<Sums, String> {
        check_bounds(bounds, self.size(), parts.iter().map(Tensor::numel).sum())?;
        let rank = self.rank();
        let (from, to) = (bounds[rank], bounds[rank + 1]);
        let device = device_of(parts);
        match &self.link {
            Link::Local { group, .. } => {
                let (sums, scalars) = group
                    .round(rank, joined(parts), scalars, true)
                    .map_err(|why| format!("data-parallel group: {why}"))?;
                let mine = sums
                    .narrow(0, from as i64, (to - from) as i64)
                    .to_device(device)
                    .copy();
                Ok((mine, scalars))
            }
            Link::Remote(reduce) => {
                let (chunk, scalars) =
                    reduce.reduce_scatter(host_values(parts)?, bounds, scalars)?;
                Ok((
                    Tensor::from_slice(&chunk).to_device(device),
                    Arc::new(scalars),
                ))
            }
        }
    }

    /// Waits for every rank and returns their chunks end to end, float32
    /// on `device`; this rank's chunk is `parts` laid end to end (rank
    /// `r`'s has `bounds[r + 1] - bounds[r]` values; it may be empty, so
    /// one rank's values reach all).
    pub fn all_gather(
        &self,
        parts: &[Tensor],
        bounds: &[usize],
        device: tch::Device,
    ) -> Result<Tensor, String> {
        check_bounds(bounds, self.size(), *bounds.last().unwrap_or(&0))?;
        let rank = self.rank();
        let owned = bounds[rank + 1] - bounds[rank];
        let handed: usize = parts.iter().map(Tensor::numel).sum();
        if handed != owned {
            return Err(format!(
                "data-parallel group: rank {rank} owns {owned} values, handed in {handed}"
            ));
        }
        match &self.link {
            Link::Local { group, .. } => {
                let chunk = if parts.is_empty() {
                    Tensor::zeros([0], (Kind::Float, device))
                } else {
                    joined(parts)
                };
                let (all, _) = group
                    .round(rank, chunk, Vec::new(), false)
                    .map_err(|why| format!("data-parallel group: {why}"))?;
                let n = *bounds.last().unwrap_or(&0);
                if all.numel() != n {
                    return Err(format!(
                        "data-parallel group: the ranks handed in {} values in all, not {n}",
                        all.numel()
                    ));
                }
                Ok(all.to_device(device))
            }
            Link::Remote(reduce) => {
                let all = reduce.all_gather(host_values(parts)?, bounds)?;
                Ok(Tensor::from_slice(&all).to_device(device))
            }
        }
    }
}

/// Checks that `bounds` cut `n` values into `ranks` chunks.
fn check_bounds(bounds: &[usize], ranks: usize, n: usize) -> Result<(), String> {
    let ordered = bounds.windows(2).all(|w| w[0] <= w[1]);
    if bounds.len() != ranks + 1 || bounds[0] != 0 || bounds[ranks] != n || !ordered {
        return Err(format!(
            "data-parallel group: chunk bounds {bounds:?} do not cut {n} values among {ranks} ranks"
        ));
    }
    Ok(())
}

/// `parts` end to end as one flat float32 tensor, on the first part's device.
fn joined(parts: &[Tensor]) -> Tensor {
    let device = device_of(parts);
    let flat: Vec<Tensor> = parts
        .iter()
        .map(|p| p.to_kind(Kind::Float).reshape([-1]).to_device(device))
        .collect();
    match flat.len() {
        0 => Tensor::zeros([0], (Kind::Float, device)),
        1 => flat.into_iter().next().unwrap_or_else(|| unreachable!()),
        _ => Tensor::cat(&flat, 0),
    }
}

/// The device of the first of `parts` (the CPU for none).
fn device_of(parts: &[Tensor]) -> tch::Device {
    parts.first().map_or(tch::Device::Cpu, Tensor::device)
}

/// `parts`' values end to end as float32 in host memory, each copied once.
fn host_values(parts: &[Tensor]) -> Result<Vec<f32>, String> {
    let n = parts.iter().map(Tensor::numel).sum();
    let mut out = vec![0f32; n];
    let mut at = 0;
    for p in parts {
        let len = p.numel();
        let flat = p
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu)
            .reshape([-1])
            .contiguous();
        flat.f_copy_data(&mut out[at..at + len], len)
            .map_err(|e| e.to_string())?;
        at += len;
    }
    Ok(out)
}

/// Whether a trainer with `member` (or alone, `None`) is the one that
/// publishes, checkpoints and records: rank 0, or the only one.
pub fn leads(member: Option<&GroupMember>) -> bool {
    member.is_none_or(|m| m.rank() == 0)
}

/// Sums `scalars` over `member`'s group in place; alone (`None`), leaves them.
pub fn sum_scalars(member: Option<&GroupMember>, scalars: &mut [f64]) -> Result<(), String> {
    if let Some(member) = member {
        let (_, sums) = member.all_reduce(no_values(), scalars.to_vec())?;
        scalars.copy_from_slice(&sums);
    }
    Ok(())
}

/// Takes the element-wise maximum of `scalars` over `member`'s group in
/// place; alone (`None`), leaves them.
pub fn max_scalars(member: Option<&GroupMember>, scalars: &mut [f64]) -> Result<(), String> {
    if let Some(member) = member {
        // Each rank fills its own slot of a group-wide vector; the sum holds them all.
        let n = scalars.len();
        let mut slots = vec![0.0; n * member.size()];
        let rank = member.rank();
        slots[rank * n..(rank + 1) * n].copy_from_slice(scalars);
        let (_, sums) = member.all_reduce(no_values(), slots)?;
        for (i, x) in scalars.iter_mut().enumerate() {
            *x = (0..member.size())
                .map(|r| sums[r * n + i])
                .fold(f64::NEG_INFINITY, f64::max);
        }
    }
    Ok(())
}

fn no_values() -> Tensor {
    Tensor::zeros([0], (Kind::Float, tch::Device::Cpu))
}

impl Drop for GroupMember {
    fn drop(&mut self) {
        if let Link::Local { group, rank } = &self.link {
            group.close(format!("rank {rank} left"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_sum_in_rank_order_and_repeat() {
        let group = HostGroup::new(3);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let member = group.member(rank);
                std::thread::spawn(move || {
                    (0..50)
                        .map(|round| {
                            let v = Tensor::from_slice(&[rank as f32 + round as f32, 1.0]);
                            let (values, scalars) =
                                member.all_reduce(v, vec![rank as f64]).unwrap();
                            (Vec::<f32>::try_from(values).unwrap(), scalars)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for round in 0..50 {
            let (values, scalars) = &results[0][round];
            assert_eq!(values.as_slice(), &[3.0 + 3.0 * round as f32, 3.0]);
            assert_eq!(scalars.as_slice(), &[3.0]);
            assert!(results.iter().all(|r| r[round] == results[0][round]));
        }
    }

    #[test]
    fn max_scalars_takes_each_entry_from_the_rank_that_holds_its_maximum() {
        let group = HostGroup::new(3);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let member = group.member(rank);
                std::thread::spawn(move || {
                    let mut x = [
                        rank as f64,
                        -(rank as f64),
                        if rank == 1 { 7.0 } else { 2.0 },
                    ];
                    max_scalars(Some(&member), &mut x).unwrap();
                    x
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), [2.0, 0.0, 7.0]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_waiters_instead_of_hanging() {
        let group = HostGroup::new(2);
        let (a, b) = (group.member(0), group.member(1));
        let waiter = std::thread::spawn(move || {
            a.all_reduce(Tensor::from_slice(&[1.0f32]), vec![])
                .map(|_| ())
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(b);
        let err = waiter.join().unwrap().unwrap_err();
        assert!(err.contains("rank 1 left"), "{err}");
    }

    #[test]
    fn mismatched_lengths_are_an_error() {
        let group = HostGroup::new(2);
        let (a, b) = (group.member(0), group.member(1));
        let other = std::thread::spawn(move || {
            b.all_reduce(Tensor::from_slice(&[1.0f32, 2.0]), vec![])
                .map(|_| ())
        });
        let err = a
            .all_reduce(Tensor::from_slice(&[1.0f32]), vec![])
            .unwrap_err();
        assert!(err.contains("rank 1 handed in 2 values"), "{err}");
        drop(a);
        assert!(other.join().unwrap().is_err());
    }
}
