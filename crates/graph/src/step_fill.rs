//! Which training step a finished prompt group joins, for a streaming
//! generator: groups fill steps in the order they finish, so a step need
//! not wait for its own slowest group, while every group is trained within
//! the staleness bound of the version it started with.
//!
//! Each input step `s` brings some groups (its *quota*: output step `s`
//! takes exactly as many, so a learner step keeps its size). A group that
//! starts under policy version `v` has a *deadline* `v + k`: it must be
//! trained at a step `≤ v + k`, so its staleness never exceeds `k`
//! (AReaL's capacity rule in weir's units). Because a group of input step
//! `s` starts under a version `≥ s − k`, the groups due by step `u` never
//! outnumber the quotas of steps `≤ u`; a finished group takes the lowest
//! open step with a free slot that does not leave any step unable to take
//! the groups due by it (an earliest-deadline check), and waits otherwise.
//! Finished work is never dropped.
//!
//! A *barrier* step (a checkpoint) takes exactly the groups of input steps
//! up to it: no group crosses it either way, so a resume from it
//! regenerates exactly the steps after it. At `k = 0` every group is due at
//! its own step, and the steps are those of the synchronous path.
//!
//! # Examples
//!
//! ```
//! use weir_graph::StepFill;
//!
//! // k = 1, no barriers; input step 0 brings groups a and b, step 1 brings c.
//! let mut fill = StepFill::new(1, |_| None);
//! let a = fill.start(0, 0);
//! let b = fill.start(0, 0);
//! fill.input_complete(0);
//! let c = fill.start(1, 0);
//! // c finishes first and takes a free slot of step 0 …
//! assert_eq!(fill.finish(c), Some(0));
//! // … a is due at step 1 (started at version 0): it takes the other slot of step 0 …
//! assert_eq!(fill.finish(a), Some(0));
//! assert!(!fill.holds(0));
//! fill.close(0);
//! // … and b, the slowest, is trained at step 1, still within k.
//! assert_eq!(fill.finish(b), Some(1));
//! ```

use std::collections::BTreeMap;

use crate::{PolicyVersion, Step};

/// A group started in a [`StepFill`]: its input step and deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Started {
    /// The input step whose prompts the group came with.
    pub step: Step,
    /// The last step at which the group may be trained.
    pub deadline: Step,
}

/// What each open step has: its quota so far and the groups placed in it.
#[derive(Clone, Copy, Debug, Default)]
struct Slots {
    /// Groups its input step brought so far.
    quota: usize,
    /// Groups placed in it.
    placed: usize,
    /// Its input step is complete: the quota is final.
    complete: bool,
}

/// The step assignment of a streaming generator (see the module docs).
pub struct StepFill {
    max_staleness: u64,
    /// The first barrier step at or after a step.
    next_barrier: Box<dyn Fn(Step) -> Option<Step> + Send>,
    /// Steps not yet closed, from the oldest.
    open: BTreeMap<Step, Slots>,
    /// Groups started and not yet placed, by deadline.
    due: BTreeMap<Step, usize>,
    /// Steps below this are closed.
    closed_below: Step,
}

impl std::fmt::Debug for StepFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepFill")
            .field("max_staleness", &self.max_staleness)
            .field("open", &self.open)
            .field("due", &self.due)
            .field("closed_below", &self.closed_below)
            .finish()
    }
}

impl StepFill {
    /// Steps under staleness bound `max_staleness`; `next_barrier(s)` is
    /// the first step at or after `s` that no group crosses (a checkpoint),
    /// if any.
    pub fn new(
        max_staleness: u64,
        next_barrier: impl Fn(Step) -> Option<Step> + Send + 'static,
    ) -> Self {
        StepFill {
            max_staleness,
            next_barrier: Box::new(next_barrier),
            open: BTreeMap::new(),
            due: BTreeMap::new(),
            closed_below: 0,
        }
    }

    /// The steps of a run: its staleness bound, its commit points as
    /// barriers, and steps before its first closed already.
    pub fn for_run(steps: crate::RunSteps) -> Self {
        StepFill::new(steps.max_staleness, move |s| steps.next_commit(s)).starting_at(steps.first)
    }

    /// Steps before `step` are closed already (a resumed run starts there).
    pub fn starting_at(mut self, step: Step) -> Self {
        self.closed_below = step;
        self
    }

    /// A group of input step `step` starts under policy `version`: it is
    /// queued, and none of its tokens can be older than `version`.
    pub fn start(&mut self, step: Step, version: PolicyVersion) -> Started {
        let deadline = self.deadline(step, version);
        self.open.entry(step).or_default().quota += 1;
        *self.due.entry(deadline).or_insert(0) += 1;
        Started { step, deadline }
    }

    /// The last step a group of input step `step` whose oldest token is of
    /// `version` may be trained at.
    fn deadline(&self, step: Step, version: PolicyVersion) -> Step {
        let deadline = version.saturating_add(self.max_staleness).max(step);
        // A barrier at or after its input step holds it.
        match (self.next_barrier)(step) {
            Some(b) if b < deadline => b,
            _ => deadline,
        }
    }

    /// Every sample of `group` (not yet finished) has drawn its first token,
    /// the oldest of them under `version`: its deadline moves on to what
    /// `version` allows, if that is later (a group queued behind others
    /// while newer weights arrived gets the slack they give). Returns the
    /// group as it now stands; pass that to [`StepFill::finish`].
    pub fn first_tokens_under(&mut self, group: Started, version: PolicyVersion) -> Started {
        let deadline = self.deadline(group.step, version);
        if deadline <= group.deadline {
            return group;
        }
        let due = self
            .due
            .get_mut(&group.deadline)
            .expect("an unplaced group is due");
        *due -= 1;
        if *due == 0 {
            self.due.remove(&group.deadline);
        }
        *self.due.entry(deadline).or_insert(0) += 1;
        Started {
            step: group.step,
            deadline,
        }
    }

    /// Input step `step` has brought all its groups.
    pub fn input_complete(&mut self, step: Step) {
        if step >= self.closed_below {
            self.open.entry(step).or_default().complete = true;
        }
    }

    /// The step that finished `group` joins, or `None` while no step can
    /// take it yet (try again after more groups start or finish).
    pub fn finish(&mut self, group: Started) -> Option<Step> {
        let step = self.place(group)?;
        let slots = self.open.get_mut(&step).expect("placed in an open step");
        slots.placed += 1;
        let due = self
            .due
            .get_mut(&group.deadline)
            .expect("a started group is due");
        *due -= 1;
        if *due == 0 {
            self.due.remove(&group.deadline);
        }
        Some(step)
    }

    fn place(&self, group: Started) -> Option<Step> {
        let (lo, deadline) = (self.closed_below, group.deadline);
        if deadline < lo {
            return None;
        }
        // The lowest step it may join: after the last barrier before its input step.
        let mut floor = lo;
        while let Some(b) = (self.next_barrier)(floor).filter(|&b| b < group.step) {
            floor = b + 1;
        }
        // Free slots and due groups change only at open steps and deadlines:
        // walk those in lo..=deadline (a large k costs no more than a small
        // one), with the free slots of steps ≤ u and the groups due by u.
        let mut points: Vec<Step> = self
            .open
            .range(lo..=deadline)
            .map(|(&u, _)| u)
            .chain(self.due.range(lo..=deadline).map(|(&u, _)| u))
            .collect();
        points.sort_unstable();
        points.dedup();
        let (mut free_by, mut due_by) = (0usize, 0usize);
        let mut room: Vec<(Step, usize, bool)> = Vec::with_capacity(points.len());
        for u in points {
            let free = self.open.get(&u).map_or(0, |s| s.quota - s.placed);
            free_by += free;
            due_by += self.due.get(&u).copied().unwrap_or(0);
            // Taking a slot at or before u (until the next point) must leave
            // one for each group due by then.
            room.push((u, free, due_by < free_by));
        }
        // The lowest t with a free slot such that every u in [t, deadline) keeps room.
        let (mut fits_after, mut best) = (true, None);
        for &(u, free, spare) in room.iter().rev() {
            if u < deadline {
                fits_after &= spare;
            }
            if !fits_after {
                break;
            }
            if u >= floor && free > 0 {
                best = Some(u);
            }
        }
        best
    }

    /// Whether step `step` cannot close yet: its input step is not
    /// complete, or it has free slots (groups that will fill them are
    /// still generating).
    pub fn holds(&self, step: Step) -> bool {
        match self.open.get(&step) {
            Some(s) => !s.complete || s.placed < s.quota,
            // Its input step has not said it is complete.
            None => step >= self.closed_below,
        }
    }

    /// Ends step `step` (its input is complete by now): an error while
    /// groups are still to join it, which a streaming stage's engine thread
    /// never lets happen (it waits for [`StepFill::holds`]).
    pub fn end(&mut self, step: Step) -> Result<(), String> {
        self.input_complete(step);
        if self.holds(step) {
            return Err(format!(
                "step {step} ended with groups still to join it (a streaming stage must run on an engine thread)"
            ));
        }
        self.close(step);
        Ok(())
    }

    /// Step `step` has ended: nothing joins it any more.
    pub fn close(&mut self, step: Step) {
        self.open.remove(&step);
        self.closed_below = self.closed_below.max(step + 1);
    }

    /// Groups started and not yet placed.
    pub fn unplaced(&self) -> usize {
        self.due.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A run in miniature: input step `s` starts once `s − k` steps are
    /// trained (the version it needs), groups finish in a random order,
    /// steps close as soon as the fill lets them; returns per group
    /// (input step, start version, trained step).
    fn simulate(
        quotas: &[usize],
        k: u64,
        barrier_every: u64,
        order: &[usize],
    ) -> Result<Vec<(Step, u64, Step)>, String> {
        let barrier =
            move |s: Step| (barrier_every > 0).then(|| (s / barrier_every + 1) * barrier_every - 1);
        let mut fill = StepFill::new(k, barrier);
        let steps = quotas.len() as u64;
        let (mut admitted, mut closed) = (0u64, 0u64);
        let mut running: Vec<(usize, Started, u64)> = Vec::new();
        let mut waiting: Vec<(usize, Started, u64)> = Vec::new();
        let mut out = Vec::new();
        let mut id = 0;
        let mut pick = order.iter().cycle();
        loop {
            // Admission: the version (= steps trained) is at least s − k.
            while admitted < steps && closed + k >= admitted {
                for _ in 0..quotas[admitted as usize] {
                    // The oldest version it may start under, or the newest there is.
                    let version = if id % 2 == 0 {
                        admitted.saturating_sub(k)
                    } else {
                        closed
                    };
                    running.push((id, fill.start(admitted, version), version));
                    id += 1;
                }
                fill.input_complete(admitted);
                admitted += 1;
            }
            // Waiting groups first, oldest first.
            waiting.sort_by_key(|w| (w.1.step, w.0));
            let mut still = Vec::new();
            for w in waiting.drain(..) {
                match fill.finish(w.1) {
                    Some(t) => out.push((w.1.step, w.2, t)),
                    None => still.push(w),
                }
            }
            waiting = still;
            while closed < steps && !fill.holds(closed) {
                fill.close(closed);
                closed += 1;
            }
            if closed == steps {
                break;
            }
            if running.is_empty() {
                if admitted == steps || closed + k < admitted {
                    return Err(format!(
                        "step {closed} cannot close, {} groups waiting: {fill:?}",
                        waiting.len()
                    ));
                }
                continue;
            }
            let r = *pick.next().expect("cycle");
            let mut g = running.swap_remove(r % running.len());
            // Some groups waited in the queue: their first tokens are of the
            // newest version, which moves their deadline on.
            if r & 0x100 != 0 {
                g.1 = fill.first_tokens_under(g.1, closed);
                g.2 = g.2.max(closed);
            }
            match fill.finish(g.1) {
                Some(t) => out.push((g.1.step, g.2, t)),
                None => waiting.push(g),
            }
        }
        if fill.unplaced() != 0 || !waiting.is_empty() || !running.is_empty() {
            return Err("groups left over".into());
        }
        Ok(out)
    }

    proptest! {
        #[test]
        fn every_group_is_trained_once_within_the_bound_and_steps_keep_their_size(
            quotas in prop::collection::vec(0usize..5, 1..12),
            k in 0u64..4,
            barrier_every in 0u64..5,
            order in prop::collection::vec(any::<usize>(), 1..64),
        ) {
            let placed = simulate(&quotas, k, barrier_every, &order).map_err(TestCaseError::fail)?;
            prop_assert_eq!(placed.len(), quotas.iter().sum::<usize>());
            let mut sizes = vec![0usize; quotas.len()];
            for &(input, version, trained) in &placed {
                sizes[trained as usize] += 1;
                // The learner trains step t at version t.
                prop_assert!(trained >= version && trained - version <= k,
                    "group of step {} started at version {} trained at step {}", input, version, trained);
                if k == 0 {
                    prop_assert_eq!(trained, input);
                }
                if barrier_every > 0 {
                    // No group crosses a barrier step.
                    let block = |s: Step| s / barrier_every;
                    prop_assert_eq!(block(input), block(trained));
                }
            }
            prop_assert_eq!(sizes, quotas.to_vec());
        }
    }

    #[test]
    fn a_slow_group_is_trained_in_time_and_fast_ones_fill_earlier_steps() {
        // k = 1, two groups a step. Step 0's group a is slow: step 0 takes b
        // and a group of step 1; a must be trained at step 1.
        let mut fill = StepFill::new(1, |_| None);
        let a = fill.start(0, 0);
        let b = fill.start(0, 0);
        fill.input_complete(0);
        let c = fill.start(1, 0);
        let d = fill.start(1, 0);
        fill.input_complete(1);
        assert_eq!(fill.finish(b), Some(0));
        assert_eq!(fill.finish(c), Some(0));
        assert!(!fill.holds(0));
        fill.close(0);
        // d is due at step 1 too, and step 1 has two slots: a and d.
        assert_eq!(fill.finish(d), Some(1));
        assert!(fill.holds(1), "a still runs");
        assert_eq!(fill.finish(a), Some(1));
        assert!(!fill.holds(1));
    }

    #[test]
    fn a_group_waits_when_taking_a_slot_would_strand_a_due_one() {
        // k = 1, one group a step: b (step 1) finishes first and takes
        // step 0's slot; a, due at step 1, gets step 1.
        let mut fill = StepFill::new(1, |_| None);
        let a = fill.start(0, 0);
        fill.input_complete(0);
        let b = fill.start(1, 0);
        fill.input_complete(1);
        assert_eq!(b.deadline, 1);
        assert_eq!(fill.finish(b), Some(0));
        assert_eq!(fill.finish(a), Some(1));
        // With three groups due by step 1 and two slots, the third waits for a slot.
        let mut fill = StepFill::new(1, |_| None);
        let a = fill.start(0, 0);
        fill.input_complete(0);
        let _b = fill.start(1, 0);
        let c = fill.start(2, 1);
        assert_eq!(c.deadline, 2);
        // c may not take step 0 or 1 while a and b need both slots.
        assert_eq!(fill.finish(c), Some(2));
        assert_eq!(fill.finish(a), Some(0));
    }

    #[test]
    fn a_group_queued_past_new_weights_is_due_from_its_first_token() {
        // k = 1: a and b of step 0 are queued under version 0; by the time
        // b's first token is drawn, version 1 is loaded, so b may wait for
        // step 2 and a, due at step 1, keeps step 1's slot.
        let mut fill = StepFill::new(1, |_| None);
        let a = fill.start(0, 0);
        let b = fill.start(0, 0);
        fill.input_complete(0);
        assert_eq!(b.deadline, 1);
        let b = fill.first_tokens_under(b, 1);
        assert_eq!(b.deadline, 2);
        // An older version never pulls a deadline in.
        assert_eq!(fill.first_tokens_under(a, 0), a);
        let c = fill.start(1, 1);
        let d = fill.start(1, 1);
        fill.input_complete(1);
        assert_eq!(fill.finish(c), Some(0));
        assert_eq!(fill.finish(d), Some(0));
        fill.close(0);
        assert_eq!(fill.finish(a), Some(1));
        assert!(fill.holds(1));
        let e = fill.start(2, 1);
        fill.input_complete(2);
        // e (due at 2) takes step 1's last slot while b may go to step 2.
        assert_eq!(fill.finish(e), Some(1));
        fill.close(1);
        assert_eq!(fill.finish(b), Some(2));
        assert_eq!(fill.unplaced(), 0);
        // Without the move, b stays due at step 1 and holds its last slot:
        // step 1 could not close before b ends, and e goes to step 2.
        let mut fill = StepFill::new(1, |_| None);
        let a = fill.start(0, 0);
        let b = fill.start(0, 0);
        fill.input_complete(0);
        for g in [fill.start(1, 1), fill.start(1, 1)] {
            assert_eq!(fill.finish(g), Some(0));
        }
        fill.input_complete(1);
        fill.close(0);
        assert_eq!(fill.finish(a), Some(1));
        let e = fill.start(2, 1);
        fill.input_complete(2);
        assert_eq!(fill.finish(e), Some(2));
        assert_eq!(fill.finish(b), Some(1));
        // A barrier still holds a group that moved.
        let mut fill = StepFill::new(3, |s| (s <= 1).then_some(1));
        let a = fill.start(0, 0);
        assert_eq!(fill.first_tokens_under(a, 2).deadline, 1);
    }

    #[test]
    fn a_huge_bound_costs_no_more_than_a_small_one() {
        let mut fill = StepFill::new(u64::MAX, |_| None);
        let a = fill.start(0, 0);
        assert_eq!(a.deadline, u64::MAX);
        fill.input_complete(0);
        assert_eq!(fill.finish(a), Some(0));
        assert!(!fill.holds(0));
    }

    #[test]
    fn a_barrier_step_takes_exactly_the_groups_up_to_it() {
        let mut fill = StepFill::new(2, |s| (s == 0).then_some(0));
        let a = fill.start(0, 0);
        assert_eq!(a.deadline, 0, "held by the barrier");
        fill.input_complete(0);
        let b = fill.start(1, 0);
        assert_eq!(fill.finish(b), Some(1), "never before the barrier");
        assert!(fill.holds(0));
        assert_eq!(fill.finish(a), Some(0));
        assert!(!fill.holds(0));
    }
}
