//! Tool calls read from a turn's generated text, in the formats model
//! families are trained on.
//!
//! A turn's text may hold any number of calls. Each is a [`ToolCall`] (a
//! name and its arguments, a JSON object) or, when the model wrote
//! something that opens a call but does not complete one, a
//! [`MalformedCall`] saying what is wrong: an episode turns that into an
//! error observation and a metric, never a crash.
//!
//! | format | family | what the model writes |
//! |---|---|---|
//! | [`Hermes`] | Hermes, Qwen2.5, Qwen3 | `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, once per call |
//! | [`Llama3Json`] | Llama 3.1 – 3.3 | the whole message a JSON object `{"name": …, "parameters": {…}}` (or several, separated by `;`), optionally after `<|python_tag|>` |
//! | [`Qwen3CoderXml`] | Qwen3-Coder | `<tool_call><function=NAME><parameter=KEY>value</parameter>…</function></tool_call>` |
//!
//! Other formats implement [`ToolCallParser`].

use serde_json::{Map, Value};

/// One call of a tool: its name and arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The tool's name as the model wrote it.
    pub name: String,
    /// A JSON object.
    pub arguments: Map<String, Value>,
}

/// Text that opens a tool call but does not make one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MalformedCall {
    /// What was wrong, for the error observation the model reads next.
    pub reason: String,
    /// The call's text as the model wrote it (at most [`QUOTED`] characters).
    pub text: String,
}

/// How many characters of a malformed call [`MalformedCall::text`] keeps.
pub const QUOTED: usize = 200;

impl MalformedCall {
    fn new(reason: impl Into<String>, text: &str) -> Self {
        MalformedCall {
            reason: reason.into(),
            text: text.chars().take(QUOTED).collect(),
        }
    }
}

/// What one turn's text calls, in the order written.
pub type Calls = Vec<Result<ToolCall, MalformedCall>>;

/// Reads the tool calls of one turn's generated text.
pub trait ToolCallParser: Send + Sync {
    /// The format's name in a config (`agent.tool_format`).
    fn name(&self) -> &'static str;
    /// The calls in `text`, in order; empty when the turn calls nothing
    /// (its answer is final).
    fn parse(&self, text: &str) -> Calls;
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The bodies between `<tool_call>` and `</tool_call>`, in order; an open
/// tag without its close (a turn cut by its token budget) is an error
/// carrying the rest of the text.
fn tagged_bodies(text: &str) -> Vec<Result<&str, MalformedCall>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        let after = &rest[at + OPEN.len()..];
        match after.find(CLOSE) {
            Some(end) => {
                out.push(Ok(&after[..end]));
                rest = &after[end + CLOSE.len()..];
            }
            None => {
                out.push(Err(MalformedCall::new(
                    format!("a {OPEN} without its {CLOSE}"),
                    after,
                )));
                break;
            }
        }
    }
    out
}

/// A call from a JSON object with a name and arguments under `keys` (the
/// first present): an object, or a string holding one (as some models
/// write it).
fn call_from_json(body: &str, keys: &[&str]) -> Result<ToolCall, MalformedCall> {
    let value: Value = serde_json::from_str(body.trim())
        .map_err(|e| MalformedCall::new(format!("the call is not valid JSON ({e})"), body))?;
    let Value::Object(mut object) = value else {
        return Err(MalformedCall::new("the call is not a JSON object", body));
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => name,
        Some(_) => {
            return Err(MalformedCall::new(
                "the call's \"name\" is not a name",
                body,
            ))
        }
        None => return Err(MalformedCall::new("the call has no \"name\"", body)),
    };
    let arguments = match keys.iter().find_map(|k| object.remove(*k)) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(arguments)) => arguments,
        Some(Value::String(text)) => match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(arguments)) => arguments,
            _ => {
                return Err(MalformedCall::new(
                    format!(
                        "the call's \"{}\" is a string that holds no JSON object",
                        keys[0]
                    ),
                    body,
                ))
            }
        },
        Some(_) => {
            return Err(MalformedCall::new(
                format!("the call's \"{}\" is not a JSON object", keys[0]),
                body,
            ))
        }
    };
    Ok(ToolCall { name, arguments })
}

/// The formats a model family writes its calls in, by their config names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// [`Hermes`]: Hermes, Qwen2.5, Qwen3.
    #[default]
    Hermes,
    /// [`Llama3Json`]: Llama 3.1 and later.
    Llama3Json,
    /// [`Qwen3CoderXml`]: Qwen3-Coder.
    Qwen3Coder,
}

impl ToolFormat {
    /// Its parser.
    pub fn parser(self) -> Box<dyn ToolCallParser> {
        match self {
            ToolFormat::Hermes => Box::new(Hermes),
            ToolFormat::Llama3Json => Box::new(Llama3Json),
            ToolFormat::Qwen3Coder => Box::new(Qwen3CoderXml),
        }
    }
}

/// Hermes-style calls (Hermes, Qwen2.5, Qwen3): a JSON object with `name`
/// and `arguments` between `<tool_call>` and `</tool_call>`, once per call.
pub struct Hermes;

impl ToolCallParser for Hermes {
    fn name(&self) -> &'static str {
        "hermes"
    }

    fn parse(&self, text: &str) -> Calls {
        tagged_bodies(text)
            .into_iter()
            .map(|body| body.and_then(|b| call_from_json(b, &["arguments", "parameters"])))
            .collect()
    }
}

/// Llama 3.1's JSON calls: the whole message is a JSON object with `name`
/// and `parameters` (several separated by `;`), optionally after
/// `<|python_tag|>`; a message that does not start with `{` calls nothing.
pub struct Llama3Json;

impl ToolCallParser for Llama3Json {
    fn name(&self) -> &'static str {
        "llama3_json"
    }

    fn parse(&self, text: &str) -> Calls {
        let text = text.trim();
        let text = text.strip_prefix("<|python_tag|>").unwrap_or(text).trim();
        if !text.starts_with('{') {
            return Vec::new();
        }
        json_objects(text)
            .into_iter()
            .map(|object| object.and_then(|o| call_from_json(o, &["parameters", "arguments"])))
            .collect()
    }
}

/// The JSON objects of `text`, separated by `;` (and white space), each
/// found by its balanced braces outside strings.
fn json_objects(text: &str) -> Vec<Result<&str, MalformedCall>> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        if !rest.starts_with('{') {
            out.push(Err(MalformedCall::new(
                "text after a call that is not another call",
                rest,
            )));
            break;
        }
        match balanced_object(rest) {
            Some(end) => {
                out.push(Ok(&rest[..end]));
                rest = rest[end..].trim_start();
                rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
            }
            None => {
                out.push(Err(MalformedCall::new(
                    "a call whose braces do not close",
                    rest,
                )));
                break;
            }
        }
    }
    out
}

/// The byte length of the JSON object `text` starts with, by its braces
/// (outside strings), or `None` when they do not close.
fn balanced_object(text: &str) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Qwen3-Coder's XML calls: `<tool_call><function=NAME>` then
/// `<parameter=KEY>value</parameter>` per argument, `</function></tool_call>`.
/// A value that reads as JSON (a number, `true`, an object) is that value;
/// any other is a string, without the one newline the template puts on
/// each side of it.
pub struct Qwen3CoderXml;

impl ToolCallParser for Qwen3CoderXml {
    fn name(&self) -> &'static str {
        "qwen3_coder"
    }

    fn parse(&self, text: &str) -> Calls {
        tagged_bodies(text)
            .into_iter()
            .map(|body| body.and_then(xml_call))
            .collect()
    }
}

fn xml_call(body: &str) -> Result<ToolCall, MalformedCall> {
    const FUNCTION: &str = "<function=";
    let inner = body.trim();
    let Some(after) = inner.strip_prefix(FUNCTION) else {
        return Err(MalformedCall::new(
            format!("the call does not start with {FUNCTION}NAME>"),
            body,
        ));
    };
    let Some(end_name) = after.find('>') else {
        return Err(MalformedCall::new(
            "the function's name is not closed by >",
            body,
        ));
    };
    let name = after[..end_name].trim();
    if name.is_empty() {
        return Err(MalformedCall::new("the function has no name", body));
    }
    let Some(end) = after.rfind("</function>") else {
        return Err(MalformedCall::new(
            "a <function=…> without its </function>",
            body,
        ));
    };
    let mut parameters = &after[end_name + 1..end];
    let mut arguments = Map::new();
    const PARAMETER: &str = "<parameter=";
    const PARAMETER_CLOSE: &str = "</parameter>";
    loop {
        let trimmed = parameters.trim_start();
        if trimmed.is_empty() {
            break;
        }
        let Some(after) = trimmed.strip_prefix(PARAMETER) else {
            return Err(MalformedCall::new(
                format!("text inside the function that is not a {PARAMETER}KEY>"),
                body,
            ));
        };
        let Some(end_key) = after.find('>') else {
            return Err(MalformedCall::new(
                "a parameter's name is not closed by >",
                body,
            ));
        };
        let key = after[..end_key].trim();
        let Some(end_value) = after[end_key + 1..].find(PARAMETER_CLOSE) else {
            return Err(MalformedCall::new(
                format!("the parameter {key} has no {PARAMETER_CLOSE}"),
                body,
            ));
        };
        let raw = &after[end_key + 1..end_key + 1 + end_value];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = serde_json::from_str::<Value>(raw.trim())
            .ok()
            .filter(|v| !v.is_string())
            .unwrap_or_else(|| Value::String(raw.to_string()));
        if arguments.insert(key.to_string(), value).is_some() {
            return Err(MalformedCall::new(
                format!("the parameter {key} is given twice"),
                body,
            ));
        }
        parameters = &after[end_key + 1 + end_value + PARAMETER_CLOSE.len()..];
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> Result<ToolCall, MalformedCall> {
        let Value::Object(arguments) = arguments else {
            panic!("arguments are an object")
        };
        Ok(ToolCall {
            name: name.into(),
            arguments,
        })
    }

    fn reasons(calls: &Calls) -> Vec<String> {
        calls
            .iter()
            .map(|c| match c {
                Ok(call) => format!("ok {}", call.name),
                Err(e) => e.reason.clone(),
            })
            .collect()
    }

    #[test]
    fn hermes_calls_are_read_in_order_and_a_turn_without_one_calls_nothing() {
        let text = "Let me compute.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}\n</tool_call>\n<tool_call>{\"name\": \"search\", \"arguments\": \"{\\\"q\\\": \\\"rust\\\"}\"}</tool_call>";
        assert_eq!(
            Hermes.parse(text),
            vec![
                call("calculator", json!({"expression": "12*34"})),
                call("search", json!({"q": "rust"})),
            ]
        );
        assert!(Hermes.parse("The answer is 408.").is_empty());
    }

    #[test]
    fn malformed_hermes_calls_say_what_is_wrong() {
        let calls = Hermes.parse(concat!(
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"x\": 1}</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
            "<tool_call>{\"name\": \"f\", \"arguments\": {}}",
        ));
        assert_eq!(
            reasons(&calls),
            [
                "the call is not valid JSON (EOF while parsing an object at line 1 column 38)",
                "the call is not a JSON object",
                "the call has no \"name\"",
                "the call's \"arguments\" is not a JSON object",
                "a <tool_call> without its </tool_call>",
            ]
        );
        // A call cut by the token budget keeps what was written, bounded.
        let long = format!("<tool_call>{}", "x".repeat(5000));
        let cut = Hermes.parse(&long);
        assert_eq!(cut.len(), 1);
        assert_eq!(cut[0].as_ref().unwrap_err().text.chars().count(), QUOTED);
    }

    #[test]
    fn llama3_calls_are_the_whole_message_with_or_without_the_python_tag() {
        let one =
            "<|python_tag|>{\"name\": \"calculator\", \"parameters\": {\"expression\": \"7*8\"}}";
        assert_eq!(
            Llama3Json.parse(one),
            vec![call("calculator", json!({"expression": "7*8"}))]
        );
        let two = "{\"name\": \"a\", \"parameters\": {\"s\": \"}{;\"}}; {\"name\": \"b\", \"arguments\": {}}";
        assert_eq!(
            Llama3Json.parse(two),
            vec![call("a", json!({"s": "}{;"})), call("b", json!({}))]
        );
        assert!(Llama3Json.parse("56 is the answer {not a call}").is_empty());
        assert_eq!(
            reasons(&Llama3Json.parse("{\"name\": \"a\", \"parameters\": {")),
            ["a call whose braces do not close"]
        );
        assert_eq!(
            reasons(&Llama3Json.parse("{\"name\": \"a\"} and then prose")),
            ["ok a", "text after a call that is not another call"]
        );
    }

    #[test]
    fn qwen3_coder_calls_read_values_as_json_where_they_are_and_text_otherwise() {
        let text = "<tool_call>\n<function=run_python>\n<parameter=code>\nprint(1 + 1)\nx = {'a': 1}\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n<parameter=flags>\n{\"fast\": true}\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            Qwen3CoderXml.parse(text),
            vec![call(
                "run_python",
                json!({"code": "print(1 + 1)\nx = {'a': 1}", "timeout": 30, "flags": {"fast": true}})
            )]
        );
        // A value that is a JSON string stays the text as written.
        let quoted =
            "<tool_call><function=f><parameter=s>\"hi\"</parameter></function></tool_call>";
        assert_eq!(
            Qwen3CoderXml.parse(quoted),
            vec![call("f", json!({"s": "\"hi\""}))]
        );
        let calls = Qwen3CoderXml.parse(concat!(
            "<tool_call>{\"name\": \"f\"}</tool_call>",
            "<tool_call><function=f><parameter=a>1</function></tool_call>",
            "<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
            "<tool_call><function=f></tool_call>",
        ));
        assert_eq!(
            reasons(&calls),
            [
                "the call does not start with <function=NAME>",
                "the parameter a has no </parameter>",
                "the parameter a is given twice",
                "a <function=…> without its </function>",
            ]
        );
    }

    #[test]
    fn every_named_format_has_a_parser_of_that_name() {
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Qwen3Coder,
        ] {
            let name = serde_json::to_value(format).unwrap();
            assert_eq!(format.parser().name(), name.as_str().unwrap());
        }
        assert!(serde_json::from_value::<ToolFormat>(serde_json::json!("mistral")).is_err());
    }
}
