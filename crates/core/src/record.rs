//! A record as read from a partition, one at a time: its headers and how its
//! timestamp was set. Sources hand records over in `RecordChunk`s; this is
//! the owned form for tests and tools, and the parts a chunk's records share.

use std::sync::Arc;

use crate::Offset;

/// How a record's timestamp was set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestampType {
    /// The record has no timestamp.
    NotAvailable,
    /// Set by the producer.
    CreateTime,
    /// Set by the broker when it appended the record.
    LogAppendTime,
}

/// One record header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The header's name.
    pub key: String,
    /// The header's value; `None` for a null value.
    pub value: Option<Vec<u8>>,
}

/// One record as read from a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The topic, shared by the records of a partition.
    pub topic: Arc<str>,
    /// The partition number.
    pub partition: i32,
    /// The record's offset.
    pub offset: Offset,
    /// Epoch milliseconds, when the record has a timestamp.
    pub timestamp_ms: Option<i64>,
    /// How the timestamp was set.
    pub timestamp_type: TimestampType,
    /// The key; `None` for a null key.
    pub key: Option<Vec<u8>>,
    /// The value; `None` for a null value (a tombstone).
    pub value: Option<Vec<u8>>,
    /// The headers, when the source is asked to include them; empty otherwise.
    pub headers: Vec<Header>,
}
