//! A pipeline built from Sluice's crates with a processor of its own: it counts
//! records per key in each batch and keeps running totals in a file per batch.
//!
//! ```text
//! cargo run -p sluice-examples --example count_per_key -- <bootstrap> <topic> <checkpoint dir> <output dir>
//! ```
//!
//! The processor relies on Sluice's contract: a batch that is replayed after a
//! crash has the same id and the same records. Writing the result of batch N to
//! `counts-N.txt` (replacing it) therefore makes the totals exactly once.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use sluice_checkpoint_fs::Checkpoint;
use sluice_executor::{Query, QueryOptions, Trigger};
use sluice_kafka_source::{KafkaSource, KafkaSourceConfig, TopicSelection};
use sluice_offsets::{BatchId, ReadBatch, Sink, StartingOffsets};

/// Counts records per key and writes one file per batch.
struct CountPerKey {
    dir: PathBuf,
}

impl Sink for CountPerKey {
    type Error = std::io::Error;

    async fn write_batch(&mut self, batch: BatchId, records: &ReadBatch) -> std::io::Result<()> {
        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for record in records.partitions.iter().flat_map(|p| &p.records) {
            let key = record
                .key
                .as_deref()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_else(|| "(no key)".to_owned());
            *counts.entry(key).or_default() += 1;
        }
        let text: String = counts.iter().map(|(k, n)| format!("{k}\t{n}\n")).collect();
        println!(
            "batch {batch}: {} records, {} keys",
            records.record_count(),
            counts.len()
        );
        // Same batch, same records, same file: replacing it is exactly once.
        tokio::fs::write(self.dir.join(format!("counts-{batch}.txt")), text).await
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [bootstrap, topic, checkpoint, output] = args.as_slice() else {
        anyhow::bail!("usage: count_per_key <bootstrap> <topic> <checkpoint dir> <output dir>");
    };
    std::fs::create_dir_all(output).with_context(|| format!("creating {output}"))?;

    let checkpoint = Checkpoint::open(checkpoint)?;
    let config = KafkaSourceConfig::new(bootstrap, TopicSelection::Subscribe(vec![topic.clone()]));
    let source = KafkaSource::new(config, checkpoint.id())?;
    let sink = CountPerKey {
        dir: PathBuf::from(output),
    };
    let options = QueryOptions {
        name: Some("count_per_key".to_owned()),
        trigger: Trigger::AvailableNow,
        starting: StartingOffsets::Earliest,
        ..QueryOptions::default()
    };
    let query_id = checkpoint.id().to_owned();
    let (_stop_tx, stop) = tokio::sync::watch::channel(false);
    let summary = Query::new(options, query_id, source, checkpoint, sink)
        .run(stop, |_| {})
        .await?;
    println!(
        "done: {} batches, {} records",
        summary.batches, summary.records
    );
    Ok(())
}
