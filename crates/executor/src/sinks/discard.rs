//! `discard`: a sink that keeps nothing, for measuring everything but the sink.

use arrow::array::RecordBatch;
use sluice_core::{RecordChunk, Sink, Writes};

use super::SinkError;

/// Accepts every batch and drops it.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiscardSink;

impl Sink for DiscardSink {
    type Error = SinkError;
}

impl Writes for DiscardSink {
    async fn write(&mut self, _records: &RecordChunk) -> Result<(), SinkError> {
        Ok(())
    }
}

impl Writes<RecordBatch> for DiscardSink {
    async fn write(&mut self, _rows: &RecordBatch) -> Result<(), SinkError> {
        Ok(())
    }
}
