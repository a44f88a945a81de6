//! What a batch's records become before they reach the sink.
//!
//! A [`Processor`] sits between the reader and the sink. It takes the batch's
//! records chunk by chunk and gives the sink its output: the records themselves
//! ([`PassThrough`]), or rows a query made of them. It is told where each batch
//! begins and ends, so that it can emit at the end what the batch's watermark
//! closed. What it keeps between batches it shows the executor as capabilities:
//! its [`StatefulOperator`]s, whose state the executor restores and makes durable,
//! and its [`EventTime`], whose watermark goes into each plan.

use std::collections::BTreeMap;
use std::future::Future;

use crate::{BatchId, BatchMetadata, RecordChunk, StateFile, StateFileKind, StatefulOperator};
/// The header a record that could not be processed carries, naming why, when it
/// goes to the dead letters.
pub const ERROR_HEADER: &str = "sluice.error";

/// What processing produced: output for the sink, and the records that could
/// not be processed.
#[derive(Debug)]
pub struct Processed<O> {
    /// Output for the sink, in order.
    pub rows: Vec<O>,
    /// How many rows `rows` holds in all.
    pub row_count: u64,
    /// The records that could not be processed (a value that does not decode),
    /// each with an [`ERROR_HEADER`] header naming why.
    pub bad: RecordChunk,
}

impl<O> Default for Processed<O> {
    fn default() -> Self {
        Processed {
            rows: Vec::new(),
            row_count: 0,
            bad: RecordChunk::default(),
        }
    }
}

impl<O> Processed<O> {
    /// Empties it for the next chunk.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.row_count = 0;
        self.bad.clear();
    }
}

/// Turns a batch's records into its sink's input.
///
/// Contract: the executor calls `begin_batch` once the batch's plan is durable,
/// `process` for every chunk and `finish_batch`; then it makes the state of its
/// [`stateful_operators`](Processor::stateful_operators) durable and commits it
/// before it writes the batch's commit. A batch begun again (a read retried, a
/// replay after a crash) gets the same records again, and must give the same
/// output.
///
/// No method has a default: a processor that wraps another forwards each one or
/// says, in its own code, that it has no state or no event time.
pub trait Processor: Send {
    /// What the sink receives.
    type Output: Send + Sync;
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Starts `batch`, or starts it over. `metadata` is the plan's, with the
    /// event-time watermark in force for the batch.
    fn begin_batch(
        &mut self,
        batch: BatchId,
        metadata: &BatchMetadata,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Processes the batch's next records into `out`.
    fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<Self::Output>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Ends the batch, with what it still has to emit.
    fn finish_batch(
        &mut self,
        batch: BatchId,
        out: &mut Processed<Self::Output>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Its operators that keep state between batches, always in the same
    /// order: their place is their number in the checkpoint. Empty for a
    /// stateless processor.
    fn stateful_operators(&mut self) -> Vec<&mut dyn StatefulOperator<Self::Error>>;

    /// Its event-time clock; `None` when the query has no event time.
    fn event_time(&mut self) -> Option<&mut dyn EventTime>;

    /// The lookup tables it joins with, and the version of each the last
    /// batch joined with. Empty when it has none.
    fn lookup_tables(&self) -> Vec<LookupStats>;

    /// Whether `error` may go away by itself (a lookup table's store timing
    /// out), so that the executor's retry policy begins the batch again.
    fn is_transient(error: &Self::Error) -> bool;
}

/// A lookup table as the progress report shows it: the version a batch joined
/// with, its size, and how its reloads went.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LookupStats {
    /// The table's name in the query.
    pub name: String,
    /// Which version is in force, as its loader describes it (the files'
    /// modification times, a row count).
    pub version: String,
    /// Its rows.
    pub rows: u64,
    /// What its rows take in memory.
    pub memory_bytes: u64,
    /// How many times a changed table was read again and put in force.
    pub reloads: u64,
    /// How many reloads failed, leaving the last good version in force.
    pub failed_reloads: u64,
    /// Why the last failed reload failed.
    pub last_error: Option<String>,
}

/// The event time of a query with a watermark, as Spark's
/// `withWatermark(column, delay)` keeps it: the watermark changes only between
/// batches, so that a batch replayed under its recorded watermark gives the same
/// output.
pub trait EventTime: Send {
    /// The watermark for the next batch's plan, in epoch milliseconds.
    fn next_watermark_ms(&self) -> i64;

    /// Takes the watermark a restart continues from: the last commit's
    /// `next_watermark_ms`, when no batch is to be replayed (a replay's plan
    /// carries its own, given to [`Processor::begin_batch`]).
    fn restore_watermark(&mut self, watermark_ms: i64);

    /// The event time of the batch just finished, for its progress report.
    fn stats(&self) -> EventTimeStats;

    /// Each source's own watermark as of the batches finished, in a query of
    /// several sources, which the next plan records
    /// ([`SOURCE_WATERMARKS_CONF`]); empty for a query of one.
    fn source_watermarks_ms(&self) -> Vec<Option<i64>>;

    /// Takes back the sources' own watermarks recorded with the plan a
    /// restart continues from, so that a source behind the others holds the
    /// query's watermark back after a restart as it did before.
    fn restore_source_watermarks(&mut self, watermarks_ms: &[Option<i64>]);
}

/// The `conf` key under which a plan records its sources' own watermarks as
/// the batches before it left them ([`EventTime::source_watermarks_ms`]):
/// Spark keeps only the query's, and ignores `conf` keys it does not know.
pub const SOURCE_WATERMARKS_CONF: &str = "sluice.sourceWatermarksMs";

/// The `conf` entries a plan records for the processor's event time: its
/// sources' own watermarks, in a query of several.
pub fn event_time_conf<P: Processor + ?Sized>(processor: &mut P) -> BTreeMap<String, String> {
    let mut conf = BTreeMap::new();
    if let Some(clock) = processor.event_time() {
        let watermarks = clock.source_watermarks_ms();
        if !watermarks.is_empty() {
            let text: Vec<String> = watermarks
                .iter()
                .map(|w| w.map_or_else(|| "-".to_owned(), |ms| ms.to_string()))
                .collect();
            conf.insert(SOURCE_WATERMARKS_CONF.to_owned(), text.join(","));
        }
    }
    conf
}

/// The sources' own watermarks of a plan's `conf` ([`event_time_conf`]):
/// `None` when it records none, an error naming what is wrong otherwise.
pub fn source_watermarks_of(
    conf: &BTreeMap<String, String>,
) -> Option<Result<Vec<Option<i64>>, String>> {
    let text = conf.get(SOURCE_WATERMARKS_CONF)?;
    Some(
        text.split(',')
            .map(|part| match part.trim() {
                "-" => Ok(None),
                ms => ms.parse().map(Some).map_err(|_| {
                    format!("{SOURCE_WATERMARKS_CONF} = {text:?}: {ms:?} is not milliseconds or -")
                }),
            })
            .collect(),
    )
}

/// The watermark for the next batch's plan: the processor's event time's, or 0
/// for a query without event time.
pub fn next_watermark_ms<P: Processor + ?Sized>(processor: &mut P) -> i64 {
    processor
        .event_time()
        .map_or(0, |clock| clock.next_watermark_ms())
}

/// Whether a batch without new data should run now, under the watermark
/// [`next_watermark_ms`] gives, because that watermark moved past
/// `last_watermark_ms` and an operator holds state it would emit or drop:
/// Spark's no-data batch.
pub fn wants_batch_without_data<P: Processor + ?Sized>(
    processor: &mut P,
    last_watermark_ms: i64,
) -> bool {
    let moved = processor
        .event_time()
        .is_some_and(|clock| clock.next_watermark_ms() > last_watermark_ms);
    moved
        && processor
            .stateful_operators()
            .iter()
            .any(|operator| operator.waits_for_watermark())
}

/// Every stateful operator's files of `kind` for `version`, the operators
/// numbered in the order [`Processor::stateful_operators`] gives them.
pub fn encode_state<P: Processor + ?Sized>(
    processor: &mut P,
    version: BatchId,
    kind: StateFileKind,
) -> Result<Vec<StateFile>, P::Error> {
    let mut files = Vec::new();
    for (operator, state) in (0..).zip(processor.stateful_operators()) {
        let parts = match kind {
            StateFileKind::Delta => state.delta()?,
            StateFileKind::Snapshot => state.snapshot()?,
        };
        files.extend(StateFile::of_operator(operator, version, kind, parts));
    }
    Ok(files)
}

/// The event time a batch's rows carried, and the watermark it ran under, in
/// epoch milliseconds: Spark's `eventTime` progress entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventTimeStats {
    /// The watermark in force for the batch.
    pub watermark_ms: i64,
    /// The earliest, latest and mean event time of the batch's rows; `None`
    /// when it had no rows with an event time.
    pub min_ms: Option<i64>,
    /// See `min_ms`.
    pub max_ms: Option<i64>,
    /// See `min_ms`.
    pub avg_ms: Option<i64>,
    /// Each source's own watermark, by index, in a query reading several:
    /// `None` for one that has not seen an event time yet, which the query's
    /// watermark does not wait for. Empty for a query of one source.
    pub source_watermarks_ms: Vec<Option<i64>>,
}

/// No processing: the sink receives the records as read.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassThrough;

impl Processor for PassThrough {
    type Output = RecordChunk;
    type Error = std::convert::Infallible;

    async fn begin_batch(&mut self, _: BatchId, _: &BatchMetadata) -> Result<(), Self::Error> {
        Ok(())
    }

    async fn finish_batch(
        &mut self,
        _: BatchId,
        _: &mut Processed<RecordChunk>,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    fn stateful_operators(&mut self) -> Vec<&mut dyn StatefulOperator<Self::Error>> {
        Vec::new()
    }

    fn event_time(&mut self) -> Option<&mut dyn EventTime> {
        None
    }

    fn lookup_tables(&self) -> Vec<LookupStats> {
        Vec::new()
    }

    fn is_transient(error: &Self::Error) -> bool {
        match *error {}
    }

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<RecordChunk>,
    ) -> Result<(), Self::Error> {
        out.row_count += records.len() as u64;
        out.rows.push(records);
        Ok(())
    }
}

/// What happens to a record that cannot be processed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BadRecordPolicy {
    /// The query stops, naming the record and why.
    #[default]
    Fail,
    /// It is left out and counted.
    Skip,
    /// It goes, as read and with the reason in a header, to the dead letters,
    /// and is counted.
    DeadLetter,
}
