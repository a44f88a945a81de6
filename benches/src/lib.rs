//! Criterion benchmarks of Sluice's hot paths, run with `cargo bench -p sluice-benches`.
//! The end-to-end throughput benchmark against real Kafka lives in `cargo xtask bench`.
