//! Rewards by how a response ended: `FinishRewards` replaces the reward
//! of rows whose `finish_reason` a rule names (`reward.on_finish`, e.g.
//! zero for a truncated response), and `NoReward` gives every row 0
//! (`reward.kind = "none"`, where an environment's turn rewards are the
//! rewards).

use std::collections::BTreeMap;

use arrow::array::RecordBatch;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use crate::data::columns::{f32s, float_list_array, float_lists, strings, with_rewards};
use crate::rollout::col;

/// The `finish_reason`s a response or an episode may end with.
pub const FINISH_REASONS: &[&str] = &[
    "stop",
    "length",
    "max_turns",
    "tool_error",
    "env_error",
    "timeout",
];

/// Replaces the reward of each row whose `finish_reason` has a rule by
/// the rule's value; an episode's environment turn rewards (`env_rewards`)
/// are zeroed with it, so the value is the whole of what the row earns.
/// Records `finish_replaced`, the share of rows replaced.
#[derive(Clone, Debug, PartialEq)]
pub struct FinishRewards {
    /// Reward by finish reason.
    pub rules: BTreeMap<String, f64>,
}

impl Stage for FinishRewards {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let stage = ctx.stage().to_string();
        let stage = stage.as_str();
        let reasons = strings(&batch, col::FINISH_REASON, stage)?;
        let mut rewards = f32s(&batch, col::REWARD, stage)?;
        let replaced: Vec<bool> = reasons.iter().map(|r| self.rules.contains_key(r)).collect();
        for (reward, reason) in rewards.iter_mut().zip(&reasons) {
            if let Some(&value) = self.rules.get(reason) {
                *reward = value;
            }
        }
        if !rewards.is_empty() {
            let n = replaced.iter().filter(|&&r| r).count();
            ctx.record("finish_replaced", n as f64 / rewards.len() as f64);
        }
        let mut out = with_rewards(&batch, &rewards)?;
        if out.column_by_name(col::ENV_REWARDS).is_some() {
            let mut turns = float_lists(&out, col::ENV_REWARDS, stage)?;
            for (row, zero) in turns.iter_mut().zip(&replaced) {
                if *zero {
                    row.iter_mut().for_each(|r| *r = 0.0);
                }
            }
            out = with_column(&out, col::ENV_REWARDS, float_list_array(&turns))?;
        }
        Ok(vec![out])
    }
}

/// ProRL's stop-properly penalty on truncated responses
/// ([`crate::algorithms::stop_properly`], `reward.stop_properly_coef`):
/// the reward of a row whose `finish_reason` is `length` is scaled by
/// `coef` (≥ 0) or replaced by it (< 0). Records `stop_properly_truncated`,
/// the share of rows it touched.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StopProperly {
    /// The scale (in [0, 1]) or, negative, the reward of a truncated row.
    pub coef: f64,
}

impl Stage for StopProperly {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let stage = ctx.stage().to_string();
        let reasons = strings(&batch, col::FINISH_REASON, &stage)?;
        let mut rewards = f32s(&batch, col::REWARD, &stage)?;
        let mut truncated = 0;
        for (reward, reason) in rewards.iter_mut().zip(&reasons) {
            let cut = reason == "length";
            truncated += usize::from(cut);
            *reward = crate::algorithms::stop_properly(*reward, cut, self.coef);
        }
        if !rewards.is_empty() {
            ctx.record(
                "stop_properly_truncated",
                truncated as f64 / rewards.len() as f64,
            );
        }
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}

/// Every row's reward is 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoReward;

impl Stage for NoReward {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let zeros = vec![0.0; batch.num_rows()];
        Ok(vec![with_rewards(&batch, &zeros)?])
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Float32Array, StringArray};
    use weir_graph::WorkerInfo;

    use super::*;

    #[test]
    fn a_rule_replaces_the_reward_of_its_rows_and_zeroes_their_turn_rewards() {
        let batch = RecordBatch::try_from_iter([
            (
                col::FINISH_REASON,
                Arc::new(StringArray::from(vec!["stop", "length", "timeout"])) as ArrayRef,
            ),
            (
                col::REWARD,
                Arc::new(Float32Array::from(vec![1.0f32, 1.0, 0.5])) as ArrayRef,
            ),
            (
                col::ENV_REWARDS,
                float_list_array(&[vec![0.0, 0.25], vec![0.5], vec![0.0, 1.0]]),
            ),
        ])
        .unwrap();
        let mut stage = FinishRewards {
            rules: [("length".to_string(), 0.0), ("timeout".to_string(), -1.0)].into(),
        };
        let mut ctx = StepContext::detached(0, WorkerInfo::single(), 0);
        let out = stage.process(&mut ctx, batch).unwrap().remove(0);
        assert_eq!(f32s(&out, col::REWARD, "t").unwrap(), [1.0, 0.0, -1.0]);
        assert_eq!(
            float_lists(&out, col::ENV_REWARDS, "t").unwrap(),
            [vec![0.0, 0.25], vec![0.0], vec![0.0, 0.0]]
        );
        let share = ctx
            .recorded()
            .iter()
            .find(|(name, _)| name == "finish_replaced")
            .map(|(_, v)| *v);
        assert_eq!(share, Some(2.0 / 3.0));
    }
}
