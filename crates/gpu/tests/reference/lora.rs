//! LoRA adapters: a fresh adapter changes nothing; only adapters train;
//! snapshots carry only them; a LoRA model saves as a PEFT folder that
//! weir (and, by the recorded case, `peft`) loads to the same logits;
//! merged weights compute what the adapters do; models that share frozen
//! weights share their storage and a LoRA model trained over them leaves
//! them untouched.

use weir_gpu::generate::{generate_on, Backend};
use weir_gpu::lora::LoraConfig;
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::SamplingParams;

use super::*;

fn adapters(targets: &[&str]) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
    }
}

fn all_targets() -> LoraConfig {
    adapters(&weir_gpu::lora::TARGET_MODULES)
}

/// Gives every `B` the seeded values PEFT's test case used (so the adapters
/// change the logits): `B[i, j] = 0.02 · sin(1 + 7·n + i·r + j)` for the
/// n-th adapter in name order.
fn set_b(model: &Model) {
    let _guard = tch::no_grad_guard();
    let bs = model
        .adapter_tensors()
        .into_iter()
        .filter(|(name, _)| name.contains("lora_B"));
    for (n, (_, mut b)) in bs.enumerate() {
        let (rows, cols) = (b.size()[0], b.size()[1]);
        let values: Vec<f64> = (0..rows * cols)
            .map(|k| 0.02 * ((1 + 7 * n as i64 + k) as f64).sin())
            .collect();
        b.copy_(
            &Tensor::from_slice(&values)
                .view([rows, cols])
                .to_kind(b.kind()),
        );
    }
}

fn ids() -> Tensor {
    Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 11, 4]).view([2, 4])
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn adapters_train_alone_and_round_trip_as_peft_folders() {
    let base_logits = load("tiny-llama", Kind::Double)
        .logits(&ids(), None, None)
        .unwrap();
    let mut model = load("tiny-llama", Kind::Double);
    model.add_lora(&all_targets(), 3).unwrap();
    // B = 0: a fresh adapter computes what the base does.
    assert_eq!(
        max_abs(&model.logits(&ids(), None, None).unwrap(), &base_logits),
        0.0
    );
    let layers = model.config.num_hidden_layers as usize;
    let trainable = model.trainable_tensors();
    assert_eq!(trainable.len(), layers * 7 * 2);
    assert!(trainable
        .iter()
        .all(|(n, _)| n.starts_with("base_model.model.model.layers.")
            && (n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight"))));
    assert!(model
        .named_tensors()
        .iter()
        .all(|(_, t)| !t.requires_grad()));
    set_b(&model);
    let lora_logits = model.logits(&ids(), None, None).unwrap();
    assert!(max_abs(&lora_logits, &base_logits) > 1e-4);

    // The merged weights compute the same.
    let plain = load("tiny-llama", Kind::Double);
    {
        let merged: std::collections::HashMap<_, _> = model.merged_tensors().into_iter().collect();
        let _guard = tch::no_grad_guard();
        for (name, mut t) in plain.named_tensors() {
            t.copy_(&merged[&name]);
        }
    }
    assert!(max_abs(&plain.logits(&ids(), None, None).unwrap(), &lora_logits) < 1e-10);

    // A snapshot carries the adapters only, and another LoRA model applies it.
    let bytes = model.export_snapshot(5).unwrap();
    let (tensors, _) = weir_gpu::snapshot::from_safetensors(&bytes).unwrap();
    assert_eq!(tensors.len(), trainable.len());
    let mut other = load("tiny-llama", Kind::Double);
    other.add_lora(&all_targets(), 99).unwrap();
    assert_eq!(other.apply_snapshot(&bytes).unwrap(), 5);
    assert!(max_abs(&other.logits(&ids(), None, None).unwrap(), &lora_logits) < 1e-12);
    // A full snapshot is refused by a LoRA model, naming what is missing.
    let full = plain.export_snapshot(1).unwrap();
    let err = other.apply_snapshot(&full).unwrap_err().to_string();
    assert!(err.contains("lora_A"), "{err}");

    // Saved: a PEFT folder (no full weights), loaded back by Model::load.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    model.save(&dir, None).unwrap();
    assert!(dir.join("adapter_config.json").is_file());
    assert!(dir.join("adapter_model.safetensors").is_file());
    assert!(dir.join("tokenizer.json").is_file());
    assert!(!dir.join("model.safetensors").exists());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["peft_type"], "LORA");
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    let again = Model::load(&dir, Device::Cpu, Kind::Double).unwrap();
    assert_eq!(again.lora(), Some(&all_targets()));
    assert!(max_abs(&again.logits(&ids(), None, None).unwrap(), &lora_logits) < 1e-12);

    // `merge_lora` folds them in: a plain model that computes the same.
    let mut merged = Model::load(&dir, Device::Cpu, Kind::Double).unwrap();
    merged.merge_lora().unwrap();
    assert!(merged.lora().is_none() && merged.adapter_tensors().is_empty());
    assert!(max_abs(&merged.logits(&ids(), None, None).unwrap(), &lora_logits) < 1e-10);

    // Only the adapters move in an optimizer step.
    let before: Vec<Tensor> = model
        .named_tensors()
        .into_iter()
        .map(|(_, t)| t.copy())
        .collect();
    let adapters_before: Vec<Tensor> = model
        .adapter_tensors()
        .into_iter()
        .map(|(_, t)| t.copy())
        .collect();
    let mut opt = Optimizer::adamw(&model, AdamWConfig::default()).unwrap();
    model
        .logits(&ids(), None, None)
        .unwrap()
        .log_softmax(-1, Kind::Double)
        .select(2, 3)
        .sum(Kind::Double)
        .backward();
    opt.step(None);
    for ((_, after), before) in model.named_tensors().iter().zip(&before) {
        assert!(after.equal(before));
    }
    let moved = model
        .adapter_tensors()
        .iter()
        .zip(&adapters_before)
        .filter(|((_, a), b)| !a.equal(b))
        .count();
    assert_eq!(moved, adapters_before.len());
}

#[test]
fn adapters_on_chosen_projections_only_and_bad_configs_named() {
    let mut model = load("tiny-qwen2", Kind::Float);
    model.add_lora(&adapters(&["q_proj", "v_proj"]), 1).unwrap();
    let names: Vec<String> = model
        .adapter_tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.len(), model.config.num_hidden_layers as usize * 2 * 2);
    assert!(names
        .iter()
        .all(|n| n.contains(".q_proj.") || n.contains(".v_proj.")));
    for (config, want) in [
        (adapters(&["qkv"]), "target module `qkv`"),
        (
            LoraConfig {
                rank: 0,
                ..all_targets()
            },
            "rank must be positive",
        ),
        (
            LoraConfig {
                dropout: 1.0,
                ..all_targets()
            },
            "dropout",
        ),
    ] {
        let mut fresh = load("tiny-qwen2", Kind::Float);
        let err = fresh.add_lora(&config, 0).unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    let err = model.add_lora(&all_targets(), 0).unwrap_err().to_string();
    assert!(err.contains("already has adapters"), "{err}");
}

/// Greedy generation of a float32 LoRA model on weir's CPU kernels (which
/// run on the merged weights) and on libtorch (adapters unmerged) agree.
#[test]
fn the_cpu_kernels_generate_what_the_adapters_compute() {
    let mut model = load("tiny-llama", Kind::Float);
    model.add_lora(&all_targets(), 5).unwrap();
    set_b(&model);
    let prompts = vec![vec![1i64, 5, 9], vec![2, 7]];
    let params = SamplingParams {
        max_new_tokens: 6,
        greedy: true,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let run = |backend| {
        generate_on(&model, &prompts, &[0, 1], &params, backend)
            .unwrap()
            .into_iter()
            .map(|g| g.tokens)
            .collect::<Vec<_>>()
    };
    let torch = run(Backend::Torch);
    assert_eq!(run(Backend::Auto), torch);
    let base = load("tiny-llama", Kind::Float);
    let plain: Vec<_> = generate_on(&base, &prompts, &[0, 1], &params, Backend::Torch)
        .unwrap()
        .into_iter()
        .map(|g| g.tokens)
        .collect();
    assert_ne!(plain, torch, "the adapters should change the greedy tokens");
}

#[test]
fn shared_frozen_weights_are_one_copy_and_stay_frozen() {
    let dir = fixtures().join("models").join("tiny-llama");
    let reference = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut policy = Model::load_shared(&dir, Device::Cpu, Kind::Float).unwrap();
    for ((name, a), (_, b)) in reference.named_tensors().iter().zip(policy.named_tensors()) {
        assert_eq!(a.data_ptr(), b.data_ptr(), "{name} is a second copy");
    }
    let want = load("tiny-llama", Kind::Float)
        .logits(&ids(), None, None)
        .unwrap();
    assert_eq!(
        max_abs(&reference.logits(&ids(), None, None).unwrap(), &want),
        0.0
    );
    policy.add_lora(&all_targets(), 2).unwrap();
    let mut opt = Optimizer::adamw(
        &policy,
        AdamWConfig {
            lr: 0.1,
            ..AdamWConfig::default()
        },
    )
    .unwrap();
    for _ in 0..2 {
        opt.zero_grad();
        policy
            .logits(&ids(), None, None)
            .unwrap()
            .select(2, 3)
            .sum(Kind::Float)
            .backward();
        opt.step(None);
    }
    assert!(max_abs(&policy.logits(&ids(), None, None).unwrap(), &want) > 1e-4);
    assert_eq!(
        max_abs(&reference.logits(&ids(), None, None).unwrap(), &want),
        0.0
    );
    let err = policy.merge_lora().unwrap_err().to_string();
    assert!(err.contains("shared"), "{err}");
}

/// The adapter folder weir writes, loaded by `peft` 0.21 onto the float64
/// transformers model (`scripts/record_peft_lora.py`), gives these logits:
/// the layout (names, shapes, config) is PEFT's.
#[test]
fn peft_loads_weirs_adapter_folder_to_the_same_logits() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/peft_lora_logits.json");
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut model = load("tiny-llama", Kind::Double);
    model.add_lora(&all_targets(), 3).unwrap();
    set_b(&model);
    if let Ok(out) = std::env::var("WEIR_WRITE_PEFT_CASE") {
        // How the recorded case was made: this folder, then the script.
        model
            .save(std::path::Path::new(&out), Some(Kind::Float))
            .unwrap();
    }
    let ids = matrix(&recorded["input_ids"]);
    let logits = model.logits(&ids, None, None).unwrap();
    let want: Vec<Option<f64>> = flat(&recorded["logits"]);
    // The folder holds float32 adapters; the recording ran on them.
    let d = max_diff(&logits, &want);
    assert!(d < 1e-5, "logits differ from peft's by {d:e}");
    assert_eq!(recorded["missing_keys"], serde_json::json!([]));
    assert_eq!(recorded["unexpected_keys"], serde_json::json!([]));
    assert!(recorded["base_differs_by"].as_f64().unwrap() > 1e-3);
}
