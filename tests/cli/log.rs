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

    // Two data-parallel learner ranks, each fed the rows its worker logged,
    // summing through a group as in the run: the same bits.
    let mut ranks = sets.to_vec();
    ranks.extend(["placement.workers=3", "placement.train=[1, 2]"]);
    run_in(tmp.path(), &run_args("grpo", "ranks", &model, &ranks));
    let text = success(&weir(&["replay", "ranks", "--steps", "2.."], tmp.path()));
    assert!(text.contains("on 2 data-parallel ranks"), "{text}");
    assert_eq!(
        last_line(&text),
        "replay: steps=2 metrics=24 max_abs_diff=0e0",
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

/// The `--set` arguments of an export's `read it with:` line.
fn read_with(text: &str) -> Vec<String> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("read it with: "))
        .unwrap_or_else(|| panic!("no `read it with:` line in {text}"));
    line.split(", ")
        .flat_map(|kv| ["--set".to_string(), kv.replace(" = ", "=")])
        .collect()
}

fn jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn exports_feed_the_sft_dpo_and_rl_pipelines() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = fixtures().join("arith-sft");
    let sets = ["run.steps=4", "data.prompts_per_step=6"];
    run_in(dir, &run_args("grpo", "r", &model, &sets));

    the_python_example_reads_the_log_as_the_run_recorded_it(&dir.join("r"));

    // Rejection sampling: the best response of each prompt that solved it.
    let text = success(&weir(
        &["export", "r", "--as", "sft", "--out", "best.jsonl"],
        dir,
    ));
    assert!(
        last_line(&text).starts_with("export: rows_read=96 written="),
        "{text}"
    );
    let best = jsonl(&dir.join("best.jsonl"));
    assert!(!best.is_empty());
    for record in &best {
        // A reward of 1 on arith is the exact answer.
        assert_eq!(record["reward"], 1.0, "{record}");
        assert_eq!(record["response"], record["answer"], "{record}");
    }
    let mut sft = vec!["run", "sft", "--quiet", "--out", "sft", "--set"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    sft.extend([
        format!("model.path={}", model.display()),
        "--set".into(),
        "run.steps=2".into(),
        "--set".into(),
        "data.prompts_per_step=2".into(),
        "--set".into(),
        "eval.arith=false".into(),
    ]);
    sft.extend(read_with(&text));
    let trained = run_in(dir, &sft);
    assert!(trained.contains("pipeline: \"sft\""), "{trained}");

    // Preference pairs: each group's best and worst, from step 1 on.
    let text = success(&weir(
        &[
            "export",
            "r",
            "--as",
            "dpo",
            "--where",
            "step >= 1",
            "--out",
            "pairs.parquet",
        ],
        dir,
    ));
    assert!(
        last_line(&text).starts_with("export: rows_read=72 "),
        "{text}"
    );
    let pairs = crate::read(&dir.join("pairs.parquet"));
    assert!(pairs.num_rows() > 0);
    let rewards = |name| {
        pairs
            .column_by_name(name)
            .unwrap()
            .as_any()
            .downcast_ref::<arrow::array::Float64Array>()
            .unwrap()
            .values()
            .to_vec()
    };
    let (chosen, rejected) = (rewards("chosen_reward"), rewards("rejected_reward"));
    assert!(chosen.iter().zip(&rejected).all(|(c, r)| c > r));
    let mut dpo: Vec<String> = ["run", "dpo", "--quiet", "--out", "dpo", "--set"]
        .into_iter()
        .map(String::from)
        .collect();
    dpo.extend([
        format!("model.path={}", model.display()),
        "--set".into(),
        "run.steps=2".into(),
        "--set".into(),
        "data.prompts_per_step=2".into(),
    ]);
    dpo.extend(read_with(&text));
    assert!(run_in(dir, &dpo).contains("pipeline: \"dpo\""));

    // The prompts no response solved, as the next run's prompt set.
    let text = success(&weir(
        &[
            "export",
            "r",
            "--as",
            "prompts",
            "--unsolved",
            "--out",
            "hard.jsonl",
        ],
        dir,
    ));
    let hard = jsonl(&dir.join("hard.jsonl"));
    assert!(!hard.is_empty(), "{text}");
    assert!(hard.iter().all(|p| p["best_reward"].as_f64() < Some(1.0)));
    let mut grpo = run_args("grpo", "again", &model, &["run.steps=1"]);
    grpo.extend(read_with(&text));
    let again = run_in(dir, &grpo);
    assert!(again.contains("steps: 1"), "{again}");
    // Its prompts are the exported ones (rendered with the chat template).
    let rows = weir::graph::parquet_log::read_parquet_dir(&dir.join("again/rollouts")).unwrap();
    let prompts = weir::operators::data::columns::strings(&rows[0], "prompt", "test").unwrap();
    let exported: Vec<&str> = hard.iter().map(|p| p["prompt"].as_str().unwrap()).collect();
    assert!(
        prompts
            .iter()
            .all(|p| exported.iter().any(|e| p.contains(e))),
        "{prompts:?} {exported:?}"
    );

    // An existing file is never overwritten; an empty result names the filter.
    let err = failure(dir, &["export", "r", "--as", "sft", "--out", "best.jsonl"]);
    assert!(err.contains("the file exists"), "{err}");
    let err = failure(
        dir,
        &[
            "export",
            "r",
            "--as",
            "sft",
            "--where",
            "reward > 5",
            "--out",
            "none.jsonl",
        ],
    );
    assert!(
        err.contains("no row matches the filter \"reward > 5\""),
        "{err}"
    );
    assert!(!dir.join("none.jsonl").exists());

    // Prompts a file rendered through the chat template (a system prompt
    // and a question) export as their conversations, a Parquet list of
    // {role, content} read back with data.messages_column: the next run's
    // prompt tokens are the logged ones.
    let questions = dir.join("questions.jsonl");
    let lines: Vec<String> = (1..4)
        .map(|i| {
            serde_json::json!({"question": format!("{i}+{i}="), "answer": format!("{}", 2 * i)})
                .to_string()
        })
        .collect();
    std::fs::write(&questions, lines.join("\n")).unwrap();
    let file = format!("data.prompts={}", questions.display());
    let chat = [
        "run.steps=1",
        file.as_str(),
        "data.prompt_column=question",
        "data.apply_chat_template=true",
        "data.system_prompt=Be brief.",
    ];
    run_in(dir, &run_args("grpo", "chat", &model, &chat));
    let text = success(&weir(
        &["export", "chat", "--as", "prompts", "--out", "chat.parquet"],
        dir,
    ));
    assert!(
        text.contains("data.messages_column = \"messages\""),
        "{text}"
    );
    let mut grpo = run_args("grpo", "chat-again", &model, &["run.steps=1"]);
    grpo.extend(read_with(&text));
    run_in(dir, &grpo);
    let tokens_by_prompt = |run: &str| {
        let rows = rollouts(&dir.join(run));
        let prompts = weir::operators::data::columns::strings(&rows, "prompt", "test").unwrap();
        let tokens =
            weir::operators::data::columns::token_lists(&rows, "prompt_tokens", "test").unwrap();
        prompts
            .into_iter()
            .zip(tokens)
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let (before, again) = (tokens_by_prompt("chat"), tokens_by_prompt("chat-again"));
    assert_eq!(before.len(), 3);
    assert_eq!(before, again);
}

/// The run's summary.json.
fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// Every rollout row of a run folder, as one batch.
fn rollouts(dir: &Path) -> arrow::array::RecordBatch {
    let batches = weir::graph::parquet_log::read_parquet_dir(&dir.join("rollouts")).unwrap();
    weir::graph::concat_by_name(&batches).unwrap()
}

#[test]
fn training_from_a_log_improves_accuracy_and_a_mixed_run_logs_both_sources() {
    use weir::operators::data::columns::{strings, token_lists, u64s};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = fixtures().join("arith-sft");
    let common = [
        "run.steps=24",
        "run.checkpoint_every=0",
        "data.prompts_per_step=8",
        "data.samples_per_prompt=8",
        "generate.max_new_tokens=8",
        "algorithm.lr=1e-5",
    ];
    // The log: an on-policy GRPO run.
    run_in(dir, &run_args("grpo", "source", &model, &common));

    // A run that generates nothing: every group replayed from that log,
    // weighed by TIS; the final evaluation is its greedy accuracy.
    let mut sets = common.to_vec();
    sets.extend([
        "eval.arith=true",
        "algorithm.correction=\"tis\"",
        "data.rollouts=[\"source\"]",
    ]);
    run_in(dir, &run_args("grpo", "from_log", &model, &sets));
    let s = summary(&dir.join("from_log"));
    let (before, after) = (
        s["eval_accuracy_before"].as_f64().unwrap(),
        s["eval_accuracy_after"].as_f64().unwrap(),
    );
    assert!(after > before, "greedy accuracy {before} → {after}");
    let rows = rollouts(&dir.join("from_log"));
    let sources = strings(&rows, "source", "test").unwrap();
    assert!(sources.iter().all(|s| s == "log"), "{sources:?}");
    // Every replayed row is a row of the log, as the log holds it.
    let logged = rollouts(&dir.join("source"));
    let key = |b: &arrow::array::RecordBatch, step: &str, i: usize| {
        (
            u64s(b, step, "t").unwrap()[i],
            u64s(b, "prompt_id", "t").unwrap()[i],
            token_lists(b, "response_tokens", "t").unwrap()[i].clone(),
        )
    };
    let logged_keys: std::collections::BTreeSet<_> = (0..logged.num_rows())
        .map(|i| key(&logged, "step", i))
        .collect();
    for i in 0..rows.num_rows() {
        assert!(
            logged_keys.contains(&key(&rows, "logged_step", i)),
            "row {i}"
        );
    }

    // Half fresh, half replayed: both sources in the run's own log, the
    // importance weights and the replayed rows per step in its metrics.
    let mut sets = common.to_vec();
    sets.extend([
        "run.steps=3",
        "algorithm.correction=\"icepop\"",
        "data.rollouts=[\"source\"]",
        "data.replay_fraction=0.5",
        "data.rollouts_where=\"step >= 20\"",
    ]);
    run_in(dir, &run_args("grpo", "mixed", &model, &sets));
    let rows = rollouts(&dir.join("mixed"));
    let sources = strings(&rows, "source", "test").unwrap();
    let replayed = sources.iter().filter(|s| *s == "log").count();
    assert_eq!(replayed * 2, sources.len(), "{sources:?}");
    assert!(sources.iter().all(|s| s == "log" || s == "generated"));
    let logged_steps = rows.column_by_name("logged_step").unwrap();
    for (i, s) in sources.iter().enumerate() {
        // Replayed rows name their step in the log (the filter's), generated ones none.
        assert_eq!(logged_steps.is_null(i), s == "generated", "row {i}");
        if s == "log" {
            assert!(u64s(&rows, "logged_step", "t").unwrap()[i] >= 20);
        }
    }
    let metrics = weir::graph::parquet_log::read_parquet_file(&dir.join("mixed/metrics.parquet"))
        .unwrap()
        .iter()
        .flat_map(|b| batch_to_rows(b).unwrap())
        .collect::<Vec<_>>();
    let sum = |name: &str| -> f64 {
        metrics
            .iter()
            .filter(|r| r.metric == name)
            .map(|r| r.value)
            .sum()
    };
    assert_eq!(sum("log_rows") as usize, replayed);
    assert_eq!(
        metrics
            .iter()
            .filter(|r| r.metric == "is_weight_mean")
            .count(),
        3
    );
}

#[test]
fn bad_logs_are_refused_in_one_line_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = model_copy(dir);
    run_in(dir, &run_args("grpo", "r", &model, &["run.steps=2"]));
    let from = |log: &str, more: &[&str]| -> Vec<String> {
        let rollouts = format!("data.rollouts=[{log:?}]");
        let mut sets = vec!["algorithm.correction=\"tis\"", rollouts.as_str()];
        sets.extend(more);
        run_args("grpo", "out", &model, &sets)
    };
    let refused = |args: Vec<String>, needle: &str| {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = failure(dir, &argv);
        assert!(err.contains(needle), "{needle}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!dir.join("out").exists(), "{needle}: out/ was written");
    };
    // No correction for rows of another policy.
    refused(
        run_args("grpo", "out", &model, &["data.rollouts=[\"r\"]"]),
        "set algorithm.correction",
    );
    // A filter no row passes, and one that cannot be read.
    refused(
        from("r", &["data.rollouts_where=\"reward > 5\""]),
        "no row matches the filter \"reward > 5\"",
    );
    refused(
        from("r", &["data.rollouts_where=\"reward >\""]),
        "data.rollouts_where",
    );
    refused(
        from("r", &["data.rollouts_where=\"response > 1\""]),
        "column `response` is Utf8, not a number",
    );
    // A grpo log for the optimal token baseline, which needs each token's Σπ².
    refused(
        {
            let mut args = from("r", &[]);
            args[1] = "otb".into();
            args
        },
        "no `sum_pi_squared` column",
    );
    let part = std::fs::read_dir(dir.join("r/rollouts"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    let bytes = std::fs::read(&part).unwrap();
    // A file of another program: the metrics file is Parquet, not a log.
    let foreign = dir.join("foreign.parquet");
    std::fs::copy(dir.join("r/metrics.parquet"), &foreign).unwrap();
    refused(
        from("foreign.parquet", &[]),
        "foreign.parquet: not a weir rollout log",
    );
    // A truncated file.
    let cut = dir.join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    refused(
        from("cut.parquet", &[]),
        "cut.parquet: not a readable Parquet file",
    );
    // A column of the wrong type.
    let log = crate::read(&part);
    let schema = log.schema();
    let at = schema.index_of("reward").unwrap();
    let mut fields: Vec<arrow::datatypes::Field> =
        schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields[at] = arrow::datatypes::Field::new("reward", arrow::datatypes::DataType::Utf8, false);
    let mut columns = log.columns().to_vec();
    columns[at] = std::sync::Arc::new(arrow::array::StringArray::from(vec!["1"; log.num_rows()]));
    let wrong = arrow::array::RecordBatch::try_new(
        std::sync::Arc::new(arrow::datatypes::Schema::new(fields)),
        columns,
    )
    .unwrap();
    let typed = dir.join("typed.parquet");
    write_parquet_atomically(&typed, &[wrong]).unwrap();
    refused(from("typed.parquet", &[]), "typed.parquet: ");
    refused(from("typed.parquet", &[]), "column `reward` is Utf8");
    // A log of another tokenizer: its ids would mean other text.
    let other = dir.join("other-model");
    std::fs::create_dir_all(&other).unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), other.join(entry.file_name())).unwrap();
    }
    let mut text = std::fs::read_to_string(other.join("tokenizer.json")).unwrap();
    text.push('\n');
    std::fs::write(other.join("tokenizer.json"), text).unwrap();
    let mut args = from("r", &[]);
    let at = args
        .iter()
        .position(|a| a.starts_with("model.path="))
        .unwrap();
    args[at] = format!("model.path={}", other.display());
    refused(args, "the log's tokenizer.json");
    // The log itself is untouched by all of it.
    assert_eq!(std::fs::read(&part).unwrap(), bytes);
}

/// `scripts/read_rollouts.py` (polars and DuckDB, as docs/rollout-log.md
/// shows them) on `run`: its per-step rows, rewards and lengths are the
/// learner's, as `metrics.parquet` holds them. The Python is the test
/// script's venv (`scripts/test.sh` installs polars and duckdb there), or
/// `WEIR_TEST_PYTHON`.
fn the_python_example_reads_the_log_as_the_run_recorded_it(run: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var("WEIR_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join(".venv/bin/python"));
    let out = std::process::Command::new(&python)
        .arg(root.join("scripts/read_rollouts.py"))
        .arg(run)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (scripts/test.sh sets it up)", python.display()));
    let text = success(&out);
    let mut metrics = std::collections::BTreeMap::new();
    for batch in read_parquet_file(&run.join("metrics.parquet")).unwrap() {
        for r in batch_to_rows(&batch).unwrap() {
            if r.stage == "learn" {
                metrics.insert((r.step, r.metric), r.value);
            }
        }
    }
    let steps: Vec<&str> = text.lines().filter(|l| l.starts_with("polars ")).collect();
    assert_eq!(steps.len(), 4, "{text}");
    for line in steps {
        let field = |name: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        let step = field("step") as u64;
        assert_eq!(field("rows"), 24.0, "{line}");
        for name in ["reward", "response_length"] {
            let logged = metrics[&(step, name.to_string())];
            assert!(
                (field(name) - logged).abs() < 1e-6,
                "{line}: {name} {logged}"
            );
        }
    }
    let duck = text.lines().find(|l| l.starts_with("duckdb ")).unwrap();
    assert!(duck.starts_with("duckdb prompts=24 solved="), "{text}");
}
