//! Where a run stands (`RunContext`) and where its models live: the
//! checkpoint writer, the compute dtype, the device of a worker.

use std::path::{Path, PathBuf};

use tch::Kind;
use weir_gpu::{Device, Model};
use weir_graph::{StageError, WorkerInfo};
use weir_operators::checkpoint::{
    load_optimizer, CheckpointCommits, CheckpointPlan, Checkpointer, StepValues,
};
use weir_operators::data::cursor::{Cursor, CursorLog};
use weir_operators::stages::prompt_stats::StatsView;

use crate::config::DeviceChoice;
use crate::RunConfig;

/// Where a run (or a resumed segment of one) starts, and what its stages share.
#[derive(Clone, Debug)]
pub struct RunContext {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The actor's starting checkpoint (the config's, or a checkpoint's `actor/`).
    pub actor: PathBuf,
    /// The checkpoint folder resumed from (`actor/`, `critic/` with optimizer state), if any.
    pub resumed_from: Option<PathBuf>,
    /// The first step of this segment.
    pub first_step: u64,
    /// The policy version at `first_step`.
    pub version: u64,
    /// The prompt cursor at `first_step`.
    pub cursor: Option<Cursor>,
    /// Cursors as the source draws them (for checkpoints).
    pub cursors: CursorLog,
    /// Per-prompt statistics (curriculum).
    pub stats: StatsView,
    /// The last step of the run.
    pub last_step: u64,
    /// Components of a complete checkpoint.
    pub components: Vec<String>,
    /// Checkpoint states waiting for their commit point.
    pub commits: CheckpointCommits,
    /// Config values a resume must keep, stored in every checkpoint.
    pub invariants: std::collections::BTreeMap<String, String>,
    /// What stages carry from step to step, for checkpoints.
    pub values: StepValues,
    /// Those values as the checkpoint resumed from stored them.
    pub resumed_values: std::collections::BTreeMap<String, f64>,
    /// The logged groups replayed in place of generated ones (`data.rollouts`).
    pub replay: Option<std::sync::Arc<weir_operators::data::from_log::LoggedGroups>>,
}

impl RunContext {
    /// The checkpoint writer of this run.
    pub fn checkpointer(&self, cfg: &RunConfig) -> Checkpointer {
        checkpointer(cfg, &self.run_dir)
    }

    /// Restores `optimizer` from the `component` (`actor`, `critic`) of the
    /// checkpoint this segment resumed from; nothing on a fresh run.
    pub fn restore_optimizer(
        &self,
        component: &str,
        optimizer: &mut weir_gpu::optim::Optimizer,
    ) -> Result<(), StageError> {
        match &self.resumed_from {
            Some(dir) => load_optimizer(&dir.join(component), optimizer),
            None => Ok(()),
        }
    }

    /// What trainers save, when, with the run state.
    pub fn checkpoint_plan(&self, cfg: &RunConfig) -> CheckpointPlan {
        CheckpointPlan {
            checkpointer: self.checkpointer(cfg),
            cursors: Some(self.cursors.clone()),
            seed: cfg.run.seed,
            components: self.components.clone(),
            commits: Some(self.commits.clone()),
            invariants: self.invariants.clone(),
            values: Some(self.values.clone()),
        }
    }
}

/// The checkpoint writer of a run of `cfg` in `run_dir`.
pub fn checkpointer(cfg: &RunConfig, run_dir: &Path) -> Checkpointer {
    Checkpointer {
        root: run_dir.join("checkpoints"),
        every: cfg.run.checkpoint_every,
        last_step: Some(cfg.run.steps - 1),
        max_shard_bytes: weir_gpu::snapshot::parse_size(&cfg.run.max_shard_size)
            .unwrap_or(weir_gpu::snapshot::DEFAULT_MAX_SHARD_BYTES),
    }
}

/// The compute dtype named by `model.dtype`.
pub fn kind(cfg: &RunConfig) -> Kind {
    cfg.model.dtype.kind()
}

/// The device of `worker`: the CPU, or CUDA device `index mod count`.
pub fn device(cfg: &RunConfig, worker: &WorkerInfo) -> Result<Device, StageError> {
    if cfg.run.device == DeviceChoice::Cpu {
        return Ok(Device::Cpu);
    }
    let count = Device::cuda_count();
    if count == 0 {
        return Err("run.device = \"cuda\", but libtorch sees no CUDA device".into());
    }
    Ok(Device::Cuda(worker.index % count))
}

/// Loads `dir` on `worker`'s device in the config's dtype (a PEFT adapter
/// folder loads as its base with the adapters).
pub fn load(cfg: &RunConfig, dir: &Path, worker: &WorkerInfo) -> Result<Model, StageError> {
    Ok(Model::load(dir, device(cfg, worker)?, kind(cfg))?)
}

/// The policy a role trains or samples from, starting at `dir` (the
/// actor's checkpoint, or `model.path`). With `[lora]`: the frozen weights
/// of `model.path`, shared with the other frozen models on this device,
/// plus adapters (drawn from `run.seed`: every role and rank starts equal),
/// loaded from `dir` when it is an adapter folder (a resumed run).
pub fn load_policy(cfg: &RunConfig, dir: &Path, worker: &WorkerInfo) -> Result<Model, StageError> {
    let adapter_folder = dir.join(weir_gpu::lora::ADAPTER_CONFIG).is_file();
    let Some(adapters) = cfg.lora.adapters() else {
        if adapter_folder {
            return Err(format!(
                "{} holds LoRA adapters: set its [lora] section to train on, or `weir merge` it into a plain checkpoint first",
                dir.display()
            )
            .into());
        }
        return load(cfg, dir, worker);
    };
    if !adapter_folder && dir != Path::new(&cfg.model.path) {
        return Err(format!(
            "{} holds full weights, not LoRA adapters: resume it without [lora]",
            dir.display()
        )
        .into());
    }
    let base = Path::new(&cfg.model.path);
    let mut model = Model::load_shared(base, device(cfg, worker)?, kind(cfg))?;
    model.add_lora(&adapters, cfg.run.seed)?;
    if adapter_folder {
        let (saved, _) = weir_gpu::lora::LoraConfig::read_peft(dir)?;
        if saved != adapters {
            return Err(format!(
                "{}: the checkpoint's adapters (rank {}, alpha {}, {:?}) differ from [lora] (rank {}, alpha {}, {:?})",
                dir.display(),
                saved.rank,
                saved.alpha,
                saved.target_modules,
                adapters.rank,
                adapters.alpha,
                adapters.target_modules
            )
            .into());
        }
        model.load_adapter_weights(dir)?;
    }
    Ok(model)
}

/// A model that never trains (the reference): one copy of `dir`'s weights
/// per device, shared by every role that loads it this way (with `[lora]`,
/// the policy's own frozen weights when `dir` is `model.path`).
pub fn load_frozen(cfg: &RunConfig, dir: &Path, worker: &WorkerInfo) -> Result<Model, StageError> {
    Ok(Model::load_shared(dir, device(cfg, worker)?, kind(cfg))?)
}
