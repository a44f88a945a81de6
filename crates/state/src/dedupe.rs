//! Deduplication on chosen keys within the watermark, as Spark's
//! `dropDuplicatesWithinWatermark`: the first row of a key passes, and every
//! later row of it is dropped until the watermark passes the first row's event
//! time plus the watermark delay; then the key is forgotten, and a row of it
//! passes again.
//!
//! The seen keys are packed as the aggregation's groups are ([`Keys`]: Arrow's
//! row format in one buffer, a hash table of numbers over them), each with the
//! event time at which it expires: about its key's bytes plus 20 bytes a key,
//! with no allocation of its own. A batch's new keys join the same table, so
//! that a row costs one probe, but they are numbered after the committed ones
//! and dropped again when a batch begins anew, so that a batch begun again
//! decides the same rows.
//!
//! A batch's delta holds the keys it wrote and one row for those its watermark
//! forgot: every key that expired before it, which restoring forgets in the
//! same way. Listing each forgotten key would double the delta of a stream
//! whose keys come and go at its rate.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, Int8Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Int8Type, Int64Type, Schema, SchemaRef};
use arrow::row::{RowConverter, SortField};
use hashbrown::HashMap;
use sluice_core::{StateFile, StateOperatorStats, StatefulOperator};

use crate::error::internal;
use crate::groups::{OP_REMOVE, OP_WRITE};
use crate::keys::{KeyHasher, Keys};
use crate::{Encoder, StateError, decode, partition_of};

/// The most rows a state file's table holds: a snapshot of many keys is
/// written a table at a time.
const ROWS_PER_TABLE: usize = 64 * 1024;

/// The op of a delta's first row when its batch forgot keys: every key that
/// expired before the row's `expires_ms` (the batch's watermark) is forgotten;
/// its key columns are null.
const OP_EXPIRE: i8 = 2;

/// A forgotten key's expiry: it is absent, and its slot waits to be compacted
/// away or taken again by the same key.
const FORGOTTEN: i64 = i64::MIN;

/// The seen keys of one keyed deduplication.
pub struct Dedupe {
    key_fields: Vec<Field>,
    converter: RowConverter,
    hasher: KeyHasher,
    delay_ms: i64,
    partitions: u32,
    memory_limit: u64,
    /// The keys and, per key number, when it expires ([`FORGOTTEN`] for a
    /// key removed since the keys were last compacted): the committed keys,
    /// numbered below `committed`, then the batch's new ones.
    keys: Keys,
    expires: Vec<i64>,
    committed: usize,
    /// Committed keys not forgotten.
    live: usize,
    /// The batch in progress.
    watermark_ms: i64,
    /// How many keys, of how many bytes, the last batch added: room for as
    /// many is made when a batch begins.
    last_added: (usize, usize),
    /// Committed keys that had expired and were seen again, with their new
    /// expiry.
    renewed: HashMap<u32, i64>,
    /// Committed keys the batch's watermark removed, found by `finish`.
    removed: Vec<u32>,
    delta: Option<Vec<Vec<u8>>>,
    stats: DedupeStats,
}

/// What a deduplication held and did in the last batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DedupeStats {
    /// Keys held.
    pub keys: u64,
    /// Keys the batch saw first (or again, after they had been forgotten).
    pub keys_added: u64,
    /// Keys the batch's watermark made it forget.
    pub keys_removed: u64,
    /// Rows dropped as duplicates of a key held.
    pub duplicates_dropped: u64,
    /// Rows dropped as later than the watermark.
    pub late_dropped: u64,
    /// Bytes the keys take in memory.
    pub memory_bytes: u64,
    /// The most the batch's own structures held beside the committed keys:
    /// its new keys and its delta, which a memory budget plans batches by.
    pub batch_memory_bytes: u64,
}

impl Dedupe {
    /// A deduplication on keys of the columns `key_fields`, forgetting a key
    /// `delay_ms` after its first row's event time has passed the watermark.
    pub fn new(key_fields: Vec<Field>, delay_ms: i64) -> Result<Dedupe, StateError> {
        let converter = RowConverter::new(
            key_fields
                .iter()
                .map(|f| SortField::new(f.data_type().clone()))
                .collect(),
        )
        .map_err(|e| internal("keys of the deduplication", e))?;
        Ok(Dedupe {
            key_fields,
            converter,
            hasher: KeyHasher::default(),
            delay_ms,
            partitions: 1,
            memory_limit: u64::MAX,
            keys: Keys::default(),
            expires: Vec::new(),
            committed: 0,
            live: 0,
            watermark_ms: i64::MIN,
            last_added: (0, 0),
            renewed: HashMap::new(),
            removed: Vec::new(),
            delta: None,
            stats: DedupeStats::default(),
        })
    }

    /// Splits its state files into `partitions` partitions by key.
    pub fn with_partitions(mut self, partitions: u32) -> Dedupe {
        self.partitions = partitions.max(1);
        self
    }

    /// Stops a batch whose keys, held and new, take more than `bytes`.
    pub fn with_memory_limit(mut self, bytes: u64) -> Dedupe {
        self.memory_limit = bytes;
        self
    }

    /// Begins a batch under the watermark `watermark_ms`, from the committed
    /// keys, forgetting whatever a batch begun before did.
    pub fn begin(&mut self, watermark_ms: i64) {
        self.watermark_ms = watermark_ms;
        if self.keys.len() > self.committed {
            self.keys.truncate(&self.hasher, self.committed);
            self.expires.truncate(self.committed);
        }
        let (keys, bytes) = self.last_added;
        self.keys.reserve(&self.hasher, keys, bytes);
        self.expires.reserve(keys);
        self.renewed = HashMap::new();
        self.removed.clear();
        self.delta = None;
        self.stats = DedupeStats {
            keys: self.live as u64,
            memory_bytes: self.memory_bytes(),
            ..DedupeStats::default()
        };
    }

    /// Counts `rows` rows dropped as later than the watermark before they
    /// reached it.
    pub fn dropped(&mut self, rows: usize) {
        self.stats.late_dropped += rows as u64;
    }

    /// Which rows pass: those whose key (the columns `keys`, in the order of
    /// the fields it was made with) it does not hold, each the first of its key
    /// in the batch; `event_ms` is each row's event time.
    pub fn keep(
        &mut self,
        keys: &[ArrayRef],
        event_ms: &Int64Array,
    ) -> Result<BooleanArray, StateError> {
        let rows = self
            .converter
            .convert_columns(keys)
            .map_err(|e| internal("keys of the deduplication", e))?;
        if self.keys.len() == self.committed && self.last_added.0 == 0 {
            // A first batch's rows are mostly new keys: room for them at once.
            let bytes = rows.size().min(rows.num_rows() * 64);
            self.keys.reserve(&self.hasher, rows.num_rows(), bytes);
        }
        let mut keep = Vec::with_capacity(rows.num_rows());
        for (row, key) in rows.iter().enumerate() {
            let key = key.as_ref();
            let hash = self.hasher.hash(key);
            let expires = if event_ms.is_null(row) {
                // A row without event time never expires by the watermark;
                // the processor drops such rows before they get here.
                i64::MAX
            } else {
                event_ms.value(row).saturating_add(self.delay_ms)
            };
            let passes = match self.keys.find_or_push(&self.hasher, hash, key)? {
                (_, true) => {
                    self.expires.push(expires);
                    true
                }
                // A key the batch saw first.
                (n, false) if n as usize >= self.committed => false,
                (n, false) if self.held(n) => false,
                (n, false) => match self.renewed.entry(n) {
                    hashbrown::hash_map::Entry::Occupied(_) => false,
                    hashbrown::hash_map::Entry::Vacant(entry) => {
                        entry.insert(expires);
                        true
                    }
                },
            };
            if passes {
                self.stats.keys_added += 1;
            } else {
                self.stats.duplicates_dropped += 1;
            }
            keep.push(passes);
        }
        let bytes = self.memory_bytes();
        if bytes > self.memory_limit {
            return Err(StateError::OverMemory {
                bytes,
                limit: self.memory_limit,
            });
        }
        Ok(BooleanArray::from(keep))
    }

    /// Whether the committed key `number` is still held under the batch's
    /// watermark.
    fn held(&self, number: u32) -> bool {
        let expires = self.expires[number as usize];
        expires != FORGOTTEN && expires >= self.watermark_ms
    }

    /// Ends the batch: forgets the keys its watermark passed, and encodes what
    /// changed as the batch's delta.
    pub fn finish(&mut self) -> Result<(), StateError> {
        self.removed = (0..self.committed as u32)
            .filter(|&n| {
                self.expires[n as usize] != FORGOTTEN
                    && !self.held(n)
                    && !self.renewed.contains_key(&n)
            })
            .collect();
        self.stats.keys_removed = self.removed.len() as u64;
        let added = self.keys.len() - self.committed;
        let written = (self.committed as u32..self.keys.len() as u32)
            .map(|n| (self.keys.key(n), self.expires[n as usize]))
            .chain(
                self.renewed
                    .iter()
                    .map(|(&n, &expires)| (self.keys.key(n), expires)),
            );
        let expired = (!self.removed.is_empty()).then_some(self.watermark_ms);
        let delta = self.files(expired, added + self.renewed.len(), written)?;
        self.stats.batch_memory_bytes = (self.keys.bytes_from(self.committed)
            + added * (size_of::<u32>() + size_of::<i64>() + 8)
            + self.renewed.allocation_size()
            + self.removed.capacity() * size_of::<u32>()
            + delta.iter().map(Vec::len).sum::<usize>())
            as u64;
        self.delta = Some(delta);
        let revived = self
            .renewed
            .keys()
            .filter(|&&n| self.expires[n as usize] == FORGOTTEN)
            .count();
        self.stats.keys = (self.live + added + revived - self.removed.len()) as u64;
        self.stats.memory_bytes = self.memory_bytes();
        Ok(())
    }

    /// Makes the finished batch's keys the committed ones.
    pub fn commit(&mut self) {
        if self.delta.take().is_none() {
            return;
        }
        for (&n, &expires) in &self.renewed {
            if self.expires[n as usize] == FORGOTTEN {
                self.live += 1;
            }
            self.expires[n as usize] = expires;
        }
        for &n in &self.removed {
            self.expires[n as usize] = FORGOTTEN;
        }
        self.live -= self.removed.len();
        let added = self.keys.len() - self.committed;
        self.last_added = (added, self.keys.bytes_from(self.committed));
        self.live += added;
        self.committed = self.keys.len();
        // Forgotten keys' slots are dropped when they are as many as the live
        // keys, and before the table would grow for the next batch's new keys:
        // growing hashes every key again, forgotten ones too, and compacting
        // hashes only the live ones.
        let forgotten = self.expires.len() - self.live;
        if forgotten > 1024 && (forgotten > self.live || self.keys.room() < added) {
            self.compact();
        }
        self.renewed = HashMap::new();
        self.removed = Vec::new();
    }

    /// Drops the forgotten keys' slots, leaving room for as many new keys as
    /// the last batch added.
    fn compact(&mut self) {
        // Room for two batches' new keys, so that the next batch finds room
        // and the one after it, with the keys the next one forgets, finds
        // the table due for compacting rather than growing.
        let (more, bytes) = self.last_added;
        let live_bytes: usize = (0..self.expires.len() as u32)
            .filter(|&n| self.expires[n as usize] != FORGOTTEN)
            .map(|n| self.keys.key(n).len())
            .sum();
        let mut keys = Keys::with_capacity(self.live + 2 * more, live_bytes + 2 * bytes);
        let mut expires = Vec::with_capacity(self.live + 2 * more);
        for (key, &at) in self.keys.iter().zip(&self.expires) {
            if at != FORGOTTEN {
                keys.push_fitting(&self.hasher, self.hasher.hash(key), key);
                expires.push(at);
            }
        }
        self.keys = keys;
        self.expires = expires;
        self.committed = self.keys.len();
    }

    /// What the keys take in memory, held and the batch's.
    fn memory_bytes(&self) -> u64 {
        (self.keys.memory_size()
            + self.expires.capacity() * size_of::<i64>()
            + self.renewed.allocation_size()) as u64
    }

    /// What it held and did in the last batch.
    pub fn stats(&self) -> DedupeStats {
        self.stats
    }

    /// The columns of its state files: the op, the key's columns, the expiry.
    pub fn file_schema(&self) -> SchemaRef {
        let mut fields = vec![Field::new("op", DataType::Int8, false)];
        fields.extend(
            self.key_fields
                .iter()
                .cloned()
                .map(|f| f.with_nullable(true)),
        );
        fields.push(Field::new("expires_ms", DataType::Int64, false));
        Arc::new(Schema::new(fields))
    }

    /// One file per partition: first the row that forgets the keys expired
    /// before `expired`, when there is one, then `written` (about `rows` keys
    /// in row format, each with its expiry), a table of at most
    /// [`ROWS_PER_TABLE`] rows at a time, so that a snapshot of many keys is
    /// never one table in memory.
    fn files<'a>(
        &self,
        expired: Option<i64>,
        rows: usize,
        written: impl Iterator<Item = (&'a [u8], i64)>,
    ) -> Result<Vec<Vec<u8>>, StateError> {
        let schema = self.file_schema();
        let partitions = self.partitions as usize;
        let mut files = (0..partitions)
            .map(|_| Encoder::new(&schema))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(watermark_ms) = expired {
            let expire = self.expire_row(watermark_ms)?;
            for file in &mut files {
                file.write(&expire)?;
            }
        }
        let mut written_any = vec![expired.is_some(); partitions];
        let room = (rows / partitions + 1).min(ROWS_PER_TABLE);
        let mut pending: Vec<Vec<(&[u8], i64)>> =
            (0..partitions).map(|_| Vec::with_capacity(room)).collect();
        for (key, expires) in written {
            let part = if partitions == 1 {
                0
            } else {
                partition_of(key, self.partitions) as usize
            };
            pending[part].push((key, expires));
            if pending[part].len() == ROWS_PER_TABLE {
                files[part].write(&self.table(&pending[part])?)?;
                pending[part].clear();
                written_any[part] = true;
            }
        }
        for ((file, rest), written) in files.iter_mut().zip(&pending).zip(written_any) {
            if !rest.is_empty() || !written {
                file.write(&self.table(rest)?)?;
            }
        }
        files.into_iter().map(Encoder::finish).collect()
    }

    /// Keys written, each with its expiry, as a table of a state file.
    fn table(&self, written: &[(&[u8], i64)]) -> Result<RecordBatch, StateError> {
        let parser = self.converter.parser();
        let keys = self
            .converter
            .convert_rows(written.iter().map(|w| parser.parse(w.0)))
            .map_err(|e| internal("keys of the deduplication", e))?;
        let mut columns: Vec<ArrayRef> =
            vec![Arc::new(Int8Array::from_value(OP_WRITE, written.len()))];
        columns.extend(keys);
        columns.push(Arc::new(Int64Array::from_iter_values(
            written.iter().map(|w| w.1),
        )));
        RecordBatch::try_new(self.file_schema(), columns)
            .map_err(|e| internal("a state file of the deduplication", e))
    }

    /// The row that forgets every key expired before `watermark_ms`.
    fn expire_row(&self, watermark_ms: i64) -> Result<RecordBatch, StateError> {
        let mut columns: Vec<ArrayRef> = vec![Arc::new(Int8Array::from(vec![OP_EXPIRE]))];
        columns.extend(
            self.key_fields
                .iter()
                .map(|f| arrow::array::new_null_array(f.data_type(), 1)),
        );
        columns.push(Arc::new(Int64Array::from(vec![watermark_ms])));
        RecordBatch::try_new(self.file_schema(), columns)
            .map_err(|e| internal("a state file of the deduplication", e))
    }

    /// The whole committed state, one file per partition.
    pub fn snapshot_files(&self) -> Result<Vec<Vec<u8>>, StateError> {
        let held = self
            .keys
            .iter()
            .zip(&self.expires[..self.committed])
            .filter(|(_, at)| **at != FORGOTTEN)
            .map(|(key, &at)| (key, at));
        self.files(None, self.live, held)
    }

    /// The batch's delta, once it finished and until it is committed.
    pub fn pending_delta(&self) -> Option<&[Vec<u8>]> {
        self.delta.as_deref()
    }

    /// Sets the committed keys from state files' tables, each a snapshot or a
    /// delta of a partition, in the order they were written per partition.
    pub fn restore(&mut self, tables: &[(RecordBatch, u32, &str)]) -> Result<(), StateError> {
        self.reset();
        let key_columns = self.key_fields.len();
        for (table, partition, location) in tables {
            let damaged = |reason: String| StateError::Damaged {
                location: (*location).to_owned(),
                reason,
            };
            let ops = table
                .column(0)
                .as_primitive_opt::<Int8Type>()
                .ok_or_else(|| damaged("its first column is not the int8 op".to_owned()))?;
            let expires = table
                .column(key_columns + 1)
                .as_primitive_opt::<Int64Type>()
                .ok_or_else(|| damaged("its last column is not the int64 expiry".to_owned()))?;
            let rows = self
                .converter
                .convert_columns(&table.columns()[1..=key_columns])
                .map_err(|e| damaged(format!("its keys do not read back ({e})")))?;
            for (row, key) in rows.iter().enumerate() {
                if ops.value(row) == OP_EXPIRE {
                    self.expire(expires.value(row), *partition);
                    continue;
                }
                let key = key.as_ref();
                let hash = self.hasher.hash(key);
                let number = self.keys.find(hash, key);
                match (ops.value(row), number) {
                    (OP_WRITE, Some(n)) => {
                        if self.expires[n as usize] == FORGOTTEN {
                            self.live += 1;
                        }
                        self.expires[n as usize] = expires.value(row);
                    }
                    (OP_WRITE, None) => {
                        self.keys.push(&self.hasher, hash, key)?;
                        self.expires.push(expires.value(row));
                        self.live += 1;
                    }
                    (OP_REMOVE, Some(n)) if self.expires[n as usize] != FORGOTTEN => {
                        self.expires[n as usize] = FORGOTTEN;
                        self.live -= 1;
                    }
                    (OP_REMOVE, _) => {}
                    (op, _) => {
                        return Err(damaged(format!(
                            "damaged or written by a newer Sluice: row {row} has the op {op}, \
                             and a deduplication's state knows 0, 1 and 2"
                        )));
                    }
                }
            }
        }
        self.committed = self.keys.len();
        self.compact();
        self.stats.keys = self.live as u64;
        self.stats.memory_bytes = self.memory_bytes();
        Ok(())
    }

    /// Forgets the keys of `partition` that expired before `watermark_ms`, as
    /// the batch that wrote it did.
    fn expire(&mut self, watermark_ms: i64, partition: u32) {
        for (n, at) in self.expires.iter_mut().enumerate() {
            if *at != FORGOTTEN
                && *at < watermark_ms
                && (self.partitions == 1
                    || partition_of(self.keys.key(n as u32), self.partitions) == partition)
            {
                *at = FORGOTTEN;
                self.live -= 1;
            }
        }
    }

    /// Forgets every key.
    pub fn reset(&mut self) {
        self.keys = Keys::default();
        self.expires = Vec::new();
        self.committed = 0;
        self.live = 0;
        self.begin(i64::MIN);
    }

    /// Whether it holds keys that a later watermark alone would forget.
    pub fn holds_keys(&self) -> bool {
        self.live > 0
    }
}

impl<E: From<StateError>> StatefulOperator<E> for Dedupe {
    fn name(&self) -> &str {
        "dedupeWithinWatermark"
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }

    fn delta(&self) -> Result<Vec<Vec<u8>>, E> {
        Ok(self.pending_delta().map(<[_]>::to_vec).unwrap_or_default())
    }

    fn snapshot(&self) -> Result<Vec<Vec<u8>>, E> {
        Ok(self.snapshot_files()?)
    }

    fn restore(&mut self, files: &[StateFile]) -> Result<(), E> {
        let schema = self.file_schema();
        let tables = files
            .iter()
            .map(|f| {
                let table = decode(&f.bytes, &schema, &f.location)?;
                Ok((table, f.partition, f.location.as_str()))
            })
            .collect::<Result<Vec<_>, StateError>>()?;
        Ok(Dedupe::restore(self, &tables)?)
    }

    fn commit(&mut self) {
        Dedupe::commit(self);
    }

    fn waits_for_watermark(&self) -> bool {
        self.holds_keys()
    }

    fn stats(&self) -> StateOperatorStats {
        let stats = self.stats;
        StateOperatorStats {
            name: "dedupeWithinWatermark".to_owned(),
            rows_total: stats.keys,
            rows_updated: stats.keys_added,
            rows_removed: stats.keys_removed,
            rows_dropped_by_watermark: stats.late_dropped,
            memory_used_bytes: stats.memory_bytes,
            batch_memory_bytes: stats.batch_memory_bytes,
            custom_metrics: vec![("numDroppedDuplicateRows", stats.duplicates_dropped)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::StringArray;

    fn dedupe() -> Dedupe {
        Dedupe::new(vec![Field::new("id", DataType::Utf8, true)], 10)
            .unwrap()
            .with_partitions(3)
    }

    /// The rows of `ids` (at event times `at`) that pass.
    fn keep(d: &mut Dedupe, ids: &[Option<&str>], at: &[i64]) -> Vec<bool> {
        let keys: ArrayRef = Arc::new(StringArray::from(ids.to_vec()));
        let mask = d.keep(&[keys], &Int64Array::from(at.to_vec())).unwrap();
        mask.iter().map(Option::unwrap).collect()
    }

    fn batch(d: &mut Dedupe, watermark: i64, ids: &[Option<&str>], at: &[i64]) -> Vec<bool> {
        d.begin(watermark);
        let kept = keep(d, ids, at);
        d.finish().unwrap();
        kept
    }

    fn files(d: &Dedupe, delta: bool) -> Vec<StateFile> {
        let bytes = if delta {
            d.pending_delta().unwrap().to_vec()
        } else {
            d.snapshot_files().unwrap()
        };
        bytes
            .into_iter()
            .enumerate()
            .map(|(i, bytes)| StateFile {
                operator: 0,
                partition: i as u32,
                version: sluice_core::BatchId(0),
                kind: if delta {
                    sluice_core::StateFileKind::Delta
                } else {
                    sluice_core::StateFileKind::Snapshot
                },
                location: format!("part {i}"),
                bytes,
            })
            .collect()
    }

    /// What a deduplication decides, kept the plain way: each held key's
    /// expiry, every key looked at on every batch.
    #[derive(Default)]
    struct Model {
        held: std::collections::HashMap<String, i64>,
    }

    impl Model {
        fn batch(&mut self, watermark: i64, ids: &[String], at: &[i64]) -> (Vec<bool>, usize) {
            let mut seen = std::collections::HashMap::new();
            let kept = ids
                .iter()
                .zip(at)
                .map(|(id, &at)| {
                    let held = self.held.get(id).is_some_and(|&e| e >= watermark);
                    if held || seen.contains_key(id) {
                        return false;
                    }
                    seen.insert(id.clone(), at + 10);
                    true
                })
                .collect();
            let removed = self
                .held
                .iter()
                .filter(|(id, e)| **e < watermark && !seen.contains_key(*id))
                .count();
            self.held
                .retain(|id, e| *e >= watermark || seen.contains_key(id));
            self.held.extend(seen);
            (kept, removed)
        }
    }

    #[test]
    fn it_decides_and_forgets_as_a_plain_model_does_over_many_batches() {
        let mut d = dedupe();
        let mut model = Model::default();
        let mut random = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |below: u64| {
            random ^= random << 13;
            random ^= random >> 7;
            random ^= random << 17;
            random % below
        };
        let mut now = 0_i64;
        let mut stored = Vec::new();
        for batch_no in 0..400 {
            let rows = next(60) as usize;
            let ids: Vec<String> = (0..rows).map(|_| format!("k{}", next(300))).collect();
            let at: Vec<i64> = (0..rows)
                .map(|_| {
                    now += next(40) as i64;
                    now - next(3_000) as i64
                })
                .collect();
            let watermark = now - 2_000 - next(500) as i64;
            let refs: Vec<Option<&str>> = ids.iter().map(|i| Some(i.as_str())).collect();
            if batch_no % 7 == 3 {
                // A batch begun, then begun again: the first attempt leaves no trace.
                batch(&mut d, watermark, &refs[..rows / 2], &at[..rows / 2]);
            }
            let kept = batch(&mut d, watermark, &refs, &at);
            let (want, removed) = model.batch(watermark, &ids, &at);
            assert_eq!(kept, want, "batch {batch_no}");
            assert_eq!(d.stats().keys_removed, removed as u64, "batch {batch_no}");
            stored.extend(files(&d, true));
            d.commit();
            assert_eq!(d.stats().keys, model.held.len() as u64, "batch {batch_no}");
            if batch_no % 50 == 49 {
                // Restored from the last snapshot and every delta after it,
                // partition by partition as a store reads them.
                stored.sort_by_key(|f| f.partition);
                let mut restored = dedupe();
                StatefulOperator::<StateError>::restore(&mut restored, &stored).unwrap();
                assert_eq!(restored.stats().keys, d.stats().keys, "batch {batch_no}");
                d = restored;
            }
            if batch_no % 100 == 99 {
                stored = files(&d, false);
            }
        }
    }

    #[test]
    fn the_first_row_of_a_key_passes_until_the_watermark_passes_it() {
        let mut d = dedupe();
        let a = Some("a");
        let b = Some("b");
        // Within a batch and across batches, only the first of a key passes;
        // a null key is a key too.
        assert_eq!(
            batch(
                &mut d,
                0,
                &[a, b, a, None, None],
                &[100, 100, 101, 100, 100]
            ),
            [true, true, false, true, false]
        );
        d.commit();
        assert_eq!(d.stats().keys, 3);
        assert_eq!(batch(&mut d, 50, &[a, b], &[105, 120]), [false, false]);
        assert_eq!(d.stats().duplicates_dropped, 2);
        assert!(d.stats().batch_memory_bytes > 0);
        d.commit();
        // "a" expires at 110: held under a watermark of 110, forgotten past it.
        assert_eq!(batch(&mut d, 110, &[a], &[130]), [false]);
        d.commit();
        d.begin(111);
        d.finish().unwrap();
        assert_eq!(d.stats().keys_removed, 3);
        assert_eq!(d.stats().keys, 0);
        d.commit();
        assert_eq!(batch(&mut d, 111, &[a, a], &[140, 141]), [true, false]);
        d.commit();
        assert_eq!(d.stats().keys, 1);
    }

    #[test]
    fn a_batch_begun_again_decides_the_same_rows() {
        let mut d = dedupe();
        batch(&mut d, 0, &[Some("a")], &[100]);
        d.commit();
        let first = batch(
            &mut d,
            0,
            &[Some("a"), Some("b"), Some("b")],
            &[100, 100, 100],
        );
        // Not committed: begun again, "b" is new again.
        let again = batch(
            &mut d,
            0,
            &[Some("a"), Some("b"), Some("b")],
            &[100, 100, 100],
        );
        assert_eq!(first, again);
        assert_eq!(first, [false, true, false]);
    }

    #[test]
    fn keys_restore_from_a_snapshot_and_the_deltas_after_it() {
        let mut d = dedupe();
        let ids: Vec<String> = (0..50).map(|i| format!("k{i}")).collect();
        let all: Vec<Option<&str>> = ids.iter().map(|s| Some(s.as_str())).collect();
        let times: Vec<i64> = (0..50).collect();
        batch(&mut d, 0, &all, &times);
        d.commit();
        let snapshot = files(&d, false);
        // The watermark forgets k0..k9 (expiring at 10..19); k5 comes again.
        batch(&mut d, 20, &[Some("k5"), Some("new")], &[30, 30]);
        let delta = files(&d, true);
        d.commit();
        assert_eq!(d.stats().keys, 42);
        let mut restored = dedupe();
        let mut stored = snapshot;
        stored.extend(delta);
        StatefulOperator::<StateError>::restore(&mut restored, &stored).unwrap();
        assert_eq!(restored.stats().keys, 42);
        let probe = [
            Some("k4"),
            Some("k5"),
            Some("k10"),
            Some("new"),
            Some("other"),
        ];
        assert_eq!(
            batch(&mut restored, 20, &probe, &[40; 5]),
            batch(&mut d, 20, &probe, &[40; 5])
        );
        // A file of another query's keys is named, not misread.
        let other = Dedupe::new(vec![Field::new("n", DataType::Int64, true)], 10).unwrap();
        let err = StatefulOperator::<StateError>::restore(&mut { other }, &stored).unwrap_err();
        assert!(err.to_string().contains("another query"), "{err}");
    }

    #[test]
    fn a_snapshot_of_more_keys_than_a_table_holds_restores_whole() {
        let mut d = dedupe();
        let ids: Vec<String> = (0..150_000).map(|i| format!("k{i}")).collect();
        let all: Vec<Option<&str>> = ids.iter().map(|s| Some(s.as_str())).collect();
        batch(&mut d, 0, &all, &vec![5; all.len()]);
        d.commit();
        let mut restored = dedupe();
        StatefulOperator::<StateError>::restore(&mut restored, &files(&d, false)).unwrap();
        assert_eq!(restored.stats().keys, 150_000);
        assert_eq!(
            batch(
                &mut restored,
                0,
                &[Some("k149999"), Some("k150000")],
                &[6, 6]
            ),
            [false, true]
        );
    }

    #[test]
    fn forgotten_keys_are_compacted_away() {
        let mut d = dedupe();
        let ids: Vec<String> = (0..5000).map(|i| format!("k{i}")).collect();
        let all: Vec<Option<&str>> = ids.iter().map(|s| Some(s.as_str())).collect();
        batch(&mut d, 0, &all, &vec![0; 5000]);
        d.commit();
        let full = d.stats().memory_bytes;
        batch(&mut d, 11, &[Some("last")], &[11]);
        d.commit();
        assert_eq!(d.stats().keys, 1);
        assert_eq!(d.expires.len(), 1);
        assert!(
            d.memory_bytes() < full / 10,
            "{} of {full}",
            d.memory_bytes()
        );
    }
}
