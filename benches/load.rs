//! Peak memory of loading a bf16 checkpoint: `weir generate --dtype bf16`
//! (one prompt, one new token) on a Qwen2.5-1.5B-shaped checkpoint with
//! random bf16 weights, written here tensor by tensor, each load in a child
//! process of its own, its peak resident memory (`ru_maxrss`) taken from
//! the kernel as the child ends. Beside it, in the same invocation, the
//! staged load a model made before direct loading (float32 parameters
//! filled from the file, then cast to bf16) through the library's public
//! calls, and the floor (the same command on a checkpoint of the same
//! config with one layer and a 16-token vocabulary: libtorch, the rotary
//! tables, the generator's buffers). Last line:
//!
//! ```text
//! load: generate_peak_over_file=<f> staged_peak_over_file=<f>
//! ```
//!
//! `cargo bench --bench load`; under `cargo test` a 4-layer, 4,096-token
//! vocabulary shape of the same family checks that it runs.

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use weir::gpu::{Device, Model};

/// The child's job, by name.
const CHILD: &str = "WEIR_LOAD_BENCH_CHILD";

/// A Qwen2-family shape.
#[derive(Clone, Copy)]
struct Shape {
    hidden: u64,
    layers: u64,
    intermediate: u64,
    heads: u64,
    kv_heads: u64,
    vocab: u64,
}

/// Qwen2.5-1.5B's.
const QWEN2_5_1_5B: Shape = Shape {
    hidden: 1536,
    layers: 28,
    intermediate: 8960,
    heads: 12,
    kv_heads: 2,
    vocab: 151_936,
};

const SMALL: Shape = Shape {
    hidden: 256,
    layers: 4,
    intermediate: 704,
    heads: 4,
    kv_heads: 2,
    vocab: 4096,
};

impl Shape {
    /// Every tensor of the checkpoint, by HuggingFace name, with its shape
    /// (tied embeddings: no `lm_head`).
    fn tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let head_dim = h / self.heads;
        let (q, kv) = (self.heads * head_dim, self.kv_heads * head_dim);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            out.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
                (format!("{p}.self_attn.q_proj.bias"), vec![q]),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.k_proj.bias"), vec![kv]),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
                (format!("{p}.self_attn.v_proj.bias"), vec![kv]),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
                (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        out
    }

    fn config(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "tie_word_embeddings": true,
            "hidden_act": "silu",
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "bfloat16",
        })
    }
}

/// Writes a safetensors checkpoint of `shape` with random bf16 weights
/// (norms at one) into `dir`, a tensor at a time; returns the file's bytes.
fn write_checkpoint(dir: &Path, shape: &Shape) -> u64 {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&shape.config()).unwrap(),
    )
    .unwrap();
    let tensors = shape.tensors();
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dims) in &tensors {
        let bytes = 2 * dims.iter().product::<u64>();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut text = serde_json::to_string(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let path = dir.join("model.safetensors");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    file.write_all(&(text.len() as u64).to_le_bytes()).unwrap();
    file.write_all(text.as_bytes()).unwrap();
    // Values of about ±0.03 from a xorshift generator: bf16 is the top half of a float32.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut chunk = Vec::new();
    for (name, dims) in &tensors {
        let n = dims.iter().product::<u64>() as usize;
        let norm = name.ends_with("norm.weight");
        chunk.clear();
        chunk.reserve(2 * n);
        for _ in 0..n {
            let value = if norm {
                1.0f32
            } else {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.06
            };
            chunk.extend_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes());
        }
        file.write_all(&chunk).unwrap();
    }
    file.flush().unwrap();
    std::fs::metadata(&path).unwrap().len()
}

/// Peak resident bytes and seconds of `command`, run to its end (its
/// output to `log`, shown if it fails).
fn peak_of(mut command: Command, log: &Path) -> (u64, f64) {
    let started = Instant::now();
    let out = std::fs::File::create(log).unwrap();
    command.stdout(out.try_clone().unwrap()).stderr(out);
    // Reaped by `wait4` below, which also reports its peak memory.
    #[allow(clippy::zombie_processes)]
    let child = command.spawn().expect("start the child");
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child and fills `status` and `usage`.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32, "wait4");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{command:?} failed (status {status}): {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    (
        usage.ru_maxrss as u64 * 1024,
        started.elapsed().as_secs_f64(),
    )
}

fn generate(dir: &Path, input: &Path, output: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_weir"));
    command
        .arg("generate")
        .arg("--model")
        .arg(dir)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(output)
        .args(["--dtype", "bf16", "--max-new-tokens", "1", "--greedy"]);
    command
}

/// The staged load, in this (child) process: float32 parameters filled
/// from the file, then cast to bf16.
fn staged_child(dir: &Path) {
    let config = weir::gpu::ModelConfig::load(dir).unwrap();
    let mut model = Model::new(config, Device::Cpu, dir).unwrap();
    model.load_weights(dir).unwrap();
    model.var_store_mut().set_kind(tch::Kind::BFloat16);
    assert_eq!(model.kind(), tch::Kind::BFloat16);
}

fn main() {
    if let Ok(dir) = std::env::var(CHILD) {
        staged_child(Path::new(&dir));
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let shape = if full { QWEN2_5_1_5B } else { SMALL };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let floor_dir = tmp.path().join("floor");
    let file_bytes = write_checkpoint(&dir, &shape);
    write_checkpoint(
        &floor_dir,
        &Shape {
            layers: 1,
            vocab: 16,
            ..shape
        },
    );
    let input = tmp.path().join("prompts.jsonl");
    std::fs::write(&input, "{\"input_ids\": [3, 4, 5, 6]}\n").unwrap();
    let output = tmp.path().join("out.parquet");
    println!(
        "== loading a bf16 checkpoint: {} layers, hidden {}, vocab {}, {:.2} GB of weights ==",
        shape.layers,
        shape.hidden,
        shape.vocab,
        file_bytes as f64 / 1e9
    );
    let log = tmp.path().join("child.log");
    let (floor, _) = peak_of(generate(&floor_dir, &input, &output), &log);
    let (direct, direct_s) = peak_of(generate(&dir, &input, &output), &log);
    let mut staged = Command::new(std::env::current_exe().unwrap());
    staged.env(CHILD, &dir);
    let (staged, staged_s) = peak_of(staged, &log);
    let gb = |b: u64| b as f64 / 1e9;
    println!(
        "floor (weir generate, 1 layer, 16 tokens): peak {:.2} GB",
        gb(floor)
    );
    println!(
        "weir generate --dtype bf16: peak {:.2} GB in {direct_s:.1} s",
        gb(direct)
    );
    println!(
        "staged load (float32, then bf16), library only: peak {:.2} GB in {staged_s:.1} s",
        gb(staged)
    );
    let ratio = |b: u64| b as f64 / file_bytes as f64;
    println!(
        "load: generate_peak_over_file={:.3} staged_peak_over_file={:.3}",
        ratio(direct),
        ratio(staged)
    );
}
