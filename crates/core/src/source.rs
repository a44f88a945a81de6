//! The trait a source of records implements, and a batch read whole for
//! tests and small tools.

use std::collections::BTreeMap;
use std::future::Future;

use crate::{
    DataLoss, OffsetBounds, OffsetRange, PartitionOffsets, Record, RecordChunk, StartingOffsets,
    TopicPartition,
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

/// Bytes of records a source fetched against the bytes of records it read
/// (keys and values both times), so that records fetched again, because what was
/// fetched could not be kept until a batch wanted it, show as a ratio over 1.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadAmplification {
    /// Fetched since the source started.
    pub fetched_bytes: u64,
    /// Read since the source started.
    pub read_bytes: u64,
    /// Fetched over the source's latest measurement interval.
    pub recent_fetched_bytes: u64,
    /// Read over the same interval.
    pub recent_read_bytes: u64,
    /// The partitions that fetched the most per byte read since the source
    /// started, with that ratio, worst first; at most a few.
    pub worst_partitions: Vec<(TopicPartition, f64)>,
}

impl ReadAmplification {
    /// Fetched over read since the source started; 1 before anything was read.
    pub fn total(&self) -> f64 {
        ratio(self.fetched_bytes, self.read_bytes)
    }

    /// Fetched over read over the latest interval; 1 when nothing was read.
    pub fn recent(&self) -> f64 {
        ratio(self.recent_fetched_bytes, self.recent_read_bytes)
    }
}

fn ratio(fetched: u64, read: u64) -> f64 {
    if read == 0 {
        1.0
    } else {
        fetched as f64 / read as f64
    }
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

    /// How many sources this is, as a plan counts them (a line each in Spark's
    /// offsets file): one, unless it reads several streams, each a table of
    /// the query. Their chunks say which they are ([`RecordChunk::source`]).
    fn source_count(&self) -> usize {
        1
    }

    /// Which source reads `topic`, by its place in the order the query
    /// declares them; `None` when none would. The default is one source that
    /// reads whatever it lists.
    fn source_of(&self, topic: &str) -> Option<usize> {
        let _ = topic;
        Some(0)
    }

    /// Whether `error` may go away by itself (a broker restarting, a request
    /// timing out), so that the same call is worth trying again. Data loss and
    /// configuration errors are not. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// How much the source fetched beside what it read, when it knows: a log
    /// that hands out whole blocks of records may fetch a block again for each
    /// part of it a batch takes. The default knows nothing.
    fn read_amplification(&self) -> Option<ReadAmplification> {
        None
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
