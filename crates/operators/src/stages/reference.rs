//! `RefLogprob`: a frozen model's log-probs of each response's tokens: the
//! reference's, or a distillation teacher's (with its top-k tokens at each
//! position, when asked).

use arrow::array::RecordBatch;
use tch::Kind;
use weir_gpu::Model;
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use crate::data::columns::{float_list_array, token_list_array, token_lists};
use crate::rollout::col;
use crate::training::sequences::{response_logprobs, response_top_logprobs, TopTokens};

/// Writes `ref_logprobs` with a frozen model.
pub struct RefLogprob {
    model: Model,
    temperature: f64,
    chunk: usize,
    packed: bool,
    column: &'static str,
    top: TopTokens,
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
            top: TopTokens::default(),
        }
    }

    /// Also writes the `k` most likely tokens at each response position
    /// and their log-probs (`teacher_topk_ids`, `teacher_topk_logprobs`;
    /// 0: not). Read on libtorch (the CPU kernels read sampled tokens only),
    /// so the model keeps its libtorch weights. With `below`, the top k are
    /// taken among the ids below it (the student's vocabulary, where the
    /// teacher's pads further: ids the student has no logit for), their
    /// log-probs still the teacher's whole softmax.
    pub fn with_top_k(mut self, k: usize, below: Option<i64>) -> Self {
        self.top = TopTokens { k, below };
        self
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
        let lengths: Vec<i64> = responses.iter().map(|r| r.len() as i64).collect();
        // Row i's first `len` entries along dimension 1, flattened.
        let row =
            |t: &tch::Tensor, i: usize| t.get(i as i64).narrow(0, 0, lengths[i]).reshape([-1]);
        let mut batch = batch;
        let lp = if self.top.k > 0 {
            let read = response_top_logprobs(
                &self.model,
                &prompts,
                &responses,
                self.temperature,
                self.top,
                self.chunk,
                self.packed,
            )?;
            let (top, ids) = (
                read.top.to_kind(Kind::Double),
                read.ids.to_kind(Kind::Int64),
            );
            let (mut tops, mut top_ids) = (Vec::new(), Vec::new());
            for i in 0..responses.len() {
                tops.push(Vec::<f64>::try_from(row(&top, i)).map_err(|e| e.to_string())?);
                top_ids.push(Vec::<i64>::try_from(row(&ids, i)).map_err(|e| e.to_string())?);
            }
            batch = with_column(&batch, col::TEACHER_TOPK_LOGPROBS, float_list_array(&tops))?;
            batch = with_column(&batch, col::TEACHER_TOPK_IDS, token_list_array(&top_ids))?;
            read.logprobs
        } else {
            response_logprobs(
                &self.model,
                &prompts,
                &responses,
                self.temperature,
                self.chunk,
                self.packed,
            )?
            .0
        };
        let lp = lp.to_kind(Kind::Double);
        let rows: Vec<Vec<f64>> = (0..responses.len())
            .map(|i| Vec::<f64>::try_from(row(&lp, i)).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        Ok(vec![with_column(
            &batch,
            self.column,
            float_list_array(&rows),
        )?])
    }
}
