//! Training a model: AdamW over its `VarStore` with gradient-norm clipping,
//! its state whole on every data-parallel rank or sharded over them (ZeRO
//! stages 1 and 2: [`Optimizer::shard`]).

use tch::{Kind, Tensor};

use crate::collective::{sum_scalars, GroupMember};
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
///
/// Sharded over the ranks of a data-parallel group ([`Optimizer::shard`]),
/// each rank keeps the moments and master copies of its own run of
/// parameters only, sums only their gradients (a reduce-scatter), updates
/// them, and hands them to the other ranks (an all-gather); the weights
/// after every step are the bits of the unsharded ranks'.
pub struct Optimizer {
    config: AdamWConfig,
    lr: f64,
    /// One per trainable parameter, sorted by name.
    slots: Vec<Slot>,
    /// Which parameters this rank updates, when sharded over ranks.
    shard: Option<Shard>,
    /// Optimizer steps taken.
    steps: u64,
    /// libtorch's own optimizer over the same parameters, never stepped:
    /// its `zero_grad` sets every gradient to none (freeing it), which no
    /// other call of libtorch's C API does.
    gradient_release: tch::COptimizer,
}

/// A parameter and its optimizer state (none where another rank owns it).
struct Slot {
    name: String,
    param: Tensor,
    state: Option<Moments>,
}

/// One parameter's AdamW state.
struct Moments {
    /// First moment (float32).
    m: Tensor,
    /// Second moment (float32).
    v: Tensor,
    /// The float32 master copy of a half-precision parameter.
    master: Option<Tensor>,
}

/// How the parameters are shared out among the ranks: rank `r` owns slots
/// `slots[r]..slots[r + 1]`, which are values `values[r]..values[r + 1]`
/// of the parameters laid end to end in slot order.
struct Shard {
    rank: usize,
    slots: Vec<usize>,
    values: Vec<usize>,
    /// libtorch's optimizer over the parameters of other ranks, never
    /// stepped: its `zero_grad` frees their gradients once summed away.
    release_others: tch::COptimizer,
}

/// The slot boundaries that share parameters of `numels` values out among
/// `ranks` ranks in runs of whole parameters: boundary `c` is the one
/// nearest to `c / ranks` of all values, so each rank's share is within
/// one parameter's size of an even one (a parameter is never split, which
/// keeps each gradient's norm and update the unsharded ones' to the bit).
pub fn shard_bounds(numels: &[usize], ranks: usize) -> Vec<usize> {
    let total: usize = numels.iter().sum();
    let mut prefix = Vec::with_capacity(numels.len() + 1);
    prefix.push(0usize);
    for n in numels {
        prefix.push(prefix.last().copied().unwrap_or(0) + n);
    }
    let mut bounds = vec![0];
    for c in 1..ranks {
        let target = total as f64 * c as f64 / ranks as f64;
        let from = *bounds.last().unwrap_or(&0);
        let best = (from..=numels.len())
            .min_by(|&a, &b| {
                let d = |k: usize| (prefix[k] as f64 - target).abs();
                d(a).total_cmp(&d(b))
            })
            .unwrap_or(from);
        bounds.push(best);
    }
    bounds.push(numels.len());
    bounds
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
                    state: Some(Moments { m, v, master }),
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
            shard: None,
            steps: 0,
            gradient_release,
        })
    }

    /// Shards the optimizer state over `member`'s group (ZeRO stages 1 and
    /// 2): this rank keeps the moments and master copies of its run of
    /// parameters ([`shard_bounds`]) and drops the rest. From then on
    /// [`Optimizer::all_reduce_gradients`] sums only this rank's gradients
    /// (freeing the others), and [`Optimizer::step_sharded`] updates its
    /// parameters and gathers everyone's. Every rank calls this with its
    /// member of the same group, after the ranks' parameters are equal.
    pub fn shard(&mut self, member: &GroupMember) -> Result<(), ModelError> {
        let numels: Vec<usize> = self.slots.iter().map(|s| s.param.numel()).collect();
        let slots = shard_bounds(&numels, member.size());
        let mut values = vec![0];
        for w in slots.windows(2) {
            values.push(
                values.last().copied().unwrap_or(0) + numels[w[0]..w[1]].iter().sum::<usize>(),
            );
        }
        let rank = member.rank();
        let mine = slots[rank]..slots[rank + 1];
        let mut release_others = tch::COptimizer::sgd(0.0, 0.0, 0.0, 0.0, false)?;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if !mine.contains(&i) {
                slot.state = None;
                release_others.add_parameters(&slot.param, 0)?;
            }
        }
        self.shard = Some(Shard {
            rank,
            slots,
            values,
            release_others,
        });
        Ok(())
    }

    /// Whether the state is sharded over ranks.
    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// The bytes of optimizer state this rank holds (moments and master copies).
    pub fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .filter_map(|s| s.state.as_ref())
            .map(|st| {
                let master = st.master.as_ref().map_or(0, Tensor::numel);
                ((st.m.numel() + st.v.numel() + master) * 4) as u64
            })
            .sum()
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
        let Some(shard) = &mut self.shard else {
            return all_reduce(member, &grads, true, scalars);
        };
        // Reduce-scatter: this rank keeps the sums of its own gradients.
        let _guard = tch::no_grad_guard();
        let flat: Vec<Tensor> = grads
            .iter()
            .map(|g| g.to_kind(Kind::Float).reshape([-1]))
            .collect();
        let (mine, sums) = member
            .reduce_scatter(&flat, &shard.values, scalars.to_vec())
            .map_err(ModelError::Input)?;
        drop(flat);
        scalars.copy_from_slice(&sums);
        let mut offset = 0;
        for g in &grads[shard.slots[shard.rank]..shard.slots[shard.rank + 1]] {
            let n = g.numel() as i64;
            let summed = mine.narrow(0, offset, n).view(g.size().as_slice());
            g.shallow_clone().copy_(&summed.to_kind(g.kind()));
            offset += n;
        }
        drop(grads);
        // ZeRO stage 2: the other ranks' gradients are theirs to keep.
        let _ = shard.release_others.zero_grad();
        Ok(())
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
            if let Some(master) = slot.state.as_mut().and_then(|s| s.master.as_mut()) {
                master.copy_(&slot.param.to_kind(Kind::Float));
            }
        }
    }

    /// Each parameter's gradient's squared L2 norm (0 where it has none).
    fn squared_norms(&self) -> Vec<f64> {
        self.slots
            .iter()
            .map(|s| {
                let g = s.param.grad();
                if !g.defined() || s.state.is_none() {
                    return 0.0;
                }
                g.to_kind(Kind::Double)
                    .pow_tensor_scalar(2)
                    .sum(Kind::Double)
                    .double_value(&[])
            })
            .collect()
    }

    /// The global L2 norm of the accumulated gradients (of this rank's
    /// parameters, when sharded: [`Optimizer::step_sharded`] sums them over
    /// the ranks).
    pub fn grad_norm(&self) -> f64 {
        let total: f64 = self.squared_norms().iter().sum();
        total.sqrt()
    }

    /// Clips the gradients to `max_norm` (if given), steps, and returns the
    /// norm before clipping. Gradients must have been accumulated with
    /// `backward()` on one or more micro-batch losses.
    pub fn step(&mut self, max_norm: Option<f64>) -> f64 {
        let norm = self.grad_norm();
        self.update(norm, max_norm);
        norm
    }

    /// [`Optimizer::step`] of a sharded optimizer, after
    /// [`Optimizer::all_reduce_gradients`]: the gradient norm from every
    /// rank's parameters' norms (summed in parameter order, as unsharded),
    /// this rank's parameters updated, then every rank's gathered. Without
    /// a shard, [`Optimizer::step`].
    pub fn step_sharded(
        &mut self,
        max_norm: Option<f64>,
        member: &GroupMember,
    ) -> Result<f64, ModelError> {
        if self.shard.is_none() {
            return Ok(self.step(max_norm));
        }
        let mut squares = self.squared_norms();
        sum_scalars(Some(member), &mut squares).map_err(ModelError::Input)?;
        let norm = squares.iter().sum::<f64>().sqrt();
        self.update(norm, max_norm);
        self.gather_parameters(member)?;
        Ok(norm)
    }

    /// Hands every rank the parameters the others updated.
    fn gather_parameters(&mut self, member: &GroupMember) -> Result<(), ModelError> {
        let Some(shard) = &self.shard else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        let (rank, slots) = (shard.rank, &shard.slots);
        let mine: Vec<Tensor> = self.slots[slots[rank]..slots[rank + 1]]
            .iter()
            .map(|s| s.param.to_kind(Kind::Float).reshape([-1]))
            .collect();
        let all = member
            .all_gather(&mine, &shard.values, self.device())
            .map_err(ModelError::Input)?;
        drop(mine);
        let mut offset = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            let n = slot.param.numel() as i64;
            if !(slots[rank]..slots[rank + 1]).contains(&i) {
                let values = all.narrow(0, offset, n).view(slot.param.size().as_slice());
                slot.param
                    .shallow_clone()
                    .copy_(&values.to_kind(slot.param.kind()));
            }
            offset += n;
        }
        Ok(())
    }

    /// The device of the parameters.
    fn device(&self) -> tch::Device {
        self.slots
            .first()
            .map_or(tch::Device::Cpu, |s| s.param.device())
    }

    /// Applies AdamW to this rank's parameters given the gradients' global
    /// norm, and frees the gradients.
    fn update(&mut self, norm: f64, max_norm: Option<f64>) {
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
            let Some(state) = slot.state.as_mut() else {
                continue;
            };
            if !g.defined() {
                continue;
            }
            let g = if scale == 1.0 {
                g.to_kind(Kind::Float)
            } else {
                g.to_kind(Kind::Float) * scale
            };
            let (m, v) = (&mut state.m, &mut state.v);
            let _ = m.g_mul_scalar_(c.beta1);
            let _ = m.g_add_(&(&g * (1.0 - c.beta1)));
            let _ = v.g_mul_scalar_(c.beta2);
            let _ = v.g_add_(&(&g * &g * (1.0 - c.beta2)));
            let denom = v.sqrt() / bias2.sqrt() + c.eps;
            let update = (&*m / denom) * (self.lr / bias1);
            // The update lands on the float32 master where there is one.
            let target = state.master.as_mut().unwrap_or(&mut slot.param);
            if c.weight_decay != 0.0 {
                let _ = target.g_mul_scalar_(1.0 - self.lr * c.weight_decay);
            }
            let _ = target.g_sub_(&update.to_kind(target.kind()));
            if let Some(master) = &state.master {
                slot.param.copy_(&master.to_kind(slot.param.kind()));
            }
        }
        // The gradients, the pass's activations and the step's temporaries
        // are freed.
        self.zero_grad();
        crate::device::release_freed_host_memory();
    }

    /// The optimizer state this rank holds as named tensors (`exp_avg.NAME`,
    /// `exp_avg_sq.NAME`, and `master.NAME` for a half-precision parameter)
    /// and the step count, for a checkpoint.
    pub fn state(&self) -> (Vec<(String, Tensor)>, u64) {
        let mut out = Vec::with_capacity(self.slots.len() * 2);
        for slot in &self.slots {
            let Some(st) = &slot.state else { continue };
            let name = &slot.name;
            out.push((format!("exp_avg.{name}"), st.m.shallow_clone()));
            out.push((format!("exp_avg_sq.{name}"), st.v.shallow_clone()));
            if let Some(master) = &st.master {
                out.push((format!("master.{name}"), master.shallow_clone()));
            }
        }
        (out, self.steps)
    }

    /// The names of the state tensors this rank holds, as [`Optimizer::state`] names them.
    pub fn state_names(&self) -> Vec<String> {
        let mine = match &self.shard {
            Some(s) => s.slots[s.rank]..s.slots[s.rank + 1],
            None => 0..self.slots.len(),
        };
        self.state_layout(mine)
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    }

    /// The names and shapes of the state of slots `slots`, in
    /// [`Optimizer::state`]'s order (whichever rank holds it).
    fn state_layout(&self, slots: std::ops::Range<usize>) -> Vec<(String, Vec<i64>)> {
        let mut out = Vec::new();
        for slot in &self.slots[slots] {
            let (name, size) = (&slot.name, slot.param.size());
            out.push((format!("exp_avg.{name}"), size.clone()));
            out.push((format!("exp_avg_sq.{name}"), size.clone()));
            if needs_master(slot.param.kind()) {
                out.push((format!("master.{name}"), size));
            }
        }
        out
    }

    /// Hands `write` every rank's optimizer state, one rank's at a time, on
    /// every rank of a sharded optimizer's group (a checkpoint: the rank
    /// that writes holds no more than its own state and one other's at
    /// once); `write` gets the owning rank, the group's size and the named
    /// tensors. Every rank calls this together.
    pub fn gather_state(
        &self,
        member: &GroupMember,
        mut write: impl FnMut(usize, usize, Vec<(String, Tensor)>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let Some(shard) = &self.shard else {
            return write(0, 1, self.state().0);
        };
        let _guard = tch::no_grad_guard();
        let ranks = member.size();
        for owner in 0..ranks {
            let layout = self.state_layout(shard.slots[owner]..shard.slots[owner + 1]);
            let total: usize = layout
                .iter()
                .map(|(_, size)| size.iter().product::<i64>() as usize)
                .sum();
            let mut bounds = vec![0; ranks + 1];
            bounds[owner + 1..].iter_mut().for_each(|b| *b = total);
            let parts: Vec<Tensor> = if owner == shard.rank {
                self.state().0.into_iter().map(|(_, t)| t).collect()
            } else {
                Vec::new()
            };
            let all = member
                .all_gather(&parts, &bounds, self.device())
                .map_err(ModelError::Input)?;
            drop(parts);
            let mut offset = 0;
            let mut tensors = Vec::with_capacity(layout.len());
            for (name, size) in layout {
                let n: i64 = size.iter().product();
                tensors.push((name, all.narrow(0, offset, n).view(size.as_slice())));
                offset += n;
            }
            write(owner, ranks, tensors)?;
        }
        Ok(())
    }

    /// Restores a state saved by [`Optimizer::state`] (or by every rank's
    /// [`Optimizer::gather_state`]); the moments of every parameter this
    /// rank updates must be present with its shape.
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
            state,
        } in &mut self.slots
        {
            let Some(Moments { m, v, master }) = state else {
                continue;
            };
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
        .all_reduce_parts(&flat, scalars.to_vec())
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
