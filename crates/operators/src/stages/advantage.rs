//! `GroupAdvantage`: group-relative advantages (GRPO, Dr.GRPO, RLOO) over
//! whole prompt groups. Rows of one group may arrive in several batches
//! (from several generators); the stage keeps a step's rows and computes at
//! `end_step`, so its input edge must be partitioned `ByKey("group_id")`.

use std::collections::BTreeMap;

use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use super::columns::{f32s, float_lists, u64s};
use crate::algorithms::{grpo, rloo, Flavor};
use crate::rollout::col;

/// Which group baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupEstimator {
    /// `(r − mean) / (std + ε)`.
    Grpo,
    /// `r − mean`.
    DrGrpo,
    /// `r − mean of the others`.
    Rloo,
}

/// Computes `advantages` (the group-relative advantage on every response
/// token) and `returns` (the same, as outcome-only estimators define them).
pub struct GroupAdvantage {
    estimator: GroupEstimator,
    flavor: Flavor,
    held: BTreeMap<u64, Vec<RecordBatch>>,
}

impl GroupAdvantage {
    /// An advantage stage.
    pub fn new(estimator: GroupEstimator, flavor: Flavor) -> Self {
        GroupAdvantage {
            estimator,
            flavor,
            held: BTreeMap::new(),
        }
    }
}

impl Stage for GroupAdvantage {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.held.entry(ctx.step).or_default().push(batch);
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let Some(held) = self.held.remove(&ctx.step) else {
            return Ok(Vec::new());
        };
        let batch = concat_batches(&held[0].schema(), &held)?;
        let rewards = f32s(&batch, col::REWARD, "advantage")?;
        let groups = u64s(&batch, col::GROUP_ID, "advantage")?;
        let per_response = match self.estimator {
            GroupEstimator::Grpo => grpo(&rewards, &groups, true, self.flavor)?,
            GroupEstimator::DrGrpo => grpo(&rewards, &groups, false, self.flavor)?,
            GroupEstimator::Rloo => rloo(&rewards, &groups, self.flavor)?,
        };
        let lengths: Vec<usize> = float_lists(&batch, col::BEHAVIOR_LOGPROBS, "advantage")?
            .iter()
            .map(Vec::len)
            .collect();
        let per_token: Vec<Vec<f64>> = per_response
            .iter()
            .zip(&lengths)
            .map(|(a, n)| vec![*a; *n])
            .collect();
        let batch = with_column(
            &batch,
            col::ADVANTAGES,
            super::columns::float_list_array(&per_token),
        )?;
        let batch = with_column(
            &batch,
            col::RETURNS,
            super::columns::float_list_array(&per_token),
        )?;
        Ok(vec![batch])
    }
}

/// PPO's advantages: per-token rewards (the score on the last token, minus
/// `kl_coef ·` KL(behaviour ‖ reference) on every token, score clipped to
/// `reward_clip`), then GAE with the critic's `values`, then whitening over
/// the step's rows. Writes `token_rewards`, `advantages` and `returns`.
pub struct GaeAdvantage {
    /// Discount.
    pub gamma: f64,
    /// GAE λ.
    pub lambda: f64,
    /// β of the KL penalty in the reward (0: none; needs `ref_logprobs` otherwise).
    pub kl_coef: f64,
    /// The KL estimator of the penalty.
    pub kl_estimator: crate::algorithms::KlEstimator,
    /// Clip range of the score.
    pub reward_clip: Option<(f64, f64)>,
    /// Whiten the advantages over the step.
    pub whiten: bool,
    /// Whose semantics.
    pub flavor: Flavor,
    held: BTreeMap<u64, Vec<RecordBatch>>,
}

impl GaeAdvantage {
    /// OpenRLHF's defaults: γ = λ = 1, k1, score clipped to ±10, whitened.
    pub fn new(kl_coef: f64) -> Self {
        GaeAdvantage {
            gamma: 1.0,
            lambda: 1.0,
            kl_coef,
            kl_estimator: crate::algorithms::KlEstimator::K1,
            reward_clip: Some((-10.0, 10.0)),
            whiten: true,
            flavor: Flavor::OpenRlhf,
            held: BTreeMap::new(),
        }
    }
}

impl Stage for GaeAdvantage {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.held.entry(ctx.step).or_default().push(batch);
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        use crate::algorithms::{gae, kl_tokens, token_rewards, whiten_advantages};
        let Some(held) = self.held.remove(&ctx.step) else {
            return Ok(Vec::new());
        };
        let batch = concat_batches(&held[0].schema(), &held)?;
        let scores = f32s(&batch, col::REWARD, "advantage")?;
        let behaviour = float_lists(&batch, col::BEHAVIOR_LOGPROBS, "advantage")?;
        let values = float_lists(&batch, col::VALUES, "advantage")?;
        let mask: Vec<Vec<f64>> = behaviour.iter().map(|r| vec![1.0; r.len()]).collect();
        let kl = if self.kl_coef > 0.0 {
            let reference = float_lists(&batch, col::REF_LOGPROBS, "advantage")?;
            kl_tokens(&behaviour, &reference, self.kl_estimator, self.flavor)
        } else {
            mask.iter().map(|r| vec![0.0; r.len()]).collect()
        };
        let rewards = token_rewards(&scores, &kl, &mask, self.kl_coef, self.reward_clip);
        let (advantages, returns) = gae(
            &rewards,
            &values,
            &mask,
            self.gamma,
            self.lambda,
            self.flavor,
        );
        let advantages = if self.whiten {
            whiten_advantages(&advantages, &mask, false, self.flavor)
        } else {
            advantages
        };
        let batch = with_column(
            &batch,
            col::TOKEN_REWARDS,
            super::columns::float_list_array(&rewards),
        )?;
        let batch = with_column(
            &batch,
            col::ADVANTAGES,
            super::columns::float_list_array(&advantages),
        )?;
        let batch = with_column(
            &batch,
            col::RETURNS,
            super::columns::float_list_array(&returns),
        )?;
        Ok(vec![batch])
    }
}
