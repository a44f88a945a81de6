//! The Kafka and file side of `cargo xtask bench latency`:
//!
//! - `stamp <bootstrap> <topic> <rate> <seconds> [<warm-up seconds>]`: produces
//!   `rate` records a second for `seconds`, on a fixed schedule, each value the
//!   time it was handed to the producer, in microseconds since the epoch, as
//!   ASCII digits; prints how many it sent. The warm-up's records come first, on
//!   the same schedule, their stamps marked with a leading `w`: the readers pass
//!   over them, as a topic's first half second says how Kafka starts a topic,
//!   not how a running query keeps up (see [`WARM_UP`]).
//! - `read-jsonl <dir> <records> <timeout seconds>`: watches a `jsonl` sink's
//!   directory and takes, for each record, the time its batch file appeared
//!   minus the time it was sent; prints the latencies' summary and histogram
//!   as JSON once it has seen `records` records past the warm-up.
//! - `read-kafka <bootstrap> <topic> <records> <timeout seconds> <committed|all>`:
//!   the same for a topic, from the moment a consumer receives each record;
//!   `committed` reads with `isolation.level = read_committed`, as a consumer
//!   of an exactly-once sink must.
//! - `chart <results.json> <out.svg>`: the latency histograms of one rate's
//!   configurations, as SVG.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{Value, json};

/// The producer's `linger.ms`. At librdkafka's default of 5 ms the producer
/// alone adds up to 5 ms to every record; at 0, one broker on a small machine
/// queues single-record requests at 10,000 records a second until the producer
/// lags by seconds. One millisecond keeps the floor low and the broker keeping up.
const LINGER_MS: &str = "1";

/// What marks a warm-up record's stamp. On a topic created moments before, the
/// single dev broker holds every record for 100 to 190 ms once or a few times
/// within the first half second, with nothing else running (a producer and a
/// reader of the topic alone, 10,000 records a second: p99 37 to 185 ms in 8 of
/// 10 runs). After a second of records, the same pair's p99 was 2.5 ms and its
/// slowest record 9 to 16 ms in 6 of 6 runs. A fresh topic per run keeps runs
/// apart, so each run writes a warm-up first and the readers pass over it.
const WARM_UP: u8 = b'w';

/// Histogram buckets per decade, from 10 µs to 100 s.
const BUCKETS_PER_DECADE: f64 = 20.0;
const FIRST_BUCKET_US: f64 = 10.0;
const DECADES: f64 = 7.0;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["stamp", bootstrap, topic, rate, seconds, warm_up @ ..] if warm_up.len() <= 1 => {
            let warm_up = match warm_up.first() {
                Some(seconds) => seconds.parse()?,
                None => 0,
            };
            stamp(bootstrap, topic, rate.parse()?, seconds.parse()?, warm_up)
        }
        ["read-jsonl", dir, records, timeout] => {
            let latencies = read_jsonl(Path::new(dir), records.parse()?, seconds(timeout)?)?;
            println!("{}", summary(latencies));
            Ok(())
        }
        ["read-kafka", bootstrap, topic, records, timeout, isolation] => {
            let committed = match *isolation {
                "committed" => true,
                "all" => false,
                other => bail!("isolation {other:?}: use committed or all"),
            };
            let latencies = read_kafka(
                bootstrap,
                topic,
                records.parse()?,
                seconds(timeout)?,
                committed,
            )?;
            println!("{}", summary(latencies));
            Ok(())
        }
        ["chart", results, out] => chart(Path::new(results), Path::new(out)),
        _ => bail!("usage: latency_probe stamp|read-jsonl|read-kafka|chart ..."),
    }
}

fn seconds(text: &str) -> Result<Duration> {
    Ok(Duration::from_secs(text.parse().with_context(|| {
        format!("{text:?} is not a number of seconds")
    })?))
}

fn now_us() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

/// Sends record `i` at `start + i / rate`, stamped with the moment it is
/// handed to the producer, so that a producer running late shows as its own
/// delay in the input topic's latency, the baseline, and not only in Sluice's.
fn stamp(bootstrap: &str, topic: &str, rate: u64, seconds: u64, warm_up: u64) -> Result<()> {
    if rate == 0 {
        bail!("the rate must be at least one record a second");
    }
    let producer: ThreadedProducer<_> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", LINGER_MS)
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .context("creating the producer")?;
    let warm = rate * warm_up;
    let total = warm + rate * seconds;
    let start = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        let due = start + Duration::from_secs_f64(sent as f64 / rate as f64);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        // Everything that has come due since the last wake-up goes now.
        let due_now = ((start.elapsed().as_secs_f64() * rate as f64) as u64 + 1).min(total);
        while sent < due_now {
            let value = if sent < warm {
                format!("{}{}", char::from(WARM_UP), now_us())
            } else {
                now_us().to_string()
            };
            let mut record = BaseRecord::<(), String>::to(topic).payload(&value);
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((e, back)) => {
                        if !matches!(
                            e,
                            rdkafka::error::KafkaError::MessageProduction(
                                rdkafka::types::RDKafkaErrorCode::QueueFull
                            )
                        ) {
                            bail!("producing to {topic}: {e}");
                        }
                        record = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            sent += 1;
        }
    }
    producer
        .flush(Duration::from_secs(30))
        .context("flushing the producer")?;
    println!(
        "{}",
        json!({"sent": sent - warm, "warm_up": warm, "seconds": start.elapsed().as_secs_f64()})
    );
    Ok(())
}

/// What a record's stamp says.
enum Stamp {
    /// Sent at this many microseconds since the epoch.
    Sent(u64),
    /// A warm-up record, which no figure counts.
    WarmUp,
}

/// The stamp in a record's value, or in the `"value":"..."` field of a jsonl line.
fn stamp_of(text: &[u8]) -> Option<Stamp> {
    let digits = match text.windows(9).position(|w| w == b"\"value\":\"") {
        Some(at) => &text[at + 9..],
        None => text,
    };
    if digits.first() == Some(&WARM_UP) {
        return Some(Stamp::WarmUp);
    }
    let end = digits
        .iter()
        .position(|c| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    std::str::from_utf8(&digits[..end])
        .ok()?
        .parse()
        .ok()
        .map(Stamp::Sent)
}

/// Batch files appear one by one, `batch-<id>.jsonl` with consecutive ids, so
/// the reader looks for the next id; a full listing now and then covers a
/// gap in the ids.
fn read_jsonl(dir: &Path, records: u64, timeout: Duration) -> Result<Vec<u64>> {
    let deadline = Instant::now() + timeout;
    let mut latencies = Vec::with_capacity(usize::try_from(records).unwrap_or(0));
    let mut next: u64 = 0;
    let mut last_listing = Instant::now();
    let file = |id: u64| dir.join(format!("batch-{id:020}.jsonl"));
    while (latencies.len() as u64) < records {
        if Instant::now() > deadline {
            bail!(
                "saw {} of {records} records in {} before the timeout",
                latencies.len(),
                dir.display()
            );
        }
        let path = file(next);
        match std::fs::read(&path) {
            Ok(bytes) => {
                let seen = now_us();
                for line in bytes.split(|c| *c == b'\n').filter(|l| !l.is_empty()) {
                    let stamp = stamp_of(line)
                        .with_context(|| format!("a line of {} has no stamp", path.display()))?;
                    if let Stamp::Sent(sent) = stamp {
                        latencies.push(seen.saturating_sub(sent));
                    }
                }
                next += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if last_listing.elapsed() > Duration::from_millis(200) {
                    last_listing = Instant::now();
                    if let Some(id) = first_batch_after(dir, next)? {
                        next = id;
                        continue;
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }
    Ok(latencies)
}

fn first_batch_after(dir: &Path, id: u64) -> Result<Option<u64>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let mut first = None;
    for entry in entries {
        let name = PathBuf::from(entry?.file_name());
        let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_prefix("batch-"))
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if n >= id && first.is_none_or(|f| n < f) {
            first = Some(n);
        }
    }
    Ok(first)
}

fn read_kafka(
    bootstrap: &str,
    topic: &str,
    records: u64,
    timeout: Duration,
    committed: bool,
) -> Result<Vec<u64>> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("latency-probe-{}", now_us()))
        .set("enable.auto.commit", "false")
        .set(
            "isolation.level",
            if committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        // Return each fetch as soon as it holds a record.
        .set("fetch.wait.max.ms", "100")
        .set("fetch.min.bytes", "1")
        .create()
        .context("creating the consumer")?;
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .with_context(|| format!("reading the metadata of {topic}"))?;
    let partitions = metadata
        .topics()
        .first()
        .map(|t| t.partitions().len())
        .unwrap_or(0);
    if partitions == 0 {
        bail!("topic {topic} has no partitions");
    }
    let mut assignment = TopicPartitionList::new();
    for p in 0..partitions {
        assignment.add_partition_offset(topic, i32::try_from(p)?, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let deadline = Instant::now() + timeout;
    let mut latencies = Vec::with_capacity(usize::try_from(records).unwrap_or(0));
    while (latencies.len() as u64) < records {
        if Instant::now() > deadline {
            bail!(
                "saw {} of {records} records of {topic} before the timeout",
                latencies.len()
            );
        }
        let Some(message) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let message = message.with_context(|| format!("reading {topic}"))?;
        let seen = now_us();
        let stamp = message
            .payload()
            .and_then(stamp_of)
            .with_context(|| format!("a record of {topic} has no stamp"))?;
        if let Stamp::Sent(sent) = stamp {
            latencies.push(seen.saturating_sub(sent));
        }
    }
    Ok(latencies)
}

/// p50, p99, p999 and the maximum in milliseconds, and a histogram with
/// logarithmic buckets: `[upper bound in ms, share of the records]`.
fn summary(mut latencies: Vec<u64>) -> Value {
    latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((latencies.len().saturating_sub(1)) as f64 * q).round() as usize;
        latencies.get(i).map_or(f64::NAN, |us| *us as f64 / 1000.0)
    };
    let buckets = (BUCKETS_PER_DECADE * DECADES) as usize;
    let mut counts = vec![0u64; buckets];
    for us in &latencies {
        let position =
            ((*us as f64).max(FIRST_BUCKET_US) / FIRST_BUCKET_US).log10() * BUCKETS_PER_DECADE;
        counts[(position as usize).min(buckets - 1)] += 1;
    }
    let total = latencies.len().max(1) as f64;
    let histogram: Vec<Value> = counts
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let upper_us = FIRST_BUCKET_US * 10f64.powf((i + 1) as f64 / BUCKETS_PER_DECADE);
            json!([upper_us / 1000.0, *n as f64 / total])
        })
        .collect();
    json!({
        "records": latencies.len(),
        "p50_ms": at(0.5),
        "p99_ms": at(0.99),
        "p999_ms": at(0.999),
        "max_ms": at(1.0),
        "histogram": histogram,
    })
}

/// One line per configuration of `results` (`{"rate", "configurations": [{name,
/// latency: {histogram}}]}`): the share of records per latency bucket, on a
/// logarithmic axis of milliseconds.
fn chart(results: &Path, out: &Path) -> Result<()> {
    use plotters::prelude::*;
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(results)
            .with_context(|| format!("reading {}", results.display()))?,
    )?;
    let rate = json["rate"].as_u64().unwrap_or(0);
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for c in json["configurations"].as_array().into_iter().flatten() {
        let points = c["latency"]["histogram"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()? * 100.0)))
            .collect();
        lines.push((c["name"].as_str().unwrap_or_default().to_owned(), points));
    }
    if lines.is_empty() {
        bail!("{} has no configurations", results.display());
    }
    // Bound the axis by where records are, with room on the left for the legend.
    let used = || lines.iter().flat_map(|l| l.1.iter()).filter(|p| p.1 > 0.0);
    let low = used().map(|p| p.0).fold(f64::INFINITY, f64::min) / 8.0;
    let high = used().map(|p| p.0).fold(0.0, f64::max) * 1.5;
    let top = used().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let root = SVGBackend::new(out, (900, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("send to visible at {rate} records/s: share of records per latency bucket"),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(
            (low.max(0.01)..high.max(1.0)).log_scale(),
            0.0..top.max(1.0),
        )?;
    chart
        .configure_mesh()
        .x_desc("milliseconds (logarithmic)")
        .y_desc("% of records")
        .x_label_formatter(&|x| {
            if *x < 1.0 {
                format!("{x:.2}")
            } else {
                format!("{x:.0}")
            }
        })
        .draw()?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    println!("wrote {}", out.display());
    Ok(())
}
