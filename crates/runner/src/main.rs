//! `sluice`: reads the configuration and the command line, builds the source, the
//! offset store and the sink, and hands them to the executor.
//!
//! Exit codes: 0 done (or stopped by a signal), 1 a runtime failure (Kafka
//! unreachable, the sink failing, I/O), 2 bad configuration or command line,
//! 3 data loss with `fail_on_data_loss = true`, 4 an unusable checkpoint (held by
//! another runner, damaged or inconsistent), 130 a second interrupt.

mod config;
mod exit;
mod offsets_cmd;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use sluice_cassandra_store::CassandraStore;
use sluice_checkpoint_fs::Checkpoint;
use sluice_executor::sinks::{ConsoleFormat, ConsoleSink, JsonlSink};
use sluice_executor::{Query, QueryOptions, QueryProgress};
use sluice_kafka_source::KafkaSource;
use sluice_offsets::{OffsetStore, Sink, Source};
use tokio::sync::watch;

use config::{Settings, SinkKind, StoreKind};
use exit::Exit;

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

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    init_logging(cli.log_format);
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
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(exit) => {
            tracing::error!("{:#}", exit.error);
            eprintln!("sluice: {:#}", exit.error);
            ExitCode::from(exit.code)
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn run(config: PathBuf) -> Result<(), Exit> {
    let settings = config::load(&config).map_err(Exit::config)?;
    match settings.checkpoint.clone() {
        StoreKind::Directory(dir) => {
            let shown = dir.display().to_string();
            let checkpoint = tokio::task::spawn_blocking(move || Checkpoint::open(dir))
                .await
                .map_err(|e| Exit::runtime(anyhow::anyhow!("opening the checkpoint: {e}")))?
                .map_err(Exit::checkpoint)?;
            let query_id = checkpoint.id().to_owned();
            with_store(settings, query_id, checkpoint, shown).await
        }
        StoreKind::Cassandra(location, options) => {
            let shown = format!("cassandra {}/{}", location.keyspace, location.query);
            let store = CassandraStore::open(location, *options)
                .await
                .map_err(Exit::cassandra)?;
            let query_id = store.id().to_owned();
            with_store(settings, query_id, store, shown).await
        }
    }
}

/// Builds the source and the sink around an opened offset store, and runs.
async fn with_store<St: OffsetStore>(
    settings: Settings,
    query_id: String,
    store: St,
    shown: String,
) -> Result<(), Exit> {
    let source =
        KafkaSource::new(settings.kafka.clone(), &query_id).map_err(|e| Exit::config(e.into()))?;
    tracing::info!(query = %query_id, offsets = %shown, "starting");
    match settings.sink.clone() {
        SinkKind::Discard => {
            let sink = sluice_executor::sinks::DiscardSink;
            run_query(settings, query_id, source, store, sink, "discard".into()).await
        }
        SinkKind::Console { json } => {
            let format = if json {
                ConsoleFormat::Json
            } else {
                ConsoleFormat::Text
            };
            let sink = ConsoleSink::new(format);
            run_query(settings, query_id, source, store, sink, "console".into()).await
        }
        SinkKind::Kafka(config) => {
            let description = format!("kafka[{}]", config.topic);
            let sink = sluice_kafka_source::KafkaSink::new(config, &query_id)
                .map_err(|e| Exit::config(e.into()))?;
            run_query(settings, query_id, source, store, sink, description).await
        }
        SinkKind::Cassandra(config) => {
            let description = format!("cassandra[{}.{}]", config.keyspace, config.table);
            let sink = sluice_cassandra_store::CassandraSink::new(config)
                .await
                .map_err(Exit::cassandra)?;
            run_query(settings, query_id, source, store, sink, description).await
        }
        SinkKind::Jsonl { path } => {
            let sink = JsonlSink::new(&path).map_err(|e| Exit::runtime(e.into()))?;
            let description = format!("jsonl[{}]", path.display());
            run_query(settings, query_id, source, store, sink, description).await
        }
    }
}

async fn run_query<St: OffsetStore, K: Sink>(
    settings: Settings,
    query_id: String,
    source: KafkaSource,
    store: St,
    sink: K,
    sink_description: String,
) -> Result<(), Exit> {
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
        let addr: std::net::SocketAddr = addr
            .parse()
            .with_context(|| format!("progress.metrics_addr {addr:?} is not host:port"))
            .map_err(Exit::config)?;
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("serving metrics on {addr}"))
            .map_err(Exit::runtime)?;
        tracing::info!(%addr, "serving Prometheus metrics");
    }

    let stop = stop_on_signals();
    let mut query = Query::new(options, query_id, source, store, sink);
    let on_progress = |progress: &QueryProgress| {
        if let Some(file) = progress_file.as_mut()
            && let Err(e) = writeln!(file, "{}", progress.to_json())
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
    let mut source =
        KafkaSource::new(settings.kafka.clone(), "validate").map_err(|e| Exit::config(e.into()))?;
    let partitions = source
        .partitions()
        .await
        .map_err(|e| Exit::runtime(e.into()))?;
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
