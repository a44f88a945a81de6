//! Aggregation across batches, on DataFusion's own partial aggregation states.
//!
//! DataFusion plans the query's aggregate as usual. Everything below it runs on
//! each chunk; its groups are kept here, across batches, as DataFusion's
//! [`GroupsAccumulator`]s, whose partial `state` is what is stored between
//! batches and merged back (`merge_batch`) when a batch begins. At the end of a
//! batch the groups the output mode names are evaluated, and everything above the
//! aggregate (HAVING, the SELECT list) runs over them. No accumulator is our own:
//! `count`, `sum`, `avg`, `count(DISTINCT)`, `approx_distinct` and every other
//! aggregate whose partial state merges work the same way.
//!
//! A batch's state is a table: the group keys, then each aggregate's state
//! columns. It moves in versions: [`Aggregation::begin`] starts from the last
//! committed one, [`Aggregation::finish`] makes the next, and
//! [`Aggregation::commit`] makes that the one the next batch starts from, once it
//! is durable. A batch begun again starts from the same version, so it gives the
//! same output.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, Int8Array, RecordBatch, UInt32Array, new_null_array,
};
use arrow::datatypes::{DataType, Field, FieldRef, Schema, SchemaRef};
use arrow::row::{RowConverter, SortField};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::GroupsAccumulatorAdapter;
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_plan::PhysicalExpr;

use crate::StateError;

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
}

/// One version of the state: the groups and their partial states.
#[derive(Clone)]
struct Version {
    table: RecordBatch,
    /// Each group's key in DataFusion's row format, to its row in `table`.
    index: HashMap<Box<[u8]>, usize>,
}

/// The batch in progress.
struct Working {
    index: HashMap<Box<[u8]>, usize>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    updated: Vec<bool>,
    dropped: u64,
}

/// What a finished batch leaves, until it is committed.
struct Pending {
    version: Version,
    delta: RecordBatch,
    stats: StateStats,
}

/// A stateful aggregation over the stream.
pub struct Aggregation {
    parts: AggregateParts,
    mode: OutputMode,
    eviction: Eviction,
    session: Option<usize>,
    converter: RowConverter,
    /// Keys, then state columns, all nullable.
    state_schema: SchemaRef,
    /// `state_schema` behind an `op` column: 0 for a group written, 1 for one
    /// removed. Deltas and snapshots are tables of this schema.
    file_schema: SchemaRef,
    committed: Version,
    /// In a mutex only so that the query can be shared while a chunk runs;
    /// it is reached through `&mut self`, without locking.
    working: Mutex<Option<Working>>,
    pending: Option<Pending>,
    stats: StateStats,
    /// `[query] max_state_rows`.
    max_rows: u64,
    /// How many partitions its state files are split into.
    partitions: u32,
}

impl std::fmt::Debug for Aggregation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aggregation")
            .field("mode", &self.mode)
            .field("eviction", &self.eviction)
            .field("groups", &self.committed.table.num_rows())
            .finish_non_exhaustive()
    }
}

fn internal(context: &str, e: impl std::fmt::Display) -> StateError {
    StateError::Internal(format!("{context}: {e}"))
}

fn execution(e: impl std::fmt::Display) -> StateError {
    StateError::Execution(one_line(&e.to_string()))
}

/// The name of the column in state files that says whether a row writes or
/// removes its group.
const OP_COLUMN: &str = "op";
const OP_WRITE: i8 = 0;
const OP_REMOVE: i8 = 1;

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
        let converter = RowConverter::new(sort).map_err(|e| internal("group keys", e))?;
        let state_schema = Arc::new(Schema::new(fields.clone()));
        let mut file_fields = vec![Arc::new(Field::new(OP_COLUMN, DataType::Int8, false))];
        file_fields.extend(fields);
        let file_schema = Arc::new(Schema::new(file_fields));
        let committed = Version {
            table: RecordBatch::new_empty(state_schema.clone()),
            index: HashMap::new(),
        };
        Ok(Aggregation {
            parts,
            mode,
            eviction,
            session,
            converter,
            state_schema,
            file_schema,
            committed,
            working: Mutex::new(None),
            pending: None,
            stats: StateStats::default(),
            max_rows,
            partitions: 1,
        })
    }

    /// Splits its state files into `partitions` partitions by a hash of the
    /// group key ([`partition_of`]); one unless told otherwise.
    pub fn with_partitions(mut self, partitions: u32) -> Aggregation {
        self.partitions = partitions.max(1);
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

    fn accumulators(&self) -> Result<Vec<Box<dyn GroupsAccumulator>>, StateError> {
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

    /// The state columns of each aggregate in `table`.
    fn state_columns(&self, table: &RecordBatch) -> Vec<Vec<ArrayRef>> {
        let mut at = self.parts.group_exprs.len();
        self.parts
            .aggregates
            .iter()
            .map(|aggregate| {
                let n = aggregate.state_fields().map_or(0, |f| f.len());
                let columns = table.columns()[at..at + n].to_vec();
                at += n;
                columns
            })
            .collect()
    }

    /// Accumulators holding `table`'s groups, group i being row i.
    fn load(&self, table: &RecordBatch) -> Result<Vec<Box<dyn GroupsAccumulator>>, StateError> {
        let mut accumulators = self.accumulators()?;
        let n = table.num_rows();
        if n > 0 {
            let groups: Vec<usize> = (0..n).collect();
            for (accumulator, states) in accumulators.iter_mut().zip(self.state_columns(table)) {
                accumulator
                    .merge_batch(&states, &groups, n)
                    .map_err(|e| internal("restoring the state", e))?;
            }
        }
        Ok(accumulators)
    }

    /// Starts a batch from the committed state.
    pub fn begin(&mut self) -> Result<(), StateError> {
        let n = self.committed.table.num_rows();
        *self.working() = Some(Working {
            index: self.committed.index.clone(),
            accumulators: self.load(&self.committed.table)?,
            updated: vec![false; n],
            dropped: 0,
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
        let rows = self
            .converter
            .convert_columns(&keys)
            .map_err(|e| internal("group keys", e))?;
        let no_aggregates = self.parts.aggregates.is_empty();
        let mut groups = Vec::with_capacity(rows.num_rows());
        for row in rows.iter() {
            let group = match working.index.get(row.as_ref()) {
                Some(group) => {
                    // A group with nothing to aggregate changes only when it is new.
                    if !no_aggregates {
                        working.updated[*group] = true;
                    }
                    *group
                }
                None => {
                    let group = working.index.len();
                    working.index.insert(row.as_ref().into(), group);
                    working.updated.push(true);
                    group
                }
            };
            groups.push(group);
        }
        let total = working.index.len();
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
                .update_batch(&values, &groups, filter.as_ref(), total)
                .map_err(execution)?;
        }
        Ok(())
    }

    /// Ends the batch under `watermark_ms`: the rows its output mode emits (in
    /// the aggregate's output schema), and the next version of the state.
    pub fn finish(&mut self, watermark_ms: i64) -> Result<RecordBatch, StateError> {
        if self.working().is_none() {
            self.begin()?;
        }
        let Some(mut working) = self.working().take() else {
            return Ok(RecordBatch::new_empty(self.parts.output.clone()));
        };
        let total = working.index.len();
        let mut ordered: Vec<&[u8]> = vec![&[]; total];
        for (key, group) in &working.index {
            ordered[*group] = key;
        }
        let parser = self.converter.parser();
        let mut columns = self
            .converter
            .convert_rows(ordered.iter().map(|k| parser.parse(k)))
            .map_err(|e| internal("group keys", e))?;
        for accumulator in &mut working.accumulators {
            columns.extend(
                accumulator
                    .state(EmitTo::All)
                    .map_err(|e| internal("the state of an aggregate", e))?,
            );
        }
        let mut table = RecordBatch::try_new(self.state_schema.clone(), columns)
            .map_err(|e| internal("the state table", e))?;
        let mut updated = working.updated;
        if let Some(window) = self.session {
            (table, updated) = self.merge_sessions(&table, &updated, window)?;
        }
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
                let times = time_ms(table.column(i))?;
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
        let output = self.evaluate(&table, &emit)?;

        let kept = take_rows(&table, &keep)?;
        let keys = &kept.columns()[..self.parts.group_exprs.len()];
        let rows = self
            .converter
            .convert_columns(keys)
            .map_err(|e| internal("group keys", e))?;
        let index: HashMap<Box<[u8]>, usize> = rows
            .iter()
            .enumerate()
            .map(|(i, row)| (Box::from(row.as_ref()), i))
            .collect();
        let changed: Vec<u32> = keep
            .iter()
            .enumerate()
            .filter(|(_, old)| updated[**old as usize])
            .map(|(new, _)| new as u32)
            .collect();
        let removed: Vec<u32> = self
            .committed
            .index
            .iter()
            .filter(|(key, _)| !index.contains_key(*key))
            .map(|(_, row)| *row as u32)
            .collect();
        let delta = self.delta(&kept, &changed, &removed)?;
        let stats = StateStats {
            rows_total: kept.num_rows() as u64,
            rows_updated: changed.len() as u64,
            rows_removed: (n - keep.len()) as u64,
            rows_dropped_by_watermark: working.dropped,
            memory_used_bytes: (kept.get_array_memory_size()
                + index.keys().map(|k| k.len() + 32).sum::<usize>())
                as u64,
        };
        self.stats = stats;
        self.pending = Some(Pending {
            version: Version { table: kept, index },
            delta,
            stats,
        });
        Ok(output)
    }

    /// The aggregate's output for the groups `rows` of `table`.
    fn evaluate(&self, table: &RecordBatch, rows: &[u32]) -> Result<RecordBatch, StateError> {
        let chosen = take_rows(table, rows)?;
        let mut accumulators = self.load(&chosen)?;
        let mut columns: Vec<ArrayRef> = chosen.columns()[..self.parts.group_exprs.len()].to_vec();
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
        for (accumulator, states) in accumulators.iter_mut().zip(self.state_columns(table)) {
            accumulator
                .merge_batch(&states, &session_of, sessions.len())
                .map_err(|e| internal("merging sessions", e))?;
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

    /// A state file's table: `changed` rows of `table` written, `removed` rows
    /// of the committed version removed.
    fn delta(
        &self,
        table: &RecordBatch,
        changed: &[u32],
        removed: &[u32],
    ) -> Result<RecordBatch, StateError> {
        let written = take_rows(table, changed)?;
        let keys = self.parts.group_exprs.len();
        let gone = take_rows(&self.committed.table, removed)?;
        let mut columns: Vec<ArrayRef> = Vec::new();
        let mut ops = vec![OP_WRITE; written.num_rows()];
        ops.extend(std::iter::repeat_n(OP_REMOVE, gone.num_rows()));
        columns.push(Arc::new(Int8Array::from(ops)));
        for (i, field) in self.state_schema.fields().iter().enumerate() {
            let removed_part = if i < keys {
                gone.column(i).clone()
            } else {
                new_null_array(field.data_type(), gone.num_rows())
            };
            columns.push(
                arrow::compute::concat(&[written.column(i).as_ref(), removed_part.as_ref()])
                    .map_err(|e| internal("a state delta", e))?,
            );
        }
        RecordBatch::try_new(self.file_schema.clone(), columns)
            .map_err(|e| internal("a state delta", e))
    }

    /// The finished batch's delta: the groups it wrote and removed. `None`
    /// before a batch has finished.
    pub fn pending_delta(&self) -> Option<&RecordBatch> {
        self.pending.as_ref().map(|p| &p.delta)
    }

    /// The whole committed state, as a snapshot file's table.
    pub fn committed_snapshot(&self) -> Result<RecordBatch, StateError> {
        let table = &self.committed.table;
        let mut columns: Vec<ArrayRef> =
            vec![Arc::new(Int8Array::from(vec![OP_WRITE; table.num_rows()]))];
        columns.extend(table.columns().iter().cloned());
        RecordBatch::try_new(self.file_schema.clone(), columns)
            .map_err(|e| internal("a state snapshot", e))
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
            self.committed = pending.version;
            self.stats = pending.stats;
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
        for (f, file) in files.iter().enumerate() {
            let rows = self
                .converter
                .convert_columns(&file.columns()[1..=keys])
                .map_err(|e| internal("state keys", e))?;
            let ops = file.column(0).as_primitive::<arrow::datatypes::Int8Type>();
            for (r, row) in rows.iter().enumerate() {
                if ops.value(r) == OP_REMOVE {
                    latest.remove(row.as_ref());
                } else {
                    latest.insert(row.as_ref().into(), (f, r));
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
        let rows = self
            .converter
            .convert_columns(&table.columns()[..keys])
            .map_err(|e| internal("state keys", e))?;
        let index = rows
            .iter()
            .enumerate()
            .map(|(i, row)| (Box::from(row.as_ref()), i))
            .collect();
        self.committed = Version { table, index };
        *self.working() = None;
        self.pending = None;
        self.stats.rows_total = self.committed.table.num_rows() as u64;
        Ok(())
    }

    /// Empties the state.
    pub fn reset(&mut self) {
        self.committed = Version {
            table: RecordBatch::new_empty(self.state_schema.clone()),
            index: HashMap::new(),
        };
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

/// The event times of a timestamp column, in epoch milliseconds.
fn time_ms(column: &ArrayRef) -> Result<arrow::array::Int64Array, StateError> {
    crate::epoch_millis(column).map_err(execution)
}

/// A message on one line: its lines joined.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
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

fn take_rows(table: &RecordBatch, rows: &[u32]) -> Result<RecordBatch, StateError> {
    let indices = UInt32Array::from(rows.to_vec());
    arrow::compute::take_record_batch(table, &indices).map_err(|e| internal("taking groups", e))
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
