//! `[source]`: which Kafka partitions a query reads and how, where a new query
//! starts, and how much one batch may read, with Spark's option names.

use std::collections::BTreeMap;
use std::num::NonZeroU64;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_core::{
    MinOffsetsPerTrigger, StartingOptions, TimestampFallback, TopicPartition,
    parse_starting_offsets, values_from_json,
};
use sluice_kafka::{KafkaSourceConfig, TopicSelection};

use super::BOOTSTRAP_ENV;
use super::values::{client_options, parse_duration};

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
    /// How many MiB of records the reader may hold in all: the read-ahead and
    /// the rest of record batches larger than a partition's share.
    pub read_memory_mb: Option<u64>,
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

/// `[source]`'s reading options, checked; the values' format and the
/// event time are [`super::Processing`]'s.
#[derive(Debug, Clone)]
pub struct SourceSettings {
    /// The consumer's options and the partitions it reads.
    pub kafka: KafkaSourceConfig,
    /// The source as Spark's progress names it: `KafkaV2[Subscribe[orders]]`.
    pub description: String,
    /// Where a new query starts.
    pub starting: StartingOptions,
    /// The most offsets one batch reads.
    pub max_offsets_per_trigger: Option<NonZeroU64>,
    /// How many new offsets a batch waits for, and for how long.
    pub min_offsets_per_trigger: Option<MinOffsetsPerTrigger>,
}

impl TryFrom<&SourceSection> for SourceSettings {
    type Error = anyhow::Error;

    fn try_from(source: &SourceSection) -> Result<SourceSettings> {
        let (kafka, description) = kafka(source)?;
        let starting = starting(source)?;
        let (max_offsets_per_trigger, min_offsets_per_trigger) = rate_limits(source)?;
        Ok(SourceSettings {
            kafka,
            description,
            starting,
            max_offsets_per_trigger,
            min_offsets_per_trigger,
        })
    }
}

/// The partitions a query reads (exactly one of Spark's three ways), and the
/// source's description in Spark's words.
fn selection(source: &SourceSection) -> Result<(TopicSelection, String)> {
    let selections = [
        source.subscribe.is_some(),
        source.subscribe_pattern.is_some(),
        source.assign.is_some(),
    ];
    let selection = match (
        source.subscribe.clone(),
        source.subscribe_pattern.clone(),
        source.assign.clone(),
    ) {
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

    Ok((selection, description))
}

/// The consumer's options: the servers (the environment's first), the
/// selection, the read-ahead and timeouts, and librdkafka's own options.
fn kafka(source: &SourceSection) -> Result<(KafkaSourceConfig, String)> {
    let bootstrap = std::env::var(BOOTSTRAP_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or(source.bootstrap_servers.clone())
        .context("source.bootstrap_servers is missing (or set SLUICE_BOOTSTRAP_SERVERS)")?;

    let (selection, description) = selection(source)?;
    let mut kafka = KafkaSourceConfig::new(bootstrap, selection);
    kafka.group_id = source.group_id.clone();
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
    // Unset, the read memory grows with a larger read-ahead.
    kafka.read_memory_bytes = kafka.read_memory_bytes.max(kafka.read_ahead_bytes);
    if let Some(mb) = source.read_memory_mb {
        kafka.read_memory_bytes = usize::try_from(mb.saturating_mul(1024 * 1024))
            .context("read_memory_mb is too large for this machine")?;
    }
    if kafka.read_memory_bytes < kafka.read_ahead_bytes {
        bail!(
            "read_memory_mb ({} MiB) is less than read_ahead_mb ({} MiB): the read memory holds \
             the read-ahead; raise read_memory_mb or lower read_ahead_mb",
            kafka.read_memory_bytes / (1024 * 1024),
            kafka.read_ahead_bytes / (1024 * 1024)
        );
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
    kafka.client_options = client_options("source.kafka", source.kafka.clone())?;
    kafka.validate()?;

    Ok((kafka, description))
}

/// Where a new query starts: one of Spark's three options, at most.
fn starting(source: &SourceSection) -> Result<StartingOptions> {
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
    Ok(StartingOptions {
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
    })
}

/// `max_offsets_per_trigger`, and `min_offsets_per_trigger` with its delay.
fn rate_limits(
    source: &SourceSection,
) -> Result<(Option<NonZeroU64>, Option<MinOffsetsPerTrigger>)> {
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
    let min_offsets_per_trigger = match (
        source.min_offsets_per_trigger,
        source.max_trigger_delay.clone(),
    ) {
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

    Ok((max_offsets_per_trigger, min_offsets_per_trigger))
}
