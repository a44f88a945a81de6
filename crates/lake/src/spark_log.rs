//! Spark's file-sink log: `_spark_metadata/` under the table, one file per
//! batch listing the files it added, so that a reader lists the table's files
//! from the log instead of the directory and never sees a file of a batch that
//! was not committed.
//!
//! The format is Spark's `FileStreamSinkLog`: a file named by the batch id,
//! holding a version line, `v1`, and then one JSON object per added file (its
//! `SinkFileStatus`: `path` as a URI, `size`, `isDir`, `modificationTime`,
//! `blockReplication`, `blockSize`, `action`). Every tenth batch (ids 9, 19,
//! ...) is written as `<id>.compact` instead, holding the entries of every
//! batch up to it, so that a reader opens one compact file and the batches
//! after it. A log file is written once and never replaced: it is created
//! under a temporary name and linked to its own, which fails when it exists.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::LakeError;

/// Spark's `spark.sql.streaming.fileSink.log.compactInterval` default.
const COMPACT_INTERVAL: u64 = 10;

/// The only version of the log's format.
const VERSION: &str = "v1";

/// The block size Spark's local file system reports, which its entries carry.
const BLOCK_SIZE: u64 = 32 * 1024 * 1024;

/// One file a batch added, as the log lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkFile {
    /// The file's URI, `file:///...`.
    pub path: String,
    /// Its length in bytes.
    pub size: u64,
    /// When it was last modified, in milliseconds since the epoch.
    pub modification_time_ms: i64,
}

impl SinkFile {
    /// The entry for the file at `path` (absolute), from its metadata.
    pub fn of(path: &Path) -> Result<SinkFile, LakeError> {
        let meta = fs::metadata(path).map_err(LakeError::io("reading the metadata of", path))?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as i64);
        Ok(SinkFile {
            path: file_uri(path),
            size: meta.len(),
            modification_time_ms: modified,
        })
    }

    fn to_json(&self) -> Value {
        json!({
            "path": self.path,
            "size": self.size,
            "isDir": false,
            "modificationTime": self.modification_time_ms,
            "blockReplication": 1,
            "blockSize": BLOCK_SIZE,
            "action": "add",
        })
    }
}

/// The `file://` URI of an absolute path, each byte that a URI's path may not
/// hold as it is written `%XX`: a Hive partition value's own escapes (`%3A`)
/// become `%253A`, which a reader decodes back to the directory's name.
pub(crate) fn file_uri(path: &Path) -> String {
    let mut uri = String::from("file://");
    for b in path.to_string_lossy().bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~=+,;@!$&()".contains(&b) {
            uri.push(b as char);
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri
}

/// The file-sink log of one table directory.
#[derive(Clone, Debug)]
pub struct SparkFileLog {
    dir: PathBuf,
}

impl SparkFileLog {
    /// The log of the table at `table`.
    pub fn new(table: &Path) -> SparkFileLog {
        SparkFileLog {
            dir: table.join("_spark_metadata"),
        }
    }

    /// The log's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether batch `batch` is written as a compact file.
    pub fn is_compaction(batch: u64) -> bool {
        (batch + 1).is_multiple_of(COMPACT_INTERVAL)
    }

    fn path_of(&self, batch: u64) -> PathBuf {
        if SparkFileLog::is_compaction(batch) {
            self.dir.join(format!("{batch}.compact"))
        } else {
            self.dir.join(batch.to_string())
        }
    }

    /// The batches the log holds, in order; files of other names are not
    /// the log's (Spark lists only these).
    pub fn batches(&self) -> Result<Vec<u64>, LakeError> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(LakeError::io("listing", &self.dir)(e)),
        };
        let mut batches = Vec::new();
        for entry in entries {
            let entry = entry.map_err(LakeError::io("listing", &self.dir))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let id = name.strip_suffix(".compact").unwrap_or(&name);
            if let Ok(batch) = id.parse::<u64>() {
                batches.push(batch);
            }
        }
        batches.sort_unstable();
        Ok(batches)
    }

    /// Whether the log lists batch `batch`.
    pub fn has(&self, batch: u64) -> bool {
        self.path_of(batch).exists()
    }

    /// The files of every batch up to `batch`, as a reader of the table would
    /// list them after it: the last compact file at or before it and every
    /// batch after that.
    pub fn files_through(&self, batch: u64) -> Result<Vec<SinkFile>, LakeError> {
        let compact = (0..=batch)
            .rev()
            .find(|b| SparkFileLog::is_compaction(*b) && self.has(*b));
        let first = compact.map_or(0, |c| c + 1);
        let mut files = match compact {
            Some(c) => self.read(c)?,
            None => Vec::new(),
        };
        for b in first..=batch {
            files.extend(self.read(b)?);
        }
        Ok(files)
    }

    /// Every file the log lists.
    pub fn files(&self) -> Result<Vec<SinkFile>, LakeError> {
        match self.batches()?.last() {
            Some(last) => self.files_through(*last),
            None => Ok(Vec::new()),
        }
    }

    fn read(&self, batch: u64) -> Result<Vec<SinkFile>, LakeError> {
        let path = self.path_of(batch);
        let text = fs::read_to_string(&path).map_err(LakeError::io("reading", &path))?;
        let bad = |reason: String| LakeError::Log {
            path: path.clone(),
            reason,
        };
        let mut lines = text.lines();
        match lines.next() {
            Some(VERSION) => {}
            other => {
                return Err(bad(format!(
                    "the first line is {other:?}, not \"{VERSION}\""
                )));
            }
        }
        let mut files: Vec<SinkFile> = Vec::new();
        for (n, line) in lines.enumerate() {
            let entry: Value =
                serde_json::from_str(line).map_err(|e| bad(format!("line {}: {e}", n + 2)))?;
            let field = |name: &str| {
                entry
                    .get(name)
                    .ok_or_else(|| bad(format!("line {}: no `{name}`", n + 2)))
            };
            let file = SinkFile {
                path: field("path")?.as_str().unwrap_or_default().to_owned(),
                size: field("size")?.as_u64().unwrap_or_default(),
                modification_time_ms: field("modificationTime")?.as_i64().unwrap_or_default(),
            };
            match field("action")?.as_str() {
                Some("add") => files.push(file),
                Some("delete") => files.retain(|f| f.path != file.path),
                other => return Err(bad(format!("line {}: action {other:?}", n + 2))),
            }
        }
        Ok(files)
    }

    /// Writes batch `batch`'s entry listing `files`, durably, or, for every
    /// tenth batch, the compact file of every batch up to it. Fails when the
    /// batch is already listed: an entry is never replaced.
    pub fn add(&self, batch: u64, files: &[SinkFile]) -> Result<(), LakeError> {
        fs::create_dir_all(&self.dir).map_err(LakeError::io("creating", &self.dir))?;
        let mut entries = if SparkFileLog::is_compaction(batch) && batch > 0 {
            self.files_through(batch - 1)?
        } else {
            Vec::new()
        };
        entries.extend_from_slice(files);
        let mut text = String::from(VERSION);
        for entry in &entries {
            text.push('\n');
            text.push_str(&entry.to_json().to_string());
        }
        let path = self.path_of(batch);
        let temp = self
            .dir
            .join(format!(".{batch}.{}.tmp", std::process::id()));
        let written = File::create(&temp)
            .and_then(|mut f| {
                f.write_all(text.as_bytes())?;
                f.sync_all()
            })
            .map_err(LakeError::io("writing", &temp));
        // Linked, not renamed: a link fails when the batch's entry exists.
        let linked = written.and_then(|()| {
            fs::hard_link(&temp, &path).map_err(LakeError::io("adding the log entry", &path))
        });
        let _ = fs::remove_file(&temp);
        linked?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(LakeError::io("syncing", &self.dir))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(n: u64) -> SinkFile {
        SinkFile {
            path: format!("file:///t/part-{n}.parquet"),
            size: n,
            modification_time_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn every_tenth_batch_compacts_the_entries_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let log = SparkFileLog::new(dir.path());
        for batch in 0..12 {
            log.add(batch, &[file(batch)]).unwrap();
        }
        let names: Vec<String> = {
            let mut n: Vec<String> = fs::read_dir(log.dir())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        assert!(names.contains(&"9.compact".to_owned()) && !names.contains(&"9".to_owned()));
        assert!(names.contains(&"10".to_owned()) && names.contains(&"11".to_owned()));
        let compact = fs::read_to_string(log.dir().join("9.compact")).unwrap();
        assert_eq!(compact.lines().count(), 11, "v1 and ten entries");
        assert!(compact.starts_with("v1\n{"));
        assert_eq!(log.files().unwrap(), (0..12).map(file).collect::<Vec<_>>());
        assert_eq!(log.batches().unwrap(), (0..12).collect::<Vec<_>>());
        assert_eq!(log.files_through(4).unwrap().len(), 5);
    }

    #[test]
    fn an_entry_is_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let log = SparkFileLog::new(dir.path());
        log.add(0, &[file(0)]).unwrap();
        assert!(log.add(0, &[file(7)]).is_err());
        assert_eq!(log.files().unwrap(), vec![file(0)]);
        // Nothing left beside the entries.
        assert_eq!(fs::read_dir(log.dir()).unwrap().count(), 1);
    }

    #[test]
    fn an_entry_holds_what_spark_reads() {
        let dir = tempfile::tempdir().unwrap();
        let log = SparkFileLog::new(dir.path());
        log.add(0, &[file(3)]).unwrap();
        let text = fs::read_to_string(log.dir().join("0")).unwrap();
        let entry: Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
        assert_eq!(
            entry,
            json!({"path": "file:///t/part-3.parquet", "size": 3, "isDir": false,
                   "modificationTime": 1_700_000_000_000_i64, "blockReplication": 1,
                   "blockSize": 33_554_432, "action": "add"})
        );
    }

    #[test]
    fn a_damaged_entry_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let log = SparkFileLog::new(dir.path());
        fs::create_dir_all(log.dir()).unwrap();
        fs::write(log.dir().join("0"), "v2\n").unwrap();
        let e = log.files().unwrap_err().to_string();
        assert!(
            e.contains("_spark_metadata/0") && e.contains("\"v2\""),
            "{e}"
        );
        fs::write(log.dir().join("0"), "v1\n{\"path\": 1").unwrap();
        let e = log.files().unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn uris_escape_what_a_path_may_not_hold() {
        assert_eq!(
            file_uri(Path::new("/t/day=2026-12-07/c=a%3Ab c/part-0.parquet")),
            "file:///t/day=2026-12-07/c=a%253Ab%20c/part-0.parquet"
        );
    }
}
