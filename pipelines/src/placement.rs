//! How a run spreads over processes and workers: the processes of a run
//! ([`Cluster`]) and the engine's execution for them, the checks on
//! data-parallel trainers, and the prompt cursor of a process that trains
//! but draws no prompts.
//!
//! A run may span several processes (timely's cluster mode): each is
//! started with the same config and its own id, and the run folder must be
//! one that every process sees (a shared filesystem, as checkpoints need on
//! any multi-node trainer). `placement.workers` counts the workers of all
//! processes; process `p` runs workers `p·t .. (p+1)·t` with `t = workers /
//! processes`.

use std::path::PathBuf;
use std::time::Duration;

use weir_graph::{Execution, RunSteps, WorkerInfo};
use weir_operators::data::cursor::CursorLog;

use crate::context::RunContext;
use crate::{PipelineError, PipelineKind, RunConfig, TrainsOn};

/// The processes of a run: one (the default), or several in timely's
/// cluster mode, each started with the same config and its own id.
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    /// Processes in the run.
    pub processes: usize,
    /// This process's id, `0..processes`.
    pub process: usize,
    /// `host:port` of every process, one per line in process-id order
    /// (default: `localhost:2101`, `2102`, …).
    pub hostfile: Option<PathBuf>,
    /// `host:port` of every process, as a launcher's environment gives
    /// them (read when there is no hostfile).
    pub hosts: Option<Vec<String>>,
    /// How long a silent peer is tolerated during the run.
    pub peer_timeout: Duration,
    /// How long start-up waits for every peer to connect.
    pub connect_timeout: Duration,
    /// The secret every process must prove (`WEIR_CLUSTER_SECRET`, `--cluster-secret-file`).
    pub secret: Option<weir_graph::ClusterSecret>,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster {
            processes: 1,
            process: 0,
            hostfile: None,
            hosts: None,
            peer_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(120),
            secret: None,
        }
    }
}

impl Cluster {
    /// Process 0 writes what concerns the whole run (config, metrics, summary).
    pub fn is_leader(&self) -> bool {
        self.process == 0
    }

    /// The engine's execution of this cluster with `threads` workers a
    /// process: its hosts from the hostfile, else the launcher's, else
    /// `localhost:2101…`.
    pub fn execution(&self, threads: usize) -> Result<Execution, weir_graph::GraphError> {
        match (&self.hostfile, &self.hosts) {
            (None, Some(hosts)) => Execution::cluster_on(
                threads,
                self.processes,
                self.process,
                hosts.clone(),
                "the launcher's hosts",
            ),
            (hostfile, _) => {
                Execution::cluster(threads, self.processes, self.process, hostfile.as_deref())
            }
        }
    }

    /// This process's workers when the run has `workers` in all.
    pub(crate) fn local_workers(&self, workers: usize) -> std::ops::Range<usize> {
        let threads = workers / self.processes.max(1);
        self.process * threads..(self.process + 1) * threads
    }
}

/// The engine's execution for `cluster`: `placement.workers` split evenly over the processes.
pub(crate) fn execution(cfg: &RunConfig, cluster: &Cluster) -> Result<Execution, PipelineError> {
    let workers = cfg.placement.workers;
    if cluster.processes == 0 || !workers.is_multiple_of(cluster.processes) {
        return Err(format!(
            "`placement.workers` = {workers} does not split evenly over {} processes \
             (each process runs placement.workers / processes workers)",
            cluster.processes
        )
        .into());
    }
    Ok(cluster.execution(workers / cluster.processes)?)
}

/// The prompt cursors of a process that trains but draws no prompts: derived
/// from where the segment starts, which holds when nothing is skipped;
/// `steps` are the engine's ([`weir_graph::RunSettings::run_steps`]).
pub(crate) fn derived_cursors(
    kind: PipelineKind,
    cfg: &RunConfig,
    ctx: &RunContext,
    cluster: &Cluster,
    steps: RunSteps,
) -> Result<CursorLog, PipelineError> {
    if cfg.curriculum.enabled {
        return Err(format!(
            "`curriculum.enabled`: process {} trains but hosts no `placement.rollout` worker, \
             so it cannot know which prompts the curriculum skipped; place a rollout worker \
             beside the learner, or turn the curriculum off",
            cluster.process
        )
        .into());
    }
    let probe = WorkerInfo {
        process: cluster.process,
        steps,
        ..WorkerInfo::single()
    };
    let source = match kind.trains_on() {
        TrainsOn::Pairs => crate::prompts::preference_pairs(cfg, ctx)(&probe)?,
        TrainsOn::Rollouts | TrainsOn::Targets => crate::prompts::prompts(cfg, ctx, 1)(&probe)?,
    };
    Ok(CursorLog::derived(
        ctx.first_step,
        ctx.cursor.unwrap_or_default(),
        cfg.data.prompts_per_step,
        source.rows().len(),
    ))
}

/// Refuses data-parallel trainers (several `placement.train` workers) where
/// they cannot train like one: dynamic sampling, which fills a step's quota
/// on one worker. Ranks may sit in any processes.
pub(crate) fn check_data_parallel(cfg: &RunConfig) -> Result<(), PipelineError> {
    let train = &cfg.placement.train;
    if train.len() <= 1 {
        return Ok(());
    }
    if cfg.dynamic_sampling.enabled {
        return Err(format!(
            "`placement.train` = {train:?}: dynamic sampling fills a step's quota on one worker; use one train worker with `dynamic_sampling.enabled`"
        )
        .into());
    }
    Ok(())
}
