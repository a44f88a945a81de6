//! A test hook that kills the process at one moment the random SIGKILLs of the
//! tests might miss: `SLUICE_FAILPOINT=after_sink_commit:<batch>` aborts right
//! after the sink made batch `<batch>` durable (a Kafka transaction committed)
//! and before the store's commit of it is written.

use sluice_offsets::{BatchId, OffsetRange, Sink};

/// The environment variable naming the failpoint.
pub const FAILPOINT_VAR: &str = "SLUICE_FAILPOINT";

/// The batch after whose sink commit the process aborts, if the failpoint is set.
pub fn crash_after_sink_commit() -> anyhow::Result<Option<BatchId>> {
    let Ok(value) = std::env::var(FAILPOINT_VAR) else {
        return Ok(None);
    };
    let batch = value
        .strip_prefix("after_sink_commit:")
        .and_then(|b| b.parse::<u64>().ok())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{FAILPOINT_VAR}={value:?}: the one failpoint is after_sink_commit:<batch id>"
            )
        })?;
    Ok(Some(BatchId(batch)))
}

/// A sink that aborts the process once `inner` finished batch `at`.
pub struct CrashAfterCommit<S> {
    /// The sink written to.
    pub inner: S,
    /// The batch to crash after; `None` passes everything through.
    pub at: Option<BatchId>,
}

impl<T: ?Sized + Sync, S: Sink<T>> Sink<T> for CrashAfterCommit<S> {
    type Error = S::Error;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), S::Error> {
        self.inner.begin_batch(batch, ranges).await
    }

    async fn write(&mut self, output: &T) -> Result<(), S::Error> {
        self.inner.write(output).await
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), S::Error> {
        self.inner.finish_batch(batch).await?;
        if self.at == Some(batch) {
            eprintln!("sluice: {FAILPOINT_VAR}: aborting after the sink committed batch {batch}");
            std::process::abort();
        }
        Ok(())
    }

    fn is_transient(error: &S::Error) -> bool {
        S::is_transient(error)
    }

    async fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<bool, S::Error> {
        self.inner.delivered(batch, ranges).await
    }
}
