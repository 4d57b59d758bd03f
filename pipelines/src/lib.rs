//! # weir-pipelines: declarative RLHF pipelines
//!
//! Each pipeline (PPO, GRPO, REINFORCE++, RLOO, SFT, RM, DPO) is a short
//! function that wires `weir_operators` stages into a `weir_graph::Pipeline`
//! from a typed config. Filled by the pipelines issue; the engine simulation
//! (`weir sim`) shows the shape with synthetic stages.

pub use weir_graph::Pipeline;
