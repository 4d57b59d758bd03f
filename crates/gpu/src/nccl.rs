//! NCCL broadcast of a weights snapshot (feature `cuda`): the learner's rank
//! sends the safetensors bytes of a snapshot, every generator rank receives
//! them on its own device, then applies them with `Model::apply_snapshot`.
//!
//! The unique id that joins the ranks is made on one rank
//! ([`unique_id`]) and handed to the others out of band (the engine's
//! control messages, or a file). Every call checks that the CUDA driver and
//! NCCL libraries can be loaded first, so on a machine without them it
//! returns [`DeviceError::NoDriver`] / [`DeviceError::NoNccl`] instead of
//! panicking in cudarc's loader.
//!
//! The snapshot crosses as one byte buffer (length first, then bytes):
//! simple and exact; a zero-copy per-tensor broadcast is a later
//! optimisation.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{Comm, Id};

use crate::cuda::driver_present;
use crate::device::DeviceError;

/// The 128 bytes that name an NCCL clique.
pub type UniqueId = [std::ffi::c_char; 128];

fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl; no NCCL call is made.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

fn check_libraries() -> Result<(), DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    if !nccl_present() {
        return Err(DeviceError::NoNccl);
    }
    Ok(())
}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> DeviceError {
    DeviceError::Driver(format!("NCCL: {e:?}"))
}

fn driver_err(e: cudarc::driver::DriverError) -> DeviceError {
    DeviceError::Driver(e.to_string())
}

/// A fresh unique id, made on one rank and shared with the others.
pub fn unique_id() -> Result<UniqueId, DeviceError> {
    check_libraries()?;
    Ok(*Id::new().map_err(nccl_err)?.internal())
}

/// One rank of a weights-broadcast group.
pub struct WeightsBroadcast {
    comm: Comm,
    stream: Arc<CudaStream>,
}

impl WeightsBroadcast {
    /// Joins the group `id` as `rank` of `world_size`, on CUDA device `device`.
    pub fn join(
        device: usize,
        rank: usize,
        world_size: usize,
        id: &UniqueId,
    ) -> Result<Self, DeviceError> {
        check_libraries()?;
        let ctx = CudaContext::new(device).map_err(driver_err)?;
        let stream = ctx.default_stream();
        let comm =
            Comm::from_rank(stream.clone(), rank, world_size, Id::uninit(*id)).map_err(nccl_err)?;
        Ok(WeightsBroadcast { comm, stream })
    }

    /// Broadcasts `snapshot` from `root`: the root passes `Some(bytes)`, the
    /// others `None`; every rank gets the bytes back.
    pub fn broadcast(&self, snapshot: Option<&[u8]>, root: usize) -> Result<Vec<u8>, DeviceError> {
        let is_root = self.comm.rank() == root;
        if is_root != snapshot.is_some() {
            return Err(DeviceError::Driver(format!(
                "rank {}: only the root ({root}) passes a snapshot",
                self.comm.rank()
            )));
        }
        let root = root as i32;
        let len = snapshot.map_or(0u64, |b| b.len() as u64);
        let mut len_dev = self.stream.clone_htod(&[len]).map_err(driver_err)?;
        self.comm
            .broadcast_in_place(&mut len_dev, root)
            .map_err(nccl_err)?;
        let len = self.stream.clone_dtoh(&len_dev).map_err(driver_err)?[0] as usize;
        let mut bytes_dev = match snapshot {
            Some(bytes) => self.stream.clone_htod(bytes).map_err(driver_err)?,
            None => self.stream.alloc_zeros::<u8>(len).map_err(driver_err)?,
        };
        self.comm
            .broadcast_in_place(&mut bytes_dev, root)
            .map_err(nccl_err)?;
        self.stream.clone_dtoh(&bytes_dev).map_err(driver_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_libraries_every_entry_point_is_a_clear_error() {
        if driver_present() && nccl_present() {
            // A GPU machine: a one-rank group broadcasts to itself.
            let id = unique_id().unwrap();
            let group = WeightsBroadcast::join(0, 0, 1, &id).unwrap();
            assert_eq!(group.broadcast(Some(&[1, 2, 3]), 0).unwrap(), vec![1, 2, 3]);
            return;
        }
        let err = unique_id().unwrap_err();
        assert!(
            matches!(err, DeviceError::NoDriver | DeviceError::NoNccl),
            "{err}"
        );
        let err = WeightsBroadcast::join(0, 0, 1, &[0; 128])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("CUDA driver") || err.contains("NCCL"), "{err}");
    }
}
