//! The core of Sluice: its pure model (topic-partitions, offsets, offset ranges,
//! batch plans, what a batch reads, starting-offset and reset policies,
//! data-loss classification, state files and Spark-compatible offset JSON) and
//! the seams every part implements: the source, the stores, the processor and
//! its stateful operators, and the sink.
//!
//! This crate does no I/O and depends on no async runtime, so that every decision
//! about what a batch reads and how a restart recovers is a plain function that can
//! be tested exhaustively.
//!
//! An [`Offset`] always means "the next offset to read", as in Kafka and Spark.
//!
//! ```
//! use sluice_core::{Offset, PartitionOffsets, TopicPartition, offsets_to_json};
//!
//! let mut offsets = PartitionOffsets::new();
//! offsets.insert(TopicPartition::new("events", 1), Offset::new(5).unwrap());
//! offsets.insert(TopicPartition::new("events", 0), Offset::new(23).unwrap());
//! assert_eq!(offsets_to_json(&offsets), r#"{"events":{"0":23,"1":5}}"#);
//! ```

mod batch;
mod chunk;
mod data_loss;
mod group;
mod json;
mod memory;
mod partition;
mod planning;
mod processor;
mod rate_limit;
mod record;
mod recovery;
mod sink;
mod source;
mod starting;
mod state;
mod store;

pub use batch::{BatchCommit, BatchId, BatchMetadata, BatchPlan, PlanError};
pub use chunk::{Iter as RecordIter, RecordChunk, RecordParts, RecordRef};
pub use data_loss::{
    DataLoss, DataLossDecision, OffsetBounds, apply_data_loss_policy, classify_batch,
    classify_data_loss, data_loss_report,
};
pub use group::{
    Directory, DirectoryEntry, Generation, GroupError, Membership, MembershipChange, Origin,
    PartitionDirectory, PartitionStart, Revocation, settled_ends,
};
pub use json::{
    OffsetJsonError, offsets_from_json, offsets_to_json, values_from_json, values_to_json,
};
pub use memory::{
    ASSUMED_BYTES_PER_RECORD, BATCH_SHARE, BatchSizing, MIN_RECORDS, MemoryBudget, PLANNED_SHARE,
};
pub use partition::{Offset, OffsetRange, PartitionOffsets, TopicPartition};
pub use planning::Reach;
pub use processor::{
    BadRecordPolicy, ERROR_HEADER, EventTime, EventTimeStats, LookupStats, PassThrough, Processed,
    Processor, SOURCE_WATERMARKS_CONF, encode_state, event_time_conf, next_watermark_ms,
    source_watermarks_of, wants_batch_without_data,
};
pub use rate_limit::{MinOffsetsPerTrigger, rate_limit, should_run_batch};
pub use record::{Header, Record, TimestampType};
pub use recovery::{
    DEFAULT_MIN_BATCHES_TO_RETAIN, Inconsistency, Log, Recovery, decide_recovery, purge_due,
    purge_interval, purge_threshold,
};
pub use sink::{Sink, Writes};
pub use source::{BatchReader, PartitionRecords, ReadAmplification, ReadBatch, Source, read_all};
pub use starting::{
    MissingCommitted, SpecificOffset, StartingOffsets, StartingOffsetsError, StartingOptions,
    TimestampFallback, parse_starting_offsets,
};
pub use state::{
    SNAPSHOT_EVERY, StateFile, StateFileId, StateFileKind, StateGap, StateOperatorStats,
    StatefulOperator, snapshot_due, state_files_for, state_files_to_load, state_files_to_purge,
    state_files_to_purge_in,
};
pub use store::{OffsetStore, StateStore, StoredBatches};
