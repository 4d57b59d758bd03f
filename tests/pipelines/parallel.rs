//! Data-parallel learners: two ranks train like one worker, for GRPO,
//! PPO (its critic too), REINFORCE++ and GPG.

use std::collections::BTreeMap;
use std::path::Path;

use weir::graph::parquet_log::read_parquet_file;
use weir::pipelines::config::Aggregation;
use weir::pipelines::PipelineKind;

use super::support::{assert_curves_match, config, metric, metric_rows, request, run, run_err};

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
