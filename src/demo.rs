//! `weir demo`: from nothing to a model that visibly learns, on CPU.
//!
//! 1. trains a byte-level BPE tokenizer on the arith task's text;
//! 2. creates a small Llama (hidden 128, 4 layers, 4/2 heads) with fresh weights;
//! 3. runs the `sft` pipeline on the 9,500 training pairs until greedy
//!    accuracy on the 500 evaluation pairs reaches 50% (checked every 25 steps);
//! 4. runs the `grpo` pipeline from the SFT checkpoint with `max_staleness = 1`,
//!    generation and the reference on worker 0, learning on worker 1, the
//!    exact-match reward;
//! 5. measures greedy accuracy on the 500 evaluation pairs before and after
//!    GRPO and writes `summary.json` and plots.
//!
//! Nothing is read from outside the binary: the task, its evaluation pairs
//! and every file of the model are made here.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use serde_json::json;
use weir_operators::tasks::arith;
use weir_pipelines::runner::RunRequest;
use weir_pipelines::task::arith_accuracy;
use weir_pipelines::{PipelineKind, RunConfig};

/// The greedy accuracy at which the demo's SFT stops ([`DemoArgs::sft_target`]).
pub const SFT_TARGET: f64 = 0.5;
/// The demo's SFT steps between evaluations.
pub const SFT_CHUNK: u64 = 25;
/// The demo's SFT steps at most.
pub const MAX_SFT_STEPS: u64 = 800;

/// `weir demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The demo's folder (default: runs/demo-DATE-TIME).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// SFT stops once greedy accuracy on the evaluation pairs reaches this
    /// (GRPO from a start below about 45% ends lower, and how far below
    /// depends on the host's rounding).
    #[arg(long, default_value_t = SFT_TARGET)]
    pub sft_target: f64,
    /// SFT steps (64 prompts each) between evaluations.
    #[arg(long, default_value_t = SFT_CHUNK)]
    pub sft_chunk: u64,
    /// SFT steps at most.
    #[arg(long, default_value_t = MAX_SFT_STEPS)]
    pub max_sft_steps: u64,
    /// GRPO steps (8 prompts × 8 samples each; default 200, with --agentic 60).
    #[arg(long)]
    pub grpo_steps: Option<u64>,
    /// GRPO's learning rate (default 2e-5, with --agentic 1e-4).
    #[arg(long)]
    pub grpo_lr: Option<f64>,
    /// The agentic demo instead: a small model learns to call a calculator
    /// for two-digit multiplications (SFT on a few calls, then GRPO with
    /// the tool); summary.json holds accuracy and tool-call rate before
    /// and after on held-out problems.
    #[arg(long)]
    pub agentic: bool,
    /// The agentic demo's SFT steps (64 rows each).
    #[arg(long, default_value_t = 300)]
    pub agentic_sft_steps: u64,
    /// The share of the agentic demo's SFT problems that call the tool.
    #[arg(long, default_value_t = 0.2)]
    pub tool_share: f64,
    /// Seed of the tokenizer corpus order, the weights and sampling.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs the demo (the agentic one with `--agentic`) and prints where its run folder is.
pub fn demo(args: &DemoArgs) -> anyhow::Result<()> {
    if args.agentic {
        return crate::demo_agentic::run(&crate::demo_agentic::AgenticSettings {
            out: args
                .out
                .clone()
                .unwrap_or_else(|| crate::run_cli::default_run_dir("demo-agentic")),
            sft_steps: args.agentic_sft_steps,
            tool_share: args.tool_share,
            grpo_steps: args.grpo_steps.unwrap_or(60),
            grpo_lr: args.grpo_lr.unwrap_or(1e-4),
            seed: args.seed,
            quiet: args.quiet,
        });
    }
    arith_demo(args)
}

/// The arith demo: SFT then async GRPO.
fn arith_demo(args: &DemoArgs) -> anyhow::Result<()> {
    let grpo_steps = args.grpo_steps.unwrap_or(200);
    let started = Instant::now();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| crate::run_cli::default_run_dir("demo"));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    println!(
        "weir demo: SFT then async GRPO on the arith task, in {}",
        out.display()
    );

    let init = out.join("init");
    let vocab = make_tokenizer(&init)?;
    let params = crate::demo_model::make_model(&init, vocab, args.seed as i64)?;
    println!("tokenizer: byte-level BPE, {vocab} tokens; model: Llama, {params} parameters");

    // SFT in chunks until greedy accuracy is meaningful (each chunk resumes the last).
    let mut sft = RunConfig::defaults_for(PipelineKind::Sft);
    sft.model.path = init.to_path_buf();
    sft.run.seed = args.seed;
    sft.run.threads = 2;
    sft.eval.arith = false;
    let sft_dir = out.join("sft");
    let sft_started = Instant::now();
    let mut sft_steps = 0;
    let (sft_out, sft_accuracy) = loop {
        sft_steps = (sft_steps + args.sft_chunk).min(args.max_sft_steps);
        sft.run.steps = sft_steps;
        let run = weir_pipelines::run(&RunRequest {
            pipeline: PipelineKind::Sft,
            config: sft.clone(),
            run_dir: sft_dir.clone(),
            resume: sft_steps > args.sft_chunk,
            progress: !args.quiet,
            cluster: Default::default(),
        })?;
        let (accuracy, _) = arith_accuracy(&sft, &run.final_actor)?;
        println!(
            "sft: {sft_steps} steps ({:.0} s), loss {:.3}, greedy accuracy {:.1}%",
            sft_started.elapsed().as_secs_f64(),
            run.summary["loss_last"].as_f64().unwrap_or(f64::NAN),
            100.0 * accuracy
        );
        if accuracy >= args.sft_target || sft_steps >= args.max_sft_steps {
            break (run, accuracy);
        }
    };
    let sft_wall = sft_started.elapsed().as_secs_f64();

    let mut grpo = RunConfig::defaults_for(PipelineKind::Grpo);
    grpo.model.path = sft_out.final_actor;
    grpo.run.steps = grpo_steps;
    grpo.run.seed = args.seed;
    grpo.run.max_staleness = 1;
    grpo.run.threads = 1;
    grpo.placement.workers = 2;
    grpo.placement.rollout = vec![0];
    grpo.placement.train = vec![1];
    // The learner bounds the step: the reference keeps the generator company.
    grpo.placement.reference = weir_pipelines::config::ReferencePlacement::Rollout;
    grpo.data.prompts_per_step = 8;
    grpo.data.samples_per_prompt = 8;
    grpo.generate.max_new_tokens = 8;
    grpo.algorithm.lr = args.grpo_lr.unwrap_or(2e-5);
    grpo.algorithm.kl_coef = 0.04;
    let grpo_started = Instant::now();
    let rl = weir_pipelines::run(&RunRequest {
        pipeline: PipelineKind::Grpo,
        config: grpo,
        run_dir: out.join("grpo"),
        resume: false,
        progress: !args.quiet,
        cluster: Default::default(),
    })?;
    let grpo_wall = grpo_started.elapsed().as_secs_f64();

    let s = &rl.summary;
    let summary = json!({
        "eval_accuracy_before": s["eval_accuracy_before"],
        "eval_accuracy_after": s["eval_accuracy_after"],
        "steps": s["steps"],
        "samples_per_s": s["samples_per_s"],
        "max_staleness_observed": s["max_staleness_observed"],
        "max_staleness": 1,
        "reward_first": s["reward_first"],
        "reward_last": s["reward_last"],
        "eval_samples_after": s["eval_samples_after"],
        "sft_steps": sft_steps,
        "sft_accuracy": sft_accuracy,
        "sft_loss_last": sft_out.summary["loss_last"],
        "sft_wall_s": sft_wall,
        "grpo_wall_s": grpo_wall,
        "total_wall_s": started.elapsed().as_secs_f64(),
        "tokenizer_vocab": vocab,
        "model_parameters": params,
        "sft_run": out.join("sft").display().to_string(),
        "grpo_run": out.join("grpo").display().to_string(),
    });
    crate::demo_model::write_summary(&out, &summary, &[&sft_out.run_dir, &rl.run_dir])?;
    let pct = |v: &serde_json::Value| {
        v.as_f64()
            .map_or("?".into(), |x| format!("{:.1}%", 100.0 * x))
    };
    println!(
        "grpo: {} steps in {grpo_wall:.0} s ({:.0} samples/s, max staleness {}), greedy accuracy on the 500 evaluation pairs {} → {}",
        grpo_steps,
        s["samples_per_s"].as_f64().unwrap_or(0.0),
        s["max_staleness_observed"],
        pct(&s["eval_accuracy_before"]),
        pct(&s["eval_accuracy_after"]),
    );
    println!("run folder: {}", out.display());
    Ok(())
}

/// The arith task's text, the prompt as the chat template renders it and the answer, for the tokenizer.
fn corpus() -> Vec<String> {
    (0..100u32)
        .flat_map(|a| (0..100u32).map(move |b| (a, b)))
        .map(|(a, b)| {
            format!(
                "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>\n",
                arith::user_message(a, b),
                a + b
            )
        })
        .collect()
}

fn make_tokenizer(dir: &Path) -> anyhow::Result<usize> {
    weir_gpu::tokenizer::train_chatml_bpe(&corpus(), 320, dir).context("training the tokenizer")
}
