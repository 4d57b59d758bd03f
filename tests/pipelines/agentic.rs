//! Multi-turn episodes through whole runs: grpo, ppo and reinforce_pp with
//! an environment in OpenRLHF's agent format and with the calculator tool;
//! the rollout log's per-token columns checked row by row; the bad inputs
//! of `[agent]`, each refused with one line naming it.

use std::path::Path;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{Float32Type, UInt32Type, UInt8Type};
use weir::graph::parquet_log::read_parquet_dir;
use weir::operators::rollout::{col, TokenKind};
use weir::pipelines::config::RewardKind;
use weir::pipelines::PipelineKind;

use super::support::{chat_questions, config, fixture, run, with_tool_template};

/// An environment in OpenRLHF's format: async, importing
/// `openrlhf.utils.agent`; the episode is two turns whatever the model
/// says (`done` at the second step), each turn worth 1 when it is the
/// label and 0.25 otherwise, the feedback raw text.
const TWO_TURNS: &str = r#"
from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.steps = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.steps += 1
        right = states["action_text"].strip() == states["label"]
        return {
            "rewards": 1.0 if right else 0.25,
            "scores": 1.0 if right else 0.0,
            "environment_feedback": "\nAgain:",
            "done": self.steps >= 2,
        }


class AgentExecutor(AgentExecutorBase):
    def __init__(self, *args):
        super().__init__(AgentInstance, *args)
"#;

/// A column of lists of `T`, row by row (null rows empty).
fn lists<T: arrow::datatypes::ArrowPrimitiveType>(
    b: &RecordBatch,
    name: &str,
) -> Vec<Vec<T::Native>> {
    let list = b
        .column_by_name(name)
        .unwrap_or_else(|| panic!("no column {name}"))
        .as_list::<i32>();
    (0..list.len())
        .map(|i| list.value(i).as_primitive::<T>().values().to_vec())
        .collect()
}

/// Per row: the behaviour log-probs, `None` where null.
fn nullable_logprobs(b: &RecordBatch) -> Vec<Vec<Option<f32>>> {
    let list = b
        .column_by_name(col::BEHAVIOR_LOGPROBS)
        .unwrap()
        .as_list::<i32>();
    (0..list.len())
        .map(|i| {
            let v = list.value(i);
            let v = v.as_primitive::<Float32Type>();
            (0..v.len())
                .map(|j| v.is_valid(j).then(|| v.value(j)))
                .collect()
        })
        .collect()
}

/// Checks what every episode's per-token columns say of each other: the
/// kinds, turns, log-probs and rewards of one trajectory, aligned.
fn check_episode_rows(batches: &[RecordBatch], feedback: &[i64]) -> usize {
    let mut observed = 0;
    for b in batches {
        let tokens = lists::<arrow::datatypes::Int64Type>(b, col::RESPONSE_TOKENS);
        let kinds = lists::<UInt8Type>(b, col::TOKEN_KINDS);
        let turns = lists::<UInt32Type>(b, col::TOKEN_TURNS);
        let env = lists::<Float32Type>(b, col::ENV_REWARDS);
        let logprobs = nullable_logprobs(b);
        for row in 0..b.num_rows() {
            let n = tokens[row].len();
            assert_eq!(kinds[row].len(), n);
            assert_eq!(turns[row].len(), n);
            assert_eq!(env[row].len(), n);
            assert_eq!(logprobs[row].len(), n);
            for i in 0..n {
                let generated = kinds[row][i] == TokenKind::Generated as u8;
                assert_eq!(
                    logprobs[row][i].is_some(),
                    generated,
                    "row {row}, token {i}: a log-prob exactly on generated tokens"
                );
                if env[row][i] != 0.0 {
                    assert!(generated, "a turn reward sits on a generated token");
                }
            }
            // Raw-text feedback: each observation span is exactly its tokens.
            let mut i = 0;
            while i < n {
                if kinds[row][i] == TokenKind::Observation as u8 {
                    assert_eq!(&tokens[row][i..i + feedback.len()], feedback);
                    assert_eq!(turns[row][i], turns[row][i - 1]);
                    assert_eq!(turns[row][i + feedback.len()], turns[row][i] + 1);
                    observed += 1;
                    i += feedback.len();
                } else {
                    i += 1;
                }
            }
        }
    }
    observed
}

#[test]
fn an_openrlhf_agent_file_drives_episodes_in_grpo_ppo_and_reinforce_pp() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("agent_func.py");
    std::fs::write(&file, TWO_TURNS).unwrap();
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let feedback = tokenizer.encode("\nAgain:", false).unwrap();
    for kind in [
        PipelineKind::Grpo,
        PipelineKind::Ppo,
        PipelineKind::ReinforcePp,
    ] {
        let mut cfg = config(kind, 2);
        cfg.agent.environment = Some(file.display().to_string());
        cfg.agent.max_turns = 3;
        cfg.generate.max_new_tokens = 24;
        cfg.reward.kind = RewardKind::None;
        let dir = tmp.path().join(kind.name());
        run(kind, cfg, &dir, false);
        let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
        let observed = check_episode_rows(&batches, &feedback);
        assert!(
            observed > 0,
            "{}: no episode got past its first turn",
            kind.name()
        );
        for b in &batches {
            let reasons = b
                .column_by_name(col::FINISH_REASON)
                .unwrap()
                .as_string::<i32>();
            let env = lists::<Float32Type>(b, col::ENV_REWARDS);
            let kinds = lists::<UInt8Type>(b, col::TOKEN_KINDS);
            for row in 0..b.num_rows() {
                let turns_rewarded = env[row].iter().filter(|&&r| r != 0.0).count();
                match reasons.value(row) {
                    // Done at the second step: two turns, each rewarded.
                    "stop" => assert_eq!(turns_rewarded, 2),
                    "length" => assert!(turns_rewarded <= 1),
                    other => panic!("{}: finish_reason {other}", kind.name()),
                }
                let last = *kinds[row].last().unwrap();
                assert_eq!(
                    last,
                    TokenKind::Generated as u8,
                    "an episode ends on the model's turn"
                );
            }
            // reward.kind = "none": the environment's rewards are all there is.
            let rewards = b
                .column_by_name(col::REWARD)
                .unwrap()
                .as_primitive::<Float32Type>();
            assert!(rewards.values().iter().all(|&r| r == 0.0));
        }
    }
}

/// The optimal token baseline over episodes (verl's multi-turn form): its
/// positions count the model's own tokens only, the observations between
/// turns skipped.
#[test]
fn the_optimal_token_baseline_counts_only_the_models_tokens_of_an_episode() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("agent_func.py");
    std::fs::write(&file, TWO_TURNS).unwrap();
    let kind = PipelineKind::Otb;
    let mut cfg = config(kind, 2);
    cfg.agent.environment = Some(file.display().to_string());
    cfg.agent.max_turns = 3;
    cfg.generate.max_new_tokens = 24;
    cfg.reward.kind = RewardKind::None;
    let dir = tmp.path().join("otb");
    run(kind, cfg, &dir, false);
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let feedback = tokenizer.encode("\nAgain:", false).unwrap();
    assert!(
        check_episode_rows(&batches, &feedback) > 0,
        "no episode got past its first turn"
    );
    assert!(super::support::check_otb(&dir) > 0);
}

/// Prompts from a file through the chat template (a system prompt and the
/// question), with tools: the episode's prompt is that conversation
/// rendered once with the tools' schemas, not the rendered text nested in
/// another user message.
#[test]
fn a_chat_rendered_prompt_file_with_tools_renders_its_conversation_once() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 1);
    cfg.model.path = with_tool_template(tmp.path());
    let questions = (1..5).map(|i| (format!("{i}*7="), format!("{}", 7 * i)));
    chat_questions(&mut cfg, tmp.path(), questions);
    cfg.data.system_prompt = Some("Use the tools.".into());
    cfg.agent.tools = vec!["calculator".into()];
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let mut rows = 0;
    for b in &read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let prompts = lists::<arrow::datatypes::Int64Type>(b, col::PROMPT_TOKENS);
        let messages = b
            .column_by_name(col::PROMPT_MESSAGES)
            .unwrap()
            .as_string::<i32>();
        for (row, prompt) in prompts.iter().enumerate() {
            let m: serde_json::Value = serde_json::from_str(messages.value(row)).unwrap();
            let question = m[1]["content"].as_str().unwrap();
            let text = tokenizer.decode(prompt, false).unwrap();
            let want = format!(
                "<|im_end|>\n<|im_start|>system\nUse the tools.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            );
            assert!(
                text.starts_with("<|im_start|>system\nTools:\n") && text.ends_with(&want),
                "{text}"
            );
            assert_eq!(text.matches("<|im_start|>").count(), 4, "{text}");
            rows += 1;
        }
    }
    assert_eq!(rows, 3 * 4);
}

/// The `tool-caller` fixture (arith-sft taught to call the calculator on
/// every arith prompt, then to answer with its output) runs episodes in
/// grpo: its calls reach the tool, whose outputs are the sums the calls
/// ask for, logged in `tool_calls` and in the token stream as observation
/// tokens between the call's turn and the answer's.
#[test]
fn the_calculator_tool_runs_in_grpo_on_the_models_own_calls() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.model.path = fixture("tool-caller");
    cfg.agent.tools = vec!["calculator".into()];
    cfg.agent.max_turns = 2;
    // The call is ~50 tokens of this tokenizer's; sampled cooler than at
    // 1.0, the fixture's calls come out whole.
    cfg.generate.max_new_tokens = 96;
    cfg.generate.temperature = 0.3;
    cfg.reward.on_finish = [("length".to_string(), -1.0)].into();
    let dir = tmp.path().join("run");
    run(kind, cfg, &dir, false);
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("tool-caller")).unwrap();
    let (mut rows, mut called, mut answered) = (0, 0, 0);
    for b in &batches {
        let prompts = lists::<arrow::datatypes::Int64Type>(b, col::PROMPT_TOKENS);
        let responses = lists::<arrow::datatypes::Int64Type>(b, col::RESPONSE_TOKENS);
        let kinds = lists::<UInt8Type>(b, col::TOKEN_KINDS);
        let reasons = b
            .column_by_name(col::FINISH_REASON)
            .unwrap()
            .as_string::<i32>();
        let rewards = b
            .column_by_name(col::REWARD)
            .unwrap()
            .as_primitive::<Float32Type>();
        let calls = b.column_by_name("tool_calls").unwrap().as_string::<i32>();
        for row in 0..b.num_rows() {
            rows += 1;
            let prompt = tokenizer.decode(&prompts[row], false).unwrap();
            assert!(
                prompt.starts_with("<|im_start|>system\nTools: calculator<|im_end|>"),
                "the tool's name in the prompt: {prompt}"
            );
            if reasons.value(row) == "length" {
                assert_eq!(rewards.value(row), -1.0, "reward.on_finish replaced it");
            }
            let calls: Vec<serde_json::Value> = serde_json::from_str(calls.value(row)).unwrap();
            // What the tools said, in the token stream.
            let observed: Vec<i64> = responses[row]
                .iter()
                .zip(&kinds[row])
                .filter(|(_, &k)| k == TokenKind::Observation as u8)
                .map(|(&t, _)| t)
                .collect();
            let observed = tokenizer.decode(&observed, false).unwrap();
            // A sampled call can come out garbled: an error observation.
            for call in calls.iter().filter(|c| c["ok"] == true) {
                assert_eq!(call["tool"], "calculator", "{call}");
                // The arguments as the model wrote them: a JSON object's text.
                let arguments: serde_json::Value =
                    serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
                let expression = arguments["expression"].as_str().unwrap_or_default();
                let sum: Option<u64> = expression.split_once('+').and_then(|(a, b)| {
                    Some(a.trim().parse::<u64>().ok()? + b.trim().parse::<u64>().ok()?)
                });
                if let Some(sum) = sum {
                    assert_eq!(call["output"], sum.to_string(), "the tool's output: {call}");
                    assert!(
                        observed.contains(&sum.to_string()),
                        "{observed:?} for {call}"
                    );
                    called += 1;
                }
            }
            if calls.len() == 1 && reasons.value(row) == "stop" {
                answered += 1;
            }
        }
    }
    assert_eq!(rows, 2 * 3 * 4);
    // The fixture calls on nearly every prompt.
    assert!(
        called * 4 >= rows * 3,
        "{called} of {rows} episodes called the calculator with a sum"
    );
    assert!(answered > 0, "no episode answered after its call");
    let metrics =
        weir::graph::parquet_log::read_parquet_file(&dir.join("metrics.parquet")).unwrap();
    let calls_metric: Vec<f64> = metrics
        .iter()
        .flat_map(|b| weir::graph::metrics::batch_to_rows(b).unwrap())
        .filter(|r| r.stage == "generate" && r.metric == "tool_calls")
        .map(|r| r.value)
        .collect();
    assert!(
        !calls_metric.is_empty() && calls_metric.iter().all(|&c| c > 0.5),
        "{calls_metric:?}"
    );
}

#[test]
fn bad_agent_inputs_are_refused_with_one_line_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let err = |cfg: weir::pipelines::RunConfig, name: &str| -> String {
        let dir = tmp.path().join(name);
        let e = weir::pipelines::run(&super::support::request(kind, cfg, &dir, false))
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        e
    };
    // A template that does not render tools.
    let mut cfg = config(kind, 1);
    cfg.agent.tools = vec!["calculator".into()];
    let e = err(cfg, "template");
    assert!(
        e.contains("arith-sft") && e.contains("does not render `tools`"),
        "{e}"
    );
    // A tool that does not exist.
    let mut cfg = config(kind, 1);
    cfg.agent.tools = vec!["search".into()];
    let e = err(cfg, "tool");
    assert!(e.contains("agent.tools") && e.contains("\"search\""), "{e}");
    // An environment file without the class.
    let file = tmp.path().join("env.py");
    std::fs::write(&file, "class Game:\n    pass\n").unwrap();
    let mut cfg = config(kind, 1);
    cfg.agent.environment = Some(file.display().to_string());
    let e = err(cfg, "class");
    assert!(
        e.contains("env.py::AgentInstance")
            && e.contains("no class `AgentInstance` (its classes: Game)"),
        "{e}"
    );
    // A finish reason that does not exist; no reward without an environment.
    let mut cfg = config(kind, 1);
    cfg.reward.on_finish = [("truncated".to_string(), 0.0)].into();
    let e = err(cfg, "finish");
    assert!(e.contains("reward.on_finish.truncated"), "{e}");
    let mut cfg = config(kind, 1);
    cfg.reward.kind = RewardKind::None;
    let e = err(cfg, "none");
    assert!(
        e.contains("reward.kind") && e.contains("agent.environment"),
        "{e}"
    );
    // Episodes with what they cannot go with yet.
    let mut cfg = config(PipelineKind::Remax, 1);
    cfg.agent.tools = vec!["calculator".into()];
    let e = weir::pipelines::run(&super::support::request(
        PipelineKind::Remax,
        cfg,
        &tmp.path().join("remax"),
        false,
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("agent.tools") && e.contains("remax"), "{e}");
}

#[test]
fn an_openenv_server_drives_episodes_and_one_that_answers_garbage_fails_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 1);
    cfg.agent.environment = Some(super::support::openenv_server(false));
    cfg.agent.max_turns = 4;
    cfg.generate.max_new_tokens = 48;
    cfg.reward.kind = RewardKind::None;
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let mut hints = 0;
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let tokens = lists::<arrow::datatypes::Int64Type>(&b, col::RESPONSE_TOKENS);
        let kinds = lists::<UInt8Type>(&b, col::TOKEN_KINDS);
        let env = lists::<Float32Type>(&b, col::ENV_REWARDS);
        for row in 0..b.num_rows() {
            // The observations are the hints, appended raw.
            let observed: Vec<i64> = tokens[row]
                .iter()
                .zip(&kinds[row])
                .filter(|(_, &k)| k == TokenKind::Observation as u8)
                .map(|(&t, _)| t)
                .collect();
            let text = tokenizer.decode(&observed, false).unwrap();
            let words = text.replace("higher", "").replace("lower", "");
            assert!(words.is_empty(), "observations {text:?}");
            hints += (text.len() - words.len()).min(1);
            let total: f32 = env[row].iter().sum();
            assert!(total == 0.0 || total == 1.0, "{total}");
        }
    }
    assert!(hints > 0, "no episode read a hint");
    // A server that answers outside the protocol: one line naming it.
    let garbage = super::support::openenv_server(true);
    cfg.agent.environment = Some(garbage.clone());
    let e = weir::pipelines::run(&super::support::request(
        kind,
        cfg.clone(),
        &tmp.path().join("bad"),
        false,
    ))
    .unwrap_err()
    .to_string();
    assert!(!e.contains('\n'), "{e}");
    assert!(
        e.contains(&garbage) && e.contains("not OpenEnv's") && e.contains("row "),
        "{e}"
    );
    // Streamed, an error in a later batch names the row of its batch: a
    // server that fails only once the second step's episodes reset.
    let resets = std::sync::atomic::AtomicUsize::new(0);
    let late = super::support::serve(move |path, _| {
        use std::sync::atomic::Ordering::SeqCst;
        let answer =
            serde_json::json!({"observation": {"hint": "go"}, "reward": 0.0, "done": false});
        if path == "/reset" {
            resets.fetch_add(1, SeqCst);
            return (200, answer.to_string());
        }
        if resets.load(SeqCst) > 12 {
            return (200, "<html>not json</html>".into());
        }
        (
            200,
            serde_json::json!({"observation": {"hint": "go"}, "reward": 0.0, "done": true})
                .to_string(),
        )
    });
    let mut streamed = cfg;
    streamed.agent.environment = Some(late);
    streamed.generate.max_inflight = 4;
    streamed.run.steps = 2;
    streamed.run.max_staleness = 0;
    let e = weir::pipelines::run(&super::support::request(
        kind,
        streamed,
        &tmp.path().join("bad-streamed"),
        false,
    ))
    .unwrap_err()
    .to_string();
    let row: usize = e
        .split("row ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no row in {e}"));
    assert!(row < 12, "{e}");
}

#[test]
fn python_function_and_http_tools_reach_the_prompt_with_their_schemas() {
    use weir::pipelines::config::{FunctionTool, HttpToolSpec, ToolSpec};
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("tools.py");
    std::fs::write(
        &file,
        "def add(a: int, b: int) -> int:\n    \"\"\"Adds two integers.\n\n    Args:\n        a: The first.\n        b: The second.\n    \"\"\"\n    return a + b\n",
    )
    .unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 1);
    cfg.model.path = with_tool_template(tmp.path());
    cfg.agent.tools = vec![
        ToolSpec::Function(FunctionTool {
            file: file.clone(),
            function: "add".into(),
        }),
        ToolSpec::Http(HttpToolSpec {
            url: "http://127.0.0.1:9/square".into(),
            name: "square".into(),
            description: "Squares n.".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}}),
        }),
    ];
    cfg.generate.max_new_tokens = 16;
    let dir = tmp.path().join("run");
    run(kind, cfg.clone(), &dir, false);
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    let prompts = lists::<arrow::datatypes::Int64Type>(&batches[0], col::PROMPT_TOKENS);
    let text = tokenizer.decode(&prompts[0], false).unwrap();
    // The schema as read from the signature and docstring, and the endpoint's.
    assert!(
        text.contains(r#""description":"Adds two integers.""#)
            && text.contains(r#""a":{"description":"The first.","type":"integer"}"#)
            && text.contains(r#""name":"square""#),
        "{text}"
    );
    // An undocumented function, or parameters that are no object schema, are refused.
    std::fs::write(&file, "def add(a, b):\n    return a + b\n").unwrap();
    let e = weir::pipelines::run(&super::support::request(
        kind,
        cfg.clone(),
        &tmp.path().join("bad"),
        false,
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("agent.tools[0]") && e.contains("tools.py::add"),
        "{e}"
    );
    let ToolSpec::Http(h) = &mut cfg.agent.tools[1] else {
        unreachable!()
    };
    h.parameters = serde_json::json!({"type": "string"});
    let e = weir::pipelines::run(&super::support::request(
        kind,
        cfg,
        &tmp.path().join("bad2"),
        false,
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("agent.tools[1].parameters"), "{e}");
}

/// Rows of a run keyed by (step, group, sample): their response tokens.
fn responses_by_row(dir: &Path) -> std::collections::BTreeMap<(u64, u64, u32), Vec<i64>> {
    use arrow::datatypes::UInt64Type;
    let mut out = std::collections::BTreeMap::new();
    for b in read_parquet_dir(&dir.join("rollouts")).unwrap() {
        let tokens = lists::<arrow::datatypes::Int64Type>(&b, col::RESPONSE_TOKENS);
        let step = b
            .column_by_name(col::STEP)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let group = b
            .column_by_name(col::GROUP_ID)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let sample = b
            .column_by_name(col::SAMPLE_IDX)
            .unwrap()
            .as_primitive::<UInt32Type>();
        for (row, t) in tokens.into_iter().enumerate() {
            out.insert((step.value(row), group.value(row), sample.value(row)), t);
        }
    }
    out
}

#[test]
fn streamed_episodes_match_batch_episodes_at_k0_and_span_versions_at_k1() {
    use arrow::datatypes::UInt64Type;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("agent_func.py");
    std::fs::write(&file, TWO_TURNS).unwrap();
    let kind = PipelineKind::Grpo;
    let mut cfg = config(kind, 2);
    cfg.agent.environment = Some(file.display().to_string());
    cfg.agent.max_turns = 3;
    cfg.generate.max_new_tokens = 24;
    cfg.reward.kind = RewardKind::None;
    cfg.run.max_staleness = 0;
    run(kind, cfg.clone(), &tmp.path().join("batch"), false);
    let mut streamed = cfg.clone();
    streamed.generate.max_inflight = 5;
    run(kind, streamed.clone(), &tmp.path().join("stream"), false);
    let (a, b) = (
        responses_by_row(&tmp.path().join("batch")),
        responses_by_row(&tmp.path().join("stream")),
    );
    assert_eq!(a.len(), 2 * 3 * 4);
    assert_eq!(a, b, "k = 0: the same episodes, streamed or batch by batch");
    // At k = 1 episodes may span two versions; each token says which.
    streamed.run.max_staleness = 1;
    streamed.run.steps = 4;
    streamed.generate.on_new_weights = weir::pipelines::config::OnNewWeights::Keep;
    let dir = tmp.path().join("k1");
    run(kind, streamed, &dir, false);
    let tokenizer = weir::gpu::Tokenizer::load(&fixture("arith-sft")).unwrap();
    let feedback = tokenizer.encode("\nAgain:", false).unwrap();
    let batches = read_parquet_dir(&dir.join("rollouts")).unwrap();
    assert!(check_episode_rows(&batches, &feedback) > 0);
    let mut rows = 0;
    for b in &batches {
        let versions = lists::<UInt32Type>(b, col::TOKEN_VERSIONS);
        let tokens = lists::<arrow::datatypes::Int64Type>(b, col::RESPONSE_TOKENS);
        let policy = b
            .column_by_name(col::POLICY_VERSION)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let staleness = b
            .column_by_name(col::STALENESS)
            .unwrap()
            .as_primitive::<UInt64Type>();
        let recomputed = b
            .column_by_name(col::KV_RECOMPUTED)
            .unwrap()
            .as_list::<i32>();
        let kinds = lists::<UInt8Type>(b, col::TOKEN_KINDS);
        let turns = lists::<UInt32Type>(b, col::TOKEN_TURNS);
        for row in 0..b.num_rows() {
            rows += 1;
            assert_eq!(versions[row].len(), tokens[row].len());
            // A turn that rejoined the pool had its context prefilled again
            // under its first token's weights; the first turn's (under
            // "keep") was never recomputed, nor are observations.
            let flags = recomputed.value(row);
            let flags = flags.as_boolean();
            assert_eq!(flags.len(), tokens[row].len());
            for i in 0..flags.len() {
                let generated = kinds[row][i] == TokenKind::Generated as u8;
                let opens_turn =
                    generated && (i == 0 || kinds[row][i - 1] != TokenKind::Generated as u8);
                if !generated || turns[row][i] == 0 {
                    assert!(!flags.value(i), "row {row}, token {i}");
                } else if opens_turn {
                    assert!(flags.value(i), "row {row}, token {i}");
                }
            }
            let oldest = versions[row].iter().min().copied().unwrap_or(0);
            assert_eq!(policy.value(row), u64::from(oldest));
            assert!(staleness.value(row) <= 1);
        }
    }
    assert_eq!(rows, 4 * 3 * 4, "every row once");
}
