//! What both demos share: the small Llama they train from fresh weights,
//! and how they leave their summary and plots.

use std::path::Path;

use anyhow::Context;
use serde_json::json;
use weir_gpu::{Device, Model, ModelConfig};

/// A fresh Llama in HF layout in `dir` (beside the tokenizer); returns its parameter count.
pub(crate) fn make_model(dir: &Path, vocab: usize, seed: i64) -> anyhow::Result<i64> {
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": false,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "float32",
    });
    let generation = json!({"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3});
    for (name, value) in [
        ("config.json", config),
        ("generation_config.json", generation),
    ] {
        let path = dir.join(name);
        weir_durable::write(&path, serde_json::to_string_pretty(&value)?.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let mut model = Model::new(ModelConfig::load(dir)?, Device::Cpu, dir)?;
    model.init_weights(0.02, seed);
    model.save(dir, None)?;
    Ok(model
        .named_tensors()
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .sum())
}

/// Writes `summary` as `out/summary.json` and the plots of each of `runs`.
pub(crate) fn write_summary(
    out: &Path,
    summary: &serde_json::Value,
    runs: &[&std::path::PathBuf],
) -> anyhow::Result<()> {
    let path = out.join("summary.json");
    weir_durable::write(&path, serde_json::to_string_pretty(summary)?.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    for run in runs {
        crate::report::plot(run)?;
    }
    Ok(())
}
