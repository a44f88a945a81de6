//! Everything that can go wrong with a checkpoint directory, with the path it
//! concerns.

use std::io;
use std::path::PathBuf;

use sluice_core::PlanError;

/// An error of the filesystem checkpoint, naming the file or directory concerned.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A filesystem operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. `reading`.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// Another runner holds the checkpoint.
    #[error(
        "checkpoint {} is in use by another runner ({holder}); two runners must never write one \
         checkpoint: stop the other one, or give this query its own checkpoint",
        dir.display()
    )]
    Locked {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Who holds it, as the lock file says (pid, host, since when).
        holder: String,
    },
    /// A file's content is not what the format requires.
    #[error("damaged checkpoint file {}: {problem}", path.display())]
    Damaged {
        /// The damaged file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A batch file that would be overwritten.
    #[error(
        "{} already exists; a batch file is never overwritten (is another runner writing this \
         checkpoint, or was it edited?)",
        path.display()
    )]
    AlreadyExists {
        /// The existing file.
        path: PathBuf,
    },
    /// The previous batch's file, needed to know where a batch starts, is gone.
    #[error(
        "cannot tell where batch {batch} starts: {} holds only its end offsets and {} is missing",
        plan.display(), previous.display()
    )]
    UnknownStart {
        /// The batch.
        batch: u64,
        /// Its plan file.
        plan: PathBuf,
        /// The file that would have told.
        previous: PathBuf,
    },
    /// A stored plan that does not form a valid batch plan.
    #[error("damaged checkpoint file {}: {source}", path.display())]
    InvalidPlan {
        /// The plan file.
        path: PathBuf,
        /// Why its offsets are not a plan.
        #[source]
        source: PlanError,
    },
    /// A commit for a batch that has no plan file.
    #[error(
        "refusing to write {}: its plan {} does not exist, and a commit without a plan would \
         make the checkpoint inconsistent",
        commit.display(), plan.display()
    )]
    CommitWithoutPlan {
        /// The commit file that was to be written.
        commit: PathBuf,
        /// The missing plan file.
        plan: PathBuf,
    },
    /// The blocking filesystem task did not finish.
    #[error("checkpoint I/O task failed: {0}")]
    Task(String),
}

impl CheckpointError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| CheckpointError::Io {
            action,
            path,
            source,
        }
    }
}
