//! Devices: CPU everywhere, CUDA through tch when present, and the libtorch
//! thread count each worker uses.

use std::fmt;
use std::str::FromStr;

/// Errors of device selection.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    /// The text is not `cpu`, `cuda` or `cuda:N`.
    #[error("`{0}` is not a device (expected cpu, cuda or cuda:N)")]
    Unparsable(String),
    /// No CUDA driver library (libcuda.so) on this machine.
    #[error(
        "no CUDA driver found (libcuda.so could not be loaded): this machine runs on CPU only"
    )]
    NoDriver,
    /// No NCCL library (libnccl.so) on this machine.
    #[error("no NCCL library found (libnccl.so could not be loaded; pip's nvidia-nccl ships only libnccl.so.2: add a libnccl.so link beside it)")]
    NoNccl,
    /// The CUDA driver reported an error.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A CUDA device was asked for that this machine does not have.
    #[error(
        "device cuda:{index} requested, but {available} CUDA device(s) are visible to libtorch"
    )]
    Unavailable {
        /// The requested index.
        index: usize,
        /// How many devices libtorch sees.
        available: usize,
    },
}

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// A CUDA device by index.
    Cuda(usize),
}

impl Device {
    /// Number of CUDA devices libtorch can use (0 without a driver or a CUDA build).
    pub fn cuda_count() -> usize {
        tch::Cuda::device_count().max(0) as usize
    }

    /// Checks that the device exists here and converts it for tch.
    pub fn to_tch(self) -> Result<tch::Device, DeviceError> {
        match self {
            Device::Cpu => Ok(tch::Device::Cpu),
            Device::Cuda(index) => {
                let available = Device::cuda_count();
                if index < available {
                    Ok(tch::Device::Cuda(index))
                } else {
                    Err(DeviceError::Unavailable { index, available })
                }
            }
        }
    }

    /// The device of worker `worker` when each worker owns one GPU: CUDA
    /// device `worker % count` if there are any, else the CPU.
    pub fn for_worker(worker: usize) -> Device {
        match Device::cuda_count() {
            0 => Device::Cpu,
            n => Device::Cuda(worker % n),
        }
    }
}

impl FromStr for Device {
    type Err = DeviceError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| DeviceError::Unparsable(text.to_string())),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Sets libtorch's intra-op threads for this process. On a machine with
/// few cores, workers × threads should not exceed the cores.
pub fn set_threads(threads: usize) {
    tch::set_num_threads(threads.max(1) as i32);
}

/// Gives the host memory that freed tensors left in the allocator's heap
/// back to the system (glibc on Linux: `malloc_trim`). Called where a
/// phase of different tensor shapes ends (a generation, a learner update):
/// glibc serves tensors of up to 32 MiB from heap arenas that keep freed
/// memory resident, and one phase's holes rarely fit the next phase's
/// tensors, so without it the resident set grows by the sum of the
/// phases' working sets (about 1.1 GB of a 135M-shaped GRPO run's peak).
/// Pages given back fault in again when reused, so this trims only when
/// the heaps hold at least [`TRIM_MIN_FREE_BYTES`] free: a small model's
/// phases free a few dozen MB that the next step reuses, and trimming them
/// every phase cost the arith GRPO run a third of its speed (the learner's
/// step 142 → 193 ms, measured by bisecting `cargo bench --bench grpo`).
pub fn release_freed_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallinfo2 reads the allocator's statistics; malloc_trim only
    // returns free heap pages to the system.
    unsafe {
        if libc::mallinfo2().fordblks >= TRIM_MIN_FREE_BYTES {
            libc::malloc_trim(0);
        }
    }
}

/// The free heap memory below which [`release_freed_host_memory`] leaves
/// the pages where they are (256 MiB).
pub const TRIM_MIN_FREE_BYTES: usize = 256 << 20;

/// Phases that held less than this leave too little behind to trim.
pub const RELEASE_MIN_BYTES: usize = 16 << 20;

/// [`release_freed_host_memory`] after a phase that held `bytes`, when
/// that is at least [`RELEASE_MIN_BYTES`]: a trim costs milliseconds (the
/// pages fault in again when reused), and small phases — a streaming
/// pipeline's reference calls come a group at a time, many a step — leave
/// holes the next call reuses. Measured on the streaming bench's long tail
/// (4-row calls, another job sharing the machine): trimming after each
/// took the reference from 0.62 s to 1.25 s and the learner beside it from
/// 5.6 s to 7.8 s over 12 steps.
pub fn release_freed_host_memory_after(bytes: usize) {
    if bytes >= RELEASE_MIN_BYTES {
        release_freed_host_memory();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_devices() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap().to_string(), "cuda:3");
        assert_eq!(
            "gpu".parse::<Device>().unwrap_err(),
            DeviceError::Unparsable("gpu".into())
        );
    }

    #[test]
    fn cpu_always_converts_and_missing_cuda_is_an_error() {
        assert_eq!(Device::Cpu.to_tch().unwrap(), tch::Device::Cpu);
        let too_many = Device::cuda_count() + 1;
        let err = Device::Cuda(too_many).to_tch().unwrap_err().to_string();
        assert!(err.contains(&format!("cuda:{too_many}")), "{err}");
        set_threads(1);
        assert_eq!(tch::get_num_threads(), 1);
    }
}
