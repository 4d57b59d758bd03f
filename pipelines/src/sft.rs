//! Supervised fine-tuning as a pipeline: prompts with their targets flow
//! from the source into the trainer, one optimizer step per step.

use std::path::Path;

use weir_gpu::Tokenizer;
use weir_graph::{Partition, Pipeline};
use weir_operators::stages::sft::{SftConfig, SftTrainer};

use crate::context::RunContext;
use crate::roles::{self, ROLLOUT, TRAIN};
use crate::{PipelineError, RunConfig};

/// SFT on `data.label_column` (the target text; the end-of-turn token is appended).
pub fn sft(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    let (c, x) = (cfg.clone(), ctx.clone());
    let group = roles::data_parallel_group(cfg);
    Ok(Pipeline::new("sft")
        .source(ROLLOUT, crate::prompts::prompts(cfg, ctx, 1))
        .stage("sft", TRAIN, Partition::RoundRobin, move |w| {
            let a = &c.algorithm;
            let model = crate::context::load_policy(&c, &x.actor, w)?;
            let tok = Tokenizer::load(Path::new(&c.model.path))?;
            let config = SftConfig {
                adamw: roles::adamw(&c, a.lr),
                schedule: roles::schedule(&c),
                max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
                micro_batch: a.micro_batch,
                gradient_checkpointing: a.gradient_checkpointing,
                logprob_chunk: a.logprob_chunk,
            };
            let mut trainer = SftTrainer::new(model, tok, crate::rewards::label(&c), config)?
                .with_checkpoints(x.checkpoint_plan(&c));
            if let Some(group) = &group {
                trainer = trainer.with_data_parallel(group.member(w, "sft")?)?;
            }
            x.restore_optimizer("actor", trainer.optimizer_mut())?;
            Ok(trainer)
        })
        .offload(roles::MODEL_QUEUE))
}
