//! Evaluation on held-out prompts (`eval.prompts`): the run's own prompt
//! format, generator and reward, on a checkpoint.
//!
//! - `reward`: the mean reward of one greedy response per prompt;
//! - with `eval.k > 1`, `k` responses per prompt sampled as in training
//!   (`generate.temperature`, `top_p`, `top_k`): `mean_at_k`, their mean
//!   reward, and `pass_at_k`, the share of prompts whose best response has
//!   a positive reward.
//!
//! The rows go through the same stages as a training step's (the prompt
//! source, `Generate`, the reward stage), so a task's evaluation scores
//! exactly what its training rewards.

use std::path::Path;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, UInt64Type};
use weir_gpu::{SamplingParams, Tokenizer};
use weir_graph::metrics::MetricRow;
use weir_graph::{Source, SourceContext, Stage, StepContext, WorkerInfo};
use weir_operators::stages::generate::Generate;

use crate::{PipelineError, RunConfig};

/// What an evaluation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// Prompts evaluated.
    pub prompts: usize,
    /// Mean reward of the greedy responses.
    pub reward: f64,
    /// With `k > 1`: the mean reward of `k` sampled responses per prompt.
    pub mean_at_k: Option<f64>,
    /// With `k > 1`: the share of prompts with a positive best reward among `k`.
    pub pass_at_k: Option<f64>,
}

impl EvalResult {
    /// The result as metric rows of stage `eval` at `step`.
    pub fn metric_rows(&self, step: u64) -> Vec<MetricRow> {
        let mut rows = vec![
            MetricRow::new(step, 0, "eval", "reward", None, self.reward),
            MetricRow::new(step, 0, "eval", "prompts", None, self.prompts as f64),
        ];
        if let (Some(mean), Some(pass)) = (self.mean_at_k, self.pass_at_k) {
            rows.push(MetricRow::new(step, 0, "eval", "mean_at_k", None, mean));
            rows.push(MetricRow::new(step, 0, "eval", "pass_at_k", None, pass));
        }
        rows
    }
}

/// Evaluates the policy in `actor` on `cfg.eval.prompts`.
pub fn evaluate(cfg: &RunConfig, actor: &Path) -> Result<EvalResult, PipelineError> {
    let worker = WorkerInfo::single();
    let reward_factory = crate::rewards::reward(cfg);
    let mut reward = reward_factory(&worker)?;
    let model = crate::context::load(cfg, actor, &worker)?;
    let tokenizer = Tokenizer::load(Path::new(&cfg.model.path))?;
    let sampled_params = crate::roles::sampling(cfg, &tokenizer);
    let mut generate = Generate::new(
        model,
        Tokenizer::load(Path::new(&cfg.model.path))?,
        SamplingParams {
            greedy: true,
            ..sampled_params.clone()
        },
    );
    let greedy = scored(cfg, &tokenizer, 1, &mut generate, reward.as_mut())?;
    let rewards = column_f32(&greedy, "reward")?;
    let prompts = rewards.len();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut result = EvalResult {
        prompts,
        reward: mean(&rewards),
        mean_at_k: None,
        pass_at_k: None,
    };
    if cfg.eval.k > 1 {
        generate.set_params(sampled_params);
        let sampled = scored(cfg, &tokenizer, cfg.eval.k, &mut generate, reward.as_mut())?;
        let rewards = column_f32(&sampled, "reward")?;
        let groups = sampled
            .column_by_name("group_id")
            .ok_or_else(|| "eval: no group_id column".to_string())?
            .as_primitive::<UInt64Type>()
            .values()
            .to_vec();
        let mut best: std::collections::BTreeMap<u64, f64> = Default::default();
        for (g, r) in groups.iter().zip(&rewards) {
            let b = best.entry(*g).or_insert(f64::NEG_INFINITY);
            *b = b.max(*r);
        }
        result.mean_at_k = Some(mean(&rewards));
        result.pass_at_k =
            Some(best.values().filter(|r| **r > 0.0).count() as f64 / best.len().max(1) as f64);
    }
    Ok(result)
}

/// Every eval prompt × `samples`, generated and rewarded, in one batch.
fn scored(
    cfg: &RunConfig,
    tokenizer: &Tokenizer,
    samples: usize,
    generate: &mut Generate,
    reward: &mut dyn Stage,
) -> Result<RecordBatch, PipelineError> {
    let path = Path::new(&cfg.eval.prompts);
    let mut source = crate::prompts::prompt_file(cfg, path, samples, false, tokenizer)?
        .every_prompt_per_step()
        .epochs(1);
    let worker = WorkerInfo::single();
    let batch = source
        .next_step(&SourceContext { step: 0, worker })?
        .and_then(|mut b| b.pop())
        .ok_or_else(|| format!("eval.prompts {}: no prompts", path.display()))?;
    let mut ctx = StepContext::detached(0, worker, 0);
    let mut out = Vec::new();
    // Generation in batches of eval.batch rows.
    let rows = batch.num_rows();
    let step = cfg.eval.batch.max(1);
    for start in (0..rows).step_by(step) {
        let part = batch.slice(start, step.min(rows - start));
        for generated in generate.process(&mut ctx, part)? {
            out.extend(reward.process(&mut ctx, generated)?);
        }
    }
    let schema = out
        .first()
        .map(|b| b.schema())
        .ok_or_else(|| "eval: nothing scored".to_string())?;
    Ok(arrow::compute::concat_batches(&schema, &out).map_err(|e| e.to_string())?)
}

fn column_f32(batch: &RecordBatch, name: &str) -> Result<Vec<f64>, PipelineError> {
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
