//! The shapes state is kept in: committed blocks of groups, the groups a
//! batch touched in each, and what a finished batch leaves until its commit.

use std::collections::BTreeMap;

use arrow::array::{ArrayRef, RecordBatch, UInt32Array};

use crate::StateError;
use crate::chunks::Chunks;
use crate::error::internal;
use crate::keys::Keys;

/// Counts of a batch's state, for its progress report (Spark's
/// `stateOperators` entry).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Groups held after the batch.
    pub rows_total: u64,
    /// Groups the batch changed.
    pub rows_updated: u64,
    /// Groups the batch removed, as final.
    pub rows_removed: u64,
    /// Input rows dropped as later than the watermark.
    pub rows_dropped_by_watermark: u64,
    /// The state's size in memory, in bytes.
    pub memory_used_bytes: u64,
    /// The most bytes the batch's own structures held beside the state.
    pub batch_memory_bytes: u64,
}

/// Which groups a block holds: those of one window (its start and end, in
/// epoch milliseconds), when groups leave the state window by window; else
/// every group, in the one block [`ALL_GROUPS`].
pub(crate) type BlockKey = (i64, i64);

/// The block of an aggregation whose groups are not kept by window.
pub(crate) const ALL_GROUPS: BlockKey = (i64::MIN, i64::MIN);

/// A group the batch touched that the committed state does not hold.
pub(crate) const NEW: u32 = u32::MAX;

/// How groups are kept in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// A block per window; the window key (at this index) is the block's, and
    /// the keys in the block are the other group keys.
    Windows(usize),
    /// One block of every group, with every group key.
    One,
}

/// The committed groups of one block: their keys and each aggregate's state
/// columns, group `g` at row `g`.
#[derive(Clone)]
pub(crate) struct Block {
    pub(crate) keys: Keys,
    pub(crate) states: Chunks,
}

impl Block {
    pub(crate) fn memory_size(&self) -> usize {
        self.keys.memory_size() + self.states.memory_size()
    }
}

/// The groups of one block that a batch touched, numbered in the order it
/// touched them.
#[derive(Default)]
pub(crate) struct Touched {
    pub(crate) keys: Keys,
    /// Each one's group among the batch's accumulators.
    pub(crate) batch: Vec<u32>,
    /// Each one's group in the committed block, or [`NEW`].
    pub(crate) committed: Vec<u32>,
}

/// A batch taken out to finish it.
pub(crate) struct Batch {
    /// The groups it touched, block by block.
    pub(crate) touched: BTreeMap<BlockKey, Touched>,
    /// Each aggregate's state of the groups it touched, each aggregate's
    /// columns one after the other, the batch's group `g` at row `g`.
    pub(crate) states: Vec<ArrayRef>,
    /// Its rows dropped as late.
    pub(crate) dropped: u64,
    /// The bytes its groups and accumulators held.
    pub(crate) bytes: u64,
}

/// What a finished batch leaves, until it is committed.
pub(crate) struct Pending {
    pub(crate) change: Change,
    /// Each partition's delta file.
    pub(crate) delta: Vec<Vec<u8>>,
    pub(crate) stats: StateStats,
}

/// How the committed blocks become the next version.
pub(crate) enum Change {
    /// The blocks `closed` leave; each touched block that stays takes its
    /// state columns after the batch, and its new groups' keys.
    Merge {
        closed: Vec<BlockKey>,
        stays: Vec<(BlockKey, Touched, Chunks)>,
    },
    /// The blocks are replaced (a state whose groups merge or close one by one).
    Replace(BTreeMap<BlockKey, Block>),
}

impl Touched {
    pub(crate) fn len(&self) -> usize {
        self.committed.len()
    }

    /// Its groups the committed block does not hold, in order.
    pub(crate) fn new_groups(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len() as u32).filter(|&l| self.committed[l as usize] == NEW)
    }
}

/// The rows `rows` of each column.
pub(crate) fn take_columns(
    columns: &[ArrayRef],
    rows: &[u32],
) -> Result<Vec<ArrayRef>, StateError> {
    let indices = UInt32Array::from(rows.to_vec());
    columns
        .iter()
        .map(|c| arrow::compute::take(c, &indices, None).map_err(|e| internal("taking groups", e)))
        .collect()
}

pub(crate) fn take_rows(table: &RecordBatch, rows: &[u32]) -> Result<RecordBatch, StateError> {
    let indices = UInt32Array::from(rows.to_vec());
    arrow::compute::take_record_batch(table, &indices).map_err(|e| internal("taking groups", e))
}
