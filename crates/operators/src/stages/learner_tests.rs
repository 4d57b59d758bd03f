//! The learner's tests: entropy bonus, shared prompts and gradient
//! checkpointing, data-parallel ranks, schedules.

use super::*;
use crate::algorithms::Flavor;
use crate::data::columns::float_lists;
use crate::data::columns::{float_list_array, token_list_array};
use crate::training::learn_rows::budget_cuts;

/// A learner's input: prompts, responses, per-token advantages and behaviour log-probs.
fn learn_rows(
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    advantages: &[Vec<f64>],
    behaviour: &[Vec<f64>],
) -> RecordBatch {
    RecordBatch::try_from_iter([
        (col::PROMPT_TOKENS, token_list_array(prompts)),
        (col::RESPONSE_TOKENS, token_list_array(responses)),
        (col::ADVANTAGES, float_list_array(advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(behaviour)),
    ])
    .unwrap()
}

fn entropy_after_two_updates(coef: f64) -> (f64, f64) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-llama");
    let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
    let mut cfg = LearnerConfig {
        entropy_coef: coef,
        ..LearnerConfig::default()
    };
    cfg.adamw.lr = 1e-2;
    cfg.adamw.weight_decay = 0.0;
    let mut learner = Learner::new(model, cfg).unwrap();
    let responses = vec![vec![5i64, 6, 7], vec![8, 9]];
    let zeros: Vec<Vec<f64>> = responses.iter().map(|r| vec![0.0; r.len()]).collect();
    let batch = learn_rows(&[vec![1, 2], vec![1, 3, 4]], &responses, &zeros, &zeros);
    let first = learner.update(&batch).unwrap();
    let second = learner.update(&batch).unwrap();
    assert!(first.loss.is_finite() && first.entropy > 0.0);
    (first.entropy, second.entropy)
}

#[test]
fn the_entropy_bonus_moves_entropy_its_way() {
    // Zero advantages: the policy term has no gradient; only the bonus moves the weights.
    let (before, up) = entropy_after_two_updates(0.5);
    let (same, down) = entropy_after_two_updates(-0.5);
    assert_eq!(
        before, same,
        "the entropy before any update does not depend on the coefficient"
    );
    assert!(up > before + 1e-4, "{before} → {up}");
    assert!(down < before - 1e-4, "{before} → {down}");
}

/// Two updates agree: each pair of figures to 1e-5 (relative past 1), every
/// weight to 1e-4 (a wrong gradient would move weights by ~lr = 1e-2).
fn assert_same_update(
    what: &str,
    figures: &[(f64, f64)],
    weights: &[(String, Tensor)],
    other: &[(String, Tensor)],
) {
    for &(a, b) in figures {
        assert!(
            (a - b).abs() < 1e-5 * a.abs().max(1.0),
            "{what}: {a} vs {b}"
        );
    }
    for ((name, a), (_, b)) in weights.iter().zip(other) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d < 1e-4, "{what}: {name} differs by {d:e}");
    }
}

#[test]
fn shared_prompts_gradient_checkpointing_and_a_chunked_head_give_the_same_updates() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-qwen2");
    let responses = vec![vec![5i64, 6, 7], vec![8, 9], vec![10]];
    let advantages = vec![vec![1.0; 3], vec![-0.5; 2], vec![0.25]];
    let behaviour: Vec<Vec<f64>> = responses.iter().map(|r| vec![-2.0; r.len()]).collect();
    let batch = RecordBatch::try_from_iter([
        (
            col::PROMPT_TOKENS,
            // A repeated prompt: the plain pass runs it once
            // (`Model::response_logits`), the checkpointed one per row.
            token_list_array(&[vec![1, 2], vec![1, 3, 4], vec![1, 2]]),
        ),
        (col::RESPONSE_TOKENS, token_list_array(&responses)),
        (col::ADVANTAGES, float_list_array(&advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(&behaviour)),
    ])
    .unwrap();
    let run_at = |checkpointed: bool, chunk: usize, temperature: f64, flavor: Flavor, epochs| {
        let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        let mut cfg = LearnerConfig {
            entropy_coef: 0.1,
            micro_batch: 2,
            ppo_epochs: epochs,
            gradient_checkpointing: checkpointed,
            logprob_chunk: chunk,
            temperature,
            ..LearnerConfig::default()
        };
        cfg.policy.flavor = flavor;
        cfg.adamw.lr = 1e-2;
        // Rounding-level gradients (a key bias's is 0 up to rounding:
        // softmax ignores a shift shared by all keys) take rounding-level
        // steps, not ~lr·g/(g + ε) ones that differ with the rounding.
        cfg.adamw.eps = 1e-6;
        let mut learner = Learner::new(model, cfg).unwrap();
        let stats = learner.update(&batch).unwrap();
        (stats, learner.model().named_tensors())
    };
    // At temperature 1, and at 0.7 under both flavors (OpenRLHF's entropy
    // is on the raw logits, verl's at the temperature: the chunked head's
    // gradient takes each its way).
    for (temperature, flavor) in [
        (1.0, Flavor::OpenRlhf),
        (0.7, Flavor::OpenRlhf),
        (0.7, Flavor::Verl),
    ] {
        let run = |checkpointed, chunk| run_at(checkpointed, chunk, temperature, flavor, 2);
        let (plain, plain_weights) = run(false, 0);
        assert!(plain.grad_norm > 0.0);
        // Checkpointed; the output head two positions at a time (the log-probs,
        // the entropy and their gradient through the head chunk by chunk), with
        // and without checkpointing.
        for (checkpointed, chunk) in [(true, 0), (false, 2), (true, 2), (false, 1)] {
            let (other, weights) = run(checkpointed, chunk);
            assert_same_update(
                &format!("T {temperature} {flavor:?}: checkpointed {checkpointed}, chunk {chunk}"),
                &[
                    (plain.loss, other.loss),
                    (plain.grad_norm, other.grad_norm),
                    (plain.entropy, other.entropy),
                ],
                &plain_weights,
                &weights,
            );
        }
    }
    // One pass measures the entropy before its step: OpenRLHF's at 0.7 is
    // the raw logits' (as at temperature 1), verl's the sharper one's.
    let entropy = |temperature, flavor| run_at(false, 2, temperature, flavor, 1).0.entropy;
    let raw = entropy(1.0, Flavor::Verl);
    assert!((entropy(0.7, Flavor::OpenRlhf) - raw).abs() < 1e-9 * raw);
    assert!(entropy(0.7, Flavor::Verl) < raw - 1e-3, "{raw}");
}

#[test]
fn one_update_takes_its_proximal_logprobs_from_the_training_forward() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-llama");
    let responses = vec![vec![5i64, 6, 7], vec![8, 9], vec![10, 11, 12, 13]];
    let advantages = vec![vec![1.0; 3], vec![-0.5; 2], vec![0.25; 4]];
    // Behaviour log-probs apart from the policy's: the correction's weights
    // (proximal over behaviour) spread, some clamped.
    let behaviour: Vec<Vec<f64>> = responses
        .iter()
        .map(|r| (0..r.len()).map(|t| -4.0 - t as f64).collect())
        .collect();
    let batch = learn_rows(
        &[vec![1, 2], vec![1, 3, 4], vec![1, 2]],
        &responses,
        &advantages,
        &behaviour,
    );
    let run = |pass: bool, checkpointed: bool, chunk: usize| {
        let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        let mut cfg = LearnerConfig {
            micro_batch: 2,
            gradient_checkpointing: checkpointed,
            logprob_chunk: chunk,
            ..LearnerConfig::default()
        };
        cfg.policy.correction = Some(crate::algorithms::ImportanceCorrection::Tis {
            low: 0.5,
            high: 2.0,
        });
        cfg.adamw.lr = 1e-2;
        cfg.adamw.eps = 1e-6;
        let mut learner = Learner::new(model, cfg).unwrap();
        learner.proximal_pass_always = pass;
        let stats = learner.update(&batch).unwrap();
        (stats, learner.model().named_tensors())
    };
    for (checkpointed, chunk) in [(false, 0), (true, 0), (false, 2)] {
        let (with_pass, pass_weights) = run(true, checkpointed, chunk);
        let (reused, weights) = run(false, checkpointed, chunk);
        assert!(with_pass.grad_norm > 0.0);
        // The ratio is 1 at the one update: nothing is clipped.
        assert_eq!(reused.clip_fraction, 0.0);
        assert_eq!(with_pass.clip_fraction, 0.0);
        let (w, v) = (
            with_pass.importance_weights.unwrap(),
            reused.importance_weights.unwrap(),
        );
        assert_same_update(
            &format!("checkpointed {checkpointed}, chunk {chunk}"),
            &[
                (with_pass.loss, reused.loss),
                (with_pass.grad_norm, reused.grad_norm),
                (w.mean, v.mean),
                (w.max, v.max),
            ],
            &pass_weights,
            &weights,
        );
    }
}

#[test]
fn data_parallel_ranks_train_like_one_learner_on_all_rows() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-llama");
    let responses = vec![vec![5i64, 6, 7], vec![8, 9], vec![10], vec![11, 12, 13, 14]];
    let advantages = vec![vec![1.0; 3], vec![-0.5; 2], vec![0.25], vec![-1.0; 4]];
    let behaviour: Vec<Vec<f64>> = responses.iter().map(|r| vec![-2.0; r.len()]).collect();
    let reference: Vec<Vec<f64>> = responses.iter().map(|r| vec![-1.5; r.len()]).collect();
    let batch = RecordBatch::try_from_iter([
        (
            col::PROMPT_TOKENS,
            token_list_array(&[vec![1, 2], vec![1, 3, 4], vec![1, 2], vec![7]]),
        ),
        (col::RESPONSE_TOKENS, token_list_array(&responses)),
        (col::ADVANTAGES, float_list_array(&advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(&behaviour)),
        (col::REF_LOGPROBS, float_list_array(&reference)),
        (
            col::REWARD,
            std::sync::Arc::new(arrow::array::Float32Array::from(vec![1.0, 0.0, 0.5, 0.25]))
                as arrow::array::ArrayRef,
        ),
    ])
    .unwrap();
    let learner = || {
        let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        let mut cfg = LearnerConfig {
            entropy_coef: 0.1,
            kl_coef: 0.05,
            micro_batch: 2,
            ppo_epochs: 2,
            ..LearnerConfig::default()
        };
        cfg.policy.aggregation = crate::algorithms::Aggregation::TokenMean;
        cfg.adamw.lr = 1e-2;
        Learner::new(model, cfg).unwrap()
    };
    let mut one = learner();
    let alone = one.update(&batch).unwrap();
    // Rows 0–1 on rank 0, 2–3 on rank 1, none on rank 2.
    let group = weir_gpu::collective::HostGroup::new(3);
    let shares = [Some(batch.slice(0, 2)), Some(batch.slice(2, 2)), None];
    let ranks: Vec<_> = shares
        .into_iter()
        .enumerate()
        .map(|(rank, rows)| {
            let (l, member) = (learner(), group.member(rank));
            std::thread::spawn(move || {
                let mut l = l.with_data_parallel(member).unwrap();
                let stats = l.update_rows(rows.as_ref(), "learn").unwrap();
                let weights: Vec<Vec<f32>> = l
                    .model()
                    .named_tensors()
                    .iter()
                    .map(|(_, t)| Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
                    .collect();
                (stats, weights)
            })
        })
        .collect();
    let ranks: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    let (stats, weights) = &ranks[0];
    assert!(
        ranks.iter().all(|(s, w)| s == stats && w == weights),
        "the ranks agree bit for bit"
    );
    assert!(alone.grad_norm > 0.0 && alone.kl != 0.0);
    for (name, a, b) in [
        ("loss", alone.loss, stats.loss),
        ("grad_norm", alone.grad_norm, stats.grad_norm),
        ("kl", alone.kl, stats.kl),
        ("entropy", alone.entropy, stats.entropy),
        ("clip_fraction", alone.clip_fraction, stats.clip_fraction),
        (
            "response_length",
            alone.response_length,
            stats.response_length,
        ),
    ] {
        assert!(
            (a - b).abs() < 1e-5 * a.abs().max(1.0),
            "{name}: {a} vs {b}"
        );
    }
    assert_eq!(alone.reward, Some(0.4375));
    assert_eq!(stats.reward, alone.reward);
    for ((name, a), b) in one.model().named_tensors().iter().zip(weights) {
        let a = Vec::<f32>::try_from(&a.reshape([-1])).unwrap();
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-4, "{name} differs by {d:e}");
    }
}

/// Four rows with uneven lengths (one empty response) and per-token advantages.
fn uneven_batch(copies: usize) -> RecordBatch {
    let responses = [
        vec![5i64, 6, 7],
        vec![8, 9],
        vec![],
        vec![11, 12, 13, 14, 15],
    ];
    let advantages = [
        vec![1.0, -0.5, 0.3],
        vec![-0.5; 2],
        vec![],
        vec![-1.0, 0.5, 2.0, -0.25, 0.75],
    ];
    let prompts = [vec![1i64, 2], vec![1, 3, 4], vec![1, 2], vec![7]];
    fn rep<T: Clone>(x: &[T], copies: usize) -> Vec<T> {
        (0..copies).flat_map(|_| x.iter().cloned()).collect()
    }
    let behaviour: Vec<Vec<f64>> = responses.iter().map(|r| vec![-2.0; r.len()]).collect();
    let reference: Vec<Vec<f64>> = responses.iter().map(|r| vec![-1.5; r.len()]).collect();
    RecordBatch::try_from_iter([
        (col::PROMPT_TOKENS, token_list_array(&rep(&prompts, copies))),
        (
            col::RESPONSE_TOKENS,
            token_list_array(&rep(&responses, copies)),
        ),
        (col::ADVANTAGES, float_list_array(&rep(&advantages, copies))),
        (
            col::BEHAVIOR_LOGPROBS,
            float_list_array(&rep(&behaviour, copies)),
        ),
        (
            col::REF_LOGPROBS,
            float_list_array(&rep(&reference, copies)),
        ),
    ])
    .unwrap()
}

fn aggregation_learner(aggregation: crate::algorithms::Aggregation, micro_batch: usize) -> Learner {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-llama");
    let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
    let mut cfg = LearnerConfig {
        entropy_coef: 0.1,
        kl_coef: 0.05,
        micro_batch,
        // No clipping: the gradient norm shows the gradient's scale.
        max_grad_norm: None,
        ..LearnerConfig::default()
    };
    cfg.policy.aggregation = aggregation;
    cfg.policy.flavor = crate::algorithms::Flavor::Verl;
    Learner::new(model, cfg).unwrap()
}

const AGGREGATIONS: [crate::algorithms::Aggregation; 5] = [
    crate::algorithms::Aggregation::TokenMean,
    crate::algorithms::Aggregation::SeqMeanTokenMean,
    crate::algorithms::Aggregation::SeqMeanTokenSum,
    crate::algorithms::Aggregation::SeqMeanTokenSumNorm,
    crate::algorithms::Aggregation::TokenSum,
];

#[test]
fn every_aggregation_gives_one_step_however_it_is_split() {
    let batch = uneven_batch(1);
    for mode in AGGREGATIONS {
        let whole = aggregation_learner(mode, 4).update(&batch).unwrap();
        let micro = aggregation_learner(mode, 1).update(&batch).unwrap();
        // Sorted by width (3, 5, 5, 6) and cut at 10 padded tokens: {2, 0}, {1}, {3}.
        let budgeted = {
            let mut l = aggregation_learner(mode, 4);
            l.cfg.micro_batch_tokens = 10;
            l.update(&batch).unwrap()
        };
        // Two ranks: row 0 on rank 0, rows 1–3 on rank 1 (its micro-batches of 2).
        let group = weir_gpu::collective::HostGroup::new(2);
        let ranks: Vec<_> = [batch.slice(0, 1), batch.slice(1, 3)]
            .into_iter()
            .enumerate()
            .map(|(rank, rows)| {
                let (l, member) = (aggregation_learner(mode, 2), group.member(rank));
                std::thread::spawn(move || {
                    let mut l = l.with_data_parallel(member).unwrap();
                    l.update(&rows).unwrap()
                })
            })
            .collect();
        let ranks: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert!(whole.grad_norm > 0.0);
        for (how, other) in [
            ("4 micro-batches", micro),
            ("a token budget", budgeted),
            ("2 ranks", ranks[0]),
        ] {
            for (name, a, b) in [
                ("loss", whole.loss, other.loss),
                ("grad_norm", whole.grad_norm, other.grad_norm),
                ("kl", whole.kl, other.kl),
                ("entropy", whole.entropy, other.entropy),
            ] {
                assert!(
                    (a - b).abs() < 1e-5 * a.abs().max(1.0),
                    "{mode:?}, {how}: {name} {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn mini_batches_are_optimizer_steps_that_ranks_share() {
    let batch = uneven_batch(1);
    let learner = || {
        let mut l = aggregation_learner(crate::algorithms::Aggregation::TokenMean, 4);
        l.cfg.mini_batches = 2;
        // The second mini-batch starts after an Adam step, which moves even
        // rounding-level gradients by ~lr (at lr = 0.05 the two layouts differ
        // by 2e-4 in the second mini-batch's loss; at 1e-3 by 1.5e-5 in its
        // gradient norm on some CPUs; at 1e-4, by rounding).
        l.cfg.adamw.lr = 1e-4;
        l
    };
    // Ranks take rows {0, 1} and {2, 3}; their mini-batches are {0, 2} and {1, 3}.
    let order = arrow::array::UInt32Array::from(vec![0, 2, 1, 3]);
    let reordered = arrow::compute::take_record_batch(&batch, &order).unwrap();
    let alone = learner().update(&reordered).unwrap();
    let group = weir_gpu::collective::HostGroup::new(2);
    let ranks: Vec<_> = [batch.slice(0, 2), batch.slice(2, 2)]
        .into_iter()
        .enumerate()
        .map(|(rank, rows)| {
            let (l, member) = (learner(), group.member(rank));
            std::thread::spawn(move || l.with_data_parallel(member).unwrap().update(&rows).unwrap())
        })
        .collect();
    let ranks: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
    for (name, a, b) in [
        ("loss", alone.loss, ranks[0].loss),
        ("grad_norm", alone.grad_norm, ranks[0].grad_norm),
        ("entropy", alone.entropy, ranks[0].entropy),
    ] {
        assert!(
            (a - b).abs() < 1e-5 * a.abs().max(1.0),
            "{name}: {a} vs {b}"
        );
    }
    // The second mini-batch starts from the first one's update: one mini-batch differs.
    let mut whole = learner();
    whole.cfg.mini_batches = 1;
    let once = whole.update(&reordered).unwrap();
    assert!(
        (once.loss - alone.loss).abs() > 1e-6,
        "{} vs {}",
        once.loss,
        alone.loss
    );
}

#[test]
fn a_larger_batch_of_the_same_rows_is_the_same_step_except_for_token_sum() {
    // Dr.GRPO's normaliser included: Σ / (N · T) does not grow with the batch.
    for mode in AGGREGATIONS {
        let once = aggregation_learner(mode, 4)
            .update(&uneven_batch(1))
            .unwrap();
        let twice = aggregation_learner(mode, 4)
            .update(&uneven_batch(2))
            .unwrap();
        let factor = match mode {
            crate::algorithms::Aggregation::TokenSum => 2.0,
            crate::algorithms::Aggregation::TokenMean
            | crate::algorithms::Aggregation::SeqMeanTokenMean
            | crate::algorithms::Aggregation::SeqMeanTokenSum
            | crate::algorithms::Aggregation::SeqMeanTokenSumNorm => 1.0,
        };
        for (name, a, b) in [
            ("loss", once.loss, twice.loss),
            ("grad_norm", once.grad_norm, twice.grad_norm),
        ] {
            assert!(
                (a * factor - b).abs() < 1e-5 * b.abs().max(1.0),
                "{mode:?}: {name} {a} vs {b}"
            );
        }
    }
}

#[test]
fn a_mistyped_reward_column_is_an_error() {
    let batch = uneven_batch(1);
    let schema = batch.schema();
    let mut columns: Vec<(&str, arrow::array::ArrayRef)> = schema
        .fields()
        .iter()
        .zip(batch.columns())
        .map(|(f, c)| (f.name().as_str(), c.clone()))
        .collect();
    columns.push((
        col::REWARD,
        std::sync::Arc::new(arrow::array::StringArray::from(vec!["1"; 4])),
    ));
    let batch = RecordBatch::try_from_iter(columns).unwrap();
    let err = aggregation_learner(crate::algorithms::Aggregation::TokenMean, 4)
        .update(&batch)
        .unwrap_err()
        .to_string();
    assert!(err.contains(col::REWARD), "{err}");
}

#[test]
fn schedules_warm_up_then_hold_or_decay() {
    let c = LrSchedule::Constant { warmup: 4 };
    assert_eq!(c.rate(1.0, 0), 0.25);
    assert_eq!(c.rate(1.0, 3), 1.0);
    assert_eq!(c.rate(1.0, 100), 1.0);
    let cos = LrSchedule::Cosine {
        warmup: 2,
        total: 12,
        min_ratio: 0.1,
    };
    assert_eq!(cos.rate(2.0, 0), 1.0);
    assert!(
        (cos.rate(2.0, 2) - 2.0).abs() < 1e-12,
        "decay starts at the base rate"
    );
    assert!(
        (cos.rate(2.0, 7) - (0.2 + 1.8 * 0.5)).abs() < 1e-12,
        "halfway"
    );
    assert!((cos.rate(2.0, 12) - 0.2).abs() < 1e-12 && (cos.rate(2.0, 50) - 0.2).abs() < 1e-12);
}

#[test]
fn a_token_budget_cuts_sorted_rows_into_padded_micro_batches() {
    // Rows of widths 3, 5, 5, 6 under 10 tokens: 2 × 5, then 1 × 5 (2 × 6 = 12), then 6.
    assert_eq!(
        budget_cuts(&[3, 5, 5, 6], 4, 10),
        vec![(0, 2), (2, 3), (3, 4)]
    );
    // The row cap still holds under a large budget.
    assert_eq!(
        budget_cuts(&[1, 1, 1, 1, 1], 2, 1000),
        vec![(0, 2), (2, 4), (4, 5)]
    );
    // A row wider than the budget goes alone; nothing is lost.
    assert_eq!(
        budget_cuts(&[2, 50, 60], 8, 10),
        vec![(0, 1), (1, 2), (2, 3)]
    );
    assert_eq!(budget_cuts(&[], 8, 10), Vec::<(usize, usize)>::new());
    // A long tail: 28 short rows and 4 long ones pad to 28 × 8 + 4 × 256, not 32 × 256.
    let mut widths = vec![8; 28];
    widths.extend([256; 4]);
    let cuts = budget_cuts(&widths, 32, 1024);
    let padded: usize = cuts.iter().map(|&(a, b)| (b - a) * widths[b - 1]).sum();
    assert_eq!(padded, 28 * 8 + 4 * 256);
}

/// The KL and entropy terms beside the policy loss: verl aggregates them
/// as the policy loss (`loss_agg_mode`), OpenRLHF always as a token mean
/// over the step (its `aggregate_loss` default). With zero advantages the
/// loss is those terms alone.
#[test]
fn openrlhf_aggregates_the_kl_and_entropy_terms_as_a_token_mean() {
    let batch = uneven_batch(1);
    let zeros: Vec<Vec<f64>> = float_lists(&batch, col::ADVANTAGES, "t")
        .unwrap()
        .iter()
        .map(|r| vec![0.0; r.len()])
        .collect();
    let batch =
        weir_graph::batch::with_column(&batch, col::ADVANTAGES, float_list_array(&zeros)).unwrap();
    let loss = |flavor, mode| {
        let mut l = aggregation_learner(mode, 4);
        l.cfg.policy.flavor = flavor;
        l.update(&batch).unwrap().loss
    };
    use crate::algorithms::{Aggregation, Flavor};
    let token = loss(Flavor::OpenRlhf, Aggregation::TokenMean);
    let sequence = loss(Flavor::OpenRlhf, Aggregation::SeqMeanTokenMean);
    assert!(token.abs() > 1e-4, "{token}");
    assert!((token - sequence).abs() < 1e-6, "{token} vs {sequence}");
    let token = loss(Flavor::Verl, Aggregation::TokenMean);
    let sequence = loss(Flavor::Verl, Aggregation::SeqMeanTokenMean);
    assert!((token - sequence).abs() > 1e-4, "{token} vs {sequence}");
}

/// `uneven_batch(1)` as an episode: row 0's middle token and row 3's third
/// and fourth are an observation and a boundary (`token_kinds`); rows 1
/// and 2 are all generated (null rows). With `scramble`, every per-token
/// input of those tokens (advantage, behaviour and reference log-probs)
/// holds values no loss could ignore.
fn episode_batch(scramble: bool) -> RecordBatch {
    use crate::rollout::TokenKind::{Boundary, Generated, Observation};
    let batch = uneven_batch(1);
    let kinds = vec![
        Some(vec![Generated, Observation, Generated]),
        None,
        None,
        Some(vec![Generated, Generated, Boundary, Observation, Generated]),
    ];
    let mut columns: Vec<(&str, arrow::array::ArrayRef)> = Vec::new();
    for (name, at) in [
        (col::ADVANTAGES, 40.0),
        (col::BEHAVIOR_LOGPROBS, -30.0),
        (col::REF_LOGPROBS, 5.0),
    ] {
        let mut rows = crate::data::columns::float_lists(&batch, name, "test").unwrap();
        if scramble {
            rows[0][1] = at;
            rows[3][2] = -at;
            rows[3][3] = at;
        }
        columns.push((name, float_list_array(&rows)));
    }
    let mut batch = batch;
    for (name, column) in columns {
        batch = weir_graph::batch::with_column(&batch, name, column).unwrap();
    }
    weir_graph::batch::with_column(
        &batch,
        col::TOKEN_KINDS,
        crate::data::columns::token_kinds_array(&kinds),
    )
    .unwrap()
}

#[test]
fn an_episodes_observation_and_boundary_tokens_are_in_no_loss_and_no_count() {
    for mode in AGGREGATIONS {
        let update = |batch: &RecordBatch| {
            let mut learner = aggregation_learner(mode, 4);
            let stats = learner.update(batch).unwrap();
            (stats, learner.model().named_tensors())
        };
        let (plain, plain_weights) = update(&episode_batch(false));
        let (scrambled, scrambled_weights) = update(&episode_batch(true));
        assert!(plain.grad_norm > 0.0);
        // Whatever the observation and boundary tokens carry, the update is the same ...
        assert_same_update(
            &format!("{mode:?}"),
            &[
                (plain.loss, scrambled.loss),
                (plain.grad_norm, scrambled.grad_norm),
                (plain.kl, scrambled.kl),
                (plain.entropy, scrambled.entropy),
                (plain.clip_fraction, scrambled.clip_fraction),
            ],
            &plain_weights,
            &scrambled_weights,
        );
        // ... and the counts are the generated tokens': (2 + 2 + 0 + 3) / 4
        // (slime#365 normalised a multi-turn loss by every token's count).
        assert_eq!(plain.response_length, 1.75, "{mode:?}");
        // Without token_kinds, the same rows train on every token.
        let all = uneven_batch(1);
        let (every, _) = update(&all);
        assert_eq!(every.response_length, 2.5);
        assert!(
            (every.grad_norm - plain.grad_norm).abs() > 1e-6 * plain.grad_norm,
            "{mode:?}: the mask changes nothing"
        );
    }
}

#[test]
fn batch_normalised_weights_average_one_and_divide_the_loss() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-llama");
    let responses = vec![vec![5i64, 6, 7], vec![8, 9], vec![10, 11]];
    let advantages = vec![vec![1.0; 3], vec![-0.5; 2], vec![0.75; 2]];
    // Behaviour log-probs far from the policy's: weights well away from 1.
    let behaviour = vec![vec![-1.0, -0.5, -1.5], vec![-0.5, -1.0], vec![-2.0, -1.0]];
    let batch = learn_rows(
        &[vec![1, 2], vec![1, 3, 4], vec![1, 2]],
        &responses,
        &advantages,
        &behaviour,
    );
    let run = |normalize: bool| {
        let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        let mut cfg = LearnerConfig {
            micro_batch: 2,
            normalize_weights: normalize,
            ..LearnerConfig::default()
        };
        cfg.policy.correction = Some(crate::algorithms::ImportanceCorrection::Tis {
            low: 0.0,
            high: 1e6,
        });
        let mut learner = Learner::new(model, cfg).unwrap();
        // Both through the proximal pass, so that only the normaliser differs.
        learner.proximal_pass_always = true;
        let stats = learner.update(&batch).unwrap();
        let recorded: std::collections::BTreeMap<_, _> =
            learner.update_metrics().into_iter().collect();
        (stats, recorded)
    };
    let (plain, plain_metrics) = run(false);
    let (normal, metrics) = run(true);
    let normalizer = metrics["is_weight_normalizer"];
    assert!(!plain_metrics.contains_key("is_weight_normalizer"));
    let plain_mean = plain.importance_weights.unwrap().mean;
    // The normaliser is the weights' mean over the step's tokens: after it, they average 1.
    assert!(
        (normalizer - plain_mean).abs() < 1e-6 * plain_mean,
        "{normalizer} vs {plain_mean}"
    );
    assert!((normalizer - 1.0).abs() > 0.5, "{normalizer}");
    let mean = normal.importance_weights.unwrap().mean;
    assert!((mean - 1.0).abs() < 1e-6, "{mean}");
    // The token-mean policy loss is linear in the weights (to float32 rounding
    // of a loss 500 times smaller).
    assert!(
        (normal.loss - plain.loss / normalizer).abs() < 1e-3 * normal.loss.abs(),
        "{} vs {} / {normalizer}",
        normal.loss,
        plain.loss
    );
}

#[test]
fn packed_rows_train_like_padded_ones() {
    use crate::algorithms::Aggregation;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-qwen2");
    // Lengths far apart (a long prompt with a one-token answer, a short one
    // with a long answer), repeated prompts, an empty response.
    let prompts = vec![
        vec![1i64, 2, 3, 4, 5, 6, 7, 8, 9],
        vec![1, 3],
        vec![1, 3],
        vec![7],
        vec![2, 4, 6],
        vec![2, 4, 6],
    ];
    // Packed, the rows sharing a micro-batch and a prompt run it once
    // (one of them with an empty response).
    let responses = vec![
        vec![5i64],
        vec![8, 9, 10, 11, 12, 13, 14, 15],
        vec![6, 7],
        vec![20, 21, 22, 23],
        vec![],
        vec![9, 9, 3],
    ];
    let advantages: Vec<Vec<f64>> = responses
        .iter()
        .enumerate()
        .map(|(i, r)| vec![if i % 2 == 0 { 1.0 } else { -0.5 }; r.len()])
        .collect();
    let behaviour: Vec<Vec<f64>> = responses.iter().map(|r| vec![-2.0; r.len()]).collect();
    let batch = learn_rows(&prompts, &responses, &advantages, &behaviour);
    let run = |packing: bool, aggregation: Aggregation, checkpointed: bool, lora: bool| {
        let mut model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        if lora {
            let adapters = weir_gpu::adapter::LoraConfig {
                rank: 4,
                alpha: 8.0,
                dropout: 0.0,
                target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            };
            model.add_lora(&adapters, 3).unwrap();
        }
        let mut cfg = LearnerConfig {
            entropy_coef: 0.1,
            micro_batch: 3,
            // Packed: rows up to 14 tokens a micro-batch; padded: sorted by width.
            micro_batch_tokens: 14,
            ppo_epochs: 2,
            gradient_checkpointing: checkpointed,
            packing,
            ..LearnerConfig::default()
        };
        cfg.policy.aggregation = aggregation;
        cfg.policy.correction = Some(crate::algorithms::ImportanceCorrection::Tis {
            low: 0.5,
            high: 2.0,
        });
        cfg.adamw.lr = 1e-2;
        cfg.adamw.eps = 1e-6;
        let mut learner = Learner::new(model, cfg).unwrap();
        let stats = learner.update(&batch).unwrap();
        (stats, learner.model().named_tensors())
    };
    for (aggregation, checkpointed, lora) in [
        (Aggregation::TokenMean, false, false),
        (Aggregation::SeqMeanTokenMean, true, false),
        (Aggregation::SeqMeanTokenSum, false, true),
        (Aggregation::SeqMeanTokenSumNorm, true, true),
        (Aggregation::TokenSum, false, false),
    ] {
        // Gradient checkpointing with LoRA (a frozen embedding) too: it
        // failed on the padded path before (its backward reached the embedding).
        let (padded, padded_weights) = run(false, aggregation, checkpointed, lora);
        let (packed, packed_weights) = run(true, aggregation, checkpointed, lora);
        assert!(packed.grad_norm > 0.0);
        assert_same_update(
            &format!("{aggregation:?}, checkpointed {checkpointed}, lora {lora}"),
            &[
                (padded.loss, packed.loss),
                (padded.grad_norm, packed.grad_norm),
                (padded.entropy, packed.entropy),
                (padded.clip_fraction, packed.clip_fraction),
            ],
            &padded_weights,
            &packed_weights,
        );
    }
    // A budget below the longest row names the key.
    let model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
    let cfg = LearnerConfig {
        micro_batch_tokens: 5,
        packing: true,
        ..LearnerConfig::default()
    };
    let err = Learner::new(model, cfg)
        .unwrap()
        .update(&batch)
        .unwrap_err()
        .to_string();
    assert!(err.contains("algorithm.micro_batch_tokens = 5"), "{err}");
}

/// A teacher's top-k term (GKD's divergence over the teacher's top k):
/// the learner's measured divergence is the one computed directly from
/// the student's full distribution; every path (the chunked head, packed
/// rows, gradient checkpointing, LoRA) makes the same update; repeated
/// updates bring the student towards the teacher; rows whose top-k
/// columns do not hold k per token are refused naming the row.
#[test]
fn a_teachers_top_k_term_is_gkds_divergence_on_every_path() {
    use crate::algorithms::{topk_divergence, TopKTail};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/tiny-qwen2");
    let prompts = vec![
        vec![1i64, 2, 3, 4, 5, 6, 7, 8, 9],
        vec![1, 3],
        vec![1, 3],
        vec![7],
        vec![2, 4, 6],
    ];
    let responses = vec![
        vec![5i64],
        vec![8, 9, 10, 11, 12, 13, 14, 15],
        vec![6, 7],
        vec![],
        vec![9, 9, 3],
    ];
    let k = 4;
    // The teacher: the same checkpoint, sharper (temperature 0.5).
    let teacher = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
    let read = crate::training::sequences::response_top_logprobs(
        &teacher,
        &prompts,
        &responses,
        0.5,
        crate::training::sequences::TopTokens { k, below: None },
        3,
        false,
    )
    .unwrap();
    let row = |t: &Tensor, i: usize| t.get(i as i64).narrow(0, 0, responses[i].len() as i64);
    let top_ids: Vec<Vec<i64>> = (0..responses.len())
        .map(|i| Vec::<i64>::try_from(row(&read.ids, i).reshape([-1])).unwrap())
        .collect();
    let top_logprobs: Vec<Vec<f64>> = (0..responses.len())
        .map(|i| {
            Vec::<f64>::try_from(row(&read.top, i).reshape([-1]).to_kind(Kind::Double)).unwrap()
        })
        .collect();
    let zeros: Vec<Vec<f64>> = responses.iter().map(|r| vec![0.0; r.len()]).collect();
    let batch = |ids: &[Vec<i64>]| {
        let b = learn_rows(&prompts, &responses, &zeros, &zeros);
        let b = weir_graph::batch::with_column(&b, col::TEACHER_TOPK_IDS, token_list_array(ids))
            .unwrap();
        weir_graph::batch::with_column(
            &b,
            col::TEACHER_TOPK_LOGPROBS,
            float_list_array(&top_logprobs),
        )
        .unwrap()
    };
    let gkd = GkdLoss {
        k,
        beta: 0.5,
        coef: 1.0,
        tail: TopKTail::Add,
    };
    let learner = |epochs, chunk, packing, checkpointed, lora: bool| {
        let mut model = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
        if lora {
            let adapters = weir_gpu::adapter::LoraConfig {
                rank: 4,
                alpha: 8.0,
                dropout: 0.0,
                target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
            };
            model.add_lora(&adapters, 3).unwrap();
        }
        let mut cfg = LearnerConfig {
            micro_batch: 2,
            micro_batch_tokens: if packing { 14 } else { 0 },
            ppo_epochs: epochs,
            logprob_chunk: chunk,
            packing,
            gradient_checkpointing: checkpointed,
            gkd: Some(gkd),
            ..LearnerConfig::default()
        };
        cfg.adamw.lr = 1e-2;
        cfg.adamw.eps = 1e-6;
        Learner::new(model, cfg).unwrap()
    };

    // The divergence the learner measures before its one step, and directly.
    let mut one = learner(1, 0, false, false, false);
    let measured = one.update(&batch(&top_ids)).unwrap().gkd;
    let student = Model::load(&dir, weir_gpu::Device::Cpu, Kind::Float).unwrap();
    let (mut sum, mut tokens) = (0.0, 0.0);
    for (i, (p, r)) in prompts.iter().zip(&responses).enumerate() {
        if r.is_empty() {
            continue;
        }
        let ids = Tensor::from_slice(&[p.as_slice(), r.as_slice()].concat()).view([1, -1]);
        let logits = student.logits(&ids, None, None).unwrap().get(0);
        let at = logits.narrow(0, p.len() as i64 - 1, r.len() as i64);
        let support = Tensor::from_slice(&top_ids[i]).view([r.len() as i64, k as i64]);
        let s = at.log_softmax(-1, Kind::Double).gather(-1, &support, false);
        let t = Tensor::from_slice(&top_logprobs[i]).view([r.len() as i64, k as i64]);
        let d = topk_divergence(&s, &t, gkd.beta, gkd.tail);
        sum += d.sum(Kind::Double).double_value(&[]);
        tokens += r.len() as f64;
    }
    assert!(measured > 1e-3, "{measured}");
    assert!(
        (measured - sum / tokens).abs() < 1e-5 * measured,
        "learner {measured} vs direct {}",
        sum / tokens
    );

    // The same two-pass update on every path.
    let run = |chunk, packing, checkpointed, lora| {
        let mut l = learner(2, chunk, packing, checkpointed, lora);
        let stats = l.update(&batch(&top_ids)).unwrap();
        (stats, l.model().named_tensors())
    };
    for lora in [false, true] {
        let (plain, plain_weights) = run(0, false, false, lora);
        assert!(plain.grad_norm > 0.0 && plain.gkd > 0.0);
        for (chunk, packing, checkpointed) in [(2, false, false), (0, true, true), (3, true, false)]
        {
            let (other, weights) = run(chunk, packing, checkpointed, lora);
            assert_same_update(
                &format!(
                    "chunk {chunk}, packed {packing}, checkpointed {checkpointed}, lora {lora}"
                ),
                &[
                    (plain.loss, other.loss),
                    (plain.grad_norm, other.grad_norm),
                    (plain.gkd, other.gkd),
                ],
                &plain_weights,
                &weights,
            );
        }
    }

    // Updates on the term alone bring the student towards the teacher.
    let mut l = learner(1, 0, false, false, false);
    let first = l.update(&batch(&top_ids)).unwrap().gkd;
    let mut last = first;
    for _ in 0..5 {
        last = l.update(&batch(&top_ids)).unwrap().gkd;
    }
    assert!(last < 0.8 * first, "{first} → {last}");

    // Top-k columns that do not hold k per token: the row named.
    let mut short = top_ids.clone();
    short[2].pop();
    let err = learner(1, 0, false, false, false)
        .update(&batch(&short))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("row 2") && err.contains("teacher.top_k = 4"),
        "{err}"
    );
}
