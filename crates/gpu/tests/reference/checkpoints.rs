//! Saving, snapshots, training, critics, and checkpoint variants made with transformers.

use super::*;

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
    // Over max_shard_size: shards and an index, as transformers writes them; they load back.
    let model = load("tiny-llama", Kind::Float);
    let dir = tempfile::tempdir().unwrap();
    model.save_sharded(dir.path(), None, 100_000).unwrap();
    assert!(!dir.path().join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let shards: std::collections::BTreeSet<&str> =
        map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(shards.len() > 1, "{shards:?}");
    let n = shards.len();
    for (i, shard) in shards.iter().enumerate() {
        assert_eq!(*shard, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let size = std::fs::metadata(dir.path().join(shard)).unwrap().len();
        let tensors = Tensor::read_safetensors(dir.path().join(shard)).unwrap();
        assert!(
            size <= 100_000 + 4096 || tensors.len() == 1,
            "{shard}: {size} bytes"
        );
    }
    let total: i64 = model
        .named_tensors()
        .iter()
        .map(|(_, t)| t.numel() as i64 * 4)
        .sum();
    assert_eq!(index["metadata"]["total_size"].as_i64(), Some(total));
    let back = Model::load(dir.path(), Device::Cpu, Kind::Float).unwrap();
    for ((a, ta), (b, tb)) in model
        .named_tensors()
        .iter()
        .zip(back.named_tensors().iter())
    {
        assert_eq!(a, b);
        assert!(ta.equal(tb), "{a} changed through shards");
    }
    assert_eq!(weir_gpu::snapshot::parse_size("5GB"), Some(5_000_000_000));
    assert_eq!(weir_gpu::snapshot::parse_size("2GiB"), Some(2 << 30));
    assert_eq!(weir_gpu::snapshot::parse_size("100kb"), Some(100_000));
    assert_eq!(weir_gpu::snapshot::parse_size("1048576"), Some(1 << 20));
    assert_eq!(weir_gpu::snapshot::parse_size("5 parsecs"), None);
    assert_eq!(weir_gpu::snapshot::parse_size("0"), None);

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

    // The update rule is PyTorch's AdamW (libtorch's own, through tch), and a
    // restored state continues exactly where the saved one was.
    use tch::nn::OptimizerConfig;
    let cfg = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..Default::default()
    };
    let (ours, theirs) = (
        load("tiny-llama", Kind::Float),
        load("tiny-llama", Kind::Float),
    );
    let mut opt = Optimizer::adamw(&ours, cfg).unwrap();
    let mut torch_opt = tch::nn::AdamW {
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        wd: cfg.weight_decay,
        eps: cfg.eps,
        amsgrad: false,
    }
    .build(theirs.var_store(), cfg.lr)
    .unwrap();
    for _ in 0..3 {
        opt.zero_grad();
        loss_of(&ours).backward();
        opt.step(None);
        torch_opt.zero_grad();
        loss_of(&theirs).backward();
        torch_opt.step();
    }
    for ((n, a), (_, b)) in ours.named_tensors().iter().zip(theirs.named_tensors()) {
        let d = (a - &b).abs().max().double_value(&[]);
        assert!(d < 1e-6, "{n}: {d}");
    }
    let (state, steps) = opt.state();
    let mut resumed = load("tiny-llama", Kind::Float);
    resumed.var_store_mut().copy(ours.var_store()).unwrap();
    let mut opt2 = Optimizer::adamw(&resumed, cfg).unwrap();
    opt2.load_state(&state, steps).unwrap();
    for (o, m) in [(&mut opt, &ours), (&mut opt2, &resumed)] {
        o.zero_grad();
        loss_of(m).backward();
        o.step(Some(1.0));
    }
    for ((n, a), (_, b)) in ours.named_tensors().iter().zip(resumed.named_tensors()) {
        assert_eq!(
            Vec::<f32>::try_from(a.flatten(0, -1)).unwrap(),
            Vec::<f32>::try_from(b.flatten(0, -1)).unwrap(),
            "{n}"
        );
    }
    assert!(
        opt2.load_state(&state[1..], steps).is_err(),
        "a missing moment is an error"
    );

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
        let vocab = r["logits"][0][0].as_array().unwrap().len();
        let reference = batch_logits(&r["logits"], vocab);
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

/// `ModelConfig::parameter_count` counts every weight a loaded model holds
/// but its biases.
#[test]
fn the_parameter_count_is_the_weights_a_model_loads() {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "arith-sft"] {
        let model = load(name, Kind::Float);
        let weights: i64 = model
            .named_tensors()
            .iter()
            .filter(|(n, _)| !n.ends_with("bias"))
            .map(|(_, t)| t.numel() as i64)
            .sum();
        assert_eq!(model.config.parameter_count(), weights, "{name}");
    }
}
