//! Lookup tables from files: a CSV, JSON-lines or Parquet file, or a directory
//! of them (as Spark, pyarrow and DuckDB write a table), read into Arrow and
//! read again when the files change.
//!
//! A [`FileTable`] is the [`TableLoader`] of one `[tables.<name>]` section. At
//! the beginning of every batch it compares each file's size and modification
//! time with what it last read (a `stat` per file, nothing more) and reads the
//! table again only when one changed, was added or went away. A table whose
//! files change while it is being read is not used: the next batch reads it
//! again, so that a file rewritten in place is never joined half written.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use arrow::array::RecordBatch;
use arrow::compute::cast;
use arrow::datatypes::{Schema, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice_sql::{Loaded, Refresh, TableLoader};

mod cassandra;

pub use cassandra::{CassandraTable, DEFAULT_IN_FLIGHT};

/// How a table's files are written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileFormat {
    /// Comma-separated (or another delimiter) text, one row per line.
    Csv {
        /// Whether the first line of each file names the columns, and is
        /// skipped.
        header: bool,
        /// The byte between fields.
        delimiter: u8,
    },
    /// One JSON object per line, as Spark writes JSON.
    Json,
    /// Parquet, with any of the usual codecs.
    Parquet,
}

impl FileFormat {
    fn name(&self) -> &'static str {
        match self {
            FileFormat::Csv { .. } => "csv",
            FileFormat::Json => "json",
            FileFormat::Parquet => "parquet",
        }
    }
}

/// A lookup table's files could not be read as the table.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// A file or directory that cannot be listed or opened.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A file whose contents are not rows of the table.
    #[error("{path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong in it.
        reason: String,
    },
    /// A directory without a file to read.
    #[error("{path}: the directory holds no {format} file")]
    Empty {
        /// The directory.
        path: PathBuf,
        /// The format looked for.
        format: &'static str,
    },
    /// A CSV or JSON table without a declared schema.
    #[error("a {format} table needs a schema (schema = \"id BIGINT, name STRING\")")]
    NoSchema {
        /// The table's format.
        format: &'static str,
    },
}

/// One file as last seen: its path, length and modification time.
type Seen = Vec<(PathBuf, u64, SystemTime)>;

/// A table read from a file or a directory of files, again when they change.
#[derive(Debug)]
pub struct FileTable {
    path: PathBuf,
    format: FileFormat,
    schema: SchemaRef,
    /// The files as they were when last read; `None` before the first read.
    seen: Option<Seen>,
}

impl FileTable {
    /// The table at `path` in `format`, with columns `schema`, which a CSV or
    /// JSON table must declare and a Parquet table may (its files' own schema
    /// otherwise, from the first file).
    pub fn open(
        path: &Path,
        format: FileFormat,
        schema: Option<SchemaRef>,
    ) -> Result<FileTable, TableError> {
        let schema = match (schema, &format) {
            (Some(schema), _) => schema,
            (None, FileFormat::Parquet) => {
                let files = list(path, &format)?;
                let (first, _, _) = &files[0];
                let file = open_file(first)?;
                let builder = ParquetRecordBatchReaderBuilder::try_new(file)
                    .map_err(|e| parse_error(first, e))?;
                Arc::new(Schema::new(builder.schema().fields().clone()))
            }
            (None, format) => {
                return Err(TableError::NoSchema {
                    format: format.name(),
                });
            }
        };
        Ok(FileTable {
            path: path.to_owned(),
            format,
            schema,
            seen: None,
        })
    }

    /// The table's columns.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The table's rows, if its files changed since the last read.
    fn read_if_changed(&mut self) -> Result<Option<Loaded>, TableError> {
        let before = list(&self.path, &self.format)?;
        if self.seen.as_ref() == Some(&before) {
            return Ok(None);
        }
        // A file rewritten in place is empty for a moment; read as a table
        // without rows, it would join nothing for a whole batch.
        if let Some((empty, _, _)) = before.iter().find(|(_, len, _)| *len == 0) {
            return Err(parse_error(
                empty,
                "the file is empty: if it is being written, it is read again once it is whole",
            ));
        }
        let mut batches = Vec::new();
        for (file, _, _) in &before {
            read_file(file, &self.format, &self.schema, &mut batches)?;
        }
        let after = list(&self.path, &self.format)?;
        if after != before {
            // Written while it was read: read again at the next batch.
            return Ok(None);
        }
        let version = describe(&before);
        self.seen = Some(before);
        Ok(Some(Loaded { batches, version }))
    }
}

impl TableLoader for FileTable {
    fn refresh(&mut self) -> Refresh<'_> {
        Box::pin(async move {
            // The files are read on the blocking pool, the table moved there
            // and back.
            let mut table = FileTable {
                path: self.path.clone(),
                format: self.format.clone(),
                schema: self.schema.clone(),
                seen: self.seen.take(),
            };
            let (table, read) = tokio::task::spawn_blocking(move || {
                let read = table.read_if_changed();
                (table, read)
            })
            .await?;
            self.seen = table.seen;
            Ok(read?)
        })
    }
}

/// The files of the table at `path`: the file itself, or the directory's
/// files in name order, leaving out hidden and bookkeeping files (`.crc`,
/// `_SUCCESS`, `_delta_log`) and, for Parquet, files of other formats.
fn list(path: &Path, format: &FileFormat) -> Result<Seen, TableError> {
    let io = |source| TableError::Io {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let mut files = Vec::new();
    if meta.is_file() {
        files.push((path.to_owned(), meta.len(), meta.modified().map_err(io)?));
        return Ok(files);
    }
    for entry in std::fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || name.starts_with('_') || name.ends_with(".crc") {
            continue;
        }
        if *format == FileFormat::Parquet && !name.ends_with(".parquet") {
            continue;
        }
        let meta = entry.metadata().map_err(io)?;
        if meta.is_file() {
            files.push((entry.path(), meta.len(), meta.modified().map_err(io)?));
        }
    }
    if files.is_empty() {
        return Err(TableError::Empty {
            path: path.to_owned(),
            format: format.name(),
        });
    }
    files.sort();
    Ok(files)
}

fn open_file(path: &Path) -> Result<File, TableError> {
    File::open(path).map_err(|source| TableError::Io {
        path: path.to_owned(),
        source,
    })
}

fn parse_error(path: &Path, error: impl std::fmt::Display) -> TableError {
    TableError::Parse {
        path: path.to_owned(),
        reason: error.to_string(),
    }
}

/// Rows per batch read from a CSV or JSON file: few batches to put together
/// into the table's one.
const TEXT_BATCH_ROWS: usize = 64 * 1024;

fn read_file(
    path: &Path,
    format: &FileFormat,
    schema: &SchemaRef,
    out: &mut Vec<RecordBatch>,
) -> Result<(), TableError> {
    let file = open_file(path)?;
    let parse = |e: arrow::error::ArrowError| parse_error(path, e);
    match format {
        FileFormat::Csv { header, delimiter } => {
            let reader = arrow::csv::ReaderBuilder::new(schema.clone())
                .with_batch_size(TEXT_BATCH_ROWS)
                .with_header(*header)
                .with_delimiter(*delimiter)
                .build(BufReader::new(file))
                .map_err(parse)?;
            for batch in reader {
                out.push(batch.map_err(parse)?);
            }
        }
        FileFormat::Json => {
            let reader = arrow::json::ReaderBuilder::new(schema.clone())
                .with_batch_size(TEXT_BATCH_ROWS)
                .build(BufReader::new(file))
                .map_err(parse)?;
            for batch in reader {
                out.push(batch.map_err(parse)?);
            }
        }
        FileFormat::Parquet => {
            // The file's rows in one batch where they fit one, so that the
            // table is not held twice while its batches are put together.
            let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                .and_then(|b| {
                    let rows = b.metadata().file_metadata().num_rows().max(1) as usize;
                    b.with_batch_size(rows).build()
                })
                .map_err(|e| parse_error(path, e))?;
            for batch in reader {
                out.push(in_schema(path, &batch.map_err(parse)?, schema)?);
            }
        }
    }
    Ok(())
}

/// A Parquet file's rows in the table's columns: picked by name, and cast
/// where the file stores a column in another type.
fn in_schema(
    path: &Path,
    batch: &RecordBatch,
    schema: &SchemaRef,
) -> Result<RecordBatch, TableError> {
    let mut columns = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        let Some(column) = batch.column_by_name(field.name()) else {
            return Err(parse_error(
                path,
                format!(
                    "no column {:?}; the file has {}",
                    field.name(),
                    batch
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        };
        let column = if column.data_type() == field.data_type() {
            column.clone()
        } else {
            cast(column, field.data_type()).map_err(|e| {
                parse_error(
                    path,
                    format!(
                        "column {:?} is {} in the file and {} in the schema: {e}",
                        field.name(),
                        column.data_type(),
                        field.data_type()
                    ),
                )
            })?
        };
        columns.push(column);
    }
    RecordBatch::try_new(schema.clone(), columns).map_err(|e| parse_error(path, e))
}

/// The version as progress shows it: how many files, and when the newest
/// was last modified.
fn describe(files: &Seen) -> String {
    let newest = files
        .iter()
        .map(|(_, _, modified)| *modified)
        .max()
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let bytes: u64 = files.iter().map(|(_, len, _)| len).sum();
    format!(
        "{} file{}, {bytes} bytes, modified {}",
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        humantime::format_rfc3339_millis(newest)
    )
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};
    use sluice_sql::LookupTable;

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]))
    }

    fn csv() -> FileFormat {
        FileFormat::Csv {
            header: true,
            delimiter: b',',
        }
    }

    fn rows(table: &LookupTable) -> u64 {
        table.stats().rows
    }

    /// Writes `text` to `path` through a file beside it, as a careful writer
    /// replaces a file, and moves its modification time on (file systems keep
    /// it to a tick coarser than a test's writes).
    fn replace(path: &Path, text: &str, tick: u64) {
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, text).unwrap();
        let file = File::options().write(true).open(&temporary).unwrap();
        file.set_modified(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + tick))
            .unwrap();
        std::fs::rename(&temporary, path).unwrap();
    }

    #[tokio::test]
    async fn a_csv_file_is_read_again_only_when_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("customers.csv");
        replace(&path, "id,name\n1,ann\n2,bob\n", 1);
        let mut loader = FileTable::open(&path, csv(), Some(schema())).unwrap();
        let table = LookupTable::new("customers", loader.schema(), 1 << 20);
        table.refresh(&mut loader).await.unwrap();
        assert_eq!(rows(&table), 2);
        let first = table.stats().version;
        table.refresh(&mut loader).await.unwrap();
        assert_eq!(table.stats().reloads, 0);
        replace(&path, "id,name\n1,ann\n2,bob\n3,cy\n", 2);
        table.refresh(&mut loader).await.unwrap();
        assert_eq!((rows(&table), table.stats().reloads), (3, 1));
        assert_ne!(table.stats().version, first);
    }

    #[tokio::test]
    async fn a_file_that_does_not_parse_keeps_the_last_good_version() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("customers.csv");
        replace(&path, "id,name\n1,ann\n", 1);
        let mut loader = FileTable::open(&path, csv(), Some(schema())).unwrap();
        let table = LookupTable::new("customers", loader.schema(), 1 << 20);
        table.refresh(&mut loader).await.unwrap();
        replace(&path, "id,name\nseven,ann\n", 2);
        table.refresh(&mut loader).await.unwrap();
        let stats = table.stats();
        assert_eq!((stats.rows, stats.failed_reloads), (1, 1));
        let error = stats.last_error.unwrap();
        assert!(
            error.contains("customers.csv") && error.contains("seven"),
            "{error}"
        );
        replace(&path, "", 3);
        table.refresh(&mut loader).await.unwrap();
        let stats = table.stats();
        assert_eq!((stats.rows, stats.failed_reloads), (1, 2));
        assert!(stats.last_error.unwrap().contains("the file is empty"));
        replace(&path, "id,name\n1,ann\n2,bob\n", 4);
        table.refresh(&mut loader).await.unwrap();
        assert_eq!((rows(&table), table.stats().reloads), (2, 1));
    }

    #[tokio::test]
    async fn a_first_load_that_fails_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("customers.json");
        std::fs::write(&path, "{\"id\": 1, \"name\": \"ann\"}\n{\"id\": \"x\"}\n").unwrap();
        let mut loader = FileTable::open(&path, FileFormat::Json, Some(schema())).unwrap();
        let table = LookupTable::new("customers", loader.schema(), 1 << 20);
        let error = table.refresh(&mut loader).await.unwrap_err().to_string();
        assert!(error.starts_with("lookup table \"customers\": "), "{error}");
        assert!(error.contains("customers.json"), "{error}");
        let missing = FileTable::open(&dir.path().join("none"), FileFormat::Parquet, None)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("none: No such file"), "{missing}");
        let no_schema = FileTable::open(&path, FileFormat::Json, None)
            .unwrap_err()
            .to_string();
        assert!(no_schema.contains("needs a schema"), "{no_schema}");
    }

    #[tokio::test]
    async fn a_parquet_directory_is_read_whole_in_its_own_schema() {
        let dir = tempfile::tempdir().unwrap();
        for (part, ids) in [(0, vec![1_i64, 2]), (1, vec![3])] {
            let names: Vec<String> = ids.iter().map(|i| format!("c{i}")).collect();
            let batch = RecordBatch::try_new(
                schema(),
                vec![
                    Arc::new(Int64Array::from(ids)),
                    Arc::new(StringArray::from(names)),
                ],
            )
            .unwrap();
            let file = File::create(dir.path().join(format!("part-{part}.parquet"))).unwrap();
            let mut writer = parquet::arrow::ArrowWriter::try_new(file, schema(), None).unwrap();
            writer.write(&batch).unwrap();
            writer.close().unwrap();
        }
        std::fs::write(dir.path().join("_SUCCESS"), "").unwrap();
        let mut loader = FileTable::open(dir.path(), FileFormat::Parquet, None).unwrap();
        assert_eq!(loader.schema().fields(), schema().fields());
        let table = LookupTable::new("customers", loader.schema(), 1 << 20);
        table.refresh(&mut loader).await.unwrap();
        assert_eq!(rows(&table), 3);
        assert!(table.stats().version.starts_with("2 files"));
        let narrower = Arc::new(Schema::new(vec![Field::new("id", DataType::Utf8, true)]));
        let mut loader = FileTable::open(dir.path(), FileFormat::Parquet, Some(narrower)).unwrap();
        let table = LookupTable::new("ids", loader.schema(), 1 << 20);
        table.refresh(&mut loader).await.unwrap();
        assert_eq!(rows(&table), 3);
    }
}
