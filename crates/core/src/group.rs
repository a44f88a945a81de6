//! Scale-out: several processes share one query through Kafka's consumer group
//! (`docs/scale-out.md`).
//!
//! Kafka decides which member holds which partitions. What Sluice keeps is the
//! query's *directory*: per partition, the generation that holds it and the
//! offset it started from there. A *generation* is one member's run over one
//! fixed set of partitions, with a batch log of its own; the member begins a new
//! generation whenever its assignment changes. A generation that ends cleanly
//! hands every partition back with its committed end. One that does not (the
//! process died, or was paused past its session) still holds its partitions in
//! the directory, and whoever is assigned one of them first fences that
//! generation's log, replays its uncommitted batch, and hands all of them back.
//!
//! The functions here decide where each partition starts; the traits are the
//! directory a store keeps and the membership a source provides.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;

use crate::{Offset, PartitionOffsets, StoredBatches, TopicPartition};

/// One member's run over one fixed set of partitions; its batch log is a query
/// of its own in the store, named by [`Generation::log_name`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(String);

impl Generation {
    /// The `number`th generation of `member`, a name unique to one process.
    pub fn new(member: &str, number: u64) -> Generation {
        Generation(format!("{member}.{number}"))
    }

    /// A generation by the name the directory holds.
    pub fn from_name(name: impl Into<String>) -> Generation {
        Generation(name.into())
    }

    /// The name, as the directory holds it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The member that runs the generation: the name up to its number.
    pub fn member(&self) -> &str {
        self.0
            .rsplit_once('.')
            .map_or(&self.0, |(member, _)| member)
    }

    /// The name of this generation's batch log among the store's queries: the
    /// query's name, a slash and the generation, so that every log of a query
    /// sorts beside it.
    pub fn log_name(&self, query: &str) -> String {
        format!("{query}/{}", self.0)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One partition in the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectoryEntry {
    /// The generation that holds the partition; `None` once it was handed back.
    pub owner: Option<Generation>,
    /// Where the holder started reading it, or, once handed back, where the
    /// next holder starts.
    pub start: Offset,
}

/// What the store keeps of a query in group mode.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Directory {
    /// The query id and where every partition of the first look at the topic
    /// starts, written once by the first member, so that members that start
    /// together agree on both.
    pub origin: Option<Origin>,
    /// Every partition that a generation ever held.
    pub entries: BTreeMap<TopicPartition, DirectoryEntry>,
}

/// A query's id and initial offsets, as the first member recorded them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The query id.
    pub query_id: String,
    /// Where each partition starts that no generation held yet, from the
    /// starting options resolved when the query began.
    pub initial: PartitionOffsets,
}

/// Where a newly assigned partition starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionStart {
    /// Handed back at this offset, or never held and resolved when the query
    /// began: read from here.
    At(Offset),
    /// A partition that appeared after the query began: from its earliest
    /// offset, as a query in one process reads a partition that appears.
    Earliest,
    /// Still held by a generation that did not hand it back: that generation's
    /// log is settled first, which hands this partition back with the rest.
    HeldBy(Generation),
}

impl Directory {
    /// Where `partition` starts for a generation that was just assigned it.
    pub fn start_of(&self, partition: &TopicPartition) -> PartitionStart {
        match self.entries.get(partition) {
            Some(DirectoryEntry {
                owner: Some(owner), ..
            }) => PartitionStart::HeldBy(owner.clone()),
            Some(DirectoryEntry { owner: None, start }) => PartitionStart::At(*start),
            None => match self
                .origin
                .as_ref()
                .and_then(|origin| origin.initial.get(partition))
            {
                Some(offset) => PartitionStart::At(*offset),
                None => PartitionStart::Earliest,
            },
        }
    }

    /// The partitions `generation` holds.
    pub fn held_by(&self, generation: &Generation) -> BTreeSet<TopicPartition> {
        self.entries
            .iter()
            .filter(|(_, entry)| entry.owner.as_ref() == Some(generation))
            .map(|(tp, _)| tp.clone())
            .collect()
    }

    /// Every generation that holds a partition.
    pub fn holders(&self) -> BTreeSet<Generation> {
        self.entries
            .values()
            .filter_map(|entry| entry.owner.clone())
            .collect()
    }
}

/// Why a generation's partitions cannot be handed back yet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// The generation's newest plan is not committed: it must be replayed first,
    /// or the next holders would read its ranges again beside what it wrote.
    #[error(
        "generation {generation} planned batch {batch} and did not commit it: it is replayed before \
         its partitions move"
    )]
    Unsettled {
        /// The generation.
        generation: Generation,
        /// Its uncommitted batch.
        batch: u64,
    },
}

/// Where each partition `generation` holds continues, from its settled log: the
/// end of its newest committed batch, or where it started a partition that no
/// batch of it read.
pub fn settled_ends(
    directory: &Directory,
    generation: &Generation,
    stored: &StoredBatches,
) -> Result<PartitionOffsets, GroupError> {
    let committed = stored.latest_commit.as_ref().map(|c| c.id);
    let ends = match &stored.latest_plan {
        Some(plan) if Some(plan.id()) == committed => plan.end_offsets(),
        Some(plan) => {
            return Err(GroupError::Unsettled {
                generation: generation.clone(),
                batch: plan.id().0,
            });
        }
        None => PartitionOffsets::new(),
    };
    Ok(directory
        .entries
        .iter()
        .filter(|(_, entry)| entry.owner.as_ref() == Some(generation))
        .map(|(tp, entry)| (tp.clone(), ends.get(tp).copied().unwrap_or(entry.start)))
        .collect())
}

/// The directory of a query in group mode, kept by the offset store beside the
/// generations' logs.
///
/// Contract for implementations: every change is conditional on the entry
/// being as the caller last read it, so that two members never both take a
/// partition, and a generation that lost one can no longer hand it back.
pub trait PartitionDirectory: Send {
    /// What can go wrong, with the table and key it concerns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Reads the whole directory.
    fn read(&mut self) -> impl Future<Output = Result<Directory, Self::Error>> + Send;

    /// Records the query's origin unless one is recorded already, and returns
    /// the one that is, so that every member uses the first member's.
    fn originate(
        &mut self,
        origin: &Origin,
    ) -> impl Future<Output = Result<Origin, Self::Error>> + Send;

    /// Makes `generation` the holder of `partition` from `start`, if its entry
    /// is still `expected` (`None`: no entry). False when it changed meanwhile.
    fn take(
        &mut self,
        partition: &TopicPartition,
        expected: Option<&DirectoryEntry>,
        generation: &Generation,
        start: Offset,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// Hands back every partition of `ends` that `generation` still holds, each
    /// to start at its end.
    fn hand_back(
        &mut self,
        generation: &Generation,
        ends: &PartitionOffsets,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether `error` may go away by itself, so that the call is worth trying
    /// again (as [`crate::OffsetStore::is_transient`]).
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// Partitions taken from this member by its group, handed over only once
/// [`Revocation::complete`] is called (or the revocation is dropped): until then
/// the member may finish the batch in flight and commit it.
pub struct Revocation {
    /// The partitions the group takes away.
    pub partitions: BTreeSet<TopicPartition>,
    done: Option<Box<dyn FnOnce() + Send>>,
}

impl Revocation {
    /// A revocation that calls `done` when it completes.
    pub fn new(
        partitions: BTreeSet<TopicPartition>,
        done: impl FnOnce() + Send + 'static,
    ) -> Revocation {
        Revocation {
            partitions,
            done: Some(Box::new(done)),
        }
    }

    /// Lets the group hand the partitions to other members: this member writes
    /// nothing more for them.
    pub fn complete(mut self) {
        if let Some(done) = self.done.take() {
            done();
        }
    }
}

impl Drop for Revocation {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done();
        }
    }
}

impl fmt::Debug for Revocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Revocation")
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

/// A change of what this member holds.
#[derive(Debug)]
pub enum MembershipChange {
    /// The group gave this member more partitions.
    Assigned(BTreeSet<TopicPartition>),
    /// The group takes partitions away, once the revocation completes.
    Revoking(Revocation),
    /// The member lost its partitions without a revocation (its session
    /// expired): another member may hold them already.
    Lost(BTreeSet<TopicPartition>),
}

/// This process's membership in the query's consumer group, which decides the
/// partitions it runs.
pub trait Membership: Send {
    /// What can go wrong, with the group it concerns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The member's name, unique to this process, for its generations.
    fn member(&self) -> &str;

    /// The partitions the member holds now.
    fn assignment(&self) -> BTreeSet<TopicPartition>;

    /// Waits for the next change of the assignment.
    fn next_change(&mut self)
    -> impl Future<Output = Result<MembershipChange, Self::Error>> + Send;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::{BatchCommit, BatchId, BatchMetadata, BatchPlan};

    fn tp(p: i32) -> TopicPartition {
        TopicPartition::new("t", p)
    }

    fn off(v: i64) -> Offset {
        Offset::new(v).unwrap()
    }

    fn held(owner: &str, start: i64) -> DirectoryEntry {
        DirectoryEntry {
            owner: Some(Generation::from_name(owner)),
            start: off(start),
        }
    }

    fn released(start: i64) -> DirectoryEntry {
        DirectoryEntry {
            owner: None,
            start: off(start),
        }
    }

    fn plan(id: u64, from: &[(i32, i64)], until: &[(i32, i64)]) -> BatchPlan {
        let offsets = |list: &[(i32, i64)]| list.iter().map(|&(p, o)| (tp(p), off(o))).collect();
        BatchPlan::from_offsets(
            BatchId(id),
            &offsets(from),
            &offsets(until),
            BatchMetadata::default(),
        )
        .unwrap()
    }

    #[test]
    fn a_generation_log_sorts_beside_its_query() {
        let generation = Generation::new("3f2a", 7);
        assert_eq!(generation.as_str(), "3f2a.7");
        assert_eq!(generation.log_name("orders"), "orders/3f2a.7");
        assert_eq!(generation.member(), "3f2a");
        assert_eq!(Generation::new("host.a", 12).member(), "host.a");
    }

    #[test]
    fn a_partition_starts_where_it_was_handed_back_or_recovers_its_holder() {
        let directory = Directory {
            origin: Some(Origin {
                query_id: "q".to_owned(),
                initial: PartitionOffsets::from([(tp(0), off(5)), (tp(3), off(40))]),
            }),
            entries: BTreeMap::from([(tp(0), released(17)), (tp(1), held("a.1", 9))]),
        };
        assert_eq!(directory.start_of(&tp(0)), PartitionStart::At(off(17)));
        assert_eq!(
            directory.start_of(&tp(1)),
            PartitionStart::HeldBy(Generation::from_name("a.1"))
        );
        // Never held: the origin's offset, or the earliest of a partition
        // that appeared later.
        assert_eq!(directory.start_of(&tp(3)), PartitionStart::At(off(40)));
        assert_eq!(directory.start_of(&tp(2)), PartitionStart::Earliest);
        assert_eq!(
            directory.holders(),
            BTreeSet::from([Generation::from_name("a.1")])
        );
    }

    #[test]
    fn a_settled_generation_hands_back_its_committed_ends_and_untouched_starts() {
        let a = Generation::from_name("a.1");
        let directory = Directory {
            origin: None,
            entries: BTreeMap::from([
                (tp(0), held("a.1", 10)),
                (tp(1), held("a.1", 20)),
                (tp(2), held("b.4", 30)),
            ]),
        };
        // Nothing planned: every partition goes back where it started.
        assert_eq!(
            settled_ends(&directory, &a, &StoredBatches::default()),
            Ok(PartitionOffsets::from([(tp(0), off(10)), (tp(1), off(20))]))
        );
        let committed = StoredBatches {
            planned: vec![BatchId(0), BatchId(1)],
            committed: vec![BatchId(0), BatchId(1)],
            latest_plan: Some(plan(1, &[(0, 12)], &[(0, 15)])),
            latest_commit: Some(BatchCommit {
                id: BatchId(1),
                next_watermark_ms: 0,
            }),
            initial_offsets: None,
        };
        assert_eq!(
            settled_ends(&directory, &a, &committed),
            Ok(PartitionOffsets::from([(tp(0), off(15)), (tp(1), off(20))]))
        );
    }

    #[test]
    fn an_uncommitted_plan_keeps_the_partitions_where_they_are() {
        let a = Generation::from_name("a.1");
        let directory = Directory {
            origin: None,
            entries: BTreeMap::from([(tp(0), held("a.1", 10))]),
        };
        let unsettled = StoredBatches {
            planned: vec![BatchId(0), BatchId(1)],
            committed: vec![BatchId(0)],
            latest_plan: Some(plan(1, &[(0, 12)], &[(0, 15)])),
            latest_commit: Some(BatchCommit {
                id: BatchId(0),
                next_watermark_ms: 0,
            }),
            initial_offsets: None,
        };
        assert_eq!(
            settled_ends(&directory, &a, &unsettled),
            Err(GroupError::Unsettled {
                generation: a,
                batch: 1
            })
        );
    }

    proptest::proptest! {
        #[test]
        fn a_settled_generation_hands_back_exactly_what_it_holds_never_behind_its_start(
            entries in proptest::collection::btree_map(0..16_i32, (0..3_u8, 0..100_i64), 0..12),
            advance in proptest::collection::btree_map(0..16_i32, 0..50_i64, 0..12),
        ) {
            let a = Generation::from_name("a.1");
            let directory = Directory {
                origin: None,
                entries: entries
                    .iter()
                    .map(|(&p, &(who, start))| {
                        let entry = match who {
                            0 => held("a.1", start),
                            1 => held("b.1", start),
                            _ => released(start),
                        };
                        (tp(p), entry)
                    })
                    .collect(),
            };
            // One committed batch of `a` over what it holds, some partitions
            // advanced, some not read at all.
            let mine = directory.held_by(&a);
            let from: Vec<(i32, i64)> = mine
                .iter()
                .filter(|t| advance.contains_key(&t.partition))
                .map(|t| (t.partition, directory.entries[t].start.value()))
                .collect();
            let until: Vec<(i32, i64)> = from
                .iter()
                .map(|&(p, start)| (p, start + advance[&p]))
                .collect();
            let stored = StoredBatches {
                planned: vec![BatchId(0)],
                committed: vec![BatchId(0)],
                latest_plan: Some(plan(0, &from, &until)),
                latest_commit: Some(BatchCommit { id: BatchId(0), next_watermark_ms: 0 }),
                initial_offsets: None,
            };
            let ends = settled_ends(&directory, &a, &stored).unwrap();
            proptest::prop_assert_eq!(ends.keys().cloned().collect::<BTreeSet<_>>(), mine);
            for (t, end) in &ends {
                proptest::prop_assert!(*end >= directory.entries[t].start);
            }
        }
    }

    #[test]
    fn a_revocation_completes_once_whether_completed_or_dropped() {
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        let revocation = Revocation::new(BTreeSet::from([tp(0)]), move || {
            assert!(!flag.swap(true, Ordering::SeqCst), "completed twice");
        });
        assert!(!done.load(Ordering::SeqCst));
        revocation.complete();
        assert!(done.load(Ordering::SeqCst));

        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        drop(Revocation::new(BTreeSet::new(), move || {
            flag.store(true, Ordering::SeqCst)
        }));
        assert!(dropped.load(Ordering::SeqCst));
    }
}
