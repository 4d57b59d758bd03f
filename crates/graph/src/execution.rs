//! Where a pipeline runs (one thread, N threads, N processes) and the
//! settings of a run; connecting to the peers of a cluster.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use timely::communication::Config as CommunicationConfig;

use crate::weights_edge::{InlineTransport, WeightsChannel, WeightsTransport};
use crate::{ClusterSecret, GraphError, Placement, PolicyVersion, Step};

/// How many workers, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Execution {
    /// `n` worker threads in this process (`Threads(1)`: a single thread).
    Threads(usize),
    /// One of several processes (timely cluster mode).
    Cluster {
        /// Worker threads per process.
        threads: usize,
        /// This process's id, `0..hosts.len()`.
        process: usize,
        /// `host:port` of every process, in process-id order.
        hosts: Vec<String>,
    },
}

impl Execution {
    /// A cluster of `processes` processes: addresses from `hostfile` (one
    /// `host:port` per line), or `localhost:2101..` when `None`.
    pub fn cluster(
        threads: usize,
        processes: usize,
        process: usize,
        hostfile: Option<&Path>,
    ) -> Result<Self, GraphError> {
        let hosts: Vec<String> = match hostfile {
            // One process reads no addresses.
            Some(path) if processes > 1 => {
                let text = std::fs::read_to_string(path).map_err(|e| GraphError::io(path, e))?;
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(String::from)
                    .collect()
            }
            _ => (0..processes)
                .map(|i| format!("localhost:{}", 2101 + i))
                .collect(),
        };
        let what = hostfile.map_or_else(|| "the default hosts".into(), |p| p.display().to_string());
        Execution::cluster_on(threads, processes, process, hosts, &what)
    }

    /// A cluster of `processes` processes at `hosts` (`host:port` each, in
    /// process-id order; the first `processes` are taken), which `what`
    /// names in errors (a hostfile, the variables of a launcher).
    pub fn cluster_on(
        threads: usize,
        processes: usize,
        process: usize,
        hosts: Vec<String>,
        what: &str,
    ) -> Result<Self, GraphError> {
        if processes == 0 || threads == 0 {
            return Err(GraphError::Execution(
                "processes and threads must be at least 1".into(),
            ));
        }
        if process >= processes {
            return Err(GraphError::Execution(format!(
                "process id {process} is not below the process count {processes}"
            )));
        }
        if processes == 1 {
            return Ok(Execution::Threads(threads));
        }
        if let Some((i, bad)) = hosts.iter().enumerate().find(|(_, h)| !h.contains(':')) {
            return Err(GraphError::Execution(format!(
                "{what}: line {}: `{bad}` is not host:port",
                i + 1
            )));
        }
        if hosts.len() < processes {
            return Err(GraphError::Execution(format!(
                "{what}: {} addresses for {processes} processes",
                hosts.len()
            )));
        }
        Ok(Execution::Cluster {
            threads,
            process,
            hosts: hosts.into_iter().take(processes).collect(),
        })
    }

    /// Total workers over all processes.
    pub fn total_workers(&self) -> usize {
        match self {
            Execution::Threads(n) => *n,
            Execution::Cluster { threads, hosts, .. } => threads * hosts.len(),
        }
    }

    /// This process's id.
    pub fn process(&self) -> usize {
        match self {
            Execution::Threads(_) => 0,
            Execution::Cluster { process, .. } => *process,
        }
    }

    pub(crate) fn local_workers(&self) -> usize {
        match self {
            Execution::Threads(n) => (*n).max(1),
            Execution::Cluster { threads, .. } => *threads,
        }
    }

    /// This process's host, as the hostfile names it (`None` outside a cluster).
    pub(crate) fn host(&self) -> Option<&str> {
        match self {
            Execution::Threads(_) => None,
            Execution::Cluster { process, hosts, .. } => hosts
                .get(*process)
                .map(|h| h.rsplit_once(':').map_or(h.as_str(), |(host, _)| host)),
        }
    }

    pub(crate) fn processes(&self) -> usize {
        match self {
            Execution::Threads(_) => 1,
            Execution::Cluster { hosts, .. } => hosts.len(),
        }
    }

    /// Whether every process of this execution runs on this machine (each
    /// host is `localhost` or a loopback address; always, for threads).
    pub fn is_local(&self) -> bool {
        let Execution::Cluster { hosts, .. } = self else {
            return true;
        };
        hosts.iter().all(|address| {
            let host = address
                .rsplit_once(':')
                .map_or(address.as_str(), |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        })
    }

    /// The secret a run of this execution proves: `given`, else — for a
    /// cluster whose processes all run on this machine — the run folder's
    /// own ([`ClusterSecret::of_run_folder`]), and none for one process. A
    /// cluster over several machines without one is refused: it would
    /// accept anyone who reaches its ports.
    pub fn cluster_secret(
        &self,
        given: Option<ClusterSecret>,
        run_dir: &Path,
    ) -> Result<Option<ClusterSecret>, GraphError> {
        match (self, given) {
            (Execution::Threads(_), given) => Ok(given),
            (_, Some(secret)) => Ok(Some(secret)),
            (_, None) if self.is_local() => ClusterSecret::of_run_folder(run_dir).map(Some),
            (_, None) => Err(GraphError::Execution(
                "a run over several machines needs a cluster secret: give every process the \
                 same WEIR_CLUSTER_SECRET or --cluster-secret-file"
                    .into(),
            )),
        }
    }
}

/// Everything about a run that is not the pipeline itself.
#[derive(Clone)]
pub struct RunSettings {
    /// Threads and processes.
    pub execution: Execution,
    /// Which workers run which role.
    pub placement: Placement,
    /// k: a generator at step s holds a version ≥ s − k; at most k + 1 steps are in flight.
    pub max_staleness: u64,
    /// Steps to run (`None`: until the source is exhausted).
    pub steps: Option<u64>,
    /// The first step (a resumed run continues its counter).
    pub first_step: Step,
    /// The policy version the generators and the learner start from.
    pub initial_version: PolicyVersion,
    /// How long a silent peer process is tolerated during the run.
    pub peer_timeout: Duration,
    /// How long start-up waits for every peer process to connect (processes
    /// started by a scheduler may come up minutes apart).
    pub connect_timeout: Duration,
    /// Where to write every metric row as Parquet (process of worker 0), if anywhere.
    pub metrics_path: Option<PathBuf>,
    /// How weights cross the weights edge.
    pub transport: Arc<dyn WeightsTransport>,
    /// The largest piece an inline weights payload crosses to another
    /// process in (see [`crate::weights_edge`]).
    pub weights_bucket_bytes: usize,
    /// How an inline weights payload crosses to another process.
    pub weights_channel: WeightsChannel,
    /// The most bytes a weights payload from another process may have: a
    /// peer that announces more is refused before anything is allocated
    /// (default: the machine's memory; a pipeline sets its model's size).
    pub max_weights_bytes: u64,
    /// Called on the metrics worker with each arriving bundle of metric rows
    /// (progress bars, live dashboards).
    pub observer: Option<MetricsObserver>,
    /// Called on the metrics worker with every metric row of a step, once
    /// all have arrived (the metrics frontier has passed the step), in step order.
    pub step_observer: Option<StepObserver>,
    /// Metric rows of earlier segments of a resumed run: kept in the report
    /// and the metrics file ahead of this segment's rows.
    pub prior_metrics: Vec<crate::metrics::MetricRow>,
    /// How often the metrics file is also rewritten between commit points
    /// (for live readers; durability comes from the commit points).
    pub metrics_flush: Duration,
    /// Commit points after every this many steps and at the last (0: at the
    /// last only; `None`: none; see [`crate::commit`]): sinks and the
    /// metrics file are made durable there before [`RunSettings::on_commit`] runs.
    pub commit_every: Option<u64>,
    /// Called once the whole run has passed a commit point.
    pub on_commit: Option<crate::commit::OnCommit>,
    /// What every process of a cluster must agree on, hashed (the caller's
    /// config, say): a peer whose fingerprint differs fails the run at its
    /// first heartbeat instead of running a different pipeline.
    pub fingerprint: u64,
    /// The secret every process of a cluster proves on each of its
    /// connections and in its heartbeats (see [`crate::cluster_secret`]); a
    /// run over several processes without one is refused
    /// ([`Execution::cluster_secret`] finds one).
    pub cluster_secret: Option<crate::ClusterSecret>,
    /// Whether every byte between the processes of a cluster is encrypted
    /// (timely's sockets and the direct weights channel; see
    /// [`crate::sealed`]): every process must choose alike.
    pub encrypt: bool,
}

/// A callback over live metric rows.
pub type MetricsObserver = Arc<dyn Fn(&[crate::metrics::MetricRow]) + Send + Sync>;

/// A callback over the complete metric rows of one step.
pub type StepObserver = Arc<dyn Fn(Step, &[crate::metrics::MetricRow]) + Send + Sync>;

impl RunSettings {
    /// Settings with k = 0, an unbounded number of steps, a 60 s peer
    /// timeout, 120 s to connect, and the inline weights transport.
    pub fn new(execution: Execution, placement: Placement) -> Self {
        RunSettings {
            execution,
            placement,
            max_staleness: 0,
            steps: None,
            first_step: 0,
            initial_version: 0,
            peer_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(120),
            metrics_path: None,
            transport: Arc::new(InlineTransport),
            weights_bucket_bytes: 64 << 20,
            weights_channel: WeightsChannel::default(),
            max_weights_bytes: crate::host::memory_bytes().unwrap_or(64 << 30),
            observer: None,
            step_observer: None,
            prior_metrics: Vec::new(),
            metrics_flush: Duration::from_secs(10),
            commit_every: None,
            on_commit: None,
            fingerprint: 0,
            cluster_secret: None,
            encrypt: false,
        }
    }

    /// Encrypts (or not) every byte between the processes of a cluster.
    pub fn encrypt(mut self, encrypt: bool) -> Self {
        self.encrypt = encrypt;
        self
    }

    /// Sends inline weights to other processes in buckets of at most `bytes`.
    pub fn weights_bucket_bytes(mut self, bytes: usize) -> Self {
        self.weights_bucket_bytes = bytes.max(1);
        self
    }

    /// Refuses weights payloads from other processes of more than `bytes`.
    pub fn max_weights_bytes(mut self, bytes: u64) -> Self {
        self.max_weights_bytes = bytes;
        self
    }

    /// Sends inline weights to other processes over `channel`.
    pub fn weights_channel(mut self, channel: WeightsChannel) -> Self {
        self.weights_channel = channel;
        self
    }

    /// Starts at `first_step` with the generators and learner at `version` (a resumed run).
    pub fn resume_at(mut self, first_step: Step, version: PolicyVersion) -> Self {
        self.first_step = first_step;
        self.initial_version = version;
        self
    }

    /// Calls `observer` with the live metric rows.
    pub fn observe(mut self, observer: MetricsObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Calls `observer` with each step's complete metric rows.
    pub fn observe_steps(mut self, observer: StepObserver) -> Self {
        self.step_observer = Some(observer);
        self
    }

    /// Keeps earlier segments' metric rows (see [`RunSettings::prior_metrics`]).
    pub fn prior_metrics(mut self, rows: Vec<crate::metrics::MetricRow>) -> Self {
        self.prior_metrics = rows;
        self
    }

    /// Sets `max_staleness`.
    pub fn max_staleness(mut self, k: u64) -> Self {
        self.max_staleness = k;
        self
    }

    /// Sets the number of steps.
    pub fn steps(mut self, steps: u64) -> Self {
        self.steps = Some(steps);
        self
    }

    /// Sets the peer timeout.
    pub fn peer_timeout(mut self, timeout: Duration) -> Self {
        self.peer_timeout = timeout;
        self
    }

    /// Sets how long start-up waits for the peers to connect.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the fingerprint every process must share (see [`RunSettings::fingerprint`]).
    pub fn fingerprint(mut self, fingerprint: u64) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// Admits only processes that prove `secret` (see [`crate::cluster_secret`]).
    pub fn cluster_secret(mut self, secret: Option<crate::ClusterSecret>) -> Self {
        self.cluster_secret = secret;
        self
    }

    /// Commits after every `every` steps and the last (0: the last only),
    /// then calls `on_commit` (see [`crate::commit`]).
    pub fn commits(mut self, every: u64, on_commit: crate::commit::OnCommit) -> Self {
        self.commit_every = Some(every);
        self.on_commit = Some(on_commit);
        self
    }

    /// The run's steps as the stages see them ([`crate::WorkerInfo::steps`]).
    pub fn run_steps(&self) -> crate::RunSteps {
        crate::RunSteps {
            first: self.first_step,
            last: self
                .steps
                .and_then(|n| (self.first_step + n).checked_sub(1)),
            max_staleness: self.max_staleness,
            commit_every: self.commit_every,
        }
    }

    /// Where the run commits: [`crate::RunSteps::next_commit`] as the sinks
    /// and the driver hold it (`None`: nowhere).
    pub(crate) fn commit_points(&self) -> Option<crate::commit::NextCommit> {
        let steps = self.run_steps();
        steps.commit_every?;
        Some(std::sync::Arc::new(move |from| steps.next_commit(from)))
    }

    /// Sets where metrics are written.
    pub fn metrics_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.metrics_path = Some(path.into());
        self
    }
}

pub(crate) type Allocators = (
    Vec<timely::communication::allocator::AllocatorBuilder>,
    Box<dyn std::any::Any + Send>,
);

/// Builds timely's allocators. A cluster's processes connect through
/// sockets each authenticated under `secret` (which a cluster must have)
/// with settings `fingerprint` (see [`crate::mesh`]), and sealed when
/// `encrypt` (see [`crate::sealed`]), giving up when peers do not connect
/// within `timeout`; returns the run's random value too (0 for one process).
pub(crate) fn connect(
    execution: &Execution,
    timeout: Duration,
    secret: Option<&ClusterSecret>,
    fingerprint: u64,
    encrypt: bool,
) -> Result<(Allocators, u64), GraphError> {
    use timely::communication::allocator::zero_copy::initialize::initialize_networking_from_sockets;
    use timely::communication::allocator::{AllocatorBuilder, ProcessBuilder};
    let (threads, process, hosts) = match execution {
        Execution::Threads(0 | 1) => {
            let built = CommunicationConfig::Thread.try_build();
            return Ok((built.map_err(GraphError::Runtime)?, 0));
        }
        Execution::Threads(n) => {
            let built = CommunicationConfig::Process(*n).try_build();
            return Ok((built.map_err(GraphError::Runtime)?, 0));
        }
        Execution::Cluster {
            threads,
            process,
            hosts,
        } => (*threads, *process, hosts),
    };
    let secret = secret.ok_or_else(|| {
        GraphError::Execution(
            "a run over several processes needs a cluster secret (RunSettings::cluster_secret)"
                .into(),
        )
    })?;
    let mesh = crate::mesh::connect(hosts, process, secret, fingerprint, encrypt, timeout)?;
    let hooks = timely::communication::Hooks::default();
    let local =
        ProcessBuilder::new_typed_vector(threads, hooks.refill.clone(), hooks.spill.clone());
    let started = if encrypt {
        let sockets = mesh
            .sockets
            .into_iter()
            .map(|pair| {
                pair.map(|(socket, keys)| {
                    crate::sealed::Sealed::new(
                        socket,
                        keys.expect("an encrypting mesh keys each socket"),
                    )
                })
            })
            .collect();
        initialize_networking_from_sockets(local, sockets, process, threads, hooks)
    } else {
        let sockets = mesh
            .sockets
            .into_iter()
            .map(|pair| pair.map(|(socket, _)| socket))
            .collect();
        initialize_networking_from_sockets(local, sockets, process, threads, hooks)
    };
    let (builders, guard) = started
        .map_err(|e| GraphError::Runtime(format!("starting the cluster's network threads: {e}")))?;
    let builders = builders.into_iter().map(AllocatorBuilder::Tcp).collect();
    Ok(((builders, Box::new(guard)), mesh.run))
}
