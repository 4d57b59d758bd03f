//! Synthetic stages: they sleep for a configurable cost and emit real rows.
//!
//! They exercise the engine exactly as model stages will (same traits, same
//! columns the engine stamps, real weights payloads on the weights edge)
//! without any model, so the engine's guarantees can be tested and its
//! overhead measured on their own. `engine_sim`, the property tests and the
//! benchmarks use them.
//!
//! Rows carry `step`, `row_id` (unique in the run), `group_id`; the generator
//! adds `response_len`, `gen_start_ns`, `gen_end_ns` and the engine adds
//! `policy_version`; the scorer adds `reward`; the advantage stage adds
//! `advantage` (reward minus its group's mean, so it needs whole groups); the
//! learner adds `learn_start_ns`, `learn_end_ns` and the engine adds
//! `learner_version` and `staleness`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{ArrayRef, AsArray, Float32Array, RecordBatch, UInt32Array, UInt64Array};

use arrow::datatypes::{Float32Type, UInt64Type};

use crate::batch::{u64_column, with_column};
use crate::stage::{Source, SourceContext, Stage, StepBuffer, StepContext, StepStage};
use crate::step_fill::{Started, StepFill};
use crate::weights_edge::{now_ns, WeightsPayload};
use crate::{PolicyVersion, StageError, Step};

/// A stage's cost: a base sleep plus a seeded random jitter per call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Sleep this long on every call.
    pub base: Duration,
    /// Plus a pseudo-random extra in `0..=jitter`, fixed by (`seed`, step, call).
    pub jitter: Duration,
    /// Seed of the jitter.
    pub seed: u64,
}

impl Cost {
    /// A fixed cost of `ms` milliseconds.
    pub fn millis(ms: u64) -> Self {
        Cost {
            base: Duration::from_millis(ms),
            jitter: Duration::ZERO,
            seed: 0,
        }
    }

    /// Sleeps for this cost on the `call`-th call of `step`.
    fn pay(&self, step: u64, call: u64) {
        let mut d = self.base;
        if !self.jitter.is_zero() {
            let r = mix(self.seed ^ mix(step.wrapping_mul(0x9e37_79b9) ^ call));
            d += Duration::from_nanos(r % (self.jitter.as_nanos() as u64 + 1));
        }
        if !d.is_zero() {
            std::thread::sleep(d);
        }
    }
}

/// splitmix64: a tiny, good, deterministic mixer.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Emits `rows` rows per step (split over the source role's workers by
/// group), in groups of `group_size` consecutive row ids.
#[derive(Clone, Debug)]
pub struct SyntheticPrompts {
    rows: u64,
    group_size: u64,
    rank: u64,
    role_size: u64,
}

impl SyntheticPrompts {
    /// `rows` rows a step, groups of 4.
    pub fn new(rows: u64) -> Self {
        SyntheticPrompts {
            rows,
            group_size: 4,
            rank: 0,
            role_size: 1,
        }
    }

    /// Groups of `size` rows sharing a `group_id`.
    pub fn group_size(mut self, size: u64) -> Self {
        self.group_size = size.max(1);
        self
    }

    /// This instance's share when the source role has `size` workers.
    pub fn shard(mut self, rank: usize, size: usize) -> Self {
        self.rank = rank as u64;
        self.role_size = size.max(1) as u64;
        self
    }
}

impl Source for SyntheticPrompts {
    fn next_step(&mut self, ctx: &SourceContext) -> Result<Option<Vec<RecordBatch>>, StageError> {
        // A group stays on one worker, as a prompt's samples do.
        let ids: Vec<u64> = (0..self.rows)
            .filter(|i| (i / self.group_size) % self.role_size == self.rank)
            .map(|i| ctx.step * self.rows + i)
            .collect();
        let groups: Vec<u64> = ids.iter().map(|id| id / self.group_size).collect();
        let batch = RecordBatch::try_from_iter([
            (
                "step",
                Arc::new(UInt64Array::from_value(ctx.step, ids.len())) as ArrayRef,
            ),
            ("row_id", Arc::new(UInt64Array::from(ids)) as ArrayRef),
            ("group_id", Arc::new(UInt64Array::from(groups)) as ArrayRef),
        ])?;
        Ok(Some(vec![batch]))
    }
}

/// The payload a synthetic learner publishes for `version`: `bytes` bytes
/// that encode the version, so a generator can check what it received.
pub fn weights_for(version: PolicyVersion, bytes: usize) -> WeightsPayload {
    let mut payload = vec![0u8; bytes.max(8)];
    payload[..8].copy_from_slice(&version.to_le_bytes());
    for (i, b) in payload.iter_mut().enumerate().skip(8) {
        *b = (mix(version ^ i as u64) & 0xff) as u8;
    }
    WeightsPayload::from(payload)
}

/// A generator: sleeps `cost` per batch, adds a deterministic `response_len`.
#[derive(Clone, Debug, Default)]
pub struct SyntheticGenerate {
    /// Cost of one batch.
    pub cost: Cost,
    calls: u64,
    loaded: PolicyVersion,
    /// The version the engine said no later step may use
    /// ([`StepContext::weights_retired`]): a real generator frees it.
    retired: Option<PolicyVersion>,
}

impl SyntheticGenerate {
    /// A generator with cost `cost`.
    pub fn new(cost: Cost) -> Self {
        SyntheticGenerate {
            cost,
            calls: 0,
            loaded: 0,
            retired: None,
        }
    }
}

impl Stage for SyntheticGenerate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        if ctx.version != self.loaded {
            return Err(format!(
                "engine says version {} but the stage loaded {}",
                ctx.version, self.loaded
            )
            .into());
        }
        if self.retired == Some(self.loaded) {
            return Err(format!(
                "step {} runs on version {}, which the engine said no later step would use",
                ctx.step, self.loaded
            )
            .into());
        }
        let start = now_ns();
        self.cost.pay(ctx.step, self.calls);
        self.calls += 1;
        let ids = u64_column(&batch, "row_id", "generate")?;
        let lens: UInt32Array = ids
            .values()
            .iter()
            .map(|id| 1 + (mix(*id) % 64) as u32)
            .collect();
        let n = batch.num_rows();
        let batch = with_column(&batch, "response_len", Arc::new(lens))?;
        let batch = with_column(
            &batch,
            "gen_start_ns",
            Arc::new(UInt64Array::from_value(start, n)),
        )?;
        let batch = with_column(
            &batch,
            "gen_end_ns",
            Arc::new(UInt64Array::from_value(now_ns(), n)),
        )?;
        Ok(vec![batch])
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let expected = weights_for(version, weights.len());
        if *weights != expected {
            return Err(format!("weights payload of version {version} is corrupt").into());
        }
        self.loaded = version;
        Ok(())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        if ctx.weights_retired() {
            self.retired = Some(self.loaded);
            ctx.record("weights_retired", 1.0);
        }
        Ok(Vec::new())
    }
}

/// A streaming generator (continuous batching without a model): a pool of
/// `slots` sequences; each [`Stage::advance`] is one decode pass that
/// sleeps `cost` and gives every sequence in the pool one token under the
/// version it holds (new weights apply between passes, over the sequences
/// in flight, as `on_new_weights = "keep"` does). A row's length is
/// `1 + 2^(id mod 7)` tokens (2 to 65, a long tail); a group's rows leave
/// together when its last ends, at the step a [`StepFill`] gives it. Rows
/// get `response_len`, `gen_start_ns`, `gen_end_ns`, `token_versions`
/// (list<u32>) and `policy_version` (the oldest token's version), and
/// `step` becomes the step they train at.
pub struct SyntheticStreamingGenerate {
    cost: Cost,
    slots: usize,
    loaded: PolicyVersion,
    passes: u64,
    fill: StepFill,
    /// Rows waiting for a slot, then rows in the pool.
    queue: std::collections::VecDeque<SyntheticSequence>,
    pool: Vec<SyntheticSequence>,
    /// Groups in flight, by (arrival, group id): their rows' batch and results.
    groups: std::collections::BTreeMap<(u64, u64), SyntheticGroup>,
    arrivals: u64,
}

struct SyntheticSequence {
    group: (u64, u64),
    row: usize,
    length: u32,
    versions: Vec<u32>,
}

struct SyntheticGroup {
    rows: RecordBatch,
    started: Started,
    start_ns: u64,
    versions: Vec<Option<Vec<u32>>>,
}

impl SyntheticStreamingGenerate {
    /// `slots` sequences in flight, `cost` per pass, staleness bound `max_staleness`.
    pub fn new(cost: Cost, slots: usize, max_staleness: u64) -> Self {
        SyntheticStreamingGenerate {
            cost,
            slots: slots.max(1),
            loaded: 0,
            passes: 0,
            fill: StepFill::new(max_staleness, |_| None),
            queue: Default::default(),
            pool: Vec::new(),
            groups: Default::default(),
            arrivals: 0,
        }
    }

    /// The rows of every group that has finished and found its step.
    fn placed(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        let done: Vec<(u64, u64)> = self
            .groups
            .iter()
            .filter(|(_, g)| g.versions.iter().all(Option::is_some))
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::new();
        for key in done {
            let Some(step) = self.fill.finish(self.groups[&key].started) else {
                continue;
            };
            let g = self.groups.remove(&key).expect("listed above");
            let versions: Vec<Vec<u32>> = g.versions.into_iter().flatten().collect();
            let n = g.rows.num_rows();
            let oldest: UInt64Array = versions
                .iter()
                .map(|v| u64::from(*v.iter().min().expect("every row has a token")))
                .collect();
            let lens: UInt32Array = versions.iter().map(|v| v.len() as u32).collect();
            let mut list = arrow::array::ListBuilder::new(arrow::array::UInt32Builder::new());
            for v in &versions {
                list.values().append_slice(v);
                list.append(true);
            }
            let mut batch =
                with_column(&g.rows, "step", Arc::new(UInt64Array::from_value(step, n)))?;
            for (name, column) in [
                ("response_len", Arc::new(lens) as ArrayRef),
                (
                    "gen_start_ns",
                    Arc::new(UInt64Array::from_value(g.start_ns, n)),
                ),
                ("gen_end_ns", Arc::new(UInt64Array::from_value(now_ns(), n))),
                ("token_versions", Arc::new(list.finish())),
                ("policy_version", Arc::new(oldest)),
            ] {
                batch = with_column(&batch, name, column)?;
            }
            out.push((step, batch));
        }
        Ok(out)
    }
}

impl Stage for SyntheticStreamingGenerate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let ids = u64_column(&batch, "row_id", "generate")?.clone();
        let groups = u64_column(&batch, "group_id", "generate")?.clone();
        let mut seen: Vec<u64> = Vec::new();
        for &g in groups.values() {
            if !seen.contains(&g) {
                seen.push(g);
            }
        }
        for g in seen {
            let rows: Vec<u32> = (0..batch.num_rows() as u32)
                .filter(|&i| groups.value(i as usize) == g)
                .collect();
            let key = (self.arrivals, g);
            let taken =
                arrow::compute::take_record_batch(&batch, &UInt32Array::from(rows.clone()))?;
            for (row, &i) in rows.iter().enumerate() {
                let id = ids.value(i as usize);
                self.queue.push_back(SyntheticSequence {
                    group: key,
                    row,
                    length: 1 + (1 << (mix(id) % 7)) as u32,
                    versions: Vec::new(),
                });
            }
            self.groups.insert(
                key,
                SyntheticGroup {
                    rows: taken,
                    started: self.fill.start(ctx.step, self.loaded),
                    start_ns: now_ns(),
                    versions: vec![None; rows.len()],
                },
            );
        }
        self.arrivals += 1;
        Ok(Vec::new())
    }

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        while self.pool.len() < self.slots {
            let Some(seq) = self.queue.pop_front() else {
                break;
            };
            self.pool.push(seq);
        }
        if !self.pool.is_empty() {
            self.cost.pay(self.passes, 0);
            self.passes += 1;
            let version = u32::try_from(self.loaded).map_err(|_| "version exceeds u32")?;
            for seq in &mut self.pool {
                seq.versions.push(version);
            }
            let (done, live): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pool)
                .into_iter()
                .partition(|s| s.versions.len() as u32 >= s.length);
            self.pool = live;
            for seq in done {
                let g = self
                    .groups
                    .get_mut(&seq.group)
                    .expect("a sequence's group is in flight");
                g.versions[seq.row] = Some(seq.versions);
            }
        }
        self.placed()
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        if *weights != weights_for(version, weights.len()) {
            return Err(format!("weights payload of version {version} is corrupt").into());
        }
        self.loaded = version;
        Ok(())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        self.fill.end(ctx.step)?;
        Ok(Vec::new())
    }

    fn streaming(&self) -> bool {
        true
    }

    fn holds(&self, step: Step) -> bool {
        if step == Step::MAX {
            return !self.pool.is_empty() || !self.queue.is_empty();
        }
        self.fill.holds(step)
    }

    fn input_ended(&mut self, step: Step) {
        self.fill.input_complete(step);
    }
}

/// A scorer: sleeps `cost` per batch, adds a deterministic `reward` in [0, 1).
#[derive(Clone, Debug, Default)]
pub struct SyntheticScore {
    /// Cost of one batch.
    pub cost: Cost,
    /// Fail on the first batch of this step (to test failure handling).
    pub fail_at: Option<u64>,
    calls: u64,
}

impl SyntheticScore {
    /// A scorer with cost `cost`.
    pub fn new(cost: Cost) -> Self {
        SyntheticScore {
            cost,
            fail_at: None,
            calls: 0,
        }
    }

    /// Makes the scorer fail at `step`.
    pub fn fail_at(mut self, step: Option<u64>) -> Self {
        self.fail_at = step;
        self
    }
}

impl Stage for SyntheticScore {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        if self.fail_at == Some(ctx.step) {
            return Err(format!("injected failure at step {}", ctx.step).into());
        }
        self.cost.pay(ctx.step, self.calls);
        self.calls += 1;
        let ids = u64_column(&batch, "row_id", "score")?;
        let rewards: Float32Array = ids
            .values()
            .iter()
            .map(|id| (mix(id ^ 0x5eed) % 1000) as f32 / 1000.0)
            .collect();
        Ok(vec![with_column(&batch, "reward", Arc::new(rewards))?])
    }
}

/// Group-relative advantages: reward minus the mean reward of its
/// `group_id`, computed when the step ends (a group may arrive in pieces).
/// Fails if a group's rows are split over workers, which a `ByKey("group_id")` edge prevents.
#[derive(Debug, Default)]
pub struct SyntheticAdvantage {
    held: StepBuffer,
    group_size: u64,
}

impl SyntheticAdvantage {
    /// Expects groups of `group_size` rows.
    pub fn new(group_size: u64) -> Self {
        SyntheticAdvantage {
            held: StepBuffer::new(),
            group_size,
        }
    }
}

impl StepStage for SyntheticAdvantage {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        _ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let Some(batch) = rows else {
            return Ok(Vec::new());
        };
        let groups = batch
            .column_by_name("group_id")
            .ok_or("advantage: missing group_id")?
            .as_primitive::<UInt64Type>();
        let rewards = batch
            .column_by_name("reward")
            .ok_or("advantage: missing reward")?
            .as_primitive::<Float32Type>();
        // Sums in f64 are exact for these rewards, so the result does not
        // depend on the order in which a group's rows arrived.
        let mut sums: HashMap<u64, (f64, u64)> = HashMap::new();
        for i in 0..batch.num_rows() {
            let e = sums.entry(groups.value(i)).or_insert((0.0, 0));
            e.0 += f64::from(rewards.value(i));
            e.1 += 1;
        }
        if let Some((g, (_, n))) = sums.iter().find(|(_, (_, n))| *n != self.group_size) {
            return Err(format!(
                "group {g} has {n} rows here, expected {}: a group was split",
                self.group_size
            )
            .into());
        }
        let adv: Float32Array = (0..batch.num_rows())
            .map(|i| {
                let (sum, n) = sums[&groups.value(i)];
                (f64::from(rewards.value(i)) - sum / n as f64) as f32
            })
            .collect();
        Ok(vec![with_column(
            &batch,
            "advantage",
            Arc::new(adv) as ArrayRef,
        )?])
    }
}

/// A learner: holds the step's rows, sleeps `cost` at the end of the step,
/// stamps `learn_start_ns`/`learn_end_ns`, publishes a `weights_bytes` payload.
#[derive(Clone, Debug)]
pub struct SyntheticLearn {
    /// Cost of one update.
    pub cost: Cost,
    /// Size of the published weights.
    pub weights_bytes: usize,
    held: Vec<RecordBatch>,
}

impl Default for SyntheticLearn {
    fn default() -> Self {
        SyntheticLearn::new(Cost::default(), 64)
    }
}

impl SyntheticLearn {
    /// A learner with cost `cost` publishing `weights_bytes` bytes per update.
    pub fn new(cost: Cost, weights_bytes: usize) -> Self {
        SyntheticLearn {
            cost,
            weights_bytes,
            held: Vec::new(),
        }
    }
}

impl Stage for SyntheticLearn {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.held.push(batch);
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let start = now_ns();
        self.cost.pay(ctx.step, 0);
        let end = now_ns();
        ctx.publish_weights(weights_for(ctx.version + 1, self.weights_bytes))?;
        let mut out = Vec::with_capacity(self.held.len());
        for batch in self.held.drain(..) {
            let n = batch.num_rows();
            let batch = with_column(
                &batch,
                "learn_start_ns",
                Arc::new(UInt64Array::from_value(start, n)),
            )?;
            out.push(with_column(
                &batch,
                "learn_end_ns",
                Arc::new(UInt64Array::from_value(end, n)),
            )?);
        }
        Ok(out)
    }
}
