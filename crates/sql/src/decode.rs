//! Values decoded into columns: the source table's rows.
//!
//! With `format = "raw"` the table has Spark's Kafka columns ([`crate::columns`]).
//! With `json` or `csv` it has the declared columns, decoded from each value by
//! arrow's readers, followed by the Kafka columns other than `value` and other
//! than any the schema declares itself. A value that does not decode to exactly
//! one row is a bad record, returned with the decoder's reason; the others still
//! make their rows.

use std::sync::Arc;

use arrow::array::{BooleanArray, RecordBatch};
use arrow::compute::{concat_batches, filter_record_batch};
use arrow::datatypes::{Schema, SchemaRef};
use arrow::error::ArrowError;
use sluice_offsets::RecordChunk;

use crate::SqlError;
use crate::columns::KafkaColumns;

/// How record values are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// Kept as bytes, in Spark's `value` column.
    Raw,
    /// One JSON object per value.
    Json(SchemaRef),
    /// One line of comma-separated values per value, without a header.
    Csv(SchemaRef),
}

/// A record whose value did not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadRecord {
    /// Its place in the chunk.
    pub index: usize,
    /// The decoder's reason.
    pub reason: String,
}

/// A chunk's rows, and the records that made none.
#[derive(Debug)]
pub struct Decoded {
    /// One row per good record, in the table's schema.
    pub batch: RecordBatch,
    /// The records that did not decode, in chunk order.
    pub bad: Vec<BadRecord>,
}

/// Turns chunks of records into rows of the source table.
#[derive(Debug)]
pub struct Decoder {
    format: Format,
    kafka: KafkaColumns,
    schema: SchemaRef,
}

impl Decoder {
    /// A decoder for `format`, with the `headers` column when `include_headers`.
    pub fn new(format: Format, include_headers: bool) -> Decoder {
        let spark = KafkaColumns::spark(include_headers);
        let (kafka, schema) = match &format {
            Format::Raw => {
                let schema = Arc::new(Schema::new(spark.fields()));
                (spark, schema)
            }
            Format::Json(declared) | Format::Csv(declared) => {
                let names: Vec<&str> = declared
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .chain(["value"])
                    .collect();
                let kafka = spark.without(&names);
                let fields: Vec<_> = declared
                    .fields()
                    .iter()
                    .map(|f| f.as_ref().clone())
                    .chain(kafka.fields())
                    .collect();
                (kafka, Arc::new(Schema::new(fields)))
            }
        };
        Decoder {
            format,
            kafka,
            schema,
        }
    }

    /// The source table's schema.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The rows of `chunk`'s records.
    pub fn decode(&self, chunk: &RecordChunk) -> Result<Decoded, SqlError> {
        let declared = match &self.format {
            Format::Raw => {
                let batch = RecordBatch::try_new(self.schema.clone(), self.kafka.arrays(chunk))
                    .map_err(|e| SqlError::Internal(e.to_string()))?;
                return Ok(Decoded {
                    batch,
                    bad: Vec::new(),
                });
            }
            Format::Json(declared) | Format::Csv(declared) => declared,
        };
        let (values, bad) = match self.decode_all(declared, chunk) {
            Ok(batch) => (batch, Vec::new()),
            // Some value did not decode: find which, one at a time.
            Err(_) => self.decode_each(declared, chunk)?,
        };
        let mut kafka = RecordBatch::try_new(
            Arc::new(Schema::new(self.kafka.fields())),
            self.kafka.arrays(chunk),
        )
        .map_err(|e| SqlError::Internal(e.to_string()))?;
        if !bad.is_empty() {
            let mut keep = vec![true; chunk.len()];
            for b in &bad {
                keep[b.index] = false;
            }
            kafka = filter_record_batch(&kafka, &BooleanArray::from(keep))
                .map_err(|e| SqlError::Internal(e.to_string()))?;
        }
        let columns = values
            .columns()
            .iter()
            .chain(kafka.columns())
            .cloned()
            .collect();
        let batch = RecordBatch::try_new(self.schema.clone(), columns)
            .map_err(|e| SqlError::Internal(e.to_string()))?;
        Ok(Decoded { batch, bad })
    }

    /// Every value at once; an error if any does not make exactly one row.
    fn decode_all(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
    ) -> Result<RecordBatch, ArrowError> {
        let mut text = Vec::with_capacity(chunk.byte_len() + 2 * chunk.len());
        for record in chunk {
            push_value(&self.format, record.value(), &mut text);
        }
        let batch = self.run(declared, &text, chunk.len())?;
        if batch.num_rows() != chunk.len() {
            return Err(ArrowError::ParseError(format!(
                "{} rows from {} values",
                batch.num_rows(),
                chunk.len()
            )));
        }
        Ok(batch)
    }

    /// Each value on its own, so that a bad one is named and the others kept.
    fn decode_each(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
    ) -> Result<(RecordBatch, Vec<BadRecord>), SqlError> {
        let mut good = Vec::with_capacity(chunk.len());
        let mut bad = Vec::new();
        let mut text = Vec::new();
        for (index, record) in chunk.iter().enumerate() {
            text.clear();
            push_value(&self.format, record.value(), &mut text);
            match self.run(declared, &text, 1) {
                Ok(batch) if batch.num_rows() == 1 => good.push(batch),
                Ok(batch) => bad.push(BadRecord {
                    index,
                    reason: format!(
                        "a value must hold exactly one {}, this one holds {}",
                        self.unit(),
                        batch.num_rows()
                    ),
                }),
                Err(e) => bad.push(BadRecord {
                    index,
                    reason: e.to_string(),
                }),
            }
        }
        let batch =
            concat_batches(declared, &good).map_err(|e| SqlError::Internal(e.to_string()))?;
        Ok((batch, bad))
    }

    fn unit(&self) -> &'static str {
        match self.format {
            Format::Csv(_) => "line",
            _ => "JSON object",
        }
    }

    /// Decodes `text`, which holds up to `rows` values, into one batch.
    fn run(
        &self,
        declared: &SchemaRef,
        text: &[u8],
        rows: usize,
    ) -> Result<RecordBatch, ArrowError> {
        // Room for one more row than expected, so that a value holding two is seen.
        let batch_size = rows + 1;
        let batch = match &self.format {
            Format::Json(_) => {
                let mut decoder = arrow::json::ReaderBuilder::new(declared.clone())
                    .with_batch_size(batch_size)
                    .build_decoder()?;
                let mut at = 0;
                while at < text.len() {
                    let read = decoder.decode(&text[at..])?;
                    if read == 0 {
                        break;
                    }
                    at += read;
                }
                decoder.flush()?
            }
            Format::Csv(_) => {
                let mut decoder = arrow::csv::ReaderBuilder::new(declared.clone())
                    .with_header(false)
                    .with_batch_size(batch_size)
                    .build_decoder();
                let mut at = 0;
                while at < text.len() {
                    let read = decoder.decode(&text[at..])?;
                    if read == 0 {
                        break;
                    }
                    at += read;
                }
                decoder.flush()?
            }
            Format::Raw => None,
        };
        Ok(batch.unwrap_or_else(|| RecordBatch::new_empty(declared.clone())))
    }
}

/// Appends a value as one line of the format. A null value (a tombstone) is a
/// row of nulls, as Spark's `from_json` makes of it.
fn push_value(format: &Format, value: Option<&[u8]>, text: &mut Vec<u8>) {
    match (format, value) {
        (_, Some(value)) => text.extend_from_slice(value),
        (Format::Json(_), None) => text.extend_from_slice(b"{}"),
        (Format::Csv(declared), None) => {
            text.extend(std::iter::repeat_n(
                b',',
                declared.fields().len().saturating_sub(1),
            ));
        }
        (Format::Raw, None) => {}
    }
    text.push(b'\n');
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Float64Type, Int64Type};
    use sluice_offsets::{Offset, Record, TimestampType};

    use super::*;
    use crate::parse_ddl;

    fn chunk(values: &[Option<&str>]) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for (i, value) in values.iter().enumerate() {
            chunk.push_record(&Record {
                topic: Arc::from("orders"),
                partition: 0,
                offset: Offset::new(i as i64).unwrap(),
                timestamp_ms: Some(1_700_000_000_000),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: value.map(|v| v.as_bytes().to_vec()),
                headers: Vec::new(),
            });
        }
        chunk
    }

    #[test]
    fn json_values_become_columns_and_bad_ones_are_named() {
        let schema = parse_ddl("order BIGINT, customer STRING, amount DOUBLE").unwrap();
        let decoder = Decoder::new(Format::Json(schema), false);
        let names: Vec<String> = decoder
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            names,
            [
                "order",
                "customer",
                "amount",
                "key",
                "topic",
                "partition",
                "offset",
                "timestamp",
                "timestampType"
            ]
        );
        let good = decoder
            .decode(&chunk(&[
                Some(r#"{"order":1,"customer":"a","amount":2.5}"#),
                Some(r#"{"order":2,"extra":true}"#),
                None,
            ]))
            .unwrap();
        assert!(good.bad.is_empty());
        assert_eq!(good.batch.num_rows(), 3);
        assert_eq!(good.batch.column(0).as_primitive::<Int64Type>().value(1), 2);
        assert!(good.batch.column(2).is_null(1), "a missing field is null");
        assert!(
            good.batch.column(0).is_null(2),
            "a tombstone is a row of nulls"
        );

        let mixed = decoder
            .decode(&chunk(&[
                Some(r#"{"order":1,"amount":1.0}"#),
                Some(r#"{"order":"x"}"#),
                Some("not json"),
                Some(r#"{"order":4,"amount":4.0}"#),
                Some(r#"{"order":5}{"order":6}"#),
                Some(""),
            ]))
            .unwrap();
        assert_eq!(mixed.batch.num_rows(), 2);
        assert_eq!(
            mixed.batch.column(2).as_primitive::<Float64Type>().value(1),
            4.0
        );
        let offsets = mixed.batch.column(6).as_primitive::<Int64Type>();
        assert_eq!(
            (offsets.value(0), offsets.value(1)),
            (0, 3),
            "rows keep their offsets"
        );
        let bad: Vec<usize> = mixed.bad.iter().map(|b| b.index).collect();
        assert_eq!(bad, [1, 2, 4, 5]);
        assert!(
            mixed.bad[0].reason.contains("order"),
            "{}",
            mixed.bad[0].reason
        );
        assert!(
            mixed.bad[2].reason.contains("exactly one JSON object"),
            "{}",
            mixed.bad[2].reason
        );
    }

    #[test]
    fn csv_lines_become_columns() {
        let schema = parse_ddl("order BIGINT, customer STRING").unwrap();
        let decoder = Decoder::new(Format::Csv(schema), false);
        let decoded = decoder
            .decode(&chunk(&[Some("1,a"), Some("two,b"), Some("3,\"c, d\"")]))
            .unwrap();
        assert_eq!(decoded.batch.num_rows(), 2);
        assert_eq!(decoded.bad.len(), 1);
        assert_eq!(decoded.batch.column(1).as_string::<i32>().value(1), "c, d");
    }

    #[test]
    fn raw_keeps_sparks_columns() {
        let decoder = Decoder::new(Format::Raw, false);
        let decoded = decoder.decode(&chunk(&[Some("x"), None])).unwrap();
        assert_eq!(decoded.batch.num_columns(), 7);
        assert!(decoded.batch.column(1).is_null(1));
    }
}
