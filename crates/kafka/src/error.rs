//! Errors of the Kafka source, naming the partitions and offsets concerned.

use rdkafka::error::KafkaError as RdKafkaError;
use sluice_core::{DataLoss, Offset, TopicPartition};

/// An error of the Kafka source.
#[derive(Debug, thiserror::Error)]
pub enum KafkaError {
    /// A client option that Sluice sets itself.
    #[error("Kafka option `{option}` is set by Sluice and cannot be given: {reason}")]
    OwnedOption {
        /// The option as given.
        option: String,
        /// Why Sluice owns it.
        reason: &'static str,
    },
    /// Configuration that cannot work.
    #[error("invalid Kafka source configuration: {0}")]
    Config(String),
    /// The subscribe pattern is not a regular expression.
    #[error("invalid subscribe_pattern {pattern:?}: {source}")]
    Pattern {
        /// The pattern as given.
        pattern: String,
        /// Why it does not compile.
        #[source]
        source: Box<regex::Error>,
    },
    /// librdkafka refused the client configuration.
    #[error("creating the Kafka client for {bootstrap} failed: {source}")]
    Client {
        /// The bootstrap servers.
        bootstrap: String,
        /// librdkafka's error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// A metadata or offsets request failed, typically because no broker answers.
    #[error("cannot reach Kafka at {bootstrap}: {what} failed: {source}")]
    Unreachable {
        /// The bootstrap servers.
        bootstrap: String,
        /// The request, e.g. `listing offsets of 12 partitions`.
        what: String,
        /// The error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// The cluster turned the client away: a failed login, an untrusted
    /// certificate, or a listener of another security protocol. Not retried.
    #[error(
        "Kafka at {bootstrap} refused this client ({what} failed): {why}; check \
         security.protocol and the sasl.* and ssl.* options"
    )]
    Refused {
        /// The bootstrap servers.
        bootstrap: String,
        /// The request that failed.
        what: String,
        /// The broker's reason, as librdkafka reported it.
        why: String,
    },
    /// Starting by timestamp found no record at or after it.
    #[error(
        "{topic_partition}: no record has a timestamp at or after {timestamp_ms}; set \
         starting_offsets_by_timestamp_strategy = \"latest\" to start at the end instead"
    )]
    NoOffsetForTimestamp {
        /// The partition.
        topic_partition: TopicPartition,
        /// The requested epoch milliseconds.
        timestamp_ms: i64,
    },
    /// Starting from the consumer group found no committed offset.
    #[error("{topic_partition}: consumer group {group} has no committed offset for this partition")]
    NoCommittedOffset {
        /// The partition.
        topic_partition: TopicPartition,
        /// The consumer group.
        group: String,
    },
    /// Offsets a batch needs are gone and `fail_on_data_loss` is set.
    #[error("{}", sluice_core::data_loss_report(.0))]
    DataLoss(Vec<DataLoss>),
    /// A read made no progress for `poll_timeout` while records were still owed.
    #[error(
        "reading {topic_partition} [{from}, {until}) made no progress for {timeout_ms} ms: \
         offsets before {reached} were read, [{reached}, {until}) are still owed; is the \
         broker up, or is a transaction holding the partition open? (poll_timeout_ms)"
    )]
    PollTimeout {
        /// The partition.
        topic_partition: TopicPartition,
        /// The planned start.
        from: Offset,
        /// The planned end.
        until: Offset,
        /// The first offset not yet read.
        reached: Offset,
        /// The timeout.
        timeout_ms: u128,
    },
    /// The consumer group of a query in group mode cannot be used as configured.
    #[error("{what}: {problem}")]
    Group {
        /// What was being done.
        what: String,
        /// What is wrong.
        problem: String,
    },
    /// A Kafka call failed.
    #[error("{what} failed: {source}")]
    Kafka {
        /// What was being done.
        what: String,
        /// librdkafka's error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// Kafka fenced the sink's producer: a newer runner of the query took its
    /// transactional id over, or the broker aborted a transaction that
    /// outlived `transaction.timeout.ms`, which fences the same way.
    #[error(
        "the kafka sink's transactional id {transactional_id} was taken over by a newer runner \
         of the query, or its transaction outlived sink.kafka.\"transaction.timeout.ms\" and \
         the broker aborted it (Kafka fenced this producer: {source}); this runner stops and \
         writes nothing more. If no other runner was started, raise the timeout above the \
         longest batch and run again: the batch is written again, once"
    )]
    Fenced {
        /// The transactional id.
        transactional_id: String,
        /// librdkafka's error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// A transaction failed in a way that aborting it and writing the batch
    /// again cures (a broker restart, a transaction that timed out).
    #[error("{what} failed, and the transaction was aborted: {source}")]
    Aborted {
        /// What was being done.
        what: String,
        /// librdkafka's error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// A transaction's commit failed without saying whether it went through.
    /// Writing the batch again in this process could write it twice, so the
    /// runner stops; the next start's `init_transactions` settles the
    /// transaction, and recovery reads whether the batch reached Kafka.
    #[error(
        "{what} failed, and whether it went through is not known: {source}; this runner stops, \
         and the next start finds out and writes the batch again only if it is missing"
    )]
    CommitUnknown {
        /// What was being done.
        what: String,
        /// librdkafka's error.
        #[source]
        source: Box<RdKafkaError>,
    },
    /// The blocking Kafka task did not finish.
    #[error("Kafka I/O task failed: {0}")]
    Task(String),
}
