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
use arrow::datatypes::SchemaRef;
use datafusion::catalog::streaming::StreamingTable;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::DataFusionError;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, LogicalPlan, Volatility};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::PartitionStream;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;

use crate::SqlError;

/// A stateless query over the source table, ready to run chunk after chunk.
pub struct StreamQuery {
    plan: Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    slot: Arc<Slot>,
    schema: SchemaRef,
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
        let slot = Arc::new(Slot::default());
        let partition = Arc::new(SlotPartition {
            schema: input.clone(),
            slot: slot.clone(),
        });
        let source = StreamingTable::try_new(input.clone(), vec![partition])
            .map_err(|e| SqlError::Internal(e.to_string()))?;
        ctx.register_table(table, Arc::new(source))
            .map_err(|e| SqlError::Internal(e.to_string()))?;

        only_one_select(sql)?;
        let logical = ctx
            .state()
            .create_logical_plan(sql)
            .await
            .map_err(|e| planning_error(e, table))?;
        refuse_what_streams_cannot_do(&logical)?;
        let frame = ctx
            .execute_logical_plan(logical)
            .await
            .map_err(|e| planning_error(e, table))?;
        let plan = frame
            .create_physical_plan()
            .await
            .map_err(|e| planning_error(e, table))?;
        let schema = plan.schema();
        Ok(StreamQuery {
            plan,
            task: ctx.task_ctx(),
            slot,
            schema,
        })
    }

    /// The schema of the rows the query makes.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The query's rows for the source rows in `input`.
    pub async fn run(&self, input: RecordBatch) -> Result<Vec<RecordBatch>, SqlError> {
        *self.slot.0.lock().unwrap_or_else(PoisonError::into_inner) = vec![input];
        let out = self.run_partitions().await;
        self.slot
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        out
    }

    /// The query's rows for each row of `input` on its own, and the rows it
    /// failed on, with the reason: for a chunk the query failed on as a whole.
    pub async fn run_each(
        &self,
        input: &RecordBatch,
    ) -> Result<(Vec<RecordBatch>, Vec<(usize, String)>), SqlError> {
        let mut rows = Vec::new();
        let mut failed = Vec::new();
        for row in 0..input.num_rows() {
            match self.run(input.slice(row, 1)).await {
                Ok(out) => rows.extend(out),
                Err(SqlError::Execution(reason)) => failed.push((row, reason)),
                Err(e) => return Err(e),
            }
        }
        Ok((rows, failed))
    }

    /// Every output partition of the plan in turn: a UNION ALL has one per side.
    async fn run_partitions(&self) -> Result<Vec<RecordBatch>, SqlError> {
        let mut out = Vec::new();
        let partitions = self.plan.output_partitioning().partition_count();
        for partition in 0..partitions {
            let mut stream = self
                .plan
                .execute(partition, self.task.clone())
                .map_err(|e| SqlError::Execution(one_line(&e.to_string())))?;
            while let Some(batch) = stream.next().await {
                let batch = batch.map_err(|e| SqlError::Execution(one_line(&e.to_string())))?;
                if batch.num_rows() > 0 {
                    out.push(batch);
                }
            }
        }
        Ok(out)
    }
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

/// A refusal of a construct that needs the whole stream, or state.
fn refused(what: &str, why: &str, instead: &str) -> SqlError {
    SqlError::Refused {
        what: what.to_owned(),
        why: why.to_owned(),
        instead: instead.to_owned(),
    }
}

/// Walks the plan and its expressions for what a stateless query over an
/// unbounded stream cannot do.
fn refuse_what_streams_cannot_do(plan: &LogicalPlan) -> Result<(), SqlError> {
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
            LogicalPlan::Join(_) => Some(refused(
                "a join",
                "joining the stream with itself needs state across batches",
                "compute each side's columns in one SELECT over the source table",
            )),
            LogicalPlan::Aggregate(_) | LogicalPlan::Distinct(_) => Some(refused(
                "aggregation (GROUP BY, DISTINCT or an aggregate function)",
                "aggregating a stream needs state and event-time windows, which come with windowed \
                 aggregation",
                "project and filter rows here, and aggregate downstream for now",
            )),
            LogicalPlan::Window(_) => Some(refused(
                "a window function (OVER)",
                "it needs rows from across batches",
                "project and filter rows here",
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
        Expr::AggregateFunction(_) => Some(refused(
            "an aggregate function",
            "aggregating a stream needs state and event-time windows, which come with windowed \
             aggregation",
            "project and filter rows here, and aggregate downstream for now",
        )),
        Expr::WindowFunction(_) => Some(refused(
            "a window function (OVER)",
            "it needs rows from across batches",
            "project and filter rows here",
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
fn planning_error(error: DataFusionError, table: &str) -> SqlError {
    let error = error.find_root();
    let message = one_line(&error.to_string());
    let message = message
        .strip_prefix("Error during planning: ")
        .or_else(|| message.strip_prefix("Schema error: "))
        .unwrap_or(&message)
        .to_owned();
    match error {
        DataFusionError::SQL(parser, _) => SqlError::Syntax(one_line(&parser.to_string())),
        _ if message.contains("table '") && message.contains("not found") => SqlError::Plan(
            format!("{message}; the stream is the table `{table}` ([source] table)"),
        ),
        _ if message.contains("got Binary") => SqlError::Plan(format!(
            "{message}; the Kafka columns `key` and `value` are bytes: read them as text with \
             CAST(value AS STRING), or declare the value's columns with source.format and schema"
        )),
        _ => SqlError::Plan(message),
    }
}

/// A message on one line: its lines joined.
pub(crate) fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema};

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
        let query = StreamQuery::plan("SELECT timestampType FROM orders", "orders", input()).await;
        assert!(query.is_ok(), "{:?}", query.err());
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
        .await;
        assert!(query.is_ok(), "{:?}", query.err());
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
            ("SELECT count(*) FROM orders", "aggregation"),
            ("SELECT DISTINCT customer FROM orders", "aggregation"),
            (
                "SELECT order FROM orders UNION SELECT order FROM orders",
                "aggregation",
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
        let mut chunk = sluice_offsets::RecordChunk::default();
        chunk.push_record(&sluice_offsets::Record {
            topic: Arc::from("orders"),
            partition: 1,
            offset: sluice_offsets::Offset::new(5).unwrap(),
            timestamp_ms: Some(1_700_000_000_000),
            timestamp_type: sluice_offsets::TimestampType::CreateTime,
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
