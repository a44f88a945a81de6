//! A block's state columns in chunks of rows. A batch that changes some of a
//! block's groups rebuilds only the chunks they are in, and one that adds
//! groups appends them, so that a batch costs what it touched, not the whole
//! block: a window of millions of keys, or the one block of an aggregation
//! without windows, is not copied at every batch.

use arrow::array::{Array, ArrayRef};

use crate::StateError;
use crate::error::internal;

/// The most rows a chunk is grown to by appending; a batch that adds more
/// makes chunks of their own.
const CHUNK_ROWS: usize = 1 << 16;

/// State columns of `len` rows, in chunks.
#[derive(Clone, Debug, Default)]
pub(crate) struct Chunks {
    /// Each chunk's columns, the same columns in every chunk.
    chunks: Vec<Vec<ArrayRef>>,
    /// The rows of each chunk. Kept apart from the columns, which an
    /// aggregation without aggregates (a dedupe) does not have.
    lens: Vec<usize>,
}

impl Chunks {
    /// `columns` of `rows` rows, as chunks of at most [`CHUNK_ROWS`] rows each.
    pub(crate) fn new(columns: Vec<ArrayRef>, rows: usize) -> Chunks {
        let mut chunks = Chunks::default();
        chunks.append(columns, rows);
        chunks
    }

    /// How many rows.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Each column whole.
    #[cfg(test)]
    pub(crate) fn columns(&self) -> Result<Vec<ArrayRef>, StateError> {
        let width = self.chunks.first().map_or(0, Vec::len);
        (0..width)
            .map(|c| {
                let parts: Vec<&dyn Array> = self.chunks.iter().map(|k| k[c].as_ref()).collect();
                if parts.len() == 1 {
                    return Ok(self.chunks[0][c].clone());
                }
                arrow::compute::concat(&parts).map_err(|e| internal("the state's columns", e))
            })
            .collect()
    }

    /// Each chunk's rows and columns, in order.
    pub(crate) fn parts(&self) -> impl Iterator<Item = (usize, &[ArrayRef])> {
        self.lens
            .iter()
            .copied()
            .zip(self.chunks.iter().map(Vec::as_slice))
    }

    /// Where row `row` is: its chunk and its row in that chunk.
    fn locate(&self, row: usize, starts: &[usize]) -> (usize, usize) {
        let chunk = starts.partition_point(|&start| start <= row) - 1;
        (chunk, row - starts[chunk])
    }

    fn starts(&self) -> Vec<usize> {
        let mut at = 0;
        self.lens
            .iter()
            .map(|len| {
                let start = at;
                at += len;
                start
            })
            .collect()
    }

    /// The rows `rows`, in that order, of each column.
    pub(crate) fn take(&self, rows: &[u32]) -> Result<Vec<ArrayRef>, StateError> {
        let starts = self.starts();
        let picks: Vec<(usize, usize)> = rows
            .iter()
            .map(|&row| self.locate(row as usize, &starts))
            .collect();
        self.pick(&picks, &[])
    }

    /// Each column of `picks`, a pair of a chunk (or, past the chunks, a
    /// column set of `extra`) and a row in it.
    fn pick(
        &self,
        picks: &[(usize, usize)],
        extra: &[&[ArrayRef]],
    ) -> Result<Vec<ArrayRef>, StateError> {
        let width = self.chunks.first().map_or(0, Vec::len);
        (0..width)
            .map(|c| {
                let sources: Vec<&dyn Array> = self
                    .chunks
                    .iter()
                    .map(|k| k[c].as_ref())
                    .chain(extra.iter().map(|columns| columns[c].as_ref()))
                    .collect();
                arrow::compute::interleave(&sources, picks)
                    .map_err(|e| internal("taking groups", e))
            })
            .collect()
    }

    /// Appends `rows` rows of `columns`: into the last chunk while it stays
    /// within [`CHUNK_ROWS`], else as chunks of their own.
    fn append(&mut self, columns: Vec<ArrayRef>, rows: usize) {
        if rows == 0 {
            return;
        }
        if let (Some(last), Some(len)) = (self.chunks.last_mut(), self.lens.last_mut())
            && *len + rows <= CHUNK_ROWS
        {
            let grown: Option<Vec<ArrayRef>> = last
                .iter()
                .zip(&columns)
                .map(|(old, new)| arrow::compute::concat(&[old.as_ref(), new.as_ref()]).ok())
                .collect();
            if let Some(grown) = grown {
                *last = grown;
                *len += rows;
                return;
            }
        }
        if rows <= CHUNK_ROWS {
            self.chunks.push(columns);
            self.lens.push(rows);
            return;
        }
        // Copied, not sliced: a slice would keep, and count, the whole buffer.
        let mut at = 0;
        while at < rows {
            let take = (rows - at).min(CHUNK_ROWS);
            let range = arrow::array::UInt32Array::from_iter_values(at as u32..(at + take) as u32);
            let chunk = columns
                .iter()
                .map(|c| {
                    arrow::compute::take(c, &range, None).unwrap_or_else(|_| c.slice(at, take))
                })
                .collect();
            self.chunks.push(chunk);
            self.lens.push(take);
            at += take;
        }
    }

    /// The columns after a batch: each row `g` of `replaced`'s pairs `(g, l)`
    /// replaced by row `l` of `merged`, and the rows `appended` of `merged`
    /// after the last. Chunks without a replaced row are shared. Also the
    /// bytes of the chunks it made.
    pub(crate) fn after(
        &self,
        replaced: &[(u32, u32)],
        merged: &[ArrayRef],
        appended: &[u32],
    ) -> Result<(Chunks, usize), StateError> {
        let mut out = self.clone();
        let mut made = 0;
        let mut replaced = replaced.to_vec();
        replaced.sort_unstable();
        let starts = self.starts();
        let mut at = 0;
        while at < replaced.len() {
            let (k, _) = self.locate(replaced[at].0 as usize, &starts);
            let end = starts[k] + self.lens[k];
            let here = replaced[at..]
                .iter()
                .take_while(|(g, _)| (*g as usize) < end)
                .count();
            let mut picks: Vec<(usize, usize)> = (0..self.lens[k]).map(|r| (0, r)).collect();
            for (g, l) in &replaced[at..at + here] {
                picks[*g as usize - starts[k]] = (1, *l as usize);
            }
            at += here;
            let chunk: Vec<ArrayRef> = self.chunks[k]
                .iter()
                .zip(merged)
                .map(|(old, new)| {
                    arrow::compute::interleave(&[old.as_ref(), new.as_ref()], &picks)
                        .map_err(|e| internal("the state after a batch", e))
                })
                .collect::<Result<_, _>>()?;
            made += chunk
                .iter()
                .map(|a| a.get_array_memory_size())
                .sum::<usize>();
            out.chunks[k] = chunk;
        }
        if !appended.is_empty() {
            let indices = arrow::array::UInt32Array::from(appended.to_vec());
            let columns: Vec<ArrayRef> = merged
                .iter()
                .map(|c| {
                    arrow::compute::take(c, &indices, None)
                        .map_err(|e| internal("the state after a batch", e))
                })
                .collect::<Result<_, _>>()?;
            made += columns
                .iter()
                .map(|a| a.get_array_memory_size())
                .sum::<usize>();
            out.append(columns, appended.len());
        }
        Ok((out, made))
    }

    /// The bytes it holds.
    pub(crate) fn memory_size(&self) -> usize {
        self.chunks
            .iter()
            .flatten()
            .map(|a| a.get_array_memory_size())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{AsArray, Int64Array};
    use arrow::datatypes::Int64Type;

    use super::*;

    fn values(chunks: &Chunks) -> Vec<i64> {
        let columns = chunks.columns().unwrap();
        columns[0].as_primitive::<Int64Type>().values().to_vec()
    }

    fn column(values: impl IntoIterator<Item = i64>) -> Vec<ArrayRef> {
        vec![Arc::new(Int64Array::from_iter_values(values))]
    }

    #[test]
    fn a_batch_rebuilds_the_chunks_it_changed_and_appends_what_it_added() {
        let rows = CHUNK_ROWS * 2 + 10;
        let chunks = Chunks::new(column(0..rows as i64), rows);
        assert_eq!(chunks.len(), rows);
        assert_eq!(chunks.lens, [CHUNK_ROWS, CHUNK_ROWS, 10]);
        // Row 5 and the last row change; two rows come.
        let replaced = [(rows as u32 - 1, 1), (5, 0)];
        let merged = column([-5, -1, 100, 200]);
        let (after, made) = chunks.after(&replaced, &merged, &[2, 3]).unwrap();
        let got = values(&after);
        assert_eq!(got.len(), rows + 2);
        assert_eq!((got[4], got[5], got[6]), (4, -5, 6));
        assert_eq!(&got[rows - 2..], [rows as i64 - 2, -1, 100, 200]);
        // The middle chunk was not touched: shared, not copied.
        assert!(Arc::ptr_eq(&after.chunks[1][0], &chunks.chunks[1][0]));
        // One full chunk rebuilt (row 5's), and the small last one with the two new rows.
        assert!(made <= CHUNK_ROWS * 8 + 4096, "{made}");
        // Taking rows across chunks, in any order.
        let taken = after
            .take(&[rows as u32 + 1, 5, CHUNK_ROWS as u32])
            .unwrap();
        let taken = taken[0].as_primitive::<Int64Type>().values().to_vec();
        assert_eq!(taken, [200, -5, CHUNK_ROWS as i64]);
        // The one before is as it was.
        assert_eq!(values(&chunks), (0..rows as i64).collect::<Vec<_>>());
    }

    #[test]
    fn without_columns_rows_are_still_counted() {
        let chunks = Chunks::new(Vec::new(), 3);
        let (after, _) = chunks.after(&[], &[], &[0, 1]).unwrap();
        assert_eq!(after.len(), 5);
        assert!(after.columns().unwrap().is_empty());
    }
}
