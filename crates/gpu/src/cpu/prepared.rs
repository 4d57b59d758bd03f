//! What a [`Model`](crate::model::Model) keeps for the CPU kernels between calls:
//! its packed weights (while they hold still), a KV-cache buffer and a
//! thread pool. It knows the model only by what `cpu::pack` hands it: the
//! parameters' stamp and a way to pack them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::engine::CpuModel;
use crate::checkpoint::SharedKey;
use crate::error::ModelError;

/// The packed weights of one [`Model`], kept between calls while its
/// parameters are unchanged, and a KV-cache buffer to reuse.
///
/// "Unchanged" is judged by each parameter's storage address and libtorch's
/// version counter, which every in-place write bumps (loading, applying a
/// snapshot, an optimizer step), so a stale packing is never used. A model
/// whose weights change between every two calls (a generator fed a new
/// version each step, a learner) would never reuse its packing, so after the
/// first such change the packing is dropped when its call ends instead of
/// being held as a second copy of the weights; once two calls in a row see
/// the same weights, it is kept again.
#[derive(Debug, Default)]
pub struct Prepared {
    packed: Mutex<Option<Packing>>,
    /// The packing that alone holds the weights once the model freed its
    /// own copy ([`Model::keep_only_cpu_packing`]): used whatever the stamp.
    pinned: std::sync::OnceLock<Arc<CpuModel>>,
    cache: Mutex<Vec<f32>>,
    pool: Mutex<Option<Arc<rayon::ThreadPool>>>,
}

/// The weights a packing was made from, the packing if it is kept, and
/// whether a second call used it.
#[derive(Debug)]
struct Packing {
    stamp: Stamp,
    packed: Option<Arc<CpuModel>>,
    reused: bool,
}

/// KV-cache buffers up to this many floats (256 MiB) are kept for the next call.
const KEPT_CACHE_FLOATS: usize = 64 << 20;

impl Prepared {
    /// The packing of the weights `stamp` describes: the kept one while
    /// they are unchanged, else `build`'s (kept or not as the type says).
    pub(crate) fn model(
        &self,
        stamp: impl FnOnce() -> Result<Stamp, ModelError>,
        build: impl FnOnce() -> Result<CpuModel, ModelError>,
    ) -> Result<Arc<CpuModel>, ModelError> {
        if let Some(pinned) = self.pinned.get() {
            return Ok(pinned.clone());
        }
        let stamp = stamp()?;
        let mut slot = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        let (keep, reused) = match slot.as_mut() {
            Some(entry) if entry.stamp == stamp => {
                if let Some(packed) = &entry.packed {
                    entry.reused = true;
                    return Ok(packed.clone());
                }
                // The same weights as last call, which dropped its packing: keep it now.
                (true, true)
            }
            // New weights: keep their packing only if the last one was used twice.
            Some(entry) => (entry.reused, false),
            None => (true, false),
        };
        *slot = None; // free a stale packing before building the new one
        let packed = Arc::new(build()?);
        *slot = Some(Packing {
            stamp,
            packed: keep.then(|| packed.clone()),
            reused,
        });
        Ok(packed)
    }

    /// Makes `packed` the weights for good (see the field).
    pub(crate) fn pin(&self, packed: Arc<CpuModel>) {
        let _ = self.pinned.set(packed);
        *self.packed.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Makes `build`'s packing the weights for good. A model of
    /// [`Model::load_shared`](crate::Model::load_shared) weights (`shared`:
    /// their checkpoint, device and dtype) takes the packing another model
    /// of them made, while one lives: several workers' references in one
    /// process hold the weights once.
    pub(crate) fn pin_consuming(
        &self,
        shared: Option<SharedKey>,
        build: impl FnOnce() -> Result<CpuModel, ModelError>,
    ) -> Result<(), ModelError> {
        let Some(key) = shared else {
            self.pin(Arc::new(build()?));
            return Ok(());
        };
        // Held while packing, so two models packing at once pack once.
        let mut packings = shared_packings().lock().unwrap_or_else(|e| e.into_inner());
        packings.retain(|_, packed| packed.strong_count() > 0);
        let packed = match packings.get(&key).and_then(Weak::upgrade) {
            Some(packed) => packed,
            None => {
                let packed = Arc::new(build()?);
                packings.insert(key, Arc::downgrade(&packed));
                packed
            }
        };
        self.pin(packed);
        Ok(())
    }

    /// Drops a kept packing and KV-cache buffer now (a caller that knows
    /// the weights will change before the next call: a generator at the
    /// end of its step, a learner after its proximal pass).
    pub(crate) fn release(&self) {
        let packing = self.packed.lock().unwrap_or_else(|e| e.into_inner()).take();
        let cache = std::mem::take(&mut *self.cache.lock().unwrap_or_else(|e| e.into_inner()));
        if packing.is_some_and(|p| p.packed.is_some()) || !cache.is_empty() {
            drop(cache);
            crate::device::release_freed_host_memory();
        }
    }

    /// A pool of libtorch's intra-op thread count (`None` for one thread),
    /// so `set_threads` governs the kernels too.
    pub(super) fn pool(&self) -> Result<Option<Arc<rayon::ThreadPool>>, ModelError> {
        let threads = tch::get_num_threads().max(1) as usize;
        if threads == 1 {
            return Ok(None);
        }
        let mut slot = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = slot.as_ref().filter(|p| p.current_num_threads() == threads) {
            return Ok(Some(pool.clone()));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("weir-cpu-{i}"))
            .build()
            .map_err(|e| {
                ModelError::Input(format!("cannot start {threads} kernel threads: {e}"))
            })?;
        let pool = Arc::new(pool);
        *slot = Some(pool.clone());
        Ok(Some(pool))
    }

    /// The KV-cache buffer of an earlier call (empty when another call holds it).
    pub(super) fn take_cache(&self) -> Vec<f32> {
        std::mem::take(&mut *self.cache.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps `buffer` for the next call if it is small enough.
    pub(super) fn give_back_cache(&self, buffer: Vec<f32>) {
        if buffer.len() <= KEPT_CACHE_FLOATS {
            *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = buffer;
        }
    }
}

/// Storage address and version of every parameter.
pub(crate) type Stamp = Vec<(usize, i64)>;

/// The packings that alone hold shared weights, by checkpoint, device and dtype.
type SharedPackings = Mutex<HashMap<SharedKey, Weak<CpuModel>>>;

fn shared_packings() -> &'static SharedPackings {
    static PACKINGS: OnceLock<SharedPackings> = OnceLock::new();
    PACKINGS.get_or_init(Default::default)
}

#[cfg(test)]
impl Prepared {
    /// Whether a packing is kept for the next call.
    pub(super) fn holds_packing(&self) -> bool {
        self.packed
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|p| p.packed.is_some())
    }
}
