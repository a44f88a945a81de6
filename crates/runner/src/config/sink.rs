//! `[sink]`: where rows go, each sink's options checked against its type.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_executor::Trigger;
use sluice_kafka::KafkaSourceConfig;

use super::checkpoint::CassandraAuth;
use super::processing::Processing;
use super::values::{client_options, with_source_security};

/// `[sink]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkSection {
    #[serde(rename = "type")]
    pub kind: String,
    pub path: Option<PathBuf>,
    pub format: Option<String>,
    /// How many rows of each batch a `console` sink's table shows (Spark's
    /// `numRows`, default 20).
    pub num_rows: Option<usize>,
    /// Whether a `console` sink's table cuts values to 20 characters (Spark's
    /// `truncate`, default true).
    pub truncate: Option<bool>,
    /// The output topic of a `kafka` sink.
    pub topic: Option<String>,
    /// The output cluster of a `kafka` sink; the source's by default.
    pub bootstrap_servers: Option<String>,
    /// Producer options of a `kafka` sink, passed through.
    #[serde(default)]
    pub kafka: BTreeMap<String, toml::Value>,
    /// A `kafka` sink's guarantee: "at_least_once" or "exactly_once".
    pub delivery: Option<String>,
    /// Contact points of a `cassandra` sink, `host:port[,host:port]`.
    pub nodes: Option<String>,
    /// The keyspace of a `cassandra` sink.
    pub keyspace: Option<String>,
    /// The table of a `cassandra` sink.
    pub table: Option<String>,
    /// A `cassandra` sink's columns: column = "topic" | "partition" | "offset" |
    /// "timestamp" | "key" | "value" | `"value.<json path>"`.
    #[serde(default)]
    pub columns: BTreeMap<String, String>,
    /// A `cassandra` sink's authentication and TLS.
    #[serde(flatten)]
    pub auth: CassandraAuth,
    /// A `parquet` or `delta` sink's partition columns, Hive-style
    /// directories in order.
    #[serde(default)]
    pub partition_by: Vec<String>,
    /// A `parquet` or `delta` sink's codec: "zstd" (default), "snappy" or
    /// "none".
    pub compression: Option<String>,
    /// The most rows of a `parquet` or `delta` sink's row group (1,048,576 by
    /// default).
    pub row_group_rows: Option<usize>,
    /// The size in MiB at which a `parquet` or `delta` sink begins its next
    /// file (128).
    pub file_size_mb: Option<u64>,
    /// Commits between checkpoints of a `delta` sink's log, for a table it
    /// creates (Delta's `delta.checkpointInterval`, 10).
    pub checkpoint_interval: Option<u64>,
}

/// The built-in sinks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkKind {
    Discard,
    Console {
        json: bool,
        num_rows: usize,
        truncate: bool,
    },
    Jsonl {
        path: PathBuf,
    },
    Kafka(sluice_kafka::KafkaSinkConfig),
    Cassandra(sluice_cassandra_store::CassandraSinkConfig),
    Parquet(TableSinkConfig),
    Delta(TableSinkConfig),
}

/// A `parquet` or `delta` sink's options; the query's id completes them at
/// start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSinkConfig {
    pub path: PathBuf,
    pub partition_by: Vec<String>,
    pub compression: sluice_lake::Compression,
    pub row_group_rows: usize,
    pub file_bytes: u64,
    /// A `delta` sink's; `None` for `parquet`.
    pub checkpoint_interval: Option<u64>,
}

impl TableSinkConfig {
    /// A `parquet` sink's options for query `query_id`.
    pub fn parquet(&self, query_id: &str) -> sluice_lake::ParquetOptions {
        let mut options = sluice_lake::ParquetOptions::new(&self.path, query_id);
        options.partition_by = self.partition_by.clone();
        options.compression = self.compression;
        options.row_group_rows = self.row_group_rows;
        options.file_bytes = self.file_bytes;
        options
    }

    /// A `delta` sink's options for query `query_id`, named `name`.
    pub fn delta(&self, query_id: &str, name: Option<&str>) -> sluice_lake::DeltaOptions {
        let mut options = sluice_lake::DeltaOptions::new(&self.path, query_id);
        options.partition_by = self.partition_by.clone();
        options.compression = self.compression;
        options.row_group_rows = self.row_group_rows;
        options.file_bytes = self.file_bytes;
        if let Some(interval) = self.checkpoint_interval {
            options.checkpoint_interval = interval;
        }
        options.name = name.map(str::to_owned);
        options
    }
}

/// Refuses an option of another sink type than the one configured, which
/// would otherwise be ignored without a word.
fn check_sink_options(sink: &SinkSection) -> Result<()> {
    let set = [
        ("path", sink.path.is_some()),
        ("format", sink.format.is_some()),
        ("num_rows", sink.num_rows.is_some()),
        ("truncate", sink.truncate.is_some()),
        ("topic", sink.topic.is_some()),
        ("bootstrap_servers", sink.bootstrap_servers.is_some()),
        ("kafka", !sink.kafka.is_empty()),
        ("nodes", sink.nodes.is_some()),
        ("keyspace", sink.keyspace.is_some()),
        ("table", sink.table.is_some()),
        ("columns", !sink.columns.is_empty()),
        ("username", sink.auth.username.is_some()),
        ("password", sink.auth.password.is_some()),
        ("password_env", sink.auth.password_env.is_some()),
        ("tls_ca_file", sink.auth.tls_ca_file.is_some()),
        ("partition_by", !sink.partition_by.is_empty()),
        ("compression", sink.compression.is_some()),
        ("row_group_rows", sink.row_group_rows.is_some()),
        ("file_size_mb", sink.file_size_mb.is_some()),
        ("checkpoint_interval", sink.checkpoint_interval.is_some()),
    ];
    let table = matches!(sink.kind.as_str(), "parquet" | "delta");
    let owner = |key: &str| match key {
        "path" | "partition_by" | "compression" | "row_group_rows" | "file_size_mb" if table => {
            sink.kind.as_str()
        }
        "path" => "jsonl",
        "partition_by" | "compression" | "row_group_rows" | "file_size_mb" => "parquet",
        "checkpoint_interval" => "delta",
        "format" | "num_rows" | "truncate" => "console",
        "topic" | "bootstrap_servers" | "kafka" => "kafka",
        _ => "cassandra",
    };
    let known = [
        "console",
        "discard",
        "jsonl",
        "kafka",
        "cassandra",
        "parquet",
        "delta",
    ];
    if !known.contains(&sink.kind.as_str()) {
        return Ok(());
    }
    match set
        .iter()
        .find(|(key, is_set)| *is_set && owner(key) != sink.kind)
    {
        Some((key, _)) => bail!(
            "sink.{key} is an option of the {} sink, and sink.type is {:?}: remove it, or change \
             the type",
            owner(key),
            sink.kind
        ),
        None => Ok(()),
    }
}

/// The sink of `section`: the source's `kafka` options give a kafka sink on
/// the same cluster its servers and security, the `trigger` rules out what it
/// cannot deliver, and `processing` says whether rows or records arrive.
pub(super) fn sink(
    section: SinkSection,
    kafka: &KafkaSourceConfig,
    trigger: Trigger,
    processing: &Processing,
) -> Result<SinkKind> {
    if section.delivery.is_some() && section.kind != "kafka" {
        bail!(
            "sink.delivery is the kafka sink's; a {:?} sink's guarantee is its own (see \
             docs/delivery.md)",
            section.kind
        );
    }
    check_sink_options(&section)?;
    match section.kind.as_str() {
        "console" => console(&section),
        "discard" => Ok(SinkKind::Discard),
        "jsonl" => Ok(SinkKind::Jsonl {
            path: section
                .path
                .context("a jsonl sink needs sink.path, the directory to write batch files to")?,
        }),
        "kafka" => kafka_sink(section, kafka, trigger),
        "cassandra" => cassandra(section, processing),
        "parquet" => table(section, trigger).map(SinkKind::Parquet),
        "delta" => table(section, trigger).map(SinkKind::Delta),
        other => bail!(
            "sink.type must be \"jsonl\", \"parquet\", \"delta\", \"cassandra\", \"kafka\", \"console\" \
             or \"discard\", not {other:?}"
        ),
    }
}

/// A `parquet` or `delta` sink.
fn table(section: SinkSection, trigger: Trigger) -> Result<TableSinkConfig> {
    let kind = section.kind.as_str();
    if matches!(trigger, Trigger::Continuous(_)) {
        bail!(
            "sink.type = {kind:?} with trigger.continuous: a batch's files are committed when \
             it ends, so an epoch's rows would wait for its end; use processing_time"
        );
    }
    if section.checkpoint_interval == Some(0) {
        bail!("sink.checkpoint_interval must be at least 1");
    }
    let compression = match section.compression.as_deref() {
        None | Some("zstd") => sluice_lake::Compression::Zstd,
        Some("snappy") => sluice_lake::Compression::Snappy,
        Some("none") => sluice_lake::Compression::None,
        Some(other) => {
            bail!("sink.compression must be \"zstd\", \"snappy\" or \"none\", not {other:?}")
        }
    };
    if section.row_group_rows == Some(0) {
        bail!("sink.row_group_rows must be at least 1");
    }
    if section.file_size_mb == Some(0) {
        bail!("sink.file_size_mb must be at least 1");
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(twice) = section.partition_by.iter().find(|c| !seen.insert(*c)) {
        bail!("sink.partition_by names `{twice}` twice");
    }
    Ok(TableSinkConfig {
        path: section.path.with_context(|| {
            format!("a {kind} sink needs sink.path, the directory of the table")
        })?,
        partition_by: section.partition_by,
        compression,
        row_group_rows: section.row_group_rows.unwrap_or(1024 * 1024),
        file_bytes: section.file_size_mb.unwrap_or(128) * 1024 * 1024,
        checkpoint_interval: section.checkpoint_interval,
    })
}

fn console(section: &SinkSection) -> Result<SinkKind> {
    let json = match section.format.as_deref() {
        None | Some("text") => false,
        Some("json") => true,
        Some(other) => bail!("sink.format must be \"text\" or \"json\", not {other:?}"),
    };
    if section.num_rows == Some(0) {
        bail!("sink.num_rows must be at least 1");
    }
    Ok(SinkKind::Console {
        json,
        num_rows: section
            .num_rows
            .unwrap_or(sluice_executor::sinks::DEFAULT_NUM_ROWS),
        truncate: section.truncate.unwrap_or(true),
    })
}

fn kafka_sink(
    section: SinkSection,
    kafka: &KafkaSourceConfig,
    trigger: Trigger,
) -> Result<SinkKind> {
    let delivery = match section.delivery.as_deref() {
        None | Some("at_least_once") => sluice_kafka::Delivery::AtLeastOnce,
        Some("exactly_once") => sluice_kafka::Delivery::ExactlyOnce,
        Some(other) => {
            bail!("sink.delivery must be \"at_least_once\" or \"exactly_once\", not {other:?}")
        }
    };
    let own_options = client_options("sink.kafka", section.kafka)?;
    // On the source's cluster, the sink reaches it as the source does.
    let sink_options = match &section.bootstrap_servers {
        None => with_source_security(&kafka.client_options, own_options),
        Some(_) => own_options,
    };
    let bootstrap_servers = section
        .bootstrap_servers
        .unwrap_or_else(|| kafka.bootstrap_servers.clone());
    if delivery == sluice_kafka::Delivery::ExactlyOnce && matches!(trigger, Trigger::Continuous(_))
    {
        bail!(
            "sink.delivery = \"exactly_once\" with trigger.continuous: an epoch's \
                 transaction would hold every record back until the epoch ends, and the \
                 continuous trigger is at least once (docs/delivery.md); use \
                 delivery = \"at_least_once\", or processing_time = \"0s\", which is \
                 exactly once within milliseconds"
        );
    }
    if delivery == sluice_kafka::Delivery::ExactlyOnce
        && bootstrap_servers != kafka.bootstrap_servers
    {
        bail!(
            "sink.delivery = \"exactly_once\" with sink.bootstrap_servers = \
                 {bootstrap_servers:?}, another cluster than the source's: exactly once \
                 commits each batch's source offsets inside the output transaction, which \
                 Kafka allows only on the cluster that holds both; leave \
                 sink.bootstrap_servers out, or use at_least_once"
        );
    }
    Ok(SinkKind::Kafka(sluice_kafka::KafkaSinkConfig {
        bootstrap_servers,
        topic: section
            .topic
            .context("a kafka sink needs sink.topic, the topic to produce to")?,
        client_options: sink_options,
        delivery,
    }))
}

fn cassandra(section: SinkSection, processing: &Processing) -> Result<SinkKind> {
    let need = |value: Option<String>, key: &str| {
        value.with_context(|| format!("a cassandra sink needs sink.{key}"))
    };
    let nodes: Vec<String> = need(section.nodes, "nodes")?
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    let connection = section.auth.connection(nodes, "sink")?;
    let keyspace = need(section.keyspace, "keyspace")?;
    let table = need(section.table, "table")?;
    let (columns, renames) = if processing.is_pass_through() {
        if section.columns.is_empty() {
            bail!("a cassandra sink needs [sink.columns], mapping columns to record fields");
        }
        let columns = section
            .columns
            .into_iter()
            .map(
                |(column, field)| match sluice_cassandra_store::Field::parse(&field) {
                    Some(field) => Ok((column, field)),
                    None => bail!(
                        "sink.columns.{column} = {field:?}: use topic, partition, offset, \
                         timestamp, key, value or value.<json path>"
                    ),
                },
            )
            .collect::<Result<_>>()?;
        (columns, BTreeMap::new())
    } else {
        // Rows map to columns by name; [sink.columns] renames.
        (BTreeMap::new(), section.columns)
    };
    Ok(SinkKind::Cassandra(
        sluice_cassandra_store::CassandraSinkConfig {
            connection,
            keyspace,
            table,
            columns,
            renames,
        },
    ))
}
