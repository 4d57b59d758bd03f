//! The RLHF stages, as `weir_graph` sources and stages over `weir_gpu` models.
//!
//! - [`prompts::PromptSource`]: prompts × n samples per step, seeded shuffling per epoch, a cursor.
//! - [`generate::Generate`]: the actor; loads weight snapshots from the weights edge.
//! - The reward stages live with the rewards (`crate::rewards`).
//! - [`dynamic_sampling::DynamicSampling`]: DAPO's filter of groups whose rewards all agree, refilled from a staleness-bounded pool.
//! - [`prompt_stats::PromptStats`]: per-prompt solve rate and reward variance across epochs, a differential-dataflow view the prompt source can use as a curriculum.
//! - [`reference::RefLogprob`]: the frozen reference model's log-probs (or the teacher's).
//! - [`distill::DistillAdvantage`]: on-policy distillation's per-token advantage, the teacher's log-prob less the student's.
//! - [`advantage::GroupAdvantage`]: GRPO / Dr.GRPO / RLOO over whole prompt groups; [`advantage::ReinforceAdvantage`]: REINFORCE++ (-baseline); [`advantage::GaeAdvantage`]: PPO's KL-shaped rewards and GAE.
//! - [`critic::Critic`] and [`critic::CriticLearner`]: values before the advantage, the value fit after it.
//! - [`preference::RewardTrainer`] (Bradley–Terry) and [`preference::DpoTrainer`] (DPO, cDPO, IPO): training on preference pairs.
//! - [`sft::SftTrainer`]: supervised fine-tuning on a target column.
//! - [`learner::Learner`]: the clipped policy loss, AdamW, publishes the next weights version.
//!
//! What they read lives in [`crate::data`], the trainers' row handling in [`crate::training`].

pub mod advantage;
pub mod critic;
pub mod distill;
pub mod dynamic_sampling;
pub mod generate;
pub mod learner;
pub mod preference;
pub mod prompt_stats;
pub mod prompts;
pub mod reference;
pub mod sft;

/// The buffer of a stage that works on whole steps: a step's rows come out
/// ordered by group and sample, however their batches arrived (several
/// generators, or a streaming one sending groups as they finish), so a
/// step's update does not depend on timing.
pub(crate) fn rows_in_order() -> weir_graph::StepBuffer {
    weir_graph::StepBuffer::ordered_by(&[
        crate::rollout::col::GROUP_ID,
        crate::rollout::col::SAMPLE_IDX,
    ])
}
