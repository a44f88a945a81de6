//! The size of a fetch per partition, learned from the record batches the
//! partitions deliver.
//!
//! A fetch asks each partition for `max.partition.fetch.bytes`, and the broker
//! sends only the first partition of a response a record batch larger than that
//! whole: the others get the batch cut short, which librdkafka cannot use. It
//! then doubles that partition's size and asks again, and meanwhile the cut
//! partitions fill every response. With 1,024 partitions of 170 KiB record
//! batches (librdkafka's producers write up to 1,000,000 bytes) and 16 KiB per
//! partition, the raw consumer itself read the topic in 12.6 s instead of 1.9.
//! So a small size suits the Java producer's 16 KiB record batches, which a
//! larger one brings many of at a time, more than a partition's share of the
//! read memory; and once partitions deliver record batches larger than the
//! size, the reader makes its consumer again with a size that holds them.

use super::*;

/// A partition's run of messages, from its queue found empty to found empty
/// again, that is larger than this many fetch sizes was fetched with a size
/// librdkafka had to double: a run holds what one fetch brought, and at most a
/// little of the next one.
const RUN_OF_FETCHES: usize = 4;

/// How many partitions must show record batches larger than the fetch size
/// before the consumer is made again with a larger one (all of them, if
/// fewer).
const PARTITIONS_SHOWING: usize = 4;

/// The largest fetch size learned: librdkafka's default, and the producers'
/// default largest record batch.
const MAX_LEARNED_FETCH_BYTES: usize = 1024 * 1024;

/// What the reader learned of the record batches.
#[derive(Debug, Default)]
pub(crate) struct Sizing {
    /// The fetch size learned, once learned.
    pub(crate) learned: Option<usize>,
    /// Partitions whose runs showed record batches larger than the fetch size,
    /// and the largest such run.
    showing: HashSet<Key>,
    largest: usize,
}

impl Sizing {
    /// Notes `part`'s run of `bytes` when its queue was found empty.
    pub(crate) fn run_ended(&mut self, part: &Part, bytes: usize, fetch_bytes: usize) {
        if bytes > RUN_OF_FETCHES * fetch_bytes {
            self.showing.insert(part.key());
            self.largest = self.largest.max(bytes);
        }
    }

    /// The larger fetch size to make the consumer again with, when enough
    /// partitions showed they need it.
    fn due(&self, partitions: usize, fetch_bytes: usize) -> Option<usize> {
        if self.showing.len() < PARTITIONS_SHOWING.min(partitions.max(1)) {
            return None;
        }
        let bytes = self
            .largest
            .next_power_of_two()
            .min(MAX_LEARNED_FETCH_BYTES);
        (bytes > fetch_bytes).then_some(bytes)
    }
}

impl ReaderState {
    /// The fetch size per partition in force.
    pub(super) fn fetch_bytes(&self, partitions: usize) -> usize {
        self.sizing
            .learned
            .unwrap_or_else(|| partition_fetch_bytes(&self.client, partitions))
    }

    /// Makes the consumer again with a larger fetch size when the record
    /// batches call for one, carrying on with the read in progress from where
    /// each of its partitions stands. What partitions had read ahead is fetched
    /// again.
    pub(super) fn resize_fetches(&mut self) {
        if self
            .client
            .config
            .client_options
            .contains_key("max.partition.fetch.bytes")
        {
            return;
        }
        let fetch_bytes = self.fetch_bytes(self.parts.len());
        let Some(bytes) = self.sizing.due(self.parts.len(), fetch_bytes) else {
            return;
        };
        tracing::info!(
            partitions = self.sizing.showing.len(),
            largest_run = self.sizing.largest,
            from = fetch_bytes,
            to = bytes,
            "partitions deliver record batches larger than a fetch asks of them: \
             fetching {bytes} bytes per partition from now on"
        );
        self.sizing = Sizing {
            learned: Some(bytes),
            ..Sizing::default()
        };
        self.shared
            .learned_fetch_bytes
            .store(bytes as u64, Ordering::Relaxed);
        // Where the read in progress stands, to go on from there.
        let carried = self.read.take().map(|read| {
            let ranges: Vec<OffsetRange> = read
                .ranges
                .iter()
                .map(|range| {
                    let part = &self.parts[range.part];
                    let from = if range.done { range.until } else { part.start };
                    OffsetRange {
                        topic_partition: part.topic_partition(),
                        from: offset(from),
                        until: offset(range.until.max(from)),
                    }
                })
                .collect();
            (ranges, read)
        });
        self.tally.consumer_replaced(&mut self.parts);
        self.forget_all();
        // The assigner finishes the changes asked of the old consumer before it
        // stops; what it reports of them concerns nothing known any more.
        self.assigner = None;
        self.consumer = None;
        lock(&self.shared.changed).clear();
        self.stopping.clear();
        self.poking = false;
        self.poke = None;
        if let Some((ranges, read)) = carried {
            self.begin_carrying(ranges, read);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_larger_fetch_is_due_once_enough_partitions_showed_larger_record_batches() {
        let fetch = 16 * 1024;
        let mut sizing = Sizing::default();
        let part = |p| Part::new(Arc::from("t"), p);
        // A run of four fetches could be a fetch and what followed it.
        for p in 0..8 {
            sizing.run_ended(&part(p), 4 * fetch, fetch);
        }
        assert_eq!(sizing.due(1024, fetch), None);
        // The same partition counts once.
        for _ in 0..4 {
            sizing.run_ended(&part(0), 170 * 1024, fetch);
        }
        assert_eq!(sizing.due(1024, fetch), None);
        for p in 1..4 {
            sizing.run_ended(&part(p), 100 * 1024, fetch);
        }
        // Room for the largest run, as librdkafka would have doubled to.
        assert_eq!(sizing.due(1024, fetch), Some(256 * 1024));
        // With fewer partitions than that, all of them.
        let mut two = Sizing::default();
        two.run_ended(&part(0), 100 * 1024, fetch);
        assert_eq!(two.due(2, fetch), None);
        two.run_ended(&part(1), 100 * 1024, fetch);
        assert_eq!(two.due(2, fetch), Some(128 * 1024));
        // Never past librdkafka's default, and never smaller than in force.
        sizing.run_ended(&part(9), 5 * 1024 * 1024, fetch);
        assert_eq!(sizing.due(1024, fetch), Some(1024 * 1024));
        assert_eq!(sizing.due(1024, 1024 * 1024), None);
    }
}
