//! `RemoteReward`: rewards from an HTTP reward server, OpenRLHF's protocol.
//!
//! Each request is `POST url` with the JSON body
//! `{"query": [prompt + response, …], "prompts": [prompt, …], "labels": [label, …]}`
//! (`labels` only when a label column is configured), and the answer is a
//! JSON object whose `score_key` (default `"rewards"`) holds one number per
//! query, in order — the body OpenRLHF's `remote_rm_fn` sends and its
//! `serve_rm` answers. Rows go out in chunks of `batch_size`, up to
//! `concurrency` requests at a time, on a tokio runtime owned by the stage.
//! A request that fails (connection refused, timeout, HTTP 5xx or 429) is
//! retried with exponential back-off; one that still fails, or a malformed
//! answer, fails the step with an error naming the server and the cause.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::RecordBatch;
use serde_json::{json, Value};
use weir_graph::{Stage, StageError, StepContext};

use crate::rollout::col;
use crate::stages::columns::{strings, with_rewards};

/// Where and how to ask a reward server.
#[derive(Clone, Debug, PartialEq)]
pub struct RemoteRewardConfig {
    /// The endpoint, e.g. `http://10.0.0.7:5000/get_reward`.
    pub url: String,
    /// The answer's key holding the rewards.
    pub score_key: String,
    /// A dataset column sent as `labels` (a reference answer), if any.
    pub label_column: Option<String>,
    /// Whether the prompt file holds the labels as JSON numbers, lists or
    /// objects: they are sent as those values, not as their text.
    pub label_typed: bool,
    /// Rows per request.
    pub batch_size: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Attempts per request (1 = no retry).
    pub attempts: u32,
    /// Wait before the first retry; doubled before each further one.
    pub backoff: Duration,
}

impl Default for RemoteRewardConfig {
    fn default() -> Self {
        RemoteRewardConfig {
            url: "http://127.0.0.1:5000/get_reward".to_string(),
            score_key: "rewards".to_string(),
            label_column: None,
            label_typed: false,
            batch_size: 64,
            concurrency: 4,
            timeout: Duration::from_secs(120),
            attempts: 3,
            backoff: Duration::from_millis(500),
        }
    }
}

/// The remote reward stage.
pub struct RemoteReward {
    cfg: Arc<RemoteRewardConfig>,
    client: reqwest::Client,
    runtime: tokio::runtime::Runtime,
}

impl RemoteReward {
    /// A client for `cfg.url`; fails on a URL that is not `http://`.
    pub fn new(cfg: RemoteRewardConfig) -> Result<Self, StageError> {
        let url = reqwest::Url::parse(&cfg.url)
            .map_err(|e| format!("reward server url `{}`: {e}", cfg.url))?;
        if url.scheme() != "http" {
            return Err(format!(
                "reward server url `{}`: only http:// is supported (put a TLS proxy in front for https)",
                cfg.url
            )
            .into());
        }
        let client = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .build()
            .map_err(|e| format!("reward server client: {e}"))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("reward server client runtime: {e}"))?;
        Ok(RemoteReward {
            cfg: Arc::new(RemoteRewardConfig {
                batch_size: cfg.batch_size.max(1),
                concurrency: cfg.concurrency.max(1),
                attempts: cfg.attempts.max(1),
                ..cfg
            }),
            client,
            runtime,
        })
    }

    /// Rewards for `(prompt, response, label)` rows, in order.
    pub fn score(
        &self,
        prompts: &[String],
        responses: &[String],
        labels: Option<&[String]>,
    ) -> Result<Vec<f64>, StageError> {
        let cfg = &self.cfg;
        let bodies: Vec<Value> = (0..prompts.len())
            .step_by(cfg.batch_size)
            .map(|start| {
                let end = (start + cfg.batch_size).min(prompts.len());
                let query: Vec<String> = (start..end)
                    .map(|i| format!("{}{}", prompts[i], responses[i]))
                    .collect();
                let mut body = json!({ "query": query, "prompts": &prompts[start..end] });
                if let Some(labels) = labels {
                    body["labels"] = super::column_values(&labels[start..end], cfg.label_typed);
                }
                body
            })
            .collect();
        let answers = self.runtime.block_on(async {
            let mut answers = Vec::with_capacity(bodies.len());
            for wave in bodies.chunks(cfg.concurrency) {
                let mut tasks = tokio::task::JoinSet::new();
                for (i, body) in wave.iter().enumerate() {
                    let (client, cfg, body) = (self.client.clone(), cfg.clone(), body.clone());
                    tasks.spawn(async move { (i, request(&client, &cfg, &body).await) });
                }
                let mut got: Vec<Option<Result<Vec<f64>, String>>> = vec![None; wave.len()];
                while let Some(done) = tasks.join_next().await {
                    let (i, result) = done.map_err(|e| e.to_string())?;
                    got[i] = Some(result);
                }
                answers.extend(got.into_iter().flatten());
            }
            Ok::<_, String>(answers)
        })?;
        let mut rewards = Vec::with_capacity(prompts.len());
        for answer in answers {
            rewards.extend(answer?);
        }
        Ok(rewards)
    }
}

/// One request with its retries; the rewards or the last error.
async fn request(
    client: &reqwest::Client,
    cfg: &RemoteRewardConfig,
    body: &Value,
) -> Result<Vec<f64>, String> {
    let expected = body["query"].as_array().map_or(0, Vec::len);
    let mut wait = cfg.backoff;
    let mut last = String::new();
    for attempt in 1..=cfg.attempts {
        if attempt > 1 {
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
        let sent = client.post(&cfg.url).json(body).send().await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                last = describe(&e, cfg);
                tracing::warn!(url = %cfg.url, attempt, error = %last, "reward server request failed");
                continue;
            }
        };
        let status = response.status();
        if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            last = format!("answered HTTP {status}");
            tracing::warn!(url = %cfg.url, attempt, %status, "reward server busy or failing");
            continue;
        }
        if !status.is_success() {
            // A client error will not go away on retry.
            let text = response.text().await.unwrap_or_default();
            return Err(format!(
                "reward server {} answered HTTP {status}: {}",
                cfg.url,
                text.chars().take(200).collect::<String>()
            ));
        }
        let text = match response.text().await {
            Ok(text) => text,
            Err(e) => {
                last = describe(&e, cfg);
                tracing::warn!(url = %cfg.url, attempt, error = %last, "reward server answer lost");
                continue;
            }
        };
        let answer: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                // A server that sends bad JSON will send it again: no retry.
                let nan = ["NaN", "Infinity"].iter().any(|w| text.contains(w));
                return Err(format!(
                    "reward server {} sent a body that is not JSON ({e}{}): {}",
                    cfg.url,
                    if nan {
                        "; NaN and Infinity are not JSON numbers, and a reward must be finite"
                    } else {
                        ""
                    },
                    text.chars().take(200).collect::<String>()
                ));
            }
        };
        return parse_rewards(&answer, &cfg.score_key, expected)
            .map_err(|e| format!("reward server {}: {e}", cfg.url));
    }
    // The run's keys that govern this, so that a user knows what to raise.
    Err(format!(
        "reward server {} failed after {} attempt(s) (reward.attempts; each may take {:?}, \
         reward.timeout_s): {last}",
        cfg.url, cfg.attempts, cfg.timeout
    ))
}

fn describe(e: &reqwest::Error, cfg: &RemoteRewardConfig) -> String {
    if e.is_timeout() {
        format!("timed out after {:?}", cfg.timeout)
    } else if e.is_connect() {
        "cannot connect (is the server up?)".to_string()
    } else {
        e.to_string()
    }
}

/// `answer[score_key]` as `expected` numbers.
fn parse_rewards(answer: &Value, score_key: &str, expected: usize) -> Result<Vec<f64>, String> {
    let list = answer
        .get(score_key)
        .and_then(Value::as_array)
        .ok_or_else(|| {
            let shown: String = answer.to_string().chars().take(200).collect();
            format!("the answer has no list `{score_key}`: {shown}")
        })?;
    if list.len() != expected {
        return Err(format!(
            "`{score_key}` has {} values for {expected} queries",
            list.len()
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_f64()
                .ok_or_else(|| format!("`{score_key}[{i}]` is not a number: {v}"))
        })
        .collect()
}

impl Stage for RemoteReward {
    fn process(
        &mut self,
        _ctx: &mut StepContext,
        batch: RecordBatch,
    ) -> Result<Vec<RecordBatch>, StageError> {
        let prompts = strings(&batch, col::PROMPT, "remote reward")?;
        let responses = strings(&batch, col::RESPONSE, "remote reward")?;
        let labels = match &self.cfg.label_column {
            Some(name) => Some(strings(&batch, name, "remote reward")?),
            None => None,
        };
        let rewards = self.score(&prompts, &responses, labels.as_deref())?;
        Ok(vec![with_rewards(&batch, &rewards)?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::sync::Mutex;

    /// What the test server does with the request it receives.
    #[derive(Clone, Copy)]
    enum Reply {
        /// Answers `{"rewards": [len(query_i) …]}`.
        Lengths,
        Status(u16),
        /// Sleeps before answering like `Lengths`.
        Slow(u64),
    }

    /// A one-request-per-connection HTTP server following `script` (the
    /// last entry repeats); returns its URL and the bodies it received.
    fn serve(script: Vec<Reply>) -> (String, Arc<Mutex<Vec<Value>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/get_reward", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for (n, stream) in listener.incoming().enumerate() {
                let Ok(mut stream) = stream else { return };
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    if line.trim().is_empty() {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let body: Value = serde_json::from_slice(&body).unwrap();
                log.lock().unwrap().push(body.clone());
                let reply = script[n.min(script.len() - 1)];
                let (status, text) = match reply {
                    Reply::Status(code) => (code, String::from("{}")),
                    Reply::Lengths | Reply::Slow(_) => {
                        if let Reply::Slow(ms) = reply {
                            std::thread::sleep(Duration::from_millis(ms));
                        }
                        let lengths: Vec<usize> = body["query"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|q| q.as_str().unwrap().len())
                            .collect();
                        (200, json!({ "rewards": lengths }).to_string())
                    }
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
            }
        });
        (url, seen)
    }

    fn client(url: &str, attempts: u32, timeout_ms: u64) -> RemoteReward {
        RemoteReward::new(RemoteRewardConfig {
            url: url.to_string(),
            label_column: Some("answer".into()),
            batch_size: 2,
            concurrency: 2,
            timeout: Duration::from_millis(timeout_ms),
            attempts,
            backoff: Duration::from_millis(10),
            ..Default::default()
        })
        .unwrap()
    }

    fn texts(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn rewards_come_back_in_row_order_across_chunks() {
        let (url, seen) = serve(vec![Reply::Lengths]);
        let prompts = texts(&["a", "bb", "ccc", "d", "e"]);
        let responses = texts(&["1", "22", "333", "4444", "55555"]);
        let labels = texts(&["x", "y", "z", "u", "v"]);
        let got = client(&url, 1, 5_000)
            .score(&prompts, &responses, Some(&labels))
            .unwrap();
        assert_eq!(got, vec![2.0, 4.0, 6.0, 5.0, 6.0]);
        let mut bodies = seen.lock().unwrap().clone();
        assert_eq!(bodies.len(), 3, "5 rows in chunks of 2");
        bodies.sort_by_key(|b| b["prompts"][0].as_str().unwrap().to_string());
        assert_eq!(bodies[0]["query"], json!(["a1", "bb22"]));
        assert_eq!(bodies[0]["labels"], json!(["x", "y"]));
        assert_eq!(bodies[2]["prompts"], json!(["e"]));
    }

    #[test]
    fn busy_servers_are_retried_and_down_servers_named() {
        let (url, seen) = serve(vec![Reply::Status(503), Reply::Status(429), Reply::Lengths]);
        let got = client(&url, 3, 5_000)
            .score(&texts(&["p"]), &texts(&["r"]), Some(&texts(&["l"])))
            .unwrap();
        assert_eq!(got, vec![2.0]);
        assert_eq!(seen.lock().unwrap().len(), 3);

        let (url, _) = serve(vec![Reply::Status(500)]);
        let err = client(&url, 2, 5_000)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&url) && err.contains("after 2 attempt(s)") && err.contains("500"),
            "{err}"
        );

        let (url, _) = serve(vec![Reply::Status(400)]);
        let err = client(&url, 3, 5_000)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("HTTP 400"),
            "client errors are not retried: {err}"
        );

        // Nothing listens on a port that was just released.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}/get_reward");
        let err = client(&url, 2, 5_000)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&url) && err.contains("cannot connect"),
            "{err}"
        );
    }

    #[test]
    fn slow_servers_time_out() {
        let (url, _) = serve(vec![Reply::Slow(2_000)]);
        let err = client(&url, 1, 200)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("timed out after 200ms"), "{err}");
    }

    #[test]
    fn answers_are_checked_for_key_length_and_type() {
        let ok = json!({"rewards": [1.0, -0.5]});
        assert_eq!(parse_rewards(&ok, "rewards", 2).unwrap(), vec![1.0, -0.5]);
        assert!(parse_rewards(&ok, "scores", 2)
            .unwrap_err()
            .contains("no list `scores`"));
        assert!(parse_rewards(&ok, "rewards", 3)
            .unwrap_err()
            .contains("2 values for 3 queries"));
        let bad = json!({"rewards": [1.0, "x"]});
        assert!(parse_rewards(&bad, "rewards", 2)
            .unwrap_err()
            .contains("`rewards[1]` is not a number"));
    }

    #[test]
    fn only_http_urls_are_accepted() {
        for (url, msg) in [
            ("https://rm:5000/x", "only http://"),
            ("not a url", "reward server url `not a url`"),
        ] {
            let err = RemoteReward::new(RemoteRewardConfig {
                url: url.into(),
                ..Default::default()
            })
            .err()
            .unwrap()
            .to_string();
            assert!(err.contains(msg), "{err}");
        }
    }
}
