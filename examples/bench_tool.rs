//! The Kafka side of `cargo xtask bench`:
//!
//! - `fill <bootstrap> <topic> <partitions> <records> <value bytes> [batch bytes [compression]]`:
//!   creates the topic and fills it to `records` records, with a progress bar; a
//!   topic that already holds them is reused. The producer's `batch.size` is
//!   `batch bytes` (librdkafka's 1,000,000 by default; the Java producer's default
//!   is 16,384), which sets the size of the record batches a fetch returns whole;
//!   `compression` is its `compression.type` (`none` by default, `lz4`, `zstd`...).
//!   Each value is a JSON order (`order`, `customer`, `amount`, `note`), padded with
//!   its note to `value bytes`, so that the SQL configurations have JSON to decode.
//! - `events <bootstrap> <topic> <partitions> <records> <users>`: like `fill`, with
//!   events of a high-cardinality stream: `user` (`u00000` to `u09999` for 10,000
//!   users), `ts` and `amount`, each user once in every 10 seconds of event time,
//!   in order of time, so that a count per user per 10-second
//!   window makes a group of every event. Producer defaults as `fill`'s.
//! - `lookup <path> <rows>`: a Parquet lookup table of `rows` customers (`id`
//!   0 to rows - 1, `name`, `segment`, `country`, `score`), snappy-compressed in
//!   row groups of 128Ki rows as pyarrow writes them, unless the file is there.
//! - `consume <bootstrap> <topic>`: the baseline, a plain rdkafka consumer reading
//!   every partition to its end with no processing, with the fetch settings Sluice
//!   uses; prints JSON figures.
//! - `pipe <bootstrap> <from> <to>`: the Kafka to Kafka baseline, the same
//!   consumer producing every record to topic `to` (which must exist) with the
//!   producer settings of Sluice's `kafka` sink (idempotent, `acks=all`, delivery
//!   reports of errors only) and headers of the same sizes; prints JSON figures.
//! - `chart <results.json> <out.svg> [title]`: a bar per configuration, as SVG.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};

// The allocator and its option as in the `sluice` binary, so that the
// baseline is the same librdkafka, allocating the same way.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> Result<()> {
    // SAFETY: setting an option only stores a value; no other thread exists
    // yet. 15 is mimalloc 3's `mi_option_purge_delay`, checked in the runner.
    unsafe { libmimalloc_sys::mi_option_set(15, 100) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [
            "fill",
            bootstrap,
            topic,
            partitions,
            records,
            value_bytes,
            producer @ ..,
        ] if producer.len() <= 2 => fill(
            bootstrap,
            topic,
            partitions.parse()?,
            records.parse()?,
            value_bytes.parse()?,
            producer.first().map_or(Ok(1_000_000), |b| b.parse())?,
            producer.get(1).copied().unwrap_or("none"),
        ),
        ["events", bootstrap, topic, partitions, records, users] => {
            let users: u64 = users.parse()?;
            if users == 0 {
                bail!("events needs at least one user");
            }
            fill_with(
                bootstrap,
                topic,
                partitions.parse()?,
                records.parse()?,
                (1_000_000, "none"),
                |n, value| event(n, users, value),
            )
        }
        ["lookup", path, rows] => lookup_table(std::path::Path::new(path), rows.parse()?),
        ["consume", bootstrap, topic] => consume(bootstrap, topic, None),
        ["pipe", bootstrap, from, to] => consume(bootstrap, from, Some(to)),
        ["create", bootstrap, topic, partitions] => {
            admin_call(bootstrap, topic, Some(partitions.parse()?))
        }
        ["delete", bootstrap, topic] => admin_call(bootstrap, topic, None),
        ["chart", results, out] => chart(
            results,
            out,
            "records per second (median), higher is better",
        ),
        ["chart", results, out, title] => chart(results, out, title),
        _ => bail!("usage: bench_tool fill|events|lookup|consume|pipe|create|delete|chart ..."),
    }
}

/// Creates `topic` with `partitions` partitions, or deletes it when `None`.
fn admin_call(bootstrap: &str, topic: &str, partitions: Option<i32>) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = config(bootstrap).create()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let results = match partitions {
        Some(partitions) => {
            let new_topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
            runtime.block_on(admin.create_topics([&new_topic], &AdminOptions::new()))?
        }
        None => runtime.block_on(admin.delete_topics(&[topic], &AdminOptions::new()))?,
    };
    for result in results {
        result.map_err(|(topic, code)| anyhow::anyhow!("topic {topic}: {code}"))?;
    }
    Ok(())
}

fn config(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    config
}

/// The high watermark of every partition of `topic`.
fn ends(consumer: &BaseConsumer, topic: &str) -> Result<Vec<(i32, i64)>> {
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    partitions
        .into_iter()
        .map(|p| {
            let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
            Ok((p, high))
        })
        .collect()
}

fn fill(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    records: u64,
    value_bytes: usize,
    batch_bytes: usize,
    compression: &str,
) -> Result<()> {
    fill_with(
        bootstrap,
        topic,
        partitions,
        records,
        (batch_bytes, compression),
        |n, value| order(n, value_bytes, value),
    )
}

/// Creates `topic` and fills it to `records` records, record `n` with the
/// value `value` writes for it, in partition `n % partitions`, through a
/// producer of `batch.size` and `compression.type` `producer`.
fn fill_with(
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    records: u64,
    (batch_bytes, compression): (usize, &str),
    mut value_of: impl FnMut(u64, &mut Vec<u8>),
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = config(bootstrap).create()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let new_topic = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    runtime.block_on(admin.create_topics([&new_topic], &AdminOptions::new()))?;
    let consumer: BaseConsumer = config(bootstrap).create()?;
    let mut present: u64 = 0;
    for _ in 0..50 {
        if let Ok(e) = ends(&consumer, topic)
            && e.len() == partitions as usize
        {
            present = e.iter().map(|(_, h)| *h as u64).sum();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if present >= records {
        println!("{topic} already holds {present} records: reused");
        return Ok(());
    }
    let producer: ThreadedProducer<_> = config(bootstrap)
        .set("linger.ms", "20")
        .set("batch.size", batch_bytes.to_string())
        .set("compression.type", compression)
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .create()?;
    let bar = indicatif::ProgressBar::new(records - present);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "filling {msg} {bar:40} {pos}/{len} ({per_sec}, {eta})",
        )
        .context("a progress bar template")?,
    );
    bar.set_message(topic.to_owned());
    let started = Instant::now();
    let mut value = Vec::with_capacity(128);
    for n in present..records {
        let key = n.to_string();
        value_of(n, &mut value);
        let mut record = BaseRecord::to(topic)
            .key(&key)
            .payload(&value)
            .partition((n % partitions as u64) as i32);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, back)) => {
                    // The queue is full: let the producer drain it.
                    std::thread::sleep(Duration::from_millis(5));
                    record = back;
                }
            }
        }
        if n % 10_000 == 0 {
            bar.set_position(n - present);
        }
    }
    producer.flush(Duration::from_secs(120))?;
    bar.finish();
    println!(
        "filled {topic} with {} records in {:.1} s",
        records - present,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The order numbered `n` as a JSON object, its note padded so that the value
/// has `bytes` bytes (or the least an order takes, if that is more), for the
/// benchmarks of SQL over JSON values: about half the orders have an amount over
/// 500.
fn order(n: u64, bytes: usize, out: &mut Vec<u8>) {
    use std::io::Write;
    out.clear();
    let _ = write!(
        out,
        r#"{{"order":{n},"customer":"c{}","amount":{}.5,"note":""#,
        n % 97,
        n * 37 % 1000
    );
    let pad = bytes.saturating_sub(out.len() + 2);
    out.extend(std::iter::repeat_n(b'x', pad));
    out.extend_from_slice(b"\"}");
}

/// Event `n` of a stream of `users` users: window `n / users` of 10 seconds
/// from 2026-01-01T00:00:00Z holds one event of every user, user `n % users`
/// at its own time within the window, so that event time grows with `n` and in
/// every partition: no event is later than a watermark of a few seconds.
fn event(n: u64, users: u64, out: &mut Vec<u8>) {
    use std::io::Write;
    out.clear();
    let (window, user) = (n / users, n % users);
    let ms = window * 10_000 + user * 10_000 / users;
    let (seconds, millis) = (ms / 1000, ms % 1000);
    let (day, second) = (seconds / 86_400, seconds % 86_400);
    let _ = write!(
        out,
        r#"{{"user":"u{user:05}","ts":"2026-01-{:02}T{:02}:{:02}:{:02}.{millis:03}Z","amount":{}}}"#,
        1 + day,
        second / 3600,
        second / 60 % 60,
        second % 60,
        n * 37 % 1000
    );
}

/// Writes the lookup table of `lookup` to `path`, through a file beside it.
fn lookup_table(path: &std::path::Path, rows: u64) -> Result<()> {
    use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::basic::Compression;
    use parquet::file::properties::WriterProperties;
    use std::sync::Arc;

    if path.exists() {
        return Ok(());
    }
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
        Field::new("segment", DataType::Utf8, false),
        Field::new("country", DataType::Utf8, false),
        Field::new("score", DataType::Float64, false),
    ]));
    let segments = ["retail", "wholesale", "online", "partner", "staff"];
    let countries = ["GB", "US", "NL", "DE", "FR", "JP", "BR"];
    let temporary = path.with_extension("tmp");
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(128 * 1024))
        .build();
    let mut writer = ArrowWriter::try_new(
        std::fs::File::create(&temporary)?,
        schema.clone(),
        Some(properties),
    )?;
    let mut start = 0;
    while start < rows {
        let end = (start + 65_536).min(rows);
        let ids: Vec<i64> = (start as i64..end as i64).collect();
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(ids.clone())),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| format!("customer-{i:07}")),
                )),
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| segments[(i % 5) as usize]),
                )),
                Arc::new(StringArray::from_iter_values(
                    ids.iter()
                        .map(|i| countries[(i * 7 % 7 + i / 7 % 7) as usize % 7]),
                )),
                Arc::new(Float64Array::from_iter_values(
                    ids.iter().map(|i| (i * 37 % 1000) as f64 / 10.0),
                )),
            ],
        )?;
        writer.write(&batch)?;
        start = end;
    }
    writer.close()?;
    std::fs::rename(&temporary, path)?;
    Ok(())
}

/// Reads every partition of `topic` to its end, and with `to` produces each
/// record there too.
fn consume(bootstrap: &str, topic: &str, to: Option<&str>) -> Result<()> {
    // The same fetch settings as Sluice's source, so that the baseline is the
    // ceiling for the same client configuration, not a slower default.
    let consumer: BaseConsumer = config(bootstrap)
        .set("group.id", "sluice-bench-baseline")
        .set("enable.auto.commit", "false")
        .set("fetch.queue.backoff.ms", "10")
        .set("fetch.wait.max.ms", "20")
        // Sluice's whole read-ahead, in the one shared queue.
        .set(
            "queued.max.messages.kbytes",
            (sluice_kafka::DEFAULT_READ_AHEAD_BYTES / 1024).to_string(),
        )
        .set(
            "fetch.max.bytes",
            sluice_kafka::default_fetch_max_bytes(sluice_kafka::DEFAULT_READ_AHEAD_BYTES)
                .to_string(),
        )
        .create()?;
    let ends = ends(&consumer, topic)?;
    let total: i64 = ends.iter().map(|(_, h)| *h).sum();
    let mut assignment = TopicPartitionList::new();
    for (p, _) in &ends {
        assignment.add_partition_offset(topic, *p, Offset::Beginning)?;
    }
    let producer: Option<ThreadedProducer<_>> = match to {
        None => None,
        Some(_) => Some(
            config(bootstrap)
                .set("enable.idempotence", "true")
                .set("acks", "all")
                .set("delivery.report.only.error", "true")
                .create()?,
        ),
    };
    // The sizes of the headers Sluice's sink adds: a query id, a batch id and
    // a position.
    let query = "00000000-0000-0000-0000-000000000000";
    let started = Instant::now();
    consumer.assign(&assignment)?;
    let (mut records, mut bytes) = (0_i64, 0_u64);
    while records < total {
        match consumer.poll(Duration::from_secs(10)) {
            Some(Ok(message)) => {
                records += 1;
                bytes += message.payload().map_or(0, |p| p.len()) as u64
                    + message.key().map_or(0, |k| k.len()) as u64;
                if let (Some(producer), Some(to)) = (&producer, to) {
                    pipe_one(producer, to, query, &message)?;
                }
            }
            Some(Err(e)) => eprintln!("baseline consumer: {e}"),
            None => bail!("the baseline consumer stalled after {records} of {total} records"),
        }
    }
    if let Some(producer) = &producer {
        producer.flush(Duration::from_secs(120))?;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"records": records, "bytes": bytes, "seconds": seconds})
    );
    Ok(())
}

/// Produces `message` to `to`, with headers the sizes of Sluice's, waiting
/// while the producer's queue is full.
fn pipe_one(
    producer: &ThreadedProducer<rdkafka::producer::DefaultProducerContext>,
    to: &str,
    query: &str,
    message: &rdkafka::message::BorrowedMessage<'_>,
) -> Result<()> {
    use rdkafka::message::{Header, OwnedHeaders};
    let position = format!(
        "{}-{}@{}",
        message.topic(),
        message.partition(),
        message.offset()
    );
    let headers = OwnedHeaders::new_with_capacity(3)
        .insert(Header {
            key: "sluice.query",
            value: Some(query),
        })
        .insert(Header {
            key: "sluice.batch",
            value: Some("0"),
        })
        .insert(Header {
            key: "sluice.position",
            value: Some(&position),
        });
    let mut record = BaseRecord::<[u8], [u8]>::to(to).headers(headers);
    if let Some(key) = message.key() {
        record = record.key(key);
    }
    if let Some(value) = message.payload() {
        record = record.payload(value);
    }
    if let Some(ms) = message.timestamp().to_millis() {
        record = record.timestamp(ms);
    }
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((
                rdkafka::error::KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::QueueFull,
                ),
                back,
            )) => {
                record = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err((e, _)) => bail!("producing to {to}: {e}"),
        }
    }
}

/// Draws a bar per configuration of `results`, of its `records_per_second`
/// median (which the partition sweep fills with a ratio).
fn chart(results: &str, out: &str, title: &str) -> Result<()> {
    use plotters::prelude::*;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(results)?)?;
    let rows: Vec<(String, f64)> = json["configurations"]
        .as_array()
        .context("results.json has no configurations")?
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_owned(),
                c["records_per_second"]["median"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    let max = rows.iter().map(|r| r.1).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(out, (900, 60 + 40 * rows.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(260)
        .build_cartesian_2d(0.0..max, (0..rows.len()).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(i) => rows.get(*i).map(|r| r.0.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .x_label_formatter(&|x| {
            if max > 100.0 {
                format!("{:.0}k", x / 1000.0)
            } else {
                format!("{x:.1}")
            }
        })
        .draw()?;
    chart.draw_series(rows.iter().enumerate().map(|(i, (_, value))| {
        Rectangle::new(
            [
                (0.0, SegmentValue::Exact(i)),
                (*value, SegmentValue::Exact(i + 1)),
            ],
            BLUE.mix(0.6).filled(),
        )
    }))?;
    root.present()?;
    println!("wrote {out}");
    Ok(())
}
