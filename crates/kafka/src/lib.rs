//! Kafka for Sluice, over `rdkafka`. The source: partition discovery, watermarks,
//! offsets by timestamp, reading planned offset ranges and detecting data loss;
//! and the `kafka` sink ([`KafkaSink`]), which produces to an output topic.
//!
//! It implements the [`Source`] trait of `sluice-core`; the decisions themselves
//! (rate limits, data-loss classification) stay in that crate. Every blocking
//! librdkafka call runs on tokio's blocking pool, off the async worker threads.

mod batch_queue;
mod client;
mod config;
mod describe_group;
mod discovery;
mod error;
mod membership;
mod reader;
mod refusal;
mod sink;
mod sources;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::ConsumerContext;
use sluice_core::{
    BatchReader, DataLoss, MissingCommitted, OffsetBounds, OffsetRange, PartitionOffsets,
    ReadAmplification, RecordChunk, Source, SpecificOffset, StartingOffsets, TimestampFallback,
    TopicPartition,
};

use client::{Client, Position};
pub use config::{
    DEFAULT_READ_AHEAD_BYTES, DEFAULT_READ_MEMORY_BYTES, KafkaSourceConfig, TopicSelection,
    default_fetch_max_bytes, is_secret_option, is_security_option,
};
pub use error::KafkaError;
pub use membership::{GroupConfig, GroupProtocol, KafkaMembership, live_members};
pub use sink::{Delivery, KafkaSink, KafkaSinkConfig};
pub use sources::{KafkaSources, KafkaSourcesReader};

/// Routes librdkafka's own log lines to `tracing`, and keeps the reason of a
/// cluster that refuses the client (see `refusal`).
#[derive(Clone, Default)]
pub struct SourceContext {
    refusals: refusal::Refusals,
    /// For the reading consumer: where its statistics go.
    statistics: Option<Arc<reader::Latest>>,
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        route_log(&self.refusals, level, facility, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        route_error(&self.refusals, &error, reason);
    }

    fn stats_raw(&self, statistics: &[u8]) {
        if let Some(latest) = &self.statistics {
            latest.put(statistics);
        }
    }
}

/// librdkafka's log line to `tracing`, noting a refusal on the way: librdkafka
/// logs a broker's failure from its own threads, while the error callback waits
/// for a poll that a client used only for requests never makes.
pub(crate) fn route_log(
    refusals: &refusal::Refusals,
    level: RDKafkaLogLevel,
    facility: &str,
    message: &str,
) {
    refusals.observe_log(facility, message);
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            tracing::error!(target: "librdkafka", facility, "{message}")
        }
        RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", facility, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", facility, "{message}")
        }
        RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", facility, "{message}"),
    }
}

/// An error librdkafka reports outside any request, to `tracing`.
pub(crate) fn route_error(
    refusals: &refusal::Refusals,
    error: &rdkafka::error::KafkaError,
    reason: &str,
) {
    if refusals.observe(error, reason) {
        tracing::error!(target: "librdkafka", %error, "{reason}");
        return;
    }
    match error {
        // The end of a partition that a finished read no longer watches.
        rdkafka::error::KafkaError::PartitionEOF(_)
        | rdkafka::error::KafkaError::Global(rdkafka::types::RDKafkaErrorCode::PartitionEOF) => {
            tracing::debug!(target: "librdkafka", "{reason}")
        }
        // librdkafka retries these itself; a read that never recovers times out.
        _ => tracing::warn!(target: "librdkafka", %error, "{reason}"),
    }
}

impl ConsumerContext for SourceContext {}

/// A Kafka cluster as a [`Source`]: a consumer for requests, and a thread with a
/// consumer of its own that reads batches and reads ahead between them.
pub struct KafkaSource {
    client: Arc<Client>,
    reader: reader::ReadingThread,
}

impl KafkaSource {
    /// Validates `config` and creates the consumer. The consumer group is
    /// `config.group_id`, or `sluice-<query_id>`. No request is sent yet, so an
    /// unreachable cluster shows on the first call.
    pub fn new(config: KafkaSourceConfig, query_id: &str) -> Result<KafkaSource, KafkaError> {
        config.validate()?;
        let pattern = match &config.selection {
            TopicSelection::SubscribePattern(p) => Some(config::compile_pattern(p)?),
            _ => None,
        };
        let group_id = config
            .group_id
            .clone()
            .unwrap_or_else(|| format!("sluice-{query_id}"));
        let mut client_config = ClientConfig::new();
        // When its local queue is full, librdkafka stops fetching for
        // fetch.queue.backoff.ms (1 s by default), although a batch read drains the
        // queue in milliseconds: a 200,000-record batch spent 0.85 s of its 1.13 s
        // in that backoff (`cargo xtask bench`, librdkafka debug=fetch).
        client_config.set("fetch.queue.backoff.ms", "10");
        // librdkafka has one fetch in flight per broker. When the partitions that
        // still have records are skipped because their queues are full, the fetch
        // holds only partitions at their end and long-polls for fetch.wait.max.ms
        // (500 ms by default), and the others wait behind it: a 1,000,000-record
        // read took 1.2-1.6 s instead of 0.5 s (`cargo xtask bench`).
        client_config.set("fetch.wait.max.ms", "20");
        // One fetch response may hold up to max.partition.fetch.bytes (1 MiB) of
        // every partition, up to this much in all (50 MiB by default), and lives in
        // memory until its last record is read: so it follows the read-ahead.
        client_config.set("fetch.max.bytes", config.fetch_max_bytes().to_string());
        for (key, value) in &config.client_options {
            client_config.set(key, value);
        }
        client_config
            .set("bootstrap.servers", &config.bootstrap_servers)
            .set("group.id", &group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Offsets that are gone must surface as errors, never as a silent reset.
            .set("auto.offset.reset", "error")
            // Taken in a batch, an end-of-partition event would move librdkafka's
            // position one past the end (see the reader); the reader asks for
            // positions itself when it waits.
            .set("enable.partition.eof", "false");
        let context = SourceContext::default();
        let refusals = context.refusals.clone();
        let consumer = client_config
            .create_with_context(context)
            .map_err(|source| KafkaError::Client {
                bootstrap: config.bootstrap_servers.clone(),
                source: Box::new(source),
            })?;
        let client = Arc::new(Client {
            consumer: Arc::new(consumer),
            refusals,
            reader_config: client_config,
            config,
            group_id,
            pattern,
            names: Default::default(),
        });
        let reader = reader::ReadingThread::start(client.clone())?;
        Ok(KafkaSource { client, reader })
    }

    /// The consumer group this source commits progress to and reads committed
    /// offsets from.
    pub fn group_id(&self) -> &str {
        &self.client.group_id
    }

    /// How many reads assigned partitions afresh instead of continuing where the
    /// previous read ended (a replay, new partitions, tolerated data loss).
    pub fn assignments(&self) -> u64 {
        self.reader
            .shared()
            .assignments
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times a partition's read-ahead filled its share, so that the
    /// partition stopped fetching until the batches had taken half of it.
    pub fn read_ahead_pauses(&self) -> u64 {
        self.reader
            .shared()
            .pauses
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many messages the reading consumer fetched, as of librdkafka's last
    /// statistics (`statistics.interval.ms`, off by default, when this stays
    /// 0). Messages that a pause dropped and that were fetched again count each
    /// time, so beside the records read it tells how much was fetched twice.
    pub fn fetched_messages(&self) -> u64 {
        self.reader
            .shared()
            .statistics
            .messages
            .load(Ordering::Relaxed)
    }

    /// The read amplification as of the reading consumer's latest statistics
    /// (every `statistics.interval.ms`, a second unless configured).
    pub fn read_amplification(&self) -> Option<ReadAmplification> {
        self.reader
            .shared()
            .amplification
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The fetch size per partition (`max.partition.fetch.bytes`) the reader
    /// learned from record batches larger than the one it started with.
    pub fn learned_fetch_bytes(&self) -> Option<u64> {
        Some(
            self.reader
                .shared()
                .learned_fetch_bytes
                .load(Ordering::Relaxed),
        )
        .filter(|b| *b > 0)
    }

    /// Whether the source reads `topic` (some of its partitions, for `assign`).
    pub fn selects(&self, topic: &str) -> bool {
        discovery::selects(
            &self.client.config.selection,
            self.client.pattern.as_ref(),
            topic,
        )
    }

    /// The configuration in force.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.client.config
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Client) -> Result<T, KafkaError> + Send + 'static,
    ) -> Result<T, KafkaError> {
        let client = self.client.clone();
        off_thread(move || work(&client)).await?
    }
}

/// Runs a blocking librdkafka call on the blocking pool, off the async threads.
pub(crate) async fn off_thread<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, KafkaError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| KafkaError::Task(e.to_string()))
}

/// How many chunks a read may have ready before the sink takes them: enough to
/// keep the reading thread busy while the sink works, few enough to bound memory.
const CHUNKS_IN_FLIGHT: usize = 4;

/// The records of one batch as a [`KafkaSource`] reads them on a thread of its own.
pub struct KafkaBatchReader {
    events: tokio::sync::mpsc::Receiver<Result<reader::Event, KafkaError>>,
    /// Told when a chunk was taken, so that the reading thread hands over the next.
    shared: Arc<reader::Shared>,
    data_loss: Vec<DataLoss>,
    finished: bool,
}

impl KafkaBatchReader {
    /// [`BatchReader::next_chunk`] as a poll, so that the readers of several
    /// sources can be waited on together; nothing is lost when a poll is left
    /// pending.
    pub(crate) fn poll_chunk(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Option<RecordChunk>, KafkaError>> {
        use std::task::Poll;
        if self.finished {
            return Poll::Ready(Ok(None));
        }
        let Poll::Ready(event) = self.events.poll_recv(cx) else {
            return Poll::Pending;
        };
        self.shared.signal.notify();
        Poll::Ready(match event {
            Some(Ok(reader::Event::Chunk(chunk))) => Ok(Some(chunk)),
            Some(Ok(reader::Event::Done(losses))) => {
                self.finished = true;
                self.data_loss = losses;
                Ok(None)
            }
            Some(Err(e)) => {
                self.finished = true;
                Err(e)
            }
            None => {
                self.finished = true;
                Err(KafkaError::Task(
                    "the reading thread stopped before the batch was read".to_owned(),
                ))
            }
        })
    }
}

impl BatchReader for KafkaBatchReader {
    type Error = KafkaError;

    async fn next_chunk(&mut self) -> Result<Option<RecordChunk>, KafkaError> {
        std::future::poll_fn(|cx| self.poll_chunk(cx)).await
    }

    fn data_loss(&self) -> &[DataLoss] {
        &self.data_loss
    }
}

impl Source for KafkaSource {
    type Error = KafkaError;
    type Reader = KafkaBatchReader;

    async fn partitions(&mut self) -> Result<BTreeMap<TopicPartition, OffsetBounds>, KafkaError> {
        self.blocking(|client| client.partitions()).await
    }

    async fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    ) -> Result<PartitionOffsets, KafkaError> {
        let starting = starting.clone();
        let partitions = partitions.clone();
        self.blocking(move |client| resolve_start(client, &starting, &partitions))
            .await
    }

    async fn read(&mut self, ranges: &[OffsetRange]) -> Result<KafkaBatchReader, KafkaError> {
        let (events, receiver) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
        self.reader.read(ranges.to_vec(), events);
        Ok(KafkaBatchReader {
            events: receiver,
            shared: self.reader.shared().clone(),
            data_loss: Vec::new(),
            finished: false,
        })
    }

    fn is_transient(error: &KafkaError) -> bool {
        matches!(
            error,
            KafkaError::Unreachable { .. }
                | KafkaError::Kafka { .. }
                | KafkaError::PollTimeout { .. }
                | KafkaError::Task(_)
        )
    }

    fn read_amplification(&self) -> Option<ReadAmplification> {
        KafkaSource::read_amplification(self)
    }

    async fn commit_progress(&mut self, offsets: &PartitionOffsets) -> Result<(), KafkaError> {
        if !self.client.config.commit_progress || offsets.is_empty() {
            return Ok(());
        }
        let offsets = offsets.clone();
        self.blocking(move |client| client.commit(&offsets)).await
    }
}

/// Where a fresh query starts on each partition, as Spark resolves its options.
fn resolve_start(
    client: &Client,
    starting: &StartingOffsets,
    partitions: &BTreeMap<TopicPartition, OffsetBounds>,
) -> Result<PartitionOffsets, KafkaError> {
    let all: BTreeSet<TopicPartition> = partitions.keys().cloned().collect();
    let low = |tp: &TopicPartition| partitions[tp].low;
    let high = |tp: &TopicPartition| partitions[tp].high;
    let by_timestamp = |timestamps: BTreeMap<TopicPartition, i64>, fallback: TimestampFallback| {
        let queries = timestamps
            .iter()
            .map(|(tp, ms)| (tp.clone(), Position::Timestamp(*ms)))
            .collect();
        let found = client.list_offsets_at(&queries)?;
        timestamps
            .into_iter()
            .map(
                |(tp, timestamp_ms)| match (found.get(&tp).copied().flatten(), fallback) {
                    (Some(offset), _) => Ok((tp, offset)),
                    (None, TimestampFallback::Latest) => {
                        let end = high(&tp);
                        Ok((tp, end))
                    }
                    (None, TimestampFallback::Error) => Err(KafkaError::NoOffsetForTimestamp {
                        topic_partition: tp,
                        timestamp_ms,
                    }),
                },
            )
            .collect::<Result<PartitionOffsets, _>>()
    };
    let require_all = |named: BTreeSet<&TopicPartition>, option: &str| {
        if let Some(tp) = all.iter().find(|tp| !named.contains(tp)) {
            return Err(KafkaError::Config(format!(
                "{option} names no offset for {tp}; name every partition the query reads"
            )));
        }
        if let Some(tp) = named.iter().find(|tp| !all.contains(**tp)) {
            return Err(KafkaError::Config(format!(
                "{option} names {tp}, which the query does not read or Kafka does not have"
            )));
        }
        Ok(())
    };
    match starting {
        StartingOffsets::Earliest => Ok(all.iter().map(|tp| (tp.clone(), low(tp))).collect()),
        StartingOffsets::Latest => Ok(all.iter().map(|tp| (tp.clone(), high(tp))).collect()),
        StartingOffsets::Specific(offsets) => {
            require_all(offsets.keys().collect(), "starting_offsets")?;
            Ok(offsets
                .iter()
                .map(|(tp, specific)| {
                    let offset = match specific {
                        SpecificOffset::Earliest => low(tp),
                        SpecificOffset::Latest => high(tp),
                        SpecificOffset::At(offset) => *offset,
                    };
                    (tp.clone(), offset)
                })
                .collect())
        }
        StartingOffsets::TimestampPerPartition {
            timestamps,
            fallback,
        } => {
            require_all(timestamps.keys().collect(), "starting_offsets_by_timestamp")?;
            by_timestamp(timestamps.clone(), *fallback)
        }
        StartingOffsets::Timestamp {
            timestamp_ms,
            fallback,
        } => by_timestamp(
            all.iter().map(|tp| (tp.clone(), *timestamp_ms)).collect(),
            *fallback,
        ),
        StartingOffsets::GroupCommitted { missing } => {
            let committed = client.committed(&all)?;
            all.iter()
                .map(|tp| match (committed.get(tp).copied().flatten(), missing) {
                    (Some(offset), _) => Ok((tp.clone(), offset)),
                    (None, MissingCommitted::Earliest) => Ok((tp.clone(), low(tp))),
                    (None, MissingCommitted::Latest) => Ok((tp.clone(), high(tp))),
                    (None, MissingCommitted::Error) => Err(KafkaError::NoCommittedOffset {
                        topic_partition: tp.clone(),
                        group: client.group_id.clone(),
                    }),
                })
                .collect()
        }
    }
}
