//! Offsets as JSON exactly as Spark's Kafka source writes them:
//! `{"topic":{"0":23,"1":5}}`, topics and partitions in order.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::{Offset, PartitionOffsets, TopicPartition};

/// Why a text is not Spark's Kafka offset JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffsetJsonError {
    /// The text is not JSON at all.
    #[error("not valid JSON: {0}")]
    Syntax(String),
    /// The JSON is not an object of topics.
    #[error("expected an object of topics like {{\"topic\":{{\"0\":23}}}}, found {found}")]
    NotAnObject {
        /// What was found instead, e.g. `an array`.
        found: &'static str,
    },
    /// A topic's value is not an object of partitions.
    #[error("topic {topic:?}: expected an object of partitions like {{\"0\":23}}, found {found}")]
    TopicNotAnObject {
        /// The topic in question.
        topic: String,
        /// What was found instead.
        found: &'static str,
    },
    /// A partition key is not a non-negative integer.
    #[error("topic {topic:?}: partition {key:?} is not a partition number")]
    BadPartition {
        /// The topic in question.
        topic: String,
        /// The key as written.
        key: String,
    },
    /// A value is not an integer, or not one allowed here.
    #[error("{topic_partition}: {value} is not {expected}")]
    BadOffset {
        /// The partition in question.
        topic_partition: TopicPartition,
        /// The value as written.
        value: String,
        /// What the value must be.
        expected: &'static str,
    },
}

/// Writes offsets as Spark's Kafka source does, topics and partitions sorted.
pub fn offsets_to_json(offsets: &PartitionOffsets) -> String {
    values_to_json(offsets.iter().map(|(tp, offset)| (tp, offset.value())))
}

/// Writes any per-partition integers (timestamps, or offsets with -2/-1) in the
/// same shape. The iterator must be ordered by topic-partition.
pub fn values_to_json<'a>(values: impl IntoIterator<Item = (&'a TopicPartition, i64)>) -> String {
    let mut out = String::from("{");
    let mut current: Option<&str> = None;
    for (tp, value) in values {
        if current != Some(tp.topic.as_ref()) {
            if current.is_some() {
                out.push_str("},");
            }
            // serde_json escapes the topic name as a JSON string; it cannot fail for a str.
            out.push_str(&serde_json::to_string(&*tp.topic).unwrap_or_default());
            out.push_str(":{");
            current = Some(&tp.topic);
        } else {
            out.push(',');
        }
        // itoa instead of `write!`: formatting was most of the encoding time
        // (`cargo bench`, offset JSON encode).
        let mut digits = itoa::Buffer::new();
        out.push('"');
        out.push_str(digits.format(tp.partition));
        out.push_str("\":");
        out.push_str(digits.format(value));
    }
    if current.is_some() {
        out.push('}');
    }
    out.push('}');
    out
}

/// Reads offsets in Spark's format. Every value must be a non-negative offset.
pub fn offsets_from_json(text: &str) -> Result<PartitionOffsets, OffsetJsonError> {
    values_from_json(text)?
        .into_iter()
        .map(|(tp, value)| match Offset::new(value) {
            Some(offset) => Ok((tp, offset)),
            None => Err(OffsetJsonError::BadOffset {
                topic_partition: tp,
                value: value.to_string(),
                expected: "an offset (offsets are never negative)",
            }),
        })
        .collect()
}

/// Reads per-partition integers in Spark's format without judging their sign.
pub fn values_from_json(text: &str) -> Result<BTreeMap<TopicPartition, i64>, OffsetJsonError> {
    let root: Value =
        serde_json::from_str(text).map_err(|e| OffsetJsonError::Syntax(e.to_string()))?;
    let Value::Object(topics) = root else {
        return Err(OffsetJsonError::NotAnObject { found: kind(&root) });
    };
    let mut values = BTreeMap::new();
    for (topic, partitions) in topics {
        let Value::Object(partitions) = partitions else {
            return Err(OffsetJsonError::TopicNotAnObject {
                found: kind(&partitions),
                topic,
            });
        };
        let name: std::sync::Arc<str> = std::sync::Arc::from(topic.as_str());
        for (key, value) in partitions {
            // Only the canonical spelling ("7", not "07" or "+7"), checked without
            // formatting the number back (`cargo bench`, offset JSON decode).
            let canonical = !key.is_empty()
                && key.bytes().all(|b| b.is_ascii_digit())
                && (key == "0" || !key.starts_with('0'));
            let partition = canonical
                .then(|| key.parse::<i32>().ok())
                .flatten()
                .ok_or_else(|| OffsetJsonError::BadPartition {
                    topic: topic.clone(),
                    key: key.clone(),
                })?;
            let tp = TopicPartition::new(name.clone(), partition);
            let Some(number) = value.as_i64() else {
                return Err(OffsetJsonError::BadOffset {
                    topic_partition: tp,
                    value: value.to_string(),
                    expected: "an integer",
                });
            };
            values.insert(tp, number);
        }
    }
    Ok(values)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offsets(entries: &[(&str, i32, i64)]) -> PartitionOffsets {
        entries
            .iter()
            .map(|(t, p, o)| (TopicPartition::new(*t, *p), Offset::new(*o).unwrap()))
            .collect()
    }

    #[test]
    fn writes_sparks_shape_sorted_numerically() {
        let o = offsets(&[("b", 0, 7), ("a", 10, 5), ("a", 2, 23)]);
        assert_eq!(offsets_to_json(&o), r#"{"a":{"2":23,"10":5},"b":{"0":7}}"#);
        assert_eq!(offsets_to_json(&PartitionOffsets::new()), "{}");
    }

    #[test]
    fn reads_what_spark_writes_in_any_order_and_spacing() {
        let read = offsets_from_json(r#"{ "b":{"0":7}, "a":{"10":5,"2":23} }"#).unwrap();
        assert_eq!(read, offsets(&[("a", 2, 23), ("a", 10, 5), ("b", 0, 7)]));
    }

    #[test]
    fn escapes_topic_names() {
        let o = offsets(&[("we\"ird", 0, 1)]);
        let json = offsets_to_json(&o);
        assert_eq!(json, r#"{"we\"ird":{"0":1}}"#);
        assert_eq!(offsets_from_json(&json).unwrap(), o);
    }

    #[test]
    fn names_what_is_wrong() {
        let err = |t: &str| offsets_from_json(t).unwrap_err().to_string();
        assert!(err("{").starts_with("not valid JSON"));
        assert!(err("[1]").contains("found an array"));
        assert!(err(r#"{"t":5}"#).contains("topic \"t\""));
        assert!(err(r#"{"t":{"x":5}}"#).contains("partition \"x\""));
        assert!(err(r#"{"t":{"-1":5}}"#).contains("partition \"-1\""));
        for odd in ["07", "+7", "", " 7", "99999999999"] {
            let text = format!(r#"{{"t":{{"{odd}":5}}}}"#);
            assert!(
                err(&text).contains(&format!("partition \"{odd}\"")),
                "{odd:?}"
            );
        }
        assert!(offsets_from_json(r#"{"t":{"0":5,"10":6}}"#).is_ok());
        assert!(err(r#"{"t":{"0":"5"}}"#).contains("t-0: \"5\" is not an integer"));
        assert!(err(r#"{"t":{"0":-2}}"#).contains("t-0: -2 is not an offset"));
    }

    #[test]
    fn keeps_negative_values_where_they_are_allowed() {
        let values = values_from_json(r#"{"t":{"0":-2,"1":-1}}"#).unwrap();
        assert_eq!(values[&TopicPartition::new("t", 0)], -2);
        assert_eq!(
            values_to_json(values.iter().map(|(tp, v)| (tp, *v))),
            r#"{"t":{"0":-2,"1":-1}}"#
        );
    }

    proptest! {
        #[test]
        fn json_round_trips(
            entries in prop::collection::btree_map(
                ("[a-zA-Z0-9._\\-\"\\\\ ]{1,12}", 0..5000_i32),
                0..i64::MAX,
                0..40,
            )
        ) {
            let o: PartitionOffsets = entries
                .into_iter()
                .map(|((t, p), v)| (TopicPartition::new(t, p), Offset::new(v).unwrap()))
                .collect();
            let json = offsets_to_json(&o);
            prop_assert_eq!(offsets_from_json(&json).unwrap(), o.clone());
            // Writing is deterministic: the same offsets give the same bytes.
            prop_assert_eq!(offsets_to_json(&offsets_from_json(&json).unwrap()), json);
        }
    }
}
