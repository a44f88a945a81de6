//! Records, and the trait a source of records implements.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use crate::{
    DataLoss, Offset, OffsetRange, PartitionOffsets, StartingOffsets, TopicPartition, Watermarks,
};

/// How a record's timestamp was set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestampType {
    /// The record has no timestamp.
    NotAvailable,
    /// Set by the producer.
    CreateTime,
    /// Set by the broker when it appended the record.
    LogAppendTime,
}

/// One record header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The header's name.
    pub key: String,
    /// The header's value; `None` for a null value.
    pub value: Option<Vec<u8>>,
}

/// One record as read from a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The topic, shared by the records of a partition.
    pub topic: Arc<str>,
    /// The partition number.
    pub partition: i32,
    /// The record's offset.
    pub offset: Offset,
    /// Epoch milliseconds, when the record has a timestamp.
    pub timestamp_ms: Option<i64>,
    /// How the timestamp was set.
    pub timestamp_type: TimestampType,
    /// The key; `None` for a null key.
    pub key: Option<Vec<u8>>,
    /// The value; `None` for a null value (a tombstone).
    pub value: Option<Vec<u8>>,
    /// The headers, when the source is asked to include them; empty otherwise.
    pub headers: Vec<Header>,
}

/// The records of one planned range, in offset order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionRecords {
    /// The range as planned. Records may not fill it: transaction markers and
    /// aborted records take offsets too, and tolerated data loss skips offsets.
    pub range: OffsetRange,
    /// The records, in offset order, all within the range.
    pub records: Vec<Record>,
}

/// What reading a batch's ranges produced.
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

/// A partitioned log that batches are planned over and read from: Kafka.
pub trait Source: Send {
    /// What can go wrong, naming the partitions concerned.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Every partition the query reads now, with its earliest and latest offsets.
    /// Called before every batch, so that new partitions are picked up.
    fn partitions(
        &mut self,
    ) -> impl Future<Output = Result<BTreeMap<TopicPartition, Watermarks>, Self::Error>> + Send;

    /// Where a fresh query starts on each of `partitions`.
    fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, Watermarks>,
    ) -> impl Future<Output = Result<PartitionOffsets, Self::Error>> + Send;

    /// Reads exactly the records of `ranges`.
    fn read(
        &mut self,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<ReadBatch, Self::Error>> + Send;

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

/// Where a batch's records go: a file per batch, a table, a topic, or a user's
/// own processing.
///
/// Contract: the executor calls `write_batch` once per batch, after the batch's
/// plan is durable and before its commit. After a crash, a batch that was planned
/// but not committed is written again with the **same batch id, the same ranges
/// and the same records**. A sink that replaces its output per batch id (a file
/// named by the id, upserts keyed by topic, partition and offset) is therefore
/// exactly once; one that appends is at least once.
pub trait Sink: Send {
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Delivers one batch. Returns once the records are durable in the sink.
    fn write_batch(
        &mut self,
        batch: crate::BatchId,
        records: &ReadBatch,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}
