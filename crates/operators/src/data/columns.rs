//! Typed access to rollout columns, with errors that name the stage and column.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Float32Builder, Int64Builder, ListBuilder, RecordBatch,
};
use arrow::datatypes::{DataType, Field, Float32Type, Int64Type, UInt32Type, UInt64Type};
use weir_graph::StageError;

use crate::rollout::SchemaError;

fn column<'a>(batch: &'a RecordBatch, name: &str, stage: &str) -> Result<&'a ArrayRef, StageError> {
    batch.column_by_name(name).ok_or_else(|| {
        SchemaError::Missing {
            stage: stage.into(),
            column: name.into(),
        }
        .into()
    })
}

/// Column `name` of `stage` holds `found` where `expected` belongs.
fn wrong_type(stage: &str, name: &str, expected: &str, found: String) -> SchemaError {
    SchemaError::WrongType {
        stage: stage.into(),
        column: name.into(),
        expected: expected.into(),
        found,
    }
}

/// A `List<Int64>` column as rows of ids.
pub fn token_lists(
    batch: &RecordBatch,
    name: &str,
    stage: &str,
) -> Result<Vec<Vec<i64>>, StageError> {
    let col = column(batch, name, stage)?;
    let list = col
        .as_list_opt::<i32>()
        .ok_or_else(|| wrong_type(stage, name, "list<int64>", col.data_type().to_string()))?;
    (0..list.len())
        .map(|i| {
            let v = list.value(i);
            v.as_primitive_opt::<Int64Type>()
                .map(|p| p.values().to_vec())
                .ok_or_else(|| {
                    wrong_type(
                        stage,
                        name,
                        "list<int64>",
                        format!("list<{}>", v.data_type()),
                    )
                    .into()
                })
        })
        .collect()
}

/// A `List<Float32>` column as rows of f64.
pub fn float_lists(
    batch: &RecordBatch,
    name: &str,
    stage: &str,
) -> Result<Vec<Vec<f64>>, StageError> {
    let col = column(batch, name, stage)?;
    let list = col
        .as_list_opt::<i32>()
        .ok_or_else(|| wrong_type(stage, name, "list<float32>", col.data_type().to_string()))?;
    (0..list.len())
        .map(|i| {
            let v = list.value(i);
            v.as_primitive_opt::<Float32Type>()
                .map(|p| p.values().iter().map(|x| f64::from(*x)).collect())
                .ok_or_else(|| {
                    wrong_type(
                        stage,
                        name,
                        "list<float32>",
                        format!("list<{}>", v.data_type()),
                    )
                    .into()
                })
        })
        .collect()
}

/// A `UInt64` column.
pub fn u64s(batch: &RecordBatch, name: &str, stage: &str) -> Result<Vec<u64>, StageError> {
    let col = column(batch, name, stage)?;
    Ok(col
        .as_primitive_opt::<UInt64Type>()
        .ok_or_else(|| wrong_type(stage, name, "uint64", col.data_type().to_string()))?
        .values()
        .to_vec())
}

/// A `UInt32` column.
pub fn u32s(batch: &RecordBatch, name: &str, stage: &str) -> Result<Vec<u32>, StageError> {
    let col = column(batch, name, stage)?;
    Ok(col
        .as_primitive_opt::<UInt32Type>()
        .ok_or_else(|| wrong_type(stage, name, "uint32", col.data_type().to_string()))?
        .values()
        .to_vec())
}

/// Each row's score: the reward before an overlong penalty (`score`) where
/// one applied, else the reward.
pub fn scores(batch: &RecordBatch, stage: &str) -> Result<Vec<f64>, StageError> {
    use crate::rollout::col;
    let name = if batch.column_by_name(col::SCORE).is_some() {
        col::SCORE
    } else {
        col::REWARD
    };
    f32s(batch, name, stage)
}

/// A `Float32` column as f64.
pub fn f32s(batch: &RecordBatch, name: &str, stage: &str) -> Result<Vec<f64>, StageError> {
    let col = column(batch, name, stage)?;
    Ok(col
        .as_primitive_opt::<Float32Type>()
        .ok_or_else(|| wrong_type(stage, name, "float32", col.data_type().to_string()))?
        .values()
        .iter()
        .map(|x| f64::from(*x))
        .collect())
}

/// `batch` with its `reward` column set to `rewards` (float32).
pub fn with_rewards(batch: &RecordBatch, rewards: &[f64]) -> Result<RecordBatch, StageError> {
    let column: arrow::array::Float32Array = rewards.iter().map(|r| *r as f32).collect();
    Ok(weir_graph::batch::with_column(
        batch,
        crate::rollout::col::REWARD,
        std::sync::Arc::new(column) as ArrayRef,
    )?)
}

/// `rows` moved to training step `step`: their `step` column (where they
/// have one) says the step that trains them, not the one that brought them.
pub fn trained_at(rows: &RecordBatch, step: u64) -> Result<RecordBatch, StageError> {
    if rows.column_by_name(crate::rollout::col::STEP).is_none() {
        return Ok(rows.clone());
    }
    Ok(weir_graph::batch::with_u64_column(
        rows,
        crate::rollout::col::STEP,
        step,
    )?)
}

/// The `reward` column, every value finite; a NaN or infinite reward is an
/// error naming its row (never trained on, never silently zeroed).
pub fn rewards(batch: &RecordBatch, stage: &str) -> Result<Vec<f64>, StageError> {
    let rewards = f32s(batch, crate::rollout::col::REWARD, stage)?;
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        let prompt = u64s(batch, crate::rollout::col::PROMPT_ID, stage)
            .ok()
            .map_or(String::new(), |ids| format!(" (prompt_id {})", ids[i]));
        return Err(format!(
            "`{stage}`: row {i}{prompt} has reward {}: a reward must be a finite number",
            rewards[i]
        )
        .into());
    }
    Ok(rewards)
}

/// A `Utf8` column.
pub fn strings(batch: &RecordBatch, name: &str, stage: &str) -> Result<Vec<String>, StageError> {
    let col = column(batch, name, stage)?;
    let s = col
        .as_string_opt::<i32>()
        .ok_or_else(|| wrong_type(stage, name, "utf8", col.data_type().to_string()))?;
    Ok((0..s.len()).map(|i| s.value(i).to_string()).collect())
}

/// Each row's conversation from `prompt_messages` (a list of `{role,
/// content}`), `None` where the column is absent or the row's is null (a
/// prompt the chat template did not render from a file).
pub fn prompt_conversations(
    batch: &RecordBatch,
    stage: &str,
) -> Result<Vec<Option<Vec<serde_json::Value>>>, StageError> {
    let name = crate::rollout::col::PROMPT_MESSAGES;
    let Some(col) = batch.column_by_name(name) else {
        return Ok(vec![None; batch.num_rows()]);
    };
    let s = col
        .as_string_opt::<i32>()
        .ok_or_else(|| wrong_type(stage, name, "utf8", col.data_type().to_string()))?;
    (0..s.len())
        .map(|i| {
            s.is_valid(i)
                .then(|| {
                    serde_json::from_str(s.value(i)).map_err(|e| {
                        StageError::from(format!(
                            "stage `{stage}`: column `{name}` row {i}: not a list of messages: {e}"
                        ))
                    })
                })
                .transpose()
        })
        .collect()
}

/// Each row's conversation: the one a prompt file's chat template
/// rendered ([`prompt_conversations`]), else its `prompt` as the one user
/// message.
pub fn row_conversations(
    batch: &RecordBatch,
    stage: &str,
) -> Result<Vec<Vec<serde_json::Value>>, StageError> {
    let prompts = strings(batch, crate::rollout::col::PROMPT, stage)?;
    Ok(prompt_conversations(batch, stage)?
        .into_iter()
        .zip(prompts)
        .map(|(given, prompt)| {
            given.unwrap_or_else(|| vec![serde_json::json!({"role": "user", "content": prompt})])
        })
        .collect())
}

/// The prompt of a conversation as plain text: its one message besides
/// the system's, or each such message as `role: content`, a blank line
/// between them.
pub fn plain_prompt(messages: &[serde_json::Value]) -> String {
    let turns: Vec<(&str, &str)> = messages
        .iter()
        .filter_map(|m| Some((m.get("role")?.as_str()?, m.get("content")?.as_str()?)))
        .filter(|(role, _)| *role != "system")
        .collect();
    match turns[..] {
        [(_, content)] => content.to_string(),
        _ => turns
            .iter()
            .map(|(role, content)| format!("{role}: {content}"))
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

/// Builds a `List<Int64>` column (non-null items, as the rollout schema declares).
pub fn token_list_array(rows: &[Vec<i64>]) -> ArrayRef {
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

/// Builds a `List<Float32>` column (non-null items).
pub fn float_list_array(rows: &[Vec<f64>]) -> ArrayRef {
    let mut b = ListBuilder::new(Float32Builder::new()).with_field(Arc::new(Field::new(
        "item",
        DataType::Float32,
        false,
    )));
    for r in rows {
        for x in r {
            b.values().append_value(*x as f32);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

/// Builds a `List<UInt32>` column (non-null items): per-token policy versions.
pub fn u32_list_array(rows: &[Vec<u32>]) -> ArrayRef {
    let mut b = ListBuilder::new(arrow::array::UInt32Builder::new())
        .with_field(Arc::new(Field::new("item", DataType::UInt32, false)));
    for r in rows {
        b.values().append_slice(r);
        b.append(true);
    }
    Arc::new(b.finish())
}

/// Each row's generated-token mask from `token_kinds`: 1.0 on a token the
/// model sampled, 0.0 on an observation or boundary token; all 1.0 where
/// the column is absent or the row null. `lengths` are the rows' response
/// lengths (a row whose kinds are another length is an error naming it).
pub fn generated_masks(
    batch: &RecordBatch,
    lengths: &[usize],
    stage: &str,
) -> Result<Vec<Vec<f64>>, StageError> {
    use crate::rollout::{col, TokenKind};
    let all = || lengths.iter().map(|&n| vec![1.0; n]).collect();
    let Some(col) = batch.column_by_name(col::TOKEN_KINDS) else {
        return Ok(all());
    };
    let name = col::TOKEN_KINDS;
    let list = col
        .as_list_opt::<i32>()
        .ok_or_else(|| wrong_type(stage, name, "list<uint8>", col.data_type().to_string()))?;
    lengths
        .iter()
        .enumerate()
        .map(|(row, &n)| {
            if list.is_null(row) {
                return Ok(vec![1.0; n]);
            }
            let kinds = list.value(row);
            let kinds = kinds
                .as_primitive_opt::<arrow::datatypes::UInt8Type>()
                .ok_or_else(|| {
                    wrong_type(
                        stage,
                        name,
                        "list<uint8>",
                        format!("list<{}>", kinds.data_type()),
                    )
                })?;
            if kinds.len() != n {
                return Err(SchemaError::Misaligned {
                    stage: stage.into(),
                    column: name.into(),
                    row,
                    expected: n,
                    found: kinds.len(),
                }
                .into());
            }
            kinds
                .values()
                .iter()
                .map(|&code| match TokenKind::from_code(code) {
                    Some(TokenKind::Generated) => Ok(1.0),
                    Some(_) => Ok(0.0),
                    None => Err(format!(
                        "stage `{stage}`: column `{name}` row {row} holds {code}, not a token kind \
                         (0 generated, 1 observation, 2 boundary)"
                    )
                    .into()),
                })
                .collect()
        })
        .collect()
}

/// Each row's per-token environment rewards (`env_rewards`), or `None`
/// when the batch has none (a null row: no rewards, zeros).
pub fn env_rewards(
    batch: &RecordBatch,
    lengths: &[usize],
    stage: &str,
) -> Result<Option<Vec<Vec<f64>>>, StageError> {
    let name = crate::rollout::col::ENV_REWARDS;
    if batch.column_by_name(name).is_none() {
        return Ok(None);
    }
    let rows = float_lists(batch, name, stage)?;
    for (row, (r, &n)) in rows.iter().zip(lengths).enumerate() {
        if !r.is_empty() && r.len() != n {
            return Err(SchemaError::Misaligned {
                stage: stage.into(),
                column: name.into(),
                row,
                expected: n,
                found: r.len(),
            }
            .into());
        }
        if let Some(bad) = r.iter().find(|x| !x.is_finite()) {
            return Err(
                format!("`{stage}`: row {row}'s environment reward {bad} is not finite").into(),
            );
        }
    }
    Ok(Some(
        rows.into_iter()
            .zip(lengths)
            .map(|(r, &n)| if r.is_empty() { vec![0.0; n] } else { r })
            .collect(),
    ))
}

/// How many tokens of each mask [`generated_masks`] made are generated.
pub fn generated_counts(masks: &[Vec<f64>]) -> Vec<usize> {
    masks
        .iter()
        .map(|m| m.iter().filter(|&&x| x > 0.0).count())
        .collect()
}

/// Builds a `token_kinds` column (non-null items; `None`: a null row, all generated).
pub fn token_kinds_array(rows: &[Option<Vec<crate::rollout::TokenKind>>]) -> ArrayRef {
    let mut b = ListBuilder::new(arrow::array::UInt8Builder::new())
        .with_field(Arc::new(Field::new("item", DataType::UInt8, false)));
    for r in rows {
        match r {
            Some(kinds) => {
                for &kind in kinds {
                    b.values().append_value(kind as u8);
                }
                b.append(true);
            }
            None => b.append(false),
        }
    }
    Arc::new(b.finish())
}

/// Builds a `List<Boolean>` column (non-null items).
pub fn bool_list_array(rows: &[Vec<bool>]) -> ArrayRef {
    let mut b = ListBuilder::new(arrow::array::BooleanBuilder::new())
        .with_field(Arc::new(Field::new("item", DataType::Boolean, false)));
    for r in rows {
        for &x in r {
            b.values().append_value(x);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

#[cfg(test)]
mod tests {
    use arrow::array::Float32Array;
    use arrow::datatypes::Schema;

    use super::*;

    use crate::error::OperatorError;

    #[test]
    fn a_conversation_as_plain_text_leaves_out_the_system_and_the_markup() {
        let m = |role: &str, content: &str| serde_json::json!({"role": role, "content": content});
        let one = [m("system", "Be brief."), m("user", "What is 2+2?")];
        assert_eq!(plain_prompt(&one), "What is 2+2?");
        let turns = [
            m("system", "Be brief."),
            m("user", "Hi"),
            m("assistant", "Hello."),
            m("user", "2+2?"),
        ];
        assert_eq!(
            plain_prompt(&turns),
            "user: Hi\n\nassistant: Hello.\n\nuser: 2+2?"
        );
    }

    #[test]
    fn generated_masks_read_token_kinds_and_default_to_all_generated() {
        use crate::rollout::{col, TokenKind::*};
        let lengths = [3, 2, 0];
        let plain = RecordBatch::try_from_iter([(
            col::RESPONSE_TOKENS,
            token_list_array(&[vec![1, 2, 3], vec![4, 5], vec![]]),
        )])
        .unwrap();
        let all = vec![vec![1.0; 3], vec![1.0; 2], vec![]];
        assert_eq!(generated_masks(&plain, &lengths, "t").unwrap(), all);
        let with = |kinds: ArrayRef| {
            weir_graph::batch::with_column(&plain, col::TOKEN_KINDS, kinds).unwrap()
        };
        let batch = with(token_kinds_array(&[
            Some(vec![Generated, Boundary, Observation]),
            None,
            Some(vec![]),
        ]));
        let masks = generated_masks(&batch, &lengths, "t").unwrap();
        assert_eq!(masks, vec![vec![1.0, 0.0, 0.0], vec![1.0, 1.0], vec![]]);
        assert_eq!(generated_counts(&masks), [1, 2, 0]);
        // A row of another length, and a code that is no kind.
        let short = with(token_kinds_array(&[Some(vec![Generated]), None, None]));
        let err = generated_masks(&short, &lengths, "t")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("token_kinds") && err.contains("row 0"),
            "{err}"
        );
        let mut b = ListBuilder::new(arrow::array::UInt8Builder::new())
            .with_field(Arc::new(Field::new("item", DataType::UInt8, false)));
        for row in [vec![0u8, 7, 0], vec![0, 0], vec![]] {
            b.values().append_slice(&row);
            b.append(true);
        }
        let err = generated_masks(&with(Arc::new(b.finish())), &lengths, "t")
            .unwrap_err()
            .to_string();
        assert!(err.contains("row 0 holds 7, not a token kind"), "{err}");
    }

    #[test]
    fn a_bad_column_is_a_schema_error_naming_stage_and_column() {
        let schema = Schema::new(vec![Field::new("reward", DataType::Float32, false)]);
        let batch = RecordBatch::try_new(
            Arc::new(schema),
            vec![Arc::new(Float32Array::from(vec![1.0f32])) as ArrayRef],
        )
        .unwrap();
        let missing = u64s(&batch, "prompt_id", "advantage").unwrap_err();
        assert_eq!(
            missing.downcast_ref::<SchemaError>(),
            Some(&SchemaError::Missing {
                stage: "advantage".into(),
                column: "prompt_id".into(),
            })
        );
        let wrong = token_lists(&batch, "reward", "learn").unwrap_err();
        assert_eq!(
            wrong.to_string(),
            "stage `learn`: column `reward` is Float32, expected list<int64>"
        );
        assert!(matches!(
            wrong.downcast_ref::<SchemaError>(),
            Some(SchemaError::WrongType { expected, .. }) if expected == "list<int64>"
        ));
    }

    #[test]
    fn an_operator_error_keeps_its_cause() {
        use std::error::Error;
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let err = OperatorError::file("/runs/a/state.json", io);
        assert_eq!(err.to_string(), "/runs/a/state.json: denied");
        let cause = err.source().expect("the I/O error is the source");
        assert_eq!(
            cause.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::PermissionDenied)
        );
    }
}
