//! The trainers' shared core ([`TrainerCore`]) and one optimizer step over
//! a step's rows, the same for every trainer (the actor's learner, SFT, the
//! reward-model and DPO trainers, the critic's fit): the step's loss
//! denominators counted over all micro-batches and data-parallel ranks, the
//! learning-rate schedule, the backward passes, the ranks' gradient sums,
//! clipping, and the check that the loss and gradients are finite.
//!
//! A loss normalised by the whole step's counts ([`StepScale`]) gives the
//! same update however the step is split into micro-batches and ranks, as
//! verl 0.9 does with `batch_num_tokens` / `global_batch_size` and OpenRLHF
//! 0.11 with its global token and sample counts.

use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

use weir_gpu::collective::{leads, max_scalars, sum_scalars, GroupMember};
use weir_gpu::optim::{AdamWConfig, Optimizer};
use weir_gpu::Model;
use weir_graph::StageError;

use crate::algorithms::StepScale;
use crate::checkpoint::{save_optimizer, CheckpointPlan, Checkpointer, OptimizerSave};

/// Learning rate over optimizer steps: linear warm-up from 0, then constant or cosine decay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// `lr · min(1, (k + 1) / warmup)`.
    Constant {
        /// Warm-up steps.
        warmup: u64,
    },
    /// Warm-up, then `min_lr + (lr − min_lr) · (1 + cos(π · progress)) / 2` until `total` steps.
    Cosine {
        /// Warm-up steps.
        warmup: u64,
        /// Steps over which the rate decays.
        total: u64,
        /// The floor, as a fraction of the base rate.
        min_ratio: f64,
    },
}

impl LrSchedule {
    /// The rate of optimizer step `k` (0-based) for base rate `lr`.
    pub fn rate(&self, lr: f64, k: u64) -> f64 {
        let warm = |w: u64| {
            if w == 0 {
                1.0
            } else {
                ((k + 1) as f64 / w as f64).min(1.0)
            }
        };
        match *self {
            LrSchedule::Constant { warmup } => lr * warm(warmup),
            LrSchedule::Cosine {
                warmup,
                total,
                min_ratio,
            } => {
                if k < warmup {
                    return lr * warm(warmup);
                }
                let span = total.saturating_sub(warmup).max(1) as f64;
                let progress = ((k - warmup) as f64 / span).min(1.0);
                let min_lr = lr * min_ratio;
                min_lr + (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0
            }
        }
    }
}

/// How a trainer holds the model it trains: its own ([`Model`]), or one it
/// shares with a stage that scores with it (`Arc<Mutex<Model>>`, the
/// critic's), held for the length of an optimizer step or a save.
pub trait HeldModel {
    /// The model while held.
    type Held<'a>: Deref<Target = Model>
    where
        Self: 'a;

    /// Holds the model.
    fn hold(&self) -> Result<Self::Held<'_>, StageError>;
}

impl HeldModel for Model {
    type Held<'a> = &'a Model;

    fn hold(&self) -> Result<&Model, StageError> {
        Ok(self)
    }
}

impl HeldModel for Arc<Mutex<Model>> {
    type Held<'a> = MutexGuard<'a, Model>;

    fn hold(&self) -> Result<MutexGuard<'_, Model>, StageError> {
        self.lock()
            .map_err(|_| "a stage panicked while holding a shared model".into())
    }
}

/// Where a trainer's checkpoints go.
enum Saves {
    /// As the actor, with the run's state (step, version, cursors, …).
    Actor(CheckpointPlan),
    /// As one more component of the actor's checkpoints (`critic`).
    Component(Checkpointer, &'static str),
}

/// What every trainer (the actor's learner, SFT, the reward-model and DPO
/// trainers, the critic's fit) keeps around its own loss: the model it
/// trains (held as `M`), its optimizer and learning-rate schedule, its rank
/// among data-parallel trainers, and where it saves.
pub struct TrainerCore<M: HeldModel = Model> {
    model: M,
    optimizer: Optimizer,
    base_lr: f64,
    schedule: LrSchedule,
    max_grad_norm: Option<f64>,
    data_parallel: Option<GroupMember>,
    checkpoints: Option<Saves>,
}

impl TrainerCore<Model> {
    /// The model being trained.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl<M: HeldModel> TrainerCore<M> {
    /// Trains `model` with AdamW (`adamw`, its rate the schedule's base),
    /// the gradient norm clipped to `max_grad_norm`.
    pub fn new(
        model: M,
        adamw: AdamWConfig,
        schedule: LrSchedule,
        max_grad_norm: Option<f64>,
    ) -> Result<Self, StageError> {
        let optimizer = Optimizer::adamw(&*model.hold()?, adamw)?;
        Ok(TrainerCore {
            optimizer,
            model,
            base_lr: adamw.lr,
            schedule,
            max_grad_norm,
            data_parallel: None,
            checkpoints: None,
        })
    }

    /// Trains as one rank of `member`'s group: each rank takes its share of
    /// a step's rows and the ranks sum their gradients before every
    /// optimizer step, so their weights stay equal; rank 0 publishes, saves
    /// and records. Every rank calls this together: they start from rank
    /// 0's weights. A member that shards the optimizer
    /// ([`GroupMember::shards_optimizer`]) keeps the AdamW state of its
    /// share of the parameters only ([`Optimizer::shard`]).
    pub fn join_data_parallel(&mut self, member: GroupMember) -> Result<(), StageError> {
        self.optimizer.share_rank0_parameters(&member)?;
        if member.shards_optimizer() {
            self.optimizer.shard(&member)?;
        }
        self.data_parallel = Some(member);
        Ok(())
    }

    /// Saves checkpoints as `plan` says.
    pub fn save_with(&mut self, plan: CheckpointPlan) {
        self.checkpoints = Some(Saves::Actor(plan));
    }

    /// Saves the model (and its optimizer) as the `name` component of the
    /// checkpoints `checkpointer` makes due.
    pub fn save_as_component(&mut self, checkpointer: Checkpointer, name: &'static str) {
        self.checkpoints = Some(Saves::Component(checkpointer, name));
    }

    /// Replaces the learning-rate schedule.
    pub fn set_schedule(&mut self, schedule: LrSchedule) {
        self.schedule = schedule;
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }

    /// The optimizer (to restore its state on resume).
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }

    /// This trainer's rank among data-parallel trainers, if there are several.
    pub fn member(&self) -> Option<&GroupMember> {
        self.data_parallel.as_ref()
    }

    /// Whether this trainer publishes, saves and records (rank 0, or the only one).
    pub fn leads(&self) -> bool {
        leads(self.member())
    }

    /// Whether a step trains here: with rows, or as a data-parallel rank
    /// (which joins the ranks' sums without rows too).
    pub fn runs(&self, has_rows: bool) -> bool {
        has_rows || self.data_parallel.is_some()
    }

    /// One optimizer step ([`optimizer_step`]) at the schedule's rate for
    /// the optimizer's own step count (restored with its state, so a
    /// resumed run continues the schedule where it stopped): `backward`
    /// runs every micro-batch's backward pass on the model, adding its
    /// measurements to `stats`. Returns the gradient norm before clipping.
    pub fn step(
        &mut self,
        stats: &mut [f64],
        backward: impl FnOnce(&Model, &mut [f64]) -> Result<(), StageError>,
    ) -> Result<f64, StageError> {
        let lr = self.schedule.rate(self.base_lr, self.optimizer.steps());
        let model = self.model.hold()?;
        optimizer_step(
            &mut self.optimizer,
            self.data_parallel.as_ref(),
            lr,
            self.max_grad_norm,
            stats,
            |stats| backward(&model, stats),
        )
    }

    /// Saves the model and optimizer (as policy `version`, for the actor)
    /// when step `step` is due a checkpoint: the rank that leads writes;
    /// with the optimizer sharded, every rank hands it its share, so every
    /// rank calls this.
    pub fn save_if_due(&self, step: u64, version: u64) -> Result<(), StageError> {
        let state = match (self.member(), self.optimizer.is_sharded()) {
            (Some(member), true) => OptimizerSave::Sharded(&self.optimizer, member),
            _ => OptimizerSave::Whole(&self.optimizer),
        };
        let (checkpointer, component) = match &self.checkpoints {
            Some(Saves::Actor(plan)) => (&plan.checkpointer, "actor"),
            Some(Saves::Component(checkpointer, name)) => (checkpointer, *name),
            None => return Ok(()),
        };
        if !checkpointer.due(step) {
            return Ok(());
        }
        if !self.leads() {
            // A rank that does not write hands its share of a sharded state over.
            return match state {
                OptimizerSave::Sharded(..) => save_optimizer(None, state),
                OptimizerSave::Whole(_) => Ok(()),
            };
        }
        let model = self.model.hold()?;
        match &self.checkpoints {
            Some(Saves::Actor(plan)) => plan.save_actor(step, version, &model, state),
            Some(Saves::Component(..)) | None => checkpointer
                .save_component(step, component, &model, state)
                .map(|_| ()),
        }
    }
}

/// The denominators of a step whose rows (on this rank) have responses of
/// `lengths` tokens, summed over every rank of `member`'s group. `T` of
/// Dr.GRPO's normaliser is `loss_scale_factor`, or else the longest
/// response of the step over all ranks (the padded response length).
pub fn step_scale(
    member: Option<&GroupMember>,
    lengths: impl IntoIterator<Item = usize>,
    loss_scale_factor: Option<f64>,
) -> Result<StepScale, StageError> {
    step_scale_counted(
        member,
        lengths.into_iter().map(|n| (n, n)),
        loss_scale_factor,
    )
}

/// [`step_scale`] of responses given as (tokens that count, length): an
/// episode's response counts its generated tokens only, while `T` of
/// Dr.GRPO's normaliser stays the longest response's length (the padded
/// width, observations included).
pub fn step_scale_counted(
    member: Option<&GroupMember>,
    rows: impl IntoIterator<Item = (usize, usize)>,
    loss_scale_factor: Option<f64>,
) -> Result<StepScale, StageError> {
    let (mut tokens, mut sequences, mut nonempty, mut longest) = (0.0, 0.0, 0.0, 0.0f64);
    for (counted, len) in rows {
        tokens += counted as f64;
        sequences += 1.0;
        nonempty += f64::from(u8::from(counted > 0));
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
fn optimizer_step(
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
    let norm = match member {
        Some(member) => {
            optimizer.all_reduce_gradients(member, stats)?;
            optimizer.step_sharded(max_grad_norm, member)?
        }
        None => optimizer.step(max_grad_norm),
    };
    let loss = stats.first().copied().unwrap_or(0.0);
    if !loss.is_finite() || !norm.is_finite() {
        return Err(format!("the loss ({loss}) or gradient norm ({norm}) is not finite").into());
    }
    Ok(norm)
}
