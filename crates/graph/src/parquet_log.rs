//! `ParquetLog`: a sink that writes every row it gets to rolling Parquet files.
//!
//! Files are named `part-<worker>-<first step>.parquet` (so a resumed run,
//! which starts at a later step, never reuses a name) and become visible only when
//! complete (written to a `.tmp` name, then renamed), so a crash never leaves
//! a truncated file for pandas, polars or DuckDB to trip over.
//!
//! # Examples
//! ```
//! use std::sync::Arc;
//! use arrow::array::{ArrayRef, RecordBatch, UInt64Array};
//! use weir_graph::{ParquetLog, Sink};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let mut log = ParquetLog::new(dir.path(), 0, 1000).unwrap();
//! let rows = RecordBatch::try_from_iter([("row_id", Arc::new(UInt64Array::from(vec![1, 2])) as ArrayRef)]).unwrap();
//! log.write(0, &rows).unwrap();
//! log.end_step(0).unwrap();
//! log.finish().unwrap();
//! let back = weir_graph::parquet_log::read_parquet_dir(dir.path()).unwrap();
//! assert_eq!(back.iter().map(|b| b.num_rows()).sum::<usize>(), 2);
//! ```

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::stage::Sink;
use crate::{GraphError, StageError, Step};

/// Writes batches to rolling Parquet files in one folder.
pub struct ParquetLog {
    dir: PathBuf,
    worker: usize,
    rows_per_file: usize,
    first_step: Option<Step>,
    buffered: Vec<RecordBatch>,
    buffered_rows: usize,
    schema: Option<SchemaRef>,
}

impl ParquetLog {
    /// A log writing into `dir` (created if missing) for worker `worker`;
    /// a file is closed once it holds at least `rows_per_file` rows, at a step boundary.
    pub fn new(dir: &Path, worker: usize, rows_per_file: usize) -> Result<Self, GraphError> {
        std::fs::create_dir_all(dir).map_err(|e| GraphError::io(dir, e))?;
        Ok(ParquetLog {
            dir: dir.to_path_buf(),
            worker,
            rows_per_file: rows_per_file.max(1),
            first_step: None,
            buffered: Vec::new(),
            buffered_rows: 0,
            schema: None,
        })
    }

    fn flush_file(&mut self) -> Result<(), GraphError> {
        if self.buffered.is_empty() {
            return Ok(());
        }
        let first = self.first_step.unwrap_or(0);
        let mut path = self
            .dir
            .join(format!("part-{:04}-{first:010}.parquet", self.worker));
        // Two files may start at one step (a schema change mid-step): never overwrite.
        let mut n = 1;
        while path.exists() {
            path = self
                .dir
                .join(format!("part-{:04}-{first:010}-{n}.parquet", self.worker));
            n += 1;
        }
        write_parquet_atomically(&path, &self.buffered)?;
        self.first_step = None;
        self.buffered.clear();
        self.buffered_rows = 0;
        self.schema = None;
        Ok(())
    }
}

impl Sink for ParquetLog {
    fn write(&mut self, step: Step, batch: &RecordBatch) -> Result<(), StageError> {
        if self.schema.as_ref().is_some_and(|s| *s != batch.schema()) {
            self.flush_file()?;
        }
        self.first_step.get_or_insert(step);
        self.schema = Some(batch.schema());
        self.buffered_rows += batch.num_rows();
        self.buffered.push(batch.clone());
        Ok(())
    }

    fn end_step(&mut self, _step: Step) -> Result<(), StageError> {
        if self.buffered_rows >= self.rows_per_file {
            self.flush_file()?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), StageError> {
        Ok(self.flush_file()?)
    }
}

/// Writes `batches` (one schema) to `path` via a temporary file and a rename.
pub fn write_parquet_atomically(path: &Path, batches: &[RecordBatch]) -> Result<(), GraphError> {
    let Some(first) = batches.first() else {
        return Ok(());
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| GraphError::io(parent, e))?;
    }
    let tmp = path.with_extension("parquet.tmp");
    let file = File::create(&tmp).map_err(|e| GraphError::io(&tmp, e))?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .build();
    let mut writer = ArrowWriter::try_new(file, first.schema(), Some(props))
        .map_err(|e| GraphError::io(&tmp, e))?;
    for batch in batches {
        writer.write(batch).map_err(|e| GraphError::io(&tmp, e))?;
    }
    writer.close().map_err(|e| GraphError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| GraphError::io(path, e))?;
    Ok(())
}

/// Reads every `*.parquet` file of a folder, in name order.
pub fn read_parquet_dir(dir: &Path) -> Result<Vec<RecordBatch>, GraphError> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| GraphError::io(dir, e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        out.extend(read_parquet_file(&path)?);
    }
    Ok(out)
}

/// Reads one Parquet file into batches.
pub fn read_parquet_file(path: &Path) -> Result<Vec<RecordBatch>, GraphError> {
    let file = File::open(path).map_err(|e| GraphError::io(path, e))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .and_then(|b| b.build())
        .map_err(|e| GraphError::io(path, e))?;
    reader
        .map(|b| b.map_err(|e| GraphError::io(path, e)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, UInt64Array};
    use std::sync::Arc;

    fn rows(ids: std::ops::Range<u64>) -> RecordBatch {
        RecordBatch::try_from_iter([(
            "row_id",
            Arc::new(UInt64Array::from_iter_values(ids)) as ArrayRef,
        )])
        .unwrap()
    }

    #[test]
    fn rolls_files_at_step_boundaries_and_leaves_no_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ParquetLog::new(dir.path(), 3, 4).unwrap();
        for step in 0..5u64 {
            log.write(step, &rows(step * 3..step * 3 + 3)).unwrap();
            log.end_step(step).unwrap();
        }
        log.finish().unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names
                .iter()
                .all(|n| n.starts_with("part-0003-") && n.ends_with(".parquet")),
            "{names:?}"
        );
        assert_eq!(names.len(), 3);
        let back = read_parquet_dir(dir.path()).unwrap();
        let ids: Vec<u64> = back
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<UInt64Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
            .collect();
        assert_eq!(ids, (0..15).collect::<Vec<_>>());
    }

    #[test]
    fn unwritable_folder_is_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let err = ParquetLog::new(&file.join("sub"), 0, 1)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("a-file"), "{err}");
    }
}
