//! # weir-operators: the RLHF stages
//!
//! The rollout schema (Arrow columns), the RL algorithms (advantages, KL,
//! policy and value losses), reward functions, datasets, the Parquet rollout
//! log and checkpoints, built as `weir_graph::Stage`s over `weir_gpu` models.
//! So far: [`algorithms`], the RL math as pure functions with OpenRLHF's
//! and verl's semantics. The engine's own column names live in
//! `weir_graph::columns`.

#![deny(missing_docs)]

pub mod agent;
pub mod algorithms;
pub mod checkpoint;
pub mod data;
pub mod error;
mod python_worker;
pub mod rewards;
pub mod rollout;
pub mod rollout_log;
pub mod stages;
pub mod tasks;
pub mod training;

pub use error::OperatorError;
pub use weir_graph::columns;
