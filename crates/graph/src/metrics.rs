//! Observability: the metrics stream and the run report.
//!
//! Every stage operator emits, when a step ends on its worker, metric rows in
//! a long format (`step`, `worker`, `stage`, `metric`, `label`, `value`):
//! busy seconds, batches and rows in and out, peak queue depth, the policy
//! version a generator used, weights-edge transfer time, and the staleness
//! histogram (metric `staleness`, label = the staleness, value = rows). The
//! rows travel as Arrow batches to the metrics writer (worker 0), which keeps
//! them for the [`RunReport`] and writes them to Parquet; `tracing` gets the
//! same figures as debug events.
//!
//! # Examples
//! ```
//! use weir_graph::metrics::{MetricRow, rows_to_batch, batch_to_rows};
//!
//! let rows = vec![MetricRow::new(0, 1, "generate", "busy_s", None, 0.25)];
//! let batch = rows_to_batch(&rows).unwrap();
//! assert_eq!(batch_to_rows(&batch).unwrap(), rows);
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Float64Array, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow::datatypes::{DataType, Field, Float64Type, Schema, SchemaRef, UInt32Type, UInt64Type};

use crate::{GraphError, Step};

/// Metric names the engine writes.
pub mod names {
    /// Seconds the stage spent inside its calls during the step.
    pub const BUSY_S: &str = "busy_s";
    /// Batches that reached the stage.
    pub const BATCHES_IN: &str = "batches_in";
    /// Rows that reached the stage.
    pub const ROWS_IN: &str = "rows_in";
    /// Rows the stage sent on.
    pub const ROWS_OUT: &str = "rows_out";
    /// Most batches waiting inside the operator (for weights, or for its engine thread).
    pub const QUEUE_PEAK: &str = "queue_peak";
    /// The policy version a generator used for the step.
    pub const POLICY_VERSION: &str = "policy_version";
    /// Seconds from the learner's send of a weights version until it is
    /// whole at the generator's process (a row per version loaded).
    pub const WEIGHTS_TRANSFER_S: &str = "weights_transfer_s";
    /// Seconds the generator spent applying a weights version (its pause).
    pub const WEIGHTS_LOAD_S: &str = "weights_load_s";
    /// Bytes of a weights version as the generator received it.
    pub const WEIGHTS_BYTES: &str = "weights_bytes";
    /// Rows the learner consumed at each staleness (label = staleness).
    pub const STALENESS: &str = "staleness";
    /// When the stage finished the step on this worker, in seconds since the
    /// Unix epoch (a learner's figures give step times and throughput, across resumes too).
    pub const DONE_UNIX_S: &str = "done_unix_s";
    /// Steps admitted but not yet completed, sampled when the source admits a step.
    pub const IN_FLIGHT_STEPS: &str = "in_flight_steps";
}

/// One metric observation.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricRow {
    /// The step it belongs to.
    pub step: Step,
    /// The global worker index that observed it.
    pub worker: u32,
    /// The stage's name (or `engine`).
    pub stage: String,
    /// The metric's name (see [`names`]).
    pub metric: String,
    /// A sub-key, e.g. the staleness bucket.
    pub label: Option<String>,
    /// The value.
    pub value: f64,
}

impl MetricRow {
    /// A metric row.
    pub fn new(
        step: Step,
        worker: u32,
        stage: &str,
        metric: &str,
        label: Option<String>,
        value: f64,
    ) -> Self {
        MetricRow {
            step,
            worker,
            stage: stage.to_string(),
            metric: metric.to_string(),
            label,
            value,
        }
    }
}

/// The Arrow schema of the metrics stream and of `metrics.parquet`.
pub fn metrics_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("step", DataType::UInt64, false),
        Field::new("worker", DataType::UInt32, false),
        Field::new("stage", DataType::Utf8, false),
        Field::new("metric", DataType::Utf8, false),
        Field::new("label", DataType::Utf8, true),
        Field::new("value", DataType::Float64, false),
    ]))
}

/// Packs metric rows into one batch of [`metrics_schema`].
pub fn rows_to_batch(rows: &[MetricRow]) -> Result<RecordBatch, GraphError> {
    let columns: Vec<ArrayRef> = vec![
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.step))),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.worker))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.stage.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.metric.as_str()),
        )),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.label.as_deref()),
        )),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.value))),
    ];
    RecordBatch::try_new(metrics_schema(), columns)
        .map_err(|e| GraphError::Codec(format!("metrics batch: {e}")))
}

/// Unpacks a batch of [`metrics_schema`].
pub fn batch_to_rows(batch: &RecordBatch) -> Result<Vec<MetricRow>, GraphError> {
    if batch.schema().fields() != metrics_schema().fields() {
        return Err(GraphError::Codec(format!(
            "not a metrics batch: schema {:?}",
            batch.schema()
        )));
    }
    let step = batch.column(0).as_primitive::<UInt64Type>();
    let worker = batch.column(1).as_primitive::<UInt32Type>();
    let stage = batch.column(2).as_string::<i32>();
    let metric = batch.column(3).as_string::<i32>();
    let label = batch.column(4).as_string::<i32>();
    let value = batch.column(5).as_primitive::<Float64Type>();
    Ok((0..batch.num_rows())
        .map(|i| MetricRow {
            step: step.value(i),
            worker: worker.value(i),
            stage: stage.value(i).to_string(),
            metric: metric.value(i).to_string(),
            label: (!label.is_null(i)).then(|| label.value(i).to_string()),
            value: value.value(i),
        })
        .collect())
}

/// Totals of one stage over a run (summed over the workers that host it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageTotals {
    /// Seconds inside the stage's calls.
    pub busy_s: f64,
    /// Seconds of the run not spent inside its calls, summed over its workers.
    pub idle_s: f64,
    /// Batches in.
    pub batches_in: u64,
    /// Rows in.
    pub rows_in: u64,
    /// Rows out.
    pub rows_out: u64,
    /// Largest queue depth seen.
    pub queue_peak: u64,
    /// Number of workers that ran it.
    pub workers: u64,
}

/// What a finished run measured. On a multi-process run the process hosting
/// worker 0 holds the whole report; the others hold what they saw locally.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    /// Steps completed.
    pub steps: u64,
    /// Wall-clock seconds from start to the last step's completion.
    pub wall_s: f64,
    /// Steps per second.
    pub steps_per_s: f64,
    /// Per stage totals, by stage name.
    pub stages: BTreeMap<String, StageTotals>,
    /// Rows consumed by learners at each staleness.
    pub staleness_histogram: BTreeMap<u64, u64>,
    /// Most steps admitted and not yet complete at any time.
    pub peak_in_flight_steps: u64,
    /// Mean seconds from a learner's send to a generator's load of new weights.
    pub weights_transfer_s_mean: f64,
    /// Largest such time.
    pub weights_transfer_s_max: f64,
    /// Every metric row (process of worker 0 only).
    pub metrics: Vec<MetricRow>,
}

impl RunReport {
    /// Builds the report from metric rows and the run's wall time.
    pub fn from_metrics(
        metrics: Vec<MetricRow>,
        steps: u64,
        wall_s: f64,
        peak_in_flight_steps: u64,
    ) -> Self {
        let mut stages: BTreeMap<String, StageTotals> = BTreeMap::new();
        let mut stage_workers: BTreeMap<String, std::collections::BTreeSet<u32>> = BTreeMap::new();
        let mut staleness_histogram = BTreeMap::new();
        let mut transfers = Vec::new();
        for row in &metrics {
            if row.metric == names::STALENESS {
                if let Some(bucket) = row.label.as_deref().and_then(|l| l.parse::<u64>().ok()) {
                    *staleness_histogram.entry(bucket).or_insert(0) += row.value as u64;
                }
                continue;
            }
            if row.metric == names::WEIGHTS_TRANSFER_S {
                transfers.push(row.value);
            }
            if row.metric == names::IN_FLIGHT_STEPS {
                continue;
            }
            let totals = stages.entry(row.stage.clone()).or_default();
            stage_workers
                .entry(row.stage.clone())
                .or_default()
                .insert(row.worker);
            match row.metric.as_str() {
                names::BUSY_S => totals.busy_s += row.value,
                names::BATCHES_IN => totals.batches_in += row.value as u64,
                names::ROWS_IN => totals.rows_in += row.value as u64,
                names::ROWS_OUT => totals.rows_out += row.value as u64,
                names::QUEUE_PEAK => totals.queue_peak = totals.queue_peak.max(row.value as u64),
                _ => {}
            }
        }
        for (stage, totals) in stages.iter_mut() {
            totals.workers = stage_workers.get(stage).map_or(0, |w| w.len() as u64);
            totals.idle_s = (wall_s * totals.workers as f64 - totals.busy_s).max(0.0);
        }
        let weights_transfer_s_mean = if transfers.is_empty() {
            0.0
        } else {
            transfers.iter().sum::<f64>() / transfers.len() as f64
        };
        let weights_transfer_s_max = transfers.iter().cloned().fold(0.0, f64::max);
        RunReport {
            steps,
            wall_s,
            steps_per_s: if wall_s > 0.0 {
                steps as f64 / wall_s
            } else {
                0.0
            },
            stages,
            staleness_histogram,
            peak_in_flight_steps,
            weights_transfer_s_mean,
            weights_transfer_s_max,
            metrics,
        }
    }

    /// The largest staleness any learner saw.
    pub fn max_staleness_observed(&self) -> Option<u64> {
        self.staleness_histogram.keys().next_back().copied()
    }

    /// Writes every metric row to a Parquet file, atomically (temp file + rename).
    pub fn write_parquet(&self, path: &Path) -> Result<(), GraphError> {
        let batch = rows_to_batch(&self.metrics)?;
        crate::parquet_log::write_parquet_atomically(path, &[batch])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_sums_per_stage_and_histogram() {
        let rows = vec![
            MetricRow::new(0, 0, "gen", names::BUSY_S, None, 1.0),
            MetricRow::new(1, 1, "gen", names::BUSY_S, None, 2.0),
            MetricRow::new(0, 1, "gen", names::QUEUE_PEAK, None, 3.0),
            MetricRow::new(1, 0, "gen", names::QUEUE_PEAK, None, 2.0),
            MetricRow::new(0, 2, "learn", names::STALENESS, Some("0".into()), 8.0),
            MetricRow::new(1, 2, "learn", names::STALENESS, Some("1".into()), 8.0),
            MetricRow::new(2, 2, "learn", names::STALENESS, Some("1".into()), 4.0),
            MetricRow::new(1, 0, "gen", names::WEIGHTS_TRANSFER_S, None, 0.5),
            MetricRow::new(2, 0, "gen", names::WEIGHTS_TRANSFER_S, None, 1.5),
        ];
        let report = RunReport::from_metrics(rows, 3, 10.0, 2);
        let gen = &report.stages["gen"];
        assert_eq!(gen.busy_s, 3.0);
        assert_eq!(gen.workers, 2);
        assert_eq!(gen.idle_s, 17.0);
        assert_eq!(gen.queue_peak, 3);
        assert_eq!(
            report.staleness_histogram,
            BTreeMap::from([(0, 8), (1, 12)])
        );
        assert_eq!(report.max_staleness_observed(), Some(1));
        assert_eq!(report.weights_transfer_s_mean, 1.0);
        assert_eq!(report.weights_transfer_s_max, 1.5);
        assert!((report.steps_per_s - 0.3).abs() < 1e-12);
    }

    #[test]
    fn batch_to_rows_rejects_other_schemas() {
        let other =
            RecordBatch::try_from_iter([("x", Arc::new(UInt64Array::from(vec![1])) as ArrayRef)])
                .unwrap();
        assert!(batch_to_rows(&other).is_err());
    }
}
