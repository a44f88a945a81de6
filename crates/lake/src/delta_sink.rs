//! `delta`: each batch's rows appended to a Delta Lake table as one commit
//! that also records the batch as the query's transaction version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use deltalake::kernel::engine::arrow_conversion::{TryIntoArrow, TryIntoKernel};
use deltalake::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake::kernel::{Action, StructType, Transaction};
use deltalake::protocol::{DeltaOperation, OutputMode};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use deltalake::{DeltaTable, DeltaTableBuilder, DeltaTableError};
use parquet::file::properties::WriterProperties;
use sluice_core::{BatchId, OffsetRange, Sink, Writes};

use crate::LakeError;
use crate::parquet_sink::{Compression, Written, check_partitions};

/// Where and how a [`DeltaSink`] writes.
#[derive(Clone, Debug)]
pub struct DeltaOptions {
    /// The table's directory.
    pub path: PathBuf,
    /// The table's partition columns, for a table this sink creates; an
    /// existing table's must be the same.
    pub partition_by: Vec<String>,
    /// The data files' codec.
    pub compression: Compression,
    /// The most rows a row group holds.
    pub row_group_rows: usize,
    /// The size at which a data file is closed and the next one begun.
    pub file_bytes: u64,
    /// Commits between checkpoints of the log, for a table this sink creates
    /// (Delta's `delta.checkpointInterval`).
    pub checkpoint_interval: u64,
    /// The query's id: the `appId` of the transactions this sink commits.
    pub query_id: String,
    /// The query's name, given to a table this sink creates.
    pub name: Option<String>,
}

impl DeltaOptions {
    /// Options for the table at `path`, written by query `query_id`, with the
    /// defaults: zstd, row groups of 1,048,576 rows, files of 128 MiB, and a
    /// checkpoint every 10 commits, as Delta makes them.
    pub fn new(path: impl Into<PathBuf>, query_id: impl Into<String>) -> DeltaOptions {
        DeltaOptions {
            path: path.into(),
            partition_by: Vec::new(),
            compression: Compression::Zstd,
            row_group_rows: 1024 * 1024,
            file_bytes: 128 * 1024 * 1024,
            checkpoint_interval: 10,
            query_id: query_id.into(),
            name: None,
        }
    }
}

/// Appends each batch's rows to a Delta Lake table, one commit per batch.
///
/// The commit carries the data files the batch wrote and a `txn` action with
/// the query id as `appId` and the batch id as `version`, as Spark's Delta sink
/// makes it. A batch whose id the table's transaction for the query already
/// reached was committed ([`Sink::delivered`]), and a replay of it writes
/// nothing. Files a batch wrote but never committed (a crash, a failed
/// commit) are in no version of the table; `sluice vacuum` removes them once
/// they are older than the retention.
pub struct DeltaSink {
    options: Arc<DeltaOptions>,
    /// The query's output as the table stores it.
    schema: SchemaRef,
    /// `None` until the table exists.
    table: Option<DeltaTable>,
    batch: Option<Batch>,
    written: Written,
}

impl std::fmt::Debug for DeltaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaSink")
            .field("path", &self.options.path)
            .field("version", &self.table.as_ref().and_then(|t| t.version()))
            .finish()
    }
}

struct Batch {
    id: u64,
    /// The table's transaction for the query already has the batch.
    delivered: bool,
    writer: Option<RecordBatchWriter>,
    rows: u64,
}

impl DeltaSink {
    /// A sink appending the query's output, of `schema`, to the table at
    /// `options.path`. An existing table must hold the query's columns with
    /// the same types and partition columns; a missing one is created when
    /// the first batch begins.
    pub async fn open(mut options: DeltaOptions, schema: &Schema) -> Result<DeltaSink, LakeError> {
        std::fs::create_dir_all(&options.path).map_err(LakeError::io("creating", &options.path))?;
        options.path = options
            .path
            .canonicalize()
            .map_err(LakeError::io("resolving", &options.path))?;
        if options.row_group_rows == 0
            || options.file_bytes == 0
            || options.checkpoint_interval == 0
        {
            return Err(LakeError::Options(
                "the row group's rows, the file's bytes and the checkpoint interval must be more \
                 than 0"
                    .to_owned(),
            ));
        }
        check_partitions(&options.partition_by, schema)?;
        let schema = Arc::new(delta_schema(schema)?);
        let table = load(&options.path).await?;
        if let Some(table) = &table {
            fits(&options, &schema, table)?;
        }
        Ok(DeltaSink {
            options: Arc::new(options),
            schema,
            table,
            batch: None,
            written: Written::default(),
        })
    }

    /// The table's directory.
    pub fn path(&self) -> &Path {
        &self.options.path
    }

    /// The version the table's transaction for the query reached: the last
    /// batch committed, if any.
    async fn committed(&mut self) -> Result<Option<i64>, LakeError> {
        let path = self.options.path.clone();
        let Some(table) = &mut self.table else {
            return Ok(None);
        };
        table.update_state().await.map_err(delta(&path))?;
        let state = table.snapshot().map_err(delta(&path))?;
        state
            .transaction_version(table.log_store().as_ref(), &self.options.query_id)
            .await
            .map_err(delta(&path))
    }

    /// Creates the table from the query's schema.
    async fn create(&mut self) -> Result<(), LakeError> {
        let path = self.options.path.clone();
        let columns: StructType = self.schema.as_ref().try_into_kernel().map_err(|e| {
            LakeError::Options(format!("the query's output as a Delta schema: {e}"))
        })?;
        let mut create = DeltaTable::try_from_url(table_url(&path)?)
            .await
            .map_err(delta(&path))?
            .create()
            .with_columns(columns.fields().cloned())
            .with_partition_columns(self.options.partition_by.clone())
            .with_configuration_property(
                deltalake::TableProperty::CheckpointInterval,
                Some(self.options.checkpoint_interval.to_string()),
            );
        if let Some(name) = &self.options.name {
            create = create.with_table_name(name.clone());
        }
        let table = create.await.map_err(delta(&path))?;
        tracing::info!(path = %path.display(), "created the Delta table");
        self.table = Some(table);
        Ok(())
    }
}

/// The table at `path`, or `None` when there is none yet.
async fn load(path: &Path) -> Result<Option<DeltaTable>, LakeError> {
    // Delta's reader logs an error for a directory without a log; without
    // one there is no table yet, which is no error here.
    let log = path.join("_delta_log");
    match std::fs::metadata(&log) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LakeError::io("reading", log)(e)),
    }
    let mut table = DeltaTableBuilder::from_url(table_url(path)?)
        .map_err(delta(path))?
        .build()
        .map_err(delta(path))?;
    match table.load().await {
        Ok(()) => Ok(Some(table)),
        Err(DeltaTableError::NotATable(_)) => Ok(None),
        Err(e) => Err(delta(path)(e)),
    }
}

fn table_url(path: &Path) -> Result<url::Url, LakeError> {
    url::Url::from_directory_path(path)
        .map_err(|()| LakeError::Options(format!("{} is not an absolute path", path.display())))
}

fn delta(path: &Path) -> impl FnOnce(DeltaTableError) -> LakeError + use<> {
    let path = path.to_owned();
    move |source| LakeError::Delta {
        path,
        source: Box::new(source),
    }
}

/// Checks that an existing table takes the query's rows: the same columns in
/// any order, each of the same type, none the query may leave null that the
/// table holds not null, and the same partition columns.
fn fits(options: &DeltaOptions, schema: &Schema, table: &DeltaTable) -> Result<(), LakeError> {
    let path = &options.path;
    let state = table.snapshot().map_err(delta(path))?;
    let metadata = state.metadata();
    let stored = metadata.parse_schema().map_err(|e| delta(path)(e.into()))?;
    let stored: Schema = (&stored).try_into_arrow().map_err(|e| {
        LakeError::Options(format!("the table's schema at {}: {e}", path.display()))
    })?;
    let mut wrong = Vec::new();
    for field in schema.fields() {
        match stored.field_with_name(field.name()) {
            Err(_) => wrong.push(format!("`{}` is not a column of the table", field.name())),
            Ok(column) if column.data_type() != field.data_type() => wrong.push(format!(
                "`{}` is {} in the table and {} in the query",
                field.name(),
                column.data_type(),
                field.data_type()
            )),
            Ok(column) if !column.is_nullable() && field.is_nullable() => wrong.push(format!(
                "`{}` is NOT NULL in the table and may be null in the query",
                field.name()
            )),
            Ok(_) => {}
        }
    }
    for column in stored.fields() {
        if schema.field_with_name(column.name()).is_err() {
            wrong.push(format!(
                "`{}` is a column of the table the query does not have",
                column.name()
            ));
        }
    }
    let partitions: Vec<String> = metadata.partition_columns().to_vec();
    if partitions != options.partition_by {
        wrong.push(format!(
            "the table is partitioned by [{}] and the sink by [{}]",
            partitions.join(", "),
            options.partition_by.join(", ")
        ));
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(LakeError::Schema {
            path: path.clone(),
            reasons: wrong,
        })
    }
}

/// The query's output as a Delta table stores it: timestamps in microseconds
/// (with the zone as UTC), unsigned integers in the next wider signed type,
/// and the large and view forms of strings and binaries in the plain ones.
fn delta_schema(schema: &Schema) -> Result<Schema, LakeError> {
    let fields = schema
        .fields()
        .iter()
        .map(|field| {
            let data_type = delta_type(field.data_type()).ok_or_else(|| {
                LakeError::Options(format!(
                    "column `{}` is {}, which a Delta table cannot store; cast it in the query",
                    field.name(),
                    field.data_type()
                ))
            })?;
            Ok(Field::new(field.name(), data_type, field.is_nullable()))
        })
        .collect::<Result<Vec<_>, LakeError>>()?;
    Ok(Schema::new(fields))
}

fn delta_type(data_type: &DataType) -> Option<DataType> {
    Some(match data_type {
        DataType::Boolean
        | DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::Float32
        | DataType::Float64
        | DataType::Utf8
        | DataType::Binary
        | DataType::Date32 => data_type.clone(),
        DataType::Decimal128(precision, _) if *precision <= 38 => data_type.clone(),
        DataType::UInt8 => DataType::Int16,
        DataType::UInt16 => DataType::Int32,
        DataType::UInt32 => DataType::Int64,
        DataType::LargeUtf8 | DataType::Utf8View => DataType::Utf8,
        DataType::LargeBinary | DataType::BinaryView => DataType::Binary,
        DataType::Timestamp(_, Some(_)) => {
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
        }
        DataType::Timestamp(_, None) => DataType::Timestamp(TimeUnit::Microsecond, None),
        _ => return None,
    })
}

/// `rows` in the table's types, column by column.
fn conform(rows: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, LakeError> {
    if rows.schema_ref().fields() == schema.fields() {
        return Ok(rows.clone());
    }
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let column = rows.column_by_name(field.name()).ok_or_else(|| {
                LakeError::Options(format!("the rows have no column `{}`", field.name()))
            })?;
            cast(column, field.data_type()).map_err(|e| {
                LakeError::Options(format!(
                    "column `{}` as {}: {e}",
                    field.name(),
                    field.data_type()
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema.clone(), columns)
        .map_err(|e| LakeError::Options(format!("the rows in the table's schema: {e}")))
}

/// Whether a failed commit may succeed when the batch is written again: the
/// store's I/O, or another writer's commit of the same version.
fn transient(error: &DeltaTableError) -> bool {
    match error {
        DeltaTableError::ObjectStore { .. } | DeltaTableError::Io { .. } => true,
        DeltaTableError::VersionAlreadyExists(_) => true,
        DeltaTableError::Transaction { source } => matches!(
            source,
            TransactionError::VersionAlreadyExists(_)
                | TransactionError::MaxCommitAttempts(_)
                | TransactionError::ObjectStore { .. }
                | TransactionError::CommitConflict(_)
        ),
        _ => false,
    }
}

impl Sink for DeltaSink {
    type Error = LakeError;

    fn is_transient(error: &LakeError) -> bool {
        match error {
            LakeError::Delta { source, .. } => transient(source),
            other => other.is_transient(),
        }
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<(), LakeError> {
        self.written = Written::default();
        if let Some(mut abandoned) = self.batch.take()
            && let Some(writer) = &mut abandoned.writer
        {
            writer.reset();
        }
        if self.table.is_none() {
            self.create().await?;
        }
        let delivered = self
            .committed()
            .await?
            .is_some_and(|version| version >= batch.0 as i64);
        let writer = if delivered {
            None
        } else {
            let table = self.table.as_ref().expect("created above");
            let properties = WriterProperties::builder()
                .set_compression(self.options.compression.parquet())
                .set_max_row_group_row_count(Some(self.options.row_group_rows))
                .build();
            Some(
                RecordBatchWriter::for_table(table)
                    .map_err(delta(&self.options.path))?
                    .with_writer_properties(properties)
                    .with_target_file_size(self.options.file_bytes),
            )
        };
        self.batch = Some(Batch {
            id: batch.0,
            delivered,
            writer,
            rows: 0,
        });
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), LakeError> {
        let path = self.options.path.clone();
        let Some(open) = self.batch.as_mut() else {
            return Err(LakeError::Task(format!(
                "batch {batch} ends, but none was begun"
            )));
        };
        if open.id != batch.0 {
            return Err(LakeError::Task(format!(
                "batch {batch} ends, but batch {} was begun",
                open.id
            )));
        }
        if open.delivered {
            self.batch = None;
            return Ok(());
        }
        let writer = open
            .writer
            .as_mut()
            .expect("a batch not delivered has a writer");
        let adds = writer.flush().await.map_err(delta(&path))?;
        let written = Written {
            files: adds.len() as u64,
            bytes: adds.iter().map(|a| a.size.max(0) as u64).sum(),
            rows: open.rows,
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let properties = CommitProperties::default()
            .with_application_transaction(Transaction::new_with_last_update(
                &self.options.query_id,
                batch.0 as i64,
                Some(now),
            ))
            // Another writer's commit fails this one; the executor's retry
            // policy writes the batch again.
            .with_max_retries(0);
        let table = self.table.as_mut().expect("a batch begun has a table");
        let state = table.snapshot().map_err(delta(&path))?;
        let committed = CommitBuilder::from(properties)
            .with_actions(adds.into_iter().map(Action::Add).collect())
            .build(
                Some(state),
                table.log_store(),
                DeltaOperation::StreamingUpdate {
                    output_mode: OutputMode::Append,
                    query_id: self.options.query_id.clone(),
                    epoch_id: batch.0 as i64,
                },
            )
            .await
            .map_err(delta(&path))?;
        tracing::debug!(
            batch = batch.0,
            version = committed.version(),
            "committed to the Delta table"
        );
        table.update_state().await.map_err(delta(&path))?;
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
        Ok(self
            .committed()
            .await?
            .is_some_and(|version| version >= batch.0 as i64))
    }
}

impl Writes<RecordBatch> for DeltaSink {
    async fn write(&mut self, rows: &RecordBatch) -> Result<(), LakeError> {
        let path = self.options.path.clone();
        let schema = self.schema.clone();
        let Some(batch) = self.batch.as_mut() else {
            return Err(LakeError::Task("rows arrived outside a batch".to_owned()));
        };
        if rows.num_rows() == 0 || batch.delivered {
            return Ok(());
        }
        let rows = conform(rows, &schema)?;
        batch.rows += rows.num_rows() as u64;
        batch
            .writer
            .as_mut()
            .expect("a batch not delivered has a writer")
            .write(rows)
            .await
            .map_err(delta(&path))
    }
}

/// What [`vacuum`] removed, or would remove in a dry run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vacuumed {
    /// The files, as paths under the table.
    pub files: Vec<String>,
    /// Whether the files were only listed.
    pub dry_run: bool,
}

/// Removes the data files of the table at `path` that its current version
/// does not list and that are older than `retain` (the table's
/// `delta.deletedFileRetentionDuration`, a week, when `None`): files of
/// versions since replaced, and files a batch wrote but never committed.
///
/// A `retain` shorter than the table's own retention is refused unless
/// `check_retention` is false, since a reader of an older version, or a batch
/// being written now, may still need the files.
pub async fn vacuum(
    path: &Path,
    retain: Option<std::time::Duration>,
    check_retention: bool,
    dry_run: bool,
) -> Result<Vacuumed, LakeError> {
    use deltalake::operations::vacuum::VacuumMode;
    use deltalake::table::config::TablePropertiesExt as _;

    let Some(table) = load(path).await? else {
        return Err(LakeError::Options(format!(
            "{} is not a Delta table: it has no _delta_log",
            path.display()
        )));
    };
    let minimum = table
        .snapshot()
        .map_err(delta(path))?
        .table_config()
        .deleted_file_retention_duration();
    let retain = retain.unwrap_or(minimum);
    if check_retention && retain < minimum {
        return Err(LakeError::Options(format!(
            "a retention of {} hours is shorter than the table's \
             delta.deletedFileRetentionDuration ({} hours): a reader of an older version or a \
             batch being written may need those files; stop the query and pass \
             --no-retention-check to remove them anyway",
            retain.as_secs() / 3600,
            minimum.as_secs() / 3600
        )));
    }
    let retain = chrono::Duration::from_std(retain)
        .map_err(|e| LakeError::Options(format!("the retention: {e}")))?;
    let (_, metrics) = table
        .vacuum()
        .with_mode(VacuumMode::Full)
        .with_retention_period(retain)
        .with_enforce_retention_duration(false)
        .with_dry_run(dry_run)
        .await
        .map_err(delta(path))?;
    Ok(Vacuumed {
        files: metrics.files_deleted,
        dry_run,
    })
}

#[cfg(test)]
mod tests {
    use arrow::array::{AsArray, Int64Array, TimestampMillisecondArray};
    use arrow::datatypes::Int64Type;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    use super::*;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("day", DataType::Utf8View, true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                true,
            ),
        ])
    }

    fn rows(from: i64, count: i64) -> RecordBatch {
        let ids: Vec<i64> = (from..from + count).collect();
        let days: Vec<Option<&str>> = ids
            .iter()
            .map(|i| if i % 2 == 0 { Some("even") } else { None })
            .collect();
        let at: Vec<i64> = ids.iter().map(|i| 1_765_000_000_000 + i).collect();
        RecordBatch::try_new(
            Arc::new(schema()),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(arrow::array::StringViewArray::from(days)),
                Arc::new(TimestampMillisecondArray::from(at).with_timezone("UTC")),
            ],
        )
        .unwrap()
    }

    async fn batch(sink: &mut DeltaSink, id: u64, parts: &[RecordBatch]) {
        sink.begin_batch(BatchId(id), &[]).await.unwrap();
        for part in parts {
            sink.write(part).await.unwrap();
        }
        sink.finish_batch(BatchId(id)).await.unwrap();
    }

    /// The ids in the table's current version, read from its data files.
    async fn ids(path: &Path) -> Vec<i64> {
        let table = load(path).await.unwrap().unwrap();
        let mut ids = Vec::new();
        for uri in table.get_file_uris().unwrap() {
            let file = match url::Url::parse(&uri) {
                Ok(url) => url.to_file_path().unwrap(),
                Err(_) => PathBuf::from(&uri),
            };
            let reader =
                ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(file).unwrap())
                    .unwrap()
                    .build()
                    .unwrap();
            for rows in reader {
                let rows = rows.unwrap();
                ids.extend(
                    rows.column_by_name("id")
                        .unwrap()
                        .as_primitive::<Int64Type>()
                        .values(),
                );
            }
        }
        ids.sort_unstable();
        ids
    }

    /// Each commit's `txn` actions, as (appId, version), from the log's JSON.
    fn transactions(path: &Path) -> Vec<Vec<(String, i64)>> {
        let mut commits: Vec<PathBuf> = std::fs::read_dir(path.join("_delta_log"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        commits.sort();
        commits
            .iter()
            .map(|commit| {
                std::fs::read_to_string(commit)
                    .unwrap()
                    .lines()
                    .filter_map(|line| {
                        let action: serde_json::Value = serde_json::from_str(line).unwrap();
                        let txn = action.get("txn")?;
                        Some((
                            txn["appId"].as_str().unwrap().to_owned(),
                            txn["version"].as_i64().unwrap(),
                        ))
                    })
                    .collect()
            })
            .collect()
    }

    #[tokio::test]
    async fn each_batch_is_one_commit_with_its_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        assert!(
            !path.join("_delta_log").exists(),
            "created by the first batch"
        );
        batch(&mut sink, 0, &[rows(0, 5), rows(5, 5)]).await;
        assert_eq!(sink.metrics()["rowsWritten"], "10");
        assert_eq!(sink.metrics()["filesWritten"], "1");
        batch(&mut sink, 1, &[rows(10, 3)]).await;
        assert_eq!(ids(&path).await, (0..13).collect::<Vec<_>>());
        // Version 0 creates the table; each batch is a version of its own.
        assert_eq!(
            transactions(&path),
            vec![
                vec![],
                vec![("q-1".to_owned(), 0)],
                vec![("q-1".to_owned(), 1)]
            ]
        );
        let stored = load(&path).await.unwrap().unwrap();
        let metadata = stored.snapshot().unwrap().metadata().clone();
        assert_eq!(
            metadata
                .configuration()
                .get("delta.checkpointInterval")
                .map(String::as_str),
            Some("10")
        );
    }

    #[tokio::test]
    async fn a_batch_the_table_has_is_delivered_and_not_appended_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        batch(&mut sink, 0, &[rows(0, 4)]).await;
        batch(&mut sink, 1, &[rows(4, 4)]).await;
        drop(sink);
        // A restart after the commit and before the store's.
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        assert!(sink.delivered(BatchId(1), &[]).await.unwrap());
        assert!(!sink.delivered(BatchId(2), &[]).await.unwrap());
        batch(&mut sink, 1, &[rows(4, 4)]).await;
        assert_eq!(sink.metrics()["rowsWritten"], "0");
        batch(&mut sink, 2, &[rows(8, 1)]).await;
        assert_eq!(ids(&path).await, (0..9).collect::<Vec<_>>());
        // Another query's transactions are its own.
        let mut other = DeltaSink::open(DeltaOptions::new(&path, "q-2"), &schema())
            .await
            .unwrap();
        assert!(!other.delivered(BatchId(1), &[]).await.unwrap());
    }

    #[tokio::test]
    async fn a_batch_begun_again_drops_what_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        sink.begin_batch(BatchId(0), &[]).await.unwrap();
        sink.write(&rows(0, 4)).await.unwrap();
        batch(&mut sink, 0, &[rows(0, 2)]).await;
        assert_eq!(ids(&path).await, vec![0, 1]);
    }

    #[tokio::test]
    async fn the_log_is_checkpointed_every_ten_commits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        for id in 0..12 {
            batch(&mut sink, id, &[rows(id as i64, 1)]).await;
        }
        let mut checkpoints: Vec<String> = std::fs::read_dir(path.join("_delta_log"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains(".checkpoint."))
            .collect();
        checkpoints.sort();
        assert_eq!(checkpoints, vec!["00000000000000000009.checkpoint.parquet"]);
        assert_eq!(ids(&path).await, (0..12).collect::<Vec<_>>());
        assert!(sink.delivered(BatchId(11), &[]).await.unwrap());
    }

    #[tokio::test]
    async fn partitioned_tables_write_hive_directories() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut options = DeltaOptions::new(&path, "q-1");
        options.partition_by = vec!["day".to_owned()];
        let mut sink = DeltaSink::open(options.clone(), &schema()).await.unwrap();
        batch(&mut sink, 0, &[rows(0, 6)]).await;
        assert!(path.join("day=even").is_dir());
        assert_eq!(ids(&path).await.len(), 6);
        // The same table with other partition columns is refused.
        options.partition_by = Vec::new();
        let e = DeltaSink::open(options, &schema()).await.unwrap_err();
        assert!(e.to_string().contains("partitioned by [day]"), "{e}");
    }

    #[tokio::test]
    async fn a_table_the_output_does_not_fit_is_refused_naming_the_columns() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        batch(&mut sink, 0, &[rows(0, 1)]).await;
        let other = Schema::new(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("day", DataType::Utf8, true),
            Field::new("extra", DataType::Int32, true),
        ]);
        let e = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &other)
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, LakeError::Schema { .. }), "{e}");
        assert!(
            text.contains("`id` is Int64 in the table and Utf8 in the query"),
            "{text}"
        );
        assert!(
            text.contains("`extra` is not a column of the table"),
            "{text}"
        );
        assert!(
            text.contains("`at` is a column of the table the query does not have"),
            "{text}"
        );
        let nullable = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("day", DataType::Utf8, true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ]);
        let e = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &nullable)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("`id` is NOT NULL in the table"),
            "{e}"
        );
        // Stored types of another width are the same column.
        let wide = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("day", DataType::LargeUtf8, true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Second, Some("+01:00".into())),
                true,
            ),
        ]);
        DeltaSink::open(DeltaOptions::new(&path, "q-1"), &wide)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn columns_a_delta_table_cannot_store_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let odd = Schema::new(vec![Field::new("n", DataType::UInt64, true)]);
        let e = DeltaSink::open(DeltaOptions::new(dir.path(), "q-1"), &odd)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("column `n` is UInt64"), "{e}");
    }

    #[tokio::test]
    async fn vacuum_removes_only_files_no_version_lists_once_old_enough() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut sink = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        batch(&mut sink, 0, &[rows(0, 3)]).await;
        // What a batch cut short between its files and its commit leaves.
        let orphan = path.join("part-00000-cut-short.c000.zstd.parquet");
        std::fs::copy(
            load(&path)
                .await
                .unwrap()
                .unwrap()
                .get_file_uris()
                .unwrap()
                .next()
                .map(|uri| {
                    url::Url::parse(&uri)
                        .ok()
                        .and_then(|u| u.to_file_path().ok())
                        .unwrap_or_else(|| PathBuf::from(&uri))
                })
                .unwrap(),
            &orphan,
        )
        .unwrap();
        let canonical = path.canonicalize().unwrap();
        // Within the week the table keeps files, nothing goes.
        let kept = vacuum(&canonical, None, true, false).await.unwrap();
        assert!(kept.files.is_empty(), "{kept:?}");
        let e = vacuum(&canonical, Some(std::time::Duration::ZERO), true, false)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("shorter than the table's"), "{e}");
        let listed = vacuum(&canonical, Some(std::time::Duration::ZERO), false, true)
            .await
            .unwrap();
        assert_eq!(listed.files.len(), 1, "{listed:?}");
        assert!(
            listed.files[0].ends_with("cut-short.c000.zstd.parquet"),
            "{listed:?}"
        );
        assert!(orphan.exists(), "a dry run removes nothing");
        vacuum(&canonical, Some(std::time::Duration::ZERO), false, false)
            .await
            .unwrap();
        assert!(!orphan.exists());
        assert_eq!(ids(&path).await, vec![0, 1, 2]);
        let e = vacuum(dir.path(), None, true, false).await.unwrap_err();
        assert!(e.to_string().contains("is not a Delta table"), "{e}");
    }

    #[tokio::test]
    async fn a_commit_another_writer_got_in_before_is_transient_and_succeeds_when_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("table");
        let mut ours = DeltaSink::open(DeltaOptions::new(&path, "q-1"), &schema())
            .await
            .unwrap();
        batch(&mut ours, 0, &[rows(0, 2)]).await;
        let mut theirs = DeltaSink::open(DeltaOptions::new(&path, "q-2"), &schema())
            .await
            .unwrap();
        ours.begin_batch(BatchId(1), &[]).await.unwrap();
        ours.write(&rows(2, 2)).await.unwrap();
        batch(&mut theirs, 0, &[rows(100, 1)]).await;
        let e = ours.finish_batch(BatchId(1)).await.unwrap_err();
        assert!(DeltaSink::is_transient(&e), "{e}");
        // The executor's retry: the batch begun and written again.
        batch(&mut ours, 1, &[rows(2, 2)]).await;
        assert_eq!(ids(&path).await, vec![0, 1, 2, 3, 100]);
        assert!(ours.delivered(BatchId(1), &[]).await.unwrap());
    }
}
