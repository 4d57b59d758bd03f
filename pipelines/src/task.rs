//! The task a run trains on: its prompt set (or the preference pairs of
//! `rm` and `dpo`), and the task's own measure of a policy beside the
//! run's reward. The runner, the prompt sources and the evaluation ask the
//! task; nothing else knows which one it is.
//!
//! - [`Task::Arith`] (`data.prompts = "arith"`): the built-in task, its
//!   training pairs, preference pairs and greedy accuracy on its 500
//!   evaluation pairs (`weir_operators::tasks::arith`);
//! - [`Task::File`]: the user's JSONL or Parquet prompt file, read as
//!   `[data]` says; it is scored by the run's reward, and evaluated on
//!   `eval.prompts` (`eval.rs`).
//!
//! A new built-in task is a variant here and its module in
//! `weir_operators::tasks`.

use std::path::Path;

use serde_json::{json, Value};
use weir_gpu::Tokenizer;
use weir_graph::StageError;
use weir_operators::data::prompt_files::{PromptColumn, PromptFormat, PromptLimit};
use weir_operators::stages::prompts::PromptSource;
use weir_operators::tasks::arith;

use crate::rewards::reward_columns;
use crate::{PipelineError, PipelineKind, RunConfig};

/// An accuracy and the (prompt, response) samples it was measured on.
pub type Accuracy = (f64, Vec<(String, String)>);

pub use crate::config::Task;

impl Task {
    /// The prompt set, `samples` rows per prompt, with the label and the
    /// columns the reward reads.
    pub fn prompts(
        &self,
        cfg: &RunConfig,
        samples: usize,
        tok: &Tokenizer,
    ) -> Result<PromptSource, StageError> {
        let (d, seed) = (&cfg.data, cfg.run.seed);
        match self {
            Task::Arith => arith::prompts(
                &arith::train_pairs(seed),
                tok,
                d.prompts_per_step,
                samples,
                seed,
            ),
            Task::File(path) => prompt_file(cfg, path, samples, false, tok),
        }
    }

    /// The preference pairs: prompts with their chosen and rejected responses.
    pub fn pairs(&self, cfg: &RunConfig, tok: &Tokenizer) -> Result<PromptSource, StageError> {
        let (d, seed) = (&cfg.data, cfg.run.seed);
        match self {
            Task::Arith => {
                arith::preferences(&arith::train_pairs(seed), tok, d.prompts_per_step, seed)
            }
            Task::File(path) => prompt_file(cfg, path, 1, true, tok),
        }
    }

    /// The task's own accuracy of the starting policy (measured once per
    /// run folder) and of the final one in `final_actor`, with samples —
    /// the arith task's greedy accuracy on its 500 evaluation pairs, with
    /// `eval.arith` and a policy to measure (not a reward model); `None`
    /// otherwise (a prompt file is measured through `eval.prompts`).
    pub fn accuracy(
        &self,
        kind: PipelineKind,
        cfg: &RunConfig,
        run_dir: &Path,
        final_actor: &Path,
    ) -> Result<Option<(Accuracy, Accuracy)>, PipelineError> {
        match self {
            Task::Arith if cfg.eval.arith && kind != PipelineKind::Rm => Ok(Some((
                arith_accuracy_before(cfg, run_dir)?,
                arith_accuracy(cfg, final_actor)?,
            ))),
            Task::Arith | Task::File(_) => Ok(None),
        }
    }
}

/// A prompt file read as `[data]` says: its prompt or messages column,
/// shaped by the template, chat template and system prompt; the label and
/// the columns a Python reward receives (or, for `pairs`, the chosen,
/// rejected and margin columns); prompts that leave the response no room
/// in the model's context refused.
fn prompt_file(
    cfg: &RunConfig,
    path: &Path,
    samples: usize,
    pairs: bool,
    tok: &Tokenizer,
) -> Result<PromptSource, StageError> {
    let d = &cfg.data;
    let column = match &d.messages_column {
        None => PromptColumn::Text(d.prompt_column.clone()),
        Some(messages) => PromptColumn::Messages(messages.clone()),
    };
    let extra: Vec<String> = if pairs {
        [
            Some(&d.chosen_column),
            Some(&d.rejected_column),
            d.margin_column.as_ref(),
        ]
        .into_iter()
        .flatten()
        .filter(|c| !c.is_empty())
        .cloned()
        .collect()
    } else {
        d.label_column
            .iter()
            .cloned()
            .chain(reward_columns(cfg)?)
            .collect()
    };
    // Room for the response in the model's context (pairs carry their own).
    let context =
        weir_gpu::config::ModelConfig::load(Path::new(&cfg.model.path))?.max_position_embeddings;
    let room = context
        .filter(|_| !pairs)
        .map(|c| (c.max(0) as usize).saturating_sub(cfg.generate.max_new_tokens));
    let format = PromptFormat {
        template: d.prompt_template.clone(),
        chat: d.apply_chat_template,
        system: d.system_prompt.clone(),
    };
    let limit = room.map(|tokens| PromptLimit {
        tokens,
        skip: d.skip_long_prompts,
    });
    PromptSource::from_file(
        path,
        &column,
        &format,
        &extra,
        limit,
        tok,
        d.prompts_per_step,
        samples,
        cfg.run.seed,
    )
}

/// The arith task's greedy accuracy of the checkpoint in `dir` on its 500 evaluation pairs.
pub fn arith_accuracy(cfg: &RunConfig, dir: &Path) -> Result<Accuracy, PipelineError> {
    let device = if cfg.run.device == crate::config::DeviceChoice::Cuda
        && weir_gpu::Device::cuda_count() > 0
    {
        weir_gpu::Device::Cuda(0)
    } else {
        weir_gpu::Device::Cpu
    };
    let model = weir_gpu::Model::load(dir, device, crate::context::kind(cfg))?;
    let tok = weir_gpu::Tokenizer::load(Path::new(&cfg.model.path))?;
    let threads = tch::get_num_threads();
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let result = arith::greedy_accuracy(&model, &tok, &arith::eval_pairs(), cfg.eval.batch);
    tch::set_num_threads(threads);
    Ok(result?)
}

/// The arith accuracy before training: measured once, kept in `eval.json` across resumes.
fn arith_accuracy_before(
    cfg: &RunConfig,
    dir: &Path,
) -> Result<(f64, Vec<(String, String)>), PipelineError> {
    let path = dir.join("eval.json");
    if let Ok(text) = std::fs::read_to_string(&path) {
        if let Some(acc) = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["eval_accuracy_before"].as_f64())
        {
            return Ok((acc, Vec::new()));
        }
    }
    let (acc, samples) = arith_accuracy(cfg, Path::new(&cfg.model.path))?;
    write_text(
        &path,
        &json!({"eval_accuracy_before": acc, "samples": samples}).to_string(),
    )?;
    Ok((acc, samples))
}

fn write_text(path: &Path, text: &str) -> Result<(), PipelineError> {
    Ok(weir_gpu::snapshot::write_atomically(path, text.as_bytes())?)
}
