//! The state of a query's stateful operators in its checkpoint: restored on
//! start, a delta made durable before each commit, a snapshot now and then
//! after one, and files no retained batch needs purged with the batches.
//!
//! This is the one place that moves state between a processor's
//! [`StatefulOperator`]s and the [`StateStore`]: an operator encodes its own
//! files, and the store keeps bytes. Which files rebuild a version and which
//! can go are the model's decisions (`state_files_for`,
//! `state_files_to_purge_in`).

use std::collections::BTreeMap;
use std::time::Instant;

use sluice_core::{
    BatchId, Processor, Source, StateFile, StateFileId, StateFileKind, StateGap, StatefulOperator,
    Writes, state_files_for, state_files_to_purge_in,
};

use super::{Query, QueryError, QueryStore, micros};
use crate::ExecutorError;
use crate::progress::StateOperatorProgress;
use crate::retry::Part;

/// What writing a batch's state took.
#[derive(Default)]
pub(super) struct StateWritten {
    /// Encoding its deltas.
    encode_micros: u64,
    /// Writing them durably.
    micros: u64,
    bytes: u64,
    /// Encoding and writing the snapshots after the commit, when due.
    snapshot_micros: u64,
    snapshot_bytes: u64,
}

impl<Src, Store, Snk, Proc, Dead> Query<Src, Store, Snk, Proc, Dead>
where
    Src: Source,
    Store: QueryStore,
    Proc: Processor,
    Snk: Writes<Proc::Output>,
    Dead: Writes,
{
    /// Whether the query keeps state between batches.
    pub(super) fn is_stateful(&mut self) -> bool {
        !self.processor.stateful_operators().is_empty()
    }

    /// Sets the event-time watermark a restart continues from, which the last
    /// commit recorded.
    pub(super) fn restore_watermark(&mut self, watermark_ms: i64) {
        if let Some(clock) = self.processor.event_time() {
            clock.restore_watermark(watermark_ms);
        }
    }

    /// Rebuilds each stateful operator's state at `version` from the store: in
    /// each partition its newest snapshot up to the version and the deltas after
    /// it. `None` starts every operator with empty state.
    pub(super) async fn restore_state(
        &mut self,
        version: Option<BatchId>,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let partitions: Vec<u32> = self
            .processor
            .stateful_operators()
            .iter()
            .map(|operator| operator.partitions())
            .collect();
        for (operator, partitions) in (0..).zip(partitions) {
            let files = match version {
                Some(version) => self.read_version(operator, partitions, version).await?,
                None => Vec::new(),
            };
            if let Some(version) = version {
                tracing::info!(
                    operator,
                    version = version.0,
                    files = files.len(),
                    "restored the state of the last committed batch"
                );
            }
            self.operator(operator)
                .restore(&files)
                .map_err(ExecutorError::Process)?;
        }
        Ok(())
    }

    /// The files of `operator` that rebuild `version`, read from the store.
    async fn read_version(
        &mut self,
        operator: u32,
        partitions: u32,
        version: BatchId,
    ) -> Result<Vec<StateFile>, QueryError<Src, Store, Proc, Snk, Dead>> {
        let stored = self.stored_state(operator).await?;
        let wanted = state_files_for(&stored, partitions, version).map_err(|gap| match gap {
            StateGap::Missing {
                partition,
                version: missing,
            } => ExecutorError::StateMissing {
                operator,
                version: version.0,
                location: self.store.describe_state(
                    operator,
                    StateFileId {
                        partition,
                        version: missing,
                        kind: StateFileKind::Delta,
                    },
                ),
                hint: if stored.is_empty() {
                    "; batches that ran while the query was stateless have no \
                     state: give the stateful query a new checkpoint, or start it \
                     afresh with `sluice offsets set --reset-state`"
                        .to_owned()
                } else {
                    String::new()
                },
            },
            StateGap::Partitions { stored } => ExecutorError::StatePartitions {
                operator,
                version: version.0,
                stored,
                configured: partitions,
            },
        })?;
        let mut files = Vec::with_capacity(wanted.len());
        for id in wanted {
            files.push(retrying!(self, Part::Store, "reading state", async {
                self.store
                    .read_state(operator, id)
                    .await
                    .map_err(ExecutorError::Store)
            })?);
        }
        Ok(files)
    }

    /// `operator`'s state files in the store.
    async fn stored_state(
        &mut self,
        operator: u32,
    ) -> Result<Vec<StateFileId>, QueryError<Src, Store, Proc, Snk, Dead>> {
        retrying!(self, Part::Store, "listing state", async {
            self.store
                .list_state(operator)
                .await
                .map_err(ExecutorError::Store)
        })
    }

    /// Makes the finished batch's state durable, then commits it in each
    /// operator: the next batch starts from it.
    pub(super) async fn write_state(
        &mut self,
        batch: BatchId,
    ) -> Result<StateWritten, QueryError<Src, Store, Proc, Snk, Dead>> {
        let t = Instant::now();
        let files = self
            .encode(batch, StateFileKind::Delta)
            .map_err(ExecutorError::Process)?;
        let encode_micros = micros(t.elapsed());
        let t = Instant::now();
        let mut bytes = 0;
        for file in &files {
            retrying!(self, Part::Store, "writing state", async {
                self.store
                    .write_state(file)
                    .await
                    .map_err(ExecutorError::Store)
            })?;
            bytes += file.bytes.len() as u64;
        }
        for operator in self.processor.stateful_operators() {
            operator.commit();
        }
        Ok(StateWritten {
            encode_micros,
            micros: micros(t.elapsed()),
            bytes,
            ..StateWritten::default()
        })
    }

    /// Every operator's files of `kind` for `version`.
    fn encode(
        &mut self,
        version: BatchId,
        kind: StateFileKind,
    ) -> Result<Vec<StateFile>, Proc::Error> {
        sluice_core::encode_state(&mut self.processor, version, kind)
    }

    /// Writes snapshots of the committed `batch`'s state. The deltas hold the
    /// same, so a snapshot that cannot be written is a warning: the next restart
    /// reads more deltas, and the next due snapshot tries again.
    pub(super) async fn write_snapshots(&mut self, batch: BatchId, written: &mut StateWritten) {
        let t = Instant::now();
        let files = match self.encode(batch, StateFileKind::Snapshot) {
            Ok(files) => files,
            Err(e) => {
                tracing::warn!(batch = batch.0, error = %e, "encoding a state snapshot failed");
                return;
            }
        };
        for file in &files {
            let stored: Result<(), QueryError<Src, Store, Proc, Snk, Dead>> =
                retrying!(self, Part::Store, "writing a state snapshot", async {
                    self.store
                        .write_state(file)
                        .await
                        .map_err(ExecutorError::Store)
                });
            match stored {
                Ok(()) => written.snapshot_bytes += file.bytes.len() as u64,
                Err(e) => tracing::warn!(
                    batch = batch.0,
                    operator = file.operator,
                    error = %e,
                    "writing a state snapshot failed; a restart reads the deltas instead"
                ),
            }
        }
        written.snapshot_micros = micros(t.elapsed());
    }

    /// Removes the state files no retained batch can start from.
    pub(super) async fn purge_state(
        &mut self,
        keep_from: BatchId,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let operators = self.processor.stateful_operators().len() as u32;
        for operator in 0..operators {
            let stored = self.stored_state(operator).await?;
            let old = state_files_to_purge_in(&stored, keep_from);
            if !old.is_empty() {
                retrying!(self, Part::Store, "purging old state", async {
                    self.store
                        .remove_state(operator, &old)
                        .await
                        .map_err(ExecutorError::Store)
                })?;
            }
        }
        Ok(())
    }

    /// What each operator held after the batch, and what writing its state
    /// took, for the batch's progress report.
    pub(super) fn state_progress(&mut self, state: &StateWritten) -> Vec<StateOperatorProgress> {
        self.processor
            .stateful_operators()
            .iter()
            .map(|operator| {
                let s = operator.stats();
                let mut custom_metrics = BTreeMap::from([
                    ("stateFileBytes".to_owned(), state.bytes),
                    ("commitTimeMicros".to_owned(), state.micros),
                    ("encodeTimeMicros".to_owned(), state.encode_micros),
                    ("snapshotTimeMicros".to_owned(), state.snapshot_micros),
                    ("snapshotFileBytes".to_owned(), state.snapshot_bytes),
                ]);
                custom_metrics.extend(
                    s.custom_metrics
                        .iter()
                        .map(|(name, value)| ((*name).to_owned(), *value)),
                );
                StateOperatorProgress {
                    operator_name: s.name,
                    num_rows_total: s.rows_total,
                    num_rows_updated: s.rows_updated,
                    num_rows_removed: s.rows_removed,
                    num_rows_dropped_by_watermark: s.rows_dropped_by_watermark,
                    memory_used_bytes: s.memory_used_bytes,
                    batch_memory_bytes: s.batch_memory_bytes,
                    commit_time_ms: state.micros / 1000,
                    num_state_store_instances: 1,
                    custom_metrics,
                }
            })
            .collect()
    }

    /// Stateful operator number `operator`.
    fn operator(&mut self, operator: u32) -> &mut dyn StatefulOperator<Proc::Error> {
        self.processor
            .stateful_operators()
            .swap_remove(operator as usize)
    }
}
