//! Tools the user writes: a function in a Python file, or an HTTP endpoint.
//!
//! **A Python function.** Its JSON schema comes from its signature and
//! docstring, as transformers' `get_json_schema` reads them: the
//! docstring's first paragraph describes the tool, its `Args:` lines the
//! parameters, their type annotations give the types (`str`, `int`,
//! `float`, `bool`, `list[...]`, `dict`, `Optional`, `Literal`), and those
//! without a default are required. A parameter without an annotation, or
//! a function without a docstring, is refused when the run starts. Calls
//! run in long-lived worker processes (`crate::python_worker`), one per
//! call at once; the function's return value is the output (text as it
//! is, anything else as JSON), an exception an error output naming it. A
//! call past the timeout kills its worker and is a timed-out output.
//!
//! **An HTTP endpoint.** Its name, description and parameters (a JSON
//! schema object) come from the config; a call posts the arguments as a
//! JSON object, and the answer's body is the output (a JSON string's text,
//! else the body as it is). A status other than 2xx is an error output
//! with the status and the start of the body; a call past the timeout is a
//! timed-out output.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::tools::{Tool, ToolOutput};
use crate::python_worker::{Lost, Worker};

const DRIVER: &str = include_str!("tool_driver.py");

/// A function in the user's Python file, as a tool.
pub struct PythonFunctionTool {
    file: PathBuf,
    function: String,
    python: String,
    timeout: Duration,
    schema: Value,
    /// Workers not running a call.
    idle: Mutex<Vec<Worker>>,
}

impl PythonFunctionTool {
    /// Loads `function` from `file` with `python` and reads its schema; a
    /// file that does not load, a missing function, or one whose schema
    /// cannot be read is an error naming them.
    pub fn new(
        file: PathBuf,
        function: String,
        python: String,
        timeout: Duration,
    ) -> Result<Self, String> {
        let name = format!("{}::{function}", file.display());
        if !file.is_file() {
            return Err(format!("{name}: no such file"));
        }
        let mut tool = PythonFunctionTool {
            file,
            function,
            python,
            timeout,
            schema: Value::Null,
            idle: Mutex::new(Vec::new()),
        };
        let mut worker = tool.start().map_err(|e| format!("{name}: {e}"))?;
        let answer = worker
            .call(
                &json!({"op": "schema"}),
                timeout.max(Duration::from_secs(10)),
            )
            .map_err(|_| format!("{name}: its worker gave no schema"))?;
        tool.schema = answer["schema"].clone();
        if !tool.schema["function"]["name"].is_string() {
            return Err(format!("{name}: no schema: {answer}"));
        }
        tool.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(worker);
        Ok(tool)
    }

    fn start(&self) -> Result<Worker, String> {
        let args = [self.file.as_os_str(), std::ffi::OsStr::new(&self.function)];
        Worker::start(&self.python, "agent.python", DRIVER, &args, self.timeout)
    }
}

impl Tool for PythonFunctionTool {
    fn name(&self) -> &str {
        &self.function
    }

    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn call(&self, arguments: &Map<String, Value>) -> ToolOutput {
        let taken = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut worker = match taken.map_or_else(|| self.start(), Ok) {
            Ok(worker) => worker,
            Err(e) => {
                return ToolOutput::error(format!("error: {} could not start: {e}", self.function))
            }
        };
        let request = json!({"op": "call", "arguments": arguments});
        match worker.call(&request, self.timeout) {
            Ok(answer) => {
                self.idle
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(worker);
                match answer["output"].as_str() {
                    Some(text) if answer["ok"] == true => ToolOutput::ok(text),
                    _ => ToolOutput::error(format!(
                        "error: {}",
                        answer["error"].as_str().unwrap_or("the call failed")
                    )),
                }
            }
            // The worker is dropped: killed with whatever it runs.
            Err(Lost::TimedOut) => ToolOutput::timed_out(format!(
                "error: {} gave no answer within {} s",
                self.function,
                self.timeout.as_secs_f64()
            )),
            Err(Lost::Died(why)) => {
                ToolOutput::error(format!("error: {} ended{why}", self.function))
            }
        }
    }
}

/// An HTTP endpoint, as a tool.
pub struct HttpTool {
    url: String,
    schema: Value,
    timeout: Duration,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl HttpTool {
    /// The tool `name` at `url`, described by `description`, whose
    /// arguments are the JSON schema object `parameters`; a URL that is
    /// not `http(s)://` or parameters that are not an object schema are an
    /// error naming them.
    pub fn new(
        url: &str,
        name: &str,
        description: &str,
        parameters: Value,
        timeout: Duration,
    ) -> Result<Self, String> {
        let parsed = reqwest::Url::parse(url).map_err(|e| format!("`{url}`: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!("`{url}`: not an http:// or https:// URL"));
        }
        if parameters["type"] != "object" || !parameters["properties"].is_object() {
            return Err(format!(
                "parameters {parameters}: not a JSON schema of an object (\"type\": \"object\" with \"properties\")"
            ));
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .use_rustls_tls()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("`{url}`: {e}"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(HttpTool {
            url: url.to_string(),
            schema: json!({
                "type": "function",
                "function": {"name": name, "description": description, "parameters": parameters},
            }),
            timeout,
            client,
            runtime,
        })
    }
}

impl Tool for HttpTool {
    fn name(&self) -> &str {
        self.schema["function"]["name"].as_str().unwrap_or("")
    }

    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn call(&self, arguments: &Map<String, Value>) -> ToolOutput {
        let answer = self.runtime.block_on(async {
            let response = self.client.post(&self.url).json(arguments).send().await?;
            let status = response.status();
            Ok::<_, reqwest::Error>((status, response.text().await?))
        });
        match answer {
            Ok((status, body)) if status.is_success() => {
                match serde_json::from_str::<Value>(&body) {
                    Ok(Value::String(text)) => ToolOutput::ok(text),
                    _ => ToolOutput::ok(body),
                }
            }
            Ok((status, body)) => {
                let start: String = body.chars().take(200).collect();
                ToolOutput::error(format!("error: {}: {status}: {start}", self.name()))
            }
            Err(e) if e.is_timeout() => ToolOutput::timed_out(format!(
                "error: {} gave no answer within {} s",
                self.name(),
                self.timeout.as_secs_f64()
            )),
            Err(e) => ToolOutput::error(format!("error: {}: {e}", self.name())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: &str = r#"
import time
from typing import Optional


def lookup(city: str, days: int = 1, units: Optional[str] = None) -> dict:
    """Looks up the weather of a city.

    Args:
        city: The city's name.
        days (int): How many days ahead.
        units: "metric" or "imperial".
    """
    if city == "nowhere":
        raise KeyError(city)
    if city == "slow":
        time.sleep(30)
    return {"city": city, "days": days}


def shout(text: str) -> str:
    """Shouts."""
    return text.upper()


def untyped(x):
    """No annotation."""
    return x
"#;

    fn tool(dir: &std::path::Path, function: &str) -> Result<PythonFunctionTool, String> {
        let file = dir.join("tools.py");
        std::fs::write(&file, TOOLS).unwrap();
        PythonFunctionTool::new(
            file,
            function.into(),
            "python3".into(),
            Duration::from_millis(1500),
        )
    }

    #[test]
    fn a_python_functions_schema_comes_from_its_signature_and_docstring() {
        let dir = tempfile::tempdir().unwrap();
        let lookup = tool(dir.path(), "lookup").unwrap();
        assert_eq!(
            lookup.schema(),
            json!({"type": "function", "function": {
                "name": "lookup",
                "description": "Looks up the weather of a city.",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "days": {"type": "integer", "description": "How many days ahead."},
                    "units": {"type": "string", "description": "\"metric\" or \"imperial\"."},
                }, "required": ["city"]},
            }})
        );
        let args = |v: Value| v.as_object().unwrap().clone();
        let out = lookup.call(&args(json!({"city": "Oslo", "days": 2})));
        assert_eq!(
            (out.text.as_str(), out.ok),
            ("{\"city\": \"Oslo\", \"days\": 2}", true)
        );
        let out = lookup.call(&args(json!({"city": "nowhere"})));
        assert!(
            !out.ok && out.text.contains("KeyError: 'nowhere'"),
            "{}",
            out.text
        );
        let out = lookup.call(&args(json!({"city": "slow"})));
        assert!(out.timed_out && !out.ok, "{}", out.text);
        // After a timeout, a fresh worker answers.
        let out = tool(dir.path(), "shout")
            .unwrap()
            .call(&args(json!({"text": "hi"})));
        assert_eq!(out.text, "HI");
        let e = tool(dir.path(), "untyped").err().unwrap();
        assert!(
            e.contains("tools.py::untyped") && e.contains("parameter `x` has no type annotation"),
            "{e}"
        );
        let e = tool(dir.path(), "missing").err().unwrap();
        assert!(e.contains("it defines no function `missing`"), "{e}");
    }

    #[test]
    fn an_http_tool_posts_its_arguments_and_reads_the_body() {
        let url = super::super::http_env::tests::serve_json(|body| {
            let n = body["n"].as_i64().unwrap_or(0);
            if n < 0 {
                (400, "\"negative\"".to_string())
            } else {
                (
                    200,
                    json!(format!("{} squared is {}", n, n * n)).to_string(),
                )
            }
        });
        let parameters =
            json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let square = HttpTool::new(
            &url,
            "square",
            "Squares n.",
            parameters,
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(square.name(), "square");
        assert_eq!(
            square.schema()["function"]["parameters"]["required"],
            json!(["n"])
        );
        let args = |v: Value| v.as_object().unwrap().clone();
        let out = square.call(&args(json!({"n": 7})));
        assert_eq!((out.text.as_str(), out.ok), ("7 squared is 49", true));
        let out = square.call(&args(json!({"n": -1})));
        assert!(!out.ok && out.text.contains("400"), "{}", out.text);
        let bad = HttpTool::new(
            &url,
            "x",
            "",
            json!({"type": "string"}),
            Duration::from_secs(1),
        );
        assert!(bad
            .err()
            .unwrap()
            .contains("not a JSON schema of an object"));
    }
}
