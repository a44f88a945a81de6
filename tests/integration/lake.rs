//! Streams landed in tables, read back by the readers our users have: a JSON
//! topic filtered by SQL into a partitioned Parquet table exactly once through
//! SIGKILLs, read by pyarrow through Spark's file-sink log and by DuckDB over
//! the directory; the records of a query without SQL as Spark's Kafka columns;
//! and the directories and options a Parquet sink refuses. The same stream
//! into a Delta table, read by the `deltalake` package, its log holding one
//! transaction per batch; tables it does not fit; and `sluice vacuum`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use sluice_tests::kafka::{create_topic, delete_topic, produce_values, producer};
use sluice_tests::process::{Lcg, run, stderr};
use sluice_tests::readers::run_python;

use crate::sql::{Job, SCHEMA, SQL, keep_producing, oracle, sorted};

/// Reads the table at argv[1] as Spark does: the files its file-sink log
/// lists (the last compact file and the batches after it), each file's rows
/// with the values of the partition directories it lies in. Prints a JSON
/// object per row.
const PYARROW_THROUGH_THE_LOG: &str = r#"
import datetime, json, os, sys, urllib.parse
import pyarrow.parquet as pq
def plain(value):
    # Bytes as text, and timestamps as whole seconds since the epoch, as the
    # jsonl sink writes them.
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    assert isinstance(value, datetime.datetime), value
    return int(value.replace(tzinfo=value.tzinfo or datetime.timezone.utc).timestamp())
table = sys.argv[1]
log = os.path.join(table, "_spark_metadata")
ids = sorted(int(n.split(".")[0]) for n in os.listdir(log) if n.split(".")[0].isdigit())
compacts = [i for i in ids if os.path.exists(os.path.join(log, f"{i}.compact"))]
start = compacts[-1] if compacts else None
entries = []
for i in ids:
    if start is not None and i < start:
        continue
    name = f"{i}.compact" if i == start else str(i)
    lines = open(os.path.join(log, name)).read().split("\n")
    assert lines[0] == "v1", lines[0]
    entries += [json.loads(l) for l in lines[1:] if l]
for entry in entries:
    assert entry["action"] == "add" and entry["path"].startswith("file://")
    path = urllib.parse.unquote(entry["path"][len("file://"):])
    assert os.path.getsize(path) == entry["size"]
    parts = {}
    for segment in os.path.relpath(os.path.dirname(path), table).split(os.sep):
        if "=" in segment:
            key, value = segment.split("=", 1)
            value = urllib.parse.unquote(value)
            parts[key] = None if value == "__HIVE_DEFAULT_PARTITION__" else value
    for row in pq.ParquetFile(path).read().to_pylist():
        assert not set(row) & set(parts), "a partition column is in the file"
        row.update(parts)
        print(json.dumps(row, default=plain))
"#;

/// Reads every Parquet file under argv[1] with DuckDB, Hive partitions as
/// columns. Prints a JSON object per row.
const DUCKDB_OVER_THE_DIRECTORY: &str = r#"
import json, sys, duckdb
table = sys.argv[1]
rows = duckdb.sql(f"SELECT * FROM read_parquet('{table}/**/*.parquet', hive_partitioning = true)")
names = rows.columns
for row in rows.fetchall():
    print(json.dumps(dict(zip(names, row)), default=str))
"#;

/// Reads the Delta table at argv[1] with the `deltalake` package. Prints a
/// JSON object per row, and last a line `{"txn": [[appId, version], ...]}`
/// with every `txn` action of the table's JSON commits, in their order.
const DELTALAKE_PACKAGE: &str = r#"
import datetime, json, os, sys
from deltalake import DeltaTable
def plain(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    assert isinstance(value, datetime.datetime), value
    return int(value.replace(tzinfo=value.tzinfo or datetime.timezone.utc).timestamp())
table = DeltaTable(sys.argv[1])
for row in table.to_pyarrow_table().to_pylist():
    print(json.dumps(row, default=plain))
log = os.path.join(sys.argv[1], "_delta_log")
txn = []
for name in sorted(n for n in os.listdir(log) if n.endswith(".json")):
    for line in open(os.path.join(log, name)):
        action = json.loads(line)
        if "txn" in action:
            txn.append([action["txn"]["appId"], action["txn"]["version"]])
print(json.dumps({"txn": txn}))
"#;

/// The rows of the Delta table at `table` as the `deltalake` package reads
/// them, and the `txn` actions of its log as (appId, version).
pub(crate) fn delta_rows(table: &Path) -> (Vec<Value>, Vec<(String, u64)>) {
    let mut rows = rows(&run_python(DELTALAKE_PACKAGE, &[table.to_str().unwrap()]));
    let last = rows.pop().expect("the txn line");
    let txn = last["txn"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t[0].as_str().unwrap().to_owned(), t[1].as_u64().unwrap()))
        .collect();
    (rows, txn)
}

/// Checks that a Delta table's log records each of the query's batches once,
/// every one from 0 to `last`, and no other writer's.
pub(crate) fn assert_one_txn_per_batch(txn: &[(String, u64)], last: u64) {
    let apps: std::collections::BTreeSet<&str> = txn.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(apps.len(), 1, "one query's transactions: {apps:?}");
    let versions: Vec<u64> = txn.iter().map(|(_, v)| *v).collect();
    assert_eq!(
        versions,
        (0..=last).collect::<Vec<_>>(),
        "one commit per batch, in order, the batch id as version"
    );
}

fn rows(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The rows of the Parquet table at `table`, read by pyarrow through Spark's
/// file-sink log, bytes as text and timestamps in seconds since the epoch.
pub(crate) fn parquet_rows(table: &Path) -> Vec<Value> {
    rows(&run_python(
        PYARROW_THROUGH_THE_LOG,
        &[table.to_str().unwrap()],
    ))
}

#[tokio::test]
async fn a_json_topic_lands_in_parquet_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
 {
    stateless_into_parquet_through_sigkills(false).await;
}

#[tokio::test]
async fn a_json_topic_lands_in_parquet_exactly_once_through_sigkills_with_the_cassandra_store() {
    stateless_into_parquet_through_sigkills(true).await;
}

/// A JSON topic filtered by SQL into the table `sink` configures (`type`,
/// `path` under the job's `table`, `partition_by = ["size"]`), through a crash
/// between the sink's end of batch 2 and the store's commit (the next run
/// finds the batch delivered and writes the store's commit only), then 20
/// SIGKILLs while a producer writes, then a run that catches up. Returns the
/// job, its topic and the orders produced.
async fn land_through_sigkills(
    name: &str,
    sink: &str,
    cassandra: bool,
) -> (Job, String, Vec<(i32, String)>) {
    let topic = sluice_tests::unique_name(name);
    create_topic(&topic, 3).await;
    let job = Job::with_store(cassandra);
    let rest = format!(
        "[sink]\n{sink}\npath = \"{}\"\npartition_by = [\"size\"]\n\n[query]\nsql = \"{SQL}\"\n",
        job.path("table").display()
    );
    let source = format!("table = \"orders\"\nformat = \"json\"\nschema = \"{SCHEMA}\"");
    let streaming = job.config(&topic, &source, "processing_time = \"0s\"", &rest);

    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 3, stop.clone());
    sluice_tests::process::crash_after_sink_commit_and_resume(&streaming, 2).await;
    let mut random = Lcg::from_clock(name);
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 20, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    let catch_up = job.config(&topic, &source, "available_now = true", &rest);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    (job, topic, produced)
}

/// The stream into a Parquet table, snappy, read back by pyarrow through
/// Spark's file-sink log and by DuckDB over the directory.
async fn stateless_into_parquet_through_sigkills(cassandra: bool) {
    let (job, topic, produced) = land_through_sigkills(
        "parquetcrash",
        "type = \"parquet\"\ncompression = \"snappy\"",
        cassandra,
    )
    .await;
    let table = job.path("table");
    let want = sorted(oracle(&produced).await);
    let through_log = sorted(parquet_rows(&table));
    let table = table.to_str().unwrap();
    let by_duckdb = sorted(rows(&run_python(DUCKDB_OVER_THE_DIRECTORY, &[table])));
    println!(
        "{} orders produced, {} rows through the log, {} by DuckDB, {} batches",
        produced.len(),
        through_log.len(),
        by_duckdb.len(),
        job.progress().len()
    );
    assert!(!want.is_empty());
    assert_eq!(through_log.len(), want.len(), "no row lost or duplicated");
    assert_eq!(
        through_log, want,
        "pyarrow, through Spark's log, reads the oracle's rows"
    );
    // Once caught up, the directory holds exactly the listed files: a replay
    // wrote the files of a batch cut short under the same names.
    assert_eq!(
        by_duckdb, want,
        "DuckDB, over the directory, reads the oracle's rows"
    );
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_json_topic_lands_in_delta_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
{
    stateless_into_delta_through_sigkills(false).await;
}

#[tokio::test]
async fn a_json_topic_lands_in_delta_exactly_once_through_sigkills_with_the_cassandra_store() {
    stateless_into_delta_through_sigkills(true).await;
}

/// The stream into a Delta table, read back by the `deltalake` package, its
/// log holding one `txn` per batch and a checkpoint.
async fn stateless_into_delta_through_sigkills(cassandra: bool) {
    let (job, topic, produced) =
        land_through_sigkills("deltacrash", "type = \"delta\"", cassandra).await;
    let table = job.path("table");
    let want = sorted(oracle(&produced).await);
    let (got, txn) = delta_rows(&table);
    let got = sorted(got);
    let last = job.progress().last().unwrap()["batchId"].as_u64().unwrap();
    println!(
        "{} orders produced, {} rows read by deltalake, {} commits for batches 0..={last}",
        produced.len(),
        got.len(),
        txn.len()
    );
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len(), "no row lost or duplicated");
    assert_eq!(got, want, "the deltalake package reads the oracle's rows");
    assert_one_txn_per_batch(&txn, last);
    assert!(
        std::fs::read_dir(table.join("_delta_log"))
            .unwrap()
            .any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains(".checkpoint.")),
        "the log is checkpointed every 10 commits"
    );
    delete_topic(&topic).await;
}

#[tokio::test]
async fn records_without_a_query_land_as_sparks_kafka_columns() {
    let topic = sluice_tests::unique_name("parquetraw");
    create_topic(&topic, 2).await;
    let values: Vec<(i32, Option<Vec<u8>>)> = (0..50)
        .map(|n| (n % 2, Some(format!("v{n}").into_bytes())))
        .collect();
    produce_values(&producer(), &topic, &values).await;
    let job = Job::new();
    let table = job.path("table");
    let rest = format!(
        "[sink]\ntype = \"parquet\"\npath = \"{}\"\npartition_by = [\"partition\"]\n",
        table.display()
    );
    let config = job.config(&topic, "", "available_now = true", &rest);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let got = parquet_rows(&table);
    assert_eq!(got.len(), 50);
    let mut names: Vec<&str> = got[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "key",
            "offset",
            "partition",
            "timestamp",
            "timestampType",
            "topic",
            "value"
        ]
    );
    let mut values: Vec<&str> = got.iter().map(|r| r["value"].as_str().unwrap()).collect();
    values.sort_unstable();
    let mut want: Vec<String> = (0..50).map(|n| format!("v{n}")).collect();
    want.sort_unstable();
    assert_eq!(values, want);
    for row in &got {
        assert_eq!(row["topic"], Value::from(topic.as_str()));
        let n: i64 = row["offset"].as_i64().unwrap();
        let partition: i64 = row["partition"].as_str().unwrap().parse().unwrap();
        assert!(n < 25 && (0..2).contains(&partition));
    }
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_parquet_sink_refuses_another_querys_table_and_bad_options_with_exit_2() {
    let topic = sluice_tests::unique_name("parquetbad");
    create_topic(&topic, 1).await;
    produce_values(&producer(), &topic, &[(0, Some(b"v".to_vec()))]).await;
    let first = Job::new();
    let table = first.path("table");
    let sink = |table: &Path, extra: &str| {
        format!(
            "[sink]\ntype = \"parquet\"\npath = \"{}\"\n{extra}\n",
            table.display()
        )
    };
    let config = first.config(&topic, "", "available_now = true", &sink(&table, ""));
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let listed = std::fs::read_dir(table.join("_spark_metadata"))
        .unwrap()
        .count();

    // Another query (another checkpoint) into the same directory.
    let second = Job::new();
    let config = second.config(&topic, "", "available_now = true", &sink(&table, ""));
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let said = stderr(&output);
    assert!(
        said.contains("holds the output of another writer"),
        "{said}"
    );
    assert_eq!(
        std::fs::read_dir(table.join("_spark_metadata"))
            .unwrap()
            .count(),
        listed,
        "nothing written"
    );

    for (extra, expected) in [
        ("partition_by = [\"nope\"]", "partition column `nope`"),
        ("compression = \"brotli\"", "sink.compression must be"),
        ("file_size_mb = 0", "sink.file_size_mb must be at least 1"),
        (
            "format = \"json\"",
            "sink.format is an option of the console sink",
        ),
    ] {
        let job = Job::new();
        let own = job.path("table");
        let config = job.config(&topic, "", "available_now = true", &sink(&own, extra));
        let output = run(&["run", "--config", config.to_str().unwrap()]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{extra}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains(expected),
            "{extra}: {}",
            stderr(&output)
        );
    }
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_delta_sink_refuses_a_table_the_output_does_not_fit_and_vacuum_removes_what_no_version_lists()
 {
    let topic = sluice_tests::unique_name("deltabad");
    create_topic(&topic, 1).await;
    produce_values(&producer(), &topic, &[(0, Some(b"v".to_vec()))]).await;
    let first = Job::new();
    let table = first.path("table");
    let sink = |extra: &str| {
        format!(
            "[sink]\ntype = \"delta\"\npath = \"{}\"\n{extra}\n",
            table.display()
        )
    };
    // The records of a query without SQL: Spark's Kafka columns.
    let config = first.config(&topic, "", "available_now = true", &sink(""));
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let (got, txn) = delta_rows(&table);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["value"], Value::from("v"));
    assert_eq!(txn.len(), 1);
    let commits = || {
        std::fs::read_dir(table.join("_delta_log"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "json")
            })
            .count()
    };
    let before = commits();

    // A query whose output is other columns, into the same table.
    let second = Job::new();
    let rest = format!(
        "{}\n[query]\nsql = \"SELECT CAST(partition AS STRING) AS partition, value FROM events\"\n",
        sink("")
    );
    let config = second.config(&topic, "table = \"events\"", "available_now = true", &rest);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    let said = stderr(&output);
    assert!(said.contains("does not take the query's rows"), "{said}");
    assert!(
        said.contains("`partition` is Int32 in the table and Utf8 in the query"),
        "{said}"
    );
    assert!(
        said.contains("`topic` is a column of the table the query does not have"),
        "{said}"
    );
    // Other partition columns than the table's.
    let config = second.config(
        &topic,
        "",
        "available_now = true",
        &sink("partition_by = [\"topic\"]"),
    );
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("partitioned by [] and the sink by [topic]"),
        "{}",
        stderr(&output)
    );
    assert_eq!(commits(), before, "nothing written");
    for (extra, expected) in [
        (
            "checkpoint_interval = 0",
            "sink.checkpoint_interval must be at least 1",
        ),
        (
            "num_rows = 3",
            "sink.num_rows is an option of the console sink",
        ),
    ] {
        let config = second.config(&topic, "", "available_now = true", &sink(extra));
        let output = run(&["run", "--config", config.to_str().unwrap()]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{extra}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains(expected),
            "{extra}: {}",
            stderr(&output)
        );
    }

    // A file of a batch cut short before its commit: in no version.
    let data = std::fs::read_dir(&table)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    let orphan = table.join("part-00000-cut-short.c000.zstd.parquet");
    std::fs::copy(&data, &orphan).unwrap();
    let path = table.to_str().unwrap();
    let output = run(&["vacuum", "--table", path]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(orphan.exists(), "younger than the week Delta keeps files");
    let output = run(&["vacuum", "--table", path, "--retain-hours", "0"]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--no-retention-check"),
        "{}",
        stderr(&output)
    );
    let config = first.config(&topic, "", "available_now = true", &sink(""));
    let output = run(&[
        "vacuum",
        "--config",
        config.to_str().unwrap(),
        "--retain-hours",
        "0",
        "--no-retention-check",
        "--dry-run",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(String::from_utf8_lossy(&output.stdout).contains("cut-short"));
    assert!(orphan.exists(), "a dry run removes nothing");
    let output = run(&[
        "vacuum",
        "--table",
        path,
        "--retain-hours",
        "0",
        "--no-retention-check",
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!orphan.exists());
    assert!(data.exists(), "the committed file stays");
    assert_eq!(delta_rows(&table).0.len(), 1);
    let output = run(&["vacuum", "--table", first.path("nothing").to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("is not a Delta table"),
        "{}",
        stderr(&output)
    );
    delete_topic(&topic).await;
}
