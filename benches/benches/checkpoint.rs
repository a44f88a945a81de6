//! The filesystem checkpoint: one batch's plan and commit, each fsynced, against
//! the floor of writing and fsyncing two files of the same size.

use std::fs::{self, File};
use std::hint::black_box;
use std::io::Write;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice_benches::sample_offsets;
use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{BatchCommit, BatchId, BatchMetadata, BatchPlan, OffsetStore, purge_threshold};

const PARTITIONS: usize = 8;
const RETAIN: u64 = sluice_core::DEFAULT_MIN_BATCHES_TO_RETAIN;

fn plan_and_commit(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut checkpoint = Checkpoint::open(dir.path().join("checkpoint")).expect("a checkpoint");
    let start = sample_offsets(PARTITIONS, 0);
    let end = sample_offsets(PARTITIONS, 10_000);
    let mut batch = 0_u64;

    let mut group = c.benchmark_group("checkpoint_fs_plan_commit_8_partitions");
    group.bench_function("plan_commit_purge", |b| {
        b.iter(|| {
            let plan =
                BatchPlan::from_offsets(BatchId(batch), &start, &end, BatchMetadata::default())
                    .expect("a valid plan");
            runtime.block_on(async {
                checkpoint.write_plan(&plan).await.expect("plan written");
                let commit = BatchCommit {
                    id: BatchId(batch),
                    next_watermark_ms: 0,
                };
                checkpoint
                    .write_commit(&commit)
                    .await
                    .expect("commit written");
                if let Some(keep_from) = purge_threshold(BatchId(batch), RETAIN) {
                    checkpoint.purge(keep_from).await.expect("purged");
                }
            });
            batch += 1;
        })
    });

    // Baseline: create, write and fsync two files of the same sizes, fsync the
    // directory, and remove them again: what any durable plan+commit must cost.
    let raw = dir.path().join("raw");
    fs::create_dir_all(&raw).expect("a directory");
    let plan_bytes = vec![b'x'; 300];
    let commit_bytes = vec![b'x'; 30];
    let mut n = 0_u64;
    group.bench_function("baseline_two_fsynced_files", |b| {
        b.iter(|| {
            for (name, bytes) in [("p", &plan_bytes), ("c", &commit_bytes)] {
                let path = raw.join(format!("{name}{n}"));
                let mut file = File::create(&path).expect("created");
                file.write_all(black_box(bytes)).expect("written");
                file.sync_all().expect("synced");
                File::open(&raw)
                    .and_then(|d| d.sync_all())
                    .expect("dir synced");
                fs::remove_file(&path).expect("removed");
            }
            n += 1;
        })
    });
    group.finish();
}

criterion_group!(benches, plan_and_commit);
criterion_main!(benches);
