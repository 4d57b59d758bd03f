//! Attacks a user of the same machine, or a file from elsewhere, could make
//! on a run, each ending in one line and a non-zero exit with memory
//! bounded and nothing written through a planted link (docs/security.md):
//! small files that decode or render to gigabytes, sparse side files,
//! crafted rollout logs and cursors, links planted where weir writes, and
//! the cluster secret read through `/proc` by what a run executes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, DictionaryArray, Float32Builder, Int64Builder, ListBuilder,
    RecordBatch, StringArray,
};
use arrow::datatypes::{DataType, Float32Type, Int32Type, Int64Type};
use weir::graph::parquet_log::{read_parquet_file, write_parquet_atomically};

use crate::{fixtures, success, weir};

/// `weir ARGS` in `dir` with `envs`, its output and its peak resident
/// memory in KiB (the child's own, from `wait4`).
fn weir_measured(args: &[&str], dir: &Path, envs: &[(&str, &str)]) -> (std::process::Output, u64) {
    let out = tempfile::tempdir().unwrap();
    let (stdout, stderr) = (out.path().join("out"), out.path().join("err"));
    // Waited on below with wait4, for its resource use.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(dir)
        .stdout(std::fs::File::create(&stdout).unwrap())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: rusage is plain data; the pid is this test's own child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as i32);
    let output = std::process::Output {
        status: std::os::unix::process::ExitStatusExt::from_raw(status),
        stdout: std::fs::read(stdout).unwrap(),
        stderr: std::fs::read(stderr).unwrap(),
    };
    (output, usage.ru_maxrss as u64)
}

/// The one line a refusal prints, checked: a non-zero exit, no panic or
/// abort, and every `words` in it.
fn one_line(output: &std::process::Output, words: &[&str]) -> String {
    let err = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "succeeded: {err}");
    assert_eq!(output.status.code(), Some(1), "killed or aborted: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    for word in words {
        assert!(err.contains(word), "`{word}` not in: {err}");
    }
    err
}

/// A copy of the arith checkpoint in `dir/name`.
fn model_copy(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(fixtures().join("arith-sft")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    to
}

/// `weir run grpo --quiet --out OUT` on `model`, small, with `sets`.
fn grpo(out: &str, model: &Path, sets: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "grpo", "--quiet", "--out", out]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let small = [
        format!("model.path={}", model.display()),
        "data.prompts_per_step=2".into(),
        "data.samples_per_prompt=2".into(),
        "generate.max_new_tokens=4".into(),
        "eval.arith=false".into(),
    ];
    for s in small.iter().map(String::as_str).chain(sets.iter().copied()) {
        args.extend(["--set".to_string(), s.to_string()]);
    }
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn sparse_side_files_of_a_checkpoint_are_refused_from_their_length() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("in.jsonl"),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Compute: 1+2\"}]}\n",
    )
    .unwrap();
    for name in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let model = model_copy(tmp.path(), name);
        // 3.2 GB that take no disk: read whole, they took 3.2 GB of memory.
        std::fs::OpenOptions::new()
            .write(true)
            .open(model.join(name))
            .unwrap()
            .set_len(3_200_000_000)
            .unwrap();
        let args = [
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            "in.jsonl",
            "--output",
            "out.parquet",
            "--max-new-tokens",
            "2",
        ];
        let (output, peak_kib) = weir_measured(&args, tmp.path(), &[]);
        one_line(&output, &[name, "3200000000 bytes", "more than"]);
        assert!(peak_kib < 1 << 20, "{name}: peak RSS {peak_kib} KiB");
        assert!(!tmp.path().join("out.parquet").exists());
    }
}

#[test]
fn an_input_line_past_the_record_bound_is_refused_before_it_is_read_whole() {
    let tmp = tempfile::tempdir().unwrap();
    // A 1 GB line (sparse: zeros, no newline) after a good one.
    let input = tmp.path().join("in.jsonl");
    std::fs::write(&input, "{\"input_ids\": [1, 2]}\n").unwrap();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&input)
        .unwrap();
    file.set_len(1 << 30).unwrap();
    let model = fixtures().join("arith-sft");
    let args = [
        "logprobs",
        "--model",
        model.to_str().unwrap(),
        "--input",
        "in.jsonl",
        "--output",
        "out.parquet",
    ];
    let (output, peak_kib) = weir_measured(&args, tmp.path(), &[]);
    one_line(&output, &["in.jsonl", "line 2", "longer than 16 MiB"]);
    assert!(peak_kib < 512 << 10, "peak RSS {peak_kib} KiB");
}

/// 600 rows of a 10 MiB string, dictionary-encoded: one copy in the file
/// (a few hundred KB compressed), 6 GB decoded.
#[test]
fn a_dictionary_encoded_prompt_file_is_decoded_within_its_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let long = "7".repeat(10 << 20);
    let values = StringArray::from(vec![long.as_str()]);
    let keys = arrow::array::Int32Array::from(vec![0; 600]);
    let prompts: DictionaryArray<Int32Type> =
        DictionaryArray::try_new(keys, Arc::new(values)).unwrap();
    let answers = StringArray::from(vec!["3"; 600]);
    let batch = RecordBatch::try_from_iter([
        ("prompt", Arc::new(prompts) as ArrayRef),
        ("answer", Arc::new(answers) as ArrayRef),
    ])
    .unwrap();
    let path = tmp.path().join("bomb.parquet");
    write_parquet_atomically(&path, &[batch]).unwrap();
    assert!(std::fs::metadata(&path).unwrap().len() < 2 << 20);
    let model = fixtures().join("arith-sft");
    let args = grpo(
        "r",
        &model,
        &[
            "data.prompts=bomb.parquet",
            "data.prompt_column=prompt",
            "data.label_column=answer",
            "run.steps=1",
        ],
    );
    let (output, peak_kib) = weir_measured(&strs(&args), tmp.path(), &[]);
    // Refused at its first row, as soon as its first batch is decoded.
    one_line(&output, &["bomb.parquet", "row 0"]);
    // Without a bound per decoded batch, the whole file (6 GB) was decoded at once.
    assert!(peak_kib < 3 << 20, "peak RSS {peak_kib} KiB");
}

/// `batch` with row 0 of list column `name` given `len` entries (zeros),
/// or one entry more than it had with `len` None.
fn with_row_zero_of_length(batch: &RecordBatch, name: &str, len: Option<usize>) -> RecordBatch {
    let schema = batch.schema();
    let at = schema.index_of(name).unwrap();
    let DataType::List(field) = schema.field(at).data_type().clone() else {
        panic!("{name} is not a list");
    };
    let list = batch.column(at).as_list::<i32>();
    let column: ArrayRef = match field.data_type() {
        DataType::Int64 => {
            let mut b = ListBuilder::new(Int64Builder::new()).with_field(field.clone());
            for row in 0..list.len() {
                let values = list.value(row);
                let values = values.as_primitive::<Int64Type>();
                let n = if row == 0 {
                    len.unwrap_or(values.len() + 1)
                } else {
                    values.len()
                };
                for i in 0..n {
                    b.values()
                        .append_value(if i < values.len() { values.value(i) } else { 0 });
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
        DataType::Float32 => {
            let mut b = ListBuilder::new(Float32Builder::new()).with_field(field.clone());
            for row in 0..list.len() {
                let values = list.value(row);
                let values = values.as_primitive::<Float32Type>();
                let n = if row == 0 {
                    len.unwrap_or(values.len() + 1)
                } else {
                    values.len()
                };
                for i in 0..n {
                    b.values().append_option(
                        (i < values.len() && values.is_valid(i))
                            .then(|| values.value(i))
                            .or(Some(0.0)),
                    );
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
        other => panic!("{name}: a list of {other}"),
    };
    let mut columns = batch.columns().to_vec();
    columns[at] = column;
    RecordBatch::try_new(schema, columns).unwrap()
}

/// Everything that reads a finished run's folder back: crafted logs and
/// cursors, and links planted where an export, a checkpoint and its state
/// are written.
#[test]
fn crafted_logs_cursors_and_planted_links_of_a_run_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = fixtures().join("arith-sft");
    let run = grpo("r", &model, &["run.steps=2", "run.checkpoint_every=1"]);
    success(&weir(&strs(&run), dir));
    let rollouts: Vec<PathBuf> = std::fs::read_dir(dir.join("r/rollouts"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    let batch = read_parquet_file(&rollouts[0]).unwrap().remove(0);

    // A log whose first row holds two million tokens (16 MB of ids,
    // compressed to almost nothing): refused against the model's context
    // before anything is sized by it.
    let long = dir.join("long");
    std::fs::create_dir_all(&long).unwrap();
    let bomb = with_row_zero_of_length(&batch, "response_tokens", Some(2_000_000));
    write_parquet_atomically(&long.join("part-0-0.parquet"), &[bomb]).unwrap();
    let args = grpo(
        "from-long",
        &model,
        &[
            "run.steps=1",
            "data.rollouts=[\"long\"]",
            "algorithm.correction=tis",
        ],
    );
    let (output, peak_kib) = weir_measured(&strs(&args), dir, &[]);
    one_line(&output, &["part-0-0.parquet", "row 0", "2000", "more than"]);
    assert!(peak_kib < 2 << 20, "peak RSS {peak_kib} KiB");

    // Behaviour log-probs one longer than the response: named, not a torch panic.
    let skewed = dir.join("skewed");
    std::fs::create_dir_all(&skewed).unwrap();
    let bad = with_row_zero_of_length(&batch, "behavior_logprobs", None);
    write_parquet_atomically(&skewed.join("part-0-0.parquet"), &[bad]).unwrap();
    let args = grpo(
        "from-skewed",
        &model,
        &[
            "run.steps=1",
            "data.rollouts=[\"skewed\"]",
            "algorithm.correction=tis",
        ],
    );
    one_line(
        &weir(&strs(&args), dir),
        &["part-0-0.parquet", "behavior_logprobs", "row 0"],
    );

    // An export with links planted at its old temporary names: their
    // target does not change, the export lands in place.
    let victim = dir.join("victim.txt");
    std::fs::write(&victim, "precious").unwrap();
    std::fs::create_dir_all(dir.join("px")).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("px/out.tmp")).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("px/out.jsonl.tmp")).unwrap();
    success(&weir(
        &["export", "r", "--as", "prompts", "--out", "px/out.jsonl"],
        dir,
    ));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert!(std::fs::read_to_string(dir.join("px/out.jsonl"))
        .unwrap()
        .contains("prompt"));
    // A link planted at the export's own name: refused as a file that
    // exists (and were it planted after that check, the rename replaces it).
    std::fs::remove_file(dir.join("px/out.jsonl")).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("px/out.jsonl")).unwrap();
    let output = weir(
        &["export", "r", "--as", "prompts", "--out", "px/out.jsonl"],
        dir,
    );
    one_line(&output, &["px/out.jsonl", "exists"]);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    // A resume that writes checkpoint 2 and its state with links planted
    // at every name a temporary had, and at the summary's own name.
    let next = dir.join("r/checkpoints/step-2");
    std::fs::create_dir_all(next.join("actor")).unwrap();
    for planted in [
        "state.tmp",
        "state.json.tmp",
        "actor/model.tmp",
        "actor/optimizer.tmp",
        "actor/config.tmp",
    ] {
        std::os::unix::fs::symlink(&victim, next.join(planted)).unwrap();
    }
    std::fs::remove_file(dir.join("r/summary.json")).unwrap();
    for planted in ["summary.tmp", "metrics.parquet.tmp", "summary.json"] {
        std::os::unix::fs::symlink(&victim, dir.join("r").join(planted)).unwrap();
    }
    success(&weir(
        &["run", "--resume", "r", "--quiet", "--set", "run.steps=3"],
        dir,
    ));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    let state = std::fs::read_to_string(next.join("state.json")).unwrap();
    assert!(state.contains("\"step\""), "{state}");
    let summary = std::fs::read_to_string(dir.join("r/summary.json")).unwrap();
    assert!(summary.contains("steps"), "{summary}");

    // A cursor no prompt set reaches, a step near 2⁶⁴, a component outside
    // the checkpoint: one line naming what is wrong.
    let state_path = dir.join("r/checkpoints/step-2/state.json");
    let mut state: serde_json::Value = serde_json::from_str(&state).unwrap();
    let crafted: [(&str, &str, serde_json::Value, &[&str]); 4] = [
        (
            "cursor",
            "position",
            u64::MAX.into(),
            &["cursor", "position"],
        ),
        ("cursor", "epoch", u64::MAX.into(), &["cursor", "epoch"]),
        ("", "step", u64::MAX.into(), &["state.json", "`step`"]),
        (
            "",
            "components",
            serde_json::json!(["../../.."]),
            &["state.json", "component"],
        ),
    ];
    for (outer, key, value, words) in crafted {
        let mut bad = state.clone();
        match outer {
            "" => bad[key] = value,
            _ => bad[outer][key] = value,
        }
        std::fs::write(&state_path, bad.to_string()).unwrap();
        let output = weir(
            &["run", "--resume", "r", "--quiet", "--set", "run.steps=4"],
            dir,
        );
        one_line(&output, words);
    }
    state["cursor"]["position"] = 0.into();
    std::fs::write(&state_path, state.to_string()).unwrap();
}

/// What a run executes (a Python reward here) cannot read the cluster
/// secret through its parent's `/proc/<pid>/environ`, and does not inherit it.
#[test]
fn a_reward_worker_cannot_read_the_cluster_secret() {
    let tmp = tempfile::tempdir().unwrap();
    let secret = "weir-secret-5f3a9c0e71";
    let seen = tmp.path().join("seen.txt");
    let reward = tmp.path().join("peek.py");
    std::fs::write(
        &reward,
        format!(
            "import os\n\
             SECRET = b'{secret}'\n\
             def reward_func(queries, prompts, labels, **rest):\n    \
             parent = os.getppid()\n    \
             found = []\n    \
             for name in ('environ', 'cmdline'):\n        \
             try:\n            \
             data = open(f'/proc/{{parent}}/{{name}}', 'rb').read()\n            \
             found.append(name + (':FOUND' if SECRET in data else ':clean'))\n        \
             except OSError:\n            \
             found.append(name + ':denied')\n    \
             found.append('own:' + ('FOUND' if SECRET.decode() in str(os.environ) else 'clean'))\n    \
             open({seen:?}, 'a').write(f'{{parent}} ' + ' '.join(found) + '\\n')\n    \
             return [0.0] * len(queries)\n",
            seen = seen.display().to_string()
        ),
    )
    .unwrap();
    let model = fixtures().join("arith-sft");
    let reward_file = format!("reward.file={}", reward.display());
    let args = grpo(
        "r",
        &model,
        &["run.steps=1", "reward.kind=python", reward_file.as_str()],
    );
    let child = Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(strs(&args))
        .env("WEIR_CLUSTER_SECRET", secret)
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    success(&child.wait_with_output().unwrap());
    let text = std::fs::read_to_string(&seen).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(!lines.is_empty());
    for line in lines {
        assert!(
            line.starts_with(&format!("{pid} ")),
            "not weir's child: {line}"
        );
        assert!(!line.contains("FOUND"), "{line}");
    }
}
