//! The prompt sources: the task's prompt set (`task.rs`), shaped by
//! `[data]` (epochs, curriculum), resumed at the run's cursor, sharded over
//! the rollout workers.

use std::path::Path;

use weir_gpu::Tokenizer;
use weir_graph::{StageError, WorkerInfo};
use weir_operators::stages::prompt_stats::Curriculum;
use weir_operators::stages::prompts::PromptSource;

use crate::context::RunContext;
use crate::RunConfig;

/// The prompt source: the task's prompts, with the run's cursor.
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
        let task = &cfg.data.prompts;
        let mut src = if pairs {
            task.pairs(&cfg, &tok)?
        } else {
            task.prompts(&cfg, samples, &tok)?
        };
        if d.epochs > 0 {
            src = src.epochs(d.epochs);
        }
        if let Some(cursor) = ctx.cursor {
            src.restore(cursor)?;
        }
        if cfg.curriculum.enabled {
            src = src.curriculum(Curriculum {
                view: ctx.stats.clone(),
                min_samples: cfg.curriculum.min_samples,
                max_solve_rate: cfg.curriculum.max_solve_rate,
                min_solve_rate: cfg.curriculum.min_solve_rate,
                max_staleness: w.steps.max_staleness,
            });
        }
        let (first, last) = (w.steps.first, w.steps.last);
        if let Some(last) = last {
            // Epochs too few for the steps fail here, before any step trains.
            if let Some(left) = src.steps_left() {
                let needed = (last + 1).saturating_sub(first);
                if left < needed {
                    return Err(src.shortfall(first + left, last).into());
                }
            }
            src = src.required_through(last);
        }
        Ok(src
            .cursor_log(ctx.cursors.clone())
            .shard(w.rank, w.role_size))
    }
}
