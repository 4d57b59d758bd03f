//! The streaming mode of [`Generate`]: the pool's state, rows joining it,
//! one pass, the groups that finished and the steps they join.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{ArrayRef, RecordBatch, UInt32Array, UInt64Array};
use weir_gpu::{Finished, Streamer};
use weir_graph::batch::with_column;
use weir_graph::weights_edge::now_unix_s;
use weir_graph::{PolicyVersion, StageError, Started, Step, StepContext, StepFill, WeightsPayload};

use super::{row_streams, version_u32, with_responses, Generate, Responses};
use crate::rollout::col;
use crate::stages::columns::{token_lists, u64s};

/// The streaming mode's state.
pub(super) struct StreamState {
    pub(super) streamer: Streamer,
    /// Which step each finished group joins.
    pub(super) fill: StepFill,
    /// Batches with rows in flight, by arrival.
    pub(super) batches: BTreeMap<u64, InFlight>,
    pub(super) next_batch: u64,
    /// Weights held back until the sequences in flight end (`finish`).
    pub(super) held: Option<(PolicyVersion, WeightsPayload)>,
    /// Per step: rows out, rows spanning versions, passes, sequences in flight over them.
    pub(super) figures: BTreeMap<Step, StepFigures>,
    /// Seconds of each weights update since the last step ended.
    pub(super) applies: Vec<f64>,
}

#[derive(Default)]
pub(super) struct StepFigures {
    pub(super) rows: u64,
    pub(super) partial: u64,
    pub(super) passes: u64,
    pub(super) inflight: u64,
}

/// A batch whose rows are being generated.
pub(super) struct InFlight {
    pub(super) step: Step,
    pub(super) batch: RecordBatch,
    pub(super) admitted: Instant,
    pub(super) admitted_unix: f64,
    pub(super) results: Vec<Option<(Finished, f32)>>,
    /// Rows of each group not finished yet.
    pub(super) open: HashMap<u64, usize>,
    pub(super) groups: Vec<u64>,
    /// Rows already sent on.
    pub(super) sent: Vec<bool>,
    /// Each group's place in the step fill.
    pub(super) started: HashMap<u64, Started>,
}

/// Rows of a batch are keyed (batch << 32) | row.
pub(super) const ROW_BITS: u32 = 32;

impl Generate {
    pub(super) fn admit(
        &mut self,
        ctx: &StepContext,
        batch: RecordBatch,
    ) -> Result<(), StageError> {
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, "generate")?;
        let streams = row_streams(&batch)?;
        let groups = u64s(&batch, col::GROUP_ID, "generate")?;
        let id = self.stream.as_ref().expect("streaming mode").next_batch;
        let requests = self.requests(&batch, prompts, &streams, id << ROW_BITS)?;
        let state = self.stream.as_mut().expect("streaming mode");
        state.next_batch += 1;
        state.streamer.submit(&self.model, requests)?;
        let mut open = HashMap::new();
        let mut started = HashMap::new();
        let version = u64::from(state.streamer.version());
        for g in &groups {
            *open.entry(*g).or_insert(0) += 1;
            started
                .entry(*g)
                .or_insert_with(|| state.fill.start(ctx.step, version));
        }
        let n = batch.num_rows();
        state.batches.insert(
            id,
            InFlight {
                step: ctx.step,
                batch,
                admitted: Instant::now(),
                admitted_unix: now_unix_s(),
                results: vec![None; n],
                open,
                groups,
                sent: vec![false; n],
                started,
            },
        );
        Ok(())
    }

    /// One pass of the pool; returns the rows of every group that ended.
    pub(super) fn advance_stream(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        let state = self.stream.as_mut().expect("streaming mode");
        if state.streamer.live() == 0 {
            if let Some((version, weights)) = state.held.take() {
                self.apply_held(version, &weights)?;
            }
        }
        let state = self.stream.as_mut().expect("streaming mode");
        let finished = state.streamer.advance(&self.model)?;
        let stats = state.streamer.take_stats();
        if let Some(oldest) = state.batches.values().next() {
            let f = state.figures.entry(oldest.step).or_default();
            f.passes += stats.passes;
            f.inflight += stats.inflight;
        }
        for done in finished {
            let (id, row) = (
                done.key >> ROW_BITS,
                (done.key & ((1 << ROW_BITS) - 1)) as usize,
            );
            let b = state
                .batches
                .get_mut(&id)
                .expect("a key names a batch in flight");
            let seconds = b.admitted.elapsed().as_secs_f32();
            b.results[row] = Some((done, seconds));
            let left = b
                .open
                .get_mut(&b.groups[row])
                .expect("the row's group is open");
            *left -= 1;
        }
        let mut out = Vec::new();
        let ids: Vec<u64> = state.batches.keys().copied().collect();
        // Oldest first: batches by arrival, groups by first row.
        for id in ids {
            let state = self.stream.as_mut().expect("streaming mode");
            let b = state.batches.get_mut(&id).expect("listed above");
            let mut placed: BTreeMap<Step, Vec<usize>> = BTreeMap::new();
            let mut decided: HashMap<u64, Option<Step>> = HashMap::new();
            for r in 0..b.sent.len() {
                let g = b.groups[r];
                if b.sent[r] || b.open[&g] > 0 {
                    continue;
                }
                let fill = &mut state.fill;
                let to = *decided
                    .entry(g)
                    .or_insert_with(|| fill.finish(b.started[&g]));
                if let Some(step) = to {
                    placed.entry(step).or_default().push(r);
                }
            }
            for (step, ready) in placed {
                let state = self.stream.as_mut().expect("streaming mode");
                let b = state.batches.get_mut(&id).expect("listed above");
                for &r in &ready {
                    b.sent[r] = true;
                }
                let indices =
                    UInt32Array::from(ready.iter().map(|&r| r as u32).collect::<Vec<_>>());
                let rows = arrow::compute::take_record_batch(&b.batch, &indices)?;
                let picked: Vec<&(Finished, f32)> = ready
                    .iter()
                    .map(|&r| b.results[r].as_ref().expect("a ready row has its result"))
                    .collect();
                let versions: Vec<Vec<u32>> =
                    picked.iter().map(|(f, _)| f.versions.clone()).collect();
                // The rows train at the step they joined.
                let rows = if rows.column_by_name(col::STEP).is_some() {
                    with_column(
                        &rows,
                        col::STEP,
                        Arc::new(UInt64Array::from_value(step, rows.num_rows())) as ArrayRef,
                    )?
                } else {
                    rows
                };
                let figures = state.figures.entry(step).or_default();
                figures.rows += ready.len() as u64;
                figures.partial += versions
                    .iter()
                    .filter(|v| v.iter().min() != v.iter().max())
                    .count() as u64;
                let responses = Responses {
                    generations: picked.iter().map(|(f, _)| &f.generation).collect(),
                    recomputed: picked.iter().map(|(f, _)| f.recomputed.clone()).collect(),
                    versions,
                    version: u64::from(state.streamer.version()),
                    seconds: picked.iter().map(|(_, s)| *s).collect(),
                    started: vec![b.admitted_unix; ready.len()],
                };
                let batch = with_responses(&self.tokenizer, rows, responses)?;
                if b.sent.iter().all(|&s| s) {
                    state.batches.remove(&id);
                }
                out.push((step, batch));
            }
        }
        Ok(out)
    }

    pub(super) fn apply_held(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let started = Instant::now();
        self.apply(version, weights)?;
        let state = self.stream.as_mut().expect("streaming mode");
        state.streamer.weights_changed(version_u32(version)?);
        state.streamer.set_admitting(true);
        state.applies.push(started.elapsed().as_secs_f64());
        Ok(())
    }
}
