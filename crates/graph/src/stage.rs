//! What a pipeline is made of: sources, stages and sinks.
//!
//! All three are plain traits over Arrow [`RecordBatch`]es. A pipeline holds
//! *factories* for them, called once on each worker of the role, on the
//! thread that will run the instance (so an instance may hold
//! thread-affine resources such as a CUDA context and need not be `Send`).

use arrow::array::RecordBatch;

use crate::weights_edge::WeightsPayload;
use crate::{PolicyVersion, StageError, Step};

/// Where an instance runs: its worker and its rank within its role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerInfo {
    /// Global worker index, `0..peers`.
    pub index: usize,
    /// Total number of workers over all processes.
    pub peers: usize,
    /// This process's id.
    pub process: usize,
    /// Rank of this worker within the role's worker set.
    pub rank: usize,
    /// Size of the role's worker set.
    pub role_size: usize,
    /// The engine run this worker belongs to (0 outside a run): where
    /// [`crate::collective::join`] finds the run's collectives.
    pub run: u64,
    /// The run's steps, staleness bound and commit points.
    pub steps: RunSteps,
}

/// The run's steps as a stage may need them: where they start and end, the
/// staleness bound, and the commit points (where checkpoints are taken).
/// The engine hands them to every factory ([`WorkerInfo::steps`]), from
/// the [`crate::RunSettings`] it runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunSteps {
    /// The first step (a resumed run continues its counter).
    pub first: Step,
    /// The last step (`None`: until the source runs dry).
    pub last: Option<Step>,
    /// k: a row trains at most k versions after the policy that sampled it.
    pub max_staleness: u64,
    /// Commit points after every this many steps and at the last (0: at
    /// the last only); `None`: the run commits nothing.
    pub commit_every: Option<u64>,
}

impl RunSteps {
    /// The first commit point at or after step `from` (`None`: no more).
    /// A stage that moves rows between steps moves none across one, so a
    /// resume from its checkpoint regenerates exactly the steps after it.
    pub fn next_commit(&self, from: Step) -> Option<Step> {
        crate::commit::next(self.commit_every?, self.last, from)
    }
}

impl WorkerInfo {
    /// The one worker of a one-worker run (tools that run a stage on its
    /// own, such as an evaluation, and tests).
    pub fn single() -> Self {
        WorkerInfo {
            index: 0,
            peers: 1,
            process: 0,
            rank: 0,
            role_size: 1,
            run: 0,
            steps: RunSteps::default(),
        }
    }
}

/// The per-call context of a stage: the step, where it runs, the weights
/// version, and (for a learner) the slot for publishing new weights.
#[derive(Debug)]
pub struct StepContext {
    /// The stage's name in the pipeline (errors and records name it).
    stage: std::sync::Arc<str>,
    /// The step being processed.
    pub step: Step,
    /// Where this instance runs.
    pub worker: WorkerInfo,
    /// For a generator, the policy version it holds; for a learner, the
    /// version of the weights it is training (the number of updates so far).
    pub version: PolicyVersion,
    pub(crate) published: Option<WeightsPayload>,
    pub(crate) may_publish: bool,
    pub(crate) weights_retired: bool,
    pub(crate) recorded: Vec<(String, f64)>,
    pub(crate) recorded_under: Vec<(String, String, f64)>,
}

impl StepContext {
    /// A context outside an engine run (to call a stage directly, in tests
    /// or tools); it may not publish weights.
    /// Its stage is named `detached` until [`StepContext::in_stage`] names it.
    pub fn detached(step: Step, worker: WorkerInfo, version: PolicyVersion) -> Self {
        StepContext::new("detached".into(), step, worker, version, false)
    }

    /// This context for the stage named `stage`.
    pub fn in_stage(mut self, stage: &str) -> Self {
        self.stage = stage.into();
        self
    }

    pub(crate) fn new(
        stage: std::sync::Arc<str>,
        step: Step,
        worker: WorkerInfo,
        version: PolicyVersion,
        may_publish: bool,
    ) -> Self {
        StepContext {
            stage,
            step,
            worker,
            version,
            published: None,
            recorded: Vec::new(),
            recorded_under: Vec::new(),
            may_publish,
            weights_retired: false,
        }
    }

    /// The stage's name in the pipeline: what a stage calls itself in its
    /// errors (a column it cannot read, say).
    pub fn stage(&self) -> &str {
        &self.stage
    }

    /// Records a stage-specific metric for this step (a learner's loss,
    /// gradient norm, KL…); it joins the engine's metric rows (stage = this
    /// stage, metric = `name`) in the metrics stream and `metrics.parquet`.
    pub fn record(&mut self, name: &str, value: f64) {
        self.recorded.push((name.to_string(), value));
    }

    /// Records a metric for this step under another stage's name: a figure
    /// the stage measures for a part of the run that is not its own (the
    /// generator's periodic evaluation writes stage `eval`).
    pub fn record_under(&mut self, stage: &str, name: &str, value: f64) {
        self.recorded_under
            .push((stage.to_string(), name.to_string(), value));
    }

    /// The metrics recorded so far in this call.
    pub fn recorded(&self) -> &[(String, f64)] {
        &self.recorded
    }

    /// True in a learner's `end_step`, where [`StepContext::publish_weights`] may be called.
    pub fn may_publish(&self) -> bool {
        self.may_publish
    }

    /// True in a generator's `end_step` when the weights it holds serve no
    /// later step: the staleness bound asks for a newer version at every
    /// later step, and the learner's next one arrives before the next call
    /// (at `max_staleness = 0`, after every step). The stage may free its
    /// copy of the weights until then, so that it does not sit beside the
    /// learner's update.
    pub fn weights_retired(&self) -> bool {
        self.weights_retired
    }

    /// Publishes the learner's new weights (version `self.version + 1`) on
    /// the weights edge. Only a learner stage may call this, at most once per
    /// step, from [`Stage::end_step`].
    pub fn publish_weights(&mut self, weights: WeightsPayload) -> Result<(), StageError> {
        if !self.may_publish {
            return Err("only a learner stage may publish weights, from end_step".into());
        }
        if self.published.is_some() {
            return Err(format!("weights were already published at step {}", self.step).into());
        }
        self.published = Some(weights);
        Ok(())
    }
}

/// A stage transforms the batches of a step and may keep state across steps.
///
/// The engine calls `process` for each batch that reaches this worker and
/// `end_step` once the step is complete here: every batch of the step has
/// arrived (the input frontier passed it) and been processed. `end_step` is
/// called in step order. A plain stage may receive batches of step `s + 1`
/// before `end_step(s)` (with `max_staleness > 0` steps overlap), so state it
/// keeps per step must be keyed by `ctx.step`. A learner sees a step's
/// batches only after `end_step` of every earlier step.
pub trait Stage {
    /// Processes one batch of `ctx.step`; returns the batches to send on.
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError>;

    /// Called once per step when the step is complete at this worker;
    /// returns batches to send on (a learner's consumed rows, a reduction…).
    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let _ = ctx;
        Ok(Vec::new())
    }

    /// Loads new policy weights; called on generator stages before the first
    /// batch processed with `version`.
    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        let _ = (version, weights);
        Err("this stage does not take weights".into())
    }

    /// The policy version of the weights the stage samples with now, where
    /// it differs from the last version handed to [`Stage::load_weights`]:
    /// a streaming generator under `on_new_weights = "finish"` holds new
    /// weights back until its sequences in flight end. `None`: the last
    /// version loaded.
    fn policy_version(&self) -> Option<PolicyVersion> {
        None
    }

    /// True for a streaming stage (a continuous-batching generator):
    /// `process` only takes a batch in, and the rows leave later, from
    /// [`Stage::advance`]. The engine calls `advance` whenever the stage
    /// holds rows and no other job waits, applies new weights between two
    /// calls, and calls `end_step(s)` only once the stage no longer
    /// [`holds`](Stage::holds) rows of step `s` or earlier.
    fn streaming(&self) -> bool {
        false
    }

    /// A streaming stage's next piece of work (one decode pass); returns
    /// the rows that are done, with their steps.
    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        Ok(Vec::new())
    }

    /// Whether a streaming stage still holds rows of `step` or an earlier step.
    fn holds(&self, step: Step) -> bool {
        let _ = step;
        false
    }

    /// Tells a streaming stage that every batch of `step` has reached it
    /// (its `end_step` may still wait for [`Stage::holds`]); it may be told
    /// more than once.
    fn input_ended(&mut self, step: Step) {
        let _ = step;
    }
}

/// A boxed stage is a stage (a role whose stage type the config picks).
impl Stage for Box<dyn Stage> {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        (**self).process(ctx, batch)
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        (**self).end_step(ctx)
    }

    fn load_weights(
        &mut self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<(), StageError> {
        (**self).load_weights(version, weights)
    }

    fn policy_version(&self) -> Option<PolicyVersion> {
        (**self).policy_version()
    }

    fn streaming(&self) -> bool {
        (**self).streaming()
    }

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        (**self).advance()
    }

    fn holds(&self, step: Step) -> bool {
        (**self).holds(step)
    }

    fn input_ended(&mut self, step: Step) {
        (**self).input_ended(step)
    }
}

/// Context of a source call.
#[derive(Clone, Copy, Debug)]
pub struct SourceContext {
    /// The step to produce.
    pub step: Step,
    /// Where this source instance runs; `rank`/`role_size` say which share to produce.
    pub worker: WorkerInfo,
}

/// A source produces the input of each step (e.g. B prompts × n samples).
pub trait Source {
    /// Returns this worker's share of step `ctx.step`, or `None` when exhausted.
    fn next_step(&mut self, ctx: &SourceContext) -> Result<Option<Vec<RecordBatch>>, StageError>;
}

/// A sink consumes batches at the end of an edge (a Parquet log, a collector).
pub trait Sink {
    /// Takes one batch of `step`.
    fn write(&mut self, step: Step, batch: &RecordBatch) -> Result<(), StageError>;

    /// Called once `step` is complete at this sink (all its batches written).
    fn end_step(&mut self, step: Step) -> Result<(), StageError> {
        let _ = step;
        Ok(())
    }

    /// Called when the input has passed commit point `step` (see
    /// [`crate::commit`]), whether or not the step brought data here: make
    /// everything written so far durable (complete, readable files). A
    /// checkpoint of `step` counts only after every sink has committed it.
    fn commit(&mut self, step: Step) -> Result<(), StageError> {
        let _ = step;
        Ok(())
    }

    /// Called once at the end of a successful run.
    fn finish(&mut self) -> Result<(), StageError> {
        Ok(())
    }
}

/// Builds a stage instance on its worker.
pub type StageFactory =
    std::sync::Arc<dyn Fn(&WorkerInfo) -> Result<Box<dyn Stage>, StageError> + Send + Sync>;
/// Builds a source instance on its worker.
pub type SourceFactory =
    std::sync::Arc<dyn Fn(&WorkerInfo) -> Result<Box<dyn Source>, StageError> + Send + Sync>;
/// Builds a sink instance on its worker.
pub type SinkFactory =
    std::sync::Arc<dyn Fn(&WorkerInfo) -> Result<Box<dyn Sink>, StageError> + Send + Sync>;

/// The batches a stage holds until a step ends, by step — for stages that
/// need a whole step (group statistics, a learner's update). A plain stage
/// may receive batches of step `s + 1` before `end_step(s)`, hence the keying.
///
/// With [`StepBuffer::ordered_by`], a step's rows come out sorted by key
/// columns whatever order their batches arrived in (several generators, or
/// a streaming one that sends groups as they finish), so what a step
/// computes does not depend on timing.
#[derive(Debug, Default)]
pub struct StepBuffer {
    held: std::collections::BTreeMap<Step, Vec<RecordBatch>>,
    order: &'static [&'static str],
}

impl StepBuffer {
    /// An empty buffer; rows come out in arrival order.
    pub fn new() -> Self {
        StepBuffer::default()
    }

    /// An empty buffer whose steps come out sorted by `keys` (ascending,
    /// stable), when a step's rows have every key column.
    pub fn ordered_by(keys: &'static [&'static str]) -> Self {
        StepBuffer {
            held: Default::default(),
            order: keys,
        }
    }

    /// Holds `batch` for `step`.
    pub fn push(&mut self, step: Step, batch: RecordBatch) {
        self.held.entry(step).or_default().push(batch);
    }

    /// The batches of `step` as one batch, or `None` if none arrived; the
    /// step is forgotten. Batches of differing columns (rows generated
    /// beside rows replayed from a log) are joined by [`concat_by_name`].
    pub fn take(&mut self, step: Step) -> Result<Option<RecordBatch>, StageError> {
        let Some(batches) = self.held.remove(&step) else {
            return Ok(None);
        };
        let rows = concat_by_name(&batches)?;
        Ok(Some(sorted_by(rows, self.order)?))
    }
}

/// `batches` as one batch. Batches of one schema are concatenated as they
/// are; otherwise the columns are matched by name, in the order they first
/// appear: a column some batch lacks is null in its rows (and nullable), a
/// list whose items are nullable in one batch is so in all, and a column
/// of two different types is an error naming it.
pub fn concat_by_name(batches: &[RecordBatch]) -> Result<RecordBatch, StageError> {
    let first = batches.first().ok_or("no batches to concatenate")?.schema();
    if batches.iter().all(|b| b.schema() == first) {
        return Ok(arrow::compute::concat_batches(&first, batches)?);
    }
    use arrow::datatypes::{DataType, Field};
    let mut fields: Vec<Field> = Vec::new();
    for batch in batches {
        for field in batch.schema().fields() {
            match fields.iter_mut().find(|f| f.name() == field.name()) {
                None => fields.push(field.as_ref().clone()),
                Some(have) => {
                    let ty = match (have.data_type(), field.data_type()) {
                        (a, b) if a == b => a.clone(),
                        (DataType::List(a), DataType::List(b))
                            if a.data_type() == b.data_type() =>
                        {
                            DataType::List(std::sync::Arc::new(
                                a.as_ref()
                                    .clone()
                                    .with_nullable(a.is_nullable() || b.is_nullable()),
                            ))
                        }
                        (a, b) => {
                            return Err(format!(
                                "column `{}` is {a} in one batch of the step and {b} in another",
                                field.name()
                            )
                            .into())
                        }
                    };
                    let nullable = have.is_nullable() || field.is_nullable();
                    *have = have.clone().with_data_type(ty).with_nullable(nullable);
                }
            }
        }
    }
    for field in &mut fields {
        if batches
            .iter()
            .any(|b| b.column_by_name(field.name()).is_none())
        {
            *field = field.clone().with_nullable(true);
        }
    }
    let schema = std::sync::Arc::new(arrow::datatypes::Schema::new_with_metadata(
        fields.clone(),
        first.metadata().clone(),
    ));
    let unified = batches
        .iter()
        .map(|b| {
            let columns = fields
                .iter()
                .map(|f| match b.column_by_name(f.name()) {
                    Some(c) if c.data_type() == f.data_type() => Ok(c.clone()),
                    Some(c) => arrow::compute::cast(c, f.data_type()),
                    None => Ok(arrow::array::new_null_array(f.data_type(), b.num_rows())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            RecordBatch::try_new(schema.clone(), columns)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(arrow::compute::concat_batches(&schema, &unified)?)
}

/// `rows` sorted by the `keys` columns (unchanged without them, or when already in order).
fn sorted_by(rows: RecordBatch, keys: &[&str]) -> Result<RecordBatch, StageError> {
    let columns: Option<Vec<arrow::array::ArrayRef>> = keys
        .iter()
        .map(|k| rows.column_by_name(k).cloned())
        .collect();
    let Some(columns) = columns.filter(|c| !c.is_empty()) else {
        return Ok(rows);
    };
    let sort: Vec<arrow::compute::SortColumn> = columns
        .into_iter()
        .map(|values| arrow::compute::SortColumn {
            values,
            options: None,
        })
        .collect();
    let order = arrow::compute::lexsort_to_indices(&sort, None)?;
    if order
        .values()
        .iter()
        .enumerate()
        .all(|(i, &j)| i as u32 == j)
    {
        return Ok(rows);
    }
    Ok(arrow::compute::take_record_batch(&rows, &order)?)
}

/// A stage that works on whole steps (group statistics, a learner's update):
/// every [`StepStage`] is a [`Stage`] that holds a step's batches in its
/// [`StepBuffer`] and gets them at once, concatenated, when the step ends.
pub trait StepStage {
    /// Where the step's batches wait (a field of the stage).
    fn buffer(&mut self) -> &mut StepBuffer;

    /// Runs on the step's rows; `None` when no row of the step reached this worker.
    fn run_step(
        &mut self,
        ctx: &mut StepContext,
        rows: Option<RecordBatch>,
    ) -> Result<Vec<RecordBatch>, StageError>;
}

impl<T: StepStage> Stage for T {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        self.buffer().push(ctx.step, batch);
        Ok(Vec::new())
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let rows = self.buffer().take(ctx.step)?;
        self.run_step(ctx, rows)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Array, Float32Array, ListArray, RecordBatch, StringArray, UInt64Array};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::concat_by_name;

    #[test]
    fn batches_of_other_columns_join_by_name_with_nulls() {
        let list =
            |nullable| DataType::List(Arc::new(Field::new("item", DataType::Float32, nullable)));
        let item = Arc::new(Field::new("item", DataType::Float32, false));
        let lp = ListArray::new(
            item,
            arrow::buffer::OffsetBuffer::from_lengths([1, 2]),
            Arc::new(Float32Array::from(vec![0.5, 1.5, 2.5])),
            None,
        );
        let a = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("step", DataType::UInt64, false),
                Field::new("lp", list(false), false),
            ])),
            vec![Arc::new(UInt64Array::from(vec![1, 2])), Arc::new(lp)],
        );
        let a = a.unwrap();
        let b = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("source", DataType::Utf8, false),
                Field::new("step", DataType::UInt64, false),
            ])),
            vec![
                Arc::new(StringArray::from(vec!["log"])),
                Arc::new(UInt64Array::from(vec![3])),
            ],
        )
        .unwrap();
        let joined = concat_by_name(&[a.clone(), b]).unwrap();
        let schema = joined.schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["step", "lp", "source"]);
        assert_eq!(joined.num_rows(), 3);
        let lp = joined.column_by_name("lp").unwrap();
        assert!(lp.is_null(2) && !lp.is_null(0));
        let source = joined.column_by_name("source").unwrap();
        assert_eq!(source.null_count(), 2);
        let values = lp.as_any().downcast_ref::<ListArray>().unwrap().value(1);
        let values = values.as_any().downcast_ref::<Float32Array>().unwrap();
        assert_eq!(values.values(), &[1.5, 2.5]);
        // One schema: concatenated as it is.
        assert_eq!(
            concat_by_name(&[a.clone(), a.clone()]).unwrap().schema(),
            a.schema()
        );
        // A column of two types is named.
        let c = RecordBatch::try_new(
            Arc::new(Schema::new(vec![Field::new("step", DataType::Utf8, false)])),
            vec![Arc::new(StringArray::from(vec!["x"]))],
        )
        .unwrap();
        let err = concat_by_name(&[a, c]).unwrap_err().to_string();
        assert!(err.contains("column `step` is UInt64"), "{err}");
    }
}
