//! Agentic episodes: what a model's turn calls, and the tools that answer.
//!
//! - [`tool_calls`]: tool calls read from a turn's generated text in the
//!   formats model families are trained on (Hermes / Qwen2.5, Llama 3.1
//!   JSON, Qwen3-Coder XML), a malformed call an error to show the model;
//! - [`calculator`]: the built-in `calculator` tool, exact arithmetic on
//!   integers and decimals.

pub mod calculator;
pub mod tool_calls;
