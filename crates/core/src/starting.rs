//! Where a query starts when its offset store is empty, with the options and
//! precedence of Spark's Kafka source.
//!
//! These apply only to a fresh query. Once a batch is planned, the offset store
//! decides where every partition continues; partitions discovered later always
//! start from their earliest offset.

use std::collections::BTreeMap;

use crate::json::{OffsetJsonError, values_from_json};
use crate::{Offset, TopicPartition};

/// One partition's start in `starting_offsets`: Spark writes -2 for earliest and
/// -1 for latest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecificOffset {
    /// The partition's earliest available offset (-2).
    Earliest,
    /// The partition's end: only records produced from now on (-1).
    Latest,
    /// This exact offset.
    At(Offset),
}

impl SpecificOffset {
    /// Reads Spark's number: -2, -1, or an offset.
    pub fn from_spark(value: i64) -> Option<SpecificOffset> {
        match value {
            -2 => Some(SpecificOffset::Earliest),
            -1 => Some(SpecificOffset::Latest),
            _ => Offset::new(value).map(SpecificOffset::At),
        }
    }

    /// The number Spark writes for it.
    pub fn to_spark(self) -> i64 {
        match self {
            SpecificOffset::Earliest => -2,
            SpecificOffset::Latest => -1,
            SpecificOffset::At(offset) => offset.value(),
        }
    }
}

/// What to do for a partition that has no offset at or after a requested
/// timestamp (Spark's `startingOffsetsByTimestampStrategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimestampFallback {
    /// Stop with an error naming the partition (Spark's default).
    #[default]
    Error,
    /// Start at the partition's end.
    Latest,
}

/// What to do for a partition without a committed offset in the consumer group.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissingCommitted {
    /// Start at the partition's earliest offset.
    #[default]
    Earliest,
    /// Start at the partition's end.
    Latest,
    /// Stop with an error naming the partition.
    Error,
}

/// Where a fresh query starts reading.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StartingOffsets {
    /// Every partition's earliest available offset.
    Earliest,
    /// Every partition's end (Spark's default for streaming queries).
    #[default]
    Latest,
    /// Given per partition; partitions not listed start at latest.
    Specific(BTreeMap<TopicPartition, SpecificOffset>),
    /// The earliest offset whose timestamp is at or after the given epoch
    /// milliseconds, per partition.
    TimestampPerPartition {
        /// Epoch milliseconds per partition.
        timestamps: BTreeMap<TopicPartition, i64>,
        /// What to do where no such offset exists.
        fallback: TimestampFallback,
    },
    /// The same timestamp for every partition.
    Timestamp {
        /// Epoch milliseconds.
        timestamp_ms: i64,
        /// What to do where no such offset exists.
        fallback: TimestampFallback,
    },
    /// The offsets committed by the consumer group.
    GroupCommitted {
        /// What to do for partitions the group has not committed.
        missing: MissingCommitted,
    },
}

/// Why a `starting_offsets` value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartingOffsetsError {
    /// Neither a keyword nor JSON.
    #[error(
        "expected \"earliest\", \"latest\", \"group\" or JSON like {{\"topic\":{{\"0\":23,\"1\":-2}}}}: {0}"
    )]
    Json(#[from] OffsetJsonError),
    /// A per-partition value below -2.
    #[error("{topic_partition}: {value} is neither an offset nor -2 (earliest) or -1 (latest)")]
    BadValue {
        /// The partition in question.
        topic_partition: TopicPartition,
        /// The value given.
        value: i64,
    },
}

/// Reads a `starting_offsets` value: `earliest`, `latest`, `group`, or Spark's JSON
/// with -2 and -1 for earliest and latest.
pub fn parse_starting_offsets(text: &str) -> Result<StartingOffsets, StartingOffsetsError> {
    match text.trim() {
        "earliest" => Ok(StartingOffsets::Earliest),
        "latest" => Ok(StartingOffsets::Latest),
        "group" => Ok(StartingOffsets::GroupCommitted {
            missing: MissingCommitted::default(),
        }),
        json => {
            let specific = values_from_json(json)?
                .into_iter()
                .map(|(tp, value)| match SpecificOffset::from_spark(value) {
                    Some(offset) => Ok((tp, offset)),
                    None => Err(StartingOffsetsError::BadValue {
                        topic_partition: tp,
                        value,
                    }),
                })
                .collect::<Result<_, _>>()?;
            Ok(StartingOffsets::Specific(specific))
        }
    }
}

/// The starting options as a user gives them, any of which may be absent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StartingOptions {
    /// `starting_offsets`.
    pub starting_offsets: Option<StartingOffsets>,
    /// `starting_offsets_by_timestamp`: epoch milliseconds per partition.
    pub starting_offsets_by_timestamp: Option<BTreeMap<TopicPartition, i64>>,
    /// `starting_timestamp`: epoch milliseconds for every partition.
    pub starting_timestamp: Option<i64>,
    /// `starting_offsets_by_timestamp_strategy`.
    pub timestamp_fallback: TimestampFallback,
}

impl StartingOptions {
    /// The one start that applies, with Spark's precedence: a timestamp for all
    /// partitions, then timestamps per partition, then `starting_offsets`, then
    /// latest.
    pub fn resolve(&self) -> StartingOffsets {
        if let Some(timestamp_ms) = self.starting_timestamp {
            return StartingOffsets::Timestamp {
                timestamp_ms,
                fallback: self.timestamp_fallback,
            };
        }
        if let Some(timestamps) = &self.starting_offsets_by_timestamp {
            return StartingOffsets::TimestampPerPartition {
                timestamps: timestamps.clone(),
                fallback: self.timestamp_fallback,
            };
        }
        self.starting_offsets.clone().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keywords_and_json_with_sparks_special_values() {
        assert_eq!(
            parse_starting_offsets("earliest"),
            Ok(StartingOffsets::Earliest)
        );
        assert_eq!(
            parse_starting_offsets(" latest "),
            Ok(StartingOffsets::Latest)
        );
        let parsed = parse_starting_offsets(r#"{"t":{"0":23,"1":-2,"2":-1}}"#).unwrap();
        let StartingOffsets::Specific(map) = parsed else {
            panic!("expected specific offsets, got {parsed:?}");
        };
        assert_eq!(
            map.values().copied().collect::<Vec<_>>(),
            vec![
                SpecificOffset::At(Offset::new(23).unwrap()),
                SpecificOffset::Earliest,
                SpecificOffset::Latest
            ]
        );
        assert_eq!(
            map.values().map(|o| o.to_spark()).collect::<Vec<_>>(),
            vec![23, -2, -1]
        );
    }

    #[test]
    fn refuses_values_below_minus_two_and_junk() {
        let err = parse_starting_offsets(r#"{"t":{"3":-3}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t-3: -3 is neither an offset nor -2 (earliest) or -1 (latest)"
        );
        assert!(parse_starting_offsets("earliestt").is_err());
    }

    #[test]
    fn follows_sparks_precedence() {
        let tp = TopicPartition::new("t", 0);
        let mut options = StartingOptions {
            starting_offsets: Some(StartingOffsets::Earliest),
            ..StartingOptions::default()
        };
        assert_eq!(options.resolve(), StartingOffsets::Earliest);

        options.starting_offsets_by_timestamp = Some(BTreeMap::from([(tp.clone(), 1_000)]));
        assert!(matches!(
            options.resolve(),
            StartingOffsets::TimestampPerPartition { .. }
        ));

        options.starting_timestamp = Some(2_000);
        assert_eq!(
            options.resolve(),
            StartingOffsets::Timestamp {
                timestamp_ms: 2_000,
                fallback: TimestampFallback::Error
            }
        );

        assert_eq!(
            StartingOptions::default().resolve(),
            StartingOffsets::Latest
        );
    }
}
