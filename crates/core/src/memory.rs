//! Batches planned to a memory budget. A stateful query's batch holds its
//! groups until it ends, so a batch of every record available can need more
//! memory than the machine has. Its plan is written before it runs, so the
//! budget cannot shrink the batch that measured too much; it sizes the batches
//! after it, from the bytes each input record cost the batches before them.

use std::num::NonZeroU64;

/// The share of the budget a batch's own structures are planned to, as the
/// stateful operators count them (its groups, their states, its output and
/// delta). The process needs two to three times that beside its size at
/// rest, for what they do not count: the records being read and decoded, the
/// plan above the aggregate, the allocator's own pages. Swept on a group per
/// event (5,000,000 events, docs/benchmarks.md) by the budget at a fixed
/// share: throughput was flat from a sixteenth of 256 MiB to three sixteenths
/// (3.0-3.4 s) while peak RSS rose with the batch (104-107 to 151 MiB), and a
/// thirty-second was a quarter slower; a sixteenth is the knee.
pub const BATCH_SHARE: f64 = 1.0 / 16.0;

/// The share of the budget the state and a batch are planned within: a
/// state past it leaves a batch only the fewest records, so that the state
/// can still grow into the rest of the budget before the query stops.
pub const PLANNED_SHARE: f64 = 0.5;

/// The bytes an input record is assumed to cost before a batch measured it:
/// a group of its own with a long key, and the copies a batch makes of it.
pub const ASSUMED_BYTES_PER_RECORD: f64 = 1024.0;

/// The fewest records a plan under a budget reads, so that a query whose state
/// alone fills the planned share still moves on: its windows close and free
/// the state, or it grows into the budget itself and stops, named.
pub const MIN_RECORDS: u64 = 1000;

/// A measured cost per record falls towards a lower one at this rate a
/// batch, while a higher one is taken at once: a batch of old keys costs
/// little, and the next one may be all new keys.
const DECAY: f64 = 0.75;

/// The budget, and what the batches measured against it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryBudget {
    budget_bytes: u64,
    bytes_per_record: Option<f64>,
}

/// Why a batch has the size it has, for its progress report.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchSizing {
    /// The budget, in bytes.
    pub budget_bytes: u64,
    /// The state held when the batch was planned.
    pub state_bytes: u64,
    /// The cost of an input record the plan assumed.
    pub bytes_per_record: f64,
    /// Whether a batch measured it, or it is [`ASSUMED_BYTES_PER_RECORD`].
    pub measured: bool,
    /// The most records the budget lets the batch read.
    pub max_records: NonZeroU64,
}

impl MemoryBudget {
    /// A budget of `budget_bytes`, nothing measured yet.
    pub fn new(budget_bytes: NonZeroU64) -> MemoryBudget {
        MemoryBudget {
            budget_bytes: budget_bytes.get(),
            bytes_per_record: None,
        }
    }

    /// Takes what a batch of `records` input records measured: the most bytes
    /// its own structures held beside the state. A batch of fewer than
    /// [`MIN_RECORDS`] records measures too little to go by.
    pub fn observe(&mut self, records: u64, batch_bytes: u64) {
        if records < MIN_RECORDS {
            return;
        }
        let measured = batch_bytes as f64 / records as f64;
        self.bytes_per_record = Some(match self.bytes_per_record {
            Some(before) => measured.max(before * DECAY),
            None => measured,
        });
    }

    /// The size of the next batch with `state_bytes` of state held.
    pub fn plan(&self, state_bytes: u64) -> BatchSizing {
        let budget = self.budget_bytes as f64;
        let room = (budget * PLANNED_SHARE - state_bytes as f64).clamp(0.0, budget * BATCH_SHARE);
        let bytes_per_record = self
            .bytes_per_record
            .unwrap_or(ASSUMED_BYTES_PER_RECORD)
            .max(1.0);
        let records = (room / bytes_per_record) as u64;
        BatchSizing {
            budget_bytes: self.budget_bytes,
            state_bytes,
            bytes_per_record,
            measured: self.bytes_per_record.is_some(),
            max_records: NonZeroU64::new(records.max(MIN_RECORDS)).unwrap_or(NonZeroU64::MIN),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn budget(mib: u64) -> MemoryBudget {
        MemoryBudget::new(NonZeroU64::new(mib * MIB).unwrap())
    }

    #[test]
    fn a_first_batch_assumes_a_kibibyte_a_record_in_a_sixteenth_of_the_budget() {
        let sizing = budget(256).plan(0);
        assert_eq!(sizing.max_records.get(), 16 * 1024);
        assert!(!sizing.measured);
    }

    #[test]
    fn later_batches_fill_their_share_at_the_measured_cost_while_the_state_leaves_room() {
        let mut b = budget(256);
        // 100 bytes a record measured.
        b.observe(100_000, 10_000_000);
        let sizing = b.plan(28 * MIB);
        assert!(sizing.measured);
        assert_eq!(sizing.max_records.get(), (16 * MIB) / 100);
        // A state near half the budget leaves the batch what is left of it.
        assert_eq!(b.plan(118 * MIB).max_records.get(), (10 * MIB) / 100);
        // A batch of old keys costs less; the cost falls slowly towards it.
        b.observe(1_000_000, 10_000_000);
        assert_eq!(b.plan(0).bytes_per_record, 75.0);
        // A dearer one is taken at once.
        b.observe(10_000, 5_000_000);
        assert_eq!(b.plan(0).bytes_per_record, 500.0);
        // Too few records to go by.
        b.observe(10, 1_000_000_000);
        assert_eq!(b.plan(0).bytes_per_record, 500.0);
    }

    #[test]
    fn a_state_over_its_share_still_reads_the_fewest_records() {
        let mut b = budget(64);
        b.observe(10_000, 1_000_000);
        assert_eq!(b.plan(33 * MIB).max_records.get(), MIN_RECORDS);
    }
}
