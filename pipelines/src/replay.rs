//! `weir replay`: the learner of a finished (or crashed) RL run, fed the
//! rows its log holds, without generating, and held to the metrics the run
//! recorded.
//!
//! A replay of steps `A..=B` starts from the newest complete checkpoint
//! before `A` (its weights and optimizer state; `model.path` when there is
//! none), builds the learner the run built (the resolved config: the same
//! objective, micro-batching, learning-rate schedule and thread count),
//! and feeds it each step's logged rows in the order the run's learner took
//! them (by group, then sample); a run's data-parallel ranks are replayed
//! as ranks too, each fed its worker's rows. Each step's learner metrics (loss,
//! gradient norm, clip fraction, entropy, learning rate, KL, importance
//! weights, reward, response length) are compared with `metrics.parquet`.
//! On the CPU the same kernels, thread count and rows give the same bits;
//! on CUDA, atomics in the backward pass make the last digits vary, and
//! the comparison takes a tolerance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use weir_graph::metrics::batch_to_rows;
use weir_graph::parquet_log::read_parquet_file;
use weir_graph::WorkerInfo;
use weir_operators::checkpoint::{complete, load_optimizer};
use weir_operators::rollout::col;
use weir_operators::rollout_log::{self, RowFilter};
use weir_operators::stages::learner::Learner;

use crate::config::DeviceChoice;
use crate::context::load_policy;
use crate::manifest::{Manifest, ModelHashes};
use crate::runner::read_resolved;
use crate::PipelineError;

/// What to replay.
#[derive(Clone, Debug)]
pub struct ReplayRequest {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The first step replayed and compared (`None`: the log's first).
    pub first: Option<u64>,
    /// The last (`None`: the log's last).
    pub last: Option<u64>,
    /// The largest difference that counts as equal, relative to
    /// `max(1, |logged|)` (`None`: 0 on the CPU, [`CUDA_TOLERANCE`] on CUDA).
    pub tolerance: Option<f64>,
}

/// The default tolerance of a replay on CUDA, relative to `max(1, |value|)`.
pub const CUDA_TOLERANCE: f64 = 1e-3;

/// What a replay found.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayReport {
    /// Steps the learner was fed (from the checkpoint to the last).
    pub steps: u64,
    /// Metrics compared.
    pub metrics: usize,
    /// The largest absolute difference between a replayed and a logged metric.
    pub max_abs_diff: f64,
    /// The first metric beyond the tolerance: one line naming the step, the
    /// metric and both values.
    pub first_difference: Option<String>,
}

impl ReplayReport {
    /// The replay's last line.
    pub fn last_line(&self) -> String {
        format!(
            "replay: steps={} metrics={} max_abs_diff={:e}",
            self.steps, self.metrics, self.max_abs_diff
        )
    }
}

/// Replays `req`'s steps, saying what it does through `say` (one line per
/// step); the report's `first_difference` holds the first metric that
/// differs.
pub fn replay(
    req: &ReplayRequest,
    mut say: impl FnMut(&str),
) -> Result<ReplayReport, PipelineError> {
    let dir = &req.run_dir;
    let (kind, cfg) = read_resolved(dir)?;
    if !kind.is_rl() {
        return Err(format!(
            "{}: a `{}` run trains on no rollouts: `weir replay` replays an RL pipeline's learner",
            dir.display(),
            kind.name()
        )
        .into());
    }
    check_model(dir, &cfg.model.path)?;
    let logged = logged_metrics(dir)?;
    // Opened and checked once; each step's rows are read from them.
    let files = rollout_log::open_all(&[dir.to_path_buf()])?;
    let steps = logged_steps(&files)?;
    let (Some(&log_first), Some(&log_last)) = (steps.first(), steps.last()) else {
        return Err(format!("{}: the rollout log holds no rows", dir.display()).into());
    };
    let first = req.first.unwrap_or(log_first);
    let last = req.last.unwrap_or(log_last);
    if first > last {
        return Err(format!("--steps {first}..{last}: the first step comes after the last").into());
    }
    if last > log_last {
        return Err(format!(
            "--steps {first}..{last}: the log of {} ends at step {log_last}",
            dir.display()
        )
        .into());
    }
    // The newest complete checkpoint before `first`: the learner as it was.
    let checkpoint = complete(&dir.join("checkpoints"))?
        .into_iter()
        .rfind(|(_, state)| state.step < first);
    let (start_dir, start) = match &checkpoint {
        Some((ck, state)) => (ck.join("actor"), state.step + 1),
        None => (cfg.model.path.clone(), 0),
    };
    if let Some(missing) = (start..=last).find(|s| !steps.contains(s)) {
        return Err(format!(
            "{}: the rollout log holds no rows of step {missing}, which the replay from {} needs",
            dir.display(),
            start_dir.display()
        )
        .into());
    }
    let tolerance = req.tolerance.unwrap_or(match cfg.run.device {
        DeviceChoice::Cpu => 0.0,
        DeviceChoice::Cuda => CUDA_TOLERANCE,
    });
    if cfg.lora.adapters().is_some_and(|l| l.dropout > 0.0) {
        say("note: lora.dropout > 0 draws from libtorch's random state, which no checkpoint keeps: replayed metrics will differ");
    }
    tch::set_num_threads(cfg.run.threads as i32);
    say(&format!(
        "replaying steps {start}..={last} of {} from {}{}",
        dir.display(),
        start_dir.display(),
        match cfg.placement.train.len() {
            1 => String::new(),
            n => format!(" on {n} data-parallel ranks"),
        }
    ));
    let start_from = Start {
        dir: start_dir,
        optimizer: checkpoint.as_ref().map(|(ck, _)| ck.join("actor")),
    };
    let replayed = learn(&cfg, kind, &files, &start_from, start..=last)?;
    let mut report = ReplayReport {
        steps: 0,
        metrics: 0,
        max_abs_diff: 0.0,
        first_difference: None,
    };
    for (step, metrics) in replayed {
        report.steps += 1;
        let mut line = format!("step {step}:");
        let recorded = logged.get(&step);
        for (name, value) in metrics {
            let Some(&was) = recorded.and_then(|m| m.get(name)) else {
                report.first_difference.get_or_insert_with(|| {
                    format!("step {step}: `{name}` = {value} is not in metrics.parquet")
                });
                continue;
            };
            let diff = (value - was).abs();
            report.metrics += 1;
            report.max_abs_diff = report.max_abs_diff.max(diff);
            line.push_str(&format!(" {name}={value:.6}"));
            if diff > tolerance * was.abs().max(1.0) || value.is_nan() != was.is_nan() {
                line.push_str(&format!(" (logged {was})"));
                report.first_difference.get_or_insert_with(|| {
                    format!(
                        "step {step}: `{name}` replayed {value}, logged {was} (difference {diff:e})"
                    )
                });
            }
        }
        say(&line);
    }
    Ok(report)
}

/// Each replayed step's learner metrics, in step order.
type StepMetrics = Vec<(u64, Vec<(&'static str, f64)>)>;

/// Where the replayed learner starts: a checkpoint's `actor/` (weights and
/// optimizer state) or `model.path`.
struct Start {
    dir: PathBuf,
    optimizer: Option<PathBuf>,
}

/// The learner metrics of each step of `steps`, from the run's learner (or
/// its data-parallel ranks, each on a thread of its own, summing through a
/// group as in the run) fed the logged rows.
fn learn(
    cfg: &crate::RunConfig,
    kind: crate::PipelineKind,
    files: &[rollout_log::LogFile],
    start: &Start,
    steps: std::ops::RangeInclusive<u64>,
) -> Result<StepMetrics, PipelineError> {
    let workers = cfg.placement.train.clone();
    let ranks = workers.len();
    let group = weir_gpu::collective::HostGroup::new(ranks);
    let rank = |r: usize| -> Result<StepMetrics, PipelineError> {
        let worker = WorkerInfo {
            index: workers[r],
            rank: r,
            role_size: ranks,
            ..WorkerInfo::single()
        };
        let model = load_policy(cfg, &start.dir, &worker)?;
        let mut learner =
            Learner::new(model, crate::roles::learner_config(cfg, kind.kl_in_loss()))?;
        if ranks > 1 {
            learner = learner.with_data_parallel(group.member(r))?;
        }
        if let Some(actor) = &start.optimizer {
            load_optimizer(actor, learner.optimizer_mut())?;
        }
        // A rank trains the rows the run routed to it: its worker's files.
        let prefix = format!("part-{:04}-", workers[r]);
        let own: Vec<&rollout_log::LogFile> = files
            .iter()
            .filter(|f| {
                ranks == 1
                    || f.path
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
            .collect();
        let mut out = Vec::new();
        for step in steps.clone() {
            let rows = step_rows(&own, step)?;
            if ranks == 1 && rows.is_none() {
                return Err(format!("the rollout log holds no rows of step {step}").into());
            }
            learner.update_as_rank(rows.as_ref())?;
            if learner.leads() {
                out.push((step, learner.update_metrics()));
            }
        }
        Ok(out)
    };
    if ranks == 1 {
        return rank(0);
    }
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let rank = &rank;
                scope.spawn(move || rank(r).map_err(|e| e.to_string()))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank's thread panicked".into()))
            })
            .collect()
    });
    let mut lead = Vec::new();
    for (r, result) in results.into_iter().enumerate() {
        let metrics = result.map_err(|e| format!("rank {r}: {e}"))?;
        if r == 0 {
            lead = metrics;
        }
    }
    Ok(lead)
}

/// Refuses a log whose manifest names other weights, tokenizer or chat
/// template than `model.path` holds now.
fn check_model(dir: &Path, model: &Path) -> Result<(), PipelineError> {
    let Some((path, manifest)) = Manifest::find(dir)? else {
        tracing::warn!(
            "{}: the log has no manifest: the model it came from cannot be checked",
            dir.display()
        );
        return Ok(());
    };
    let ours = ModelHashes::of(model)?;
    match manifest.policy.difference(&ours) {
        Some(difference) => Err(format!(
            "{}: the log was written from {}, and {difference}: replay it with the model it was trained from",
            path.display(),
            manifest.policy.path.display()
        )
        .into()),
        None => Ok(()),
    }
}

/// The learner's metrics of each step, as the run recorded them.
fn logged_metrics(dir: &Path) -> Result<BTreeMap<u64, BTreeMap<String, f64>>, PipelineError> {
    let path = dir.join("metrics.parquet");
    if !path.is_file() {
        return Err(format!("{}: no such file: nothing to compare with", path.display()).into());
    }
    let mut out: BTreeMap<u64, BTreeMap<String, f64>> = BTreeMap::new();
    for batch in read_parquet_file(&path)? {
        for row in batch_to_rows(&batch)? {
            if row.stage == "learn" && row.label.is_none() {
                out.entry(row.step)
                    .or_default()
                    .insert(row.metric, row.value);
            }
        }
    }
    Ok(out)
}

/// The steps the log holds rows of, in order.
fn logged_steps(files: &[rollout_log::LogFile]) -> Result<Vec<u64>, PipelineError> {
    let mut steps = std::collections::BTreeSet::new();
    for file in files {
        for batch in rollout_log::read(file, &RowFilter::default(), Some(&[col::STEP]))? {
            steps.extend(weir_operators::data::columns::u64s(
                &batch,
                col::STEP,
                "replay",
            )?);
        }
    }
    Ok(steps.into_iter().collect())
}

/// The rows of `step` in `files`, in the order the run's learner took
/// them; `None` when there are none.
fn step_rows(
    files: &[&rollout_log::LogFile],
    step: u64,
) -> Result<Option<RecordBatch>, PipelineError> {
    let filter = RowFilter::parse(&format!("step == {step}"))?;
    let mut batches = Vec::new();
    for file in files {
        batches.extend(rollout_log::read(file, &filter, None)?);
    }
    Ok(rollout_log::in_step_order(&batches)?)
}
