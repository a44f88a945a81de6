//! Errors that stop a query, with what the runner needs to choose an exit code.

use sluice_offsets::{DataLoss, Inconsistency};

/// A boxed error of a source, store or sink.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a query stopped.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The source failed (Kafka unreachable, a read that stalled, data loss while reading).
    #[error("{0}")]
    Source(BoxError),
    /// The offset store failed (a damaged checkpoint, a second runner, I/O).
    #[error("{0}")]
    Store(BoxError),
    /// The sink failed.
    #[error("sink: {0}")]
    Sink(BoxError),
    /// The store's logs contradict each other.
    #[error("the offset store is inconsistent: {inconsistency}; look at {}", entries.join(" and "))]
    Inconsistent {
        /// What contradicts what.
        inconsistency: Inconsistency,
        /// Where the entries live (files, rows).
        entries: Vec<String>,
    },
    /// Offsets the next batch needs are gone and `fail_on_data_loss` is set.
    #[error("{}", sluice_offsets::data_loss_report(.0))]
    DataLoss(Vec<DataLoss>),
    /// A plan that could not be built from the offsets (a bug or a hand-edited store).
    #[error("cannot plan batch {batch}: {reason}")]
    Plan {
        /// The batch.
        batch: u64,
        /// Why.
        reason: String,
    },
}
