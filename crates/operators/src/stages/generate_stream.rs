//! [`StreamingGenerate`], generation as a stream: the pool's state, rows
//! joining it, one pass, the groups that finished and the steps they join.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use arrow::array::{RecordBatch, UInt32Array};
use weir_gpu::{Finished, Streamer};
use weir_graph::weights_edge::now_unix_s;
use weir_graph::{PolicyVersion, StageError, Started, Step, StepContext, StepFill, WeightsPayload};

use weir_gpu::OnNewWeights;
use weir_graph::Stage;

use super::{row_streams, version_u32, with_responses, Generate, Generator, Responses};
use crate::data::columns::{token_lists, trained_at, u64s};
use crate::rollout::col;

/// A generator whose rows join a pool of sequences that all advance one
/// token per pass (continuous batching): a finished sequence's slot goes to
/// the next row at once, and a group's rows leave as soon as its last
/// sample ends, for the step it joins ([`StepFill`]). Made by
/// [`Generate::streamed`]; [`Generate`] samples for it.
pub struct StreamingGenerate {
    pub(super) core: Generate,
    pub(super) state: StreamState,
}

/// The pool and what it has in flight.
pub(super) struct StreamState {
    pub(super) streamer: Streamer,
    /// Which step each finished group joins.
    pub(super) fill: StepFill,
    /// Batches with rows in flight, by arrival.
    pub(super) batches: BTreeMap<u64, InFlight>,
    pub(super) next_batch: u64,
    /// Weights held back until the sequences in flight end (`finish`).
    pub(super) held: Option<(PolicyVersion, WeightsPayload)>,
    /// Per step: rows out, rows spanning versions, and what the passes did.
    pub(super) figures: BTreeMap<Step, StepFigures>,
    /// Seconds of each weights update since the last step ended.
    pub(super) applies: Vec<f64>,
    /// The test hook of [`StreamingGenerate::holding_for_weights_at`].
    pub(super) hold: Hold,
}

/// Where the pool waits for newer weights: at a sequence's `at`-th token
/// (`None`: nowhere), while versions before the run's `last` step can
/// still come, and since when it waits.
pub(super) struct Hold {
    at: Option<usize>,
    last: Option<Step>,
    since: Option<Instant>,
}

impl Hold {
    /// No hold, in a run whose last step is `last`.
    pub(super) fn off(last: Option<Step>) -> Self {
        Hold {
            at: None,
            last,
            since: None,
        }
    }
}

/// How long a hold waits at most: past it, the pool goes on (a run whose
/// weights cannot come while the pool waits does not hang on the hook).
const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// A step's figures: its rows and, for the passes run while it was the
/// oldest step in flight, their count, the sequences in flight over them,
/// the tokens sampled and the sequences prefilled again under new weights.
#[derive(Default)]
pub(super) struct StepFigures {
    pub(super) rows: u64,
    pub(super) partial: u64,
    pub(super) passes: u64,
    pub(super) inflight: u64,
    pub(super) tokens: u64,
    pub(super) recomputed: u64,
}

/// A batch whose rows are being generated.
pub(super) struct InFlight {
    pub(super) step: Step,
    pub(super) batch: RecordBatch,
    pub(super) admitted: Instant,
    pub(super) admitted_unix: f64,
    pub(super) results: Vec<Option<(Finished, f32)>>,
    pub(super) rows: GroupRows,
}

/// A streamed batch's rows by group: which have ended, which have left,
/// and each group's place in the [`StepFill`]. What a streaming stage
/// needs to send whole groups on, oldest first, to the steps they join.
pub(crate) struct GroupRows {
    /// Each row's group.
    groups: Vec<u64>,
    /// Rows of each group not ended yet.
    open: HashMap<u64, usize>,
    /// Rows per group.
    sizes: HashMap<u64, usize>,
    /// Rows already sent on.
    sent: Vec<bool>,
    /// Each group's place in the step fill.
    started: HashMap<u64, Started>,
    /// Per group: its rows whose first token is drawn, and the oldest
    /// version among those tokens.
    first_tokens: HashMap<u64, (usize, u32)>,
}

impl GroupRows {
    /// Rows of `groups` arriving for step `step`, their groups started in
    /// `fill` under policy `version`.
    pub(crate) fn new(groups: Vec<u64>, fill: &mut StepFill, step: Step, version: u64) -> Self {
        let (mut open, mut started) = (HashMap::new(), HashMap::new());
        for g in &groups {
            *open.entry(*g).or_insert(0) += 1;
            started
                .entry(*g)
                .or_insert_with(|| fill.start(step, version));
        }
        GroupRows {
            sent: vec![false; groups.len()],
            sizes: open.clone(),
            open,
            groups,
            started,
            first_tokens: HashMap::new(),
        }
    }

    /// Row `row` drew its first token under `version`: once every row of
    /// its group has, the group's deadline counts from the oldest of those
    /// versions (newer weights give it more time).
    pub(crate) fn first_token(&mut self, row: usize, version: u32, fill: &mut StepFill) {
        let g = self.groups[row];
        let first = self.first_tokens.entry(g).or_insert((0, version));
        first.0 += 1;
        first.1 = first.1.min(version);
        if first.0 == self.sizes[&g] {
            let group = self.started.get_mut(&g).expect("every group started");
            *group = fill.first_tokens_under(*group, u64::from(first.1));
        }
    }

    /// Row `row` ended.
    pub(crate) fn ended(&mut self, row: usize) {
        *self
            .open
            .get_mut(&self.groups[row])
            .expect("the row's group is open") -= 1;
    }

    /// The rows of every group whose rows all ended, by the step each
    /// group joins (in row order), marked sent.
    pub(crate) fn ready(&mut self, fill: &mut StepFill) -> BTreeMap<Step, Vec<usize>> {
        let mut placed: BTreeMap<Step, Vec<usize>> = BTreeMap::new();
        let mut decided: HashMap<u64, Option<Step>> = HashMap::new();
        for r in 0..self.sent.len() {
            let g = self.groups[r];
            if self.sent[r] || self.open[&g] > 0 {
                continue;
            }
            let to = *decided
                .entry(g)
                .or_insert_with(|| fill.finish(self.started[&g]));
            if let Some(step) = to {
                placed.entry(step).or_default().push(r);
            }
        }
        for rows in placed.values() {
            for &r in rows {
                self.sent[r] = true;
            }
        }
        placed
    }

    /// Whether every row was sent on.
    pub(crate) fn all_sent(&self) -> bool {
        self.sent.iter().all(|&s| s)
    }
}

/// Rows of a batch are keyed (batch << 32) | row.
pub(super) const ROW_BITS: u32 = 32;

/// A request's batch and row.
fn split_key(key: u64) -> (u64, usize) {
    (key >> ROW_BITS, (key & ((1 << ROW_BITS) - 1)) as usize)
}

impl StreamingGenerate {
    /// Queues `batch`'s rows (of step `ctx.step`) in the pool.
    fn admit(&mut self, ctx: &StepContext, batch: RecordBatch) -> Result<(), StageError> {
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, ctx.stage())?;
        let streams = row_streams(&batch, ctx.stage())?;
        let groups = u64s(&batch, col::GROUP_ID, ctx.stage())?;
        let id = self.state.next_batch;
        let requests = self
            .core
            .requests(&batch, prompts, &streams, id << ROW_BITS)?;
        let state = &mut self.state;
        state.next_batch += 1;
        state.streamer.submit(&self.core.model, requests)?;
        let version = u64::from(state.streamer.version());
        let rows = GroupRows::new(groups, &mut state.fill, ctx.step, version);
        let n = batch.num_rows();
        state.batches.insert(
            id,
            InFlight {
                step: ctx.step,
                batch,
                admitted: Instant::now(),
                admitted_unix: now_unix_s(),
                results: vec![None; n],
                rows,
            },
        );
        Ok(())
    }

    /// A test hook: the pool stops before a sequence's `tokens`-th token
    /// under the weights it holds until newer weights arrive, so that a swap
    /// lands there whatever the timing (at most [`HOLD_LIMIT`] a time; only
    /// where new weights can arrive between passes: a threaded stage whose
    /// learner needs none of the rows in flight, `keep` or `recompute`).
    pub fn holding_for_weights_at(mut self, tokens: usize) -> Self {
        self.state.hold.at = Some(tokens);
        self
    }

    /// Whether the hook of [`Self::holding_for_weights_at`] holds the pool now.
    fn holding(&mut self) -> bool {
        let (streamer, hold) = (&self.state.streamer, &mut self.state.hold);
        let Some(at) = hold.at else {
            return false;
        };
        // The learner's step v gives version v + 1: none comes after the
        // last, nor while a row of step v is still in the pool.
        let version = u64::from(streamer.version());
        let oldest = self.state.batches.values().map(|b| b.step).min();
        let more = hold.last.is_some_and(|last| version < last)
            && oldest.is_none_or(|step| step > version);
        if !more || streamer.on_new_weights() == OnNewWeights::Finish || !streamer.reached(at) {
            hold.since = None;
            return false;
        }
        hold.since.get_or_insert_with(Instant::now).elapsed() < HOLD_LIMIT
    }

    /// One pass of the pool; returns the rows of every group that ended.
    fn advance_stream(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        if self.state.streamer.live() == 0 {
            if let Some((version, weights)) = self.state.held.take() {
                self.apply_held(version, &weights)?;
            }
        }
        if self.holding() {
            // New weights arrive between two calls.
            std::thread::sleep(std::time::Duration::from_millis(1));
            return Ok(Vec::new());
        }
        let state = &mut self.state;
        let finished = state.streamer.advance(&self.core.model)?;
        // A group's deadline counts from its first tokens, not from when it
        // was queued: those drawn under newer weights give it more time.
        for (key, version) in state.streamer.take_started() {
            let (id, row) = split_key(key);
            let b = state
                .batches
                .get_mut(&id)
                .expect("a key names a batch in flight");
            b.rows.first_token(row, version, &mut state.fill);
        }
        let stats = state.streamer.take_stats();
        if let Some(oldest) = state.batches.values().next() {
            let f = state.figures.entry(oldest.step).or_default();
            f.passes += stats.passes;
            f.inflight += stats.inflight;
            f.tokens += stats.tokens;
            f.recomputed += stats.recomputed;
        }
        for done in finished {
            let (id, row) = split_key(done.key);
            let b = state
                .batches
                .get_mut(&id)
                .expect("a key names a batch in flight");
            let seconds = b.admitted.elapsed().as_secs_f32();
            b.results[row] = Some((done, seconds));
            b.rows.ended(row);
        }
        let mut out = Vec::new();
        let ids: Vec<u64> = state.batches.keys().copied().collect();
        // Oldest first: batches by arrival, groups by first row.
        for id in ids {
            let state = &mut self.state;
            let b = state.batches.get_mut(&id).expect("listed above");
            let placed = b.rows.ready(&mut state.fill);
            for (step, ready) in placed {
                let state = &mut self.state;
                let b = state.batches.get_mut(&id).expect("listed above");
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
                let rows = trained_at(&rows, step)?;
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
                let batch = with_responses(&self.core.tokenizer, rows, responses)?;
                if b.rows.all_sent() {
                    state.batches.remove(&id);
                }
                out.push((step, batch));
            }
        }
        Ok(out)
    }

    /// Applies `weights` (policy `version`) to the model between passes.
    fn apply_held(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let started = Instant::now();
        self.core.apply(version, weights)?;
        let state = &mut self.state;
        state.streamer.weights_changed(version_u32(version)?);
        state.streamer.set_admitting(true);
        state.applies.push(started.elapsed().as_secs_f64());
        Ok(())
    }
}

impl Generator for StreamingGenerate {
    fn generate(&mut self) -> &mut Generate {
        &mut self.core
    }
}

impl Stage for StreamingGenerate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.admit(ctx, batch)?;
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let state = &mut self.state;
        state
            .fill
            .end(ctx.step)
            .map_err(|e| format!("generate: {e}"))?;
        let f = state.figures.remove(&ctx.step).unwrap_or_default();
        if f.rows > 0 {
            ctx.record("partial_ratio", f.partial as f64 / f.rows as f64);
        }
        if f.passes > 0 {
            let mean = f.inflight as f64 / f.passes as f64;
            ctx.record("inflight", mean);
            ctx.record(
                "slot_occupancy",
                mean / state.streamer.max_inflight() as f64,
            );
            ctx.record("passes", f.passes as f64);
            ctx.record("tokens", f.tokens as f64);
        }
        if state.streamer.on_new_weights() == OnNewWeights::Recompute {
            ctx.record("recomputed", f.recomputed as f64);
        }
        for s in state.applies.drain(..) {
            ctx.record("weights_apply_s", s);
        }
        Ok(Vec::new())
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let state = &mut self.state;
        if state.streamer.on_new_weights() == OnNewWeights::Finish && state.streamer.live() > 0 {
            // The sequences in flight finish on the weights they started
            // with; nothing new starts until then.
            state.held = Some((version, weights.clone()));
            state.streamer.set_admitting(false);
            return Ok(());
        }
        state.held = None;
        self.apply_held(version, weights)
    }

    fn policy_version(&self) -> Option<PolicyVersion> {
        // Under `finish`, weights sent while sequences are in flight wait
        // in `held`; the streamer samples with the version it was last given.
        Some(PolicyVersion::from(self.state.streamer.version()))
    }

    fn streaming(&self) -> bool {
        true
    }

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        self.advance_stream()
    }

    fn holds(&self, step: Step) -> bool {
        if step == Step::MAX {
            // Work to do: sequences to run (finished groups waiting for a
            // step to join move only when others start or finish).
            return !self.state.streamer.is_idle();
        }
        self.state.fill.holds(step)
    }

    fn input_ended(&mut self, step: Step) {
        self.state.fill.input_complete(step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::columns::token_list_array;
    use arrow::array::{ArrayRef, UInt64Array};
    use std::sync::Arc;
    use tch::Kind;
    use weir_gpu::{Model, OnNewWeights, SamplingParams, Tokenizer};
    use weir_graph::{RunSteps, Stage, WorkerInfo};

    use crate::stages::generate::Streaming;

    /// A streaming generator on the tiny Llama: a pool of `pool`, bound k = 1,
    /// four tokens a response, and the weights it holds as version 1.
    fn generator(pool: usize, policy: OnNewWeights) -> (StreamingGenerate, WeightsPayload) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama");
        let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        let newer = WeightsPayload::from(model.export_snapshot(1).unwrap());
        let params = SamplingParams {
            max_new_tokens: 4,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let generate = Generate::new(model, Tokenizer::load(&dir).unwrap(), params)
            .streamed(
                Streaming {
                    max_inflight: pool,
                    on_new_weights: policy,
                },
                RunSteps {
                    last: Some(10),
                    max_staleness: 1,
                    ..RunSteps::default()
                },
                0,
            )
            .unwrap();
        (generate, newer)
    }

    /// `groups` groups of one row each, of input step 0.
    fn rows(groups: u64) -> RecordBatch {
        let prompts: Vec<Vec<i64>> = (0..groups).map(|g| vec![1, 2 + g as i64]).collect();
        RecordBatch::try_from_iter([
            (col::PROMPT_TOKENS, token_list_array(&prompts)),
            (
                col::GROUP_ID,
                Arc::new(UInt64Array::from_iter_values(0..groups)) as ArrayRef,
            ),
            (
                col::SAMPLE_IDX,
                Arc::new(UInt32Array::from(vec![0u32; groups as usize])) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    /// The metrics recorded in `ctx`, by name.
    fn recorded(ctx: &StepContext) -> BTreeMap<&str, f64> {
        ctx.recorded()
            .iter()
            .map(|(n, v)| (n.as_str(), *v))
            .collect()
    }

    fn deadlines(generate: &StreamingGenerate) -> Vec<Step> {
        let state = &generate.state;
        let b = state.batches.values().next().unwrap();
        (0..b.rows.groups.len() as u64)
            .map(|g| b.rows.started[&g].deadline)
            .collect()
    }

    #[test]
    fn held_weights_are_not_named_until_applied_and_every_pass_is_counted() {
        let (mut generate, newer) = generator(2, OnNewWeights::Finish);
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        assert!(generate.process(&mut ctx, rows(2)).unwrap().is_empty());
        generate.advance().unwrap();
        // Under `finish` the new weights wait for the two sequences in flight.
        generate.load_weights(1, &newer).unwrap();
        assert_eq!(generate.policy_version(), Some(0), "held, not loaded");
        let mut out = Vec::new();
        while generate.holds(Step::MAX) {
            out.extend(generate.advance().unwrap());
        }
        assert_eq!(generate.policy_version(), Some(0));
        // The next pass applies them.
        generate.advance().unwrap();
        assert_eq!(generate.policy_version(), Some(1));
        let rows: usize = out.iter().map(|(_, b)| b.num_rows()).sum();
        assert_eq!(rows, 2);
        generate.end_step(&mut ctx).unwrap();
        let recorded = recorded(&ctx);
        assert_eq!(recorded["passes"], 4.0, "{recorded:?}");
        assert_eq!(recorded["tokens"], 8.0, "{recorded:?}");
        assert!(!recorded.contains_key("recomputed"), "only under recompute");
    }

    #[test]
    fn a_queued_group_is_due_from_its_first_token_and_recomputes_are_counted() {
        // One slot, three groups: under `recompute`, version 1 arrives after
        // the first pass, so group 0 is prefilled again and groups 1 and 2
        // draw their first tokens under version 1.
        let (mut generate, newer) = generator(1, OnNewWeights::Recompute);
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        generate.process(&mut ctx, rows(3)).unwrap();
        generate.input_ended(0);
        assert_eq!(deadlines(&generate), [1, 1, 1], "v0 + k while queued");
        generate.advance().unwrap();
        generate.load_weights(1, &newer).unwrap();
        assert_eq!(generate.policy_version(), Some(1));
        let mut out = Vec::new();
        // Until group 2 is under way (group 0 has ended by then).
        while generate.state.streamer.waiting() > 0 {
            out.extend(generate.advance().unwrap());
        }
        generate.advance().unwrap();
        assert_eq!(deadlines(&generate), [1, 2, 2]);
        while generate.holds(Step::MAX) {
            out.extend(generate.advance().unwrap());
        }
        generate.end_step(&mut ctx).unwrap();
        let recorded = recorded(&ctx);
        assert_eq!(recorded["recomputed"], 1.0, "{recorded:?}");
        assert_eq!(recorded["tokens"], 12.0, "{recorded:?}");
    }
}
