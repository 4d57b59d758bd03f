//! Crash tests: a GRPO run killed with SIGKILL and resumed after each kill
//! loses nothing and doubles nothing. Kills take turns: partway into a step,
//! just after a checkpoint (both read from the run's own progress: its
//! checkpoints and its per-step lines), and at a seeded random moment; each
//! test asserts kills landed after a checkpoint and mid-step. With two
//! processes (learner ranks on both), killing one ends the other with an
//! error within the peer timeout and the pair resumes.
//!
//! `WEIR_CRASH_SEED` and `WEIR_CRASH_KILLS` change the seed and the number of
//! kills (defaults 7 and 10); a failure prints the seed to reproduce it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use arrow::array::AsArray;
use arrow::datatypes::{UInt32Type, UInt64Type};
use weir::graph::metrics::batch_to_rows;
use weir::graph::parquet_log::read_parquet_file;

use super::runs::strs;
use super::*;

/// Long enough that kills at random (20–1,500 ms after a start) land in
/// start-up, in steps and in checkpoint writes alike.
const STEPS: u64 = 24;
const PROMPTS: u64 = 2;
const SAMPLES: u64 = 4;
const K: u64 = 1;
const CHECKPOINT_EVERY: u64 = 3;

/// A small, seeded generator of kill delays (xorshift64*).
struct Delays(u64);

impl Delays {
    fn next_ms(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        lo + self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % (hi - lo)
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `weir run grpo` into `out`, or `weir run --resume out` once it holds a run.
fn run_args(out: &Path) -> Vec<String> {
    run_args_with(out, &[])
}

/// [`run_args`] with more `--set` items for a new run (an item
/// `pipeline=NAME` runs that pipeline instead of grpo).
fn run_args_with(out: &Path, more: &[&str]) -> Vec<String> {
    let out_s = out.display().to_string();
    if out.join("config.resolved.toml").is_file() {
        return ["run", "--resume", &out_s, "--quiet"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    }
    let model = fixtures().join("arith-sft");
    let pipeline = more
        .iter()
        .find_map(|m| m.strip_prefix("pipeline="))
        .unwrap_or("grpo");
    let mut args: Vec<String> = ["run", pipeline, "--quiet", "--out", &out_s]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for set in [
        format!("model.path={}", model.display()),
        format!("run.steps={STEPS}"),
        format!("run.max_staleness={K}"),
        format!("run.checkpoint_every={CHECKPOINT_EVERY}"),
        format!("data.prompts_per_step={PROMPTS}"),
        format!("data.samples_per_prompt={SAMPLES}"),
        "generate.max_new_tokens=6".into(),
        "eval.arith=false".into(),
    ]
    .into_iter()
    .chain(
        more.iter()
            .filter(|m| !m.starts_with("pipeline="))
            .map(|s| s.to_string()),
    ) {
        args.extend(["--set".to_string(), set]);
    }
    args
}

fn spawn(args: &[String], dir: &Path, cluster: &[String]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .args(cluster)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weir binary starts")
}

/// Kills `child` with SIGKILL after `delay` unless it ended first; true if killed.
fn kill_after(child: &mut Child, delay: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < delay {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    killed
}

/// When a kill lands, chosen from the run's own progress: its checkpoints
/// and the line it prints on stderr as each step finishes.
#[derive(Clone, Copy, Debug)]
enum Moment {
    /// A seeded delay after the start: in start-up, a step or a
    /// checkpoint's writes alike.
    Anytime,
    /// Just after a checkpoint newer than the segment's first is committed.
    AfterCheckpoint,
    /// Partway into the step after one that commits nothing.
    MidStep,
}

/// Where a kill landed: the newest committed checkpoint, and the last
/// step the run had reported finished.
#[derive(Clone, Copy, Debug)]
struct Landed {
    checkpoint: Option<u64>,
    reported: Option<u64>,
}

impl Landed {
    /// A resume goes on from a checkpoint this segment or an earlier one wrote.
    fn after_checkpoint(&self) -> bool {
        self.checkpoint.is_some()
    }

    /// Steps had finished past the newest checkpoint: the resume does them again.
    fn mid_step(&self) -> bool {
        self.reported
            .is_some_and(|r| self.checkpoint.is_none_or(|c| r > c))
    }
}

/// The steps a run reports finished on stderr (`grpo step 4 (5/24) …`, one
/// line a step where stderr is no terminal), as they come.
fn reported_steps(child: &mut Child) -> std::sync::mpsc::Receiver<u64> {
    use std::io::BufRead;
    let stderr = child.stderr.take().expect("stderr piped");
    let (send, steps) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { return };
            let words: Vec<&str> = line.split_whitespace().collect();
            if let [_, "step", n, ..] = words[..] {
                if let Ok(n) = n.parse() {
                    let _ = send.send(n);
                }
            }
        }
    });
    steps
}

/// Runs `args` in `root` (the run folder `out`) and kills it at `moment`
/// unless it ends first: where the kill landed, or how the run ended.
fn kill_at(
    args: &[String],
    out: &Path,
    root: &Path,
    moment: Moment,
    delays: &mut Delays,
) -> Result<Landed, std::process::ExitStatus> {
    let first = latest_checkpoint(out);
    let mut child = spawn(args, root, &[]);
    let steps = reported_steps(&mut child);
    let started = Instant::now();
    let anytime = Duration::from_millis(delays.next_ms(20, 1500));
    // A step's time is the shortest gap between two step lines: the first
    // line's wait holds the start-up (loading, a resume's replay) as well.
    let (mut reported, mut finished_at) = (None, None::<Instant>);
    let mut step_time: Option<Duration> = None;
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{moment:?}: the run neither ended nor reached the moment"
        );
        if let Some(status) = child.try_wait().unwrap() {
            return Err(status);
        }
        for step in steps.try_iter() {
            if let Some(at) = finished_at {
                let gap = at.elapsed().max(Duration::from_millis(1));
                step_time = Some(step_time.map_or(gap, |t| t.min(gap)));
            }
            finished_at = Some(Instant::now());
            reported = Some(step);
        }
        let now = match moment {
            Moment::Anytime => started.elapsed() >= anytime,
            Moment::AfterCheckpoint => latest_checkpoint(out) > first,
            Moment::MidStep => {
                step_time.is_some()
                    && reported.is_some_and(|s| {
                        (s + 1) % CHECKPOINT_EVERY != 0 && Some(s) > latest_checkpoint(out)
                    })
            }
        };
        if now {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if let Moment::MidStep = moment {
        // Within the next step: at most half a step's time on.
        let half = (step_time.unwrap_or_default().as_millis() as u64 / 2).max(2);
        std::thread::sleep(Duration::from_millis(delays.next_ms(1, half)));
    }
    let _ = child.kill();
    let _ = child.wait();
    reported = steps.try_iter().last().or(reported);
    Ok(Landed {
        checkpoint: latest_checkpoint(out),
        reported,
    })
}

/// The step of the newest committed checkpoint, if any.
fn latest_checkpoint(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir.join("checkpoints"))
        .ok()?
        .flatten()
        .filter(|e| e.path().join("state.json").is_file())
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .max()
}

/// Every `*.parquet` file under `dir`, superseded ones included.
fn parquet_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|x| x == "parquet") {
                out.push(path);
            }
        }
    }
    out
}

/// What a finished run folder must hold after any number of crashes.
fn check_run_folder(dir: &Path, seed: u64) {
    let ctx = format!("(WEIR_CRASH_SEED={seed}, {})", dir.display());
    for path in parquet_files(dir) {
        if let Err(e) = read_parquet_file(&path) {
            panic!("{} unreadable: {e} {ctx}", path.display());
        }
    }
    // Every step exactly once in the log (superseded rows excluded).
    let mut per_step: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
    let mut rows = 0u64;
    let mut version_offsets = BTreeSet::new();
    for entry in std::fs::read_dir(dir.join("rollouts")).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|x| x != "parquet") {
            continue;
        }
        for b in read_parquet_file(&path).unwrap() {
            let col = |name: &str| {
                b.column_by_name(name)
                    .unwrap()
                    .as_primitive::<UInt64Type>()
                    .clone()
            };
            let (step, group) = (col("step"), col("group_id"));
            let sample = b
                .column_by_name("sample_idx")
                .unwrap()
                .as_primitive::<UInt32Type>()
                .clone();
            let (learner, staleness) = (col("learner_version"), col("staleness"));
            for i in 0..b.num_rows() {
                rows += 1;
                per_step
                    .entry(step.value(i))
                    .or_default()
                    .insert((group.value(i), u64::from(sample.value(i))));
                assert!(
                    staleness.value(i) <= K,
                    "staleness {} > k {ctx}",
                    staleness.value(i)
                );
                version_offsets.insert(learner.value(i) as i64 - step.value(i) as i64);
            }
        }
    }
    let steps: Vec<u64> = per_step.keys().copied().collect();
    assert_eq!(
        steps,
        (0..STEPS).collect::<Vec<_>>(),
        "steps in rollouts/ {ctx}"
    );
    for (step, ids) in &per_step {
        assert_eq!(
            ids.len() as u64,
            PROMPTS * SAMPLES,
            "step {step}'s rows {ctx}"
        );
    }
    assert_eq!(rows, STEPS * PROMPTS * SAMPLES, "no row twice {ctx}");
    // Every prompt's samples exactly once, whichever step they joined (a
    // streaming generator's groups fill steps in the order they finish).
    let all: BTreeSet<(u64, u64)> = per_step.values().flatten().copied().collect();
    let expected: BTreeSet<(u64, u64)> = (0..STEPS * PROMPTS)
        .flat_map(|g| (0..SAMPLES).map(move |s| (g, s)))
        .collect();
    assert_eq!(all, expected, "every prompt's samples once {ctx}");
    assert_eq!(
        version_offsets.len(),
        1,
        "learner versions continuous: offsets {version_offsets:?} {ctx}"
    );
    // metrics.parquet covers every step, each once per learner worker
    // (data-parallel ranks each record their own engine figures).
    let mut learned: BTreeMap<(u64, u32), u32> = BTreeMap::new();
    for b in read_parquet_file(&dir.join("metrics.parquet")).unwrap() {
        for r in batch_to_rows(&b).unwrap() {
            if r.stage == "learn" && r.metric == "rows_in" {
                *learned.entry((r.step, r.worker)).or_default() += 1;
            }
        }
    }
    let steps: BTreeSet<u64> = learned.keys().map(|k| k.0).collect();
    assert_eq!(
        steps.into_iter().collect::<Vec<_>>(),
        (0..STEPS).collect::<Vec<_>>(),
        "metrics steps {ctx}"
    );
    let workers: BTreeSet<u32> = learned.keys().map(|k| k.1).collect();
    assert_eq!(
        learned.len(),
        STEPS as usize * workers.len(),
        "every learner worker's figures for every step {ctx}"
    );
    assert!(
        learned.values().all(|&n| n == 1),
        "a step's metrics twice {ctx}"
    );
    let last = dir.join(format!("checkpoints/step-{}", STEPS - 1));
    assert!(last.join("state.json").is_file() && last.join("actor/model.safetensors").is_file());
    assert!(dir.join("summary.json").is_file(), "{ctx}");
}

#[test]
fn a_run_killed_at_random_moments_resumes_with_every_step_once() {
    let seed = env_u64("WEIR_CRASH_SEED", 7);
    kill_and_resume(seed, env_u64("WEIR_CRASH_KILLS", 10), &[]);
}

/// With streaming generation, a kill lands while sequences of one or two
/// steps are in flight. They are not in any checkpoint: the resume starts
/// at the step after the last checkpoint and generates those steps again
/// from their prompts (the same rows a straight run gives at k = 0).
#[test]
fn a_streaming_run_killed_with_sequences_in_flight_resumes_with_every_step_once() {
    let seed = env_u64("WEIR_CRASH_SEED", 7) + 1;
    let kills = env_u64("WEIR_CRASH_KILLS", 10).div_ceil(2);
    kill_and_resume(
        seed,
        kills,
        &["generate.max_inflight=3", "generate.on_new_weights=keep"],
    );
}

/// With multi-turn episodes answered by a Python environment that takes
/// 20 ms a step, streamed across steps (`generate.max_inflight`), kills
/// land mid-episode, with its worker processes answering: nothing of an
/// unfinished episode is in a checkpoint, and the resume runs it again
/// from its prompt.
#[test]
fn an_agentic_run_killed_mid_episode_resumes_with_every_step_once() {
    let seed = env_u64("WEIR_CRASH_SEED", 7) + 3;
    let kills = env_u64("WEIR_CRASH_KILLS", 10).div_ceil(2);
    let tmp = tempfile::tempdir().unwrap();
    let env = tmp.path().join("agent_func.py");
    std::fs::write(
        &env,
        "import time\n\
         from openrlhf.utils.agent import AgentInstanceBase\n\
         class AgentInstance(AgentInstanceBase):\n\
         \x20   def __init__(self):\n\
         \x20       self.steps = 0\n\
         \x20   async def step(self, states):\n\
         \x20       self.steps += 1\n\
         \x20       time.sleep(0.02)\n\
         \x20       return {'rewards': 0.5, 'environment_feedback': '\\nAgain:', 'done': self.steps >= 2}\n",
    )
    .unwrap();
    let environment = format!("agent.environment={:?}", env.display().to_string());
    kill_and_resume_in(
        tmp.path(),
        seed,
        kills,
        &[
            &environment,
            "generate.max_new_tokens=32",
            "generate.max_inflight=4",
            "agent.max_concurrency=2",
        ],
    );
}

/// At k = 0 a run's result does not depend on timing: killed and resumed
/// over and over, it trains exactly the weights of a run left alone.
#[test]
fn a_synchronous_run_killed_at_random_moments_trains_the_uninterrupted_weights() {
    let seed = env_u64("WEIR_CRASH_SEED", 7) + 2;
    let more = ["run.max_staleness=0"];
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    success(&weir(&strs(&run_args_with(&straight, &more)), tmp.path()));
    let last = format!("checkpoints/step-{}/actor/model.safetensors", STEPS - 1);
    let want = std::fs::read(straight.join(&last)).unwrap();
    let kills = env_u64("WEIR_CRASH_KILLS", 10).div_ceil(2);
    let runs = kill_and_resume_in(tmp.path(), seed, kills, &more);
    assert!(!runs.is_empty());
    for run in runs {
        assert!(
            std::fs::read(run.join(&last)).unwrap() == want,
            "WEIR_CRASH_SEED={seed}: {} trained other weights than the run left alone",
            run.display()
        );
    }
}

/// On-policy distillation at k = 0, killed and resumed over and over,
/// trains exactly the weights of a run left alone (the teacher's scores
/// and the advantages lose nothing to a crash).
#[test]
fn a_distillation_run_killed_at_random_moments_trains_the_uninterrupted_weights() {
    let seed = env_u64("WEIR_CRASH_SEED", 7) + 6;
    let teacher = format!("teacher.path={}", fixtures().join("tiny-llama").display());
    let more = ["pipeline=distill", "run.max_staleness=0", teacher.as_str()];
    let tmp = tempfile::tempdir().unwrap();
    let straight = tmp.path().join("straight");
    success(&weir(&strs(&run_args_with(&straight, &more)), tmp.path()));
    let last = format!("checkpoints/step-{}/actor/model.safetensors", STEPS - 1);
    let want = std::fs::read(straight.join(&last)).unwrap();
    let kills = env_u64("WEIR_CRASH_KILLS", 10).div_ceil(2);
    for run in kill_and_resume_in(tmp.path(), seed, kills, &more) {
        assert!(
            std::fs::read(run.join(&last)).unwrap() == want,
            "WEIR_CRASH_SEED={seed}: {} trained other weights than the run left alone",
            run.display()
        );
    }
}

/// Training from a log (half of each step's groups replayed from another
/// run's log, half generated) at k = 0: which groups replay depends on
/// their ids alone, so killed and resumed over and over, the run trains
/// exactly the weights of one left alone.
#[test]
fn a_run_training_from_a_log_killed_at_random_moments_trains_the_uninterrupted_weights() {
    let seed = env_u64("WEIR_CRASH_SEED", 7) + 4;
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log");
    success(&weir(&strs(&run_args_with(&log, &[])), tmp.path()));
    let rollouts = format!("data.rollouts=[{:?}]", log.display().to_string());
    let more = [
        "run.max_staleness=0",
        "algorithm.correction=\"tis\"",
        "data.replay_fraction=0.5",
        rollouts.as_str(),
    ];
    let straight = tmp.path().join("straight");
    success(&weir(&strs(&run_args_with(&straight, &more)), tmp.path()));
    let last = format!("checkpoints/step-{}/actor/model.safetensors", STEPS - 1);
    let want = std::fs::read(straight.join(&last)).unwrap();
    let kills = env_u64("WEIR_CRASH_KILLS", 10).div_ceil(2);
    for run in kill_and_resume_in(tmp.path(), seed, kills, &more) {
        assert!(
            std::fs::read(run.join(&last)).unwrap() == want,
            "WEIR_CRASH_SEED={seed}: {} trained other weights than the run left alone",
            run.display()
        );
    }
}

/// Kills `weir run grpo` (with `more` settings) `kills` times at seeded
/// random moments, resuming after each, and checks every finished run folder.
fn kill_and_resume(seed: u64, kills: u64, more: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    kill_and_resume_in(tmp.path(), seed, kills, more);
}

/// [`kill_and_resume`] with run folders under `root`; returns them.
fn kill_and_resume_in(root: &Path, seed: u64, kills: u64, more: &[&str]) -> Vec<PathBuf> {
    let mut delays = Delays(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    // Kills land partway into a step, just after a checkpoint, and
    // anywhere (in start-up, between steps, in a checkpoint's writes), in turn.
    // A run that gets to its end before all kills are spent is checked,
    // and the rest go to a new run.
    let moments = [Moment::MidStep, Moment::AfterCheckpoint, Moment::Anytime];
    let mut landed: Vec<Vec<Landed>> = Vec::new();
    let mut attempts = 0;
    let mut runs = Vec::new();
    while (landed.iter().map(Vec::len).sum::<usize>() as u64) < kills {
        let out = root.join(format!("run-{}", landed.len()));
        runs.push(out.clone());
        let done = out.join(format!("checkpoints/step-{}/state.json", STEPS - 1));
        let mut these = Vec::new();
        let mut spent = landed.iter().map(Vec::len).sum::<usize>() as u64;
        while spent < kills && !done.is_file() {
            // Not quiet: the run reports each step it finishes.
            let args: Vec<String> = run_args_with(&out, more)
                .into_iter()
                .filter(|a| a != "--quiet")
                .collect();
            // By attempt, not by kill: a moment a run never reaches (it
            // ended first) does not hold up the others.
            let moment = moments[attempts % moments.len()];
            attempts += 1;
            match kill_at(&args, &out, root, moment, &mut delays) {
                Ok(at) => {
                    these.push(at);
                    spent += 1;
                }
                Err(status) => {
                    assert!(status.success(), "WEIR_CRASH_SEED={seed}: a segment failed")
                }
            }
        }
        // A kill that landed before the run folder had its config leaves
        // nothing to resume: the run starts afresh.
        let resuming = out.join("config.resolved.toml").is_file();
        let args = run_args_with(&out, more);
        let text = success(&weir(&strs(&args), root));
        assert!(
            !resuming
                || text
                    .lines()
                    .next()
                    .is_some_and(|l| l.contains("resuming at step")
                        || l.contains("already complete")
                        || l.contains("starting again")),
            "one line on what the resume did: {text}"
        );
        check_run_folder(&out, seed);
        // Resuming a finished run, twice: nothing to do, nothing changed
        // (the run folder now has its config: these are resumes).
        let args = run_args_with(&out, more);
        let before = std::fs::read(out.join("summary.json")).unwrap();
        for _ in 0..2 {
            let text = success(&weir(&strs(&args), root));
            assert!(text.contains("already complete"), "{text}");
        }
        assert_eq!(std::fs::read(out.join("summary.json")).unwrap(), before);
        check_run_folder(&out, seed);
        // Killed inside its final checkpoint: the components are written,
        // the state is not. The resume redoes the steps after the one before.
        let last = out.join(format!("checkpoints/step-{}", STEPS - 1));
        std::fs::remove_file(last.join("state.json")).unwrap();
        let text = success(&weir(&strs(&args), root));
        assert!(
            text.contains(&format!("resuming at step {}", STEPS - 3)),
            "{text}"
        );
        check_run_folder(&out, seed);
        landed.push(these);
    }
    eprintln!("seed {seed}: where each kill landed, per run: {landed:?}");
    // The kills that matter most landed: some after a checkpoint (the
    // resume starts from it), some mid-step (the resume does steps again).
    let all: Vec<&Landed> = landed.iter().flatten().collect();
    if kills >= moments.len() as u64 {
        assert!(
            all.iter().any(|l| l.after_checkpoint()) && all.iter().any(|l| l.mid_step()),
            "WEIR_CRASH_SEED={seed}: kills after a checkpoint and mid-step: {all:?}"
        );
    }
    runs
}

#[test]
fn killing_one_of_two_processes_ends_the_other_and_the_pair_resumes() {
    let seed = env_u64("WEIR_CRASH_SEED", 7);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("pair");
    let mut delays = Delays(seed.wrapping_mul(0xd134_2543_de82_ef95) | 1);
    let peer_timeout = 3.0;
    let mut kills = 0;
    for round in 0..6 {
        if kills == 2 {
            break;
        }
        let hosts = super::common::hostfile(tmp.path());
        // Learner ranks on both processes: killing process 1 kills a rank
        // that process 0's rank waits for in every all-reduce.
        let args = run_args_with(&out, &["placement.train=[0, 1]"]);
        let cluster = |id: usize| -> Vec<String> {
            [
                "--processes".to_string(),
                "2".into(),
                "--process-id".into(),
                id.to_string(),
                "--hostfile".into(),
                hosts.display().to_string(),
                "--peer-timeout-s".into(),
                peer_timeout.to_string(),
                "--connect-timeout-s".into(),
                "5".into(),
            ]
            .to_vec()
        };
        let p0 = spawn(&args, tmp.path(), &cluster(0));
        let mut p1 = spawn(&args, tmp.path(), &cluster(1));
        // Past start-up (two processes connecting), into the steps.
        let delay = Duration::from_millis(delays.next_ms(600, 2000));
        if kill_after(&mut p1, delay) {
            kills += 1;
            let started = Instant::now();
            let o0 = super::common::wait_with_deadline(p0, Duration::from_secs(60));
            let err = String::from_utf8_lossy(&o0.stderr);
            if o0.status.success() {
                // Process 1 died after its part was done: process 0 may finish.
                continue;
            }
            assert!(!err.contains("panicked"), "round {round}: {err}");
            assert_eq!(
                err.trim().lines().count(),
                1,
                "round {round}: one line: {err}"
            );
            assert!(
                started.elapsed() < Duration::from_secs_f64(peer_timeout * 4.0 + 5.0),
                "round {round}: process 0 took {:?} to notice",
                started.elapsed()
            );
        } else {
            let o0 = super::common::wait_with_deadline(p0, Duration::from_secs(60));
            success(&o0);
        }
    }
    assert!(kills >= 1, "WEIR_CRASH_SEED={seed}: no kill landed");
    // The pair resumes and finishes.
    let hosts = super::common::hostfile(tmp.path());
    let args = run_args(&out);
    let mut children = Vec::new();
    for id in 0..2 {
        let cluster: Vec<String> = [
            "--processes".to_string(),
            "2".into(),
            "--process-id".into(),
            id.to_string(),
            "--hostfile".into(),
            hosts.display().to_string(),
        ]
        .to_vec();
        children.push(spawn(&args, tmp.path(), &cluster));
    }
    for child in children {
        success(&super::common::wait_with_deadline(
            child,
            Duration::from_secs(120),
        ));
    }
    check_run_folder(&out, seed);
}

#[test]
fn a_full_disk_ends_the_run_with_an_error_and_keeps_the_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("full");
    // A run killed once its first checkpoint is committed.
    let mut child = spawn(&run_args(&out), tmp.path(), &[]);
    let started = Instant::now();
    while latest_checkpoint(&out).is_none() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    let last = latest_checkpoint(&out).unwrap();
    let ck = out.join(format!("checkpoints/step-{last}"));
    let files = [
        "state.json",
        "actor/model.safetensors",
        "actor/optimizer.safetensors",
    ];
    let before: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(ck.join(f)).unwrap())
        .collect();
    // The disk fills up: every file the run writes past 4 KiB fails
    // (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write returns EFBIG as a
    // full disk returns ENOSPC). A link planted at a temporary name no
    // longer reaches weir's writes, whose temporaries have random names.
    let args = run_args(&out);
    let output = {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(env!("CARGO_BIN_EXE_weir"));
        command.args(strs(&args)).current_dir(tmp.path());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            command.pre_exec(|| {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let limit = libc::rlimit {
                    rlim_cur: 4096,
                    rlim_max: 4096,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command.output().unwrap()
    };
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "a full disk went unnoticed");
    assert!(
        err.contains(&out.display().to_string()) && err.contains("File too large"),
        "the failed write named: {err}"
    );
    // (The test's own folder may be named `.tmpXXXXXX`.)
    let named = err.split(&out.display().to_string()).nth(1).unwrap_or("");
    assert!(
        !named.contains(".tmp"),
        "the temporary's name, not the file's: {err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        latest_checkpoint(&out),
        Some(last),
        "no checkpoint past the failed write"
    );
    for (file, bytes) in files.iter().zip(&before) {
        assert_eq!(
            &std::fs::read(ck.join(file)).unwrap(),
            bytes,
            "{file} changed"
        );
    }
    // Space again: the run resumes from that checkpoint and loses nothing.
    success(&weir(&strs(&args), tmp.path()));
    check_run_folder(&out, 0);
}
