//! Prompt sets through whole runs: a verl dataset in Parquet, held-out
//! prompts evaluated during training.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use weir::operators::rollout::col;
use weir::pipelines::PipelineKind;

use super::support::{
    config, fixture, metric, metric_rows, reward_column, run, run_err, step_means, text_column,
    u64s, write_arith_task,
};

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
