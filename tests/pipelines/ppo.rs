//! PPO: packed sequences train like padded micro-batches.

use weir::pipelines::PipelineKind;

use super::support::{config, metric, run};

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
