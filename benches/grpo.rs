//! End-to-end GRPO, weir against TRL in the same run: the `grpo` pipeline
//! from the arith-sft checkpoint TRL's runs start from
//! (`../shared/fixtures/models/arith-sft`, beside the repository with the
//! TRL baseline; without it, the repository's `tests/fixtures` one, and the
//! bench says so) with the settings of
//! `../shared/bench/trl/grpo.py` (8 prompts × 8 samples, completions ≤ 8
//! tokens, temperature 1, lr 1e-4, β 0.04 k3 KL to the SFT model, clip 0.2,
//! per-sequence length-normalised loss, 1 libtorch thread per worker), in
//! four placements:
//!
//! - (a) synchronous and colocated: one worker, `max_staleness = 0` — the
//!   like-for-like comparison with TRL's single thread;
//! - (b) `max_staleness = 1`, generation on worker 0 and the reference and
//!   learner on worker 1 (two threads);
//! - (c) as (b) with the reference beside the generator on worker 0
//!   (`placement.reference = "rollout"`), balancing the learner-bound step;
//! - (d) as (b) with two data-parallel learner ranks on workers 0 and 1
//!   (`placement.train = [0, 1]`), the reference split over them.
//!
//! `cargo bench --bench grpo`; `WEIR_BENCH_STEPS` sets the steps (default
//! 60). With `$WEIR_BENCH_PYTHON` (a python with torch 2.11, transformers,
//! trl, datasets, accelerate; see `../shared/bench/trl/README.md`) TRL's
//! `grpo.py` runs beside it for as many steps, and the ratios are printed.
//! Step times leave out the first 3 steps (warm-up, model loading), as
//! TRL's summary does: weir's come from the learner's `done_unix_s`, TRL's
//! from its per-step log. Under `cargo test` a 2-step run checks that the
//! benchmark works, without TRL.
//!
//! `cargo bench --bench grpo -- throughput` runs the setting of
//! `../shared/bench/trl/grpo_throughput.py` instead: a random 24.6M Llama
//! (hidden 512, 8 layers), 8 prompts × 8 samples of 64 new tokens with eos
//! ignored (`generate.ignore_eos`, TRL's `suppress_tokens`), lr 1e-5,
//! otherwise as above, 8 steps (`WEIR_BENCH_STEPS`), one worker at k = 0,
//! once without and once with gradient checkpointing (TRL's default). Each
//! weir run is a child process of its own, so its peak resident memory
//! (`VmHWM`) is its own; TRL's is its summary's `peak_rss_mib_self`. Step
//! times leave out 2 warm-up steps, as that script's summary does. The last
//! line is `checkpointed_peak_vs_trl=<weir ÷ TRL> checkpointed_samples_per_s_vs_trl=<weir ÷ TRL>`
//! (issue 15's target: below TRL's peak at no loss of speed). Under `cargo
//! test` one 8-token step of each weir run checks that it works.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/random_llama.rs"]
mod random_llama;
#[path = "support/grpo_throughput.rs"]
mod throughput;
use weir::graph::metrics::MetricRow;
use weir::pipelines::config::{Aggregation, KlEstimator, ReferencePlacement, ScheduleChoice};
use weir::pipelines::{run, PipelineKind, RunConfig, RunRequest};

/// Completions per step: 8 prompts × 8 samples.
const SAMPLES_PER_STEP: f64 = 64.0;

fn shared() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared")
}

/// Which of TRL's two scripts a run reproduces.
#[derive(Clone, Copy, PartialEq)]
enum Setting {
    /// `grpo.py`: arith-sft, ≤ 8 new tokens, lr 1e-4.
    Arith,
    /// `grpo_throughput.py`: the random 24.6M Llama, 64 new tokens with eos
    /// ignored, lr 1e-5.
    Throughput,
}

impl Setting {
    /// Steps left out of the step-time figures, as in the script's summary.
    fn warmup(self) -> u64 {
        match self {
            Setting::Arith => 3,
            Setting::Throughput => 2,
        }
    }

    /// The TRL script, whose summary and step log are `<stem>_summary.json`
    /// and `<stem>_steps.csv`.
    fn script(self) -> &'static str {
        match self {
            Setting::Arith => "grpo",
            Setting::Throughput => "grpo_throughput",
        }
    }
}

/// What one run measured.
struct Figures {
    steps: u64,
    /// The whole run (weir: `summary.json`'s `wall_s`, model loading and the
    /// final checkpoint included; TRL: `trainer.train()`).
    wall_s: f64,
    /// Median seconds per step after the warm-up.
    median_step_s: f64,
    /// Mean seconds per step after the warm-up (completion of the last
    /// warm-up step to completion of the last step).
    mean_step_s: f64,
    /// Which steps the step times cover.
    measured: String,
    /// Mean completion tokens per sample.
    response_length: Option<f64>,
    /// Peak resident memory of the whole process, MiB (when measured).
    peak_mib: Option<f64>,
}

impl Figures {
    fn samples_per_s(&self) -> f64 {
        SAMPLES_PER_STEP / self.median_step_s
    }

    fn samples_per_s_mean(&self) -> f64 {
        SAMPLES_PER_STEP / self.mean_step_s
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The placements compared.
#[derive(Clone, Copy, PartialEq)]
enum Placing {
    /// (a) one worker, k = 0.
    Synchronous,
    /// (b) k = 1, generation on worker 0, reference + learner on worker 1.
    Async,
    /// (c) k = 1, generation + reference on worker 0, learner on worker 1.
    AsyncReferenceWithGenerator,
    /// (d) k = 1, generation on worker 0, two data-parallel learner ranks
    /// on workers 0 and 1, the reference split over them.
    DataParallel,
}

/// The arith-sft checkpoint TRL's `grpo.py` starts from where the baseline
/// is beside the repository, else the repository's own.
fn arith_sft() -> PathBuf {
    static SAID: std::sync::Once = std::sync::Once::new();
    let trl = shared().join("fixtures/models/arith-sft");
    if trl.is_dir() {
        return trl;
    }
    SAID.call_once(|| {
        println!("(../shared/fixtures is not here: weir starts from tests/fixtures/models/arith-sft, not TRL's checkpoint)");
    });
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/arith-sft")
}

/// TRL's settings on weir's `grpo` pipeline: `grpo.py`'s on arith-sft.
fn config(steps: u64, placing: Placing) -> RunConfig {
    let model = arith_sft();
    let mut c = trl_settings(&model, steps, 8);
    c.algorithm.lr = 1e-4;
    place(&mut c, placing);
    c
}

/// What TRL's two scripts share: 8 prompts × 8 samples, temperature 1, a
/// constant schedule, β 0.04 (k3), clip 0.2, per-sequence token-mean loss,
/// 1 thread, no evaluation, no checkpoints.
fn trl_settings(model: &Path, steps: u64, new_tokens: usize) -> RunConfig {
    let mut c = RunConfig::defaults_for(PipelineKind::Grpo);
    c.model.path = model.to_path_buf();
    c.data.prompts = weir::pipelines::config::Task::Arith;
    c.data.prompts_per_step = 8;
    c.data.samples_per_prompt = 8;
    c.generate.max_new_tokens = new_tokens;
    c.generate.temperature = 1.0;
    c.generate.top_p = 1.0;
    c.generate.top_k = 0;
    c.algorithm.schedule = ScheduleChoice::Constant;
    c.algorithm.warmup_steps = 0;
    c.algorithm.weight_decay = 0.0;
    c.algorithm.kl_coef = 0.04;
    c.algorithm.kl_estimator = KlEstimator::K3;
    c.algorithm.clip_low = 0.2;
    c.algorithm.clip_high = 0.2;
    // TRL's loss_type = "grpo": token mean per sequence, then mean over sequences.
    c.algorithm.aggregation = Aggregation::SeqMeanTokenMean;
    c.eval.arith = false;
    c.run.steps = steps;
    c.run.threads = 1;
    c.run.checkpoint_every = 0;
    c
}

fn place(c: &mut RunConfig, placing: Placing) {
    if placing == Placing::Synchronous {
        c.run.max_staleness = 0;
        c.placement.workers = 1;
        c.placement.rollout = vec![0];
        c.placement.train = vec![0];
    } else {
        c.run.max_staleness = 1;
        c.placement.workers = 2;
        c.placement.rollout = vec![0];
        c.placement.train = vec![1];
        if placing == Placing::AsyncReferenceWithGenerator {
            c.placement.reference = ReferencePlacement::Rollout;
        }
        if placing == Placing::DataParallel {
            c.placement.train = vec![0, 1];
        }
    }
}

/// Per step, the value of `metric` of `stage` (summed over workers).
fn per_step(rows: &[MetricRow], stage: &str, metric: &str) -> BTreeMap<u64, f64> {
    let mut out = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.stage == stage && r.metric == metric)
    {
        *out.entry(r.step).or_insert(0.0) += r.value;
    }
    out
}

/// Runs weir's `grpo` pipeline; returns its figures and the mean busy
/// seconds per step of each stage after `warmup` steps.
fn weir_grpo(config: RunConfig, warmup: u64) -> (Figures, Vec<(String, f64)>) {
    let steps = config.run.steps;
    let dir = tempfile::tempdir().unwrap();
    let outcome = run(&RunRequest {
        pipeline: PipelineKind::Grpo,
        config,
        run_dir: dir.path().join("run"),
        resume: false,
        progress: false,
        cluster: Default::default(),
    })
    .unwrap();
    let rows = &outcome.report.metrics;
    // A step is done when its last learner rank is.
    let mut done = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.stage == "learn" && r.metric == "done_unix_s")
    {
        let t = done.entry(r.step).or_insert(r.value);
        *t = f64::max(*t, r.value);
    }
    assert_eq!(done.len() as u64, steps, "one learner step per step");
    let wall_s = outcome.summary["wall_s"].as_f64().unwrap();
    let skip = if steps > warmup + 1 { warmup } else { 0 };
    let times: Vec<f64> = done.values().copied().collect();
    let (median_step_s, mean_step_s, measured) = if skip > 0 {
        let s = skip as usize;
        let intervals: Vec<f64> = times[s - 1..].windows(2).map(|w| w[1] - w[0]).collect();
        let mean = (times[times.len() - 1] - times[s - 1]) / (times.len() - s) as f64;
        (
            median(intervals),
            mean,
            format!("steps {skip}..{} (learner done_unix_s)", steps - 1),
        )
    } else {
        let per = wall_s / steps as f64;
        (
            per,
            per,
            "all steps, run wall time (too few steps to leave out warm-up)".into(),
        )
    };
    let lengths = per_step(rows, "learn", "response_length");
    let post: Vec<f64> = lengths.range(skip..).map(|(_, v)| *v).collect();
    let response_length = (!post.is_empty()).then(|| post.iter().sum::<f64>() / post.len() as f64);
    let counted = (steps - skip).max(1) as f64;
    let mut busy: BTreeMap<String, f64> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.metric == "busy_s" && r.step >= skip)
    {
        *busy.entry(r.stage.clone()).or_insert(0.0) += r.value / counted;
    }
    let mut busy: Vec<(String, f64)> = busy.into_iter().collect();
    busy.sort_by(|a, b| b.1.total_cmp(&a.1));
    (
        Figures {
            steps,
            wall_s,
            median_step_s,
            mean_step_s,
            measured,
            response_length,
            peak_mib: None,
        },
        busy,
    )
}

/// Runs TRL's script of `setting` for `steps` steps with `$WEIR_BENCH_PYTHON`.
fn trl_grpo(setting: Setting, steps: u64) -> Result<Figures, String> {
    let python = std::env::var("WEIR_BENCH_PYTHON").map_err(|_| "WEIR_BENCH_PYTHON is not set")?;
    let out = tempfile::tempdir().map_err(|e| e.to_string())?;
    let stem = setting.script();
    let script = shared().join(format!("bench/trl/{stem}.py"));
    let result = Command::new(&python)
        .arg(&script)
        .current_dir(out.path())
        .env("HF_HUB_OFFLINE", "1")
        .env("OMP_NUM_THREADS", "1")
        .env("BENCH_THREADS", "1")
        .env("BENCH_STEPS", steps.to_string())
        .env("BENCH_OUT", out.path())
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !result.status.success() {
        let err = String::from_utf8_lossy(&result.stderr);
        let tail: Vec<&str> = err.lines().rev().take(20).collect();
        return Err(format!(
            "{} failed ({}):\n{}",
            script.display(),
            result.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    let summary = format!("{stem}_summary.json");
    let text = std::fs::read_to_string(out.path().join(&summary))
        .map_err(|e| format!("{summary}: {e}"))?;
    let s: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let get = |k: &str| s[k].as_f64().ok_or(format!("{summary}: no `{k}`"));
    let median_step_s = get("median_step_wall_s")?;
    let run_steps = get("steps_run")? as u64;
    let elapsed = csv_column(&out.path().join(format!("{stem}_steps.csv")), "elapsed_s")?;
    let skip = get("warmup_steps_excluded")? as usize;
    let mean_step_s = if elapsed.len() > skip + 1 && skip > 0 {
        (elapsed[elapsed.len() - 1] - elapsed[skip - 1]) / (elapsed.len() - skip) as f64
    } else {
        median_step_s
    };
    Ok(Figures {
        steps: run_steps,
        wall_s: get("train_wall_s")?,
        median_step_s,
        mean_step_s,
        measured: format!(
            "steps {skip}..{} (TRL's per-step log)",
            run_steps.saturating_sub(1)
        ),
        response_length: get("median_completion_tokens_per_step")
            .ok()
            .map(|t| t / SAMPLES_PER_STEP),
        peak_mib: get("peak_rss_mib_self").ok(),
    })
}

/// One numeric column of a CSV file with a header row (no quoted fields).
fn csv_column(path: &Path, name: &str) -> Result<Vec<f64>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text.lines();
    let header = lines.next().ok_or("empty CSV")?;
    let i = header
        .split(',')
        .position(|h| h == name)
        .ok_or(format!("{}: no column `{name}`", path.display()))?;
    lines
        .map(|l| {
            l.split(',')
                .nth(i)
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or(format!("{}: bad `{name}` in {l:?}", path.display()))
        })
        .collect()
}

fn header() {
    println!(
        "| {:<38} | {:>5} | {:>7} | {:>9} | {:>9} | {:>9} | {:>9} | {:>6} | {:>8} |",
        "run",
        "steps",
        "wall s",
        "s/step md",
        "s/step mn",
        "samples/s",
        "smp/s mn",
        "tokens",
        "peak MiB"
    );
    let dashes: Vec<String> = [40, 7, 9, 11, 11, 11, 11, 8, 10]
        .iter()
        .map(|&n| "-".repeat(n))
        .collect();
    println!("|{}|", dashes.join("|"));
}

fn row(name: &str, f: &Figures) {
    println!(
        "| {name:<38} | {:>5} | {:>7.1} | {:>9.4} | {:>9.4} | {:>9.1} | {:>9.1} | {:>6} | {:>8} |",
        f.steps,
        f.wall_s,
        f.median_step_s,
        f.mean_step_s,
        f.samples_per_s(),
        f.samples_per_s_mean(),
        f.response_length
            .map_or("-".to_string(), |l| format!("{l:.2}")),
        f.peak_mib.map_or("-".to_string(), |m| format!("{m:.0}")),
    );
}

/// The steps of a full run: `WEIR_BENCH_STEPS`, else `default`.
fn bench_steps(default: u64) -> u64 {
    let steps = std::env::var("WEIR_BENCH_STEPS")
        .ok()
        .map(|s| s.parse().expect("WEIR_BENCH_STEPS: a number of steps"))
        .unwrap_or(default);
    assert!(steps > 0, "WEIR_BENCH_STEPS must be at least 1");
    steps
}

/// A stage's mean busy time per step, as `stage 12.3 ms, …`.
fn busy_text(busy: &[(String, f64)]) -> String {
    let text: Vec<String> = busy
        .iter()
        .map(|(stage, s)| format!("{stage} {:.1} ms", s * 1e3))
        .collect();
    text.join(", ")
}

fn main() {
    if let (Ok(spec), Ok(model)) = (
        std::env::var(throughput::CHILD),
        std::env::var(throughput::CHILD_MODEL),
    ) {
        throughput::child(&spec, Path::new(&model));
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    if std::env::args().any(|a| a == "throughput") {
        throughput::run(full);
        return;
    }
    arith(full);
    if !full {
        throughput::run(full);
    }
}

/// `grpo.py`'s setting in four placements against TRL.
fn arith(full: bool) {
    let steps = if full { bench_steps(60) } else { 2 };
    println!(
        "== GRPO end to end: arith-sft, 8 prompts × 8 samples, ≤ 8 new tokens, temperature 1, lr 1e-4, β 0.04 (k3), clip 0.2, {steps} steps =="
    );
    let (sync, sync_busy) = weir_grpo(config(steps, Placing::Synchronous), Setting::Arith.warmup());
    let (stale, stale_busy) = weir_grpo(config(steps, Placing::Async), Setting::Arith.warmup());
    let (balanced, balanced_busy) = weir_grpo(
        config(steps, Placing::AsyncReferenceWithGenerator),
        Setting::Arith.warmup(),
    );
    let (parallel, parallel_busy) = weir_grpo(
        config(steps, Placing::DataParallel),
        Setting::Arith.warmup(),
    );
    let trl = if full {
        trl_grpo(Setting::Arith, steps)
    } else {
        Err("not run under `cargo test`".into())
    };

    header();
    row("weir (a) k=0, 1 worker, 1 thread", &sync);
    row("weir (b) k=1, gen w0 / learn w1, 2 thr", &stale);
    row("weir (c) k=1, gen+ref w0 / learn w1", &balanced);
    row("weir (d) k=1, gen w0, 2 learner ranks", &parallel);
    match &trl {
        Ok(t) => row("TRL grpo.py, 1 thread", t),
        Err(why) => println!("TRL skipped: {why}"),
    }
    println!(
        "(s/step md: median step time, as TRL's summary; mn: mean; samples/s = 64 / step time; tokens: mean completion tokens per sample)"
    );
    println!("weir measured: {}", sync.measured);
    if let Ok(t) = &trl {
        println!("TRL measured: {}", t.measured);
        for (name, w) in [
            ("(a)", &sync),
            ("(b)", &stale),
            ("(c)", &balanced),
            ("(d)", &parallel),
        ] {
            println!(
                "weir {name} / TRL samples/s: {:.2} (median-based), {:.2} (mean-based)",
                w.samples_per_s() / t.samples_per_s(),
                w.samples_per_s_mean() / t.samples_per_s_mean()
            );
        }
    }
    for (name, busy) in [
        ("(a)", &sync_busy),
        ("(b)", &stale_busy),
        ("(c)", &balanced_busy),
        ("(d)", &parallel_busy),
    ] {
        println!(
            "weir {name} mean busy s per step, over the measured steps: {}",
            busy_text(busy)
        );
    }
}
