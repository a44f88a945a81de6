//! The `kafka` sink: records to an output topic through an idempotent producer.
//!
//! At least once: a batch replayed after a crash is produced again. Every record
//! carries headers naming the query, the batch and the source position
//! (`sluice.query`, `sluice.batch`, `sluice.position` = `topic-partition@offset`),
//! so that consumers can drop the duplicates a replay produces.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use sluice_offsets::{BatchId, OffsetRange, RecordChunk, Sink};

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
    batch: BatchId,
    batch_text: String,
    /// Records produced and not yet acknowledged, oldest first.
    deliveries: VecDeque<DeliveryFuture>,
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
            batch: BatchId::FIRST,
            batch_text: String::new(),
            deliveries: VecDeque::new(),
        })
    }
}

impl KafkaSink {
    /// Waits for the oldest delivery in flight.
    async fn settle_oldest(&mut self) -> Result<(), KafkaSourceError> {
        let Some(delivery) = self.deliveries.pop_front() else {
            return Ok(());
        };
        let batch = self.batch;
        match delivery.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((source, _))) => Err(KafkaSourceError::Kafka {
                what: format!("producing batch {batch} to {}", self.topic),
                source: Box::new(source),
            }),
            Err(_) => Err(KafkaSourceError::Task(format!(
                "the producer dropped a delivery of batch {batch}"
            ))),
        }
    }
}

impl Sink for KafkaSink {
    type Error = KafkaSourceError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<(), KafkaSourceError> {
        // A batch begun again is produced again in full; what an abandoned attempt
        // produced stays, as at least once allows.
        self.deliveries.clear();
        self.batch = batch;
        self.batch_text = batch.to_string();
        Ok(())
    }

    async fn write(&mut self, records: &RecordChunk) -> Result<(), KafkaSourceError> {
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
            headers = headers
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
                });
            let topic = self.topic.clone();
            let mut out = FutureRecord::<[u8], [u8]>::to(&topic).headers(headers);
            if let Some(key) = record.key() {
                out = out.key(key);
            }
            if let Some(value) = record.value() {
                out = out.payload(value);
            }
            if let Some(ms) = record.timestamp_ms() {
                out = out.timestamp(ms);
            }
            loop {
                match self.producer.send_result(out) {
                    Ok(delivery) => {
                        self.deliveries.push_back(delivery);
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if !self.deliveries.is_empty() =>
                    {
                        // The producer's queue is full: wait for what is in flight.
                        out = back;
                        self.settle_oldest().await?;
                    }
                    Err((source, _)) => {
                        return Err(KafkaSourceError::Kafka {
                            what: format!("producing {position} to {}", self.topic),
                            source: Box::new(source),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), KafkaSourceError> {
        while !self.deliveries.is_empty() {
            self.settle_oldest().await?;
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
