//! Generation: greedy against the references, sampling, eos handling.

use super::*;
use weir_gpu::{generate_on, Backend};

/// Largest difference between two generations' behaviour log-probs.
fn max_logprob_diff(a: &weir_gpu::Generation, b: &weir_gpu::Generation) -> f32 {
    a.logprobs
        .iter()
        .zip(&b.logprobs)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_greedy(name: &str) {
    let r = &reference(name)["greedy"];
    let model = load(name, Kind::Float);
    let prompts: Vec<Vec<i64>> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let params = weir_gpu::SamplingParams {
        max_new_tokens: 16,
        greedy: true,
        ignore_eos: true,
        ..Default::default()
    };
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    // The CPU kernels, and libtorch's ops (the GPU's path: a slot cache).
    for backend in [Backend::Auto, Backend::Torch] {
        let out = generate_on(&model, &prompts, &ids, &params, backend).unwrap();
        for (i, g) in out.iter().enumerate() {
            assert_eq!(
                g.tokens,
                ints(&r["new_token_ids"][i]),
                "{name} {backend:?}: greedy tokens of prompt {i}"
            );
            assert_eq!(g.finish_reason, weir_gpu::FinishReason::Length);
            let reference: Vec<Option<f64>> = floats(&r["new_token_logprobs"][i]);
            let d = max_diff(&Tensor::from_slice(&g.logprobs), &reference);
            assert!(
                d < 1e-4,
                "{name} {backend:?}: greedy log-probs of prompt {i} differ by {d:e}"
            );
        }
    }
}

#[test]
fn greedy_generation_with_kv_cache_matches_transformers() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        check_greedy(name);
    }
}

#[test]
fn sampling_is_seeded_per_sequence_and_respects_its_settings() {
    use weir_gpu::{generate, SamplingParams};
    let model = load("tiny-llama", Kind::Float);
    let prompts = vec![
        vec![1i64, 286, 202, 305],
        vec![302, 592],
        vec![5, 6, 7, 8, 9, 10],
    ];
    let params = SamplingParams {
        max_new_tokens: 12,
        temperature: 1.3,
        top_p: Some(0.9),
        top_k: Some(50),
        n: 3,
        seed: 11,
        ..Default::default()
    };
    let all = generate(&model, &prompts, &params).unwrap();
    assert_eq!(all.len(), 9);
    assert_eq!(
        generate(&model, &prompts, &params).unwrap(),
        all,
        "same seed, same samples"
    );
    // A prompt's samples do not depend on the other prompts in the batch
    // (padding width, batch size): drop the longest prompt and compare.
    let fewer = generate(&model, &prompts[..2], &params).unwrap();
    for (a, b) in fewer.iter().zip(all.iter().filter(|g| g.prompt < 2)) {
        assert_eq!(a.tokens, b.tokens);
        let d = max_logprob_diff(a, b);
        assert!(d < 1e-4, "log-probs differ by {d}");
    }
    assert_ne!(
        all[0].tokens, all[1].tokens,
        "samples of one prompt should differ"
    );
    let other_seed = generate(
        &model,
        &prompts,
        &SamplingParams {
            seed: 12,
            ..params.clone()
        },
    )
    .unwrap();
    assert_ne!(other_seed, all);
    // top_k = 1 is greedy; the log-prob of a certain draw is 0.
    let top1 = generate(
        &model,
        &prompts,
        &SamplingParams {
            top_k: Some(1),
            top_p: None,
            n: 1,
            ..params.clone()
        },
    )
    .unwrap();
    let greedy = generate(
        &model,
        &prompts,
        &SamplingParams {
            greedy: true,
            n: 1,
            ..params.clone()
        },
    )
    .unwrap();
    for (a, b) in top1.iter().zip(&greedy) {
        assert_eq!(a.tokens, b.tokens);
        assert!(a.logprobs.iter().all(|l| l.abs() < 1e-6));
    }
    // Behaviour log-probs are those of the distribution sampled from: with
    // top-k and top-p they are the renormalised kept mass's, so at least the
    // unfiltered log-probs of the same tokens at temperature 1.3, and above
    // them somewhere (the filters dropped mass); without filters, equal.
    let unfiltered = |g: &weir_gpu::Generation| -> Vec<f32> {
        let mut ids = prompts[g.prompt].clone();
        ids.extend(&g.tokens);
        let n = ids.len() as i64;
        let lp = model
            .token_logprobs(&Tensor::from_slice(&ids).view([1, n]), None, 1.3)
            .unwrap()
            .get(0)
            .narrow(0, n - 1 - g.tokens.len() as i64, g.tokens.len() as i64)
            .to_kind(Kind::Float);
        Vec::<f32>::try_from(lp).unwrap()
    };
    let mut above = 0;
    for g in &all {
        for (filtered, full) in g.logprobs.iter().zip(unfiltered(g)) {
            assert!(*filtered >= full - 1e-4, "{filtered} < {full}");
            above += usize::from(*filtered > full + 1e-3);
        }
    }
    assert!(above > 0, "top-k and top-p renormalised nothing");
    let full = generate(
        &model,
        &prompts,
        &SamplingParams {
            top_k: None,
            top_p: None,
            ..params.clone()
        },
    )
    .unwrap();
    for g in &full {
        for (sampled, reference) in g.logprobs.iter().zip(unfiltered(g)) {
            assert!(
                (sampled - reference).abs() < 1e-4,
                "{sampled} vs {reference}"
            );
        }
    }
}

#[test]
fn generation_stops_at_any_eos_id_and_keeps_it() {
    use weir_gpu::{generate, FinishReason, SamplingParams};
    let model = load("tiny-llama", Kind::Float);
    let prompts = vec![vec![1i64, 286, 202, 305], vec![302, 592]];
    let free = generate(
        &model,
        &prompts,
        &SamplingParams {
            max_new_tokens: 10,
            greedy: true,
            ..Default::default()
        },
    )
    .unwrap();
    // Make the 4th greedy token of prompt 0 an eos id: generation must stop right there.
    let eos = free[0].tokens[3];
    let params = SamplingParams {
        max_new_tokens: 10,
        greedy: true,
        eos_token_ids: vec![999, eos],
        ..Default::default()
    };
    let stopped = generate(&model, &prompts, &params).unwrap();
    let first = free[0].tokens.iter().position(|&t| t == eos).unwrap();
    assert_eq!(stopped[0].tokens, free[0].tokens[..=first].to_vec());
    assert_eq!(stopped[0].finish_reason, FinishReason::Stop);
    // The other sequence goes on unaffected by its neighbour leaving the batch.
    let cut = free[1]
        .tokens
        .iter()
        .position(|&t| t == eos)
        .map_or(10, |i| i + 1);
    assert_eq!(stopped[1].tokens, free[1].tokens[..cut].to_vec());
    let err = generate(
        &model,
        &prompts,
        &SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("temperature"), "{err}");
    assert!(generate(&model, &[vec![]], &SamplingParams::default()).is_err());
}

/// weir's CPU kernels (the default for float32 on an AVX2 CPU) against the
/// libtorch ops path, for every family: greedy and sampled tokens agree,
/// behaviour log-probs within 1e-4, prompts of different lengths, several
/// samples per prompt and repeated prompts (prefilled once), and a prompt longer than one
/// prefill chunk.
#[test]
fn cpu_kernels_agree_with_libtorch_ops() {
    use weir_gpu::{generate_on, Backend, SamplingParams};
    let avx2 =
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    let long: Vec<i64> = (0..300).map(|i| 5 + (i * 7) % 900).collect();
    // The last prompt repeats the first (as a source that expands prompts × n
    // sends them): prefilled once, sampled from its own streams.
    let prompts = vec![
        vec![1i64, 286, 202, 305],
        vec![302, 592],
        vec![5, 6, 7, 8, 9, 10, 11, 12, 13],
        long,
        vec![1i64, 286, 202, 305],
    ];
    let ids: Vec<u64> = (0..prompts.len() as u64).collect();
    let sampled = SamplingParams {
        max_new_tokens: 12,
        temperature: 1.3,
        top_p: Some(0.9),
        top_k: Some(50),
        n: 3,
        seed: 5,
        ..Default::default()
    };
    let greedy = SamplingParams {
        max_new_tokens: 20,
        greedy: true,
        ..Default::default()
    };
    let plain = SamplingParams {
        top_k: None,
        top_p: None,
        n: 2,
        ..sampled.clone()
    };
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "arith-sft"] {
        let model = load(name, Kind::Float);
        assert_eq!(model.runs_on_cpu_kernels(), avx2);
        for params in [&greedy, &sampled, &plain] {
            let ours = generate_on(&model, &prompts, &ids, params, Backend::Auto).unwrap();
            let torch = generate_on(&model, &prompts, &ids, params, Backend::Torch).unwrap();
            assert_eq!(ours.len(), prompts.len() * params.n);
            for (a, b) in ours.iter().zip(&torch) {
                assert_eq!((a.prompt, a.sample), (b.prompt, b.sample));
                assert_eq!(
                    a.tokens, b.tokens,
                    "{name}: tokens of prompt {} sample {} ({params:?})",
                    a.prompt, a.sample
                );
                assert_eq!(a.finish_reason, b.finish_reason);
                let d = max_logprob_diff(a, b);
                assert!(d < 1e-4, "{name}: log-probs differ by {d}");
            }
        }
    }
    // The packed weights follow in-place changes (an optimizer step, a
    // snapshot): after scaling every weight, the kernels still agree.
    let model = load("tiny-qwen2", Kind::Float);
    let before = generate_on(&model, &prompts, &ids, &greedy, Backend::Auto).unwrap();
    {
        let _guard = tch::no_grad_guard();
        for (name, mut t) in model.named_tensors() {
            if name.ends_with("proj.weight") {
                let _ = t.g_mul_scalar_(1.7);
            }
        }
    }
    let after = generate_on(&model, &prompts, &ids, &greedy, Backend::Auto).unwrap();
    let torch = generate_on(&model, &prompts, &ids, &greedy, Backend::Torch).unwrap();
    assert_ne!(
        before, after,
        "scaling the weights changes the greedy tokens"
    );
    for (a, b) in after.iter().zip(&torch) {
        assert_eq!(
            a.tokens, b.tokens,
            "stale packed weights after an in-place change"
        );
    }
    // The kernels split products and attention among libtorch's intra-op
    // threads; every element is computed the same way: identical bits.
    let threads = tch::get_num_threads();
    let model = load("tiny-llama", Kind::Float);
    let mut runs = Vec::new();
    for t in [1, 3] {
        weir_gpu::device::set_threads(t);
        runs.push(generate_on(&model, &prompts, &ids, &sampled, Backend::Auto).unwrap());
    }
    tch::set_num_threads(threads);
    assert_eq!(runs[0], runs[1], "1 thread and 3 threads differ");
    // Other dtypes stay on libtorch.
    assert!(!load("tiny-llama", Kind::BFloat16).runs_on_cpu_kernels());
}

/// The error a libtorch pass of `model` gives (it must give one).
fn libtorch_refusal(model: &Model) -> String {
    let ids = Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]);
    model
        .hidden_states(&ids, None, None)
        .unwrap_err()
        .to_string()
}

/// A frozen model that keeps its weights only in the CPU kernels' packing
/// (the reference): the same log-probs as before, no libtorch weights left,
/// and every libtorch use refused in one line.
#[test]
fn a_model_kept_only_packed_scores_alike_and_refuses_libtorch() {
    use weir_gpu::generate::response_logprobs_on_cpu_kernels;
    let dir = fixtures().join("models").join("tiny-qwen2");
    let mut model = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    if !model.runs_on_cpu_kernels() {
        assert!(!model.keep_only_cpu_packing().unwrap());
        return;
    }
    let prompts = vec![vec![1i64, 286, 202, 305], vec![302, 592]];
    let responses = vec![vec![5i64, 6, 7], vec![8, 9]];
    let before = response_logprobs_on_cpu_kernels(&model, &prompts, &responses, 1.0).unwrap();
    // Another model shares the weights: they stay its.
    let other = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(model.keep_only_cpu_packing().unwrap());
    assert!(model.named_tensors().iter().all(|(_, t)| t.numel() == 0));
    let after = response_logprobs_on_cpu_kernels(&model, &prompts, &responses, 1.0).unwrap();
    assert_eq!(before, after);
    assert!(other.named_tensors().iter().all(|(_, t)| t.numel() > 0));
    let ids = Tensor::from_slice(&[1i64, 286, 202]).view([1, 3]);
    let fresh = Model::load(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(other
        .logits(&ids, None, None)
        .unwrap()
        .equal(&fresh.logits(&ids, None, None).unwrap()));
    // Alone with its weights, a model's packing is their only copy.
    drop(other);
    let mut alone = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(alone.keep_only_cpu_packing().unwrap());
    assert!(alone.named_tensors().iter().all(|(_, t)| t.numel() == 0));
    let packed_alone = response_logprobs_on_cpu_kernels(&alone, &prompts, &responses, 1.0).unwrap();
    assert_eq!(before, packed_alone);
    let err = libtorch_refusal(&model);
    assert!(err.contains("only packed for the CPU kernels"), "{err}");
    assert!(model.export_snapshot(1).is_err());
    let params = weir_gpu::SamplingParams::default();
    assert!(generate_on(&model, &prompts, &[0, 1], &params, Backend::Torch).is_err());
    // The kernels still generate from the packing: the same samples as
    // from the weights themselves.
    assert_eq!(
        generate_on(&model, &prompts, &[0, 1], &params, Backend::Auto).unwrap(),
        generate_on(&fresh, &prompts, &[0, 1], &params, Backend::Auto).unwrap()
    );
    // Another shared load reads the weights again.
    let again = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(again.named_tensors().iter().all(|(_, t)| t.numel() > 0));
}

/// A generator's copy freed until the next snapshot: nothing of it left,
/// every pass (libtorch, the CPU kernels, a snapshot, a save) refused in one
/// line, and the snapshot brings back exactly the weights it carries.
#[test]
fn weights_freed_until_a_snapshot_come_back_whole_from_it() {
    let source = load("tiny-llama", Kind::Float);
    let bytes = source.export_snapshot(4).unwrap();
    let mut model = load("tiny-llama", Kind::Float);
    {
        // Other weights than the snapshot's, so that its arrival shows.
        let _g = tch::no_grad_guard();
        for (_, mut t) in model.named_tensors() {
            let _ = t.f_mul_scalar_(0.5).unwrap();
        }
    }
    let prompts = vec![vec![1i64, 286, 202, 305], vec![302, 592]];
    let params = weir_gpu::SamplingParams {
        max_new_tokens: 6,
        greedy: true,
        ..Default::default()
    };
    assert!(model.free_weights_until_snapshot());
    assert!(!model.free_weights_until_snapshot(), "freed twice");
    assert!(model.named_tensors().iter().all(|(_, t)| t.numel() == 0));
    let err = libtorch_refusal(&model);
    assert!(err.contains("until the learner's next version"), "{err}");
    for backend in [Backend::Auto, Backend::Torch] {
        let err = generate_on(&model, &prompts, &[0, 1], &params, backend).unwrap_err();
        assert!(err.to_string().contains("freed its weights"), "{err}");
    }
    assert!(model.export_snapshot(5).is_err());
    assert!(model
        .save(tempfile::tempdir().unwrap().path(), None)
        .is_err());
    // A snapshot of another architecture leaves it refusing, not half-filled.
    let other = load("tiny-qwen2", Kind::Float).export_snapshot(1).unwrap();
    assert!(model.apply_snapshot(&other).is_err());
    libtorch_refusal(&model);

    assert_eq!(model.apply_snapshot(&bytes).unwrap(), 4);
    for ((name, a), (_, b)) in source.named_tensors().iter().zip(model.named_tensors()) {
        assert!(a.equal(&b), "{name} differs after the snapshot");
    }
    for backend in [Backend::Auto, Backend::Torch] {
        assert_eq!(
            generate_on(&model, &prompts, &[0, 1], &params, backend).unwrap(),
            generate_on(&source, &prompts, &[0, 1], &params, backend).unwrap(),
        );
    }
    // A model whose snapshots carry adapters keeps its base.
    let mut adapted = load("tiny-llama", Kind::Float);
    let lora = weir_gpu::lora::LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: vec!["q_proj".into()],
    };
    adapted.add_lora(&lora, 3).unwrap();
    assert!(!adapted.free_weights_until_snapshot());
}

/// Response log-probs on the CPU kernels (the reference's and the learner's
/// no-grad passes) against libtorch's `token_logprobs` on each whole
/// sequence: repeated prompts (run once), an empty response, a temperature.
#[test]
fn cpu_kernels_score_responses_like_libtorch() {
    use weir_gpu::generate::response_logprobs_on_cpu_kernels;
    let prompts = vec![
        vec![1i64, 286, 202, 305],
        vec![302, 592],
        vec![1i64, 286, 202, 305],
        vec![9, 8, 7],
    ];
    let long: Vec<i64> = (0..40).map(|i| 3 + (i * 13) % 500).collect();
    let responses = vec![vec![5i64, 6, 7], vec![8], long, vec![]];
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let model = load(name, Kind::Float);
        if !model.runs_on_cpu_kernels() {
            assert!(response_logprobs_on_cpu_kernels(&model, &prompts, &responses, 1.0).is_err());
            continue;
        }
        for temperature in [1.0, 0.7] {
            let ours = response_logprobs_on_cpu_kernels(&model, &prompts, &responses, temperature)
                .unwrap();
            for (r, (p, resp)) in prompts.iter().zip(&responses).enumerate() {
                assert_eq!(ours[r].len(), resp.len());
                if resp.is_empty() {
                    continue;
                }
                let seq: Vec<i64> = p.iter().chain(resp).copied().collect();
                let ids = Tensor::from_slice(&seq).view([1, -1]);
                let all = model.token_logprobs(&ids, None, temperature).unwrap();
                let theirs = all.get(0).narrow(0, p.len() as i64 - 1, resp.len() as i64);
                let reference: Vec<Option<f64>> =
                    Vec::<f64>::try_from(theirs.to_kind(Kind::Double))
                        .unwrap()
                        .into_iter()
                        .map(Some)
                        .collect();
                let d = max_diff(&Tensor::from_slice(&ours[r]), &reference);
                assert!(
                    d < 1e-4,
                    "{name} row {r} at temperature {temperature}: {d:e}"
                );
            }
        }
        let err = response_logprobs_on_cpu_kernels(&model, &prompts, &[vec![1]], 1.0).unwrap_err();
        assert!(
            err.to_string().contains("4 prompts for 1 responses"),
            "{err}"
        );
        let bad = vec![vec![model.config.vocab_size]];
        let err = response_logprobs_on_cpu_kernels(&model, &prompts[..1], &bad, 1.0).unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    }
}

/// The kernels on shapes no fixture has: sizes that are not multiples of
/// 8 or 16 (hidden 40, head 12, intermediate 70, vocab 37), 5 query heads
/// on 1 key/value head, q/k/v biases with q/k norms, untied head, llama3
/// RoPE scaling — against the libtorch path, greedy and sampled.
#[test]
fn cpu_kernels_handle_shapes_no_fixture_has() {
    use weir_gpu::{generate_on, Backend, ModelConfig, SamplingParams};
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 37,
        "hidden_size": 40, "intermediate_size": 70, "num_hidden_layers": 3,
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12,
        "attention_bias": true, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0, "tie_word_embeddings": false,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 2.0, "original_max_position_embeddings": 32},
        "bos_token_id": 0, "eos_token_id": 1
    });
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let parsed = ModelConfig::load(dir.path()).unwrap();
    assert!(parsed.qk_norm && parsed.attention_bias);
    let mut model = Model::new(parsed, Device::Cpu, dir.path()).unwrap();
    model.init_weights(0.3, 9);
    {
        // Non-trivial norms and biases.
        let _guard = tch::no_grad_guard();
        for (name, mut t) in model.named_tensors() {
            if name.ends_with("norm.weight") || name.ends_with(".bias") {
                t.copy_(
                    &(Tensor::randn_like(&t) * 0.2
                        + if name.ends_with("bias") { 0.0 } else { 1.0 }),
                );
            }
        }
    }
    assert!(model.runs_on_cpu_kernels() || !std::arch::is_x86_feature_detected!("avx2"));
    let prompts: Vec<Vec<i64>> = vec![(2..30).collect(), vec![5, 9], vec![33, 34, 35, 36, 2]];
    let ids: Vec<u64> = (0..3).collect();
    for params in [
        SamplingParams {
            max_new_tokens: 40,
            greedy: true,
            ..Default::default()
        },
        SamplingParams {
            max_new_tokens: 40,
            temperature: 0.9,
            top_k: Some(7),
            n: 3,
            seed: 4,
            ..Default::default()
        },
    ] {
        let ours = generate_on(&model, &prompts, &ids, &params, Backend::Auto).unwrap();
        let torch = generate_on(&model, &prompts, &ids, &params, Backend::Torch).unwrap();
        for (a, b) in ours.iter().zip(&torch) {
            assert_eq!(
                a.tokens, b.tokens,
                "prompt {} sample {}",
                a.prompt, a.sample
            );
            let d = max_logprob_diff(a, b);
            assert!(d < 1e-4, "log-probs differ by {d}");
        }
    }
}

/// `Σ π²` of the distribution `logits` (one position's) becomes after
/// `params`' temperature, top-k and top-p (greedy: the plain softmax),
/// computed by hand in float64.
pub(crate) fn sum_pi_squared_by_hand(logits: &[f32], params: &weir_gpu::SamplingParams) -> f64 {
    let t = if params.greedy {
        1.0
    } else {
        params.temperature
    };
    let mut x: Vec<f64> = logits.iter().map(|&l| f64::from(l) / t).collect();
    x.sort_by(|a, b| b.total_cmp(a));
    if !params.greedy {
        if let Some(k) = params.top_k {
            // Ties with the k-th stay, as the samplers keep them.
            let kth = x[k.min(x.len()) - 1];
            x.retain(|v| *v >= kth);
        }
        if let Some(p) = params.top_p.filter(|&p| p < 1.0) {
            let z: f64 = x.iter().map(|v| v.exp()).sum();
            let mut mass = 0.0;
            let mut kept = 0;
            for v in &x {
                if mass >= p {
                    break;
                }
                mass += v.exp() / z;
                kept += 1;
            }
            x.truncate(kept.max(1));
        }
    }
    let z: f64 = x.iter().map(|v| v.exp()).sum();
    x.iter().map(|v| (v.exp() / z).powi(2)).sum()
}

/// Checks each of `g`'s tokens' `Σ π²` against its position's logits in a
/// forward pass of `prompt` and the tokens, through `params`' sampling.
pub(crate) fn assert_sum_pi_squared(
    model: &Model,
    prompt: &[i64],
    g: &weir_gpu::Generation,
    params: &weir_gpu::SamplingParams,
    label: &str,
) {
    assert_eq!(g.sum_pi_squared.len(), g.tokens.len(), "{label}");
    let sequence: Vec<i64> = prompt.iter().chain(&g.tokens).copied().collect();
    let n = sequence.len() as i64;
    let logits = model
        .logits(&Tensor::from_slice(&sequence).view([1, n]), None, None)
        .unwrap()
        .get(0)
        .to_kind(Kind::Float);
    for (i, got) in g.sum_pi_squared.iter().enumerate() {
        let row = Vec::<f32>::try_from(logits.get(prompt.len() as i64 - 1 + i as i64)).unwrap();
        let want = sum_pi_squared_by_hand(&row, params);
        assert!(
            (f64::from(*got) - want).abs() < 1e-4,
            "{label}: token {i}: Σπ² {got} against {want}"
        );
    }
}

/// Each generated token's `Σ π²` (what the optimal token baseline reads)
/// is that of the distribution it was drawn from — the temperature, top-k
/// and top-p applied to the model's logits at its position — on the
/// libtorch path and the CPU kernels alike, checked against a forward pass
/// of the whole sequence.
#[test]
fn each_tokens_sum_pi_squared_is_that_of_its_sampling_distribution() {
    use weir_gpu::SamplingParams;
    let model = load("arith-sft", Kind::Float);
    let prompts = vec![vec![1i64, 286, 202, 305], vec![302, 592, 7]];
    let ids = [0u64, 1];
    let base = SamplingParams {
        max_new_tokens: 6,
        n: 2,
        seed: 3,
        sum_pi_squared: true,
        top_k: None,
        top_p: None,
        ..Default::default()
    };
    let cases = [
        SamplingParams {
            temperature: 1.3,
            ..base.clone()
        },
        SamplingParams {
            temperature: 0.8,
            top_k: Some(7),
            ..base.clone()
        },
        SamplingParams {
            temperature: 1.1,
            top_p: Some(0.9),
            ..base.clone()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: Some(40),
            top_p: Some(0.7),
            ..base.clone()
        },
        SamplingParams {
            greedy: true,
            n: 1,
            ..base.clone()
        },
    ];
    for params in &cases {
        for backend in [Backend::Auto, Backend::Torch] {
            let out = generate_on(&model, &prompts, &ids, params, backend).unwrap();
            for g in &out {
                let label = format!("{backend:?} {params:?}");
                assert_sum_pi_squared(&model, &prompts[g.prompt], g, params, &label);
            }
        }
    }
}
