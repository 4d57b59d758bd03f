//! How the file spells values that are not plain strings: `""` for none,
//! and `data.prompts`' task name or path. The file and `weir config` keep
//! their spelling; the code gets the types.

use std::ffi::OsStr;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serializer};

use super::Task;

/// An optional value spelt `""` when absent: `#[serde(with = "none_if_empty")]`.
pub mod none_if_empty {
    use super::*;

    /// Writes the value, or `""` for none.
    pub fn serialize<S: Serializer, T: AsRef<OsStr>>(
        value: &Option<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(&plain(value))
    }

    /// Reads a string: `""` is none.
    pub fn deserialize<'de, D: Deserializer<'de>, T: From<String>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        let text = String::deserialize(d)?;
        Ok((!text.is_empty()).then(|| T::from(text)))
    }
}

impl From<String> for Task {
    fn from(text: String) -> Self {
        match text.as_str() {
            "arith" => Task::Arith,
            _ => Task::File(PathBuf::from(text)),
        }
    }
}

impl From<Task> for String {
    fn from(task: Task) -> Self {
        match task {
            Task::Arith => "arith".into(),
            Task::File(path) => path.to_string_lossy().into_owned(),
        }
    }
}

/// An optional value as the file spells it (`""` for none).
pub fn plain<T: AsRef<OsStr>>(value: &Option<T>) -> String {
    value
        .as_ref()
        .map_or(String::new(), |v| v.as_ref().to_string_lossy().into_owned())
}

/// [`plain`], quoted, for errors.
pub fn spelt<T: AsRef<OsStr>>(value: &Option<T>) -> String {
    format!("{:?}", plain(value))
}
