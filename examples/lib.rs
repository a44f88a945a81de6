//! Runnable examples of Sluice (`cargo run -p sluice-examples --example <name>`):
//!
//! - `count_per_key`: a pipeline built from Sluice's crates with a batch processor
//!   of its own, for library users.
//! - `demo_producer`: keeps producing sample events for `cargo xtask demo`.
