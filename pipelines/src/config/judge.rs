//! `[judge]`: a generative judge's reward (`reward.kind = "judge"`, or a
//! judge term): the section, its defaults, its rows of the key table and
//! its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::validate::bad;
use super::{ConfigError, JudgeVerdict, OnUnparsed};

/// `[judge]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JudgeSection {
    /// The judge's HF checkpoint folder (a causal LM).
    pub path: PathBuf,
    /// The minijinja template of the judge's prompt.
    pub template: String,
    /// Give the rendered template to the judge as a user message through
    /// its tokenizer's chat template.
    pub chat: bool,
    /// How the judge's answer becomes the reward.
    pub verdict: JudgeVerdict,
    /// `verdict = "regex"`: the pattern whose first group is the reward.
    pub pattern: String,
    /// `verdict = "probability"`: the tokens whose probability is the reward.
    pub verdict_tokens: Vec<String>,
    /// Tokens the judge generates at most.
    pub max_new_tokens: usize,
    /// The judge's sampling temperature (0: greedy).
    pub temperature: f64,
    /// What an answer the pattern does not parse gets.
    pub on_unparsed: OnUnparsed,
    /// `on_unparsed = "reward"`: that reward.
    pub unparsed_reward: f64,
}

impl Default for JudgeSection {
    fn default() -> Self {
        JudgeSection {
            path: PathBuf::new(),
            template: "Question: {{ prompt }} Response: {{ response }} How good is the response, from 0 (wrong) to 10 (perfect)? Answer with the number only.".into(),
            chat: true,
            verdict: JudgeVerdict::Regex,
            pattern: r"(-?\d+(?:\.\d+)?)".into(),
            verdict_tokens: Vec::new(),
            max_new_tokens: 32,
            temperature: 0.0,
            on_unparsed: OnUnparsed::Error,
            unparsed_reward: 0.0,
        }
    }
}

/// `[judge]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("judge", "path", Rl, "The judge's HuggingFace checkpoint folder (a causal LM; required when reward.kind = \"judge\" or a [[reward.terms]] entry has rule = \"judge\"). It runs in the reward stage (on the rollout workers, or on placement.judge's), through weir's own generator (batched; a step's judging overlaps the next batch's generation), in model.dtype on model.device."),
    key("judge", "template", Rl, "The judge's prompt, a minijinja template over `prompt` (the prompt as the file gives it: for prompts rendered through the policy's chat template, the conversation's one message besides the system's, or each as `role: content`, never the policy's markup), `response` (the completion, cut at its end-of-turn marker), `label` (data.label_column's value) and the prompt file's other columns by name; a name that is none of these is refused."),
    key("judge", "chat", Rl, "Give the rendered template to the judge as a user message through its tokenizer's chat template (with the generation prompt); false: the text is the judge's prompt as is."),
    key("judge", "verdict", Rl, "How the judge's answer becomes the reward: \"regex\" (the first group of judge.pattern in the generated text, read as a number) or \"probability\" (Σ p(token) over judge.verdict_tokens at the judge's first generated position: no generation, one forward pass)."),
    key("judge", "pattern", Rl, "verdict = \"regex\": the pattern (Rust regex syntax) whose first capture group, in its first match, is the reward; it must have a group."),
    key("judge", "verdict_tokens", Rl, "verdict = \"probability\": the tokens (text, e.g. [\"Yes\"]) whose summed probability is the reward; each must be exactly one token to the judge's tokenizer."),
    key("judge", "max_new_tokens", Rl, "verdict = \"regex\": tokens the judge generates at most (its own budget)."),
    key("judge", "temperature", Rl, "verdict = \"regex\": the judge's sampling temperature (0: greedy; sampled with the run's seed, a stream per row)."),
    key("judge", "on_unparsed", Rl, "verdict = \"regex\": an answer the pattern finds no number in stops the run with an error naming the row and the judge's text (\"error\"), or gets judge.unparsed_reward (\"reward\"); the share of such rows is the metric judge_unparsed."),
    key("judge", "unparsed_reward", Rl, "on_unparsed = \"reward\": the reward of an unparsed answer."),
];

impl JudgeSection {
    /// A causal LM checkpoint folder, a template that compiles, a pattern
    /// with a group, verdict tokens of one token each, a chat template
    /// when asked for one (the caller checks it only when a judge scores:
    /// [`super::RunConfig::uses_judge`]). The names the template reads are
    /// checked against the prompt file's columns when the judge starts.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        use weir_operators::rewards::judge::Verdict;
        let j = self;
        let shown = format!("{:?}", j.path.display().to_string());
        if j.path.as_os_str().is_empty() {
            return bad(
                "judge.path",
                shown,
                "a judge reward needs the judge's checkpoint folder",
            );
        }
        if !j.path.join("config.json").is_file() {
            return bad(
                "judge.path",
                shown,
                "no config.json there: not a HuggingFace checkpoint folder",
            );
        }
        let tokenizer = match weir_gpu::Tokenizer::load(&j.path) {
            Ok(t) => t,
            Err(e) => return bad("judge.path", shown, &e.to_string()),
        };
        if j.chat && tokenizer.chat_template().is_none() {
            return bad(
                "judge.chat",
                "true".into(),
                "the judge's tokenizer has no chat template (false gives the judge the text as is)",
            );
        }
        if let Err(why) = weir_operators::rewards::judge::compile(&j.template) {
            return bad("judge.template", format!("{:?}", j.template), &why);
        }
        match j.verdict {
            JudgeVerdict::Regex => {
                if let Err(why) = Verdict::regex(&j.pattern) {
                    return bad("judge.pattern", format!("{:?}", j.pattern), &why);
                }
                if j.max_new_tokens == 0 {
                    return bad(
                        "judge.max_new_tokens",
                        "0".into(),
                        "the judge must answer: at least 1",
                    );
                }
                if j.temperature != 0.0 {
                    if let Some(why) = weir_gpu::temperature_error(j.temperature) {
                        return bad("judge.temperature", j.temperature.to_string(), why);
                    }
                }
            }
            JudgeVerdict::Probability => {
                if let Err(why) = Verdict::probability(&tokenizer, &j.verdict_tokens) {
                    return bad(
                        "judge.verdict_tokens",
                        format!("{:?}", j.verdict_tokens),
                        &why,
                    );
                }
            }
        }
        if !j.unparsed_reward.is_finite() {
            return bad(
                "judge.unparsed_reward",
                j.unparsed_reward.to_string(),
                "must be a finite number",
            );
        }
        Ok(())
    }
}
