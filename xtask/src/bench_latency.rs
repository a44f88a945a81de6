//! `cargo xtask bench latency`: how long a record takes from its producer to
//! where a reader of Sluice's output sees it.
//!
//! For each rate and configuration: a fresh topic, `sluice run` on it with
//! `processing_time = "0s"` or the continuous trigger, a producer stamping each record with its send
//! time at a fixed rate (`examples/latency_probe.rs stamp`), a reader of the
//! sink's output, and beside it a reader of the input topic itself: Kafka's own
//! latency in the same run, the floor under Sluice's. Figures go to
//! `target/bench/latency.json` and `docs/benchmarks.md`, the histograms of one
//! rate to `docs/benchmarks-latency.svg`.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{bench_tool, build_release, checkpoint, percentile, replace_section, slug};
use crate::bench_scale::progress_lines;

const BOOTSTRAP: &str = "127.0.0.1:9092";

/// The rate whose histograms the chart shows: the one the target names.
const CHART_RATE: u64 = 10_000;

/// What `bench latency` measures.
pub struct LatencyArgs {
    pub rates: Vec<u64>,
    pub seconds: u64,
    /// Seconds of records sent before the measured ones, which no figure counts.
    pub warm_up: u64,
    pub partitions: u32,
    /// How many times each configuration runs at each rate; the run with the
    /// median p99 is reported.
    pub runs: usize,
    /// Only the configurations whose name contains this.
    pub only: Option<String>,
}

impl LatencyArgs {
    pub fn parse(args: &[String]) -> Result<LatencyArgs> {
        let mut parsed = LatencyArgs {
            rates: vec![100, 10_000, 100_000],
            seconds: 10,
            warm_up: 1,
            partitions: 8,
            runs: 1,
            only: None,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            let number = |v: &str| {
                v.trim()
                    .parse::<u64>()
                    .with_context(|| format!("{flag} {v:?} is not a number"))
            };
            match flag.as_str() {
                "--rates" => {
                    parsed.rates = value.split(',').map(number).collect::<Result<_>>()?;
                    if parsed.rates.contains(&0) {
                        bail!("--rates: every rate must be at least one record a second");
                    }
                }
                "--seconds" => parsed.seconds = number(value)?.max(1),
                "--warm-up" => parsed.warm_up = number(value)?,
                "--partitions" => parsed.partitions = u32::try_from(number(value)?)?.max(1),
                "--runs" => parsed.runs = usize::try_from(number(value)?)?.max(1),
                "--only" => parsed.only = Some(value.clone()),
                other => bail!(
                    "unknown option {other}: use --rates 100,10000,100000, --seconds N, \
                     --warm-up N, --partitions P, --runs N, --only NAME"
                ),
            }
        }
        Ok(parsed)
    }
}

#[derive(Clone, Copy)]
enum Output {
    Jsonl,
    Kafka(&'static str),
}

struct Configuration {
    name: &'static str,
    cassandra: bool,
    output: Output,
    /// The `[trigger]` line.
    trigger: &'static str,
}

const MICRO_BATCH: &str = "processing_time = \"0s\"";

const CONFIGURATIONS: [Configuration; 7] = [
    Configuration {
        name: "filesystem, jsonl",
        cassandra: false,
        output: Output::Jsonl,
        trigger: MICRO_BATCH,
    },
    Configuration {
        name: "cassandra, jsonl",
        cassandra: true,
        output: Output::Jsonl,
        trigger: MICRO_BATCH,
    },
    Configuration {
        name: "filesystem, kafka at_least_once",
        cassandra: false,
        output: Output::Kafka("at_least_once"),
        trigger: MICRO_BATCH,
    },
    Configuration {
        name: "filesystem, kafka exactly_once",
        cassandra: false,
        output: Output::Kafka("exactly_once"),
        trigger: MICRO_BATCH,
    },
    Configuration {
        name: "cassandra, kafka exactly_once",
        cassandra: true,
        output: Output::Kafka("exactly_once"),
        trigger: MICRO_BATCH,
    },
    // Spark's continuous processing: records go to the sink as they arrive,
    // and each epoch of a second is committed as a batch.
    Configuration {
        name: "continuous 1s, filesystem, kafka at_least_once",
        cassandra: false,
        output: Output::Kafka("at_least_once"),
        trigger: "continuous = \"1s\"",
    },
    Configuration {
        name: "continuous 1s, cassandra, kafka at_least_once",
        cassandra: true,
        output: Output::Kafka("at_least_once"),
        trigger: "continuous = \"1s\"",
    },
];

/// A child whose standard output is read to its end on a thread of its own, so
/// that a full pipe never stops it.
struct Reader {
    child: Child,
    out: std::thread::JoinHandle<String>,
}

fn spawn_reader(command: &mut Command) -> Result<Reader> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut stdout = child.stdout.take().context("the reader's output")?;
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        // A read error leaves what was read; the summary's parse then says so.
        let _ = stdout.read_to_string(&mut text);
        text
    });
    Ok(Reader { child, out })
}

impl Reader {
    fn finish(mut self, what: &str) -> Result<Value> {
        let status = self.child.wait()?;
        let text = self.out.join().unwrap_or_default();
        if !status.success() {
            bail!("{what} failed ({status})");
        }
        serde_json::from_str(text.trim()).with_context(|| format!("{what} printed {text:?}"))
    }
}

/// Where [`build_release`] leaves `latency_probe`.
fn probe_path(root: &Path) -> PathBuf {
    root.join("target")
        .join("release")
        .join("examples")
        .join("latency_probe")
}

/// The median of each phase over the batches that read records past the
/// warm-up's `warm_up` records, in ms.
/// The batches that had rows and began after the warm-up's records.
fn measured_batches(progress: &[Value], warm_up: u64) -> Vec<&Value> {
    progress
        .iter()
        .filter(|p| p["numInputRows"].as_u64().unwrap_or(0) > 0)
        .filter(|p| started_at(p) >= warm_up)
        .collect()
}

fn phases(progress: &[Value], warm_up: u64) -> Value {
    let with_rows = measured_batches(progress, warm_up);
    let mut out = serde_json::Map::new();
    out.insert("batches".into(), json!(with_rows.len()));
    for phase in [
        "latestOffset",
        "walCommit",
        "addBatch",
        "sinkCommit",
        "commitOffsets",
        "triggerExecution",
    ] {
        let values: Vec<f64> = with_rows
            .iter()
            .filter_map(|p| p["durationMicros"][phase].as_f64())
            .map(|us| us / 1000.0)
            .collect();
        out.insert(phase.into(), json!(percentile(values, 0.5)));
    }
    Value::Object(out)
}

/// The slowest measured batch: its id and its phases in ms.
fn slowest(progress: &[Value], warm_up: u64) -> Value {
    // A p99 that stands out is usually one batch that stalled; which phase it
    // stalled in says where to look.
    let micros = |p: &Value, phase: &str| p["durationMicros"][phase].as_f64().unwrap_or(0.0);
    let with_rows = measured_batches(progress, warm_up);
    let Some(slowest) = with_rows
        .iter()
        .max_by(|a, b| micros(a, "triggerExecution").total_cmp(&micros(b, "triggerExecution")))
    else {
        return Value::Null;
    };
    let mut phases = serde_json::Map::new();
    for (phase, us) in slowest["durationMicros"].as_object().into_iter().flatten() {
        phases.insert(phase.clone(), json!(us.as_f64().unwrap_or(0.0) / 1000.0));
    }
    json!({ "batchId": slowest["batchId"], "ms": phases })
}

/// "batch N: T ms (phase a, phase b, ...)" for a [`slowest`] batch.
fn slowest_line(slowest: &Value) -> String {
    let Some(ms) = slowest["ms"].as_object() else {
        return "no batch with rows".to_owned();
    };
    let parts: Vec<String> = ms
        .iter()
        .filter(|(phase, _)| *phase != "triggerExecution")
        .map(|(phase, v)| format!("{phase} {:.1}", v.as_f64().unwrap_or(0.0)))
        .collect();
    format!(
        "batch {}: {:.1} ms ({})",
        slowest["batchId"],
        ms.get("triggerExecution")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        parts.join(", ")
    )
}

/// How many records of the input the batch's sources had read before it began:
/// the sum of its start offsets, as the run's topic starts at offset 0.
fn started_at(progress: &Value) -> u64 {
    let Some(sources) = progress["sources"].as_array() else {
        return 0;
    };
    sources
        .iter()
        .filter_map(|s| s["startOffset"].as_object())
        .flat_map(|topics| topics.values())
        .filter_map(Value::as_object)
        .flat_map(|partitions| partitions.values())
        .filter_map(Value::as_u64)
        .sum()
}

fn measure(
    root: &Path,
    tools: (&Path, &Path, &Path),
    configuration: &Configuration,
    rate: u64,
    round: usize,
    args: &LatencyArgs,
) -> Result<Value> {
    let (sluice, bench, probe) = tools;
    let run = crate::bench::uuid_like();
    let topic = format!("sluice-latency-{}-{rate}-{run}", slug(configuration.name));
    let partitions = args.partitions.to_string();
    bench_tool(bench, &["create", BOOTSTRAP, &topic, &partitions])?;
    let dir = root
        .join("target")
        .join("bench")
        .join("latency")
        // A directory per round keeps every run's progress file, so that a
        // run whose p99 stands out can be read batch by batch afterwards.
        .join(format!("{}-{rate}-round{round}", slug(configuration.name)));
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(&dir)?;
    let out_dir = dir.join("out");
    let out_topic = format!("{topic}-out");
    let sink = match configuration.output {
        Output::Jsonl => format!("type = \"jsonl\"\npath = \"{}\"", out_dir.display()),
        Output::Kafka(delivery) => {
            bench_tool(bench, &["create", BOOTSTRAP, &out_topic, &partitions])?;
            format!("type = \"kafka\"\ntopic = \"{out_topic}\"\ndelivery = \"{delivery}\"")
        }
    };
    let progress = dir.join("progress.jsonl");
    let config = dir.join("query.toml");
    fs::write(
        &config,
        format!(
            "[source]\nbootstrap_servers = \"{BOOTSTRAP}\"\nsubscribe = [\"{topic}\"]\n\
             starting_offsets = \"earliest\"\n\n[checkpoint]\n{}\n\n[trigger]\n{}\n\n\
             [sink]\n{sink}\n\n[progress]\nfile = \"{}\"\n",
            checkpoint(configuration.cassandra, &dir),
            configuration.trigger,
            progress.display()
        ),
    )?;
    let mut query = Command::new(sluice)
        .args(["run", "--config"])
        .arg(&config)
        .env("SLUICE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .context("starting sluice run")?;
    // The run has opened its store, made its first plan-less look and is
    // polling; Cassandra's schema takes the longest.
    sleep(Duration::from_secs(if configuration.cassandra {
        6
    } else {
        3
    }));
    if let Some(status) = query.try_wait()? {
        bail!(
            "sluice run ended before the producer started ({status}); see {}",
            config.display()
        );
    }
    let records = (rate * args.seconds).to_string();
    let timeout = (args.warm_up + args.seconds + 60).to_string();
    let mut output = Command::new(probe);
    match configuration.output {
        Output::Jsonl => output
            .arg("read-jsonl")
            .arg(&out_dir)
            .args([&records, &timeout]),
        Output::Kafka(delivery) => output.args([
            "read-kafka",
            BOOTSTRAP,
            &out_topic,
            &records,
            &timeout,
            if delivery == "exactly_once" {
                "committed"
            } else {
                "all"
            },
        ]),
    };
    let output = spawn_reader(&mut output)?;
    let alone = spawn_reader(Command::new(probe).args([
        "read-kafka",
        BOOTSTRAP,
        &topic,
        &records,
        &timeout,
        "all",
    ]))?;
    // The readers have their assignments before the first record is sent.
    sleep(Duration::from_secs(1));
    let started = Instant::now();
    let stamped = Command::new(probe)
        .args(["stamp", BOOTSTRAP, &topic, &rate.to_string()])
        .arg(args.seconds.to_string())
        .arg(args.warm_up.to_string())
        .output()?;
    if !stamped.status.success() {
        bail!(
            "the producer failed: {}",
            String::from_utf8_lossy(&stamped.stderr)
        );
    }
    let output = output.finish("the reader of Sluice's output");
    let alone = alone.finish("the reader of the input topic");
    Command::new("kill")
        .args(["-TERM", &query.id().to_string()])
        .status()?;
    let status = query.wait()?;
    let (output, alone) = (output?, alone?);
    if !status.success() {
        bail!(
            "sluice run did not stop cleanly ({status}); see {}",
            config.display()
        );
    }
    let lines = progress_lines(&dir);
    let phases = phases(&lines, rate * args.warm_up);
    let slowest = slowest(&lines, rate * args.warm_up);
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    println!(
        "{} at {rate}/s ({:.1} s): p50 {:.1} ms, p99 {:.1} ms, p999 {:.1} ms; Kafka alone p50 {:.1} \
         ms, p99 {:.1} ms; {} batches, p50 {:.1} ms each; the slowest {}; progress in {}",
        configuration.name,
        started.elapsed().as_secs_f64(),
        f(&output["p50_ms"]),
        f(&output["p99_ms"]),
        f(&output["p999_ms"]),
        f(&alone["p50_ms"]),
        f(&alone["p99_ms"]),
        phases["batches"],
        f(&phases["triggerExecution"]),
        slowest_line(&slowest),
        progress.display(),
    );
    // The topics of a run are its own; deleting them keeps the broker's disk and
    // metadata small over many runs.
    let _ = bench_tool(bench, &["delete", BOOTSTRAP, &topic]);
    if matches!(configuration.output, Output::Kafka(_)) {
        let _ = bench_tool(bench, &["delete", BOOTSTRAP, &out_topic]);
    }
    Ok(json!({
        "name": configuration.name,
        "rate": rate,
        "latency": output,
        "kafka_alone": alone,
        "phases_p50_ms": phases,
        "slowest_batch": slowest,
    }))
}

pub fn latency(root: &Path, args: &LatencyArgs) -> Result<()> {
    let (sluice, bench) = build_release(root)?;
    let probe = probe_path(root);
    let chosen: Vec<&Configuration> = CONFIGURATIONS
        .iter()
        .filter(|c| {
            args.only
                .as_ref()
                .is_none_or(|o| c.name.contains(o.as_str()))
        })
        .collect();
    if chosen.is_empty() {
        bail!(
            "--only {:?} names none of: {}",
            args.only.as_deref().unwrap_or_default(),
            CONFIGURATIONS.map(|c| c.name).join(", ")
        );
    }
    // Rounds over every configuration rather than one configuration's runs in a
    // row, so that a slow spell of the machine falls on several configurations
    // once each instead of on all runs of one.
    let mut runs: Vec<Vec<Value>> = Vec::new();
    for number in 1..=args.runs {
        let mut round = Vec::new();
        for &rate in &args.rates {
            for configuration in &chosen {
                round.push(measure(
                    root,
                    (&sluice, &bench, &probe),
                    configuration,
                    rate,
                    number,
                    args,
                )?);
            }
        }
        runs.push(round);
    }
    let rows: Vec<Value> = (0..runs[0].len())
        .map(|i| median_run(runs.iter().map(|round| round[i].clone()).collect()))
        .collect();
    let command = format!(
        "cargo xtask bench latency --rates {} --seconds {} --warm-up {} --partitions {} --runs {}{}",
        args.rates
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.seconds,
        args.warm_up,
        args.partitions,
        args.runs,
        args.only
            .as_ref()
            .map(|o| format!(" --only {o:?}"))
            .unwrap_or_default()
    );
    let work = root.join("target").join("bench");
    fs::create_dir_all(&work)?;
    fs::write(
        work.join("latency.json"),
        serde_json::to_string_pretty(&json!({"command": command, "runs": rows}))?,
    )?;
    let chart_rate = if args.rates.contains(&CHART_RATE) {
        CHART_RATE
    } else {
        args.rates[0]
    };
    let charted: Vec<&Value> = rows
        .iter()
        .filter(|r| r["rate"].as_u64() == Some(chart_rate))
        .collect();
    let chart_input = work.join("latency-chart.json");
    fs::write(
        &chart_input,
        serde_json::to_string(&json!({"rate": chart_rate, "configurations": charted}))?,
    )?;
    let status = Command::new(&probe)
        .arg("chart")
        .arg(&chart_input)
        .arg(root.join("docs").join("benchmarks-latency.svg"))
        .status()?;
    if !status.success() {
        bail!("drawing the latency chart failed");
    }
    replace_section(
        &root.join("docs").join("benchmarks.md"),
        "latency",
        &table(&command, args, &rows, chart_rate),
    )
}

/// Of one configuration's runs at one rate, the run whose p99 is the median
/// (the lower of the middle two for an even count), with every run's p99 beside it.
fn median_run(mut runs: Vec<Value>) -> Value {
    let p99 = |run: &Value| run["latency"]["p99_ms"].as_f64().unwrap_or(f64::INFINITY);
    runs.sort_by(|a, b| p99(a).total_cmp(&p99(b)));
    let each: Vec<f64> = runs.iter().map(p99).collect();
    let mut chosen = runs.swap_remove((runs.len() - 1) / 2);
    chosen["p99_each_run"] = json!(each);
    chosen
}

fn table(command: &str, args: &LatencyArgs, rows: &[Value], chart_rate: u64) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mut text = format!(
        "Measured with `{command}`: {} partitions, `processing_time = \"0s\"` unless the \
         configuration names the continuous trigger, records stamped with their send time for \
         {} s at each rate, after {} s of warm-up records that no figure counts; each \
         configuration ran {} times at each rate, in rounds, and each row is the run with the \
         median p99 (every run's p99 in the last column). Sluice's latency is from the send to the moment a reader sees the \
         record: its batch file renamed into place for `jsonl`, a consumer receiving it for \
         `kafka` (`read_committed` for `exactly_once`). \"Kafka alone\" is a consumer of the \
         input topic in the same run. Milliseconds; phases are medians per batch (an epoch, \
         for the continuous trigger) that read records.\n\n\
         | configuration | rate/s | p50 | p99 | p999 | Kafka alone p50 / p99 | batches | batch p50 | latestOffset / walCommit / addBatch / sinkCommit / commitOffsets | p99, each run |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        args.partitions, args.seconds, args.warm_up, args.runs
    );
    for row in rows {
        let (l, a, p) = (&row["latency"], &row["kafka_alone"], &row["phases_p50_ms"]);
        text.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1} | {:.1} / {:.1} | {} | {:.1} | {:.1} / {:.1} / {:.1} / {:.1} / {:.1} | {} |\n",
            row["name"].as_str().unwrap_or_default(),
            row["rate"],
            f(&l["p50_ms"]),
            f(&l["p99_ms"]),
            f(&l["p999_ms"]),
            f(&a["p50_ms"]),
            f(&a["p99_ms"]),
            p["batches"],
            f(&p["triggerExecution"]),
            f(&p["latestOffset"]),
            f(&p["walCommit"]),
            f(&p["addBatch"]),
            f(&p["sinkCommit"]),
            f(&p["commitOffsets"]),
            row["p99_each_run"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|v| format!("{:.1}", f(v)))
                .collect::<Vec<_>>()
                .join(", "),
        ));
    }
    text.push_str(&format!(
        "\n![latency histograms at {chart_rate} records/s](benchmarks-latency.svg)\n"
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(id: u64, start: u64, rows: u64, total_us: u64, wal_us: u64) -> Value {
        json!({
            "batchId": id,
            "numInputRows": rows,
            "sources": [{ "startOffset": { "t": { "0": start } } }],
            "durationMicros": { "triggerExecution": total_us, "walCommit": wal_us },
        })
    }

    #[test]
    fn the_slowest_batch_is_measured_only_after_the_warm_up_and_with_rows() {
        let progress = vec![
            batch(0, 0, 100, 900_000, 1_000),   // in the warm-up
            batch(1, 100, 100, 30_000, 21_700), // the slowest measured
            batch(2, 200, 0, 800_000, 0),       // no rows
            batch(3, 200, 100, 5_000, 1_000),
        ];
        let slowest = slowest(&progress, 100);
        assert_eq!(slowest["batchId"], 1);
        assert_eq!(slowest_line(&slowest), "batch 1: 30.0 ms (walCommit 21.7)");
        assert_eq!(slowest_line(&super::slowest(&[], 0)), "no batch with rows");
    }
}
