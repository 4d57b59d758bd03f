//! Streaming generation (`generate.max_inflight`) through whole runs: at
//! k = 0 the same rows and weights as batch-by-batch generation; at k = 1
//! every token's version recorded and the staleness bound held per row.

use arrow::array::{Array, ListArray};
use arrow::datatypes::UInt32Type;
use weir::pipelines::config::OnNewWeights;

use std::collections::BTreeMap;
use std::path::Path;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Float32Type;
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::{check, col, Phase};
use weir::pipelines::config::RewardKind;
use weir::pipelines::PipelineKind;

use super::support::{config, fixture, metric, run, u64s, write_arith_task};

/// Every rollout row of `dir`, keyed by (step, group, sample), as the
/// columns that must not depend on how generation was scheduled.
fn rows_by_key(dir: &Path) -> BTreeMap<(u64, u64, u64), Vec<String>> {
    let mut out = BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let (steps, groups) = (u64s(&b, col::STEP), u64s(&b, col::GROUP_ID));
        let samples = b
            .column_by_name(col::SAMPLE_IDX)
            .unwrap()
            .as_primitive::<UInt32Type>();
        for i in 0..b.num_rows() {
            let values = [
                col::RESPONSE_TOKENS,
                col::BEHAVIOR_LOGPROBS,
                col::REWARD,
                col::REF_LOGPROBS,
                col::ADVANTAGES,
                col::POLICY_VERSION,
                col::TOKEN_VERSIONS,
                col::FINISH_REASON,
            ]
            .iter()
            .map(|c| {
                let column = b.column_by_name(c).unwrap_or_else(|| panic!("no {c}"));
                arrow::util::display::array_value_to_string(column, i).unwrap()
            })
            .collect();
            let key = (steps[i], groups[i], u64::from(samples.value(i)));
            assert!(out.insert(key, values).is_none(), "row {key:?} twice");
        }
    }
    out
}

fn list_values(b: &RecordBatch, name: &str, row: usize) -> arrow::array::ArrayRef {
    let list: &ListArray = b.column_by_name(name).unwrap().as_list::<i32>();
    list.value(row)
}

#[test]
fn streaming_generation_keeps_the_synchronous_rows_at_k0_and_bounds_every_token_at_k1() {
    let tmp = tempfile::tempdir().unwrap();
    let base = || {
        let mut cfg = config(PipelineKind::Grpo, 3);
        cfg.run.max_staleness = 0;
        cfg.generate.max_new_tokens = 8;
        cfg
    };
    let batch = tmp.path().join("batch");
    run(PipelineKind::Grpo, base(), &batch, false);
    // 12 rows a step through 5 slots: slots are refilled within a step.
    let mut cfg = base();
    cfg.generate.max_inflight = 5;
    let streamed = tmp.path().join("streamed");
    run(PipelineKind::Grpo, cfg, &streamed, false);
    let (a, b) = (rows_by_key(&batch), rows_by_key(&streamed));
    assert_eq!(a.len(), 3 * 12);
    assert_eq!(a, b, "k = 0: streaming changed the rows");
    for name in ["loss", "kl", "grad_norm"] {
        assert_eq!(
            metric(&batch, "learn", name),
            metric(&streamed, "learn", name),
            "k = 0: learn {name}"
        );
    }
    let weights =
        |dir: &Path| std::fs::read(dir.join("checkpoints/step-2/actor/model.safetensors")).unwrap();
    assert!(
        weights(&batch) == weights(&streamed),
        "k = 0: the checkpoints differ"
    );
    let occupancy = metric(&streamed, "generate", "slot_occupancy");
    assert_eq!(occupancy.len(), 3);
    assert!(
        occupancy.values().all(|&o| o > 0.0 && o <= 1.0),
        "{occupancy:?}"
    );

    // k = 1: weights land while sequences are in flight (or between them);
    // whatever the timing, each token names its version and each row's
    // policy_version is its oldest token's, within the bound.
    for policy in [
        OnNewWeights::Keep,
        OnNewWeights::Recompute,
        OnNewWeights::Finish,
    ] {
        let mut cfg = base();
        cfg.run.steps = 4;
        cfg.run.max_staleness = 1;
        cfg.generate.max_inflight = 5;
        cfg.generate.on_new_weights = policy;
        if policy == OnNewWeights::Keep {
            // Evaluation during training wraps the streaming generator, and
            // must pass every hook on (a missing one hung the run).
            let held = tmp.path().join("held.jsonl");
            std::fs::write(
                &held,
                "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"2+3=\", \"answer\": \"5\"}\n",
            )
            .unwrap();
            cfg.eval.prompts = Some(held.to_path_buf());
            cfg.eval.every = 2;
        }
        let dir = tmp.path().join(format!("k1-{policy:?}"));
        let summary = run(PipelineKind::Grpo, cfg, &dir, false);
        if policy == OnNewWeights::Keep {
            assert!(!metric(&dir, "eval", "reward").is_empty(), "no evaluation");
        }
        assert!(summary["max_staleness_observed"].as_u64().unwrap() <= 1);
        let mut rows = 0;
        for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
            check(&b, Phase::Learn, "test").unwrap();
            let (policy_versions, learner) = (
                u64s(&b, col::POLICY_VERSION),
                u64s(&b, col::LEARNER_VERSION),
            );
            for i in 0..b.num_rows() {
                rows += 1;
                let versions = list_values(&b, col::TOKEN_VERSIONS, i);
                let versions = versions.as_primitive::<UInt32Type>().values().to_vec();
                let recomputed = list_values(&b, col::KV_RECOMPUTED, i);
                let recomputed: Vec<bool> =
                    recomputed.as_boolean().iter().map(Option::unwrap).collect();
                assert_eq!(
                    versions.len(),
                    list_values(&b, col::RESPONSE_TOKENS, i).len()
                );
                let oldest = versions.iter().min().map(|&v| u64::from(v));
                assert_eq!(
                    Some(policy_versions[i]),
                    oldest.or(Some(policy_versions[i]))
                );
                assert!(
                    versions.windows(2).all(|w| w[0] <= w[1]),
                    "{policy:?}: {versions:?}"
                );
                assert!(learner[i] - policy_versions[i] <= 1);
                if policy != OnNewWeights::Recompute {
                    assert!(recomputed.iter().all(|r| !r), "{policy:?}: {recomputed:?}");
                }
                if policy == OnNewWeights::Finish {
                    assert!(
                        versions.iter().all(|&v| v == versions[0]),
                        "finish: {versions:?}"
                    );
                }
            }
        }
        assert_eq!(rows, 4 * 12, "{policy:?}");
        assert_eq!(metric(&dir, "learn", "loss").len(), 4);
    }
}

/// k = 1 with one prompt a step: the learner's new weights land while the
/// next step's sequences are in flight, at their `HOLD`-th token (the
/// generator's test hook waits there for them, so no timing decides where).
/// Under `recompute` each sequence's prompt and tokens so far run again
/// under the new weights, so every token's behaviour log-prob is what an
/// independent forward pass of its whole prefix under the weights of its
/// version gives (the version-v weights are the checkpoint of step v − 1).
#[test]
fn a_swap_mid_sequence_samples_every_later_token_under_the_new_weights() {
    const HOLD: usize = 24;
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = config(PipelineKind::Grpo, 4);
    cfg.run.max_staleness = 1;
    cfg.run.checkpoint_every = 1;
    cfg.data.prompts_per_step = 1;
    cfg.data.samples_per_prompt = 2;
    cfg.generate.max_inflight = 2;
    cfg.generate.max_new_tokens = 64;
    cfg.generate.ignore_eos = true;
    cfg.generate.on_new_weights = OnNewWeights::Recompute;
    cfg.generate.hold_for_weights_at = Some(HOLD);
    // libtorch's decode: the GPU path.
    cfg.generate.backend = weir::pipelines::config::Backend::Torch;
    // A step moves the policy far enough that the versions' log-probs tell apart.
    cfg.algorithm.lr = 1e-3;
    let dir = tmp.path().join("run");
    run(PipelineKind::Grpo, cfg.clone(), &dir, false);

    let mut models: BTreeMap<u64, weir::gpu::Model> = BTreeMap::new();
    let (mut swapped, mut compared) = (0, 0);
    // How far the tokens after a swap are from the older weights' log-probs:
    // what the comparison would have missed had they been sampled from those.
    let mut apart = 0.0f32;
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        for i in 0..b.num_rows() {
            let ints = |name: &str| {
                let v = list_values(&b, name, i);
                v.as_primitive::<arrow::datatypes::Int64Type>()
                    .values()
                    .to_vec()
            };
            let (prompt, response) = (ints(col::PROMPT_TOKENS), ints(col::RESPONSE_TOKENS));
            let versions = list_values(&b, col::TOKEN_VERSIONS, i);
            let versions = versions.as_primitive::<UInt32Type>().values().to_vec();
            let behaviour = list_values(&b, col::BEHAVIOR_LOGPROBS, i);
            let behaviour = behaviour.as_primitive::<Float32Type>().values().to_vec();
            let recomputed = list_values(&b, col::KV_RECOMPUTED, i);
            let recomputed: Vec<bool> =
                recomputed.as_boolean().iter().map(Option::unwrap).collect();
            let Some(at) = versions.iter().position(|&v| v != versions[0]) else {
                continue;
            };
            swapped += 1;
            assert_eq!(
                at, HOLD,
                "row {i}: the swap lands where the generator waits"
            );
            assert!(
                recomputed[at],
                "row {i}: the swap at token {at} ran over a recomputed cache"
            );
            let ids =
                tch::Tensor::from_slice(&[prompt.clone(), response.clone()].concat()).view([1, -1]);
            let mut distinct = versions.clone();
            distinct.dedup();
            let mut before: Vec<f32> = Vec::new();
            for v in distinct {
                let v = u64::from(v);
                let model = models.entry(v).or_insert_with(|| {
                    let path = match v {
                        0 => fixture("arith-sft"),
                        v => dir.join(format!("checkpoints/step-{}/actor", v - 1)),
                    };
                    weir::gpu::Model::load(&path, weir::gpu::Device::Cpu, tch::Kind::Float).unwrap()
                });
                let lp = model
                    .token_logprobs(&ids, None, cfg.generate.temperature)
                    .unwrap()
                    .view([-1]);
                let lp: Vec<f32> = Vec::try_from(lp.to_kind(tch::Kind::Float)).unwrap();
                if before.is_empty() {
                    before = lp.clone();
                }
                let older = u64::from(versions[0]) < v;
                for (t, _) in versions
                    .iter()
                    .enumerate()
                    .filter(|(_, &tv)| u64::from(tv) == v)
                {
                    let fresh = lp[prompt.len() + t - 1];
                    if older {
                        apart = apart.max((behaviour[t] - before[prompt.len() + t - 1]).abs());
                    }
                    assert!(
                        (behaviour[t] - fresh).abs() < 2e-3,
                        "row {i} token {t} (version {v}): behaviour log-prob {}, a fresh pass {fresh}",
                        behaviour[t]
                    );
                    compared += 1;
                }
            }
        }
    }
    // Steps 1, 2 and 3 start under the weights before theirs: two rows each.
    assert_eq!(swapped, 6, "weights landed mid-sequence in {swapped} rows");
    assert!(
        apart > 0.05,
        "the versions' log-probs differ by at most {apart}"
    );
    assert_eq!(compared, 6 * 64, "every token of the swapped rows compared");
}

#[test]
fn dynamic_sampling_waits_for_later_steps_up_to_its_bound_and_never_across_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("task.jsonl");
    let pairs: Vec<(u32, u32)> = (0..18).map(|i| (i % 5, i % 7)).collect();
    // Two prompts of every three are `uniform`: the reward gives all their
    // samples 0, so they are dropped; the `mixed` ones' samples get random
    // rewards, so they are always informative. A step's input thus brings
    // as many informative groups as it drew mixed prompts, often below the
    // target of two.
    write_arith_task(
        &prompts,
        &pairs,
        |i| serde_json::json!({"kind": if i % 3 < 2 { "uniform" } else { "mixed" }}),
    );
    let reward = tmp.path().join("reward.py");
    std::fs::write(
        &reward,
        "import random\n\
         def reward_func(queries, prompts, labels, kind, **rest):\n    \
         return [random.random() if k == 'mixed' else 0.0 for k in kind]\n",
    )
    .unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 6);
    cfg.data.prompts = weir::pipelines::config::Task::File(prompts.to_path_buf());
    cfg.data.messages_column = Some("messages".into());
    cfg.reward.kind = RewardKind::Python;
    cfg.reward.file = Some(reward.to_path_buf());
    cfg.run.max_staleness = 1;
    cfg.run.checkpoint_every = 3;
    cfg.dynamic_sampling.enabled = true;
    cfg.dynamic_sampling.target_groups = 2;
    cfg.dynamic_sampling.max_extra_batches = 1;
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let extra = metric(&dir, "dynamic_sampling", "extra_steps");
    let emitted = metric(&dir, "dynamic_sampling", "groups_emitted");
    assert_eq!(extra.len(), 6);
    // (step → input steps of its groups), from the rows: a group's id is its
    // input step × prompts per step + its place.
    let mut inputs: BTreeMap<u64, BTreeMap<u64, u64>> = BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let ids = u64s(&b, col::PROMPT_ID);
        for (i, (step, group)) in u64s(&b, col::STEP)
            .into_iter()
            .zip(u64s(&b, col::GROUP_ID))
            .enumerate()
        {
            assert_eq!(
                ids[i] % 3,
                2,
                "a uniform prompt's group trained at step {step}"
            );
            *inputs.entry(step).or_default().entry(group).or_default() = group / 3;
        }
    }
    let barrier = |s: u64| s % 3 == 2;
    let mut from_later = 0;
    for step in 0..6u64 {
        let groups = inputs.remove(&step).unwrap_or_default();
        assert_eq!(groups.len() as f64, emitted[&step], "step {step}");
        assert!(groups.len() <= 2, "step {step}: {groups:?}");
        let latest = groups.values().copied().max();
        if barrier(step) {
            // A checkpoint step (2, 5) takes no later step's groups.
            assert_eq!(extra[&step], 0.0, "step {step}");
            assert!(latest.is_none_or(|l| l <= step), "step {step}: {groups:?}");
        } else if extra[&step] == 0.0 {
            // It had its target without waiting.
            assert_eq!(groups.len(), 2, "step {step}: {groups:?}");
            assert!(latest.is_none_or(|l| l <= step), "step {step}: {groups:?}");
        } else {
            // It waited for one more input step, and no further.
            assert_eq!(extra[&step], 1.0, "step {step}");
            assert!(
                latest.is_none_or(|l| l <= step + 1),
                "step {step}: {groups:?}"
            );
            from_later += usize::from(latest == Some(step + 1));
        }
    }
    assert!(
        from_later > 0,
        "no step took a later step's group: {extra:?}"
    );
    // Without waiting a step trains on its own and earlier input steps.
    cfg.dynamic_sampling.max_extra_batches = 0;
    let plain = tmp.path().join("plain");
    run(kind, cfg, &plain, false);
    assert!(metric(&plain, "dynamic_sampling", "extra_steps").is_empty());
    for b in read_parquet_dir(&plain.join("rollouts")).unwrap() {
        for (step, group) in u64s(&b, col::STEP).into_iter().zip(u64s(&b, col::GROUP_ID)) {
            assert!(group / 3 <= step);
        }
    }
}
