//! Helpers for tests that start several `weir` processes on localhost.

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// `n` TCP ports free at the time of the call.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
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
