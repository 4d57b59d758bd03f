//! RL math as pure functions over plain numbers: advantages and returns,
//! KL estimators, reward shaping. Each function's doc comment states its
//! formula, the shapes, what the mask means and where the reward sits.
//!
//! Default semantics follow OpenRLHF; where OpenRLHF and verl disagree the
//! function takes a [`Flavor`] and says, in its doc comment, what each does.
//! Token matrices are `&[Vec<f64>]`: one row per response, one entry per
//! response token; a mask row holds 1.0 for tokens that count and 0.0 for
//! padding (and masked interior tokens of multi-turn responses).

pub mod advantages;
pub mod aggregation;
pub mod corrections;
pub mod gkd;
pub mod kl;
pub mod losses;
pub mod objectives;
pub mod rejection;
pub mod shaping;
pub mod stats;

pub use advantages::{
    discounted_returns, gae, gdpo, gdpo_combined, gpg, gpg_alpha, gpg_counts, gpg_with_alpha,
    greedy_baselines, grpo, grpo_passk, opo, optimal_token_baseline, remax, rloo,
    whiten_advantages, whiten_advantages_over, GroupError,
};
pub use corrections::GateDivergence;
pub use gkd::{topk_divergence, GkdLoss, TopKTail};
pub use kl::{kl, kl_tensor, kl_tokens, kl_unbiased_gradient, token_rewards, KlEstimator};
pub use losses::{
    aggregate, aggregate_in_step, correction_weights, importance_weights, policy_loss,
    policy_loss_in_step, value_loss, value_loss_in_step, Aggregation, ImportanceCorrection,
    PolicyLoss, PolicyLossConfig, RatioLevel, StepScale, WeightStats,
};
pub use objectives::PolicyObjective;
pub use rejection::RejectionChain;
pub use shaping::{overlong_penalty, stop_properly, KlController};
pub use stats::Tokens;

/// Which reference implementation a function follows where they disagree
/// (config spelling, `algorithm.flavor`: `openrlhf`, `verl`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    /// OpenRLHF (`openrlhf/models/utils.py`, `trainer/ppo_utils/experience_maker.py`).
    #[default]
    OpenRlhf,
    /// verl (`verl/trainer/ppo/core_algos.py`).
    Verl,
}

impl Flavor {
    /// How the KL and entropy loss terms and the critic's value loss
    /// aggregate, given the policy loss's `policy` aggregation: verl's as
    /// the policy loss (`loss_agg_mode`); OpenRLHF's as a token mean.
    pub fn term_aggregation(self, policy: Aggregation) -> Aggregation {
        match self {
            Flavor::Verl => policy,
            Flavor::OpenRlhf => Aggregation::TokenMean,
        }
    }

    /// The temperature the entropy is measured at, for sampling at
    /// `temperature`: verl's at the sampling temperature, OpenRLHF's on the
    /// raw logits.
    pub fn entropy_temperature(self, temperature: f64) -> f64 {
        match self {
            Flavor::Verl => temperature,
            Flavor::OpenRlhf => 1.0,
        }
    }

    /// The dual clip c when none is set: verl always applies its
    /// `clip_ratio_c` = 3; OpenRLHF none.
    pub fn default_dual_clip(self) -> Option<f64> {
        match self {
            Flavor::Verl => Some(3.0),
            Flavor::OpenRlhf => None,
        }
    }

    /// Whether the score is clipped to the reward clip range before it
    /// becomes a reward (OpenRLHF's `compute_reward`); verl clips nothing.
    pub fn clips_scores(self) -> bool {
        self == Flavor::OpenRlhf
    }
}

/// A `[rows, columns]` float tensor of equal-length rows (tests).
#[cfg(test)]
pub(crate) fn test_rows(rows: &[&[f32]]) -> tch::Tensor {
    let (b, n) = (rows.len() as i64, rows[0].len() as i64);
    tch::Tensor::from_slice(&rows.concat()).view([b, n])
}
