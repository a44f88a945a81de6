//! State kept across batches by a stateful operator, as the stores hold it.
//!
//! An operator's state moves in versions, one per batch: version N is the state
//! after batch N, durable before commit N is written, and replaying batch N
//! starts from version N-1. Each version is a file of its own: a delta (what batch
//! N changed) or a snapshot (all of it), written every
//! [`SNAPSHOT_EVERY`] versions so that a restart reads a bounded number of files.
//! The encoding of a file is its [`StatefulOperator`]'s; the stores keep bytes.
//!
//! An operator's keys are split into state partitions by a hash of the key, as
//! Spark splits them by its shuffle partitions, so that no single file or
//! Cassandra partition holds all of a large state. Every batch writes a delta for
//! every partition (an empty one where no key of it changed), so that each
//! partition's versions stay contiguous.
//!
//! Only the deltas are on the way to a commit. A snapshot repeats what the deltas
//! before it hold, so it is written after the batch's commit, as Spark's
//! maintenance task writes them: one that is lost to a crash costs a restart a
//! few more deltas to read, never data.

use crate::BatchId;

/// How many versions apart snapshots are written.
pub const SNAPSHOT_EVERY: u64 = 10;

/// Whether a snapshot of the state after `batch` is due.
pub fn snapshot_due(batch: BatchId) -> bool {
    (batch.0 + 1).is_multiple_of(SNAPSHOT_EVERY)
}

/// An operator that keeps state between batches (an aggregation's groups, a
/// join's buffered rows, a dedupe set), as the executor's checkpoint sees it.
/// `E` is the error of the processor that runs it.
///
/// Contract: the executor asks for the batch's [`delta`](Self::delta) once the
/// processor has finished the batch, makes it durable, then calls
/// [`commit`](Self::commit); the next batch starts from the committed state. A
/// batch begun again before its commit starts from the same committed state. The
/// encoding of the files is the operator's: the executor names and stores them,
/// and hands them back as written.
pub trait StatefulOperator<E>: Send {
    /// Its name in progress reports, as Spark names the operator
    /// (`stateStoreSave`, `dedupe`).
    fn name(&self) -> &str;

    /// How many partitions its keys are split into: fixed for a checkpoint, as
    /// the stored state is split so.
    fn partitions(&self) -> u32;

    /// What the batch just finished changed: one file per partition, in
    /// partition order (an empty change where no key of a partition changed, so
    /// that each partition's versions stay contiguous). Empty when no batch has
    /// finished since the last commit.
    fn delta(&self) -> Result<Vec<Vec<u8>>, E>;

    /// The whole committed state, one file per partition in partition order.
    fn snapshot(&self) -> Result<Vec<Vec<u8>>, E>;

    /// Sets the committed state from stored files: for each partition its
    /// snapshot and the deltas after it, all ordered by version. No files is the
    /// empty state.
    fn restore(&mut self, files: &[StateFile]) -> Result<(), E>;

    /// Makes the finished batch's state the one the next batch starts from:
    /// its delta is durable.
    fn commit(&mut self);

    /// Whether it holds state that a later watermark alone would emit or drop,
    /// so that a batch without new data is worth running once the watermark
    /// moves: Spark's no-data batch.
    fn waits_for_watermark(&self) -> bool;

    /// What it held after the batch just finished, for its progress report.
    fn stats(&self) -> StateOperatorStats;
}

/// Whether a state file holds a batch's changes or the whole state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StateFileKind {
    /// What the batch changed.
    Delta,
    /// The whole state after the batch.
    Snapshot,
}

impl StateFileKind {
    /// The file name's extension, as in Spark's state layout.
    pub fn extension(self) -> &'static str {
        match self {
            StateFileKind::Delta => "delta",
            StateFileKind::Snapshot => "snapshot",
        }
    }

    /// The kind named by `extension`.
    pub fn from_extension(extension: &str) -> Option<StateFileKind> {
        match extension {
            "delta" => Some(StateFileKind::Delta),
            "snapshot" => Some(StateFileKind::Snapshot),
            _ => None,
        }
    }
}

/// Which state file of an operator: its partition, version and kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StateFileId {
    /// The state partition, numbered from 0.
    pub partition: u32,
    /// The batch whose state it is.
    pub version: BatchId,
    /// A delta or a snapshot.
    pub kind: StateFileKind,
}

/// One stored version of an operator's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateFile {
    /// The operator, numbered from 0 in the query.
    pub operator: u32,
    /// The state partition: which keys it holds.
    pub partition: u32,
    /// The batch whose state it is.
    pub version: BatchId,
    /// A delta or a snapshot.
    pub kind: StateFileKind,
    /// Its contents, as the processor encoded them. An empty snapshot is the
    /// empty state, as `offsets set --reset-state` writes it.
    pub bytes: Vec<u8>,
    /// Where it is stored (a path, a table and key), for messages; empty for one
    /// not yet written.
    pub location: String,
}

/// Which files rebuild `version` from what is stored: the newest snapshot at or
/// before it, then every delta after that snapshot up to it, in order. `None`
/// when a version in between is missing (or nothing was stored), with the first
/// missing one.
pub fn state_files_to_load(
    stored: &[(BatchId, StateFileKind)],
    version: BatchId,
) -> Result<Vec<(BatchId, StateFileKind)>, BatchId> {
    let snapshot = stored
        .iter()
        .filter(|(v, k)| *k == StateFileKind::Snapshot && *v <= version)
        .map(|(v, _)| *v)
        .max();
    let first_delta = snapshot.map_or(BatchId::FIRST, BatchId::next);
    let mut files: Vec<(BatchId, StateFileKind)> = snapshot
        .map(|v| (v, StateFileKind::Snapshot))
        .into_iter()
        .collect();
    let mut v = first_delta;
    while v <= version {
        if !stored.contains(&(v, StateFileKind::Delta)) {
            return Err(v);
        }
        files.push((v, StateFileKind::Delta));
        v = v.next();
    }
    Ok(files)
}

/// The stored files that no longer matter once batches before `keep_from` are
/// purged: everything older than the newest snapshot that can still rebuild
/// version `keep_from - 1`, the oldest a retained batch can start from.
pub fn state_files_to_purge(
    stored: &[(BatchId, StateFileKind)],
    keep_from: BatchId,
) -> Vec<(BatchId, StateFileKind)> {
    let Some(oldest_needed) = keep_from.0.checked_sub(1).map(BatchId) else {
        return Vec::new();
    };
    let Some(base) = stored
        .iter()
        .filter(|(v, k)| *k == StateFileKind::Snapshot && *v <= oldest_needed)
        .map(|(v, _)| *v)
        .max()
    else {
        return Vec::new();
    };
    stored
        .iter()
        .filter(|(v, k)| *v < base || (*v == base && *k == StateFileKind::Delta))
        .copied()
        .collect()
}

impl StateFile {
    /// The files an operator encoded for `version`, one per partition in
    /// partition order (as [`StatefulOperator::delta`] and
    /// [`StatefulOperator::snapshot`] give them), named for the store.
    pub fn of_operator(
        operator: u32,
        version: BatchId,
        kind: StateFileKind,
        partitions: Vec<Vec<u8>>,
    ) -> Vec<StateFile> {
        partitions
            .into_iter()
            .zip(0..)
            .map(|(bytes, partition)| StateFile {
                operator,
                partition,
                version,
                kind,
                bytes,
                location: String::new(),
            })
            .collect()
    }

    /// Its partition, version and kind.
    pub fn id(&self) -> StateFileId {
        StateFileId {
            partition: self.partition,
            version: self.version,
            kind: self.kind,
        }
    }
}

/// Why the stored state of an operator cannot rebuild a version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateGap {
    /// A file of this partition and version is missing, and no snapshot after it
    /// makes up for it.
    Missing {
        /// The state partition.
        partition: u32,
        /// The first missing version.
        version: BatchId,
    },
    /// The version was written with other partitions than the query has.
    Partitions {
        /// The partitions the stored version has.
        stored: Vec<u32>,
    },
}

/// Which files rebuild `version` of an operator's state in `partitions`
/// partitions, from what is stored: for each partition its newest snapshot at or
/// before the version and the deltas after it, all ordered by version.
pub fn state_files_for(
    stored: &[StateFileId],
    partitions: u32,
    version: BatchId,
) -> Result<Vec<StateFileId>, StateGap> {
    let mut at_version: Vec<u32> = stored
        .iter()
        .filter(|f| f.version == version)
        .map(|f| f.partition)
        .collect();
    at_version.sort_unstable();
    at_version.dedup();
    if !at_version.is_empty() && !at_version.iter().copied().eq(0..partitions) {
        return Err(StateGap::Partitions { stored: at_version });
    }
    let mut files = Vec::new();
    for partition in 0..partitions {
        let mine = of_partition(stored, partition);
        let wanted = state_files_to_load(&mine, version)
            .map_err(|version| StateGap::Missing { partition, version })?;
        files.extend(wanted.into_iter().map(|(version, kind)| StateFileId {
            partition,
            version,
            kind,
        }));
    }
    files.sort_by_key(|f| (f.version, f.kind, f.partition));
    Ok(files)
}

/// The stored files of an operator, in any number of partitions, that no
/// retained batch needs once batches before `keep_from` are purged: each
/// partition's own, by [`state_files_to_purge`].
pub fn state_files_to_purge_in(stored: &[StateFileId], keep_from: BatchId) -> Vec<StateFileId> {
    let mut partitions: Vec<u32> = stored.iter().map(|f| f.partition).collect();
    partitions.sort_unstable();
    partitions.dedup();
    partitions
        .into_iter()
        .flat_map(|partition| {
            state_files_to_purge(&of_partition(stored, partition), keep_from)
                .into_iter()
                .map(move |(version, kind)| StateFileId {
                    partition,
                    version,
                    kind,
                })
        })
        .collect()
}

fn of_partition(stored: &[StateFileId], partition: u32) -> Vec<(BatchId, StateFileKind)> {
    stored
        .iter()
        .filter(|f| f.partition == partition)
        .map(|f| (f.version, f.kind))
        .collect()
}

/// What one stateful operator held after a batch: Spark's `stateOperators`
/// progress entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateOperatorStats {
    /// The operator, as Spark names it (`stateStoreSave`, `dedupe`).
    pub name: String,
    /// Rows (groups) held.
    pub rows_total: u64,
    /// Rows the batch changed.
    pub rows_updated: u64,
    /// Rows the batch removed as final.
    pub rows_removed: u64,
    /// Input rows dropped as later than the watermark.
    pub rows_dropped_by_watermark: u64,
    /// The state's size in memory.
    pub memory_used_bytes: u64,
    /// The most the batch's own structures held beside the state: its
    /// groups, their merged states, its output and its state files. What a
    /// memory budget plans the next batches by.
    pub batch_memory_bytes: u64,
    /// Figures of its own kind, named as Spark names them
    /// (`numDroppedDuplicateRows`), for the report's `customMetrics`.
    pub custom_metrics: Vec<(&'static str, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use StateFileKind::{Delta, Snapshot};

    fn b(v: u64) -> BatchId {
        BatchId(v)
    }

    #[test]
    fn a_version_loads_from_its_newest_snapshot_and_the_deltas_after_it() {
        let stored: Vec<_> = (0..=25)
            .map(|v| (b(v), Delta))
            .chain([(b(10), Snapshot), (b(20), Snapshot)])
            .collect();
        assert_eq!(
            state_files_to_load(&stored, b(23)),
            Ok(vec![
                (b(20), Snapshot),
                (b(21), Delta),
                (b(22), Delta),
                (b(23), Delta)
            ])
        );
        assert_eq!(
            state_files_to_load(&stored, b(20)),
            Ok(vec![(b(20), Snapshot)])
        );
        assert_eq!(
            state_files_to_load(&stored, b(2)),
            Ok(vec![(b(0), Delta), (b(1), Delta), (b(2), Delta)])
        );
        let gap: Vec<_> = stored
            .iter()
            .copied()
            .filter(|f| *f != (b(22), Delta))
            .collect();
        assert_eq!(state_files_to_load(&gap, b(23)), Err(b(22)));
        assert_eq!(state_files_to_load(&[], b(0)), Err(b(0)));
    }

    #[test]
    fn purging_keeps_exactly_what_rebuilds_the_oldest_retained_start() {
        let stored: Vec<_> = (0..=25)
            .map(|v| (b(v), Delta))
            .chain([(b(10), Snapshot), (b(20), Snapshot)])
            .collect();
        // Batches from 22 are kept: version 21 must rebuild, from snapshot 20.
        let purged = state_files_to_purge(&stored, b(22));
        let left: Vec<_> = stored
            .iter()
            .copied()
            .filter(|f| !purged.contains(f))
            .collect();
        assert_eq!(
            state_files_to_load(&left, b(21)),
            Ok(vec![(b(20), Snapshot), (b(21), Delta)])
        );
        assert!(left.iter().all(|(v, _)| *v >= b(20)), "{left:?}");
        assert!(!left.contains(&(b(20), Delta)));
        for keep_from in 0..=26 {
            let purged = state_files_to_purge(&stored, b(keep_from));
            let left: Vec<_> = stored
                .iter()
                .copied()
                .filter(|f| !purged.contains(f))
                .collect();
            for version in keep_from.saturating_sub(1)..=25 {
                assert!(
                    state_files_to_load(&left, b(version)).is_ok(),
                    "{keep_from} {version}"
                );
            }
        }
        // Before the first snapshot nothing can go.
        assert!(state_files_to_purge(&stored, b(9)).is_empty());
    }

    fn id(partition: u32, version: u64, kind: StateFileKind) -> StateFileId {
        StateFileId {
            partition,
            version: b(version),
            kind,
        }
    }

    #[test]
    fn every_partition_rebuilds_from_its_own_snapshot_and_the_files_come_in_version_order() {
        let mut stored: Vec<StateFileId> = (0..3)
            .flat_map(|p| (0..=12).map(move |v| id(p, v, Delta)))
            .collect();
        // Partition 1's snapshot after batch 9 was lost to a crash.
        stored.extend([id(0, 9, Snapshot), id(2, 9, Snapshot)]);
        let files = state_files_for(&stored, 3, b(11)).unwrap();
        assert_eq!(files.first(), Some(&id(1, 0, Delta)));
        assert_eq!(files.iter().filter(|f| f.partition == 1).count(), 12);
        assert_eq!(
            files
                .iter()
                .filter(|f| f.partition == 0)
                .collect::<Vec<_>>(),
            [&id(0, 9, Snapshot), &id(0, 10, Delta), &id(0, 11, Delta)]
        );
        assert!(files.windows(2).all(|w| w[0].version <= w[1].version));

        let gap: Vec<_> = stored
            .iter()
            .copied()
            .filter(|f| *f != id(2, 10, Delta))
            .collect();
        assert_eq!(
            state_files_for(&gap, 3, b(11)),
            Err(StateGap::Missing {
                partition: 2,
                version: b(10)
            })
        );
        // Written with three partitions, asked for with two or four.
        for partitions in [2, 4] {
            assert_eq!(
                state_files_for(&stored, partitions, b(11)),
                Err(StateGap::Partitions {
                    stored: vec![0, 1, 2]
                })
            );
        }
        assert_eq!(
            state_files_for(&[], 2, b(0)),
            Err(StateGap::Missing {
                partition: 0,
                version: b(0)
            })
        );
    }

    #[test]
    fn each_partition_is_purged_to_what_rebuilds_it() {
        let mut stored: Vec<StateFileId> = (0..2)
            .flat_map(|p| (0..=22).map(move |v| id(p, v, Delta)))
            .collect();
        stored.extend([id(0, 9, Snapshot), id(0, 19, Snapshot), id(1, 9, Snapshot)]);
        let purged = state_files_to_purge_in(&stored, b(21));
        let left: Vec<_> = stored
            .iter()
            .copied()
            .filter(|f| !purged.contains(f))
            .collect();
        assert!(left.iter().all(|f| f.partition == 1 || f.version >= b(19)));
        assert!(left.contains(&id(1, 9, Snapshot)) && !left.contains(&id(1, 8, Delta)));
        for version in 20..=22 {
            assert!(state_files_for(&left, 2, b(version)).is_ok(), "{version}");
        }
    }
}
