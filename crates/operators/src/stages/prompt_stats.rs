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
//! The view serves as a filter or a curriculum: [`Curriculum`] tells the
//! prompt source to skip prompts that are already mastered or never
//! solved, reading the stats as of a step that every worker has finished
//! (`step − max_staleness − 1`), so all source workers decide alike.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arrow::array::RecordBatch;
use differential_dataflow::input::{Input, InputSession};
use timely::communication::allocator::thread::Thread;
use timely::communication::allocator::Allocator;
use timely::dataflow::ProbeHandle;
use timely::worker::Worker;
use weir_graph::{StageError, StepBuffer, StepContext, StepStage};

use super::columns::{f32s, u64s};
use crate::rollout::col;

/// Rewards enter the dataflow as integers in these units (exact sums, an `Ord` value).
const REWARD_SCALE: f64 = 1e6;

/// One prompt's statistics over every sample scored so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
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
    input: InputSession<u64, (u64, i64), isize>,
    probe: ProbeHandle<u64>,
    solve_threshold: i64,
    view: StatsView,
    held: StepBuffer,
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
            let (input, rewards) = scope.new_collection::<(u64, i64), isize>();
            rewards
                .reduce(move |_prompt, rewards, out| {
                    let mut stat = PromptStat::default();
                    for (&reward, count) in rewards {
                        let n = *count as i64;
                        stat.samples += n as u64;
                        if reward >= solve {
                            stat.solved += n as u64;
                        }
                        stat.reward_sum += reward * n;
                        stat.reward_sq_sum +=
                            i128::from(reward) * i128::from(reward) * i128::from(n);
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
        }
    }

    /// The view this stage feeds.
    pub fn view(&self) -> &StatsView {
        &self.view
    }
}

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
            let rewards = f32s(batch, col::REWARD, "prompt stats")?;
            for (p, r) in prompts.into_iter().zip(rewards) {
                if !r.is_finite() {
                    return Err(format!("prompt stats: prompt {p} has reward {r}").into());
                }
                let units = to_units(r);
                solved += usize::from(units >= self.solve_threshold);
                self.input.insert((p, units));
            }
        }
        self.input.advance_to(ctx.step + 1);
        self.input.flush();
        let (probe, time) = (&self.probe, *self.input.time());
        self.worker.step_while(|| probe.less_than(&time));
        if let Some(batch) = &rows {
            ctx.record("solve_rate", solved as f64 / batch.num_rows().max(1) as f64);
        }
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
