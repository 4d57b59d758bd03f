//! The engine's error type: one variant per failure kind, each naming the
//! stage, step, worker, column or value at fault.

use crate::Step;

/// What a stage returns when it fails: any error from any crate. The engine
/// wraps it in [`GraphError::Stage`] with the stage's name and the step.
pub type StageError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the dataflow engine.
#[derive(Debug, Clone, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum GraphError {
    /// A stage, source or sink failed (returned an error or panicked).
    #[error("stage `{stage}` failed{} on worker {worker}: {message}", step.map(|s| format!(" at step {s}")).unwrap_or_default())]
    Stage {
        /// The stage's name in the pipeline.
        stage: String,
        /// The step being processed, or `None` outside a step (start-up, finish).
        step: Option<Step>,
        /// The global index of the worker it ran on.
        worker: usize,
        /// The stage's own error message.
        message: String,
    },
    /// The pipeline description is inconsistent (unknown role, empty worker set, …).
    #[error("invalid pipeline: {0}")]
    Pipeline(String),
    /// The execution settings are invalid (process id out of range, bad hostfile, …).
    #[error("invalid execution settings: {0}")]
    Execution(String),
    /// A batch lacks a column the engine needs, or has it with the wrong type.
    #[error("stage `{stage}`: column `{column}`: {problem}")]
    Column {
        /// The stage whose input or output was checked.
        stage: String,
        /// The column's name.
        column: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A row's staleness exceeded the bound; this is an engine bug, never a user error.
    #[error("staleness {staleness} exceeds max_staleness {max_staleness} at step {step} (learner version {learner_version}, policy version {policy_version})")]
    StalenessViolated {
        /// The step the learner consumed.
        step: Step,
        /// The learner's version when it consumed the row.
        learner_version: u64,
        /// The version that generated the row.
        policy_version: u64,
        /// learner_version − policy_version.
        staleness: u64,
        /// The configured bound.
        max_staleness: u64,
    },
    /// A peer process stopped answering or its connection broke.
    #[error("{peer} lost: {reason}")]
    PeerLost {
        /// Which peer (`process 1`), as far as it is known.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// Encoding or decoding an Arrow batch or a weights payload failed.
    #[error("codec: {0}")]
    Codec(String),
    /// A file could not be written or read.
    #[error("{path}: {message}")]
    Io {
        /// The file or folder.
        path: String,
        /// The operating system's or the format's message.
        message: String,
    },
    /// timely itself failed (a worker thread panicked outside any stage, a connection could not be set up).
    #[error("dataflow runtime: {0}")]
    Runtime(String),
}

impl GraphError {
    pub(crate) fn io(path: impl AsRef<std::path::Path>, err: impl std::fmt::Display) -> Self {
        GraphError::Io {
            path: path.as_ref().display().to_string(),
            message: err.to_string(),
        }
    }
}

/// Calls user code (a stage, source, sink or factory), turning its error or
/// its panic into a message: user code must never take a worker down.
pub(crate) fn call_user<R>(call: impl FnOnce() -> Result<R, StageError>) -> Result<R, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(err.to_string()),
        Err(payload) => Err(format!("panicked: {}", panic_message(payload.as_ref()))),
    }
}

/// Turns a caught panic's payload into a message.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}
