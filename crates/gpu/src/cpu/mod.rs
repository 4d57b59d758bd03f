//! weir's CPU kernels for generation: float32 causal LMs on x86-64 with AVX2
//! and FMA (`generate::Backend::Auto` picks them there). They run a decode
//! step without libtorch: weights packed once per call, fused element-wise
//! work, no padding, prompts prefilled once per sample group.

pub(crate) mod engine;
pub mod gemm;
mod math;
mod sample;
