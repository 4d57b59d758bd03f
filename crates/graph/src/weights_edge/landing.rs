//! Where payloads from other processes land in this process: their buckets
//! (timely's channel, [`write`]) or their whole stream (the direct channel,
//! [`fill`]), in one buffer per payload under construction, taken from the buffers of
//! earlier versions once nobody holds them any more (their pages are
//! already mapped, so a version arrives with one warm copy rather than
//! page faults over fresh memory).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::WeightsPayload;

#[derive(Default)]
struct Landings {
    /// Payloads under construction.
    open: HashMap<u64, Open>,
    /// Payloads handed out, kept to reuse their buffers once only this holds them.
    done: Vec<WeightsPayload>,
}

/// A payload under construction: its buffer and the byte ranges in so far.
struct Open {
    buffer: Vec<u8>,
    /// Start → end of every range received (no two overlap).
    ranges: BTreeMap<u64, u64>,
    received: u64,
}

/// Whole payloads kept for reuse (a generator holds the newest while the next arrives).
const KEEP: usize = 2;

fn landings() -> MutexGuard<'static, Landings> {
    static LANDINGS: OnceLock<Mutex<Landings>> = OnceLock::new();
    LANDINGS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// An id for a new payload, unique across processes in practice.
pub(super) fn fresh_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u64(crate::weights_edge::now_ns());
    h.write_u32(std::process::id());
    h.finish()
}

/// The most bytes a payload landing from a peer may have: the largest any
/// run of this process allows ([`allow_payloads_of`]; 0: none has said).
static LIMIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Lets payloads of up to `bytes` land in this process (runs of one
/// process share the landing, so the largest limit holds).
pub(crate) fn allow_payloads_of(bytes: u64) {
    LIMIT.fetch_max(bytes, std::sync::atomic::Ordering::SeqCst);
}

/// Copies `bytes` to `offset` of payload `id`'s buffer (`total` bytes).
pub(super) fn write(id: u64, offset: u64, total: u64, bytes: &[u8]) -> Result<(), String> {
    let limit = match LIMIT.load(std::sync::atomic::Ordering::SeqCst) {
        // No run has said: the machine's memory.
        0 => crate::host::memory_bytes().unwrap_or(64 << 30),
        set => set,
    };
    if total > limit {
        return Err(format!(
            "weights payload {id:016x}: a bucket says {total} bytes, more than the {limit} \
             this process's runs expect"
        ));
    }
    let end = offset.checked_add(bytes.len() as u64);
    if end.is_none_or(|end| end > total) {
        return Err(format!(
            "a weights bucket of {} bytes at {offset} overruns its payload of {total}",
            bytes.len()
        ));
    }
    let end = offset + bytes.len() as u64;
    // Take the buffer out, so the copy runs without the lock.
    let mut open = {
        let mut all = landings();
        match all.open.remove(&id) {
            Some(open) => open,
            None => Open {
                buffer: reusable(&mut all, total as usize),
                ranges: BTreeMap::new(),
                received: 0,
            },
        }
    };
    if open.buffer.len() != total as usize {
        return Err(format!(
            "weights payload {id:016x}: a bucket says {total} bytes, an earlier one {}",
            open.buffer.len()
        ));
    }
    // Bytes count once: a bucket over bytes already in would let a payload
    // complete with holes.
    let before = open.ranges.range(..end.max(offset + 1)).next_back();
    if !bytes.is_empty() && before.is_some_and(|(_, &e)| e > offset) {
        landings().open.insert(id, open);
        return Err(format!(
            "weights payload {id:016x}: a bucket of {} bytes at {offset} overlaps bytes already received",
            bytes.len()
        ));
    }
    let at = offset as usize;
    open.buffer[at..at + bytes.len()].copy_from_slice(bytes);
    if !bytes.is_empty() {
        open.ranges.insert(offset, end);
    }
    open.received += bytes.len() as u64;
    landings().open.insert(id, open);
    Ok(())
}

/// A buffer of `len` bytes: a kept payload's that nobody else holds, or a new one.
fn reusable(all: &mut Landings, len: usize) -> Vec<u8> {
    let free = all
        .done
        .iter()
        .position(|p| p.len() == len && Arc::strong_count(&p.0) == 1);
    match free.map(|i| all.done.swap_remove(i)) {
        Some(payload) => Arc::try_unwrap(payload.0).unwrap_or_else(|shared| (*shared).clone()),
        None => fresh(len),
    }
}

/// A zeroed buffer of `len` bytes; a large one asks for huge pages
/// before its first touch (a 1 GiB payload then faults in 512 pieces
/// rather than 262,144).
fn fresh(len: usize) -> Vec<u8> {
    let buffer = vec![0u8; len];
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    if len >= 4 * HUGE {
        let start = (buffer.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (buffer.as_ptr() as usize + len) / HUGE * HUGE;
        if end > start {
            // SAFETY: advice on whole pages inside this live allocation;
            // it changes how they are backed, never their contents.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    buffer
}

/// Payload `id` once all its bytes are in (`None` before).
pub(super) fn take_whole(id: u64) -> Option<WeightsPayload> {
    let mut all = landings();
    let open = all.open.get(&id)?;
    if open.received < open.buffer.len() as u64 {
        return None;
    }
    let open = all.open.remove(&id).expect("just found");
    Some(keep(&mut all, open.buffer))
}

/// A payload of `len` bytes that `fill` writes in one go into a buffer of
/// its own (an earlier version's where one is free).
pub(super) fn fill(
    len: usize,
    fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
) -> std::io::Result<WeightsPayload> {
    let mut buffer = reusable(&mut landings(), len);
    fill(&mut buffer)?;
    Ok(keep(&mut landings(), buffer))
}

/// `buffer` as a whole payload, kept to be reused once nobody else holds it.
fn keep(all: &mut Landings, buffer: Vec<u8>) -> WeightsPayload {
    let payload = WeightsPayload(Arc::new(buffer));
    all.done.push(payload.clone());
    if all.done.len() > KEEP {
        all.done.remove(0);
    }
    payload
}

/// Drops payload `id` under construction (its receiver is gone).
pub(super) fn abandon(id: u64) {
    landings().open.remove(&id);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_with_overlapping_buckets_is_refused() {
        allow_payloads_of(1 << 20);
        let id = fresh_id();
        write(id, 0, 10, &[1; 6]).unwrap();
        // Six more bytes would make twelve "received" of ten, with 6..10 a hole.
        let err = write(id, 4, 10, &[2; 6]).unwrap_err();
        assert!(err.contains("overlaps"), "{err}");
        assert!(take_whole(id).is_none(), "incomplete");
        write(id, 6, 10, &[3; 4]).unwrap();
        let whole = take_whole(id).expect("complete");
        assert_eq!(whole.bytes(), &[1, 1, 1, 1, 1, 1, 3, 3, 3, 3]);
        abandon(id);
    }

    #[test]
    fn a_bucket_announcing_more_than_the_run_expects_is_refused() {
        allow_payloads_of(1 << 20);
        let err = write(fresh_id(), 0, u64::MAX / 2, &[1; 4]).unwrap_err();
        assert!(err.contains("more than the"), "{err}");
    }
}
