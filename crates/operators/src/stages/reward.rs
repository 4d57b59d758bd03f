//! `RuleReward`: a rule reward of each response against a dataset column.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, RecordBatch};
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use super::columns::strings;
use crate::rewards::RuleReward as RuleFn;
use crate::rollout::col;

/// Scores `response` against the column `reference` with a rule.
pub struct RuleReward {
    rule: RuleFn,
    reference: String,
}

impl RuleReward {
    /// Rewards with `rule(response, row[reference])`.
    pub fn new(rule: RuleFn, reference: &str) -> Self {
        RuleReward {
            rule,
            reference: reference.to_string(),
        }
    }
}

impl Stage for RuleReward {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let responses = strings(&batch, col::RESPONSE, "reward")?;
        let answers = strings(&batch, &self.reference, "reward")?;
        let rewards: Float32Array = responses
            .iter()
            .zip(&answers)
            .map(|(r, a)| (self.rule)(r, a) as f32)
            .collect();
        Ok(vec![with_column(
            &batch,
            col::REWARD,
            Arc::new(rewards) as ArrayRef,
        )?])
    }
}
