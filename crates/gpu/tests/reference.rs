//! The model runtime against float64 transformers references
//! (`../shared/fixtures/models/*/reference.json`): logits and token
//! log-probs of single and padded batches (left, right, and the RL layout),
//! reward scores, in fp32 (tolerance 1e-4) and in float64 (tighter).

use std::path::PathBuf;

use serde_json::Value;
use tch::{Kind, Tensor};
use weir_gpu::{Device, Model};

fn fixtures() -> PathBuf {
    match std::env::var_os("WEIR_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures"),
    }
}

fn reference(model: &str) -> Value {
    let path = fixtures().join("models").join(model).join("reference.json");
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

fn load(model: &str, kind: Kind) -> Model {
    Model::load(&fixtures().join("models").join(model), Device::Cpu, kind).unwrap()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn matrix(v: &Value) -> Tensor {
    let rows: Vec<Vec<i64>> = v.as_array().unwrap().iter().map(ints).collect();
    let (b, t) = (rows.len() as i64, rows[0].len() as i64);
    Tensor::from_slice(&rows.concat()).view([b, t])
}

fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().unwrap().iter().map(Value::as_f64).collect()
}

/// Largest |ours − reference| over the entries where the reference has a number.
fn max_diff(ours: &Tensor, reference: &[Option<f64>]) -> f64 {
    let ours: Vec<f64> = Vec::<f64>::try_from(ours.to_kind(Kind::Double).flatten(0, -1)).unwrap();
    assert_eq!(ours.len(), reference.len());
    ours.iter()
        .zip(reference)
        .filter_map(|(o, r)| r.map(|r| (o - r).abs()))
        .fold(0.0, f64::max)
}

fn flat(v: &Value) -> Vec<Option<f64>> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Null => vec![None],
        other => vec![other.as_f64()],
    }
}

fn check_causal_lm(name: &str, kind: Kind, tol: f64) {
    let r = reference(name);
    let model = load(name, kind);
    for case in r["single"].as_array().unwrap() {
        let ids = Tensor::from_slice(&ints(&case["input_ids"])).view([1, -1]);
        let logits = model.logits(&ids, None, None).unwrap();
        let d = max_diff(&logits, &flat(&case["logits"]));
        assert!(
            d < tol,
            "{name} {kind:?} single {}: logits differ by {d:e}",
            case["name"]
        );
        let lp = model.token_logprobs(&ids, None, 1.0).unwrap();
        let d = max_diff(&lp, &floats(&case["token_logprobs"])[1..]);
        assert!(
            d < tol,
            "{name} {kind:?} single {}: log-probs differ by {d:e}",
            case["name"]
        );
    }
    for case in r["batched"].as_array().unwrap() {
        let ids = matrix(&case["input_ids"]);
        let mask = matrix(&case["attention_mask"]);
        let positions = matrix(&case["position_ids"]);
        let logits = model.logits(&ids, Some(&mask), Some(&positions)).unwrap();
        if !case["logits"].is_null() {
            // Rows at padding are null in the reference and skipped.
            let reference: Vec<Option<f64>> = flat(&case["logits"]);
            let per_row = logits.size()[2] as usize;
            let expanded: Vec<Option<f64>> = case["logits"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|b| {
                    b.as_array().unwrap().iter().flat_map(|row| {
                        if row.is_null() {
                            vec![None; per_row]
                        } else {
                            flat(row)
                        }
                    })
                })
                .collect();
            assert!(reference.len() <= expanded.len());
            let d = max_diff(&logits, &expanded);
            assert!(
                d < tol,
                "{name} {kind:?} {}: logits differ by {d:e}",
                case["name"]
            );
        }
        let t = ids.size()[1];
        let lp = weir_gpu::logprobs::gather_logprobs(
            &logits.narrow(1, 0, t - 1),
            &ids.narrow(1, 1, t - 1),
            1.0,
        );
        let reference: Vec<Option<f64>> = case["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| floats(row)[1..].to_vec())
            .collect();
        let d = max_diff(&lp, &reference);
        assert!(
            d < tol,
            "{name} {kind:?} {}: log-probs differ by {d:e}",
            case["name"]
        );
        // The same batch with default positions (cumsum of the mask) agrees too.
        let lp_default = model.token_logprobs(&ids, Some(&mask), 1.0).unwrap();
        let d = max_diff(&lp_default, &reference);
        assert!(
            d < tol,
            "{name} {kind:?} {}: default positions: log-probs differ by {d:e}",
            case["name"]
        );
    }
}

#[test]
fn llama_matches_transformers() {
    check_causal_lm("tiny-llama", Kind::Float, 1e-4);
    check_causal_lm("tiny-llama", Kind::Double, 1e-8);
}

#[test]
fn qwen2_matches_transformers() {
    check_causal_lm("tiny-qwen2", Kind::Float, 1e-4);
    check_causal_lm("tiny-qwen2", Kind::Double, 1e-8);
}

#[test]
fn qwen3_matches_transformers() {
    check_causal_lm("tiny-qwen3", Kind::Float, 1e-4);
    check_causal_lm("tiny-qwen3", Kind::Double, 1e-8);
}

#[test]
fn arith_sft_target_logprobs_match_transformers() {
    let r = reference("arith-sft");
    let model = load("arith-sft", Kind::Float);
    let cases = r["target_logprobs_fp64"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let prompt = ints(&case["prompt_ids"]);
        let completion = ints(&case["completion_ids"]);
        let ids = Tensor::from_slice(&[prompt.clone(), completion.clone()].concat()).view([1, -1]);
        let lp = model.token_logprobs(&ids, None, 1.0).unwrap();
        // Log-probs of the completion tokens: positions len(prompt)..end, i.e. the last |completion| entries.
        let n = completion.len() as i64;
        let tail = lp.narrow(1, lp.size()[1] - n, n);
        let d = max_diff(&tail, &floats(&case["completion_token_logprobs"]));
        assert!(
            d < 1e-4,
            "arith-sft {}: log-probs differ by {d:e}",
            case["pair"]
        );
    }
}

#[test]
fn reward_model_scores_match_transformers() {
    let r = reference("tiny-llama-rm");
    for (kind, tol) in [(Kind::Float, 1e-4), (Kind::Double, 1e-8)] {
        let model = load("tiny-llama-rm", kind);
        for case in r["single"].as_array().unwrap() {
            let ids = Tensor::from_slice(&ints(&case["input_ids"])).view([1, -1]);
            let score = model.scores(&ids, None).unwrap().double_value(&[0, 0]);
            let want = case["score"].as_f64().unwrap();
            assert!(
                (score - want).abs() < tol,
                "{kind:?} {}: score {score} vs {want}",
                case["name"]
            );
            let per_position = model.position_scores(&ids, None).unwrap();
            let d = max_diff(&per_position, &floats(&case["per_position_scores"]));
            assert!(
                d < tol,
                "{kind:?} {}: per-position scores differ by {d:e}",
                case["name"]
            );
        }
        for case in r["batched"].as_array().unwrap() {
            let ids = matrix(&case["input_ids"]);
            let mask = matrix(&case["attention_mask"]);
            let scores = model.scores(&ids, Some(&mask)).unwrap();
            let d = max_diff(&scores, &floats(&case["scores"]));
            assert!(d < tol, "{kind:?} {}: scores differ by {d:e}", case["name"]);
        }
    }
}

#[test]
fn broken_checkpoints_give_errors_naming_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("models/tiny-llama");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    // A checkpoint lacking one tensor.
    let tensors = Tensor::read_safetensors(src.join("model.safetensors")).unwrap();
    let kept: Vec<(String, Tensor)> = tensors
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight")
        .collect();
    Tensor::write_safetensors(&kept, dir.path().join("model.safetensors")).unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight") && err.contains("missing"),
        "{err}"
    );
    // A config that disagrees with the tensors' shapes.
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["intermediate_size"] = 100.into();
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("_proj.weight") && err.contains("100"),
        "{err}"
    );
    // Malformed JSON.
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
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
    let out = weir_gpu::generate(&model, &prompts, &params).unwrap();
    for (i, g) in out.iter().enumerate() {
        assert_eq!(
            g.tokens,
            ints(&r["new_token_ids"][i]),
            "{name}: greedy tokens of prompt {i}"
        );
        assert_eq!(g.finish_reason, weir_gpu::FinishReason::Length);
        let reference: Vec<Option<f64>> = floats(&r["new_token_logprobs"][i]);
        let d = max_diff(&Tensor::from_slice(&g.logprobs), &reference);
        assert!(
            d < 1e-4,
            "{name}: greedy log-probs of prompt {i} differ by {d:e}"
        );
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
        let d = a
            .logprobs
            .iter()
            .zip(&b.logprobs)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
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
    // Behaviour log-probs are those of the distribution sampled from: with top-k
    // they are at least the unfiltered log-probs at temperature 1.3.
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
        assert!(g.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
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

#[test]
fn tokenizer_and_chat_template_match_transformers() {
    use weir_gpu::{Message, Tokenizer};
    let dir = fixtures().join("tokenizer");
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_reference.json")).unwrap(),
    )
    .unwrap();
    let tok = Tokenizer::load(&dir).unwrap();
    for case in r["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, ints(&case["ids"]), "ids of {text:?}");
        let tokens: Vec<String> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        assert_eq!(tok.tokens(text).unwrap(), tokens, "tokens of {text:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "decoded {text:?}"
        );
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "decoded (skip special) {text:?}"
        );
    }
    for case in r["chat"].as_array().unwrap() {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        assert_eq!(
            tok.apply_chat_template(&messages, add).unwrap(),
            case["rendered"].as_str().unwrap()
        );
        assert_eq!(tok.encode_chat(&messages, add).unwrap(), ints(&case["ids"]));
    }
    assert_eq!(tok.eos_token_ids(), &[r["eos_token_id"].as_i64().unwrap()]);
    assert_eq!(tok.pad_token_id(), r["pad_token_id"].as_i64());
    // qwen2's generation config lists two eos ids; both count.
    let qwen = Tokenizer::load(&fixtures().join("models/tiny-qwen2")).unwrap();
    assert_eq!(qwen.eos_token_ids(), &[2, 0]);
}

#[test]
fn arith_sft_greedy_completions_match_transformers_on_all_500_pairs() {
    use weir_gpu::{generate, Message, SamplingParams, Tokenizer};
    let dir = fixtures().join("models/arith-sft");
    let r = reference("arith-sft");
    let tok = Tokenizer::load(&dir).unwrap();
    let model = load("arith-sft", Kind::Float);
    let pairs: Vec<Vec<i64>> = r["eval_pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let prompts: Vec<Vec<i64>> = pairs
        .iter()
        .map(|p| {
            tok.encode_chat(
                &[Message {
                    role: "user".into(),
                    content: format!("Compute: {}+{}", p[0], p[1]),
                }],
                true,
            )
            .unwrap()
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: 6,
        greedy: true,
        eos_token_ids: tok.eos_token_ids().to_vec(),
        ..Default::default()
    };
    let out = generate(&model, &prompts, &params).unwrap();
    let expected: Vec<Vec<i64>> = r["greedy_completion_ids_fp32"]
        .as_array()
        .unwrap()
        .iter()
        .map(ints)
        .collect();
    let mismatches: Vec<usize> = (0..pairs.len())
        .filter(|&i| out[i].tokens != expected[i])
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of 500 completions differ, first at pair {:?}",
        mismatches.len(),
        mismatches.first().map(|&i| &pairs[i])
    );
    let correct = out
        .iter()
        .zip(&pairs)
        .filter(|(g, p)| tok.decode(&g.tokens, true).unwrap().trim() == (p[0] + p[1]).to_string())
        .count();
    let accuracy = correct as f64 / pairs.len() as f64;
    assert!(
        (accuracy - r["greedy_accuracy_fp32"].as_f64().unwrap()).abs() < 1e-9,
        "accuracy {accuracy}"
    );
}

#[test]
fn save_then_load_is_bit_identical_and_snapshots_cross_instances() {
    for name in ["tiny-qwen2", "tiny-llama-rm", "tiny-qwen3"] {
        let model = load(name, Kind::Float);
        let dir = tempfile::tempdir().unwrap();
        model.save(dir.path(), None).unwrap();
        for file in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(dir.path().join(file).is_file(), "{name}: {file} not saved");
        }
        let back = Model::load(dir.path(), Device::Cpu, Kind::Float).unwrap();
        assert_eq!(back.config, model.config);
        for ((a, ta), (b, tb)) in model
            .named_tensors()
            .iter()
            .zip(back.named_tensors().iter())
        {
            assert_eq!(a, b);
            assert!(ta.equal(tb), "{name}: {a} changed in the round trip");
        }
        // Tied checkpoints stay tied: no lm_head.weight is written.
        let saved = Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
        assert_eq!(
            saved.iter().any(|(n, _)| n == "lm_head.weight"),
            !model.config.tie_word_embeddings && model.config.head == weir_gpu::Head::CausalLm
        );
    }
    // A snapshot moves weights between instances of other dtypes, with its version.
    let source = load("tiny-llama", Kind::Float);
    let bytes = source.export_snapshot(7).unwrap();
    let mut target = load("tiny-llama", Kind::Double);
    {
        let _g = tch::no_grad_guard();
        for (_, mut t) in target.named_tensors() {
            let _ = t.f_zero_().unwrap();
        }
    }
    assert_eq!(target.apply_snapshot(&bytes).unwrap(), 7);
    let ids = Tensor::from_slice(&[1i64, 286, 202, 305, 29]).view([1, -1]);
    let a = source.logits(&ids, None, None).unwrap();
    let b = target
        .logits(&ids, None, None)
        .unwrap()
        .to_kind(Kind::Float);
    assert!((a - b).abs().max().double_value(&[]) < 1e-4);
    // A snapshot of another architecture is refused with the tensor's name.
    let other = load("tiny-qwen2", Kind::Float).export_snapshot(1).unwrap();
    let err = target.apply_snapshot(&other).unwrap_err().to_string();
    assert!(err.contains("weights snapshot"), "{err}");
    // bf16 saving: loadable, close to fp32.
    let dir = tempfile::tempdir().unwrap();
    source.save(dir.path(), Some(Kind::BFloat16)).unwrap();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let half = Model::load(dir.path(), Device::Cpu, Kind::Float).unwrap();
    let d = (source.logits(&ids, None, None).unwrap() - half.logits(&ids, None, None).unwrap())
        .abs()
        .max()
        .double_value(&[]);
    assert!(d > 0.0 && d < 0.5, "bf16 round trip moved logits by {d}");
}

#[test]
fn adamw_training_lowers_the_loss_and_critics_load_from_lm_or_rm() {
    use weir_gpu::optim::{AdamWConfig, Optimizer};
    let model = load("tiny-llama", Kind::Float);
    let ids = Tensor::from_slice(&[1i64, 286, 202, 305, 29, 224, 26, 14, 27, 25, 2]).view([1, -1]);
    let mut opt = Optimizer::adamw(
        &model,
        AdamWConfig {
            lr: 1e-2,
            ..Default::default()
        },
    )
    .unwrap();
    let loss_of = |m: &Model| -m.token_logprobs(&ids, None, 1.0).unwrap().mean(Kind::Float);
    let first = loss_of(&model).double_value(&[]);
    let mut norms = Vec::new();
    for _ in 0..5 {
        opt.zero_grad();
        loss_of(&model).backward();
        norms.push(opt.step(Some(1.0)));
    }
    let last = loss_of(&model).double_value(&[]);
    assert!(norms.iter().all(|n| n.is_finite() && *n > 0.0), "{norms:?}");
    assert!(last < first - 0.1, "loss {first} → {last}");

    // A critic from a causal LM: fresh one-output head, values on every position.
    let critic = Model::load_critic(
        &fixtures().join("models/tiny-llama"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    let values = critic.position_scores(&ids, None).unwrap();
    assert_eq!(values.size(), vec![1, 11, 1]);
    assert!(values.abs().max().double_value(&[]) > 0.0);
    // A critic from a reward model is the reward model.
    let rm = reference("tiny-llama-rm");
    let critic = Model::load_critic(
        &fixtures().join("models/tiny-llama-rm"),
        Device::Cpu,
        Kind::Float,
    )
    .unwrap();
    let case = &rm["single"][0];
    let ids = Tensor::from_slice(&ints(&case["input_ids"])).view([1, -1]);
    let d = max_diff(
        &critic.position_scores(&ids, None).unwrap(),
        &floats(&case["per_position_scores"]),
    );
    assert!(d < 1e-4, "critic values differ by {d:e}");
}

/// Checkpoint variants made by `tests/data/make_variants.py` with transformers:
/// llama3 RoPE + biases, MQA + tied, Mistral, sharded bf16 Qwen2, Qwen3 with a
/// wide head and linear RoPE; float64 within 1e-8 (bf16 weights: exactly the
/// same values after the cast), fp32 within 1e-4.
#[test]
fn checkpoint_variants_match_transformers() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/variants");
    let mut names: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    assert_eq!(names.len(), 5);
    for dir in names {
        let r: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let ids = matrix(&r["input_ids"]);
        let mask = matrix(&r["attention_mask"]);
        let per_row = r["logits"][0][0].as_array().unwrap().len();
        let reference: Vec<Option<f64>> = r["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|b| {
                b.as_array().unwrap().iter().flat_map(|row| {
                    if row.is_null() {
                        vec![None; per_row]
                    } else {
                        flat(row)
                    }
                })
            })
            .collect();
        for (kind, tol) in [(Kind::Double, 1e-8), (Kind::Float, 1e-4)] {
            let model = Model::load(&dir, Device::Cpu, kind).unwrap();
            let logits = model.logits(&ids, Some(&mask), None).unwrap();
            let d = max_diff(&logits, &reference);
            assert!(
                d < tol,
                "{} {kind:?}: logits differ by {d:e}",
                dir.display()
            );
        }
    }
}
