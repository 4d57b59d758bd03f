//! Rotary position embeddings, computed the way transformers computes them:
//! inverse frequencies and the cos/sin tables in float32 whatever the model's
//! dtype, then cast. (A true float64 table differs from transformers by
//! ~1e-6 in the logits.)

use tch::{Device, Kind, Tensor};

use crate::config::{ModelConfig, RopeScaling};

/// The inverse frequencies of one model.
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    /// Builds the (scaled) inverse frequencies for `config` on `device`.
    pub fn new(config: &ModelConfig, device: Device) -> Self {
        let dim = config.head_dim;
        let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device))
            .to_kind(Kind::Float)
            / dim as f64;
        let mut inv_freq = (Tensor::from(config.rope_theta as f32)
            .to_device(device)
            .pow(&exponents))
        .reciprocal();
        match config.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => inv_freq /= factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_freq_wavelen = old / low_freq_factor;
                let high_freq_wavelen = old / high_freq_factor;
                let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
                let scaled =
                    inv_freq.where_self(&wavelen.le(low_freq_wavelen), &(&inv_freq / factor));
                let smooth = (wavelen.reciprocal() * old - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                let smoothed =
                    (smooth.ones_like() - &smooth) * &scaled / factor + &smooth * &scaled;
                let medium = wavelen
                    .ge(high_freq_wavelen)
                    .logical_and(&wavelen.le(low_freq_wavelen));
                inv_freq = smoothed.where_self(&medium, &scaled);
            }
        }
        Rope {
            inv_freq: inv_freq.to_kind(Kind::Float),
        }
    }

    /// cos and sin tables `[B, T, head_dim]` for `position_ids` `[B, T]`, in `kind`.
    pub fn tables(&self, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs =
            position_ids.to_kind(Kind::Float).unsqueeze(-1) * self.inv_freq.view([1, 1, -1]);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// Applies RoPE to `x` `[B, H, T, D]` with tables `[B, T, D]`.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
}
