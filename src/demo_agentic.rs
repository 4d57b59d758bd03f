//! `weir demo --agentic`: a small model learns to call a calculator for
//! the multiplications it cannot do in its head, on CPU.
//!
//! 1. The task: `Compute: A*B` for two-digit A and B; 200 pairs are held
//!    out for evaluation, the rest train.
//! 2. A byte-level BPE tokenizer trained on the task's conversations, a
//!    chat template that renders the tools' names in a system turn, and a
//!    small Llama with fresh weights.
//! 3. A short SFT on conversations of two kinds: most answer at once (a
//!    guess: the model cannot multiply), the rest call
//!    `calculator` with the product and then answer with what it said. So
//!    the model knows the call's form but seldom makes one.
//! 4. GRPO with the `calculator` tool (`agent.tools`), the exact-match
//!    reward on the episode's last turn: a right answer is almost always
//!    one that called the tool, so calling it is what is reinforced.
//! 5. Greedy episodes on the held-out pairs before and after GRPO:
//!    accuracy and the share that called the tool, in `summary.json`
//!    (`accuracy_before`, `accuracy_after`, `tool_call_rate_before`,
//!    `tool_call_rate_after`), with the runs' plots.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use serde_json::{json, Value};
use weir_gpu::{Device, Model, SamplingParams, Tokenizer};
use weir_operators::agent::episode::{Budgets, EpisodeRunner, OnError};
use weir_operators::agent::pool::{run_episodes, EpisodeInput, PoolSettings, Schedule};
use weir_operators::agent::tool_calls::Hermes;
use weir_operators::agent::tools::{Calculator, Tool};
use weir_pipelines::config::Task;
use weir_pipelines::runner::RunRequest;
use weir_pipelines::{PipelineKind, RunConfig};

/// The chat template: the tools' names in a system turn, every message in
/// ChatML. An SFT conversation that starts with that system message
/// renders as an episode's prompt does.
const TEMPLATE: &str = "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The system message the template renders for the calculator.
const SYSTEM: &str = "Tools: calculator";

/// Held-out pairs.
const EVAL_PAIRS: usize = 200;

/// Settings of `weir demo --agentic`.
#[derive(Clone, Debug)]
pub struct AgenticSettings {
    /// The demo's folder.
    pub out: PathBuf,
    /// SFT steps (64 rows each).
    pub sft_steps: u64,
    /// The share of SFT problems whose conversation calls the tool.
    pub tool_share: f64,
    /// GRPO steps (8 prompts × 8 samples).
    pub grpo_steps: u64,
    /// GRPO's learning rate.
    pub grpo_lr: f64,
    /// Seed of the split, the tokenizer corpus, the weights and sampling.
    pub seed: u64,
    /// No progress bars.
    pub quiet: bool,
}

/// Every pair `(a, b)` of two-digit numbers, in a seeded order: the first
/// [`EVAL_PAIRS`] held out, the rest for training.
fn pairs(seed: u64) -> Vec<(u32, u32)> {
    let mut all: Vec<(u32, u32)> = (10..100u32)
        .flat_map(|a| (10..100u32).map(move |b| (a, b)))
        .collect();
    let mut state = seed | 1;
    for i in (1..all.len()).rev() {
        // xorshift64*: a seeded Fisher–Yates shuffle.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        all.swap(i, (r % (i as u64 + 1)) as usize);
    }
    all
}

fn question(a: u32, b: u32) -> String {
    format!("Compute: {a}*{b}")
}

fn call(a: u32, b: u32) -> String {
    format!("<tool_call>{{\"name\": \"calculator\", \"arguments\": {{\"expression\": \"{a}*{b}\"}}}}</tool_call>")
}

/// The SFT rows of one problem: `(messages, target)`.
fn sft_rows(a: u32, b: u32, with_tool: bool) -> Vec<(Vec<Value>, String)> {
    let start = vec![
        json!({"role": "system", "content": SYSTEM}),
        json!({"role": "user", "content": question(a, b)}),
    ];
    let product = (a * b).to_string();
    if !with_tool {
        return vec![(start, product)];
    }
    let mut after = start.clone();
    after.push(json!({"role": "assistant", "content": call(a, b)}));
    after.push(json!({"role": "tool", "content": product}));
    vec![(start, call(a, b)), (after, product)]
}

/// Runs the agentic demo.
pub fn run(s: &AgenticSettings) -> anyhow::Result<()> {
    let started = Instant::now();
    let out = &s.out;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    println!(
        "weir demo --agentic: SFT on a few calculator calls, then GRPO with the calculator tool, in {}",
        out.display()
    );
    let all = pairs(s.seed);
    let (held_out, train) = all.split_at(EVAL_PAIRS);
    let init = out.join("init");
    let (vocab, params) = prepare(s, train, &init)?;
    println!("tokenizer: byte-level BPE, {vocab} tokens; model: Llama, {params} parameters");
    let (sft_file, grpo_file) = (out.join("sft.jsonl"), out.join("problems.jsonl"));

    let mut sft = RunConfig::defaults_for(PipelineKind::Sft);
    sft.model.path = init.clone();
    sft.run.seed = s.seed;
    sft.run.steps = s.sft_steps;
    sft.run.threads = 2;
    sft.data.prompts = Task::File(sft_file);
    sft.data.messages_column = Some("messages".into());
    sft.data.label_column = Some("target".into());
    sft.eval.arith = false;
    let sft_started = Instant::now();
    let sft_run = weir_pipelines::run(&RunRequest {
        pipeline: PipelineKind::Sft,
        config: sft,
        run_dir: out.join("sft"),
        resume: false,
        progress: !s.quiet,
        cluster: Default::default(),
    })?;
    let sft_wall = sft_started.elapsed().as_secs_f64();
    let before = evaluate(&sft_run.final_actor, held_out, s.seed)?;
    println!(
        "sft: {} steps ({sft_wall:.0} s), loss {:.3}; held-out: accuracy {:.1}%, tool calls {:.1}%",
        s.sft_steps,
        sft_run.summary["loss_last"].as_f64().unwrap_or(f64::NAN),
        100.0 * before.accuracy,
        100.0 * before.tool_call_rate
    );

    let mut grpo = RunConfig::defaults_for(PipelineKind::Grpo);
    grpo.model.path = sft_run.final_actor.clone();
    grpo.run.steps = s.grpo_steps;
    grpo.run.seed = s.seed;
    grpo.run.threads = 2;
    grpo.data.prompts = Task::File(grpo_file);
    grpo.data.prompt_column = "prompt".into();
    grpo.data.label_column = Some("answer".into());
    grpo.data.prompts_per_step = 8;
    grpo.data.samples_per_prompt = 8;
    grpo.generate.max_new_tokens = 64;
    grpo.algorithm.lr = s.grpo_lr;
    grpo.algorithm.kl_coef = 0.0;
    grpo.eval.arith = false;
    grpo.agent.tools = vec!["calculator".into()];
    grpo.agent.max_turns = 2;
    let grpo_started = Instant::now();
    let rl = weir_pipelines::run(&RunRequest {
        pipeline: PipelineKind::Grpo,
        config: grpo,
        run_dir: out.join("grpo"),
        resume: false,
        progress: !s.quiet,
        cluster: Default::default(),
    })?;
    let grpo_wall = grpo_started.elapsed().as_secs_f64();
    let after = evaluate(&rl.final_actor, held_out, s.seed)?;
    let summary = json!({
        "accuracy_before": before.accuracy,
        "accuracy_after": after.accuracy,
        "tool_call_rate_before": before.tool_call_rate,
        "tool_call_rate_after": after.tool_call_rate,
        "held_out_problems": held_out.len(),
        "sft_steps": s.sft_steps,
        "sft_tool_share": s.tool_share,
        "grpo_steps": s.grpo_steps,
        "reward_first": rl.summary["reward_first"],
        "reward_last": rl.summary["reward_last"],
        "sft_wall_s": sft_wall,
        "grpo_wall_s": grpo_wall,
        "total_wall_s": started.elapsed().as_secs_f64(),
        "tokenizer_vocab": vocab,
        "model_parameters": params,
        "sft_run": out.join("sft").display().to_string(),
        "grpo_run": out.join("grpo").display().to_string(),
    });
    crate::demo_model::write_summary(out, &summary, &[&sft_run.run_dir, &rl.run_dir])?;
    println!(
        "grpo: {} steps in {grpo_wall:.0} s; held-out greedy episodes: accuracy {:.1}% → {:.1}%, tool calls {:.1}% → {:.1}%",
        s.grpo_steps,
        100.0 * before.accuracy,
        100.0 * after.accuracy,
        100.0 * before.tool_call_rate,
        100.0 * after.tool_call_rate
    );
    println!("run folder: {}", out.display());
    Ok(())
}

/// Writes the SFT conversations (`DIR/../sft.jsonl`) and the GRPO problems
/// (`DIR/../problems.jsonl`) of the `train` pairs, and in `init` a tokenizer
/// trained on the conversations, the chat template and a fresh model;
/// returns the vocabulary and parameter counts.
fn prepare(s: &AgenticSettings, train: &[(u32, u32)], init: &Path) -> anyhow::Result<(usize, i64)> {
    let mut rng = s.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut rows = Vec::new();
    for &(a, b) in train {
        rows.extend(sft_rows(a, b, uniform() < s.tool_share));
    }
    std::fs::create_dir_all(init)?;
    let corpus: Vec<String> = rows
        .iter()
        .take(4000)
        .map(|(messages, target)| {
            let mut text = String::new();
            for m in messages {
                text.push_str(&format!(
                    "<|im_start|>{}\n{}<|im_end|>\n",
                    m["role"].as_str().unwrap_or(""),
                    m["content"].as_str().unwrap_or("")
                ));
            }
            format!("{text}<|im_start|>assistant\n{target}<|im_end|>\n")
        })
        .collect();
    let vocab = weir_gpu::tokenizer::train_chatml_bpe(&corpus, 400, init)
        .context("training the tokenizer")?;
    let template = init.join("chat_template.jinja");
    weir_durable::write(&template, TEMPLATE.as_bytes())
        .with_context(|| format!("writing {}", template.display()))?;
    let params = crate::demo_model::make_model(init, vocab, s.seed as i64)?;
    let sft: Vec<Value> = rows
        .iter()
        .map(|(messages, target)| json!({"messages": messages, "target": target}))
        .collect();
    write_lines(&s.out.join("sft.jsonl"), &sft)?;
    let problems: Vec<Value> = train
        .iter()
        .map(|&(a, b)| json!({"prompt": question(a, b), "answer": (a * b).to_string()}))
        .collect();
    write_lines(&s.out.join("problems.jsonl"), &problems)?;
    Ok((vocab, params))
}

/// `values` as JSON lines in `path`.
fn write_lines(path: &Path, values: &[Value]) -> anyhow::Result<()> {
    weir_durable::write_with(path, |file| {
        let mut file = std::io::BufWriter::new(file);
        for v in values {
            writeln!(file, "{v}")?;
        }
        file.flush()
    })
    .with_context(|| format!("writing {}", path.display()))
}

/// Greedy episodes' figures on held-out problems.
struct Scores {
    accuracy: f64,
    tool_call_rate: f64,
}

/// Runs a greedy episode with the calculator on each of `pairs` with the
/// checkpoint in `dir`: the share answered right (the last turn is the
/// product) and the share that called the tool.
fn evaluate(dir: &Path, pairs: &[(u32, u32)], seed: u64) -> anyhow::Result<Scores> {
    let model = Model::load(dir, Device::Cpu, tch::Kind::Float)?;
    let tokenizer = Tokenizer::load(dir)?;
    let tools: std::sync::Arc<Vec<Box<dyn Tool>>> = std::sync::Arc::new(vec![Box::new(Calculator)]);
    let schemas = weir_operators::agent::tools::schemas(&tools);
    let runner = EpisodeRunner {
        tokenizer: &tokenizer,
        parser: &Hermes,
        tools: &tools,
        end_of_turn: "<|im_end|>".into(),
        budgets: Budgets {
            max_turns: 2,
            max_tokens: 64,
            max_observation_tokens: 32,
        },
        on_error: OnError::Observe,
    };
    let inputs = pairs
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| {
            let messages = vec![json!({"role": "user", "content": question(a, b)})];
            Ok(EpisodeInput {
                prompt: tokenizer.encode_conversation(&messages, Some(&schemas), true)?,
                messages,
                stream: seed ^ i as u64,
                row: Value::Null,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let params = SamplingParams {
        max_new_tokens: 64,
        eos_token_ids: tokenizer.eos_token_ids().to_vec(),
        greedy: true,
        seed,
        ..Default::default()
    };
    let settings = PoolSettings {
        max_concurrency: 8,
        call_deadline: None,
        schedule: Schedule::Streaming,
        backend: weir_gpu::generate::Backend::Auto,
    };
    let episodes = run_episodes(
        &runner,
        &model,
        &params,
        &inputs,
        tools.clone(),
        &mut Vec::new(),
        settings,
    )?;
    let (mut right, mut called) = (0, 0);
    for (episode, &(a, b)) in episodes.iter().zip(pairs) {
        let last = episode.generated_by_turn().pop().unwrap_or_default();
        let ids: Vec<i64> = last.iter().map(|&i| episode.tokens[i]).collect();
        let answer = tokenizer.decode(&ids, true)?;
        right += usize::from(answer.trim() == (a * b).to_string());
        called += usize::from(!episode.calls.is_empty());
    }
    let n = pairs.len().max(1) as f64;
    Ok(Scores {
        accuracy: right as f64 / n,
        tool_call_rate: called as f64 / n,
    })
}
