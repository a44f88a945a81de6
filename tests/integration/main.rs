//! Sluice's integration tests. Each module talks to the real Kafka broker or
//! Cassandra node (see `sluice_tests` for where they are) and creates its own
//! uniquely named topics and keyspaces, so tests run in parallel and can be rerun.

mod cassandra_smoke;
mod continuous;
mod exactly_once;
mod group;
mod kafka_smoke;
mod kafka_source;
mod lake;
mod lookup;
mod memory_budget;
mod runner;
mod scale_out;
mod security;
mod sources;
mod spark_checkpoint;
mod sql;
mod stateful;
mod status_page;
mod store_suite;
