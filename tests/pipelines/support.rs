//! What the pipeline tests and the key walk share: the fixtures, a small
//! config per pipeline, running it through the runner `weir run` uses, and
//! a reward server. Each test binary that includes it uses a part.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, UInt64Type};
use weir::graph::parquet_log::{read_parquet_dir, read_parquet_file};
use weir::operators::rollout::col;
use weir::pipelines::runner::RunRequest;
use weir::pipelines::{PipelineKind, RunConfig};

/// A fixture checkpoint's folder.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// The arith checkpoint as an echo judge, in `dir` (made once): attention
/// and MLP outputs zeroed, so each position sees only its own token, and
/// the output head the unit embeddings, so that token is the most likely
/// next one — the judge repeats its prompt's last token.
pub fn echo_judge(dir: &Path) -> PathBuf {
    let from = fixture("arith-sft");
    let to = dir.join("echo-judge");
    if to.join("model.safetensors").is_file() {
        return to;
    }
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
    let tensors = tch::Tensor::read_safetensors(from.join("model.safetensors")).unwrap();
    let embed = tensors
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap()
        .1
        .shallow_clone();
    // (A padding row may be all zeros.)
    let unit = &embed / embed.norm_scalaropt_dim(2, [1], true).clamp_min(1e-6);
    let rewired: Vec<(String, tch::Tensor)> = tensors
        .into_iter()
        .map(|(name, t)| {
            let t = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                t.zeros_like()
            } else if name == "model.norm.weight" {
                t.ones_like()
            } else if name == "lm_head.weight" {
                unit.copy()
            } else {
                t
            };
            (name, t)
        })
        .collect();
    tch::Tensor::write_safetensors(&rewired, to.join("model.safetensors")).unwrap();
    to
}

/// A small config of `kind` on the arith-sft checkpoint.
pub fn config(kind: PipelineKind, steps: u64) -> RunConfig {
    let mut c = RunConfig::defaults_for(kind);
    c.model.path = fixture("arith-sft");
    c.run.steps = steps;
    c.data.prompts_per_step = 3;
    if kind.is_rl() {
        c.data.samples_per_prompt = 4;
        c.generate.max_new_tokens = 6;
    }
    if kind.is_rl() || kind == PipelineKind::Sft {
        c.algorithm.micro_batch = 8;
    }
    if kind != PipelineKind::Rm {
        c.eval.arith = false;
    }
    if kind == PipelineKind::Distill {
        c.teacher.path = fixture("tiny-llama");
    }
    c
}

/// A prompt file `dir/questions.jsonl` of `{question, answer}` records,
/// one per `(question, answer)`; the config reads it with the chat template.
pub fn chat_questions(
    cfg: &mut RunConfig,
    dir: &Path,
    pairs: impl IntoIterator<Item = (String, String)>,
) {
    let path = dir.join("questions.jsonl");
    let lines: Vec<String> = pairs
        .into_iter()
        .map(|(q, a)| serde_json::json!({"question": q, "answer": a}).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    cfg.data.prompts = weir::pipelines::config::Task::File(path);
    cfg.data.prompt_column = "question".into();
    cfg.data.apply_chat_template = true;
}

/// A copy of the arith checkpoint whose chat template renders tools and
/// tool results as Qwen2.5's does.
pub fn with_tool_template(dir: &Path) -> PathBuf {
    let to = dir.join("arith-tools");
    if to.is_dir() {
        return to;
    }
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(fixture("arith-sft")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
    std::fs::write(
        to.join("chat_template.jinja"),
        r#"{%- if tools %}{{ "<|im_start|>system\nTools:\n" }}{% for tool in tools %}{{ tool | tojson }}{{ "\n" }}{% endfor %}{{ "<|im_end|>\n" }}{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{ "<|im_start|>user" }}{% endif %}
{{- "\n<tool_response>\n" + message.content + "\n</tool_response>" }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{ "<|im_end|>\n" }}{% endif %}
{%- else %}{{ "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ "<|im_start|>assistant\n" }}{% endif %}"#,
    )
    .unwrap();
    to
}

/// The runner's request for a run of `kind` with `cfg` in `dir`.
pub fn request(kind: PipelineKind, cfg: RunConfig, dir: &Path, resume: bool) -> RunRequest {
    RunRequest {
        pipeline: kind,
        config: cfg,
        run_dir: dir.to_path_buf(),
        resume,
        progress: false,
        cluster: Default::default(),
    }
}

/// Runs `kind` with `cfg` in `dir`; its summary.
pub fn run(kind: PipelineKind, cfg: RunConfig, dir: &Path, resume: bool) -> serde_json::Value {
    weir::pipelines::run(&request(kind, cfg, dir, resume))
        .unwrap_or_else(|e| panic!("{}: {e}", kind.name()))
        .summary
}

/// Serves HTTP on a free local port, each request on a thread of its own:
/// `answer(path, body)` gives the status and the JSON text. Its URL.
pub fn serve(answer: impl Fn(&str, &[u8]) -> (u16, String) + Send + Sync + 'static) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answer = std::sync::Arc::new(answer);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let answer = answer.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let (mut length, mut path) = (0, String::new());
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    if path.is_empty() {
                        path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0; length];
                if reader.read_exact(&mut body).is_err() {
                    return;
                }
                let (status, text) = answer(&path, &body);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    url
}

/// The URL of a reward server (OpenRLHF's protocol) for this test process:
/// it refuses every other copy of a request with 503 (the first, third, …:
/// so a client needs a retry), answers after 0.5 s (so a short timeout fails),
/// and scores a query by its length, scaled by 1/1000, or by 2/1000 on a
/// path ending in `/other`. Each pipeline's walk uses a path of its own, so
/// walks running side by side do not share request counts.
pub fn reward_server() -> String {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        let seen = std::sync::Mutex::new(std::collections::HashMap::new());
        serve(move |path, body| {
            let copies = {
                let mut seen = seen.lock().unwrap();
                let n = seen
                    .entry((path.to_string(), body.to_vec()))
                    .or_insert(0u32);
                *n += 1;
                *n
            };
            if copies % 2 == 1 {
                return (503, "{}".to_string());
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
            let body: serde_json::Value = serde_json::from_slice(body).unwrap();
            let scale = if path.ends_with("/other") { 2e-3 } else { 1e-3 };
            let rewards: Vec<f64> = body["query"]
                .as_array()
                .unwrap()
                .iter()
                .map(|q| q.as_str().unwrap().len() as f64 * scale)
                .collect();
            (200, serde_json::json!({ "rewards": rewards }).to_string())
        })
    })
    .clone()
}

/// An environment server speaking OpenEnv's protocol, one episode at a
/// time: a guessing game whose number is the reset's seed mod 10. Each
/// step reads the guess from `action.message` and answers `{"hint":
/// "higher" | "lower" | "right", "tries": n}`, reward 1 when right, done
/// when right or after 3 tries. With `garbage`, `/step` answers HTML.
pub fn openenv_server(garbage: bool) -> String {
    let game = std::sync::Mutex::new((0i64, 0u64));
    serve(move |path, body| {
        let body: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let mut game = game.lock().unwrap();
        if path == "/reset" {
            *game = ((body["seed"].as_u64().unwrap_or(0) % 10) as i64, 0);
            let answer = serde_json::json!({"observation": {"hint": "go", "tries": 0}, "reward": null, "done": false});
            return (200, answer.to_string());
        }
        if garbage {
            return (200, "<html>not json</html>".into());
        }
        game.1 += 1;
        let guess: i64 = body["action"]["message"]
            .as_str()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1);
        let hint = match guess.cmp(&game.0) {
            std::cmp::Ordering::Less => "higher",
            std::cmp::Ordering::Greater => "lower",
            std::cmp::Ordering::Equal => "right",
        };
        let answer = serde_json::json!({
            "observation": {"hint": hint, "tries": game.1},
            "reward": if hint == "right" { 1.0 } else { 0.0 },
            "done": hint == "right" || game.1 >= 3,
        });
        (200, answer.to_string())
    })
}

/// The error of a run that must fail.
pub fn run_err(kind: PipelineKind, cfg: RunConfig, dir: &Path) -> String {
    weir::pipelines::run(&request(kind, cfg, dir, false))
        .unwrap_err()
        .to_string()
}

/// Asserts that two per-step curves cover `steps` steps and agree within
/// 1e-4 relative (1e-6 absolute near zero).
pub fn assert_curves_match(
    a: &BTreeMap<u64, f64>,
    b: &BTreeMap<u64, f64>,
    steps: usize,
    what: &str,
) {
    assert_eq!(a.len(), steps, "{what}: {a:?}");
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (step, x) in a {
        let y = b[step];
        assert!(
            (x - y).abs() <= 1e-4 * x.abs().max(1e-2),
            "{what} at step {step}: {x} vs {y}"
        );
    }
}

pub fn u64s(b: &RecordBatch, name: &str) -> Vec<u64> {
    b.column_by_name(name)
        .unwrap_or_else(|| panic!("no {name}"))
        .as_primitive::<UInt64Type>()
        .values()
        .to_vec()
}

/// A text column of every rollout row.
pub fn text_column(dir: &Path, name: &str) -> Vec<String> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b.column_by_name(name).unwrap().as_string::<i32>();
            (0..b.num_rows())
                .map(|i| c.value(i).to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every rollout row's reward.
pub fn reward_column(dir: &Path) -> Vec<f64> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b
                .column_by_name(col::REWARD)
                .unwrap()
                .as_primitive::<Float32Type>();
            c.values().iter().map(|v| f64::from(*v)).collect::<Vec<_>>()
        })
        .collect()
}

/// Every rollout row's response, answer and reward.
pub fn scored_rows(dir: &Path) -> Vec<(String, String, f64)> {
    let rewards = read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| {
            let c = b.column_by_name(col::REWARD).unwrap();
            let c = c.as_primitive::<Float32Type>();
            c.values().iter().map(|v| f64::from(*v)).collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    let (responses, answers) = (text_column(dir, col::RESPONSE), text_column(dir, "answer"));
    responses
        .into_iter()
        .zip(answers)
        .zip(rewards)
        .map(|((r, a), w)| (r, a, w))
        .collect()
}

/// Metric values of `stage`/`metric` by step.
pub fn metric(dir: &Path, stage: &str, name: &str) -> BTreeMap<u64, f64> {
    let mut out = BTreeMap::new();
    for b in read_parquet_file(&dir.join("metrics.parquet")).unwrap() {
        for r in weir::graph::metrics::batch_to_rows(&b).unwrap() {
            if r.stage == stage && r.metric == name {
                out.insert(r.step, r.value);
            }
        }
    }
    out
}

/// A float list column of `b` as rows of f64.
pub fn float_rows(b: &RecordBatch, name: &str) -> Vec<Vec<f64>> {
    let list = b.column_by_name(name).unwrap().as_list::<i32>();
    (0..b.num_rows())
        .map(|i| {
            let row = list.value(i);
            let row = row.as_primitive::<Float32Type>();
            row.values().iter().map(|x| f64::from(*x)).collect()
        })
        .collect()
}

/// Writes arithmetic chat prompts as JSONL: for each pair `(a, b)`, the
/// `messages` asking for `a + b` and the `answer`, with `more(i)`'s fields.
pub fn write_arith_task(
    path: &Path,
    pairs: &[(u32, u32)],
    more: impl Fn(usize) -> serde_json::Value,
) {
    use weir::operators::tasks::arith;
    let lines: Vec<String> = pairs
        .iter()
        .enumerate()
        .map(|(i, &(a, b))| {
            let mut record = serde_json::json!({
                "messages": [{"role": "user", "content": arith::user_message(a, b)}],
                "answer": (a + b).to_string(),
            });
            if let serde_json::Value::Object(fields) = more(i) {
                record.as_object_mut().unwrap().extend(fields);
            }
            record.to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

/// Per step, the mean over the rollout rows of `value(batch, row)`.
pub fn step_means(dir: &Path, value: impl Fn(&RecordBatch, usize) -> f64) -> BTreeMap<u64, f64> {
    let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        for (i, step) in u64s(&b, col::STEP).into_iter().enumerate() {
            let s = sums.entry(step).or_default();
            s.0 += value(&b, i);
            s.1 += 1.0;
        }
    }
    sums.into_iter().map(|(k, (sum, n))| (k, sum / n)).collect()
}

/// Every metric row of a run.
pub fn metric_rows(dir: &Path) -> Vec<weir::graph::metrics::MetricRow> {
    read_parquet_file(&dir.join("metrics.parquet"))
        .unwrap()
        .iter()
        .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
        .collect()
}

/// The optimal token baseline of an `otb` run's log, step by step: the
/// logged advantages are the estimator's on the logged rewards (an
/// episode's environment rewards added), behaviour log-probs, `Σ π²` and
/// generated-token masks; each generated token's `Σ π²` lies in [π², 1]
/// (its distribution's, which holds at least the sampled token), 0 on an
/// episode's other tokens. Returns the rows checked.
pub fn check_otb(dir: &Path) -> usize {
    use weir::operators::data::columns::{env_rewards, generated_masks};
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    type Rows = (Vec<f64>, Vec<u64>, [Vec<Vec<f64>>; 4]);
    let mut steps: BTreeMap<u64, Rows> = BTreeMap::new();
    for b in &batches {
        let behaviour = float_rows(b, col::BEHAVIOR_LOGPROBS);
        let lengths: Vec<usize> = behaviour.iter().map(Vec::len).collect();
        let squares = float_rows(b, col::SUM_PI_SQUARED);
        let masks = generated_masks(b, &lengths, "test").unwrap();
        let env = env_rewards(b, &lengths, "test").unwrap();
        let advantages = float_rows(b, col::ADVANTAGES);
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        for (i, (step, group)) in u64s(b, col::STEP)
            .into_iter()
            .zip(u64s(b, col::GROUP_ID))
            .enumerate()
        {
            for ((lp, sq), m) in behaviour[i].iter().zip(&squares[i]).zip(&masks[i]) {
                if *m > 0.0 {
                    let p2 = (2.0 * lp).exp();
                    assert!(*sq >= p2 - 1e-5 && *sq <= 1.0 + 1e-5, "Σπ² {sq}, π² {p2}");
                } else {
                    assert_eq!(*sq, 0.0);
                }
            }
            let turns: f64 = env.as_ref().map_or(0.0, |e| e[i].iter().sum());
            let rows = steps.entry(step).or_default();
            rows.0.push(f64::from(rewards.value(i)) + turns);
            rows.1.push(group);
            for (to, from) in rows
                .2
                .iter_mut()
                .zip([&behaviour, &squares, &masks, &advantages])
            {
                to.push(from[i].clone());
            }
        }
    }
    let mut checked = 0;
    for (step, (rewards, groups, [behaviour, squares, masks, logged])) in &steps {
        let want = weir::operators::algorithms::optimal_token_baseline(
            rewards, behaviour, squares, masks, groups,
        )
        .unwrap();
        for (row, (w, l)) in want.iter().zip(logged).enumerate() {
            assert_eq!(w.len(), l.len());
            for (t, (a, b)) in w.iter().zip(l).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                    "step {step} row {row} token {t}: logged {b}, the estimator gives {a}"
                );
            }
        }
        checked += logged.len();
    }
    checked
}

/// Every rollout row's list column `name` (float32), in log order.
pub fn float_list_column(dir: &Path, name: &str) -> Vec<Vec<f64>> {
    read_parquet_dir(&dir.join("rollouts"))
        .unwrap()
        .iter()
        .flat_map(|b| weir::operators::data::columns::float_lists(b, name, "test").unwrap())
        .collect()
}
