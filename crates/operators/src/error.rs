//! The operators' errors by kind, each keeping the error it wraps as its
//! source: a stage's or a trainer's failure reaches the user with its root
//! cause, and code can match on it (`downcast_ref::<OperatorError>()` on a
//! stage's error, or on the source of `weir_graph::GraphError::Stage`).

use std::path::PathBuf;

pub use crate::rollout::SchemaError;

/// The error an [`OperatorError`] wraps.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a stage, a reward, a prompt file or a checkpoint reports.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    /// A batch does not fit the rollout schema: a column missing or of
    /// another type.
    #[error(transparent)]
    Schema(#[from] SchemaError),
    /// A file (prompts, a checkpoint's part) could not be read, parsed or
    /// written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file or folder.
        path: PathBuf,
        /// What reading, parsing or writing it gave.
        #[source]
        source: Cause,
    },
    /// A training step failed.
    #[error("step {step}: {source}")]
    Step {
        /// The step.
        step: u64,
        /// Why.
        #[source]
        source: Cause,
    },
    /// A reward function or reward server failed.
    #[error("reward {reward}: {source}")]
    Reward {
        /// The reward (its file and function, or its server).
        reward: String,
        /// Why.
        #[source]
        source: Cause,
    },
}

impl OperatorError {
    /// `path` could not be read, parsed or written.
    pub fn file(path: impl Into<PathBuf>, source: impl Into<Cause>) -> Self {
        OperatorError::File {
            path: path.into(),
            source: source.into(),
        }
    }

    /// Training step `step` failed.
    pub fn step(step: u64, source: impl Into<Cause>) -> Self {
        OperatorError::Step {
            step,
            source: source.into(),
        }
    }

    /// The reward `reward` failed.
    pub fn reward(reward: impl Into<String>, source: impl Into<Cause>) -> Self {
        OperatorError::Reward {
            reward: reward.into(),
            source: source.into(),
        }
    }
}
