//! The micro-batch engine of Sluice: triggers, planning, the write-ahead of each
//! batch plan, processing, commit and progress reporting.
//!
//! It drives batches through the traits of `sluice-offsets` and never names a
//! concrete source, store or sink.
