//! The flags that make a command one process of a multi-process run
//! (timely's cluster mode): `weir run` and `weir sim` share them.

use std::path::PathBuf;
use std::time::Duration;

use weir_pipelines::placement::Cluster;

/// `--processes`, `--process-id`, `--hostfile`, `--peer-timeout-s`, `--connect-timeout-s`.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct ClusterArgs {
    /// Processes in the run; start each with the same flags and its own --process-id.
    #[arg(long, default_value_t = 1)]
    pub processes: usize,
    /// This process's id, 0..processes.
    #[arg(long = "process-id", default_value_t = 0)]
    pub process_id: usize,
    /// A file of host:port lines, one per process in id order (default: localhost:2101, 2102, …).
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Seconds a silent peer process is tolerated during the run.
    #[arg(long = "peer-timeout-s", default_value_t = 60.0)]
    pub peer_timeout_s: f64,
    /// Seconds start-up waits for every peer process to connect.
    #[arg(long = "connect-timeout-s", default_value_t = 120.0)]
    pub connect_timeout_s: f64,
}

impl Default for ClusterArgs {
    fn default() -> Self {
        ClusterArgs {
            processes: 1,
            process_id: 0,
            hostfile: None,
            peer_timeout_s: 60.0,
            connect_timeout_s: 120.0,
        }
    }
}

impl ClusterArgs {
    /// The cluster these flags describe (the process id is checked by the engine).
    pub fn cluster(&self) -> anyhow::Result<Cluster> {
        let seconds = |flag: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(Duration::from_secs_f64(value))
            } else {
                Err(anyhow::anyhow!(
                    "{flag} {value}: must be a positive number of seconds"
                ))
            }
        };
        Ok(Cluster {
            processes: self.processes,
            process: self.process_id,
            hostfile: self.hostfile.clone(),
            peer_timeout: seconds("--peer-timeout-s", self.peer_timeout_s)?,
            connect_timeout: seconds("--connect-timeout-s", self.connect_timeout_s)?,
        })
    }
}
