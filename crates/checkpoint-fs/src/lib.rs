//! The filesystem offset store of Sluice: an offsets log, a commit log and the
//! query metadata in a checkpoint directory laid out as Spark Structured Streaming
//! lays it out, written durably and atomically.
//!
//! ```text
//! <checkpoint>/
//!   metadata          {"id":"<query id>"}
//!   offsets/<batch>   v1 / metadata JSON / Kafka offset JSON (the plan, written first)
//!   commits/<batch>   v1 / {"nextBatchWatermarkMs":0}       (written after the sink)
//!   sources/<i>/0     0x00 v1 / initial Kafka offsets of source i
//!   state/<op>/<p>/<batch>.delta     a stateful operator's changes in a batch, per partition
//!   state/<op>/<p>/<batch>.snapshot  and all of its state, every few batches
//!   sluice.lock       held with flock while a runner has the checkpoint open
//! ```
//!
//! A checkpoint Spark's Kafka source wrote can be opened here, and Spark can read
//! the offsets and commits Sluice writes. See `docs/checkpoint-format.md`.

mod atomic;
mod error;
pub mod format;
mod lock;
mod state;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use sluice_core::{
    BatchCommit, BatchId, BatchPlan, Log, Offset, OffsetStore, PartitionOffsets, StateFileId,
    StoredBatches,
};
use state::{list_state_files, state_file_path};

pub use atomic::TEMP_SUFFIX;
pub use error::CheckpointError;
pub use lock::LOCK_FILE;

/// An open checkpoint directory, held exclusively until dropped.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    id: String,
    // Held for its flock: dropping it releases the checkpoint.
    _lock: File,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`, creating it when it does not exist, and takes
    /// its lock. Leftover temporary files of interrupted writes are removed; nothing
    /// else is changed. Blocking: call it before starting async work, or from a
    /// blocking task.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Checkpoint, CheckpointError> {
        Checkpoint::open_with_id(dir, None)
    }

    /// Like [`Checkpoint::open`], giving a new checkpoint the query id `id` (as
    /// when a query is migrated here). An existing checkpoint keeps its own id.
    pub fn open_with_id(
        dir: impl Into<PathBuf>,
        id: Option<&str>,
    ) -> Result<Checkpoint, CheckpointError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(CheckpointError::io("creating", &dir))?;
        let lock = lock::acquire(&dir)?;

        let metadata = dir.join("metadata");
        let id = match fs::read(&metadata) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|e| CheckpointError::Damaged {
                    path: metadata.clone(),
                    problem: format!("not UTF-8 text: {e}"),
                })?;
                format::parse_metadata(&text).map_err(|problem| CheckpointError::Damaged {
                    path: metadata.clone(),
                    problem,
                })?
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let id = id.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
                atomic::create_file(&metadata, format::write_metadata(&id).as_bytes())?;
                id
            }
            Err(e) => return Err(CheckpointError::io("reading", &metadata)(e)),
        };

        let checkpoint = Checkpoint {
            dir,
            id,
            _lock: lock,
        };
        for sub in [
            checkpoint.offsets_dir(),
            checkpoint.commits_dir(),
            checkpoint.sources_dir(),
        ] {
            fs::create_dir_all(&sub).map_err(CheckpointError::io("creating", &sub))?;
        }
        for sub in [
            checkpoint.dir.clone(),
            checkpoint.offsets_dir(),
            checkpoint.commits_dir(),
        ] {
            remove_temp_files(&sub)?;
        }
        for source in list_dir_names(&checkpoint.dir.join("sources"))? {
            let sub = checkpoint.dir.join("sources").join(source);
            if sub.is_dir() {
                remove_temp_files(&sub)?;
            }
        }
        for operator in list_dir_names(&checkpoint.dir.join("state"))? {
            let operator = checkpoint.dir.join("state").join(operator);
            if !operator.is_dir() {
                continue;
            }
            for partition in list_dir_names(&operator)? {
                let sub = operator.join(partition);
                if sub.is_dir() {
                    remove_temp_files(&sub)?;
                }
            }
        }
        Ok(checkpoint)
    }

    /// Reads a checkpoint without taking its lock or changing anything, so that it
    /// can be inspected while a runner holds it. Every file is written atomically,
    /// so what is read is always whole. Returns the query id and the stored batches.
    pub fn inspect(dir: impl AsRef<Path>) -> Result<(String, StoredBatches), CheckpointError> {
        let dir = dir.as_ref();
        let metadata = dir.join("metadata");
        let bytes = read_if_exists(&metadata)?.ok_or_else(|| {
            damaged(
                &metadata,
                "missing: this directory is not a checkpoint (no metadata file)".to_owned(),
            )
        })?;
        let id = format::parse_metadata(&utf8(&metadata, bytes)?)
            .map_err(|problem| damaged(&metadata, problem))?;
        let paths = Paths {
            offsets: dir.join("offsets"),
            commits: dir.join("commits"),
            sources: dir.join("sources"),
        };
        let stored = paths.load()?;
        Ok((id, stored))
    }

    /// The state files of `operator` in the checkpoint in `dir`, with their sizes
    /// in bytes, read without taking the lock.
    pub fn inspect_state(
        dir: impl AsRef<Path>,
        operator: u32,
    ) -> Result<Vec<(StateFileId, u64)>, CheckpointError> {
        let dir = dir.as_ref();
        list_state_files(dir, operator)?
            .into_iter()
            .map(|file| {
                let path = state_file_path(dir, operator, file);
                let size = fs::metadata(&path)
                    .map_err(CheckpointError::io("reading", &path))?
                    .len();
                Ok((file, size))
            })
            .collect()
    }

    /// The query id from the `metadata` file.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The plan file of a batch: `offsets/<batch>`.
    pub fn plan_path(&self, batch: BatchId) -> PathBuf {
        self.offsets_dir().join(batch.to_string())
    }

    /// The commit file of a batch: `commits/<batch>`.
    pub fn commit_path(&self, batch: BatchId) -> PathBuf {
        self.commits_dir().join(batch.to_string())
    }

    /// Where an operator's state file is:
    /// `state/<operator>/<partition>/<batch>.<kind>`, as Spark lays out its state
    /// store.
    pub fn state_path(&self, operator: u32, file: StateFileId) -> PathBuf {
        state_file_path(&self.dir, operator, file)
    }

    fn offsets_dir(&self) -> PathBuf {
        self.dir.join("offsets")
    }

    fn commits_dir(&self) -> PathBuf {
        self.dir.join("commits")
    }

    fn sources_dir(&self) -> PathBuf {
        self.dir.join("sources").join("0")
    }

    /// A handle for blocking work on another thread: paths only, no lock.
    fn paths(&self) -> Paths {
        Paths {
            offsets: self.offsets_dir(),
            commits: self.commits_dir(),
            sources: self.dir.join("sources"),
        }
    }
}

/// The paths blocking tasks work on.
struct Paths {
    offsets: PathBuf,
    commits: PathBuf,
    /// `sources`, with a directory per source holding its initial offsets.
    sources: PathBuf,
}

impl Paths {
    fn load(&self) -> Result<StoredBatches, CheckpointError> {
        let planned = list_batches(&self.offsets)?;
        let committed = list_batches(&self.commits)?;
        let initial_offsets = self.read_initial_offsets()?;
        let latest_plan = match planned.last() {
            Some(&batch) => Some(self.read_plan(batch, initial_offsets.as_ref())?),
            None => None,
        };
        let latest_commit = match committed.last() {
            Some(&batch) => Some(self.read_commit(batch)?),
            None => None,
        };
        Ok(StoredBatches {
            planned,
            committed,
            latest_plan,
            latest_commit,
            initial_offsets,
        })
    }

    /// Source `index`'s initial offsets file, as Spark names it.
    fn initial(&self, index: usize) -> PathBuf {
        self.sources.join(index.to_string()).join("0")
    }

    /// The initial offsets of every source, merged (each reads topics of
    /// its own): `sources/0/0`, `sources/1/0`, ... up to the first missing.
    fn read_initial_offsets(&self) -> Result<Option<PartitionOffsets>, CheckpointError> {
        let mut merged: Option<PartitionOffsets> = None;
        for index in 0.. {
            let path = self.initial(index);
            let Some(bytes) = read_if_exists(&path)? else {
                break;
            };
            let offsets =
                format::parse_initial_offsets(&bytes).map_err(|problem| damaged(&path, problem))?;
            merged.get_or_insert_default().extend(offsets);
        }
        Ok(merged)
    }

    fn read_offsets_file(
        &self,
        batch: BatchId,
    ) -> Result<Option<format::OffsetsFile>, CheckpointError> {
        let path = self.offsets.join(batch.to_string());
        let Some(bytes) = read_if_exists(&path)? else {
            return Ok(None);
        };
        let text = utf8(&path, bytes)?;
        format::parse_offsets(&text)
            .map(Some)
            .map_err(|problem| damaged(&path, problem))
    }

    fn read_plan(
        &self,
        batch: BatchId,
        initial: Option<&PartitionOffsets>,
    ) -> Result<BatchPlan, CheckpointError> {
        let path = self.offsets.join(batch.to_string());
        let file = self
            .read_offsets_file(batch)?
            .ok_or_else(|| damaged(&path, "the file disappeared while reading".to_owned()))?;
        let start = match file.start {
            Some(start) => start,
            // Spark records only end offsets: the start is the previous batch's end,
            // or the initial offsets for batch 0.
            None => {
                let (previous_path, previous_end) = match batch.previous() {
                    None => (self.initial(0), initial.cloned()),
                    Some(previous) => (
                        self.offsets.join(previous.to_string()),
                        self.read_offsets_file(previous)?
                            .map(|f| f.ends.into_iter().flatten().collect()),
                    ),
                };
                let previous_end = previous_end.ok_or_else(|| CheckpointError::UnknownStart {
                    batch: batch.0,
                    plan: path.clone(),
                    previous: previous_path,
                })?;
                // Partitions the previous batch did not know started at their
                // beginning, as Spark starts new partitions.
                file.ends
                    .iter()
                    .flat_map(|line| line.keys())
                    .map(|tp| {
                        let from = previous_end
                            .get(tp)
                            .or_else(|| initial.and_then(|i| i.get(tp)))
                            .copied()
                            .unwrap_or(Offset::ZERO);
                        (tp.clone(), from)
                    })
                    .collect()
            }
        };
        BatchPlan::from_lines(batch, &start, &file.ends, file.metadata)
            .map_err(|source| CheckpointError::InvalidPlan { path, source })
    }

    fn read_commit(&self, batch: BatchId) -> Result<BatchCommit, CheckpointError> {
        let path = self.commits.join(batch.to_string());
        let bytes = read_if_exists(&path)?
            .ok_or_else(|| damaged(&path, "the file disappeared while reading".to_owned()))?;
        let text = utf8(&path, bytes)?;
        let next_watermark_ms =
            format::parse_commit(&text).map_err(|problem| damaged(&path, problem))?;
        Ok(BatchCommit {
            id: batch,
            next_watermark_ms,
        })
    }

    fn write_plan(&self, plan: &BatchPlan) -> Result<(), CheckpointError> {
        let start = plan.start_offsets();
        if plan.id() == BatchId::FIRST {
            for (index, offsets) in plan.start_offsets_by_source().iter().enumerate() {
                let initial = self.initial(index);
                if !exists(&initial)? {
                    let dir = self.sources.join(index.to_string());
                    fs::create_dir_all(&dir).map_err(CheckpointError::io("creating", &dir))?;
                    atomic::create_file(&initial, &format::write_initial_offsets(offsets))?;
                }
            }
        }
        let text = format::write_offsets(plan.metadata(), &start, &plan.end_offsets_by_source());
        atomic::create_file(&self.offsets.join(plan.id().to_string()), text.as_bytes())
    }

    fn write_commit(&self, commit: &BatchCommit) -> Result<(), CheckpointError> {
        let path = self.commits.join(commit.id.to_string());
        let plan = self.offsets.join(commit.id.to_string());
        if !exists(&plan)? {
            return Err(CheckpointError::CommitWithoutPlan { commit: path, plan });
        }
        atomic::create_file(
            &path,
            format::write_commit(commit.next_watermark_ms).as_bytes(),
        )
    }

    /// Removes old batch files. The directories are not fsynced afterwards: a
    /// removal lost in a crash only brings back an old, contiguous batch file,
    /// which recovery accepts and the next purge removes again.
    fn purge(&self, keep_from: BatchId) -> Result<(), CheckpointError> {
        for dir in [&self.offsets, &self.commits] {
            for batch in list_batches(dir)?
                .into_iter()
                .take_while(|b| *b < keep_from)
            {
                let path = dir.join(batch.to_string());
                fs::remove_file(&path).map_err(CheckpointError::io("removing", &path))?;
                // Spark's Hadoop filesystem leaves a checksum beside each file.
                let _ = fs::remove_file(dir.join(format!(".{batch}.crc")));
            }
        }
        Ok(())
    }
}

impl OffsetStore for Checkpoint {
    type Error = CheckpointError;

    async fn load(&mut self) -> Result<StoredBatches, CheckpointError> {
        let paths = self.paths();
        blocking(move || paths.load()).await
    }

    async fn write_plan(&mut self, plan: &BatchPlan) -> Result<(), CheckpointError> {
        let paths = self.paths();
        let plan = plan.clone();
        blocking(move || paths.write_plan(&plan)).await
    }

    async fn write_commit(&mut self, commit: &BatchCommit) -> Result<(), CheckpointError> {
        let paths = self.paths();
        let commit = commit.clone();
        blocking(move || paths.write_commit(&commit)).await
    }

    async fn purge(&mut self, keep_from: BatchId) -> Result<(), CheckpointError> {
        let paths = self.paths();
        blocking(move || paths.purge(keep_from)).await
    }

    fn describe(&self, log: Log, batch: BatchId) -> String {
        let path = match log {
            Log::Plans => self.plan_path(batch),
            Log::Commits => self.commit_path(batch),
        };
        path.display().to_string()
    }
}

/// Runs filesystem work (reads, fsyncs) on tokio's blocking pool, off the async
/// worker threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, CheckpointError> + Send + 'static,
) -> Result<T, CheckpointError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
}

/// The batch ids of the files in a log directory, ascending. Hidden files (Spark's
/// `.crc` checksums, temporary files) are not batches; other names are ignored
/// with a warning, as Spark ignores them.
fn list_batches(dir: &Path) -> Result<Vec<BatchId>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        // A checkpoint that Spark created but never planned in has no log yet.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io("listing", dir)(e)),
    };
    let mut batches = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io("listing", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        match name.parse::<u64>() {
            Ok(id) if id.to_string() == name => {
                batches.insert(id, ());
            }
            _ => tracing::warn!(
                path = %entry.path().display(),
                "ignoring a file that is not named by a batch id"
            ),
        }
    }
    Ok(batches.into_keys().map(BatchId).collect())
}

/// The names in a directory; none when it does not exist.
fn list_dir_names(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    match fs::read_dir(dir) {
        Ok(entries) => entries
            .map(|e| {
                e.map(|e| e.file_name().to_string_lossy().into_owned())
                    .map_err(CheckpointError::io("listing", dir))
            })
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(CheckpointError::io("listing", dir)(e)),
    }
}

fn remove_temp_files(dir: &Path) -> Result<(), CheckpointError> {
    let entries = fs::read_dir(dir).map_err(CheckpointError::io("listing", dir))?;
    let mut removed = false;
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io("listing", dir))?;
        if atomic::is_temp_name(&entry.file_name().to_string_lossy()) {
            let path = entry.path();
            tracing::info!(path = %path.display(), "removing a temporary file left by an interrupted write");
            fs::remove_file(&path).map_err(CheckpointError::io("removing", &path))?;
            removed = true;
        }
    }
    if removed {
        atomic::sync_dir(dir)?;
    }
    Ok(())
}

fn read_if_exists(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(CheckpointError::io("reading", path)(e)),
    }
}

fn exists(path: &Path) -> Result<bool, CheckpointError> {
    path.try_exists()
        .map_err(CheckpointError::io("checking", path))
}

fn utf8(path: &Path, bytes: Vec<u8>) -> Result<String, CheckpointError> {
    String::from_utf8(bytes).map_err(|e| damaged(path, format!("not UTF-8 text: {e}")))
}

fn damaged(path: &Path, problem: String) -> CheckpointError {
    CheckpointError::Damaged {
        path: path.to_owned(),
        problem,
    }
}
