//! Per-rank memory of data-parallel training with the optimizer state
//! sharded over the ranks (`placement.shard_optimizer`, ZeRO stages 1 and
//! 2) against whole on every rank, in one invocation: two processes, one
//! learner rank each, an SFT run of the random 24.6M Llama of the TRL
//! baseline (float32, AdamW) on the arith task, 16 rows a step (8 a rank),
//! 3 steps, a checkpoint at the last (rank 0 writing each rank's optimizer
//! file as it arrives).
//!
//! Each process reports its peak resident memory (`VmHWM`) and the
//! optimizer-state bytes its rank holds. The last line is
//!
//! ```text
//! sharded_over_unsharded_rank_peak=<largest sharded rank peak ÷ largest unsharded> optimizer_state_per_rank=<largest sharded rank's state ÷ unsharded>
//! ```
//!
//! `cargo bench --bench zero`; under `cargo test`, a 2-layer model of
//! width 128 and one step.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/random_llama.rs"]
mod random_llama;

use tch::Tensor;
use weir::gpu::optim::shard_bounds;
use weir::gpu::{Device, Model};
use weir::pipelines::placement::Cluster;
use weir::pipelines::{PipelineKind, RunConfig, RunRequest};

fn peak_mb() -> f64 {
    status_mb("VmHWM:")
}

fn status_mb(key: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(f64::NAN)
        / 1024.0
}

/// Process `process` of the two-process SFT run in `out`.
fn rank(model: &Path, out: &Path, hosts: &Path, process: usize, shard: bool, steps: u64) {
    // libtorch and the engine, loaded, before the run starts.
    let _ = tch::Tensor::zeros([1], (tch::Kind::Float, tch::Device::Cpu));
    let start = status_mb("VmRSS:");
    let mut c = RunConfig::defaults_for(PipelineKind::Sft);
    c.model.path = model.to_path_buf();
    c.data.prompts = weir::pipelines::config::Task::Arith;
    c.data.prompts_per_step = 16;
    c.eval.arith = false;
    c.run.steps = steps;
    c.run.threads = 1;
    c.run.checkpoint_every = 0;
    c.placement.workers = 2;
    c.placement.rollout = vec![0];
    c.placement.train = vec![0, 1];
    c.placement.shard_optimizer = shard;
    weir::pipelines::run(&RunRequest {
        pipeline: PipelineKind::Sft,
        config: c,
        run_dir: out.to_path_buf(),
        resume: false,
        progress: false,
        cluster: Cluster {
            processes: 2,
            process,
            hostfile: Some(hosts.to_path_buf()),
            ..Cluster::default()
        },
    })
    .unwrap();
    // Before this process loads anything more.
    let peak = peak_mb();
    // The state this rank held: AdamW's two float32 moments of its parameters.
    let loaded = Model::load(model, Device::Cpu, tch::Kind::Float).unwrap();
    let numels: Vec<usize> = loaded
        .trainable_tensors()
        .iter()
        .map(|(_, t): &(String, Tensor)| t.numel())
        .collect();
    let mine = if shard {
        let b = shard_bounds(&numels, 2);
        numels[b[process]..b[process + 1]].iter().sum::<usize>()
    } else {
        numels.iter().sum()
    };
    println!(
        "rank start_mb={start:.1} peak_mb={:.1} state_mb={:.1}",
        peak,
        (mine * 8) as f64 / (1024.0 * 1024.0)
    );
}

/// Two free local ports, as a hostfile in `dir`.
fn hostfile(dir: &Path) -> PathBuf {
    let ports: Vec<u16> = (0..2)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        })
        .collect();
    let path = dir.join("hosts.txt");
    let lines: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn field(line: &str, key: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Both ranks' (peak MiB, state MiB, MiB at start), as two processes of this bench.
fn two_ranks(model: &Path, tmp: &Path, shard: bool, full: bool) -> Vec<(f64, f64, f64)> {
    let out = tmp.join(if shard { "sharded" } else { "whole" });
    let hosts = hostfile(tmp);
    let spawn = |process: usize| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        if full {
            cmd.arg("--bench");
        }
        cmd.env(
            "WEIR_ZERO_CHILD",
            format!(
                "{process}:{shard}:{}:{}:{}",
                model.display(),
                out.display(),
                hosts.display()
            ),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the bench runs itself")
    };
    let children = [spawn(0), spawn(1)];
    children
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            let line = text
                .lines()
                .rfind(|l| l.starts_with("rank "))
                .unwrap()
                .to_string();
            (
                field(&line, "peak_mb="),
                field(&line, "state_mb="),
                field(&line, "start_mb="),
            )
        })
        .collect()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let steps = if full { 3 } else { 1 };
    if let Ok(spec) = std::env::var("WEIR_ZERO_CHILD") {
        let parts: Vec<&str> = spec.splitn(5, ':').collect();
        let (process, shard) = (parts[0].parse().unwrap(), parts[1] == "true");
        rank(
            Path::new(parts[2]),
            Path::new(parts[3]),
            Path::new(parts[4]),
            process,
            shard,
            steps,
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = if full {
        random_llama::random_llama(tmp.path())
    } else {
        random_llama::random_model(tmp.path(), "random-llama-small", 128, 2, 256, 128)
    };
    let weights_mb = std::fs::metadata(model.join("model.safetensors"))
        .unwrap()
        .len() as f64
        / (1024.0 * 1024.0);
    println!(
        "model: {} ({weights_mb:.1} MiB float32), sft 16 rows a step over 2 processes of one rank each, {steps} steps",
        model.file_name().unwrap().to_string_lossy()
    );
    let mut largest = Vec::new();
    for shard in [false, true] {
        let ranks = two_ranks(&model, tmp.path(), shard, full);
        let label = if shard { "sharded" } else { "unsharded" };
        for (r, (peak, state, start)) in ranks.iter().enumerate() {
            println!(
                "{label}: rank {r} peak_mb={peak:.1} (at start {start:.1}: the run added {:.1}) optimizer_state_mb={state:.1}",
                peak - start
            );
        }
        let max = |f: fn(&(f64, f64, f64)) -> f64| ranks.iter().map(f).fold(0.0, f64::max);
        largest.push((max(|r| r.0), max(|r| r.1)));
    }
    println!(
        "sharded_over_unsharded_rank_peak={:.3} optimizer_state_per_rank={:.3}",
        largest[1].0 / largest[0].0,
        largest[1].1 / largest[0].1
    );
}
