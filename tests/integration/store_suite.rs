//! One behaviour suite for every offset store, run against the filesystem
//! checkpoint and against the real Cassandra node: fresh start, plan → crash →
//! replay, commit → next batch, two writers, retention, damaged or
//! inconsistent logs, and state files in several partitions.

use std::future::Future;
use std::path::PathBuf;

use sluice_cassandra_store::{CassandraLocation, CassandraOptions, CassandraStore};
use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Offset, OffsetStore, PartitionOffsets,
    Recovery, StateFile, StateFileId, StateFileKind, StateStore, TopicPartition, purge_threshold,
};

/// Opens stores of one query, as successive runners would.
trait Harness {
    type Store: OffsetStore + StateStore;

    /// A new runner's store for the query.
    fn open(&self) -> impl Future<Output = Result<Self::Store, String>>;

    /// Corrupts the stored plan of `batch` behind the store's back.
    fn damage_plan(&self, batch: u64) -> impl Future<Output = ()>;
}

fn plan(batch: u64) -> BatchPlan {
    let offsets = |base: i64| -> PartitionOffsets {
        (0..3)
            .map(|p| {
                (
                    TopicPartition::new("events", p),
                    Offset::new(base + i64::from(p)).unwrap(),
                )
            })
            .collect()
    };
    let from = batch as i64 * 10;
    BatchPlan::from_offsets(
        BatchId(batch),
        &offsets(from),
        &offsets(from + 10),
        BatchMetadata {
            watermark_ms: 0,
            timestamp_ms: 1_700_000_000_000 + batch as i64,
            conf: Default::default(),
        },
    )
    .unwrap()
}

fn commit(batch: u64) -> BatchCommit {
    BatchCommit {
        id: BatchId(batch),
        next_watermark_ms: 0,
    }
}

async fn run_batch<S: OffsetStore>(store: &mut S, batch: u64) {
    store.write_plan(&plan(batch)).await.unwrap();
    store.write_commit(&commit(batch)).await.unwrap();
}

/// Batch `batch` of a query of two sources: `events` and `clicks`, in that
/// order, the second with nothing yet in batch 0.
fn two_source_plan(batch: u64) -> BatchPlan {
    let at = |v: i64| Offset::new(v).unwrap();
    let from = batch as i64 * 10;
    let mut start = PartitionOffsets::new();
    let mut ends = vec![PartitionOffsets::new(), PartitionOffsets::new()];
    for p in 0..2 {
        let tp = TopicPartition::new("events", p);
        start.insert(tp.clone(), at(from));
        ends[0].insert(tp, at(from + 10));
    }
    if batch > 0 {
        let tp = TopicPartition::new("clicks", 0);
        start.insert(tp.clone(), at(from - 10));
        ends[1].insert(tp, at(from));
    }
    BatchPlan::from_lines(BatchId(batch), &start, &ends, BatchMetadata::default()).unwrap()
}

async fn several_sources(h: &impl Harness) {
    {
        let mut store = h.open().await.unwrap();
        for batch in 0..2 {
            store.write_plan(&two_source_plan(batch)).await.unwrap();
            store.write_commit(&commit(batch)).await.unwrap();
        }
        store.write_plan(&two_source_plan(2)).await.unwrap();
    }
    let mut store = h.open().await.unwrap();
    let stored = store.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(2) })
    );
    let plan = stored.latest_plan.unwrap();
    assert_eq!(plan, two_source_plan(2), "each range on its source's line");
    assert_eq!(plan.source_count(), 2);
    // A source without partitions keeps its line.
    let first = two_source_plan(0);
    assert_eq!(first.source_count(), 2);
    assert!(first.end_offsets_by_source()[1].is_empty());
}

async fn fresh_start(h: &impl Harness) {
    let mut store = h.open().await.unwrap();
    let stored = store.load().await.unwrap();
    assert_eq!(stored.recovery(), Ok(Recovery::StartFresh));
    assert!(stored.latest_plan.is_none() && stored.initial_offsets.is_none());
}

async fn plan_crash_replay(h: &impl Harness) {
    {
        let mut store = h.open().await.unwrap();
        run_batch(&mut store, 0).await;
        store.write_plan(&plan(1)).await.unwrap();
        // The runner dies here.
    }
    let mut store = h.open().await.unwrap();
    let stored = store.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(1) })
    );
    assert_eq!(stored.latest_plan, Some(plan(1)), "identical ranges");
    assert_eq!(stored.initial_offsets, Some(plan(0).start_offsets()));
    store.write_commit(&commit(1)).await.unwrap();
}

async fn commit_then_next(h: &impl Harness) {
    {
        let mut store = h.open().await.unwrap();
        for batch in 0..3 {
            run_batch(&mut store, batch).await;
        }
    }
    let mut store = h.open().await.unwrap();
    let stored = store.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::RunNext {
            last_committed: BatchId(2),
            next: BatchId(3)
        })
    );
    assert_eq!(
        stored.latest_plan.unwrap().end_offsets(),
        plan(3).start_offsets()
    );
}

async fn two_writers(h: &impl Harness) {
    let mut first = h.open().await.unwrap();
    run_batch(&mut first, 0).await;
    match h.open().await {
        // The filesystem lock refuses the second runner outright.
        Err(message) => {
            assert!(message.contains("in use by another runner"), "{message}");
            run_batch(&mut first, 1).await;
        }
        // Cassandra lets the newer runner in and fences the older one out.
        Ok(mut second) => {
            let refused = first.write_plan(&plan(1)).await.unwrap_err().to_string();
            assert!(refused.contains("was taken over by"), "{refused}");
            let refused = first
                .write_commit(&commit(0))
                .await
                .unwrap_err()
                .to_string();
            assert!(
                refused.contains("taken over") || refused.contains("already exists"),
                "{refused}"
            );
            let stored = second.load().await.unwrap();
            assert_eq!(
                stored.planned,
                vec![BatchId(0)],
                "nothing of the old runner after the takeover"
            );
            run_batch(&mut second, 1).await;
            let stored = second.load().await.unwrap();
            assert_eq!(stored.planned, vec![BatchId(0), BatchId(1)]);
        }
    }
}

/// A commit and the next plan as the executor writes them when batches follow
/// one another at once: one write where the store joins them, else the
/// commit, then the plan.
async fn commit_and_plan<S: OffsetStore>(
    store: &mut S,
    commit: &BatchCommit,
    plan: &BatchPlan,
) -> Result<(), S::Error> {
    if !store.hold_commit(commit) {
        store.write_commit(commit).await?;
    }
    store.write_plan(plan).await
}

async fn joined_commit_and_plan(h: &impl Harness) {
    let mut first = h.open().await.unwrap();
    first.write_plan(&plan(0)).await.unwrap();
    commit_and_plan(&mut first, &commit(0), &plan(1))
        .await
        .unwrap();
    let stored = first.load().await.unwrap();
    assert_eq!(stored.planned, vec![BatchId(0), BatchId(1)]);
    assert_eq!(stored.committed, vec![BatchId(0)]);
    assert_eq!(stored.latest_plan, Some(plan(1)));
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(1) })
    );

    // Written again, the pair is refused whole and nothing stored changes.
    let refused = commit_and_plan(&mut first, &commit(0), &plan(1))
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("already exists"), "{refused}");
    assert_eq!(first.load().await.unwrap(), stored);

    if let Ok(mut second) = h.open().await {
        // Cassandra lets a newer runner in: the older one's pair is refused
        // whole, neither the commit nor the plan lands.
        let refused = commit_and_plan(&mut first, &commit(1), &plan(2))
            .await
            .unwrap_err()
            .to_string();
        assert!(refused.contains("was taken over by"), "{refused}");
        assert_eq!(second.load().await.unwrap(), stored);
        commit_and_plan(&mut second, &commit(1), &plan(2))
            .await
            .unwrap();
        first = second;
    } else {
        commit_and_plan(&mut first, &commit(1), &plan(2))
            .await
            .unwrap();
    }
    let stored = first.load().await.unwrap();
    assert_eq!(stored.committed, vec![BatchId(0), BatchId(1)]);
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(2) })
    );
}

async fn retention(h: &impl Harness) {
    let mut store = h.open().await.unwrap();
    for batch in 0..130 {
        run_batch(&mut store, batch).await;
        if let Some(keep_from) = purge_threshold(BatchId(batch), 100) {
            store.purge(keep_from).await.unwrap();
        }
    }
    let stored = store.load().await.unwrap();
    assert_eq!(stored.planned, (30..130).map(BatchId).collect::<Vec<_>>());
    assert_eq!(stored.committed, (30..130).map(BatchId).collect::<Vec<_>>());
    assert!(stored.initial_offsets.is_some(), "batch 0's start is kept");
}

/// A state file of operator 0 whose bytes name it, larger than one Cassandra
/// chunk for the snapshot.
fn state_file(partition: u32, version: u64, kind: StateFileKind) -> StateFile {
    let mut bytes = format!("p{partition} v{version} {kind:?}").into_bytes();
    if kind == StateFileKind::Snapshot {
        bytes.resize(1_500_000, b'.');
    }
    StateFile {
        operator: 0,
        partition,
        version: BatchId(version),
        kind,
        bytes,
        location: String::new(),
    }
}

async fn state_in_partitions(h: &impl Harness) {
    let mut store = h.open().await.unwrap();
    assert!(store.list_state(0).await.unwrap().is_empty());
    let mut written = Vec::new();
    for version in 0..3 {
        for partition in 0..3 {
            written.push(state_file(partition, version, StateFileKind::Delta));
        }
    }
    written.push(state_file(1, 2, StateFileKind::Snapshot));
    for file in &written {
        store.write_state(file).await.unwrap();
    }
    // A replayed batch writes the same file again: the stored one stays.
    let mut again = state_file(2, 1, StateFileKind::Delta);
    again.bytes = b"other".to_vec();
    store.write_state(&again).await.unwrap();

    let mut ids: Vec<StateFileId> = written.iter().map(StateFile::id).collect();
    ids.sort_unstable();
    assert_eq!(store.list_state(0).await.unwrap(), ids);
    assert!(store.list_state(1).await.unwrap().is_empty());
    for file in &written {
        let read = store.read_state(0, file.id()).await.unwrap();
        assert_eq!(read.bytes, file.bytes, "{:?}", file.id());
        assert_eq!(read.id(), file.id());
        let (p, v) = (file.partition, file.version);
        assert!(
            read.location
                .contains(&format!("partition={p} version={v}"))
                || read.location.contains(&format!("/{p}/{v}.")),
            "{} names its partition",
            read.location
        );
    }

    let gone: Vec<StateFileId> = ids.iter().copied().filter(|f| f.version.0 == 0).collect();
    store.remove_state(0, &gone).await.unwrap();
    let left = store.list_state(0).await.unwrap();
    assert_eq!(left.len(), ids.len() - 3);
    assert!(left.iter().all(|f| f.version.0 > 0));
    // A second runner finds the same files.
    drop(store);
    let mut second = h.open().await.unwrap();
    assert_eq!(second.list_state(0).await.unwrap(), left);
}

async fn damaged_and_inconsistent(h: &impl Harness) {
    let mut store = h.open().await.unwrap();
    run_batch(&mut store, 0).await;
    // A commit without its plan is refused, and an existing entry is never replaced.
    let err = store
        .write_commit(&commit(5))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("plan"), "{err}");
    let err = store.write_plan(&plan(0)).await.unwrap_err().to_string();
    assert!(err.contains("already exists"), "{err}");

    store.write_plan(&plan(1)).await.unwrap();
    drop(store);
    h.damage_plan(1).await;
    let mut store = h.open().await.unwrap_or_else(|e| panic!("{e}"));
    let err = store.load().await.unwrap_err().to_string();
    assert!(err.contains("damaged") && err.contains('1'), "{err}");
}

struct FsHarness {
    dir: tempfile::TempDir,
}

impl FsHarness {
    fn new() -> Self {
        FsHarness {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("checkpoint")
    }
}

impl Harness for FsHarness {
    type Store = Checkpoint;

    async fn open(&self) -> Result<Checkpoint, String> {
        Checkpoint::open(self.path()).map_err(|e| e.to_string())
    }

    async fn damage_plan(&self, batch: u64) {
        let path = self.path().join("offsets").join(batch.to_string());
        std::fs::remove_file(&path).unwrap();
        std::fs::write(path, "v1\n{\"batchWatermarkMs\":0}\n{\"events\":").unwrap();
    }
}

struct CassandraHarness {
    location: CassandraLocation,
}

impl CassandraHarness {
    fn new(keyspace: &str) -> Self {
        CassandraHarness {
            location: CassandraLocation {
                nodes: sluice_tests::cassandra_nodes(),
                keyspace: keyspace.to_owned(),
                query: sluice_tests::unique_name("q"),
            },
        }
    }
}

fn options() -> CassandraOptions {
    CassandraOptions {
        replication: Some(sluice_tests::TEST_REPLICATION.to_owned()),
        ..CassandraOptions::default()
    }
}

impl Harness for CassandraHarness {
    type Store = CassandraStore;

    async fn open(&self) -> Result<CassandraStore, String> {
        CassandraStore::open(self.location.clone(), options())
            .await
            .map_err(|e| e.to_string())
    }

    async fn damage_plan(&self, batch: u64) {
        let session = sluice_tests::cassandra_session(&self.location.nodes).await;
        session
            .query_unpaged(
                format!(
                    "UPDATE {}.sluice_log SET end_offsets = '{{\"events\":' WHERE query = ? AND \
                     kind = 'plan' AND batch_id = ?",
                    self.location.keyspace
                ),
                (&self.location.query, batch as i64),
            )
            .await
            .unwrap();
    }
}

macro_rules! suite {
    ($module:ident, $harness:expr) => {
        mod $module {
            use super::*;

            #[tokio::test]
            async fn starts_fresh() {
                fresh_start(&$harness).await;
            }

            #[tokio::test]
            async fn replays_a_planned_batch_after_a_crash() {
                plan_crash_replay(&$harness).await;
            }

            #[tokio::test]
            async fn runs_the_next_batch_after_a_commit() {
                commit_then_next(&$harness).await;
            }

            #[tokio::test]
            async fn refuses_two_writers() {
                two_writers(&$harness).await;
            }

            #[tokio::test]
            async fn writes_a_commit_with_the_next_plan_as_one() {
                joined_commit_and_plan(&$harness).await;
            }

            #[tokio::test]
            async fn keeps_the_newest_batches() {
                retention(&$harness).await;
            }

            #[tokio::test]
            async fn refuses_damaged_and_inconsistent_logs() {
                damaged_and_inconsistent(&$harness).await;
            }

            #[tokio::test]
            async fn keeps_state_files_in_partitions() {
                state_in_partitions(&$harness).await;
            }

            #[tokio::test]
            async fn keeps_a_line_per_source_in_every_plan() {
                several_sources(&$harness).await;
            }
        }
    };
}

suite!(filesystem, FsHarness::new());
// Every test uses its own query in one shared keyspace, created on first use.
suite!(cassandra, CassandraHarness::new("sluice_store_suite"));

/// The rows of a query's offsets table, each with the batch that wrote it.
async fn offsets_table(h: &CassandraHarness) -> Vec<(TopicPartition, Offset, i64)> {
    let session = sluice_tests::cassandra_session(&h.location.nodes).await;
    let rows = session
        .query_unpaged(
            "SELECT topic, partition, offset, batch_id FROM sluice_store_suite.sluice_core WHERE query = ?",
            (&h.location.query,),
        )
        .await
        .unwrap()
        .into_rows_result()
        .unwrap();
    rows.rows::<(String, i32, i64, i64)>()
        .unwrap()
        .map(|row| {
            let (topic, partition, offset, batch) = row.unwrap();
            (
                TopicPartition::new(topic, partition),
                Offset::new(offset).unwrap(),
                batch,
            )
        })
        .collect()
}

/// The offsets of `rows`, all of which `batch` must have written.
fn written_by(rows: &[(TopicPartition, Offset, i64)], batch: i64) -> PartitionOffsets {
    rows.iter()
        .map(|(tp, offset, by)| {
            assert_eq!(*by, batch, "written by batch {batch}: {rows:?}");
            (tp.clone(), *offset)
        })
        .collect()
}

#[tokio::test]
async fn cassandra_mirrors_the_latest_committed_offsets_in_plain_columns() {
    let h = CassandraHarness::new("sluice_store_suite");
    let mut store = h.open().await.unwrap();
    // The first commit writes the table; the next ones within a second wait
    // for a commit after it, or for the end of the run.
    for batch in 0..3 {
        run_batch(&mut store, batch).await;
    }
    assert_eq!(
        written_by(&offsets_table(&h).await, 0),
        plan(0).end_offsets(),
        "the next offsets to read, as Kafka commits them"
    );
    store.flush().await.unwrap();
    assert_eq!(
        written_by(&offsets_table(&h).await, 2),
        plan(2).end_offsets()
    );
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    run_batch(&mut store, 3).await;
    assert_eq!(
        written_by(&offsets_table(&h).await, 3),
        plan(3).end_offsets(),
        "a commit a second after the last write writes the table"
    );
}

#[tokio::test]
async fn a_cassandra_store_that_lost_its_query_leaves_the_offsets_table_to_the_new_owner() {
    let h = CassandraHarness::new("sluice_store_suite");
    let mut old = h.open().await.unwrap();
    for batch in 0..3 {
        run_batch(&mut old, batch).await;
    }
    // A second runner claims the query; the first one's deferred rows (batch 2)
    // must not be written over the new owner's.
    let _new = h.open().await.unwrap();
    let refused = old.flush().await.unwrap_err();
    assert!(refused.to_string().contains("was taken over"), "{refused}");
    assert_eq!(
        written_by(&offsets_table(&h).await, 0),
        plan(0).end_offsets()
    );
}

#[tokio::test]
async fn a_state_table_of_the_layout_before_partitions_is_named_with_what_to_do() {
    let (session, keyspace) = sluice_tests::keyspace_with(
        "old_state",
        &[
            "CREATE TABLE {keyspace}.sluice_state (query text, operator int, version bigint, \
           kind text, chunk int, bytes blob, epoch bigint, \
           PRIMARY KEY ((query, operator), version, kind, chunk))",
        ],
    )
    .await;
    let location = CassandraLocation {
        nodes: sluice_tests::cassandra_nodes(),
        keyspace: keyspace.clone(),
        query: "q".to_owned(),
    };
    let err = CassandraStore::open(location, options())
        .await
        .err()
        .expect("the old layout is refused")
        .to_string();
    assert!(
        err.contains(&format!(
            "table {keyspace}.sluice_state has an older layout"
        )),
        "{err}"
    );
    assert!(err.contains("no `partition` column"), "{err}");
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap();
}
