//! An environment behind an HTTP server speaking OpenEnv's protocol:
//! `POST /reset` with `{"seed": …}` and `POST /step` with `{"action":
//! {FIELD: the turn's text}}`, each answered with `{"observation": {…},
//! "reward": number or null, "done": bool}`.
//!
//! What the model reads after a step is the observation's field
//! `observation_field`: text is appended raw, a list of `{role, content}`
//! messages is rendered by the chat template. Without a field, the
//! observation's only text field is taken, or the whole observation as
//! JSON text. The reset's observation is not shown: the prompt is the
//! row's.
//!
//! A server holds one episode at a time, so each instance is one server
//! (a run lists one URL per episode it runs at once). Every request is
//! bounded by the timeout: one past it ends the episode as `timeout`. A
//! connection that fails, or a 5xx answer, is tried again up to
//! `attempts` times in all; a 4xx answer is the step's error. An answer
//! that is not the protocol's fails the run, naming the server and what
//! it said: a misconfigured server would otherwise fail every episode
//! quietly.

use std::time::Duration;

use serde_json::{json, Value};

use super::environment::{EnvFault, EnvStep, Environment, Observation};

/// Where the server is and how to talk to it.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpEnvConfig {
    /// The server's base URL (`http://host:port`).
    pub url: String,
    /// How long one request may take.
    pub timeout: Duration,
    /// Tries per request when the connection fails or the server answers 5xx.
    pub attempts: u32,
    /// The action's field that carries the turn's text.
    pub action_field: String,
    /// The observation's field the model reads (None: its only text field,
    /// else the observation as JSON).
    pub observation_field: Option<String>,
}

/// An OpenEnv server as an environment.
pub struct HttpEnvironment {
    cfg: HttpEnvConfig,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl HttpEnvironment {
    /// A client of `cfg.url` (refused unless `http://` or `https://`).
    pub fn new(cfg: HttpEnvConfig) -> Result<Self, String> {
        let url = reqwest::Url::parse(&cfg.url)
            .map_err(|e| format!("agent.environment `{}`: {e}", cfg.url))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "agent.environment `{}`: not an http:// or https:// URL",
                cfg.url
            ));
        }
        let client = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .use_rustls_tls()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("agent.environment `{}`: {e}", cfg.url))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        Ok(HttpEnvironment {
            cfg,
            client,
            runtime,
        })
    }

    /// `POST path` with `body`; the answer's JSON, checked to be the protocol's.
    fn post(&self, path: &str, body: &Value) -> Result<Value, EnvFault> {
        let url = format!("{}{path}", self.cfg.url.trim_end_matches('/'));
        let mut last = String::new();
        for _ in 0..self.cfg.attempts.max(1) {
            let sent = self
                .runtime
                .block_on(async { self.client.post(&url).json(body).send().await });
            let response = match sent {
                Ok(response) => response,
                Err(e) if e.is_timeout() => {
                    return Err(EnvFault::Timeout(format!(
                        "{url}: no answer within {} s",
                        self.cfg.timeout.as_secs_f64()
                    )))
                }
                Err(e) => {
                    last = format!("{url}: {e}");
                    continue;
                }
            };
            let status = response.status();
            let text =
                self.runtime
                    .block_on(response.text())
                    .map_err(|e| match e.is_timeout() {
                        true => EnvFault::Timeout(format!("{url}: the answer took too long")),
                        false => EnvFault::Error(format!("{url}: {e}")),
                    })?;
            if status.is_server_error() {
                last = format!("{url}: {status}: {}", snippet(&text));
                continue;
            }
            if !status.is_success() {
                return Err(EnvFault::Error(format!(
                    "{url}: {status}: {}",
                    snippet(&text)
                )));
            }
            return protocol(&url, &text);
        }
        Err(EnvFault::Error(format!(
            "{last} (after {} attempt(s))",
            self.cfg.attempts.max(1)
        )))
    }

    /// What the model reads of `observation`.
    fn observation(&self, url: &str, observation: &Value) -> Result<Observation, EnvFault> {
        let fields = observation.as_object().expect("checked by protocol()");
        let value = match &self.cfg.observation_field {
            Some(field) => fields.get(field).ok_or_else(|| {
                let names: Vec<&String> = fields.keys().collect();
                EnvFault::Protocol(format!(
                    "{url}: the observation has no field `{field}` (agent.observation_field; its fields: {names:?})"
                ))
            })?,
            None => {
                let mut texts = fields.values().filter(|v| v.is_string());
                match (texts.next(), texts.next()) {
                    (Some(only), None) => only,
                    _ => return Ok(Observation::Text(observation.to_string())),
                }
            }
        };
        match value {
            Value::String(text) => Ok(Observation::Text(text.clone())),
            Value::Array(items)
                if items
                    .iter()
                    .all(|m| m["role"].is_string() && m["content"].is_string()) =>
            {
                Ok(Observation::Messages(items.clone()))
            }
            other => Ok(Observation::Text(other.to_string())),
        }
    }
}

/// The first 120 characters of `text`, on one line.
fn snippet(text: &str) -> String {
    let one_line: String = text.chars().take(120).collect();
    one_line.replace(['\n', '\r'], " ")
}

/// `text` as the protocol's answer, or a protocol error naming `url`.
fn protocol(url: &str, text: &str) -> Result<Value, EnvFault> {
    let bad = || {
        EnvFault::Protocol(format!(
            "{url} answered {:?}: not OpenEnv's {{\"observation\": {{…}}, \"reward\": …, \"done\": …}}",
            snippet(text)
        ))
    };
    let answer: Value = serde_json::from_str(text).map_err(|_| bad())?;
    let fits = answer["observation"].is_object()
        && answer["done"].is_boolean()
        && (answer["reward"].is_null() || answer["reward"].is_number());
    if fits {
        Ok(answer)
    } else {
        Err(bad())
    }
}

impl Environment for HttpEnvironment {
    fn reset(&mut self, row: &Value, _prompt: &str) -> Result<Option<String>, EnvFault> {
        // The same row resets the same way in every run.
        let seed = row["group_id"].as_u64().unwrap_or(0) * 1_000_003
            + row["sample_idx"].as_u64().unwrap_or(0);
        self.post("/reset", &json!({"seed": seed}))?;
        Ok(None)
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvFault> {
        let mut fields = serde_json::Map::new();
        fields.insert(self.cfg.action_field.clone(), Value::String(action.into()));
        let answer = self.post("/step", &json!({"action": fields}))?;
        let url = format!("{}/step", self.cfg.url.trim_end_matches('/'));
        Ok(EnvStep {
            observation: self.observation(&url, &answer["observation"])?,
            reward: answer["reward"].as_f64().unwrap_or(0.0),
            done: answer["done"] == true,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};

    /// Serves HTTP on a free local port, each request on a thread of its
    /// own: `answer(path, body as JSON)` gives the status and the body.
    pub(crate) fn serve(
        answer: impl Fn(&str, Value) -> (u16, String) + Send + Sync + 'static,
    ) -> String {
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
                            path = line.split(' ').nth(1).unwrap_or("").to_string();
                        }
                        let lower = line.to_ascii_lowercase();
                        if let Some(v) = lower.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    let (status, text) = answer(&path, body);
                    let reply = format!(
                        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                        text.len()
                    );
                    let _ = stream.write_all(reply.as_bytes());
                });
            }
        });
        url
    }

    /// [`serve`] whatever the path.
    pub(crate) fn serve_json(
        answer: impl Fn(Value) -> (u16, String) + Send + Sync + 'static,
    ) -> String {
        serve(move |_, body| answer(body))
    }

    /// An OpenEnv-style server: a guessing game whose number is the
    /// reset's seed mod 10; each step answers `{"hint": "higher"|"lower"|
    /// "right", "tries": n}`, reward 1 when right. With `garbage`, /step
    /// answers text that is not the protocol's.
    fn guessing_server(garbage: bool) -> String {
        let target = std::sync::Mutex::new((0i64, 0u64));
        serve(move |path, body| {
            let mut t = target.lock().unwrap();
            if path == "/reset" {
                *t = ((body["seed"].as_u64().unwrap_or(0) % 10) as i64, 0);
                let answer = json!({"observation": {"hint": "go", "tries": 0}, "reward": null, "done": false});
                return (200, answer.to_string());
            }
            if garbage {
                return (200, "<html>not json</html>".to_string());
            }
            t.1 += 1;
            let guess: i64 = body["action"]["message"]
                .as_str()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(-1);
            let hint = match guess.cmp(&t.0) {
                std::cmp::Ordering::Less => "higher",
                std::cmp::Ordering::Greater => "lower",
                std::cmp::Ordering::Equal => "right",
            };
            let answer = json!({"observation": {"hint": hint, "tries": t.1},
                                "reward": if hint == "right" { 1.0 } else { 0.0 },
                                "done": hint == "right" || t.1 >= 3});
            (200, answer.to_string())
        })
    }

    fn config(url: &str) -> HttpEnvConfig {
        HttpEnvConfig {
            url: url.into(),
            timeout: Duration::from_secs(5),
            attempts: 2,
            action_field: "message".into(),
            observation_field: None,
        }
    }

    #[test]
    fn an_openenv_server_answers_each_step() {
        let url = guessing_server(false);
        let mut env = HttpEnvironment::new(config(&url)).unwrap();
        let row = json!({"group_id": 0, "sample_idx": 7});
        assert_eq!(env.reset(&row, "p").unwrap(), None);
        let step = env.step("3").unwrap();
        // Two fields, one of them text: that one.
        assert_eq!(step.observation, Observation::Text("higher".into()));
        assert_eq!((step.reward, step.done), (0.0, false));
        let step = env.step(" 7 ").unwrap();
        assert_eq!((step.reward, step.done), (1.0, true));
        // A named field; one that is not there is the server's misfit.
        let mut cfg = config(&url);
        cfg.observation_field = Some("tries".into());
        let mut env = HttpEnvironment::new(cfg).unwrap();
        env.reset(&row, "p").unwrap();
        assert_eq!(
            env.step("1").unwrap().observation,
            Observation::Text("1".into())
        );
        let mut cfg = config(&url);
        cfg.observation_field = Some("text".into());
        let mut env = HttpEnvironment::new(cfg).unwrap();
        env.reset(&row, "p").unwrap();
        let Err(EnvFault::Protocol(e)) = env.step("1") else {
            panic!("not a protocol error")
        };
        assert!(
            e.contains("no field `text`") && e.contains("\"hint\""),
            "{e}"
        );
    }

    #[test]
    fn garbage_is_a_protocol_error_and_a_dead_server_an_error_after_its_attempts() {
        let url = guessing_server(true);
        let mut env = HttpEnvironment::new(config(&url)).unwrap();
        env.reset(&json!({}), "p").unwrap();
        let Err(EnvFault::Protocol(e)) = env.step("1") else {
            panic!("not a protocol error")
        };
        assert!(
            e.contains(&url) && e.contains("<html>not json</html>"),
            "{e}"
        );
        // Nothing listens there any more.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let mut env = HttpEnvironment::new(config(&closed)).unwrap();
        let Err(EnvFault::Error(e)) = env.reset(&json!({}), "p") else {
            panic!("not an error")
        };
        assert!(e.contains("after 2 attempt(s)"), "{e}");
        assert!(HttpEnvironment::new(config("ftp://x")).is_err());
    }
}
