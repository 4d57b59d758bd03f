//! A long-lived Python worker process speaking JSON lines over a pipe:
//! what runs a user's Python reward function (`rewards::python`) and a
//! Python environment (`agent::python_env`); weir never links Python.
//!
//! A worker runs in a process group of its own, without the cluster secret
//! in its environment; ending it ends the group (whatever it started
//! itself), and the kernel ends it if weir's process dies
//! (`PR_SET_PDEATHSIG`). Requests are written by a thread of the worker's
//! own, so a worker that stops reading costs its timeout, not a hang.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// What every worker's script begins with: the protocol's descriptors,
/// `send`, the user's file (`path`, argv 1) and its loading, and how a
/// failure in it is named (`last_line`, `where`).
const PRELUDE: &str = include_str!("python_prelude.py");

/// Why a request got no answer.
pub(crate) enum Lost {
    /// The worker ended (with what it last wrote to stderr).
    Died(String),
    /// No answer within the timeout.
    TimedOut,
}

/// One worker process.
pub(crate) struct Worker {
    child: Child,
    /// Lines to its input, written by a thread of their own.
    requests: mpsc::Sender<String>,
    answers: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
}

impl Worker {
    /// Starts `python` (named by the config key `key` in errors) on the
    /// driver `script` after the prelude, with `args` (the user's file first), and waits for its first line, which
    /// must be `{"ready": true}` (or `{"error": …}`, saying why not),
    /// allowing `timeout`, and a minute at least: loading may import big
    /// libraries.
    pub(crate) fn start(
        python: &str,
        key: &str,
        script: &str,
        args: &[&std::ffi::OsStr],
        timeout: Duration,
    ) -> Result<Worker, String> {
        let mut command = Command::new(python);
        command
            .arg("-u")
            .arg("-c")
            .arg(format!("{PRELUDE}\n{script}"))
            .args(args)
            .env_clear()
            .envs(worker_env(std::env::vars_os()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child =
            spawn_tied(command).map_err(|e| format!("cannot start `{python}` ({key}): {e}"))?;
        let mut stdin = child.stdin.take().expect("piped");
        let (requests, lines) = mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("weir:py-requests".into())
            .spawn(move || {
                for line in lines {
                    if stdin.write_all(line.as_bytes()).is_err() || stdin.flush().is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let stdout = child.stdout.take().expect("piped");
        let stderr_pipe = child.stderr.take().expect("piped");
        let (tx, answers) = mpsc::channel();
        std::thread::Builder::new()
            .name("weir:py-answers".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let tail = stderr.clone();
        std::thread::Builder::new()
            .name("weir:py-stderr".into())
            .spawn(move || {
                for line in BufReader::new(stderr_pipe).lines() {
                    let Ok(line) = line else { break };
                    tracing::debug!(target: "weir::python_worker", "{line}");
                    let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                    tail.push_back(line);
                    if tail.len() > 20 {
                        tail.pop_front();
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let mut worker = Worker {
            child,
            requests,
            answers,
            stderr,
        };
        match worker.answer(timeout.max(Duration::from_secs(60))) {
            Ok(v) if v["ready"] == true => Ok(worker),
            Ok(v) => Err(v["error"]
                .as_str()
                .map_or_else(|| format!("an unexpected first line: {v}"), String::from)),
            Err(Lost::Died(why)) => Err(format!("the worker ended while loading it{why}")),
            Err(Lost::TimedOut) => Err("loading it took more than a minute".into()),
        }
    }

    /// The next answer line, parsed.
    pub(crate) fn answer(&mut self, timeout: Duration) -> Result<Value, Lost> {
        match self.answers.recv_timeout(timeout) {
            Ok(line) => serde_json::from_str(&line).map_err(|e| {
                Lost::Died(format!(
                    ": it wrote a line that is not weir's protocol ({e}): {line}"
                ))
            }),
            Err(RecvTimeoutError::Timeout) => Err(Lost::TimedOut),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                let tail = self.stderr.lock().unwrap_or_else(|e| e.into_inner());
                let last = tail.back().map(|l| format!(": {l}")).unwrap_or_default();
                Err(Lost::Died(format!(" ({status}){last}")))
            }
        }
    }

    /// Sends `request` and waits for its answer.
    pub(crate) fn call(&mut self, request: &Value, timeout: Duration) -> Result<Value, Lost> {
        if self.requests.send(format!("{request}\n")).is_err() {
            // Its input broke: the worker ended (or closed it).
            return match self.answer(Duration::from_millis(200)) {
                Err(lost) => Err(lost),
                Ok(_) => Err(Lost::Died(" (its input closed)".into())),
            };
        }
        self.answer(timeout)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // The worker's group: the worker and whatever it started.
        if let Ok(group) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: a signal to the process group the worker leads.
            unsafe {
                libc::kill(-group, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment a worker starts with: this process's, less the cluster
/// secret (the user's function has no business with it).
pub(crate) fn worker_env(
    vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    vars.filter(|(name, _)| name != weir_graph::cluster_secret::ENV_VAR)
        .collect()
}

/// Starts `command` as the leader of a process group of its own, which the
/// kernel kills when this process ends. `PR_SET_PDEATHSIG` fires when the
/// *thread* that forked the child ends, so every fork happens on one thread
/// that lives as long as the process, never on a step's short-lived one.
pub(crate) fn spawn_tied(mut command: Command) -> std::io::Result<Child> {
    tie(&mut command);
    spawn_on_spawner(command)
}

/// Makes `command`'s child the leader of a process group of its own that
/// the kernel kills when this process ends. Its `pre_exec` runs before any
/// registered after it (the python tool's sandbox forks in its own).
pub(crate) fn tie(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    command.process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // weir ended before the request above took hold.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// Spawns `command` on the one long-lived thread that starts every child
/// (see [`spawn_tied`]); `command` should be [`tie`]d.
pub(crate) fn spawn_on_spawner(command: Command) -> std::io::Result<Child> {
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: std::sync::OnceLock<Option<Mutex<mpsc::Sender<Job>>>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("weir:py-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .ok()
            .map(|_| Mutex::new(tx))
    });
    let Some(spawner) = spawner else {
        return Err(std::io::Error::other(
            "the thread that starts workers could not start",
        ));
    };
    let (reply, child) = mpsc::channel();
    let sent = spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((command, reply));
    match sent.ok().and_then(|()| child.recv().ok()) {
        Some(child) => child,
        None => Err(std::io::Error::other(
            "the thread that starts workers has ended",
        )),
    }
}
