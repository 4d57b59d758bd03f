//! `weir config`, `weir run` (bad input, run then resume) and `weir demo`.

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
