//! `[teacher]`: the teacher of on-policy distillation: the section, its rows
//! of the key table and its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::ConfigError;

/// `[teacher]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TeacherSection {
    /// The teacher's HF checkpoint folder (`distill`; required there).
    pub path: PathBuf,
    /// Tokens the teacher records at each position for a top-k loss term (0: none).
    pub top_k: usize,
}

/// `[teacher]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("teacher", "path", Distill, "The distillation teacher's HuggingFace checkpoint folder (required by distill). It scores the student's (model.path's) token ids, so its tokenizer must read every id of the student's as the student's does (vocabulary and added tokens; ids of its own past them and the file's layout do not matter) and its config.json's vocab_size must reach the student's; the first id that differs is named."),
    key("teacher", "top_k", Distill, "The teacher also records its k most likely tokens and their log-probs at every response position (teacher_topk_ids, teacher_topk_logprobs in the rollout log, k per position; among the ids the student's vocabulary holds, where the teacher's pads further), and the learner adds algorithm.gkd_coef × GKD's divergence between the teacher and the student over those tokens (algorithm.gkd_beta, algorithm.gkd_tail), differentiated through the student's whole distribution; 0: no such term. The teacher then runs on libtorch (on the CPU too) and keeps its libtorch weights."),
];

impl TeacherSection {
    /// distill's teacher is a checkpoint folder with a tokenizer to hold
    /// to the student's (the caller checks it for distill only; its top k
    /// against both vocabularies is in `validate.rs`).
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let teacher = &self.path;
        let shown = format!("{:?}", teacher.display().to_string());
        if teacher.as_os_str().is_empty() {
            return bad(
                "teacher.path",
                shown,
                "distill needs the teacher's checkpoint folder",
            );
        }
        if !teacher.join("config.json").is_file() {
            return bad(
                "teacher.path",
                shown,
                "no config.json there: not a HuggingFace checkpoint folder",
            );
        }
        if !teacher.join("tokenizer.json").is_file() {
            return bad(
                "teacher.path",
                shown,
                "no tokenizer.json there to hold to the student's: the teacher scores the student's token ids",
            );
        }
        Ok(())
    }
}
