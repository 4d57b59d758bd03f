//! Logits, log-probs and reward scores against the references; broken checkpoints.

use super::*;

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
    // A config with fewer layers than the weights hold: refused, naming a
    // tensor it has no place for (not a model that quietly drops a layer).
    let mut fewer: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let layers = fewer["num_hidden_layers"].as_i64().unwrap();
    fewer["num_hidden_layers"] = (layers - 1).into();
    std::fs::write(dir.path().join("config.json"), fewer.to_string()).unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("model.layers.{}.", layers - 1)) && err.contains("no place for"),
        "{err}"
    );
    // Damaged weights files: cut short, a header longer than the file, an
    // unreadable header, a tensor whose bytes do not match its shape.
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let file = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&file[8..8 + n]).unwrap().to_string();
    let wrong_shape = {
        // The first shape's first size, one larger (same header length).
        let at = header.find("\"shape\":[").unwrap() + 9;
        let digit = header.as_bytes()[at];
        let mut h = header.clone().into_bytes();
        h[at] = if digit == b'9' { b'1' } else { digit + 1 };
        [&file[..8], &h[..], &file[8 + n..]].concat()
    };
    let fp8 = {
        // The first tensor's dtype an FP8 one (a well-formed file weir cannot read).
        let at = header.find("\"dtype\":\"").unwrap() + 9;
        let end = at + header[at..].find('"').unwrap();
        let h = format!("{}F8_E4M3{}", &header[..at], &header[end..]);
        [
            &(h.len() as u64).to_le_bytes()[..],
            h.as_bytes(),
            &file[8 + n..],
        ]
        .concat()
    };
    for (case, bytes, says) in [
        (
            "cut short",
            file[..file.len() - 100].to_vec(),
            "ends at byte",
        ),
        (
            "header too long",
            [&(1u64 << 40).to_le_bytes()[..], &file[8..]].concat(),
            "header",
        ),
        (
            "no JSON",
            [&file[..8], &vec![b'x'; n][..], &file[8 + n..]].concat(),
            "not JSON",
        ),
        ("a wrong shape", wrong_shape, "is not its"),
        (
            "quantized",
            fp8,
            "dtype `F8_E4M3`, which weir does not read",
        ),
        ("empty", Vec::new(), "header's length"),
    ] {
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.safetensors") && err.contains(says),
            "{case}: {err}"
        );
        assert_eq!(
            err.contains("not a safetensors file"),
            case != "quantized",
            "{err}"
        );
    }
    // Crafted files: a dimension past i64 (with a zero beside it, so the
    // byte count adds up), and configs that ask for far more weights than
    // the files hold. Each is refused before anything is allocated.
    let huge_dim = {
        let h = r#"{"t":{"dtype":"F32","shape":[9223372036854775808,0],"data_offsets":[0,0]}}"#;
        [&(h.len() as u64).to_le_bytes()[..], h.as_bytes()].concat()
    };
    std::fs::write(dir.path().join("model.safetensors"), huge_dim).unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("9223372036854775808 is too large"),
        "{err}"
    );
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let original: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (key, value, named) in [
        ("vocab_size", json!(1_000_000_000_000i64), "vocab_size"),
        // With intermediate_size 2^40 too, 3·h·i overflows i64: the count
        // saturates, no panic.
        ("hidden_size", json!(1i64 << 40), "hidden_size"),
        ("intermediate_size", json!(1i64 << 50), "intermediate_size"),
        (
            "num_hidden_layers",
            json!(1_000_000_000i64),
            "num_hidden_layers",
        ),
    ] {
        let mut crafted = original.clone();
        crafted[key] = value;
        if key == "hidden_size" {
            crafted["intermediate_size"] = json!(1i64 << 40);
            crafted["head_dim"] = json!(original["head_dim"].as_i64().unwrap_or(16));
        }
        std::fs::write(dir.path().join("config.json"), crafted.to_string()).unwrap();
        for load in [Model::load, Model::load_critic] {
            let err = load(dir.path(), Device::Cpu, Kind::Float)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("config.json") && err.contains(named) && !err.contains('\n'),
                "{key}: {err}"
            );
        }
    }
    // Malformed JSON.
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = Model::load(dir.path(), Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(err.contains("config.json"), "{err}");
}

/// Rows packed end to end give each row's own hidden states, and their
/// gradients, whatever attention buckets the lengths fall into: very long
/// rows alone, short ones sharing a call, a one-token row (float64; tiny
/// Llama, and tiny Qwen3 with its q/k norms and grouped keys).
#[test]
fn packed_rows_attend_within_themselves_in_buckets() {
    for family in ["tiny-llama", "tiny-qwen3"] {
        packed_rows_of(family);
    }
}

fn packed_rows_of(family: &str) {
    let model = load(family, Kind::Double);
    let vocab = model.config.vocab_size;
    // Long rows in buckets of their own, a run of short ones together.
    let lengths = [150i64, 3, 97, 1, 20, 140, 12, 12, 5, 60];
    tch::manual_seed(11);
    let rows: Vec<Tensor> = lengths
        .iter()
        .map(|&n| Tensor::randint(vocab, [1, n], (Kind::Int64, tch::Device::Cpu)))
        .collect();
    let packed = Tensor::cat(&rows, 1);
    let hidden = model
        .hidden_states_packed(&packed, &weir_gpu::PackedLayout::rows(&lengths))
        .unwrap();
    let weights = Tensor::randn(hidden.size().as_slice(), (Kind::Double, tch::Device::Cpu));
    (&hidden * &weights).sum(Kind::Double).backward();
    let packed_grads = take_grads(&model);
    let mut at = 0;
    for (row, &n) in rows.iter().zip(&lengths) {
        let alone = model.hidden_states(row, None, None).unwrap();
        let d = (&alone - hidden.narrow(1, at, n))
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            d < 1e-10,
            "{family}: row of {n} tokens at {at}: differs by {d:e}"
        );
        (&alone * weights.narrow(1, at, n))
            .sum(Kind::Double)
            .backward();
        at += n;
    }
    assert_grads(&model, &packed_grads);
}

/// A group's shared prompt packed once, each sample's response a row that
/// attends to it: every response's states and the gradients of a loss on
/// them are those of each prompt + response run alone (float64), the
/// prompt's states those of the prompt alone (tiny Llama, and tiny Qwen3
/// with its q/k norms).
#[test]
fn a_shared_prompt_packed_once_gives_each_rows_own_states() {
    for family in ["tiny-llama", "tiny-qwen3"] {
        shared_prompt_of(family);
    }
}

fn shared_prompt_of(family: &str) {
    use weir_gpu::{AttentionRow, PackedLayout};
    let model = load(family, Kind::Double);
    let vocab = model.config.vocab_size;
    tch::manual_seed(5);
    let prompt = Tensor::randint(vocab, [1, 9], (Kind::Int64, tch::Device::Cpu));
    let lengths = [4i64, 1, 30, 7];
    let responses: Vec<Tensor> = lengths
        .iter()
        .map(|&n| Tensor::randint(vocab, [1, n], (Kind::Int64, tch::Device::Cpu)))
        .collect();
    let p = 9i64;
    let mut positions: Vec<i64> = (0..p).collect();
    let mut rows = vec![AttentionRow {
        keys: (0..p).collect(),
        context: 0,
    }];
    let mut at = p;
    for &n in &lengths {
        positions.extend(p..p + n);
        rows.push(AttentionRow {
            keys: (0..p).chain(at..at + n).collect(),
            context: p as usize,
        });
        at += n;
    }
    let layout = PackedLayout { positions, rows };
    let mut parts = vec![prompt.shallow_clone()];
    parts.extend(responses.iter().map(Tensor::shallow_clone));
    let hidden = model
        .hidden_states_packed(&Tensor::cat(&parts, 1), &layout)
        .unwrap();
    let weights = Tensor::randn(hidden.size().as_slice(), (Kind::Double, tch::Device::Cpu));
    let _ = weights.narrow(1, 0, p).fill_(0.0);
    (&hidden * &weights).sum(Kind::Double).backward();
    let packed_grads = take_grads(&model);
    let alone = model.hidden_states(&prompt, None, None).unwrap();
    let d = (&alone - hidden.narrow(1, 0, p))
        .abs()
        .max()
        .double_value(&[]);
    assert!(d < 1e-10, "{family}: the prompt's states differ by {d:e}");
    let mut at = p;
    for (r, &n) in responses.iter().zip(&lengths) {
        let alone = model
            .hidden_states(
                &Tensor::cat(&[prompt.shallow_clone(), r.shallow_clone()], 1),
                None,
                None,
            )
            .unwrap()
            .narrow(1, p, n);
        let d = (&alone - hidden.narrow(1, at, n))
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            d < 1e-10,
            "{family}: a response of {n} tokens differs by {d:e}"
        );
        (&alone * weights.narrow(1, at, n))
            .sum(Kind::Double)
            .backward();
        at += n;
    }
    assert_grads(&model, &packed_grads);
    // A layout that leaves a position without a query row is refused.
    let mut broken = layout.clone();
    broken.rows.pop();
    let err = model
        .hidden_states_packed(&Tensor::cat(&parts, 1), &broken)
        .unwrap_err()
        .to_string();
    assert!(err.contains("query of no attention row"), "{err}");
}

/// Every parameter's gradient (none for the output head, which hidden
/// states do not reach), then zeroed.
fn take_grads(model: &Model) -> Vec<Option<Tensor>> {
    model
        .named_tensors()
        .into_iter()
        .map(|(_, mut t)| {
            let g = t.grad().defined().then(|| t.grad().copy());
            t.zero_grad();
            g
        })
        .collect()
}

/// The gradients now equal `before` to float32 rounding, relative to the
/// largest: the RMS norms compute in float32 as transformers' do, so a
/// gradient that reaches a shared position summed (packed once) or in
/// turns (each row alone) rounds there at float32.
fn assert_grads(model: &Model, before: &[Option<Tensor>]) {
    for ((name, t), g) in model.named_tensors().iter().zip(before) {
        let Some(g) = g else {
            assert!(!t.grad().defined(), "{name}");
            continue;
        };
        let d = (t.grad() - g).abs().max().double_value(&[]);
        let largest = g.abs().max().double_value(&[]);
        assert!(
            d <= 1e-6 * largest.max(1.0),
            "gradient of {name} differs by {d:e} (largest {largest:e})"
        );
    }
}
