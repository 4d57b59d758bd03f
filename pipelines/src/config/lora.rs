//! `[lora]`: LoRA adapters for the actor: the section, its defaults, its
//! rows of the key table and its checks.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::ConfigError;

/// `[lora]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Adapter rank (0: no adapters, the whole model trains).
    pub rank: i64,
    /// The adapters' update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapters' input while training.
    pub dropout: f64,
    /// The projections that get adapters.
    pub target_modules: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: 0,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: weir_gpu::lora::TARGET_MODULES
                .iter()
                .map(|m| m.to_string())
                .collect(),
        }
    }
}

impl LoraSection {
    /// The adapters' shape, when `rank > 0`.
    pub fn adapters(&self) -> Option<weir_gpu::lora::LoraConfig> {
        (self.rank > 0).then(|| weir_gpu::lora::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
        })
    }
}

/// `[lora]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("lora", "rank", NotRm, "LoRA adapters of this rank on the actor (0: none, the whole model trains). Only the adapters train; the reference is the same frozen weights without them (one copy per device, shared by the roles there); the weights edge carries only the adapters; checkpoints are PEFT adapter folders (adapter_config.json, adapter_model.safetensors) that peft loads onto model.path and that weir merge turns into a plain checkpoint."),
    key("lora", "alpha", NotRm, "The adapters' update is scaled by alpha / rank."),
    key("lora", "dropout", NotRm, "Dropout on the adapters' input while the learner trains (needs algorithm.gradient_checkpointing = false)."),
    key("lora", "target_modules", NotRm, "The projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."),
];

impl LoraSection {
    /// A rank ≥ 0, and adapters of a shape they can take.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if self.rank < 0 {
            return bad("lora.rank", self.rank.to_string(), "must be ≥ 0");
        }
        if let Some(adapters) = self.adapters() {
            if let Err((field, why)) = adapters.check() {
                let value = match field {
                    "rank" => self.rank.to_string(),
                    "alpha" => self.alpha.to_string(),
                    "dropout" => self.dropout.to_string(),
                    _ => format!("{:?}", self.target_modules),
                };
                return bad(&format!("lora.{field}"), value, &why);
            }
        }
        Ok(())
    }
}
