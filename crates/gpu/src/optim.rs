//! Training a model: AdamW over its `VarStore` with gradient-norm clipping.

use tch::{Kind, Tensor};

use crate::collective::GroupMember;
use crate::error::ModelError;
use crate::model::Model;

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

/// An AdamW optimiser over one model's parameters, PyTorch's update rule
/// (decoupled decay, bias-corrected moments), with its state exposed so a
/// checkpoint can save and restore it.
///
/// Moments are float32. A half-precision parameter (bf16, f16) has a float32
/// master copy that the update applies to, and the parameter is the master
/// rounded: updates smaller than the parameter's rounding step accumulate
/// instead of being lost (mixed-precision training as DeepSpeed's and FSDP's).
pub struct Optimizer {
    config: AdamWConfig,
    lr: f64,
    /// One per trainable parameter, sorted by name.
    slots: Vec<Slot>,
    /// Optimizer steps taken.
    steps: u64,
    /// libtorch's own optimizer over the same parameters, never stepped:
    /// its `zero_grad` sets every gradient to none (freeing it), which no
    /// other call of libtorch's C API does.
    gradient_release: tch::COptimizer,
}

/// A parameter and its optimizer state.
struct Slot {
    name: String,
    param: Tensor,
    /// First moment (float32).
    m: Tensor,
    /// Second moment (float32).
    v: Tensor,
    /// The float32 master copy of a half-precision parameter.
    master: Option<Tensor>,
}

/// Whether a parameter of `kind` trains through a float32 master copy.
fn needs_master(kind: Kind) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half)
}

impl Optimizer {
    /// AdamW over every trainable parameter of `model` (a LoRA model's adapters).
    pub fn adamw(model: &Model, config: AdamWConfig) -> Result<Self, ModelError> {
        let slots = model
            .trainable_tensors()
            .into_iter()
            .map(|(name, p)| {
                let m = p.zeros_like().to_kind(Kind::Float);
                let v = p.zeros_like().to_kind(Kind::Float);
                let master = needs_master(p.kind()).then(|| p.detach().to_kind(Kind::Float));
                Slot {
                    name,
                    param: p,
                    m,
                    v,
                    master,
                }
            })
            .collect::<Vec<Slot>>();
        let mut gradient_release = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?;
        for slot in &slots {
            gradient_release.add_parameters(&slot.param, 0)?;
        }
        Ok(Optimizer {
            config,
            lr: config.lr,
            slots,
            steps: 0,
            gradient_release,
        })
    }

    /// Sets the learning rate (for warm-up and schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// The learning rate the last step took (the one [`Optimizer::set_lr`] set).
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Clears the accumulated gradients: sets them to none, as PyTorch's
    /// `zero_grad()` does, so their memory is free until the next backward
    /// pass allocates them again, layer by layer as it frees the
    /// activations (zeroed gradients would sit beside the next forward's
    /// activations at its peak). [`Optimizer::step`] ends with this.
    pub fn zero_grad(&mut self) {
        if self.gradient_release.zero_grad().is_err() {
            // Never seen; zeroed gradients serve the next step alike.
            for slot in &mut self.slots {
                let mut g = slot.param.grad();
                if g.defined() {
                    let _ = g.detach_();
                    let _ = g.zero_();
                }
            }
        }
    }

    /// Sums the accumulated gradients, and `scalars`, over the ranks of a
    /// data-parallel group, in place: every rank ends with the same
    /// gradients, so the same [`Optimizer::step`] keeps the ranks' weights
    /// equal. A rank that ran no backward pass contributes zeros. The sums
    /// are float32, on the devices (no copy through host memory).
    pub fn all_reduce_gradients(
        &mut self,
        member: &GroupMember,
        scalars: &mut [f64],
    ) -> Result<(), ModelError> {
        let missing: Vec<Tensor> = self
            .slots
            .iter()
            .filter(|s| !s.param.grad().defined())
            .map(|s| s.param.sum(Kind::Float) * 0.0)
            .collect();
        if !missing.is_empty() {
            // Defines the missing gradients as zeros.
            Tensor::stack(&missing, 0).sum(Kind::Float).backward();
        }
        let grads: Vec<Tensor> = self.slots.iter().map(|s| s.param.grad()).collect();
        all_reduce(member, &grads, true, scalars)
    }

    /// Gives every rank of a data-parallel group rank 0's parameters, so
    /// ranks start equal even where a checkpoint leaves a head to a random
    /// initialisation (a reward model's score head).
    pub fn share_rank0_parameters(&mut self, member: &GroupMember) -> Result<(), ModelError> {
        let params: Vec<Tensor> = self.slots.iter().map(|s| s.param.shallow_clone()).collect();
        all_reduce(member, &params, member.rank() == 0, &mut [])?;
        self.sync_masters();
        Ok(())
    }

    /// Sets each master copy to its parameter (after the parameters changed outside [`Optimizer::step`]).
    fn sync_masters(&mut self) {
        let _guard = tch::no_grad_guard();
        for slot in &mut self.slots {
            if let Some(master) = &mut slot.master {
                master.copy_(&slot.param.to_kind(Kind::Float));
            }
        }
    }

    /// The global L2 norm of the accumulated gradients.
    pub fn grad_norm(&self) -> f64 {
        let total: f64 = self
            .slots
            .iter()
            .map(|s| s.param.grad())
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
        // PyTorch's clip_grad_norm_: scale by max / (norm + 1e-6) when above.
        let scale = match max_norm {
            Some(max) if norm > max => max / (norm + 1e-6),
            _ => 1.0,
        };
        let c = self.config;
        self.steps += 1;
        let t = self.steps as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        let _guard = tch::no_grad_guard();
        for slot in &mut self.slots {
            let g = slot.param.grad();
            if !g.defined() {
                continue;
            }
            let g = if scale == 1.0 {
                g.to_kind(Kind::Float)
            } else {
                g.to_kind(Kind::Float) * scale
            };
            let (m, v) = (&mut slot.m, &mut slot.v);
            let _ = m.g_mul_scalar_(c.beta1);
            let _ = m.g_add_(&(&g * (1.0 - c.beta1)));
            let _ = v.g_mul_scalar_(c.beta2);
            let _ = v.g_add_(&(&g * &g * (1.0 - c.beta2)));
            let denom = v.sqrt() / bias2.sqrt() + c.eps;
            let update = (&*m / denom) * (self.lr / bias1);
            // The update lands on the float32 master where there is one.
            let target = slot.master.as_mut().unwrap_or(&mut slot.param);
            if c.weight_decay != 0.0 {
                let _ = target.g_mul_scalar_(1.0 - self.lr * c.weight_decay);
            }
            let _ = target.g_sub_(&update.to_kind(target.kind()));
            if let Some(master) = &slot.master {
                slot.param.copy_(&master.to_kind(slot.param.kind()));
            }
        }
        // The gradients, the pass's activations and the step's temporaries
        // are freed.
        self.zero_grad();
        crate::device::release_freed_host_memory();
        norm
    }

    /// The optimizer state as named tensors (`exp_avg.NAME`, `exp_avg_sq.NAME`,
    /// and `master.NAME` for a half-precision parameter) and the step count,
    /// for a checkpoint.
    pub fn state(&self) -> (Vec<(String, Tensor)>, u64) {
        let mut out = Vec::with_capacity(self.slots.len() * 2);
        for slot in &self.slots {
            let name = &slot.name;
            out.push((format!("exp_avg.{name}"), slot.m.shallow_clone()));
            out.push((format!("exp_avg_sq.{name}"), slot.v.shallow_clone()));
            if let Some(master) = &slot.master {
                out.push((format!("master.{name}"), master.shallow_clone()));
            }
        }
        (out, self.steps)
    }

    /// Restores a state saved by [`Optimizer::state`]; every parameter's moments must be present with its shape.
    pub fn load_state(
        &mut self,
        tensors: &[(String, Tensor)],
        steps: u64,
    ) -> Result<(), ModelError> {
        let by_name: std::collections::HashMap<&str, &Tensor> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        for Slot {
            name,
            param: p,
            m,
            v,
            master,
        } in &mut self.slots
        {
            // A master copy saved beside the moments (a half-precision
            // checkpoint of this or a later weir); else the parameter's value.
            if let Some(master) = master {
                let _guard = tch::no_grad_guard();
                match by_name.get(format!("master.{name}").as_str()) {
                    Some(t) if t.size() == p.size() => {
                        master.copy_(&t.to_kind(Kind::Float).to_device(p.device()))
                    }
                    _ => master.copy_(&p.to_kind(Kind::Float)),
                }
            }
            for (prefix, slot) in [("exp_avg", &mut *m), ("exp_avg_sq", &mut *v)] {
                let key = format!("{prefix}.{name}");
                let t = by_name
                    .get(key.as_str())
                    .ok_or_else(|| ModelError::Input(format!("optimizer state has no `{key}`")))?;
                if t.size() != p.size() {
                    return Err(ModelError::Input(format!(
                        "optimizer state `{key}` has shape {:?}, the parameter {:?}",
                        t.size(),
                        p.size()
                    )));
                }
                let _guard = tch::no_grad_guard();
                slot.copy_(&t.to_kind(Kind::Float).to_device(p.device()));
            }
        }
        self.steps = steps;
        Ok(())
    }
}

/// Replaces each of `tensors` by its sum over `member`'s group (a rank that
/// does not `contribute` adds zeros), and `scalars` likewise. The values
/// stay on their devices (summed in float32 on rank 0's), with no copy
/// through host memory.
fn all_reduce(
    member: &GroupMember,
    tensors: &[Tensor],
    contribute: bool,
    scalars: &mut [f64],
) -> Result<(), ModelError> {
    let _guard = tch::no_grad_guard();
    let flat: Vec<Tensor> = tensors
        .iter()
        .map(|t| {
            let t = t.to_kind(Kind::Float).reshape([-1]);
            if contribute {
                t
            } else {
                t.zeros_like()
            }
        })
        .collect();
    let (sums, scalar_sums) = member
        .all_reduce(Tensor::cat(&flat, 0), scalars.to_vec())
        .map_err(ModelError::Input)?;
    scalars.copy_from_slice(&scalar_sums);
    let mut offset = 0;
    let mut here: Option<Tensor> = None;
    for t in tensors {
        let sums = here.get_or_insert_with(|| sums.to_device(t.device()));
        let n = t.numel() as i64;
        let summed = sums.narrow(0, offset, n).view(t.size().as_slice());
        t.shallow_clone().copy_(&summed.to_kind(t.kind()));
        offset += n;
    }
    Ok(())
}
