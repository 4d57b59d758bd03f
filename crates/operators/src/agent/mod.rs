//! Agentic episodes: what a model's turn calls, and the tools that answer.
//!
//! - [`tool_calls`]: tool calls read from a turn's generated text in the
//!   formats model families are trained on (Hermes / Qwen2.5, Llama 3.1
//!   JSON, Qwen3-Coder XML), a malformed call an error to show the model;
//! - [`episode`]: one episode as one token trajectory: turns sampled by a
//!   [`episode::TurnPolicy`], the tools' answers rendered after them, what
//!   each token is, the budgets and why it ended;
//! - [`turns`]: an episode as a state machine (what it needs next: a
//!   turn sampled, its calls answered, nothing), and [`turns::work`],
//!   which answers a call or an environment's reset or step;
//! - [`environment`]: the `Environment` trait (reset with a row, a step
//!   per turn: an observation, a reward, done), observations as messages
//!   or raw text;
//! - [`http_env`]: an environment behind a server speaking OpenEnv's
//!   HTTP protocol;
//! - [`python_env`]: an environment in a Python file in OpenRLHF's agent
//!   format, run by a long-lived worker process;
//! - [`pool`]: a batch's episodes in one decode pool, their calls on
//!   other threads (or in lockstep rounds, to compare);
//! - [`stream`]: `StreamingEpisodes`, episodes streamed across batches
//!   and steps, weights changing between passes;
//! - [`stage`]: `EpisodeGenerate`, the generator stage that writes one
//!   episode per row as the rollout's response columns;
//! - [`tools`]: the `Tool` trait (a name, a JSON schema for the chat
//!   template, a call), the built-ins, and [`tools::answer`], which turns
//!   any failed call into an error observation;
//! - [`user_tools`]: tools the user writes, a Python function (its schema
//!   from its signature and docstring) or an HTTP endpoint;
//! - [`calculator`]: the built-in `calculator` tool, exact arithmetic on
//!   integers and decimals;
//! - [`python_tool`]: the built-in `python` tool, code run in a fresh
//!   interpreter under CPU, memory, wall-clock and output limits, off the
//!   network where the machine allows;
//! - [`observe`]: the tokens an episode appends after a turn (the
//!   template's boundary, then the observation), rendered by the
//!   checkpoint's own template without re-encoding anything before them.

pub mod calculator;
pub mod environment;
pub mod episode;
pub mod http_env;
pub mod observe;
pub mod pool;
pub mod python_env;
pub mod python_tool;
pub mod stage;
pub mod stream;
pub mod tool_calls;
pub mod tools;
pub mod turns;
pub mod user_tools;
