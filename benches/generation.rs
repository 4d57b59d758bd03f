//! Model-runtime throughput, weir against transformers in the same run:
//! generation tokens/s (8 prompts × 8 samples, 64 new tokens, EOS
//! suppressed, temperature 1, 1 thread) and forward+backward tokens/s, on
//! `tests/fixtures/models/arith-sft` and on a random 24.6M-parameter
//! Llama (hidden 512, 8 layers, 8/4 heads, vocab 1000), as in
//! `../shared/bench/trl/grpo_throughput.py`.
//!
//! `cargo bench --bench generation`; `WEIR_BENCH_DEVICE=cuda` runs weir's
//! figures on that device (`scripts/gpu-check.sh` does). transformers runs through
//! `benches/hf_generate.py` with `$WEIR_BENCH_PYTHON` (a python with torch
//! 2.11 and transformers; see `../shared/bench/trl/README.md`); without it
//! only weir's figures are printed. Under `cargo test` everything runs once, tiny.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use tch::{Kind, Tensor};
#[path = "support/random_llama.rs"]
mod random_llama;
use random_llama::{random_llama, random_model};
use weir::gpu::optim::{AdamWConfig, Optimizer};
use weir::gpu::{
    generate_on, Backend, Device, Message, Model, ModelConfig, OnNewWeights, Request,
    SamplingParams, Streamer, Tokenizer,
};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn prompts(count: usize) -> Vec<Vec<i64>> {
    let tok = Tokenizer::load(&fixtures().join("tokenizer")).unwrap();
    (0..count)
        .map(|i| {
            let (a, b) = ((i * 37 + 11) % 100, (i * 53 + 7) % 100);
            tok.encode_chat(
                &[Message {
                    role: "user".into(),
                    content: format!("Compute: {a}+{b}"),
                }],
                true,
            )
            .unwrap()
        })
        .collect()
}

fn weir_generate(
    model: &Model,
    prompts: &[Vec<i64>],
    n: usize,
    new: usize,
    backend: Backend,
) -> f64 {
    let params = SamplingParams {
        max_new_tokens: new,
        n,
        ignore_eos: true,
        seed: 1,
        ..Default::default()
    };
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    let generate = || generate_on(model, prompts, &ids, &params, backend).unwrap();
    generate(); // warm-up
    let mut times: Vec<(f64, usize)> = (0..3)
        .map(|_| {
            let t = Instant::now();
            let out = generate();
            (
                t.elapsed().as_secs_f64(),
                out.iter().map(|g| g.tokens.len()).sum(),
            )
        })
        .collect();
    times.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (s, tokens) = times[1];
    tokens as f64 / s
}

fn weir_train(model: &Model, batch: i64, len: i64) -> f64 {
    let ids = Tensor::randint(1000, [batch, len], (Kind::Int64, model.device())).clamp(4, 999);
    let mut opt = Optimizer::adamw(model, AdamWConfig::default()).unwrap();
    let mut step = || {
        opt.zero_grad();
        let loss = -model
            .token_logprobs(&ids, None, 1.0)
            .unwrap()
            .mean(Kind::Float);
        loss.backward();
        opt.step(Some(1.0));
    };
    step();
    let t = Instant::now();
    let reps = 3;
    for _ in 0..reps {
        step();
    }
    (batch * len * reps) as f64 / t.elapsed().as_secs_f64()
}

fn hf_generate(model_dir: &Path, prompts: &[Vec<i64>], n: usize, new: usize) -> Option<f64> {
    let python = std::env::var("WEIR_BENCH_PYTHON").ok()?;
    let file = std::env::temp_dir().join(format!("weir-bench-prompts-{}.json", std::process::id()));
    std::fs::write(&file, serde_json::to_string(prompts).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/hf_generate.py");
    let out = Command::new(python)
        .arg(script)
        .arg(model_dir)
        .arg(&file)
        .args([n.to_string(), new.to_string(), "1".into()])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "transformers run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.lines().last()?).ok()?;
    v["tokens_per_s"].as_f64()
}

/// Multiply-adds per token through the decoder and LM head.
fn macs_per_token(c: &ModelConfig) -> f64 {
    let (h, q, kv, i) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    (c.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * c.vocab_size) as f64
}

/// GFLOP/s of weir's packed kernel on one decode step's products (64 rows).
fn kernel_gflops(c: &ModelConfig) -> f64 {
    use weir::gpu::cpu::gemm::{matmul, supported, Packed};
    if !supported() {
        return f64::NAN;
    }
    let (h, q, kv, i) = (
        c.hidden_size as usize,
        (c.num_attention_heads * c.head_dim) as usize,
        (c.num_key_value_heads * c.head_dim) as usize,
        c.intermediate_size as usize,
    );
    let shapes = [
        (h, q + 2 * kv),
        (q, h),
        (h, 2 * i),
        (i, h),
        (h, c.vocab_size as usize),
    ];
    let m = 64;
    let (mut flops, mut seconds) = (0.0, 0.0);
    for (k, n) in shapes {
        let a: Vec<f32> = (0..m * k).map(|x| (x % 7) as f32 * 0.1).collect();
        let w: Vec<f32> = (0..n * k).map(|x| (x % 5) as f32 * 0.01).collect();
        let packed = Packed::new(&w, n, k, None);
        let mut c = vec![0.0f32; m * n];
        // SAFETY: `supported()` checked above.
        let run = |c: &mut [f32]| unsafe { matmul(&a, k, m, &packed, c, n, false, None) };
        run(&mut c);
        let reps = 20;
        let t = Instant::now();
        for _ in 0..reps {
            run(&mut c);
        }
        seconds += t.elapsed().as_secs_f64();
        flops += (2 * m * k * n * reps) as f64;
    }
    flops / seconds / 1e9
}

/// Token budgets from a heavy tail: `low · 2^(5u)`, u uniform, so the
/// longest is 32× the shortest.
fn long_tail_budgets(count: usize, low: usize) -> Vec<usize> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            (low as f64 * (5.0 * u).exp2()).round() as usize
        })
        .collect()
}

/// Useful tokens/s of a long-tail workload on libtorch ops (the GPU's
/// path): the continuous-batching pool against static batches of the same
/// size, each run until its longest budget (what batch-level generation
/// does); returns (pool, static).
fn long_tail_pool(
    model: &Model,
    prompts: &[Vec<i64>],
    budgets: &[usize],
    pool: usize,
) -> (f64, f64) {
    let params = SamplingParams {
        max_new_tokens: *budgets.iter().max().unwrap(),
        ignore_eos: true,
        seed: 1,
        ..Default::default()
    };
    let useful: usize = budgets.iter().sum();
    let requests: Vec<Request> = budgets
        .iter()
        .enumerate()
        .map(|(i, &b)| Request {
            key: i as u64,
            prompt: prompts[i % prompts.len()].clone(),
            stream: i as u64,
            greedy: false,
            max_new_tokens: Some(b),
        })
        .collect();
    let t = Instant::now();
    let mut streamer = Streamer::new(
        model,
        params.clone(),
        pool,
        OnNewWeights::Keep,
        0,
        Backend::Torch,
    )
    .unwrap();
    streamer.submit(model, requests.clone()).unwrap();
    let mut tokens = 0;
    while !streamer.is_idle() {
        for f in streamer.advance(model).unwrap() {
            tokens += f.generation.tokens.len();
        }
    }
    assert_eq!(tokens, useful, "every budget is met");
    let pooled = useful as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for batch in requests.chunks(pool) {
        let batch_prompts: Vec<Vec<i64>> = batch.iter().map(|r| r.prompt.clone()).collect();
        let ids: Vec<u64> = batch.iter().map(|r| r.stream).collect();
        let longest = batch.iter().filter_map(|r| r.max_new_tokens).max().unwrap();
        let params = SamplingParams {
            max_new_tokens: longest,
            ..params.clone()
        };
        generate_on(model, &batch_prompts, &ids, &params, Backend::Torch).unwrap();
    }
    (pooled, useful as f64 / t.elapsed().as_secs_f64())
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let device: Device = std::env::var("WEIR_BENCH_DEVICE").map_or(Device::Cpu, |d| {
        d.parse()
            .unwrap_or_else(|e| panic!("WEIR_BENCH_DEVICE: {e}"))
    });
    weir::gpu::device::set_threads(1);
    let (n_prompts, n, new) = if full { (8, 8, 64) } else { (2, 2, 4) };
    let dir = tempfile::tempdir().unwrap();
    // Under `cargo test`, a 1-layer stand-in for the 24.6M model: the
    // paths are checked, not the figures.
    let (random, random_name) = if full {
        (random_llama(dir.path()), "random llama (24.6M)")
    } else {
        (
            random_model(dir.path(), "random-llama-tiny", 64, 1, 176, 512),
            "random llama (hidden 64, 1 layer)",
        )
    };
    let prompts = prompts(n_prompts);
    println!("== generation on {device}: {n_prompts} prompts × {n} samples, {new} new tokens, EOS suppressed, temperature 1, 1 thread ==");
    // `cargo bench --bench generation -- long_tail` runs only the long-tail pool.
    let models = if std::env::args().any(|a| a == "long_tail") {
        vec![]
    } else {
        vec![
            ("arith-sft (995k)", fixtures().join("models/arith-sft")),
            (random_name, random.clone()),
        ]
    };
    for (name, path) in models {
        let model = Model::load(&path, device, Kind::Float).unwrap();
        let width = prompts.iter().map(Vec::len).max().unwrap();
        // Rows through the model in transformers' run: every sample's padded
        // prompt, then one row per sample for each further token.
        let hf_rows = (prompts.len() * n * (width + new - 1)) as f64;
        let ours = weir_generate(&model, &prompts, n, new, Backend::Auto);
        let torch = weir_generate(&model, &prompts, n, new, Backend::Torch);
        let train = weir_train(&model, if full { 16 } else { 2 }, if full { 80 } else { 8 });
        match hf_generate(&path, &prompts, n, new) {
            Some(theirs) => {
                println!(
                    "{name}: weir generate {ours:.0} tok/s (on libtorch ops {torch:.0}), transformers generate {theirs:.0} tok/s, ratio {:.2} (target ≥ 3; libtorch ops {:.2}); weir forward+backward+AdamW {train:.0} tok/s",
                    ours / theirs,
                    torch / theirs
                );
                let hf_gflops = 2.0 * macs_per_token(&model.config) * hf_rows
                    / ((prompts.len() * n * new) as f64 / theirs)
                    / 1e9;
                println!(
                    "  arithmetic: transformers' run does {hf_gflops:.1} GFLOP/s of model products; weir's packed kernel runs a decode step's products at {:.1} GFLOP/s",
                    kernel_gflops(&model.config)
                );
            }
            None => println!("{name}: weir generate {ours:.0} tok/s (on libtorch ops {torch:.0}; set WEIR_BENCH_PYTHON for transformers' figure); weir forward+backward+AdamW {train:.0} tok/s"),
        }
    }
    // The second setting is bound by the KV cache's memory traffic (a
    // small model, long responses), as decode on a GPU is.
    let small = random_model(dir.path(), "random-llama-small", 128, 2, 352, 2048);
    let settings = if full {
        [
            ("random llama (24.6M)", &random, 64, 8, 16),
            ("random llama (hidden 128, 2 layers)", &small, 48, 32, 16),
        ]
    } else {
        [
            (random_name, &random, 6, 2, 3),
            ("random llama (hidden 128, 2 layers)", &small, 6, 2, 3),
        ]
    };
    let mut ratio = 0.0;
    for (name, path, requests, low, pool) in settings {
        let budgets = long_tail_budgets(requests, low);
        let model = Model::load(path, device, Kind::Float).unwrap();
        let (pooled, batched) = long_tail_pool(&model, &prompts, &budgets, pool);
        println!(
            "== long tail on libtorch ops: {requests} requests, budgets {}..{} tokens (mean {:.0}), pool {pool}, {name} ==",
            budgets.iter().min().unwrap(),
            budgets.iter().max().unwrap(),
            budgets.iter().sum::<usize>() as f64 / requests as f64
        );
        println!("continuous batching {pooled:.0} useful tok/s, static batches of {pool} {batched:.0} useful tok/s");
        ratio = pooled / batched;
    }
    println!("pool_vs_static_tokens_per_s={ratio:.3}");
}
