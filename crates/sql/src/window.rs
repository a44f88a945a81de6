//! Spark's event-time windows as SQL functions: `window(ts, '1 minute')` for
//! tumbling windows, `window(ts, '10 minutes', '1 minute')` for sliding ones and
//! `session_window(ts, '5 minutes')` for sessions.
//!
//! A window is a struct of `start` and `end` (of the event-time column's type),
//! the half-open interval `[start, end)`, aligned to the epoch as in Spark. A
//! tumbling window is one struct per row; a sliding one is the list of every
//! window the row falls in, which the query expands into one row each
//! (`unnest`); a session window is the row's own `[ts, ts + gap)`, merged with the
//! sessions it overlaps by the aggregation that keeps them.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, ListArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, FieldRef, Fields};
use datafusion::common::{DataFusionError, Result, ScalarValue, plan_err};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
    Volatility,
};

/// The name of the column a query's window is: `window.start`, `window.end`.
pub const WINDOW_COLUMN: &str = "window";

/// A duration in Spark's interval text (`'10 seconds'`, `'1 hour 30 minutes'`),
/// in milliseconds.
pub fn parse_duration(text: &str) -> Result<i64, String> {
    let mut words = text.split_whitespace();
    let mut total: i64 = 0;
    let mut any = false;
    while let Some(number) = words.next() {
        let (number, glued) = split_number(number);
        let amount: i64 = number.parse().map_err(|_| {
            format!("{text:?} is not a duration; write it as Spark does, such as '10 seconds'")
        })?;
        let unit = match glued {
            Some(unit) => unit.to_owned(),
            None => words
                .next()
                .ok_or_else(|| format!("{text:?} has no unit after {amount}"))?
                .to_owned(),
        };
        let unit_ms: i64 = match unit.to_ascii_lowercase().as_str() {
            "ms" | "millisecond" | "milliseconds" => 1,
            "s" | "sec" | "secs" | "second" | "seconds" => 1_000,
            "m" | "min" | "mins" | "minute" | "minutes" => 60_000,
            "h" | "hour" | "hours" => 3_600_000,
            "d" | "day" | "days" => 86_400_000,
            "w" | "week" | "weeks" => 7 * 86_400_000,
            other => {
                return Err(format!(
                    "unknown unit {other:?} in {text:?}; use milliseconds, seconds, minutes, \
                     hours, days or weeks (months and years have no fixed length)"
                ));
            }
        };
        total = amount
            .checked_mul(unit_ms)
            .and_then(|ms| total.checked_add(ms))
            .ok_or_else(|| format!("{text:?} is too long a duration"))?;
        any = true;
    }
    if !any {
        return Err(format!(
            "{text:?} is not a duration; write it as Spark does, such as '10 seconds'"
        ));
    }
    Ok(total)
}

/// `"10s"` as `("10", Some("s"))`, `"10"` as `("10", None)`.
fn split_number(word: &str) -> (&str, Option<&str>) {
    let digits = word
        .char_indices()
        .find(|(i, c)| !(c.is_ascii_digit() || (*i == 0 && *c == '-')))
        .map_or(word.len(), |(i, _)| i);
    match word.split_at(digits) {
        (number, "") => (number, None),
        (number, unit) => (number, Some(unit)),
    }
}

/// The windows a row at `ts` falls in, as their starts, for windows of
/// `duration_ms` starting every `slide_ms` from the epoch; latest first, as
/// Spark lists them.
pub fn window_starts(ts: i64, duration_ms: i64, slide_ms: i64) -> impl Iterator<Item = i64> {
    let last = ts - ts.rem_euclid(slide_ms);
    (0..)
        .map(move |i: i64| last - i * slide_ms)
        .take_while(move |start| *start > ts - duration_ms)
}

/// Which of the window functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowKind {
    /// `window(ts, duration[, slide])`.
    Window,
    /// `session_window(ts, gap)`.
    Session,
}

/// The SQL function.
#[derive(Debug, PartialEq, Eq, Hash)]
struct WindowFunction {
    kind: WindowKind,
    signature: Signature,
}

/// The window functions, to register with a session.
pub fn window_functions() -> Vec<ScalarUDF> {
    [WindowKind::Window, WindowKind::Session]
        .into_iter()
        .map(|kind| {
            ScalarUDF::new_from_impl(WindowFunction {
                kind,
                signature: Signature::variadic_any(Volatility::Immutable),
            })
        })
        .collect()
}

/// The struct of a window over event times of type `time`.
pub fn window_fields(time: &DataType) -> Fields {
    Fields::from(vec![
        Field::new("start", time.clone(), true),
        Field::new("end", time.clone(), true),
    ])
}

impl WindowFunction {
    fn name_of(&self) -> &'static str {
        match self.kind {
            WindowKind::Window => "window",
            WindowKind::Session => "session_window",
        }
    }

    /// The durations in milliseconds: (length or gap, slide).
    fn durations(&self, args: &[Option<&ScalarValue>]) -> Result<(i64, i64)> {
        let name = self.name_of();
        let text = |i: usize, what: &str| -> Result<i64> {
            match args.get(i).copied().flatten() {
                Some(
                    ScalarValue::Utf8(Some(s))
                    | ScalarValue::LargeUtf8(Some(s))
                    | ScalarValue::Utf8View(Some(s)),
                ) => {
                    let ms = parse_duration(s).map_err(|e| plan(format!("{name}(): {e}")))?;
                    if ms <= 0 {
                        return plan_err!("{name}(): the {what} {s:?} must be longer than zero");
                    }
                    Ok(ms)
                }
                _ => {
                    plan_err!("{name}(): the {what} must be a constant string such as '10 seconds'")
                }
            }
        };
        match (self.kind, args.len()) {
            (WindowKind::Window, 2) => {
                let length = text(1, "window duration")?;
                Ok((length, length))
            }
            (WindowKind::Window, 3) => {
                let length = text(1, "window duration")?;
                let slide = text(2, "slide duration")?;
                if slide > length {
                    return plan_err!(
                        "window(): the slide duration must not be longer than the window \
                         duration, or rows between windows would belong to none"
                    );
                }
                Ok((length, slide))
            }
            (WindowKind::Window, 4) => plan_err!(
                "window(): a start time offset (the fourth argument) is not supported; windows \
                 start at multiples of the slide from the epoch"
            ),
            (WindowKind::Window, _) => {
                plan_err!("window() takes an event time and a duration, and an optional slide")
            }
            (WindowKind::Session, 2) => {
                let gap = text(1, "gap duration")?;
                Ok((gap, gap))
            }
            (WindowKind::Session, _) => {
                plan_err!("session_window() takes an event time and a gap duration")
            }
        }
    }
}

fn plan(message: String) -> DataFusionError {
    DataFusionError::Plan(message)
}

impl ScalarUDFImpl for WindowFunction {
    fn name(&self) -> &str {
        self.name_of()
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, _arg_types: &[DataType]) -> Result<DataType> {
        Err(DataFusionError::Internal(
            "the window functions' type comes from return_field_from_args".to_owned(),
        ))
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        let name = self.name_of();
        let Some(time) = args.arg_fields.first() else {
            return plan_err!("{name}() needs an event-time column as its first argument");
        };
        if !matches!(time.data_type(), DataType::Timestamp(_, _)) {
            return plan_err!(
                "{name}(): the event time {} is {}, and must be a TIMESTAMP",
                time.name(),
                time.data_type()
            );
        }
        // Checked here, so that a bad duration fails at planning, not on the first rows.
        self.durations(args.scalar_arguments)?;
        let window = DataType::Struct(window_fields(time.data_type()));
        let sliding = self.kind == WindowKind::Window && args.arg_fields.len() == 3;
        let data_type = if sliding {
            // One row per window the row falls in, once expanded.
            DataType::List(Arc::new(Field::new_list_field(window, true)))
        } else {
            window
        };
        Ok(Arc::new(Field::new(name, data_type, true)))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let literals: Vec<Option<ScalarValue>> = args
            .args
            .iter()
            .map(|a| match a {
                ColumnarValue::Scalar(s) => Some(s.clone()),
                ColumnarValue::Array(_) => None,
            })
            .collect();
        let refs: Vec<Option<&ScalarValue>> = literals.iter().map(Option::as_ref).collect();
        let (length, slide) = self.durations(&refs)?;
        let time_type = args.arg_fields[0].data_type().clone();
        let times = args.args[0].to_array(args.number_rows)?;
        let millis = sluice_state::epoch_millis(&times)?;
        let fields = window_fields(&time_type);
        let sliding = self.kind == WindowKind::Window && args.args.len() == 3;
        if !sliding {
            let mut starts = Vec::with_capacity(millis.len());
            let mut ends = Vec::with_capacity(millis.len());
            for ts in millis.iter() {
                let start = ts.map(|ts| match self.kind {
                    WindowKind::Window => ts - ts.rem_euclid(length),
                    WindowKind::Session => ts,
                });
                starts.push(start);
                ends.push(start.map(|s| s + length));
            }
            let window = window_array(&fields, &time_type, starts, ends, millis.nulls())?;
            return Ok(ColumnarValue::Array(window));
        }
        let mut starts = Vec::new();
        let mut ends = Vec::new();
        let mut offsets = Vec::with_capacity(millis.len() + 1);
        offsets.push(0_i32);
        for ts in millis.iter() {
            if let Some(ts) = ts {
                for start in window_starts(ts, length, slide) {
                    starts.push(Some(start));
                    ends.push(Some(start + length));
                }
            }
            offsets.push(i32::try_from(starts.len()).map_err(|_| {
                DataFusionError::Execution("window(): too many windows in one chunk".to_owned())
            })?);
        }
        let windows = window_array(&fields, &time_type, starts, ends, None)?;
        let list = ListArray::try_new(
            Arc::new(Field::new_list_field(windows.data_type().clone(), true)),
            OffsetBuffer::new(offsets.into()),
            windows,
            millis.nulls().cloned(),
        )?;
        Ok(ColumnarValue::Array(Arc::new(list)))
    }
}

/// A struct array of windows from their bounds in milliseconds, in the event
/// time's own type.
fn window_array(
    fields: &Fields,
    time_type: &DataType,
    starts: Vec<Option<i64>>,
    ends: Vec<Option<i64>>,
    nulls: Option<&arrow::buffer::NullBuffer>,
) -> Result<ArrayRef> {
    let as_time = |ms: Vec<Option<i64>>| -> Result<ArrayRef> {
        Ok(sluice_state::from_epoch_millis(ms.into(), time_type)?)
    };
    let array = StructArray::try_new(
        fields.clone(),
        vec![as_time(starts)?, as_time(ends)?],
        nulls.cloned(),
    )?;
    Ok(Arc::new(array))
}

/// Whether `name` is the window column a rewritten query groups by.
pub(crate) fn is_window_key(name: &str, data_type: &DataType) -> bool {
    name == WINDOW_COLUMN
        && matches!(data_type, DataType::Struct(fields)
            if fields.len() == 2 && fields[0].name() == "start" && fields[1].name() == "end")
}

/// A query whose GROUP BY names a window function, rewritten so that the
/// window is a column of its own named `window` (as in Spark, where
/// `window.start` and `window.end` then resolve), computed below the
/// aggregation; a sliding window's list is expanded into a row per window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WindowGrouping {
    /// Which function.
    pub kind: WindowKind,
    /// The event-time argument, as written.
    pub time: String,
}

/// The query with its GROUP BY window made a column, and what the window is;
/// the query unchanged when it groups by no window function.
pub(crate) fn rewrite_window_grouping(
    sql: &str,
) -> Result<(String, Option<WindowGrouping>), crate::SqlError> {
    use datafusion::sql::parser::{DFParserBuilder, Statement};
    use datafusion::sql::sqlparser::ast::{
        Expr, FunctionArg, FunctionArgExpr, FunctionArguments, GroupByExpr, Ident, SelectItem,
        SetExpr, Statement as Sql,
    };
    use datafusion::sql::sqlparser::dialect::SparkSqlDialect;
    use datafusion::sql::sqlparser::parser::Parser;

    let syntax =
        |e: &dyn std::fmt::Display| crate::SqlError::Syntax(crate::error::one_line(&e.to_string()));
    let mut statements = DFParserBuilder::new(sql)
        .with_dialect(&SparkSqlDialect {})
        .build()
        .and_then(|mut parser| parser.parse_statements())
        .map_err(|e| syntax(&e))?;
    let Some(Statement::Statement(statement)) = statements.front_mut() else {
        return Ok((sql.to_owned(), None));
    };
    let Sql::Query(query) = statement.as_mut() else {
        return Ok((sql.to_owned(), None));
    };
    let SetExpr::Select(select) = query.body.as_mut() else {
        return Ok((sql.to_owned(), None));
    };
    let GroupByExpr::Expressions(keys, _) = &mut select.group_by else {
        return Ok((sql.to_owned(), None));
    };
    let kind_of = |expr: &Expr| match expr {
        Expr::Function(f) => match f.name.to_string().to_ascii_lowercase().as_str() {
            "window" => Some(WindowKind::Window),
            "session_window" => Some(WindowKind::Session),
            _ => None,
        },
        _ => None,
    };
    let windows: Vec<usize> = (0..keys.len())
        .filter(|i| kind_of(&keys[*i]).is_some())
        .collect();
    let index = match windows.as_slice() {
        [] => return Ok((sql.to_owned(), None)),
        [index] => *index,
        _ => {
            return Err(crate::SqlError::Refused {
                what: "GROUP BY more than one window".to_owned(),
                why: "a row's group has one event-time window, which decides when it is final"
                    .to_owned(),
                instead: "group by one window() or session_window() and plain columns".to_owned(),
            });
        }
    };
    let function = keys[index].clone();
    let kind = kind_of(&function).unwrap_or(WindowKind::Window);
    let Expr::Function(call) = &function else {
        return Ok((sql.to_owned(), None));
    };
    let args: Vec<&FunctionArg> = match &call.args {
        FunctionArguments::List(list) => list.args.iter().collect(),
        _ => Vec::new(),
    };
    let time = match args.first() {
        Some(FunctionArg::Unnamed(FunctionArgExpr::Expr(e))) => e.to_string(),
        _ => String::new(),
    };
    let sliding = kind == WindowKind::Window && args.len() == 3;
    let column = Expr::Identifier(Ident::with_quote('`', WINDOW_COLUMN));
    let text = function.to_string();
    keys[index] = column.clone();
    // The same call in the SELECT list means the window column.
    for item in &mut select.projection {
        match item {
            SelectItem::UnnamedExpr(e) if e.to_string() == text => {
                *item = SelectItem::ExprWithAlias {
                    expr: column.clone(),
                    alias: Ident::with_quote('`', WINDOW_COLUMN),
                };
            }
            SelectItem::ExprWithAlias { expr, .. } if expr.to_string() == text => {
                *expr = column.clone();
            }
            _ => {}
        }
    }
    if select.from.len() != 1 {
        return Ok((sql.to_owned(), None));
    }
    // The window is computed on the table whose column it reads: the one its
    // qualifier names (`o.timestamp` in a join), the first table otherwise.
    let qualifier = match args.first() {
        Some(FunctionArg::Unnamed(FunctionArgExpr::Expr(Expr::CompoundIdentifier(parts))))
            if parts.len() == 2 =>
        {
            Some(parts[0].value.clone())
        }
        _ => None,
    };
    let from = &mut select.from[0];
    let target = std::iter::once(&mut from.relation)
        .chain(from.joins.iter_mut().map(|j| &mut j.relation))
        .find(|r| qualifier.is_some() && table_alias(r) == qualifier);
    let target = match target {
        Some(target) => target,
        None => &mut select.from[0].relation,
    };
    let relation = target.to_string();
    let alias = table_alias(target).ok_or_else(|| crate::SqlError::Refused {
        what: "a window over this FROM clause".to_owned(),
        why: "the window is computed on the rows of one named table".to_owned(),
        instead: "name the source table, or a WITH table, in FROM".to_owned(),
    })?;
    let window = if sliding {
        format!("unnest({text})")
    } else {
        text
    };
    let wrapped = format!(
        "SELECT * FROM (SELECT *, {window} AS `{WINDOW_COLUMN}` FROM {relation}) AS `{alias}`"
    );
    let wrapped = Parser::new(&SparkSqlDialect {})
        .try_with_sql(&wrapped)
        .and_then(|mut p| p.parse_query())
        .map_err(|e| syntax(&e))?;
    let SetExpr::Select(inner) = *wrapped.body else {
        return Err(crate::SqlError::Internal(
            "the window rewrite lost its SELECT".to_owned(),
        ));
    };
    let Some(from) = inner.from.into_iter().next() else {
        return Err(crate::SqlError::Internal(
            "the window rewrite lost its FROM".to_owned(),
        ));
    };
    *target = from.relation;
    Ok((statement.to_string(), Some(WindowGrouping { kind, time })))
}

/// The name a FROM item's columns are qualified by.
fn table_alias(relation: &datafusion::sql::sqlparser::ast::TableFactor) -> Option<String> {
    use datafusion::sql::sqlparser::ast::TableFactor;
    match relation {
        TableFactor::Table { alias: Some(a), .. } | TableFactor::Derived { alias: Some(a), .. } => {
            Some(a.name.value.clone())
        }
        TableFactor::Table { name, .. } => name.0.last().map(|part| {
            part.as_ident()
                .map_or_else(|| part.to_string(), |ident| ident.value.clone())
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_spark_writes_them() {
        assert_eq!(parse_duration("10 seconds"), Ok(10_000));
        assert_eq!(parse_duration("1 minute"), Ok(60_000));
        assert_eq!(parse_duration("1 hour 30 minutes"), Ok(5_400_000));
        assert_eq!(parse_duration("500 milliseconds"), Ok(500));
        assert_eq!(parse_duration("10s"), Ok(10_000));
        assert_eq!(parse_duration("2 DAYS"), Ok(172_800_000));
        let unknown = parse_duration("1 fortnight").unwrap_err();
        assert!(unknown.contains("unknown unit \"fortnight\""), "{unknown}");
        assert!(parse_duration("").is_err());
        assert!(parse_duration("ten seconds").is_err());
        assert!(parse_duration("10").unwrap_err().contains("no unit"));
    }

    #[test]
    fn a_row_falls_in_every_sliding_window_that_covers_it() {
        let starts: Vec<i64> = window_starts(125, 100, 25).collect();
        assert_eq!(starts, [125, 100, 75, 50]);
        let tumbling: Vec<i64> = window_starts(125, 100, 100).collect();
        assert_eq!(tumbling, [100]);
        let negative: Vec<i64> = window_starts(-1, 10, 10).collect();
        assert_eq!(negative, [-10]);
    }
}
