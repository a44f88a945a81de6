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
    /// A fault of Sluice, not of the input.
    #[error("internal error in the state: {0}")]
    Internal(String),
}
