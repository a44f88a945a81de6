//! The state files of a query's stateful operators, under the checkpoint's
//! `state/<operator>/<partition>/<version>.<delta|snapshot>`, as Spark lays
//! out its state store's files.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use sluice_core::{BatchId, StateFile, StateFileId, StateFileKind, StateStore};

use crate::{Checkpoint, CheckpointError, atomic, blocking, exists, list_dir_names};

impl StateStore for Checkpoint {
    type Error = CheckpointError;

    async fn write_state(&mut self, file: &StateFile) -> Result<(), CheckpointError> {
        let path = self.state_path(file.operator, file.id());
        let bytes = file.bytes.clone();
        blocking(move || {
            let dir = path.parent().unwrap_or(Path::new("."));
            if !exists(dir)? {
                fs::create_dir_all(dir).map_err(CheckpointError::io("creating", dir))?;
                if let Some(parent) = dir.parent() {
                    atomic::sync_dir(parent)?;
                }
            }
            match atomic::create_file(&path, &bytes) {
                // The batch was replayed: its state, computed from the same version
                // before it, is stored already.
                Err(CheckpointError::AlreadyExists { .. }) => Ok(()),
                other => other,
            }
        })
        .await
    }

    async fn list_state(&mut self, operator: u32) -> Result<Vec<StateFileId>, CheckpointError> {
        let dir = self.dir.clone();
        blocking(move || list_state_files(&dir, operator)).await
    }

    async fn read_state(
        &mut self,
        operator: u32,
        file: StateFileId,
    ) -> Result<StateFile, CheckpointError> {
        let path = self.state_path(operator, file);
        blocking(move || {
            let bytes = fs::read(&path).map_err(CheckpointError::io("reading", &path))?;
            Ok(StateFile {
                operator,
                partition: file.partition,
                version: file.version,
                kind: file.kind,
                bytes,
                location: path.display().to_string(),
            })
        })
        .await
    }

    async fn remove_state(
        &mut self,
        operator: u32,
        files: &[StateFileId],
    ) -> Result<(), CheckpointError> {
        let paths: Vec<PathBuf> = files
            .iter()
            .map(|f| self.state_path(operator, *f))
            .collect();
        blocking(move || {
            for path in paths {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(CheckpointError::io("removing", &path)(e)),
                }
            }
            Ok(())
        })
        .await
    }

    fn describe_state(&self, operator: u32, file: StateFileId) -> String {
        self.state_path(operator, file).display().to_string()
    }
}

pub(crate) fn state_file_path(checkpoint: &Path, operator: u32, file: StateFileId) -> PathBuf {
    checkpoint
        .join("state")
        .join(operator.to_string())
        .join(file.partition.to_string())
        .join(format!("{}.{}", file.version, file.kind.extension()))
}

/// An operator's state files in every partition directory; leftover temporary
/// files and other names are not state.
pub(crate) fn list_state_files(
    checkpoint: &Path,
    operator: u32,
) -> Result<Vec<StateFileId>, CheckpointError> {
    let operator_dir = checkpoint.join("state").join(operator.to_string());
    let mut files = Vec::new();
    if !operator_dir.is_dir() {
        return Ok(files);
    }
    for name in list_dir_names(&operator_dir)? {
        let dir = operator_dir.join(&name);
        match name.parse::<u32>() {
            Ok(partition) if partition.to_string() == name && dir.is_dir() => {
                files.extend(
                    list_partition_files(&dir)?
                        .into_iter()
                        .map(|(version, kind)| StateFileId {
                            partition,
                            version,
                            kind,
                        }),
                );
            }
            _ => tracing::warn!(
                path = %dir.display(),
                "ignoring an entry that is not a state partition"
            ),
        }
    }
    files.sort_unstable();
    Ok(files)
}

/// The versions and kinds of the state files in one partition's directory.
fn list_partition_files(dir: &Path) -> Result<Vec<(BatchId, StateFileKind)>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io("listing", dir)(e)),
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(CheckpointError::io("listing", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let parsed = name.split_once('.').and_then(|(version, extension)| {
            let kind = StateFileKind::from_extension(extension)?;
            let id: u64 = version.parse().ok()?;
            (id.to_string() == version).then_some((BatchId(id), kind))
        });
        match parsed {
            Some(file) => files.push(file),
            None => tracing::warn!(
                path = %entry.path().display(),
                "ignoring a file that is not a state delta or snapshot"
            ),
        }
    }
    files.sort_unstable();
    Ok(files)
}
