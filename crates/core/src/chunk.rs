//! Records in chunks: the unit a source hands to a sink while a batch streams.
//!
//! A batch can be far larger than memory, so it is never held whole. A chunk keeps
//! the keys, values and headers of its records in one byte buffer, so that reading
//! a record costs one copy and no allocation of its own.

use std::sync::Arc;

use crate::{Header, Offset, Record, TimestampType};

/// Where a key, value or header lies in a chunk's buffer, or that it is null.
///
/// Offsets are `u32`: a chunk holds at most 4 GiB, and a record read from Kafka
/// is smaller than 2 GiB. Keeping an entry small matters because a chunk is also
/// the read-ahead buffer, where small records are many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    start: u32,
    /// [`NULL_LEN`] for null.
    len: u32,
}

impl Span {
    const NULL: Span = Span {
        start: 0,
        len: NULL_LEN,
    };

    fn range(self) -> Option<std::ops::Range<usize>> {
        (self.len != NULL_LEN).then(|| self.start as usize..self.start as usize + self.len as usize)
    }
}

/// `timestamp_ms` of a record without a timestamp.
const NO_TIMESTAMP: i64 = i64::MIN;

/// `key_len` or `value_len` of a null key or value.
const NULL_LEN: u32 = u32::MAX;

/// One record's place in a chunk. It is most of a small record's cost in the
/// read-ahead (a 100-byte record takes about 150 bytes), so it keeps only what
/// cannot be derived: the value follows the key in `data`, and a record's
/// headers begin where the previous record's end. 40 bytes; a topic index of
/// 16 bits is what lets the timestamp type fit beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    offset: Offset,
    timestamp_ms: i64,
    partition: i32,
    /// Where the key begins in `data`, and the value right after it.
    start: u32,
    /// [`NULL_LEN`] for a null key or value.
    key_len: u32,
    value_len: u32,
    /// One past the record's last header in `headers`.
    headers_end: u32,
    topic: u16,
    timestamp_type: TimestampType,
}

impl Entry {
    fn key(&self) -> Span {
        Span {
            start: self.start,
            len: self.key_len,
        }
    }

    fn value(&self) -> Span {
        let key = if self.key_len == NULL_LEN {
            0
        } else {
            self.key_len
        };
        Span {
            start: self.start + key,
            len: self.value_len,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct HeaderEntry {
    key: Span,
    value: Span,
}

/// A run of records, in the order they were read. Records of different partitions
/// may interleave; within a partition they are in offset order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordChunk {
    /// Which of a query's sources read the records: chunks never mix sources.
    source: u16,
    topics: Vec<Arc<str>>,
    entries: Vec<Entry>,
    headers: Vec<HeaderEntry>,
    data: Vec<u8>,
}

/// What [`RecordChunk::push`] copies into a chunk: one record, borrowed.
#[derive(Clone, Copy, Debug)]
pub struct RecordParts<'a> {
    /// The record's partition.
    pub partition: i32,
    /// The record's offset.
    pub offset: Offset,
    /// Epoch milliseconds, when the record has a timestamp.
    pub timestamp_ms: Option<i64>,
    /// How the timestamp was set.
    pub timestamp_type: TimestampType,
    /// The key; `None` for a null key.
    pub key: Option<&'a [u8]>,
    /// The value; `None` for a null value.
    pub value: Option<&'a [u8]>,
}

impl RecordChunk {
    /// The most topics one chunk holds records of (its entries' topic index is
    /// 16 bits).
    pub const MAX_TOPICS: usize = 1 << 16;

    /// Which of the query's sources read the chunk's records, in the order
    /// the query declares them; 0 for a query with one.
    pub fn source(&self) -> usize {
        usize::from(self.source)
    }

    /// Marks the chunk as read by source `source`.
    pub fn set_source(&mut self, source: usize) {
        self.source = u16::try_from(source).unwrap_or(u16::MAX);
    }

    /// An empty chunk with room for about `records` records of `bytes` bytes in all.
    pub fn with_capacity(records: usize, bytes: usize) -> RecordChunk {
        RecordChunk::with_room(records, bytes, 0)
    }

    /// Copies a record of `topic` into the chunk, with `headers` as (name, value)
    /// pairs.
    ///
    /// # Panics
    ///
    /// When the chunk would hold 4 GiB of keys, values and headers, or records of
    /// more than [`RecordChunk::MAX_TOPICS`] topics: its entries keep 32-bit
    /// places and a 16-bit topic index. The source's chunks hold at most 1,024
    /// records, and [`RecordChunk::has_room_for`] bounds their bytes.
    pub fn push<'h>(
        &mut self,
        topic: &Arc<str>,
        record: RecordParts<'_>,
        headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
    ) {
        let topic = self.topic_index(topic);
        let start = index(self.data.len());
        let key = self.copy(record.key);
        let value = self.copy(record.value);
        for (name, header_value) in headers {
            let key = self.copy(Some(name.as_bytes()));
            let value = self.copy(header_value);
            self.headers.push(HeaderEntry { key, value });
        }
        self.entries.push(Entry {
            offset: record.offset,
            timestamp_ms: record.timestamp_ms.unwrap_or(NO_TIMESTAMP),
            partition: record.partition,
            start,
            key_len: key.len,
            value_len: value.len,
            headers_end: index(self.headers.len()),
            topic,
            timestamp_type: record.timestamp_type,
        });
    }

    /// Copies a record of another chunk into this one. Panics as
    /// [`RecordChunk::push`] does.
    pub fn push_ref(&mut self, record: RecordRef<'_>) {
        self.push(
            record.topic_arc(),
            RecordParts {
                partition: record.partition(),
                offset: record.offset(),
                timestamp_ms: record.timestamp_ms(),
                timestamp_type: record.timestamp_type(),
                key: record.key(),
                value: record.value(),
            },
            record.headers(),
        );
    }

    /// Copies an owned record into the chunk. Panics as [`RecordChunk::push`]
    /// does.
    pub fn push_record(&mut self, record: &Record) {
        self.push(
            &record.topic,
            RecordParts {
                partition: record.partition,
                offset: record.offset,
                timestamp_ms: record.timestamp_ms,
                timestamp_type: record.timestamp_type,
                key: record.key.as_deref(),
                value: record.value.as_deref(),
            },
            record
                .headers
                .iter()
                .map(|h| (h.key.as_str(), h.value.as_deref())),
        );
    }

    fn topic_index(&mut self, topic: &Arc<str>) -> u16 {
        // Chunks hold one or a few topics, and mostly records of the one pushed last.
        let i = match self.topics.len().checked_sub(1) {
            Some(last) if Arc::ptr_eq(&self.topics[last], topic) || self.topics[last] == *topic => {
                last
            }
            _ => match self.topics.iter().position(|t| t == topic) {
                Some(i) => i,
                None => {
                    // Refused before the list grows, so a caller that catches
                    // the panic still has a consistent chunk.
                    assert!(
                        self.topics.len() < RecordChunk::MAX_TOPICS,
                        "a RecordChunk holds records of at most MAX_TOPICS topics"
                    );
                    self.topics.push(topic.clone());
                    self.topics.len() - 1
                }
            },
        };
        u16::try_from(i).expect("a RecordChunk holds records of at most MAX_TOPICS topics")
    }

    fn copy(&mut self, bytes: Option<&[u8]>) -> Span {
        match bytes {
            None => Span::NULL,
            Some(b) => {
                let start = index(self.data.len());
                let len = index(b.len());
                // The end must fit too, and `u32::MAX` marks null.
                assert!(
                    u64::from(start) + u64::from(len) < u64::from(u32::MAX),
                    "a RecordChunk holds at most 4 GiB"
                );
                self.data.extend_from_slice(b);
                Span { start, len }
            }
        }
    }

    /// How many records the chunk holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the chunk holds no record.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes of keys, values and headers the chunk holds.
    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// The memory a record takes in a chunk: `data_bytes` bytes of key, value
    /// and headers, and its `headers` headers' entries.
    pub fn footprint(data_bytes: usize, headers: usize) -> usize {
        data_bytes + std::mem::size_of::<Entry>() + headers * std::mem::size_of::<HeaderEntry>()
    }

    /// Whether a record of `data_bytes` bytes with `headers` headers fits in the
    /// memory the chunk has already taken, so that pushing it allocates nothing.
    /// (A record of a topic the chunk has not seen yet may still grow its list
    /// of topics by one.)
    pub fn has_room_for(&self, data_bytes: usize, headers: usize) -> bool {
        self.entries.len() < self.entries.capacity()
            && self.data.capacity() - self.data.len() >= data_bytes
            && self.headers.capacity() - self.headers.len() >= headers
    }

    /// An empty chunk with room for `records` records, `bytes` bytes of keys,
    /// values and headers, and `headers` headers, which pushing records within
    /// that room never grows.
    pub fn with_room(records: usize, bytes: usize, headers: usize) -> RecordChunk {
        RecordChunk {
            source: 0,
            topics: Vec::with_capacity(1),
            entries: Vec::with_capacity(records),
            headers: Vec::with_capacity(headers),
            data: Vec::with_capacity(bytes),
        }
    }

    /// The heap memory the chunk has taken, whether it holds records there yet
    /// or not: what keeping it costs.
    pub fn allocated_bytes(&self) -> usize {
        self.data.capacity()
            + self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.headers.capacity() * std::mem::size_of::<HeaderEntry>()
            + self.topics.capacity() * std::mem::size_of::<Arc<str>>()
    }

    /// The record at `index`, in the order they were pushed.
    pub fn get(&self, index: usize) -> Option<RecordRef<'_>> {
        let entry = self.entries.get(index)?;
        let first_header = match index.checked_sub(1) {
            Some(previous) => self.entries[previous].headers_end,
            None => 0,
        };
        Some(RecordRef {
            chunk: self,
            entry,
            first_header,
        })
    }

    /// Forgets every record, keeping the memory for the next ones.
    pub fn clear(&mut self) {
        self.topics.clear();
        self.entries.clear();
        self.headers.clear();
        self.data.clear();
    }

    /// The records, in the order they were pushed.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            chunk: self,
            entries: self.entries.iter(),
            first_header: 0,
        }
    }
}

impl<'a> IntoIterator for &'a RecordChunk {
    type Item = RecordRef<'a>;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The records of a [`RecordChunk`], in order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    chunk: &'a RecordChunk,
    entries: std::slice::Iter<'a, Entry>,
    /// The next record's first header.
    first_header: u32,
}

impl<'a> Iterator for Iter<'a> {
    type Item = RecordRef<'a>;

    fn next(&mut self) -> Option<RecordRef<'a>> {
        let entry = self.entries.next()?;
        let first_header = std::mem::replace(&mut self.first_header, entry.headers_end);
        Some(RecordRef {
            chunk: self.chunk,
            entry,
            first_header,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.entries.size_hint()
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// One record of a [`RecordChunk`], borrowed from it.
#[derive(Clone, Copy, Debug)]
pub struct RecordRef<'a> {
    chunk: &'a RecordChunk,
    entry: &'a Entry,
    /// Its first header in the chunk's `headers`: where the previous record's end.
    first_header: u32,
}

impl<'a> RecordRef<'a> {
    /// The record's topic.
    pub fn topic(&self) -> &'a str {
        &self.chunk.topics[self.entry.topic as usize]
    }

    /// The record's topic, shared.
    pub fn topic_arc(&self) -> &'a Arc<str> {
        &self.chunk.topics[self.entry.topic as usize]
    }

    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.entry.partition
    }

    /// The record's offset.
    pub fn offset(&self) -> Offset {
        self.entry.offset
    }

    /// Epoch milliseconds, when the record has a timestamp.
    pub fn timestamp_ms(&self) -> Option<i64> {
        (self.entry.timestamp_ms != NO_TIMESTAMP).then_some(self.entry.timestamp_ms)
    }

    /// How the timestamp was set.
    pub fn timestamp_type(&self) -> TimestampType {
        self.entry.timestamp_type
    }

    /// The key; `None` for a null key.
    pub fn key(&self) -> Option<&'a [u8]> {
        self.bytes(self.entry.key())
    }

    /// The value; `None` for a null value (a tombstone).
    pub fn value(&self) -> Option<&'a [u8]> {
        self.bytes(self.entry.value())
    }

    /// The memory the record takes in its chunk ([`RecordChunk::footprint`]).
    pub fn footprint(&self) -> usize {
        RecordChunk::footprint(self.byte_len(), self.header_count())
    }

    /// How many headers the record has.
    pub fn header_count(&self) -> usize {
        (self.entry.headers_end - self.first_header) as usize
    }

    fn header_entries(&self) -> &'a [HeaderEntry] {
        &self.chunk.headers[self.first_header as usize..self.entry.headers_end as usize]
    }

    /// The headers as (name, value) pairs, in their order on the record.
    pub fn headers(&self) -> impl ExactSizeIterator<Item = (&'a str, Option<&'a [u8]>)> + 'a {
        let chunk = self.chunk;
        self.header_entries().iter().map(move |h| {
            // Names were copied from `&str`, so they are always UTF-8.
            let name = h
                .key
                .range()
                .and_then(|r| std::str::from_utf8(&chunk.data[r]).ok())
                .unwrap_or_default();
            (name, h.value.range().map(|v| &chunk.data[v]))
        })
    }

    /// The bytes of its key, value and headers: what the record adds to
    /// [`RecordChunk::byte_len`].
    pub fn byte_len(&self) -> usize {
        let len = |span: Span| span.range().map_or(0, |r| r.len());
        let headers: usize = self
            .header_entries()
            .iter()
            .map(|h| len(h.key) + len(h.value))
            .sum();
        len(self.entry.key()) + len(self.entry.value()) + headers
    }

    fn bytes(&self, span: Span) -> Option<&'a [u8]> {
        let data: &'a [u8] = &self.chunk.data;
        span.range().map(|range| &data[range])
    }

    /// The record as an owned [`Record`].
    pub fn to_record(&self) -> Record {
        Record {
            topic: self.topic_arc().clone(),
            partition: self.partition(),
            offset: self.offset(),
            timestamp_ms: self.timestamp_ms(),
            timestamp_type: self.timestamp_type(),
            key: self.key().map(<[u8]>::to_vec),
            value: self.value().map(<[u8]>::to_vec),
            headers: self
                .headers()
                .map(|(key, value)| Header {
                    key: key.to_owned(),
                    value: value.map(<[u8]>::to_vec),
                })
                .collect(),
        }
    }
}

/// A position in a chunk's vectors as `u32`; see [`Span`].
fn index(i: usize) -> u32 {
    u32::try_from(i).expect("a RecordChunk holds at most 4 GiB and 2^32 records")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(topic: &str, partition: i32, offset: i64, value: Option<&str>) -> Record {
        Record {
            topic: Arc::from(topic),
            partition,
            offset: Offset::new(offset).unwrap(),
            timestamp_ms: Some(offset * 10),
            timestamp_type: TimestampType::CreateTime,
            key: (offset % 2 == 0).then(|| format!("k{offset}").into_bytes()),
            value: value.map(|v| v.as_bytes().to_vec()),
            headers: if offset == 3 {
                vec![
                    Header {
                        key: "trace".into(),
                        value: Some(b"abc".to_vec()),
                    },
                    Header {
                        key: "empty".into(),
                        value: None,
                    },
                ]
            } else {
                Vec::new()
            },
        }
    }

    fn push_one_of(chunk: &mut RecordChunk, topic: &Arc<str>) {
        let parts = RecordParts {
            partition: 0,
            offset: Offset::new(0).unwrap(),
            timestamp_ms: None,
            timestamp_type: TimestampType::CreateTime,
            key: None,
            value: Some(b"v"),
        };
        chunk.push(topic, parts, std::iter::empty());
    }

    #[test]
    fn a_chunk_holds_records_of_max_topics_topics_and_panics_at_one_more() {
        let topic = |i: usize| -> Arc<str> { Arc::from(format!("t{i}").as_str()) };
        let mut chunk = RecordChunk::with_capacity(2, 2);
        // As if records of the first MAX_TOPICS - 1 topics had been pushed.
        chunk.topics = (0..RecordChunk::MAX_TOPICS - 1).map(topic).collect();
        push_one_of(&mut chunk, &topic(RecordChunk::MAX_TOPICS - 1));
        assert_eq!(chunk.topics.len(), RecordChunk::MAX_TOPICS);
        let last = chunk.get(0).unwrap();
        assert_eq!(last.topic(), format!("t{}", RecordChunk::MAX_TOPICS - 1));
        let more = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            push_one_of(&mut chunk, &topic(RecordChunk::MAX_TOPICS));
        }));
        assert!(
            more.is_err(),
            "a topic beyond MAX_TOPICS must not be pushed"
        );
    }

    #[test]
    fn a_chunk_made_with_room_counts_its_records_and_never_grows() {
        let records: Vec<Record> = (0..8)
            .map(|o| record("a", 0, o, Some("a value of some bytes")))
            .collect();
        let size = |r: &Record| {
            r.key.as_ref().map_or(0, Vec::len)
                + r.value.as_ref().map_or(0, Vec::len)
                + r.headers
                    .iter()
                    .map(|h| h.key.len() + h.value.as_ref().map_or(0, Vec::len))
                    .sum::<usize>()
        };
        let bytes: usize = records.iter().map(size).sum();
        let headers: usize = records.iter().map(|r| r.headers.len()).sum();
        let mut chunk = RecordChunk::with_room(records.len(), bytes, headers);
        let allocated = chunk.allocated_bytes();
        let mut footprints = 0;
        for r in &records {
            assert!(chunk.has_room_for(size(r), r.headers.len()));
            chunk.push_record(r);
            footprints += RecordChunk::footprint(size(r), r.headers.len());
        }
        assert!(!chunk.has_room_for(0, 0), "every entry is taken");
        assert_eq!(chunk.allocated_bytes(), allocated, "nothing grew");
        let counted: usize = chunk.iter().map(|r| r.footprint()).sum();
        assert_eq!(counted, footprints);
        // What the records take is what the chunk took, but for its topic list.
        assert_eq!(
            counted,
            allocated - std::mem::size_of::<Arc<str>>() * chunk.topics.capacity()
        );
    }

    #[test]
    fn records_come_back_as_they_were_pushed() {
        let records = vec![
            record("a", 0, 0, Some("zero")),
            record("b", 1, 1, None),
            record("a", 0, 2, Some("")),
            record("a", 2, 3, Some("three")),
            record("c", 0, 4, Some("four")),
        ];
        let mut chunk = RecordChunk::default();
        for r in &records {
            chunk.push_record(r);
        }
        assert_eq!(chunk.len(), 5);
        assert_eq!(chunk.iter().len(), 5);
        let back: Vec<Record> = chunk.iter().map(|r| r.to_record()).collect();
        assert_eq!(back, records);
        let mut copy = RecordChunk::default();
        chunk.iter().for_each(|r| copy.push_ref(r));
        assert_eq!(copy, chunk);
        assert_eq!(chunk.topics.len(), 3, "each topic is stored once");
        let third = chunk.iter().nth(3).unwrap();
        assert_eq!(third.header_count(), 2);
        assert_eq!(
            third.headers().collect::<Vec<_>>(),
            vec![("trace", Some(&b"abc"[..])), ("empty", None)]
        );
        // A record found by index finds its headers after its predecessor's.
        for (i, r) in records.iter().enumerate() {
            assert_eq!(&chunk.get(i).unwrap().to_record(), r);
        }
    }

    #[test]
    fn records_are_found_by_index_and_sized() {
        let mut chunk = RecordChunk::default();
        for offset in 0..5 {
            chunk.push_record(&record("a", 0, offset, Some("value")));
        }
        assert_eq!(chunk.get(3).unwrap().offset().value(), 3);
        assert!(chunk.get(5).is_none());
        let sizes: usize = chunk.iter().map(|r| r.byte_len()).sum();
        assert_eq!(sizes, chunk.byte_len());
        assert!(chunk.allocated_bytes() >= chunk.byte_len() + 5 * std::mem::size_of::<Entry>());
        chunk.clear();
        assert!(chunk.is_empty() && chunk.byte_len() == 0 && chunk.get(0).is_none());
        // An entry is most of a small record's cost in the read-ahead.
        assert!(
            std::mem::size_of::<Entry>() <= 40,
            "{}",
            std::mem::size_of::<Entry>()
        );
    }

    #[test]
    fn null_and_empty_values_differ() {
        let mut chunk = RecordChunk::with_capacity(2, 16);
        chunk.push_record(&record("a", 0, 1, None));
        chunk.push_record(&record("a", 0, 3, Some("")));
        let values: Vec<_> = chunk.iter().map(|r| r.value()).collect();
        assert_eq!(values, vec![None, Some(&b""[..])]);
        assert_eq!(chunk.byte_len(), "traceabcempty".len());
    }
}
