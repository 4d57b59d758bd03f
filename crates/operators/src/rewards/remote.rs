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
//!
//! `https://` servers are verified against the system's certificate
//! authorities (`SSL_CERT_FILE` replaces them) and any in `ca_file`.
//! Redirects are not followed (a 3xx is an error naming where it points),
//! an answer over [`MAX_ANSWER_BYTES`] is refused, and the proxy variables
//! (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`) apply as in curl;
//! the stage logs the proxy a request goes through.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::RecordBatch;
use serde_json::{json, Value};
use weir_graph::{Stage, StageError, StepContext};

use crate::data::columns::{strings, with_rewards};
use crate::rollout::col;

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
    /// PEM certificates of authorities trusted beside the system's
    /// (`https://` only).
    pub ca_file: Option<PathBuf>,
}

/// The largest answer read from a reward server (a few bytes per row are
/// expected; a server that sends more is refused, not buffered).
pub const MAX_ANSWER_BYTES: usize = 16 << 20;

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
            ca_file: None,
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
    /// A client for `cfg.url`; fails on a URL that is not `http://` or
    /// `https://`, and on a `ca_file` that holds no certificate.
    pub fn new(cfg: RemoteRewardConfig) -> Result<Self, StageError> {
        let url = reqwest::Url::parse(&cfg.url)
            .map_err(|e| format!("reward server url `{}`: {e}", cfg.url))?;
        let tls = match url.scheme() {
            "https" => true,
            "http" => false,
            other => {
                return Err(format!(
                    "reward server url `{}`: `{other}://` is not http:// or https://",
                    cfg.url
                )
                .into())
            }
        };
        let mut builder = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .use_rustls_tls()
            .redirect(reqwest::redirect::Policy::none());
        if let Some(file) = &cfg.ca_file {
            if !tls {
                return Err(format!(
                    "reward.ca_file {}: the reward server `{}` is not https://",
                    file.display(),
                    cfg.url
                )
                .into());
            }
            let pem = std::fs::read(file)
                .map_err(|e| format!("reward.ca_file {}: {e}", file.display()))?;
            let certificates = reqwest::Certificate::from_pem_bundle(&pem)
                .ok()
                .filter(|c| !c.is_empty())
                .ok_or_else(|| {
                    format!(
                        "reward.ca_file {}: no PEM certificate in it",
                        file.display()
                    )
                })?;
            for certificate in certificates {
                builder = builder.add_root_certificate(certificate);
            }
        }
        if let Some((var, proxy)) = proxy_for(&url, |name| std::env::var(name).ok()) {
            tracing::info!(url = %cfg.url, %proxy, "reward requests go through the proxy in {var} (NO_PROXY bypasses it)");
        }
        let client = builder
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
        if status.is_redirection() {
            let to = response
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .unwrap_or("nowhere")
                .to_string();
            return Err(format!(
                "reward server {} answered HTTP {status} to {to}: weir follows no redirect \
                 (set reward.url to where the server is)",
                cfg.url
            ));
        }
        if !status.is_success() {
            // A client error will not go away on retry.
            let text = read_capped(response, 4096).await.unwrap_or_default();
            return Err(format!(
                "reward server {} answered HTTP {status}: {}",
                cfg.url,
                String::from_utf8_lossy(&text)
                    .chars()
                    .take(200)
                    .collect::<String>()
            ));
        }
        let text = match read_capped(response, MAX_ANSWER_BYTES).await {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(BodyError::TooLong) => {
                return Err(format!(
                    "reward server {} sent an answer over {} MiB for {expected} queries",
                    cfg.url,
                    MAX_ANSWER_BYTES >> 20
                ))
            }
            Err(BodyError::Lost(e)) => {
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

/// Why an answer's body was not read.
enum BodyError {
    /// It is longer than the limit.
    TooLong,
    /// The connection failed.
    Lost(reqwest::Error),
}

/// The body of `response`, refused past `limit` bytes (announced or sent).
async fn read_capped(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, BodyError> {
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLong);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(BodyError::Lost)? {
        if body.len() + chunk.len() > limit {
            return Err(BodyError::TooLong);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The proxy variable and proxy a request to `url` goes through, as curl
/// and reqwest read them (`NO_PROXY` = `*` or a list of hosts and domains).
fn proxy_for(
    url: &reqwest::Url,
    var: impl Fn(&str) -> Option<String>,
) -> Option<(&'static str, String)> {
    let host = url.host_str().unwrap_or_default();
    let no_proxy = var("NO_PROXY")
        .or_else(|| var("no_proxy"))
        .unwrap_or_default();
    let bypassed = no_proxy.split(',').map(str::trim).any(|entry| {
        let entry = entry.trim_start_matches('.');
        entry == "*"
            || (!entry.is_empty() && (host == entry || host.ends_with(&format!(".{entry}"))))
    });
    if bypassed {
        return None;
    }
    let names: &[&'static str] = if url.scheme() == "https" {
        &["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]
    } else {
        &["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
    };
    names
        .iter()
        .find_map(|&name| var(name).filter(|v| !v.is_empty()).map(|v| (name, v)))
}

fn describe(e: &reqwest::Error, cfg: &RemoteRewardConfig) -> String {
    if e.is_timeout() {
        format!("timed out after {:?}", cfg.timeout)
    } else if e.is_connect() {
        // The innermost cause: a refused connection, or the certificate
        // that did not verify.
        let mut cause: &dyn std::error::Error = e;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        format!("cannot connect (is the server up?): {cause}")
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
        /// Announces a body over the limit.
        Announced,
        /// Sends a body over the limit without announcing its length.
        Endless,
        /// Points elsewhere with a 307.
        Redirect,
    }

    /// A one-request-per-connection HTTP server following `script` (the
    /// last entry repeats), over TLS with `tls`; returns its URL and the
    /// bodies it received.
    fn serve_on(
        script: Vec<Reply>,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> (String, Arc<Mutex<Vec<Value>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let port = listener.local_addr().unwrap().port();
        let url = format!("{scheme}://127.0.0.1:{port}/get_reward");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for (n, stream) in listener.incoming().enumerate() {
                let Ok(stream) = stream else { return };
                let reply = script[n.min(script.len() - 1)];
                let log = log.clone();
                match &tls {
                    Some(config) => {
                        let connection = rustls::ServerConnection::new(config.clone()).unwrap();
                        answer(rustls::StreamOwned::new(connection, stream), reply, &log);
                    }
                    None => answer(stream, reply, &log),
                }
            }
        });
        (url, seen)
    }

    fn serve(script: Vec<Reply>) -> (String, Arc<Mutex<Vec<Value>>>) {
        serve_on(script, None)
    }

    /// Reads one request from `stream` and answers it as `reply` says.
    fn answer(stream: impl Read + Write, reply: Reply, log: &Mutex<Vec<Value>>) {
        let mut reader = BufReader::new(stream);
        let mut length = 0;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                return; // A client that gave up (on the certificate, say).
            }
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
        let stream = reader.get_mut();
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
            Reply::Announced => {
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    MAX_ANSWER_BYTES + 1
                );
                return;
            }
            Reply::Endless => {
                let _ = write!(stream, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
                let chunk = vec![b' '; 1 << 20];
                for _ in 0..=(MAX_ANSWER_BYTES >> 20) + 1 {
                    if stream.write_all(&chunk).is_err() {
                        return;
                    }
                }
                let _ = stream.flush();
                return;
            }
            Reply::Redirect => {
                let _ = write!(
                    stream,
                    "HTTP/1.1 307 X\r\nLocation: http://10.9.9.9/steal\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = stream.flush();
                return;
            }
        };
        let _ = write!(
            stream,
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
            text.len()
        );
        let _ = stream.flush();
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
    fn only_http_and_https_urls_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let not_pem = dir.path().join("not.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        for (url, ca_file, msg) in [
            (
                "ftp://rm:5000/x",
                None,
                "`ftp://` is not http:// or https://",
            ),
            ("not a url", None, "reward server url `not a url`"),
            ("http://rm:5000/x", Some(not_pem.clone()), "is not https://"),
            (
                "https://rm:5000/x",
                Some(not_pem.clone()),
                "no PEM certificate",
            ),
            (
                "https://rm:5000/x",
                Some(dir.path().join("absent.pem")),
                "absent.pem",
            ),
        ] {
            let err = RemoteReward::new(RemoteRewardConfig {
                url: url.into(),
                ca_file,
                ..Default::default()
            })
            .err()
            .unwrap()
            .to_string();
            assert!(err.contains(msg), "{err}");
        }
        assert!(RemoteReward::new(RemoteRewardConfig {
            url: "https://rm:5000/x".into(),
            ..Default::default()
        })
        .is_ok());
    }

    #[test]
    fn https_servers_are_verified_against_the_given_authority() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, cert.pem()).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        let (url, seen) = serve_on(vec![Reply::Lengths], Some(Arc::new(server)));
        let trusting = |ca_file: Option<PathBuf>| {
            RemoteReward::new(RemoteRewardConfig {
                url: url.clone(),
                ca_file,
                attempts: 1,
                timeout: Duration::from_secs(5),
                ..Default::default()
            })
            .unwrap()
        };
        let got = trusting(Some(ca_file))
            .score(&texts(&["p1", "p"]), &texts(&["r", "r22"]), None)
            .unwrap();
        assert_eq!(got, vec![3.0, 4.0]);
        assert_eq!(seen.lock().unwrap()[0]["query"], json!(["p1r", "pr22"]));
        // The same server is not trusted without its authority.
        let err = trusting(None)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("certificate"), "{err}");
        assert_eq!(seen.lock().unwrap().len(), 1, "no request without trust");
    }

    #[test]
    fn oversized_answers_and_redirects_are_refused() {
        for reply in [Reply::Announced, Reply::Endless] {
            let (url, _) = serve(vec![reply]);
            let err = client(&url, 3, 10_000)
                .score(&texts(&["p"]), &texts(&["r"]), None)
                .unwrap_err()
                .to_string();
            assert!(err.contains("an answer over 16 MiB"), "{err}");
        }
        let (url, seen) = serve(vec![Reply::Redirect]);
        let err = client(&url, 3, 5_000)
            .score(&texts(&["p"]), &texts(&["r"]), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("307") && err.contains("http://10.9.9.9/steal"),
            "{err}"
        );
        assert_eq!(
            seen.lock().unwrap().len(),
            1,
            "neither followed nor retried"
        );
    }

    #[test]
    fn the_proxy_a_request_takes_is_named() {
        let vars = |pairs: &'static [(&str, &str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        let rm = url("https://rm.lab.internal:5000/x");
        assert_eq!(proxy_for(&rm, vars(&[])), None);
        assert_eq!(
            proxy_for(&rm, vars(&[("https_proxy", "http://p:3128")])),
            Some(("https_proxy", "http://p:3128".to_string()))
        );
        assert_eq!(
            proxy_for(&url("http://rm:1/x"), vars(&[("HTTPS_PROXY", "http://p")])),
            None,
            "an https proxy is not an http one"
        );
        for no_proxy in ["lab.internal", ".lab.internal", "*", "x, rm.lab.internal"] {
            let pairs: &'static [(&str, &str)] = Box::leak(Box::new([
                ("ALL_PROXY", "socks5://p"),
                ("NO_PROXY", no_proxy),
            ]));
            assert_eq!(proxy_for(&rm, vars(pairs)), None, "{no_proxy}");
        }
        assert_eq!(
            proxy_for(
                &rm,
                vars(&[("ALL_PROXY", "socks5://p"), ("NO_PROXY", "internal.other")])
            ),
            Some(("ALL_PROXY", "socks5://p".to_string()))
        );
    }
}
