//! `SELECT DISTINCT ON (keys) ...` over a stream: deduplication on chosen keys
//! within the watermark, as Spark's `dropDuplicatesWithinWatermark`.
//!
//! The plan below the `DISTINCT ON` runs on every chunk, projected to the keys,
//! the selected columns and the event time; [`sluice_state::Dedupe`] then keeps
//! the rows whose key it has not seen, and they are the query's output at once
//! (append mode). A key is forgotten once the watermark passes its first row's
//! event time plus the watermark delay. Flink's idiom, `ROW_NUMBER() OVER
//! (PARTITION BY keys ORDER BY ts) = 1`, is rewritten into the same
//! `DISTINCT ON` ([`row_number_first`]).

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{Schema, SchemaRef};
use std::collections::HashMap;

use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{Column, ScalarValue};
use datafusion::logical_expr::expr::{WindowFunction, WindowFunctionParams};
use datafusion::logical_expr::{
    Distinct, DistinctOn, Expr, LogicalPlan, LogicalPlanBuilder, Operator, WindowFunctionDefinition,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionContext;
use sluice_state::{Dedupe, OutputMode};

use crate::SqlError;
use crate::error::refused;
use crate::options::QueryOptions;

/// The name of the event-time column the plan below hands the deduplication.
const EVENT_TIME: &str = "__sluice_event_time";

/// A query's keyed deduplication: its seen keys, and where its input's
/// columns are.
pub(crate) struct KeyedDedupe {
    pub(crate) dedupe: Dedupe,
    /// The leading columns of the plan below: the keys.
    keys: usize,
    /// The output's schema: the selected columns, after the keys.
    output: SchemaRef,
}

/// The query's `DISTINCT ON`, when it is the outermost operator; refused
/// anywhere else.
pub(crate) fn distinct_on(plan: &LogicalPlan) -> Result<Option<&DistinctOn>, SqlError> {
    if let LogicalPlan::Distinct(Distinct::On(on)) = plan {
        return Ok(Some(on));
    }
    let mut nested = false;
    let _ = plan.apply(|node| {
        nested |= matches!(node, LogicalPlan::Distinct(Distinct::On(_)));
        Ok(TreeNodeRecursion::Continue)
    });
    if nested {
        return Err(refused(
            "DISTINCT ON inside another query",
            "a keyed deduplication keeps state across batches, and only the outermost SELECT \
             may hold it",
            "write SELECT DISTINCT ON (...) as the outermost SELECT",
        ));
    }
    Ok(None)
}

/// The query as a `DISTINCT ON`, when it is Flink's deduplication idiom:
/// `SELECT cols FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY keys ORDER BY
/// ts) AS rn FROM source) WHERE rn = 1`, ordered by the event-time column
/// `event_time` ascending, which keeps each key's first row as `DISTINCT ON`
/// does. `None` when the plan is not that shape.
pub(crate) fn row_number_first(
    plan: &LogicalPlan,
    event_time: Option<&str>,
) -> Result<Option<LogicalPlan>, SqlError> {
    let (outer, filter) = match plan {
        LogicalPlan::Projection(p) => match p.input.as_ref() {
            LogicalPlan::Filter(f) => (Some(p), f),
            _ => return Ok(None),
        },
        LogicalPlan::Filter(f) => (None, f),
        _ => return Ok(None),
    };
    let below_filter = match filter.input.as_ref() {
        LogicalPlan::SubqueryAlias(alias) => alias.input.as_ref(),
        other => other,
    };
    let LogicalPlan::Projection(inner) = below_filter else {
        return Ok(None);
    };
    let LogicalPlan::Window(window) = inner.input.as_ref() else {
        return Ok(None);
    };
    let [window_expr] = window.window_expr.as_slice() else {
        return Ok(None);
    };
    let Expr::WindowFunction(function) = window_expr.clone().unalias() else {
        return Ok(None);
    };
    let WindowFunction {
        fun,
        params:
            WindowFunctionParams {
                args,
                partition_by,
                order_by,
                ..
            },
    } = *function;
    let WindowFunctionDefinition::WindowUDF(udf) = fun else {
        return Ok(None);
    };
    if udf.name() != "row_number" || !args.is_empty() || partition_by.is_empty() {
        return Ok(None);
    }
    // The column the window adds, and the names the inner projection gives it.
    let window_column = window
        .schema
        .field(window.schema.fields().len() - 1)
        .name()
        .clone();
    let mut columns: HashMap<String, Expr> = HashMap::new();
    let mut rank_names = Vec::new();
    for (expr, field) in inner.expr.iter().zip(inner.schema.fields()) {
        let unaliased = expr.clone().unalias();
        if matches!(&unaliased, Expr::Column(c) if c.name == window_column) {
            rank_names.push(field.name().clone());
            columns.insert(
                field.name().clone(),
                Expr::Literal(ScalarValue::UInt64(Some(1)), None).alias(field.name()),
            );
        } else {
            columns.insert(field.name().clone(), unaliased);
        }
    }
    if !keeps_only_the_first(&filter.predicate, &rank_names) {
        return Ok(None);
    }
    let ordered_by_event_time = match (order_by.as_slice(), event_time) {
        ([sort], Some(event_time)) => {
            sort.asc && matches!(&sort.expr, Expr::Column(c) if c.name == event_time)
        }
        _ => false,
    };
    if !ordered_by_event_time {
        return Err(refused(
            "ROW_NUMBER() = 1 not ordered by the event time ascending",
            "a stream keeps each key's first row by event time, as it arrives within the \
             watermark; the last row, or the first in another order, is known only once all of \
             a key's rows are in",
            "ORDER BY the event-time column (source.event_time, or timestamp) ascending, with a \
             watermark",
        ));
    }
    let rename = |expr: &Expr| -> Result<Expr, SqlError> {
        expr.clone()
            .transform(|e| match &e {
                Expr::Column(c) => match columns.get(&c.name) {
                    Some(inner) => Ok(Transformed::yes(inner.clone().unalias())),
                    None => Ok(Transformed::no(e)),
                },
                _ => Ok(Transformed::no(e)),
            })
            .map(|t| t.data)
            .map_err(|e| SqlError::Internal(format!("planning ROW_NUMBER() = 1: {e}")))
    };
    let select_expr = match outer {
        Some(outer) => outer
            .expr
            .iter()
            .zip(outer.schema.fields())
            .map(|(e, field)| Ok(rename(&e.clone().unalias())?.alias(field.name())))
            .collect::<Result<Vec<_>, SqlError>>()?,
        None => inner
            .schema
            .fields()
            .iter()
            .map(|field| columns[field.name()].clone().unalias().alias(field.name()))
            .collect(),
    };
    let on = DistinctOn::try_new(partition_by, select_expr, None, window.input.clone())
        .map_err(|e| SqlError::Internal(format!("planning ROW_NUMBER() = 1: {e}")))?;
    Ok(Some(LogicalPlan::Distinct(Distinct::On(on))))
}

/// Whether `predicate` is `rank = 1` (either way round), `rank <= 1` or
/// `rank < 2` on one of the columns `ranks`.
fn keeps_only_the_first(predicate: &Expr, ranks: &[String]) -> bool {
    let Expr::BinaryExpr(binary) = predicate else {
        return false;
    };
    let rank = |e: &Expr| matches!(e, Expr::Column(c) if ranks.contains(&c.name));
    let number = |e: &Expr| match e {
        Expr::Literal(value, _) => value.cast_to(&arrow::datatypes::DataType::Int64).ok(),
        _ => None,
    };
    let one = Some(ScalarValue::Int64(Some(1)));
    let two = Some(ScalarValue::Int64(Some(2)));
    match binary.op {
        Operator::Eq => {
            (rank(&binary.left) && number(&binary.right) == one)
                || (rank(&binary.right) && number(&binary.left) == one)
        }
        Operator::LtEq => rank(&binary.left) && number(&binary.right) == one,
        Operator::Lt => rank(&binary.left) && number(&binary.right) == two,
        _ => false,
    }
}

/// Plans `on`: the plan below it to run on every chunk, and the deduplication.
pub(crate) async fn plan(
    ctx: &SessionContext,
    on: &DistinctOn,
    options: &QueryOptions,
) -> Result<(Arc<dyn ExecutionPlan>, KeyedDedupe), SqlError> {
    let Some(event_time) = options.watermark_column.as_deref() else {
        return Err(refused(
            "DISTINCT ON without a watermark",
            "its seen keys would be kept for ever: a key is forgotten once the watermark \
             passes its first row's event time plus the delay",
            "set source.watermark_delay (and source.event_time for a column of the value)",
        ));
    };
    if on.sort_expr.is_some() {
        return Err(refused(
            "ORDER BY with DISTINCT ON",
            "a stream keeps the first row of each key to arrive (as Spark's \
             dropDuplicatesWithinWatermark), and which row comes first in another order is \
             known only once all of a key's rows are in",
            "leave ORDER BY out",
        ));
    }
    if matches!(
        options.output_mode,
        Some(OutputMode::Complete | OutputMode::Update)
    ) {
        return Err(refused(
            "output_mode other than append with DISTINCT ON",
            "a deduplication emits each key's first row once, when it arrives",
            "leave output_mode out (append)",
        ));
    }
    let mut aggregates = false;
    let _ = on.input.apply(|node| {
        aggregates |= matches!(
            node,
            LogicalPlan::Aggregate(_) | LogicalPlan::Distinct(Distinct::All(_))
        );
        Ok(TreeNodeRecursion::Continue)
    });
    if aggregates {
        return Err(refused(
            "DISTINCT ON over an aggregation",
            "Sluice runs one stateful operator per query, and both keep state across batches",
            "deduplicate the source's rows, or aggregate them, in one query",
        ));
    }
    if !on
        .input
        .schema()
        .has_column_with_unqualified_name(event_time)
    {
        return Err(refused(
            "DISTINCT ON over a subquery without the event-time column",
            "a key is kept until the watermark passes its row's event time, so the rows it \
             deduplicates need the source's event-time column",
            "deduplicate the source table's rows, or keep the event-time column in the subquery",
        ));
    }
    let mut exprs: Vec<Expr> = on
        .on_expr
        .iter()
        .enumerate()
        .map(|(i, e)| e.clone().alias(format!("__sluice_key_{i}")))
        .collect();
    exprs.extend(
        on.select_expr
            .iter()
            .zip(on.schema.fields())
            .map(|(e, field)| e.clone().alias(field.name())),
    );
    exprs.push(Expr::Column(Column::from_name(event_time)).alias(EVENT_TIME));
    let below = LogicalPlanBuilder::from(on.input.as_ref().clone())
        .project(exprs)
        .and_then(LogicalPlanBuilder::build)
        .map_err(|e| SqlError::Internal(format!("planning DISTINCT ON: {e}")))?;
    let below = ctx
        .state()
        .create_physical_plan(&below)
        .await
        .map_err(|e| SqlError::Internal(format!("planning DISTINCT ON: {e}")))?;
    let schema = below.schema();
    let keys = on.on_expr.len();
    let selected = on.select_expr.len();
    let key_fields = schema.fields()[..keys]
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    let output = Arc::new(Schema::new(schema.fields()[keys..keys + selected].to_vec()));
    let delay_ms = options.watermark_delay_ms.unwrap_or(0);
    let dedupe = Dedupe::new(key_fields, delay_ms)?
        .with_partitions(options.state_partitions.unwrap_or(1))
        .with_memory_limit(options.state_memory_bytes.unwrap_or(u64::MAX));
    Ok((
        below,
        KeyedDedupe {
            dedupe,
            keys,
            output,
        },
    ))
}

impl KeyedDedupe {
    /// The schema of the rows it keeps.
    pub(crate) fn schema(&self) -> SchemaRef {
        self.output.clone()
    }

    /// The rows of `batch` (a batch of the plan below) whose key it has not
    /// seen, with the selected columns only.
    pub(crate) fn keep(&mut self, batch: &RecordBatch) -> Result<RecordBatch, SqlError> {
        let columns = batch.columns();
        let keys = &columns[..self.keys];
        let selected = &columns[self.keys..self.keys + self.output.fields().len()];
        let event_ms = sluice_state::epoch_millis(&columns[columns.len() - 1])
            .map_err(|e| SqlError::Internal(format!("event time of DISTINCT ON: {e}")))?;
        let mask = self.dedupe.keep(keys, &event_ms)?;
        let kept = selected
            .iter()
            .map(|c| arrow::compute::filter(c, &mask))
            .collect::<Result<Vec<ArrayRef>, _>>()
            .map_err(|e| SqlError::Internal(format!("DISTINCT ON: {e}")))?;
        RecordBatch::try_new(self.output.clone(), kept)
            .map_err(|e| SqlError::Internal(format!("DISTINCT ON: {e}")))
    }
}
