//! `sluice`: reads the configuration and the command line, builds the source, the
//! offset store and the sink, and hands them to the executor.
//!
//! Exit codes: 0 done (or stopped by a signal), 1 a runtime failure (Kafka
//! unreachable, the sink failing, I/O), 2 bad configuration or command line,
//! 3 data loss with `fail_on_data_loss = true`, 4 an unusable checkpoint (held by
//! another runner, damaged or inconsistent), 130 a second interrupt.

// A group-mode generation runs a whole query inside a future that must be
// `Send`: its nested retried calls make a type deeper than the default limit
// of 128 that the compiler follows while it lays the future out.
#![recursion_limit = "256"]

mod code_pages;
mod dead;
mod exit;
mod failpoint;
mod group;
mod kafka_rows;
mod logging;
mod offsets_cmd;
mod offsets_group;
mod signals;
mod telemetry;

use logging::{LOG_FORMAT, LogFormat, init_logging};
use signals::stop_on_signals;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use telemetry::{batch_counts, describe_trigger, record_metrics, serve_status};

use anyhow::Context;
use clap::{Parser, Subcommand};
use sluice_cassandra_store::{CassandraSink, CassandraStore};
use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{BatchPlan, OffsetStore, PassThrough, Processor, Source, Writes};
use sluice_executor::sinks::{ConsoleFormat, ConsoleSink, DiscardSink, JsonlSink};
use sluice_executor::{Query, QueryOptions, QueryProgress, QueryStore};
use sluice_kafka::{KafkaSink, KafkaSource, KafkaSources};
use sluice_sql::{Decoder, LookupTable, SqlProcessor, StreamQuery, TableLoader};
use sluice_tables::{CassandraTable, FileTable};
use tokio::sync::watch;

use dead::DeadLetterSink;
use exit::{Classify, Exit};
use sluice_runner::config;
use sluice_runner::config::{DeadLetters, Settings, SinkKind, StoreKind};

/// Exactly-once micro-batches from Apache Kafka.
#[derive(Parser)]
#[command(name = "sluice", version)]
struct Cli {
    /// How log lines look (they go to standard error).
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a query until its trigger is done or it is stopped (SIGINT/SIGTERM).
    Run {
        /// The query's TOML configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Check a configuration, the connection to Kafka and the topics, writing nothing.
    Validate {
        /// The query's TOML configuration.
        #[arg(long)]
        config: PathBuf,
    },
    /// Inspect or move a query's offsets.
    Offsets {
        #[command(subcommand)]
        command: offsets_cmd::OffsetsCommand,
    },
    /// Remove the data files of a Delta table that its current version does
    /// not list and that are older than the retention: files of replaced
    /// versions, and files of batches cut short before their commit. A query
    /// writing the table never removes files itself.
    Vacuum {
        /// The table's directory (or give --config).
        #[arg(long, conflicts_with = "config", required_unless_present = "config")]
        table: Option<PathBuf>,
        /// A query's configuration whose sink is the Delta table.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Keep files younger than this many hours (by default the table's
        /// delta.deletedFileRetentionDuration, a week).
        #[arg(long)]
        retain_hours: Option<u64>,
        /// Allow a retention shorter than the table's: only with no reader of
        /// an older version and no query writing the table.
        #[arg(long)]
        no_retention_check: bool,
        /// List the files that would go, and remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

// librdkafka allocates every message on one thread and frees it on another,
// which glibc's malloc serialises on its arena locks; mimalloc, which also
// replaces malloc for the C code, frees across threads without a lock.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay`, by its place in mimalloc 3's
/// `mi_option_e`, which the Rust bindings predate. The version is pinned, and a
/// test checks the option's default at this place.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Hands freed pages back to the system after 100 ms instead of mimalloc's
/// second, which held about a third more peak memory at 1,024 partitions and
/// 10,000 offsets per trigger (docs/benchmarks.md, "The allocator").
fn tune_allocator() {
    // SAFETY: setting an option only stores a value; this runs before any
    // thread of ours exists.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 100) };
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let log_format = cli.log_format;
    let _ = LOG_FORMAT.set(log_format);
    init_logging(log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("sluice: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run { config } => run(config).await,
            Command::Validate { config } => validate(config).await,
            Command::Offsets { command } => offsets_cmd::run(command).await,
            Command::Vacuum {
                table,
                config,
                retain_hours,
                no_retention_check,
                dry_run,
            } => vacuum(table, config, retain_hours, !no_retention_check, dry_run).await,
        }
    });
    // A request that a stop cut short may still be waiting for its timeout on
    // the blocking pool; it has nothing left to do for anyone.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(exit) => {
            // Once: as a JSON log line where logs are read by machines, as a
            // plain line for people otherwise.
            match log_format {
                LogFormat::Json => tracing::error!("{}", error_chain(&exit.error)),
                LogFormat::Text => eprintln!("sluice: {}", error_chain(&exit.error)),
            }
            ExitCode::from(exit.code)
        }
    }
}

/// An error and its causes, each said once: many of our errors already name
/// their cause in their own message, which anyhow's `{:#}` would repeat.
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let said = cause.to_string();
        if text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

/// Every check that `run` and `validate` both make before anything is opened:
/// the configuration, the query planned over its decoder (so that bad SQL
/// touches no store), what the sink needs of the query's rows, and whether the
/// query can run in the mode the configuration asks for. `None` for a query
/// that passes the records through.
async fn prepare(config: &Path) -> Result<(Settings, Option<SqlProcessor>), Exit> {
    let settings = config::load(config).map_err(Exit::config)?;
    if settings.processing.is_pass_through() {
        return Ok((settings, None));
    }
    let processor = processor(&settings).await?;
    if let SinkKind::Kafka(_) = &settings.sink {
        KafkaSink::check_rows(&processor.output_schema()).map_err(|e| Exit::config(e.into()))?;
    }
    if settings.scale_out.is_some() && processor.is_stateful() {
        return Err(Exit::config(anyhow::anyhow!(
            "query.sql aggregates, and stateful queries are not supported with scale_out yet: \
             their state would have to move with the partitions (docs/scale-out.md#limits)"
        )));
    }
    Ok((settings, Some(processor)))
}

async fn run(config: PathBuf) -> Result<(), Exit> {
    let (settings, processor) = prepare(&config).await?;
    if let Some(protocol) = settings.scale_out {
        let StoreKind::Cassandra(location, options) = settings.checkpoint.clone() else {
            unreachable!("the configuration refuses scale_out without a Cassandra store");
        };
        return group::run(settings, location, *options, protocol).await;
    }
    match settings.checkpoint.clone() {
        StoreKind::Directory(dir) => {
            let shown = dir.display().to_string();
            let checkpoint = tokio::task::spawn_blocking(move || Checkpoint::open(dir))
                .await
                .map_err(|e| Exit::runtime(anyhow::anyhow!("opening the checkpoint: {e}")))?
                .map_err(Exit::checkpoint)?;
            let query_id = checkpoint.id().to_owned();
            let stop = stop_on_signals();
            with_store(settings, processor, query_id, checkpoint, shown, stop, None).await
        }
        StoreKind::Cassandra(location, options) => {
            let shown = format!("cassandra {}/{}", location.keyspace, location.query);
            let store = CassandraStore::open(location, *options)
                .await
                .map_err(Exit::cassandra)?;
            let query_id = store.id().to_owned();
            let stop = stop_on_signals();
            with_store(settings, processor, query_id, store, shown, stop, None).await
        }
    }
}

/// Builds the source, the processor and the sink around an opened offset
/// store, and runs until `stop` turns true or the trigger is done. In group
/// mode, `generation` names the sink's output.
async fn with_store<St>(
    settings: Settings,
    processor: Option<SqlProcessor>,
    query_id: String,
    store: St,
    shown: String,
    stop: watch::Receiver<bool>,
    group: Option<group::InGroup>,
) -> Result<(), Exit>
where
    St: QueryStore,
    <St as OffsetStore>::Error: Classify,
{
    let source = kafka_sources(&settings, &query_id)?;
    tracing::info!(query = %query_id, offsets = %shown, "starting");
    let parts = Parts {
        settings,
        query_id,
        source,
        store_description: shown,
        stop,
        recovery_only: group.as_ref().is_some_and(|g| g.recovery_only),
        shared_status: group.as_ref().map(|g| (g.status.clone(), g.store.clone())),
        generation: group.map(|g| g.generation),
    };
    let Some(processor) = processor else {
        return parts.with_sink(store, PassThrough, DiscardSink, None).await;
    };
    let dead = dead_letters(&parts.settings, &parts.query_id, parts.generation.as_ref())?;
    let schema = processor.output_schema();
    parts.with_sink(store, processor, dead, Some(schema)).await
}

/// The sources as the status page and `validate` name them.
fn describe_sources(settings: &Settings) -> String {
    match settings.sources.as_slice() {
        [one] => one.source.description.clone(),
        several => several
            .iter()
            .map(|s| format!("{}: {}", s.table, s.source.description))
            .collect::<Vec<_>>()
            .join("; "),
    }
}

/// The Kafka source of each of the configuration's sources, in order.
fn kafka_sources(settings: &Settings, query_id: &str) -> Result<KafkaSources, Exit> {
    let sources = settings
        .sources
        .iter()
        .map(|stream| {
            KafkaSource::new(stream.source.kafka.clone(), query_id)
                .map(|source| (stream.table.clone(), source))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(KafkaSources::new)
        .map_err(|e| Exit::config(e.into()))?;
    Ok(sources)
}

/// The decoders and the query of a configuration, planned.
async fn processor(settings: &Settings) -> Result<SqlProcessor, Exit> {
    let processing = &settings.processing;
    let decoders: Vec<Decoder> = settings
        .sources
        .iter()
        .map(|stream| Decoder::new(stream.format.clone(), stream.source.kafka.include_headers))
        .collect();
    let lookups = lookup_tables(&processing.tables).await?;
    let mut options = processing.query_options();
    options.lookup_tables = lookups.iter().map(|(table, _)| table.clone()).collect();
    let streams: Vec<(String, sluice_sql::arrow::datatypes::SchemaRef)> = settings
        .sources
        .iter()
        .zip(&decoders)
        .map(|(stream, decoder)| (stream.table.clone(), decoder.schema()))
        .collect();
    let query = match &processing.sql {
        Some(sql) => Some(
            StreamQuery::plan_streams(sql, &streams, &options)
                .await
                .map_err(|e| Exit::config(anyhow::Error::new(e).context("query.sql")))?,
        ),
        None => None,
    };
    let mut processor = SqlProcessor::with_sources(decoders, query).with_lookups(lookups);
    for (index, stream) in settings.sources.iter().enumerate() {
        if let Some((column, delay_ms)) = &stream.watermark {
            let at = match settings.sources.len() {
                1 => "[source]".to_owned(),
                _ => format!("[sources.{}]", stream.table),
            };
            processor = processor
                .with_source_watermark(index, column, *delay_ms)
                .map_err(|e| Exit::config(anyhow::Error::new(e).context(at)))?;
        }
    }
    Ok(processor)
}

/// The lookup tables of `[tables.*]`: a file table read once, a Cassandra
/// table connected to; one that cannot be is a configuration error.
async fn lookup_tables(
    specs: &[config::TableSpec],
) -> Result<Vec<(LookupTable, Option<Box<dyn TableLoader>>)>, Exit> {
    let mut tables = Vec::with_capacity(specs.len());
    for spec in specs {
        let at = || format!("[tables.{}]", spec.name);
        match &spec.source {
            config::TableSource::File { path, format } => {
                let mut loader = FileTable::open(path, format.clone(), spec.schema.clone())
                    .map_err(|e| Exit::config(anyhow::Error::new(e).context(at())))?;
                let table = LookupTable::new(&spec.name, loader.schema(), spec.max_memory_bytes);
                table
                    .refresh(&mut loader)
                    .await
                    .map_err(|e| Exit::config(anyhow::Error::new(e)))?;
                tables.push((table, Some(Box::new(loader) as Box<dyn TableLoader>)));
            }
            config::TableSource::Cassandra {
                connection,
                keyspace,
                table,
                in_flight,
            } => {
                let schema = spec
                    .schema
                    .clone()
                    .expect("the configuration requires a Cassandra table's schema");
                let loader =
                    CassandraTable::open(connection, keyspace, table, schema.clone(), *in_flight)
                        .await
                        .map_err(|e| Exit::config(anyhow::Error::new(e).context(at())))?;
                let table = LookupTable::keyed(
                    &spec.name,
                    schema,
                    std::sync::Arc::new(loader),
                    spec.max_memory_bytes,
                );
                tables.push((table, None));
            }
        }
    }
    Ok(tables)
}

fn dead_letters(
    settings: &Settings,
    query_id: &str,
    generation: Option<&sluice_core::Generation>,
) -> Result<DeadLetterSink, Exit> {
    Ok(match &settings.dead_letters {
        DeadLetters::None => DeadLetterSink::None(DiscardSink),
        DeadLetters::Directory(path) => {
            DeadLetterSink::Directory(jsonl(path, generation).map_err(|e| Exit::runtime(e.into()))?)
        }
        DeadLetters::Kafka(config) => DeadLetterSink::Kafka(Box::new(
            KafkaSink::new(config.clone(), query_id).map_err(|e| Exit::config(e.into()))?,
        )),
    })
}

/// A jsonl sink into `path`, its files named by `generation` in group mode.
fn jsonl(
    path: &std::path::Path,
    generation: Option<&sluice_core::Generation>,
) -> Result<JsonlSink, sluice_executor::sinks::SinkError> {
    match generation {
        Some(generation) => JsonlSink::for_generation(path, generation),
        None => JsonlSink::new(path),
    }
}

/// What every run needs, whatever its sink.
struct Parts {
    settings: Settings,
    query_id: String,
    source: KafkaSources,
    /// The store as the start line and the status page name it.
    store_description: String,
    /// Turns true when the run is to stop after the batch in flight.
    stop: watch::Receiver<bool>,
    /// The generation this run is, in group mode.
    generation: Option<sluice_core::Generation>,
    /// Whether the run only recovers: it replays what is planned and not
    /// committed, and stops (group mode, settling a generation).
    recovery_only: bool,
    /// In group mode, the status page every generation of the process
    /// shares, and the store as it names it.
    shared_status: Option<(
        std::sync::Arc<tokio::sync::OnceCell<sluice_status::Status>>,
        String,
    )>,
}

impl Parts {
    /// The `kafka` sink; in group mode, the generation's.
    async fn kafka_sink(&self, config: sluice_kafka::KafkaSinkConfig) -> Result<KafkaSink, Exit> {
        KafkaSink::check_transaction_timeout(&config)
            .await
            .map_err(Classify::exit)?;
        match &self.generation {
            None => KafkaSink::new(config, &self.query_id),
            Some(generation) => {
                KafkaSink::for_generation(config, &self.query_id, generation.as_str())
            }
        }
        .map_err(|e| Exit::config(e.into()))
    }

    /// Runs with the processor's output going to the configured sink: the
    /// records as read (`rows` is `None`), or rows of the `rows` schema.
    async fn with_sink<St, P, D>(
        self,
        store: St,
        processor: P,
        dead: D,
        rows: Option<sluice_sql::arrow::datatypes::SchemaRef>,
    ) -> Result<(), Exit>
    where
        St: QueryStore,
        <St as OffsetStore>::Error: Classify,
        P: Processor,
        P::Error: Classify,
        D: Writes,
        DiscardSink: Writes<P::Output>,
        ConsoleSink: Writes<P::Output>,
        KafkaSink: Writes<P::Output>,
        CassandraSink: Writes<P::Output>,
        JsonlSink: Writes<P::Output>,
        kafka_rows::KafkaRows<sluice_lake::ParquetSink>: Writes<P::Output>,
        kafka_rows::KafkaRows<sluice_lake::DeltaSink>: Writes<P::Output>,
    {
        match self.settings.sink.clone() {
            SinkKind::Discard => {
                self.run(store, processor, DiscardSink, dead, "discard".into())
                    .await
            }
            SinkKind::Console {
                json,
                num_rows,
                truncate,
            } => {
                let mut sink = ConsoleSink::new(console_format(json));
                if rows.is_some() {
                    sink = sink.with_table(num_rows, truncate);
                }
                self.run(store, processor, sink, dead, "console".into())
                    .await
            }
            SinkKind::Kafka(config) => {
                let description = format!("kafka[{}]", config.topic);
                let sink = self.kafka_sink(config).await?;
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Cassandra(config) => {
                let description = format!("cassandra[{}.{}]", config.keyspace, config.table);
                let sink = match &rows {
                    Some(schema) => CassandraSink::for_rows(config, schema).await,
                    None => CassandraSink::new(config).await,
                }
                .map_err(Exit::cassandra)?;
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Jsonl { path } => {
                let sink =
                    jsonl(&path, self.generation.as_ref()).map_err(|e| Exit::runtime(e.into()))?;
                let description = format!("jsonl[{}]", path.display());
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Parquet(config) => {
                self.refuse_group_mode("parquet", "Spark's file-sink log")?;
                let include_headers = self.include_headers();
                let sink = sluice_lake::ParquetSink::open(config.parquet(&self.query_id))
                    .map_err(lake_exit)?;
                sink.check(&output_schema(&rows, include_headers))
                    .map_err(|e| Exit::config(e.into()))?;
                let description = format!("parquet[{}]", sink.path().display());
                let sink = kafka_rows::KafkaRows::new(sink, include_headers);
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Delta(config) => {
                self.refuse_group_mode("delta", "the table's transaction for the query")?;
                let include_headers = self.include_headers();
                let options = config.delta(&self.query_id, self.settings.name.as_deref());
                let sink =
                    sluice_lake::DeltaSink::open(options, &output_schema(&rows, include_headers))
                        .await
                        .map_err(lake_exit)?;
                let description = format!("delta[{}]", sink.path().display());
                let sink = kafka_rows::KafkaRows::new(sink, include_headers);
                self.run(store, processor, sink, dead, description).await
            }
        }
    }

    /// Refuses a table sink in group mode, where each generation numbers its
    /// batches from 0 and `what` numbers one query's.
    fn refuse_group_mode(&self, sink: &str, what: &str) -> Result<(), Exit> {
        if self.generation.is_some() {
            return Err(Exit::config(anyhow::anyhow!(
                "sink.type = \"{sink}\" in group mode: {what} numbers one query's batches, and \
                 each generation numbers its own from 0; run one process, or write jsonl files"
            )));
        }
        Ok(())
    }

    /// Whether the records a query-less run lands carry their headers.
    fn include_headers(&self) -> bool {
        self.settings
            .sources
            .first()
            .is_some_and(|s| s.source.kafka.include_headers)
    }

    async fn run<St, P, K, D>(
        self,
        store: St,
        processor: P,
        sink: K,
        dead: D,
        sink_description: String,
    ) -> Result<(), Exit>
    where
        St: QueryStore,
        <St as OffsetStore>::Error: Classify,
        P: Processor,
        P::Error: Classify,
        K: Writes<P::Output>,
        D: Writes,
    {
        let sink = failpoint::WithFailpoint {
            inner: sink,
            at: failpoint::from_env().map_err(Exit::config)?,
        };
        run_query(self, store, processor, sink, dead, sink_description).await
    }
}

/// `sluice vacuum`: prints each file removed (or to be removed), one a line,
/// then a count.
async fn vacuum(
    table: Option<PathBuf>,
    config: Option<PathBuf>,
    retain_hours: Option<u64>,
    check_retention: bool,
    dry_run: bool,
) -> Result<(), Exit> {
    let path = match (table, config) {
        (Some(table), _) => table,
        (None, Some(config)) => {
            let settings = config::load(&config).map_err(Exit::config)?;
            match settings.sink {
                SinkKind::Delta(sink) => sink.path,
                _ => {
                    return Err(Exit::config(anyhow::anyhow!(
                        "{}: sink.type is not \"delta\"; vacuum removes a Delta table's files",
                        config.display()
                    )));
                }
            }
        }
        (None, None) => unreachable!("clap requires one"),
    };
    let retain = retain_hours.map(|h| std::time::Duration::from_secs(h * 3600));
    let vacuumed = sluice_lake::vacuum(&path, retain, check_retention, dry_run)
        .await
        .map_err(lake_exit)?;
    for file in &vacuumed.files {
        println!("{file}");
    }
    let verb = if dry_run { "would remove" } else { "removed" };
    eprintln!(
        "sluice: {verb} {} file(s) from {}",
        vacuumed.files.len(),
        path.display()
    );
    Ok(())
}

/// What a table sink lands: the query's rows, or without a query the
/// records' columns as Spark's Kafka source has them.
fn output_schema(
    rows: &Option<sluice_sql::arrow::datatypes::SchemaRef>,
    include_headers: bool,
) -> sluice_sql::arrow::datatypes::Schema {
    match rows {
        Some(schema) => schema.as_ref().clone(),
        None => sluice_sql::arrow::datatypes::Schema::new(
            sluice_sql::columns::KafkaColumns::spark(include_headers).fields(),
        ),
    }
}

/// A table sink that cannot start: another writer's directory or a table
/// the output does not fit are the configuration's fault.
fn lake_exit(error: sluice_lake::LakeError) -> Exit {
    match error {
        sluice_lake::LakeError::Foreign { .. }
        | sluice_lake::LakeError::Schema { .. }
        | sluice_lake::LakeError::Options(_) => Exit::config(error.into()),
        other => Exit::runtime(other.into()),
    }
}

fn console_format(json: bool) -> ConsoleFormat {
    if json {
        ConsoleFormat::Json
    } else {
        ConsoleFormat::Text
    }
}

/// A generation's part of the progress report: the member, the generation
/// and the partitions it holds, which its settings assign exactly.
fn group_progress(
    settings: &Settings,
    generation: &sluice_core::Generation,
) -> sluice_executor::GroupProgress {
    let held: Vec<sluice_core::TopicPartition> = match &settings.kafka().selection {
        sluice_kafka::TopicSelection::Assign(topics) => topics
            .iter()
            .flat_map(|(topic, partitions)| {
                partitions
                    .iter()
                    .map(|p| sluice_core::TopicPartition::new(topic.as_str(), *p))
            })
            .collect(),
        _ => Vec::new(),
    };
    sluice_executor::GroupProgress::new(generation.member(), generation.as_str(), &held)
}

/// `[progress] file`, opened to append one report a line.
fn progress_file(settings: &Settings) -> Result<Option<std::fs::File>, Exit> {
    let Some(path) = &settings.progress.file else {
        return Ok(None);
    };
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening the progress file {}", path.display()))
        .map(Some)
        .map_err(Exit::config)
}

async fn run_query<St, P, K, D>(
    parts: Parts,
    store: St,
    processor: P,
    sink: K,
    dead: D,
    sink_description: String,
) -> Result<(), Exit>
where
    St: QueryStore,
    <St as OffsetStore>::Error: Classify,
    P: Processor,
    P::Error: Classify,
    K: Writes<P::Output>,
    D: Writes,
{
    let Parts {
        settings,
        query_id,
        source,
        store_description,
        stop,
        generation,
        recovery_only,
        shared_status,
    } = parts;
    let group = generation.map(|generation| group_progress(&settings, &generation));
    let options = QueryOptions {
        name: settings.name.clone(),
        trigger: settings.trigger,
        polling_delay: settings.polling_delay,
        sources: settings
            .sources
            .iter()
            .map(|stream| sluice_executor::SourceOptions {
                description: stream.source.description.clone(),
                starting: stream.source.starting.resolve(),
                max_offsets_per_trigger: stream.source.max_offsets_per_trigger,
                on_bad_record: stream.on_bad_record,
            })
            .collect(),
        min_offsets_per_trigger: settings.min_offsets_per_trigger,
        state_memory: Some(settings.processing.state_memory_bytes),
        fail_on_data_loss: settings.kafka().fail_on_data_loss,
        min_batches_to_retain: settings.min_batches_to_retain,
        sink_description: sink_description.clone(),
        retry: settings.retry,
        group: group.clone(),
    };
    let mut progress_file = progress_file(&settings)?;
    let metrics_addr = match &settings.progress.metrics_addr {
        Some(addr) => Some(config::metrics_listen(addr).map_err(Exit::config)?),
        None => None,
    };
    let about = sluice_status::About {
        name: settings.name.clone(),
        id: query_id.clone(),
        run_id: String::new(),
        trigger: describe_trigger(settings.trigger),
        source: describe_sources(&settings),
        store: store_description,
        sink: sink_description.clone(),
    };

    let mut query = Query::with_processor(options, query_id, source, store, processor, sink, dead);
    if recovery_only {
        query = query.recovery_only();
    }
    let status = match (metrics_addr, shared_status) {
        (Some(addr), None) => {
            let status = serve_status(
                sluice_status::About {
                    run_id: query.run_id().to_owned(),
                    ..about
                },
                addr,
            )
            .await?;
            Some(status)
        }
        // Each generation is a run of its own; the page is the member's, so
        // it names the member where a run's id would be.
        (Some(addr), Some((shared, store))) => {
            let about = sluice_status::About {
                run_id: group
                    .as_ref()
                    .map_or_else(String::new, |g| g.member.clone()),
                store,
                ..about
            };
            Some(
                shared
                    .get_or_try_init(|| serve_status(about, addr))
                    .await?
                    .clone(),
            )
        }
        (None, _) => None,
    };
    let mut first_batch = true;
    let on_progress = |progress: &QueryProgress| {
        if std::mem::take(&mut first_batch) {
            code_pages::release_startup_code();
        }
        // One short line for people; the whole report where machines read logs.
        match LOG_FORMAT.get().copied().unwrap_or(LogFormat::Text) {
            LogFormat::Text => tracing::info!("{}", progress.summary()),
            LogFormat::Json => tracing::info!(
                batch = progress.batch_id,
                rows = progress.num_input_rows,
                progress = %progress.to_json(),
                "{}",
                progress.summary()
            ),
        }
        // The line and its newline in one write: `writeln!` makes two, and a
        // SIGKILL between them left a line without its end, which the next
        // run's first line then continued (seen once in CI).
        let json = (progress_file.is_some() || status.is_some()).then(|| progress.to_json());
        if let (Some(file), Some(json)) = (progress_file.as_mut(), &json)
            && let Err(e) = file.write_all(format!("{json}\n").as_bytes())
        {
            tracing::warn!(error = %e, "writing the progress file failed");
        }
        // Without the status server no recorder is installed, and the
        // metrics would be built only to be dropped.
        if let (Some(status), Some(json)) = (&status, json) {
            record_metrics(progress);
            status.record(json, batch_counts(progress));
        }
    };
    let summary = query
        .run(stop, on_progress)
        .await
        .map_err(|e| Exit::executor(e, K::is_fenced))?;
    tracing::info!(
        batches = summary.batches,
        records = summary.records,
        lost_offsets = summary.lost_offsets,
        bad_records = summary.bad_records,
        last_committed = summary.last_committed.map(|b| b.0),
        "stopped"
    );
    Ok(())
}

async fn validate(config: PathBuf) -> Result<(), Exit> {
    let (settings, _) = prepare(&config).await?;
    if let SinkKind::Kafka(sink) = &settings.sink {
        KafkaSink::check_options(sink).map_err(Classify::exit)?;
        KafkaSink::check_transaction_timeout(sink)
            .await
            .map_err(Classify::exit)?;
    }
    let mut partitions = 0;
    for stream in &settings.sources {
        let kafka = &stream.source.kafka;
        let mut source =
            KafkaSource::new(kafka.clone(), "validate").map_err(|e| Exit::config(e.into()))?;
        let found = source.partitions().await.map_err(Classify::exit)?;
        partitions += found.len();
        let missing: Vec<String> = match &kafka.selection {
            sluice_kafka::TopicSelection::Subscribe(topics) => topics
                .iter()
                .filter(|t| !found.keys().any(|tp| *tp.topic == ***t))
                .cloned()
                .collect(),
            sluice_kafka::TopicSelection::Assign(assign) => assign
                .iter()
                .flat_map(|(t, ps)| {
                    ps.iter()
                        .map(move |p| sluice_core::TopicPartition::new(t.as_str(), *p))
                })
                .filter(|tp| !found.contains_key(tp))
                .map(|tp| tp.to_string())
                .collect(),
            sluice_kafka::TopicSelection::SubscribePattern(_) => Vec::new(),
        };
        if !missing.is_empty() {
            let of = match settings.sources.len() {
                1 => String::new(),
                _ => format!(" ([sources.{}])", stream.table),
            };
            return Err(Exit::config(anyhow::anyhow!(
                "{}: Kafka at {} has no {}{of}",
                config.display(),
                kafka.bootstrap_servers,
                missing.join(", ")
            )));
        }
    }
    let checkpoint = match &settings.checkpoint {
        StoreKind::Directory(dir) => {
            if dir.join("metadata").exists() {
                let (_, stored) = Checkpoint::inspect(dir).map_err(Exit::checkpoint)?;
                let lines = stored.latest_plan.as_ref().map(BatchPlan::source_count);
                if let Some(lines) = lines.filter(|n| *n != settings.sources.len()) {
                    return Err(Exit::config(anyhow::anyhow!(
                        "{}: the checkpoint {} holds offsets of {lines} source(s), and the query \
                         reads {} ({}): a checkpoint keeps the sources it was started with",
                        config.display(),
                        dir.display(),
                        settings.sources.len(),
                        describe_sources(&settings)
                    )));
                }
            }
            dir.display().to_string()
        }
        StoreKind::Cassandra(location, _) => format!(
            "cassandra {} (keyspace {}, query {})",
            location.nodes.join(","),
            location.keyspace,
            location.query
        ),
    };
    println!(
        "{}: valid; Kafka at {} answers with {} partitions for {}; checkpoint {}",
        config.display(),
        settings.kafka().bootstrap_servers,
        partitions,
        describe_sources(&settings),
        checkpoint
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::telemetry::offsets_behind;
    use super::{MI_OPTION_PURGE_DELAY, error_chain};

    /// A report with every part filled that a metric is recorded from.
    fn full_progress() -> sluice_executor::QueryProgress {
        use sluice_executor::{DurationMs, SinkProgress, SourceProgress, StateOperatorProgress};
        let metrics = [
            ("dataLossOffsets", "3"),
            ("badRecords", "2"),
            ("maxOffsetsBehindLatest", "5"),
            ("avgOffsetsBehindLatest", "2.5"),
        ];
        sluice_executor::QueryProgress {
            id: "q".to_owned(),
            run_id: "r".to_owned(),
            name: None,
            timestamp: "2026-12-01T10:00:00.000Z".to_owned(),
            batch_id: 7,
            num_input_rows: 100,
            input_rows_per_second: 50.0,
            processed_rows_per_second: 1000.0,
            duration_ms: DurationMs::default(),
            duration_micros: DurationMs {
                trigger_execution: 12_000,
                ..DurationMs::default()
            },
            event_time: Some(
                [(
                    "watermark".to_owned(),
                    "2026-12-01T09:59:00.000Z".to_owned(),
                )]
                .into(),
            ),
            state_operators: vec![StateOperatorProgress {
                operator_name: "stateStoreSave".to_owned(),
                num_rows_total: 10,
                num_rows_updated: 4,
                num_rows_removed: 1,
                num_rows_dropped_by_watermark: 2,
                memory_used_bytes: 4096,
                batch_memory_bytes: 2048,
                commit_time_ms: 1,
                num_state_store_instances: 1,
                custom_metrics: Default::default(),
            }],
            memory: None,
            lookup_tables: vec![sluice_executor::LookupTableProgress {
                name: "customers".to_owned(),
                version: "1 file, 120 bytes, modified 2026-12-01T09:00:00.000Z".to_owned(),
                num_rows: 3,
                memory_used_bytes: 1024,
                num_reloads: 1,
                num_failed_reloads: 0,
                last_error: None,
            }],
            sources: vec![SourceProgress {
                description: "KafkaV2[Subscribe[t]]".to_owned(),
                start_offset: serde_json::json!({"t": {"0": 0, "1": 0}}),
                end_offset: serde_json::json!({"t": {"0": 50, "1": 50}}),
                latest_offset: serde_json::json!({"t": {"0": 55, "1": 50}}),
                num_input_rows: 100,
                input_rows_per_second: 50.0,
                processed_rows_per_second: 1000.0,
                metrics: metrics
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                watermark: None,
            }],
            sink: SinkProgress {
                description: "jsonl".to_owned(),
                num_output_rows: 100,
                metrics: std::collections::BTreeMap::new(),
            },
            group: None,
        }
    }

    /// Every panel of the dashboard is well formed, and every metric its
    /// queries name is one that Sluice records, as the recorder renders it.
    #[test]
    fn the_grafana_dashboard_loads_and_charts_only_metrics_sluice_exports() {
        let text = include_str!("../../../docs/grafana/sluice.json");
        let dashboard: serde_json::Value = serde_json::from_str(text).expect("valid JSON");
        assert!(dashboard["uid"].is_string() && dashboard["title"].is_string());
        assert!(dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
        let variables: Vec<&str> = dashboard["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        assert_eq!(variables, ["datasource", "instance"]);

        let recorder = super::telemetry::prometheus().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || super::record_metrics(&full_progress()));
        let rendered = handle.render();
        let series: Vec<&str> = rendered
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();

        let panels = dashboard["panels"].as_array().unwrap();
        assert!(panels.len() >= 8);
        let mut ids = std::collections::BTreeSet::new();
        for panel in panels {
            let title = panel["title"].as_str().unwrap();
            assert!(
                ids.insert(panel["id"].as_u64().unwrap()),
                "{title}: id repeated"
            );
            assert!(
                ["timeseries", "heatmap"].contains(&panel["type"].as_str().unwrap()),
                "{title}"
            );
            let grid = &panel["gridPos"];
            let (x, w, h) = (grid["x"].as_u64(), grid["w"].as_u64(), grid["h"].as_u64());
            assert!(
                matches!((x, w, h), (Some(x), Some(w), Some(h)) if w > 0 && h > 0 && x + w <= 24),
                "{title}: {grid}"
            );
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
            let targets = panel["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{title}");
            for target in targets {
                assert!(target["refId"].is_string(), "{title}");
                let expr = target["expr"].as_str().unwrap();
                let named: Vec<&str> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|word| word.starts_with("sluice_"))
                    .collect();
                assert!(!named.is_empty(), "{title}: {expr} names no metric of ours");
                for metric in named {
                    assert!(
                        series.contains(&metric),
                        "{title}: {metric} is not among the metrics Sluice exports:\n{rendered}"
                    );
                }
            }
        }
        // Per partition, with their labels, and the histogram with buckets.
        assert!(rendered.contains(r#"sluice_offsets_behind_latest{topic="t",partition="0"} 5"#));
        assert!(rendered.contains(r#"sluice_topic_offsets_behind_latest{topic="t"} 5"#));
        assert!(rendered.contains(r#"sluice_batch_duration_seconds_bucket{le="0.025"} 1"#));
    }

    #[test]
    fn offsets_behind_pairs_each_partition_of_both_maps() {
        let end = serde_json::json!({"a": {"0": 10, "1": 5}, "b": {"0": 7}});
        let latest = serde_json::json!({"a": {"0": 12, "1": 5, "2": 9}, "b": {"0": 6}});
        let mut behind = offsets_behind(&end, &latest);
        behind.sort();
        let named = |t: &str, p: &str, n| (t.to_owned(), p.to_owned(), n);
        // a-2 is in no plan yet, and b-0's latest is older than its end (a
        // truncated topic, say): neither is negative nor invented.
        assert_eq!(
            behind,
            vec![named("a", "0", 2), named("a", "1", 0), named("b", "0", 0)]
        );
        assert!(offsets_behind(&serde_json::Value::Null, &latest).is_empty());
    }

    #[derive(Debug, thiserror::Error)]
    #[error("cannot reach Kafka at h:1: fetching metadata failed: {source}")]
    struct Names {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn an_error_chain_says_each_cause_once() {
        let error = anyhow::Error::new(Names {
            source: std::io::Error::other("transport failure"),
        })
        .context("discovering partitions failed 2 times");
        assert_eq!(
            error_chain(&error),
            "discovering partitions failed 2 times: cannot reach Kafka at h:1: fetching \
             metadata failed: transport failure"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_chain(&plain), "outer: inner");
    }

    /// The option tuned is the one meant: mimalloc 3's purge delay defaults to
    /// 1,000 ms. A mimalloc whose option numbering moved fails here instead of
    /// tuning something else.
    #[test]
    fn the_allocator_option_is_found_by_its_default() {
        // SAFETY: reading an option has no side effect but its lazy init.
        let delay = unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        assert_eq!(delay, 1000);
    }
}
