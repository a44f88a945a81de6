//! Blocking requests to the cluster (metadata, offsets by timestamp, committed
//! offsets). Each is one attempt, sent once and bounded by the request timeout:
//! the executor's retry policy decides whether and when to try again, so that no
//! request is retried inside a retry. Callers run them on tokio's blocking pool.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::metadata::Metadata;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};
use regex::Regex;
use sluice_core::{Offset, OffsetBounds, PartitionOffsets, TopicPartition};

use crate::refusal::Refusals;
use crate::{KafkaError, KafkaSourceConfig, SourceContext, discovery};

/// How often a caller waiting for an answer serves the client's queue, which
/// is how soon a refusal ends the wait and librdkafka's log lines come out.
const SERVE_EVERY: Duration = Duration::from_millis(50);

/// What a ListOffsets request asks for each partition.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Position {
    /// The log start offset.
    Earliest,
    /// The end offset (the last stable offset under read_committed).
    Latest,
    /// The first offset whose timestamp is at or after these epoch milliseconds.
    Timestamp(i64),
}

/// The consumer used for requests and reads, with the settings requests need.
pub(crate) struct Client {
    /// Shared with the thread a request runs on, which may outlive the wait
    /// for it when the cluster refused the client.
    pub(crate) consumer: Arc<BaseConsumer<SourceContext>>,
    /// What the consumers' error callbacks saw of a cluster refusing them.
    pub(crate) refusals: Refusals,
    /// The settings of the consumer that reads batches. It is a consumer of its
    /// own, so that its fetches, which long-poll at a partition's end, never hold
    /// back a metadata or offsets request on the same connection.
    pub(crate) reader_config: rdkafka::ClientConfig,
    pub(crate) config: KafkaSourceConfig,
    pub(crate) group_id: String,
    pub(crate) pattern: Option<Regex>,
    /// The topic names discovery has seen, shared by every discovery's partitions.
    pub(crate) names: std::sync::Mutex<std::collections::BTreeSet<std::sync::Arc<str>>>,
}

impl Client {
    /// Sends `request` once, naming the cluster and the request if it fails,
    /// and the broker's reason when it refused the client rather than not
    /// answering.
    ///
    /// librdkafka tells of a refusal (a failed login or handshake) only through
    /// the client's queue, while a request to a cluster that refuses waits out its
    /// whole timeout as if no broker were up. So the request runs on a thread of
    /// its own with the whole `request_timeout`, and the caller serves the queue
    /// while it waits: a refusal ends the wait at once (the request thread ends
    /// with its timeout and its answer is dropped), and librdkafka's log lines
    /// come out when they happen.
    fn request<T: Send + 'static>(
        &self,
        what: impl Fn() -> String,
        request: impl FnOnce(&BaseConsumer<SourceContext>, Duration) -> Result<T, RdKafkaError>
        + Send
        + 'static,
    ) -> Result<T, KafkaError> {
        let consumer = Arc::clone(&self.consumer);
        let timeout = self.config.request_timeout;
        let (send, answer) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("sluice-request".to_owned())
            .spawn(move || {
                // The caller may have stopped waiting; the answer is then dropped.
                let _ = send.send(request(&consumer, timeout));
            })
            .map_err(|e| KafkaError::Task(format!("starting a thread for {}: {e}", what())))?;
        let refused = |why| KafkaError::Refused {
            bootstrap: self.config.bootstrap_servers.clone(),
            what: what(),
            why,
        };
        let result = loop {
            match answer.recv_timeout(SERVE_EVERY) {
                Ok(result) => break result,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(KafkaError::Task(format!(
                        "{} stopped without an answer",
                        what()
                    )));
                }
            }
            self.serve_queue();
            if let Some(why) = self.refusals.last() {
                return Err(refused(why));
            }
        };
        self.serve_queue();
        match result {
            Ok(answer) => {
                self.refusals.clear();
                Ok(answer)
            }
            Err(source) => match self.refusals.last() {
                Some(why) => Err(refused(why)),
                None => Err(KafkaError::Unreachable {
                    bootstrap: self.config.bootstrap_servers.clone(),
                    what: what(),
                    source: Box::new(source),
                }),
            },
        }
    }

    /// Serves the request consumer's queue: librdkafka's log lines and errors.
    /// It is assigned no partition, so no record is taken from it.
    fn serve_queue(&self) {
        while let Some(event) = self.consumer.poll(Duration::ZERO) {
            if let Err(error) = event {
                tracing::debug!(target: "librdkafka", %error, "the request consumer's queue");
            }
        }
    }

    fn metadata(&self) -> Result<Metadata, KafkaError> {
        // One topic's metadata when the selection names exactly one, else all.
        let single = match &self.config.selection {
            crate::TopicSelection::Subscribe(topics) if topics.len() == 1 => {
                Some(topics[0].clone())
            }
            crate::TopicSelection::Assign(topics) if topics.len() == 1 => {
                topics.keys().next().cloned()
            }
            _ => None,
        };
        self.request(
            || "fetching metadata".to_owned(),
            move |consumer, wait| consumer.fetch_metadata(single.as_deref(), wait),
        )
    }

    /// The selected partitions and their watermarks.
    pub(crate) fn partitions(&self) -> Result<BTreeMap<TopicPartition, OffsetBounds>, KafkaError> {
        let metadata = self.metadata()?;
        let selected = {
            let mut names = self
                .names
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            discovery::select(
                &self.config.selection,
                self.pattern.as_ref(),
                &metadata,
                &mut names,
            )
        };
        let earliest = self.list_offsets(&selected, Position::Earliest)?;
        let latest = self.list_offsets(&selected, Position::Latest)?;
        Ok(selected
            .into_iter()
            .filter_map(|tp| {
                let low = earliest.get(&tp).copied().flatten()?;
                let high = latest.get(&tp).copied().flatten()?.max(low);
                Some((tp, OffsetBounds { low, high }))
            })
            .collect())
    }

    /// One ListOffsets round for every partition at once. `None` for a partition
    /// means Kafka has no such offset (a timestamp after the last record).
    pub(crate) fn list_offsets(
        &self,
        partitions: &BTreeSet<TopicPartition>,
        position: Position,
    ) -> Result<BTreeMap<TopicPartition, Option<Offset>>, KafkaError> {
        let queries = partitions.iter().map(|tp| (tp.clone(), position)).collect();
        self.list_offsets_at(&queries)
    }

    /// Like `list_offsets`, with a position per partition.
    pub(crate) fn list_offsets_at(
        &self,
        queries: &BTreeMap<TopicPartition, Position>,
    ) -> Result<BTreeMap<TopicPartition, Option<Offset>>, KafkaError> {
        if queries.is_empty() {
            return Ok(BTreeMap::new());
        }
        let mut request = TopicPartitionList::with_capacity(queries.len());
        for (tp, position) in queries {
            let query = match position {
                Position::Earliest => KafkaOffset::Beginning,
                Position::Latest => KafkaOffset::End,
                Position::Timestamp(ms) => KafkaOffset::Offset(*ms),
            };
            request
                .add_partition_offset(&tp.topic, tp.partition, query)
                .map_err(|source| KafkaError::Kafka {
                    what: format!("asking for offsets of {tp}"),
                    source: Box::new(source),
                })?;
        }
        let answer = self.request(
            || format!("listing offsets of {} partitions", queries.len()),
            move |consumer, wait| {
                let answer = consumer.offsets_for_times(request, wait)?;
                // A partition-level error fails the round, so that it is retried whole.
                for elem in answer.elements() {
                    elem.error()?;
                }
                Ok(answer)
            },
        )?;
        Ok(offsets_of(&answer))
    }

    /// The consumer group's committed offsets; `None` where it has none.
    pub(crate) fn committed(
        &self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> Result<BTreeMap<TopicPartition, Option<Offset>>, KafkaError> {
        let mut request = TopicPartitionList::with_capacity(partitions.len());
        for tp in partitions {
            request.add_partition(&tp.topic, tp.partition);
        }
        let answer = self.request(
            || format!("reading the committed offsets of group {}", self.group_id),
            move |consumer, wait| consumer.committed_offsets(request, wait),
        )?;
        Ok(offsets_of(&answer))
    }

    /// Commits `offsets` (next offsets to read, as Kafka expects) to the group.
    pub(crate) fn commit(&self, offsets: &PartitionOffsets) -> Result<(), KafkaError> {
        let mut list = TopicPartitionList::with_capacity(offsets.len());
        for (tp, offset) in offsets {
            list.add_partition_offset(&tp.topic, tp.partition, KafkaOffset::Offset(offset.value()))
                .map_err(|source| KafkaError::Kafka {
                    what: format!("committing {tp} at {offset}"),
                    source: Box::new(source),
                })?;
        }
        self.consumer
            .commit(&list, rdkafka::consumer::CommitMode::Sync)
            .map_err(|source| KafkaError::Kafka {
                what: format!("committing progress to consumer group {}", self.group_id),
                source: Box::new(source),
            })
    }
}

/// The offsets of an answer per partition; `None` where Kafka gave no offset
/// (no record at a timestamp, no committed offset).
fn offsets_of(answer: &TopicPartitionList) -> BTreeMap<TopicPartition, Option<Offset>> {
    answer
        .elements()
        .into_iter()
        .map(|elem| {
            let offset = match elem.offset() {
                KafkaOffset::Offset(n) => Offset::new(n),
                _ => None,
            };
            (TopicPartition::new(elem.topic(), elem.partition()), offset)
        })
        .collect()
}
