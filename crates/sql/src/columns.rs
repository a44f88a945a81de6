//! Records as Arrow: the columns of Spark's Kafka source.
//!
//! | column | type | Spark's type |
//! | --- | --- | --- |
//! | `key` | binary | binary |
//! | `value` | binary | binary |
//! | `topic` | utf8 | string |
//! | `partition` | int32 | int |
//! | `offset` | int64 | long |
//! | `timestamp` | timestamp (ms, UTC) | timestamp |
//! | `timestampType` | int32 (0 create time, 1 log append time, -1 none) | int |
//! | `headers` | list of struct (`key` utf8, `value` binary), with `include_headers` | array of struct |

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryBuilder, Int32Builder, Int64Builder, ListBuilder, RecordBatch, StringBuilder,
    StructBuilder, TimestampMillisecondBuilder,
};
use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use sluice_core::{RecordChunk, TimestampType};

/// The names of Spark's Kafka columns, in their order.
pub const KAFKA_COLUMNS: [&str; 8] = [
    "key",
    "value",
    "topic",
    "partition",
    "offset",
    "timestamp",
    "timestampType",
    "headers",
];

fn header_fields() -> Fields {
    Fields::from(vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("value", DataType::Binary, true),
    ])
}

/// The field of one Kafka column.
fn kafka_field(name: &str) -> Field {
    match name {
        "key" | "value" => Field::new(name, DataType::Binary, true),
        "topic" => Field::new(name, DataType::Utf8, false),
        "partition" | "timestampType" => Field::new(name, DataType::Int32, false),
        "offset" => Field::new(name, DataType::Int64, false),
        "timestamp" => Field::new(
            name,
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            true,
        ),
        _ => Field::new(
            name,
            DataType::List(Arc::new(Field::new(
                "item",
                DataType::Struct(header_fields()),
                true,
            ))),
            false,
        ),
    }
}

/// Which of Spark's Kafka columns a table has, in Spark's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaColumns {
    names: Vec<&'static str>,
}

impl KafkaColumns {
    /// Spark's columns: all of them but `headers` unless `include_headers`.
    pub fn spark(include_headers: bool) -> KafkaColumns {
        KafkaColumns {
            names: KAFKA_COLUMNS
                .iter()
                .copied()
                .filter(|n| include_headers || *n != "headers")
                .collect(),
        }
    }

    /// The same without the columns in `except` (compared case-insensitively):
    /// those a decoded value declares, which take their place.
    pub fn without(mut self, except: &[&str]) -> KafkaColumns {
        self.names
            .retain(|n| !except.iter().any(|e| e.eq_ignore_ascii_case(n)));
        self
    }

    /// The columns' names.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// The columns' fields.
    pub fn fields(&self) -> Vec<Field> {
        self.names.iter().map(|n| kafka_field(n)).collect()
    }

    /// The columns of `chunk`'s records, one row per record, in this order.
    pub fn arrays(&self, chunk: &RecordChunk) -> Vec<ArrayRef> {
        self.names.iter().map(|name| column(name, chunk)).collect()
    }

    /// `chunk` as a batch of exactly these columns.
    pub fn batch(&self, chunk: &RecordChunk) -> RecordBatch {
        let schema: SchemaRef = Arc::new(Schema::new(self.fields()));
        // The arrays are built to the schema's types, one row per record.
        RecordBatch::try_new(schema, self.arrays(chunk))
            .unwrap_or_else(|e| unreachable!("Kafka columns match their schema: {e}"))
    }
}

fn column(name: &str, chunk: &RecordChunk) -> ArrayRef {
    let rows = chunk.len();
    match name {
        "key" | "value" => {
            let bytes: usize = chunk
                .iter()
                .map(|r| if name == "key" { r.key() } else { r.value() }.map_or(0, <[u8]>::len))
                .sum();
            let mut b = BinaryBuilder::with_capacity(rows, bytes);
            for r in chunk {
                b.append_option(if name == "key" { r.key() } else { r.value() });
            }
            Arc::new(b.finish())
        }
        "topic" => {
            let mut b = StringBuilder::with_capacity(rows, rows * 16);
            for r in chunk {
                b.append_value(r.topic());
            }
            Arc::new(b.finish())
        }
        "partition" => {
            let mut b = Int32Builder::with_capacity(rows);
            for r in chunk {
                b.append_value(r.partition());
            }
            Arc::new(b.finish())
        }
        "offset" => {
            let mut b = Int64Builder::with_capacity(rows);
            for r in chunk {
                b.append_value(r.offset().value());
            }
            Arc::new(b.finish())
        }
        "timestamp" => {
            let mut b = TimestampMillisecondBuilder::with_capacity(rows).with_timezone("UTC");
            for r in chunk {
                b.append_option(r.timestamp_ms());
            }
            Arc::new(b.finish())
        }
        "timestampType" => {
            let mut b = Int32Builder::with_capacity(rows);
            for r in chunk {
                b.append_value(match r.timestamp_type() {
                    TimestampType::CreateTime => 0,
                    TimestampType::LogAppendTime => 1,
                    TimestampType::NotAvailable => -1,
                });
            }
            Arc::new(b.finish())
        }
        _ => {
            let values = StructBuilder::from_fields(header_fields(), rows);
            let mut b = ListBuilder::new(values).with_field(Arc::new(Field::new(
                "item",
                DataType::Struct(header_fields()),
                true,
            )));
            for r in chunk {
                for (key, value) in r.headers() {
                    let s = b.values();
                    if let Some(k) = s.field_builder::<StringBuilder>(0) {
                        k.append_value(key);
                    }
                    if let Some(v) = s.field_builder::<BinaryBuilder>(1) {
                        v.append_option(value);
                    }
                    s.append(true);
                }
                b.append(true);
            }
            Arc::new(b.finish())
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Int32Type, Int64Type};
    use sluice_core::{Header, Offset, Record};

    use super::*;

    fn chunk() -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for offset in 0..3 {
            chunk.push_record(&Record {
                topic: Arc::from("orders"),
                partition: 2,
                offset: Offset::new(offset).unwrap(),
                timestamp_ms: (offset != 1).then_some(1_700_000_000_000 + offset),
                timestamp_type: TimestampType::CreateTime,
                key: (offset == 0).then(|| b"k".to_vec()),
                value: Some(format!("v{offset}").into_bytes()),
                headers: vec![Header {
                    key: "h".into(),
                    value: Some(b"x".to_vec()),
                }],
            });
        }
        chunk
    }

    #[test]
    fn records_become_sparks_columns() {
        let batch = KafkaColumns::spark(true).batch(&chunk());
        assert_eq!(batch.num_rows(), 3);
        let schema = batch.schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, KAFKA_COLUMNS);
        assert!(batch.column(0).is_null(1), "a null key stays null");
        assert_eq!(batch.column(1).as_binary::<i32>().value(2), b"v2");
        assert_eq!(batch.column(3).as_primitive::<Int32Type>().value(0), 2);
        assert_eq!(batch.column(4).as_primitive::<Int64Type>().value(2), 2);
        assert!(batch.column(5).is_null(1));
        assert_eq!(batch.column(7).as_list::<i32>().value(0).len(), 1);
    }

    #[test]
    fn declared_columns_take_the_place_of_kafka_columns() {
        let columns = KafkaColumns::spark(false).without(&["Timestamp", "value"]);
        assert_eq!(
            columns.names(),
            ["key", "topic", "partition", "offset", "timestampType"]
        );
        assert_eq!(columns.batch(&chunk()).num_columns(), 5);
    }
}
