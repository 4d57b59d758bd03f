//! `config.json` of a HuggingFace checkpoint, read for the families weir runs.
//!
//! Llama, Mistral (Llama-shaped), Qwen2 (q/k/v biases) and Qwen3 (q/k
//! RMSNorm, explicit `head_dim`) differ only in the flags below, so one
//! decoder serves them all. Both config layouts are read: top-level
//! `rope_theta` + `rope_scaling` (transformers 4 and most hub checkpoints)
//! and `rope_parameters` (transformers 5).

use std::path::Path;

use serde_json::Value;

use crate::error::ModelError;

/// The model families weir runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `LlamaFor*`.
    Llama,
    /// `MistralFor*` (Llama-shaped; sliding windows are not supported).
    Mistral,
    /// `Qwen2For*`: biases on q/k/v.
    Qwen2,
    /// `Qwen3For*`: RMSNorm on q and k per head.
    Qwen3,
}

/// What sits on top of the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// `*ForCausalLM`: logits over the vocabulary.
    CausalLm,
    /// `*ForSequenceClassification`: `num_labels` scores (a reward model has one).
    SequenceClassification,
}

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// `linear`: positions divided by `factor`.
    Linear {
        /// The factor.
        factor: f64,
    },
    /// `llama3`: long wavelengths divided by `factor`, a smooth blend in between.
    Llama3 {
        /// The factor.
        factor: f64,
        /// The low-frequency factor.
        low_freq_factor: f64,
        /// The high-frequency factor.
        high_freq_factor: f64,
        /// The context length the model was trained for.
        original_max_position_embeddings: f64,
    },
}

/// What the runtime needs from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The architecture string, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    /// The family.
    pub family: Family,
    /// The head.
    pub head: Head,
    /// Vocabulary size of the embedding (may exceed the tokenizer's).
    pub vocab_size: i64,
    /// Hidden size.
    pub hidden_size: i64,
    /// MLP inner size.
    pub intermediate_size: i64,
    /// Decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_key_value_heads: i64,
    /// Per-head size.
    pub head_dim: i64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// Biases on q/k/v (and o for Llama's `attention_bias`).
    pub attention_bias: bool,
    /// Bias on the attention output projection.
    pub o_bias: bool,
    /// Biases in the MLP.
    pub mlp_bias: bool,
    /// RMSNorm on q and k per head (Qwen3).
    pub qk_norm: bool,
    /// The LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Number of scores of a classification head.
    pub num_labels: i64,
    /// Padding id, if the config names one.
    pub pad_token_id: Option<i64>,
    /// End-of-sequence ids (a list is allowed).
    pub eos_token_ids: Vec<i64>,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<i64>,
    /// The dtype the weights were saved in (`float32`, `bfloat16`, `float16`).
    pub torch_dtype: Option<String>,
    /// The longest sequence (prompt + response) the model was built for.
    pub max_position_embeddings: Option<i64>,
}

/// Architectures weir runs, for error messages.
pub const SUPPORTED: &str = "LlamaForCausalLM, LlamaForSequenceClassification, MistralForCausalLM, MistralForSequenceClassification, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen3ForCausalLM, Qwen3ForSequenceClassification";

impl ModelConfig {
    /// The number of weights of the decoder (embeddings, attention, MLP,
    /// norms and an untied output head; biases and a value head aside).
    /// Saturates at `i64::MAX` rather than overflow, for a config that
    /// describes more than any machine holds.
    pub fn parameter_count(&self) -> i64 {
        let mul = |factors: &[i64]| factors.iter().fold(1i64, |acc, &f| acc.saturating_mul(f));
        let (h, v, d) = (self.hidden_size, self.vocab_size, self.head_dim);
        let qk_norms = if self.qk_norm { mul(&[2, d]) } else { 0 };
        let layer = [
            mul(&[2, h, self.num_attention_heads, d]),
            mul(&[2, h, self.num_key_value_heads, d]),
            mul(&[3, h, self.intermediate_size]),
            mul(&[2, h]),
            qk_norms,
        ]
        .iter()
        .fold(0i64, |acc, &x| acc.saturating_add(x));
        let head = if self.tie_word_embeddings {
            0
        } else {
            mul(&[v, h])
        };
        [mul(&[v, h]), head, mul(&[self.num_hidden_layers, layer]), h]
            .iter()
            .fold(0i64, |acc, &x| acc.saturating_add(x))
    }

    /// Reads `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES)
            .map_err(|e| ModelError::io(&path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_json(&value, &path)
    }

    /// Reads a parsed `config.json`; `path` is only used in errors.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self, ModelError> {
        let architecture = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| {
                ModelError::config(
                    path,
                    "architectures",
                    "missing (expected e.g. [\"LlamaForCausalLM\"])",
                )
            })?
            .to_string();
        let unknown = || ModelError::UnknownArchitecture {
            path: path.display().to_string(),
            name: architecture.clone(),
            supported: SUPPORTED.into(),
        };
        let (family, rest) = [
            ("Llama", Family::Llama),
            ("Mistral", Family::Mistral),
            ("Qwen2", Family::Qwen2),
            ("Qwen3", Family::Qwen3),
        ]
        .iter()
        .find_map(|(prefix, f)| architecture.strip_prefix(prefix).map(|rest| (*f, rest)))
        .ok_or_else(unknown)?;
        let head = match rest {
            "ForCausalLM" => Head::CausalLm,
            "ForSequenceClassification" => Head::SequenceClassification,
            _ => return Err(unknown()),
        };
        if let Some(key) = sliding_window_in_use(v, family) {
            return Err(ModelError::config(
                path,
                key,
                "sliding-window attention is not supported (weir attends over the whole context)",
            ));
        }
        match v.get("hidden_act").and_then(Value::as_str) {
            None | Some("silu" | "swish") => {}
            Some(other) => {
                return Err(ModelError::config(
                    path,
                    "hidden_act",
                    format!("`{other}` is not supported (the MLP runs SiLU)"),
                ))
            }
        }
        let int = |key: &str| -> Result<i64, ModelError> {
            v.get(key)
                .and_then(Value::as_i64)
                .filter(|n| *n > 0)
                .ok_or_else(|| ModelError::config(path, key, "missing or not a positive integer"))
        };
        let opt_int = |key: &str| v.get(key).and_then(Value::as_i64);
        let flag =
            |key: &str, default: bool| v.get(key).and_then(Value::as_bool).unwrap_or(default);

        let hidden_size = int("hidden_size")?;
        let num_attention_heads = int("num_attention_heads")?;
        let num_key_value_heads = opt_int("num_key_value_heads").unwrap_or(num_attention_heads);
        if num_key_value_heads <= 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(ModelError::config(path, "num_key_value_heads", format!("{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}")));
        }
        let head_dim = match v.get("head_dim") {
            Some(Value::Number(n)) => n
                .as_i64()
                .filter(|d| *d > 0)
                .ok_or_else(|| ModelError::config(path, "head_dim", "not a positive integer"))?,
            _ => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(ModelError::config(
                        path,
                        "hidden_size",
                        "not divisible by num_attention_heads and no head_dim given",
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_theta = rope_params
            .and_then(|p| p.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            return Err(ModelError::config(
                path,
                "rope_theta",
                format!("{rope_theta} is not a rotary base (a number above 1)"),
            ));
        }
        let scaling = rope_params.or_else(|| v.get("rope_scaling").filter(|s| s.is_object()));
        let rope_scaling = parse_rope_scaling(scaling, path)?;
        let (attention_bias, o_bias) = match family {
            Family::Qwen2 => (true, false),
            Family::Llama | Family::Mistral | Family::Qwen3 => {
                let b = flag("attention_bias", false);
                (b, b)
            }
        };
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
            _ => Vec::new(),
        };
        let num_labels = match v.get("num_labels").and_then(Value::as_i64) {
            Some(n) => n,
            None => v
                .get("id2label")
                .and_then(Value::as_object)
                .map_or(2, |m| m.len() as i64),
        };
        Ok(ModelConfig {
            architecture,
            family,
            head,
            vocab_size: int("vocab_size")?,
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            attention_bias,
            o_bias,
            mlp_bias: flag("mlp_bias", false),
            qk_norm: family == Family::Qwen3,
            tie_word_embeddings: flag("tie_word_embeddings", false),
            num_labels,
            pad_token_id: opt_int("pad_token_id"),
            eos_token_ids,
            bos_token_id: opt_int("bos_token_id"),
            torch_dtype: v
                .get("torch_dtype")
                .or_else(|| v.get("dtype"))
                .and_then(Value::as_str)
                .map(String::from),
            max_position_embeddings: opt_int("max_position_embeddings"),
        })
    }
}

/// The key that turns on a sliding attention window shorter than the
/// context, if any: Mistral's `sliding_window`; Qwen2's and Qwen3's
/// `use_sliding_window` (on the layers from `max_window_layers` on);
/// `layer_types` naming a sliding layer (transformers ≥ 4.54 writes it).
fn sliding_window_in_use(v: &Value, family: Family) -> Option<&'static str> {
    let context = v
        .get("max_position_embeddings")
        .and_then(Value::as_i64)
        .unwrap_or(i64::MAX);
    let window_short = v
        .get("sliding_window")
        .and_then(Value::as_i64)
        .is_some_and(|w| w < context);
    if v.get("layer_types")
        .and_then(Value::as_array)
        .is_some_and(|l| l.iter().any(|t| t.as_str() == Some("sliding_attention")))
        && window_short
    {
        return Some("layer_types");
    }
    match family {
        Family::Mistral if window_short => Some("sliding_window"),
        Family::Qwen2 | Family::Qwen3 => {
            let on = v.get("use_sliding_window").and_then(Value::as_bool) == Some(true);
            let layers = v
                .get("num_hidden_layers")
                .and_then(Value::as_i64)
                .unwrap_or(0);
            let from = v
                .get("max_window_layers")
                .and_then(Value::as_i64)
                .unwrap_or(layers);
            (on && window_short && from < layers).then_some("use_sliding_window")
        }
        Family::Llama | Family::Mistral => None,
    }
}

fn parse_rope_scaling(scaling: Option<&Value>, path: &Path) -> Result<RopeScaling, ModelError> {
    let Some(s) = scaling else {
        return Ok(RopeScaling::None);
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |key: &str| {
        let key_name = format!("rope_scaling.{key}");
        match s.get(key).and_then(Value::as_f64) {
            None => Err(ModelError::config(
                path,
                &key_name,
                format!("missing for rope type `{kind}`"),
            )),
            Some(x) if !(x.is_finite() && x > 0.0) => Err(ModelError::config(
                path,
                &key_name,
                format!("{x} is not a positive number"),
            )),
            Some(x) => Ok(x),
        }
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(ModelError::config(
            path,
            "rope_scaling.rope_type",
            format!("`{other}` is not supported (default, linear, llama3)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "eos_token_id": 2})
    }

    #[test]
    fn reads_both_rope_layouts() {
        let mut v4 = base();
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = ModelConfig::from_json(&v4, Path::new("c.json")).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6});
        let c = ModelConfig::from_json(&v5, Path::new("c.json")).unwrap();
        assert_eq!(
            (c.rope_theta, c.rope_scaling.clone(), c.head_dim),
            (1e6, RopeScaling::None, 16)
        );
    }

    #[test]
    fn family_flags_and_eos_lists() {
        let mut q = base();
        q["architectures"] = json!(["Qwen2ForCausalLM"]);
        q["eos_token_id"] = json!([2, 0]);
        let c = ModelConfig::from_json(&q, Path::new("c.json")).unwrap();
        assert!(c.attention_bias && !c.o_bias && !c.qk_norm);
        assert_eq!(c.eos_token_ids, vec![2, 0]);
        q["architectures"] = json!(["Qwen3ForSequenceClassification"]);
        q["head_dim"] = json!(32);
        let c = ModelConfig::from_json(&q, Path::new("c.json")).unwrap();
        assert_eq!(
            (c.head, c.qk_norm, c.head_dim, c.attention_bias),
            (Head::SequenceClassification, true, 32, false)
        );
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let mut bad = base();
        bad["architectures"] = json!(["GPT2LMHeadModel"]);
        let err = ModelConfig::from_json(&bad, Path::new("m/config.json"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("m/config.json") && err.contains("GPT2LMHeadModel"),
            "{err}"
        );
        let mut bad = base();
        bad.as_object_mut().unwrap().remove("hidden_size");
        let err = ModelConfig::from_json(&bad, Path::new("m/config.json"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`hidden_size`"), "{err}");
        let mut bad = base();
        bad["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(ModelConfig::from_json(&bad, Path::new("c"))
            .unwrap_err()
            .to_string()
            .contains("yarn"));
        for (key, value, says) in [
            (
                "rope_scaling",
                json!({"rope_type": "linear", "factor": 0.0}),
                "rope_scaling.factor",
            ),
            (
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": -1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                "rope_scaling.low_freq_factor",
            ),
            ("rope_theta", json!(0.0), "`rope_theta`"),
        ] {
            let mut bad = base();
            bad[key] = value;
            let err = ModelConfig::from_json(&bad, Path::new("c"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{err}");
        }
        let mut bad = base();
        bad["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&bad, Path::new("c"))
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads"));
        let mut bad = base();
        bad["hidden_act"] = json!("gelu");
        let err = ModelConfig::from_json(&bad, Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`hidden_act`") && err.contains("gelu"),
            "{err}"
        );
    }

    /// A sliding window shorter than the context is refused whichever way
    /// the config turns it on; a window that is off, or as long as the
    /// context, is not.
    #[test]
    fn sliding_windows_in_use_are_refused() {
        let window = |arch: &str, extra: Value| {
            let mut v = base();
            v["architectures"] = json!([arch]);
            v["max_position_embeddings"] = json!(4096);
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            ModelConfig::from_json(&v, Path::new("c"))
                .err()
                .map(|e| e.to_string())
        };
        for (arch, extra, key) in [
            (
                "MistralForCausalLM",
                json!({"sliding_window": 1024}),
                "sliding_window",
            ),
            (
                "Qwen2ForCausalLM",
                json!({"use_sliding_window": true, "sliding_window": 1024, "max_window_layers": 1}),
                "use_sliding_window",
            ),
            (
                "Qwen3ForCausalLM",
                json!({"sliding_window": 1024, "layer_types": ["full_attention", "sliding_attention"]}),
                "layer_types",
            ),
        ] {
            let err = window(arch, extra).expect(arch);
            assert!(err.contains(&format!("`{key}`")), "{err}");
        }
        for (arch, extra) in [
            ("MistralForCausalLM", json!({"sliding_window": 4096})),
            ("MistralForCausalLM", json!({"sliding_window": null})),
            (
                "Qwen2ForCausalLM",
                json!({"use_sliding_window": false, "sliding_window": 1024}),
            ),
            // Every layer below max_window_layers: none slides.
            (
                "Qwen2ForCausalLM",
                json!({"use_sliding_window": true, "sliding_window": 1024, "max_window_layers": 2}),
            ),
            (
                "Qwen3ForCausalLM",
                json!({"sliding_window": null, "layer_types": ["full_attention", "full_attention"]}),
            ),
        ] {
            assert_eq!(window(arch, extra.clone()), None, "{arch} {extra}");
        }
    }
}
