//! The commands as a user runs them: `weir logprobs`, `weir generate`,
//! `weir score` on the fixture checkpoints, checked against the float64
//! transformers references; bad input lines are named and nothing is written.
//! `weir inspect` and `weir plot` on a run folder of known metrics and on a
//! `weir sim` run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt64Array};
use arrow::datatypes::{Float32Type, Int64Type};
use serde_json::Value;
use weir::graph::metrics::{rows_to_batch, MetricRow};
use weir::graph::parquet_log::{read_parquet_file, write_parquet_atomically};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/models")
}

fn reference(model: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(model).join("reference.json")).unwrap(),
    )
    .unwrap()
}

fn weir(args: &[&str], dir: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// Writes `in.jsonl` with one `{"input_ids": …}` line per reference case.
fn write_input_ids(dir: &Path, cases: &[Value]) {
    let lines: Vec<String> = cases
        .iter()
        .map(|c| serde_json::json!({"input_ids": c["input_ids"]}).to_string())
        .collect();
    std::fs::write(dir.join("in.jsonl"), lines.join("\n")).unwrap();
}

fn read(path: &Path) -> RecordBatch {
    let batches = read_parquet_file(path).unwrap();
    arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap()
}

#[test]
fn logprobs_command_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("tiny-llama");
    let cases = r["single"].as_array().unwrap();
    write_input_ids(dir.path(), cases);
    let model = fixtures().join("tiny-llama");
    let out = weir(
        &[
            "logprobs",
            "--model",
            model.to_str().unwrap(),
            "--input",
            "in.jsonl",
            "--output",
            "out.parquet",
            "--batch-size",
            "2",
        ],
        dir.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let batch = read(&dir.path().join("out.parquet"));
    let lps = batch
        .column_by_name("token_logprobs")
        .unwrap()
        .as_list::<i32>();
    let ids = batch.column_by_name("input_ids").unwrap().as_list::<i32>();
    for (i, case) in cases.iter().enumerate() {
        let want: Vec<f64> = case["token_logprobs"].as_array().unwrap()[1..]
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let got = lps.value(i);
        let got = got.as_primitive::<Float32Type>();
        assert_eq!(got.len(), want.len(), "length is len(input_ids) − 1");
        assert_eq!(
            ids.value(i).as_primitive::<Int64Type>().len(),
            want.len() + 1
        );
        for (g, w) in got.values().iter().zip(&want) {
            assert!((f64::from(*g) - w).abs() < 1e-4, "row {i}: {g} vs {w}");
        }
    }
}

#[test]
fn generate_command_answers_arith_prompts_like_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("arith-sft");
    let pairs = &r["eval_pairs"].as_array().unwrap()[..20];
    let lines: Vec<String> = pairs
        .iter()
        .map(|p| serde_json::json!({"messages": [{"role": "user", "content": format!("Compute: {}+{}", p[0], p[1])}]}).to_string())
        .collect();
    std::fs::write(dir.path().join("in.jsonl"), lines.join("\n")).unwrap();
    let model = fixtures().join("arith-sft");
    let out = weir(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            "in.jsonl",
            "--output",
            "out.parquet",
            "--max-new-tokens",
            "6",
            "--greedy",
            "--batch-size",
            "7",
        ],
        dir.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let batch = read(&dir.path().join("out.parquet"));
    let texts = batch.column_by_name("response").unwrap().as_string::<i32>();
    let tokens = batch
        .column_by_name("response_tokens")
        .unwrap()
        .as_list::<i32>();
    let reasons = batch
        .column_by_name("finish_reason")
        .unwrap()
        .as_string::<i32>();
    let lps = batch
        .column_by_name("response_logprobs")
        .unwrap()
        .as_list::<i32>();
    for i in 0..pairs.len() {
        assert_eq!(texts.value(i), r["greedy_texts_fp64"][i].as_str().unwrap());
        let want: Vec<i64> = r["greedy_completion_ids_fp32"][i]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        assert_eq!(
            tokens
                .value(i)
                .as_primitive::<Int64Type>()
                .values()
                .to_vec(),
            want
        );
        assert_eq!(
            reasons.value(i),
            if want.last() == Some(&2) {
                "stop"
            } else {
                "length"
            }
        );
        assert_eq!(lps.value(i).len(), want.len());
    }
    // Sampling with --ignore-eos gives exactly N tokens per sample, n samples per prompt.
    let out = weir(
        &[
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            "in.jsonl",
            "--output",
            "s.parquet",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--n",
            "3",
            "--seed",
            "4",
            "--ignore-eos",
        ],
        dir.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let batch = read(&dir.path().join("s.parquet"));
    assert_eq!(batch.num_rows(), 60);
    let tokens = batch
        .column_by_name("response_tokens")
        .unwrap()
        .as_list::<i32>();
    assert!((0..60).all(|i| tokens.value(i).len() == 5));
}

#[test]
fn score_command_matches_the_reward_reference() {
    let dir = tempfile::tempdir().unwrap();
    let r = reference("tiny-llama-rm");
    let cases = r["single"].as_array().unwrap();
    write_input_ids(dir.path(), cases);
    let model = fixtures().join("tiny-llama-rm");
    let out = weir(
        &[
            "score",
            "--model",
            model.to_str().unwrap(),
            "--input",
            "in.jsonl",
            "--output",
            "out.parquet",
        ],
        dir.path(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let batch = read(&dir.path().join("out.parquet"));
    let scores = batch
        .column_by_name("score")
        .unwrap()
        .as_primitive::<Float32Type>();
    for (i, case) in cases.iter().enumerate() {
        assert!((f64::from(scores.value(i)) - case["score"].as_f64().unwrap()).abs() < 1e-4);
    }
}

#[test]
fn bad_lines_are_named_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-llama");
    let m = model.to_str().unwrap();
    std::fs::write(
        dir.path().join("bad.jsonl"),
        "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1, 5000]}\n",
    )
    .unwrap();
    let out = weir(
        &[
            "logprobs",
            "--model",
            m,
            "--input",
            "bad.jsonl",
            "--output",
            "out.parquet",
        ],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("bad.jsonl: line 2") && stderr.contains("5000"),
        "{stderr}"
    );
    assert!(!dir.path().join("out.parquet").exists());
    std::fs::write(
        dir.path().join("bad.jsonl"),
        "{\"input_ids\": [1, 2, 3]}\nnot json\n",
    )
    .unwrap();
    let out = weir(
        &[
            "generate",
            "--model",
            m,
            "--input",
            "bad.jsonl",
            "--output",
            "out.parquet",
            "--max-new-tokens",
            "2",
        ],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("line 2: not JSON"),
        "{stderr}"
    );
    let out = weir(
        &[
            "score",
            "--model",
            m,
            "--input",
            "bad.jsonl",
            "--output",
            "out.parquet",
        ],
        dir.path(),
    );
    assert!(!out.status.success());
    let out = weir(
        &[
            "logprobs",
            "--model",
            "/nonexistent",
            "--input",
            "bad.jsonl",
            "--output",
            "o.parquet",
        ],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// Writes a run folder with known metrics: 5 steps; `generate` on workers 0
/// and 1, the learner `train` on workers 2 and 3 (each step's reward is the
/// mean of the two workers' figures); plus summary.json and a rollouts file.
fn write_run(dir: &Path) {
    let rewards = [0.1, 0.3, 0.2, 0.6, 0.75];
    let mut rows = Vec::new();
    for (step, reward) in (0u64..).zip(rewards) {
        let done = 1_700_000_000.0 + 2.0 * step as f64;
        for worker in 0..2 {
            let row =
                |metric: &str, value| MetricRow::new(step, worker, "generate", metric, None, value);
            rows.extend([
                row("busy_s", 1.5),
                row("rows_out", 8.0),
                row("policy_version", step.saturating_sub(1) as f64),
                row("done_unix_s", done - 1.0),
            ]);
        }
        for (worker, spread) in [(2, -0.05), (3, 0.05)] {
            let row =
                |metric: &str, value| MetricRow::new(step, worker, "train", metric, None, value);
            rows.extend([
                row("busy_s", 0.5),
                row("rows_in", 8.0),
                row("done_unix_s", done),
                row("reward", reward + spread),
                row("kl", 0.01 * step as f64),
                row("loss", 1.0 / (step + 1) as f64),
            ]);
            let staleness = |label: &str, n| {
                MetricRow::new(step, worker, "train", "staleness", Some(label.into()), n)
            };
            if step == 0 {
                rows.push(staleness("0", 8.0));
            } else {
                rows.extend([staleness("0", 2.0), staleness("1", 6.0)]);
            }
        }
    }
    let batch = rows_to_batch(&rows).unwrap();
    write_parquet_atomically(&dir.join("metrics.parquet"), &[batch]).unwrap();
    std::fs::write(
        dir.join("summary.json"),
        r#"{"algo": "grpo", "final_reward": 0.75, "steps": 5, "eval": {"solve_rate": 0.5}}"#,
    )
    .unwrap();
    let rollouts = RecordBatch::try_from_iter([(
        "row_id",
        Arc::new(UInt64Array::from(vec![1, 2, 3])) as ArrayRef,
    )])
    .unwrap();
    write_parquet_atomically(&dir.join("rollouts/part-0000-000000.parquet"), &[rollouts]).unwrap();
}

/// The whitespace-separated fields of the first line of `text` whose first field is `first`.
fn fields<'a>(text: &'a str, first: &str) -> Vec<&'a str> {
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&first))
        .unwrap_or_else(|| panic!("no line starting with `{first}` in:\n{text}"))
}

fn success(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

#[test]
fn inspect_summarises_a_run_folder() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path());
    let text = success(&weir(&["inspect", "."], dir.path()));
    assert_eq!(
        fields(&text, "steps")[1..],
        ["0..4", "(5", "steps)"],
        "{text}"
    );
    // Wall time: from the first `generate` completion (step 0) to the last learner one.
    assert_eq!(fields(&text, "wall")[2..4], ["9", "s"], "{text}");
    // 4 steps of 16 rows after the first, over 8 s between learner completions.
    assert!(
        text.contains("8 rows/s, 0.5 steps/s (rows_in of `train`)"),
        "{text}"
    );
    // first, last, min, max: means over the two learner workers.
    assert_eq!(
        fields(&text, "reward")[1..5],
        ["0.1", "0.75", "0.1", "0.75"],
        "{text}"
    );
    assert_eq!(
        fields(&text, "loss")[1..5],
        ["1", "0.2", "0.2", "1"],
        "{text}"
    );
    let spark = fields(&text, "reward")[5];
    assert_eq!(spark.chars().count(), 5, "{text}");
    assert!(spark.starts_with('▁') && spark.ends_with('█'), "{text}");
    assert!(
        !text.contains("entropy"),
        "entropy was not recorded: {text}"
    );
    // Staleness: 2 × 8 rows at 0 in step 0, then 2 × (2 at 0, 6 at 1) a step.
    let zero = fields(&text, "0");
    let one = fields(&text, "1");
    assert_eq!((zero[1], one[1]), ("32", "48"), "{text}");
    assert_eq!((zero[2].chars().count(), one[2].chars().count()), (27, 40));
    // busy 1.5 s × 2 workers × 5 steps of 9 s × 2 workers.
    assert_eq!(
        fields(&text, "generate")[1..],
        ["2", "15", "3", "83.3%"],
        "{text}"
    );
    assert_eq!(
        fields(&text, "train")[1..],
        ["2", "5", "13", "27.8%"],
        "{text}"
    );
    assert_eq!(fields(&text, "algo")[1..], ["=", "grpo"], "{text}");
    assert_eq!(fields(&text, "final_reward")[1..], ["=", "0.75"], "{text}");
    assert!(
        !text.contains("solve_rate"),
        "nested values are left out: {text}"
    );
    assert_eq!(
        fields(&text, "rollouts")[1..5],
        ["3", "rows", "in", "1"],
        "{text}"
    );
}

#[test]
fn plot_writes_png_charts_of_the_recorded_metrics() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path());
    let text = success(&weir(&["plot", "."], dir.path()));
    let names: Vec<String> = text
        .lines()
        .map(|l| {
            Path::new(l)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        names,
        [
            "reward.png",
            "kl.png",
            "loss.png",
            "staleness.png",
            "throughput.png"
        ]
    );
    for name in &names {
        let bytes = std::fs::read(dir.path().join("plots").join(name)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{name}");
        assert!(bytes.len() > 5_000, "{name}: {} bytes", bytes.len());
    }
    assert!(!dir.path().join("plots/entropy.png").exists());
}

#[test]
fn inspect_and_plot_name_a_missing_run_folder() {
    let dir = tempfile::tempdir().unwrap();
    for command in ["inspect", "plot"] {
        let out = weir(&[command, "/nonexistent/run"], dir.path());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(
            stderr.contains("/nonexistent/run") && !stderr.contains("panicked"),
            "{stderr}"
        );
    }
    // A folder without metrics.parquet is named too.
    let out = weir(&["inspect", "."], dir.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("metrics.parquet"),
        "{stderr}"
    );
}

#[test]
fn inspect_and_plot_read_a_sim_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "sim",
        "--steps",
        "4",
        "--batch-rows",
        "8",
        "--gen-ms",
        "1",
        "--train-ms",
        "1",
        "--out",
        "sim",
    ];
    success(&weir(&args, dir.path()));
    let text = success(&weir(&["inspect", "sim"], dir.path()));
    assert_eq!(fields(&text, "steps")[1], "0..3", "{text}");
    assert!(
        text.contains("rows/s") && text.contains("(rows_in of `learn`)"),
        "{text}"
    );
    // The sim records no learner curves; every row of every step reaches the learner once.
    assert!(!text.contains("per-step metrics"), "{text}");
    let staleness_rows: u64 = text
        .lines()
        .skip_while(|l| !l.starts_with("staleness"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(staleness_rows, 32, "{text}");
    for stage in ["generate", "score", "advantage", "learn"] {
        assert_eq!(fields(&text, stage).len(), 5, "{text}");
    }
    let written = success(&weir(&["plot", "sim"], dir.path()));
    assert!(
        written.contains("staleness.png") && written.contains("throughput.png"),
        "{written}"
    );
    assert!(!written.contains("reward.png"), "{written}");
}

#[test]
fn config_prints_every_key_and_run_names_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let text = success(&weir(&["config", "grpo"], tmp.path()));
    assert!(text.contains("# Bounded staleness k") && text.contains("[algorithm]"));
    // The printed file is a valid config for `weir run`.
    let parsed = weir::pipelines::RunConfig::load(
        weir::pipelines::PipelineKind::Grpo,
        Some((&text, "printed")),
        &[],
    )
    .unwrap();
    assert_eq!(
        parsed,
        weir::pipelines::RunConfig::defaults_for(weir::pipelines::PipelineKind::Grpo)
    );

    let model = fixtures().join("arith-sft");
    let model = model.to_str().unwrap();
    std::fs::write(tmp.path().join("bad.toml"), "[algorithm]\nlr = \"fast\"\n").unwrap();
    for (args, needle) in [
        (vec!["run", "nope"], "unknown pipeline `nope`"),
        (vec!["run", "grpo", "--config", "bad.toml"], "bad.toml"),
        (
            vec!["run", "grpo", "--config", "missing.toml"],
            "missing.toml",
        ),
        (
            vec!["run", "grpo", "--set", "run.stepz=3"],
            "unknown key `run.stepz`",
        ),
        (vec!["run", "grpo"], "model.path"),
        (
            vec![
                "run",
                "grpo",
                "--set",
                &format!("model.path={model}"),
                "--set",
                "algorithm.kl_estimator=k7",
            ],
            "algorithm.kl_estimator",
        ),
        (vec!["run", "--resume", "not-a-run"], "not-a-run"),
    ] {
        let out = weir(&args, tmp.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(
        !tmp.path().join("runs").exists(),
        "nothing written for bad input"
    );
}

#[test]
fn demo_writes_a_self_contained_run_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = weir(
        &[
            "demo",
            "--quiet",
            "--out",
            "d",
            "--sft-chunk",
            "4",
            "--max-sft-steps",
            "8",
            "--grpo-steps",
            "3",
        ],
        tmp.path(),
    );
    let text = success(&out);
    let dir = tmp.path().join("d");
    assert!(text.contains("run folder: d"), "{text}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    for key in [
        "eval_accuracy_before",
        "eval_accuracy_after",
        "samples_per_s",
        "max_staleness_observed",
    ] {
        assert!(summary[key].is_number(), "{key}: {summary}");
    }
    assert_eq!(summary["steps"], 3);
    assert_eq!(
        summary["sft_steps"], 8,
        "two SFT chunks (the target is out of reach)"
    );
    assert!(summary["max_staleness_observed"].as_u64().unwrap() <= 1);
    // Its own tokenizer and model, SFT and GRPO run folders with checkpoints and plots.
    for file in [
        "init/tokenizer.json",
        "init/config.json",
        "init/model.safetensors",
        "sft/config.resolved.toml",
        "sft/checkpoints/step-7/actor/model.safetensors",
        "grpo/config.resolved.toml",
        "grpo/metrics.parquet",
        "grpo/checkpoints/step-2/state.json",
        "grpo/plots/reward.png",
    ] {
        assert!(dir.join(file).is_file(), "{file}");
    }
    assert!(dir.join("grpo/rollouts").read_dir().unwrap().count() > 0);
}

#[test]
fn run_then_resume_through_the_command_line() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("arith-sft");
    let base = [
        "--quiet".to_string(),
        "--set".into(),
        format!("model.path={}", model.display()),
        "--set".into(),
        "data.prompts_per_step=4".into(),
    ];
    let mut args: Vec<String> = ["run", "sft", "--out", "r", "--set", "run.steps=2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(base.iter().cloned());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = success(&weir(&argv, tmp.path()));
    assert!(
        text.contains("pipeline: \"sft\"") && text.contains("run folder: r"),
        "{text}"
    );
    let dir = tmp.path().join("r");
    assert!(dir.join("plots/loss.png").is_file());
    assert!(dir
        .join("checkpoints/step-1/actor/model.safetensors")
        .is_file());

    // Two more steps on the same run folder.
    let text = success(&weir(
        &["run", "--resume", "r", "--quiet", "--set", "run.steps=4"],
        tmp.path(),
    ));
    assert!(text.contains("steps: 4"), "{text}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["resumed_at_step"], 2);
    assert!(dir.join("checkpoints/step-3/state.json").is_file());
    let resolved = std::fs::read_to_string(dir.join("config.resolved.toml")).unwrap();
    assert!(resolved.starts_with("pipeline = \"sft\"") && resolved.contains("steps = 4"));
    // Starting a new run into the same folder is refused.
    let out = weir(&argv, tmp.path());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already holds a run"));
}
