//! Criterion benchmarks of Sluice's hot paths, run with `cargo bench -p sluice-benches`.
//! Each group measures a baseline beside Sluice's code, so that a figure can be read
//! as a ratio on the same machine in the same run. The end-to-end throughput
//! benchmark against real Kafka belongs to `cargo xtask bench`.
//!
//! This library holds the inputs the benchmarks share.

use sluice_core::{Offset, PartitionOffsets, TopicPartition};

/// `partitions` partitions spread over topics of 100 partitions each, with
/// offsets that vary like real ones do.
pub fn sample_offsets(partitions: usize, base: i64) -> PartitionOffsets {
    (0..partitions)
        .map(|i| {
            let tp = TopicPartition::new(format!("topic-{}", i / 100), (i % 100) as i32);
            let value = base + (i as i64 * 7_919) % 1_000_003;
            (tp, Offset::new(value).unwrap_or(Offset::ZERO))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::sample_offsets;

    #[test]
    fn samples_have_the_requested_size_and_base() {
        let offsets = sample_offsets(250, 10);
        assert_eq!(offsets.len(), 250);
        assert!(offsets.values().all(|o| o.value() >= 10));
        assert_eq!(
            offsets.keys().filter(|tp| &*tp.topic == "topic-2").count(),
            50
        );
    }
}
