//! An aggregation as the executor's checkpoint sees it: a stateful operator
//! whose versions are Arrow IPC files, one per state partition.

use arrow::array::RecordBatch;
use sluice_core::{StateFile, StateOperatorStats, StatefulOperator};

use crate::{Aggregation, Encoder, StateError, decode, encode};

impl<E: From<StateError>> StatefulOperator<E> for Aggregation {
    fn name(&self) -> &str {
        self.operator_name()
    }

    fn partitions(&self) -> u32 {
        Aggregation::partitions(self)
    }

    fn delta(&self) -> Result<Vec<Vec<u8>>, E> {
        match self.pending_delta() {
            Some(delta) => Ok(self.encode_by_partition(delta)?),
            None => Ok(Vec::new()),
        }
    }

    fn snapshot(&self) -> Result<Vec<Vec<u8>>, E> {
        let schema = self.file_schema();
        let mut files = (0..Aggregation::partitions(self))
            .map(|_| Encoder::new(&schema))
            .collect::<Result<Vec<_>, _>>()?;
        self.for_each_snapshot_table(|table| {
            let parts = self.split_by_partition(&table, Aggregation::partitions(self))?;
            for (file, part) in files.iter_mut().zip(&parts) {
                file.write(part)?;
            }
            Ok(())
        })?;
        Ok(files
            .into_iter()
            .map(Encoder::finish)
            .collect::<Result<_, _>>()?)
    }

    fn restore(&mut self, files: &[StateFile]) -> Result<(), E> {
        if files.is_empty() {
            self.reset();
            return Ok(());
        }
        let schema = self.file_schema();
        let tables = files
            .iter()
            .map(|f| decode(&f.bytes, &schema, &f.location))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Aggregation::restore(self, &tables)?)
    }

    fn commit(&mut self) {
        Aggregation::commit(self);
    }

    fn waits_for_watermark(&self) -> bool {
        self.evicts() && Aggregation::stats(self).rows_total > 0
    }

    fn stats(&self) -> StateOperatorStats {
        let stats = Aggregation::stats(self);
        StateOperatorStats {
            name: self.operator_name().to_owned(),
            rows_total: stats.rows_total,
            rows_updated: stats.rows_updated,
            rows_removed: stats.rows_removed,
            rows_dropped_by_watermark: stats.rows_dropped_by_watermark,
            memory_used_bytes: stats.memory_used_bytes,
            batch_memory_bytes: stats.batch_memory_bytes,
        }
    }
}

impl Aggregation {
    /// A state file's table as one encoded file per partition; a partition
    /// that the table has no row of gets a file without rows, so that every
    /// partition has every version.
    fn encode_by_partition(&self, table: &RecordBatch) -> Result<Vec<Vec<u8>>, StateError> {
        self.split_by_partition(table, Aggregation::partitions(self))?
            .iter()
            .map(encode)
            .collect()
    }
}
