//! `ParquetLog`: a sink that writes every row it gets to rolling Parquet files.
//!
//! Files are named `part-<worker>-<first step>.parquet` (so a resumed run,
//! which starts at a later step, never reuses a name) and become visible only when
//! complete (written to an exclusive temporary, then renamed), so a crash never leaves
//! a truncated file for pandas, polars or DuckDB to trip over. A file closes
//! once it holds `rows_per_file` rows; at every commit point (a checkpoint)
//! the open file is written out as it stands and stays open, to be rewritten
//! with more rows at the next commit, so a checkpoint never covers rows that
//! are only in memory and the log still has few, large files.
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

/// Buffered batches that are copied into one (see [`ParquetLog::compact`]).
const COMPACT_BATCHES: usize = 64;

/// Writes batches to rolling Parquet files in one folder.
pub struct ParquetLog {
    dir: PathBuf,
    worker: usize,
    rows_per_file: usize,
    /// The open file's name (fixed at its first row).
    path: Option<PathBuf>,
    buffered: Vec<RecordBatch>,
    buffered_rows: usize,
    /// Rows of the open file already on disk.
    written_rows: usize,
    schema: Option<SchemaRef>,
    /// Key–value pairs every file carries in its Parquet metadata.
    metadata: Vec<(String, String)>,
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
            path: None,
            buffered: Vec::new(),
            buffered_rows: 0,
            written_rows: 0,
            schema: None,
            metadata: Vec::new(),
        })
    }

    /// Writes `key` = `value` into every file's Parquet metadata (a
    /// schema's version, say), where readers find it without reading rows.
    pub fn with_metadata(mut self, key: &str, value: &str) -> Self {
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }

    /// A fresh name for a file whose first row is of step `first`.
    fn new_path(&self, first: Step) -> PathBuf {
        let stem = format!("part-{:04}-{first:010}", self.worker);
        let mut path = self.dir.join(format!("{stem}.parquet"));
        // Two files may start at one step (a schema change mid-step): never overwrite.
        let mut n = 1;
        while path.exists() {
            path = self.dir.join(format!("{stem}-{n}.parquet"));
            n += 1;
        }
        path
    }

    /// Copies the buffered batches into one, tightly sized: a step's batch
    /// often holds buffers far larger than its rows (builders' capacities),
    /// and thousands of small long-lived buffers interleaved with a model's
    /// large short-lived ones fragment the heap.
    fn compact(&mut self) -> Result<(), GraphError> {
        if let (Some(schema), true) = (&self.schema, self.buffered.len() > 1) {
            let one = arrow::compute::concat_batches(schema, &self.buffered)
                .map_err(|e| GraphError::Codec(format!("rollout log: {e}")))?;
            self.buffered = vec![one];
        }
        Ok(())
    }

    /// Writes the open file as it stands, if it has rows not yet on disk.
    fn write_open_file(&mut self) -> Result<(), GraphError> {
        if let Some(path) = &self.path {
            if self.buffered_rows > self.written_rows {
                write_parquet_with(path, &self.buffered, &self.metadata)?;
                self.written_rows = self.buffered_rows;
            }
        }
        Ok(())
    }

    fn close_file(&mut self) -> Result<(), GraphError> {
        self.write_open_file()?;
        self.path = None;
        self.buffered.clear();
        self.buffered_rows = 0;
        self.written_rows = 0;
        self.schema = None;
        Ok(())
    }
}

impl Sink for ParquetLog {
    fn write(&mut self, step: Step, batch: &RecordBatch) -> Result<(), StageError> {
        if self.schema.as_ref().is_some_and(|s| *s != batch.schema()) {
            self.close_file()?;
        }
        if self.path.is_none() {
            self.path = Some(self.new_path(step));
        }
        self.schema = Some(batch.schema());
        self.buffered_rows += batch.num_rows();
        self.buffered.push(batch.clone());
        if self.buffered.len() >= COMPACT_BATCHES {
            self.compact()?;
        }
        Ok(())
    }

    fn end_step(&mut self, _step: Step) -> Result<(), StageError> {
        if self.buffered_rows >= self.rows_per_file {
            self.close_file()?;
        }
        Ok(())
    }

    fn commit(&mut self, _step: Step) -> Result<(), StageError> {
        Ok(self.write_open_file()?)
    }

    fn finish(&mut self) -> Result<(), StageError> {
        Ok(self.close_file()?)
    }
}

/// Writes `batches` (one schema) to `path` via a temporary file, synced,
/// and a rename, then syncs the folder.
pub fn write_parquet_atomically(path: &Path, batches: &[RecordBatch]) -> Result<(), GraphError> {
    write_parquet_with(path, batches, &[])
}

/// [`write_parquet_atomically`] with `metadata` in the file's key–value metadata.
pub fn write_parquet_with(
    path: &Path,
    batches: &[RecordBatch],
    metadata: &[(String, String)],
) -> Result<(), GraphError> {
    let Some(first) = batches.first() else {
        return Ok(());
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| GraphError::io(parent, e))?;
    }
    let kv = metadata
        .iter()
        .map(|(k, v)| parquet::file::metadata::KeyValue::new(k.clone(), v.clone()))
        .collect::<Vec<_>>();
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_key_value_metadata((!kv.is_empty()).then_some(kv))
        .build();
    // On disk before it takes its name, and the name on disk before a
    // commit point counts it: a power cut loses no committed row.
    weir_durable::write_with(path, |file| {
        let mut writer = ArrowWriter::try_new(file, first.schema(), Some(props))
            .map_err(std::io::Error::other)?;
        for batch in batches {
            writer.write(batch).map_err(std::io::Error::other)?;
        }
        writer.close().map(|_| ()).map_err(std::io::Error::other)
    })
    .map_err(|e| GraphError::io(path, e))
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
    parquet_batches(path)?.1.collect()
}

/// The batches of the Parquet file at `path`, read one at a time
/// ([`decode_bounded`]), and the bytes its row groups say they hold
/// uncompressed (a lower bound of what reading them all costs: encodings
/// can make a file's values far larger than its metadata says).
pub fn parquet_batches(
    path: &Path,
) -> Result<
    (
        u64,
        impl Iterator<Item = Result<RecordBatch, GraphError>> + '_,
    ),
    GraphError,
> {
    let file = File::open(path).map_err(|e| GraphError::io(path, e))?;
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| GraphError::io(path, e))?;
    let bytes = builder
        .metadata()
        .row_groups()
        .iter()
        .map(|g| g.total_byte_size().max(0) as u64)
        .sum();
    let reader = builder
        .with_batch_size(DECODE_ROWS)
        .build()
        .map_err(|e| GraphError::io(path, e))?;
    Ok((bytes, decode_bounded(path, reader)))
}

/// Rows decoded at a time from a Parquet file a user gives.
pub const DECODE_ROWS: usize = 16;

/// The most memory decoding one batch of [`DECODE_ROWS`] rows may hold: 32
/// MiB a row, twice the largest prompt record, and far above a rollout row
/// at any model's context. A file's metadata cannot bound this: dictionary
/// and run-length encodings turn a few kilobytes into gigabytes of values.
pub const DECODE_BYTES: usize = DECODE_ROWS * (32 << 20);

/// The batches `reader` decodes (build it with a batch size of
/// [`DECODE_ROWS`]), each decoded under a memory budget of [`DECODE_BYTES`]
/// ([`weir_budget::within`]): a batch that would take more ends the
/// iteration with one error naming `path`, before the memory is taken.
pub fn decode_bounded<R>(
    path: &Path,
    reader: R,
) -> impl Iterator<Item = Result<RecordBatch, GraphError>> + '_
where
    R: Iterator<Item = Result<RecordBatch, arrow::error::ArrowError>> + Send + 'static,
{
    let mut reader = Some(reader);
    std::iter::from_fn(move || {
        let mut taken = reader.take()?;
        match weir_budget::within(DECODE_BYTES, move || {
            let next = taken.next();
            (taken, next)
        }) {
            Ok((back, next)) => {
                reader = Some(back);
                Some(next?.map_err(|e| GraphError::io(path, e)))
            }
            Err(over) => Some(Err(GraphError::io(
                path,
                format!(
                    "{DECODE_ROWS} rows decode to more memory than they may take ({over}): \
                     values far larger than the file (a dictionary- or run-length-encoded \
                     bomb, or a list far past any model's context?)"
                ),
            ))),
        }
    })
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

    /// Every `row_id` the folder's files hold, in file order.
    fn ids(dir: &Path) -> Vec<u64> {
        read_parquet_dir(dir)
            .unwrap()
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_any()
                    .downcast_ref::<UInt64Array>()
                    .unwrap()
                    .values()
                    .to_vec()
            })
            .collect()
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
        assert_eq!(ids(dir.path()), (0..15).collect::<Vec<_>>());
    }

    #[test]
    fn a_commit_writes_the_open_file_which_then_grows() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ParquetLog::new(dir.path(), 0, 100).unwrap();
        log.write(0, &rows(0..3)).unwrap();
        log.end_step(0).unwrap();
        assert!(
            ids(dir.path()).is_empty(),
            "below rows_per_file, nothing yet"
        );
        log.commit(0).unwrap();
        assert_eq!(ids(dir.path()), vec![0, 1, 2]);
        log.write(1, &rows(3..5)).unwrap();
        log.end_step(1).unwrap();
        log.commit(1).unwrap();
        // One file, rewritten with the new rows.
        assert_eq!(ids(dir.path()), vec![0, 1, 2, 3, 4]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        log.commit(2).unwrap();
        log.finish().unwrap();
        assert_eq!(ids(dir.path()), vec![0, 1, 2, 3, 4]);
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

    /// One 40 MiB value that 64 rows share through the dictionary: a file
    /// of a few kilobytes whose first batch decodes to 640 MiB, past
    /// the decoding bound. Reading it is one error naming the file, and
    /// the memory was never taken.
    #[test]
    fn a_batch_that_decodes_past_its_bound_is_refused_before_it_is_held() {
        use arrow::array::{DictionaryArray, Int32Array, StringArray};
        use arrow::datatypes::Int32Type;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bomb.parquet");
        let value = "x".repeat(40 << 20);
        let dictionary: DictionaryArray<Int32Type> = DictionaryArray::try_new(
            Int32Array::from(vec![0; 64]),
            Arc::new(StringArray::from(vec![value.as_str()])),
        )
        .unwrap();
        let batch =
            RecordBatch::try_from_iter([("text", Arc::new(dictionary) as ArrayRef)]).unwrap();
        // Without the Arrow schema in its metadata (as other writers leave
        // it), the column reads back as plain strings, each row its own copy.
        let options = parquet::arrow::arrow_writer::ArrowWriterOptions::new()
            .with_skip_arrow_metadata(true)
            .with_properties(
                WriterProperties::builder()
                    .set_compression(Compression::ZSTD(ZstdLevel::default()))
                    .build(),
            );
        let mut writer = ArrowWriter::try_new_with_options(
            File::create(&path).unwrap(),
            batch.schema(),
            options,
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() < 1 << 20);
        let err = read_parquet_file(&path).unwrap_err().to_string();
        assert!(
            err.contains("bomb.parquet") && err.contains("decode to more memory"),
            "{err}"
        );
        // The decoding thread stopped at the bound: this process holds far
        // less than the 2.5 GiB the file decodes to.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let peak_kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        assert!(peak_kib < 2 << 20, "peak RSS {peak_kib} KiB");
    }
}
