//! `RefLogprob`: a frozen model's log-probs of each response's tokens: the
//! reference's, or a distillation teacher's.

use arrow::array::RecordBatch;
use tch::Kind;
use weir_gpu::Model;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use super::columns::{float_list_array, token_lists};
use super::sequences::response_logprobs;
use crate::rollout::col;

/// Writes `ref_logprobs` with a frozen model.
pub struct RefLogprob {
    model: Model,
    temperature: f64,
    chunk: usize,
    packed: bool,
    column: &'static str,
}

impl RefLogprob {
    /// A reference stage over `model` (its weights are never updated).
    pub fn new(model: Model, temperature: f64) -> Self {
        RefLogprob {
            model,
            temperature,
            chunk: 0,
            packed: false,
            column: col::REF_LOGPROBS,
        }
    }

    /// Writes the log-probs to `column` instead of `ref_logprobs` (a
    /// teacher's, `teacher_logprobs`).
    pub fn writing(mut self, column: &'static str) -> Self {
        self.column = column;
        self
    }

    /// Runs a batch's rows as one sequence without padding (`algorithm.packing`;
    /// on weir's CPU kernels rows never pad anyway).
    pub fn with_packing(mut self, packed: bool) -> Self {
        self.packed = packed;
        self
    }

    /// Runs the output head on `chunk` response positions at a time (0: all at once).
    pub fn with_logprob_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk;
        self
    }
}

impl Stage for RefLogprob {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, ctx.stage())?;
        let responses = token_lists(&batch, col::RESPONSE_TOKENS, ctx.stage())?;
        let _guard = tch::no_grad_guard();
        let (lp, _) = response_logprobs(
            &self.model,
            &prompts,
            &responses,
            self.temperature,
            self.chunk,
            self.packed,
        )?;
        let lp = lp.to_kind(Kind::Double);
        let rows: Vec<Vec<f64>> = responses
            .iter()
            .enumerate()
            .map(|(i, r)| {
                Vec::<f64>::try_from(lp.get(i as i64).narrow(0, 0, r.len() as i64))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        Ok(vec![with_column(
            &batch,
            self.column,
            float_list_array(&rows),
        )?])
    }
}
