//! The `kafka` sink: records to an output topic through an idempotent producer.
//!
//! Every record carries headers naming the query, the batch and the source
//! position (`sluice.query`, `sluice.batch`, `sluice.position` =
//! `topic-partition@offset`, or `batch#row` for a query's rows, which a replay
//! makes again in the same order).
//!
//! With [`Delivery::AtLeastOnce`] a batch replayed after a crash is produced
//! again, and consumers drop the duplicates by those headers. With
//! [`Delivery::ExactlyOnce`] each batch is one Kafka transaction, and the
//! batch's source end offsets are committed inside it to a consumer group named
//! as the transactional id, with the batch id as their metadata. On recovery,
//! `init_transactions` settles what the previous runner left open (aborts it, or
//! waits for a commit under way), and the group's offsets then tell whether the
//! planned batch reached Kafka: if they are its ends and name it, only the
//! store's commit is left to write; otherwise the batch is written again in a new
//! transaction. A `read_committed` reader sees each batch once either way.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError as RdKafkaError, KafkaResult};
use rdkafka::message::Message;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};
use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, Writes};

use crate::refusal::Refusals;
use crate::{KafkaError, off_thread};

/// Where the `kafka` sink writes. Its `Debug` hides the values of secret
/// client options.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSinkConfig {
    /// `bootstrap.servers` of the output cluster.
    pub bootstrap_servers: String,
    /// The output topic.
    pub topic: String,
    /// Further producer options, passed through.
    pub client_options: BTreeMap<String, String>,
    /// At least once, or exactly once through transactions.
    pub delivery: Delivery,
}

impl std::fmt::Debug for KafkaSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSinkConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topic", &self.topic)
            .field(
                "client_options",
                &crate::config::Redacted(&self.client_options),
            )
            .field("delivery", &self.delivery)
            .finish()
    }
}

/// How the `kafka` sink delivers a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Delivery {
    /// An idempotent producer; a batch replayed after a crash is produced again.
    #[default]
    AtLeastOnce,
    /// One transaction per batch, with the batch's source offsets in it.
    ExactlyOnce,
}

/// librdkafka's `transaction.timeout.ms` when none is set.
const DEFAULT_TRANSACTION_TIMEOUT_MS: u64 = 60_000;

/// The transactional producer's `retry.backoff.ms` unless `[sink.kafka]` sets it.
///
/// The coordinator answers CONCURRENT_TRANSACTIONS to a transaction's first
/// request while the previous one's markers are still being written, which a
/// batch a few milliseconds after the last meets now and then; librdkafka's
/// 100 ms backoff then lands whole in that batch's latency. At 10,000 records/s
/// three paired runs put p99 at 94, 44 and 60 ms against 253, 98 and 117 with
/// 100 ms. The backoff still doubles on each retry, up to `retry.backoff.max.ms`.
const TRANSACTIONAL_RETRY_BACKOFF_MS: &str = "10";

/// How long a transaction call (init, commit, abort, offsets) may take.
const TRANSACTION_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a batch's flush may wait for the broker's acknowledgements.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits until everything `producer` has queued is acknowledged, or `timeout`.
///
/// rdkafka's `flush` asks librdkafka's with a zero timeout and then polls the
/// producer's queue for up to 100 ms, a queue the threaded producer's own thread
/// serves, so every batch took at least 100 ms. Asking with a zero timeout in a
/// loop of our own was prompt to notice, but librdkafka sends at once, ignoring
/// `linger.ms`, only while a flush call is under way, and a zero-timeout call
/// ends before the broker thread looks: the batch's last records waited out
/// `linger.ms` (5 ms by default). At 10,000 records/s into an exactly-once
/// sink, that flush took 4.6 ms at p50 against 0.6 ms for the commit after it.
/// librdkafka's flush called with the whole timeout holds the flag while it
/// waits, and as rdkafka uses librdkafka's event API, it waits on a condition
/// that librdkafka signals when its last message is done.
fn flush_promptly(producer: &ThreadedProducer<Deliveries>, timeout: Duration) -> KafkaResult<()> {
    let millis = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: the handle is live for as long as `producer` is borrowed, and
    // librdkafka allows a flush from any thread.
    let code = unsafe { rdkafka::bindings::rd_kafka_flush(producer.client().native_ptr(), millis) };
    match RDKafkaErrorCode::from(code) {
        RDKafkaErrorCode::NoError => Ok(()),
        code => Err(RdKafkaError::Flush(code)),
    }
}

/// The transactional side of an exactly-once sink.
struct Transactions {
    /// The producer's `transactional.id`, also the group its offsets go to.
    id: String,
    /// A member-less consumer of that group: its metadata for
    /// `send_offsets_to_transaction`, and the offsets committed so far.
    group: Arc<BaseConsumer>,
    /// `init_transactions` has run.
    ready: bool,
    /// A transaction is open.
    open: bool,
    /// The ranges of the batch begun last.
    ranges: Vec<OffsetRange>,
    /// The open transaction's end offsets on their way into it, sent when the
    /// batch began so that its two round trips overlap the produce.
    offsets: Option<tokio::task::JoinHandle<KafkaResult<()>>>,
}

/// An admin client of the output cluster, with the sink's security settings.
fn admin_of(
    config: &KafkaSinkConfig,
) -> Result<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>, KafkaError> {
    security_config(config)
        .set("bootstrap.servers", &config.bootstrap_servers)
        .create()
        .map_err(|source| KafkaError::Client {
            bootstrap: config.bootstrap_servers.clone(),
            source: Box::new(source),
        })
}

/// The group offsets' metadata that names the batch whose transaction wrote them.
fn batch_marker(batch: BatchId) -> String {
    format!("sluice batch {batch}")
}

/// Produces each batch's records, or a query's rows, to a topic and waits until
/// all are acknowledged.
pub struct KafkaSink {
    producer: ThreadedProducer<Deliveries>,
    /// The producer's settings, to make a new one when a fence ended the old one.
    client: ClientConfig,
    bootstrap: String,
    topic: String,
    query_id: String,
    batch: BatchId,
    batch_text: String,
    /// Rows of the batch produced so far, which numbers each row's position.
    rows: u64,
    /// For exactly once.
    transactions: Option<Transactions>,
}

impl KafkaSink {
    /// A sink for `query_id`, with an idempotent producer (`acks=all`), and for
    /// exactly once a transactional one whose id is [`KafkaSink::transactional_id`].
    pub fn new(config: KafkaSinkConfig, query_id: &str) -> Result<KafkaSink, KafkaError> {
        let id = Self::transactional_id(query_id, &config.topic);
        Self::with_transactional_id(config, query_id, id)
    }

    /// The sink of one generation of a query in group mode: for exactly once,
    /// its transactional id and offsets group are the generation's
    /// ([`KafkaSink::generation_transactional_id`]), so that the member that
    /// settles a dead or paused generation fences that generation's producer
    /// and finds whether its pending batch reached Kafka, while the live
    /// members, each in a generation of its own, never fence one another.
    pub fn for_generation(
        config: KafkaSinkConfig,
        query_id: &str,
        generation: &str,
    ) -> Result<KafkaSink, KafkaError> {
        let id = Self::generation_transactional_id(query_id, &config.topic, generation);
        Self::with_transactional_id(config, query_id, id)
    }

    fn with_transactional_id(
        config: KafkaSinkConfig,
        query_id: &str,
        id: String,
    ) -> Result<KafkaSink, KafkaError> {
        Self::check_options(&config)?;
        let client_error = |source| KafkaError::Client {
            bootstrap: config.bootstrap_servers.clone(),
            source: Box::new(source),
        };
        let mut client = ClientConfig::new();
        for (key, value) in &config.client_options {
            client.set(key, value);
        }
        client
            .set("bootstrap.servers", &config.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all");
        let transactions = match config.delivery {
            Delivery::AtLeastOnce => None,
            Delivery::ExactlyOnce => {
                client.set("transactional.id", &id);
                if !config.client_options.contains_key("retry.backoff.ms") {
                    client.set("retry.backoff.ms", TRANSACTIONAL_RETRY_BACKOFF_MS);
                }
                let group: BaseConsumer = security_config(&config)
                    .set("bootstrap.servers", &config.bootstrap_servers)
                    .set("group.id", &id)
                    .set("enable.auto.commit", "false")
                    .set("isolation.level", "read_committed")
                    .create()
                    .map_err(client_error)?;
                Some(Transactions {
                    id,
                    group: Arc::new(group),
                    ready: false,
                    open: false,
                    ranges: Vec::new(),
                    offsets: None,
                })
            }
        };
        client.set("delivery.report.only.error", "true");
        let producer = client
            .create_with_context(Deliveries::default())
            .map_err(client_error)?;
        Ok(KafkaSink {
            producer,
            client,
            bootstrap: config.bootstrap_servers.clone(),
            topic: config.topic,
            query_id: query_id.to_owned(),
            batch: BatchId::FIRST,
            batch_text: String::new(),
            rows: 0,
            transactions,
        })
    }

    /// Refuses the producer options the sink sets itself.
    pub fn check_options(config: &KafkaSinkConfig) -> Result<(), KafkaError> {
        for key in ["enable.idempotence", "acks", "bootstrap.servers"] {
            if config.client_options.contains_key(key) {
                return Err(KafkaError::OwnedOption {
                    option: key.to_owned(),
                    reason: "the kafka sink always produces idempotently with acks=all to the \
                             configured bootstrap_servers",
                });
            }
        }
        if config.client_options.contains_key("transactional.id") {
            return Err(KafkaError::OwnedOption {
                option: "transactional.id".to_owned(),
                reason: "with delivery = \"exactly_once\" the sink derives it from the query id \
                         and the topic, so that a restarted runner fences the one before it and \
                         two queries never share one; at least once needs none",
            });
        }
        Ok(())
    }

    /// Checks, for exactly once, that `transaction.timeout.ms` (librdkafka's
    /// 60000 unless set) is within the broker's `transaction.max.timeout.ms`,
    /// which would otherwise refuse every transaction.
    pub async fn check_transaction_timeout(config: &KafkaSinkConfig) -> Result<(), KafkaError> {
        use rdkafka::admin::{AdminOptions, ResourceSpecifier};
        if config.delivery != Delivery::ExactlyOnce {
            return Ok(());
        }
        let ours = match config.client_options.get("transaction.timeout.ms") {
            None => DEFAULT_TRANSACTION_TIMEOUT_MS,
            Some(text) => text.parse::<u64>().map_err(|_| {
                KafkaError::Config(format!(
                    "sink.kafka.\"transaction.timeout.ms\" = {text:?} is not a number of \
                     milliseconds"
                ))
            })?,
        };
        let failed = |what: &str| {
            let what = what.to_owned();
            move |source| KafkaError::Kafka {
                what,
                source: Box::new(source),
            }
        };
        let admin = admin_of(config)?;
        let (admin, metadata) = off_thread(move || {
            let metadata = admin.inner().fetch_metadata(None, Duration::from_secs(10));
            (admin, metadata)
        })
        .await?;
        let metadata = metadata.map_err(failed("reading the output cluster's brokers"))?;
        let Some(broker) = metadata.brokers().first().map(|b| b.id()) else {
            return Ok(());
        };
        let described = admin
            .describe_configs(
                &[ResourceSpecifier::Broker(broker)],
                &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(failed("reading the broker's transaction.max.timeout.ms"))?;
        let most = described
            .first()
            .and_then(|r| r.as_ref().ok())
            .and_then(|r| r.get("transaction.max.timeout.ms"))
            .and_then(|e| e.value.as_deref())
            .and_then(|v| v.parse::<u64>().ok());
        match most {
            Some(most) if ours > most => Err(KafkaError::Config(format!(
                "sink.kafka.\"transaction.timeout.ms\" = {ours} is above the broker's \
                 transaction.max.timeout.ms = {most} (broker {broker} at {}), so every \
                 transaction of the exactly-once sink would be refused; set it at most {most}, \
                 and above the longest batch, which one transaction spans",
                config.bootstrap_servers
            ))),
            _ => Ok(()),
        }
    }

    /// The `transactional.id` of an exactly-once sink of `query_id` writing to
    /// `topic`: the same for every runner of the query, so that a new one fences
    /// the one before it, and different for every query and topic.
    pub fn transactional_id(query_id: &str, topic: &str) -> String {
        format!("sluice-{query_id}-{topic}")
    }

    /// The `transactional.id` of an exactly-once sink of `generation` of the
    /// group-mode query `query_id` writing to `topic`, which is also the group
    /// its offsets go to.
    pub fn generation_transactional_id(query_id: &str, topic: &str, generation: &str) -> String {
        format!("sluice-{query_id}-{topic}-{generation}")
    }

    /// Deletes the offsets group of `generation`'s exactly-once sink once the
    /// generation handed its partitions back, when nothing reads it again;
    /// without this every generation would leave a group behind until the
    /// broker's `offsets.retention.minutes` expired it. A group already gone
    /// is no error, since two members may settle one generation at once.
    pub async fn forget_generation(
        config: &KafkaSinkConfig,
        query_id: &str,
        generation: &str,
    ) -> Result<(), KafkaError> {
        use rdkafka::admin::AdminOptions;
        if config.delivery != Delivery::ExactlyOnce {
            return Ok(());
        }
        let group = Self::generation_transactional_id(query_id, &config.topic, generation);
        let what = format!("deleting the offsets group {group} of a finished generation");
        let failed = |source| KafkaError::Kafka {
            what: what.clone(),
            source: Box::new(source),
        };
        let admin = admin_of(config)?;
        let results = admin
            .delete_groups(
                &[group.as_str()],
                &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(failed)?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::GroupIdNotFound)) => {}
                Err((_, code)) => return Err(failed(RdKafkaError::AdminOp(code))),
            }
        }
        Ok(())
    }

    /// Runs a blocking transaction call on the producer off the async threads.
    async fn transaction_call(
        &self,
        what: String,
        call: impl FnOnce(&ThreadedProducer<Deliveries>) -> KafkaResult<()> + Send + 'static,
    ) -> Result<(), KafkaError> {
        let producer = self.producer.clone();
        let result = off_thread(move || call(&producer)).await?;
        self.refused(result.map_err(|source| self.transaction_error(what, source)))
    }

    /// An error the cluster's refusal explains (a failed login or handshake)
    /// as that refusal, which no retry changes; a success forgets earlier ones.
    fn refused<T>(&self, result: Result<T, KafkaError>) -> Result<T, KafkaError> {
        let refusals = &self.producer.context().refusals;
        match result {
            Ok(value) => {
                refusals.clear();
                Ok(value)
            }
            Err(e) => match (refusals.last(), &e) {
                (_, KafkaError::Fenced { .. }) | (None, _) => Err(e),
                (Some(why), _) => Err(KafkaError::Refused {
                    bootstrap: self.bootstrap.clone(),
                    what: e.to_string(),
                    why,
                }),
            },
        }
    }

    /// Makes a new producer when the old one was fenced, which ends a
    /// transactional producer for good, then fences every earlier one.
    async fn take_over_transactions(&mut self) -> Result<(), KafkaError> {
        self.settle_offsets().await;
        let Some(t) = self.transactions.as_mut() else {
            return Ok(());
        };
        if t.ready {
            t.ready = false;
            t.open = false;
            self.producer = self
                .client
                .create_with_context(Deliveries::default())
                .map_err(|source| KafkaError::Client {
                    bootstrap: self.bootstrap.clone(),
                    source: Box::new(source),
                })?;
        }
        self.ensure_ready().await
    }

    /// What a failed transaction call means: fenced by a newer runner, to be
    /// aborted and written again, or a failure of its own.
    fn transaction_error(&self, what: String, source: RdKafkaError) -> KafkaError {
        let id = self
            .transactions
            .as_ref()
            .map(|t| t.id.clone())
            .unwrap_or_default();
        let code = source.rdkafka_error_code();
        let fenced = matches!(
            code,
            Some(
                RDKafkaErrorCode::Fenced
                    | RDKafkaErrorCode::ProducerFenced
                    // Retrying after an old-epoch error would bump the epoch again
                    // and fence the runner that took over, so it is final too.
                    | RDKafkaErrorCode::InvalidProducerEpoch
                    | RDKafkaErrorCode::TransactionCoordinatorFenced
            )
        );
        match &source {
            _ if fenced => KafkaError::Fenced {
                transactional_id: id,
                source: Box::new(source),
            },
            RdKafkaError::Transaction(e) if e.is_fatal() => KafkaError::Kafka {
                what,
                source: Box::new(source),
            },
            _ => KafkaError::Aborted {
                what,
                source: Box::new(source),
            },
        }
    }

    /// Runs `init_transactions` once: it fences every earlier producer of the
    /// id and settles the transaction it left.
    async fn ensure_ready(&mut self) -> Result<(), KafkaError> {
        if self.transactions.as_ref().is_none_or(|t| t.ready) {
            return Ok(());
        }
        self.transaction_call("initialising transactions".to_owned(), |p| {
            p.init_transactions(TRANSACTION_CALL_TIMEOUT)
        })
        .await?;
        if let Some(t) = self.transactions.as_mut() {
            t.ready = true;
        }
        Ok(())
    }

    /// Waits for the offsets sent into the open transaction, if any, whatever
    /// their outcome: librdkafka takes one transaction call at a time, and an
    /// abort or a new producer makes that outcome moot.
    async fn settle_offsets(&mut self) {
        if let Some(pending) = self.transactions.as_mut().and_then(|t| t.offsets.take()) {
            let _ = pending.await;
        }
    }

    /// Aborts the open transaction, if any, dropping what it produced.
    async fn abort_open(&mut self) -> Result<(), KafkaError> {
        self.settle_offsets().await;
        if !self.transactions.as_ref().is_some_and(|t| t.open) {
            return Ok(());
        }
        let batch = self.batch;
        self.transaction_call(format!("aborting the transaction of batch {batch}"), |p| {
            p.abort_transaction(TRANSACTION_CALL_TIMEOUT)
        })
        .await?;
        if let Some(t) = self.transactions.as_mut() {
            t.open = false;
        }
        Ok(())
    }

    /// After a failure inside the open transaction: aborts it (an abort that
    /// fails too is logged; the next begin tries again) and returns `error`.
    async fn fail_transaction(&mut self, error: KafkaError) -> KafkaError {
        if matches!(error, KafkaError::Fenced { .. }) {
            return error;
        }
        if let Err(abort) = self.abort_open().await {
            tracing::warn!(error = %abort, "aborting the failed transaction failed");
            return abort;
        }
        match error {
            KafkaError::Kafka { what, source } => KafkaError::Aborted { what, source },
            other => other,
        }
    }

    /// Sends the batch's source end offsets into the open transaction on a
    /// blocking thread, for [`KafkaSink::commit_open`] to wait for.
    fn send_offsets(&mut self, batch: BatchId) -> Result<(), KafkaError> {
        let Some(t) = self.transactions.as_ref() else {
            return Ok(());
        };
        if t.ranges.is_empty() {
            return Ok(());
        }
        let (offsets, metadata) = Self::end_offsets(t, batch)?;
        let producer = self.producer.clone();
        let pending = tokio::task::spawn_blocking(move || {
            producer.send_offsets_to_transaction(&offsets, &metadata, TRANSACTION_CALL_TIMEOUT)
        });
        if let Some(t) = self.transactions.as_mut() {
            t.offsets = Some(pending);
        }
        Ok(())
    }

    /// The batch's end offsets, marked with its id, and the group they go to.
    fn end_offsets(
        t: &Transactions,
        batch: BatchId,
    ) -> Result<(TopicPartitionList, rdkafka::consumer::ConsumerGroupMetadata), KafkaError> {
        let mut offsets = TopicPartitionList::new();
        for range in &t.ranges {
            let tp = &range.topic_partition;
            let mut element = offsets.add_partition(&tp.topic, tp.partition);
            element
                .set_offset(KafkaOffset::Offset(range.until.value()))
                .map_err(|source| KafkaError::Kafka {
                    what: format!("recording the end of {tp}"),
                    source: Box::new(source),
                })?;
            element.set_metadata(batch_marker(batch));
        }
        let metadata = t.group.group_metadata().ok_or_else(|| {
            KafkaError::Task(format!("no consumer group metadata for group {}", t.id))
        })?;
        Ok((offsets, metadata))
    }

    /// Commits the open transaction with the batch's source end offsets in it.
    async fn commit_open(&mut self, batch: BatchId) -> Result<(), KafkaError> {
        let Some(t) = self.transactions.as_mut() else {
            return Ok(());
        };
        let what = format!("committing the transaction of batch {batch}");
        // A batch without ranges (nothing to read) has no offsets to send.
        if let Some(pending) = t.offsets.take() {
            let sent = pending.await.map_err(|e| KafkaError::Task(e.to_string()))?;
            self.refused(sent.map_err(|source| self.transaction_error(what.clone(), source)))?;
        }
        self.transaction_call(what, |p| p.commit_transaction(TRANSACTION_CALL_TIMEOUT))
            .await?;
        if let Some(t) = self.transactions.as_mut() {
            t.open = false;
        }
        Ok(())
    }
}

impl KafkaSink {
    /// Waits until everything produced is acknowledged, and names the first
    /// record the broker refused.
    async fn flush(&mut self) -> Result<(), KafkaError> {
        let batch = self.batch;
        let producer = self.producer.clone();
        let flushed = off_thread(move || flush_promptly(&producer, FLUSH_TIMEOUT))
            .await?
            .map_err(|source| KafkaError::Kafka {
                what: format!("flushing batch {batch}"),
                source: Box::new(source),
            });
        let delivered = flushed.and_then(|()| match self.producer.context().take_failure() {
            None => Ok(()),
            Some((partition, source)) => Err(KafkaError::Kafka {
                what: format!("producing batch {batch} to {partition}"),
                source: Box::new(source),
            }),
        });
        self.refused(delivered.map_err(|e| self.fenced_or(e)))
    }

    /// `error` as `Fenced` when the producer failed for good because a newer
    /// producer of its transactional id fenced it: a send or a flush then says
    /// only "fatal error", and the producer keeps the reason.
    fn fenced_or(&self, error: KafkaError) -> KafkaError {
        let fatal = matches!(
            &error,
            KafkaError::Kafka { source, .. }
                if source.rdkafka_error_code() == Some(RDKafkaErrorCode::Fatal)
        );
        let fenced = fatal
            && matches!(
                self.producer.client().fatal_error(),
                Some((
                    RDKafkaErrorCode::Fenced
                        | RDKafkaErrorCode::ProducerFenced
                        | RDKafkaErrorCode::InvalidProducerEpoch,
                    _
                ))
            );
        match (error, &self.transactions) {
            (KafkaError::Kafka { source, .. }, Some(t)) if fenced => KafkaError::Fenced {
                transactional_id: t.id.clone(),
                source,
            },
            (error, _) => error,
        }
    }
}

/// The producer's context: it keeps the first failed delivery. Successes are
/// not reported (`delivery.report.only.error`), as a report per record costs
/// more than producing it; a batch waits for all of them with one flush.
#[derive(Default)]
pub struct Deliveries {
    failed: Mutex<Option<(String, RdKafkaError)>>,
    refusals: Refusals,
}

impl Deliveries {
    fn take_failure(&self) -> Option<(String, RdKafkaError)> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl ClientContext for Deliveries {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        crate::route_log(&self.refusals, level, facility, message);
    }

    fn error(&self, error: RdKafkaError, reason: &str) {
        crate::route_error(&self.refusals, &error, reason);
    }
}

/// A client of the output cluster with the sink's security options only: the
/// consumer of the transactions' group and the admin client that reads the
/// broker's limits.
fn security_config(config: &KafkaSinkConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    for (key, value) in &config.client_options {
        if crate::is_security_option(key) {
            client.set(key, value);
        }
    }
    client
}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((error, message)) = result {
            let mut failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
            if failed.is_none() {
                *failed = Some((
                    format!("{}-{}", message.topic(), message.partition()),
                    error.clone(),
                ));
            }
        }
    }
}

/// A column of a query's rows that the sink reads, as Spark's Kafka sink does:
/// `value` (required), `key`, `headers`, `topic` and `partition`.
const ROW_COLUMNS: [&str; 5] = ["value", "key", "headers", "topic", "partition"];

impl KafkaSink {
    /// Checks a query's output against what the sink reads: a `value` column of
    /// text or bytes; optionally `key` (text or bytes), `headers` (a list of
    /// `key`, `value` structs), `topic` (text) and `partition` (an int); and no
    /// other column, which would be lost.
    pub fn check_rows(schema: &arrow::datatypes::Schema) -> Result<(), KafkaError> {
        use arrow::datatypes::DataType;
        let bytes = |t: &DataType| {
            matches!(
                t,
                DataType::Utf8
                    | DataType::LargeUtf8
                    | DataType::Utf8View
                    | DataType::Binary
                    | DataType::LargeBinary
                    | DataType::BinaryView
            )
        };
        let problem = |what: String| Err(KafkaError::Config(format!("kafka sink: {what}")));
        if schema.index_of("value").is_err() {
            return problem(
                "the query must output a `value` column, the record's value (SELECT ... AS value); \
                 to_json(named_struct(...)) makes one of several columns"
                    .to_owned(),
            );
        }
        for field in schema.fields() {
            let ok = match field.name().as_str() {
                "value" | "key" => bytes(field.data_type()),
                "topic" => matches!(
                    field.data_type(),
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
                ),
                "partition" => matches!(field.data_type(), DataType::Int32 | DataType::Int64),
                "headers" => matches!(field.data_type(), DataType::List(_)),
                other => {
                    return problem(format!(
                        "the query outputs column `{other}`, which the sink does not write; it \
                         writes {}: put `{other}` into the value, or leave it out",
                        ROW_COLUMNS.join(", ")
                    ));
                }
            };
            if !ok {
                return problem(format!(
                    "column `{}` is {}, which the sink cannot write there; CAST it to STRING \
                     (value, key, topic), INT (partition), or make headers a list of key-value \
                     structs",
                    field.name(),
                    field.data_type()
                ));
            }
        }
        Ok(())
    }

    /// Produces one message, waiting while the producer's queue is full.
    async fn produce(&mut self, message: Outgoing<'_>) -> Result<(), KafkaError> {
        let Outgoing {
            topic,
            key,
            value,
            partition,
            timestamp_ms,
            headers,
            position,
        } = message;
        let mut out = BaseRecord::<[u8], [u8]>::to(topic).headers(headers);
        if let Some(key) = key {
            out = out.key(key);
        }
        if let Some(value) = value {
            out = out.payload(value);
        }
        if let Some(partition) = partition {
            out = out.partition(partition);
        }
        if let Some(ms) = timestamp_ms {
            out = out.timestamp(ms);
        }
        loop {
            match self.producer.send(out) {
                Ok(()) => return Ok(()),
                Err((RdKafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    // Backpressure, not a retry: the producer's queue is full,
                    // and its thread drains it.
                    out = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err((source, _)) => {
                    return Err(self.fenced_or(KafkaError::Kafka {
                        what: format!("producing {position} to {topic}"),
                        source: Box::new(source),
                    }));
                }
            }
        }
    }

    /// The headers Sluice adds, naming the query, the batch and the position.
    fn sluice_headers(&self, headers: OwnedHeaders, position: &str) -> OwnedHeaders {
        headers
            .insert(Header {
                key: "sluice.query",
                value: Some(self.query_id.as_bytes()),
            })
            .insert(Header {
                key: "sluice.batch",
                value: Some(self.batch_text.as_bytes()),
            })
            .insert(Header {
                key: "sluice.position",
                value: Some(position.as_bytes()),
            })
    }
}

/// One message to produce.
struct Outgoing<'a> {
    topic: &'a str,
    key: Option<&'a [u8]>,
    value: Option<&'a [u8]>,
    partition: Option<i32>,
    timestamp_ms: Option<i64>,
    headers: OwnedHeaders,
    /// Where it comes from, for error messages.
    position: &'a str,
}

/// The bytes of row `i` of a text or bytes column.
fn bytes_at(array: &dyn arrow::array::Array, i: usize) -> Option<&[u8]> {
    use arrow::array::AsArray;
    use arrow::datatypes::DataType;
    if array.is_null(i) {
        return None;
    }
    Some(match array.data_type() {
        DataType::Utf8 => array.as_string::<i32>().value(i).as_bytes(),
        DataType::LargeUtf8 => array.as_string::<i64>().value(i).as_bytes(),
        DataType::Utf8View => array.as_string_view().value(i).as_bytes(),
        DataType::Binary => array.as_binary::<i32>().value(i),
        DataType::LargeBinary => array.as_binary::<i64>().value(i),
        DataType::BinaryView => array.as_binary_view().value(i),
        _ => return None,
    })
}

impl Writes<arrow::array::RecordBatch> for KafkaSink {
    async fn write(&mut self, rows: &arrow::array::RecordBatch) -> Result<(), KafkaError> {
        use arrow::array::{Array, AsArray};
        use arrow::datatypes::{DataType, Int32Type, Int64Type};
        Self::check_rows(&rows.schema())?;
        let column = |name: &str| {
            rows.schema()
                .index_of(name)
                .ok()
                .map(|i| rows.column(i).clone())
        };
        let (value, key, topic, partition, headers) = (
            column("value"),
            column("key"),
            column("topic"),
            column("partition"),
            column("headers"),
        );
        for i in 0..rows.num_rows() {
            let position = format!("{}#{}", self.batch_text, self.rows);
            self.rows += 1;
            let mut extra = OwnedHeaders::new();
            if let Some(headers) = &headers
                && !headers.is_null(i)
            {
                let list = headers.as_list::<i32>().value(i);
                if let Some(entries) = list.as_struct_opt() {
                    for h in 0..entries.len() {
                        let name = bytes_at(entries.column(0).as_ref(), h)
                            .map(|b| String::from_utf8_lossy(b).into_owned())
                            .unwrap_or_default();
                        let value = if entries.num_columns() > 1 {
                            bytes_at(entries.column(1).as_ref(), h)
                        } else {
                            None
                        };
                        extra = extra.insert(Header {
                            key: name.as_str(),
                            value,
                        });
                    }
                }
            }
            let headers = self.sluice_headers(extra, &position);
            let target = topic
                .as_ref()
                .and_then(|t| bytes_at(t.as_ref(), i))
                .map(|t| String::from_utf8_lossy(t).into_owned())
                .unwrap_or_else(|| self.topic.clone());
            let partition = partition.as_ref().and_then(|p| {
                if p.is_null(i) {
                    return None;
                }
                match p.data_type() {
                    DataType::Int32 => Some(p.as_primitive::<Int32Type>().value(i)),
                    DataType::Int64 => i32::try_from(p.as_primitive::<Int64Type>().value(i)).ok(),
                    _ => None,
                }
            });
            let value = value.as_ref().and_then(|v| bytes_at(v.as_ref(), i));
            let key = key.as_ref().and_then(|k| bytes_at(k.as_ref(), i));
            self.produce(Outgoing {
                topic: &target,
                key,
                value,
                partition,
                timestamp_ms: None,
                headers,
                position: &position,
            })
            .await?;
        }
        Ok(())
    }
}

impl Sink for KafkaSink {
    type Error = KafkaError;

    async fn take_over(&mut self) -> Result<(), KafkaError> {
        self.take_over_transactions().await
    }

    fn is_fenced(error: &KafkaError) -> bool {
        matches!(error, KafkaError::Fenced { .. })
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), KafkaError> {
        if self.transactions.is_some() {
            // An attempt begun again: what it produced is aborted, unseen.
            self.ensure_ready().await?;
            self.abort_open().await?;
            self.transaction_call(format!("beginning the transaction of batch {batch}"), |p| {
                p.begin_transaction()
            })
            .await?;
            if let Some(t) = self.transactions.as_mut() {
                t.open = true;
                t.ranges = ranges.to_vec();
            }
            self.send_offsets(batch)?;
        }
        // At least once, a batch begun again is produced again in full; what an
        // abandoned attempt produced stays, as at least once allows.
        self.producer.context().take_failure();
        self.batch = batch;
        self.batch_text = batch.to_string();
        self.rows = 0;
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), KafkaError> {
        if let Err(e) = self.flush().await {
            return Err(self.fail_transaction(e).await);
        }
        if self.transactions.is_some() {
            return match self.commit_open(batch).await {
                Ok(()) => Ok(()),
                Err(e @ KafkaError::Aborted { .. }) if requires_abort(&e) => {
                    Err(self.fail_transaction(e).await)
                }
                // Whether the commit went through is not known: the next runner's
                // `init_transactions` settles it, and `delivered` reads the outcome.
                Err(KafkaError::Aborted { what, source }) => {
                    Err(KafkaError::CommitUnknown { what, source })
                }
                Err(e) => Err(e),
            };
        }
        Ok(())
    }

    fn is_transient(error: &KafkaError) -> bool {
        match error {
            KafkaError::Aborted { .. } => true,
            // At least once, a batch whose records were not all acknowledged is
            // produced again; its duplicates carry the same dedupe headers.
            KafkaError::Kafka { source, .. } => retriable(source),
            _ => false,
        }
    }

    async fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<bool, KafkaError> {
        if self.transactions.is_none() || ranges.is_empty() {
            return Ok(false);
        }
        // The previous runner's transaction is committed or aborted once this
        // returns, so the offsets read next are final.
        self.ensure_ready().await?;
        let Some(t) = self.transactions.as_ref() else {
            return Ok(false);
        };
        let mut wanted = TopicPartitionList::new();
        for range in ranges {
            let tp = &range.topic_partition;
            wanted.add_partition(&tp.topic, tp.partition);
        }
        let group = t.group.clone();
        let id = t.id.clone();
        let committed =
            off_thread(move || group.committed_offsets(wanted, TRANSACTION_CALL_TIMEOUT))
                .await?
                .map_err(|source| KafkaError::Kafka {
                    what: format!("reading the offsets of group {id}"),
                    source: Box::new(source),
                })?;
        let marker = batch_marker(batch);
        Ok(ranges.iter().all(|range| {
            let tp = &range.topic_partition;
            committed
                .find_partition(&tp.topic, tp.partition)
                .is_some_and(|e| {
                    e.offset() == KafkaOffset::Offset(range.until.value()) && e.metadata() == marker
                })
        }))
    }
}

impl Writes for KafkaSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), KafkaError> {
        for record in records {
            let position = format!(
                "{}-{}@{}",
                record.topic(),
                record.partition(),
                record.offset()
            );
            let mut headers = OwnedHeaders::new_with_capacity(record.header_count() + 3);
            for (key, value) in record.headers() {
                headers = headers.insert(Header { key, value });
            }
            let headers = self.sluice_headers(headers, &position);
            let topic = self.topic.clone();
            self.produce(Outgoing {
                topic: &topic,
                key: record.key(),
                value: record.value(),
                partition: None,
                timestamp_ms: record.timestamp_ms(),
                headers,
                position: &position,
            })
            .await?;
        }
        Ok(())
    }
}

/// Whether a failed transaction call left the transaction to be aborted.
/// Whether a produce or flush failure may go away when the batch is produced
/// again: the cluster was away or slow, not the record or the rights wrong. A
/// transaction's errors are classified apart, as fenced, aborted or unknown.
fn retriable(error: &RdKafkaError) -> bool {
    if matches!(error, RdKafkaError::Transaction(_)) {
        return false;
    }
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageTimedOut
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::QueueFull
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::NotEnoughReplicas
                | RDKafkaErrorCode::NotEnoughReplicasAfterAppend
                | RDKafkaErrorCode::NotCoordinator
                | RDKafkaErrorCode::CoordinatorNotAvailable
                | RDKafkaErrorCode::Resolve
        )
    )
}

fn requires_abort(error: &KafkaError) -> bool {
    match error {
        KafkaError::Aborted { source, .. } => match source.as_ref() {
            RdKafkaError::Transaction(e) => e.txn_requires_abort(),
            _ => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kafka(code: RDKafkaErrorCode) -> KafkaError {
        KafkaError::Kafka {
            what: "producing batch 3 to out-0".to_owned(),
            source: Box::new(RdKafkaError::MessageProduction(code)),
        }
    }

    fn config(delivery: Delivery, options: &[(&str, &str)]) -> KafkaSinkConfig {
        KafkaSinkConfig {
            bootstrap_servers: "127.0.0.1:1".to_owned(),
            topic: "out".to_owned(),
            client_options: options
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            delivery,
        }
    }

    #[test]
    fn the_transactional_producer_backs_off_briefly_unless_told_otherwise() {
        let backoff = |delivery, options: &[(&str, &str)]| {
            let sink = KafkaSink::new(config(delivery, options), "q").unwrap();
            sink.client.get("retry.backoff.ms").map(str::to_owned)
        };
        assert_eq!(
            backoff(Delivery::ExactlyOnce, &[]).as_deref(),
            Some(TRANSACTIONAL_RETRY_BACKOFF_MS)
        );
        assert_eq!(
            backoff(Delivery::ExactlyOnce, &[("retry.backoff.ms", "250")]).as_deref(),
            Some("250")
        );
        assert_eq!(backoff(Delivery::AtLeastOnce, &[]), None);
    }

    #[test]
    fn a_cluster_away_is_retried_and_a_refused_record_or_an_unknown_commit_is_not() {
        let transient = <KafkaSink as Sink>::is_transient;
        assert!(transient(&kafka(RDKafkaErrorCode::MessageTimedOut)));
        assert!(transient(&kafka(RDKafkaErrorCode::AllBrokersDown)));
        assert!(transient(&KafkaError::Kafka {
            what: "flushing batch 3".to_owned(),
            source: Box::new(RdKafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)),
        }));
        assert!(!transient(&kafka(RDKafkaErrorCode::MessageSizeTooLarge)));
        assert!(!transient(&kafka(
            RDKafkaErrorCode::TopicAuthorizationFailed
        )));
        let timed_out = || Box::new(RdKafkaError::Flush(RDKafkaErrorCode::OperationTimedOut));
        assert!(transient(&KafkaError::Aborted {
            what: "flushing batch 3".to_owned(),
            source: timed_out(),
        }));
        assert!(!transient(&KafkaError::CommitUnknown {
            what: "committing the transaction of batch 3".to_owned(),
            source: timed_out(),
        }));
    }
}
