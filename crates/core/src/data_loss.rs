//! Data loss: when the offsets a batch needs are no longer, or not yet, in Kafka.

use std::collections::BTreeMap;
use std::fmt;

use crate::{Offset, OffsetRange, PartitionOffsets, TopicPartition};

/// The offsets a partition holds now: its earliest available offset (Kafka's low
/// watermark) and its end (the high watermark, the offset the next record will
/// get). Not to be confused with an event-time watermark, which is a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OffsetBounds {
    /// The earliest offset still in the partition.
    pub low: Offset,
    /// The offset after the last record.
    pub high: Offset,
}

/// One partition whose planned offsets Kafka cannot serve. Each case carries what
/// an error message needs, and where reading continues when loss is tolerated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLoss {
    /// The planned start was purged, typically by retention: `[planned, earliest)` is lost.
    Purged {
        /// The partition.
        topic_partition: TopicPartition,
        /// Where the batch was to start.
        planned: Offset,
        /// The partition's low watermark now.
        earliest_available: Offset,
        /// The partition's high watermark now.
        latest_available: Offset,
    },
    /// The planned start lies beyond the partition's end: the topic was deleted and
    /// recreated, or the start offset was set too high.
    AheadOfEnd {
        /// The partition.
        topic_partition: TopicPartition,
        /// Where the batch was to start.
        planned: Offset,
        /// The partition's low watermark now.
        earliest_available: Offset,
        /// The partition's high watermark now.
        latest_available: Offset,
    },
    /// The partition no longer exists: the topic was deleted.
    PartitionGone {
        /// The partition.
        topic_partition: TopicPartition,
        /// Where the batch was to start.
        planned: Offset,
    },
    /// A partition appeared whose records no longer start at 0: `[0, earliest)` was
    /// purged before Sluice could read it.
    NewPartitionNotAtZero {
        /// The partition.
        topic_partition: TopicPartition,
        /// The partition's low watermark now.
        earliest_available: Offset,
    },
}

impl DataLoss {
    /// The partition concerned.
    pub fn topic_partition(&self) -> &TopicPartition {
        match self {
            DataLoss::Purged {
                topic_partition, ..
            }
            | DataLoss::AheadOfEnd {
                topic_partition, ..
            }
            | DataLoss::PartitionGone {
                topic_partition, ..
            }
            | DataLoss::NewPartitionNotAtZero {
                topic_partition, ..
            } => topic_partition,
        }
    }

    /// The offsets known to be lost, when they are known.
    pub fn lost_range(&self) -> Option<OffsetRange> {
        let (tp, from, until) = match self {
            DataLoss::Purged {
                topic_partition,
                planned,
                earliest_available,
                ..
            } => (topic_partition, *planned, *earliest_available),
            DataLoss::NewPartitionNotAtZero {
                topic_partition,
                earliest_available,
            } => (topic_partition, Offset::ZERO, *earliest_available),
            DataLoss::AheadOfEnd { .. } | DataLoss::PartitionGone { .. } => return None,
        };
        Some(OffsetRange {
            topic_partition: tp.clone(),
            from,
            until,
        })
    }

    /// How many offsets are known to be lost (0 where it cannot be known).
    pub fn lost_offsets(&self) -> u64 {
        self.lost_range().map_or(0, |r| r.len())
    }

    /// Where reading continues when data loss is tolerated: the earliest offset
    /// available, or `None` for a partition that is gone.
    pub fn resume_at(&self) -> Option<Offset> {
        match self {
            DataLoss::Purged {
                earliest_available, ..
            }
            | DataLoss::AheadOfEnd {
                earliest_available, ..
            }
            | DataLoss::NewPartitionNotAtZero {
                earliest_available, ..
            } => Some(*earliest_available),
            DataLoss::PartitionGone { .. } => None,
        }
    }

    /// The probable cause, in words for an error message.
    pub fn probable_cause(&self) -> &'static str {
        match self {
            DataLoss::Purged { .. } => {
                "the records were deleted by retention (retention.ms or retention.bytes) or by \
                 delete-records before they were read"
            }
            DataLoss::AheadOfEnd { .. } => {
                "the topic was deleted and recreated, or the start offset was set beyond the end \
                 of the partition"
            }
            DataLoss::PartitionGone { .. } => "the topic was deleted",
            DataLoss::NewPartitionNotAtZero { .. } => {
                "the partition was added and its first records were deleted by retention before \
                 they were read"
            }
        }
    }
}

impl fmt::Display for DataLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataLoss::Purged {
                topic_partition,
                planned,
                earliest_available,
                latest_available,
            } => write!(
                f,
                "{topic_partition}: offsets [{planned}, {earliest_available}) are lost: the batch \
                 starts at {planned} but the partition now holds [{earliest_available}, \
                 {latest_available})"
            ),
            DataLoss::AheadOfEnd {
                topic_partition,
                planned,
                earliest_available,
                latest_available,
            } => write!(
                f,
                "{topic_partition}: the batch starts at {planned}, beyond the partition's end; it \
                 now holds [{earliest_available}, {latest_available})"
            ),
            DataLoss::PartitionGone {
                topic_partition,
                planned,
            } => write!(
                f,
                "{topic_partition}: the partition no longer exists; the batch was to start at {planned}"
            ),
            DataLoss::NewPartitionNotAtZero {
                topic_partition,
                earliest_available,
            } => write!(
                f,
                "{topic_partition}: new partition starts at {earliest_available} instead of 0, so \
                 offsets [0, {earliest_available}) are lost"
            ),
        }?;
        write!(f, " (probable cause: {})", self.probable_cause())
    }
}

/// Judges one partition. `planned` is `None` for a partition the query has not
/// read before; `watermarks` is `None` when Kafka no longer knows the partition.
/// `None` means the planned offsets are all there.
pub fn classify_data_loss(
    topic_partition: &TopicPartition,
    planned: Option<Offset>,
    watermarks: Option<OffsetBounds>,
) -> Option<DataLoss> {
    let topic_partition = topic_partition.clone();
    match (planned, watermarks) {
        (Some(planned), Some(w)) if planned < w.low => Some(DataLoss::Purged {
            topic_partition,
            planned,
            earliest_available: w.low,
            latest_available: w.high,
        }),
        (Some(planned), Some(w)) if planned > w.high => Some(DataLoss::AheadOfEnd {
            topic_partition,
            planned,
            earliest_available: w.low,
            latest_available: w.high,
        }),
        (Some(_), Some(_)) => None,
        (Some(planned), None) => Some(DataLoss::PartitionGone {
            topic_partition,
            planned,
        }),
        (None, Some(w)) if w.low > Offset::ZERO => Some(DataLoss::NewPartitionNotAtZero {
            topic_partition,
            earliest_available: w.low,
        }),
        (None, _) => None,
    }
}

/// Judges every partition a batch starts from, and every partition Kafka has
/// that the batch did not know, in topic-partition order.
pub fn classify_batch(
    planned: &PartitionOffsets,
    current: &BTreeMap<TopicPartition, OffsetBounds>,
) -> Vec<DataLoss> {
    let mut partitions: Vec<&TopicPartition> = planned.keys().chain(current.keys()).collect();
    partitions.sort();
    partitions.dedup();
    partitions
        .into_iter()
        .filter_map(|tp| classify_data_loss(tp, planned.get(tp).copied(), current.get(tp).copied()))
        .collect()
}

/// The message a query stops with when `fail_on_data_loss` is set: every lost
/// partition on its own line, and how to go on instead.
pub fn data_loss_report(losses: &[DataLoss]) -> String {
    let mut text = format!(
        "data loss in {} partition{} and fail_on_data_loss is true, so the query stops:",
        losses.len(),
        if losses.len() == 1 { "" } else { "s" }
    );
    for loss in losses {
        text.push_str("\n  ");
        text.push_str(&loss.to_string());
    }
    text.push_str(
        "\nTo skip ahead to the earliest available offsets and report the loss instead, set \
         fail_on_data_loss = false.",
    );
    text
}

/// What `fail_on_data_loss` decides for the losses of one batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLossDecision {
    /// Nothing is lost.
    None,
    /// Stop: the query must not go on without the lost offsets.
    Fail(Vec<DataLoss>),
    /// Go on: the start offsets were moved past the losses, which are reported.
    Skip(Vec<DataLoss>),
}

/// Applies `fail_on_data_loss` to a batch's start offsets. When loss is
/// tolerated, each affected partition moves to its earliest available offset,
/// a partition that is gone is dropped, and a new partition starts where its
/// records now start.
pub fn apply_data_loss_policy(
    start: &mut PartitionOffsets,
    losses: Vec<DataLoss>,
    fail_on_data_loss: bool,
) -> DataLossDecision {
    if losses.is_empty() {
        return DataLossDecision::None;
    }
    if fail_on_data_loss {
        return DataLossDecision::Fail(losses);
    }
    for loss in &losses {
        match loss.resume_at() {
            Some(offset) => {
                start.insert(loss.topic_partition().clone(), offset);
            }
            None => {
                start.remove(loss.topic_partition());
            }
        }
    }
    DataLossDecision::Skip(losses)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> TopicPartition {
        TopicPartition::new("events", p)
    }

    fn off(v: i64) -> Offset {
        Offset::new(v).unwrap()
    }

    fn marks(low: i64, high: i64) -> Option<OffsetBounds> {
        Some(OffsetBounds {
            low: off(low),
            high: off(high),
        })
    }

    #[test]
    fn offsets_within_the_watermarks_are_fine() {
        assert_eq!(classify_data_loss(&tp(0), Some(off(5)), marks(5, 9)), None);
        assert_eq!(classify_data_loss(&tp(0), Some(off(9)), marks(5, 9)), None);
        assert_eq!(classify_data_loss(&tp(0), None, marks(0, 9)), None);
    }

    #[test]
    fn a_start_before_the_low_watermark_lost_the_range_between() {
        let loss = classify_data_loss(&tp(4), Some(off(23_456)), marks(30_000, 31_000)).unwrap();
        assert_eq!(loss.lost_offsets(), 6_544);
        assert_eq!(loss.resume_at(), Some(off(30_000)));
        assert_eq!(
            loss.to_string(),
            "events-4: offsets [23456, 30000) are lost: the batch starts at 23456 but the \
             partition now holds [30000, 31000) (probable cause: the records were deleted by \
             retention (retention.ms or retention.bytes) or by delete-records before they were read)"
        );
    }

    #[test]
    fn a_start_beyond_the_end_means_recreated_or_set_too_high() {
        let loss = classify_data_loss(&tp(1), Some(off(500)), marks(0, 20)).unwrap();
        assert!(matches!(loss, DataLoss::AheadOfEnd { .. }));
        assert_eq!(loss.lost_range(), None);
        assert_eq!(loss.resume_at(), Some(off(0)));
        assert!(loss.to_string().contains("recreated"));
    }

    #[test]
    fn gone_and_new_partitions() {
        let gone = classify_data_loss(&tp(2), Some(off(7)), None).unwrap();
        assert_eq!(gone.resume_at(), None);
        assert!(gone.to_string().contains("no longer exists"));

        let new = classify_data_loss(&tp(3), None, marks(40, 50)).unwrap();
        assert_eq!(new.lost_offsets(), 40);
        assert!(new.to_string().contains("instead of 0"));
    }

    #[test]
    fn the_policy_fails_or_moves_the_start_past_the_loss() {
        let planned = PartitionOffsets::from([(tp(0), off(3)), (tp(1), off(9)), (tp(2), off(4))]);
        let current = BTreeMap::from([
            (tp(0), marks(5, 10).unwrap()),
            (tp(2), marks(0, 10).unwrap()),
        ]);
        let losses = classify_batch(&planned, &current);

        let mut start = planned.clone();
        let decision = apply_data_loss_policy(&mut start, losses.clone(), true);
        assert_eq!(decision, DataLossDecision::Fail(losses.clone()));
        assert_eq!(start, planned, "failing leaves the start alone");

        let decision = apply_data_loss_policy(&mut start, losses.clone(), false);
        assert_eq!(decision, DataLossDecision::Skip(losses));
        assert_eq!(
            start,
            PartitionOffsets::from([(tp(0), off(5)), (tp(2), off(4))])
        );

        assert_eq!(
            apply_data_loss_policy(&mut start, Vec::new(), true),
            DataLossDecision::None
        );
    }

    #[test]
    fn a_batch_is_judged_over_old_and_new_partitions() {
        let planned = PartitionOffsets::from([(tp(0), off(3)), (tp(1), off(9))]);
        let current = BTreeMap::from([
            (tp(0), marks(5, 10).unwrap()),
            (tp(2), marks(1, 10).unwrap()),
        ]);
        let losses = classify_batch(&planned, &current);
        let partitions: Vec<i32> = losses
            .iter()
            .map(|l| l.topic_partition().partition)
            .collect();
        assert_eq!(partitions, vec![0, 1, 2]);
    }
}
