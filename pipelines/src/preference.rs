//! Training on preference pairs: `rm` (a Bradley–Terry reward model) and
//! `dpo` (DPO, cDPO, IPO against a frozen reference). Pairs flow from the
//! source into the trainer, one optimizer step per step.

use std::path::Path;

use weir_gpu::{Model, Tokenizer};
use weir_graph::{Partition, Pipeline};
use weir_operators::stages::preference::{DpoTrainer, PairConfig, PreferenceLoss, RewardTrainer};

use crate::config::PreferenceChoice;
use crate::context::RunContext;
use crate::roles::{self, ROLLOUT, TRAIN};
use crate::{PipelineError, RunConfig};

/// The reward model: the config's `model.reward_model` if set, else the
/// actor's checkpoint with a fresh one-output score head.
pub fn rm(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    let (c, x) = (cfg.clone(), ctx.clone());
    let group = roles::data_parallel_group(cfg);
    Ok(Pipeline::new("rm")
        .source(ROLLOUT, crate::prompts::preference_pairs(cfg, ctx))
        .stage("rm", TRAIN, Partition::RoundRobin, move |w| {
            let start = match &c.model.reward_model {
                Some(dir) if x.resumed_from.is_none() => dir.clone(),
                _ => x.actor.clone(),
            };
            let model = Model::load_critic(
                &start,
                crate::context::device(&c, w)?,
                crate::context::kind(&c),
            )?;
            let tok = Tokenizer::load(Path::new(&c.model.path))?;
            let mut trainer = RewardTrainer::new(model, tok, pair_config(&c))?
                .with_checkpoints(x.checkpoint_plan(&c));
            if let Some(group) = &group {
                trainer = trainer.with_data_parallel(group.member(w, "rm")?)?;
            }
            x.restore_optimizer("actor", trainer.optimizer_mut())?;
            Ok(trainer)
        })
        .offload(roles::MODEL_QUEUE))
}

/// DPO and its variants (`algorithm.preference_loss`), the reference being
/// `model.reference` (default: the actor's starting checkpoint).
pub fn dpo(cfg: &RunConfig, ctx: &RunContext) -> Result<Pipeline, PipelineError> {
    let (c, x) = (cfg.clone(), ctx.clone());
    let group = roles::data_parallel_group(cfg);
    Ok(Pipeline::new("dpo")
        .source(ROLLOUT, crate::prompts::preference_pairs(cfg, ctx))
        .stage("dpo", TRAIN, Partition::RoundRobin, move |w| {
            let a = &c.algorithm;
            let policy = crate::context::load_policy(&c, &x.actor, w)?;
            let reference_dir = c.model.reference_dir();
            let reference = crate::context::load_frozen(&c, reference_dir, w)?;
            let loss = match a.preference_loss {
                PreferenceChoice::Ipo => PreferenceLoss::Ipo,
                PreferenceChoice::Cdpo => PreferenceLoss::Cdpo {
                    label_smoothing: a.label_smoothing,
                },
                PreferenceChoice::Dpo => PreferenceLoss::Dpo,
            };
            let tok = Tokenizer::load(Path::new(&c.model.path))?;
            let mut trainer =
                DpoTrainer::new(policy, reference, tok, pair_config(&c), a.beta, loss)?
                    .with_checkpoints(x.checkpoint_plan(&c));
            if let Some(group) = &group {
                trainer = trainer.with_data_parallel(group.member(w, "dpo")?)?;
            }
            x.restore_optimizer("actor", trainer.optimizer_mut())?;
            Ok(trainer)
        })
        .offload(roles::MODEL_QUEUE))
}

fn pair_config(c: &RunConfig) -> PairConfig {
    let a = &c.algorithm;
    PairConfig {
        adamw: roles::adamw(c, a.lr),
        schedule: roles::schedule(c),
        max_grad_norm: (a.max_grad_norm > 0.0).then_some(a.max_grad_norm),
        chosen: c.data.chosen_column.clone(),
        rejected: c.data.rejected_column.clone(),
        margin: c.data.margin_column.clone(),
    }
}
