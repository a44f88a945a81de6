//! The query as the executor's processor: decode, then query, chunk by chunk.

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use sluice_core::{
    BatchId, BatchMetadata, ERROR_HEADER, EventTime, EventTimeStats, LookupStats, Processed,
    Processor, RecordChunk, RecordParts, StatefulOperator,
};
#[cfg(test)]
use sluice_core::{StateFile, StateFileKind};

use crate::{BadRecord, Decoder, LookupTable, SqlError, StreamQuery, TableLoader};

/// Decodes each chunk's values and runs the query, if there is one, over them.
/// Records whose values do not decode are handed back with the reason in an
/// `sluice.error` header. A query of several sources has a decoder each, and
/// decodes each chunk with its source's.
pub struct SqlProcessor {
    decoders: Vec<Decoder>,
    query: Option<StreamQuery>,
    event_time: Option<Clock>,
    /// The query's lookup tables, each asked at the beginning of a batch
    /// whether it changed.
    lookups: Vec<(LookupTable, Option<Box<dyn TableLoader>>)>,
}

impl std::fmt::Debug for SqlProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlProcessor")
            .field("decoders", &self.decoders)
            .field("query", &self.query)
            .field("event_time", &self.event_time)
            .field(
                "lookups",
                &self.lookups.iter().map(|(t, _)| t).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// The query's event time, as Spark's `withWatermark(column, delay)` on each
/// source that has one: a source's watermark is the latest event time it saw
/// minus its delay, the query's is the least of the sources' that saw any
/// (Spark's default policy), never moves back, and changes only between
/// batches, so that a batch replayed with its recorded watermark gives the
/// same output.
#[derive(Debug)]
struct Clock {
    /// Each source's event time, by index; `None` for one without.
    sources: Vec<Option<SourceTime>>,
    /// The watermark in force for the batch in progress.
    watermark_ms: i64,
    /// The watermark the last batch begun ran under, for no-data batches.
    begun_ms: i64,
}

/// One source's event-time column and what its rows carried.
#[derive(Debug)]
struct SourceTime {
    /// The column's index in the source's decoded rows.
    column: usize,
    delay_ms: i64,
    /// The batch's event times so far.
    seen: Seen,
    /// The source's watermark as of the batches before this one, since the
    /// query started: `None` until it saw an event time.
    before_ms: Option<i64>,
    /// The last batch finished, with the source's watermark after it: taken
    /// into `before_ms` when the next batch begins, and dropped when the same
    /// batch begins again.
    finished: Option<(BatchId, Option<i64>)>,
}

/// The event times a batch's rows carried so far.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    min_ms: Option<i64>,
    max_ms: Option<i64>,
    sum_ms: i128,
    count: u64,
}

impl SourceTime {
    fn observe(&mut self, batch: &RecordBatch) -> Result<(), SqlError> {
        let column = batch.column(self.column);
        let millis = sluice_state::epoch_millis(column)
            .map_err(|e| SqlError::Internal(format!("reading the event time: {e}")))?;
        let seen = &mut self.seen;
        for ms in millis.iter().flatten() {
            seen.min_ms = Some(seen.min_ms.map_or(ms, |m| m.min(ms)));
            seen.max_ms = Some(seen.max_ms.map_or(ms, |m| m.max(ms)));
            seen.sum_ms += i128::from(ms);
            seen.count += 1;
        }
        Ok(())
    }

    /// The source's watermark with this batch's rows: `None` while it has
    /// seen no event time.
    fn watermark_ms(&self) -> Option<i64> {
        let now = self
            .seen
            .max_ms
            .map(|max| max.saturating_sub(self.delay_ms));
        match (self.before_ms, now) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Clock {
    fn begin(&mut self, watermark_ms: i64) {
        self.watermark_ms = watermark_ms;
        for source in self.sources.iter_mut().flatten() {
            source.seen = Seen::default();
        }
    }

    /// Notes what a finished batch's rows moved each source's watermark to.
    fn finish(&mut self, batch: BatchId) {
        for source in self.sources.iter_mut().flatten() {
            source.finished = Some((batch, source.watermark_ms()));
        }
    }

    /// Takes the last finished batch's sources' watermarks as those before
    /// `batch`, unless `batch` is that batch begun again: then it gives the
    /// same watermark, whatever an earlier attempt saw.
    fn advance_to(&mut self, batch: BatchId) {
        for source in self.sources.iter_mut().flatten() {
            if let Some((finished, watermark_ms)) = source.finished.take()
                && finished != batch
            {
                source.before_ms = watermark_ms;
            }
        }
    }

    /// The rows of `batch` (of `source`) at or after the watermark, and how
    /// many were older. A source without event time has no late rows.
    fn on_time(&self, source: usize, batch: RecordBatch) -> Result<(RecordBatch, u64), SqlError> {
        let Some(Some(time)) = self.sources.get(source) else {
            return Ok((batch, 0));
        };
        let millis = sluice_state::epoch_millis(batch.column(time.column))
            .map_err(|e| SqlError::Internal(format!("reading the event time: {e}")))?;
        let keep: arrow::array::BooleanArray = millis
            .iter()
            .map(|ms| Some(ms.is_none_or(|ms| ms >= self.watermark_ms)))
            .collect();
        let late = (keep.len() - keep.true_count()) as u64;
        if late == 0 {
            return Ok((batch, 0));
        }
        let kept = arrow::compute::filter_record_batch(&batch, &keep)
            .map_err(|e| SqlError::Internal(format!("dropping late rows: {e}")))?;
        Ok((kept, late))
    }

    fn observe(&mut self, source: usize, batch: &RecordBatch) -> Result<(), SqlError> {
        match self.sources.get_mut(source) {
            Some(Some(time)) => time.observe(batch),
            _ => Ok(()),
        }
    }

    /// The watermark the next batch runs under.
    fn next_watermark_ms(&self) -> i64 {
        let least = self
            .sources
            .iter()
            .flatten()
            .filter_map(SourceTime::watermark_ms)
            .min();
        least.map_or(self.watermark_ms, |least| self.watermark_ms.max(least))
    }

    fn stats(&self) -> EventTimeStats {
        let mut seen = Seen::default();
        for source in self.sources.iter().flatten() {
            let s = source.seen;
            seen.min_ms = match (seen.min_ms, s.min_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            seen.max_ms = match (seen.max_ms, s.max_ms) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            seen.sum_ms += s.sum_ms;
            seen.count += s.count;
        }
        let source_watermarks_ms = if self.sources.len() > 1 {
            self.sources
                .iter()
                .map(|s| s.as_ref().and_then(SourceTime::watermark_ms))
                .collect()
        } else {
            Vec::new()
        };
        EventTimeStats {
            watermark_ms: self.watermark_ms,
            min_ms: seen.min_ms,
            max_ms: seen.max_ms,
            avg_ms: (seen.count > 0).then(|| (seen.sum_ms / i128::from(seen.count)) as i64),
            source_watermarks_ms,
        }
    }
}

impl SqlProcessor {
    /// A processor decoding with `decoder`, then running `query`; without a
    /// query, the decoded rows are the output.
    pub fn new(decoder: Decoder, query: Option<StreamQuery>) -> SqlProcessor {
        SqlProcessor::with_sources(vec![decoder], query)
    }

    /// A processor of several sources, a decoder each in the order of their
    /// index ([`RecordChunk::source`]), then running `query`, planned over
    /// their tables in that order ([`StreamQuery::plan_streams`]).
    pub fn with_sources(decoders: Vec<Decoder>, query: Option<StreamQuery>) -> SqlProcessor {
        SqlProcessor {
            decoders,
            query,
            event_time: None,
            lookups: Vec::new(),
        }
    }

    /// Reads each lookup table again from its loader when it changed, at the
    /// beginning of every batch, and has a table read by key (without a
    /// loader) forget the rows the last batch read. The tables are the ones
    /// the query was planned with ([`crate::QueryOptions::lookup_tables`]),
    /// with their first version loaded.
    pub fn with_lookups(
        mut self,
        lookups: Vec<(LookupTable, Option<Box<dyn TableLoader>>)>,
    ) -> Self {
        self.lookups = lookups;
        self
    }

    /// Tracks event time in the first source's decoded `column` (a
    /// timestamp), with a watermark `delay_ms` behind the latest event time
    /// seen.
    pub fn with_watermark(self, column: &str, delay_ms: i64) -> Result<SqlProcessor, SqlError> {
        self.with_source_watermark(0, column, delay_ms)
    }

    /// Tracks event time in source `source`'s decoded `column`, as
    /// [`SqlProcessor::with_watermark`] does for the first.
    pub fn with_source_watermark(
        mut self,
        source: usize,
        column: &str,
        delay_ms: i64,
    ) -> Result<SqlProcessor, SqlError> {
        let schema = self
            .decoders
            .get(source)
            .ok_or_else(|| SqlError::Internal(format!("the query has no source {source}")))?
            .schema();
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
        let count = self.decoders.len();
        let clock = self.event_time.get_or_insert_with(|| Clock {
            sources: (0..count).map(|_| None).collect(),
            watermark_ms: 0,
            begun_ms: 0,
        });
        clock.sources[source] = Some(SourceTime {
            column: index,
            delay_ms,
            seen: Seen::default(),
            before_ms: None,
            finished: None,
        });
        Ok(self)
    }

    /// Whether the query aggregates, keeping state across batches.
    pub fn is_stateful(&self) -> bool {
        self.query.as_ref().is_some_and(StreamQuery::is_stateful)
    }

    /// The schema of the rows the sink receives.
    pub fn output_schema(&self) -> SchemaRef {
        match &self.query {
            Some(query) => query.schema(),
            None => self.decoders[0].schema(),
        }
    }
}

impl EventTime for Clock {
    fn next_watermark_ms(&self) -> i64 {
        Clock::next_watermark_ms(self)
    }

    fn restore_watermark(&mut self, watermark_ms: i64) {
        self.begin(watermark_ms);
        // The sources' own come from the plan ([`EventTime::restore_source_watermarks`]).
        for source in self.sources.iter_mut().flatten() {
            source.finished = None;
        }
    }

    fn stats(&self) -> EventTimeStats {
        Clock::stats(self)
    }

    fn source_watermarks_ms(&self) -> Vec<Option<i64>> {
        if self.sources.len() < 2 {
            return Vec::new();
        }
        self.sources
            .iter()
            .map(|s| s.as_ref().and_then(SourceTime::watermark_ms))
            .collect()
    }

    fn restore_source_watermarks(&mut self, watermarks_ms: &[Option<i64>]) {
        for (source, watermark_ms) in self.sources.iter_mut().zip(watermarks_ms) {
            if let Some(source) = source {
                source.before_ms = *watermark_ms;
                source.finished = None;
                source.seen = Seen::default();
            }
        }
    }
}

impl Processor for SqlProcessor {
    type Output = RecordBatch;
    type Error = SqlError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        metadata: &BatchMetadata,
    ) -> Result<(), SqlError> {
        if let Some(event_time) = &mut self.event_time {
            event_time.advance_to(batch);
            event_time.begin(metadata.watermark_ms);
            event_time.begun_ms = metadata.watermark_ms;
        }
        if let Some(query) = self.query.as_mut() {
            query.begin_batch(metadata.watermark_ms)?;
        }
        // A table that fails to load again keeps its last good version, so
        // that a file half written when the batch began does not stop the query.
        for (table, loader) in &mut self.lookups {
            match loader {
                Some(loader) => table.refresh(loader.as_mut()).await?,
                None => table.begin_batch(),
            }
        }
        Ok(())
    }

    async fn finish_batch(
        &mut self,
        batch: BatchId,
        out: &mut Processed<RecordBatch>,
    ) -> Result<(), SqlError> {
        let watermark_ms = self.event_time.as_ref().map_or(0, |e| e.watermark_ms);
        if let Some(clock) = &mut self.event_time {
            clock.finish(batch);
        }
        if let Some(query) = self.query.as_mut().filter(|q| q.is_stateful()) {
            let rows = query.finish_batch(watermark_ms).await?;
            out.row_count += rows.iter().map(|b| b.num_rows() as u64).sum::<u64>();
            out.rows.extend(rows);
        }
        Ok(())
    }

    fn stateful_operators(&mut self) -> Vec<&mut dyn StatefulOperator<SqlError>> {
        self.query
            .as_mut()
            .and_then(StreamQuery::stateful_operator)
            .into_iter()
            .collect()
    }

    fn event_time(&mut self) -> Option<&mut dyn EventTime> {
        self.event_time.as_mut().map(|w| w as &mut dyn EventTime)
    }

    fn lookup_tables(&self) -> Vec<LookupStats> {
        self.lookups
            .iter()
            .map(|(table, _)| table.stats())
            .collect()
    }

    fn is_transient(error: &SqlError) -> bool {
        error.is_transient()
    }

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<RecordBatch>,
    ) -> Result<(), SqlError> {
        let source = records.source();
        let decoder = self.decoders.get(source).ok_or_else(|| {
            SqlError::Internal(format!(
                "a chunk of source {source}, and the query has {} sources",
                self.decoders.len()
            ))
        })?;
        let mut decoded = decoder.decode(&records)?;
        if let Some(event_time) = &mut self.event_time {
            event_time.observe(source, &decoded.batch)?;
        }
        let mut bad: Vec<BadRecord> = decoded.bad;
        let stateful = self.query.as_ref().is_some_and(StreamQuery::is_stateful);
        if stateful && let Some(event_time) = &self.event_time {
            // Late rows are left out of state, as in Spark: their groups may be
            // final and emitted already.
            let (on_time, late) = event_time.on_time(source, decoded.batch)?;
            decoded.batch = on_time;
            if let Some(query) = self.query.as_mut() {
                query.dropped(late);
            }
        }
        let rows = match &self.query {
            Some(query) => match query.run_source(source, decoded.batch.clone()).await {
                Ok(rows) => rows,
                // A row the query cannot compute (a cast of a value that does not
                // fit): find it, so that it is a bad record like one that does not
                // decode, rather than a chunk that stops the query on every replay.
                Err(SqlError::Execution(_)) => {
                    let records_of_rows = rows_to_records(records.len(), &bad);
                    let (rows, failed) = query.run_each(source, &decoded.batch).await?;
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
        let rows = match self.query.as_mut().filter(|_| stateful) {
            // An aggregation's rows are emitted when the batch finishes, a
            // deduplication's first rows at once.
            Some(query) => query.update(&rows)?,
            None => rows,
        };
        out.row_count += rows.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        out.rows.extend(rows);
        Ok(())
    }
}

/// What the executor's checkpoint does with a processor, for the tests here,
/// which run one without an executor.
#[cfg(test)]
impl SqlProcessor {
    fn watermark_ms(&mut self) -> i64 {
        sluice_core::next_watermark_ms(self)
    }

    fn event_stats(&mut self) -> Option<EventTimeStats> {
        self.event_time().map(|clock| clock.stats())
    }

    fn restore_watermark(&mut self, watermark_ms: i64) {
        if let Some(clock) = self.event_time() {
            clock.restore_watermark(watermark_ms);
        }
    }

    fn state_files(&mut self, batch: BatchId) -> Result<Vec<StateFile>, SqlError> {
        self.encoded(batch, StateFileKind::Delta)
    }

    fn state_snapshots(&mut self, batch: BatchId) -> Result<Vec<StateFile>, SqlError> {
        self.encoded(batch, StateFileKind::Snapshot)
    }

    fn encoded(&mut self, batch: BatchId, kind: StateFileKind) -> Result<Vec<StateFile>, SqlError> {
        sluice_core::encode_state(self, batch, kind)
    }

    fn commit_state(&mut self) {
        for state in self.stateful_operators() {
            state.commit();
        }
    }

    fn restore_state(&mut self, files: &[StateFile]) -> Result<(), SqlError> {
        for state in self.stateful_operators() {
            state.restore(files)?;
        }
        Ok(())
    }

    fn state_progress(&mut self) -> Vec<sluice_core::StateOperatorStats> {
        self.stateful_operators()
            .iter()
            .map(|state| state.stats())
            .collect()
    }

    fn wants_batch_without_data(&mut self, last_watermark_ms: i64) -> bool {
        sluice_core::wants_batch_without_data(self, last_watermark_ms)
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
    use sluice_core::{Offset, Processed, Processor, Record, RecordChunk, TimestampType};

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
        let stats = processor.event_stats().unwrap();
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
        assert_eq!(processor.event_stats().unwrap().watermark_ms, next);
        assert_eq!(processor.watermark_ms(), next);

        // A batch without event times keeps it too.
        batch(&mut processor, 2, next, &[r#"{"n":5}"#]).await;
        assert_eq!(processor.watermark_ms(), next);
        let stats = processor.event_stats().unwrap();
        assert_eq!(
            (stats.min_ms, stats.max_ms, stats.avg_ms),
            (None, None, None)
        );
    }

    /// A query of two sources: `a` (`n INT, ts TIMESTAMP`, a watermark 10 s
    /// behind) and `b` (`m INT, ts TIMESTAMP`, 20 s behind), unioned.
    async fn two_sources() -> SqlProcessor {
        let a = Decoder::new(
            Format::Json(parse_ddl("n INT, ts TIMESTAMP").unwrap()),
            false,
        );
        let b = Decoder::new(
            Format::Json(parse_ddl("m INT, ts TIMESTAMP").unwrap()),
            false,
        );
        let streams = [("a".to_owned(), a.schema()), ("b".to_owned(), b.schema())];
        let query = StreamQuery::plan_streams(
            "SELECT 'a' AS s, n FROM a UNION ALL SELECT 'b' AS s, m AS n FROM b",
            &streams,
            &crate::QueryOptions::default(),
        )
        .await
        .unwrap();
        SqlProcessor::with_sources(vec![a, b], Some(query))
            .with_source_watermark(0, "ts", 10_000)
            .unwrap()
            .with_source_watermark(1, "ts", 20_000)
            .unwrap()
    }

    /// Runs batch `id` over chunks of `(source, values)`; returns its rows as
    /// `source:n`.
    async fn sources_batch(
        processor: &mut SqlProcessor,
        id: u64,
        watermark_ms: i64,
        chunks: &[(usize, &[&str])],
    ) -> Vec<String> {
        processor
            .begin_batch(BatchId(id), &metadata(watermark_ms))
            .await
            .unwrap();
        let mut out = Processed::<RecordBatch>::default();
        for (source, values) in chunks {
            let mut records = chunk(values);
            records.set_source(*source);
            processor.process(records, &mut out).await.unwrap();
        }
        processor.finish_batch(BatchId(id), &mut out).await.unwrap();
        let mut rows = Vec::new();
        for batch in &out.rows {
            let s = batch.column(0).as_string::<i32>();
            let n = batch.column(1).as_primitive::<Int32Type>();
            for row in 0..batch.num_rows() {
                rows.push(format!("{}:{}", s.value(row), n.value(row)));
            }
        }
        rows
    }

    #[tokio::test]
    async fn each_source_is_decoded_as_its_own_and_the_query_watermark_is_the_least() {
        let minute = 1_767_225_600_000 + 60_000;
        let mut processor = two_sources().await;
        // Only `a` has rows: `b` has no watermark yet and does not hold the
        // query's back, as in Spark.
        let rows = sources_batch(
            &mut processor,
            0,
            0,
            &[(0, &[r#"{"n":1,"ts":"2026-01-01T00:01:00Z"}"#])],
        )
        .await;
        assert_eq!(rows, ["a:1"]);
        assert_eq!(processor.watermark_ms(), minute - 10_000);
        assert_eq!(
            processor.event_stats().unwrap().source_watermarks_ms,
            [Some(minute - 10_000), None]
        );
        // `b`'s rows are read with its own columns; its watermark is now the least.
        let w1 = processor.watermark_ms();
        let rows = sources_batch(
            &mut processor,
            1,
            w1,
            &[
                (1, &[r#"{"m":7,"ts":"2026-01-01T00:01:05Z"}"#]),
                (0, &[r#"{"n":2,"ts":"2026-01-01T00:02:00Z"}"#]),
            ],
        )
        .await;
        assert_eq!(rows, ["b:7", "a:2"]);
        assert_eq!(
            processor.event_stats().unwrap().source_watermarks_ms,
            [Some(minute + 50_000), Some(minute - 15_000)]
        );
        assert_eq!(
            processor.watermark_ms(),
            w1,
            "b's is less, and the query's never moves back"
        );

        // Batch 2 begun twice, the first attempt with rows that moved `a`
        // far on and did not finish: the same watermark as a fresh run.
        let w2 = processor.watermark_ms();
        processor
            .begin_batch(BatchId(2), &metadata(w2))
            .await
            .unwrap();
        let mut far = chunk(&[r#"{"n":3,"ts":"2026-01-01T09:00:00Z"}"#]);
        far.set_source(0);
        processor
            .process(far, &mut Processed::default())
            .await
            .unwrap();
        sources_batch(
            &mut processor,
            2,
            w2,
            &[(1, &[r#"{"m":8,"ts":"2026-01-01T00:03:00Z"}"#])],
        )
        .await;
        assert_eq!(
            processor.event_stats().unwrap().source_watermarks_ms,
            [
                Some(minute + 60_000 - 10_000),
                Some(minute + 120_000 - 20_000)
            ]
        );
        assert_eq!(processor.watermark_ms(), minute + 60_000 - 10_000);

        // A restart takes the sources' own watermarks back from the plan, so
        // that `a` holds the query's back while only `b` has rows.
        let recorded = processor.event_time().unwrap().source_watermarks_ms();
        let mut restarted = two_sources().await;
        restarted.restore_watermark(processor.watermark_ms());
        restarted
            .event_time()
            .unwrap()
            .restore_source_watermarks(&recorded);
        let w3 = restarted.watermark_ms();
        sources_batch(
            &mut restarted,
            3,
            w3,
            &[(1, &[r#"{"m":9,"ts":"2026-01-01T00:10:00Z"}"#])],
        )
        .await;
        assert_eq!(
            restarted.watermark_ms(),
            minute + 60_000 - 10_000,
            "held by a"
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
        let watermark = first.watermark_ms();
        assert_eq!(watermark, retried.watermark_ms());
        assert_eq!(watermark, restarted.watermark_ms());
        assert_eq!(first.event_stats(), restarted.event_stats());

        // Restored from a commit, the next batch starts from it.
        let mut resumed = watermarked(60_000);
        let watermark = first.watermark_ms();
        resumed.restore_watermark(watermark);
        assert_eq!(resumed.watermark_ms(), watermark);
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

#[cfg(test)]
mod stateful_tests {
    use std::sync::Arc;

    use arrow::array::RecordBatch;
    use sluice_core::{
        BatchId, BatchMetadata, Offset, Processed, Processor, Record, RecordChunk, StateFile,
        TimestampType,
    };

    use super::*;
    use crate::{Format, OutputMode, QueryOptions, parse_ddl};

    const SQL: &str = "SELECT window.start AS s, window.end AS e, user, count(*) AS n, \
                       sum(amount) AS total FROM source GROUP BY window(ts, '10 seconds'), user";

    async fn processor(sql: &str, mode: Option<OutputMode>) -> SqlProcessor {
        let options = QueryOptions {
            output_mode: mode,
            watermark_column: Some("ts".to_owned()),
            ..QueryOptions::default()
        };
        planned(sql, &options).await
    }

    /// A processor running `sql` planned with `options`, with a watermark 5 s
    /// behind `ts`.
    async fn planned(sql: &str, options: &QueryOptions) -> SqlProcessor {
        let decoder = Decoder::new(
            Format::Json(parse_ddl("user STRING, amount BIGINT, ts TIMESTAMP").unwrap()),
            false,
        );
        let query = StreamQuery::plan_with(sql, "source", decoder.schema(), options)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        SqlProcessor::new(decoder, Some(query))
            .with_watermark("ts", 5_000)
            .unwrap()
    }

    fn chunk(rows: &[(&str, i64, i64)]) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for (i, (user, amount, second)) in rows.iter().enumerate() {
            let value = format!(
                r#"{{"user":"{user}","amount":{amount},"ts":"2026-01-01T00:00:{second:02}Z"}}"#
            );
            chunk.push_record(&Record {
                topic: Arc::from("orders"),
                partition: 0,
                offset: Offset::new(i as i64).unwrap(),
                timestamp_ms: Some(0),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: Some(value.into_bytes()),
                headers: Vec::new(),
            });
        }
        chunk
    }

    /// Runs one batch; its emitted rows as text, sorted, and its state files.
    async fn run(
        p: &mut SqlProcessor,
        id: u64,
        rows: &[(&str, i64, i64)],
    ) -> (Vec<String>, Vec<StateFile>) {
        let metadata = BatchMetadata {
            watermark_ms: p.watermark_ms(),
            timestamp_ms: 0,
            conf: Default::default(),
        };
        p.begin_batch(BatchId(id), &metadata).await.unwrap();
        let mut out = Processed::<RecordBatch>::default();
        if !rows.is_empty() {
            p.process(chunk(rows), &mut out).await.unwrap();
        }
        p.finish_batch(BatchId(id), &mut out).await.unwrap();
        let files = p.state_files(BatchId(id)).unwrap();
        p.commit_state();
        (text(&out.rows), files)
    }

    /// Rows as text, a line each, sorted.
    pub(super) fn text(batches: &[RecordBatch]) -> Vec<String> {
        let mut rows = Vec::new();
        for batch in batches {
            for row in 0..batch.num_rows() {
                let cells: Vec<String> = batch
                    .columns()
                    .iter()
                    .map(|c| arrow::util::display::array_value_to_string(c, row).unwrap())
                    .collect();
                rows.push(cells.join(" "));
            }
        }
        rows.sort();
        rows
    }

    const T0: &str = "2026-01-01T00:00:00Z";
    const T10: &str = "2026-01-01T00:00:10Z";
    const T20: &str = "2026-01-01T00:00:20Z";

    #[tokio::test]
    async fn append_emits_each_window_once_when_the_watermark_passes_its_end() {
        let mut p = processor(SQL, None).await;
        let (out, _) = run(&mut p, 0, &[("ann", 5, 1), ("bob", 1, 2), ("ann", 7, 12)]).await;
        assert!(out.is_empty(), "nothing is final yet: {out:?}");
        assert_eq!(p.watermark_ms(), 1_767_225_600_000 + 7_000);
        // 3 s is older than the watermark (7 s): dropped and counted.
        let (out, _) = run(&mut p, 1, &[("ann", 100, 3), ("bob", 2, 25)]).await;
        assert!(out.is_empty(), "[0, 10) ends after 7 s: {out:?}");
        assert_eq!(p.state_progress()[0].rows_dropped_by_watermark, 1);
        assert!(p.wants_batch_without_data(1_767_225_607_000));
        // A batch without data under the watermark of 20 s closes two windows.
        let (out, _) = run(&mut p, 2, &[]).await;
        assert_eq!(
            out,
            [
                format!("{T0} {T10} ann 1 5"),
                format!("{T0} {T10} bob 1 1"),
                format!("{T10} {T20} ann 1 7"),
            ]
        );
        let stats = &p.state_progress()[0];
        assert_eq!((stats.rows_total, stats.rows_removed), (1, 3), "{stats:?}");
        let watermark = p.watermark_ms();
        assert!(!p.wants_batch_without_data(watermark));
        // And never again.
        let (out, _) = run(&mut p, 3, &[("carl", 1, 59)]).await;
        assert!(
            out.is_empty(),
            "[20 s, 30 s) ends after the watermark of 20 s: {out:?}"
        );
        let (out, _) = run(&mut p, 4, &[]).await;
        assert_eq!(out, [format!("{T20} 2026-01-01T00:00:30Z bob 1 2")]);
    }

    #[tokio::test]
    async fn update_emits_the_groups_a_batch_changed() {
        let mut p = processor(SQL, Some(OutputMode::Update)).await;
        let (out, _) = run(&mut p, 0, &[("ann", 5, 1), ("bob", 1, 2)]).await;
        assert_eq!(out.len(), 2);
        let (out, _) = run(&mut p, 1, &[("ann", 5, 3)]).await;
        assert_eq!(out, [format!("{T0} {T10} ann 2 10")]);
    }

    #[tokio::test]
    async fn state_restored_from_its_files_continues_as_if_nothing_happened() {
        // Windows close in batches 4 and 6; the files after them must not
        // bring their groups back.
        let batches: Vec<Vec<(&str, i64, i64)>> = vec![
            vec![("ann", 5, 1), ("bob", 1, 2)],
            vec![("ann", 1, 8), ("bob", 2, 14)],
            vec![("ann", 3, 16), ("carl", 4, 18)],
            vec![("ann", 1, 29)],
            vec![],
            vec![("bob", 1, 31), ("dan", 2, 33)],
            vec![("ann", 6, 47)],
            vec![("carl", 1, 48)],
            vec![],
        ];
        for mode in [OutputMode::Update, OutputMode::Append] {
            let mut straight = processor(SQL, Some(mode)).await;
            let mut expected = Vec::new();
            for (id, rows) in batches.iter().enumerate() {
                let out = run(&mut straight, id as u64, rows).await.0;
                expected.push((out, straight.state_progress()[0].rows_total));
            }
            assert!(
                expected.iter().any(|(out, _)| !out.is_empty()),
                "{mode:?} emits"
            );
            // Crash after every batch: a fresh processor restores from the files.
            let mut files: Vec<StateFile> = Vec::new();
            let mut watermark = 0;
            for (id, rows) in batches.iter().enumerate() {
                let mut p = processor(SQL, Some(mode)).await;
                p.restore_watermark(watermark);
                p.restore_state(&files).unwrap();
                let (out, new) = run(&mut p, id as u64, rows).await;
                let total = p.state_progress()[0].rows_total;
                assert_eq!((out, total), expected[id], "{mode:?}, batch {id}");
                files.extend(new);
                watermark = p.watermark_ms();
            }
        }
    }

    /// A window of more groups than a chunk of state holds (64 Ki) is
    /// snapshotted and emitted chunk by chunk, each group once.
    #[tokio::test]
    async fn a_window_of_many_chunks_is_snapshotted_and_emitted_whole() {
        let users: Vec<String> = (0..150_000).map(|u| format!("u{u}")).collect();
        let rows: Vec<(&str, i64, i64)> = users.iter().map(|u| (u.as_str(), 2, 1)).collect();
        let mut p = processor(SQL, None).await;
        run(&mut p, 0, &rows).await;
        let snapshot = p.state_snapshots(BatchId(0)).unwrap();
        let mut restored = processor(SQL, None).await;
        restored.restore_watermark(p.watermark_ms());
        restored.restore_state(&snapshot).unwrap();
        for p in [&mut p, &mut restored] {
            let (out, _) = run(p, 1, &[("late", 1, 30)]).await;
            assert_eq!(p.watermark_ms(), 1_767_225_600_000 + 25_000);
            let (out_closed, _) = run(p, 2, &[]).await;
            assert!(out.is_empty(), "{}", out.len());
            assert_eq!(out_closed.len(), users.len());
            assert!(out_closed.iter().all(|row| row.ends_with(" 1 2")));
            let mut seen: Vec<&str> = out_closed
                .iter()
                .map(|row| row.split(' ').nth(2).unwrap())
                .collect();
            seen.dedup();
            assert_eq!(seen.len(), users.len(), "each group once");
        }
    }

    #[tokio::test]
    async fn sliding_windows_count_a_row_in_each_window_it_falls_in() {
        let sql = "SELECT window.start AS s, count(*) AS n FROM source \
                   GROUP BY window(ts, '10 seconds', '5 seconds')";
        let mut p = processor(sql, Some(OutputMode::Update)).await;
        let (out, _) = run(&mut p, 0, &[("a", 1, 7)]).await;
        // 7 s falls in [0 s, 10 s) and [5 s, 15 s).
        assert_eq!(
            out,
            [format!("{T0} 1"), "2026-01-01T00:00:05Z 1".to_owned()]
        );
    }

    #[tokio::test]
    async fn sessions_merge_when_they_overlap() {
        let sql = "SELECT session_window.start AS s, session_window.end AS e, user, count(*) AS n \
                   FROM source GROUP BY session_window(ts, '5 seconds'), user";
        let sql = sql.replace("session_window.", "window.");
        let mut p = processor(&sql, Some(OutputMode::Update)).await;
        let (out, _) = run(&mut p, 0, &[("a", 1, 1), ("a", 1, 4), ("a", 1, 20)]).await;
        assert_eq!(
            out,
            [
                "2026-01-01T00:00:01Z 2026-01-01T00:00:09Z a 2",
                "2026-01-01T00:00:20Z 2026-01-01T00:00:25Z a 1"
            ]
        );
    }
    /// A processor running `sql` with a watermark 5 s behind `ts`.
    async fn deduplicating(sql: &str) -> SqlProcessor {
        let options = QueryOptions {
            watermark_column: Some("ts".to_owned()),
            watermark_delay_ms: Some(5_000),
            ..QueryOptions::default()
        };
        planned(sql, &options).await
    }

    const DEDUPE: &str = "SELECT DISTINCT ON (user) user, amount * 10 AS tenfold FROM source \
                          WHERE amount > 0";

    /// The same deduplication as Flink's users write it.
    const FIRST_ROW: &str = "SELECT user, amount * 10 AS tenfold FROM (SELECT *, ROW_NUMBER() \
                             OVER (PARTITION BY user ORDER BY ts) AS rn FROM source \
                             WHERE amount > 0) t WHERE rn = 1";

    #[tokio::test]
    async fn distinct_on_keeps_a_keys_first_row_until_the_watermark_passes_it() {
        // Each batch's orders (user, amount, second) and the rows it emits.
        type Batch<'a> = (Vec<(&'a str, i64, i64)>, Vec<&'a str>);
        let batches: Vec<Batch> = vec![
            // The first of each key passes; a filtered row does not count.
            (
                vec![("ann", 5, 1), ("bob", 0, 2), ("bob", 1, 2), ("ann", 7, 3)],
                vec!["ann 50", "bob 10"],
            ),
            // ann's first row (1 s) is kept until the watermark passes 6 s.
            (vec![("ann", 2, 20), ("carl", 3, 20)], vec!["carl 30"]),
            // The watermark is 15 s: ann and bob are forgotten, and a row older
            // than the watermark is dropped as late.
            (
                vec![("ann", 4, 21), ("bob", 6, 22), ("dan", 1, 2)],
                vec!["ann 40", "bob 60"],
            ),
            (vec![("ann", 9, 23), ("carl", 9, 24)], vec![]),
        ];
        for sql in [DEDUPE, FIRST_ROW] {
            let mut p = deduplicating(sql).await;
            for (id, (rows, expected)) in batches.iter().enumerate() {
                let (out, _) = run(&mut p, id as u64, rows).await;
                assert_eq!(out, *expected, "batch {id} of {sql}");
            }
        }
        let mut straight = deduplicating(DEDUPE).await;
        for (id, (rows, _)) in batches.iter().enumerate() {
            run(&mut straight, id as u64, rows).await;
        }
        let stats = &straight.state_progress()[0];
        assert_eq!(stats.name, "dedupeWithinWatermark");
        // ann, bob (from 21-22 s), carl (20 s): held under a watermark of 19 s.
        assert_eq!(stats.rows_total, 3, "{stats:?}");
        assert_eq!(stats.custom_metrics, [("numDroppedDuplicateRows", 2)]);
        // Crash after every batch: a fresh processor restores from the files
        // and decides the same rows.
        let mut files: Vec<StateFile> = Vec::new();
        let mut watermark = 0;
        let mut late = 0;
        for (id, (rows, expected)) in batches.iter().enumerate() {
            let mut p = deduplicating(DEDUPE).await;
            p.restore_watermark(watermark);
            p.restore_state(&files).unwrap();
            let (out, new) = run(&mut p, id as u64, rows).await;
            assert_eq!(out, *expected, "batch {id} after a restart");
            files.extend(new);
            watermark = p.watermark_ms();
            late += p.state_progress()[0].rows_dropped_by_watermark;
        }
        assert_eq!(late, 1);
    }

    #[tokio::test]
    async fn the_first_row_idiom_keeps_its_rank_column() {
        let sql = "SELECT * FROM (SELECT user, amount, ROW_NUMBER() OVER (PARTITION BY user \
                   ORDER BY ts ASC) AS rn FROM source) t WHERE 1 = rn";
        let mut p = deduplicating(sql).await;
        let (out, _) = run(&mut p, 0, &[("ann", 5, 1), ("ann", 6, 2), ("bob", 1, 2)]).await;
        assert_eq!(out, ["ann 5 1", "bob 1 1"]);
        let names: Vec<String> = p
            .output_schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(names, ["user", "amount", "rn"]);
    }

    #[tokio::test]
    async fn distinct_on_is_refused_where_a_stream_cannot_keep_it() {
        let decoder = Decoder::new(
            Format::Json(parse_ddl("user STRING, amount BIGINT, ts TIMESTAMP").unwrap()),
            false,
        );
        let without_watermark =
            StreamQuery::plan_with(DEDUPE, "source", decoder.schema(), &QueryOptions::default())
                .await
                .unwrap_err()
                .to_string();
        assert!(
            without_watermark.contains("DISTINCT ON without a watermark")
                && without_watermark.contains("source.watermark_delay"),
            "{without_watermark}"
        );
        let options = QueryOptions {
            watermark_column: Some("ts".to_owned()),
            watermark_delay_ms: Some(5_000),
            ..QueryOptions::default()
        };
        for (sql, refused) in [
            (
                "SELECT DISTINCT ON (user) user, amount FROM source ORDER BY user, ts",
                "ORDER BY with DISTINCT ON",
            ),
            (
                "SELECT user FROM (SELECT DISTINCT ON (user) user, ts FROM source) \
                 WHERE user <> 'x'",
                "DISTINCT ON inside another query",
            ),
            (
                "SELECT DISTINCT ON (user) user, n, ts FROM \
                 (SELECT user, count(*) AS n, max(ts) AS ts FROM source GROUP BY user)",
                "DISTINCT ON over an aggregation",
            ),
            (
                "SELECT user FROM (SELECT user, ROW_NUMBER() OVER (PARTITION BY user \
                 ORDER BY ts DESC) AS rn FROM source) t WHERE rn = 1",
                "ROW_NUMBER() = 1 not ordered by the event time ascending",
            ),
            (
                "SELECT user FROM (SELECT user, ROW_NUMBER() OVER (PARTITION BY user \
                 ORDER BY ts) AS rn FROM source) t WHERE rn = 2",
                "a window function (OVER)",
            ),
        ] {
            let err = StreamQuery::plan_with(sql, "source", decoder.schema(), &options)
                .await
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(err.contains(refused), "{sql}: {err}");
        }
    }
}

#[cfg(test)]
mod aggregate_tests {
    use std::sync::Arc;

    use arrow::array::RecordBatch;
    use datafusion::prelude::SessionContext;
    use sluice_core::{
        BatchId, BatchMetadata, Offset, Processed, Processor, Record, RecordChunk, StateFile,
        TimestampType,
    };

    use super::*;
    use crate::{Format, OutputMode, QueryOptions, parse_ddl};

    const DDL: &str = "user STRING, amount BIGINT, price DOUBLE, ok BOOLEAN, ts TIMESTAMP";

    fn value(n: i64) -> String {
        format!(
            r#"{{"user":"u{}","amount":{},"price":{}.25,"ok":{},"ts":"2026-01-01T00:00:{:02}Z"}}"#,
            n % 3,
            n * 7 % 11,
            n % 5,
            n % 4 != 0,
            n % 60
        )
    }

    fn chunk(from: i64, until: i64) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for n in from..until {
            chunk.push_record(&Record {
                topic: Arc::from("t"),
                partition: 0,
                offset: Offset::new(n).unwrap(),
                timestamp_ms: Some(0),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: Some(value(n).into_bytes()),
                headers: Vec::new(),
            });
        }
        chunk
    }

    async fn processor(sql: &str, options: &QueryOptions) -> SqlProcessor {
        let decoder = Decoder::new(Format::Json(parse_ddl(DDL).unwrap()), false);
        let query = StreamQuery::plan_with(sql, "source", decoder.schema(), options)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        SqlProcessor::new(decoder, Some(query))
    }

    use super::stateful_tests::text as rows;

    /// `sql` over orders 0..60 in three batches, a fresh processor restored from
    /// the state files before each (the second's deltas, then the snapshot after
    /// it), in complete mode: the last batch's rows.
    async fn in_batches(sql: &str) -> Vec<String> {
        let options = QueryOptions {
            output_mode: Some(OutputMode::Complete),
            watermark_column: None,
            ..QueryOptions::default()
        };
        let mut files: Vec<StateFile> = Vec::new();
        let mut last = Vec::new();
        for (id, (from, until)) in [(0, 25), (25, 41), (41, 60)].into_iter().enumerate() {
            let mut p = processor(sql, &options).await;
            p.restore_state(&files).unwrap();
            let metadata = BatchMetadata::default();
            p.begin_batch(BatchId(id as u64), &metadata).await.unwrap();
            let mut out = Processed::<RecordBatch>::default();
            p.process(chunk(from, until), &mut out).await.unwrap();
            p.finish_batch(BatchId(id as u64), &mut out).await.unwrap();
            files.extend(p.state_files(BatchId(id as u64)).unwrap());
            p.commit_state();
            if id == 1 {
                // The last batch starts from a snapshot in place of the deltas.
                files = p.state_snapshots(BatchId(1)).unwrap();
            }
            last = rows(&out.rows);
        }
        last
    }

    /// `sql` run by DataFusion once over all 60 orders.
    async fn at_once(sql: &str) -> Vec<String> {
        let decoder = Decoder::new(Format::Json(parse_ddl(DDL).unwrap()), false);
        let all = decoder.decode(&chunk(0, 60)).unwrap().batch;
        let ctx = SessionContext::new();
        ctx.register_batch("source", all).unwrap();
        rows(&ctx.sql(sql).await.unwrap().collect().await.unwrap())
    }

    #[tokio::test]
    async fn every_mergeable_aggregate_gives_across_batches_what_it_gives_at_once() {
        for aggregate in [
            "count(*)",
            "count(amount)",
            "sum(amount)",
            "min(price)",
            "max(amount)",
            "avg(price)",
            "stddev(price)",
            "var_samp(amount)",
            "bool_and(ok)",
            "bool_or(ok)",
            "bit_or(amount)",
            "median(amount)",
            "count(DISTINCT amount)",
            "approx_distinct(amount)",
            "sum(amount) FILTER (WHERE ok)",
        ] {
            let sql = format!("SELECT user, {aggregate} AS v FROM source GROUP BY user");
            let got = in_batches(&sql).await;
            let want = at_once(&sql).await;
            assert_eq!(got.len(), 3, "{aggregate}: {got:?}");
            if aggregate.starts_with("stddev")
                || aggregate.starts_with("var")
                || aggregate.starts_with("avg")
            {
                // Sums of floats in another order: equal to many digits, not every bit.
                for (g, w) in got.iter().zip(&want) {
                    let (g, w): (f64, f64) = (
                        g.rsplit(' ').next().unwrap().parse().unwrap(),
                        w.rsplit(' ').next().unwrap().parse().unwrap(),
                    );
                    assert!(
                        (g - w).abs() < 1e-9 * w.abs().max(1.0),
                        "{aggregate}: {g} {w}"
                    );
                }
            } else {
                assert_eq!(got, want, "{aggregate}");
            }
        }
    }

    #[tokio::test]
    async fn distinct_on_keys_and_event_time_forgets_rows_the_watermark_passed() {
        let options = QueryOptions {
            output_mode: Some(OutputMode::Update),
            watermark_column: Some("ts".to_owned()),
            ..QueryOptions::default()
        };
        let mut p = processor("SELECT DISTINCT user, ts FROM source", &options)
            .await
            .with_watermark("ts", 0)
            .unwrap();
        let mut emitted = Vec::new();
        let mut held = Vec::new();
        for (id, (from, until)) in [(0, 10), (5, 20), (15, 30)].into_iter().enumerate() {
            let metadata = BatchMetadata {
                watermark_ms: p.watermark_ms(),
                ..BatchMetadata::default()
            };
            p.begin_batch(BatchId(id as u64), &metadata).await.unwrap();
            let mut out = Processed::<RecordBatch>::default();
            p.process(chunk(from, until), &mut out).await.unwrap();
            p.finish_batch(BatchId(id as u64), &mut out).await.unwrap();
            p.commit_state();
            emitted.extend(rows(&out.rows));
            held.push(p.state_progress()[0].rows_total);
        }
        // Each (user, ts) once, though orders 5..10 and 15..20 came twice: the
        // second time, those older than the watermark (9 s, then 19 s) were late,
        // and the others were still held.
        let distinct: std::collections::BTreeSet<&String> = emitted.iter().collect();
        assert_eq!(distinct.len(), emitted.len(), "{emitted:?}");
        assert_eq!(emitted.len(), 30);
        assert_eq!(p.state_progress()[0].name, "dedupe");
        // Only rows at or after the batch's watermark stay: 0..9 s, 9..19 s, 19..29 s.
        assert_eq!(held, [10, 11, 11]);
    }
}
