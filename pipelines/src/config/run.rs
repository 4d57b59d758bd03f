//! `[run]`: how long a run goes and how it keeps itself (steps, the staleness
//! bound, seed, threads, checkpoints): the section, its defaults, its rows
//! of the key table and its checks.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::{ConfigError, DeviceChoice};

/// `[run]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSection {
    /// Steps (policy updates) to run.
    pub steps: u64,
    /// Bounded staleness k.
    pub max_staleness: u64,
    /// Seed of shuffling and sampling.
    pub seed: u64,
    /// libtorch threads per worker.
    pub threads: usize,
    /// Checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoint weights above this size go in shards with an index (`5GB`, `500MB`, `2GiB`).
    pub max_shard_size: String,
    /// Rows per rollout Parquet file.
    pub rows_per_file: usize,
    /// `cpu` or `cuda`.
    pub device: DeviceChoice,
}

impl Default for RunSection {
    fn default() -> Self {
        RunSection {
            steps: 100,
            max_staleness: 1,
            seed: 42,
            threads: 1,
            checkpoint_every: 50,
            max_shard_size: "5GB".into(),
            rows_per_file: 4096,
            device: DeviceChoice::Cpu,
        }
    }
}

/// `[run]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("run", "steps", All, "Steps (policy updates) to run."),
    key("run", "max_staleness", Rl, "Bounded staleness k: rollouts may come from policies up to k versions old (0 = synchronous on-policy)."),
    key("run", "seed", All, "Seed of prompt shuffling and sampling."),
    key("run", "threads", All, "libtorch threads per worker."),
    key("run", "checkpoint_every", All, "Save a checkpoint every N steps (0: only after the last step)."),
    key("run", "max_shard_size", All, "Checkpoint weights larger than this are saved in shards with model.safetensors.index.json, as transformers saves them (\"5GB\", \"500MB\", \"2GiB\")."),
    key("run", "rows_per_file", Rl, "Rollout rows per Parquet file."),
    key("run", "device", All, "\"cpu\" or \"cuda\"."),
];

impl RunSection {
    /// Steps and threads at least 1, a shard size that parses.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if self.steps == 0 {
            return bad("run.steps", "0".into(), "must be at least 1");
        }
        if self.threads == 0 {
            return bad("run.threads", "0".into(), "must be at least 1");
        }
        if weir_gpu::snapshot::parse_size(&self.max_shard_size).is_none() {
            return bad(
                "run.max_shard_size",
                format!("{:?}", self.max_shard_size),
                "a size such as \"5GB\", \"500MB\" or \"2GiB\"",
            );
        }
        Ok(())
    }
}
