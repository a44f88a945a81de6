//! Group mode: one query over several processes (`docs/scale-out.md`). Kafka's
//! consumer group decides which partitions this process runs; the directory
//! says where each starts. Each change of assignment ends one generation, a
//! query of its own over a fixed set of partitions, and begins the next.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use sluice_core::{
    Generation, Membership, MembershipChange, Origin, PartitionDirectory, PartitionOffsets,
    PartitionStart, Revocation, StoredBatches, TopicPartition, settled_ends,
};
use tokio::sync::watch;

use crate::RetryPolicy;
use crate::retry::{Driver, Failed, Tries};

/// How often a member takes its partitions again before it gives up, when
/// other members keep changing their rows meanwhile.
const TAKE_ROUNDS: u32 = 10;

/// How long a member waits before it reads the directory again after another
/// member settled a generation at the same time.
const CONTENDED_PAUSE: Duration = Duration::from_millis(500);

/// What the runner provides to run a query's generations: each is a query of
/// its own, with its own log in the store.
pub trait Generations: Send {
    /// What can go wrong, with what it concerns.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Where every partition of the query's topics starts under its starting
    /// options, for the query's origin.
    fn initial_offsets(
        &mut self,
    ) -> impl Future<Output = Result<PartitionOffsets, Self::Error>> + Send;

    /// The earliest offsets of partitions that appeared after the query began.
    fn earliest(
        &mut self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> impl Future<Output = Result<PartitionOffsets, Self::Error>> + Send;

    /// Runs `generation` of the query `query_id` from `starts`, one offset per
    /// partition it holds, until `stop` turns true or its trigger is done, and
    /// returns its log as it then is.
    fn run(
        &mut self,
        query_id: &str,
        generation: &Generation,
        starts: &PartitionOffsets,
        stop: watch::Receiver<bool>,
    ) -> impl Future<Output = Result<StoredBatches, Self::Error>> + Send;

    /// Claims the log of `generation`, which fences it should it still run,
    /// replays the batch it planned and did not commit, and returns the log.
    fn settle(
        &mut self,
        query_id: &str,
        generation: &Generation,
    ) -> impl Future<Output = Result<StoredBatches, Self::Error>> + Send;

    /// Removes the log of a generation of the query `query_id` whose
    /// partitions were handed back, and whatever else the generation kept
    /// (an exactly-once sink's offsets group).
    fn remove(
        &mut self,
        query_id: &str,
        generation: &Generation,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether `error` may go away by itself.
    fn is_transient(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// Why a query in group mode stopped.
#[derive(Debug, thiserror::Error)]
pub enum GroupQueryError<M, D, G>
where
    M: std::error::Error + 'static,
    D: std::error::Error + 'static,
    G: std::error::Error + 'static,
{
    /// The consumer group failed.
    #[error("{0}")]
    Membership(M),
    /// The directory failed.
    #[error("{0}")]
    Directory(D),
    /// A generation failed.
    #[error("{0}")]
    Generation(G),
    /// A generation's partitions cannot be handed back.
    #[error("{0}")]
    Unsettled(#[from] sluice_core::GroupError),
    /// Other members kept changing the rows of the partitions this member was
    /// given.
    #[error(
        "could not take {partitions} partition(s) of query {query} in {rounds} rounds: other \
         members kept changing their rows"
    )]
    Contended {
        /// The query.
        query: String,
        /// How many partitions were still not taken.
        partitions: usize,
        /// The rounds tried.
        rounds: u32,
    },
    /// A stop was requested while a call was being retried.
    #[error("stopped while retrying {what}")]
    Stopped {
        /// The call.
        what: &'static str,
    },
}

/// The error of a [`GroupQuery`] over these parts.
pub type GroupErrorOf<M, D, G> = GroupQueryError<
    <M as Membership>::Error,
    <D as PartitionDirectory>::Error,
    <G as Generations>::Error,
>;

/// What a query in group mode did in this process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupSummary {
    /// Generations this member ran.
    pub generations: u64,
    /// Generations of other members it settled.
    pub settled: u64,
}

/// One process's part of a query in group mode.
pub struct GroupQuery<M, D, G> {
    query: String,
    membership: M,
    directory: D,
    generations: G,
    retry: RetryPolicy,
}

/// A stop that is never asked for, for the calls that must finish once begun.
fn never_stopped() -> watch::Receiver<bool> {
    watch::channel(false).1
}

/// Awaits `$call` through the one retry driver ([`Driver`]) while it fails
/// transiently: the call's result or its last error, or the name of the call
/// when a stop ended the retrying. A
/// member's calls outside its generations are all short and safe to cut short,
/// and its parts have answered before them.
macro_rules! retried {
    ($policy:expr, $stop:expr, $what:expr, $transient:expr, $call:expr) => {{
        let tries = Tries::new($policy, $what, true, false);
        let mut driver = Driver::new(tries, $stop.clone(), $transient);
        match drive!(driver, $call) {
            Ok(value) => Ok(Ok(value)),
            Err(Failed::Error { error, .. }) => Ok(Err(error)),
            Err(Failed::Stopped | Failed::TimedOut { .. }) => Err($what),
        }
    }};
}

impl<M, D, G> GroupQuery<M, D, G>
where
    M: Membership,
    D: PartitionDirectory,
    G: Generations,
{
    /// The part of query `query` this process runs, with its membership in
    /// the group, the query's directory and the runner's generations.
    pub fn new(
        query: impl Into<String>,
        membership: M,
        directory: D,
        generations: G,
        retry: RetryPolicy,
    ) -> Self {
        GroupQuery {
            query: query.into(),
            membership,
            directory,
            generations,
            retry,
        }
    }

    /// The membership, for the caller to leave the group with once the query
    /// returned.
    pub fn into_membership(self) -> M {
        self.membership
    }

    /// Runs generations over whatever the group assigns to this member until
    /// `stop` turns true. A change of assignment lets the batch in flight
    /// finish and commit; then the partitions are handed back and a new
    /// generation begins over the new assignment.
    pub async fn run(
        &mut self,
        mut stop: watch::Receiver<bool>,
    ) -> Result<GroupSummary, GroupErrorOf<M, D, G>> {
        let mut summary = GroupSummary::default();
        let origin = self.originate(&mut stop).await?;
        let member = self.membership.member().to_owned();
        loop {
            if *stop.borrow() {
                return Ok(summary);
            }
            let assigned = self.membership.assignment();
            if assigned.is_empty() {
                tokio::select! {
                    change = self.membership.next_change() => {
                        // Nothing runs: a revocation of nothing goes ahead.
                        change.map_err(GroupQueryError::Membership)?;
                    }
                    _ = stop.changed() => {}
                }
                continue;
            }
            summary.generations += 1;
            let generation = Generation::new(&member, summary.generations);
            let starts = self
                .take(&origin, &generation, &assigned, &mut stop, &mut summary)
                .await?;
            tracing::info!(
                %generation,
                partitions = starts.len(),
                "generation starts over the partitions the group assigned"
            );
            let (ended, revocation) = self
                .run_generation(&origin.query_id, &generation, &starts, &mut stop)
                .await;
            let stored = ended.map_err(GroupQueryError::Generation)?;
            // Handed back even when stopping: the next holder starts at once
            // instead of settling this generation.
            let mut never = never_stopped();
            match self
                .hand_back(&origin.query_id, &generation, &stored, &mut never)
                .await
            {
                Err(GroupQueryError::Unsettled(unsettled)) => {
                    // Stopped inside a batch, as when a plan's write was being
                    // retried: its batch is replayed as anyone's would be.
                    tracing::warn!(%unsettled, "settling this member's own generation");
                    if self
                        .settle(&origin.query_id, &generation, &mut never)
                        .await?
                    {
                        summary.settled += 1;
                    }
                }
                ended => ended?,
            }
            tracing::info!(%generation, "generation ended and handed its partitions back");
            drop(revocation);
        }
    }

    /// Runs one generation until its trigger is done, the assignment changes
    /// or a stop is asked for. A revocation is returned still pending, to be
    /// completed once the partitions are handed back.
    async fn run_generation(
        &mut self,
        query_id: &str,
        generation: &Generation,
        starts: &PartitionOffsets,
        stop: &mut watch::Receiver<bool>,
    ) -> (Result<StoredBatches, G::Error>, Option<Revocation>) {
        let (ask, asked) = watch::channel(false);
        let mut revocation = None;
        let membership = &mut self.membership;
        let run = self.generations.run(query_id, generation, starts, asked);
        tokio::pin!(run);
        let mut stopping = false;
        loop {
            tokio::select! {
                ended = &mut run => return (ended, revocation),
                change = membership.next_change(), if !stopping => {
                    match change {
                        Ok(MembershipChange::Revoking(r)) => {
                            tracing::info!(%generation, revoked = r.partitions.len(),
                                "the group takes partitions away: finishing the batch in flight");
                            revocation = Some(r);
                        }
                        // The assignment read when the generation began
                        // already held them: the event was queued before.
                        Ok(MembershipChange::Assigned(given))
                            if given.iter().all(|tp| starts.contains_key(tp)) =>
                        {
                            tracing::debug!(%generation, assigned = given.len(),
                                "the group's assignment is the generation's already");
                            continue;
                        }
                        Ok(MembershipChange::Assigned(given)) => {
                            tracing::info!(%generation, assigned = given.len(),
                                "the group gave more partitions: finishing the batch in flight");
                        }
                        Ok(MembershipChange::Lost(lost)) => {
                            tracing::warn!(%generation, lost = lost.len(),
                                "this member's session expired and its partitions may be \
                                 another's already: finishing the batch in flight, whose \
                                 commit is refused if they are");
                        }
                        Err(error) => {
                            tracing::error!(%error, %generation, "the consumer group failed");
                        }
                    }
                    stopping = true;
                    let _ = ask.send(true);
                }
                changed = stop.changed(), if !stopping => {
                    if changed.is_err() || *stop.borrow() {
                        stopping = true;
                        let _ = ask.send(true);
                    }
                }
            }
        }
    }

    /// The query's origin: the first member's, or this member's if it is first.
    async fn originate(
        &mut self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Origin, GroupErrorOf<M, D, G>> {
        let directory = self.read_directory(stop).await?;
        if let Some(origin) = directory.origin {
            return Ok(origin);
        }
        let generations = &mut self.generations;
        let initial = retried!(
            self.retry,
            stop,
            "resolving the query's starting offsets",
            G::is_transient,
            generations.initial_offsets()
        )
        .map_err(|what| GroupQueryError::Stopped { what })?
        .map_err(GroupQueryError::Generation)?;
        let origin = Origin {
            query_id: uuid::Uuid::new_v4().to_string(),
            initial,
        };
        let directory = &mut self.directory;
        retried!(
            self.retry,
            stop,
            "recording the query's origin",
            D::is_transient,
            directory.originate(&origin)
        )
        .map_err(|what| GroupQueryError::Stopped { what })?
        .map_err(GroupQueryError::Directory)
    }

    async fn read_directory(
        &mut self,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<sluice_core::Directory, GroupErrorOf<M, D, G>> {
        let directory = &mut self.directory;
        retried!(
            self.retry,
            stop,
            "reading the query's directory",
            D::is_transient,
            directory.read()
        )
        .map_err(|what| GroupQueryError::Stopped { what })?
        .map_err(GroupQueryError::Directory)
    }

    /// Takes every assigned partition for `generation`, settling the
    /// generations that still hold some, and returns where each starts.
    async fn take(
        &mut self,
        origin: &Origin,
        generation: &Generation,
        assigned: &BTreeSet<TopicPartition>,
        stop: &mut watch::Receiver<bool>,
        summary: &mut GroupSummary,
    ) -> Result<PartitionOffsets, GroupErrorOf<M, D, G>> {
        let mut missing = assigned.len();
        for _ in 0..TAKE_ROUNDS {
            let directory = self.read_directory(stop).await?;
            let mut starts = PartitionOffsets::new();
            let mut earliest = BTreeSet::new();
            let mut holders = BTreeSet::new();
            for tp in assigned {
                match directory.start_of(tp) {
                    PartitionStart::At(offset) => {
                        starts.insert(tp.clone(), offset);
                    }
                    PartitionStart::Earliest => {
                        earliest.insert(tp.clone());
                    }
                    // Taken in an earlier round whose answer was lost.
                    PartitionStart::HeldBy(holder) if &holder == generation => {
                        starts.insert(tp.clone(), directory.entries[tp].start);
                    }
                    PartitionStart::HeldBy(holder) => {
                        holders.insert(holder);
                    }
                }
            }
            if !holders.is_empty() {
                for holder in holders {
                    if self.settle(&origin.query_id, &holder, stop).await? {
                        summary.settled += 1;
                    }
                }
                continue;
            }
            if !earliest.is_empty() {
                let generations = &mut self.generations;
                let found = retried!(
                    self.retry,
                    stop,
                    "looking up the earliest offsets of new partitions",
                    G::is_transient,
                    generations.earliest(&earliest)
                )
                .map_err(|what| GroupQueryError::Stopped { what })?
                .map_err(GroupQueryError::Generation)?;
                starts.extend(found);
            }
            let mut all_taken = true;
            missing = 0;
            for tp in assigned {
                let expected = directory.entries.get(tp);
                if expected.is_some_and(|e| e.owner.as_ref() == Some(generation)) {
                    continue;
                }
                let Some(&start) = starts.get(tp) else {
                    all_taken = false;
                    missing += 1;
                    continue;
                };
                let directory = &mut self.directory;
                let taken = retried!(
                    self.retry,
                    stop,
                    "taking a partition in the query's directory",
                    D::is_transient,
                    directory.take(tp, expected, generation, start)
                )
                .map_err(|what| GroupQueryError::Stopped { what })?
                .map_err(GroupQueryError::Directory)?;
                if !taken {
                    all_taken = false;
                    missing += 1;
                }
            }
            if all_taken {
                return Ok(starts);
            }
        }
        Err(GroupQueryError::Contended {
            query: self.query.clone(),
            partitions: missing,
            rounds: TAKE_ROUNDS,
        })
    }

    /// Settles `holder`, a generation that did not hand its partitions back:
    /// fences its log, replays its uncommitted batch, hands all its partitions
    /// back and removes its log. False when another member settled it at the
    /// same moment; the directory says how far it got.
    async fn settle(
        &mut self,
        query_id: &str,
        holder: &Generation,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<bool, GroupErrorOf<M, D, G>> {
        tracing::warn!(
            generation = %holder,
            "a generation holds partitions this member was given: settling it (fencing its log \
             and replaying its uncommitted batch)"
        );
        let stored = match self.generations.settle(query_id, holder).await {
            Ok(stored) => stored,
            Err(error) => {
                // Most likely another member settles it too and fenced this
                // claim; the next read of the directory shows how far it got.
                tracing::warn!(%error, generation = %holder, "settling the generation failed");
                tokio::time::sleep(CONTENDED_PAUSE).await;
                return Ok(false);
            }
        };
        self.hand_back(query_id, holder, &stored, stop).await?;
        Ok(true)
    }

    /// Hands every partition of `generation` back at its committed end and
    /// removes its log.
    async fn hand_back(
        &mut self,
        query_id: &str,
        generation: &Generation,
        stored: &StoredBatches,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(), GroupErrorOf<M, D, G>> {
        let read = self.read_directory(stop).await?;
        let ends = settled_ends(&read, generation, stored)?;
        let directory = &mut self.directory;
        retried!(
            self.retry,
            stop,
            "handing partitions back in the query's directory",
            D::is_transient,
            directory.hand_back(generation, &ends)
        )
        .map_err(|what| GroupQueryError::Stopped { what })?
        .map_err(GroupQueryError::Directory)?;
        let generations = &mut self.generations;
        let removed = retried!(
            self.retry,
            stop,
            "removing what a generation kept",
            G::is_transient,
            generations.remove(query_id, generation)
        );
        // Nothing reads the log once its partitions are handed back; another
        // member that settled the same generation at the same moment may have
        // claimed or removed it first.
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, %generation, "removing what the generation kept (its log, its sink's offsets group) failed; it is left behind");
            }
            Err(what) => return Err(GroupQueryError::Stopped { what }),
        }
        Ok(())
    }
}
