//! Streaming generation against batch-level asynchrony, in one invocation,
//! on 2 workers (generation on worker 0, reference and learner on worker 1),
//! `grpo` on `tests/fixtures/models/arith-sft`:
//!
//! - the long-tail setting (`generate.long_tail = 1`: per-response budgets
//!   from a Pareto distribution between 4 and 256 tokens, eos ignored, so
//!   lengths within a step spread over up to 64×, as reasoning traces do;
//!   decoding on libtorch ops, the GPU's path, whose pass costs about the
//!   same for one sequence as for many; the learner's micro-batches cut at
//!   1,024 padded tokens, `WEIR_BENCH_MICRO_TOKENS` to change):
//!   synchronous (k = 0), batch-level k = 1, streaming k = 1 with
//!   `on_new_weights = "keep"` and `"recompute"` (`generate.max_inflight` =
//!   the rows of the k + 1 steps the bound lets run at once), and
//!   batch-level against streaming keep at k = 2;
//! - the arith setting (≤ 8 tokens, eos ends responses): batch-level k = 1
//!   against streaming k = 1 `"keep"`.
//!
//! Each run reports tokens/s and samples/s over the steps after the warm-up
//! (learner `done_unix_s`), the generator's and the learner's idle fractions
//! (1 − busy / wall over the same steps), the spread of response lengths
//! within a step, the rows whose tokens span two versions, and the mean
//! reward per sample over the same samples. The last line is
//! `streaming_vs_batch_tokens_per_s=<best streaming / batch k=1 on the long
//! tail> reward_per_sample_delta=<that streaming run's mean reward − batch
//! k=1's>`.
//!
//! `cargo bench --bench streaming`; `WEIR_BENCH_STEPS` sets the steps
//! (default 24). Under `cargo test`, 3 steps of a tail up to 32 tokens
//! check that it works.

use std::collections::BTreeMap;
use std::path::Path;

use arrow::array::AsArray;
use arrow::datatypes::{Float32Type, UInt32Type, UInt64Type};
use weir::graph::metrics::MetricRow;
use weir::graph::parquet_log::read_parquet_dir;
use weir::pipelines::config::{Backend, OnNewWeights};
use weir::pipelines::{run, PipelineKind, RunConfig, RunRequest};

const WARMUP_STEPS: u64 = 2;
const PROMPTS: usize = 8;
const SAMPLES: usize = 4;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Synchronous,
    /// Batch by batch at this k.
    Batch(u64),
    /// Streaming at this k.
    Streaming(OnNewWeights, u64),
}

/// The long tail's longest response: 256 tokens, 32 under `cargo test`.
fn tail_tokens() -> usize {
    if std::env::args().any(|a| a == "--bench") {
        256
    } else {
        32
    }
}

fn config(steps: u64, mode: Mode, long_tail: bool) -> RunConfig {
    let mut c = RunConfig::defaults_for(PipelineKind::Grpo);
    c.model.path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/arith-sft");
    c.data.prompts_per_step = PROMPTS;
    c.data.samples_per_prompt = SAMPLES;
    c.algorithm.micro_batch = PROMPTS * SAMPLES;
    c.eval.arith = false;
    c.run.steps = steps;
    c.run.threads = 1;
    c.run.checkpoint_every = 0;
    c.placement.workers = 2;
    c.placement.rollout = vec![0];
    c.placement.train = vec![1];
    if long_tail {
        c.generate.long_tail = 1.0;
        c.generate.max_new_tokens = tail_tokens();
        // Decoding on libtorch ops, the path a GPU runs: a pass costs about
        // the same for one sequence as for a full pool, as on a GPU, so a
        // batch that waits for its longest row wastes its empty slots.
        c.generate.backend = Backend::Torch;
        // The learner pays for the tokens, not rows × the longest row.
        c.algorithm.micro_batch_tokens = std::env::var("WEIR_BENCH_MICRO_TOKENS")
            .ok()
            .map(|s| s.parse().expect("WEIR_BENCH_MICRO_TOKENS: a number"))
            .unwrap_or(1024);
    } else {
        c.generate.max_new_tokens = 8;
    }
    c.run.max_staleness = match mode {
        Mode::Synchronous => 0,
        Mode::Batch(k) | Mode::Streaming(_, k) => k,
    };
    if let Mode::Streaming(policy, k) = mode {
        // Room for every row the bound lets the generator hold at once: the
        // k + 1 steps from the oldest untrained one.
        c.generate.max_inflight = (k as usize + 1) * PROMPTS * SAMPLES;
        c.generate.on_new_weights = policy;
    }
    c
}

/// What one run measured.
struct Figures {
    label: String,
    tokens_per_s: f64,
    samples_per_s: f64,
    generator_idle: f64,
    learner_idle: f64,
    reward: f64,
    /// Longest over shortest response within a step, the median over steps.
    spread: f64,
    partial: f64,
    mean_length: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn measure(steps: u64, mode: Mode, long_tail: bool) -> Figures {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let outcome = run(&RunRequest {
        pipeline: PipelineKind::Grpo,
        config: config(steps, mode, long_tail),
        run_dir: run_dir.clone(),
        resume: false,
        progress: false,
        cluster: Default::default(),
    })
    .unwrap();
    let rows: &[MetricRow] = &outcome.report.metrics;
    let done: BTreeMap<u64, f64> = rows
        .iter()
        .filter(|r| r.stage == "learn" && r.metric == "done_unix_s")
        .map(|r| (r.step, r.value))
        .collect();
    assert_eq!(done.len() as u64, steps, "one learner step per step");
    let skip = if steps > WARMUP_STEPS + 1 {
        WARMUP_STEPS
    } else {
        0
    };
    let first = if skip > 0 {
        done[&(skip - 1)]
    } else {
        done[&0] - outcome.summary["wall_s"].as_f64().unwrap() / steps as f64
    };
    let wall = done[&(steps - 1)] - first;
    let measured = |s: u64| s >= skip;
    let busy = |stage: &str| -> f64 {
        rows.iter()
            .filter(|r| r.stage == stage && r.metric == "busy_s" && measured(r.step))
            .map(|r| r.value)
            .sum()
    };
    // Rows: tokens, rewards, lengths by step, rows spanning versions.
    let (mut tokens, mut samples, mut rewards) = (0usize, 0usize, Vec::new());
    let (mut lengths, mut partial) = (BTreeMap::<u64, Vec<usize>>::new(), 0usize);
    for b in read_parquet_dir(&run_dir.join("rollouts")).unwrap() {
        let step = b
            .column_by_name("step")
            .unwrap()
            .as_primitive::<UInt64Type>()
            .clone();
        let reward = b
            .column_by_name("reward")
            .unwrap()
            .as_primitive::<Float32Type>()
            .clone();
        let responses = b
            .column_by_name("response_tokens")
            .unwrap()
            .as_list::<i32>()
            .clone();
        let versions = b
            .column_by_name("token_versions")
            .unwrap()
            .as_list::<i32>()
            .clone();
        for i in 0..b.num_rows() {
            let n = responses.value_length(i) as usize;
            rewards.push(f64::from(reward.value(i)));
            lengths.entry(step.value(i)).or_default().push(n);
            let v = versions.value(i);
            let v = v.as_primitive::<UInt32Type>();
            if !v.is_empty() && v.values().iter().min() != v.values().iter().max() {
                partial += 1;
            }
            if measured(step.value(i)) {
                tokens += n;
                samples += 1;
            }
        }
    }
    let spread = median(
        lengths
            .values()
            .map(|l| *l.iter().max().unwrap() as f64 / (*l.iter().min().unwrap()).max(1) as f64)
            .collect(),
    );
    let all: usize = lengths.values().map(Vec::len).sum();
    let label = match mode {
        Mode::Synchronous => "synchronous k=0".to_string(),
        Mode::Batch(k) => format!("batch-level k={k}"),
        Mode::Streaming(p, k) => format!("streaming k={k} {p:?}").to_lowercase(),
    };
    Figures {
        label,
        tokens_per_s: tokens as f64 / wall,
        samples_per_s: samples as f64 / wall,
        generator_idle: 1.0 - busy("generate") / wall,
        learner_idle: 1.0 - busy("learn") / wall,
        reward: rewards.iter().sum::<f64>() / rewards.len().max(1) as f64,
        spread,
        partial: partial as f64 / all.max(1) as f64,
        mean_length: lengths.values().flatten().sum::<usize>() as f64 / all.max(1) as f64,
    }
}

fn table(title: &str, runs: &[Figures]) {
    println!("\n{title}");
    println!(
        "| {:<24} | {:>9} | {:>9} | {:>8} | {:>8} | {:>7} | {:>7} | {:>7} | {:>8} |",
        "run",
        "tokens/s",
        "samples/s",
        "gen idle",
        "lrn idle",
        "mean len",
        "spread",
        "partial",
        "reward"
    );
    println!(
        "|{}|",
        ["-"; 9]
            .iter()
            .map(|_| "----------")
            .collect::<Vec<_>>()
            .join("|")
    );
    for f in runs {
        println!(
            "| {:<24} | {:>9.1} | {:>9.2} | {:>8.2} | {:>8.2} | {:>7.1} | {:>6.0}× | {:>7.2} | {:>8.4} |",
            f.label, f.tokens_per_s, f.samples_per_s, f.generator_idle, f.learner_idle, f.mean_length, f.spread, f.partial, f.reward
        );
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let steps: u64 = if full {
        std::env::var("WEIR_BENCH_STEPS")
            .ok()
            .map(|s| s.parse().expect("WEIR_BENCH_STEPS: a number of steps"))
            .unwrap_or(24)
    } else {
        3
    };
    assert!(steps > 0, "WEIR_BENCH_STEPS must be at least 1");
    println!(
        "== streaming generation: grpo, arith-sft, {PROMPTS} prompts × {SAMPLES} samples, 2 workers (generate w0, reference + learn w1), 1 thread each, {steps} steps, the first {WARMUP_STEPS} left out =="
    );
    // The headline compares k = 1 runs; the k = 2 pair shows what groups
    // filling steps as they finish (slack that k = 1 does not leave) adds.
    let modes = [
        Mode::Synchronous,
        Mode::Batch(1),
        Mode::Streaming(OnNewWeights::Keep, 1),
        Mode::Streaming(OnNewWeights::Recompute, 1),
        Mode::Batch(2),
        Mode::Streaming(OnNewWeights::Keep, 2),
    ];
    let tail: Vec<Figures> = modes.iter().map(|&m| measure(steps, m, true)).collect();
    table(
        &format!("long tail (generate.long_tail = 1, 4..{} tokens, eos ignored; libtorch decoding, learner micro-batches of ≤ 1024 padded tokens)", tail_tokens()),
        &tail,
    );
    println!(
        "synchronous step: generation busy {:.0} % of the wall, learner {:.0} %",
        100.0 * (1.0 - tail[0].generator_idle),
        100.0 * (1.0 - tail[0].learner_idle)
    );
    let arith: Vec<Figures> = [Mode::Batch(1), Mode::Streaming(OnNewWeights::Keep, 1)]
        .iter()
        .map(|&m| measure(steps, m, false))
        .collect();
    table("arith (≤ 8 tokens, eos ends responses)", &arith);
    let batch = &tail[1];
    let best = tail[2..4]
        .iter()
        .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
        .unwrap();
    println!(
        "k=2: streaming keep / batch-level tokens/s = {:.2}",
        tail[5].tokens_per_s / tail[4].tokens_per_s
    );
    println!(
        "\nlong tail: {} / batch-level k=1 tokens/s = {:.2}; arith: streaming keep / batch-level k=1 tokens/s = {:.2}",
        best.label,
        best.tokens_per_s / batch.tokens_per_s,
        arith[1].tokens_per_s / arith[0].tokens_per_s
    );
    println!(
        "streaming_vs_batch_tokens_per_s={:.3} reward_per_sample_delta={:.4}",
        best.tokens_per_s / batch.tokens_per_s,
        best.reward - batch.reward
    );
}
