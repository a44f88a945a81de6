//! State files as Arrow IPC streams: a table of the group keys and each
//! aggregate's partial state, behind an `op` column that says whether a row
//! writes its group or removes it. The schema travels with the file, so a file
//! written by another query (other groups, other aggregates) is recognised.

use std::io::Cursor;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};

use crate::StateError;

/// `table` as the bytes of a state file.
pub fn encode(table: &RecordBatch) -> Result<Vec<u8>, StateError> {
    let mut bytes = Vec::new();
    // LZ4 frames: a state file is written and fsynced before every commit, and
    // its keys and windows repeat, so compressing it costs less than writing it.
    let options = IpcWriteOptions::default()
        .try_with_compression(Some(CompressionType::LZ4_FRAME))
        .map_err(|e| StateError::Internal(format!("encoding state: {e}")))?;
    let mut writer = StreamWriter::try_new_with_options(&mut bytes, &table.schema(), options)
        .map_err(|e| StateError::Internal(format!("encoding state: {e}")))?;
    writer
        .write(table)
        .and_then(|()| writer.finish())
        .map_err(|e| StateError::Internal(format!("encoding state: {e}")))?;
    drop(writer);
    Ok(bytes)
}

/// A state file's table, which must have the columns of `schema`.
pub fn decode(bytes: &[u8], schema: &SchemaRef, location: &str) -> Result<RecordBatch, StateError> {
    let damaged = |reason: String| StateError::Damaged {
        location: location.to_owned(),
        reason,
    };
    if bytes.is_empty() {
        // The empty state, as `offsets set --reset-state` writes it.
        return Ok(RecordBatch::new_empty(schema.clone()));
    }
    // Arrow's reader panics on some damaged files (a validity bitmap shorter
    // than its column, found by the state_file fuzzer) instead of returning an
    // error; a damaged file must stop the query with its name, not a panic.
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        read_table(bytes, schema, &damaged)
    }));
    read.unwrap_or_else(|panic| {
        let reason = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no reason given");
        Err(damaged(format!(
            "damaged: Arrow's reader gave up ({reason})"
        )))
    })
}

/// The table of a state file that is not empty.
fn read_table(
    bytes: &[u8],
    schema: &SchemaRef,
    damaged: &dyn Fn(String) -> StateError,
) -> Result<RecordBatch, StateError> {
    let reader = StreamReader::try_new(Cursor::new(bytes), None)
        .map_err(|e| damaged(format!("not a state file Sluice wrote ({e})")))?;
    let found = reader.schema();
    let same = found.fields().len() == schema.fields().len()
        && found
            .fields()
            .iter()
            .zip(schema.fields())
            .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
    if !same {
        let columns = |s: &SchemaRef| {
            s.fields()
                .iter()
                .map(|f| format!("{} {}", f.name(), f.data_type()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(damaged(format!(
            "it holds the state of another query ({}), and this query's state is ({}); a query \
             whose groups or aggregates changed needs a new checkpoint, or `sluice offsets set \
             --reset-state`",
            columns(&found),
            columns(schema)
        )));
    }
    let mut batches = Vec::new();
    for batch in reader {
        batches.push(batch.map_err(|e| damaged(format!("cut short or damaged ({e})")))?);
    }
    arrow::compute::concat_batches(schema, &batches)
        .map_err(|e| damaged(format!("cut short or damaged ({e})")))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    /// The state_file fuzzer's first finding: a real state file with a
    /// column's buffer cut short, which made Arrow's reader panic.
    #[test]
    fn a_file_whose_buffers_are_cut_short_is_damaged_not_a_panic() {
        let found: &[u8] = include_bytes!(
            "../../../fuzz/regressions/state_file/crash-209124de787e2d860d9a3e407574c47b49014fb9"
        );
        let schema = StreamReader::try_new(Cursor::new(found), None)
            .unwrap()
            .schema();
        let err = decode(found, &schema, "state/0/0/4.delta").unwrap_err();
        let message = err.to_string();
        assert!(message.contains("state/0/0/4.delta"), "{message}");
        assert!(message.contains("Arrow's reader gave up"), "{message}");
    }

    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    #[test]
    fn a_state_file_reads_back_and_damage_is_named() {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, true)]));
        let table =
            RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1, 2]))])
                .unwrap();
        let bytes = encode(&table).unwrap();
        assert_eq!(decode(&bytes, &schema, "f").unwrap(), table);
        let cut = decode(&bytes[..bytes.len() / 2], &schema, "state/0/0/3.delta")
            .unwrap_err()
            .to_string();
        assert!(cut.starts_with("state file state/0/0/3.delta: "), "{cut}");
        let other = Arc::new(Schema::new(vec![Field::new("m", DataType::Utf8, true)]));
        let wrong = decode(&bytes, &other, "f").unwrap_err().to_string();
        assert!(wrong.contains("another query"), "{wrong}");
        assert_eq!(decode(&[], &schema, "f").unwrap().num_rows(), 0);
    }
}
