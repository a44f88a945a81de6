//! Errors that stop a query, typed by what failed, so that the runner can
//! choose an exit code without guessing.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_core::{
    DataLoss, DataLossDecision, ERROR_HEADER, Inconsistency, Offset, OffsetBounds,
    PartitionOffsets, RecordChunk, TopicPartition, apply_data_loss_policy, classify_batch,
};

use crate::GaveUp;
use crate::retry::Tries;

/// Why a query stopped. `S`, `T`, `P`, `K` and `D` are the errors of the
/// source, the offset store, the processor, the sink and the dead letters.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError<S, T, P, K, D>
where
    S: std::error::Error + 'static,
    T: std::error::Error + 'static,
    P: std::error::Error + 'static,
    K: std::error::Error + 'static,
    D: std::error::Error + 'static,
{
    /// The source failed (Kafka unreachable, a read that stalled, data loss while reading).
    #[error("{0}")]
    Source(S),
    /// The offset store failed (a damaged checkpoint, a second runner, I/O).
    #[error("{0}")]
    Store(T),
    /// Processing failed (a query's cast of a value that does not fit).
    #[error("{0}")]
    Process(P),
    /// The sink failed.
    #[error("sink: {0}")]
    Sink(K),
    /// Writing to the dead letters failed.
    #[error("dead letters: {0}")]
    DeadLetters(D),
    /// A record could not be processed and `on_bad_record = "fail"`.
    #[error(
        "record {topic_partition}@{offset} cannot be processed: {reason}; set on_bad_record = \
         \"skip\" or \"dead_letter\" to go on without it"
    )]
    BadRecord {
        /// Where the record is.
        topic_partition: TopicPartition,
        /// Its offset.
        offset: Offset,
        /// Why it cannot be processed.
        reason: String,
    },
    /// The store's logs contradict each other.
    #[error("the offset store is inconsistent: {inconsistency}; look at {}", entries.join(" and "))]
    Inconsistent {
        /// What contradicts what.
        inconsistency: Inconsistency,
        /// Where the entries live (files, rows).
        entries: Vec<String>,
    },
    /// Offsets the next batch needs are gone and `fail_on_data_loss` is set.
    #[error("{}", sluice_core::data_loss_report(.0))]
    DataLoss(Vec<DataLoss>),
    /// A state version that recovery needs is not stored.
    #[error(
        "the state of operator {operator} at batch {version} cannot be rebuilt: {location} is \
         missing{hint}"
    )]
    StateMissing {
        /// The operator.
        operator: u32,
        /// The version that was to be restored.
        version: u64,
        /// The first missing file.
        location: String,
        /// What to do when the query was stateless before.
        hint: String,
    },
    /// The stored state is split into other partitions than the query's.
    #[error(
        "the state of operator {operator} at batch {version} is split into partitions \
         {stored:?}, and the query has {configured}: a checkpoint keeps the partitions its state \
         was written with, so set `[query] state_partitions = {}` again, or give the query a new \
         checkpoint",
        .stored.len()
    )]
    StatePartitions {
        /// The operator.
        operator: u32,
        /// The version that was to be restored.
        version: u64,
        /// The partitions stored at that version.
        stored: Vec<u32>,
        /// The partitions the query has.
        configured: u32,
    },
    /// The checkpoint's plans have another number or order of sources than
    /// the query.
    #[error(
        "the checkpoint holds offsets of {checkpoint}, and the query reads {config}: a \
         checkpoint keeps the sources it was started with, in their order; declare them so \
         again, or give the query a new checkpoint"
    )]
    SourcesDiffer {
        /// The checkpoint's sources, by the topics of each line.
        checkpoint: String,
        /// The query's sources, by name.
        config: String,
    },
    /// A call kept failing transiently until the retry policy gave up.
    #[error(
        "{retried}; {}",
        .last.as_ref().map_or_else(
            || "the first attempt had no answer yet".to_owned(),
            |last| format!("the last error: {last}")
        )
    )]
    GaveUp {
        /// What was tried, how often, and which limit ended it.
        retried: Retried,
        /// The last failure, when an attempt failed rather than being cut short.
        last: Option<Box<Self>>,
    },
    /// A stop request ended a call that was being retried. [`Query::run`]
    /// turns it into a normal end, so its callers never see it.
    ///
    /// [`Query::run`]: crate::Query::run
    /// The continuous trigger with a processor that keeps state.
    #[error(
        "the continuous trigger runs stateless queries only, and this one keeps state in \
         {operators} operator(s), which is committed with each batch's watermark: use \
         processing_time = \"0s\", which runs batches back to back"
    )]
    ContinuousWithState {
        /// The processor's stateful operators.
        operators: u32,
    },
    #[error("stopped while retrying {what}")]
    Stopped {
        /// What was being retried.
        what: &'static str,
    },
    /// A plan that could not be built from the offsets (a bug or a hand-edited store).
    #[error("cannot plan batch {batch}: {reason}")]
    Plan {
        /// The batch.
        batch: u64,
        /// Why.
        reason: String,
    },
}

/// The tries of a call that the retry policy gave up on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retried {
    /// What was being done.
    pub what: &'static str,
    /// The attempts really made, a cut-short last one included.
    pub attempts: u32,
    /// From the first attempt to giving up.
    pub elapsed: Duration,
    /// Which limit ended the retries.
    pub why: GaveUp,
}

impl std::fmt::Display for Retried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed {} {} in {:.1} s, giving up at {}",
            self.what,
            self.attempts,
            if self.attempts == 1 { "time" } else { "times" },
            self.elapsed.as_secs_f64(),
            self.why
        )
    }
}

/// The error for the first of `bad`'s records, with the reason its header gives.
pub(crate) fn first_bad_record<S, T, P, K, D>(bad: &RecordChunk) -> ExecutorError<S, T, P, K, D>
where
    S: std::error::Error + 'static,
    T: std::error::Error + 'static,
    P: std::error::Error + 'static,
    K: std::error::Error + 'static,
    D: std::error::Error + 'static,
{
    let record = bad.iter().next();
    ExecutorError::BadRecord {
        topic_partition: record.map_or_else(
            || TopicPartition::new("?", 0),
            |r| TopicPartition::new(r.topic(), r.partition()),
        ),
        offset: record.map_or(sluice_core::Offset::ZERO, |r| r.offset()),
        reason: record
            .and_then(|r| r.headers().find(|(name, _)| *name == ERROR_HEADER))
            .and_then(|(_, value)| value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_else(|| "no reason given".to_owned()),
    }
}

pub(crate) fn gave_up<S, T, P, K, D>(
    tries: &Tries,
    why: GaveUp,
    last: Option<ExecutorError<S, T, P, K, D>>,
) -> ExecutorError<S, T, P, K, D>
where
    S: std::error::Error + 'static,
    T: std::error::Error + 'static,
    P: std::error::Error + 'static,
    K: std::error::Error + 'static,
    D: std::error::Error + 'static,
{
    ExecutorError::GaveUp {
        retried: Retried {
            what: tries.what(),
            attempts: tries.attempts(),
            elapsed: tries.elapsed(),
            why,
        },
        last: last.map(Box::new),
    }
}

/// Classifies what `from` lost against the partitions' bounds and applies
/// the policy: stop with the losses, or skip ahead past them (moving `from`)
/// and return them for the progress report.
pub(crate) fn data_loss<S, T, P, K, D>(
    from: &mut PartitionOffsets,
    partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    fail_on_data_loss: bool,
) -> Result<Vec<DataLoss>, ExecutorError<S, T, P, K, D>>
where
    S: std::error::Error + 'static,
    T: std::error::Error + 'static,
    P: std::error::Error + 'static,
    K: std::error::Error + 'static,
    D: std::error::Error + 'static,
{
    let losses = classify_batch(from, partitions);
    match apply_data_loss_policy(from, losses, fail_on_data_loss) {
        DataLossDecision::None => Ok(Vec::new()),
        DataLossDecision::Fail(losses) => Err(ExecutorError::DataLoss(losses)),
        DataLossDecision::Skip(losses) => {
            for loss in &losses {
                tracing::warn!(
                    lost_offsets = loss.lost_offsets(),
                    "{loss}; skipping ahead because fail_on_data_loss is false"
                );
            }
            Ok(losses)
        }
    }
}
