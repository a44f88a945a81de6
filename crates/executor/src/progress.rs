//! What each batch reports, with the fields of Spark's `StreamingQueryProgress`.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use sluice_offsets::{DataLoss, EventTimeStats, PartitionOffsets, offsets_to_json};

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
    /// The one source.
    pub sources: Vec<SourceProgress>,
    /// The sink.
    pub sink: SinkProgress,
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
    /// Writing the plan durably.
    pub wal_commit: u64,
    /// Reading the records.
    pub get_batch: u64,
    /// Handing them to the sink.
    pub add_batch: u64,
    /// Of `add_batch`, the sink's finish: waiting until what it was handed is
    /// durable, and its own commit (the Kafka sink's transaction). Not Spark's.
    pub sink_commit: u64,
    /// Writing the commit (and progress to the consumer group).
    pub commit_offsets: u64,
    /// The whole trigger.
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
}

/// The sink's part of a progress report.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SinkProgress {
    /// What the sink is.
    pub description: String,
    /// Rows handed to the sink: the records as read, or the rows a query made.
    pub num_output_rows: u64,
}

/// Spark's `eventTime` entry: the watermark always, and the rows' minimum,
/// maximum and mean event time when the batch had any.
pub(crate) fn event_time_entry(stats: &EventTimeStats) -> BTreeMap<String, String> {
    let format = |ms: i64| {
        let at = std::time::UNIX_EPOCH
            + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
        humantime::format_rfc3339_millis(at).to_string()
    };
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

/// Offsets as a JSON value in Spark's shape.
pub(crate) fn offsets_value(offsets: &PartitionOffsets) -> Value {
    serde_json::from_str(&offsets_to_json(offsets)).unwrap_or(Value::Null)
}

/// Spark's Kafka lag metrics, plus the offsets lost to tolerated data loss and
/// the records that could not be processed.
pub(crate) fn source_metrics(
    end: &PartitionOffsets,
    latest: &PartitionOffsets,
    losses: &[DataLoss],
    bad_records: u64,
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
}
