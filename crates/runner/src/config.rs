//! The TOML configuration of a query. Source options are named as Spark names
//! them, in snake_case.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_executor::Trigger;
use sluice_kafka_source::{KafkaSourceConfig, TopicSelection};
use sluice_offsets::{
    MinOffsetsPerTrigger, StartingOptions, TimestampFallback, TopicPartition,
    parse_starting_offsets, values_from_json,
};

/// Overrides `source.bootstrap_servers`.
pub const BOOTSTRAP_ENV: &str = "SLUICE_BOOTSTRAP_SERVERS";
/// Overrides `checkpoint.location`.
pub const CHECKPOINT_ENV: &str = "SLUICE_CHECKPOINT_LOCATION";
/// The source's `fetch.wait.max.ms` under the continuous trigger, unless
/// `[source.kafka]` sets it.
const CONTINUOUS_FETCH_WAIT_MAX_MS: &str = "5";

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The query's name, for logs and progress.
    pub name: Option<String>,
    /// Where records come from.
    pub source: SourceSection,
    /// Where offsets are kept.
    pub checkpoint: CheckpointSection,
    /// When batches run.
    #[serde(default)]
    pub trigger: TriggerSection,
    /// Where records go.
    pub sink: SinkSection,
    /// Where progress is reported besides the log.
    #[serde(default)]
    pub progress: ProgressSection,
    /// How transient Kafka failures are retried.
    #[serde(default)]
    pub retry: RetrySection,
    /// The SQL the stream goes through.
    pub query: Option<QuerySection>,
    /// Where records go whose values do not decode, with `on_bad_record = "dead_letter"`.
    pub dead_letter: Option<DeadLetterSection>,
    /// Several processes share the query through Kafka's consumer group.
    #[serde(default)]
    pub scale_out: ScaleOutSection,
}

/// `[scale_out]`: every process runs the same configuration, and Kafka's
/// consumer group shares the partitions among them (`docs/scale-out.md`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleOutSection {
    #[serde(default)]
    pub enabled: bool,
    /// "classic" (cooperative-sticky, the default) or "consumer" (KIP-848).
    pub group_protocol: Option<String>,
}

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
}

/// `[dead_letter]`: a directory of JSON-lines files, or a Kafka topic.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterSection {
    pub path: Option<PathBuf>,
    pub topic: Option<String>,
    /// The Kafka cluster of `topic`; the source's by default.
    pub bootstrap_servers: Option<String>,
}

/// `[retry]`: transient failures (a broker restarting, timeouts) are retried with
/// exponential backoff before the query stops.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySection {
    pub max_attempts: Option<u32>,
    pub initial_backoff: Option<String>,
    pub max_backoff: Option<String>,
    pub startup_timeout: Option<String>,
}

/// `[source]`: Kafka, with Spark's option names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceSection {
    pub bootstrap_servers: Option<String>,
    pub subscribe: Option<Vec<String>>,
    pub subscribe_pattern: Option<String>,
    pub assign: Option<BTreeMap<String, Vec<i32>>>,
    pub starting_offsets: Option<String>,
    pub starting_offsets_by_timestamp: Option<String>,
    pub starting_timestamp: Option<i64>,
    pub starting_offsets_by_timestamp_strategy: Option<String>,
    #[serde(default = "yes")]
    pub fail_on_data_loss: bool,
    pub max_offsets_per_trigger: Option<u64>,
    pub min_offsets_per_trigger: Option<u64>,
    pub max_trigger_delay: Option<String>,
    #[serde(default)]
    pub include_headers: bool,
    pub poll_timeout_ms: Option<u64>,
    pub fetch_offset_num_retries: Option<u32>,
    pub fetch_offset_retry_interval_ms: Option<u64>,
    pub request_timeout_ms: Option<u64>,
    pub group_id: Option<String>,
    #[serde(default)]
    pub commit_progress: bool,
    /// How many MiB of records the reader may hold ahead of the batches.
    pub read_ahead_mb: Option<u64>,
    /// The name of the source table in `[query] sql`.
    pub table: Option<String>,
    /// How values are read: "raw" (default), "json", "csv" or "avro".
    pub format: Option<String>,
    /// The values' columns: in Spark's DDL form for json and csv, the writer's
    /// schema in Avro's JSON form for avro.
    pub schema: Option<String>,
    /// A file holding `schema`.
    pub schema_file: Option<PathBuf>,
    /// How Avro values are framed: "raw" (default, the datum alone, as Spark's
    /// `from_avro` reads it) or "confluent" (a zero byte and a schema id first).
    pub avro_wire_format: Option<String>,
    /// With `avro_wire_format = "confluent"`: the id values must carry.
    pub avro_schema_id: Option<u32>,
    /// What happens to a record whose value does not decode: "fail" (default),
    /// "skip" or "dead_letter".
    pub on_bad_record: Option<String>,
    /// The event-time column (a TIMESTAMP); Kafka's `timestamp` by default.
    pub event_time: Option<String>,
    /// How far the watermark stays behind the latest event time, as Spark's
    /// `withWatermark` delay: "10s", "5 minutes".
    pub watermark_delay: Option<String>,
    /// librdkafka options, passed through.
    #[serde(default)]
    pub kafka: BTreeMap<String, toml::Value>,
}

fn yes() -> bool {
    true
}

/// `[checkpoint]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    pub location: Option<String>,
    pub min_batches_to_retain: Option<u64>,
    /// Cassandra only: the keyspace's replication, to create it when missing.
    pub replication: Option<String>,
    /// Cassandra only: create Sluice's tables when missing (default true).
    pub create_schema: Option<bool>,
    /// Cassandra only: `LOCAL_QUORUM` by default.
    pub consistency: Option<String>,
    /// Cassandra only: `LOCAL_SERIAL` by default.
    pub serial_consistency: Option<String>,
    /// Cassandra only: the timeout of one request.
    pub request_timeout_ms: Option<u64>,
    /// Cassandra only: authentication and TLS.
    #[serde(flatten)]
    pub auth: CassandraAuth,
}

/// Authentication and TLS for Cassandra, in `[checkpoint]` and `[sink]`. Its
/// `Debug` hides the password.
#[derive(Default, Deserialize, Clone)]
pub struct CassandraAuth {
    pub username: Option<String>,
    pub password: Option<String>,
    /// The name of an environment variable holding the password, to keep it out of the file.
    pub password_env: Option<String>,
    /// Connect with TLS, verifying the nodes against this CA certificate (PEM).
    pub tls_ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for CassandraAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CassandraAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_env", &self.password_env)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl CassandraAuth {
    fn is_set(&self) -> bool {
        self.username.is_some()
            || self.password.is_some()
            || self.password_env.is_some()
            || self.tls_ca_file.is_some()
    }

    /// The connection to `nodes` with these credentials.
    fn connection(
        &self,
        nodes: Vec<String>,
        table: &str,
    ) -> Result<sluice_cassandra_store::Connection> {
        let password = match (&self.password, &self.password_env) {
            (Some(_), Some(_)) => bail!("[{table}] takes password or password_env, not both"),
            (Some(p), None) => Some(p.clone()),
            (None, Some(var)) => Some(std::env::var(var).with_context(|| {
                format!("[{table}] password_env names {var}, which is not set")
            })?),
            (None, None) => None,
        };
        if self.username.is_some() != password.is_some() {
            bail!(
                "[{table}] needs both username and a password (password or password_env), or neither"
            );
        }
        Ok(sluice_cassandra_store::Connection {
            username: self.username.clone(),
            password,
            tls_ca_file: self.tls_ca_file.clone(),
            ..sluice_cassandra_store::Connection::new(nodes)
        })
    }
}

/// Where the offsets live.
#[derive(Debug, Clone)]
pub enum StoreKind {
    /// A checkpoint directory in Spark's layout.
    Directory(PathBuf),
    /// Cassandra tables.
    Cassandra(
        sluice_cassandra_store::CassandraLocation,
        Box<sluice_cassandra_store::CassandraOptions>,
    ),
}

/// `[trigger]`: exactly one of the four.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerSection {
    pub processing_time: Option<String>,
    #[serde(default)]
    pub available_now: bool,
    #[serde(default)]
    pub once: bool,
    /// Continuous processing, with an epoch of this interval.
    pub continuous: Option<String>,
    /// The longest wait between looks for new data of an idle
    /// `processing_time = "0s"` query.
    pub polling_delay: Option<String>,
}

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
}

/// `[progress]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressSection {
    /// A file to append one JSON line per batch to.
    pub file: Option<PathBuf>,
    /// Serve Prometheus metrics on this address.
    pub metrics_addr: Option<String>,
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
    Kafka(sluice_kafka_source::KafkaSinkConfig),
    Cassandra(sluice_cassandra_store::CassandraSinkConfig),
}

/// How the stream is processed, checked.
#[derive(Debug, Clone)]
pub struct Processing {
    /// The source table's name.
    pub table: String,
    /// How values are read.
    pub format: sluice_sql::Format,
    /// The SQL, if any.
    pub sql: Option<String>,
    /// What happens to records whose values do not decode.
    pub on_bad_record: sluice_offsets::BadRecordPolicy,
    /// The event-time column and the watermark delay in milliseconds.
    pub watermark: Option<(String, i64)>,
    /// `[query] output_mode`, when set.
    pub output_mode: Option<sluice_sql::OutputMode>,
    /// `[query] max_state_rows`, when set.
    pub max_state_rows: Option<u64>,
    /// `[query] state_partitions`, when set.
    pub state_partitions: Option<u32>,
}

impl Processing {
    /// How the query is planned.
    pub fn query_options(&self) -> sluice_sql::QueryOptions {
        sluice_sql::QueryOptions {
            output_mode: self.output_mode,
            watermark_column: self.watermark.as_ref().map(|(column, _)| column.clone()),
            max_state_rows: self.max_state_rows,
            state_partitions: self.state_partitions,
        }
    }
}

impl Processing {
    /// Whether records reach the sink as read, with nothing to decode or query.
    pub fn is_pass_through(&self) -> bool {
        self.sql.is_none() && self.format == sluice_sql::Format::Raw && self.watermark.is_none()
    }
}

/// Where records whose values do not decode go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetters {
    /// Nowhere: `on_bad_record` is not "dead_letter".
    None,
    /// JSON-lines files in a directory, one per batch.
    Directory(PathBuf),
    /// A Kafka topic.
    Kafka(sluice_kafka_source::KafkaSinkConfig),
}

/// Everything the runner needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    pub processing: Processing,
    pub dead_letters: DeadLetters,
    pub name: Option<String>,
    pub kafka: KafkaSourceConfig,
    pub starting: StartingOptions,
    pub trigger: Trigger,
    pub polling_delay: Duration,
    pub max_offsets_per_trigger: Option<NonZeroU64>,
    pub min_offsets_per_trigger: Option<MinOffsetsPerTrigger>,
    pub checkpoint: StoreKind,
    pub min_batches_to_retain: u64,
    pub sink: SinkKind,
    pub progress: ProgressSection,
    pub source_description: String,
    pub retry: sluice_executor::RetryPolicy,
    /// Group mode, and how its members agree; `None` for one process.
    pub scale_out: Option<sluice_kafka_source::GroupProtocol>,
}

/// Reads and checks a configuration file. Every error names the file, and the
/// key or line concerned.
pub fn load(path: &Path) -> Result<Settings> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the configuration {}", path.display()))?;
    parse(&text, &path.display().to_string())
}

/// Checks the text of a configuration; errors name `origin`, the file.
pub fn parse(text: &str, origin: &str) -> Result<Settings> {
    let config: Config = toml::from_str(text)
        .map_err(|e| anyhow::anyhow!("{origin}: {}", with_suggestion(&e.to_string())))?;
    settings(config).with_context(|| origin.to_owned())
}

/// Adds "did you mean" to serde's unknown-field errors.
fn with_suggestion(message: &str) -> String {
    let message = message.trim_end().to_owned();
    let Some(at) = message.find("unknown field `") else {
        return message;
    };
    let rest = &message[at + "unknown field `".len()..];
    let Some((unknown, expected)) = rest.split_once('`') else {
        return message;
    };
    let best = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|candidate| (strsim::jaro_winkler(unknown, candidate), candidate))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match best {
        Some((_, candidate)) => format!("{message}\ndid you mean `{candidate}`?"),
        None => message,
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
    ];
    let owner = |key: &str| match key {
        "path" => "jsonl",
        "format" | "num_rows" | "truncate" => "console",
        "topic" | "bootstrap_servers" | "kafka" => "kafka",
        _ => "cassandra",
    };
    let known = ["console", "discard", "jsonl", "kafka", "cassandra"];
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

fn settings(config: Config) -> Result<Settings> {
    let source = config.source;
    let bootstrap = std::env::var(BOOTSTRAP_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or(source.bootstrap_servers.clone())
        .context("source.bootstrap_servers is missing (or set SLUICE_BOOTSTRAP_SERVERS)")?;

    let selections = [
        source.subscribe.is_some(),
        source.subscribe_pattern.is_some(),
        source.assign.is_some(),
    ];
    let selection = match (source.subscribe, source.subscribe_pattern, source.assign) {
        (Some(topics), None, None) => TopicSelection::Subscribe(topics),
        (None, Some(pattern), None) => TopicSelection::SubscribePattern(pattern),
        (None, None, Some(assign)) => TopicSelection::Assign(assign),
        _ => bail!(
            "[source] needs exactly one of subscribe, subscribe_pattern or assign; {} given",
            selections.iter().filter(|s| **s).count()
        ),
    };
    let description = match &selection {
        TopicSelection::Subscribe(t) => format!("KafkaV2[Subscribe[{}]]", t.join(",")),
        TopicSelection::SubscribePattern(p) => format!("KafkaV2[SubscribePattern[{p}]]"),
        TopicSelection::Assign(a) => format!(
            "KafkaV2[Assign[{}]]",
            a.iter()
                .flat_map(|(t, ps)| ps.iter().map(move |p| format!("{t}-{p}")))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };

    let mut kafka = KafkaSourceConfig::new(bootstrap, selection);
    kafka.group_id = source.group_id;
    kafka.fail_on_data_loss = source.fail_on_data_loss;
    kafka.include_headers = source.include_headers;
    kafka.commit_progress = source.commit_progress;
    if let Some(mb) = source.read_ahead_mb {
        if mb == 0 {
            bail!("read_ahead_mb must be at least 1");
        }
        kafka.read_ahead_bytes = usize::try_from(mb.saturating_mul(1024 * 1024))
            .context("read_ahead_mb is too large for this machine")?;
    }
    if let Some(ms) = source.poll_timeout_ms {
        if ms == 0 {
            bail!("source.poll_timeout_ms must be at least 1: every read would give up at once");
        }
        kafka.poll_timeout = Duration::from_millis(ms);
    }
    // Spark's names for the client's own retries. Sluice retries each request
    // under the one `[retry]` policy instead, so that no request is retried
    // inside a retry (which once took 23 minutes to give up on a dead cluster).
    for (set, key) in [
        (
            source.fetch_offset_num_retries.is_some(),
            "fetch_offset_num_retries",
        ),
        (
            source.fetch_offset_retry_interval_ms.is_some(),
            "fetch_offset_retry_interval_ms",
        ),
    ] {
        if set {
            bail!(
                "source.{key} is not an option of Sluice: every request is retried under \
                 [retry] (max_attempts, initial_backoff, max_backoff, startup_timeout); \
                 remove it and set those instead"
            );
        }
    }
    if let Some(ms) = source.request_timeout_ms {
        if ms == 0 {
            bail!("source.request_timeout_ms must be at least 1: every request would time out");
        }
        kafka.request_timeout = Duration::from_millis(ms);
    }
    kafka.client_options = client_options("source.kafka", source.kafka)?;
    kafka.validate()?;

    // Spark takes the first of these by precedence and ignores the others
    // without a word; a config that names two starts means one of them.
    let starts: Vec<&str> = [
        (source.starting_timestamp.is_some(), "starting_timestamp"),
        (
            source.starting_offsets_by_timestamp.is_some(),
            "starting_offsets_by_timestamp",
        ),
        (source.starting_offsets.is_some(), "starting_offsets"),
    ]
    .into_iter()
    .filter_map(|(set, name)| set.then_some(name))
    .collect();
    if starts.len() > 1 {
        bail!(
            "[source] sets {}: each says where a new query starts, so give one (Spark would \
             take {} and ignore the rest)",
            starts.join(" and "),
            starts[0]
        );
    }
    if source.starting_offsets_by_timestamp_strategy.is_some()
        && source.starting_timestamp.is_none()
        && source.starting_offsets_by_timestamp.is_none()
    {
        bail!(
            "source.starting_offsets_by_timestamp_strategy says what to do when no offset \
             matches a starting timestamp, and neither starting_timestamp nor \
             starting_offsets_by_timestamp is set"
        );
    }
    let fallback = match source.starting_offsets_by_timestamp_strategy.as_deref() {
        None | Some("error") => TimestampFallback::Error,
        Some("latest") => TimestampFallback::Latest,
        Some(other) => bail!(
            "starting_offsets_by_timestamp_strategy must be \"error\" or \"latest\", not {other:?}"
        ),
    };
    let starting = StartingOptions {
        starting_offsets: source
            .starting_offsets
            .as_deref()
            .map(parse_starting_offsets)
            .transpose()
            .context("starting_offsets")?,
        starting_offsets_by_timestamp: source
            .starting_offsets_by_timestamp
            .as_deref()
            .map(values_from_json)
            .transpose()
            .context("starting_offsets_by_timestamp")?
            .map(|m| m.into_iter().collect::<BTreeMap<TopicPartition, i64>>()),
        starting_timestamp: source.starting_timestamp,
        timestamp_fallback: fallback,
    };

    let max_offsets_per_trigger = match source.max_offsets_per_trigger {
        None => None,
        Some(n) => Some(NonZeroU64::new(n).context("max_offsets_per_trigger must be at least 1")?),
    };
    if source.min_offsets_per_trigger == Some(0) {
        bail!("min_offsets_per_trigger must be at least 1; leave it out to run on any new offset");
    }
    if let (Some(min), Some(max)) = (source.min_offsets_per_trigger, max_offsets_per_trigger)
        && min > max.get()
    {
        bail!(
            "min_offsets_per_trigger ({min}) is above max_offsets_per_trigger ({max}): a batch \
             would wait for more offsets than it may read; lower the first or raise the second"
        );
    }
    let min_offsets_per_trigger = match (source.min_offsets_per_trigger, source.max_trigger_delay) {
        (None, None) => None,
        (None, Some(_)) => bail!("max_trigger_delay needs min_offsets_per_trigger"),
        (Some(min), delay) => {
            let delay = match delay {
                Some(text) => parse_duration("max_trigger_delay", &text)?,
                None => Duration::from_secs(15 * 60),
            };
            Some(MinOffsetsPerTrigger {
                min_offsets: min,
                max_trigger_delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            })
        }
    };

    let polling_delay_text = config.trigger.polling_delay.clone();
    let trigger = match (
        config.trigger.processing_time,
        config.trigger.available_now,
        config.trigger.once,
        config.trigger.continuous,
    ) {
        (None, false, false, None) => Trigger::ProcessingTime(Duration::ZERO),
        (Some(interval), false, false, None) => {
            Trigger::ProcessingTime(parse_duration("trigger.processing_time", &interval)?)
        }
        (None, true, false, None) => Trigger::AvailableNow,
        (None, false, true, None) => Trigger::Once,
        (None, false, false, Some(epoch)) => {
            let interval = parse_duration("trigger.continuous", &epoch)?;
            if interval < Duration::from_millis(10) {
                bail!(
                    "trigger.continuous = {epoch:?} is below 10 ms: each epoch writes a plan and \
                     a commit, and records reach the sink as they arrive whatever the epoch, \
                     so a longer one costs no latency; \"1s\" is usual"
                );
            }
            Trigger::Continuous(interval)
        }
        _ => bail!(
            "[trigger] takes one of processing_time, available_now = true, once = true or \
             continuous"
        ),
    };
    let polling_delay = match polling_delay_text {
        None => sluice_executor::DEFAULT_POLLING_DELAY,
        Some(_)
            if !matches!(
                trigger,
                Trigger::ProcessingTime(Duration::ZERO) | Trigger::Continuous(_)
            ) =>
        {
            bail!(
                "trigger.polling_delay is how long an idle processing_time = \"0s\" or \
                 continuous query waits between looks for new data, and this query's trigger \
                 is {}: remove it",
                match trigger {
                    Trigger::AvailableNow => "available_now = true",
                    Trigger::Once => "once = true",
                    _ => "a processing_time interval",
                }
            )
        }
        Some(text) => {
            let delay = parse_duration("trigger.polling_delay", &text)?;
            if delay < Duration::from_millis(1) {
                bail!(
                    "trigger.polling_delay = {text:?} is below 1 ms: an idle query would ask the \
                     brokers for their offsets without pause"
                );
            }
            delay
        }
    };
    // The reader long-polls partitions at their end for fetch.wait.max.ms, and a
    // continuous epoch's next look waits behind that poll. At 100 records/s the
    // source's 20 ms made the median latency 34.5 ms, and 5 ms made it 12.9 ms
    // (runs of `latency_probe` as `cargo xtask bench latency` drives it); the
    // cost is more fetch requests while idle.
    if matches!(trigger, Trigger::Continuous(_)) {
        kafka
            .client_options
            .entry("fetch.wait.max.ms".to_owned())
            .or_insert_with(|| CONTINUOUS_FETCH_WAIT_MAX_MS.to_owned());
    }
    if trigger == Trigger::Once && max_offsets_per_trigger.is_some() {
        bail!(
            "max_offsets_per_trigger limits each batch, and trigger once = true reads everything \
             in one batch: use available_now = true, which reads the same in batches of that size"
        );
    }
    if matches!(trigger, Trigger::Continuous(_)) && source.min_offsets_per_trigger.is_some() {
        bail!(
            "min_offsets_per_trigger makes a batch wait for new offsets, and the continuous \
             trigger hands every record to the sink as it arrives: remove it, or use \
             processing_time"
        );
    }
    if matches!(trigger, Trigger::Once | Trigger::AvailableNow)
        && source.min_offsets_per_trigger.is_some()
    {
        bail!(
            "min_offsets_per_trigger makes a batch wait for new offsets, and a run with {} stops \
             when it has caught up: remove it, or use processing_time",
            if trigger == Trigger::Once {
                "once = true"
            } else {
                "available_now = true"
            }
        );
    }

    let checkpoint = std::env::var(CHECKPOINT_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or(config.checkpoint.location.clone())
        .context("checkpoint.location is missing (or set SLUICE_CHECKPOINT_LOCATION)")?;
    let checkpoint = if checkpoint.starts_with("cassandra://") {
        let location = sluice_cassandra_store::CassandraLocation::parse(&checkpoint)?;
        let section = &config.checkpoint;
        let connection = section
            .auth
            .connection(location.nodes.clone(), "checkpoint")?;
        let mut options = sluice_cassandra_store::CassandraOptions {
            replication: section.replication.clone(),
            create_schema: section.create_schema.unwrap_or(true),
            username: connection.username,
            password: connection.password,
            tls_ca_file: connection.tls_ca_file,
            ..Default::default()
        };
        if let Some(text) = &section.consistency {
            options.consistency = sluice_cassandra_store::parse_consistency(text).with_context(|| {
                format!("checkpoint.consistency {text:?} is not a consistency level like LOCAL_QUORUM")
            })?;
        }
        if let Some(text) = &section.serial_consistency {
            options.serial_consistency = sluice_cassandra_store::parse_serial_consistency(text)
                .with_context(|| {
                    format!("checkpoint.serial_consistency {text:?} must be SERIAL or LOCAL_SERIAL")
                })?;
        }
        if let Some(ms) = section.request_timeout_ms {
            if ms == 0 {
                bail!(
                    "checkpoint.request_timeout_ms must be at least 1: every request would time out"
                );
            }
            options.request_timeout = Duration::from_millis(ms);
        }
        StoreKind::Cassandra(location, Box::new(options))
    } else if checkpoint.contains("://") && !checkpoint.starts_with("file://") {
        bail!(
            "checkpoint.location {checkpoint:?}: use a directory path, file:///path, or \
             cassandra://host:port/keyspace?query=<name>"
        );
    } else {
        let c = &config.checkpoint;
        if c.replication.is_some()
            || c.create_schema.is_some()
            || c.consistency.is_some()
            || c.serial_consistency.is_some()
            || c.request_timeout_ms.is_some()
            || c.auth.is_set()
        {
            bail!(
                "checkpoint.replication, create_schema, consistency, serial_consistency, \
                 request_timeout_ms and the credentials apply to cassandra:// locations only"
            );
        }
        StoreKind::Directory(PathBuf::from(checkpoint.trim_start_matches("file://")))
    };

    let declared = match (source.schema, source.schema_file) {
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
    let format = match (format_name, declared) {
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
    };
    let on_bad_record = match source.on_bad_record.as_deref() {
        None | Some("fail") => sluice_offsets::BadRecordPolicy::Fail,
        Some("skip") => sluice_offsets::BadRecordPolicy::Skip,
        Some("dead_letter") => sluice_offsets::BadRecordPolicy::DeadLetter,
        Some(other) => bail!(
            "source.on_bad_record must be \"fail\", \"skip\" or \"dead_letter\", not {other:?}"
        ),
    };
    let table = source.table.unwrap_or_else(|| "source".to_owned());
    if table.is_empty() || !table.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        bail!("source.table {table:?} must be a plain name: letters, digits and underscores");
    }
    let (sql, output_mode, max_state_rows, state_partitions) = match config.query {
        Some(query) => (
            Some(query.sql),
            query.output_mode,
            query.max_state_rows,
            query.state_partitions,
        ),
        None => (None, None, None, None),
    };
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
    let dead_letters = match (on_bad_record, config.dead_letter) {
        (sluice_offsets::BadRecordPolicy::DeadLetter, None) => bail!(
            "on_bad_record = \"dead_letter\" needs a [dead_letter] table with path (a directory) \
             or topic (a Kafka topic)"
        ),
        (sluice_offsets::BadRecordPolicy::DeadLetter, Some(dead)) => {
            match (dead.path, dead.topic) {
                (Some(_), None) if dead.bootstrap_servers.is_some() => bail!(
                    "dead_letter.bootstrap_servers is for a dead-letter topic, and [dead_letter] \
                     names a directory (path)"
                ),
                (Some(path), None) => DeadLetters::Directory(path),
                (None, Some(topic)) => DeadLetters::Kafka(sluice_kafka_source::KafkaSinkConfig {
                    // On the source's cluster, it reaches it as the source does.
                    client_options: match &dead.bootstrap_servers {
                        None => with_source_security(&kafka.client_options, BTreeMap::new()),
                        Some(_) => BTreeMap::new(),
                    },
                    bootstrap_servers: dead
                        .bootstrap_servers
                        .unwrap_or_else(|| kafka.bootstrap_servers.clone()),
                    topic,
                    delivery: sluice_kafka_source::Delivery::AtLeastOnce,
                }),
                _ => bail!("[dead_letter] takes path or topic, exactly one"),
            }
        }
        (_, Some(_)) => bail!(
            "[dead_letter] is set, but on_bad_record is not \"dead_letter\", so nothing would go there"
        ),
        (_, None) => DeadLetters::None,
    };
    if format == sluice_sql::Format::Raw && on_bad_record != sluice_offsets::BadRecordPolicy::Fail {
        bail!(
            "source.on_bad_record applies to values that do not decode, but format is \"raw\": \
             set format = \"json\", \"csv\" or \"avro\" with a schema"
        );
    }
    let watermark = match (source.event_time, source.watermark_delay) {
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
    };
    let processing = Processing {
        table,
        format,
        sql,
        on_bad_record,
        watermark,
        output_mode,
        max_state_rows,
        state_partitions,
    };

    if config.sink.delivery.is_some() && config.sink.kind != "kafka" {
        bail!(
            "sink.delivery is the kafka sink's; a {:?} sink's guarantee is its own (see \
             docs/delivery.md)",
            config.sink.kind
        );
    }
    check_sink_options(&config.sink)?;
    let sink = match config.sink.kind.as_str() {
        "console" => {
            let json = match config.sink.format.as_deref() {
                None | Some("text") => false,
                Some("json") => true,
                Some(other) => bail!("sink.format must be \"text\" or \"json\", not {other:?}"),
            };
            if config.sink.num_rows == Some(0) {
                bail!("sink.num_rows must be at least 1");
            }
            SinkKind::Console {
                json,
                num_rows: config
                    .sink
                    .num_rows
                    .unwrap_or(sluice_executor::sinks::DEFAULT_NUM_ROWS),
                truncate: config.sink.truncate.unwrap_or(true),
            }
        }
        "discard" => SinkKind::Discard,
        "jsonl" => SinkKind::Jsonl {
            path: config
                .sink
                .path
                .context("a jsonl sink needs sink.path, the directory to write batch files to")?,
        },
        "kafka" => {
            let delivery = match config.sink.delivery.as_deref() {
                None | Some("at_least_once") => sluice_kafka_source::Delivery::AtLeastOnce,
                Some("exactly_once") => sluice_kafka_source::Delivery::ExactlyOnce,
                Some(other) => bail!(
                    "sink.delivery must be \"at_least_once\" or \"exactly_once\", not {other:?}"
                ),
            };
            let own_options = client_options("sink.kafka", config.sink.kafka)?;
            // On the source's cluster, the sink reaches it as the source does.
            let sink_options = match &config.sink.bootstrap_servers {
                None => with_source_security(&kafka.client_options, own_options),
                Some(_) => own_options,
            };
            let bootstrap_servers = config
                .sink
                .bootstrap_servers
                .unwrap_or_else(|| kafka.bootstrap_servers.clone());
            if delivery == sluice_kafka_source::Delivery::ExactlyOnce
                && matches!(trigger, Trigger::Continuous(_))
            {
                bail!(
                    "sink.delivery = \"exactly_once\" with trigger.continuous: an epoch's \
                     transaction would hold every record back until the epoch ends, and the \
                     continuous trigger is at least once (docs/delivery.md); use \
                     delivery = \"at_least_once\", or processing_time = \"0s\", which is \
                     exactly once within milliseconds"
                );
            }
            if delivery == sluice_kafka_source::Delivery::ExactlyOnce
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
            SinkKind::Kafka(sluice_kafka_source::KafkaSinkConfig {
                bootstrap_servers,
                topic: config
                    .sink
                    .topic
                    .context("a kafka sink needs sink.topic, the topic to produce to")?,
                client_options: sink_options,
                delivery,
            })
        }
        "cassandra" => {
            let need = |value: Option<String>, key: &str| {
                value.with_context(|| format!("a cassandra sink needs sink.{key}"))
            };
            let nodes: Vec<String> = need(config.sink.nodes, "nodes")?
                .split(',')
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect();
            let connection = config.sink.auth.connection(nodes, "sink")?;
            let keyspace = need(config.sink.keyspace, "keyspace")?;
            let table = need(config.sink.table, "table")?;
            let (columns, renames) = if processing.is_pass_through() {
                if config.sink.columns.is_empty() {
                    bail!(
                        "a cassandra sink needs [sink.columns], mapping columns to record fields"
                    );
                }
                let columns = config
                    .sink
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
                (BTreeMap::new(), config.sink.columns)
            };
            SinkKind::Cassandra(sluice_cassandra_store::CassandraSinkConfig {
                connection,
                keyspace,
                table,
                columns,
                renames,
            })
        }
        other => bail!(
            "sink.type must be \"jsonl\", \"cassandra\", \"kafka\", \"console\" or \"discard\", not {other:?}"
        ),
    };

    let mut retry = sluice_executor::RetryPolicy::default();
    if let Some(n) = config.retry.max_attempts {
        if n == 0 {
            bail!("retry.max_attempts must be at least 1");
        }
        retry.max_attempts = n;
    }
    if let Some(text) = &config.retry.initial_backoff {
        retry.initial_backoff = parse_duration("retry.initial_backoff", text)?;
    }
    if let Some(text) = &config.retry.max_backoff {
        retry.max_backoff = parse_duration("retry.max_backoff", text)?;
    }
    if retry.initial_backoff > retry.max_backoff {
        bail!(
            "retry.initial_backoff ({}) is longer than retry.max_backoff ({}): the first wait \
             cannot exceed the longest",
            humantime::format_duration(retry.initial_backoff),
            humantime::format_duration(retry.max_backoff)
        );
    }
    if let Some(text) = &config.retry.startup_timeout {
        retry.startup_timeout = parse_duration("retry.startup_timeout", text)?;
        if retry.startup_timeout.is_zero() {
            bail!("retry.startup_timeout must be longer than 0s");
        }
    }

    let scale_out = scale_out(
        &config.scale_out,
        &kafka,
        &checkpoint,
        trigger,
        &dead_letters,
    )?;
    Ok(Settings {
        processing,
        dead_letters,
        retry,
        name: config.name,
        kafka,
        starting,
        trigger,
        polling_delay,
        max_offsets_per_trigger,
        min_offsets_per_trigger,
        checkpoint,
        min_batches_to_retain: match config.checkpoint.min_batches_to_retain {
            // The newest batch is the one a restart continues from.
            Some(0) => bail!(
                "checkpoint.min_batches_to_retain must be at least 1: a restart continues from \
                 the newest batch"
            ),
            Some(n) => n,
            None => sluice_offsets::DEFAULT_MIN_BATCHES_TO_RETAIN,
        },
        scale_out,
        sink,
        progress: config.progress,
        source_description: description,
    })
}

/// Checks `[scale_out]` against the rest: what group mode needs, and what it
/// does not support yet, each with the reason.
fn scale_out(
    section: &ScaleOutSection,
    kafka: &KafkaSourceConfig,
    checkpoint: &StoreKind,
    trigger: Trigger,
    dead_letters: &DeadLetters,
) -> Result<Option<sluice_kafka_source::GroupProtocol>> {
    use sluice_kafka_source::GroupProtocol;
    if !section.enabled {
        if section.group_protocol.is_some() {
            bail!("scale_out.group_protocol applies with scale_out.enabled = true");
        }
        return Ok(None);
    }
    let protocol = match section.group_protocol.as_deref() {
        None | Some("classic") => GroupProtocol::Classic,
        Some("consumer") => GroupProtocol::Consumer,
        Some(other) => bail!(
            "scale_out.group_protocol must be \"classic\" (cooperative-sticky) or \"consumer\" \
             (KIP-848), not {other:?}"
        ),
    };
    if kafka.group_id.is_none() {
        bail!(
            "scale_out needs source.group_id: every process of the query joins that consumer \
             group, which shares the partitions among them"
        );
    }
    sluice_kafka_source::GroupConfig::topics_of(&kafka.selection)
        .map_err(|e| anyhow::anyhow!("scale_out: {e}"))?;
    for key in ["group.protocol", "partition.assignment.strategy"] {
        if kafka.client_options.contains_key(key) {
            bail!(
                "[source.kafka] {key} is chosen by scale_out.group_protocol (classic with \
                 cooperative-sticky, or consumer): remove it"
            );
        }
    }
    match checkpoint {
        StoreKind::Directory(_) => bail!(
            "scale_out needs a cassandra:// checkpoint.location: a checkpoint directory cannot be \
             shared safely between processes, and every process of the query reads and writes \
             the same directory of partitions"
        ),
        StoreKind::Cassandra(location, _) if location.query.contains('/') => bail!(
            "scale_out: the query name {:?} must not contain '/', which separates the query from \
             its generations' logs",
            location.query
        ),
        StoreKind::Cassandra(..) => {}
    }
    if !matches!(trigger, Trigger::ProcessingTime(_)) {
        bail!(
            "scale_out runs until it is stopped: use [trigger] processing_time (available_now and \
             once end when one process has caught up with its own partitions, and the continuous \
             trigger is not supported in group mode yet)"
        );
    }
    if kafka.commit_progress {
        bail!(
            "source.commit_progress commits to the consumer group, which in group mode belongs to \
             its members: remove it"
        );
    }
    if let DeadLetters::Kafka(config) = dead_letters
        && config.delivery == sluice_kafka_source::Delivery::ExactlyOnce
    {
        bail!("[dead_letter] to Kafka is at least once with scale_out");
    }
    Ok(Some(protocol))
}

/// librdkafka options from a TOML table: strings, numbers and booleans as text.
/// `KEY_env = "VAR"` takes the value of `KEY` from the environment variable
/// `VAR` (`"sasl.password_env"`), to keep secrets out of the file. A secret's
/// value is never shown in an error.
fn client_options(
    table: &str,
    values: BTreeMap<String, toml::Value>,
) -> Result<BTreeMap<String, String>> {
    let mut options = BTreeMap::new();
    for (key, value) in &values {
        if let Some(option) = key.strip_suffix("_env") {
            let toml::Value::String(var) = value else {
                bail!("[{table}] {key} names an environment variable: give its name as a string");
            };
            if values.contains_key(option) {
                bail!("[{table}] takes {option} or {key}, not both");
            }
            let text = std::env::var(var)
                .with_context(|| format!("[{table}] {key} names {var}, which is not set"))?;
            options.insert(option.to_owned(), text);
            continue;
        }
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            _ if sluice_kafka_source::is_secret_option(key) => {
                bail!("[{table}] {key} must be a string")
            }
            other => bail!("[{table}] {key} must be a string, number or boolean, not {other}"),
        };
        options.insert(key.clone(), text);
    }
    Ok(options)
}

/// The source's security options (protocol, TLS, SASL) under `own`, for another
/// client of the source's cluster: what it sets itself wins.
fn with_source_security(
    source: &BTreeMap<String, String>,
    own: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut options: BTreeMap<String, String> = source
        .iter()
        .filter(|(key, _)| sluice_kafka_source::is_security_option(key))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    options.extend(own);
    options
}

/// Where the metrics endpoint listens: `host:port` as given, or loopback for a
/// bare port (`"9464"` or `":9464"`), so that the endpoint is reachable from
/// elsewhere only when the address says so (`"0.0.0.0:9464"`).
pub fn metrics_listen(text: &str) -> Result<std::net::SocketAddr> {
    let port_only = text.strip_prefix(':').unwrap_or(text);
    if let Ok(port) = port_only.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse().with_context(|| {
        format!(
            "progress.metrics_addr = {text:?} is neither host:port (\"127.0.0.1:9464\", \
             \"0.0.0.0:9464\" for every interface) nor a port (\"9464\", on loopback)"
        )
    })
}

fn parse_duration(key: &str, text: &str) -> Result<Duration> {
    humantime::parse_duration(text.trim())
        .with_context(|| format!("{key} = {text:?} is not a duration like \"10s\" or \"15m\""))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Settings> {
        super::parse(text, "query.toml")
    }

    const MINIMAL: &str = r#"
        [source]
        bootstrap_servers = "127.0.0.1:9092"
        subscribe = ["events"]
        [checkpoint]
        location = "/tmp/q"
        [sink]
        type = "console"
    "#;

    #[test]
    fn kafka_secrets_come_from_the_environment_and_are_never_shown() {
        let config = |source: &str, sink: &str| {
            format!(
                "[source]\nbootstrap_servers = \"h:9094\"\nsubscribe = [\"events\"]\n\
                 [source.kafka]\n{source}\n[checkpoint]\nlocation = \"/tmp/q\"\n\
                 [sink]\ntype = \"kafka\"\ntopic = \"out\"\n{sink}"
            )
        };
        // SAFETY: no other test reads or writes this variable.
        unsafe { std::env::set_var("SLUICE_TEST_SASL_SECRET", "from-the-environment") };
        let source = "\"security.protocol\" = \"SASL_SSL\"\n\"sasl.username\" = \"u\"\n\
                      \"sasl.password_env\" = \"SLUICE_TEST_SASL_SECRET\"\nlinger = 1";
        let settings = parse(&config(source, "")).unwrap();
        assert_eq!(
            settings.kafka.client_options["sasl.password"],
            "from-the-environment"
        );
        assert!(
            !settings
                .kafka
                .client_options
                .contains_key("sasl.password_env")
        );
        // The sink on the source's cluster reaches it as the source does, and
        // takes none of the source's other options.
        let SinkKind::Kafka(sink) = &settings.sink else {
            panic!("a kafka sink")
        };
        assert_eq!(sink.client_options["sasl.password"], "from-the-environment");
        assert_eq!(sink.client_options["security.protocol"], "SASL_SSL");
        assert!(!sink.client_options.contains_key("linger"));
        assert!(!format!("{:?}", settings.kafka).contains("from-the-environment"));
        assert!(!format!("{sink:?}").contains("from-the-environment"));
        // Another cluster: the sink's own options only.
        let other = parse(&config(source, "bootstrap_servers = \"other:9092\"")).unwrap();
        let SinkKind::Kafka(sink) = &other.sink else {
            panic!("a kafka sink")
        };
        assert!(sink.client_options.is_empty());

        let err = |source: &str| format!("{:#}", parse(&config(source, "")).unwrap_err());
        assert!(
            err("\"sasl.password_env\" = \"SLUICE_TEST_UNSET_VAR\"").contains("which is not set")
        );
        assert!(
            err("\"sasl.password\" = \"a\"\n\"sasl.password_env\" = \"SLUICE_TEST_SASL_SECRET\"")
                .contains("not both")
        );
        let shown = err("\"sasl.password\" = [\"hunter2-in-a-list\"]");
        assert!(shown.contains("sasl.password must be a string"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn a_metrics_port_alone_listens_on_loopback_only() {
        for text in ["9464", ":9464", "127.0.0.1:9464"] {
            assert_eq!(metrics_listen(text).unwrap().to_string(), "127.0.0.1:9464");
        }
        assert_eq!(
            metrics_listen("0.0.0.0:9464").unwrap().to_string(),
            "0.0.0.0:9464"
        );
        let err = format!("{:#}", metrics_listen("localhost").unwrap_err());
        assert!(err.contains("neither host:port"), "{err}");
    }

    #[test]
    fn a_minimal_config_gets_sparks_defaults() {
        let s = parse(MINIMAL).unwrap();
        assert_eq!(s.trigger, Trigger::ProcessingTime(Duration::ZERO));
        assert!(s.kafka.fail_on_data_loss);
        assert_eq!(s.min_batches_to_retain, 100);
        assert_eq!(s.source_description, "KafkaV2[Subscribe[events]]");
        assert_eq!(
            s.starting.resolve(),
            sluice_offsets::StartingOffsets::Latest
        );
    }

    #[test]
    fn bad_configs_are_refused_with_the_reason() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "subscribe = [\"events\"]",
                "subscibe = [\"events\"]",
                "did you mean `subscribe`?",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nsubscribe_pattern = \"e.*\"",
                "exactly one of subscribe",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nmax_offsets_per_trigger = 0",
                "at least 1",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nstarting_offsets = \"earliestt\"",
                "starting_offsets",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nevent_time = \"ts\"",
                "set source.watermark_delay too",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nwatermark_delay = \"ten seconds\"",
                "source.watermark_delay = \"ten seconds\" is not a duration",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nmax_trigger_delay = \"5m\"",
                "needs min_offsets_per_trigger",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\n[source.kafka]\n\"enable.auto.commit\" = true",
                "`enable.auto.commit` is set by Sluice",
            ),
            (
                "type = \"console\"",
                "type = \"kafkaa\"",
                "sink.type must be",
            ),
            ("type = \"console\"", "type = \"jsonl\"", "needs sink.path"),
            (
                "location = \"/tmp/q\"",
                "location = \"cassandra://h:9042/ks\"",
                "?query=<name>",
            ),
            (
                "location = \"/tmp/q\"",
                "location = \"s3://bucket/q\"",
                "use a directory path",
            ),
            (
                "location = \"/tmp/q\"",
                "location = \"/tmp/q\"\nreplication = \"x\"",
                "apply to cassandra:// locations only",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nmin_offsets_per_trigger = 5000\nmax_offsets_per_trigger = 1000",
                "min_offsets_per_trigger (5000) is above max_offsets_per_trigger (1000)",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nmin_offsets_per_trigger = 0",
                "min_offsets_per_trigger must be at least 1",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nfetch_offset_num_retries = 3",
                "every request is retried under [retry]",
            ),
            (
                "type = \"console\"",
                "type = \"console\"\ntopic = \"out\"",
                "sink.topic is an option of the kafka sink, and sink.type is \"console\"",
            ),
            (
                "type = \"console\"",
                "type = \"jsonl\"\npath = \"/tmp/out\"\nnum_rows = 5",
                "sink.num_rows is an option of the console sink",
            ),
            (
                "type = \"console\"",
                "type = \"discard\"\n[sink.kafka]\n\"linger.ms\" = 5",
                "sink.kafka is an option of the kafka sink",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nstarting_offsets = \"earliest\"\nstarting_timestamp = 1000",
                "sets starting_timestamp and starting_offsets: each says where a new query starts",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nstarting_offsets_by_timestamp_strategy = \"latest\"",
                "neither starting_timestamp nor starting_offsets_by_timestamp is set",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\nrequest_timeout_ms = 0",
                "source.request_timeout_ms must be at least 1",
            ),
            (
                "subscribe = [\"events\"]",
                "subscribe = [\"events\"]\npoll_timeout_ms = 0",
                "source.poll_timeout_ms must be at least 1",
            ),
            (
                "location = \"/tmp/q\"",
                "location = \"/tmp/q\"\nmin_batches_to_retain = 0",
                "checkpoint.min_batches_to_retain must be at least 1",
            ),
            (
                "location = \"/tmp/q\"",
                "location = \"cassandra://h:9042/ks?query=q\"\nrequest_timeout_ms = 0",
                "checkpoint.request_timeout_ms must be at least 1",
            ),
        ];
        for (from, to, expected) in cases {
            let text = MINIMAL.replacen(from, to, 1);
            let err = format!("{:#}", parse(&text).unwrap_err());
            assert!(
                err.contains(expected),
                "{to}: expected {expected:?} in {err}"
            );
        }
    }

    #[tokio::test]
    async fn the_readme_example_is_a_valid_config() {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("```toml\n")
            .expect("a toml block in the README")
            + 8;
        let end = start + readme[start..].find("```").expect("the end of the block");
        let settings = parse(&readme[start..end]).unwrap();
        assert_eq!(settings.name.as_deref(), Some("orders-to-files"));
        assert_eq!(
            settings.trigger,
            Trigger::ProcessingTime(Duration::from_secs(10))
        );
        let processing = &settings.processing;
        let decoder = sluice_sql::Decoder::new(processing.format.clone(), false);
        sluice_sql::StreamQuery::plan(
            processing
                .sql
                .as_deref()
                .expect("the README's example has a query"),
            &processing.table,
            decoder.schema(),
        )
        .await
        .unwrap();
    }

    #[test]
    fn the_scale_out_demo_config_is_group_mode_over_cassandra() {
        let settings = parse(include_str!("../../../examples/demo-scale-out.toml")).unwrap();
        assert!(settings.scale_out.is_some());
        assert!(matches!(settings.checkpoint, StoreKind::Cassandra(..)));
        assert!(settings.progress.metrics_addr.is_some());
    }

    #[tokio::test]
    async fn the_demo_config_decodes_json_and_plans_its_query() {
        let settings = parse(include_str!("../../../examples/demo.toml")).unwrap();
        let processing = &settings.processing;
        assert!(matches!(processing.format, sluice_sql::Format::Json(_)));
        let decoder = sluice_sql::Decoder::new(processing.format.clone(), false);
        let query = sluice_sql::StreamQuery::plan_with(
            processing.sql.as_deref().expect("the demo has a query"),
            &processing.table,
            decoder.schema(),
            &processing.query_options(),
        )
        .await
        .unwrap();
        assert!(query.is_stateful());
        assert_eq!(query.output_mode(), Some(sluice_sql::OutputMode::Append));
        let columns: Vec<String> = query
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        assert_eq!(
            columns,
            [
                "window_start",
                "window_end",
                "customer",
                "orders",
                "revenue"
            ]
        );
    }

    #[test]
    fn scale_out_needs_a_group_subscribe_and_cassandra_and_refuses_what_it_cannot_share() {
        let config = |source: &str, checkpoint: &str, rest: &str| {
            format!(
                "[source]\nbootstrap_servers = \"h:9092\"\n{source}\n[checkpoint]\n{checkpoint}\n\
                 [sink]\ntype = \"jsonl\"\npath = \"/tmp/out\"\n{rest}\n[scale_out]\nenabled = true\n"
            )
        };
        let group = "subscribe = [\"events\"]\ngroup_id = \"g\"";
        let cassandra = "location = \"cassandra://h:9042/ks?query=q\"";
        let settings = parse(&config(group, cassandra, "")).unwrap();
        assert_eq!(
            settings.scale_out,
            Some(sluice_kafka_source::GroupProtocol::Classic)
        );
        let consumer = config(group, cassandra, "").replace(
            "enabled = true",
            "enabled = true\ngroup_protocol = \"consumer\"",
        );
        assert_eq!(
            parse(&consumer).unwrap().scale_out,
            Some(sluice_kafka_source::GroupProtocol::Consumer)
        );
        let err = |text: String| format!("{:#}", parse(&text).unwrap_err());
        for (text, expected) in [
            (
                config(group, "location = \"/tmp/q\"", ""),
                "needs a cassandra:// checkpoint.location",
            ),
            (
                config("subscribe = [\"events\"]", cassandra, ""),
                "scale_out needs source.group_id",
            ),
            (
                config("assign = { events = [0] }\ngroup_id = \"g\"", cassandra, ""),
                "use `subscribe`",
            ),
            (
                config(group, "location = \"cassandra://h:9042/ks?query=a/b\"", ""),
                "must not contain '/'",
            ),
            (
                config(group, cassandra, "[trigger]\navailable_now = true"),
                "use [trigger] processing_time",
            ),
            (
                config(
                    &format!(
                        "{group}\n[source.kafka]\n\"partition.assignment.strategy\" = \"range\""
                    ),
                    cassandra,
                    "",
                ),
                "chosen by scale_out.group_protocol",
            ),
            (
                config(group, cassandra, "").replace(
                    "enabled = true",
                    "enabled = true\ngroup_protocol = \"eager\"",
                ),
                "must be \"classic\"",
            ),
        ] {
            let shown = err(text);
            assert!(shown.contains(expected), "{expected:?} not in {shown}");
        }
        let exactly_once = config(group, cassandra, "").replace(
            "type = \"jsonl\"\npath = \"/tmp/out\"",
            "type = \"kafka\"\ntopic = \"out\"\ndelivery = \"exactly_once\"",
        );
        // Each generation has a transactional id of its own (docs/scale-out.md).
        assert!(parse(&exactly_once).is_ok());
        // Each member serves its own page; on one host, port 0 gives each its own port.
        let served = parse(&config(
            group,
            cassandra,
            "[progress]\nmetrics_addr = \"0\"",
        ));
        assert!(served.is_ok(), "{:?}", served.err());
    }

    #[test]
    fn cassandra_options_are_read_and_checked() {
        let with = |extra: &str| {
            parse(&MINIMAL.replacen(
                "location = \"/tmp/q\"",
                &format!("location = \"cassandra://h:9042/ks?query=q\"\n{extra}"),
                1,
            ))
        };
        let settings = with(
            "consistency = \"QUORUM\"\nserial_consistency = \"SERIAL\"\nusername = \"sluice\"\npassword = \"s3cret\"\nrequest_timeout_ms = 2500",
        )
        .unwrap();
        let StoreKind::Cassandra(location, options) = settings.checkpoint else {
            panic!("expected a Cassandra store");
        };
        assert_eq!(location.query, "q");
        assert_eq!(
            options.consistency,
            sluice_cassandra_store::Consistency::Quorum
        );
        assert_eq!(options.username.as_deref(), Some("sluice"));
        assert_eq!(options.request_timeout, Duration::from_millis(2500));
        let err = |extra: &str| format!("{:#}", with(extra).unwrap_err());
        assert!(err("consistency = \"MOST\"").contains("not a consistency level"));
        assert!(err("username = \"u\"").contains("needs both username and a password"));
        assert!(err("password_env = \"SLUICE_TEST_UNSET_VAR\"").contains("which is not set"));
        assert!(err("password = \"a\"\npassword_env = \"B\"").contains("not both"));
    }

    #[test]
    fn rate_limits_that_a_trigger_cannot_honour_are_refused() {
        let with = |source: &str, trigger: &str| {
            let text = MINIMAL
                .replacen(
                    "subscribe = [\"events\"]",
                    &format!("subscribe = [\"events\"]\n{source}"),
                    1,
                )
                .replacen(
                    "type = \"console\"",
                    &format!("type = \"console\"\n[trigger]\n{trigger}"),
                    1,
                );
            parse(&text).map(|_| ()).map_err(|e| format!("{e:#}"))
        };
        let err = with("max_offsets_per_trigger = 100", "once = true").unwrap_err();
        assert!(err.contains("use available_now = true"), "{err}");
        assert!(with("max_offsets_per_trigger = 100", "available_now = true").is_ok());
        for trigger in ["once = true", "available_now = true"] {
            let err = with("min_offsets_per_trigger = 100", trigger).unwrap_err();
            assert!(
                err.contains("stops when it has caught up"),
                "{trigger}: {err}"
            );
            assert!(err.contains(trigger), "{err}");
        }
        assert!(with("min_offsets_per_trigger = 100", "processing_time = \"1s\"").is_ok());
    }

    #[test]
    fn a_polling_delay_is_for_processing_time_zero_and_at_least_a_millisecond() {
        let with = |t: &str| {
            parse(&format!("{MINIMAL}\n[trigger]\n{t}"))
                .map(|s| s.polling_delay)
                .map_err(|e| format!("{e:#}"))
        };
        assert_eq!(
            parse(MINIMAL).unwrap().polling_delay,
            sluice_executor::DEFAULT_POLLING_DELAY
        );
        assert_eq!(
            with("polling_delay = \"20ms\"").unwrap(),
            Duration::from_millis(20)
        );
        assert_eq!(
            with("processing_time = \"0s\"\npolling_delay = \"1s\"").unwrap(),
            Duration::from_secs(1)
        );
        for (trigger, named) in [
            ("processing_time = \"10s\"", "a processing_time interval"),
            ("available_now = true", "available_now = true"),
            ("once = true", "once = true"),
        ] {
            let err = with(&format!("{trigger}\npolling_delay = \"5ms\"")).unwrap_err();
            assert!(err.contains(named) && err.contains("remove it"), "{err}");
        }
        let err = with("polling_delay = \"500us\"").unwrap_err();
        assert!(err.contains("below 1 ms"), "{err}");
        let err = with("polling_delay = \"often\"").unwrap_err();
        assert!(
            err.contains("trigger.polling_delay") && err.contains("not a duration"),
            "{err}"
        );
    }

    #[test]
    fn the_continuous_trigger_takes_an_epoch_and_refuses_what_it_cannot_keep() {
        let with = |source: &str, trigger: &str, sink: &str| {
            let text = MINIMAL
                .replace(
                    "subscribe = [\"events\"]",
                    &format!("subscribe = [\"events\"]\n{source}"),
                )
                .replace(
                    "type = \"console\"",
                    &format!("{sink}\n[trigger]\n{trigger}"),
                );
            parse(&text).map_err(|e| format!("{e:#}"))
        };
        let console = "type = \"console\"";
        let settings = with("", "continuous = \"1s\"", console).unwrap();
        assert_eq!(
            settings.trigger,
            Trigger::Continuous(Duration::from_secs(1))
        );
        assert_eq!(settings.kafka.client_options["fetch.wait.max.ms"], "5");
        let settings = with(
            "[source.kafka]\n\"fetch.wait.max.ms\" = 50",
            "continuous = \"1s\"",
            console,
        )
        .unwrap();
        assert_eq!(settings.kafka.client_options["fetch.wait.max.ms"], "50");
        let settings = with("", "processing_time = \"0s\"", console).unwrap();
        assert!(
            !settings
                .kafka
                .client_options
                .contains_key("fetch.wait.max.ms")
        );
        let settings = with(
            "max_offsets_per_trigger = 1000",
            "continuous = \"500ms\"\npolling_delay = \"10ms\"",
            console,
        )
        .unwrap();
        assert_eq!(settings.polling_delay, Duration::from_millis(10));
        let err = with("", "continuous = \"1ms\"", console).unwrap_err();
        assert!(err.contains("below 10 ms"), "{err}");
        let err = with("", "continuous = \"often\"", console).unwrap_err();
        assert!(
            err.contains("trigger.continuous") && err.contains("not a duration"),
            "{err}"
        );
        let err = with("", "continuous = \"1s\"\nonce = true", console).unwrap_err();
        assert!(
            err.contains("one of") && err.contains("continuous"),
            "{err}"
        );
        let err = with(
            "min_offsets_per_trigger = 10",
            "continuous = \"1s\"",
            console,
        )
        .unwrap_err();
        assert!(
            err.contains("min_offsets_per_trigger") && err.contains("remove it"),
            "{err}"
        );
        let kafka = |delivery: &str| {
            format!("type = \"kafka\"\ntopic = \"out\"\ndelivery = \"{delivery}\"")
        };
        let err = with("", "continuous = \"1s\"", &kafka("exactly_once")).unwrap_err();
        assert!(
            err.contains("exactly_once") && err.contains("at_least_once") && err.contains("0s"),
            "{err}"
        );
        assert!(with("", "continuous = \"1s\"", &kafka("at_least_once")).is_ok());
        assert!(with("", "processing_time = \"0s\"", &kafka("exactly_once")).is_ok());
    }

    #[test]
    fn triggers_and_durations() {
        let with = |t: &str| parse(&format!("{MINIMAL}\n[trigger]\n{t}")).map(|s| s.trigger);
        assert_eq!(
            with("processing_time = \"10s\"").unwrap(),
            Trigger::ProcessingTime(Duration::from_secs(10))
        );
        assert_eq!(with("available_now = true").unwrap(), Trigger::AvailableNow);
        assert_eq!(with("once = true").unwrap(), Trigger::Once);
        assert!(with("once = true\navailable_now = true").is_err());
        assert!(
            format!("{:#}", with("processing_time = \"soon\"").unwrap_err())
                .contains("not a duration")
        );
    }

    #[test]
    fn a_watermark_delay_tracks_kafkas_timestamp_unless_event_time_names_a_column() {
        let with = |extra: &str| {
            let text = MINIMAL.replace(
                "subscribe = [\"events\"]",
                &format!("subscribe = [\"events\"]\n{extra}"),
            );
            parse(&text).unwrap().processing
        };
        let kafka_time = with("watermark_delay = \"10s\"");
        assert_eq!(kafka_time.watermark, Some(("timestamp".to_owned(), 10_000)));
        assert!(
            !kafka_time.is_pass_through(),
            "the watermark needs the rows"
        );
        let column = with(
            "format = \"json\"\nschema = \"ts TIMESTAMP\"\nevent_time = \"ts\"\nwatermark_delay = \"2 minutes\"",
        );
        assert_eq!(column.watermark, Some(("ts".to_owned(), 120_000)));
        assert_eq!(with("").watermark, None);
    }
}
