//! What a query does on start, decided from the batches its store holds.

use std::fmt;

use crate::BatchId;

/// The two logs of an offset store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Log {
    /// Batch plans, written before a batch reads anything (Spark's `offsets/`).
    Plans,
    /// Batch commits, written after the sink has a batch (Spark's `commits/`).
    Commits,
}

impl fmt::Display for Log {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Log::Plans => "plan",
            Log::Commits => "commit",
        })
    }
}

/// How a query resumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Nothing was ever planned: start from the starting offsets as batch 0.
    StartFresh,
    /// Every plan is committed: plan `next`, starting where `last_committed` ended.
    RunNext {
        /// The newest committed batch.
        last_committed: BatchId,
        /// The batch to plan.
        next: BatchId,
    },
    /// `batch` was planned but not committed: run it again with its plan unchanged.
    Replay {
        /// The batch to replay.
        batch: BatchId,
    },
}

/// Logs that contradict each other: recovery refuses to guess, and names the
/// entries that disagree so that a person can look at them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    /// A commit without the plan it commits.
    #[error("batch {batch} has a commit but no plan")]
    CommitWithoutPlan {
        /// The committed batch.
        batch: BatchId,
    },
    /// A log skips a batch between two it holds.
    #[error("the {log} of batch {missing} is missing between batches {before} and {after}")]
    Gap {
        /// The log with the gap.
        log: Log,
        /// The first missing batch.
        missing: BatchId,
        /// The batch before the gap.
        before: BatchId,
        /// The batch after the gap.
        after: BatchId,
    },
    /// More than one batch is planned beyond the newest commit, which a
    /// write-ahead log never produces.
    #[error(
        "batch {latest_plan} is planned but the newest commit is {}; only the batch right \
         after the newest commit may lack one",
        latest_commit.map_or_else(|| "none".to_owned(), |c| format!("batch {c}"))
    )]
    PlannedAhead {
        /// The newest plan.
        latest_plan: BatchId,
        /// The newest commit, if any.
        latest_commit: Option<BatchId>,
    },
}

impl Inconsistency {
    /// The log entries that disagree, so a store can name its files or rows.
    pub fn entries(&self) -> Vec<(Log, BatchId)> {
        match *self {
            Inconsistency::CommitWithoutPlan { batch } => vec![(Log::Commits, batch)],
            Inconsistency::Gap {
                log, before, after, ..
            } => vec![(log, before), (log, after)],
            Inconsistency::PlannedAhead {
                latest_plan,
                latest_commit,
            } => {
                let mut entries = vec![(Log::Plans, latest_plan)];
                entries.extend(latest_commit.map(|c| (Log::Commits, c)));
                entries
            }
        }
    }
}

/// Decides how to resume from the batch ids in each log, both in ascending order.
/// Old entries may have been purged from either log; what remains must be
/// contiguous, and the plans must reach exactly the newest commit or one past it.
pub fn decide_recovery(
    planned: &[BatchId],
    committed: &[BatchId],
) -> Result<Recovery, Inconsistency> {
    find_gap(Log::Plans, planned)?;
    find_gap(Log::Commits, committed)?;
    let latest_commit = committed.last().copied();
    let Some(&latest_plan) = planned.last() else {
        return match latest_commit {
            None => Ok(Recovery::StartFresh),
            Some(batch) => Err(Inconsistency::CommitWithoutPlan { batch }),
        };
    };
    match latest_commit {
        Some(commit) if commit > latest_plan => {
            Err(Inconsistency::CommitWithoutPlan { batch: commit })
        }
        Some(commit) if commit == latest_plan => Ok(Recovery::RunNext {
            last_committed: commit,
            next: commit.next(),
        }),
        Some(commit) if commit.next() == latest_plan => Ok(Recovery::Replay { batch: latest_plan }),
        None if latest_plan == BatchId::FIRST => Ok(Recovery::Replay { batch: latest_plan }),
        _ => Err(Inconsistency::PlannedAhead {
            latest_plan,
            latest_commit,
        }),
    }
}

fn find_gap(log: Log, ids: &[BatchId]) -> Result<(), Inconsistency> {
    for pair in ids.windows(2) {
        if pair[0].next() != pair[1] {
            return Err(Inconsistency::Gap {
                log,
                missing: pair[0].next(),
                before: pair[0],
                after: pair[1],
            });
        }
    }
    Ok(())
}

/// How many batches a store keeps by default, as Spark's `minBatchesToRetain`.
pub const DEFAULT_MIN_BATCHES_TO_RETAIN: u64 = 100;

/// The oldest batch to keep when `min_batches_to_retain` batches are kept after
/// `latest` is committed, or `None` when nothing is old enough to purge.
pub fn purge_threshold(latest: BatchId, min_batches_to_retain: u64) -> Option<BatchId> {
    let keep_from = latest
        .0
        .checked_add(1)?
        .checked_sub(min_batches_to_retain.max(1))?;
    (keep_from > 0).then_some(BatchId(keep_from))
}

/// How many batches past `min_batches_to_retain` a store may hold before they
/// are purged together: three tenths of it, at least one, as Spark 4's
/// `ratioExtraSpaceAllowedInCheckpoint` (0.3) does for state versions.
pub fn purge_interval(min_batches_to_retain: u64) -> u64 {
    (min_batches_to_retain.saturating_mul(3).saturating_add(5) / 10).max(1)
}

/// The [`purge_threshold`] after `latest` is committed, when it is time to
/// purge: once every [`purge_interval`] batches, so that a store deletes old
/// entries in bulk rather than two with every batch (each purge of the Cassandra
/// store is a serial read and two range deletions, each leaving a tombstone in
/// the query's partition). A store then holds `min_batches_to_retain` to
/// `min_batches_to_retain + purge_interval - 1` batches, and a restart purges
/// everything older at the next due batch.
pub fn purge_due(latest: BatchId, min_batches_to_retain: u64) -> Option<BatchId> {
    purge_threshold(latest, min_batches_to_retain)
        .filter(|keep_from| keep_from.0 % purge_interval(min_batches_to_retain) == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(range: std::ops::Range<u64>) -> Vec<BatchId> {
        range.map(BatchId).collect()
    }

    #[test]
    fn purges_come_every_three_tenths_of_the_retention_and_keep_what_recovery_needs() {
        assert_eq!(purge_interval(100), 30);
        assert_eq!(purge_interval(5), 2);
        assert_eq!(purge_interval(3), 1);
        assert_eq!(purge_interval(1), 1);
        assert_eq!(purge_interval(u64::MAX), u64::MAX / 10);
        let due: Vec<u64> = (0..200)
            .filter_map(|b| purge_due(BatchId(b), 100).map(|k| k.0))
            .collect();
        assert_eq!(due, vec![30, 60, 90]);
        // Between purges the store holds at least the retention and less than the
        // retention and the interval.
        let mut oldest = 0;
        for latest in 0..1000u64 {
            if let Some(keep_from) = purge_due(BatchId(latest), 100) {
                oldest = keep_from.0;
            }
            let held = latest + 1 - oldest;
            assert!(held >= 100.min(latest + 1), "batch {latest}: {held} held");
            assert!(held < 130, "batch {latest}: {held} held");
        }
        // Retaining one batch purges after every batch, as before.
        assert_eq!(purge_due(BatchId(7), 1), purge_threshold(BatchId(7), 1));
    }

    #[test]
    fn empty_logs_start_fresh() {
        assert_eq!(decide_recovery(&[], &[]), Ok(Recovery::StartFresh));
    }

    #[test]
    fn a_committed_plan_runs_the_next_batch() {
        assert_eq!(
            decide_recovery(&ids(0..5), &ids(0..5)),
            Ok(Recovery::RunNext {
                last_committed: BatchId(4),
                next: BatchId(5)
            })
        );
    }

    #[test]
    fn an_uncommitted_plan_is_replayed() {
        assert_eq!(
            decide_recovery(&ids(0..6), &ids(0..5)),
            Ok(Recovery::Replay { batch: BatchId(5) })
        );
        assert_eq!(
            decide_recovery(&ids(0..1), &[]),
            Ok(Recovery::Replay { batch: BatchId(0) })
        );
    }

    #[test]
    fn purged_heads_are_fine() {
        assert_eq!(
            decide_recovery(&ids(90..101), &ids(90..100)),
            Ok(Recovery::Replay {
                batch: BatchId(100)
            })
        );
    }

    #[test]
    fn inconsistent_logs_are_refused_with_the_entries_named() {
        let err = decide_recovery(&ids(0..3), &ids(0..4)).unwrap_err();
        assert_eq!(err, Inconsistency::CommitWithoutPlan { batch: BatchId(3) });
        assert_eq!(err.entries(), vec![(Log::Commits, BatchId(3))]);

        let err = decide_recovery(&[BatchId(0), BatchId(1), BatchId(3)], &ids(0..2)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the plan of batch 2 is missing between batches 1 and 3"
        );

        let err = decide_recovery(&ids(0..4), &[BatchId(0), BatchId(2)]).unwrap_err();
        assert!(matches!(
            err,
            Inconsistency::Gap {
                log: Log::Commits,
                ..
            }
        ));

        let err = decide_recovery(&ids(0..5), &ids(0..2)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "batch 4 is planned but the newest commit is batch 1; only the batch right after \
             the newest commit may lack one"
        );
        assert!(decide_recovery(&ids(3..4), &[]).is_err());
        assert!(decide_recovery(&[], &ids(0..1)).is_err());
    }

    #[test]
    fn purge_keeps_the_newest_batches() {
        assert_eq!(purge_threshold(BatchId(99), 100), None);
        assert_eq!(purge_threshold(BatchId(100), 100), Some(BatchId(1)));
        assert_eq!(purge_threshold(BatchId(5), 2), Some(BatchId(4)));
        assert_eq!(purge_threshold(BatchId(5), 0), Some(BatchId(5)));
    }

    proptest! {
        #[test]
        fn recovery_is_consistent_with_the_logs(
            first_plan in 0..50_u64,
            plans in 0..30_u64,
            first_commit in 0..60_u64,
            commits in 0..30_u64,
        ) {
            let planned = ids(first_plan..first_plan + plans);
            let committed = ids(first_commit..first_commit + commits);
            match decide_recovery(&planned, &committed) {
                Ok(Recovery::StartFresh) => {
                    prop_assert!(planned.is_empty() && committed.is_empty());
                }
                Ok(Recovery::RunNext { last_committed, next }) => {
                    prop_assert_eq!(planned.last(), Some(&last_committed));
                    prop_assert_eq!(committed.last(), Some(&last_committed));
                    prop_assert_eq!(next, last_committed.next());
                }
                Ok(Recovery::Replay { batch }) => {
                    prop_assert_eq!(planned.last(), Some(&batch));
                    prop_assert!(!committed.contains(&batch));
                    prop_assert_eq!(committed.last().map(|c| c.next()).unwrap_or(BatchId(0)), batch);
                }
                Err(e) => {
                    // Refusals name entries that exist in the logs they name.
                    for (log, id) in e.entries() {
                        let present = match log {
                            Log::Plans => planned.contains(&id),
                            Log::Commits => committed.contains(&id),
                        };
                        prop_assert!(present, "{e} names {log} {id}, which does not exist");
                    }
                }
            }
        }
    }
}
