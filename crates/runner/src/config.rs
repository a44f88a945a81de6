//! The TOML configuration of a query. Source options are named as Spark names
//! them, in snake_case. Each section is a type of its own, read by serde and
//! checked into its settings in the module named after it; [`parse`] puts
//! them together and checks what one section asks of another.

mod checkpoint;
mod processing;
mod retry;
mod scale_out;
mod sink;
mod source;
mod tables;
mod trigger;
mod values;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_core::MinOffsetsPerTrigger;
use sluice_executor::Trigger;
use sluice_kafka::KafkaSourceConfig;

pub use checkpoint::{CassandraAuth, CheckpointSection, StoreKind};
pub use processing::{DeadLetterSection, DeadLetters, Processing, QuerySection, StreamSettings};
pub use retry::RetrySection;
pub use scale_out::ScaleOutSection;
pub use sink::{SinkKind, SinkSection, TableSinkConfig};
pub use source::{SourceSection, SourceSettings};
pub use tables::{DEFAULT_TABLE_MEMORY_MB, TableSection, TableSource, TableSpec};
pub use trigger::{TriggerSection, TriggerSettings};

/// Overrides `source.bootstrap_servers`.
pub const BOOTSTRAP_ENV: &str = "SLUICE_BOOTSTRAP_SERVERS";
/// Overrides `checkpoint.location`.
pub const CHECKPOINT_ENV: &str = "SLUICE_CHECKPOINT_LOCATION";

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The query's name, for logs and progress.
    pub name: Option<String>,
    /// Where records come from, for a query of one stream.
    pub source: Option<SourceSection>,
    /// Where records come from, for a query of several streams: a
    /// `[sources.<table>]` each, in the file's order.
    pub sources: Option<toml::Table>,
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
    /// Lookup tables the query joins its stream with, by name.
    #[serde(default)]
    pub tables: std::collections::BTreeMap<String, TableSection>,
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

/// Everything the runner needs, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    pub processing: Processing,
    pub dead_letters: DeadLetters,
    pub name: Option<String>,
    pub trigger: Trigger,
    pub polling_delay: Duration,
    pub min_offsets_per_trigger: Option<MinOffsetsPerTrigger>,
    pub checkpoint: StoreKind,
    pub min_batches_to_retain: u64,
    pub sink: SinkKind,
    pub progress: ProgressSection,
    pub retry: sluice_executor::RetryPolicy,
    /// Group mode, and how its members agree; `None` for one process.
    pub scale_out: Option<sluice_kafka::GroupProtocol>,
    /// Every source, in the order the checkpoint numbers them: the one of
    /// `[source]`, or each of `[sources.<table>]`; never empty.
    pub sources: Vec<StreamSettings>,
}

impl Settings {
    /// The first source: the only one of a query of one stream.
    pub fn first(&self) -> &StreamSettings {
        &self.sources[0]
    }

    /// The first source, to change.
    pub fn first_mut(&mut self) -> &mut StreamSettings {
        &mut self.sources[0]
    }

    /// The first source's client settings: the cluster a Kafka sink and
    /// dead-letter topic are on by default, and group mode's source.
    pub fn kafka(&self) -> &KafkaSourceConfig {
        &self.first().source.kafka
    }
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
    let config: Config = toml::from_str(text).map_err(|e| {
        let at = e.span().map_or_else(String::new, |span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |n| n + 1) + 1;
            format!("line {line}, column {column}: ")
        });
        // One line, where TOML's own error draws the line it points at.
        let message = with_suggestion(e.message()).replace('\n', "; ");
        anyhow::anyhow!("{origin}: {at}{message}")
    })?;
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

/// The sections checked one by one, in the order of the file's reading
/// (source, trigger, checkpoint, processing, sink, retry), then what they ask
/// of each other.
fn settings(config: Config) -> Result<Settings> {
    let sections = source_sections(config.source, config.sources)?;
    let several = sections.len() > 1;
    let trigger = TriggerSettings::try_from(&config.trigger)?;
    let mut streams = Vec::with_capacity(sections.len());
    for (name, section) in &sections {
        let stream = stream_settings(name, section, trigger.trigger, several);
        streams.push(match several {
            true => stream.with_context(|| format!("[sources.{name}]"))?,
            false => stream?,
        });
    }
    if several {
        distinct_topics(&streams)?;
    }
    let source = streams[0].source.clone();
    let checkpoint = StoreKind::try_from(&config.checkpoint)?;
    let (mut processing, dead_letters) =
        processing::processing(&streams, config.query, config.dead_letter, &source.kafka)?;
    processing.tables = tables::tables(config.tables, &streams)?;
    if !processing.tables.is_empty() && processing.sql.is_none() {
        anyhow::bail!(
            "[tables.{}] is declared, but there is no [query] sql to join it with the stream",
            processing.tables[0].name
        );
    }
    if several && processing.sql.is_none() {
        bail!(
            "[sources.*] declares {} sources, and there is no [query] sql to combine them: \
             write one, with UNION ALL or joins with lookup tables",
            streams.len()
        );
    }
    let sink = sink::sink(config.sink, &source.kafka, trigger.trigger, &processing)?;
    let retry = sluice_executor::RetryPolicy::try_from(&config.retry)?;
    let scale_out = scale_out::scale_out(
        &config.scale_out,
        &source.kafka,
        &checkpoint,
        trigger.trigger,
        &dead_letters,
    )?;
    if several && scale_out.is_some() {
        bail!(
            "scale_out shares one source's partitions over a consumer group, and [sources.*] \
             declares {}: run a query of several sources in one process",
            streams.len()
        );
    }
    Ok(Settings {
        processing,
        dead_letters,
        retry,
        name: config.name,
        trigger: trigger.trigger,
        polling_delay: trigger.polling_delay,
        min_offsets_per_trigger: source.min_offsets_per_trigger,
        min_batches_to_retain: config.checkpoint.min_batches_to_retain()?,
        checkpoint,
        scale_out,
        sink,
        progress: config.progress,
        sources: streams,
    })
}

/// One source's settings, checked: what it reads and how, fitted to the
/// trigger.
fn stream_settings(
    name: &str,
    section: &SourceSection,
    trigger: Trigger,
    several: bool,
) -> Result<StreamSettings> {
    let mut source = SourceSettings::try_from(section)?;
    if several && source.min_offsets_per_trigger.is_some() {
        bail!(
            "min_offsets_per_trigger is for a query of one source; a query of several runs a \
             batch when any of them has new offsets"
        );
    }
    trigger::fit_source(trigger, &mut source)?;
    processing::stream(name, section, source)
}

/// The query's source sections with their table names, in order: `[source]`
/// alone, or each `[sources.<table>]`.
fn source_sections(
    source: Option<SourceSection>,
    sources: Option<toml::Table>,
) -> Result<Vec<(String, SourceSection)>> {
    match (source, sources) {
        (Some(_), Some(_)) => bail!(
            "[source] and [sources.*] are both set: a query reads one stream with [source], or \
             several with a [sources.<table>] each; move [source] to [sources.<its table>]"
        ),
        (None, None) => bail!(
            "there is no [source]: declare the stream a query reads with [source], or several \
             with [sources.<table>]"
        ),
        (Some(source), None) => {
            let table = source.table.clone().unwrap_or_else(|| "source".to_owned());
            Ok(vec![(table, source)])
        }
        (None, Some(sources)) => {
            if sources.is_empty() {
                bail!("[sources] declares no source: add a [sources.<table>] for each stream");
            }
            sources
                .into_iter()
                .map(|(name, value)| {
                    let section: SourceSection =
                        value.try_into().map_err(|e: toml::de::Error| {
                            anyhow::anyhow!("[sources.{name}]: {}", with_suggestion(e.message()))
                        })?;
                    if section.table.as_ref().is_some_and(|t| *t != name) {
                        bail!(
                            "[sources.{name}] sets table = {:?}: a source of [sources.*] is the \
                             table its section names; leave table out",
                            section.table.as_deref().unwrap_or_default()
                        );
                    }
                    Ok((name, section))
                })
                .collect()
        }
    }
}

/// Refuses a topic that two sources name: its records would be read once for
/// each, as rows of two tables. Patterns are checked as topics appear.
fn distinct_topics(streams: &[StreamSettings]) -> Result<()> {
    let mut seen: std::collections::BTreeMap<&str, &str> = Default::default();
    for stream in streams {
        let topics: Vec<&str> = match &stream.source.kafka.selection {
            sluice_kafka::TopicSelection::Subscribe(topics) => {
                topics.iter().map(String::as_str).collect()
            }
            sluice_kafka::TopicSelection::Assign(assigned) => {
                assigned.keys().map(String::as_str).collect()
            }
            sluice_kafka::TopicSelection::SubscribePattern(_) => Vec::new(),
        };
        for topic in topics {
            if let Some(other) = seen.insert(topic, &stream.table) {
                bail!(
                    "topic {topic} is read by [sources.{other}] and [sources.{}]: a topic may be \
                     read by one source only",
                    stream.table
                );
            }
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests;
