//! The catalogue of bad input to `weir run`: each kind ends the command with
//! one line naming the file, key, row or value, a non-zero exit and no
//! panic, and loses nothing already written.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::time::Duration;

use super::*;

/// A reward server that answers every request with `status` and `body` after `delay`.
fn reward_server(status: u16, body: &'static str, delay: Duration) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap_or(0);
                    }
                }
                let mut request = vec![0; length];
                let _ = reader.read_exact(&mut request);
                std::thread::sleep(delay);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    url
}

/// What, the pipeline, extra `--set`s, extra arguments, what the error must hold.
type Case<'a> = (&'a str, &'a str, Vec<String>, Vec<String>, &'a str);

/// A port nothing listens on.
fn dead_url() -> String {
    let port = super::common::free_ports(1)[0];
    format!("http://127.0.0.1:{port}/reward")
}

fn prompts_file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn a_catalogue_of_bad_run_input_gets_one_line_each() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = fixtures().join("arith-sft").display().to_string();
    let rm = fixtures().join("tiny-llama-rm").display().to_string();
    let long_prompt = format!(
        "{{\"prompt\": \"{}\", \"answer\": \"1\"}}\n",
        "1+1=".repeat(4000)
    );
    std::fs::write(dir.join("syntax.toml"), "[run]\nsteps = 3\nthreads = \n").unwrap();
    std::fs::write(dir.join("type.toml"), "[algorithm]\nlr = \"fast\"\n").unwrap();
    std::fs::write(dir.join("syntax.toml.empty"), "\n").unwrap();
    std::fs::write(
        dir.join("rloo.toml"),
        "pipeline = \"rloo\"\n[run]\nsteps = 3\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("foreign")).unwrap();
    std::fs::write(dir.join("foreign/notes.txt"), "mine").unwrap();
    std::fs::create_dir_all(dir.join("empty-model")).unwrap();
    // tiny-llama with ids 300 and 301 swapped in its tokenizer.json.
    let swapped = dir.join("swapped-ids");
    std::fs::create_dir_all(&swapped).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("tiny-llama").join(f), swapped.join(f)).unwrap();
    }
    let mut tokenizer: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("tiny-llama/tokenizer.json")).unwrap(),
    )
    .unwrap();
    for entry in tokenizer["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .values_mut()
    {
        match entry.as_i64() {
            Some(300) => *entry = 301.into(),
            Some(301) => *entry = 300.into(),
            _ => {}
        }
    }
    std::fs::write(swapped.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let swapped = swapped.display().to_string();
    let qwen3 = fixtures().join("tiny-qwen3").display().to_string();
    let files = [
        ("empty", prompts_file(dir, "empty.jsonl", "")),
        ("csv", prompts_file(dir, "p.csv", "prompt,answer\n1+1=,2\n")),
        (
            "malformed",
            prompts_file(
                dir,
                "bad.jsonl",
                "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"2+2=\", \"answer\"\n",
            ),
        ),
        (
            "no-prompt",
            prompts_file(
                dir,
                "noprompt.jsonl",
                "{\"question\": \"1+1=\", \"answer\": \"2\"}\n",
            ),
        ),
        (
            "no-label",
            prompts_file(dir, "nolabel.jsonl", "{\"prompt\": \"1+1=\"}\n"),
        ),
        ("long", prompts_file(dir, "long.jsonl", &long_prompt)),
    ];
    let file = |k: &str| files.iter().find(|(n, _)| *n == k).unwrap().1.clone();
    let remote = |url: String| -> Vec<String> {
        vec![
            "reward.kind=remote".into(),
            format!("reward.url={url}"),
            "reward.attempts=2".into(),
            "reward.timeout_s=1".into(),
        ]
    };
    let slow = reward_server(200, "{\"rewards\": [1]}", Duration::from_secs(5));
    let malformed = reward_server(200, "{\"rewards\": [1, 2", Duration::ZERO);
    let wrong_count = reward_server(200, "{\"rewards\": [1.0]}", Duration::ZERO);
    let nan = reward_server(200, "{\"rewards\": [NaN, NaN, NaN, NaN]}", Duration::ZERO);
    let not_number = reward_server(200, "{\"rewards\": [\"high\", 1, 1, 1]}", Duration::ZERO);
    let busy = reward_server(503, "{}", Duration::ZERO);

    // (what, the pipeline, extra `--set`s, extra arguments, what the error must hold)
    let none = Vec::<String>::new;
    let set = |s: &str| vec![s.to_string()];
    let prompts = |k: &str| vec![format!("data.prompts={}", file(k))];
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let cases: Vec<Case> = vec![
        (
            "unknown pipeline",
            "nope",
            none(),
            none(),
            "unknown pipeline `nope`",
        ),
        (
            "TOML syntax",
            "grpo",
            none(),
            args(&["--config", "syntax.toml"]),
            "line 3",
        ),
        (
            "the file names another pipeline",
            "grpo",
            none(),
            args(&["--config", "rloo.toml"]),
            "`pipeline` = \"rloo\", but the run is \"grpo\"",
        ),
        (
            "eval every N without eval prompts",
            "grpo",
            set("eval.every=2"),
            none(),
            "eval.every",
        ),
        (
            "best checkpoint not saved at evaluations",
            "grpo",
            args(&[
                &format!("eval.prompts={}", file("no-prompt")),
                "eval.every=3",
                "eval.best_checkpoint=true",
                "run.checkpoint_every=2",
            ]),
            none(),
            "eval.best_checkpoint",
        ),
        (
            "unknown key",
            "grpo",
            set("run.stepz=3"),
            none(),
            "`run.stepz`",
        ),
        (
            "wrong type",
            "grpo",
            none(),
            args(&["--config", "type.toml"]),
            "algorithm.lr",
        ),
        (
            "negative staleness",
            "grpo",
            set("run.max_staleness=-1"),
            none(),
            "run.max_staleness",
        ),
        (
            "zero samples",
            "grpo",
            set("data.samples_per_prompt=0"),
            none(),
            "data.samples_per_prompt",
        ),
        (
            "top-p above 1",
            "grpo",
            set("generate.top_p=1.5"),
            none(),
            "generate.top_p",
        ),
        (
            "lr not positive",
            "grpo",
            set("algorithm.lr=0"),
            none(),
            "algorithm.lr",
        ),
        (
            "no such worker",
            "grpo",
            set("placement.train=[7]"),
            none(),
            "placement.train",
        ),
        (
            "a stop-properly scale above 1",
            "grpo",
            set("reward.stop_properly_coef=1.5"),
            none(),
            "reward.stop_properly_coef",
        ),
        (
            "the optimizer sharded over one rank",
            "grpo",
            set("placement.shard_optimizer=true"),
            none(),
            "placement.shard_optimizer",
        ),
        (
            "data-parallel ranks with dynamic sampling",
            "grpo",
            args(&[
                "placement.train=[0, 1]",
                "placement.rollout=[0, 1]",
                "dynamic_sampling.enabled=true",
            ]),
            none(),
            "dynamic sampling",
        ),
        (
            "missing prompt file",
            "grpo",
            set("data.prompts=missing.jsonl"),
            none(),
            "missing.jsonl",
        ),
        (
            "empty prompt file",
            "grpo",
            prompts("empty"),
            none(),
            "empty.jsonl",
        ),
        (
            "not JSONL or Parquet",
            "grpo",
            prompts("csv"),
            none(),
            "p.csv",
        ),
        (
            "malformed line",
            "grpo",
            prompts("malformed"),
            none(),
            "bad.jsonl: line 2",
        ),
        (
            "no prompt column",
            "grpo",
            prompts("no-prompt"),
            none(),
            "`prompt`",
        ),
        (
            "no label column",
            "grpo",
            prompts("no-label"),
            none(),
            "`answer`",
        ),
        (
            "prompt too long",
            "grpo",
            prompts("long"),
            none(),
            "long.jsonl",
        ),
        (
            "every prompt too long to keep",
            "grpo",
            [prompts("long"), set("data.skip_long_prompts=true")].concat(),
            none(),
            "long.jsonl: every prompt is longer than",
        ),
        (
            "missing model",
            "grpo",
            set("model.path=no-such-model"),
            none(),
            "no-such-model",
        ),
        (
            "not a checkpoint",
            "grpo",
            vec![format!("model.path={}", dir.join("empty-model").display())],
            none(),
            "empty-model",
        ),
        (
            "not a causal LM",
            "grpo",
            vec![format!("model.path={rm}")],
            none(),
            "tiny-llama-rm",
        ),
        (
            "reward model without a score head",
            "grpo",
            vec![
                "reward.kind=model".into(),
                format!("model.reward_model={model}"),
            ],
            none(),
            "score",
        ),
        (
            "a reference whose tokenizer reads an id as another token",
            "grpo",
            vec![format!("model.reference={swapped}")],
            none(),
            "`model.reference` = ",
        ),
        (
            "the id that differs",
            "ppo",
            vec![format!("model.critic={swapped}")],
            none(),
            "token id 300 is",
        ),
        (
            "a critic started from a reward model with fewer ids than the policy samples",
            "ppo",
            vec![
                format!("model.path={qwen3}"),
                "reward.kind=model".into(),
                format!("model.reward_model={rm}"),
            ],
            none(),
            "vocab_size 1000, the policy's",
        ),
        (
            "reward server down",
            "grpo",
            remote(dead_url()),
            none(),
            "127.0.0.1",
        ),
        (
            "reward server slow",
            "grpo",
            remote(slow),
            none(),
            "timed out",
        ),
        ("reward server busy", "grpo", remote(busy), none(), "503"),
        ("malformed JSON", "grpo", remote(malformed), none(), "JSON"),
        (
            "wrong number of rewards",
            "grpo",
            remote(wrong_count),
            none(),
            "1 values for 4 queries",
        ),
        ("NaN rewards", "grpo", remote(nan), none(), "NaN"),
        (
            "a reward that is not a number",
            "grpo",
            remote(not_number),
            none(),
            "rewards[0]",
        ),
        (
            "foreign output folder",
            "grpo",
            none(),
            args(&["--out", "foreign"]),
            "foreign",
        ),
        (
            "missing cluster secret file",
            "grpo",
            none(),
            args(&["--cluster-secret-file", "no-such-secret"]),
            "no-such-secret",
        ),
        (
            "empty cluster secret file",
            "grpo",
            none(),
            args(&["--cluster-secret-file", "syntax.toml.empty"]),
            "the first line is empty",
        ),
    ];
    assert!(cases.len() >= 20);
    let mut failed_start = None;
    for (i, (what, pipeline, sets, extra, needle)) in cases.into_iter().enumerate() {
        let mut args: Vec<String> = vec!["run".into(), pipeline.into(), "--quiet".into()];
        if !extra.iter().any(|a| a == "--out") {
            args.extend(["--out".into(), format!("out-{i}")]);
        }
        if what == "no label column" {
            failed_start = Some(format!("out-{i}"));
        }
        args.extend(extra);
        for set in [
            format!("model.path={model}"),
            "run.steps=2".into(),
            "data.prompts_per_step=1".into(),
            "data.samples_per_prompt=4".into(),
            "generate.max_new_tokens=4".into(),
            "eval.arith=false".into(),
        ]
        .into_iter()
        .chain(sets)
        {
            args.extend(["--set".into(), set]);
        }
        let output = weir(&super::runs::strs(&args), dir);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{what}: succeeded");
        assert!(err.contains(needle), "{what}: wants {needle:?} in: {err}");
        // Retries may log warnings first; the error itself is one line.
        let error: Vec<&str> = err.trim().lines().filter(|l| !l.contains("WARN")).collect();
        assert_eq!(error.len(), 1, "{what}: one line: {err}");
        assert!(error[0].starts_with("error: "), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
    }
    // A run, then resumes whose config no longer matches its checkpoint.
    // It goes where a start failed on bad prompts: a folder holding no
    // step's output is taken over, not refused as a run to resume.
    let failed_start = failed_start.unwrap();
    assert!(dir
        .join(&failed_start)
        .join("config.resolved.toml")
        .is_file());
    std::fs::rename(dir.join(&failed_start), dir.join("done")).unwrap();
    let run = |args: &[&str]| weir(args, dir);
    let model_set = format!("model.path={model}");
    success(&run(&[
        "run",
        "grpo",
        "--quiet",
        "--out",
        "done",
        "--set",
        &model_set,
        "--set",
        "run.steps=2",
        "--set",
        "data.prompts_per_step=1",
        "--set",
        "data.samples_per_prompt=4",
        "--set",
        "generate.max_new_tokens=4",
        "--set",
        "eval.arith=false",
    ]));
    let resolved = dir.join("done/config.resolved.toml");
    let text = std::fs::read_to_string(&resolved).unwrap();
    let state = std::fs::read(dir.join("done/checkpoints/step-1/state.json")).unwrap();
    let edited = text.replace("seed = 42", "seed = 43");
    assert_ne!(edited, text, "the resolved config holds the seed");
    std::fs::write(&resolved, &edited).unwrap();
    for (what, args, needle) in [
        (
            "edited config",
            vec!["run", "--resume", "done"],
            "`run.seed`",
        ),
        (
            "fewer steps than done",
            vec![
                "run",
                "--resume",
                "done",
                "--set",
                "run.seed=42",
                "--set",
                "run.steps=1",
            ],
            "run.steps",
        ),
        (
            "another prompt set",
            vec![
                "run",
                "--resume",
                "done",
                "--set",
                "run.seed=42",
                "--set",
                "data.prompts=x.jsonl",
            ],
            "`data.prompts`",
        ),
    ] {
        let output = run(&args);
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{what}: succeeded");
        assert!(
            err.contains(needle) && err.contains("done"),
            "{what}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{what}: one line: {err}");
    }
    assert_eq!(
        std::fs::read_to_string(&resolved).unwrap(),
        edited,
        "a refused resume writes nothing"
    );
    assert_eq!(
        std::fs::read(dir.join("done/checkpoints/step-1/state.json")).unwrap(),
        state
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("foreign/notes.txt")).unwrap(),
        "mine",
        "nothing of a foreign folder is touched"
    );
}
