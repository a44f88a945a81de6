//! Event times as epoch milliseconds, and back.
//!
//! A timestamp's values are instants since the epoch in UTC whatever its time
//! zone; the zone only says how to show them. Arrow's `cast` between a zoned and
//! a naive timestamp moves the values to or from wall-clock time, row by row
//! through the zone's rules, which is both wrong for event time (windows and
//! watermarks are on the instant, as in Spark) and slow. These keep the values
//! and change only the type.

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, make_array};
use arrow::datatypes::{DataType, Int64Type, TimeUnit};
use arrow::error::ArrowError;

/// The column's values as epoch milliseconds: a timestamp of any unit and
/// zone, or anything `cast` turns into one (a date, a string).
pub fn epoch_millis(column: &ArrayRef) -> Result<Int64Array, ArrowError> {
    let naive = match column.data_type() {
        DataType::Timestamp(unit, Some(_)) => retype(column, DataType::Timestamp(*unit, None))?,
        _ => column.clone(),
    };
    let ms = arrow::compute::cast(&naive, &DataType::Timestamp(TimeUnit::Millisecond, None))?;
    let ms = retype(&ms, DataType::Int64)?;
    Ok(ms.as_primitive::<Int64Type>().clone())
}

/// A column of `data_type` (a timestamp of any unit and zone) holding the
/// instants `millis`.
pub fn from_epoch_millis(millis: Int64Array, data_type: &DataType) -> Result<ArrayRef, ArrowError> {
    let millis: ArrayRef = std::sync::Arc::new(millis);
    let ms = retype(&millis, DataType::Timestamp(TimeUnit::Millisecond, None))?;
    match data_type {
        DataType::Timestamp(unit, zone) => {
            let scaled = arrow::compute::cast(&ms, &DataType::Timestamp(*unit, None))?;
            match zone {
                Some(_) => retype(&scaled, data_type.clone()),
                None => Ok(scaled),
            }
        }
        other => arrow::compute::cast(&ms, other),
    }
}

/// The same buffers under another type of the same layout.
fn retype(column: &ArrayRef, data_type: DataType) -> Result<ArrayRef, ArrowError> {
    let data = column
        .to_data()
        .into_builder()
        .data_type(data_type)
        .build()?;
    Ok(make_array(data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::TimestampMicrosecondArray;
    use std::sync::Arc;

    #[test]
    fn a_zoned_timestamp_keeps_its_instant_both_ways() {
        // 2026-01-01T00:00:00Z and a later instant, in microseconds, shown in
        // a zone five and a half hours east.
        let zoned: ArrayRef = Arc::new(
            TimestampMicrosecondArray::from(vec![Some(1_767_225_600_000_000), None, Some(1_500)])
                .with_timezone("+05:30"),
        );
        let ms = epoch_millis(&zoned).unwrap();
        assert_eq!(
            ms.iter().collect::<Vec<_>>(),
            [Some(1_767_225_600_000), None, Some(1)]
        );
        let back = from_epoch_millis(ms, zoned.data_type()).unwrap();
        assert_eq!(back.data_type(), zoned.data_type());
        let back = back.as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        assert_eq!(back.value(0), 1_767_225_600_000_000);
        assert!(back.is_null(1));
        assert_eq!(back.value(2), 1_000);
    }
}
