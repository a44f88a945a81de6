//! `cargo xtask bench partitions` and `cargo xtask bench soak`: how Sluice's
//! memory and per-batch cost behave as partitions and batches grow.
//!
//! - `partitions`: 8, 256 and 1,024 partitions (and more when asked), each at
//!   the default batch size and at 10,000 offsets per trigger, with the
//!   filesystem checkpoint and the Cassandra store, every run paired with a run
//!   of the raw consumer just before it. Ratios and peak RSS go to
//!   `target/bench/partitions.json`, `docs/benchmarks.md` and
//!   `docs/benchmarks-partitions.svg`.
//! - `soak`: 100,000 tiny batches with `processing_time = "0"`, reporting the
//!   batch cost at the start and at the end, the checkpoint's size and RSS over
//!   time, into `target/bench/soak.json` and `docs/benchmarks.md`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{
    build_release, checkpoint, median, peak_rss, percentile, replace_section, watch_peak_rss,
};

const BOOTSTRAP: &str = "127.0.0.1:9092";

/// A producer the sweep fills topics with: its `batch.size` and
/// `compression.type`, which set the record batches a fetch returns whole.
#[derive(Clone, Debug, PartialEq)]
pub struct Producer {
    pub batch_bytes: u64,
    pub compression: String,
}

impl Producer {
    /// `16384`, `1000000`, `1000000:lz4`...
    fn parse(text: &str) -> Result<Producer> {
        let (bytes, compression) = text.trim().split_once(':').unwrap_or((text.trim(), "none"));
        Ok(Producer {
            batch_bytes: bytes
                .parse()
                .with_context(|| format!("producer {text:?}: {bytes:?} is not a batch.size"))?,
            compression: compression.to_owned(),
        })
    }

    fn label(&self) -> String {
        let size = match self.batch_bytes {
            16_384 => "16 KiB".to_owned(),
            1_000_000 => "1 MB".to_owned(),
            b => format!("{b} B"),
        };
        match self.compression.as_str() {
            "none" => format!("{size} batches"),
            c => format!("{size} {c} batches"),
        }
    }

    fn spec(&self) -> String {
        format!("{}:{}", self.batch_bytes, self.compression)
    }
}

/// What `bench partitions` measures.
pub struct SweepArgs {
    pub records: u64,
    pub partitions: Vec<u32>,
    pub runs: usize,
    /// The producers to fill topics with: the Java producer's 16 KiB record
    /// batches, librdkafka's 1,000,000 bytes, and those with lz4 and zstd.
    pub producers: Vec<Producer>,
}

impl SweepArgs {
    pub fn parse(args: &[String]) -> Result<SweepArgs> {
        let mut parsed = SweepArgs {
            records: 2_000_000,
            partitions: vec![8, 256, 1024],
            runs: 2,
            producers: ["16384", "1000000", "1000000:lz4", "1000000:zstd"]
                .iter()
                .map(|p| Producer::parse(p))
                .collect::<Result<_>>()?,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            let number = |v: &str| {
                v.parse::<u64>()
                    .with_context(|| format!("{flag} {v:?} is not a number"))
            };
            match flag.as_str() {
                "--records" => parsed.records = number(value)?,
                "--runs" => parsed.runs = usize::try_from(number(value)?)?.max(1),
                "--producers" => {
                    parsed.producers = value
                        .split(',')
                        .map(Producer::parse)
                        .collect::<Result<_>>()?;
                }
                "--partitions" => {
                    parsed.partitions = value
                        .split(',')
                        .map(|p| Ok(u32::try_from(number(p.trim())?)?))
                        .collect::<Result<_>>()?;
                }
                other => bail!(
                    "unknown option {other}: use --records, --partitions 8,256,1024, --runs, \
                     --producers 16384,1000000,1000000:lz4,1000000:zstd"
                ),
            }
        }
        Ok(parsed)
    }
}

/// One run of the raw consumer.
struct Raw {
    seconds: f64,
    peak_rss_kib: u64,
}

fn raw(tool: &Path, topic: &str) -> Result<Raw> {
    let started = Instant::now();
    let mut child = Command::new(tool)
        .args(["consume", BOOTSTRAP, topic])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let peak_rss_kib = watch_peak_rss(&mut child)?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "the raw consumer failed on {topic}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(Raw {
        seconds: started.elapsed().as_secs_f64(),
        peak_rss_kib,
    })
}

/// Writes a query reading `topic` from the start to the discard sink.
fn query(
    dir: &Path,
    topic: &str,
    source_extra: &str,
    store: &str,
    trigger: &str,
) -> Result<PathBuf> {
    let config = dir.join("query.toml");
    fs::write(
        &config,
        format!(
            "[source]\nbootstrap_servers = \"{BOOTSTRAP}\"\nsubscribe = [\"{topic}\"]\n\
             starting_offsets = \"earliest\"\n{source_extra}\n\n[checkpoint]\n{store}\n\n\
             [trigger]\n{trigger}\n\n[sink]\ntype = \"discard\"\n\n[progress]\nfile = \"{}\"\n",
            dir.join("progress.jsonl").display()
        ),
    )?;
    Ok(config)
}

fn fresh_dir(path: PathBuf) -> Result<PathBuf> {
    if path.exists() {
        fs::remove_dir_all(&path)?;
    }
    fs::create_dir_all(&path)?;
    Ok(path)
}

/// The progress reports a query wrote to `progress.jsonl` in `dir`, one per
/// batch; a line cut short by a killed writer is skipped.
pub(crate) fn progress_lines(dir: &Path) -> Vec<Value> {
    fs::read_to_string(dir.join("progress.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// One configuration of the sweep.
struct Sweep<'a> {
    name: String,
    topic: &'a str,
    cassandra: bool,
    max: Option<u64>,
}

/// Runs `sweep` `runs` times, each beside a run of the raw consumer, and
/// returns its row of the results.
fn run_sweep(
    work: &Path,
    (sluice, tool): (&Path, &Path),
    sweep: &Sweep,
    args: &SweepArgs,
) -> Result<Value> {
    let name = &sweep.name;
    let mut ratios = Vec::new();
    let mut rss = Vec::new();
    let mut raw_rss = Vec::new();
    let mut amplification = Vec::new();
    for run in 0..args.runs {
        let base = raw(tool, sweep.topic)?;
        let dir = fresh_dir(
            work.join("sweep")
                .join(crate::bench::slug(name))
                .join(run.to_string()),
        )?;
        let extra = sweep
            .max
            .map(|m| format!("max_offsets_per_trigger = {m}"))
            .unwrap_or_default();
        let config = query(
            &dir,
            sweep.topic,
            &extra,
            &checkpoint(sweep.cassandra, &dir),
            "available_now = true",
        )?;
        let started = Instant::now();
        let mut child = Command::new(sluice)
            .args(["run", "--config"])
            .arg(&config)
            .env("SLUICE_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()?;
        let peak = watch_peak_rss(&mut child)?;
        let status = child.wait()?;
        let seconds = started.elapsed().as_secs_f64();
        if !status.success() {
            bail!(
                "sluice run failed for {name} ({status}); see {}",
                config.display()
            );
        }
        let progress = progress_lines(&dir);
        let read: f64 = progress
            .iter()
            .map(|p| p["numInputRows"].as_f64().unwrap_or(0.0))
            .sum();
        if read as u64 != args.records {
            bail!("{name}: read {read} records of {}", args.records);
        }
        // As of librdkafka's last statistics, a second or less before the end.
        let amp = progress
            .last()
            .and_then(|p| {
                p["sources"][0]["metrics"]["readAmplificationTotal"]
                    .as_str()?
                    .parse()
                    .ok()
            })
            .unwrap_or(f64::NAN);
        let ratio = base.seconds / seconds;
        println!(
            "{name} run {run}: {seconds:.2} s, x{ratio:.2} of the raw consumer's {:.2} s; peak RSS {} MiB (raw {} MiB); read amplification {amp:.2}",
            base.seconds,
            peak / 1024,
            base.peak_rss_kib / 1024
        );
        ratios.push(ratio);
        rss.push(peak as f64 / 1024.0);
        raw_rss.push(base.peak_rss_kib as f64 / 1024.0);
        amplification.push(amp);
    }
    Ok(json!({
        "name": name,
        "store": if sweep.cassandra { "cassandra" } else { "filesystem" },
        "max_offsets_per_trigger": sweep.max,
        "ratio_to_raw": median(ratios.clone()),
        "ratios": ratios,
        "peak_rss_mib": median(rss.clone()),
        "peak_rss_mib_all": rss,
        "raw_peak_rss_mib": median(raw_rss),
        "read_amplification": median(amplification.clone()),
        "read_amplification_all": amplification,
        // For the chart, which plots this field.
        "records_per_second": {"median": median(ratios)},
    }))
}

pub fn partitions(root: &Path, args: &SweepArgs) -> Result<()> {
    let (sluice, tool) = build_release(root)?;
    let work = root.join("target").join("bench");
    let mut rows = Vec::new();
    for producer in &args.producers {
        for &partitions in &args.partitions {
            let topic = format!(
                "sluice-sweep-{partitions}p-{}r-{}b-{}",
                args.records, producer.batch_bytes, producer.compression
            );
            let status = Command::new(&tool)
                .args(["fill", BOOTSTRAP, &topic])
                .arg(partitions.to_string())
                .arg(args.records.to_string())
                .arg("100")
                .arg(producer.batch_bytes.to_string())
                .arg(&producer.compression)
                .status()
                .context("running bench_tool fill")?;
            if !status.success() {
                bail!("filling {topic} failed");
            }
            for cassandra in [false, true] {
                for max in [None, Some(10_000_u64)] {
                    let name = format!(
                        "{}, {partitions} partitions, {}, {}",
                        producer.label(),
                        if cassandra { "cassandra" } else { "filesystem" },
                        max.map_or("default".to_owned(), |m| format!("{}k/trigger", m / 1000))
                    );
                    let sweep = Sweep {
                        name,
                        topic: &topic,
                        cassandra,
                        max,
                    };
                    let mut row = run_sweep(&work, (&sluice, &tool), &sweep, args)?;
                    row["partitions"] = json!(partitions);
                    row["producer"] = json!({
                        "batch.size": producer.batch_bytes,
                        "compression.type": producer.compression,
                    });
                    rows.push(row);
                }
            }
        }
    }
    let command = format!(
        "cargo xtask bench partitions --records {} --partitions {} --runs {} --producers {}",
        args.records,
        args.partitions
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.runs,
        args.producers
            .iter()
            .map(Producer::spec)
            .collect::<Vec<_>>()
            .join(",")
    );
    let report = json!({"command": command, "configurations": rows});
    let results = work.join("partitions.json");
    fs::write(&results, serde_json::to_string_pretty(&report)?)?;
    let chart = root.join("docs").join("benchmarks-partitions.svg");
    let status = Command::new(&tool)
        .args(["chart"])
        .arg(&results)
        .arg(&chart)
        .arg("ratio to the raw consumer in the same run (median), higher is better")
        .status()?;
    if !status.success() {
        bail!("drawing the chart failed");
    }
    let mut table = format!(
        "Measured with `{command}`: {} records of 100 bytes per topic, each topic written by \
         librdkafka's producer with the `batch.size` and `compression.type` its configuration \
         names (`linger.ms` 20), the discard sink, `available_now`. Each ratio is the raw \
         consumer's wall time over Sluice's, each Sluice run paired with a raw run just before \
         it; medians over the runs. The read amplification is the bytes of keys and values \
         librdkafka fetched per byte Sluice read, as of its last statistics (a second or less \
         before the end; none for a run shorter than a second).\n\n\
         | configuration | ratio to raw | read amplification | Sluice peak RSS MiB | raw peak RSS MiB |\n\
         | --- | --- | --- | --- | --- |\n",
        args.records
    );
    for row in report["configurations"].as_array().into_iter().flatten() {
        let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
        table.push_str(&format!(
            "| {} | {:.2} | {} | {:.0} | {:.0} |\n",
            row["name"].as_str().unwrap_or_default(),
            f(&row["ratio_to_raw"]),
            // A run shorter than librdkafka's first statistics has none.
            Some(f(&row["read_amplification"]))
                .filter(|a| a.is_finite())
                .map_or("–".to_owned(), |a| format!("{a:.2}")),
            f(&row["peak_rss_mib"]),
            f(&row["raw_peak_rss_mib"]),
        ));
    }
    // Every run, as the medians of few noisy runs hide how far apart they were.
    let runs: Vec<String> = report["configurations"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|row| {
            let list = |key: &str, digits: usize| {
                row[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|v| format!("{:.digits$}", v.as_f64().unwrap_or(f64::NAN)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            format!(
                "{}: {} ({})",
                row["name"].as_str().unwrap_or_default(),
                list("ratios", 2),
                list("peak_rss_mib_all", 0)
            )
        })
        .collect();
    table.push_str(&format!(
        "\nEvery run of each configuration, as ratios and peak RSS in MiB: {}.\n",
        runs.join("; ")
    ));
    table.push_str(
        "\n![ratio to the raw consumer per partition count](benchmarks-partitions.svg)\n",
    );
    replace_section(
        &root.join("docs").join("benchmarks.md"),
        "partitions",
        &table,
    )?;
    Ok(())
}

/// What `bench soak` measures.
pub struct SoakArgs {
    pub batches: u64,
    pub cassandra: bool,
}

impl SoakArgs {
    pub fn parse(args: &[String]) -> Result<SoakArgs> {
        let mut parsed = SoakArgs {
            batches: 100_000,
            cassandra: false,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            match flag.as_str() {
                "--batches" => {
                    parsed.batches = value
                        .parse()
                        .with_context(|| format!("--batches {value:?} is not a number"))?;
                }
                "--store" => {
                    parsed.cassandra = match value.as_str() {
                        "filesystem" | "fs" => false,
                        "cassandra" => true,
                        other => bail!("--store {other:?}: use filesystem or cassandra"),
                    };
                }
                other => {
                    bail!("unknown option {other}: use --batches N, --store filesystem|cassandra")
                }
            }
        }
        Ok(parsed)
    }
}

/// The size of the files under `dir`, in bytes.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => size_of(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Counts the lines of a file that grows, reading each byte once.
#[derive(Default)]
struct NewLines {
    file: Option<fs::File>,
    lines: u64,
}

impl NewLines {
    /// The lines written so far; zero while the file does not exist yet.
    fn count(&mut self, path: &Path) -> u64 {
        if self.file.is_none() {
            self.file = fs::File::open(path).ok();
        }
        if let Some(file) = &mut self.file {
            let mut buffer = [0u8; 64 * 1024];
            // A read error leaves the count where it was; the next look tries again.
            while let Ok(n @ 1..) = std::io::Read::read(file, &mut buffer) {
                self.lines += buffer[..n].iter().filter(|c| **c == b'\n').count() as u64;
            }
        }
        self.lines
    }
}

pub fn soak(root: &Path, args: &SoakArgs) -> Result<()> {
    let (sluice, tool) = build_release(root)?;
    // Eight partitions and eight offsets per trigger: one record per partition
    // per batch.
    const PARTITIONS: u64 = 8;
    let records = args.batches * PARTITIONS;
    let topic = format!("sluice-soak-{PARTITIONS}p-{records}r");
    let status = Command::new(&tool)
        .args(["fill", BOOTSTRAP, &topic])
        .arg(PARTITIONS.to_string())
        .arg(records.to_string())
        .arg("100")
        .status()
        .context("running bench_tool fill")?;
    if !status.success() {
        bail!("filling {topic} failed");
    }
    let store_name = if args.cassandra {
        "cassandra"
    } else {
        "filesystem"
    };
    let dir = fresh_dir(
        root.join("target")
            .join("bench")
            .join("soak")
            .join(store_name),
    )?;
    let config = query(
        &dir,
        &topic,
        &format!("max_offsets_per_trigger = {PARTITIONS}"),
        &checkpoint(args.cassandra, &dir),
        "processing_time = \"0\"",
    )?;
    let started = Instant::now();
    let mut child = Command::new(&sluice)
        .args(["run", "--config"])
        .arg(&config)
        .env("SLUICE_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    let progress = dir.join("progress.jsonl");
    // Only what was appended since the last look is read: reading the whole file
    // every 200 ms cost the machine about a third of a core by its end (120 MB),
    // which the last batches paid for as cost that was not theirs.
    let mut lines_seen = NewLines::default();
    let mut samples = Vec::new();
    let mut last_sample = Instant::now() - Duration::from_secs(10);
    let batches = loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "sluice run ended early ({status}); see {}",
                config.display()
            );
        }
        let done = lines_seen.count(&progress);
        if last_sample.elapsed() >= Duration::from_secs(5) || done >= args.batches {
            last_sample = Instant::now();
            let rss = peak_rss(child.id(), "VmRSS:").unwrap_or(0);
            let checkpoint = size_of(&dir.join("checkpoint"));
            println!(
                "{done} batches after {:.0} s: RSS {} MiB, checkpoint {} KiB",
                started.elapsed().as_secs_f64(),
                rss / 1024,
                checkpoint / 1024
            );
            samples.push(json!({
                "seconds": started.elapsed().as_secs_f64(),
                "batches": done,
                "rss_mib": rss as f64 / 1024.0,
                "checkpoint_kib": checkpoint as f64 / 1024.0,
            }));
        }
        if done >= args.batches {
            break done;
        }
        sleep(Duration::from_millis(200));
    };
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    let status = child.wait()?;
    if !status.success() {
        bail!("sluice run did not stop cleanly ({status})");
    }
    let lines = progress_lines(&dir);
    let window = (lines.len() / 100).clamp(100, 1000);
    let cost = |slice: &[Value]| {
        let micros: Vec<f64> = slice
            .iter()
            .filter_map(|p| p["durationMicros"]["triggerExecution"].as_f64())
            .map(|us| us / 1000.0)
            .collect();
        json!({"p50_ms": percentile(micros.clone(), 0.5), "p99_ms": percentile(micros, 0.99)})
    };
    let first = cost(&lines[..window.min(lines.len())]);
    let last = cost(&lines[lines.len().saturating_sub(window)..]);
    let report = json!({
        "command": format!("cargo xtask bench soak --batches {} --store {store_name}", args.batches),
        "batches": batches,
        "window": window,
        "first": first,
        "last": last,
        "samples": samples,
    });
    let work = root.join("target").join("bench");
    fs::write(
        work.join(format!("soak-{store_name}.json")),
        serde_json::to_string_pretty(&report)?,
    )?;
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let rss: Vec<f64> = samples.iter().map(|s| f(&s["rss_mib"])).collect();
    let sizes: Vec<f64> = samples.iter().map(|s| f(&s["checkpoint_kib"])).collect();
    let at = |v: &[f64], q: f64| {
        v.get(((v.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    let text = format!(
        "`{}`: {batches} batches of one record per partition over {PARTITIONS} partitions, \
         `processing_time = \"0\"`, the discard sink, retention of the default 100 batches.\n\n\
         | | first {window} batches | last {window} batches |\n| --- | --- | --- |\n\
         | batch cost p50 / p99 ms | {:.2} / {:.2} | {:.2} / {:.2} |\n\n\
         RSS at 10%, 50% and 100% of the run: {:.0} / {:.0} / {:.0} MiB. Checkpoint size (the \
         directory; Cassandra keeps its log in its own files) at the same points: {:.0} / {:.0} / \
         {:.0} KiB.\n",
        report["command"].as_str().unwrap_or_default(),
        f(&first["p50_ms"]),
        f(&first["p99_ms"]),
        f(&last["p50_ms"]),
        f(&last["p99_ms"]),
        at(&rss, 0.1),
        at(&rss, 0.5),
        at(&rss, 1.0),
        at(&sizes, 0.1),
        at(&sizes, 0.5),
        at(&sizes, 1.0),
    );
    replace_section(
        &root.join("docs").join("benchmarks.md"),
        &format!("soak-{store_name}"),
        &text,
    )?;
    Ok(())
}
