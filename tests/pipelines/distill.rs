//! Distillation: the teacher's top k and GKD's term, and on-policy
//! distillation's per-token advantage.

use std::path::Path;

use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::col;
use weir::pipelines::config::TeacherPlacement;
use weir::pipelines::PipelineKind;

use super::support::{
    config, fixture, float_list_column, metric, metric_rows, reward_column, run, run_err, u64s,
};

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
