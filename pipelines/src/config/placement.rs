//! `[placement]`: which workers run which roles, and how the learner's
//! weights cross between processes: the section, its defaults, its rows of
//! the key table and its checks.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::{ConfigError, ReferencePlacement, TeacherPlacement, WeightsChannelChoice};

/// `[placement]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementSection {
    /// Engine workers (threads; one per GPU on a GPU machine).
    pub workers: usize,
    /// Workers that generate and score.
    pub rollout: Vec<usize>,
    /// Workers that run the critic, advantage and learner (several: data-parallel learner ranks).
    pub train: Vec<usize>,
    /// Where the reference runs: `train` or `rollout` (beside the generator).
    pub reference: ReferencePlacement,
    /// How the learner's weights cross to another process.
    pub weights_channel: WeightsChannelChoice,
    /// The port the direct channel's server listens on (0: any free one).
    pub weights_port: u16,
    /// The largest bucket, in MiB, the learner's weights cross to another
    /// process in over timely's channel.
    pub weights_bucket_mib: usize,
    /// Encrypt every byte between the processes of a cluster.
    pub encrypt: bool,
    /// Where the distillation teacher runs: `train`, `rollout` or workers of its own.
    pub teacher: TeacherPlacement,
    /// Shard the trainers' optimizer state over the data-parallel ranks (ZeRO stages 1 and 2).
    pub shard_optimizer: bool,
    /// Workers the judge reward runs on (empty: the rollout workers).
    pub judge: Vec<usize>,
}

impl Default for PlacementSection {
    fn default() -> Self {
        PlacementSection {
            workers: 2,
            rollout: vec![0],
            train: vec![1],
            reference: ReferencePlacement::Train,
            weights_channel: WeightsChannelChoice::Direct,
            weights_port: 0,
            weights_bucket_mib: 64,
            encrypt: false,
            teacher: TeacherPlacement::At(ReferencePlacement::Train),
            shard_optimizer: false,
            judge: Vec::new(),
        }
    }
}

/// `[placement]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("placement", "workers", All, "Engine workers (threads; one per GPU on a GPU machine)."),
    key("placement", "rollout", All, "Workers that generate and score."),
    key("placement", "train", All, "Workers that run the reference, critic, advantage and learner (may equal rollout: colocation). Several workers (in one process or in several) train as data-parallel ranks of one learner, each on its share of every step's rows, their gradients summed before each optimizer step (whitening, the in-reward KL and GPG's α over the whole step); dynamic sampling needs one train worker."),
    key("placement", "weights_channel", Rl, "How the learner's weights cross to another process (once per process, while generation goes on): \"direct\" (a TCP connection of their own from the learner's process, straight into the receiving process's memory: the kernel's two copies; proves the cluster secret when there is one) or \"timely\" (in buckets on timely's own connections, for networks where only the hostfile's ports are open: two more copies)."),
    key("placement", "weights_port", Rl, "The port on which a learner's process serves its weights over the direct channel, on its hostfile host (0: any free port; the receivers learn it from the weights edge)."),
    key("placement", "weights_bucket_mib", Rl, "The largest piece, in MiB, in which the learner's weights cross to another process over timely's channel (the buckets travel while generation goes on)."),
    key("placement", "encrypt", All, "Encrypt every byte the processes of a multi-process run exchange (rows and control on timely's connections, weights on the direct channel) with AES-256-GCM, under keys each connection derives from the cluster secret and an X25519 exchange of its own (see docs/security.md for what it costs); every process must set it alike. No effect in one process."),
    key("placement", "shard_optimizer", All, "Shard the trainers' optimizer state over the data-parallel ranks of placement.train (ZeRO stages 1 and 2): each rank keeps the AdamW moments (and float32 master weights) of its run of whole parameters only, about 1/N of them; the ranks' gradients are reduce-scattered (each keeps the sums of its own, the rest are freed), each updates its parameters, and they are all-gathered. The weights equal the unsharded ranks' to the bit. Checkpoints then hold one optimizer file per rank (optimizer-0000r-of-0000N.safetensors, written by rank 0 as each arrives) and resume on any rank count, sharded or not. Needs two or more train workers."),
    key("placement", "teacher", Distill, "Where the distillation teacher runs: \"train\" (with the learner, each train worker scoring a share of every batch), \"rollout\" (beside the generator) or a list of workers of its own (e.g. [2, 3]: each scores a share of every batch, by group; a GPU each on a GPU machine; in any process of a cluster)."),
    key("placement", "judge", Rl, "Workers of their own for the judge reward (reward.kind = \"judge\" or a judge term): the reward stages run there, each worker judging a share of every batch by group, while the rollout workers go on generating; empty: the reward stages run on the rollout workers, beside the generator."),
    key("placement", "reference", Rl, "Where the reference model runs: \"train\" (with the learner) or \"rollout\" (beside the generator, to balance a learner-bound step)."),
];

impl PlacementSection {
    /// A bucket and a worker at least, and two train ranks or more to
    /// shard the optimizer over.
    pub(super) fn check_sizes(&self) -> Result<(), ConfigError> {
        let p = self;
        if p.weights_bucket_mib == 0 {
            return bad(
                "placement.weights_bucket_mib",
                "0".into(),
                "must be at least 1",
            );
        }
        if p.workers == 0 {
            return bad("placement.workers", "0".into(), "must be at least 1");
        }
        if p.shard_optimizer && p.train.len() < 2 {
            return bad(
                "placement.shard_optimizer",
                "true".into(),
                &format!(
                    "shards the optimizer state over data-parallel ranks, and placement.train = {:?} is one rank: name two or more train workers, or set it false",
                    p.train
                ),
            );
        }
        Ok(())
    }

    /// The roles' workers: some for the rollout, the train and a teacher
    /// placed on workers of its own, each below `placement.workers`.
    pub(super) fn check_workers(&self) -> Result<(), ConfigError> {
        let p = self;
        let no_teacher = Vec::new();
        let teacher = match &p.teacher {
            TeacherPlacement::Workers(w) => w,
            TeacherPlacement::At(_) => &no_teacher,
        };
        if matches!(p.teacher, TeacherPlacement::Workers(_)) && teacher.is_empty() {
            return bad(
                "placement.teacher",
                "[]".into(),
                "names no worker: name some, or \"train\" or \"rollout\"",
            );
        }
        for (key, set) in [
            ("placement.rollout", &p.rollout),
            ("placement.train", &p.train),
            ("placement.judge", &p.judge),
            ("placement.teacher", teacher),
        ] {
            if set.is_empty() && (key == "placement.rollout" || key == "placement.train") {
                return bad(key, "[]".into(), "needs at least one worker");
            }
            if let Some(w) = set.iter().find(|w| **w >= p.workers) {
                return bad(
                    key,
                    format!("{set:?}"),
                    &format!("worker {w} ≥ placement.workers = {}", p.workers),
                );
            }
        }
        Ok(())
    }
}
