//! Blocking requests to the cluster (metadata, offsets by timestamp, committed
//! offsets). Each is one attempt, bounded by the request timeout: the executor's
//! retry policy decides whether and when to try again, so that no request is
//! retried inside a retry. (Within the timeout, a request that got no answer is
//! sent again, see `Client::request`.) Callers run them on tokio's blocking pool.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::metadata::Metadata;
use rdkafka::{Offset as KafkaOffset, TopicPartitionList};
use regex::Regex;
use sluice_core::{Offset, OffsetBounds, PartitionOffsets, TopicPartition};

use crate::refusal::Refusals;
use crate::{KafkaError, KafkaSourceConfig, SourceContext, discovery};

/// The first slice of a request's wait; each next one is twice as long.
const FIRST_SLICE: Duration = Duration::from_millis(250);

/// Whether a request failed for want of an answer (no broker up yet, or none
/// answered in time), rather than with the cluster's answer.
fn unanswered(error: &RdKafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        error.rdkafka_error_code(),
        Some(
            Code::OperationTimedOut
                | Code::RequestTimedOut
                | Code::BrokerTransportFailure
                | Code::AllBrokersDown
                | Code::NetworkException
                | Code::Resolve
        )
    )
}

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
    pub(crate) consumer: BaseConsumer<SourceContext>,
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
    /// Runs `request`, naming the cluster and the request if it fails, and the
    /// broker's reason when it refused the client rather than not answering.
    ///
    /// librdkafka tells of a refusal (a failed login or handshake) only through
    /// the client's queue, while a request to a cluster that refuses waits out its
    /// whole timeout as if no broker were up. So the request waits in slices
    /// that double (250 ms, 500 ms, ...), within `request_timeout` in all, and
    /// the queue is served between them: a refusal ends the wait at once, and
    /// librdkafka's log lines come out when they happen. Only a request that got
    /// no answer is sent again within the timeout; retrying after it is the
    /// executor's.
    fn request<T>(
        &self,
        what: impl Fn() -> String,
        mut request: impl FnMut(Duration) -> Result<T, RdKafkaError>,
    ) -> Result<T, KafkaError> {
        let deadline = Instant::now() + self.config.request_timeout;
        let mut slice = FIRST_SLICE;
        loop {
            let wait = slice.min(deadline.saturating_duration_since(Instant::now()));
            let result = request(wait);
            self.serve_queue();
            let source = match result {
                Ok(answer) => {
                    self.refusals.clear();
                    return Ok(answer);
                }
                Err(source) => source,
            };
            if let Some(why) = self.refusals.last() {
                return Err(KafkaError::Refused {
                    bootstrap: self.config.bootstrap_servers.clone(),
                    what: what(),
                    why,
                });
            }
            if Instant::now() >= deadline || !unanswered(&source) {
                return Err(KafkaError::Unreachable {
                    bootstrap: self.config.bootstrap_servers.clone(),
                    what: what(),
                    source: Box::new(source),
                });
            }
            slice = slice.saturating_mul(2);
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
            |wait| self.consumer.fetch_metadata(single.as_deref(), wait),
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
            |wait| {
                let answer = self.consumer.offsets_for_times(request.clone(), wait)?;
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
            |wait| self.consumer.committed_offsets(request.clone(), wait),
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
