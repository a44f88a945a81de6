//! The query as the executor's processor: decode, then query, chunk by chunk.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use sluice_offsets::{ERROR_HEADER, Processed, Processor, RecordChunk, RecordParts};

use crate::{BadRecord, Decoder, SqlError, StreamQuery};

/// Decodes each chunk's values and runs the query, if there is one, over them.
/// Records whose values do not decode are handed back with the reason in an
/// `sluice.error` header.
#[derive(Debug)]
pub struct SqlProcessor {
    decoder: Decoder,
    query: Option<StreamQuery>,
}

impl SqlProcessor {
    /// A processor decoding with `decoder`, then running `query`; without a
    /// query, the decoded rows are the output.
    pub fn new(decoder: Decoder, query: Option<StreamQuery>) -> SqlProcessor {
        SqlProcessor { decoder, query }
    }

    /// The schema of the rows the sink receives.
    pub fn output_schema(&self) -> SchemaRef {
        match &self.query {
            Some(query) => query.schema(),
            None => self.decoder.schema(),
        }
    }
}

impl Processor for SqlProcessor {
    type Output = RecordBatch;
    type Error = SqlError;

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<RecordBatch>,
    ) -> Result<(), SqlError> {
        let decoded = self.decoder.decode(&records)?;
        let mut bad: Vec<BadRecord> = decoded.bad;
        let rows = match &self.query {
            Some(query) => match query.run(decoded.batch.clone()).await {
                Ok(rows) => rows,
                // A row the query cannot compute (a cast of a value that does not
                // fit): find it, so that it is a bad record like one that does not
                // decode, rather than a chunk that stops the query on every replay.
                Err(SqlError::Execution(_)) => {
                    let records_of_rows = rows_to_records(records.len(), &bad);
                    let (rows, failed) = query.run_each(&decoded.batch).await?;
                    bad.extend(failed.into_iter().map(|(row, reason)| BadRecord {
                        index: records_of_rows[row],
                        reason: format!("the query failed on its row: {reason}"),
                    }));
                    bad.sort_by_key(|b| b.index);
                    rows
                }
                Err(e) => return Err(e),
            },
            None if decoded.batch.num_rows() > 0 => vec![decoded.batch],
            None => Vec::new(),
        };
        for bad in &bad {
            let Some(record) = records.get(bad.index) else {
                continue;
            };
            out.bad.push(
                record.topic_arc(),
                RecordParts {
                    partition: record.partition(),
                    offset: record.offset(),
                    timestamp_ms: record.timestamp_ms(),
                    timestamp_type: record.timestamp_type(),
                    key: record.key(),
                    value: record.value(),
                },
                record
                    .headers()
                    .chain(std::iter::once((ERROR_HEADER, Some(bad.reason.as_bytes())))),
            );
        }
        out.row_count += rows.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        out.rows.extend(rows);
        Ok(())
    }
}

/// The record each decoded row came from: every record of the chunk but those
/// that did not decode, in order.
fn rows_to_records(records: usize, bad: &[BadRecord]) -> Vec<usize> {
    let mut bad = bad.iter().map(|b| b.index).peekable();
    (0..records)
        .filter(|index| bad.next_if_eq(index).is_none())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, RecordBatch};
    use arrow::datatypes::Int32Type;
    use sluice_offsets::{Offset, Processed, Processor, Record, RecordChunk, TimestampType};

    use super::*;
    use crate::{Format, parse_ddl};

    fn chunk(values: &[&str]) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for (i, value) in values.iter().enumerate() {
            chunk.push_record(&Record {
                topic: Arc::from("orders"),
                partition: 0,
                offset: Offset::new(100 + i as i64).unwrap(),
                timestamp_ms: Some(1_700_000_000_000),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: Some(value.as_bytes().to_vec()),
                headers: Vec::new(),
            });
        }
        chunk
    }

    #[tokio::test]
    async fn a_row_the_query_cannot_compute_is_a_bad_record_of_its_own() {
        let decoder = Decoder::new(Format::Json(parse_ddl("code STRING").unwrap()), false);
        let query = StreamQuery::plan(
            "SELECT CAST(code AS INT) AS n, offset FROM source",
            "source",
            decoder.schema(),
        )
        .await
        .unwrap();
        let mut processor = SqlProcessor::new(decoder, Some(query));
        let mut out = Processed::<RecordBatch>::default();
        processor
            .process(
                chunk(&[
                    r#"{"code":"1"}"#,
                    "not json",
                    r#"{"code":"x"}"#,
                    r#"{"code":"4"}"#,
                ]),
                &mut out,
            )
            .await
            .unwrap();
        let bad: Vec<(i64, String)> = out
            .bad
            .iter()
            .map(|r| {
                let reason = r
                    .headers()
                    .find(|(k, _)| *k == ERROR_HEADER)
                    .and_then(|(_, v)| v)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                (r.offset().value(), reason)
            })
            .collect();
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert_eq!(bad[0].0, 101);
        assert_eq!(bad[1].0, 102, "{bad:?}");
        assert!(bad[1].1.contains("the query failed on its row"), "{bad:?}");
        let n: Vec<i32> = out
            .rows
            .iter()
            .flat_map(|b| b.column(0).as_primitive::<Int32Type>().values().to_vec())
            .collect();
        assert_eq!(n, [1, 4]);
        assert_eq!(out.row_count, 2);
    }
}
