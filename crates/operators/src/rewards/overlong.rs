//! `OverlongPenalty`: DAPO's soft punishment of long responses.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, RecordBatch};
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use crate::rollout::col;

/// DAPO's soft overlong punishment (arXiv 2503.14476; OpenRLHF's
/// `overlong_buffer_len` / `overlong_penalty_factor`): adds
/// [`crate::algorithms::overlong_penalty`] of each response's length to its
/// `reward`, 0 up to `max_len − buffer` tokens, then falling linearly to
/// `−factor` at `max_len`, and keeps the reward before it as `score`.
/// Records the step's mean penalty as `overlong_penalty`.
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
        let lengths = crate::data::columns::token_lists(&batch, col::RESPONSE_TOKENS, "overlong")?;
        let rewards = crate::data::columns::f32s(&batch, col::REWARD, "overlong")?;
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
        let scored = with_column(
            &batch,
            col::SCORE,
            Arc::new(rewards.iter().map(|&r| r as f32).collect::<Float32Array>()) as ArrayRef,
        )?;
        Ok(vec![with_column(
            &scored,
            col::REWARD,
            Arc::new(shaped) as ArrayRef,
        )?])
    }
}

#[cfg(test)]
mod overlong_tests {
    use super::*;
    use crate::data::columns::token_list_array;

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
        let r = crate::data::columns::f32s(&out[0], col::REWARD, "t").unwrap();
        // Expected length 4: no penalty at 4, −0.5 at 6, −1 at 8.
        assert_eq!(r, vec![1.0, 0.5, -1.0]);
        // The score before the penalty stays beside it.
        let scores = crate::data::columns::scores(&out[0], "t").unwrap();
        assert_eq!(scores, vec![1.0, 1.0, 0.0]);
    }
}
