//! `sluice`: reads the configuration and the command line, builds the source, the
//! offset store and the sink, and hands them to the executor.
//!
//! Exit codes: 0 done (or stopped by a signal), 1 a runtime failure (Kafka
//! unreachable, the sink failing, I/O), 2 bad configuration or command line,
//! 3 data loss with `fail_on_data_loss = true`, 4 an unusable checkpoint (held by
//! another runner, damaged or inconsistent), 130 a second interrupt.

mod config;
mod dead;
mod exit;
mod failpoint;
mod offsets_cmd;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sluice_cassandra_store::CassandraStore;
use sluice_checkpoint_fs::Checkpoint;
use sluice_executor::sinks::{ConsoleFormat, ConsoleSink, DiscardSink, JsonlSink};
use sluice_executor::{Query, QueryOptions, QueryProgress};
use sluice_kafka_source::{KafkaSink, KafkaSource};
use sluice_offsets::{OffsetStore, PassThrough, Processor, Sink, Source};
use sluice_sql::{Decoder, SqlProcessor, StreamQuery};
use tokio::sync::watch;

use config::{DeadLetters, Settings, SinkKind, StoreKind};
use dead::DeadLetterSink;
use exit::{Classify, Exit};

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

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// How logs look: chosen once for the process, as the log subscriber is.
static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

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

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes are for a terminal, not for a file or a pipe; NO_COLOR
        // (no-color.org) turns them off there too.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        );
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(config: PathBuf) -> Result<(), Exit> {
    let settings = config::load(&config).map_err(Exit::config)?;
    // Planned before anything is opened, so that bad SQL touches no store.
    let processor = match settings.processing.is_pass_through() {
        true => None,
        false => {
            let processor = processor(&settings).await?;
            if let SinkKind::Kafka(_) = &settings.sink {
                KafkaSink::check_rows(&processor.output_schema())
                    .map_err(|e| Exit::config(e.into()))?;
            }
            Some(processor)
        }
    };
    match settings.checkpoint.clone() {
        StoreKind::Directory(dir) => {
            let shown = dir.display().to_string();
            let checkpoint = tokio::task::spawn_blocking(move || Checkpoint::open(dir))
                .await
                .map_err(|e| Exit::runtime(anyhow::anyhow!("opening the checkpoint: {e}")))?
                .map_err(Exit::checkpoint)?;
            let query_id = checkpoint.id().to_owned();
            with_store(settings, processor, query_id, checkpoint, shown).await
        }
        StoreKind::Cassandra(location, options) => {
            let shown = format!("cassandra {}/{}", location.keyspace, location.query);
            let store = CassandraStore::open(location, *options)
                .await
                .map_err(Exit::cassandra)?;
            let query_id = store.id().to_owned();
            with_store(settings, processor, query_id, store, shown).await
        }
    }
}

/// Builds the source, the processor and the sink around an opened offset
/// store, and runs.
async fn with_store<St>(
    settings: Settings,
    processor: Option<SqlProcessor>,
    query_id: String,
    store: St,
    shown: String,
) -> Result<(), Exit>
where
    St: OffsetStore,
    St::Error: Classify,
{
    let source =
        KafkaSource::new(settings.kafka.clone(), &query_id).map_err(|e| Exit::config(e.into()))?;
    tracing::info!(query = %query_id, offsets = %shown, "starting");
    let parts = Parts {
        settings,
        query_id,
        source,
    };
    let Some(processor) = processor else {
        return parts.records(store).await;
    };
    let dead = dead_letters(&parts.settings, &parts.query_id)?;
    parts.rows(store, processor, dead).await
}

/// The decoder and the query of a configuration, planned.
async fn processor(settings: &Settings) -> Result<SqlProcessor, Exit> {
    let processing = &settings.processing;
    let decoder = Decoder::new(processing.format.clone(), settings.kafka.include_headers);
    let query = match &processing.sql {
        Some(sql) => Some(
            StreamQuery::plan_with(
                sql,
                &processing.table,
                decoder.schema(),
                &processing.query_options(),
            )
            .await
            .map_err(|e| Exit::config(anyhow::Error::new(e).context("query.sql")))?,
        ),
        None => None,
    };
    let processor = SqlProcessor::new(decoder, query);
    match &processing.watermark {
        Some((column, delay_ms)) => processor
            .with_watermark(column, *delay_ms)
            .map_err(|e| Exit::config(e.into())),
        None => Ok(processor),
    }
}

fn dead_letters(settings: &Settings, query_id: &str) -> Result<DeadLetterSink, Exit> {
    Ok(match &settings.dead_letters {
        DeadLetters::None => DeadLetterSink::None(DiscardSink),
        DeadLetters::Directory(path) => {
            DeadLetterSink::Directory(JsonlSink::new(path).map_err(|e| Exit::runtime(e.into()))?)
        }
        DeadLetters::Kafka(config) => DeadLetterSink::Kafka(Box::new(
            KafkaSink::new(config.clone(), query_id).map_err(|e| Exit::config(e.into()))?,
        )),
    })
}

/// What every run needs, whatever its sink.
struct Parts {
    settings: Settings,
    query_id: String,
    source: KafkaSource,
}

impl Parts {
    /// Runs with the records going to the sink as read.
    async fn records<St>(self, store: St) -> Result<(), Exit>
    where
        St: OffsetStore,
        St::Error: Classify,
    {
        let dead = DiscardSink;
        match self.settings.sink.clone() {
            SinkKind::Discard => {
                self.run(store, PassThrough, DiscardSink, dead, "discard".into())
                    .await
            }
            SinkKind::Console { json, .. } => {
                let sink = ConsoleSink::new(console_format(json));
                self.run(store, PassThrough, sink, dead, "console".into())
                    .await
            }
            SinkKind::Kafka(config) => {
                let description = format!("kafka[{}]", config.topic);
                KafkaSink::check_transaction_timeout(&config)
                    .await
                    .map_err(Classify::exit)?;
                let sink =
                    KafkaSink::new(config, &self.query_id).map_err(|e| Exit::config(e.into()))?;
                self.run(store, PassThrough, sink, dead, description).await
            }
            SinkKind::Cassandra(config) => {
                let description = format!("cassandra[{}.{}]", config.keyspace, config.table);
                let sink = sluice_cassandra_store::CassandraSink::new(config)
                    .await
                    .map_err(Exit::cassandra)?;
                self.run(store, PassThrough, sink, dead, description).await
            }
            SinkKind::Jsonl { path } => {
                let sink = JsonlSink::new(&path).map_err(|e| Exit::runtime(e.into()))?;
                let description = format!("jsonl[{}]", path.display());
                self.run(store, PassThrough, sink, dead, description).await
            }
        }
    }

    /// Runs with the query's rows (or the decoded rows) going to the sink.
    async fn rows<St>(
        self,
        store: St,
        processor: SqlProcessor,
        dead: DeadLetterSink,
    ) -> Result<(), Exit>
    where
        St: OffsetStore,
        St::Error: Classify,
    {
        let schema = processor.output_schema();
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
                let sink = ConsoleSink::new(console_format(json)).with_table(num_rows, truncate);
                self.run(store, processor, sink, dead, "console".into())
                    .await
            }
            SinkKind::Kafka(config) => {
                let description = format!("kafka[{}]", config.topic);
                KafkaSink::check_transaction_timeout(&config)
                    .await
                    .map_err(Classify::exit)?;
                let sink =
                    KafkaSink::new(config, &self.query_id).map_err(|e| Exit::config(e.into()))?;
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Cassandra(config) => {
                let description = format!("cassandra[{}.{}]", config.keyspace, config.table);
                let sink = sluice_cassandra_store::CassandraSink::for_rows(config, &schema)
                    .await
                    .map_err(Exit::cassandra)?;
                self.run(store, processor, sink, dead, description).await
            }
            SinkKind::Jsonl { path } => {
                let sink = JsonlSink::new(&path).map_err(|e| Exit::runtime(e.into()))?;
                let description = format!("jsonl[{}]", path.display());
                self.run(store, processor, sink, dead, description).await
            }
        }
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
        St: OffsetStore,
        St::Error: Classify,
        P: Processor,
        P::Error: Classify,
        K: Sink<P::Output>,
        D: Sink,
    {
        let sink = failpoint::WithFailpoint {
            inner: sink,
            at: failpoint::from_env().map_err(Exit::config)?,
        };
        run_query(
            self.settings,
            self.query_id,
            self.source,
            store,
            processor,
            sink,
            dead,
            sink_description,
        )
        .await
    }
}

fn console_format(json: bool) -> ConsoleFormat {
    if json {
        ConsoleFormat::Json
    } else {
        ConsoleFormat::Text
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_query<St, P, K, D>(
    settings: Settings,
    query_id: String,
    source: KafkaSource,
    store: St,
    processor: P,
    sink: K,
    dead: D,
    sink_description: String,
) -> Result<(), Exit>
where
    St: OffsetStore,
    St::Error: Classify,
    P: Processor,
    P::Error: Classify,
    K: Sink<P::Output>,
    D: Sink,
{
    let options = QueryOptions {
        name: settings.name.clone(),
        trigger: settings.trigger,
        starting: settings.starting.resolve(),
        max_offsets_per_trigger: settings.max_offsets_per_trigger,
        min_offsets_per_trigger: settings.min_offsets_per_trigger,
        fail_on_data_loss: settings.kafka.fail_on_data_loss,
        min_batches_to_retain: settings.min_batches_to_retain,
        source_description: settings.source_description.clone(),
        sink_description,
        retry: settings.retry,
        on_bad_record: settings.processing.on_bad_record,
    };
    let mut progress_file = match &settings.progress.file {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening the progress file {}", path.display()))
                .map_err(Exit::config)?,
        ),
        None => None,
    };
    if let Some(addr) = &settings.progress.metrics_addr {
        let addr = config::metrics_listen(addr).map_err(Exit::config)?;
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("serving metrics on {addr}"))
            .map_err(Exit::runtime)?;
        tracing::info!(%addr, "serving Prometheus metrics");
    }

    let stop = stop_on_signals();
    let mut query = Query::with_processor(options, query_id, source, store, processor, sink, dead);
    let on_progress = |progress: &QueryProgress| {
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
        if let Some(file) = progress_file.as_mut()
            && let Err(e) = file.write_all(format!("{}\n", progress.to_json()).as_bytes())
        {
            tracing::warn!(error = %e, "writing the progress file failed");
        }
        record_metrics(progress);
    };
    let summary = query.run(stop, on_progress).await.map_err(Exit::executor)?;
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

fn record_metrics(progress: &QueryProgress) {
    metrics::counter!("sluice_batches_total").increment(1);
    metrics::counter!("sluice_input_rows_total").increment(progress.num_input_rows);
    metrics::gauge!("sluice_batch_id").set(progress.batch_id as f64);
    metrics::gauge!("sluice_processed_rows_per_second").set(progress.processed_rows_per_second);
    metrics::histogram!("sluice_trigger_execution_ms")
        .record(progress.duration_ms.trigger_execution as f64);
    metrics::histogram!("sluice_wal_commit_ms").record(progress.duration_ms.wal_commit as f64);
    metrics::histogram!("sluice_commit_offsets_ms")
        .record(progress.duration_ms.commit_offsets as f64);
    // One operator per stateful query, so its name is a label of bounded
    // cardinality.
    for operator in &progress.state_operators {
        let name = operator.operator_name.clone();
        metrics::gauge!("sluice_state_rows", "operator" => name.clone())
            .set(operator.num_rows_total as f64);
        metrics::gauge!("sluice_state_memory_bytes", "operator" => name.clone())
            .set(operator.memory_used_bytes as f64);
        metrics::counter!("sluice_state_rows_updated_total", "operator" => name.clone())
            .increment(operator.num_rows_updated);
        metrics::counter!("sluice_state_rows_removed_total", "operator" => name.clone())
            .increment(operator.num_rows_removed);
        metrics::counter!("sluice_late_rows_dropped_total", "operator" => name.clone())
            .increment(operator.num_rows_dropped_by_watermark);
        metrics::histogram!("sluice_state_commit_ms", "operator" => name)
            .record(operator.commit_time_ms as f64);
    }
    if let Some(event_time) = &progress.event_time
        && let Some(watermark) = event_time.get("watermark")
        && let Ok(at) = humantime::parse_rfc3339(watermark)
        && let Ok(since) = at.duration_since(std::time::UNIX_EPOCH)
    {
        metrics::gauge!("sluice_watermark_ms").set(since.as_millis() as f64);
    }
    if let Some(source) = progress.sources.first() {
        for (name, metric) in [
            ("maxOffsetsBehindLatest", "sluice_max_offsets_behind_latest"),
            ("avgOffsetsBehindLatest", "sluice_avg_offsets_behind_latest"),
        ] {
            if let Some(value) = source.metrics.get(name).and_then(|v| v.parse::<f64>().ok()) {
                metrics::gauge!(metric).set(value);
            }
        }
        if let Some(lost) = source
            .metrics
            .get("dataLossOffsets")
            .and_then(|v| v.parse::<u64>().ok())
        {
            metrics::counter!("sluice_data_loss_offsets_total").increment(lost);
        }
    }
}

/// The first SIGINT or SIGTERM asks the query to stop after the batch in flight;
/// a second one exits at once (the write-ahead plan makes that safe too).
fn stop_on_signals() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut interrupt), Ok(mut terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot listen for signals; stop the query with SIGKILL");
            return;
        };
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        tracing::info!("stopping after the batch in flight; a second signal exits at once");
        let _ = tx.send(true);
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        eprintln!(
            "sluice: second signal, exiting at once; the batch in flight is replayed on restart"
        );
        std::process::exit(130);
    });
    rx
}

async fn validate(config: PathBuf) -> Result<(), Exit> {
    let settings = config::load(&config).map_err(Exit::config)?;
    if !settings.processing.is_pass_through() {
        let processor = processor(&settings).await?;
        if let SinkKind::Kafka(_) = &settings.sink {
            KafkaSink::check_rows(&processor.output_schema())
                .map_err(|e| Exit::config(e.into()))?;
        }
    }
    if let SinkKind::Kafka(sink) = &settings.sink {
        KafkaSink::check_options(sink).map_err(Classify::exit)?;
        KafkaSink::check_transaction_timeout(sink)
            .await
            .map_err(Classify::exit)?;
    }
    let mut source =
        KafkaSource::new(settings.kafka.clone(), "validate").map_err(|e| Exit::config(e.into()))?;
    let partitions = source.partitions().await.map_err(Classify::exit)?;
    let missing: Vec<String> = match &settings.kafka.selection {
        sluice_kafka_source::TopicSelection::Subscribe(topics) => topics
            .iter()
            .filter(|t| !partitions.keys().any(|tp| &tp.topic == *t))
            .cloned()
            .collect(),
        sluice_kafka_source::TopicSelection::Assign(assign) => assign
            .iter()
            .flat_map(|(t, ps)| {
                ps.iter()
                    .map(move |p| sluice_offsets::TopicPartition::new(t.as_str(), *p))
            })
            .filter(|tp| !partitions.contains_key(tp))
            .map(|tp| tp.to_string())
            .collect(),
        sluice_kafka_source::TopicSelection::SubscribePattern(_) => Vec::new(),
    };
    if !missing.is_empty() {
        return Err(Exit::config(anyhow::anyhow!(
            "{}: Kafka at {} has no {}",
            config.display(),
            settings.kafka.bootstrap_servers,
            missing.join(", ")
        )));
    }
    let checkpoint = match &settings.checkpoint {
        StoreKind::Directory(dir) => {
            if dir.join("metadata").exists() {
                Checkpoint::inspect(dir).map_err(Exit::checkpoint)?;
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
        settings.kafka.bootstrap_servers,
        partitions.len(),
        settings.source_description,
        checkpoint
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{MI_OPTION_PURGE_DELAY, error_chain};

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
