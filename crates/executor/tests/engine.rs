//! The batch loop against in-memory implementations of the source, store and
//! sink traits: recovery, triggers, rate limits, data loss and progress.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_core::{
    BatchCommit, BatchId, BatchPlan, BatchReader, DataLoss, EventTime, Log, Offset, OffsetBounds,
    OffsetRange, OffsetStore, PartitionOffsets, Record, RecordChunk, Sink, Source, StartingOffsets,
    StateFile, StateFileId, StateFileKind, StateStore, StatefulOperator, StoredBatches,
    TimestampType, TopicPartition, Writes,
};
use sluice_executor::{
    ExecutorError, GaveUp, Query, QueryOptions, QueryProgress, Retried, RetryPolicy, SourceOptions,
    Trigger,
};
use tokio::sync::watch;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TestError(String);

/// A source failure that a retry may cure.
const TRANSIENT: &str = "broker unavailable";

/// A sink failure that a retry may cure.
const SINK_UNAVAILABLE: &str = "sink unavailable";

/// A part that another runner fenced.
const FENCED: &str = "fenced by another runner";

/// A log per partition: offsets [low, high) hold records valued "<p>-<offset>".
#[derive(Clone, Default)]
struct MemSource {
    logs: Arc<Mutex<BTreeMap<TopicPartition, (i64, i64)>>>,
    /// Failures the next `partitions` calls return, first to last.
    failures: Arc<Mutex<Vec<&'static str>>>,
    calls: Arc<Mutex<u32>>,
    /// Failures that the next reads meet after their first chunk, first to last.
    read_failures: Arc<Mutex<Vec<&'static str>>>,
    /// How long a failing `partitions` call takes to fail.
    failure_delay: Arc<Mutex<Duration>>,
    /// How many reads were opened.
    reads: Arc<Mutex<u32>>,
    /// From this `partitions` call on (1 is the first), every call fails so.
    fail_from_call: Arc<Mutex<Option<(u32, &'static str)>>>,
    /// How long a `partitions` call that succeeds takes.
    discovery_delay: Arc<Mutex<Duration>>,
}

/// Records per chunk of the in-memory source.
const CHUNK: usize = 3;

/// The chunks of one read, last first; an `Err` is a failure part way.
struct MemReader {
    chunks: Vec<Result<RecordChunk, TestError>>,
}

impl BatchReader for MemReader {
    type Error = TestError;

    async fn next_chunk(&mut self) -> Result<Option<RecordChunk>, TestError> {
        self.chunks.pop().transpose()
    }

    fn data_loss(&self) -> &[DataLoss] {
        &[]
    }
}

impl MemSource {
    fn with(partitions: &[(i32, i64)]) -> Self {
        let source = MemSource::default();
        for (p, count) in partitions {
            source.logs.lock().unwrap().insert(tp(*p), (0, *count));
        }
        source
    }

    fn append(&self, partition: i32, count: i64) {
        self.logs.lock().unwrap().get_mut(&tp(partition)).unwrap().1 += count;
    }

    fn purge_before(&self, partition: i32, offset: i64) {
        self.logs.lock().unwrap().get_mut(&tp(partition)).unwrap().0 = offset;
    }
}

impl Source for MemSource {
    type Error = TestError;
    type Reader = MemReader;

    fn is_transient(error: &TestError) -> bool {
        error.0 == TRANSIENT
    }

    async fn partitions(&mut self) -> Result<BTreeMap<TopicPartition, OffsetBounds>, TestError> {
        *self.calls.lock().unwrap() += 1;
        if let Some((from, message)) = *self.fail_from_call.lock().unwrap()
            && *self.calls.lock().unwrap() >= from
        {
            return Err(TestError(message.to_owned()));
        }
        let failure = {
            let mut failures = self.failures.lock().unwrap();
            (!failures.is_empty()).then(|| failures.remove(0))
        };
        if let Some(message) = failure {
            let delay = *self.failure_delay.lock().unwrap();
            tokio::time::sleep(delay).await;
            return Err(TestError(message.to_owned()));
        }
        let delay = *self.discovery_delay.lock().unwrap();
        tokio::time::sleep(delay).await;
        Ok(self
            .logs
            .lock()
            .unwrap()
            .iter()
            .map(|(tp, (low, high))| {
                (
                    tp.clone(),
                    OffsetBounds {
                        low: off(*low),
                        high: off(*high),
                    },
                )
            })
            .collect())
    }

    async fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    ) -> Result<PartitionOffsets, TestError> {
        Ok(partitions
            .iter()
            .map(|(tp, w)| {
                let at = match starting {
                    StartingOffsets::Latest => w.high,
                    _ => w.low,
                };
                (tp.clone(), at)
            })
            .collect())
    }

    async fn read(&mut self, ranges: &[OffsetRange]) -> Result<MemReader, TestError> {
        *self.reads.lock().unwrap() += 1;
        let logs = self.logs.lock().unwrap();
        let mut records = Vec::new();
        for range in ranges {
            let (low, _) = logs[&range.topic_partition];
            if range.from.value() < low {
                return Err(TestError(format!("{} purged", range.topic_partition)));
            }
            records.extend((range.from.value()..range.until.value()).map(|o| Record {
                topic: range.topic_partition.topic.clone(),
                partition: range.topic_partition.partition,
                offset: off(o),
                timestamp_ms: Some(o),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: Some(format!("{}-{o}", range.topic_partition.partition).into_bytes()),
                headers: Vec::new(),
            }));
        }
        // Small chunks, so that every batch of more than a few records streams.
        let mut chunks: Vec<Result<RecordChunk, TestError>> = records
            .chunks(CHUNK)
            .map(|part| {
                let mut chunk = RecordChunk::default();
                part.iter().for_each(|r| chunk.push_record(r));
                Ok(chunk)
            })
            .collect();
        let failure = {
            let mut failures = self.read_failures.lock().unwrap();
            (!failures.is_empty()).then(|| failures.remove(0))
        };
        if let Some(message) = failure {
            chunks.insert(chunks.len().min(1), Err(TestError(message.to_owned())));
        }
        chunks.reverse();
        Ok(MemReader { chunks })
    }

    async fn commit_progress(&mut self, _: &PartitionOffsets) -> Result<(), TestError> {
        Ok(())
    }
}

/// A state file's key in [`MemStore`].
type StateKey = (u32, u32, BatchId, StateFileKind);

#[derive(Clone, Default)]
struct MemStore {
    plans: Arc<Mutex<BTreeMap<BatchId, BatchPlan>>>,
    commits: Arc<Mutex<BTreeMap<BatchId, BatchCommit>>>,
    state: Arc<Mutex<BTreeMap<StateKey, Vec<u8>>>>,
    /// Refuse every snapshot, as a full or failing disk would.
    refuse_snapshots: Arc<std::sync::atomic::AtomicBool>,
    /// Another runner claimed the query: the claim check fails.
    claim_lost: Arc<std::sync::atomic::AtomicBool>,
    /// How long writing a plan takes.
    plan_delay: Arc<Mutex<Duration>>,
    /// Whether a commit is written with the next plan, as the Cassandra store does.
    joins: bool,
    /// The commit it holds for the next plan.
    held: Arc<Mutex<Option<BatchCommit>>>,
    /// The plan and commit writes, in order: "plan 0", "commit 0 + plan 1", "commit 1".
    writes: Arc<Mutex<Vec<String>>>,
}

impl MemStore {
    fn joining() -> Self {
        MemStore {
            joins: true,
            ..MemStore::default()
        }
    }

    fn writes(&self) -> Vec<String> {
        self.writes.lock().unwrap().clone()
    }

    fn insert_plan(&self, plan: &BatchPlan) -> Result<(), TestError> {
        let mut plans = self.plans.lock().unwrap();
        if plans.contains_key(&plan.id()) {
            return Err(TestError(format!("plan {} exists", plan.id())));
        }
        plans.insert(plan.id(), plan.clone());
        Ok(())
    }
}

impl OffsetStore for MemStore {
    type Error = TestError;

    async fn check_claim(&mut self) -> Result<(), TestError> {
        if self.claim_lost.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(TestError(FENCED.to_owned()));
        }
        Ok(())
    }

    async fn load(&mut self) -> Result<StoredBatches, TestError> {
        let plans = self.plans.lock().unwrap();
        let commits = self.commits.lock().unwrap();
        Ok(StoredBatches {
            planned: plans.keys().copied().collect(),
            committed: commits.keys().copied().collect(),
            latest_plan: plans.values().last().cloned(),
            latest_commit: commits.values().last().cloned(),
            initial_offsets: None,
        })
    }

    async fn write_plan(&mut self, plan: &BatchPlan) -> Result<(), TestError> {
        let delay = *self.plan_delay.lock().unwrap();
        tokio::time::sleep(delay).await;
        if let Some(commit) = self.held.lock().unwrap().take() {
            assert!(
                self.plans.lock().unwrap().contains_key(&commit.id),
                "a commit follows its plan"
            );
            self.insert_plan(plan)?;
            self.commits
                .lock()
                .unwrap()
                .insert(commit.id, commit.clone());
            self.writes
                .lock()
                .unwrap()
                .push(format!("commit {} + plan {}", commit.id, plan.id()));
            return Ok(());
        }
        self.insert_plan(plan)?;
        self.writes
            .lock()
            .unwrap()
            .push(format!("plan {}", plan.id()));
        Ok(())
    }

    async fn write_commit(&mut self, commit: &BatchCommit) -> Result<(), TestError> {
        self.commits
            .lock()
            .unwrap()
            .insert(commit.id, commit.clone());
        self.writes
            .lock()
            .unwrap()
            .push(format!("commit {}", commit.id));
        Ok(())
    }

    fn hold_commit(&mut self, commit: &BatchCommit) -> bool {
        if self.joins {
            *self.held.lock().unwrap() = Some(commit.clone());
        }
        self.joins
    }

    async fn settle(&mut self) -> Result<(), TestError> {
        let held = self.held.lock().unwrap().take();
        match held {
            Some(commit) => self.write_commit(&commit).await,
            None => Ok(()),
        }
    }

    async fn purge(&mut self, keep_from: BatchId) -> Result<(), TestError> {
        self.plans.lock().unwrap().retain(|id, _| *id >= keep_from);
        self.commits
            .lock()
            .unwrap()
            .retain(|id, _| *id >= keep_from);
        Ok(())
    }

    fn describe(&self, log: Log, batch: BatchId) -> String {
        format!("{log} {batch}")
    }
}

impl StateStore for MemStore {
    type Error = TestError;

    async fn write_state(&mut self, file: &StateFile) -> Result<(), TestError> {
        if file.kind == StateFileKind::Snapshot
            && self
                .refuse_snapshots
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(TestError("no space left for a snapshot".into()));
        }
        self.state
            .lock()
            .unwrap()
            .entry((file.operator, file.partition, file.version, file.kind))
            .or_insert_with(|| file.bytes.clone());
        Ok(())
    }

    async fn list_state(&mut self, operator: u32) -> Result<Vec<StateFileId>, TestError> {
        Ok(self
            .state
            .lock()
            .unwrap()
            .keys()
            .filter(|k| k.0 == operator)
            .map(|k| StateFileId {
                partition: k.1,
                version: k.2,
                kind: k.3,
            })
            .collect())
    }

    async fn read_state(
        &mut self,
        operator: u32,
        file: StateFileId,
    ) -> Result<StateFile, TestError> {
        let location = self.describe_state(operator, file);
        let bytes = self
            .state
            .lock()
            .unwrap()
            .get(&(operator, file.partition, file.version, file.kind))
            .cloned()
            .ok_or_else(|| TestError(format!("no {location}")))?;
        Ok(StateFile {
            operator,
            partition: file.partition,
            version: file.version,
            kind: file.kind,
            bytes,
            location,
        })
    }

    async fn remove_state(
        &mut self,
        operator: u32,
        files: &[StateFileId],
    ) -> Result<(), TestError> {
        let mut state = self.state.lock().unwrap();
        for f in files {
            state.remove(&(operator, f.partition, f.version, f.kind));
        }
        Ok(())
    }

    fn describe_state(&self, operator: u32, file: StateFileId) -> String {
        format!(
            "state {operator} {} {} {:?}",
            file.partition, file.version, file.kind
        )
    }
}

/// One delivered batch: its id, its ranges and its record values.
type Delivered = (BatchId, Vec<OffsetRange>, Vec<String>);

/// Collects what it is given; can be told to fail on one batch.
#[derive(Clone, Default)]
struct MemSink {
    batches: Arc<Mutex<Vec<Delivered>>>,
    /// The batch begun last and what it received so far.
    open: Option<Delivered>,
    /// How many times a batch was begun, restarts included.
    begins: Arc<Mutex<u32>>,
    fail_on: Option<BatchId>,
    /// How many of the next begins fail as an unavailable sink does.
    transient_failures: Arc<Mutex<u32>>,
    /// Values handed to `write`, in every batch and attempt.
    written: Arc<Mutex<u64>>,
    /// The store's plans, when the sink is to check that a batch's records
    /// come only once its plan is written.
    plans: Option<Arc<Mutex<BTreeMap<BatchId, BatchPlan>>>>,
}

impl MemSink {
    fn values(&self) -> Vec<String> {
        self.batches
            .lock()
            .unwrap()
            .iter()
            .flat_map(|b| b.2.clone())
            .collect()
    }
}

impl Sink for MemSink {
    type Error = TestError;

    fn is_transient(error: &TestError) -> bool {
        error.0 == SINK_UNAVAILABLE
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), TestError> {
        if self.fail_on == Some(batch) {
            return Err(TestError(format!("sink down at batch {batch}")));
        }
        {
            let mut failures = self.transient_failures.lock().unwrap();
            if *failures > 0 {
                *failures -= 1;
                return Err(TestError(SINK_UNAVAILABLE.to_owned()));
            }
        }
        *self.begins.lock().unwrap() += 1;
        self.open = Some((batch, ranges.to_vec(), Vec::new()));
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), TestError> {
        let open = self
            .open
            .take()
            .filter(|o| o.0 == batch)
            .ok_or_else(|| TestError(format!("batch {batch} ends without having begun")))?;
        self.batches.lock().unwrap().push(open);
        Ok(())
    }
}

impl Writes for MemSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), TestError> {
        let open = self
            .open
            .as_mut()
            .ok_or_else(|| TestError("records outside a batch".to_owned()))?;
        if let Some(plans) = &self.plans
            && !plans.lock().unwrap().contains_key(&open.0)
        {
            return Err(TestError(format!(
                "records of batch {} before its plan was written",
                open.0
            )));
        }
        open.2.extend(
            records
                .iter()
                .map(|r| String::from_utf8(r.value().unwrap().to_vec()).unwrap()),
        );
        *self.written.lock().unwrap() += records.len() as u64;
        Ok(())
    }
}

fn tp(p: i32) -> TopicPartition {
    TopicPartition::new("events", p)
}

fn off(v: i64) -> Offset {
    Offset::new(v).unwrap()
}

fn options(trigger: Trigger, max: Option<u64>) -> QueryOptions {
    QueryOptions {
        trigger,
        sources: vec![SourceOptions {
            starting: StartingOffsets::Earliest,
            max_offsets_per_trigger: max.and_then(std::num::NonZeroU64::new),
            ..SourceOptions::default()
        }],
        ..QueryOptions::default()
    }
}

fn never_stop() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    std::mem::forget(tx);
    rx
}

fn all_values(partitions: &[(i32, i64)]) -> Vec<String> {
    let mut values: Vec<String> = partitions
        .iter()
        .flat_map(|(p, n)| (0..*n).map(move |o| format!("{p}-{o}")))
        .collect();
    values.sort();
    values
}

fn sorted(mut values: Vec<String>) -> Vec<String> {
    values.sort();
    values
}

#[tokio::test]
async fn available_now_reads_everything_in_rate_limited_batches_then_stops() {
    let source = MemSource::with(&[(0, 100), (1, 50), (2, 0), (3, 30)]);
    let (store, sink) = (MemStore::default(), MemSink::default());
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(40)),
        "q".into(),
        source.clone(),
        store.clone(),
        sink.clone(),
    );
    let mut progress = Vec::new();
    let summary = query
        .run(never_stop(), |p: &QueryProgress| progress.push(p.clone()))
        .await
        .unwrap();

    assert_eq!(summary.records, 180);
    assert_eq!(summary.batches, 5, "180 offsets at 40 per batch");
    assert_eq!(
        sorted(sink.values()),
        all_values(&[(0, 100), (1, 50), (3, 30)])
    );
    assert!(progress.iter().all(|p| p.num_input_rows <= 40));
    assert_eq!(store.commits.lock().unwrap().len(), 5);
    assert_eq!(
        *source.calls.lock().unwrap(),
        1,
        "as in Spark, the partitions and their ends are looked up once per run"
    );

    // Nothing new: a second run plans nothing.
    let mut again = Query::new(
        options(Trigger::AvailableNow, Some(40)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    let summary = again.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.batches, 0);
    assert_eq!(
        store.plans.lock().unwrap().len(),
        5,
        "no plan without new data"
    );
}

#[tokio::test]
async fn a_batch_held_for_the_next_plan_does_not_count_the_wait_in_its_duration() {
    // Back to back at processing_time 0, each batch discovers the offsets
    // anew, for 100 ms, while the previous batch's commit waits for its plan:
    // that wait is the next batch's latestOffset, not the held batch's.
    let source = MemSource::with(&[(0, 60), (1, 30)]);
    *source.discovery_delay.lock().unwrap() = Duration::from_millis(100);
    let store = MemStore::joining();
    let mut query = Query::new(
        options(Trigger::ProcessingTime(Duration::ZERO), Some(30)),
        "q".into(),
        source,
        store.clone(),
        MemSink::default(),
    );
    let (stop_tx, stop) = watch::channel(false);
    let mut progress = Vec::new();
    query
        .run(stop, |p: &QueryProgress| {
            progress.push(p.clone());
            if p.batch_id == 2 {
                let _ = stop_tx.send(true);
            }
        })
        .await
        .unwrap();
    assert_eq!(
        store.writes(),
        [
            "plan 0",
            "commit 0 + plan 1",
            "commit 1 + plan 2",
            "commit 2"
        ]
    );
    assert_eq!(progress.len(), 3);
    for p in &progress {
        let d = &p.duration_micros;
        assert!(
            d.latest_offset >= 100_000,
            "each discovery took 100 ms: {d:?}"
        );
        let phases = d.latest_offset + d.wal_commit + d.add_batch + d.commit_offsets;
        assert!(
            d.trigger_execution <= phases + 50_000,
            "batch {}: {d:?}",
            p.batch_id
        );
    }
}

#[tokio::test]
async fn a_store_that_joins_them_writes_each_commit_with_the_next_plan() {
    let source = MemSource::with(&[(0, 60), (1, 30)]);
    let (store, sink) = (MemStore::joining(), MemSink::default());
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(30)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    let mut progress = Vec::new();
    let summary = query
        .run(never_stop(), |p: &QueryProgress| progress.push(p.clone()))
        .await
        .unwrap();

    assert_eq!(summary.batches, 3);
    assert_eq!(
        store.writes(),
        [
            "plan 0",
            "commit 0 + plan 1",
            "commit 1 + plan 2",
            "commit 2"
        ],
        "the last commit, with no batch after it, is written alone"
    );
    assert_eq!(sorted(sink.values()), all_values(&[(0, 60), (1, 30)]));
    assert_eq!(
        progress.iter().map(|p| p.batch_id).collect::<Vec<_>>(),
        [0, 1, 2],
        "each batch is reported once its commit is durable"
    );
    // A batch's phases do not count the time its commit waited for the next plan.
    for p in &progress {
        let d = &p.duration_micros;
        let phases = d.latest_offset + d.wal_commit + d.add_batch + d.commit_offsets;
        assert!(
            d.trigger_execution >= d.commit_offsets && d.trigger_execution <= phases + 50_000,
            "{d:?}"
        );
    }

    // Batches with a wait between them commit each alone, at once.
    let source = MemSource::with(&[(0, 20)]);
    let store = MemStore::joining();
    let mut paced = Query::new(
        options(Trigger::ProcessingTime(Duration::from_millis(5)), Some(10)),
        "q".into(),
        source,
        store.clone(),
        MemSink::default(),
    );
    let (tx, rx) = watch::channel(false);
    let mut seen = 0;
    paced
        .run(rx, |_| {
            seen += 1;
            if seen == 2 {
                tx.send(true).unwrap();
            }
        })
        .await
        .unwrap();
    assert_eq!(store.writes(), ["plan 0", "commit 0", "plan 1", "commit 1"]);
}

#[tokio::test]
async fn a_commit_held_for_the_next_plan_is_written_when_the_query_idles_or_planning_fails() {
    // Idle: nothing more to read, so the held commit is written before the wait,
    // and only then is the batch reported.
    let source = MemSource::with(&[(0, 10)]);
    let store = MemStore::joining();
    let mut query = Query::new(
        options(Trigger::ProcessingTime(Duration::ZERO), None),
        "q".into(),
        source.clone(),
        store.clone(),
        MemSink::default(),
    );
    let (tx, rx) = watch::channel(false);
    let summary = tokio::time::timeout(
        Duration::from_secs(10),
        query.run(rx, |_| tx.send(true).unwrap()),
    )
    .await
    .expect("the batch is reported while the query idles")
    .unwrap();
    assert_eq!(summary.batches, 1);
    assert_eq!(store.writes(), ["plan 0", "commit 0"]);

    // Planning fails: the batch before reached its sink, so its commit is
    // written all the same, and the error is the planning's.
    source.append(0, 10);
    *source.fail_from_call.lock().unwrap() =
        Some((*source.calls.lock().unwrap() + 2, "metadata refused"));
    let mut query = Query::new(
        options(Trigger::ProcessingTime(Duration::ZERO), None),
        "q".into(),
        source,
        store.clone(),
        MemSink::default(),
    );
    let mut reported = Vec::new();
    let err = query
        .run(never_stop(), |p: &QueryProgress| reported.push(p.batch_id))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("metadata refused"), "{err}");
    assert_eq!(
        store.writes(),
        ["plan 0", "commit 0", "plan 1", "commit 1"],
        "batch 1's commit is not lost with the failed plan of batch 2"
    );
    assert_eq!(reported, [1]);
}

#[tokio::test]
async fn a_read_opens_while_its_plan_is_written_and_afresh_after_a_slow_write() {
    for (delay, reads) in [(Duration::ZERO, 1), (Duration::from_millis(1200), 2)] {
        let source = MemSource::with(&[(0, 10), (1, 5)]);
        let store = MemStore::default();
        *store.plan_delay.lock().unwrap() = delay;
        let sink = MemSink {
            plans: Some(store.plans.clone()),
            ..MemSink::default()
        };
        let mut query = Query::new(
            options(Trigger::Once, None),
            "q".into(),
            source.clone(),
            store.clone(),
            sink.clone(),
        );
        let summary = query.run(never_stop(), |_| {}).await.unwrap();
        assert_eq!(summary.records, 15);
        assert_eq!(sorted(sink.values()), all_values(&[(0, 10), (1, 5)]));
        assert_eq!(
            *source.reads.lock().unwrap(),
            reads,
            "a plan written in {delay:?}: the early read is kept, or opened again after a write \
             longer than a second"
        );
    }
}

#[tokio::test]
async fn replays_an_uncommitted_batch_with_the_same_id_and_ranges() {
    let source = MemSource::with(&[(0, 30), (1, 30)]);
    let store = MemStore::default();
    let failing = MemSink {
        fail_on: Some(BatchId(1)),
        ..MemSink::default()
    };
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(20)),
        "q".into(),
        source.clone(),
        store.clone(),
        failing.clone(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(matches!(err, ExecutorError::Sink(_)), "{err}");
    let planned = store.plans.lock().unwrap()[&BatchId(1)].clone();
    assert!(!store.commits.lock().unwrap().contains_key(&BatchId(1)));

    // More data arrives before the restart; the replay must not take any of it.
    source.append(0, 10);
    let sink = MemSink::default();
    let mut restarted = Query::new(
        options(Trigger::AvailableNow, Some(20)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    restarted.run(never_stop(), |_| {}).await.unwrap();
    let first = sink.batches.lock().unwrap()[0].clone();
    assert_eq!(first.0, BatchId(1));
    assert_eq!(
        first.1,
        planned.ranges().to_vec(),
        "identical ranges on replay"
    );
    let mut everything = failing.values();
    everything.extend(sink.values());
    assert_eq!(
        sorted(everything),
        all_values(&[(0, 40), (1, 30)]),
        "each record exactly once"
    );
}

#[tokio::test]
async fn once_reads_everything_in_one_batch_ignoring_the_rate_limit() {
    let source = MemSource::with(&[(0, 100), (1, 100)]);
    let sink = MemSink::default();
    let mut query = Query::new(
        options(Trigger::Once, Some(10)),
        "q".into(),
        source,
        MemStore::default(),
        sink.clone(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!((summary.batches, summary.records), (1, 200));
}

#[tokio::test]
async fn processing_time_runs_new_data_as_it_arrives_and_stops_on_request() {
    let source = MemSource::with(&[(0, 5)]);
    let store = MemStore::default();
    let sink = MemSink::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut query = Query::new(
        options(
            Trigger::ProcessingTime(std::time::Duration::from_millis(20)),
            None,
        ),
        "q".into(),
        source.clone(),
        store.clone(),
        sink.clone(),
    );
    let feeder = {
        let source = source.clone();
        let sink = sink.clone();
        tokio::spawn(async move {
            while sink.values().len() < 5 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            source.append(0, 7);
            while sink.values().len() < 12 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            // Idle triggers with no data must not plan anything.
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            stop_tx.send(true).unwrap();
        })
    };
    let summary = query.run(stop_rx, |_| {}).await.unwrap();
    feeder.await.unwrap();
    assert_eq!(summary.records, 12);
    assert_eq!(summary.batches, 2);
    assert_eq!(store.plans.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn old_batches_are_purged_in_bulk_keeping_at_least_the_retention() {
    // 38 batches of one record, 10 retained: purges come when the oldest batch
    // to keep is a multiple of 3, the last after batch 36 (keeping 27 on).
    let source = MemSource::with(&[(0, 38)]);
    let store = MemStore::default();
    let mut query = Query::new(
        QueryOptions {
            min_batches_to_retain: 10,
            ..options(Trigger::AvailableNow, Some(1))
        },
        "q".into(),
        source.clone(),
        store.clone(),
        MemSink::default(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.batches, 38);
    let plans: Vec<u64> = store.plans.lock().unwrap().keys().map(|b| b.0).collect();
    let commits: Vec<u64> = store.commits.lock().unwrap().keys().map(|b| b.0).collect();
    assert_eq!(plans, (27..38).collect::<Vec<_>>());
    assert_eq!(commits, plans);

    // A restart goes on from there, and the next due purge takes what is old.
    source.logs.lock().unwrap().insert(tp(0), (0, 40));
    let mut query = Query::new(
        QueryOptions {
            min_batches_to_retain: 10,
            ..options(Trigger::AvailableNow, Some(1))
        },
        "q".into(),
        source,
        store.clone(),
        MemSink::default(),
    );
    assert_eq!(query.run(never_stop(), |_| {}).await.unwrap().batches, 2);
    let plans: Vec<u64> = store.plans.lock().unwrap().keys().map(|b| b.0).collect();
    assert_eq!(plans, (30..40).collect::<Vec<_>>(), "purged after batch 39");
}

#[tokio::test]
async fn purged_offsets_stop_the_query_or_are_skipped_and_counted() {
    let source = MemSource::with(&[(0, 10)]);
    let store = MemStore::default();
    let mut query = Query::new(
        options(Trigger::AvailableNow, None),
        "q".into(),
        source.clone(),
        store.clone(),
        MemSink::default(),
    );
    query.run(never_stop(), |_| {}).await.unwrap();
    source.append(0, 20);
    source.purge_before(0, 25);

    let mut strict = Query::new(
        options(Trigger::AvailableNow, None),
        "q".into(),
        source.clone(),
        store.clone(),
        MemSink::default(),
    );
    let err = strict.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("events-0: offsets [10, 25) are lost"),
        "{err}"
    );
    assert_eq!(
        store.plans.lock().unwrap().len(),
        1,
        "nothing planned past the loss"
    );

    let mut tolerant_options = options(Trigger::AvailableNow, None);
    tolerant_options.fail_on_data_loss = false;
    let sink = MemSink::default();
    let mut tolerant = Query::new(tolerant_options, "q".into(), source, store, sink.clone());
    let mut progress = Vec::new();
    let summary = tolerant
        .run(never_stop(), |p: &QueryProgress| progress.push(p.clone()))
        .await
        .unwrap();
    assert_eq!(summary.lost_offsets, 15);
    assert_eq!(
        sink.values(),
        (25..30).map(|o| format!("0-{o}")).collect::<Vec<_>>()
    );
    assert_eq!(progress[0].sources[0].metrics["dataLossOffsets"], "15");
}

#[tokio::test]
async fn an_inconsistent_store_is_refused_naming_the_entries() {
    let store = MemStore::default();
    store.commits.lock().unwrap().insert(
        BatchId(0),
        BatchCommit {
            id: BatchId(0),
            next_watermark_ms: 0,
        },
    );
    let mut query = Query::new(
        options(Trigger::Once, None),
        "q".into(),
        MemSource::with(&[(0, 1)]),
        store,
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "the offset store is inconsistent: batch 0 has a commit but no plan; look at commit 0"
    );
}

#[tokio::test]
async fn progress_has_sparks_fields() {
    let source = MemSource::with(&[(0, 10), (1, 4)]);
    let mut opts = options(Trigger::AvailableNow, Some(8));
    opts.name = Some("orders".into());
    opts.source().description = "KafkaV2[Subscribe[events]]".into();
    let mut query = Query::new(
        opts,
        "query-1".into(),
        source,
        MemStore::default(),
        MemSink::default(),
    );
    let mut progress = Vec::new();
    query
        .run(never_stop(), |p: &QueryProgress| progress.push(p.clone()))
        .await
        .unwrap();
    let json: serde_json::Value = serde_json::from_str(&progress[0].to_json()).unwrap();
    for field in [
        "id",
        "runId",
        "name",
        "timestamp",
        "batchId",
        "numInputRows",
        "inputRowsPerSecond",
        "processedRowsPerSecond",
        "durationMs",
        "sources",
        "sink",
    ] {
        assert!(json.get(field).is_some(), "missing {field} in {json}");
    }
    for field in [
        "latestOffset",
        "walCommit",
        "getBatch",
        "addBatch",
        "sinkCommit",
        "commitOffsets",
        "triggerExecution",
    ] {
        assert!(
            json["durationMs"].get(field).is_some(),
            "missing durationMs.{field}"
        );
        let micros = json["durationMicros"][field].as_u64().unwrap();
        assert_eq!(
            json["durationMs"][field].as_u64().unwrap(),
            micros / 1000,
            "durationMicros.{field} is durationMs.{field} in finer units"
        );
    }
    assert!(
        json["durationMicros"]["sinkCommit"].as_u64()
            <= json["durationMicros"]["addBatch"].as_u64(),
        "the sink's commit is part of addBatch: {json}"
    );
    let source = &json["sources"][0];
    assert_eq!(
        source["startOffset"],
        serde_json::json!({"events": {"0": 0, "1": 0}})
    );
    assert_eq!(
        source["endOffset"],
        serde_json::json!({"events": {"0": 6, "1": 2}})
    );
    assert_eq!(
        source["latestOffset"],
        serde_json::json!({"events": {"0": 10, "1": 4}})
    );
    assert_eq!(source["metrics"]["maxOffsetsBehindLatest"], "4");
    assert_eq!(source["metrics"]["minOffsetsBehindLatest"], "2");
    assert_eq!(json["id"], "query-1");
    assert_eq!(json["name"], "orders");
    assert!(json["timestamp"].as_str().unwrap().ends_with('Z'));
}

fn fast_retries(attempts: u32) -> sluice_executor::RetryPolicy {
    sluice_executor::RetryPolicy {
        max_attempts: attempts,
        initial_backoff: std::time::Duration::from_millis(1),
        max_backoff: std::time::Duration::from_millis(4),
        startup_timeout: std::time::Duration::from_secs(60),
    }
}

#[tokio::test]
async fn transient_source_failures_are_retried_and_permanent_ones_stop_at_once() {
    let source = MemSource::with(&[(0, 10)]);
    source
        .failures
        .lock()
        .unwrap()
        .extend([TRANSIENT, TRANSIENT, TRANSIENT]);
    let mut opts = options(Trigger::AvailableNow, None);
    opts.retry = fast_retries(5);
    let mut query = Query::new(
        opts.clone(),
        "q".into(),
        source.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(
        summary.records, 10,
        "three transient failures, then success"
    );

    let permanent = MemSource::with(&[(0, 10)]);
    permanent.failures.lock().unwrap().push("bad configuration");
    let mut query = Query::new(
        opts.clone(),
        "q".into(),
        permanent.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert_eq!(err.to_string(), "bad configuration");
    assert_eq!(
        *permanent.calls.lock().unwrap(),
        1,
        "no retry of a permanent failure"
    );

    let down = MemSource::with(&[(0, 10)]);
    down.failures.lock().unwrap().extend([TRANSIENT; 5]);
    let mut query = Query::new(
        opts,
        "q".into(),
        down.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        matches!(
            &err,
            ExecutorError::GaveUp {
                retried: Retried {
                    attempts: 5,
                    why: GaveUp::Attempts,
                    ..
                },
                last: Some(_),
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.starts_with("discovering partitions failed 5 times in ")
            && message
                .ends_with("giving up at retry.max_attempts; the last error: broker unavailable"),
        "the message counts the tries really made: {message}"
    );
    assert_eq!(
        *down.calls.lock().unwrap(),
        5,
        "gives up after max_attempts"
    );
}

/// A source that never answers: every discovery fails after `delay`, as a
/// request to an unreachable broker times out.
fn unreachable_source(delay: Duration) -> MemSource {
    let source = MemSource::with(&[(0, 10)]);
    source.failures.lock().unwrap().extend([TRANSIENT; 1000]);
    *source.failure_delay.lock().unwrap() = delay;
    source
}

#[tokio::test(start_paused = true)]
async fn a_source_unreachable_at_start_fails_within_the_startup_timeout() {
    let source = unreachable_source(Duration::from_secs(30));
    let mut opts = options(Trigger::AvailableNow, None);
    opts.retry = RetryPolicy::default();
    let started = tokio::time::Instant::now();
    let mut query = Query::new(
        opts,
        "q".into(),
        source.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    let took = started.elapsed();
    assert!(took <= Duration::from_secs(60), "took {took:?}");
    assert!(
        took >= Duration::from_secs(59),
        "gave up early, after {took:?}"
    );
    // 30 s, a second's wait, then the second attempt is cut short at 60 s.
    assert_eq!(*source.calls.lock().unwrap(), 2);
    match &err {
        ExecutorError::GaveUp {
            retried:
                Retried {
                    attempts: 2,
                    why: GaveUp::StartupTimeout(limit),
                    ..
                },
            last: Some(last),
        } => {
            assert_eq!(*limit, Duration::from_secs(60));
            assert_eq!(last.to_string(), TRANSIENT);
        }
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().contains("retry.startup_timeout (1m)"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_source_lost_after_the_start_is_retried_max_attempts_times() {
    let source = MemSource::with(&[(0, 10)]);
    let mut opts = options(Trigger::ProcessingTime(Duration::from_secs(1)), None);
    opts.retry = RetryPolicy::default();
    let (stop_tx, stop) = watch::channel(false);
    let mut query = Query::new(
        opts,
        "q".into(),
        source.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    let lose = source.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        lose.failures.lock().unwrap().extend([TRANSIENT; 1000]);
        *lose.failure_delay.lock().unwrap() = Duration::from_secs(30);
        let _ = stop_tx;
        std::future::pending::<()>().await;
    });
    let started = tokio::time::Instant::now();
    let err = query.run(stop, |_| {}).await.unwrap_err();
    // Well past the startup timeout: the source had answered.
    assert!(started.elapsed() > Duration::from_secs(400));
    assert!(
        matches!(
            err,
            ExecutorError::GaveUp {
                retried: Retried {
                    attempts: 10,
                    why: GaveUp::Attempts,
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stop_request_ends_the_retrying_at_once() {
    let source = unreachable_source(Duration::from_secs(30));
    let mut opts = options(Trigger::ProcessingTime(Duration::from_secs(1)), None);
    opts.retry = RetryPolicy {
        startup_timeout: Duration::from_secs(3600),
        ..RetryPolicy::default()
    };
    let (stop_tx, stop) = watch::channel(false);
    let mut query = Query::new(
        opts,
        "q".into(),
        source.clone(),
        MemStore::default(),
        MemSink::default(),
    );
    tokio::spawn(async move {
        // During the second attempt; then during a backoff wait below.
        tokio::time::sleep(Duration::from_secs(45)).await;
        let _ = stop_tx.send(true);
    });
    let started = tokio::time::Instant::now();
    let summary = query.run(stop, |_| {}).await.unwrap();
    assert_eq!(summary.batches, 0);
    assert_eq!(started.elapsed(), Duration::from_secs(45));

    // A stop during a backoff wait.
    let mut opts = options(Trigger::ProcessingTime(Duration::from_secs(1)), None);
    opts.retry = RetryPolicy {
        initial_backoff: Duration::from_secs(600),
        max_backoff: Duration::from_secs(600),
        startup_timeout: Duration::from_secs(3600),
        ..RetryPolicy::default()
    };
    let source = unreachable_source(Duration::from_secs(1));
    let (stop_tx, stop) = watch::channel(false);
    let mut query = Query::new(
        opts,
        "q".into(),
        source,
        MemStore::default(),
        MemSink::default(),
    );
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let _ = stop_tx.send(true);
    });
    let started = tokio::time::Instant::now();
    query.run(stop, |_| {}).await.unwrap();
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

#[tokio::test]
async fn transient_sink_failures_are_retried_and_a_permanent_one_writes_no_commit() {
    let source = MemSource::with(&[(0, 10)]);
    let sink = MemSink::default();
    *sink.transient_failures.lock().unwrap() = 2;
    let store = MemStore::default();
    let mut opts = options(Trigger::AvailableNow, None);
    opts.retry = fast_retries(5);
    let mut query = Query::new(
        opts.clone(),
        "q".into(),
        source.clone(),
        store.clone(),
        sink.clone(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.batches, 1);
    assert_eq!(sorted(sink.values()), all_values(&[(0, 10)]));
    assert_eq!(
        *sink.begins.lock().unwrap(),
        1,
        "two failed begins, one that worked"
    );

    let sink = MemSink::default();
    *sink.transient_failures.lock().unwrap() = 100;
    let store = MemStore::default();
    let mut query = Query::new(opts, "q".into(), source, store.clone(), sink.clone());
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        matches!(
            err,
            ExecutorError::GaveUp {
                retried: Retried { attempts: 5, .. },
                ..
            }
        ),
        "{err}"
    );
    assert!(
        store.commits.lock().unwrap().is_empty(),
        "no commit without the sink"
    );
    assert_eq!(
        store.plans.lock().unwrap().len(),
        1,
        "the plan waits for a replay"
    );
}

#[tokio::test]
async fn a_read_failing_part_way_begins_the_batch_again_and_delivers_each_record_once() {
    let source = MemSource::with(&[(0, 10), (1, 7)]);
    source
        .read_failures
        .lock()
        .unwrap()
        .extend([TRANSIENT, TRANSIENT]);
    let mut opts = options(Trigger::AvailableNow, None);
    opts.retry = fast_retries(5);
    let sink = MemSink::default();
    let store = MemStore::default();
    let mut query = Query::new(
        opts.clone(),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.batches, 1);
    assert_eq!(
        summary.records, 17,
        "rows count the successful attempt only"
    );
    assert_eq!(
        *sink.begins.lock().unwrap(),
        3,
        "two failed attempts, then one whole"
    );
    let batches = sink.batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 1);
    assert_eq!(
        sorted(batches[0].2.clone()),
        all_values(&[(0, 10), (1, 7)]),
        "the records the failed attempts had delivered are not kept twice"
    );
    assert_eq!(store.commits.lock().unwrap().len(), 1);

    // A failure that is not transient stops the query with the batch uncommitted.
    let broken = MemSource::with(&[(0, 10)]);
    broken.read_failures.lock().unwrap().push("corrupt record");
    let store = MemStore::default();
    let sink = MemSink::default();
    let mut query = Query::new(opts, "q".into(), broken, store.clone(), sink.clone());
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert_eq!(err.to_string(), "corrupt record");
    assert_eq!(store.plans.lock().unwrap().len(), 1, "the plan is durable");
    assert!(
        store.commits.lock().unwrap().is_empty(),
        "nothing is committed"
    );
    assert!(
        sink.batches.lock().unwrap().is_empty(),
        "the sink never finished it"
    );
}

/// Passes records through, but those at offsets 3, 13, 23, ... are bad; reports
/// a watermark of 1,000 ms per batch begun.
#[derive(Default)]
struct PickyProcessor {
    batches: i64,
}

impl sluice_core::Processor for PickyProcessor {
    type Output = RecordChunk;
    type Error = TestError;

    async fn begin_batch(
        &mut self,
        _batch: BatchId,
        _metadata: &sluice_core::BatchMetadata,
    ) -> Result<(), TestError> {
        self.batches += 1;
        Ok(())
    }

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut sluice_core::Processed<RecordChunk>,
    ) -> Result<(), TestError> {
        let mut good = RecordChunk::default();
        for record in &records {
            if record.offset().value() % 10 == 3 {
                let mut bad = record.to_record();
                bad.headers.push(sluice_core::Header {
                    key: sluice_core::ERROR_HEADER.to_owned(),
                    value: Some(b"ends in 3".to_vec()),
                });
                out.bad.push_record(&bad);
            } else {
                good.push_ref(record);
            }
        }
        out.row_count += good.len() as u64;
        out.rows.push(good);
        Ok(())
    }

    async fn finish_batch(
        &mut self,
        _batch: BatchId,
        _out: &mut sluice_core::Processed<RecordChunk>,
    ) -> Result<(), TestError> {
        Ok(())
    }

    fn stateful_operators(&mut self) -> Vec<&mut dyn StatefulOperator<TestError>> {
        Vec::new()
    }

    fn event_time(&mut self) -> Option<&mut dyn EventTime> {
        Some(self)
    }

    fn lookup_tables(&self) -> Vec<sluice_core::LookupStats> {
        Vec::new()
    }

    fn is_transient(_: &Self::Error) -> bool {
        false
    }
}

impl EventTime for PickyProcessor {
    fn next_watermark_ms(&self) -> i64 {
        1000 * self.batches
    }

    fn restore_watermark(&mut self, _watermark_ms: i64) {}

    fn stats(&self) -> sluice_core::EventTimeStats {
        sluice_core::EventTimeStats::default()
    }

    fn source_watermarks_ms(&self) -> Vec<Option<i64>> {
        Vec::new()
    }

    fn restore_source_watermarks(&mut self, _watermarks_ms: &[Option<i64>]) {}
}

#[tokio::test]
async fn bad_records_stop_the_query_or_are_skipped_or_go_to_the_dead_letters() {
    use sluice_core::BadRecordPolicy;
    let run = |policy: BadRecordPolicy| async move {
        let source = MemSource::with(&[(0, 25), (1, 10)]);
        let (store, sink, dead) = (MemStore::default(), MemSink::default(), MemSink::default());
        let mut query = Query::with_processor(
            {
                let mut options = options(Trigger::AvailableNow, Some(20));
                options.source().on_bad_record = policy;
                options
            },
            "q".into(),
            source,
            store.clone(),
            PickyProcessor::default(),
            sink.clone(),
            dead.clone(),
        );
        let mut progress = Vec::new();
        let result = query
            .run(never_stop(), |p: &QueryProgress| progress.push(p.clone()))
            .await;
        (result, store, sink, dead, progress)
    };

    let (result, store, _, _, _) = run(BadRecordPolicy::Fail).await;
    let err = result.unwrap_err();
    assert!(matches!(err, ExecutorError::BadRecord { .. }), "{err}");
    assert!(
        err.to_string()
            .starts_with("record events-0@3 cannot be processed: ends in 3;"),
        "{err}"
    );
    assert!(
        store.commits.lock().unwrap().is_empty(),
        "nothing committed"
    );

    let bad_values = ["0-3", "0-13", "0-23", "1-3"];
    let (result, _, sink, dead, progress) = run(BadRecordPolicy::Skip).await;
    let summary = result.unwrap();
    assert_eq!(summary.bad_records, 4);
    assert_eq!(sink.values().len(), 35 - 4);
    assert!(dead.values().is_empty(), "skipped, not kept");
    let counted: u64 = progress
        .iter()
        .map(|p| p.sources[0].metrics["badRecords"].parse::<u64>().unwrap())
        .sum();
    assert_eq!(counted, 4, "the progress reports count them");
    assert_eq!(
        progress.iter().map(|p| p.sink.num_output_rows).sum::<u64>(),
        31
    );

    let (result, store, sink, dead, _) = run(BadRecordPolicy::DeadLetter).await;
    assert_eq!(result.unwrap().bad_records, 4);
    assert_eq!(
        sorted(dead.values()),
        sorted(bad_values.map(String::from).to_vec())
    );
    assert!(
        !sink
            .values()
            .iter()
            .any(|v| bad_values.contains(&v.as_str()))
    );
    // The watermark a processor reports is recorded in the next plan and in the commit.
    let plans = store.plans.lock().unwrap();
    assert_eq!(plans[&BatchId(0)].metadata().watermark_ms, 0);
    assert_eq!(plans[&BatchId(1)].metadata().watermark_ms, 1000);
    assert_eq!(
        store.commits.lock().unwrap()[&BatchId(1)].next_watermark_ms,
        2000
    );
}

/// A sink that already holds every batch it is asked about on recovery.
#[derive(Clone, Default)]
struct TwoPhaseSink {
    inner: MemSink,
    asked: Arc<Mutex<Vec<BatchId>>>,
}

impl Sink for TwoPhaseSink {
    type Error = TestError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), TestError> {
        self.inner.begin_batch(batch, ranges).await
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), TestError> {
        self.inner.finish_batch(batch).await
    }

    async fn delivered(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<bool, TestError> {
        self.asked.lock().unwrap().push(batch);
        Ok(true)
    }
}

impl Writes for TwoPhaseSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), TestError> {
        self.inner.write(records).await
    }
}

#[tokio::test]
async fn a_replayed_batch_the_sink_already_has_is_only_committed() {
    let source = MemSource::with(&[(0, 30)]);
    let store = MemStore::default();
    let failing = MemSink {
        fail_on: Some(BatchId(1)),
        ..MemSink::default()
    };
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(20)),
        "q".into(),
        source.clone(),
        store.clone(),
        failing,
    );
    assert!(query.run(never_stop(), |_| {}).await.is_err());
    assert!(store.plans.lock().unwrap().contains_key(&BatchId(1)));

    let sink = TwoPhaseSink::default();
    let mut recovered = Query::new(
        options(Trigger::AvailableNow, Some(20)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    recovered.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(*sink.asked.lock().unwrap(), vec![BatchId(1)]);
    assert!(
        sink.inner.values().is_empty(),
        "batch 1 is not written again, and nothing else was left"
    );
    assert!(store.commits.lock().unwrap().contains_key(&BatchId(1)));
}

/// Counts every record it has seen across batches, as state: each batch's
/// delta is its own count, a snapshot the total so far.
#[derive(Default)]
struct CountingProcessor {
    counter: Counter,
    /// Failures its next chunks meet, the last first.
    failures: Vec<&'static str>,
}

/// The count of [`CountingProcessor`], as its one stateful operator.
#[derive(Default)]
struct Counter {
    committed: u64,
    batch: u64,
}

impl sluice_core::Processor for CountingProcessor {
    type Output = RecordChunk;
    type Error = TestError;

    async fn begin_batch(
        &mut self,
        _batch: BatchId,
        _metadata: &sluice_core::BatchMetadata,
    ) -> Result<(), TestError> {
        self.counter.batch = 0;
        Ok(())
    }

    async fn process(
        &mut self,
        records: RecordChunk,
        out: &mut sluice_core::Processed<RecordChunk>,
    ) -> Result<(), TestError> {
        if let Some(failure) = self.failures.pop() {
            return Err(TestError(failure.to_owned()));
        }
        self.counter.batch += records.len() as u64;
        out.row_count += records.len() as u64;
        out.rows.push(records);
        Ok(())
    }

    async fn finish_batch(
        &mut self,
        _batch: BatchId,
        _out: &mut sluice_core::Processed<RecordChunk>,
    ) -> Result<(), TestError> {
        Ok(())
    }

    fn stateful_operators(&mut self) -> Vec<&mut dyn StatefulOperator<TestError>> {
        vec![&mut self.counter]
    }

    fn event_time(&mut self) -> Option<&mut dyn EventTime> {
        None
    }

    fn lookup_tables(&self) -> Vec<sluice_core::LookupStats> {
        Vec::new()
    }

    fn is_transient(error: &Self::Error) -> bool {
        error.0 == TRANSIENT
    }
}

impl StatefulOperator<TestError> for Counter {
    fn name(&self) -> &str {
        "counter"
    }

    fn partitions(&self) -> u32 {
        1
    }

    fn delta(&self) -> Result<Vec<Vec<u8>>, TestError> {
        Ok(vec![self.batch.to_be_bytes().to_vec()])
    }

    fn snapshot(&self) -> Result<Vec<Vec<u8>>, TestError> {
        Ok(vec![self.committed.to_be_bytes().to_vec()])
    }

    fn restore(&mut self, files: &[StateFile]) -> Result<(), TestError> {
        self.committed = files
            .iter()
            .map(|f| u64::from_be_bytes(f.bytes.as_slice().try_into().unwrap()))
            .sum();
        Ok(())
    }

    fn commit(&mut self) {
        self.committed += self.batch;
    }

    fn waits_for_watermark(&self) -> bool {
        false
    }

    fn stats(&self) -> sluice_core::StateOperatorStats {
        sluice_core::StateOperatorStats {
            name: "counter".to_owned(),
            rows_total: 1,
            ..Default::default()
        }
    }
}

#[tokio::test]
async fn a_processors_transient_failure_begins_the_batch_again_and_a_permanent_one_stops() {
    let mut opts = options(Trigger::AvailableNow, Some(4));
    opts.retry = fast_retries(5);
    let processor = CountingProcessor {
        failures: vec![TRANSIENT, TRANSIENT],
        ..CountingProcessor::default()
    };
    let sink = MemSink::default();
    let mut query = Query::with_processor(
        opts.clone(),
        "q".into(),
        MemSource::with(&[(0, 10)]),
        MemStore::default(),
        processor,
        sink.clone(),
        MemSink::default(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.records, 10, "two transient failures, then success");
    assert_eq!(sink.values().len(), 10, "each record reaches the sink once");
    assert!(
        *sink.begins.lock().unwrap() > 3,
        "the failed batches began again"
    );

    let processor = CountingProcessor {
        failures: vec!["a lookup table's rows do not parse"],
        ..CountingProcessor::default()
    };
    let mut query = Query::with_processor(
        opts,
        "q".into(),
        MemSource::with(&[(0, 10)]),
        MemStore::default(),
        processor,
        MemSink::default(),
        MemSink::default(),
    );
    let error = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(error.to_string().contains("do not parse"), "{error}");
}

#[tokio::test]
async fn state_is_durable_before_each_commit_restored_on_restart_and_purged_to_what_recovery_needs()
{
    let source = MemSource::with(&[(0, 100)]);
    let store = MemStore::default();
    let opts = QueryOptions {
        min_batches_to_retain: 5,
        ..options(Trigger::AvailableNow, Some(3))
    };
    let mut query = Query::with_processor(
        opts.clone(),
        "q".into(),
        source.clone(),
        store.clone(),
        CountingProcessor::default(),
        MemSink::default(),
        MemSink::default(),
    );
    let summary = query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(summary.batches, 34);
    // Batches 29..=33 are kept; version 28 is the oldest a retained batch starts
    // from, rebuilt from snapshot 19 and deltas 20..=28.
    let kept: Vec<(BatchId, StateFileKind)> = store
        .state
        .lock()
        .unwrap()
        .keys()
        .map(|k| (k.2, k.3))
        .collect();
    let mut expected = vec![(BatchId(19), StateFileKind::Snapshot)];
    for v in 20..=33 {
        expected.push((BatchId(v), StateFileKind::Delta));
    }
    expected.push((BatchId(29), StateFileKind::Snapshot));
    expected.sort_unstable();
    assert_eq!(kept, expected);

    // A restart rebuilds the total from snapshot 29 and delta 30..=33.
    source.logs.lock().unwrap().insert(tp(0), (0, 101));
    let mut query = Query::with_processor(
        opts.clone(),
        "q".into(),
        source.clone(),
        store.clone(),
        CountingProcessor::default(),
        MemSink::default(),
        MemSink::default(),
    );
    let mut totals = Vec::new();
    query
        .run(never_stop(), |p| totals.push(p.batch_id))
        .await
        .unwrap();
    assert_eq!(totals, [34]);
    let snapshot = store
        .state
        .lock()
        .unwrap()
        .get(&(0, 0, BatchId(34), StateFileKind::Delta))
        .cloned()
        .unwrap();
    assert_eq!(u64::from_be_bytes(snapshot.try_into().unwrap()), 1);

    // A missing delta is named, and nothing is run.
    store
        .state
        .lock()
        .unwrap()
        .remove(&(0, 0, BatchId(32), StateFileKind::Delta));
    let mut query = Query::with_processor(
        opts,
        "q".into(),
        source,
        store.clone(),
        CountingProcessor::default(),
        MemSink::default(),
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        err.to_string().contains("state 0 0 32 Delta is missing"),
        "{err}"
    );
}

#[tokio::test]
async fn a_snapshot_that_cannot_be_written_leaves_the_query_running_on_deltas() {
    let source = MemSource::with(&[(0, 100)]);
    let store = MemStore::default();
    store
        .refuse_snapshots
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let opts = QueryOptions {
        min_batches_to_retain: 5,
        ..options(Trigger::AvailableNow, Some(3))
    };
    let run = |processor| {
        let mut query = Query::with_processor(
            opts.clone(),
            "q".into(),
            source.clone(),
            store.clone(),
            processor,
            MemSink::default(),
            MemSink::default(),
        );
        async move { query.run(never_stop(), |_| {}).await }
    };
    let summary = run(CountingProcessor::default()).await.unwrap();
    assert_eq!(summary.batches, 34);
    // With no snapshot to start from, no delta may be purged.
    let kept: Vec<StateKey> = store.state.lock().unwrap().keys().copied().collect();
    let deltas: Vec<StateKey> = (0..34)
        .map(|v| (0, 0, BatchId(v), StateFileKind::Delta))
        .collect();
    assert_eq!(kept, deltas);

    // A restart rebuilds the total from all 34 deltas: the snapshot after batch
    // 39, once the store takes snapshots again, counts every record.
    store
        .refuse_snapshots
        .store(false, std::sync::atomic::Ordering::Relaxed);
    source.logs.lock().unwrap().insert(tp(0), (0, 118));
    let summary = run(CountingProcessor::default()).await.unwrap();
    assert_eq!(summary.batches, 6);
    let snapshot = store
        .state
        .lock()
        .unwrap()
        .get(&(0, 0, BatchId(39), StateFileKind::Snapshot))
        .cloned()
        .expect("the snapshot after batch 39");
    assert_eq!(u64::from_be_bytes(snapshot.try_into().unwrap()), 118);
}

/// A sink that fences earlier writers when taken over, and that a runner on
/// its way out fences once, at the end of one batch.
#[derive(Clone, Default)]
struct FencedSink {
    inner: MemSink,
    take_overs: Arc<Mutex<Vec<Option<BatchId>>>>,
    fence_at: Arc<Mutex<Option<BatchId>>>,
    batch: Option<BatchId>,
}

impl Sink for FencedSink {
    type Error = TestError;

    async fn take_over(&mut self) -> Result<(), TestError> {
        self.take_overs.lock().unwrap().push(self.batch);
        Ok(())
    }

    fn is_fenced(error: &TestError) -> bool {
        error.0 == FENCED
    }

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        ranges: &[OffsetRange],
    ) -> Result<(), TestError> {
        self.batch = Some(batch);
        self.inner.begin_batch(batch, ranges).await
    }

    async fn finish_batch(&mut self, batch: BatchId) -> Result<(), TestError> {
        if self
            .fence_at
            .lock()
            .unwrap()
            .take_if(|at| *at == batch)
            .is_some()
        {
            return Err(TestError(FENCED.to_owned()));
        }
        self.inner.finish_batch(batch).await
    }
}

impl Writes for FencedSink {
    async fn write(&mut self, records: &RecordChunk) -> Result<(), TestError> {
        self.inner.write(records).await
    }
}

#[tokio::test]
async fn a_sink_fenced_while_the_store_names_this_runner_is_taken_over_again() {
    let source = MemSource::with(&[(0, 30)]);
    let store = MemStore::default();
    let sink = FencedSink::default();
    *sink.fence_at.lock().unwrap() = Some(BatchId(1));
    let mut opts = options(Trigger::AvailableNow, Some(10));
    opts.retry = fast_retries(5);
    let mut query = Query::new(opts, "q".into(), source, store.clone(), sink.clone());
    query.run(never_stop(), |_| {}).await.unwrap();
    assert_eq!(
        *sink.take_overs.lock().unwrap(),
        vec![None, Some(BatchId(1))],
        "taken over before the first batch, and again after the fence"
    );
    assert_eq!(sorted(sink.inner.values()), all_values(&[(0, 30)]));
    assert_eq!(store.commits.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn a_runner_that_lost_the_query_writes_nothing_after_its_take_over() {
    let source = MemSource::with(&[(0, 30)]);
    let store = MemStore::default();
    store
        .claim_lost
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let sink = FencedSink::default();
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(10)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    let error = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        matches!(error, ExecutorError::Store(ref e) if e.0 == FENCED),
        "{error}"
    );
    assert_eq!(sink.take_overs.lock().unwrap().len(), 1);
    assert!(sink.inner.values().is_empty());
    assert!(store.plans.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_fenced_sink_stops_the_runner_once_the_store_no_longer_names_it() {
    let source = MemSource::with(&[(0, 30)]);
    let store = MemStore::default();
    let sink = FencedSink::default();
    *sink.fence_at.lock().unwrap() = Some(BatchId(1));
    let lost = store.claim_lost.clone();
    let mut query = Query::new(
        options(Trigger::AvailableNow, Some(10)),
        "q".into(),
        source,
        store.clone(),
        sink.clone(),
    );
    let error = query
        .run(never_stop(), |progress| {
            if progress.batch_id == 0 {
                lost.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        })
        .await
        .unwrap_err();
    assert!(
        matches!(error, ExecutorError::Store(ref e) if e.0 == FENCED),
        "{error}"
    );
    assert_eq!(
        sink.take_overs.lock().unwrap().len(),
        1,
        "no second take-over"
    );
    assert!(!store.commits.lock().unwrap().contains_key(&BatchId(1)));
}

#[tokio::test]
async fn continuous_hands_records_to_the_sink_before_their_epoch_is_planned() {
    let source = MemSource::with(&[(0, 5), (1, 3)]);
    let store = MemStore::default();
    let sink = MemSink::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    // An epoch far longer than the test's waits: records must arrive while
    // it is still open.
    let epoch = std::time::Duration::from_secs(30);
    let mut query = Query::new(
        options(Trigger::Continuous(epoch), None),
        "q".into(),
        source.clone(),
        store.clone(),
        sink.clone(),
    );
    let feeder = {
        let (source, sink, store) = (source.clone(), sink.clone(), store.clone());
        tokio::spawn(async move {
            while *sink.written.lock().unwrap() < 8 {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            let planned_early = store.plans.lock().unwrap().len();
            source.append(0, 4);
            source.append(1, 2);
            while *sink.written.lock().unwrap() < 14 {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            let planned_later = store.plans.lock().unwrap().len();
            stop_tx.send(true).unwrap();
            (planned_early, planned_later)
        })
    };
    let summary = query.run(stop_rx, |_| {}).await.unwrap();
    let (planned_early, planned_later) = feeder.await.unwrap();
    assert_eq!(
        (planned_early, planned_later),
        (0, 0),
        "records reach the sink while their epoch is open"
    );
    // The stop closes the epoch: one batch, planned and committed, with all of it.
    assert_eq!((summary.batches, summary.records), (1, 14));
    let plans = store.plans.lock().unwrap();
    let plan = plans.get(&BatchId(0)).expect("the epoch's plan");
    assert_eq!(plan.end_offsets().get(&tp(0)), Some(&off(9)));
    assert_eq!(plan.end_offsets().get(&tp(1)), Some(&off(5)));
    assert!(store.commits.lock().unwrap().contains_key(&BatchId(0)));
    let mut values = sink.values();
    values.sort();
    assert_eq!(values, all_values(&[(0, 9), (1, 5)]));
}

#[tokio::test]
async fn continuous_commits_an_epoch_per_interval_and_none_without_records() {
    let source = MemSource::with(&[(0, 6)]);
    let store = MemStore::default();
    let sink = MemSink::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut query = Query::new(
        options(
            Trigger::Continuous(std::time::Duration::from_millis(40)),
            None,
        ),
        "q".into(),
        source.clone(),
        store.clone(),
        sink.clone(),
    );
    let feeder = {
        let (source, store) = (source.clone(), store.clone());
        tokio::spawn(async move {
            while store.commits.lock().unwrap().is_empty() {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            // Idle epochs plan nothing.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let idle_commits = store.commits.lock().unwrap().len();
            source.append(0, 4);
            while store.commits.lock().unwrap().len() < 2 {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            stop_tx.send(true).unwrap();
            idle_commits
        })
    };
    let summary = query.run(stop_rx, |_| {}).await.unwrap();
    assert_eq!(
        feeder.await.unwrap(),
        1,
        "an epoch without records is no batch"
    );
    assert_eq!((summary.batches, summary.records), (2, 10));
    assert_eq!(sink.values(), all_values(&[(0, 10)]));
    let plans = store.plans.lock().unwrap();
    assert_eq!(
        plans[&BatchId(1)].start_offsets().get(&tp(0)),
        Some(&off(6))
    );
}

#[tokio::test]
async fn a_read_failing_in_an_epoch_starts_the_epoch_over_and_keeps_each_record_once() {
    let source = MemSource::with(&[(0, 10), (1, 7)]);
    source
        .read_failures
        .lock()
        .unwrap()
        .extend([TRANSIENT, TRANSIENT]);
    let mut opts = options(
        Trigger::Continuous(std::time::Duration::from_millis(30)),
        None,
    );
    opts.retry = fast_retries(5);
    let store = MemStore::default();
    let sink = MemSink::default();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut query = Query::new(opts, "q".into(), source, store.clone(), sink.clone());
    let stopper = {
        let store = store.clone();
        tokio::spawn(async move {
            while store.commits.lock().unwrap().is_empty() {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            stop_tx.send(true).unwrap();
        })
    };
    let summary = query.run(stop_rx, |_| {}).await.unwrap();
    stopper.await.unwrap();
    assert_eq!(summary.records, 17);
    assert!(
        *sink.begins.lock().unwrap() >= 3,
        "begun again after each failure"
    );
    let mut values = sink.values();
    values.sort();
    assert_eq!(values, all_values(&[(0, 10), (1, 7)]));
}

#[tokio::test]
async fn continuous_refuses_a_stateful_processor() {
    let mut query = Query::with_processor(
        options(Trigger::Continuous(std::time::Duration::from_secs(1)), None),
        "q".into(),
        MemSource::with(&[(0, 3)]),
        MemStore::default(),
        CountingProcessor::default(),
        MemSink::default(),
        MemSink::default(),
    );
    let err = query.run(never_stop(), |_| {}).await.unwrap_err();
    assert!(
        matches!(err, ExecutorError::ContinuousWithState { operators: 1 }),
        "{err}"
    );
    assert!(err.to_string().contains("processing_time"), "{err}");
}
