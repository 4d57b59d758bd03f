//! The weights edge: versioned learner weights back to the generators.
//!
//! The learner consumes step `s` and publishes version `s + 1` at time `s`.
//! The edge is a timely feedback edge with delay `max_staleness + 1`, so the
//! message reaches the generators at time `s + k + 1`, and a generator may
//! process step `t` only once its weights-input frontier has passed `t`:
//! progress tracking, not a lock, guarantees that a generator at step `t`
//! holds a version ≥ `t − k`.
//!
//! What travels is a [`WeightsMessage`]: the version, the send time, and a
//! body that a [`WeightsTransport`] produced from the learner's
//! [`WeightsPayload`]. The default [`InlineTransport`] carries the payload
//! bytes (safetensors layout) on the edge itself; a transport that moves the
//! tensors out of band (an NCCL broadcast) sends only the version and
//! fetches the tensors in `unpack`.
//!
//! An inline payload crosses to each other process once, whatever its
//! number of generator workers, to that process's first generator worker,
//! which shelves it for the others (they get a [`WeightsBody::Shelved`]
//! note). By default ([`WeightsChannel::Direct`]) only a [`WireNote`]
//! travels on the edge and the receiving process fetches the bytes over a
//! TCP connection of its own, straight into its buffer for that payload
//! (see `wire`). With [`WeightsChannel::Timely`] the payload travels on the
//! edge itself in [`Bucket`]s (`RunSettings::weights_bucket_bytes`, 64 MiB
//! by default), one bucket per activation of the learner's operator, each
//! its own timely message, so a bucket is on the wire and being landed
//! while the next is serialised; on arrival a bucket's bytes go straight
//! into the buffer. Either way the bytes travel while the generators go on
//! generating, the buffer is reused from version to version, and a
//! generator hands over no batch of a step at or after the time a version
//! arrived at until that version is whole and loaded. Generators in the
//! learner's own process share the learner's payload without a copy.
//!
//! # Examples
//! ```
//! use weir_graph::{InlineTransport, WeightsPayload, WeightsTransport};
//!
//! let transport = InlineTransport;
//! let body = transport.pack(3, &WeightsPayload::from(vec![1u8, 2, 3])).unwrap();
//! let back = transport.unpack(3, &body).unwrap();
//! assert_eq!(back.bytes(), &[1, 2, 3]);
//! ```

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use timely::dataflow::operators::feedback::Handle as LoopHandle;
use timely::dataflow::operators::Feedback;
use timely::dataflow::{Scope, Stream};

use crate::{GraphError, PolicyVersion, Step};

mod awaited;
mod buckets;
mod landing;
mod wire;

pub(crate) use awaited::{fetch_for_process, Awaited, WeightsShelf};
pub use buckets::Bucket;
pub(crate) use buckets::{address, receiving_processes, Across, Reassembly};
pub(crate) use landing::allow_payloads_of;
pub use wire::WireNote;
pub(crate) use wire::{Wire, WireConfig};

/// How an inline payload crosses to another process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightsChannel {
    /// Over a TCP connection of its own, straight from the learner's
    /// payload into the receiving process's buffer (see `wire`): the
    /// kernel's two copies only. The learner's process serves it on its
    /// hostfile host at `port` (0: any free port; the receivers learn it
    /// from the edge).
    Direct {
        /// The weights server's port.
        port: u16,
    },
    /// In buckets on timely's own connections (for networks where only the
    /// hostfile's ports are open): two more copies, through timely's buffers.
    Timely,
}

impl Default for WeightsChannel {
    fn default() -> Self {
        WeightsChannel::Direct { port: 0 }
    }
}

/// A learner's weights, opaque to the engine: by convention the bytes of a
/// safetensors file (a JSON header then the named tensors' data). Cloning is
/// cheap (shared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightsPayload(Arc<Vec<u8>>);

impl WeightsPayload {
    /// The payload bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The payload size in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when the payload holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<Vec<u8>> for WeightsPayload {
    fn from(bytes: Vec<u8>) -> Self {
        WeightsPayload(Arc::new(bytes))
    }
}

impl Serialize for WeightsPayload {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for WeightsPayload {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let bytes = serde_bytes::ByteBuf::deserialize(deserializer)?;
        Ok(WeightsPayload::from(bytes.into_vec()))
    }
}

/// What a transport puts on the edge.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum WeightsBody {
    /// The payload itself.
    Inline(WeightsPayload),
    /// Nothing: the transport moves the tensors out of band.
    External,
    /// One bucket of an inline payload, on its way to another process's
    /// receiving worker, which puts the buckets back together.
    Bucket(Bucket),
    /// The payload went to another generator worker of this process (its
    /// receiver), which shelves it for the others: one copy per process.
    Shelved,
    /// Where to fetch the payload over the direct channel; the receiving
    /// worker fetches it for its process and shelves it.
    Wire(WireNote),
}

/// One message on the weights edge, addressed to one generator worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WeightsMessage {
    /// The generator worker this copy goes to.
    pub dest: u32,
    /// The version these weights are (number of learner updates).
    pub version: PolicyVersion,
    /// The step whose update produced them.
    pub step: Step,
    /// Wall-clock send time, nanoseconds since the Unix epoch (for the transfer-time metric).
    pub sent_at_ns: u64,
    /// The transported body.
    pub body: WeightsBody,
}

/// Moves a learner's weights to the generators.
pub trait WeightsTransport: Send + Sync {
    /// On the learner: the body to send for `version`.
    fn pack(
        &self,
        version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<WeightsBody, GraphError>;
    /// On a generator: the weights of `version` from a received body.
    fn unpack(
        &self,
        version: PolicyVersion,
        body: &WeightsBody,
    ) -> Result<WeightsPayload, GraphError>;
}

/// Carries the payload bytes on the edge: shared in a process, serialised between processes.
#[derive(Clone, Copy, Debug, Default)]
pub struct InlineTransport;

impl WeightsTransport for InlineTransport {
    fn pack(
        &self,
        _version: PolicyVersion,
        weights: &WeightsPayload,
    ) -> Result<WeightsBody, GraphError> {
        Ok(WeightsBody::Inline(weights.clone()))
    }

    fn unpack(
        &self,
        version: PolicyVersion,
        body: &WeightsBody,
    ) -> Result<WeightsPayload, GraphError> {
        match body {
            WeightsBody::Inline(payload) => Ok(payload.clone()),
            WeightsBody::External
            | WeightsBody::Bucket(_)
            | WeightsBody::Shelved
            | WeightsBody::Wire(_) => {
                Err(GraphError::Codec(format!(
                    "weights version {version} arrived without a whole payload, but the inline transport expects one"
                )))
            }
        }
    }
}

/// Creates the weights edge of a dataflow: the stream generators read, and
/// the handle the learner's weights output connects to. Messages sent at
/// time `s` appear at `s + max_staleness + 1`.
pub fn weights_edge<'scope>(
    scope: Scope<'scope, Step>,
    max_staleness: u64,
) -> (
    LoopHandle<'scope, Step, Vec<WeightsMessage>>,
    Stream<'scope, Step, Vec<WeightsMessage>>,
) {
    scope.feedback(max_staleness + 1)
}

/// Nanoseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Seconds since the Unix epoch, as metric rows and rollout columns hold them.
pub fn now_unix_s() -> f64 {
    now_ns() as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_cross_processes_as_bytes() {
        let msg = WeightsMessage {
            dest: 1,
            version: 4,
            step: 3,
            sent_at_ns: 9,
            body: WeightsBody::Inline(WeightsPayload::from(vec![7u8; 1000])),
        };
        let bytes = bincode::serialize(&vec![msg]).unwrap();
        assert!(
            bytes.len() < 1100,
            "payload not sent as raw bytes: {} bytes",
            bytes.len()
        );
        let back: Vec<WeightsMessage> = bincode::deserialize(&bytes).unwrap();
        assert_eq!(back[0].version, 4);
        match &back[0].body {
            WeightsBody::Inline(p) => assert_eq!(p.bytes(), &[7u8; 1000][..]),
            WeightsBody::External
            | WeightsBody::Bucket(_)
            | WeightsBody::Shelved
            | WeightsBody::Wire(_) => panic!("body lost"),
        }
    }

    #[test]
    fn inline_transport_rejects_an_external_body() {
        assert!(InlineTransport
            .unpack(2, &WeightsBody::External)
            .unwrap_err()
            .to_string()
            .contains("version 2"));
    }
}
