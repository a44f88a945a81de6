//! Reading exactly the records of planned offset ranges.
//!
//! All ranges are read by one consumer at once: librdkafka fetches every assigned
//! partition in parallel, from each partition's leader. A partition is done when
//! its consumer position reaches the range's end. The position, not the last
//! record, decides, because transaction markers and aborted records take offsets
//! that are never delivered.
//!
//! Records are copied into [`RecordChunk`]s and handed over a bounded channel as
//! they arrive, so memory holds a few chunks and librdkafka's prefetch queue, never
//! a whole batch.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset as KafkaOffset, Timestamp, TopicPartitionList};
use sluice_offsets::{
    DataLoss, Offset, OffsetRange, RecordChunk, RecordParts, TimestampType, TopicPartition,
    classify_data_loss,
};
use tokio::sync::mpsc;

use crate::client::{Client, Position};
use crate::{KafkaSourceError, SourceContext};

/// How long one poll waits before the reader checks positions and its timeout.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// A chunk is handed over once it holds this many bytes of keys and values...
pub(crate) const CHUNK_BYTES: usize = 128 * 1024;
/// ...or this many records.
pub(crate) const CHUNK_RECORDS: usize = 1024;

/// What the reading thread sends to the batch's reader.
pub(crate) enum Event {
    /// The next records.
    Chunk(RecordChunk),
    /// Every range is read; with the data loss tolerated on the way.
    Done(Vec<DataLoss>),
}

/// The sending half of a read.
pub(crate) type Events = mpsc::Sender<Result<Event, KafkaSourceError>>;

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

/// Finds a message's pending range by topic and partition number, without
/// hashing: a query reads a few topics, and partition numbers are small.
struct Index {
    topics: Vec<(Arc<str>, Vec<Option<usize>>)>,
}

impl Index {
    fn new(pending: &[Pending]) -> Index {
        let mut topics: Vec<(Arc<str>, Vec<Option<usize>>)> = Vec::new();
        for (i, p) in pending.iter().enumerate() {
            let slot = match topics.iter().position(|(t, _)| *t == p.topic) {
                Some(slot) => slot,
                None => {
                    topics.push((p.topic.clone(), Vec::new()));
                    topics.len() - 1
                }
            };
            let partitions = &mut topics[slot].1;
            let n = usize::try_from(p.partition).unwrap_or(0);
            if partitions.len() <= n {
                partitions.resize(n + 1, None);
            }
            partitions[n] = Some(i);
        }
        Index { topics }
    }

    fn find<M: Message>(&self, message: &M) -> Option<usize> {
        // The consumer is assigned exactly the indexed partitions, so with one topic
        // the partition number decides, and the topic name (a C string checked for
        // UTF-8 on every call) is not needed.
        let partitions = match self.topics.as_slice() {
            [(_, partitions)] => partitions,
            _ => &self.find_topic(message.topic())?.1,
        };
        *partitions.get(usize::try_from(message.partition()).ok()?)?
    }

    fn find_topic(&self, topic: &str) -> Option<&(Arc<str>, Vec<Option<usize>>)> {
        self.topics.iter().find(|(t, _)| **t == *topic)
    }

    fn find_partition(&self, topic: &str, partition: i32) -> Option<usize> {
        let (_, partitions) = self.find_topic(topic)?;
        *partitions.get(usize::try_from(partition).ok()?)?
    }
}

/// Wakes the reading thread when a partition queue receives messages.
#[derive(Default)]
struct Signal {
    ready: Mutex<bool>,
    changed: Condvar,
}

impl Signal {
    fn notify(&self) {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        *ready = true;
        self.changed.notify_one();
    }

    /// Forgets earlier notifications; called before the queues are polled, so
    /// that a message arriving after the poll is never missed.
    fn reset(&self) {
        *self.ready.lock().unwrap_or_else(PoisonError::into_inner) = false;
    }

    fn wait(&self, timeout: Duration) {
        let ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        let _unused = self
            .changed
            .wait_timeout_while(ready, timeout, |ready| !*ready)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

/// One partition's own message queue.
type Queue = PartitionQueue<SourceContext>;

/// What a read leaves for the next one, so that back-to-back batches continue
/// where the last one ended instead of assigning and fetching from scratch.
///
/// Every partition has a queue of its own: the read polls only the partitions
/// whose ranges are unfinished, and what librdkafka prefetched beyond a range's
/// end stays queued (up to `queued.max.messages.kbytes` per partition) for the
/// next batch. With one shared queue, a fetch response enqueues up to
/// `max.partition.fetch.bytes` per partition one partition after another, so a
/// batch of 10,000 records over 8 partitions had to drain about 7 times that much
/// to reach its last partition's records (`cargo xtask bench`).
#[derive(Default)]
pub(crate) struct ReadState {
    /// The consumer that reads, created by the first read.
    consumer: Option<Arc<BaseConsumer<SourceContext>>>,
    /// Each assigned partition with the offset its next range must start at, in
    /// the order of the last plan; empty when nothing is assigned.
    next: Vec<(Arc<str>, i32, i64)>,
    /// Per entry of `next`, its queue.
    queues: Vec<Option<Queue>>,
    /// Per entry of `next`, a record polled beyond the end of its last range.
    carry: Vec<RecordChunk>,
    signal: Arc<Signal>,
}

impl ReadState {
    /// Whether `ranges` continue exactly where the last read ended.
    fn continues(&self, ranges: &[OffsetRange]) -> bool {
        self.next.len() == ranges.len()
            && self
                .next
                .iter()
                .zip(ranges)
                .all(|((topic, partition, next), r)| {
                    **topic == *r.topic_partition.topic
                        && *partition == r.topic_partition.partition
                        && *next == r.from.value()
                })
    }
}

/// Drops the assignment when a read ends in any other way than completely, so
/// that nothing is fetched for a read that will not continue.
struct Assigned<'a> {
    consumer: &'a BaseConsumer<SourceContext>,
    keep: bool,
}

impl Drop for Assigned<'_> {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if let Err(e) = self.consumer.unassign() {
            tracing::debug!(error = %e, "dropping the assignment after a read failed");
        }
    }
}

/// Assigns `pending` at their next offsets and gives each a queue of its own.
/// Partitions that are done get no queue when `all` is false.
fn assign(
    client: &Client,
    consumer: &Arc<BaseConsumer<SourceContext>>,
    pending: &[Pending],
    signal: &Arc<Signal>,
    all: bool,
) -> Result<Vec<Option<Queue>>, KafkaSourceError> {
    client
        .assignments
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let wanted = |p: &Pending| all || !p.done;
    let mut assignment = TopicPartitionList::with_capacity(pending.len());
    for p in pending.iter().filter(|p| wanted(p)) {
        assignment
            .add_partition_offset(&p.topic, p.partition, KafkaOffset::Offset(p.next))
            .map_err(|source| kafka_error("assigning", &p.topic_partition(), source))?;
    }
    consumer
        .assign(&assignment)
        .map_err(|source| KafkaSourceError::Kafka {
            what: format!("assigning {} partitions", assignment.count()),
            source: Box::new(source),
        })?;
    // Split before anything is polled, so that no message of these partitions
    // waits in the consumer's shared queue.
    pending
        .iter()
        .map(|p| {
            if !wanted(p) {
                return Ok(None);
            }
            let mut queue = consumer
                .split_partition_queue(&p.topic, p.partition)
                .ok_or_else(|| KafkaSourceError::Kafka {
                    what: format!("giving {} a queue of its own", p.topic_partition()),
                    source: Box::new(KafkaError::Subscription(
                        "librdkafka has no queue for this partition".to_owned(),
                    )),
                })?;
            let signal = signal.clone();
            queue.set_nonempty_callback(move || signal.notify());
            Ok(Some(queue))
        })
        .collect()
}

/// The most messages taken from one partition queue before the next partition's
/// turn, so that every partition moves on.
const BURST: usize = 1024;

/// Reads `ranges` and sends their records to `events` in chunks. Returns the
/// data loss tolerated on the way, or `None` when the receiver went away and the
/// read was abandoned. `state` carries the assignment from one read to the next.
pub(crate) fn read(
    client: &Client,
    state: &mut ReadState,
    ranges: &[OffsetRange],
    events: &Events,
) -> Result<Option<Vec<DataLoss>>, KafkaSourceError> {
    let mut losses = Vec::new();
    if ranges.is_empty() {
        return Ok(Some(losses));
    }
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
    let consumer = match &state.consumer {
        Some(consumer) => consumer.clone(),
        None => {
            let consumer = Arc::new(client.reader(ranges.len())?);
            state.consumer = Some(consumer.clone());
            consumer
        }
    };
    let signal = state.signal.clone();
    let continues = state.continues(ranges);
    // Until this read ends well, there is nothing to continue from.
    state.next.clear();
    let carried = std::mem::take(&mut state.carry);
    let mut queues = std::mem::take(&mut state.queues);
    let mut assigned = Assigned {
        consumer: &consumer,
        keep: false,
    };
    if !continues {
        drop(queues);
        // Partitions with empty ranges are assigned too, so that they prefetch
        // for the batches to come.
        queues = assign(client, &consumer, &pending, &signal, true)?;
    }

    let index = Index::new(&pending);
    let include_headers = client.config.include_headers;
    let poll_timeout = client.config.poll_timeout;
    let mut chunk = new_chunk();
    let mut carry = vec![RecordChunk::default(); pending.len()];
    let mut reassigned = false;

    // A record the last read polled beyond its range comes first.
    if continues {
        for (i, carried) in carried.iter().enumerate() {
            for record in carried {
                let p = &mut pending[i];
                let at = record.offset().value();
                if at < p.next {
                    continue;
                }
                if !p.done && at < p.until {
                    chunk.push_ref(record);
                    p.next = at + 1;
                    if p.next >= p.until {
                        finish(p, &mut remaining);
                    }
                } else {
                    if !p.done {
                        finish(p, &mut remaining);
                    }
                    carry[i].push_ref(record);
                }
            }
        }
    }
    drop(carried);

    let mut last_progress = Instant::now();
    // Reading the clock for every record cost 9% of a read (perf, `cargo xtask
    // bench`); progress is noted here and timed only when the queues run dry.
    let mut progressed = false;
    while remaining > 0 {
        signal.reset();
        let mut polled = false;
        for i in 0..pending.len() {
            for _ in 0..BURST {
                if pending[i].done {
                    break;
                }
                let Some(queue) = &queues[i] else {
                    break;
                };
                let Some(result) = queue.poll(Duration::ZERO) else {
                    break;
                };
                polled = true;
                match result {
                    Ok(message) => {
                        take(
                            &mut pending[i],
                            &message,
                            &mut chunk,
                            &mut carry[i],
                            include_headers,
                            &mut remaining,
                            &mut progressed,
                        );
                        if full(&chunk) && !send(events, &mut chunk) {
                            return Ok(None);
                        }
                    }
                    Err(KafkaError::PartitionEOF(_)) => break,
                    Err(KafkaError::MessageConsumption(
                        RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange,
                    )) => {
                        // Found by comparing every unfinished partition's position
                        // with the watermarks, as librdkafka may not say which.
                        let found = out_of_range(client, &pending)?;
                        if client.config.fail_on_data_loss && !found.is_empty() {
                            return Err(KafkaSourceError::DataLoss(found));
                        }
                        let skipped = !found.is_empty();
                        for loss in found {
                            skip_past(&mut pending, &index, &loss, &mut remaining);
                            tracing::warn!(
                                lost_offsets = loss.lost_offsets(),
                                "{loss}; skipping ahead because fail_on_data_loss is false"
                            );
                            losses.push(loss);
                        }
                        if skipped && remaining > 0 {
                            // After an out-of-range error librdkafka keeps the
                            // partition in an error state that a seek cannot leave;
                            // a fresh assignment restarts its fetcher.
                            queues = assign(client, &consumer, &pending, &signal, false)?;
                            reassigned = true;
                        }
                        last_progress = Instant::now();
                        break;
                    }
                    Err(e) => {
                        // librdkafka retries transient broker errors itself and
                        // reports them here too; the poll timeout catches a read
                        // that never recovers.
                        tracing::warn!(error = %e, "Kafka reported an error while reading; continuing");
                        break;
                    }
                }
            }
        }
        // The shared queue serves librdkafka's callbacks; messages of these
        // partitions only arrive there if they were queued before the split.
        while let Some(result) = consumer.poll(Duration::ZERO) {
            match result {
                Ok(message) => {
                    if let Some(i) = index.find(&message) {
                        take(
                            &mut pending[i],
                            &message,
                            &mut chunk,
                            &mut carry[i],
                            include_headers,
                            &mut remaining,
                            &mut progressed,
                        );
                        if full(&chunk) && !send(events, &mut chunk) {
                            return Ok(None);
                        }
                    }
                }
                Err(e) => tracing::debug!(error = %e, "Kafka event outside the partition queues"),
            }
        }
        if polled || remaining == 0 {
            continue;
        }
        // Nothing more right now: what is read so far goes on rather than wait.
        if !chunk.is_empty() && !send(events, &mut chunk) {
            return Ok(None);
        }
        if sync_positions(&consumer, &mut pending, &mut remaining)? {
            progressed = true;
        }
        if std::mem::take(&mut progressed) {
            last_progress = Instant::now();
        }
        if remaining > 0 && last_progress.elapsed() > poll_timeout {
            let stuck = pending
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
        if remaining > 0 {
            signal.wait(POLL_INTERVAL);
        }
    }
    if !chunk.is_empty() && !send(events, &mut chunk) {
        return Ok(None);
    }
    if !reassigned && losses.is_empty() {
        state.next = pending
            .iter()
            .map(|p| (p.topic.clone(), p.partition, p.until))
            .collect();
        state.queues = queues;
        state.carry = carry;
        assigned.keep = true;
    }
    Ok(Some(losses))
}

/// Takes one polled message: into the chunk when it lies in its partition's
/// range, into the carry when it lies beyond (a transaction marker took the
/// range's last offsets); duplicates are dropped.
fn take<M: Message>(
    p: &mut Pending,
    message: &M,
    chunk: &mut RecordChunk,
    carry: &mut RecordChunk,
    include_headers: bool,
    remaining: &mut usize,
    progressed: &mut bool,
) {
    let at = message.offset();
    if at < p.next {
        return;
    }
    *progressed = true;
    if !p.done && at < p.until {
        push(chunk, message, &p.topic, include_headers);
        p.next = at + 1;
        if p.next >= p.until {
            finish(p, remaining);
        }
    } else {
        if !p.done {
            finish(p, remaining);
        }
        p.next = at + 1;
        push(carry, message, &p.topic, include_headers);
    }
}

fn full(chunk: &RecordChunk) -> bool {
    chunk.len() >= CHUNK_RECORDS || chunk.byte_len() >= CHUNK_BYTES
}

fn new_chunk() -> RecordChunk {
    RecordChunk::with_capacity(CHUNK_RECORDS, CHUNK_BYTES + 16 * 1024)
}

/// Hands `chunk` over and starts a new one. Returns false when nobody reads any
/// more (the batch was abandoned).
fn send(events: &Events, chunk: &mut RecordChunk) -> bool {
    let full = std::mem::replace(chunk, new_chunk());
    events.blocking_send(Ok(Event::Chunk(full))).is_ok()
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
/// bench`, 1 of about 100 batches). What a finished partition still delivers is
/// kept for the next batch instead.
fn finish(p: &mut Pending, remaining: &mut usize) {
    p.done = true;
    *remaining -= 1;
}

/// Advances each unfinished partition to the consumer's position, which moves
/// past transaction markers and aborted records. Returns whether any moved.
fn sync_positions(
    consumer: &BaseConsumer<SourceContext>,
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
fn skip_past(pending: &mut [Pending], index: &Index, loss: &DataLoss, remaining: &mut usize) {
    let tp = loss.topic_partition();
    let Some(i) = index.find_partition(&tp.topic, tp.partition) else {
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

fn push<M: Message>(chunk: &mut RecordChunk, message: &M, topic: &Arc<str>, include_headers: bool) {
    let (timestamp_ms, timestamp_type) = match message.timestamp() {
        Timestamp::NotAvailable => (None, TimestampType::NotAvailable),
        Timestamp::CreateTime(ms) => (Some(ms), TimestampType::CreateTime),
        Timestamp::LogAppendTime(ms) => (Some(ms), TimestampType::LogAppendTime),
    };
    let parts = RecordParts {
        partition: message.partition(),
        offset: offset(message.offset()),
        timestamp_ms,
        timestamp_type,
        key: message.key(),
        value: message.payload(),
    };
    match include_headers.then(|| message.headers()).flatten() {
        Some(headers) => chunk.push(
            topic,
            parts,
            (0..headers.count()).map(|i| {
                let header = headers.get(i);
                (header.key, header.value)
            }),
        ),
        None => chunk.push(topic, parts, std::iter::empty()),
    }
}
