//! `sluice offsets show|set|migrate|import`, for checkpoint directories and
//! Cassandra stores alike.

use std::path::PathBuf;

use anyhow::{Context, anyhow};
use clap::Subcommand;
use serde_json::{Value, json};
use sluice_cassandra_store::{CassandraLocation, CassandraOptions, CassandraStore};
use sluice_checkpoint_fs::Checkpoint;
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Directory, Log, OffsetStore, PartitionOffsets,
    Recovery, StateFile, StateFileId, StateFileKind, StateGap, StateStore, StoredBatches,
    TopicPartition, offsets_from_json, offsets_to_json, state_files_for,
};

use crate::exit::Exit;
use crate::offsets_group;

#[derive(Subcommand)]
pub enum OffsetsCommand {
    /// Print the query id, the last committed batch and its offsets, and a planned
    /// but uncommitted batch if there is one, as JSON; for a group-mode query,
    /// every partition's committed offset, the generation holding it and its
    /// epoch. Reads only: safe while the query runs.
    Show {
        /// A checkpoint directory, or cassandra://host:port/keyspace?query=name.
        #[arg(long)]
        checkpoint: String,
    },
    /// Make the next batch start at these offsets (partitions not named keep theirs).
    /// A checkpoint directory held by a runner is refused; a Cassandra query is
    /// taken over, so a runner still on it is fenced out and stops. A group-mode
    /// query must be stopped: no live member in its consumer group.
    Set {
        /// A checkpoint directory, or cassandra://host:port/keyspace?query=name.
        #[arg(long)]
        checkpoint: String,
        /// A group-mode query's configuration: its consumer group is checked for
        /// live members first.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Spark's offset JSON, e.g. '{"events":{"0":23,"1":5}}'.
        #[arg(long)]
        offsets: String,
        /// Cassandra: create the keyspace with this replication if it is missing.
        #[arg(long)]
        replication: Option<String>,
        /// For a stateful query: start its state empty at the new offsets. Without
        /// it a stateful query's offsets are not moved, as state and offsets must
        /// agree.
        #[arg(long)]
        reset_state: bool,
    },
    /// Copy a query's id, latest committed offsets and state to another store.
    Migrate {
        /// Where the query is now.
        #[arg(long)]
        from: String,
        /// Where it is to go.
        #[arg(long)]
        to: String,
        /// Also write into a target that already holds batches: its next batch then
        /// starts at the migrated offsets.
        #[arg(long)]
        force: bool,
        /// Cassandra: create the keyspace with this replication if it is missing.
        #[arg(long)]
        replication: Option<String>,
    },
    /// Make the offsets of an existing Cassandra table (columns topic, partition,
    /// offset: the next offset to read) the next batch's start.
    Import {
        /// The query's store: a checkpoint directory or a cassandra:// location.
        #[arg(long)]
        checkpoint: String,
        /// Contact points of the Cassandra cluster holding the table, `host:port[,host:port]`.
        #[arg(long)]
        cassandra_nodes: String,
        /// The table, as keyspace.table.
        #[arg(long)]
        cassandra_table: String,
        /// Cassandra store: create the keyspace with this replication if it is missing.
        #[arg(long)]
        replication: Option<String>,
    },
}

pub async fn run(command: OffsetsCommand) -> Result<(), Exit> {
    match command {
        OffsetsCommand::Show { checkpoint } => show(checkpoint).await,
        OffsetsCommand::Set {
            checkpoint,
            config,
            offsets,
            replication,
            reset_state,
        } => set(checkpoint, config, offsets, replication, reset_state).await,
        OffsetsCommand::Migrate {
            from,
            to,
            force,
            replication,
        } => migrate(from, to, force, replication).await,
        OffsetsCommand::Import {
            checkpoint,
            cassandra_nodes,
            cassandra_table,
            replication,
        } => import(checkpoint, cassandra_nodes, cassandra_table, replication).await,
    }
}

/// `sluice offsets show`: the query's batches, offsets and state, as JSON.
async fn show(checkpoint: String) -> Result<(), Exit> {
    let location = Location::parse(&checkpoint)?;
    if let Some((cassandra, directory)) = location.group_mode().await? {
        let report = offsets_group::show(&checkpoint, cassandra, &directory).await?;
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
        return Ok(());
    }
    let (id, stored) = location
        .inspect()
        .await?
        .ok_or_else(|| Exit::config(anyhow!("{checkpoint} holds no query")))?;
    let mut report = report(&checkpoint, &id, &stored);
    let state = location.inspect_state().await?;
    if !state.is_empty() {
        report["state"] = state_report(&stored, &state);
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    Ok(())
}

/// `sluice offsets set`: the next batch starts at `offsets`.
async fn set(
    checkpoint: String,
    config: Option<PathBuf>,
    offsets: String,
    replication: Option<String>,
    reset_state: bool,
) -> Result<(), Exit> {
    let target = offsets_from_json(&offsets)
        .context("--offsets must be Spark's offset JSON, like {\"events\":{\"0\":23}}")
        .map_err(Exit::config)?;
    let location = Location::parse(&checkpoint)?;
    if let Some((cassandra, directory)) = location.group_mode().await? {
        return offsets_group::set(
            &checkpoint,
            cassandra,
            &directory,
            &target,
            config.as_deref(),
        )
        .await;
    }
    let Some((_, before)) = location.inspect().await? else {
        return Err(Exit::config(anyhow!("{checkpoint} holds no query")));
    };
    let state: Vec<StateFileId> = location
        .inspect_state()
        .await?
        .into_iter()
        .map(|(f, _)| f)
        .collect();
    let stateful = !state.is_empty();
    if stateful && !reset_state {
        return Err(Exit::config(anyhow!(
            "{checkpoint} holds a stateful query, whose state was built from the offsets it \
             read: moving the offsets alone would make them disagree; add --reset-state to \
             start the state empty at the new offsets"
        )));
    }
    let mut store = location.open(None, replication).await?;
    let next = store.move_to(&target).await?;
    if stateful {
        // The moved-to batch's state is empty, in the partitions the
        // state has: the next batch starts from it.
        let last = before.latest_commit.map(|c| c.id);
        for partition in 0..stored_partitions(&state, last) {
            store
                .write_state(&StateFile {
                    operator: 0,
                    partition,
                    version: next,
                    kind: StateFileKind::Snapshot,
                    bytes: Vec::new(),
                    location: String::new(),
                })
                .await?;
        }
    }
    println!(
        "{checkpoint}: the next batch ({}) starts at {}",
        next.next(),
        offsets_to_json(&target)
    );
    Ok(())
}

/// `sluice offsets migrate`: the query, its offsets and its state moved to another store.
async fn migrate(
    from: String,
    to: String,
    force: bool,
    replication: Option<String>,
) -> Result<(), Exit> {
    let (id, stored) = Location::parse(&from)?
        .inspect()
        .await?
        .ok_or_else(|| Exit::config(anyhow!("nothing to migrate: {from} holds no query")))?;
    let latest = match stored.recovery() {
        Ok(Recovery::RunNext { .. }) => stored.latest_plan.clone(),
        Ok(Recovery::Replay { batch }) => {
            return Err(Exit::checkpoint_state(anyhow!(
                "batch {batch} is planned but not committed in {from}; run the query so it \
                 finishes that batch, then migrate"
            )));
        }
        Ok(Recovery::StartFresh) => None,
        Err(e) => {
            return Err(Exit::checkpoint_state(anyhow!(
                "{from} is inconsistent: {e}"
            )));
        }
    };
    let latest = latest.ok_or_else(|| {
        Exit::config(anyhow!("nothing to migrate: {from} has no committed batch"))
    })?;
    let target = Location::parse(&to)?;
    let existing = target.inspect().await?;
    let target_is_empty = existing
        .as_ref()
        .is_none_or(|(_, s)| s.planned.is_empty() && s.committed.is_empty());
    if !target_is_empty && !force {
        return Err(Exit::config(anyhow!(
            "{to} already holds batches of query {}; refusing to write into it without --force",
            existing.map(|(id, _)| id).unwrap_or_default()
        )));
    }
    let mut store = target.open(Some(&id), replication).await?;
    // The state the next batch starts from goes along: the files that
    // rebuild the last committed batch's version.
    let source_state = Location::parse(&from)?.inspect_state().await?;
    if !source_state.is_empty() {
        let listed: Vec<StateFileId> = source_state.iter().map(|(f, _)| *f).collect();
        let partitions = stored_partitions(&listed, Some(latest.id()));
        let wanted = state_files_for(&listed, partitions, latest.id()).map_err(|gap| {
            Exit::checkpoint_state(anyhow!(
                "{from}: the state of batch {} cannot be rebuilt: {gap:?}",
                latest.id()
            ))
        })?;
        let mut source = Location::parse(&from)?.open(None, None).await?;
        for id in wanted {
            let file = source.read_state(id).await?;
            store.write_state(&file).await?;
        }
    }
    if target_is_empty {
        // The same batch, so the numbering goes on where it was.
        store.write_plan(&latest).await?;
        // The commit's watermark goes along too: the next batch runs
        // under it, as it would have where the query was.
        let next_watermark_ms = stored
            .latest_commit
            .as_ref()
            .map_or(0, |c| c.next_watermark_ms);
        store
            .write_commit(&BatchCommit {
                id: latest.id(),
                next_watermark_ms,
            })
            .await?;
    } else {
        store.move_to(&latest.end_offsets()).await?;
    }
    println!(
        "migrated query {id} from {from} to {to}: the next batch starts at {}",
        offsets_to_json(&latest.end_offsets())
    );
    Ok(())
}

/// `sluice offsets import`: the next batch starts at offsets kept in a Cassandra table.
async fn import(
    checkpoint: String,
    cassandra_nodes: String,
    cassandra_table: String,
    replication: Option<String>,
) -> Result<(), Exit> {
    let offsets = read_offsets_table(&cassandra_nodes, &cassandra_table).await?;
    if offsets.is_empty() {
        return Err(Exit::config(anyhow!(
            "{cassandra_table} holds no offsets to import"
        )));
    }
    let location = Location::parse(&checkpoint)?;
    if !location.inspect_state().await?.is_empty() {
        return Err(Exit::config(anyhow!(
            "{checkpoint} holds a stateful query, whose state must agree with its offsets; \
             use `sluice offsets set --reset-state` with the imported offsets instead"
        )));
    }
    let mut store = location.open(None, replication).await?;
    let next = store.move_to(&offsets).await?;
    println!(
        "imported {} partitions from {cassandra_table}: batch {} of {checkpoint} starts at {}",
        offsets.len(),
        next.next(),
        offsets_to_json(&offsets)
    );
    Ok(())
}

/// Reads `topic`, `partition`, `offset` from a table teams keep their offsets in.
async fn read_offsets_table(nodes: &str, table: &str) -> Result<PartitionOffsets, Exit> {
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    match table.split_once('.') {
        Some((ks, t)) if valid(ks) && valid(t) => {}
        _ => {
            return Err(Exit::config(anyhow!(
                "--cassandra-table {table:?} must be keyspace.table"
            )));
        }
    }
    let nodes: Vec<String> = nodes
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    let offsets = sluice_cassandra_store::read_offsets_table(&nodes, table)
        .await
        .map_err(|e| match e {
            sluice_cassandra_store::CassandraStoreError::Connect { .. } => {
                Exit::runtime(anyhow::Error::new(e))
            }
            e => Exit::config(anyhow::Error::new(e)),
        })?;
    Ok(offsets)
}

fn report(location: &str, id: &str, stored: &StoredBatches) -> Value {
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
    let mut report = json!({
        "checkpoint": location,
        "id": id,
        "lastCommitted": last,
        "pending": pending,
        "initialOffsets": stored.initial_offsets.as_ref().map(offsets_json),
    });
    // A query of several sources: each one's end offsets, in the order of
    // the lines its plans keep.
    if let Some(plan) = stored.latest_plan.as_ref().filter(|p| p.source_count() > 1) {
        let lines: Vec<Value> = plan
            .end_offsets_by_source()
            .iter()
            .map(offsets_json)
            .collect();
        report["sources"] = json!({ "batchId": plan.id().0, "endOffsets": lines });
    }
    report
}

/// The state a restart starts from: the version of the last commit, and the
/// files and bytes that rebuild it.
fn state_report(stored: &StoredBatches, files: &[(StateFileId, u64)]) -> Value {
    let listed: Vec<StateFileId> = files.iter().map(|(f, _)| *f).collect();
    let version = stored.latest_commit.as_ref().map(|c| c.id);
    let partitions = stored_partitions(&listed, version);
    let needed = version.map(|v| state_files_for(&listed, partitions, v));
    let (rebuilds, bytes) = match &needed {
        Some(Ok(needed)) => (
            Value::from(needed.len()),
            Value::from(
                files
                    .iter()
                    .filter(|(f, _)| needed.contains(f))
                    .map(|(_, b)| b)
                    .sum::<u64>(),
            ),
        ),
        _ => (Value::Null, Value::Null),
    };
    let missing = match needed {
        Some(Err(StateGap::Missing { partition, version })) => {
            json!({"partition": partition, "version": version.0})
        }
        _ => Value::Null,
    };
    json!([{
        "operator": 0,
        "version": version.map(|v| v.0),
        "partitions": partitions,
        "missing": missing,
        "filesToRebuild": rebuilds,
        "bytesToRebuild": bytes,
        "filesStored": files.len(),
        "bytesStored": files.iter().map(|(_, b)| b).sum::<u64>(),
    }])
}

/// How many partitions the stored state has: those with a file at `version`
/// (every batch writes all of them), or all that have any file.
fn stored_partitions(files: &[StateFileId], version: Option<BatchId>) -> u32 {
    let count = |at: Option<BatchId>| {
        let mut partitions: Vec<u32> = files
            .iter()
            .filter(|f| at.is_none_or(|v| f.version == v))
            .map(|f| f.partition)
            .collect();
        partitions.sort_unstable();
        partitions.dedup();
        partitions.len() as u32
    };
    match count(version) {
        0 => count(None).max(1),
        n => n,
    }
}

fn offsets_json(offsets: &PartitionOffsets) -> Value {
    serde_json::from_str(&offsets_to_json(offsets)).unwrap_or(Value::Null)
}

/// A store given on the command line.
enum Location {
    Directory(PathBuf),
    Cassandra(CassandraLocation),
}

impl Location {
    fn parse(text: &str) -> Result<Location, Exit> {
        if text.starts_with("cassandra://") {
            CassandraLocation::parse(text)
                .map(Location::Cassandra)
                .map_err(|e| Exit::config(e.into()))
        } else {
            Ok(Location::Directory(PathBuf::from(
                text.trim_start_matches("file://"),
            )))
        }
    }

    /// The location and directory of a group-mode query; `None` for any other.
    async fn group_mode(&self) -> Result<Option<(&CassandraLocation, Directory)>, Exit> {
        match self {
            Location::Directory(_) => Ok(None),
            Location::Cassandra(location) => Ok(offsets_group::directory_of(location)
                .await?
                .map(|directory| (location, directory))),
        }
    }

    /// The query's id and batches, read without taking the query over; `None` when
    /// the store holds no query yet.
    async fn inspect(&self) -> Result<Option<(String, StoredBatches)>, Exit> {
        match self {
            Location::Directory(dir) => {
                if !dir.join("metadata").exists() {
                    return Ok(None);
                }
                Checkpoint::inspect(dir).map(Some).map_err(Exit::checkpoint)
            }
            Location::Cassandra(location) => {
                match CassandraStore::inspect(location.clone(), CassandraOptions::default()).await {
                    Ok(found) => Ok(found),
                    // A keyspace or table that does not exist holds no query.
                    Err(
                        sluice_cassandra_store::CassandraStoreError::MissingKeyspace { .. }
                        | sluice_cassandra_store::CassandraStoreError::MissingTable { .. },
                    ) => Ok(None),
                    Err(e) => Err(Exit::cassandra(e)),
                }
            }
        }
    }

    /// The state files of the query's stateful operator, with their sizes,
    /// read without taking the query over.
    async fn inspect_state(&self) -> Result<Vec<(StateFileId, u64)>, Exit> {
        match self {
            Location::Directory(dir) => Checkpoint::inspect_state(dir, 0).map_err(Exit::checkpoint),
            Location::Cassandra(location) => {
                match CassandraStore::inspect_state(
                    location.clone(),
                    CassandraOptions::default(),
                    0,
                )
                .await
                {
                    Ok(found) => Ok(found),
                    Err(
                        sluice_cassandra_store::CassandraStoreError::MissingKeyspace { .. }
                        | sluice_cassandra_store::CassandraStoreError::MissingTable { .. },
                    ) => Ok(Vec::new()),
                    Err(e) => Err(Exit::cassandra(e)),
                }
            }
        }
    }

    /// Opens the store for writing, as a runner would.
    async fn open(
        &self,
        query_id: Option<&str>,
        replication: Option<String>,
    ) -> Result<Writer, Exit> {
        match self {
            Location::Directory(dir) => {
                let dir = dir.clone();
                let id = query_id.map(str::to_owned);
                tokio::task::spawn_blocking(move || Checkpoint::open_with_id(dir, id.as_deref()))
                    .await
                    .map_err(|e| Exit::runtime(anyhow!("opening the checkpoint: {e}")))?
                    .map(Writer::Directory)
                    .map_err(Exit::checkpoint)
            }
            Location::Cassandra(location) => {
                let options = CassandraOptions {
                    replication,
                    query_id: query_id.map(str::to_owned),
                    ..CassandraOptions::default()
                };
                CassandraStore::open(location.clone(), options)
                    .await
                    .map(|store| Writer::Cassandra(Box::new(store)))
                    .map_err(Exit::cassandra)
            }
        }
    }
}

/// An opened store of either kind.
enum Writer {
    Directory(Checkpoint),
    Cassandra(Box<CassandraStore>),
}

impl Writer {
    async fn load(&mut self) -> Result<StoredBatches, Exit> {
        match self {
            Writer::Directory(s) => s.load().await.map_err(Exit::checkpoint),
            Writer::Cassandra(s) => s.load().await.map_err(Exit::cassandra),
        }
    }

    async fn write_plan(&mut self, plan: &BatchPlan) -> Result<(), Exit> {
        match self {
            Writer::Directory(s) => s.write_plan(plan).await.map_err(Exit::checkpoint),
            Writer::Cassandra(s) => s.write_plan(plan).await.map_err(Exit::cassandra),
        }
    }

    async fn write_commit(&mut self, commit: &BatchCommit) -> Result<(), Exit> {
        match self {
            Writer::Directory(s) => s.write_commit(commit).await.map_err(Exit::checkpoint),
            Writer::Cassandra(s) => s.write_commit(commit).await.map_err(Exit::cassandra),
        }
    }

    async fn write_state(&mut self, file: &StateFile) -> Result<(), Exit> {
        match self {
            Writer::Directory(s) => s.write_state(file).await.map_err(Exit::checkpoint),
            Writer::Cassandra(s) => s.write_state(file).await.map_err(Exit::cassandra),
        }
    }

    async fn read_state(&mut self, file: StateFileId) -> Result<StateFile, Exit> {
        match self {
            Writer::Directory(s) => s.read_state(0, file).await.map_err(Exit::checkpoint),
            Writer::Cassandra(s) => s.read_state(0, file).await.map_err(Exit::cassandra),
        }
    }

    fn describe(&self, log: Log, batch: BatchId) -> String {
        match self {
            Writer::Directory(s) => s.describe(log, batch),
            Writer::Cassandra(s) => s.describe(log, batch),
        }
    }

    /// Records an empty batch at `target` (merged over the latest offsets), so that
    /// the next batch starts there; Spark reads such a move the same way. Returns
    /// the id of the empty batch.
    async fn move_to(&mut self, target: &PartitionOffsets) -> Result<BatchId, Exit> {
        let stored = self.load().await?;
        let next = match stored.recovery() {
            Ok(Recovery::StartFresh) => BatchId::FIRST,
            Ok(Recovery::RunNext { next, .. }) => next,
            Ok(Recovery::Replay { batch }) => {
                return Err(Exit::checkpoint_state(anyhow!(
                    "batch {batch} is planned but not committed ({}); run the query so it finishes \
                     that batch, then move the offsets",
                    self.describe(Log::Plans, batch)
                )));
            }
            Err(e) => {
                return Err(Exit::checkpoint_state(anyhow!(
                    "the store is inconsistent: {e}"
                )));
            }
        };
        let mut moved = stored
            .latest_plan
            .as_ref()
            .map(BatchPlan::end_offsets)
            .unwrap_or_default();
        moved.extend(target.clone());
        let metadata = BatchMetadata {
            conf: [("sluice.movedBy".to_owned(), "sluice offsets".to_owned())].into(),
            ..BatchMetadata::default()
        };
        // A query of several sources keeps a line each: a topic stays on the
        // line of the source that read it.
        let lines: Vec<PartitionOffsets> = stored
            .latest_plan
            .as_ref()
            .map(BatchPlan::end_offsets_by_source)
            .unwrap_or_default();
        let source_of = |tp: &TopicPartition| match lines.len() {
            0 | 1 => Some(0),
            _ => lines
                .iter()
                .position(|line| line.keys().any(|known| known.topic == tp.topic)),
        };
        let plan = BatchPlan::from_offsets(next, &moved, &moved, metadata)
            .and_then(|plan| plan.with_sources(lines.len(), source_of))
            .map_err(|e| Exit::config(anyhow!("offsets: {e}")))?;
        self.write_plan(&plan).await?;
        self.write_commit(&BatchCommit {
            id: next,
            next_watermark_ms: 0,
        })
        .await?;
        Ok(next)
    }
}
