//! `console`: records on standard output, for trying a query out.

use std::io::Write;

use sluice_offsets::{BatchId, ReadBatch, Sink};

use super::{SinkError, record_json};

/// How the console sink prints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ConsoleFormat {
    /// A header line per batch, then `topic-partition@offset key=... value=...`.
    #[default]
    Text,
    /// One JSON object per record (see [`super::record_json`]).
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

impl Sink for ConsoleSink {
    type Error = SinkError;

    async fn write_batch(&mut self, batch: BatchId, records: &ReadBatch) -> Result<(), SinkError> {
        let mut out = Vec::new();
        if self.format == ConsoleFormat::Text {
            out.extend_from_slice(
                format!(
                    "-------- batch {batch}: {} records --------\n",
                    records.record_count()
                )
                .as_bytes(),
            );
        }
        for record in records.partitions.iter().flat_map(|p| &p.records) {
            let line = match self.format {
                ConsoleFormat::Json => record_json(record).to_string(),
                ConsoleFormat::Text => format!(
                    "{}-{}@{} key={} value={}",
                    record.topic,
                    record.partition,
                    record.offset,
                    text(record.key.as_deref()),
                    text(record.value.as_deref())
                ),
            };
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        let mut stdout = std::io::stdout().lock();
        stdout
            .write_all(&out)
            .and_then(|()| stdout.flush())
            .map_err(|source| SinkError::Io {
                action: "writing to",
                path: "standard output".into(),
                source,
            })
    }
}

fn text(bytes: Option<&[u8]>) -> String {
    match bytes {
        None => "null".to_owned(),
        Some(b) => String::from_utf8_lossy(b).into_owned(),
    }
}
