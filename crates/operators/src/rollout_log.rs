//! Reading rollout logs back: the Parquet files a run wrote under
//! `rollouts/`, as the rows of a replay, of training from logs or of an
//! export.
//!
//! A source is a run folder (its `rollouts/*.parquet`; rows a resume
//! replaced, under `rollouts/superseded/`, are not read), a folder of
//! Parquet files, or one file. Every file is checked before a row is read:
//! it must be Parquet, hold the rollout schema's columns with their types,
//! and carry a schema version this build reads (a file without the version
//! key and with the schema's columns is version 1, the first). A
//! [`RowFilter`] is checked against each row group's statistics first, so
//! row groups that cannot match are never read, then row by row.
//!
//! Schema versions: 1 is the first; a newer file is refused with one line
//! naming both versions. When a version 2 comes, the reading of a version 1
//! file upgrades it here, in [`upgrade`].

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, BooleanArray, RecordBatch};
use arrow::compute::kernels::cmp;
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::arrow_reader::statistics::StatisticsConverter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ProjectionMask;

use crate::error::OperatorError;
use crate::rollout::{self, col, SCHEMA_VERSION, SCHEMA_VERSION_KEY};

/// The log's manifest, beside its Parquet files.
pub const MANIFEST: &str = "manifest.json";

/// The columns a file must hold to be a rollout log at all.
const REQUIRED: [&str; 5] = [
    col::STEP,
    col::GROUP_ID,
    col::PROMPT_TOKENS,
    col::RESPONSE_TOKENS,
    col::BEHAVIOR_LOGPROBS,
];

/// The Parquet files of `source`, in name order: a run folder's
/// `rollouts/`, a folder's own `*.parquet`, or the file itself.
pub fn files_of(source: &Path) -> Result<Vec<PathBuf>, OperatorError> {
    if source.is_file() {
        return Ok(vec![source.to_path_buf()]);
    }
    let rollouts = source.join("rollouts");
    let dir = if rollouts.is_dir() {
        rollouts
    } else {
        source.to_path_buf()
    };
    let entries = std::fs::read_dir(&dir).map_err(|e| OperatorError::file(&dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(OperatorError::file(
            &dir,
            "no Parquet files here (a run folder, a folder of rollout files, or a .parquet file)",
        ));
    }
    Ok(files)
}

/// How a [`Condition`] compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `==` (or `=`)
    Eq,
    /// `!=`
    Ne,
}

/// `column op value`, on a numeric column.
#[derive(Clone, Debug, PartialEq)]
pub struct Condition {
    /// The column.
    pub column: String,
    /// The comparison.
    pub op: Op,
    /// The number compared with.
    pub value: f64,
}

/// Which rows of a log to read: conditions joined by `and`, such as
/// `step >= 10 and reward > 0.5 and policy_version < 40`; empty keeps
/// every row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowFilter {
    /// Every condition must hold.
    pub conditions: Vec<Condition>,
}

impl RowFilter {
    /// Parses `text` (`""`: every row).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut conditions = Vec::new();
        let text = text.trim();
        if text.is_empty() {
            return Ok(RowFilter::default());
        }
        for part in text.split(" and ") {
            let part = part.trim();
            let ops = [
                ("<=", Op::Le),
                (">=", Op::Ge),
                ("==", Op::Eq),
                ("!=", Op::Ne),
                ("<", Op::Lt),
                (">", Op::Gt),
                ("=", Op::Eq),
            ];
            let Some((at, sym, op)) = ops
                .iter()
                .filter_map(|(sym, op)| part.find(sym).map(|at| (at, *sym, *op)))
                .min_by_key(|(at, sym, _)| (*at, std::cmp::Reverse(sym.len())))
            else {
                return Err(format!(
                    "{part:?}: expected `column op number` (op one of < <= > >= == !=), conditions joined by `and`"
                ));
            };
            let column = part[..at].trim();
            let number = part[at + sym.len()..].trim();
            let valid_name = !column.is_empty()
                && column
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_');
            let value: f64 = number.parse().map_err(|_| {
                format!("{part:?}: {number:?} is not a number (conditions compare a column with a number)")
            })?;
            if !valid_name {
                return Err(format!("{part:?}: {column:?} is not a column name"));
            }
            conditions.push(Condition {
                column: column.to_string(),
                op,
                value,
            });
        }
        Ok(RowFilter { conditions })
    }

    /// The columns the conditions read.
    pub fn columns(&self) -> Vec<&str> {
        self.conditions.iter().map(|c| c.column.as_str()).collect()
    }

    /// Whether the filter keeps every row.
    pub fn is_empty(&self) -> bool {
        self.conditions.is_empty()
    }

    /// Which of `batch`'s rows it keeps (`what` names the batch in errors).
    pub fn mask(&self, batch: &RecordBatch, what: &str) -> Result<BooleanArray, String> {
        let mut keep = BooleanArray::from(vec![true; batch.num_rows()]);
        for c in &self.conditions {
            let column = numeric(batch, &c.column, what)?;
            let value = arrow::array::Float64Array::new_scalar(c.value);
            let hit = match c.op {
                Op::Lt => cmp::lt(&column, &value),
                Op::Le => cmp::lt_eq(&column, &value),
                Op::Gt => cmp::gt(&column, &value),
                Op::Ge => cmp::gt_eq(&column, &value),
                Op::Eq => cmp::eq(&column, &value),
                Op::Ne => cmp::neq(&column, &value),
            }
            .map_err(|e| format!("{what}: {e}"))?;
            // A null never matches.
            let hit = match hit.nulls() {
                Some(_) => arrow::compute::prep_null_mask_filter(&hit),
                None => hit,
            };
            keep = arrow::compute::and(&keep, &hit).map_err(|e| format!("{what}: {e}"))?;
        }
        Ok(keep)
    }

    /// Whether a row group whose columns span `bounds(column)` = (min,
    /// max) may hold a row the filter keeps (`None`: not known).
    fn may_match(&self, bounds: impl Fn(&str) -> Option<(f64, f64)>) -> bool {
        self.conditions.iter().all(|c| {
            let Some((lo, hi)) = bounds(&c.column) else {
                return true;
            };
            match c.op {
                Op::Lt => lo < c.value,
                Op::Le => lo <= c.value,
                Op::Gt => hi > c.value,
                Op::Ge => hi >= c.value,
                Op::Eq => lo <= c.value && c.value <= hi,
                Op::Ne => !(lo == c.value && hi == c.value),
            }
        })
    }
}

/// `batch`'s column `name` as float64, if it is numeric.
fn numeric(batch: &RecordBatch, name: &str, what: &str) -> Result<ArrayRef, String> {
    let column = batch
        .column_by_name(name)
        .ok_or_else(|| format!("{what}: no column `{name}` to filter on"))?;
    if !column.data_type().is_numeric() {
        return Err(format!(
            "{what}: column `{name}` is {}, not a number: a filter compares numbers",
            column.data_type()
        ));
    }
    arrow::compute::cast(column, &DataType::Float64).map_err(|e| format!("{what}: {e}"))
}

/// One checked log file.
#[derive(Debug)]
pub struct LogFile {
    /// Where it is.
    pub path: PathBuf,
    /// Its Arrow schema.
    pub schema: SchemaRef,
    /// Its rollout schema version.
    pub version: String,
    /// Its rows.
    pub rows: usize,
}

/// Opens and checks the rollout log file at `path`: Parquet, the rollout
/// schema's columns with their types, a version this build reads.
pub fn open(path: &Path) -> Result<LogFile, OperatorError> {
    let builder = builder(path)?;
    let metadata = builder.metadata().file_metadata();
    let version = metadata
        .key_value_metadata()
        .and_then(|kv| kv.iter().find(|k| k.key == SCHEMA_VERSION_KEY))
        .and_then(|k| k.value.clone());
    let schema = builder.schema().clone();
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|c| schema.column_with_name(c).is_none())
        .collect();
    if !missing.is_empty() {
        let has = |c| if version.is_some() { "" } else { c };
        return Err(OperatorError::file(
            path,
            format!(
                "not a weir rollout log{}: no column {}",
                has(" (no `weir.rollout_schema_version` in its metadata)"),
                missing
                    .iter()
                    .map(|c| format!("`{c}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let version = version.unwrap_or_else(|| "1".to_string());
    let newer = match (version.parse::<u64>(), SCHEMA_VERSION.parse::<u64>()) {
        (Ok(v), Ok(ours)) => v > ours,
        _ => true,
    };
    if newer {
        return Err(OperatorError::file(
            path,
            format!(
                "rollout schema version {version}, but this weir reads versions up to {SCHEMA_VERSION}: read it with a newer weir"
            ),
        ));
    }
    rollout::check_schema(&schema, rollout::Phase::Learn, &path.display().to_string())
        .map_err(|e| OperatorError::file(path, e.to_string()))?;
    Ok(LogFile {
        path: path.to_path_buf(),
        schema: upgrade(&version, schema),
        version,
        rows: metadata.num_rows().max(0) as usize,
    })
}

/// A file of schema `version`'s schema as this build's (version 1, the
/// first, is today's).
fn upgrade(version: &str, schema: SchemaRef) -> SchemaRef {
    debug_assert!(version == SCHEMA_VERSION, "no older version exists yet");
    schema
}

fn builder(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<File>, OperatorError> {
    let file = File::open(path).map_err(|e| OperatorError::file(path, e))?;
    ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| {
        OperatorError::file(
            path,
            format!("not a readable Parquet file (truncated, corrupt, or of another format): {e}"),
        )
    })
}

/// Reads the rows of `file` that `filter` keeps, only `columns` of them
/// (`None`: all; the filter's own columns are read either way and dropped
/// again). Row groups whose statistics rule the filter out are skipped.
pub fn read(
    file: &LogFile,
    filter: &RowFilter,
    columns: Option<&[&str]>,
) -> Result<Vec<RecordBatch>, OperatorError> {
    let path = &file.path;
    for c in filter.columns() {
        if file.schema.column_with_name(c).is_none() {
            return Err(OperatorError::file(
                path,
                format!("no column `{c}` to filter on"),
            ));
        }
    }
    let builder = builder(path)?;
    let groups = {
        let meta = builder.metadata();
        let parquet = builder.parquet_schema();
        let bounds = |column: &str| -> Result<Vec<Option<(f64, f64)>>, String> {
            let groups = meta.row_groups();
            let unknown = vec![None; groups.len()];
            let Ok(conv) = StatisticsConverter::try_new(column, &file.schema, parquet) else {
                return Ok(unknown);
            };
            let (Ok(mins), Ok(maxes)) = (
                conv.row_group_mins(groups.iter()),
                conv.row_group_maxes(groups.iter()),
            ) else {
                return Ok(unknown);
            };
            let as_f64 = |a: &ArrayRef| arrow::compute::cast(a, &DataType::Float64).ok();
            let (Some(mins), Some(maxes)) = (as_f64(&mins), as_f64(&maxes)) else {
                return Ok(unknown);
            };
            let (mins, maxes) = (
                mins.as_any()
                    .downcast_ref::<arrow::array::Float64Array>()
                    .cloned(),
                maxes
                    .as_any()
                    .downcast_ref::<arrow::array::Float64Array>()
                    .cloned(),
            );
            let (Some(mins), Some(maxes)) = (mins, maxes) else {
                return Ok(unknown);
            };
            Ok((0..groups.len())
                .map(|g| {
                    (mins.is_valid(g) && maxes.is_valid(g)).then(|| (mins.value(g), maxes.value(g)))
                })
                .collect())
        };
        let mut per_column = std::collections::HashMap::new();
        for c in filter.columns() {
            per_column.insert(
                c.to_string(),
                bounds(c).map_err(|e| OperatorError::file(path, e))?,
            );
        }
        (0..meta.num_row_groups())
            .filter(|&g| filter.may_match(|c| per_column.get(c).and_then(|b| b[g])))
            .collect::<Vec<_>>()
    };
    if groups.is_empty() {
        return Ok(Vec::new());
    }
    let wanted: Option<Vec<usize>> = columns.map(|names| {
        let mut idx: Vec<usize> = names
            .iter()
            .chain(filter.columns().iter())
            .filter_map(|n| file.schema.index_of(n).ok())
            .collect();
        idx.sort_unstable();
        idx.dedup();
        idx
    });
    let mut builder = builder.with_row_groups(groups.clone());
    if let Some(idx) = &wanted {
        let mask = ProjectionMask::roots(builder.parquet_schema(), idx.iter().copied());
        builder = builder.with_projection(mask);
    }
    let reader = builder
        .with_batch_size(weir_graph::parquet_log::DECODE_ROWS)
        .build()
        .map_err(|e| OperatorError::file(path, e.to_string()))?;
    let mut out = Vec::new();
    for batch in weir_graph::parquet_log::decode_bounded(path, reader) {
        let batch = batch.map_err(|e| {
            let why = match e {
                weir_graph::GraphError::Io { message, .. } => message,
                other => other.to_string(),
            };
            OperatorError::file(path, format!("reading row groups {groups:?}: {why}"))
        })?;
        let what = path.display().to_string();
        let batch = if filter.is_empty() {
            batch
        } else {
            let keep = filter
                .mask(&batch, &what)
                .map_err(|e| OperatorError::file(path, e))?;
            arrow::compute::filter_record_batch(&batch, &keep)
                .map_err(|e| OperatorError::file(path, e.to_string()))?
        };
        let batch = match columns {
            Some(names) => {
                let idx: Vec<usize> = names
                    .iter()
                    .filter_map(|n| batch.schema().index_of(n).ok())
                    .collect();
                batch
                    .project(&idx)
                    .map_err(|e| OperatorError::file(path, e.to_string()))?
            }
            None => batch,
        };
        if batch.num_rows() > 0 {
            out.push(batch);
        }
    }
    Ok(out)
}

/// Every file of the logs under `sources`, each checked ([`open`]).
pub fn open_all(sources: &[PathBuf]) -> Result<Vec<LogFile>, OperatorError> {
    let mut files = Vec::new();
    for source in sources {
        for path in files_of(source)? {
            files.push(open(&path)?);
        }
    }
    Ok(files)
}

/// Every row of the logs under `sources` that `filter` keeps (each
/// source checked first), with an error naming the filter when none does.
pub fn read_all(
    sources: &[PathBuf],
    filter: &RowFilter,
    columns: Option<&[&str]>,
) -> Result<Vec<RecordBatch>, OperatorError> {
    let files = open_all(sources)?;
    let mut out = Vec::new();
    for file in &files {
        out.extend(read(file, filter, columns)?);
    }
    if out.is_empty() {
        return Err(no_rows(sources, filter));
    }
    Ok(out)
}

/// The error of logs `sources` of which `filter` keeps no row.
pub fn no_rows(sources: &[PathBuf], filter: &RowFilter) -> OperatorError {
    let named: Vec<String> = sources.iter().map(|s| s.display().to_string()).collect();
    OperatorError::file(
        named.join(", "),
        if filter.is_empty() {
            "the log holds no rows".to_string()
        } else {
            format!("no row matches the filter {:?}", filter_text(filter))
        },
    )
}

/// The filter as text.
pub fn filter_text(filter: &RowFilter) -> String {
    filter
        .conditions
        .iter()
        .map(|c| {
            let op = match c.op {
                Op::Lt => "<",
                Op::Le => "<=",
                Op::Gt => ">",
                Op::Ge => ">=",
                Op::Eq => "==",
                Op::Ne => "!=",
            };
            format!("{} {op} {}", c.column, c.value)
        })
        .collect::<Vec<_>>()
        .join(" and ")
}

/// The rows of `batches` as one batch, sorted by `(step, group_id,
/// sample_idx)`: the order a step's whole-step stages see them in.
pub fn in_step_order(batches: &[RecordBatch]) -> Result<Option<RecordBatch>, OperatorError> {
    let Some(first) = batches.first() else {
        return Ok(None);
    };
    let rows = arrow::compute::concat_batches(&first.schema(), batches)
        .map_err(|e| OperatorError::file("rollout log", e.to_string()))?;
    let keys: Vec<arrow::compute::SortColumn> = [col::STEP, col::GROUP_ID, col::SAMPLE_IDX]
        .iter()
        .filter_map(|k| rows.column_by_name(k))
        .map(|c| arrow::compute::SortColumn {
            values: Arc::clone(c),
            options: None,
        })
        .collect();
    let order = arrow::compute::lexsort_to_indices(&keys, None)
        .map_err(|e| OperatorError::file("rollout log", e.to_string()))?;
    Ok(Some(
        arrow::compute::take_record_batch(&rows, &order)
            .map_err(|e| OperatorError::file("rollout log", e.to_string()))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_parse_and_refuse_what_they_cannot_read() {
        let f = RowFilter::parse("step >= 3 and reward > 0.5 and policy_version!=2").unwrap();
        assert_eq!(f.conditions.len(), 3);
        assert_eq!(f.conditions[0].op, Op::Ge);
        assert_eq!(f.conditions[2].column, "policy_version");
        assert_eq!(f.conditions[2].op, Op::Ne);
        assert_eq!(
            filter_text(&f),
            "step >= 3 and reward > 0.5 and policy_version != 2"
        );
        assert!(RowFilter::parse("").unwrap().is_empty());
        for bad in ["step", "step >= x", ">= 3", "step-1 > 2"] {
            assert!(RowFilter::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn row_group_bounds_rule_out_what_cannot_match() {
        let f = RowFilter::parse("step >= 10 and reward < 0").unwrap();
        let bounds = |step: (f64, f64), reward: (f64, f64)| {
            move |c: &str| match c {
                "step" => Some(step),
                "reward" => Some(reward),
                _ => None,
            }
        };
        assert!(!f.may_match(bounds((0.0, 9.0), (-1.0, 1.0))));
        assert!(!f.may_match(bounds((0.0, 20.0), (0.0, 1.0))));
        assert!(f.may_match(bounds((5.0, 10.0), (-1.0, 0.0))));
        assert!(f.may_match(|_| None));
    }
}
