//! How the stream is processed: the values' format and schema, what happens
//! to a value that does not decode (`[dead_letter]`), the event time, and
//! `[query]`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_core::BadRecordPolicy;
use sluice_kafka::KafkaSourceConfig;

use super::source::SourceSection;
use super::values::{parse_duration, with_source_security};

/// `[query]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuerySection {
    /// A SELECT over the source table.
    pub sql: String,
    /// When an aggregation emits a group: "append", "update" or "complete".
    pub output_mode: Option<String>,
    /// The most groups an aggregation may hold.
    pub max_state_rows: Option<u64>,
    /// How many partitions an aggregation's state is split into.
    pub state_partitions: Option<u32>,
    /// The memory an aggregation's state and a batch's groups may take, in MiB.
    pub state_memory_mb: Option<u64>,
}

/// `[query] state_memory_mb` when it is not set: a batch is planned to a
/// sixteenth of it, so that a query at its defaults stays within a small machine.
pub const DEFAULT_STATE_MEMORY_MB: u64 = 256;

/// The largest `state_memory_mb` taken: 1 TiB.
const MOST_STATE_MEMORY_MB: u64 = 1 << 20;

/// `[dead_letter]`: a directory of JSON-lines files, or a Kafka topic.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterSection {
    pub path: Option<PathBuf>,
    pub topic: Option<String>,
    /// The Kafka cluster of `topic`; the source's by default.
    pub bootstrap_servers: Option<String>,
}

/// How the stream is processed, checked.
#[derive(Debug, Clone)]
pub struct Processing {
    /// The SQL, if any.
    pub sql: Option<String>,
    /// Whether every source's values are read raw, with nothing to decode.
    pub raw: bool,
    /// The event-time column and the watermark delay in milliseconds that a
    /// window or a deduplication keeps its state by: the first source's
    /// column with event time, and the longest delay of them all.
    pub watermark: Option<(String, i64)>,
    /// `[query] output_mode`, when set.
    pub output_mode: Option<sluice_sql::OutputMode>,
    /// `[query] max_state_rows`, when set.
    pub max_state_rows: Option<u64>,
    /// `[query] state_partitions`, when set.
    pub state_partitions: Option<u32>,
    /// `[query] state_memory_mb`, in bytes.
    pub state_memory_bytes: std::num::NonZeroU64,
    /// `[tables.*]`, the lookup tables.
    pub tables: Vec<super::TableSpec>,
}

impl Processing {
    /// How the query is planned.
    pub fn query_options(&self) -> sluice_sql::QueryOptions {
        sluice_sql::QueryOptions {
            output_mode: self.output_mode,
            watermark_column: self.watermark.as_ref().map(|(column, _)| column.clone()),
            watermark_delay_ms: self.watermark.as_ref().map(|(_, delay)| *delay),
            max_state_rows: self.max_state_rows,
            state_partitions: self.state_partitions,
            state_memory_bytes: Some(self.state_memory_bytes.get()),
            // Read from `tables` when the query is planned, not by the
            // configuration's checks.
            lookup_tables: Vec::new(),
        }
    }
}

impl Processing {
    /// Whether records reach the sink as read, with nothing to decode or query.
    pub fn is_pass_through(&self) -> bool {
        self.sql.is_none() && self.raw && self.watermark.is_none()
    }
}

/// One source of the query: its table, how it is read, and how its values
/// are decoded and timed.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// The source's table in `[query] sql`.
    pub table: String,
    /// What it reads, where it starts and how fast.
    pub source: super::SourceSettings,
    /// How its values are read.
    pub format: sluice_sql::Format,
    /// What happens to its records whose values do not decode.
    pub on_bad_record: BadRecordPolicy,
    /// Its event-time column and watermark delay in milliseconds.
    pub watermark: Option<(String, i64)>,
}

/// The source `section` of table `name`, with its reading settings checked.
pub(super) fn stream(
    name: &str,
    section: &SourceSection,
    source: super::SourceSettings,
) -> Result<StreamSettings> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        bail!("the source table {name:?} must be a plain name: letters, digits and underscores");
    }
    let format = format(section)?;
    let on_bad_record = on_bad_record(section)?;
    if format == sluice_sql::Format::Raw && on_bad_record != BadRecordPolicy::Fail {
        bail!(
            "on_bad_record applies to values that do not decode, but format is \"raw\": set \
             format = \"json\", \"csv\" or \"avro\" with a schema"
        );
    }
    Ok(StreamSettings {
        table: name.to_owned(),
        source,
        format,
        on_bad_record,
        watermark: watermark(section)?,
    })
}

/// Where records whose values do not decode go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetters {
    /// Nowhere: `on_bad_record` is not "dead_letter".
    None,
    /// JSON-lines files in a directory, one per batch.
    Directory(PathBuf),
    /// A Kafka topic.
    Kafka(sluice_kafka::KafkaSinkConfig),
}

/// The processing of `[source]`'s values and `[query]`, and where values
/// that do not decode go; `kafka` is the source's, whose cluster a
/// dead-letter topic is on by default.
pub(super) fn processing(
    streams: &[StreamSettings],
    query: Option<QuerySection>,
    dead_letter: Option<DeadLetterSection>,
    kafka: &KafkaSourceConfig,
) -> Result<(Processing, DeadLetters)> {
    let table = &streams[0].table;
    let (sql, output_mode, max_state_rows, state_partitions, state_memory_mb) = match query {
        Some(query) => (
            Some(query.sql),
            query.output_mode,
            query.max_state_rows,
            query.state_partitions,
            query.state_memory_mb,
        ),
        None => (None, None, None, None, None),
    };
    let state_memory_mb = state_memory_mb.unwrap_or(DEFAULT_STATE_MEMORY_MB);
    if !(1..=MOST_STATE_MEMORY_MB).contains(&state_memory_mb) {
        bail!(
            "query.state_memory_mb = {state_memory_mb}: it must be from 1 to {MOST_STATE_MEMORY_MB} \
             (MiB)"
        );
    }
    let state_memory_bytes = std::num::NonZeroU64::new(state_memory_mb << 20)
        .context("query.state_memory_mb is at least 1")?;
    if max_state_rows == Some(0) {
        bail!("query.max_state_rows must be at least 1");
    }
    if let Some(n) = state_partitions
        && !(1..=sluice_sql::MAX_STATE_PARTITIONS).contains(&n)
    {
        bail!(
            "query.state_partitions = {n}: it must be from 1 to {}",
            sluice_sql::MAX_STATE_PARTITIONS
        );
    }
    let output_mode = match output_mode.as_deref() {
        None => None,
        Some("append") => Some(sluice_sql::OutputMode::Append),
        Some("update") => Some(sluice_sql::OutputMode::Update),
        Some("complete") => Some(sluice_sql::OutputMode::Complete),
        Some(other) => {
            bail!("query.output_mode must be \"append\", \"update\" or \"complete\", not {other:?}")
        }
    };
    if sql.as_deref().is_some_and(|s| s.trim().is_empty()) {
        bail!("query.sql is empty: write a SELECT over the source table `{table}`");
    }
    // The dead letters are the query's: any source may send records there.
    let dead_letter_policy = streams
        .iter()
        .map(|s| s.on_bad_record)
        .find(|p| *p == BadRecordPolicy::DeadLetter)
        .unwrap_or(streams[0].on_bad_record);
    let dead_letters = dead_letters(dead_letter_policy, dead_letter, kafka)?;
    let timed = streams.iter().filter_map(|s| s.watermark.as_ref());
    let watermark = timed.clone().next().map(|(column, _)| {
        let delay = timed.map(|(_, delay)| *delay).max().unwrap_or_default();
        (column.clone(), delay)
    });
    let processing = Processing {
        sql,
        raw: streams.iter().all(|s| s.format == sluice_sql::Format::Raw),
        watermark,
        output_mode,
        max_state_rows,
        state_partitions,
        state_memory_bytes,
        tables: Vec::new(),
    };
    Ok((processing, dead_letters))
}

/// How values are read: raw, or JSON, CSV or Avro with a schema.
fn format(source: &SourceSection) -> Result<sluice_sql::Format> {
    let declared = match (source.schema.clone(), source.schema_file.clone()) {
        (Some(_), Some(_)) => bail!("[source] takes schema or schema_file, not both"),
        (Some(text), None) => Some(text),
        (None, Some(path)) => Some(
            std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read source.schema_file {}", path.display()))?,
        ),
        (None, None) => None,
    };
    let format_name = source.format.as_deref().unwrap_or("raw");
    if format_name != "avro"
        && (source.avro_wire_format.is_some() || source.avro_schema_id.is_some())
    {
        bail!("source.avro_wire_format and avro_schema_id apply to format = \"avro\" only");
    }
    Ok(match (format_name, declared) {
        ("raw", None) => sluice_sql::Format::Raw,
        ("raw", Some(_)) => bail!(
            "source.schema declares columns, but format is \"raw\": set format = \"json\", \"csv\" \
             or \"avro\""
        ),
        ("json", Some(schema)) => {
            sluice_sql::Format::Json(sluice_sql::parse_ddl(schema.trim()).context("source.schema")?)
        }
        ("csv", Some(schema)) => {
            sluice_sql::Format::Csv(sluice_sql::parse_ddl(schema.trim()).context("source.schema")?)
        }
        ("json" | "csv", None) => bail!(
            "source.format = {format_name:?} needs source.schema, the values' columns in Spark's DDL \
             form, like \"order BIGINT, customer STRING, amount DOUBLE\""
        ),
        ("avro", Some(schema)) => {
            let wire = match (source.avro_wire_format.as_deref(), source.avro_schema_id) {
                (None | Some("raw"), None) => sluice_sql::AvroWire::Raw,
                (None | Some("raw"), Some(_)) => bail!(
                    "source.avro_schema_id applies to avro_wire_format = \"confluent\", whose values \
                     carry a schema id"
                ),
                (Some("confluent"), id) => sluice_sql::AvroWire::Confluent(id),
                (Some(other), _) => {
                    bail!("source.avro_wire_format must be \"raw\" or \"confluent\", not {other:?}")
                }
            };
            sluice_sql::Format::Avro(sluice_sql::AvroFormat::new(schema.trim(), wire)?)
        }
        ("avro", None) => bail!(
            "source.format = \"avro\" needs source.schema (or schema_file), the writer's schema in \
             Avro's JSON form, like '{{\"type\": \"record\", \"name\": \"Order\", \"fields\": [...]}}'"
        ),
        (other, _) => {
            bail!("source.format must be \"raw\", \"json\", \"csv\" or \"avro\", not {other:?}")
        }
    })
}

/// `on_bad_record`: what happens to a value that does not decode.
fn on_bad_record(source: &SourceSection) -> Result<BadRecordPolicy> {
    Ok(match source.on_bad_record.as_deref() {
        None | Some("fail") => BadRecordPolicy::Fail,
        Some("skip") => BadRecordPolicy::Skip,
        Some("dead_letter") => BadRecordPolicy::DeadLetter,
        Some(other) => bail!(
            "source.on_bad_record must be \"fail\", \"skip\" or \"dead_letter\", not {other:?}"
        ),
    })
}

/// Where values that do not decode go, with `on_bad_record = "dead_letter"`.
fn dead_letters(
    on_bad_record: BadRecordPolicy,
    section: Option<DeadLetterSection>,
    kafka: &KafkaSourceConfig,
) -> Result<DeadLetters> {
    Ok(match (on_bad_record, section) {
        (BadRecordPolicy::DeadLetter, None) => bail!(
            "on_bad_record = \"dead_letter\" needs a [dead_letter] table with path (a directory) \
             or topic (a Kafka topic)"
        ),
        (BadRecordPolicy::DeadLetter, Some(dead)) => {
            match (dead.path, dead.topic) {
                (Some(_), None) if dead.bootstrap_servers.is_some() => bail!(
                    "dead_letter.bootstrap_servers is for a dead-letter topic, and [dead_letter] \
                     names a directory (path)"
                ),
                (Some(path), None) => DeadLetters::Directory(path),
                (None, Some(topic)) => DeadLetters::Kafka(sluice_kafka::KafkaSinkConfig {
                    // On the source's cluster, it reaches it as the source does.
                    client_options: match &dead.bootstrap_servers {
                        None => with_source_security(&kafka.client_options, BTreeMap::new()),
                        Some(_) => BTreeMap::new(),
                    },
                    bootstrap_servers: dead
                        .bootstrap_servers
                        .unwrap_or_else(|| kafka.bootstrap_servers.clone()),
                    topic,
                    delivery: sluice_kafka::Delivery::AtLeastOnce,
                }),
                _ => bail!("[dead_letter] takes path or topic, exactly one"),
            }
        }
        (_, Some(_)) => bail!(
            "[dead_letter] is set, but on_bad_record is not \"dead_letter\", so nothing would go there"
        ),
        (_, None) => DeadLetters::None,
    })
}

/// The event-time column and the watermark's delay in milliseconds.
fn watermark(source: &SourceSection) -> Result<Option<(String, i64)>> {
    Ok(
        match (source.event_time.clone(), source.watermark_delay.clone()) {
            (Some(column), None) => bail!(
                "source.event_time = {column:?} takes effect with a watermark: set source.watermark_delay \
             too, like \"10s\""
            ),
            (column, Some(delay)) => {
                let delay = parse_duration("source.watermark_delay", &delay)?;
                Some((
                    column.unwrap_or_else(|| "timestamp".to_owned()),
                    i64::try_from(delay.as_millis()).unwrap_or(i64::MAX),
                ))
            }
            (None, None) => None,
        },
    )
}
