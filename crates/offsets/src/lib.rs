//! The pure model of Sluice: topic-partitions, offsets, offset ranges, batch plans,
//! starting-offset and reset policies, data-loss classification and Spark-compatible
//! offset JSON, plus the traits that the offset stores, sources and sinks implement.
//!
//! This crate does no I/O and depends on no async runtime, so that every decision
//! about what a batch reads and how a restart recovers is a plain function that can
//! be tested exhaustively.
