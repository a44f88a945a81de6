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
    let mut file = Encoder::new(&table.schema())?;
    file.write(table)?;
    file.finish()
}

/// A state file written a table at a time, so that a snapshot of many
/// windows is never one table in memory; it reads back as one table.
pub struct Encoder {
    writer: StreamWriter<Vec<u8>>,
}

impl Encoder {
    /// A file of tables of `schema`.
    pub fn new(schema: &arrow::datatypes::Schema) -> Result<Encoder, StateError> {
        // LZ4 frames: a state file is written and fsynced before every commit,
        // and its keys and windows repeat, so compressing it costs less than
        // writing it.
        let options = IpcWriteOptions::default()
            .try_with_compression(Some(CompressionType::LZ4_FRAME))
            .map_err(encoding)?;
        let writer =
            StreamWriter::try_new_with_options(Vec::new(), schema, options).map_err(encoding)?;
        Ok(Encoder { writer })
    }

    /// Adds `table`'s rows.
    pub fn write(&mut self, table: &RecordBatch) -> Result<(), StateError> {
        self.writer.write(table).map_err(encoding)
    }

    /// The file's bytes.
    pub fn finish(mut self) -> Result<Vec<u8>, StateError> {
        self.writer.finish().map_err(encoding)?;
        self.writer.into_inner().map_err(encoding)
    }
}

fn encoding(e: arrow::error::ArrowError) -> StateError {
    StateError::Internal(format!("encoding state: {e}"))
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
    // Arrow's reader allocates what a message or a compressed buffer says it
    // holds before it reads it: a damaged length aborts the process, which no
    // catch can turn into an error (found twice by the state_file fuzzer).
    check_framing(bytes).map_err(damaged)?;
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

/// How many times its compressed size a buffer may hold: LZ4 compresses at
/// most about 255 to 1; zstd, which Sluice does not write, far more.
fn most_per_compressed_byte(codec: arrow::ipc::CompressionType) -> u64 {
    if codec == CompressionType::LZ4_FRAME {
        256
    } else {
        1 << 16
    }
}

/// Walks the IPC stream's messages and checks that each fits in the file, that
/// no compressed buffer says it holds more than its codec could have made of
/// it, and that the stream ends with its marker. What does not parse is left
/// to Arrow's reader, which names it.
fn check_framing(bytes: &[u8]) -> Result<(), String> {
    let int32 = |at: usize| -> Option<i32> {
        Some(i32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let mut at = 0;
    while let Some(mut length) = int32(at) {
        at += 4;
        if length == -1 {
            // The continuation marker before the metadata's length.
            let Some(after) = int32(at) else { break };
            length = after;
            at += 4;
        }
        let Ok(length) = usize::try_from(length) else {
            return Ok(());
        };
        if length == 0 {
            // The end-of-stream marker, which every file Sluice writes ends with.
            return Ok(());
        }
        // Arrow's reader allocates a message's metadata and body in full
        // before it reads them, so a length past the end of the file is
        // found here, not by a failed allocation (found by the state_file
        // fuzzer: a 1.7 KB file whose body claimed gigabytes).
        let remaining = bytes.len() - at;
        if length > remaining {
            return Err(format!(
                "damaged or cut short: a message's header says it has {length} bytes, and only {remaining} \
                 remain"
            ));
        }
        let metadata = &bytes[at..at + length];
        let Ok(message) = arrow::ipc::root_as_message(metadata) else {
            return Ok(());
        };
        at += length;
        let Ok(body_length) = usize::try_from(message.bodyLength()) else {
            return Ok(());
        };
        let remaining = bytes.len() - at;
        if body_length > remaining {
            return Err(format!(
                "damaged or cut short: a message says its body has {body_length} bytes, and only \
                 {remaining} remain"
            ));
        }
        let body = &bytes[at..at + body_length];
        let batch = message.header_as_record_batch().or_else(|| {
            message
                .header_as_dictionary_batch()
                .and_then(|dictionary| dictionary.data())
        });
        if let Some(batch) = batch
            && let (Some(compression), Some(buffers)) = (batch.compression(), batch.buffers())
        {
            let most = most_per_compressed_byte(compression.codec());
            for buffer in buffers.iter() {
                let (Ok(offset), Ok(stored)) = (
                    usize::try_from(buffer.offset()),
                    u64::try_from(buffer.length()),
                ) else {
                    continue;
                };
                // Each compressed buffer starts with its length uncompressed,
                // or -1 when it was stored as it is. An empty one (the
                // validity of a column without nulls) has none: the bytes at
                // its offset are the next buffer's.
                if stored < 8 {
                    continue;
                }
                let Some(head) = body.get(offset..offset.saturating_add(8)) else {
                    continue;
                };
                let claimed = i64::from_le_bytes(head.try_into().unwrap_or_default());
                // What the buffer can hold is bounded by the bytes it really
                // has, whatever its stored length says.
                let stored = stored.min((body.len() - offset) as u64);
                if claimed > 0
                    && claimed.unsigned_abs() > stored.saturating_mul(most).saturating_add(1024)
                {
                    return Err(format!(
                        "damaged: a compressed buffer of {stored} bytes says it holds {claimed} bytes"
                    ));
                }
            }
        }
        at += body_length;
    }
    // Arrow's reader takes a file that stops between two messages for a
    // whole one, which would read a state cut short as a smaller state.
    Err("cut short: the file ends without the end-of-stream marker".to_owned())
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

    /// The state_file fuzzer's third finding: a compressed buffer whose
    /// length says it holds 1.4 EB, which Arrow's reader tried to allocate, so
    /// that the process aborted.
    #[test]
    fn a_compressed_buffer_claiming_more_than_lz4_can_hold_is_damaged_not_an_abort() {
        let seed: &[u8] = include_bytes!("../../../fuzz/seeds/state_file/window-state.delta");
        let schema = StreamReader::try_new(Cursor::new(seed), None)
            .unwrap()
            .schema();
        let found: &[u8] = include_bytes!(
            "../../../fuzz/regressions/state_file/crash-2c88b693fe9c203ef46ab5a6166b197e5b055b4f"
        );
        let message = decode(found, &schema, "state/0/0/7.delta")
            .unwrap_err()
            .to_string();
        assert!(message.contains("state/0/0/7.delta"), "{message}");
        assert!(message.contains("says it holds"), "{message}");
        // The real file it came from still reads.
        assert!(decode(seed, &schema, "seed").is_ok());
    }

    /// The state_file fuzzer's fourth finding: a message whose body says it
    /// has gigabytes in a 1.7 KB file, which Arrow's reader allocated before
    /// reading, so that the process ran out of memory.
    #[test]
    fn a_message_longer_than_its_file_is_cut_short_not_out_of_memory() {
        let seed: &[u8] = include_bytes!("../../../fuzz/seeds/state_file/window-state.delta");
        let schema = StreamReader::try_new(Cursor::new(seed), None)
            .unwrap()
            .schema();
        let found: &[u8] = include_bytes!(
            "../../../fuzz/regressions/state_file/oom-ecbc3a03ba1b18f73388c3cc1fbf0b27e7d0c3a5"
        );
        let message = decode(found, &schema, "state/0/0/9.delta")
            .unwrap_err()
            .to_string();
        assert!(message.contains("state/0/0/9.delta"), "{message}");
        assert!(message.contains("cut short"), "{message}");
        // Every prefix of a real file is cut short too, and says so.
        for end in 1..seed.len() {
            let cut = decode(&seed[..end], &schema, "seed")
                .unwrap_err()
                .to_string();
            assert!(cut.contains("seed"), "{end}: {cut}");
        }
    }

    /// The state_file fuzzer's fifth finding: a compressed buffer whose
    /// stored length is near 2^64, which overflowed the check above.
    #[test]
    fn a_buffer_with_a_huge_stored_length_is_damaged_not_an_overflow() {
        let seed: &[u8] = include_bytes!("../../../fuzz/seeds/state_file/window-state.delta");
        let schema = StreamReader::try_new(Cursor::new(seed), None)
            .unwrap()
            .schema();
        let found: &[u8] = include_bytes!(
            "../../../fuzz/regressions/state_file/crash-0ca50ce7034c7842d816a52b3109cbb064878f1e"
        );
        let message = decode(found, &schema, "state/0/0/3.delta")
            .unwrap_err()
            .to_string();
        assert!(message.contains("state/0/0/3.delta"), "{message}");
    }

    use arrow::array::{Array, Int64Array};
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

    /// An empty buffer (the validity of a column without nulls) has no length
    /// of its own: the eight bytes at its offset are the next buffer's, which
    /// may hold far more than the empty one could.
    #[test]
    fn an_empty_buffer_before_a_well_compressed_one_is_not_damage() {
        let schema = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, true)]));
        let values = Int64Array::from(vec![7; 100_000]);
        assert_eq!(values.null_count(), 0);
        let table = RecordBatch::try_new(schema.clone(), vec![Arc::new(values)]).unwrap();
        let bytes = encode(&table).unwrap();
        assert_eq!(decode(&bytes, &schema, "f").unwrap(), table);
    }
}
