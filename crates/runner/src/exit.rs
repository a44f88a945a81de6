//! Errors as exit codes: which failures are the user's to fix, and which are not.

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
                Err(other) => Exit::runtime(anyhow::anyhow!(other)),
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
