//! The query as the executor's processor: decode, then query, chunk by chunk.

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef, TimeUnit, TimestampMillisecondType};
use sluice_offsets::{
    BatchId, BatchMetadata, ERROR_HEADER, EventTimeStats, Processed, Processor, RecordChunk,
    RecordParts,
};

use crate::{BadRecord, Decoder, SqlError, StreamQuery};

/// Decodes each chunk's values and runs the query, if there is one, over them.
/// Records whose values do not decode are handed back with the reason in an
/// `sluice.error` header.
#[derive(Debug)]
pub struct SqlProcessor {
    decoder: Decoder,
    query: Option<StreamQuery>,
    event_time: Option<EventTime>,
}

/// The event-time column and the watermark it drives, as Spark's
/// `withWatermark(column, delay)`: the watermark is the latest event time seen
/// minus the delay, never moves back, and changes only between batches, so
/// that a batch replayed with its recorded watermark gives the same output.
#[derive(Debug)]
struct EventTime {
    /// The column's index in the decoded rows.
    column: usize,
    delay_ms: i64,
    /// The watermark in force for the batch in progress.
    watermark_ms: i64,
    /// The batch's event times so far.
    seen: Seen,
}

/// The event times a batch's rows carried so far.
#[derive(Debug, Default)]
struct Seen {
    min_ms: Option<i64>,
    max_ms: Option<i64>,
    sum_ms: i128,
    count: u64,
}

impl EventTime {
    fn begin(&mut self, watermark_ms: i64) {
        self.watermark_ms = watermark_ms;
        self.seen = Seen::default();
    }

    fn observe(&mut self, batch: &RecordBatch) -> Result<(), SqlError> {
        let column = batch.column(self.column);
        let millis =
            arrow::compute::cast(column, &DataType::Timestamp(TimeUnit::Millisecond, None))
                .map_err(|e| SqlError::Internal(format!("reading the event time: {e}")))?;
        let millis = millis.as_primitive::<TimestampMillisecondType>();
        let seen = &mut self.seen;
        for ms in millis.iter().flatten() {
            seen.min_ms = Some(seen.min_ms.map_or(ms, |m| m.min(ms)));
            seen.max_ms = Some(seen.max_ms.map_or(ms, |m| m.max(ms)));
            seen.sum_ms += i128::from(ms);
            seen.count += 1;
        }
        Ok(())
    }

    /// The watermark the next batch runs under.
    fn next_watermark_ms(&self) -> i64 {
        self.seen.max_ms.map_or(self.watermark_ms, |max| {
            self.watermark_ms.max(max.saturating_sub(self.delay_ms))
        })
    }

    fn stats(&self) -> EventTimeStats {
        let seen = &self.seen;
        EventTimeStats {
            watermark_ms: self.watermark_ms,
            min_ms: seen.min_ms,
            max_ms: seen.max_ms,
            avg_ms: (seen.count > 0).then(|| (seen.sum_ms / i128::from(seen.count)) as i64),
        }
    }
}

impl SqlProcessor {
    /// A processor decoding with `decoder`, then running `query`; without a
    /// query, the decoded rows are the output.
    pub fn new(decoder: Decoder, query: Option<StreamQuery>) -> SqlProcessor {
        SqlProcessor {
            decoder,
            query,
            event_time: None,
        }
    }

    /// Tracks event time in the decoded `column` (a timestamp), with a watermark
    /// `delay_ms` behind the latest event time seen.
    pub fn with_watermark(mut self, column: &str, delay_ms: i64) -> Result<SqlProcessor, SqlError> {
        let schema = self.decoder.schema();
        let names = || {
            schema
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let Some((index, field)) = schema.column_with_name(column) else {
            return Err(SqlError::EventTime {
                column: column.to_owned(),
                reason: format!("no such column; the source table has {}", names()),
            });
        };
        if !matches!(field.data_type(), DataType::Timestamp(_, _)) {
            return Err(SqlError::EventTime {
                column: column.to_owned(),
                reason: format!(
                    "it is {}, and event time must be a TIMESTAMP (declare it so in source.schema)",
                    field.data_type()
                ),
            });
        }
        if delay_ms < 0 {
            return Err(SqlError::EventTime {
                column: column.to_owned(),
                reason: "the watermark delay cannot be negative".to_owned(),
            });
        }
        self.event_time = Some(EventTime {
            column: index,
            delay_ms,
            watermark_ms: 0,
            seen: Seen::default(),
        });
        Ok(self)
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

    async fn begin_batch(
        &mut self,
        _batch: BatchId,
        metadata: &BatchMetadata,
    ) -> Result<(), SqlError> {
        if let Some(event_time) = &mut self.event_time {
            event_time.begin(metadata.watermark_ms);
        }
        Ok(())
    }

    fn watermark_ms(&self) -> i64 {
        self.event_time
            .as_ref()
            .map_or(0, EventTime::next_watermark_ms)
    }

    fn restore_watermark(&mut self, watermark_ms: i64) {
        if let Some(event_time) = &mut self.event_time {
            event_time.begin(watermark_ms);
        }
    }

    fn event_time(&self) -> Option<EventTimeStats> {
        self.event_time.as_ref().map(EventTime::stats)
    }

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<RecordBatch>,
    ) -> Result<(), SqlError> {
        let decoded = self.decoder.decode(&records)?;
        if let Some(event_time) = &mut self.event_time {
            event_time.observe(&decoded.batch)?;
        }
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

    fn metadata(watermark_ms: i64) -> BatchMetadata {
        BatchMetadata {
            watermark_ms,
            timestamp_ms: 0,
            conf: Default::default(),
        }
    }

    fn watermarked(delay_ms: i64) -> SqlProcessor {
        let decoder = Decoder::new(
            Format::Json(parse_ddl("n INT, ts TIMESTAMP").unwrap()),
            false,
        );
        SqlProcessor::new(decoder, None)
            .with_watermark("ts", delay_ms)
            .unwrap()
    }

    async fn batch(processor: &mut SqlProcessor, id: u64, watermark_ms: i64, values: &[&str]) {
        processor
            .begin_batch(BatchId(id), &metadata(watermark_ms))
            .await
            .unwrap();
        let mut out = Processed::<RecordBatch>::default();
        processor.process(chunk(values), &mut out).await.unwrap();
        processor.finish_batch(BatchId(id), &mut out).await.unwrap();
    }

    #[tokio::test]
    async fn the_watermark_trails_the_latest_event_time_and_never_moves_back() {
        let mut processor = watermarked(10_000);
        batch(
            &mut processor,
            0,
            0,
            &[
                r#"{"n":1,"ts":"2026-01-01T00:00:30Z"}"#,
                r#"{"n":2,"ts":"2026-01-01T00:01:00Z"}"#,
                r#"{"n":3,"ts":null}"#,
            ],
        )
        .await;
        let minute = 1_767_225_600_000 + 60_000;
        let stats = processor.event_time().unwrap();
        assert_eq!(stats.watermark_ms, 0, "batch 0 ran without a watermark");
        assert_eq!(stats.min_ms, Some(minute - 30_000));
        assert_eq!(stats.max_ms, Some(minute));
        assert_eq!(stats.avg_ms, Some(minute - 15_000), "nulls are not counted");
        let next = processor.watermark_ms();
        assert_eq!(next, minute - 10_000);

        // Older events do not move it back.
        batch(
            &mut processor,
            1,
            next,
            &[r#"{"n":4,"ts":"2026-01-01T00:00:01Z"}"#],
        )
        .await;
        assert_eq!(processor.event_time().unwrap().watermark_ms, next);
        assert_eq!(processor.watermark_ms(), next);

        // A batch without event times keeps it too.
        batch(&mut processor, 2, next, &[r#"{"n":5}"#]).await;
        assert_eq!(processor.watermark_ms(), next);
        let stats = processor.event_time().unwrap();
        assert_eq!(
            (stats.min_ms, stats.max_ms, stats.avg_ms),
            (None, None, None)
        );
    }

    #[tokio::test]
    async fn a_batch_begun_again_with_its_recorded_watermark_gives_the_same_one() {
        let values = [r#"{"n":1,"ts":"2026-01-01T00:05:00Z"}"#];
        let mut first = watermarked(60_000);
        batch(&mut first, 7, 1_000, &values).await;
        // The same processor retrying the batch, and a fresh one after a crash.
        let mut retried = watermarked(60_000);
        batch(
            &mut retried,
            7,
            1_000,
            &[r#"{"n":0,"ts":"2026-01-01T09:00:00Z"}"#],
        )
        .await;
        batch(&mut retried, 7, 1_000, &values).await;
        let mut restarted = watermarked(60_000);
        batch(&mut restarted, 7, 1_000, &values).await;
        assert_eq!(first.watermark_ms(), retried.watermark_ms());
        assert_eq!(first.watermark_ms(), restarted.watermark_ms());
        assert_eq!(first.event_time(), restarted.event_time());

        // Restored from a commit, the next batch starts from it.
        let mut resumed = watermarked(60_000);
        resumed.restore_watermark(first.watermark_ms());
        assert_eq!(resumed.watermark_ms(), first.watermark_ms());
    }

    #[test]
    fn an_event_time_column_must_exist_and_be_a_timestamp() {
        let decoder = || {
            Decoder::new(
                Format::Json(parse_ddl("n INT, ts TIMESTAMP").unwrap()),
                false,
            )
        };
        let missing = SqlProcessor::new(decoder(), None)
            .with_watermark("when", 0)
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("source.event_time \"when\": no such column"),
            "{missing}"
        );
        assert!(
            missing.contains("ts"),
            "names the columns there are: {missing}"
        );
        let not_time = SqlProcessor::new(decoder(), None)
            .with_watermark("n", 0)
            .unwrap_err()
            .to_string();
        assert!(not_time.contains("must be a TIMESTAMP"), "{not_time}");
        // Kafka's own timestamp column, in the raw format.
        SqlProcessor::new(Decoder::new(Format::Raw, false), None)
            .with_watermark("timestamp", 5_000)
            .unwrap();
    }
}
