//! Group mode's driver against in-memory implementations of the membership,
//! the directory and the generations: settling a generation that died,
//! handing partitions back before a revocation completes, and where each
//! generation starts.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Directory, DirectoryEntry, Generation,
    Membership, MembershipChange, Offset, Origin, PartitionDirectory, PartitionOffsets, Revocation,
    StoredBatches, TopicPartition,
};
use sluice_executor::{Generations, GroupQuery, RetryPolicy};
use tokio::sync::{mpsc, watch};

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TestError(String);

fn tp(p: i32) -> TopicPartition {
    TopicPartition::new("t", p)
}

fn off(v: i64) -> Offset {
    Offset::new(v).unwrap()
}

/// The directory as a map, shared with the test.
#[derive(Clone, Default)]
struct MemDirectory(Arc<Mutex<Directory>>);

impl PartitionDirectory for MemDirectory {
    type Error = TestError;

    async fn read(&mut self) -> Result<Directory, TestError> {
        Ok(self.0.lock().unwrap().clone())
    }

    async fn originate(&mut self, origin: &Origin) -> Result<Origin, TestError> {
        let mut directory = self.0.lock().unwrap();
        Ok(directory
            .origin
            .get_or_insert_with(|| origin.clone())
            .clone())
    }

    async fn take(
        &mut self,
        partition: &TopicPartition,
        expected: Option<&DirectoryEntry>,
        generation: &Generation,
        start: Offset,
    ) -> Result<bool, TestError> {
        let mut directory = self.0.lock().unwrap();
        if directory.entries.get(partition) != expected {
            return Ok(false);
        }
        directory.entries.insert(
            partition.clone(),
            DirectoryEntry {
                owner: Some(generation.clone()),
                start,
            },
        );
        Ok(true)
    }

    async fn hand_back(
        &mut self,
        generation: &Generation,
        ends: &PartitionOffsets,
    ) -> Result<(), TestError> {
        let mut directory = self.0.lock().unwrap();
        for (partition, end) in ends {
            if let Some(entry) = directory.entries.get_mut(partition)
                && entry.owner.as_ref() == Some(generation)
            {
                *entry = DirectoryEntry {
                    owner: None,
                    start: *end,
                };
            }
        }
        Ok(())
    }
}

/// A membership the test drives through a channel.
struct TestMembership {
    assignment: Arc<Mutex<BTreeSet<TopicPartition>>>,
    changes: mpsc::UnboundedReceiver<MembershipChange>,
}

impl Membership for TestMembership {
    type Error = TestError;

    fn member(&self) -> &str {
        "m"
    }

    fn assignment(&self) -> BTreeSet<TopicPartition> {
        self.assignment.lock().unwrap().clone()
    }

    async fn next_change(&mut self) -> Result<MembershipChange, TestError> {
        match self.changes.recv().await {
            Some(change) => Ok(change),
            None => std::future::pending().await,
        }
    }
}

/// What the generations did, for the test to check.
#[derive(Default)]
struct Record {
    /// Each run: the generation and where its partitions started.
    runs: Vec<(Generation, PartitionOffsets)>,
    settled: Vec<Generation>,
    removed: Vec<Generation>,
}

/// Generations whose runs read 10 offsets of every partition in one batch and
/// wait for the stop; logs of generations that died are given by the test.
#[derive(Clone, Default)]
struct TestGenerations {
    record: Arc<Mutex<Record>>,
    logs: Arc<Mutex<BTreeMap<Generation, StoredBatches>>>,
}

fn one_batch(id: u64, from: &PartitionOffsets, committed: bool) -> StoredBatches {
    let until = from
        .iter()
        .map(|(tp, o)| (tp.clone(), o.saturating_add(10)))
        .collect();
    let plan =
        BatchPlan::from_offsets(BatchId(id), from, &until, BatchMetadata::default()).unwrap();
    StoredBatches {
        planned: vec![BatchId(id)],
        committed: if committed { vec![BatchId(id)] } else { vec![] },
        latest_plan: Some(plan),
        latest_commit: committed.then_some(BatchCommit {
            id: BatchId(id),
            next_watermark_ms: 0,
        }),
        initial_offsets: None,
    }
}

impl Generations for TestGenerations {
    type Error = TestError;

    async fn initial_offsets(&mut self) -> Result<PartitionOffsets, TestError> {
        Ok((0..4).map(|p| (tp(p), off(100))).collect())
    }

    async fn earliest(
        &mut self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> Result<PartitionOffsets, TestError> {
        Ok(partitions.iter().map(|t| (t.clone(), off(0))).collect())
    }

    async fn run(
        &mut self,
        _query_id: &str,
        generation: &Generation,
        starts: &PartitionOffsets,
        mut stop: watch::Receiver<bool>,
    ) -> Result<StoredBatches, TestError> {
        self.record
            .lock()
            .unwrap()
            .runs
            .push((generation.clone(), starts.clone()));
        let _ = stop.wait_for(|stop| *stop).await;
        Ok(one_batch(0, starts, true))
    }

    async fn settle(
        &mut self,
        _query_id: &str,
        generation: &Generation,
    ) -> Result<StoredBatches, TestError> {
        self.record.lock().unwrap().settled.push(generation.clone());
        // The replay commits what the generation planned.
        let mut log = self.logs.lock().unwrap()[generation].clone();
        if let Some(plan) = &log.latest_plan {
            log.committed = vec![plan.id()];
            log.latest_commit = Some(BatchCommit {
                id: plan.id(),
                next_watermark_ms: 0,
            });
        }
        Ok(log)
    }

    async fn remove(&mut self, _query_id: &str, generation: &Generation) -> Result<(), TestError> {
        self.record.lock().unwrap().removed.push(generation.clone());
        Ok(())
    }
}

/// Waits until `n` generations have run, or fails after a second.
async fn wait_for_runs(record: Arc<Mutex<Record>>, n: usize) {
    for _ in 0..200 {
        if record.lock().unwrap().runs.len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("no generation {n}");
}

#[tokio::test]
async fn generations_settle_the_dead_hand_back_before_a_revocation_and_resume_where_they_ended() {
    let dead = Generation::from_name("dead.7");
    let directory = MemDirectory::default();
    {
        let mut d = directory.0.lock().unwrap();
        d.origin = Some(Origin {
            query_id: "q-id".to_owned(),
            initial: (0..2).map(|p| (tp(p), off(100))).collect(),
        });
        d.entries.insert(
            tp(1),
            DirectoryEntry {
                owner: Some(dead.clone()),
                start: off(40),
            },
        );
    }
    let generations = TestGenerations::default();
    // The dead generation planned [40, 50) of partition 1 and did not commit it.
    generations.logs.lock().unwrap().insert(
        dead.clone(),
        one_batch(3, &PartitionOffsets::from([(tp(1), off(40))]), false),
    );
    let assignment = Arc::new(Mutex::new(BTreeSet::from([tp(0), tp(1), tp(2)])));
    let (changes, changes_in) = mpsc::unbounded_channel();
    let membership = TestMembership {
        assignment: assignment.clone(),
        changes: changes_in,
    };
    let mut query = GroupQuery::new(
        "q",
        membership,
        directory.clone(),
        generations.clone(),
        RetryPolicy::default(),
    );
    let (stop, stopped) = watch::channel(false);
    let running = tokio::spawn(async move { query.run(stopped).await });

    let runs = |n: usize| wait_for_runs(generations.record.clone(), n);
    runs(1).await;
    {
        let record = generations.record.lock().unwrap();
        assert_eq!(record.settled, vec![dead.clone()]);
        let (first, starts) = &record.runs[0];
        assert_eq!(first, &Generation::new("m", 1));
        // The origin's offset, the dead generation's replayed end, and the
        // earliest of a partition the origin did not know.
        assert_eq!(
            starts,
            &PartitionOffsets::from([(tp(0), off(100)), (tp(1), off(50)), (tp(2), off(0))])
        );
        assert!(record.removed.contains(&dead));
    }

    // Partition 2 is revoked: the revocation completes only once the
    // generation handed everything back.
    assignment.lock().unwrap().remove(&tp(2));
    let (done, completed) = tokio::sync::oneshot::channel();
    let seen = directory.clone();
    changes
        .send(MembershipChange::Revoking(Revocation::new(
            BTreeSet::from([tp(2)]),
            move || {
                let d = seen.0.lock().unwrap();
                let _ = done.send(d.holders());
            },
        )))
        .unwrap();
    let holders_at_completion = completed.await.unwrap();
    assert!(
        holders_at_completion.is_empty(),
        "still held when the revocation completed: {holders_at_completion:?}"
    );
    runs(2).await;
    {
        let record = generations.record.lock().unwrap();
        let (second, starts) = &record.runs[1];
        assert_eq!(second, &Generation::new("m", 2));
        assert_eq!(
            starts,
            &PartitionOffsets::from([(tp(0), off(110)), (tp(1), off(60))])
        );
        assert!(record.removed.contains(&Generation::new("m", 1)));
    }
    // Partition 2 waits, handed back at its end, for its next holder.
    assert_eq!(
        directory.0.lock().unwrap().entries[&tp(2)],
        DirectoryEntry {
            owner: None,
            start: off(10)
        }
    );

    stop.send(true).unwrap();
    let summary = running.await.unwrap().unwrap();
    assert_eq!((summary.generations, summary.settled), (2, 1));
    assert!(directory.0.lock().unwrap().holders().is_empty());
}

#[tokio::test]
async fn an_assignment_the_generation_already_holds_does_not_restart_it() {
    let generations = TestGenerations::default();
    let assignment = Arc::new(Mutex::new(BTreeSet::from([tp(0), tp(1)])));
    let (changes, changes_in) = mpsc::unbounded_channel();
    // Queued before the first generation began over both partitions, as the
    // group's first assignment is.
    changes
        .send(MembershipChange::Assigned(BTreeSet::from([tp(0), tp(1)])))
        .unwrap();
    let membership = TestMembership {
        assignment: assignment.clone(),
        changes: changes_in,
    };
    let mut query = GroupQuery::new(
        "q",
        membership,
        MemDirectory::default(),
        generations.clone(),
        RetryPolicy::default(),
    );
    let (stop, stopped) = watch::channel(false);
    let running = tokio::spawn(async move { query.run(stopped).await });
    let runs = |n: usize| wait_for_runs(generations.record.clone(), n);
    runs(1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(generations.record.lock().unwrap().runs.len(), 1);
    // A partition it does not hold yet starts the next generation.
    assignment.lock().unwrap().insert(tp(2));
    changes
        .send(MembershipChange::Assigned(BTreeSet::from([tp(2)])))
        .unwrap();
    runs(2).await;
    stop.send(true).unwrap();
    let summary = running.await.unwrap().unwrap();
    assert_eq!(summary.generations, 2);
}
