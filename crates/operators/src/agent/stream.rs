//! [`StreamingEpisodes`], episodes as a stream: a pool of sequences that
//! outlives batches and steps ([`EpisodePool`]), episodes joining it as
//! their rows arrive and leaving it when they end, their groups leaving
//! for the step they join ([`StepFill`]) as soon as their last episode
//! ends. New weights reach the pool between two passes, as in the
//! streaming generator (`generate.on_new_weights`): an episode waiting on
//! a call comes back to weights newer than its earlier turns', and each
//! token's version is recorded (`token_versions`; the row's
//! `policy_version` is its oldest token's), so the staleness bound holds
//! for episodes that span versions. `kv_recomputed` says of each token
//! whether its context was computed under its own version: a turn that
//! rejoins the pool has its whole context prefilled again.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use arrow::array::{RecordBatch, UInt32Array};
use weir_gpu::OnNewWeights;
use weir_graph::batch::with_column;
use weir_graph::weights_edge::now_unix_s;
use weir_graph::{
    PolicyVersion, RunSteps, Stage, StageError, Step, StepContext, StepFill, WeightsPayload,
};

use super::episode::{Episode, EpisodeError};
use super::pool::{EpisodePool, PoolSettings};
use super::stage::{episode_metrics, EpisodeGenerate};
use crate::data::columns::{bool_list_array, trained_at, u32_list_array, u64s};
use crate::rollout::col;
use crate::stages::generate::{version_u32, GroupRows, Streaming};

/// Rows of a batch are keyed (batch << 32) | row.
const ROW_BITS: u32 = 32;

fn split_key(key: u64) -> (u64, usize) {
    (key >> ROW_BITS, (key & ((1 << ROW_BITS) - 1)) as usize)
}

/// An error the pool names by key, named by the row of its batch instead.
fn row_of_key(error: EpisodeError) -> EpisodeError {
    match error {
        EpisodeError::InRow { row, error } => EpisodeError::InRow {
            row: split_key(row as u64).1,
            error,
        },
        other => other,
    }
}

/// The episode generator as a stream (`generate.max_inflight` with `[agent]`).
pub struct StreamingEpisodes {
    core: EpisodeGenerate,
    pool: EpisodePool,
    fill: StepFill,
    /// Batches with episodes under way, by arrival.
    batches: BTreeMap<u64, InFlight>,
    next_batch: u64,
    /// Weights held back until the sequences in flight end (`finish`).
    held: Option<(PolicyVersion, WeightsPayload)>,
    /// Per step: the episodes that left for it (for its metrics).
    emitted: BTreeMap<Step, Vec<Episode>>,
    /// Seconds of each weights update since the last step ended.
    applies: Vec<f64>,
}

/// An ended episode, its tokens' versions and recomputed contexts, and
/// the seconds since its batch arrived.
struct Ended {
    episode: Episode,
    versions: Vec<u32>,
    recomputed: Vec<bool>,
    seconds: f32,
}

/// A batch whose episodes are under way.
struct InFlight {
    batch: RecordBatch,
    admitted: Instant,
    admitted_unix: f64,
    /// Each row's episode, once ended.
    results: Vec<Option<Ended>>,
    rows: GroupRows,
}

impl EpisodeGenerate {
    /// This generator as a stream: a pool of `settings.max_inflight`
    /// sequences across batches and steps, new weights reaching it as
    /// `settings.on_new_weights` says, groups filling the steps of `steps`.
    pub fn streamed(
        self,
        settings: Streaming,
        steps: RunSteps,
        version: PolicyVersion,
    ) -> Result<StreamingEpisodes, StageError> {
        let Streaming {
            max_inflight,
            on_new_weights,
        } = settings;
        let version = version_u32(version)?;
        let mut core = self;
        let pool_settings = PoolSettings {
            max_concurrency: core.max_concurrency,
            call_deadline: core.call_deadline,
            schedule: core.schedule,
            backend: core.backend,
        };
        let pool = EpisodePool::new(
            &core.model,
            &core.params,
            max_inflight,
            (on_new_weights, version),
            core.tools.clone(),
            std::mem::take(&mut core.environments),
            pool_settings,
        )?;
        Ok(StreamingEpisodes {
            core,
            pool,
            fill: StepFill::for_run(steps),
            batches: BTreeMap::new(),
            next_batch: 0,
            held: None,
            emitted: BTreeMap::new(),
            applies: Vec::new(),
        })
    }
}

impl StreamingEpisodes {
    /// Queues `batch`'s episodes (of step `ctx.step`) in the pool.
    fn admit(&mut self, ctx: &StepContext, batch: RecordBatch) -> Result<(), StageError> {
        let (batch, inputs) = self.core.inputs(ctx.stage(), batch)?;
        let groups = u64s(&batch, col::GROUP_ID, ctx.stage())?;
        let id = self.next_batch;
        self.next_batch += 1;
        let runner = self.core.runner();
        for (row, input) in inputs.into_iter().enumerate() {
            self.pool
                .add(
                    &runner,
                    &self.core.model,
                    id << ROW_BITS | row as u64,
                    input,
                )
                .map_err(row_of_key)?;
        }
        let version = u64::from(self.pool.streamer().version());
        let rows = GroupRows::new(groups, &mut self.fill, ctx.step, version);
        let n = batch.num_rows();
        self.batches.insert(
            id,
            InFlight {
                batch,
                admitted: Instant::now(),
                admitted_unix: now_unix_s(),
                results: (0..n).map(|_| None).collect(),
                rows,
            },
        );
        Ok(())
    }

    /// One pass of the pool; the rows of every group that ended.
    fn advance_stream(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        if !self.pool.decoding() {
            if let Some((version, weights)) = self.held.take() {
                self.apply(version, &weights)?;
            }
        }
        let runner = self.core.runner();
        let ended = self
            .pool
            .tick(&runner, &self.core.model, Duration::from_millis(5))
            .map_err(row_of_key)?;
        // A group's deadline counts from its first tokens.
        for (key, version) in self.pool.take_started() {
            let (id, row) = split_key(key);
            let b = self
                .batches
                .get_mut(&id)
                .expect("a key names a batch in flight");
            b.rows.first_token(row, version, &mut self.fill);
        }
        for key in ended {
            let (id, row) = split_key(key);
            let (episode, versions, recomputed) =
                self.pool.take(key).expect("an ended episode is there");
            let b = self
                .batches
                .get_mut(&id)
                .expect("a key names a batch in flight");
            let seconds = b.admitted.elapsed().as_secs_f32();
            b.results[row] = Some(Ended {
                episode,
                versions,
                recomputed,
                seconds,
            });
            b.rows.ended(row);
        }
        self.ready()
    }

    /// The rows of every group whose episodes all ended, for the steps they join.
    fn ready(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        let mut out = Vec::new();
        let ids: Vec<u64> = self.batches.keys().copied().collect();
        for id in ids {
            let b = self.batches.get_mut(&id).expect("listed above");
            let placed = b.rows.ready(&mut self.fill);
            for (step, rows) in placed {
                let b = self.batches.get_mut(&id).expect("listed above");
                let indices = UInt32Array::from(rows.iter().map(|&r| r as u32).collect::<Vec<_>>());
                let picked = arrow::compute::take_record_batch(&b.batch, &indices)?;
                let picked = trained_at(&picked, step)?;
                let mut episodes = Vec::with_capacity(rows.len());
                let (mut versions, mut recomputed, mut seconds) =
                    (Vec::new(), Vec::new(), Vec::new());
                for &r in &rows {
                    let ended = b.results[r].take().expect("a ready row has its result");
                    episodes.push(ended.episode);
                    versions.push(ended.versions);
                    recomputed.push(ended.recomputed);
                    seconds.push(ended.seconds);
                }
                let started = vec![b.admitted_unix; rows.len()];
                if b.rows.all_sent() {
                    self.batches.remove(&id);
                }
                let current = self.pool.streamer().version();
                let oldest: Vec<u64> = versions
                    .iter()
                    .map(|v| u64::from(v.iter().copied().min().unwrap_or(current)))
                    .collect();
                let batch = self
                    .core
                    .with_episodes(picked, &episodes, oldest, seconds, started)?;
                let batch = with_column(&batch, col::TOKEN_VERSIONS, u32_list_array(&versions))?;
                let batch = with_column(&batch, col::KV_RECOMPUTED, bool_list_array(&recomputed))?;
                self.emitted.entry(step).or_default().extend(episodes);
                out.push((step, batch));
            }
        }
        Ok(out)
    }

    /// Applies `weights` (policy `version`) between passes.
    fn apply(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let started = Instant::now();
        crate::stages::generate::apply_snapshot(&mut self.core.model, version, weights)?;
        let version = u32::try_from(version)
            .map_err(|_| format!("generate: policy version {version} exceeds u32"))?;
        let streamer = self.pool.streamer();
        streamer.weights_changed(version);
        streamer.set_admitting(true);
        self.applies.push(started.elapsed().as_secs_f64());
        Ok(())
    }
}

impl Stage for StreamingEpisodes {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.admit(ctx, batch)?;
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        self.fill
            .end(ctx.step)
            .map_err(|e| format!("generate: {e}"))?;
        let episodes = self.emitted.remove(&ctx.step).unwrap_or_default();
        for (name, value) in episode_metrics(&episodes) {
            ctx.record(name, value);
        }
        for s in self.applies.drain(..) {
            ctx.record("weights_apply_s", s);
        }
        Ok(Vec::new())
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let streamer = self.pool.streamer();
        if streamer.on_new_weights() == OnNewWeights::Finish && self.pool.decoding() {
            // The sequences in flight finish on the weights they started
            // with; no new one starts until then.
            self.held = Some((version, weights.clone()));
            self.pool.streamer().set_admitting(false);
            return Ok(());
        }
        self.held = None;
        self.apply(version, weights)
    }

    fn policy_version(&self) -> Option<PolicyVersion> {
        Some(PolicyVersion::from(self.pool.version()))
    }

    fn streaming(&self) -> bool {
        true
    }

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        self.advance_stream()
    }

    fn holds(&self, step: Step) -> bool {
        if step == Step::MAX {
            // Work to do: sequences to run, calls out, episodes to start.
            return self.pool.busy();
        }
        self.fill.holds(step)
    }

    fn input_ended(&mut self, step: Step) {
        self.fill.input_complete(step);
    }
}
