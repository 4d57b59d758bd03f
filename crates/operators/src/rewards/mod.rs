//! Rule rewards: functions of a response's text and its row's dataset
//! columns, looked up by name from the pipeline config.

pub mod arith;
pub mod python;
pub mod rules;
pub mod terms;

/// A rule reward: `reward(response_text, reference_answer)`.
pub type RuleReward = fn(&str, &str) -> f64;

/// The rule rewards weir ships, by config name.
pub fn rule_reward(name: &str) -> Option<RuleReward> {
    match name {
        "arith_exact_match" => Some(arith::exact_match),
        "math" => Some(rules::math),
        "exact" => Some(rules::exact),
        "contains" => Some(rules::contains),
        _ => None,
    }
}

/// Names accepted by [`rule_reward`], for error messages and `weir config`.
pub const RULE_REWARDS: &[&str] = &["arith_exact_match", "math", "exact", "contains"];

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
