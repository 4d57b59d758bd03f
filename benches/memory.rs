//! Memory of the learner's log-prob pass with and without the chunked
//! output head (`algorithm.logprob_chunk`): one actor update of a random
//! Llama with a 65,536-token vocabulary (hidden 64, 2 layers) on 8 rows of
//! 16 prompt and 512 response tokens, each configuration in a child process
//! of its own. Prints per configuration the resident memory of the weights
//! and of AdamW's state (float32 moments), the peak the update added on top
//! (VmHWM after − before: gradients, activations, the head's logits) and
//! its seconds, then
//!
//! ```text
//! logprob_chunk_1024_peak_over_whole=<ratio>   (the 1024-position chunks' peak ÷ the whole head's)
//! logprob_chunk_1024_time_over_whole=<ratio>
//! ```
//!
//! `cargo bench --bench memory`; under `cargo test` a smaller setting (8,192
//! tokens, 128-token responses) checks that it runs.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use weir::gpu::{Device, Model, ModelConfig};
use weir::operators::data::columns::{float_list_array, token_list_array};
use weir::operators::rollout::col;
use weir::operators::stages::learner::{Learner, LearnerConfig};

fn status_kb(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn peak_kb() -> u64 {
    status_kb("VmHWM:")
}

fn rss_mb() -> f64 {
    status_kb("VmRSS:") as f64 / 1024.0
}

/// One update with `chunk`; prints `peak_mb=… seconds=…`.
fn child(chunk: usize, vocab: usize, response: usize, dir: &Path) {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3, "hidden_act": "silu", "torch_dtype": "float32"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let start = rss_mb();
    let mut model = Model::new(ModelConfig::load(dir).unwrap(), Device::Cpu, dir).unwrap();
    model.init_weights(0.02, 7);
    let weights_mb = rss_mb() - start;
    let rows = 8;
    let prompts: Vec<Vec<i64>> = (0..rows)
        .map(|r| {
            (0..16)
                .map(|t| 4 + (r * 31 + t * 7) as i64 % 1000)
                .collect()
        })
        .collect();
    let responses: Vec<Vec<i64>> = (0..rows)
        .map(|r| {
            (0..response)
                .map(|t| 4 + (r * 13 + t * 17) as i64 % (vocab as i64 - 4))
                .collect()
        })
        .collect();
    let advantages: Vec<Vec<f64>> = (0..rows)
        .map(|r| vec![if r % 2 == 0 { 1.0 } else { -1.0 }; response])
        .collect();
    let behaviour: Vec<Vec<f64>> = (0..rows).map(|_| vec![-11.0; response]).collect();
    let batch = arrow::array::RecordBatch::try_from_iter([
        (col::PROMPT_TOKENS, token_list_array(&prompts)),
        (col::RESPONSE_TOKENS, token_list_array(&responses)),
        (col::ADVANTAGES, float_list_array(&advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(&behaviour)),
    ])
    .unwrap();
    let cfg = LearnerConfig {
        micro_batch: rows,
        logprob_chunk: chunk,
        entropy_coef: 0.01,
        ..LearnerConfig::default()
    };
    let before_optimizer = rss_mb();
    let mut learner = Learner::new(model, cfg).unwrap();
    let optimizer_mb = rss_mb() - before_optimizer;
    let before = peak_kb();
    let started = Instant::now();
    let stats = learner.update(&batch).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    assert!(stats.loss.is_finite());
    let peak_mb = (peak_kb() - before) as f64 / 1024.0;
    println!(
        "weights_mb={weights_mb:.1} optimizer_mb={optimizer_mb:.1} peak_mb={peak_mb:.1} seconds={seconds:.3}"
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (vocab, response) = if full { (65_536, 512) } else { (8_192, 128) };
    if let Ok(chunk) = std::env::var("WEIR_MEMORY_CHILD") {
        let dir = tempfile::tempdir().unwrap();
        child(chunk.parse().unwrap(), vocab, response, dir.path());
        return;
    }
    let mut figures = Vec::new();
    for chunk in [0usize, 1024, 256] {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        if full {
            cmd.arg("--bench");
        }
        let out = cmd
            .env("WEIR_MEMORY_CHILD", chunk.to_string())
            .output()
            .expect("the bench runs itself");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "chunk {chunk}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = text.lines().last().unwrap_or_default().to_string();
        let field = |key: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN)
        };
        let (peak, seconds) = (field("peak_mb="), field("seconds="));
        let (weights, optimizer) = (field("weights_mb="), field("optimizer_mb="));
        println!(
            "logprob_chunk={chunk} vocab={vocab} rows=8 response_tokens={response}: weights_mb={weights:.1} adamw_state_mb={optimizer:.1} update_peak_added_mb={peak:.1} seconds={seconds:.3}"
        );
        figures.push((chunk, peak, seconds));
    }
    let whole = figures[0];
    let chunked = figures[1];
    println!(
        "logprob_chunk_1024_peak_over_whole={:.3}",
        chunked.1 / whole.1
    );
    println!(
        "logprob_chunk_1024_time_over_whole={:.3}",
        chunked.2 / whole.2
    );
}
