//! Preference pipelines: the reward model learns its pairs, DPO grows
//! the margin.

use std::path::Path;

use weir::pipelines::config::PreferenceChoice;
use weir::pipelines::PipelineKind;

use super::support::{assert_curves_match, config, metric, run};

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
