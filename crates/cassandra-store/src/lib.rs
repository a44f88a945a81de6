//! The Cassandra offset store and sink of Sluice, over the `scylla` driver: batch
//! plans and commits per query, fenced by an epoch so that only one runner writes.
//!
//! Schema (created when missing unless `create_schema = false`):
//!
//! ```text
//! sluice_log     (query, kind, batch_id) + static query_id, epoch, owner
//!                plans (kind 'plan'), commits ('commit') and batch 0's start ('initial')
//! sluice_core (query, topic, partition) -> offset, batch_id   the latest committed offsets
//! sluice_partitions (query, topic, partition) -> owner, start_offset + static query_id,
//!                initial_offsets                                 group mode's directory
//! ```
//!
//! A runner claims a query by raising its epoch with a lightweight transaction;
//! every plan and commit is an `UPDATE ... IF epoch = <ours> AND <entry> = null`,
//! so a runner whose epoch was superseded can never write again, and no entry is
//! ever overwritten. See `docs/cassandra-store.md`.

mod connect;
mod directory;
mod error;
mod location;
mod lookup;
mod sink;
mod store;

pub use connect::{
    Connection, Consistency, SerialConsistency, parse_consistency, parse_serial_consistency,
    read_offsets_table,
};
pub use directory::{CassandraDirectory, PARTITIONS_TABLE};
pub use error::{CassandraStoreError, DriverError};
pub use location::CassandraLocation;
pub use lookup::KeyReader;
pub use sink::{CassandraSink, CassandraSinkConfig, Field};
pub use store::{
    CassandraOptions, CassandraStore, InspectedLog, LOG_TABLE, OFFSETS_TABLE, STATE_TABLE,
};
