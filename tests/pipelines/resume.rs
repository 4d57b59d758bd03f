//! Resuming: the same step counter, versions and data cursor after a
//! crash; the KL controller, the learning-rate schedules and the
//! curriculum go on where they stopped.

use std::collections::BTreeMap;
use std::path::Path;

use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::col;
use weir::pipelines::runner::read_resolved;
use weir::pipelines::{PipelineKind, RunConfig};

use super::support::{
    assert_curves_match, config, metric, metric_rows, run, u64s, write_arith_task,
};

/// Asserts `file` has the same bytes in run folders `a` and `b`.
fn assert_same_file(a: &Path, b: &Path, file: &str) {
    assert!(
        std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap(),
        "{file} differs between {} and {}",
        a.display(),
        b.display()
    );
}

/// (step → prompt ids drawn) from a run folder's rollouts.
fn prompts_by_step(dir: &Path) -> BTreeMap<u64, Vec<u64>> {
    let mut out: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        for (s, p) in u64s(&b, col::STEP)
            .into_iter()
            .zip(u64s(&b, col::PROMPT_ID))
        {
            out.entry(s).or_default().push(p);
        }
    }
    for ids in out.values_mut() {
        ids.sort();
    }
    out
}

#[test]
fn resume_continues_steps_versions_and_cursor_after_a_crash() {
    let kind = PipelineKind::Grpo;
    let tmp = tempfile::tempdir().unwrap();
    // Evaluated every two steps on five held-out prompts.
    let held = tmp.path().join("held.jsonl");
    let lines: Vec<String> = (0..5u32)
        .map(|i| {
            let content = weir::operators::tasks::arith::user_message(i, 7);
            serde_json::json!({"messages": [{"role": "user", "content": content}], "answer": (i + 7).to_string()})
                .to_string()
        })
        .collect();
    std::fs::write(&held, lines.join("\n")).unwrap();
    let config = |kind, steps| {
        let mut c = config(kind, steps);
        c.eval.prompts = Some(held.to_path_buf());
        c.data.messages_column = Some("messages".into());
        c.eval.every = 2;
        c
    };
    // The run as it should be: four steps straight.
    let straight = tmp.path().join("straight");
    run(kind, config(kind, 4), &straight, false);

    // A run that "crashed" after step 2: its step-2 checkpoint never landed.
    let crashed = tmp.path().join("crashed");
    let mut first = config(kind, 3);
    first.run.checkpoint_every = 2;
    run(kind, first, &crashed, false);
    std::fs::remove_dir_all(crashed.join("checkpoints/step-2")).unwrap();
    // Resume, asking for four steps in all.
    let (k, cfg) = read_resolved(&crashed).unwrap();
    let cfg = cfg.with_overrides(&["run.steps=4".into()]).unwrap();
    let summary = run(k, cfg, &crashed, true);
    assert_eq!(summary["resumed_at_step"], 2);

    // No step repeated or skipped, and the same prompts as the straight run.
    assert_eq!(prompts_by_step(&crashed), prompts_by_step(&straight));
    // Step 2's first rows were moved aside, not lost.
    assert!(
        crashed
            .join("rollouts/superseded")
            .read_dir()
            .unwrap()
            .count()
            > 0
    );
    // The version counter continues: the learner of step s holds version s.
    for b in read_parquet_dir(&crashed.join("rollouts")).unwrap() {
        assert_eq!(u64s(&b, col::LEARNER_VERSION), u64s(&b, col::STEP));
    }
    // Metrics hold each step once, the resumed steps from the resumed run.
    let losses = metric(&crashed, "learn", "loss");
    assert_eq!(losses.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crashed.join("checkpoints/step-3/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["version"].as_u64()),
        (Some(3), Some(4))
    );
    // The cursor after step 3: 4 steps × 3 prompts drawn.
    assert_eq!(state["cursor"]["position"].as_u64(), Some(12));
    // The earlier metrics file was kept aside, not overwritten.
    assert_eq!(crashed.join("superseded").read_dir().unwrap().count(), 1);
    // Each evaluation once: the kept one of step 0, step 2's again by the
    // resumed generators, and the final policy's (not the first attempt's).
    for dir in [&straight, &crashed] {
        let points = weir::pipelines::eval::points(&metric_rows(dir));
        assert_eq!(points.keys().copied().collect::<Vec<_>>(), vec![0, 2, 4]);
        assert!(points.values().all(|p| p.prompts == 5), "{points:?}");
        assert_eq!(points[&4].policy_version, 4);
    }

    // A crash before the first checkpoint: the resumed run starts over,
    // and what the first attempt wrote is kept aside.
    let early = tmp.path().join("early");
    run(kind, config(kind, 2), &early, false);
    std::fs::remove_dir_all(early.join("checkpoints")).unwrap();
    let (k, cfg) = read_resolved(&early).unwrap();
    let summary = run(k, cfg, &early, true);
    assert!(summary["resumed_at_step"].is_null());
    let steps = prompts_by_step(&early);
    assert_eq!(steps.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
    assert!(
        steps.values().all(|ids| ids.len() == 3 * 4),
        "each step once"
    );
    assert_eq!(
        early
            .join("rollouts/superseded")
            .read_dir()
            .unwrap()
            .count(),
        1
    );
}

#[test]
fn the_adaptive_kl_coefficient_follows_its_controller_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::ReinforcePp;
    let mut cfg = config(kind, 4);
    cfg.algorithm.kl_coef = 0.1;
    // A target far above any KL this run reaches: every step's error clips
    // at −0.2, and with the horizon at the step's 12 responses β shrinks
    // by 0.8 after each step.
    cfg.algorithm.kl_target = 1e6;
    cfg.algorithm.kl_horizon = 12.0;
    cfg.run.checkpoint_every = 2;
    let straight = tmp.path().join("straight");
    run(kind, cfg.clone(), &straight, false);
    let expected: BTreeMap<u64, f64> = (0..4).map(|s| (s, 0.1 * 0.8f64.powi(s as i32))).collect();
    let got = metric(&straight, "advantage", "kl_coef");
    assert_curves_match(&got, &expected, 4, "kl_coef");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(straight.join("checkpoints/step-1/state.json")).unwrap(),
    )
    .unwrap();
    assert!((state["values"]["kl_coef"].as_f64().unwrap() - 0.1 * 0.8f64.powi(2)).abs() < 1e-12);

    // Two steps, then two more from the checkpoint: the same coefficients.
    let resumed = tmp.path().join("resumed");
    run(kind, config_with_steps(&cfg, 2), &resumed, false);
    run(kind, cfg.clone(), &resumed, true);
    assert_curves_match(
        &metric(&resumed, "advantage", "kl_coef"),
        &expected,
        4,
        "resumed kl_coef",
    );
}

/// The actor's and the critic's learning-rate schedules go on from a
/// checkpoint where they stopped (warm-up and decay count optimizer steps,
/// restored with the optimizer): two steps and two resumed ones train
/// the same weights as four straight ones.
#[test]
fn learning_rate_schedules_continue_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Ppo;
    let mut cfg = config(kind, 4);
    cfg.run.max_staleness = 0;
    cfg.run.checkpoint_every = 2;
    cfg.algorithm.warmup_steps = 2;
    cfg.algorithm.schedule = weir::pipelines::config::ScheduleChoice::Cosine;
    let straight = tmp.path().join("straight");
    run(kind, cfg.clone(), &straight, false);
    let resumed = tmp.path().join("resumed");
    run(kind, config_with_steps(&cfg, 2), &resumed, false);
    run(kind, cfg.clone(), &resumed, true);
    for (stage, base) in [
        ("learn", cfg.algorithm.lr),
        ("critic_learn", cfg.algorithm.critic_lr),
    ] {
        let lr = metric(&straight, stage, "lr");
        // Warm-up over steps 0 and 1, then the cosine from its top.
        let want = [0.5 * base, base, base, 0.1 * base + 0.9 * base * 0.5];
        for (step, w) in want.iter().enumerate() {
            let got = lr[&(step as u64)];
            assert!(
                (got - w).abs() < 1e-12 * base,
                "{stage} step {step}: lr {got}, want {w}"
            );
        }
        assert_eq!(metric(&resumed, stage, "lr"), lr, "{stage}");
    }
    for component in ["actor", "critic"] {
        let file = format!("checkpoints/step-3/{component}/model.safetensors");
        assert_same_file(&straight, &resumed, &file);
    }
}

/// The curriculum's per-prompt stats are part of a checkpoint: a run
/// resumed from one skips the prompts the straight run skips, so it draws
/// the same prompts and trains the same weights.
#[test]
fn a_curriculum_resumes_with_the_stats_it_had() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("task.jsonl");
    let pairs: Vec<(u32, u32)> = (0..6).map(|i| (i % 4, i / 2)).collect();
    write_arith_task(&prompts, &pairs, |_| serde_json::json!({}));
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 8);
    cfg.data.prompts = weir::pipelines::config::Task::File(prompts.to_path_buf());
    cfg.data.messages_column = Some("messages".into());
    cfg.data.prompts_per_step = 2;
    cfg.run.max_staleness = 0;
    cfg.run.checkpoint_every = 2;
    cfg.curriculum.enabled = true;
    cfg.curriculum.min_samples = 1;
    cfg.curriculum.max_solve_rate = 0.5;
    let straight = tmp.path().join("straight");
    run(kind, cfg.clone(), &straight, false);
    // The curriculum acts: without it the run draws other prompts.
    let mut plain = cfg.clone();
    plain.curriculum = Default::default();
    let unskipped = tmp.path().join("plain");
    run(kind, plain, &unskipped, false);
    assert_ne!(prompts_by_step(&straight), prompts_by_step(&unskipped));

    let resumed = tmp.path().join("resumed");
    run(kind, config_with_steps(&cfg, 4), &resumed, false);
    run(kind, cfg.clone(), &resumed, true);
    assert_eq!(prompts_by_step(&resumed), prompts_by_step(&straight));
    assert_same_file(
        &straight,
        &resumed,
        "checkpoints/step-7/actor/model.safetensors",
    );
}

fn config_with_steps(cfg: &RunConfig, steps: u64) -> RunConfig {
    let mut c = cfg.clone();
    c.run.steps = steps;
    c
}
