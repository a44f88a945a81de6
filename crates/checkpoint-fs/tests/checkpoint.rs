//! The filesystem checkpoint's behaviour: recovery, the single-writer lock,
//! retention, damaged files, and Spark compatibility in both directions.

use std::fs;
use std::path::Path;

use sluice_checkpoint_fs::{Checkpoint, CheckpointError};
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, DEFAULT_MIN_BATCHES_TO_RETAIN, Log, Offset,
    OffsetStore, PartitionOffsets, Recovery, TopicPartition, purge_threshold,
};

fn offsets(entries: &[(&str, i32, i64)]) -> PartitionOffsets {
    entries
        .iter()
        .map(|(t, p, o)| (TopicPartition::new(*t, *p), Offset::new(*o).unwrap()))
        .collect()
}

fn plan(batch: u64, start: &[(&str, i32, i64)], end: &[(&str, i32, i64)]) -> BatchPlan {
    let metadata = BatchMetadata {
        watermark_ms: 0,
        timestamp_ms: 1_700_000_000_000 + batch as i64,
        conf: Default::default(),
    };
    BatchPlan::from_offsets(BatchId(batch), &offsets(start), &offsets(end), metadata).unwrap()
}

fn commit(batch: u64) -> BatchCommit {
    BatchCommit {
        id: BatchId(batch),
        next_watermark_ms: 0,
    }
}

/// A plan per batch that reads ten more offsets of `events-0`.
fn nth_plan(batch: u64) -> BatchPlan {
    let from = batch as i64 * 10;
    plan(batch, &[("events", 0, from)], &[("events", 0, from + 10)])
}

#[tokio::test]
async fn a_fresh_checkpoint_starts_fresh_and_records_a_query_id() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("query");
    let mut checkpoint = Checkpoint::open(&path).unwrap();
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(stored.recovery(), Ok(Recovery::StartFresh));
    assert_eq!(stored.initial_offsets, None);

    let id = checkpoint.id().to_owned();
    assert_eq!(
        fs::read_to_string(path.join("metadata")).unwrap(),
        format!("{{\"id\":\"{id}\"}}")
    );
    drop(checkpoint);
    assert_eq!(
        Checkpoint::open(&path).unwrap().id(),
        id,
        "the id survives a restart"
    );
}

#[tokio::test]
async fn replays_planned_batch_after_crash_with_identical_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let planned = plan(
        1,
        &[("events", 0, 10), ("events", 1, 4), ("other", 0, 0)],
        &[("events", 0, 25), ("events", 1, 4), ("other", 0, 3)],
    );
    {
        let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
        checkpoint.write_plan(&nth_plan(0)).await.unwrap();
        checkpoint.write_commit(&commit(0)).await.unwrap();
        checkpoint.write_plan(&planned).await.unwrap();
        // The process dies here: batch 1 is planned, not committed.
    }
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(1) })
    );
    assert_eq!(stored.latest_plan.as_ref(), Some(&planned));
    assert_eq!(stored.latest_commit, Some(commit(0)));
}

#[tokio::test]
async fn runs_the_next_batch_after_a_commit_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
        for batch in 0..3 {
            checkpoint.write_plan(&nth_plan(batch)).await.unwrap();
            checkpoint.write_commit(&commit(batch)).await.unwrap();
        }
    }
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::RunNext {
            last_committed: BatchId(2),
            next: BatchId(3)
        })
    );
    let next_start = stored.latest_plan.unwrap().end_offsets();
    assert_eq!(next_start, offsets(&[("events", 0, 30)]));
    assert_eq!(
        stored.initial_offsets,
        Some(offsets(&[("events", 0, 0)])),
        "batch 0's start is kept as Spark's sources/0/0"
    );
}

#[tokio::test]
async fn a_second_runner_is_refused_with_the_holder_named() {
    let dir = tempfile::tempdir().unwrap();
    let first = Checkpoint::open(dir.path()).unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, CheckpointError::Locked { .. }), "{message}");
    assert!(
        message.contains(&dir.path().display().to_string()),
        "{message}"
    );
    assert!(
        message.contains(&format!("pid={}", std::process::id())),
        "{message}"
    );
    assert!(message.contains("host="), "{message}");

    drop(first);
    Checkpoint::open(dir.path()).expect("the lock is released when the first runner stops");
}

#[tokio::test]
async fn retention_keeps_the_newest_batches_and_bounds_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let retain = DEFAULT_MIN_BATCHES_TO_RETAIN;
    for batch in 0..250 {
        checkpoint.write_plan(&nth_plan(batch)).await.unwrap();
        checkpoint.write_commit(&commit(batch)).await.unwrap();
        if let Some(keep_from) = purge_threshold(BatchId(batch), retain) {
            checkpoint.purge(keep_from).await.unwrap();
        }
    }
    for log in ["offsets", "commits"] {
        let mut ids: Vec<u64> = fs::read_dir(dir.path().join(log))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().parse().unwrap())
            .collect();
        ids.sort();
        assert_eq!(ids, (150..250).collect::<Vec<_>>(), "{log}");
    }
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::RunNext {
            last_committed: BatchId(249),
            next: BatchId(250)
        })
    );
    assert!(
        dir.path().join("sources/0/0").exists(),
        "initial offsets are never purged"
    );
}

#[tokio::test]
async fn batch_files_are_never_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    checkpoint.write_plan(&nth_plan(0)).await.unwrap();
    let before = fs::read(dir.path().join("offsets/0")).unwrap();

    let other = plan(0, &[("events", 0, 0)], &[("events", 0, 99)]);
    let err = checkpoint.write_plan(&other).await.unwrap_err();
    assert!(
        matches!(err, CheckpointError::AlreadyExists { .. }),
        "{err}"
    );
    assert_eq!(fs::read(dir.path().join("offsets/0")).unwrap(), before);

    checkpoint.write_commit(&commit(0)).await.unwrap();
    let err = checkpoint.write_commit(&commit(0)).await.unwrap_err();
    assert!(
        matches!(err, CheckpointError::AlreadyExists { .. }),
        "{err}"
    );
    assert_no_temp_files(dir.path());
}

#[tokio::test]
async fn a_commit_without_its_plan_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let err = checkpoint.write_commit(&commit(0)).await.unwrap_err();
    assert!(
        err.to_string().contains("offsets/0 does not exist"),
        "{err}"
    );
    assert!(!dir.path().join("commits/0").exists());
}

#[tokio::test]
async fn inconsistent_logs_are_refused_naming_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    for batch in 0..3 {
        checkpoint.write_plan(&nth_plan(batch)).await.unwrap();
        checkpoint.write_commit(&commit(batch)).await.unwrap();
    }
    fs::remove_file(dir.path().join("offsets/1")).unwrap();
    let stored = checkpoint.load().await.unwrap();
    let inconsistency = stored.recovery().unwrap_err();
    let files: Vec<String> = inconsistency
        .entries()
        .into_iter()
        .map(|(log, batch)| checkpoint.describe(log, batch))
        .collect();
    assert_eq!(
        files,
        vec![
            dir.path().join("offsets/0").display().to_string(),
            dir.path().join("offsets/2").display().to_string()
        ]
    );
    assert_eq!(
        checkpoint.describe(Log::Commits, BatchId(7)),
        dir.path().join("commits/7").display().to_string()
    );
}

#[tokio::test]
async fn leftover_temporary_files_are_ignored_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
        checkpoint.write_plan(&nth_plan(0)).await.unwrap();
    }
    // What a crash between writing and linking leaves behind, ours or Spark's.
    fs::write(
        dir.path().join("offsets/.1.0b6f0c2e.tmp"),
        "v1\n{}\n{\"events\":",
    )
    .unwrap();
    fs::write(dir.path().join("commits/.0.4c1d.tmp"), "").unwrap();
    fs::write(dir.path().join(".metadata.99.tmp"), "{").unwrap();

    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    assert_no_temp_files(dir.path());
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(0) })
    );
}

fn assert_no_temp_files(root: &Path) {
    for sub in ["", "offsets", "commits", "sources/0"] {
        for entry in fs::read_dir(root.join(sub)).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.ends_with(".tmp"), "{sub}/{name} was left behind");
        }
    }
}

/// Each damaged file stops `open` or `load` with an error that names the file and
/// what is wrong, and the file is left exactly as it was.
#[tokio::test]
async fn damaged_files_are_errors_naming_the_file_and_are_left_alone() {
    let cases: &[(&str, &[u8], &str)] = &[
        ("offsets/1", b"", "the file is empty"),
        ("offsets/1", b"v1", "metadata line is missing"),
        (
            "offsets/1",
            b"v1\n{\"batchWatermarkMs\":0}",
            "no offsets line",
        ),
        (
            "offsets/1",
            b"v1\n{\"batchWatermarkMs\":0}\n{\"events\":{\"0\":1",
            "offsets line of source 0: not valid JSON",
        ),
        (
            "offsets/1",
            b"v1\n{\"batchWatermarkMs\":0,\n{\"events\":{\"0\":1}}",
            "metadata line is not valid JSON",
        ),
        (
            "offsets/1",
            b"v7\n{}\n{\"events\":{\"0\":1}}",
            "v7 is newer",
        ),
        ("offsets/1", b"version one\n{}\n{}", "version like v1"),
        (
            "offsets/1",
            b"v1\n{}\n{\"events\":{\"0\":-5}}",
            "is not an offset",
        ),
        ("offsets/1", b"v1\n{}\n\xff\xfe", "not UTF-8"),
        (
            "offsets/1",
            b"v1\n{}\n{\"events\":{\"0\":5}}",
            "ends before it starts",
        ),
        ("commits/0", b"v1\n", "commit JSON is missing"),
        (
            "commits/0",
            b"v1\n{\"nextBatchWatermarkMs\"",
            "not valid JSON",
        ),
        (
            "commits/0",
            b"v2\n{\"nextBatchWatermarkMs\":0}",
            "v2 is newer",
        ),
        (
            "sources/0/0",
            b"\0v1\n{\"events\":",
            "initial offsets: not valid JSON",
        ),
        ("metadata", b"{\"id\":", "not valid JSON"),
        ("metadata", b"{}", "expected {\"id\""),
    ];
    for (file, content, problem) in cases {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
            checkpoint.write_plan(&nth_plan(0)).await.unwrap();
            checkpoint.write_commit(&commit(0)).await.unwrap();
            checkpoint.write_plan(&nth_plan(1)).await.unwrap();
        }
        let path = dir.path().join(file);
        fs::remove_file(&path).unwrap();
        fs::write(&path, content).unwrap();

        let err = match Checkpoint::open(dir.path()) {
            Err(e) => e,
            Ok(mut checkpoint) => checkpoint
                .load()
                .await
                .expect_err(&format!("{file} with {content:?} must be refused")),
        };
        let message = err.to_string();
        assert!(
            message.contains(&path.display().to_string()) && message.contains(problem),
            "{file} with {content:?}: expected the path and {problem:?} in: {message}"
        );
        assert_eq!(fs::read(&path).unwrap(), *content, "{file} was changed");
    }
}

/// A checkpoint laid out byte for byte as Spark's Kafka source writes it: no start
/// offsets in the metadata, checksum files beside each file, `sources/0/0` with
/// its leading 0x00 byte, and Spark's own `conf` entries.
fn write_spark_checkpoint(root: &Path) {
    let conf = r#""conf":{"spark.sql.streaming.stateStore.providerClass":"org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider","spark.sql.streaming.join.stateFormatVersion":"2","spark.sql.streaming.stateStore.compression.codec":"lz4","spark.sql.streaming.flatMapGroupsWithState.stateFormatVersion":"2","spark.sql.streaming.multipleWatermarkPolicy":"min","spark.sql.streaming.aggregation.stateFormatVersion":"2","spark.sql.shuffle.partitions":"200"}"#;
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("metadata", br#"{"id":"8b0a4e3c-7d4e-4a53-9d1f-3c9b0f6f2a11"}"#.to_vec()),
        ("sources/0/0", b"\0v1\n{\"events\":{\"2\":0,\"1\":0,\"0\":0}}".to_vec()),
        ("sources/0/.0.crc", b"crc".to_vec()),
        (
            "offsets/0",
            format!("v1\n{{\"batchWatermarkMs\":0,\"batchTimestampMs\":1700000000000,{conf}}}\n{{\"events\":{{\"2\":40,\"1\":33,\"0\":35}}}}").into_bytes(),
        ),
        ("offsets/.0.crc", b"crc".to_vec()),
        (
            "offsets/1",
            format!("v1\n{{\"batchWatermarkMs\":0,\"batchTimestampMs\":1700000060000,{conf}}}\n{{\"events\":{{\"2\":80,\"1\":70,\"0\":71}}}}").into_bytes(),
        ),
        ("offsets/.1.crc", b"crc".to_vec()),
        (
            "offsets/2",
            format!("v1\n{{\"batchWatermarkMs\":0,\"batchTimestampMs\":1700000120000,{conf}}}\n{{\"events\":{{\"3\":12,\"2\":95,\"1\":70,\"0\":100}}}}").into_bytes(),
        ),
        ("offsets/.2.crc", b"crc".to_vec()),
        ("commits/0", b"v1\n{\"nextBatchWatermarkMs\":0}".to_vec()),
        ("commits/.0.crc", b"crc".to_vec()),
        ("commits/1", b"v1\n{\"nextBatchWatermarkMs\":0}".to_vec()),
        ("commits/.1.crc", b"crc".to_vec()),
    ];
    for (name, bytes) in files {
        let path = root.join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }
}

#[tokio::test]
async fn reads_a_checkpoint_written_by_spark() {
    let dir = tempfile::tempdir().unwrap();
    write_spark_checkpoint(dir.path());

    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(checkpoint.id(), "8b0a4e3c-7d4e-4a53-9d1f-3c9b0f6f2a11");
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(stored.planned, vec![BatchId(0), BatchId(1), BatchId(2)]);
    assert_eq!(stored.committed, vec![BatchId(0), BatchId(1)]);
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(2) })
    );
    assert_eq!(
        stored.initial_offsets,
        Some(offsets(&[
            ("events", 0, 0),
            ("events", 1, 0),
            ("events", 2, 0)
        ]))
    );

    // Batch 2 starts where batch 1 ended; partition 3 is new in batch 2 and starts
    // at its beginning, as Spark starts new partitions.
    let replay = stored.latest_plan.unwrap();
    assert_eq!(
        replay.start_offsets(),
        offsets(&[
            ("events", 0, 71),
            ("events", 1, 70),
            ("events", 2, 80),
            ("events", 3, 0)
        ])
    );
    assert_eq!(
        replay.end_offsets(),
        offsets(&[
            ("events", 0, 100),
            ("events", 1, 70),
            ("events", 2, 95),
            ("events", 3, 12)
        ])
    );
    assert_eq!(replay.metadata().timestamp_ms, 1_700_000_120_000);
    assert_eq!(
        replay.metadata().conf["spark.sql.shuffle.partitions"],
        "200"
    );

    // Sluice continues the Spark checkpoint: commit the replay, plan the next batch.
    checkpoint.write_commit(&commit(2)).await.unwrap();
    let next = BatchPlan::from_offsets(
        BatchId(3),
        &replay.end_offsets(),
        &offsets(&[
            ("events", 0, 120),
            ("events", 1, 75),
            ("events", 2, 95),
            ("events", 3, 20),
        ]),
        replay.metadata().clone(),
    )
    .unwrap();
    checkpoint.write_plan(&next).await.unwrap();
    drop(checkpoint);
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let stored = checkpoint.load().await.unwrap();
    assert_eq!(
        stored.recovery(),
        Ok(Recovery::Replay { batch: BatchId(3) })
    );
    assert_eq!(stored.latest_plan, Some(next));
}

#[tokio::test]
async fn derives_the_first_batchs_start_from_sparks_initial_offsets() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir_all(dir.path().join("sources/0")).unwrap();
    fs::create_dir_all(dir.path().join("offsets")).unwrap();
    fs::write(
        dir.path().join("sources/0/0"),
        b"\0v1\n{\"events\":{\"0\":5}}",
    )
    .unwrap();
    fs::write(
        dir.path().join("offsets/0"),
        b"v1\n{\"batchWatermarkMs\":0,\"batchTimestampMs\":1}\n{\"events\":{\"0\":9}}",
    )
    .unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let plan = checkpoint.load().await.unwrap().latest_plan.unwrap();
    assert_eq!(plan.start_offsets(), offsets(&[("events", 0, 5)]));

    fs::remove_file(dir.path().join("sources/0/0")).unwrap();
    let err = checkpoint.load().await.unwrap_err();
    assert!(
        err.to_string().contains("cannot tell where batch 0 starts"),
        "{err}"
    );
}

/// What Sluice writes is what Spark reads: the exact bytes of each file kind.
#[tokio::test]
async fn writes_files_in_sparks_format() {
    let dir = tempfile::tempdir().unwrap();
    let mut checkpoint = Checkpoint::open(dir.path()).unwrap();
    let first = BatchPlan::from_offsets(
        BatchId(0),
        &offsets(&[("events", 0, 0), ("events", 10, 7)]),
        &offsets(&[("events", 0, 23), ("events", 10, 9)]),
        BatchMetadata {
            watermark_ms: 0,
            timestamp_ms: 1_700_000_000_000,
            conf: Default::default(),
        },
    )
    .unwrap();
    checkpoint.write_plan(&first).await.unwrap();
    checkpoint.write_commit(&commit(0)).await.unwrap();

    let read = |name: &str| fs::read(dir.path().join(name)).unwrap();
    assert_eq!(
        read("offsets/0"),
        b"v1\n{\"batchWatermarkMs\":0,\"batchTimestampMs\":1700000000000,\"conf\":{\"sluice.startOffsets\":\"{\\\"events\\\":{\\\"0\\\":0,\\\"10\\\":7}}\"}}\n{\"events\":{\"0\":23,\"10\":9}}"
    );
    assert_eq!(read("commits/0"), b"v1\n{\"nextBatchWatermarkMs\":0}");
    assert_eq!(
        read("sources/0/0"),
        b"\0v1\n{\"events\":{\"0\":0,\"10\":7}}"
    );
}
