//! Batches: their ids, their plans (the ranges they read) and their commits.

use std::collections::BTreeMap;
use std::fmt;

use crate::{Offset, OffsetRange, PartitionOffsets, TopicPartition};

/// The number of a micro-batch, from 0, as in Spark's `offsets/<batchId>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchId(pub u64);

impl BatchId {
    /// The first batch of a query.
    pub const FIRST: BatchId = BatchId(0);

    /// The batch after this one.
    pub fn next(self) -> BatchId {
        BatchId(self.0.saturating_add(1))
    }

    /// The batch before this one, if any.
    pub fn previous(self) -> Option<BatchId> {
        self.0.checked_sub(1).map(BatchId)
    }
}

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What Spark keeps beside a batch's offsets: the event-time watermark, the
/// batch's timestamp, and configuration that must not change across restarts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchMetadata {
    /// The event-time watermark in force for the batch, in epoch milliseconds.
    pub watermark_ms: i64,
    /// When the batch was planned, in epoch milliseconds.
    pub timestamp_ms: i64,
    /// Configuration recorded with the batch, kept as it was read.
    pub conf: BTreeMap<String, String>,
}

/// Why a set of ranges is not a valid batch plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Two ranges name the same partition.
    #[error("{0} appears twice in the plan")]
    DuplicatePartition(TopicPartition),
    /// A range ends before it starts.
    #[error("range {0} ends before it starts")]
    Backwards(OffsetRange),
    /// An end offset has no start offset.
    #[error("{0} has an end offset but no start offset")]
    MissingStart(TopicPartition),
    /// A start offset has no end offset.
    #[error("{0} has a start offset but no end offset")]
    MissingEnd(TopicPartition),
    /// A partition belongs to none of the query's sources.
    #[error("{0} is read by none of the query's {1} sources")]
    NoSource(TopicPartition, usize),
}

/// The write-ahead record of one batch: exactly which offsets it reads. A batch
/// that is replayed after a crash reads this same plan again.
#[derive(Clone, Debug, PartialEq, Eq)]
///
/// A query reading several sources keeps, beside each range, which source
/// reads it: Spark's offsets file has a line per source, in the order the
/// query declares them.
pub struct BatchPlan {
    id: BatchId,
    ranges: Vec<OffsetRange>,
    metadata: BatchMetadata,
    /// The source of each range, by index into `ranges`.
    sources: Vec<u16>,
    source_count: u16,
}

impl BatchPlan {
    /// A plan from its ranges, at most one per partition, none backwards.
    pub fn new(
        id: BatchId,
        mut ranges: Vec<OffsetRange>,
        metadata: BatchMetadata,
    ) -> Result<BatchPlan, PlanError> {
        ranges.sort();
        for pair in ranges.windows(2) {
            if pair[0].topic_partition == pair[1].topic_partition {
                return Err(PlanError::DuplicatePartition(
                    pair[0].topic_partition.clone(),
                ));
            }
        }
        if let Some(bad) = ranges.iter().find(|r| r.until < r.from) {
            return Err(PlanError::Backwards(bad.clone()));
        }
        Ok(BatchPlan {
            id,
            sources: vec![0; ranges.len()],
            ranges,
            metadata,
            source_count: 1,
        })
    }

    /// The plan with each range given to one of `count` sources by `source_of`
    /// (at least one: a plan of one source is one line).
    pub fn with_sources(
        mut self,
        count: usize,
        source_of: impl Fn(&TopicPartition) -> Option<usize>,
    ) -> Result<BatchPlan, PlanError> {
        let count = count.clamp(1, usize::from(u16::MAX));
        self.sources = self
            .ranges
            .iter()
            .map(|r| match source_of(&r.topic_partition) {
                Some(i) if i < count => Ok(i as u16),
                _ => Err(PlanError::NoSource(r.topic_partition.clone(), count)),
            })
            .collect::<Result<_, _>>()?;
        self.source_count = count as u16;
        Ok(self)
    }

    /// A plan from its start offsets and the end offsets of each source, in
    /// the sources' order: as an offsets file with a line per source holds it.
    pub fn from_lines(
        id: BatchId,
        start: &PartitionOffsets,
        ends: &[PartitionOffsets],
        metadata: BatchMetadata,
    ) -> Result<BatchPlan, PlanError> {
        let mut end = PartitionOffsets::new();
        for line in ends {
            for (tp, until) in line {
                if end.insert(tp.clone(), *until).is_some() {
                    return Err(PlanError::DuplicatePartition(tp.clone()));
                }
            }
        }
        BatchPlan::from_offsets(id, start, &end, metadata)?.with_sources(ends.len(), |tp| {
            ends.iter().position(|line| line.contains_key(tp))
        })
    }

    /// A plan from per-partition start and end offsets, which must name the same
    /// partitions.
    pub fn from_offsets(
        id: BatchId,
        start: &PartitionOffsets,
        end: &PartitionOffsets,
        metadata: BatchMetadata,
    ) -> Result<BatchPlan, PlanError> {
        if let Some(tp) = start.keys().find(|tp| !end.contains_key(*tp)) {
            return Err(PlanError::MissingEnd(tp.clone()));
        }
        let ranges = end
            .iter()
            .map(|(tp, until)| match start.get(tp) {
                Some(from) => Ok(OffsetRange {
                    topic_partition: tp.clone(),
                    from: *from,
                    until: *until,
                }),
                None => Err(PlanError::MissingStart(tp.clone())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        BatchPlan::new(id, ranges, metadata)
    }

    /// The batch's id.
    pub fn id(&self) -> BatchId {
        self.id
    }

    /// The ranges, one per partition, ordered by topic-partition.
    pub fn ranges(&self) -> &[OffsetRange] {
        &self.ranges
    }

    /// How many sources the plan has a line for: one unless the query reads
    /// several.
    pub fn source_count(&self) -> usize {
        usize::from(self.source_count)
    }

    /// The source that reads each range, in the order of [`BatchPlan::ranges`].
    pub fn range_sources(&self) -> impl Iterator<Item = (usize, &OffsetRange)> {
        self.sources
            .iter()
            .map(|s| usize::from(*s))
            .zip(self.ranges.iter())
    }

    /// The end offsets of each source's ranges, one map per source in order:
    /// the lines of Spark's offsets file.
    pub fn end_offsets_by_source(&self) -> Vec<PartitionOffsets> {
        self.by_source(|r| r.until)
    }

    /// The start offsets of each source's ranges, one map per source in order.
    pub fn start_offsets_by_source(&self) -> Vec<PartitionOffsets> {
        self.by_source(|r| r.from)
    }

    fn by_source(&self, pick: impl Fn(&OffsetRange) -> Offset) -> Vec<PartitionOffsets> {
        let mut lines = vec![PartitionOffsets::new(); self.source_count()];
        for (source, range) in self.range_sources() {
            lines[source].insert(range.topic_partition.clone(), pick(range));
        }
        lines
    }

    /// The watermark, timestamp and configuration recorded with the plan.
    pub fn metadata(&self) -> &BatchMetadata {
        &self.metadata
    }

    /// The first offset the batch reads, per partition.
    pub fn start_offsets(&self) -> PartitionOffsets {
        self.offsets(|r| r.from)
    }

    /// The first offset the batch does not read, per partition: where the next
    /// batch starts.
    pub fn end_offsets(&self) -> PartitionOffsets {
        self.offsets(|r| r.until)
    }

    /// How many offsets the batch spans over all partitions.
    pub fn offset_count(&self) -> u64 {
        self.ranges.iter().map(OffsetRange::len).sum()
    }

    fn offsets(&self, pick: impl Fn(&OffsetRange) -> Offset) -> PartitionOffsets {
        self.ranges
            .iter()
            .map(|r| (r.topic_partition.clone(), pick(r)))
            .collect()
    }
}

/// The record that a batch's results reached the sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchCommit {
    /// The committed batch.
    pub id: BatchId,
    /// The watermark the next batch starts with, in epoch milliseconds.
    pub next_watermark_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> TopicPartition {
        TopicPartition::new("t", p)
    }

    fn off(v: i64) -> Offset {
        Offset::new(v).unwrap()
    }

    #[test]
    fn plan_from_offsets_pairs_starts_and_ends() {
        let start = PartitionOffsets::from([(tp(1), off(5)), (tp(0), off(0))]);
        let end = PartitionOffsets::from([(tp(0), off(10)), (tp(1), off(5))]);
        let plan =
            BatchPlan::from_offsets(BatchId(3), &start, &end, BatchMetadata::default()).unwrap();
        assert_eq!(plan.ranges().len(), 2);
        assert_eq!(plan.start_offsets(), start);
        assert_eq!(plan.end_offsets(), end);
        assert_eq!(plan.offset_count(), 10);
    }

    #[test]
    fn a_plan_of_several_sources_keeps_the_lines_it_was_made_of() {
        let other = |p| TopicPartition::new("u", p);
        let start = PartitionOffsets::from([(tp(0), off(1)), (other(0), off(2))]);
        let ends = [
            PartitionOffsets::from([(tp(0), off(5))]),
            PartitionOffsets::from([(other(0), off(7))]),
        ];
        let plan =
            BatchPlan::from_lines(BatchId(1), &start, &ends, BatchMetadata::default()).unwrap();
        assert_eq!(plan.source_count(), 2);
        assert_eq!(plan.end_offsets_by_source(), ends);
        assert_eq!(
            plan.start_offsets_by_source(),
            [
                PartitionOffsets::from([(tp(0), off(1))]),
                PartitionOffsets::from([(other(0), off(2))]),
            ]
        );
        let by_topic = |t: &TopicPartition| Some(usize::from(&*t.topic == "u"));
        let again = BatchPlan::from_offsets(
            BatchId(1),
            &start,
            &plan.end_offsets(),
            BatchMetadata::default(),
        )
        .unwrap()
        .with_sources(2, by_topic)
        .unwrap();
        assert_eq!(again, plan);
        assert_eq!(
            plan.clone().with_sources(2, |_| None),
            Err(PlanError::NoSource(tp(0), 2))
        );
        let twice = [ends[0].clone(), ends[0].clone()];
        assert_eq!(
            BatchPlan::from_lines(BatchId(1), &start, &twice, BatchMetadata::default()),
            Err(PlanError::DuplicatePartition(tp(0)))
        );
    }

    #[test]
    fn plans_refuse_duplicates_backwards_ranges_and_unpaired_offsets() {
        let range = |p, from, until| OffsetRange {
            topic_partition: tp(p),
            from: off(from),
            until: off(until),
        };
        let meta = BatchMetadata::default;
        assert_eq!(
            BatchPlan::new(BatchId(0), vec![range(0, 0, 1), range(0, 1, 2)], meta()),
            Err(PlanError::DuplicatePartition(tp(0)))
        );
        assert_eq!(
            BatchPlan::new(BatchId(0), vec![range(0, 5, 1)], meta()),
            Err(PlanError::Backwards(range(0, 5, 1)))
        );
        let one = PartitionOffsets::from([(tp(0), off(1))]);
        let other = PartitionOffsets::from([(tp(1), off(1))]);
        assert_eq!(
            BatchPlan::from_offsets(BatchId(0), &one, &other, meta()),
            Err(PlanError::MissingEnd(tp(0)))
        );
        assert_eq!(
            BatchPlan::from_offsets(BatchId(0), &PartitionOffsets::new(), &other, meta()),
            Err(PlanError::MissingStart(tp(1)))
        );
    }
}
