//! `parquet`: each batch's rows as Parquet files under a directory, listed in
//! Spark's file-sink log once the batch's files are durable.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array};
use arrow::compute::{cast, take_record_batch};
use arrow::datatypes::{DataType, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::ZstdLevel;
use parquet::file::properties::WriterProperties;
use sluice_core::{BatchId, OffsetRange, Sink, Writes};

use crate::LakeError;
use crate::spark_log::{SinkFile, SparkFileLog};

/// The file in a sink's directory naming the query that writes it. Its name
/// starts with `_`, which Spark, Hive and DuckDB's Hive partitioning skip.
const QUERY_MARKER: &str = "_sluice_query";

/// Spark's directory name for a null or empty partition value.
const NULL_PARTITION: &str = "__HIVE_DEFAULT_PARTITION__";

/// How a file's pages are compressed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// zstd at its default level.
    #[default]
    Zstd,
    /// Snappy, Spark's default.
    Snappy,
    /// None.
    None,
}

impl Compression {
    pub(crate) fn parquet(self) -> parquet::basic::Compression {
        match self {
            Compression::Zstd => parquet::basic::Compression::ZSTD(ZstdLevel::default()),
            Compression::Snappy => parquet::basic::Compression::SNAPPY,
            Compression::None => parquet::basic::Compression::UNCOMPRESSED,
        }
    }

    /// The part of a file's name that names the codec, as Spark's do.
    fn tag(self) -> &'static str {
        match self {
            Compression::Zstd => ".zstd",
            Compression::Snappy => ".snappy",
            Compression::None => "",
        }
    }
}

/// Where and how a [`ParquetSink`] writes.
#[derive(Clone, Debug)]
pub struct ParquetOptions {
    /// The table's directory.
    pub path: PathBuf,
    /// Columns whose values name Hive-style directories (`col=value/`), in
    /// order; their values are in the directories' names, not in the files.
    pub partition_by: Vec<String>,
    /// The pages' codec.
    pub compression: Compression,
    /// The most rows a row group holds.
    pub row_group_rows: usize,
    /// The size at which a file is closed and the next one begun.
    pub file_bytes: u64,
    /// The id of the query writing, kept in the directory so that another
    /// query's sink does not write beside it.
    pub query_id: String,
}

impl ParquetOptions {
    /// Options for `path`, written by query `query_id`, with the defaults:
    /// zstd, row groups of 1,048,576 rows, files of 128 MiB.
    pub fn new(path: impl Into<PathBuf>, query_id: impl Into<String>) -> ParquetOptions {
        ParquetOptions {
            path: path.into(),
            partition_by: Vec::new(),
            compression: Compression::Zstd,
            row_group_rows: 1024 * 1024,
            file_bytes: 128 * 1024 * 1024,
            query_id: query_id.into(),
        }
    }
}

/// Writes each batch's rows as Parquet files under a directory and lists them
/// in Spark's file-sink log ([`SparkFileLog`]) when the batch finishes.
///
/// A batch's files are written under hidden temporary names (a leading `.`,
/// which readers skip), made durable and renamed to
/// `part-<batch>-<n>.<codec>.parquet` when it finishes, and then listed in the
/// log's entry for the batch, which is written once. A batch replayed before
/// its entry was written writes the same rows in the same files again,
/// replacing them; one whose entry exists was delivered ([`Sink::delivered`])
/// and is not written again. Spark reading the directory lists the files from
/// the log, so it sees each row exactly once; a reader that lists the directory
/// itself may see the files of a batch whose entry a crash prevented, until the
/// batch is replayed.
#[derive(Debug)]
pub struct ParquetSink {
    options: Arc<ParquetOptions>,
    log: SparkFileLog,
    batch: Option<Batch>,
    /// What the batch finished last wrote.
    written: Written,
}

/// What a batch wrote, for the progress report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Written {
    pub(crate) files: u64,
    pub(crate) bytes: u64,
    pub(crate) rows: u64,
}

impl Written {
    /// As the progress report's `sink.metrics`.
    pub(crate) fn metrics(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("filesWritten".to_owned(), self.files.to_string()),
            ("bytesWritten".to_owned(), self.bytes.to_string()),
            ("rowsWritten".to_owned(), self.rows.to_string()),
        ])
    }
}

/// The batch being written.
#[derive(Debug, Default)]
struct Batch {
    id: u64,
    /// Already listed in the log: nothing is written.
    delivered: bool,
    /// The file being written in each partition directory, by the
    /// directory's path under the table.
    open: HashMap<String, Open>,
    /// Files closed, as their numbers and (temporary, final) paths.
    closed: Vec<(u32, PathBuf, PathBuf)>,
    /// Files begun, which numbers the next one.
    files: u32,
    /// Rows written.
    rows: u64,
}

struct Open {
    /// The file's number in its batch.
    number: u32,
    temp: PathBuf,
    path: PathBuf,
    writer: ArrowWriter<File>,
}

impl std::fmt::Debug for Open {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Open").field("temp", &self.temp).finish()
    }
}

impl ParquetSink {
    /// A sink writing into `options.path`, created if missing. Refuses a
    /// directory that another query writes, or whose file-sink log another
    /// writer (Spark's own file sink) keeps.
    pub fn open(mut options: ParquetOptions) -> Result<ParquetSink, LakeError> {
        fs::create_dir_all(&options.path).map_err(LakeError::io("creating", &options.path))?;
        options.path = options
            .path
            .canonicalize()
            .map_err(LakeError::io("resolving", &options.path))?;
        if options.row_group_rows == 0 || options.file_bytes == 0 {
            return Err(LakeError::Options(
                "the row group's rows and the file's bytes must be more than 0".to_owned(),
            ));
        }
        let log = SparkFileLog::new(&options.path);
        let marker = options.path.join(QUERY_MARKER);
        let foreign = |found: String| LakeError::Foreign {
            path: options.path.clone(),
            found,
            ours: format!("query {}", options.query_id),
        };
        match fs::read_to_string(&marker) {
            Ok(found) if found.trim() == options.query_id => {}
            Ok(found) => return Err(foreign(format!("query {}", found.trim()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !log.batches()?.is_empty() {
                    return Err(foreign(
                        "a file-sink log without a query of Sluice's, such as Spark's file sink"
                            .to_owned(),
                    ));
                }
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&marker)
                    .and_then(|mut f| {
                        f.write_all(options.query_id.as_bytes())?;
                        f.sync_all()
                    })
                    .map_err(LakeError::io("writing", &marker))?;
                sync_dir(&options.path)?;
            }
            Err(e) => return Err(LakeError::io("reading", &marker)(e)),
        }
        Ok(ParquetSink {
            options: Arc::new(options),
            log,
            batch: None,
            written: Written::default(),
        })
    }

    /// Checks that the query's output `schema` fits the options: every
    /// partition column is one of its columns, of a type whose values name a
    /// directory, and some column is left for the files.
    pub fn check(&self, schema: &Schema) -> Result<(), LakeError> {
        check_partitions(&self.options.partition_by, schema)
    }

    /// The table's directory.
    pub fn path(&self) -> &Path {
        &self.options.path
    }

    /// The table's file-sink log.
    pub fn log(&self) -> &SparkFileLog {
        &self.log
    }

    /// Runs blocking file work on tokio's blocking pool with the open batch.
    async fn with_batch<T: Send + 'static>(
        &mut self,
        work: impl FnOnce(&ParquetOptions, &mut Batch) -> Result<T, LakeError> + Send + 'static,
    ) -> Result<T, LakeError> {
        let mut batch = self
            .batch
            .take()
            .ok_or_else(|| LakeError::Task("rows arrived outside a batch".to_owned()))?;
        let options = self.options.clone();
        let (batch, result) = tokio::task::spawn_blocking(move || {
            let result = work(&options, &mut batch);
            (batch, result)
        })
        .await
        .map_err(|e| LakeError::Task(e.to_string()))?;
        self.batch = Some(batch);
        result
    }
}

pub(crate) fn check_partitions(partition_by: &[String], schema: &Schema) -> Result<(), LakeError> {
    for column in partition_by {
        let field = schema.field_with_name(column).map_err(|_| {
            LakeError::Options(format!(
                "partition column `{column}` is not a column of the query's output ({})",
                schema
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        if !partition_type(field.data_type()) {
            return Err(LakeError::Options(format!(
                "partition column `{column}` is {}; a partition column must be a string, an \
                 integer, a boolean or a date",
                field.data_type()
            )));
        }
    }
    if schema.fields().len() <= partition_by.len() {
        return Err(LakeError::Options(
            "every column is a partition column, which leaves the files none".to_owned(),
        ));
    }
    Ok(())
}

fn partition_type(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::Boolean
            | DataType::Date32
    )
}

/// A partition value as a directory name's part, escaped as Spark's
/// `ExternalCatalogUtils.escapePathName` does.
fn escape_partition_value(value: &str) -> String {
    if value.is_empty() {
        return NULL_PARTITION.to_owned();
    }
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        let escaped = matches!(
            c,
            '\u{1}'
                ..='\u{1f}'
                    | '"'
                    | '#'
                    | '%'
                    | '\''
                    | '*'
                    | '/'
                    | ':'
                    | '='
                    | '?'
                    | '\\'
                    | '\u{7f}'
                    | '{'
                    | '['
                    | ']'
                    | '^'
        );
        if escaped {
            out.push_str(&format!("%{:02X}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// Each row's partition directory under the table (`a=1/b=x`), as the row
/// numbers of each directory in the order the directories first come.
fn partitions(
    partition_by: &[String],
    rows: &RecordBatch,
) -> Result<Vec<(String, Vec<u32>)>, LakeError> {
    let texts: Vec<ArrayRef> = partition_by
        .iter()
        .map(|column| {
            let array = rows
                .column_by_name(column)
                .ok_or_else(|| LakeError::Partition {
                    column: column.clone(),
                    reason: "no such column in the rows".to_owned(),
                })?;
            cast(array, &DataType::Utf8).map_err(|e| LakeError::Partition {
                column: column.clone(),
                reason: e.to_string(),
            })
        })
        .collect::<Result<_, _>>()?;
    let texts: Vec<&arrow::array::StringArray> = texts
        .iter()
        .map(|a| arrow::array::AsArray::as_string::<i32>(a.as_ref()))
        .collect();
    let mut order: Vec<(String, Vec<u32>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut dir = String::new();
    for row in 0..rows.num_rows() {
        dir.clear();
        for (column, text) in partition_by.iter().zip(&texts) {
            if !dir.is_empty() {
                dir.push('/');
            }
            dir.push_str(&escape_partition_value(column));
            dir.push('=');
            if text.is_null(row) {
                dir.push_str(NULL_PARTITION);
            } else {
                dir.push_str(&escape_partition_value(text.value(row)));
            }
        }
        match index.get(&dir) {
            Some(&i) => order[i].1.push(row as u32),
            None => {
                index.insert(dir.clone(), order.len());
                order.push((dir.clone(), vec![row as u32]));
            }
        }
    }
    Ok(order)
}

impl Batch {
    /// Writes `rows` (the data columns only) into the file open in `dir`,
    /// beginning one when none is, and closes it once it reaches its size.
    fn write(
        &mut self,
        options: &ParquetOptions,
        dir: &str,
        rows: &RecordBatch,
    ) -> Result<(), LakeError> {
        if !self.open.contains_key(dir) {
            let folder = options.path.join(dir);
            fs::create_dir_all(&folder).map_err(LakeError::io("creating", &folder))?;
            let name = format!(
                "part-{:05}-{:05}{}.parquet",
                self.id,
                self.files,
                options.compression.tag()
            );
            self.files += 1;
            let path = folder.join(&name);
            let temp = folder.join(format!(".{name}.tmp"));
            let file = File::create(&temp).map_err(LakeError::io("creating", &temp))?;
            let properties = WriterProperties::builder()
                .set_compression(options.compression.parquet())
                .set_max_row_group_row_count(Some(options.row_group_rows))
                .build();
            let writer =
                ArrowWriter::try_new(file, rows.schema(), Some(properties)).map_err(|source| {
                    LakeError::Parquet {
                        path: temp.clone(),
                        source,
                    }
                })?;
            let number = self.files - 1;
            self.open.insert(
                dir.to_owned(),
                Open {
                    number,
                    temp,
                    path,
                    writer,
                },
            );
        }
        self.rows += rows.num_rows() as u64;
        let open = self.open.get_mut(dir).expect("opened above");
        open.writer
            .write(rows)
            .map_err(|source| LakeError::Parquet {
                path: open.temp.clone(),
                source,
            })?;
        let size = open.writer.bytes_written() + open.writer.in_progress_size();
        if size as u64 >= options.file_bytes {
            let open = self.open.remove(dir).expect("open above");
            self.closed.push(close(open)?);
        }
        Ok(())
    }

    /// Removes the batch's temporary files: a batch begun again, or cut short.
    fn abandon(&mut self) {
        for (_, open) in self.open.drain() {
            let _ = fs::remove_file(&open.temp);
        }
        for (_, temp, _) in self.closed.drain(..) {
            let _ = fs::remove_file(&temp);
        }
    }
}

/// Ends a file's Parquet footer and makes it durable.
fn close(mut open: Open) -> Result<(u32, PathBuf, PathBuf), LakeError> {
    open.writer.finish().map_err(|source| LakeError::Parquet {
        path: open.temp.clone(),
        source,
    })?;
    open.writer
        .inner()
        .sync_all()
        .map_err(LakeError::io("syncing", &open.temp))?;
    Ok((open.number, open.temp, open.path))
}

fn sync_dir(dir: &Path) -> Result<(), LakeError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(LakeError::io("syncing", dir))
}

impl Sink for ParquetSink {
    type Error = LakeError;

    fn is_transient(error: &LakeError) -> bool {
        error.is_transient()
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<(), LakeError> {
        self.written = Written::default();
        let abandoned = self.batch.take();
        let log = self.log.clone();
        let started = tokio::task::spawn_blocking(move || {
            if let Some(mut abandoned) = abandoned {
                abandoned.abandon();
            }
            Batch {
                id: batch.0,
                delivered: log.has(batch.0),
                ..Batch::default()
            }
        })
        .await
        .map_err(|e| LakeError::Task(e.to_string()))?;
        self.batch = Some(started);
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), LakeError> {
        let log = self.log.clone();
        let written = self
            .with_batch(move |options, open| {
                if open.id != batch.0 {
                    return Err(LakeError::Task(format!(
                        "batch {batch} ends, but batch {} was begun",
                        open.id
                    )));
                }
                if open.delivered {
                    return Ok(Written::default());
                }
                let left: Vec<Open> = open.open.drain().map(|(_, file)| file).collect();
                for file in left {
                    open.closed.push(close(file)?);
                }
                // Listed in the order they were begun.
                open.closed.sort_by_key(|(number, _, _)| *number);
                let mut folders = Vec::new();
                let mut files = Vec::new();
                for (_, temp, path) in open.closed.drain(..) {
                    fs::rename(&temp, &path)
                        .map_err(LakeError::io("renaming into place", &path))?;
                    files.push(SinkFile::of(&path)?);
                    if let Some(folder) = path.parent()
                        && !folders.iter().any(|f: &PathBuf| f == folder)
                    {
                        folders.push(folder.to_owned());
                    }
                }
                for folder in folders.iter().chain([&options.path]) {
                    sync_dir(folder)?;
                }
                log.add(batch.0, &files)?;
                Ok(Written {
                    files: files.len() as u64,
                    bytes: files.iter().map(|f| f.size).sum(),
                    rows: open.rows,
                })
            })
            .await?;
        self.batch = None;
        self.written = written;
        Ok(())
    }

    fn metrics(&self) -> BTreeMap<String, String> {
        self.written.metrics()
    }

    async fn delivered(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<bool, LakeError> {
        Ok(self.log.has(batch.0))
    }
}

impl Writes<RecordBatch> for ParquetSink {
    async fn write(&mut self, rows: &RecordBatch) -> Result<(), LakeError> {
        if rows.num_rows() == 0 || self.batch.as_ref().is_some_and(|b| b.delivered) {
            return Ok(());
        }
        let rows = rows.clone();
        self.with_batch(move |options, batch| {
            if options.partition_by.is_empty() {
                return batch.write(options, "", &rows);
            }
            let data: Vec<usize> = (0..rows.num_columns())
                .filter(|&i| {
                    let name = rows.schema_ref().field(i).name().clone();
                    !options.partition_by.contains(&name)
                })
                .collect();
            let data_rows = rows
                .project(&data)
                .map_err(|e| LakeError::Options(e.to_string()))?;
            for (dir, indices) in partitions(&options.partition_by, &rows)? {
                let part = take_record_batch(&data_rows, &UInt32Array::from(indices))
                    .map_err(|e| LakeError::Options(e.to_string()))?;
                batch.write(options, &dir, &part)?;
            }
            Ok(())
        })
        .await
    }
}

impl Drop for ParquetSink {
    fn drop(&mut self) {
        // A batch cut short is replayed on the next start; its files go.
        if let Some(mut batch) = self.batch.take() {
            batch.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{AsArray, Float64Array, Int64Array, StringArray};
    use arrow::datatypes::{Field, Int64Type};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    use super::*;

    fn rows(from: i64, count: i64) -> RecordBatch {
        let ids: Vec<i64> = (from..from + count).collect();
        let days: Vec<Option<&str>> = ids
            .iter()
            .map(|i| match i % 3 {
                0 => Some("2026-12-07"),
                1 => Some("a/b:c"),
                _ => None,
            })
            .collect();
        let amounts: Vec<f64> = ids.iter().map(|i| *i as f64 / 2.0).collect();
        RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new("day", DataType::Utf8, true),
                Field::new("amount", DataType::Float64, false),
            ])),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(StringArray::from(days)),
                Arc::new(Float64Array::from(amounts)),
            ],
        )
        .unwrap()
    }

    /// Every file the log lists, read back: its path under the table and its
    /// rows.
    fn listed(table: &Path) -> Vec<(String, RecordBatch)> {
        SparkFileLog::new(table)
            .files()
            .unwrap()
            .into_iter()
            .map(|file| {
                let local = file
                    .path
                    .strip_prefix("file://")
                    .unwrap()
                    .replace("%253A", "%3A")
                    .replace("%252F", "%2F");
                let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&local).unwrap())
                    .unwrap()
                    .build()
                    .unwrap();
                let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
                let rows = arrow::compute::concat_batches(&batches[0].schema(), &batches).unwrap();
                let under = local
                    .strip_prefix(table.canonicalize().unwrap().to_str().unwrap())
                    .unwrap()
                    .to_owned();
                (under, rows)
            })
            .collect()
    }

    async fn write_batch(sink: &mut ParquetSink, batch: u64, parts: &[RecordBatch]) {
        sink.begin_batch(BatchId(batch), &[]).await.unwrap();
        for part in parts {
            sink.write(part).await.unwrap();
        }
        sink.finish_batch(BatchId(batch)).await.unwrap();
    }

    #[tokio::test]
    async fn each_batch_lands_in_files_its_log_entry_lists() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = ParquetSink::open(ParquetOptions::new(dir.path(), "q1")).unwrap();
        write_batch(&mut sink, 0, &[rows(0, 10), rows(10, 5)]).await;
        write_batch(&mut sink, 1, &[rows(15, 3)]).await;
        let metrics = sink.metrics();
        assert_eq!(metrics["filesWritten"], "1");
        assert_eq!(metrics["rowsWritten"], "3");
        let size = fs::metadata(dir.path().join("part-00001-00000.zstd.parquet"))
            .unwrap()
            .len();
        assert_eq!(metrics["bytesWritten"], size.to_string());
        let files = listed(dir.path());
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "/part-00000-00000.zstd.parquet",
                "/part-00001-00000.zstd.parquet"
            ]
        );
        assert_eq!(
            files[0].1,
            arrow::compute::concat_batches(&rows(0, 1).schema(), &[rows(0, 10), rows(10, 5)])
                .unwrap()
        );
        assert_eq!(files[1].1, rows(15, 3));
        // Nothing beside the files, the log and the query's marker.
        let mut all: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        all.sort();
        assert_eq!(
            all,
            [
                "_sluice_query",
                "_spark_metadata",
                "part-00000-00000.zstd.parquet",
                "part-00001-00000.zstd.parquet"
            ]
        );
    }

    #[tokio::test]
    async fn partition_columns_name_directories_as_spark_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = ParquetOptions::new(dir.path(), "q1");
        options.partition_by = vec!["day".to_owned()];
        options.compression = Compression::Snappy;
        let mut sink = ParquetSink::open(options).unwrap();
        sink.check(&rows(0, 1).schema()).unwrap();
        write_batch(&mut sink, 0, &[rows(0, 9)]).await;
        let files = listed(dir.path());
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "/day=2026-12-07/part-00000-00000.snappy.parquet",
                "/day=a%2Fb%3Ac/part-00000-00001.snappy.parquet",
                "/day=__HIVE_DEFAULT_PARTITION__/part-00000-00002.snappy.parquet",
            ]
        );
        for (n, (_, rows)) in files.iter().enumerate() {
            assert_eq!(
                rows.schema().fields().len(),
                2,
                "no partition column in the file"
            );
            let ids: Vec<i64> = rows.column(0).as_primitive::<Int64Type>().values().to_vec();
            assert_eq!(
                ids,
                (0..9).filter(|i| i % 3 == n as i64).collect::<Vec<_>>()
            );
        }
    }

    #[tokio::test]
    async fn files_roll_at_their_size_and_row_groups_at_their_rows() {
        let dir = tempfile::tempdir().unwrap();
        let mut options = ParquetOptions::new(dir.path(), "q1");
        options.row_group_rows = 100;
        options.file_bytes = 1;
        options.compression = Compression::None;
        let mut sink = ParquetSink::open(options).unwrap();
        write_batch(&mut sink, 0, &[rows(0, 250), rows(250, 250)]).await;
        let files = listed(dir.path());
        assert_eq!(files.len(), 2, "a file per write once each passes its size");
        assert_eq!(files[1].0, "/part-00000-00001.parquet");
        let meta = ParquetRecordBatchReaderBuilder::try_new(
            File::open(dir.path().join("part-00000-00000.parquet")).unwrap(),
        )
        .unwrap()
        .metadata()
        .clone();
        assert_eq!(meta.num_row_groups(), 3);
    }

    #[tokio::test]
    async fn a_batch_cut_short_leaves_nothing_and_its_replay_lands_once() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut sink = ParquetSink::open(ParquetOptions::new(dir.path(), "q1")).unwrap();
            sink.begin_batch(BatchId(0), &[]).await.unwrap();
            sink.write(&rows(0, 10)).await.unwrap();
            // Begun again: what it wrote goes.
            sink.begin_batch(BatchId(0), &[]).await.unwrap();
            sink.write(&rows(0, 4)).await.unwrap();
        }
        // Dropped before it finished: no file, no entry.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        // A crash after the files were renamed but before the entry: the
        // replay writes the same files again.
        fs::write(dir.path().join("part-00000-00000.zstd.parquet"), b"torn").unwrap();
        let mut sink = ParquetSink::open(ParquetOptions::new(dir.path(), "q1")).unwrap();
        assert!(!sink.delivered(BatchId(0), &[]).await.unwrap());
        write_batch(&mut sink, 0, &[rows(0, 10)]).await;
        assert!(sink.delivered(BatchId(0), &[]).await.unwrap());
        // Replayed once more after its entry: delivered, nothing written.
        write_batch(&mut sink, 0, &[rows(100, 10)]).await;
        let files = listed(dir.path());
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].1, rows(0, 10));
    }

    #[tokio::test]
    async fn another_writers_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = ParquetSink::open(ParquetOptions::new(dir.path(), "q1")).unwrap();
        write_batch(&mut sink, 0, &[rows(0, 1)]).await;
        let e = ParquetSink::open(ParquetOptions::new(dir.path(), "q2")).unwrap_err();
        assert!(matches!(e, LakeError::Foreign { .. }), "{e}");
        assert!(
            e.to_string().contains("query q1") && e.to_string().contains("query q2"),
            "{e}"
        );
        // A log some other writer keeps, such as Spark's file sink.
        let spark = tempfile::tempdir().unwrap();
        SparkFileLog::new(spark.path()).add(0, &[]).unwrap();
        let e = ParquetSink::open(ParquetOptions::new(spark.path(), "q1")).unwrap_err();
        assert!(e.to_string().contains("Spark's file sink"), "{e}");
        assert!(!spark.path().join(QUERY_MARKER).exists());
    }

    #[test]
    fn partition_columns_are_checked_against_the_output() {
        let schema = rows(0, 1).schema();
        let e = check_partitions(&["nope".to_owned()], &schema)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`nope`") && e.contains("id, day, amount"), "{e}");
        let e = check_partitions(&["amount".to_owned()], &schema)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`amount` is Float64"), "{e}");
        let all = ["id".to_owned(), "day".to_owned()];
        check_partitions(&all, &schema).unwrap();
        let narrow = Schema::new(vec![Field::new("id", DataType::Int64, false)]);
        assert!(check_partitions(&["id".to_owned()], &narrow).is_err());
    }

    #[test]
    fn partition_values_are_escaped_as_spark_escapes_them() {
        assert_eq!(escape_partition_value("a b=c/d%e:f"), "a b%3Dc%2Fd%25e%3Af");
        assert_eq!(escape_partition_value(""), NULL_PARTITION);
        assert_eq!(escape_partition_value("é\u{1}"), "é%01");
    }
}
