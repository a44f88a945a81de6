//! The Kafka source of Sluice, over `rdkafka`: partition discovery, watermarks,
//! offsets by timestamp, reading planned offset ranges and detecting data loss;
//! and the `kafka` sink ([`KafkaSink`]), which produces to an output topic.
//!
//! It implements the [`Source`] trait of `sluice-offsets`; the decisions themselves
//! (rate limits, data-loss classification) stay in that crate. Every blocking
//! librdkafka call runs on tokio's blocking pool, off the async worker threads.

mod client;
mod config;
mod discovery;
mod error;
mod reader;
mod sink;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::ConsumerContext;
use sluice_offsets::{
    MissingCommitted, OffsetRange, PartitionOffsets, ReadBatch, Source, SpecificOffset,
    StartingOffsets, TimestampFallback, TopicPartition, Watermarks,
};

use client::{Client, Position};
pub use config::{KafkaSourceConfig, TopicSelection};
pub use error::KafkaSourceError;
pub use sink::{KafkaSink, KafkaSinkConfig};

/// Routes librdkafka's own log lines to `tracing`.
pub struct SourceContext;

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
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

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        SourceContext::global_error(&error, reason);
    }
}

impl SourceContext {
    fn global_error(error: &rdkafka::error::KafkaError, reason: &str) {
        match error {
            // The end of a partition that a finished read no longer watches.
            rdkafka::error::KafkaError::PartitionEOF(_) => {
                tracing::debug!(target: "librdkafka", "{reason}")
            }
            // librdkafka retries these itself; a read that never recovers times out.
            _ => tracing::warn!(target: "librdkafka", %error, "{reason}"),
        }
    }
}

impl ConsumerContext for SourceContext {}

/// A Kafka cluster as a [`Source`]: one long-lived consumer for requests and
/// reads, kept between batches.
pub struct KafkaSource {
    client: Arc<Client>,
}

impl KafkaSource {
    /// Validates `config` and creates the consumer. The consumer group is
    /// `config.group_id`, or `sluice-<query_id>`. No request is sent yet, so an
    /// unreachable cluster shows on the first call.
    pub fn new(config: KafkaSourceConfig, query_id: &str) -> Result<KafkaSource, KafkaSourceError> {
        config.validate()?;
        let pattern = match &config.selection {
            TopicSelection::SubscribePattern(p) => Some(discovery::compile_pattern(p)?),
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
        // Kafka answers the requests of one connection in order, so a fetch that
        // long-polls at a partition's end holds back the next metadata and offset
        // requests for fetch.wait.max.ms (500 ms by default): after each batch,
        // when every partition is at its planned end, that was pure delay.
        client_config.set("fetch.wait.max.ms", "20");
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
            .set("enable.partition.eof", "true");
        let consumer = client_config
            .create_with_context(SourceContext)
            .map_err(|source| KafkaSourceError::Client {
                bootstrap: config.bootstrap_servers.clone(),
                source: Box::new(source),
            })?;
        Ok(KafkaSource {
            client: Arc::new(Client {
                consumer,
                config,
                group_id,
                pattern,
            }),
        })
    }

    /// The consumer group this source commits progress to and reads committed
    /// offsets from.
    pub fn group_id(&self) -> &str {
        &self.client.group_id
    }

    /// The configuration in force.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.client.config
    }

    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Client) -> Result<T, KafkaSourceError> + Send + 'static,
    ) -> Result<T, KafkaSourceError> {
        let client = self.client.clone();
        tokio::task::spawn_blocking(move || work(&client))
            .await
            .map_err(|e| KafkaSourceError::Task(e.to_string()))?
    }
}

impl Source for KafkaSource {
    type Error = KafkaSourceError;

    async fn partitions(
        &mut self,
    ) -> Result<BTreeMap<TopicPartition, Watermarks>, KafkaSourceError> {
        self.blocking(|client| client.partitions()).await
    }

    async fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, Watermarks>,
    ) -> Result<PartitionOffsets, KafkaSourceError> {
        let starting = starting.clone();
        let partitions = partitions.clone();
        self.blocking(move |client| resolve_start(client, &starting, &partitions))
            .await
    }

    async fn read(&mut self, ranges: &[OffsetRange]) -> Result<ReadBatch, KafkaSourceError> {
        let ranges = ranges.to_vec();
        self.blocking(move |client| reader::read(client, &ranges))
            .await
    }

    fn is_transient(error: &KafkaSourceError) -> bool {
        matches!(
            error,
            KafkaSourceError::Unreachable { .. }
                | KafkaSourceError::Kafka { .. }
                | KafkaSourceError::PollTimeout { .. }
                | KafkaSourceError::Task(_)
        )
    }

    async fn commit_progress(
        &mut self,
        offsets: &PartitionOffsets,
    ) -> Result<(), KafkaSourceError> {
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
    partitions: &BTreeMap<TopicPartition, Watermarks>,
) -> Result<PartitionOffsets, KafkaSourceError> {
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
                    (None, TimestampFallback::Error) => {
                        Err(KafkaSourceError::NoOffsetForTimestamp {
                            topic_partition: tp,
                            timestamp_ms,
                        })
                    }
                },
            )
            .collect::<Result<PartitionOffsets, _>>()
    };
    let require_all = |named: BTreeSet<&TopicPartition>, option: &str| {
        if let Some(tp) = all.iter().find(|tp| !named.contains(tp)) {
            return Err(KafkaSourceError::Config(format!(
                "{option} names no offset for {tp}; name every partition the query reads"
            )));
        }
        if let Some(tp) = named.iter().find(|tp| !all.contains(**tp)) {
            return Err(KafkaSourceError::Config(format!(
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
                    (None, MissingCommitted::Error) => Err(KafkaSourceError::NoCommittedOffset {
                        topic_partition: tp.clone(),
                        group: client.group_id.clone(),
                    }),
                })
                .collect()
        }
    }
}
