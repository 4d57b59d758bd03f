//! LoRA's data: the adapters' shape (PEFT's `LoraConfig`) and folder
//! names, one projection's adapter as the decoder applies it, and a model's
//! set of them. Attaching, merging, saving and loading them is `lora`'s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::{nn, Tensor};

use crate::error::ModelError;

/// The projections an adapter may target (PEFT's `target_modules` names).
pub const TARGET_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The adapter file names of a PEFT folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter weights of a PEFT folder.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The shape of the adapters (PEFT's `LoraConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// `r`: the adapters' inner dimension.
    pub rank: i64,
    /// `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// `lora_dropout`: dropout on the adapter's input while training.
    pub dropout: f64,
    /// The projections adapted, e.g. `q_proj`, `v_proj`.
    pub target_modules: Vec<String>,
}

impl LoraConfig {
    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Checks the values; the first bad one's field (`rank`, `alpha`,
    /// `dropout`, `target_modules`) and what is wrong with it.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.rank <= 0 {
            return Err(("rank", format!("must be positive, got {}", self.rank)));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(("alpha", format!("must be positive, got {}", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err((
                "dropout",
                format!("must lie in [0, 1), got {}", self.dropout),
            ));
        }
        if self.target_modules.is_empty() {
            return Err(("target_modules", "is empty".into()));
        }
        if let Some(bad) = self
            .target_modules
            .iter()
            .find(|m| !TARGET_MODULES.contains(&m.as_str()))
        {
            return Err((
                "target_modules",
                format!(
                    "target module `{bad}` is not one of {}",
                    TARGET_MODULES.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// PEFT's `adapter_config.json` for adapters on the model at `base`.
    pub fn to_peft_json(&self, base: &Path) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base.display().to_string(),
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.target_modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }

    /// Reads a PEFT `adapter_config.json`: the adapters' shape and the base
    /// model's folder (relative paths are taken from the adapter folder).
    pub fn read_peft(dir: &Path) -> Result<(LoraConfig, PathBuf), ModelError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES)
            .map_err(|e| ModelError::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let bad = |key: &str, why: String| ModelError::config(&path, key, why);
        let peft_type = v["peft_type"].as_str().unwrap_or("");
        if peft_type != "LORA" {
            return Err(bad(
                "peft_type",
                format!("only LORA adapters load, found `{peft_type}`"),
            ));
        }
        for (key, plain) in [
            ("use_dora", false),
            ("use_rslora", false),
            ("fan_in_fan_out", false),
        ] {
            if v[key].as_bool().unwrap_or(plain) != plain {
                return Err(bad(key, format!("must be {plain} (not supported)")));
            }
        }
        let targets = match &v["target_modules"] {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|m| m.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad("target_modules", "must be a list of names".into()))?,
            serde_json::Value::String(s) => s.split(',').map(|m| m.trim().to_string()).collect(),
            _ => return Err(bad("target_modules", "missing".into())),
        };
        let config = LoraConfig {
            rank: v["r"]
                .as_i64()
                .ok_or_else(|| bad("r", "missing or not an integer".into()))?,
            alpha: v["lora_alpha"]
                .as_f64()
                .ok_or_else(|| bad("lora_alpha", "missing or not a number".into()))?,
            dropout: v["lora_dropout"].as_f64().unwrap_or(0.0),
            target_modules: targets,
        };
        config.check().map_err(|(field, why)| {
            let key = match field {
                "rank" => "r",
                "alpha" => "lora_alpha",
                "dropout" => "lora_dropout",
                other => other,
            };
            bad(key, why)
        })?;
        let base = v["base_model_name_or_path"]
            .as_str()
            .filter(|b| !b.is_empty())
            .ok_or_else(|| bad("base_model_name_or_path", "missing".into()))?;
        Ok((config, dir.join(base)))
    }
}

/// One projection's adapter.
#[derive(Debug)]
pub(crate) struct Adapter {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
    pub(crate) dropout: f64,
    pub(crate) training: Arc<AtomicBool>,
}

impl Adapter {
    /// `y + scale · B·A·dropout(x)`.
    pub(crate) fn add_to(&self, y: Tensor, x: &Tensor) -> Tensor {
        let x = if self.dropout > 0.0 && self.training.load(Ordering::Relaxed) {
            x.dropout(self.dropout, true)
        } else {
            x.shallow_clone()
        };
        y + x.matmul(&self.a.tr()).matmul(&self.b.tr()) * self.scale
    }
}

/// The weight update of adapter `(a, b)`: `scale · B·A` `[out, in]`.
pub(crate) fn delta(a: &Tensor, b: &Tensor, scale: f64) -> Tensor {
    b.matmul(a) * scale
}

/// A model's adapters: their shape, their store, and the training switch
/// (dropout is on only while the learner trains).
#[derive(Debug)]
pub(crate) struct Lora {
    pub(crate) config: LoraConfig,
    pub(crate) vs: nn::VarStore,
    /// Each adapted weight's `(A, B)`, by the weight's name (`model.layers.0.self_attn.q_proj.weight`).
    pub(crate) by_weight: HashMap<String, (Tensor, Tensor)>,
    pub(crate) training: Arc<AtomicBool>,
}

/// PEFT's name of adapter `which` ("A" or "B") on decoder module `module`.
pub(crate) fn peft_name(module: &str, which: &str) -> String {
    format!("base_model.model.model.{module}.lora_{which}.weight")
}

/// Adds trainable `tensor` to `vs` under the dotted `name`.
pub(crate) fn add_var(vs: &nn::VarStore, name: &str, tensor: Tensor) -> Tensor {
    let (path, last) = name.rsplit_once('.').expect("a dotted name");
    let mut at = vs.root();
    for part in path.split('.') {
        at = at.sub(part);
    }
    at.add(last, tensor, true)
}
