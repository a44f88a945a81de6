//! The dead letters: where records go whose values do not decode, with
//! `on_bad_record = "dead_letter"`. Each keeps the record as read, with an
//! `sluice.error` header naming why.

use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, Writes};
use sluice_executor::sinks::{DiscardSink, JsonlSink, SinkError};
use sluice_kafka::{KafkaError, KafkaSink};

/// The configured dead letters.
pub enum DeadLetterSink {
    /// None are written: `on_bad_record` is not "dead_letter".
    None(DiscardSink),
    /// A JSON-lines file per batch in a directory: exactly once, as the jsonl sink.
    Directory(JsonlSink),
    /// A Kafka topic: at least once, with position headers.
    Kafka(Box<KafkaSink>),
}

/// Why writing dead letters failed.
#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    /// Writing the directory failed.
    #[error(transparent)]
    Local(#[from] SinkError),
    /// Producing to the topic failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
}

impl Sink for DeadLetterSink {
    type Error = DeadLetterError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), DeadLetterError> {
        match self {
            DeadLetterSink::None(s) => Sink::begin_batch(s, batch, ranges).await?,
            DeadLetterSink::Directory(s) => {
                Sink::begin_batch(s, batch, ranges).await?;
            }
            DeadLetterSink::Kafka(s) => {
                Sink::begin_batch(s.as_mut(), batch, ranges).await?;
            }
        }
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), DeadLetterError> {
        match self {
            DeadLetterSink::None(s) => Sink::finish_batch(s, batch).await?,
            DeadLetterSink::Directory(s) => Sink::finish_batch(s, batch).await?,
            DeadLetterSink::Kafka(s) => {
                Sink::finish_batch(s.as_mut(), batch).await?;
            }
        }
        Ok(())
    }
}

impl Writes for DeadLetterSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), DeadLetterError> {
        match self {
            DeadLetterSink::None(s) => Writes::write(s, records).await?,
            DeadLetterSink::Directory(s) => Writes::write(s, records).await?,
            DeadLetterSink::Kafka(s) => Writes::write(s.as_mut(), records).await?,
        }
        Ok(())
    }
}
