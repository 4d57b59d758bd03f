//! The built-in `python` tool: runs the code a model wrote in a fresh
//! interpreter, fenced in.
//!
//! What holds each run in ([`PythonLimits`] sets the numbers):
//! - a fresh temporary folder as its working folder and home, removed
//!   after the run;
//! - an environment of its own: `PATH`, `HOME`, `TMPDIR`, `LANG` and
//!   `PYTHONDONTWRITEBYTECODE` only (none of weir's variables, no cluster
//!   secret), and Python's isolated mode (`-I`: no user site, no `PYTHON*`
//!   variables);
//! - CPU time, address space, file size, open files (and no core dumps)
//!   limited by `setrlimit`; a wall-clock limit after which the whole
//!   process group is killed; every process it started is killed when it
//!   ends, and the kernel kills it if weir dies;
//! - no network where the kernel lets an unprivileged process have a
//!   network namespace of its own (a user namespace with a network
//!   namespace; or a network namespace, as root): only a loopback device
//!   that is down. Whether it does is probed once ([`network_isolated`]);
//! - its output (stdout, then stderr) cut to [`PythonLimits::output_bytes`]
//!   with a marker saying how much was left out.
//!
//! What it does not isolate: the file system. The code reads whatever the
//! user running weir may read and writes wherever that user may write (its
//! files limited in size, not in place). Run weir as a user with little
//! access, or in a container, when the model's code must not see the
//! machine.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The limits of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonLimits {
    /// CPU seconds (the process is stopped past them).
    pub cpu_seconds: u64,
    /// Address space in bytes (an allocation past it raises `MemoryError`).
    pub memory_bytes: u64,
    /// Wall-clock time (the process group is killed past it).
    pub wall: Duration,
    /// Bytes of output kept (stdout and stderr together).
    pub output_bytes: usize,
    /// The largest file the code may write.
    pub file_bytes: u64,
}

impl Default for PythonLimits {
    fn default() -> Self {
        PythonLimits {
            cpu_seconds: 10,
            memory_bytes: 1 << 30,
            wall: Duration::from_secs(20),
            output_bytes: 16 << 10,
            file_bytes: 16 << 20,
        }
    }
}

/// What a run gave the model to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ran {
    /// Its output, cut to the limit, with a line saying how it ended when
    /// not with exit status 0.
    pub text: String,
    /// Whether it exited with status 0 within every limit.
    pub ok: bool,
    /// Whether it was stopped at the wall-clock limit.
    pub timed_out: bool,
}

/// Why the tool could not run the code at all (not the code's own failure).
#[derive(Debug, thiserror::Error)]
#[error("the python tool: {0}")]
pub struct PythonToolError(String);

/// Runs `code` with `interpreter` under `limits`.
pub fn run(interpreter: &str, code: &str, limits: &PythonLimits) -> Result<Ran, PythonToolError> {
    let fail = |what: &str, e: std::io::Error| PythonToolError(format!("{what}: {e}"));
    let executable = executable(interpreter)?;
    let folder = tempfile::Builder::new()
        .prefix("weir-python-")
        .tempdir()
        .map_err(|e| fail("making its temporary folder", e))?;
    std::fs::write(folder.path().join("main.py"), code)
        .map_err(|e| fail("writing the code to its folder", e))?;
    let mut command = Command::new(&executable);
    command
        .args(["-I", "main.py"])
        .current_dir(folder.path())
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", folder.path())
        .env("TMPDIR", folder.path())
        .env("LANG", "C.UTF-8")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    fence(&mut command, limits, network_isolated());
    let mut child = crate::python_worker::spawn_tied(command)
        .map_err(|e| fail(&format!("starting {}", executable.display()), e))?;
    let group = child.id() as i32;
    let cap = limits.output_bytes;
    let stdout = child.stdout.take().map(|out| reader(out, cap));
    let stderr = child.stderr.take().map(|err| reader(err, cap));
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() >= limits.wall => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(fail("waiting for the interpreter", e)),
        }
    };
    // Whatever it started goes with it (and lets go of the pipes).
    // SAFETY: kill only sends a signal to the child's own process group.
    unsafe {
        libc::kill(-group, libc::SIGKILL);
    }
    let status = match status {
        Some(status) => Some(status),
        None => {
            let _ = child.wait();
            None
        }
    };
    // A process that left the group may hold a pipe open: what was read
    // by then is what there is.
    let deadline = Instant::now() + Duration::from_secs(1);
    let joined = |r: Option<mpsc::Receiver<(Vec<u8>, usize)>>| {
        let left = deadline.saturating_duration_since(Instant::now());
        r.and_then(|r| r.recv_timeout(left).ok())
            .unwrap_or_default()
    };
    let (out, out_total) = joined(stdout);
    let (err, err_total) = joined(stderr);
    let mut text = String::new();
    let mut left_out = out_total - out.len() + err_total - err.len();
    text.push_str(&String::from_utf8_lossy(&out));
    let room = cap.saturating_sub(out.len());
    let err_kept = &err[..err.len().min(room)];
    left_out += err.len() - err_kept.len();
    if !err_kept.is_empty() {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&String::from_utf8_lossy(err_kept));
    }
    if left_out > 0 {
        if !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&format!("[… {left_out} more bytes of output not shown]"));
    }
    let timed_out = status.is_none();
    let ending = ending(status, limits);
    let ok = ending.is_none();
    if let Some(ending) = ending {
        if !text.is_empty() && !text.ends_with('\n') {
            text.push('\n');
        }
        text.push_str(&ending);
    }
    Ok(Ran {
        text,
        ok,
        timed_out,
    })
}

/// How a run ended, when not with status 0: a line for the model.
fn ending(status: Option<std::process::ExitStatus>, limits: &PythonLimits) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let Some(status) = status else {
        return Some(format!(
            "[stopped: it ran past the wall-clock limit of {:.1} s]",
            limits.wall.as_secs_f64()
        ));
    };
    match (status.code(), status.signal()) {
        (Some(0), _) => None,
        (Some(code), _) => Some(format!("[exit status {code}]")),
        (None, Some(libc::SIGXCPU)) => Some(format!(
            "[stopped: it used up its CPU time of {} s]",
            limits.cpu_seconds
        )),
        (None, Some(signal)) => Some(format!("[stopped by signal {signal}]")),
        (None, None) => Some("[stopped]".into()),
    }
}

/// Reads `source` to its end, keeping the first `cap` bytes; gives them
/// and how many bytes there were in all.
fn reader(mut source: impl Read + Send + 'static, cap: usize) -> mpsc::Receiver<(Vec<u8>, usize)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut total = 0usize;
        let mut buffer = [0u8; 8192];
        loop {
            match source.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    total += n;
                    let room = cap.saturating_sub(kept.len()).min(n);
                    kept.extend_from_slice(&buffer[..room]);
                }
            }
        }
        let _ = tx.send((kept, total));
    });
    rx
}

/// Adds the limits (and, when `isolate`, a network namespace) to
/// `command`'s start.
fn fence(command: &mut Command, limits: &PythonLimits, isolate: bool) {
    use std::os::unix::process::CommandExt;
    let limits = limits.clone();
    // SAFETY: only async-signal-safe calls (setrlimit, unshare) between fork and exec.
    unsafe {
        command.pre_exec(move || {
            let set = |resource, soft: u64, hard: u64| {
                let limit = libc::rlimit {
                    rlim_cur: soft as libc::rlim_t,
                    rlim_max: hard as libc::rlim_t,
                };
                if libc::setrlimit(resource, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            };
            set(libc::RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1)?;
            set(libc::RLIMIT_AS, limits.memory_bytes, limits.memory_bytes)?;
            set(libc::RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes)?;
            set(libc::RLIMIT_NOFILE, 64, 64)?;
            set(libc::RLIMIT_CORE, 0, 0)?;
            if isolate && !unshare_network() {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Enters a network namespace of its own: with a user namespace first
/// (unprivileged), or alone (as root). True when one took.
fn unshare_network() -> bool {
    // SAFETY: unshare changes only the calling (forked, single-threaded) process.
    unsafe {
        libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) == 0
            || libc::unshare(libc::CLONE_NEWNET) == 0
    }
}

/// Whether this machine lets the tool cut its runs off the network:
/// probed once, by starting `/bin/true` in a network namespace of its own.
pub fn network_isolated() -> bool {
    static PROBED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBED.get_or_init(|| {
        use std::os::unix::process::CommandExt;
        let mut probe = Command::new("/bin/true");
        probe
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only unshare between fork and exec.
        unsafe {
            probe.pre_exec(|| {
                if unshare_network() {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let isolated = probe.status().is_ok_and(|s| s.success());
        if !isolated {
            tracing::warn!(
                "the python tool's runs can reach the network: this machine gives an \
                 unprivileged process no network namespace of its own"
            );
        }
        isolated
    })
}

/// The interpreter's own executable (`sys.executable`), found once per
/// name: a launcher such as pyenv's shim needs the environment the tool's
/// runs do not get.
fn executable(interpreter: &str) -> Result<PathBuf, PythonToolError> {
    static FOUND: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, path)) = found.iter().find(|(name, _)| name == interpreter) {
        return Ok(path.clone());
    }
    let output = Command::new(interpreter)
        .args(["-I", "-c", "import sys; print(sys.executable)"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            PythonToolError(format!(
                "the interpreter {interpreter:?} does not start: {e}"
            ))
        })?;
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || !Path::new(&path).is_file() {
        return Err(PythonToolError(format!(
            "the interpreter {interpreter:?} does not say where its executable is: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    found.push((interpreter.to_string(), path.clone()));
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> PythonLimits {
        PythonLimits {
            cpu_seconds: 2,
            memory_bytes: 512 << 20,
            wall: Duration::from_secs(10),
            output_bytes: 4096,
            file_bytes: 1 << 20,
        }
    }

    fn python(code: &str, limits: &PythonLimits) -> Ran {
        run("python3", code, limits).unwrap()
    }

    #[test]
    fn code_runs_and_its_output_and_errors_come_back() {
        let ran = python("print(2 ** 100)", &limits());
        assert_eq!(
            ran,
            Ran {
                text: "1267650600228229401496703205376\n".into(),
                ok: true,
                timed_out: false,
            }
        );
        let ran = python("print('before')\n1 / 0", &limits());
        assert!(!ran.ok);
        assert!(ran.text.starts_with("before\n"), "{}", ran.text);
        assert!(
            ran.text.contains("ZeroDivisionError") && ran.text.ends_with("[exit status 1]"),
            "{}",
            ran.text
        );
    }

    #[test]
    fn a_fresh_folder_and_an_environment_of_its_own() {
        let code = "import os, json\nprint(json.dumps([os.getcwd(), os.listdir('.'), sorted(os.environ)]))";
        let ran = python(code, &limits());
        let (cwd, files, vars): (String, Vec<String>, Vec<String>) =
            serde_json::from_str(ran.text.trim()).unwrap();
        assert!(cwd.contains("weir-python-"), "{cwd}");
        assert_eq!(files, ["main.py"]);
        let allowed = [
            "HOME",
            "LANG",
            "LC_CTYPE",
            "PATH",
            "PYTHONDONTWRITEBYTECODE",
            "TMPDIR",
        ];
        assert!(
            vars.iter().all(|v| allowed.contains(&v.as_str())),
            "{vars:?}"
        );
        assert!(
            !Path::new(&cwd).exists(),
            "the folder is removed after the run"
        );
    }

    #[test]
    fn cpu_memory_and_wall_clock_limits_stop_the_code() {
        let started = Instant::now();
        let ran = python("while True:\n    pass", &limits());
        assert!(!ran.ok);
        assert!(ran.text.contains("CPU time of 2 s"), "{}", ran.text);
        assert!(
            started.elapsed() < Duration::from_secs(8),
            "{:?}",
            started.elapsed()
        );

        let ran = python("x = bytearray(2 * 1024 ** 3)", &limits());
        assert!(ran.text.contains("MemoryError"), "{}", ran.text);

        let wall = PythonLimits {
            wall: Duration::from_millis(500),
            ..limits()
        };
        let started = Instant::now();
        let ran = python("import time\ntime.sleep(30)", &wall);
        assert!(ran.timed_out && !ran.ok);
        assert!(
            ran.text.contains("wall-clock limit of 0.5 s"),
            "{}",
            ran.text
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn long_output_is_cut_with_a_marker_and_processes_it_started_end_with_it() {
        let ran = python("print('x' * 100000)", &limits());
        assert!(ran.ok);
        assert!(ran.text.len() < 4096 + 100, "{}", ran.text.len());
        assert!(
            ran.text
                .ends_with("[… 95905 more bytes of output not shown]"),
            "{}",
            &ran.text[4000..]
        );

        // A process it leaves behind is killed with its group.
        let code = "import subprocess\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid)";
        let ran = python(code, &limits());
        let pid: i32 = ran.text.trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Gone, or a zombie waiting for its reaper.
        assert!(
            stat.is_empty() || stat.split(' ').nth(2) == Some("Z"),
            "{stat}"
        );
    }

    #[test]
    fn the_network_is_out_of_reach_where_the_machine_allows() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let code = format!(
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('reached')\nexcept OSError as e:\n    print('unreachable', e)"
        );
        let ran = python(&code, &limits());
        let expected = if network_isolated() {
            "unreachable"
        } else {
            "reached"
        };
        eprintln!("network isolation here: {}", network_isolated());
        assert!(ran.text.starts_with(expected), "{}", ran.text);
    }
}
