//! `sluice offsets show` and `sluice offsets set`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use serde_json::{Value, json};
use sluice_checkpoint_fs::Checkpoint;
use sluice_offsets::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, OffsetStore, PartitionOffsets, Recovery,
    offsets_from_json, offsets_to_json,
};

use crate::exit::Exit;

#[derive(Subcommand)]
pub enum OffsetsCommand {
    /// Print the query id, the last committed batch and its offsets, and a planned
    /// but uncommitted batch if there is one, as JSON. Safe while the query runs.
    Show {
        /// The checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
    },
    /// Make the next batch start at these offsets. Refused while a runner holds the
    /// checkpoint, or while a batch is planned but not committed.
    Set {
        /// The checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Spark's offset JSON, e.g. '{"events":{"0":23,"1":5}}'.
        #[arg(long)]
        offsets: String,
    },
}

pub async fn run(command: OffsetsCommand) -> Result<(), Exit> {
    let checkpoint = match &command {
        OffsetsCommand::Show { checkpoint } | OffsetsCommand::Set { checkpoint, .. } => checkpoint,
    };
    if checkpoint.to_string_lossy().starts_with("cassandra://") {
        return Err(Exit::config(anyhow::anyhow!(
            "sluice offsets works on checkpoint directories only in this version; for a Cassandra \
             store, read {} with CQL",
            sluice_cassandra_store::OFFSETS_TABLE
        )));
    }
    match command {
        OffsetsCommand::Show { checkpoint } => {
            let (id, stored) = Checkpoint::inspect(&checkpoint).map_err(Exit::checkpoint)?;
            let last = stored.latest_commit.as_ref().map(|commit| {
                let offsets = stored
                    .latest_plan
                    .as_ref()
                    .filter(|plan| plan.id() == commit.id)
                    .map(|plan| offsets_json(&plan.end_offsets()));
                json!({ "batchId": commit.id.0, "endOffsets": offsets })
            });
            let pending = stored
                .latest_plan
                .as_ref()
                .filter(|plan| Some(plan.id()) != stored.latest_commit.as_ref().map(|c| c.id))
                .map(|plan| {
                    json!({
                        "batchId": plan.id().0,
                        "startOffsets": offsets_json(&plan.start_offsets()),
                        "endOffsets": offsets_json(&plan.end_offsets()),
                    })
                });
            let report = json!({
                "checkpoint": checkpoint.display().to_string(),
                "id": id,
                "lastCommitted": last,
                "pending": pending,
                "initialOffsets": stored.initial_offsets.as_ref().map(offsets_json),
            });
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            Ok(())
        }
        OffsetsCommand::Set {
            checkpoint,
            offsets,
        } => {
            let target = offsets_from_json(&offsets)
                .context("--offsets must be Spark's offset JSON, like {\"events\":{\"0\":23}}")
                .map_err(Exit::config)?;
            if !checkpoint.join("metadata").exists() {
                return Err(Exit::config(anyhow::anyhow!(
                    "{} is not a checkpoint (no metadata file)",
                    checkpoint.display()
                )));
            }
            let dir = checkpoint.clone();
            let mut store = tokio::task::spawn_blocking(move || Checkpoint::open(dir))
                .await
                .map_err(|e| Exit::runtime(anyhow::anyhow!("opening the checkpoint: {e}")))?
                .map_err(Exit::checkpoint)?;
            let stored = store.load().await.map_err(Exit::checkpoint)?;
            let next = match stored.recovery() {
                Ok(Recovery::StartFresh) => BatchId::FIRST,
                Ok(Recovery::RunNext { next, .. }) => next,
                Ok(Recovery::Replay { batch }) => {
                    return Err(Exit {
                        code: 4,
                        error: anyhow::anyhow!(
                            "batch {batch} is planned but not committed ({}); run the query so it \
                             finishes that batch, then move the offsets",
                            store.describe(sluice_offsets::Log::Plans, batch)
                        ),
                    });
                }
                Err(e) => {
                    return Err(Exit {
                        code: 4,
                        error: anyhow::anyhow!("the checkpoint is inconsistent: {e}"),
                    });
                }
            };
            // Partitions not named keep their offsets.
            let mut moved = stored
                .latest_plan
                .as_ref()
                .map(BatchPlan::end_offsets)
                .unwrap_or_default();
            moved.extend(target.clone());
            // An empty batch at the new offsets: the next batch starts where it ends,
            // and Spark reads the move the same way.
            let metadata = BatchMetadata {
                conf: [("sluice.movedBy".to_owned(), "sluice offsets set".to_owned())].into(),
                ..BatchMetadata::default()
            };
            let plan = BatchPlan::from_offsets(next, &moved, &moved, metadata)
                .map_err(|e| Exit::config(anyhow::anyhow!("--offsets: {e}")))?;
            store.write_plan(&plan).await.map_err(Exit::checkpoint)?;
            store
                .write_commit(&BatchCommit {
                    id: next,
                    next_watermark_ms: 0,
                })
                .await
                .map_err(Exit::checkpoint)?;
            println!(
                "{}: the next batch ({}) starts at {}",
                checkpoint.display(),
                next.next(),
                offsets_to_json(&moved)
            );
            Ok(())
        }
    }
}

fn offsets_json(offsets: &PartitionOffsets) -> Value {
    serde_json::from_str(&offsets_to_json(offsets)).unwrap_or(Value::Null)
}
