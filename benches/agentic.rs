//! Multi-turn episodes with a simulated tool latency: the episode pool
//! (an episode whose call is out leaves the decode pool, the others go on
//! decoding, it rejoins with its observation) against batch-level turns in
//! lockstep (every episode's turn `t` decodes as one batch, then every
//! call runs, then turn `t + 1`: TRL's tool loop), in one invocation, on
//! the same episodes.
//!
//! The setting: `tests/fixtures/models/arith-sft` decoding on libtorch ops
//! (`Backend::Torch`, the path a GPU runs: a pass costs about the same for
//! one sequence as for many); 32 episodes a batch (8 prompts × 4); an
//! environment that ends row `i`'s episode after `1 + i % 4` turns and
//! answers each step after a latency drawn from an exponential
//! distribution of mean `WEIR_BENCH_LATENCY_MS` (default 20 ms), seeded by
//! row and turn, so both schedules wait the same; as many calls at once as
//! episodes (a tool service that scales). Both schedules sample each turn
//! from the same random stream, and the bench checks that they produce the
//! same tokens.
//!
//! Each schedule runs `WEIR_BENCH_BATCHES` batches (default 6), in
//! alternating order; it reports generated tokens per second of wall time
//! and the time per batch. The last line is
//! `episodes_streaming_vs_lockstep_tokens_per_s=<f>`.
//!
//! `cargo bench --bench agentic`. Under `cargo test`, one small batch of
//! each checks that it works.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use weir::gpu::generate::Backend;
use weir::gpu::{Device, Model, SamplingParams, Tokenizer};
use weir::operators::agent::environment::{EnvFault, EnvStep, Environment, Observation};
use weir::operators::agent::episode::{Budgets, Episode, EpisodeRunner, OnError};
use weir::operators::agent::pool::{run_episodes, EpisodeInput, PoolSettings, Schedule};
use weir::operators::agent::tool_calls::Hermes;
use weir::operators::agent::tools::Tool;

/// Ends row `i`'s episode after `1 + i % 4` turns; answers each step after
/// an exponential latency of mean `mean`, drawn from (row, turn).
struct Slow {
    mean: Duration,
    row: u64,
    turns: u64,
    steps: u64,
}

impl Environment for Slow {
    fn reset(&mut self, row: &Value, _prompt: &str) -> Result<Option<String>, EnvFault> {
        self.row = row["i"].as_u64().ok_or("the row has no i")?;
        self.turns = 1 + self.row % 4;
        self.steps = 0;
        Ok(None)
    }

    fn step(&mut self, _action: &str) -> Result<EnvStep, EnvFault> {
        self.steps += 1;
        // A uniform from (row, step) through splitmix64, then −ln(u) · mean.
        let mut z = (self.row << 8 | self.steps).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        std::thread::sleep(self.mean.mul_f64(-u.ln()));
        Ok(EnvStep {
            observation: Observation::Text("\nAgain:".into()),
            reward: 0.0,
            done: self.steps == self.turns,
        })
    }
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let var = |name: &str, default: u64| -> u64 {
        std::env::var(name)
            .ok()
            .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
            .unwrap_or(default)
    };
    let batches = if benching {
        var("WEIR_BENCH_BATCHES", 6)
    } else {
        1
    };
    let episodes = if benching { 32 } else { 8 };
    let mean = Duration::from_millis(var("WEIR_BENCH_LATENCY_MS", 20));
    tch::set_num_threads(1);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/arith-sft");
    let model = Model::load(&dir, Device::Cpu, tch::Kind::Float).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let params = SamplingParams {
        max_new_tokens: 96,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        temperature: 1.0,
        seed: 7,
        ..Default::default()
    };
    let tools: std::sync::Arc<Vec<Box<dyn Tool>>> = std::sync::Arc::new(Vec::new());
    let runner = EpisodeRunner {
        tokenizer: &tokenizer,
        parser: &Hermes,
        tools: &tools,
        end_of_turn: "<|im_end|>".into(),
        budgets: Budgets {
            max_turns: 4,
            max_tokens: 96,
            max_observation_tokens: 16,
        },
        on_error: OnError::Observe,
    };
    let inputs = |batch: u64| -> Vec<EpisodeInput> {
        (0..episodes as u64)
            .map(|i| {
                let (a, b) = ((batch * 31 + i * 7) % 90 + 10, (i * 13) % 90 + 10);
                let messages =
                    vec![json!({"role": "user", "content": format!("Compute: {a}+{b}")})];
                EpisodeInput {
                    prompt: tokenizer
                        .encode_conversation(&messages, None, true)
                        .unwrap(),
                    messages,
                    stream: batch << 20 | i,
                    row: json!({"i": i}),
                }
            })
            .collect()
    };
    let run = |schedule: Schedule, batch: u64| -> (Vec<Episode>, Duration) {
        let mut environments: Vec<Box<dyn Environment>> = (0..episodes)
            .map(|_| {
                Box::new(Slow {
                    mean,
                    row: 0,
                    turns: 0,
                    steps: 0,
                }) as Box<dyn Environment>
            })
            .collect();
        let settings = PoolSettings {
            max_concurrency: episodes,
            call_deadline: None,
            schedule,
            backend: Backend::Torch,
        };
        let inputs = inputs(batch);
        let clock = Instant::now();
        let out = run_episodes(
            &runner,
            &model,
            &params,
            &inputs,
            tools.clone(),
            &mut environments,
            settings,
        )
        .expect("the episodes run");
        (out, clock.elapsed())
    };
    let generated = |episodes: &[Episode]| -> usize { episodes.iter().map(|e| e.counts().0).sum() };
    // One untimed batch of each warms the caches.
    run(Schedule::Streaming, u64::MAX >> 24);
    run(Schedule::Lockstep, u64::MAX >> 24);
    let (mut tokens, mut wall) = ([0usize; 2], [Duration::ZERO; 2]);
    let mut turns = 0usize;
    for batch in 0..batches {
        let order = if batch % 2 == 0 {
            [Schedule::Streaming, Schedule::Lockstep]
        } else {
            [Schedule::Lockstep, Schedule::Streaming]
        };
        let mut outs = Vec::new();
        for schedule in order {
            let (out, took) = run(schedule, batch);
            let k = usize::from(schedule == Schedule::Lockstep);
            tokens[k] += generated(&out);
            wall[k] += took;
            outs.push(out);
        }
        for (a, b) in outs[0].iter().zip(&outs[1]) {
            assert_eq!(
                a.tokens, b.tokens,
                "both schedules sample the same episodes"
            );
        }
        turns += outs[0].iter().map(|e| e.turns_taken).sum::<usize>();
    }
    let rate = |k: usize| tokens[k] as f64 / wall[k].as_secs_f64();
    println!(
        "{batches} batches of {episodes} episodes, {:.2} turns an episode, {} generated tokens a batch, latency mean {} ms",
        turns as f64 / (batches as usize * episodes) as f64,
        tokens[0] / batches as usize,
        mean.as_millis()
    );
    for (k, name) in ["streaming", "lockstep"].iter().enumerate() {
        println!(
            "{name:>10}: {:8.1} tokens/s, {:7.1} ms a batch",
            rate(k),
            wall[k].as_secs_f64() * 1e3 / batches as f64
        );
    }
    println!(
        "episodes_streaming_vs_lockstep_tokens_per_s={:.3}",
        rate(0) / rate(1)
    );
}
