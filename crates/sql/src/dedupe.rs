//! `SELECT DISTINCT ON (keys) ...` over a stream: deduplication on chosen keys
//! within the watermark, as Spark's `dropDuplicatesWithinWatermark`.
//!
//! The plan below the `DISTINCT ON` runs on every chunk, projected to the keys,
//! the selected columns and the event time; [`sluice_state::Dedupe`] then keeps
//! the rows whose key it has not seen, and they are the query's output at once
//! (append mode). A key is forgotten once the watermark passes its first row's
//! event time plus the watermark delay.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{Schema, SchemaRef};
use datafusion::common::Column;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Distinct, DistinctOn, Expr, LogicalPlan, LogicalPlanBuilder};
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
