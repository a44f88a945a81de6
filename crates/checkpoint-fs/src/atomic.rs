//! Durable, atomic file creation that never replaces an existing file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use crate::CheckpointError;

/// Suffix of the temporary files written before a file is linked into place.
/// Spark's checkpoint file manager names its temporary files the same way
/// (`.<name>.<uuid>.tmp`), so leftovers of either are recognised.
pub const TEMP_SUFFIX: &str = ".tmp";

/// Creates `path` with `bytes`, all or nothing, and durably:
/// writes a temporary file in the same directory, fsyncs it, links it to `path`
/// (which fails if `path` exists, so nothing is ever overwritten), removes the
/// temporary name and fsyncs the directory.
pub fn create_file(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}{TEMP_SUFFIX}", uuid::Uuid::new_v4()));

    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(CheckpointError::io("writing", &temp)(e));
    }

    let linked = fs::hard_link(&temp, path);
    let _ = fs::remove_file(&temp);
    match linked {
        Ok(()) => sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(CheckpointError::AlreadyExists {
            path: path.to_owned(),
        }),
        Err(e) => Err(CheckpointError::io("linking into place", path)(e)),
    }
}

/// Makes the directory's entries (created, linked or removed files) durable.
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io("syncing directory", dir))
}

/// Whether a file name is a temporary file of an interrupted write.
pub fn is_temp_name(name: &str) -> bool {
    name.starts_with('.') && name.ends_with(TEMP_SUFFIX)
}
