//! Built-in tasks: a prompt set with reference answers, the rule that
//! rewards a response, and the task's own measure of a policy. The arith
//! task (`arith.rs`) is the one weir ships; a user's task is a prompt file
//! and a reward (see `weir_pipelines::task`).

pub mod arith;
