//! The `kafka` sink: records to an output topic through an idempotent producer.
//!
//! At least once: a batch replayed after a crash is produced again. Every record
//! carries headers naming the query, the batch and the source position
//! (`sluice.query`, `sluice.batch`, `sluice.position` = `topic-partition@offset`),
//! so that consumers can drop the duplicates a replay produces.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use sluice_offsets::{BatchId, ReadBatch, Sink};

use crate::KafkaSourceError;

/// Where the `kafka` sink writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KafkaSinkConfig {
    /// `bootstrap.servers` of the output cluster.
    pub bootstrap_servers: String,
    /// The output topic.
    pub topic: String,
    /// Further producer options, passed through.
    pub client_options: BTreeMap<String, String>,
}

/// Produces each batch's records to a topic and waits until all are acknowledged.
pub struct KafkaSink {
    producer: FutureProducer,
    topic: String,
    query_id: String,
}

impl KafkaSink {
    /// A sink for `query_id`, with an idempotent producer (`acks=all`).
    pub fn new(config: KafkaSinkConfig, query_id: &str) -> Result<KafkaSink, KafkaSourceError> {
        for key in ["enable.idempotence", "acks", "bootstrap.servers"] {
            if config.client_options.contains_key(key) {
                return Err(KafkaSourceError::OwnedOption {
                    option: key.to_owned(),
                    reason: "the kafka sink always produces idempotently with acks=all to the \
                             configured bootstrap_servers",
                });
            }
        }
        let mut client = ClientConfig::new();
        for (key, value) in &config.client_options {
            client.set(key, value);
        }
        let producer = client
            .set("bootstrap.servers", &config.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .map_err(|source| KafkaSourceError::Client {
                bootstrap: config.bootstrap_servers.clone(),
                source: Box::new(source),
            })?;
        Ok(KafkaSink {
            producer,
            topic: config.topic,
            query_id: query_id.to_owned(),
        })
    }
}

impl Sink for KafkaSink {
    type Error = KafkaSourceError;

    async fn write_batch(
        &mut self,
        batch: BatchId,
        records: &ReadBatch,
    ) -> Result<(), KafkaSourceError> {
        let batch_text = batch.to_string();
        let mut deliveries = Vec::with_capacity(records.record_count());
        for record in records.partitions.iter().flat_map(|p| &p.records) {
            let position = format!("{}-{}@{}", record.topic, record.partition, record.offset);
            let mut headers = OwnedHeaders::new_with_capacity(record.headers.len() + 3);
            for header in &record.headers {
                headers = headers.insert(Header {
                    key: &header.key,
                    value: header.value.as_deref(),
                });
            }
            headers = headers
                .insert(Header {
                    key: "sluice.query",
                    value: Some(self.query_id.as_bytes()),
                })
                .insert(Header {
                    key: "sluice.batch",
                    value: Some(batch_text.as_bytes()),
                })
                .insert(Header {
                    key: "sluice.position",
                    value: Some(position.as_bytes()),
                });
            let mut out = FutureRecord::<[u8], [u8]>::to(&self.topic).headers(headers);
            if let Some(key) = record.key.as_deref() {
                out = out.key(key);
            }
            if let Some(value) = record.value.as_deref() {
                out = out.payload(value);
            }
            if let Some(ms) = record.timestamp_ms {
                out = out.timestamp(ms);
            }
            match self.producer.send_result(out) {
                Ok(delivery) => deliveries.push(delivery),
                Err((source, _)) => {
                    return Err(KafkaSourceError::Kafka {
                        what: format!("producing {position} to {}", self.topic),
                        source: Box::new(source),
                    });
                }
            }
        }
        for delivery in deliveries {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((source, _))) => {
                    return Err(KafkaSourceError::Kafka {
                        what: format!("producing batch {batch} to {}", self.topic),
                        source: Box::new(source),
                    });
                }
                Err(_) => {
                    return Err(KafkaSourceError::Task(format!(
                        "the producer dropped a delivery of batch {batch}"
                    )));
                }
            }
        }
        // Deliveries above are acknowledged; flushing keeps nothing queued at shutdown.
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(30)))
            .await
            .map_err(|e| KafkaSourceError::Task(e.to_string()))?
            .map_err(|source| KafkaSourceError::Kafka {
                what: format!("flushing batch {batch}"),
                source: Box::new(source),
            })
    }
}
