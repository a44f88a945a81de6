//! How a query runs, beyond its SQL.

use sluice_state::OutputMode;

use crate::LookupTable;

/// How a query runs, beyond its SQL.
#[derive(Clone, Debug, Default)]
pub struct QueryOptions {
    /// `[query] output_mode`; `None` for the default: append for windows,
    /// update for other aggregations.
    pub output_mode: Option<OutputMode>,
    /// The event-time column, when the query has a watermark.
    pub watermark_column: Option<String>,
    /// How far the watermark stays behind the latest event time, in
    /// milliseconds: how long a keyed deduplication keeps a key past its
    /// row's event time.
    pub watermark_delay_ms: Option<i64>,
    /// The most groups an aggregation may hold; `None` for
    /// [`DEFAULT_MAX_STATE_ROWS`].
    pub max_state_rows: Option<u64>,
    /// How many partitions the state is split into, by a hash of the group
    /// key; `None` for one.
    pub state_partitions: Option<u32>,
    /// The most bytes an aggregation's state and a batch's own groups may
    /// hold; `None` for no limit.
    pub state_memory_bytes: Option<u64>,
    /// The lookup tables the query may join its stream with, each under its
    /// name.
    pub lookup_tables: Vec<LookupTable>,
}

/// How many groups an aggregation holds at most unless told otherwise.
pub const DEFAULT_MAX_STATE_ROWS: u64 = 10_000_000;

/// The most state partitions a query may have: each is a file (or Cassandra
/// partition) written every batch.
pub const MAX_STATE_PARTITIONS: u32 = 256;
