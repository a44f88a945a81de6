//! The Kafka broker answers as Sluice needs: topics can be created, records
//! produced to chosen partitions come back in order, and the watermarks match.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Message, Offset, TopicPartitionList};

const PARTITIONS: i32 = 3;
const RECORDS: i32 = 1_000;
const TIMEOUT: Duration = Duration::from_secs(30);

fn client_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", sluice_tests::kafka_bootstrap());
    config
}

fn admin() -> AdminClient<DefaultClientContext> {
    client_config()
        .create()
        .expect("an admin client for the test broker")
}

async fn create_topic(name: &str) {
    let topic = NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1));
    let options = AdminOptions::new().operation_timeout(Some(TIMEOUT));
    let results = admin()
        .create_topics([&topic], &options)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "creating topic {name} on {} failed: {e}; is Kafka up (cargo xtask up)?",
                sluice_tests::kafka_bootstrap()
            )
        });
    for result in results {
        result.unwrap_or_else(|(topic, code)| panic!("creating topic {topic} failed: {code}"));
    }
}

async fn delete_topic(name: &str) {
    // Best effort: a leftover topic has a unique name and harms no later run.
    let _ = admin().delete_topics(&[name], &AdminOptions::new()).await;
}

#[tokio::test]
async fn produces_and_reads_back_a_thousand_records_with_matching_watermarks() {
    let topic = sluice_tests::unique_name("smoke");
    create_topic(&topic).await;

    let producer: FutureProducer = client_config()
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .create()
        .expect("a producer for the test broker");
    // Queue every record first, then wait for the acknowledgements, so the test
    // does not pay one linger interval per record.
    let mut deliveries = Vec::new();
    for i in 0..RECORDS {
        let key = format!("key-{i}");
        let value = format!("value-{i}");
        let record = FutureRecord::to(&topic)
            .partition(i % PARTITIONS)
            .key(&key)
            .payload(&value);
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((e, _)) => panic!("queueing record {i} for {topic} failed: {e}"),
        }
    }
    for (i, delivery) in deliveries.into_iter().enumerate() {
        let outcome = delivery
            .await
            .expect("the producer stays open until every delivery");
        if let Err((e, _)) = outcome {
            panic!("record {i} to {topic} was not acknowledged: {e}");
        }
    }
    producer.flush(TIMEOUT).expect("flushing the producer");

    let consume_topic = topic.clone();
    let (by_partition, watermarks) =
        tokio::task::spawn_blocking(move || read_everything(&consume_topic))
            .await
            .expect("the reading thread");

    for partition in 0..PARTITIONS {
        let expected: Vec<(String, String)> = (0..RECORDS)
            .filter(|i| i % PARTITIONS == partition)
            .map(|i| (format!("key-{i}"), format!("value-{i}")))
            .collect();
        let read = by_partition.get(&partition).cloned().unwrap_or_default();
        let offsets: Vec<i64> = read.iter().map(|(offset, _, _)| *offset).collect();
        let expected_offsets: Vec<i64> = (0..expected.len() as i64).collect();
        assert_eq!(offsets, expected_offsets, "offsets of {topic}-{partition}");
        let records: Vec<(String, String)> = read
            .into_iter()
            .map(|(_, key, value)| (key, value))
            .collect();
        assert_eq!(records, expected, "records of {topic}-{partition}");
        assert_eq!(
            watermarks[&partition],
            (0, expected.len() as i64),
            "low and high watermarks of {topic}-{partition}"
        );
    }

    delete_topic(&topic).await;
}

type Records = BTreeMap<i32, Vec<(i64, String, String)>>;

/// Reads every partition of `topic` from its beginning until all `RECORDS` have
/// arrived, and fetches each partition's watermarks.
fn read_everything(topic: &str) -> (Records, BTreeMap<i32, (i64, i64)>) {
    let consumer: BaseConsumer = client_config()
        .set("group.id", sluice_tests::unique_name("smoke_group"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("a consumer for the test broker");
    let mut assignment = TopicPartitionList::new();
    for partition in 0..PARTITIONS {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("a valid assignment");
    }
    consumer
        .assign(&assignment)
        .expect("assigning the partitions");

    let mut records = Records::new();
    let mut count = 0;
    let deadline = Instant::now() + TIMEOUT;
    while count < RECORDS {
        assert!(
            Instant::now() < deadline,
            "only {count} of {RECORDS} records of {topic} arrived within {TIMEOUT:?}"
        );
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = message.unwrap_or_else(|e| panic!("reading {topic} failed: {e}"));
        let text = |bytes: Option<&[u8]>| String::from_utf8(bytes.unwrap_or_default().to_vec());
        records.entry(message.partition()).or_default().push((
            message.offset(),
            text(message.key()).expect("UTF-8 keys"),
            text(message.payload()).expect("UTF-8 values"),
        ));
        count += 1;
    }

    let watermarks = (0..PARTITIONS)
        .map(|partition| {
            let marks = consumer
                .fetch_watermarks(topic, partition, TIMEOUT)
                .unwrap_or_else(|e| panic!("watermarks of {topic}-{partition}: {e}"));
            (partition, marks)
        })
        .collect();
    (records, watermarks)
}
