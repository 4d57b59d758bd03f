//! An environment written in Python, in OpenRLHF's agent format: a file
//! with a class (`AgentInstance` by default) whose `reset(states)` returns
//! `{"observation": text}` and whose `step(states)` returns `rewards`,
//! `environment_feedback` and `done` (and optionally `scores` and
//! `extra_logs`), either of them sync or async. A user's OpenRLHF agent
//! file runs unchanged, its `from openrlhf.utils.agent import …` line
//! included, with OpenRLHF not installed (`env_driver.py` puts a module of
//! that name in its place).
//!
//! What the file receives is what OpenRLHF hands it: `reset` gets
//! `{"observation": prompt, "label": label}` (and the prompt again as
//! `"prompt"`, as older examples read it), the prompt being its text as
//! the model reads it; `step` gets `{"observation_text": everything so
//! far, "action_text": the turn, "label": label}`. Its
//! `environment_feedback` is raw text, appended as it is (no template
//! around it: the file formats it itself), and each step's `rewards` is
//! the turn's reward.
//!
//! The file runs in a long-lived worker process (`crate::python_worker`),
//! one instance of the class per episode. A request not answered within
//! the timeout kills the worker (the episode's state goes with it, so the
//! episode ends as `timeout`); the next episode starts a new one. Of a
//! run's environments ([`PythonEnvironment::instances`]), each starts its
//! worker when it first holds an episode: a run starts as many Python
//! processes as episodes hold an environment at once, not one per
//! `agent.max_concurrency`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{json, Value};

use super::environment::{EnvFault, EnvStep, Environment, Observation};
use crate::python_worker::{Lost, Worker};

const DRIVER: &str = include_str!("env_driver.py");

/// Where the environment is and how to run it.
#[derive(Clone, Debug, PartialEq)]
pub struct PythonEnvConfig {
    /// The user's `.py` file.
    pub file: PathBuf,
    /// Its class.
    pub class: String,
    /// The interpreter.
    pub python: String,
    /// How long one reset or step may take.
    pub timeout: Duration,
    /// The row's column handed to the file as `label`.
    pub label_column: Option<String>,
}

impl PythonEnvConfig {
    fn name(&self) -> String {
        format!("{}::{}", self.file.display(), self.class)
    }
}

/// The environment of a Python agent file.
pub struct PythonEnvironment {
    cfg: PythonEnvConfig,
    worker: Option<Worker>,
    /// The worker that checked the file, for the first of its siblings
    /// that needs one.
    spare: Arc<Mutex<Option<Worker>>>,
    /// The episode under way, by the id its worker knows it by.
    episode: u64,
}

impl PythonEnvironment {
    /// Starts its worker: a file that does not load, or lacks the class,
    /// is an error now, naming the file.
    pub fn new(cfg: PythonEnvConfig) -> Result<Self, String> {
        let mut env = PythonEnvironment::instances(cfg, 1)?;
        Ok(env.pop().expect("one instance"))
    }

    /// `n` environments of the file (one for each episode that may hold
    /// one at once). The file is checked now, by starting one worker: a
    /// file that does not load, or lacks the class, is an error naming it.
    /// That worker goes to the first environment that holds an episode;
    /// the others start theirs when they first do.
    pub fn instances(cfg: PythonEnvConfig, n: usize) -> Result<Vec<Self>, String> {
        if !cfg.file.is_file() {
            return Err(format!(
                "agent.environment {}: no such file",
                cfg.file.display()
            ));
        }
        let worker = start(&cfg).map_err(|e| format!("{}: {e}", cfg.name()))?;
        let spare = Arc::new(Mutex::new(Some(worker)));
        Ok((0..n.max(1))
            .map(|_| PythonEnvironment {
                cfg: cfg.clone(),
                worker: None,
                spare: spare.clone(),
                episode: 0,
            })
            .collect())
    }

    /// Sends `request` and returns its answer, or why there is none.
    fn call(&mut self, request: Value) -> Result<Value, EnvFault> {
        let name = self.cfg.name();
        if self.worker.is_none() {
            let spare = self
                .spare
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            self.worker = Some(match spare {
                Some(worker) => worker,
                None => start(&self.cfg).map_err(|e| EnvFault::Error(format!("{name}: {e}")))?,
            });
        }
        let worker = self.worker.as_mut().expect("started above");
        match worker.call(&request, self.cfg.timeout) {
            Ok(answer) if answer["ok"] == true => Ok(answer),
            Ok(answer) => Err(EnvFault::Error(format!(
                "{name}: {}",
                answer["error"].as_str().unwrap_or("failed")
            ))),
            Err(lost) => {
                self.worker = None;
                Err(match lost {
                    Lost::TimedOut => EnvFault::Timeout(format!(
                        "{name}: no answer within {} s",
                        self.cfg.timeout.as_secs_f64()
                    )),
                    Lost::Died(why) => EnvFault::Error(format!("{name}: its worker ended{why}")),
                })
            }
        }
    }
}

fn start(cfg: &PythonEnvConfig) -> Result<Worker, String> {
    let args = [cfg.file.as_os_str(), std::ffi::OsStr::new(&cfg.class)];
    Worker::start(&cfg.python, "agent.python", DRIVER, &args, cfg.timeout)
}

impl Environment for PythonEnvironment {
    fn reset(&mut self, row: &Value, prompt: &str) -> Result<Option<String>, EnvFault> {
        self.episode += 1;
        let label = match &self.cfg.label_column {
            Some(column) => row.get(column).cloned().unwrap_or(Value::Null),
            None => Value::Null,
        };
        let answer = self.call(json!({
            "op": "reset", "id": self.episode, "prompt": prompt, "label": label,
        }))?;
        Ok(answer["observation"].as_str().map(String::from))
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvFault> {
        let answer = self.call(json!({"op": "step", "id": self.episode, "action": action}))?;
        Ok(EnvStep {
            observation: Observation::Text(answer["feedback"].as_str().unwrap_or("").to_string()),
            reward: answer["reward"].as_f64().unwrap_or(0.0),
            done: answer["done"] == true,
        })
    }

    fn close(&mut self) {
        if self.worker.is_some() {
            // Frees the episode's instance; a failure here has nothing left to lose.
            let _ = self.call(json!({"op": "close", "id": self.episode}));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &std::path::Path, source: &str) -> PythonEnvConfig {
        let file = dir.join("agent_func.py");
        std::fs::write(&file, source).unwrap();
        PythonEnvConfig {
            file,
            class: "AgentInstance".into(),
            python: "python3".into(),
            timeout: Duration::from_secs(10),
            label_column: Some("answer".into()),
        }
    }

    /// OpenRLHF's own example's shape: async `__init__`, async methods,
    /// the `openrlhf.utils.agent` import, an executor class beside it.
    const OPENRLHF_STYLE: &str = r#"
from typing import Any, Dict
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.step_idx += 1
        right = states["action_text"].strip() == states["label"]
        done = right or self.step_idx >= 3
        print("said", states["action_text"])
        return {
            "rewards": 1.0 if right else 0.0,
            "scores": 1.0 if right else 0.0,
            "environment_feedback": "" if done else f"\nwrong, seen {len(states['observation_text'])} chars\n",
            "done": done,
            "extra_logs": {},
        }


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, result_queue)
"#;

    #[test]
    fn an_openrlhf_agent_file_runs_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let mut env = PythonEnvironment::new(config(dir.path(), OPENRLHF_STYLE)).unwrap();
        let row = json!({"answer": "7"});
        assert_eq!(env.reset(&row, "3+4=").unwrap().as_deref(), Some("3+4="));
        let wrong = env.step("8").unwrap();
        // It saw the prompt and the turn: 4 + 1 characters.
        assert_eq!(
            wrong,
            EnvStep {
                observation: Observation::Text("\nwrong, seen 4 chars\n".into()),
                reward: 0.0,
                done: false,
            }
        );
        let second = env.step("9").unwrap();
        let seen = "3+4=8\nwrong, seen 4 chars\n".len();
        assert_eq!(
            second.observation,
            Observation::Text(format!("\nwrong, seen {seen} chars\n"))
        );
        let right = env.step(" 7 ").unwrap();
        assert_eq!((right.reward, right.done), (1.0, true));
        env.close();
        // A new episode starts afresh.
        env.reset(&row, "1+1=").unwrap();
        assert_eq!(env.step("7").unwrap().reward, 1.0);
    }

    #[test]
    fn environments_start_a_worker_only_when_they_first_hold_an_episode() {
        let dir = tempfile::tempdir().unwrap();
        let starts = dir.path().join("starts");
        // Each worker that loads the file adds a line.
        let source = format!(
            "with open({:?}, 'a') as f:\n    f.write('started\\n')\n\
             class AgentInstance:\n    def reset(self, s):\n        return s\n\
             \x20   def step(self, s):\n        return {{'rewards': 1.0, 'environment_feedback': '', 'done': True}}\n",
            starts.display().to_string()
        );
        let started = || std::fs::read_to_string(&starts).unwrap().lines().count();
        let mut envs = PythonEnvironment::instances(config(dir.path(), &source), 4).unwrap();
        assert_eq!(envs.len(), 4);
        assert_eq!(started(), 1, "the file is checked by one worker");
        // Two episodes at once: the checking worker and one more.
        let (a, rest) = envs.split_first_mut().unwrap();
        a.reset(&json!({}), "p").unwrap();
        rest[2].reset(&json!({}), "q").unwrap();
        assert_eq!(started(), 2);
        for env in [&mut *a, &mut rest[2]] {
            assert!(env.step("x").unwrap().done);
            env.close();
        }
        // Episodes one after another on those two: no more workers.
        for _ in 0..3 {
            a.reset(&json!({}), "p").unwrap();
            a.step("x").unwrap();
            a.close();
        }
        assert_eq!(started(), 2);
    }

    #[test]
    fn a_file_without_the_class_or_that_fails_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let no_class = PythonEnvironment::new(config(dir.path(), "class Other:\n    pass\n"))
            .err()
            .unwrap();
        assert!(
            no_class.contains("agent_func.py::AgentInstance: it defines no class `AgentInstance` (its classes: Other)"),
            "{no_class}"
        );
        let broken = PythonEnvironment::new(config(dir.path(), "import nope_not_here\n"))
            .err()
            .unwrap();
        assert!(
            broken.contains("cannot load it: ModuleNotFoundError") && broken.contains("line 1"),
            "{broken}"
        );
        // A step that raises, or answers without its keys: an error naming it.
        let source = "class AgentInstance:\n    def reset(self, s):\n        return s\n    def step(self, s):\n        if s['action_text'] == 'x':\n            raise RuntimeError('boom')\n        return {'rewards': 1}\n";
        let mut env = PythonEnvironment::new(config(dir.path(), source)).unwrap();
        env.reset(&json!({}), "p").unwrap();
        let EnvFault::Error(boom) = env.step("x").unwrap_err() else {
            panic!("not an error")
        };
        assert!(boom.ends_with("RuntimeError: boom (line 6)"), "{boom}");
        let EnvFault::Error(keys) = env.step("y").unwrap_err() else {
            panic!("not an error")
        };
        assert!(
            keys.contains("step returned no \"environment_feedback\""),
            "{keys}"
        );
    }

    #[test]
    fn a_step_past_its_timeout_is_a_timeout_and_the_next_episode_runs() {
        let dir = tempfile::tempdir().unwrap();
        let source = "import time\nclass AgentInstance:\n    def reset(self, s):\n        return s\n    def step(self, s):\n        if s['action_text'] == 'slow':\n            time.sleep(30)\n        return {'rewards': 0.5, 'environment_feedback': '', 'done': True}\n";
        let mut cfg = config(dir.path(), source);
        cfg.timeout = Duration::from_millis(500);
        let mut env = PythonEnvironment::new(cfg).unwrap();
        env.reset(&json!({}), "p").unwrap();
        let started = std::time::Instant::now();
        let fault = env.step("slow").unwrap_err();
        assert!(matches!(fault, EnvFault::Timeout(_)), "{fault:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        env.close();
        env.reset(&json!({}), "p").unwrap();
        assert_eq!(env.step("fast").unwrap().reward, 0.5);
    }
}
