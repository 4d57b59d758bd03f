//! `weir inspect` and `weir plot` on a run folder of known metrics and on a `weir sim` run.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, UInt64Array};
use weir::graph::metrics::{rows_to_batch, MetricRow};
use weir::graph::parquet_log::write_parquet_atomically;

use super::*;

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
                row("slot_occupancy", 0.5 + 0.1 * step as f64),
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
                row("row_latency_s", 1.0 + 0.2 * step as f64),
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
            "row_latency_s.png",
            "generate_slot_occupancy.png",
            "staleness.png",
            "throughput.png",
            "idle.png"
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
    // The sim records no learner curves (its generator records only when
    // the engine retired its weights); every row of every step reaches the
    // learner once.
    assert!(!text.contains(" learn/"), "{text}");
    assert!(text.contains("generate/weights_retired"), "{text}");
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
    // The weights edge: the versions the generator loaded, the sim's 4,096-byte payload.
    let loads: u64 = fields(&text, "weights")[1].parse().unwrap();
    assert!(loads >= 1 && text.contains("0.004096 MB each"), "{text}");
    let written = success(&weir(&["plot", "sim"], dir.path()));
    assert!(
        written.contains("staleness.png") && written.contains("throughput.png"),
        "{written}"
    );
    assert!(!written.contains("reward.png"), "{written}");
}

#[test]
fn inspect_shows_an_episode_turn_by_turn() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("env.py"),
        "class AgentInstance:\n    def __init__(self):\n        self.steps = 0\n    def reset(self, states):\n        return states\n    def step(self, states):\n        self.steps += 1\n        return {'rewards': 0.25, 'environment_feedback': '\\nAgain:', 'done': self.steps >= 2}\n",
    )
    .unwrap();
    let model = format!(
        "model.path={:?}",
        fixtures().join("arith-sft").display().to_string()
    );
    let sets = [
        model.as_str(),
        "run.steps=1",
        "data.prompts_per_step=2",
        "data.samples_per_prompt=2",
        "generate.max_new_tokens=48",
        "eval.arith=false",
        "agent.environment=\"env.py\"",
    ];
    let mut args = vec!["run", "grpo", "--quiet", "--out", "run"];
    for set in &sets {
        args.extend(["--set", set]);
    }
    success(&weir(&args, dir.path()));
    let mut seen_observation = false;
    for row in 0..4 {
        let spec = format!("0:{row}");
        let text = success(&weir(&["inspect", "run", "--episode", &spec], dir.path()));
        assert!(
            text.starts_with(&format!("episode: step 0, row {row} ")),
            "{text}"
        );
        assert!(text.contains("turn 0 model ▸"), "{text}");
        // The spans' token counts add up to the counts' line.
        let spans: usize = text
            .lines()
            .filter(|l| {
                l.contains(" ▸ (") || l.contains("◂ observation (") || l.contains("· boundary (")
            })
            .map(|l| {
                let n = l.split(" (").nth(1).unwrap().split(' ').next().unwrap();
                n.parse::<usize>().unwrap()
            })
            .sum();
        let counts = text.lines().find(|l| l.starts_with("tokens: ")).unwrap();
        let total: usize = counts
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse::<usize>().ok())
            .sum();
        assert_eq!(spans, total, "{text}");
        if text.contains("◂ observation") {
            seen_observation = true;
            assert!(
                text.contains("◂ observation (") && text.contains("\"\\nAgain:\""),
                "{text}"
            );
            assert!(text.contains("turn 1 model ▸"), "{text}");
            assert!(text.contains("environment reward 0.25"), "{text}");
        }
    }
    assert!(seen_observation, "no episode got a second turn");
    let out = weir(&["inspect", "run", "--episode", "0:4"], dir.path());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("step 0 has 4 rows"), "{err}");
}
