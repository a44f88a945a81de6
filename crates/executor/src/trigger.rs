//! When batches run: Spark's three micro-batch triggers and its continuous one.

use std::time::Duration;

/// When the query runs its batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// A batch every `interval`, if there is new data. Zero runs batches back to
    /// back; a batch that overruns its interval starts the next one at once.
    ProcessingTime(Duration),
    /// Process what exists when the query starts, in rate-limited batches, then stop.
    AvailableNow,
    /// One batch with everything available, then stop.
    Once,
    /// Spark's continuous processing: records go to the sink as they arrive, and
    /// every `interval` (an epoch) what was read is planned and committed as one
    /// batch. An epoch's records reach the sink before its plan is durable, so
    /// a crash replays them: at least once, unless the sink publishes a batch
    /// only when it finishes (a `jsonl` file).
    Continuous(Duration),
}

impl Default for Trigger {
    fn default() -> Self {
        Trigger::ProcessingTime(Duration::ZERO)
    }
}

impl Trigger {
    /// Whether the query stops once it has caught up.
    pub fn stops_when_caught_up(self) -> bool {
        !matches!(self, Trigger::ProcessingTime(_) | Trigger::Continuous(_))
    }
}
