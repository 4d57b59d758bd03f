//! Log-probabilities and entropy from logits, and response log-probs on
//! weir's CPU kernels.

use tch::{Kind, Tensor};

use crate::{Model, ModelError};

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

/// `log p(responses[r][j] | prompts[r] ++ responses[r][..j])` at
/// `temperature` for every response token, without gradients, on weir's CPU
/// kernels (equal prompts run once). An error where they do not apply
/// ([`cpu_kernels_apply`](crate::generate::cpu_kernels_apply)): use `Model::logits` there.
pub fn response_logprobs_on_cpu_kernels(
    model: &Model,
    prompts: &[Vec<i64>],
    responses: &[Vec<i64>],
    temperature: f64,
) -> Result<Vec<Vec<f32>>, ModelError> {
    if prompts.len() != responses.len() {
        return Err(ModelError::Input(format!(
            "{} prompts for {} responses",
            prompts.len(),
            responses.len()
        )));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(ModelError::Input(format!(
            "temperature must be positive, got {temperature}"
        )));
    }
    crate::generate::check_prompts(model, prompts, responses)?;
    if !crate::generate::cpu_kernels_apply(model) {
        return Err(ModelError::Input(
            "the CPU kernels need a float32 causal LM on an x86-64 CPU with AVX2 and FMA".into(),
        ));
    }
    #[cfg(target_arch = "x86_64")]
    return crate::cpu::run::response_logprobs(model, prompts, responses, temperature);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("cpu_kernels_apply is false off x86-64")
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
