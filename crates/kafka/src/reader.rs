//! Reading planned offset ranges, with a read-ahead of bounded size.
//!
//! One thread per source owns the reading consumer for as long as the source
//! lives. It keeps every partition of the last plan assigned and reads ahead of
//! the plans, so that the next batch, which starts where this one ended, finds
//! its records waiting. What it has read ahead waits in a buffer per partition,
//! copied out of librdkafka at once.
//!
//! # Why the read-ahead is ours
//!
//! librdkafka keeps about 300 bytes of bookkeeping per queued message, and a
//! fetched response stays in memory until its last message is polled. A broker
//! answers every partition of a fetch with at least one whole record batch
//! (KIP-74), whatever `max.partition.fetch.bytes` says. So with many partitions
//! and small batches, which take a few records of each partition at a time,
//! leaving the rest in librdkafka's queues held the whole topic in memory, four
//! times over: 876 MiB for 200 MB of records over 1,024 partitions at 10,000
//! records per trigger (heaptrack: 604 MiB of it in `rd_kafka_op_new_fetch_msg`).
//!
//! Instead, every partition that is fetching is polled as soon as messages
//! arrive. A record the current read wants goes into its chunk; any other goes
//! into the partition's buffer. Once a buffer holds its share of
//! [`crate::KafkaSourceConfig::read_ahead_bytes`], the partition is no longer
//! polled and is paused, which stops its fetching and makes librdkafka drop what
//! it still queued for it; it resumes once the buffer has drained to half.
//! Nothing polled is ever dropped, so librdkafka resumes right after the last
//! buffered record. While the batch's reader is behind, what the batch itself
//! wants waits in the partition's buffer too, within the same share.
//!
//! A queue is taken in one call ([`crate::batch_queue`]), not a message per
//! call, and past the buffer's share by up to two fetch shares: what a pause
//! drops is fetched again, and a fetch brings a partition whole record batches,
//! so a buffer that took only what fitted its share had the broker send much of
//! the topic twice. librdkafka moves the partition's position past every message
//! it returns, errors included, and a pause resumes from there: so the
//! end-of-partition event is off, and a partition that reports any other error
//! is assigned afresh at its next offset.
//!
//! A fetch brings a partition whole record batches, and librdkafka's producers
//! write batches of up to 1,000,000 bytes: over 1,024 partitions, far more than
//! a share. What a partition had queued past its share is kept within its
//! part of [`crate::KafkaSourceConfig::read_memory_bytes`] (an equal part, from
//! half to all of it, spread over the partitions) while all the buffers
//! together hold less than that; past that it is dropped at the pause and
//! fetched again (the progress report's read amplification says
//! how often), and a warning says so at most once a minute.
//!
//! So memory is bounded by configuration: the read memory, librdkafka's queue
//! limits (an eighth of a share per partition), what one fetch brings a
//! partition while the reading thread is behind, and the fetch in flight
//! (`fetch.max.bytes`). What a fetch in flight at the pause brings is dropped
//! and fetched again.
//!
//! librdkafka does not wake a broker thread that idles for want of fetchable
//! partitions when one of them resumes; the thread sleeps up to a second. After
//! resuming partitions, the reader asks for one of their watermarks, which wakes
//! its leader's thread: a 200-batch read over 1,024 partitions took 27 s without
//! and 5 s with it.
//!
//! Partitions start at explicit offsets by assignment: on their first read, on a
//! read that does not continue (a replay), after an out-of-range offset, and when
//! a read has waited [`STALL`] for one in vain (a guard against librdkafka losing
//! a resumption, as in confluentinc/librdkafka#5591). Assigning and unassigning
//! wait for librdkafka's main thread, about 0.5 ms a call, so a thread of their
//! own makes them ([`Assigner`]). A partition being unassigned is not polled until
//! librdkafka confirms, as until then what it queued still looks current.
//!
//! A partition is done when its next offset reaches its range's end. librdkafka
//! moves a partition's position past transaction markers and aborted records,
//! which are never delivered, and the reader takes that position when the
//! partition has nothing queued, so such offsets never stall a read.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset as KafkaOffset, Timestamp, TopicPartitionList};
use sluice_core::{
    DataLoss, Offset, OffsetRange, RecordChunk, RecordParts, TimestampType, TopicPartition,
    classify_data_loss,
};
use tokio::sync::mpsc::{self, error::TrySendError};

use crate::batch_queue::BatchQueue;
use crate::client::{Client, Position};
use crate::{KafkaError, SourceContext};

// Parts of the reading thread's work, each over its state.
mod buffer;
mod fetched;
mod loss;
mod plan;
mod poll;
mod sizing;

use buffer::Buffer;
pub(crate) use fetched::Latest;

/// How long the reading thread sleeps when nothing happens, before it checks
/// positions and the read's timeout again.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// A chunk is handed over once it holds this many bytes of keys and values...
pub(crate) const CHUNK_BYTES: usize = 128 * 1024;
/// ...or this many records.
pub(crate) const CHUNK_RECORDS: usize = 1024;

/// The most messages taken from one partition queue before the next partition's
/// turn, so that every partition moves on.
const BURST: usize = 1024;

/// How long a read waits for a partition that delivers nothing before that
/// partition is assigned afresh at its next offset. Plans name only offsets
/// that exist, so a partition a read waits for should be delivering.
const STALL: Duration = Duration::from_secs(2);

/// What the reading thread sends to the batch's reader.
pub(crate) enum Event {
    /// The next records.
    Chunk(RecordChunk),
    /// Every range is read; with the data loss tolerated on the way.
    Done(Vec<DataLoss>),
}

/// The sending half of a read.
pub(crate) type Events = mpsc::Sender<Result<Event, KafkaError>>;

/// One partition's own message queue.
type Queue = PartitionQueue<SourceContext>;

/// A partition's own queue, through two handles: rdkafka's, which keeps it
/// apart from the consumer's queue and tells when it fills, and one that takes
/// its messages many at a time.
struct PartQueue {
    split: Queue,
    batch: BatchQueue,
    /// Set when librdkafka queued messages since the queue was last polled empty.
    ready: Arc<AtomicBool>,
}

/// A partition, by topic and number.
type Key = (Arc<str>, i32);

/// The reading thread, seen from the source. Dropping it stops the thread.
pub(crate) struct ReadingThread {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What the source and the reading thread share.
pub(crate) struct Shared {
    /// Wakes the thread: librdkafka queued messages, a chunk was taken, a read
    /// was asked for, an assignment changed, or the source is going away.
    pub(crate) signal: Signal,
    /// The read asked for and not yet begun; a newer one replaces it.
    request: Mutex<Option<(Vec<OffsetRange>, Events)>>,
    /// Changes of the assignment that the [`Assigner`] made.
    changed: Mutex<Vec<Result<Change, KafkaError>>>,
    stop: AtomicBool,
    /// How many reads began afresh instead of continuing where the last ended.
    pub(crate) assignments: AtomicU64,
    /// How many times a partition was paused because its buffer was full.
    pub(crate) pauses: AtomicU64,
    /// The consumer's latest statistics.
    pub(crate) statistics: Arc<fetched::Latest>,
    /// The read amplification as of the latest statistics.
    pub(crate) amplification: Mutex<Option<sluice_core::ReadAmplification>>,
    /// The fetch size per partition learned from the record batches; 0 until
    /// learned.
    pub(crate) learned_fetch_bytes: AtomicU64,
}

impl ReadingThread {
    /// Starts the reading thread; it creates its consumer at the first read.
    pub(crate) fn start(client: Arc<Client>) -> Result<ReadingThread, KafkaError> {
        let shared = Arc::new(Shared {
            signal: Signal::default(),
            request: Mutex::new(None),
            changed: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            assignments: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
            statistics: Arc::default(),
            amplification: Mutex::new(None),
            learned_fetch_bytes: AtomicU64::new(0),
        });
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-reader".to_owned())
            .spawn(move || run(client, thread_shared))
            .map_err(|e| KafkaError::Task(format!("starting the reading thread: {e}")))?;
        Ok(ReadingThread {
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for `ranges` to be read into `events`. A read still in progress is
    /// abandoned.
    pub(crate) fn read(&self, ranges: Vec<OffsetRange>, events: Events) {
        *lock(&self.shared.request) = Some((ranges, events));
        self.shared.signal.notify();
    }

    /// What the thread shares with the readers of batches.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for ReadingThread {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.signal.notify();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakes the reading thread.
#[derive(Default)]
pub(crate) struct Signal {
    ready: Mutex<bool>,
    changed: Condvar,
}

impl Signal {
    pub(crate) fn notify(&self) {
        *lock(&self.ready) = true;
        self.changed.notify_one();
    }

    /// Forgets earlier notifications; called before the thread looks at its
    /// queues, so that anything arriving after the look is never missed.
    fn reset(&self) {
        *lock(&self.ready) = false;
    }

    fn wait(&self, timeout: Duration) {
        let ready = lock(&self.ready);
        let _unused = self
            .changed
            .wait_timeout_while(ready, timeout, |ready| !*ready)
            .unwrap_or_else(PoisonError::into_inner);
    }
}

fn run(client: Arc<Client>, shared: Arc<Shared>) {
    let mut reading = ReaderState::new(client, shared.clone());
    while !shared.stop.load(Ordering::Relaxed) {
        shared.signal.reset();
        let request = lock(&shared.request).take();
        if let Some((ranges, events)) = request {
            reading.begin(ranges, events);
        }
        if !reading.step() {
            reading.stats.waits += 1;
            shared.signal.wait(POLL_INTERVAL);
        }
    }
}

/// A change of the assignment, made by the [`Assigner`].
pub(crate) enum Change {
    /// These partitions are assigned at these offsets.
    Assign(Vec<(Key, i64)>),
    /// These partitions are unassigned.
    Unassign(Vec<Key>),
    /// A request for this partition's watermarks, made only to wake the
    /// thread of its leader.
    Poke(Key),
}

/// A thread that makes the changes of the assignment the reading thread asks
/// for, in the order asked, and reports each back through [`Shared::changed`].
struct Assigner {
    changes: Option<std::sync::mpsc::Sender<Change>>,
    thread: Option<JoinHandle<()>>,
}

impl Assigner {
    fn start(
        consumer: Arc<BaseConsumer<SourceContext>>,
        shared: Arc<Shared>,
    ) -> Result<Assigner, KafkaError> {
        let (changes, receiver) = std::sync::mpsc::channel::<Change>();
        let thread = std::thread::Builder::new()
            .name("sluice-assigner".to_owned())
            .spawn(move || {
                while let Ok(change) = receiver.recv() {
                    let done = apply(&consumer, change);
                    lock(&shared.changed).push(done);
                    shared.signal.notify();
                }
            })
            .map_err(|e| KafkaError::Task(format!("starting the assigning thread: {e}")))?;
        Ok(Assigner {
            changes: Some(changes),
            thread: Some(thread),
        })
    }

    fn send(&self, change: Change) {
        if let Some(changes) = &self.changes {
            // The thread only ends when this sender is dropped.
            let _ = changes.send(change);
        }
    }
}

impl Drop for Assigner {
    fn drop(&mut self) {
        self.changes = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Makes one change of the assignment.
fn apply(consumer: &BaseConsumer<SourceContext>, change: Change) -> Result<Change, KafkaError> {
    let mut list = TopicPartitionList::new();
    match &change {
        Change::Assign(parts) => {
            for ((topic, partition), next) in parts {
                list.add_partition_offset(topic, *partition, KafkaOffset::Offset(*next))
                    .map_err(|source| KafkaError::Kafka {
                        what: format!("assigning {topic}-{partition} at {next}"),
                        source: Box::new(source),
                    })?;
            }
            consumer
                .incremental_assign(&list)
                .map_err(|source| KafkaError::Kafka {
                    what: format!("assigning {} partitions", list.count()),
                    source: Box::new(source),
                })?;
        }
        Change::Poke((topic, partition)) => {
            // Only the request matters, not what it finds.
            let _ = consumer.fetch_watermarks(topic, *partition, Duration::from_secs(5));
        }
        Change::Unassign(parts) => {
            for (topic, partition) in parts {
                list.add_partition(topic, *partition);
            }
            consumer
                .incremental_unassign(&list)
                .map_err(|source| KafkaError::Kafka {
                    what: format!("unassigning {} partitions", list.count()),
                    source: Box::new(source),
                })?;
        }
    }
    Ok(change)
}

/// Where a partition stands with librdkafka.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fetch {
    /// Not assigned, and its queue holds nothing current.
    Idle,
    /// Assigned, or being assigned, at `next`: its queue is polled.
    Fetching,
    /// Assigned and paused, because its buffer is full: nothing is fetched, and
    /// its queue holds nothing current.
    Paused,
    /// Being unassigned: its queue is not polled until librdkafka confirms, as
    /// until then what it queued still looks current.
    Stopping,
}

/// One partition the reader knows, from the last plan.
struct Part {
    topic: Arc<str>,
    partition: i32,
    fetch: Fetch,
    /// Where the next read must start to continue: the first offset not yet
    /// handed to a read. Buffered records lie at or after it.
    start: i64,
    /// The offset after the last one fetched: where fetching goes on.
    next: i64,
    buffer: Buffer,
    /// The buffer holds its share: the partition is not polled, and is to stop
    /// fetching.
    full: bool,
    /// librdkafka found `next` out of range; what was lost is judged when a read
    /// needs the partition.
    out_of_range: bool,
    /// When the partition last delivered a message, or was assigned.
    last_message: Instant,
    /// The index of this partition's range in the read in progress.
    range: Option<usize>,
    /// Bytes of keys and values of the messages taken from librdkafka, and of
    /// those taken when the latest statistics came.
    taken: u64,
    taken_counted: u64,
    /// Bytes of keys and values of taken messages that were dropped unread
    /// (the buffer discarded for a new plan, or with the consumer), and of
    /// those kept, as counted in the read amplification so far.
    discarded: u64,
    kept_counted: u64,
    /// Bytes taken since its queue was last found empty.
    run: usize,
}

impl Part {
    fn new(topic: Arc<str>, partition: i32) -> Part {
        Part {
            topic,
            partition,
            fetch: Fetch::Idle,
            start: 0,
            next: 0,
            buffer: Buffer::default(),
            full: false,
            out_of_range: false,
            last_message: Instant::now(),
            range: None,
            taken: 0,
            taken_counted: 0,
            discarded: 0,
            kept_counted: 0,
            run: 0,
        }
    }

    /// Drops what the buffer holds, counting it as discarded.
    fn discard_buffer(&mut self) {
        self.discarded += self.buffer.data_bytes;
        self.buffer.clear();
    }

    fn key(&self) -> Key {
        (self.topic.clone(), self.partition)
    }

    fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.as_ref(), self.partition)
    }

    fn is(&self, tp: &TopicPartition) -> bool {
        self.partition == tp.partition && *self.topic == *tp.topic
    }
}

/// What the reading thread owns: its consumer, partitions, queues and read.
struct ReaderState {
    client: Arc<Client>,
    shared: Arc<Shared>,
    consumer: Option<Arc<BaseConsumer<SourceContext>>>,
    assigner: Option<Assigner>,
    parts: Vec<Part>,
    /// Per entry of `parts`, its queue, and whether librdkafka queued messages
    /// there since the queue was last polled empty.
    queues: Vec<PartQueue>,
    by_name: HashMap<Key, usize>,
    /// Unassignments asked for and not yet made, per partition; a partition
    /// is not assigned again before they are.
    stopping: HashMap<Key, usize>,
    /// A poke of a broker thread is on its way.
    poking: bool,
    /// A partition resumed since the last poke was sent: one more is due.
    poke: Option<Key>,
    read: Option<BatchRead>,
    /// When positions and the timeout were last looked at.
    last_idle_check: Instant,
    /// Bytes fetched and read per partition, for the read amplification.
    tally: fetched::Tally,
    /// When the read memory was last reported full.
    last_cut_report: Option<Instant>,
    /// The record batches' size as the partitions showed it, and the fetch
    /// size learned from it.
    sizing: sizing::Sizing,
    stats: Stats,
}

/// What the reading thread did, for its debug log line after every read.
#[derive(Debug, Default)]
struct Stats {
    /// Messages polled from librdkafka.
    polled: u64,
    /// Messages still queued at a pause, dropped to be fetched again (those of
    /// fetches the pause outdated librdkafka drops itself, unseen).
    dropped: u64,
    /// Partitions unassigned to start over.
    stopped: u64,
    /// Partitions paused for a full buffer, and resumed.
    paused: u64,
    resumed: u64,
    /// Partitions assigned at their next offsets.
    assigned: u64,
    /// Times a full partition's queued records were left to be dropped and
    /// fetched again because the read memory was full.
    cut: u64,
    /// Partitions assigned afresh because a read waited for them in vain.
    stalled: u64,
    /// Times the thread slept for lack of work.
    waits: u64,
}

impl ReaderState {
    fn new(client: Arc<Client>, shared: Arc<Shared>) -> ReaderState {
        ReaderState {
            client,
            shared,
            consumer: None,
            assigner: None,
            parts: Vec::new(),
            queues: Vec::new(),
            by_name: HashMap::new(),
            stopping: HashMap::new(),
            poking: false,
            poke: None,
            read: None,
            last_idle_check: Instant::now(),
            tally: fetched::Tally::default(),
            last_cut_report: None,
            sizing: sizing::Sizing::default(),
            stats: Stats::default(),
        }
    }

    /// Each partition's share of the read-ahead, in bytes.
    fn share(&self) -> usize {
        share_of(self.client.config.read_ahead_bytes, self.parts.len())
    }

    /// The consumer, created at the first read for `partitions` partitions.
    fn consumer(
        &mut self,
        partitions: usize,
    ) -> Result<Arc<BaseConsumer<SourceContext>>, KafkaError> {
        if let Some(consumer) = &self.consumer {
            return Ok(consumer.clone());
        }
        let consumer = Arc::new(create_consumer(
            &self.client,
            partitions,
            self.sizing.learned,
            self.shared.statistics.clone(),
        )?);
        self.assigner = Some(Assigner::start(consumer.clone(), self.shared.clone())?);
        self.consumer = Some(consumer.clone());
        Ok(consumer)
    }

    /// Does what there is to do. Returns false when there was nothing, so that
    /// the thread may sleep.
    fn step(&mut self) -> bool {
        let Some(consumer) = self.consumer.clone() else {
            return false;
        };
        if let Err(e) = self.take_changes() {
            self.fail(e);
            return true;
        }
        let mut busy = self.hand_over();
        busy |= self.take_buffered();
        busy |= self.poll_queues(&consumer);
        self.resize_fetches();
        busy |= self.hand_over();
        if let Some(read) = &mut self.read
            && std::mem::take(&mut read.progressed)
        {
            read.last_progress = Instant::now();
        }
        self.flow();
        // Also under load, as other partitions may keep the thread busy while the
        // ones a read waits for give nothing.
        if self.read.is_some() && (!busy || self.last_idle_check.elapsed() > POLL_INTERVAL) {
            self.last_idle_check = Instant::now();
            if let Err(e) = self.when_idle(&consumer) {
                self.fail(e);
                return true;
            }
        }
        busy | self.complete()
    }

    /// Ends the read in progress with `error`. Its partitions start over at the
    /// next read, as their place is uncertain.
    fn fail(&mut self, error: KafkaError) {
        if let Some(read) = self.read.take() {
            let _ = read.events.try_send(Err(error));
        }
        self.forget_all();
    }

    /// Forgets every partition, so that the next read starts afresh.
    fn forget_all(&mut self) {
        for part in &mut self.parts {
            part.discard_buffer();
        }
        self.tally.settle(&mut self.parts);
        let fetching = self
            .parts
            .iter()
            .filter(|p| matches!(p.fetch, Fetch::Fetching | Fetch::Paused))
            .map(|p| (p.key(), p.fetch == Fetch::Paused))
            .collect();
        self.unassign(fetching);
        self.parts.clear();
        self.queues.clear();
        self.by_name.clear();
    }

    /// Hands the full chunk over if the channel has room. Returns whether it did.
    fn hand_over(&mut self) -> bool {
        hand_over(&mut self.read)
    }

    /// Moves buffered records into the read's chunk. Returns whether any moved.
    fn take_buffered(&mut self) -> bool {
        let Some(read) = &mut self.read else {
            return false;
        };
        let BatchRead {
            ranges,
            remaining,
            out,
            progressed,
            ..
        } = read;
        let mut moved = false;
        for range in ranges.iter_mut().filter(|r| !r.done) {
            let part = &mut self.parts[range.part];
            while !range.done {
                if finish_if_complete(range, part, remaining) {
                    moved = true;
                    break;
                }
                if !out.has_room() {
                    out.seal();
                    if !out.has_room() {
                        return moved;
                    }
                }
                let Some(taken) = part
                    .buffer
                    .pop_into(&mut out.chunk, &part.topic, part.partition)
                else {
                    break;
                };
                part.start = taken.offset + 1;
                moved = true;
            }
        }
        *progressed |= moved;
        moved
    }

    /// Ends the read once every range is done and every chunk handed over.
    /// Returns whether it did.
    fn complete(&mut self) -> bool {
        let Some(read) = &mut self.read else {
            return false;
        };
        if read.remaining > 0 {
            return false;
        }
        if !read.out.chunk.is_empty() && read.out.ready.is_none() {
            read.out.ready = Some(std::mem::replace(&mut read.out.chunk, new_chunk()));
        }
        if read.out.ready.is_some() {
            self.hand_over();
            return false;
        }
        let Some(read) = self.read.take() else {
            return false;
        };
        let losses = read.losses;
        match read.events.try_send(Ok(Event::Done(losses))) {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(done)) => {
                // Chunks are still waiting to be taken: try again then.
                let Ok(Event::Done(losses)) = done else {
                    return false;
                };
                self.read = Some(BatchRead { losses, ..read });
                return false;
            }
        }
        for part in &mut self.parts {
            part.range = None;
        }
        let buffered: usize = self.parts.iter().map(|p| p.buffer.bytes).sum();
        tracing::debug!(stats = ?self.stats, buffered, "read done");
        true
    }
}

/// One range of the read in progress.
struct Range {
    part: usize,
    from: i64,
    until: i64,
    done: bool,
}

/// The read of one batch's ranges, in progress.
struct BatchRead {
    events: Events,
    ranges: Vec<Range>,
    remaining: usize,
    out: Out,
    losses: Vec<DataLoss>,
    last_progress: Instant,
    /// Records moved since `last_progress` was last set: reading the clock per
    /// record cost 9% of a read.
    progressed: bool,
}

/// The chunks of a read on their way out.
struct Out {
    /// Being filled.
    chunk: RecordChunk,
    /// Full, waiting for room in the channel.
    ready: Option<RecordChunk>,
}

impl Out {
    fn has_room(&self) -> bool {
        self.chunk.len() < CHUNK_RECORDS && self.chunk.byte_len() < CHUNK_BYTES
    }

    /// Moves a full chunk to the hand-over slot, if that is free.
    fn seal(&mut self) {
        if !self.has_room() && self.ready.is_none() {
            self.ready = Some(std::mem::replace(&mut self.chunk, new_chunk()));
        }
    }
}

fn new_chunk() -> RecordChunk {
    RecordChunk::with_capacity(CHUNK_RECORDS, CHUNK_BYTES + 16 * 1024)
}

/// Marks `range` done when its partition has nothing more to give it: the
/// partition's next offset reached the range's end, or its first buffered
/// record lies beyond it. Returns whether it did.
fn finish_if_complete(range: &mut Range, part: &mut Part, remaining: &mut usize) -> bool {
    if range.done {
        return false;
    }
    let complete = part.start >= range.until
        || part
            .buffer
            .front_offset()
            .is_some_and(|at| at >= range.until)
        || (part.buffer.is_empty() && part.next >= range.until);
    if complete {
        range.done = true;
        part.start = part.start.max(range.until);
        *remaining -= 1;
    }
    complete
}

/// Whether `ranges` continue the partitions of `parts`, one for one and in the
/// same order, each from where its partition stands.
fn continues(parts: &[Part], ranges: &[OffsetRange]) -> bool {
    parts.len() == ranges.len()
        && parts
            .iter()
            .zip(ranges)
            .all(|(p, r)| p.is(&r.topic_partition) && p.start == r.from.value())
}

/// Hands the read's full chunk over if the channel has room, and forgets a read
/// nobody reads any more. Returns whether it did either.
fn hand_over(slot: &mut Option<BatchRead>) -> bool {
    let Some(read) = slot else {
        return false;
    };
    read.out.seal();
    let Some(chunk) = read.out.ready.take() else {
        return false;
    };
    match read.events.try_send(Ok(Event::Chunk(chunk))) {
        Ok(()) => {
            read.out.seal();
            true
        }
        Err(TrySendError::Full(Ok(Event::Chunk(chunk)))) => {
            read.out.ready = Some(chunk);
            false
        }
        Err(_) => {
            // Nobody reads this batch any more.
            *slot = None;
            true
        }
    }
}

/// Takes one polled message of `part`: into the read's chunk when the read
/// wants it next, else into the partition's buffer, which is then full if it
/// holds its `share`.
fn take<M: Message>(
    part: &mut Part,
    read: Option<&mut BatchRead>,
    message: &M,
    include_headers: bool,
    share: usize,
) {
    let at = message.offset();
    if at < part.next {
        return;
    }
    let bytes = message.key().map_or(0, <[u8]>::len) + message.payload().map_or(0, <[u8]>::len);
    part.taken += bytes as u64;
    if let (Some(read), Some(r)) = (read, part.range) {
        let BatchRead {
            ranges,
            remaining,
            out,
            progressed,
            ..
        } = read;
        let range = &mut ranges[r];
        if !range.done && part.buffer.is_empty() {
            if at >= range.until {
                // Transaction markers or aborted records took the range's last
                // offsets.
                part.start = part.start.max(range.until);
                finish_if_complete(range, part, remaining);
            } else if out.has_room() {
                push(&mut out.chunk, message, &part.topic, include_headers);
                part.next = at + 1;
                part.start = at + 1;
                finish_if_complete(range, part, remaining);
                *progressed = true;
                out.seal();
                return;
            }
        }
    }
    part.buffer.push(message, include_headers, share);
    part.next = at + 1;
    part.full = part.buffer.bytes >= share;
}

/// The most a partition holds ahead of the batches: two of librdkafka's
/// 1 MiB fetches. Few partitions would otherwise each hold megabytes that no
/// batch needs sooner; a query slower than the reads (SQL over JSON) keeps
/// every share full, and with 8 partitions and 32 MiB, 4 MiB each made its peak
/// RSS 131-135 MiB against 122-123 MiB with 2 MiB, at the same speed.
const MAX_SHARE_BYTES: usize = 2 * 1024 * 1024;

/// The least a fetch asks of a partition: one of the Java producer's record
/// batches (`batch.size` 16 KiB).
const MIN_PARTITION_FETCH_BYTES: usize = 16 * 1024;

/// Each of `partitions` partitions' share of `read_ahead_bytes`.
fn share_of(read_ahead_bytes: usize, partitions: usize) -> usize {
    (read_ahead_bytes / partitions.max(1)).min(MAX_SHARE_BYTES)
}

/// What a fetch asks of each of `partitions` partitions: the configuration's
/// `max.partition.fetch.bytes`, or the default explained in [`create_consumer`].
fn partition_fetch_bytes(client: &Client, partitions: usize) -> usize {
    let configured = client
        .config
        .client_options
        .get("max.partition.fetch.bytes")
        .and_then(|v| v.trim().parse().ok());
    configured.unwrap_or_else(|| {
        let share = share_of(client.config.read_ahead_bytes, partitions);
        (client.config.fetch_max_bytes() / partitions.max(1))
            .min(share / 2)
            .clamp(MIN_PARTITION_FETCH_BYTES, 1024 * 1024)
    })
}

/// A consumer for reading `partitions` partitions, each with a queue of its own.
/// librdkafka's limits apply per partition queue, so they are shared out; they
/// matter only while the thread is busy elsewhere, as it takes every message as
/// soon as it arrives.
fn create_consumer(
    client: &Client,
    partitions: usize,
    learned_fetch_bytes: Option<usize>,
    statistics: Arc<fetched::Latest>,
) -> Result<BaseConsumer<SourceContext>, KafkaError> {
    let mut config = client.reader_config.clone();
    let options = &client.config.client_options;
    let share = share_of(client.config.read_ahead_bytes, partitions);
    // What librdkafka queues costs about four times what the buffers cost (its
    // bookkeeping per message), and the reading thread takes it at once, so its
    // queues stay short: an eighth of a share each, at most 512 KiB.
    if !options.contains_key("queued.max.messages.kbytes") {
        let kbytes = (share / 8 / 1024).clamp(1, 512);
        config.set("queued.max.messages.kbytes", kbytes.to_string());
    }
    // A fetch brings each partition up to `max.partition.fetch.bytes`. What a
    // partition had queued when its buffer filled is kept beyond its share, and
    // while the reading thread is behind, as much waits in librdkafka's queue, at
    // about three times the bytes. With librdkafka's 1 MiB, 1,024 partitions at
    // 10,000 records per trigger read 2,000,000 records in 12.9 s (its broker
    // thread parsed about thirty times what was kept, when what did not fit was
    // dropped), and 256 partitions in one batch peaked at 148-165 MiB. So a fetch
    // asks each partition for its part of one whole fetch (`fetch.max.bytes`),
    // and for no more than half its share, which is the room it has when it
    // resumes; at least one of the Java producer's 16 KiB record batches. A
    // larger record batch still arrives: librdkafka doubles a partition's limit
    // when a fetch brought it nothing whole.
    if !options.contains_key("statistics.interval.ms") {
        config.set("statistics.interval.ms", fetched::STATISTICS_INTERVAL_MS);
    }
    if !options.contains_key("max.partition.fetch.bytes") {
        let bytes =
            learned_fetch_bytes.unwrap_or_else(|| partition_fetch_bytes(client, partitions));
        config.set("max.partition.fetch.bytes", bytes.to_string());
    }
    config
        .create_with_context(SourceContext {
            refusals: client.refusals.clone(),
            statistics: Some(statistics),
        })
        .map_err(|source| KafkaError::Client {
            bootstrap: client.config.bootstrap_servers.clone(),
            source: Box::new(source),
        })
}

fn offset(value: i64) -> Offset {
    Offset::new(value).unwrap_or(Offset::ZERO)
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
