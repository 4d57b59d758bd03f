//! The config keys that choose a behaviour, as enums: a value is parsed
//! once, when the config is read (a misspelt one is an error naming the
//! key and the accepted values), and every use matches all variants, so no
//! value can pass validation and then fall through to a default.

use serde::{Deserialize, Serialize};
use weir_operators::algorithms::{Aggregation, Flavor, KlEstimator};

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

/// `generate.backend`: which runtime decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GenerateBackend {
    /// weir's CPU kernels for a float32 model on an AVX2 CPU, libtorch otherwise.
    Auto,
    /// libtorch ops everywhere: on a CPU, the path a GPU runs.
    Torch,
}

impl GenerateBackend {
    /// The runtime's backend.
    pub fn backend(self) -> weir_gpu::Backend {
        match self {
            GenerateBackend::Auto => weir_gpu::Backend::Auto,
            GenerateBackend::Torch => weir_gpu::Backend::Torch,
        }
    }
}

/// `generate.on_new_weights`: what a streaming generator's in-flight
/// sequences do when the learner's new weights arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightUpdate {
    /// They finish on the weights they started with; new ones start once they have.
    Finish,
    /// They go on under the new weights over their existing KV cache (PipelineRL).
    Keep,
    /// Their prompt and tokens so far are run again under the new weights (AReaL).
    Recompute,
}

impl WeightUpdate {
    /// The runtime's policy.
    pub fn policy(self) -> weir_gpu::OnNewWeights {
        match self {
            WeightUpdate::Finish => weir_gpu::OnNewWeights::Finish,
            WeightUpdate::Keep => weir_gpu::OnNewWeights::Keep,
            WeightUpdate::Recompute => weir_gpu::OnNewWeights::Recompute,
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

/// `algorithm.kl_estimator` (verl's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlChoice {
    /// `log π − log π_ref`.
    K1,
    /// `(log π − log π_ref)² / 2` (also `mse`).
    #[serde(alias = "mse")]
    K2,
    /// `exp(log π_ref − log π) − 1 + log π − log π_ref`.
    K3,
    /// `|log π − log π_ref|`.
    Abs,
    /// k1's value with k2's gradient.
    #[serde(rename = "k1+")]
    K1Plus,
    /// k3's value with k2's gradient.
    #[serde(rename = "k3+")]
    K3Plus,
}

impl From<KlChoice> for KlEstimator {
    fn from(k: KlChoice) -> Self {
        match k {
            KlChoice::K1 => KlEstimator::K1,
            KlChoice::K2 => KlEstimator::K2,
            KlChoice::K3 => KlEstimator::K3,
            KlChoice::Abs => KlEstimator::Abs,
            KlChoice::K1Plus => KlEstimator::K1Plus,
            KlChoice::K3Plus => KlEstimator::K3Plus,
        }
    }
}

/// `algorithm.aggregation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AggregationChoice {
    /// [`Aggregation::TokenMean`].
    TokenMean,
    /// [`Aggregation::SeqMeanTokenMean`].
    SeqMeanTokenMean,
    /// [`Aggregation::SeqMeanTokenSum`].
    SeqMeanTokenSum,
    /// [`Aggregation::SeqMeanTokenSumNorm`].
    SeqMeanTokenSumNorm,
    /// [`Aggregation::TokenSum`].
    TokenSum,
}

impl From<AggregationChoice> for Aggregation {
    fn from(a: AggregationChoice) -> Self {
        match a {
            AggregationChoice::TokenMean => Aggregation::TokenMean,
            AggregationChoice::SeqMeanTokenMean => Aggregation::SeqMeanTokenMean,
            AggregationChoice::SeqMeanTokenSum => Aggregation::SeqMeanTokenSum,
            AggregationChoice::SeqMeanTokenSumNorm => Aggregation::SeqMeanTokenSumNorm,
            AggregationChoice::TokenSum => Aggregation::TokenSum,
        }
    }
}

/// `algorithm.flavor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlavorChoice {
    /// OpenRLHF's semantics.
    Openrlhf,
    /// verl's semantics.
    Verl,
}

impl From<FlavorChoice> for Flavor {
    fn from(f: FlavorChoice) -> Self {
        match f {
            FlavorChoice::Openrlhf => Flavor::OpenRlhf,
            FlavorChoice::Verl => Flavor::Verl,
        }
    }
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
