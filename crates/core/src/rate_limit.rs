//! How much a batch may read: `max_offsets_per_trigger` shared across partitions
//! in proportion to their backlogs, and `min_offsets_per_trigger` with
//! `max_trigger_delay`.

use std::num::NonZeroU64;

use crate::{Offset, PartitionOffsets, TopicPartition};

/// The end offsets of a batch that starts at `start`, given each partition's
/// latest offset and an optional budget of offsets for the whole batch.
///
/// Without a budget, or when the whole backlog fits in it, every partition reads
/// to its latest offset. Otherwise the budget is shared in proportion to each
/// partition's backlog, as Spark does, with two guarantees Spark lacks: the total
/// never exceeds the budget, and every partition with a backlog gets at least one
/// offset whenever the budget has one offset per such partition. With a smaller
/// budget than that, the partitions with the largest backlogs go first.
///
/// The result has an entry for every partition of `start`. A partition without
/// a latest offset, or whose latest offset lies before its start, keeps its start:
/// that is a data-loss case, judged by [`crate::classify_data_loss`], not here.
pub fn rate_limit(
    start: &PartitionOffsets,
    latest: &PartitionOffsets,
    max_offsets: Option<NonZeroU64>,
) -> PartitionOffsets {
    let backlogs: Vec<(&TopicPartition, Offset, u64)> = start
        .iter()
        .filter_map(|(tp, from)| {
            let size = from.distance_to(*latest.get(tp)?);
            (size > 0).then_some((tp, *from, size))
        })
        .collect();
    let total: u128 = backlogs.iter().map(|(_, _, size)| u128::from(*size)).sum();

    let mut end = start.clone();
    let budget = match max_offsets {
        Some(budget) if u128::from(budget.get()) < total => budget.get(),
        _ => {
            for (tp, from, size) in backlogs {
                end.insert(tp.clone(), from.saturating_add(size));
            }
            return end;
        }
    };

    for (i, share) in shares(&backlogs, budget).into_iter().enumerate() {
        let (tp, from, _) = backlogs[i];
        end.insert(tp.clone(), from.saturating_add(share));
    }
    end
}

/// Splits `budget` (smaller than the total backlog) over the backlogs.
fn shares(backlogs: &[(&TopicPartition, Offset, u64)], budget: u64) -> Vec<u64> {
    let n = backlogs.len();
    let mut shares = vec![0_u64; n];
    let budget_u = usize::try_from(budget).unwrap_or(usize::MAX);
    if budget_u < n {
        // Not even one offset each: the largest backlogs first, ties in partition order.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| backlogs[b].2.cmp(&backlogs[a].2).then(a.cmp(&b)));
        for &i in order.iter().take(budget_u) {
            shares[i] = 1;
        }
        return shares;
    }

    // One offset each so that no partition starves, then the rest in proportion to
    // what each partition still has beyond that one, by largest remainder.
    let rest = u128::from(budget) - n as u128;
    let weights: Vec<u128> = backlogs.iter().map(|b| u128::from(b.2 - 1)).collect();
    let weight_total: u128 = weights.iter().sum();
    let mut remainders = Vec::with_capacity(n);
    let mut given: u128 = 0;
    for (i, weight) in weights.iter().enumerate() {
        let exact = rest * weight;
        let extra = exact / weight_total;
        given += extra;
        shares[i] = 1 + extra as u64;
        remainders.push((exact % weight_total, i));
    }
    let mut leftover = rest - given;
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, i) in remainders {
        if leftover == 0 {
            break;
        }
        if u128::from(shares[i]) < weights[i] + 1 {
            shares[i] += 1;
            leftover -= 1;
        }
    }
    shares
}

/// `min_offsets_per_trigger` with `max_trigger_delay`: wait for enough data, but
/// not for ever.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MinOffsetsPerTrigger {
    /// How many new offsets, over all partitions, make a batch worth running.
    pub min_offsets: u64,
    /// How long to wait for them before running a batch with what there is.
    pub max_trigger_delay_ms: u64,
}

/// Whether a trigger should run a batch now: there is new data, and either no
/// minimum is set, the minimum is reached, or the last batch is at least
/// `max_trigger_delay_ms` ago.
pub fn should_run_batch(
    available_offsets: u64,
    minimum: Option<MinOffsetsPerTrigger>,
    ms_since_last_batch: u64,
) -> bool {
    if available_offsets == 0 {
        return false;
    }
    match minimum {
        None => true,
        Some(min) => {
            available_offsets >= min.min_offsets || ms_since_last_batch >= min.max_trigger_delay_ms
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offsets(values: &[i64]) -> PartitionOffsets {
        values
            .iter()
            .enumerate()
            .map(|(p, v)| (TopicPartition::new("t", p as i32), Offset::new(*v).unwrap()))
            .collect()
    }

    fn values(offsets: &PartitionOffsets) -> Vec<i64> {
        offsets.values().map(|o| o.value()).collect()
    }

    fn budget(n: u64) -> Option<NonZeroU64> {
        NonZeroU64::new(n)
    }

    #[test]
    fn reads_everything_without_a_budget_or_when_it_fits() {
        let start = offsets(&[0, 10, 5]);
        let latest = offsets(&[100, 10, 50]);
        assert_eq!(
            values(&rate_limit(&start, &latest, None)),
            vec![100, 10, 50]
        );
        assert_eq!(
            values(&rate_limit(&start, &latest, budget(145))),
            vec![100, 10, 50]
        );
    }

    #[test]
    fn shares_the_budget_in_proportion_to_backlog() {
        let start = offsets(&[0, 0, 0]);
        let latest = offsets(&[300, 100, 0]);
        // Backlogs 300 and 100: 3/4 and 1/4 of 40.
        assert_eq!(
            values(&rate_limit(&start, &latest, budget(40))),
            vec![30, 10, 0]
        );
    }

    #[test]
    fn small_backlogs_get_one_offset_and_the_budget_holds() {
        let start = offsets(&[0, 0, 0]);
        let latest = offsets(&[1_000_000, 1, 1]);
        let end = rate_limit(&start, &latest, budget(10));
        assert_eq!(values(&end), vec![8, 1, 1]);
    }

    #[test]
    fn a_budget_below_one_per_partition_goes_to_the_largest_backlogs() {
        let start = offsets(&[0, 0, 0]);
        let latest = offsets(&[5, 9, 9]);
        assert_eq!(
            values(&rate_limit(&start, &latest, budget(2))),
            vec![0, 1, 1]
        );
    }

    #[test]
    fn partitions_behind_their_start_keep_it() {
        let start = offsets(&[50, 0]);
        let latest = offsets(&[10, 20]);
        assert_eq!(values(&rate_limit(&start, &latest, budget(5))), vec![50, 5]);
    }

    #[test]
    fn waits_for_enough_data_but_not_longer_than_the_delay() {
        let min = Some(MinOffsetsPerTrigger {
            min_offsets: 100,
            max_trigger_delay_ms: 60_000,
        });
        assert!(!should_run_batch(0, None, 0));
        assert!(should_run_batch(1, None, 0));
        assert!(!should_run_batch(99, min, 59_999));
        assert!(should_run_batch(100, min, 0));
        assert!(should_run_batch(1, min, 60_000));
        assert!(!should_run_batch(0, min, 600_000));
    }

    proptest! {
        #[test]
        fn budget_is_respected_no_partition_starves_and_progress_is_made(
            parts in prop::collection::vec((0..1_000_000_i64, 0..1_000_000_i64), 1..60),
            max in 1..5_000_000_u64,
        ) {
            let start = offsets(&parts.iter().map(|p| p.0).collect::<Vec<_>>());
            let latest = offsets(&parts.iter().map(|p| p.0 + p.1).collect::<Vec<_>>());
            let end = rate_limit(&start, &latest, budget(max));

            let mut total = 0_u64;
            let backlogged = parts.iter().filter(|p| p.1 > 0).count() as u64;
            for (tp, from) in &start {
                let to = end[tp];
                prop_assert!(to >= *from && to <= latest[tp], "{tp}: {from}..{to} outside its backlog");
                let read = from.distance_to(to);
                total += read;
                if backlogged <= max && from.distance_to(latest[tp]) > 0 {
                    prop_assert!(read >= 1, "{tp} starved");
                }
            }
            prop_assert!(total <= max, "read {total} with a budget of {max}");
            let backlog: u64 = parts.iter().map(|p| p.1 as u64).sum();
            prop_assert_eq!(total, backlog.min(max), "the budget or the backlog is used up");
        }
    }
}
