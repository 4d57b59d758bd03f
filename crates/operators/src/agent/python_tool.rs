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
//!   limited by `setrlimit`;
//! - every process it starts, however it starts it (a double fork with
//!   `setsid` included), ends when the interpreter ends, at the wall-clock
//!   limit and when weir ends: the code runs in a PID namespace of its own
//!   whose init is a small supervisor (when the init ends the kernel kills
//!   every process in the namespace), where the kernel gives one (a user
//!   namespace with a PID namespace, unprivileged; or a PID namespace, as
//!   root); elsewhere a supervisor that is the runs' child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`: every orphan of the run is adopted by it)
//!   kills what is left of its descendants. Whether the machine gives PID
//!   and network namespaces is probed once ([`processes_isolated`],
//!   [`network_isolated`]);
//! - at most [`PythonLimits::processes`] processes at once, where the
//!   kernel counts them: a `pids` cgroup of the run's own where weir may
//!   make one (cgroup v1's `pids` hierarchy or a v2 cgroup with `pids`
//!   delegated), and `RLIMIT_NPROC` in a user namespace of its own (which
//!   the kernel counts per namespace, Linux 5.14 and later, for any user
//!   but root). As root without a cgroup nothing counts them: the wall
//!   clock still ends them ([`processes_counted`] says which);
//! - no network: only a loopback device that is down, in a network
//!   namespace of its own. Where the machine gives none the tool refuses
//!   to run unless the user allows the network
//!   (`agent.python_network = "allow"`, [`PythonNetwork::Allow`]), which
//!   also runs the code on weir's network where it could be cut off;
//! - its output (stdout, then stderr) cut to [`PythonLimits::output_bytes`]
//!   with a marker saying how much was left out. The pipes are read until
//!   the wall-clock limit, not until their end: a process that keeps one
//!   open does not hold the call, which returns what was read by then.
//!
//! What it does not isolate: the file system. The code reads whatever the
//! user running weir may read and writes wherever that user may write (its
//! files limited in size, not in place). Run weir as a user with little
//! access, or in a container, when the model's code must not see the
//! machine.

use std::ffi::CString;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The limits of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonLimits {
    /// CPU seconds (the process is stopped past them).
    pub cpu_seconds: u64,
    /// Address space in bytes (an allocation past it raises `MemoryError`).
    pub memory_bytes: u64,
    /// Wall-clock time (every process of the run is killed past it).
    pub wall: Duration,
    /// Bytes of output kept (stdout and stderr together).
    pub output_bytes: usize,
    /// The largest file the code may write.
    pub file_bytes: u64,
    /// Processes the code may have at once, the interpreter included (a
    /// fork past them fails), where the kernel counts them
    /// ([`processes_counted`]).
    pub processes: u64,
}

impl Default for PythonLimits {
    fn default() -> Self {
        PythonLimits {
            cpu_seconds: 10,
            memory_bytes: 1 << 30,
            wall: Duration::from_secs(20),
            output_bytes: 16 << 10,
            file_bytes: 16 << 20,
            processes: 32,
        }
    }
}

/// Whether the tool's runs may reach the network (`agent.python_network`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PythonNetwork {
    /// Cut off, in a network namespace of their own; where the machine
    /// gives none, the tool refuses to run.
    #[default]
    Isolate,
    /// On weir's network, never cut off (said once in the log).
    Allow,
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

/// Why a run may not start on this machine with `network`: one line naming
/// the key that allows it, or `None` when it may.
pub fn refusal(network: PythonNetwork) -> Option<String> {
    (network == PythonNetwork::Isolate && !network_isolated()).then(|| {
        "this machine gives an unprivileged process no network namespace of its own, so the \
         code would reach the network: set agent.python_network = \"allow\" to run it anyway"
            .to_string()
    })
}

/// Runs `code` with `interpreter` under `limits`, on the network only when
/// `network` allows it.
pub fn run(
    interpreter: &str,
    code: &str,
    limits: &PythonLimits,
    network: PythonNetwork,
) -> Result<Ran, PythonToolError> {
    if let Some(why) = refusal(network) {
        return Err(PythonToolError(why));
    }
    let mut flags = namespaces();
    if network == PythonNetwork::Allow {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "the python tool's runs reach the network: agent.python_network = \"allow\""
            )
        });
        flags &= !libc::CLONE_NEWNET;
    }
    let cgroup = Cgroup::make(limits.processes + supervisors(flags));
    run_in(interpreter, code, limits, flags, cgroup)
}

/// [`run`] in the namespaces `flags` names (none: a subreaper supervises
/// the run), counted by `cgroup` when there is one.
fn run_in(
    interpreter: &str,
    code: &str,
    limits: &PythonLimits,
    flags: libc::c_int,
    cgroup: Option<Cgroup>,
) -> Result<Ran, PythonToolError> {
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
    // The tie first: the fence forks, and only the interpreter's branch
    // runs what is registered after it.
    crate::python_worker::tie(&mut command);
    fence(&mut command, limits, flags, cgroup.as_ref())?;
    // Before the start, so that this deadline never comes after the
    // supervisor's own clock would say it has.
    let started = Instant::now();
    let deadline = started + limits.wall;
    let mut child = crate::python_worker::spawn_on_spawner(command)
        .map_err(|e| fail(&format!("starting {}", executable.display()), e))?;
    let supervisor = child.id() as libc::pid_t;
    let cap = limits.output_bytes;
    let mut pipes = [
        Pipe::new(child.stdout.take(), cap),
        Pipe::new(child.stderr.take(), cap),
    ];
    let wait = |child: &mut std::process::Child| {
        child
            .try_wait()
            .map_err(|e| fail("waiting for the interpreter", e))
    };
    let mut status = None;
    while status.is_none() && Instant::now() < deadline {
        read_pipes(
            &mut pipes,
            deadline.min(Instant::now() + Duration::from_millis(5)),
        );
        status = wait(&mut child)?;
    }
    let timed_out = status.is_none();
    if timed_out {
        // The supervisor kills every process of the run when told (a
        // subreaper must outlive what it adopted to find it); SIGKILL to
        // its group if it does not within a second.
        // SAFETY: a signal to the supervisor, our child, not yet reaped.
        unsafe {
            libc::kill(supervisor, libc::SIGUSR1);
        }
        let grace = Instant::now() + Duration::from_secs(1);
        while status.is_none() && Instant::now() < grace {
            read_pipes(
                &mut pipes,
                grace.min(Instant::now() + Duration::from_millis(5)),
            );
            status = wait(&mut child)?;
        }
        if status.is_none() {
            // SAFETY: the supervisor leads the group and is not reaped, so
            // the group's id is still its.
            unsafe {
                libc::kill(-supervisor, libc::SIGKILL);
            }
            let _ = child.wait();
        }
    }
    // Every process of the run has ended, so the pipes end at once; should
    // one not, what was read by the wall-clock limit is what there is.
    let drain = deadline.max(Instant::now()) + Duration::from_millis(100);
    while pipes.iter().any(|p| p.source.is_some()) && Instant::now() < drain {
        read_pipes(&mut pipes, drain);
    }
    // Dropping them closes the read ends: a writer left gets EPIPE.
    let [Pipe {
        kept: out,
        total: out_total,
        ..
    }, Pipe {
        kept: err,
        total: err_total,
        ..
    }] = pipes;
    drop(cgroup);
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
    let ending = ending(if timed_out { None } else { status }, limits);
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

/// One output pipe, read without blocking: its first `cap` bytes and how
/// many there were in all.
struct Pipe {
    /// The read end, until the pipe's end.
    source: Option<Box<dyn ReadFd>>,
    cap: usize,
    kept: Vec<u8>,
    total: usize,
}

/// A pipe's read end.
trait ReadFd: Read + AsRawFd {}
impl<T: Read + AsRawFd> ReadFd for T {}

impl Pipe {
    fn new(source: Option<impl Read + AsRawFd + 'static>, cap: usize) -> Pipe {
        if let Some(source) = &source {
            // SAFETY: fcntl on a descriptor `source` owns.
            unsafe {
                let fd = source.as_raw_fd();
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Pipe {
            source: source.map(|s| Box::new(s) as Box<dyn ReadFd>),
            cap,
            kept: Vec::new(),
            total: 0,
        }
    }

    /// Reads what is there; closes the pipe at its end.
    fn read(&mut self) {
        let Some(source) = &mut self.source else {
            return;
        };
        let mut buffer = [0u8; 8192];
        loop {
            match source.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => {
                    self.total += n;
                    let room = self.cap.saturating_sub(self.kept.len()).min(n);
                    self.kept.extend_from_slice(&buffer[..room]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        self.source = None;
    }
}

/// Waits until one of the open `pipes` has something or `until`, and
/// reads what is there; a pipe at its end is closed.
fn read_pipes(pipes: &mut [Pipe; 2], until: Instant) {
    let mut polled: Vec<libc::pollfd> = pipes
        .iter()
        .filter_map(|p| p.source.as_ref())
        .map(|source| libc::pollfd {
            fd: source.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let wait = until.saturating_duration_since(Instant::now());
    if polled.is_empty() {
        std::thread::sleep(wait);
        return;
    }
    let ms = wait.as_millis().min(1000) as libc::c_int;
    // SAFETY: `polled` is a live array of its length.
    unsafe {
        libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms);
    }
    for pipe in pipes.iter_mut() {
        pipe.read();
    }
}

/// A `pids` cgroup of one run's own, removed after it.
struct Cgroup {
    dir: PathBuf,
    /// Its `cgroup.procs`, which the supervisor joins before it forks.
    procs: CString,
}

impl Cgroup {
    /// One holding `processes` at once, where weir may make one.
    fn make(processes: u64) -> Option<Cgroup> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static RUNS: AtomicU64 = AtomicU64::new(0);
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let name = format!(
            "weir-python-{}-{}",
            std::process::id(),
            RUNS.fetch_add(1, Ordering::Relaxed)
        );
        // cgroup v1's pids hierarchy, else the v2 one (whose parent must
        // delegate `pids` for the child to have pids.max).
        let mut parents = Vec::new();
        for line in own.lines() {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let path = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "pids") {
                parents.insert(0, Path::new("/sys/fs/cgroup/pids").join(path));
            } else if controllers.is_empty() {
                parents.push(Path::new("/sys/fs/cgroup").join(path));
            }
        }
        parents.into_iter().find_map(|parent| {
            let dir = parent.join(&name);
            std::fs::create_dir(&dir).ok()?;
            let cgroup = Cgroup {
                procs: CString::new(
                    dir.join("cgroup.procs")
                        .into_os_string()
                        .into_encoded_bytes(),
                )
                .ok()?,
                dir,
            };
            std::fs::write(cgroup.dir.join("pids.max"), processes.to_string()).ok()?;
            Some(cgroup)
        })
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Its last processes may still be on their way out.
        for _ in 0..200 {
            match std::fs::remove_dir(&self.dir) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => return,
            }
        }
    }
}

/// Whether the machine counts a run's processes against
/// [`PythonLimits::processes`]: a `pids` cgroup weir may make, or a user
/// namespace whose `RLIMIT_NPROC` binds (any user but root).
pub fn processes_counted() -> bool {
    static PROBED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBED.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let counted =
            Cgroup::make(1).is_some() || (!root && namespaces() & libc::CLONE_NEWUSER != 0);
        if !counted {
            tracing::warn!(
                "the python tool's runs are not limited in processes: weir runs as root and \
                 may make no pids cgroup (the wall clock still ends them)"
            );
        }
        counted
    })
}

/// Adds the limits, the namespaces `flags` names, the cgroup and the
/// supervisors to `command`'s start: the child weir starts becomes the
/// supervisor and forks the interpreter (under an init of its own in a
/// PID namespace).
fn fence(
    command: &mut Command,
    limits: &PythonLimits,
    flags: libc::c_int,
    cgroup: Option<&Cgroup>,
) -> Result<(), PythonToolError> {
    use std::os::unix::process::CommandExt;
    let limits = limits.clone();
    let procs = cgroup.map(|c| c.procs.clone());
    // SAFETY: only async-signal-safe calls (raw system calls, no allocation
    // or lock) between fork and exec: the closure's captures are made here.
    unsafe {
        command.pre_exec(move || {
            // Told to end the run, the supervisor finds the signal pending.
            block_sigusr1(true);
            if let Some(procs) = &procs {
                // Before any fork, so that every process of the run counts.
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
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
            set(libc::RLIMIT_CORE, 0, 0)?;
            if flags != 0 && libc::unshare(flags) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let pid_namespace = flags & libc::CLONE_NEWPID != 0;
            if !pid_namespace && libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The init's report of the interpreter's status, and (while its
            // read end is open) the sign that the supervisor lives.
            let mut report = [0; 2];
            if libc::pipe2(report.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let first = libc::fork();
            if first < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if first > 0 {
                libc::close(report[1]);
                supervise(first, report[0], pid_namespace);
            }
            libc::close(report[0]);
            if pid_namespace {
                // The namespace's init: the kernel kills the namespace when
                // it ends, and it ends when the supervisor does.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                let mut alive = libc::pollfd {
                    fd: report[1],
                    events: libc::POLLOUT,
                    revents: 0,
                };
                if libc::poll(&mut alive, 1, 0) < 0 || alive.revents & libc::POLLERR != 0 {
                    libc::_exit(1);
                }
                let interpreter = libc::fork();
                if interpreter < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if interpreter > 0 {
                    init(interpreter, report[1]);
                }
            } else {
                // The supervisor outlives the interpreter; the interpreter
                // must not outlive the supervisor.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            }
            libc::close(report[1]);
            block_sigusr1(false);
            set(libc::RLIMIT_NOFILE, 64, 64)?;
            if flags & libc::CLONE_NEWUSER != 0 {
                // Counted per user namespace (Linux 5.14 and later): the
                // code's processes and its supervisors.
                let most = limits.processes + supervisors(flags);
                set(libc::RLIMIT_NPROC, most, most)?;
            }
            Ok(())
        });
    }
    Ok(())
}

/// The processes of a run that are not the code's: the supervisor, and the
/// init of its PID namespace when it has one.
fn supervisors(flags: libc::c_int) -> u64 {
    if flags & libc::CLONE_NEWPID != 0 {
        2
    } else {
        1
    }
}

/// Blocks (or unblocks) SIGUSR1 for the calling thread.
fn block_sigusr1(block: bool) {
    // SAFETY: sigset operations on a local set; sigprocmask is async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        let how = if block {
            libc::SIG_BLOCK
        } else {
            libc::SIG_UNBLOCK
        };
        libc::sigprocmask(how, &set, std::ptr::null_mut());
    }
}

/// Closes every descriptor but `keep`: a supervisor holds none of the
/// run's pipes (nor the one that tells weir the interpreter started).
fn close_all_but(keep: libc::c_int) {
    // SAFETY: closing descriptors of this (forked, single-threaded) process.
    unsafe {
        let close_range = |first: libc::c_uint, last: libc::c_uint| {
            if first > last {
                return;
            }
            if libc::syscall(libc::SYS_close_range, first, last, 0) != 0 {
                // A kernel before close_range (5.9).
                for fd in first..=last.min(1 << 16) {
                    libc::close(fd as libc::c_int);
                }
            }
        };
        let keep = keep as libc::c_uint;
        if keep > 0 {
            close_range(0, keep - 1);
        }
        close_range(keep + 1, libc::c_uint::MAX);
    }
}

/// The run's init in its PID namespace: reaps what the namespace orphans
/// until the interpreter ends, reports its status on `report` and ends
/// (and with it, by the kernel's hand, every process in the namespace).
fn init(interpreter: libc::pid_t, report: libc::c_int) -> ! {
    close_all_but(report);
    // SAFETY: waitpid, write and _exit, all async-signal-safe.
    unsafe {
        loop {
            let mut status = 0;
            let pid = libc::waitpid(-1, &mut status, 0);
            if pid == interpreter {
                libc::write(report, (&status as *const libc::c_int).cast(), 4);
                libc::_exit(0);
            }
            if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                libc::_exit(1);
            }
        }
    }
}

/// The child weir started: waits for `first` (the namespace's init, or the
/// interpreter itself), for SIGUSR1 (the wall clock) or for weir's end;
/// then kills every process left of the run and ends as the interpreter
/// ended.
fn supervise(first: libc::pid_t, report: libc::c_int, pid_namespace: bool) -> ! {
    close_all_but(report);
    // SAFETY: raw system calls only, on this (forked, single-threaded) process.
    unsafe {
        let parent = libc::getppid();
        if !pid_namespace {
            // weir's end must not kill the subreaper before it has killed
            // what it adopted: it watches for that itself.
            libc::prctl(libc::PR_SET_PDEATHSIG, 0);
            if libc::getppid() != parent {
                libc::_exit(1);
            }
        }
        let mut interpreter_status = None;
        let mut first_done = false;
        loop {
            let mut status = 0;
            let pid = libc::waitpid(-1, &mut status, libc::WNOHANG);
            if pid == first {
                first_done = true;
                if !pid_namespace {
                    interpreter_status = Some(status);
                }
                break;
            }
            if pid > 0 {
                continue; // an orphan it adopted, reaped
            }
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut pending);
            if libc::sigismember(&pending, libc::SIGUSR1) == 1 || libc::getppid() != parent {
                break;
            }
            let pause = libc::timespec {
                tv_sec: 0,
                tv_nsec: 2_000_000,
            };
            libc::nanosleep(&pause, std::ptr::null_mut());
        }
        if !first_done {
            libc::kill(first, libc::SIGKILL);
        }
        if pid_namespace {
            if !first_done {
                libc::waitpid(first, std::ptr::null_mut(), 0);
            }
            let mut status: libc::c_int = 0;
            let got = libc::read(report, (&mut status as *mut libc::c_int).cast(), 4);
            if got == 4 {
                interpreter_status = Some(status);
            }
        } else {
            kill_descendants();
        }
        match interpreter_status {
            Some(status) if libc::WIFEXITED(status) => libc::_exit(libc::WEXITSTATUS(status)),
            Some(status) if libc::WIFSIGNALED(status) => {
                // Ends by the same signal, so weir reads how the
                // interpreter ended.
                let signal = libc::WTERMSIG(status);
                libc::signal(signal, libc::SIG_DFL);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, signal);
                libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                libc::raise(signal);
                libc::_exit(128 + signal)
            }
            _ => {
                libc::raise(libc::SIGKILL);
                libc::_exit(137)
            }
        }
    }
}

/// Kills every descendant of this subreaper: its children as the kernel
/// lists them, again and again as their orphans are handed to it, until
/// it has none.
fn kill_descendants() {
    // SAFETY: raw system calls only; the path is a literal.
    unsafe {
        for _ in 0..100_000 {
            let fd = libc::open(
                c"/proc/thread-self/children".as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            );
            if fd >= 0 {
                let mut buffer = [0u8; 4096];
                let n = libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len());
                libc::close(fd);
                let mut pid: libc::pid_t = 0;
                for &byte in &buffer[..n.max(0) as usize] {
                    if byte.is_ascii_digit() {
                        pid = pid * 10 + (byte - b'0') as libc::pid_t;
                    } else if pid > 0 {
                        libc::kill(pid, libc::SIGKILL);
                        pid = 0;
                    }
                }
                if pid > 0 {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            // Reap what died; none left to wait for is the end.
            loop {
                let reaped = libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG);
                if reaped < 0 {
                    return;
                }
                if reaped == 0 {
                    break;
                }
            }
            let pause = libc::timespec {
                tv_sec: 0,
                tv_nsec: 200_000,
            };
            libc::nanosleep(&pause, std::ptr::null_mut());
        }
    }
}

/// The namespaces a run gets (`CLONE_NEW*` flags): a user namespace
/// (unprivileged, or whenever one is to be had) with a PID and a network
/// namespace where the kernel gives them, probed once by starting
/// `/bin/true` in each combination, best first.
fn namespaces() -> libc::c_int {
    static PROBED: std::sync::OnceLock<libc::c_int> = std::sync::OnceLock::new();
    *PROBED.get_or_init(|| {
        use libc::{CLONE_NEWNET as NET, CLONE_NEWPID as PID, CLONE_NEWUSER as USER};
        let tries = [
            USER | PID | NET,
            PID | NET,
            USER | NET,
            NET,
            USER | PID,
            PID,
        ];
        let flags = tries.into_iter().find(|&flags| probe(flags)).unwrap_or(0);
        if flags & NET == 0 {
            tracing::warn!(
                "this machine gives the python tool's runs no network namespace of their own: \
                 the tool refuses to run unless agent.python_network = \"allow\""
            );
        }
        if flags & PID == 0 {
            tracing::warn!(
                "this machine gives the python tool's runs no PID namespace of their own: a \
                 subreaper kills what they leave behind"
            );
        }
        flags
    })
}

/// Whether `/bin/true` starts in new namespaces `flags`.
fn probe(flags: libc::c_int) -> bool {
    use std::os::unix::process::CommandExt;
    let mut probe = Command::new("/bin/true");
    probe
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only unshare between fork and exec.
    unsafe {
        probe.pre_exec(move || {
            if libc::unshare(flags) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    probe.status().is_ok_and(|s| s.success())
}

/// Whether this machine lets the tool cut its runs off the network (a
/// network namespace of their own).
pub fn network_isolated() -> bool {
    namespaces() & libc::CLONE_NEWNET != 0
}

/// Whether this machine gives the tool's runs a PID namespace of their own
/// (else a subreaper ends what they leave behind).
pub fn processes_isolated() -> bool {
    namespaces() & libc::CLONE_NEWPID != 0
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
            processes: 16,
        }
    }

    /// The network as this machine allows: isolated where it can be.
    fn network() -> PythonNetwork {
        if network_isolated() {
            PythonNetwork::Isolate
        } else {
            PythonNetwork::Allow
        }
    }

    fn python(code: &str, limits: &PythonLimits) -> Ran {
        run("python3", code, limits, network()).unwrap()
    }

    /// The run as this machine gives it (namespaces where it can), and
    /// under a subreaper alone, as on a machine without namespaces.
    fn both(code: &dyn Fn(&str) -> String, limits: &PythonLimits) -> Vec<(String, Ran, PathBuf)> {
        let dir = tempfile::tempdir().unwrap().keep();
        ["namespaces", "subreaper"]
            .into_iter()
            .map(|how| {
                let file = dir.join(how);
                let code = code(file.to_str().unwrap());
                let ran = match how {
                    "namespaces" => python(&code, limits),
                    _ => run_in(
                        "python3",
                        &code,
                        limits,
                        0,
                        Cgroup::make(limits.processes + 1),
                    )
                    .unwrap(),
                };
                (how.to_string(), ran, file)
            })
            .collect()
    }

    /// That whatever appended to `file` no longer does (and once did).
    fn stopped_growing(file: &Path, how: &str) {
        std::thread::sleep(Duration::from_millis(100));
        let before = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
        std::thread::sleep(Duration::from_millis(500));
        let after = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
        assert!(before > 0, "{how}: nothing wrote to {file:?}");
        assert_eq!(before, after, "{how}: a process of the run still writes");
    }

    /// A Python statement that appends to the file at `path` every 20 ms,
    /// for 20 s at most (so that a process that escapes still ends).
    fn appends(path: &str) -> String {
        let body = format!(
            "import time\nfor _ in range(1000):\n    with open({path:?}, 'a') as f:\n        f.write('x')\n    time.sleep(0.02)"
        );
        format!("exec({body:?})")
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

        // A process it leaves behind ends with it.
        let code = |path: &str| {
            format!(
                "import os, time\nif os.fork() == 0:\n    try:\n        {}\n    finally:\n        os._exit(0)\ntime.sleep(0.3)\nprint('done')",
                appends(path)
            )
        };
        for (how, ran, file) in both(&code, &limits()) {
            assert!(ran.ok && ran.text == "done\n", "{how}: {}", ran.text);
            stopped_growing(&file, &how);
        }
    }

    #[test]
    fn a_fork_bomb_is_held_to_the_process_limit_and_ends_at_the_deadline() {
        let limits = PythonLimits {
            wall: Duration::from_secs(2),
            processes: 8,
            ..limits()
        };
        // Forks 200 children that each append to the file, then waits.
        let code = |path: &str| {
            format!(
                "import os, time\nforked = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        try:\n            {}\n        finally:\n            os._exit(0)\n    forked += 1\nprint(forked, flush=True)\ntime.sleep(60)",
                appends(path)
            )
        };
        for (how, ran, file) in both(&code, &limits) {
            let counted = match how.as_str() {
                "namespaces" => processes_counted(),
                _ => Cgroup::make(1).is_some(),
            };
            let forked: u64 = ran.text.lines().next().unwrap_or("").parse().unwrap_or(0);
            assert!(ran.timed_out, "{how}: {}", ran.text);
            assert!(forked > 0, "{how}: {}", ran.text);
            if counted {
                // The interpreter and its children, within the limit.
                assert!(forked < limits.processes, "{how}: {forked} forks succeeded");
            } else {
                eprintln!("{how}: this machine does not count processes; {forked} forks");
            }
            stopped_growing(&file, &how);
        }
    }

    #[test]
    fn a_process_that_escapes_with_setsid_ends_at_the_deadline() {
        let limits = PythonLimits {
            wall: Duration::from_secs(1),
            ..limits()
        };
        // A double fork with setsid: a session and a group of its own, an
        // orphan, none of the run's pipes open.
        let code = |path: &str| {
            format!(
                "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        null = os.open('/dev/null', os.O_WRONLY)\n        os.dup2(null, 1)\n        os.dup2(null, 2)\n        try:\n            {}\n        finally:\n            os._exit(0)\n    os._exit(0)\ntime.sleep(60)",
                appends(path)
            )
        };
        for (how, ran, file) in both(&code, &limits) {
            assert!(ran.timed_out, "{how}: {}", ran.text);
            stopped_growing(&file, &how);
        }
    }

    #[test]
    fn a_process_holding_the_output_open_does_not_hold_the_call() {
        let limits = PythonLimits {
            wall: Duration::from_secs(2),
            ..limits()
        };
        // An escapee that keeps stdout and stderr open and sleeps, after
        // the code printed; the code ends, or runs past its deadline.
        for (ends, tail) in [(true, ""), (false, "time.sleep(60)\n")] {
            let code = |_: &str| {
                format!(
                    "import os, time\nprint('before', flush=True)\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\nos.wait()\nprint('after', flush=True)\n{tail}"
                )
            };
            let started = Instant::now();
            for (how, ran, _) in both(&code, &limits) {
                assert!(
                    ran.text.starts_with("before\nafter\n"),
                    "{how}: {:?}",
                    ran.text
                );
                assert_eq!(ran.ok, ends, "{how}: {}", ran.text);
                assert_eq!(ran.timed_out, !ends, "{how}: {}", ran.text);
            }
            // Two runs, each within its deadline and a little.
            assert!(
                started.elapsed() < 2 * (limits.wall + Duration::from_millis(500)),
                "{:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn the_network_is_out_of_reach_unless_allowed_and_refused_where_it_cannot_be() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let code = format!(
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('reached')\nexcept OSError as e:\n    print('unreachable', e)"
        );
        eprintln!("network isolation here: {}", network_isolated());
        match run("python3", &code, &limits(), PythonNetwork::Isolate) {
            Ok(ran) => {
                assert!(network_isolated(), "ran unisolated: {}", ran.text);
                assert!(ran.text.starts_with("unreachable"), "{}", ran.text);
            }
            Err(e) => {
                assert!(!network_isolated(), "{e}");
                let e = e.to_string();
                assert!(
                    e.contains("agent.python_network = \"allow\"") && !e.contains('\n'),
                    "{e}"
                );
            }
        }
        let ran = run("python3", &code, &limits(), PythonNetwork::Allow).unwrap();
        assert!(ran.text.starts_with("reached"), "{}", ran.text);
    }
}
