//! The traits a source of records and a sink implement, and a batch read
//! whole for tests and small tools.

use std::collections::BTreeMap;
use std::future::Future;

use crate::{
    BatchId, DataLoss, OffsetBounds, OffsetRange, PartitionOffsets, Record, RecordChunk,
    StartingOffsets, TopicPartition,
};

/// The records of one planned range, in offset order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionRecords {
    /// The range as planned. Records may not fill it: transaction markers and
    /// aborted records take offsets too, and tolerated data loss skips offsets.
    pub range: OffsetRange,
    /// The records, in offset order, all within the range.
    pub records: Vec<Record>,
}

/// A whole batch held in memory, as [`read_all`] collects it: for tests and
/// small tools. The executor streams chunks instead.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// Per planned range, in the order of the plan.
    pub partitions: Vec<PartitionRecords>,
    /// Data loss met while reading and tolerated (`fail_on_data_loss = false`).
    pub data_loss: Vec<DataLoss>,
}

impl ReadBatch {
    /// How many records the batch holds.
    pub fn record_count(&self) -> usize {
        self.partitions.iter().map(|p| p.records.len()).sum()
    }
}

/// Reads every chunk of `reader` into memory, grouped by the planned `ranges`.
/// A record outside every range is an error of the source, reported as
/// `Err(record)` so that the caller can name it.
pub async fn read_all<R: BatchReader>(
    ranges: &[OffsetRange],
    mut reader: R,
) -> Result<Result<ReadBatch, Box<Record>>, R::Error> {
    let mut batch = ReadBatch {
        partitions: ranges
            .iter()
            .map(|range| PartitionRecords {
                range: range.clone(),
                records: Vec::new(),
            })
            .collect(),
        data_loss: Vec::new(),
    };
    while let Some(chunk) = reader.next_chunk().await? {
        for record in chunk.iter() {
            let owned = record.to_record();
            let slot = batch.partitions.iter_mut().find(|p| {
                p.range.topic_partition.partition == owned.partition
                    && *p.range.topic_partition.topic == *owned.topic
                    && p.range.from <= owned.offset
                    && owned.offset < p.range.until
            });
            match slot {
                Some(p) => p.records.push(owned),
                None => return Ok(Err(Box::new(owned))),
            }
        }
    }
    batch.data_loss = reader.data_loss().to_vec();
    Ok(Ok(batch))
}

/// A partitioned log that batches are planned over and read from: Kafka.
pub trait Source: Send {
    /// What can go wrong, naming the partitions concerned.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Streams the records of one batch.
    type Reader: BatchReader<Error = Self::Error>;

    /// Every partition the query reads now, with its earliest and latest offsets.
    /// Called before every batch, so that new partitions are picked up.
    fn partitions(
        &mut self,
    ) -> impl Future<Output = Result<BTreeMap<TopicPartition, OffsetBounds>, Self::Error>> + Send;

    /// Where a fresh query starts on each of `partitions`.
    fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    ) -> impl Future<Output = Result<PartitionOffsets, Self::Error>> + Send;

    /// Starts reading exactly the records of `ranges`. Only one reader is live at a
    /// time: dropping a reader before its end abandons the read, and the next call
    /// starts afresh.
    fn read(
        &mut self,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<Self::Reader, Self::Error>> + Send;

    /// Whether `error` may go away by itself (a broker restarting, a request
    /// timing out), so that the same call is worth trying again. Data loss and
    /// configuration errors are not. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Records processed offsets where lag monitors look for them (a consumer
    /// group). Never the source of truth: the offset store is. Callers log a
    /// failure here and go on.
    fn commit_progress(
        &mut self,
        offsets: &PartitionOffsets,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// The records of one batch as they arrive, chunk by chunk, so that a batch never
/// has to fit in memory.
pub trait BatchReader: Send {
    /// What can go wrong, naming the partitions concerned.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The next records, or `None` once every range has been read to its end.
    /// Within a partition, records come in offset order and each exactly once.
    fn next_chunk(
        &mut self,
    ) -> impl Future<Output = Result<Option<RecordChunk>, Self::Error>> + Send;

    /// Data loss met while reading and tolerated (`fail_on_data_loss = false`);
    /// complete once [`BatchReader::next_chunk`] has returned `None`.
    fn data_loss(&self) -> &[DataLoss];
}

/// Where a batch's output goes: a file per batch, a table, a topic, or a user's
/// own processing. `T` is what it receives: the records as read
/// ([`RecordChunk`], the default), or rows a query made of them.
///
/// Contract: for each batch, after its plan is durable, the executor calls
/// `begin_batch`, then `write` for every piece of output, then `finish_batch`,
/// and only then commits the batch. A read that fails part way and is retried
/// begins the same batch again, and everything is written anew. After a crash, a
/// batch that was planned but not committed is written again with the **same
/// batch id, the same ranges and the same output**. A sink that replaces its
/// output per batch id (a file named by the id, upserts keyed by the data) is
/// therefore exactly once; one that appends is at least once. A sink that can
/// tell whether a batch already reached it ([`Sink::delivered`], a two-phase sink
/// such as Kafka transactions) is exactly once without replacing anything.
///
/// Under the continuous trigger a batch (an epoch) begins before its plan
/// exists, with no ranges, since its end is decided when it closes; its
/// records are written as they arrive, and its plan is durable before
/// `finish_batch`. A crash before that replays the records from the last
/// commit in a new attempt of the same batch id: a sink that publishes only
/// at `finish_batch` stays exactly once, one that publishes on `write` is at
/// least once.
pub trait Sink<T: ?Sized + Sync = RecordChunk>: Send {
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Starts `batch`, which reads `ranges`, or starts it over, dropping whatever
    /// of it was written since the last `begin_batch`.
    fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = (batch, ranges);
        async { Ok(()) }
    }

    /// Delivers the next output of the batch begun last.
    fn write(&mut self, output: &T) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Ends the batch begun last. Returns once its output is durable in the sink.
    fn finish_batch(
        &mut self,
        batch: BatchId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = batch;
        async { Ok(()) }
    }

    /// Whether `error` may go away when the batch is begun and written again
    /// (a transaction the sink aborted), so that the executor retries the batch
    /// under its retry policy. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Fences every earlier writer of this query's output, so that a runner that
    /// lost the query cannot write to the sink any more (a Kafka transactional
    /// producer's `init_transactions`). The executor calls it before the first
    /// batch and then confirms with [`OffsetStore::check_claim`] that this runner
    /// still holds the query, so a runner that lost the query in between writes
    /// nothing. The default has nothing to fence.
    ///
    /// [`OffsetStore::check_claim`]: crate::OffsetStore::check_claim
    fn take_over(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Whether `error` says another writer fenced this sink. When the store
    /// confirms that this runner still holds the query, the fence came from a
    /// runner that is about to stop, and the executor takes the sink over again
    /// and retries the batch. The default says no.
    fn is_fenced(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Asked on recovery about a batch that was planned but not committed:
    /// whether its whole output already reached the sink, so that only the
    /// commit is left to write. The default says no, and the batch is replayed.
    fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = (batch, ranges);
        async { Ok(false) }
    }
}
