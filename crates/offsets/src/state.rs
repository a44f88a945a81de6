//! State kept across batches by a stateful operator, as the stores hold it.
//!
//! An operator's state moves in versions, one per batch: version N is the state
//! after batch N, durable before commit N is written, and replaying batch N
//! starts from version N-1. Each version is a file of its own: a delta (what batch
//! N changed) or a snapshot (all of it), written every
//! [`SNAPSHOT_EVERY`] versions so that a restart reads a bounded number of files.
//! The encoding of a file is the processor's; the stores keep bytes.

use crate::BatchId;

/// How many versions apart snapshots are written.
pub const SNAPSHOT_EVERY: u64 = 10;

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

/// One stored version of an operator's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateFile {
    /// The operator, numbered from 0 in the query.
    pub operator: u32,
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
}
