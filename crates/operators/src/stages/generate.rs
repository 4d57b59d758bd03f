//! `Generate`: the actor. Samples one response per row (the source already
//! expanded prompts × n), writes the response columns, and loads new
//! weights from the weights edge (safetensors snapshots).

use std::sync::Arc;
use std::time::Instant;

use arrow::array::AsArray;
use arrow::array::{ArrayRef, Float32Array, RecordBatch, StringArray};
use weir_gpu::{generate_with_ids, Generation, Model, SamplingParams, Tokenizer};
use weir_graph::batch::with_column;
use weir_graph::{PolicyVersion, Stage, StageError, StepContext, WeightsPayload};

use super::columns::{float_list_array, token_list_array, token_lists, u32s, u64s};
use crate::rollout::col;

/// The actor's generation stage.
pub struct Generate {
    model: Model,
    tokenizer: Tokenizer,
    params: SamplingParams,
}

impl Generate {
    /// Generates with `model` and `params` (n is taken from the rows: one response per row).
    pub fn new(model: Model, tokenizer: Tokenizer, params: SamplingParams) -> Self {
        Generate {
            model,
            tokenizer,
            params: SamplingParams { n: 1, ..params },
        }
    }
}

impl Generate {
    /// Samples with `params` from now on (n is still one response per row).
    pub fn set_params(&mut self, params: SamplingParams) {
        self.params = SamplingParams { n: 1, ..params };
    }
}

impl Generate {
    /// One generation per row: with the sampling parameters, or greedily
    /// for rows marked `greedy_baseline` (ReMax's baseline responses).
    fn generate_rows(
        &self,
        batch: &RecordBatch,
        prompts: &[Vec<i64>],
        streams: &[u64],
    ) -> Result<Vec<Generation>, StageError> {
        let greedy: Vec<bool> = match batch.column_by_name(col::GREEDY_BASELINE) {
            None => {
                return Ok(generate_with_ids(
                    &self.model,
                    prompts,
                    streams,
                    &self.params,
                )?)
            }
            Some(c) => c
                .as_boolean_opt()
                .ok_or_else(|| format!("generate: column `{}` is not bool", col::GREEDY_BASELINE))?
                .iter()
                .map(|v| v.unwrap_or(false))
                .collect(),
        };
        let greedy_params = SamplingParams {
            greedy: true,
            ..self.params.clone()
        };
        let mut out: Vec<Option<Generation>> = vec![None; prompts.len()];
        for (want, params) in [(false, &self.params), (true, &greedy_params)] {
            let idx: Vec<usize> = (0..prompts.len()).filter(|&i| greedy[i] == want).collect();
            if idx.is_empty() {
                continue;
            }
            let p: Vec<Vec<i64>> = idx.iter().map(|&i| prompts[i].clone()).collect();
            let s: Vec<u64> = idx.iter().map(|&i| streams[i]).collect();
            for (i, g) in idx
                .into_iter()
                .zip(generate_with_ids(&self.model, &p, &s, params)?)
            {
                out[i] = Some(g);
            }
        }
        Ok(out.into_iter().flatten().collect())
    }
}

impl Stage for Generate {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let name = "generate";
        let prompts = token_lists(&batch, col::PROMPT_TOKENS, name)?;
        let groups = u64s(&batch, col::GROUP_ID, name)?;
        let samples = u32s(&batch, col::SAMPLE_IDX, name)?;
        // A row's random stream depends only on its group and sample: reproducible under any batching.
        let streams: Vec<u64> = groups
            .iter()
            .zip(&samples)
            .map(|(g, s)| (g << 16) ^ u64::from(*s))
            .collect();
        let started = Instant::now();
        let out = self.generate_rows(&batch, &prompts, &streams)?;
        let seconds = started.elapsed().as_secs_f64() as f32;
        let tokens: Vec<Vec<i64>> = out.iter().map(|g| g.tokens.clone()).collect();
        let logprobs: Vec<Vec<f64>> = out
            .iter()
            .map(|g| g.logprobs.iter().map(|x| f64::from(*x)).collect())
            .collect();
        let texts: Vec<String> = out
            .iter()
            .map(|g| self.tokenizer.decode(&g.tokens, true))
            .collect::<Result<_, _>>()?;
        let reasons: Vec<&str> = out.iter().map(|g| g.finish_reason.as_str()).collect();
        let n = batch.num_rows();
        let mut b = batch;
        b = with_column(
            &b,
            col::RESPONSE,
            Arc::new(StringArray::from(texts)) as ArrayRef,
        )?;
        b = with_column(&b, col::RESPONSE_TOKENS, token_list_array(&tokens))?;
        b = with_column(&b, col::BEHAVIOR_LOGPROBS, float_list_array(&logprobs))?;
        // The engine stamps policy_version; put it in its schema position now so the order is stable.
        b = weir_graph::batch::with_u64_column(&b, col::POLICY_VERSION, ctx.version)?;
        b = with_column(
            &b,
            col::FINISH_REASON,
            Arc::new(StringArray::from(reasons)) as ArrayRef,
        )?;
        b = with_column(
            &b,
            col::GENERATE_S,
            Arc::new(Float32Array::from_value(seconds, n)) as ArrayRef,
        )?;
        Ok(vec![b])
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let got = self.model.apply_snapshot(weights.bytes())?;
        if got != version {
            return Err(
                format!("weights edge says version {version}, the snapshot says {got}").into(),
            );
        }
        Ok(())
    }
}
