//! Random Llama checkpoints for the benches, in the shape of the TRL
//! throughput baseline (`../shared/bench/trl/grpo_throughput.py`): vocabulary
//! 1000, 8 query and 4 key/value heads, untied embeddings, float32, with the
//! fixtures' tokenizer beside them so that `weir run` can load them.

use std::path::{Path, PathBuf};

use weir::gpu::{Device, Model, ModelConfig};

/// The random 24.6M Llama of the TRL throughput baseline (hidden 512, 8
/// layers, MLP 1,408, 512 positions), written to `dir`.
pub fn random_llama(dir: &Path) -> PathBuf {
    random_model(dir, "random-llama-24.6m", 512, 8, 1408, 512)
}

/// A random Llama of vocabulary 1000 with 8 query and 4 key/value heads of
/// `hidden / 8`, written to `dir/name`.
pub fn random_model(
    dir: &Path,
    name: &str,
    hidden: i64,
    layers: i64,
    intermediate: i64,
    positions: i64,
) -> PathBuf {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3, "hidden_act": "silu", "torch_dtype": "float32"
    });
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    std::fs::write(
        out.join("generation_config.json"),
        r#"{"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3}"#,
    )
    .unwrap();
    let tokenizer = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        if tokenizer.join(file).is_file() {
            std::fs::copy(tokenizer.join(file), out.join(file)).unwrap();
        }
    }
    let mut model = Model::new(ModelConfig::load(&out).unwrap(), Device::Cpu, &out).unwrap();
    model.init_weights(0.02, 42);
    model.save(&out, None).unwrap();
    out
}
