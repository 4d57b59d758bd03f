//! The learner's training pass with packed micro-batches
//! (`algorithm.packing`) against today's sorted, padded ones, in one
//! invocation, on the long-tail lengths of the streaming bench: the
//! `arith-sft` checkpoint, 8 prompts × 4 samples a step (a group's samples
//! share their prompt), responses of 4 to 256 tokens drawn from a Pareto
//! distribution of shape 1 (`generate.long_tail = 1`), micro-batches cut
//! at 1,024 tokens (padded: rows × the widest; packed: in all).
//!
//! Each layout runs one warm-up update and then `WEIR_BENCH_UPDATES` (8)
//! timed ones (forward, backward and AdamW, one thread) on the same rows;
//! tokens/s counts each row's prompt and response once. Both layouts run a
//! prompt that rows of a micro-batch share once. The padding share is the
//! share of the positions the decoder layers run that hold no token; the
//! output head, which both run over each micro-batch's response width, is
//! counted alike and left out. The last line is
//!
//! ```text
//! packed_vs_padded_tokens_per_s=<packed ÷ padded> padding_share=<packed's>
//! ```
//!
//! `cargo bench --bench packing` (`WEIR_BENCH_MODEL=24.6m`: the random
//! 24.6M Llama of the TRL baseline instead); under `cargo test`, one
//! update each.

use std::path::{Path, PathBuf};
use std::time::Instant;

#[path = "support/random_llama.rs"]
mod random_llama;

use tch::Kind;
use weir::gpu::{Device, Model};
use weir::operators::data::columns::{float_list_array, token_list_array};
use weir::operators::rollout::col;
use weir::operators::stages::learner::{Learner, LearnerConfig};

const PROMPTS: usize = 8;
const SAMPLES: usize = 4;
const BUDGET: usize = 1024;

/// The step's rows: prompts (one per group) and long-tailed responses.
fn rows(vocab: i64) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut prompts, mut responses) = (Vec::new(), Vec::new());
    for g in 0..PROMPTS {
        let prompt: Vec<i64> = (0..12 + g as i64 % 5)
            .map(|i| 10 + (g as i64 * 7 + i) % (vocab - 20))
            .collect();
        for _ in 0..SAMPLES {
            // Pareto(1) between 4 and 256: 4 / u, capped.
            let u = ((next() >> 11) as f64 / (1u64 << 53) as f64).max(1e-9);
            let length = ((4.0 / u) as usize).clamp(4, 256);
            let response = (0..length)
                .map(|_| 10 + (next() % (vocab as u64 - 20)) as i64)
                .collect();
            prompts.push(prompt.clone());
            responses.push(response);
        }
    }
    (prompts, responses)
}

/// The share of the positions the decoder layers run that hold no token,
/// under each layout (padded, packed): each micro-batch runs its distinct
/// prompts once and every row's response.
fn padding_shares(prompts: &[Vec<i64>], responses: &[Vec<i64>]) -> (f64, f64) {
    let width = |i: usize| prompts[i].len() + responses[i].len().max(1);
    // (tokens, positions) of the rows `rows` as one micro-batch: distinct
    // prompts once, responses but the last token (whose state predicts
    // nothing); `padded` pads each to the micro-batch's longest.
    let count = |rows: &[usize], padded: bool| -> (usize, usize) {
        let mut distinct: Vec<&Vec<i64>> = rows.iter().map(|&i| &prompts[i]).collect();
        distinct.sort();
        distinct.dedup();
        let prompt_tokens: usize = distinct.iter().map(|p| p.len()).sum();
        let response = |i: usize| responses[i].len().saturating_sub(1);
        let tokens = prompt_tokens + rows.iter().map(|&i| response(i)).sum::<usize>();
        if !padded {
            return (tokens, tokens);
        }
        let prompt_width = distinct.iter().map(|p| p.len()).max().unwrap_or(0);
        let response_width = rows.iter().map(|&i| response(i)).max().unwrap_or(0);
        (
            tokens,
            distinct.len() * prompt_width + rows.len() * response_width,
        )
    };
    let share = |cuts: Vec<Vec<usize>>, padded: bool| {
        let (tokens, positions) = cuts
            .iter()
            .map(|rows| count(rows, padded))
            .fold((0, 0), |(t, p), (a, b)| (t + a, p + b));
        1.0 - tokens as f64 / positions as f64
    };
    // Padded: rows sorted by width, cut where rows × the widest passes the budget.
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    order.sort_by_key(|&i| width(i));
    let mut padded = Vec::new();
    let mut start = 0;
    for end in 1..=order.len() {
        if (end - start) * width(order[end - 1]) > BUDGET && end - 1 > start {
            padded.push(order[start..end - 1].to_vec());
            start = end - 1;
        }
    }
    padded.push(order[start..].to_vec());
    // Packed: rows in order, cut where their tokens pass the budget.
    let mut packed = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for i in 0..prompts.len() {
        let row = prompts[i].len() + responses[i].len();
        if tokens + row > BUDGET && i > start {
            packed.push((start..i).collect());
            (start, tokens) = (i, 0);
        }
        tokens += row;
    }
    packed.push((start..prompts.len()).collect());
    (share(padded, true), share(packed, false))
}

/// Tokens/s of `updates` updates of the layout (after one warm-up).
fn tokens_per_s(dir: &Path, packing: bool, updates: usize) -> f64 {
    let model = Model::load(dir, Device::Cpu, Kind::Float).unwrap();
    let (prompts, responses) = rows(model.config.vocab_size);
    let advantages: Vec<Vec<f64>> = responses
        .iter()
        .enumerate()
        .map(|(i, r)| vec![if i % 2 == 0 { 0.5 } else { -0.5 }; r.len()])
        .collect();
    let behaviour: Vec<Vec<f64>> = responses.iter().map(|r| vec![-1.0; r.len()]).collect();
    let batch = arrow::array::RecordBatch::try_from_iter([
        (col::PROMPT_TOKENS, token_list_array(&prompts)),
        (col::RESPONSE_TOKENS, token_list_array(&responses)),
        (col::ADVANTAGES, float_list_array(&advantages)),
        (col::BEHAVIOR_LOGPROBS, float_list_array(&behaviour)),
    ])
    .unwrap();
    let cfg = LearnerConfig {
        micro_batch: PROMPTS * SAMPLES,
        micro_batch_tokens: BUDGET,
        packing,
        ..LearnerConfig::default()
    };
    let mut learner = Learner::new(model, cfg).unwrap();
    learner.update(&batch).unwrap();
    let tokens: usize = prompts
        .iter()
        .zip(&responses)
        .map(|(p, r)| p.len() + r.len())
        .sum();
    let started = Instant::now();
    for _ in 0..updates {
        learner.update(&batch).unwrap();
    }
    (tokens * updates) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    tch::set_num_threads(1);
    // `WEIR_BENCH_MODEL=24.6m`: the random 24.6M Llama of the TRL baseline.
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = match std::env::var("WEIR_BENCH_MODEL").as_deref() {
        Ok("24.6m") => random_llama::random_llama(tmp.path()),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/arith-sft"),
    };
    println!("model={}", dir.file_name().unwrap().to_string_lossy());
    let updates: usize = if full {
        std::env::var("WEIR_BENCH_UPDATES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8)
    } else {
        1
    };
    let (prompts, responses) = rows(
        Model::load(&dir, Device::Cpu, Kind::Float)
            .unwrap()
            .config
            .vocab_size,
    );
    let (padded_share, packed_share) = padding_shares(&prompts, &responses);
    let real: usize = prompts
        .iter()
        .zip(&responses)
        .map(|(p, r)| p.len() + r.len())
        .sum();
    let lengths: Vec<usize> = responses.iter().map(Vec::len).collect();
    println!(
        "rows={} response_lengths min={} max={} tokens={real}",
        lengths.len(),
        lengths.iter().min().unwrap(),
        lengths.iter().max().unwrap()
    );
    let padded = tokens_per_s(&dir, false, updates);
    let packed = tokens_per_s(&dir, true, updates);
    println!("padded tokens_per_s={padded:.0} padding_share={padded_share:.4}");
    println!("packed tokens_per_s={packed:.0} padding_share={packed_share:.4}");
    println!(
        "packed_vs_padded_tokens_per_s={:.3} padding_share={packed_share:.4}",
        packed / padded
    );
}
