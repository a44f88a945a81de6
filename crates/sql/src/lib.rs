//! SQL over the stream: records as Arrow, values decoded into columns, and
//! queries planned once by Apache DataFusion and run on every chunk, with
//! event-time windows and aggregation whose state is kept across batches.
//!
//! This crate computes and does no I/O: it turns [`RecordChunk`]s into Arrow
//! record batches with Spark's Kafka columns ([`columns`]), decodes values in a
//! declared schema ([`decode`], [`parse_ddl`]), and runs a query over them
//! ([`StreamQuery`]), refusing what an unbounded stream cannot do. [`SqlProcessor`]
//! puts the three together as the executor's [`Processor`].
//!
//! [`RecordChunk`]: sluice_core::RecordChunk
//! [`Processor`]: sluice_core::Processor

pub mod columns;
mod ddl;
pub mod decode;
mod dedupe;
mod error;
mod flat_json;
mod lookup;
mod options;
mod processor;
mod query;
pub mod window;

pub use ddl::parse_ddl;
pub use decode::{AvroFormat, AvroWire, BadRecord, Decoded, Decoder, Format};
pub use error::SqlError;
pub use lookup::{
    Fetch, FetchError, KeyedLoader, LoadError, Loaded, LookupTable, Refresh, TableLoader,
};
pub use options::{DEFAULT_MAX_STATE_ROWS, MAX_STATE_PARTITIONS, QueryOptions};
pub use processor::SqlProcessor;
pub use query::StreamQuery;
pub use sluice_state::{OutputMode, StateStats};

/// Arrow, as this crate uses it, for the crates that take its rows.
pub use arrow;
