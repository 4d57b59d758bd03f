//! `RuleReward`: a rule reward of each response against a dataset column.

use arrow::array::RecordBatch;
use weir_graph::{Stage, StageError, StepContext};

use super::RuleReward as RuleFn;
use crate::rollout::col;
use crate::stages::columns::{strings, with_rewards};

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
        let rewards: Vec<f64> = responses
            .iter()
            .zip(&answers)
            .map(|(r, a)| (self.rule)(r, a))
            .collect();
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}
