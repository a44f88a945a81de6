//! Aggregation across batches, on DataFusion's own partial aggregation states.
//!
//! DataFusion plans the query's aggregate as usual. Everything below it runs on
//! each chunk; its groups are kept here, across batches, as the partial `state`
//! of DataFusion's [`GroupsAccumulator`]s. At the end of a batch the groups the
//! output mode names are evaluated, and everything above the aggregate (HAVING,
//! the SELECT list) runs over them. No accumulator is our own: `count`, `sum`,
//! `avg`, `count(DISTINCT)`, `approx_distinct` and every other aggregate whose
//! partial state merges work the same way.
//!
//! The committed groups are kept in blocks, one per window when groups leave
//! the state window by window: a block's keys are packed in one buffer
//! ([`Keys`]) and its states are Arrow arrays, a row per group, so that a group
//! costs tens of bytes and a window the watermark closes is freed whole. A batch
//! aggregates its rows into accumulators of its own, holding only the groups it
//! touched, and [`Aggregation::finish`] merges them with the committed states
//! of the same groups. The next version waits until [`Aggregation::commit`],
//! once it is durable, so that a batch begun again starts from the same state
//! and gives the same output.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Int8Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, FieldRef, Schema, SchemaRef};
use arrow::row::{RowConverter, SortField};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::GroupsAccumulatorAdapter;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_plan::PhysicalExpr;

use crate::StateError;
use crate::block::{
    ALL_GROUPS, Batch, Block, BlockKey, Layout, NEW, Pending, StateStats, Touched, take_rows,
};
use crate::chunks::Chunks;
use crate::error::{execution, internal};
use crate::keys::{KeyHasher, Keys};

/// When a group's row is emitted: Spark's output modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputMode {
    /// Once, when the watermark passes its window's end, so that it is final.
    Append,
    /// Every batch that changed it.
    Update,
    /// Every group, every batch.
    Complete,
}

impl OutputMode {
    /// The mode's name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            OutputMode::Append => "append",
            OutputMode::Update => "update",
            OutputMode::Complete => "complete",
        }
    }
}

/// Which group key decides when a group is final and leaves the state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// None: groups stay for ever.
    Never,
    /// The window key at this index: a group is final when the watermark reaches
    /// its window's end.
    Window(usize),
    /// The event-time key at this index (DISTINCT over keys and event time): a
    /// group is final when the watermark passes its time.
    Time(usize),
}

/// The aggregate as DataFusion planned it, taken apart.
pub struct AggregateParts {
    pub group_exprs: Vec<(Arc<dyn PhysicalExpr>, String)>,
    pub aggregates: Vec<Arc<AggregateFunctionExpr>>,
    pub filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// The schema of the aggregate's output: the group keys, then each
    /// aggregate's value.
    pub output: SchemaRef,
    /// The schema of the rows the aggregate reads.
    pub input: SchemaRef,
}

/// The batch in progress: what it touched, block by block, and its own
/// accumulators, holding only what the batch's rows added.
struct Working {
    blocks: BTreeMap<BlockKey, Touched>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    groups: usize,
    dropped: u64,
    /// The bytes it holds, after its last chunk.
    bytes: u64,
}

impl Working {
    fn memory_size(&self) -> u64 {
        let touched: usize = self
            .blocks
            .values()
            .map(|t| {
                t.keys.memory_size()
                    + (t.batch.capacity() + t.committed.capacity()) * size_of::<u32>()
            })
            .sum();
        let accumulators: usize = self.accumulators.iter().map(|a| a.size()).sum();
        (touched + accumulators) as u64
    }
}

/// Group keys of one chunk's rows, in a block's row format: none when the
/// block's groups have no key of their own (a window is the only key).
enum ChunkKeys {
    Rows(arrow::row::Rows),
    Empty,
}

impl ChunkKeys {
    fn get(&self, row: usize) -> &[u8] {
        match self {
            ChunkKeys::Rows(rows) => rows.row(row).data(),
            ChunkKeys::Empty => &[],
        }
    }
}

/// A stateful aggregation over the stream.
pub struct Aggregation {
    pub(crate) parts: AggregateParts,
    pub(crate) mode: OutputMode,
    pub(crate) eviction: Eviction,
    pub(crate) session: Option<usize>,
    pub(crate) layout: Layout,
    /// Every group key, for state files and their partitions.
    pub(crate) converter: RowConverter,
    /// The keys within a block; `None` when there are none.
    pub(crate) block_converter: Option<RowConverter>,
    pub(crate) hasher: KeyHasher,
    /// Keys, then state columns, all nullable.
    pub(crate) state_schema: SchemaRef,
    /// `state_schema` behind an `op` column: 0 for a group written, 1 for one
    /// removed. Deltas and snapshots are tables of this schema.
    pub(crate) file_schema: SchemaRef,
    pub(crate) committed: BTreeMap<BlockKey, Block>,
    /// In a mutex only so that the query can be shared while a chunk runs;
    /// it is reached through `&mut self`, without locking.
    working: Mutex<Option<Working>>,
    pub(crate) pending: Option<Pending>,
    pub(crate) stats: StateStats,
    /// `[query] max_state_rows`.
    pub(crate) max_rows: u64,
    /// How many partitions its state files are split into.
    partitions: u32,
    /// `[query] state_memory_mb`, in bytes: the most the state and a batch's
    /// own structures may hold.
    memory_limit: u64,
    /// The committed blocks' bytes.
    pub(crate) committed_bytes: u64,
}

impl std::fmt::Debug for Aggregation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregation")
            .field("mode", &self.mode)
            .field("eviction", &self.eviction)
            .field("layout", &self.layout)
            .field("blocks", &self.committed.len())
            .finish_non_exhaustive()
    }
}

/// The name of the column in state files that says whether a row writes or
/// removes its group.
const OP_COLUMN: &str = "op";
pub(crate) const OP_WRITE: i8 = 0;
pub(crate) const OP_REMOVE: i8 = 1;
/// Removes every group of the row's window, whose other keys and states are
/// null. A file's window removals come before its other rows.
pub(crate) const OP_REMOVE_WINDOW: i8 = 2;

impl Aggregation {
    /// An aggregation over `parts`, emitting by `mode`; `session` is the window
    /// key's index when it is a session window, whose groups merge.
    pub fn new(
        parts: AggregateParts,
        mode: OutputMode,
        eviction: Eviction,
        session: Option<usize>,
        max_rows: u64,
    ) -> Result<Aggregation, StateError> {
        let mut fields: Vec<FieldRef> = Vec::new();
        let mut sort = Vec::new();
        for (expr, name) in &parts.group_exprs {
            let data_type = expr
                .data_type(&parts.input)
                .map_err(|e| internal("typing a group key", e))?;
            sort.push(SortField::new(data_type.clone()));
            fields.push(Arc::new(Field::new(name, data_type, true)));
        }
        for (i, aggregate) in parts.aggregates.iter().enumerate() {
            for field in aggregate
                .state_fields()
                .map_err(|e| internal("the state of an aggregate", e))?
            {
                // Prefixed, as two aggregates may name their states alike.
                fields.push(Arc::new(Field::new(
                    format!("{i}:{}", field.name()),
                    field.data_type().clone(),
                    true,
                )));
            }
        }
        // A session's groups merge with others of their key, and an event-time
        // key closes group by group: those keep every group in one block.
        let layout = match (eviction, session) {
            (Eviction::Window(i), None) => Layout::Windows(i),
            _ => Layout::One,
        };
        let block_sort: Vec<SortField> = sort
            .iter()
            .enumerate()
            .filter(|(i, _)| layout != Layout::Windows(*i))
            .map(|(_, field)| field.clone())
            .collect();
        let block_converter = if block_sort.is_empty() {
            None
        } else {
            Some(RowConverter::new(block_sort).map_err(|e| internal("group keys", e))?)
        };
        let converter = RowConverter::new(sort).map_err(|e| internal("group keys", e))?;
        let state_schema = Arc::new(Schema::new(fields.clone()));
        let mut file_fields = vec![Arc::new(Field::new(OP_COLUMN, DataType::Int8, false))];
        file_fields.extend(fields);
        let file_schema = Arc::new(Schema::new(file_fields));
        Ok(Aggregation {
            parts,
            mode,
            eviction,
            session,
            layout,
            converter,
            block_converter,
            hasher: KeyHasher::default(),
            state_schema,
            file_schema,
            committed: BTreeMap::new(),
            working: Mutex::new(None),
            pending: None,
            stats: StateStats::default(),
            max_rows,
            partitions: 1,
            memory_limit: u64::MAX,
            committed_bytes: 0,
        })
    }

    /// Splits its state files into `partitions` partitions by a hash of the
    /// group key ([`partition_of`]); one unless told otherwise.
    pub fn with_partitions(mut self, partitions: u32) -> Aggregation {
        self.partitions = partitions.max(1);
        self
    }

    /// Stops a batch whose groups, with the state, pass `bytes`
    /// ([`StateError::OverMemory`]); no limit unless told.
    pub fn with_memory_limit(mut self, bytes: u64) -> Aggregation {
        self.memory_limit = bytes;
        self
    }

    /// How many partitions its state files are split into.
    pub fn partitions(&self) -> u32 {
        self.partitions
    }

    /// The output mode.
    pub fn mode(&self) -> OutputMode {
        self.mode
    }

    /// The schema of the rows [`Aggregation::finish`] emits.
    pub fn output_schema(&self) -> SchemaRef {
        self.parts.output.clone()
    }

    /// The counts of the batch last finished.
    pub fn stats(&self) -> StateStats {
        self.stats
    }

    pub(crate) fn accumulators(&self) -> Result<Vec<Box<dyn GroupsAccumulator>>, StateError> {
        self.parts
            .aggregates
            .iter()
            .map(|aggregate| {
                if aggregate.groups_accumulator_supported() {
                    aggregate.create_groups_accumulator()
                } else {
                    let aggregate = aggregate.clone();
                    Ok(Box::new(GroupsAccumulatorAdapter::new(move || {
                        aggregate.create_accumulator()
                    })) as Box<dyn GroupsAccumulator>)
                }
            })
            .collect::<Result<_, _>>()
            .map_err(|e| internal("creating an accumulator", e))
    }

    /// How many state columns each aggregate has, in order.
    pub(crate) fn state_widths(&self) -> Vec<usize> {
        self.parts
            .aggregates
            .iter()
            .map(|aggregate| aggregate.state_fields().map_or(0, |f| f.len()))
            .collect()
    }

    /// Accumulators holding the groups of `states` (each aggregate's state
    /// columns, one after the other), group i being row i.
    pub(crate) fn load(
        &self,
        states: &[ArrayRef],
    ) -> Result<Vec<Box<dyn GroupsAccumulator>>, StateError> {
        let mut accumulators = self.accumulators()?;
        let n = states.first().map_or(0, |a| a.len());
        if n > 0 {
            let groups: Vec<usize> = (0..n).collect();
            let mut at = 0;
            for (accumulator, width) in accumulators.iter_mut().zip(self.state_widths()) {
                accumulator
                    .merge_batch(&states[at..at + width], &groups, n)
                    .map_err(|e| internal("restoring the state", e))?;
                at += width;
            }
        }
        Ok(accumulators)
    }

    /// Starts a batch from the committed state.
    pub fn begin(&mut self) -> Result<(), StateError> {
        *self.working() = Some(Working {
            blocks: BTreeMap::new(),
            accumulators: self.accumulators()?,
            groups: 0,
            dropped: 0,
            bytes: 0,
        });
        self.pending = None;
        Ok(())
    }

    /// Counts input rows dropped as late.
    pub fn dropped(&mut self, rows: u64) {
        if let Some(working) = self.working().as_mut() {
            working.dropped += rows;
        }
    }

    /// Adds the rows below the aggregate to their groups.
    pub fn update(&mut self, batch: &RecordBatch) -> Result<(), StateError> {
        if self.working().is_none() {
            self.begin()?;
        }
        let Some(mut working) = self.working().take() else {
            return Ok(());
        };
        let result = self.update_working(&mut working, batch);
        *self.working() = Some(working);
        result
    }

    fn update_working(&self, working: &mut Working, batch: &RecordBatch) -> Result<(), StateError> {
        let evaluate = |expr: &Arc<dyn PhysicalExpr>, batch: &RecordBatch| {
            expr.evaluate(batch)
                .and_then(|v| v.into_array(batch.num_rows()))
                .map_err(execution)
        };
        let mut keys: Vec<ArrayRef> = self
            .parts
            .group_exprs
            .iter()
            .map(|(expr, _)| evaluate(expr, batch))
            .collect::<Result<_, _>>()?;
        // A row without an event time has no window; Spark leaves it out too.
        let mut batch = batch.clone();
        if let Eviction::Window(i) = self.eviction
            && keys[i].null_count() > 0
        {
            let valid = BooleanArray::from(
                (0..keys[i].len())
                    .map(|row| keys[i].is_valid(row))
                    .collect::<Vec<_>>(),
            );
            batch = arrow::compute::filter_record_batch(&batch, &valid).map_err(execution)?;
            keys = keys
                .iter()
                .map(|k| arrow::compute::filter(k, &valid))
                .collect::<Result<_, _>>()
                .map_err(execution)?;
        }
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let groups = self.assign_groups(working, &keys)?;
        for (i, aggregate) in self.parts.aggregates.iter().enumerate() {
            let values: Vec<ArrayRef> = aggregate
                .expressions()
                .iter()
                .map(|e| evaluate(e, &batch))
                .collect::<Result<_, _>>()?;
            let filter = match &self.parts.filters[i] {
                Some(filter) => Some(evaluate(filter, &batch)?),
                None => None,
            };
            let filter = filter.as_ref().map(|f| f.as_boolean().clone());
            working.accumulators[i]
                .update_batch(&values, &groups, filter.as_ref(), working.groups)
                .map_err(execution)?;
        }
        working.bytes = working.memory_size();
        self.within_memory(working.bytes)
    }

    /// Whether the state and `batch_bytes` of a batch's own fit the budget.
    pub(crate) fn within_memory(&self, batch_bytes: u64) -> Result<(), StateError> {
        let bytes = self.committed_bytes + batch_bytes;
        if bytes > self.memory_limit {
            return Err(StateError::OverMemory {
                bytes,
                limit: self.memory_limit,
            });
        }
        Ok(())
    }

    /// The batch's group of each row whose group keys are `keys`, adding the
    /// groups it had not touched yet. Rows are taken block by block, each
    /// key hashed once for the batch's groups and the committed ones.
    fn assign_groups(
        &self,
        working: &mut Working,
        keys: &[ArrayRef],
    ) -> Result<Vec<usize>, StateError> {
        let n = keys.first().map_or(0, |k| k.len());
        let (chunk_keys, blocks) = self.chunk_keys(keys)?;
        let mut order: Vec<u32> = (0..n as u32).collect();
        if let Some(blocks) = &blocks
            && blocks.windows(2).any(|w| w[0] != w[1])
        {
            order.sort_by_key(|&r| blocks[r as usize]);
        }
        let block_of = |r: u32| blocks.as_ref().map_or(ALL_GROUPS, |b| b[r as usize]);
        let Working {
            blocks: touched_blocks,
            groups: batch_groups,
            ..
        } = working;
        let mut groups = vec![0_usize; n];
        let mut at = 0;
        while at < n {
            let block = block_of(order[at]);
            let run = order[at..]
                .iter()
                .take_while(|&&r| block_of(r) == block)
                .count();
            let committed = self.committed.get(&block);
            let touched = touched_blocks.entry(block).or_default();
            for &r in &order[at..at + run] {
                let key = chunk_keys.get(r as usize);
                let hash = self.hasher.hash(key);
                let group = match touched.keys.find(hash, key) {
                    Some(local) => touched.batch[local as usize],
                    None => {
                        let group = u32::try_from(*batch_groups).map_err(|_| {
                            internal("a batch's groups", "more than 4 Gi groups in one batch")
                        })?;
                        touched.keys.push(&self.hasher, hash, key)?;
                        touched.batch.push(group);
                        touched.committed.push(
                            committed
                                .and_then(|b| b.keys.find(hash, key))
                                .unwrap_or(NEW),
                        );
                        *batch_groups += 1;
                        group
                    }
                };
                groups[r as usize] = group as usize;
            }
            at += run;
        }
        Ok(groups)
    }

    /// The keys of a chunk's rows within their blocks, and each row's block
    /// when the groups are kept by window.
    fn chunk_keys(
        &self,
        keys: &[ArrayRef],
    ) -> Result<(ChunkKeys, Option<Vec<BlockKey>>), StateError> {
        let (within, blocks) = match self.layout {
            Layout::Windows(i) => {
                let starts = window_bounds_ms(keys[i].as_ref(), 0)?;
                let ends = window_bounds_ms(keys[i].as_ref(), 1)?;
                let blocks = starts
                    .values()
                    .iter()
                    .zip(ends.values().iter())
                    .map(|(s, e)| (*s, *e))
                    .collect();
                let others: Vec<ArrayRef> = keys
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| *k != i)
                    .map(|(_, key)| key.clone())
                    .collect();
                (others, Some(blocks))
            }
            Layout::One => (keys.to_vec(), None),
        };
        let chunk_keys = match &self.block_converter {
            Some(converter) => ChunkKeys::Rows(
                converter
                    .convert_columns(&within)
                    .map_err(|e| internal("group keys", e))?,
            ),
            None => ChunkKeys::Empty,
        };
        Ok((chunk_keys, blocks))
    }

    /// The batch in progress, taken out.
    pub(crate) fn take_working(&mut self) -> Result<Option<Batch>, StateError> {
        if self.working().is_none() {
            self.begin()?;
        }
        let Some(working) = self.working().take() else {
            return Ok(None);
        };
        let mut states = Vec::new();
        for mut accumulator in working.accumulators {
            states.extend(
                accumulator
                    .state(EmitTo::All)
                    .map_err(|e| internal("the state of an aggregate", e))?,
            );
        }
        Ok(Some(Batch {
            touched: working.blocks,
            states,
            dropped: working.dropped,
            bytes: working.bytes,
        }))
    }

    /// The key columns of `rows` of a block, in the order of the group keys,
    /// the window's built from the block's bounds.
    pub(crate) fn key_columns<'a>(
        &self,
        block: BlockKey,
        keys: impl Iterator<Item = &'a [u8]>,
        rows: usize,
    ) -> Result<Vec<ArrayRef>, StateError> {
        let mut columns = match &self.block_converter {
            Some(converter) => {
                let parser = converter.parser();
                converter
                    .convert_rows(keys.map(|k| parser.parse(k)))
                    .map_err(|e| internal("group keys", e))?
            }
            None => Vec::new(),
        };
        if let Layout::Windows(i) = self.layout {
            columns.insert(i, self.window_column(block, rows)?);
        }
        Ok(columns)
    }

    /// A window key column of `rows` rows of the window `block`.
    fn window_column(&self, block: BlockKey, rows: usize) -> Result<ArrayRef, StateError> {
        self.window_struct(
            Int64Array::from_value(block.0, rows),
            Int64Array::from_value(block.1, rows),
        )
    }

    /// A window key column of the windows `blocks`, a row each.
    pub(crate) fn windows_column(&self, blocks: &[BlockKey]) -> Result<ArrayRef, StateError> {
        self.window_struct(
            Int64Array::from_iter_values(blocks.iter().map(|b| b.0)),
            Int64Array::from_iter_values(blocks.iter().map(|b| b.1)),
        )
    }

    /// A window key column of windows from `starts` to `ends`, in epoch
    /// milliseconds.
    fn window_struct(&self, starts: Int64Array, ends: Int64Array) -> Result<ArrayRef, StateError> {
        let Layout::Windows(i) = self.layout else {
            return Err(internal("a window column", "the groups have no window"));
        };
        let DataType::Struct(fields) = self.state_schema.field(i).data_type() else {
            return Err(internal(
                "a window column",
                self.state_schema.field(i).data_type(),
            ));
        };
        let time_type = fields[0].data_type();
        let bounds = vec![
            crate::from_epoch_millis(starts, time_type).map_err(execution)?,
            crate::from_epoch_millis(ends, time_type).map_err(execution)?,
        ];
        Ok(Arc::new(
            arrow::array::StructArray::try_new(fields.clone(), bounds, None)
                .map_err(|e| internal("a window column", e))?,
        ))
    }

    /// A table of the state's schema: `keys`, then `states`.
    pub(crate) fn state_table(
        &self,
        mut keys: Vec<ArrayRef>,
        states: Vec<ArrayRef>,
    ) -> Result<RecordBatch, StateError> {
        keys.extend(states);
        RecordBatch::try_new(self.state_schema.clone(), keys)
            .map_err(|e| internal("the state table", e))
    }

    /// Hands `each` the groups of the block `key` as tables of the state's
    /// schema, a chunk of `states` at a time, so that a window of millions of
    /// groups is never one table; `keys` are its groups' keys in order.
    pub(crate) fn for_each_table<'a>(
        &self,
        key: BlockKey,
        mut keys: impl Iterator<Item = &'a [u8]>,
        states: &Chunks,
        mut each: impl FnMut(RecordBatch) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        for (rows, columns) in states.parts() {
            let keys = self.key_columns(key, keys.by_ref().take(rows), rows)?;
            each(self.state_table(keys, columns.to_vec())?)?;
        }
        Ok(())
    }

    /// The blocks holding the groups of `table`, a table of the state's
    /// schema with one row per group.
    pub(crate) fn blocks_of(
        &self,
        table: &RecordBatch,
    ) -> Result<BTreeMap<BlockKey, Block>, StateError> {
        let mut rows: BTreeMap<BlockKey, Vec<u32>> = BTreeMap::new();
        match self.layout {
            Layout::Windows(i) => {
                let starts = window_bounds_ms(table.column(i).as_ref(), 0)?;
                let ends = window_bounds_ms(table.column(i).as_ref(), 1)?;
                for r in 0..table.num_rows() {
                    rows.entry((starts.value(r), ends.value(r)))
                        .or_default()
                        .push(r as u32);
                }
            }
            Layout::One if table.num_rows() > 0 => {
                rows.insert(ALL_GROUPS, (0..table.num_rows() as u32).collect());
            }
            Layout::One => {}
        }
        let keys = self.parts.group_exprs.len();
        let mut blocks = BTreeMap::new();
        for (key, rows) in rows {
            let part = if rows.len() == table.num_rows() {
                table.clone()
            } else {
                take_rows(table, &rows)?
            };
            let (chunk_keys, _) = self.chunk_keys(&part.columns()[..keys])?;
            let mut block = Block {
                keys: Keys::with_capacity(part.num_rows(), 0),
                states: Chunks::new(part.columns()[keys..].to_vec(), part.num_rows()),
            };
            for r in 0..part.num_rows() {
                let key = chunk_keys.get(r);
                let hash = self.hasher.hash(key);
                if block.keys.find(hash, key).is_some() {
                    return Err(internal("the state", "two groups of one key"));
                }
                block.keys.push(&self.hasher, hash, key)?;
            }
            blocks.insert(key, block);
        }
        Ok(blocks)
    }

    /// The state's size in memory: every committed block's keys and states.
    pub(crate) fn committed_memory(&self) -> u64 {
        self.committed
            .values()
            .map(Block::memory_size)
            .sum::<usize>() as u64
    }

    /// How many groups the committed state holds.
    pub(crate) fn committed_groups(&self) -> u64 {
        self.committed.values().map(|b| b.keys.len() as u64).sum()
    }

    /// The aggregate's output for the groups of `table`, a table of the
    /// state's schema.
    pub(crate) fn evaluate(&self, table: &RecordBatch) -> Result<RecordBatch, StateError> {
        let keys = self.parts.group_exprs.len();
        let mut accumulators = self.load(&table.columns()[keys..])?;
        let mut columns: Vec<ArrayRef> = table.columns()[..keys].to_vec();
        for accumulator in &mut accumulators {
            columns.push(accumulator.evaluate(EmitTo::All).map_err(execution)?);
        }
        let columns = columns
            .into_iter()
            .zip(self.parts.output.fields())
            .map(|(column, field)| {
                if column.data_type() == field.data_type() {
                    Ok(column)
                } else {
                    arrow::compute::cast(&column, field.data_type()).map_err(execution)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let output = self.parts.output.clone();
        // Nullability as DataFusion planned it may be stricter than a state table.
        let relaxed = Arc::new(Schema::new(
            output
                .fields()
                .iter()
                .map(|f| f.as_ref().clone().with_nullable(true))
                .collect::<Vec<_>>(),
        ));
        RecordBatch::try_new(output, columns.clone())
            .or_else(|_| RecordBatch::try_new(relaxed, columns))
            .map_err(|e| internal("the aggregate's rows", e))
    }

    /// The finished batch's delta files, one per partition: the groups it
    /// wrote and removed. `None` before a batch has finished.
    pub fn pending_delta(&self) -> Option<&[Vec<u8>]> {
        self.pending.as_ref().map(|p| p.delta.as_slice())
    }

    /// Hands `each` the committed state as snapshot tables, a block at a time,
    /// so that the whole state is never one more table in memory.
    pub fn for_each_snapshot_table(
        &self,
        mut each: impl FnMut(RecordBatch) -> Result<(), StateError>,
    ) -> Result<(), StateError> {
        for (key, block) in &self.committed {
            self.for_each_table(*key, block.keys.iter(), &block.states, |table| {
                each(self.file_table(OP_WRITE, &table)?)
            })?;
        }
        Ok(())
    }

    /// `table`, of the state's schema, as a state file's table whose rows
    /// are all `op`.
    pub(crate) fn file_table(
        &self,
        op: i8,
        table: &RecordBatch,
    ) -> Result<RecordBatch, StateError> {
        let mut columns: Vec<ArrayRef> =
            vec![Arc::new(Int8Array::from(vec![op; table.num_rows()]))];
        columns.extend(table.columns().iter().cloned());
        RecordBatch::try_new(self.file_schema.clone(), columns)
            .map_err(|e| internal("a state file's table", e))
    }

    /// Splits a state file's table (a delta or a snapshot) into `partitions`
    /// tables, by [`partition_of`] each row's group key.
    pub fn split_by_partition(
        &self,
        file: &RecordBatch,
        partitions: u32,
    ) -> Result<Vec<RecordBatch>, StateError> {
        if partitions <= 1 {
            return Ok(vec![file.clone()]);
        }
        let keys = self.parts.group_exprs.len();
        let rows = self
            .converter
            .convert_columns(&file.columns()[1..=keys])
            .map_err(|e| internal("state keys", e))?;
        let mut chosen: Vec<Vec<u32>> = vec![Vec::new(); partitions as usize];
        for (r, row) in rows.iter().enumerate() {
            chosen[partition_of(row.as_ref(), partitions) as usize].push(r as u32);
        }
        chosen.iter().map(|rows| take_rows(file, rows)).collect()
    }

    /// Makes the finished batch's state the one the next batch starts from.
    pub fn commit(&mut self) {
        if let Some(pending) = self.pending.take() {
            self.stats = pending.stats;
            self.apply(pending.change);
            self.committed_bytes = self.committed_memory();
            self.stats.memory_used_bytes = self.committed_bytes;
        }
    }

    /// The schema of state files.
    pub fn file_schema(&self) -> SchemaRef {
        self.file_schema.clone()
    }

    /// Sets the committed state from a snapshot and the deltas after it, in
    /// order, as read from state files.
    pub fn restore(&mut self, files: &[RecordBatch]) -> Result<(), StateError> {
        let keys = self.parts.group_exprs.len();
        let mut latest: HashMap<Box<[u8]>, (usize, usize)> = HashMap::new();
        // Each file's windows, when the groups are kept by window, to find the
        // groups of a window a later file removes.
        let windows = match self.layout {
            Layout::Windows(i) => files
                .iter()
                .map(|f| {
                    let window = f.column(1 + i).as_ref();
                    Ok((window_bounds_ms(window, 0)?, window_bounds_ms(window, 1)?))
                })
                .collect::<Result<Vec<_>, StateError>>()?,
            Layout::One => Vec::new(),
        };
        for (f, file) in files.iter().enumerate() {
            let rows = self
                .converter
                .convert_columns(&file.columns()[1..=keys])
                .map_err(|e| internal("state keys", e))?;
            let ops = file.column(0).as_primitive::<arrow::datatypes::Int8Type>();
            let window = |f: usize, r: usize| {
                windows
                    .get(f)
                    .map(|(starts, ends)| (starts.value(r), ends.value(r)))
            };
            let closed: HashSet<BlockKey> = (0..file.num_rows())
                .filter(|&r| ops.value(r) == OP_REMOVE_WINDOW)
                .filter_map(|r| window(f, r))
                .collect();
            if !closed.is_empty() {
                latest.retain(|_, (f, r)| window(*f, *r).is_none_or(|w| !closed.contains(&w)));
            }
            for (r, row) in rows.iter().enumerate() {
                match ops.value(r) {
                    OP_WRITE => {
                        latest.insert(row.as_ref().into(), (f, r));
                    }
                    OP_REMOVE => {
                        latest.remove(row.as_ref());
                    }
                    OP_REMOVE_WINDOW => {}
                    op => {
                        return Err(internal(
                            "restoring the state",
                            format!("a state file's row {r} has the unknown op {op}"),
                        ));
                    }
                }
            }
        }
        let mut picks: Vec<(usize, usize)> = latest.into_values().collect();
        picks.sort_unstable();
        let mut columns = Vec::new();
        for c in 1..self.file_schema.fields().len() {
            let arrays: Vec<&dyn Array> = files.iter().map(|f| f.column(c).as_ref()).collect();
            columns.push(
                arrow::compute::interleave(&arrays, &picks)
                    .map_err(|e| internal("restoring the state", e))?,
            );
        }
        let table = RecordBatch::try_new(self.state_schema.clone(), columns)
            .map_err(|e| internal("restoring the state", e))?;
        self.committed = self.blocks_of(&table)?;
        *self.working() = None;
        self.pending = None;
        self.stats.rows_total = self.committed_groups();
        self.committed_bytes = self.committed_memory();
        self.stats.memory_used_bytes = self.committed_bytes;
        Ok(())
    }

    /// Empties the state.
    pub fn reset(&mut self) {
        self.committed = BTreeMap::new();
        self.committed_bytes = 0;
        *self.working() = None;
        self.pending = None;
    }

    fn working(&mut self) -> &mut Option<Working> {
        self.working
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether groups ever become final and leave the state.
    pub fn evicts(&self) -> bool {
        self.eviction != Eviction::Never && self.mode != OutputMode::Complete
    }

    /// The operator's name in progress reports, as Spark names it.
    pub fn operator_name(&self) -> &'static str {
        if self.parts.aggregates.is_empty() {
            "dedupe"
        } else if self.session.is_some() {
            "sessionWindowStateStoreSaveExec"
        } else {
            "stateStoreSave"
        }
    }
}

/// The state partition of a group key, given in Arrow's row format: FNV-1a over
/// its bytes, so that it is the same in every process and on every machine.
pub fn partition_of(key: &[u8], partitions: u32) -> u32 {
    let hash = key.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    (hash % u64::from(partitions.max(1))) as u32
}

/// The `start` (`field` 0) or `end` (`field` 1) bounds of a window struct
/// column, in epoch milliseconds.
pub fn window_bounds_ms(
    window: &dyn Array,
    field: usize,
) -> Result<arrow::array::Int64Array, StateError> {
    let window = window
        .as_struct_opt()
        .ok_or_else(|| internal("a window column", window.data_type()))?;
    crate::epoch_millis(window.column(field)).map_err(execution)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};

    #[test]
    fn a_key_lands_in_the_same_partition_on_every_run() {
        // Partitioned state on disk was split by these values: a change to the
        // hash or to Arrow's row format would put a stored key in another
        // partition than the one its later changes go to.
        let converter = RowConverter::new(vec![
            SortField::new(DataType::Utf8),
            SortField::new(DataType::Int64),
        ])
        .unwrap();
        let keys: [ArrayRef; 2] = [
            Arc::new(StringArray::from(vec!["alice", "bob", "carol", "dave"])),
            Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
        ];
        let rows = converter.convert_columns(&keys).unwrap();
        let got: Vec<u32> = rows.iter().map(|r| partition_of(r.as_ref(), 8)).collect();
        assert_eq!(got, [0, 2, 1, 4]);
        assert!(rows.iter().all(|r| partition_of(r.as_ref(), 1) == 0));
    }
}
