//! One optimizer step over a step's rows, the same for every trainer (the
//! actor's learner, SFT, the reward-model and DPO trainers): the step's
//! loss denominators counted over all micro-batches and data-parallel
//! ranks, the learning rate, the backward passes, the ranks' gradient sums,
//! clipping, and the check that the loss and gradients are finite.
//!
//! A loss normalised by the whole step's counts ([`StepScale`]) gives the
//! same update however the step is split into micro-batches and ranks, as
//! verl 0.9 does with `batch_num_tokens` / `global_batch_size` and OpenRLHF
//! 0.11 with its global token and sample counts.

use weir_gpu::collective::{max_scalars, sum_scalars, GroupMember};
use weir_gpu::optim::Optimizer;
use weir_graph::StageError;

use crate::algorithms::StepScale;

/// The denominators of a step whose rows (on this rank) have responses of
/// `lengths` tokens, summed over every rank of `member`'s group. `T` of
/// Dr.GRPO's normaliser is `loss_scale_factor`, or else the longest
/// response of the step over all ranks (the padded response length).
pub fn step_scale(
    member: Option<&GroupMember>,
    lengths: impl IntoIterator<Item = usize>,
    loss_scale_factor: Option<f64>,
) -> Result<StepScale, StageError> {
    let (mut tokens, mut sequences, mut nonempty, mut longest) = (0.0, 0.0, 0.0, 0.0f64);
    for len in lengths {
        tokens += len as f64;
        sequences += 1.0;
        nonempty += f64::from(u8::from(len > 0));
        longest = longest.max(len as f64);
    }
    let mut counts = [tokens, sequences, nonempty];
    sum_scalars(member, &mut counts)?;
    let loss_scale_factor = match loss_scale_factor {
        Some(t) => t,
        None => {
            let mut longest = [longest];
            max_scalars(member, &mut longest)?;
            longest[0]
        }
    };
    Ok(StepScale {
        tokens: counts[0],
        sequences: counts[1],
        nonempty: counts[2],
        loss_scale_factor,
    })
}

/// One optimizer step at learning rate `lr`: zero the gradients, run
/// `backward` (every micro-batch's backward pass; it adds its measurements
/// to `stats`, the loss first), sum the gradients and `stats` over the
/// ranks, clip to `max_grad_norm` and step. A rank with no rows runs a
/// `backward` that does nothing and still joins the sums. Returns the
/// gradient norm before clipping; a loss or gradient norm that is not
/// finite is an error.
pub fn optimizer_step(
    optimizer: &mut Optimizer,
    member: Option<&GroupMember>,
    lr: f64,
    max_grad_norm: Option<f64>,
    stats: &mut [f64],
    backward: impl FnOnce(&mut [f64]) -> Result<(), StageError>,
) -> Result<f64, StageError> {
    optimizer.set_lr(lr);
    optimizer.zero_grad();
    backward(stats)?;
    if let Some(member) = member {
        optimizer.all_reduce_gradients(member, stats)?;
    }
    let norm = optimizer.step(max_grad_norm);
    let loss = stats.first().copied().unwrap_or(0.0);
    if !loss.is_finite() || !norm.is_finite() {
        return Err(format!("the loss ({loss}) or gradient norm ({norm}) is not finite").into());
    }
    Ok(norm)
}
