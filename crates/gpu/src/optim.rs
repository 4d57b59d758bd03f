//! Training a model: AdamW over its `VarStore` with gradient-norm clipping.

use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};

use crate::model::Model;
use crate::ModelError;

/// AdamW settings (PyTorch's defaults, weight decay 0.0 as RLHF trainers use).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// An AdamW optimiser over one model's parameters.
pub struct Optimizer {
    inner: nn::Optimizer,
    params: Vec<Tensor>,
}

impl Optimizer {
    /// AdamW over every trainable parameter of `model`.
    pub fn adamw(model: &Model, config: AdamWConfig) -> Result<Self, ModelError> {
        let adamw = nn::AdamW {
            beta1: config.beta1,
            beta2: config.beta2,
            wd: config.weight_decay,
            eps: config.eps,
            amsgrad: false,
        };
        let inner = adamw.build(model.var_store(), config.lr)?;
        Ok(Optimizer {
            inner,
            params: model.var_store().trainable_variables(),
        })
    }

    /// Sets the learning rate (for warm-up and schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }

    /// Clears the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.inner.zero_grad();
    }

    /// The global L2 norm of the accumulated gradients.
    pub fn grad_norm(&self) -> f64 {
        let total: f64 = self
            .params
            .iter()
            .map(|p| p.grad())
            .filter(|g| g.defined())
            .map(|g| {
                g.to_kind(Kind::Double)
                    .pow_tensor_scalar(2)
                    .sum(Kind::Double)
                    .double_value(&[])
            })
            .sum();
        total.sqrt()
    }

    /// Clips the gradients to `max_norm` (if given), steps, and returns the
    /// norm before clipping. Gradients must have been accumulated with
    /// `backward()` on one or more micro-batch losses.
    pub fn step(&mut self, max_norm: Option<f64>) -> f64 {
        let norm = self.grad_norm();
        if let Some(max) = max_norm {
            self.inner.clip_grad_norm(max);
        }
        self.inner.step();
        norm
    }
}
