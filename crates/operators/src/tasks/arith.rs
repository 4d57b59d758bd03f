//! The arith task (as `../shared/bench/trl/arith_task.py` defines it, so
//! weir's numbers compare with TRL's): prompt = the chat template of the
//! user message `Compute: A+B` with a generation prompt; answer = `A + B`;
//! reward 1.0 when the completion, cut at `<|im_end|>` and stripped, equals
//! the answer, else 0.0. The 500 evaluation pairs are shipped as data
//! (`data/arith_eval_pairs.json`, made by `scripts/make_arith_eval_pairs.py`).

use weir_gpu::{Message, Tokenizer};
use weir_graph::StageError;

use crate::data::prompt_files::PromptRow;
use crate::stages::prompts::{PromptSource, Tokenize};

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

/// Greedy exact-match accuracy on `pairs` (as `arith_task.greedy_accuracy`:
/// chat prompt with a generation prompt, at most 6 new tokens, stop at the
/// end token), `batch` prompts at a time; also the first five
/// `("A+B", completion)` pairs to show.
pub fn greedy_accuracy(
    model: &weir_gpu::Model,
    tokenizer: &weir_gpu::Tokenizer,
    pairs: &[(u32, u32)],
    batch: usize,
) -> Result<(f64, Vec<(String, String)>), weir_gpu::ModelError> {
    let _guard = tch::no_grad_guard();
    let params = weir_gpu::SamplingParams {
        max_new_tokens: 6,
        greedy: true,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        ..Default::default()
    };
    let (mut correct, mut shown) = (0usize, Vec::new());
    for chunk in pairs.chunks(batch.max(1)) {
        let prompts = chunk
            .iter()
            .map(|&(a, b)| {
                tokenizer.encode_chat(
                    &[weir_gpu::Message {
                        role: "user".into(),
                        content: user_message(a, b),
                    }],
                    true,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (g, &(a, b)) in weir_gpu::generate(model, &prompts, &params)?
            .iter()
            .zip(chunk)
        {
            let text = tokenizer.decode(&g.tokens, false)?;
            correct += (exact_match(&text, &(a + b).to_string()) == 1.0) as usize;
            if shown.len() < 5 {
                shown.push((format!("{a}+{b}"), text));
            }
        }
    }
    Ok((correct as f64 / pairs.len().max(1) as f64, shown))
}

/// Training pairs: every (a, b) in 0..100² that is not an evaluation pair,
/// in a seeded order.
pub fn train_pairs(seed: u64) -> Vec<(u32, u32)> {
    let held: std::collections::HashSet<(u32, u32)> = eval_pairs().into_iter().collect();
    let mut pairs: Vec<(u32, u32)> = (0..100)
        .flat_map(|a| (0..100).map(move |b| (a, b)))
        .filter(|p| !held.contains(p))
        .collect();
    // Fisher–Yates with splitmix64.
    let mut state = seed;
    for i in (1..pairs.len()).rev() {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        pairs.swap(i, (z % (i as u64 + 1)) as usize);
    }
    pairs
}

/// The arith task's prompts for `pairs`, with an `answer` column.
pub fn prompts(
    pairs: &[(u32, u32)],
    tokenizer: &Tokenizer,
    prompts_per_step: usize,
    samples: usize,
    seed: u64,
) -> Result<PromptSource, StageError> {
    let rows = pairs
        .iter()
        .map(|&(a, b)| PromptRow {
            prompt: user_message(a, b),
            messages: None,
            tokens: Vec::new(),
            extra: vec![(a + b).to_string()],
        })
        .collect();
    let source = PromptSource::new(rows, vec!["answer".into()], prompts_per_step, samples, seed)?;
    Ok(source.tokenized_when_drawn(chat_tokens(tokenizer)))
}

/// The token ids of a row's user message in `tokenizer`'s chat template,
/// with a generation prompt.
fn chat_tokens(tokenizer: &Tokenizer) -> Tokenize {
    let tokenizer = tokenizer.clone();
    Tokenize(std::sync::Arc::new(move |row: &PromptRow| {
        let messages = [Message {
            role: "user".into(),
            content: row.prompt.clone(),
        }];
        Ok(tokenizer.encode_chat(&messages, true)?)
    }))
}

/// The arith task as preference pairs: columns `chosen` (the sum) and
/// `rejected` (a wrong sum, off by 1–10, fixed per pair).
pub fn preferences(
    pairs: &[(u32, u32)],
    tokenizer: &Tokenizer,
    prompts_per_step: usize,
    seed: u64,
) -> Result<PromptSource, StageError> {
    let src = prompts(pairs, tokenizer, prompts_per_step, 1, seed)?;
    let rows = src
        .rows()
        .iter()
        .zip(pairs)
        .map(|(r, &(a, b))| {
            let sum = a + b;
            let off = 1 + (a * 31 + b * 17) % 10;
            let wrong = if (a + b) % 2 == 0 || sum < off {
                sum + off
            } else {
                sum - off
            };
            PromptRow {
                extra: vec![sum.to_string(), wrong.to_string()],
                ..r.clone()
            }
        })
        .collect();
    let source = PromptSource::new(
        rows,
        vec!["chosen".into(), "rejected".into()],
        prompts_per_step,
        1,
        seed,
    )?;
    Ok(source.tokenized_when_drawn(chat_tokens(tokenizer)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn train_pairs_exclude_the_evaluation_pairs() {
        let train = train_pairs(1);
        assert_eq!(train.len(), 10_000 - 500);
        let eval: std::collections::HashSet<_> = eval_pairs().into_iter().collect();
        assert!(train.iter().all(|p| !eval.contains(p)));
        assert_ne!(train[..10], train_pairs(2)[..10], "the seed orders them");
    }

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
            .join("../../tests/fixtures/models/arith-sft/reference.json");
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
