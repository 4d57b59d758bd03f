//! # weir: an RLHF engine that runs RLHF as a streaming dataflow graph
//!
//! This crate is the `weir` command line and re-exports the layers:
//! [`graph`] (the timely dataflow engine), [`gpu`] (the model runtime),
//! [`operators`] (RLHF stages and algorithms) and [`pipelines`].

#![deny(missing_docs)]

pub use weir_gpu as gpu;
pub use weir_graph as graph;
pub use weir_operators as operators;
pub use weir_pipelines as pipelines;

pub mod cli;
pub mod cluster;
pub mod demo;
mod demo_agentic;
mod demo_model;
pub mod launch;
pub mod log_cli;
pub mod model_cli;
pub mod report;
pub mod run_cli;
pub mod sim;

/// The README's code, compiled by `cargo test --doc` so that it stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The code of docs/agents.md, compiled by `cargo test --doc`.
#[doc = include_str!("../docs/agents.md")]
#[cfg(doctest)]
pub struct AgentsDoctests;
