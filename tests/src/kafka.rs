//! Kafka helpers for the integration tests: clients for the test broker, topics
//! and producing records.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

/// How long test requests may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// A client configuration pointing at the test broker.
pub fn client_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", crate::kafka_bootstrap());
    config
}

/// An admin client for the test broker.
pub fn admin() -> AdminClient<DefaultClientContext> {
    client_config()
        .create()
        .expect("an admin client for the test broker")
}

/// Creates `name` with `partitions` partitions, retrying while a topic of the
/// same name is still being deleted.
pub async fn create_topic(name: &str, partitions: i32) {
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let options = AdminOptions::new().operation_timeout(Some(TIMEOUT));
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let results = admin()
            .create_topics([&topic], &options)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "creating topic {name} on {} failed: {e}; is Kafka up (cargo xtask up)?",
                    crate::kafka_bootstrap()
                )
            });
        match results.into_iter().next().expect("one result") {
            Ok(_) => return,
            Err(_) if std::time::Instant::now() < deadline => {
                // The previous topic of this name may still be being deleted.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err((topic, code)) => panic!("creating topic {topic} failed: {code}"),
        }
    }
}

/// Deletes a topic, best effort: a leftover topic has a unique name and harms no
/// later run.
pub async fn delete_topic(name: &str) {
    let _ = admin().delete_topics(&[name], &AdminOptions::new()).await;
}

/// A producer that waits for every replica.
pub fn producer() -> FutureProducer {
    client_config()
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .create()
        .expect("a producer for the test broker")
}

/// One record to produce.
pub struct Out {
    /// The partition.
    pub partition: i32,
    /// The key.
    pub key: String,
    /// The value.
    pub value: String,
    /// Epoch milliseconds to set as the create time, if any.
    pub timestamp_ms: Option<i64>,
    /// Headers as (name, value) pairs.
    pub headers: Vec<(String, String)>,
}

impl Out {
    /// A record with a key and value and nothing else.
    pub fn new(partition: i32, key: impl Into<String>, value: impl Into<String>) -> Out {
        Out {
            partition,
            key: key.into(),
            value: value.into(),
            timestamp_ms: None,
            headers: Vec::new(),
        }
    }
}

/// Produces `records` to `topic` and waits until all are acknowledged.
pub async fn produce(producer: &FutureProducer, topic: &str, records: &[Out]) {
    use rdkafka::message::{Header, OwnedHeaders};
    let mut deliveries = Vec::with_capacity(records.len());
    for r in records {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &r.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(topic)
            .partition(r.partition)
            .key(&r.key)
            .payload(&r.value)
            .headers(headers);
        if let Some(ts) = r.timestamp_ms {
            record = record.timestamp(ts);
        }
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((e, _)) => panic!("queueing a record for {topic} failed: {e}"),
        }
    }
    for delivery in deliveries {
        let outcome = delivery.await.expect("the producer stays open");
        if let Err((e, _)) = outcome {
            panic!("a record to {topic} was not acknowledged: {e}");
        }
    }
    producer.flush(TIMEOUT).expect("flushing the producer");
}

/// Produces values of any bytes, or none (tombstones), each to its partition,
/// and waits until all are acknowledged.
pub async fn produce_values(
    producer: &FutureProducer,
    topic: &str,
    values: &[(i32, Option<Vec<u8>>)],
) {
    let mut deliveries = Vec::with_capacity(values.len());
    for (partition, value) in values {
        let mut record = FutureRecord::<(), [u8]>::to(topic).partition(*partition);
        if let Some(value) = value {
            record = record.payload(value.as_slice());
        }
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((e, _)) => panic!("queueing a record for {topic} failed: {e}"),
        }
    }
    for delivery in deliveries {
        if let Err((e, _)) = delivery.await.expect("the producer stays open") {
            panic!("a record to {topic} was not acknowledged: {e}");
        }
    }
}

/// `count` records to one partition, valued `<prefix>-<i>`.
pub fn numbered(partition: i32, prefix: &str, count: usize) -> Vec<Out> {
    (0..count)
        .map(|i| Out::new(partition, format!("k{i}"), format!("{prefix}-{i}")))
        .collect()
}
