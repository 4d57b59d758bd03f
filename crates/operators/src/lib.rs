//! # weir-operators: the RLHF stages
//!
//! The rollout schema (Arrow columns), the RL algorithms (advantages, KL,
//! policy and value losses), reward functions, datasets, the Parquet rollout
//! log and checkpoints, built as `weir_graph::Stage`s over `weir_gpu` models.
//! Filled by the RLHF-stages issue; the engine's own column names live in
//! `weir_graph::columns`.

pub use weir_graph::columns;
