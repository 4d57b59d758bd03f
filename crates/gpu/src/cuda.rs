//! CUDA device discovery through cudarc (feature `cuda`): names and
//! free/total memory, for the placement plan. cudarc loads the driver
//! library at run time, so this compiles everywhere; on a machine without a
//! driver it returns [`DeviceError::NoDriver`] instead of panicking in the
//! loader (the library's presence is checked before the first call).

use crate::device::DeviceError;

/// One CUDA device as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Driver ordinal.
    pub index: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Free memory, bytes.
    pub free_bytes: usize,
    /// Total memory, bytes.
    pub total_bytes: usize,
}

/// True when the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Every CUDA device with its memory, or a clear error without a driver.
pub fn list_devices() -> Result<Vec<CudaDeviceInfo>, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    let driver = |e: cudarc::driver::DriverError| DeviceError::Driver(e.to_string());
    let count = cudarc::driver::CudaContext::device_count().map_err(driver)?;
    let mut out = Vec::new();
    for index in 0..count.max(0) as usize {
        let ctx = cudarc::driver::CudaContext::new(index).map_err(driver)?;
        let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(driver)?;
        out.push(CudaDeviceInfo {
            index,
            name: ctx.name().map_err(driver)?,
            free_bytes,
            total_bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_devices_never_panics() {
        match list_devices() {
            Ok(devices) => {
                assert!(driver_present());
                for d in devices {
                    assert!(d.free_bytes <= d.total_bytes && !d.name.is_empty(), "{d:?}");
                }
            }
            Err(DeviceError::NoDriver) => assert!(!driver_present()),
            Err(other) => assert!(other.to_string().contains("CUDA driver"), "{other}"),
        }
    }
}
