//! Lookup tables against the real broker: a stream of orders enriched from a
//! CSV file that is replaced in place while the query runs and is killed, each
//! output row checked against the version of the table its batch recorded; and
//! a lookup table that cannot be used refused at the start with exit 2.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use sluice_tests::kafka::{Out, create_topic, delete_topic, produce, producer};
use sluice_tests::process::{Lcg, Running, run, stderr};

const SQL: &str = "SELECT o.order, o.customer, c.segment FROM orders o \
                   LEFT JOIN customers c ON o.customer = c.name";

/// The lookup file's text: a segment per customer `c0` to `c<customers - 1>`,
/// tagged with `tag`.
fn customers(tag: &str, customers: u64) -> String {
    let mut text = String::from("name,segment\n");
    for c in 0..customers {
        text.push_str(&format!("c{c},{tag}-c{c}\n"));
    }
    text
}

/// Produces orders `{"order": n, "customer": "c<n % 8>"}` until told to stop;
/// returns how many.
fn keep_producing(topic: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let p = producer();
        let mut n = 0_u64;
        while !stop.load(Ordering::Relaxed) {
            let batch: Vec<Out> = (n..n + 40)
                .map(|i| {
                    Out::new(
                        (i % 3) as i32,
                        format!("k{i}"),
                        format!(r#"{{"order":{i},"customer":"c{}"}}"#, i % 8),
                    )
                })
                .collect();
            produce(&p, &topic, &batch).await;
            n += 40;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        n
    })
}

/// A config reading `topic` into `dir/out` with `tables` (the `[tables.*]`
/// sections), `trigger` and `sql`, `max` offsets a batch; written to `name`.
fn config_of(
    dir: &Path,
    name: &str,
    topic: &str,
    (tables, trigger, sql, max): (&str, &str, &str, u64),
) -> std::path::PathBuf {
    let text = format!(
        r#"
[source]
bootstrap_servers = "{bootstrap}"
subscribe = ["{topic}"]
starting_offsets = "earliest"
max_offsets_per_trigger = {max}
table = "orders"
format = "json"
schema = "order BIGINT, customer STRING"

{tables}

[checkpoint]
location = "{checkpoint}"

[trigger]
{trigger}

[progress]
file = "{progress}"

[sink]
type = "jsonl"
path = "{out}"

[query]
sql = "{sql}"
"#,
        bootstrap = sluice_tests::kafka_bootstrap(),
        checkpoint = dir.join("checkpoint").display(),
        progress = dir.join("progress.jsonl").display(),
        out = dir.join("out").display(),
    );
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// The crash test's config: the CSV table at `table` joined by [`SQL`].
fn config(dir: &Path, topic: &str, table: &Path, trigger: &str) -> std::path::PathBuf {
    let tables = format!(
        "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\n\
         schema = \"name STRING, segment STRING\"",
        table.display()
    );
    let name = format!("query-{}.toml", trigger.len());
    config_of(dir, &name, topic, (&tables, trigger, SQL, 300))
}

/// Every report of the progress file, by batch: the last one, which a
/// replay's report replaces.
fn reports(dir: &Path) -> BTreeMap<u64, Value> {
    std::fs::read_to_string(dir.join("progress.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|r| (r["batchId"].as_u64().unwrap(), r))
        .collect()
}

#[tokio::test]
async fn a_csv_lookup_replaced_in_place_enriches_each_batch_from_the_version_it_records() {
    let topic = sluice_tests::unique_name("lookup");
    create_topic(&topic, 3).await;
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("customers.csv");
    let (first, second) = (customers("one", 7), customers("two", 8));
    std::fs::write(&table, &first).unwrap();
    let streaming = config(dir.path(), &topic, &table, "processing_time = \"0s\"");
    let progress = dir.path().join("progress.jsonl");

    let stop = Arc::new(AtomicBool::new(false));
    let producing = keep_producing(topic.clone(), stop.clone());
    let mut random = Lcg::from_clock("lookup crash test");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 6, (400, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "6 killed runs");

    // One run sees the file rewritten in place twice: a version that does not
    // parse, which leaves the first in force, then the second.
    let running = Running::spawn(&["run", "--config", streaming.to_str().unwrap()]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    std::fs::write(&table, "name,segment\nc0,broken\n\"c1,unterminated\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    std::fs::write(&table, &second).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    running.signal("-KILL");
    let log = running.wait();
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 6, (400, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "6 more killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producing.await.unwrap();

    let catch_up = config(dir.path(), &topic, &table, "available_now = true");
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let reports = reports(dir.path());
    assert!(
        reports.values().any(|r| {
            let table = &r["lookupTables"][0];
            table["numFailedReloads"].as_u64() >= Some(1)
                && table["lastError"]
                    .as_str()
                    .is_some_and(|e| e.contains("customers.csv"))
        }),
        "a report counts the reload that failed, naming the file; the run's log:\n{}",
        stderr(&log)
    );
    // The two versions differ in length, which each report's version names.
    let reported = |batch: u64| -> Option<&str> {
        let version = reports.get(&batch)?["lookupTables"][0]["version"].as_str()?;
        if version.contains(&format!(" {} bytes", first.len())) {
            Some("one")
        } else if version.contains(&format!(" {} bytes", second.len())) {
            Some("two")
        } else {
            panic!("batch {batch} joined with a version of neither length: {version}")
        }
    };
    let mut seen = BTreeSet::new();
    let mut joined = BTreeMap::<&str, u64>::new();
    let mut unreported = 0;
    for entry in std::fs::read_dir(dir.path().join("out")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        let stem = path.file_stem().unwrap().to_str().unwrap();
        let batch: u64 = stem.rsplit('-').next().unwrap().parse().unwrap();
        // Every row of a batch joined with one version, the one its report
        // names. A run killed between a commit and its report leaves a batch
        // without one; its rows must still agree among themselves.
        let mut version: Option<&str> = None;
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let row: Value = serde_json::from_str(line).unwrap();
            let order = row["order"].as_u64().unwrap();
            let customer = format!("c{}", order % 8);
            assert_eq!(row["customer"], customer.as_str());
            let segment = row.get("segment").cloned().unwrap_or(Value::Null);
            let this = match segment.as_str() {
                None if order % 8 == 7 => "one",
                Some(s) if s == format!("one-{customer}") && order % 8 != 7 => "one",
                Some(s) if s == format!("two-{customer}") => "two",
                _ => panic!("order {order} in batch {batch}: segment {segment} is no version's"),
            };
            assert_eq!(
                *version.get_or_insert(this),
                this,
                "batch {batch} joined with both versions"
            );
            assert!(seen.insert(order), "order {order} written twice");
        }
        let Some(version) = version else { continue };
        match reported(batch) {
            Some(named) => assert_eq!(named, version, "batch {batch}'s report"),
            None => unreported += 1,
        }
        *joined.entry(version).or_default() += 1;
    }
    println!("batches without a report (killed before it): {unreported}");
    println!("{produced} orders produced; batches joined with each version: {joined:?}");
    assert_eq!(seen.len() as u64, produced, "every order exactly once");
    assert!(
        joined.get("one") > Some(&0) && joined.get("two") > Some(&0),
        "batches joined with both versions: {joined:?}"
    );
    delete_topic(&topic).await;
}

#[test]
fn a_lookup_table_that_cannot_be_used_stops_the_start_with_exit_2_and_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.csv");
    std::fs::write(&good, "name,segment\nc0,gold\n").unwrap();
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "name,segment,extra\nc0,gold,x\n").unwrap();
    let cases = [
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, segment STRING\"",
                bad.display()
            ),
            SQL.to_owned(),
            "bad.csv",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, segment STRING\"",
                dir.path().join("missing.csv").display()
            ),
            SQL.to_owned(),
            "missing.csv: No such file",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name BIGINT, segment STRING\"",
                good.display()
            ),
            "SELECT o.order FROM orders o JOIN customers c ON o.customer = c.name".to_owned(),
            "good.csv",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, segment STRING\"",
                good.display()
            ),
            "SELECT o.order FROM orders o JOIN customers c ON o.order = c.name".to_owned(),
            "the join key o.order is BIGINT and c.name is STRING",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, segment STRING\"",
                good.display()
            ),
            "SELECT o.order FROM orders o JOIN suppliers s ON o.customer = s.name".to_owned(),
            "table 'suppliers' not found",
        ),
        (
            format!(
                "[tables.orders]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING\"",
                good.display()
            ),
            SQL.to_owned(),
            "[tables.orders]: the stream is the table `orders`",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, segment STRING\"\nmax_memory_mb = 0",
                good.display()
            ),
            SQL.to_owned(),
            "max_memory_mb = 0",
        ),
        (
            format!(
                "[tables.customers]\npath = \"{}\"\nformat = \"csv\"",
                good.display()
            ),
            SQL.to_owned(),
            "[tables.customers] needs schema",
        ),
    ];
    for (table, sql, expected) in cases {
        let config = dir.path().join("query.toml");
        std::fs::write(
            &config,
            format!(
                r#"
[source]
bootstrap_servers = "127.0.0.1:1"
subscribe = ["orders"]
table = "orders"
format = "json"
schema = "order BIGINT, customer STRING"

{table}

[checkpoint]
location = "{checkpoint}"

[sink]
type = "console"

[query]
sql = "{sql}"
"#,
                checkpoint = dir.path().join("checkpoint").display()
            ),
        )
        .unwrap();
        let output = run(&["validate", "--config", config.to_str().unwrap()]);
        let log = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{expected}: {log}");
        // The log's lines are the loaded tables'; the error is the one line
        // the binary writes in its own name.
        let errors: Vec<&str> = log.lines().filter(|l| l.starts_with("sluice: ")).collect();
        assert_eq!(errors.len(), 1, "one line for {expected}: {log}");
        assert!(errors[0].contains(expected), "{expected}: {log}");
    }
}

/// A config reading `topic` once (`available_now`), with `table` as
/// `[tables.customers]` and `sql` as the query, into `dir/out`.
fn once(dir: &Path, topic: &str, table: &str, sql: &str) -> std::path::PathBuf {
    config_of(
        dir,
        "once.toml",
        topic,
        (table, "available_now = true", sql, 50),
    )
}

/// Every row the query wrote, by order number.
fn rows_by_order(dir: &Path) -> BTreeMap<u64, Value> {
    crate::sql::lines(&dir.join("out"))
        .into_iter()
        .map(|row| (row["order"].as_u64().unwrap(), row))
        .collect()
}

#[tokio::test]
async fn a_cassandra_lookup_table_is_read_by_key_as_each_batch_runs() {
    let topic = sluice_tests::unique_name("lookupcass");
    create_topic(&topic, 2).await;
    let (session, keyspace) = sluice_tests::keyspace_with(
        "lookup",
        &["CREATE TABLE {keyspace}.customers (name text PRIMARY KEY, segment text, since bigint)"],
    )
    .await;
    for (name, segment) in [("c0", "gold"), ("c1", "silver"), ("c2", "tin")] {
        session
            .query_unpaged(
                format!("INSERT INTO {keyspace}.customers (name, segment, since) VALUES (?, ?, 7)"),
                (name, segment),
            )
            .await
            .unwrap();
    }
    let orders = |from: u64| -> Vec<Out> {
        (from..from + 100)
            .map(|n| {
                Out::new(
                    (n % 2) as i32,
                    format!("k{n}"),
                    format!(r#"{{"order":{n},"customer":"c{}"}}"#, n % 4),
                )
            })
            .collect()
    };
    let p = producer();
    produce(&p, &topic, &orders(0)).await;
    let dir = tempfile::tempdir().unwrap();
    let section = format!(
        "[tables.customers]\ntype = \"cassandra\"\ncontact_points = \"{}\"\nkeyspace = \
         \"{keyspace}\"\ntable = \"customers\"\nschema = \"name STRING, segment STRING, since \
         BIGINT\"\nin_flight = 4",
        sluice_tests::cassandra_nodes().join(",")
    );
    let sql = "SELECT o.order, o.customer, c.segment, c.since FROM orders o \
               LEFT JOIN customers c ON o.customer = c.name";
    let config = once(dir.path(), &topic, &section, sql);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    // A row changed in Cassandra is read as it is by the batches after.
    session
        .query_unpaged(
            format!("UPDATE {keyspace}.customers SET segment = 'platinum' WHERE name = 'c2'"),
            (),
        )
        .await
        .unwrap();
    produce(&p, &topic, &orders(100)).await;
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let rows = rows_by_order(dir.path());
    assert_eq!(rows.len(), 200, "every order once");
    for (order, row) in &rows {
        let want = match (order % 4, *order < 100) {
            (0, _) => serde_json::json!("gold"),
            (1, _) => serde_json::json!("silver"),
            (2, true) => serde_json::json!("tin"),
            (2, false) => serde_json::json!("platinum"),
            _ => Value::Null,
        };
        assert_eq!(
            row.get("segment").cloned().unwrap_or(Value::Null),
            want,
            "{row}"
        );
        if order % 4 != 3 {
            assert_eq!(row["since"], 7, "{row}");
        }
    }
    let reports = reports(dir.path());
    let table = &reports.values().last().unwrap()["lookupTables"][0];
    assert!(
        table["version"]
            .as_str()
            .is_some_and(|v| v.contains(&format!("cassandra {keyspace}.customers"))
                && v.contains("(4 keys)")),
        "each batch of 50 orders reads its 4 customers: {table}"
    );

    // A join on a column other than the partition key is refused at the start.
    let wrong = once(
        dir.path(),
        &topic,
        &section,
        "SELECT o.order FROM orders o JOIN customers c ON o.customer = c.segment",
    );
    let output = run(&["validate", "--config", wrong.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("is read by its key (name)"),
        "{}",
        stderr(&output)
    );
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap();
    delete_topic(&topic).await;
}
