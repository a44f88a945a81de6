//! The end of a batch: the groups it touched merged with the committed ones,
//! the rows its output mode emits, the groups the watermark closes, and the
//! delta that makes the next version durable. Nothing committed changes here:
//! the next version waits in [`Pending`] until [`Aggregation::commit`], so that
//! a batch begun again starts from the same state.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, new_null_array};
use arrow::datatypes::DataType;
use arrow::row::{RowConverter, SortField};
use datafusion::logical_expr::EmitTo;

use crate::block::{
    ALL_GROUPS, Batch, Block, BlockKey, Change, Layout, NEW, Pending, Touched, take_columns,
    take_rows,
};
use crate::chunks::Chunks;
use crate::error::{execution, internal};
use crate::groups::{OP_REMOVE, OP_REMOVE_WINDOW, OP_WRITE};
use crate::{Aggregation, Encoder, Eviction, OutputMode, StateError, StateStats, window_bounds_ms};

/// A block the batch touched: its groups in the batch's order, their states
/// merged with the committed ones, and the block's state columns after the
/// batch (committed groups, then its new ones).
struct Merged {
    key: BlockKey,
    touched: Touched,
    states: Vec<ArrayRef>,
    after: Chunks,
}

impl Aggregation {
    /// Ends the batch under `watermark_ms`: the rows its output mode emits (in
    /// the aggregate's output schema, a batch per window), and the next
    /// version of the state.
    pub fn finish(&mut self, watermark_ms: i64) -> Result<Vec<RecordBatch>, StateError> {
        let Some(Batch {
            touched,
            states,
            dropped,
            bytes,
        }) = self.take_working()?
        else {
            return Ok(Vec::new());
        };
        let mut merged = Vec::with_capacity(touched.len());
        let mut merged_bytes = 0;
        for (key, touched) in touched {
            let local = take_columns(&states, &touched.batch)?;
            let committed = self.committed.get(&key);
            let (states, after) = match committed {
                Some(block) => {
                    let states = if touched.committed.iter().any(|&c| c != NEW) {
                        self.merge(block, &touched, &local)?
                    } else {
                        local
                    };
                    let (after, made) = after_batch(block, &touched, &states)?;
                    merged_bytes += made;
                    (states, after)
                }
                // A new block's states after the batch are its merged ones.
                None => {
                    let after = Chunks::new(local.clone(), touched.len());
                    (local, after)
                }
            };
            merged_bytes += states
                .iter()
                .map(|a| a.get_array_memory_size())
                .sum::<usize>();
            merged.push(Merged {
                key,
                touched,
                states,
                after,
            });
        }
        drop(states);
        let (output, mut pending) =
            if self.session.is_some() || matches!(self.eviction, Eviction::Time(_)) {
                self.finish_one_by_one(merged, dropped, watermark_ms)?
            } else {
                self.finish_by_block(merged, dropped, watermark_ms)?
            };
        let output_bytes: usize = output.iter().map(|b| b.get_array_memory_size()).sum();
        pending.stats.batch_memory_bytes = bytes
            + (merged_bytes + pending.delta.iter().map(Vec::len).sum::<usize>() + output_bytes)
                as u64;
        self.within_memory(pending.stats.batch_memory_bytes)?;
        pending.stats.memory_used_bytes = self.committed_bytes;
        self.stats = pending.stats;
        self.pending = Some(pending);
        Ok(output)
    }

    /// `touched`'s states merged with the committed states of its groups that
    /// `block` holds.
    fn merge(
        &self,
        block: &Block,
        touched: &Touched,
        local: &[ArrayRef],
    ) -> Result<Vec<ArrayRef>, StateError> {
        let n = touched.len();
        let (held, ids): (Vec<usize>, Vec<u32>) = touched
            .committed
            .iter()
            .enumerate()
            .filter(|(_, c)| **c != NEW)
            .map(|(l, c)| (l, *c))
            .unzip();
        let old = block.states.take(&ids)?;
        let all: Vec<usize> = (0..n).collect();
        let mut merged = Vec::with_capacity(local.len());
        let mut at = 0;
        for (mut accumulator, width) in self.accumulators()?.into_iter().zip(self.state_widths()) {
            let mut merge = |states: &[ArrayRef], groups: &[usize]| {
                accumulator
                    .merge_batch(states, groups, n)
                    .map_err(|e| internal("merging a batch into the state", e))
            };
            // The committed state first, as if the batch's rows came after it.
            merge(&old[at..at + width], &held)?;
            merge(&local[at..at + width], &all)?;
            merged.extend(
                accumulator
                    .state(EmitTo::All)
                    .map_err(|e| internal("merging a batch into the state", e))?,
            );
            at += width;
        }
        Ok(merged)
    }

    /// A block the watermark has closed: every group of a window whose end it
    /// reached. Never one whose groups are not kept by window.
    fn closes(&self, key: &BlockKey, watermark_ms: i64) -> bool {
        matches!(self.layout, Layout::Windows(_)) && key.1 <= watermark_ms
    }

    /// The groups a touched block changed: all of them, but for an
    /// aggregation without aggregates (a dedupe) only its new ones.
    fn changed(&self, touched: &Touched) -> Vec<u32> {
        if self.parts.aggregates.is_empty() {
            touched.new_groups().collect()
        } else {
            (0..touched.len() as u32).collect()
        }
    }

    /// Hands `each` the block `key` after the batch as tables of the state's
    /// schema, a chunk of its states at a time.
    fn for_each_table_after(
        &self,
        key: BlockKey,
        merged: Option<&Merged>,
        each: impl FnMut(RecordBatch) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        let committed = self.committed.get(&key);
        let Some(merged) = merged else {
            let block = committed.ok_or_else(|| internal("the state", "a block of no groups"))?;
            return self.for_each_table(key, block.keys.iter(), &block.states, each);
        };
        let touched = &merged.touched;
        let keys = committed
            .into_iter()
            .flat_map(|b| b.keys.iter())
            .chain(touched.new_groups().map(|l| touched.keys.key(l)));
        self.for_each_table(key, keys, &merged.after, each)
    }

    /// The block `key` after the batch, as one table of the state's schema.
    fn table_after(
        &self,
        key: BlockKey,
        merged: Option<&Merged>,
    ) -> Result<RecordBatch, StateError> {
        let mut tables = Vec::new();
        self.for_each_table_after(key, merged, |table| {
            tables.push(table);
            Ok(())
        })?;
        arrow::compute::concat_batches(&self.state_schema, &tables)
            .map_err(|e| internal("the state's groups", e))
    }

    /// The rows `groups` of a touched block, with their merged states.
    fn touched_table(&self, merged: &Merged, groups: &[u32]) -> Result<RecordBatch, StateError> {
        let touched = &merged.touched;
        let keys = groups.iter().map(|&l| touched.keys.key(l));
        let keys = self.key_columns(merged.key, keys, groups.len())?;
        self.state_table(keys, take_columns(&merged.states, groups)?)
    }

    /// The end of a batch whose groups leave window by window, or never.
    fn finish_by_block(
        &self,
        merged: Vec<Merged>,
        dropped: u64,
        watermark_ms: i64,
    ) -> Result<(Vec<RecordBatch>, Pending), StateError> {
        let mut stats = StateStats {
            rows_dropped_by_watermark: dropped,
            ..StateStats::default()
        };
        for (key, block) in &self.committed {
            let n = block.keys.len() as u64;
            if self.closes(key, watermark_ms) {
                stats.rows_removed += n;
            } else {
                stats.rows_total += n;
            }
        }
        for m in &merged {
            let new = m.touched.new_groups().count();
            if self.closes(&m.key, watermark_ms) {
                stats.rows_removed += new as u64;
            } else {
                stats.rows_total += new as u64;
                stats.rows_updated += self.changed(&m.touched).len() as u64;
                if let Some(block) = self.committed.get(&m.key) {
                    let bytes = m.touched.new_groups().map(|l| m.touched.keys.key(l).len());
                    if !block.keys.fits(new, bytes.sum()) {
                        return Err(internal("the state", "a window's keys pass 4 GiB"));
                    }
                }
            }
        }
        if stats.rows_total > self.max_rows {
            return Err(StateError::TooLarge {
                rows: stats.rows_total,
                limit: self.max_rows,
            });
        }
        let by_key: BTreeMap<BlockKey, &Merged> = merged.iter().map(|m| (m.key, m)).collect();
        let every: BTreeSet<BlockKey> = self
            .committed
            .keys()
            .chain(by_key.keys())
            .copied()
            .collect();
        // Evaluated window by window and chunk by chunk, so that no table of
        // every emitted group's states is made beside their output.
        let mut output = Vec::new();
        match self.mode {
            OutputMode::Append | OutputMode::Complete => {
                for key in &every {
                    if self.mode == OutputMode::Complete || self.closes(key, watermark_ms) {
                        self.for_each_table_after(*key, by_key.get(key).copied(), |table| {
                            output.push(self.evaluate(&table)?);
                            Ok(())
                        })?;
                    }
                }
            }
            OutputMode::Update => {
                for m in &merged {
                    let changed = self.changed(&m.touched);
                    if !changed.is_empty() {
                        output.push(self.evaluate(&self.touched_table(m, &changed)?)?);
                    }
                }
            }
        }

        // Windows the watermark closed go as one row each, before the groups
        // the batch wrote: a window of millions of groups costs its file a row,
        // not a key per group.
        let mut delta = self.delta_files()?;
        let closed: Vec<BlockKey> = self
            .committed
            .keys()
            .filter(|key| self.closes(key, watermark_ms))
            .copied()
            .collect();
        self.write_closed_windows(&mut delta, &closed)?;
        for m in &merged {
            if !self.closes(&m.key, watermark_ms) {
                let written = self.touched_table(m, &self.changed(&m.touched))?;
                self.write_delta(&mut delta, OP_WRITE, &written)?;
            }
        }
        let delta = finish_files(delta)?;
        let stays = merged
            .into_iter()
            .filter(|m| !self.closes(&m.key, watermark_ms))
            .map(|m| (m.key, m.touched, m.after))
            .collect();
        let pending = Pending {
            change: Change::Merge { closed, stays },
            delta,
            stats,
        };
        Ok((output, pending))
    }

    /// The end of a batch whose groups close one by one (by their event time)
    /// or merge (sessions): the one block is rebuilt from its groups after
    /// the batch.
    fn finish_one_by_one(
        &self,
        merged: Vec<Merged>,
        dropped: u64,
        watermark_ms: i64,
    ) -> Result<(Vec<RecordBatch>, Pending), StateError> {
        let merged = merged.into_iter().find(|m| m.key == ALL_GROUPS);
        let committed = self.committed.get(&ALL_GROUPS);
        let table = match (&merged, committed) {
            (None, None) => RecordBatch::new_empty(self.state_schema.clone()),
            (merged, _) => self.table_after(ALL_GROUPS, merged.as_ref())?,
        };
        let held = committed.map_or(0, |b| b.keys.len());
        let mut updated = vec![false; held];
        if let Some(m) = &merged {
            for l in self.changed(&m.touched) {
                match m.touched.committed[l as usize] {
                    NEW => {}
                    c => updated[c as usize] = true,
                }
            }
            updated.extend(m.touched.new_groups().map(|_| true));
        }
        let (table, updated) = match self.session {
            Some(window) => self.merge_sessions(&table, &updated, window)?,
            None => (table, updated),
        };
        let n = table.num_rows();
        let closed: Vec<bool> = match self.eviction {
            Eviction::Never => vec![false; n],
            Eviction::Window(i) => {
                let ends = window_bounds_ms(table.column(i).as_ref(), 1)?;
                ends.iter()
                    .map(|end| end.is_some_and(|end| end <= watermark_ms))
                    .collect()
            }
            Eviction::Time(i) => {
                let times = crate::epoch_millis(table.column(i)).map_err(execution)?;
                times
                    .iter()
                    .map(|t| t.is_some_and(|t| t < watermark_ms))
                    .collect()
            }
        };
        let emit: Vec<u32> = (0..n)
            .filter(|&g| match self.mode {
                OutputMode::Append => closed[g],
                OutputMode::Update => updated[g],
                OutputMode::Complete => true,
            })
            .map(|g| g as u32)
            .collect();
        let keep: Vec<u32> = (0..n).filter(|&g| !closed[g]).map(|g| g as u32).collect();
        if keep.len() as u64 > self.max_rows {
            return Err(StateError::TooLarge {
                rows: keep.len() as u64,
                limit: self.max_rows,
            });
        }
        let output = vec![self.evaluate(&take_rows(&table, &emit)?)?];
        let kept = take_rows(&table, &keep)?;
        let blocks = self.blocks_of(&kept)?;
        let changed: Vec<u32> = keep
            .iter()
            .enumerate()
            .filter(|(_, old)| updated[**old as usize])
            .map(|(new, _)| new as u32)
            .collect();
        let mut delta = self.delta_files()?;
        self.write_delta(&mut delta, OP_WRITE, &take_rows(&kept, &changed)?)?;
        if let Some(block) = committed {
            let after = blocks.get(&ALL_GROUPS);
            let gone: Vec<&[u8]> = block
                .keys
                .iter()
                .filter(|key| {
                    after.is_none_or(|b| b.keys.find(self.hasher.hash(key), key).is_none())
                })
                .collect();
            let count = gone.len();
            let keys = self.key_columns(ALL_GROUPS, gone.into_iter(), count)?;
            self.write_delta(&mut delta, OP_REMOVE, &self.without_states(keys)?)?;
        }
        let delta = finish_files(delta)?;
        let stats = StateStats {
            rows_total: kept.num_rows() as u64,
            rows_updated: changed.len() as u64,
            rows_removed: (n - keep.len()) as u64,
            rows_dropped_by_watermark: dropped,
            ..StateStats::default()
        };
        let pending = Pending {
            change: Change::Replace(blocks),
            delta,
            stats,
        };
        Ok((output, pending))
    }

    /// An encoder for each partition's delta file.
    fn delta_files(&self) -> Result<Vec<Encoder>, StateError> {
        (0..self.partitions())
            .map(|_| Encoder::new(&self.file_schema))
            .collect()
    }

    /// Writes `table`'s groups, a table of the state's schema, to the
    /// partitions' files, each row as `op`.
    fn write_delta(
        &self,
        files: &mut [Encoder],
        op: i8,
        table: &RecordBatch,
    ) -> Result<(), StateError> {
        if table.num_rows() == 0 {
            return Ok(());
        }
        let file = self.file_table(op, table)?;
        let parts = self.split_by_partition(&file, self.partitions())?;
        for (file, part) in files.iter_mut().zip(&parts) {
            if part.num_rows() > 0 {
                file.write(part)?;
            }
        }
        Ok(())
    }

    /// Writes the windows `closed` to every partition's file, a row each, as
    /// every partition may hold groups of them.
    fn write_closed_windows(
        &self,
        files: &mut [Encoder],
        closed: &[BlockKey],
    ) -> Result<(), StateError> {
        let Layout::Windows(i) = self.layout else {
            return Ok(());
        };
        if closed.is_empty() {
            return Ok(());
        }
        let mut keys: Vec<ArrayRef> = self.state_schema.fields()[..self.parts.group_exprs.len()]
            .iter()
            .map(|f| new_null_array(f.data_type(), closed.len()))
            .collect();
        keys[i] = self.windows_column(closed)?;
        let file = self.file_table(OP_REMOVE_WINDOW, &self.without_states(keys)?)?;
        for file_of_partition in files.iter_mut() {
            file_of_partition.write(&file)?;
        }
        Ok(())
    }

    /// A table of the state's schema of the groups `keys`, without states.
    fn without_states(&self, keys: Vec<ArrayRef>) -> Result<RecordBatch, StateError> {
        let rows = keys.first().map_or(0, |c| c.len());
        let states = self.state_schema.fields()[keys.len()..]
            .iter()
            .map(|f| new_null_array(f.data_type(), rows))
            .collect();
        self.state_table(keys, states)
    }

    /// Makes a finished batch's change to the blocks.
    pub(crate) fn apply(&mut self, change: Change) {
        match change {
            Change::Replace(blocks) => self.committed = blocks,
            Change::Merge { closed, stays } => {
                for key in closed {
                    self.committed.remove(&key);
                }
                for (key, touched, after) in stays {
                    match self.committed.get_mut(&key) {
                        Some(block) => {
                            for l in touched.new_groups() {
                                let k = touched.keys.key(l);
                                block
                                    .keys
                                    .push_fitting(&self.hasher, self.hasher.hash(k), k);
                            }
                            block.states = after;
                        }
                        None => {
                            self.committed.insert(
                                key,
                                Block {
                                    keys: touched.keys,
                                    states: after,
                                },
                            );
                        }
                    }
                }
            }
        }
    }

    /// Merges each key's session windows that overlap into one, with their
    /// states merged, as Spark's session windows do.
    fn merge_sessions(
        &self,
        table: &RecordBatch,
        updated: &[bool],
        window: usize,
    ) -> Result<(RecordBatch, Vec<bool>), StateError> {
        let n = table.num_rows();
        let starts = window_bounds_ms(table.column(window).as_ref(), 0)?;
        let ends = window_bounds_ms(table.column(window).as_ref(), 1)?;
        // The other keys, to tell the sessions of one key from another's.
        let others: Vec<ArrayRef> = table.columns()[..self.parts.group_exprs.len()]
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != window)
            .map(|(_, c)| c.clone())
            .collect();
        let others_fields = others
            .iter()
            .map(|c| SortField::new(c.data_type().clone()))
            .collect();
        let converter = RowConverter::new(others_fields).map_err(|e| internal("keys", e))?;
        let other_rows = converter
            .convert_columns(&others)
            .map_err(|e| internal("keys", e))?;
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|a, b| {
            other_rows
                .row(*a)
                .cmp(&other_rows.row(*b))
                .then(starts.value(*a).cmp(&starts.value(*b)))
        });
        // Each group's session, and each session's first group and bounds.
        let mut session_of = vec![0_usize; n];
        let mut sessions: Vec<(usize, i64, i64, bool)> = Vec::new();
        for &g in &order {
            let (start, end) = (starts.value(g), ends.value(g));
            match sessions.last_mut() {
                Some((first, _, last_end, changed))
                    if other_rows.row(*first) == other_rows.row(g) && start <= *last_end =>
                {
                    *last_end = (*last_end).max(end);
                    *changed |= updated[g];
                }
                _ => sessions.push((g, start, end, updated[g])),
            }
            session_of[g] = sessions.len() - 1;
        }
        if sessions.len() == n {
            return Ok((table.clone(), updated.to_vec()));
        }
        let firsts: Vec<u32> = sessions.iter().map(|s| s.0 as u32).collect();
        let mut keys: Vec<ArrayRef> =
            take_rows(table, &firsts)?.columns()[..self.parts.group_exprs.len()].to_vec();
        let time_type = match table.column(window).data_type() {
            DataType::Struct(fields) => fields[0].data_type().clone(),
            other => return Err(internal("a session window", other)),
        };
        let bounds = |values: Vec<Option<i64>>| -> Result<ArrayRef, StateError> {
            crate::from_epoch_millis(values.into(), &time_type).map_err(execution)
        };
        let fields = match table.column(window).data_type() {
            DataType::Struct(fields) => fields.clone(),
            other => return Err(internal("a session window", other)),
        };
        keys[window] = Arc::new(
            arrow::array::StructArray::try_new(
                fields,
                vec![
                    bounds(sessions.iter().map(|s| Some(s.1)).collect())?,
                    bounds(sessions.iter().map(|s| Some(s.2)).collect())?,
                ],
                None,
            )
            .map_err(execution)?,
        );
        let mut accumulators = self.accumulators()?;
        let mut at = self.parts.group_exprs.len();
        for (accumulator, width) in accumulators.iter_mut().zip(self.state_widths()) {
            accumulator
                .merge_batch(
                    &table.columns()[at..at + width],
                    &session_of,
                    sessions.len(),
                )
                .map_err(|e| internal("merging sessions", e))?;
            at += width;
        }
        let mut columns = keys;
        for accumulator in &mut accumulators {
            columns.extend(
                accumulator
                    .state(EmitTo::All)
                    .map_err(|e| internal("merging sessions", e))?,
            );
        }
        let merged = RecordBatch::try_new(self.state_schema.clone(), columns)
            .map_err(|e| internal("merging sessions", e))?;
        Ok((merged, sessions.iter().map(|s| s.3).collect()))
    }
}

/// The block's state columns after the batch: its committed groups, those the
/// batch touched with their merged `states`, then the batch's new groups; and
/// the bytes of the chunks that made.
fn after_batch(
    block: &Block,
    touched: &Touched,
    states: &[ArrayRef],
) -> Result<(Chunks, usize), StateError> {
    let replaced: Vec<(u32, u32)> = touched
        .committed
        .iter()
        .enumerate()
        .filter(|(_, c)| **c != NEW)
        .map(|(l, c)| (*c, l as u32))
        .collect();
    let appended: Vec<u32> = touched.new_groups().collect();
    block.states.after(&replaced, states, &appended)
}

/// The bytes of each partition's delta file.
fn finish_files(files: Vec<Encoder>) -> Result<Vec<Vec<u8>>, StateError> {
    files.into_iter().map(Encoder::finish).collect()
}
