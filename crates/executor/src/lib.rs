//! The micro-batch engine of Sluice: triggers, planning, the write-ahead of each
//! batch plan, processing, commit and progress reporting.
//!
//! It drives batches through the traits of `sluice-core` ([`Source`],
//! [`OffsetStore`], [`Sink`]) and never names a concrete source, store or sink.
//! Each batch runs in this order:
//!
//! 1. discover partitions and latest offsets;
//! 2. plan ranges, within the rate limits;
//! 3. classify data loss and apply `fail_on_data_loss`;
//! 4. write the plan durably;
//! 5. read the records;
//! 6. hand them to the sink with the batch id;
//! 7. write the commit (and, optionally, progress to the consumer group);
//! 8. purge old entries.
//!
//! On start, a planned but uncommitted batch is replayed first with its stored
//! ranges and batch id, so a [`Sink`] that replaces its output per batch id is
//! exactly once.
//!
//! [`Source`]: sluice_core::Source
//! [`OffsetStore`]: sluice_core::OffsetStore
//! [`Sink`]: sluice_core::Sink

// First, for the driver's macro that the others use.
#[macro_use]
mod retry;

mod error;
mod group;
mod progress;
mod query;
pub mod sinks;
mod trigger;

pub use error::{ExecutorError, Retried};
pub use group::{Generations, GroupErrorOf, GroupQuery, GroupQueryError, GroupSummary};
pub use progress::{
    DurationMs, GroupProgress, LookupTableProgress, MemoryProgress, QueryProgress, SinkProgress,
    SourceProgress, StateOperatorProgress,
};
pub use query::{
    DEFAULT_POLLING_DELAY, Query, QueryError, QueryOptions, QueryStore, RunSummary, SourceOptions,
};
pub use retry::{GaveUp, RetryPolicy};
pub use trigger::Trigger;
