//! The Kafka source of Sluice, over `rdkafka`: partition discovery, watermarks,
//! offsets by timestamp, reading planned offset ranges and detecting data loss.
//!
//! It implements the source trait of `sluice-offsets`; the decisions themselves
//! (rate limits, data-loss classification) stay in that crate.
