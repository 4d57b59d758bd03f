//! The model runtime against float64 transformers references
//! (`tests/fixtures/models/*/reference.json`): logits and token
//! log-probs of single and padded batches (left, right, and the RL layout),
//! reward scores, in fp32 (tolerance 1e-4) and in float64 (tighter).

mod checkpoints;
mod generation;
mod logits;
mod lora;
mod streaming;
mod tokenizer;
mod training;

use std::path::PathBuf;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use weir_gpu::{Device, Model};

pub(crate) fn fixtures() -> PathBuf {
    match std::env::var_os("WEIR_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

pub(crate) fn reference(model: &str) -> Value {
    let path = fixtures().join("models").join(model).join("reference.json");
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

pub(crate) fn load(model: &str, kind: Kind) -> Model {
    Model::load(&fixtures().join("models").join(model), Device::Cpu, kind).unwrap()
}

pub(crate) fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

pub(crate) fn matrix(v: &Value) -> Tensor {
    let rows: Vec<Vec<i64>> = v.as_array().unwrap().iter().map(ints).collect();
    let (b, t) = (rows.len() as i64, rows[0].len() as i64);
    Tensor::from_slice(&rows.concat()).view([b, t])
}

pub(crate) fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().unwrap().iter().map(Value::as_f64).collect()
}

/// Largest |ours − reference| over the entries where the reference has a number.
pub(crate) fn max_diff(ours: &Tensor, reference: &[Option<f64>]) -> f64 {
    let ours: Vec<f64> = Vec::<f64>::try_from(ours.to_kind(Kind::Double).flatten(0, -1)).unwrap();
    assert_eq!(ours.len(), reference.len());
    ours.iter()
        .zip(reference)
        .filter_map(|(o, r)| r.map(|r| (o - r).abs()))
        .fold(0.0, f64::max)
}

/// `[B][T][V]` reference logits with null rows at padding, flattened, a
/// null row standing for `vocab` missing entries (skipped in comparisons).
pub(crate) fn batch_logits(v: &Value, vocab: usize) -> Vec<Option<f64>> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|b| {
            b.as_array().unwrap().iter().flat_map(|row| {
                if row.is_null() {
                    vec![None; vocab]
                } else {
                    flat(row)
                }
            })
        })
        .collect()
}

pub(crate) fn flat(v: &Value) -> Vec<Option<f64>> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Null => vec![None],
        other => vec![other.as_f64()],
    }
}

pub(crate) fn check_causal_lm(name: &str, kind: Kind, tol: f64) {
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
    let mut right_padded_cases = 0;
    for case in r["batched"].as_array().unwrap() {
        let ids = matrix(&case["input_ids"]);
        let mask = matrix(&case["attention_mask"]);
        let positions = matrix(&case["position_ids"]);
        let logits = model.logits(&ids, Some(&mask), Some(&positions)).unwrap();
        let right_padded = mask
            .diff(1, 1, None::<Tensor>, None::<Tensor>)
            .le(0)
            .all()
            .int64_value(&[])
            == 1;
        if right_padded {
            // Padding only on the right: plain causal attention without a mask
            // (SDPA's `is_causal`) gives the same logits at every real token.
            let causal = model.logits(&ids, None, None).unwrap();
            let real = mask.unsqueeze(-1).to_kind(Kind::Bool);
            let d = (causal - &logits)
                .masked_fill(&real.logical_not(), 0.0)
                .abs()
                .max()
                .double_value(&[]);
            assert!(
                d < tol,
                "{name} {kind:?} {}: unmasked causal logits differ by {d:e}",
                case["name"]
            );
            right_padded_cases += 1;
        }
        if !case["logits"].is_null() {
            // Rows at padding are null in the reference and skipped.
            let expanded = batch_logits(&case["logits"], logits.size()[2] as usize);
            assert!(flat(&case["logits"]).len() <= expanded.len());
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
    assert!(right_padded_cases > 0, "{name}: no right-padded case");
}
