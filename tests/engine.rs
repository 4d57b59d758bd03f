//! The engine's guarantees, end to end, through the engine simulation:
//! staleness ≤ k, strict on-policy at k = 0, at most k + 1 steps in flight,
//! every row exactly once, identical rows across 1 thread and 2 processes,
//! and failures (a failing stage, a killed peer) that end the run with an
//! error instead of a hang. In one process, 4 threads, and 2 processes.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use arrow::array::AsArray;
use arrow::datatypes::{Float32Type, UInt32Type, UInt64Type};
use proptest::prelude::*;

mod common;
use common::{assert_all_failed_with, hostfile, wait_with_deadline};
use weir::graph::parquet_log::read_parquet_dir;
use weir::sim::{run_sim, SimArgs};

fn sim_args(out: &Path) -> SimArgs {
    SimArgs {
        steps: 8,
        batch_rows: 16,
        max_staleness: 1,
        workers: 1,
        cluster: weir::cluster::ClusterArgs {
            peer_timeout_s: 20.0,
            ..Default::default()
        },
        gen_ms: 1,
        train_ms: 1,
        score_ms: 0,
        jitter_ms: 0,
        seed: 0,
        group_size: 4,
        weights_bytes: 256,
        weights_bucket_bytes: 64 << 20,
        weights_channel: weir::graph::WeightsChannel::default(),
        encrypt: false,
        placement: None,
        generate_queue: 2,
        stream_slots: 0,
        fail_at_step: None,
        out: out.to_path_buf(),
    }
}

/// One rollout row as the log holds it.
#[derive(Clone, Debug, PartialEq)]
struct Row {
    step: u64,
    row_id: u64,
    group_id: u64,
    response_len: u32,
    policy_version: u64,
    learner_version: u64,
    staleness: u64,
    reward: f32,
    advantage: f32,
    gen_start_ns: u64,
    learn_start_ns: u64,
    learn_end_ns: u64,
}

fn read_rows(out: &Path) -> Vec<Row> {
    let batches = read_parquet_dir(&out.join("rollouts")).expect("rollout log readable");
    let mut rows = Vec::new();
    for b in &batches {
        let u64s = |name: &str| {
            b.column_by_name(name)
                .unwrap_or_else(|| panic!("column {name}"))
                .as_primitive::<UInt64Type>()
                .clone()
        };
        let f32s = |name: &str| {
            b.column_by_name(name)
                .unwrap_or_else(|| panic!("column {name}"))
                .as_primitive::<Float32Type>()
                .clone()
        };
        let (step, row_id, group_id) = (u64s("step"), u64s("row_id"), u64s("group_id"));
        let (pv, lv, st) = (
            u64s("policy_version"),
            u64s("learner_version"),
            u64s("staleness"),
        );
        let (gs, ls, le) = (
            u64s("gen_start_ns"),
            u64s("learn_start_ns"),
            u64s("learn_end_ns"),
        );
        let (reward, advantage) = (f32s("reward"), f32s("advantage"));
        let len = b
            .column_by_name("response_len")
            .expect("response_len")
            .as_primitive::<UInt32Type>()
            .clone();
        for i in 0..b.num_rows() {
            rows.push(Row {
                step: step.value(i),
                row_id: row_id.value(i),
                group_id: group_id.value(i),
                response_len: len.value(i),
                policy_version: pv.value(i),
                learner_version: lv.value(i),
                staleness: st.value(i),
                reward: reward.value(i),
                advantage: advantage.value(i),
                gen_start_ns: gs.value(i),
                learn_start_ns: ls.value(i),
                learn_end_ns: le.value(i),
            });
        }
    }
    rows.sort_by_key(|r| r.row_id);
    rows
}

/// Checks every engine guarantee on a finished run's rows.
fn check_guarantees(rows: &[Row], k: u64, steps: u64, rows_per_step: u64) {
    let ids: Vec<u64> = rows.iter().map(|r| r.row_id).collect();
    assert_eq!(
        ids,
        (0..steps * rows_per_step).collect::<Vec<_>>(),
        "every row exactly once"
    );
    for r in rows {
        assert_eq!(
            r.step,
            r.row_id / rows_per_step,
            "row {} in the wrong step",
            r.row_id
        );
        assert_eq!(
            r.learner_version, r.step,
            "one update per step: learner version = step"
        );
        assert_eq!(r.staleness, r.learner_version - r.policy_version);
        assert!(
            r.staleness <= k,
            "row {}: staleness {} > k = {k}",
            r.row_id,
            r.staleness
        );
    }
    // Per step: when generation started, when learning ended.
    let mut gen_start: BTreeMap<u64, u64> = BTreeMap::new();
    let mut learn: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for r in rows {
        let g = gen_start.entry(r.step).or_insert(u64::MAX);
        *g = (*g).min(r.gen_start_ns);
        learn.insert(r.step, (r.learn_start_ns, r.learn_end_ns));
    }
    if k == 0 {
        for s in 1..steps {
            assert!(
                gen_start[&s] >= learn[&(s - 1)].1,
                "k = 0: generation of step {s} started before learning on step {} ended",
                s - 1
            );
        }
    }
    // In flight: steps whose [first generation, end of learning] intervals overlap.
    let mut events: Vec<(u64, i64)> = Vec::new();
    for s in 0..steps {
        events.push((gen_start[&s], 1));
        events.push((learn[&s].1, -1));
    }
    events.sort_by_key(|&(t, d)| (t, d));
    let (mut live, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        live += d;
        peak = peak.max(live);
    }
    assert!(peak as u64 <= k + 1, "{peak} steps in flight with k = {k}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random stage delays, k ∈ {0, 1, 2, 4}, 1 or 4 threads.
    #[test]
    fn staleness_in_flight_and_exactly_once_hold_under_random_delays(
        k in prop::sample::select(vec![0u64, 1, 2, 4]),
        threads in prop::sample::select(vec![1usize, 4]),
        gen_ms in 0u64..3,
        train_ms in 0u64..3,
        jitter_ms in 0u64..4,
        seed in any::<u64>(),
        queue in 0usize..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let args = SimArgs { max_staleness: k, workers: threads, gen_ms, train_ms, score_ms: 0, jitter_ms, seed, generate_queue: queue, steps: 10, ..sim_args(dir.path()) };
        let report = run_sim(&args).unwrap();
        prop_assert_eq!(report.steps, 10);
        prop_assert!(report.peak_in_flight_steps <= k + 1, "peak in flight {} > k + 1", report.peak_in_flight_steps);
        prop_assert!(report.max_staleness_observed().unwrap() <= k);
        let rows = read_rows(dir.path());
        check_guarantees(&rows, k, 10, 16);
        prop_assert_eq!(report.staleness_histogram.values().sum::<u64>(), 160);
        // A generator hears that its weights serve no later step only from
        // step k on (weights that arrived early may serve the next step),
        // and the synthetic generator fails if such weights serve one.
        let generators = report.stages["generate"].workers as u64;
        for (step, n) in retired_steps(dir.path()) {
            prop_assert!(step >= k && n <= generators, "step {} retired on {} generators", step, n);
        }
    }
}

/// At k = 0 with a slow learner, a generator ends each step well before the
/// next version exists: it hears that its weights retire (a real one frees
/// them through the learner's update), and the next step brings new ones.
#[test]
fn generators_hear_when_their_weights_serve_no_later_step() {
    let dir = tempfile::tempdir().unwrap();
    let args = SimArgs {
        max_staleness: 0,
        workers: 2,
        train_ms: 40,
        steps: 6,
        ..sim_args(dir.path())
    };
    let report = run_sim(&args).unwrap();
    assert_eq!(report.steps, 6);
    let retired = retired_steps(dir.path());
    assert!(
        retired.len() >= 4,
        "generators heard of retired weights at steps {retired:?} only"
    );
}

/// Every row of a finished run's `metrics.parquet`.
fn metric_rows(out: &Path) -> Vec<weir::graph::metrics::MetricRow> {
    weir::graph::parquet_log::read_parquet_file(&out.join("metrics.parquet"))
        .expect("metrics.parquet readable")
        .iter()
        .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
        .collect()
}

/// Per step: how many generators were told their weights retire at its end.
fn retired_steps(out: &Path) -> BTreeMap<u64, u64> {
    let mut steps = BTreeMap::new();
    for row in metric_rows(out) {
        if row.stage == "generate" && row.metric == "weights_retired" {
            *steps.entry(row.step).or_insert(0) += 1;
        }
    }
    steps
}

/// Per row of a streaming run: row id → (trained step, each token's version).
fn token_versions(out: &Path) -> BTreeMap<u64, (u64, Vec<u32>)> {
    let mut rows = BTreeMap::new();
    for b in read_parquet_dir(&out.join("rollouts")).expect("rollout log readable") {
        let ids = b
            .column_by_name("row_id")
            .unwrap()
            .as_primitive::<UInt64Type>()
            .clone();
        let steps = b
            .column_by_name("step")
            .unwrap()
            .as_primitive::<UInt64Type>()
            .clone();
        let versions = b
            .column_by_name("token_versions")
            .expect("token_versions")
            .as_list::<i32>()
            .clone();
        for i in 0..b.num_rows() {
            let v = versions.value(i);
            let v = v.as_primitive::<UInt32Type>().values().to_vec();
            rows.insert(ids.value(i), (steps.value(i), v));
        }
    }
    rows
}

/// The guarantees of a streaming run: every row once, every step its size,
/// the bound per token (the oldest token's version is `policy_version`,
/// versions never fall within a row, none is newer than the learner's),
/// and at k = 0 each row at its own step under that step's version.
fn check_streaming(out: &Path, k: u64, steps: u64, rows_per_step: u64) {
    let rows = read_rows(out);
    let ids: Vec<u64> = rows.iter().map(|r| r.row_id).collect();
    assert_eq!(
        ids,
        (0..steps * rows_per_step).collect::<Vec<_>>(),
        "every row exactly once"
    );
    let versions = token_versions(out);
    let mut sizes = BTreeMap::<u64, u64>::new();
    for r in &rows {
        *sizes.entry(r.step).or_default() += 1;
        assert_eq!(r.learner_version, r.step, "one update per step");
        assert_eq!(r.staleness, r.learner_version - r.policy_version);
        let (step, v) = &versions[&r.row_id];
        assert_eq!(*step, r.step);
        assert_eq!(
            v.len(),
            r.response_len as usize,
            "row {}: a version per token",
            r.row_id
        );
        assert!(
            v.windows(2).all(|w| w[0] <= w[1]),
            "row {}: versions fall: {v:?}",
            r.row_id
        );
        assert_eq!(
            u64::from(v[0]),
            r.policy_version,
            "row {}: policy_version is the oldest token's",
            r.row_id
        );
        for &t in v {
            let t = u64::from(t);
            assert!(
                t <= r.learner_version && r.learner_version - t <= k,
                "row {}: token of version {t} trained at version {} with k = {k}",
                r.row_id,
                r.learner_version
            );
        }
        if k == 0 {
            assert_eq!(
                r.step,
                r.row_id / rows_per_step,
                "k = 0: row {} left its step",
                r.row_id
            );
            assert!(v.iter().all(|&t| u64::from(t) == r.step));
        }
    }
    assert_eq!(
        sizes,
        (0..steps).map(|s| (s, rows_per_step)).collect(),
        "every step keeps its size"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10, ..ProptestConfig::default() })]

    /// A streaming generator (continuous batching, weights applied between
    /// decode passes, groups filling steps as they finish) under random
    /// delays: the bound holds for every token.
    #[test]
    fn streaming_keeps_every_guarantee_per_token_under_random_delays(
        k in prop::sample::select(vec![0u64, 1, 2, 4]),
        threads in prop::sample::select(vec![1usize, 4]),
        slots in prop::sample::select(vec![2usize, 5, 64]),
        gen_ms in 0u64..2,
        train_ms in 0u64..4,
        jitter_ms in 0u64..3,
        seed in any::<u64>(),
        queue in 1usize..3,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let args = SimArgs { max_staleness: k, workers: threads, gen_ms, train_ms, jitter_ms, seed, generate_queue: queue, stream_slots: slots, steps: 8, ..sim_args(dir.path()) };
        let report = run_sim(&args).unwrap();
        prop_assert_eq!(report.steps, 8);
        prop_assert!(report.peak_in_flight_steps <= k + 1, "peak in flight {} > k + 1", report.peak_in_flight_steps);
        prop_assert!(report.max_staleness_observed().unwrap() <= k);
        check_streaming(dir.path(), k, 8, 16);
    }
}

#[test]
fn streaming_groups_fill_earlier_steps_and_stragglers_train_in_time() {
    // k = 2, every row of two steps in the pool at once: short groups of a
    // later step fill a step whose long group is still generating.
    let dir = tempfile::tempdir().unwrap();
    let args = SimArgs {
        max_staleness: 2,
        stream_slots: 64,
        gen_ms: 1,
        train_ms: 2,
        steps: 10,
        ..sim_args(dir.path())
    };
    run_sim(&args).unwrap();
    check_streaming(dir.path(), 2, 10, 16);
    let moved = read_rows(dir.path())
        .iter()
        .filter(|r| r.step != r.row_id / 16)
        .count();
    assert!(
        moved > 0,
        "no group trained at a step other than its prompts'"
    );
}

#[test]
fn metrics_parquet_has_every_stage_and_the_weights_edge() {
    let dir = tempfile::tempdir().unwrap();
    let args = SimArgs {
        workers: 3,
        max_staleness: 2,
        ..sim_args(dir.path())
    };
    let report = run_sim(&args).unwrap();
    let rows = metric_rows(dir.path());
    let stages: BTreeSet<&str> = rows.iter().map(|r| r.stage.as_str()).collect();
    assert_eq!(
        stages,
        BTreeSet::from(["advantage", "generate", "learn", "score"])
    );
    assert!(rows
        .iter()
        .any(|r| r.metric == "weights_transfer_s" && r.value >= 0.0));
    assert_eq!(report.stages["learn"].rows_in, 8 * 16);
    assert_eq!(
        report.stages["generate"].workers, 2,
        "default placement: 2 of 3 workers generate"
    );
    assert!(report.stages["generate"].busy_s > 0.0 && report.stages["generate"].idle_s > 0.0);
}

#[test]
fn a_failing_stage_ends_the_run_with_its_name_and_step() {
    let dir = tempfile::tempdir().unwrap();
    let args = SimArgs {
        workers: 4,
        steps: 50,
        fail_at_step: Some(3),
        ..sim_args(dir.path())
    };
    let started = Instant::now();
    let err = run_sim(&args).unwrap_err().to_string();
    assert!(
        err.contains("`score`") && err.contains("step 3") && err.contains("injected failure"),
        "{err}"
    );
    // The failure travels with the dataflow: well within the peer timeout.
    let peer_timeout = Duration::from_secs_f64(sim_args(dir.path()).cluster.peer_timeout_s);
    assert!(
        started.elapsed() < peer_timeout / 2,
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn bad_settings_are_reported_not_panicked() {
    let dir = tempfile::tempdir().unwrap();
    let err = run_sim(&SimArgs {
        batch_rows: 10,
        ..sim_args(dir.path())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--batch-rows 10") && err.contains("--group-size 4"),
        "{err}"
    );
    let err = run_sim(&SimArgs {
        placement: Some("rollout=0;train=5".into()),
        ..sim_args(dir.path())
    })
    .unwrap_err();
    assert!(format!("{err:#}").contains("worker 5"), "{err:#}");
    let err = run_sim(&SimArgs {
        cluster: weir::cluster::ClusterArgs {
            processes: Some(2),
            process_id: Some(2),
            ..Default::default()
        },
        ..sim_args(dir.path())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("process id 2"), "{err}");
}

// ---- Two processes on localhost ----

fn spawn_peer(args: &[String], process: usize, hosts: &Path, out: &Path) -> Child {
    spawn_peer_with_secret(args, process, hosts, out, None)
}

fn spawn_peer_with_secret(
    args: &[String],
    process: usize,
    hosts: &Path,
    out: &Path,
    secret: Option<&str>,
) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_weir"));
    match secret {
        Some(s) => command.env(weir::cluster::SECRET_VAR, s),
        None => command.env_remove(weir::cluster::SECRET_VAR),
    };
    command
        .arg("sim")
        .args(args)
        .args(["--processes", "2", "--process-id", &process.to_string()])
        .args(
            (!args.iter().any(|a| a == "--workers"))
                .then_some(["--workers", "1"])
                .into_iter()
                .flatten(),
        )
        .arg("--hostfile")
        .arg(hosts)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weir binary starts")
}

fn run_two_processes(args: &[String], out: &Path) -> (Output, Output) {
    let hosts = hostfile(out);
    let p0 = spawn_peer(args, 0, &hosts, out);
    let p1 = spawn_peer(args, 1, &hosts, out);
    let o1 = wait_with_deadline(p1, Duration::from_secs(60));
    let o0 = wait_with_deadline(p0, Duration::from_secs(60));
    (o0, o1)
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

#[test]
fn only_processes_that_share_the_cluster_secret_run_together() {
    let args = strings(&[
        "--steps",
        "4",
        "--gen-ms",
        "1",
        "--train-ms",
        "1",
        "--peer-timeout-s",
        "20",
    ]);
    let wait = |c: Child| wait_with_deadline(c, Duration::from_secs(60));
    let succeeded = |o: &Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let no_secret_printed = |o: &Output| {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !err.contains("correct horse") && !err.contains("battery"),
            "the secret printed: {err}"
        );
    };

    // Process 0 waits with the secret. Before its peer comes: a
    // connect-and-close, bytes that are not weir's, and a second cluster's
    // process 1 that knows the config but not the secret, which is refused
    // with one line. Then the real process 1 joins and the run goes through,
    // every row once.
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path());
    let port0 = std::fs::read_to_string(&hosts).unwrap();
    let port0 = port0.lines().next().unwrap().to_string();
    let p0 = spawn_peer_with_secret(&args, 0, &hosts, dir.path(), Some("correct horse"));
    let started = Instant::now();
    let stray = loop {
        match std::net::TcpStream::connect(&port0) {
            Ok(s) => break s,
            Err(_) if started.elapsed() < Duration::from_secs(30) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("process 0 never listened on {port0}: {e}"),
        }
    };
    drop(stray);
    let mut garbage = std::net::TcpStream::connect(&port0).unwrap();
    std::io::Write::write_all(&mut garbage, b"GET / HTTP/1.0\r\n\r\n").unwrap();
    drop(garbage);
    let other = tempfile::tempdir().unwrap();
    let stranger = wait(spawn_peer_with_secret(
        &args,
        1,
        &hosts,
        other.path(),
        Some("battery"),
    ));
    assert!(!stranger.status.success());
    let err = String::from_utf8_lossy(&stranger.stderr);
    assert!(err.contains("another cluster secret"), "{err}");
    no_secret_printed(&stranger);
    let p1 = spawn_peer_with_secret(&args, 1, &hosts, dir.path(), Some("correct horse"));
    let (o1, o0) = (wait(p1), wait(p0));
    succeeded(&o0);
    succeeded(&o1);
    check_guarantees(&read_rows(dir.path()), 1, 4, 64);

    // Without a secret on either, local processes share the run folder's.
    let dir = tempfile::tempdir().unwrap();
    let (o0, o1) = run_two_processes(&args, dir.path());
    succeeded(&o0);
    succeeded(&o1);
    let secret = dir.path().join(weir::graph::cluster_secret::SECRET_FILE);
    let mode = std::os::unix::fs::PermissionsExt::mode(&secret.metadata().unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "only its owner reads the secret");

    // One process with a secret, the other with the run folder's: the
    // second stops at once, the first when no process with the secret has
    // come within the connect timeout, saying what it refused; no step runs.
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path());
    let mut waiting = args.clone();
    waiting.extend(strings(&["--connect-timeout-s", "5"]));
    let p0 = spawn_peer_with_secret(&waiting, 0, &hosts, dir.path(), Some("correct horse"));
    let p1 = spawn_peer_with_secret(&waiting, 1, &hosts, dir.path(), None);
    let outputs = [wait(p1), wait(p0)];
    assert_all_failed_with(&outputs, "cluster secret");
    outputs.iter().for_each(no_secret_printed);
    let rows = dir.path().join("rollouts");
    assert!(
        !rows.is_dir()
            || read_parquet_dir(&rows).map_or(true, |b| b.iter().all(|b| b.num_rows() == 0)),
        "a step ran with a process that does not belong"
    );

    // The secret from a file on one machine and the variable on the other.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "correct horse\n").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path());
    let mut with_file = args.clone();
    with_file.extend([
        "--cluster-secret-file".to_string(),
        file.path().display().to_string(),
    ]);
    let p0 = spawn_peer_with_secret(&with_file, 0, &hosts, dir.path(), None);
    let p1 = spawn_peer_with_secret(&args, 1, &hosts, dir.path(), Some("correct horse"));
    succeeded(&wait(p1));
    succeeded(&wait(p0));
}

#[test]
fn two_processes_keep_every_guarantee() {
    for k in [0u64, 1, 2, 4] {
        let dir = tempfile::tempdir().unwrap();
        let k_text = k.to_string();
        let args = strings(&[
            "--steps",
            "10",
            "--batch-rows",
            "16",
            "--max-staleness",
            &k_text,
            "--gen-ms",
            "2",
            "--train-ms",
            "1",
            "--jitter-ms",
            "2",
            "--seed",
            "7",
        ]);
        let (o0, o1) = run_two_processes(&args, dir.path());
        assert!(
            o0.status.success(),
            "process 0: {}",
            String::from_utf8_lossy(&o0.stderr)
        );
        assert!(
            o1.status.success(),
            "process 1: {}",
            String::from_utf8_lossy(&o1.stderr)
        );
        let stdout = String::from_utf8_lossy(&o0.stdout);
        assert!(
            stdout.lines().last().unwrap().starts_with("steps_per_s="),
            "{stdout}"
        );
        check_guarantees(&read_rows(dir.path()), k, 10, 16);
    }
}

/// The weights edge between processes, over each channel: the learner
/// (worker 3, process 1) sends each version to process 0 once (over the
/// direct channel, a note its worker 0 fetches the payload by; over
/// timely's, in buckets to worker 0), and worker 0's copy is shelved for
/// generator 1; generator 2 shares process 1's copy. Every generator checks
/// every byte of every version it loads.
#[test]
fn weights_cross_to_each_process_once_over_either_channel() {
    // Encrypted, every connection is sealed: timely's (rows, control) and the weights'.
    for (channel, encrypt) in [("direct", false), ("timely", false), ("direct", true)] {
        let dir = tempfile::tempdir().unwrap();
        let mut args = strings(&[
            "--workers",
            "2",
            "--steps",
            "6",
            "--batch-rows",
            "12",
            "--max-staleness",
            "1",
            "--gen-ms",
            "2",
            "--train-ms",
            "1",
            "--weights-bytes",
            "10000",
            "--weights-bucket-bytes",
            "1024",
            "--weights-channel",
            channel,
        ]);
        if encrypt {
            args.push("--encrypt".into());
        }
        let (o0, o1) = run_two_processes(&args, dir.path());
        for (i, o) in [(0, &o0), (1, &o1)] {
            assert!(
                o.status.success(),
                "{channel}: process {i}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        check_guarantees(&read_rows(dir.path()), 1, 6, 12);
        let rows = metric_rows(dir.path());
        let loads = |metric: &str| -> BTreeMap<u32, Vec<f64>> {
            rows.iter()
                .filter(|r| r.stage == "generate" && r.metric == metric)
                .fold(BTreeMap::new(), |mut m, r| {
                    m.entry(r.worker).or_default().push(r.value);
                    m
                })
        };
        let bytes = loads("weights_bytes");
        assert_eq!(bytes.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
        assert!(
            bytes.values().flatten().all(|&b| b == 10000.0),
            "{channel}: {bytes:?}"
        );
        // Every generator loaded the late versions (each version at most once).
        for (w, loaded) in &bytes {
            assert!(
                (3..=6).contains(&loaded.len()),
                "{channel}: worker {w}: {loaded:?}"
            );
        }
        assert!(loads("weights_transfer_s")
            .values()
            .flatten()
            .all(|&t| t >= 0.0));
        assert!(loads("weights_load_s")
            .values()
            .flatten()
            .all(|&t| t >= 0.0));
    }
}

/// A weights port another program holds: the learner's process cannot
/// listen, and both processes stop with that error before any step runs,
/// not at the first publish (a generation here takes 60 s: a run that
/// waited for it would pass the deadline).
#[test]
fn a_weights_port_in_use_stops_both_processes_before_any_step() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let channel = format!("direct:{}", taken.local_addr().unwrap().port());
    let dir = tempfile::tempdir().unwrap();
    let args = strings(&[
        "--steps",
        "4",
        "--batch-rows",
        "8",
        "--gen-ms",
        "60000",
        "--weights-channel",
        &channel,
    ]);
    let hosts = hostfile(dir.path());
    let peers: Vec<_> = (0..2)
        .map(|p| spawn_peer(&args, p, &hosts, dir.path()))
        .collect();
    let outputs: Vec<_> = peers
        .into_iter()
        .map(|p| wait_with_deadline(p, Duration::from_secs(20)))
        .collect();
    assert_all_failed_with(&outputs, "placement.weights_port");
    let rows = dir.path().join("rollouts");
    assert!(
        !rows.is_dir()
            || read_parquet_dir(&rows).map_or(true, |b| b.iter().all(|b| b.num_rows() == 0)),
        "a step ran though the learner's process could not listen"
    );
    drop(taken);
}

#[test]
fn heartbeats_survive_long_calls_and_catch_mismatched_or_absent_peers() {
    // The learner (process 1's only worker) spends 5 s per step, 2.5 times
    // the peer timeout: its worker must keep sending heartbeats.
    let dir = tempfile::tempdir().unwrap();
    let args = strings(&[
        "--steps",
        "2",
        "--batch-rows",
        "8",
        "--gen-ms",
        "1",
        "--train-ms",
        "5000",
        "--peer-timeout-s",
        "2",
    ]);
    let (o0, o1) = run_two_processes(&args, dir.path());
    for (i, o) in [o0, o1].iter().enumerate() {
        assert!(
            o.status.success(),
            "process {i}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    check_guarantees(&read_rows(dir.path()), 1, 2, 8);

    // Processes started with different flags stop with one clear error.
    let hosts = hostfile(dir.path());
    let p0 = spawn_peer(&args, 0, &hosts, dir.path());
    let mut other = args.clone();
    other.extend(strings(&["--seed", "9"]));
    let p1 = spawn_peer(&other, 1, &hosts, dir.path());
    assert_all_failed_with(
        &[
            wait_with_deadline(p0, Duration::from_secs(30)),
            wait_with_deadline(p1, Duration::from_secs(30)),
        ],
        "runs different settings",
    );

    // A process whose peer never starts gives up after the connect timeout.
    let mut alone = args.clone();
    alone.extend(strings(&["--connect-timeout-s", "1"]));
    let started = Instant::now();
    let o = wait_with_deadline(
        spawn_peer(&alone, 0, &hostfile(dir.path()), dir.path()),
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("did not connect within 1.0 s"), "{stderr}");
    // Ten times the connect timeout: start-up included, on a loaded machine.
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn one_thread_and_two_processes_produce_identical_rows() {
    let single = tempfile::tempdir().unwrap();
    run_sim(&SimArgs {
        max_staleness: 0,
        steps: 6,
        ..sim_args(single.path())
    })
    .unwrap();
    let cluster = tempfile::tempdir().unwrap();
    let (o0, o1) = run_two_processes(
        &strings(&[
            "--steps",
            "6",
            "--batch-rows",
            "16",
            "--max-staleness",
            "0",
            "--gen-ms",
            "1",
            "--train-ms",
            "1",
        ]),
        cluster.path(),
    );
    assert!(
        o0.status.success() && o1.status.success(),
        "{}",
        String::from_utf8_lossy(&o1.stderr)
    );
    // Everything but wall-clock timings must agree.
    let strip = |rows: Vec<Row>| -> Vec<Row> {
        rows.into_iter()
            .map(|r| Row {
                gen_start_ns: 0,
                learn_start_ns: 0,
                learn_end_ns: 0,
                ..r
            })
            .collect()
    };
    let (a, b) = (
        strip(read_rows(single.path())),
        strip(read_rows(cluster.path())),
    );
    assert_eq!(a.len(), 6 * 16);
    assert_eq!(a, b);
}

#[test]
fn a_failing_stage_stops_both_processes_with_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let args = strings(&[
        "--steps",
        "40",
        "--batch-rows",
        "16",
        "--gen-ms",
        "5",
        "--fail-at-step",
        "3",
        "--peer-timeout-s",
        "30",
    ]);
    let peer_timeout = Duration::from_secs(30);
    let started = Instant::now();
    let (o0, o1) = run_two_processes(&args, dir.path());
    // The failure reaches the other process as a message, not by the timeout.
    assert!(
        started.elapsed() < peer_timeout,
        "took {:?}",
        started.elapsed()
    );
    for (i, o) in [(0, &o0), (1, &o1)] {
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "process {i} succeeded");
        assert!(
            stderr.contains("`score`") && stderr.contains("step 3"),
            "process {i}: {stderr}"
        );
        assert!(
            !stderr.contains("panicked"),
            "process {i} panicked: {stderr}"
        );
    }
}

#[test]
fn a_killed_peer_ends_the_run_with_an_error_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let args = strings(&[
        "--steps",
        "100000",
        "--batch-rows",
        "8",
        "--gen-ms",
        "10",
        "--train-ms",
        "5",
        "--peer-timeout-s",
        "5",
    ]);
    let peer_timeout = Duration::from_secs(5);
    let hosts = hostfile(dir.path());
    let p0 = spawn_peer(&args, 0, &hosts, dir.path());
    let mut p1 = spawn_peer(&args, 1, &hosts, dir.path());
    std::thread::sleep(Duration::from_secs(2));
    p1.kill().unwrap();
    let killed_at = Instant::now();
    let o0 = wait_with_deadline(p0, Duration::from_secs(30));
    let _ = p1.wait();
    let stderr = String::from_utf8_lossy(&o0.stderr);
    assert!(!o0.status.success(), "process 0 succeeded: {stderr}");
    assert!(stderr.contains("lost"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        killed_at.elapsed() < 2 * peer_timeout,
        "took {:?} after the kill",
        killed_at.elapsed()
    );
}

#[test]
fn a_hung_peer_ends_the_run_with_an_error_after_the_peer_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let args = strings(&[
        "--steps",
        "100000",
        "--batch-rows",
        "8",
        "--gen-ms",
        "10",
        "--train-ms",
        "5",
        "--peer-timeout-s",
        "2",
    ]);
    let peer_timeout = Duration::from_secs(2);
    let hosts = hostfile(dir.path());
    let p0 = spawn_peer(&args, 0, &hosts, dir.path());
    let mut p1 = spawn_peer(&args, 1, &hosts, dir.path());
    std::thread::sleep(Duration::from_secs(2));
    // A stopped process keeps its connections open but sends nothing: only the heartbeat notices.
    let stopped = Command::new("kill")
        .args(["-STOP", &p1.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let stopped_at = Instant::now();
    let o0 = wait_with_deadline(p0, Duration::from_secs(30));
    let waited = stopped_at.elapsed();
    let _ = p1.kill();
    let _ = p1.wait();
    let stderr = String::from_utf8_lossy(&o0.stderr);
    assert!(!o0.status.success(), "process 0 succeeded: {stderr}");
    assert!(
        stderr.contains("process 1 lost") && stderr.contains("no heartbeat"),
        "{stderr}"
    );
    // Not before the timeout (the last heartbeat may be up to a beat old),
    // and within a few timeouts of it.
    assert!(
        waited >= peer_timeout * 3 / 4 && waited < peer_timeout * 4,
        "ended {waited:?} after the stop"
    );
}

#[test]
fn a_commit_point_is_announced_only_once_its_rows_and_metrics_are_on_disk() {
    use std::sync::{Arc, Mutex};
    use weir::graph::{commit, Execution, RunSettings};
    let dir = tempfile::tempdir().unwrap();
    let args = SimArgs {
        workers: 3,
        steps: 12,
        max_staleness: 2,
        ..sim_args(dir.path())
    };
    std::fs::create_dir_all(&args.out).unwrap();
    let (out, seen) = (args.out.clone(), Arc::new(Mutex::new(BTreeSet::new())));
    let announced = seen.clone();
    let on_commit: commit::OnCommit = Arc::new(move |at: u64| {
        // Rows stay in memory far below 4096 per file: only commits put them on disk.
        let rows = read_rows(&out);
        for step in 0..=at {
            let n = rows.iter().filter(|r| r.step == step).count();
            if n != 16 {
                return Err(format!("commit {at}: step {step} has {n} rows on disk"));
            }
        }
        let metrics = weir::graph::parquet_log::read_parquet_file(&out.join("metrics.parquet"))
            .map_err(|e| e.to_string())?;
        let learned: BTreeSet<u64> = metrics
            .iter()
            .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
            .filter(|r| r.stage == "learn" && r.metric == "busy_s")
            .map(|r| r.step)
            .collect();
        if !(0..=at).all(|s| learned.contains(&s)) {
            return Err(format!("commit {at}: metrics of steps {learned:?}"));
        }
        announced.lock().unwrap().insert(at);
        Ok(())
    });
    let settings = RunSettings::new(Execution::Threads(3), args.placement(3).unwrap())
        .max_staleness(2)
        .steps(12)
        .metrics_path(args.out.join("metrics.parquet"))
        .commits(4, on_commit);
    weir::sim::sim_pipeline(&args).run(&settings).unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        BTreeSet::from([3, 7, 11]),
        "each commit point announced once its files were complete"
    );
}
