//! The `kafka` sink: records to an output topic through an idempotent producer.
//!
//! At least once: a batch replayed after a crash is produced again. Every record
//! carries headers naming the query, the batch and the source position
//! (`sluice.query`, `sluice.batch`, `sluice.position` = `topic-partition@offset`,
//! or `batch#row` for a query's rows, which a replay makes again in the same
//! order), so that consumers can drop the duplicates a replay produces.

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

/// Produces each batch's records, or a query's rows, to a topic and waits until
/// all are acknowledged.
pub struct KafkaSink {
    producer: FutureProducer,
    topic: String,
    query_id: String,
    batch: BatchId,
    batch_text: String,
    /// Records produced and not yet acknowledged, oldest first.
    deliveries: VecDeque<DeliveryFuture>,
    /// Rows of the batch produced so far, which numbers each row's position.
    rows: u64,
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
            rows: 0,
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

/// A column of a query's rows that the sink reads, as Spark's Kafka sink does:
/// `value` (required), `key`, `headers`, `topic` and `partition`.
const ROW_COLUMNS: [&str; 5] = ["value", "key", "headers", "topic", "partition"];

impl KafkaSink {
    /// Checks a query's output against what the sink reads: a `value` column of
    /// text or bytes; optionally `key` (text or bytes), `headers` (a list of
    /// `key`, `value` structs), `topic` (text) and `partition` (an int); and no
    /// other column, which would be lost.
    pub fn check_rows(schema: &arrow::datatypes::Schema) -> Result<(), KafkaSourceError> {
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
        let problem = |what: String| Err(KafkaSourceError::Config(format!("kafka sink: {what}")));
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

    /// Produces one message, waiting for deliveries while the producer's queue
    /// is full.
    async fn produce(&mut self, message: Outgoing<'_>) -> Result<(), KafkaSourceError> {
        let Outgoing {
            topic,
            key,
            value,
            partition,
            timestamp_ms,
            headers,
            position,
        } = message;
        let mut out = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
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
            match self.producer.send_result(out) {
                Ok(delivery) => {
                    self.deliveries.push_back(delivery);
                    return Ok(());
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
                        what: format!("producing {position} to {topic}"),
                        source: Box::new(source),
                    });
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

impl Sink<arrow::array::RecordBatch> for KafkaSink {
    type Error = KafkaSourceError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), KafkaSourceError> {
        <Self as Sink>::begin_batch(self, batch, ranges).await
    }

    async fn write(&mut self, rows: &arrow::array::RecordBatch) -> Result<(), KafkaSourceError> {
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

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), KafkaSourceError> {
        <Self as Sink>::finish_batch(self, batch).await
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
        self.rows = 0;
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
