//! Rewards through whole runs: a Python file, a remote server, weighted
//! terms, one registered in Rust, a reward model with its own tokenizer.

use std::collections::BTreeMap;

use arrow::array::AsArray;
use weir::operators::rollout::col;
use weir::pipelines::config::RewardKind;
use weir::pipelines::runner::read_resolved;
use weir::pipelines::PipelineKind;

use super::support::{
    config, fixture, metric, reward_column, reward_server, run, run_err, scored_rows, step_means,
    text_column, write_arith_task,
};

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
