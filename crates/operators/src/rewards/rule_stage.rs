//! `RuleReward`: a rule reward of each response against a dataset column.

use arrow::array::RecordBatch;
use weir_graph::{Stage, StageError, StepContext};

use super::RuleReward as RuleFn;
use crate::data::columns::{strings, with_rewards};
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
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let responses = strings(&batch, col::RESPONSE, ctx.stage())?;
        let answers = strings(&batch, &self.reference, ctx.stage())?;
        let rewards: Vec<f64> = responses
            .iter()
            .zip(&answers)
            .map(|(r, a)| (self.rule)(r, a))
            .collect();
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use weir_graph::WorkerInfo;

    use super::*;
    use crate::rewards::rule_reward;

    #[test]
    fn a_missing_column_is_named_with_the_pipelines_name_for_the_stage() {
        let schema = Schema::new(vec![Field::new(col::RESPONSE, DataType::Utf8, false)]);
        let responses = Arc::new(StringArray::from(vec!["12"])) as ArrayRef;
        let batch = RecordBatch::try_new(Arc::new(schema), vec![responses]).unwrap();
        let mut stage = RuleReward::new(rule_reward("exact").unwrap(), "answer");
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0).in_stage("judge");
        let err = stage.process(&mut ctx, batch).unwrap_err();
        assert_eq!(
            err.to_string(),
            "stage `judge`: column `answer` is missing",
            "the name the pipeline gave the stage, not one of its own"
        );
    }
}
