//! The direct weights channel: an inline payload crosses to another process
//! over a TCP connection of its own instead of timely's.
//!
//! Through timely's connections a payload is copied four times: into
//! timely's send buffer, into the kernel, out of it, and from timely's
//! receive buffer into the landing buffer. Here the learner's process offers
//! the payload ([`Wire::offer`]) and only a [`WireNote`] travels on the
//! weights edge (the payload's id and size, and where to fetch it); the
//! receiving process's first generator worker hands the note to a fetch
//! thread ([`Wire::fetch`]) that connects to the learner's process and reads
//! the bytes straight into the landing buffer while the generators go on
//! generating. The sender writes from the payload itself. What is left are
//! the kernel's two copies, the floor of a raw TCP copy.
//!
//! A fetch proves the cluster secret when the run has one: the server sends
//! a fresh nonce and the fetcher answers with an HMAC over its process id,
//! the run's fingerprint, the nonce and the payload id
//! (`ClusterSecret::wire_proof`). Without a secret, a fetch must know the
//! payload's id (64 random bits that travel only on the weights edge). Each
//! side also sends the public half of an X25519 key made for the fetch;
//! with `placement.encrypt` the size and the payload cross sealed under
//! keys derived from it and the secret (see [`crate::sealed`]), otherwise
//! in clear, as timely's bytes do. Every read and write
//! has the peer timeout, so a learner process that dies fails the fetch,
//! and the generator that needs that version fails the run with the error,
//! never hangs.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{landing, WeightsPayload};
use crate::sealed::{KeyShare, Sealed, SessionKeys};
use crate::unproven::{Ticket, Unproven, GREETING};
use crate::{ClusterSecret, GraphError};

/// Where to fetch a payload the learner's process offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireNote {
    /// The payload's id (random; what a fetch asks for).
    pub id: u64,
    /// Its size in bytes.
    pub total: u64,
    /// `host:port` of the offering process's weights server.
    pub from: String,
}

/// What a process's channel needs to know of the run.
#[derive(Clone, Debug)]
pub(crate) struct WireConfig {
    /// This process's host (as the hostfile names it): the server listens there.
    pub host: String,
    /// The port the server listens on (0: any free one).
    pub port: u16,
    /// This process's id.
    pub process: usize,
    /// The run's settings fingerprint (bound into the proofs).
    pub fingerprint: u64,
    /// The cluster secret, if the run has one.
    pub secret: Option<ClusterSecret>,
    /// Whether payloads cross sealed (which needs the secret).
    pub encrypt: bool,
    /// How long a connect, read or write may wait.
    pub timeout: Duration,
    /// Payloads a server keeps offered at once, older ones withdrawn (a
    /// guard: every receiver fetches a payload as soon as its note is in,
    /// which withdraws it).
    pub offered: usize,
    /// The most bytes a payload fetched from a peer may have.
    pub max_payload: u64,
}

/// A process's end of the direct channel: its server (started by the first
/// offer) and the configuration its fetches use.
#[derive(Default)]
pub(crate) struct Wire {
    config: OnceLock<WireConfig>,
    server: Mutex<Option<Server>>,
}

/// First bytes of a fetch: which protocol this is.
const MAGIC: &[u8; 8] = b"weirwt02";

/// The server's answer after the proof.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Answer {
    Sending = 0,
    NotOffered = 1,
    Refused = 2,
}

impl Wire {
    /// Sets what the channel needs (once, before the run's dataflow starts).
    pub(crate) fn configure(&self, config: WireConfig) {
        let _ = self.config.set(config);
    }

    /// Whether the run set the channel up (a cluster that did not choose timely's).
    pub(crate) fn enabled(&self) -> bool {
        self.config.get().is_some()
    }

    fn config(&self) -> Result<&WireConfig, GraphError> {
        self.config.get().ok_or_else(|| {
            GraphError::Execution(
                "the direct weights channel runs between processes of a cluster only".into(),
            )
        })
    }

    /// Starts the server now, if it is not yet running: a process that will
    /// offer weights listens before its first step, so a port it cannot
    /// have fails the run before any work, not at the first publish.
    pub(crate) fn listen(&self) -> Result<(), GraphError> {
        let config = self.config()?;
        let mut server = self.server.lock().unwrap_or_else(|p| p.into_inner());
        if server.is_none() {
            *server = Some(Server::start(config)?);
        }
        Ok(())
    }

    /// Offers `payload` to `fetches` processes; the note tells them where to fetch it.
    pub(crate) fn offer(
        &self,
        payload: &WeightsPayload,
        fetches: usize,
    ) -> Result<WireNote, GraphError> {
        let config = self.config()?;
        self.listen()?;
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner());
        let server = server.as_ref().expect("listening");
        let id = landing::fresh_id();
        let mut offers = server.offers.lock().unwrap_or_else(|p| p.into_inner());
        offers.push_back(Offer {
            id,
            payload: payload.clone(),
            fetches_left: fetches,
        });
        while offers.len() > config.offered.max(1) {
            offers.pop_front();
        }
        Ok(WireNote {
            id,
            total: payload.len() as u64,
            from: server.address.clone(),
        })
    }

    /// Fetches the payload `note` names on a thread of its own, then calls
    /// `done` with it (landed in this process's buffer for it) or with why not.
    pub(crate) fn fetch(
        &self,
        note: WireNote,
        done: impl FnOnce(Result<WeightsPayload, String>) + Send + 'static,
    ) {
        let config = match self.config() {
            Ok(config) => config.clone(),
            Err(err) => return done(Err(err.to_string())),
        };
        // `done` is called whatever happens, so a waiting generator never hangs.
        let done = Arc::new(Mutex::new(Some(done)));
        let call = {
            let done = done.clone();
            move |result: Result<WeightsPayload, String>| {
                let taken = done.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(done) = taken {
                    done(result);
                }
            }
        };
        let what = format!(
            "fetching weights payload {:016x} ({} bytes) from {}",
            note.id, note.total, note.from
        );
        let spawned = std::thread::Builder::new()
            .name("weir:weights-fetch".into())
            .spawn({
                let (what, call) = (what.clone(), call.clone());
                move || call(fetch(&config, &note).map_err(|e| format!("{what}: {e}")))
            });
        if let Err(e) = spawned {
            call(Err(format!("{what}: cannot start a thread: {e}")));
        }
    }
}

struct Offer {
    id: u64,
    payload: WeightsPayload,
    /// Processes yet to fetch it.
    fetches_left: usize,
}

type Offers = Arc<Mutex<VecDeque<Offer>>>;

/// A process's weights server: a listener and its accept thread.
struct Server {
    /// `host:port` fetchers connect to.
    address: String,
    local: SocketAddr,
    offers: Offers,
    stop: Arc<AtomicBool>,
}

impl Server {
    fn start(config: &WireConfig) -> Result<Server, GraphError> {
        let bind = |e: std::io::Error| {
            GraphError::Execution(format!(
                "the weights server cannot listen on {}:{}: {e} (placement.weights_port)",
                config.host, config.port
            ))
        };
        let listener = TcpListener::bind((unbracketed(&config.host), config.port)).map_err(bind)?;
        let local = listener.local_addr().map_err(bind)?;
        let server = Server {
            address: format!("{}:{}", config.host, local.port()),
            local,
            offers: Arc::default(),
            stop: Arc::default(),
        };
        let (offers, stop, config) = (server.offers.clone(), server.stop.clone(), config.clone());
        std::thread::Builder::new()
            .name("weir:weights-server".into())
            .spawn(move || accept(listener, offers, stop, config))
            .map_err(|e| GraphError::Runtime(format!("starting the weights server: {e}")))?;
        tracing::debug!(address = %server.address, "weights server listening");
        Ok(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept call, which then sees the flag.
        let _ = TcpStream::connect_timeout(&self.local, Duration::from_secs(1));
    }
}

/// `host` without the brackets of an IPv6 literal (as `bind` wants it).
fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Accepts every connection, holding those not yet proven in an
/// [`Unproven`] table (which closes the oldest to make room, so idle
/// sockets cannot lock a fetcher out), each answered on a thread of its own.
fn accept(listener: TcpListener, offers: Offers, stop: Arc<AtomicBool>, config: WireConfig) {
    let unproven = Unproven::default();
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, from) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: back off rather than spin.
                tracing::warn!(%e, "the weights server could not accept a connection");
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        let (ticket, closed) = unproven.admit(&stream, from);
        if let Some(old) = closed {
            tracing::debug!(%old, "the weights server closed an unproven connection to make room");
        }
        let (offers, config) = (offers.clone(), config.clone());
        let _ = std::thread::Builder::new()
            .name("weir:weights-send".into())
            .spawn(move || {
                if let Err(e) = serve(stream, &offers, &config, ticket) {
                    tracing::warn!(%e, "a weights fetch failed on the sending side");
                }
            });
    }
}

fn timeouts(stream: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

fn read_u64(stream: &mut impl Read) -> std::io::Result<u64> {
    let mut word = [0u8; 8];
    stream.read_exact(&mut word)?;
    Ok(u64::from_le_bytes(word))
}

/// The keys of a fetch when the run encrypts: from this side's key `share`
/// and the other side's public half `theirs`, bound to the fetch.
fn fetch_keys(
    config: &WireConfig,
    share: KeyShare,
    theirs: &[u8; 32],
    fetcher: u64,
    payload: u64,
    nonce: u64,
    fetching: bool,
) -> std::io::Result<Option<SessionKeys>> {
    if !config.encrypt {
        return Ok(None);
    }
    let secret = config.secret.as_ref().ok_or_else(|| {
        std::io::Error::other("encrypting the weights channel needs the cluster secret")
    })?;
    let mut context = b"weir weights fetch".to_vec();
    for word in [fetcher, payload, nonce, config.fingerprint] {
        context.extend_from_slice(&word.to_le_bytes());
    }
    share
        .keys(theirs, secret, &context, fetching)
        .map(Some)
        .map_err(std::io::Error::other)
}

/// `stream`, sealed under `keys` when there are any.
fn sealed_or_not(stream: TcpStream, keys: Option<SessionKeys>) -> Box<dyn ReadWrite> {
    match keys {
        Some(keys) => Box::new(Sealed::new(stream, keys)),
        None => Box::new(stream),
    }
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// One fetch, on the sending side: the handshake, then the payload.
fn serve(
    mut stream: TcpStream,
    offers: &Offers,
    config: &WireConfig,
    ticket: Ticket,
) -> std::io::Result<()> {
    // The request and proof come at once from a real fetcher.
    timeouts(&stream, GREETING.min(config.timeout))?;
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(std::io::Error::other(
            "a connection that is not a weights fetch",
        ));
    }
    let (process, id) = (read_u64(&mut stream)?, read_u64(&mut stream)?);
    let mut theirs = [0u8; 32];
    stream.read_exact(&mut theirs)?;
    let nonce = crate::cluster_secret::nonce(config.process);
    let share = KeyShare::new().map_err(std::io::Error::other)?;
    let mut greeting = nonce.to_le_bytes().to_vec();
    greeting.extend_from_slice(share.public());
    stream.write_all(&greeting)?;
    let mut proof = [0u8; 32];
    stream.read_exact(&mut proof)?;
    let admitted = config.secret.as_ref().is_none_or(|secret| {
        secret.verifies_wire(process as usize, config.fingerprint, nonce, id, &proof)
    });
    let payload = admitted
        .then(|| {
            let offers = offers.lock().unwrap_or_else(|p| p.into_inner());
            offers
                .iter()
                .find(|o| o.id == id)
                .map(|o| o.payload.clone())
        })
        .flatten();
    let answer = match (&payload, admitted) {
        (_, false) => Answer::Refused,
        (None, true) => Answer::NotOffered,
        (Some(_), true) => Answer::Sending,
    };
    stream.write_all(&[answer as u8])?;
    let Some(payload) = payload else {
        return Err(std::io::Error::other(format!(
            "process {process} asked for weights payload {id:016x}: {answer:?}"
        )));
    };
    ticket.proven();
    stream.set_write_timeout(Some(config.timeout))?;
    let keys = fetch_keys(config, share, &theirs, process, id, nonce, false)?;
    let mut stream = sealed_or_not(stream, keys);
    stream.write_all(&(payload.len() as u64).to_le_bytes())?;
    stream.write_all(payload.bytes())?;
    stream.flush()?;
    let mut offers = offers.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(at) = offers.iter().position(|o| o.id == id) {
        offers[at].fetches_left = offers[at].fetches_left.saturating_sub(1);
        if offers[at].fetches_left == 0 {
            offers.remove(at);
        }
    }
    Ok(())
}

/// One fetch, on the receiving side. A try that ends before the server has
/// answered (a connection it closed to make room among unproven ones, a
/// stall) is made again until the peer timeout has passed.
fn fetch(config: &WireConfig, note: &WireNote) -> Result<WeightsPayload, String> {
    if note.total > config.max_payload {
        return Err(format!(
            "the note announces {} bytes, more than the {} this run's weights can be",
            note.total, config.max_payload
        ));
    }
    let deadline = std::time::Instant::now() + config.timeout;
    loop {
        match try_fetch(config, note, deadline) {
            Ok(payload) => return Ok(payload),
            Err(Attempt::Fatal(why)) => return Err(why),
            Err(Attempt::Again(why)) if std::time::Instant::now() >= deadline => {
                return Err(format!(
                    "no try got an answer within {:.1} s; the last {why}",
                    config.timeout.as_secs_f64()
                ))
            }
            Err(Attempt::Again(why)) => {
                tracing::debug!(%why, "fetching weights again");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Why one try at a fetch failed.
enum Attempt {
    /// Before the server answered: try again.
    Again(String),
    /// The server answered, or the payload broke off: no retry changes it.
    Fatal(String),
}

/// What an I/O error means, in words.
fn in_words(what: &str, e: std::io::Error, waited: Duration) -> String {
    use std::io::ErrorKind::{
        BrokenPipe, ConnectionAborted, ConnectionReset, TimedOut, UnexpectedEof, WouldBlock,
    };
    match e.kind() {
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => format!(
            "{what}: the connection was lost ({e}): the sending process stopped or its network failed"
        ),
        WouldBlock | TimedOut => format!(
            "{what}: no answer within {:.1} s (the sending process is stalled or unreachable)",
            waited.as_secs_f64()
        ),
        _ => format!("{what}: {e}"),
    }
}

/// One try at [`fetch`].
fn try_fetch(
    config: &WireConfig,
    note: &WireNote,
    deadline: std::time::Instant,
) -> Result<WeightsPayload, Attempt> {
    let again = |what: &'static str, waited: Duration| {
        move |e: std::io::Error| Attempt::Again(in_words(what, e, waited))
    };
    let addresses: Vec<SocketAddr> = note
        .from
        .to_socket_addrs()
        .map_err(|e| Attempt::Fatal(format!("resolving the address: {e}")))?
        .collect();
    // A handshake waits no longer than a server gives an unproven connection.
    let left = deadline
        .saturating_duration_since(std::time::Instant::now())
        .clamp(Duration::from_millis(1), GREETING * 2);
    let mut last = String::from("the address resolves to nothing");
    let mut stream = None;
    for address in addresses {
        match TcpStream::connect_timeout(&address, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            // Nothing listens there: the sending process has ended.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(Attempt::Fatal(format!(
                    "connecting to {address}: {e}: the sending process has stopped"
                )))
            }
            Err(e) => last = in_words(&format!("connecting to {address}"), e, left),
        }
    }
    let mut stream = stream.ok_or(Attempt::Again(last))?;
    timeouts(&stream, left).map_err(again("setting up the connection", left))?;
    let share = KeyShare::new().map_err(|e| Attempt::Fatal(e.to_string()))?;
    let mut request = MAGIC.to_vec();
    request.extend_from_slice(&(config.process as u64).to_le_bytes());
    request.extend_from_slice(&note.id.to_le_bytes());
    request.extend_from_slice(share.public());
    stream
        .write_all(&request)
        .map_err(again("sending the request", left))?;
    let nonce = read_u64(&mut stream).map_err(again("reading the server's nonce", left))?;
    let mut theirs = [0u8; 32];
    stream
        .read_exact(&mut theirs)
        .map_err(again("reading the server's key share", left))?;
    let proof = config.secret.as_ref().map_or([0u8; 32], |secret| {
        secret.wire_proof(config.process, config.fingerprint, nonce, note.id)
    });
    stream
        .write_all(&proof)
        .map_err(again("sending the proof of the cluster secret", left))?;
    let mut answer = [0u8; 1];
    stream
        .read_exact(&mut answer)
        .map_err(again("reading the server's answer", left))?;
    let fatal = |why: &str| Attempt::Fatal(why.to_string());
    match answer[0] {
        a if a == Answer::Sending as u8 => {}
        a if a == Answer::NotOffered as u8 => {
            return Err(fatal("the sending process no longer offers it"))
        }
        a if a == Answer::Refused as u8 => {
            return Err(fatal("the sending process refused this process's proof of the cluster secret (do both have the same secret?)"))
        }
        a => return Err(Attempt::Fatal(format!("an unknown answer {a}"))),
    }
    // From here the server has proven itself: the payload's reads have the
    // whole peer timeout, and a break is the sending process's failure.
    let lost = |what: &'static str| {
        move |e: std::io::Error| Attempt::Fatal(in_words(what, e, config.timeout))
    };
    timeouts(&stream, config.timeout).map_err(lost("setting up the connection"))?;
    let keys = fetch_keys(
        config,
        share,
        &theirs,
        config.process as u64,
        note.id,
        nonce,
        true,
    )
    .map_err(lost("deriving the fetch's keys"))?;
    tracing::debug!(
        id = note.id,
        sealed = keys.is_some(),
        "receiving a weights payload"
    );
    let mut stream = sealed_or_not(stream, keys);
    let total = read_u64(&mut stream).map_err(lost("reading the payload's size"))?;
    if total != note.total {
        return Err(Attempt::Fatal(format!(
            "the server sends {total} bytes, the note said {}",
            note.total
        )));
    }
    landing::fill(total as usize, |buffer| stream.read_exact(buffer))
        .map_err(lost("receiving the payload"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unproven::MAX_UNPROVEN;

    fn config(process: usize, secret: Option<&str>) -> WireConfig {
        WireConfig {
            max_payload: 1 << 30,
            host: "127.0.0.1".into(),
            port: 0,
            process,
            fingerprint: 7,
            secret: secret.map(|s| ClusterSecret::new(s).unwrap()),
            encrypt: false,
            timeout: Duration::from_secs(5),
            offered: 4,
        }
    }

    #[test]
    fn an_encrypted_payload_lands_whole_and_a_fetcher_that_does_not_decrypt_gets_nothing() {
        let sealed = |process| WireConfig {
            encrypt: true,
            ..config(process, Some("s"))
        };
        let (sender, receiver) = (Wire::default(), Wire::default());
        sender.configure(sealed(1));
        receiver.configure(sealed(0));
        let payload = WeightsPayload::from(
            (0..1_000_003u32)
                .map(|i| (i % 253) as u8)
                .collect::<Vec<_>>(),
        );
        let note = sender.offer(&payload, 2).unwrap();
        assert_eq!(fetched(&receiver, note.clone()).unwrap(), payload);
        // A fetcher that proves the secret but reads in clear reads no size
        // or byte of the payload.
        let clear = Wire::default();
        clear.configure(config(0, Some("s")));
        let err = fetched(&clear, note).unwrap_err();
        assert!(err.contains("the server sends"), "{err}");
    }

    fn fetched(wire: &Wire, note: WireNote) -> Result<WeightsPayload, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        wire.fetch(note, move |r| tx.send(r).unwrap());
        rx.recv_timeout(Duration::from_secs(20)).unwrap()
    }

    #[test]
    fn a_payload_crosses_once_per_offer_and_lands_whole() {
        let (sender, receiver) = (Wire::default(), Wire::default());
        sender.configure(config(1, Some("s")));
        receiver.configure(config(0, Some("s")));
        let payload = WeightsPayload::from((0..300_000u32).map(|i| i as u8).collect::<Vec<_>>());
        let note = sender.offer(&payload, 2).unwrap();
        assert_eq!(note.total, 300_000);
        assert_eq!(fetched(&receiver, note.clone()).unwrap(), payload);
        // A second process fetches it too; then it is withdrawn.
        assert_eq!(fetched(&receiver, note.clone()).unwrap(), payload);
        let gone = fetched(&receiver, note.clone()).unwrap_err();
        assert!(gone.contains("no longer offers"), "{gone}");
        assert!(gone.contains(&format!("{:016x}", note.id)), "{gone}");
        // An empty payload crosses as well.
        let empty = WeightsPayload::from(Vec::new());
        let note = sender.offer(&empty, 1).unwrap();
        assert_eq!(fetched(&receiver, note).unwrap(), empty);
    }

    /// Threads of this process named `weir:weights-send` (as the kernel cuts it).
    fn sending_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.starts_with("weir:weights-se"))
            })
            .count()
    }

    #[test]
    fn a_note_announcing_more_than_the_run_expects_is_refused_before_fetching() {
        let sender = Wire::default();
        sender.configure(config(1, Some("s")));
        let note = sender
            .offer(&WeightsPayload::from(vec![1u8; 100]), 1)
            .unwrap();
        let receiver = Wire::default();
        receiver.configure(WireConfig {
            max_payload: 99,
            ..config(0, Some("s"))
        });
        let err = fetched(&receiver, note.clone()).unwrap_err();
        assert!(err.contains("more than the 99"), "{err}");
        let forged = WireNote {
            total: u64::MAX,
            ..note
        };
        let receiver = Wire::default();
        receiver.configure(config(0, Some("s")));
        let err = fetched(&receiver, forged).unwrap_err();
        assert!(err.contains("more than the"), "{err}");
    }

    /// 300 idle connections and 40 that stop halfway through a request,
    /// all held open: the server holds a bounded number of threads, and a
    /// fetch made meanwhile lands, without waiting for them to time out.
    #[test]
    fn idle_and_half_open_connections_neither_lock_out_a_fetch_nor_pile_up_threads() {
        let sender = Wire::default();
        sender.configure(config(1, Some("s")));
        let payload = WeightsPayload::from(vec![9u8; 5000]);
        let note = sender.offer(&payload, 1).unwrap();
        let address: SocketAddr = note.from.parse().unwrap();
        let mut held: Vec<TcpStream> = (0..300)
            .filter_map(|_| TcpStream::connect_timeout(&address, Duration::from_millis(50)).ok())
            .collect();
        for _ in 0..40 {
            if let Ok(mut half) = TcpStream::connect_timeout(&address, Duration::from_millis(50)) {
                let _ = half.write_all(&MAGIC[..]);
                let _ = half.write_all(&7u64.to_le_bytes()[..3]);
                held.push(half);
            }
        }
        assert!(held.len() > MAX_UNPROVEN, "{} connections", held.len());
        std::thread::sleep(Duration::from_millis(300));
        // Other tests of this binary may be fetching too: a little room.
        let threads = sending_threads();
        assert!(
            threads <= MAX_UNPROVEN + 4,
            "{threads} threads for {} idle connections",
            held.len()
        );
        let receiver = Wire::default();
        receiver.configure(config(0, Some("s")));
        let started = std::time::Instant::now();
        assert_eq!(fetched(&receiver, note).unwrap(), payload);
        // Before any idle connection's greeting time ran out.
        assert!(started.elapsed() < GREETING, "{:?}", started.elapsed());
        drop(held);
    }

    #[test]
    fn a_fetch_without_the_secret_is_refused_and_a_dead_server_is_an_error() {
        let sender = Wire::default();
        sender.configure(config(1, Some("right")));
        let payload = WeightsPayload::from(vec![5u8; 1000]);
        let note = sender.offer(&payload, 1).unwrap();
        for secret in [Some("wrong"), None] {
            let stranger = Wire::default();
            stranger.configure(config(0, secret));
            let refused = fetched(&stranger, note.clone()).unwrap_err();
            assert!(refused.contains("refused"), "{refused}");
        }
        // Still offered to the process that knows the secret.
        let member = Wire::default();
        member.configure(config(0, Some("right")));
        assert_eq!(fetched(&member, note.clone()).unwrap(), payload);
        // The server gone (its process ended): the fetch fails, it does not hang.
        let note = sender.offer(&payload, 1).unwrap();
        drop(sender);
        let lost = fetched(&member, note).unwrap_err();
        assert!(lost.contains("127.0.0.1"), "{lost}");
        // A process outside a cluster has no channel.
        let alone = Wire::default();
        assert!(alone.offer(&payload, 1).is_err());
    }
}
