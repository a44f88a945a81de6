//! The TOML configuration as a user might mistype it: checking it never
//! panics, whatever the text. The runner's own parser is compiled in, as the
//! runner is a binary with no library to link.

#![no_main]
#![allow(dead_code)]

use libfuzzer_sys::fuzz_target;

#[path = "../../crates/runner/src/config.rs"]
mod config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = config::parse(text, "fuzz.toml");
});
