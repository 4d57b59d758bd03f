//! `[agent]`: multi-turn episodes with tools and an environment, and the
//! checks of its values.

use serde::{Deserialize, Serialize};

use super::docs::{key, Key, Readers::*};
use super::text::none_if_empty;
use super::validate::bad;
use super::{ConfigError, OnError, PipelineKind, PythonNetwork, RewardKind, RunConfig, ToolFormat};

/// The built-in tools `agent.tools` may name.
pub const BUILTIN_TOOLS: &[&str] = &["calculator", "python"];

/// One of `agent.tools`: a built-in's name, a Python function, or an HTTP endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a built-in tool's name (\"calculator\", \"python\"), or a table: {file, function} (a Python function) or {url, name, description, parameters} (an HTTP endpoint)"
)]
pub enum ToolSpec {
    /// A built-in, by name.
    Builtin(String),
    /// A function in a Python file.
    Function(FunctionTool),
    /// An HTTP endpoint.
    Http(HttpToolSpec),
}

/// A Python function as a tool: its schema from its signature and docstring.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionTool {
    /// The `.py` file.
    pub file: std::path::PathBuf,
    /// The function, which is also the tool's name.
    pub function: String,
}

/// An HTTP endpoint as a tool: a call posts its arguments as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpToolSpec {
    /// Where calls are posted.
    pub url: String,
    /// The name the model calls it by.
    pub name: String,
    /// What it does, for the model.
    #[serde(default)]
    pub description: String,
    /// Its arguments' JSON schema (an object schema).
    pub parameters: serde_json::Value,
}

impl From<&str> for ToolSpec {
    fn from(name: &str) -> Self {
        ToolSpec::Builtin(name.to_string())
    }
}

impl ToolSpec {
    /// The name the model calls it by.
    pub fn name(&self) -> &str {
        match self {
            ToolSpec::Builtin(name) => name,
            ToolSpec::Function(f) => &f.function,
            ToolSpec::Http(h) => &h.name,
        }
    }

    /// Whether it is the built-in `python`.
    pub fn is_python_builtin(&self) -> bool {
        matches!(self, ToolSpec::Builtin(name) if name == "python")
    }

    /// Whether it runs Python (the built-in `python`, or a Python function).
    pub fn runs_python(&self) -> bool {
        matches!(self, ToolSpec::Function(_)) || self.name() == "python"
    }
}

/// `[agent]`: episodes of several turns, answered by tools or an
/// environment (on when `tools` or `environment` names one).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentSection {
    /// The tools the model may call: built-ins (`calculator`, `python`),
    /// Python functions, HTTP endpoints.
    pub tools: Vec<ToolSpec>,
    /// How the model writes its calls: `hermes`, `llama3_json`, `qwen3_coder`.
    pub tool_format: ToolFormat,
    /// A Python file in OpenRLHF's agent format, or an environment the
    /// user's binary registered.
    #[serde(with = "none_if_empty")]
    pub environment: Option<String>,
    /// The Python file's class.
    pub environment_class: String,
    /// An OpenEnv server's action field that carries the turn's text.
    pub action_field: String,
    /// An OpenEnv server's observation field the model reads ("": its only
    /// text field, else the observation as JSON).
    pub observation_field: String,
    /// Turns of the model per episode at most.
    pub max_turns: usize,
    /// Tokens of one tool output or observation past which it is cut, with a marker.
    pub max_observation_tokens: usize,
    /// Seconds a tool call or an environment's reset or step may take.
    pub timeout_s: f64,
    /// What a failed call or step does: `observe` or `end`.
    pub on_error: OnError,
    /// Tool calls or environment steps at once (and environment instances).
    pub max_concurrency: usize,
    /// The interpreter of the `python` tool and of a Python environment.
    pub python: String,
    /// Whether the `python` tool's runs may reach the network: `isolate`
    /// (refused where the machine cannot cut them off) or `allow`.
    pub python_network: PythonNetwork,
}

impl Default for AgentSection {
    fn default() -> Self {
        AgentSection {
            tools: Vec::new(),
            tool_format: ToolFormat::default(),
            environment: None,
            environment_class: "AgentInstance".into(),
            action_field: "message".into(),
            observation_field: String::new(),
            max_turns: 4,
            max_observation_tokens: 256,
            timeout_s: 30.0,
            on_error: OnError::default(),
            max_concurrency: 8,
            python: "python3".into(),
            python_network: PythonNetwork::default(),
        }
    }
}

impl AgentSection {
    /// Whether a run's rollouts are episodes.
    pub fn enabled(&self) -> bool {
        !self.tools.is_empty() || self.environment.is_some()
    }

    /// The environment's Python file, when it names one.
    pub fn environment_file(&self) -> Option<&str> {
        self.environment.as_deref().filter(|e| e.ends_with(".py"))
    }

    /// The OpenEnv servers it names (comma-separated URLs), when it names any.
    pub fn environment_urls(&self) -> Option<Vec<&str>> {
        let env = self.environment.as_deref()?;
        (env.starts_with("http://") || env.starts_with("https://"))
            .then(|| env.split(',').map(str::trim).collect())
    }
}

impl RunConfig {
    /// `[agent]` and what episodes cannot go with.
    pub(super) fn check_agent(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let a = &self.agent;
        for (i, tool) in a.tools.iter().enumerate() {
            let key = format!("agent.tools[{i}]");
            match tool {
                ToolSpec::Builtin(name) if !BUILTIN_TOOLS.contains(&name.as_str()) => {
                    return bad(
                        &key,
                        format!("{name:?}"),
                        &format!(
                            "no built-in tool of that name: the built-ins are {BUILTIN_TOOLS:?}"
                        ),
                    );
                }
                ToolSpec::Function(f) if !f.file.is_file() => {
                    return bad(
                        &format!("{key}.file"),
                        format!("{:?}", f.file),
                        "no such file",
                    );
                }
                ToolSpec::Http(h) => {
                    let p = &h.parameters;
                    if p["type"] != "object" || !p["properties"].is_object() {
                        return bad(
                            &format!("{key}.parameters"),
                            p.to_string(),
                            "not a JSON schema of an object (type = \"object\", with properties)",
                        );
                    }
                    if !(h.url.starts_with("http://") || h.url.starts_with("https://")) {
                        return bad(
                            &format!("{key}.url"),
                            format!("{:?}", h.url),
                            "not an http:// or https:// URL",
                        );
                    }
                }
                ToolSpec::Builtin(_) | ToolSpec::Function(_) => {}
            }
            if a.tools[..i].iter().any(|t| t.name() == tool.name()) {
                return bad(
                    &key,
                    format!("{:?}", tool.name()),
                    "a second tool of that name",
                );
            }
        }
        if let Some(env) = &a.environment {
            let known = weir_operators::agent::environment::registered(env).is_some();
            if let Some(urls) = a.environment_urls() {
                for url in urls {
                    let host = url
                        .strip_prefix("http://")
                        .or_else(|| url.strip_prefix("https://"));
                    if !host.is_some_and(|h| !h.is_empty() && !h.contains(char::is_whitespace)) {
                        return bad(
                            "agent.environment",
                            format!("{env:?}"),
                            &format!("{url:?} is not an http:// or https:// URL"),
                        );
                    }
                }
                return self.check_agent_rest(pipeline);
            }
            match a.environment_file() {
                Some(file) if !std::path::Path::new(file).is_file() => {
                    return bad("agent.environment", format!("{env:?}"), "no such file");
                }
                None if !known => {
                    let names = weir_operators::agent::environment::registered_names();
                    return bad(
                        "agent.environment",
                        format!("{env:?}"),
                        &format!("neither a .py file, an http(s):// URL, nor an environment this binary registered (registered: {names:?})"),
                    );
                }
                _ => {}
            }
        }
        self.check_agent_rest(pipeline)
    }

    /// `[agent]` past its environment.
    fn check_agent_rest(&self, pipeline: PipelineKind) -> Result<(), ConfigError> {
        let a = &self.agent;
        if self.reward.kind == RewardKind::None && a.environment.is_none() {
            return bad(
                "reward.kind",
                "\"none\"".into(),
                "no reward at all: \"none\" needs agent.environment, whose turn rewards are the rewards",
            );
        }
        for (reason, value) in &self.reward.on_finish {
            let reasons = weir_operators::rewards::finish::FINISH_REASONS;
            if !reasons.contains(&reason.as_str()) {
                return bad(
                    &format!("reward.on_finish.{reason}"),
                    value.to_string(),
                    &format!("no finish_reason of that name: they are {reasons:?}"),
                );
            }
            if !value.is_finite() {
                return bad(
                    &format!("reward.on_finish.{reason}"),
                    value.to_string(),
                    "must be a finite number",
                );
            }
        }
        if !a.enabled() {
            return Ok(());
        }
        if a.max_turns == 0 {
            return bad("agent.max_turns", "0".into(), "must be at least 1");
        }
        if a.max_concurrency == 0 {
            return bad("agent.max_concurrency", "0".into(), "must be at least 1");
        }
        if a.max_observation_tokens == 0 {
            return bad(
                "agent.max_observation_tokens",
                "0".into(),
                "must be at least 1",
            );
        }
        if !(a.timeout_s > 0.0 && a.timeout_s <= 86_400.0) {
            return bad(
                "agent.timeout_s",
                a.timeout_s.to_string(),
                "must be seconds in (0, 86400]",
            );
        }
        if a.tools.iter().any(ToolSpec::is_python_builtin) {
            if let Some(why) = weir_operators::agent::python_tool::refusal(a.python_network) {
                return bad("agent.python_network", "\"isolate\"".into(), &why);
            }
        }
        let (key, value) = match &a.environment {
            Some(env) if a.tools.is_empty() => ("agent.environment", format!("{env:?}")),
            _ => {
                let names: Vec<&str> = a.tools.iter().map(ToolSpec::name).collect();
                ("agent.tools", format!("{names:?}"))
            }
        };
        if pipeline == PipelineKind::Remax {
            return bad(key, value, "remax's greedy baseline rows are single responses, not episodes: use grpo, ppo, reinforce_pp or another RL pipeline");
        }
        if self.eval.every > 0 {
            return bad(key, value, "evaluation during training samples single responses, not episodes: set eval.every = 0");
        }
        if self.generate.long_tail > 0.0 {
            return bad(
                key,
                value,
                "generate.long_tail draws single responses' lengths, not episodes': set it to 0",
            );
        }
        Ok(())
    }
}

/// `[agent]`'s rows of [`super::KEYS`], in the order `weir config` prints them.
pub(super) const KEYS: &[Key] = &[
    key("agent", "tools", Agentic, "Multi-turn episodes with tools the model may call: built-ins by name, \"calculator\" (exact arithmetic on integers and decimals) and \"python\" (a fresh sandboxed interpreter per call: CPU, memory, process, output and wall-clock limits, every process it starts ends with it, off the network unless agent.python_network allows it; the file system is not isolated); {file, function}, a Python function whose schema comes from its signature and docstring (types from its annotations, each parameter's description from the Args: section), run by long-lived workers; {url, name, description, parameters}, an HTTP endpoint a call posts its arguments to (parameters: the arguments' JSON schema). Their schemas reach the chat template as `tools`, which must render them; each turn's calls are answered and the answers rendered by the template as tool messages. An episode is one row: generate.max_new_tokens bounds its whole response, observations included; the reward reads the model's last turn as response (tool_calls holds every call)."),
    key("agent", "tool_format", Agentic, "How the model writes tool calls: \"hermes\" (<tool_call>{json}</tool_call>: Hermes, Qwen2.5, Qwen3), \"llama3_json\" (Llama 3.1's bare JSON), \"qwen3_coder\" (Qwen3-Coder's XML). A call that cannot be read is an error observation and counts in tool_parse_failures."),
    key("agent", "environment", Agentic, "Multi-turn episodes with an environment that answers each turn: a Python file in OpenRLHF's agent format (a class with reset / step, sync or async, whose environment_feedback is appended as raw text and whose rewards are each turn's reward; its `from openrlhf.utils.agent import …` works without OpenRLHF), servers speaking OpenEnv's HTTP protocol (http:// or https:// URLs, comma-separated: each holds one episode at a time; requests bounded by timeout_s, a failed connection or 5xx tried 3 times, an answer outside the protocol fails the run naming the server), or the name of an environment the user's binary registered. Turn rewards sit on each turn's last generated token (env_rewards) and add to the reward."),
    key("agent", "environment_class", Agentic, "The class of the environment's Python file."),
    key("agent", "action_field", Agentic, "An OpenEnv server's action field that carries the model's turn: each step posts {\"action\": {action_field: the turn's text}}."),
    key("agent", "observation_field", Agentic, "The field of an OpenEnv server's observation the model reads next: text is appended raw, a list of {role, content} messages is rendered by the chat template (empty: the observation's only text field, else the whole observation as JSON text)."),
    key("agent", "max_turns", Agentic, "Turns of the model per episode at most (finish_reason max_turns when the last still called a tool or the environment went on)."),
    key("agent", "max_observation_tokens", Agentic, "Tokens of one tool output or environment observation (each message's content) past which it is cut, with a marker saying how many were left out (one that fits exactly is kept whole)."),
    key("agent", "timeout_s", Agentic, "Seconds a tool call (the python tool's wall clock) or an environment's reset or step may take; an environment past it is restarted and its episode ends as timeout."),
    key("agent", "on_error", Agentic, "A failed tool call or environment step: \"observe\" (its error is what the model reads next, and the episode goes on) or \"end\" (the episode ends: finish_reason tool_error, env_error or timeout). Counted either way, as tool_errors or env_errors."),
    key("agent", "max_concurrency", Agentic, "Tool calls and environment steps running at once, each on a thread of its own, while the other episodes of the batch go on decoding (an episode whose call is out leaves the decode pool and comes back with its observation); with agent.environment also the environment's instances (a Python file: one worker process each), so as many episodes hold one at once."),
    key("agent", "python", Agentic, "The interpreter of the python tool, of Python function tools and of a Python environment."),
    key("agent", "python_network", Agentic, "Whether the python tool's runs may reach the network: \"isolate\" (a network namespace of their own, only a loopback that is down; on a machine that gives weir none, the run is refused naming this key) or \"allow\" (on weir's network, never cut off; said once in the log). See docs/security.md."),
];
