//! The micro-batch loop.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_core::{
    BadRecordPolicy, BatchCommit, BatchId, BatchMetadata, BatchPlan, BatchReader, BatchSizing,
    DataLoss, MemoryBudget, MinOffsetsPerTrigger, OffsetBounds, OffsetRange, OffsetStore,
    PartitionOffsets, PassThrough, Processed, Processor, Reach, RecordChunk, Recovery, Sink,
    Source, StartingOffsets, StateStore, TopicPartition, Writes, event_time_conf,
    next_watermark_ms, purge_due, rate_limit, should_run_batch, snapshot_due, source_watermarks_of,
    wants_batch_without_data,
};
use tokio::sync::watch;
use tracing::Instrument;

use crate::error::{data_loss, first_bad_record, gave_up};
use crate::progress::{
    DurationMs, GroupProgress, LookupTableProgress, MemoryProgress, QueryProgress, SinkProgress,
    SourceProgress, event_time_entry, format_event_time, offsets_value, source_metrics,
};
use crate::retry::{Driver, Failed, Part, Reached, Tries};
use crate::sinks::DiscardSink;
use crate::{ExecutorError, RetryPolicy, Trigger};

/// What a query keeps its progress in: an offset store that keeps its state
/// files too, with one error for both, as both stores of the project do.
pub trait QueryStore: OffsetStore + StateStore<Error = <Self as OffsetStore>::Error> {}

impl<S> QueryStore for S where S: OffsetStore + StateStore<Error = <S as OffsetStore>::Error> {}

/// How a driven call of a [`Query`] over these parts ended without a value.
type QueryFailed<Src, Store, Proc, Snk, Dead> = Failed<QueryError<Src, Store, Proc, Snk, Dead>>;

/// The error of a [`Query`] over these parts.
pub type QueryError<Src, Store, Proc, Snk, Dead> = ExecutorError<
    <Src as Source>::Error,
    <Store as OffsetStore>::Error,
    <Proc as Processor>::Error,
    <Snk as Sink>::Error,
    <Dead as Sink>::Error,
>;

/// Makes `$call`, an expression making a fresh future over the query's parts
/// for each attempt, through the one retry driver under the query's policy:
/// as a call to `$part`, retried while the part judges its error transient
/// (or while `$retryable` says so), and with the first attempt inside a batch
/// finished despite a stop request (or as `$in_batch` says).
macro_rules! retrying {
    ($self:ident, $part:expr, $what:expr, $call:expr) => {
        retrying!($self, $part, $what, $self.in_batch, Self::transient, $call)
    };
    ($self:ident, $part:expr, $what:expr, $in_batch:expr, $retryable:expr, $call:expr) => {{
        let mut driver = $self.driver($part, $what, $in_batch, $retryable);
        let outcome = drive!(driver, $call);
        $self.driven($part, $what, &driver, outcome)
    }};
}

// After the macro, which they use.
mod checkpoint;
mod continuous;
mod sources;
mod stream;

use checkpoint::StateWritten;

/// How long a batch's early read may wait for its plan to be written before
/// it is started afresh; well under the sources' poll timeouts.
const EARLY_READ_PATIENCE: Duration = Duration::from_secs(1);

/// The longest a query with `ProcessingTime(0)` waits before it looks for new
/// data again when there was none, unless `QueryOptions::polling_delay` says
/// otherwise.
pub const DEFAULT_POLLING_DELAY: Duration = Duration::from_millis(100);

/// The first wait of an idle `ProcessingTime(0)` query: short, so that a record
/// arriving just after a look is picked up within a millisecond or two.
const FIRST_IDLE_WAIT: Duration = Duration::from_millis(1);

/// The waits of an idle `ProcessingTime(0)` query: from `FIRST_IDLE_WAIT`,
/// doubling up to the polling delay, and back to the first after a batch. A fixed
/// long wait would add up to that wait to the latency of the first record after a
/// pause; a fixed short one would ask the brokers for their offsets a thousand
/// times a second on a quiet topic.
#[derive(Clone, Debug)]
struct IdleBackoff {
    next: Duration,
    longest: Duration,
}

impl IdleBackoff {
    fn new(longest: Duration) -> Self {
        IdleBackoff {
            next: FIRST_IDLE_WAIT.min(longest),
            longest,
        }
    }

    fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = wait.saturating_mul(2).min(self.longest);
        wait
    }

    fn reset(&mut self) {
        self.next = FIRST_IDLE_WAIT.min(self.longest);
    }
}

/// What a query does, apart from where it reads, stores and writes.
#[derive(Clone, Debug)]
pub struct QueryOptions {
    /// A name for progress reports and logs.
    pub name: Option<String>,
    /// When batches run.
    pub trigger: Trigger,
    /// The longest wait between looks for new data of an idle
    /// `ProcessingTime(0)` query; the waits start at a millisecond and double.
    pub polling_delay: Duration,
    /// Each source's own options, in the order the source numbers them
    /// ([`Source::source_of`]): one for a query of one stream.
    pub sources: Vec<SourceOptions>,
    /// Wait for this many new offsets, but no longer than its delay.
    pub min_offsets_per_trigger: Option<MinOffsetsPerTrigger>,
    /// The memory a stateful query's state and a batch's own structures may
    /// take: its batches are planned to it ([`MemoryBudget`]). Stateless
    /// queries ignore it.
    pub state_memory: Option<NonZeroU64>,
    /// Stop when offsets are lost (true), or skip ahead and report (false).
    pub fail_on_data_loss: bool,
    /// How many batches the offset store keeps.
    pub min_batches_to_retain: u64,
    /// The sink, as progress reports describe it.
    pub sink_description: String,
    /// How transient failures of the source, the store and the sink are retried.
    pub retry: RetryPolicy,
    /// The member and partitions of a group-mode run, which every progress
    /// report carries.
    pub group: Option<GroupProgress>,
}

impl Default for QueryOptions {
    fn default() -> Self {
        QueryOptions {
            name: None,
            trigger: Trigger::default(),
            polling_delay: DEFAULT_POLLING_DELAY,
            sources: vec![SourceOptions::default()],
            min_offsets_per_trigger: None,
            state_memory: None,
            fail_on_data_loss: true,
            min_batches_to_retain: sluice_core::DEFAULT_MIN_BATCHES_TO_RETAIN,
            sink_description: "sink".to_owned(),
            retry: RetryPolicy::default(),
            group: None,
        }
    }
}

/// What one source of a query does: where it starts, how much a batch
/// reads of it, and how progress names it.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    /// The source, as progress reports describe it.
    pub description: String,
    /// Where a fresh query starts on it.
    pub starting: StartingOffsets,
    /// The most offsets one batch reads of it, over its partitions.
    pub max_offsets_per_trigger: Option<NonZeroU64>,
    /// What happens to a record of it the processor cannot process.
    pub on_bad_record: BadRecordPolicy,
}

impl Default for SourceOptions {
    fn default() -> Self {
        SourceOptions {
            description: "source".to_owned(),
            starting: StartingOffsets::default(),
            max_offsets_per_trigger: None,
            on_bad_record: BadRecordPolicy::default(),
        }
    }
}

impl QueryOptions {
    /// The options of the query's one source, for a query that reads one.
    pub fn source(&mut self) -> &mut SourceOptions {
        if self.sources.is_empty() {
            self.sources.push(SourceOptions::default());
        }
        &mut self.sources[0]
    }
}

/// What a run did before it stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Batches committed, replays included.
    pub batches: u64,
    /// Records handed to the sink.
    pub records: u64,
    /// Offsets lost to tolerated data loss.
    pub lost_offsets: u64,
    /// Records that could not be processed, skipped or sent to the dead letters.
    pub bad_records: u64,
    /// The newest committed batch.
    pub last_committed: Option<BatchId>,
}

/// A streaming query: a source, an offset store, a processor and a sink, driven
/// batch by batch; records that cannot be processed may go to the dead letters.
pub struct Query<Src, Store, Snk, Proc = PassThrough, Dead = DiscardSink> {
    options: QueryOptions,
    query_id: String,
    run_id: String,
    source: Src,
    store: Store,
    processor: Proc,
    sink: Snk,
    dead_letters: Dead,
    last_trigger: Option<Instant>,
    /// Turns true when the query is asked to stop.
    stop: watch::Receiver<bool>,
    /// The parts that have answered in this run, which the startup timeout
    /// no longer bounds.
    reached: Reached,
    /// Whether a batch's plan is written and its commit not yet: a stop
    /// request then lets a first attempt finish.
    in_batch: bool,
    /// Whether a run ends after its recovery ([`Query::recovery_only`]).
    recovery_only: bool,
    /// A batch whose commit the store holds, to write it with the next batch's
    /// plan ([`OffsetStore::hold_commit`]); its progress is reported once that
    /// write is done.
    held: Option<EndedBatch>,
    /// A stateful query's memory budget and what its batches measured.
    memory: Option<MemoryBudget>,
}

/// What one batch read, wrote and met.
#[derive(Default)]
struct Streamed {
    rows: u64,
    /// Input rows and bad records of each source, by its index.
    by_source: Vec<(u64, u64)>,
    output_rows: u64,
    bad_records: u64,
    losses: Vec<DataLoss>,
}

impl Streamed {
    fn of_source(&mut self, source: usize) -> &mut (u64, u64) {
        if self.by_source.len() <= source {
            self.by_source.resize(source + 1, (0, 0));
        }
        &mut self.by_source[source]
    }
}

/// A batch whose output the sink has and whose state is written, with the
/// commit still to write.
struct EndedBatch {
    planned: Planned,
    streamed: Streamed,
    state: StateWritten,
    commit: BatchCommit,
    /// When the commit phase began (`commitOffsets` in progress reports).
    started: Instant,
    /// When the commit began to wait for the next plan.
    held_at: Instant,
    /// How long it waited for the next batch to be planned, which belongs to
    /// neither batch's `commitOffsets` nor to its `triggerExecution`.
    waited: Duration,
}

/// Where a run goes on after its recovery.
struct Recovered {
    /// The next batch to plan.
    next_batch: BatchId,
    /// Where it starts; `None` where the starting options decide.
    start: Option<PartitionOffsets>,
    /// The watermark of the newest plan.
    last_watermark: i64,
}

/// A batch ready to execute, with the phases timed so far.
struct Planned {
    plan: BatchPlan,
    /// A replay's plan is already stored, and is not written again.
    replay: bool,
    latest: PartitionOffsets,
    losses: Vec<DataLoss>,
    /// In microseconds until the progress report converts them.
    durations: DurationMs,
    trigger_start: Instant,
    timestamp: SystemTime,
    /// How the memory budget sized it, and what bounded it.
    sizing: Option<(BatchSizing, &'static str)>,
}

impl<Src, Store, Snk> Query<Src, Store, Snk>
where
    Src: Source,
    Store: QueryStore,
    Snk: Writes,
{
    /// A query with the id its offset store holds, handing the records to the
    /// sink as read.
    pub fn new(
        options: QueryOptions,
        query_id: String,
        source: Src,
        store: Store,
        sink: Snk,
    ) -> Self {
        Query::with_processor(
            options,
            query_id,
            source,
            store,
            PassThrough,
            sink,
            DiscardSink,
        )
    }
}

impl<Src, Store, Snk, Proc, Dead> Query<Src, Store, Snk, Proc, Dead>
where
    Src: Source,
    Store: QueryStore,
    Proc: Processor,
    Snk: Writes<Proc::Output>,
    Dead: Writes,
{
    /// A query whose records go through `processor` to `sink`; records it
    /// cannot process go to `dead_letters` when `on_bad_record` says so.
    pub fn with_processor(
        options: QueryOptions,
        query_id: String,
        source: Src,
        store: Store,
        processor: Proc,
        sink: Snk,
        dead_letters: Dead,
    ) -> Self {
        Query {
            query_id,
            run_id: uuid::Uuid::new_v4().to_string(),
            source,
            store,
            processor,
            sink,
            dead_letters,
            last_trigger: None,
            stop: watch::channel(false).1,
            reached: Reached::default(),
            in_batch: false,
            held: None,
            recovery_only: false,
            memory: options.state_memory.map(MemoryBudget::new),
            options,
        }
    }

    /// Makes a run end once it has recovered: a planned but uncommitted batch
    /// is replayed and committed, and nothing new is planned. Group mode
    /// settles a generation that died this way (`docs/scale-out.md`).
    pub fn recovery_only(mut self) -> Self {
        self.recovery_only = true;
        self
    }

    /// This run's id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Runs batches until the trigger is done or `stop` turns true. A batch in
    /// flight when `stop` turns true is finished first; one that is cut short by the
    /// process ending is replayed on the next start, because its plan is durable.
    ///
    /// A stop request also ends the waits of a failing call, and the call
    /// itself unless it is the first attempt inside a batch; the run then ends
    /// normally, and a batch it left is replayed on the next start.
    pub async fn run(
        &mut self,
        stop: watch::Receiver<bool>,
        mut on_progress: impl FnMut(&QueryProgress) + Send,
    ) -> Result<RunSummary, QueryError<Src, Store, Proc, Snk, Dead>> {
        self.stop = stop;
        self.reached = Reached::default();
        let mut summary = RunSummary::default();
        let mut result = self.run_batches(&mut summary, &mut on_progress).await;
        // A commit held for a next plan that did not come is written alone, also
        // when planning failed: the batch reached its sink.
        if self.held.is_some() {
            let settled = self.settle_held(&mut summary, &mut on_progress).await;
            match (&result, settled) {
                (_, Ok(())) => {}
                (Ok(()), Err(e)) => result = Err(e),
                (Err(_), Err(e)) => {
                    tracing::warn!(error = %e, "writing the last batch's commit failed too; it is replayed on restart");
                }
            }
        }
        match result {
            Ok(()) => {
                // Derived data only (a mirror of the committed offsets), so a
                // failure is not the run's.
                if let Err(e) = self.store.flush().await {
                    tracing::warn!(error = %e, "writing the store's deferred writes failed");
                }
                Ok(summary)
            }
            Err(ExecutorError::Stopped { what }) => {
                if self.in_batch {
                    tracing::info!(
                        "stopped while retrying {what}; the batch in flight is replayed on restart"
                    );
                } else {
                    tracing::info!("stopped while retrying {what}");
                }
                self.in_batch = false;
                Ok(summary)
            }
            Err(e) => Err(e),
        }
    }

    /// Recovers, then runs the trigger's batches: each the eight steps that
    /// `docs/architecture.md` lists, of which `execute` takes the last five.
    async fn run_batches(
        &mut self,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let Recovered {
            mut next_batch,
            mut start,
            mut last_watermark,
        } = self.recover(summary, on_progress).await?;
        if self.recovery_only {
            return Ok(());
        }
        if let Trigger::Continuous(interval) = self.options.trigger {
            return self
                .run_epochs(interval, next_batch, start, summary, on_progress)
                .await;
        }
        // As in Spark, `available_now` reads what was there when it started: the
        // partitions and their ends are looked up once, not before every batch,
        // and no batch reads past those ends. Offsets purged since then still
        // surface as data loss while reading.
        let mut available_now: Option<(BTreeMap<TopicPartition, OffsetBounds>, PartitionOffsets)> =
            None;
        let mut last_batch_at = Instant::now();
        let mut idle = IdleBackoff::new(self.options.polling_delay);
        while !*self.stop.borrow() {
            let trigger_start = Instant::now();
            let timestamp = SystemTime::now();
            // 1. The partitions and their offset bounds.
            let partitions = match &available_now {
                Some((partitions, _)) => partitions.clone(),
                None => self.discover().await?,
            };
            if self.options.trigger == Trigger::AvailableNow && available_now.is_none() {
                let ends = partitions.iter().map(|(tp, b)| (tp.clone(), b.high));
                available_now = Some((partitions.clone(), ends.collect()));
            }
            // 2. Data loss, judged against the bounds, which may move a start.
            let mut from = match start.take() {
                Some(from) => from,
                None => self.starting_offsets(&partitions).await?,
            };
            let losses = data_loss(&mut from, &partitions, self.options.fail_on_data_loss)?;
            // 3. The plan, under the rate limits, unless the trigger waits.
            let reach = Reach::of(
                from,
                &partitions,
                available_now.as_ref().map(|(_, ends)| ends),
            );
            let latest_offset_us = micros(trigger_start.elapsed());
            let since_last = millis(last_batch_at.elapsed());
            if !self.runs_now(&reach, since_last, last_watermark) {
                let available = reach.available();
                start = Some(reach.from);
                self.settle_held(summary, on_progress).await?;
                if available == 0 && self.options.trigger.stops_when_caught_up() {
                    break;
                }
                let idle = Some(idle.next_wait());
                if wait_for_next_trigger(self.options.trigger, trigger_start, idle, &mut self.stop)
                    .await
                {
                    break;
                }
                continue;
            }
            let mut planned = self.plan(next_batch, reach, losses, trigger_start, timestamp)?;
            planned.durations.latest_offset = latest_offset_us;
            last_watermark = planned.plan.metadata().watermark_ms;
            let end = planned.plan.end_offsets();
            // 4.-8. Write the plan, read, process, sink, commit, purge.
            self.execute(planned, summary, on_progress).await?;
            last_batch_at = Instant::now();
            idle.reset();
            start = Some(end);
            next_batch = next_batch.next();
            if self.options.trigger == Trigger::Once
                || wait_for_next_trigger(self.options.trigger, trigger_start, None, &mut self.stop)
                    .await
            {
                break;
            }
        }
        Ok(())
    }

    /// Loads the store and decides how the query resumes: fences earlier
    /// writers of the sink, restores the state and the watermark of the last
    /// committed batch, and replays a planned but uncommitted batch.
    async fn recover(
        &mut self,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<Recovered, QueryError<Src, Store, Proc, Snk, Dead>> {
        let stored = retrying!(self, Part::Store, "loading the offset store", async {
            self.store.load().await.map_err(ExecutorError::Store)
        })?;
        let recovery = stored
            .recovery()
            .map_err(|inconsistency| ExecutorError::Inconsistent {
                entries: inconsistency
                    .entries()
                    .into_iter()
                    .map(|(log, batch)| self.store.describe(log, batch))
                    .collect(),
                inconsistency,
            })?;
        if let Some(plan) = &stored.latest_plan {
            self.check_sources(plan)?;
        }
        self.take_over_sink().await?;
        self.confirm_claim().await?;
        summary.last_committed = stored.latest_commit.as_ref().map(|c| c.id);
        let state_version = match recovery {
            Recovery::StartFresh => None,
            Recovery::RunNext { next, .. } | Recovery::Replay { batch: next } => {
                next.0.checked_sub(1).map(BatchId)
            }
        };
        self.restore_state(state_version).await?;
        if let Some(plan) = &stored.latest_plan {
            self.restore_source_watermarks(plan)?;
        }
        let last_watermark = stored
            .latest_plan
            .as_ref()
            .map_or(0, |p| p.metadata().watermark_ms);
        let (next_batch, start) = match recovery {
            Recovery::StartFresh => (BatchId::FIRST, stored.initial_offsets),
            Recovery::RunNext { next, .. } => {
                if let Some(commit) = &stored.latest_commit {
                    self.restore_watermark(commit.next_watermark_ms);
                }
                (
                    next,
                    stored.latest_plan.as_ref().map(BatchPlan::end_offsets),
                )
            }
            Recovery::Replay { batch } => {
                let plan = stored.latest_plan.ok_or_else(|| ExecutorError::Plan {
                    batch: batch.0,
                    reason: "the plan to replay could not be loaded".to_owned(),
                })?;
                tracing::info!(
                    batch = batch.0,
                    "replaying the planned but uncommitted batch with its recorded ranges"
                );
                let end = plan.end_offsets();
                let planned = Planned {
                    latest: end.clone(),
                    plan,
                    replay: true,
                    losses: Vec::new(),
                    durations: DurationMs::default(),
                    trigger_start: Instant::now(),
                    timestamp: SystemTime::now(),
                    sizing: None,
                };
                self.execute(planned, summary, on_progress).await?;
                (batch.next(), Some(end))
            }
        };
        Ok(Recovered {
            next_batch,
            start,
            last_watermark,
        })
    }

    /// Whether the trigger runs a batch over `reach` now: there is new data and
    /// `min_offsets_per_trigger` does not hold it back, or there is none but a
    /// watermark that moved since `last_watermark` closes state (a batch
    /// without data emits it, as Spark's no-data batches do).
    fn runs_now(&mut self, reach: &Reach, since_last_ms: u64, last_watermark: i64) -> bool {
        match reach.available() {
            0 => wants_batch_without_data(&mut self.processor, last_watermark),
            available => should_run_batch(
                available,
                self.options.min_offsets_per_trigger,
                since_last_ms,
            ),
        }
    }

    /// The plan of batch `id` over `reach`, under the trigger's rate limit, with
    /// the watermark the processor gives.
    fn plan(
        &mut self,
        id: BatchId,
        reach: Reach,
        losses: Vec<DataLoss>,
        trigger_start: Instant,
        timestamp: SystemTime,
    ) -> Result<Planned, QueryError<Src, Store, Proc, Snk, Dead>> {
        // Once is one batch of everything, as the user asked: neither a rate
        // limit nor a budget may leave the rest unread.
        let once = self.options.trigger == Trigger::Once;
        let available = reach.available();
        // Several sources each take their own limit first; the memory budget
        // then shares what they leave.
        let (reach, max_offsets) = match self.options.sources.as_slice() {
            [one] => (reach, one.max_offsets_per_trigger.filter(|_| !once)),
            _ if once => (reach, None),
            _ => {
                let reachable = self.source_limits(&reach.from, &reach.reachable);
                let capped = Reach { reachable, ..reach };
                (capped, None)
            }
        };
        let capped = reach.available() < available;
        let sizing = if once { None } else { self.memory_sizing() };
        let budget = match (max_offsets, sizing) {
            (Some(most), Some(sizing)) => Some(most.min(sizing.max_records)),
            (most, sizing) => most.or(sizing.map(|s| s.max_records)),
        };
        let sizing = sizing.map(|sizing| {
            let limited_by = if reach.available() <= budget.map_or(u64::MAX, NonZeroU64::get) {
                if capped {
                    "maxOffsetsPerTrigger"
                } else {
                    "available"
                }
            } else if max_offsets.is_some_and(|most| most <= sizing.max_records) {
                "maxOffsetsPerTrigger"
            } else {
                "memory"
            };
            (sizing, limited_by)
        });
        let end = reach.end(budget);
        let metadata = BatchMetadata {
            watermark_ms: next_watermark_ms(&mut self.processor),
            timestamp_ms: epoch_ms(timestamp),
            conf: event_time_conf(&mut self.processor),
        };
        let plan = self
            .with_sources(BatchPlan::from_offsets(id, &reach.from, &end, metadata))
            .map_err(|e| ExecutorError::Plan {
                batch: id.0,
                reason: e.to_string(),
            })?;
        Ok(Planned {
            plan,
            replay: false,
            latest: reach.latest,
            losses,
            durations: DurationMs::default(),
            trigger_start,
            timestamp,
            sizing,
        })
    }

    /// How the memory budget sizes the next batch of a stateful query, from
    /// the state its operators hold.
    fn memory_sizing(&mut self) -> Option<BatchSizing> {
        let budget = self.memory.as_ref()?;
        let operators = self.processor.stateful_operators();
        if operators.is_empty() {
            return None;
        }
        let state_bytes = operators.iter().map(|o| o.stats().memory_used_bytes).sum();
        Some(budget.plan(state_bytes))
    }

    /// Writes the plan (unless it is a replay), reads, hands the records to the
    /// sink, commits, and reports progress.
    async fn execute(
        &mut self,
        mut planned: Planned,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let batch = planned.plan.id();
        let span = tracing::info_span!("batch", id = batch.0);
        async {
            if planned.replay {
                // A replay's plan is already stored: nothing to write it with.
                // Boxed, as the other commit paths below: the nested batch
                // futures otherwise outgrow the compiler's type depth limit.
                Box::pin(self.settle_held(summary, on_progress)).await?;
            }
            self.in_batch = true;
            // The read starts while the plan is written, so that the source can
            // ready the batch's first records meanwhile. They wait for the
            // write-ahead: none reaches the processor or the sink before the plan
            // is durable. A read that fails to start is started again, with
            // retries, when the batch is streamed.
            let mut early = None;
            if !planned.replay {
                early = self.source.read(planned.plan.ranges()).await.ok();
            }
            let t = Instant::now();
            // A commit the store holds goes with this plan, in the same write.
            let previous = self.held.take();
            if !planned.replay {
                retrying!(self, Part::Store, "writing the plan", async {
                    self.store
                        .write_plan(&planned.plan)
                        .await
                        .map_err(ExecutorError::Store)
                })?;
            }
            planned.durations.wal_commit = micros(t.elapsed());
            let written = t.elapsed();
            if let Some(mut previous) = previous {
                previous.waited = previous.held_at.elapsed().saturating_sub(written);
                Box::pin(self.after_commit(previous, summary, on_progress)).await?;
            }
            // A plan write retried through an outage kept the early read from
            // handing anything over, which a source may judge a stalled read:
            // the read starts afresh instead, as it did before it started early.
            if written > EARLY_READ_PATIENCE {
                early = None;
            }

            let t = Instant::now();
            // A replayed batch that a two-phase sink already has needs only its
            // commit; a stateful one is processed all the same, for its state,
            // with nothing written.
            let delivered = planned.replay
                && retrying!(
                    self,
                    Part::Sink,
                    "asking the sink whether it has the replayed batch",
                    async {
                        self.sink
                            .delivered(batch, planned.plan.ranges())
                            .await
                            .map_err(ExecutorError::Sink)
                    }
                )?;
            let streamed = if delivered && !self.is_stateful() {
                tracing::info!(
                    batch = batch.0,
                    "the sink already has this batch; writing its commit only"
                );
                Streamed::default()
            } else {
                if delivered {
                    tracing::info!(
                        batch = batch.0,
                        "the sink already has this batch; rebuilding its state without writing"
                    );
                }
                self.stream(&planned.plan, &mut planned.durations, !delivered, early)
                    .await?
            };
            planned.durations.add_batch =
                micros(t.elapsed()).saturating_sub(planned.durations.get_batch);
            let ended = self.end_batch(planned, streamed).await?;
            if self.batches_follow_at_once() && self.store.hold_commit(&ended.commit) {
                self.held = Some(ended);
                return Ok(());
            }
            Box::pin(self.write_commit(ended, summary, on_progress)).await
        }
        .instrument(span)
        .await
    }

    /// Ends a batch whose output the sink has: writes its state and its commit,
    /// commits progress to the consumer group, purges old batches and reports
    /// progress.
    async fn commit_batch(
        &mut self,
        planned: Planned,
        streamed: Streamed,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let ended = self.end_batch(planned, streamed).await?;
        self.write_commit(ended, summary, on_progress).await
    }

    /// Writes a batch's state and hands its commit back, to be written alone
    /// or with the next batch's plan.
    async fn end_batch(
        &mut self,
        mut planned: Planned,
        mut streamed: Streamed,
    ) -> Result<EndedBatch, QueryError<Src, Store, Proc, Snk, Dead>> {
        let batch = planned.plan.id();
        planned.losses.append(&mut streamed.losses);
        let started = Instant::now();
        let state = self.write_state(batch).await?;
        let commit = BatchCommit {
            id: batch,
            next_watermark_ms: next_watermark_ms(&mut self.processor),
        };
        Ok(EndedBatch {
            planned,
            streamed,
            state,
            commit,
            started,
            held_at: Instant::now(),
            waited: Duration::ZERO,
        })
    }

    /// Whether the next batch, if there is data, starts at once, so that a
    /// store may hold a batch's commit to write it with the next plan
    /// ([`OffsetStore::hold_commit`]). Any other way on writes the commit alone.
    fn batches_follow_at_once(&self) -> bool {
        !self.recovery_only
            && match self.options.trigger {
                Trigger::AvailableNow => true,
                Trigger::ProcessingTime(interval) => interval.is_zero(),
                Trigger::Once | Trigger::Continuous(_) => false,
            }
    }

    /// Writes an ended batch's commit alone, then what follows it.
    async fn write_commit(
        &mut self,
        ended: EndedBatch,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        retrying!(self, Part::Store, "writing the commit", async {
            self.store
                .write_commit(&ended.commit)
                .await
                .map_err(ExecutorError::Store)
        })?;
        self.after_commit(ended, summary, on_progress).await?;
        self.in_batch = false;
        Ok(())
    }

    /// Has the store write the commit it holds for the next plan alone: no
    /// batch follows at once (the query is idle, stops, or failed while
    /// planning).
    async fn settle_held(
        &mut self,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let Some(ended) = self.held.take() else {
            return Ok(());
        };
        retrying!(self, Part::Store, "writing the commit", async {
            self.store.settle().await.map_err(ExecutorError::Store)
        })?;
        self.after_commit(ended, summary, on_progress).await?;
        self.in_batch = false;
        Ok(())
    }

    /// What follows a durable commit: snapshots, the consumer group's offsets,
    /// the purge of old batches and the progress report.
    async fn after_commit(
        &mut self,
        ended: EndedBatch,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let EndedBatch {
            mut planned,
            streamed,
            mut state,
            commit,
            started: t,
            waited,
            ..
        } = ended;
        let batch = commit.id;
        let rows = streamed.rows;
        if snapshot_due(batch) && self.is_stateful() {
            self.write_snapshots(batch, &mut state).await;
        }
        let end = planned.plan.end_offsets();
        if let Err(e) = self.source.commit_progress(&end).await {
            // Only lag monitors read the group's offsets; the store holds the truth.
            tracing::warn!(error = %e, "committing progress to the consumer group failed");
        }
        if let Some(keep_from) = purge_due(batch, self.options.min_batches_to_retain) {
            retrying!(self, Part::Store, "purging old batches", async {
                self.store
                    .purge(keep_from)
                    .await
                    .map_err(ExecutorError::Store)
            })?;
            self.purge_state(keep_from).await?;
        }
        planned.durations.commit_offsets = micros(t.elapsed().saturating_sub(waited));
        planned.durations.trigger_execution =
            micros(planned.trigger_start.elapsed().saturating_sub(waited));

        let mut progress = self.progress(
            &planned,
            rows,
            &end,
            streamed.output_rows,
            &streamed.by_source,
        );
        progress.state_operators = self.state_progress(&state);
        if let Some((sizing, limited_by)) = planned.sizing {
            let batch_bytes = progress
                .state_operators
                .iter()
                .map(|o| o.batch_memory_bytes)
                .sum();
            if let Some(memory) = &mut self.memory {
                memory.observe(rows, batch_bytes);
            }
            progress.memory = Some(MemoryProgress {
                budget_bytes: sizing.budget_bytes,
                state_bytes: sizing.state_bytes,
                bytes_per_record: sizing.bytes_per_record,
                measured: sizing.measured,
                max_records: sizing.max_records.get(),
                limited_by,
                batch_bytes,
            });
        }
        // The caller logs the report in the form its logs take.
        on_progress(&progress);
        summary.batches += 1;
        summary.records += rows;
        summary.bad_records += streamed.bad_records;
        summary.lost_offsets += planned
            .losses
            .iter()
            .map(DataLoss::lost_offsets)
            .sum::<u64>();
        summary.last_committed = Some(batch);
        Ok(())
    }

    /// A retry driver for a call to `part`, under the query's policy.
    fn driver(
        &self,
        part: Part,
        what: &'static str,
        in_batch: bool,
        retryable: fn(&QueryError<Src, Store, Proc, Snk, Dead>) -> bool,
    ) -> Driver<QueryError<Src, Store, Proc, Snk, Dead>> {
        let tries = Tries::new(self.options.retry, what, self.reached.get(part), in_batch);
        Driver::new(tries, self.stop.clone(), retryable)
    }

    /// What a driven call to `part` came to: its value, with the part marked as
    /// one that answered, or the error that ended it.
    fn driven<T>(
        &mut self,
        part: Part,
        what: &'static str,
        driver: &Driver<QueryError<Src, Store, Proc, Snk, Dead>>,
        outcome: Result<T, QueryFailed<Src, Store, Proc, Snk, Dead>>,
    ) -> Result<T, QueryError<Src, Store, Proc, Snk, Dead>> {
        let tries = driver.tries();
        match outcome {
            Ok(value) => {
                self.reached.mark(part);
                Ok(value)
            }
            Err(Failed::Error { error, why: None }) => Err(error),
            Err(Failed::Error {
                error,
                why: Some(why),
            }) => Err(gave_up(tries, why, Some(error))),
            Err(Failed::TimedOut { last }) => Err(gave_up(tries, tries.timed_out(), last)),
            Err(Failed::Stopped) => Err(ExecutorError::Stopped { what }),
        }
    }

    /// Whether an error may go away by itself, as the part it came from judges
    /// it.
    fn transient(error: &QueryError<Src, Store, Proc, Snk, Dead>) -> bool {
        match error {
            ExecutorError::Source(e) => Src::is_transient(e),
            ExecutorError::Store(e) => {
                <Store as OffsetStore>::is_transient(e) || <Store as StateStore>::is_transient(e)
            }
            ExecutorError::Sink(e) => Snk::is_transient(e),
            ExecutorError::Process(e) => Proc::is_transient(e),
            _ => false,
        }
    }

    /// Fences every earlier writer of the sink ([`Sink::take_over`]).
    async fn take_over_sink(&mut self) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        retrying!(self, Part::Sink, "taking over the sink", async {
            self.sink.take_over().await.map_err(ExecutorError::Sink)
        })
    }

    /// Confirms after a take-over that the store still names this runner, so
    /// that a runner that lost the query meanwhile stops before it writes
    /// anything ([`OffsetStore::check_claim`]).
    async fn confirm_claim(&mut self) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        retrying!(
            self,
            Part::Store,
            "confirming that this runner holds the query",
            async { self.store.check_claim().await.map_err(ExecutorError::Store) }
        )
    }

    /// The source's partitions with their low and high offsets, looked up again
    /// under the retry policy while the source fails transiently.
    async fn discover(
        &mut self,
    ) -> Result<BTreeMap<TopicPartition, OffsetBounds>, QueryError<Src, Store, Proc, Snk, Dead>>
    {
        retrying!(self, Part::Source, "discovering partitions", async {
            self.source
                .partitions()
                .await
                .map_err(ExecutorError::Source)
        })
    }

    /// Where a query with nothing committed starts on `partitions`, from its
    /// `starting` option.
    async fn starting_offsets(
        &mut self,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    ) -> Result<PartitionOffsets, QueryError<Src, Store, Proc, Snk, Dead>> {
        let mut starts = PartitionOffsets::new();
        for (index, options) in self.options.sources.clone().iter().enumerate() {
            let several = self.options.sources.len() > 1;
            let mine: BTreeMap<TopicPartition, OffsetBounds> = partitions
                .iter()
                .filter(|(tp, _)| !several || self.source.source_of(&tp.topic) == Some(index))
                .map(|(tp, bounds)| (tp.clone(), *bounds))
                .collect();
            if several && mine.is_empty() {
                continue;
            }
            let resolved = retrying!(self, Part::Source, "resolving starting offsets", async {
                self.source
                    .starting_offsets(&options.starting, &mine)
                    .await
                    .map_err(ExecutorError::Source)
            })?;
            starts.extend(resolved);
        }
        Ok(starts)
    }

    fn progress(
        &mut self,
        planned: &Planned,
        rows: u64,
        end: &PartitionOffsets,
        output_rows: u64,
        by_source: &[(u64, u64)],
    ) -> QueryProgress {
        let execution = planned.durations.trigger_execution.max(1) as f64 / 1_000_000.0;
        let since_last = self
            .last_trigger
            .map(|t| planned.trigger_start.duration_since(t).as_secs_f64())
            .filter(|s| *s > 0.0);
        self.last_trigger = Some(planned.trigger_start);
        let input_rate = since_last.map_or(0.0, |s| rows as f64 / s);
        let processed_rate = rows as f64 / execution;
        QueryProgress {
            id: self.query_id.clone(),
            run_id: self.run_id.clone(),
            name: self.options.name.clone(),
            timestamp: humantime::format_rfc3339_millis(planned.timestamp).to_string(),
            batch_id: planned.plan.id().0,
            num_input_rows: rows,
            input_rows_per_second: input_rate,
            processed_rows_per_second: processed_rate,
            duration_ms: planned.durations.to_millis(),
            duration_micros: planned.durations.clone(),
            event_time: self
                .processor
                .event_time()
                .map(|clock| event_time_entry(&clock.stats())),
            state_operators: Vec::new(),
            memory: None,
            lookup_tables: self
                .processor
                .lookup_tables()
                .into_iter()
                .map(LookupTableProgress::from)
                .collect(),
            sources: self.source_progress(planned, end, since_last, execution, by_source),
            sink: SinkProgress {
                description: self.options.sink_description.clone(),
                num_output_rows: output_rows,
                metrics: self.sink.metrics(),
            },
            group: self.options.group.clone(),
        }
    }
}

/// Waits for the next trigger; `idle` is how long a `ProcessingTime(0)` query
/// that found nothing to do waits. Returns true when the query should stop.
async fn wait_for_next_trigger(
    trigger: Trigger,
    trigger_start: Instant,
    idle: Option<Duration>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let wait = match trigger {
        // An epoch waits for records as a zero interval does.
        Trigger::Continuous(_) => match idle {
            Some(wait) => wait,
            None => return *stop.borrow(),
        },
        Trigger::ProcessingTime(interval) if interval.is_zero() => match idle {
            Some(wait) => wait,
            None => return *stop.borrow(),
        },
        Trigger::ProcessingTime(interval) => interval.saturating_sub(trigger_start.elapsed()),
        // Catching up runs batches back to back.
        Trigger::AvailableNow | Trigger::Once => return *stop.borrow(),
    };
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if *stop.borrow() {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => return *stop.borrow(),
            changed = stop.changed() => {
                if changed.is_err() {
                    // Nobody can ask for a stop any more: just wait.
                    tokio::time::sleep_until(deadline).await;
                    return false;
                }
            }
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn epoch_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_waits_double_from_a_millisecond_to_the_polling_delay() {
        let mut idle = IdleBackoff::new(Duration::from_millis(10));
        let waits: Vec<u128> = (0..6).map(|_| idle.next_wait().as_millis()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 10, 10]);
    }

    #[test]
    fn a_batch_makes_the_next_idle_wait_short_again() {
        let mut idle = IdleBackoff::new(DEFAULT_POLLING_DELAY);
        for _ in 0..20 {
            idle.next_wait();
        }
        assert_eq!(idle.next_wait(), DEFAULT_POLLING_DELAY);
        idle.reset();
        assert_eq!(idle.next_wait(), FIRST_IDLE_WAIT);
    }

    #[test]
    fn a_polling_delay_below_the_first_wait_is_the_only_wait() {
        let mut idle = IdleBackoff::new(Duration::from_micros(300));
        assert_eq!(idle.next_wait(), Duration::from_micros(300));
        assert_eq!(idle.next_wait(), Duration::from_micros(300));
    }
}
