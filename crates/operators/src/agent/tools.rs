//! Tools an episode's model may call: each has a name, the JSON schema the
//! chat template shows the model (transformers' convention: `{"type":
//! "function", "function": {"name", "description", "parameters"}}`), and
//! a call that turns arguments into the text the model reads next.
//!
//! [`answer`] runs one parsed call against a set of tools. Whatever goes
//! wrong (a malformed call, a tool that does not exist, arguments that do
//! not fit, a tool that fails) becomes an output marked not ok whose text
//! says what, for the model to read; an episode never stops on it.

use serde_json::{json, Map, Value};

use super::python_tool::{PythonLimits, PythonNetwork};
use super::tool_calls::{MalformedCall, ToolCall};

/// What a call gives the model to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutput {
    /// The observation's text.
    pub text: String,
    /// Whether the call did what it was asked (false: an error observation).
    pub ok: bool,
    /// Whether it failed by running out of time.
    pub timed_out: bool,
}

impl ToolOutput {
    /// The call did what it was asked; `text` is its output.
    pub fn ok(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            ok: true,
            timed_out: false,
        }
    }

    /// The call failed; `text` says why.
    pub fn error(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            ok: false,
            timed_out: false,
        }
    }

    /// The call ran out of time; `text` says so.
    pub fn timed_out(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            ok: false,
            timed_out: true,
        }
    }
}

/// A tool a model may call.
pub trait Tool: Send + Sync {
    /// The name the model calls it by.
    fn name(&self) -> &str;
    /// Its JSON schema, as the chat template receives it in `tools`.
    fn schema(&self) -> Value;
    /// Runs a call with `arguments` (a JSON object).
    fn call(&self, arguments: &Map<String, Value>) -> ToolOutput;
}

/// The string argument `key` of a call, or an error output naming it.
fn string_argument<'a>(
    tool: &str,
    arguments: &'a Map<String, Value>,
    key: &str,
) -> Result<&'a str, ToolOutput> {
    match arguments.get(key) {
        Some(Value::String(text)) => Ok(text),
        Some(other) => Err(ToolOutput::error(format!(
            "error: {tool}'s argument \"{key}\" must be a string, not {other}"
        ))),
        None => Err(ToolOutput::error(format!(
            "error: {tool} needs the argument \"{key}\""
        ))),
    }
}

/// The built-in `calculator` (see [`super::calculator`]).
pub struct Calculator;

impl Tool for Calculator {
    fn name(&self) -> &str {
        "calculator"
    }

    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluates an arithmetic expression exactly: integers and decimals, + - * / % and ^ (whole exponents), parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "The expression, e.g. \"123 * 456\"."}
                    },
                    "required": ["expression"]
                }
            }
        })
    }

    fn call(&self, arguments: &Map<String, Value>) -> ToolOutput {
        let expression = match string_argument(self.name(), arguments, "expression") {
            Ok(expression) => expression,
            Err(output) => return output,
        };
        match super::calculator::evaluate(expression) {
            Ok(value) => ToolOutput::ok(value),
            Err(e) => ToolOutput::error(format!("error: {e}")),
        }
    }
}

/// The built-in `python` (see [`super::python_tool`]).
pub struct Python {
    /// The interpreter (a name on `PATH` or a path).
    pub interpreter: String,
    /// Each run's limits.
    pub limits: PythonLimits,
    /// Whether its runs may reach the network (`agent.python_network`).
    pub network: PythonNetwork,
}

impl Tool for Python {
    fn name(&self) -> &str {
        "python"
    }

    fn schema(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": "python",
                "description": format!(
                    "Runs Python code in a fresh interpreter and returns what it prints (stdout, then stderr). Limits: {} s of CPU, {} MiB of memory, {} KiB of output.",
                    self.limits.cpu_seconds,
                    self.limits.memory_bytes >> 20,
                    self.limits.output_bytes >> 10
                ),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "The program; print what you want to see."}
                    },
                    "required": ["code"]
                }
            }
        })
    }

    fn call(&self, arguments: &Map<String, Value>) -> ToolOutput {
        let code = match string_argument(self.name(), arguments, "code") {
            Ok(code) => code,
            Err(output) => return output,
        };
        match super::python_tool::run(&self.interpreter, code, &self.limits, self.network) {
            Ok(ran) => ToolOutput {
                text: ran.text,
                ok: ran.ok,
                timed_out: ran.timed_out,
            },
            Err(e) => ToolOutput::error(format!("error: {e}")),
        }
    }
}

/// The output of one call read from a turn: the tool's, or an error saying
/// why there is none.
pub fn answer(tools: &[Box<dyn Tool>], call: &Result<ToolCall, MalformedCall>) -> ToolOutput {
    let call = match call {
        Ok(call) => call,
        Err(malformed) => {
            return ToolOutput::error(format!(
                "error: the tool call could not be read: {}",
                malformed.reason
            ))
        }
    };
    match tools.iter().find(|t| t.name() == call.name) {
        Some(tool) => tool.call(&call.arguments),
        None => {
            let names: Vec<&str> = tools.iter().map(|t| t.name()).collect();
            ToolOutput::error(format!(
                "error: there is no tool {:?}; the tools are: {}",
                call.name,
                names.join(", ")
            ))
        }
    }
}

/// The schemas of `tools`, for the chat template's `tools`.
pub fn schemas(tools: &[Box<dyn Tool>]) -> Vec<Value> {
    tools.iter().map(|t| t.schema()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tool_calls::{Hermes, ToolCallParser};

    fn tools() -> Vec<Box<dyn Tool>> {
        vec![
            Box::new(Calculator),
            Box::new(Python {
                interpreter: "python3".into(),
                limits: PythonLimits::default(),
                network: PythonNetwork::Isolate,
            }),
        ]
    }

    fn answers(text: &str) -> Vec<ToolOutput> {
        let tools = tools();
        Hermes
            .parse(text)
            .iter()
            .map(|c| answer(&tools, c))
            .collect()
    }

    #[test]
    fn calls_read_from_a_turn_are_answered_by_their_tools() {
        let got = answers(concat!(
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"123 * 456\"}}</tool_call>",
            "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(sum(range(10)))\"}}</tool_call>",
        ));
        assert_eq!(got, [ToolOutput::ok("56088"), ToolOutput::ok("45\n")]);
    }

    #[test]
    fn what_goes_wrong_is_an_error_observation_naming_it() {
        let got = answers(concat!(
            "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": 12}}</tool_call>",
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1/0\"}}</tool_call>",
            "<tool_call>{\"name\": \"calculator\"",
        ));
        let texts: Vec<&str> = got.iter().map(|o| o.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "error: there is no tool \"search\"; the tools are: calculator, python",
                "error: calculator needs the argument \"expression\"",
                "error: calculator's argument \"expression\" must be a string, not 12",
                "error: division by zero",
                "error: the tool call could not be read: a <tool_call> without its </tool_call>",
            ]
        );
        assert!(got.iter().all(|o| !o.ok));
    }

    #[test]
    fn schemas_follow_the_transformers_convention() {
        for schema in schemas(&tools()) {
            let function = &schema["function"];
            assert_eq!(schema["type"], "function");
            assert!(function["name"].is_string() && function["description"].is_string());
            let required = function["parameters"]["required"].as_array().unwrap();
            for key in required {
                assert!(function["parameters"]["properties"][key.as_str().unwrap()].is_object());
            }
        }
    }
}
