//! Errors of the SQL layer, each one line naming what was wrong.

/// Why a schema, a query or a chunk's processing failed.
#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    /// A schema in Spark's DDL form that does not parse.
    #[error("schema {schema:?}: {reason} (at character {})", position + 1)]
    Schema {
        /// The schema as given.
        schema: String,
        /// Where in it, from 0.
        position: usize,
        /// What is wrong there.
        reason: String,
    },
    /// An Avro schema that does not parse, or is not a record.
    #[error("source.schema is not a usable Avro schema: {reason}")]
    AvroSchema {
        /// What is wrong with it.
        reason: String,
    },
    /// An event-time column that cannot drive a watermark.
    #[error("source.event_time {column:?}: {reason}")]
    EventTime {
        /// The column as given.
        column: String,
        /// What is wrong with it.
        reason: String,
    },
    /// SQL that does not parse.
    #[error("SQL syntax error: {0}")]
    Syntax(String),
    /// SQL that parses but cannot be planned: an unknown column or table, a type
    /// error.
    #[error("{0}")]
    Plan(String),
    /// SQL that cannot run on an unbounded stream, or not yet.
    #[error("{what} cannot run on a stream: {why}; {instead}")]
    Refused {
        /// The construct, as the user wrote it.
        what: String,
        /// Why it cannot run.
        why: String,
        /// What to write instead.
        instead: String,
    },
    /// The query failed on a chunk's rows (a cast of a value that does not fit).
    #[error("the query failed on a batch's rows: {0}")]
    Execution(String),
    /// A stored state file that cannot be read back, or belongs to another query.
    #[error("state file {location}: {reason}")]
    State {
        /// Where it is stored.
        location: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An aggregation's state grew past `[query] max_state_rows`.
    #[error("{0}")]
    StateTooLarge(sluice_state::StateError),
    /// An aggregation's state and a batch's groups passed `[query]
    /// state_memory_mb`.
    #[error("{0}")]
    StateOverMemory(sluice_state::StateError),
    /// A lookup table whose rows cannot be read or used.
    #[error("lookup table {table:?}: {reason}")]
    Lookup {
        /// The table's name.
        table: String,
        /// What is wrong.
        reason: String,
    },
    /// Reading a lookup table's rows by key failed.
    #[error("reading the lookup table {table:?} by key failed: {reason}")]
    LookupRead {
        /// The table's name.
        table: String,
        /// What went wrong.
        reason: String,
        /// Whether trying again may succeed.
        transient: bool,
    },
    /// A fault of Sluice, not of the input.
    #[error("internal error in the SQL layer: {0}")]
    Internal(String),
}

impl SqlError {
    /// Whether the error may go away by itself (a lookup table's store
    /// timing out), so that the batch is worth trying again.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            SqlError::LookupRead {
                transient: true,
                ..
            }
        )
    }

    /// DataFusion's error as ours: one of ours that a plan's operator raised
    /// (a lookup that failed) as it was, anything else as a failure of the
    /// chunk's rows.
    pub(crate) fn from_execution(error: datafusion::error::DataFusionError) -> SqlError {
        use datafusion::error::DataFusionError;
        match error {
            DataFusionError::External(inner) => match inner.downcast::<SqlError>() {
                Ok(ours) => *ours,
                Err(other) => SqlError::Execution(crate::error::one_line(&other.to_string())),
            },
            DataFusionError::Context(_, inner) => SqlError::from_execution(*inner),
            DataFusionError::Shared(inner) => match std::sync::Arc::try_unwrap(inner) {
                Ok(inner) => SqlError::from_execution(inner),
                Err(shared) => SqlError::Execution(crate::error::one_line(&shared.to_string())),
            },
            other => SqlError::Execution(crate::error::one_line(&other.to_string())),
        }
    }
}

impl From<sluice_state::StateError> for SqlError {
    fn from(error: sluice_state::StateError) -> SqlError {
        use sluice_state::StateError;
        match error {
            // A row the aggregation cannot compute is like one the query cannot.
            StateError::Execution(reason) => SqlError::Execution(reason),
            StateError::Damaged { location, reason } => SqlError::State { location, reason },
            e @ StateError::TooLarge { .. } => SqlError::StateTooLarge(e),
            e @ StateError::OverMemory { .. } => SqlError::StateOverMemory(e),
            StateError::Internal(reason) => SqlError::Internal(reason),
        }
    }
}

/// A construct refused, why, and what to write instead.
pub(crate) fn refused(what: &str, why: &str, instead: &str) -> SqlError {
    SqlError::Refused {
        what: what.to_owned(),
        why: why.to_owned(),
        instead: instead.to_owned(),
    }
}

/// A message on one line: its lines joined.
pub(crate) fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
