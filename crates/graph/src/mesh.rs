//! Connecting the processes of a cluster: one TCP socket per pair of
//! processes, each authenticated before timely sends anything over it.
//!
//! Process `i` listens on its own address, connects to every process below
//! it (process 0 first) and then accepts every process above it, so no two
//! processes wait on each other. On each socket the two run a
//! challenge–response under the cluster secret:
//!
//! 1. the connecting process sends its id, the id it wants, its settings
//!    fingerprint and a fresh random nonce;
//! 2. the accepting process answers with its fingerprint, the run's random
//!    value, a fresh nonce of its own, and an HMAC over both ids, its
//!    fingerprint, the run value and both nonces;
//! 3. the connecting process answers with its own HMAC over the same (its
//!    fingerprint, another label);
//! 4. the accepting process says whether it admits the connection.
//!
//! Neither proof can be replayed: each covers the other side's fresh nonce.
//! The run's random value is drawn by process 0 and learned by every other
//! process on its first connection (to process 0); it is mixed into the
//! fingerprint the run's heartbeats and weight fetches prove
//! ([`session_fingerprint`]), so nothing recorded from an earlier run with the
//! same config verifies in this one.
//!
//! Each side's nonce is the public half of an X25519 key made for that
//! connection alone; with `placement.encrypt` both sides derive the
//! connection's keys from it and the secret once the handshake admits it,
//! and timely's traffic crosses sealed (see [`crate::sealed`]). Whether a
//! run encrypts is part of the fingerprint the handshake compares, so a
//! process that would encrypt never meets one that would not.
//!
//! A connection that does not speak this protocol (a port scan, a load
//! balancer's health check), asks for another process, claims an id that
//! does not connect here, or does not prove the secret is dropped and
//! logged, and start-up goes on; idle and half-open connections are held
//! in an `Unproven` table that closes the oldest to make room (see the
//! crate's `unproven` module), and a dial that such a listener closes is
//! made again until the deadline; only a process that proves the secret but
//! runs other settings stops the run at once. If a peer has not connected
//! when the start-up deadline passes, the error says so and names what was
//! refused in its place.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cluster_secret::{random, ClusterSecret, Proof, Side};
use crate::sealed::{KeyShare, SessionKeys};
use crate::unproven::{Ticket, Unproven, GREETING};
use crate::GraphError;

/// Every pair's socket (`None` at this process's own place), with its
/// keys when the run encrypts, and the run's random value.
pub(crate) struct Mesh {
    pub(crate) sockets: Vec<Option<(TcpStream, Option<SessionKeys>)>>,
    pub(crate) run: u64,
}

/// The first bytes of every greeting.
const MAGIC: &[u8; 16] = b"weir cluster v1\0";
type Nonce = [u8; 32];

const ADMITTED: u8 = 0;
const NO_SECRET: u8 = 1;
const OTHER_SETTINGS: u8 = 2;

/// Who this process is in the cluster.
#[derive(Clone)]
struct Party {
    me: usize,
    processes: usize,
    secret: ClusterSecret,
    /// The settings' fingerprint, with whether the run encrypts mixed in.
    fingerprint: u64,
    encrypt: bool,
}

impl Party {
    /// The keys of an admitted connection between `connecting` and
    /// `accepting` (when the run encrypts), from this side's key `share`
    /// and the other side's public half `theirs`.
    fn keys(
        &self,
        share: KeyShare,
        theirs: &Nonce,
        connecting: usize,
        accepting: usize,
        run: u64,
    ) -> Result<Option<SessionKeys>, GraphError> {
        if !self.encrypt {
            return Ok(None);
        }
        let mut context = b"weir cluster connection".to_vec();
        for word in [connecting as u64, accepting as u64, run, self.fingerprint] {
            context.extend_from_slice(&word.to_le_bytes());
        }
        share
            .keys(theirs, &self.secret, &context, connecting == self.me)
            .map(Some)
    }
}

/// `fingerprint` with the choice to encrypt mixed in.
fn with_encryption(fingerprint: u64, encrypt: bool) -> u64 {
    if !encrypt {
        return fingerprint;
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"weir sealed cluster v1")
        .chain_update(fingerprint.to_le_bytes())
        .finalize();
    u64::from_le_bytes(
        digest[..8]
            .try_into()
            .expect("a SHA-256 digest has 32 bytes"),
    )
}

/// Connects this process (`me`, listening on `hosts[me]`) to every other,
/// proving `secret` on each socket and checking `fingerprint` (see the
/// module's documentation), within `timeout`; with `encrypt`, each socket
/// comes with its keys.
pub(crate) fn connect(
    hosts: &[String],
    me: usize,
    secret: &ClusterSecret,
    fingerprint: u64,
    encrypt: bool,
    timeout: Duration,
) -> Result<Mesh, GraphError> {
    // A name that does not resolve yet (a pod's, before its service
    // publishes it) is waited for, as peers are.
    let started = Instant::now();
    let listener = loop {
        let resolves = std::net::ToSocketAddrs::to_socket_addrs(hosts[me].as_str()).is_ok();
        match TcpListener::bind(hosts[me].as_str()) {
            Ok(listener) => break listener,
            Err(_) if !resolves && started.elapsed() < timeout => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(GraphError::Execution(format!(
                    "process {me} cannot listen on {}: {e}",
                    hosts[me]
                )))
            }
        }
    };
    connect_on(listener, hosts, me, secret, fingerprint, encrypt, timeout)
}

/// [`connect`] with this process's listener already bound.
fn connect_on(
    listener: TcpListener,
    hosts: &[String],
    me: usize,
    secret: &ClusterSecret,
    fingerprint: u64,
    encrypt: bool,
    timeout: Duration,
) -> Result<Mesh, GraphError> {
    let deadline = Instant::now() + timeout;
    let party = Party {
        me,
        processes: hosts.len(),
        secret: secret.clone(),
        fingerprint: with_encryption(fingerprint, encrypt),
        encrypt,
    };
    let mut sockets: Vec<Option<(TcpStream, Option<SessionKeys>)>> =
        (0..hosts.len()).map(|_| None).collect();
    let mut run = if me == 0 {
        u64::from_le_bytes(random()?)
    } else {
        0
    };
    for (peer, address) in hosts.iter().enumerate().take(me) {
        let (stream, theirs, keys) = dial(&party, peer, address, deadline, timeout)?;
        if peer == 0 {
            run = theirs;
        } else if theirs != run {
            return Err(GraphError::Execution(format!(
                "process {peer} at {address} belongs to another run than process 0 \
                 (is every process started with the same hostfile?)"
            )));
        }
        sockets[peer] = Some((stream, keys));
    }
    accept_all(&listener, &party, run, &mut sockets, deadline, timeout)?;
    Ok(Mesh { sockets, run })
}

/// The fingerprint a run's heartbeats and weight fetches prove: the
/// settings' `fingerprint` and the run's random value, hashed.
pub(crate) fn session_fingerprint(fingerprint: u64, run: u64) -> u64 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(b"weir session v1")
        .chain_update(fingerprint.to_le_bytes())
        .chain_update(run.to_le_bytes())
        .finalize();
    u64::from_le_bytes(
        digest[..8]
            .try_into()
            .expect("a SHA-256 digest has 32 bytes"),
    )
}

fn another_secret(peer: usize, me: usize) -> GraphError {
    GraphError::Execution(format!(
        "process {peer} has another cluster secret than this process ({me}): start every \
         process with the same WEIR_CLUSTER_SECRET or --cluster-secret-file"
    ))
}

fn other_settings(peer: usize, me: usize, theirs: u64, ours: u64) -> GraphError {
    GraphError::Execution(format!(
        "process {peer} runs different settings than process {me} (fingerprint \
         {theirs:016x}, here {ours:016x}): start every process with the same config, flags \
         and weir build"
    ))
}

fn seconds(timeout: Duration) -> String {
    format!("{:.1} s", timeout.as_secs_f64())
}

/// Connects to process `peer` at `address` and runs the connecting side of
/// the handshake; returns the socket, the run value it was told, and the
/// socket's keys when the run encrypts. A connection that closes or stalls
/// before the peer has proven anything (a listener whose unproven slots
/// strays hold, a peer not yet listening) is dialled again until the deadline.
fn dial(
    party: &Party,
    peer: usize,
    address: &str,
    deadline: Instant,
    timeout: Duration,
) -> Result<(TcpStream, u64, Option<SessionKeys>), GraphError> {
    let mut last: Option<String> = None;
    loop {
        if let Some(stream) = try_connect(address) {
            match handshake(party, peer, address, stream, deadline) {
                Ok(done) => return Ok(done),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Again(why)) => {
                    tracing::debug!("process {}: dialling process {peer} again: {why}", party.me);
                    last = Some(why);
                }
            }
        }
        if Instant::now() >= deadline {
            let note = last
                .map(|why| format!("; the last try {why}"))
                .unwrap_or_default();
            return Err(GraphError::PeerLost {
                peer: format!("process {peer}"),
                reason: format!(
                    "did not connect within {} (is every process started, with the same \
                     hostfile?){note}",
                    seconds(timeout)
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Why one try at a handshake did not connect.
enum Attempt {
    /// Nothing was proven either way: try again.
    Again(String),
    /// The peer answered in a way no retry changes.
    Fatal(GraphError),
}

/// The connecting side of the handshake on `stream` (see [`dial`]).
fn handshake(
    party: &Party,
    peer: usize,
    address: &str,
    mut stream: TcpStream,
    deadline: Instant,
) -> Result<(TcpStream, u64, Option<SessionKeys>), Attempt> {
    let me = party.me;
    // One try waits no longer than a listener gives an unproven connection.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), GREETING * 2);
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(left));
    let _ = stream.set_write_timeout(Some(left));
    let broken = |e: std::io::Error| {
        Attempt::Again(match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!("had no answer within {}", seconds(left))
            }
            _ => format!("was closed during the cluster handshake ({e})"),
        })
    };
    let share = KeyShare::new().map_err(Attempt::Fatal)?;
    let ours: Nonce = *share.public();
    let mut hello = Vec::with_capacity(HELLO);
    hello.extend_from_slice(MAGIC);
    for word in [me as u64, peer as u64, party.fingerprint] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    hello.extend_from_slice(&ours);
    stream.write_all(&hello).map_err(broken)?;
    let mut reply = [0u8; REPLY];
    stream.read_exact(&mut reply).map_err(broken)?;
    if &reply[..16] != MAGIC {
        return Err(Attempt::Fatal(GraphError::Execution(format!(
            "{address} (process {peer}) does not speak weir's cluster protocol"
        ))));
    }
    let word = |at: usize| u64::from_le_bytes(reply[at..at + 8].try_into().expect("8 bytes"));
    let (theirs_fingerprint, run) = (word(16), word(24));
    let theirs: Nonce = reply[32..64].try_into().expect("32 bytes");
    let their_proof: Proof = reply[64..96].try_into().expect("32 bytes");
    let words = |fingerprint| [me as u64, peer as u64, fingerprint, run];
    let proof =
        party
            .secret
            .handshake_proof(Side::Connecting, &words(party.fingerprint), &ours, &theirs);
    stream.write_all(&proof).map_err(broken)?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).map_err(broken)?;
    let genuine = party.secret.verifies_handshake(
        Side::Accepting,
        &words(theirs_fingerprint),
        &ours,
        &theirs,
        &their_proof,
    );
    if !genuine || verdict[0] == NO_SECRET {
        return Err(Attempt::Fatal(another_secret(peer, me)));
    }
    if theirs_fingerprint != party.fingerprint || verdict[0] != ADMITTED {
        return Err(Attempt::Fatal(other_settings(
            peer,
            me,
            theirs_fingerprint,
            party.fingerprint,
        )));
    }
    let keys = party
        .keys(share, &theirs, me, peer, run)
        .map_err(Attempt::Fatal)?;
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    Ok((stream, run, keys))
}

/// A connection to `address`, if one opens within a second.
fn try_connect(address: &str) -> Option<TcpStream> {
    let addresses: Vec<SocketAddr> = address.to_socket_addrs().ok()?.collect();
    addresses
        .iter()
        .find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(1)).ok())
}

const HELLO: usize = 16 + 3 * 8 + 32;
const REPLY: usize = 16 + 2 * 8 + 32 + 32;

/// What became of one accepted connection.
enum Answered {
    /// (The keys are boxed: an AES key schedule is a kilobyte.)
    Admitted(usize, TcpStream, Option<Box<SessionKeys>>),
    /// Dropped: who it claimed to be (if it said), and why.
    Dropped(SocketAddr, Option<usize>, String),
    /// A process that proves the secret but runs other settings.
    Fatal(GraphError),
}

/// Accepts every process above this one, answering each connection's
/// handshake on a thread of its own; the connections not yet proven are
/// held in an [`Unproven`] table, which closes the oldest to make room.
fn accept_all(
    listener: &TcpListener,
    party: &Party,
    run: u64,
    sockets: &mut [Option<(TcpStream, Option<SessionKeys>)>],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), GraphError> {
    let me = party.me;
    listener
        .set_nonblocking(true)
        .map_err(|e| GraphError::Runtime(format!("the cluster listener: {e}")))?;
    let (tx, rx) = mpsc::channel();
    let unproven = Unproven::default();
    let mut refused: Vec<Option<String>> = vec![None; party.processes];
    loop {
        while let Ok(answered) = rx.try_recv() {
            match answered {
                Answered::Admitted(peer, stream, keys) if sockets[peer].is_none() => {
                    sockets[peer] = Some((stream, keys.map(|k| *k)));
                }
                Answered::Admitted(peer, ..) => {
                    tracing::warn!("process {me}: dropped a second connection as process {peer}");
                }
                Answered::Dropped(from, claimed, why) => {
                    tracing::warn!("process {me}: dropped a connection from {from}: {why}");
                    if let Some(p) = claimed {
                        refused[p] = Some(why);
                    }
                }
                Answered::Fatal(e) => return Err(e),
            }
        }
        let Some(missing) = (me + 1..party.processes).find(|&p| sockets[p].is_none()) else {
            return Ok(());
        };
        if Instant::now() >= deadline {
            let note = refused[missing]
                .as_ref()
                .map(|why| format!("; a connection as process {missing} was dropped: {why}"))
                .unwrap_or_default();
            return Err(GraphError::PeerLost {
                peer: format!("process {missing}"),
                reason: format!(
                    "did not connect within {} (is every process started, with the same \
                     hostfile?){note}",
                    seconds(timeout)
                ),
            });
        }
        match listener.accept() {
            Ok((stream, from)) => {
                let (ticket, closed) = unproven.admit(&stream, from);
                if let Some(old) = closed {
                    tracing::warn!(
                        "process {me}: closed an unproven connection from {old} to make room"
                    );
                }
                let (party, tx) = (party.clone(), tx.clone());
                let _ = std::thread::Builder::new()
                    .name("weir:handshake".into())
                    .spawn(move || {
                        let _ = tx.send(answer(stream, from, &party, run, ticket));
                    });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                // Out of file descriptors, say: back off rather than spin.
                tracing::warn!("process {me}: accepting a connection: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// The accepting side of the handshake on `stream`, from `from`.
fn answer(
    mut stream: TcpStream,
    from: SocketAddr,
    party: &Party,
    run: u64,
    ticket: Ticket,
) -> Answered {
    let me = party.me;
    let dropped = |claimed, why: String| Answered::Dropped(from, claimed, why);
    if stream.set_nonblocking(false).is_err()
        || stream.set_read_timeout(Some(GREETING)).is_err()
        || stream.set_write_timeout(Some(GREETING)).is_err()
    {
        return dropped(None, "its socket could not be set up".into());
    }
    let _ = stream.set_nodelay(true);
    let io = |e: std::io::Error| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            format!(
                "it did not finish the handshake within {}",
                seconds(GREETING)
            )
        }
        _ => format!("it closed the connection during the handshake ({e})"),
    };
    let mut hello = [0u8; HELLO];
    if let Err(e) = stream.read_exact(&mut hello) {
        return dropped(None, io(e));
    }
    if &hello[..16] != MAGIC {
        return dropped(None, "it does not speak weir's cluster protocol".into());
    }
    let word = |at: usize| u64::from_le_bytes(hello[at..at + 8].try_into().expect("8 bytes"));
    let (peer, wanted, theirs_fingerprint) = (word(16), word(24), word(32));
    if wanted != me as u64 {
        return dropped(None, format!("it asked for process {wanted}, not {me}"));
    }
    let peer = match usize::try_from(peer) {
        Ok(p) if p > me && p < party.processes => p,
        _ => {
            return dropped(
                None,
                format!("it claimed to be process {peer}, which does not connect to process {me}"),
            )
        }
    };
    let theirs: Nonce = hello[40..72].try_into().expect("32 bytes");
    let share = match KeyShare::new() {
        Ok(share) => share,
        Err(e) => return Answered::Fatal(e),
    };
    let ours: Nonce = *share.public();
    let words = |fingerprint| [peer as u64, me as u64, fingerprint, run];
    let proof =
        party
            .secret
            .handshake_proof(Side::Accepting, &words(party.fingerprint), &theirs, &ours);
    let mut reply = Vec::with_capacity(REPLY);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(&party.fingerprint.to_le_bytes());
    reply.extend_from_slice(&run.to_le_bytes());
    reply.extend_from_slice(&ours);
    reply.extend_from_slice(&proof);
    let mut their_proof: Proof = [0u8; 32];
    if let Err(e) = stream
        .write_all(&reply)
        .and_then(|()| stream.read_exact(&mut their_proof))
    {
        return dropped(Some(peer), io(e));
    }
    let genuine = party.secret.verifies_handshake(
        Side::Connecting,
        &words(theirs_fingerprint),
        &theirs,
        &ours,
        &their_proof,
    );
    if !genuine {
        let _ = stream.write_all(&[NO_SECRET]);
        return dropped(Some(peer), "it did not prove the cluster secret".into());
    }
    ticket.proven();
    if theirs_fingerprint != party.fingerprint {
        let _ = stream.write_all(&[OTHER_SETTINGS]);
        return Answered::Fatal(other_settings(
            peer,
            me,
            theirs_fingerprint,
            party.fingerprint,
        ));
    }
    let keys = match party.keys(share, &theirs, peer, me, run) {
        Ok(keys) => keys,
        Err(e) => {
            let _ = stream.write_all(&[NO_SECRET]);
            return dropped(Some(peer), e.to_string());
        }
    };
    if let Err(e) = stream.write_all(&[ADMITTED]) {
        return dropped(Some(peer), io(e));
    }
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    Answered::Admitted(peer, stream, keys.map(Box::new))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::JoinHandle;

    /// `n` listeners on ports the system picked, and their addresses.
    fn bound(n: usize) -> (Vec<TcpListener>, Vec<String>) {
        let listeners: Vec<TcpListener> = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let hosts = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        (listeners, hosts)
    }

    fn start(
        listener: TcpListener,
        hosts: &[String],
        me: usize,
        secret: &str,
        fingerprint: u64,
        timeout: Duration,
    ) -> JoinHandle<Result<Mesh, GraphError>> {
        start_sealed(listener, hosts, me, secret, fingerprint, false, timeout)
    }

    fn start_sealed(
        listener: TcpListener,
        hosts: &[String],
        me: usize,
        secret: &str,
        fingerprint: u64,
        encrypt: bool,
        timeout: Duration,
    ) -> JoinHandle<Result<Mesh, GraphError>> {
        let hosts = hosts.to_vec();
        let secret = ClusterSecret::new(secret).unwrap();
        std::thread::spawn(move || {
            connect_on(listener, &hosts, me, &secret, fingerprint, encrypt, timeout)
        })
    }

    /// More idle and half-open connections than a listener holds, opened
    /// before the processes start and held open all through: start-up
    /// finishes, and well before its deadline.
    #[test]
    fn a_flood_of_idle_and_half_open_connections_delays_start_up_by_little() {
        let (listeners, hosts) = bound(3);
        let mut held = Vec::new();
        for host in &hosts {
            for i in 0..100 {
                let mut stream = TcpStream::connect(host).unwrap();
                if i % 2 == 1 {
                    // A partial greeting: the magic and half an id.
                    stream.write_all(MAGIC).unwrap();
                    stream.write_all(&[1, 0, 0, 0]).unwrap();
                }
                held.push(stream);
            }
        }
        let started = Instant::now();
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(me, l)| start(l, &hosts, me, "s3cret", 42, Duration::from_secs(60)))
            .collect();
        for handle in handles {
            handle.join().unwrap().unwrap();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{:?}",
            started.elapsed()
        );
        drop(held);
    }

    #[test]
    fn processes_connect_through_strays_and_each_socket_joins_the_right_pair() {
        let (listeners, hosts) = bound(3);
        // Before any process answers: a connect-and-close, bytes that are
        // not weir's, a greeting that claims an id nobody has, and a
        // connection that stays silent.
        let mut strays = Vec::new();
        for host in &hosts {
            drop(TcpStream::connect(host).unwrap());
            let mut garbage = TcpStream::connect(host).unwrap();
            garbage.write_all(&[7u8; HELLO]).unwrap();
            strays.push(garbage);
            let mut liar = TcpStream::connect(host).unwrap();
            let mut hello = MAGIC.to_vec();
            for word in [u64::MAX, 0, 1] {
                hello.extend_from_slice(&word.to_le_bytes());
            }
            hello.extend_from_slice(&[0u8; 32]);
            liar.write_all(&hello).unwrap();
            strays.push(liar);
            strays.push(TcpStream::connect(host).unwrap());
        }
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(me, l)| start(l, &hosts, me, "s3cret", 42, Duration::from_secs(30)))
            .collect();
        let meshes: Vec<Mesh> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        assert!(
            meshes.iter().all(|m| m.run == meshes[0].run),
            "one run value"
        );
        // Each process writes its id on every socket; the other end reads it.
        for (me, mesh) in meshes.iter().enumerate() {
            for (peer, socket) in mesh.sockets.iter().enumerate() {
                assert_eq!(socket.is_none(), peer == me);
                if let Some(mut s) = socket.as_ref().map(|(s, _)| s) {
                    s.write_all(&[me as u8]).unwrap();
                }
            }
        }
        for (me, mesh) in meshes.iter().enumerate() {
            for (peer, socket) in mesh.sockets.iter().enumerate() {
                if let Some(mut s) = socket.as_ref().map(|(s, _)| s) {
                    let mut byte = [0u8];
                    s.read_exact(&mut byte).unwrap();
                    assert_eq!(byte[0] as usize, peer, "process {me}'s socket to {peer}");
                }
            }
        }
        drop(strays);
    }

    #[test]
    fn a_process_without_the_secret_cannot_join_and_the_run_waits_for_one_with_it() {
        let (mut listeners, hosts) = bound(2);
        let second = listeners.pop().unwrap();
        let first = start(
            listeners.pop().unwrap(),
            &hosts,
            0,
            "s3cret",
            42,
            Duration::from_secs(30),
        );
        // A stranger that knows the config (the fingerprint) but not the secret.
        let stranger_listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stranger = start(
            stranger_listener,
            &hosts,
            1,
            "guess",
            42,
            Duration::from_secs(30),
        );
        let err = stranger.join().unwrap().err().expect("refused").to_string();
        assert!(err.contains("cluster secret"), "{err}");
        let second = start(second, &hosts, 1, "s3cret", 42, Duration::from_secs(30));
        let (a, b) = (
            first.join().unwrap().unwrap(),
            second.join().unwrap().unwrap(),
        );
        assert_eq!(a.run, b.run);
    }

    #[test]
    fn processes_with_other_settings_both_stop_and_a_lone_one_says_what_it_refused() {
        let (mut listeners, hosts) = bound(2);
        let timeout = Duration::from_secs(30);
        let b = start(listeners.pop().unwrap(), &hosts, 1, "s3cret", 7, timeout);
        let a = start(listeners.pop().unwrap(), &hosts, 0, "s3cret", 42, timeout);
        for handle in [a, b] {
            let err = handle.join().unwrap().err().expect("stopped").to_string();
            assert!(err.contains("runs different settings"), "{err}");
        }

        let (mut listeners, hosts) = bound(2);
        let lone = start(
            listeners.remove(0),
            &hosts,
            0,
            "s3cret",
            42,
            Duration::from_secs(2),
        );
        let stranger = start(
            listeners.remove(0),
            &hosts,
            1,
            "guess",
            42,
            Duration::from_secs(2),
        );
        assert!(stranger.join().unwrap().is_err());
        let err = lone.join().unwrap().err().expect("timed out").to_string();
        assert!(
            err.contains("did not connect within 2.0 s")
                && err.contains("process 1 was dropped: it did not prove the cluster secret"),
            "{err}"
        );
    }

    #[test]
    fn encrypted_sockets_carry_sealed_bytes_and_both_sides_must_encrypt() {
        use crate::sealed::Sealed;
        let timeout = Duration::from_secs(30);
        // Processes 0 and 1, each encrypting or not.
        let two = |encrypt_0: bool, encrypt_1: bool| {
            let (mut listeners, hosts) = bound(2);
            let b = start_sealed(
                listeners.pop().unwrap(),
                &hosts,
                1,
                "s3cret",
                42,
                encrypt_1,
                timeout,
            );
            let a = start_sealed(
                listeners.pop().unwrap(),
                &hosts,
                0,
                "s3cret",
                42,
                encrypt_0,
                timeout,
            );
            (a, b)
        };
        let (a, b) = two(true, true);
        let sealed = |mesh: Mesh, peer: usize| {
            let (socket, keys) = mesh.sockets.into_iter().nth(peer).unwrap().unwrap();
            Sealed::new(socket, keys.expect("an encrypting run's socket has keys"))
        };
        let mut a = sealed(a.join().unwrap().unwrap(), 1);
        let mut b = sealed(b.join().unwrap().unwrap(), 0);
        a.write_all(b"rows and weights").unwrap();
        let mut got = [0u8; 16];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"rows and weights");
        b.write_all(b"back").unwrap();
        a.read_exact(&mut got[..4]).unwrap();
        assert_eq!(&got[..4], b"back");

        // One process that encrypts and one that does not: other settings.
        let (a, b) = two(true, false);
        for handle in [a, b] {
            let err = handle.join().unwrap().err().expect("stopped").to_string();
            assert!(err.contains("runs different settings"), "{err}");
        }
    }

    #[test]
    fn a_session_fingerprint_differs_from_run_to_run() {
        assert_ne!(session_fingerprint(42, 1), session_fingerprint(42, 2));
        assert_ne!(session_fingerprint(42, 1), session_fingerprint(43, 1));
        assert_eq!(session_fingerprint(42, 1), session_fingerprint(42, 1));
    }
}
