//! weir's CPU kernels: generation and no-grad response log-probs for
//! float32 causal LMs on x86-64 with AVX2 and FMA (`generate::Backend::Auto`
//! picks them there). No libtorch in the loop: weights packed once per
//! weights version (`pack`, `prepared`), a fused forward pass (`engine`, `gemm`,
//! `math`), per-sequence cache slots without padding (`state`), and each
//! distinct prompt prefilled once (`run`).

mod engine;
pub mod gemm;
mod math;
pub(crate) mod pack;
pub(crate) mod prepared;
pub(crate) mod run;
mod sample;
mod state;
