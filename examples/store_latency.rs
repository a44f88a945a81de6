//! Measures one batch's plan+commit against the offset stores, with the
//! baselines beside them in the same run:
//!
//! - Cassandra with fencing (two lightweight transactions), and with each
//!   commit written together with the next plan (one), against the same two
//!   rows written as plain `LOCAL_QUORUM` updates without conditions;
//! - the filesystem checkpoint (two fsynced files).
//!
//! ```text
//! cargo run --release -p sluice-examples --example store_latency -- [cassandra host:port] [iterations] [partitions]
//! ```

use std::time::{Duration, Instant};

use anyhow::Result;
use scylla::statement::Consistency;
use sluice_cassandra_store::{CassandraLocation, CassandraOptions, CassandraStore};
use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Offset, OffsetStore, PartitionOffsets,
    TopicPartition,
};

fn plan(batch: u64, partitions: i32) -> BatchPlan {
    let offsets = |base: i64| -> PartitionOffsets {
        (0..partitions)
            .map(|p| {
                (
                    TopicPartition::new("events", p),
                    Offset::new(base + i64::from(p)).unwrap(),
                )
            })
            .collect()
    };
    let from = batch as i64 * 1000;
    BatchPlan::from_offsets(
        BatchId(batch),
        &offsets(from),
        &offsets(from + 1000),
        BatchMetadata::default(),
    )
    .unwrap()
}

fn commit(batch: u64) -> BatchCommit {
    BatchCommit {
        id: BatchId(batch),
        next_watermark_ms: 0,
    }
}

async fn time_store<S: OffsetStore>(
    store: &mut S,
    iterations: u64,
    partitions: i32,
) -> Result<Vec<Duration>> {
    let mut times = Vec::new();
    for batch in 0..iterations {
        let plan = plan(batch, partitions);
        let start = Instant::now();
        store.write_plan(&plan).await?;
        store.write_commit(&commit(batch)).await?;
        times.push(start.elapsed());
    }
    Ok(times)
}

/// Each batch's commit written with the next batch's plan, as the executor
/// does when batches follow one another at once.
async fn time_joined<S: OffsetStore>(
    store: &mut S,
    iterations: u64,
    partitions: i32,
) -> Result<Vec<Duration>> {
    store.write_plan(&plan(0, partitions)).await?;
    let mut times = Vec::new();
    for batch in 0..iterations {
        let next = plan(batch + 1, partitions);
        let start = Instant::now();
        if !store.hold_commit(&commit(batch)) {
            store.write_commit(&commit(batch)).await?;
        }
        store.write_plan(&next).await?;
        times.push(start.elapsed());
    }
    Ok(times)
}

fn report(name: &str, mut times: Vec<Duration>) -> (Duration, Duration) {
    times.sort();
    let at = |q: f64| times[((times.len() as f64 - 1.0) * q).round() as usize];
    let (p50, p99) = (at(0.50), at(0.99));
    println!(
        "{name:<44} p50 {:>8.3} ms   p99 {:>8.3} ms",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
    (p50, p99)
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let node = args.next().unwrap_or_else(|| "127.0.0.1:9042".to_owned());
    let iterations: u64 = args.next().map(|n| n.parse()).transpose()?.unwrap_or(300);
    let partitions: i32 = args.next().map(|n| n.parse()).transpose()?.unwrap_or(8);
    let keyspace = format!("sluice_latency_{}", std::process::id());
    let location = CassandraLocation {
        nodes: vec![node.clone()],
        keyspace: keyspace.clone(),
        query: "fenced".to_owned(),
    };
    let options = CassandraOptions {
        replication: Some("{'class': 'SimpleStrategy', 'replication_factor': 1}".to_owned()),
        ..CassandraOptions::default()
    };
    let mut fenced = CassandraStore::open(location.clone(), options.clone()).await?;
    let fenced_times = time_store(&mut fenced, iterations, partitions).await?;
    let mut joined = CassandraStore::open(
        CassandraLocation {
            query: "joined".to_owned(),
            ..location
        },
        options,
    )
    .await?;
    let joined_times = time_joined(&mut joined, iterations, partitions).await?;

    // The baseline: the same two rows per batch, written without conditions.
    let session = scylla::client::session_builder::SessionBuilder::new()
        .known_node(&node)
        .build()
        .await?;
    let mut write = session
        .prepare(format!(
            "UPDATE {keyspace}.sluice_log SET start_offsets = ?, end_offsets = ?, watermark_ms = ? \
             WHERE query = 'plain' AND kind = ? AND batch_id = ?"
        ))
        .await?;
    write.set_consistency(Consistency::LocalQuorum);
    let mut plain_times = Vec::new();
    for batch in 0..iterations {
        let plan = plan(batch, partitions);
        let (start_json, end_json) = (
            sluice_core::offsets_to_json(&plan.start_offsets()),
            sluice_core::offsets_to_json(&plan.end_offsets()),
        );
        let start = Instant::now();
        session
            .execute_unpaged(
                &write,
                (&start_json, &end_json, 0_i64, "plan", batch as i64),
            )
            .await?;
        session
            .execute_unpaged(
                &write,
                (&start_json, &end_json, 0_i64, "commit", batch as i64),
            )
            .await?;
        plain_times.push(start.elapsed());
    }

    let dir = tempfile::tempdir()?;
    let mut checkpoint = Checkpoint::open(dir.path().join("checkpoint"))?;
    let fs_times = time_store(&mut checkpoint, iterations, partitions).await?;

    println!("{iterations} batches of {partitions} partitions each, one at a time");
    let (f50, f99) = report("cassandra plan+commit, fenced (2 LWT)", fenced_times);
    report("cassandra commit with the next plan (1 LWT)", joined_times);
    let (b50, b99) = report("cassandra baseline: same rows, no conditions", plain_times);
    report("filesystem plan+commit (fsync)", fs_times);
    println!(
        "fencing costs x{:.2} at p50 and x{:.2} at p99 against the unconditional writes",
        f50.as_secs_f64() / b50.as_secs_f64(),
        f99.as_secs_f64() / b99.as_secs_f64()
    );
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await?;
    Ok(())
}
