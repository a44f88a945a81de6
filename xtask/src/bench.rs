//! `cargo xtask bench`: Sluice end to end against a plain rdkafka consumer reading
//! the same topic on the same machine, in one run, with every figure a ratio to
//! that baseline. Results go to `target/bench/results.json`, a table in
//! `docs/benchmarks.md` and a chart in `docs/benchmarks-throughput.svg`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::cargo;

/// What to measure, from the command line.
pub struct BenchArgs {
    pub records: u64,
    pub partitions: u32,
    pub value_bytes: u32,
    pub runs: usize,
    /// Only the configurations whose name contains this.
    pub only: Option<String>,
}

impl BenchArgs {
    pub fn parse(args: &[String]) -> Result<BenchArgs> {
        let mut parsed = BenchArgs {
            records: 5_000_000,
            partitions: 8,
            value_bytes: 100,
            runs: 3,
            only: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            let number = || {
                value
                    .parse::<u64>()
                    .with_context(|| format!("{flag} {value:?} is not a number"))
            };
            match flag.as_str() {
                "--only" => parsed.only = Some(value.clone()),
                "--records" => parsed.records = number()?,
                "--partitions" => parsed.partitions = u32::try_from(number()?)?,
                "--value-bytes" => parsed.value_bytes = u32::try_from(number()?)?,
                "--runs" => parsed.runs = usize::try_from(number()?)?.max(1),
                other => bail!(
                    "unknown option {other}: use --records, --partitions, --value-bytes, --runs, \
                     --only"
                ),
            }
        }
        Ok(parsed)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Store {
    Directory,
    Cassandra,
}

struct Configuration {
    name: String,
    store: Store,
    sink: Output,
    max_offsets: Option<u64>,
    /// `[source]` lines and a `[query]`, for the SQL configurations.
    sql: Option<(&'static str, &'static str)>,
    /// For Kafka to Kafka: the `kafka` sink's `delivery`, to a topic of the
    /// run's own.
    kafka: Option<&'static str>,
}

/// Where a configuration's output goes, besides Kafka.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Discard,
    /// A JSON-lines file per batch.
    Jsonl,
    /// A Parquet table under Spark's file-sink log.
    Parquet,
    /// A Delta Lake table, a commit per batch.
    Delta,
}

/// The values' columns: `bench_tool fill` writes every value as such a JSON
/// order, padded with its note to the value size.
const ORDER_SCHEMA: &str = "order BIGINT, customer STRING, amount DOUBLE, note STRING";

/// JSON decoded, about half the rows filtered out, and a projection with a
/// function and arithmetic.
const ORDER_QUERY: &str = "SELECT order, upper(customer) AS customer, amount * 2 AS doubled, \
                           partition, offset FROM source WHERE amount > 500";

/// Keyed deduplication within the watermark, over the events: a key is a
/// user's number and the event's 10-second window, which is each event's own,
/// but every tenth event takes the key of the event before it (the user
/// before, in the same window), so 10% of the rows are duplicates.
const DEDUPE_QUERY: &str = "SELECT DISTINCT ON (CAST(substr(user, 2) AS BIGINT) - CASE WHEN \
                            amount % 10 = 0 AND user <> 'u00000' THEN 1 ELSE 0 END, \
                            date_bin(INTERVAL '10' SECOND, ts, TIMESTAMP '1970-01-01 00:00:00')) \
                            user, ts, amount FROM source";

/// The events joined with a lookup table of 1,000,000 customers in Parquet: a
/// key per user and amount's last two digits, so that the events probe the
/// whole table.
const LOOKUP_QUERY: &str = "SELECT e.user, e.ts, e.amount, c.name, c.segment, c.country \
                            FROM source e JOIN customers c \
                            ON CAST(substr(e.user, 2) AS BIGINT) * 100 + e.amount % 100 = c.id";

/// The rows of the lookup table: 100 per user of the events.
const LOOKUP_ROWS: u64 = 1_000_000;

/// The events of `bench_tool events`: a user, an event time and an amount.
const EVENT_SCHEMA: &str = "user STRING, ts TIMESTAMP, amount BIGINT";

/// A count and a sum per user in 10-second windows of the events' own time,
/// where every user has one event per window: a group per event, the
/// high-cardinality case.
const PER_USER_QUERY: &str = "SELECT window.start AS start, user, count(*) AS n, \
                              sum(amount) AS total FROM source \
                              GROUP BY window(ts, '10 seconds'), user";

/// The users of the events topic.
const EVENT_USERS: u64 = 10_000;

/// A count and a sum per key in 10-second tumbling windows of Kafka's
/// timestamp, over 10,000 keys, in append mode: state across batches.
const WINDOWED_QUERY: &str = "SELECT window.start AS start, order % 10000 AS key, count(*) AS n, \
                              sum(amount) AS total FROM source \
                              GROUP BY window(timestamp, '10 seconds'), order % 10000";

fn configurations() -> Vec<Configuration> {
    let mut all = Vec::new();
    for (store, sink, label) in [
        (Store::Directory, Output::Discard, "filesystem, discard"),
        (Store::Cassandra, Output::Discard, "cassandra, discard"),
        (Store::Directory, Output::Jsonl, "filesystem, jsonl"),
    ] {
        for max in [None, Some(100_000), Some(10_000)] {
            let size = max.map_or("default".to_owned(), |m| format!("{}k/trigger", m / 1000));
            all.push(Configuration {
                name: format!("{label}, {size}"),
                store,
                sink,
                max_offsets: max,
                sql: None,
                kafka: None,
            });
        }
    }
    // Kafka to Kafka, records as read, at least once and in a transaction per batch.
    for delivery in ["at_least_once", "exactly_once"] {
        for max in [None, Some(100_000)] {
            let size = max.map_or("default".to_owned(), |m| format!("{}k/trigger", m / 1000));
            all.push(Configuration {
                name: format!("kafka to kafka, {delivery}, {size}"),
                store: Store::Directory,
                sink: Output::Discard,
                max_offsets: max,
                sql: None,
                kafka: Some(delivery),
            });
        }
    }
    // SQL over the JSON values: Arrow and DataFusion with nothing decoded, then
    // decoding, filtering and projecting into each sink.
    for (name, sink, source, query, max_offsets) in [
        (
            "sql, SELECT * over raw, discard",
            Output::Discard,
            "",
            "SELECT * FROM source",
            None,
        ),
        (
            "sql, json + filter + projection, discard",
            Output::Discard,
            "json",
            ORDER_QUERY,
            None,
        ),
        (
            "sql, json + filter + projection, jsonl",
            Output::Jsonl,
            "json",
            ORDER_QUERY,
            None,
        ),
        (
            "sql, json + filter + projection, parquet",
            Output::Parquet,
            "json",
            ORDER_QUERY,
            None,
        ),
        (
            "sql, json + filter + projection, delta",
            Output::Delta,
            "json",
            ORDER_QUERY,
            None,
        ),
        (
            "sql, json + windowed count and sum over 10k keys, discard",
            Output::Discard,
            "json+watermark",
            WINDOWED_QUERY,
            // Many batches, so that state moves from batch to batch.
            Some(100_000),
        ),
        (
            "sql, json + keyed dedupe (DISTINCT ON), 10% duplicates, discard",
            Output::Discard,
            "events",
            DEDUPE_QUERY,
            Some(100_000),
        ),
        (
            // The same decoding without the deduplication: what it costs.
            "sql, json events without dedupe, the same columns, discard",
            Output::Discard,
            "events",
            "SELECT user, ts, amount FROM source",
            Some(100_000),
        ),
        (
            "sql, json events + lookup join with 1M-row Parquet table, discard",
            Output::Discard,
            "events+lookup",
            LOOKUP_QUERY,
            Some(100_000),
        ),
        (
            // The same key computed, without the table: what the join itself costs.
            "sql, json events + the lookup join's key, without the join, discard",
            Output::Discard,
            "events",
            "SELECT e.user, e.ts, e.amount, CAST(substr(e.user, 2) AS BIGINT) * 100 + \
             e.amount % 100 AS k FROM source e",
            Some(100_000),
        ),
        (
            "sql, json + count and sum per user and window, a group per event, discard, default",
            Output::Discard,
            "events",
            PER_USER_QUERY,
            // The defaults: the memory budget alone sizes the batches.
            None,
        ),
        (
            "sql, json + count and sum per user and window, a group per event, discard, 500k/trigger",
            Output::Discard,
            "events",
            PER_USER_QUERY,
            Some(500_000),
        ),
    ] {
        all.push(Configuration {
            name: name.to_owned(),
            store: Store::Directory,
            sink,
            max_offsets,
            sql: Some((source, query)),
            kafka: None,
        });
    }
    all
}

/// The measurements of one run of the baseline consumer.
struct Baseline {
    /// Over the whole process, start to exit, as `sluice run` is measured.
    records_per_second: f64,
    /// Over its read alone, from assignment to the last record.
    reading_records_per_second: f64,
    megabytes_per_second: f64,
    peak_rss_kib: u64,
}

/// The measurements of one run of one configuration.
struct Run {
    records_per_second: f64,
    /// Over the batches alone (their `triggerExecution`), startup excluded.
    batch_records_per_second: f64,
    /// `records_per_second` over the paired baseline run's.
    ratio: f64,
    /// `batch_records_per_second` over the paired baseline run's read alone.
    batch_ratio: f64,
    wal_commit_ms: Vec<f64>,
    commit_offsets_ms: Vec<f64>,
    /// Per batch, the sink's finish (`sinkCommit`: its flush and, exactly
    /// once, its transaction's commit) and that plus the store's commit.
    sink_commit_ms: Vec<f64>,
    sink_and_store_commit_ms: Vec<f64>,
    /// For Kafka to Kafka: `bench_tool pipe`, the same records consumed and
    /// produced by plain rdkafka clients, run just before, over the whole process.
    pipe_records_per_second: Option<f64>,
    /// Making each batch's state durable, for a stateful query.
    state_commit_ms: Vec<f64>,
    /// Writing the snapshots of the batches that had one, after their commits.
    snapshot_ms: Vec<f64>,
    /// The disk's own: the same atomic write of a delta-sized file, timed by
    /// the bench beside the run.
    disk_ms: Vec<f64>,
    /// The most groups the state held after a batch, and their size in memory.
    state_rows: u64,
    state_bytes: u64,
    peak_rss_kib: u64,
    peak_anon_kib: u64,
    restart_ms: f64,
}

/// Builds the release `sluice`, `bench_tool` and `latency_probe`; returns the
/// paths of the first two. One build for all three: built apart, the examples
/// would unify the shared crates' features differently and rebuild most of
/// them (arrow, datafusion) a second time.
pub fn build_release(root: &Path) -> Result<(PathBuf, PathBuf)> {
    cargo(
        root,
        &[
            "build",
            "--release",
            "-q",
            "-p",
            "sluice-runner",
            "--bin",
            "sluice",
            "-p",
            "sluice-examples",
            "--example",
            "bench_tool",
            "--example",
            "latency_probe",
        ],
    )?;
    let release = root.join("target").join("release");
    Ok((
        release.join("sluice"),
        release.join("examples").join("bench_tool"),
    ))
}

pub fn bench(root: &Path, args: &BenchArgs) -> Result<()> {
    let (sluice, tool) = build_release(root)?;
    let bootstrap = "127.0.0.1:9092";
    let topic = format!(
        "sluice-bench-{}p-{}r-{}b-orders",
        args.partitions, args.records, args.value_bytes
    );
    let events_topic = format!(
        "sluice-bench-{}p-{}r-{EVENT_USERS}u-events",
        args.partitions, args.records
    );
    let chosen: Vec<Configuration> = configurations()
        .into_iter()
        .filter(|c| {
            args.only
                .as_ref()
                .is_none_or(|o| c.name.contains(o.as_str()))
        })
        .collect();
    let on_events = |c: &Configuration| matches!(c.sql, Some(("events" | "events+lookup", _)));
    if chosen
        .iter()
        .any(|c| matches!(c.sql, Some(("events+lookup", _))))
    {
        fs::create_dir_all(root.join("target").join("bench"))?;
        let status = Command::new(&tool)
            .arg("lookup")
            .arg(lookup_table(root))
            .arg(LOOKUP_ROWS.to_string())
            .status()
            .context("running bench_tool lookup")?;
        if !status.success() {
            bail!("writing the lookup table failed");
        }
    }
    // Each topic is filled when a chosen configuration reads it.
    if chosen.iter().any(|c| !on_events(c)) {
        let status = Command::new(&tool)
            .args(["fill", bootstrap, &topic])
            .arg(args.partitions.to_string())
            .arg(args.records.to_string())
            .arg(args.value_bytes.to_string())
            .status()
            .context("running bench_tool fill")?;
        if !status.success() {
            bail!("filling {topic} failed");
        }
    }
    if chosen.iter().any(on_events) {
        let status = Command::new(&tool)
            .args(["events", bootstrap, &events_topic])
            .arg(args.partitions.to_string())
            .arg(args.records.to_string())
            .arg(EVENT_USERS.to_string())
            .status()
            .context("running bench_tool events")?;
        if !status.success() {
            bail!("filling {events_topic} failed");
        }
    }

    let topics_read: Vec<&str> = [
        (chosen.iter().any(|c| !on_events(c)), topic.as_str()),
        (chosen.iter().any(on_events), events_topic.as_str()),
    ]
    .into_iter()
    .filter_map(|(read, name)| read.then_some(name))
    .collect();

    let work = root.join("target").join("bench");
    fs::create_dir_all(&work)?;
    // The machine is noisy and its speed drifts over a run, so every run of a
    // configuration is paired with a baseline run just before it, and ratios are
    // taken within each pair.
    let mut baseline = Vec::new();
    let mut results = Vec::new();
    for configuration in chosen {
        let topic = if on_events(&configuration) {
            &events_topic
        } else {
            &topic
        };
        let mut runs = Vec::new();
        for run in 0..args.runs {
            let dir = work
                .join("work")
                .join(slug(&configuration.name))
                .join(run.to_string());
            if dir.exists() {
                fs::remove_dir_all(&dir)?;
            }
            fs::create_dir_all(&dir)?;
            let base = measure_baseline(&tool, bootstrap, topic)?;
            let mut measured = run_once(&sluice, &tool, &dir, &configuration, topic, bootstrap)?;
            measured.ratio = measured.records_per_second / base.records_per_second;
            measured.batch_ratio =
                measured.batch_records_per_second / base.reading_records_per_second;
            println!(
                "{} run {run}: {:.0} records/s (x{:.2} of the baseline's {:.0} just before), peak RSS {} MiB, restart {:.0} ms",
                configuration.name,
                measured.records_per_second,
                measured.ratio,
                base.records_per_second,
                measured.peak_rss_kib / 1024,
                measured.restart_ms
            );
            baseline.push(base);
            runs.push(measured);
        }
        results.push(summarise(&configuration, runs));
    }

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let command = format!(
        "cargo xtask bench --records {} --partitions {} --value-bytes {} --runs {}{}",
        args.records,
        args.partitions,
        args.value_bytes,
        args.runs,
        args.only
            .as_ref()
            .map(|o| format!(" --only {o:?}"))
            .unwrap_or_default()
    );
    let report = json!({
        "command": command,
        "cores": cores,
        "topic": topics_read.join("` and `"),
        "baseline": {
            "records_per_second": stats(baseline.iter().map(|b| b.records_per_second).collect()),
            "reading_records_per_second": stats(baseline.iter().map(|b| b.reading_records_per_second).collect()),
            "megabytes_per_second": stats(baseline.iter().map(|b| b.megabytes_per_second).collect()),
            "peak_rss_mib": stats(baseline.iter().map(|b| b.peak_rss_kib as f64 / 1024.0).collect()),
        },
        "configurations": results,
    });
    let results_path = work.join("results.json");
    fs::write(&results_path, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", results_path.display());
    let chart = match &args.only {
        None => root.join("docs").join("benchmarks-throughput.svg"),
        Some(_) => work.join("throughput.svg"),
    };
    let status = Command::new(&tool)
        .args(["chart"])
        .arg(&results_path)
        .arg(&chart)
        .status()?;
    if !status.success() {
        bail!("drawing the chart failed");
    }
    // A run of some configurations only has a section of its own, so that the
    // full table stays as the last full run left it.
    let section = match &args.only {
        None => "bench".to_owned(),
        Some(only) => format!("bench-{}", slug(only)),
    };
    write_markdown(&root.join("docs").join("benchmarks.md"), &report, &section)?;
    Ok(())
}

/// The Parquet lookup table of the lookup join's configuration.
fn lookup_table(root: &Path) -> PathBuf {
    root.join("target")
        .join("bench")
        .join(format!("customers-{LOOKUP_ROWS}.parquet"))
}

pub fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

fn run_once(
    sluice: &Path,
    tool: &Path,
    dir: &Path,
    configuration: &Configuration,
    topic: &str,
    bootstrap: &str,
) -> Result<Run> {
    let checkpoint = checkpoint(configuration.store == Store::Cassandra, dir);
    let out_topic = format!("{topic}-out-{}", uuid_like());
    let pipe_records_per_second = match configuration.kafka {
        None => None,
        Some(_) => {
            // As many partitions as the input, so that neither side is the narrower.
            let partitions = topic
                .split('-')
                .find_map(|part| part.strip_suffix('p').and_then(|n| n.parse::<u32>().ok()))
                .unwrap_or(8)
                .to_string();
            bench_tool(tool, &["create", bootstrap, &out_topic, &partitions])?;
            Some(measure_pipe(
                tool,
                bootstrap,
                topic,
                &out_topic,
                &partitions,
            )?)
        }
    };
    let sink = if let Some(delivery) = configuration.kafka {
        format!("type = \"kafka\"\ntopic = \"{out_topic}\"\ndelivery = \"{delivery}\"")
    } else if configuration.sink == Output::Jsonl {
        format!("type = \"jsonl\"\npath = \"{}\"", dir.join("out").display())
    } else if configuration.sink == Output::Parquet {
        format!(
            "type = \"parquet\"\npath = \"{}\"",
            dir.join("out").display()
        )
    } else if configuration.sink == Output::Delta {
        format!("type = \"delta\"\npath = \"{}\"", dir.join("out").display())
    } else {
        "type = \"discard\"".to_owned()
    };
    let max = configuration
        .max_offsets
        .map(|m| format!("max_offsets_per_trigger = {m}"))
        .unwrap_or_default();
    let (format, query) = match configuration.sql {
        None => (String::new(), String::new()),
        Some(("json", sql)) => (
            format!("format = \"json\"\nschema = \"{ORDER_SCHEMA}\"\n"),
            format!("[query]\nsql = \"{sql}\"\n"),
        ),
        Some(("json+watermark", sql)) => (
            format!("format = \"json\"\nschema = \"{ORDER_SCHEMA}\"\nwatermark_delay = \"5s\"\n"),
            format!("[query]\nsql = \"{sql}\"\n"),
        ),
        Some(("events", sql)) => (
            format!(
                "format = \"json\"\nschema = \"{EVENT_SCHEMA}\"\nevent_time = \"ts\"\n\
                 watermark_delay = \"5s\"\n"
            ),
            format!("[query]\nsql = \"{sql}\"\n"),
        ),
        Some(("events+lookup", sql)) => (
            format!(
                "format = \"json\"\nschema = \"{EVENT_SCHEMA}\"\nevent_time = \"ts\"\n\
                 watermark_delay = \"5s\"\n"
            ),
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"parquet\"\n\n\
                 [query]\nsql = \"{sql}\"\n",
                lookup_table(&crate::workspace_root()).display()
            ),
        ),
        Some((_, sql)) => (String::new(), format!("[query]\nsql = \"{sql}\"\n")),
    };
    let progress = dir.join("progress.jsonl");
    let config = dir.join("query.toml");
    fs::write(
        &config,
        format!(
            "[source]\nbootstrap_servers = \"{bootstrap}\"\nsubscribe = [\"{topic}\"]\nstarting_offsets = \"earliest\"\n{max}\n{format}\n\
             [checkpoint]\n{checkpoint}\n\n[trigger]\navailable_now = true\n\n[sink]\n{sink}\n\n\
             [progress]\nfile = \"{}\"\n\n{query}",
            progress.display()
        ),
    )?;

    let stateful = matches!(configuration.sql, Some(("json+watermark" | "events", _)));
    let stop = Arc::new(AtomicBool::new(false));
    let disk = stateful.then(|| {
        let (dir, stop) = (dir.join("disk-baseline"), stop.clone());
        std::thread::spawn(move || disk_baseline(&dir, &stop))
    });
    let started = Instant::now();
    let mut child = Command::new(sluice)
        .args(["run", "--config"])
        .arg(&config)
        .env("SLUICE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    let (peak_rss_kib, peak_anon_kib) = watch_memory(&mut child)?;
    let status = child.wait()?;
    stop.store(true, Ordering::Relaxed);
    let disk_ms = match disk {
        Some(thread) => thread
            .join()
            .map_err(|_| anyhow::anyhow!("the disk baseline thread panicked"))??,
        None => Vec::new(),
    };
    let seconds = started.elapsed().as_secs_f64();
    if !status.success() {
        bail!(
            "sluice run failed for {} ({status}); see {}",
            configuration.name,
            config.display()
        );
    }
    let lines: Vec<Value> = fs::read_to_string(&progress)?
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let records: f64 = lines
        .iter()
        .map(|p| p["numInputRows"].as_f64().unwrap_or(0.0))
        .sum();
    // Microseconds, reported in milliseconds: an fsync takes well under one.
    let durations = |field: &str| -> Vec<f64> {
        lines
            .iter()
            .filter_map(|p| p["durationMicros"][field].as_f64())
            .map(|us| us / 1000.0)
            .collect()
    };
    let batch_seconds: f64 = durations("triggerExecution").iter().sum::<f64>() / 1000.0;
    let sink_commit_ms = durations("sinkCommit");
    let sink_and_store_commit_ms: Vec<f64> = sink_commit_ms
        .iter()
        .zip(durations("commitOffsets"))
        .map(|(sink, store)| sink + store)
        .collect();
    let state = |field: &str| -> Vec<f64> {
        lines
            .iter()
            .filter_map(|p| p["stateOperators"][0][field].as_f64())
            .collect()
    };
    let state_commit_ms: Vec<f64> = lines
        .iter()
        .filter_map(|p| p["stateOperators"][0]["customMetrics"]["commitTimeMicros"].as_f64())
        .map(|us| us / 1000.0)
        .collect();
    let snapshot_ms: Vec<f64> = lines
        .iter()
        .map(|p| &p["stateOperators"][0]["customMetrics"])
        .filter(|m| m["snapshotFileBytes"].as_u64().unwrap_or(0) > 0)
        .filter_map(|m| m["snapshotTimeMicros"].as_f64())
        .map(|us| us / 1000.0)
        .collect();
    let state_rows = state("numRowsTotal").into_iter().fold(0.0, f64::max) as u64;
    let state_bytes = state("memoryUsedBytes").into_iter().fold(0.0, f64::max) as u64;

    // Restart: move the query back by one partition's worth of a small batch, then
    // time a fresh process until its first batch is committed.
    let show = Command::new(sluice)
        .args(["offsets", "show", "--checkpoint", &location_of(&checkpoint)])
        .output()?;
    let shown: Value = serde_json::from_slice(&show.stdout).context("reading offsets show")?;
    let ends = &shown["lastCommitted"]["endOffsets"][topic];
    let back = ends["0"].as_i64().unwrap_or(0).saturating_sub(1000).max(0);
    let set = Command::new(sluice)
        .args([
            "offsets",
            "set",
            "--checkpoint",
            &location_of(&checkpoint),
            // A stateful query's state starts empty at the moved offsets.
            "--reset-state",
            "--offsets",
        ])
        .arg(format!("{{\"{topic}\":{{\"0\":{back}}}}}"))
        .output()?;
    if !set.status.success() {
        bail!(
            "offsets set failed: {}",
            String::from_utf8_lossy(&set.stderr)
        );
    }
    let before = fs::read_to_string(&progress)?.lines().count();
    let restart_started = Instant::now();
    let mut restarted = Command::new(sluice)
        .args(["run", "--config"])
        .arg(&config)
        .env("SLUICE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    let restart_ms = loop {
        if fs::read_to_string(&progress)?.lines().count() > before {
            break restart_started.elapsed().as_secs_f64() * 1000.0;
        }
        if restarted.try_wait()?.is_some()
            && fs::read_to_string(&progress)?.lines().count() == before
        {
            bail!(
                "the restarted run of {} committed no batch",
                configuration.name
            );
        }
        if restart_started.elapsed() > Duration::from_secs(60) {
            let _ = restarted.kill();
            bail!(
                "the restarted run of {} did not commit a batch within 60 s",
                configuration.name
            );
        }
        sleep(Duration::from_millis(2));
    };
    restarted.wait()?;

    if configuration.kafka.is_some() {
        // A run's output is as large as its input: it goes once measured.
        bench_tool(tool, &["delete", bootstrap, &out_topic])?;
    }
    Ok(Run {
        records_per_second: records / seconds,
        batch_records_per_second: records / batch_seconds,
        ratio: f64::NAN,
        batch_ratio: f64::NAN,
        wal_commit_ms: durations("walCommit"),
        commit_offsets_ms: durations("commitOffsets"),
        sink_commit_ms,
        sink_and_store_commit_ms,
        pipe_records_per_second,
        state_commit_ms,
        snapshot_ms,
        disk_ms,
        state_rows,
        state_bytes,
        peak_rss_kib,
        peak_anon_kib,
        restart_ms,
    })
}

/// The write a batch's state delta costs, without Sluice: a 48 KiB file (a
/// 10,000-group delta is 47 KB) written to a temporary name, fsynced, linked
/// into place and its directory fsynced, every 100 ms (about a batch's pace)
/// until `stop`. Timed beside the run, so that it meets the same disk.
fn disk_baseline(dir: &Path, stop: &AtomicBool) -> Result<Vec<f64>> {
    use std::io::Write;
    fs::create_dir_all(dir)?;
    let bytes: Vec<u8> = (0..48 * 1024).map(|i| (i * 7 % 251) as u8).collect();
    let mut millis = Vec::new();
    let mut n = 0_u64;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let temp = dir.join(format!(".{n}.tmp"));
        let mut file = fs::File::create_new(&temp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        fs::hard_link(&temp, dir.join(format!("{n}.delta")))?;
        fs::remove_file(&temp)?;
        fs::File::open(dir)?.sync_all()?;
        millis.push(started.elapsed().as_secs_f64() * 1000.0);
        n += 1;
        sleep(Duration::from_millis(100));
    }
    fs::remove_dir_all(dir)?;
    Ok(millis)
}

fn location_of(checkpoint_line: &str) -> String {
    checkpoint_line
        .split('"')
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

pub fn uuid_like() -> String {
    format!(
        "bench_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default()
    )
}

/// Runs `bench_tool` with `args` to its end; returns what it printed.
pub(crate) fn bench_tool(tool: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let output = Command::new(tool).args(args).output()?;
    if !output.status.success() {
        bail!(
            "bench_tool {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(output.stdout)
}

/// One run of `bench_tool pipe` from `topic` into a topic of its own, named
/// after `like`, of `partitions` partitions (deleted after it): records/s over
/// the whole process.
fn measure_pipe(
    tool: &Path,
    bootstrap: &str,
    topic: &str,
    like: &str,
    partitions: &str,
) -> Result<f64> {
    let out = format!("{like}-pipe");
    bench_tool(tool, &["create", bootstrap, &out, partitions])?;
    let started = Instant::now();
    let printed = bench_tool(tool, &["pipe", bootstrap, topic, &out])?;
    let wall = started.elapsed().as_secs_f64();
    bench_tool(tool, &["delete", bootstrap, &out])?;
    let figures: Value = serde_json::from_slice(&printed)?;
    Ok(figures["records"].as_f64().unwrap_or(0.0) / wall)
}

/// One run of the baseline consumer, timed like `sluice run`: the whole
/// process, start to exit.
fn measure_baseline(tool: &Path, bootstrap: &str, topic: &str) -> Result<Baseline> {
    let started = Instant::now();
    let mut child = Command::new(tool)
        .args(["consume", bootstrap, topic])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let peak_rss_kib = watch_peak_rss(&mut child)?;
    let output = child.wait_with_output()?;
    let wall = started.elapsed().as_secs_f64();
    if !output.status.success() {
        bail!(
            "the baseline consumer failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let figures: Value = serde_json::from_slice(&output.stdout)?;
    let reading = figures["seconds"].as_f64().unwrap_or(f64::NAN);
    let records = figures["records"].as_f64().unwrap_or(0.0);
    let bytes = figures["bytes"].as_f64().unwrap_or(0.0);
    Ok(Baseline {
        records_per_second: records / wall,
        reading_records_per_second: records / reading,
        megabytes_per_second: bytes / reading / 1e6,
        peak_rss_kib,
    })
}

/// Samples the peak RSS of `child` until it exits; returns the highest, in KiB.
pub fn watch_peak_rss(child: &mut std::process::Child) -> Result<u64> {
    Ok(watch_memory(child)?.0)
}

/// Samples the memory of `child` until it exits: its peak RSS (`VmHWM`), and
/// the highest anonymous part seen (`RssAnon`, the memory of its own, without
/// the pages of its binary and libraries that the page cache shares), in KiB.
pub fn watch_memory(child: &mut std::process::Child) -> Result<(u64, u64)> {
    let (mut peak, mut anon) = (0, 0);
    loop {
        if let Some(kib) = peak_rss(child.id(), "VmHWM:") {
            peak = kib.max(peak);
        }
        if let Some(kib) = peak_rss(child.id(), "RssAnon:") {
            anon = kib.max(anon);
        }
        if child.try_wait()?.is_some() {
            return Ok((peak, anon));
        }
        sleep(Duration::from_millis(10));
    }
}

/// A memory figure of a running process from `/proc/<pid>/status`, in KiB:
/// `VmHWM:` for the peak resident set size, `VmRSS:` for the current one.
pub fn peak_rss(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The middle value, or the mean of the two middle ones: with two runs, the
/// higher of them alone made every two-run table look better than it was.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

pub fn percentile(mut values: Vec<f64>, q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    if values.is_empty() {
        return f64::NAN;
    }
    values[((values.len() - 1) as f64 * q).round() as usize]
}

fn stats(values: Vec<f64>) -> Value {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({"median": median(values), "min": min, "max": max})
}

fn summarise(configuration: &Configuration, runs: Vec<Run>) -> Value {
    let rates: Vec<f64> = runs.iter().map(|r| r.records_per_second).collect();
    let batch_rates: Vec<f64> = runs.iter().map(|r| r.batch_records_per_second).collect();
    let wal: Vec<f64> = runs.iter().flat_map(|r| r.wal_commit_ms.clone()).collect();
    let commit: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.commit_offsets_ms.clone())
        .collect();
    json!({
        "name": configuration.name,
        "records_per_second": stats(rates.clone()),
        "ratio_to_baseline": median(runs.iter().map(|r| r.ratio).collect()),
        "batch_records_per_second": stats(batch_rates.clone()),
        "batch_ratio_to_baseline_reading": median(runs.iter().map(|r| r.batch_ratio).collect()),
        "wal_commit_ms": {"p50": percentile(wal.clone(), 0.5), "p99": percentile(wal, 0.99)},
        "commit_offsets_ms": {"p50": percentile(commit.clone(), 0.5), "p99": percentile(commit, 0.99)},
        "kafka": kafka_summary(&runs),
        "peak_rss_mib": stats(runs.iter().map(|r| r.peak_rss_kib as f64 / 1024.0).collect()),
        "peak_anon_mib": stats(runs.iter().map(|r| r.peak_anon_kib as f64 / 1024.0).collect()),
        "restart_ms": stats(runs.iter().map(|r| r.restart_ms).collect()),
        "state": state_summary(&runs),
        "runs": runs.len(),
    })
}

/// A Kafka to Kafka configuration's figures beside the plain clients' pipe,
/// and its commits; `null` for others.
fn kafka_summary(runs: &[Run]) -> Value {
    let pipe: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.pipe_records_per_second)
        .collect();
    if pipe.is_empty() {
        return Value::Null;
    }
    let ratios: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.pipe_records_per_second.map(|p| r.records_per_second / p))
        .collect();
    let sink: Vec<f64> = runs.iter().flat_map(|r| r.sink_commit_ms.clone()).collect();
    let both: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.sink_and_store_commit_ms.clone())
        .collect();
    json!({
        "pipe_records_per_second": stats(pipe),
        "ratio_to_pipe": median(ratios),
        "sink_commit_ms": {"p50": percentile(sink.clone(), 0.5), "p99": percentile(sink, 0.99)},
        "sink_and_store_commit_ms": {"p50": percentile(both.clone(), 0.5), "p99": percentile(both, 0.99)},
    })
}

/// A stateful configuration's state: commit time and size; `null` for others.
fn state_summary(runs: &[Run]) -> Value {
    let commits: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.state_commit_ms.clone())
        .collect();
    if commits.is_empty() {
        return Value::Null;
    }
    let snapshots: Vec<f64> = runs.iter().flat_map(|r| r.snapshot_ms.clone()).collect();
    let disk: Vec<f64> = runs.iter().flat_map(|r| r.disk_ms.clone()).collect();
    json!({
        "commit_ms": {"p50": percentile(commits.clone(), 0.5), "p99": percentile(commits, 0.99)},
        "disk_ms": {
            "p50": percentile(disk.clone(), 0.5),
            "p99": percentile(disk.clone(), 0.99),
            "count": disk.len(),
        },
        "snapshot_ms": {
            "p50": percentile(snapshots.clone(), 0.5),
            "p99": percentile(snapshots.clone(), 0.99),
            "count": snapshots.len(),
        },
        "rows": runs.iter().map(|r| r.state_rows).max(),
        "memory_mib": runs.iter().map(|r| r.state_bytes).max().map(|b| b as f64 / 1_048_576.0),
    })
}

fn write_markdown(path: &Path, report: &Value, section: &str) -> Result<()> {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let base = &report["baseline"];
    let mut table = format!(
        "Measured with `{}` on a machine with {} cores, against topic `{}`.\n\n\
         Baseline, a plain rdkafka consumer reading every partition to its end, run once before \
         every run of a configuration: {:.0} records/s over the whole process (min {:.0}, max \
         {:.0}); {:.0} records/s and {:.1} MB/s while reading; peak RSS {:.0} MiB. Each ratio is \
         the median, over a configuration's runs, of its rate over the rate of the baseline run \
         just before it.\n\n\
         Peak RSS counts the pages of the binary it ran, which the page cache shares; the \
         anonymous part is the memory of its own.\n\n\
         | configuration | records/s, whole process (median, min–max) | ratio to baseline | records/s in batches | ratio to baseline reading | walCommit p50/p99 ms | commitOffsets p50/p99 ms | peak RSS MiB | of it anonymous MiB | restart to first commit ms |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        report["command"].as_str().unwrap_or_default(),
        report["cores"],
        report["topic"].as_str().unwrap_or_default(),
        f(&base["records_per_second"]["median"]),
        f(&base["records_per_second"]["min"]),
        f(&base["records_per_second"]["max"]),
        f(&base["reading_records_per_second"]["median"]),
        f(&base["megabytes_per_second"]["median"]),
        f(&base["peak_rss_mib"]["median"]),
    );
    for c in report["configurations"].as_array().into_iter().flatten() {
        table.push_str(&format!(
            "| {} | {:.0} ({:.0}–{:.0}) | {:.2} | {:.0} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.0} ({:.0}–{:.0}) | {:.0} | {:.0} |\n",
            c["name"].as_str().unwrap_or_default(),
            f(&c["records_per_second"]["median"]),
            f(&c["records_per_second"]["min"]),
            f(&c["records_per_second"]["max"]),
            f(&c["ratio_to_baseline"]),
            f(&c["batch_records_per_second"]["median"]),
            f(&c["batch_ratio_to_baseline_reading"]),
            f(&c["wal_commit_ms"]["p50"]),
            f(&c["wal_commit_ms"]["p99"]),
            f(&c["commit_offsets_ms"]["p50"]),
            f(&c["commit_offsets_ms"]["p99"]),
            f(&c["peak_rss_mib"]["median"]),
            f(&c["peak_rss_mib"]["min"]),
            f(&c["peak_rss_mib"]["max"]),
            f(&c["peak_anon_mib"]["median"]),
            f(&c["restart_ms"]["median"]),
        ));
    }
    let stateful: Vec<&Value> = report["configurations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| !c["state"].is_null())
        .collect();
    if !stateful.is_empty() {
        table.push_str(
            "\nState of the stateful configurations: the time to make each batch's state \
             durable (its delta written and fsynced before its commit); the same write of a \
             48 KiB file timed by the bench beside each run, every 100 ms (the disk's baseline); \
             the time to write the snapshot of every tenth batch (after its commit); and the most \
             groups held after a batch, with their size in memory, beside the peak RSS.\n\n\
             | configuration | state commit p50/p99 ms | disk baseline p50/p99 ms (writes) | snapshot write p50/p99 ms (count) | groups held, most | state in memory MiB | peak RSS MiB |\n\
             | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for c in stateful {
            table.push_str(&format!(
                "| {} | {:.2} / {:.2} | {:.2} / {:.2} ({}) | {:.2} / {:.2} ({}) | {} | {:.1} | {:.0} |\n",
                c["name"].as_str().unwrap_or_default(),
                f(&c["state"]["commit_ms"]["p50"]),
                f(&c["state"]["commit_ms"]["p99"]),
                f(&c["state"]["disk_ms"]["p50"]),
                f(&c["state"]["disk_ms"]["p99"]),
                c["state"]["disk_ms"]["count"],
                f(&c["state"]["snapshot_ms"]["p50"]),
                f(&c["state"]["snapshot_ms"]["p99"]),
                c["state"]["snapshot_ms"]["count"],
                c["state"]["rows"],
                f(&c["state"]["memory_mib"]),
                f(&c["peak_rss_mib"]["median"]),
            ));
        }
    }
    let kafka: Vec<&Value> = report["configurations"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| !c["kafka"].is_null())
        .collect();
    if !kafka.is_empty() {
        table.push_str(
            "\nKafka to Kafka beside `bench_tool pipe`, the same records consumed and produced \
             (idempotent, `acks=all`, the same three headers) by plain rdkafka clients with \
             nothing planned, stored or committed, run just before each run; and per batch, \
             the sink's finish (`sinkCommit`: its flush and, exactly once, the transaction's \
             commit) alone and with the store's commit after it.\n\n\
             | configuration | records/s | ratio to the consumer | pipe records/s | ratio to the pipe | sink commit p50/p99 ms | sink + store commit p50/p99 ms |\n\
             | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for c in kafka {
            table.push_str(&format!(
                "| {} | {:.0} | {:.2} | {:.0} | {:.2} | {:.2} / {:.2} | {:.2} / {:.2} |\n",
                c["name"].as_str().unwrap_or_default(),
                f(&c["records_per_second"]["median"]),
                f(&c["ratio_to_baseline"]),
                f(&c["kafka"]["pipe_records_per_second"]["median"]),
                f(&c["kafka"]["ratio_to_pipe"]),
                f(&c["kafka"]["sink_commit_ms"]["p50"]),
                f(&c["kafka"]["sink_commit_ms"]["p99"]),
                f(&c["kafka"]["sink_and_store_commit_ms"]["p50"]),
                f(&c["kafka"]["sink_and_store_commit_ms"]["p99"]),
            ));
        }
    }
    if section == "bench" {
        table.push_str("\n![throughput per configuration](benchmarks-throughput.svg)\n");
    }
    replace_section(path, section, &table)
}

/// Replaces what lies between `<!-- NAME:start -->` and `<!-- NAME:end -->` in
/// the file at `path` with `text`, or appends the section.
pub fn replace_section(path: &Path, name: &str, text: &str) -> Result<()> {
    let old = fs::read_to_string(path).unwrap_or_default();
    let (start, end) = (
        format!("<!-- {name}:start -->"),
        format!("<!-- {name}:end -->"),
    );
    let new = match (old.find(&start), old.find(&end)) {
        (Some(s), Some(e)) if s < e => format!("{}{start}\n{text}{}", &old[..s], &old[e..]),
        _ => format!("{old}\n{start}\n{text}{end}\n"),
    };
    fs::write(path, new)?;
    println!("updated {}", path.display());
    Ok(())
}

/// A `[checkpoint]` table: a directory in `dir`, or a new Cassandra query.
pub(crate) fn checkpoint(cassandra: bool, dir: &Path) -> String {
    if cassandra {
        format!(
            "location = \"cassandra://127.0.0.1:9042/sluice_bench?query={}\"\nreplication = \"{{'class': 'SimpleStrategy', 'replication_factor': 1}}\"",
            uuid_like()
        )
    } else {
        format!("location = \"{}\"", dir.join("checkpoint").display())
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![1.02, 1.54]), 1.28);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }
}
