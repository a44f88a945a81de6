//! Topic-partitions, offsets and offset ranges.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// One partition of one Kafka topic. Ordered by topic, then partition number.
///
/// The name is shared: a batch's offsets are kept in several maps keyed by
/// partition, which at 1,024 partitions copied and compared names thousands of
/// times per batch. Partitions made from one shared name compare it by address.
#[derive(Clone, Debug)]
pub struct TopicPartition {
    /// The topic's name.
    pub topic: Arc<str>,
    /// The partition number, as Kafka numbers them (from 0).
    pub partition: i32,
}

impl TopicPartition {
    /// A topic-partition from a topic name and a partition number.
    pub fn new(topic: impl Into<Arc<str>>, partition: i32) -> Self {
        TopicPartition {
            topic: topic.into(),
            partition,
        }
    }
}

impl PartialEq for TopicPartition {
    fn eq(&self, other: &Self) -> bool {
        self.partition == other.partition
            && (Arc::ptr_eq(&self.topic, &other.topic) || self.topic == other.topic)
    }
}

impl Eq for TopicPartition {}

impl std::hash::Hash for TopicPartition {
    // By content, as equality falls back to it.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.topic.hash(state);
        self.partition.hash(state);
    }
}

impl Ord for TopicPartition {
    fn cmp(&self, other: &Self) -> Ordering {
        let topic = if Arc::ptr_eq(&self.topic, &other.topic) {
            Ordering::Equal
        } else {
            self.topic.cmp(&other.topic)
        };
        topic.then(self.partition.cmp(&other.partition))
    }
}

impl PartialOrd for TopicPartition {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for TopicPartition {
    /// `topic-partition`, as Kafka's own tools print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.topic, self.partition)
    }
}

/// A position in a partition, meaning "the next offset to read", as in Kafka's
/// committed offsets and Spark's checkpoints. Never negative: the special values
/// -2 and -1 of Spark's options are [`crate::SpecificOffset`], not offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Offset(i64);

impl Offset {
    /// The first offset of a partition that was never purged.
    pub const ZERO: Offset = Offset(0);

    /// The offset `value`, or `None` when it is negative.
    pub const fn new(value: i64) -> Option<Offset> {
        if value >= 0 {
            Some(Offset(value))
        } else {
            None
        }
    }

    /// The offset as Kafka writes it.
    pub const fn value(self) -> i64 {
        self.0
    }

    /// The offset `count` records further on, saturating at `i64::MAX`.
    pub fn saturating_add(self, count: u64) -> Offset {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        Offset(self.0.saturating_add(count))
    }

    /// How many offsets lie in `[self, later)`; 0 when `later` is not after `self`.
    pub fn distance_to(self, later: Offset) -> u64 {
        u64::try_from(later.0 - self.0).unwrap_or(0)
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One offset per topic-partition, ordered by topic and partition.
pub type PartitionOffsets = BTreeMap<TopicPartition, Offset>;

/// The offsets `[from, until)` of one topic-partition: `from` is the first offset
/// read, `until` the first one not read, so `until` is the next batch's `from`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OffsetRange {
    /// The partition the range belongs to.
    pub topic_partition: TopicPartition,
    /// The first offset of the range.
    pub from: Offset,
    /// The first offset after the range.
    pub until: Offset,
}

impl OffsetRange {
    /// How many offsets the range spans. Kafka may hold fewer records than this
    /// (transaction markers and aborted records take offsets too).
    pub fn len(&self) -> u64 {
        self.from.distance_to(self.until)
    }

    /// Whether the range spans no offset.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for OffsetRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} [{}, {})",
            self.topic_partition, self.from, self.until
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_are_never_negative() {
        assert_eq!(Offset::new(-1), None);
        assert_eq!(Offset::new(0), Some(Offset::ZERO));
    }

    #[test]
    fn ranges_are_half_open() {
        let range = OffsetRange {
            topic_partition: TopicPartition::new("events", 4),
            from: Offset(10),
            until: Offset(15),
        };
        assert_eq!(range.len(), 5);
        assert_eq!(range.to_string(), "events-4 [10, 15)");
        let empty = OffsetRange {
            until: Offset(10),
            ..range
        };
        assert!(empty.is_empty());
    }

    #[test]
    fn topic_partitions_order_by_topic_then_partition_number() {
        let mut tps = vec![
            TopicPartition::new("b", 0),
            TopicPartition::new("a", 10),
            TopicPartition::new("a", 2),
        ];
        tps.sort();
        assert_eq!(
            tps,
            vec![
                TopicPartition::new("a", 2),
                TopicPartition::new("a", 10),
                TopicPartition::new("b", 0)
            ]
        );
    }

    #[test]
    fn a_shared_name_and_a_copy_of_it_compare_and_hash_alike() {
        use std::hash::{BuildHasher, RandomState};
        let shared: Arc<str> = Arc::from("events");
        let names = [
            Arc::clone(&shared),
            Arc::from("events"),
            Arc::from("eventz"),
        ];
        let hasher = RandomState::new();
        for a in &names {
            for b in &names {
                for (pa, pb) in [(1, 1), (1, 2), (2, 1)] {
                    let (x, y) = (
                        TopicPartition::new(a.clone(), pa),
                        TopicPartition::new(b.clone(), pb),
                    );
                    let by_content = (&**a, pa).cmp(&(&**b, pb));
                    assert_eq!(x.cmp(&y), by_content, "{x} against {y}");
                    assert_eq!(x == y, by_content.is_eq(), "{x} against {y}");
                    if x == y {
                        assert_eq!(hasher.hash_one(&x), hasher.hash_one(&y));
                    }
                }
            }
        }
    }
}
