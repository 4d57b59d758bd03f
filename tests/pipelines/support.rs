//! What the pipeline tests and the key walk share: the fixtures, a small
//! config per pipeline, running it through the runner `weir run` uses, and
//! a reward server. Each test binary that includes it uses a part.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

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
