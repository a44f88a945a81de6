//! The state of a stateful query between batches: its groups, each holding
//! DataFusion's partial aggregation states, versioned by batch and written as
//! Arrow IPC files.
//!
//! This crate computes and does no I/O. [`Aggregation`] keeps the groups of one
//! aggregation: a batch begins from the last committed version, adds its rows
//! with DataFusion's own [`GroupsAccumulator`]s, and finishes by emitting what
//! its output mode names and freeing what the watermark closed; the new version
//! becomes the committed one once the executor has made it durable. Its deltas
//! and snapshots are encoded by [`encode`] and read back by [`decode`], which
//! names a damaged file or one written by another query. [`Dedupe`] keeps
//! the keys a keyed deduplication has seen, each until the watermark passes.
//!
//! [`GroupsAccumulator`]: datafusion::logical_expr::GroupsAccumulator

mod block;
mod chunks;
mod dedupe;
mod error;
mod file;
mod finish;
mod groups;
mod keys;
mod operator;
mod time;

pub use block::StateStats;
pub use dedupe::{Dedupe, DedupeStats};
pub use error::StateError;
pub use file::{Encoder, decode, encode};
pub use groups::{
    AggregateParts, Aggregation, Eviction, OutputMode, partition_of, window_bounds_ms,
};
pub use time::{epoch_millis, from_epoch_millis};
