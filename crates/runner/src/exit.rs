//! Errors as exit codes: which failures are the user's to fix, and which are not.

use sluice_cassandra_store::CassandraStoreError;
use sluice_checkpoint_fs::CheckpointError;
use sluice_executor::ExecutorError;
use sluice_kafka::KafkaError;
use sluice_sql::SqlError;

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

    /// A query whose state and batch passed `[query] state_memory_mb`: 4, as
    /// the state forbids going on until the budget or the query changes.
    pub fn over_memory(error: anyhow::Error) -> Exit {
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
            | CassandraStoreError::MissingTable { .. }
            | CassandraStoreError::OldTable { .. }
            | CassandraStoreError::Refused { .. } => 2,
            CassandraStoreError::Fenced { .. }
            | CassandraStoreError::AlreadyExists { .. }
            | CassandraStoreError::CommitWithoutPlan { .. }
            | CassandraStoreError::Damaged { .. } => 4,
            CassandraStoreError::Connect { .. }
            | CassandraStoreError::Query { .. }
            | CassandraStoreError::NotConsecutive { .. } => 1,
        };
        Exit {
            code,
            error: error.into(),
        }
    }

    /// Why the executor stopped: each part's error chooses its own code;
    /// `fenced` is the sink's own judgement ([`Sink::is_fenced`]) of its errors.
    ///
    /// [`Sink::is_fenced`]: sluice_core::Sink::is_fenced
    pub fn executor<S, T, P, K, D>(
        error: ExecutorError<S, T, P, K, D>,
        fenced: fn(&K) -> bool,
    ) -> Exit
    where
        S: Classify + std::error::Error + Send + Sync + 'static,
        T: Classify + std::error::Error + Send + Sync + 'static,
        P: Classify + std::error::Error + Send + Sync + 'static,
        K: std::error::Error + Send + Sync + 'static,
        D: std::error::Error + Send + Sync + 'static,
    {
        match error {
            ExecutorError::Source(e) => e.exit(),
            ExecutorError::Store(e) => e.exit(),
            ExecutorError::Process(e) => e.exit(),
            e @ ExecutorError::DataLoss(_) => Exit::data_loss(e.into()),
            e @ (ExecutorError::Inconsistent { .. }
            | ExecutorError::Plan { .. }
            | ExecutorError::StateMissing { .. }) => Exit {
                code: 4,
                error: e.into(),
            },
            e @ (ExecutorError::StatePartitions { .. }
            | ExecutorError::SourcesDiffer { .. }
            | ExecutorError::ContinuousWithState { .. }) => Exit::config(e.into()),
            e @ ExecutorError::BadRecord { .. } => Exit {
                code: 5,
                error: e.into(),
            },
            // Fenced by a newer runner, as the stores' fencing is: 4.
            ExecutorError::Sink(e) => Exit {
                code: if fenced(&e) { 4 } else { 1 },
                error: e.into(),
            },
            e @ ExecutorError::DeadLetters(_) => Exit::runtime(e.into()),
            // The last error chooses the code; the message keeps the count of
            // tries and the limit that ended them.
            ExecutorError::GaveUp {
                retried,
                last: Some(last),
            } => {
                let inner = Exit::executor(*last, fenced);
                Exit {
                    code: inner.code,
                    error: inner.error.context(format!("{retried}; the last error")),
                }
            }
            e @ ExecutorError::GaveUp { last: None, .. } => Exit::runtime(e.into()),
            // Never returned by a run; a stop is not a failure.
            e @ ExecutorError::Stopped { .. } => Exit::runtime(e.into()),
        }
    }
}

/// An error that knows the exit code it ends the process with.
pub trait Classify: Sized {
    /// The error with its exit code.
    fn exit(self) -> Exit;
}

impl Classify for KafkaError {
    fn exit(self) -> Exit {
        match self {
            e @ KafkaError::DataLoss(_) => Exit::data_loss(e.into()),
            e @ (KafkaError::Config(_)
            | KafkaError::OwnedOption { .. }
            | KafkaError::Pattern { .. }
            | KafkaError::NoOffsetForTimestamp { .. }
            | KafkaError::NoCommittedOffset { .. }
            | KafkaError::Refused { .. }) => Exit::config(e.into()),
            e => Exit::runtime(e.into()),
        }
    }
}

impl Classify for CheckpointError {
    fn exit(self) -> Exit {
        Exit::checkpoint(self)
    }
}

impl Classify for CassandraStoreError {
    fn exit(self) -> Exit {
        Exit::cassandra(self)
    }
}

impl Classify for SqlError {
    fn exit(self) -> Exit {
        match self {
            e @ (SqlError::Execution(_) | SqlError::Internal(_) | SqlError::StateTooLarge(_)) => {
                Exit::runtime(e.into())
            }
            e @ SqlError::State { .. } => Exit::checkpoint_state(e.into()),
            e @ SqlError::StateOverMemory(_) => Exit::over_memory(e.into()),
            e => Exit::config(e.into()),
        }
    }
}

impl Classify for std::convert::Infallible {
    fn exit(self) -> Exit {
        match self {}
    }
}
