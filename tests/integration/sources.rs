//! Several sources in one query against the real broker: a JSON topic and an
//! Avro topic read as two tables of one query, each with its own rate limit,
//! a line per source in every plan of the checkpoint, and a checkpoint whose
//! sources differ from the configuration's refused with exit 2; and the two,
//! each joined with a lookup table and deduplicated together, exactly once
//! through SIGKILLs with both stores.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use sluice_core::PartitionOffsets;
use sluice_tests::kafka::{Out, create_topic, delete_topic, produce, produce_values, producer};
use sluice_tests::process::{Lcg, Running, run, stderr};

pub(crate) const ORDER_AVSC: &str = r#"{"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "order", "type": "long"},
    {"name": "customer", "type": "string"},
    {"name": "amount", "type": "long"}]}"#;

const SQL: &str = "SELECT 'order' AS kind, order, customer FROM orders \
                   UNION ALL SELECT 'payment' AS kind, order, customer FROM payments";

/// The `[sources.*]` sections for `orders` (JSON) and `payments` (Avro in
/// Confluent's framing), in the order `reversed` says.
pub(crate) fn sources(dir: &Path, orders: &str, payments: &str, reversed: bool) -> String {
    let bootstrap = sluice_tests::kafka_bootstrap();
    let orders = format!(
        "[sources.orders]\nbootstrap_servers = \"{bootstrap}\"\nsubscribe = [\"{orders}\"]\n\
         starting_offsets = \"earliest\"\nmax_offsets_per_trigger = 7\nformat = \"json\"\n\
         schema = \"order BIGINT, customer STRING\"\n"
    );
    let payments = format!(
        "[sources.payments]\nbootstrap_servers = \"{bootstrap}\"\nsubscribe = [\"{payments}\"]\n\
         starting_offsets = \"earliest\"\nformat = \"avro\"\nschema_file = \"{}\"\n\
         avro_wire_format = \"confluent\"\navro_schema_id = 12\n",
        dir.join("order.avsc").display()
    );
    match reversed {
        false => format!("{orders}\n{payments}"),
        true => format!("{payments}\n{orders}"),
    }
}

/// A config of `sources` read once into `dir/out` by [`SQL`]; written to `name`.
pub(crate) fn config(dir: &Path, name: &str, sources: &str) -> std::path::PathBuf {
    config_with(dir, name, sources, SQL)
}

/// [`config`] with `sql` for the query.
fn config_with(dir: &Path, name: &str, sources: &str, sql: &str) -> std::path::PathBuf {
    let checkpoint = format!("location = \"{}\"", dir.join("checkpoint").display());
    let query = format!("sql = \"{sql}\"");
    write_config(
        dir,
        name,
        sources,
        (&checkpoint, "available_now = true", &query),
    )
}

/// Writes to `dir/name` a config of `sources` (and lookup tables), the
/// `[checkpoint]`, `[trigger]` and `[query]` lines given, progress to
/// `dir/progress.jsonl` and rows to `dir/out`.
fn write_config(
    dir: &Path,
    name: &str,
    sources: &str,
    (checkpoint, trigger, query): (&str, &str, &str),
) -> PathBuf {
    let text = format!(
        r#"
{sources}

[checkpoint]
{checkpoint}

[trigger]
{trigger}

[progress]
file = "{progress}"

[sink]
type = "jsonl"
path = "{out}"

[query]
{query}
"#,
        progress = dir.join("progress.jsonl").display(),
        out = dir.join("out").display(),
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Writes the orders numbered `orders.1` as JSON over two partitions of
/// `orders.0`, and the payments numbered `payments.1` as Avro (schema id 12)
/// to `payments.0`.
async fn produce_orders_and_payments(
    p: &rdkafka::producer::FutureProducer,
    orders: (&str, std::ops::Range<u64>),
    payments: (&str, std::ops::Range<u64>),
) {
    let batch: Vec<Out> = orders
        .1
        .map(|i| {
            Out::new(
                (i % 2) as i32,
                format!("k{i}"),
                format!(r#"{{"order":{i},"customer":"c{}"}}"#, i % 5),
            )
        })
        .collect();
    produce(p, orders.0, &batch).await;
    let values: Vec<(i32, Option<Vec<u8>>)> = payments
        .1
        .map(|n| (0, Some(crate::sql::avro_order(12, n))))
        .collect();
    produce_values(p, payments.0, &values).await;
}

/// Every row the query wrote, counted by (kind, order).
fn rows(dir: &Path) -> BTreeMap<(String, u64), usize> {
    let mut rows = BTreeMap::new();
    for row in crate::sql::lines(&dir.join("out")) {
        let kind = row["kind"].as_str().unwrap().to_owned();
        *rows
            .entry((kind, row["order"].as_u64().unwrap()))
            .or_default() += 1;
    }
    rows
}

#[tokio::test]
async fn a_json_and_an_avro_topic_are_two_tables_of_one_query_with_a_plan_line_each() {
    let orders = sluice_tests::unique_name("orders");
    let payments = sluice_tests::unique_name("payments");
    create_topic(&orders, 2).await;
    create_topic(&payments, 1).await;
    let p = producer();
    produce_orders_and_payments(&p, (&orders, 0..30), (&payments, 100..112)).await;

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("order.avsc"), ORDER_AVSC).unwrap();
    let query = config(
        dir.path(),
        "query.toml",
        &sources(dir.path(), &orders, &payments, false),
    );
    let output = run(&["run", "--config", query.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let mut want = BTreeMap::new();
    for n in 0..30 {
        want.insert(("order".to_owned(), n), 1);
    }
    for n in 100..112 {
        want.insert(("payment".to_owned(), n), 1);
    }
    assert_eq!(rows(dir.path()), want, "every record of both topics once");

    // Spark's layout: a line per source in every plan, in the config's order,
    // and each source's initial offsets in sources/<i>/0.
    let checkpoint = dir.path().join("checkpoint");
    let plan = std::fs::read_to_string(checkpoint.join("offsets/0")).unwrap();
    let lines: Vec<&str> = plan.lines().collect();
    assert_eq!(lines.len(), 4, "{plan}");
    assert!(
        lines[2].contains(&orders) && !lines[2].contains(&payments),
        "{plan}"
    );
    assert!(
        lines[3].contains(&payments) && !lines[3].contains(&orders),
        "{plan}"
    );
    for (index, topic) in [(0, &orders), (1, &payments)] {
        let initial = std::fs::read(checkpoint.join(format!("sources/{index}/0"))).unwrap();
        assert!(String::from_utf8_lossy(&initial).contains(topic.as_str()));
    }

    // Each source has its own part of every report, and only the orders are
    // limited: 7 offsets a batch.
    let reports: Vec<Value> = std::fs::read_to_string(dir.path().join("progress.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        reports.len() >= 5,
        "30 orders at 7 a batch: {}",
        reports.len()
    );
    let mut read = [0, 0];
    for report in &reports {
        let sources = report["sources"].as_array().unwrap();
        assert_eq!(sources.len(), 2, "{report}");
        assert!(
            sources[0]["description"]
                .as_str()
                .unwrap()
                .contains(&orders)
        );
        assert!(
            sources[1]["description"]
                .as_str()
                .unwrap()
                .contains(&payments)
        );
        let orders_read = sources[0]["numInputRows"].as_u64().unwrap();
        assert!(orders_read <= 7, "{report}");
        read[0] += orders_read;
        read[1] += sources[1]["numInputRows"].as_u64().unwrap();
    }
    assert_eq!(read, [30, 12]);

    // The same checkpoint with the sources in another order, or one of
    // them, is refused before anything is read.
    let reversed = config(
        dir.path(),
        "reversed.toml",
        &sources(dir.path(), &orders, &payments, true),
    );
    let only = config_with(
        dir.path(),
        "one.toml",
        sources(dir.path(), &orders, &payments, false)
            .split("[sources.payments]")
            .next()
            .unwrap(),
        "SELECT 'order' AS kind, order, customer FROM orders",
    );
    // `validate` finds both sources' partitions, and a checkpoint of another
    // number of sources.
    let valid = run(&["validate", "--config", query.to_str().unwrap()]);
    assert!(valid.status.success(), "{}", stderr(&valid));
    let said = String::from_utf8_lossy(&valid.stdout);
    assert!(said.contains("3 partitions"), "{said}");
    let refused = run(&["validate", "--config", only.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("holds offsets of 2 source(s), and the query reads 1"),
        "{}",
        stderr(&refused)
    );
    for (changed, named) in [(&reversed, "2 (KafkaV2[Subscribe["), (&only, "1 (KafkaV2")] {
        let output = run(&["run", "--config", changed.to_str().unwrap()]);
        let log = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{log}");
        assert!(
            log.contains("the checkpoint holds offsets of 2 source(s)") && log.contains(named),
            "{log}"
        );
    }
    assert_eq!(rows(dir.path()), want, "nothing more was written");

    // `offsets show` has each source's end offsets, in order.
    let shown = run(&[
        "offsets",
        "show",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
    ]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let shown: Value = serde_json::from_slice(&shown.stdout).unwrap();
    let lines = &shown["sources"]["endOffsets"];
    assert_eq!(lines[0][&orders]["0"], 15, "{shown}");
    assert_eq!(lines[1][&payments]["0"], 12, "{shown}");

    // `offsets set` moves the payments back to 8 and keeps both lines: the
    // query reads payments 108 to 111 again and nothing of the orders.
    let moved = run(&[
        "offsets",
        "set",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--offsets",
        &format!("{{\"{payments}\":{{\"0\":8}}}}"),
    ]);
    assert!(moved.status.success(), "{}", stderr(&moved));
    let output = run(&["run", "--config", query.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    for n in 108..112 {
        want.insert(("payment".to_owned(), n), 2);
    }
    assert_eq!(
        rows(dir.path()),
        want,
        "the moved source read again, the other not"
    );
    delete_topic(&orders).await;
    delete_topic(&payments).await;
}

#[tokio::test]
async fn the_continuous_trigger_reads_both_sources_as_they_come_and_plans_a_line_each() {
    let orders = sluice_tests::unique_name("corders");
    let payments = sluice_tests::unique_name("cpayments");
    create_topic(&orders, 2).await;
    create_topic(&payments, 1).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("order.avsc"), ORDER_AVSC).unwrap();
    let checkpoint = format!("location = \"{}\"", dir.path().join("checkpoint").display());
    let query = write_config(
        dir.path(),
        "query.toml",
        &sources(dir.path(), &orders, &payments, false),
        (
            &checkpoint,
            "continuous = \"300ms\"",
            &format!("sql = \"{SQL}\""),
        ),
    );
    let running = Running::spawn(&["run", "--config", query.to_str().unwrap()]);
    // Records of both topics come while the query runs, in three rounds.
    let p = producer();
    let mut want = BTreeMap::new();
    for round in 0..3_u64 {
        let (order_numbers, payment_numbers) = (
            round * 10..round * 10 + 10,
            100 + round * 4..104 + round * 4,
        );
        produce_orders_and_payments(&p, (&orders, order_numbers), (&payments, payment_numbers))
            .await;
        want.extend((round * 10..round * 10 + 10).map(|n| (("order".to_owned(), n), 1)));
        want.extend((100 + round * 4..104 + round * 4).map(|n| (("payment".to_owned(), n), 1)));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while rows(dir.path()) != want && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            rows(dir.path()),
            want,
            "round {round}: every record so far, once"
        );
    }
    running.signal("-TERM");
    let output = running.wait();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    // Each epoch's plan has a line per source, and the last ends past every record.
    let plans = dir.path().join("checkpoint").join("offsets");
    let mut last = None;
    for entry in std::fs::read_dir(&plans).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if let Ok(n) = name.parse::<u64>() {
            let plan = std::fs::read_to_string(plans.join(&name)).unwrap();
            assert_eq!(plan.lines().count(), 4, "{plan}");
            last = last.max(Some(n));
        }
    }
    let shown = run(&[
        "offsets",
        "show",
        "--checkpoint",
        dir.path().join("checkpoint").to_str().unwrap(),
    ]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let shown: Value = serde_json::from_slice(&shown.stdout).unwrap();
    let lines = &shown["sources"]["endOffsets"];
    assert_eq!(lines[0][&orders]["0"], 15, "after {last:?}: {shown}");
    assert_eq!(lines[0][&orders]["1"], 15, "{shown}");
    assert_eq!(lines[1][&payments]["0"], 12, "{shown}");
    assert_eq!(rows(dir.path()), want, "nothing written twice by the stop");
    delete_topic(&orders).await;
    delete_topic(&payments).await;
}

#[test]
fn sources_that_cannot_be_one_query_are_refused_with_exit_2_and_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("order.avsc"), ORDER_AVSC).unwrap();
    let both = sources(dir.path(), "a", "b", false);
    let cases = [
        (
            format!("[source]\nbootstrap_servers = \"127.0.0.1:1\"\nsubscribe = [\"x\"]\n\n{both}"),
            "[source] and [sources.*] are both set",
        ),
        (
            sources(dir.path(), "a", "a", false),
            "topic a is read by [sources.orders] and [sources.payments]",
        ),
        (
            both.replace("[sources.payments]", "[sources.orders]"),
            "line 10, column 10: duplicate key",
        ),
        (
            both.replace(
                "subscribe = [\"b\"]",
                "subscribe = [\"b\"]\ntable = \"pay\"",
            ),
            "[sources.payments] sets table = \"pay\"",
        ),
        (
            both.replace("max_offsets_per_trigger = 7", "min_offsets_per_trigger = 7"),
            "[sources.orders]: min_offsets_per_trigger is for a query of one source",
        ),
    ];
    for (sources, expected) in cases {
        let path = config(dir.path(), "bad.toml", &sources);
        let output = run(&["validate", "--config", path.to_str().unwrap()]);
        let log = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{expected}: {log}");
        let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("sluice: ")).collect();
        assert_eq!(errors.len(), 1, "one line for {expected}: {log}");
        assert!(errors[0].contains(expected), "{expected}: {log}");
    }
}

/// Payment `n` in Avro, raw: `{n: long, customer: string, amount: long, ts:
/// timestamp-millis}`, of customer `p<n % 5>` at order `n`'s event time.
fn payment(n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    crate::sql::avro_long(&mut out, n as i64);
    let customer = format!("p{}", n % 5);
    crate::sql::avro_long(&mut out, customer.len() as i64);
    out.extend_from_slice(customer.as_bytes());
    crate::sql::avro_long(&mut out, (n % 100) as i64);
    crate::sql::avro_long(&mut out, crate::stateful::event_ms(n));
    out
}

const PAYMENT_AVSC: &str = r#"{"type": "record", "name": "Payment", "fields": [
    {"name": "n", "type": "long"},
    {"name": "customer", "type": "string"},
    {"name": "amount", "type": "long"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}"#;

/// Keeps producing payments, payment `n` to partition `dedupe_key(n) % 3`,
/// until told to stop; returns each partition's payments in offset order.
fn keep_paying(
    topic: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<BTreeMap<i32, Vec<u64>>> {
    tokio::spawn(async move {
        let p = producer();
        let mut produced: BTreeMap<i32, Vec<u64>> = BTreeMap::new();
        let mut n = 0_u64;
        while !stop.load(Ordering::Relaxed) {
            let mut batch = Vec::new();
            for _ in 0..30 {
                let partition = (crate::stateful::dedupe_key(n) % 3) as i32;
                batch.push((partition, Some(payment(n))));
                produced.entry(partition).or_default().push(n);
                n += 1;
            }
            produce_values(&p, &topic, &batch).await;
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        produced
    })
}

/// The crash test's config: orders (JSON) enriched from the CSV file
/// `customers`, payments (Avro) from the Cassandra table `tiers`, the union
/// deduplicated on customer and amount.
fn crash_config(
    job: &crate::stateful::StatefulJob,
    name: &str,
    (orders, payments, keyspace): (&str, &str, &str),
    trigger: &str,
) -> PathBuf {
    let replication = match job.checkpoint().starts_with("cassandra://") {
        true => format!("replication = \"{}\"", sluice_tests::TEST_REPLICATION),
        false => String::new(),
    };
    let delay = crate::stateful::DELAY_MS;
    let text = format!(
        r#"
[sources.orders]
bootstrap_servers = "{bootstrap}"
subscribe = ["{orders}"]
starting_offsets = "earliest"
max_offsets_per_trigger = 300
poll_timeout_ms = 20000
format = "json"
schema = "n BIGINT, customer STRING, amount BIGINT, ts TIMESTAMP"
event_time = "ts"
watermark_delay = "{delay}ms"

[sources.payments]
bootstrap_servers = "{bootstrap}"
subscribe = ["{payments}"]
starting_offsets = "earliest"
max_offsets_per_trigger = 200
poll_timeout_ms = 20000
format = "avro"
schema_file = "{avsc}"
event_time = "ts"
watermark_delay = "{delay}ms"

[tables.customers]
path = "{customers}"
format = "csv"
schema = "name STRING, segment STRING"

[tables.tiers]
type = "cassandra"
contact_points = "{nodes}"
keyspace = "{keyspace}"
table = "tiers"
schema = "name STRING, tier STRING"
"#,
        bootstrap = sluice_tests::kafka_bootstrap(),
        avsc = job.path("payment.avsc").display(),
        customers = job.path("customers.csv").display(),
        nodes = sluice_tests::cassandra_nodes().join(","),
    );
    let checkpoint = format!(
        "location = \"{}\"\nmin_batches_to_retain = 100000\n{replication}",
        job.checkpoint()
    );
    let query = r#"state_partitions = 2
sql = """
SELECT DISTINCT ON (customer, amount) n, customer, amount, label FROM (
  SELECT o.n, o.customer, o.amount, o.ts, c.segment AS label
  FROM orders o LEFT JOIN customers c ON o.customer = c.name
  UNION ALL
  SELECT p.n, p.customer, p.amount, p.ts, t.tier AS label
  FROM payments p LEFT JOIN tiers t ON p.customer = t.name
)
""""#;
    write_config(job.dir(), name, &text, (&checkpoint, trigger, query))
}

/// What the deduplication of the union emits, batch by batch as the plans
/// read both topics, under each batch's recorded watermark: the rows that are
/// the first of their (source, key) while the watermark keeps it. Checks that
/// the plans tile both topics, and that each recorded watermark lies between
/// the last one and what the least of the sources' watermarks allows.
fn union_dedupe_oracle(
    produced: [(&str, &BTreeMap<i32, Vec<u64>>); 2],
    plans: &BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)>,
) -> (BTreeSet<(usize, u64)>, u64) {
    let delay = crate::stateful::DELAY_MS;
    let ids: Vec<u64> = plans.keys().copied().collect();
    assert_eq!(ids, (0..plans.len() as u64).collect::<Vec<_>>());
    let mut held: BTreeMap<(usize, u64), i64> = BTreeMap::new();
    let mut emitted = BTreeSet::new();
    let mut duplicates = 0;
    let mut next: BTreeMap<(usize, i32), i64> = BTreeMap::new();
    let mut source_marks: [Option<i64>; 2] = [None, None];
    let mut last = 0_i64;
    for (batch, (start, end, watermark)) in plans {
        let allowed = source_marks
            .iter()
            .flatten()
            .min()
            .map_or(last, |least| last.max(*least));
        assert!(
            last <= *watermark && *watermark <= allowed,
            "batch {batch} ran under {watermark}, after {last}, with the sources allowing {allowed}"
        );
        last = *watermark;
        let mut latest = [None::<i64>; 2];
        for (tp, until) in end {
            let source = produced
                .iter()
                .position(|(topic, _)| *topic == &*tp.topic)
                .unwrap();
            let from = start.get(tp).map_or(0, |o| o.value());
            assert_eq!(
                from,
                next.get(&(source, tp.partition)).copied().unwrap_or(0),
                "batch {batch} starts {tp} where the last ended it"
            );
            next.insert((source, tp.partition), until.value());
            for offset in from..until.value() {
                let n = produced[source].1[&tp.partition][offset as usize];
                let ts = crate::stateful::event_ms(n);
                latest[source] = Some(latest[source].map_or(ts, |l: i64| l.max(ts)));
                if ts < *watermark {
                    continue;
                }
                let key = (source, crate::stateful::dedupe_key(n));
                match held.get(&key) {
                    Some(&expires) if expires >= *watermark => duplicates += 1,
                    _ => {
                        held.insert(key, ts + delay);
                        emitted.insert((source, n));
                    }
                }
            }
        }
        for (mark, latest) in source_marks.iter_mut().zip(latest) {
            if let Some(latest) = latest {
                *mark = Some(mark.map_or(latest - delay, |m| m.max(latest - delay)));
            }
        }
    }
    for (source, (topic, produced)) in produced.iter().enumerate() {
        for (partition, rows) in produced.iter() {
            assert_eq!(
                next.get(&(source, *partition)).copied().unwrap_or(0),
                rows.len() as i64,
                "the plans read {topic}-{partition} to its last record"
            );
        }
    }
    (emitted, duplicates)
}

/// Two topics in two formats, each enriched from a lookup table that changes
/// while the query runs and is killed (a CSV file rewritten in place, a
/// Cassandra table read by key), their union deduplicated: exactly the
/// oracle's rows, each with a version of its table.
async fn two_sources_exactly_once_through_sigkills(cassandra: bool) {
    let orders = sluice_tests::unique_name("unionorders");
    let payments = sluice_tests::unique_name("unionpayments");
    create_topic(&orders, 3).await;
    create_topic(&payments, 3).await;
    let job = crate::stateful::StatefulJob::new(&orders, cassandra);
    std::fs::write(job.path("payment.avsc"), PAYMENT_AVSC).unwrap();
    let (session, keyspace) = sluice_tests::keyspace_with(
        "uniontiers",
        &["CREATE TABLE {keyspace}.tiers (name text PRIMARY KEY, tier text)"],
    )
    .await;
    crate::stateful::set_tiers(&session, &keyspace, "p", "old").await;
    std::fs::write(
        job.path("customers.csv"),
        crate::stateful::segments_csv("one"),
    )
    .unwrap();
    let names = (orders.as_str(), payments.as_str(), keyspace.as_str());
    let streaming = crash_config(&job, "streaming.toml", names, "processing_time = \"0s\"");
    let stop = Arc::new(AtomicBool::new(false));
    let ordering = crate::stateful::keep_producing_to(
        orders.clone(),
        |n| (crate::stateful::dedupe_key(n) % 3) as i32,
        stop.clone(),
    );
    let paying = keep_paying(payments.clone(), stop.clone());
    let mut random = Lcg::from_clock("two sources crash test");
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 10, (300, 900), &mut random).await;
    std::fs::write(
        job.path("customers.csv"),
        crate::stateful::segments_csv("two"),
    )
    .unwrap();
    crate::stateful::set_tiers(&session, &keyspace, "p", "new").await;
    sluice_tests::process::kill_at_random_moments(&streaming, 10, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced_orders = ordering.await.unwrap();
    let produced_payments = paying.await.unwrap();
    let catch_up = crash_config(&job, "catch_up.toml", names, "available_now = true");
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let plans = job.plans().await;
    let (expected, duplicates) = union_dedupe_oracle(
        [
            (orders.as_str(), &produced_orders),
            (payments.as_str(), &produced_payments),
        ],
        &plans,
    );
    let mut versions = BTreeMap::<String, u64>::new();
    let mut got = BTreeSet::new();
    let mut rows = 0;
    for row in crate::sql::lines(&job.path("out")) {
        let n = row["n"].as_u64().unwrap();
        let customer = row["customer"].as_str().unwrap();
        let source = usize::from(customer.starts_with('p'));
        let prefix = ["c", "p"][source];
        assert_eq!(customer, format!("{prefix}{}", n % 5), "{row}");
        let label = row["label"].as_str().unwrap_or_default();
        let version = label.strip_suffix(&format!("-{customer}"));
        let allowed: &[&str] = [&["one", "two"][..], &["old", "new"][..]][source];
        assert!(
            version.is_some_and(|v| allowed.contains(&v)),
            "a version of its table: {row}"
        );
        *versions.entry(version.unwrap().to_owned()).or_default() += 1;
        got.insert((source, n));
        rows += 1;
    }
    println!(
        "{} first rows of their key, {duplicates} duplicates, {} batches; rows by version: \
         {versions:?}",
        expected.len(),
        plans.len()
    );
    assert!(duplicates > 0);
    assert_eq!(rows, got.len(), "no row repeated");
    assert_eq!(
        got, expected,
        "exactly the first row of each key of each source"
    );
    for version in ["one", "two", "old", "new"] {
        assert!(
            versions.contains_key(version),
            "rows joined with {version}: {versions:?}"
        );
    }
    // Every report has each source's part.
    for report in std::fs::read_to_string(&progress).unwrap().lines() {
        let report: Value = serde_json::from_str(report).unwrap();
        assert_eq!(report["sources"].as_array().unwrap().len(), 2, "{report}");
    }
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap();
    delete_topic(&orders).await;
    delete_topic(&payments).await;
}

#[tokio::test]
async fn two_sources_with_lookups_and_dedupe_are_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
 {
    two_sources_exactly_once_through_sigkills(false).await;
}

#[tokio::test]
async fn two_sources_with_lookups_and_dedupe_are_exactly_once_through_sigkills_with_the_cassandra_store()
 {
    two_sources_exactly_once_through_sigkills(true).await;
}
