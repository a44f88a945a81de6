//! Read amplification: what librdkafka fetched for each partition, from the
//! reading consumer's statistics, against what the reading thread took.
//!
//! librdkafka counts, per partition, the bytes of keys and values of every
//! message it queued (`rxbytes`): messages a pause dropped and fetched again
//! count each time. The reading thread counts the same bytes of the records it
//! kept: handed to reads or held in a partition's read-ahead, but for what a
//! buffer dropped unread (for a new plan, or with the consumer). Counted only
//! once handed to reads, what the read-ahead holds looked like fetches in
//! vain: a 3-second read whose read-ahead held 100 MB at the last statistics
//! showed 2.7 where records were fetched about 1.3 times. Both are taken at the
//! moment the statistics arrive, on the reading thread, so that the two sides
//! of each interval match.
//! Records of a record batch before the offset a fetch started at are skipped
//! by librdkafka uncounted, so the figure is a floor of what the broker sent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use sluice_core::{ReadAmplification, TopicPartition};

use super::{Key, Part, lock};

/// The reading consumer's `statistics.interval.ms` unless configured: the
/// interval of the figures. Parsing the statistics of 1,024 partitions once a
/// second costs about a millisecond.
pub(crate) const STATISTICS_INTERVAL_MS: &str = "1000";

/// The partitions reported as the worst.
const WORST: usize = 3;

/// What the statistics hold that the figures need; the rest is skipped unparsed.
#[derive(Deserialize, Default)]
pub(crate) struct Statistics {
    #[serde(default)]
    rxmsgs: u64,
    #[serde(default)]
    topics: HashMap<String, TopicStatistics>,
}

#[derive(Deserialize)]
struct TopicStatistics {
    #[serde(default)]
    partitions: HashMap<String, PartitionStatistics>,
}

#[derive(Deserialize)]
struct PartitionStatistics {
    partition: i32,
    #[serde(default)]
    rxbytes: u64,
}

/// The latest statistics, put by librdkafka's callback and taken by the reading
/// thread (both run on that thread, while it serves the consumer's queue).
#[derive(Default)]
pub(crate) struct Latest {
    slot: Mutex<Option<Statistics>>,
    /// Messages fetched in all, as of the latest statistics.
    pub(crate) messages: AtomicU64,
}

impl Latest {
    /// Keeps `raw` statistics; unparsable ones are logged and dropped.
    pub(crate) fn put(&self, raw: &[u8]) {
        match serde_json::from_slice::<Statistics>(raw) {
            Ok(statistics) => {
                self.messages.store(statistics.rxmsgs, Ordering::Relaxed);
                *lock(&self.slot) = Some(statistics);
            }
            Err(e) => tracing::debug!(error = %e, "librdkafka's statistics did not parse"),
        }
    }

    fn take(&self) -> Option<Statistics> {
        lock(&self.slot).take()
    }
}

/// Each partition's bytes fetched and read, over the source's life.
#[derive(Default)]
pub(crate) struct Tally {
    partitions: HashMap<Key, PartitionTally>,
    /// Read since the figures were last made.
    unreported_read: u64,
    /// Fetched by a consumer that is gone, since the figures were last made.
    unreported_fetched: u64,
}

#[derive(Default)]
struct PartitionTally {
    /// librdkafka's count at the last statistics.
    rxbytes: u64,
    fetched: u64,
    read: u64,
}

impl Tally {
    /// Counts as fetched what `parts` took from a consumer about to be replaced
    /// since its last statistics, which will not come, and starts librdkafka's
    /// counts from nothing for the next consumer.
    pub(crate) fn consumer_replaced(&mut self, parts: &mut [Part]) {
        for part in parts.iter_mut() {
            let fetched = part.taken - part.taken_counted;
            part.taken_counted = part.taken;
            self.partitions.entry(part.key()).or_default().fetched += fetched;
            self.unreported_fetched += fetched;
        }
        for tally in self.partitions.values_mut() {
            tally.rxbytes = 0;
        }
    }

    /// Counts what `parts` kept since they were last counted; called before
    /// partitions are forgotten too, once their buffers are discarded.
    pub(crate) fn settle(&mut self, parts: &mut [Part]) {
        for part in parts {
            let kept = part.taken - part.discarded;
            let read = kept - part.kept_counted;
            part.kept_counted = kept;
            self.partitions.entry(part.key()).or_default().read += read;
            self.unreported_read += read;
        }
    }

    /// Takes the latest statistics, if new ones came, and the bytes `parts` read
    /// since the last; returns the figures then.
    pub(crate) fn update(
        &mut self,
        latest: &Latest,
        parts: &mut [Part],
    ) -> Option<ReadAmplification> {
        let statistics = latest.take()?;
        let mut recent_fetched = 0;
        for (topic, stats) in statistics.topics {
            let topic: Arc<str> = Arc::from(topic);
            // librdkafka's unassigned partition is -1.
            for p in stats.partitions.values().filter(|p| p.partition >= 0) {
                let tally = self
                    .partitions
                    .entry((topic.clone(), p.partition))
                    .or_default();
                // A count lower than the last belongs to a partition made anew.
                let fetched = p.rxbytes.checked_sub(tally.rxbytes).unwrap_or(p.rxbytes);
                tally.rxbytes = p.rxbytes;
                tally.fetched += fetched;
                recent_fetched += fetched;
            }
        }
        self.settle(parts);
        for part in parts.iter_mut() {
            part.taken_counted = part.taken;
        }
        let recent_fetched = recent_fetched + std::mem::take(&mut self.unreported_fetched);
        let recent_read = std::mem::take(&mut self.unreported_read);
        let (mut fetched_bytes, mut read_bytes) = (0, 0);
        let mut worst: Vec<(TopicPartition, f64)> = Vec::new();
        for ((topic, partition), tally) in &self.partitions {
            fetched_bytes += tally.fetched;
            read_bytes += tally.read;
            if tally.read > 0 {
                let ratio = tally.fetched as f64 / tally.read as f64;
                worst.push((TopicPartition::new(topic.as_ref(), *partition), ratio));
            }
        }
        worst.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        worst.truncate(WORST);
        Some(ReadAmplification {
            fetched_bytes,
            read_bytes,
            recent_fetched_bytes: recent_fetched,
            recent_read_bytes: recent_read,
            worst_partitions: worst,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn statistics(rxbytes: &[(i32, u64)]) -> Vec<u8> {
        let partitions: serde_json::Map<String, serde_json::Value> = rxbytes
            .iter()
            .map(|(p, b)| {
                (
                    p.to_string(),
                    serde_json::json!({"partition": p, "rxbytes": b, "fetchq_cnt": 3}),
                )
            })
            .collect();
        serde_json::json!({
            "name": "rdkafka#consumer-1",
            "rxmsgs": 10,
            "topics": {"t": {"topic": "t", "partitions": partitions}}
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn fetched_over_read_per_interval_and_per_partition() {
        let latest = Latest::default();
        let mut tally = Tally::default();
        let mut parts = vec![Part::new(Arc::from("t"), 0), Part::new(Arc::from("t"), 1)];
        assert!(tally.update(&latest, &mut parts).is_none(), "nothing new");

        parts[0].taken = 100;
        parts[1].taken = 100;
        latest.put(&statistics(&[(-1, 0), (0, 100), (1, 300)]));
        assert_eq!(latest.messages.load(Ordering::Relaxed), 10);
        let first = tally.update(&latest, &mut parts).unwrap();
        assert_eq!((first.fetched_bytes, first.read_bytes), (400, 200));
        assert_eq!(first.recent(), 2.0);
        assert_eq!(
            first.worst_partitions[0],
            (TopicPartition::new("t", 1), 3.0)
        );

        // The next interval counts only what came since.
        // What a partition took and then dropped unread is not read.
        parts[0].taken = 250;
        parts[0].discarded = 50;
        latest.put(&statistics(&[(0, 200), (1, 300)]));
        let second = tally.update(&latest, &mut parts).unwrap();
        assert_eq!(
            (second.recent_fetched_bytes, second.recent_read_bytes),
            (100, 100)
        );
        assert_eq!(second.recent(), 1.0);
        assert_eq!(second.total(), 500.0 / 300.0);

        // A partition made anew starts counting from zero.
        latest.put(&statistics(&[(0, 50), (1, 300)]));
        let third = tally.update(&latest, &mut parts).unwrap();
        assert_eq!(third.recent_fetched_bytes, 50);
    }
}
