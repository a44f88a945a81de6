//! Membership in the query's consumer group (`docs/scale-out.md`): Kafka's
//! group coordinator decides which partitions this process runs. The member's
//! consumer subscribes and takes part in rebalances, but reads nothing: it
//! pauses every partition it is given, and the source's own reader reads the
//! planned ranges as it always does.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use rdkafka::TopicPartitionList;
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use sluice_core::{Membership, MembershipChange, Revocation, TopicPartition};
use tokio::sync::mpsc;

use crate::{KafkaError, TopicSelection, refusal, route_error, route_log};

/// How members agree on an assignment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GroupProtocol {
    /// The classic protocol with the cooperative-sticky assignor: a rebalance
    /// moves only the partitions that change hands, and the others keep running.
    #[default]
    Classic,
    /// KIP-848's protocol (`group.protocol = "consumer"`): the broker assigns,
    /// incrementally, and a member's heartbeat carries its changes.
    Consumer,
}

/// What a member needs to join its group.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// The consumer group the members share.
    pub group_id: String,
    /// The topics whose partitions the group shares.
    pub topics: Vec<String>,
    /// How the members agree.
    pub protocol: GroupProtocol,
    /// Further librdkafka options: security, `session.timeout.ms`,
    /// `heartbeat.interval.ms`, `max.poll.interval.ms`, `group.remote.assignor`.
    pub client_options: BTreeMap<String, String>,
}

impl GroupConfig {
    /// The group's topics from a source's selection: only `subscribe` shares
    /// partitions through a group.
    pub fn topics_of(selection: &TopicSelection) -> Result<Vec<String>, KafkaError> {
        match selection {
            TopicSelection::Subscribe(topics) => Ok(topics.clone()),
            TopicSelection::Assign(_) => Err(KafkaError::Group {
                what: "choosing the group's topics".to_owned(),
                problem: "`assign` names the partitions of one process; scale-out shares a \
                          topic's partitions among processes: use `subscribe`"
                    .to_owned(),
            }),
            TopicSelection::SubscribePattern(_) => Err(KafkaError::Group {
                what: "choosing the group's topics".to_owned(),
                problem: "`subscribe_pattern` is not supported with scale-out yet: list the \
                          topics with `subscribe`"
                    .to_owned(),
            }),
        }
    }
}

/// The members the group coordinator knows of for `group_id` now, under
/// either protocol, as `(member id, client id)`: empty when no process of the
/// query runs. A blocking call: run it off the async threads.
pub fn live_members(
    bootstrap_servers: &str,
    group_id: &str,
    client_options: &BTreeMap<String, String>,
) -> Result<Vec<(String, String)>, KafkaError> {
    let mut client = ClientConfig::new();
    for (key, value) in client_options {
        client.set(key, value);
    }
    let admin: BaseConsumer = client
        .set("bootstrap.servers", bootstrap_servers)
        .set("client.id", "sluice-core")
        .create()
        .map_err(|source| KafkaError::Client {
            bootstrap: bootstrap_servers.to_owned(),
            source: Box::new(source),
        })?;
    crate::describe_group::members(admin.client(), group_id, Duration::from_secs(10)).map_err(
        |(code, message)| KafkaError::Kafka {
            what: format!("describing consumer group {group_id} ({message})"),
            source: Box::new(rdkafka::error::KafkaError::AdminOp(code)),
        },
    )
}

enum Event {
    Change(MembershipChange),
    Failed(KafkaError),
}

/// What the rebalance callbacks share with the member.
struct MemberContext {
    refusals: refusal::Refusals,
    events: mpsc::UnboundedSender<Event>,
    assignment: Arc<Mutex<BTreeSet<TopicPartition>>>,
    /// Set once the member leaves: a revocation then goes ahead at once.
    leaving: Arc<AtomicBool>,
}

impl ClientContext for MemberContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        route_log(&self.refusals, level, facility, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        route_error(&self.refusals, &error, reason);
    }
}

fn partitions_of(list: &TopicPartitionList) -> BTreeSet<TopicPartition> {
    list.elements()
        .iter()
        .map(|e| TopicPartition::new(e.topic(), e.partition()))
        .collect()
}

impl MemberContext {
    fn assignment(&self) -> std::sync::MutexGuard<'_, BTreeSet<TopicPartition>> {
        self.assignment
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl ConsumerContext for MemberContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(list) = rebalance else {
            return;
        };
        let partitions = partitions_of(list);
        if partitions.is_empty() {
            return;
        }
        if consumer.assignment_lost() {
            // The session expired: the group may have handed these on already,
            // so there is nothing to wait for, only to stop writing them.
            self.assignment().retain(|tp| !partitions.contains(tp));
            let _ = self
                .events
                .send(Event::Change(MembershipChange::Lost(partitions)));
            return;
        }
        // Gone from the assignment before the member hears of it, so that the
        // generation it begins next does not hold them.
        self.assignment().retain(|tp| !partitions.contains(tp));
        if !self.leaving.load(Ordering::SeqCst) {
            // Kafka hands the partitions on only when this callback returns:
            // it waits here until the member's batch in flight is committed.
            let (done, handed_over) = std::sync::mpsc::channel();
            let revocation = Revocation::new(partitions.clone(), move || {
                let _ = done.send(());
            });
            if self
                .events
                .send(Event::Change(MembershipChange::Revoking(revocation)))
                .is_ok()
            {
                let _ = handed_over.recv();
            }
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                // This consumer only holds the assignment; the source reads.
                if let Err(error) = consumer.pause(list) {
                    tracing::warn!(%error, "pausing the member's newly assigned partitions");
                }
                let partitions = partitions_of(list);
                if partitions.is_empty() {
                    return;
                }
                self.assignment().extend(partitions.iter().cloned());
                let _ = self
                    .events
                    .send(Event::Change(MembershipChange::Assigned(partitions)));
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(error) => {
                tracing::warn!(%error, "the consumer group's rebalance failed");
            }
        }
    }
}

/// This process's membership in the query's consumer group, on a thread of its
/// own that serves the group's rebalances.
pub struct KafkaMembership {
    member: String,
    group_id: String,
    assignment: Arc<Mutex<BTreeSet<TopicPartition>>>,
    events: mpsc::UnboundedReceiver<Event>,
    leaving: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KafkaMembership {
    /// Joins the group as `member` and subscribes to its topics. Partitions
    /// come as [`MembershipChange::Assigned`] once the group has agreed.
    pub fn join(config: &GroupConfig, member: &str) -> Result<KafkaMembership, KafkaError> {
        let mut client = ClientConfig::new();
        for (key, value) in &config.client_options {
            client.set(key, value);
        }
        client
            .set("bootstrap.servers", &config.bootstrap_servers)
            .set("group.id", &config.group_id)
            .set("client.id", format!("sluice-member-{member}"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // Never read, so never reset: the source reads planned ranges.
            .set("auto.offset.reset", "latest");
        match config.protocol {
            GroupProtocol::Classic => {
                client
                    .set("group.protocol", "classic")
                    .set("partition.assignment.strategy", "cooperative-sticky");
            }
            GroupProtocol::Consumer => {
                client.set("group.protocol", "consumer");
            }
        }
        let (sender, events) = mpsc::unbounded_channel();
        let assignment = Arc::new(Mutex::new(BTreeSet::new()));
        let leaving = Arc::new(AtomicBool::new(false));
        let context = MemberContext {
            refusals: refusal::Refusals::default(),
            events: sender.clone(),
            assignment: assignment.clone(),
            leaving: leaving.clone(),
        };
        let consumer: BaseConsumer<MemberContext> =
            client
                .create_with_context(context)
                .map_err(|source| KafkaError::Client {
                    bootstrap: config.bootstrap_servers.clone(),
                    source: Box::new(source),
                })?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|source| KafkaError::Kafka {
                what: format!(
                    "subscribing group {} to {}",
                    config.group_id,
                    config.topics.join(", ")
                ),
                source: Box::new(source),
            })?;
        let stop = leaving.clone();
        let group = config.group_id.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-member".to_owned())
            .spawn(move || serve(consumer, stop, sender, group))
            .map_err(|error| KafkaError::Group {
                what: "starting the member's thread".to_owned(),
                problem: error.to_string(),
            })?;
        Ok(KafkaMembership {
            member: member.to_owned(),
            group_id: config.group_id.clone(),
            assignment,
            events,
            leaving,
            thread: Some(thread),
        })
    }

    /// Leaves the group: its partitions go to the other members at once
    /// instead of after the session timeout. Hand them back first.
    pub async fn leave(mut self) {
        self.leaving.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

/// Serves the group's rebalances until the member leaves. librdkafka calls
/// the rebalance callbacks from `poll`, on this thread.
fn serve(
    consumer: BaseConsumer<MemberContext>,
    leaving: Arc<AtomicBool>,
    events: mpsc::UnboundedSender<Event>,
    group: String,
) {
    while !leaving.load(Ordering::SeqCst) {
        match consumer.poll(Duration::from_millis(100)) {
            // Fetched before its partition was paused: the source reads it.
            None | Some(Ok(_)) => {}
            Some(Err(error)) => {
                if consumer.context().refusals.observe(&error, "") {
                    let _ = events.send(Event::Failed(KafkaError::Kafka {
                        what: format!("joining consumer group {group}"),
                        source: Box::new(error),
                    }));
                    return;
                }
                tracing::warn!(%error, group, "the group member's consumer");
            }
        }
    }
    consumer.unsubscribe();
    // Closing the consumer leaves the group; the revocation it calls back
    // with goes ahead at once, since the member is leaving.
    drop(consumer);
}

impl Drop for KafkaMembership {
    fn drop(&mut self) {
        self.leaving.store(true, Ordering::SeqCst);
    }
}

impl Membership for KafkaMembership {
    type Error = KafkaError;

    fn member(&self) -> &str {
        &self.member
    }

    fn assignment(&self) -> BTreeSet<TopicPartition> {
        self.assignment
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn next_change(&mut self) -> Result<MembershipChange, KafkaError> {
        match self.events.recv().await {
            Some(Event::Change(change)) => Ok(change),
            Some(Event::Failed(error)) => Err(error),
            None => Err(KafkaError::Group {
                what: format!("serving consumer group {}", self.group_id),
                problem: "the member's thread ended".to_owned(),
            }),
        }
    }
}
