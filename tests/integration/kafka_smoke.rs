//! The Kafka broker answers as Sluice needs: topics can be created, records
//! produced to chosen partitions come back in order, and the watermarks match.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sluice_tests::kafka::{
    Out, TIMEOUT, client_config, create_topic, delete_topic, produce, producer,
};

const PARTITIONS: i32 = 3;
const RECORDS: i32 = 1_000;

#[tokio::test]
async fn produces_and_reads_back_a_thousand_records_with_matching_watermarks() {
    let topic = sluice_tests::unique_name("smoke");
    create_topic(&topic, PARTITIONS).await;
    let records: Vec<Out> = (0..RECORDS)
        .map(|i| Out::new(i % PARTITIONS, format!("key-{i}"), format!("value-{i}")))
        .collect();
    produce(&producer(), &topic, &records).await;

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
