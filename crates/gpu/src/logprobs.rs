//! Log-probabilities and entropy from logits.

use tch::{Kind, Tensor};

/// `log_softmax(logits / temperature)` at `targets`: `[.., V]` and `[..]` → `[..]`, in float32 or better.
pub fn gather_logprobs(logits: &Tensor, targets: &Tensor, temperature: f64) -> Tensor {
    let kind = if logits.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let scaled = if temperature == 1.0 {
        logits.to_kind(kind)
    } else {
        logits.to_kind(kind) / temperature
    };
    scaled
        .log_softmax(-1, kind)
        .gather(-1, &targets.unsqueeze(-1), false)
        .squeeze_dim(-1)
}

/// Entropy of `softmax(logits / temperature)` over the last dimension.
pub fn entropy(logits: &Tensor, temperature: f64) -> Tensor {
    let kind = if logits.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let logp = (logits.to_kind(kind) / temperature).log_softmax(-1, kind);
    -(logp.exp() * &logp).sum_dim_intlist(-1, false, kind)
}
