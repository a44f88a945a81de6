//! Spark's offset JSON (`{"topic":{"0":23}}`) and the starting-offsets option
//! that embeds it: parsing never panics, and what parses is written back and
//! read the same.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_core::{
    offsets_from_json, offsets_to_json, parse_starting_offsets, values_from_json, values_to_json,
};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(offsets) = offsets_from_json(text) {
        let again = offsets_from_json(&offsets_to_json(&offsets));
        assert_eq!(again.as_ref().ok(), Some(&offsets), "offsets round trip");
    }
    if let Ok(values) = values_from_json(text) {
        let again = values_from_json(&values_to_json(values.iter().map(|(tp, v)| (tp, *v))));
        assert_eq!(again.as_ref().ok(), Some(&values), "values round trip");
    }
    let _ = parse_starting_offsets(text);
});
