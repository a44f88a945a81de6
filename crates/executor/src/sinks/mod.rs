//! The built-in sinks: `console` and `jsonl`, which write records in the same JSON
//! shape (see [`record_json`]), and `discard`, which keeps nothing (for benchmarks).

mod console;
mod discard;
mod jsonl;

use std::io;
use std::path::PathBuf;

use base64::Engine as _;
use serde_json::{Map, Value};
use sluice_offsets::{Record, TimestampType};

pub use console::{ConsoleFormat, ConsoleSink};
pub use discard::DiscardSink;
pub use jsonl::JsonlSink;

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
}

/// A record as one JSON object: `topic`, `partition`, `offset`, `timestamp`,
/// `timestampType`, `key`, `value` and, when present, `headers`. Keys, values and
/// header values that are not UTF-8 text are written base64-encoded under
/// `keyBase64`, `valueBase64` and `valueBase64` instead.
pub fn record_json(record: &Record) -> Value {
    let mut map = Map::new();
    map.insert("topic".into(), Value::from(record.topic.as_ref()));
    map.insert("partition".into(), Value::from(record.partition));
    map.insert("offset".into(), Value::from(record.offset.value()));
    map.insert(
        "timestamp".into(),
        record.timestamp_ms.map_or(Value::Null, Value::from),
    );
    let kind = match record.timestamp_type {
        TimestampType::NotAvailable => "NotAvailable",
        TimestampType::CreateTime => "CreateTime",
        TimestampType::LogAppendTime => "LogAppendTime",
    };
    map.insert("timestampType".into(), Value::from(kind));
    put_bytes(&mut map, "key", record.key.as_deref());
    put_bytes(&mut map, "value", record.value.as_deref());
    if !record.headers.is_empty() {
        let headers = record
            .headers
            .iter()
            .map(|h| {
                let mut header = Map::new();
                header.insert("key".into(), Value::from(h.key.as_str()));
                put_bytes(&mut header, "value", h.value.as_deref());
                Value::Object(header)
            })
            .collect();
        map.insert("headers".into(), Value::Array(headers));
    }
    Value::Object(map)
}

fn put_bytes(map: &mut Map<String, Value>, name: &str, bytes: Option<&[u8]>) {
    match bytes.map(std::str::from_utf8) {
        None => {
            map.insert(name.into(), Value::Null);
        }
        Some(Ok(text)) => {
            map.insert(name.into(), Value::from(text));
        }
        Some(Err(_)) => {
            let encoded =
                base64::engine::general_purpose::STANDARD.encode(bytes.unwrap_or_default());
            map.insert(format!("{name}Base64"), Value::from(encoded));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sluice_offsets::{Header, Offset};

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
        assert_eq!(
            record_json(&record).to_string(),
            r#"{"headers":[{"key":"trace","value":null}],"key":"user-1","offset":42,"partition":3,"timestamp":1700000000000,"timestampType":"CreateTime","topic":"events","valueBase64":"/wA="}"#
        );
    }
}
