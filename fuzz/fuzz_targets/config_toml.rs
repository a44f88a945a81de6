//! The TOML configuration as a user might mistype it: checking it never
//! panics, whatever the text. The parser is the runner library's, the one the
//! `sluice` binary runs.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_runner::config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = config::parse(text, "fuzz.toml");
});
