//! `weir inspect` and `weir plot`: what a run folder says, as a terminal
//! summary and as PNG charts.
//!
//! Both read `RUN_DIR/metrics.parquet`, the long-format metrics stream of
//! [`weir_graph::metrics`], and take any metric being absent in their stride:
//! an SFT run records only `loss` and `grad_norm`, `weir sim` only the
//! engine's figures. No stage name is assumed: the learner is the stage that
//! records `loss`, or failing that the one that records `staleness`.
//!
//! Charts are drawn with `plotters` on its bitmap backend, with text set in a
//! font embedded in the binary, so `weir plot` needs no system font library
//! and no display.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use weir_graph::metrics::{batch_to_rows, names, MetricRow};
use weir_graph::parquet_log::{read_parquet_dir, read_parquet_file};
use weir_graph::Step;

mod episode;
mod inspect;
mod plot;

pub use self::episode::episode;
pub use self::inspect::inspect;
pub use self::plot::plot;

/// Learner metrics, in the order `inspect` lists them.
const LEARNER_METRICS: [&str; 9] = [
    "reward",
    "kl",
    // Distillation's reverse KL to the teacher (its advantage stage's),
    // and the divergence over the teacher's top k (the learner's).
    "teacher_kl",
    "gkd_divergence",
    "entropy",
    "loss",
    "grad_norm",
    "clip_fraction",
    "response_length",
];

/// Metrics the engine writes for every stage; the rest are the stages' own.
const ENGINE_METRICS: [&str; 12] = [
    names::BUSY_S,
    names::BATCHES_IN,
    names::ROWS_IN,
    names::ROWS_OUT,
    names::QUEUE_PEAK,
    names::POLICY_VERSION,
    names::WEIGHTS_TRANSFER_S,
    names::WEIGHTS_LOAD_S,
    names::WEIGHTS_BYTES,
    names::STALENESS,
    names::DONE_UNIX_S,
    names::IN_FLIGHT_STEPS,
];

/// The metric rows of one run folder.
struct RunMetrics {
    /// Where they were read from.
    path: PathBuf,
    rows: Vec<MetricRow>,
}

/// How the rows of one step are folded into one figure.
#[derive(Clone, Copy)]
enum Fold {
    /// Over workers: a per-worker figure such as a loss.
    Mean,
    /// Over workers: a count such as rows.
    Sum,
    /// Over workers: a time such as `done_unix_s`.
    Max,
}

impl RunMetrics {
    fn load(run_dir: &Path) -> anyhow::Result<Self> {
        let meta = std::fs::metadata(run_dir)
            .with_context(|| format!("run folder {}", run_dir.display()))?;
        if !meta.is_dir() {
            bail!(
                "{} is not a folder (expected a weir run folder)",
                run_dir.display()
            );
        }
        let path = run_dir.join("metrics.parquet");
        let batches = if path.is_dir() {
            read_parquet_dir(&path)?
        } else if path.is_file() {
            read_parquet_file(&path)?
        } else {
            bail!(
                "{}: not found (is {} a weir run folder?)",
                path.display(),
                run_dir.display()
            );
        };
        let mut rows = Vec::new();
        for batch in &batches {
            rows.extend(batch_to_rows(batch).with_context(|| path.display().to_string())?);
        }
        // The evaluation's figures as one per step (its workers weighted by their prompts).
        let rows = weir_pipelines::eval::folded(&rows);
        Ok(RunMetrics { path, rows })
    }

    /// A stage's unlabelled `metric`, one figure per step; `stage: None` takes every stage.
    fn per_step(&self, stage: Option<&str>, metric: &str, fold: Fold) -> BTreeMap<Step, f64> {
        let mut acc: BTreeMap<Step, (f64, u32)> = BTreeMap::new();
        let rows = self.rows.iter().filter(|r| {
            r.metric == metric && r.label.is_none() && stage.is_none_or(|s| r.stage == s)
        });
        for row in rows {
            let (value, n) = acc.entry(row.step).or_insert((0.0, 0));
            *value = match (fold, *n) {
                (_, 0) => row.value,
                (Fold::Mean | Fold::Sum, _) => *value + row.value,
                (Fold::Max, _) => value.max(row.value),
            };
            *n += 1;
        }
        acc.into_iter()
            .map(|(step, (value, n))| match fold {
                Fold::Mean => (step, value / f64::from(n)),
                Fold::Sum | Fold::Max => (step, value),
            })
            .collect()
    }

    /// The first stage (in file order) that records `metric`.
    fn stage_with(&self, metric: &str) -> Option<&str> {
        self.rows
            .iter()
            .find(|r| r.metric == metric)
            .map(|r| r.stage.as_str())
    }

    /// The stage that records `loss`, or else the one that consumes rows by staleness.
    fn learner(&self) -> Option<&str> {
        self.stage_with("loss")
            .or_else(|| self.stage_with(names::STALENESS))
    }

    /// `metric` per step: the learner's if it records it, else the first stage's that does.
    fn series_of(&self, metric: &str) -> Option<(&str, BTreeMap<Step, f64>)> {
        let learner = self.learner();
        let stage = learner
            .filter(|l| {
                self.rows
                    .iter()
                    .any(|r| r.stage == *l && r.metric == metric)
            })
            .or_else(|| self.stage_with(metric))?;
        let series = self.per_step(Some(stage), metric, Fold::Mean);
        (!series.is_empty()).then_some((stage, series))
    }

    /// Every per-step curve the stages recorded themselves: the learner's
    /// (named by metric, known ones first), then other stages' as `stage/metric`.
    fn curves(&self) -> Vec<(String, BTreeMap<Step, f64>)> {
        let learner = self.learner();
        let mut own: BTreeSet<(&str, &str)> = BTreeSet::new();
        for r in &self.rows {
            if r.label.is_none() && !ENGINE_METRICS.contains(&r.metric.as_str()) {
                own.insert((r.stage.as_str(), r.metric.as_str()));
            }
        }
        let rank = |stage: &str, metric: &str| {
            let known = LEARNER_METRICS.iter().position(|m| *m == metric);
            (
                Some(stage) != learner,
                known.unwrap_or(LEARNER_METRICS.len()),
            )
        };
        let mut keys: Vec<(&str, &str)> = own.into_iter().collect();
        keys.sort_by_key(|(stage, metric)| (rank(stage, metric), *stage, *metric));
        keys.into_iter()
            .map(|(stage, metric)| {
                let name = if Some(stage) == learner {
                    metric.to_string()
                } else {
                    format!("{stage}/{metric}")
                };
                (name, self.per_step(Some(stage), metric, Fold::Mean))
            })
            .filter(|(_, series)| !series.is_empty())
            .collect()
    }

    /// Rows consumed at each staleness, over the run.
    fn staleness_histogram(&self) -> BTreeMap<u64, u64> {
        let mut histogram = BTreeMap::new();
        for r in self.rows.iter().filter(|r| r.metric == names::STALENESS) {
            if let Some(staleness) = r.label.as_deref().and_then(|l| l.parse::<u64>().ok()) {
                *histogram.entry(staleness).or_insert(0) += r.value.max(0.0) as u64;
            }
        }
        histogram
    }

    /// Seconds from the first stage's completion of a step to the last's,
    /// over the run (the start of the first step is not recorded).
    fn wall_s(&self) -> Option<f64> {
        let done = self
            .rows
            .iter()
            .filter(|r| r.metric == names::DONE_UNIX_S)
            .map(|r| r.value);
        let first = done.clone().reduce(f64::min)?;
        let last = done.reduce(f64::max)?;
        Some(last - first)
    }

    /// Per stage: the workers that ran it and its busy seconds summed over them.
    fn busy_by_stage(&self) -> BTreeMap<&str, (usize, f64)> {
        let mut workers: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        let mut busy: BTreeMap<&str, f64> = BTreeMap::new();
        for r in &self.rows {
            workers.entry(&r.stage).or_default().insert(r.worker);
            if r.metric == names::BUSY_S {
                *busy.entry(&r.stage).or_default() += r.value;
            }
        }
        busy.into_iter()
            .map(|(stage, s)| (stage, (workers[stage].len(), s)))
            .collect()
    }

    /// Per stage that records `busy_s`, in the order stages first appear:
    /// the share of each step's wall time (since that stage completed its
    /// previous step, × its workers) it was not busy. The first step has no
    /// start and is left out.
    fn idle_fractions(&self) -> Vec<(&str, Vec<(Step, f64)>)> {
        let workers = self.busy_by_stage();
        let mut order: Vec<&str> = Vec::new();
        for r in &self.rows {
            if workers.contains_key(r.stage.as_str()) && !order.contains(&r.stage.as_str()) {
                order.push(&r.stage);
            }
        }
        order
            .into_iter()
            .filter_map(|stage| {
                let n = workers[stage].0 as f64;
                let busy = self.per_step(Some(stage), names::BUSY_S, Fold::Sum);
                let done = self.per_step(Some(stage), names::DONE_UNIX_S, Fold::Max);
                let points: Vec<(Step, f64)> = done
                    .iter()
                    .zip(done.iter().skip(1))
                    .filter_map(|((_, before), (step, end))| {
                        let wall = (end - before) * n;
                        let busy = busy.get(step)?;
                        (wall > 0.0).then(|| (*step, (1.0 - busy / wall).clamp(0.0, 1.0)))
                    })
                    .collect();
                (!points.is_empty()).then_some((stage, points))
            })
            .collect()
    }

    /// Rows per step and when each step completed: the learner's `rows_in`,
    /// or with no learner the `rows_out` of the stage that finishes last.
    fn throughput(&self) -> Option<Throughput<'_>> {
        let has = |stage: &str, metric: &str| {
            self.rows
                .iter()
                .any(|r| r.stage == stage && r.metric == metric)
        };
        let (stage, metric) = match self.learner() {
            Some(learner) if has(learner, names::ROWS_IN) => (learner, names::ROWS_IN),
            _ => (self.last_stage()?, names::ROWS_OUT),
        };
        let rows = self.per_step(Some(stage), metric, Fold::Sum);
        let mut done = self.per_step(Some(stage), names::DONE_UNIX_S, Fold::Max);
        if done.is_empty() {
            done = self.per_step(None, names::DONE_UNIX_S, Fold::Max);
        }
        let steps = rows
            .into_iter()
            .filter_map(|(step, n)| done.get(&step).map(|t| (step, (n, *t))))
            .collect();
        Some(Throughput {
            stage,
            metric,
            steps,
        })
    }

    /// The stage with `rows_out` that completes its steps last (in file order without times).
    fn last_stage(&self) -> Option<&str> {
        let mut latest: BTreeMap<&str, f64> = BTreeMap::new();
        let mut order: Vec<&str> = Vec::new();
        for r in &self.rows {
            if r.metric == names::ROWS_OUT && !order.contains(&r.stage.as_str()) {
                order.push(&r.stage);
            }
            if r.metric == names::DONE_UNIX_S {
                let t = latest.entry(&r.stage).or_insert(f64::NEG_INFINITY);
                *t = t.max(r.value);
            }
        }
        order
            .iter()
            .max_by(|a, b| {
                let t = |s: &&str| latest.get(*s).copied().unwrap_or(f64::NEG_INFINITY);
                t(a).total_cmp(&t(b))
            })
            .copied()
    }
}

/// Rows and completion time of each step of the stage throughput is counted at.
struct Throughput<'a> {
    stage: &'a str,
    metric: &'static str,
    /// step → (rows, `done_unix_s`)
    steps: BTreeMap<Step, (f64, f64)>,
}

impl Throughput<'_> {
    /// Rows per second and steps per second from the first step's completion to the last's.
    fn overall(&self) -> Option<(f64, f64)> {
        let (_, (_, start)) = self.steps.first_key_value()?;
        let (_, (_, end)) = self.steps.last_key_value()?;
        let span = end - start;
        if self.steps.len() < 2 || span <= 0.0 {
            return None;
        }
        let rows: f64 = self.steps.values().skip(1).map(|(n, _)| n).sum();
        Some((rows / span, (self.steps.len() - 1) as f64 / span))
    }

    /// Per step after the first: its rows over the time since the previous step completed.
    fn rates(&self) -> Vec<(Step, f64)> {
        self.steps
            .iter()
            .zip(self.steps.iter().skip(1))
            .filter_map(|((_, (_, before)), (step, (rows, done)))| {
                let dt = done - before;
                (dt > 0.0).then_some((*step, rows / dt))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: Step, worker: u32, stage: &str, metric: &str, value: f64) -> MetricRow {
        MetricRow::new(step, worker, stage, metric, None, value)
    }

    #[test]
    fn learner_is_found_by_its_metrics_and_throughput_by_completion_times() {
        let mut rows = Vec::new();
        for step in 0..3u64 {
            for worker in 0..2 {
                rows.push(row(step, worker, "gen", names::ROWS_OUT, 10.0));
                rows.push(row(step, worker, "gen", names::BUSY_S, 1.0));
            }
            rows.push(row(step, 2, "train", "loss", 3.0 - step as f64));
            rows.push(row(step, 2, "train", names::ROWS_IN, 20.0));
            rows.push(row(
                step,
                2,
                "train",
                names::DONE_UNIX_S,
                100.0 + 2.0 * step as f64,
            ));
            rows.push(row(
                step,
                0,
                "gen",
                names::DONE_UNIX_S,
                99.0 + 2.0 * step as f64,
            ));
        }
        let run = RunMetrics {
            path: PathBuf::from("metrics.parquet"),
            rows,
        };
        assert_eq!(run.learner(), Some("train"));
        let t = run.throughput().unwrap();
        assert_eq!((t.stage, t.metric), ("train", names::ROWS_IN));
        assert_eq!(t.overall(), Some((10.0, 0.5)));
        assert_eq!(t.rates(), vec![(1, 10.0), (2, 10.0)]);
        assert_eq!(run.wall_s(), Some(5.0));
        assert_eq!(run.busy_by_stage()["gen"], (2, 6.0));
        // 2 busy seconds over 2 s × 2 workers per step after the first;
        // `train` records no busy time.
        assert_eq!(
            run.idle_fractions(),
            vec![("gen", vec![(1, 0.5), (2, 0.5)])]
        );
        let curves = run.curves();
        assert_eq!(curves.len(), 1);
        assert_eq!(curves[0].0, "loss");
        assert_eq!(
            curves[0].1.values().copied().collect::<Vec<_>>(),
            [3.0, 2.0, 1.0]
        );

        // Without a learner, rows are counted out of the stage that finishes last.
        let run = RunMetrics {
            rows: run.rows.into_iter().filter(|r| r.stage == "gen").collect(),
            ..run
        };
        let t = run.throughput().unwrap();
        assert_eq!((t.stage, t.metric), ("gen", names::ROWS_OUT));
        assert_eq!(t.overall(), Some((10.0, 0.5)));
    }
}
