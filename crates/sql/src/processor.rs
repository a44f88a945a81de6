//! The query as the executor's processor: decode, then query, chunk by chunk.

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use sluice_offsets::{ERROR_HEADER, Processed, Processor, RecordChunk, RecordParts};

use crate::{Decoder, SqlError, StreamQuery};

/// Decodes each chunk's values and runs the query, if there is one, over them.
/// Records whose values do not decode are handed back with the reason in an
/// `sluice.error` header.
#[derive(Debug)]
pub struct SqlProcessor {
    decoder: Decoder,
    query: Option<StreamQuery>,
}

impl SqlProcessor {
    /// A processor decoding with `decoder`, then running `query`; without a
    /// query, the decoded rows are the output.
    pub fn new(decoder: Decoder, query: Option<StreamQuery>) -> SqlProcessor {
        SqlProcessor { decoder, query }
    }

    /// The schema of the rows the sink receives.
    pub fn output_schema(&self) -> SchemaRef {
        match &self.query {
            Some(query) => query.schema(),
            None => self.decoder.schema(),
        }
    }
}

impl Processor for SqlProcessor {
    type Output = RecordBatch;
    type Error = SqlError;

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut Processed<RecordBatch>,
    ) -> Result<(), SqlError> {
        let decoded = self.decoder.decode(&records)?;
        for bad in &decoded.bad {
            let Some(record) = records.get(bad.index) else {
                continue;
            };
            out.bad.push(
                record.topic_arc(),
                RecordParts {
                    partition: record.partition(),
                    offset: record.offset(),
                    timestamp_ms: record.timestamp_ms(),
                    timestamp_type: record.timestamp_type(),
                    key: record.key(),
                    value: record.value(),
                },
                record
                    .headers()
                    .chain(std::iter::once((ERROR_HEADER, Some(bad.reason.as_bytes())))),
            );
        }
        let rows = match &self.query {
            Some(query) => query.run(decoded.batch).await?,
            None if decoded.batch.num_rows() > 0 => vec![decoded.batch],
            None => Vec::new(),
        };
        out.row_count += rows.iter().map(|b| b.num_rows() as u64).sum::<u64>();
        out.rows.extend(rows);
        Ok(())
    }
}
