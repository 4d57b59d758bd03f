//! `RewardModel`: a reward model's score of each prompt and response.

use std::sync::Arc;

use arrow::array::{ArrayRef, Float32Array, RecordBatch};
use weir_graph::batch::with_column;
use weir_graph::{Stage, StageError, StepContext};

use crate::rollout::col;

/// Rows of token ids.
type Tokens = Vec<Vec<i64>>;

/// Scores `prompt_tokens + response_tokens` with a reward model
/// (`*ForSequenceClassification`, pooled at the last non-pad token), or,
/// for a reward model whose tokenizer is not the policy's, each row as
/// text through its own tokenizer ([`RewardModel::reading_text`]).
pub struct RewardModel {
    model: weir_gpu::Model,
    micro_batch: usize,
    /// The reward model's own tokenizer, when it reads rows as text.
    text: Option<weir_gpu::Tokenizer>,
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
            text: None,
        })
    }

    /// Scores each row as text, through the reward model's own `tokenizer`
    /// (verl's reward model with another tokenizer than the policy's, and
    /// TRL's reward processing class): the row's conversation (the prompt
    /// file's, `prompt_messages`, else the prompt as a user message) with
    /// the completion (cut at its end-of-turn marker) as the assistant's
    /// answer, rendered by its chat template; without one, the
    /// conversation's plain text ([`plain_prompt`](crate::data::columns::plain_prompt))
    /// and the completion, its special tokens added.
    pub fn reading_text(mut self, tokenizer: weir_gpu::Tokenizer) -> Self {
        self.text = Some(tokenizer);
        self
    }

    /// Each row of `batch` as the reward model's tokens: the policy's
    /// prompt and response tokens, or, reading text, the row rendered anew
    /// (an empty response beside it).
    fn rows(&self, batch: &RecordBatch, stage: &str) -> Result<(Tokens, Tokens), StageError> {
        use crate::data::columns::{plain_prompt, row_conversations, strings, token_lists};
        let Some(tokenizer) = &self.text else {
            return Ok((
                token_lists(batch, col::PROMPT_TOKENS, stage)?,
                token_lists(batch, col::RESPONSE_TOKENS, stage)?,
            ));
        };
        let responses = strings(batch, col::RESPONSE, stage)?;
        let mut rows = Vec::with_capacity(responses.len());
        for (mut messages, response) in row_conversations(batch, stage)?.into_iter().zip(&responses)
        {
            let completion = super::rules::completion(response);
            let ids = if tokenizer.chat_template().is_some() {
                messages.push(serde_json::json!({"role": "assistant", "content": completion}));
                tokenizer.encode_conversation(&messages, None, false)?
            } else {
                tokenizer.encode(&format!("{}{completion}", plain_prompt(&messages)), true)?
            };
            rows.push(ids);
        }
        Ok((rows, vec![Vec::new(); responses.len()]))
    }
}

impl Stage for RewardModel {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let stage = ctx.stage();
        let (prompts, responses) = self.rows(&batch, stage)?;
        let _guard = tch::no_grad_guard();
        let mut scores = Vec::with_capacity(batch.num_rows());
        for start in (0..prompts.len()).step_by(self.micro_batch) {
            let end = (start + self.micro_batch).min(prompts.len());
            let packed = crate::training::sequences::pack_for(
                &self.model,
                &prompts[start..end],
                &responses[start..end],
            )?;
            let lengths: Vec<i64> = prompts[start..end]
                .iter()
                .zip(&responses[start..end])
                .map(|(p, r)| (p.len() + r.len()) as i64)
                .collect();
            let s = self.model.scores_of_rows(&packed.ids, &lengths)?;
            scores.extend(
                Vec::<f32>::try_from(s.select(1, 0).to_kind(tch::Kind::Float))
                    .map_err(|e| e.to_string())?,
            );
        }
        finite_scores(&scores)?;
        Ok(vec![with_column(
            &batch,
            col::REWARD,
            Arc::new(Float32Array::from(scores)) as ArrayRef,
        )?])
    }
}

/// A reward model's scores must be numbers: NaN or an infinity (weights
/// that overflow, or a score past f32) would poison every advantage.
fn finite_scores(scores: &[f32]) -> Result<(), StageError> {
    match scores.iter().position(|s| !s.is_finite()) {
        Some(i) => Err(format!(
            "reward model: row {i}: the score is {}: the model's output overflows (a reward must be a finite number)",
            scores[i]
        )
        .into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_that_are_not_numbers_name_their_row() {
        assert!(finite_scores(&[0.5, -3.0]).is_ok());
        let err = finite_scores(&[0.5, f32::NAN]).unwrap_err().to_string();
        assert!(err.contains("row 1: the score is NaN"), "{err}");
        let err = finite_scores(&[f32::INFINITY]).unwrap_err().to_string();
        assert!(err.contains("row 0: the score is inf"), "{err}");
    }
    use arrow::array::AsArray;
    use arrow::datatypes::{DataType, Field, Float32Type};
    use weir_graph::WorkerInfo;

    fn ctx() -> StepContext {
        // A stage context outside an engine run: only the step matters here.
        weir_graph::stage::StepContext::detached(0, WorkerInfo::single(), 0)
    }

    /// The fixture reward model and a copy of it without a padding id
    /// (as many Qwen3 reward checkpoints): rows of different lengths score
    /// alone or side by side in one micro-batch as a direct forward of each.
    #[test]
    fn reward_model_scores_match_a_direct_forward() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/tiny-llama-rm");
        let unpadded = tempfile::tempdir().unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        config["pad_token_id"] = serde_json::Value::Null;
        std::fs::write(unpadded.path().join("config.json"), config.to_string()).unwrap();
        std::fs::copy(
            dir.join("model.safetensors"),
            unpadded.path().join("model.safetensors"),
        )
        .unwrap();
        let prompts = vec![vec![1i64, 286, 202], vec![1, 5], vec![1, 3, 7]];
        let responses = vec![vec![305i64, 29, 2], vec![9], vec![3]];
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
                crate::data::columns::token_list_array(&prompts),
                crate::data::columns::token_list_array(&responses),
            ],
        )
        .unwrap();
        for checkpoint in [dir.as_path(), unpadded.path()] {
            let load = || {
                weir_gpu::Model::load(checkpoint, weir_gpu::Device::Cpu, tch::Kind::Float).unwrap()
            };
            let direct = load();
            for micro_batch in [1, 3] {
                let mut stage = RewardModel::new(load(), micro_batch).unwrap();
                let out = stage.process(&mut ctx(), batch.clone()).unwrap().remove(0);
                let got = out
                    .column_by_name(col::REWARD)
                    .unwrap()
                    .as_primitive::<Float32Type>();
                for i in 0..prompts.len() {
                    let ids = tch::Tensor::from_slice(
                        &[prompts[i].clone(), responses[i].clone()].concat(),
                    )
                    .view([1, -1]);
                    let want = direct.scores(&ids, None).unwrap().double_value(&[0, 0]);
                    let got = f64::from(got.value(i));
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{}, micro-batch {micro_batch}, row {i}: {got} vs {want}",
                        checkpoint.display()
                    );
                }
            }
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
