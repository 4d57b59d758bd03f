//! Typed access to rollout columns, with errors that name the stage and column.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Float32Builder, Int64Builder, ListBuilder, RecordBatch,
};
use arrow::datatypes::{DataType, Field, Float32Type, Int64Type, UInt32Type, UInt64Type};
use weir_graph::StageError;

fn column<'a>(batch: &'a RecordBatch, name: &str, stage: &str) -> Result<&'a ArrayRef, StageError> {
    batch
        .column_by_name(name)
        .ok_or_else(|| format!("stage `{stage}`: column `{name}` is missing").into())
}

/// A `List<Int64>` column as rows of ids.
pub fn token_lists(
    batch: &RecordBatch,
    name: &str,
    stage: &str,
) -> Result<Vec<Vec<i64>>, StageError> {
    let col = column(batch, name, stage)?;
    let list = col.as_list_opt::<i32>().ok_or_else(|| {
        format!(
            "stage `{stage}`: column `{name}` is {}, expected list<int64>",
            col.data_type()
        )
    })?;
    (0..list.len())
        .map(|i| {
            let v = list.value(i);
            v.as_primitive_opt::<Int64Type>()
                .map(|p| p.values().to_vec())
                .ok_or_else(|| {
                    format!(
                        "stage `{stage}`: column `{name}` holds {}, expected int64",
                        v.data_type()
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
    let list = col.as_list_opt::<i32>().ok_or_else(|| {
        format!(
            "stage `{stage}`: column `{name}` is {}, expected list<float32>",
            col.data_type()
        )
    })?;
    (0..list.len())
        .map(|i| {
            let v = list.value(i);
            v.as_primitive_opt::<Float32Type>()
                .map(|p| p.values().iter().map(|x| f64::from(*x)).collect())
                .ok_or_else(|| {
                    format!(
                        "stage `{stage}`: column `{name}` holds {}, expected float32",
                        v.data_type()
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
        .ok_or_else(|| {
            format!(
                "stage `{stage}`: column `{name}` is {}, expected uint64",
                col.data_type()
            )
        })?
        .values()
        .to_vec())
}

/// A `UInt32` column.
pub fn u32s(batch: &RecordBatch, name: &str, stage: &str) -> Result<Vec<u32>, StageError> {
    let col = column(batch, name, stage)?;
    Ok(col
        .as_primitive_opt::<UInt32Type>()
        .ok_or_else(|| {
            format!(
                "stage `{stage}`: column `{name}` is {}, expected uint32",
                col.data_type()
            )
        })?
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
        .ok_or_else(|| {
            format!(
                "stage `{stage}`: column `{name}` is {}, expected float32",
                col.data_type()
            )
        })?
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
    let s = col.as_string_opt::<i32>().ok_or_else(|| {
        format!(
            "stage `{stage}`: column `{name}` is {}, expected utf8",
            col.data_type()
        )
    })?;
    Ok((0..s.len()).map(|i| s.value(i).to_string()).collect())
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
