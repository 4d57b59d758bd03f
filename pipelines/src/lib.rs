//! # weir-pipelines: declarative RLHF pipelines
//!
//! Each pipeline is a short function that wires `weir_operators` stages
//! into a `weir_graph::Pipeline` from a typed [`RunConfig`]: [`rl::grpo`],
//! [`rl::dr_grpo`], [`rl::rloo`], [`rl::opo`], [`rl::grpo_passk`],
//! [`rl::gpg`], [`rl::reinforce_pp`],
//! [`rl::reinforce_pp_baseline`], [`rl::ppo`], [`sft::sft`], [`preference::rm`]
//! and [`preference::dpo`]. The pieces
//! they share (the prompt source, the actor, rewards, the learner, the
//! rollout log) are in [`roles`]; [`runner`] turns a config into a run
//! folder: resolved config, rollouts, metrics, checkpoints, summary — and
//! resumes one.

#![deny(missing_docs)]

pub mod config;
pub mod context;
pub mod eval;
pub mod export;
pub mod from_log;
pub mod manifest;
pub mod placement;
pub mod preference;
pub mod progress;
pub mod prompts;
pub mod replay;
pub mod resume;
pub mod rewards;
pub mod rl;
pub mod roles;
pub mod runner;
pub mod sft;
pub mod task;

pub use config::{ConfigError, RunConfig};
pub use runner::{run, RunOutcome, RunRequest};
pub use weir_graph::Pipeline;

/// The pipelines `weir run` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PipelineKind {
    /// PPO: actor, critic, reference, GAE.
    Ppo,
    /// GRPO: group-normalised outcome advantages, β·KL in the loss.
    Grpo,
    /// Dr.GRPO: group-centred advantages (no std), length-unbiased aggregation.
    DrGrpo,
    /// RLOO: leave-one-out baselines.
    Rloo,
    /// OPO: the length-weighted mean as the baseline.
    Opo,
    /// GRPO with pass@k advantages: only a group's best response learns.
    GrpoPassk,
    /// GPG: `α (r − mean)` advantages and the plain policy-gradient loss.
    Gpg,
    /// The optimal token baseline: a baseline per position of a group's
    /// tokens, weighted by each path's accumulated variance.
    Otb,
    /// REINFORCE++: KL-shaped token rewards, whitened returns.
    ReinforcePp,
    /// REINFORCE++-baseline: group-mean baseline first.
    ReinforcePpBaseline,
    /// ReMax: a greedy response per prompt is the baseline.
    Remax,
    /// On-policy distillation: the teacher's log-prob of each sampled token
    /// less the student's is its advantage (plus, optionally, a task's).
    Distill,
    /// Supervised fine-tuning on a target column.
    Sft,
    /// Bradley–Terry reward-model training on preference pairs.
    Rm,
    /// DPO / cDPO / IPO on preference pairs against a frozen reference.
    Dpo,
}

impl PipelineKind {
    /// Every pipeline.
    pub const ALL: &'static [PipelineKind] = &[
        PipelineKind::Ppo,
        PipelineKind::Grpo,
        PipelineKind::DrGrpo,
        PipelineKind::Rloo,
        PipelineKind::Opo,
        PipelineKind::GrpoPassk,
        PipelineKind::Gpg,
        PipelineKind::Otb,
        PipelineKind::ReinforcePp,
        PipelineKind::ReinforcePpBaseline,
        PipelineKind::Remax,
        PipelineKind::Distill,
        PipelineKind::Sft,
        PipelineKind::Rm,
        PipelineKind::Dpo,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            PipelineKind::Ppo => "ppo",
            PipelineKind::Grpo => "grpo",
            PipelineKind::DrGrpo => "dr_grpo",
            PipelineKind::Rloo => "rloo",
            PipelineKind::Opo => "opo",
            PipelineKind::GrpoPassk => "grpo_passk",
            PipelineKind::Gpg => "gpg",
            PipelineKind::Otb => "otb",
            PipelineKind::ReinforcePp => "reinforce_pp",
            PipelineKind::ReinforcePpBaseline => "reinforce_pp_baseline",
            PipelineKind::Remax => "remax",
            PipelineKind::Distill => "distill",
            PipelineKind::Sft => "sft",
            PipelineKind::Rm => "rm",
            PipelineKind::Dpo => "dpo",
        }
    }

    /// Parses a command-line name.
    pub fn parse(name: &str) -> Result<Self, String> {
        PipelineKind::ALL
            .iter()
            .copied()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = PipelineKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown pipeline `{name}` (one of {})", names.join(", "))
            })
    }

    /// Whether advantages are computed over prompt groups.
    pub fn is_group(self) -> bool {
        matches!(
            self,
            PipelineKind::Grpo
                | PipelineKind::DrGrpo
                | PipelineKind::Rloo
                | PipelineKind::Opo
                | PipelineKind::GrpoPassk
                | PipelineKind::Gpg
                | PipelineKind::Otb
        )
    }

    /// Whether β·KL to the reference is a term of the learner's loss (the
    /// group estimators, as GRPO has it, and distillation) rather than
    /// shaped into the reward (REINFORCE++, ReMax, PPO).
    pub fn kl_in_loss(self) -> bool {
        self.is_group() || self == PipelineKind::Distill
    }

    /// How the pipeline trains: on its own rollouts, on targets, or on
    /// preference pairs.
    pub fn trains_on(self) -> TrainsOn {
        match self {
            PipelineKind::Ppo
            | PipelineKind::Grpo
            | PipelineKind::DrGrpo
            | PipelineKind::Rloo
            | PipelineKind::Opo
            | PipelineKind::GrpoPassk
            | PipelineKind::Gpg
            | PipelineKind::Otb
            | PipelineKind::ReinforcePp
            | PipelineKind::ReinforcePpBaseline
            | PipelineKind::Remax
            | PipelineKind::Distill => TrainsOn::Rollouts,
            PipelineKind::Sft => TrainsOn::Targets,
            PipelineKind::Rm | PipelineKind::Dpo => TrainsOn::Pairs,
        }
    }

    /// Whether the pipeline generates (the RL ones).
    pub fn is_rl(self) -> bool {
        self.trains_on() == TrainsOn::Rollouts
    }

    /// The name of the stage that trains (whose metrics are the run's curves).
    pub fn trainer_stage(self) -> &'static str {
        match self.trains_on() {
            TrainsOn::Rollouts => "learn",
            TrainsOn::Targets => "sft",
            TrainsOn::Pairs if self == PipelineKind::Rm => "rm",
            TrainsOn::Pairs => "dpo",
        }
    }
}

/// What a pipeline trains on ([`PipelineKind::trains_on`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainsOn {
    /// Its own rollouts, scored by a reward (the RL pipelines).
    Rollouts,
    /// Target texts (`sft`).
    Targets,
    /// Preference pairs (`rm`, `dpo`).
    Pairs,
}

/// Why a pipeline could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A bad config.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The engine failed.
    #[error(transparent)]
    Graph(#[from] weir_graph::GraphError),
    /// The model runtime failed.
    #[error(transparent)]
    Model(#[from] weir_gpu::ModelError),
    /// A stage's or a role's own error (a bad prompt file, a reward that
    /// cannot start, …), its cause kept.
    #[error(transparent)]
    Stage(weir_graph::StageError),
    /// Anything else, described.
    #[error("{0}")]
    Other(String),
}

impl From<String> for PipelineError {
    fn from(s: String) -> Self {
        PipelineError::Other(s)
    }
}

impl From<weir_operators::error::OperatorError> for PipelineError {
    fn from(e: weir_operators::error::OperatorError) -> Self {
        PipelineError::Stage(Box::new(e))
    }
}

impl From<weir_graph::StageError> for PipelineError {
    fn from(e: weir_graph::StageError) -> Self {
        PipelineError::Stage(e)
    }
}
