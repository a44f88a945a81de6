//! `console`: records or rows on standard output, for trying a query out.

use std::io::Write;

use arrow::array::RecordBatch;
use sluice_offsets::{BatchId, OffsetRange, RecordChunk, Sink};

use super::rows::{textual, write_rows_json};
use super::{SinkError, write_record_json};

/// How the console sink prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConsoleFormat {
    /// A header line per batch, then `topic-partition@offset key=... value=...`.
    #[default]
    Text,
    /// One JSON object per record (see [`super::write_record_json`]).
    Json,
}

/// Prints every record to standard output. At least once: a replayed batch is
/// printed again.
#[derive(Debug, Clone, Default)]
pub struct ConsoleSink {
    format: ConsoleFormat,
}

impl ConsoleSink {
    /// A console sink printing in `format`.
    pub fn new(format: ConsoleFormat) -> ConsoleSink {
        ConsoleSink { format }
    }
}

fn print(out: &[u8]) -> Result<(), SinkError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(out)
        .and_then(|()| stdout.flush())
        .map_err(|source| SinkError::Io {
            action: "writing to",
            path: "standard output".into(),
            source,
        })
}

impl Sink for ConsoleSink {
    type Error = SinkError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), SinkError> {
        if self.format == ConsoleFormat::Text {
            let offsets: u64 = ranges.iter().map(OffsetRange::len).sum();
            print(
                format!("-------- batch {batch}: up to {offsets} records --------\n").as_bytes(),
            )?;
        }
        Ok(())
    }

    async fn write(&mut self, records: &RecordChunk) -> Result<(), SinkError> {
        let mut out = Vec::new();
        for record in records {
            match self.format {
                ConsoleFormat::Json => write_record_json(&mut out, record),
                ConsoleFormat::Text => out.extend_from_slice(
                    format!(
                        "{}-{}@{} key={} value={}",
                        record.topic(),
                        record.partition(),
                        record.offset(),
                        text(record.key()),
                        text(record.value())
                    )
                    .as_bytes(),
                ),
            }
            out.push(b'\n');
        }
        print(&out)
    }
}

fn text(bytes: Option<&[u8]>) -> String {
    match bytes {
        None => "null".to_owned(),
        Some(b) => String::from_utf8_lossy(b).into_owned(),
    }
}

impl Sink<RecordBatch> for ConsoleSink {
    type Error = SinkError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<(), SinkError> {
        if self.format == ConsoleFormat::Text {
            print(format!("-------- batch {batch} --------\n").as_bytes())?;
        }
        Ok(())
    }

    async fn write(&mut self, rows: &RecordBatch) -> Result<(), SinkError> {
        let mut out = Vec::new();
        match self.format {
            ConsoleFormat::Json => write_rows_json(&mut out, rows).map_err(SinkError::Rows)?,
            ConsoleFormat::Text => {
                // A table as Spark's console sink prints one, binary as text.
                let rows = textual(rows).map_err(SinkError::Rows)?;
                let table = arrow::util::pretty::pretty_format_batches(&[rows])
                    .map_err(|e| SinkError::Rows(e.to_string()))?;
                out.extend_from_slice(format!("{table}\n").as_bytes());
            }
        }
        print(&out)
    }
}
