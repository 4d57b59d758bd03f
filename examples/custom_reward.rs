//! A binary of your own with a reward written in Rust, and every command
//! of `weir`: it registers the reward, then hands over to weir's command line.
//!
//! ```sh
//! cargo run --release --example custom_reward -- run grpo --out runs/short \
//!     --set model.path=CKPT --set reward.rule=short_and_right
//! ```
//!
//! Run folders, resume, `weir inspect`, several processes: all as with
//! `weir` itself (start every process with this binary).

use weir::graph::StageError;
use weir::operators::rewards::{register, rules, Reward, RewardRows, Scores};

/// 1 for the right answer, less a little per character of the completion.
struct ShortAndRight {
    per_char: f64,
}

impl Reward for ShortAndRight {
    fn score(&mut self, rows: &RewardRows<'_>) -> Result<Scores, StageError> {
        let labels = rows
            .labels
            .ok_or_else(|| StageError::from("short_and_right needs data.label_column"))?;
        let mut right = 0.0;
        let rewards = rows
            .responses
            .iter()
            .zip(labels)
            .map(|(response, label)| {
                let correct = rules::exact(response, label);
                right += correct;
                correct - self.per_char * rules::completion(response).chars().count() as f64
            })
            .collect();
        let share = right / rows.responses.len().max(1) as f64;
        Ok(Scores {
            rewards,
            metrics: vec![("right".into(), share)],
        })
    }
}

fn main() {
    register("short_and_right", || {
        Ok(Box::new(ShortAndRight { per_char: 0.01 }))
    });
    weir::cli::main()
}
