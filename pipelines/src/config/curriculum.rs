//! `[curriculum]`: skipping prompts by their solve rate so far: the section,
//! its defaults and its rows of the key table (its values need no check).

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};

/// `[curriculum]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CurriculumSection {
    /// Skip prompts by their solve rate so far.
    pub enabled: bool,
    /// Samples a prompt needs before it is judged.
    pub min_samples: u64,
    /// Skip prompts solved at this rate or more.
    pub max_solve_rate: f64,
    /// Skip prompts solved at this rate or less (negative: keep all).
    pub min_solve_rate: f64,
    /// A sample counts as solved at this reward or more.
    pub solve_threshold: f64,
}

impl Default for CurriculumSection {
    fn default() -> Self {
        CurriculumSection {
            enabled: false,
            min_samples: 8,
            max_solve_rate: 1.0,
            min_solve_rate: -1.0,
            solve_threshold: 1.0,
        }
    }
}

/// `[curriculum]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key(
        "curriculum",
        "enabled",
        Group,
        "Skip prompts by their solve rate so far (maintained with differential dataflow).",
    ),
    key(
        "curriculum",
        "min_samples",
        Group,
        "Samples a prompt needs before it is judged.",
    ),
    key(
        "curriculum",
        "max_solve_rate",
        Group,
        "Skip prompts solved at this rate or more.",
    ),
    key(
        "curriculum",
        "min_solve_rate",
        Group,
        "Skip prompts solved at this rate or less (negative: keep all).",
    ),
    key(
        "curriculum",
        "solve_threshold",
        Group,
        "A sample counts as solved at this reward or more.",
    ),
];
