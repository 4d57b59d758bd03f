//! # weir-gpu: the model runtime
//!
//! HuggingFace checkpoints on tch (libtorch): configuration, loading
//! (single and sharded safetensors), the shared decoder of the Llama,
//! Mistral, Qwen2 and Qwen3 families with causal-LM and
//! sequence-classification heads, log-probs, and devices. This crate knows
//! nothing of timely or pipelines.

#![deny(missing_docs)]

pub mod adapter;
pub mod checkpoint;
pub mod collective;
pub mod config;
#[cfg(target_arch = "x86_64")]
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decoder;
pub mod device;
mod error;
pub mod generate;
mod held;
pub mod kv_cache;
pub mod logprobs;
pub mod lora;
pub mod model;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod optim;
pub mod responses;
pub mod rope;
pub mod sampling;
pub mod slots;
pub mod snapshot;
pub mod stream;
pub mod tokenizer;

pub use config::{Family, Head, ModelConfig};
pub use decoder::{AttentionRow, PackedLayout};
pub use device::{Device, DeviceError};
pub use error::ModelError;
pub use generate::{generate, generate_on, generate_with_ids};
pub use model::Model;
pub use sampling::{
    temperature_error, top_p_error, Backend, FinishReason, Generation, SamplingParams,
};
pub use stream::{Finished, OnNewWeights, Request, StreamStats, Streamer};
pub use tokenizer::{Message, Tokenizer};
/// Memory budgets for work that input steers (chat templates).
pub use weir_budget as memory_budget;
