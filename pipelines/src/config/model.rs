//! `[model]`: the checkpoints of the roles (actor, reference, reward model,
//! critic): the section, its defaults, its rows of the key table and its
//! check.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::validate::bad;
use super::{ConfigError, Dtype};

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// The actor's HF checkpoint folder (required).
    pub path: PathBuf,
    /// Compute dtype: `f32`, `bf16`, `f16`.
    pub dtype: Dtype,
    /// The frozen reference (none: the actor's checkpoint).
    #[serde(with = "none_if_empty")]
    pub reference: Option<PathBuf>,
    /// A reward model checkpoint, for `reward.kind = "model"`.
    #[serde(with = "none_if_empty")]
    pub reward_model: Option<PathBuf>,
    /// The critic's initial checkpoint (ppo; none: the reward model, else the actor with a fresh head).
    #[serde(with = "none_if_empty")]
    pub critic: Option<PathBuf>,
}

impl ModelSection {
    /// The frozen reference's checkpoint: `reference`, else the actor's.
    pub fn reference_dir(&self) -> &PathBuf {
        self.reference.as_ref().unwrap_or(&self.path)
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: PathBuf::new(),
            dtype: Dtype::F32,
            reference: None,
            reward_model: None,
            critic: None,
        }
    }
}

/// `[model]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("model", "path", All, "The actor's HuggingFace checkpoint folder (required)."),
    key("model", "dtype", All, "Compute dtype: \"f32\", \"bf16\" or \"f16\". Trainers of a half-precision model keep float32 master weights and AdamW moments (saved in optimizer.safetensors as master.*): the update lands on the master, the weights are it rounded."),
    key("model", "reference", RlAndDpo, "The frozen reference's checkpoint (empty: the actor's). It scores the policy's token ids: its tokenizer must read every id of the policy's as the policy's does and its vocab_size reach the policy's."),
    key("model", "reward_model", RlAndRm, "A reward model checkpoint, for reward.kind = \"model\". Where its tokenizer reads every id of the policy's as the policy's does and its vocab_size reaches the policy's, it scores the policy's tokens; otherwise it reads each row as text: the prompt's conversation with the completion as the assistant's answer, rendered by its own chat template and tokenizer (PPO's critic may then not start from it: set model.critic)."),
    key("model", "critic", Ppo, "The critic's initial checkpoint (ppo; empty: the reward model, else the actor with a fresh value head). It reads the policy's token ids: its tokenizer must read every id of the policy's as the policy's does and its vocab_size reach the policy's."),
];

impl ModelSection {
    /// The actor's checkpoint folder is given. (The other checkpoints are
    /// held to the actor's token ids in `validate.rs`: that check reads
    /// `[teacher]` too.)
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if self.path.as_os_str().is_empty() {
            return bad(
                "model.path",
                "\"\"".into(),
                "the actor's checkpoint folder is required",
            );
        }
        Ok(())
    }
}
