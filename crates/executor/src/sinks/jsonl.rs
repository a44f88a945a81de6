//! `jsonl`: one file of JSON lines per batch, named by the batch id.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, Writes};

use super::rows::write_rows_json;
use super::{SinkError, write_record_json};

/// Writes each batch to `<dir>/batch-<id, 20 digits>.jsonl`, one record per line
/// in the order read, atomically: records stream into a temporary file, which is
/// fsynced and renamed into place when the batch ends, and the directory is
/// fsynced. A replayed batch has the same id and records, so it replaces its file
/// with the same records: the directory holds every record exactly once.
#[derive(Debug)]
pub struct JsonlSink {
    dir: PathBuf,
    /// What each file's name starts with: `batch-`, or `batch-<generation>-`
    /// in group mode, whose generations each number their batches from 0.
    prefix: String,
    open: Option<Open>,
}

/// The batch being written. The JSON lines of one chunk are written in one
/// call, so the file needs no buffer of its own, and `lines` is reused from chunk
/// to chunk.
#[derive(Debug)]
struct Open {
    batch: BatchId,
    temp: PathBuf,
    file: File,
    lines: Vec<u8>,
}

impl JsonlSink {
    /// A sink writing into `dir`, created if missing.
    pub fn new(dir: impl Into<PathBuf>) -> Result<JsonlSink, SinkError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|source| SinkError::Io {
            action: "creating",
            path: dir.clone(),
            source,
        })?;
        Ok(JsonlSink {
            dir,
            prefix: "batch-".to_owned(),
            open: None,
        })
    }

    /// A sink writing the batches of one generation of a query in group mode
    /// (`docs/scale-out.md`) into `dir`, as `batch-<generation>-<id>.jsonl`:
    /// the members' files never collide, and a generation's batch replayed by
    /// whoever settles it replaces its own file.
    pub fn for_generation(
        dir: impl Into<PathBuf>,
        generation: &sluice_core::Generation,
    ) -> Result<JsonlSink, SinkError> {
        let mut sink = JsonlSink::new(dir)?;
        sink.prefix = format!("batch-{generation}-");
        Ok(sink)
    }

    /// The file a batch is written to.
    pub fn batch_path(&self, batch: BatchId) -> PathBuf {
        self.dir
            .join(format!("{}{:020}.jsonl", self.prefix, batch.0))
    }

    /// Runs blocking file work on tokio's blocking pool with the open batch.
    async fn with_open<T: Send + 'static>(
        &mut self,
        work: impl FnOnce(&mut Open) -> Result<T, SinkError> + Send + 'static,
    ) -> Result<T, SinkError> {
        let mut open = self
            .open
            .take()
            .ok_or_else(|| SinkError::Task("records arrived outside a batch".to_owned()))?;
        let (open, result) = tokio::task::spawn_blocking(move || {
            let result = work(&mut open);
            (open, result)
        })
        .await
        .map_err(|e| SinkError::Task(e.to_string()))?;
        self.open = Some(open);
        result
    }
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SinkError {
    let path = path.to_owned();
    move |source| SinkError::Io {
        action,
        path,
        source,
    }
}

impl JsonlSink {
    /// Starts `batch` in a new temporary file, dropping an abandoned one.
    async fn begin(&mut self, batch: BatchId, _ranges: &[OffsetRange]) -> Result<(), SinkError> {
        let abandoned = self.open.take().map(|open| open.temp);
        let path = self.batch_path(batch);
        let dir = self.dir.clone();
        let open = tokio::task::spawn_blocking(move || {
            if let Some(temp) = abandoned {
                // A batch begun again starts from an empty file.
                let _ = fs::remove_file(&temp);
            }
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let temp = dir.join(format!(".{name}.{}.tmp", uuid::Uuid::new_v4()));
            let file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temp)
                .map_err(io("creating", &temp))?;
            Ok::<_, SinkError>(Open {
                batch,
                temp,
                file,
                lines: Vec::new(),
            })
        })
        .await
        .map_err(|e| SinkError::Task(e.to_string()))??;
        self.open = Some(open);
        Ok(())
    }

    /// Writes what `lines` appends to the open batch's file, in one write.
    async fn append(
        &mut self,
        lines: impl FnOnce(&mut Vec<u8>) -> Result<(), SinkError>,
    ) -> Result<(), SinkError> {
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| SinkError::Task("records arrived outside a batch".to_owned()))?;
        open.lines.clear();
        lines(&mut open.lines)?;
        self.with_open(move |open| {
            open.file
                .write_all(&open.lines)
                .map_err(io("writing", &open.temp))
        })
        .await
    }

    /// Makes the batch's file durable under its final name.
    async fn finish(&mut self, batch: BatchId) -> Result<(), SinkError> {
        let path = self.batch_path(batch);
        let dir = self.dir.clone();
        self.with_open(move |open| {
            if open.batch != batch {
                return Err(SinkError::Task(format!(
                    "batch {batch} ends, but batch {} was begun",
                    open.batch
                )));
            }
            open.file.sync_all().map_err(io("writing", &open.temp))?;
            fs::rename(&open.temp, &path).map_err(io("renaming into place", &path))?;
            File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(io("syncing", &dir))
        })
        .await?;
        self.open = None;
        Ok(())
    }
}

impl Sink for JsonlSink {
    type Error = SinkError;

    fn is_transient(error: &SinkError) -> bool {
        error.is_transient()
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), SinkError> {
        self.begin(batch, ranges).await
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), SinkError> {
        self.finish(batch).await
    }
}

impl Writes for JsonlSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), SinkError> {
        self.append(|lines| {
            for record in records {
                write_record_json(lines, record);
                lines.push(b'\n');
            }
            Ok(())
        })
        .await
    }
}

impl Writes<RecordBatch> for JsonlSink {
    async fn write(&mut self, rows: &RecordBatch) -> Result<(), SinkError> {
        self.append(|lines| write_rows_json(lines, rows).map_err(SinkError::Rows))
            .await
    }
}

impl Drop for JsonlSink {
    fn drop(&mut self) {
        // A batch cut short is replayed on the next start; its partial file goes.
        if let Some(open) = self.open.take() {
            let _ = fs::remove_file(&open.temp);
        }
    }
}
