//! `PythonReward`: rewards from a function in the user's Python file, run by
//! a pool of long-lived worker processes of the user's own `python3`; weir
//! never links Python.
//!
//! Two signatures, chosen by the function's name:
//! - OpenRLHF's `reward_func(queries, prompts, labels, **kwargs)` (any name
//!   but `compute_score`): `queries` are prompt + response texts, `kwargs`
//!   the prompt file's other columns; it returns a list (or tensor) of
//!   floats, or a dict with `"rewards"` and optionally `"scores"` and
//!   `"extra_logs"` (their means become metrics), as `--remote_rm_url
//!   file.py` accepts;
//! - verl's per-sample `compute_score(data_source, solution_str,
//!   ground_truth, extra_info)`, returning a float or a dict with `"score"`
//!   (its other numeric keys become metrics).
//!
//! A step's rows are split over the workers and sent as one JSON line each
//! over a pipe (`python_driver.py` is the worker's side). A function that
//! raises, returns the wrong count, a non-number, NaN or infinity fails
//! the step with one line naming the file, the function and the row. A
//! worker that dies or answers later than `timeout` is killed and started
//! again, and the request retried, `attempts` times in all.
//! Each worker is a `crate::python_worker::Worker`: a process group of
//! its own, without the cluster secret, ended with weir.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use arrow::array::RecordBatch;
use serde_json::{json, Value};
use weir_graph::{Stage, StageError, StepContext};

use crate::data::columns::{strings, with_rewards};
use crate::error::OperatorError;
use crate::python_worker::{Lost, Worker};
use crate::rollout::col;

const DRIVER: &str = include_str!("python_driver.py");

/// Where the reward function is and how to run it.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonRewardConfig {
    /// The user's `.py` file.
    pub file: PathBuf,
    /// The function: `compute_score` takes verl's per-sample signature, any
    /// other name OpenRLHF's batch one.
    pub function: String,
    /// The interpreter (`python3`, or a venv's `bin/python`).
    pub python: String,
    /// Worker processes.
    pub workers: usize,
    /// How long one request may take.
    pub timeout: Duration,
    /// Tries per request when a worker dies or times out.
    pub attempts: u32,
    /// The column of reference answers (`labels` / `ground_truth`), if any.
    pub label_column: Option<String>,
    /// Further prompt-file columns handed to the function.
    pub columns: Vec<String>,
    /// The columns (the label's included) whose values in the prompt file
    /// are JSON numbers, booleans, lists or objects: the rollout keeps them
    /// as JSON text, and the function receives them decoded, as the file
    /// holds them.
    pub typed: Vec<String>,
}

impl PythonRewardConfig {
    fn per_sample(&self) -> bool {
        self.function == "compute_score"
    }

    /// Column `name`'s values as the function receives them: text, or,
    /// for a typed column, the JSON values the texts hold.
    fn values(&self, name: &str, texts: &[String]) -> Value {
        super::column_values(texts, self.typed.iter().any(|t| t == name))
    }

    /// `file::function`, for messages.
    fn name(&self) -> String {
        format!("{}::{}", self.file.display(), self.function)
    }
}

/// Starts a worker of `cfg`'s function and waits until its file is loaded.
fn start_worker(cfg: &PythonRewardConfig) -> Result<Worker, String> {
    let mode = if cfg.per_sample() { "sample" } else { "batch" };
    let args = [
        cfg.file.as_os_str(),
        std::ffi::OsStr::new(&cfg.function),
        std::ffi::OsStr::new(mode),
    ];
    Worker::start(&cfg.python, "reward.python", DRIVER, &args, cfg.timeout)
}

/// Rewards in row order and the means of the function's extra logs.
pub type Scored = (Vec<f64>, BTreeMap<String, f64>);

/// The rows of one request.
struct Rows<'a> {
    offset: usize,
    prompts: &'a [String],
    responses: &'a [String],
    labels: Option<&'a [String]>,
    columns: Vec<(&'a str, &'a [String])>,
}

/// The reward stage over a pool of Python workers.
pub struct PythonReward {
    cfg: PythonRewardConfig,
    workers: Vec<Option<Worker>>,
}

impl PythonReward {
    /// Starts the workers; a file that does not load is an error now, not at the first step.
    pub fn new(cfg: PythonRewardConfig) -> Result<Self, StageError> {
        if !cfg.file.is_file() {
            return Err(format!("reward.file {}: no such file", cfg.file.display()).into());
        }
        let workers = (0..cfg.workers.max(1))
            .map(|_| start_worker(&cfg).map(Some))
            .collect::<Result<Vec<_>, String>>()
            .map_err(|e| OperatorError::reward(cfg.name(), e))?;
        Ok(PythonReward { cfg, workers })
    }

    /// Rewards for the rows of `batch` (stage `stage`'s input): its
    /// prompts, responses, labels and the columns the function receives.
    pub fn score_batch(&mut self, batch: &RecordBatch, stage: &str) -> Result<Scored, StageError> {
        let prompts = strings(batch, col::PROMPT, stage)?;
        let responses = strings(batch, col::RESPONSE, stage)?;
        let labels = match &self.cfg.label_column {
            Some(c) => Some(strings(batch, c, stage)?),
            None => None,
        };
        let columns = self
            .cfg
            .columns
            .iter()
            .map(|c| Ok((c.clone(), strings(batch, c, stage)?)))
            .collect::<Result<Vec<_>, StageError>>()?;
        self.score(&prompts, &responses, labels.as_deref(), &columns)
    }

    /// Rewards for rows of `(prompt, response)` with their labels and
    /// columns, and the means of the function's extra logs.
    pub fn score(
        &mut self,
        prompts: &[String],
        responses: &[String],
        labels: Option<&[String]>,
        columns: &[(String, Vec<String>)],
    ) -> Result<Scored, StageError> {
        let n = responses.len();
        let chunk = n.div_ceil(self.workers.len()).max(1);
        let cfg = &self.cfg;
        let results: Vec<Result<Scored, String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .workers
                .iter_mut()
                .enumerate()
                .map(|(w, worker)| {
                    let start = (w * chunk).min(n);
                    let end = (start + chunk).min(n);
                    let rows = Rows {
                        offset: start,
                        prompts: &prompts[start..end],
                        responses: &responses[start..end],
                        labels: labels.map(|l| &l[start..end]),
                        columns: columns
                            .iter()
                            .map(|(k, v)| (k.as_str(), &v[start..end]))
                            .collect(),
                    };
                    scope.spawn(move || request(cfg, worker, &rows))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a worker thread panicked".into()))
                })
                .collect()
        });
        let mut rewards = Vec::with_capacity(n);
        let mut logs: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        for result in results {
            let (r, l) = result.map_err(|e| OperatorError::reward(self.cfg.name(), e))?;
            let rows = r.len();
            rewards.extend(r);
            for (k, v) in l {
                let e = logs.entry(k).or_insert((0.0, 0));
                e.0 += v * rows as f64;
                e.1 += rows;
            }
        }
        let logs = logs
            .into_iter()
            .map(|(k, (sum, rows))| (k, sum / rows.max(1) as f64))
            .collect();
        Ok((rewards, logs))
    }
}

/// One chunk's request on one worker, with restarts and retries.
fn request(
    cfg: &PythonRewardConfig,
    worker: &mut Option<Worker>,
    rows: &Rows,
) -> Result<Scored, String> {
    let n = rows.responses.len();
    if n == 0 {
        return Ok((Vec::new(), BTreeMap::new()));
    }
    let queries: Vec<String> = rows
        .prompts
        .iter()
        .zip(rows.responses)
        .map(|(p, r)| format!("{p}{r}"))
        .collect();
    let columns: serde_json::Map<String, Value> = rows
        .columns
        .iter()
        .map(|(k, v)| (k.to_string(), cfg.values(k, v)))
        .collect();
    let labels = match (rows.labels, &cfg.label_column) {
        (Some(labels), Some(name)) => cfg.values(name, labels),
        _ => Value::Null,
    };
    let body = json!({
        "queries": queries,
        "prompts": rows.prompts,
        "responses": rows.responses,
        "labels": labels,
        "columns": columns,
    });
    let span = |i: usize| format!("row {}", rows.offset + i);
    let mut last = String::new();
    for attempt in 1..=cfg.attempts.max(1) {
        if worker.is_none() {
            *worker = Some(start_worker(cfg)?);
        }
        let w = worker.as_mut().expect("just started");
        let answer = match w.call(&body, cfg.timeout) {
            Ok(answer) => answer,
            Err(lost) => {
                last = match lost {
                    Lost::Died(why) => format!("the worker died{why}"),
                    Lost::TimedOut => format!(
                        "no answer for rows {}..{} within reward.timeout_s = {} s",
                        rows.offset,
                        rows.offset + n,
                        cfg.timeout.as_secs_f64()
                    ),
                };
                tracing::warn!(reward = %cfg.name(), attempt, error = %last, "python reward worker lost; restarting it");
                *worker = None;
                continue;
            }
        };
        if answer["ok"] != true {
            let error = answer["error"].as_str().unwrap_or("failed");
            return Err(match answer["row"].as_u64() {
                Some(i) => format!("{}: {error}", span(i as usize)),
                None => error.to_string(),
            });
        }
        let list = answer["rewards"].as_array().cloned().unwrap_or_default();
        if list.len() != n {
            return Err(format!(
                "returned {} rewards for {n} rows (rows {}..{})",
                list.len(),
                rows.offset,
                rows.offset + n
            ));
        }
        let mut rewards = Vec::with_capacity(n);
        for (i, v) in list.iter().enumerate() {
            match v {
                Value::Number(x) => rewards.push(x.as_f64().unwrap_or(f64::NAN)),
                Value::String(s) => {
                    return Err(format!(
                        "{}: the reward is {s}: a reward must be a finite number",
                        span(i)
                    ))
                }
                other => {
                    let shown = other["bad"].as_str().unwrap_or("?");
                    return Err(format!("{}: the reward {shown} is not a number", span(i)));
                }
            }
        }
        let logs = answer["logs"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                    .collect()
            })
            .unwrap_or_default();
        return Ok((rewards, logs));
    }
    Err(format!("{last} (after {} attempt(s))", cfg.attempts.max(1)))
}

impl Stage for PythonReward {
    fn process(
        &mut self,
        ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let (rewards, logs) = self.score_batch(&batch, ctx.stage())?;
        for (key, value) in logs {
            ctx.record(&key, value);
        }
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &std::path::Path, source: &str, function: &str) -> PythonRewardConfig {
        let file = dir.join("reward.py");
        std::fs::write(&file, source).unwrap();
        PythonRewardConfig {
            file,
            function: function.into(),
            python: "python3".into(),
            workers: 2,
            timeout: Duration::from_secs(5),
            attempts: 2,
            label_column: Some("answer".into()),
            columns: vec!["topic".into()],
            typed: Vec::new(),
        }
    }

    fn texts(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    fn score(cfg: PythonRewardConfig) -> Result<Scored, String> {
        let mut reward = PythonReward::new(cfg).map_err(|e| e.to_string())?;
        let columns = vec![("topic".to_string(), texts(&["a", "b", "a"]))];
        reward
            .score(
                &texts(&["1+1=", "2+2=", "3+3="]),
                &texts(&["2", "5", "6"]),
                Some(&texts(&["2", "4", "6"])),
                &columns,
            )
            .map_err(|e| e.to_string())
    }

    #[test]
    fn openrlhf_and_verl_signatures_score_in_row_order() {
        let dir = tempfile::tempdir().unwrap();
        let batch = "def reward_func(queries, prompts, labels, topic=None):\n    \
                     print('user output goes to stderr')\n    \
                     r = [float(q[len(p):] == l) for q, p, l in zip(queries, prompts, labels)]\n    \
                     return {'rewards': r, 'extra_logs': {'topic_a': [float(t == 'a') for t in topic]}}\n";
        let (rewards, logs) = score(config(dir.path(), batch, "reward_func")).unwrap();
        assert_eq!(rewards, vec![1.0, 0.0, 1.0]);
        assert!((logs["topic_a"] - 2.0 / 3.0).abs() < 1e-12, "{logs:?}");
        let sample = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    \
                      return {'score': 2.0 * (solution_str == ground_truth), 'is_a': float(extra_info['topic'] == 'a')}\n";
        let (rewards, logs) = score(config(dir.path(), sample, "compute_score")).unwrap();
        assert_eq!(rewards, vec![2.0, 0.0, 2.0]);
        assert!((logs["is_a"] - 2.0 / 3.0).abs() < 1e-12, "{logs:?}");
    }

    /// A reward that runs programs (their output, and any read of stdin,
    /// stay off the protocol), loaded by a relative path (its errors still
    /// name their line).
    #[test]
    fn subprocess_output_and_relative_paths_keep_the_protocol() {
        let dir = tempfile::tempdir().unwrap();
        let source = "import subprocess, sys\n\
                      def reward_func(q, p, l, **k):\n    \
                      subprocess.run(['echo', 'compiled ok'])\n    \
                      subprocess.run(['cat'], timeout=5)\n    \
                      assert sys.stdin.read() == ''\n    \
                      return [float(len(l[0]) < 9)] * len(q)\n";
        let mut cfg = config(dir.path(), source, "reward_func");
        let (rewards, _) = score(cfg.clone()).unwrap();
        assert_eq!(rewards, vec![1.0; 3]);
        // The same file by a path relative to this process's folder.
        let here = std::env::current_dir().unwrap();
        let up = "../".repeat(here.components().count() - 1);
        let relative = format!(
            "{up}{}",
            cfg.file.display().to_string().trim_start_matches('/')
        );
        std::fs::write(
            &cfg.file,
            "def reward_func(q, p, l, **k):\n    raise KeyError('label')\n",
        )
        .unwrap();
        cfg.file = relative.into();
        assert!(cfg.file.is_relative());
        let err = score(cfg).unwrap_err();
        assert!(err.contains("KeyError: 'label' (line 2)"), "{err}");
    }

    /// Labels and columns that the prompt file holds as numbers, lists or
    /// objects reach the function as those values, not as their JSON text;
    /// a text column stays text even when it looks like a number.
    #[test]
    fn typed_columns_arrive_as_the_file_holds_them() {
        let dir = tempfile::tempdir().unwrap();
        let sample = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    \
                      assert isinstance(extra_info['topic'], str), extra_info\n    \
                      assert isinstance(extra_info['ok'], list), extra_info\n    \
                      return float(ground_truth == int(solution_str) and solution_str in extra_info['ok'])\n";
        let mut cfg = config(dir.path(), sample, "compute_score");
        cfg.columns = vec!["topic".into(), "ok".into()];
        cfg.typed = vec!["answer".into(), "ok".into()];
        let mut reward = PythonReward::new(cfg).unwrap();
        let columns = vec![
            ("topic".to_string(), texts(&["7", "b", "a"])),
            (
                "ok".to_string(),
                texts(&["[\"2\"]", "[\"5\", \"4\"]", "[]"]),
            ),
        ];
        let (rewards, _) = reward
            .score(
                &texts(&["1+1=", "2+2=", "3+3="]),
                &texts(&["2", "4", "6"]),
                Some(&texts(&["2", "4", "6"])),
                &columns,
            )
            .unwrap();
        assert_eq!(rewards, vec![1.0, 1.0, 0.0]);
    }

    #[test]
    fn failures_name_the_file_function_and_row() {
        let dir = tempfile::tempdir().unwrap();
        for (source, function, needle) in [
            ("def f(:\n", "reward_func", "cannot load it: SyntaxError"),
            (
                "x = 1\n",
                "reward_func",
                "defines no function `reward_func`",
            ),
            (
                "def compute_score(s, r, g, e):\n    return 1 / (len(r) - 1)\n",
                "compute_score",
                "row 0: ZeroDivisionError",
            ),
            (
                "def reward_func(q, p, l, **k):\n    raise KeyError('label')\n",
                "reward_func",
                "KeyError: 'label' (line 2)",
            ),
            (
                "def reward_func(q, p, l, **k):\n    return [1.0]\n",
                "reward_func",
                "returned 1 rewards for 2 rows",
            ),
            (
                "def reward_func(q, p, l, **k):\n    return [float('nan')] * len(q)\n",
                "reward_func",
                "row 0: the reward is nan",
            ),
            (
                "def compute_score(s, r, g, e):\n    return 'high'\n",
                "compute_score",
                "row 0: the reward 'high' is not a number",
            ),
            (
                "import os\ndef reward_func(q, p, l, **k):\n    os._exit(3)\n",
                "reward_func",
                "the worker died",
            ),
            (
                "import time\ndef reward_func(q, p, l, **k):\n    time.sleep(30)\n",
                "reward_func",
                "within reward.timeout_s",
            ),
        ] {
            let mut cfg = config(dir.path(), source, function);
            cfg.timeout = Duration::from_millis(1500);
            let err = score(cfg).unwrap_err();
            assert!(
                err.contains("reward.py::") && err.contains(needle),
                "{source}: {err}"
            );
            assert_eq!(err.lines().count(), 1, "{err}");
        }
    }

    /// Whether process `pid` is gone (or a zombie nobody waits for).
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        }
    }

    #[test]
    fn a_worker_starts_without_the_cluster_secret() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
            pairs.iter().map(|(k, v)| (k.into(), v.into())).collect()
        };
        let given = env(&[
            ("PATH", "/bin"),
            ("WEIR_CLUSTER_SECRET", "s3cret"),
            ("HOME", "/h"),
        ]);
        assert_eq!(
            crate::python_worker::worker_env(given.into_iter()),
            env(&[("PATH", "/bin"), ("HOME", "/h")])
        );
    }

    #[test]
    fn what_a_worker_starts_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let source = format!(
            "import subprocess\n\
             child = subprocess.Popen(['sleep', '300'])\n\
             open({:?}, 'a').write(f'{{child.pid}}\\n')\n\
             def reward_func(q, p, l, **k):\n    \
             return [1.0] * len(q)\n",
            pids.display().to_string()
        );
        let mut cfg = config(dir.path(), &source, "reward_func");
        cfg.workers = 1;
        let (rewards, _) = score(cfg).unwrap();
        assert_eq!(rewards, vec![1.0; 3]);
        let grandchildren: Vec<i32> = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert!(!grandchildren.is_empty());
        let started = std::time::Instant::now();
        while !grandchildren.iter().all(|&p| gone(p)) {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "a reward worker's child outlived the reward: {grandchildren:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_worker_that_dies_once_is_restarted_and_the_request_retried() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("died-once");
        let source = format!(
            "import os\ndef reward_func(q, p, l, **k):\n    \
             if not os.path.exists({flag:?}):\n        open({flag:?}, 'w').close()\n        os._exit(1)\n    \
             return [0.5] * len(q)\n"
        );
        let mut cfg = config(dir.path(), &source, "reward_func");
        cfg.workers = 1;
        let (rewards, _) = score(cfg).unwrap();
        assert_eq!(rewards, vec![0.5; 3]);
    }
}
