//! An aggregation as the executor's checkpoint sees it: a stateful operator
//! whose versions are Arrow IPC files, one per state partition.

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::Int8Type;
use sluice_core::{StateFile, StateOperatorStats, StatefulOperator};

use crate::groups::{OP_REMOVE, OP_REMOVE_WINDOW, OP_WRITE};

use crate::{Aggregation, Encoder, StateError, decode};

impl<E: From<StateError>> StatefulOperator<E> for Aggregation {
    fn name(&self) -> &str {
        self.operator_name()
    }

    fn partitions(&self) -> u32 {
        Aggregation::partitions(self)
    }

    fn delta(&self) -> Result<Vec<Vec<u8>>, E> {
        Ok(self.pending_delta().map(<[_]>::to_vec).unwrap_or_default())
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
            .map(|f| {
                let table = decode(&f.bytes, &schema, &f.location)?;
                known_ops(&table).map_err(|reason| StateError::Damaged {
                    location: f.location.clone(),
                    reason,
                })?;
                Ok::<_, StateError>(table)
            })
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
            custom_metrics: Vec::new(),
        }
    }
}

/// Whether every row of a state file's table has an `op` this version writes.
fn known_ops(table: &RecordBatch) -> Result<(), String> {
    let ops = table
        .column(0)
        .as_primitive_opt::<Int8Type>()
        .ok_or("its first column is not the int8 op")?;
    match ops
        .iter()
        .enumerate()
        .find(|(_, op)| !matches!(op, Some(OP_WRITE | OP_REMOVE | OP_REMOVE_WINDOW)))
    {
        Some((row, op)) => Err(format!(
            "damaged or written by a newer Sluice: row {row} has the op {}, and this version \
             knows 0, 1 and 2",
            op.map_or("null".to_owned(), |op| op.to_string())
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int8Array, RecordBatch};

    use super::known_ops;

    fn ops(values: Vec<Option<i8>>) -> RecordBatch {
        RecordBatch::try_from_iter([("op", Arc::new(Int8Array::from(values)) as _)]).unwrap()
    }

    #[test]
    fn a_file_with_an_op_this_version_does_not_write_is_damaged() {
        assert_eq!(known_ops(&ops(vec![Some(0), Some(2), Some(1)])), Ok(()));
        let unknown = known_ops(&ops(vec![Some(0), Some(3)])).unwrap_err();
        assert!(unknown.contains("row 1 has the op 3"), "{unknown}");
        let null = known_ops(&ops(vec![None])).unwrap_err();
        assert!(null.contains("row 0 has the op null"), "{null}");
    }
}
