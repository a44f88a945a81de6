//! Rows as JSON lines, for the sinks that write rows as text.
//!
//! Each row becomes one JSON object with its columns by name, as Spark's
//! `to_json` writes them. Binary columns (`key` and `value` of the raw table) are
//! written as text when they hold UTF-8, else base64-encoded, as the records'
//! own JSON does; nulls are written as `null`.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use base64::Engine as _;

/// Appends one JSON line per row of `batch` to `out`.
pub fn write_rows_json(out: &mut Vec<u8>, batch: &RecordBatch) -> Result<(), String> {
    let batch = textual(batch)?;
    let mut writer = arrow::json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, arrow::json::writer::LineDelimited>(out);
    writer.write(&batch).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}

/// `batch` with its binary columns as text: UTF-8 as it is, anything else in
/// base64 (per value, so that one binary value does not turn a column of text
/// into base64).
pub fn textual(batch: &RecordBatch) -> Result<RecordBatch, String> {
    if !batch
        .schema()
        .fields()
        .iter()
        .any(|f| matches!(f.data_type(), DataType::Binary | DataType::LargeBinary))
    {
        return Ok(batch.clone());
    }
    let mut fields = Vec::with_capacity(batch.num_columns());
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(batch.num_columns());
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        let values: Option<Vec<Option<String>>> = match field.data_type() {
            DataType::Binary => Some(
                column
                    .as_binary::<i32>()
                    .iter()
                    .map(|v| v.map(text_or_base64))
                    .collect(),
            ),
            DataType::LargeBinary => Some(
                column
                    .as_binary::<i64>()
                    .iter()
                    .map(|v| v.map(text_or_base64))
                    .collect(),
            ),
            _ => None,
        };
        match values {
            Some(values) => {
                fields.push(Field::new(
                    field.name(),
                    DataType::Utf8,
                    column.is_nullable(),
                ));
                columns.push(Arc::new(StringArray::from(values)));
            }
            None => {
                fields.push(field.as_ref().clone());
                columns.push(column.clone());
            }
        }
    }
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).map_err(|e| e.to_string())
}

fn text_or_base64(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_owned(),
        Err(_) => base64::engine::general_purpose::STANDARD.encode(bytes),
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{BinaryArray, Int64Array};

    use super::*;

    #[test]
    fn rows_become_json_lines_with_binary_as_text() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("order", DataType::Int64, true),
            Field::new("value", DataType::Binary, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(vec![Some(1), None])),
                Arc::new(BinaryArray::from(vec![
                    Some(&b"hi"[..]),
                    Some(&[0xff, 0][..]),
                ])),
            ],
        )
        .unwrap();
        let mut out = Vec::new();
        write_rows_json(&mut out, &batch).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "{\"order\":1,\"value\":\"hi\"}\n{\"order\":null,\"value\":\"/wA=\"}\n"
        );
    }
}
