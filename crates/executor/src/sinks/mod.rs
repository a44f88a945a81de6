//! The built-in sinks: `console` and `jsonl`, which write records in the same JSON
//! shape (see [`write_record_json`]) and rows as JSON objects (see
//! [`write_rows_json`]), and `discard`, which keeps nothing (for benchmarks).

mod console;
mod discard;
mod jsonl;
mod rows;

use std::io;
use std::path::PathBuf;

use base64::Engine as _;
use sluice_core::{RecordRef, TimestampType};

pub use console::{ConsoleFormat, ConsoleSink, DEFAULT_NUM_ROWS};
pub use discard::DiscardSink;
pub use jsonl::JsonlSink;
pub use rows::{textual, write_rows_json};

/// An error of a built-in sink, naming the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Writing failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The blocking write task did not finish.
    #[error("sink task failed: {0}")]
    Task(String),
    /// Rows that could not be written as text.
    #[error("writing rows: {0}")]
    Rows(String),
}

impl SinkError {
    /// Whether writing the batch again may succeed: a full disk or quota may
    /// be freed, a timed-out network file system may answer. A missing right
    /// or a bad path does not go away by itself, and stops the query at once.
    pub fn is_transient(&self) -> bool {
        match self {
            SinkError::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::StorageFull
                    | std::io::ErrorKind::QuotaExceeded
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::Interrupted
            ),
            _ => false,
        }
    }
}

/// Appends a record to `out` as one JSON object: `headers` (when present), `key`,
/// `offset`, `partition`, `timestamp`, `timestampType`, `topic` and `value`. Keys,
/// values and header values that are not UTF-8 text are written base64-encoded
/// under `keyBase64`, `valueBase64` and `valueBase64` instead.
///
/// The object is written straight into `out`: building a `serde_json::Value` per
/// record cost the `jsonl` sink most of its time.
pub fn write_record_json(out: &mut Vec<u8>, record: RecordRef<'_>) {
    out.push(b'{');
    if record.header_count() > 0 {
        out.extend_from_slice(b"\"headers\":[");
        for (i, (key, value)) in record.headers().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(b"{\"key\":");
            json_string(out, key);
            out.push(b',');
            put_bytes(out, "value", value);
            out.push(b'}');
        }
        out.extend_from_slice(b"],");
    }
    put_bytes(out, "key", record.key());
    let timestamp = record
        .timestamp_ms()
        .map_or_else(|| "null".to_owned(), |ms| ms.to_string());
    let kind = match record.timestamp_type() {
        TimestampType::NotAvailable => "NotAvailable",
        TimestampType::CreateTime => "CreateTime",
        TimestampType::LogAppendTime => "LogAppendTime",
    };
    out.extend_from_slice(
        format!(
            ",\"offset\":{},\"partition\":{},\"timestamp\":{timestamp},\"timestampType\":\"{kind}\",\"topic\":",
            record.offset().value(),
            record.partition(),
        )
        .as_bytes(),
    );
    json_string(out, record.topic());
    out.push(b',');
    put_bytes(out, "value", record.value());
    out.push(b'}');
}

fn json_string(out: &mut Vec<u8>, text: &str) {
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

fn put_bytes(out: &mut Vec<u8>, name: &str, bytes: Option<&[u8]>) {
    out.push(b'"');
    out.extend_from_slice(name.as_bytes());
    match bytes.map(std::str::from_utf8) {
        None => out.extend_from_slice(b"\":null"),
        Some(Ok(text)) => {
            out.extend_from_slice(b"\":");
            json_string(out, text);
        }
        Some(Err(_)) => {
            out.extend_from_slice(b"Base64\":\"");
            let encoded =
                base64::engine::general_purpose::STANDARD.encode(bytes.unwrap_or_default());
            out.extend_from_slice(encoded.as_bytes());
            out.push(b'"');
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sluice_core::{Header, Offset, Record};

    use super::*;

    #[test]
    fn records_become_json_with_binary_data_in_base64() {
        let record = Record {
            topic: Arc::from("events"),
            partition: 3,
            offset: Offset::new(42).unwrap(),
            timestamp_ms: Some(1_700_000_000_000),
            timestamp_type: TimestampType::CreateTime,
            key: Some(b"user-1".to_vec()),
            value: Some(vec![0xff, 0x00]),
            headers: vec![Header {
                key: "trace".into(),
                value: None,
            }],
        };
        let mut chunk = sluice_core::RecordChunk::default();
        chunk.push_record(&record);
        let mut out = Vec::new();
        write_record_json(&mut out, chunk.iter().next().unwrap());
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"headers":[{"key":"trace","value":null}],"key":"user-1","offset":42,"partition":3,"timestamp":1700000000000,"timestampType":"CreateTime","topic":"events","valueBase64":"/wA="}"#
        );
    }
}
