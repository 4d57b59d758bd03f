//! Every RL pipeline for a few steps: run folders, rollouts, metrics and
//! checkpoints, each step's logged advantages recomputed with the
//! pipeline's own estimator; a bad config fails before anything runs.

use std::collections::BTreeMap;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Float32Type;
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::{check, col, Phase};
use weir::pipelines::config::{CorrectionChoice, ReferencePlacement, RewardKind, TeacherPlacement};
use weir::pipelines::runner::read_resolved;
use weir::pipelines::{PipelineKind, RunConfig};

use super::support::{config, fixture, float_rows, metric, run, run_err, u64s};

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
