//! Errors of the state, each one line naming what was wrong.

/// Why keeping, writing or reading state failed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// An expression of the aggregation failed on a batch's rows.
    #[error("the aggregation failed on a batch's rows: {0}")]
    Execution(String),
    /// A stored state file that cannot be read back, or belongs to another query.
    #[error("state file {location}: {reason}")]
    Damaged {
        /// Where it is stored.
        location: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The state grew past its limit.
    #[error(
        "the aggregation's state holds {rows} groups, more than query.max_state_rows = {limit}: \
         groups that never close (no window, or no watermark) or keys without end grow it; raise \
         the limit if memory allows, or add a window and a watermark"
    )]
    TooLarge {
        /// The groups it would hold.
        rows: u64,
        /// The limit.
        limit: u64,
    },
    /// The state and the batch's own groups passed the memory budget.
    #[error(
        "the aggregation's state and the batch's groups hold {} MiB, more than query.state_memory_mb \
         = {}: batches are planned to a sixteenth of it from what the batches before measured, and this \
         one (or the state alone) grew past all of it; raise state_memory_mb if the machine has \
         the memory, or lower max_offsets_per_trigger, or close windows sooner (a shorter window \
         or watermark delay)",
        bytes >> 20,
        limit >> 20
    )]
    OverMemory {
        /// The bytes they held.
        bytes: u64,
        /// The budget, in bytes.
        limit: u64,
    },
    /// A fault of Sluice, not of the input.
    #[error("internal error in the state: {0}")]
    Internal(String),
}

pub(crate) fn internal(context: &str, e: impl std::fmt::Display) -> StateError {
    StateError::Internal(format!("{context}: {e}"))
}

pub(crate) fn execution(e: impl std::fmt::Display) -> StateError {
    StateError::Execution(one_line(&e.to_string()))
}

/// A message on one line: its lines joined.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
