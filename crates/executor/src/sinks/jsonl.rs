//! `jsonl`: one file of JSON lines per batch, named by the batch id.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use sluice_offsets::{BatchId, ReadBatch, Sink};

use super::{SinkError, record_json};

/// Writes each batch to `<dir>/batch-<id, 20 digits>.jsonl`, one record per line in
/// plan order, atomically: a temporary file, fsync, rename, fsync of the
/// directory. A replayed batch has the same id and records, so it replaces its
/// file with identical content: the directory holds every record exactly once.
#[derive(Debug, Clone)]
pub struct JsonlSink {
    dir: PathBuf,
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
        Ok(JsonlSink { dir })
    }

    /// The file a batch is written to.
    pub fn batch_path(&self, batch: BatchId) -> PathBuf {
        self.dir.join(format!("batch-{:020}.jsonl", batch.0))
    }
}

impl Sink for JsonlSink {
    type Error = SinkError;

    async fn write_batch(&mut self, batch: BatchId, records: &ReadBatch) -> Result<(), SinkError> {
        let mut content = Vec::new();
        for partition in &records.partitions {
            for record in &partition.records {
                content.extend_from_slice(record_json(record).to_string().as_bytes());
                content.push(b'\n');
            }
        }
        let path = self.batch_path(batch);
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_atomically(&dir, &path, &content))
            .await
            .map_err(|e| SinkError::Task(e.to_string()))?
    }
}

fn write_atomically(dir: &Path, path: &Path, content: &[u8]) -> Result<(), SinkError> {
    let io = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| SinkError::Io {
            action,
            path,
            source,
        }
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}.tmp", uuid::Uuid::new_v4()));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp)
        .map_err(io("creating", &temp))?;
    file.write_all(content)
        .and_then(|()| file.sync_all())
        .map_err(io("writing", &temp))?;
    fs::rename(&temp, path).map_err(io("renaming into place", path))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}
