//! Continuous batching (`weir_gpu::Streamer`) against one static batch, and
//! weights applied while sequences are in flight.

use super::*;
use weir_gpu::{
    generate_on, Backend, FinishReason, Generation, OnNewWeights, Request, SamplingParams, Streamer,
};

const PROMPTS: [&[i64]; 7] = [
    &[1, 286, 202, 305],
    &[302, 592],
    &[5, 6, 7, 8, 9, 10],
    &[1, 286, 202, 305],
    &[77],
    &[400, 12, 99, 3, 41, 8, 17, 250],
    &[33, 44],
];

fn prompts() -> Vec<Vec<i64>> {
    PROMPTS.iter().map(|p| p.to_vec()).collect()
}

fn requests(prompts: &[Vec<i64>], streams: &[u64]) -> Vec<Request> {
    prompts
        .iter()
        .zip(streams)
        .enumerate()
        .map(|(i, (p, &s))| Request {
            key: i as u64,
            prompt: p.clone(),
            stream: s,
            greedy: false,
            max_new_tokens: None,
        })
        .collect()
}

/// Runs `requests` to the end through a pool of `max_inflight`, checking
/// that a free slot never stays empty while requests wait; results by key.
fn stream_all(
    model: &Model,
    params: &SamplingParams,
    max_inflight: usize,
    backend: Backend,
    requests: Vec<Request>,
) -> Vec<weir_gpu::Finished> {
    let n = requests.len();
    let mut streamer = Streamer::new(
        model,
        params.clone(),
        max_inflight,
        OnNewWeights::Keep,
        0,
        backend,
    )
    .unwrap();
    streamer.submit(model, requests).unwrap();
    let mut out: Vec<Option<weir_gpu::Finished>> = vec![None; n];
    while !streamer.is_idle() {
        let ready = streamer.live() + streamer.waiting();
        for f in streamer.advance(model).unwrap() {
            let key = f.key as usize;
            out[key] = Some(f);
        }
        // Every pass runs a full pool while requests wait: freed slots are refilled at once.
        let stats = streamer.take_stats();
        assert_eq!(stats.passes, 1);
        assert_eq!(
            stats.inflight as usize,
            ready.min(max_inflight),
            "a slot stayed empty"
        );
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// Eos ids that end the static batch's sequences at different lengths.
fn staggered_eos(model: &Model, prompts: &[Vec<i64>], backend: Backend) -> Vec<i64> {
    let long = SamplingParams {
        max_new_tokens: 12,
        greedy: true,
        ignore_eos: true,
        ..Default::default()
    };
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    let out = generate_on(model, prompts, &ids, &long, backend).unwrap();
    vec![out[0].tokens[2], out[2].tokens[7], out[5].tokens[4]]
}

fn assert_same(name: &str, expected: &[Generation], got: &[weir_gpu::Finished], exact: bool) {
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        assert_eq!(g.generation.tokens, e.tokens, "{name}: tokens of row {i}");
        assert_eq!(
            g.generation.finish_reason, e.finish_reason,
            "{name}: row {i}"
        );
        let d = e
            .logprobs
            .iter()
            .zip(&g.generation.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let tolerance = if exact { 0.0 } else { 1e-4 };
        assert!(
            d <= tolerance,
            "{name}: log-probs of row {i} differ by {d:e}"
        );
        assert_eq!(g.versions, vec![0; e.tokens.len()]);
        assert_eq!(g.recomputed, vec![false; e.tokens.len()]);
    }
}

#[test]
fn continuous_batching_gives_the_static_batch_tokens_on_both_backends() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let model = load(name, Kind::Float);
        let prompts = prompts();
        let streams: Vec<u64> = (0..prompts.len() as u64).map(|i| 100 + i).collect();
        for backend in [Backend::Auto, Backend::Torch] {
            let eos = staggered_eos(&model, &prompts, backend);
            for greedy in [true, false] {
                let params = SamplingParams {
                    max_new_tokens: 10,
                    greedy,
                    temperature: 0.9,
                    top_k: Some(40),
                    seed: 7,
                    eos_token_ids: eos.clone(),
                    ..Default::default()
                };
                let expected = generate_on(&model, &prompts, &streams, &params, backend).unwrap();
                let lengths: Vec<usize> = expected.iter().map(|g| g.tokens.len()).collect();
                if greedy {
                    assert!(
                        lengths.iter().min() < lengths.iter().max(),
                        "{name}: the eos ids should end rows at different lengths: {lengths:?}"
                    );
                    assert!(expected
                        .iter()
                        .any(|g| g.finish_reason == FinishReason::Stop));
                }
                for max_inflight in [2, 3, 16] {
                    let got = stream_all(
                        &model,
                        &params,
                        max_inflight,
                        backend,
                        requests(&prompts, &streams),
                    );
                    let label = format!("{name} {backend:?} greedy={greedy} pool={max_inflight}");
                    // The CPU kernels compute each row alike whatever else is in the pass.
                    assert_same(&label, &expected, &got, backend == Backend::Auto);
                }
            }
        }
    }
}

/// `model` with every weight scaled by `factor` (another policy version).
fn scaled(name: &str, factor: f64) -> Model {
    let model = load(name, Kind::Float);
    let _guard = tch::no_grad_guard();
    for (_, mut t) in model.named_tensors() {
        let _ = t.g_mul_scalar_(factor);
    }
    model
}

#[test]
fn weights_applied_in_flight_are_recorded_per_token_and_recompute_matches_a_fresh_prefill() {
    let name = "tiny-llama";
    let new_weights = scaled(name, 1.25).export_snapshot(1).unwrap();
    let fresh = scaled(name, 1.25);
    let prompts = prompts();
    let streams: Vec<u64> = (0..prompts.len() as u64).collect();
    let params = SamplingParams {
        max_new_tokens: 12,
        greedy: true,
        ignore_eos: true,
        ..Default::default()
    };
    let before = 4;
    for backend in [Backend::Auto, Backend::Torch] {
        let old = generate_on(
            &load(name, Kind::Float),
            &prompts,
            &streams,
            &params,
            backend,
        )
        .unwrap();
        // Per policy, each row's first log-prob under the new weights.
        let mut first_after: Vec<Vec<f32>> = Vec::new();
        for policy in [OnNewWeights::Keep, OnNewWeights::Recompute] {
            let mut firsts = Vec::new();
            let mut model = load(name, Kind::Float);
            let mut streamer =
                Streamer::new(&model, params.clone(), 16, policy, 0, backend).unwrap();
            streamer
                .submit(&model, requests(&prompts, &streams))
                .unwrap();
            for _ in 0..before {
                assert!(streamer.advance(&model).unwrap().is_empty());
            }
            assert_eq!(model.apply_snapshot(&new_weights).unwrap(), 1);
            streamer.weights_changed(1);
            let mut got = Vec::new();
            while !streamer.is_idle() {
                got.extend(streamer.advance(&model).unwrap());
            }
            got.sort_by_key(|f| f.key);
            let label = format!("{backend:?} {policy:?}");
            let recompute = policy == OnNewWeights::Recompute;
            for (i, f) in got.iter().enumerate() {
                let tokens = &f.generation.tokens;
                assert_eq!(tokens.len(), 12);
                assert_eq!(
                    tokens[..before],
                    old[i].tokens[..before],
                    "{label}: row {i} before the update"
                );
                let close = |a: &[f32], b: &[f32], what: &str| {
                    assert_eq!(a.len(), b.len(), "{label}: row {i} {what}");
                    for (x, y) in a.iter().zip(b) {
                        assert!(
                            (x - y).abs() < 1e-4,
                            "{label}: row {i} {what}: {a:?} vs {b:?}"
                        );
                    }
                };
                close(
                    &f.generation.logprobs[..before],
                    &old[i].logprobs[..before],
                    "log-probs before the update",
                );
                let mut versions = vec![0u32; before];
                versions.resize(12, 1);
                assert_eq!(f.versions, versions, "{label}: row {i}");
                let mut marks = vec![false; before];
                marks.resize(12, recompute);
                assert_eq!(f.recomputed, marks, "{label}: row {i}");
                if recompute {
                    // The same as a fresh generation from prompt + the tokens so far under the new weights.
                    let mut prefix = prompts[i].clone();
                    prefix.extend_from_slice(&tokens[..before]);
                    let rest = SamplingParams {
                        max_new_tokens: 12 - before,
                        ..params.clone()
                    };
                    let expected =
                        generate_on(&fresh, &[prefix], &[streams[i]], &rest, backend).unwrap();
                    assert_eq!(
                        tokens[before..],
                        expected[0].tokens[..],
                        "{label}: row {i} after the update"
                    );
                    // The behaviour log-probs are the new weights' on the recomputed context.
                    close(
                        &f.generation.logprobs[before..],
                        &expected[0].logprobs,
                        "log-probs after the update",
                    );
                }
                firsts.push(f.generation.logprobs[before]);
            }
            assert!(
                got.iter()
                    .any(|f| f.generation.tokens != old[f.key as usize].tokens),
                "{label}: the new weights changed no token"
            );
            first_after.push(firsts);
        }
        // `keep` goes on over the old weights' cache: its first token under
        // the new weights is scored on another context than `recompute`'s.
        assert!(
            first_after[0]
                .iter()
                .zip(&first_after[1])
                .any(|(k, r)| (k - r).abs() > 1e-3),
            "{backend:?}: keep and recompute scored alike: {first_after:?}"
        );
    }
}

#[test]
fn a_request_budget_ends_its_sequence_and_zero_ends_it_at_once() {
    let model = load("tiny-qwen2", Kind::Float);
    let prompts = prompts();
    let streams: Vec<u64> = (0..prompts.len() as u64).collect();
    let params = SamplingParams {
        max_new_tokens: 9,
        greedy: true,
        ignore_eos: true,
        ..Default::default()
    };
    for backend in [Backend::Auto, Backend::Torch] {
        let full = generate_on(&model, &prompts, &streams, &params, backend).unwrap();
        let mut requests = requests(&prompts, &streams);
        let budgets = [Some(3), None, Some(0), Some(20), Some(1), Some(9), Some(5)];
        for (r, b) in requests.iter_mut().zip(budgets) {
            r.max_new_tokens = b;
        }
        let got = stream_all(&model, &params, 3, backend, requests);
        for (i, (f, b)) in got.iter().zip(budgets).enumerate() {
            let n = b.unwrap_or(9).min(9);
            assert_eq!(
                f.generation.tokens,
                full[i].tokens[..n],
                "{backend:?} row {i}"
            );
            assert_eq!(f.versions.len(), n);
        }
    }
}

#[test]
fn the_slot_cache_keeps_every_row_through_growth_and_moves() {
    // Budgets that end rows in a mixed order, so rows leave from the middle
    // of the cache (the last rows move into their places) while others grow
    // past the cache's first 64 positions.
    let model = load("tiny-qwen3", Kind::Float);
    let prompts: Vec<Vec<i64>> = prompts().into_iter().cycle().take(12).collect();
    let streams: Vec<u64> = (0..prompts.len() as u64).map(|i| 50 + i).collect();
    let budgets = [90, 7, 55, 3, 70, 1, 33, 90, 12, 64, 2, 80];
    for greedy in [true, false] {
        let params = SamplingParams {
            max_new_tokens: 90,
            greedy,
            temperature: 0.8,
            seed: 11,
            ignore_eos: true,
            ..Default::default()
        };
        let full = generate_on(&model, &prompts, &streams, &params, Backend::Torch).unwrap();
        let mut requests = requests(&prompts, &streams);
        for (r, &b) in requests.iter_mut().zip(&budgets) {
            r.max_new_tokens = Some(b);
        }
        let got = stream_all(&model, &params, 4, Backend::Torch, requests);
        for (i, (f, &b)) in got.iter().zip(&budgets).enumerate() {
            assert_eq!(
                f.generation.tokens,
                full[i].tokens[..b],
                "greedy={greedy}: row {i}"
            );
            let d = f
                .generation
                .logprobs
                .iter()
                .zip(&full[i].logprobs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                d <= 1e-4,
                "greedy={greedy}: log-probs of row {i} differ by {d:e}"
            );
        }
    }
}

/// Streamed tokens carry the `Σ π²` of the distribution each was drawn
/// from (temperature, top-k, top-p applied to its position's logits), on
/// both backends, whatever the pool size.
#[test]
fn streamed_tokens_carry_the_sum_pi_squared_of_their_distribution() {
    let model = load("arith-sft", Kind::Float);
    let prompts = prompts();
    let streams: Vec<u64> = (0..prompts.len() as u64).map(|i| 40 + i).collect();
    for (top_k, top_p) in [(None, Some(0.85)), (Some(12), None), (Some(30), Some(0.6))] {
        let params = SamplingParams {
            max_new_tokens: 5,
            temperature: 1.2,
            top_k,
            top_p,
            seed: 9,
            sum_pi_squared: true,
            ..Default::default()
        };
        for backend in [Backend::Auto, Backend::Torch] {
            for max_inflight in [2, 16] {
                let got = stream_all(
                    &model,
                    &params,
                    max_inflight,
                    backend,
                    requests(&prompts, &streams),
                );
                for f in &got {
                    let label = format!(
                        "{backend:?} pool {max_inflight} {top_k:?}/{top_p:?}: row {}",
                        f.key
                    );
                    super::generation::assert_sum_pi_squared(
                        &model,
                        &prompts[f.key as usize],
                        &f.generation,
                        &params,
                        &label,
                    );
                }
            }
        }
    }
}
