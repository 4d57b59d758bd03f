//! Placement: which workers run which role.
//!
//! Every timely worker is one thread and, with a GPU, one device. A role
//! (`rollout`, `reward`, `reference`, `critic`, `train`, …) runs on a set of
//! workers; sets may overlap (colocation, e.g. actor and reference on one
//! device). Roles that should overlap in time, such as generation and
//! training, go on different workers so a long call in one never stalls the
//! other.
//!
//! # Examples
//! ```
//! use weir_graph::Placement;
//!
//! // Four workers: generation on 0..3, training on 3; scoring colocated with generation.
//! let placement = Placement::new(4)
//!     .assign("rollout", 0..3)
//!     .assign("reward", 0..3)
//!     .assign("train", [3]);
//! assert_eq!(placement.workers("train").unwrap(), &[3]);
//! assert_eq!(placement.leader("rollout").unwrap(), 0);
//! assert!(placement.workers("critic").is_err());
//! ```

use std::collections::BTreeMap;

use crate::GraphError;

/// Role names used by weir's own pipelines. Any other name is allowed too.
pub mod roles {
    /// Reads prompts and feeds steps.
    pub const SOURCE: &str = "source";
    /// The actor generating responses.
    pub const ROLLOUT: &str = "rollout";
    /// Reward functions and reward models.
    pub const REWARD: &str = "reward";
    /// The frozen reference model.
    pub const REFERENCE: &str = "reference";
    /// The critic (values and its own learner).
    pub const CRITIC: &str = "critic";
    /// The actor's learner.
    pub const TRAIN: &str = "train";
    /// Writers of the rollout log.
    pub const LOG: &str = "log";
}

/// A map from role names to sets of global worker indices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    workers: usize,
    roles: BTreeMap<String, Vec<usize>>,
    everywhere: bool,
}

impl Placement {
    /// A placement over `workers` workers with no role assigned yet.
    pub fn new(workers: usize) -> Self {
        Placement {
            workers,
            roles: BTreeMap::new(),
            everywhere: false,
        }
    }

    /// A placement where every role runs on every worker (fully colocated).
    pub fn colocated(workers: usize) -> Self {
        Placement {
            workers,
            roles: BTreeMap::new(),
            everywhere: true,
        }
    }

    /// Assigns `role` to the given workers (replacing an earlier assignment).
    pub fn assign(mut self, role: &str, workers: impl IntoIterator<Item = usize>) -> Self {
        let mut set: Vec<usize> = workers.into_iter().collect();
        set.sort_unstable();
        set.dedup();
        self.roles.insert(role.to_string(), set);
        self
    }

    /// The number of workers this placement spans.
    pub fn worker_count(&self) -> usize {
        self.workers
    }

    /// The workers of `role`, sorted, or an error if the role has none.
    pub fn workers(&self, role: &str) -> Result<Vec<usize>, GraphError> {
        match self.roles.get(role) {
            Some(set) => Ok(set.clone()),
            None if self.everywhere => Ok((0..self.workers).collect()),
            None => Err(GraphError::Pipeline(format!(
                "role `{role}` has no workers in the placement (assigned roles: {})",
                self.roles.keys().cloned().collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// The first worker of `role`: where a role's single-writer duties run.
    pub fn leader(&self, role: &str) -> Result<usize, GraphError> {
        Ok(self.workers(role)?[0])
    }

    /// The roles `worker` hosts.
    pub fn roles_of(&self, worker: usize) -> Vec<&str> {
        self.roles
            .iter()
            .filter(|(_, set)| set.contains(&worker))
            .map(|(role, _)| role.as_str())
            .collect()
    }

    /// Checks that every assigned set is non-empty and inside `0..worker_count`.
    pub fn validate(&self) -> Result<(), GraphError> {
        if self.workers == 0 {
            return Err(GraphError::Pipeline(
                "a placement needs at least one worker".into(),
            ));
        }
        for (role, set) in &self.roles {
            if set.is_empty() {
                return Err(GraphError::Pipeline(format!(
                    "role `{role}` is assigned to no worker"
                )));
            }
            if let Some(bad) = set.iter().find(|&&w| w >= self.workers) {
                return Err(GraphError::Pipeline(format!(
                    "role `{role}` is assigned to worker {bad}, but there are only {} workers (0..{})",
                    self.workers, self.workers
                )));
            }
        }
        Ok(())
    }

    /// Parses `role=0,1,2;role2=3` (worker ranges `a-b` allowed), as given on a command line.
    pub fn parse(workers: usize, text: &str) -> Result<Self, GraphError> {
        let mut placement = Placement::colocated(workers);
        for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (role, list) = part.split_once('=').ok_or_else(|| {
                GraphError::Pipeline(format!("placement entry `{part}` is not `role=workers`"))
            })?;
            let mut set = Vec::new();
            for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                let parse = |s: &str| {
                    s.trim().parse::<usize>().map_err(|_| {
                        GraphError::Pipeline(format!(
                            "placement entry `{part}`: `{s}` is not a worker index"
                        ))
                    })
                };
                match item.split_once('-') {
                    Some((a, b)) => set.extend(parse(a)?..=parse(b)?),
                    None => set.push(parse(item)?),
                }
            }
            placement = placement.assign(role.trim(), set);
        }
        placement.validate()?;
        Ok(placement)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colocated_placement_gives_every_role_every_worker() {
        let p = Placement::colocated(3);
        assert_eq!(p.workers("anything").unwrap(), &[0, 1, 2]);
    }

    #[test]
    fn validate_rejects_out_of_range_workers() {
        let err = Placement::new(2)
            .assign("train", [2])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("worker 2") && err.contains("train"), "{err}");
        let err = Placement::new(2)
            .assign("train", [])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("no worker"), "{err}");
    }

    #[test]
    fn parse_reads_lists_and_ranges() {
        let p = Placement::parse(4, "rollout=0-2; train=3").unwrap();
        assert_eq!(p.workers("rollout").unwrap(), &[0, 1, 2]);
        assert_eq!(p.workers("train").unwrap(), &[3]);
        assert_eq!(p.roles_of(3), vec!["train"]);
        assert!(Placement::parse(4, "rollout=x")
            .unwrap_err()
            .to_string()
            .contains("`x`"));
        assert!(Placement::parse(4, "rollout").is_err());
    }
}
