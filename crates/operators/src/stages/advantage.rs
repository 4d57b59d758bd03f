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
