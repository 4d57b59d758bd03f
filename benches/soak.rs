//! Soak: 1,000 steps of a small GRPO run (the arith SFT fixture, 2 prompts ×
//! 4 samples, 6 new tokens, a checkpoint every 100 steps) as `weir run` in a
//! child process. At every checkpoint it samples the process's resident
//! memory and open file descriptors (from `/proc`) and the bytes per step of
//! `metrics.parquet` and `rollouts/`. Prints one line per sample, then
//!
//! ```text
//! rss_growth_100_to_last=<ratio − 1>   (target < 0.10; sampled as each checkpoint commits)
//! peak_rss_growth_100_to_last=<ratio − 1>   (the high-water mark, VmHWM)
//! fd_growth_100_to_last=<count>        (target 0)
//! metrics_bytes_per_step_ratio=<last ÷ at 100>
//! rollout_bytes_per_step_ratio=<last ÷ at 100>
//! ```
//!
//! `cargo bench --bench soak` (`WEIR_SOAK_STEPS` changes the step count);
//! under `cargo test`, 4 steps check that it works.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models")
}

fn proc_field(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

fn bytes_under(path: &Path) -> u64 {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => m.len(),
        Ok(m) if m.is_dir() => std::fs::read_dir(path)
            .map(|d| d.flatten().map(|e| bytes_under(&e.path())).sum())
            .unwrap_or(0),
        _ => 0,
    }
}

struct Sample {
    step: u64,
    rss_kb: u64,
    peak_kb: u64,
    fds: usize,
    metrics_per_step: f64,
    rollouts_per_step: f64,
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let steps: u64 = std::env::var("WEIR_SOAK_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|_| full)
        .unwrap_or(if full { 1000 } else { 4 });
    let every = (steps / 10).max(1);
    let tmp = tempfile::tempdir().expect("a temporary folder");
    let out = tmp.path().join("soak");
    let model = fixtures().join("arith-sft");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weir"));
    cmd.args(["run", "grpo", "--quiet", "--out"]).arg(&out);
    for set in [
        format!("model.path={}", model.display()),
        format!("run.steps={steps}"),
        format!("run.checkpoint_every={every}"),
        "run.max_staleness=1".into(),
        "data.prompts_per_step=2".into(),
        "data.samples_per_prompt=4".into(),
        "generate.max_new_tokens=6".into(),
        "eval.arith=false".into(),
    ] {
        cmd.args(["--set", &set]);
    }
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weir starts");
    let pid = child.id();
    let started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut next = every - 1;
    loop {
        if child.try_wait().expect("waits").is_some() {
            break;
        }
        let committed = out.join(format!("checkpoints/step-{next}/state.json"));
        if next < steps && committed.is_file() {
            let (Some(rss_kb), Some(peak_kb), Some(fds)) = (
                proc_field(pid, "VmRSS:"),
                proc_field(pid, "VmHWM:"),
                open_fds(pid),
            ) else {
                break;
            };
            let done = (next + 1) as f64;
            let sample = Sample {
                step: next + 1,
                rss_kb,
                peak_kb,
                fds,
                metrics_per_step: bytes_under(&out.join("metrics.parquet")) as f64 / done,
                rollouts_per_step: bytes_under(&out.join("rollouts")) as f64 / done,
            };
            println!(
                "step={} rss_mb={:.1} peak_rss_mb={:.1} fds={} metrics_bytes_per_step={:.0} rollout_bytes_per_step={:.0} elapsed_s={:.1}",
                sample.step,
                sample.rss_kb as f64 / 1024.0,
                sample.peak_kb as f64 / 1024.0,
                sample.fds,
                sample.metrics_per_step,
                sample.rollouts_per_step,
                started.elapsed().as_secs_f64()
            );
            samples.push(sample);
            next += every;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let output = child.wait_with_output().expect("weir ends");
    assert!(
        output.status.success(),
        "the soak run failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
        panic!("no samples: the run ended before its first checkpoint was seen");
    };
    println!(
        "steps={steps} wall_s={:.1}",
        started.elapsed().as_secs_f64()
    );
    println!(
        "rss_growth_100_to_last={:.4}",
        last.rss_kb as f64 / first.rss_kb as f64 - 1.0
    );
    println!(
        "peak_rss_growth_100_to_last={:.4}",
        last.peak_kb as f64 / first.peak_kb as f64 - 1.0
    );
    println!(
        "fd_growth_100_to_last={}",
        last.fds as i64 - first.fds as i64
    );
    println!(
        "metrics_bytes_per_step_ratio={:.3}",
        last.metrics_per_step / first.metrics_per_step
    );
    println!(
        "rollout_bytes_per_step_ratio={:.3}",
        last.rollouts_per_step / first.rollouts_per_step
    );
}
