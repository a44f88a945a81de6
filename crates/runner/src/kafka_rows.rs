//! Records as Spark's Kafka columns, for a sink that takes rows: a query
//! without SQL lands the records in a table as Spark's Kafka source reads them.

use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, Writes};
use sluice_sql::arrow::array::RecordBatch;
use sluice_sql::columns::KafkaColumns;

/// `inner`, taking records as rows of Spark's Kafka columns, and rows as they
/// are.
pub struct KafkaRows<S> {
    inner: S,
    columns: KafkaColumns,
}

impl<S> KafkaRows<S> {
    /// `inner`, with the `headers` column when `include_headers`.
    pub fn new(inner: S, include_headers: bool) -> KafkaRows<S> {
        KafkaRows {
            inner,
            columns: KafkaColumns::spark(include_headers),
        }
    }
}

impl<S: Sink> Sink for KafkaRows<S> {
    type Error = S::Error;

    fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.begin_batch(batch, ranges)
    }

    fn finish_batch(
        &mut self,
        batch: BatchId,
    ) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.finish_batch(batch)
    }

    fn is_transient(error: &S::Error) -> bool {
        S::is_transient(error)
    }

    fn take_over(&mut self) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.take_over()
    }

    fn is_fenced(error: &S::Error) -> bool {
        S::is_fenced(error)
    }

    fn metrics(&self) -> std::collections::BTreeMap<String, String> {
        self.inner.metrics()
    }

    fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<bool, S::Error>> + Send {
        self.inner.delivered(batch, ranges)
    }
}

impl<S: Writes<RecordBatch>> Writes<RecordChunk> for KafkaRows<S> {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), S::Error> {
        let rows = self.columns.batch(records);
        self.inner.write(&rows).await
    }
}

impl<S: Writes<RecordBatch>> Writes<RecordBatch> for KafkaRows<S> {
    fn write(&mut self, rows: &RecordBatch) -> impl Future<Output = Result<(), S::Error>> + Send {
        self.inner.write(rows)
    }
}
