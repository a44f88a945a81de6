//! The text of each checkpoint file, exactly as Spark writes it. Pure functions
//! over strings, so every format rule is testable without a filesystem.
//!
//! - `metadata`: `{"id":"<uuid>"}`
//! - `offsets/<batchId>`: `v1`, a metadata JSON line, then one line per source
//!   with its offset JSON (`-` for a source without offsets). Spark 4 may write
//!   `v2`, where each source line is `<sourceId>:<json>`.
//! - `commits/<batchId>`: `v1`, then `{"nextBatchWatermarkMs":0}`
//! - `sources/<i>/0`: a 0x00 byte, `v1`, then source i's initial offsets
//!
//! Spark writes no newline after the last line; readers accept one.

use serde_json::{Map, Value};
use sluice_core::{BatchMetadata, PartitionOffsets, offsets_from_json, offsets_to_json};

/// The `conf` key under which Sluice records a batch's start offsets. Spark keeps
/// only a batch's end offsets and derives the start from the previous batch, which
/// retention may have purged; keeping the start makes a replay exact on its own.
/// Spark ignores `conf` keys it does not know.
pub const START_OFFSETS_CONF: &str = "sluice.startOffsets";

/// What is wrong with a file's text; the caller adds the path.
pub type Problem = String;

/// A parsed `offsets/<batchId>` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetsFile {
    /// Watermark, timestamp and `conf`, without Sluice's start offsets.
    pub metadata: BatchMetadata,
    /// The batch's end offsets, a map per source line in order (empty for a
    /// source line of `-`).
    pub ends: Vec<PartitionOffsets>,
    /// The batch's start offsets, when Sluice wrote the file.
    pub start: Option<PartitionOffsets>,
}

/// Reads a checkpoint's `metadata` file: the query id.
pub fn parse_metadata(text: &str) -> Result<String, Problem> {
    let value: Value =
        serde_json::from_str(text.trim()).map_err(|e| format!("not valid JSON: {e}"))?;
    match value.get("id").and_then(Value::as_str) {
        Some(id) if !id.is_empty() => Ok(id.to_owned()),
        _ => Err(r#"expected {"id":"<query id>"}"#.to_owned()),
    }
}

/// Writes a checkpoint's `metadata` file.
pub fn write_metadata(id: &str) -> String {
    Value::Object(Map::from_iter([("id".to_owned(), Value::from(id))])).to_string()
}

/// Writes `offsets/<batchId>`: a line of end offsets per source, in order.
pub fn write_offsets(
    metadata: &BatchMetadata,
    start: &PartitionOffsets,
    ends: &[PartitionOffsets],
) -> String {
    let mut conf: Map<String, Value> = metadata
        .conf
        .iter()
        .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
        .collect();
    conf.insert(
        START_OFFSETS_CONF.to_owned(),
        Value::from(offsets_to_json(start)),
    );
    // Spark's field order; conf keys come sorted.
    let meta = format!(
        "{{\"batchWatermarkMs\":{},\"batchTimestampMs\":{},\"conf\":{}}}",
        metadata.watermark_ms,
        metadata.timestamp_ms,
        Value::Object(conf)
    );
    let mut text = format!("v1\n{meta}");
    for end in ends {
        text.push('\n');
        text.push_str(&offsets_to_json(end));
    }
    text
}

/// Reads `offsets/<batchId>`.
pub fn parse_offsets(text: &str) -> Result<OffsetsFile, Problem> {
    let mut lines = lines(text);
    let version = version(lines.next(), 2)?;
    let meta_line = lines
        .next()
        .ok_or("the file ends after its version line; the metadata line is missing")?;
    let sources: Vec<&str> = lines.collect();
    if sources.is_empty() {
        return Err("the file has no offsets line (truncated?)".to_owned());
    }
    let ends = sources
        .iter()
        .enumerate()
        .map(|(i, line)| source_line(version, i, line))
        .collect::<Result<Vec<_>, _>>()?;

    let mut metadata = BatchMetadata::default();
    let mut start = None;
    if !meta_line.trim().is_empty() {
        let meta: Value = serde_json::from_str(meta_line)
            .map_err(|e| format!("metadata line is not valid JSON: {e}"))?;
        let Value::Object(meta) = meta else {
            return Err("metadata line is not a JSON object".to_owned());
        };
        metadata.watermark_ms = int_field(&meta, "batchWatermarkMs")?;
        metadata.timestamp_ms = int_field(&meta, "batchTimestampMs")?;
        if let Some(conf) = meta.get("conf") {
            let Value::Object(conf) = conf else {
                return Err("metadata field conf is not an object".to_owned());
            };
            for (key, value) in conf {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                if key == START_OFFSETS_CONF {
                    start = Some(
                        offsets_from_json(&text)
                            .map_err(|e| format!("conf {START_OFFSETS_CONF}: {e}"))?,
                    );
                } else {
                    metadata.conf.insert(key.clone(), text);
                }
            }
        }
    }
    Ok(OffsetsFile {
        metadata,
        ends,
        start,
    })
}

/// Source `index`'s end offsets from its line of an offsets file.
fn source_line(version: u32, index: usize, line: &str) -> Result<PartitionOffsets, Problem> {
    let json = if version == 2 {
        line.split_once(':').map(|(_, json)| json).ok_or_else(|| {
            format!(
                "a v2 offsets line must be <sourceId>:<json>, found {line:?} for source {index}"
            )
        })?
    } else {
        line
    };
    if json.trim() == "-" {
        return Ok(PartitionOffsets::new());
    }
    offsets_from_json(json).map_err(|e| format!("offsets line of source {index}: {e}"))
}

/// Writes `commits/<batchId>`.
pub fn write_commit(next_watermark_ms: i64) -> String {
    let json = Value::Object(Map::from_iter([(
        "nextBatchWatermarkMs".to_owned(),
        Value::from(next_watermark_ms),
    )]));
    format!("v1\n{json}")
}

/// Reads `commits/<batchId>`: the next batch's watermark.
pub fn parse_commit(text: &str) -> Result<i64, Problem> {
    let mut lines = lines(text);
    version(lines.next(), 1)?;
    let line = lines
        .next()
        .ok_or("the file ends after its version line; the commit JSON is missing")?;
    let value: Value =
        serde_json::from_str(line).map_err(|e| format!("commit line is not valid JSON: {e}"))?;
    let Value::Object(map) = value else {
        return Err("commit line is not a JSON object".to_owned());
    };
    if lines.next().is_some() {
        return Err("unexpected lines after the commit JSON".to_owned());
    }
    int_field(&map, "nextBatchWatermarkMs")
}

/// Writes `sources/<i>/0`, with the leading 0x00 byte Spark writes since 2.1.1.
pub fn write_initial_offsets(offsets: &PartitionOffsets) -> Vec<u8> {
    let mut bytes = vec![0_u8];
    bytes.extend_from_slice(format!("v1\n{}", offsets_to_json(offsets)).as_bytes());
    bytes
}

/// Reads `sources/<i>/0`, with or without the leading 0x00 byte.
pub fn parse_initial_offsets(bytes: &[u8]) -> Result<PartitionOffsets, Problem> {
    let bytes = bytes.strip_prefix(&[0_u8]).unwrap_or(bytes);
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8 text: {e}"))?;
    let mut lines = lines(text);
    version(lines.next(), 1)?;
    let json: Vec<&str> = lines.collect();
    if json.is_empty() {
        return Err("the file ends after its version line; the offsets are missing".to_owned());
    }
    offsets_from_json(&json.join("\n")).map_err(|e| format!("initial offsets: {e}"))
}

fn lines(text: &str) -> impl Iterator<Item = &str> {
    text.strip_suffix('\n').unwrap_or(text).split('\n')
}

/// Checks a `v<N>` line and returns N, which must be at most `max`.
fn version(line: Option<&str>, max: u32) -> Result<u32, Problem> {
    let line = line.unwrap_or_default().trim_end_matches('\r');
    if line.is_empty() {
        return Err("the file is empty".to_owned());
    }
    let number = line
        .strip_prefix('v')
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("the first line must be a version like v1, found {line:?}"))?;
    if number > max {
        return Err(format!(
            "log version v{number} is newer than this Sluice reads (up to v{max}); it was written \
             by a newer version of Spark or Sluice"
        ));
    }
    Ok(number)
}

fn int_field(map: &Map<String, Value>, name: &str) -> Result<i64, Problem> {
    match map.get(name) {
        None => Ok(0),
        Some(value) => value
            .as_i64()
            .ok_or_else(|| format!("{name} is {value}, not an integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::{Offset, TopicPartition};
    use std::collections::BTreeMap;

    fn conf(entries: &[(&str, &str)]) -> BTreeMap<String, String> {
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn offsets(entries: &[(i32, i64)]) -> PartitionOffsets {
        entries
            .iter()
            .map(|(p, o)| (TopicPartition::new("events", *p), Offset::new(*o).unwrap()))
            .collect()
    }

    #[test]
    fn offsets_files_round_trip_with_the_start_in_conf() {
        let metadata = BatchMetadata {
            watermark_ms: 5,
            timestamp_ms: 1_700_000_000_000,
            conf: conf(&[("spark.sql.shuffle.partitions", "200")]),
        };
        let start = offsets(&[(0, 10), (1, 0)]);
        let end = offsets(&[(0, 20), (1, 3)]);
        let text = write_offsets(&metadata, &start, std::slice::from_ref(&end));
        assert_eq!(
            text,
            "v1\n{\"batchWatermarkMs\":5,\"batchTimestampMs\":1700000000000,\"conf\":{\
             \"sluice.startOffsets\":\"{\\\"events\\\":{\\\"0\\\":10,\\\"1\\\":0}}\",\
             \"spark.sql.shuffle.partitions\":\"200\"}}\n\
             {\"events\":{\"0\":20,\"1\":3}}"
        );
        let parsed = parse_offsets(&text).unwrap();
        assert_eq!(
            parsed,
            OffsetsFile {
                metadata,
                ends: vec![end],
                start: Some(start)
            }
        );
    }

    #[test]
    fn several_sources_are_a_line_each_in_their_order() {
        let other = |p: i32, o: i64| (TopicPartition::new("clicks", p), Offset::new(o).unwrap());
        let start = offsets(&[(0, 10)]);
        let ends = vec![offsets(&[(0, 20)]), PartitionOffsets::from([other(0, 4)])];
        let text = write_offsets(&BatchMetadata::default(), &start, &ends);
        assert!(text.ends_with("\n{\"events\":{\"0\":20}}\n{\"clicks\":{\"0\":4}}"));
        assert_eq!(parse_offsets(&text).unwrap().ends, ends);
        let v2 = parse_offsets("v2\n{}\n0:{\"events\":{\"0\":7}}\n1:-").unwrap();
        assert_eq!(v2.ends, vec![offsets(&[(0, 7)]), PartitionOffsets::new()]);
    }

    #[test]
    fn reads_v2_offsets_and_void_sources() {
        let parsed =
            parse_offsets("v2\n{\"batchWatermarkMs\":0}\n0:{\"events\":{\"0\":7}}").unwrap();
        assert_eq!(parsed.ends, vec![offsets(&[(0, 7)])]);
        assert_eq!(
            parse_offsets("v1\n\n-").unwrap().ends,
            vec![PartitionOffsets::new()]
        );
    }

    #[test]
    fn names_what_is_wrong_with_offsets_files() {
        let problem = |t: &str| parse_offsets(t).unwrap_err();
        assert_eq!(problem(""), "the file is empty");
        assert!(problem("v1").contains("metadata line is missing"));
        assert!(problem("v1\n{}").contains("no offsets line"));
        assert!(problem("v3\n{}\n{}").contains("v3 is newer"));
        assert!(problem("x1\n{}\n{}").contains("version like v1, found \"x1\""));
        assert!(
            problem("v1\n{\"batchWatermarkMs\":\n{}").contains("metadata line is not valid JSON")
        );
        assert!(
            problem("v1\n{}\n{\"events\":{\"0\":")
                .contains("offsets line of source 0: not valid JSON")
        );
        assert!(problem("v1\n{}\n{}\n{\"x\":").contains("source 1"));
        assert!(problem("v1\n{\"batchTimestampMs\":\"x\"}\n{}").contains("not an integer"));
    }

    #[test]
    fn commits_and_initial_offsets_round_trip() {
        assert_eq!(write_commit(0), "v1\n{\"nextBatchWatermarkMs\":0}");
        assert_eq!(parse_commit(&write_commit(42)), Ok(42));
        assert_eq!(parse_commit("v1\n{\"nextBatchWatermarkMs\":0}\n"), Ok(0));
        assert!(
            parse_commit("v1\n{")
                .unwrap_err()
                .contains("not valid JSON")
        );
        assert!(
            parse_commit("v1\n")
                .unwrap_err()
                .contains("commit JSON is missing")
        );
        assert!(
            parse_commit("v1")
                .unwrap_err()
                .contains("commit JSON is missing")
        );

        let initial = offsets(&[(0, 0), (2, 9)]);
        let bytes = write_initial_offsets(&initial);
        assert_eq!(bytes[0], 0);
        assert_eq!(&bytes[1..4], b"v1\n");
        assert_eq!(parse_initial_offsets(&bytes), Ok(initial.clone()));
        assert_eq!(parse_initial_offsets(&bytes[1..]), Ok(initial));
        assert!(parse_initial_offsets(&[0]).unwrap_err().contains("empty"));
    }

    #[test]
    fn metadata_holds_the_query_id() {
        assert_eq!(parse_metadata(&write_metadata("abc")), Ok("abc".to_owned()));
        assert_eq!(parse_metadata("{\"id\":\"5e2a\"}\n"), Ok("5e2a".to_owned()));
        assert!(parse_metadata("{}").is_err());
        assert!(parse_metadata("").is_err());
    }
}
