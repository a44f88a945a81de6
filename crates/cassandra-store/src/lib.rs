//! The Cassandra offset store and sink of Sluice, over the `scylla` driver: batch
//! plans and commits per query, fenced by an epoch so that only one runner writes.
