//! Test hooks for the moments the random SIGKILLs of the tests might miss,
//! named by `SLUICE_FAILPOINT`:
//! - `after_sink_commit:<batch>` aborts right after the sink made batch `<batch>`
//!   durable (a Kafka transaction committed) and before the store's commit of it
//!   is written;
//! - `slow_sink:<ms>` makes every batch's sink take `<ms>` longer to finish, a
//!   long batch for a rebalance or a stop to arrive in;
//! - `before_sink_take_over` stops the process (SIGSTOP) after it claimed the
//!   query and before the sink fences earlier writers, as a runner paused there
//!   by the machine would be, until a SIGCONT.

use sluice_core::{BatchId, OffsetRange, Sink, Writes};

/// The environment variable naming the failpoint.
pub const FAILPOINT_VAR: &str = "SLUICE_FAILPOINT";

/// Where the process is to fail, as `SLUICE_FAILPOINT` says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Failpoint {
    /// None: everything passes through.
    #[default]
    None,
    /// Abort once the sink finished this batch.
    AfterSinkCommit(BatchId),
    /// Stop the process before the sink's take-over.
    BeforeSinkTakeOver,
    /// Wait this many milliseconds before each batch's sink finishes.
    SlowSink(u64),
}

/// The failpoint the environment sets.
pub fn from_env() -> anyhow::Result<Failpoint> {
    let Ok(value) = std::env::var(FAILPOINT_VAR) else {
        return Ok(Failpoint::None);
    };
    if value == "before_sink_take_over" {
        return Ok(Failpoint::BeforeSinkTakeOver);
    }
    let number = |prefix: &str| value.strip_prefix(prefix)?.parse::<u64>().ok();
    number("after_sink_commit:")
        .map(|batch| Failpoint::AfterSinkCommit(BatchId(batch)))
        .or_else(|| number("slow_sink:").map(Failpoint::SlowSink))
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{FAILPOINT_VAR}={value:?}: the failpoints are after_sink_commit:<batch id>, \
                 slow_sink:<milliseconds> and before_sink_take_over"
            )
        })
}

/// A sink that fails the process at `at` and otherwise is `inner`.
pub struct WithFailpoint<S> {
    /// The sink written to.
    pub inner: S,
    /// Where to fail.
    pub at: Failpoint,
}

impl<S: Sink> Sink for WithFailpoint<S> {
    type Error = S::Error;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), S::Error> {
        self.inner.begin_batch(batch, ranges).await
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), S::Error> {
        if let Failpoint::SlowSink(ms) = self.at {
            eprintln!("sluice: {FAILPOINT_VAR}: batch {batch} is in flight for {ms} ms more");
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
            eprintln!("sluice: {FAILPOINT_VAR}: batch {batch} reaches its sink");
        }
        self.inner.finish_batch(batch).await?;
        if self.at == Failpoint::AfterSinkCommit(batch) {
            eprintln!("sluice: {FAILPOINT_VAR}: aborting after the sink committed batch {batch}");
            std::process::abort();
        }
        Ok(())
    }

    fn is_transient(error: &S::Error) -> bool {
        S::is_transient(error)
    }

    async fn take_over(&mut self) -> Result<(), S::Error> {
        if self.at == Failpoint::BeforeSinkTakeOver {
            eprintln!("sluice: {FAILPOINT_VAR}: stopping before the sink's take-over");
            // The process stops here until a SIGCONT; `kill` spares a libc binding.
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
        }
        self.inner.take_over().await
    }

    fn is_fenced(error: &S::Error) -> bool {
        S::is_fenced(error)
    }

    fn metrics(&self) -> std::collections::BTreeMap<String, String> {
        self.inner.metrics()
    }

    async fn delivered(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<bool, S::Error> {
        self.inner.delivered(batch, ranges).await
    }
}

impl<T: ?Sized + Sync, S: Writes<T>> Writes<T> for WithFailpoint<S> {
    async fn write(&mut self, output: &T) -> Result<(), S::Error> {
        self.inner.write(output).await
    }
}
