//! The group-relative family beyond plain GRPO: GDPO's per-term
//! normalisation, the optimal token baseline's `Σ π²`, and GRPO with LoRA
//! adapters (trained, resumed and merged).

use std::collections::BTreeMap;
use std::path::Path;

use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::col;
use weir::pipelines::config::Aggregation;
use weir::pipelines::runner::read_resolved;
use weir::pipelines::PipelineKind;

use super::support::{
    assert_curves_match, check_otb, config, fixture, float_rows, metric, request, run, run_err,
    u64s,
};

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
