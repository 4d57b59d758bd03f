//! `[eval]`: evaluation before, during and after training: the section, its
//! defaults, its rows of the key table and its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::validate::bad;
use super::ConfigError;
use crate::PipelineKind;

/// `[eval]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Greedy accuracy on the 500 arith evaluation pairs before and after (arith data only).
    pub arith: bool,
    /// Prompts per generation batch.
    pub batch: usize,
    /// Held-out prompts (a file like `data.prompts`) the final policy is evaluated on.
    #[serde(with = "none_if_empty")]
    pub prompts: Option<PathBuf>,
    /// Responses sampled per eval prompt for mean@k and pass@k (1: greedy only).
    pub k: usize,
    /// Evaluate on `prompts` every N steps during training, from step 0 (0: only at the end).
    pub every: u64,
    /// Mark the checkpoint of the best evaluation (`checkpoints/best`, `best.json`).
    pub best_checkpoint: bool,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            arith: true,
            batch: 128,
            prompts: None,
            k: 1,
            every: 0,
            best_checkpoint: false,
        }
    }
}

/// `[eval]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("eval", "arith", NotRm, "Greedy accuracy on the 500 arith evaluation pairs before and after (arith data only)."),
    key("eval", "batch", NotRm, "Prompts per evaluation batch."),
    key("eval", "prompts", NotRm, "Held-out prompts (JSONL or Parquet, read like data.prompts) the final policy is evaluated on with the run's reward: eval/reward (greedy), eval/mean_at_k and eval/pass_at_k in metrics.parquet and summary.json (empty: none)."),
    key("eval", "every", Rl, "Evaluate on eval.prompts every N steps during training: each rollout worker scores its share of the prompts with the policy its generator holds, before that step's rollouts (step 0: the starting policy); rows of stage eval in metrics.parquet, with the policy_version evaluated (0: only the final policy, at the end)."),
    key("eval", "best_checkpoint", Rl, "After the run, link checkpoints/best to the checkpoint whose policy had the best greedy eval reward (the earliest of equals) and describe it in checkpoints/best.json and summary.json; eval.every must be a multiple of run.checkpoint_every so that evaluated policies are saved."),
    key("eval", "k", NotRm, "Responses sampled per eval prompt (as in training) for mean@k and pass@k, the share of prompts whose best response's reward is positive (1: greedy only)."),
];

impl EvalSection {
    /// Held-out prompts: a file, and a policy to evaluate on them.
    pub(super) fn check_prompts(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if let Some(eval) = &self.prompts {
            if !eval.is_file() {
                return bad("eval.prompts", format!("{eval:?}"), "no such file");
            }
            if pipeline == PipelineKind::Rm {
                return bad(
                    "eval.prompts",
                    format!("{eval:?}"),
                    "a reward model has no policy to evaluate",
                );
            }
        }
        Ok(())
    }

    /// A response per prompt and a prompt per batch at least.
    pub(super) fn check_sizes(&self) -> Result<(), ConfigError> {
        if self.k == 0 {
            return bad("eval.k", "0".into(), "must be ≥ 1");
        }
        if self.batch == 0 {
            return bad("eval.batch", "0".into(), "must be at least 1");
        }
        Ok(())
    }
}
