//! The SFT, reward-model and DPO trainers' losses through the tiny fixture
//! models against OpenRLHF 0.11.2's loss classes on transformers' float64
//! forward passes (`tests/data/pair_losses.json`, made by
//! `scripts/record_pair_losses.py`): the masking of prompt and padding, the
//! summed response log-probs, the pooling at the last token and the
//! step-wide means, not only the formulas.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{ArrayRef, StringArray};
use serde_json::Value;
use weir_graph::{Stage, WorkerInfo};

use super::*;
use crate::data::columns::token_list_array;
use crate::stages::sft::{SftConfig, SftTrainer};

/// float32 here against float64 there: relative, past 1.
fn close(ours: f64, theirs: f64) -> bool {
    (ours - theirs).abs() <= 2e-4 * theirs.abs().max(1.0)
}

fn recording() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/pair_losses.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn model(name: &str) -> Model {
    Model::load(&fixture(name), weir_gpu::Device::Cpu, Kind::Float).unwrap()
}

fn tokenizer() -> Tokenizer {
    Tokenizer::load(&fixture("tiny-llama")).unwrap()
}

fn id_lists(v: &Value) -> Vec<Vec<i64>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect()
        })
        .collect()
}

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The recorded rows as a step's batch: prompt tokens, and the chosen,
/// rejected and margin columns as text.
fn batch(r: &Value) -> RecordBatch {
    let rows = r["rows"].as_array().unwrap();
    let column = |key: &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(
            |row| match &row[key] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            },
        )))
    };
    RecordBatch::try_from_iter([
        (
            col::PROMPT_TOKENS,
            token_list_array(&id_lists(&r["prompt_ids"])),
        ),
        ("chosen", column("chosen")),
        ("rejected", column("rejected")),
        ("margin", column("margin")),
    ])
    .unwrap()
}

fn pair_config(margin: bool) -> PairConfig {
    PairConfig {
        adamw: AdamWConfig::default(),
        schedule: LrSchedule::Constant { warmup: 0 },
        max_grad_norm: None,
        chosen: "chosen".into(),
        rejected: "rejected".into(),
        margin: margin.then(|| "margin".into()),
    }
}

/// One step of `stage` on `batch`: its recorded metrics.
fn step(stage: &mut dyn Stage, batch: RecordBatch) -> BTreeMap<String, f64> {
    let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
    stage.process(&mut ctx, batch).unwrap();
    stage.end_step(&mut ctx).unwrap();
    ctx.recorded().iter().cloned().collect()
}

#[test]
fn the_rows_are_tokenised_as_recorded() {
    let r = recording();
    let tok = tokenizer();
    let b = batch(&r);
    assert_eq!(
        response_targets(&b, "chosen", &tok, "t").unwrap(),
        id_lists(&r["chosen_ids"])
    );
    assert_eq!(
        response_targets(&b, "rejected", &tok, "t").unwrap(),
        id_lists(&r["rejected_ids"])
    );
    for (row, prompt) in r["rows"]
        .as_array()
        .unwrap()
        .iter()
        .zip(id_lists(&r["prompt_ids"]))
    {
        let message = weir_gpu::Message {
            role: "user".into(),
            content: row["prompt"].as_str().unwrap().into(),
        };
        assert_eq!(tok.encode_chat(&[message], true).unwrap(), prompt);
    }
}

#[test]
fn sft_loss_is_openrlhfs_token_mean_through_the_model() {
    let r = recording();
    let want = number(&r["sft_loss"]);
    // One micro-batch, and one row a micro-batch with the output head in
    // chunks of two positions: the step's token mean either way.
    for (micro_batch, logprob_chunk) in [(8, 0), (1, 2)] {
        let cfg = SftConfig {
            adamw: AdamWConfig::default(),
            schedule: LrSchedule::Constant { warmup: 0 },
            max_grad_norm: None,
            micro_batch,
            gradient_checkpointing: false,
            logprob_chunk,
        };
        let mut trainer = SftTrainer::new(model("tiny-llama"), tokenizer(), "chosen", cfg).unwrap();
        let (loss, _) = trainer.train_step(&batch(&r)).unwrap();
        assert!(
            close(loss, want),
            "micro-batch {micro_batch}: SFT loss {loss}, OpenRLHF {want}"
        );
    }
}

#[test]
fn reward_model_loss_is_openrlhfs_pairwise_loss_through_the_model() {
    let r = recording();
    for (margin, key) in [(false, "loss"), (true, "loss_with_margin")] {
        let model = weir_gpu::Model::load_critic(
            &fixture("tiny-llama-rm"),
            weir_gpu::Device::Cpu,
            Kind::Float,
        )
        .unwrap();
        let mut trainer = RewardTrainer::new(model, tokenizer(), pair_config(margin)).unwrap();
        let metrics = step(&mut trainer, batch(&r));
        let (ours, want) = (metrics["loss"], number(&r["rm"][key]));
        assert!(close(ours, want), "RM {key}: {ours}, OpenRLHF {want}");
    }
}

#[test]
fn dpo_losses_are_openrlhfs_through_policy_and_reference() {
    let r = recording();
    let d = &r["dpo"];
    let beta = number(&d["beta"]);
    for (name, loss) in [
        ("dpo", PreferenceLoss::Dpo),
        (
            "cdpo",
            PreferenceLoss::Cdpo {
                label_smoothing: number(&d["cdpo"]["label_smoothing"]),
            },
        ),
        ("ipo", PreferenceLoss::Ipo),
    ] {
        let mut trainer = DpoTrainer::new(
            model("tiny-llama"),
            model("arith-sft"),
            tokenizer(),
            pair_config(false),
            beta,
            loss,
        )
        .unwrap();
        let metrics = step(&mut trainer, batch(&r));
        for (ours, theirs) in [
            ("loss", "loss"),
            ("reward_chosen", "reward_chosen"),
            ("reward_rejected", "reward_rejected"),
        ] {
            let (got, want) = (metrics[ours], number(&d[name][theirs]));
            assert!(close(got, want), "{name} {ours}: {got}, OpenRLHF {want}");
        }
    }
}
