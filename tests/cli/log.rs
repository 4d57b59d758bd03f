//! The rollout log as a dataset, as a user runs it: `weir replay` of a
//! logged run, `weir export` of its rows into files weir's own pipelines
//! train on, training from logs (`data.rollouts`), and logs that are not
//! what they claim to be.

use std::path::{Path, PathBuf};

use weir::graph::metrics::{batch_to_rows, rows_to_batch};
use weir::graph::parquet_log::{read_parquet_file, write_parquet_atomically};

use crate::{fixtures, success, weir};

/// `weir run PIPELINE --quiet --out OUT` on the arith checkpoint at `model`,
/// with a small step and `sets`.
fn run_args(pipeline: &str, out: &str, model: &Path, sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", pipeline, "--quiet", "--out", out]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let small = [
        format!("model.path={}", model.display()),
        "data.prompts_per_step=3".into(),
        "data.samples_per_prompt=4".into(),
        "generate.max_new_tokens=6".into(),
        "algorithm.micro_batch=8".into(),
        "eval.arith=false".into(),
    ];
    for s in small.iter().map(String::as_str).chain(sets.iter().copied()) {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args
}

fn run_in(dir: &Path, args: &[String]) -> String {
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    success(&weir(&argv, dir))
}

/// `weir ARGS` in `dir` that must fail: its stderr.
fn failure(dir: &Path, args: &[&str]) -> String {
    let out = weir(args, dir);
    assert!(
        !out.status.success(),
        "{args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn last_line(text: &str) -> &str {
    text.lines().last().unwrap_or("")
}

/// A copy of the arith checkpoint in `dir` (to change under a finished run).
fn model_copy(dir: &Path) -> PathBuf {
    let to = dir.join("model");
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(fixtures().join("arith-sft")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

#[test]
fn replay_reproduces_a_logged_run_and_names_the_first_metric_that_differs() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_copy(tmp.path());
    // Asynchronous (k = 1), two epochs of two mini-batches, a token budget
    // per micro-batch, TIS: every path of the learner that a step takes.
    let sets = [
        "run.steps=4",
        "run.checkpoint_every=2",
        "run.max_staleness=1",
        "algorithm.ppo_epochs=2",
        "algorithm.mini_batches=2",
        "algorithm.micro_batch_tokens=40",
        "algorithm.correction=tis",
    ];
    run_in(tmp.path(), &run_args("grpo", "r", &model, &sets));

    // From the checkpoint of step 1: steps 2 and 3, each metric equal to the bit.
    let text = success(&weir(&["replay", "r", "--steps", "2..3"], tmp.path()));
    assert!(text.contains("from r/checkpoints/step-1/actor"), "{text}");
    // loss, grad_norm, clip_fraction, entropy, lr, kl, 4 importance-weight
    // figures, reward, response_length: 12 a step.
    assert_eq!(
        last_line(&text),
        "replay: steps=2 metrics=24 max_abs_diff=0e0",
        "{text}"
    );
    // Without a checkpoint before step 0: from model.path, every step.
    let text = success(&weir(&["replay", "r"], tmp.path()));
    assert_eq!(
        last_line(&text),
        "replay: steps=4 metrics=48 max_abs_diff=0e0",
        "{text}"
    );

    // A run whose metrics say otherwise: the first differing metric is named.
    let metrics = tmp.path().join("r/metrics.parquet");
    let mut rows = Vec::new();
    for batch in read_parquet_file(&metrics).unwrap() {
        rows.extend(batch_to_rows(&batch).unwrap());
    }
    for row in &mut rows {
        if row.step == 3 && row.stage == "learn" && row.metric == "grad_norm" {
            row.value += 0.5;
        }
    }
    write_parquet_atomically(&metrics, &[rows_to_batch(&rows).unwrap()]).unwrap();
    let out = weir(&["replay", "r", "--steps", "3"], tmp.path());
    assert!(!out.status.success());
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        last_line(&stdout).starts_with("replay: steps=2 metrics=24 max_abs_diff=5e-1"),
        "{stdout}"
    );
    assert!(
        stderr.contains("step 3: `grad_norm` replayed") && stderr.lines().count() == 1,
        "{stderr}"
    );

    // The log of another model: refused, naming what differs.
    let weights = model.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let err = failure(tmp.path(), &["replay", "r"]);
    assert!(
        err.contains("r/rollouts/manifest.json") && err.contains("its weights (sha256"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}
