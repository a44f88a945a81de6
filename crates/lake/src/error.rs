//! What can go wrong landing rows in a table.

use std::path::PathBuf;

/// An error of a table sink, with the path or column it concerns.
#[derive(Debug, thiserror::Error)]
pub enum LakeError {
    /// A file or directory could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// Parquet could not encode the rows.
    #[error("writing Parquet file {path}: {source}")]
    Parquet {
        /// The file being written.
        path: PathBuf,
        /// The encoder's error.
        source: parquet::errors::ParquetError,
    },
    /// The rows could not be split by their partition columns.
    #[error("partitioning rows by {column}: {reason}")]
    Partition {
        /// The partition column.
        column: String,
        /// Why.
        reason: String,
    },
    /// The sink's options do not fit the query's output.
    #[error("{0}")]
    Options(String),
    /// The directory holds another writer's output.
    #[error(
        "{path} holds the output of another writer ({found}), not of this query ({ours}); \
         give the sink a directory of its own"
    )]
    Foreign {
        /// The sink's directory.
        path: PathBuf,
        /// Who wrote it.
        found: String,
        /// This query's id.
        ours: String,
    },
    /// Spark's file-sink log holds something it should not.
    #[error("Spark's file-sink log {path}: {reason}")]
    Log {
        /// The log file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Delta Lake could not read or write the table.
    #[error("Delta table {path}: {source}")]
    Delta {
        /// The table's directory.
        path: PathBuf,
        /// Delta's error.
        source: Box<deltalake::DeltaTableError>,
    },
    /// The table's schema does not take the query's output.
    #[error("the Delta table {path} does not take the query's rows: {}", reasons.join("; "))]
    Schema {
        /// The table's directory.
        path: PathBuf,
        /// Each column that does not fit, and how.
        reasons: Vec<String>,
    },
    /// A blocking task did not complete.
    #[error("a file task failed: {0}")]
    Task(String),
}

impl LakeError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> LakeError {
        let path = path.into();
        move |source| LakeError::Io {
            action,
            path,
            source,
        }
    }

    /// Whether writing the batch again may succeed: a file system error may be
    /// passing (a full disk freed); a foreign directory or bad options are not.
    pub fn is_transient(&self) -> bool {
        matches!(self, LakeError::Io { .. } | LakeError::Task(_))
    }
}
