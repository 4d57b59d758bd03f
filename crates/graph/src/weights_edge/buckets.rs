//! How an inline payload crosses to another process: cut into [`Bucket`]s
//! addressed to that process's first generator worker ([`address`]),
//! landed on arrival straight into a buffer of the process's own (`landing`),
//! put back together there ([`Reassembly`]) and shelved for the process's
//! other generator workers (`WeightsShelf`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{landing, WeightsBody, WeightsMessage, WeightsPayload};
use crate::{GraphError, PolicyVersion, Step};

/// Bytes `offset..offset + len` of payload `id` (of `total` bytes). On the
/// sending side it shares the whole payload and serialises only its range.
/// Deserialised, its bytes go straight into the receiving process's buffer
/// for that payload (see `landing`): the bucket keeps only their place,
/// so a payload crosses with one copy on arrival, into memory that is
/// reused from version to version.
#[derive(Clone, Debug)]
pub struct Bucket {
    id: u64,
    offset: u64,
    total: u64,
    data: BucketData,
}

#[derive(Clone, Debug)]
enum BucketData {
    /// The sender's payload and this bucket's range of it.
    Shared(WeightsPayload, std::ops::Range<usize>),
    /// `len` bytes already copied into the landing buffer of `id`.
    Landed(usize),
}

impl Bucket {
    /// `payload` cut into buckets of at most `size` bytes (one for an empty payload).
    pub fn split(payload: &WeightsPayload, size: usize) -> Vec<Bucket> {
        let (n, size) = (payload.len(), size.max(1));
        let id = landing::fresh_id();
        (0..n.div_ceil(size).max(1))
            .map(|i| {
                let range = i * size..((i + 1) * size).min(n);
                Bucket {
                    id,
                    offset: range.start as u64,
                    total: n as u64,
                    data: BucketData::Shared(payload.clone(), range),
                }
            })
            .collect()
    }

    /// How many bytes the bucket holds.
    pub fn len(&self) -> usize {
        match &self.data {
            BucketData::Shared(_, range) => range.len(),
            BucketData::Landed(len) => *len,
        }
    }

    /// True for the empty bucket of an empty payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Serialize for Bucket {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let BucketData::Shared(payload, range) = &self.data else {
            return Err(serde::ser::Error::custom(
                "a weights bucket that has landed is not sent on",
            ));
        };
        (
            self.id,
            self.offset,
            self.total,
            serde_bytes::Bytes::new(&payload.bytes()[range.clone()]),
        )
            .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Bucket {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_tuple(4, BucketVisitor)
    }
}

struct BucketVisitor;

impl<'de> serde::de::Visitor<'de> for BucketVisitor {
    type Value = Bucket;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a weights bucket (id, offset, total, bytes)")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bucket, A::Error> {
        use serde::de::Error;
        let mut next = |what: &str| -> Result<u64, A::Error> {
            seq.next_element()?
                .ok_or_else(|| A::Error::custom(format!("a weights bucket without its {what}")))
        };
        let (id, offset, total) = (next("id")?, next("offset")?, next("total")?);
        let len = seq
            .next_element_seed(Landing { id, offset, total })?
            .ok_or_else(|| A::Error::custom("a weights bucket without its bytes"))?;
        Ok(Bucket {
            id,
            offset,
            total,
            data: BucketData::Landed(len),
        })
    }
}

/// Deserialises a bucket's bytes into the landing buffer of its payload.
struct Landing {
    id: u64,
    offset: u64,
    total: u64,
}

impl<'de> serde::de::DeserializeSeed<'de> for Landing {
    type Value = usize;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<usize, D::Error> {
        deserializer.deserialize_bytes(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Landing {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the bytes of a weights bucket")
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<usize, E> {
        landing::write(self.id, self.offset, self.total, bytes).map_err(E::custom)?;
        Ok(bytes.len())
    }

    fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<usize, E> {
        self.visit_bytes(&bytes)
    }
}

/// A receiving worker's payloads under construction.
#[derive(Debug, Default)]
pub(crate) struct Reassembly {
    open: std::collections::BTreeSet<u64>,
}

impl Reassembly {
    /// True when no payload is under construction.
    pub(crate) fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Takes `bucket` in; returns the whole payload once its last bucket is in.
    pub(crate) fn add(&mut self, bucket: &Bucket) -> Result<Option<WeightsPayload>, GraphError> {
        if let BucketData::Shared(payload, range) = &bucket.data {
            // Delivered without crossing a process: land it here.
            landing::write(
                bucket.id,
                bucket.offset,
                bucket.total,
                &payload.bytes()[range.clone()],
            )
            .map_err(GraphError::Codec)?;
        }
        self.open.insert(bucket.id);
        let whole = landing::take_whole(bucket.id);
        if whole.is_some() {
            self.open.remove(&bucket.id);
        }
        Ok(whole)
    }
}

impl Drop for Reassembly {
    fn drop(&mut self) {
        for &id in &self.open {
            landing::abandon(id);
        }
    }
}

/// Room a bucket leaves below a power of two for its message's framing
/// (timely's header, the message's own fields) and for the small messages
/// that may travel between two buckets.
const FRAMING_ROOM: usize = 64 << 10;

/// The bytes one bucket carries when the edge may send `bucket_bytes`: the
/// largest power of two within it, less [`FRAMING_ROOM`].
///
/// timely's receive thread reads into a buffer that grows to the smallest
/// power of two holding one message; when the buffer is full, the partial
/// message at its end is copied into a fresh one. A bucket of exactly 64 MiB
/// makes a message just over 64 MiB in a 128 MiB buffer, and that copy is
/// most of every other bucket (a fifth copy of the payload, measured with
/// `perf`). A message just under a power of two fills its buffer once, and
/// what is left to copy is the next message's first few bytes.
pub(crate) fn wire_bucket_bytes(bucket_bytes: usize) -> usize {
    let power = 1usize << bucket_bytes.max(1).ilog2();
    if power >= 16 * FRAMING_ROOM {
        power - FRAMING_ROOM
    } else {
        bucket_bytes.max(1)
    }
}

/// How an inline payload crosses to the other processes.
#[derive(Clone, Debug)]
pub(crate) enum Across {
    /// In buckets of at most this many bytes ([`wire_bucket_bytes`]) on the edge.
    Buckets(usize),
    /// As a note of where to fetch it over the direct channel.
    Wire(super::WireNote),
}

/// How many processes other than `from` host a worker of `generators`
/// (each `threads` workers).
pub(crate) fn receiving_processes(generators: &[usize], threads: usize, from: usize) -> usize {
    let mut processes: Vec<usize> = generators
        .iter()
        .map(|&g| g / threads.max(1))
        .filter(|&p| p != from)
        .collect();
    processes.sort_unstable();
    processes.dedup();
    processes.len()
}

/// The messages that carry `body` (version `version`, from step `step`) to
/// every worker of `generators`, sent from a worker of process `from` when
/// each process runs `threads` workers: generators of the sender's process
/// share an inline payload; each other process gets it once, as `across`
/// says, at its first generator, and its other generators a
/// [`WeightsBody::Shelved`] note. Bodies that are not inline go to every
/// generator as they are.
pub(crate) fn address(
    generators: &[usize],
    threads: usize,
    from: usize,
    header: (PolicyVersion, Step, u64),
    body: &WeightsBody,
    across: &Across,
) -> Vec<WeightsMessage> {
    let (version, step, sent_at_ns) = header;
    let message = |dest: usize, body: WeightsBody| WeightsMessage {
        dest: dest as u32,
        version,
        step,
        sent_at_ns,
        body,
    };
    let process = |w: usize| w / threads.max(1);
    let mut out = Vec::new();
    for (i, &dest) in generators.iter().enumerate() {
        let p = process(dest);
        match body {
            WeightsBody::Inline(payload) if p != from => {
                let first = generators[..i].iter().all(|&g| process(g) != p);
                match across {
                    _ if !first => out.push(message(dest, WeightsBody::Shelved)),
                    Across::Buckets(bucket_bytes) => out.extend(
                        Bucket::split(payload, wire_bucket_bytes(*bucket_bytes))
                            .into_iter()
                            .map(|b| message(dest, WeightsBody::Bucket(b))),
                    ),
                    Across::Wire(note) => out.push(message(dest, WeightsBody::Wire(note.clone()))),
                }
            }
            WeightsBody::Inline(_)
            | WeightsBody::External
            | WeightsBody::Bucket(_)
            | WeightsBody::Shelved
            | WeightsBody::Wire(_) => out.push(message(dest, body.clone())),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_other_process_gets_one_copy_in_buckets() {
        let payload = WeightsPayload::from(vec![3u8; 10]);
        let body = WeightsBody::Inline(payload);
        // Two workers a process; generators on 0, 1 (the learner's process 0), 2, 3, 5.
        let sent = address(
            &[0, 1, 2, 3, 5],
            2,
            0,
            (4, 3, 0),
            &body,
            &Across::Buckets(4),
        );
        let kinds: Vec<(u32, &str)> = sent
            .iter()
            .map(|m| {
                let kind = match &m.body {
                    WeightsBody::Inline(_) => "inline",
                    WeightsBody::Bucket(_) => "bucket",
                    WeightsBody::Shelved => "shelved",
                    WeightsBody::External => "external",
                    WeightsBody::Wire(_) => "wire",
                };
                (m.dest, kind)
            })
            .collect();
        assert_eq!(
            kinds,
            [
                (0, "inline"),
                (1, "inline"),
                (2, "bucket"),
                (2, "bucket"),
                (2, "bucket"),
                (3, "shelved"),
                (5, "bucket"),
                (5, "bucket"),
                (5, "bucket"),
            ]
        );
        assert!(sent.iter().all(|m| m.version == 4 && m.step == 3));
        let external = address(
            &[0, 2],
            2,
            0,
            (1, 0, 0),
            &WeightsBody::External,
            &Across::Buckets(4),
        );
        assert!(external
            .iter()
            .all(|m| matches!(m.body, WeightsBody::External)));
    }

    /// A bucket's message, framing included, fits the power of two below
    /// the configured size with room to spare, so timely's receive buffer
    /// never carries most of a bucket over into the next one.
    #[test]
    fn a_bucket_and_its_framing_fit_just_under_a_power_of_two() {
        const MIB: usize = 1 << 20;
        assert_eq!(wire_bucket_bytes(64 * MIB), 64 * MIB - FRAMING_ROOM);
        assert_eq!(wire_bucket_bytes(100 * MIB), 64 * MIB - FRAMING_ROOM);
        assert_eq!(wire_bucket_bytes(256 * MIB), 256 * MIB - FRAMING_ROOM);
        // Small buckets (tests, tiny payloads) are as configured.
        assert_eq!(wire_bucket_bytes(4), 4);
        assert_eq!(wire_bucket_bytes(0), 1);
        let payload = WeightsPayload::from(vec![7u8; 64 * MIB + 5]);
        // To generator 1, in another process than the learner's.
        let sent = address(
            &[1],
            1,
            0,
            (2, 1, 0),
            &WeightsBody::Inline(payload),
            &Across::Buckets(64 * MIB),
        );
        assert_eq!(sent.len(), 2, "64 MiB + 5 bytes in two buckets");
        // timely's message header is six u64s.
        let framed = 6 * 8 + bincode::serialize(&sent[0]).unwrap().len();
        assert!(
            framed <= 64 * MIB && framed > 64 * MIB - FRAMING_ROOM,
            "{framed} bytes on the wire"
        );
    }

    #[test]
    fn buckets_serialise_their_range_only_and_land_in_one_reused_buffer() {
        let payload = WeightsPayload::from((0..1000u32).map(|i| i as u8).collect::<Vec<_>>());
        let cross = |buckets: &[Bucket], order: &[usize]| {
            let mut again = Reassembly::default();
            let mut whole = None;
            // Out of order, through bincode as between processes.
            for &i in order {
                let bytes = bincode::serialize(&WeightsBody::Bucket(buckets[i].clone())).unwrap();
                assert!(bytes.len() < 300 + 60, "bucket {i}: {} bytes", bytes.len());
                let WeightsBody::Bucket(b) = bincode::deserialize(&bytes).unwrap() else {
                    panic!("not a bucket")
                };
                assert_eq!(b.len(), buckets[i].len());
                assert!(whole.is_none());
                whole = again.add(&b).unwrap();
            }
            assert!(again.is_empty());
            whole.unwrap()
        };
        let buckets = Bucket::split(&payload, 300);
        assert_eq!(buckets.len(), 4);
        let first = cross(&buckets, &[2, 0, 3, 1]);
        assert_eq!(first, payload);
        // Once nobody holds the first copy, the next payload of its size lands in its buffer.
        let at = first.bytes().as_ptr() as usize;
        drop(first);
        let next = WeightsPayload::from(vec![9u8; 1000]);
        let second = cross(&Bucket::split(&next, 300), &[0, 1, 2, 3]);
        assert_eq!(second, next);
        assert_eq!(
            second.bytes().as_ptr() as usize,
            at,
            "the buffer was not reused"
        );
        // Delivered in-process, a bucket lands the same way.
        let mut here = Reassembly::default();
        let one = Bucket::split(&next, 2000);
        assert_eq!(here.add(&one[0]).unwrap().unwrap(), next);
        let empty = Bucket::split(&WeightsPayload::from(Vec::new()), 300);
        assert_eq!(empty.len(), 1);
        assert_eq!(cross(&empty, &[0]).len(), 0);
        // A bucket that overruns its payload is refused.
        let mut bad = bincode::serialize(&buckets[3]).unwrap();
        bad[16..24].copy_from_slice(&500u64.to_le_bytes());
        assert!(bincode::deserialize::<Bucket>(&bad).is_err());
    }

    #[test]
    fn only_other_processes_count_as_receivers() {
        // Two workers a process; the learner in process 0.
        assert_eq!(receiving_processes(&[0, 1], 2, 0), 0);
        assert_eq!(receiving_processes(&[0, 2, 3, 5], 2, 0), 2);
        assert_eq!(receiving_processes(&[2, 3], 2, 1), 0);
    }
}
