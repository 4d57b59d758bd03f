//! Environments: what answers an episode's turns when the task is a world
//! to act in rather than tools to call (a game, a shell, a judge that
//! replies). An environment is reset for each episode with its dataset
//! row, then steps once per turn of the model: it reads the turn's text
//! and answers with an observation, a reward for the turn, and whether the
//! episode is over.
//!
//! An observation is either messages (rendered after the turn by the chat
//! template, as tool results are: see [`super::observe`]) or raw text,
//! tokenized as it is and appended straight after the turn with no
//! template around it: the convention of OpenRLHF's agent files, whose
//! `environment_feedback` is text the file formats itself.

use serde_json::Value;

/// What an environment says after a turn.
#[derive(Clone, Debug, PartialEq)]
pub struct EnvStep {
    /// What the model reads next.
    pub observation: Observation,
    /// The turn's reward (placed on the turn's last generated token).
    pub reward: f64,
    /// Whether the episode is over.
    pub done: bool,
}

/// An environment's observation.
#[derive(Clone, Debug, PartialEq)]
pub enum Observation {
    /// Messages (`{"role": "user", "content": …}`, say), rendered by the chat template.
    Messages(Vec<Value>),
    /// Text appended as it is, tokenized alone, no template.
    Text(String),
}

/// Why an environment gave no answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvFault {
    /// It failed, saying why.
    Error(String),
    /// It did not answer within its time (its episode's state is lost).
    Timeout(String),
    /// It answered outside its protocol: not an episode's failure but the
    /// setup's, which fails the run (a misconfigured server would
    /// otherwise fail every episode quietly).
    Protocol(String),
}

impl EnvFault {
    /// What it says.
    pub fn message(&self) -> &str {
        match self {
            EnvFault::Error(m) | EnvFault::Timeout(m) | EnvFault::Protocol(m) => m,
        }
    }
}

impl From<String> for EnvFault {
    fn from(message: String) -> Self {
        EnvFault::Error(message)
    }
}

impl From<&str> for EnvFault {
    fn from(message: &str) -> Self {
        EnvFault::Error(message.to_string())
    }
}

/// A world an episode acts in.
pub trait Environment: Send {
    /// Starts an episode for the dataset row `row` (its columns as a JSON
    /// object) whose prompt, as the model reads it, is the text `prompt`
    /// (special tokens written out). It may return the prompt rewritten
    /// (tokenized alone, no special tokens added, as OpenRLHF's agents'
    /// `reset` observation is), or `None` to keep it.
    fn reset(&mut self, row: &Value, prompt: &str) -> Result<Option<String>, EnvFault>;
    /// Answers the model's turn `action` (its text, without the end-of-turn token).
    fn step(&mut self, action: &str) -> Result<EnvStep, EnvFault>;
    /// Ends the episode (frees what the environment holds for it).
    fn close(&mut self) {}
}

/// Builds a registered environment (once per worker that generates).
pub type EnvironmentFactory =
    std::sync::Arc<dyn Fn() -> Result<Box<dyn Environment>, String> + Send + Sync>;

fn registry() -> &'static std::sync::Mutex<std::collections::BTreeMap<String, EnvironmentFactory>> {
    static REGISTRY: std::sync::OnceLock<
        std::sync::Mutex<std::collections::BTreeMap<String, EnvironmentFactory>>,
    > = std::sync::OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Registers an environment under `name`, which `agent.environment` names
/// (a name ending in `.py` is read as a file, so it cannot be taken).
pub fn register(
    name: &str,
    factory: impl Fn() -> Result<Box<dyn Environment>, String> + Send + Sync + 'static,
) {
    assert!(
        !name.ends_with(".py"),
        "`{name}` reads as a Python file: register the environment under another name"
    );
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), std::sync::Arc::new(factory));
}

/// The factory registered under `name`.
pub fn registered(name: &str) -> Option<EnvironmentFactory> {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned()
}

/// The names registered so far.
pub fn registered_names() -> Vec<String> {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .cloned()
        .collect()
}
