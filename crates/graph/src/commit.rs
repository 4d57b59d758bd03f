//! Commit points: the steps after which everything a run wrote is on disk.
//!
//! A run's checkpoint at step `c` may only count once the rollout log and the
//! metrics file hold every row of the steps up to `c`; otherwise a crash after
//! the checkpoint loses rows that the resumed run never produces again. The
//! engine makes this a frontier property:
//!
//! - every sink and the metrics writer hold a capability at the next commit
//!   point `c` ([`CommitHold`]); when their input frontier passes `c` they make
//!   what they have durable ([`crate::Sink::commit`], the metrics file) and
//!   only then move the capability on;
//! - the run's probe watches those operators too, so its frontier passes `c`
//!   only when every sink of every worker of every process has committed `c`;
//! - then each worker's driver calls the run's [`OnCommit`] (which writes the
//!   checkpoint's `state.json`, say) once for `c`.
//!
//! A failed sink keeps its capability, so no checkpoint after its last
//! commit can count.

use std::sync::Arc;

use timely::dataflow::operators::Capability;
use timely::progress::frontier::MutableAntichain;

use crate::Step;

/// The first commit point at or after a step (`None`: no more).
pub type NextCommit = Arc<dyn Fn(Step) -> Option<Step> + Send + Sync>;

/// Called (on every worker, so it must be idempotent) once the frontier of
/// the whole run, sinks and metrics included, has passed a commit point.
pub type OnCommit = Arc<dyn Fn(Step) -> Result<(), String> + Send + Sync>;

/// The first commit point at or after step `from` of a run that commits
/// every `every` steps (after steps `every − 1`, `2·every − 1`, …; none for
/// 0) and at `last`, its last step (none after it).
pub fn next(every: u64, last: Option<Step>, from: Step) -> Option<Step> {
    let periodic = (every > 0)
        .then(|| (from + 1).div_ceil(every) * every - 1)
        .filter(|&p| last.is_none_or(|l| p <= l));
    let last = last.filter(|&l| l >= from);
    match (periodic, last) {
        (Some(p), Some(l)) => Some(p.min(l)),
        (p, l) => p.or(l),
    }
}

/// A capability held at the next commit point.
pub(crate) struct CommitHold {
    cap: Option<Capability<Step>>,
    next: Option<NextCommit>,
}

impl CommitHold {
    /// Holds `cap` at the first commit point at or after `first_step`
    /// (nothing when `next` is `None`).
    pub(crate) fn new(
        mut cap: Capability<Step>,
        next: Option<NextCommit>,
        first_step: Step,
    ) -> Self {
        let at = next.as_ref().and_then(|n| n(first_step));
        let cap = at.map(|at| {
            cap.downgrade(&at);
            cap
        });
        CommitHold { cap, next }
    }

    /// Nothing held: the frontier flows past.
    pub(crate) fn none() -> Self {
        CommitHold {
            cap: None,
            next: None,
        }
    }

    /// Calls `commit(c)` for each held commit point `c` that `frontier` has
    /// passed, moving the capability on after each. On an error the
    /// capability stays where it is.
    pub(crate) fn advance<E>(
        &mut self,
        frontier: &MutableAntichain<Step>,
        mut commit: impl FnMut(Step) -> Result<(), E>,
    ) -> Result<(), E> {
        while let Some(cap) = self.cap.as_mut() {
            let at = *cap.time();
            if frontier.less_equal(&at) {
                break;
            }
            commit(at)?;
            match self.next.as_ref().and_then(|n| n(at + 1)) {
                Some(next) => cap.downgrade(&next),
                None => self.cap = None,
            }
        }
        Ok(())
    }
}

/// Tracks which commit points a worker's driver has announced.
pub(crate) struct CommitTracker {
    next: Option<Step>,
    points: NextCommit,
    on_commit: OnCommit,
}

impl CommitTracker {
    pub(crate) fn new(points: NextCommit, on_commit: OnCommit, first_step: Step) -> Self {
        CommitTracker {
            next: points(first_step),
            points,
            on_commit,
        }
    }

    /// Announces every commit point below `first_incomplete` (all of them when `None`).
    pub(crate) fn reached(&mut self, first_incomplete: Option<Step>) -> Result<(), String> {
        while let Some(at) = self.next {
            if first_incomplete.is_some_and(|f| f <= at) {
                break;
            }
            (self.on_commit)(at)?;
            self.next = (self.points)(at + 1);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`next`]'s points as a function of the step.
    fn every(every: u64, last: Option<Step>) -> impl Fn(Step) -> Option<Step> {
        move |from| next(every, last, from)
    }

    #[test]
    fn periodic_points_and_the_last_step() {
        let next = every(3, Some(10));
        let points: Vec<Step> = std::iter::successors(next(0), |&p| next(p + 1)).collect();
        assert_eq!(points, vec![2, 5, 8, 10]);
        assert_eq!(next(4), Some(5));
        assert_eq!(next(5), Some(5));
        let only_last = every(0, Some(7));
        assert_eq!(only_last(0), Some(7));
        assert_eq!(only_last(8), None);
        assert_eq!(every(4, Some(9))(9), Some(9));
        assert_eq!(every(4, Some(9))(10), None);
        let unbounded = every(1, None);
        assert_eq!(unbounded(41), Some(41));
    }
}
