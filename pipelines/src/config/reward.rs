//! `[reward]` and `[[reward.terms]]`: where rewards come from and how they
//! are shaped: the section, its defaults, its rows of the key table and
//! its checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::text::spelt;
use super::validate::bad;
use super::{ConfigError, RewardKind};

/// `[reward]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `rule`, `model` or `remote`.
    pub kind: RewardKind,
    /// The rule's name (`reward.kind = "rule"`).
    pub rule: String,
    /// The reward server (`reward.kind = "remote"`).
    #[serde(with = "none_if_empty")]
    pub url: Option<String>,
    /// PEM certificates of authorities an `https://` reward server may be
    /// signed by, beside the system's.
    #[serde(with = "none_if_empty")]
    pub ca_file: Option<PathBuf>,
    /// Seconds per request before a retry.
    pub timeout_s: f64,
    /// Attempts per request.
    pub attempts: u32,
    /// The Python file of `reward.kind = "python"`.
    #[serde(with = "none_if_empty")]
    pub file: Option<PathBuf>,
    /// Its function: OpenRLHF's `reward_func(queries, prompts, labels,
    /// **kwargs)`, or verl's per-sample `compute_score`.
    pub function: String,
    /// The interpreter that runs it.
    pub python: String,
    /// Worker processes running it.
    pub workers: usize,
    /// The rewards of `reward.kind = "terms"`, summed with their weights
    /// (kept last: TOML writes arrays of tables after the plain keys).
    pub terms: Vec<RewardTerm>,
    /// DAPO's overlong buffer in tokens below `generate.max_new_tokens` (0: off).
    pub overlong_buffer: usize,
    /// The overlong penalty at `generate.max_new_tokens`.
    pub overlong_penalty_factor: f64,
    /// ProRL's stop-properly coefficient on truncated responses (1.0: off).
    pub stop_properly_coef: f64,
    /// Rewards that replace a row's by its `finish_reason` (e.g. `length = 0.0`).
    pub on_finish: std::collections::BTreeMap<String, f64>,
}

impl Default for RewardSection {
    fn default() -> Self {
        RewardSection {
            kind: RewardKind::Rule,
            rule: "arith_exact_match".into(),
            url: None,
            ca_file: None,
            timeout_s: 60.0,
            attempts: 3,
            file: None,
            function: "reward_func".into(),
            python: "python3".into(),
            workers: 2,
            terms: Vec::new(),
            overlong_buffer: 0,
            overlong_penalty_factor: 1.0,
            stop_properly_coef: 1.0,
            on_finish: Default::default(),
        }
    }
}

/// One `[[reward.terms]]` entry: a rule or a Python function, with a weight.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardTerm {
    /// Its metric is `reward_<name>` (default: the rule, or the function).
    #[serde(with = "none_if_empty")]
    pub name: Option<String>,
    /// A rule: `arith_exact_match`, `math`, `exact`, `contains`, `regex`, `length`.
    #[serde(with = "none_if_empty")]
    pub rule: Option<String>,
    /// Or a Python file (OpenRLHF's or verl's signature, as `reward.file`).
    #[serde(with = "none_if_empty")]
    pub file: Option<PathBuf>,
    /// The Python file's function.
    pub function: String,
    /// Its weight in the sum.
    pub weight: f64,
    /// The `regex` rule's pattern, matched against the whole completion.
    pub pattern: String,
    /// The `length` rule's length at which the penalty reaches −1 (0: generate.max_new_tokens).
    pub max_tokens: usize,
}

impl Default for RewardTerm {
    fn default() -> Self {
        RewardTerm {
            name: None,
            rule: None,
            file: None,
            function: "reward_func".into(),
            weight: 1.0,
            pattern: String::new(),
            max_tokens: 0,
        }
    }
}

impl RewardTerm {
    /// The name its metric carries.
    pub fn label(&self) -> String {
        self.name
            .clone()
            .or_else(|| self.rule.clone())
            .unwrap_or_else(|| self.function.clone())
    }
}

/// `[reward]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("reward", "kind", Rl, "\"rule\", \"model\" (model.reward_model), \"remote\" (an HTTP reward server), \"python\" (a function in reward.file), \"terms\" (several, weighted: reward.terms), \"judge\" (a generative judge's verdict: [judge]) or \"none\" (every row's reward 0: an environment's turn rewards, agent.environment, are the rewards)."),
    key("reward", "rule", Rl, "The rule reward: arith_exact_match, math (the final answer: last \\boxed{…}, #### x or last number; numbers, fractions, percentages, units), exact, contains."),
    key("reward", "url", Rl, "The reward server, e.g. http://10.0.0.7:5000/get_reward (OpenRLHF's protocol), or https://… (verified against the system's certificate authorities; SSL_CERT_FILE replaces them). Redirects are not followed; the proxy variables apply (HTTPS_PROXY, HTTP_PROXY, ALL_PROXY; NO_PROXY bypasses them) and the run logs the proxy it uses."),
    key("reward", "ca_file", Rl, "A PEM file of certificate authorities an https:// reward server may be signed by, beside the system's (a private CA)."),
    key("reward", "timeout_s", Rl, "Seconds per request (remote, python) before it is retried."),
    key("reward", "attempts", Rl, "Attempts per request (remote; python: when a worker dies or times out)."),
    key("reward", "file", Rl, "The Python file of reward.kind = \"python\"."),
    key("reward", "function", Rl, "Its function: OpenRLHF's reward_func(queries, prompts, labels, **columns) returning rewards (or {\"rewards\", \"scores\", \"extra_logs\"}), or verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info)."),
    key("reward", "python", Rl, "The interpreter that runs it (python3, or a venv's bin/python)."),
    key("reward", "workers", Rl, "Long-lived worker processes of the Python reward; a step's rows are split over them."),
    key("reward", "terms", Rl, "reward.kind = \"terms\": rewards summed with weights, each logged as reward_<name>: [[reward.terms]] with rule = \"math\" | \"exact\" | \"contains\" | \"arith_exact_match\" | \"regex\" (pattern = full match of the completion) | \"length\" (−tokens/max_tokens) | \"judge\" ([judge]'s verdict), or file (+ function) of a Python reward; weight (1), name."),
    key("reward", "overlong_buffer", Rl, "DAPO's soft overlong punishment: the last N tokens below generate.max_new_tokens where a response's reward falls linearly, to −overlong_penalty_factor at the maximum (0: off; any reward kind)."),
    key("reward", "overlong_penalty_factor", Rl, "The overlong penalty at generate.max_new_tokens."),
    key("reward", "stop_properly_coef", Rl, "ProRL's stop-properly penalty (OpenRLHF 0.11's reward.stop_properly_penalty_coef): a truncated response's reward (finish_reason length) is scaled by this coefficient when it is in [0, 1], or replaced by it when negative; 1.0 leaves rewards alone. Applied after the overlong penalty; stop_properly_truncated records the share of rows truncated."),
    key("reward", "on_finish", Rl, "Rewards that replace a row's by how it ended, a table from finish_reason (stop, length; for episodes also max_turns, tool_error, env_error, timeout) to the reward, e.g. {length = 0.0} to zero truncated responses; an episode's environment turn rewards are zeroed with it. Applied after every other reward shaping; finish_replaced records the share of rows replaced."),
];

/// The built-in rule rewards and those the running binary registered.
fn known_rules() -> Vec<String> {
    let mut names: Vec<String> = weir_operators::rewards::RULE_REWARDS
        .iter()
        .map(|s| s.to_string())
        .collect();
    names.extend(weir_operators::rewards::registered_names());
    names
}

impl RewardSection {
    /// The terms of `reward.kind = "terms"`, a stop-properly coefficient,
    /// a rule that exists, a timeout.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        self.check_terms()?;
        let coef = self.stop_properly_coef;
        if !coef.is_finite() || coef > 1.0 {
            return bad(
                "reward.stop_properly_coef",
                coef.to_string(),
                "a scale in [0, 1] for a truncated response's reward, or a negative reward to give it",
            );
        }
        if self.kind == RewardKind::Rule
            && weir_operators::rewards::rule_reward(&self.rule).is_none()
            && weir_operators::rewards::registered(&self.rule).is_none()
        {
            return bad(
                "reward.rule",
                format!("{:?}", self.rule),
                &format!("must be one of {:?}", known_rules()),
            );
        }
        if !(self.timeout_s > 0.0 && self.timeout_s <= 86_400.0) {
            return bad(
                "reward.timeout_s",
                self.timeout_s.to_string(),
                "must be seconds in (0, 86400]",
            );
        }
        Ok(())
    }

    /// `[[reward.terms]]`: at least one for `reward.kind = "terms"`, each a
    /// known rule or an existing file, with the keys its rule reads, a
    /// finite weight and a name of its own.
    fn check_terms(&self) -> Result<(), ConfigError> {
        if self.kind == RewardKind::Terms {
            if self.terms.is_empty() {
                return bad(
                    "reward.terms",
                    "[]".into(),
                    "reward.kind = \"terms\" needs at least one [[reward.terms]]",
                );
            }
            let mut names = std::collections::BTreeSet::new();
            for (i, t) in self.terms.iter().enumerate() {
                let key = |k: &str| format!("reward.terms[{i}].{k}");
                if t.rule.is_none() == t.file.is_none() {
                    return bad(
                        &key("rule"),
                        spelt(&t.rule),
                        "give a term either a rule or a file",
                    );
                }
                let rule = t.rule.as_deref();
                let known = |r: &str| {
                    weir_operators::rewards::rule_reward(r).is_some()
                        || weir_operators::rewards::registered(r).is_some()
                        || matches!(r, "regex" | "length" | "judge")
                };
                if let Some(r) = rule.filter(|r| !known(r)) {
                    let mut rules = known_rules();
                    rules.extend(["regex", "length", "judge"].map(String::from));
                    return bad(
                        &key("rule"),
                        format!("{r:?}"),
                        &format!("must be one of {rules:?}"),
                    );
                }
                if rule == Some("regex") {
                    if let Err(e) = weir_operators::rewards::rules::full_match(&t.pattern) {
                        return bad(
                            &key("pattern"),
                            format!("{:?}", t.pattern),
                            &format!("not a regular expression: {e}"),
                        );
                    }
                } else if !t.pattern.is_empty() {
                    return bad(
                        &key("pattern"),
                        format!("{:?}", t.pattern),
                        "only the regex rule reads a pattern",
                    );
                }
                if t.max_tokens != 0 && rule != Some("length") {
                    return bad(
                        &key("max_tokens"),
                        t.max_tokens.to_string(),
                        "only the length rule reads max_tokens",
                    );
                }
                if t.file.as_ref().is_some_and(|f| !f.is_file()) {
                    return bad(&key("file"), spelt(&t.file), "no such file");
                }
                if !t.weight.is_finite() {
                    return bad(
                        &key("weight"),
                        t.weight.to_string(),
                        "must be a finite number",
                    );
                }
                if !names.insert(t.label()) {
                    return bad(
                        &key("name"),
                        format!("{:?}", t.label()),
                        "two terms share this name: name them",
                    );
                }
            }
        }
        Ok(())
    }

    /// Where the rewards come from: a Python file and its workers, a
    /// server, the authorities of an https:// server.
    pub(super) fn check_sources(&self) -> Result<(), ConfigError> {
        if self.kind == RewardKind::Python {
            let file = &self.file;
            if !file.as_ref().is_some_and(|f| f.is_file()) {
                return bad(
                    "reward.file",
                    spelt(file),
                    "reward.kind = \"python\" needs an existing .py file",
                );
            }
            if self.workers == 0 {
                return bad("reward.workers", "0".into(), "must be ≥ 1");
            }
        }
        if self.kind == RewardKind::Remote && self.url.is_none() {
            return bad(
                "reward.url",
                "\"\"".into(),
                "reward.kind = \"remote\" needs a server URL",
            );
        }
        if let Some(ca_file) = &self.ca_file {
            if !ca_file.is_file() {
                return bad("reward.ca_file", spelt(&self.ca_file), "no such file");
            }
            if !self
                .url
                .as_deref()
                .is_some_and(|u| u.starts_with("https://"))
            {
                return bad(
                    "reward.ca_file",
                    spelt(&self.ca_file),
                    "applies to an https:// reward.url only",
                );
            }
        }
        Ok(())
    }
}
