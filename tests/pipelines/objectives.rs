//! The policy objectives and corrections through GRPO: each trains, and
//! each step's logged loss is its own objective's.

use std::collections::BTreeMap;

use arrow::array::AsArray;
use arrow::datatypes::Float32Type;
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::col;
use weir::pipelines::PipelineKind;

use super::support::{config, fixture, metric, run};

/// Every policy objective and correction trains through a pipeline: the
/// runs finish with finite losses, and each objective's losses are its own.
#[test]
fn every_policy_loss_and_correction_trains_through_grpo() {
    let tmp = tempfile::tempdir().unwrap();
    let mut losses: Vec<(String, BTreeMap<u64, f64>)> = Vec::new();
    for (name, items) in [
        ("ppo", &["algorithm.policy_loss=ppo"][..]),
        (
            "gspo",
            &[
                "algorithm.policy_loss=gspo",
                "algorithm.aggregation=\"seq-mean-token-mean\"",
            ],
        ),
        (
            "sapo",
            &[
                "algorithm.policy_loss=sapo",
                "algorithm.aggregation=\"seq-mean-token-mean\"",
            ],
        ),
        ("cispo", &["algorithm.policy_loss=cispo"]),
        ("gmpo", &["algorithm.policy_loss=gmpo"]),
        ("gpg", &["algorithm.policy_loss=gpg"]),
        (
            "reinforce",
            &["algorithm.policy_loss=reinforce", "run.max_staleness=1"],
        ),
        (
            "clip_cov",
            &[
                "algorithm.policy_loss=clip_cov",
                "algorithm.clip_cov_lb=-100",
            ],
        ),
        ("kl_cov", &["algorithm.policy_loss=kl_cov"]),
        ("dppo_tv", &["algorithm.policy_loss=dppo_tv"]),
        ("dppo_kl", &["algorithm.policy_loss=dppo_kl"]),
        ("dro", &["algorithm.policy_loss=dro"]),
        (
            "icepop",
            &["algorithm.correction=icepop", "run.max_staleness=1"],
        ),
        (
            "seq-mask",
            &["algorithm.correction=\"seq-mask\"", "run.max_staleness=1"],
        ),
        ("dual-clip", &["algorithm.dual_clip=2.0"]),
    ] {
        let mut items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        items.extend(["algorithm.ppo_epochs=2".into(), "algorithm.lr=0.01".into()]);
        let cfg = config(PipelineKind::Grpo, 2)
            .with_overrides(&items)
            .unwrap();
        let dir = tmp.path().join(name);
        run(PipelineKind::Grpo, cfg, &dir, false);
        let loss = metric(&dir, "learn", "loss");
        assert_eq!(loss.len(), 2, "{name}: {loss:?}");
        assert!(loss.values().all(|l| l.is_finite()), "{name}: {loss:?}");
        if name.contains('-') && !name.starts_with("dual") {
            assert_eq!(metric(&dir, "learn", "is_weight_mean").len(), 2, "{name}");
        }
        losses.push((name.to_string(), loss));
    }
    // The objectives differ from PPO's in their losses.
    let ppo = &losses[0].1;
    for (name, loss) in &losses[1..12] {
        assert!(
            loss.iter().any(|(s, l)| (l - ppo[s]).abs() > 1e-6),
            "{name} gives PPO's losses: {loss:?}"
        );
    }
}

/// Each `algorithm.policy_loss` trains its own objective: one step's logged
/// loss equals the objective function (held to verl's outputs by the
/// operators' tests) on the logged rows, with the step's log-probs from an
/// independent forward pass of the starting checkpoint. At the first update
/// the ratio is 1, so the objectives fall into classes that this tells
/// apart: PPO's −A (GSPO and GMPO coincide with it there), −A·log π (CISPO,
/// GPG, DPPO and DRO), SAPO's gate and REINFORCE's weight π / π_behaviour.
#[test]
fn each_policy_loss_trains_its_own_objective() {
    use tch::{Kind, Tensor};
    use weir::operators::algorithms::{
        policy_loss, Aggregation, GateDivergence, PolicyLossConfig, PolicyObjective,
    };
    let tmp = tempfile::tempdir().unwrap();
    let model =
        weir::gpu::Model::load(&fixture("arith-sft"), weir::gpu::Device::Cpu, Kind::Float).unwrap();
    for (name, objective, aggregation) in [
        ("ppo", PolicyObjective::Clipped, Aggregation::TokenMean),
        ("cispo", PolicyObjective::Cispo, Aggregation::TokenMean),
        (
            "sapo",
            PolicyObjective::Sapo {
                tau_pos: 1.0,
                tau_neg: 1.05,
            },
            Aggregation::SeqMeanTokenMean,
        ),
        (
            "gpg",
            PolicyObjective::PolicyGradient,
            Aggregation::TokenMean,
        ),
        (
            "reinforce",
            PolicyObjective::Reinforce { cap: 2.0 },
            Aggregation::TokenMean,
        ),
        // At ratio 1 no token has moved: DPPO keeps every token, −A·log π.
        (
            "dppo_tv",
            PolicyObjective::Dppo {
                divergence: GateDivergence::Tv,
                cap: 20.0,
            },
            Aggregation::TokenMean,
        ),
        (
            "dppo_kl",
            PolicyObjective::Dppo {
                divergence: GateDivergence::BinaryKl,
                cap: 20.0,
            },
            Aggregation::TokenMean,
        ),
        // DRO's penalty is 0 at ratio 1: −A·log π.
        (
            "dro",
            PolicyObjective::Dro { beta: 0.05 },
            Aggregation::TokenMean,
        ),
    ] {
        let mut cfg = config(PipelineKind::Grpo, 1);
        cfg.algorithm.kl_coef = 0.0;
        cfg.algorithm.micro_batch = 64;
        let mut items = vec![format!("algorithm.policy_loss={name}")];
        if aggregation == Aggregation::SeqMeanTokenMean {
            items.push("algorithm.aggregation=\"seq-mean-token-mean\"".into());
        }
        let cfg = cfg.with_overrides(&items).unwrap();
        let dir = tmp.path().join(name);
        run(PipelineKind::Grpo, cfg.clone(), &dir, false);
        let logged = metric(&dir, "learn", "loss")[&0];
        // The step's rows, padded to the longest response.
        let (mut contexts, mut responses, mut behaviour, mut advantages) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
            let list = |c: &str| b.column_by_name(c).unwrap().as_list::<i32>().clone();
            let (p, r, h, a) = (
                list(col::PROMPT_TOKENS),
                list(col::RESPONSE_TOKENS),
                list(col::BEHAVIOR_LOGPROBS),
                list(col::ADVANTAGES),
            );
            for i in 0..b.num_rows() {
                let ints = |x: arrow::array::ArrayRef| {
                    x.as_primitive::<arrow::datatypes::Int64Type>()
                        .values()
                        .to_vec()
                };
                let floats =
                    |x: arrow::array::ArrayRef| x.as_primitive::<Float32Type>().values().to_vec();
                contexts.push(ints(p.value(i)));
                responses.push(ints(r.value(i)));
                behaviour.push(floats(h.value(i)));
                advantages.push(floats(a.value(i)));
            }
        }
        let width = responses.iter().map(Vec::len).max().unwrap();
        let padded = |rows: Vec<Vec<f32>>| {
            let flat: Vec<f32> = rows
                .into_iter()
                .flat_map(|mut r| {
                    r.resize(width, 0.0);
                    r
                })
                .collect();
            Tensor::from_slice(&flat)
                .view([-1, width as i64])
                .to_kind(Kind::Double)
        };
        let current: Vec<Vec<f32>> = contexts
            .iter()
            .zip(&responses)
            .map(|(prompt, response)| {
                let ids: Vec<i64> = prompt.iter().chain(response).copied().collect();
                let n = ids.len() as i64;
                let lp = model
                    .token_logprobs(
                        &Tensor::from_slice(&ids).view([1, n]),
                        None,
                        cfg.generate.temperature,
                    )
                    .unwrap()
                    .get(0)
                    .narrow(0, n - 1 - response.len() as i64, response.len() as i64);
                Vec::<f32>::try_from(lp.to_kind(Kind::Float)).unwrap()
            })
            .collect();
        let mask = padded(responses.iter().map(|r| vec![1.0; r.len()]).collect());
        let logprobs = padded(current);
        let out = policy_loss(
            &logprobs,
            &logprobs.detach(),
            &padded(advantages),
            &mask,
            Some(&padded(behaviour)),
            &PolicyLossConfig {
                objective,
                aggregation,
                ..PolicyLossConfig::default()
            },
        );
        let want = out.loss_value();
        assert!(
            (logged - want).abs() <= 1e-4 * want.abs().max(1e-2),
            "{name}: the learner's loss {logged}, the objective's {want}"
        );
    }
}
