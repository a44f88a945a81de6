//! A partition's read-ahead: the records it fetched before a batch wants them,
//! packed.
//!
//! Records wait here from the fetch that brought them until a batch takes them,
//! which with many partitions and a rate limit is a long time: 1,024 partitions
//! at 10,000 records per trigger take 10 records of each per batch, and a
//! record batch of librdkafka's producers holds a thousand or more. To read each
//! record once, a partition must hold the rest of its record batch, so what a
//! held record costs decides how many fetches the read memory spares. As a
//! chunk's entry, a record's offset, timestamp and places took 40 bytes beside
//! its key and value (37% of a 100-byte record); packed, as Kafka's own record
//! format does, they take about 6: a tag, the offset and timestamp as varint
//! deltas from the record before, and the key's and value's lengths.
//!
//! A buffer is a queue of segments of fixed capacity, so that memory is given
//! back as it drains and is what it is counted at: beyond its records, at most
//! the taken front of the first segment and the unfilled end of the last.

use std::collections::VecDeque;
use std::sync::Arc;

use rdkafka::Timestamp;
use rdkafka::message::{Headers, Message};
use sluice_core::{Offset, RecordChunk, RecordParts, TimestampType};

/// The records of a partition's buffer are kept in segments of at most this
/// many bytes, so that memory is given back as a buffer drains. A segment is an
/// eighth of the partition's share, if that is smaller.
const SEGMENT_BYTES: usize = 16 * 1024;

/// The tag's bits: the timestamp's type in the low two, then whether the key,
/// the value and headers follow.
const KEY: u8 = 1 << 2;
const VALUE: u8 = 1 << 3;
const HEADERS: u8 = 1 << 4;
const TIMESTAMP_TYPE: u8 = 0b11;

/// A partition's records fetched ahead of the batches, in offset order.
#[derive(Debug)]
pub(super) struct Buffer {
    segments: VecDeque<Segment>,
    /// The packed bytes of the records not yet taken.
    pub(super) bytes: usize,
    /// Their keys' and values' bytes.
    pub(super) data_bytes: u64,
    /// The mean packed size of this partition's records, from the last segment
    /// filled: what room for a number of records is judged by.
    pub(super) record_bytes: usize,
}

/// Records packed one after the other, with the offset and timestamp the next
/// record's deltas start from at either end.
#[derive(Debug)]
struct Segment {
    data: Vec<u8>,
    records: usize,
    /// Where the next record to take begins, and the offset and timestamp of
    /// the record taken before it.
    read: usize,
    read_offset: i64,
    read_timestamp: i64,
    /// The offset and timestamp of the last record pushed.
    last_offset: i64,
    last_timestamp: i64,
}

/// What a record taken from a buffer was: its offset, and the bytes of its key
/// and value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Taken {
    pub(super) offset: i64,
    pub(super) data_bytes: usize,
}

impl Default for Buffer {
    fn default() -> Buffer {
        Buffer {
            segments: VecDeque::new(),
            bytes: 0,
            data_bytes: 0,
            record_bytes: 128,
        }
    }
}

impl Buffer {
    /// Whether it holds no record.
    pub(super) fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// The offset of the first record, if it holds one.
    pub(super) fn front_offset(&self) -> Option<i64> {
        let segment = self.segments.front()?;
        let (delta, _) = varint(&segment.data, segment.read + 1);
        Some(segment.read_offset.wrapping_add(unzigzag(delta)))
    }

    /// Moves the first record of `topic`'s `partition` into `chunk`.
    pub(super) fn pop_into(
        &mut self,
        chunk: &mut RecordChunk,
        topic: &Arc<str>,
        partition: i32,
    ) -> Option<Taken> {
        let segment = self.segments.front_mut()?;
        let start = segment.read;
        let record = Packed::decode(segment)?;
        chunk.push(
            topic,
            RecordParts {
                partition,
                offset: Offset::new(record.offset).unwrap_or(Offset::ZERO),
                timestamp_ms: record.timestamp_ms,
                timestamp_type: record.timestamp_type,
                key: record.key,
                value: record.value,
            },
            HeaderIter {
                data: record.headers,
                left: record.header_count,
            },
        );
        let taken = Taken {
            offset: record.offset,
            data_bytes: record.key.map_or(0, <[u8]>::len) + record.value.map_or(0, <[u8]>::len),
        };
        let (end, timestamp) = (record.end, record.timestamp_ms);
        segment.read = end;
        segment.read_offset = taken.offset;
        if let Some(ms) = timestamp {
            segment.read_timestamp = ms;
        }
        self.bytes = self.bytes.saturating_sub(end - start);
        self.data_bytes = self.data_bytes.saturating_sub(taken.data_bytes as u64);
        if segment.read >= segment.data.len() {
            self.segments.pop_front();
        }
        Some(taken)
    }

    /// Appends `message`, with its headers when `include_headers`; `share` is
    /// the partition's share of the read-ahead, which sizes new segments.
    pub(super) fn push<M: Message>(&mut self, message: &M, include_headers: bool, share: usize) {
        let headers = include_headers.then(|| message.headers()).flatten();
        let (timestamp_ms, timestamp_type) = match message.timestamp() {
            Timestamp::NotAvailable => (None, 0),
            Timestamp::CreateTime(ms) => (Some(ms), 1),
            Timestamp::LogAppendTime(ms) => (Some(ms), 2),
        };
        let (key, value) = (message.key(), message.payload());
        let mut tag = timestamp_type;
        if key.is_some() {
            tag |= KEY;
        }
        if value.is_some() {
            tag |= VALUE;
        }
        if headers.is_some() {
            tag |= HEADERS;
        }
        // The most the record's packing adds to its bytes: a tag and up to
        // four varints of ten bytes, and two per header.
        let header_bytes = headers.as_ref().map_or(0, |h| {
            10 + h
                .iter()
                .map(|h| 20 + h.key.len() + h.value.map_or(0, <[u8]>::len))
                .sum::<usize>()
        });
        let most = 41 + key.map_or(0, <[u8]>::len) + value.map_or(0, <[u8]>::len) + header_bytes;
        let room = self
            .segments
            .back()
            .is_some_and(|s| s.data.capacity() - s.data.len() >= most);
        if !room {
            if let Some(last) = self.segments.back().filter(|s| s.records > 0) {
                self.record_bytes = (last.data.len() / last.records).max(1);
            }
            let bytes = (share / 8).clamp(1024, SEGMENT_BYTES).max(most);
            self.segments.push_back(Segment::with_capacity(bytes));
        }
        let Some(segment) = self.segments.back_mut() else {
            return;
        };
        let before = segment.data.len();
        let data = &mut segment.data;
        data.push(tag);
        put_varint(
            data,
            zigzag(message.offset().wrapping_sub(segment.last_offset)),
        );
        segment.last_offset = message.offset();
        if let Some(ms) = timestamp_ms {
            put_varint(data, zigzag(ms.wrapping_sub(segment.last_timestamp)));
            segment.last_timestamp = ms;
        }
        for part in [key, value].into_iter().flatten() {
            put_varint(data, part.len() as u64);
        }
        if let Some(headers) = &headers {
            put_varint(data, headers.count() as u64);
            for header in headers.iter() {
                put_varint(data, header.key.len() as u64);
                data.extend_from_slice(header.key.as_bytes());
                match header.value {
                    Some(v) => {
                        put_varint(data, v.len() as u64 + 1);
                        data.extend_from_slice(v);
                    }
                    None => put_varint(data, 0),
                }
            }
        }
        for part in [key, value].into_iter().flatten() {
            data.extend_from_slice(part);
        }
        segment.records += 1;
        self.bytes += segment.data.len() - before;
        self.data_bytes += (key.map_or(0, <[u8]>::len) + value.map_or(0, <[u8]>::len)) as u64;
    }

    /// About how many more records fit before the buffer holds `limit`; at
    /// least one.
    pub(super) fn room_in_records(&self, limit: usize) -> usize {
        limit.saturating_sub(self.bytes) / self.record_bytes.max(1) + 1
    }

    /// Forgets every record.
    pub(super) fn clear(&mut self) {
        *self = Buffer::default();
    }

    /// What its segments took from the allocator.
    #[cfg(test)]
    fn allocated(&self) -> usize {
        self.segments.iter().map(|s| s.data.capacity()).sum()
    }
}

impl Segment {
    fn with_capacity(bytes: usize) -> Segment {
        Segment {
            data: Vec::with_capacity(bytes),
            records: 0,
            read: 0,
            read_offset: 0,
            read_timestamp: 0,
            last_offset: 0,
            last_timestamp: 0,
        }
    }
}

/// One record, decoded in place.
struct Packed<'a> {
    offset: i64,
    timestamp_ms: Option<i64>,
    timestamp_type: TimestampType,
    key: Option<&'a [u8]>,
    value: Option<&'a [u8]>,
    headers: &'a [u8],
    header_count: usize,
    /// Where the next record begins.
    end: usize,
}

impl<'a> Packed<'a> {
    /// The record at `segment.read`, or `None` when the segment holds no more.
    fn decode(segment: &'a Segment) -> Option<Packed<'a>> {
        let data = &segment.data;
        let &tag = data.get(segment.read)?;
        let (delta, mut at) = varint(data, segment.read + 1);
        let offset = segment.read_offset.wrapping_add(unzigzag(delta));
        let (timestamp_ms, timestamp_type) = match tag & TIMESTAMP_TYPE {
            0 => (None, TimestampType::NotAvailable),
            kind => {
                let (delta, next) = varint(data, at);
                at = next;
                let ms = segment.read_timestamp.wrapping_add(unzigzag(delta));
                let kind = if kind == 1 {
                    TimestampType::CreateTime
                } else {
                    TimestampType::LogAppendTime
                };
                (Some(ms), kind)
            }
        };
        let mut length = |present: bool| {
            present.then(|| {
                let (len, next) = varint(data, at);
                at = next;
                len as usize
            })
        };
        let key_len = length(tag & KEY != 0);
        let value_len = length(tag & VALUE != 0);
        let (headers, header_count) = if tag & HEADERS != 0 {
            let (count, start) = varint(data, at);
            at = start;
            for _ in 0..count {
                let (name, next) = varint(data, at);
                at = next + name as usize;
                let (value, next) = varint(data, at);
                at = next + (value as usize).saturating_sub(1);
            }
            (&data[start..at], count as usize)
        } else {
            (&data[at..at], 0)
        };
        let mut bytes = |len: Option<usize>| {
            len.map(|len| {
                let part = &data[at..at + len];
                at += len;
                part
            })
        };
        let key = bytes(key_len);
        let value = bytes(value_len);
        Some(Packed {
            offset,
            timestamp_ms,
            timestamp_type,
            key,
            value,
            headers,
            header_count,
            end: at,
        })
    }
}

/// A record's packed headers, as names and values.
struct HeaderIter<'a> {
    data: &'a [u8],
    left: usize,
}

impl<'a> Iterator for HeaderIter<'a> {
    type Item = (&'a str, Option<&'a [u8]>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let (len, at) = varint(self.data, 0);
        let name = &self.data[at..at + len as usize];
        let (value, start) = varint(self.data, at + len as usize);
        let end = start + (value as usize).saturating_sub(1);
        let value = (value > 0).then(|| &self.data[start..end]);
        self.data = &self.data[end..];
        // Written from a `&str` by `push`.
        Some((std::str::from_utf8(name).unwrap_or_default(), value))
    }
}

fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

fn unzigzag(value: u64) -> i64 {
    ((value >> 1) as i64) ^ -((value & 1) as i64)
}

fn put_varint(data: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        data.push(value as u8 | 0x80);
        value >>= 7;
    }
    data.push(value as u8);
}

/// The varint at `at` in `data`, and where what follows it begins.
fn varint(data: &[u8], mut at: usize) -> (u64, usize) {
    let mut value = 0u64;
    let mut shift = 0;
    while let Some(&byte) = data.get(at) {
        at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 || shift >= 63 {
            break;
        }
        shift += 7;
    }
    (value, at)
}

#[cfg(test)]
mod tests {
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};

    use super::*;

    fn message(offset: i64, value_bytes: usize) -> OwnedMessage {
        OwnedMessage::new(
            Some(vec![b'v'; value_bytes]),
            Some(format!("k{offset}").into_bytes()),
            "t".to_owned(),
            Timestamp::CreateTime(1_700_000_000_000 + offset * 3),
            0,
            offset,
            None,
        )
    }

    /// Every kind of record a partition delivers: null keys and values,
    /// headers with null values, timestamps of each type going back and
    /// forth, and offsets with gaps (compacted topics, transaction markers).
    fn assorted() -> Vec<OwnedMessage> {
        let mut messages = Vec::new();
        let mut offset = 5;
        for i in 0..300i64 {
            offset += 1 + (i % 7) * (i % 3);
            let timestamp = match i % 4 {
                0 => Timestamp::NotAvailable,
                1 => Timestamp::CreateTime(1_700_000_000_000 - i * 1_000),
                2 => Timestamp::LogAppendTime(1_700_000_000_000 + i),
                _ => Timestamp::CreateTime(-5),
            };
            let headers = (i % 5 == 0).then(|| {
                OwnedHeaders::new()
                    .insert(Header {
                        key: "trace",
                        value: Some(&b"abc"[..]),
                    })
                    .insert(Header::<&[u8]> {
                        key: "gone",
                        value: None,
                    })
            });
            messages.push(OwnedMessage::new(
                (i % 6 != 1).then(|| vec![b'x'; (i as usize * 13) % 300]),
                (i % 3 != 2).then(|| format!("key-{i}").into_bytes()),
                "t".to_owned(),
                timestamp,
                0,
                offset,
                headers,
            ));
        }
        messages
    }

    #[test]
    fn records_come_out_as_they_went_in() {
        let topic: Arc<str> = Arc::from("t");
        let messages = assorted();
        let mut expected = RecordChunk::default();
        for m in &messages {
            crate::reader::push(&mut expected, m, &topic, true);
        }
        let mut buffer = Buffer::default();
        let mut out = RecordChunk::default();
        for (i, m) in messages.iter().enumerate() {
            buffer.push(m, true, 4 * 1024);
            // Taken while more arrive, as batches take them.
            if i % 2 == 1 {
                let front = buffer.front_offset();
                let taken = buffer.pop_into(&mut out, &topic, 0).unwrap();
                assert_eq!(front, Some(taken.offset));
            }
        }
        while let Some(taken) = buffer.pop_into(&mut out, &topic, 0) {
            let record = out.get(out.len() - 1).unwrap();
            assert_eq!(taken.offset, record.offset().value());
            assert_eq!(
                taken.data_bytes,
                record.key().map_or(0, <[u8]>::len) + record.value().map_or(0, <[u8]>::len)
            );
        }
        assert_eq!(out, expected);
        assert!(buffer.is_empty());
        assert_eq!(buffer.data_bytes, 0);
        assert_eq!(buffer.front_offset(), None);
        assert_eq!(buffer.bytes, 0);
    }

    #[test]
    fn a_buffer_counts_what_its_records_take_and_its_segments_hold_about_that() {
        let share = 32 * 1024;
        let topic: Arc<str> = Arc::from("t");
        let mut buffer = Buffer::default();
        let mut out = RecordChunk::default();
        let (mut data, mut held) = (0, 0);
        for offset in 0..2_000 {
            // Records of varying size, as a partition's are.
            let m = message(offset, 60 + (offset as usize * 37) % 100);
            data += m.payload().unwrap().len() + m.key().unwrap().len();
            buffer.push(&m, false, share);
            held += 1;
            if offset % 3 == 0 {
                let taken = buffer.pop_into(&mut out, &topic, 0).unwrap();
                data -= taken.data_bytes;
                held -= 1;
            }
            assert_eq!(buffer.data_bytes, data as u64);
            // A tag, an offset's and a timestamp's delta and two lengths: at most
            // six bytes beside the key and value, not a chunk's 40. A
            // segment's first record has the whole offset and timestamp.
            let most = data + 6 * held + 10 * buffer.segments.len();
            assert!(buffer.bytes <= most, "{} for {data}", buffer.bytes);
            // Beyond its records, the taken front of the first segment, the
            // unfilled end of the last, and less than a record and its most
            // packing at the end of each.
            let segment = share / 8;
            let ends = buffer.segments.len() * (41 + 160);
            assert!(
                buffer.allocated() <= buffer.bytes + 2 * segment + ends,
                "{} allocated for {} counted",
                buffer.allocated(),
                buffer.bytes
            );
        }
        // A record larger than a segment gets a segment of its own size.
        buffer.push(&message(2_000, 100 * 1024), false, share);
        let ends = buffer.segments.len() * (41 + 160);
        assert!(buffer.allocated() <= buffer.bytes + 2 * share / 8 + ends);
        assert_eq!(
            buffer.segments.back().map(|s| s.data.capacity()),
            Some(100 * 1024 + 41 + "k2000".len())
        );
        while buffer.pop_into(&mut out, &topic, 0).is_some() {}
        assert_eq!(buffer.bytes, 0);
        assert_eq!(buffer.allocated(), 0);
    }

    #[test]
    fn varints_and_zigzag_cover_the_whole_range() {
        for value in [0, 1, -1, 63, -64, 1 << 40, i64::MAX, i64::MIN] {
            let mut data = Vec::new();
            put_varint(&mut data, zigzag(value));
            assert_eq!(varint(&data, 0), (zigzag(value), data.len()));
            assert_eq!(unzigzag(zigzag(value)), value);
        }
    }
}
