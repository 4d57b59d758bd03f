//! Helpers for tests that start several `weir` processes on localhost.

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// `n` TCP ports free at the time of the call, never the same twice in
/// this test process. They come from below the range the kernel hands to
/// outgoing connections (`ip_local_port_range`), so no client socket of
/// another test can take one before a process binds it, starting at a
/// place drawn from this process's id, so test processes side by side
/// (nextest runs each test in its own) walk apart.
pub fn free_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<usize>().ok())
        .unwrap_or(32768);
    let (first, span) = (10_000, ephemeral.saturating_sub(10_000).max(1_000));
    let start = std::process::id() as usize * 7_919;
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        let port = (first + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    ports
}

/// Writes `dir/hosts.txt`: two `127.0.0.1:PORT` lines on free ports.
pub fn hostfile(dir: &Path) -> PathBuf {
    let path = dir.join("hosts.txt");
    let lines: Vec<String> = free_ports(2)
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

/// Waits for `child`, killing it and failing the test after `deadline`.
pub fn wait_with_deadline(mut child: Child, deadline: Duration) -> Output {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "process hung for {deadline:?}; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that every process failed with an error containing `needle`, and none panicked.
pub fn assert_all_failed_with(outputs: &[Output], needle: &str) {
    for (i, out) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "process {i} succeeded");
        assert!(err.contains(needle), "process {i}: {err}");
        assert!(!err.contains("panicked"), "process {i}: {err}");
    }
}
