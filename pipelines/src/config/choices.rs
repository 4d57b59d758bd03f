//! The config keys that choose a behaviour, as enums: a value is parsed
//! once, when the config is read (a misspelt one is an error naming the
//! key and the accepted values), and every use matches all variants, so no
//! value can pass validation and then fall through to a default.

use serde::{Deserialize, Serialize};
// The runtime's own enums read their config spelling themselves.
pub use weir_gpu::{Backend, OnNewWeights};
pub use weir_operators::agent::episode::OnError;
pub use weir_operators::agent::python_tool::PythonNetwork;
pub use weir_operators::agent::tool_calls::ToolFormat;
pub use weir_operators::algorithms::{Aggregation, Flavor, KlEstimator};

/// `run.device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// The CPU.
    Cpu,
    /// CUDA device `worker mod count`.
    Cuda,
}

/// `placement.reference`: where the frozen reference runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReferencePlacement {
    /// On the train workers, beside the learner.
    Train,
    /// On the rollout workers, beside the generator.
    Rollout,
}

/// `placement.teacher`: where distillation's teacher runs, as the reference
/// does (`"train"`, `"rollout"`), or on workers of its own (`[2, 3]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TeacherPlacement {
    /// Beside the learner or the generator.
    At(ReferencePlacement),
    /// On these workers, a share of every batch each.
    Workers(Vec<usize>),
}

impl Serialize for TeacherPlacement {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TeacherPlacement::At(at) => at.serialize(s),
            TeacherPlacement::Workers(w) => w.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for TeacherPlacement {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = TeacherPlacement;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"train\", \"rollout\" or a list of worker indices")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                match v {
                    "train" => Ok(TeacherPlacement::At(ReferencePlacement::Train)),
                    "rollout" => Ok(TeacherPlacement::At(ReferencePlacement::Rollout)),
                    other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
                }
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut workers = Vec::new();
                while let Some(w) = seq.next_element::<usize>()? {
                    workers.push(w);
                }
                Ok(TeacherPlacement::Workers(workers))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// `algorithm.distill_task`: the task advantage distillation adds its term to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillTask {
    /// None: the distillation term alone.
    None,
    /// GRPO's group-normalised advantage.
    Grpo,
    /// Dr.GRPO's group-centred advantage.
    DrGrpo,
    /// RLOO's leave-one-out advantage.
    Rloo,
}

/// `algorithm.gkd_tail`: what the top-k distillation divergence does with
/// the mass outside the teacher's top k.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GkdTail {
    /// One more outcome, "any other token", on both sides: a proper divergence.
    Add,
    /// Sums over the k tokens alone (verl's `forward_kl_topk` at β = 0).
    Drop,
}

impl GkdTail {
    /// The learner's setting.
    pub fn tail(self) -> weir_operators::algorithms::TopKTail {
        match self {
            GkdTail::Add => weir_operators::algorithms::TopKTail::Add,
            GkdTail::Drop => weir_operators::algorithms::TopKTail::Drop,
        }
    }
}

/// `placement.weights_channel`: how the learner's weights cross to another process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsChannelChoice {
    /// A TCP connection of their own, straight into the receiving process's buffer.
    Direct,
    /// In buckets on timely's connections (only the hostfile's ports open).
    Timely,
}

impl WeightsChannelChoice {
    /// The engine's setting, the direct channel's server on `port`.
    pub fn channel(self, port: u16) -> weir_graph::WeightsChannel {
        match self {
            WeightsChannelChoice::Direct => weir_graph::WeightsChannel::Direct { port },
            WeightsChannelChoice::Timely => weir_graph::WeightsChannel::Timely,
        }
    }
}

/// `model.dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
}

impl Dtype {
    /// The libtorch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            Dtype::F32 => tch::Kind::Float,
            Dtype::Bf16 => tch::Kind::BFloat16,
            Dtype::F16 => tch::Kind::Half,
        }
    }
}

/// `reward.kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// A rule on a dataset column (`reward.rule`).
    Rule,
    /// A reward model (`model.reward_model`).
    Model,
    /// An HTTP reward server (`reward.url`).
    Remote,
    /// A function in a Python file (`reward.file`, `reward.function`).
    Python,
    /// Several rewards with weights (`[[reward.terms]]`).
    Terms,
    /// No task reward: every row's is 0, and the environment's turn
    /// rewards (`agent.environment`) are the rewards.
    None,
    /// A generative judge's verdict (`[judge]`).
    Judge,
}

/// `judge.verdict`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JudgeVerdict {
    /// The first group of `judge.pattern` in the judge's answer, as a number.
    Regex,
    /// The probability of `judge.verdict_tokens` at the judge's first position.
    Probability,
}

/// `judge.on_unparsed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnparsed {
    /// The run stops with an error naming the row and the judge's answer.
    Error,
    /// The row gets `judge.unparsed_reward`.
    Reward,
}

/// `algorithm.schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleChoice {
    /// Warm-up, then the base rate.
    Constant,
    /// Warm-up, then cosine decay to `min_lr_ratio · lr`.
    Cosine,
}

/// `data.rollout_advantages`: where replayed rows' advantages come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RolloutAdvantages {
    /// The pipeline's estimator, from the logged rewards.
    Recompute,
    /// As the log holds them.
    Logged,
}

/// `algorithm.correction`: the off-policy correction of stale rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CorrectionChoice {
    /// No correction.
    None,
    /// Truncated importance sampling.
    Tis,
    /// IcePop: tokens with ρ outside the bounds are dropped.
    Icepop,
    /// Responses with a geometric-mean ρ outside the bounds are dropped.
    SeqMask,
    /// Sequence TIS: each response weighted by its whole ratio, clamped.
    SeqTis,
    /// Geometric-mean rejection: responses outside the bounds dropped, the rest weight 1.
    GeoRejection,
    /// K3 rejection: responses whose mean K3 exceeds `correction_high` dropped.
    K3Rejection,
    /// Sequence IcePop: each response weighted by its whole ratio, 0 outside the bounds.
    SeqIcepop,
    /// OpenRLHF's binary-KL gate per token: ρ where the divergence is at most `correction_high`.
    BinaryKl,
    /// The binary-KL gate on each response's mean divergence.
    SeqBinaryKl,
    /// OpenRLHF's total-variation gate per token.
    Tv,
    /// The total-variation gate on each response's mean.
    SeqTv,
}

impl CorrectionChoice {
    /// Whether the correction reads `correction_low` (the gates and K3
    /// rejection have an upper bound only).
    pub fn has_low(self) -> bool {
        !matches!(
            self,
            CorrectionChoice::None
                | CorrectionChoice::K3Rejection
                | CorrectionChoice::BinaryKl
                | CorrectionChoice::SeqBinaryKl
                | CorrectionChoice::Tv
                | CorrectionChoice::SeqTv
        )
    }
}

/// `algorithm.policy_loss` (verl's `policy_loss.loss_mode` names where it has them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLossChoice {
    /// PPO's clipped loss with a ratio per token.
    Ppo,
    /// GSPO: one ratio per response.
    Gspo,
    /// CISPO: the clipped ratio weights every token's gradient.
    Cispo,
    /// SAPO: a smooth gate instead of the clip.
    Sapo,
    /// GMPO: the geometric mean of the token ratios (verl's `geo_mean`).
    #[serde(alias = "geo_mean")]
    Gmpo,
    /// GPG: `−A · log π`.
    Gpg,
    /// Vanilla REINFORCE: `−A · log π`, the correction's weight as the importance ratio.
    Reinforce,
    /// Clip-Cov: PPO with the gradient of a few high-covariance tokens cut.
    ClipCov,
    /// KL-Cov: `−A · r` with a KL penalty on the highest-covariance tokens.
    KlCov,
    /// DPPO with a total-variation trust region on the sampled token's probability.
    DppoTv,
    /// DPPO with a binary-KL trust region on the sampled token's probability.
    DppoKl,
    /// DRO: `−A·log π` with a quadratic penalty on the log-ratio.
    Dro,
}

/// `algorithm.preference_loss`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreferenceChoice {
    /// DPO.
    Dpo,
    /// Conservative DPO (with `label_smoothing`).
    Cdpo,
    /// IPO.
    Ipo,
}
