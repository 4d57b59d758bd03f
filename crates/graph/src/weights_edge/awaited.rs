//! A generator's side of a payload that crosses to its process out of
//! line (fetched over the direct channel, or put back together from
//! buckets by the process's receiving worker): the fetch
//! ([`fetch_for_process`]), the process's shelf the payload waits on for
//! its generators ([`WeightsShelf`]), and the versions a generator awaits
//! until they are whole ([`Awaited`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{now_ns, WeightsBody, WeightsMessage, WeightsPayload, WireNote};
use crate::control::RunShared;
use crate::{PolicyVersion, Step};

/// Versions announced to a generator whose payload it takes from its
/// process's shelf once whole, each with the time (step) it arrived at:
/// no batch of a step at or after that time may be handed over before.
#[derive(Debug, Default)]
pub(crate) struct Awaited {
    versions: BTreeMap<PolicyVersion, (Step, WeightsMessage)>,
}

impl Awaited {
    /// Awaits `message`'s payload, announced at `time`.
    pub(crate) fn insert(&mut self, time: Step, message: WeightsMessage) {
        self.versions.insert(message.version, (time, message));
    }

    /// Whether a batch of `step` must wait for an awaited version.
    pub(crate) fn blocks(&self, step: Step) -> bool {
        self.versions.values().any(|&(time, _)| time <= step)
    }

    /// Stops awaiting `version` and older ones (a newer one is loading).
    pub(crate) fn settled_through(&mut self, version: PolicyVersion) {
        self.versions.retain(|&v, _| v > version);
    }

    /// Stops awaiting anything (the run stopped).
    pub(crate) fn clear(&mut self) {
        self.versions.clear();
    }

    /// The awaited versions whole on `shelf` now, taken for `worker`, in
    /// version order, as inline messages with the time each became whole;
    /// and why a version that will not come fails the run, once `waits`
    /// says a batch waits at or after its time.
    pub(crate) fn take(
        &mut self,
        shelf: &WeightsShelf,
        worker: usize,
        waits: impl Fn(Step) -> bool,
    ) -> (Vec<(WeightsMessage, u64)>, Option<String>) {
        let mut whole = Vec::new();
        let versions: Vec<PolicyVersion> = self.versions.keys().copied().collect();
        for version in versions {
            let time = self.versions[&version].0;
            match shelf.try_take(worker, version) {
                Some(Ok((payload, arrived_ns))) => {
                    let (_, message) = self.versions.remove(&version).expect("just read");
                    let message = WeightsMessage {
                        body: WeightsBody::Inline(payload),
                        ..message
                    };
                    whole.push((message, arrived_ns));
                }
                Some(Err(why)) if waits(time) => {
                    self.versions.remove(&version);
                    return (
                        whole,
                        Some(format!(
                            "worker {worker} needs weights version {version}: {why}"
                        )),
                    );
                }
                None | Some(Err(_)) => {}
            }
        }
        (whole, None)
    }
}

/// Fetches the payload `note` names (version `message.version`) for the
/// generators `takers` of this process: shelved for them once whole, or
/// marked as one that will not come.
pub(crate) fn fetch_for_process(
    shared: &Arc<RunShared>,
    note: &WireNote,
    message: &WeightsMessage,
    takers: Vec<usize>,
) {
    let (version, sent_at_ns) = (message.version, message.sent_at_ns);
    let keep = shared.clone();
    shared
        .wire
        .fetch(note.clone(), move |fetched| match fetched {
            Ok(payload) => {
                tracing::debug!(
                    version,
                    bytes = payload.len(),
                    since_sent_s = now_ns().saturating_sub(sent_at_ns) as f64 * 1e-9,
                    "weights whole"
                );
                keep.weights.put(version, payload, now_ns(), takers);
            }
            Err(why) => keep.weights.fail(version, why, &takers),
        });
}

/// The payloads a process's receiving worker keeps for the generator
/// workers of its process (itself too, when a fetch thread brought the
/// payload), each version until all of them have taken it (or a newer
/// one). A generator polls it ([`WeightsShelf::try_take`]); a payload put
/// on it wakes its takers' operators.
#[derive(Default)]
pub(crate) struct WeightsShelf {
    state: std::sync::Mutex<ShelfState>,
}

#[derive(Default)]
struct ShelfState {
    shelved: std::collections::BTreeMap<PolicyVersion, Shelved>,
    /// Versions whose payload could not be brought, and why.
    failed: std::collections::BTreeMap<PolicyVersion, String>,
    /// Each generator worker's operator, woken when something is put for it.
    wake: std::collections::BTreeMap<usize, timely::scheduling::SyncActivator>,
    /// The newest version each worker has taken: an older one that lands
    /// later (two fetches in flight) is not kept for it.
    taken: std::collections::BTreeMap<usize, PolicyVersion>,
}

struct Shelved {
    payload: WeightsPayload,
    arrived_ns: u64,
    /// Workers that have yet to take it.
    takers: Vec<usize>,
}

impl WeightsShelf {
    fn lock(&self) -> std::sync::MutexGuard<'_, ShelfState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes `worker`'s operator (through `activator`) whenever a version is put for it.
    pub(crate) fn watch(&self, worker: usize, activator: timely::scheduling::SyncActivator) {
        self.lock().wake.insert(worker, activator);
    }

    /// Shelves `payload` of `version` (whole since `arrived_ns`) for `takers`.
    pub(crate) fn put(
        &self,
        version: PolicyVersion,
        payload: WeightsPayload,
        arrived_ns: u64,
        takers: Vec<usize>,
    ) {
        let mut state = self.lock();
        let takers: Vec<usize> = takers
            .into_iter()
            .filter(|w| state.taken.get(w).is_none_or(|&t| t < version))
            .collect();
        if takers.is_empty() {
            return;
        }
        wake(&state.wake, &takers);
        state.shelved.insert(
            version,
            Shelved {
                payload,
                arrived_ns,
                takers,
            },
        );
    }

    /// `version` will not arrive, for `why`; `takers` are told when they look.
    pub(crate) fn fail(&self, version: PolicyVersion, why: String, takers: &[usize]) {
        let mut state = self.lock();
        wake(&state.wake, takers);
        state.failed.insert(version, why);
    }

    /// Worker `worker` takes `version` if it is here (giving up every older
    /// one): `None` while it is not, an error if it will not come.
    pub(crate) fn try_take(
        &self,
        worker: usize,
        version: PolicyVersion,
    ) -> Option<Result<(WeightsPayload, u64), String>> {
        let mut state = self.lock();
        if let Some(entry) = state.shelved.get(&version) {
            let found = (entry.payload.clone(), entry.arrived_ns);
            let taken = state.taken.entry(worker).or_default();
            *taken = (*taken).max(version);
            state.shelved.retain(|&v, e| {
                if v <= version {
                    e.takers.retain(|&w| w != worker);
                }
                !e.takers.is_empty()
            });
            return Some(Ok(found));
        }
        state.failed.get(&version).map(|why| Err(why.clone()))
    }
}

fn wake(
    activators: &std::collections::BTreeMap<usize, timely::scheduling::SyncActivator>,
    takers: &[usize],
) {
    for worker in takers {
        if let Some(activator) = activators.get(worker) {
            // A worker that has ended is past needing weights.
            let _ = activator.activate();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(version: PolicyVersion) -> WeightsMessage {
        WeightsMessage {
            dest: 0,
            version,
            step: version - 1,
            sent_at_ns: 0,
            body: WeightsBody::Shelved,
        }
    }

    #[test]
    fn a_version_holds_back_its_steps_until_whole_and_fails_only_when_waited_for() {
        let shelf = WeightsShelf::default();
        let mut awaited = Awaited::default();
        awaited.insert(3, note(2));
        awaited.insert(4, note(3));
        assert!(!awaited.blocks(2));
        assert!(awaited.blocks(3) && awaited.blocks(9));
        // Version 3 whole first: it loads; 2 is still awaited.
        shelf.put(3, WeightsPayload::from(vec![3u8]), 7, vec![0]);
        let (whole, failed) = awaited.take(&shelf, 0, |_| true);
        assert!(failed.is_none());
        assert_eq!(whole.len(), 1);
        assert_eq!((whole[0].0.version, whole[0].1), (3, 7));
        assert!(matches!(&whole[0].0.body, WeightsBody::Inline(p) if p.bytes() == [3]));
        assert!(awaited.blocks(3));
        // Loading 3 settles 2.
        awaited.settled_through(3);
        assert!(!awaited.blocks(100));
        // A version that will not come fails only once a batch waits for it.
        awaited.insert(5, note(4));
        shelf.fail(4, "the sender died".into(), &[0]);
        let (whole, failed) = awaited.take(&shelf, 0, |_| false);
        assert!(whole.is_empty() && failed.is_none());
        let (_, failed) = awaited.take(&shelf, 0, |time| time == 5);
        assert_eq!(
            failed.as_deref(),
            Some("worker 0 needs weights version 4: the sender died")
        );
        assert!(!awaited.blocks(5), "reported once");
    }

    #[test]
    fn the_shelf_keeps_a_version_until_every_taker_has_it_or_a_newer_one() {
        let shelf = WeightsShelf::default();
        assert!(shelf.try_take(1, 2).is_none(), "not there yet");
        shelf.put(1, WeightsPayload::from(vec![1u8]), 0, vec![1, 2]);
        shelf.put(2, WeightsPayload::from(vec![2u8]), 5, vec![1, 2]);
        let (payload, at) = shelf.try_take(1, 2).unwrap().unwrap();
        assert_eq!((payload.bytes(), at), (&[2u8][..], 5));
        // Worker 2 still needs both; once it takes 2, nothing is left.
        assert_eq!(shelf.lock().shelved.len(), 2);
        assert_eq!(shelf.try_take(2, 2).unwrap().unwrap().0.bytes(), &[2]);
        assert!(shelf.lock().shelved.is_empty());
        // A version that will not come says why.
        shelf.fail(3, "the sender died".into(), &[1]);
        assert_eq!(
            shelf.try_take(1, 3).unwrap().unwrap_err(),
            "the sender died"
        );
    }
}
