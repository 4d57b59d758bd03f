//! A GRPO pipeline on the real stages, end to end through the engine: the
//! arith-sft checkpoint generates on worker 0, the learner updates it on
//! worker 1 with max_staleness 1, new weights travel back over the weights
//! edge as safetensors snapshots, and every row lands in the Parquet log.

use std::collections::BTreeMap;
use std::path::PathBuf;

use arrow::array::AsArray;
use arrow::datatypes::{Float32Type, UInt64Type};
use tch::Kind;
use weir_gpu::optim::AdamWConfig;
use weir_gpu::{Device, Model, SamplingParams, Tokenizer};
use weir_graph::{Execution, ParquetLog, Partition, Pipeline, Placement, RunSettings};
use weir_operators::algorithms::Flavor;
use weir_operators::rewards::rule_reward;
use weir_operators::rewards::rule_stage::RuleReward;
use weir_operators::rollout::{check, col, Phase};
use weir_operators::stages::advantage::{GroupAdvantage, GroupEstimator};
use weir_operators::stages::generate::Generate;
use weir_operators::stages::learner::{Learner, LearnerConfig, LrSchedule};
use weir_operators::stages::reference::RefLogprob;
use weir_operators::tasks::arith;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/arith-sft")
}

#[test]
fn grpo_runs_through_the_engine_with_async_weights() {
    let out = tempfile::tempdir().unwrap();
    let log_dir = out.path().join("rollouts");
    let (prompts_per_step, samples, steps) = (4usize, 4usize, 3u64);
    let pipeline = Pipeline::new("grpo")
        .source("rollout", move |w| {
            let tok = Tokenizer::load(&model_dir())?;
            Ok(arith::prompts(
                &arith::eval_pairs()[..64],
                &tok,
                prompts_per_step,
                samples,
                3,
            )?
            .shard(w.rank, w.role_size))
        })
        .generate("generate", "rollout", Partition::Local, |_| {
            let model = Model::load(&model_dir(), Device::Cpu, Kind::Float)?;
            let tok = Tokenizer::load(&model_dir())?;
            let params = SamplingParams {
                max_new_tokens: 6,
                temperature: 1.0,
                eos_token_ids: tok.eos_token_ids().to_vec(),
                seed: 5,
                ..Default::default()
            };
            Ok(Generate::new(model, tok, params))
        })
        .offload(2)
        .stage("reward", "rollout", Partition::Local, |_| {
            Ok(RuleReward::new(
                rule_reward("arith_exact_match").unwrap(),
                "answer",
            ))
        })
        .stage("reference", "train", Partition::RoundRobin, |_| {
            Ok(RefLogprob::new(
                Model::load(&model_dir(), Device::Cpu, Kind::Float)?,
                1.0,
            ))
        })
        .stage(
            "advantage",
            "train",
            Partition::ByKey(col::GROUP_ID.into()),
            |_| Ok(GroupAdvantage::new(GroupEstimator::Grpo, Flavor::OpenRlhf)),
        )
        .learn("learn", "train", Partition::RoundRobin, |_| {
            let model = Model::load(&model_dir(), Device::Cpu, Kind::Float)?;
            Learner::new(
                model,
                LearnerConfig {
                    adamw: AdamWConfig {
                        lr: 1e-4,
                        ..Default::default()
                    },
                    micro_batch: 8,
                    kl_coef: 0.04,
                    ppo_epochs: 2,
                    schedule: LrSchedule::Constant { warmup: 2 },
                    ..Default::default()
                },
            )
        })
        .sink("log", "train", Partition::Local, move |w| {
            Ok(ParquetLog::new(&log_dir, w.index, 1 << 20)?)
        });
    let settings = RunSettings::new(
        Execution::Threads(2),
        Placement::new(2)
            .assign("rollout", [0])
            .assign("train", [1]),
    )
    .max_staleness(1)
    .steps(steps);
    let report = pipeline.run(&settings).unwrap();
    assert_eq!(report.steps, steps);
    assert!(report.max_staleness_observed().unwrap() <= 1);
    // The learner's own figures reach the metrics stream, one per step.
    let losses: Vec<f64> = report
        .metrics
        .iter()
        .filter(|m| m.stage == "learn" && m.metric == "loss")
        .map(|m| m.value)
        .collect();
    assert_eq!(losses.len(), steps as usize);
    assert!(losses.iter().all(|l| l.is_finite()));
    assert!(report
        .metrics
        .iter()
        .any(|m| m.stage == "learn" && m.metric == "kl" && m.value >= 0.0));

    let batches = weir_graph::parquet_log::read_parquet_dir(&out.path().join("rollouts")).unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, steps as usize * prompts_per_step * samples);
    let mut group_sums: BTreeMap<u64, f64> = BTreeMap::new();
    let mut max_policy_version = 0;
    for b in &batches {
        check(b, Phase::Learn, "log").unwrap();
        let step = b
            .column_by_name(col::STEP)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let pv = b
            .column_by_name(col::POLICY_VERSION)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let lv = b
            .column_by_name(col::LEARNER_VERSION)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let groups = b
            .column_by_name(col::GROUP_ID)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        let adv = b.column_by_name(col::ADVANTAGES).unwrap().as_list::<i32>();
        let behaviour = b
            .column_by_name(col::BEHAVIOR_LOGPROBS)
            .unwrap()
            .as_list::<i32>();
        let reference = b
            .column_by_name(col::REF_LOGPROBS)
            .unwrap()
            .as_list::<i32>();
        for i in 0..b.num_rows() {
            assert_eq!(lv.value(i), step.value(i), "one update per step");
            assert!(lv.value(i) - pv.value(i) <= 1);
            max_policy_version = max_policy_version.max(pv.value(i));
            assert!(rewards.value(i) == 0.0 || rewards.value(i) == 1.0);
            let a = adv.value(i);
            let a = a.as_primitive::<Float32Type>();
            assert!(
                a.values().windows(2).all(|w| w[0] == w[1]),
                "outcome advantage on every token"
            );
            *group_sums.entry(groups.value(i)).or_default() += f64::from(a.value(0));
            if pv.value(i) == 0 {
                // Version 0 is the reference: its log-probs equal the generator's behaviour log-probs.
                let (bh, rf) = (behaviour.value(i), reference.value(i));
                let (bh, rf) = (
                    bh.as_primitive::<Float32Type>(),
                    rf.as_primitive::<Float32Type>(),
                );
                assert_eq!(bh.len(), rf.len());
                for (x, y) in bh.values().iter().zip(rf.values()) {
                    assert!((x - y).abs() < 1e-4, "behaviour {x} vs reference {y}");
                }
            }
        }
    }
    assert!(
        max_policy_version >= 1,
        "generators loaded weights the learner published"
    );
    assert_eq!(group_sums.len(), steps as usize * prompts_per_step);
    assert!(
        group_sums.values().all(|s| s.abs() < 1e-4),
        "GRPO advantages sum to 0 per group: {group_sums:?}"
    );
}

#[test]
fn ppo_with_a_critic_runs_through_the_engine() {
    use weir_operators::stages::advantage::GaeAdvantage;
    use weir_operators::stages::critic::{Critic, CriticLearner, PerWorker};
    let out = tempfile::tempdir().unwrap();
    let log_dir = out.path().join("rollouts");
    let (prompts_per_step, samples, steps) = (3usize, 2usize, 2u64);
    let critic =
        PerWorker::new(|_| Ok(Model::load_critic(&model_dir(), Device::Cpu, Kind::Float)?));
    let (c1, c2) = (critic.clone(), critic.clone());
    let pipeline = Pipeline::new("ppo")
        .source("rollout", move |w| {
            let tok = Tokenizer::load(&model_dir())?;
            Ok(arith::prompts(
                &arith::eval_pairs()[..32],
                &tok,
                prompts_per_step,
                samples,
                9,
            )?
            .shard(w.rank, w.role_size))
        })
        .generate("generate", "rollout", Partition::Local, |_| {
            let model = Model::load(&model_dir(), Device::Cpu, Kind::Float)?;
            let tok = Tokenizer::load(&model_dir())?;
            let params = SamplingParams {
                max_new_tokens: 6,
                eos_token_ids: tok.eos_token_ids().to_vec(),
                ..Default::default()
            };
            Ok(Generate::new(model, tok, params))
        })
        .offload(2)
        .stage("reward", "rollout", Partition::Local, |_| {
            Ok(RuleReward::new(
                rule_reward("arith_exact_match").unwrap(),
                "answer",
            ))
        })
        .stage("reference", "train", Partition::RoundRobin, |_| {
            Ok(RefLogprob::new(
                Model::load(&model_dir(), Device::Cpu, Kind::Float)?,
                1.0,
            ))
        })
        .stage("critic", "train", Partition::Local, move |w| {
            Critic::new(&c1, w)
        })
        .stage("advantage", "train", Partition::Local, |_| {
            Ok(GaeAdvantage::new(0.05))
        })
        .learn("learn", "train", Partition::Local, |_| {
            Learner::new(
                Model::load(&model_dir(), Device::Cpu, Kind::Float)?,
                LearnerConfig::default(),
            )
        })
        .stage("critic_learn", "train", Partition::Local, move |w| {
            CriticLearner::new(
                &c2,
                w,
                AdamWConfig {
                    lr: 1e-4,
                    ..Default::default()
                },
                Some(0.5),
                Some(1.0),
            )
        })
        .sink("log", "train", Partition::Local, move |w| {
            Ok(ParquetLog::new(&log_dir, w.index, 1 << 20)?)
        });
    let settings = RunSettings::new(
        Execution::Threads(2),
        Placement::new(2)
            .assign("rollout", [0])
            .assign("train", [1]),
    )
    .max_staleness(1)
    .steps(steps);
    pipeline.run(&settings).unwrap();

    let batches = weir_graph::parquet_log::read_parquet_dir(&out.path().join("rollouts")).unwrap();
    assert_eq!(
        batches.iter().map(|b| b.num_rows()).sum::<usize>(),
        steps as usize * prompts_per_step * samples
    );
    for b in &batches {
        check(b, Phase::Learn, "log").unwrap();
        let rewards = b
            .column_by_name(col::TOKEN_REWARDS)
            .unwrap()
            .as_list::<i32>();
        let returns = b.column_by_name(col::RETURNS).unwrap().as_list::<i32>();
        let values = b.column_by_name(col::VALUES).unwrap().as_list::<i32>();
        for i in 0..b.num_rows() {
            let (r, g, v) = (rewards.value(i), returns.value(i), values.value(i));
            let (r, g, v) = (
                r.as_primitive::<Float32Type>(),
                g.as_primitive::<Float32Type>(),
                v.as_primitive::<Float32Type>(),
            );
            assert!(v.values().iter().all(|x| x.is_finite()));
            // γ = λ = 1: the return of every token is its reward-to-go.
            for t in 0..r.len() {
                let to_go: f32 = r.values()[t..].iter().sum();
                assert!(
                    (g.value(t) - to_go).abs() < 1e-4,
                    "row {i} token {t}: return {} vs reward-to-go {to_go}",
                    g.value(t)
                );
            }
        }
    }
}

#[test]
fn dapo_filters_groups_and_feeds_prompt_stats_through_the_engine() {
    use weir_operators::stages::dynamic_sampling::{DynamicSampling, DynamicSamplingConfig};
    use weir_operators::stages::prompt_stats::{PromptStats, StatsView};
    let out = tempfile::tempdir().unwrap();
    let log_dir = out.path().join("rollouts");
    let (prompts_per_step, samples, steps, target) = (6usize, 4usize, 4u64, 2usize);
    let view = StatsView::new();
    let stats_view = view.clone();
    let pipeline = Pipeline::new("dapo")
        .source("rollout", move |w| {
            let tok = Tokenizer::load(&model_dir())?;
            Ok(arith::prompts(
                &arith::eval_pairs()[..48],
                &tok,
                prompts_per_step,
                samples,
                11,
            )?
            .shard(w.rank, w.role_size))
        })
        .generate("generate", "rollout", Partition::Local, |_| {
            let model = Model::load(&model_dir(), Device::Cpu, Kind::Float)?;
            let tok = Tokenizer::load(&model_dir())?;
            let params = SamplingParams {
                max_new_tokens: 6,
                temperature: 1.5,
                eos_token_ids: tok.eos_token_ids().to_vec(),
                seed: 2,
                ..Default::default()
            };
            Ok(Generate::new(model, tok, params))
        })
        .stage("reward", "rollout", Partition::Local, |_| {
            Ok(RuleReward::new(
                rule_reward("arith_exact_match").unwrap(),
                "answer",
            ))
        })
        .stage(
            "stats",
            "train",
            Partition::ByKey(col::PROMPT_ID.into()),
            move |_| Ok(PromptStats::new(stats_view.clone(), 1.0)),
        )
        .stage("filter", "train", Partition::Local, move |w| {
            Ok(DynamicSampling::new(
                DynamicSamplingConfig {
                    target_groups: Some(target),
                    ..DynamicSamplingConfig::default()
                },
                w.steps,
            ))
        })
        .stage("advantage", "train", Partition::Local, |_| {
            Ok(GroupAdvantage::new(GroupEstimator::Grpo, Flavor::OpenRlhf))
        })
        .learn("learn", "train", Partition::Local, |_| {
            Learner::new(
                Model::load(&model_dir(), Device::Cpu, Kind::Float)?,
                LearnerConfig::default(),
            )
        })
        .sink("log", "train", Partition::Local, move |w| {
            Ok(ParquetLog::new(&log_dir, w.index, 1 << 20)?)
        });
    let settings = RunSettings::new(
        Execution::Threads(2),
        Placement::new(2)
            .assign("rollout", [0])
            .assign("train", [1]),
    )
    .max_staleness(1)
    .steps(steps);
    let report = pipeline.run(&settings).unwrap();
    assert!(report.max_staleness_observed().unwrap_or(0) <= 1);
    let metric = |name: &str| -> f64 {
        report
            .metrics
            .iter()
            .filter(|m| m.stage == "filter" && m.metric == name)
            .map(|m| m.value)
            .sum()
    };
    let (kept, dropped) = (metric("groups_kept"), metric("groups_dropped"));
    assert_eq!(kept + dropped, (steps as usize * prompts_per_step) as f64);
    assert!(dropped > 0.0, "some groups agree at this size");

    // Only informative groups reach the learner, at most `target` a step.
    let batches = weir_graph::parquet_log::read_parquet_dir(&out.path().join("rollouts")).unwrap();
    let mut rewards_of: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
    let mut groups_per_step: BTreeMap<u64, std::collections::BTreeSet<u64>> = BTreeMap::new();
    for b in &batches {
        let groups = b
            .column_by_name(col::GROUP_ID)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        let lv = b
            .column_by_name(col::LEARNER_VERSION)
            .unwrap()
            .as_primitive::<UInt64Type>();
        for i in 0..b.num_rows() {
            rewards_of
                .entry(groups.value(i))
                .or_default()
                .push(rewards.value(i));
            groups_per_step
                .entry(lv.value(i))
                .or_default()
                .insert(groups.value(i));
        }
    }
    assert_eq!(rewards_of.len() as f64, metric("groups_emitted"));
    for (g, r) in &rewards_of {
        assert_eq!(r.len(), samples, "group {g} arrives whole");
        assert!(
            r.iter().any(|x| *x != r[0]),
            "group {g} is informative: {r:?}"
        );
    }
    assert!(groups_per_step.values().all(|g| g.len() <= target));

    // The view saw every scored sample, prompt by prompt.
    let stats = view.as_of(steps);
    let samples_seen: u64 = stats.values().map(|s| s.samples).sum();
    assert_eq!(
        samples_seen,
        (steps as usize * prompts_per_step * samples) as u64
    );
    assert!(stats
        .values()
        .all(|s| s.samples % samples as u64 == 0 && s.solved <= s.samples));
}

/// A parser for the chain test: every turn of the arith model calls the
/// calculator on `1+1` (the model writes no tool calls of its own).
struct EveryTurnCalls;

impl weir_operators::agent::tool_calls::ToolCallParser for EveryTurnCalls {
    fn name(&self) -> &'static str {
        "every_turn"
    }

    fn parse(&self, _text: &str) -> weir_operators::agent::tool_calls::Calls {
        let mut arguments = serde_json::Map::new();
        arguments.insert("expression".into(), "1+1".into());
        vec![Ok(weir_operators::agent::tool_calls::ToolCall {
            name: "calculator".into(),
            arguments,
        })]
    }
}

/// Episodes of two turns (a tool's answer between them) through GRPO's
/// stages and the engine: the log holds each trajectory with its token
/// kinds, behaviour log-probs on generated tokens only (null elsewhere),
/// the calls; the learner counts generated tokens only.
#[test]
fn grpo_trains_on_multi_turn_episodes_through_the_engine() {
    use weir_operators::agent::episode::Budgets;
    use weir_operators::agent::stage::{EpisodeGenerate, TOOL_CALLS};
    use weir_operators::agent::tools::{Calculator, Tool};
    use weir_operators::rollout::TokenKind;

    let out = tempfile::tempdir().unwrap();
    let log_dir = out.path().join("rollouts");
    // The arith checkpoint with a chat template that renders tools.
    let tools_dir = out.path().join("arith-tools");
    std::fs::create_dir_all(&tools_dir).unwrap();
    for entry in std::fs::read_dir(model_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tools_dir.join(entry.file_name())).unwrap();
    }
    std::fs::write(
        tools_dir.join("chat_template.jinja"),
        "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let (prompts_per_step, samples, steps) = (2usize, 4usize, 2u64);
    let pipeline = Pipeline::new("grpo-episodes")
        .source("rollout", move |w| {
            let tok = Tokenizer::load(&model_dir())?;
            Ok(arith::prompts(
                &arith::eval_pairs()[..16],
                &tok,
                prompts_per_step,
                samples,
                3,
            )?
            .shard(w.rank, w.role_size))
        })
        .generate("generate", "rollout", Partition::Local, move |_| {
            let model = Model::load(&tools_dir, Device::Cpu, Kind::Float)?;
            let tok = Tokenizer::load(&tools_dir)?;
            let params = SamplingParams {
                max_new_tokens: 12,
                temperature: 1.0,
                eos_token_ids: tok.eos_token_ids().to_vec(),
                seed: 5,
                ..Default::default()
            };
            let tools: Vec<Box<dyn Tool>> = vec![Box::new(Calculator)];
            let budgets = Budgets {
                max_turns: 2,
                max_tokens: 64,
                max_observation_tokens: 16,
            };
            EpisodeGenerate::new(model, tok, params, tools, Box::new(EveryTurnCalls), budgets)
        })
        .stage("reward", "rollout", Partition::Local, |_| {
            Ok(RuleReward::new(
                rule_reward("arith_exact_match").unwrap(),
                "answer",
            ))
        })
        .stage(
            "advantage",
            "train",
            Partition::ByKey(col::GROUP_ID.into()),
            |_| Ok(GroupAdvantage::new(GroupEstimator::Grpo, Flavor::OpenRlhf)),
        )
        .learn("learn", "train", Partition::RoundRobin, |_| {
            let model = Model::load(&model_dir(), Device::Cpu, Kind::Float)?;
            Learner::new(model, LearnerConfig::default())
        })
        .sink("log", "train", Partition::Local, move |w| {
            Ok(ParquetLog::new(&log_dir, w.index, 1 << 20)?)
        });
    let settings = RunSettings::new(
        Execution::Threads(2),
        Placement::new(2)
            .assign("rollout", [0])
            .assign("train", [1]),
    )
    .max_staleness(0)
    .steps(steps);
    let report = pipeline.run(&settings).unwrap();
    assert_eq!(report.steps, steps);

    let batches = weir_graph::parquet_log::read_parquet_dir(&out.path().join("rollouts")).unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, steps as usize * prompts_per_step * samples);
    let (mut generated, mut full) = (BTreeMap::<u64, usize>::new(), BTreeMap::<u64, usize>::new());
    for b in &batches {
        check(b, Phase::Learn, "log").unwrap();
        let step = b
            .column_by_name(col::STEP)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let kinds = b.column_by_name(col::TOKEN_KINDS).unwrap().as_list::<i32>();
        let behaviour = b
            .column_by_name(col::BEHAVIOR_LOGPROBS)
            .unwrap()
            .as_list::<i32>();
        let reasons = b
            .column_by_name(col::FINISH_REASON)
            .unwrap()
            .as_string::<i32>();
        let calls = b.column_by_name(TOOL_CALLS).unwrap().as_string::<i32>();
        for i in 0..b.num_rows() {
            let k = kinds.value(i);
            let k = k.as_primitive::<arrow::datatypes::UInt8Type>();
            let lp = behaviour.value(i);
            assert_eq!(k.len(), lp.len());
            for (j, code) in k.values().iter().enumerate() {
                let kind = TokenKind::from_code(*code).unwrap();
                assert_eq!(
                    lp.is_valid(j),
                    kind == TokenKind::Generated,
                    "row {i} token {j}: a behaviour log-prob exactly on generated tokens"
                );
            }
            let reason = reasons.value(i);
            if reason == "max_turns" {
                assert!(k.values().contains(&(TokenKind::Observation as u8)));
                let calls: serde_json::Value = serde_json::from_str(calls.value(i)).unwrap();
                assert_eq!(calls[0]["output"], "2");
            } else {
                assert_eq!(reason, "length", "row {i}");
            }
            let g = k.values().iter().filter(|c| **c == 0).count();
            *generated.entry(step.value(i)).or_default() += g;
            *full.entry(step.value(i)).or_default() += k.len();
        }
    }
    assert!(
        generated.values().zip(full.values()).all(|(g, f)| g < f),
        "every step has observation tokens"
    );
    // What the episodes did reaches the metrics: one or two turns an
    // episode (a first turn cut by its budget ends it), every call answered.
    let metric = |name: &str| -> Vec<f64> {
        report
            .metrics
            .iter()
            .filter(|m| m.stage == "generate" && m.metric == name)
            .map(|m| m.value)
            .collect()
    };
    let turns = metric("turns");
    assert_eq!(turns.len(), steps as usize);
    assert!(turns.iter().all(|&t| (1.0..=2.0).contains(&t)), "{turns:?}");
    assert!(metric("tool_errors").iter().all(|&e| e == 0.0));
    assert!(metric("observation_share")
        .iter()
        .all(|&s| s > 0.0 && s < 1.0));
    assert!(metric("tool_latency_p99_s").iter().all(|&s| s >= 0.0));
    // The learner's response length counts generated tokens only.
    for m in report
        .metrics
        .iter()
        .filter(|m| m.stage == "learn" && m.metric == "response_length")
    {
        let want = generated[&m.step] as f64 / (prompts_per_step * samples) as f64;
        assert!(
            (m.value - want).abs() < 1e-9,
            "step {}: {} vs {want}",
            m.step,
            m.value
        );
    }
}
