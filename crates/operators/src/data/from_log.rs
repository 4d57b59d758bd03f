//! Training from logs: groups of earlier runs' rollout logs in place of a
//! share of a step's fresh generation.
//!
//! [`LoggedGroups`] holds the logged groups a run replays (rows of the
//! logs the row filter keeps, grouped by their `(step, group_id)`, in the
//! order they were trained). [`Replaying`] wraps the actor's generator:
//! each group of a step's prompts is either generated or replaced by a
//! logged group — group `g` is replaced when ⌊(g + 1)·f⌋ > ⌊g·f⌋ for the
//! replay fraction f, by logged group ⌊g·f⌋ mod N. The choice depends on
//! the group's id alone, so a resumed run and every rollout worker make
//! the same one, and the workers' groups (disjoint ids) replay disjoint
//! logged groups. A replayed group's rows get the step and group id of
//! the group they replace, `source = "log"`, the step and policy version
//! the log gave them (`logged_step`, `logged_policy_version`); the engine
//! stamps them with the generator's version as it does every row, so that
//! no staleness bound holds them back: how far off-policy they are is the
//! importance correction's to weigh, from their behaviour log-probs.
//! Their rewards are the logged ones: [`PassLogged`] lets them pass the
//! reward stages (and, with advantages taken as logged, the advantage
//! stage) untouched.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, BooleanArray, RecordBatch, StringArray, UInt64Array};
use weir_graph::batch::with_column;
use weir_graph::{PolicyVersion, Stage, StageError, Step, StepContext, WeightsPayload};

use crate::error::OperatorError;
use crate::rollout::{self, col, Phase};
use crate::rollout_log::{self, RowFilter};

/// What a replayed row keeps of its log's columns beyond the generator's:
/// the reward (and the score before an overlong penalty, per-token
/// rewards), and with advantages taken as logged, those and the returns.
const SCORED: [&str; 3] = [col::REWARD, col::SCORE, col::TOKEN_REWARDS];
const ADVANTAGES: [&str; 2] = [col::ADVANTAGES, col::RETURNS];
/// Generator columns that describe this run's generation only.
const NOT_REPLAYED: [&str; 5] = [
    col::POLICY_VERSION,
    col::TOKEN_VERSIONS,
    col::KV_RECOMPUTED,
    col::SOURCE,
    col::LOGGED_POLICY_VERSION,
];

/// The logged groups a run replays, and how often. Only an index is kept
/// in memory (each group's file, step and id); a group's rows are read when
/// it is replayed, a file at a time (groups replay in the order they were
/// trained, so one file serves many in a row), and the last two files read
/// are kept: memory is bounded by the log's files, not by the log.
#[derive(Debug)]
pub struct LoggedGroups {
    files: Vec<rollout_log::LogFile>,
    /// Every logged group: the files holding its rows, its step and id.
    index: Vec<(Vec<usize>, u64, u64)>,
    filter: RowFilter,
    keep_advantages: bool,
    fraction: f64,
    /// The most tokens a replayed row may hold (the model's context).
    max_tokens: usize,
    /// The files read last, each grouped: (file, (step, group) → rows).
    cache: std::sync::Mutex<Vec<(usize, Grouped)>>,
    /// The rows the filter keeps.
    pub rows: usize,
}

/// A file's replayable rows by `(step, group_id)`.
type Grouped = std::collections::HashMap<(u64, u64), RecordBatch>;

impl LoggedGroups {
    /// Indexes the groups of `sources` that `filter` keeps (only their
    /// step and group columns are read); `fraction` of a step's groups
    /// replay; `keep_advantages`: the logged advantages and returns stay
    /// (else the advantage stage computes them again); a group's rows are
    /// refused when one holds more than `max_tokens` or per-token columns
    /// of another length than its response.
    pub fn load(
        sources: &[PathBuf],
        filter: &RowFilter,
        fraction: f64,
        keep_advantages: bool,
        max_tokens: usize,
    ) -> Result<Self, OperatorError> {
        let files = rollout_log::open_all(sources)?;
        let mut groups: BTreeMap<(u64, u64), Vec<usize>> = BTreeMap::new();
        let mut rows = 0;
        for (at, file) in files.iter().enumerate() {
            for batch in rollout_log::read(file, filter, Some(&[col::STEP, col::GROUP_ID]))? {
                let ids = |name| {
                    crate::data::columns::u64s(&batch, name, "data.rollouts")
                        .map_err(|e| OperatorError::file(&file.path, e.to_string()))
                };
                let (steps, ids) = (ids(col::STEP)?, ids(col::GROUP_ID)?);
                rows += steps.len();
                for key in steps.into_iter().zip(ids) {
                    let holders = groups.entry(key).or_default();
                    if holders.last() != Some(&at) {
                        holders.push(at);
                    }
                }
            }
        }
        if groups.is_empty() {
            return Err(rollout_log::no_rows(sources, filter));
        }
        Ok(LoggedGroups {
            files,
            index: groups
                .into_iter()
                .map(|((step, group), holders)| (holders, step, group))
                .collect(),
            filter: filter.clone(),
            keep_advantages,
            fraction,
            max_tokens,
            cache: std::sync::Mutex::new(Vec::new()),
            rows,
        })
    }

    /// The first log file that has no column `name`, if one has none.
    pub fn file_without(&self, name: &str) -> Option<&std::path::Path> {
        self.files
            .iter()
            .find(|f| f.schema.index_of(name).is_err())
            .map(|f| f.path.as_path())
    }

    /// The logged groups.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Which logged group (in the order they were trained) group `group`
    /// of a step replays, if it does.
    pub fn replaces(&self, group: u64) -> Option<usize> {
        let f = self.fraction;
        let (at, next) = ((group as f64 * f).floor(), ((group + 1) as f64 * f).floor());
        (next > at && !self.index.is_empty()).then(|| at as usize % self.index.len())
    }

    /// The rows of logged group `at`, with the columns a replayed row carries.
    pub fn group(&self, at: usize) -> Result<RecordBatch, OperatorError> {
        let (holders, step, group) = &self.index[at];
        let mut parts = Vec::new();
        for &file in holders {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if !cache.iter().any(|(f, _)| *f == file) {
                let grouped = self.read_file(file)?;
                if cache.len() == 2 {
                    cache.remove(0);
                }
                cache.push((file, grouped));
            }
            let (_, grouped) = cache.iter().find(|(f, _)| *f == file).expect("just cached");
            if let Some(rows) = grouped.get(&(*step, *group)) {
                parts.push(rows.clone());
            }
        }
        let what = || self.files[holders[0]].path.clone();
        let rows = rollout_log::in_step_order(&parts)?.ok_or_else(|| {
            OperatorError::file(what(), format!("group {group} of step {step} is gone"))
        })?;
        Ok(rows)
    }

    /// File `at`'s replayable rows, grouped.
    fn read_file(&self, at: usize) -> Result<Grouped, OperatorError> {
        let file = &self.files[at];
        // What a replayed row keeps, and what its logged step and version come from.
        let wanted: Vec<&str> = file
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .filter(|name| {
                replayed(name, self.keep_advantages)
                    || [col::POLICY_VERSION, col::LOGGED_POLICY_VERSION].contains(name)
            })
            .collect();
        let batches = rollout_log::read(file, &self.filter, Some(&wanted))?;
        let mut out = Grouped::new();
        let Some(rows) = rollout_log::in_step_order(&batches)? else {
            return Ok(out);
        };
        let ids = |name| {
            crate::data::columns::u64s(&rows, name, "data.rollouts")
                .map_err(|e| OperatorError::file(&file.path, e.to_string()))
        };
        let (steps, groups) = (ids(col::STEP)?, ids(col::GROUP_ID)?);
        // Before a row's lengths size any buffer: a crafted log may hold a
        // list far past the model's context, or log-probs of another length.
        rollout::check_read(&rows, self.max_tokens, "data.rollouts")
            .map_err(|e| OperatorError::file(&file.path, e.to_string()))?;
        let rows = replayable(&rows, self.keep_advantages)
            .map_err(|e| OperatorError::file(&file.path, e))?;
        let mut start = 0;
        for end in 1..=steps.len() {
            if end == steps.len() || (steps[end], groups[end]) != (steps[start], groups[start]) {
                out.insert(
                    (steps[start], groups[start]),
                    rows.slice(start, end - start),
                );
                start = end;
            }
        }
        Ok(out)
    }
}

/// Whether a replayed row keeps column `name` of its log: the dataset's
/// columns, the prompt's and the generator's (but this run's own), the
/// scores, and with `keep_advantages` the advantages and returns.
fn replayed(name: &str, keep_advantages: bool) -> bool {
    let phase = rollout::columns()
        .into_iter()
        .find(|c| c.0 == name)
        .map(|c| c.3);
    match phase {
        None => true,
        Some(_) if NOT_REPLAYED.contains(&name) => false,
        Some(Phase::Prompt | Phase::Generate) => true,
        Some(_) => SCORED.contains(&name) || (keep_advantages && ADVANTAGES.contains(&name)),
    }
}

/// `rows` with the columns a replayed row carries: the generator's and the
/// dataset's, the logged rewards (and advantages), `logged_step` and
/// `logged_policy_version` (kept from the log where it replayed a log itself).
fn replayable(rows: &RecordBatch, keep_advantages: bool) -> Result<RecordBatch, String> {
    let schema = rows.schema();
    let indices: Vec<usize> = (0..schema.fields().len())
        .filter(|&i| replayed(schema.field(i).name(), keep_advantages))
        .collect();
    let mut out = rows.project(&indices).map_err(|e| e.to_string())?;
    let earlier = |name: &str| {
        rows.column_by_name(name)
            .and_then(|c| c.as_any().downcast_ref::<UInt64Array>().cloned())
    };
    // A row replayed before keeps what its first log said.
    let first = |logged: &str, own: &str| -> Result<ArrayRef, String> {
        let own = earlier(own).ok_or_else(|| format!("no u64 column `{own}`"))?;
        Ok(Arc::new(match earlier(logged) {
            Some(before) => (0..own.len())
                .map(|i| {
                    Some(if before.is_valid(i) {
                        before.value(i)
                    } else {
                        own.value(i)
                    })
                })
                .collect::<UInt64Array>(),
            None => own,
        }))
    };
    for (logged, own) in [
        (col::LOGGED_STEP, col::STEP),
        (col::LOGGED_POLICY_VERSION, col::POLICY_VERSION),
    ] {
        out = with_column(&out, logged, first(logged, own)?).map_err(|e| e.to_string())?;
    }
    let source: ArrayRef = Arc::new(StringArray::from(vec!["log"; out.num_rows()]));
    with_column(&out, col::SOURCE, source).map_err(|e| e.to_string())
}

/// `group`'s rows as group `id` of step `step`, started now.
fn as_group(group: &RecordBatch, step: Step, id: u64) -> Result<RecordBatch, StageError> {
    let n = group.num_rows();
    let mut out = with_column(group, col::STEP, Arc::new(UInt64Array::from_value(step, n)))?;
    out = with_column(
        &out,
        col::GROUP_ID,
        Arc::new(UInt64Array::from_value(id, n)),
    )?;
    if out.column_by_name(col::STARTED_UNIX_S).is_some() {
        let now = weir_graph::weights_edge::now_unix_s();
        out = with_column(
            &out,
            col::STARTED_UNIX_S,
            Arc::new(arrow::array::Float64Array::from_value(now, n)),
        )?;
    }
    Ok(out)
}

/// `batch` marked `source = "generated"`.
fn generated(batch: RecordBatch) -> Result<RecordBatch, StageError> {
    let n = batch.num_rows();
    Ok(with_column(
        &batch,
        col::SOURCE,
        Arc::new(StringArray::from(vec!["generated"; n])),
    )?)
}

/// The [`Stage`] methods a wrapper hands to its `inner` stage as they are:
/// weights, the version held, streaming and what it holds.
macro_rules! inner_stage {
    () => {
        fn load_weights(
            &mut self,
            version: PolicyVersion,
            weights: &WeightsPayload,
        ) -> Result<(), StageError> {
            self.inner.load_weights(version, weights)
        }

        fn policy_version(&self) -> Option<PolicyVersion> {
            self.inner.policy_version()
        }

        fn streaming(&self) -> bool {
            self.inner.streaming()
        }

        fn holds(&self, step: Step) -> bool {
            self.inner.holds(step)
        }

        fn input_ended(&mut self, step: Step) {
            self.inner.input_ended(step)
        }
    };
}

/// The actor's generator, with a share of each step's groups replayed from logs.
pub struct Replaying<S> {
    inner: S,
    log: Arc<LoggedGroups>,
    /// Per step: replayed rows, and the sum of their policy versions.
    replayed: BTreeMap<Step, (usize, u64)>,
}

impl<S: Stage> Replaying<S> {
    /// `inner` generating the groups that `log` does not replace.
    pub fn new(inner: S, log: Arc<LoggedGroups>) -> Self {
        Replaying {
            inner,
            log,
            replayed: BTreeMap::new(),
        }
    }

    fn mark(batches: Vec<RecordBatch>) -> Result<Vec<RecordBatch>, StageError> {
        batches.into_iter().map(generated).collect()
    }
}

impl<S: Stage> Stage for Replaying<S> {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let groups = crate::data::columns::u64s(&batch, col::GROUP_ID, ctx.stage())?;
        let fresh: BooleanArray = groups
            .iter()
            .map(|&g| Some(self.log.replaces(g).is_none()))
            .collect();

        let mut out = Vec::new();
        let generate = arrow::compute::filter_record_batch(&batch, &fresh)?;
        if generate.num_rows() > 0 {
            out = Self::mark(self.inner.process(ctx, generate)?)?;
        }
        let mut seen = std::collections::BTreeSet::new();
        for &g in &groups {
            if !seen.insert(g) {
                continue;
            }
            if let Some(at) = self.log.replaces(g) {
                let rows = as_group(&self.log.group(at)?, ctx.step, g)?;
                let versions =
                    crate::data::columns::u64s(&rows, col::LOGGED_POLICY_VERSION, ctx.stage())?;
                let tally = self.replayed.entry(ctx.step).or_default();
                tally.0 += rows.num_rows();
                tally.1 += versions.iter().sum::<u64>();
                out.push(rows);
            }
        }
        Ok(out)
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        let out = Self::mark(self.inner.end_step(ctx)?)?;
        let (rows, versions) = self.replayed.remove(&ctx.step).unwrap_or_default();
        ctx.record("log_rows", rows as f64);
        if rows > 0 {
            // How far behind the generator's weights the replayed rows' sampler was.
            let mean = versions as f64 / rows as f64;
            ctx.record("log_version_gap", ctx.version as f64 - mean);
        }
        Ok(out)
    }

    inner_stage!();

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        self.inner
            .advance()?
            .into_iter()
            .map(|(step, batch)| Ok((step, generated(batch)?)))
            .collect()
    }
}

/// A stage that replayed rows pass untouched (the reward stages: a
/// replayed row keeps its logged reward).
pub struct PassLogged<S> {
    inner: S,
}

impl<S: Stage> PassLogged<S> {
    /// `inner` for every row but the replayed ones.
    pub fn new(inner: S) -> Self {
        PassLogged { inner }
    }
}

/// Which of `batch`'s rows were replayed from a log.
fn logged_rows(batch: &RecordBatch) -> Option<BooleanArray> {
    let source = batch
        .column_by_name(col::SOURCE)?
        .as_any()
        .downcast_ref::<StringArray>()?;
    let logged: BooleanArray = source.iter().map(|s| Some(s == Some("log"))).collect();
    (logged.true_count() > 0).then_some(logged)
}

impl<S: Stage> Stage for PassLogged<S> {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let Some(logged) = logged_rows(&batch) else {
            return self.inner.process(ctx, batch);
        };
        let rest = arrow::compute::not(&logged)?;
        let fresh = arrow::compute::filter_record_batch(&batch, &rest)?;
        let mut out = if fresh.num_rows() > 0 {
            self.inner.process(ctx, fresh)?
        } else {
            Vec::new()
        };
        out.push(arrow::compute::filter_record_batch(&batch, &logged)?);
        Ok(out)
    }

    fn end_step(&mut self, ctx: &mut StepContext) -> Result<Vec<RecordBatch>, StageError> {
        self.inner.end_step(ctx)
    }

    inner_stage!();

    fn advance(&mut self) -> Result<Vec<(Step, RecordBatch)>, StageError> {
        self.inner.advance()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_of_groups_replays_each_logged_group_in_turn() {
        let log = |fraction| LoggedGroups {
            files: Vec::new(),
            index: (0..3).map(|g| (vec![0], 0, g)).collect(),
            filter: RowFilter::default(),
            keep_advantages: false,
            fraction,
            max_tokens: 1 << 20,
            cache: Default::default(),
            rows: 3,
        };
        let picks = |f: f64| -> Vec<Option<usize>> {
            let log = log(f);
            (0..8).map(|g| log.replaces(g)).collect()
        };
        assert_eq!(picks(1.0), [0, 1, 2, 0, 1, 2, 0, 1].map(Some));
        assert_eq!(
            picks(0.5),
            [None, Some(0), None, Some(1), None, Some(2), None, Some(0)]
        );
        assert!(picks(0.0).iter().all(Option::is_none));
        // A quarter: one group in four, whatever the worker or the resume.
        let quarter = picks(0.25);
        assert_eq!(quarter.iter().flatten().count(), 2);
    }
}
