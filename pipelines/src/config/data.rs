//! `[data]`: the prompt set (or preference pairs, or rollout logs to
//! replay) and how it is read: the section, its defaults, its rows of the
//! key table and its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::validate::bad;
use super::{ConfigError, RolloutAdvantages};
use crate::PipelineKind;

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `arith` (the built-in task) or a `.jsonl` / `.parquet` prompt file.
    pub prompts: Task,
    /// The column holding plain-text prompts (file prompt sets).
    pub prompt_column: String,
    /// The column holding chat messages instead (none: use `prompt_column`).
    #[serde(with = "none_if_empty")]
    pub messages_column: Option<String>,
    /// The column with the reference answer (rule rewards, SFT targets).
    #[serde(with = "none_if_empty")]
    pub label_column: Option<String>,
    /// A text in which `{prompt}` stands for each plain-text prompt.
    #[serde(with = "none_if_empty")]
    pub prompt_template: Option<String>,
    /// Render plain-text prompts with the model's chat template, as a user message.
    pub apply_chat_template: bool,
    /// A system message put before every chat prompt.
    #[serde(with = "none_if_empty")]
    pub system_prompt: Option<String>,
    /// Prompts per step.
    pub prompts_per_step: usize,
    /// Samples per prompt (the group size).
    pub samples_per_prompt: usize,
    /// Passes over the prompts (0: as many as the steps need).
    pub epochs: u64,
    /// The preferred response's column (rm, dpo).
    pub chosen_column: String,
    /// The dispreferred response's column (rm, dpo).
    pub rejected_column: String,
    /// A column with each pair's reward margin (rm).
    #[serde(with = "none_if_empty")]
    pub margin_column: Option<String>,
    /// Leave out prompts too long for the context beside
    /// `generate.max_new_tokens` (false: such a prompt is an error).
    pub skip_long_prompts: bool,
    /// Rollout logs to train on: run folders, folders of log files, or
    /// files (empty: every row is generated).
    pub rollouts: Vec<PathBuf>,
    /// A row filter on the logs (`step >= 10 and reward > 0`; empty: every row).
    #[serde(with = "none_if_empty")]
    pub rollouts_where: Option<String>,
    /// The share of each step's groups replayed from the logs (1: all).
    pub replay_fraction: f64,
    /// Replayed rows' advantages: computed again from their logged rewards,
    /// or taken as logged.
    pub rollout_advantages: RolloutAdvantages,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            prompts: Task::Arith,
            prompt_column: "prompt".into(),
            messages_column: None,
            label_column: Some("answer".into()),
            prompt_template: None,
            apply_chat_template: false,
            system_prompt: None,
            prompts_per_step: 8,
            samples_per_prompt: 8,
            epochs: 0,
            chosen_column: "chosen".into(),
            rejected_column: "rejected".into(),
            margin_column: None,
            skip_long_prompts: false,
            rollouts: Vec::new(),
            rollouts_where: None,
            replay_fraction: 1.0,
            rollout_advantages: RolloutAdvantages::Recompute,
        }
    }
}

/// A task: what `data.prompts` names (its prompt sets and measures live in
/// `crate::task`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum Task {
    /// The built-in arith task.
    Arith,
    /// A prompt file.
    File(PathBuf),
}

/// `[data]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("data", "prompts", All, "\"arith\" (the built-in task, its 9,500 training pairs) or a .jsonl / .parquet prompt file."),
    key("data", "prompt_column", All, "The column with plain-text prompts."),
    key("data", "messages_column", All, "The column with chat messages (rendered with the chat template); empty: use prompt_column."),
    key("data", "label_column", RlAndSft, "The column with the reference answer (rule rewards; SFT targets); a dotted name reads a nested field, e.g. verl's reward_model.ground_truth (columns of every kind may be dotted)."),
    key("data", "prompt_template", All, "A text in which {prompt} stands for each plain-text prompt, e.g. \"Question: {prompt}\\nAnswer:\" (empty: the prompt as is)."),
    key("data", "apply_chat_template", All, "Render plain-text prompts as a user message with the model's chat template and a generation prompt (message prompts always are)."),
    key("data", "system_prompt", All, "A system message put before every chat prompt (needs apply_chat_template or messages_column)."),
    key("data", "prompts_per_step", All, "Prompts per step (the SFT batch size)."),
    key("data", "samples_per_prompt", Rl, "Samples per prompt: the group size."),
    key("data", "skip_long_prompts", NotPreference, "Leave out prompts longer than the model's context leaves beside generate.max_new_tokens, with a warning counting them (verl's filter_overlong_prompts); false: such a prompt is an error naming its line."),
    key("data", "epochs", All, "Passes over the prompts (0: as many as the steps need)."),
    key("data", "rollouts", Agentic, "Rollout logs to train on instead of, or beside, fresh generation (training from logs): run folders, folders of rollout Parquet files, or files, e.g. [\"runs/grpo-a\"]. A step's groups are replaced by logged groups (data.replay_fraction of them), rows and rewards as logged, with source = \"log\" and their logged step and policy version; they are off-policy by any number of versions, so algorithm.correction must weigh them. Files are checked first (Parquet, the rollout schema, a version this weir reads; a manifest's tokenizer must be the policy's)."),
    key("data", "rollouts_where", Agentic, "A row filter on the logs' numeric columns, conditions joined by `and` (e.g. \"step >= 10 and reward > 0\"), pushed down to the Parquet row groups (empty: every row)."),
    key("data", "replay_fraction", Agentic, "The share of each step's groups replayed from data.rollouts (1: all; 0.5: every other group generated): group g replays when ⌊(g+1)·f⌋ > ⌊g·f⌋, the logged groups in turn, the same on a resume."),
    key("data", "rollout_advantages", Agentic, "Replayed rows' advantages: \"recompute\" (the pipeline's estimator over their logged rewards) or \"logged\" (as the log holds them)."),
    key("data", "chosen_column", Preference, "The preferred response's column (rm, dpo; \"arith\" makes pairs of the right and a wrong sum)."),
    key("data", "rejected_column", Preference, "The dispreferred response's column (rm, dpo)."),
    key("data", "margin_column", Rm, "A column with each pair's margin m (rm): the loss becomes −log σ(r_chosen − r_rejected − m), OpenRLHF's pairwise loss with margin; empty: none."),
];

impl DataSection {
    /// Prompts and samples per step (groups of 2 at least for a group
    /// estimator), and of training from logs what reads `[data]` alone: a
    /// replayed fraction in (0, 1] and a row filter that parses.
    pub(super) fn check(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        if self.prompts_per_step == 0 {
            return bad("data.prompts_per_step", "0".into(), "must be at least 1");
        }
        if self.samples_per_prompt == 0 {
            return bad("data.samples_per_prompt", "0".into(), "must be at least 1");
        }
        if pipeline.is_group() && self.samples_per_prompt < 2 {
            return bad(
                "data.samples_per_prompt",
                self.samples_per_prompt.to_string(),
                "group estimators need at least 2 samples per prompt",
            );
        }
        if !(self.replay_fraction > 0.0 && self.replay_fraction <= 1.0) {
            return bad(
                "data.replay_fraction",
                self.replay_fraction.to_string(),
                "must be in (0, 1]: the share of each step's groups replayed from data.rollouts",
            );
        }
        if let Some(filter) = &self.rollouts_where {
            if let Err(why) = weir_operators::rollout_log::RowFilter::parse(filter) {
                return bad("data.rollouts_where", format!("{filter:?}"), &why);
            }
        }
        Ok(())
    }

    /// A prompt template has a place for the prompt.
    pub(super) fn check_template(&self) -> Result<(), ConfigError> {
        let template = &self.prompt_template;
        if let Some(template) = template.as_ref().filter(|t| !t.contains("{prompt}")) {
            return bad(
                "data.prompt_template",
                format!("{template:?}"),
                "must contain {prompt}, where each prompt goes",
            );
        }
        Ok(())
    }
}
