//! What a batch's records become before they reach the sink.
//!
//! A [`Processor`] sits between the reader and the sink. It takes the batch's
//! records chunk by chunk and gives the sink its output: the records themselves
//! ([`PassThrough`]), or rows a query made of them. It is told where each batch
//! begins and ends, so that an operator with state can restore the state of the
//! batch before (a replay starts from version N-1), emit at the end what the
//! batch's watermark closed, and make its state durable before the batch's
//! commit ([`Processor::commit_state`]).

use std::future::Future;

use crate::{BatchId, BatchMetadata, RecordChunk, StateFile, StateOperatorStats};

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
/// `process` for every chunk, `finish_batch`, and `commit_state` before it
/// writes the batch's commit. A batch begun again (a read retried, a replay after
/// a crash) gets the same records again, and must give the same output.
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
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = (batch, metadata);
        async { Ok(()) }
    }

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
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = (batch, out);
        async { Ok(()) }
    }

    /// How many stateful operators the query has, numbered from 0; none for a
    /// stateless one.
    fn state_operators(&self) -> u32 {
        0
    }

    /// How many partitions each stateful operator splits its keys into: fixed
    /// for a checkpoint, as the stored state is split so.
    fn state_partitions(&self) -> u32 {
        1
    }

    /// The state deltas of the batch just finished, one per operator and
    /// partition, for the executor to make durable before the batch's commit.
    fn state_files(&mut self, batch: BatchId) -> Result<Vec<StateFile>, Self::Error> {
        let _ = batch;
        Ok(Vec::new())
    }

    /// Snapshots of each operator's whole state after `batch`, which is
    /// committed: asked for when [`crate::snapshot_due`], and written after the
    /// commit, off the way to it.
    fn state_snapshots(&mut self, batch: BatchId) -> Result<Vec<StateFile>, Self::Error> {
        let _ = batch;
        Ok(Vec::new())
    }

    /// Sets the state a restart continues from: version `version`, rebuilt from
    /// `files` (for each operator and partition its snapshot and the deltas after
    /// it, all ordered by version); `None` for a query that starts with empty
    /// state.
    fn restore_state(
        &mut self,
        version: Option<BatchId>,
        files: Vec<StateFile>,
    ) -> Result<(), Self::Error> {
        let _ = (version, files);
        Ok(())
    }

    /// What each stateful operator held after the batch just finished, for its
    /// progress report.
    fn state_progress(&self) -> Vec<StateOperatorStats> {
        Vec::new()
    }

    /// The batch's state files are durable: the next batch starts from its
    /// state. Called before its commit is written.
    fn commit_state(
        &mut self,
        batch: BatchId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = batch;
        async { Ok(()) }
    }

    /// Whether a batch without new data should run now, under the watermark
    /// [`Processor::watermark_ms`] gives, because that watermark closes state
    /// the last batch could not emit: Spark's no-data batch.
    fn wants_batch_without_data(&self, last_watermark_ms: i64) -> bool {
        let _ = last_watermark_ms;
        false
    }

    /// The event-time watermark for the next batch's plan, in epoch
    /// milliseconds.
    fn watermark_ms(&self) -> i64 {
        0
    }

    /// Takes the watermark a restart continues from: the last commit's
    /// `next_watermark_ms`, when no batch is to be replayed (a replay's plan
    /// carries its own, given to `begin_batch`).
    fn restore_watermark(&mut self, watermark_ms: i64) {
        let _ = watermark_ms;
    }

    /// The event time of the batch just finished, for its progress report;
    /// `None` when the query has no event time.
    fn event_time(&self) -> Option<EventTimeStats> {
        None
    }
}

/// The event time a batch's rows carried, and the watermark it ran under, in
/// epoch milliseconds: Spark's `eventTime` progress entry.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
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
}

/// No processing: the sink receives the records as read.
#[derive(Clone, Copy, Debug, Default)]
pub struct PassThrough;

impl Processor for PassThrough {
    type Output = RecordChunk;
    type Error = std::convert::Infallible;

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
