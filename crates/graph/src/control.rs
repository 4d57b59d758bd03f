//! The control side-dataflow's state: failures and heartbeats shared by the
//! workers of a process, what an operator needs to fail the run, and how
//! timely's network panics become [`GraphError::PeerLost`].

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cluster_secret::ClusterSecret;
use crate::error::panic_message;
use crate::GraphError;

/// Messages of the control side-dataflow.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum Control {
    /// A process is alive; `fingerprint` is its [`crate::RunSettings::fingerprint`],
    /// `proof` its proof of the cluster secret over `nonce` (none without a secret).
    Heartbeat {
        process: usize,
        fingerprint: u64,
        nonce: u64,
        proof: Option<crate::cluster_secret::Proof>,
    },
    Failed {
        process: usize,
        error: GraphError,
    },
}

/// State shared by the workers of one process.
pub(crate) struct RunShared {
    pub(crate) aborted: AtomicBool,
    error: Mutex<Option<GraphError>>,
    last_heard: Mutex<Vec<Instant>>,
    /// Processes whose heartbeat has verified (settings and secret).
    admitted: Mutex<Vec<bool>>,
    /// Weights this process's receiving generator keeps for the others.
    pub(crate) weights: crate::weights_edge::WeightsShelf,
    /// This process's end of the direct weights channel.
    pub(crate) wire: crate::weights_edge::Wire,
}

impl RunShared {
    /// Takes one control message on process `process`, whose settings have
    /// `fingerprint` and whose cluster secret is `secret`: a heartbeat
    /// admits its peer once the peer's fingerprint and proof of the secret
    /// match this process's, else ends the run saying which differs; a
    /// failure ends the run with it.
    pub(crate) fn receive(
        &self,
        message: Control,
        process: usize,
        fingerprint: u64,
        secret: Option<&ClusterSecret>,
    ) {
        match message {
            Control::Heartbeat {
                process: peer,
                fingerprint: theirs,
                nonce,
                proof,
            } => {
                self.heard_from(peer);
                let proven = match (secret, &proof) {
                    (Some(s), Some(p)) => s.verifies(peer, theirs, nonce, p),
                    (None, None) => true,
                    _ => false,
                };
                if !proven {
                    let what = match (secret, &proof) {
                        (Some(_), None) => format!(
                            "process {peer} has no cluster secret, this process ({process}) has one"
                        ),
                        (None, Some(_)) => format!(
                            "process {peer} has a cluster secret, this process ({process}) has none"
                        ),
                        _ => format!(
                            "process {peer} has another cluster secret than this process ({process})"
                        ),
                    };
                    self.record(GraphError::Execution(format!(
                        "{what}: start every process with the same \
                         WEIR_CLUSTER_SECRET or --cluster-secret-file"
                    )));
                } else if theirs != fingerprint {
                    self.record(GraphError::Execution(format!(
                        "process {peer} runs different settings than process {process} \
                         (fingerprint {theirs:016x}, here {fingerprint:016x}): \
                         start every process with the same config, flags and weir build"
                    )));
                } else {
                    self.admit(peer);
                }
            }
            Control::Failed { process, error } => {
                self.heard_from(process);
                self.record(error);
            }
        }
    }

    pub(crate) fn new(processes: usize) -> Self {
        RunShared {
            aborted: AtomicBool::new(false),
            error: Mutex::new(None),
            last_heard: Mutex::new(vec![Instant::now(); processes]),
            admitted: Mutex::new(vec![false; processes]),
            weights: Default::default(),
            wire: Default::default(),
        }
    }

    /// `process`'s heartbeat verified.
    pub(crate) fn admit(&self, process: usize) {
        let mut admitted = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = admitted.get_mut(process) {
            *a = true;
        }
    }

    /// Whether every process but `me` has sent a heartbeat that verified.
    pub(crate) fn all_admitted(&self, me: usize) -> bool {
        let admitted = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
        admitted.iter().enumerate().all(|(p, &a)| a || p == me)
    }

    /// Records `err` as the run's error if it is the first; aborts the run.
    pub(crate) fn record(&self, err: GraphError) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(err);
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    pub(crate) fn error(&self) -> Option<GraphError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn heard_from(&self, process: usize) {
        let mut heard = self.last_heard.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = heard.get_mut(process) {
            *t = Instant::now();
        }
    }

    /// The first peer silent for longer than `timeout`, if any.
    pub(crate) fn silent_peer(&self, me: usize, timeout: Duration) -> Option<(usize, Duration)> {
        let heard = self.last_heard.lock().unwrap_or_else(|p| p.into_inner());
        heard
            .iter()
            .enumerate()
            .filter(|(p, _)| *p != me)
            .map(|(p, t)| (p, t.elapsed()))
            .find(|(_, e)| *e > timeout)
    }
}

/// What an operator needs from its surroundings: where it runs and how to fail.
#[derive(Clone)]
pub(crate) struct OperatorEnv {
    pub(crate) shared: Arc<RunShared>,
    pub(crate) outbox: Rc<RefCell<Vec<GraphError>>>,
    pub index: usize,
    pub peers: usize,
    pub process: usize,
    /// The run's id ([`crate::stage::WorkerInfo::run`]).
    pub run: u64,
    /// The run's steps ([`crate::stage::WorkerInfo::steps`]).
    pub steps: crate::RunSteps,
    /// Workers per process.
    pub threads: usize,
}

impl OperatorEnv {
    /// Fails the run: this process stops at once, the driver tells the others.
    pub(crate) fn fail(&self, err: GraphError) {
        tracing::debug!(%err, "run failed");
        self.shared.record(err.clone());
        self.outbox.borrow_mut().push(err);
    }

    /// This worker's place in a role of `workers`, if the role holds it.
    pub(crate) fn worker_info(&self, workers: &[usize]) -> Option<crate::WorkerInfo> {
        Some(crate::WorkerInfo {
            index: self.index,
            peers: self.peers,
            process: self.process,
            rank: workers.iter().position(|&w| w == self.index)?,
            role_size: workers.len(),
            run: self.run,
            steps: self.steps,
        })
    }

    pub(crate) fn aborted(&self) -> bool {
        self.shared.aborted.load(Ordering::Relaxed)
    }
}

/// A panic that reached the driver: a broken connection to a peer, or a bug.
/// A worker learns of a broken connection second-hand ("MergeQueue
/// poisoned"); the network thread's own panic, which says what broke (the
/// socket closed, a sealed frame that failed authentication), is named
/// instead when one was seen.
pub(crate) fn runtime_panic(message: &str) -> GraphError {
    let cause = NETWORK_CAUSE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    panic_error(message, cause.as_deref())
}

/// [`runtime_panic`]'s error for `message`, given the network thread's
/// panic `network_cause` if one was seen.
fn panic_error(message: &str, network_cause: Option<&str>) -> GraphError {
    if is_network_panic(message) {
        let cause = network_cause.unwrap_or(message);
        GraphError::PeerLost {
            peer: "a peer process".into(),
            reason: format!("connection broken ({cause})"),
        }
    } else {
        GraphError::Runtime(format!("worker panicked: {message}"))
    }
}

/// True for the panics timely raises when a connection to a peer breaks.
pub(crate) fn is_network_panic(message: &str) -> bool {
    [
        TIMELY_NETWORK,
        "MergeQueue poisoned",
        "Send thread panic",
        "Recv thread panic",
    ]
    .iter()
    .any(|m| message.contains(m))
}

/// How timely's network threads begin their panic messages.
const TIMELY_NETWORK: &str = "timely communication error";

/// The first network thread's panic of this process's run (see [`runtime_panic`]).
static NETWORK_CAUSE: Mutex<Option<String>> = Mutex::new(None);

/// Keeps `message` as the run's network cause if it is a network thread's
/// panic and none was kept yet.
fn remember_network_cause(message: &str) {
    if message.contains(TIMELY_NETWORK) {
        let mut cause = NETWORK_CAUSE.lock().unwrap_or_else(|p| p.into_inner());
        cause.get_or_insert_with(|| message.to_string());
    }
}

/// Filters timely's network-thread panic messages from stderr: the run turns
/// them into a [`GraphError::PeerLost`] and reports that instead. Forgets
/// the network cause of an earlier run in this process.
pub(crate) fn quiet_network_panics() {
    *NETWORK_CAUSE.lock().unwrap_or_else(|p| p.into_inner()) = None;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let message = panic_message(info.payload());
            if is_network_panic(&message) {
                remember_network_cause(&message);
                return;
            }
            previous(info);
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_is_named_by_what_broke_it() {
        let plain = panic_error("MergeQueue poisoned.", None).to_string();
        assert!(
            plain.contains("connection broken (MergeQueue poisoned.)"),
            "{plain}"
        );
        let cause = "timely communication error: reading data: a frame from the peer failed \
                     authentication";
        let named = panic_error("MergeQueue poisoned.", Some(cause)).to_string();
        assert!(
            named.contains(&format!("connection broken ({cause})")),
            "{named}"
        );
        let bug = panic_error("index out of bounds", Some(cause)).to_string();
        assert!(
            bug.contains("worker panicked: index out of bounds"),
            "{bug}"
        );
    }
    use crate::mesh::session_fingerprint;

    #[test]
    fn a_heartbeat_recorded_in_an_earlier_run_is_refused() {
        let secret = ClusterSecret::new("s3cret").unwrap();
        let heartbeat = |run: u64| {
            let fingerprint = session_fingerprint(42, run);
            Control::Heartbeat {
                process: 1,
                fingerprint,
                nonce: 9,
                proof: Some(secret.proof(1, fingerprint, 9)),
            }
        };
        let this_run = session_fingerprint(42, 2);
        let fresh = RunShared::new(2);
        fresh.receive(heartbeat(2), 0, this_run, Some(&secret));
        assert!(fresh.all_admitted(0) && fresh.error().is_none());
        // The same config and secret, recorded in run 1.
        let replayed = RunShared::new(2);
        replayed.receive(heartbeat(1), 0, this_run, Some(&secret));
        assert!(!replayed.all_admitted(0));
        assert!(replayed.error().is_some());
    }
}
