//! `weir config`, `weir run` (bad input, run then resume, two processes).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::*;

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

    // `weir run --help` names every pipeline.
    let help = success(&weir(&["run", "--help"], tmp.path()));
    for kind in weir::pipelines::PipelineKind::ALL {
        assert!(
            help.contains(kind.name()),
            "{} missing from\n{help}",
            kind.name()
        );
    }

    let model = fixtures().join("arith-sft");
    let model = model.to_str().unwrap();
    std::fs::write(tmp.path().join("bad.toml"), "[algorithm]\nlr = \"fast\"\n").unwrap();
    // The same checkpoint with no end-of-sequence token anywhere.
    let endless = tmp.path().join("endless");
    std::fs::create_dir(&endless).unwrap();
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixtures().join("arith-sft").join(file), endless.join(file)).unwrap();
    }
    for file in ["config.json", "tokenizer_config.json"] {
        let mut v: Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures().join("arith-sft").join(file)).unwrap(),
        )
        .unwrap();
        v["eos_token_id"] = Value::Null;
        v["eos_token"] = Value::Null;
        std::fs::write(endless.join(file), v.to_string()).unwrap();
    }
    let endless = format!("model.path={}", endless.display());
    let with_model = |set: &str| -> Vec<String> {
        [
            "run",
            "grpo",
            "--set",
            &format!("model.path={model}"),
            "--set",
            set,
        ]
        .map(String::from)
        .to_vec()
    };
    for (args, needle) in [
        (
            with_model("generate.max_new_tokens=512"),
            "`generate.max_new_tokens` = 512",
        ),
        (
            with_model("generate.temperature=1e-40"),
            "generate.temperature",
        ),
        (with_model("reward.timeout_s=inf"), "reward.timeout_s"),
        (
            ["run", "grpo", "--set", &endless]
                .map(String::from)
                .to_vec(),
            "no end-of-sequence token",
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = weir(&args, tmp.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
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
    // A resolved config is a config: its `pipeline` key names the pipeline.
    let text = success(&weir(
        &[
            "run",
            "--config",
            "r/config.resolved.toml",
            "--out",
            "again",
            "--quiet",
            "--set",
            "run.steps=1",
        ],
        tmp.path(),
    ));
    assert!(text.contains("pipeline: \"sft\""), "{text}");
}

/// `weir run ARGS` as process `process` of two, in `dir`.
fn spawn_run(args: &[String], process: usize, hosts: &Path, dir: &Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .args(["--processes", "2", "--process-id", &process.to_string()])
        .arg("--hostfile")
        .arg(hosts)
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("weir binary starts")
}

/// Runs `args` as two processes; returns process 0's and 1's output.
fn run_two(args: &[String], dir: &Path) -> (String, String) {
    let hosts = super::common::hostfile(dir);
    let p0 = spawn_run(args, 0, &hosts, dir);
    let p1 = spawn_run(args, 1, &hosts, dir);
    let deadline = std::time::Duration::from_secs(240);
    let o1 = super::common::wait_with_deadline(p1, deadline);
    let o0 = super::common::wait_with_deadline(p0, deadline);
    (success(&o0), success(&o1))
}

/// A port p with p, p + 1, … p + n − 1 all free, taken through
/// `free_ports` so that no other test of this process is handed one of them.
fn consecutive_free_ports(n: usize) -> u16 {
    loop {
        let ports = super::common::free_ports(n);
        if ports.windows(2).all(|w| w[1] == w[0] + 1) {
            return ports[0];
        }
    }
}

/// Runs `args` as two processes started without cluster flags, process
/// `i`'s place in the environment `vars(i)`; their outputs (stdout, then
/// stderr's launcher line).
fn run_launched(
    args: &[String],
    dir: &Path,
    vars: &dyn Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<String> {
    let spawn = |i: usize| {
        std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(args)
            .envs(vars(i))
            .current_dir(dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("weir binary starts")
    };
    let (p0, p1) = (spawn(0), spawn(1));
    let deadline = std::time::Duration::from_secs(240);
    let outputs = [
        super::common::wait_with_deadline(p0, deadline),
        super::common::wait_with_deadline(p1, deadline),
    ];
    outputs
        .iter()
        .map(|o| {
            let text = success(o);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(err.contains("cluster: process"), "{err}");
            text
        })
        .collect()
}

pub(crate) fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn file_bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every metric row except timings, as (stage, metric, step, value) text.
fn metric_values(dir: &Path) -> Vec<String> {
    let timing = |m: &str| {
        m.ends_with("_s") || m.contains("per_s") || m.contains("queue") || m.contains("busy")
    };
    let mut rows: Vec<String> =
        weir::graph::parquet_log::read_parquet_file(&dir.join("metrics.parquet"))
            .unwrap()
            .iter()
            .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
            .filter(|r| !timing(&r.metric) && r.stage != "engine")
            .map(|r| format!("{} {} {} {}", r.stage, r.metric, r.step, r.value))
            .collect();
    rows.sort();
    rows
}

/// `weir run grpo --quiet --out OUT` with `--set` for each of `sets`.
fn grpo_args<'a>(out: &str, sets: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut a: Vec<String> = ["run", "grpo", "--quiet", "--out", out]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in sets {
        a.extend(["--set".to_string(), s.to_string()]);
    }
    a
}

/// `weir run --resume DIR --quiet --set run.steps=6`.
fn resume_to_six(dir: &str) -> Vec<String> {
    ["run", "--resume", dir, "--quiet", "--set", "run.steps=6"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn a_run_over_two_processes_matches_one_process_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("arith-sft");
    // Strictly on-policy (k = 0), so both runs are deterministic. The
    // generator sits on process 0, the learner on process 1, which has no
    // prompt source: its checkpoints must still hold the right cursor.
    // The processes encrypt what they exchange (no effect in one process),
    // and the bytes still match.
    let sets = [
        format!("model.path={}", model.display()),
        "placement.encrypt=true".into(),
        "run.steps=4".into(),
        "run.max_staleness=0".into(),
        "run.checkpoint_every=2".into(),
        "data.prompts_per_step=3".into(),
        "data.samples_per_prompt=4".into(),
        "generate.max_new_tokens=6".into(),
    ];
    let args = |out: &str, extra: &[&str]| -> Vec<String> {
        grpo_args(
            out,
            sets.iter().map(String::as_str).chain(extra.iter().copied()),
        )
    };

    let one = args("one", &[]);
    let text = success(&weir(&strs(&one), tmp.path()));
    assert!(text.contains("steps: 4"), "{text}");
    let (text0, text1) = run_two(&args("two", &[]), tmp.path());
    assert!(
        text0.contains("steps: 4") && text0.contains("plots:"),
        "{text0}"
    );
    assert!(text1.contains("process 1 of 2: done"), "{text1}");
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    for file in [
        "checkpoints/step-1/state.json",
        "checkpoints/step-3/state.json",
        "checkpoints/step-3/actor/model.safetensors",
        "config.resolved.toml",
    ] {
        assert!(
            file_bytes(&one.join(file)) == file_bytes(&two.join(file)),
            "{file} differs between one and two processes"
        );
    }
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(two.join("checkpoints/step-3/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["cursor"]["position"], 12, "{state}");
    assert_eq!(metric_values(&one), metric_values(&two));
    let summary = |dir: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
    };
    assert_eq!(
        summary(&one)["eval_accuracy_after"],
        summary(&two)["eval_accuracy_after"]
    );
    assert!(two.join("plots/reward.png").is_file());

    // The same two processes as a launcher starts them, their ids, count
    // and peers from its variables alone: srun's and torchrun's.
    let base = consecutive_free_ports(3);
    let slurm = |id: usize| {
        vec![
            ("SLURM_PROCID", id.to_string()),
            ("SLURM_NTASKS", "2".to_string()),
            ("SLURM_STEP_NODELIST", "127.0.0.[1]".to_string()),
            ("SLURM_STEP_TASKS_PER_NODE", "2".to_string()),
            ("WEIR_PORT", base.to_string()),
        ]
    };
    let torchrun = |id: usize| {
        vec![
            ("RANK", id.to_string()),
            ("WORLD_SIZE", "2".to_string()),
            ("LOCAL_WORLD_SIZE", "2".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            // Its own ports are the next two.
            ("MASTER_PORT", (base - 1).to_string()),
        ]
    };
    for (name, vars) in [
        (
            "slurm",
            &slurm as &dyn Fn(usize) -> Vec<(&'static str, String)>,
        ),
        ("torchrun", &torchrun),
    ] {
        let outputs = run_launched(&args(name, &[]), tmp.path(), vars);
        assert!(
            outputs[1].contains("process 1 of 2: done"),
            "{name}: {}",
            outputs[1]
        );
        let launched = tmp.path().join(name);
        for file in [
            "checkpoints/step-3/actor/model.safetensors",
            "config.resolved.toml",
        ] {
            assert!(
                file_bytes(&one.join(file)) == file_bytes(&launched.join(file)),
                "{file} differs between one process and {name}'s two"
            );
        }
        assert_eq!(metric_values(&one), metric_values(&launched), "{name}");
    }

    // Two more steps, resumed from step 3's checkpoint, in both layouts;
    // the weights now cross on timely's connections instead of the direct
    // channel, to the same bytes.
    success(&weir(&strs(&resume_to_six("one")), tmp.path()));
    let mut over_timely = resume_to_six("two");
    over_timely.extend([
        "--set".into(),
        "placement.weights_channel=\"timely\"".into(),
    ]);
    let (text0, _) = run_two(&over_timely, tmp.path());
    assert!(text0.contains("steps: 6"), "{text0}");
    assert_eq!(summary(&two)["resumed_at_step"], 4);
    for file in [
        "checkpoints/step-5/state.json",
        "checkpoints/step-5/actor/model.safetensors",
    ] {
        assert!(
            file_bytes(&one.join(file)) == file_bytes(&two.join(file)),
            "{file} differs after resuming"
        );
    }
    assert_eq!(metric_values(&one), metric_values(&two));

    // A weights port another program holds: both processes stop with one
    // error naming the key.
    let hosts = super::common::hostfile(tmp.path());
    let deadline = std::time::Duration::from_secs(120);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = format!(
        "placement.weights_port={}",
        taken.local_addr().unwrap().port()
    );
    let outputs: Vec<_> = (0..2)
        .map(|p| spawn_run(&args("taken", &[&port]), p, &hosts, tmp.path()))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|p| super::common::wait_with_deadline(p, deadline))
        .collect();
    super::common::assert_all_failed_with(&outputs, "placement.weights_port");
    drop(taken);

    // Processes started with different configs stop with one clear error.
    let p0 = spawn_run(&args("mismatch", &[]), 0, &hosts, tmp.path());
    let p1 = spawn_run(&args("mismatch", &["run.steps=5"]), 1, &hosts, tmp.path());
    super::common::assert_all_failed_with(
        &[
            super::common::wait_with_deadline(p0, deadline),
            super::common::wait_with_deadline(p1, deadline),
        ],
        "runs different settings",
    );

    // Bad cluster input: one line each, nothing started.
    for (extra, needle) in [
        (vec!["--processes", "2", "--process-id", "0"], "--out"),
        (
            vec![
                "--out",
                "x",
                "--processes",
                "2",
                "--set",
                "placement.workers=3",
            ],
            "placement.workers",
        ),
        (
            vec!["--out", "x", "--processes", "2", "--process-id", "2"],
            "process id 2",
        ),
        (
            vec!["--out", "x", "--peer-timeout-s", "0"],
            "--peer-timeout-s",
        ),
    ] {
        let mut a = vec!["run", "grpo", "--set"];
        let model_set = format!("model.path={}", model.display());
        a.push(&model_set);
        a.extend(extra.iter().copied());
        let out = weir(&a, tmp.path());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{a:?} succeeded");
        assert!(err.contains(needle), "{a:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{a:?}: one line: {err}");
    }
    assert!(
        !tmp.path().join("x").exists(),
        "nothing written for bad input"
    );
}

/// Data-parallel learner ranks in two processes (one rank each) train
/// exactly like the same ranks as two threads of one process: the same
/// checkpoints byte for byte and the same metrics, also after a resume.
#[test]
fn data_parallel_ranks_in_two_processes_match_one_process_and_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("arith-sft");
    let sets = [
        format!("model.path={}", model.display()),
        "run.steps=4".into(),
        "run.max_staleness=0".into(),
        "run.checkpoint_every=2".into(),
        "data.prompts_per_step=4".into(),
        "data.samples_per_prompt=4".into(),
        "generate.max_new_tokens=6".into(),
        "placement.workers=2".into(),
        "placement.rollout=[0]".into(),
        "placement.train=[0, 1]".into(),
        "algorithm.mini_batches=2".into(),
    ];
    let args = |out: &str| grpo_args(out, sets.iter().map(String::as_str));
    success(&weir(&strs(&args("one")), tmp.path()));
    let (text0, text1) = run_two(&args("two"), tmp.path());
    assert!(text0.contains("steps: 4"), "{text0}");
    assert!(text1.contains("process 1 of 2: done"), "{text1}");
    let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
    let same = |files: &[&str]| {
        for file in files {
            assert!(
                file_bytes(&one.join(file)) == file_bytes(&two.join(file)),
                "{file} differs between ranks in one process and in two"
            );
        }
    };
    same(&[
        "checkpoints/step-1/actor/model.safetensors",
        "checkpoints/step-3/actor/model.safetensors",
        "checkpoints/step-3/actor/optimizer.safetensors",
        "checkpoints/step-3/state.json",
    ]);
    let learn = |dir: &Path| -> Vec<String> {
        metric_values(dir)
            .into_iter()
            .filter(|r| r.starts_with("learn "))
            .collect()
    };
    assert!(learn(&one)
        .iter()
        .any(|r| r.starts_with("learn grad_norm 3 ")));
    assert_eq!(metric_values(&one), metric_values(&two));
    // Both ranks trained rows of their own in the two-process run.
    let rows_in: BTreeMap<u32, f64> =
        weir::graph::parquet_log::read_parquet_file(&two.join("metrics.parquet"))
            .unwrap()
            .iter()
            .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
            .filter(|r| r.stage == "learn" && r.metric == "rows_in")
            .fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.worker).or_insert(0.0) += r.value;
                m
            });
    assert!(
        rows_in.len() == 2 && rows_in.values().all(|&n| n > 0.0),
        "{rows_in:?}"
    );

    // Resumed across processes: rank 1 restores the optimizer rank 0 saved.
    success(&weir(&strs(&resume_to_six("one")), tmp.path()));
    let (text0, _) = run_two(&resume_to_six("two"), tmp.path());
    assert!(text0.contains("steps: 6"), "{text0}");
    same(&[
        "checkpoints/step-5/actor/model.safetensors",
        "checkpoints/step-5/state.json",
    ]);
    assert_eq!(metric_values(&one), metric_values(&two));

    // The optimizer state sharded over the two processes' ranks (ZeRO):
    // the same weights byte for byte, each rank holding about half the
    // state, rank 0 writing one file per rank that together hold the
    // unsharded state; resumed across processes, still the same.
    let sharded: Vec<String> = args("zero")
        .into_iter()
        .chain(["--set".into(), "placement.shard_optimizer=true".into()])
        .collect();
    run_two(&sharded, tmp.path());
    let zero = tmp.path().join("zero");
    for file in [
        "checkpoints/step-1/actor/model.safetensors",
        "checkpoints/step-3/actor/model.safetensors",
    ] {
        assert!(
            file_bytes(&one.join(file)) == file_bytes(&zero.join(file)),
            "{file}"
        );
    }
    let tensors = |dir: &Path, files: &[&str]| {
        let mut all: Vec<(String, Vec<u8>)> = Vec::new();
        for f in files {
            let bytes = file_bytes(&dir.join("checkpoints/step-3/actor").join(f));
            let (named, meta) = weir::gpu::snapshot::from_safetensors(&bytes).unwrap();
            // Four steps of two optimizer steps each.
            assert_eq!(meta["steps"], "8", "{f}");
            for (n, t) in named {
                let mut raw = vec![0u8; t.numel() * 4];
                t.copy_data_u8(&mut raw, t.numel());
                all.push((n, raw));
            }
        }
        all.sort();
        all
    };
    assert!(!zero
        .join("checkpoints/step-3/actor/optimizer.safetensors")
        .exists());
    assert!(
        tensors(&one, &["optimizer.safetensors"])
            == tensors(
                &zero,
                &[
                    "optimizer-00001-of-00002.safetensors",
                    "optimizer-00002-of-00002.safetensors"
                ]
            ),
        "the shards hold the unsharded state"
    );
    let state_bytes = |dir: &Path| -> Vec<String> {
        metric_values(dir)
            .into_iter()
            .filter(|r| r.starts_with("learn optimizer_state_bytes 3 "))
            .collect()
    };
    // Each rank records its own state's bytes: whole, the same on both;
    // sharded, about half each, together the whole.
    let bytes_of = |rows: Vec<String>| -> Vec<f64> {
        rows.iter()
            .map(|r| r.rsplit(' ').next().unwrap().parse().unwrap())
            .collect()
    };
    let (whole, shares) = (bytes_of(state_bytes(&one)), bytes_of(state_bytes(&zero)));
    assert!(whole.len() == 2 && whole[0] == whole[1], "{whole:?}");
    assert_eq!(shares.len(), 2, "{shares:?}");
    assert_eq!(shares.iter().sum::<f64>(), whole[0]);
    assert!(
        shares.iter().all(|s| (s / whole[0] - 0.5).abs() < 0.2),
        "{shares:?} of {whole:?}"
    );
    let without_state_bytes = |dir: &Path| -> Vec<String> {
        metric_values(dir)
            .into_iter()
            .filter(|r| !r.starts_with("learn optimizer_state_bytes "))
            .collect()
    };
    run_two(&resume_to_six("zero"), tmp.path());
    assert!(
        file_bytes(&one.join("checkpoints/step-5/actor/model.safetensors"))
            == file_bytes(&zero.join("checkpoints/step-5/actor/model.safetensors"))
    );
    assert_eq!(without_state_bytes(&one), without_state_bytes(&zero));
}
