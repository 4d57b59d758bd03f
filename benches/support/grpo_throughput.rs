//! The `throughput` mode of the grpo bench: `grpo_throughput.py`'s setting,
//! each weir run in a child process of its own for its own peak memory,
//! against TRL's script in the same invocation (see `benches/grpo.rs`).

use std::path::Path;
use std::process::Command;

use weir::pipelines::RunConfig;

use super::{
    bench_steps, busy_text, header, place, random_llama, row, trl_grpo, trl_settings, weir_grpo,
    Figures, Placing, Setting,
};

/// `grpo_throughput.py`'s settings on `model` (one worker, k = 0), with
/// `new_tokens` tokens a response.
fn throughput_config(model: &Path, steps: u64, new_tokens: usize, checkpointed: bool) -> RunConfig {
    let mut c = trl_settings(model, steps, new_tokens);
    c.generate.ignore_eos = true;
    c.algorithm.lr = 1e-5;
    c.algorithm.gradient_checkpointing = checkpointed;
    place(&mut c, Placing::Synchronous);
    c
}

/// Set in a child that runs one throughput-setting run: `steps:new_tokens:checkpointed`.
pub const CHILD: &str = "WEIR_GRPO_BENCH_CHILD";
/// Set beside [`CHILD`]: the random model's folder.
pub const CHILD_MODEL: &str = "WEIR_GRPO_BENCH_MODEL";

/// In the child: one run of the throughput setting, its figures printed as
/// `key=value` fields with the process's peak resident memory.
pub fn child(spec: &str, model: &Path) {
    let mut parts = spec.split(':');
    let mut next = || parts.next().expect("steps:new_tokens:checkpointed");
    let steps: u64 = next().parse().unwrap();
    let new_tokens: usize = next().parse().unwrap();
    let checkpointed: bool = next().parse().unwrap();
    let config = throughput_config(model, steps, new_tokens, checkpointed);
    let (f, busy) = weir_grpo(config, Setting::Throughput.warmup());
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let peak_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN);
    println!(
        "figures steps={} wall_s={} median_step_s={} mean_step_s={} response_length={} peak_mib={}",
        f.steps,
        f.wall_s,
        f.median_step_s,
        f.mean_step_s,
        f.response_length.unwrap_or(f64::NAN),
        peak_kib / 1024.0
    );
    println!("measured {}", f.measured);
    println!("busy {}", busy_text(&busy));
}

/// Runs [`child`] in a child process of this bench: its figures
/// and its stages' busy time per step.
fn weir_throughput(
    model: &Path,
    steps: u64,
    new_tokens: usize,
    checkpointed: bool,
) -> (Figures, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    if std::env::args().any(|a| a == "--bench") {
        cmd.arg("--bench");
    }
    let out = cmd
        .env(CHILD, format!("{steps}:{new_tokens}:{checkpointed}"))
        .env(CHILD_MODEL, model)
        .output()
        .expect("the bench runs itself");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "weir run (checkpointed: {checkpointed}) failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("figures "))
        .expect("the child prints its figures");
    let field = |key: &str| -> f64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let busy = stdout
        .lines()
        .find_map(|l| l.strip_prefix("busy "))
        .unwrap_or("-")
        .to_string();
    let figures = Figures {
        steps: field("steps") as u64,
        wall_s: field("wall_s"),
        median_step_s: field("median_step_s"),
        mean_step_s: field("mean_step_s"),
        measured: stdout
            .lines()
            .find_map(|l| l.strip_prefix("measured "))
            .unwrap_or("-")
            .to_string(),
        response_length: Some(field("response_length")).filter(|l| l.is_finite()),
        peak_mib: Some(field("peak_mib")),
    };
    (figures, busy)
}

/// `grpo_throughput.py`'s setting: weir without and with gradient
/// checkpointing against TRL, speed and peak memory.
pub fn run(full: bool) {
    let (steps, new_tokens) = if full { (bench_steps(8), 64) } else { (1, 8) };
    println!(
        "== GRPO at grpo_throughput.py's setting: random 24.6M Llama, 8 prompts × 8 samples, {new_tokens} new tokens (eos ignored), lr 1e-5, β 0.04 (k3), clip 0.2, 1 thread, {steps} steps =="
    );
    let dir = tempfile::tempdir().unwrap();
    // Under `cargo test`, a Llama of the same layout an eighth of the
    // width and depth: the runs' path is what is checked, not the figures.
    let model = if full {
        random_llama::random_llama(dir.path())
    } else {
        random_llama::random_model(dir.path(), "random-llama-small", 64, 1, 176, 512)
    };
    let (plain, plain_busy) = weir_throughput(&model, steps, new_tokens, false);
    let (checkpointed, checkpointed_busy) = weir_throughput(&model, steps, new_tokens, true);
    let trl = if full {
        trl_grpo(Setting::Throughput, steps)
    } else {
        Err("not run under `cargo test`".into())
    };
    header();
    row("weir, k=0, 1 worker, 1 thread", &plain);
    row("weir, gradient checkpointing", &checkpointed);
    match &trl {
        Ok(t) => row("TRL grpo_throughput.py (checkpointing)", t),
        Err(why) => println!("TRL skipped: {why}"),
    }
    println!("(peak MiB: the whole process's peak resident memory; weir's wall time includes loading and the final checkpoint)");
    println!("weir measured: {}", checkpointed.measured);
    println!("weir mean busy per step, without checkpointing: {plain_busy}");
    println!("weir mean busy per step, checkpointed: {checkpointed_busy}");
    assert!(plain.peak_mib.is_some_and(|m| m > 0.0), "no peak measured");
    if let Ok(t) = &trl {
        println!("TRL measured: {}", t.measured);
        for (name, w) in [
            ("without checkpointing", &plain),
            ("checkpointed", &checkpointed),
        ] {
            println!(
                "weir {name} / TRL: samples/s {:.2} (median-based), {:.2} (mean-based); peak {:.2}",
                w.samples_per_s() / t.samples_per_s(),
                w.samples_per_s_mean() / t.samples_per_s_mean(),
                w.peak_mib.unwrap_or(f64::NAN) / t.peak_mib.unwrap_or(f64::NAN)
            );
        }
        println!(
            "checkpointed_peak_vs_trl={:.3} checkpointed_samples_per_s_vs_trl={:.3}",
            checkpointed.peak_mib.unwrap_or(f64::NAN) / t.peak_mib.unwrap_or(f64::NAN),
            checkpointed.samples_per_s() / t.samples_per_s()
        );
    }
}
