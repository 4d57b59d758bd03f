//! Every key that `weir config PIPELINE` prints changes what a run of that
//! pipeline does (its rows, metrics, files or weights) or is refused with
//! an error naming it; none is silently ignored, and a run that fails for
//! another reason does not count.
//!
//! For each pipeline, a small deterministic base run (one step, k = 0; two
//! steps for a key that does not act on the first) is compared with a run
//! that changes one key; a key that chooses between behaviours, with each
//! of its values. Pipelines built by the same function as another walk the
//! `algorithm` keys each, but those only the learner reads (the same
//! function for every RL pipeline), with one value a key (otb its
//! `generate` keys too: its sampler records each token's Σπ²). The
//! sections only the rollout chain reads (rewards, episodes, the judge,
//! the evaluation), the same function for every RL pipeline, are walked by
//! grpo alone. Some keys only act under another setting (a bound of the
//! correction needs a correction): those are changed on top of that
//! setting, compared with a base that has it.
//! A few keys are speed and memory knobs by design (threads, idle workers,
//! micro-batches, gradient checkpointing, the optimizer's sharding, the evaluation's batch): their runs must succeed and are
//! held to the same results elsewhere (the learner's tests); they are
//! listed in [`PERFORMANCE`].
//!
//! A binary of its own: a walk changes `run.threads`, a process-wide
//! setting of libtorch's, so its runs stay out of the other tests' way.

use std::collections::BTreeMap;
use std::path::Path;

use arrow::array::RecordBatch;
use weir::graph::metrics::names;
use weir::graph::parquet_log::{read_parquet_dir, read_parquet_file};
use weir::operators::rollout::col;
use weir::pipelines::config::{applies, Key, KEYS};
use weir::pipelines::{PipelineKind, RunConfig};

#[path = "pipelines/support.rs"]
mod support;
use support::{config, echo_judge, fixture, request, reward_server, with_tool_template};

/// Keys that change speed or memory only (`generate.backend`: the two
/// runtimes are held to the same tokens by the runtime's tests); and `generate.on_new_weights`,
/// whose effect depends on whether new weights land while sequences are in
/// flight, which timing decides (`tests/pipelines.rs` holds streaming runs
/// to the synchronous rows at k = 0, and the runtime's tests hold each
/// policy to its definition).
const PERFORMANCE: &[&str] = &[
    "generate.max_inflight",
    "generate.on_new_weights",
    "generate.backend",
    "run.threads",
    "placement.workers",
    "placement.weights_channel",
    "placement.weights_port",
    "placement.weights_bucket_mib",
    "placement.encrypt",
    "placement.shard_optimizer",
    "algorithm.micro_batch",
    "algorithm.micro_batch_tokens",
    "algorithm.gradient_checkpointing",
    "algorithm.packing",
    "algorithm.logprob_chunk",
    "eval.batch",
    "reward.workers",
    "agent.max_concurrency",
];

/// Keys whose effect depends on what the model writes, which the fixture
/// model does not: `agent.tool_format` reads calls in another family's
/// format, and the arith model writes none in any (the parsers' own tests
/// hold each format to its calls); `agent.python_network` acts on the
/// python tool's runs, which the arith model never calls (the tool's own
/// tests hold it to the network it allows). Their runs must succeed.
const MODEL_DEPENDENT: &[&str] = &["agent.tool_format", "agent.python_network"];

/// Keys whose effect is to let a run go on that fails without them (with
/// an error naming the key): the run with the key must run, the one
/// without it must fail so.
const RESCUES: &[&str] = &["data.skip_long_prompts", "judge.verdict_tokens"];

/// Changes that make a run fail with an error that does not name the key
/// (it names what went wrong instead), with a part of that error: any
/// other failure must name its key, so that a run that fails for an
/// unrelated reason never counts as the key changing the run.
const REFUSALS: &[(&str, &str)] = &[
    // A probability verdict needs its tokens.
    ("judge.verdict", "judge.verdict_tokens"),
];

/// Metrics that depend on timing, not on what the run computed.
const TIMING: &[&str] = &[
    names::BUSY_S,
    names::WEIGHTS_TRANSFER_S,
    names::WEIGHTS_LOAD_S,
    names::DONE_UNIX_S,
    names::QUEUE_PEAK,
    "row_latency_s",
    names::BATCHES_IN,
    names::IN_FLIGHT_STEPS,
];

/// What a run did, as far as a key can change it (timings aside).
enum Outcome {
    Failed(String),
    Ran {
        /// Per rollout column: its name and its values (numbers, or text).
        rows: Vec<(String, Values)>,
        files: Vec<String>,
        metrics: BTreeMap<(String, u32, String, Option<String>, u64), f64>,
        /// The final actor's safetensors file.
        weights: Vec<u8>,
        eval: Option<String>,
    },
}

/// Briefly: whether it failed, and why.
impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Failed(e) => write!(f, "Failed({e:?})"),
            Outcome::Ran { files, .. } => write!(f, "Ran {{ files: {files:?}, .. }}"),
        }
    }
}

/// A column's values: numbers (compared within rounding) or text.
#[derive(Debug)]
enum Values {
    Numbers(Vec<f64>),
    Text(String),
}

/// Whether two numbers agree up to the rounding that libtorch's thread
/// count (a process-wide setting that other tests of this binary change
/// while a run is in flight) can cause.
fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-2)
}

impl Values {
    fn differs(&self, other: &Values) -> Option<String> {
        match (self, other) {
            (Values::Numbers(a), Values::Numbers(b)) => {
                if a.len() != b.len() {
                    return Some(format!("{} vs {} values", a.len(), b.len()));
                }
                let i = a.iter().zip(b).position(|(x, y)| !close(*x, *y))?;
                Some(format!("value {i}: {} vs {}", a[i], b[i]))
            }
            (Values::Text(a), Values::Text(b)) if a == b => None,
            (a, b) => Some(format!("{a:?} vs {b:?}")),
        }
    }
}

fn numbers(array: &dyn arrow::array::Array) -> Option<Vec<f64>> {
    use arrow::array::{AsArray, ListArray};
    use arrow::datatypes::{DataType, Float64Type};
    let values = match array.data_type() {
        DataType::List(_) => {
            let list: &ListArray = array.as_list();
            let mut out: Vec<f64> = list.offsets().iter().map(|o| *o as f64).collect();
            out.extend(numbers(list.values().as_ref())?);
            return Some(out);
        }
        t if t.is_numeric() => arrow::compute::cast(array, &DataType::Float64).ok()?,
        _ => return None,
    };
    Some(values.as_primitive::<Float64Type>().values().to_vec())
}

fn rows_of(batches: &[RecordBatch]) -> Vec<(String, Values)> {
    batches
        .iter()
        .flat_map(|b| {
            b.schema()
                .fields()
                .iter()
                .zip(b.columns())
                .filter(|(f, _)| f.name() != col::GENERATE_S && f.name() != col::STARTED_UNIX_S)
                .map(|(f, c)| {
                    let values = match numbers(c.as_ref()) {
                        Some(n) => Values::Numbers(n),
                        None => Values::Text(format!("{c:?}")),
                    };
                    (f.name().clone(), values)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A safetensors file's bytes (empty when there is none).
fn weights_of(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_default()
}

/// Where two safetensors files differ (beyond rounding, when every tensor
/// is float32), if they do: their bytes compared first, numbers only when
/// the bytes differ.
fn weights_differ(a: &[u8], b: &[u8]) -> Option<String> {
    if a == b {
        return None;
    }
    let header = |bytes: &[u8]| -> Option<usize> {
        let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
        (bytes.len() >= 8 + n).then_some(8 + n)
    };
    let (Some(n), Some(m)) = (header(a), header(b)) else {
        return Some(format!("weights: {} vs {} bytes", a.len(), b.len()));
    };
    if a[..n] != b[..m] {
        return Some("weights: headers".into());
    }
    let text = String::from_utf8_lossy(&a[8..n]);
    if !text.contains("\"F32\"") || text.contains("\"BF16\"") || text.contains("\"F16\"") {
        return Some("weights: data".into());
    }
    let floats = |bytes: &[u8]| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (x, y) = (floats(&a[n..]), floats(&b[m..]));
    let i = x
        .iter()
        .zip(&y)
        .position(|(p, q)| !close(f64::from(*p), f64::from(*q)))?;
    Some(format!("weights: value {i}: {} vs {}", x[i], y[i]))
}

fn files_under(dir: &Path, root: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            files_under(&path, root, out);
        } else {
            let name = path.strip_prefix(root).unwrap().display().to_string();
            // An event file is named by the time and process that wrote it.
            out.push(match name.find("events.out.tfevents.") {
                Some(i) => format!("{}events.out.tfevents.*", &name[..i]),
                None => name,
            });
        }
    }
}

fn outcome(kind: PipelineKind, cfg: RunConfig, dir: &Path) -> Outcome {
    if let Err(e) = cfg.validate(kind) {
        return Outcome::Failed(e.to_string());
    }
    let done = match weir::pipelines::run(&request(kind, cfg, dir, false)) {
        Ok(done) => done,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    let rollouts = dir.join("rollouts");
    let rows = if rollouts.is_dir() {
        rows_of(&read_parquet_dir(&rollouts).unwrap())
    } else {
        Vec::new()
    };
    let mut files = Vec::new();
    files_under(dir, dir, &mut files);
    files.retain(|f| !f.starts_with("plots") && !f.ends_with("summary.json"));
    files.sort();
    let mut metrics = BTreeMap::new();
    for b in read_parquet_file(&dir.join("metrics.parquet")).unwrap() {
        for r in weir::graph::metrics::batch_to_rows(&b).unwrap() {
            if !TIMING.contains(&r.metric.as_str()) {
                metrics.insert((r.stage, r.worker, r.metric, r.label, r.step), r.value);
            }
        }
    }
    // A LoRA run's actor is an adapter folder.
    let adapters = done.final_actor.join("adapter_model.safetensors");
    let weights = weights_of(&if adapters.is_file() {
        adapters
    } else {
        done.final_actor.join("model.safetensors")
    });
    let eval = std::fs::read_to_string(dir.join("eval.json")).ok();
    Outcome::Ran {
        rows,
        files,
        metrics,
        weights,
        eval,
    }
}

/// Where two outcomes differ first (beyond rounding), if they do.
fn difference(a: &Outcome, b: &Outcome) -> Option<String> {
    let (
        Outcome::Ran {
            rows,
            files,
            metrics,
            weights,
            eval,
        },
        Outcome::Ran {
            rows: rows2,
            files: files2,
            metrics: metrics2,
            weights: weights2,
            eval: eval2,
        },
    ) = (a, b)
    else {
        return match (a, b) {
            (Outcome::Failed(x), Outcome::Failed(y)) if x == y => None,
            _ => Some(format!("{a:?} vs {b:?}")),
        };
    };
    if rows.len() != rows2.len() {
        return Some(format!("{} vs {} row columns", rows.len(), rows2.len()));
    }
    for ((name, x), (name2, y)) in rows.iter().zip(rows2) {
        if name != name2 {
            return Some(format!("column {name} vs {name2}"));
        }
        if let Some(d) = x.differs(y) {
            return Some(format!("rows, {name}: {d}"));
        }
    }
    if files != files2 {
        return Some(format!("files: {files:?} vs {files2:?}"));
    }
    if metrics.len() != metrics2.len() || metrics.keys().ne(metrics2.keys()) {
        return Some(format!("{} vs {} metrics", metrics.len(), metrics2.len()));
    }
    for (k, v) in metrics {
        if !close(*v, metrics2[k]) {
            return Some(format!("metric {k:?}: {v} vs {}", metrics2[k]));
        }
    }
    if let Some(d) = weights_differ(weights, weights2) {
        return Some(d);
    }
    (eval != eval2).then(|| format!("eval {eval:?} vs {eval2:?}"))
}

/// A prompt file with several prompt columns, a label and chat messages.
fn write_prompts(path: &Path) {
    let lines: Vec<String> = (0..6u32)
        .map(|i| {
            let (a, b) = (i * 7 % 50, i * 13 % 40);
            serde_json::json!({
                "prompt": format!("{a}+{b}="),
                "question": format!("{b}+{a}="),
                // Every third prompt too long for the model's context.
                "long": if i % 3 == 0 { "1+1=".repeat(300) } else { format!("{a}+{b}=") },
                "answer": (a + b).to_string(),
                "answer2": (a + b + 1).to_string(),
                "messages": [{"role": "user", "content": format!("{a}+{b}=")}],
                "chosen": (a + b).to_string(),
                "rejected": (a + b + 1).to_string(),
                "chosen2": (a + b + 2).to_string(),
                "rejected2": (a + b + 3).to_string(),
                "margin": i as f64 * 0.5,
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

/// The pipelines a row of [`CHANGES`] is for.
#[derive(Clone, Copy)]
enum For {
    All,
    /// sft, rm and dpo.
    NotRl,
    /// The RL pipelines but PPO (whose reward model is a key of its own).
    RlNotPpo,
    Remax,
    /// The group pipelines (grpo's chain).
    Group,
    GroupOrDistill,
}

impl For {
    fn holds(self, kind: PipelineKind) -> bool {
        match self {
            For::All => true,
            For::NotRl => !kind.is_rl(),
            For::RlNotPpo => kind.is_rl() && kind != PipelineKind::Ppo,
            For::Remax => kind == PipelineKind::Remax,
            For::Group => kind.is_group(),
            For::GroupOrDistill => kind.is_group() || kind == PipelineKind::Distill,
        }
    }
}

/// A key's change: `key = value` on top of `setting`, the other keys under
/// which it acts. In both, `$prompts` stands for the prompt file's path,
/// `$log` for a rollout log (`[PATH]`), `$other`, `$rm`, `$qwen2` and
/// `$arith` for fixture checkpoints (tiny-llama, tiny-llama-rm, tiny-qwen2,
/// arith-sft), each quoted.
struct Change {
    key: &'static str,
    only: For,
    setting: &'static [&'static str],
    value: &'static str,
}

const fn to(key: &'static str, setting: &'static [&'static str], value: &'static str) -> Change {
    Change {
        key,
        only: For::All,
        setting,
        value,
    }
}

/// [`to`] for some pipelines only; a row before the one for all.
const fn to_for(
    only: For,
    key: &'static str,
    setting: &'static [&'static str],
    value: &'static str,
) -> Change {
    Change {
        key,
        only,
        setting,
        value,
    }
}

const FILE: &str = "data.prompts=$prompts";
const TIS: &str = "algorithm.correction=\"tis\"";
/// A large rate over three epochs: the ratios move enough for a clip to bind.
const EPOCHS: &str = "algorithm.ppo_epochs=3";
const RATE: &str = "algorithm.lr=0.01";

/// Every key's change but those of the judge, the remote and python
/// rewards and the agent, which write files of their own (their functions
/// below): the first row for the key that holds for the pipeline.
const CHANGES: &[Change] = &[
    to("run.steps", &[], "3"),
    to("run.max_staleness", &[], "1"),
    to("run.seed", &[], "7"),
    to("run.threads", &[], "2"),
    to("run.checkpoint_every", &[], "1"),
    to("run.rows_per_file", &[], "2"),
    to("run.max_shard_size", &[], "\"100KB\""),
    to("run.device", &[], "\"cuda\""),
    to("eval.prompts", &[], "$prompts"),
    to("eval.k", &["eval.prompts=$prompts"], "3"),
    to("eval.every", &["eval.prompts=$prompts"], "1"),
    to("eval.best_checkpoint", &["eval.prompts=$prompts"], "true"),
    to("eval.arith", &[], "true"),
    to("eval.batch", &["eval.arith=true"], "7"),
    to("lora.rank", &[], "4"),
    to("lora.alpha", &["lora.rank=4"], "4.0"),
    to("lora.dropout", &["lora.rank=4"], "0.2"),
    to("lora.target_modules", &["lora.rank=4"], "[\"q_proj\", \"down_proj\"]"),
    to("placement.workers", &[], "3"),
    to_for(For::NotRl, "placement.rollout", &["placement.workers=2"], "[1]"),
    to_for(For::NotRl, "placement.train", &["placement.workers=2"], "[1]"),
    to("placement.rollout", &[], "[1]"),
    to("placement.train", &[], "[0]"),
    to("placement.reference", &[], "\"rollout\""),
    to("placement.weights_channel", &[], "\"timely\""),
    to("placement.weights_port", &[], "4321"),
    to("placement.encrypt", &[], "true"),
    to("placement.teacher", &[], "\"rollout\""),
    to(
        "placement.shard_optimizer",
        &["placement.workers=2", "placement.train=[0, 1]"],
        "true",
    ),
    to(
        "placement.weights_bucket_mib",
        &["placement.weights_channel=\"timely\""],
        "1",
    ),
    to("teacher.path", &[], "$qwen2"),
    to("teacher.top_k", &[], "3"),
    to("model.path", &[], "$other"),
    to("model.dtype", &[], "\"bf16\""),
    to("model.reference", &[], "$other"),
    to_for(
        For::RlNotPpo,
        "model.reward_model",
        &["reward.kind=model", "model.reward_model=$rm"],
        "$arith",
    ),
    to("model.reward_model", &[], "$rm"),
    to("model.critic", &[], "$rm"),
    to("data.prompts", &[], "$prompts"),
    to("data.prompt_column", &[FILE], "\"question\""),
    to("data.messages_column", &[FILE], "\"messages\""),
    to("data.label_column", &[FILE], "\"answer2\""),
    to("data.prompt_template", &[FILE], "\"Please: {prompt}\""),
    to("data.apply_chat_template", &[FILE], "true"),
    // Long prompts: an error, or left out.
    to(
        "data.skip_long_prompts",
        &[FILE, "data.prompt_column=\"long\""],
        "true",
    ),
    to(
        "data.system_prompt",
        &[FILE, "data.apply_chat_template=true"],
        "\"Answer with a number.\"",
    ),
    to("data.chosen_column", &[FILE], "\"chosen2\""),
    to("data.rejected_column", &[FILE], "\"rejected2\""),
    to("data.margin_column", &[FILE], "\"margin\""),
    to("data.epochs", &[FILE, "run.steps=5"], "1"),
    to("data.rollouts", &[TIS], "$log"),
    // The log's later steps: its advantages are GAE's over a critic that
    // has trained, which no estimator computes again from rewards.
    to("data.rollouts_where", &[TIS, "data.rollouts=$log"], "\"step >= 1\""),
    to("data.replay_fraction", &[TIS, "data.rollouts=$log"], "0.5"),
    to(
        "data.rollout_advantages",
        &[TIS, "data.rollouts=$log", "data.rollouts_where=\"step >= 2\""],
        "\"logged\"",
    ),
    to("data.prompts_per_step", &[], "3"),
    to("data.samples_per_prompt", &[], "3"),
    to("generate.max_new_tokens", &[], "3"),
    to("generate.temperature", &[], "0.5"),
    to("generate.top_p", &[], "0.5"),
    to("generate.top_k", &[], "3"),
    to("generate.max_inflight", &[], "3"),
    to("generate.long_tail", &[], "1.0"),
    to("generate.ignore_eos", &[], "true"),
    to("generate.backend", &[], "\"torch\""),
    to(
        "generate.on_new_weights",
        &["generate.max_inflight=3", "run.max_staleness=1"],
        "\"recompute\"",
    ),
    to("reward.kind", &[], "\"remote\""),
    // Two tokens: some responses are cut.
    to(
        "reward.stop_properly_coef",
        &["generate.max_new_tokens=2"],
        "-1.0",
    ),
    to("reward.overlong_buffer", &[], "3"),
    to(
        "reward.overlong_penalty_factor",
        &["reward.overlong_buffer=3"],
        "5.0",
    ),
    to("reward.rule", &[], "\"nope\""),
    to(
        "reward.terms",
        &[
            "reward.kind=\"terms\"",
            "reward.terms=[{rule = \"arith_exact_match\"}]",
        ],
        "[{rule = \"arith_exact_match\", weight = 2.0}, {rule = \"length\", weight = 0.1}]",
    ),
    to("reward.on_finish", &[], "{stop = 0.5, length = -1.0}"),
    to("algorithm.distill_coef", &[], "0.5"),
    to("algorithm.gkd_beta", &["teacher.top_k=3"], "0.0"),
    to("algorithm.gkd_coef", &["teacher.top_k=3"], "0.5"),
    to("algorithm.gkd_tail", &["teacher.top_k=3"], "\"drop\""),
    to("algorithm.distill_task", &[], "\"rloo\""),
    to("algorithm.lr", &[], "0.01"),
    to("algorithm.warmup_steps", &[], "5"),
    to(
        "algorithm.schedule",
        &["algorithm.warmup_steps=0"],
        "\"cosine\"",
    ),
    to(
        "algorithm.min_lr_ratio",
        &["algorithm.schedule=cosine", "algorithm.warmup_steps=0"],
        "0.5",
    ),
    to("algorithm.weight_decay", &["algorithm.warmup_steps=0"], "0.9"),
    to("algorithm.max_grad_norm", &[], "0.001"),
    to("algorithm.micro_batch", &[], "1"),
    to("algorithm.micro_batch_tokens", &[], "8"),
    to("algorithm.gradient_checkpointing", &[], "true"),
    to("algorithm.packing", &[], "true"),
    to("algorithm.logprob_chunk", &[], "5"),
    to("algorithm.ppo_epochs", &[], "2"),
    to("algorithm.mini_batches", &[], "2"),
    to("algorithm.clip_low", &[EPOCHS, RATE], "0.01"),
    // ReMax on the SFT'd pairs: the greedy answer is mostly right, so
    // advantages are rarely positive; a reward for wrong answers makes them so.
    to_for(
        For::Remax,
        "algorithm.clip_high",
        &[EPOCHS, RATE, "reward.kind=\"terms\"", "reward.terms=[{rule = \"exact\", weight = -1.0}]"],
        "0.0",
    ),
    to_for(
        For::Remax,
        "algorithm.sapo_tau_pos",
        &[
            "algorithm.policy_loss=sapo",
            "algorithm.aggregation=\"seq-mean-token-mean\"",
            EPOCHS,
            RATE,
            "reward.kind=\"terms\"",
            "reward.terms=[{rule = \"exact\", weight = -1.0}]",
        ],
        "5.0",
    ),
    to("algorithm.clip_high", &[EPOCHS, RATE], "0.0"),
    // The dual clip binds where a negative advantage meets a ratio above
    // c: stale rows (k = 1) and a large rate move ratios both ways.
    to(
        "algorithm.dual_clip",
        &["run.steps=3", "run.max_staleness=1", EPOCHS, RATE],
        "1.01",
    ),
    to("algorithm.kl_coef", &[], "0.5"),
    // A target far above any KL: the coefficient shrinks by the clip after
    // each step, by 0.2 · n / kl_horizon: with 32 responses a step, past
    // the rounding the comparison allows.
    to(
        "algorithm.kl_target",
        &[
            "run.steps=3",
            "algorithm.kl_coef=0.1",
            "data.prompts_per_step=8",
            "data.samples_per_prompt=4",
        ],
        "1000000.0",
    ),
    to(
        "algorithm.kl_horizon",
        &["run.steps=3", "algorithm.kl_target=1000000.0"],
        "1.0",
    ),
    // k3+ differs from k3 in its gradient only, by r²/2 per token: a policy
    // pulled well away from its reference shows it.
    to_for(
        For::Group,
        "algorithm.kl_estimator",
        &["algorithm.lr=0.05", "algorithm.kl_coef=0.5", "run.steps=3"],
        "\"k1\"",
    ),
    to("algorithm.kl_estimator", &[], "\"k1\""),
    to("algorithm.entropy_coef", &[], "0.5"),
    // In this short run every group's samples score alike (zero
    // advantages), and OpenRLHF aggregates its KL and entropy terms as a
    // token mean whatever the mode: the mode shows in verl's KL term.
    to_for(
        For::Group,
        "algorithm.aggregation",
        &["algorithm.flavor=\"verl\""],
        "\"seq-mean-token-sum\"",
    ),
    to("algorithm.aggregation", &[], "\"seq-mean-token-sum\""),
    to(
        "algorithm.loss_scale_factor",
        &["algorithm.aggregation=\"seq-mean-token-sum-norm\""],
        "3",
    ),
    to(
        "algorithm.policy_loss",
        &["algorithm.aggregation=\"seq-mean-token-mean\"", EPOCHS, RATE],
        "\"gspo\"",
    ),
    // Dr.GRPO and RLOO agree in both anchors but for one-sample groups
    // and KL estimates beyond the clamps: a policy far from its reference.
    // GRPO's flavors differ otherwise only in the whitening epsilon (1e-9
    // against 1e-6), a change at rounding level in a two-step run.
    to_for(
        For::GroupOrDistill,
        "algorithm.flavor",
        &["algorithm.lr=0.5", "algorithm.kl_estimator=\"k2\"", "run.steps=3"],
        "\"verl\"",
    ),
    to("algorithm.flavor", &[], "\"verl\""),
    to(
        "algorithm.sapo_tau_pos",
        &["algorithm.policy_loss=sapo", "algorithm.aggregation=\"seq-mean-token-mean\"", EPOCHS, RATE],
        "5.0",
    ),
    to(
        "algorithm.sapo_tau_neg",
        &["algorithm.policy_loss=sapo", "algorithm.aggregation=\"seq-mean-token-mean\"", EPOCHS, RATE],
        "5.0",
    ),
    to(
        "algorithm.clip_cov_ratio",
        &["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_lb=-100", EPOCHS, RATE],
        "0.5",
    ),
    to(
        "algorithm.clip_cov_lb",
        &["algorithm.policy_loss=clip_cov", "algorithm.clip_cov_ratio=0.5", EPOCHS, RATE],
        "-100",
    ),
    to(
        "algorithm.clip_cov_ub",
        &[
            "algorithm.policy_loss=clip_cov",
            "algorithm.clip_cov_ratio=0.5",
            "algorithm.clip_cov_lb=-100",
            EPOCHS,
            RATE,
        ],
        "-50",
    ),
    to(
        "algorithm.gdpo",
        &[
            "reward.kind=\"terms\"",
            "reward.terms=[{rule = \"arith_exact_match\"}, {rule = \"length\", max_tokens = 6, weight = 0.3}]",
        ],
        "true",
    ),
    to("algorithm.dro_beta", &["algorithm.policy_loss=dro", EPOCHS, RATE], "5.0"),
    to(
        "algorithm.reinforce_is_cap",
        &["algorithm.policy_loss=reinforce", EPOCHS, RATE],
        "1.0",
    ),
    to("algorithm.kl_cov_ratio", &["algorithm.policy_loss=kl_cov", EPOCHS, RATE], "0.5"),
    to("algorithm.kl_cov_coef", &["algorithm.policy_loss=kl_cov", EPOCHS, RATE], "5.0"),
    to("algorithm.gamma", &[], "0.5"),
    to("algorithm.lambda", &[], "0.5"),
    to("algorithm.critic_lr", &[], "0.01"),
    to(
        "algorithm.value_clip",
        &[EPOCHS, "algorithm.critic_lr=0.01"],
        "0.001",
    ),
    to("algorithm.beta", &[], "0.5"),
    to("algorithm.preference_loss", &[], "\"ipo\""),
    to(
        "algorithm.label_smoothing",
        &["algorithm.preference_loss=cdpo", "algorithm.label_smoothing=0.1"],
        "0.3",
    ),
    to("algorithm.correction", &[], "\"tis\""),
    to(
        "algorithm.correction_low",
        &["algorithm.correction=tis", "run.max_staleness=1"],
        "1.0",
    ),
    to(
        "algorithm.correction_high",
        &["algorithm.correction=tis", "run.max_staleness=1"],
        "1.0000001",
    ),
    to(
        "algorithm.correction_batch_normalize",
        &["algorithm.correction=tis", "run.max_staleness=1"],
        "true",
    ),
    // Rows a version stale under a large rate: some tokens' ratios leave the band.
    to("algorithm.rejection", &["run.max_staleness=1", RATE], "\"token_k1\""),
    to(
        "algorithm.rejection_threshold",
        &["algorithm.rejection=\"token_k1\"", "run.max_staleness=1", RATE],
        "\"0.99_1.01\"",
    ),
    // Its gradient differs from the estimator's once the policy has left its reference.
    to(
        "algorithm.kl_unbiased_gradient",
        &["algorithm.lr=0.05", "algorithm.kl_coef=0.5", "run.steps=3"],
        "true",
    ),
    to("dynamic_sampling.enabled", &[], "true"),
    to(
        "dynamic_sampling.target_groups",
        &["dynamic_sampling.enabled=true", "data.prompts_per_step=6", "data.samples_per_prompt=4"],
        "1",
    ),
    // Every group of six in a step must be informative, or the step waits.
    to(
        "dynamic_sampling.max_extra_batches",
        &[
            "dynamic_sampling.enabled=true",
            "dynamic_sampling.target_groups=6",
            "data.prompts_per_step=6",
            "data.samples_per_prompt=4",
        ],
        "1",
    ),
    to("curriculum.enabled", &[], "true"),
    // The curriculum judges prompts seen before: six prompts, six steps of two.
    to(
        "curriculum.min_samples",
        &[FILE, "run.steps=6", "data.samples_per_prompt=4", "curriculum.enabled=true", "curriculum.max_solve_rate=0.0"],
        "1",
    ),
    to(
        "curriculum.max_solve_rate",
        &[FILE, "run.steps=6", "data.samples_per_prompt=4", "curriculum.enabled=true", "curriculum.min_samples=1"],
        "0.0",
    ),
    to(
        "curriculum.min_solve_rate",
        &[FILE, "run.steps=6", "data.samples_per_prompt=4", "curriculum.enabled=true", "curriculum.min_samples=1"],
        "1.0",
    ),
    to(
        "curriculum.solve_threshold",
        &[
            FILE,
            "run.steps=6",
            "data.samples_per_prompt=4",
            "curriculum.enabled=true",
            "curriculum.min_samples=1",
            "curriculum.max_solve_rate=0.5",
        ],
        "-1.0",
    ),
];

/// `text` with the paths [`Change`] names put in.
fn fill(text: &str, prompts: &Path) -> String {
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let mut out = text.to_string();
    // The log only where it is named: making it is a run of its own.
    let paths: [(&str, &dyn Fn() -> String); 6] = [
        ("$prompts", &|| quoted(prompts)),
        ("$log", &a_log),
        ("$other", &|| quoted(&fixture("tiny-llama"))),
        ("$rm", &|| quoted(&fixture("tiny-llama-rm"))),
        ("$qwen2", &|| quoted(&fixture("tiny-qwen2"))),
        ("$arith", &|| quoted(&fixture("arith-sft"))),
    ];
    for (name, path) in paths {
        if out.contains(name) {
            out = out.replace(name, &path());
        }
    }
    out
}

/// The other settings under which `key` acts, and its changed value.
fn change(key: &str, prompts: &Path, kind: PipelineKind) -> (Vec<String>, String) {
    let dir = prompts.parent().unwrap();
    if key.starts_with("judge.") || key == "placement.judge" {
        return judge_change(key, dir);
    }
    if key.starts_with("agent.") {
        return agent_change(key, dir);
    }
    if [
        "reward.url",
        "reward.ca_file",
        "reward.timeout_s",
        "reward.attempts",
    ]
    .contains(&key)
    {
        return remote_change(key, prompts, kind);
    }
    if [
        "reward.file",
        "reward.function",
        "reward.python",
        "reward.workers",
    ]
    .contains(&key)
    {
        return python_change(key, dir);
    }
    let row = CHANGES
        .iter()
        .find(|c| c.key == key && c.only.holds(kind))
        .unwrap_or_else(|| panic!("{key}: no changed value in this test; add a row to CHANGES"));
    let setting = row.setting.iter().map(|s| fill(s, prompts)).collect();
    (setting, fill(row.value, prompts))
}

/// A judge's key: the echo judge repeats the scripted verdict, "111" where
/// the response is the label, "xxx" (unparsed: 0.25) elsewhere.
fn judge_change(key: &str, dir: &Path) -> (Vec<String>, String) {
    let judge = echo_judge(dir);
    let mut setting = vec![
        "reward.kind=\"judge\"".to_string(),
        format!("judge.path={:?}", judge.display().to_string()),
        "judge.template=\"{% if response == label %}1{% else %}x{% endif %}\"".into(),
        "judge.chat=false".into(),
        "judge.max_new_tokens=3".into(),
        "judge.on_unparsed=\"reward\"".into(),
        "judge.unparsed_reward=0.25".into(),
    ];
    let value = match key {
        "judge.path" => format!("{:?}", fixture("tiny-llama").display().to_string()),
        "judge.template" => "\"{% if response == label %}2{% else %}x{% endif %}\"".into(),
        "judge.chat" => "true".into(),
        "judge.verdict" => "\"probability\"".into(),
        "judge.pattern" => "\"^(\\\\d)$\"".into(),
        "judge.verdict_tokens" => {
            setting.retain(|s| {
                !s.contains("on_unparsed")
                    && !s.contains("unparsed_reward")
                    && !s.contains("max_new_tokens")
            });
            setting.push("judge.verdict=\"probability\"".into());
            "[\"1\"]".into()
        }
        "judge.max_new_tokens" => "1".into(),
        "judge.temperature" => "1.0".into(),
        "judge.on_unparsed" => {
            setting.retain(|s| !s.contains("unparsed_reward"));
            "\"error\"".into()
        }
        "judge.unparsed_reward" => "0.75".into(),
        "placement.judge" => {
            setting.push("placement.workers=3".into());
            "[2]".into()
        }
        other => panic!("{other}: no changed value in this test; add one"),
    };
    (setting, value)
}

/// A remote reward's key, against the test's reward server.
fn remote_change(key: &str, prompts: &Path, kind: PipelineKind) -> (Vec<String>, String) {
    let value = match key {
        "reward.url" => format!("{:?}", format!("{}/{}/other", reward_server(), kind.name())),
        // The test server is http://: refused, naming the key.
        "reward.ca_file" => format!("{:?}", prompts.display().to_string()),
        "reward.timeout_s" => "0.2".into(),
        _ => "1".into(),
    };
    let url = format!("{}/{}", reward_server(), kind.name());
    (
        vec!["reward.kind=remote".into(), format!("reward.url={url:?}")],
        value,
    )
}

/// A python reward's key: `exact.py` (1 for the label, and `other_func`:
/// 0.25 + 0.5 for it) and `length.py` (a tenth of the answer's length), in `dir`.
fn python_change(key: &str, dir: &Path) -> (Vec<String>, String) {
    let (exact, length) = (dir.join("exact.py"), dir.join("length.py"));
    let cut = "q[len(p):].split('<|im_end|>')[0].strip()";
    std::fs::write(
        &exact,
        format!(
            "def reward_func(queries, prompts, labels, **columns):\n    \
             return [float({cut} == l) for q, p, l in zip(queries, prompts, labels)]\n\
             def other_func(queries, prompts, labels, **columns):\n    \
             return [0.25 + 0.5 * float({cut} == l) for q, p, l in zip(queries, prompts, labels)]\n"
        ),
    )
    .unwrap();
    std::fs::write(
        &length,
        format!("def reward_func(queries, prompts, labels, **columns):\n    return [len({cut}) / 10 for q, p in zip(queries, prompts)]\n"),
    )
    .unwrap();
    let value = match key {
        "reward.file" => format!("{:?}", length.display().to_string()),
        "reward.function" => "\"other_func\"".into(),
        "reward.python" => "\"python3-that-is-not-there\"".into(),
        _ => "1".into(),
    };
    (
        vec![
            "reward.kind=\"python\"".into(),
            format!("reward.file={:?}", exact.display().to_string()),
        ],
        value,
    )
}

/// A rollout log to train from, as `data.rollouts` names it: a three-step
/// PPO run on the arith checkpoint, made once for the binary.
fn a_log() -> String {
    static LOG: std::sync::OnceLock<(tempfile::TempDir, String)> = std::sync::OnceLock::new();
    let (_, value) = LOG.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("log");
        weir::pipelines::run(&request(
            PipelineKind::Ppo,
            config(PipelineKind::Ppo, 3),
            &dir,
            false,
        ))
        .unwrap();
        let value = format!("[{:?}]", dir.display().to_string());
        (tmp, value)
    });
    value.clone()
}

/// Environment files for the `[agent]` keys, in `dir`: `env.py` (two
/// classes: `AgentInstance`, two turns of long raw-text feedback, a turn's
/// reward its length; `Other`, one turn of reward 1), `slow.py` (a step
/// takes 0.3 s) and `failing.py` (every step raises).
fn agent_files(dir: &Path) -> (String, String, String) {
    let env = dir.join("env.py");
    std::fs::write(
        &env,
        r#"from openrlhf.utils.agent import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.steps = 0

    def reset(self, states):
        return {"observation": states["observation"]}

    def step(self, states):
        self.steps += 1
        feedback = "\nNot yet: think again, and answer with one number please.\n"
        reward = len(states["action_text"]) / 10
        return {"rewards": reward, "environment_feedback": feedback, "done": self.steps >= 2}


class Other(AgentInstance):
    def step(self, states):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}
"#,
    )
    .unwrap();
    let slow = dir.join("slow.py");
    std::fs::write(
        &slow,
        r#"import time


class AgentInstance:
    def reset(self, states):
        return states

    def step(self, states):
        time.sleep(0.3)
        return {"rewards": 1.0, "environment_feedback": "", "done": True}
"#,
    )
    .unwrap();
    let failing = dir.join("failing.py");
    std::fs::write(
        &failing,
        r#"class AgentInstance:
    def reset(self, states):
        return states

    def step(self, states):
        raise RuntimeError("no")
"#,
    )
    .unwrap();
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    (quoted(&env), quoted(&slow), quoted(&failing))
}

/// The settings and changed value of an `[agent]` key: episodes of an
/// environment, with a budget that leaves room for a second turn.
fn agent_change(key: &str, dir: &Path) -> (Vec<String>, String) {
    let (env, slow, failing) = agent_files(dir);
    let budget = "generate.max_new_tokens=96".to_string();
    let with_env = vec![budget.clone(), format!("agent.environment={env}")];
    match key {
        "agent.tools" => (
            vec![format!(
                "model.path={:?}",
                with_tool_template(dir).display().to_string()
            )],
            "[\"calculator\"]".into(),
        ),
        "agent.tool_format" => (
            vec![
                format!(
                    "model.path={:?}",
                    with_tool_template(dir).display().to_string()
                ),
                "agent.tools=[\"calculator\"]".into(),
            ],
            "\"llama3_json\"".into(),
        ),
        "agent.environment" => (vec![budget], env),
        "agent.environment_class" => (with_env, "\"Other\"".into()),
        "agent.max_turns" => (with_env, "1".into()),
        "agent.max_observation_tokens" => (with_env, "3".into()),
        "agent.python" => (with_env, "\"python3-that-is-not-there\"".into()),
        "agent.python_network" => (
            vec![
                format!(
                    "model.path={:?}",
                    with_tool_template(dir).display().to_string()
                ),
                "agent.tools=[\"python\"]".into(),
            ],
            "\"allow\"".into(),
        ),
        "agent.max_concurrency" => (with_env, "1".into()),
        // A server of its own: walks run side by side, and a server holds one episode.
        "agent.action_field" | "agent.observation_field" => {
            let server = format!("agent.environment={:?}", support::openenv_server(false));
            let value = if key == "agent.action_field" {
                "\"text\""
            } else {
                "\"tries\""
            };
            (vec![budget, server], value.into())
        }
        "agent.timeout_s" => (
            vec![budget, format!("agent.environment={slow}")],
            "0.1".into(),
        ),
        "agent.on_error" => (
            vec![budget, format!("agent.environment={failing}")],
            "\"end\"".into(),
        ),
        other => panic!("{other}: no changed value in this test; add one"),
    }
}

/// Further values of the keys that choose between several behaviours, each
/// run through the pipeline too.
fn more_values(key: &str) -> &'static [&'static str] {
    match key {
        "algorithm.correction" => &[
            "\"icepop\"",
            "\"seq-mask\"",
            "\"seq-tis\"",
            "\"geo-rejection\"",
            "\"k3-rejection\"",
            "\"seq-icepop\"",
            "\"binary-kl\"",
            "\"seq-binary-kl\"",
            "\"tv\"",
            "\"seq-tv\"",
        ],
        "algorithm.preference_loss" => &["\"cdpo\""],
        "generate.on_new_weights" => &["\"keep\""],
        "algorithm.policy_loss" => &[
            "\"sapo\"",
            "\"cispo\"",
            "\"gmpo\"",
            "\"gpg\"",
            "\"reinforce\"",
            "\"clip_cov\"",
            "\"kl_cov\"",
            "\"dppo_tv\"",
            "\"dppo_kl\"",
            "\"dro\"",
        ],
        "algorithm.kl_estimator" => &["\"k2\"", "\"abs\"", "\"k1+\"", "\"k3+\""],
        "algorithm.aggregation" => &[
            "\"seq-mean-token-mean\"",
            "\"seq-mean-token-sum-norm\"",
            "\"token-sum\"",
        ],
        "model.dtype" => &["\"f16\""],
        _ => &[],
    }
}

/// The small base run of `kind`: `steps` steps, k = 0, one thread.
fn base(kind: PipelineKind, steps: u64) -> RunConfig {
    let mut c = config(kind, steps);
    c.data.prompts_per_step = 2;
    c.run.threads = 1;
    if kind.is_rl() {
        c.run.max_staleness = 0;
        c.data.samples_per_prompt = 2;
        c.generate.max_new_tokens = 4;
    }
    if kind != PipelineKind::Rm {
        c.eval.arith = false;
        c.eval.batch = 128;
    }
    c
}

/// Which keys a walk changes.
#[derive(Clone, Copy, PartialEq)]
enum Keys {
    /// Every key the pipeline reads.
    All,
    /// `algorithm.*` only, but for [`LEARNER_KEYS`]: the pipeline is built
    /// by the same function as one whose walk covers the other keys (the
    /// group pipelines share grpo's chain, reinforce_pp_baseline
    /// reinforce_pp's), and differs from it in its estimator alone.
    Algorithm,
    /// `algorithm.*` and `generate.*`: as [`Keys::Algorithm`], for a
    /// pipeline whose generator also records something of its own (otb's
    /// sampler records each token's Σπ², so every sampling key reaches it).
    AlgorithmAndGenerate,
    /// Every key but those of [`ROLLOUT_SECTIONS`]: the pipeline's rollouts
    /// are built by the function that builds grpo's (`rl::rollouts`: the
    /// actor with its evaluation and episodes, the reward stages and the
    /// judge, which read those sections alone and act on every row alike,
    /// ReMax's greedy rows too; distillation's teacher is a section of its
    /// own), and grpo's walk covers them.
    AllButRollouts,
}

/// The sections that only the rollout chain and the run's evaluation
/// read, the same way in every pipeline [`Keys::AllButRollouts`] walks.
const ROLLOUT_SECTIONS: &[&str] = &["reward", "agent", "judge", "eval"];

/// The `algorithm` keys that among a sibling's stages only the learner
/// reads, the same way in every RL pipeline (`roles::learner_config` and
/// the optimizer and schedule it builds, which take no pipeline kind; PPO's
/// critic reads `aggregation` too, and PPO walks every key): grpo's walk covers
/// them, and a sibling's walk (built by grpo's or reinforce_pp's function,
/// differing in its estimator) changes the keys its own code may read
/// otherwise — the KL's (in the loss or in the reward by kind), the
/// flavor, the estimators'.
const LEARNER_KEYS: &[&str] = &[
    "lr",
    "warmup_steps",
    "schedule",
    "min_lr_ratio",
    "weight_decay",
    "max_grad_norm",
    "micro_batch",
    "micro_batch_tokens",
    "gradient_checkpointing",
    "packing",
    "logprob_chunk",
    "ppo_epochs",
    "mini_batches",
    "clip_low",
    "clip_high",
    "dual_clip",
    "entropy_coef",
    "aggregation",
    "loss_scale_factor",
    "policy_loss",
    "sapo_tau_pos",
    "sapo_tau_neg",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "kl_cov_coef",
    "dro_beta",
    "reinforce_is_cap",
    "correction",
    "correction_low",
    "correction_high",
    "correction_batch_normalize",
    "rejection",
    "rejection_threshold",
];

/// Keys whose further values ([`more_values`]) act in the learner alone,
/// which every RL pipeline builds the same way (`roles::learner`): grpo's
/// walk runs each of them; the others change the key once.
const LEARNER_VALUES: &[&str] = &["algorithm.policy_loss", "algorithm.correction"];

/// Runs of one pipeline's walk: the base outcome of each setting (the
/// other keys a changed key needs) and of each step count, run once.
struct Trials<'a> {
    kind: PipelineKind,
    root: &'a Path,
    baselines: BTreeMap<(Vec<String>, u64), Outcome>,
    runs: usize,
}

impl Trials<'_> {
    /// The outcome of the base run of `steps` steps with `items`.
    fn outcome(&mut self, items: &[String], steps: u64) -> Outcome {
        self.runs += 1;
        let dir = self.root.join(format!("run-{}", self.runs));
        match base(self.kind, steps).with_overrides(items) {
            Ok(cfg) => outcome(self.kind, cfg, &dir),
            Err(e) => Outcome::Failed(e.to_string()),
        }
    }

    /// The base outcome with `setting`, and the outcome with `change` on top.
    fn compare(&mut self, setting: &[String], change: &str, steps: u64) -> (&Outcome, Outcome) {
        let mut items = setting.to_vec();
        items.push(change.to_string());
        let after = self.outcome(&items, steps);
        let key = (setting.to_vec(), steps);
        if !self.baselines.contains_key(&key) {
            let o = self.outcome(setting, steps);
            self.baselines.insert(key.clone(), o);
        }
        (&self.baselines[&key], after)
    }
}

fn walk(kind: PipelineKind, keys: Keys) {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    write_prompts(&prompts);
    let mut trials = Trials {
        kind,
        root: tmp.path(),
        baselines: BTreeMap::new(),
        runs: 0,
    };
    // The comparison means something only if the same config gives the
    // same outcome, at either length of the base run.
    for steps in [1, 2] {
        let again = outcome(
            kind,
            base(kind, steps),
            &tmp.path().join(format!("again-{steps}")),
        );
        let first = outcome(
            kind,
            base(kind, steps),
            &tmp.path().join(format!("first-{steps}")),
        );
        assert!(
            matches!(first, Outcome::Ran { .. }),
            "{}: {first:?}",
            kind.name()
        );
        if let Some(d) = difference(&first, &again) {
            panic!("{}: two runs of one config differ: {d}", kind.name());
        }
        // The base outcome of the keys that need no other setting.
        trials.baselines.insert((Vec::new(), steps), first);
    }
    let (mut silent, mut unnamed) = (Vec::new(), Vec::new());
    for &Key {
        section, name: key, ..
    } in KEYS
    {
        let learner_only = section == "algorithm" && LEARNER_KEYS.contains(&key);
        let walked = match keys {
            Keys::All => true,
            Keys::Algorithm => section == "algorithm" && !learner_only,
            Keys::AlgorithmAndGenerate => {
                (section == "algorithm" && !learner_only) || section == "generate"
            }
            Keys::AllButRollouts => !ROLLOUT_SECTIONS.contains(&section),
        };
        let name = format!("{section}.{key}");
        let left_to_grpo = keys == Keys::AllButRollouts || learner_only;
        if left_to_grpo && !walked && applies(kind, section, key) {
            // A key this pipeline prints and leaves to grpo's walk must be in it.
            assert!(
                applies(PipelineKind::Grpo, section, key),
                "{}: {name} applies here and not to grpo: walk it here",
                kind.name()
            );
        }
        if !applies(kind, section, key) || !walked {
            continue;
        }
        let (setting, value) = change(&name, &prompts, kind);
        // A key's further values act in code every pipeline of a chain
        // shares (an estimator, an aggregation): walked where every key is,
        // while a sibling's walk shows that the key reaches its chain; those
        // that act in the learner alone, in grpo's walk.
        let values_left_to_grpo =
            LEARNER_VALUES.contains(&name.as_str()) && kind != PipelineKind::Grpo;
        let more: &[&str] = if keys != Keys::Algorithm
            && keys != Keys::AlgorithmAndGenerate
            && !values_left_to_grpo
        {
            more_values(&name)
        } else {
            &[]
        };
        for value in std::iter::once(value).chain(more.iter().map(|v| v.to_string())) {
            // A value that is already the base's changes nothing by definition.
            let base_doc =
                serde_json::to_value(base(kind, 1).with_overrides(&setting).unwrap()).unwrap();
            let current = serde_json::to_string(&base_doc[section][key]).unwrap();
            if current == value {
                continue;
            }
            let change = format!("{name}={value}");
            // Most keys act on the first step; the rest (a schedule, a KL
            // controller, staleness) show on the second.
            let (before, after) = trials.compare(&setting, &change, 1);
            // Which worker reads the prompts of sft, rm and dpo shows nowhere but in speed.
            let placement_only = !kind.is_rl() && name == "placement.rollout";
            // Where the machine cannot cut the python tool off the network,
            // its runs are refused naming the key unless it allows them.
            let rescues = RESCUES.contains(&name.as_str())
                || (name == "agent.python_network"
                    && !weir::operators::agent::python_tool::network_isolated());
            if rescues {
                // Without the key the run fails with an error naming it; with it, it runs.
                assert!(
                    matches!(before, Outcome::Failed(e) if e.contains(&name))
                        && matches!(after, Outcome::Ran { .. }),
                    "{}: {name} = {value}: {before:?} → {after:?}",
                    kind.name()
                );
                continue;
            }
            assert!(
                matches!(before, Outcome::Ran { .. }),
                "{}: the base run with {setting:?} fails: {before:?}",
                kind.name()
            );
            if PERFORMANCE.contains(&name.as_str())
                || MODEL_DEPENDENT.contains(&name.as_str())
                || placement_only
            {
                assert!(
                    matches!(after, Outcome::Ran { .. }),
                    "{}: {name} = {value} fails: {after:?}",
                    kind.name()
                );
                continue;
            }
            let (before, after) = if difference(&after, before).is_none() {
                let (before, after) = trials.compare(&setting, &change, 2);
                if difference(&after, before).is_none() {
                    silent.push(format!("{name} = {value}"));
                    continue;
                }
                (before, after)
            } else {
                (before, after)
            };
            if let (Outcome::Failed(e), Outcome::Ran { .. }) = (&after, before) {
                let expected = REFUSALS
                    .iter()
                    .any(|(key, part)| *key == name && e.contains(part));
                if !e.contains(&name) && !expected {
                    unnamed.push(format!("{name} = {value}: {e}"));
                }
            }
        }
    }
    assert!(
        silent.is_empty() && unnamed.is_empty(),
        "{}: these keys changed nothing: {silent:?}; these failed without naming their key \
         (name it, or list the change in REFUSALS): {unnamed:#?}",
        kind.name()
    );
}

#[test]
fn every_grpo_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Grpo, Keys::All);
}

#[test]
fn every_algorithm_key_of_dr_grpo_rloo_and_opo_changes_the_run_or_is_refused() {
    for kind in [PipelineKind::DrGrpo, PipelineKind::Rloo, PipelineKind::Opo] {
        walk(kind, Keys::Algorithm);
    }
}

#[test]
fn every_algorithm_key_of_grpo_passk_gpg_and_otb_and_otbs_generate_keys_change_the_run_or_are_refused(
) {
    for kind in [PipelineKind::GrpoPassk, PipelineKind::Gpg] {
        walk(kind, Keys::Algorithm);
    }
    walk(PipelineKind::Otb, Keys::AlgorithmAndGenerate);
}

#[test]
fn every_ppo_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Ppo, Keys::AllButRollouts);
}

#[test]
fn every_reinforce_pp_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::ReinforcePp, Keys::AllButRollouts);
    walk(PipelineKind::ReinforcePpBaseline, Keys::Algorithm);
}

#[test]
fn every_remax_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Remax, Keys::AllButRollouts);
}

#[test]
fn every_distill_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Distill, Keys::AllButRollouts);
}

#[test]
fn every_sft_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Sft, Keys::All);
}

#[test]
fn every_rm_and_dpo_key_changes_the_run_or_is_refused() {
    walk(PipelineKind::Rm, Keys::All);
    walk(PipelineKind::Dpo, Keys::All);
}
