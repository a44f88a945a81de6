//! The trait offset stores implement, and what they hand back on start.

use std::future::Future;

use crate::recovery::{Inconsistency, Log, Recovery, decide_recovery};
use crate::{BatchCommit, BatchId, BatchPlan, PartitionOffsets, StateFile, StateFileId};

/// What an offset store holds, as far as a restart needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredBatches {
    /// Ids of every plan still stored, ascending.
    pub planned: Vec<BatchId>,
    /// Ids of every commit still stored, ascending.
    pub committed: Vec<BatchId>,
    /// The newest plan, in full.
    pub latest_plan: Option<BatchPlan>,
    /// The newest commit, in full.
    pub latest_commit: Option<BatchCommit>,
    /// Where batch 0 starts, when that was recorded apart from its plan (Spark's
    /// `sources/0/0`). A fresh query that finds these starts from them, not from
    /// its starting options, so that a crash before the first plan changes nothing.
    pub initial_offsets: Option<PartitionOffsets>,
}

impl StoredBatches {
    /// How the query resumes from these batches.
    pub fn recovery(&self) -> Result<Recovery, Inconsistency> {
        decide_recovery(&self.planned, &self.committed)
    }
}

/// Durable storage for batch plans and commits: Spark's checkpoint layout on a
/// filesystem, or Cassandra tables.
///
/// Contract for implementations:
/// - `write_plan` and `write_commit` return only once the entry is durable, and
///   never replace an entry that already exists for the same batch: they fail
///   instead, and leave it as it was.
/// - `load` reports damaged entries as errors that name them; it never repairs,
///   rewrites or deletes anything.
/// - A store holds an exclusive claim on its query while it is open, so that a
///   second runner fails instead of writing beside the first.
pub trait OffsetStore: Send {
    /// What can go wrong, with the location (file, table) it concerns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Reads the ids of all stored plans and commits, and the newest of each.
    fn load(&mut self) -> impl Future<Output = Result<StoredBatches, Self::Error>> + Send;

    /// Durably records the plan of a batch before anything of it is read, with
    /// the commit the store holds ([`OffsetStore::hold_commit`]), if any, in
    /// the same write.
    fn write_plan(
        &mut self,
        plan: &BatchPlan,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Durably records that a batch reached the sink.
    fn write_commit(
        &mut self,
        commit: &BatchCommit,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Offers a batch's commit to be written with the next batch's plan, in one
    /// write: both or neither. The executor offers it when the next batch
    /// starts at once. A store for which that costs clearly less than two
    /// writes (one round trip to a database instead of two) holds it and says
    /// so; its next `write_plan` then writes both, or `settle` the commit alone
    /// when no plan follows at once, and the commit is durable only then. The
    /// default holds nothing, and the executor writes the commit alone.
    fn hold_commit(&mut self, commit: &BatchCommit) -> bool {
        let _ = commit;
        false
    }

    /// Writes the commit that [`hold_commit`] holds, alone: no plan follows at
    /// once (the query is idle, stops, or failed while planning). The default
    /// holds nothing to write.
    ///
    /// [`hold_commit`]: OffsetStore::hold_commit
    fn settle(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Removes plans and commits of batches before `keep_from`.
    fn purge(&mut self, keep_from: BatchId)
    -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Confirms that this runner still holds the query, failing as fenced when a
    /// later runner claimed it. Asked after the sink fenced earlier writers
    /// ([`Sink::take_over`]): a runner that lost the query in between must stop
    /// before it writes anything. A store that no other runner can claim while
    /// this one runs (the checkpoint directory's lock) always holds it.
    ///
    /// [`Sink::take_over`]: crate::Sink::take_over
    fn check_claim(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Writes what the store keeps off the batch path (the Cassandra store's
    /// table of latest offsets, refreshed at most once a second). Called when a
    /// run ends normally; nothing recovery reads may wait for it. The default
    /// has nothing to write.
    fn flush(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Whether `error` may go away by itself (the database restarting, a
    /// timeout), so that the same call is worth trying again. Implementations make
    /// their writes idempotent so that a retried write that had in fact succeeded is
    /// not an error. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Where an entry lives (a file path, a table and key), so that an error such as
    /// an [`Inconsistency`] can name what a person should look at.
    fn describe(&self, log: Log, batch: BatchId) -> String;
}

/// Durable storage for the state files of a query's stateful operators, beside
/// its offsets: a `state/` directory in the checkpoint, or a Cassandra table.
///
/// Contract for implementations: a write returns only once the file is durable,
/// and is fenced as the same store's offset writes are; `list_state` and
/// `read_state` never repair or remove anything; a damaged file is an error
/// naming it.
pub trait StateStore: Send {
    /// What can go wrong, with the location (file, table) it concerns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Durably writes a state file. One already stored for the same operator,
    /// partition, version and kind is left as it is: a replayed batch computes the same
    /// state from the same version before it, so nothing stored is replaced.
    fn write_state(
        &mut self,
        file: &StateFile,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The state files stored for `operator`, in every partition.
    fn list_state(
        &mut self,
        operator: u32,
    ) -> impl Future<Output = Result<Vec<StateFileId>, Self::Error>> + Send;

    /// Reads one state file, with its location filled in.
    fn read_state(
        &mut self,
        operator: u32,
        file: StateFileId,
    ) -> impl Future<Output = Result<StateFile, Self::Error>> + Send;

    /// Removes state files that recovery no longer needs.
    fn remove_state(
        &mut self,
        operator: u32,
        files: &[StateFileId],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Where a state file lives, for messages.
    fn describe_state(&self, operator: u32, file: StateFileId) -> String;

    /// Whether `error` may go away by itself, so that the same call is worth
    /// trying again. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}
