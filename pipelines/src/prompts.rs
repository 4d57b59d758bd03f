//! The prompt sources: the arith task's pairs or a prompt file, shaped by
//! `[data]`, resumed at the run's cursor.

use std::path::Path;

use weir_gpu::Tokenizer;
use weir_graph::{StageError, WorkerInfo};
use weir_operators::rewards::arith;
use weir_operators::stages::prompt_files::PromptFormat;
use weir_operators::stages::prompt_stats::Curriculum;
use weir_operators::stages::prompts::{PromptColumn, PromptSource};

use crate::context::RunContext;
use crate::rewards::reward_columns;
use crate::RunConfig;

/// The prompt source: the arith task's training pairs or a prompt file, with the run's cursor.
pub fn prompts(
    cfg: &RunConfig,
    ctx: &RunContext,
    samples: usize,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    source(cfg, ctx, samples, false)
}

/// The preference-pair source: prompts with their chosen and rejected responses.
pub fn preference_pairs(
    cfg: &RunConfig,
    ctx: &RunContext,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    source(cfg, ctx, 1, true)
}

fn source(
    cfg: &RunConfig,
    ctx: &RunContext,
    samples: usize,
    pairs: bool,
) -> impl Fn(&WorkerInfo) -> Result<PromptSource, StageError> + Send + Sync + 'static {
    let (cfg, ctx) = (cfg.clone(), ctx.clone());
    move |w| {
        let tok = Tokenizer::load(Path::new(&cfg.model.path))?;
        let d = &cfg.data;
        let mut src = if d.prompts == "arith" && pairs {
            PromptSource::arith_preferences(
                &arith::train_pairs(cfg.run.seed),
                &tok,
                d.prompts_per_step,
                cfg.run.seed,
            )?
        } else if d.prompts == "arith" {
            PromptSource::arith(
                &arith::train_pairs(cfg.run.seed),
                &tok,
                d.prompts_per_step,
                samples,
                cfg.run.seed,
            )?
        } else {
            prompt_file(&cfg, Path::new(&d.prompts), samples, pairs, &tok)?
        };
        if d.epochs > 0 {
            src = src.epochs(d.epochs);
        }
        if let Some(cursor) = ctx.cursor {
            src.restore(cursor);
        }
        if cfg.curriculum.enabled {
            src = src.curriculum(Curriculum {
                view: ctx.stats.clone(),
                min_samples: cfg.curriculum.min_samples,
                max_solve_rate: cfg.curriculum.max_solve_rate,
                min_solve_rate: cfg.curriculum.min_solve_rate,
                max_staleness: cfg.run.max_staleness,
            });
        }
        Ok(src
            .cursor_log(ctx.cursors.clone())
            .shard(w.rank, w.role_size))
    }
}

/// A prompt file read as `[data]` says: its prompt or messages column,
/// shaped by the template, chat template and system prompt; the label and
/// the columns a Python reward receives (or, for `pairs`, the chosen,
/// rejected and margin columns); prompts that leave the response no room
/// in the model's context refused.
pub fn prompt_file(
    cfg: &RunConfig,
    path: &Path,
    samples: usize,
    pairs: bool,
    tok: &Tokenizer,
) -> Result<PromptSource, StageError> {
    let d = &cfg.data;
    let column = if d.messages_column.is_empty() {
        PromptColumn::Text(d.prompt_column.clone())
    } else {
        PromptColumn::Messages(d.messages_column.clone())
    };
    let extra: Vec<String> = if pairs {
        [&d.chosen_column, &d.rejected_column, &d.margin_column]
            .into_iter()
            .filter(|c| !c.is_empty())
            .cloned()
            .collect()
    } else {
        [d.label_column.clone()]
            .into_iter()
            .filter(|c| !c.is_empty())
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
        template: (!d.prompt_template.is_empty()).then(|| d.prompt_template.clone()),
        chat: d.apply_chat_template,
        system: (!d.system_prompt.is_empty()).then(|| d.system_prompt.clone()),
    };
    PromptSource::from_file(
        path,
        &column,
        &format,
        &extra,
        room,
        tok,
        d.prompts_per_step,
        samples,
        cfg.run.seed,
    )
}
