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
use sluice_core::{BatchId, OffsetRange, RecordChunk, Sink, StartingOffsets, Writes};
use sluice_executor::{Query, QueryOptions, SourceOptions, Trigger};
use sluice_kafka::{KafkaSource, KafkaSourceConfig, TopicSelection};

/// Counts records per key and writes one file per batch.
struct CountPerKey {
    dir: PathBuf,
    /// The counts of the batch in progress; records arrive in chunks.
    counts: BTreeMap<String, u64>,
    records: u64,
}

impl Sink for CountPerKey {
    type Error = std::io::Error;

    async fn begin_batch(
        &mut self,
        _batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> std::io::Result<()> {
        // A batch may begin again after a failed read: start from nothing.
        self.counts.clear();
        self.records = 0;
        Ok(())
    }

    async fn finish_batch(&mut self, batch: BatchId) -> std::io::Result<()> {
        let text: String = self
            .counts
            .iter()
            .map(|(k, n)| format!("{k}\t{n}\n"))
            .collect();
        println!(
            "batch {batch}: {} records, {} keys",
            self.records,
            self.counts.len()
        );
        // Same batch, same records, same file: replacing it is exactly once.
        tokio::fs::write(self.dir.join(format!("counts-{batch}.txt")), text).await
    }
}

impl Writes for CountPerKey {
    async fn write(&mut self, records: &RecordChunk) -> std::io::Result<()> {
        for record in records {
            let key = record
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned())
                .unwrap_or_else(|| "(no key)".to_owned());
            *self.counts.entry(key).or_default() += 1;
            self.records += 1;
        }
        Ok(())
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
        counts: BTreeMap::new(),
        records: 0,
    };
    let options = QueryOptions {
        name: Some("count_per_key".to_owned()),
        trigger: Trigger::AvailableNow,
        sources: vec![SourceOptions {
            starting: StartingOffsets::Earliest,
            ..SourceOptions::default()
        }],
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
