//! Where a prompt source stands in its dataset, and the log of where it
//! stood after each step that checkpoints store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Where a source is in its dataset: the epoch and the position in that epoch's order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// Epochs completed.
    pub epoch: u64,
    /// Prompts of this epoch already emitted.
    pub position: usize,
}

impl Cursor {
    /// Where a source stands after drawing `prompts` more prompts from a
    /// dataset of `len`, when nothing is skipped (no curriculum): what
    /// [`PromptSource`](crate::stages::prompts::PromptSource) reaches, including its lazy turn of the epoch (a
    /// cursor at the end of an epoch stays there until the next draw).
    pub fn after_drawing(self, prompts: u64, len: usize) -> Cursor {
        if prompts == 0 {
            return self;
        }
        let len = len.max(1) as u64;
        let drawn = self.epoch * len + self.position as u64 + prompts;
        match (drawn / len, drawn % len) {
            (epoch, 0) => Cursor {
                epoch: epoch - 1,
                position: len as usize,
            },
            (epoch, position) => Cursor {
                epoch,
                position: position as usize,
            },
        }
    }
}

/// The cursor after each step, as the sources of a process drew them: a
/// checkpoint taken at step `s` stores `log[s]`, so resuming draws step `s + 1` next.
///
/// A process that hosts a learner but no source (a multi-process run with
/// generation elsewhere) has nothing recorded: a log made by
/// [`CursorLog::derived`] then computes the cursor from where the segment
/// started, which is exact when no curriculum skips prompts.
#[derive(Clone, Debug, Default)]
pub struct CursorLog {
    recorded: Arc<Mutex<BTreeMap<u64, Cursor>>>,
    derived: Option<DerivedCursor>,
}

/// What [`CursorLog::derived`] computes cursors from.
#[derive(Clone, Copy, Debug)]
struct DerivedCursor {
    first_step: u64,
    start: Cursor,
    prompts_per_step: usize,
    len: usize,
}

impl CursorLog {
    /// An empty log.
    pub fn new() -> Self {
        CursorLog::default()
    }

    /// A log that, for steps no source of this process recorded, derives
    /// the cursor: `start` at `first_step`, then `prompts_per_step` drawn
    /// per step from a dataset of `len` prompts, nothing skipped.
    pub fn derived(first_step: u64, start: Cursor, prompts_per_step: usize, len: usize) -> Self {
        CursorLog {
            recorded: Default::default(),
            derived: Some(DerivedCursor {
                first_step,
                start,
                prompts_per_step,
                len,
            }),
        }
    }

    /// The cursor after `step` was drawn (older entries are dropped once read past).
    pub fn after(&self, step: u64) -> Option<Cursor> {
        let mut log = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        let found = log.get(&step).copied();
        if found.is_some() {
            log.retain(|s, _| *s >= step);
            return found;
        }
        let d = self.derived?;
        let steps = (step + 1).checked_sub(d.first_step)?;
        Some(
            d.start
                .after_drawing(steps * d.prompts_per_step as u64, d.len),
        )
    }

    pub(crate) fn record(&self, step: u64, cursor: Cursor) {
        let mut log = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        log.insert(step, cursor);
    }
}
