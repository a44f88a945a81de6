//! Errors as exit codes: which failures are the user's to fix, and which are not.

use sluice_cassandra_store::CassandraStoreError;
use sluice_checkpoint_fs::CheckpointError;
use sluice_executor::ExecutorError;
use sluice_kafka_source::KafkaSourceError;

/// An error with the exit code it ends the process with.
pub struct Exit {
    /// The process's exit code.
    pub code: u8,
    /// What went wrong.
    pub error: anyhow::Error,
}

impl Exit {
    /// A runtime failure: 1.
    pub fn runtime(error: anyhow::Error) -> Exit {
        Exit { code: 1, error }
    }

    /// Bad configuration or command line: 2.
    pub fn config(error: anyhow::Error) -> Exit {
        Exit { code: 2, error }
    }

    /// Data loss with `fail_on_data_loss`: 3.
    pub fn data_loss(error: anyhow::Error) -> Exit {
        Exit { code: 3, error }
    }

    /// A store whose state forbids the operation (a pending batch, inconsistent logs): 4.
    pub fn checkpoint_state(error: anyhow::Error) -> Exit {
        Exit { code: 4, error }
    }

    /// A checkpoint problem: 4 when it is held, damaged or inconsistent, 1 for I/O.
    pub fn checkpoint(error: CheckpointError) -> Exit {
        let code = match error {
            CheckpointError::Io { .. } | CheckpointError::Task(_) => 1,
            _ => 4,
        };
        Exit {
            code,
            error: error.into(),
        }
    }

    /// A Cassandra store problem: 2 for configuration, 4 when fenced or damaged,
    /// 1 when Cassandra cannot be reached.
    pub fn cassandra(error: CassandraStoreError) -> Exit {
        let code = match error {
            CassandraStoreError::Location { .. }
            | CassandraStoreError::MissingKeyspace { .. }
            | CassandraStoreError::MissingTable { .. } => 2,
            CassandraStoreError::Fenced { .. }
            | CassandraStoreError::AlreadyExists { .. }
            | CassandraStoreError::CommitWithoutPlan { .. }
            | CassandraStoreError::Damaged { .. } => 4,
            CassandraStoreError::Connect { .. } | CassandraStoreError::Query { .. } => 1,
        };
        Exit {
            code,
            error: error.into(),
        }
    }

    /// Why the executor stopped.
    pub fn executor(error: ExecutorError) -> Exit {
        match error {
            ExecutorError::DataLoss(_) => Exit::data_loss(error.into()),
            ExecutorError::Inconsistent { .. } | ExecutorError::Plan { .. } => Exit {
                code: 4,
                error: error.into(),
            },
            ExecutorError::Store(inner) => match inner.downcast::<CheckpointError>() {
                Ok(checkpoint) => Exit::checkpoint(*checkpoint),
                Err(other) => match other.downcast::<CassandraStoreError>() {
                    Ok(cassandra) => Exit::cassandra(*cassandra),
                    Err(other) => Exit::runtime(anyhow::anyhow!(other)),
                },
            },
            ExecutorError::Source(inner) => match inner.downcast::<KafkaSourceError>() {
                Ok(kafka) => match *kafka {
                    e @ KafkaSourceError::DataLoss(_) => Exit::data_loss(e.into()),
                    e @ (KafkaSourceError::Config(_)
                    | KafkaSourceError::OwnedOption { .. }
                    | KafkaSourceError::Pattern { .. }
                    | KafkaSourceError::NoOffsetForTimestamp { .. }
                    | KafkaSourceError::NoCommittedOffset { .. }) => Exit::config(e.into()),
                    e => Exit::runtime(e.into()),
                },
                Err(other) => Exit::runtime(anyhow::anyhow!(other)),
            },
            ExecutorError::Sink(_) => Exit::runtime(error.into()),
        }
    }
}
