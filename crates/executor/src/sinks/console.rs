//! `console`: records or rows on standard output, for trying a query out.

use std::io::Write;

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, RecordBatch, StringArray};
use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, Writes};

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

/// Prints every record to standard output, or a table of each batch's first
/// rows, as Spark's console sink does. At least once: a replayed batch is
/// printed again.
#[derive(Debug, Clone)]
pub struct ConsoleSink {
    format: ConsoleFormat,
    num_rows: usize,
    truncate: bool,
    /// Whether it shows rows as a table at each batch's end, rather than
    /// records as they come.
    table: bool,
    batch: Option<BatchId>,
    shown: Vec<RecordBatch>,
    shown_rows: usize,
    rows: u64,
}

impl Default for ConsoleSink {
    fn default() -> ConsoleSink {
        ConsoleSink::new(ConsoleFormat::Text)
    }
}

/// How many rows of a batch the table shows, as in Spark (`numRows`).
pub const DEFAULT_NUM_ROWS: usize = 20;

/// How many characters of a value the table shows when truncating, as in Spark.
const TRUNCATE_AT: usize = 20;

impl ConsoleSink {
    /// A console sink printing in `format`, tables of up to 20 rows per batch
    /// with long values cut to 20 characters.
    pub fn new(format: ConsoleFormat) -> ConsoleSink {
        ConsoleSink {
            format,
            num_rows: DEFAULT_NUM_ROWS,
            truncate: true,
            table: false,
            batch: None,
            shown: Vec::new(),
            shown_rows: 0,
            rows: 0,
        }
    }

    /// Shows up to `num_rows` rows of each batch in the table (Spark's `numRows`),
    /// and cuts longer values to 20 characters when `truncate` (Spark's
    /// `truncate`). JSON and records as read are printed in full.
    pub fn with_table(mut self, num_rows: usize, truncate: bool) -> ConsoleSink {
        self.num_rows = num_rows;
        self.truncate = truncate;
        self.table = true;
        self
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
        if self.table {
            self.batch = Some(batch);
            self.shown.clear();
            self.shown_rows = 0;
            self.rows = 0;
        } else if self.format == ConsoleFormat::Text {
            let offsets: u64 = ranges.iter().map(OffsetRange::len).sum();
            print(
                format!("-------- batch {batch}: up to {offsets} records --------\n").as_bytes(),
            )?;
        }
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), SinkError> {
        if !self.table || self.format == ConsoleFormat::Json {
            return Ok(());
        }
        let out = self.render(batch).map_err(SinkError::Rows)?;
        self.shown.clear();
        print(out.as_bytes())
    }
}

impl Writes for ConsoleSink {
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

impl Writes<RecordBatch> for ConsoleSink {
    async fn write(&mut self, rows: &RecordBatch) -> Result<(), SinkError> {
        if self.format == ConsoleFormat::Json {
            let mut out = Vec::new();
            write_rows_json(&mut out, rows).map_err(SinkError::Rows)?;
            return print(&out);
        }
        self.rows += rows.num_rows() as u64;
        let wanted = self.num_rows - self.shown_rows;
        if wanted > 0 {
            let kept = rows.slice(0, wanted.min(rows.num_rows()));
            self.shown_rows += kept.num_rows();
            self.shown.push(kept);
        }
        Ok(())
    }
}

impl ConsoleSink {
    /// What `finish_batch` prints: Spark's header, the table, and how many rows
    /// it left out.
    fn render(&self, batch: BatchId) -> Result<String, String> {
        let table = self.table()?;
        let rule = "-------------------------------------------";
        let mut out = format!("{rule}\nBatch: {batch}\n{rule}\n{table}\n");
        if self.rows > self.shown_rows as u64 {
            out.push_str(&format!(
                "only showing top {} of {} rows\n",
                self.shown_rows, self.rows
            ));
        }
        out.push('\n');
        Ok(out)
    }
}

impl ConsoleSink {
    /// The batch's first rows as a table, binary as text, long values cut.
    fn table(&self) -> Result<String, String> {
        let shown: Vec<RecordBatch> = self
            .shown
            .iter()
            .map(|rows| textual(rows).and_then(|rows| self.cut(rows)))
            .collect::<Result<_, _>>()?;
        if shown.is_empty() {
            return Ok("(no rows)".to_owned());
        }
        arrow::util::pretty::pretty_format_batches(&shown)
            .map(|table| table.to_string())
            .map_err(|e| e.to_string())
    }

    /// `rows` with every string longer than Spark's 20 characters cut to 17 and
    /// "...", when truncating.
    fn cut(&self, rows: RecordBatch) -> Result<RecordBatch, String> {
        if !self.truncate {
            return Ok(rows);
        }
        let columns = rows
            .columns()
            .iter()
            .map(|column| match column.as_string_opt::<i32>() {
                Some(strings) => Arc::new(
                    strings
                        .iter()
                        .map(|v| v.map(cut_text))
                        .collect::<StringArray>(),
                ) as ArrayRef,
                None => column.clone(),
            })
            .collect();
        RecordBatch::try_new(rows.schema(), columns).map_err(|e| e.to_string())
    }
}

fn cut_text(text: &str) -> String {
    if text.chars().count() <= TRUNCATE_AT {
        return text.to_owned();
    }
    let kept: String = text.chars().take(TRUNCATE_AT - 3).collect();
    format!("{kept}...")
}

#[cfg(test)]
mod tests {
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn rows(from: i64, count: i64) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("n", DataType::Int64, false),
            Field::new("note", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(from..from + count)),
                Arc::new(StringArray::from_iter_values(
                    (from..from + count).map(|n| format!("a note long enough to cut {n}")),
                )),
            ],
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a_batch_shows_its_first_rows_as_sparks_console_does() {
        let mut sink = ConsoleSink::new(ConsoleFormat::Text).with_table(3, true);
        let batch = BatchId(7);
        Sink::begin_batch(&mut sink, batch, &[]).await.unwrap();
        for chunk in [rows(0, 2), rows(2, 2), rows(4, 1)] {
            Writes::<RecordBatch>::write(&mut sink, &chunk)
                .await
                .unwrap();
        }
        let out = sink.render(batch).unwrap();
        assert!(out.starts_with("-------------------------------------------\nBatch: 7\n"));
        assert!(out.contains("| 2 | a note long enoug... |"), "{out}");
        assert!(!out.contains("| 3 |"), "{out}");
        assert!(out.contains("only showing top 3 of 5 rows"), "{out}");

        let mut whole = ConsoleSink::new(ConsoleFormat::Text).with_table(10, false);
        Sink::begin_batch(&mut whole, batch, &[]).await.unwrap();
        Writes::<RecordBatch>::write(&mut whole, &rows(0, 2))
            .await
            .unwrap();
        let out = whole.render(batch).unwrap();
        assert!(out.contains("a note long enough to cut 1"), "{out}");
        assert!(!out.contains("only showing"), "{out}");
    }
}
