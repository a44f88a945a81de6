//! `discard`: a sink that keeps nothing, for measuring everything but the sink.

use sluice_offsets::{BatchId, ReadBatch, Sink};

use super::SinkError;

/// Accepts every batch and drops it.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiscardSink;

impl Sink for DiscardSink {
    type Error = SinkError;

    async fn write_batch(
        &mut self,
        _batch: BatchId,
        _records: &ReadBatch,
    ) -> Result<(), SinkError> {
        Ok(())
    }
}
