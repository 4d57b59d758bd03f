//! Every pipeline for a few steps on the fixture checkpoints, through the
//! runner that `weir run` uses: run folders, rollouts, metrics, checkpoints,
//! and resuming with the same step counter, versions and data cursor.
//!
//! One test binary (each libtorch process costs time to start), a module
//! per pipeline family or concern under `tests/pipelines/`; what they share
//! is in `support.rs`.

#[path = "pipelines/support.rs"]
mod support;

#[path = "pipelines/agentic.rs"]
mod agentic;
#[path = "pipelines/data.rs"]
mod data;
#[path = "pipelines/distill.rs"]
mod distill;
#[path = "pipelines/grpo.rs"]
mod grpo;
#[path = "pipelines/judge.rs"]
mod judge;
#[path = "pipelines/objectives.rs"]
mod objectives;
#[path = "pipelines/parallel.rs"]
mod parallel;
#[path = "pipelines/ppo.rs"]
mod ppo;
#[path = "pipelines/preference.rs"]
mod preference;
#[path = "pipelines/reinforce.rs"]
mod reinforce;
#[path = "pipelines/resume.rs"]
mod resume;
#[path = "pipelines/rewards.rs"]
mod rewards;
#[path = "pipelines/rl.rs"]
mod rl;
#[path = "pipelines/sft.rs"]
mod sft;
#[path = "pipelines/streaming.rs"]
mod streaming;
