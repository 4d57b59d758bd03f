//! Where a GRPO run's memory goes, with and without LoRA, at the shape of a
//! real 135M instruct checkpoint (SmolLM2-135M: hidden 576, 30 layers, 9
//! heads, 3 KV heads, MLP 1,536, vocabulary 49,152, tied embeddings;
//! random weights, float32) and the issue's run: 4 prompts × 4 samples, 24
//! new tokens, 1 thread.
//!
//! Each measurement runs in a child process of its own:
//! - `breakdown`: the roles of one worker built one by one as the pipeline
//!   builds them (generator, reference, learner with AdamW), then one
//!   generation, one reference pass and one update; after each, the
//!   resident memory it added (`VmRSS`) and the peak it reached on top
//!   (`VmHWM`), so the table says which part is weights copies, optimizer
//!   state, the CPU kernels' packed weights and KV cache, activations.
//! - `run`: a whole `weir run grpo` of 3 steps (k = 0, one worker): its
//!   peak resident memory; also with gradient checkpointing
//!   (`algorithm.gradient_checkpointing`, TRL's default).
//!
//! The last lines are
//!
//! ```text
//! run_peak_over_fp32_weights=<ratio>        (full fine-tuning; the issue's target ≤ 8)
//! checkpointed_run_peak_over_fp32_weights=<ratio>   (the same with gradient checkpointing)
//! lora_run_peak_over_fp32_weights=<ratio>   (rank 16 on all seven projections)
//! lora_peak_over_full_peak=<ratio>
//! ```
//!
//! `cargo bench --bench run_memory`; under `cargo test` a 1-layer model of
//! hidden 64 (the same vocabulary) checks that it runs (whole runs of one step).

use std::path::{Path, PathBuf};
use std::process::Command;

use weir::gpu::generate::{generate_on, Backend};
use weir::gpu::lora::LoraConfig;
use weir::gpu::{Device, Model, ModelConfig, SamplingParams};
use weir::operators::data::columns::{float_list_array, token_list_array};
use weir::operators::rollout::col;
use weir::operators::stages::learner::{Learner, LearnerConfig};
use weir::operators::training::sequences::response_logprobs;
use weir::pipelines::{PipelineKind, RunConfig, RunRequest};

const PROMPTS: usize = 4;
const SAMPLES: usize = 4;
const NEW_TOKENS: usize = 24;

fn status_mb(key: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn rss() -> f64 {
    status_mb("VmRSS:")
}

fn peak() -> f64 {
    status_mb("VmHWM:")
}

/// Writes the random checkpoint (and the fixtures' tokenizer) to `dir`;
/// returns its float32 weight bytes.
/// The SmolLM2-135M-shaped checkpoint (`full`), or for `cargo test` one
/// layer of hidden 64 with the tokenizer's vocabulary: its whole runs
/// check that every measurement runs, in seconds rather than a minute.
fn make_checkpoint(dir: &Path, full: bool) -> u64 {
    let (layers, hidden, mlp, heads, kv_heads) = if full {
        (30, 576, 1536, 9, 3)
    } else {
        (1, 64, 176, 4, 2)
    };
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "hidden_act": "silu",
        "torch_dtype": "float32"
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        let from = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizer")
            .join(file);
        if from.is_file() {
            std::fs::copy(&from, dir.join(file)).unwrap();
        }
    }
    let mut model = Model::new(ModelConfig::load(dir).unwrap(), Device::Cpu, dir).unwrap();
    model.init_weights(0.02, 7);
    model.save(dir, None).unwrap();
    std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len()
}

fn adapters() -> LoraConfig {
    LoraConfig {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        target_modules: weir::gpu::lora::TARGET_MODULES
            .iter()
            .map(|m| m.to_string())
            .collect(),
    }
}

/// Prints `name added_mb peak_added_mb` for what `f` did.
fn part<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let (before, peak_before) = (rss(), peak());
    let out = f();
    println!(
        "part {name} added_mb={:.0} peak_added_mb={:.0}",
        rss() - before,
        (peak() - peak_before.max(before)).max(0.0)
    );
    out
}

/// The roles of one worker, built and run once each.
fn breakdown(dir: &Path, lora: bool) {
    weir::gpu::device::set_threads(1);
    println!("part start rss_mb={:.0}", rss());
    let policy = |seed| {
        if lora {
            let mut m = Model::load_shared(dir, Device::Cpu, tch::Kind::Float).unwrap();
            m.add_lora(&adapters(), seed).unwrap();
            m
        } else {
            Model::load(dir, Device::Cpu, tch::Kind::Float).unwrap()
        }
    };
    let mut generator = part("generator_weights", || policy(1));
    // As the pipeline's reference role: on the CPU kernels its packing alone
    // holds its weights (with LoRA the frozen base stays, shared).
    let reference = part("reference_weights", || {
        let mut m = Model::load_shared(dir, Device::Cpu, tch::Kind::Float).unwrap();
        m.keep_only_cpu_packing().unwrap();
        m
    });
    let learner_model = part("learner_weights", || policy(1));
    let mut learner = part("learner_adamw_state", || {
        Learner::new(
            learner_model,
            LearnerConfig {
                micro_batch: PROMPTS * SAMPLES,
                ..LearnerConfig::default()
            },
        )
        .unwrap()
    });
    let prompts: Vec<Vec<i64>> = (0..PROMPTS * SAMPLES)
        .map(|i| {
            (0..12)
                .map(|t| 4 + ((i / SAMPLES) * 37 + t * 11) as i64 % 900)
                .collect()
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: NEW_TOKENS,
        ignore_eos: true,
        seed: 3,
        ..SamplingParams::default()
    };
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    // As the generate stage at its step's end at k = 0: no later step can
    // use these weights, so they are freed with their packing until the
    // learner's next version arrives (the adapters' base stays).
    let generations = part("generate_then_free_weights", || {
        let out = generate_on(&generator, &prompts, &ids, &params, Backend::Auto).unwrap();
        if !generator.free_weights_until_snapshot() {
            generator.release_cpu_packing();
        }
        out
    });
    let responses: Vec<Vec<i64>> = generations.iter().map(|g| g.tokens.clone()).collect();
    let refs = part("reference_logprobs", || {
        let _guard = tch::no_grad_guard();
        response_logprobs(&reference, &prompts, &responses, 1.0, 1024, false)
            .unwrap()
            .0
    });
    let rows = |t: &tch::Tensor| -> Vec<Vec<f64>> {
        (0..responses.len())
            .map(|i| Vec::<f64>::try_from(t.get(i as i64).to_kind(tch::Kind::Double)).unwrap())
            .collect()
    };
    let advantages: Vec<Vec<f64>> = (0..responses.len())
        .map(|i| vec![if i % 2 == 0 { 1.0 } else { -1.0 }; NEW_TOKENS])
        .collect();
    let batch = arrow::array::RecordBatch::try_from_iter([
        (col::PROMPT_TOKENS, token_list_array(&prompts)),
        (col::RESPONSE_TOKENS, token_list_array(&responses)),
        (col::ADVANTAGES, float_list_array(&advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(&rows(&refs))),
    ])
    .unwrap();
    part("learner_update", || learner.update(&batch).unwrap());
    println!("part end rss_mb={:.0} peak_mb={:.0}", rss(), peak());
}

/// A whole `weir run grpo` of 3 steps on `dir` (with gradient
/// checkpointing when `checkpointed`).
fn whole_run(dir: &Path, lora: bool, checkpointed: bool) {
    let mut c = RunConfig::defaults_for(PipelineKind::Grpo);
    c.model.path = dir.to_path_buf();
    c.data.prompts = weir::pipelines::config::Task::Arith;
    c.data.prompts_per_step = PROMPTS;
    c.data.samples_per_prompt = SAMPLES;
    c.generate.max_new_tokens = NEW_TOKENS;
    c.eval.arith = false;
    c.run.steps = if full() { 3 } else { 1 };
    c.run.threads = 1;
    c.run.max_staleness = 0;
    c.run.checkpoint_every = 0;
    c.placement.workers = 1;
    c.placement.rollout = vec![0];
    c.placement.train = vec![0];
    c.algorithm.gradient_checkpointing = checkpointed;
    if lora {
        let a = adapters();
        c.lora.rank = a.rank;
        c.lora.alpha = a.alpha;
    }
    let out = tempfile::tempdir().unwrap();
    weir::pipelines::run(&RunRequest {
        pipeline: PipelineKind::Grpo,
        config: c,
        run_dir: out.path().join("run"),
        resume: false,
        progress: false,
        cluster: Default::default(),
    })
    .unwrap();
    println!("run peak_mb={:.0}", peak());
}

fn child(mode: &str, lora: bool, dir: &Path, full: bool) -> Vec<String> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    if full {
        cmd.arg("--bench");
    }
    let out = cmd
        .env("WEIR_RUN_MEMORY_CHILD", format!("{mode}:{lora}"))
        .env("WEIR_RUN_MEMORY_DIR", dir)
        .output()
        .expect("the bench runs itself");
    assert!(
        out.status.success(),
        "{mode} lora={lora}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// `cargo bench` (else `cargo test`'s quick check).
fn full() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn main() {
    let full = full();
    if let Ok(what) = std::env::var("WEIR_RUN_MEMORY_CHILD") {
        let dir = PathBuf::from(std::env::var("WEIR_RUN_MEMORY_DIR").unwrap());
        let (mode, lora) = what.split_once(':').unwrap();
        match mode {
            "breakdown" => breakdown(&dir, lora == "true"),
            "checkpointed" => whole_run(&dir, lora == "true", true),
            _ => whole_run(&dir, lora == "true", false),
        }
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let weights_mb = make_checkpoint(&dir, full) as f64 / (1024.0 * 1024.0);
    let shape = if full {
        "SmolLM2-135M shape"
    } else {
        "1 layer, hidden 64 (cargo test)"
    };
    println!("model: {shape}, float32 weights {weights_mb:.0} MiB; grpo {PROMPTS}×{SAMPLES} samples, {NEW_TOKENS} new tokens");
    let mut peaks = Vec::new();
    for lora in [false, true] {
        let label = if lora { "lora r16" } else { "full" };
        for line in child("breakdown", lora, &dir, full) {
            if let Some(rest) = line.strip_prefix("part ") {
                println!("{label}: {rest}");
            }
        }
        let run = child("run", lora, &dir, full);
        let p = field(run.last().unwrap(), "peak_mb=");
        println!(
            "{label}: whole run peak_mb={p:.0} ({:.2}× the float32 weights)",
            p / weights_mb
        );
        peaks.push(p);
    }
    let run = child("checkpointed", false, &dir, full);
    let checkpointed = field(run.last().unwrap(), "peak_mb=");
    println!(
        "full, gradient checkpointing: whole run peak_mb={checkpointed:.0} ({:.2}× the float32 weights)",
        checkpointed / weights_mb
    );
    println!("run_peak_over_fp32_weights={:.3}", peaks[0] / weights_mb);
    println!(
        "checkpointed_run_peak_over_fp32_weights={:.3}",
        checkpointed / weights_mb
    );
    println!(
        "lora_run_peak_over_fp32_weights={:.3}",
        peaks[1] / weights_mb
    );
    println!("lora_peak_over_full_peak={:.3}", peaks[1] / peaks[0]);
}
