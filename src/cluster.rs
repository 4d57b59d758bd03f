//! The flags that make a command one process of a multi-process run
//! (timely's cluster mode): `weir run` and `weir sim` share them. Where a
//! launcher started the process (Slurm, torchrun, a Kubernetes indexed
//! Job), its environment supplies what the flags leave out
//! ([`crate::launch`]).

use std::path::PathBuf;
use std::time::Duration;

use weir_graph::ClusterSecret;
use weir_pipelines::placement::Cluster;

/// `--processes`, `--process-id`, `--hostfile`, `--peer-timeout-s`,
/// `--connect-timeout-s`, `--cluster-secret-file`.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct ClusterArgs {
    /// Processes in the run; start each with the same flags and its own
    /// --process-id (default: the launcher's, SLURM_NTASKS or WORLD_SIZE, else 1).
    #[arg(long)]
    pub processes: Option<usize>,
    /// This process's id, 0..processes (default: the launcher's,
    /// SLURM_PROCID, RANK or JOB_COMPLETION_INDEX, else 0).
    #[arg(long = "process-id")]
    pub process_id: Option<usize>,
    /// A file of host:port lines, one per process in id order (default:
    /// the launcher's — SLURM_STEP_NODELIST, WEIR_HOSTS, WEIR_HOST_PATTERN,
    /// MASTER_ADDR on one node — else localhost:2101, 2102, …).
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Seconds a silent peer process is tolerated during the run.
    #[arg(long = "peer-timeout-s", default_value_t = 60.0)]
    pub peer_timeout_s: f64,
    /// Seconds start-up waits for every peer process to connect.
    #[arg(long = "connect-timeout-s", default_value_t = 120.0)]
    pub connect_timeout_s: f64,
    /// A file holding the secret every process of the run must share (its
    /// first line; overrides WEIR_CLUSTER_SECRET); a process without it
    /// cannot join. Without either, processes all on this machine share the
    /// run folder's cluster.secret, which the first one writes; across
    /// machines one is required.
    #[arg(long = "cluster-secret-file")]
    pub cluster_secret_file: Option<PathBuf>,
}

/// What the launcher's environment says of this process.
fn launch() -> anyhow::Result<crate::launch::Launch> {
    let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
    crate::launch::Launch::from_vars(&vars).map_err(anyhow::Error::msg)
}

/// The environment variable holding a run's cluster secret.
pub const SECRET_VAR: &str = weir_graph::cluster_secret::ENV_VAR;

impl Default for ClusterArgs {
    fn default() -> Self {
        ClusterArgs {
            processes: None,
            process_id: None,
            hostfile: None,
            peer_timeout_s: 60.0,
            connect_timeout_s: 120.0,
            cluster_secret_file: None,
        }
    }
}

impl ClusterArgs {
    /// The cluster these flags describe, with what the launcher's
    /// environment says where they are silent (the process id is checked
    /// by the engine).
    pub fn cluster(&self) -> anyhow::Result<Cluster> {
        self.cluster_with(launch()?)
    }

    /// This process's id: `--process-id`, else the launcher's, else 0.
    pub fn process(&self) -> anyhow::Result<usize> {
        Ok(self.process_id.or(launch()?.process).unwrap_or(0))
    }

    /// [`ClusterArgs::cluster`] with `launch` for the environment.
    pub fn cluster_with(&self, launch: crate::launch::Launch) -> anyhow::Result<Cluster> {
        let processes = self.processes.or(launch.processes).unwrap_or(1);
        let process = self.process_id.or(launch.process).unwrap_or(0);
        let hosts = if self.hostfile.is_some() {
            None
        } else {
            launch.hosts
        };
        if processes > 1 && !launch.source.is_empty() {
            eprintln!(
                "cluster: process {process} of {processes}, from {}",
                launch.source.join(", ")
            );
        }
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
            processes,
            process,
            hostfile: self.hostfile.clone(),
            hosts,
            peer_timeout: seconds("--peer-timeout-s", self.peer_timeout_s)?,
            connect_timeout: seconds("--connect-timeout-s", self.connect_timeout_s)?,
            secret: self.secret()?,
        })
    }

    /// The cluster secret: the first line of `--cluster-secret-file`, else
    /// `WEIR_CLUSTER_SECRET`, else none.
    fn secret(&self) -> anyhow::Result<Option<ClusterSecret>> {
        let text = match &self.cluster_secret_file {
            Some(path) => {
                let text = weir_durable::read_text_capped(path, weir_durable::SIDE_FILE_BYTES)
                    .map_err(|e| {
                        anyhow::anyhow!("--cluster-secret-file {}: {e}", path.display())
                    })?;
                if let Some(mode) = weir_graph::cluster_secret::readable_by_others(path) {
                    tracing::warn!(
                        "--cluster-secret-file {}: readable by other users (mode {mode:o}); \
                         `chmod 600` it",
                        path.display()
                    );
                }
                let line = text.lines().next().unwrap_or("").trim_end().to_string();
                if line.is_empty() {
                    anyhow::bail!(
                        "--cluster-secret-file {}: the first line is empty",
                        path.display()
                    );
                }
                line
            }
            None => match secret_from_environment() {
                Some(Ok(value)) if value.is_empty() => {
                    anyhow::bail!("{SECRET_VAR} is set but empty")
                }
                Some(Ok(value)) => value.clone(),
                None => return Ok(None),
                Some(Err(())) => anyhow::bail!("{SECRET_VAR} is not valid UTF-8"),
            },
        };
        Ok(Some(ClusterSecret::new(text.into_bytes())?))
    }
}

/// `WEIR_CLUSTER_SECRET` as it was when the process started (`Err` if it
/// was not UTF-8), taken out of the environment by [`take_secret_from_environment`].
fn secret_from_environment() -> Option<&'static Result<String, ()>> {
    ENVIRONMENT_SECRET.get().and_then(Option::as_ref)
}

static ENVIRONMENT_SECRET: std::sync::OnceLock<Option<Result<String, ()>>> =
    std::sync::OnceLock::new();

/// Takes `WEIR_CLUSTER_SECRET` out of this process's environment, keeping
/// its value for [`ClusterArgs`] to read: it is removed from the variables
/// that child processes inherit, and its bytes are overwritten where the
/// kernel shows the environment the process started with
/// (`/proc/<pid>/environ`, which a worker running as the same user could
/// otherwise read). Call it first thing in `main`, before any thread starts.
pub fn take_secret_from_environment() {
    ENVIRONMENT_SECRET.get_or_init(|| {
        let value = std::env::var_os(SECRET_VAR)?;
        overwrite_initial_environment(SECRET_VAR);
        // SAFETY: called before any other thread exists (see above).
        unsafe { std::env::remove_var(SECRET_VAR) };
        Some(value.into_string().map_err(|_| ()))
    });
}

/// Overwrites with NULs the values of `name=` in the environment block the
/// process started with (the strings `/proc/<pid>/environ` reads).
fn overwrite_initial_environment(name: &str) {
    extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    let prefix = format!("{name}=");
    // SAFETY: before any thread starts, `environ` is the NUL-terminated
    // array of NUL-terminated strings the process started with; each value
    // is overwritten within its own string's bytes, and the array is left
    // as it was (remove_var takes the entry out afterwards).
    unsafe {
        let mut entry = environ;
        while !entry.is_null() && !(*entry).is_null() {
            let text = std::ffi::CStr::from_ptr(*entry);
            let bytes = text.to_bytes();
            if bytes.starts_with(prefix.as_bytes()) {
                let value = (*entry).add(prefix.len());
                std::ptr::write_bytes(value, 0, bytes.len() - prefix.len());
            }
            entry = entry.add(1);
        }
    }
}
