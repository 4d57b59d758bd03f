//! # weir-gpu: the model runtime
//!
//! HuggingFace checkpoints on tch (libtorch): loading, forward passes,
//! KV-cache generation, log-probs, reward and value heads, optimisers,
//! saving, and devices. This crate knows nothing of timely or pipelines.
//!
//! Today it holds device selection and per-worker thread settings; the model
//! families arrive with the model-runtime issue.

pub mod device;

pub use device::{Device, DeviceError};
