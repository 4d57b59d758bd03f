//! `RuleReward`: a rule reward of each response against a dataset column.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, RecordBatch};
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use super::columns::{strings, with_rewards};
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
        let rewards: Vec<f64> = responses
            .iter()
            .zip(&answers)
            .map(|(r, a)| (self.rule)(r, a))
            .collect();
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}

/// Scores `prompt_tokens + response_tokens` with a reward model
/// (`*ForSequenceClassification`, pooled at the last non-pad token).
pub struct RewardModel {
    model: weir_gpu::Model,
    micro_batch: usize,
}

impl RewardModel {
    /// A reward stage over `model`, `micro_batch` rows per forward pass.
    pub fn new(model: weir_gpu::Model, micro_batch: usize) -> Result<Self, StageError> {
        if model.config.head != weir_gpu::Head::SequenceClassification {
            return Err(format!(
                "{}: `{}` is not a reward model",
                model.source.display(),
                model.config.architecture
            )
            .into());
        }
        Ok(RewardModel {
            model,
            micro_batch: micro_batch.max(1),
        })
    }
}

impl Stage for RewardModel {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let prompts = super::columns::token_lists(&batch, col::PROMPT_TOKENS, "reward")?;
        let responses = super::columns::token_lists(&batch, col::RESPONSE_TOKENS, "reward")?;
        let pad = self.model.config.pad_token_id.unwrap_or(0).max(0);
        let _guard = tch::no_grad_guard();
        let mut scores = Vec::with_capacity(batch.num_rows());
        for start in (0..prompts.len()).step_by(self.micro_batch) {
            let end = (start + self.micro_batch).min(prompts.len());
            let packed = super::sequences::pack(
                &prompts[start..end],
                &responses[start..end],
                pad,
                self.model.device(),
            );
            let s = self.model.scores(&packed.ids, Some(&packed.mask))?;
            scores.extend(
                Vec::<f32>::try_from(s.select(1, 0).to_kind(tch::Kind::Float))
                    .map_err(|e| e.to_string())?,
            );
        }
        Ok(vec![with_column(
            &batch,
            col::REWARD,
            Arc::new(Float32Array::from(scores)) as ArrayRef,
        )?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::AsArray;
    use arrow::datatypes::{DataType, Field, Float32Type};
    use weir_graph::WorkerInfo;

    fn ctx() -> StepContext {
        // A stage context outside an engine run: only the step matters here.
        weir_graph::stage::StepContext::detached(0, WorkerInfo::single(), 0)
    }

    #[test]
    fn reward_model_scores_match_a_direct_forward() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures/models/tiny-llama-rm");
        let model = weir_gpu::Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
        let direct = weir_gpu::Model::load(&dir, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap();
        let prompts = vec![vec![1i64, 286, 202], vec![1, 5]];
        let responses = vec![vec![305i64, 29, 2], vec![9]];
        let schema = std::sync::Arc::new(arrow::datatypes::Schema::new(vec![
            Field::new(
                col::PROMPT_TOKENS,
                DataType::List(std::sync::Arc::new(Field::new(
                    "item",
                    DataType::Int64,
                    false,
                ))),
                false,
            ),
            Field::new(
                col::RESPONSE_TOKENS,
                DataType::List(std::sync::Arc::new(Field::new(
                    "item",
                    DataType::Int64,
                    false,
                ))),
                false,
            ),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                super::super::columns::token_list_array(&prompts),
                super::super::columns::token_list_array(&responses),
            ],
        )
        .unwrap();
        let mut stage = RewardModel::new(model, 1).unwrap();
        let out = stage.process(&mut ctx(), batch).unwrap().remove(0);
        let got = out
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        for i in 0..2 {
            let ids = tch::Tensor::from_slice(&[prompts[i].clone(), responses[i].clone()].concat())
                .view([1, -1]);
            let want = direct.scores(&ids, None).unwrap().double_value(&[0, 0]);
            assert!((f64::from(got.value(i)) - want).abs() < 1e-5);
        }
        let lm = weir_gpu::Model::load(
            &dir.join("../tiny-llama"),
            weir_gpu::Device::Cpu,
            tch::Kind::Float,
        )
        .unwrap();
        assert!(RewardModel::new(lm, 1)
            .err()
            .unwrap()
            .to_string()
            .contains("not a reward model"));
    }
}

/// DAPO's soft overlong punishment (arXiv 2503.14476; OpenRLHF's
/// `overlong_buffer_len` / `overlong_penalty_factor`): adds
/// [`crate::algorithms::overlong_penalty`] of each response's length to its
/// `reward`, 0 up to `max_len − buffer` tokens, then falling linearly to
/// `−factor` at `max_len`. Records the step's mean penalty as `overlong_penalty`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OverlongPenalty {
    /// The longest response (the generator's `max_new_tokens`).
    pub max_len: usize,
    /// The buffer below `max_len` where the penalty grows.
    pub buffer: usize,
    /// The penalty at `max_len`.
    pub factor: f64,
}

impl Stage for OverlongPenalty {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let lengths = super::columns::token_lists(&batch, col::RESPONSE_TOKENS, "overlong")?;
        let rewards = super::columns::f32s(&batch, col::REWARD, "overlong")?;
        let penalties: Vec<f64> = lengths
            .iter()
            .map(|r| {
                crate::algorithms::overlong_penalty(r.len(), self.max_len, self.buffer, self.factor)
            })
            .collect();
        if !penalties.is_empty() {
            ctx.record(
                "overlong_penalty",
                penalties.iter().sum::<f64>() / penalties.len() as f64,
            );
        }
        let shaped: Float32Array = rewards
            .iter()
            .zip(&penalties)
            .map(|(r, p)| (r + p) as f32)
            .collect();
        Ok(vec![with_column(
            &batch,
            col::REWARD,
            Arc::new(shaped) as ArrayRef,
        )?])
    }
}

#[cfg(test)]
mod overlong_tests {
    use super::*;
    use crate::stages::columns::token_list_array;

    #[test]
    fn long_responses_lose_reward_in_the_buffer() {
        let batch = RecordBatch::try_from_iter([
            (
                col::RESPONSE_TOKENS,
                token_list_array(&[vec![1; 4], vec![1; 6], vec![1; 8]]),
            ),
            (
                col::REWARD,
                Arc::new(Float32Array::from(vec![1.0, 1.0, 0.0])) as ArrayRef,
            ),
        ])
        .unwrap();
        let mut stage = OverlongPenalty {
            max_len: 8,
            buffer: 4,
            factor: 1.0,
        };
        let worker = weir_graph::WorkerInfo::single();
        let mut ctx = StepContext::detached(0, worker, 0);
        let out = stage.process(&mut ctx, batch).unwrap();
        let r = crate::stages::columns::f32s(&out[0], col::REWARD, "t").unwrap();
        // Expected length 4: no penalty at 4, −0.5 at 6, −1 at 8.
        assert_eq!(r, vec![1.0, 0.5, -1.0]);
    }
}
