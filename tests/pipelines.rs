//! Every pipeline for a few steps on the fixture checkpoints, through the
//! runner that `weir run` uses: run folders, rollouts, metrics, checkpoints,
//! and resuming with the same step counter, versions and data cursor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, UInt64Type};
use weir::graph::parquet_log::{read_parquet_dir, read_parquet_file};
use weir::operators::rollout::{check, col, Phase};
use weir::pipelines::config::{
    Aggregation, CorrectionChoice, PreferenceChoice, ReferencePlacement, RewardKind,
    TeacherPlacement,
};
use weir::pipelines::runner::read_resolved;
use weir::pipelines::{PipelineKind, RunConfig};

#[path = "pipelines/support.rs"]
mod support;

#[path = "pipelines/agentic.rs"]
mod agentic;
#[path = "pipelines/judge.rs"]
mod judge;
use support::{config, fixture, request, reward_server, run};

/// The error of a run that must fail.
fn run_err(kind: PipelineKind, cfg: RunConfig, dir: &Path) -> String {
    weir::pipelines::run(&request(kind, cfg, dir, false))
        .unwrap_err()
        .to_string()
}

/// Copies the folder `from` to `to`, recursively.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Asserts that two per-step curves cover `steps` steps and agree within
/// 1e-4 relative (1e-6 absolute near zero).
fn assert_curves_match(a: &BTreeMap<u64, f64>, b: &BTreeMap<u64, f64>, steps: usize, what: &str) {
    assert_eq!(a.len(), steps, "{what}: {a:?}");
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (step, x) in a {
        let y = b[step];
        assert!(
            (x - y).abs() <= 1e-4 * x.abs().max(1e-2),
            "{what} at step {step}: {x} vs {y}"
        );
    }
}

fn u64s(b: &RecordBatch, name: &str) -> Vec<u64> {
    b.column_by_name(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .as_primitive::<UInt64Type>()
        .values()
        .to_vec()
}

/// A text column of every rollout row.
fn text_column(dir: &Path, name: &str) -> Vec<String> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b.column_by_name(name).unwrap().as_string::<i32>();
            (0..b.num_rows())
                .map(|i| c.value(i).to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every rollout row's reward.
fn reward_column(dir: &Path) -> Vec<f64> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b
                .column_by_name(col::REWARD)
                .unwrap()
                .as_primitive::<Float32Type>();
            c.values().iter().map(|v| f64::from(*v)).collect::<Vec<_>>()
        })
        .collect()
}

/// Every rollout row's response, answer and reward.
fn scored_rows(dir: &Path) -> Vec<(String, String, f64)> {
    let rewards = read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b.column_by_name(col::REWARD).unwrap();
            let c = c.as_primitive::<Float32Type>();
            c.values().iter().map(|v| f64::from(*v)).collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    let (responses, answers) = (text_column(dir, col::RESPONSE), text_column(dir, "answer"));
    responses
        .into_iter()
        .zip(answers)
        .zip(rewards)
        .map(|((r, a), w)| (r, a, w))
        .collect()
}

/// Metric values of `stage`/`metric` by step.
fn metric(dir: &Path, stage: &str, name: &str) -> BTreeMap<u64, f64> {
    let mut out = BTreeMap::new();
    for b in read_parquet_file(&dir.join("metrics.parquet")).unwrap() {
        for r in weir::graph::metrics::batch_to_rows(&b).unwrap() {
            if r.stage == stage && r.metric == name {
                out.insert(r.step, r.value);
            }
        }
    }
    out
}

#[test]
fn every_rl_pipeline_runs_logs_and_checkpoints() {
    for kind in [
        PipelineKind::Grpo,
        PipelineKind::DrGrpo,
        PipelineKind::Rloo,
        PipelineKind::Opo,
        PipelineKind::GrpoPassk,
        PipelineKind::Gpg,
        PipelineKind::Otb,
        PipelineKind::ReinforcePp,
        PipelineKind::ReinforcePpBaseline,
        PipelineKind::Remax,
        PipelineKind::Ppo,
        PipelineKind::Distill,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let steps = 2;
        let mut cfg = config(kind, steps);
        match kind {
            PipelineKind::Ppo => {
                cfg.data.samples_per_prompt = 2;
                // The reference beside the generator; the critic on the train worker.
                cfg.placement.reference = ReferencePlacement::Rollout;
            }
            // Off-policy rows weighted by truncated importance ratios;
            // activations recomputed in the backward pass.
            PipelineKind::Grpo => {
                cfg.algorithm.correction = CorrectionChoice::Tis;
                cfg.algorithm.gradient_checkpointing = true;
            }
            // DAPO's filter and the solve-rate curriculum.
            PipelineKind::DrGrpo => {
                cfg.dynamic_sampling.enabled = true;
                cfg.curriculum.enabled = true;
                cfg.curriculum.min_samples = 1;
                cfg.generate.temperature = 1.5;
                // Enough groups that every step keeps some whose rewards differ.
                cfg.data.prompts_per_step = 8;
            }
            // Rewards from a reward model (same tokenizer as the actor).
            PipelineKind::Rloo => {
                cfg.reward.kind = RewardKind::Model;
                cfg.model.reward_model = Some(fixture("tiny-llama-rm"));
            }
            // DAPO's overlong punishment on the rewards.
            PipelineKind::Opo => {
                cfg.reward.overlong_buffer = 4;
                cfg.reward.overlong_penalty_factor = 2.0;
            }
            // The teacher beside the generator, the reference on the train worker.
            PipelineKind::Distill => {
                cfg.placement.teacher = TeacherPlacement::At(ReferencePlacement::Rollout);
            }
            // Every role colocated on one worker.
            PipelineKind::ReinforcePp => {
                cfg.placement.workers = 1;
                cfg.placement.rollout = vec![0];
                cfg.placement.train = vec![0];
            }
            _ => {}
        }
        let summary = run(kind, cfg.clone(), &dir, false);
        let name = kind.name();
        assert_eq!(summary["pipeline"], name);
        assert!(summary["max_staleness_observed"].as_u64().unwrap() <= cfg.run.max_staleness);

        // Finite losses, one per step.
        let losses = metric(&dir, "learn", "loss");
        assert_eq!(losses.len(), steps as usize, "{name}");
        assert!(losses.values().all(|l| l.is_finite()), "{name}: {losses:?}");
        if kind == PipelineKind::Grpo {
            let w = metric(&dir, "learn", "is_weight_mean");
            assert_eq!(w.len(), steps as usize);
            assert!(w.values().all(|x| *x > 0.0 && *x <= 2.0), "{w:?}");
        }
        if cfg.reward.overlong_buffer > 0 {
            // 6-token responses past a 2-token allowance lose up to 2 reward.
            let p = metric(&dir, "overlong", "overlong_penalty");
            assert_eq!(p.len(), steps as usize, "{name}");
            assert!(p.values().all(|x| (-2.0..=0.0).contains(x)), "{p:?}");
            assert!(p.values().any(|x| *x < 0.0), "{p:?}");
        }
        // The first update starts on-policy: nothing is clipped.
        assert_eq!(metric(&dir, "learn", "clip_fraction")[&0], 0.0, "{name}");

        // Every rollout row is logged with the learner's columns, and read back.
        let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        let per_step = cfg.data.prompts_per_step * cfg.data.samples_per_prompt;
        if cfg.dynamic_sampling.enabled {
            // Only groups whose rewards differ reach the learner.
            let kept = metric(&dir, "dynamic_sampling", "groups_emitted");
            let sent: f64 = kept.values().sum();
            assert_eq!(
                rows as f64,
                sent * cfg.data.samples_per_prompt as f64,
                "{name}"
            );
            assert!(
                !metric(&dir, "prompt_stats", "solve_rate").is_empty(),
                "{name}"
            );
        } else {
            assert_eq!(rows, steps as usize * per_step, "{name}");
        }
        if cfg.reward.kind == RewardKind::Model {
            let rewards = metric(&dir, "learn", "reward");
            assert!(
                rewards.values().all(|r| r.is_finite() && *r != 0.0),
                "{name}: {rewards:?}"
            );
        }
        for b in &batches {
            check(b, Phase::Learn, name).unwrap();
            for (pv, lv) in u64s(b, col::POLICY_VERSION)
                .iter()
                .zip(u64s(b, col::LEARNER_VERSION))
            {
                assert!(lv - pv <= cfg.run.max_staleness, "{name}");
            }
            // At version 0 the reference is the behaviour policy: log-prob ratio 1.
            if cfg.algorithm.kl_coef > 0.0 {
                let refs = b
                    .column_by_name(col::REF_LOGPROBS)
                    .unwrap()
                    .as_list::<i32>();
                let beh = b
                    .column_by_name(col::BEHAVIOR_LOGPROBS)
                    .unwrap()
                    .as_list::<i32>();
                for (i, pv) in u64s(b, col::POLICY_VERSION).iter().enumerate() {
                    if *pv == 0 {
                        let (r, h) = (refs.value(i), beh.value(i));
                        let (r, h) = (
                            r.as_primitive::<Float32Type>(),
                            h.as_primitive::<Float32Type>(),
                        );
                        for (x, y) in r.values().iter().zip(h.values()) {
                            assert!(
                                (x - y).abs() < 1e-4,
                                "{name}: reference {x} vs behaviour {y}"
                            );
                        }
                    }
                }
            }
        }

        // The advantages are the pipeline's own estimator's: recomputed from
        // each step's logged inputs (an estimator wired to the wrong
        // pipeline would run as well as the right one).
        check_advantages(kind, &cfg, &batches);

        // The final checkpoint: HF layout plus optimizer state, and the run state.
        let last = dir.join(format!("checkpoints/step-{}", steps - 1));
        for file in [
            "actor/config.json",
            "actor/model.safetensors",
            "actor/tokenizer.json",
            "actor/optimizer.safetensors",
            "state.json",
        ] {
            assert!(last.join(file).is_file(), "{name}: {file}");
        }
        if kind == PipelineKind::Ppo {
            assert!(last.join("critic/model.safetensors").is_file());
            assert!(metric(&dir, "critic_learn", "value_loss")
                .values()
                .all(|v| v.is_finite()));
        }
        let (back, resolved) = read_resolved(&dir).unwrap();
        assert_eq!((back, resolved), (kind, cfg));
    }
}

/// A float list column of `b` as rows of f64.
fn float_rows(b: &RecordBatch, name: &str) -> Vec<Vec<f64>> {
    let list = b.column_by_name(name).unwrap().as_list::<i32>();
    (0..b.num_rows())
        .map(|i| {
            let row = list.value(i);
            let row = row.as_primitive::<Float32Type>();
            row.values().iter().map(|x| f64::from(*x)).collect()
        })
        .collect()
}

/// A step's logged rows, in the log's order: what the advantage stage read
/// and what it wrote.
#[derive(Default)]
struct StepRows {
    rewards: Vec<f64>,
    groups: Vec<u64>,
    behaviour: Vec<Vec<f64>>,
    sum_pi_squared: Vec<Vec<f64>>,
    reference: Vec<Vec<f64>>,
    values: Vec<Vec<f64>>,
    baselines: Vec<f64>,
    token_rewards: Vec<Vec<f64>>,
    returns: Vec<Vec<f64>>,
    advantages: Vec<Vec<f64>>,
}

/// Each step's logged rows.
fn step_rows(
    cfg: &RunConfig,
    kind: PipelineKind,
    batches: &[RecordBatch],
) -> BTreeMap<u64, StepRows> {
    let token_level = !kind.is_group();
    let mut steps: BTreeMap<u64, StepRows> = BTreeMap::new();
    for b in batches {
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        let optional = |name: &str, on: bool| on.then(|| float_rows(b, name));
        let otb = kind == PipelineKind::Otb;
        let behaviour = optional(col::BEHAVIOR_LOGPROBS, token_level || otb);
        let squares = optional(col::SUM_PI_SQUARED, otb);
        let reference = optional(
            col::REF_LOGPROBS,
            token_level && cfg.algorithm.kl_coef > 0.0,
        );
        let values = optional(col::VALUES, kind == PipelineKind::Ppo);
        let token_rewards = optional(col::TOKEN_REWARDS, token_level);
        let returns = optional(col::RETURNS, token_level);
        let advantages = float_rows(b, col::ADVANTAGES);
        let baselines = (kind == PipelineKind::Remax).then(|| {
            let c = b.column_by_name("reward_baseline").unwrap();
            c.as_primitive::<Float32Type>().values().to_vec()
        });
        for (i, (step, group)) in u64s(b, col::STEP)
            .into_iter()
            .zip(u64s(b, col::GROUP_ID))
            .enumerate()
        {
            let rows = steps.entry(step).or_default();
            rows.rewards.push(f64::from(rewards.value(i)));
            rows.groups.push(group);
            rows.advantages.push(advantages[i].clone());
            let take = |from: &Option<Vec<Vec<f64>>>, to: &mut Vec<Vec<f64>>| {
                if let Some(from) = from {
                    to.push(from[i].clone());
                }
            };
            take(&behaviour, &mut rows.behaviour);
            take(&squares, &mut rows.sum_pi_squared);
            take(&reference, &mut rows.reference);
            take(&values, &mut rows.values);
            take(&token_rewards, &mut rows.token_rewards);
            take(&returns, &mut rows.returns);
            if let Some(b) = &baselines {
                rows.baselines.push(f64::from(b[i]));
            }
        }
    }
    steps
}

/// Recomputes every logged row's advantages from the step's logged inputs
/// with the pipeline's own estimator (functions held to verl's and
/// OpenRLHF's outputs by the operators' tests) and compares. Group
/// pipelines: each row's tokens carry the response's advantage, from the
/// step's rewards, groups and lengths. Token-level pipelines: the token
/// rewards (the score on the last token minus β·KL(behaviour ‖ reference)),
/// then the returns and advantages — REINFORCE++'s discounted, whitened
/// returns (after the group mean with the baseline), ReMax's returns minus
/// the greedy baseline, PPO's GAE on the logged values, whitened. A
/// pipeline wired to another's estimator would run as well as its own.
fn check_advantages(kind: PipelineKind, cfg: &RunConfig, batches: &[RecordBatch]) {
    use weir::operators::algorithms::{self as alg, Flavor};
    let name = kind.name();
    let flavor = cfg.algorithm.flavor;
    if kind == PipelineKind::Distill {
        // The teacher's log-prob less the student's, token by token (no task advantage).
        assert_eq!(
            cfg.algorithm.distill_task,
            weir::pipelines::config::DistillTask::None
        );
        for b in batches {
            let (a, s, t) = (
                float_rows(b, col::ADVANTAGES),
                float_rows(b, col::BEHAVIOR_LOGPROBS),
                float_rows(b, col::TEACHER_LOGPROBS),
            );
            for ((a, s), t) in a.iter().zip(&s).zip(&t) {
                assert_eq!(a.len(), s.len());
                for ((a, s), t) in a.iter().zip(s).zip(t) {
                    let want = cfg.algorithm.distill_coef * (t - s);
                    assert!(
                        (a - want).abs() <= 1e-5,
                        "distill: advantage {a}, want {want}"
                    );
                }
            }
        }
        return;
    }
    let close = |what: &str, step: u64, got: &[Vec<f64>], want: &[Vec<f64>]| {
        assert_eq!(got.len(), want.len(), "{name}: step {step}: {what} rows");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.len(),
                w.len(),
                "{name}: step {step} row {i}: {what} length"
            );
            for (t, (g, w)) in g.iter().zip(w).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                    "{name}: step {step} row {i} token {t}: {what} {g}, the estimator gives {w}"
                );
            }
        }
    };
    for (step, rows) in step_rows(cfg, kind, batches) {
        let lengths: Vec<usize> = rows.advantages.iter().map(Vec::len).collect();
        let per_token = |per_row: Vec<f64>| -> Vec<Vec<f64>> {
            per_row
                .iter()
                .zip(&lengths)
                .map(|(a, n)| vec![*a; *n])
                .collect()
        };
        let (rewards, groups) = (&rows.rewards, &rows.groups);
        let group = match kind {
            PipelineKind::Grpo => Some(alg::grpo(rewards, groups, true, flavor)),
            PipelineKind::DrGrpo => Some(alg::grpo(rewards, groups, false, flavor)),
            PipelineKind::Rloo => Some(alg::rloo(rewards, groups, flavor)),
            PipelineKind::Opo => Some(alg::opo(rewards, &lengths, groups)),
            PipelineKind::GrpoPassk => Some(alg::grpo_passk(rewards, groups, true)),
            PipelineKind::Gpg => Some(alg::gpg(rewards, groups)),
            // Per token: a baseline per position from the sampler's Σ π².
            PipelineKind::Otb => {
                let masks: Vec<Vec<f64>> = lengths.iter().map(|&n| vec![1.0; n]).collect();
                let want = alg::optimal_token_baseline(
                    rewards,
                    &rows.behaviour,
                    &rows.sum_pi_squared,
                    &masks,
                    groups,
                )
                .unwrap();
                close("advantage", step, &rows.advantages, &want);
                continue;
            }
            PipelineKind::Ppo
            | PipelineKind::ReinforcePp
            | PipelineKind::ReinforcePpBaseline
            | PipelineKind::Remax => None,
            // Held to its formula above.
            PipelineKind::Distill => return,
            PipelineKind::Sft | PipelineKind::Rm | PipelineKind::Dpo => return,
        };
        if let Some(expected) = group {
            close(
                "advantage",
                step,
                &rows.advantages,
                &per_token(expected.unwrap()),
            );
            continue;
        }
        // The in-reward KL's coefficient is fixed here (no controller).
        assert_eq!(cfg.algorithm.kl_target, 0.0, "{name}");
        let kl_coef = cfg.algorithm.kl_coef;
        let mask: Vec<Vec<f64>> = lengths.iter().map(|n| vec![1.0; *n]).collect();
        let kl = if kl_coef > 0.0 {
            alg::kl_tokens(
                &rows.behaviour,
                &rows.reference,
                cfg.algorithm.kl_estimator,
                flavor,
            )
        } else {
            mask.iter().map(|m| vec![0.0; m.len()]).collect()
        };
        let scores = match kind {
            PipelineKind::ReinforcePpBaseline => {
                assert_eq!(
                    flavor,
                    Flavor::OpenRlhf,
                    "{name}: verl centres the whole return"
                );
                alg::grpo(rewards, groups, false, flavor).unwrap()
            }
            _ => rewards.clone(),
        };
        // OpenRLHF clips the score to ±10; verl, and ReMax, clip nothing.
        let clip = (flavor.clips_scores() && kind != PipelineKind::Remax).then_some((-10.0, 10.0));
        let token_rewards = alg::token_rewards(&scores, &kl, &mask, kl_coef, clip);
        close("token reward", step, &rows.token_rewards, &token_rewards);
        let a = &cfg.algorithm;
        let (advantages, returns) = match kind {
            PipelineKind::Remax => alg::remax(&token_rewards, &mask, &rows.baselines),
            PipelineKind::Ppo => {
                let (advantages, returns) = alg::gae(
                    &token_rewards,
                    &rows.values,
                    &mask,
                    a.gamma,
                    a.lambda,
                    flavor,
                );
                (
                    alg::whiten_advantages(&advantages, &mask, false, flavor),
                    returns,
                )
            }
            _ => {
                let returns = alg::discounted_returns(&token_rewards, &mask, a.gamma, flavor);
                (
                    alg::whiten_advantages(&returns, &mask, false, flavor),
                    returns,
                )
            }
        };
        close("return", step, &rows.returns, &returns);
        close("advantage", step, &rows.advantages, &advantages);
    }
}

/// Writes arithmetic chat prompts as JSONL: for each pair `(a, b)`, the
/// `messages` asking for `a + b` and the `answer`, with `more(i)`'s fields.
fn write_arith_task(path: &Path, pairs: &[(u32, u32)], more: impl Fn(usize) -> serde_json::Value) {
    use weir::operators::tasks::arith;
    let lines: Vec<String> = pairs
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| {
            let mut record = serde_json::json!({
                "messages": [{"role": "user", "content": arith::user_message(a, b)}],
                "answer": (a + b).to_string(),
            });
            if let serde_json::Value::Object(fields) = more(i) {
                record.as_object_mut().unwrap().extend(fields);
            }
            record.to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

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
fn remax_subtracts_the_reward_of_each_prompts_greedy_response() {
    use weir::operators::tasks::arith;
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Remax;
    let mut cfg = config(kind, 2);
    cfg.run.max_staleness = 0;
    cfg.algorithm.kl_coef = 0.0;
    cfg.generate.temperature = 1.5;
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    // The greedy rows were scored and left: the log has the sampled ones.
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 2 * 3 * 4);
    assert!(batches
        .iter()
        .all(|b| b.column_by_name("greedy_baseline").is_none()));
    // Step 0's baseline is the reward of the starting policy's greedy answer.
    let model = weir::gpu::Model::load(
        &fixture("arith-sft"),
        weir::gpu::Device::Cpu,
        tch::Kind::Float,
    )
    .unwrap();
    let tok = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let params = weir::gpu::SamplingParams {
        max_new_tokens: cfg.generate.max_new_tokens,
        greedy: true,
        eos_token_ids: tok.eos_token_ids().to_vec(),
        ..Default::default()
    };
    let mut checked = 0;
    for b in &batches {
        let steps = u64s(b, col::STEP);
        let prompts = b
            .column_by_name(col::PROMPT_TOKENS)
            .unwrap()
            .as_list::<i32>();
        let answers = b.column_by_name("answer").unwrap().as_string::<i32>();
        let f32s = |name: &str| {
            b.column_by_name(name)
                .unwrap()
                .as_primitive::<Float32Type>()
                .values()
                .to_vec()
        };
        let (rewards, baselines) = (f32s(col::REWARD), f32s("reward_baseline"));
        let advantages = b.column_by_name(col::ADVANTAGES).unwrap().as_list::<i32>();
        for i in 0..b.num_rows() {
            // Without a KL term each token's advantage is reward − baseline.
            let a = advantages.value(i);
            let a = a.as_primitive::<Float32Type>();
            for t in 0..a.len() {
                assert!((a.value(t) - (rewards[i] - baselines[i])).abs() < 1e-6);
            }
            if steps[i] == 0 {
                let tokens: Vec<i64> = prompts
                    .value(i)
                    .as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec();
                let g = weir::gpu::generate(&model, &[tokens], &params).unwrap();
                let text = tok.decode(&g[0].tokens, true).unwrap();
                let want = arith::exact_match(&text, answers.value(i));
                assert_eq!(f64::from(baselines[i]), want, "row {i}: {text:?}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 3 * 4);
    let baseline = metric(&dir, "advantage", "reward_baseline");
    assert_eq!(baseline.len(), 2, "{baseline:?}");
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

#[test]
fn a_python_reward_file_scores_a_jsonl_task_with_its_columns() {
    use weir::operators::tasks::arith;
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("task.jsonl");
    // Pairs like the ones the SFT model learned (two-digit operands), so that some answers are right.
    let pairs: Vec<(u32, u32)> = arith::eval_pairs()[..12].to_vec();
    write_arith_task(
        &prompts,
        &pairs,
        |i| serde_json::json!({"topic": if i % 3 == 0 { "small" } else { "other" }}),
    );
    let file = tmp.path().join("my_reward.py");
    std::fs::write(
        &file,
        "def reward_func(queries, prompts, labels, topic, **rest):\n    \
         cut = [q[len(p):].split('<|im_end|>')[0].strip() for q, p in zip(queries, prompts)]\n    \
         return {'rewards': [2.0 * (c == l) for c, l in zip(cut, labels)],\n            \
         'extra_logs': {'small_topic': [float(t == 'small') for t in topic]}}\n",
    )
    .unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.data.prompts = weir::pipelines::config::Task::File(prompts.to_path_buf());
    cfg.data.messages_column = Some("messages".into());
    cfg.reward.kind = weir::pipelines::config::RewardKind::Python;
    cfg.reward.file = Some(file.to_path_buf());
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    // Every row's reward is what the file computes from its own response and label.
    let rows = scored_rows(&dir);
    for (i, (response, answer, reward)) in rows.iter().enumerate() {
        assert_eq!(
            *reward,
            2.0 * arith::exact_match(response, answer),
            "row {i}"
        );
    }
    assert!(text_column(&dir, "topic")
        .iter()
        .all(|t| ["small", "other"].contains(&t.as_str())));
    assert_eq!(rows.len(), 2 * 3 * 4);
    // A reward that scored nothing would pass the check above on a model
    // that answers nothing right: the SFT model answers most of them.
    assert!(rows.iter().any(|r| r.2 == 2.0), "no row scored: {rows:?}");
    // The extra figure is the mean of the step's rows' flags.
    let small = metric(&dir, "reward", "small_topic");
    let flags = step_means(&dir, |b, i| {
        f64::from(u8::from(
            b.column_by_name("topic")
                .unwrap()
                .as_string::<i32>()
                .value(i)
                == "small",
        ))
    });
    assert_eq!(small.len(), 2, "{small:?}");
    for (step, mean) in &flags {
        assert!(
            (small[step] - mean).abs() < 1e-6,
            "step {step}: {small:?} vs {flags:?}"
        );
    }
}

/// Per step, the mean over the rollout rows of `value(batch, row)`.
fn step_means(dir: &Path, value: impl Fn(&RecordBatch, usize) -> f64) -> BTreeMap<u64, f64> {
    let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        for (i, step) in u64s(&b, col::STEP).into_iter().enumerate() {
            let s = sums.entry(step).or_default();
            s.0 += value(&b, i);
            s.1 += 1.0;
        }
    }
    sums.into_iter().map(|(k, (sum, n))| (k, sum / n)).collect()
}

#[test]
fn a_remote_reward_server_scores_every_row_through_a_run() {
    // The server (see `support::reward_server`) scores a query, prompt +
    // response, by its length / 1000, and refuses every first copy of a
    // request with 503, so the run also retries.
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.reward.kind = RewardKind::Remote;
    cfg.reward.url = Some(format!("{}/value-check", reward_server()));
    cfg.reward.attempts = 3;
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    let (prompts, responses) = (
        text_column(&dir, col::PROMPT),
        text_column(&dir, col::RESPONSE),
    );
    let rewards = reward_column(&dir);
    assert_eq!(rewards.len(), 2 * 3 * 4);
    for ((p, r), reward) in prompts.iter().zip(&responses).zip(&rewards) {
        let want = (p.len() + r.len()) as f64 * 1e-3;
        assert!(
            (reward - want).abs() < 1e-6,
            "{p:?} + {r:?}: {reward} vs {want}"
        );
    }
}

#[test]
fn a_verl_dataset_in_parquet_and_its_compute_score_load_unchanged() {
    use weir::operators::tasks::arith;
    let tmp = tempfile::tempdir().unwrap();
    // verl's layout: chat `prompt`, the answer in `reward_model.ground_truth`,
    // an `extra_info` object; written to Parquet with struct columns.
    let lines: Vec<String> = (0..8u32)
        .map(|i| {
            serde_json::json!({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": arith::user_message(i, 3)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": (i + 3).to_string()},
                "extra_info": {"split": "train", "index": i},
            })
            .to_string()
        })
        .collect();
    let text = lines.join("\n");
    let mut cursor = std::io::Cursor::new(text.as_bytes());
    let (schema, _) =
        arrow::json::reader::infer_json_schema_from_seekable(&mut cursor, None).unwrap();
    let batches: Vec<RecordBatch> = arrow::json::ReaderBuilder::new(std::sync::Arc::new(schema))
        .build(std::io::Cursor::new(text.as_bytes()))
        .unwrap()
        .map(|b| b.unwrap())
        .collect();
    let prompts = tmp.path().join("train.parquet");
    weir::graph::parquet_log::write_parquet_atomically(&prompts, &batches).unwrap();
    let file = tmp.path().join("gsm8k.py");
    std::fs::write(
        &file,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
         assert data_source == 'openai/gsm8k', data_source\n    \
         assert extra_info['split'] == 'train' and isinstance(extra_info['index'], int), extra_info\n    \
         return {'score': float(solution_str.strip() == ground_truth), 'index': float(extra_info['index'])}\n",
    )
    .unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.data.prompts = weir::pipelines::config::Task::File(prompts.to_path_buf());
    cfg.data.messages_column = Some("prompt".into());
    cfg.data.label_column = Some("reward_model.ground_truth".into());
    cfg.reward.kind = weir::pipelines::config::RewardKind::Python;
    cfg.reward.file = Some(file.to_path_buf());
    cfg.reward.function = "compute_score".into();
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    let (responses, answers) = (
        text_column(&dir, col::RESPONSE),
        text_column(&dir, "reward_model.ground_truth"),
    );
    let rewards = reward_column(&dir);
    assert_eq!(rewards.len(), 2 * 3 * 4);
    for ((r, a), reward) in responses.iter().zip(&answers).zip(&rewards) {
        assert_eq!(*reward, arith::exact_match(r, a), "{r:?} {a}");
    }
    assert!(rewards.contains(&1.0), "no row scored: {rewards:?}");
    // The extra figure is the mean of the step's rows' `index`, their
    // line in the file.
    let index = metric(&dir, "reward", "index");
    let lines = step_means(&dir, |b, i| u64s(b, col::PROMPT_ID)[i] as f64);
    assert_eq!(index.len(), 2, "{index:?}");
    for (step, mean) in &lines {
        assert!(
            (index[step] - mean).abs() < 1e-6,
            "step {step}: {index:?} vs {lines:?}"
        );
    }
}

#[test]
fn weighted_reward_terms_combine_python_math_and_regex() {
    use weir::operators::rewards::rules;
    use weir::operators::tasks::arith;
    use weir::pipelines::config::{RewardKind, RewardTerm};
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("task.jsonl");
    let pairs: Vec<(u32, u32)> = (0..9).map(|i| (i, i + 1)).collect();
    write_arith_task(&prompts, &pairs, |_| serde_json::json!({}));
    let file = tmp.path().join("exact.py");
    std::fs::write(
        &file,
        "def reward_func(queries, prompts, labels, **columns):\n    \
         return [float(q[len(p):].split('<|im_end|>')[0].strip() == l) for q, p, l in zip(queries, prompts, labels)]\n",
    )
    .unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.data.prompts = weir::pipelines::config::Task::File(prompts.to_path_buf());
    cfg.data.messages_column = Some("messages".into());
    cfg.reward.kind = RewardKind::Terms;
    cfg.reward.terms = vec![
        RewardTerm {
            file: Some(file.to_path_buf()),
            weight: 0.5,
            ..Default::default()
        },
        RewardTerm {
            rule: Some("math".into()),
            ..Default::default()
        },
        RewardTerm {
            rule: Some("regex".into()),
            name: Some("digits".into()),
            pattern: r"\d+".into(),
            weight: 0.25,
            ..Default::default()
        },
    ];
    // Evaluation every step, on the task's own prompts, with the same reward.
    cfg.eval.prompts = Some(prompts.to_path_buf());
    cfg.eval.every = 1;
    // The resolved config, with its [[reward.terms]], reads back the same.
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    assert_eq!(read_resolved(&dir).unwrap().1, cfg);
    let digits = rules::full_match(r"\d+").unwrap();
    let rows = scored_rows(&dir);
    for (r, a, reward) in &rows {
        let want = 0.5 * arith::exact_match(r, a)
            + rules::math(r, a)
            + 0.25 * rules::regex_match(&digits, r);
        assert!((reward - want).abs() < 1e-6, "{r:?} {a}");
    }
    assert_eq!(rows.len(), 2 * 3 * 4);
    for term in ["reward_reward_func", "reward_math", "reward_digits"] {
        assert_eq!(metric(&dir, "reward", term).len(), 2, "{term}");
    }
    // The evaluations: before each step's rollouts, and of the final policy.
    let evals = metric(&dir, "eval", "reward");
    assert_eq!(evals.keys().collect::<Vec<_>>(), vec![&0, &1, &2]);
    assert!(
        evals.values().all(|r| (0.0..=1.75).contains(r)),
        "{evals:?}"
    );
    assert_eq!(metric(&dir, "eval", "prompts")[&1], 9.0);
    // TensorBoard: the training's event file and the final evaluation's,
    // each step's metrics as the workers' mean.
    let mut scalars = Vec::new();
    for e in std::fs::read_dir(dir.join("tensorboard")).unwrap() {
        scalars.extend(weir::graph::tensorboard::read_scalars(&e.unwrap().path()).unwrap());
    }
    for (stage, name) in [
        ("learn", "loss"),
        ("reward", "reward_math"),
        ("learn", "reward"),
        ("eval", "reward"),
    ] {
        let tag = format!("{stage}/{name}");
        let got: BTreeMap<u64, f64> = scalars
            .iter()
            .filter(|(_, t, _)| *t == tag)
            .map(|(s, _, v)| (*s, *v))
            .collect();
        let want = metric(&dir, stage, name);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{tag}"
        );
        for (step, v) in &want {
            assert!(
                (got[step] - v).abs() <= 1e-6 * v.abs().max(1.0),
                "{tag} {step}"
            );
        }
    }
    // A bad term is named.
    let mut bad = cfg.clone();
    bad.reward.terms[2].pattern = "(unclosed".into();
    let err = run_err(kind, bad, &tmp.path().join("bad"));
    assert!(err.contains("reward.terms[2].pattern"), "{err}");
}

#[test]
fn a_reward_registered_in_rust_scores_by_its_name() {
    use weir::operators::rewards::{register, rules, Reward, RewardRows, Scores};
    struct Longer;
    impl Reward for Longer {
        fn score(&mut self, rows: &RewardRows<'_>) -> Result<Scores, weir::graph::StageError> {
            let labels = rows.labels.expect("arith rows have answers");
            let rewards = rows
                .responses
                .iter()
                .zip(labels)
                .map(|(r, l)| rules::exact(r, l) + rules::completion(r).len() as f64 / 100.0)
                .collect();
            Ok(Scores {
                rewards,
                metrics: vec![("rows".into(), rows.batch.num_rows() as f64)],
            })
        }
    }
    register("test_longer", || Ok(Box::new(Longer)));
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.reward.rule = "test_longer".into();
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    for (r, a, reward) in scored_rows(&dir) {
        let want = rules::exact(&r, &a) + rules::completion(&r).len() as f64 / 100.0;
        assert!((reward - want).abs() < 1e-6);
    }
    assert_eq!(metric(&dir, "reward", "reward_test_longer_rows").len(), 2);
    // An unknown name lists the built-ins and the registered ones.
    cfg.reward.rule = "test_shorter".into();
    let err = run_err(kind, cfg, &tmp.path().join("bad"));
    assert!(
        err.contains("reward.rule") && err.contains("test_longer"),
        "{err}"
    );
}

#[test]
fn held_out_prompts_evaluate_the_policy_during_training_and_mark_the_best_checkpoint() {
    use weir::operators::tasks::arith;
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, pairs: &[(u32, u32)]| -> PathBuf {
        let path = tmp.path().join(name);
        write_arith_task(&path, pairs, |_| serde_json::json!({}));
        path
    };
    let train: Vec<(u32, u32)> = (0..12).map(|i| (i, 2 * i + 1)).collect();
    // 21 prompts: the two rollout workers evaluate 11 and 10 of them.
    let held: Vec<(u32, u32)> = (0..21).map(|i| (3 * i + 1, i + 2)).collect();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 4);
    cfg.run.max_staleness = 0;
    cfg.run.checkpoint_every = 2;
    cfg.placement.workers = 3;
    cfg.placement.rollout = vec![0, 1];
    cfg.placement.train = vec![2];
    cfg.algorithm.lr = 1e-4;
    cfg.data.prompts = weir::pipelines::config::Task::File(write("train.jsonl", &train));
    cfg.data.messages_column = Some("messages".into());
    cfg.eval.prompts = Some(write("held.jsonl", &held));
    cfg.eval.k = 4;
    cfg.eval.every = 2;
    cfg.eval.best_checkpoint = true;
    // Training rows run past the end tokens; evaluations still stop at them
    // (the accuracies below are greedy answers cut at the end token).
    cfg.generate.ignore_eos = true;
    let dir = tmp.path().join("run");
    let summary = run(kind, cfg.clone(), &dir, false);
    let reasons = text_column(&dir, "finish_reason");
    assert_eq!(reasons.len(), 4 * 3 * 4);
    assert!(reasons.iter().all(|r| r == "length"), "{reasons:?}");
    // Each evaluation is the greedy accuracy, on those pairs, of the policy
    // the generators held: the start at step 0, the checkpoint of version 2
    // (after step 1) at step 2, and the final policy (version 4) after the run.
    let tok = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let accuracy = |actor: &Path| {
        let model =
            weir::gpu::Model::load(actor, weir::gpu::Device::Cpu, tch::Kind::Float).unwrap();
        arith::greedy_accuracy(&model, &tok, &held, 7).unwrap().0
    };
    let want: BTreeMap<u64, f64> = [
        (0, accuracy(&fixture("arith-sft"))),
        (2, accuracy(&dir.join("checkpoints/step-1/actor"))),
        (4, accuracy(&dir.join("checkpoints/step-3/actor"))),
    ]
    .into();
    let points = weir::pipelines::eval::points(&metric_rows(&dir));
    assert_eq!(
        points.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (step, p) in &points {
        assert_eq!(p.prompts, 21, "step {step}");
        assert_eq!(p.policy_version, *step, "step {step}");
        assert!(
            (p.reward - want[step]).abs() < 1e-9,
            "step {step}: {p:?} vs {}",
            want[step]
        );
        let (mean, pass) = (p.mean_at_k.unwrap(), p.pass_at_k.unwrap());
        assert!((0.0..=1.0).contains(&mean) && pass >= mean - 1e-12, "{p:?}");
    }
    // During training both rollout workers evaluated their share.
    let shares: Vec<f64> = metric_rows(&dir)
        .iter()
        .filter(|r| r.stage == "eval" && r.metric == "prompts" && r.step == 2)
        .map(|r| r.value)
        .collect();
    assert_eq!(shares.len(), 2, "{shares:?}");
    assert_eq!(shares.iter().sum::<f64>(), 21.0);
    assert_eq!(summary["eval_prompts"], 21);
    assert!((summary["eval_reward"].as_f64().unwrap() - want[&4]).abs() < 1e-9);
    assert_eq!(
        summary["eval_history"].as_array().unwrap().len(),
        3,
        "{summary}"
    );
    // The best evaluated policy with a checkpoint is marked (the earliest of equals).
    let best_step = if want[&4] > want[&2] { 3 } else { 1 };
    let best = std::fs::read_link(dir.join("checkpoints/best")).unwrap();
    assert_eq!(best, PathBuf::from(format!("step-{best_step}")));
    assert!(dir.join("checkpoints/best/actor/config.json").is_file());
    let note: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("checkpoints/best.json")).unwrap())
            .unwrap();
    assert_eq!(note["policy_version"], best_step + 1);
    assert_eq!(summary["best_checkpoint"]["eval_step"], best_step + 1);
    // TensorBoard holds each evaluation as one figure (the workers weighted).
    let mut scalars = Vec::new();
    for e in std::fs::read_dir(dir.join("tensorboard")).unwrap() {
        scalars.extend(weir::graph::tensorboard::read_scalars(&e.unwrap().path()).unwrap());
    }
    let board: BTreeMap<u64, f64> = scalars
        .iter()
        .filter(|(_, tag, _)| tag == "eval/reward")
        .map(|(s, _, v)| (*s, *v))
        .collect();
    assert_eq!(
        board.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (step, v) in &board {
        assert!((v - want[step]).abs() < 1e-6, "tensorboard step {step}");
    }
    // `weir inspect` shows the evaluation; `weir plot` draws it.
    let text = weir::report::inspect(&dir).unwrap();
    assert!(
        text.contains("eval/reward") && text.contains("eval/pass_at_k"),
        "{text}"
    );
    let charts = weir::report::plot(&dir).unwrap();
    assert!(
        charts.iter().any(|c| c.ends_with("eval_reward.png")),
        "{charts:?}"
    );
    // Evaluated policies must be saved for the best to be marked.
    let mut bad = cfg.clone();
    bad.eval.every = 3;
    let err = run_err(kind, bad, &tmp.path().join("bad"));
    assert!(
        err.contains("eval.best_checkpoint") && err.contains("checkpoint_every"),
        "{err}"
    );
}

/// Every metric row of a run.
fn metric_rows(dir: &Path) -> Vec<weir::graph::metrics::MetricRow> {
    read_parquet_file(&dir.join("metrics.parquet"))
        .unwrap()
        .iter()
        .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
        .collect()
}

/// bf16 training (bf16 compute, float32 master weights and moments)
/// follows the float32 run's loss: SFT on tiny-llama, 8 steps, within 2 %
/// of the float32 loss at every step; the checkpoint keeps the masters.
#[test]
fn a_bf16_run_follows_the_float32_run() {
    let tmp = tempfile::tempdir().unwrap();
    let losses = |dtype: weir::pipelines::config::Dtype, name: &str| {
        let dir = tmp.path().join(name);
        let mut cfg = config(PipelineKind::Sft, 8);
        cfg.model.path = fixture("tiny-llama");
        cfg.model.dtype = dtype;
        cfg.data.prompts_per_step = 16;
        cfg.algorithm.warmup_steps = 0;
        cfg.algorithm.lr = 1e-3;
        run(PipelineKind::Sft, cfg, &dir, false);
        (metric(&dir, "sft", "loss"), dir)
    };
    let (f32_loss, _) = losses(weir::pipelines::config::Dtype::F32, "f32");
    let (bf16_loss, dir) = losses(weir::pipelines::config::Dtype::Bf16, "bf16");
    assert_eq!(f32_loss.len(), 8);
    assert!(f32_loss[&7] < f32_loss[&0] - 0.3, "{f32_loss:?}");
    let worst = f32_loss
        .iter()
        .map(|(s, l)| (bf16_loss[s] - l).abs() / l)
        .fold(0.0f64, f64::max);
    eprintln!("bf16 vs float32 SFT loss: largest relative gap {worst:.4}");
    assert!(worst < 0.02, "bf16 {bf16_loss:?} vs float32 {f32_loss:?}");
    let state = dir.join("checkpoints/step-7/actor/optimizer.safetensors");
    let (tensors, _) =
        weir::gpu::snapshot::from_safetensors(&std::fs::read(&state).unwrap()).unwrap();
    assert!(tensors
        .iter()
        .any(|(n, t)| n.starts_with("master.") && t.kind() == tch::Kind::Float));
}

/// GRPO with LoRA adapters on the actor: only the adapters train (the
/// base weights in every checkpoint are the starting ones, untouched); the
/// weights edge carries the adapters alone; checkpoints are PEFT folders; a
/// run resumed from one follows the straight run; `weir merge` turns the
/// final adapters into a plain checkpoint that computes the same.
#[test]
fn a_lora_grpo_run_trains_adapters_resumes_and_merges() {
    let kind = PipelineKind::Grpo;
    let tmp = tempfile::tempdir().unwrap();
    let lora = |steps| {
        let mut c = config(kind, steps);
        c.lora.rank = 8;
        c.lora.alpha = 16.0;
        c.algorithm.lr = 1e-3;
        c.algorithm.kl_coef = 0.05;
        c.run.checkpoint_every = 2;
        // Synchronous: the same seed gives the same rows, so the resumed
        // run's curves can be held to the straight run's.
        c.run.max_staleness = 0;
        c
    };
    let straight = tmp.path().join("straight");
    run(kind, lora(4), &straight, false);
    let actor = straight.join("checkpoints/step-3/actor");
    assert!(actor.join("adapter_config.json").is_file());
    assert!(!actor.join("model.safetensors").exists());
    let (state, _) = weir::gpu::snapshot::from_safetensors(
        &std::fs::read(actor.join("optimizer.safetensors")).unwrap(),
    )
    .unwrap();
    assert!(
        state.iter().all(|(n, _)| n.contains(".lora_")),
        "{:?}",
        state[0].0
    );
    // The edge's payload: the adapters, a small share of the weights.
    let full = std::fs::metadata(fixture("arith-sft").join("model.safetensors"))
        .unwrap()
        .len();
    let shipped = metric(&straight, "learn", "weights_bytes");
    assert_eq!(shipped.len(), 4);
    assert!(
        shipped.values().all(|&b| b > 0.0 && b < 0.2 * full as f64),
        "{shipped:?} of {full}"
    );
    // The adapters moved the policy: its log-probs differ from the base's.
    let kl = metric(&straight, "learn", "kl");
    assert!(kl[&3] > 0.0, "{kl:?}");

    // A crash after step 2: the resumed run loads the step-2 adapters and
    // optimizer and follows the straight run.
    let crashed = tmp.path().join("crashed");
    run(kind, lora(3), &crashed, false);
    std::fs::remove_dir_all(crashed.join("checkpoints/step-2")).unwrap();
    let (k, cfg) = read_resolved(&crashed).unwrap();
    let cfg = cfg.with_overrides(&["run.steps=4".into()]).unwrap();
    let summary = run(k, cfg, &crashed, true);
    assert_eq!(summary["resumed_at_step"], 2);
    for name in ["loss", "kl", "reward"] {
        let (a, b) = (
            metric(&straight, "learn", name),
            metric(&crashed, "learn", name),
        );
        assert_curves_match(&a, &b, 4, name);
    }
    // Resuming with `rank`: the run's error.
    let resume_with = |rank: &str| {
        let (k, cfg) = read_resolved(&crashed).unwrap();
        let cfg = cfg
            .with_overrides(&["run.steps=5".into(), format!("lora.rank={rank}")])
            .unwrap();
        weir::pipelines::run(&request(k, cfg, &crashed, true))
            .unwrap_err()
            .to_string()
    };
    // Resuming with other adapters is refused, naming both.
    let err = resume_with("4");
    assert!(err.contains("differ from [lora]"), "{err}");
    // So is resuming them as a full fine-tune.
    let err = resume_with("0");
    assert!(err.contains("holds LoRA adapters"), "{err}");

    // weir merge: a plain checkpoint that computes what base + adapters do.
    let merged = tmp.path().join("merged");
    let merge = || {
        weir::model_cli::merge(&weir::model_cli::MergeArgs {
            adapter: actor.clone(),
            output: merged.clone(),
            base: None,
            dtype: "f32".into(),
        })
    };
    merge().unwrap();
    assert!(merged.join("model.safetensors").is_file() && merged.join("config.json").is_file());
    let ids = tch::Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3]).view([1, 6]);
    let logits = |dir: &Path| {
        weir::gpu::Model::load(dir, weir::gpu::Device::Cpu, tch::Kind::Float)
            .unwrap()
            .logits(&ids, None, None)
            .unwrap()
    };
    let (adapted, plain, base) = (
        logits(&actor),
        logits(&merged),
        logits(&fixture("arith-sft")),
    );
    let d = (&adapted - &plain).abs().max().double_value(&[]);
    assert!(d < 1e-4, "merged logits differ by {d:e}");
    assert!((&adapted - &base).abs().max().double_value(&[]) > 1e-4);
    // Merging into a folder that holds files is refused; nothing is overwritten.
    let err = merge().unwrap_err().to_string();
    assert!(err.contains("not empty"), "{err}");
}

fn config_with_steps(cfg: &RunConfig, steps: u64) -> RunConfig {
    let mut c = cfg.clone();
    c.run.steps = steps;
    c
}

#[test]
fn sft_lowers_its_loss_and_evaluates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sft");
    let mut cfg = config(PipelineKind::Sft, 6);
    cfg.model.path = fixture("tiny-llama");
    cfg.data.prompts_per_step = 16;
    cfg.algorithm.warmup_steps = 0;
    cfg.algorithm.lr = 3e-3;
    cfg.algorithm.gradient_checkpointing = true;
    run(PipelineKind::Sft, cfg, &dir, false);
    let loss = metric(&dir, "sft", "loss");
    assert_eq!(loss.len(), 6);
    assert!(loss[&5] < loss[&0] - 0.5, "SFT loss {loss:?}");

    // The arith evaluation on the arith-sft fixture reproduces the greedy
    // accuracy transformers recorded for it on the same 500 held-out
    // prompts, up to two answers (a near-tie between two tokens' logits may
    // resolve the other way on another host's float32 sums).
    let mut cfg = config(PipelineKind::Grpo, 1);
    cfg.eval.arith = true;
    let (acc, samples) =
        weir::pipelines::task::arith_accuracy(&cfg, &fixture("arith-sft")).unwrap();
    let info: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("arith-sft").join("sft_info.json")).unwrap(),
    )
    .unwrap();
    let recorded = info["greedy_acc_500_heldout"].as_f64().unwrap();
    assert!(
        (acc - recorded).abs() <= 2.0 / 500.0 + 1e-12,
        "greedy accuracy {acc}, recorded {recorded}"
    );
    let first = info["samples"][0][0].as_str().unwrap();
    assert_eq!(samples[0].0, first);
}

#[test]
fn data_parallel_learners_train_like_one() {
    let tmp = tempfile::tempdir().unwrap();
    let base = || {
        let mut cfg = config(PipelineKind::Grpo, 3);
        cfg.run.max_staleness = 0;
        cfg.data.prompts_per_step = 4;
        cfg.algorithm.aggregation = Aggregation::TokenMean;
        cfg
    };
    let one = tmp.path().join("one");
    run(PipelineKind::Grpo, base(), &one, false);
    // Generation on worker 0; two learner ranks on workers 1 and 2, each
    // with the groups the advantage edge routes to it.
    let mut cfg = base();
    cfg.placement.workers = 3;
    cfg.placement.train = vec![1, 2];
    let two = tmp.path().join("two");
    let summary = run(PipelineKind::Grpo, cfg.clone(), &two, false);
    assert_eq!(summary["max_staleness_observed"], 0);
    assert!(two
        .join("checkpoints/step-2/actor/model.safetensors")
        .is_file());
    // Every rank trained on rows of its own, and the step's curves count each step once.
    let mut rows_by_worker = BTreeMap::new();
    for b in read_parquet_file(&two.join("metrics.parquet")).unwrap() {
        for r in weir::graph::metrics::batch_to_rows(&b).unwrap() {
            if r.stage == "learn" && r.metric == "rows_in" {
                *rows_by_worker.entry(r.worker).or_insert(0.0) += r.value;
            }
        }
    }
    assert_eq!(rows_by_worker.len(), 2, "{rows_by_worker:?}");
    assert!(
        rows_by_worker.values().all(|&n| n > 0.0),
        "{rows_by_worker:?}"
    );
    for name in ["loss", "grad_norm", "kl", "reward"] {
        let (a, b) = (metric(&one, "learn", name), metric(&two, "learn", name));
        assert_curves_match(
            &a,
            &b,
            3,
            &format!("learn {name}, one learner vs two ranks"),
        );
    }

    // A checkpoint outlives its rank count: two ranks resumed as one, one
    // as two, each go on from the checkpoint's weights and AdamW state,
    // like the run that never changed (to the ranks' rounding).
    let layout = |cfg: &mut weir::pipelines::RunConfig, ranks: usize| {
        cfg.placement.workers = 1 + ranks;
        cfg.placement.rollout = vec![0];
        cfg.placement.train = (1..=ranks).collect();
    };
    let four = |ranks: usize, steps: u64| {
        let mut cfg = base();
        cfg.run.steps = steps;
        cfg.run.checkpoint_every = 2;
        layout(&mut cfg, ranks);
        cfg
    };
    let straight = tmp.path().join("straight");
    run(PipelineKind::Grpo, four(1, 4), &straight, false);
    for (before, after) in [(2, 1), (1, 2)] {
        let dir = tmp.path().join(format!("ranks-{before}-to-{after}"));
        run(PipelineKind::Grpo, four(before, 2), &dir, false);
        let resumed = run(PipelineKind::Grpo, four(after, 4), &dir, true);
        assert_eq!(resumed["resumed_at_step"], 2, "{resumed}");
        for name in ["loss", "grad_norm", "kl", "reward"] {
            assert_curves_match(
                &metric(&straight, "learn", name),
                &metric(&dir, "learn", name),
                4,
                &format!("learn {name}, {before} ranks resumed as {after}"),
            );
        }
    }

    // The optimizer state sharded over the two ranks (ZeRO): the same
    // weights byte for byte, and a sharded checkpoint resumes on one rank,
    // one rank's on two sharded ranks, like the unsharded ones.
    let mut zero = cfg.clone();
    zero.placement.shard_optimizer = true;
    let sharded = tmp.path().join("sharded");
    run(PipelineKind::Grpo, zero, &sharded, false);
    let bytes = |dir: &Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    let weights = "checkpoints/step-2/actor/model.safetensors";
    assert!(bytes(&two, weights) == bytes(&sharded, weights));
    // A sharded checkpoint missing a rank's file: the resume names it.
    let lost = tmp.path().join("lost-shard");
    copy_dir(&sharded, &lost);
    std::fs::remove_file(
        lost.join("checkpoints/step-2/actor/optimizer-00002-of-00002.safetensors"),
    )
    .unwrap();
    let mut longer = cfg.clone();
    longer.placement.shard_optimizer = true;
    longer.run.steps = 4;
    let err = weir::pipelines::run(&request(PipelineKind::Grpo, longer, &lost, true))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("optimizer-00002-of-00002.safetensors")
            && err.contains("sharded over 2 ranks"),
        "{err}"
    );
    for (before, after) in [(2, 1), (1, 2)] {
        let dir = tmp.path().join(format!("sharded-{before}-to-{after}"));
        let sharding = |mut cfg: weir::pipelines::RunConfig, ranks: usize| {
            cfg.placement.shard_optimizer = ranks > 1;
            cfg
        };
        run(
            PipelineKind::Grpo,
            sharding(four(before, 2), before),
            &dir,
            false,
        );
        let resumed = run(
            PipelineKind::Grpo,
            sharding(four(after, 4), after),
            &dir,
            true,
        );
        assert_eq!(resumed["resumed_at_step"], 2, "{resumed}");
        let unsharded = tmp.path().join(format!("ranks-{before}-to-{after}"));
        let last = "checkpoints/step-3/actor/model.safetensors";
        assert!(
            bytes(&unsharded, last) == bytes(&dir, last),
            "{before} ranks resumed as {after}, sharded and not"
        );
    }

    // One group per step: a rank with no rows still ends every step with the other.
    let mut single = cfg.clone();
    single.data.prompts_per_step = 1;
    single.run.steps = 2;
    let lonely = tmp.path().join("lonely");
    run(PipelineKind::Grpo, single, &lonely, false);
    assert_eq!(metric(&lonely, "learn", "loss").len(), 2);

    // SFT too: two ranks, the same losses as one trainer.
    let sft = |train: Vec<usize>, dir: &Path| {
        let mut cfg = config(PipelineKind::Sft, 3);
        cfg.data.prompts_per_step = 6;
        cfg.placement.workers = 3;
        cfg.placement.train = train;
        run(PipelineKind::Sft, cfg, dir, false);
        metric(dir, "sft", "loss")
    };
    let (a, b) = (
        sft(vec![1], &tmp.path().join("sft-one")),
        sft(vec![1, 2], &tmp.path().join("sft-two")),
    );
    assert_curves_match(&a, &b, 3, "sft loss, one trainer vs two ranks");

    // Dynamic sampling, which fills a step's quota on one worker, is refused up front.
    let mut bad = cfg.clone();
    bad.dynamic_sampling.enabled = true;
    let err = run_err(PipelineKind::Grpo, bad, &tmp.path().join("refused"));
    assert!(
        err.contains("placement.train") && err.contains("dynamic sampling"),
        "{err}"
    );
    assert!(!tmp.path().join("refused").exists());
}

/// Packing (`algorithm.packing`) trains PPO like padded micro-batches:
/// the learner's passes, the critic's values and fit, with a group's
/// shared prompt run once; on bf16 too, where the reference runs on
/// libtorch (weir's CPU kernels take float32 only) and packs as well.
#[test]
fn packed_ppo_trains_like_padded_ppo() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in [
        weir::pipelines::config::Dtype::F32,
        weir::pipelines::config::Dtype::Bf16,
    ] {
        // In bf16 the layouts round apart, and from the second step on the
        // samples drawn from the weights differ: one step.
        let steps = if dtype == weir::pipelines::config::Dtype::F32 {
            3
        } else {
            1
        };
        let base = || {
            let mut cfg = config(PipelineKind::Ppo, steps);
            cfg.run.max_staleness = 0;
            cfg.data.prompts_per_step = 4;
            cfg.model.dtype = dtype;
            cfg.algorithm.kl_coef = 0.05;
            cfg.algorithm.micro_batch_tokens = 64;
            cfg
        };
        let padded = tmp.path().join(format!("padded-{dtype:?}"));
        run(PipelineKind::Ppo, base(), &padded, false);
        let mut cfg = base();
        cfg.algorithm.packing = true;
        let packed = tmp.path().join(format!("packed-{dtype:?}"));
        run(PipelineKind::Ppo, cfg, &packed, false);
        let tolerance = if dtype == weir::pipelines::config::Dtype::F32 {
            1e-4
        } else {
            2e-2
        };
        for (stage, name) in [
            ("learn", "loss"),
            ("learn", "grad_norm"),
            ("advantage", "kl"),
            ("critic_learn", "value_loss"),
        ] {
            let (a, b) = (metric(&padded, stage, name), metric(&packed, stage, name));
            assert_eq!(a.len(), steps as usize, "{stage} {name}");
            for (step, x) in &a {
                let y = b[step];
                assert!(
                    (x - y).abs() <= tolerance * x.abs().max(1e-2),
                    "{dtype:?} {stage} {name} step {step}: padded {x}, packed {y}"
                );
            }
        }
    }
}

/// PPO (its critic too), REINFORCE++ and GPG with two data-parallel ranks
/// train like one worker: the advantages are whitened over the whole step,
/// the in-reward KL (and so an adaptive coefficient) is the whole step's,
/// the critic's fit sums its ranks' gradients, GPG's α counts the whole
/// step; each rank trains rows of its own at every step.
#[test]
fn ppo_reinforce_pp_and_gpg_ranks_train_like_one() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in [
        PipelineKind::Ppo,
        PipelineKind::ReinforcePp,
        PipelineKind::Gpg,
    ] {
        let in_reward_kl = kind != PipelineKind::Gpg;
        let base = || {
            let mut cfg = config(kind, 3);
            cfg.run.max_staleness = 0;
            cfg.data.prompts_per_step = 4;
            cfg.algorithm.aggregation = Aggregation::TokenMean;
            if in_reward_kl {
                // An adaptive in-reward KL coefficient: it moves with the step's KL.
                cfg.algorithm.kl_coef = 0.05;
                cfg.algorithm.kl_target = 0.01;
                cfg.algorithm.kl_horizon = 100.0;
            }
            cfg
        };
        let one = tmp.path().join(format!("{}-one", kind.name()));
        run(kind, base(), &one, false);
        let mut cfg = base();
        cfg.placement.workers = 3;
        cfg.placement.train = vec![1, 2];
        let two = tmp.path().join(format!("{}-two", kind.name()));
        run(kind, cfg, &two, false);
        let mut curves = vec![("learn", "loss"), ("learn", "grad_norm")];
        if in_reward_kl {
            curves.extend([("advantage", "kl"), ("advantage", "kl_coef")]);
        }
        if kind == PipelineKind::Ppo {
            curves.push(("critic_learn", "value_loss"));
        }
        for (stage, name) in curves {
            let (a, b) = (metric(&one, stage, name), metric(&two, stage, name));
            let what = format!("{} {stage} {name}, one worker vs two ranks", kind.name());
            assert_curves_match(&a, &b, 3, &what);
        }
        // Both ranks trained rows of every step, and (with the KL term) both
        // scored a share of every step's reference log-probs.
        let stages: &[&str] = if in_reward_kl {
            &["learn", "reference"]
        } else {
            &["learn"]
        };
        for stage in stages {
            let rows: BTreeMap<(u64, u32), f64> = metric_rows(&two)
                .into_iter()
                .filter(|r| r.stage == *stage && r.metric == "rows_in")
                .map(|r| ((r.step, r.worker), r.value))
                .collect();
            assert!(
                rows.len() == 6 && rows.values().all(|&n| n > 0.0),
                "{} {stage}: {rows:?}",
                kind.name()
            );
        }
    }
}

/// GDPO: the rollout log keeps each reward term's own score; every step's
/// logged advantages are GDPO's (each term normalised in its group, the
/// weighted sum whitened over the whole step: zero mean over the step's
/// tokens) on the logged rows, whether one worker trains or two ranks each
/// hold some of the groups; the two train alike. Without reward terms, or
/// with a shaping key that would change only the summed reward, the config
/// is refused naming the key.
#[test]
fn gdpo_normalises_each_term_and_whitens_over_the_whole_step() {
    use weir::pipelines::config::{RewardKind, RewardTerm};
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let base = || {
        let mut cfg = config(kind, 3);
        cfg.run.max_staleness = 0;
        cfg.data.prompts_per_step = 4;
        cfg.algorithm.aggregation = Aggregation::TokenMean;
        cfg.algorithm.gdpo = true;
        cfg.reward.kind = RewardKind::Terms;
        cfg.reward.terms = vec![
            RewardTerm {
                rule: Some("arith_exact_match".into()),
                ..Default::default()
            },
            RewardTerm {
                rule: Some("length".into()),
                max_tokens: 6,
                weight: 0.3,
                ..Default::default()
            },
        ];
        cfg
    };
    let one = tmp.path().join("one");
    run(kind, base(), &one, false);
    let mut cfg = base();
    cfg.placement.workers = 3;
    cfg.placement.train = vec![1, 2];
    let two = tmp.path().join("two");
    run(kind, cfg, &two, false);
    for dir in [&one, &two] {
        let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
        // Per step: each row's term scores, its group, its logged advantages.
        type Rows = (Vec<Vec<f64>>, Vec<u64>, Vec<Vec<f64>>);
        let mut steps: BTreeMap<u64, Rows> = BTreeMap::new();
        for b in &batches {
            let terms = float_rows(b, col::REWARD_TERMS);
            let advantages = float_rows(b, col::ADVANTAGES);
            for (i, (step, group)) in u64s(b, col::STEP)
                .into_iter()
                .zip(u64s(b, col::GROUP_ID))
                .enumerate()
            {
                let rows = steps.entry(step).or_default();
                rows.0.push(terms[i].clone());
                rows.1.push(group);
                rows.2.push(advantages[i].clone());
            }
        }
        assert_eq!(steps.len(), 3, "{}", dir.display());
        let mut spread = false;
        for (step, (terms, groups, logged)) in &steps {
            assert!(terms.iter().all(|t| t.len() == 2));
            // The length term differs within groups where the rule does not.
            spread |= terms.iter().any(|t| (t[1] - terms[0][1]).abs() > 1e-6);
            let mask: Vec<Vec<f64>> = logged.iter().map(|a| vec![1.0; a.len()]).collect();
            let want =
                weir::operators::algorithms::gdpo(terms, &[1.0, 0.3], groups, &mask, true).unwrap();
            for (w, l) in want.iter().zip(logged) {
                for (a, b) in w.iter().zip(l) {
                    assert!((a - b).abs() < 1e-5, "step {step}: {want:?} vs {logged:?}");
                }
            }
        }
        assert!(spread, "the terms never differed");
    }
    for name in ["loss", "grad_norm"] {
        let (a, b) = (metric(&one, "learn", name), metric(&two, "learn", name));
        assert_curves_match(
            &a,
            &b,
            3,
            &format!("gdpo learn {name}, one worker vs two ranks"),
        );
    }
    // Bad input: no terms to decouple; a shaping key GDPO would ignore.
    let mut bad = base();
    bad.reward.kind = RewardKind::Rule;
    let err = run_err(kind, bad, &tmp.path().join("bad"));
    assert!(
        err.contains("algorithm.gdpo") && err.contains("terms"),
        "{err}"
    );
    let mut bad = base();
    bad.reward.stop_properly_coef = 0.5;
    let err = run_err(kind, bad, &tmp.path().join("bad2"));
    assert!(err.contains("reward.stop_properly_coef"), "{err}");
}

/// The optimal token baseline of an `otb` run's log, step by step: the
/// logged advantages are the estimator's on the logged rewards (an
/// episode's environment rewards added), behaviour log-probs, `Σ π²` and
/// generated-token masks; each generated token's `Σ π²` lies in [π², 1]
/// (its distribution's, which holds at least the sampled token), 0 on an
/// episode's other tokens. Returns the rows checked.
fn check_otb(dir: &Path) -> usize {
    use weir::operators::data::columns::{env_rewards, generated_masks};
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    type Rows = (Vec<f64>, Vec<u64>, [Vec<Vec<f64>>; 4]);
    let mut steps: BTreeMap<u64, Rows> = BTreeMap::new();
    for b in &batches {
        let behaviour = float_rows(b, col::BEHAVIOR_LOGPROBS);
        let lengths: Vec<usize> = behaviour.iter().map(Vec::len).collect();
        let squares = float_rows(b, col::SUM_PI_SQUARED);
        let masks = generated_masks(b, &lengths, "test").unwrap();
        let env = env_rewards(b, &lengths, "test").unwrap();
        let advantages = float_rows(b, col::ADVANTAGES);
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        for (i, (step, group)) in u64s(b, col::STEP)
            .into_iter()
            .zip(u64s(b, col::GROUP_ID))
            .enumerate()
        {
            for ((lp, sq), m) in behaviour[i].iter().zip(&squares[i]).zip(&masks[i]) {
                if *m > 0.0 {
                    let p2 = (2.0 * lp).exp();
                    assert!(*sq >= p2 - 1e-5 && *sq <= 1.0 + 1e-5, "Σπ² {sq}, π² {p2}");
                } else {
                    assert_eq!(*sq, 0.0);
                }
            }
            let turns: f64 = env.as_ref().map_or(0.0, |e| e[i].iter().sum());
            let rows = steps.entry(step).or_default();
            rows.0.push(f64::from(rewards.value(i)) + turns);
            rows.1.push(group);
            for (to, from) in rows
                .2
                .iter_mut()
                .zip([&behaviour, &squares, &masks, &advantages])
            {
                to.push(from[i].clone());
            }
        }
    }
    let mut checked = 0;
    for (step, (rewards, groups, [behaviour, squares, masks, logged])) in &steps {
        let want = weir::operators::algorithms::optimal_token_baseline(
            rewards, behaviour, squares, masks, groups,
        )
        .unwrap();
        for (row, (w, l)) in want.iter().zip(logged).enumerate() {
            assert_eq!(w.len(), l.len());
            for (t, (a, b)) in w.iter().zip(l).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                    "step {step} row {row} token {t}: logged {b}, the estimator gives {a}"
                );
            }
        }
        checked += logged.len();
    }
    checked
}

/// `otb` on libtorch's sampler and with streaming generation at staleness
/// 1 (rows whose tokens span weights versions): the generator records
/// each token's `Σ π²` and the logged advantages are the estimator's.
#[test]
fn the_optimal_token_baseline_reads_each_samplers_sum_pi_squared() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Otb;
    let mut torch = config(kind, 2);
    torch.generate.backend = weir::pipelines::config::Backend::Torch;
    let mut streamed = config(kind, 3);
    streamed.generate.max_inflight = 5;
    streamed.run.max_staleness = 1;
    for (name, cfg) in [("torch", torch), ("streamed", streamed)] {
        let dir = tmp.path().join(name);
        run(kind, cfg.clone(), &dir, false);
        let rows = check_otb(&dir);
        let want = cfg.run.steps as usize * cfg.data.prompts_per_step * cfg.data.samples_per_prompt;
        assert_eq!(rows, want, "{name}");
    }
}

#[test]
fn bad_configs_fail_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let mut cfg = config(PipelineKind::Grpo, 1);
    cfg.model.path = tmp.path().join("missing");
    let err = run_err(PipelineKind::Grpo, cfg, &dir);
    assert!(
        err.contains("model.path") && err.contains("missing"),
        "{err}"
    );
    assert!(!dir.exists(), "nothing written for a bad config");

    // An existing run is never overwritten.
    let ok = config(PipelineKind::Sft, 1);
    run(PipelineKind::Sft, ok.clone(), &dir, false);
    let err = run_err(PipelineKind::Sft, ok, &dir);
    assert!(
        err.contains("already holds a run") && err.contains("--resume"),
        "{err}"
    );
}

/// 32 preference pairs as JSONL: `Compute: A+B` with the right and a wrong sum.
fn write_pairs(path: &Path) {
    let lines: Vec<String> = (0..32u32)
        .map(|i| {
            let (a, b) = (i * 7 % 50, i * 13 % 40);
            serde_json::json!({
                "prompt": format!("Compute: {a}+{b}"),
                "chosen": (a + b).to_string(),
                "rejected": (a + b + 1 + i % 9).to_string(),
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

#[test]
fn rm_learns_its_pairs_and_dpo_grows_the_margin() {
    let tmp = tempfile::tempdir().unwrap();
    let pairs = tmp.path().join("pairs.jsonl");
    write_pairs(&pairs);

    let mut cfg = config(PipelineKind::Rm, 12);
    cfg.data.prompts = weir::pipelines::config::Task::File(pairs.to_path_buf());
    cfg.data.prompts_per_step = 16;
    cfg.algorithm.lr = 1e-3;
    cfg.algorithm.warmup_steps = 0;
    let dir = tmp.path().join("rm");
    let summary = run(PipelineKind::Rm, cfg, &dir, false);
    // The summary reads the reward-model trainer's figures.
    assert_eq!(summary["rows_trained"], 12.0 * 16.0, "{summary}");
    assert!(
        summary["samples_per_s"].as_f64().unwrap() > 0.0,
        "{summary}"
    );
    assert!(summary["loss_last"].as_f64().unwrap() < summary["loss_first"].as_f64().unwrap());
    let acc = metric(&dir, "rm", "accuracy");
    let loss = metric(&dir, "rm", "loss");
    assert_eq!(acc.len(), 12);
    // The last epoch (steps 10, 11) scores pairs it has trained on five times.
    assert!(
        (acc[&10] + acc[&11]) / 2.0 > 0.75,
        "accuracy by step {acc:?}"
    );
    assert!(loss[&11] < loss[&0], "loss {loss:?}");
    // The saved model is a one-label classifier that transformers and weir load as such.
    let saved = weir::gpu::ModelConfig::load(&dir.join("checkpoints/step-11/actor")).unwrap();
    assert_eq!(saved.head, weir::gpu::Head::SequenceClassification);

    // Two data-parallel ranks train like one (the source's batches alternate
    // between them, so each step one rank has no pairs and still joins in).
    for (kind, stage, names) in [
        (PipelineKind::Rm, "rm", ["loss", "accuracy", "margin"]),
        (
            PipelineKind::Dpo,
            "dpo",
            ["loss", "reward_margin", "accuracy"],
        ),
    ] {
        let curves = |train: Vec<usize>| {
            let mut cfg = config(kind, 3);
            cfg.data.prompts = weir::pipelines::config::Task::File(pairs.to_path_buf());
            cfg.data.prompts_per_step = 8;
            cfg.algorithm.lr = 1e-3;
            cfg.algorithm.warmup_steps = 0;
            cfg.placement.workers = 3;
            cfg.placement.train = train.clone();
            let dir = tmp.path().join(format!("{}-{}", stage, train.len()));
            run(kind, cfg, &dir, false);
            names.map(|name| metric(&dir, stage, name))
        };
        let (one, two) = (curves(vec![1]), curves(vec![1, 2]));
        for (name, (a, b)) in names.iter().zip(one.iter().zip(&two)) {
            assert_curves_match(
                a,
                b,
                3,
                &format!("{stage} {name}, one trainer vs two ranks"),
            );
        }
    }

    for loss_kind in [PreferenceChoice::Dpo, PreferenceChoice::Ipo] {
        let mut cfg = config(PipelineKind::Dpo, 6);
        cfg.data.prompts = weir::pipelines::config::Task::File(pairs.to_path_buf());
        cfg.data.prompts_per_step = 16;
        cfg.algorithm.lr = 1e-4;
        cfg.algorithm.warmup_steps = 0;
        cfg.algorithm.preference_loss = loss_kind;
        let dir = tmp.path().join(format!("{loss_kind:?}"));
        let summary = run(PipelineKind::Dpo, cfg, &dir, false);
        assert_eq!(summary["rows_trained"], 6.0 * 16.0, "{summary}");
        assert!(summary["loss_first"].is_number(), "{summary}");
        let margin = metric(&dir, "dpo", "reward_margin");
        assert!(
            margin[&0].abs() < 1e-6,
            "the policy starts as the reference: {margin:?}"
        );
        assert!(
            margin[&5] > 0.05,
            "{loss_kind:?}: the implicit reward margin grows: {margin:?}"
        );
    }
}

/// Every policy objective and correction trains through a pipeline: the
/// runs finish with finite losses, and each objective's losses are its own.
#[test]
fn every_policy_loss_and_correction_trains_through_grpo() {
    let tmp = tempfile::tempdir().unwrap();
    let mut losses: Vec<(String, BTreeMap<u64, f64>)> = Vec::new();
    for (name, items) in [
        ("ppo", &["algorithm.policy_loss=ppo"][..]),
        (
            "gspo",
            &[
                "algorithm.policy_loss=gspo",
                "algorithm.aggregation=\"seq-mean-token-mean\"",
            ],
        ),
        (
            "sapo",
            &[
                "algorithm.policy_loss=sapo",
                "algorithm.aggregation=\"seq-mean-token-mean\"",
            ],
        ),
        ("cispo", &["algorithm.policy_loss=cispo"]),
        ("gmpo", &["algorithm.policy_loss=gmpo"]),
        ("gpg", &["algorithm.policy_loss=gpg"]),
        (
            "reinforce",
            &["algorithm.policy_loss=reinforce", "run.max_staleness=1"],
        ),
        (
            "clip_cov",
            &[
                "algorithm.policy_loss=clip_cov",
                "algorithm.clip_cov_lb=-100",
            ],
        ),
        ("kl_cov", &["algorithm.policy_loss=kl_cov"]),
        ("dppo_tv", &["algorithm.policy_loss=dppo_tv"]),
        ("dppo_kl", &["algorithm.policy_loss=dppo_kl"]),
        ("dro", &["algorithm.policy_loss=dro"]),
        (
            "icepop",
            &["algorithm.correction=icepop", "run.max_staleness=1"],
        ),
        (
            "seq-mask",
            &["algorithm.correction=\"seq-mask\"", "run.max_staleness=1"],
        ),
        ("dual-clip", &["algorithm.dual_clip=2.0"]),
    ] {
        let mut items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        items.extend(["algorithm.ppo_epochs=2".into(), "algorithm.lr=0.01".into()]);
        let cfg = config(PipelineKind::Grpo, 2)
            .with_overrides(&items)
            .unwrap();
        let dir = tmp.path().join(name);
        run(PipelineKind::Grpo, cfg, &dir, false);
        let loss = metric(&dir, "learn", "loss");
        assert_eq!(loss.len(), 2, "{name}: {loss:?}");
        assert!(loss.values().all(|l| l.is_finite()), "{name}: {loss:?}");
        if name.contains('-') && !name.starts_with("dual") {
            assert_eq!(metric(&dir, "learn", "is_weight_mean").len(), 2, "{name}");
        }
        losses.push((name.to_string(), loss));
    }
    // The objectives differ from PPO's in their losses.
    let ppo = &losses[0].1;
    for (name, loss) in &losses[1..12] {
        assert!(
            loss.iter().any(|(s, l)| (l - ppo[s]).abs() > 1e-6),
            "{name} gives PPO's losses: {loss:?}"
        );
    }
}

/// Each `algorithm.policy_loss` trains its own objective: one step's logged
/// loss equals the objective function (held to verl's outputs by the
/// operators' tests) on the logged rows, with the step's log-probs from an
/// independent forward pass of the starting checkpoint. At the first update
/// the ratio is 1, so the objectives fall into classes that this tells
/// apart: PPO's −A (GSPO and GMPO coincide with it there), −A·log π (CISPO,
/// GPG, DPPO and DRO), SAPO's gate and REINFORCE's weight π / π_behaviour.
#[test]
fn each_policy_loss_trains_its_own_objective() {
    use tch::{Kind, Tensor};
    use weir::operators::algorithms::{
        policy_loss, Aggregation, GateDivergence, PolicyLossConfig, PolicyObjective,
    };
    let tmp = tempfile::tempdir().unwrap();
    let model =
        weir::gpu::Model::load(&fixture("arith-sft"), weir::gpu::Device::Cpu, Kind::Float).unwrap();
    for (name, objective, aggregation) in [
        ("ppo", PolicyObjective::Clipped, Aggregation::TokenMean),
        ("cispo", PolicyObjective::Cispo, Aggregation::TokenMean),
        (
            "sapo",
            PolicyObjective::Sapo {
                tau_pos: 1.0,
                tau_neg: 1.05,
            },
            Aggregation::SeqMeanTokenMean,
        ),
        (
            "gpg",
            PolicyObjective::PolicyGradient,
            Aggregation::TokenMean,
        ),
        (
            "reinforce",
            PolicyObjective::Reinforce { cap: 2.0 },
            Aggregation::TokenMean,
        ),
        // At ratio 1 no token has moved: DPPO keeps every token, −A·log π.
        (
            "dppo_tv",
            PolicyObjective::Dppo {
                divergence: GateDivergence::Tv,
                cap: 20.0,
            },
            Aggregation::TokenMean,
        ),
        (
            "dppo_kl",
            PolicyObjective::Dppo {
                divergence: GateDivergence::BinaryKl,
                cap: 20.0,
            },
            Aggregation::TokenMean,
        ),
        // DRO's penalty is 0 at ratio 1: −A·log π.
        (
            "dro",
            PolicyObjective::Dro { beta: 0.05 },
            Aggregation::TokenMean,
        ),
    ] {
        let mut cfg = config(PipelineKind::Grpo, 1);
        cfg.algorithm.kl_coef = 0.0;
        cfg.algorithm.micro_batch = 64;
        let mut items = vec![format!("algorithm.policy_loss={name}")];
        if aggregation == Aggregation::SeqMeanTokenMean {
            items.push("algorithm.aggregation=\"seq-mean-token-mean\"".into());
        }
        let cfg = cfg.with_overrides(&items).unwrap();
        let dir = tmp.path().join(name);
        run(PipelineKind::Grpo, cfg.clone(), &dir, false);
        let logged = metric(&dir, "learn", "loss")[&0];
        // The step's rows, padded to the longest response.
        let (mut contexts, mut responses, mut behaviour, mut advantages) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
            let list = |c: &str| b.column_by_name(c).unwrap().as_list::<i32>().clone();
            let (p, r, h, a) = (
                list(col::PROMPT_TOKENS),
                list(col::RESPONSE_TOKENS),
                list(col::BEHAVIOR_LOGPROBS),
                list(col::ADVANTAGES),
            );
            for i in 0..b.num_rows() {
                let ints = |x: arrow::array::ArrayRef| {
                    x.as_primitive::<arrow::datatypes::Int64Type>()
                        .values()
                        .to_vec()
                };
                let floats =
                    |x: arrow::array::ArrayRef| x.as_primitive::<Float32Type>().values().to_vec();
                contexts.push(ints(p.value(i)));
                responses.push(ints(r.value(i)));
                behaviour.push(floats(h.value(i)));
                advantages.push(floats(a.value(i)));
            }
        }
        let width = responses.iter().map(Vec::len).max().unwrap();
        let padded = |rows: Vec<Vec<f32>>| {
            let flat: Vec<f32> = rows
                .into_iter()
                .flat_map(|mut r| {
                    r.resize(width, 0.0);
                    r
                })
                .collect();
            Tensor::from_slice(&flat)
                .view([-1, width as i64])
                .to_kind(Kind::Double)
        };
        let current: Vec<Vec<f32>> = contexts
            .iter()
            .zip(&responses)
            .map(|(prompt, response)| {
                let ids: Vec<i64> = prompt.iter().chain(response).copied().collect();
                let n = ids.len() as i64;
                let lp = model
                    .token_logprobs(
                        &Tensor::from_slice(&ids).view([1, n]),
                        None,
                        cfg.generate.temperature,
                    )
                    .unwrap()
                    .get(0)
                    .narrow(0, n - 1 - response.len() as i64, response.len() as i64);
                Vec::<f32>::try_from(lp.to_kind(Kind::Float)).unwrap()
            })
            .collect();
        let mask = padded(responses.iter().map(|r| vec![1.0; r.len()]).collect());
        let logprobs = padded(current);
        let out = policy_loss(
            &logprobs,
            &logprobs.detach(),
            &padded(advantages),
            &mask,
            Some(&padded(behaviour)),
            &PolicyLossConfig {
                objective,
                aggregation,
                ..PolicyLossConfig::default()
            },
        );
        let want = out.loss_value();
        assert!(
            (logged - want).abs() <= 1e-4 * want.abs().max(1e-2),
            "{name}: the learner's loss {logged}, the objective's {want}"
        );
    }
}

/// Distillation over the teacher's top k: the teacher's k most likely
/// tokens at every position are logged (k per token, descending, the
/// sampled token's log-prob among them where it is one of them, at most
/// the k-th elsewhere); GKD's term alone (no per-token advantage) brings
/// the student towards the teacher; its keys' bad values name the key.
#[test]
fn a_teachers_top_k_is_logged_and_its_divergence_trains_the_student() {
    let tmp = tempfile::tempdir().unwrap();
    let k = 5;
    // A random student, the arith model its teacher.
    let steps = 10;
    let mut cfg = config(PipelineKind::Distill, steps);
    cfg.model.path = fixture("tiny-llama");
    cfg.teacher.path = fixture("arith-sft");
    cfg.teacher.top_k = k;
    cfg.algorithm.distill_coef = 0.0;
    cfg.algorithm.lr = 1e-2;
    cfg.run.max_staleness = 0;
    let dir = tmp.path().join("topk");
    run(PipelineKind::Distill, cfg.clone(), &dir, false);
    let sampled = float_list_column(&dir, col::TEACHER_LOGPROBS);
    let top = float_list_column(&dir, col::TEACHER_TOPK_LOGPROBS);
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    let lists = |name| -> Vec<Vec<i64>> {
        batches
            .iter()
            .flat_map(|b| weir::operators::data::columns::token_lists(b, name, "test").unwrap())
            .collect()
    };
    let (ids, responses) = (lists(col::TEACHER_TOPK_IDS), lists(col::RESPONSE_TOKENS));
    assert_eq!(top.len(), steps as usize * 3 * 4);
    let mut among = 0;
    for i in 0..top.len() {
        assert_eq!(top[i].len(), k * responses[i].len(), "row {i}");
        assert_eq!(ids[i].len(), k * responses[i].len(), "row {i}");
        for (j, token) in responses[i].iter().enumerate() {
            let (t, id) = (&top[i][j * k..(j + 1) * k], &ids[i][j * k..(j + 1) * k]);
            assert!(
                t.windows(2).all(|w| w[0] >= w[1]),
                "row {i} token {j}: {t:?}"
            );
            match id.iter().position(|x| x == token) {
                Some(at) => {
                    among += 1;
                    assert!((t[at] - sampled[i][j]).abs() < 1e-5, "row {i} token {j}");
                }
                None => assert!(sampled[i][j] <= t[k - 1] + 1e-5, "row {i} token {j}"),
            }
        }
    }
    assert!(among > 0);
    let gkd = metric(&dir, "learn", "gkd_divergence");
    let last = steps - 1;
    assert_eq!(gkd.len(), steps as usize, "{gkd:?}");
    assert!(
        gkd[&last] < 0.8 * gkd[&0],
        "the divergence did not fall: {gkd:?}"
    );
    // Advantages are zero: the term alone trains, and the reverse KL falls too.
    let kl = metric(&dir, "advantage", "teacher_kl");
    assert!(kl[&last] < 0.8 * kl[&0], "{kl:?}");
    // `weir plot` draws the divergence.
    let plots = weir::report::plot(&dir).unwrap();
    assert!(
        plots.iter().any(|p| p.ends_with("gkd_divergence.png")),
        "{plots:?}"
    );

    for (key, value, needle) in [
        ("algorithm.gkd_beta", "1.5", "[0, 1]"),
        ("teacher.top_k", "100000", "vocabulary"),
    ] {
        let bad = cfg
            .clone()
            .with_overrides(&[format!("{key}={value}")])
            .unwrap();
        let err = run_err(PipelineKind::Distill, bad, &tmp.path().join("bad"));
        assert!(err.contains(key) && err.contains(needle), "{err}");
    }
    // Its keys without a teacher's top k change nothing: refused.
    let mut inert = cfg.clone();
    inert.teacher.top_k = 0;
    let inert = inert
        .with_overrides(&["algorithm.gkd_beta=1.0".into()])
        .unwrap();
    let err = run_err(PipelineKind::Distill, inert, &tmp.path().join("inert"));
    assert!(
        err.contains("algorithm.gkd_beta") && err.contains("teacher.top_k"),
        "{err}"
    );
}

#[path = "pipelines/streaming.rs"]
mod streaming;

/// Every rollout row's list column `name` (float32), in log order.
fn float_list_column(dir: &Path, name: &str) -> Vec<Vec<f64>> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| weir::operators::data::columns::float_lists(b, name, "test").unwrap())
        .collect()
}

/// A reward model whose tokenizer reads the policy's ids otherwise (here
/// the fixture reward model with two ids swapped in its tokenizer.json)
/// scores each row as text: the prompt as a user message and the
/// completion as the answer, rendered by its own chat template and
/// tokenizer; each logged reward is that rendering's score. PPO's critic
/// may not start from such a reward model.
#[test]
fn a_reward_model_with_its_own_tokenizer_reads_each_row_as_text() {
    let tmp = tempfile::tempdir().unwrap();
    let rm = tmp.path().join("rm-swapped");
    std::fs::create_dir_all(&rm).unwrap();
    for entry in std::fs::read_dir(fixture("tiny-llama-rm")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), rm.join(entry.file_name())).unwrap();
    }
    let mut tokenizer: serde_json::Value =
        serde_json::from_slice(&std::fs::read(rm.join("tokenizer.json")).unwrap()).unwrap();
    for id in tokenizer["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .values_mut()
    {
        match id.as_i64() {
            Some(300) => *id = 301.into(),
            Some(301) => *id = 300.into(),
            _ => {}
        }
    }
    std::fs::write(rm.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 1);
    cfg.reward.kind = RewardKind::Model;
    cfg.model.reward_model = Some(rm.clone());
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let (prompts, responses, rewards) = (
        text_column(&dir, col::PROMPT),
        text_column(&dir, col::RESPONSE),
        reward_column(&dir),
    );
    assert_eq!(rewards.len(), 3 * 4);
    let tok = weir::gpu::Tokenizer::load(&rm).unwrap();
    let model = weir::gpu::Model::load(&rm, weir::gpu::Device::Cpu, tch::Kind::Float).unwrap();
    for i in 0..rewards.len() {
        let messages = serde_json::json!([
            {"role": "user", "content": prompts[i]},
            {"role": "assistant", "content": weir::operators::rewards::rules::completion(&responses[i])},
        ]);
        let ids = tok
            .encode_conversation(messages.as_array().unwrap(), None, false)
            .unwrap();
        let ids = tch::Tensor::from_slice(&ids).view([1, -1]);
        let want = model.scores(&ids, None).unwrap().double_value(&[0, 0]);
        assert!(
            (rewards[i] - want).abs() < 1e-5,
            "row {i}: {} vs {want}",
            rewards[i]
        );
    }
    // A critic started from it would score the policy's ids: refused.
    let mut ppo = config(PipelineKind::Ppo, 1);
    ppo.reward.kind = RewardKind::Model;
    ppo.model.reward_model = Some(rm);
    let refused = tmp.path().join("refused");
    let err = run_err(PipelineKind::Ppo, ppo, &refused);
    assert!(
        err.contains("model.critic") && err.contains("token id 300"),
        "{err}"
    );
    assert!(!refused.exists());
}

/// On-policy distillation: each token's logged advantage is the teacher's
/// log-prob less the student's (behaviour) one, plus a task's group
/// advantage when one is named; a student that is its own teacher sees a
/// zero reverse KL; against another teacher the reverse KL falls as the
/// student trains; a bad teacher is refused naming `teacher.path`.
#[test]
fn distillation_moves_the_student_toward_its_teacher() {
    let tmp = tempfile::tempdir().unwrap();
    let base = |teacher: &str, steps: u64| {
        let mut cfg = config(PipelineKind::Distill, steps);
        cfg.teacher.path = fixture(teacher);
        cfg.run.max_staleness = 0;
        cfg
    };
    // Its own teacher: nothing to learn.
    let own = tmp.path().join("own");
    run(PipelineKind::Distill, base("arith-sft", 1), &own, false);
    let kl = metric(&own, "advantage", "teacher_kl");
    assert!(kl[&0].abs() < 1e-4, "{kl:?}");

    let mut cfg = base("tiny-llama", 8);
    cfg.algorithm.lr = 3e-3;
    let other = tmp.path().join("other");
    run(PipelineKind::Distill, cfg, &other, false);
    let (student, teacher) = (
        float_list_column(&other, col::BEHAVIOR_LOGPROBS),
        float_list_column(&other, col::TEACHER_LOGPROBS),
    );
    let advantages = float_list_column(&other, col::ADVANTAGES);
    assert_eq!(advantages.len(), 8 * 3 * 4);
    for ((a, s), t) in advantages.iter().zip(&student).zip(&teacher) {
        assert_eq!(a.len(), s.len());
        for ((a, s), t) in a.iter().zip(s).zip(t) {
            assert!(
                (a - (t - s)).abs() < 1e-5,
                "advantage {a}, teacher {t}, student {s}"
            );
        }
    }
    let kl = metric(&other, "advantage", "teacher_kl");
    assert!(kl[&0] > 0.5, "{kl:?}");
    assert!(kl[&7] < 0.8 * kl[&0], "the reverse KL did not fall: {kl:?}");
    // `weir plot` draws it.
    let plots = weir::report::plot(&other).unwrap();
    assert!(
        plots.iter().any(|p| p.ends_with("teacher_kl.png")),
        "{plots:?}"
    );

    // Mixed with GRPO's advantage of the task's reward, at half weight.
    let mut cfg = base("tiny-llama", 1);
    cfg.algorithm.distill_task = weir::pipelines::config::DistillTask::Grpo;
    cfg.algorithm.distill_coef = 0.5;
    let mixed = tmp.path().join("mixed");
    run(PipelineKind::Distill, cfg.clone(), &mixed, false);
    let (student, teacher) = (
        float_list_column(&mixed, col::BEHAVIOR_LOGPROBS),
        float_list_column(&mixed, col::TEACHER_LOGPROBS),
    );
    let rewards = reward_column(&mixed);
    let groups: Vec<u64> = read_parquet_dir(&mixed.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| u64s(b, col::GROUP_ID))
        .collect();
    let task =
        weir::operators::algorithms::grpo(&rewards, &groups, true, cfg.algorithm.flavor).unwrap();
    let advantages = float_list_column(&mixed, col::ADVANTAGES);
    for (i, a) in advantages.iter().enumerate() {
        for (j, a) in a.iter().enumerate() {
            let want = task[i] + 0.5 * (teacher[i][j] - student[i][j]);
            assert!((a - want).abs() < 1e-5, "row {i} token {j}: {a} vs {want}");
        }
    }

    // A LoRA student, two data-parallel learner ranks, streaming
    // generation at staleness 1, the teacher's top 3 too: every step
    // trains, the teacher scoring each rank's share.
    let mut cfg = base("tiny-llama", 3);
    cfg.teacher.top_k = 3;
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8.0;
    cfg.placement.workers = 3;
    cfg.placement.train = vec![1, 2];
    cfg.run.max_staleness = 1;
    cfg.generate.max_inflight = 8;
    let spread = tmp.path().join("spread");
    run(PipelineKind::Distill, cfg, &spread, false);
    let kl = metric(&spread, "advantage", "teacher_kl");
    assert_eq!(kl.len(), 3, "{kl:?}");
    assert!(kl.values().all(|k| k.is_finite() && *k > 0.0), "{kl:?}");
    assert_eq!(metric(&spread, "learn", "loss").len(), 3);
    let gkd = metric(&spread, "learn", "gkd_divergence");
    assert!(
        gkd.len() == 3 && gkd.values().all(|d| d.is_finite() && *d > 0.0),
        "{gkd:?}"
    );

    // The teacher on a worker of its own: it alone runs the teacher
    // stage, and the run is the one with the teacher beside the learner.
    let beside = tmp.path().join("beside");
    run(PipelineKind::Distill, base("tiny-llama", 2), &beside, false);
    let mut cfg = base("tiny-llama", 2);
    cfg.placement.workers = 3;
    cfg.placement.teacher = TeacherPlacement::Workers(vec![2]);
    let apart = tmp.path().join("apart");
    run(PipelineKind::Distill, cfg, &apart, false);
    let sorted = |dir: &Path| {
        let mut rows = float_list_column(dir, col::TEACHER_LOGPROBS);
        rows.sort_by(|a, b| a.partial_cmp(b).unwrap());
        rows
    };
    assert_eq!(sorted(&apart), sorted(&beside));
    assert_eq!(
        metric(&apart, "learn", "loss"),
        metric(&beside, "learn", "loss")
    );
    let workers: std::collections::BTreeSet<u32> = metric_rows(&apart)
        .into_iter()
        .filter(|r| r.stage == "teacher")
        .map(|r| r.worker)
        .collect();
    assert_eq!(workers, [2].into());

    // A teacher whose vocabulary pads past the student's (Qwen2.5-7B's
    // against 0.5B's): its top k are the ids the student has a logit for.
    let mut cfg = base("tiny-qwen3", 1);
    cfg.teacher.top_k = 8;
    let wider = tmp.path().join("wider");
    run(PipelineKind::Distill, cfg, &wider, false);
    let ids: Vec<i64> = read_parquet_dir(&wider.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            weir::operators::data::columns::token_lists(b, col::TEACHER_TOPK_IDS, "test").unwrap()
        })
        .flatten()
        .collect();
    assert!(!ids.is_empty());
    assert!(ids.iter().all(|&id| (0..1000).contains(&id)), "{ids:?}");

    // A missing teacher, or one with another tokenizer, or fewer ids than
    // the student samples: one line naming the key, nothing written.
    let mut cfg = base("tiny-llama", 1);
    cfg.model.path = fixture("tiny-qwen3");
    let dir = tmp.path().join("refused");
    let err = run_err(PipelineKind::Distill, cfg, &dir);
    assert!(
        err.contains("teacher.path") && err.contains("vocab_size 1000, the policy's"),
        "{err}"
    );
    assert!(!dir.exists());
    let other_tokenizer = tmp.path().join("other-tokenizer");
    std::fs::create_dir_all(&other_tokenizer).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("tiny-llama").join(f), other_tokenizer.join(f)).unwrap();
    }
    std::fs::write(other_tokenizer.join("tokenizer.json"), "{}").unwrap();
    for (teacher, needle) in [
        (tmp.path().join("nowhere"), "no config.json"),
        (other_tokenizer, "tokenizer.json"),
    ] {
        let mut cfg = base("tiny-llama", 1);
        cfg.teacher.path = teacher;
        let dir = tmp.path().join("refused");
        let err = run_err(PipelineKind::Distill, cfg, &dir);
        assert!(
            err.contains("teacher.path") && err.contains(needle),
            "{err}"
        );
        assert!(!dir.exists());
    }
}
