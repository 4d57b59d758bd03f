//! Rewards, every kind in this folder, each a stage that writes `reward`:
//! - the built-in rules (functions of a response's text and its row's
//!   reference answer, looked up by name from the config: `rules.rs`, and
//!   the arith task's `arith_exact_match`), as a stage in `rule_stage.rs`;
//! - rewards written in Rust by a user's own binary ([`Reward`], [`register`]);
//! - Python reward functions (`python.rs`);
//! - a reward model (`model.rs`), a generative judge (`judge.rs`) and an
//!   HTTP reward server (`remote.rs`);
//! - weighted sums of these (`terms.rs`);
//! - and DAPO's overlong penalty, shaping a reward (`overlong.rs`).
//!
//! `weir_pipelines::rewards` is the one factory that builds the stage a
//! config names.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use arrow::array::RecordBatch;
use weir_graph::StageError;

pub mod finish;
pub mod judge;
pub mod model;
pub mod overlong;
pub mod python;
pub mod remote;
pub mod rule_stage;
pub mod rules;
pub mod terms;

/// A rule reward: `reward(response_text, reference_answer)`.
pub type RuleReward = fn(&str, &str) -> f64;

/// The rule rewards weir ships, by config name.
pub fn rule_reward(name: &str) -> Option<RuleReward> {
    match name {
        "arith_exact_match" => Some(crate::tasks::arith::exact_match),
        "math" => Some(rules::math),
        "exact" => Some(rules::exact),
        "contains" => Some(rules::contains),
        _ => None,
    }
}

/// Names accepted by [`rule_reward`], for error messages and `weir config`.
pub const RULE_REWARDS: &[&str] = &["arith_exact_match", "math", "exact", "contains"];

/// A reward written in Rust: a step's rows in, one reward per row out.
///
/// A binary of your own registers it by name before handing over to
/// weir's command line, and configs name it like a built-in rule
/// (`reward.rule = "NAME"`, or a `[[reward.terms]]` entry's `rule`):
///
/// ```no_run
/// use weir_operators::rewards::{register, Reward, RewardRows, Scores};
/// use weir_graph::StageError;
///
/// struct Brevity;
///
/// impl Reward for Brevity {
///     fn score(&mut self, rows: &RewardRows<'_>) -> Result<Scores, StageError> {
///         let rewards = rows.responses.iter().map(|r| -(r.len() as f64) / 100.0).collect();
///         Ok(Scores { rewards, metrics: vec![] })
///     }
/// }
///
/// register("brevity", || Ok(Box::new(Brevity)));
/// // then: weir::cli::main()
/// ```
pub trait Reward: Send {
    /// One reward per row, in row order, and the step's metrics `(name, value)`.
    fn score(&mut self, rows: &RewardRows<'_>) -> Result<Scores, StageError>;
}

/// What a [`Reward`] sees of a step's rows.
pub struct RewardRows<'a> {
    /// The prompts as text.
    pub prompts: &'a [String],
    /// The responses as generated (end-of-turn tokens included;
    /// [`rules::completion`] cuts them).
    pub responses: &'a [String],
    /// The reference answers (`data.label_column`), if the rows have them.
    pub labels: Option<&'a [String]>,
    /// Every column of the rows (the prompt file's own columns among them).
    pub batch: &'a RecordBatch,
}

/// What a [`Reward`] returns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scores {
    /// One finite reward per row.
    pub rewards: Vec<f64>,
    /// Metrics of the step, recorded under the reward stage.
    pub metrics: Vec<(String, f64)>,
}

/// Builds a registered reward (once per worker that scores).
pub type RewardFactory = Arc<dyn Fn() -> Result<Box<dyn Reward>, StageError> + Send + Sync>;

fn registry() -> &'static Mutex<BTreeMap<String, RewardFactory>> {
    static REGISTRY: OnceLock<Mutex<BTreeMap<String, RewardFactory>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Registers a reward under `name` (a built-in rule's name cannot be taken).
pub fn register(
    name: &str,
    factory: impl Fn() -> Result<Box<dyn Reward>, StageError> + Send + Sync + 'static,
) {
    assert!(
        rule_reward(name).is_none(),
        "`{name}` is a built-in rule reward: register under another name"
    );
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), Arc::new(factory));
}

/// The factory registered under `name`.
pub fn registered(name: &str) -> Option<RewardFactory> {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(name)
        .cloned()
}

/// The names registered so far.
pub fn registered_names() -> Vec<String> {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .cloned()
        .collect()
}

/// A column's values as a reward function receives them: its texts, or,
/// for a column the prompt file holds as JSON numbers, booleans, lists or
/// objects (`typed`), the JSON values those texts hold.
pub fn column_values(texts: &[String], typed: bool) -> serde_json::Value {
    if !typed {
        return serde_json::json!(texts);
    }
    texts
        .iter()
        .map(|t| serde_json::from_str(t).unwrap_or_else(|_| serde_json::Value::String(t.clone())))
        .collect()
}

/// Checks a [`Reward`]'s answer for `rows` rows: the count, and every value finite.
pub fn check_scores(name: &str, scores: &Scores, rows: usize) -> Result<(), StageError> {
    if scores.rewards.len() != rows {
        return Err(format!(
            "reward `{name}` returned {} rewards for {rows} rows",
            scores.rewards.len()
        )
        .into());
    }
    if let Some(i) = scores.rewards.iter().position(|r| !r.is_finite()) {
        return Err(format!(
            "reward `{name}`: row {i}: the reward is {}: a reward must be a finite number",
            scores.rewards[i]
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_finds_known_rewards_only() {
        let f = rule_reward("arith_exact_match").unwrap();
        assert_eq!(f("12<|im_end|>", "12"), 1.0);
        assert!(rule_reward("nope").is_none());
        assert!(RULE_REWARDS.iter().all(|n| rule_reward(n).is_some()));
    }
}
