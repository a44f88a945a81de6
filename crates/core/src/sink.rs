//! The trait a sink implements: its lifecycle, and what it writes.

use std::collections::BTreeMap;
use std::future::Future;

use crate::{BatchId, OffsetRange, RecordChunk};

/// Where a batch's output goes: a file per batch, a table, a topic, or a user's
/// own processing. This is its lifecycle; what it receives, it takes through
/// [`Writes`]: the records as read ([`RecordChunk`]), rows a query made of them
/// (Arrow record batches), or both, each written by a method of its own and
/// every batch begun and finished by the one implementation here.
///
/// Contract: for each batch, after its plan is durable, the executor calls
/// `begin_batch`, then `write` for every piece of output, then `finish_batch`,
/// and only then commits the batch. A read that fails part way and is retried
/// begins the same batch again, and everything is written anew. After a crash, a
/// batch that was planned but not committed is written again with the **same
/// batch id, the same ranges and the same output**. A sink that replaces its
/// output per batch id (a file named by the id, upserts keyed by the data) is
/// therefore exactly once; one that appends is at least once. A sink that can
/// tell whether a batch already reached it ([`Sink::delivered`], a two-phase sink
/// such as Kafka transactions) is exactly once without replacing anything.
///
/// Under the continuous trigger a batch (an epoch) begins before its plan
/// exists, with no ranges, since its end is decided when it closes; its
/// records are written as they arrive, and its plan is durable before
/// `finish_batch`. A crash before that replays the records from the last
/// commit in a new attempt of the same batch id: a sink that publishes only
/// at `finish_batch` stays exactly once, one that publishes on `write` is at
/// least once.
pub trait Sink: Send {
    /// What can go wrong.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Starts `batch`, which reads `ranges`, or starts it over, dropping whatever
    /// of it was written since the last `begin_batch`.
    fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = (batch, ranges);
        async { Ok(()) }
    }

    /// Ends the batch begun last. Returns once its output is durable in the sink.
    fn finish_batch(
        &mut self,
        batch: BatchId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send {
        let _ = batch;
        async { Ok(()) }
    }

    /// Whether `error` may go away when the batch is begun and written again
    /// (a transaction the sink aborted), so that the executor retries the batch
    /// under its retry policy. The default treats every error as permanent.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Fences every earlier writer of this query's output, so that a runner that
    /// lost the query cannot write to the sink any more (a Kafka transactional
    /// producer's `init_transactions`). The executor calls it before the first
    /// batch and then confirms with [`OffsetStore::check_claim`] that this runner
    /// still holds the query, so a runner that lost the query in between writes
    /// nothing. The default has nothing to fence.
    ///
    /// [`OffsetStore::check_claim`]: crate::OffsetStore::check_claim
    fn take_over(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Whether `error` says another writer fenced this sink. When the store
    /// confirms that this runner still holds the query, the fence came from a
    /// runner that is about to stop, and the executor takes the sink over again
    /// and retries the batch. The default says no.
    fn is_fenced(error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// What the sink wrote in the batch it finished last, for the progress
    /// report's `sink.metrics` (Spark's `SinkProgress.metrics`): the files,
    /// bytes and rows a table sink wrote, say. The default reports nothing;
    /// a sink that wraps another forwards it.
    fn metrics(&self) -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    /// Asked on recovery about a batch that was planned but not committed:
    /// whether its whole output already reached the sink, so that only the
    /// commit is left to write. The default says no, and the batch is replayed.
    fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send {
        let _ = (batch, ranges);
        async { Ok(false) }
    }
}

/// A sink that takes output of type `T`: records as read ([`RecordChunk`], the
/// default) or rows. A sink that takes both implements this twice, each a
/// `write` of its own, and its lifecycle once, as [`Sink`].
pub trait Writes<T: ?Sized + Sync = RecordChunk>: Sink {
    /// Delivers the next output of the batch begun last.
    fn write(&mut self, output: &T) -> impl Future<Output = Result<(), Self::Error>> + Send;
}
