//! Cluster admission: a secret every process of a multi-process run shares
//! and proves on every connection.
//!
//! timely's own handshake is an 8-byte process id. weir connects a
//! cluster's processes itself (the crate's `mesh` module): on each socket
//! both sides prove the secret with an HMAC-SHA256 over both process ids,
//! their settings fingerprints, the run's random value and a fresh nonce
//! from each side, and only then is the socket handed to timely, so no
//! byte of data or control reaches a process from a peer that has not
//! proven it. Heartbeats still carry a proof (over the sender's id, the
//! session fingerprint — the settings' fingerprint mixed with the run's
//! random value — and a nonce), and a fetch over the direct weights channel
//! proves it as well (another label, over the fetcher's id, the session
//! fingerprint, the server's nonce and the payload id), so weights go to
//! no process without it. A cluster always has a secret: given by the
//! user, or, when every process runs on this machine, made in the run
//! folder ([`ClusterSecret::of_run_folder`]).
//!
//! What it does not do by itself: encrypt the traffic. Unless the run sets
//! `RunSettings::encrypt` (`placement.encrypt`), rows and weights cross in
//! clear, as timely sends them, so the secret keeps out processes that do
//! not know it, not an attacker who can read or rewrite the network's
//! packets. With it, every connection is sealed under keys derived from
//! this secret (see the crate's `sealed` module).
//!
//! # Examples
//!
//! ```
//! use weir_graph::ClusterSecret;
//!
//! let secret = ClusterSecret::new("correct horse").unwrap();
//! let proof = secret.proof(1, 0xfeed, 42);
//! assert!(secret.verifies(1, 0xfeed, 42, &proof));
//! assert!(!secret.verifies(0, 0xfeed, 42, &proof), "another process id");
//! assert!(!ClusterSecret::new("guess").unwrap().verifies(1, 0xfeed, 42, &proof));
//! assert!(ClusterSecret::new("").is_err());
//! ```

use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::GraphError;

/// A proof of the secret: an HMAC-SHA256 tag.
pub type Proof = [u8; 32];

/// The secret a run's processes share (never printed).
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(…)")
    }
}

impl ClusterSecret {
    /// A secret of these bytes; an empty one is refused.
    ///
    /// A process that holds a secret turns itself non-dumpable
    /// (`PR_SET_DUMPABLE`): its `/proc/<pid>/mem` and `environ` are then
    /// closed to other processes of the same user — the Python rewards,
    /// tools and environments it runs — and it writes no core file.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, GraphError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(GraphError::Execution("the cluster secret is empty".into()));
        }
        // SAFETY: prctl with integer arguments only changes a flag of this process.
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
        Ok(ClusterSecret(bytes))
    }

    /// The secret's bytes (key material for [`crate::sealed`]).
    pub(crate) fn key(&self) -> &[u8] {
        &self.0
    }

    /// The HMAC of `purpose` (a label no other use shares) over `words`.
    fn mac(&self, purpose: &[u8], words: &[u64]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(purpose);
        for word in words {
            mac.update(&word.to_le_bytes());
        }
        mac
    }

    /// The proof a heartbeat of `process` with `fingerprint` and `nonce` carries.
    pub fn proof(&self, process: usize, fingerprint: u64, nonce: u64) -> Proof {
        self.mac(HEARTBEAT, &[process as u64, fingerprint, nonce])
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is that of this secret (compared in constant time).
    pub fn verifies(&self, process: usize, fingerprint: u64, nonce: u64, proof: &Proof) -> bool {
        self.mac(HEARTBEAT, &[process as u64, fingerprint, nonce])
            .verify_slice(proof)
            .is_ok()
    }

    /// The proof with which `process` fetches weights payload `payload` over
    /// the direct weights channel, answering the server's `nonce`: bound to
    /// the run's settings, the request and the connection, and never equal
    /// to a heartbeat's (another label).
    pub(crate) fn wire_proof(
        &self,
        process: usize,
        fingerprint: u64,
        nonce: u64,
        payload: u64,
    ) -> Proof {
        self.mac(WIRE, &[process as u64, fingerprint, nonce, payload])
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is [`ClusterSecret::wire_proof`]'s under this secret.
    pub(crate) fn verifies_wire(
        &self,
        process: usize,
        fingerprint: u64,
        nonce: u64,
        payload: u64,
        proof: &Proof,
    ) -> bool {
        self.mac(WIRE, &[process as u64, fingerprint, nonce, payload])
            .verify_slice(proof)
            .is_ok()
    }

    /// The proof one side of a cluster connection's handshake sends (see
    /// [`crate::mesh`]): over `words` (the connecting and the accepting
    /// process's ids, the sender's fingerprint, the run's random value) and
    /// both sides' nonces, under a label of its side's own.
    pub(crate) fn handshake_proof(
        &self,
        side: Side,
        words: &[u64; 4],
        connecting: &[u8; 32],
        accepting: &[u8; 32],
    ) -> Proof {
        self.handshake_mac(side, words, connecting, accepting)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is [`ClusterSecret::handshake_proof`]'s under this
    /// secret (compared in constant time).
    pub(crate) fn verifies_handshake(
        &self,
        side: Side,
        words: &[u64; 4],
        connecting: &[u8; 32],
        accepting: &[u8; 32],
        proof: &Proof,
    ) -> bool {
        self.handshake_mac(side, words, connecting, accepting)
            .verify_slice(proof)
            .is_ok()
    }

    fn handshake_mac(
        &self,
        side: Side,
        words: &[u64; 4],
        connecting: &[u8; 32],
        accepting: &[u8; 32],
    ) -> Hmac<Sha256> {
        let label = match side {
            Side::Connecting => CONNECTING,
            Side::Accepting => ACCEPTING,
        };
        let mut mac = self.mac(label, words);
        mac.update(connecting);
        mac.update(accepting);
        mac
    }

    /// The secret of a run whose processes all run on this machine and
    /// share the run folder `dir`: the first line of `dir/cluster.secret`,
    /// which the first process to start writes (32 random bytes, hex, a
    /// file only its owner may read) and every other reads.
    pub fn of_run_folder(dir: &Path) -> Result<Self, GraphError> {
        let path = dir.join(SECRET_FILE);
        let io = |e| GraphError::io(&path, e);
        std::fs::create_dir_all(dir).map_err(|e| GraphError::io(dir, e))?;
        if std::fs::symlink_metadata(&path).is_err() {
            let bytes: [u8; 32] = random()?;
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            // Written aside, then linked into place: a process that starts
            // at the same moment either links first or reads the winner's.
            let aside = dir.join(format!(".{SECRET_FILE}.{}", std::process::id()));
            write_private(&aside, format!("{hex}\n").as_bytes())
                .map_err(|e| GraphError::io(&aside, e))?;
            let linked = std::fs::hard_link(&aside, &path);
            let _ = std::fs::remove_file(&aside);
            match linked {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        check_private(&path)?;
        let text = std::fs::read_to_string(&path).map_err(io)?;
        let line = text.lines().next().unwrap_or("").trim();
        ClusterSecret::new(line.as_bytes()).map_err(|_| {
            GraphError::Execution(format!("{}: the first line is empty", path.display()))
        })
    }
}

/// Writes `bytes` to a new file at `path` that only its owner may read,
/// created exclusively (a stale or planted file, or a link, under the name
/// is removed first and never followed).
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let create = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    let mut file = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            create()?
        }
        file => file?,
    };
    std::io::Write::write_all(&mut file, bytes)?;
    file.sync_all()
}

/// The permission bits of `path` when users other than its owner may read
/// or write it (group or other bits set), else `None`.
pub fn readable_by_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(mode)
}

/// Refuses a run folder's secret file that someone else could know: a
/// link, a file of another user, or one that others may read or write
/// (weir writes it 0600 itself, so such a file was planted or loosened).
fn check_private(path: &Path) -> Result<(), GraphError> {
    use std::os::unix::fs::MetadataExt;
    let refuse = |why: String| {
        GraphError::Execution(format!(
            "{}: {why}; the cluster secret must be a file only you can read \
             (remove it, and weir writes a new one)",
            path.display()
        ))
    };
    let meta = std::fs::symlink_metadata(path).map_err(|e| GraphError::io(path, e))?;
    if !meta.file_type().is_file() {
        return Err(refuse("not a plain file (a link?)".into()));
    }
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    if meta.uid() != uid {
        return Err(refuse(format!("owned by user {}, not {uid}", meta.uid())));
    }
    if let Some(mode) = readable_by_others(path) {
        return Err(refuse(format!("readable by other users (mode {mode:o})")));
    }
    Ok(())
}

const HEARTBEAT: &[u8] = b"weir heartbeat v1";
const WIRE: &[u8] = b"weir weights fetch v1";
const CONNECTING: &[u8] = b"weir cluster connecting v1";
const ACCEPTING: &[u8] = b"weir cluster accepting v1";

/// The environment variable holding a run's cluster secret (weir's
/// commands read it; processes weir starts never see it).
pub const ENV_VAR: &str = "WEIR_CLUSTER_SECRET";

/// `N` bytes from the operating system's random source.
pub(crate) fn random<const N: usize>() -> Result<[u8; N], GraphError> {
    let mut bytes = [0u8; N];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| GraphError::Runtime(format!("the system's random source: {e}")))?;
    Ok(bytes)
}

/// The file in a run folder that holds the secret of a cluster whose
/// processes all run on one machine ([`ClusterSecret::of_run_folder`]).
pub const SECRET_FILE: &str = "cluster.secret";

/// Whether a run folder's file `name` is the cluster's secret, or the copy
/// a process writes aside before linking it into place (which another
/// process of the run may see for a moment).
pub fn is_secret_file(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy();
    name == SECRET_FILE
        || name
            .strip_prefix('.')
            .and_then(|n| n.strip_prefix(SECRET_FILE))
            .and_then(|n| n.strip_prefix('.'))
            .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

/// Which side of a cluster connection's handshake a proof is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The process that connects (the higher id).
    Connecting,
    /// The process that accepts (the lower id).
    Accepting,
}

/// A fresh nonce: the process id, the time and std's per-process random keys, hashed.
pub(crate) fn nonce(process: usize) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_usize(process);
    h.write_u32(std::process::id());
    h.write_u64(crate::weights_edge::now_ns());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_and_its_copy_aside_are_the_secret_files_and_nothing_else() {
        let is = |name: &str| is_secret_file(std::ffi::OsStr::new(name));
        assert!(is("cluster.secret") && is(".cluster.secret.4242"));
        assert!(!is(".cluster.secret.") && !is(".cluster.secret.12x") && !is("cluster.secret.bak"));
        assert!(!is("metrics.parquet"));
    }

    #[test]
    fn a_proof_binds_the_secret_the_process_the_settings_and_the_nonce() {
        let s = ClusterSecret::new(b"s3cret".to_vec()).unwrap();
        let p = s.proof(2, 7, 99);
        assert!(s.verifies(2, 7, 99, &p));
        assert!(!s.verifies(2, 8, 99, &p));
        assert!(!s.verifies(2, 7, 98, &p));
        assert!(!s.verifies(3, 7, 99, &p));
        assert!(!ClusterSecret::new("s3cret ")
            .unwrap()
            .verifies(2, 7, 99, &p));
        assert_eq!(format!("{s:?}"), "ClusterSecret(…)", "never printed");
        assert_ne!(nonce(0), nonce(0), "fresh each time");
    }

    #[test]
    fn a_run_folders_secret_is_private_and_a_planted_one_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // A link planted at the name the copy aside takes is not written through.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let aside = dir
            .path()
            .join(format!(".{SECRET_FILE}.{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &aside).unwrap();
        let made = ClusterSecret::of_run_folder(dir.path()).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        let path = dir.path().join(SECRET_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(ClusterSecret::of_run_folder(dir.path()).unwrap(), made);
        // Loosened (or planted world-readable): refused, naming the mode.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = ClusterSecret::of_run_folder(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cluster.secret") && err.contains("mode 644"),
            "{err}"
        );
        // A link in its place: refused, not followed.
        std::fs::remove_file(&path).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let err = ClusterSecret::of_run_folder(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a plain file"), "{err}");
    }
}
