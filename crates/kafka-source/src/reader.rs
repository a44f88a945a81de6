//! Reading exactly the records of planned offset ranges.
//!
//! All ranges are read by one consumer at once: librdkafka fetches every assigned
//! partition in parallel, from each partition's leader. A partition is done when
//! its consumer position reaches the range's end. The position, not the last
//! record, decides, because transaction markers and aborted records take offsets
//! that are never delivered.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::Consumer;
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset as KafkaOffset, Timestamp, TopicPartitionList};
use sluice_offsets::{
    DataLoss, Header, Offset, OffsetRange, PartitionRecords, ReadBatch, Record, TimestampType,
    TopicPartition, classify_data_loss,
};

use crate::KafkaSourceError;
use crate::client::{Client, Position};

/// How long one poll waits before the reader checks positions and its timeout.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

struct Pending {
    topic: Arc<str>,
    partition: i32,
    /// The planned start, for error messages.
    from: i64,
    /// The first offset not yet read.
    next: i64,
    until: i64,
    done: bool,
}

impl Pending {
    fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.as_ref(), self.partition)
    }
}

/// Reads `ranges` and returns their records in plan order.
pub(crate) fn read(client: &Client, ranges: &[OffsetRange]) -> Result<ReadBatch, KafkaSourceError> {
    let mut batch = ReadBatch {
        partitions: ranges
            .iter()
            .map(|range| PartitionRecords {
                range: range.clone(),
                records: Vec::new(),
            })
            .collect(),
        data_loss: Vec::new(),
    };
    let mut pending: Vec<Pending> = ranges
        .iter()
        .map(|r| Pending {
            topic: Arc::from(r.topic_partition.topic.as_str()),
            partition: r.topic_partition.partition,
            from: r.from.value(),
            next: r.from.value(),
            until: r.until.value(),
            done: r.is_empty(),
        })
        .collect();
    let mut remaining = pending.iter().filter(|p| !p.done).count();
    if remaining == 0 {
        return Ok(batch);
    }

    let mut index: HashMap<Arc<str>, HashMap<i32, usize>> = HashMap::new();
    let mut assignment = TopicPartitionList::with_capacity(remaining);
    for (i, p) in pending.iter().enumerate().filter(|(_, p)| !p.done) {
        index
            .entry(p.topic.clone())
            .or_default()
            .insert(p.partition, i);
        assignment
            .add_partition_offset(&p.topic, p.partition, KafkaOffset::Offset(p.next))
            .map_err(|source| kafka_error("assigning", &p.topic_partition(), source))?;
    }
    let consumer = &client.consumer;
    consumer
        .assign(&assignment)
        .map_err(|source| KafkaSourceError::Kafka {
            what: format!("assigning {remaining} partitions"),
            source: Box::new(source),
        })?;

    let include_headers = client.config.include_headers;
    let poll_timeout = client.config.poll_timeout;
    let mut last_progress = Instant::now();
    while remaining > 0 {
        match consumer.poll(POLL_INTERVAL) {
            Some(Ok(message)) => {
                let Some(&i) = index
                    .get(message.topic())
                    .and_then(|partitions| partitions.get(&message.partition()))
                else {
                    continue;
                };
                let p = &mut pending[i];
                let offset = message.offset();
                if p.done || offset < p.next {
                    continue;
                }
                last_progress = Instant::now();
                if offset < p.until {
                    batch.partitions[i].records.push(to_record(
                        &message,
                        &p.topic,
                        include_headers,
                    ));
                    p.next = offset + 1;
                }
                if offset + 1 >= p.until {
                    finish(p, &mut remaining);
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {
                if sync_positions(consumer, &mut pending, &mut remaining)? {
                    last_progress = Instant::now();
                }
                if remaining > 0 && last_progress.elapsed() > poll_timeout {
                    let stuck =
                        pending
                            .iter()
                            .find(|p| !p.done)
                            .map(|p| KafkaSourceError::PollTimeout {
                                topic_partition: p.topic_partition(),
                                from: offset(p.from),
                                until: offset(p.until),
                                reached: offset(p.next),
                                timeout_ms: poll_timeout.as_millis(),
                            });
                    if let Some(error) = stuck {
                        return Err(error);
                    }
                }
            }
            Some(Err(KafkaError::MessageConsumption(
                RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
            ))) => {
                // librdkafka does not say which partition; compare every unfinished
                // partition's position with the watermarks to find out.
                let losses = out_of_range(client, &pending)?;
                if client.config.fail_on_data_loss && !losses.is_empty() {
                    return Err(KafkaSourceError::DataLoss(losses));
                }
                let skipped = !losses.is_empty();
                for loss in losses {
                    skip_past(&mut pending, &index, &loss, &mut remaining);
                    tracing::warn!(
                        lost_offsets = loss.lost_offsets(),
                        "{loss}; skipping ahead because fail_on_data_loss is false"
                    );
                    batch.data_loss.push(loss);
                }
                if skipped && remaining > 0 {
                    reassign(client, &pending)?;
                }
                last_progress = Instant::now();
            }
            Some(Err(e)) => {
                // librdkafka retries transient broker errors itself and reports them
                // here too; the poll timeout catches a read that never recovers.
                tracing::warn!(error = %e, "Kafka reported an error while reading; continuing");
            }
        }
    }
    // Nothing is fetched between batches.
    if let Err(e) = consumer.unassign() {
        tracing::debug!(error = %e, "dropping the assignment after a read failed");
    }
    Ok(batch)
}

fn offset(value: i64) -> Offset {
    Offset::new(value).unwrap_or(Offset::ZERO)
}

fn kafka_error(what: &str, tp: &TopicPartition, source: KafkaError) -> KafkaSourceError {
    KafkaSourceError::Kafka {
        what: format!("{what} {tp}"),
        source: Box::new(source),
    }
}

/// Marks a partition done. It is not paused: pausing and resuming partitions
/// between batches left one of them never fetching again under load (`cargo xtask
/// bench`, 1 of about 100 batches), so the read filters out what a finished
/// partition still delivers, and the assignment is dropped when the read ends.
fn finish(p: &mut Pending, remaining: &mut usize) {
    p.done = true;
    *remaining -= 1;
}

/// Advances each unfinished partition to the consumer's position, which moves
/// past transaction markers and aborted records. Returns whether any moved.
fn sync_positions(
    consumer: &rdkafka::consumer::BaseConsumer<crate::SourceContext>,
    pending: &mut [Pending],
    remaining: &mut usize,
) -> Result<bool, KafkaSourceError> {
    let positions = consumer
        .position()
        .map_err(|source| KafkaSourceError::Kafka {
            what: "reading consumer positions".to_owned(),
            source: Box::new(source),
        })?;
    let mut moved = false;
    for elem in positions.elements() {
        let KafkaOffset::Offset(position) = elem.offset() else {
            continue;
        };
        let Some(p) = pending
            .iter_mut()
            .find(|p| !p.done && p.partition == elem.partition() && *p.topic == *elem.topic())
        else {
            continue;
        };
        if position > p.next {
            p.next = position.min(p.until);
            moved = true;
        }
        if position >= p.until {
            finish(p, remaining);
        }
    }
    Ok(moved)
}

/// The data loss behind an out-of-range error, found by comparing each unfinished
/// partition's next offset with its watermarks now.
fn out_of_range(client: &Client, pending: &[Pending]) -> Result<Vec<DataLoss>, KafkaSourceError> {
    let unfinished: Vec<&Pending> = pending.iter().filter(|p| !p.done).collect();
    let partitions = unfinished.iter().map(|p| p.topic_partition()).collect();
    let earliest = client.list_offsets(&partitions, Position::Earliest)?;
    let latest = client.list_offsets(&partitions, Position::Latest)?;
    Ok(unfinished
        .into_iter()
        .filter_map(|p| {
            let tp = p.topic_partition();
            let marks = match (
                earliest.get(&tp).copied().flatten(),
                latest.get(&tp).copied().flatten(),
            ) {
                (Some(low), Some(high)) => Some(sluice_offsets::Watermarks {
                    low,
                    high: high.max(low),
                }),
                _ => None,
            };
            classify_data_loss(&tp, Some(offset(p.next)), marks)
        })
        .collect())
}

/// Continues a partition after tolerated loss: from the earliest offset still
/// there, or not at all when nothing of its range is left.
fn skip_past(
    pending: &mut [Pending],
    index: &HashMap<Arc<str>, HashMap<i32, usize>>,
    loss: &DataLoss,
    remaining: &mut usize,
) {
    let tp = loss.topic_partition();
    let Some(&i) = index
        .get(tp.topic.as_str())
        .and_then(|ps| ps.get(&tp.partition))
    else {
        return;
    };
    let p = &mut pending[i];
    match (loss, loss.resume_at()) {
        (DataLoss::Purged { .. }, Some(resume)) if resume.value() < p.until => {
            p.next = resume.value();
        }
        _ => finish(p, remaining),
    }
}

/// Assigns every unfinished partition again at its next offset. After an
/// out-of-range error librdkafka keeps the partition in an error state that a
/// seek cannot leave; a fresh assignment restarts its fetcher.
fn reassign(client: &Client, pending: &[Pending]) -> Result<(), KafkaSourceError> {
    let mut assignment = TopicPartitionList::new();
    for p in pending.iter().filter(|p| !p.done) {
        assignment
            .add_partition_offset(&p.topic, p.partition, KafkaOffset::Offset(p.next))
            .map_err(|source| kafka_error("assigning", &p.topic_partition(), source))?;
    }
    client
        .consumer
        .assign(&assignment)
        .map_err(|source| KafkaSourceError::Kafka {
            what: "assigning partitions again after data loss".to_owned(),
            source: Box::new(source),
        })
}

fn to_record<M: Message>(message: &M, topic: &Arc<str>, include_headers: bool) -> Record {
    let (timestamp_ms, timestamp_type) = match message.timestamp() {
        Timestamp::NotAvailable => (None, TimestampType::NotAvailable),
        Timestamp::CreateTime(ms) => (Some(ms), TimestampType::CreateTime),
        Timestamp::LogAppendTime(ms) => (Some(ms), TimestampType::LogAppendTime),
    };
    let headers = match (include_headers, message.headers()) {
        (true, Some(headers)) => (0..headers.count())
            .map(|i| {
                let header = headers.get(i);
                Header {
                    key: header.key.to_owned(),
                    value: header.value.map(<[u8]>::to_vec),
                }
            })
            .collect(),
        _ => Vec::new(),
    };
    Record {
        topic: topic.clone(),
        partition: message.partition(),
        offset: offset(message.offset()),
        timestamp_ms,
        timestamp_type,
        key: message.key().map(<[u8]>::to_vec),
        value: message.payload().map(<[u8]>::to_vec),
        headers,
    }
}
