//! Backpressure between steps: at most `max_staleness + 1` steps in flight.
//!
//! The source admits step `s` only once step `s − k − 1` has completed, as a
//! probe at the end of the chain reports (`k` = max_staleness). Memory is then
//! bounded by `(k + 1)` steps of rollouts, and nothing is ever dropped: the
//! source simply waits (the worker parks in `step_or_park` meanwhile).
//! Within a step, the bounded queue of an engine thread does the same job.
//!
//! # Examples
//! ```
//! use weir_graph::Admission;
//!
//! // k = 1: steps 0 and 1 may be in flight together, step 2 waits for step 0.
//! let mut admission = Admission::new(0, Some(10), 1);
//! assert!(admission.may_admit(Some(0)));
//! admission.admit(Some(0));
//! assert!(admission.may_admit(Some(0)));
//! admission.admit(Some(0));
//! assert!(!admission.may_admit(Some(0)), "step 2 must wait until step 0 completes");
//! assert!(admission.may_admit(Some(1)));
//! assert_eq!(admission.peak_in_flight(), 2);
//! ```

use crate::Step;

/// The source's admission rule and its in-flight accounting.
#[derive(Clone, Debug)]
pub struct Admission {
    k: u64,
    next: Step,
    end: Option<Step>,
    peak_in_flight: u64,
}

impl Admission {
    /// Admission from step `first`, for `steps` steps (unbounded if `None`), with `max_staleness` = `k`.
    pub fn new(first: Step, steps: Option<u64>, k: u64) -> Self {
        Admission {
            k,
            next: first,
            end: steps.map(|n| first + n),
            peak_in_flight: 0,
        }
    }

    /// The next step to admit.
    pub fn next_step(&self) -> Step {
        self.next
    }

    /// True when every step of the run has been admitted.
    pub fn exhausted(&self) -> bool {
        self.end.is_some_and(|end| self.next >= end)
    }

    /// Whether the next step may enter, given the first step not yet complete
    /// at the end of the chain (`None`: all admitted steps are complete).
    pub fn may_admit(&self, first_incomplete: Option<Step>) -> bool {
        if self.exhausted() {
            return false;
        }
        match first_incomplete {
            None => true,
            // Step `next − k − 1` must be complete, i.e. the frontier is past it.
            Some(f) => self.next < f + self.k + 1,
        }
    }

    /// Records that the next step entered; returns it.
    pub fn admit(&mut self, first_incomplete: Option<Step>) -> Step {
        let step = self.next;
        self.next += 1;
        let in_flight = match first_incomplete {
            Some(f) if f <= step => self.next - f,
            _ => 1,
        };
        self.peak_in_flight = self.peak_in_flight.max(in_flight);
        step
    }

    /// The most steps in flight at any admission.
    pub fn peak_in_flight(&self) -> u64 {
        self.peak_in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k0_is_strictly_sequential() {
        let mut a = Admission::new(0, Some(3), 0);
        assert!(a.may_admit(Some(0)));
        a.admit(Some(0));
        assert!(!a.may_admit(Some(0)));
        assert!(a.may_admit(Some(1)));
        a.admit(Some(1));
        a.admit(Some(2));
        assert!(a.exhausted());
        assert!(!a.may_admit(None));
        assert_eq!(a.peak_in_flight(), 1);
    }

    #[test]
    fn resumed_runs_count_from_their_first_step() {
        let mut a = Admission::new(100, None, 2);
        for _ in 0..3 {
            assert!(a.may_admit(Some(100)));
            a.admit(Some(100));
        }
        assert!(!a.may_admit(Some(100)));
        assert_eq!(a.next_step(), 103);
        assert_eq!(a.peak_in_flight(), 3);
    }
}
