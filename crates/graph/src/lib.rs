//! # weir-graph: the streaming dataflow engine under weir
//!
//! weir runs RLHF as a timely dataflow graph: prompts flow as Arrow record
//! batches through generate → score → advantage → learn, and a versioned
//! weights edge carries the learner's weights back to the generators. This
//! crate is that engine, and knows nothing of LLMs: its stages are generic
//! over [`RecordBatch`](arrow::array::RecordBatch)es.
//!
//! The folder is the architecture:
//! - [`pipeline`]: the declarative [`Pipeline`] builder (source, stages, sinks);
//! - [`stage`]: the [`Stage`], [`Source`] and [`Sink`] traits;
//! - [`partition`]: edge partitioning (round-robin, by key, local);
//! - [`placement`]: roles → worker sets;
//! - [`weights_edge`]: the versioned feedback edge with delay `max_staleness + 1`;
//! - [`backpressure`]: at most `max_staleness + 1` steps in flight;
//! - [`engine_thread`]: stages that run on their own thread behind a bounded queue;
//! - [`execution`]: one thread, N threads or N processes, and the run settings;
//! - [`cluster_secret`]: the secret a cluster's processes prove; `mesh`: their
//!   sockets, each authenticated under it before timely sees it;
//! - [`collective`]: the all-reduce of data-parallel ranks in any processes, over timely;
//! - [`run`]: the per-worker driver and the dataflow it builds; failures and lost peers (`control`);
//! - [`metrics`]: the metrics stream and the run report;
//! - [`parquet_log`]: rows to rolling Parquet files;
//! - [`synthetic`]: sleep-for-a-cost stages that emit real rows, for tests and benchmarks.

#![deny(missing_docs)]

pub mod backpressure;
pub mod batch;
pub mod cluster_secret;
pub mod collective;
pub mod commit;
mod control;
mod dataflow;
mod edges;
pub mod engine_thread;
mod error;
pub mod execution;
pub mod host;
mod mesh;
pub mod metrics;
pub mod parquet_log;
pub mod partition;
pub mod pipeline;
pub mod placement;
pub mod run;
mod sealed;
pub mod stage;
mod stage_op;
pub mod step_fill;
pub mod synthetic;
pub mod tensorboard;
mod unproven;
pub mod weights_edge;

pub use backpressure::Admission;
pub use batch::Batch;
pub use cluster_secret::ClusterSecret;
pub use engine_thread::StageKind;
pub use error::{GraphError, StageCause, StageError};
pub use execution::{Execution, MetricsObserver, RunSettings, StepObserver};
pub use metrics::{MetricRow, RunReport};
pub use parquet_log::ParquetLog;
pub use partition::{Partition, Router};
pub use pipeline::Pipeline;
pub use placement::{roles, Placement};
pub use stage::{
    concat_by_name, RunSteps, Sink, Source, SourceContext, Stage, StepBuffer, StepContext,
    StepStage, WorkerInfo,
};
pub use step_fill::{Started, StepFill};
pub use weights_edge::{
    InlineTransport, WeightsBody, WeightsChannel, WeightsMessage, WeightsPayload, WeightsTransport,
    WireNote,
};

/// A step: one rollout batch, and the timely timestamp it travels under.
pub type Step = u64;

/// A policy version: the actor's weights after that many learner updates.
pub type PolicyVersion = u64;

/// Columns the engine itself writes.
pub mod columns {
    /// The version of the weights that generated a row (set on a generator's output).
    pub const POLICY_VERSION: &str = "policy_version";
    /// The learner's version when it consumed a row (set on a learner's input).
    pub const LEARNER_VERSION: &str = "learner_version";
    /// `learner_version − policy_version`, never above `max_staleness`.
    pub const STALENESS: &str = "staleness";
}
