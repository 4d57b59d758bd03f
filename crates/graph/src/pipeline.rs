//! The declarative pipeline: a source, a chain of stages, sinks, and the weights edge.
//!
//! A pipeline reads like the picture in DESIGN.md: prompts enter at the
//! source, flow through stages (each on its role's workers, over an edge with
//! a [`Partition`]), a learner publishes weights that a generator consumes
//! over the weights edge, and sinks tap the stream wherever they are
//! declared. Building a pipeline runs nothing; [`Pipeline::run`] does.
//!
//! # Examples
//! ```
//! use weir_graph::{Execution, Partition, Pipeline, Placement, RunSettings};
//! use weir_graph::synthetic::{SyntheticGenerate, SyntheticLearn, SyntheticPrompts};
//!
//! let pipeline = Pipeline::new("sim")
//!     .source("rollout", |_| Ok(SyntheticPrompts::new(4)))
//!     .generate("generate", "rollout", Partition::RoundRobin, |_| Ok(SyntheticGenerate::default()))
//!     .learn("learn", "train", Partition::RoundRobin, |_| Ok(SyntheticLearn::default()));
//! let settings = RunSettings::new(Execution::Threads(2), Placement::new(2).assign("rollout", [0]).assign("train", [1]))
//!     .max_staleness(1)
//!     .steps(5);
//! let report = pipeline.run(&settings).unwrap();
//! assert_eq!(report.steps, 5);
//! assert!(report.max_staleness_observed().unwrap() <= 1);
//! ```

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::engine_thread::StageKind;
use crate::partition::check_local;
use crate::stage::{Sink, SinkFactory, Source, SourceFactory, Stage, StageFactory, WorkerInfo};
use crate::{GraphError, Partition, Placement, StageError};

/// A stage in the chain.
#[derive(Clone)]
pub(crate) struct StageSpec {
    pub name: String,
    pub role: String,
    pub partition: Partition,
    pub kind: StageKind,
    pub factory: StageFactory,
    pub offload: Option<usize>,
}

/// A sink tapping the chain after the stages declared before it.
#[derive(Clone)]
pub(crate) struct SinkSpec {
    pub name: String,
    pub role: String,
    pub partition: Partition,
    pub factory: SinkFactory,
}

/// One element of the chain, in declaration order.
#[derive(Clone)]
pub(crate) enum Node {
    Stage(StageSpec),
    Sink(SinkSpec),
}

/// The source and the role it runs on.
#[derive(Clone)]
pub(crate) struct SourceSpec {
    pub role: String,
    pub factory: SourceFactory,
}

/// A declarative RLHF graph, generic over Arrow batches.
#[derive(Clone)]
pub struct Pipeline {
    pub(crate) name: String,
    pub(crate) source: Option<SourceSpec>,
    pub(crate) nodes: Vec<Node>,
}

impl Pipeline {
    /// An empty pipeline called `name`.
    pub fn new(name: &str) -> Self {
        Pipeline {
            name: name.to_string(),
            source: None,
            nodes: Vec::new(),
        }
    }

    /// The pipeline's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets the source, built on every worker of `role`.
    pub fn source<S, F>(mut self, role: &str, factory: F) -> Self
    where
        S: Source + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        let factory: SourceFactory =
            Arc::new(move |w| factory(w).map(|s| Box::new(s) as Box<dyn Source>));
        self.source = Some(SourceSpec {
            role: role.to_string(),
            factory,
        });
        self
    }

    /// Appends a stage on `role`, fed over an edge partitioned by `partition`.
    pub fn stage<S, F>(self, name: &str, role: &str, partition: Partition, factory: F) -> Self
    where
        S: Stage + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        self.push_stage(name, role, partition, StageKind::Plain, factory)
    }

    /// Appends the generator: the stage that reads the weights edge and
    /// stamps `policy_version` on its output.
    pub fn generate<S, F>(self, name: &str, role: &str, partition: Partition, factory: F) -> Self
    where
        S: Stage + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        self.push_stage(name, role, partition, StageKind::Generate, factory)
    }

    /// Appends the learner: the stage that consumes steps in order and
    /// publishes new weights on the weights edge. It always runs on an
    /// engine thread (queue of one batch): its calls are long, and its
    /// worker must stay free to drive other operators and to send the
    /// heartbeats that tell peer processes it is alive.
    pub fn learn<S, F>(self, name: &str, role: &str, partition: Partition, factory: F) -> Self
    where
        S: Stage + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        self.push_stage(name, role, partition, StageKind::Learn, factory)
    }

    /// Runs the last stage's calls on an engine thread per worker, with a
    /// queue of `capacity` batches, so the worker keeps driving its other
    /// operators while the stage works.
    pub fn offload(mut self, capacity: usize) -> Self {
        if let Some(Node::Stage(spec)) = self
            .nodes
            .iter_mut()
            .rev()
            .find(|n| matches!(n, Node::Stage(_)))
        {
            spec.offload = Some(capacity.max(1));
        }
        self
    }

    /// Taps the stream at this point into a sink on `role`.
    pub fn sink<S, F>(mut self, name: &str, role: &str, partition: Partition, factory: F) -> Self
    where
        S: Sink + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        let factory: SinkFactory =
            Arc::new(move |w| factory(w).map(|s| Box::new(s) as Box<dyn Sink>));
        self.nodes.push(Node::Sink(SinkSpec {
            name: name.to_string(),
            role: role.to_string(),
            partition,
            factory,
        }));
        self
    }

    fn push_stage<S, F>(
        mut self,
        name: &str,
        role: &str,
        partition: Partition,
        kind: StageKind,
        factory: F,
    ) -> Self
    where
        S: Stage + 'static,
        F: Fn(&WorkerInfo) -> Result<S, StageError> + Send + Sync + 'static,
    {
        let factory: StageFactory =
            Arc::new(move |w| factory(w).map(|s| Box::new(s) as Box<dyn Stage>));
        self.nodes.push(Node::Stage(StageSpec {
            name: name.to_string(),
            role: role.to_string(),
            partition,
            kind,
            factory,
            offload: (kind == StageKind::Learn).then_some(1),
        }));
        self
    }

    /// Checks the pipeline against a placement: one source, unique names,
    /// at most one generator and one learner, known roles, valid edges.
    pub fn validate(&self, placement: &Placement) -> Result<(), GraphError> {
        placement.validate()?;
        let source = self.source.as_ref().ok_or_else(|| {
            GraphError::Pipeline(format!("pipeline `{}` has no source", self.name))
        })?;
        let mut producers = placement.workers(&source.role)?;
        let mut names = BTreeSet::new();
        let (mut generators, mut learners) = (0, 0);
        for node in &self.nodes {
            let (name, role, partition) = match node {
                Node::Stage(s) => (&s.name, &s.role, &s.partition),
                Node::Sink(s) => (&s.name, &s.role, &s.partition),
            };
            if !names.insert(name.clone()) {
                return Err(GraphError::Pipeline(format!(
                    "two stages or sinks are named `{name}`"
                )));
            }
            let consumers = placement.workers(role)?;
            check_local(partition, &producers, &consumers, name)?;
            if let Node::Stage(s) = node {
                match s.kind {
                    StageKind::Generate => generators += 1,
                    StageKind::Learn => learners += 1,
                    StageKind::Plain => {}
                }
                producers = consumers;
            }
        }
        if generators > 1 || learners > 1 {
            return Err(GraphError::Pipeline(format!(
                "a pipeline has one weights edge: at most one generator and one learner (found {generators} and {learners})"
            )));
        }
        if !self.nodes.iter().any(|n| matches!(n, Node::Stage(_))) {
            return Err(GraphError::Pipeline(format!(
                "pipeline `{}` has no stage",
                self.name
            )));
        }
        Ok(())
    }
}
