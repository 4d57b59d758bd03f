//! The arith task (as `../shared/bench/trl/arith_task.py` defines it, so
//! weir's numbers compare with TRL's): prompt = the chat template of the
//! user message `Compute: A+B` with a generation prompt; answer = `A + B`;
//! reward 1.0 when the completion, cut at `<|im_end|>` and stripped, equals
//! the answer, else 0.0. The 500 evaluation pairs are shipped as data
//! (`data/arith_eval_pairs.json`, made by `scripts/make_arith_eval_pairs.py`).

/// The end-of-turn token that cuts a completion.
pub const END: &str = "<|im_end|>";

/// The user message of the pair (a, b).
pub fn user_message(a: u32, b: u32) -> String {
    format!("Compute: {a}+{b}")
}

/// 1.0 when `text`, cut at [`END`] and stripped of surrounding whitespace, equals `answer`.
pub fn exact_match(text: &str, answer: &str) -> f64 {
    let cut = text.split(END).next().unwrap_or("");
    if cut.trim() == answer.trim() {
        1.0
    } else {
        0.0
    }
}

/// The 500 fixed evaluation pairs, identical to `arith_task.eval_pairs()`.
pub fn eval_pairs() -> Vec<(u32, u32)> {
    const DATA: &str = include_str!("../../data/arith_eval_pairs.json");
    let pairs: Vec<[u32; 2]> = serde_json::from_str(DATA)
        .expect("the shipped eval-pair file is valid JSON (checked by a test)");
    pairs.into_iter().map(|[a, b]| (a, b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_match_cuts_at_the_end_token_and_strips() {
        assert_eq!(exact_match(" 127 <|im_end|>junk", "127"), 1.0);
        assert_eq!(exact_match("127", "127"), 1.0);
        assert_eq!(exact_match("1270<|im_end|>", "127"), 0.0);
        assert_eq!(exact_match("<|im_end|>127", "127"), 0.0);
        assert_eq!(exact_match("", "0"), 0.0);
        assert_eq!(user_message(3, 45), "Compute: 3+45");
    }

    #[test]
    fn eval_pairs_are_the_500_distinct_pairs_of_the_reference() {
        let pairs = eval_pairs();
        assert_eq!(pairs.len(), 500);
        let distinct: std::collections::BTreeSet<_> = pairs.iter().collect();
        assert_eq!(distinct.len(), 500);
        assert_eq!(&pairs[..3], &[(93, 34), (74, 48), (21, 92)]);
        // The fixtures record the same list (test data only).
        let reference = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures/models/arith-sft/reference.json");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(reference).unwrap()).unwrap();
        let want: Vec<(u32, u32)> = r["eval_pairs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_u64().unwrap() as u32))
            .collect();
        assert_eq!(pairs, want);
    }
}
