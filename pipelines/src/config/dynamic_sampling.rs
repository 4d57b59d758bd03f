//! `[dynamic_sampling]`: DAPO's dynamic sampling: the section, its rows of
//! the key table and its check.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::ConfigError;
use crate::PipelineKind;

/// `[dynamic_sampling]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DynamicSamplingSection {
    /// Drop groups whose rewards all agree (DAPO).
    pub enabled: bool,
    /// Groups per step for the learner (0: every informative group); set
    /// `data.prompts_per_step` above it to oversample.
    pub target_groups: usize,
    /// How many later steps' prompts a step short of `target_groups` waits
    /// for (verl's extra generation batches; 0: it trains short), at most
    /// `run.max_staleness`.
    pub max_extra_batches: u64,
}

/// `[dynamic_sampling]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("dynamic_sampling", "enabled", Group, "Drop prompt groups whose scores all agree (DAPO; the score is the reward before reward.overlong_buffer's penalty, as verl's DAPO filters on acc)."),
    key("dynamic_sampling", "target_groups", Group, "Groups per step for the learner (0: every informative group), at most data.prompts_per_step; oversample with a larger data.prompts_per_step. A step's surplus waits in a pool for later steps (within run.max_staleness); a step short of the target trains on the groups it has (groups_emitted says how many), unless max_extra_batches lets it wait."),
    key("dynamic_sampling", "max_extra_batches", Group, "A step short of target_groups waits for the informative groups of up to this many later steps' prompts, in order, until it has the target, as verl generates more batches (max_num_gen_batches − 1); past them it trains on what it has. 0: no waiting. At most run.max_staleness (those steps are generated while it waits); a checkpoint step takes no later step's groups. Recorded as extra_steps."),
];

impl DynamicSamplingSection {
    /// DAPO's filter needs groups. (Its reach, against `run.max_staleness`
    /// and `data.prompts_per_step`, is checked in `validate.rs`.)
    pub(super) fn check(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if self.enabled && !pipeline.is_group() {
            return bad(
                "dynamic_sampling.enabled",
                "true".into(),
                "needs a group estimator (grpo, dr_grpo, rloo, opo, grpo_passk, gpg)",
            );
        }
        Ok(())
    }
}
