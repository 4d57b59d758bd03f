//! On-policy distillation against GRPO from the same start: `weir demo`
//! makes the models (its own tokenizer and fresh 0.8M Llama, SFT until
//! greedy accuracy on the arith task's 500 evaluation pairs reaches 30 %,
//! then 200 steps of async GRPO); the demo's GRPO policy is the teacher
//! and its SFT checkpoint the student's start. From that start, in one
//! invocation, `grpo` (the demo's settings: 8 prompts × 8 samples, ≤ 8 new
//! tokens, lr 2e-5, β 0.04, k = 1, generation and the reference on worker
//! 0, the learner on worker 1) and `distill` (the same, the teacher on the
//! train worker, `algorithm.distill_coef = 1`, no task advantage: the
//! exact-match reward is logged, not trained on) and `distill` over the
//! teacher's top 16 tokens as well (`teacher.top_k = 16`, GKD's
//! generalized JSD at β = 0.5 added to the same advantage) run in chunks of
//! `WEIR_BENCH_CHUNK` steps (default 5), each chunk resuming the last,
//! with the greedy accuracy measured after each, until it reaches the
//! target (`WEIR_BENCH_TARGET`, default 0.95 × the teacher's accuracy) or
//! `WEIR_BENCH_MAX_STEPS` (default 300). Then each method runs that many
//! steps again in one uninterrupted, timed run (no chunk restarts, no
//! evaluation): its wall time to the target. It prints each method's
//! accuracy by step, its steps and wall seconds to the target, and last
//! `distill_vs_grpo_steps_to_target=<GRPO's steps ÷ distillation's>`, the
//! top-k arm's ratio on the line before it (a
//! method that never reaches the target counts its maximum, and the line
//! says so). Under `cargo test` a few steps of everything check that the
//! bench works.

use std::path::{Path, PathBuf};
use std::time::Instant;

use weir::pipelines::config::ReferencePlacement;
use weir::pipelines::task::arith_accuracy;
use weir::pipelines::{run, PipelineKind, RunConfig, RunRequest};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A run's `summary.json`.
fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// The demo's settings for an RL run of `kind` from `start` (distillation
/// over the teacher's `top_k` tokens as well, when not 0).
fn rl_config(
    kind: PipelineKind,
    start: &Path,
    teacher: &Path,
    seed: u64,
    top_k: usize,
) -> RunConfig {
    let mut c = RunConfig::defaults_for(kind);
    c.model.path = start.to_path_buf();
    c.run.seed = seed;
    c.run.max_staleness = 1;
    c.run.threads = 1;
    c.placement.workers = 2;
    c.placement.rollout = vec![0];
    c.placement.train = vec![1];
    c.placement.reference = ReferencePlacement::Rollout;
    c.data.prompts_per_step = 8;
    c.data.samples_per_prompt = 8;
    c.generate.max_new_tokens = 8;
    c.algorithm.lr = 2e-5;
    c.algorithm.kl_coef = 0.04;
    // The accuracy is measured here, chunk by chunk.
    c.eval.arith = false;
    if kind == PipelineKind::Distill {
        c.teacher.path = teacher.to_path_buf();
        c.algorithm.distill_coef = 1.0;
        c.teacher.top_k = top_k;
    }
    c
}

/// What one method did: the accuracy after each chunk, and the steps at
/// which it first reached the target.
struct Trace {
    points: Vec<(u64, f64)>,
    reached: Option<u64>,
}

/// Seconds one uninterrupted run of `kind` takes for `steps` steps.
fn timed(kind: PipelineKind, cfg: &RunConfig, dir: &Path, steps: u64) -> f64 {
    let mut cfg = cfg.clone();
    cfg.run.steps = steps;
    let started = Instant::now();
    run(&RunRequest {
        pipeline: kind,
        config: cfg,
        run_dir: dir.to_path_buf(),
        resume: false,
        progress: false,
        cluster: Default::default(),
    })
    .unwrap_or_else(|e| panic!("{}: {e}", kind.name()));
    started.elapsed().as_secs_f64()
}

/// `kind` from `start` in chunks until the target or `max_steps`.
fn train(
    kind: PipelineKind,
    cfg: RunConfig,
    dir: &Path,
    chunk: u64,
    max_steps: u64,
    target: f64,
    start_accuracy: f64,
) -> Trace {
    let mut trace = Trace {
        points: vec![(0, start_accuracy)],
        reached: None,
    };
    let mut steps = 0;
    while steps < max_steps && trace.reached.is_none() {
        steps = (steps + chunk).min(max_steps);
        let mut cfg = cfg.clone();
        cfg.run.steps = steps;
        let outcome = run(&RunRequest {
            pipeline: kind,
            config: cfg.clone(),
            run_dir: dir.to_path_buf(),
            resume: steps > chunk,
            progress: false,
            cluster: Default::default(),
        })
        .unwrap_or_else(|e| panic!("{}: {e}", kind.name()));
        let (accuracy, _) = arith_accuracy(&cfg, &outcome.final_actor).unwrap();
        trace.points.push((steps, accuracy));
        if accuracy >= target {
            trace.reached = Some(steps);
        }
    }
    trace
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo");
    let (chunk, max_steps) = if full {
        (
            env_or("WEIR_BENCH_CHUNK", 5u64),
            env_or("WEIR_BENCH_MAX_STEPS", 300u64),
        )
    } else {
        (2, 2)
    };
    // The demo: the student's start (its SFT) and the teacher (its GRPO).
    let demo_started = Instant::now();
    let args = weir::demo::DemoArgs {
        out: Some(out.clone()),
        // The demo's own SFT rule (under cargo test: one short chunk).
        sft_target: weir::demo::SFT_TARGET,
        sft_chunk: if full { weir::demo::SFT_CHUNK } else { 4 },
        max_sft_steps: if full { weir::demo::MAX_SFT_STEPS } else { 4 },
        grpo_steps: Some(if full { 200 } else { 2 }),
        grpo_lr: None,
        agentic: false,
        agentic_sft_steps: 0,
        tool_share: 0.0,
        seed: 42,
        quiet: true,
    };
    weir::demo::demo(&args).unwrap();
    let demo = summary(&out);
    let path = |run: &str| -> PathBuf {
        PathBuf::from(
            summary(Path::new(demo[run].as_str().unwrap()))["final_checkpoint"]
                .as_str()
                .unwrap(),
        )
    };
    let (start, teacher) = (path("sft_run"), path("grpo_run"));
    let start_accuracy = demo["sft_accuracy"].as_f64().unwrap();
    let teacher_accuracy = demo["eval_accuracy_after"].as_f64().unwrap();
    let target = env_or("WEIR_BENCH_TARGET", 0.95 * teacher_accuracy);
    println!(
        "== distillation vs GRPO from the demo's SFT checkpoint (greedy accuracy {:.1}%), teacher the demo's GRPO policy ({:.1}%), target {:.1}%; demo {:.0} s ==",
        100.0 * start_accuracy,
        100.0 * teacher_accuracy,
        100.0 * target,
        demo_started.elapsed().as_secs_f64()
    );
    let mut traces = Vec::new();
    for (kind, top_k) in [
        (PipelineKind::Grpo, 0),
        (PipelineKind::Distill, 0),
        (PipelineKind::Distill, 16),
    ] {
        let cfg = rl_config(kind, &start, &teacher, 42, top_k);
        let name = match top_k {
            0 => kind.name().to_string(),
            k => format!("{}-top{k}", kind.name()),
        };
        let dir = tmp.path().join(&name);
        let trace = train(
            kind,
            cfg.clone(),
            &dir,
            chunk,
            max_steps,
            target,
            start_accuracy,
        );
        let curve: Vec<String> = trace
            .points
            .iter()
            .map(|(s, a)| format!("{s}:{:.1}%", 100.0 * a))
            .collect();
        let steps = trace.reached.unwrap_or(max_steps);
        let timed_dir = tmp.path().join(format!("{name}-timed"));
        let seconds = timed(kind, &cfg, &timed_dir, steps);
        match trace.reached {
            Some(steps) => println!(
                "{name:<12} reached {:.1}% at step {steps}, {seconds:.1} s of training ({:.3} s/step); accuracy by step {}",
                100.0 * target,
                seconds / steps as f64,
                curve.join(" ")
            ),
            None => println!(
                "{name:<12} did not reach {:.1}% in {max_steps} steps ({seconds:.1} s of training); accuracy by step {}",
                100.0 * target,
                curve.join(" ")
            ),
        }
        traces.push(trace);
    }
    let steps = |t: &Trace| t.reached.unwrap_or(max_steps) as f64;
    let censored = traces.iter().any(|t| t.reached.is_none());
    println!(
        "distill_top16_vs_grpo_steps_to_target={:.2}",
        steps(&traces[0]) / steps(&traces[2])
    );
    println!(
        "distill_vs_grpo_steps_to_target={:.2}{}",
        steps(&traces[0]) / steps(&traces[1]),
        if censored {
            " (a method that did not reach the target counts its maximum)"
        } else {
            ""
        }
    );
}
