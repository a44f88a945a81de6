//! `sluice offsets show` and `set` for a query in group mode
//! (`docs/scale-out.md`): its offsets live per partition, in the directory and
//! in the logs of the generations that hold them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::anyhow;
use serde_json::{Value, json};
use sluice_cassandra_store::{
    CassandraDirectory, CassandraLocation, CassandraOptions, CassandraStore, CassandraStoreError,
    InspectedLog,
};
use sluice_core::{
    Directory, Generation, Offset, PartitionOffsets, StoredBatches, TopicPartition, offsets_to_json,
};

use crate::config::StoreKind;
use crate::exit::{Classify, Exit};

/// The directory of the query at `location` if it runs in group mode.
pub(crate) async fn directory_of(location: &CassandraLocation) -> Result<Option<Directory>, Exit> {
    match CassandraDirectory::inspect(location.clone(), CassandraOptions::default()).await {
        Ok(found) => Ok(found),
        // A keyspace or table that does not exist holds no group-mode query.
        Err(
            CassandraStoreError::MissingKeyspace { .. } | CassandraStoreError::MissingTable { .. },
        ) => Ok(None),
        Err(e) => Err(Exit::cassandra(e)),
    }
}

/// Where a partition held by a generation with `stored` has committed to:
/// the end of its last committed batch, or, before any, where it started.
fn committed_end(stored: &StoredBatches, tp: &TopicPartition, start: Offset) -> Offset {
    let Some(plan) = &stored.latest_plan else {
        return start;
    };
    let committed = stored.latest_commit.as_ref().map(|c| c.id) == Some(plan.id());
    // An uncommitted plan starts where the last committed one ended.
    let offsets = match committed {
        true => plan.end_offsets(),
        false => plan.start_offsets(),
    };
    offsets.get(tp).copied().unwrap_or(start)
}

/// The batch a generation planned and did not commit, over `tp`.
fn pending_over(stored: &StoredBatches, tp: &TopicPartition) -> Value {
    let Some(plan) = &stored.latest_plan else {
        return Value::Null;
    };
    if stored.latest_commit.as_ref().map(|c| c.id) == Some(plan.id()) {
        return Value::Null;
    }
    match plan.ranges().iter().find(|r| &r.topic_partition == tp) {
        Some(range) => json!({
            "batchId": plan.id().0,
            "startOffset": range.from.value(),
            "endOffset": range.until.value(),
        }),
        None => Value::Null,
    }
}

async fn logs_of(
    location: &CassandraLocation,
    holders: BTreeSet<Generation>,
) -> Result<BTreeMap<Generation, Option<InspectedLog>>, Exit> {
    let mut logs = BTreeMap::new();
    for holder in holders {
        let log = CassandraLocation {
            query: holder.log_name(&location.query),
            ..location.clone()
        };
        let inspected = CassandraStore::inspect_log(log, CassandraOptions::default())
            .await
            .map_err(Exit::cassandra)?;
        logs.insert(holder, inspected);
    }
    Ok(logs)
}

/// `sluice offsets show` of a group-mode query: every partition with its
/// committed offset, the generation holding it and that generation's epoch.
pub(crate) async fn show(
    checkpoint: &str,
    location: &CassandraLocation,
    directory: &Directory,
) -> Result<Value, Exit> {
    let origin = directory
        .origin
        .as_ref()
        .ok_or_else(|| Exit::config(anyhow!("{checkpoint} holds no group-mode query")))?;
    let logs = logs_of(location, directory.holders()).await?;
    let partitions: BTreeSet<&TopicPartition> = directory
        .entries
        .keys()
        .chain(origin.initial.keys())
        .collect();
    let mut committed = PartitionOffsets::new();
    let mut rows = Vec::new();
    for tp in partitions {
        let (state, owner, epoch, offset, pending) = match directory.entries.get(tp) {
            None => (
                "never held",
                Value::Null,
                Value::Null,
                origin.initial[tp],
                Value::Null,
            ),
            Some(entry) => match &entry.owner {
                None => (
                    "handed back",
                    Value::Null,
                    Value::Null,
                    entry.start,
                    Value::Null,
                ),
                Some(owner) => {
                    let log = logs.get(owner).and_then(Option::as_ref);
                    (
                        "held",
                        json!(owner.as_str()),
                        log.map_or(Value::Null, |l| json!(l.epoch)),
                        log.map_or(entry.start, |l| committed_end(&l.stored, tp, entry.start)),
                        log.map_or(Value::Null, |l| pending_over(&l.stored, tp)),
                    )
                }
            },
        };
        committed.insert(tp.clone(), offset);
        rows.push(json!({
            "topic": tp.topic,
            "partition": tp.partition,
            "state": state,
            "committedOffset": offset.value(),
            "owner": owner,
            "epoch": epoch,
            "pending": pending,
        }));
    }
    Ok(json!({
        "checkpoint": checkpoint,
        "id": origin.query_id,
        "mode": "group",
        "committedOffsets": serde_json::from_str::<Value>(&offsets_to_json(&committed))
            .unwrap_or(Value::Null),
        "initialOffsets": serde_json::from_str::<Value>(&offsets_to_json(&origin.initial))
            .unwrap_or(Value::Null),
        "partitions": rows,
    }))
}

/// `sluice offsets set` of a group-mode query: only with no live member in
/// its consumer group, and only for partitions no generation holds; then the
/// next holder of each starts at its new offset.
pub(crate) async fn set(
    checkpoint: &str,
    location: &CassandraLocation,
    directory: &Directory,
    target: &PartitionOffsets,
    config: Option<&Path>,
) -> Result<(), Exit> {
    let config = config.ok_or_else(|| {
        Exit::config(anyhow!(
            "{checkpoint} is a group-mode query: add --config with its configuration, whose \
             consumer group is checked for running members before anything moves"
        ))
    })?;
    let settings = crate::config::load(config).map_err(Exit::config)?;
    let StoreKind::Cassandra(configured, options) = &settings.checkpoint else {
        return Err(Exit::config(anyhow!(
            "{} keeps its offsets in a checkpoint directory, not in {checkpoint}",
            config.display()
        )));
    };
    if (&configured.keyspace, &configured.query) != (&location.keyspace, &location.query) {
        return Err(Exit::config(anyhow!(
            "{} is the configuration of query {}.{}, not of {checkpoint}",
            config.display(),
            configured.keyspace,
            configured.query
        )));
    }
    let group = settings
        .kafka()
        .group_id
        .clone()
        .ok_or_else(|| Exit::config(anyhow!("{} has no source.group_id", config.display())))?;
    let kafka = settings.kafka().clone();
    let members = tokio::task::spawn_blocking(move || {
        sluice_kafka::live_members(&kafka.bootstrap_servers, &group, &kafka.client_options)
    })
    .await
    .map_err(|e| Exit::runtime(anyhow!("describing the consumer group: {e}")))?
    .map_err(Classify::exit)?;
    let group = settings.kafka().group_id.as_deref().unwrap_or_default();
    if !members.is_empty() {
        let names: Vec<String> = members
            .iter()
            .map(|(id, client)| format!("{client} ({id})"))
            .collect();
        return Err(Exit::checkpoint_state(anyhow!(
            "consumer group {group} of {checkpoint} has {} live member(s): {}; stop every `sluice \
             run` of the query before moving its offsets",
            members.len(),
            names.join(", ")
        )));
    }
    // Every partition is checked before any moves: a refusal leaves all as they were.
    for tp in target.keys() {
        if let Some(owner) = directory.entries.get(tp).and_then(|e| e.owner.as_ref()) {
            return Err(Exit::checkpoint_state(anyhow!(
                "{}/{} of {checkpoint} is still held by generation {owner}, whose member stopped \
                 without handing it back; run the query once so that it settles that generation \
                 (replaying its last batch), stop it, and set the offsets again",
                tp.topic,
                tp.partition
            )));
        }
    }
    let mut writer = CassandraDirectory::open(location.clone(), (**options).clone())
        .await
        .map_err(Exit::cassandra)?;
    for (tp, &offset) in target {
        let moved = writer
            .move_released(tp, directory.entries.get(tp), offset)
            .await
            .map_err(Exit::cassandra)?;
        if !moved {
            return Err(Exit::checkpoint_state(anyhow!(
                "{}/{} of {checkpoint} changed while its offsets were being moved: a member \
                 started. The partitions before it in {} were moved, it and those after were not",
                tp.topic,
                tp.partition,
                offsets_to_json(target)
            )));
        }
    }
    println!(
        "{checkpoint}: the next holders of {} partition(s) start at {}",
        target.len(),
        offsets_to_json(target)
    );
    Ok(())
}
