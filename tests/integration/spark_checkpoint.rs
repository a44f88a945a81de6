//! Spark and Sluice read each other's checkpoints. Spark's own checkpoint classes
//! (`StreamMetadata`, `OffsetSeqLog`, `CommitLog` from spark-sql, and the Kafka
//! source's `KafkaSourceInitialOffsetWriter` and `KafkaSourceOffset`) write and read
//! the files, driven by `xtask/spark-compat/SparkCheckpoint.java`.
//!
//! These tests need Spark's jars, which `cargo xtask spark-compat` fetches with
//! Maven (about 290 MB) before it runs them; they are ignored otherwise.

use std::path::Path;
use std::process::Command;

use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Offset, OffsetStore, PartitionOffsets,
    Recovery, TopicPartition,
};

/// The classpath of Spark's jars, set by `cargo xtask spark-compat`.
const CLASSPATH_VAR: &str = "SLUICE_SPARK_CLASSPATH";

/// The options Spark's launcher gives a Java 17 JVM.
const JAVA17_OPTIONS: &[&str] = &[
    "-XX:+IgnoreUnrecognizedVMOptions",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.invoke=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.net=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.cs=ALL-UNNAMED",
    "--add-opens=java.base/sun.security.action=ALL-UNNAMED",
    "--add-opens=java.base/sun.util.calendar=ALL-UNNAMED",
    "-Djdk.reflect.useDirectMethodHandle=false",
];

/// Runs SparkCheckpoint.java with `args` and returns its `SPARK ...` lines.
fn spark(args: &[&str]) -> Vec<String> {
    let classpath = std::env::var(CLASSPATH_VAR)
        .unwrap_or_else(|_| panic!("{CLASSPATH_VAR} is not set: run `cargo xtask spark-compat`"));
    let program =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/spark-compat/SparkCheckpoint.java");
    let output = Command::new("java")
        .args(JAVA17_OPTIONS)
        .arg("-cp")
        .arg(classpath)
        .arg(program)
        .args(args)
        .output()
        .expect("running java");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "Spark failed on {args:?}: {}\n{}",
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
        .lines()
        .filter(|l| l.starts_with("SPARK "))
        .map(str::to_owned)
        .collect()
}

fn offsets(topic: &str, entries: &[(i32, i64)]) -> PartitionOffsets {
    entries
        .iter()
        .map(|(p, o)| (TopicPartition::new(topic, *p), Offset::new(*o).unwrap()))
        .collect()
}

/// Plan b as the Java side writes it: partitions 0..2 of `events` end at 100*(b+1).
fn spark_style_end(batch: i64) -> PartitionOffsets {
    let end = 100 * (batch + 1);
    offsets("events", &[(0, end), (1, end), (2, end)])
}

#[tokio::test]
#[ignore = "needs Spark's jars: run `cargo xtask spark-compat`"]
async fn sluice_reads_and_continues_a_checkpoint_that_spark_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("query");
    let root_str = root.to_str().unwrap();
    // Spark: three plans, the first two committed.
    spark(&["write", root_str, "3", "2", "events"]);

    let mut checkpoint = Checkpoint::open(&root).unwrap();
    assert_eq!(checkpoint.id(), "0b5e3d4c-spark-written");
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(stored.planned, vec![BatchId(0), BatchId(1), BatchId(2)]);
    assert_eq!(stored.committed, vec![BatchId(0), BatchId(1)]);
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(2) })
    );
    let replay = stored.latest_plan.unwrap();
    assert_eq!(replay.start_offsets(), spark_style_end(1));
    assert_eq!(replay.end_offsets(), spark_style_end(2));
    assert_eq!(replay.metadata().watermark_ms, 2);
    assert_eq!(replay.metadata().timestamp_ms, 1_700_000_000_002);
    assert_eq!(
        replay.metadata().conf["spark.sql.shuffle.partitions"],
        "200"
    );
    assert_eq!(stored.latest_commit.unwrap().next_watermark_ms, 1);
    assert_eq!(
        stored.initial_offsets,
        Some(offsets("events", &[(0, 0), (1, 0), (2, 0)]))
    );

    // Sluice finishes batch 2 and runs batch 3 in Spark's checkpoint.
    checkpoint
        .write_commit(&BatchCommit {
            id: BatchId(2),
            next_watermark_ms: 2,
        })
        .await
        .unwrap();
    let next = BatchPlan::from_offsets(
        BatchId(3),
        &replay.end_offsets(),
        &offsets("events", &[(0, 350), (1, 300), (2, 420)]),
        replay.metadata().clone(),
    )
    .unwrap();
    checkpoint.write_plan(&next).await.unwrap();
    checkpoint
        .write_commit(&BatchCommit {
            id: BatchId(3),
            next_watermark_ms: 2,
        })
        .await
        .unwrap();
    drop(checkpoint);

    // Spark reads all of it, Sluice's entries included.
    let lines = spark(&["read", root_str]);
    assert!(
        lines.contains(&"SPARK id=0b5e3d4c-spark-written".to_owned()),
        "{lines:#?}"
    );
    assert!(
        lines.contains(
            &"SPARK offsets batch=3 watermark=2 timestamp=1700000000002 shuffle=200 \
              events-0=350 events-1=300 events-2=420"
                .to_owned()
        ),
        "{lines:#?}"
    );
    assert!(
        lines.contains(&"SPARK commit batch=2 nextBatchWatermarkMs=2".to_owned()),
        "{lines:#?}"
    );
    assert!(
        lines.contains(&"SPARK commit batch=3 nextBatchWatermarkMs=2".to_owned()),
        "{lines:#?}"
    );
}

#[tokio::test]
#[ignore = "needs Spark's jars: run `cargo xtask spark-compat`"]
async fn spark_reads_a_checkpoint_that_sluice_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("query");
    let id = {
        let mut checkpoint = Checkpoint::open(&root).unwrap();
        let mut start = offsets("orders", &[(0, 0), (1, 5), (10, 7)]);
        for batch in 0..3_u64 {
            let end: PartitionOffsets = start
                .iter()
                .map(|(tp, o)| (tp.clone(), o.saturating_add(10 * (batch + 1))))
                .collect();
            let metadata = BatchMetadata {
                watermark_ms: batch as i64,
                timestamp_ms: 1_800_000_000_000 + batch as i64,
                conf: [("spark.sql.shuffle.partitions".to_owned(), "8".to_owned())].into(),
            };
            let plan = BatchPlan::from_offsets(BatchId(batch), &start, &end, metadata).unwrap();
            checkpoint.write_plan(&plan).await.unwrap();
            if batch < 2 {
                checkpoint
                    .write_commit(&BatchCommit {
                        id: BatchId(batch),
                        next_watermark_ms: batch as i64,
                    })
                    .await
                    .unwrap();
            }
            start = end;
        }
        checkpoint.id().to_owned()
    };

    let lines = spark(&["read", root.to_str().unwrap()]);
    let expected = vec![
        format!("SPARK id={id}"),
        "SPARK initial orders-0=0 orders-1=5 orders-10=7".to_owned(),
        "SPARK offsets batch=0 watermark=0 timestamp=1800000000000 shuffle=8 orders-0=10 orders-1=15 orders-10=17".to_owned(),
        "SPARK offsets batch=1 watermark=1 timestamp=1800000000001 shuffle=8 orders-0=30 orders-1=35 orders-10=37".to_owned(),
        "SPARK offsets batch=2 watermark=2 timestamp=1800000000002 shuffle=8 orders-0=60 orders-1=65 orders-10=67".to_owned(),
        "SPARK commit batch=0 nextBatchWatermarkMs=0".to_owned(),
        "SPARK commit batch=1 nextBatchWatermarkMs=1".to_owned(),
    ];
    assert_eq!(lines, expected);
}

#[tokio::test]
#[ignore = "needs Spark's jars: run `cargo xtask spark-compat`"]
async fn sluice_continues_a_checkpoint_of_two_sources_that_spark_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("query");
    let root_str = root.to_str().unwrap();
    spark(&["write", root_str, "2", "1", "events,clicks"]);

    let mut checkpoint = Checkpoint::open(&root).unwrap();
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(1) })
    );
    let replay = stored.latest_plan.unwrap();
    let line = |topic: &str, at: i64| offsets(topic, &[(0, at), (1, at), (2, at)]);
    assert_eq!(replay.source_count(), 2);
    assert_eq!(
        replay.end_offsets_by_source(),
        [line("events", 200), line("clicks", 200)]
    );
    assert_eq!(
        replay.start_offsets_by_source(),
        [line("events", 100), line("clicks", 100)]
    );
    let mut initial = line("events", 0);
    initial.extend(line("clicks", 0));
    assert_eq!(stored.initial_offsets, Some(initial));

    // Sluice finishes batch 1 and runs batch 2, a line per source.
    let commit = |id| BatchCommit {
        id: BatchId(id),
        next_watermark_ms: 1,
    };
    checkpoint.write_commit(&commit(1)).await.unwrap();
    let next = BatchPlan::from_lines(
        BatchId(2),
        &replay.end_offsets(),
        &[line("events", 250), line("clicks", 230)],
        replay.metadata().clone(),
    )
    .unwrap();
    checkpoint.write_plan(&next).await.unwrap();
    checkpoint.write_commit(&commit(2)).await.unwrap();
    drop(checkpoint);

    let lines = spark(&["read", root_str]);
    let expected = [
        "SPARK initial events-0=0 events-1=0 events-2=0 | clicks-0=0 clicks-1=0 clicks-2=0",
        "SPARK offsets batch=1 watermark=1 timestamp=1700000000001 shuffle=200 \
         events-0=200 events-1=200 events-2=200 | clicks-0=200 clicks-1=200 clicks-2=200",
        "SPARK offsets batch=2 watermark=1 timestamp=1700000000001 shuffle=200 \
         events-0=250 events-1=250 events-2=250 | clicks-0=230 clicks-1=230 clicks-2=230",
        "SPARK commit batch=2 nextBatchWatermarkMs=1",
    ];
    for line in expected {
        assert!(lines.contains(&line.to_owned()), "{line}: {lines:#?}");
    }
}

#[tokio::test]
#[ignore = "needs Spark's jars: run `cargo xtask spark-compat`"]
async fn spark_reads_a_checkpoint_of_two_sources_that_sluice_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("query");
    {
        let mut checkpoint = Checkpoint::open(&root).unwrap();
        let mut start = offsets("orders", &[(0, 0), (1, 5)]);
        start.extend(offsets("payments", &[(0, 3)]));
        for batch in 0..2_u64 {
            let end: PartitionOffsets = start
                .iter()
                .map(|(tp, o)| (tp.clone(), o.saturating_add(10 * (batch + 1))))
                .collect();
            let metadata = BatchMetadata {
                watermark_ms: batch as i64,
                timestamp_ms: 1_800_000_000_000 + batch as i64,
                conf: [("spark.sql.shuffle.partitions".to_owned(), "8".to_owned())].into(),
            };
            let plan = BatchPlan::from_offsets(BatchId(batch), &start, &end, metadata)
                .unwrap()
                .with_sources(2, |tp| Some(usize::from(&*tp.topic == "payments")))
                .unwrap();
            checkpoint.write_plan(&plan).await.unwrap();
            checkpoint
                .write_commit(&BatchCommit {
                    id: BatchId(batch),
                    next_watermark_ms: batch as i64,
                })
                .await
                .unwrap();
            start = end;
        }
    }
    let lines = spark(&["read", root.to_str().unwrap()]);
    let expected = [
        "SPARK initial orders-0=0 orders-1=5 | payments-0=3",
        "SPARK offsets batch=0 watermark=0 timestamp=1800000000000 shuffle=8 orders-0=10 orders-1=15 | payments-0=13",
        "SPARK offsets batch=1 watermark=1 timestamp=1800000000001 shuffle=8 orders-0=30 orders-1=35 | payments-0=33",
        "SPARK commit batch=1 nextBatchWatermarkMs=1",
    ];
    for line in expected {
        assert!(lines.contains(&line.to_owned()), "{line}: {lines:#?}");
    }
}

#[tokio::test]
#[ignore = "needs Spark's jars: run `cargo xtask spark-compat`"]
async fn spark_reads_a_parquet_table_through_the_file_sink_log_sluice_wrote() {
    use sluice_core::{Sink, Writes};
    use sluice_lake::{ParquetOptions, ParquetSink};

    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("table");
    let mut options = ParquetOptions::new(&table, "query-1");
    options.partition_by = vec!["day".to_owned()];
    let mut sink = ParquetSink::open(options).unwrap();
    let schema = std::sync::Arc::new(arrow_schema());
    // Twelve batches: the log compacts at batch 9.
    for batch in 0..12_i64 {
        let ids = datafusion::arrow::array::Int64Array::from(vec![batch * 2, batch * 2 + 1]);
        let days = datafusion::arrow::array::StringArray::from(vec!["2026-12-07", "a/b:c"]);
        let rows = datafusion::arrow::array::RecordBatch::try_new(
            schema.clone(),
            vec![std::sync::Arc::new(ids), std::sync::Arc::new(days)],
        )
        .unwrap();
        sink.begin_batch(BatchId(batch as u64), &[]).await.unwrap();
        sink.write(&rows).await.unwrap();
        sink.finish_batch(BatchId(batch as u64)).await.unwrap();
    }
    // A file a crash left unlisted: Spark must not read it.
    let listed = table
        .join("day=2026-12-07")
        .join("part-00000-00000.zstd.parquet");
    let stray = table
        .join("day=2026-12-07")
        .join("part-00099-00000.zstd.parquet");
    std::fs::copy(&listed, &stray).unwrap();

    let lines = spark(&["table", table.to_str().unwrap()]);
    let files: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("SPARK file "))
        .collect();
    assert_eq!(files.len(), 24, "{lines:?}");
    assert!(!files.iter().any(|f| f.contains("part-00099")), "{files:?}");
    assert!(
        std::path::Path::new(&table)
            .join("_spark_metadata/9.compact")
            .exists()
    );
    let mut rows: Vec<serde_json::Value> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("SPARK row "))
        .map(|r| serde_json::from_str(r).unwrap())
        .collect();
    rows.sort_by_key(|r| r["id"].as_i64());
    let want: Vec<serde_json::Value> = (0..24)
        .map(|id| {
            let day = if id % 2 == 0 { "2026-12-07" } else { "a/b:c" };
            serde_json::json!({"id": id, "day": day})
        })
        .collect();
    assert_eq!(rows, want);
}

fn arrow_schema() -> datafusion::arrow::datatypes::Schema {
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("day", DataType::Utf8, false),
    ])
}
