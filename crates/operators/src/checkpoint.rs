//! Checkpoints: what a run needs to continue after a crash.
//!
//! ```text
//! checkpoints/step-N/
//!   actor/            HF layout (config.json, model.safetensors, tokenizer files)
//!     optimizer.safetensors   AdamW moments, metadata `steps`; or, with the
//!                             state sharded over N ranks, one file per rank:
//!     optimizer-00001-of-0000N.safetensors …
//!   critic/           the same, for pipelines with a critic
//!   state.json        {"step", "version", "cursor": {"epoch", "position"}, "seed", "components"}
//! ```
//!
//! Each component is written to a hidden temporary folder, synced to disk
//! and renamed into place, and `state.json` goes through a synced temporary
//! file too, so a crash or a power cut mid-write leaves no half checkpoint
//! that [`latest`] would pick: a checkpoint counts only when `state.json`
//! exists and names components that are all present.
//!
//! In a run, `state.json` is written last of all: the trainer saves its
//! components and hands the state to [`CheckpointCommits`], which writes it
//! once the engine has passed the step at every sink and at the metrics
//! writer (a commit point, see `weir_graph::commit`). So a checkpoint never
//! counts before the rollout log and the metrics file hold its steps.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use weir_gpu::collective::GroupMember;
use weir_gpu::optim::Optimizer;
use weir_gpu::snapshot::{from_safetensors_where, save_safetensors, sync_tree, write_atomically};
use weir_gpu::Model;
use weir_graph::StageError;

use crate::data::cursor::{Cursor, CursorLog};
use crate::error::OperatorError;

/// The run state stored beside the weights.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointState {
    /// The last completed step.
    pub step: u64,
    /// The policy version after that step's update (the generators resume on it).
    pub version: u64,
    /// The prompt source's cursor after that step.
    pub cursor: Option<Cursor>,
    /// The run's seed (sampling streams derive from it and the step).
    pub seed: u64,
    /// Components saved beside the state (`actor`, `critic`).
    pub components: Vec<String>,
    /// Config values a resume must keep (key → value as text): what the
    /// weights, the cursor and the components mean depends on them.
    pub invariants: BTreeMap<String, String>,
    /// Values stages carry from step to step (e.g. an adaptive `kl_coef`),
    /// as they stand after `step`.
    pub values: BTreeMap<String, f64>,
}

/// Values that stages carry from one step to the next, by the step after
/// which they hold, so that a checkpoint stores them and a resume restores
/// them (the adaptive KL coefficient, say). Shared by the stages of a process.
#[derive(Clone, Debug, Default)]
pub struct StepValues {
    log: Arc<Mutex<BTreeMap<u64, BTreeMap<String, f64>>>>,
}

impl StepValues {
    /// An empty log.
    pub fn new() -> Self {
        StepValues::default()
    }

    /// `key` is `value` after step `step`.
    pub fn record(&self, step: u64, key: &str, value: f64) {
        self.lock()
            .entry(step)
            .or_default()
            .insert(key.to_string(), value);
    }

    /// Every key's newest value recorded at or before `step` (older entries
    /// are folded together, so the log stays small).
    pub fn after(&self, step: u64) -> BTreeMap<String, f64> {
        let mut log = self.lock();
        let mut out = BTreeMap::new();
        for values in log.range(..=step).map(|(_, v)| v) {
            out.extend(values.iter().map(|(k, v)| (k.clone(), *v)));
        }
        log.retain(|s, _| *s > step);
        if !out.is_empty() {
            log.insert(step, out.clone());
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, BTreeMap<String, f64>>> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CheckpointState {
    fn to_json(&self) -> Value {
        json!({
            "step": self.step,
            "version": self.version,
            "cursor": self.cursor.map(|c| json!({"epoch": c.epoch, "position": c.position})),
            "seed": self.seed,
            "components": self.components,
            "invariants": self.invariants,
            "values": self.values,
        })
    }

    fn from_json(v: &Value, path: &Path) -> Result<Self, StageError> {
        // Steps and versions count up from 0 a step at a time: a crafted
        // one near 2⁶⁴ would overflow what is computed from it.
        let field = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .filter(|n| *n < 1 << 62 || k == "seed")
                .ok_or_else(|| format!("{}: no integer `{k}` below 2^62", path.display()))
        };
        let cursor = match v.get("cursor") {
            Some(Value::Object(c)) => Some(Cursor {
                epoch: c.get("epoch").and_then(Value::as_u64).unwrap_or(0),
                position: c.get("position").and_then(Value::as_u64).unwrap_or(0) as usize,
            }),
            _ => None,
        };
        let components: Vec<String> = v
            .get("components")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        // A component is a folder of the checkpoint, named plainly.
        if let Some(bad) = components
            .iter()
            .find(|c| c.is_empty() || c.contains(['/', '\\']) || *c == "." || *c == "..")
        {
            return Err(
                format!("{}: component {bad:?} is not a folder name", path.display()).into(),
            );
        }
        Ok(CheckpointState {
            step: field("step")?,
            version: field("version")?,
            cursor,
            seed: field("seed")?,
            components,
            invariants: v
                .get("invariants")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_default(),
            values: v
                .get("values")
                .and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                        .collect()
                })
                .unwrap_or_default(),
        })
    }
}

/// When and where a trainer stage saves.
#[derive(Clone, Debug)]
pub struct Checkpointer {
    /// `RUN_DIR/checkpoints`.
    pub root: PathBuf,
    /// Save after every `every`-th step (0: only the last).
    pub every: u64,
    /// The run's last step, always saved.
    pub last_step: Option<u64>,
    /// Weights above this many bytes are saved in shards (with an index).
    pub max_shard_bytes: u64,
}

impl Checkpointer {
    /// Whether step `step` ends with a checkpoint: the run's commit points
    /// ([`weir_graph::commit::next`]) are its checkpoints.
    pub fn due(&self, step: u64) -> bool {
        weir_graph::commit::next(self.every, self.last_step, step) == Some(step)
    }

    /// The folder of step `step`'s checkpoint.
    pub fn dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step}"))
    }

    /// Saves `model` (HF layout) and the optimizer state as `component` of step `step`.
    pub fn save_component(
        &self,
        step: u64,
        component: &str,
        model: &Model,
        optimizer: OptimizerSave<'_>,
    ) -> Result<PathBuf, StageError> {
        let dir = self.dir(step);
        let tmp = dir.join(format!(".{component}.partial"));
        let _ = std::fs::remove_dir_all(&tmp);
        model.save_sharded(&tmp, None, self.max_shard_bytes)?;
        save_optimizer(Some(&tmp), optimizer)?;
        // Every file on disk before the folder takes its name, and the name
        // before `state.json` (the commit point) can name the component.
        sync_tree(&tmp, true)?;
        let target = dir.join(component);
        let _ = std::fs::remove_dir_all(&target);
        std::fs::rename(&tmp, &target).map_err(|e| OperatorError::file(&target, e))?;
        sync_tree(&dir, false)?;
        Ok(target)
    }

    /// Writes step `state.step`'s `state.json` (after its components).
    pub fn save_state(&self, state: &CheckpointState) -> Result<(), StageError> {
        let dir = self.dir(state.step);
        std::fs::create_dir_all(&dir).map_err(|e| OperatorError::file(&dir, e))?;
        let text = serde_json::to_string_pretty(&state.to_json()).map_err(|e| e.to_string())?;
        write_atomically(&dir.join("state.json"), text.as_bytes())?;
        Ok(())
    }
}

/// Where a trainer's optimizer state is when a checkpoint saves it.
pub enum OptimizerSave<'a> {
    /// All of it in this optimizer.
    Whole(&'a Optimizer),
    /// Sharded over the ranks of the member's group.
    Sharded(&'a Optimizer, &'a GroupMember),
}

/// The name of rank `rank`'s file of an optimizer state sharded over `ranks`.
fn shard_file(rank: usize, ranks: usize) -> String {
    format!("optimizer-{:05}-of-{ranks:05}.safetensors", rank + 1)
}

/// Writes the optimizer state into `dir`: `optimizer.safetensors`, or one
/// file per rank of a sharded state (written by the rank given a `dir` as
/// each rank's share arrives; a rank given none only hands its share over).
pub fn save_optimizer(dir: Option<&Path>, optimizer: OptimizerSave<'_>) -> Result<(), StageError> {
    let write = |file: String, tensors: &[(String, tch::Tensor)], steps: u64| {
        let Some(dir) = dir else { return Ok(()) };
        let meta = std::collections::HashMap::from([("steps".to_string(), steps.to_string())]);
        save_safetensors(&dir.join(file), tensors, None, &meta)
    };
    match optimizer {
        OptimizerSave::Whole(optimizer) => {
            let (tensors, steps) = optimizer.state();
            write("optimizer.safetensors".into(), &tensors, steps)?;
        }
        OptimizerSave::Sharded(optimizer, member) => {
            let steps = optimizer.steps();
            optimizer.gather_state(member, |rank, ranks, tensors| {
                write(shard_file(rank, ranks), &tensors, steps)
            })?;
        }
    }
    Ok(())
}

/// Checkpoint states whose components are saved, waiting for their commit point.
#[derive(Clone, Debug)]
pub struct CheckpointCommits {
    checkpointer: Checkpointer,
    pending: Arc<Mutex<BTreeMap<u64, CheckpointState>>>,
}

impl CheckpointCommits {
    /// Nothing pending, for the checkpoints of `checkpointer`.
    pub fn new(checkpointer: Checkpointer) -> Self {
        CheckpointCommits {
            checkpointer,
            pending: Arc::new(Mutex::new(BTreeMap::new())),
        }
    }

    /// Keeps `state` until [`CheckpointCommits::commit`] reaches its step.
    pub fn defer(&self, state: CheckpointState) {
        self.lock().insert(state.step, state);
    }

    /// Writes the `state.json` of every pending checkpoint up to step `at`
    /// (the run has passed the commit point `at`). Idempotent: every worker calls it.
    pub fn commit(&self, at: u64) -> Result<(), String> {
        let mut pending = self.lock();
        while let Some(entry) = pending.first_entry() {
            if *entry.key() > at {
                break;
            }
            self.checkpointer
                .save_state(entry.get())
                .map_err(|e| e.to_string())?;
            tracing::info!(step = *entry.key(), "checkpoint committed");
            entry.remove();
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, CheckpointState>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a trainer saves, when, and the run state it stores beside the weights.
#[derive(Clone, Debug)]
pub struct CheckpointPlan {
    /// Where and when.
    pub checkpointer: Checkpointer,
    /// The prompt source's cursors (same process).
    pub cursors: Option<CursorLog>,
    /// The run's seed.
    pub seed: u64,
    /// Every component a complete checkpoint has (`actor`, and `critic` for PPO).
    pub components: Vec<String>,
    /// Where the state waits for its commit point (`None`: written at once).
    pub commits: Option<CheckpointCommits>,
    /// Config values a resume must keep (see [`CheckpointState::invariants`]).
    pub invariants: BTreeMap<String, String>,
    /// What stages carry from step to step (see [`StepValues`]).
    pub values: Option<StepValues>,
}

impl CheckpointPlan {
    /// Saves `model` and `optimizer` as the actor of `step`, then the state.
    pub fn save_actor(
        &self,
        step: u64,
        version: u64,
        model: &Model,
        optimizer: OptimizerSave<'_>,
    ) -> Result<(), StageError> {
        self.checkpointer
            .save_component(step, "actor", model, optimizer)?;
        let state = CheckpointState {
            step,
            version,
            cursor: self.cursors.as_ref().and_then(|c| c.after(step)),
            seed: self.seed,
            components: self.components.clone(),
            invariants: self.invariants.clone(),
            values: self
                .values
                .as_ref()
                .map(|v| v.after(step))
                .unwrap_or_default(),
        };
        match &self.commits {
            Some(commits) => commits.defer(state),
            None => self.checkpointer.save_state(&state)?,
        }
        tracing::info!(step, "checkpoint components saved");
        Ok(())
    }
}

/// The optimizer files of a component: `optimizer.safetensors`, or every
/// rank's file of a sharded state (all of them, or an error naming the
/// first one missing).
fn optimizer_files(component_dir: &Path) -> Result<Vec<PathBuf>, StageError> {
    let whole = component_dir.join("optimizer.safetensors");
    if whole.is_file() {
        return Ok(vec![whole]);
    }
    let ranks = std::fs::read_dir(component_dir)
        .map_err(|e| OperatorError::file(component_dir, e))?
        .flatten()
        .find_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let (_, of) = name.strip_prefix("optimizer-")?.split_once("-of-")?;
            of.strip_suffix(".safetensors")?.parse::<usize>().ok()
        });
    let Some(ranks) = ranks else {
        return Err(
            OperatorError::file(&whole, "no such file (nor the files of a sharded state)").into(),
        );
    };
    (0..ranks)
        .map(|r| {
            let path = component_dir.join(shard_file(r, ranks));
            if path.is_file() {
                Ok(path)
            } else {
                Err(OperatorError::file(
                    &path,
                    format!("missing: the optimizer state was sharded over {ranks} ranks"),
                )
                .into())
            }
        })
        .collect()
}

/// Restores `optimizer` from the component folder `component_dir`: the
/// state this rank holds, from `optimizer.safetensors` or from the files of
/// a state sharded over any number of ranks (a checkpoint resumes on
/// another rank count, sharded or not); each file is read in turn and only
/// the tensors this rank needs are kept.
pub fn load_optimizer(component_dir: &Path, optimizer: &mut Optimizer) -> Result<(), StageError> {
    let wanted: std::collections::HashSet<String> = optimizer.state_names().into_iter().collect();
    let mut tensors = Vec::new();
    let mut steps = None;
    let files = optimizer_files(component_dir)?;
    for path in &files {
        let bytes = std::fs::read(path).map_err(|e| OperatorError::file(path, e))?;
        let (named, meta) = from_safetensors_where(&bytes, |n| wanted.contains(n))
            .map_err(|e| OperatorError::file(path, e))?;
        let these: u64 = meta
            .get("steps")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{}: no `steps` in the metadata", path.display()))?;
        if steps.is_some_and(|s| s != these) {
            return Err(format!(
                "{}: holds step {these} of the optimizer, its sibling files another",
                path.display()
            )
            .into());
        }
        steps = Some(these);
        tensors.extend(named);
    }
    optimizer
        .load_state(&tensors, steps.unwrap_or(0))
        .map_err(|e| OperatorError::file(&files[0], e).into())
}

/// The newest complete checkpoint under `root`: its folder and state.
pub fn latest(root: &Path) -> Result<Option<(PathBuf, CheckpointState)>, StageError> {
    for dir in step_folders(root).into_iter().rev() {
        if let Some(state) = complete_state(&dir)? {
            return Ok(Some((dir, state)));
        }
    }
    Ok(None)
}

/// Every complete checkpoint under `root`, oldest first.
pub fn complete(root: &Path) -> Result<Vec<(PathBuf, CheckpointState)>, StageError> {
    let mut out = Vec::new();
    for dir in step_folders(root) {
        if let Some(state) = complete_state(&dir)? {
            out.push((dir, state));
        }
    }
    Ok(out)
}

/// The `step-N` folders under `root`, by step.
fn step_folders(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut steps: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort();
    steps.into_iter().map(|(_, dir)| dir).collect()
}

/// The state of the checkpoint in `dir` if it is complete: its
/// `state.json` is there and every component it names is.
fn complete_state(dir: &Path) -> Result<Option<CheckpointState>, StageError> {
    let path = dir.join("state.json");
    let text = match weir_durable::read_text_capped(&path, weir_durable::SIDE_FILE_BYTES) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => {
            return Err(OperatorError::file(&path, e).into())
        }
        Err(_) => return Ok(None),
    };
    let value: Value = serde_json::from_str(&text).map_err(|e| OperatorError::file(&path, e))?;
    let state = CheckpointState::from_json(&value, &path)?;
    Ok(state
        .components
        .iter()
        .all(|c| dir.join(c).is_dir())
        .then_some(state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_values_hold_the_newest_value_of_each_key() {
        let log = StepValues::new();
        log.record(0, "kl_coef", 0.1);
        log.record(1, "kl_coef", 0.12);
        log.record(1, "other", 3.0);
        log.record(2, "kl_coef", 0.144);
        let at1 = log.after(1);
        assert_eq!(
            at1,
            BTreeMap::from([("kl_coef".into(), 0.12), ("other".into(), 3.0)])
        );
        assert_eq!(log.after(1), at1, "reading again gives the same");
        assert_eq!(log.after(2)["kl_coef"], 0.144);
        assert_eq!(log.after(2)["other"], 3.0);
    }

    #[test]
    fn only_complete_checkpoints_count() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = Checkpointer {
            root: tmp.path().to_path_buf(),
            every: 2,
            last_step: Some(4),
            max_shard_bytes: weir_gpu::snapshot::DEFAULT_MAX_SHARD_BYTES,
        };
        // Every second step and the last; none after the last (the run's commit points).
        assert_eq!(
            (0..6).filter(|s| ck.due(*s)).collect::<Vec<_>>(),
            vec![1, 3, 4]
        );
        assert!(latest(tmp.path()).unwrap().is_none());
        let state = |step| CheckpointState {
            step,
            version: step + 1,
            cursor: Some(Cursor {
                epoch: 1,
                position: 7,
            }),
            seed: 9,
            components: vec!["actor".into()],
            invariants: BTreeMap::from([("data.prompts".into(), "arith".into())]),
            values: BTreeMap::from([("kl_coef".into(), 0.25)]),
        };
        for step in [1, 3] {
            std::fs::create_dir_all(ck.dir(step).join("actor")).unwrap();
            ck.save_state(&state(step)).unwrap();
        }
        // Step 5 crashed before its actor folder was renamed into place.
        std::fs::create_dir_all(ck.dir(5).join(".actor.partial")).unwrap();
        ck.save_state(&state(5)).unwrap();
        let (dir, got) = latest(tmp.path()).unwrap().unwrap();
        assert_eq!(dir, ck.dir(3));
        assert_eq!(got, state(3));

        // Deferred states count only once their commit point is reached.
        let commits = CheckpointCommits::new(ck.clone());
        for step in [7, 9] {
            std::fs::create_dir_all(ck.dir(step).join("actor")).unwrap();
            commits.defer(state(step));
        }
        assert_eq!(latest(tmp.path()).unwrap().unwrap().1, state(3));
        commits.commit(7).unwrap();
        assert_eq!(latest(tmp.path()).unwrap().unwrap().1, state(7));
        commits.commit(7).unwrap();
        commits.commit(8).unwrap();
        assert_eq!(latest(tmp.path()).unwrap().unwrap().1, state(7));
        commits.commit(9).unwrap();
        assert_eq!(latest(tmp.path()).unwrap().unwrap().1, state(9));
    }
}
