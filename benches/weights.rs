//! The weights edge between two processes against the wire floor, in one
//! invocation:
//!
//! - **the floor**: this bench and a child process of its own copy the same
//!   number of bytes over a raw loopback TCP connection (the best of three
//!   copies, timed from the first byte written to the receiver's
//!   acknowledgement of the last); floor = bytes ÷ that bandwidth;
//! - **the edge**: `weir sim` as two processes, the learner on process 1 and
//!   the generator on process 0, publishing a payload of that size every
//!   step at k = 0 (one version in flight at a time); its
//!   `weights_transfer_s` is the time from the learner's send until the
//!   payload is whole at the generator's process: the first version's, and
//!   the steady state, the median over the versions after the first two
//!   (whose buffers are still being mapped on both sides). Over each
//!   channel: `direct` (the default: a note on the edge, the payload
//!   fetched over a connection of its own straight into the landing
//!   buffer) and `timely` (64 MiB buckets on timely's connections), each in
//!   clear and encrypted (`--encrypt`, as `placement.encrypt`: AES-256-GCM
//!   frames on every connection).
//!
//! Two sizes: a 24.6M-parameter model's float32 weights (98.4 MB) and a
//! synthetic 1 GiB snapshot. The last line is `weights_edge_vs_floor=<1 GiB
//! steady-state direct edge ÷ floor> timely_vs_floor=<the same over timely's
//! channel> encrypted_vs_clear=<1 GiB direct encrypted ÷ direct in clear>
//! encrypted_timely_vs_clear=<the same over timely's channel>`. `cargo bench
//! --bench weights`; under `cargo test`, 4 MiB in 4 steps check that it works.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use weir::graph::metrics::batch_to_rows;
use weir::graph::parquet_log::read_parquet_file;

/// Set in the child that receives the floor's copies: `port bytes copies`.
const RECEIVER: &str = "WEIR_WEIGHTS_BENCH_RECEIVER";
const COPIES: usize = 3;
const CHUNK: usize = 4 << 20;

fn main() {
    if let Ok(spec) = std::env::var(RECEIVER) {
        receive(&spec);
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let sizes: Vec<(&str, usize)> = if full {
        vec![
            ("24.6M model, float32", 24_600_000 * 4),
            ("synthetic 1 GiB", 1 << 30),
        ]
    } else {
        vec![("4 MiB", 4 << 20)]
    };
    let steps = if full { 9 } else { 4 };
    println!(
        "== the weights edge between two processes on this machine, against a raw TCP copy =="
    );
    println!(
        "{:<24} {:>12} {:>9} {:>10} {:>11} {:>9} {:>9} {:>11}",
        "payload",
        "bytes",
        "floor s",
        "floor GB/s",
        "channel",
        "first s",
        "steady s",
        "steady/floor"
    );
    // Steady state ÷ floor of the last size, per channel and encryption.
    let mut last = [[0.0; 2]; 2];
    for (label, bytes) in sizes {
        let floor = tcp_floor(bytes);
        for (i, channel) in ["direct", "timely"].into_iter().enumerate() {
            for (e, encrypt) in [false, true].into_iter().enumerate() {
                let (first, steady) = edge_transfer(bytes, steps, channel, encrypt);
                last[i][e] = steady / floor;
                let name = if encrypt {
                    format!("{channel}+enc")
                } else {
                    channel.to_string()
                };
                println!(
                    "{label:<24} {bytes:>12} {floor:>9.3} {:>10.2} {name:>11} {first:>9.3} {steady:>9.3} {:>11.2}",
                    bytes as f64 / floor / 1e9,
                    last[i][e]
                );
            }
        }
    }
    println!(
        "weights_edge_vs_floor={:.3} timely_vs_floor={:.3} encrypted_vs_clear={:.3} \
         encrypted_timely_vs_clear={:.3}",
        last[0][0],
        last[1][0],
        last[0][1] / last[0][0],
        last[1][1] / last[1][0]
    );
}

/// Seconds to copy `bytes` to another process over loopback TCP (best of [`COPIES`]).
fn tcp_floor(bytes: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let port = listener.local_addr().expect("bound").port();
    let mut child = Command::new(std::env::current_exe().expect("this bench's path"))
        .env(RECEIVER, format!("{port} {bytes} {COPIES}"))
        .stdout(Stdio::null())
        .spawn()
        .expect("the receiving child starts");
    let (mut stream, _) = listener.accept().expect("the child connects");
    stream.set_nodelay(true).expect("nodelay");
    // Distinct pages, written once, as a snapshot would be.
    let payload: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let mut best = f64::INFINITY;
    for _ in 0..COPIES {
        let started = Instant::now();
        for chunk in payload.chunks(CHUNK) {
            stream.write_all(chunk).expect("the copy is sent");
        }
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).expect("the child acknowledges");
        best = best.min(started.elapsed().as_secs_f64());
    }
    assert!(child.wait().expect("the child ends").success());
    best
}

/// The child: receives `copies` copies of `bytes` bytes, acknowledging each.
fn receive(spec: &str) {
    let parts: Vec<usize> = spec
        .split(' ')
        .map(|p| p.parse().expect("a number"))
        .collect();
    let [port, bytes, copies] = parts[..] else {
        panic!("{RECEIVER}: `port bytes copies`, got {spec}")
    };
    let mut stream = TcpStream::connect(("127.0.0.1", port as u16)).expect("the bench listens");
    stream.set_nodelay(true).expect("nodelay");
    let mut buffer = vec![0u8; CHUNK];
    for _ in 0..copies {
        let mut left = bytes;
        while left > 0 {
            let n = stream
                .read(&mut buffer[..left.min(CHUNK)])
                .expect("the copy arrives");
            assert!(n > 0, "the bench closed early");
            left -= n;
        }
        stream.write_all(&[1]).expect("the ack is sent");
    }
}

/// Two free loopback ports, as a hostfile in `dir`.
fn hostfile(dir: &Path) -> std::path::PathBuf {
    let ports: Vec<u16> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a port"))
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().expect("bound").port())
        .collect();
    let path = dir.join("hosts.txt");
    let text: String = ports.iter().map(|p| format!("127.0.0.1:{p}\n")).collect();
    std::fs::write(&path, text).expect("the hostfile is written");
    path
}

/// The first and the steady-state (median after the first two)
/// `weights_transfer_s` of a two-process `weir sim` publishing `bytes` a
/// step over `channel`, encrypted or not.
fn edge_transfer(bytes: usize, steps: u64, channel: &str, encrypt: bool) -> (f64, f64) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let hosts = hostfile(dir.path());
    let spawn = |process: usize| {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["sim", "--workers", "1", "--processes", "2"])
            .args(["--process-id", &process.to_string()])
            .arg("--hostfile")
            .arg(&hosts)
            .args(["--steps", &steps.to_string()])
            .args([
                "--batch-rows",
                "4",
                "--group-size",
                "4",
                "--max-staleness",
                "0",
            ])
            .args(["--gen-ms", "0", "--train-ms", "0"])
            .args(["--weights-bytes", &bytes.to_string()])
            .args(["--weights-channel", channel])
            .args(encrypt.then_some("--encrypt"))
            .arg("--out")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("weir sim starts")
    };
    let (p0, p1) = (spawn(0), spawn(1));
    for (i, p) in [(1, p1), (0, p0)] {
        let out = wait(p, Duration::from_secs(600));
        assert!(
            out.status.success(),
            "weir sim process {i}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut transfers: Vec<(u64, f64)> = read_parquet_file(&dir.path().join("metrics.parquet"))
        .expect("the run's metrics")
        .iter()
        .flat_map(|b| batch_to_rows(b).expect("metric rows"))
        .filter(|r| r.stage == "generate" && r.metric == "weights_transfer_s")
        .map(|r| (r.step, r.value))
        .collect();
    transfers.sort_by_key(|t| t.0);
    assert!(
        transfers.len() >= 3,
        "{} weights versions reached the generator",
        transfers.len()
    );
    let first = transfers[0].1;
    let mut steady: Vec<f64> = transfers[2..].iter().map(|t| t.1).collect();
    steady.sort_by(f64::total_cmp);
    (first, steady[steady.len() / 2])
}

fn wait(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let started = Instant::now();
    while child.try_wait().expect("the child can be polled").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("weir sim did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("the child's output")
}
