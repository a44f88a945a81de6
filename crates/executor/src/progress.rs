//! What each batch reports, with the fields of Spark's `StreamingQueryProgress`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use sluice_core::{DataLoss, EventTimeStats, PartitionOffsets, ReadAmplification};

/// One batch's progress, serialised as Spark serialises its progress events.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct QueryProgress {
    /// The query id, stable across restarts (the checkpoint's id).
    pub id: String,
    /// This run's id, new at every start.
    pub run_id: String,
    /// The query's name, if it has one.
    pub name: Option<String>,
    /// When the trigger started, RFC 3339 in UTC with milliseconds.
    pub timestamp: String,
    /// The batch.
    pub batch_id: u64,
    /// Records read in the batch.
    pub num_input_rows: u64,
    /// Records per second since the previous trigger started.
    pub input_rows_per_second: f64,
    /// Records per second over this batch's execution.
    pub processed_rows_per_second: f64,
    /// Milliseconds spent in each phase.
    pub duration_ms: DurationMs,
    /// The same phases in microseconds, for latencies well under a millisecond
    /// (an fsync on a fast disk); not in Spark's reports.
    pub duration_micros: DurationMs,
    /// The batch's event time and watermark, RFC 3339 in UTC with milliseconds,
    /// keyed `avg`, `max`, `min` and `watermark` as in Spark; absent when the
    /// query has no event time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_time: Option<BTreeMap<String, String>>,
    /// Each stateful operator's state after the batch, as Spark reports it;
    /// absent for a stateless query.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub state_operators: Vec<StateOperatorProgress>,
    /// How a stateful query's memory budget sized the batch; absent for a
    /// stateless query and a replay. Not in Spark's reports.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryProgress>,
    /// The lookup tables the batch joined with, each in the version it
    /// joined; absent for a query without. Not in Spark's reports.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lookup_tables: Vec<LookupTableProgress>,
    /// The one source.
    pub sources: Vec<SourceProgress>,
    /// The sink.
    pub sink: SinkProgress,
    /// Which member of a group-mode query made the report, and over which
    /// partitions; absent outside group mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<GroupProgress>,
}

/// A lookup table as a batch joined with it.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LookupTableProgress {
    /// Its name in the query.
    pub name: String,
    /// The version the batch joined with, as its loader describes it (for a
    /// file: how many files, their bytes and the newest modification time).
    pub version: String,
    /// Its rows.
    pub num_rows: u64,
    /// What its rows take in memory.
    pub memory_used_bytes: u64,
    /// How many times it was read again after a change, since the start.
    pub num_reloads: u64,
    /// How many reloads failed since the start, leaving the last good version.
    pub num_failed_reloads: u64,
    /// Why the last failed reload failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl From<sluice_core::LookupStats> for LookupTableProgress {
    fn from(stats: sluice_core::LookupStats) -> LookupTableProgress {
        LookupTableProgress {
            name: stats.name,
            version: stats.version,
            num_rows: stats.rows,
            memory_used_bytes: stats.memory_bytes,
            num_reloads: stats.reloads,
            num_failed_reloads: stats.failed_reloads,
            last_error: stats.last_error,
        }
    }
}

/// How the memory budget (`[query] state_memory_mb`) sized a batch.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MemoryProgress {
    /// The budget, in bytes.
    pub budget_bytes: u64,
    /// The state held when the batch was planned.
    pub state_bytes: u64,
    /// The bytes an input record was taken to cost.
    pub bytes_per_record: f64,
    /// Whether a batch before measured that cost, or it was assumed.
    pub measured: bool,
    /// The most records the budget let the batch read.
    pub max_records: u64,
    /// What bounded the batch: `memory` (the budget), `maxOffsetsPerTrigger`,
    /// or `available` (everything available fitted).
    pub limited_by: &'static str,
    /// The most the batch's own structures held beside the state, as its
    /// stateful operators counted it.
    pub batch_bytes: u64,
}

/// A group-mode member's part of a progress report: each member reports only
/// its own partitions, so a reader needs to know whose report it is.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GroupProgress {
    /// The member, unique to one process of the query.
    pub member: String,
    /// The member's current generation, which names its batch log and output.
    pub generation: String,
    /// The partitions the generation holds, per topic.
    pub partitions: BTreeMap<String, Vec<i32>>,
}

impl GroupProgress {
    /// The report part of `generation` of `member` over `partitions`.
    pub fn new<'a>(
        member: impl Into<String>,
        generation: impl Into<String>,
        partitions: impl IntoIterator<Item = &'a sluice_core::TopicPartition>,
    ) -> GroupProgress {
        let mut by_topic: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for tp in partitions {
            by_topic
                .entry(tp.topic.to_string())
                .or_default()
                .push(tp.partition);
        }
        for list in by_topic.values_mut() {
            list.sort_unstable();
            list.dedup();
        }
        GroupProgress {
            member: member.into(),
            generation: generation.into(),
            partitions: by_topic,
        }
    }
}

/// A stateful operator's part of a progress report: Spark's
/// `StateOperatorProgress`.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct StateOperatorProgress {
    /// The operator, as Spark names it.
    pub operator_name: String,
    /// Rows (groups) held after the batch.
    pub num_rows_total: u64,
    /// Rows the batch changed.
    pub num_rows_updated: u64,
    /// Rows the batch removed, as final.
    pub num_rows_removed: u64,
    /// Input rows dropped as later than the watermark.
    pub num_rows_dropped_by_watermark: u64,
    /// The state's size in memory.
    pub memory_used_bytes: u64,
    /// The most the batch's own structures held beside the state. Not in
    /// Spark's reports.
    pub batch_memory_bytes: u64,
    /// Milliseconds spent writing the batch's state files durably.
    pub commit_time_ms: u64,
    /// Spark's state partitions; one here.
    pub num_state_store_instances: u64,
    /// Sluice's own figures: `stateFileBytes` written, `commitTimeMicros` and
    /// `encodeTimeMicros` (encoding the files, before they are written).
    pub custom_metrics: BTreeMap<String, u64>,
}

/// Time per phase of a batch, named as Spark names them: milliseconds in
/// `durationMs`, microseconds in `durationMicros`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DurationMs {
    /// Discovering partitions and latest offsets.
    pub latest_offset: u64,
    /// Writing the plan durably (with the commit of the batch before, when the
    /// store writes them together).
    pub wal_commit: u64,
    /// Reading the records.
    pub get_batch: u64,
    /// Handing them to the sink.
    pub add_batch: u64,
    /// Of `add_batch`, the sink's finish: waiting until what it was handed is
    /// durable, and its own commit (the Kafka sink's transaction). Not Spark's.
    pub sink_commit: u64,
    /// Writing the commit (and progress to the consumer group). A commit
    /// written with the next batch's plan counts that write, not the wait for
    /// the next batch to be planned.
    pub commit_offsets: u64,
    /// The whole trigger, without that wait.
    pub trigger_execution: u64,
}

impl DurationMs {
    /// These durations, taken as microseconds, in whole milliseconds.
    pub fn to_millis(&self) -> DurationMs {
        DurationMs {
            latest_offset: self.latest_offset / 1000,
            wal_commit: self.wal_commit / 1000,
            get_batch: self.get_batch / 1000,
            add_batch: self.add_batch / 1000,
            sink_commit: self.sink_commit / 1000,
            commit_offsets: self.commit_offsets / 1000,
            trigger_execution: self.trigger_execution / 1000,
        }
    }
}

/// The source's part of a progress report.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SourceProgress {
    /// What the source reads, e.g. `KafkaV2[Subscribe[events]]`.
    pub description: String,
    /// Where the batch started, as Spark's offset JSON.
    pub start_offset: Value,
    /// Where it ended.
    pub end_offset: Value,
    /// The latest offsets seen when planning.
    pub latest_offset: Value,
    /// Records read.
    pub num_input_rows: u64,
    /// As in [`QueryProgress`].
    pub input_rows_per_second: f64,
    /// As in [`QueryProgress`].
    pub processed_rows_per_second: f64,
    /// Lag and data-loss figures; strings, as Spark writes them.
    pub metrics: BTreeMap<String, String>,
    /// The source's own watermark, in a query reading several with event
    /// time: the query's is the least of them (Spark's default policy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watermark: Option<String>,
}

/// The sink's part of a progress report.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SinkProgress {
    /// What the sink is.
    pub description: String,
    /// Rows handed to the sink: the records as read, or the rows a query made.
    pub num_output_rows: u64,
    /// What the sink says it wrote in the batch ([`sluice_core::Sink::metrics`]);
    /// left out when it says nothing.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, String>,
}

/// Spark's `eventTime` entry: the watermark always, and the rows' minimum,
/// maximum and mean event time when the batch had any.
pub(crate) fn event_time_entry(stats: &EventTimeStats) -> BTreeMap<String, String> {
    let format = format_event_time;
    let mut entry = BTreeMap::new();
    entry.insert("watermark".to_owned(), format(stats.watermark_ms));
    for (name, value) in [
        ("min", stats.min_ms),
        ("max", stats.max_ms),
        ("avg", stats.avg_ms),
    ] {
        if let Some(ms) = value {
            entry.insert(name.to_owned(), format(ms));
        }
    }
    entry
}

/// An event time as progress reports show it: RFC 3339 in UTC, to the
/// millisecond.
pub(crate) fn format_event_time(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(at).to_string()
}

/// Offsets as a JSON value in Spark's shape, built directly: encoding them and
/// parsing the text again took a sixth of a batch's own time at 1,024
/// partitions (three such values per report).
pub(crate) fn offsets_value(offsets: &PartitionOffsets) -> Value {
    let mut topics = serde_json::Map::new();
    let mut current: Option<(&str, serde_json::Map<String, Value>)> = None;
    for (tp, offset) in offsets {
        match &mut current {
            Some((topic, partitions)) if *topic == tp.topic.as_ref() => {
                partitions.insert(tp.partition.to_string(), offset.value().into());
            }
            _ => {
                if let Some((topic, partitions)) = current.take() {
                    topics.insert(topic.to_owned(), Value::Object(partitions));
                }
                let mut partitions = serde_json::Map::new();
                partitions.insert(tp.partition.to_string(), offset.value().into());
                current = Some((tp.topic.as_ref(), partitions));
            }
        }
    }
    if let Some((topic, partitions)) = current {
        topics.insert(topic.to_owned(), Value::Object(partitions));
    }
    Value::Object(topics)
}

/// Spark's Kafka lag metrics, plus the offsets lost to tolerated data loss, the
/// records that could not be processed, and the read amplification when the
/// source measures it.
pub(crate) fn source_metrics(
    end: &PartitionOffsets,
    latest: &PartitionOffsets,
    losses: &[DataLoss],
    bad_records: u64,
    amplification: Option<&ReadAmplification>,
) -> BTreeMap<String, String> {
    let behind: Vec<u64> = end
        .iter()
        .map(|(tp, offset)| latest.get(tp).map_or(0, |l| offset.distance_to(*l)))
        .collect();
    let mut metrics = BTreeMap::new();
    if !behind.is_empty() {
        let sum: u64 = behind.iter().sum();
        metrics.insert(
            "minOffsetsBehindLatest".to_owned(),
            behind.iter().min().copied().unwrap_or(0).to_string(),
        );
        metrics.insert(
            "maxOffsetsBehindLatest".to_owned(),
            behind.iter().max().copied().unwrap_or(0).to_string(),
        );
        metrics.insert(
            "avgOffsetsBehindLatest".to_owned(),
            format!("{:.1}", sum as f64 / behind.len() as f64),
        );
    }
    metrics.insert("badRecords".to_owned(), bad_records.to_string());
    if let Some(a) = amplification {
        metrics.insert("readAmplification".to_owned(), format!("{:.2}", a.recent()));
        metrics.insert(
            "readAmplificationTotal".to_owned(),
            format!("{:.2}", a.total()),
        );
        metrics.insert("fetchedBytes".to_owned(), a.fetched_bytes.to_string());
        metrics.insert("readBytes".to_owned(), a.read_bytes.to_string());
        if !a.worst_partitions.is_empty() {
            metrics.insert(
                "readAmplificationWorst".to_owned(),
                a.worst_partitions
                    .iter()
                    .map(|(tp, ratio)| format!("{tp}:{ratio:.2}"))
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
    }
    let lost: u64 = losses.iter().map(DataLoss::lost_offsets).sum();
    metrics.insert("dataLossOffsets".to_owned(), lost.to_string());
    if !losses.is_empty() {
        metrics.insert(
            "dataLossPartitions".to_owned(),
            losses
                .iter()
                .map(|l| l.topic_partition().to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    metrics
}

impl QueryProgress {
    /// The report as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The report as one short line for people, such as `batch 42: 10,000 rows
    /// in 18 ms (550k rows/s), behind latest 0, wal 0.7 ms, commit 1.1 ms`.
    /// Bad records and lost offsets are added when there are any.
    pub fn summary(&self) -> String {
        let micros = &self.duration_micros;
        let mut line = format!(
            "batch {}: {} rows",
            self.batch_id,
            thousands(self.num_input_rows)
        );
        if self.sources.len() > 1 {
            let each: Vec<String> = self
                .sources
                .iter()
                .map(|s| thousands(s.num_input_rows))
                .collect();
            line.push_str(&format!(" ({} by source)", each.join(" + ")));
        }
        line.push_str(&format!(
            " in {} ({} rows/s), behind latest {}, wal {}, commit {}",
            millis(micros.trigger_execution),
            rate(self.processed_rows_per_second),
            thousands(self.offsets_behind_latest()),
            millis(micros.wal_commit),
            millis(micros.commit_offsets)
        ));
        if self.sink.num_output_rows != self.num_input_rows {
            line.push_str(&format!(
                ", {} rows out",
                thousands(self.sink.num_output_rows)
            ));
        }
        for (metric, what) in [
            ("badRecords", "bad records"),
            ("dataLossOffsets", "offsets lost"),
        ] {
            let count: u64 = self
                .sources
                .iter()
                .filter_map(|s| s.metrics.get(metric)?.parse::<u64>().ok())
                .sum();
            if count > 0 {
                line.push_str(&format!(", {} {what}", thousands(count)));
            }
        }
        // Worth a word only when records are fetched again and again.
        if let Some(ratio) = self
            .sources
            .iter()
            .filter_map(|s| s.metrics.get("readAmplification")?.parse::<f64>().ok())
            .reduce(f64::max)
            .filter(|r| *r >= 1.5)
        {
            line.push_str(&format!(", fetched {ratio:.1}x what it read"));
        }
        for operator in &self.state_operators {
            line.push_str(&format!(
                ", state {} rows",
                thousands(operator.num_rows_total)
            ));
            if operator.num_rows_dropped_by_watermark > 0 {
                line.push_str(&format!(
                    ", {} late rows dropped",
                    thousands(operator.num_rows_dropped_by_watermark)
                ));
            }
        }
        if let Some(memory) = &self.memory {
            line.push_str(&format!(
                ", state and batch {} of {}",
                size(memory.state_bytes + memory.batch_bytes),
                size(memory.budget_bytes)
            ));
            if memory.limited_by == "memory" {
                line.push_str(&format!(
                    ", batch held to {} records by it",
                    thousands(memory.max_records)
                ));
            }
        }
        if let Some(group) = &self.group {
            let held: usize = group.partitions.values().map(Vec::len).sum();
            line.push_str(&format!(
                ", generation {} over {held} partitions",
                group.generation
            ));
        }
        line
    }

    /// Offsets between the batch's end and the latest offsets, over all partitions.
    fn offsets_behind_latest(&self) -> u64 {
        let mut behind = 0;
        for source in &self.sources {
            let (Value::Object(ends), Value::Object(latest)) =
                (&source.end_offset, &source.latest_offset)
            else {
                continue;
            };
            for (topic, partitions) in ends {
                let Value::Object(partitions) = partitions else {
                    continue;
                };
                for (partition, end) in partitions {
                    let last = latest.get(topic).and_then(|p| p.get(partition));
                    if let (Some(end), Some(last)) = (end.as_i64(), last.and_then(Value::as_i64)) {
                        behind += u64::try_from(last.saturating_sub(end)).unwrap_or(0);
                    }
                }
            }
        }
        behind
    }
}

/// `1234567` as `1,234,567`.
/// Bytes in KiB under a mebibyte, else in MiB, with a decimal.
fn size(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
    }
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Microseconds as milliseconds, with a decimal below 10 ms.
fn millis(micros: u64) -> String {
    let ms = micros as f64 / 1000.0;
    if ms < 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{} ms", ms.round() as u64)
    }
}

/// A rate with three significant figures and a k or M.
fn rate(per_second: f64) -> String {
    let (value, unit) = if per_second >= 1e6 {
        (per_second / 1e6, "M")
    } else if per_second >= 1e3 {
        (per_second / 1e3, "k")
    } else {
        (per_second, "")
    };
    let decimals = if value >= 100.0 || unit.is_empty() {
        0
    } else if value >= 10.0 {
        1
    } else {
        2
    };
    format!("{value:.decimals$}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::TopicPartition;

    fn report() -> QueryProgress {
        QueryProgress {
            id: "q".into(),
            run_id: "r".into(),
            name: None,
            timestamp: "2026-12-01T00:00:00.000Z".into(),
            batch_id: 42,
            num_input_rows: 10_000,
            input_rows_per_second: 0.0,
            processed_rows_per_second: 550_123.0,
            duration_ms: DurationMs::default(),
            duration_micros: DurationMs {
                wal_commit: 700,
                commit_offsets: 1_100,
                trigger_execution: 18_200,
                ..DurationMs::default()
            },
            event_time: None,
            state_operators: Vec::new(),
            memory: None,
            lookup_tables: Vec::new(),
            sources: vec![SourceProgress {
                description: "KafkaV2[Subscribe[events]]".into(),
                start_offset: serde_json::json!({"events": {"0": 0, "1": 0}}),
                end_offset: serde_json::json!({"events": {"0": 5000, "1": 5000}}),
                latest_offset: serde_json::json!({"events": {"0": 5000, "1": 6234}}),
                num_input_rows: 10_000,
                input_rows_per_second: 0.0,
                processed_rows_per_second: 550_123.0,
                metrics: BTreeMap::from([
                    ("badRecords".to_owned(), "0".to_owned()),
                    ("dataLossOffsets".to_owned(), "0".to_owned()),
                ]),
                watermark: None,
            }],
            sink: SinkProgress {
                description: "discard".into(),
                num_output_rows: 10_000,
                metrics: BTreeMap::new(),
            },
            group: None,
        }
    }

    #[test]
    fn offsets_are_the_value_of_their_spark_json() {
        let mut offsets = PartitionOffsets::new();
        for (topic, partitions) in [("b\"quoted", 3), ("a", 12), ("c", 1)] {
            for p in 0..partitions {
                offsets.insert(
                    sluice_core::TopicPartition::new(topic, p),
                    sluice_core::Offset::new(i64::from(p) * 7 + 1).unwrap(),
                );
            }
        }
        let parsed: Value = serde_json::from_str(&sluice_core::offsets_to_json(&offsets)).unwrap();
        assert_eq!(offsets_value(&offsets), parsed);
        assert_eq!(
            offsets_value(&PartitionOffsets::new()),
            serde_json::json!({})
        );
    }

    #[test]
    fn a_batch_reads_as_one_short_line() {
        assert_eq!(
            report().summary(),
            "batch 42: 10,000 rows in 18 ms (550k rows/s), behind latest 1,234, wal 0.7 ms, \
             commit 1.1 ms"
        );
        let mut two = report();
        let mut second = two.sources[0].clone();
        two.sources[0].num_input_rows = 9_000;
        second.num_input_rows = 1_000;
        second.end_offset = serde_json::json!({});
        two.sources.push(second);
        assert!(
            two.summary().starts_with(
                "batch 42: 10,000 rows (9,000 + 1,000 by source) in 18 ms (550k rows/s)"
            ),
            "{}",
            two.summary()
        );
        let mut odd = report();
        odd.sink.num_output_rows = 12;
        odd.sources[0]
            .metrics
            .insert("badRecords".to_owned(), "3".to_owned());
        odd.processed_rows_per_second = 2_345_678.0;
        odd.state_operators.push(StateOperatorProgress {
            operator_name: "stateStoreSave".into(),
            num_rows_total: 1_500,
            num_rows_updated: 10,
            num_rows_removed: 0,
            num_rows_dropped_by_watermark: 2,
            memory_used_bytes: 0,
            batch_memory_bytes: 0,
            commit_time_ms: 0,
            num_state_store_instances: 1,
            custom_metrics: BTreeMap::new(),
        });
        assert_eq!(
            odd.summary(),
            "batch 42: 10,000 rows in 18 ms (2.35M rows/s), behind latest 1,234, wal 0.7 ms, \
             commit 1.1 ms, 12 rows out, 3 bad records, state 1,500 rows, 2 late rows dropped"
        );
        odd.memory = Some(MemoryProgress {
            budget_bytes: 64 << 20,
            state_bytes: 3 << 20,
            bytes_per_record: 120.0,
            measured: true,
            max_records: 10_000,
            limited_by: "memory",
            batch_bytes: 1 << 20,
        });
        assert!(
            odd.summary().ends_with(
                "2 late rows dropped, state and batch 4.0 MiB of 64.0 MiB, batch held to \
                 10,000 records by it"
            ),
            "{}",
            odd.summary()
        );
    }

    #[test]
    fn the_read_amplification_goes_into_the_metrics_and_into_the_line_when_high() {
        let amplification = ReadAmplification {
            fetched_bytes: 3_000,
            read_bytes: 1_000,
            recent_fetched_bytes: 230,
            recent_read_bytes: 100,
            worst_partitions: vec![
                (TopicPartition::new("t", 3), 4.5),
                (TopicPartition::new("t", 1), 2.25),
            ],
        };
        let end = PartitionOffsets::new();
        let metrics = source_metrics(&end, &end, &[], 0, Some(&amplification));
        assert_eq!(metrics["readAmplification"], "2.30");
        assert_eq!(metrics["readAmplificationTotal"], "3.00");
        assert_eq!(metrics["fetchedBytes"], "3000");
        assert_eq!(metrics["readBytes"], "1000");
        assert_eq!(metrics["readAmplificationWorst"], "t-3:4.50,t-1:2.25");
        assert!(!source_metrics(&end, &end, &[], 0, None).contains_key("readAmplification"));

        let mut high = report();
        high.sources[0].metrics.extend(metrics);
        assert!(
            high.summary()
                .ends_with("commit 1.1 ms, fetched 2.3x what it read"),
            "{}",
            high.summary()
        );
        high.sources[0]
            .metrics
            .insert("readAmplification".to_owned(), "1.10".to_owned());
        assert!(
            high.summary().ends_with("commit 1.1 ms"),
            "{}",
            high.summary()
        );
    }

    #[test]
    fn a_group_member_names_itself_and_its_partitions() {
        let mut member = report();
        member.group = Some(GroupProgress::new(
            "m-1",
            "m-1.3",
            &[
                TopicPartition::new("events", 7),
                TopicPartition::new("events", 2),
                TopicPartition::new("audit", 0),
                TopicPartition::new("events", 2),
            ],
        ));
        let json: Value = serde_json::from_str(&member.to_json()).unwrap();
        assert_eq!(
            json["group"],
            serde_json::json!({
                "member": "m-1",
                "generation": "m-1.3",
                "partitions": {"audit": [0], "events": [2, 7]},
            })
        );
        assert!(
            member
                .summary()
                .ends_with(", generation m-1.3 over 3 partitions"),
            "{}",
            member.summary()
        );
        let alone: Value = serde_json::from_str(&report().to_json()).unwrap();
        assert!(alone.get("group").is_none(), "{alone}");
    }

    #[test]
    fn numbers_are_written_as_people_read_them() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(12_345_678), "12,345,678");
        assert_eq!(rate(12.4), "12");
        assert_eq!(rate(12_345.0), "12.3k");
        assert_eq!(millis(260), "0.3 ms");
        assert_eq!(millis(123_456), "123 ms");
    }
}
