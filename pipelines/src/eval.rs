//! Evaluation on held-out prompts (`eval.prompts`): the run's own prompt
//! format, generator and reward.
//!
//! - `reward`: the mean reward of one greedy response per prompt;
//! - with `eval.k > 1`, `k` responses per prompt sampled as in training
//!   (`generate.temperature`, `top_p`, `top_k`): `mean_at_k`, their mean
//!   reward, and `pass_at_k`, the share of prompts whose best response has
//!   a positive reward.
//!
//! During training ([`EvaluatingGenerator`], `eval.every`), each rollout
//! worker evaluates its share of the prompts with the weights its
//! generator holds, before it generates the rollouts of every `every`-th
//! step (step 0 measures the starting policy). The figures are metric rows
//! of stage `eval` at that step, one per worker with the worker's prompt
//! count, so they are committed with the step like every other metric;
//! [`points`] folds them into one figure per step. At the end the runner
//! evaluates the final checkpoint the same way ([`evaluate`]).
//!
//! The rows go through the same stages as a training step's (the prompt
//! source, `Generate`, the reward stage), so a task's evaluation scores
//! exactly what its training rewards.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, UInt64Type};
use serde_json::json;
use weir_gpu::{SamplingParams, Tokenizer};
use weir_graph::metrics::MetricRow;
use weir_graph::{
    PolicyVersion, Source, SourceContext, Stage, StageError, Step, StepContext, WeightsPayload,
    WorkerInfo,
};
use weir_operators::checkpoint::CheckpointState;
use weir_operators::stages::generate::{Generate, Generator};

use crate::{PipelineError, RunConfig};

/// The stage name of the evaluation's metric rows.
pub const STAGE: &str = "eval";

/// What an evaluation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// Prompts evaluated.
    pub prompts: usize,
    /// The policy version evaluated (the number of updates behind it).
    pub policy_version: PolicyVersion,
    /// Mean reward of the greedy responses.
    pub reward: f64,
    /// With `k > 1`: the mean reward of `k` sampled responses per prompt.
    pub mean_at_k: Option<f64>,
    /// With `k > 1`: the share of prompts with a positive best reward among `k`.
    pub pass_at_k: Option<f64>,
}

impl EvalResult {
    /// The figures by metric name, as the metric rows hold them.
    fn figures(&self) -> Vec<(&'static str, f64)> {
        let mut out = vec![
            ("reward", self.reward),
            ("prompts", self.prompts as f64),
            ("policy_version", self.policy_version as f64),
        ];
        if let (Some(mean), Some(pass)) = (self.mean_at_k, self.pass_at_k) {
            out.push(("mean_at_k", mean));
            out.push(("pass_at_k", pass));
        }
        out
    }

    /// The result as metric rows of stage `eval` at `step`.
    pub fn metric_rows(&self, step: Step, worker: u32) -> Vec<MetricRow> {
        self.figures()
            .into_iter()
            .map(|(metric, value)| MetricRow::new(step, worker, STAGE, metric, None, value))
            .collect()
    }
}

/// The evaluations in `rows` (stage `eval`), one per step: the workers'
/// figures weighted by their prompt counts.
pub fn points(rows: &[MetricRow]) -> BTreeMap<Step, EvalResult> {
    // (step, worker) → metric → value
    let mut by_worker: BTreeMap<(Step, u32), BTreeMap<&str, f64>> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.stage == STAGE && r.label.is_none())
    {
        by_worker
            .entry((r.step, r.worker))
            .or_default()
            .insert(&r.metric, r.value);
    }
    let mut sums: BTreeMap<Step, (f64, BTreeMap<&str, f64>, f64)> = BTreeMap::new();
    for ((step, _), figures) in &by_worker {
        let n = figures.get("prompts").copied().unwrap_or(0.0);
        if n <= 0.0 {
            continue;
        }
        let (total, weighted, version) = sums.entry(*step).or_default();
        *total += n;
        *version = version.max(figures.get("policy_version").copied().unwrap_or(0.0));
        for metric in ["reward", "mean_at_k", "pass_at_k"] {
            if let Some(v) = figures.get(metric) {
                *weighted.entry(metric).or_default() += n * v;
            }
        }
    }
    sums.into_iter()
        .map(|(step, (n, weighted, version))| {
            let mean = |m: &str| weighted.get(m).map(|s| s / n);
            let result = EvalResult {
                prompts: n as usize,
                policy_version: version as PolicyVersion,
                reward: mean("reward").unwrap_or(f64::NAN),
                mean_at_k: mean("mean_at_k"),
                pass_at_k: mean("pass_at_k"),
            };
            (step, result)
        })
        .collect()
}

/// `rows` with the evaluation rows of each step (one per worker) replaced
/// by their fold ([`points`]), as worker 0's: what a reader that averages
/// over workers should see.
pub fn folded(rows: &[MetricRow]) -> Vec<MetricRow> {
    let mut out: Vec<MetricRow> = rows.iter().filter(|r| r.stage != STAGE).cloned().collect();
    for (step, result) in points(rows) {
        out.extend(result.metric_rows(step, 0));
    }
    out
}

/// One worker's evaluation: its share of the eval prompts (greedy, and × k
/// sampled), the reward stage, and the sampling settings.
pub struct Evaluation {
    greedy: Option<RecordBatch>,
    sampled: Option<RecordBatch>,
    reward: Box<dyn Stage>,
    greedy_params: SamplingParams,
    sampled_params: SamplingParams,
    batch: usize,
    worker: WorkerInfo,
}

impl Evaluation {
    /// The evaluation of `worker`'s share of `cfg.eval.prompts` (prompt `i`
    /// goes to rollout rank `i mod ranks`).
    pub fn new(cfg: &RunConfig, worker: &WorkerInfo) -> Result<Self, StageError> {
        let tokenizer = Tokenizer::load(Path::new(&cfg.model.path))?;
        let path = cfg
            .eval
            .prompts
            .as_deref()
            .ok_or("evaluation without `eval.prompts`")?;
        let prompts = crate::task::Task::File(path.to_path_buf()).prompts(cfg, 1, &tokenizer)?;
        if prompts.rows().is_empty() {
            return Err(format!("eval.prompts {}: no prompts", path.display()).into());
        }
        // This worker's share of every prompt × `samples`, in one batch.
        let share = |samples: usize| -> Result<Option<RecordBatch>, StageError> {
            let mut source = prompts
                .clone()
                .with_samples(samples)
                .every_prompt_per_step()
                .epochs(1)
                .shard(worker.rank, worker.role_size);
            let batch = source
                .next_step(&SourceContext {
                    step: 0,
                    worker: *worker,
                })?
                .and_then(|mut b| b.pop());
            Ok(batch.filter(|b| b.num_rows() > 0))
        };
        // An evaluation measures where the policy ends its answers.
        let sampled_params = SamplingParams {
            ignore_eos: false,
            ..cfg.generate.sampling(&tokenizer, cfg.run.seed)
        };
        Ok(Evaluation {
            greedy: share(1)?,
            sampled: if cfg.eval.k > 1 {
                share(cfg.eval.k)?
            } else {
                None
            },
            reward: crate::rewards::reward(cfg)(worker)?,
            greedy_params: SamplingParams {
                greedy: true,
                ..sampled_params.clone()
            },
            sampled_params,
            batch: cfg.eval.batch.max(1),
            worker: *worker,
        })
    }

    /// Evaluates the policy in `generate` (version `version`); `None` when
    /// this worker's share is empty. `generate` is left sampling with `restore`.
    pub fn run(
        &mut self,
        generate: &mut Generate,
        version: PolicyVersion,
        restore: &SamplingParams,
    ) -> Result<Option<EvalResult>, StageError> {
        let Some(greedy) = self.greedy.clone() else {
            return Ok(None);
        };
        generate.set_params(self.greedy_params.clone());
        let result = self.measure(generate, version, &greedy);
        generate.set_params(restore.clone());
        let rewards = column_f64(&result?, "reward")?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let mut result = EvalResult {
            prompts: rewards.len(),
            policy_version: version,
            reward: mean(&rewards),
            mean_at_k: None,
            pass_at_k: None,
        };
        if let Some(rows) = self.sampled.clone() {
            generate.set_params(self.sampled_params.clone());
            let sampled = self.measure(generate, version, &rows);
            generate.set_params(restore.clone());
            let sampled = sampled?;
            let rewards = column_f64(&sampled, "reward")?;
            let groups = sampled
                .column_by_name("group_id")
                .ok_or("eval: no group_id column")?
                .as_primitive::<UInt64Type>()
                .values()
                .to_vec();
            let (mean_at_k, pass_at_k) = sampled_figures(&groups, &rewards);
            result.mean_at_k = Some(mean_at_k);
            result.pass_at_k = Some(pass_at_k);
        }
        Ok(Some(result))
    }

    /// `rows` generated in slices of `eval.batch` and rewarded, in one batch.
    fn measure(
        &mut self,
        generate: &mut Generate,
        version: PolicyVersion,
        rows: &RecordBatch,
    ) -> Result<RecordBatch, StageError> {
        let mut ctx = StepContext::detached(0, self.worker, version).in_stage(STAGE);
        let mut out = Vec::new();
        let n = rows.num_rows();
        for start in (0..n).step_by(self.batch) {
            let part = rows.slice(start, self.batch.min(n - start));
            let generated = generate.generate_now(&ctx, part)?;
            out.extend(self.reward.process(&mut ctx, generated)?);
        }
        out.extend(self.reward.end_step(&mut ctx)?);
        let schema = out
            .first()
            .map(|b| b.schema())
            .ok_or("eval: nothing scored")?;
        Ok(arrow::compute::concat_batches(&schema, &out).map_err(|e| e.to_string())?)
    }
}

/// `mean_at_k` and `pass_at_k` of k sampled responses per prompt: the mean
/// reward over every response, and the share of prompts (`groups`, one id
/// per response) whose best response has a positive reward.
fn sampled_figures(groups: &[u64], rewards: &[f64]) -> (f64, f64) {
    let mut best: BTreeMap<u64, f64> = BTreeMap::new();
    for (g, r) in groups.iter().zip(rewards) {
        let b = best.entry(*g).or_insert(f64::NEG_INFINITY);
        *b = b.max(*r);
    }
    let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
    let passed = best.values().filter(|r| **r > 0.0).count();
    (mean, passed as f64 / best.len().max(1) as f64)
}

/// The generator with `eval.every`: before the rollouts of every
/// `every`-th step it evaluates the policy it holds on its share of the
/// eval prompts, and records the figures as stage `eval`.
pub struct EvaluatingGenerator<G> {
    generate: G,
    evaluation: Evaluation,
    training: SamplingParams,
    every: Step,
    evaluated: Option<Step>,
}

impl<G: Generator> EvaluatingGenerator<G> {
    /// Wraps `generate` (which samples with `training`).
    pub fn new(generate: G, evaluation: Evaluation, training: SamplingParams, every: Step) -> Self {
        EvaluatingGenerator {
            generate,
            evaluation,
            training,
            every: every.max(1),
            evaluated: None,
        }
    }
}

impl<G: Generator> Stage for EvaluatingGenerator<G> {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let due = ctx.step.is_multiple_of(self.every);
        if due && self.evaluated.is_none_or(|s| s < ctx.step) {
            self.evaluated = Some(ctx.step);
            let result =
                self.evaluation
                    .run(self.generate.generate(), ctx.version, &self.training)?;
            for (metric, value) in result.iter().flat_map(EvalResult::figures) {
                ctx.record_under(STAGE, metric, value);
            }
        }
        self.generate.process(ctx, batch)
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        self.generate.load_weights(version, weights)
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        self.generate.end_step(ctx)
    }

    fn policy_version(&self) -> Option<PolicyVersion> {
        // What the evaluation runs on: `ctx.version` in `process` is this.
        Stage::policy_version(&self.generate)
    }

    fn streaming(&self) -> bool {
        Stage::streaming(&self.generate)
    }

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        self.generate.advance()
    }

    fn holds(&self, step: Step) -> bool {
        self.generate.holds(step)
    }

    fn input_ended(&mut self, step: Step) {
        self.generate.input_ended(step)
    }
}

/// Evaluates the policy checkpoint in `actor` (version `version`) on all of
/// `cfg.eval.prompts`, on one worker.
pub fn evaluate(
    cfg: &RunConfig,
    actor: &Path,
    version: PolicyVersion,
) -> Result<EvalResult, PipelineError> {
    let worker = WorkerInfo::single();
    let mut evaluation = Evaluation::new(cfg, &worker)?;
    let model = crate::context::load(cfg, actor, &worker)?;
    let tokenizer = Tokenizer::load(Path::new(&cfg.model.path))?;
    let training = cfg.generate.sampling(&tokenizer, cfg.run.seed);
    let mut generate = Generate::new(model, tokenizer, training.clone());
    Ok(evaluation
        .run(&mut generate, version, &training)?
        .ok_or_else(|| {
            let path = crate::config::text::plain(&cfg.eval.prompts);
            format!("eval.prompts {path}: no prompts")
        })?)
}

/// The best evaluation (by greedy reward; the earliest of equals) whose
/// policy version a complete checkpoint under `root` holds; marks it:
/// `root/best` links to the checkpoint's folder and `root/best.json` says
/// which evaluation it won. Returns the checkpoint folder and its result.
pub fn mark_best_checkpoint(
    root: &Path,
    evaluations: &BTreeMap<Step, EvalResult>,
) -> Result<Option<(PathBuf, Step, EvalResult)>, PipelineError> {
    let saved: BTreeMap<PolicyVersion, (PathBuf, CheckpointState)> =
        weir_operators::checkpoint::complete(root)?
            .into_iter()
            .map(|(dir, state)| (state.version, (dir, state)))
            .collect();
    let mut best: Option<(PathBuf, Step, EvalResult)> = None;
    for (step, result) in evaluations {
        let Some((dir, _)) = saved.get(&result.policy_version) else {
            continue;
        };
        if best.as_ref().is_none_or(|b| result.reward > b.2.reward) {
            best = Some((dir.clone(), *step, result.clone()));
        }
    }
    let Some((dir, step, result)) = &best else {
        return Ok(None);
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let link = root.join("best");
    let tmp = root.join(".best.partial");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&name, &tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    let note = json!({
        "checkpoint": name,
        "eval_step": step,
        "policy_version": result.policy_version,
        "metric": "reward",
        "value": result.reward,
        "mean_at_k": result.mean_at_k,
        "pass_at_k": result.pass_at_k,
    });
    weir_gpu::snapshot::write_atomically(
        &root.join("best.json"),
        serde_json::to_string_pretty(&note)
            .map_err(|e| e.to_string())?
            .as_bytes(),
    )?;
    Ok(best)
}

fn column_f64(batch: &RecordBatch, name: &str) -> Result<Vec<f64>, StageError> {
    Ok(batch
        .column_by_name(name)
        .ok_or_else(|| format!("eval: no `{name}` column"))?
        .as_primitive_opt::<Float32Type>()
        .ok_or_else(|| format!("eval: `{name}` is not float32"))?
        .values()
        .iter()
        .map(|v| f64::from(*v))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_weight_each_worker_by_its_prompts() {
        let a = EvalResult {
            prompts: 3,
            policy_version: 4,
            reward: 1.0,
            mean_at_k: Some(0.5),
            pass_at_k: Some(1.0),
        };
        let b = EvalResult {
            prompts: 1,
            reward: 0.0,
            mean_at_k: Some(0.1),
            pass_at_k: Some(0.0),
            ..a.clone()
        };
        let mut rows = a.metric_rows(4, 0);
        rows.extend(b.metric_rows(4, 2));
        rows.push(MetricRow::new(4, 0, "generate", "reward", None, 9.0));
        let p = points(&rows);
        assert_eq!(p.len(), 1);
        let r = &p[&4];
        assert_eq!((r.prompts, r.policy_version), (4, 4));
        assert!((r.reward - 0.75).abs() < 1e-12);
        assert!((r.mean_at_k.unwrap() - 0.4).abs() < 1e-12);
        assert!((r.pass_at_k.unwrap() - 0.75).abs() < 1e-12);
    }

    #[test]
    fn mean_and_pass_at_k_follow_their_definitions() {
        // Three prompts, k = 4: prompt 7 solved once, prompt 3 never
        // (negative and zero rewards), prompt 5 solved by every response,
        // responses interleaved.
        let groups = [7, 3, 5, 7, 3, 5, 7, 3, 5, 7, 3, 5];
        let rewards = [0.0, -1.0, 1.0, 0.0, 0.0, 1.0, 1.0, -0.5, 1.0, 0.0, 0.0, 1.0];
        let (mean, pass) = sampled_figures(&groups, &rewards);
        assert!((mean - 3.5 / 12.0).abs() < 1e-12, "{mean}");
        assert!((pass - 2.0 / 3.0).abs() < 1e-12, "{pass}");
        // A best reward of exactly 0 does not pass; one response in k does.
        assert_eq!(sampled_figures(&[1, 1], &[0.0, 0.0]), (0.0, 0.0));
        assert_eq!(
            sampled_figures(&[1, 1, 2, 2], &[0.0, 0.25, 0.0, 0.0]),
            (0.0625, 0.5)
        );
    }
}
