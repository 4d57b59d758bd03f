//! `Batch`: an Arrow `RecordBatch` on its way to one worker.
//!
//! Every data edge of a weir graph carries `Batch`es. Inside a process they
//! move as `Arc`-backed Arrow arrays (no copy); between processes they cross
//! as Arrow IPC stream bytes, which is what the serde implementation writes.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::StreamWriter;
use serde::de::Error as _;
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::GraphError;

/// A record batch addressed to one worker (`dest`, a global worker index).
#[derive(Clone, Debug)]
pub struct Batch {
    /// The worker this batch goes to on its next exchange.
    pub dest: u32,
    /// The rows.
    pub data: RecordBatch,
}

impl Batch {
    /// Encodes the rows as Arrow IPC stream bytes.
    pub fn to_ipc(data: &RecordBatch) -> Result<Vec<u8>, GraphError> {
        let mut bytes = Vec::new();
        let mut writer = StreamWriter::try_new(&mut bytes, &data.schema())
            .map_err(|e| GraphError::Codec(format!("arrow ipc: {e}")))?;
        writer
            .write(data)
            .and_then(|_| writer.finish())
            .map_err(|e| GraphError::Codec(format!("arrow ipc: {e}")))?;
        drop(writer);
        Ok(bytes)
    }

    /// Decodes rows written by [`Batch::to_ipc`].
    pub fn from_ipc(bytes: &[u8]) -> Result<RecordBatch, GraphError> {
        let mut reader = StreamReader::try_new(bytes, None)
            .map_err(|e| GraphError::Codec(format!("arrow ipc: {e}")))?;
        match reader.next() {
            Some(batch) => batch.map_err(|e| GraphError::Codec(format!("arrow ipc: {e}"))),
            None => Err(GraphError::Codec("arrow ipc stream holds no batch".into())),
        }
    }
}

impl Serialize for Batch {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let bytes = Batch::to_ipc(&self.data).map_err(S::Error::custom)?;
        (self.dest, serde_bytes::ByteBuf::from(bytes)).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let (dest, bytes): (u32, serde_bytes::ByteBuf) = Deserialize::deserialize(deserializer)?;
        let data = Batch::from_ipc(&bytes).map_err(D::Error::custom)?;
        Ok(Batch { dest, data })
    }
}

/// Returns `batch` with a `UInt64` column `name` set to `value` on every row,
/// replacing a column of that name if there is one.
pub fn with_u64_column(
    batch: &RecordBatch,
    name: &str,
    value: u64,
) -> Result<RecordBatch, GraphError> {
    let column: ArrayRef = Arc::new(UInt64Array::from_value(value, batch.num_rows()));
    with_column(batch, name, column)
}

/// Returns `batch` with `column` under `name`, replacing a column of that name if there is one.
pub fn with_column(
    batch: &RecordBatch,
    name: &str,
    column: ArrayRef,
) -> Result<RecordBatch, GraphError> {
    let schema = batch.schema();
    let mut fields: Vec<Arc<Field>> = schema.fields().iter().cloned().collect();
    let mut columns: Vec<ArrayRef> = batch.columns().to_vec();
    let field = Arc::new(Field::new(
        name,
        column.data_type().clone(),
        column.null_count() > 0,
    ));
    match schema.index_of(name) {
        Ok(i) => {
            fields[i] = field;
            columns[i] = column;
        }
        Err(_) => {
            fields.push(field);
            columns.push(column);
        }
    }
    let schema = Schema::new_with_metadata(fields, schema.metadata().clone());
    RecordBatch::try_new(Arc::new(schema), columns)
        .map_err(|e| GraphError::Codec(format!("adding column `{name}`: {e}")))
}

/// The `UInt64` column `name` of `batch`, or an error naming the stage and the column.
pub fn u64_column<'a>(
    batch: &'a RecordBatch,
    name: &str,
    stage: &str,
) -> Result<&'a UInt64Array, GraphError> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| GraphError::Column {
            stage: stage.to_string(),
            column: name.to_string(),
            problem: "missing".to_string(),
        })?;
    column
        .as_any()
        .downcast_ref::<UInt64Array>()
        .ok_or_else(|| GraphError::Column {
            stage: stage.to_string(),
            column: name.to_string(),
            problem: format!("expected UInt64, found {}", column.data_type()),
        })
}

/// True when `data_type` can serve as a partitioning key.
pub(crate) fn is_key_type(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::UInt64
            | DataType::UInt32
            | DataType::Int64
            | DataType::Int32
            | DataType::Utf8
            | DataType::LargeUtf8
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;

    fn sample() -> RecordBatch {
        RecordBatch::try_from_iter([
            ("id", Arc::new(UInt64Array::from(vec![1, 2, 3])) as ArrayRef),
            (
                "text",
                Arc::new(StringArray::from(vec!["a", "bb", "ccc"])) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    #[test]
    fn ipc_round_trip_keeps_rows_and_schema() {
        let batch = sample();
        let back = Batch::from_ipc(&Batch::to_ipc(&batch).unwrap()).unwrap();
        assert_eq!(back, batch);
    }

    #[test]
    fn serde_round_trip_keeps_destination() {
        // bincode is what timely uses for data that crosses processes.
        let batch = Batch {
            dest: 7,
            data: sample(),
        };
        let bytes = bincode::serialize(&vec![batch.clone()]).unwrap();
        let back: Vec<Batch> = bincode::deserialize(&bytes).unwrap();
        assert_eq!(back[0].dest, 7);
        assert_eq!(back[0].data, batch.data);
    }

    #[test]
    fn with_u64_column_adds_then_replaces() {
        let batch = with_u64_column(&sample(), "policy_version", 4).unwrap();
        assert_eq!(
            u64_column(&batch, "policy_version", "t").unwrap().values(),
            &[4, 4, 4]
        );
        let batch = with_u64_column(&batch, "policy_version", 5).unwrap();
        assert_eq!(batch.num_columns(), 3);
        assert_eq!(
            u64_column(&batch, "policy_version", "t").unwrap().values(),
            &[5, 5, 5]
        );
    }

    #[test]
    fn u64_column_names_the_missing_column() {
        let err = u64_column(&sample(), "step", "learn")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`step`") && err.contains("`learn`"), "{err}");
        let err = u64_column(&sample(), "text", "learn")
            .unwrap_err()
            .to_string();
        assert!(err.contains("expected UInt64"), "{err}");
    }
}
