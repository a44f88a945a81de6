//! The query: SQL planned once by DataFusion, checked for what a stream allows,
//! and run on every chunk.
//!
//! The source table is a [`StreamingTable`] over one partition whose stream hands
//! out whatever was put in its slot. The physical plan is built once; running a
//! chunk puts its rows in the slot and executes the plan again, which DataFusion
//! plans allow. Nothing in the plan waits on I/O, so every stream it makes is
//! ready at once.

use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use datafusion::catalog::streaming::StreamingTable;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::DataFusionError;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, ExprSchemable, Join, LogicalPlan, Volatility};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;

use crate::SqlError;
use crate::ddl::sql_type;
use crate::error::{one_line, refused};
use crate::lookup::lookup_joins;
use crate::options::{DEFAULT_MAX_STATE_ROWS, QueryOptions};
use crate::window::{
    WindowGrouping, WindowKind, is_window_key, rewrite_window_grouping, window_functions,
};
use sluice_core::StatefulOperator;
use sluice_state::{AggregateParts, Aggregation, Eviction, OutputMode};

use crate::dedupe::KeyedDedupe;

/// A query over the source table, ready to run chunk after chunk. A query that
/// aggregates runs in two parts: the plan below its aggregate on every chunk,
/// and the plan above it on the groups each batch emits.
pub struct StreamQuery {
    plan: Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    /// A slot per stream table, in the order the query's sources are given.
    slots: Vec<Arc<Slot>>,
    schema: SchemaRef,
    stateful: Option<Stateful>,
}

/// The stateful operator of a query.
enum Stateful {
    Aggregate(Aggregate),
    Dedupe(KeyedDedupe),
}

/// The aggregation of a query, and the plan over what it emits.
struct Aggregate {
    aggregation: Aggregation,
    upper: Arc<dyn ExecutionPlan>,
    upper_slot: Arc<Slot>,
}

impl std::fmt::Debug for StreamQuery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamQuery")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// The rows of the chunk being run.
#[derive(Debug, Default)]
struct Slot(Mutex<Vec<RecordBatch>>);

/// The source table's one partition: whatever the slot holds.
#[derive(Debug)]
struct SlotPartition {
    schema: SchemaRef,
    slot: Arc<Slot>,
}

impl PartitionStream for SlotPartition {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        // Cloned, not taken: a query may scan the table more than once (each side
        // of a UNION ALL), and every scan sees the chunk. `run` empties the slot.
        let batches = self
            .slot
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            futures::stream::iter(batches.into_iter().map(Ok)),
        ))
    }
}

impl StreamQuery {
    /// Plans `sql` over a table named `table` with the columns of `input`.
    /// Refuses what cannot run on an unbounded stream, with the reason and what
    /// to write instead.
    pub async fn plan(sql: &str, table: &str, input: SchemaRef) -> Result<StreamQuery, SqlError> {
        StreamQuery::plan_with(sql, table, input, &QueryOptions::default()).await
    }

    /// Plans `sql` as [`StreamQuery::plan`] does, with an output mode and a
    /// watermark for a query that aggregates.
    pub async fn plan_with(
        sql: &str,
        table: &str,
        input: SchemaRef,
        options: &QueryOptions,
    ) -> Result<StreamQuery, SqlError> {
        StreamQuery::plan_streams(sql, &[(table.to_owned(), input)], options).await
    }

    /// Plans `sql` over several stream tables, each a name and the columns
    /// its rows have, in the order their chunks will name them
    /// ([`StreamQuery::run_source`]); they combine by UNION ALL and by joins
    /// with lookup tables.
    pub async fn plan_streams(
        sql: &str,
        streams: &[(String, SchemaRef)],
        options: &QueryOptions,
    ) -> Result<StreamQuery, SqlError> {
        let names: Vec<String> = streams.iter().map(|(name, _)| name.clone()).collect();
        let inputs: Vec<SchemaRef> = streams.iter().map(|(_, schema)| schema.clone()).collect();
        let mut config = SessionConfig::new()
            .with_target_partitions(1)
            .with_coalesce_batches(false)
            .with_batch_size(8192);
        // Spark's columns are named in camelCase (`timestampType`), and Spark
        // resolves names as written.
        config.options_mut().sql_parser.enable_ident_normalization = false;
        // Spark SQL's own dialect: backquoted names, and Spark's Kafka columns
        // (`partition`, `offset`, `timestamp`) unquoted anywhere in a SELECT list,
        // where the generic dialect takes `offset` for the OFFSET clause.
        config.options_mut().sql_parser.dialect = datafusion::config::Dialect::Spark;
        let mut ctx = SessionContext::new_with_config(config);
        datafusion_functions_json::register_all(&mut ctx)
            .map_err(|e| SqlError::Internal(e.to_string()))?;
        for function in window_functions() {
            ctx.register_udf(function);
        }
        // That rule turns count(DISTINCT x) into two aggregations, the inner one
        // grouping by x; kept whole, its accumulator's state (the distinct values)
        // is what merges across batches.
        ctx.remove_optimizer_rule("single_distinct_aggregation_to_group_by");
        let mut slots = Vec::with_capacity(streams.len());
        for (name, input) in streams {
            if streams.iter().filter(|(other, _)| other == name).count() > 1 {
                return Err(SqlError::Plan(format!(
                    "two sources are the table {name:?}: name each source's table otherwise"
                )));
            }
            let slot = Arc::new(Slot::default());
            let partition = Arc::new(SlotPartition {
                schema: input.clone(),
                slot: slot.clone(),
            });
            let source = StreamingTable::try_new(input.clone(), vec![partition])
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            ctx.register_table(name.as_str(), Arc::new(source))
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            slots.push(slot);
        }
        for lookup in &options.lookup_tables {
            if names.iter().any(|name| name == lookup.name()) {
                return Err(SqlError::Plan(format!(
                    "the lookup table {:?} has a stream's name ([source] table): name one \
                     of them otherwise",
                    lookup.name()
                )));
            }
            let scan = StreamingTable::try_new(lookup.schema(), vec![lookup.partition()])
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            ctx.register_table(lookup.name(), Arc::new(scan))
                .map_err(|e| SqlError::Internal(e.to_string()))?;
        }

        only_one_select(sql)?;
        let (sql, grouping) = rewrite_window_grouping(sql)?;
        let logical = ctx
            .state()
            .create_logical_plan(&sql)
            .await
            .map_err(|e| planning_error(e, &names))?;
        let logical =
            crate::dedupe::row_number_first(&logical, options.watermark_column.as_deref())?
                .unwrap_or(logical);
        refuse_what_streams_cannot_do(&logical, &names)?;
        if let Some(on) = crate::dedupe::distinct_on(&logical)? {
            let (plan, dedupe) = crate::dedupe::plan(&ctx, on, options).await?;
            let plan = lookup_joins(plan, &inputs, &options.lookup_tables)?;
            return Ok(StreamQuery {
                plan,
                task: ctx.task_ctx(),
                slots,
                schema: dedupe.schema(),
                stateful: Some(Stateful::Dedupe(dedupe)),
            });
        }
        let frame = ctx
            .execute_logical_plan(logical)
            .await
            .map_err(|e| planning_error(e, &names))?;
        let plan = frame
            .create_physical_plan()
            .await
            .map_err(|e| planning_error(e, &names))?;
        let plan = lookup_joins(plan, &inputs, &options.lookup_tables)?;
        let schema = plan.schema();
        let Some(parts) = split_at_aggregate(&plan)? else {
            if options.output_mode == Some(OutputMode::Complete) {
                return Err(refused(
                    "output_mode = \"complete\" without an aggregation",
                    "complete mode writes the whole result every batch, and a query that does \
                     not aggregate has no result but its rows",
                    "leave output_mode out (append), or aggregate",
                ));
            }
            return Ok(StreamQuery {
                plan,
                task: ctx.task_ctx(),
                slots,
                schema,
                stateful: None,
            });
        };
        let (lower, top, parts) = parts;
        let upper_slot = Arc::new(Slot::default());
        let aggregation = aggregation(parts, grouping.as_ref(), options)?
            .with_partitions(options.state_partitions.unwrap_or(1))
            .with_memory_limit(options.state_memory_bytes.unwrap_or(u64::MAX));
        let upper = replace_aggregate(&plan, &top, aggregation.output_schema(), &upper_slot)?;
        Ok(StreamQuery {
            plan: lower,
            task: ctx.task_ctx(),
            slots,
            schema,
            stateful: Some(Stateful::Aggregate(Aggregate {
                aggregation,
                upper,
                upper_slot,
            })),
        })
    }

    /// Whether the query keeps state across batches: it aggregates or
    /// deduplicates.
    pub fn is_stateful(&self) -> bool {
        self.stateful.is_some()
    }

    /// The output mode of a query that keeps state.
    pub fn output_mode(&self) -> Option<OutputMode> {
        self.stateful.as_ref().map(|s| match s {
            Stateful::Aggregate(a) => a.aggregation.mode(),
            Stateful::Dedupe(_) => OutputMode::Append,
        })
    }

    /// Its stateful operator, as the executor's checkpoint sees it.
    pub(crate) fn stateful_operator(&mut self) -> Option<&mut dyn StatefulOperator<SqlError>> {
        self.stateful.as_mut().map(|s| match s {
            Stateful::Aggregate(a) => &mut a.aggregation as &mut dyn StatefulOperator<SqlError>,
            Stateful::Dedupe(d) => &mut d.dedupe as &mut dyn StatefulOperator<SqlError>,
        })
    }

    /// How many partitions the state is split into.
    pub fn state_partitions(&self) -> u32 {
        match &self.stateful {
            Some(Stateful::Aggregate(a)) => a.aggregation.partitions(),
            Some(Stateful::Dedupe(d)) => StatefulOperator::<SqlError>::partitions(&d.dedupe),
            None => 1,
        }
    }

    /// Begins a batch of a query that keeps state, under `watermark_ms`.
    pub(crate) fn begin_batch(&mut self, watermark_ms: i64) -> Result<(), SqlError> {
        match &mut self.stateful {
            Some(Stateful::Aggregate(a)) => a.aggregation.begin()?,
            Some(Stateful::Dedupe(d)) => d.dedupe.begin(watermark_ms),
            None => {}
        }
        Ok(())
    }

    /// Counts `rows` input rows dropped as later than the watermark.
    pub(crate) fn dropped(&mut self, rows: u64) {
        match &mut self.stateful {
            Some(Stateful::Aggregate(a)) => a.aggregation.dropped(rows),
            Some(Stateful::Dedupe(d)) => d.dedupe.dropped(rows as usize),
            None => {}
        }
    }

    /// Hands a stateful query the rows [`StreamQuery::run`] made of a chunk;
    /// returns what it emits at once: an aggregation's groups wait for the
    /// batch's end, a deduplication's first rows do not.
    pub(crate) fn update(&mut self, rows: &[RecordBatch]) -> Result<Vec<RecordBatch>, SqlError> {
        let mut emitted = Vec::new();
        match &mut self.stateful {
            Some(Stateful::Aggregate(a)) => {
                for batch in rows {
                    a.aggregation.update(batch)?;
                }
            }
            Some(Stateful::Dedupe(d)) => {
                for batch in rows {
                    let kept = d.keep(batch)?;
                    if kept.num_rows() > 0 {
                        emitted.push(kept);
                    }
                }
            }
            None => emitted.extend(rows.iter().cloned()),
        }
        Ok(emitted)
    }

    /// Ends a batch of a query that keeps state: the rows its output mode
    /// emits under `watermark_ms`, through the plan above the aggregate; a
    /// deduplication forgets the keys the watermark passed.
    pub(crate) async fn finish_batch(
        &mut self,
        watermark_ms: i64,
    ) -> Result<Vec<RecordBatch>, SqlError> {
        let stateful = match self.stateful.as_mut() {
            Some(Stateful::Aggregate(a)) => a,
            Some(Stateful::Dedupe(d)) => {
                d.dedupe.finish()?;
                return Ok(Vec::new());
            }
            None => return Ok(Vec::new()),
        };
        let mut emitted = stateful.aggregation.finish(watermark_ms)?;
        emitted.retain(|batch| batch.num_rows() > 0);
        if emitted.is_empty() {
            return Ok(Vec::new());
        }
        *stateful
            .upper_slot
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = emitted;
        let out = run_plan(&stateful.upper, &self.task).await;
        stateful
            .upper_slot
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        out
    }

    /// The schema of the rows the query makes.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The query's rows for the source rows in `input`, of its first stream.
    pub async fn run(&self, input: RecordBatch) -> Result<Vec<RecordBatch>, SqlError> {
        self.run_source(0, input).await
    }

    /// The query's rows for the rows in `input` of stream `source`, the
    /// other streams empty meanwhile.
    pub async fn run_source(
        &self,
        source: usize,
        input: RecordBatch,
    ) -> Result<Vec<RecordBatch>, SqlError> {
        let slot = self
            .slots
            .get(source)
            .ok_or_else(|| SqlError::Internal(format!("the query has no stream {source}")))?;
        *slot.0.lock().unwrap_or_else(PoisonError::into_inner) = vec![input];
        let out = self.run_partitions().await;
        slot.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        out
    }

    /// The query's rows for each row of `input` (of stream `source`) on its
    /// own, and the rows it failed on, with the reason: for a chunk the
    /// query failed on as a whole.
    pub async fn run_each(
        &self,
        source: usize,
        input: &RecordBatch,
    ) -> Result<(Vec<RecordBatch>, Vec<(usize, String)>), SqlError> {
        let mut rows = Vec::new();
        let mut failed = Vec::new();
        for row in 0..input.num_rows() {
            match self.run_source(source, input.slice(row, 1)).await {
                Ok(out) => rows.extend(out),
                Err(SqlError::Execution(reason)) => failed.push((row, reason)),
                Err(e) => return Err(e),
            }
        }
        Ok((rows, failed))
    }

    /// The physical plan run on every chunk, as DataFusion shows it.
    #[cfg(test)]
    pub(crate) fn explain(&self) -> String {
        datafusion::physical_plan::displayable(self.plan.as_ref())
            .indent(false)
            .to_string()
    }

    async fn run_partitions(&self) -> Result<Vec<RecordBatch>, SqlError> {
        run_plan(&self.plan, &self.task).await
    }
}

/// Every output partition of `plan` in turn: a UNION ALL has one per side.
async fn run_plan(
    plan: &Arc<dyn ExecutionPlan>,
    task: &Arc<TaskContext>,
) -> Result<Vec<RecordBatch>, SqlError> {
    let mut out = Vec::new();
    let partitions = plan.output_partitioning().partition_count();
    for partition in 0..partitions {
        let mut stream = plan
            .execute(partition, task.clone())
            .map_err(SqlError::from_execution)?;
        while let Some(batch) = stream.next().await {
            let batch = batch.map_err(SqlError::from_execution)?;
            if batch.num_rows() > 0 {
                out.push(batch);
            }
        }
    }
    Ok(out)
}

fn stream_aggregates(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<Arc<dyn ExecutionPlan>>) {
    use datafusion::physical_plan::aggregates::AggregateExec;
    if plan.is::<AggregateExec>() {
        out.push(plan.clone());
    }
    let children = match plan.downcast_ref::<crate::lookup::LookupJoinExec>() {
        Some(join) => vec![join.stream()],
        None => plan.children(),
    };
    for child in children {
        stream_aggregates(child, out);
    }
}

/// The plan below the query's aggregate, the aggregate node, and its parts;
/// `None` when the query does not aggregate.
type Split = (
    Arc<dyn ExecutionPlan>,
    Arc<dyn ExecutionPlan>,
    AggregateParts,
);

fn split_at_aggregate(plan: &Arc<dyn ExecutionPlan>) -> Result<Option<Split>, SqlError> {
    use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
    let mut aggregates: Vec<Arc<dyn ExecutionPlan>> = Vec::new();
    // Only the stream's aggregates: one on a lookup table's side runs whole,
    // once per version of the table.
    stream_aggregates(plan, &mut aggregates);
    let Some(top) = aggregates.first().cloned() else {
        return Ok(None);
    };
    let Some(exec) = top.downcast_ref::<AggregateExec>() else {
        return Ok(None);
    };
    // DataFusion may plan a partial and a final step; the partial step's
    // expressions read the rows below.
    let (partial, count) = match exec.mode() {
        AggregateMode::Final | AggregateMode::FinalPartitioned => {
            match exec.input().downcast_ref::<AggregateExec>() {
                Some(partial) => (partial, 2),
                None => {
                    return Err(SqlError::Internal(
                        "a final aggregate without its partial one".to_owned(),
                    ));
                }
            }
        }
        _ => (exec, 1),
    };
    if aggregates.len() > count {
        return Err(refused(
            "more than one aggregation",
            "a streaming query may aggregate once, as in Spark: the groups of a second \
             aggregation would depend on when the first emits",
            "aggregate once, and aggregate further downstream",
        ));
    }
    let group_by = partial.group_expr();
    if group_by.has_grouping_set() {
        return Err(refused(
            "GROUPING SETS, ROLLUP or CUBE",
            "each grouping set is a separate aggregation",
            "group by one set of keys",
        ));
    }
    for aggregate in partial.aggr_expr() {
        // These give the first, last or all values in arrival order; across the
        // partitions of a batch that order differs between a run and its replay.
        let by_arrival = matches!(
            aggregate.fun().name(),
            "first_value" | "last_value" | "nth_value" | "array_agg" | "string_agg"
        );
        if by_arrival
            || !aggregate.order_bys().is_empty()
            || !aggregate.order_sensitivity().is_insensitive()
        {
            return Err(refused(
                &format!("the aggregate {}", aggregate.name()),
                "its result depends on the order rows arrive in, and the rows of a stream arrive \
                 over many batches, so its partial state cannot be merged",
                "use an aggregate that does not depend on order, such as min or max",
            ));
        }
        if let Err(e) = aggregate.state_fields() {
            return Err(refused(
                &format!("the aggregate {}", aggregate.name()),
                &format!(
                    "its partial state cannot be kept between batches ({})",
                    one_line(&e.to_string())
                ),
                "use an aggregate whose partial state merges, such as count, sum, min, max or avg",
            ));
        }
    }
    let parts = AggregateParts {
        group_exprs: group_by.expr().to_vec(),
        aggregates: partial.aggr_expr().to_vec(),
        filters: partial.filter_expr().to_vec(),
        output: top.schema(),
        input: partial.input().schema(),
    };
    Ok(Some((partial.input().clone(), top, parts)))
}

/// The plan above the aggregate, reading what the aggregation emits.
fn replace_aggregate(
    plan: &Arc<dyn ExecutionPlan>,
    top: &Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    slot: &Arc<Slot>,
) -> Result<Arc<dyn ExecutionPlan>, SqlError> {
    use datafusion::common::tree_node::Transformed;
    use datafusion::physical_plan::streaming::StreamingTableExec;
    let source: Arc<dyn ExecutionPlan> = Arc::new(
        StreamingTableExec::try_new(
            schema.clone(),
            vec![Arc::new(SlotPartition {
                schema,
                slot: slot.clone(),
            })],
            None,
            Vec::new(),
            false,
            None,
        )
        .map_err(|e| SqlError::Internal(e.to_string()))?,
    );
    plan.clone()
        .transform_down(|node| {
            if Arc::ptr_eq(&node, top) {
                Ok(Transformed::yes(source.clone()))
            } else {
                Ok(Transformed::no(node))
            }
        })
        .map(|t| t.data)
        .map_err(|e| SqlError::Internal(e.to_string()))
}

/// The aggregation for `parts`, with its output mode checked as Spark checks
/// it.
fn aggregation(
    parts: AggregateParts,
    grouping: Option<&WindowGrouping>,
    options: &QueryOptions,
) -> Result<Aggregation, SqlError> {
    let keys: Vec<(String, DataType)> = parts
        .group_exprs
        .iter()
        .map(|(expr, name)| {
            expr.data_type(&parts.input)
                .map(|t| (name.clone(), t))
                .map_err(|e| SqlError::Internal(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let window = keys
        .iter()
        .position(|(name, data_type)| is_window_key(name, data_type));
    let watermark = options.watermark_column.as_deref();
    let eviction = match (window, watermark) {
        (Some(i), Some(column)) => {
            let time = grouping.map(|g| unquoted_name(&g.time)).unwrap_or_default();
            if time != column {
                return Err(refused(
                    &format!("a window over {time}"),
                    &format!(
                        "the watermark is on {column}, and a window is final when the watermark \
                         of its own event time passes its end"
                    ),
                    &format!("window over {column}, or set source.event_time = \"{time}\""),
                ));
            }
            Eviction::Window(i)
        }
        (None, Some(column)) => keys
            .iter()
            .position(|(name, data_type)| {
                name == column && matches!(data_type, DataType::Timestamp(_, _))
            })
            .map_or(Eviction::Never, Eviction::Time),
        (_, None) => Eviction::Never,
    };
    let session = match (grouping, window) {
        (Some(g), Some(i)) if g.kind == WindowKind::Session => Some(i),
        _ => None,
    };
    let mode = match options.output_mode {
        Some(mode) => mode,
        None if window.is_some() => OutputMode::Append,
        None => OutputMode::Update,
    };
    match mode {
        OutputMode::Append if watermark.is_none() => {
            return Err(refused(
                "output_mode = \"append\" for an aggregation without a watermark",
                "append emits a group once it is final, and without a watermark no group ever is",
                "set source.watermark_delay, or output_mode = \"update\"",
            ));
        }
        OutputMode::Append if eviction == Eviction::Never => {
            return Err(refused(
                "output_mode = \"append\" for an aggregation without an event-time window",
                "append emits a group once the watermark makes it final, and only a group of an \
                 event-time window (or of the event time itself) ever is",
                "group by window(<event time>, ...), or output_mode = \"update\"",
            ));
        }
        OutputMode::Complete if window.is_some() => {
            return Err(refused(
                "output_mode = \"complete\" for a windowed aggregation",
                "complete writes every group every batch and keeps them all, so a window's \
                 state would never be freed and the output would grow with every window",
                "use output_mode = \"append\" or \"update\"",
            ));
        }
        _ => {}
    }
    Ok(Aggregation::new(
        parts,
        mode,
        eviction,
        session,
        options.max_state_rows.unwrap_or(DEFAULT_MAX_STATE_ROWS),
    )?)
}

/// `source.ts`, `` `ts` `` as `ts`.
fn unquoted_name(expr: &str) -> String {
    let last = expr.rsplit('.').next().unwrap_or(expr);
    last.trim_matches(|c| c == '`' || c == '"').to_owned()
}

/// Refuses anything but one SELECT (or WITH ... SELECT) before planning, as
/// DataFusion would plan an INSERT against the source table.
fn only_one_select(sql: &str) -> Result<(), SqlError> {
    use datafusion::sql::parser::{DFParserBuilder, Statement};
    use datafusion::sql::sqlparser::ast::Statement as Sql;
    use datafusion::sql::sqlparser::dialect::SparkSqlDialect;
    let statements = DFParserBuilder::new(sql)
        .with_dialect(&SparkSqlDialect {})
        .build()
        .and_then(|mut parser| parser.parse_statements())
        .map_err(|e| SqlError::Syntax(one_line(&e.to_string())))?;
    match statements.iter().collect::<Vec<_>>().as_slice() {
        [Statement::Statement(statement)] if matches!(statement.as_ref(), Sql::Query(_)) => Ok(()),
        [_] => Err(refused(
            "a statement other than SELECT",
            "a query only reads the stream; its rows go to [sink]",
            "write a SELECT",
        )),
        _ => Err(refused(
            "more than one statement",
            "a query is one SELECT",
            "keep one SELECT, without a trailing semicolon and a second statement",
        )),
    }
}

/// Walks the plan and its expressions for what a stateless query over an
/// unbounded stream cannot do.
fn refuse_what_streams_cannot_do(plan: &LogicalPlan, tables: &[String]) -> Result<(), SqlError> {
    let mut found: Option<SqlError> = None;
    let _ = plan.apply_with_subqueries(|node| {
        let problem = match node {
            LogicalPlan::Sort(_) => Some(refused(
                "ORDER BY",
                "a stream has no end to sort up to",
                "sort where the rows land, or leave ORDER BY out",
            )),
            LogicalPlan::Limit(_) => Some(refused(
                "LIMIT",
                "a stream has no end, so LIMIT would stop the query's output for ever",
                "filter with WHERE instead",
            )),
            LogicalPlan::Join(join) => refused_join(join, tables),
            LogicalPlan::Window(_) => Some(refused(
                "a window function (OVER)",
                "it needs rows from across batches",
                "project and filter rows here; to keep each key's first row, write SELECT \
                 DISTINCT ON (key) or ROW_NUMBER() OVER (PARTITION BY key ORDER BY the event \
                 time) = 1 as the outermost filter",
            )),
            LogicalPlan::Subquery(_) => Some(refused(
                "a subquery",
                "a subquery over a stream needs state",
                "write the condition on the row's own columns",
            )),
            LogicalPlan::Dml(_) | LogicalPlan::Ddl(_) | LogicalPlan::Copy(_) => Some(refused(
                "a statement other than SELECT",
                "a query only reads the stream; its rows go to [sink]",
                "write a SELECT",
            )),
            LogicalPlan::Explain(_) | LogicalPlan::Analyze(_) | LogicalPlan::DescribeTable(_) => {
                Some(refused(
                    "EXPLAIN or DESCRIBE",
                    "a query's rows go to [sink]",
                    "write a SELECT",
                ))
            }
            LogicalPlan::RecursiveQuery(_) => Some(refused(
                "a recursive query",
                "it needs state",
                "write a SELECT without WITH RECURSIVE",
            )),
            _ => None,
        };
        if let Some(problem) = problem {
            found = Some(problem);
            return Ok(TreeNodeRecursion::Stop);
        }
        node.apply_expressions(|expr| {
            expr.apply(|e| {
                if let Some(problem) = refused_expression(e) {
                    found = Some(problem);
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    match found {
        Some(problem) => Err(problem),
        None => Ok(()),
    }
}

/// A join of two streams (or a stream with itself), or keys of two types.
fn refused_join(join: &Join, tables: &[String]) -> Option<SqlError> {
    let scans_stream = |plan: &LogicalPlan| {
        let mut found = false;
        let _ = plan.apply(|node| {
            found |= matches!(node, LogicalPlan::TableScan(scan)
                if tables.iter().any(|t| scan.table_name.table() == t));
            Ok(TreeNodeRecursion::Continue)
        });
        found
    };
    if scans_stream(&join.left) && scans_stream(&join.right) {
        let what = match tables {
            [_] => "a join of the stream with itself",
            _ => "a join of two streams, or of a stream with itself",
        };
        return Some(refused(
            what,
            "joining two streams keeps each side's rows as state until the other side's \
             match arrives, which Sluice does not do yet",
            "compute each side's columns in one SELECT over the source table, or join the \
             stream with a lookup table ([tables.<name>])",
        ));
    }
    let mut pairs: Vec<(Expr, Expr)> = join.on.clone();
    if let Some(filter) = &join.filter {
        for conjunct in datafusion::logical_expr::utils::split_conjunction(filter) {
            if let Expr::BinaryExpr(b) = conjunct
                && b.op == datafusion::logical_expr::Operator::Eq
            {
                pairs.push((b.left.as_ref().clone(), b.right.as_ref().clone()));
            }
        }
    }
    for (a, b) in pairs {
        let typed = |e: &Expr| {
            e.get_type(join.left.schema())
                .ok()
                .map(|t| (t, true))
                .or_else(|| e.get_type(join.right.schema()).ok().map(|t| (t, false)))
        };
        let (Some((a_type, a_left)), Some((b_type, b_left))) = (typed(&a), typed(&b)) else {
            continue;
        };
        if a_left != b_left && !comparable(&a_type, &b_type) {
            let (a_type, b_type) = (sql_type(&a_type), sql_type(&b_type));
            return Some(SqlError::Plan(format!(
                "the join key {a} is {a_type} and {b} is {b_type}: cast one side so that both \
                 are of one type, like CAST({b} AS {a_type})"
            )));
        }
    }
    None
}

/// Whether keys of these types may be compared without a cast written out:
/// numbers with numbers, text with text.
fn comparable(a: &DataType, b: &DataType) -> bool {
    let text =
        |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
    a == b || (a.is_numeric() && b.is_numeric()) || (text(a) && text(b))
}

fn refused_expression(expr: &Expr) -> Option<SqlError> {
    match expr {
        Expr::ScalarFunction(f) if f.func.signature().volatility != Volatility::Immutable => {
            Some(refused(
                &format!("{}()", f.func.name()),
                "its value depends on when or how often it runs, so a batch replayed after a \
                 crash would give other rows, and output would no longer be exactly once",
                "use the record's own columns, such as timestamp, or compute it downstream",
            ))
        }
        Expr::WindowFunction(_) => Some(refused(
            "a window function (OVER)",
            "it needs rows from across batches",
            "project and filter rows here; to keep each key's first row, write SELECT \
             DISTINCT ON (key) or ROW_NUMBER() OVER (PARTITION BY key ORDER BY the event \
             time) = 1 as the outermost filter",
        )),
        Expr::ScalarSubquery(_) | Expr::InSubquery(_) | Expr::Exists(_) => Some(refused(
            "a subquery",
            "a subquery over a stream needs state",
            "write the condition on the row's own columns",
        )),
        _ => None,
    }
}

/// DataFusion's message on one line, with what only our users need to know.
fn planning_error(error: DataFusionError, tables: &[String]) -> SqlError {
    let error = error.find_root();
    let message = one_line(&error.to_string());
    let message = message
        .strip_prefix("Error during planning: ")
        .or_else(|| message.strip_prefix("Schema error: "))
        .unwrap_or(&message)
        // A query names its tables plainly, without DataFusion's catalog and
        // schema.
        .replace("'datafusion.public.", "'");
    match error {
        DataFusionError::SQL(parser, _) => SqlError::Syntax(one_line(&parser.to_string())),
        _ if message.contains("table '") && message.contains("not found") => {
            let streams = match tables {
                [one] => format!("the stream is the table `{one}` ([source] table)"),
                more => format!(
                    "the streams are the tables {} ([sources.<table>])",
                    more.iter()
                        .map(|t| format!("`{t}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            SqlError::Plan(format!(
                "{message}; {streams}, and a lookup table is declared as [tables.<name>]"
            ))
        }
        _ if message.contains("got Binary") => SqlError::Plan(format!(
            "{message}; the Kafka columns `key` and `value` are bytes: read them as text with \
             CAST(value AS STRING), or declare the value's columns with source.format and schema"
        )),
        _ => SqlError::Plan(message),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, Int32Array, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Int32Type, Int64Type, Schema};

    use super::*;

    fn input() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("order", DataType::Int64, true),
            Field::new("customer", DataType::Utf8, true),
            Field::new("timestampType", DataType::Int32, false),
        ]))
    }

    #[tokio::test]
    async fn a_query_runs_again_on_every_batch() {
        let query = StreamQuery::plan(
            "SELECT order * 10 AS o, upper(customer) AS c FROM orders WHERE order > 1",
            "orders",
            input(),
        )
        .await
        .unwrap();
        for round in 0..3_i64 {
            let batch = RecordBatch::try_new(
                input(),
                vec![
                    Arc::new(Int64Array::from(vec![1 + round, 2 + round, 3 + round])),
                    Arc::new(StringArray::from(vec!["a", "b", "c"])),
                    Arc::new(arrow::array::Int32Array::from(vec![0, 0, 0])),
                ],
            )
            .unwrap();
            let out = query.run(batch).await.unwrap();
            let rows: usize = out.iter().map(RecordBatch::num_rows).sum();
            assert_eq!(rows, if round == 0 { 2 } else { 3 });
            let first = out[0].column(0).as_primitive::<Int64Type>().value(0);
            assert_eq!(first, if round == 0 { 20 } else { 10 * (1 + round) });
            let customer = out[0].column(1).as_string::<i32>().value(0);
            assert_eq!(customer, if round == 0 { "B" } else { "A" });
        }
    }

    #[tokio::test]
    async fn camel_case_columns_resolve_as_written() {
        let query = StreamQuery::plan("SELECT timestampType FROM orders", "orders", input())
            .await
            .unwrap();
        let schema = query.schema();
        let fields: Vec<(&str, &DataType)> = schema
            .fields()
            .iter()
            .map(|f| (f.name().as_str(), f.data_type()))
            .collect();
        assert_eq!(fields, [("timestampType", &DataType::Int32)]);
        let batch = RecordBatch::try_new(
            input(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(StringArray::from(vec!["A", "B"])),
                Arc::new(Int32Array::from(vec![0, 1])),
            ],
        )
        .unwrap();
        let out = query.run(batch).await.unwrap();
        let values: Vec<i32> = out
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<Int32Type>().values().to_vec())
            .collect();
        assert_eq!(values, [0, 1]);
    }

    #[tokio::test]
    async fn sparks_kafka_columns_need_no_quotes() {
        let kafka = crate::Decoder::new(crate::Format::Raw, true).schema();
        let query = StreamQuery::plan(
            "SELECT key, value, topic, partition, offset, timestamp, timestampType, headers, \
             `offset` + 1 AS next FROM source WHERE offset >= 0 AND partition = 0",
            "source",
            kafka,
        )
        .await
        .unwrap();
        let schema = query.schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(
            names,
            [
                "key",
                "value",
                "topic",
                "partition",
                "offset",
                "timestamp",
                "timestampType",
                "headers",
                "next"
            ]
        );
        assert_eq!(schema.field(8).data_type(), &DataType::Int64);
    }

    #[tokio::test]
    async fn what_a_stream_cannot_do_is_refused_with_the_reason() {
        for (sql, expected) in [
            (
                "SELECT order FROM orders ORDER BY order",
                "ORDER BY cannot run on a stream",
            ),
            ("SELECT now() FROM orders", "now() cannot run on a stream"),
            ("SELECT uuid() FROM orders", "uuid() cannot run on a stream"),
            (
                "SELECT current_timestamp AS t FROM orders",
                "now() cannot run on a stream",
            ),
            (
                "SELECT order FROM orders OFFSET 3",
                "LIMIT cannot run on a stream",
            ),
            (
                "SELECT count(*) FROM (SELECT customer, count(*) AS n FROM orders GROUP BY customer)",
                "more than one aggregation cannot run on a stream",
            ),
            (
                "SELECT customer, count(*) FROM orders GROUP BY ROLLUP(customer)",
                "GROUPING SETS, ROLLUP or CUBE cannot run",
            ),
            (
                "SELECT array_agg(order ORDER BY order) FROM orders",
                "depends on the order rows arrive in",
            ),
        ] {
            let err = StreamQuery::plan(sql, "orders", input())
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{sql}: {err}");
            assert!(!err.contains('\n'), "{sql}: {err}");
        }
    }

    #[tokio::test]
    async fn the_documented_stateless_surface_plans_and_runs() {
        let raw = crate::Decoder::new(crate::Format::Raw, false);
        let mut chunk = sluice_core::RecordChunk::default();
        chunk.push_record(&sluice_core::Record {
            topic: Arc::from("orders"),
            partition: 1,
            offset: sluice_core::Offset::new(5).unwrap(),
            timestamp_ms: Some(1_700_000_000_000),
            timestamp_type: sluice_core::TimestampType::CreateTime,
            key: Some(b"k".to_vec()),
            value: Some(
                br#"{"customer":"ann","order":7,"amount":120.5,"tags":["a","b"]}"#.to_vec(),
            ),
            headers: Vec::new(),
        });
        let rows = raw.decode(&chunk).unwrap().batch;
        for sql in [
            "SELECT json_get_str(CAST(value AS STRING), 'customer') AS c, \
             json_get_int(CAST(value AS STRING), 'order') AS o FROM source \
             WHERE json_get_float(CAST(value AS STRING), 'amount') > 100",
            "SELECT CAST(value AS STRING)->>'customer' AS c FROM source",
            // docs/sql.md's example.
            "WITH j AS (SELECT CAST(value AS STRING) AS v, partition, offset FROM source) \
             SELECT json_get_str(v, 'customer') AS customer, v->>'order' AS order, partition, offset \
             FROM j WHERE json_get_float(v, 'amount') > 100",
            "WITH j AS (SELECT CAST(value AS STRING) AS v FROM source) \
             SELECT json_length(v, 'tags') AS n, json_contains(v, 'order') AS has FROM j",
            "SELECT TRY_CAST(CAST(key AS STRING) AS INT) AS k, upper(topic) AS t FROM source",
            "WITH o AS (SELECT partition, offset FROM source) SELECT offset + 1 AS next FROM o",
            "SELECT unnest(make_array(1, 2)) AS n FROM source",
            "SELECT date_trunc('hour', timestamp) AS h, regexp_replace(topic, 'o', '0') AS r, \
             sha256(value) AS d, to_hex(offset) AS x FROM source",
            "SELECT CASE WHEN partition = 1 THEN 'one' ELSE 'other' END AS p FROM source",
        ] {
            let query = StreamQuery::plan(sql, "source", raw.schema())
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let out = query
                .run(rows.clone())
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let made: usize = out.iter().map(RecordBatch::num_rows).sum();
            assert!(made >= 1, "{sql}: no rows");
        }
        let binary = StreamQuery::plan(
            "SELECT json_get_str(value, 'customer') AS c FROM source",
            "source",
            raw.schema(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(binary.contains("CAST(value AS STRING)"), "{binary}");
        let query = StreamQuery::plan(
            "SELECT CAST(value AS STRING)->>'customer' AS c FROM source",
            "source",
            raw.schema(),
        )
        .await
        .unwrap();
        let out = query.run(rows).await.unwrap();
        let customer = arrow::util::display::array_value_to_string(out[0].column(0), 0).unwrap();
        assert_eq!(customer, "ann");
    }

    #[tokio::test]
    async fn union_all_gives_the_rows_of_both_sides() {
        let query = StreamQuery::plan(
            "SELECT order FROM orders UNION ALL SELECT order + 10 FROM orders WHERE order > 1",
            "orders",
            input(),
        )
        .await
        .unwrap();
        for _ in 0..2 {
            let batch = RecordBatch::try_new(
                input(),
                vec![
                    Arc::new(Int64Array::from(vec![1, 2])),
                    Arc::new(StringArray::from(vec!["a", "b"])),
                    Arc::new(arrow::array::Int32Array::from(vec![0, 0])),
                ],
            )
            .unwrap();
            let mut orders: Vec<i64> = query
                .run(batch)
                .await
                .unwrap()
                .iter()
                .flat_map(|b| b.column(0).as_primitive::<Int64Type>().values().to_vec())
                .collect();
            orders.sort_unstable();
            assert_eq!(orders, [1, 2, 12]);
        }
    }
}
