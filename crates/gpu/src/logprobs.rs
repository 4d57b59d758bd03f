//! Log-probabilities and entropy from logits, and the language-model head
//! run in chunks (forward and backward).

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

/// The float kind the log-softmax runs in: float32, or float64 for a float64 model.
fn softmax_kind(kind: Kind) -> Kind {
    if kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// Log-probs of `targets` `[N]` under the output head `weight`
/// `[vocab, hidden]` applied to `hidden` `[N, hidden]` at `temperature`
/// (and the entropy at `entropy_at`, a temperature of its own), `chunk`
/// positions at a time: at most `chunk × vocab` logits exist at once,
/// whatever `N`. Without gradients; the gradient is
/// [`head_backward_chunked`]'s. Equal to [`gather_logprobs`] and
/// [`entropy`] over the full logits.
pub fn head_forward_chunked(
    weight: &Tensor,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    entropy_at: Option<f64>,
    chunk: usize,
) -> (Tensor, Option<Tensor>) {
    let _guard = tch::no_grad_guard();
    let n = hidden.size()[0];
    let step = chunk.max(1) as i64;
    let (mut logprobs, mut entropies) = (Vec::new(), Vec::new());
    for start in (0..n).step_by(step as usize) {
        let len = step.min(n - start);
        let logits = hidden.narrow(0, start, len).matmul(&weight.tr());
        let t = targets.narrow(0, start, len);
        logprobs.push(gather_logprobs(&logits, &t, temperature));
        if let Some(at) = entropy_at {
            entropies.push(entropy(&logits, at));
        }
    }
    (
        Tensor::cat(&logprobs, 0),
        entropy_at.map(|_| Tensor::cat(&entropies, 0)),
    )
}

/// The gradient of a loss in `hidden` `[N, hidden]` and in the head's
/// `weight` `[vocab, hidden]`, given its gradient in the log-probs
/// `grad_logprobs` `[N]` (and in the entropy, with the temperature it was
/// measured at) of [`head_forward_chunked`], recomputing the logits
/// `chunk` positions at a time. With logits `x = h·Wᵀ`, `z = x/τ`,
/// `p = softmax(z)`: `∂/∂x = g_lp · (onehot(target) − p) / τ`, and for the
/// entropy at `τ_H` with `q = softmax(x/τ_H)`: `− g_H · q ⊙ (log q + H) / τ_H`;
/// then `∂/∂h = ∂/∂x · W` and `∂/∂W = (∂/∂x)ᵀ · h`.
pub fn head_backward_chunked(
    weight: &Tensor,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    grad_logprobs: &Tensor,
    grad_entropy: Option<(&Tensor, f64)>,
    chunk: usize,
) -> (Tensor, Tensor) {
    let _guard = tch::no_grad_guard();
    let n = hidden.size()[0];
    let step = chunk.max(1) as i64;
    let kind = softmax_kind(hidden.kind());
    let mut grad_weight = weight.zeros_like();
    let mut grad_hidden = Vec::new();
    for start in (0..n).step_by(step as usize) {
        let len = step.min(n - start);
        let h = hidden.narrow(0, start, len);
        let x = h.matmul(&weight.tr()).to_kind(kind);
        let logp = (&x / temperature).log_softmax(-1, kind);
        let p = logp.exp();
        let g = grad_logprobs
            .narrow(0, start, len)
            .to_kind(kind)
            .unsqueeze(-1);
        let mut dz = -(&p * &g);
        let _ = dz.scatter_add_(-1, &targets.narrow(0, start, len).unsqueeze(-1), &g);
        let mut dx = dz / temperature;
        if let Some((ge, at)) = grad_entropy {
            let ge = ge.narrow(0, start, len).to_kind(kind).unsqueeze(-1);
            let logq = if at == temperature {
                logp.shallow_clone()
            } else {
                (&x / at).log_softmax(-1, kind)
            };
            let q = logq.exp();
            let h_ent = -(&q * &logq).sum_dim_intlist(-1, true, kind);
            dx -= ge * &q * (&logq + h_ent) / at;
        }
        let dlogits = dx.to_kind(weight.kind());
        grad_hidden.push(dlogits.matmul(weight));
        grad_weight += dlogits.tr().matmul(&h);
    }
    (Tensor::cat(&grad_hidden, 0), grad_weight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_and_entropy_by_hand() {
        let logits = Tensor::from_slice(&[0.0f32, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]).view([2, 4]);
        let targets = Tensor::from_slice(&[1i64, 0]);
        let lp = Vec::<f32>::try_from(gather_logprobs(&logits, &targets, 1.0)).unwrap();
        assert!((lp[0] - (0.25f32).ln()).abs() < 1e-6);
        let z = 2.0f32.exp() + 3.0;
        assert!((lp[1] - (2.0 - z.ln())).abs() < 1e-6);
        // Temperature 2 halves the logits.
        let lp2 = Vec::<f32>::try_from(gather_logprobs(&logits, &targets, 2.0)).unwrap();
        assert!((lp2[1] - (1.0 - (1.0f32.exp() + 3.0).ln())).abs() < 1e-6);
        let h = Vec::<f32>::try_from(entropy(&logits, 1.0)).unwrap();
        assert!((h[0] - 4.0f32.ln()).abs() < 1e-6, "uniform over 4: ln 4");
        let p: Vec<f32> = [2.0f32.exp(), 1.0, 1.0, 1.0]
            .iter()
            .map(|e| e / z)
            .collect();
        let want: f32 = -p.iter().map(|p| p * p.ln()).sum::<f32>();
        assert!((h[1] - want).abs() < 1e-6);
    }
}
