//! Cluster admission: a secret every process of a multi-process run shares
//! and proves in its heartbeats.
//!
//! timely's connections are not authenticated: a process that reaches the
//! ports of a run can take a process id's place. With a [`ClusterSecret`]
//! set, each heartbeat carries a fresh nonce and an HMAC-SHA256 of the
//! sender's process id, settings fingerprint and nonce under the secret;
//! a process whose heartbeat does not verify (no secret, another secret)
//! fails the run with one line on every process, and no source feeds a
//! step before every peer has proven the secret once, so no work starts
//! with a process that does not belong. A fetch over the direct weights
//! channel proves it as well (an HMAC under another label, over the
//! fetcher's process id, the fingerprint, the server's nonce and the
//! payload id), so weights go to no process without it.
//!
//! What it does not do: the traffic itself is neither encrypted nor
//! authenticated message by message (rows and weights cross in clear, as
//! timely sends them), so it keeps out processes that do not know the
//! secret, not an attacker who can read or forge the network's packets;
//! for that, run the cluster on a private network or a VPN.
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
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, GraphError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(GraphError::Execution("the cluster secret is empty".into()));
        }
        Ok(ClusterSecret(bytes))
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
}

const HEARTBEAT: &[u8] = b"weir heartbeat v1";
const WIRE: &[u8] = b"weir weights fetch v1";

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
}
