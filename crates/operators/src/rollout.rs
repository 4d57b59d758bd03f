//! The rollout batch: one Arrow schema, declared once, that grows column by
//! column as a batch flows through the stages. Every stage names columns
//! through the constants here, so a misspelt column is a compile error.
//! Per-token columns are `List<Float32>` aligned with `response_tokens`.
//! The Parquet rollout log stores exactly these batches, with
//! [`SCHEMA_VERSION`] in the file metadata under [`SCHEMA_VERSION_KEY`].

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

/// The rollout schema's version (bumped when a column changes meaning or type).
pub const SCHEMA_VERSION: &str = "1";
/// The metadata key holding [`SCHEMA_VERSION`].
pub const SCHEMA_VERSION_KEY: &str = "weir.rollout_schema_version";

/// Column names.
pub mod col {
    /// Step the row belongs to (u64).
    pub const STEP: &str = "step";
    /// The prompt's id in its dataset (u64).
    pub const PROMPT_ID: &str = "prompt_id";
    /// The group the row's advantage is computed in (u64; one per prompt and step).
    pub const GROUP_ID: &str = "group_id";
    /// Which of the n samples of its prompt (u32).
    pub const SAMPLE_IDX: &str = "sample_idx";
    /// The prompt text as given, or, for a prompt file read through the
    /// chat template, the text the template rendered (utf8).
    pub const PROMPT: &str = "prompt";
    /// The conversation a prompt file's chat template rendered into
    /// `prompt`: JSON, a list of `{role, content}` (utf8; optional, written
    /// where `data.apply_chat_template`, `data.messages_column` or
    /// `data.system_prompt` renders the prompts of a file).
    pub const PROMPT_MESSAGES: &str = "prompt_messages";
    /// The prompt's token ids after the chat template (list<i64>).
    pub const PROMPT_TOKENS: &str = "prompt_tokens";
    /// The response text (utf8).
    pub const RESPONSE: &str = "response";
    /// The response's token ids (list<i64>).
    pub const RESPONSE_TOKENS: &str = "response_tokens";
    /// Per-token log-probs under the distribution the generator sampled from
    /// (list<f32>; an episode's are null on its observation and boundary tokens).
    pub const BEHAVIOR_LOGPROBS: &str = "behavior_logprobs";
    /// The weights version that generated the row (u64): the oldest of its
    /// `token_versions` (the engine stamps the generator's version on rows
    /// that lack it); staleness is measured on it.
    pub const POLICY_VERSION: &str = weir_graph::columns::POLICY_VERSION;
    /// Each generated token's `Σ_v π(v)²` under the distribution it was
    /// sampled from (list<f32>, aligned with the response tokens, 0 on an
    /// episode's other tokens; the `otb` pipeline's path variance).
    pub const SUM_PI_SQUARED: &str = "sum_pi_squared";
    /// `stop` or `length` (utf8).
    pub const FINISH_REASON: &str = "finish_reason";
    /// The response's scalar reward (f32).
    pub const REWARD: &str = "reward";
    /// The reward before DAPO's overlong penalty (f32; only where one
    /// applies): what the dynamic-sampling filter and the curriculum judge,
    /// as verl's DAPO filters on `acc`, the score without the penalty.
    pub const SCORE: &str = "score";
    /// Each `[[reward.terms]]` term's own score, unweighted, in the
    /// config's order (list<f32>; `reward.kind = "terms"`): what GDPO
    /// (`algorithm.gdpo`) normalises term by term.
    pub const REWARD_TERMS: &str = "reward_terms";
    /// The judge's answer to the row (utf8; a `[judge]` reward): its
    /// generated text, or under a probability verdict its most likely
    /// first token.
    pub const JUDGE_RESPONSE: &str = "judge_response";
    /// Per-token rewards, KL penalty included (list<f32>, optional).
    pub const TOKEN_REWARDS: &str = "token_rewards";
    /// Per-token log-probs under the reference model (list<f32>).
    pub const REF_LOGPROBS: &str = "ref_logprobs";
    /// Per-token log-probs of the sampled tokens under the teacher (list<f32>; `distill`).
    pub const TEACHER_LOGPROBS: &str = "teacher_logprobs";
    /// The teacher's `teacher.top_k` largest log-probs at each response
    /// position, descending, position after position (list<f32> of
    /// k × response length; `distill` with `teacher.top_k`).
    pub const TEACHER_TOPK_LOGPROBS: &str = "teacher_topk_logprobs";
    /// Their token ids, laid out alike (list<i64>).
    pub const TEACHER_TOPK_IDS: &str = "teacher_topk_ids";
    /// Per-token critic values (list<f32>).
    pub const VALUES: &str = "values";
    /// Per-token advantages (list<f32>).
    pub const ADVANTAGES: &str = "advantages";
    /// Per-token returns (list<f32>).
    pub const RETURNS: &str = "returns";
    /// The learner's version when it consumed the row (u64; set by the engine).
    pub const LEARNER_VERSION: &str = weir_graph::columns::LEARNER_VERSION;
    /// learner_version − policy_version (u64; set by the engine).
    pub const STALENESS: &str = weir_graph::columns::STALENESS;
    /// Seconds the generator spent on the row's batch (f32); with streaming
    /// generation, from the row's admission to its last token.
    pub const GENERATE_S: &str = "generate_s";
    /// When the row's generation started (f64, seconds since the Unix
    /// epoch): its batch's call, or with streaming its admission to the pool.
    pub const STARTED_UNIX_S: &str = "started_unix_s";
    /// The policy version that sampled each response token (list<u32>);
    /// `policy_version` is the oldest of them.
    pub const TOKEN_VERSIONS: &str = "token_versions";
    /// Whether each token's context had been run again under its version
    /// before it was sampled (list<bool>; `generate.on_new_weights = "recompute"`).
    pub const KV_RECOMPUTED: &str = "kv_recomputed";
    /// What each response token of an episode is (list<u8>, a
    /// [`super::TokenKind`] each): generated by the model, an observation
    /// (a tool's or an environment's output), or a template boundary. A
    /// row without it (null, or the column absent) is all generated. Every
    /// loss, KL, entropy, advantage and token count sees only generated
    /// tokens.
    pub const TOKEN_KINDS: &str = "token_kinds";
    /// The turn of an episode each response token belongs to (list<u32>,
    /// from 0; an observation or boundary: the turn it answers).
    pub const TOKEN_TURNS: &str = "token_turns";
    /// An environment's reward for each turn of an episode, on the turn's
    /// last generated token, 0 elsewhere (list<f32>). The advantage stages
    /// add it to the per-token rewards (GAE, REINFORCE++) or its sum to the
    /// row's reward (the group estimators).
    pub const ENV_REWARDS: &str = "env_rewards";
    /// Where the row came from (utf8; only in runs that train from logs,
    /// `data.rollouts`): `generated` by this run's actor, or `log`, replayed
    /// from an earlier run's rollout log.
    pub const SOURCE: &str = "source";
    /// A replayed row's step in the log it came from (u64; null for
    /// generated rows).
    pub const LOGGED_STEP: &str = "logged_step";
    /// The policy version that sampled a replayed row (u64; null for
    /// generated rows): its `policy_version` in the log it came from. The
    /// row is off-policy by the learner's version less this, which no
    /// staleness bound limits; the importance correction weighs it.
    pub const LOGGED_POLICY_VERSION: &str = "logged_policy_version";
    /// ReMax: marks the one greedy response per prompt whose reward is the
    /// group's baseline (bool; only in ReMax runs, dropped with those rows
    /// before the learner).
    pub const GREEDY_BASELINE: &str = "greedy_baseline";
    /// ReMax: the reward of the prompt's greedy response, subtracted from each sample's.
    pub const REWARD_BASELINE: &str = "reward_baseline";
}

/// What a token of an episode's response is (`token_kinds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TokenKind {
    /// Sampled by the model: the only kind any loss or count sees.
    Generated = 0,
    /// A tool's or an environment's output, rendered by the chat template.
    Observation = 1,
    /// A token the chat template puts between a turn and what follows it.
    Boundary = 2,
}

impl TokenKind {
    /// The kind stored as `code`, if it is one.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(TokenKind::Generated),
            1 => Some(TokenKind::Observation),
            2 => Some(TokenKind::Boundary),
            _ => None,
        }
    }
}

/// The stage after which a column exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Written by the prompt source.
    Prompt,
    /// Written by the generator.
    Generate,
    /// Written by reward, reference and critic scoring.
    Score,
    /// Written by the advantage stage.
    Advantage,
    /// Written by the learner (and the engine around it).
    Learn,
}

fn tokens_i64() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Int64, false)))
}

fn per_token() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Float32, false)))
}

/// Per-token values that may be null (an episode's behaviour log-probs off
/// its generated tokens).
fn per_token_nullable() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Float32, true)))
}

/// Every engine-defined column: name, type, nullable, the phase that writes
/// it, and whether it is per-token (aligned with `response_tokens`).
pub fn columns() -> Vec<(&'static str, DataType, bool, Phase, bool)> {
    use DataType::*;
    vec![
        (col::STEP, UInt64, false, Phase::Prompt, false),
        (col::PROMPT_ID, UInt64, false, Phase::Prompt, false),
        (col::GROUP_ID, UInt64, false, Phase::Prompt, false),
        (col::SAMPLE_IDX, UInt32, false, Phase::Prompt, false),
        (col::PROMPT, Utf8, false, Phase::Prompt, false),
        (col::PROMPT_MESSAGES, Utf8, true, Phase::Prompt, false),
        (
            col::PROMPT_TOKENS,
            tokens_i64(),
            false,
            Phase::Prompt,
            false,
        ),
        (col::RESPONSE, Utf8, false, Phase::Generate, false),
        (
            col::RESPONSE_TOKENS,
            tokens_i64(),
            false,
            Phase::Generate,
            false,
        ),
        (
            col::BEHAVIOR_LOGPROBS,
            per_token_nullable(),
            false,
            Phase::Generate,
            true,
        ),
        (col::POLICY_VERSION, UInt64, false, Phase::Generate, false),
        (col::FINISH_REASON, Utf8, false, Phase::Generate, false),
        (col::GENERATE_S, Float32, false, Phase::Generate, false),
        (col::STARTED_UNIX_S, Float64, false, Phase::Generate, false),
        (
            col::TOKEN_VERSIONS,
            DataType::List(Arc::new(Field::new("item", UInt32, false))),
            true,
            Phase::Generate,
            true,
        ),
        (
            col::KV_RECOMPUTED,
            DataType::List(Arc::new(Field::new("item", Boolean, false))),
            true,
            Phase::Generate,
            true,
        ),
        (
            col::TOKEN_KINDS,
            DataType::List(Arc::new(Field::new("item", UInt8, false))),
            true,
            Phase::Generate,
            true,
        ),
        (
            col::TOKEN_TURNS,
            DataType::List(Arc::new(Field::new("item", UInt32, false))),
            true,
            Phase::Generate,
            true,
        ),
        (col::ENV_REWARDS, per_token(), true, Phase::Generate, true),
        (
            col::SUM_PI_SQUARED,
            per_token(),
            true,
            Phase::Generate,
            true,
        ),
        (col::SOURCE, Utf8, true, Phase::Generate, false),
        (col::LOGGED_STEP, UInt64, true, Phase::Generate, false),
        (
            col::LOGGED_POLICY_VERSION,
            UInt64,
            true,
            Phase::Generate,
            false,
        ),
        (col::REWARD, Float32, false, Phase::Score, false),
        (col::SCORE, Float32, true, Phase::Score, false),
        (col::REWARD_TERMS, per_token(), true, Phase::Score, false),
        (col::JUDGE_RESPONSE, Utf8, true, Phase::Score, false),
        (col::TOKEN_REWARDS, per_token(), true, Phase::Score, true),
        (col::REF_LOGPROBS, per_token(), true, Phase::Score, true),
        (col::TEACHER_LOGPROBS, per_token(), true, Phase::Score, true),
        (
            col::TEACHER_TOPK_LOGPROBS,
            per_token(),
            true,
            Phase::Score,
            false,
        ),
        (
            col::TEACHER_TOPK_IDS,
            DataType::List(Arc::new(Field::new("item", DataType::Int64, false))),
            true,
            Phase::Score,
            false,
        ),
        (col::VALUES, per_token(), true, Phase::Score, true),
        (col::ADVANTAGES, per_token(), false, Phase::Advantage, true),
        (col::RETURNS, per_token(), false, Phase::Advantage, true),
        (col::LEARNER_VERSION, UInt64, false, Phase::Learn, false),
        (col::STALENESS, UInt64, false, Phase::Learn, false),
    ]
}

/// The schema of a batch after `phase`, with the dataset's own columns
/// (`dataset`, e.g. `answer`) after the prompt columns, and the version metadata.
pub fn schema_after(phase: Phase, dataset: &[Field]) -> SchemaRef {
    let mut fields: Vec<Field> = Vec::new();
    for (name, ty, nullable, p, _) in columns() {
        if p > phase {
            continue;
        }
        fields.push(Field::new(name, ty, nullable));
        if name == col::PROMPT_TOKENS {
            fields.extend(dataset.iter().cloned());
        }
    }
    let metadata = HashMap::from([(SCHEMA_VERSION_KEY.to_string(), SCHEMA_VERSION.to_string())]);
    Arc::new(Schema::new_with_metadata(fields, metadata))
}

/// A batch that does not fit the rollout schema.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchemaError {
    /// A column the phase needs is missing.
    #[error("stage `{stage}`: column `{column}` is missing")]
    Missing {
        /// The stage that checked.
        stage: String,
        /// The column.
        column: String,
    },
    /// A column has another type.
    #[error("stage `{stage}`: column `{column}` is {found}, expected {expected}")]
    WrongType {
        /// The stage that checked.
        stage: String,
        /// The column.
        column: String,
        /// What the schema says.
        expected: String,
        /// What the batch has.
        found: String,
    },
    /// A per-token column's row is not as long as the row's response.
    #[error("stage `{stage}`: column `{column}` row {row} has {found} entries, response_tokens has {expected}")]
    Misaligned {
        /// The stage that checked.
        stage: String,
        /// The column.
        column: String,
        /// The row.
        row: usize,
        /// The response length.
        expected: usize,
        /// The column's length there.
        found: usize,
    },
    /// A row holds more tokens than the model reads.
    #[error(
        "stage `{stage}`: row {row} holds {tokens} tokens (prompt and response), more than the \
         {max} the model reads"
    )]
    TooLong {
        /// The stage that checked.
        stage: String,
        /// The row.
        row: usize,
        /// Its prompt and response tokens.
        tokens: usize,
        /// The model's context.
        max: usize,
    },
}

/// Whether a column of type `found` fits the schema's `expected`: the
/// same type, or a list whose items the schema lets be null holding none
/// that may be (a plain generator's behaviour log-probs).
fn fits(expected: &DataType, found: &DataType) -> bool {
    match (expected, found) {
        (DataType::List(e), DataType::List(f)) => {
            e.data_type() == f.data_type() && (e.is_nullable() || !f.is_nullable())
        }
        _ => expected == found,
    }
}

/// Checks that `schema` holds every column written up to `phase` (the
/// optional ones where present) with its type; `stage` names the checker.
pub fn check_schema(schema: &Schema, phase: Phase, stage: &str) -> Result<(), SchemaError> {
    for (name, ty, nullable, p, _) in columns() {
        if p > phase {
            continue;
        }
        let Ok(field) = schema.field_with_name(name) else {
            if nullable {
                continue;
            }
            return Err(SchemaError::Missing {
                stage: stage.into(),
                column: name.into(),
            });
        };
        if !fits(&ty, field.data_type()) {
            return Err(SchemaError::WrongType {
                stage: stage.into(),
                column: name.into(),
                expected: ty.to_string(),
                found: field.data_type().to_string(),
            });
        }
    }
    Ok(())
}

/// Checks that `batch` holds every column written up to `phase` with its
/// type, and that per-token columns align with `response_tokens`.
pub fn check(batch: &RecordBatch, phase: Phase, stage: &str) -> Result<(), SchemaError> {
    check_schema(&batch.schema(), phase, stage)?;
    check_aligned(batch, phase, stage)
}

/// Checks rows read from a file before anything sizes memory by them:
/// every per-token column it holds as long as `response_tokens`, and no
/// row's prompt and response longer than `max_tokens` (the model's context).
pub fn check_read(batch: &RecordBatch, max_tokens: usize, what: &str) -> Result<(), SchemaError> {
    let length = |name| {
        batch
            .column_by_name(name)
            .and_then(|c| c.as_list_opt::<i32>())
    };
    if let (Some(prompt), Some(response)) =
        (length(col::PROMPT_TOKENS), length(col::RESPONSE_TOKENS))
    {
        for row in 0..batch.num_rows() {
            let tokens = prompt.value_length(row) as usize + response.value_length(row) as usize;
            if tokens > max_tokens {
                return Err(SchemaError::TooLong {
                    stage: what.into(),
                    row,
                    tokens,
                    max: max_tokens,
                });
            }
        }
    }
    check_aligned(batch, Phase::Learn, what)
}

/// Checks that `batch`'s per-token columns written up to `phase` align
/// with `response_tokens`.
fn check_aligned(batch: &RecordBatch, phase: Phase, stage: &str) -> Result<(), SchemaError> {
    let response_lengths: Option<Vec<usize>> = batch
        .column_by_name(col::RESPONSE_TOKENS)
        .and_then(|c| c.as_list_opt::<i32>())
        .map(|l| (0..l.len()).map(|i| l.value_length(i) as usize).collect());
    for (name, _, _, p, per_tok) in columns() {
        if p > phase {
            continue;
        }
        let Some(column) = batch.column_by_name(name) else {
            continue;
        };
        if let (true, Some(lengths)) = (per_tok, response_lengths.as_ref()) {
            let list = column.as_list::<i32>();
            for (row, want) in lengths.iter().enumerate() {
                if list.is_valid(row) && list.value_length(row) as usize != *want {
                    return Err(SchemaError::Misaligned {
                        stage: stage.into(),
                        column: name.into(),
                        row,
                        expected: *want,
                        found: list.value_length(row) as usize,
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/runs.md` lists every rollout column, in order, with its type
    /// and whether it is optional.
    #[test]
    fn the_documented_rollout_schema_is_the_schema() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/rollout-log.md");
        let text = std::fs::read_to_string(&path).unwrap();
        let documented: Vec<(String, String)> = text
            .split("## The schema")
            .nth(1)
            .expect("a schema section")
            .split("\n## ")
            .next()
            .expect("the schema section")
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split(" | ").collect();
                let name = cells.first()?.strip_prefix("| `")?.strip_suffix('`')?;
                Some((name.to_string(), cells.get(1)?.to_string()))
            })
            .collect();
        let short = |t: &DataType| match t {
            DataType::UInt64 => "u64".to_string(),
            DataType::UInt32 => "u32".into(),
            DataType::Utf8 => "utf8".into(),
            DataType::Float32 => "f32".into(),
            DataType::Float64 => "f64".into(),
            DataType::List(f) => match f.data_type() {
                DataType::Int64 => "list<i64>".into(),
                DataType::Float32 => "list<f32>".into(),
                DataType::UInt32 => "list<u32>".into(),
                DataType::Boolean => "list<bool>".into(),
                DataType::UInt8 => "list<u8>".into(),
                other => format!("list<{other}>"),
            },
            other => other.to_string(),
        };
        let actual: Vec<(String, String)> = columns()
            .into_iter()
            .map(|(name, ty, nullable, _, _)| {
                let optional = if nullable { ", optional" } else { "" };
                (name.to_string(), format!("{}{optional}", short(&ty)))
            })
            .collect();
        assert_eq!(documented, actual, "{}", path.display());
    }
    use arrow::array::{
        ArrayRef, Float32Builder, Int64Builder, ListBuilder, StringArray, UInt32Array, UInt64Array,
    };

    fn list_i64(rows: &[&[i64]]) -> ArrayRef {
        let mut b = ListBuilder::new(Int64Builder::new()).with_field(Arc::new(Field::new(
            "item",
            DataType::Int64,
            false,
        )));
        for r in rows {
            b.values().append_slice(r);
            b.append(true);
        }
        Arc::new(b.finish())
    }

    fn list_f32(rows: &[&[f32]]) -> ArrayRef {
        let mut b = ListBuilder::new(Float32Builder::new()).with_field(Arc::new(Field::new(
            "item",
            DataType::Float32,
            false,
        )));
        for r in rows {
            b.values().append_slice(r);
            b.append(true);
        }
        Arc::new(b.finish())
    }

    fn generated(logprobs: &[&[f32]]) -> RecordBatch {
        let schema = schema_after(
            Phase::Generate,
            &[Field::new("answer", DataType::Utf8, false)],
        );
        let columns: Vec<ArrayRef> = vec![
            Arc::new(UInt64Array::from(vec![0, 0])),
            Arc::new(UInt64Array::from(vec![5, 5])),
            Arc::new(UInt64Array::from(vec![5, 5])),
            Arc::new(UInt32Array::from(vec![0, 1])),
            Arc::new(StringArray::from(vec!["1+1", "1+1"])),
            Arc::new(StringArray::from(vec![None::<&str>, None])),
            list_i64(&[&[1, 2], &[1, 2]]),
            Arc::new(StringArray::from(vec!["2", "2"])),
            Arc::new(StringArray::from(vec!["2", "3"])),
            list_i64(&[&[7, 2], &[8]]),
            list_f32(logprobs),
            Arc::new(UInt64Array::from(vec![3, 3])),
            Arc::new(StringArray::from(vec!["stop", "length"])),
            Arc::new(arrow::array::Float32Array::from(vec![0.1, 0.1])),
            Arc::new(arrow::array::Float64Array::from(vec![1.7e9, 1.7e9])),
            crate::data::columns::u32_list_array(&[vec![3, 3], vec![3]]),
            crate::data::columns::bool_list_array(&[vec![false, false], vec![false]]),
            crate::data::columns::token_kinds_array(&[None, None]),
            crate::data::columns::u32_list_array(&[vec![0, 0], vec![0]]),
            crate::data::columns::float_list_array(&[vec![0.0, 0.0], vec![0.0]]),
        ];
        // The columns as a plain generator writes them (behaviour log-probs
        // with non-null items, which the schema's nullable items admit).
        let fields: Vec<Field> = schema
            .fields()
            .iter()
            .zip(&columns)
            .map(|(f, c)| Field::new(f.name(), c.data_type().clone(), f.is_nullable()))
            .collect();
        RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap()
    }

    #[test]
    fn schema_grows_by_phase_and_carries_its_version() {
        let prompt = schema_after(Phase::Prompt, &[]);
        let learn = schema_after(Phase::Learn, &[Field::new("answer", DataType::Utf8, false)]);
        assert!(prompt.field_with_name(col::RESPONSE).is_err());
        assert!(learn.field_with_name(col::STALENESS).is_ok());
        assert_eq!(learn.fields().len(), columns().len() + 1);
        assert_eq!(
            learn.index_of("answer").unwrap(),
            learn.index_of(col::PROMPT_TOKENS).unwrap() + 1
        );
        assert_eq!(learn.metadata()[SCHEMA_VERSION_KEY], SCHEMA_VERSION);
    }

    #[test]
    fn check_finds_missing_mistyped_and_misaligned_columns() {
        let ok = generated(&[&[-0.5, -0.1], &[-2.0]]);
        check(&ok, Phase::Generate, "generate").unwrap();
        let err = check(&ok, Phase::Score, "reward").unwrap_err().to_string();
        assert!(err.contains("`reward`") && err.contains("missing"), "{err}");
        let bad = generated(&[&[-0.5], &[-2.0]]);
        let err = check(&bad, Phase::Generate, "generate")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("behavior_logprobs") && err.contains("row 0"),
            "{err}"
        );
        let wrong = ok.project(&[0, 1]).unwrap();
        let renamed = RecordBatch::try_from_iter([(
            col::STEP,
            Arc::new(StringArray::from(vec!["x", "y"])) as ArrayRef,
        )])
        .unwrap();
        assert!(check(&wrong, Phase::Prompt, "source")
            .unwrap_err()
            .to_string()
            .contains("group_id"));
        assert!(check(&renamed, Phase::Prompt, "source")
            .unwrap_err()
            .to_string()
            .contains("expected UInt64"));
    }
}
