//! Edge partitioning: which worker of the consuming role gets each row.
//!
//! A stage's input edge names a [`Partition`]. The upstream side splits its
//! output batches with a [`Router`] and stamps each piece with a destination
//! worker; timely's exchange pact then moves the piece there (as Arrow IPC
//! bytes when it crosses processes).
//!
//! # Examples
//! ```
//! use std::sync::Arc;
//! use arrow::array::{ArrayRef, RecordBatch, UInt64Array};
//! use weir_graph::{Partition, Router};
//!
//! let rows = RecordBatch::try_from_iter([(
//!     "group_id",
//!     Arc::new(UInt64Array::from(vec![7, 7, 9, 9, 7])) as ArrayRef,
//! )]).unwrap();
//! // Rows of one group always go to the same worker of the set {2, 3}.
//! let mut router = Router::new(Partition::ByKey("group_id".into()), vec![2, 3], 0);
//! let pieces = router.route(rows, "advantage").unwrap();
//! let total: usize = pieces.iter().map(|b| b.data.num_rows()).sum();
//! assert_eq!(total, 5);
//! assert!(pieces.iter().all(|b| b.dest == 2 || b.dest == 3));
//! ```

use arrow::array::{Array, AsArray, RecordBatch, UInt32Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{DataType, Int32Type, Int64Type, UInt32Type, UInt64Type};

use crate::batch::is_key_type;
use crate::{Batch, GraphError};

/// How an edge spreads batches over the consuming role's workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Partition {
    /// Whole batches, in turn, to each worker of the role.
    RoundRobin,
    /// Rows by a hash of a key column, so all rows with one key (a prompt
    /// group) meet on one worker. Keys: UInt64/UInt32/Int64/Int32/Utf8.
    ByKey(String),
    /// Stay on the producing worker (colocated roles); every producing worker
    /// must also host the consuming role.
    Local,
}

/// Splits batches according to a [`Partition`] over a worker set.
#[derive(Debug)]
pub struct Router {
    partition: Partition,
    targets: Vec<usize>,
    me: usize,
    next: usize,
}

impl Router {
    /// A router from worker `me` to the workers `targets` (non-empty).
    pub fn new(partition: Partition, targets: Vec<usize>, me: usize) -> Self {
        assert!(
            !targets.is_empty(),
            "a router needs a target worker; placement validation guarantees one"
        );
        // Start the round-robin at a worker-dependent offset so senders spread.
        let next = me % targets.len();
        Router {
            partition,
            targets,
            me,
            next,
        }
    }

    /// Splits `data` into addressed batches. Empty pieces are not emitted.
    pub fn route(&mut self, data: RecordBatch, stage: &str) -> Result<Vec<Batch>, GraphError> {
        match &self.partition {
            Partition::RoundRobin => {
                let dest = self.targets[self.next];
                self.next = (self.next + 1) % self.targets.len();
                Ok(vec![Batch {
                    dest: dest as u32,
                    data,
                }])
            }
            Partition::Local => Ok(vec![Batch {
                dest: self.me as u32,
                data,
            }]),
            Partition::ByKey(column) => self.route_by_key(data, column, stage),
        }
    }

    fn route_by_key(
        &self,
        data: RecordBatch,
        column: &str,
        stage: &str,
    ) -> Result<Vec<Batch>, GraphError> {
        let keys = data
            .column_by_name(column)
            .ok_or_else(|| GraphError::Column {
                stage: stage.to_string(),
                column: column.to_string(),
                problem: "missing (it is this edge's partitioning key)".to_string(),
            })?;
        if !is_key_type(keys.data_type()) {
            return Err(GraphError::Column {
                stage: stage.to_string(),
                column: column.to_string(),
                problem: format!(
                    "a partitioning key must be an integer or string column, found {}",
                    keys.data_type()
                ),
            });
        }
        if self.targets.len() == 1 {
            return Ok(vec![Batch {
                dest: self.targets[0] as u32,
                data,
            }]);
        }
        let mut rows_for: Vec<Vec<u32>> = vec![Vec::new(); self.targets.len()];
        for row in 0..data.num_rows() {
            let slot = (key_hash(keys.as_ref(), row) % self.targets.len() as u64) as usize;
            rows_for[slot].push(row as u32);
        }
        let mut out = Vec::new();
        for (slot, rows) in rows_for.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let piece = if rows.len() == data.num_rows() {
                data.clone()
            } else {
                take_record_batch(&data, &UInt32Array::from(rows))
                    .map_err(|e| GraphError::Codec(e.to_string()))?
            };
            out.push(Batch {
                dest: self.targets[slot] as u32,
                data: piece,
            });
        }
        Ok(out)
    }
}

/// FNV-1a over `bytes`.
fn fnv(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Which of a role's `workers` workers a `ByKey` edge sends the unsigned
/// integer key `key` to: its rank among them (what a stage restoring keyed
/// state uses to keep the keys its rank receives).
pub fn u64_key_rank(key: u64, workers: usize) -> usize {
    (fnv(&key.to_le_bytes()) % workers.max(1) as u64) as usize
}

/// FNV-1a over the key's bytes: stable across processes and builds, unlike
/// std's randomly seeded hashers. A null key hashes like an empty one.
fn key_hash(keys: &dyn Array, row: usize) -> u64 {
    if keys.is_null(row) {
        return fnv(&[]);
    }
    match keys.data_type() {
        DataType::UInt64 => fnv(&keys.as_primitive::<UInt64Type>().value(row).to_le_bytes()),
        DataType::UInt32 => {
            fnv(&u64::from(keys.as_primitive::<UInt32Type>().value(row)).to_le_bytes())
        }
        DataType::Int64 => fnv(&keys.as_primitive::<Int64Type>().value(row).to_le_bytes()),
        DataType::Int32 => {
            fnv(&i64::from(keys.as_primitive::<Int32Type>().value(row)).to_le_bytes())
        }
        DataType::Utf8 => fnv(keys.as_string::<i32>().value(row).as_bytes()),
        DataType::LargeUtf8 => fnv(keys.as_string::<i64>().value(row).as_bytes()),
        other => unreachable!("key type {other} was rejected by is_key_type"),
    }
}

/// Checks, when a pipeline is built, that a `Local` edge only joins colocated roles.
pub(crate) fn check_local(
    partition: &Partition,
    producers: &[usize],
    consumers: &[usize],
    stage: &str,
) -> Result<(), GraphError> {
    if *partition == Partition::Local {
        if let Some(w) = producers.iter().find(|w| !consumers.contains(w)) {
            return Err(GraphError::Pipeline(format!(
                "stage `{stage}` takes a Local edge, but producing worker {w} does not host its role"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{ArrayRef, StringArray, UInt64Array};
    use std::collections::HashMap;
    use std::sync::Arc;

    fn groups(ids: Vec<u64>) -> RecordBatch {
        let n = ids.len() as u64;
        RecordBatch::try_from_iter([
            ("group_id", Arc::new(UInt64Array::from(ids)) as ArrayRef),
            (
                "row_id",
                Arc::new(UInt64Array::from((0..n).collect::<Vec<_>>())) as ArrayRef,
            ),
        ])
        .unwrap()
    }

    #[test]
    fn the_rank_of_a_u64_key_is_where_the_router_sends_it() {
        let ids: Vec<u64> = (0..40).map(|i| i * 7919 + 3).collect();
        let mut r = Router::new(Partition::ByKey("group_id".into()), vec![4, 6, 9], 0);
        for batch in r.route(groups(ids.clone()), "s").unwrap() {
            let keys = batch.data.column(0).as_primitive::<UInt64Type>();
            for k in keys.values() {
                assert_eq!(
                    [4, 6, 9][u64_key_rank(*k, 3)],
                    batch.dest as usize,
                    "key {k}"
                );
            }
        }
    }

    #[test]
    fn round_robin_cycles_through_targets() {
        let mut r = Router::new(Partition::RoundRobin, vec![4, 5, 6], 0);
        let dests: Vec<u32> = (0..6)
            .map(|_| r.route(groups(vec![1]), "s").unwrap()[0].dest)
            .collect();
        assert_eq!(dests, vec![4, 5, 6, 4, 5, 6]);
    }

    #[test]
    fn by_key_never_splits_a_group_and_keeps_every_row() {
        let ids: Vec<u64> = (0..200).map(|i| i % 17).collect();
        let mut r = Router::new(Partition::ByKey("group_id".into()), vec![0, 1, 2], 1);
        let pieces = r.route(groups(ids), "adv").unwrap();
        let mut owner: HashMap<u64, u32> = HashMap::new();
        let mut rows = Vec::new();
        for p in &pieces {
            let g = p
                .data
                .column_by_name("group_id")
                .unwrap()
                .as_primitive::<UInt64Type>();
            let id = p
                .data
                .column_by_name("row_id")
                .unwrap()
                .as_primitive::<UInt64Type>();
            for i in 0..p.data.num_rows() {
                assert_eq!(
                    *owner.entry(g.value(i)).or_insert(p.dest),
                    p.dest,
                    "group {} split",
                    g.value(i)
                );
                rows.push(id.value(i));
            }
        }
        rows.sort_unstable();
        assert_eq!(rows, (0..200).collect::<Vec<_>>());
        assert!(
            owner
                .values()
                .collect::<std::collections::HashSet<_>>()
                .len()
                > 1,
            "all groups on one worker"
        );
    }

    #[test]
    fn by_key_hash_is_the_same_for_equal_strings() {
        let batch = RecordBatch::try_from_iter([(
            "prompt",
            Arc::new(StringArray::from(vec!["a", "b", "a", "c", "a"])) as ArrayRef,
        )])
        .unwrap();
        let mut r = Router::new(Partition::ByKey("prompt".into()), vec![0, 1, 2, 3], 0);
        let pieces = r.route(batch, "s").unwrap();
        let with_a: Vec<_> = pieces
            .iter()
            .filter(|p| {
                p.data
                    .column(0)
                    .as_string::<i32>()
                    .iter()
                    .any(|v| v == Some("a"))
            })
            .collect();
        assert_eq!(with_a.len(), 1);
        assert_eq!(
            with_a[0]
                .data
                .column(0)
                .as_string::<i32>()
                .iter()
                .filter(|v| *v == Some("a"))
                .count(),
            3
        );
    }

    #[test]
    fn by_key_names_a_missing_or_unsuitable_column() {
        let mut r = Router::new(Partition::ByKey("nope".into()), vec![0, 1], 0);
        let err = r
            .route(groups(vec![1]), "advantage")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`nope`") && err.contains("`advantage`"),
            "{err}"
        );
    }

    #[test]
    fn local_requires_colocation() {
        assert!(check_local(&Partition::Local, &[0, 1], &[0, 1, 2], "s").is_ok());
        assert!(check_local(&Partition::Local, &[3], &[0, 1], "s")
            .unwrap_err()
            .to_string()
            .contains("worker 3"));
    }
}
