//! Values decoded into columns: the source table's rows.
//!
//! With `format = "raw"` the table has Spark's Kafka columns ([`crate::columns`]).
//! With `json`, `csv` or `avro` it has the declared columns, decoded from each
//! value by arrow's readers (most JSON values by a one-pass decoder of our own,
//! which makes the same rows), followed by the Kafka columns other than `value`
//! and other than any the schema declares itself. A value that does not decode to
//! exactly one row is a bad record, returned with the decoder's reason; the
//! others still make their rows. A null value (a tombstone) is a row of nulls, as
//! Spark's `from_json` and `from_avro` make of it, unless a column is `NOT NULL`.

use std::sync::Arc;

use arrow::array::{BooleanArray, RecordBatch, UInt32Array};
use arrow::compute::{concat_batches, filter_record_batch, take_record_batch};
use arrow::datatypes::{Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow_avro::reader::ReaderBuilder as AvroReaderBuilder;
use arrow_avro::schema::{AvroSchema, Fingerprint, FingerprintAlgorithm, SchemaStore};
use sluice_core::RecordChunk;

use crate::SqlError;
use crate::columns::KafkaColumns;
use crate::flat_json::FlatJson;

/// How record values are read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// Kept as bytes, in Spark's `value` column.
    Raw,
    /// One JSON object per value.
    Json(SchemaRef),
    /// One line of comma-separated values per value, without a header.
    Csv(SchemaRef),
    /// One Avro datum per value, in a schema given as Avro's JSON.
    Avro(AvroFormat),
}

impl Format {
    /// The columns a value decodes into; none for `Raw`.
    pub fn declared(&self) -> Option<&SchemaRef> {
        match self {
            Format::Raw => None,
            Format::Json(schema) | Format::Csv(schema) => Some(schema),
            Format::Avro(avro) => Some(&avro.columns),
        }
    }
}

/// How an Avro value is framed in the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AvroWire {
    /// The datum alone, as Spark's `from_avro` reads it.
    Raw,
    /// Confluent's framing: a zero byte and the 4-byte big-endian id of the
    /// writer's schema in a registry, then the datum. With an id, values written
    /// with another schema are bad records; without one, any id is read with the
    /// given schema.
    Confluent(Option<u32>),
}

/// Avro values: the writer's schema and how each value is framed.
#[derive(Clone, Debug)]
pub struct AvroFormat {
    schema: String,
    wire: AvroWire,
    columns: SchemaRef,
}

impl PartialEq for AvroFormat {
    fn eq(&self, other: &AvroFormat) -> bool {
        self.schema == other.schema && self.wire == other.wire
    }
}

impl Eq for AvroFormat {}

/// The id under which the one writer's schema is registered with arrow's
/// decoder: every value is handed to it behind a Confluent prefix with this id.
const AVRO_ID: u32 = 0;

impl AvroFormat {
    /// Avro values written with `schema` (Avro's JSON form, a record), framed as
    /// `wire`. Fails when the schema does not parse or is not a record.
    pub fn new(schema: &str, wire: AvroWire) -> Result<AvroFormat, SqlError> {
        let bad = |reason: String| SqlError::AvroSchema {
            reason: crate::error::one_line(&reason),
        };
        let parsed: serde_json::Value =
            serde_json::from_str(schema).map_err(|e| bad(format!("it is not JSON: {e}")))?;
        if parsed.get("type").and_then(|t| t.as_str()) != Some("record") {
            return Err(bad(
                "it must be a record (`{\"type\": \"record\", \"name\": ..., \"fields\": [...]}`), \
                 whose fields become the columns"
                    .to_owned(),
            ));
        }
        let mut format = AvroFormat {
            schema: schema.to_owned(),
            wire,
            columns: Arc::new(Schema::empty()),
        };
        let decoder = format.decoder(1).map_err(|e| bad(e.to_string()))?;
        // Top-level columns may be null, so that a tombstone can be a row of nulls.
        let columns: Vec<Field> = decoder
            .schema()
            .fields()
            .iter()
            .map(|f| {
                f.as_ref()
                    .clone()
                    .with_nullable(true)
                    .with_metadata(Default::default())
            })
            .collect();
        format.columns = Arc::new(Schema::new(columns));
        Ok(format)
    }

    fn decoder(&self, rows: usize) -> Result<arrow_avro::reader::Decoder, ArrowError> {
        let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
        store.set(
            Fingerprint::Id(AVRO_ID),
            AvroSchema::new(self.schema.clone()),
        )?;
        AvroReaderBuilder::new()
            .with_writer_schema_store(store)
            .with_batch_size(rows.max(1))
            .build_decoder()
    }

    /// The datum inside a value, or why there is none.
    fn datum<'a>(&self, value: &'a [u8]) -> Result<&'a [u8], String> {
        match self.wire {
            AvroWire::Raw => Ok(value),
            AvroWire::Confluent(expected) => {
                let (&[0, a, b, c, d], datum) = value.split_first_chunk::<5>().ok_or_else(|| {
                    format!(
                        "a Confluent-framed value starts with a zero byte and a 4-byte schema id; \
                         this one has {} bytes",
                        value.len()
                    )
                })?
                else {
                    return Err(format!(
                        "a Confluent-framed value starts with a zero byte, this one with {:#04x}",
                        value[0]
                    ));
                };
                let id = u32::from_be_bytes([a, b, c, d]);
                match expected {
                    Some(expected) if expected != id => Err(format!(
                        "written with schema id {id}, but source.avro_schema_id is {expected}"
                    )),
                    _ => Ok(datum),
                }
            }
        }
    }
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
    kafka_schema: SchemaRef,
    schema: SchemaRef,
    /// The one-pass decoder for JSON values, when the schema is one it reads.
    flat: Option<FlatJson>,
}

impl Decoder {
    /// A decoder for `format`, with the `headers` column when `include_headers`.
    pub fn new(format: Format, include_headers: bool) -> Decoder {
        let spark = KafkaColumns::spark(include_headers);
        let (kafka, schema) = match format.declared() {
            None => {
                let schema = Arc::new(Schema::new(spark.fields()));
                (spark, schema)
            }
            Some(declared) => {
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
        let flat = match &format {
            Format::Json(schema) => FlatJson::new(schema),
            _ => None,
        };
        Decoder {
            flat,
            format,
            kafka_schema: Arc::new(Schema::new(kafka.fields())),
            kafka,
            schema,
        }
    }

    /// The same decoder reading JSON values with arrow's reader alone, without
    /// the one-pass decoder that otherwise reads most of them. Its results are
    /// the same; the tests and the `json_values` fuzz target compare the two.
    pub fn arrow_json_only(mut self) -> Decoder {
        self.flat = None;
        self
    }

    /// The source table's schema.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The rows of `chunk`'s records.
    pub fn decode(&self, chunk: &RecordChunk) -> Result<Decoded, SqlError> {
        let Some(declared) = self.format.declared() else {
            let batch = RecordBatch::try_new(self.schema.clone(), self.kafka.arrays(chunk))
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            return Ok(Decoded {
                batch,
                bad: Vec::new(),
            });
        };
        let (values, bad) = self.decode_values(declared, chunk)?;
        let mut kafka = RecordBatch::try_new(self.kafka_schema.clone(), self.kafka.arrays(chunk))
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

    /// The declared columns of every record but the bad ones, in chunk order,
    /// and the bad ones.
    fn decode_values(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
    ) -> Result<(RecordBatch, Vec<BadRecord>), SqlError> {
        let with_value: Vec<usize> = chunk
            .iter()
            .enumerate()
            .filter_map(|(index, record)| record.value().map(|_| index))
            .collect();
        let mut parts = Vec::new();
        let mut bad = Vec::new();
        self.decode_indices(declared, chunk, &with_value, &mut parts, &mut bad);
        let tombstones = with_value.len() < chunk.len();
        let not_null = declared.fields().iter().find(|f| !f.is_nullable());
        if tombstones && let Some(field) = not_null {
            let reason = format!(
                "a null value (a tombstone) makes a row of nulls, but column `{}` is NOT NULL",
                field.name()
            );
            bad.extend(
                chunk
                    .iter()
                    .enumerate()
                    .filter(|(_, record)| record.value().is_none())
                    .map(|(index, _)| BadRecord {
                        index,
                        reason: reason.clone(),
                    }),
            );
        }
        bad.sort_by_key(|b| b.index);
        let values =
            concat_batches(declared, &parts).map_err(|e| SqlError::Internal(e.to_string()))?;
        if !tombstones || not_null.is_some() {
            // No tombstone kept: the rows are the values' rows.
            return Ok((values, bad));
        }
        // A row of nulls for each tombstone kept, in its place among the rows.
        let mut is_bad = bad.iter().map(|b| b.index).peekable();
        let mut next = 0_u32;
        let layout: UInt32Array = chunk
            .iter()
            .enumerate()
            .filter(|(index, _)| is_bad.next_if_eq(index).is_none())
            .map(|(_, record)| {
                record.value().map(|_| {
                    next += 1;
                    next - 1
                })
            })
            .collect();
        let rows =
            take_record_batch(&values, &layout).map_err(|e| SqlError::Internal(e.to_string()))?;
        Ok((rows, bad))
    }

    /// Decodes the values of the records at `indices`: JSON values in one pass
    /// where the one-pass decoder reads them, each value it declines by arrow's
    /// reader alone, and, after a few declined in a chunk (values it never
    /// reads, such as numbers in strings), the rest by arrow's reader.
    fn decode_indices(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
        indices: &[usize],
        parts: &mut Vec<RecordBatch>,
        bad: &mut Vec<BadRecord>,
    ) {
        const DECLINED_BEFORE_ARROW: usize = 8;
        let mut rest = indices;
        if let Some(flat) = &self.flat {
            let value = |index: &usize| {
                chunk
                    .get(*index)
                    .and_then(|r| r.value())
                    .unwrap_or_default()
            };
            for _ in 0..DECLINED_BEFORE_ARROW {
                if rest.is_empty() {
                    return;
                }
                let (rows, read) = flat.decode(rest.iter().map(value));
                parts.extend(rows);
                if read == rest.len() {
                    return;
                }
                self.bisect(declared, chunk, &rest[read..=read], parts, bad);
                rest = &rest[read + 1..];
            }
        }
        self.bisect(declared, chunk, rest, parts, bad);
    }

    /// Decodes the values of the records at `indices` through one decoder, or,
    /// when one of them does not decode, each half on its own, down to the bad
    /// values, which go to `bad`. A chunk without bad values is decoded once;
    /// each bad one costs about two decodes of its chunk more.
    fn bisect(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
        indices: &[usize],
        parts: &mut Vec<RecordBatch>,
        bad: &mut Vec<BadRecord>,
    ) {
        if indices.is_empty() {
            return;
        }
        match self.decode_run(declared, chunk, indices) {
            Ok(rows) => parts.push(rows),
            Err(reason) if indices.len() == 1 => bad.push(BadRecord {
                index: indices[0],
                reason,
            }),
            Err(_) => {
                let (left, right) = indices.split_at(indices.len() / 2);
                self.bisect(declared, chunk, left, parts, bad);
                self.bisect(declared, chunk, right, parts, bad);
            }
        }
    }

    /// The rows of the values at `indices`, one each, or why not.
    fn decode_run(
        &self,
        declared: &SchemaRef,
        chunk: &RecordChunk,
        indices: &[usize],
    ) -> Result<RecordBatch, String> {
        let mut decoder =
            RowDecoder::new(&self.format, indices.len()).map_err(|e| e.to_string())?;
        for &index in indices {
            let value = chunk.get(index).and_then(|r| r.value()).unwrap_or_default();
            decoder.push(value)?;
        }
        decoder.finish(declared).map_err(|e| e.to_string())
    }
}

/// One format's decoder, fed one value at a time, so that every value is seen to
/// make exactly one row: a value holding two objects, or none, would otherwise
/// shift the rows against their records.
enum RowDecoder<'f> {
    Json(arrow::json::reader::Decoder),
    Csv(Box<arrow::csv::reader::Decoder>),
    Avro(&'f AvroFormat, arrow_avro::reader::Decoder),
}

impl<'f> RowDecoder<'f> {
    /// A decoder for up to `rows` values.
    fn new(format: &'f Format, rows: usize) -> Result<RowDecoder<'f>, ArrowError> {
        // Room for one more row than values, so that a value holding two is seen.
        let capacity = rows + 1;
        Ok(match format {
            Format::Json(schema) => RowDecoder::Json(
                arrow::json::ReaderBuilder::new(schema.clone())
                    .with_batch_size(capacity)
                    .build_decoder()?,
            ),
            Format::Csv(schema) => RowDecoder::Csv(Box::new(
                arrow::csv::ReaderBuilder::new(schema.clone())
                    .with_header(false)
                    .with_batch_size(capacity)
                    .build_decoder(),
            )),
            // Exactly as many as values: a decoder that is full stops after a
            // datum, so that bytes left after it are seen as such.
            Format::Avro(avro) => RowDecoder::Avro(avro, avro.decoder(rows)?),
            Format::Raw => {
                return Err(ArrowError::InvalidArgumentError(
                    "raw values are not decoded".to_owned(),
                ));
            }
        })
    }

    /// Decodes one value, which must make exactly one row.
    fn push(&mut self, value: &[u8]) -> Result<(), String> {
        match self {
            RowDecoder::Json(decoder) => {
                let before = decoder.len();
                let fixed = astral_pairs_unescaped(value);
                let value = fixed.as_deref().unwrap_or(value);
                feed(value, |bytes| decoder.decode(bytes)).map_err(|e| e.to_string())?;
                // The line's end closes a value cut short, so that it counts.
                feed(b"\n", |bytes| decoder.decode(bytes)).map_err(|e| e.to_string())?;
                let made = decoder.len() - before;
                if made != 1 || decoder.has_partial_record() {
                    return Err(one_row("JSON object", made, decoder.has_partial_record()));
                }
            }
            RowDecoder::Csv(decoder) => {
                let before = decoder.capacity();
                feed(value, |bytes| decoder.decode(bytes)).map_err(|e| e.to_string())?;
                feed(b"\n", |bytes| decoder.decode(bytes)).map_err(|e| e.to_string())?;
                let made = before - decoder.capacity();
                if made != 1 {
                    return Err(one_row("line", made, false));
                }
            }
            RowDecoder::Avro(format, decoder) => {
                let datum = format.datum(value)?;
                let before = decoder.capacity();
                let prefix = [0, 0, 0, 0, 0];
                let read = decoder.decode(&prefix).map_err(|e| e.to_string())?;
                let body = decoder.decode(datum).map_err(|e| e.to_string())?;
                if read != prefix.len() || before - decoder.capacity() != 1 {
                    return Err(format!(
                        "the value ends inside its Avro datum ({} bytes)",
                        datum.len()
                    ));
                }
                if body != datum.len() {
                    return Err(format!(
                        "the value holds {} bytes after its Avro datum",
                        datum.len() - body
                    ));
                }
            }
        }
        Ok(())
    }

    /// The rows decoded so far, in the columns `format` declares.
    fn finish(self, declared: &SchemaRef) -> Result<RecordBatch, ArrowError> {
        let batch = match self {
            RowDecoder::Json(mut decoder) => decoder.flush()?,
            RowDecoder::Csv(mut decoder) => decoder.flush()?,
            // Avro's own schema carries metadata and non-null fields; the table's
            // columns are the same without them.
            RowDecoder::Avro(_, mut decoder) => decoder
                .flush()
                .map_err(ArrowError::from)?
                .map(|batch| batch.with_schema(declared.clone()))
                .transpose()?,
        };
        Ok(batch.unwrap_or_else(|| RecordBatch::new_empty(declared.clone())))
    }
}

/// `value` with each escaped surrogate pair of a character from U+20000 up
/// written as the character's UTF-8 instead, or `None` when it has none.
///
/// arrow's JSON reader (59) joins a pair's halves with a bitwise or where an
/// addition belongs, so that `\ud84d\ude00` (U+23600) becomes U+13600; the
/// characters below U+20000, emoji among them, come out right. The UTF-8 form
/// is the same JSON string, and arrow reads it as it is; the one-pass decoder
/// ([`crate::flat_json`]) decodes pairs itself.
fn astral_pairs_unescaped(value: &[u8]) -> Option<Vec<u8>> {
    let hex = |at: usize| -> Option<u16> {
        let digits = std::str::from_utf8(value.get(at..at + 4)?).ok()?;
        u16::from_str_radix(digits, 16).ok()
    };
    // The pair starting at `at` (a backslash), when it is one arrow misreads.
    let pair = |at: usize| -> Option<char> {
        if value.get(at + 1) != Some(&b'u') || value.get(at + 6..at + 8) != Some(b"\\u") {
            return None;
        }
        let (high, low) = (hex(at + 2)?, hex(at + 8)?);
        if !(0xD840..=0xDBFF).contains(&high) || !(0xDC00..=0xDFFF).contains(&low) {
            return None;
        }
        char::from_u32(0x1_0000 + (u32::from(high - 0xD800) << 10) + u32::from(low - 0xDC00))
    };
    let mut fixed: Option<Vec<u8>> = None;
    let mut copied = 0;
    let mut at = 0;
    while let Some(found) = value[at..].iter().position(|b| *b == b'\\') {
        at += found;
        match pair(at) {
            Some(c) => {
                let out = fixed.get_or_insert_with(|| Vec::with_capacity(value.len()));
                out.extend_from_slice(&value[copied..at]);
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                at += 12;
                copied = at;
            }
            // Any other escape, `\\` included, is two bytes.
            None => at += 2,
        }
        if at >= value.len() {
            break;
        }
    }
    let mut out = fixed?;
    out.extend_from_slice(&value[copied.min(value.len())..]);
    Some(out)
}

/// Feeds all of `bytes` to a push decoder that may take them in parts.
fn feed(
    mut bytes: &[u8],
    mut decode: impl FnMut(&[u8]) -> Result<usize, ArrowError>,
) -> Result<(), ArrowError> {
    while !bytes.is_empty() {
        let read = decode(bytes)?;
        if read == 0 {
            break;
        }
        bytes = &bytes[read..];
    }
    Ok(())
}

fn one_row(unit: &str, made: usize, partial: bool) -> String {
    if partial {
        format!("a value must hold exactly one {unit}, this one ends inside one")
    } else {
        format!("a value must hold exactly one {unit}, this one holds {made}")
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Float64Type, Int64Type};
    use sluice_core::{Offset, Record, TimestampType};

    use super::*;
    use crate::parse_ddl;

    fn column_names(decoder: &Decoder) -> Vec<String> {
        decoder
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    }

    fn chunk(values: &[Option<&str>]) -> RecordChunk {
        let values: Vec<Option<Vec<u8>>> = values
            .iter()
            .map(|v| v.map(|v| v.as_bytes().to_vec()))
            .collect();
        binary_chunk(&values)
    }

    fn binary_chunk(values: &[Option<Vec<u8>>]) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for (i, value) in values.iter().enumerate() {
            chunk.push_record(&Record {
                topic: Arc::from("orders"),
                partition: 0,
                offset: Offset::new(i as i64).unwrap(),
                timestamp_ms: Some(1_700_000_000_000),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: value.clone(),
                headers: Vec::new(),
            });
        }
        chunk
    }

    #[test]
    fn json_values_become_columns_and_bad_ones_are_named() {
        let schema = parse_ddl("order BIGINT, customer STRING, amount DOUBLE").unwrap();
        let decoder = Decoder::new(Format::Json(schema), false);
        let names = column_names(&decoder);
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

    #[test]
    fn a_value_holding_two_rows_or_none_does_not_shift_the_others() {
        let schema = parse_ddl("order BIGINT").unwrap();
        let decoder = Decoder::new(Format::Json(schema), false);
        // Two objects in one value and none in the next: as many rows as values,
        // which must not pass for one row each.
        let decoded = decoder
            .decode(&chunk(&[
                Some(r#"{"order":1}"#),
                Some(r#"{"order":5}{"order":6}"#),
                Some("  "),
                Some(r#"{"order":4}"#),
            ]))
            .unwrap();
        let bad: Vec<usize> = decoded.bad.iter().map(|b| b.index).collect();
        assert_eq!(bad, [1, 2]);
        let orders = decoded.batch.column(0).as_primitive::<Int64Type>();
        let offsets = decoded.batch.column_by_name("offset").unwrap();
        let offsets = offsets.as_primitive::<Int64Type>();
        assert_eq!(
            (0..2)
                .map(|i| (orders.value(i), offsets.value(i)))
                .collect::<Vec<_>>(),
            [(1, 0), (4, 3)]
        );

        let csv = Decoder::new(Format::Csv(parse_ddl("a INT, b STRING").unwrap()), false);
        let decoded = csv
            .decode(&chunk(&[Some("1,x\n2,y"), Some(""), Some("3,z")]))
            .unwrap();
        let bad: Vec<usize> = decoded.bad.iter().map(|b| b.index).collect();
        assert_eq!(bad, [0, 1]);
        assert_eq!(decoded.batch.num_rows(), 1);
    }

    #[test]
    fn a_tombstone_is_a_row_of_nulls_unless_a_column_is_not_null() {
        let csv = Decoder::new(Format::Csv(parse_ddl("a INT").unwrap()), false);
        let decoded = csv.decode(&chunk(&[Some("1"), None, Some("3")])).unwrap();
        assert!(decoded.bad.is_empty(), "{:?}", decoded.bad);
        let a = decoded
            .batch
            .column(0)
            .as_primitive::<arrow::datatypes::Int32Type>();
        assert_eq!(a.iter().collect::<Vec<_>>(), [Some(1), None, Some(3)]);

        let strict = Decoder::new(
            Format::Json(parse_ddl("order BIGINT NOT NULL").unwrap()),
            false,
        );
        let decoded = strict
            .decode(&chunk(&[Some(r#"{"order":1}"#), None]))
            .unwrap();
        assert_eq!(decoded.batch.num_rows(), 1);
        assert_eq!(decoded.bad.len(), 1);
        assert!(
            decoded.bad[0].reason.contains("`order` is NOT NULL"),
            "{}",
            decoded.bad[0].reason
        );
    }

    const ORDER_AVRO: &str = r#"{"type": "record", "name": "Order", "fields": [
        {"name": "order", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount", "type": ["null", "double"]}
    ]}"#;

    /// An Avro long, zig-zag encoded as a variable-length integer.
    fn avro_long(mut out: Vec<u8>, n: i64) -> Vec<u8> {
        let mut z = ((n << 1) ^ (n >> 63)) as u64;
        while z >= 0x80 {
            out.push((z as u8) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
        out
    }

    fn avro_order(order: i64, customer: &str, amount: Option<f64>) -> Vec<u8> {
        let mut out = avro_long(Vec::new(), order);
        out = avro_long(out, customer.len() as i64);
        out.extend_from_slice(customer.as_bytes());
        match amount {
            None => avro_long(out, 0),
            Some(amount) => {
                let mut out = avro_long(out, 1);
                out.extend_from_slice(&amount.to_le_bytes());
                out
            }
        }
    }

    #[test]
    fn avro_datums_become_columns_and_bad_ones_are_named() {
        let format = AvroFormat::new(ORDER_AVRO, AvroWire::Raw).unwrap();
        let decoder = Decoder::new(Format::Avro(format), false);
        let names = column_names(&decoder);
        assert_eq!(&names[..4], ["order", "customer", "amount", "key"]);
        let mut trailing = avro_order(4, "d", None);
        trailing.push(7);
        let good = avro_order(1, "ann", Some(2.5));
        let decoded = decoder
            .decode(&binary_chunk(&[
                Some(good.clone()),
                None,
                Some(good[..3].to_vec()),
                Some(trailing),
                Some(avro_order(5, "eve", None)),
            ]))
            .unwrap();
        let bad: Vec<(usize, &str)> = decoded
            .bad
            .iter()
            .map(|b| (b.index, b.reason.as_str()))
            .collect();
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert_eq!(bad[0].0, 2);
        assert!(bad[0].1.contains("ends inside"), "{bad:?}");
        assert_eq!(bad[1].0, 3);
        assert!(bad[1].1.contains("1 bytes after"), "{bad:?}");
        let batch = &decoded.batch;
        assert_eq!(batch.num_rows(), 3);
        let orders = batch.column(0).as_primitive::<Int64Type>();
        assert_eq!(
            orders.iter().collect::<Vec<_>>(),
            [Some(1), None, Some(5)],
            "the tombstone is a row of nulls"
        );
        assert_eq!(batch.column(1).as_string::<i32>().value(2), "eve");
        let amounts = batch.column(2).as_primitive::<Float64Type>();
        assert_eq!(amounts.iter().collect::<Vec<_>>(), [Some(2.5), None, None]);
        let offsets = batch.column_by_name("offset").unwrap();
        let offsets = offsets.as_primitive::<Int64Type>();
        assert_eq!(offsets.values().to_vec(), [0, 1, 4]);
    }

    #[test]
    fn confluent_framed_avro_is_checked_for_its_magic_byte_and_schema_id() {
        let framed = |id: u32, datum: Vec<u8>| {
            let mut out = vec![0];
            out.extend_from_slice(&id.to_be_bytes());
            out.extend(datum);
            out
        };
        let format = AvroFormat::new(ORDER_AVRO, AvroWire::Confluent(Some(7))).unwrap();
        let decoder = Decoder::new(Format::Avro(format), false);
        let decoded = decoder
            .decode(&binary_chunk(&[
                Some(framed(7, avro_order(1, "a", None))),
                Some(framed(8, avro_order(2, "b", None))),
                Some(avro_order(3, "c", None)),
                Some(vec![0, 0]),
            ]))
            .unwrap();
        assert_eq!(decoded.batch.num_rows(), 1);
        let reasons: Vec<&str> = decoded.bad.iter().map(|b| b.reason.as_str()).collect();
        assert!(reasons[0].contains("schema id 8"), "{reasons:?}");
        assert!(reasons[1].contains("zero byte"), "{reasons:?}");
        assert!(reasons[2].contains("2 bytes"), "{reasons:?}");

        let any = AvroFormat::new(ORDER_AVRO, AvroWire::Confluent(None)).unwrap();
        let decoded = Decoder::new(Format::Avro(any), false)
            .decode(&binary_chunk(&[Some(framed(8, avro_order(2, "b", None)))]))
            .unwrap();
        assert!(decoded.bad.is_empty());
    }

    #[test]
    fn an_avro_schema_that_is_not_a_record_is_refused() {
        for (schema, expected) in [
            ("{", "not JSON"),
            (r#""string""#, "must be a record"),
            (
                r#"{"type": "record", "name": "R", "fields": [{"name": "a", "type": "lung"}]}"#,
                "lung",
            ),
        ] {
            let err = AvroFormat::new(schema, AvroWire::Raw)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{schema}: {err}");
        }
    }
}
