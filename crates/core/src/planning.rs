//! What the next batch may read, from where the last one ended and what the
//! source reported: where each partition starts, how far it may go, and how
//! much that is. The executor asks the source and the store; every decision
//! between their answers is made here.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use crate::{Offset, OffsetBounds, PartitionOffsets, TopicPartition, rate_limit};

/// What a trigger may read, per partition, before the rate limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reach {
    /// Where each partition starts: every discovered partition, those the query
    /// has not read yet at their first offset.
    pub from: PartitionOffsets,
    /// How far each may be read: its latest offset, or less under a cap.
    pub reachable: PartitionOffsets,
    /// The latest offset of each discovered partition, for progress reports.
    pub latest: PartitionOffsets,
}

impl Reach {
    /// The reach of a batch that starts at `from` on the discovered
    /// `partitions`, reading no further than `cap` where it is given.
    ///
    /// A partition `from` does not name is new (created since the last batch, or
    /// matched by a pattern since): it starts at its low offset, its first offset
    /// unless that was lost, which data-loss classification has judged already.
    /// `cap` is `available_now`'s: the latest offsets when the query started, so
    /// that it reads what was there then and stops. A partition never reaches
    /// back before its start.
    ///
    /// Keys are the discovered partitions, whose topic names the source shares,
    /// so that the batch's maps compare them by address.
    pub fn of(
        from: PartitionOffsets,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
        cap: Option<&PartitionOffsets>,
    ) -> Reach {
        let mut from: PartitionOffsets = from
            .into_iter()
            .map(|(tp, at)| match partitions.get_key_value(&tp) {
                Some((known, _)) => (known.clone(), at),
                None => (tp, at),
            })
            .collect();
        for (tp, bounds) in partitions {
            from.entry(tp.clone()).or_insert(bounds.low);
        }
        let latest: PartitionOffsets = partitions
            .iter()
            .map(|(tp, bounds)| (tp.clone(), bounds.high))
            .collect();
        let reachable = match cap {
            Some(cap) => from
                .iter()
                .map(|(tp, start)| {
                    let capped = cap.get(tp).copied().unwrap_or(*start);
                    let high = latest.get(tp).copied().unwrap_or(*start);
                    (tp.clone(), capped.min(high).max(*start))
                })
                .collect(),
            None => latest.clone(),
        };
        Reach {
            from,
            reachable,
            latest,
        }
    }

    /// How many offsets could be read in all.
    pub fn available(&self) -> u64 {
        self.from
            .iter()
            .map(|(tp, start)| {
                self.reachable
                    .get(tp)
                    .map_or(0, |end| start.distance_to(*end))
            })
            .sum()
    }

    /// Where the batch ends under `budget` offsets ([`rate_limit`]).
    pub fn end(&self, budget: Option<NonZeroU64>) -> PartitionOffsets {
        rate_limit(&self.from, &self.reachable, budget)
    }

    /// Where a partition starts.
    pub fn start_of(&self, tp: &TopicPartition) -> Option<Offset> {
        self.from.get(tp).copied()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn tp(p: i32) -> TopicPartition {
        TopicPartition::new("t", p)
    }

    fn at(v: i64) -> Offset {
        Offset::new(v).unwrap()
    }

    /// Partitions `0..n` with their bounds, and where the query stands on some
    /// of them (`None` for one it has not read).
    fn scene() -> impl Strategy<
        Value = (
            BTreeMap<TopicPartition, OffsetBounds>,
            PartitionOffsets,
            PartitionOffsets,
        ),
    > {
        prop::collection::vec(
            (
                0..1_000_i64,
                0..1_000_i64,
                prop::option::of(0..1_000_i64),
                0..1_500_i64,
            ),
            1..12,
        )
        .prop_map(|parts| {
            let mut partitions = BTreeMap::new();
            let mut from = PartitionOffsets::new();
            let mut cap = PartitionOffsets::new();
            for (p, (low, len, read, capped)) in parts.into_iter().enumerate() {
                let p = p as i32;
                partitions.insert(
                    tp(p),
                    OffsetBounds {
                        low: at(low),
                        high: at(low + len),
                    },
                );
                if let Some(read) = read {
                    // Where the query stands lies within the partition: data
                    // loss has moved it there.
                    from.insert(tp(p), at(low + read.min(len)));
                }
                cap.insert(tp(p), at(capped));
            }
            (partitions, from, cap)
        })
    }

    #[test]
    fn a_new_partition_starts_at_its_first_offset_and_a_known_one_where_it_stood() {
        let partitions = BTreeMap::from([
            (
                tp(0),
                OffsetBounds {
                    low: at(0),
                    high: at(50),
                },
            ),
            (
                tp(1),
                OffsetBounds {
                    low: at(7),
                    high: at(9),
                },
            ),
        ]);
        let reach = Reach::of(PartitionOffsets::from([(tp(0), at(40))]), &partitions, None);
        assert_eq!(reach.start_of(&tp(0)), Some(at(40)));
        assert_eq!(reach.start_of(&tp(1)), Some(at(7)));
        assert_eq!(reach.available(), 10 + 2);
        let end = reach.end(NonZeroU64::new(4));
        let read = |p| reach.from[&tp(p)].distance_to(end[&tp(p)]);
        assert_eq!(read(0) + read(1), 4);
        assert!(read(1) >= 1, "the smaller backlog is not starved");
    }

    proptest! {
        #[test]
        fn every_partition_starts_where_it_stood_or_at_its_low_offset(
            (partitions, from, _) in scene(),
        ) {
            let reach = Reach::of(from.clone(), &partitions, None);
            for (tp, bounds) in &partitions {
                let start = reach.from[tp];
                match from.get(tp) {
                    Some(stood) => prop_assert_eq!(start, *stood),
                    None => prop_assert_eq!(start, bounds.low),
                }
                prop_assert_eq!(reach.latest[tp], bounds.high);
                prop_assert_eq!(reach.reachable[tp], bounds.high);
            }
            prop_assert_eq!(reach.from.len(), partitions.len());
        }

        #[test]
        fn a_cap_is_never_passed_and_never_reaches_back_before_a_start(
            (partitions, from, cap) in scene(),
        ) {
            let reach = Reach::of(from, &partitions, Some(&cap));
            for (tp, start) in &reach.from {
                let reachable = reach.reachable[tp];
                prop_assert!(reachable >= *start, "{tp}: {reachable} before {start}");
                prop_assert!(reachable <= (*start).max(cap[tp]), "{tp}: past the cap");
                prop_assert!(reachable <= (*start).max(reach.latest[tp]), "{tp}: past the latest");
            }
        }

        #[test]
        fn what_is_available_is_what_lies_between_start_and_reach_and_the_end_keeps_to_the_budget(
            (partitions, from, cap) in scene(),
            capped in any::<bool>(),
            budget in 1..3_000_u64,
        ) {
            let reach = Reach::of(from, &partitions, capped.then_some(&cap));
            let between: u64 = reach
                .from
                .iter()
                .map(|(tp, start)| start.distance_to(reach.reachable[tp]))
                .sum();
            prop_assert_eq!(reach.available(), between);
            let end = reach.end(NonZeroU64::new(budget));
            let read: u64 = reach.from.iter().map(|(tp, start)| start.distance_to(end[tp])).sum();
            prop_assert_eq!(read, between.min(budget));
            prop_assert_eq!(reach.end(None), reach.reachable.clone());
        }
    }
}
