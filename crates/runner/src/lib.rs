//! The library half of the `sluice` binary: its configuration, read from TOML
//! and checked section by section into the settings the binary wires up. It
//! is a library so that the configuration fuzz target and the tests link the
//! same parser the binary runs.

pub mod config;
