//! The model runtime's error type: each variant names the file, key or tensor at fault.

use std::path::Path;

/// Errors of loading, running and saving models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's message.
        message: String,
    },
    /// A JSON file is malformed or a key has the wrong type.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A configuration key is missing or has an unsupported value.
    #[error("{path}: key `{key}`: {message}")]
    Config {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The architecture is not one weir runs.
    #[error("{path}: architecture `{name}` is not supported (supported: {supported})")]
    UnknownArchitecture {
        /// The config file.
        path: String,
        /// The architecture named there.
        name: String,
        /// What is supported.
        supported: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor {
        /// The checkpoint folder or file.
        path: String,
        /// The tensor's name.
        name: String,
    },
    /// The checkpoint holds tensors the configuration has no place for
    /// (more layers than `num_hidden_layers`, biases or norms it does not
    /// declare): config.json does not describe these weights.
    #[error("{path}: {count} tensor(s) that config.json has no place for, e.g. `{first}`: does its num_hidden_layers, attention_bias or architecture match the weights?")]
    UnusedTensors {
        /// The checkpoint folder.
        path: String,
        /// How many.
        count: usize,
        /// The first, by name.
        first: String,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("{path}: tensor `{name}` has shape {found:?}, the config implies {expected:?}")]
    ShapeMismatch {
        /// The file holding it.
        path: String,
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies.
        expected: Vec<i64>,
        /// The shape in the file.
        found: Vec<i64>,
    },
    /// An input is unusable (wrong shape, token id out of range, …).
    #[error("invalid input: {0}")]
    Input(String),
    /// The requested device is not available.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(String),
}

impl ModelError {
    pub(crate) fn io(path: &Path, err: impl std::fmt::Display) -> Self {
        ModelError::Io {
            path: path.display().to_string(),
            message: err.to_string(),
        }
    }

    pub(crate) fn config(path: &Path, key: &str, message: impl Into<String>) -> Self {
        ModelError::Config {
            path: path.display().to_string(),
            key: key.to_string(),
            message: message.into(),
        }
    }
}

impl From<tch::TchError> for ModelError {
    fn from(err: tch::TchError) -> Self {
        ModelError::Torch(err.to_string())
    }
}
