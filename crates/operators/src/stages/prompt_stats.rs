//! Per-prompt statistics across epochs, maintained incrementally with
//! differential dataflow, and read back as a versioned view.
//!
//! [`PromptStats`] is a pass-through stage after the reward: every scored
//! row becomes an update `(prompt_id, reward)` at time = step in a small
//! differential dataflow of its own (one timely worker per stage instance,
//! stepped by the stage), whose `reduce` keeps, per prompt, the sample count,
//! the solve count and the reward sums. Only prompts touched by a step are
//! recomputed. The reduce's output changes land in a [`StatsView`], a
//! handle shared within the process that answers "the stats as of step t".
//!
//! Route the stage by `prompt_id` so every prompt's rows meet on one
//! instance (that also keeps groups whole for the stages after it). The
//! view is per process: in a multi-process run a process sees the prompts
//! its own instances scored.
//!
//! A checkpoint keeps each instance's prompts — their stats as of the
//! checkpoint's step and the view's entries a resumed curriculum still
//! reads (`prompt_stats/worker-N.json` in the checkpoint folder) — and a
//! resumed instance seeds its dataflow and the view with the prompts its
//! rank receives, so the resumed run skips what the straight run skips.
//!
//! The view serves as a filter or a curriculum: [`Curriculum`] tells the
//! prompt source to skip prompts that are already mastered or never
//! solved, reading the stats as of a step that every worker has finished
//! (`step − max_staleness − 1`), so all source workers decide alike.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use differential_dataflow::input::{Input, InputSession};
use timely::communication::allocator::thread::Thread;
use timely::communication::allocator::Allocator;
use timely::dataflow::ProbeHandle;
use timely::worker::Worker;
use weir_graph::{StageError, StepBuffer, StepContext, StepStage, WorkerInfo};

use crate::checkpoint::Checkpointer;
use crate::data::columns::{scores, u64s};
use crate::error::OperatorError;
use crate::rollout::col;

/// Rewards enter the dataflow as integers in these units (exact sums, an `Ord` value).
const REWARD_SCALE: f64 = 1e6;

/// One prompt's statistics over every sample scored so far.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct PromptStat {
    /// Samples scored.
    pub samples: u64,
    /// Samples whose reward reached the solve threshold.
    pub solved: u64,
    /// Σ reward, in millionths.
    reward_sum: i64,
    /// Σ reward², in millionths squared.
    reward_sq_sum: i128,
}

impl PromptStat {
    /// `solved / samples`.
    pub fn solve_rate(&self) -> f64 {
        self.solved as f64 / self.samples.max(1) as f64
    }

    /// Mean reward.
    pub fn mean(&self) -> f64 {
        self.reward_sum as f64 / REWARD_SCALE / self.samples.max(1) as f64
    }

    /// Population variance of the reward.
    pub fn variance(&self) -> f64 {
        let n = self.samples.max(1) as f64;
        let mean = self.reward_sum as f64 / n;
        ((self.reward_sq_sum as f64 / n - mean * mean) / (REWARD_SCALE * REWARD_SCALE)).max(0.0)
    }
}

impl PromptStat {
    /// `[samples, solved, reward_sum, reward_sq_sum]`, the last as text (an i128).
    fn to_json(self) -> serde_json::Value {
        serde_json::json!([
            self.samples,
            self.solved,
            self.reward_sum,
            self.reward_sq_sum.to_string()
        ])
    }

    fn from_json(v: &serde_json::Value) -> Option<Self> {
        Some(PromptStat {
            samples: v.get(0)?.as_u64()?,
            solved: v.get(1)?.as_u64()?,
            reward_sum: v.get(2)?.as_i64()?,
            reward_sq_sum: v.get(3)?.as_str()?.parse().ok()?,
        })
    }
}

/// What one prompt contributes to the dataflow: a scored sample, or (on a
/// resume) its stats as of the checkpoint.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
enum Entry {
    /// A sample's reward, in millionths.
    Reward(i64),
    /// Stats carried over from a checkpoint.
    Seed(PromptStat),
}

/// Per-prompt stats by step, shared between the stats stages and the prompt sources of a process.
#[derive(Clone, Debug, Default)]
pub struct StatsView {
    inner: Arc<Mutex<ViewInner>>,
}

#[derive(Debug, Default)]
struct ViewInner {
    /// For each prompt, its stats from each step at which they changed.
    history: HashMap<u64, BTreeMap<u64, PromptStat>>,
}

impl StatsView {
    /// A new, empty view.
    pub fn new() -> Self {
        StatsView::default()
    }

    /// `prompt`'s stats counting the samples of steps `≤ step`.
    pub fn get(&self, prompt: u64, step: u64) -> Option<PromptStat> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.history.get(&prompt).and_then(|h| as_of(h, step))
    }

    /// Every prompt's stats as of `step`.
    pub fn as_of(&self, step: u64) -> HashMap<u64, PromptStat> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .history
            .iter()
            .filter_map(|(p, h)| as_of(h, step).map(|s| (*p, s)))
            .collect()
    }

    fn record(&self, prompt: u64, step: u64, stat: PromptStat) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.history.entry(prompt).or_default().insert(step, stat);
    }

    /// `prompt`'s entries a curriculum reading as of `from` or later can
    /// still see: the newest at or before `from`, and every later one.
    fn entries_from(&self, prompt: u64, from: u64) -> Vec<(u64, PromptStat)> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let Some(history) = inner.history.get(&prompt) else {
            return Vec::new();
        };
        let first = history.range(..=from).next_back().map(|(s, _)| *s);
        history
            .range(first.unwrap_or(from)..)
            .map(|(s, stat)| (*s, *stat))
            .collect()
    }
}

/// The newest entry of a prompt's history at or before `step`.
fn as_of(history: &BTreeMap<u64, PromptStat>, step: u64) -> Option<PromptStat> {
    history.range(..=step).next_back().map(|(_, s)| *s)
}

/// Skip rules for the prompt source, from the stats view.
#[derive(Clone, Debug)]
pub struct Curriculum {
    /// The stats.
    pub view: StatsView,
    /// Only prompts with at least this many samples are judged.
    pub min_samples: u64,
    /// Skip prompts solved at this rate or more (mastered); 1.0 skips only always-solved prompts.
    pub max_solve_rate: f64,
    /// Skip prompts solved at this rate or less (too hard); negative keeps them all.
    pub min_solve_rate: f64,
    /// The run's `max_staleness`: stats are read as of `step − max_staleness − 1`.
    pub max_staleness: u64,
}

impl Curriculum {
    /// Whether the source should skip `prompt` when drawing step `step`.
    pub fn skips(&self, prompt: u64, step: u64) -> bool {
        let Some(settled) = step.checked_sub(self.max_staleness + 1) else {
            return false;
        };
        match self.view.get(prompt, settled) {
            Some(s) if s.samples >= self.min_samples => {
                let rate = s.solve_rate();
                rate >= self.max_solve_rate || rate <= self.min_solve_rate
            }
            _ => false,
        }
    }
}

/// The stats stage: passes rows through and feeds their rewards to the view.
pub struct PromptStats {
    worker: Worker,
    input: InputSession<u64, (u64, Entry), isize>,
    probe: ProbeHandle<u64>,
    solve_threshold: i64,
    view: StatsView,
    held: StepBuffer,
    /// The prompts this instance has scored (or restored).
    prompts: BTreeSet<u64>,
    /// Where and when its state goes into checkpoints.
    saves: Option<StatsSaves>,
}

/// How a stats stage saves its state with the run's checkpoints.
struct StatsSaves {
    checkpointer: Checkpointer,
    /// This instance's worker (its file's name).
    worker: usize,
    /// The run's `max_staleness`: a curriculum reads the stats as of
    /// `step − max_staleness − 1`, so a checkpoint at step S keeps the
    /// entries from `S − max_staleness` on.
    max_staleness: u64,
}

impl PromptStats {
    /// Stats into `view`; a sample counts as solved when its reward ≥ `solve_threshold`.
    pub fn new(view: StatsView, solve_threshold: f64) -> Self {
        let mut worker = Worker::new(
            timely::WorkerConfig::default(),
            Allocator::Thread(Thread::default()),
            Some(std::time::Instant::now()),
        );
        let solve = to_units(solve_threshold);
        let sink = view.clone();
        let probe = ProbeHandle::new();
        let input = worker.dataflow::<u64, _, _>(|scope| {
            let (input, rewards) = scope.new_collection::<(u64, Entry), isize>();
            rewards
                .reduce(move |_prompt, entries, out| {
                    let mut stat = PromptStat::default();
                    for (entry, count) in entries {
                        let n = *count as i64;
                        match **entry {
                            Entry::Reward(reward) => {
                                stat.samples += n as u64;
                                if reward >= solve {
                                    stat.solved += n as u64;
                                }
                                stat.reward_sum += reward * n;
                                stat.reward_sq_sum +=
                                    i128::from(reward) * i128::from(reward) * i128::from(n);
                            }
                            Entry::Seed(seed) => {
                                stat.samples += seed.samples * n as u64;
                                stat.solved += seed.solved * n as u64;
                                stat.reward_sum += seed.reward_sum * n;
                                stat.reward_sq_sum += seed.reward_sq_sum * i128::from(n);
                            }
                        }
                    }
                    out.push((stat, 1isize));
                })
                .inspect(move |((prompt, stat), step, diff)| {
                    if *diff > 0 {
                        sink.record(*prompt, *step, *stat);
                    }
                })
                .probe_with(&probe);
            input
        });
        PromptStats {
            worker,
            input,
            probe,
            solve_threshold: solve,
            view,
            held: super::rows_in_order(),
            prompts: BTreeSet::new(),
            saves: None,
        }
    }

    /// The view this stage feeds.
    pub fn view(&self) -> &StatsView {
        &self.view
    }

    /// Saves this instance's state on `worker` with each checkpoint of
    /// `checkpointer` (a curriculum reads the stats the run's
    /// `max_staleness` steps back).
    pub fn with_checkpoints(mut self, checkpointer: Checkpointer, worker: &WorkerInfo) -> Self {
        self.saves = Some(StatsSaves {
            checkpointer,
            worker: worker.index,
            max_staleness: worker.steps.max_staleness,
        });
        self
    }

    /// Restores, from the checkpoint in `dir` (of step `step`), the prompts
    /// `worker`'s rank receives: their stats seed the dataflow at `step`,
    /// their entries go back into the view.
    pub fn restored_from(
        mut self,
        dir: &Path,
        step: u64,
        worker: &WorkerInfo,
    ) -> Result<Self, StageError> {
        let folder = dir.join(SAVED_DIR);
        let Ok(files) = std::fs::read_dir(&folder) else {
            return Ok(self);
        };
        self.input.advance_to(step);
        for file in files.flatten() {
            let path = file.path();
            let bad = |why: &str| format!("{}: {why}", path.display());
            let text = weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES)
                .map_err(|e| bad(&e.to_string()))?;
            let saved: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| bad(&e.to_string()))?;
            for p in saved["prompts"].as_array().into_iter().flatten() {
                let prompt = p["prompt"]
                    .as_u64()
                    .ok_or_else(|| bad("a prompt without an id"))?;
                if weir_graph::partition::u64_key_rank(prompt, worker.role_size) != worker.rank {
                    continue;
                }
                let mut last = None;
                for e in p["history"].as_array().into_iter().flatten() {
                    let at = e[0]
                        .as_u64()
                        .ok_or_else(|| bad("an entry without a step"))?;
                    let stat = PromptStat::from_json(&e[1])
                        .ok_or_else(|| bad("an entry without its stats"))?;
                    self.view.record(prompt, at, stat);
                    last = Some(stat);
                }
                if let Some(stat) = last {
                    self.input.insert((prompt, Entry::Seed(stat)));
                    self.prompts.insert(prompt);
                }
            }
        }
        self.input.advance_to(step + 1);
        self.input.flush();
        let (probe, time) = (&self.probe, *self.input.time());
        self.worker.step_while(|| probe.less_than(&time));
        Ok(self)
    }

    /// Writes this instance's prompts' stats as of `step` into the step's
    /// checkpoint folder, if the step has one.
    fn save(&self, step: u64) -> Result<(), StageError> {
        let Some(saves) = self.saves.as_ref().filter(|s| s.checkpointer.due(step)) else {
            return Ok(());
        };
        let from = step.saturating_sub(saves.max_staleness);
        let prompts: Vec<serde_json::Value> = self
            .prompts
            .iter()
            .map(|&prompt| {
                let history: Vec<serde_json::Value> = self
                    .view
                    .entries_from(prompt, from)
                    .into_iter()
                    .filter(|(at, _)| *at <= step)
                    .map(|(at, stat)| serde_json::json!([at, stat.to_json()]))
                    .collect();
                serde_json::json!({ "prompt": prompt, "history": history })
            })
            .collect();
        let dir = saves.checkpointer.dir(step).join(SAVED_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| OperatorError::file(&dir, e))?;
        let text = serde_json::json!({ "step": step, "prompts": prompts }).to_string();
        weir_gpu::snapshot::write_atomically(
            &dir.join(format!("worker-{}.json", saves.worker)),
            text.as_bytes(),
        )?;
        Ok(())
    }
}

/// The checkpoint subfolder holding the stats stages' state.
const SAVED_DIR: &str = "prompt_stats";

fn to_units(reward: f64) -> i64 {
    (reward * REWARD_SCALE).round() as i64
}

impl StepStage for PromptStats {
    fn buffer(&mut self) -> &mut StepBuffer {
        &mut self.held
    }

    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError> {
        // Steps reach `run_step` in order, so the input's time only moves forward.
        if *self.input.time() < ctx.step {
            self.input.advance_to(ctx.step);
        }
        let mut solved = 0usize;
        if let Some(batch) = &rows {
            let prompts = u64s(batch, col::PROMPT_ID, "prompt stats")?;
            let rewards = scores(batch, "prompt stats")?;
            for (p, r) in prompts.into_iter().zip(rewards) {
                if !r.is_finite() {
                    return Err(format!("prompt stats: prompt {p} has reward {r}").into());
                }
                let units = to_units(r);
                solved += usize::from(units >= self.solve_threshold);
                self.input.insert((p, Entry::Reward(units)));
                self.prompts.insert(p);
            }
        }
        self.input.advance_to(ctx.step + 1);
        self.input.flush();
        let (probe, time) = (&self.probe, *self.input.time());
        self.worker.step_while(|| probe.less_than(&time));
        if let Some(batch) = &rows {
            ctx.record("solve_rate", solved as f64 / batch.num_rows().max(1) as f64);
        }
        self.save(ctx.step)?;
        Ok(rows.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, Float32Array, UInt64Array};
    use weir_graph::{Stage, WorkerInfo};

    fn step(stage: &mut PromptStats, step: u64, rows: &[(u64, f32)]) {
        let batch = RecordBatch::try_from_iter([
            (
                col::PROMPT_ID,
                Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.0))) as ArrayRef,
            ),
            (
                col::REWARD,
                Arc::new(Float32Array::from_iter_values(rows.iter().map(|r| r.1))) as ArrayRef,
            ),
        ])
        .unwrap();
        let worker = WorkerInfo::single();
        let mut ctx = StepContext::detached(step, worker, step);
        assert!(stage.process(&mut ctx, batch).unwrap().is_empty());
        let out = stage.end_step(&mut ctx).unwrap();
        assert_eq!(out[0].num_rows(), rows.len(), "rows pass through");
    }

    /// Two ranks save their prompts at a checkpoint; two fresh ranks
    /// restore from it and go on: the view they build reads as the
    /// straight one from the checkpoint's window on.
    #[test]
    fn a_checkpoint_keeps_the_stats_a_resumed_curriculum_reads() {
        let tmp = tempfile::tempdir().unwrap();
        let checkpointer = Checkpointer {
            root: tmp.path().to_path_buf(),
            every: 2,
            last_step: None,
            max_shard_bytes: u64::MAX,
        };
        let k = 1;
        let rank = |r| WorkerInfo {
            index: 3 + r,
            rank: r,
            role_size: 2,
            steps: weir_graph::RunSteps {
                max_staleness: k,
                ..Default::default()
            },
            ..WorkerInfo::single()
        };
        // Steps' rows: (prompt, reward); prompts split over the ranks as a ByKey edge would.
        let steps: Vec<Vec<(u64, f32)>> = (0..6u64)
            .map(|s| {
                (0..8u64)
                    .map(|p| (p, ((p * 7 + s * 3) % 5) as f32 / 4.0))
                    .collect()
            })
            .collect();
        let owned = |r: usize, rows: &[(u64, f32)]| -> Vec<(u64, f32)> {
            rows.iter()
                .copied()
                .filter(|(p, _)| weir_graph::partition::u64_key_rank(*p, 2) == r)
                .collect()
        };
        let straight = StatsView::new();
        let mut stages: Vec<PromptStats> = (0..2)
            .map(|r| {
                PromptStats::new(straight.clone(), 0.5)
                    .with_checkpoints(checkpointer.clone(), &rank(r))
            })
            .collect();
        for (s, rows) in steps.iter().enumerate() {
            for (r, stage) in stages.iter_mut().enumerate() {
                step(stage, s as u64, &owned(r, rows));
            }
        }
        assert!(checkpointer
            .dir(3)
            .join("prompt_stats/worker-4.json")
            .is_file());
        // Resumed after step 3's checkpoint.
        let resumed = StatsView::new();
        let mut again: Vec<PromptStats> = (0..2)
            .map(|r| {
                PromptStats::new(resumed.clone(), 0.5)
                    .restored_from(&checkpointer.dir(3), 3, &rank(r))
                    .unwrap()
            })
            .collect();
        for (s, rows) in steps.iter().enumerate().skip(4) {
            for (r, stage) in again.iter_mut().enumerate() {
                step(stage, s as u64, &owned(r, rows));
            }
        }
        for at in 3 - k..6 {
            assert_eq!(resumed.as_of(at), straight.as_of(at), "as of step {at}");
        }
        assert_eq!(resumed.as_of(5).len(), 8);
    }

    #[test]
    fn stats_accumulate_across_steps_and_are_read_as_of_a_step() {
        let view = StatsView::new();
        let mut stage = PromptStats::new(view.clone(), 1.0);
        step(&mut stage, 0, &[(7, 1.0), (7, 0.0), (9, 0.0), (9, 0.0)]);
        step(&mut stage, 1, &[(7, 1.0), (7, 1.0)]);
        step(&mut stage, 3, &[(9, 1.0), (9, 0.5)]);

        let p7 = view.get(7, 1).unwrap();
        assert_eq!((p7.samples, p7.solved), (4, 3));
        assert!((p7.mean() - 0.75).abs() < 1e-12);
        assert!((p7.variance() - 0.1875).abs() < 1e-12);
        assert_eq!(view.get(7, 0).unwrap().solved, 1, "as of step 0");
        assert_eq!(view.get(7, 5), view.get(7, 1), "unchanged since step 1");
        assert!(view.get(8, 5).is_none());

        let p9 = view.get(9, 2).unwrap();
        assert_eq!((p9.samples, p9.solved, p9.mean()), (2, 0, 0.0));
        let p9 = view.get(9, 3).unwrap();
        assert_eq!((p9.samples, p9.solved), (4, 1));
        assert!((p9.mean() - 0.375).abs() < 1e-12);
        assert_eq!(view.as_of(0).len(), 2);

        let curriculum = Curriculum {
            view: view.clone(),
            min_samples: 2,
            max_solve_rate: 0.75,
            min_solve_rate: 0.0,
            max_staleness: 1,
        };
        assert!(!curriculum.skips(7, 1), "nothing settled before step 2");
        assert!(!curriculum.skips(7, 2), "as of step 0: solved 1 of 2");
        assert!(
            curriculum.skips(7, 3),
            "as of step 1: solved 3 of 4, mastered"
        );
        assert!(curriculum.skips(9, 2), "as of step 0: never solved");
        assert!(!curriculum.skips(9, 5), "as of step 3: solved once");
        assert!(!curriculum.skips(8, 9), "never seen");
    }
}
