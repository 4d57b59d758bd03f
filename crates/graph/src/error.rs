//! The engine's error type: one variant per failure kind, each naming the
//! stage, step, worker, column or value at fault.

use std::sync::Arc;

use crate::Step;

/// What a stage returns when it fails: any error from any crate. The engine
/// wraps it in [`GraphError::Stage`] with the stage's name and the step.
pub type StageError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A stage's own error, kept as [`GraphError::Stage`]'s source.
pub type StageCause = Arc<dyn std::error::Error + Send + Sync + 'static>;

/// Errors of the dataflow engine.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum GraphError {
    /// A stage, source or sink failed (returned an error or panicked).
    Stage {
        /// The stage's name in the pipeline.
        stage: String,
        /// The step being processed, or `None` outside a step (start-up, finish).
        step: Option<Step>,
        /// The global index of the worker it ran on.
        worker: usize,
        /// The stage's own error message.
        message: String,
        /// The stage's own error, in the process where it failed (a peer
        /// process's failure arrives as its message alone): match on it
        /// with `downcast_ref`.
        #[serde(skip)]
        source: Option<StageCause>,
    },
    /// The pipeline description is inconsistent (unknown role, empty worker set, …).
    Pipeline(String),
    /// The execution settings are invalid (process id out of range, bad hostfile, …).
    Execution(String),
    /// A batch lacks a column the engine needs, or has it with the wrong type.
    Column {
        /// The stage whose input or output was checked.
        stage: String,
        /// The column's name.
        column: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A row's staleness exceeded the bound; this is an engine bug, never a user error.
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
    PeerLost {
        /// Which peer (`process 1`), as far as it is known.
        peer: String,
        /// What was observed.
        reason: String,
    },
    /// Encoding or decoding an Arrow batch or a weights payload failed.
    Codec(String),
    /// A file could not be written or read.
    Io {
        /// The file or folder.
        path: String,
        /// The operating system's or the format's message.
        message: String,
    },
    /// timely itself failed (a worker thread panicked outside any stage, a connection could not be set up).
    Runtime(String),
}

impl std::fmt::Display for GraphError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GraphError::Stage {
                stage,
                step,
                worker,
                message,
                ..
            } => {
                let at = step.map(|s| format!(" at step {s}")).unwrap_or_default();
                write!(
                    f,
                    "stage `{stage}` failed{at} on worker {worker}: {message}"
                )
            }
            GraphError::Pipeline(why) => write!(f, "invalid pipeline: {why}"),
            GraphError::Execution(why) => write!(f, "invalid execution settings: {why}"),
            GraphError::Column {
                stage,
                column,
                problem,
            } => write!(f, "stage `{stage}`: column `{column}`: {problem}"),
            GraphError::StalenessViolated {
                step,
                learner_version,
                policy_version,
                staleness,
                max_staleness,
            } => write!(
                f,
                "staleness {staleness} exceeds max_staleness {max_staleness} at step {step} \
                 (learner version {learner_version}, policy version {policy_version})"
            ),
            GraphError::PeerLost { peer, reason } => write!(f, "{peer} lost: {reason}"),
            GraphError::Codec(why) => write!(f, "codec: {why}"),
            GraphError::Io { path, message } => write!(f, "{path}: {message}"),
            GraphError::Runtime(why) => write!(f, "dataflow runtime: {why}"),
        }
    }
}

impl std::error::Error for GraphError {
    /// A stage's own error, itself (not its `Arc`), so that a caller can
    /// `downcast_ref` it to its type.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GraphError::Stage {
                source: Some(cause),
                ..
            } => Some(&**cause),
            GraphError::Stage { source: None, .. }
            | GraphError::Pipeline(_)
            | GraphError::Execution(_)
            | GraphError::Column { .. }
            | GraphError::StalenessViolated { .. }
            | GraphError::PeerLost { .. }
            | GraphError::Codec(_)
            | GraphError::Io { .. }
            | GraphError::Runtime(_) => None,
        }
    }
}

impl GraphError {
    /// Stage `stage` failed (at `step`, on `worker`) with `cause`, kept as
    /// the source.
    pub fn stage(
        stage: impl Into<String>,
        step: Option<Step>,
        worker: usize,
        cause: StageError,
    ) -> Self {
        GraphError::Stage {
            stage: stage.into(),
            step,
            worker,
            message: cause.to_string(),
            source: Some(Arc::from(cause)),
        }
    }

    pub(crate) fn io(path: impl AsRef<std::path::Path>, err: impl std::fmt::Display) -> Self {
        GraphError::Io {
            path: path.as_ref().display().to_string(),
            message: err.to_string(),
        }
    }
}

/// Calls user code (a stage, source, sink or factory), turning its panic
/// into an error: user code must never take a worker down.
pub(crate) fn call_user<R>(call: impl FnOnce() -> Result<R, StageError>) -> Result<R, StageError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(payload) => Err(format!("panicked: {}", panic_message(payload.as_ref())).into()),
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
