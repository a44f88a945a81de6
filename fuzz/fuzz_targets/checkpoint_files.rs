//! The checkpoint directory's files (`metadata`, `offsets/N`, `commits/N`,
//! `sources/0/0`) as a hostile or damaged disk would hand them over: parsing
//! never panics, and what parses is written back and read the same.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_checkpoint_fs::format;

fuzz_target!(|data: &[u8]| {
    if let Ok(offsets) = format::parse_initial_offsets(data) {
        let again = format::parse_initial_offsets(&format::write_initial_offsets(&offsets));
        assert_eq!(again.as_ref(), Ok(&offsets), "sources/0/0 round trip");
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(id) = format::parse_metadata(text) {
        let again = format::parse_metadata(&format::write_metadata(&id));
        assert_eq!(again.as_ref(), Ok(&id), "metadata round trip");
    }
    if let Ok(file) = format::parse_offsets(text)
        && let Some(start) = &file.start
    {
        let written = format::write_offsets(&file.metadata, start, &file.ends);
        let again = format::parse_offsets(&written).expect("what Sluice writes, it reads");
        assert_eq!(again.metadata, file.metadata, "offsets metadata round trip");
        assert_eq!(again.ends, file.ends, "offsets end round trip");
        assert_eq!(again.start, file.start, "offsets start round trip");
    }
    if let Ok(watermark) = format::parse_commit(text) {
        let again = format::parse_commit(&format::write_commit(watermark));
        assert_eq!(again, Ok(watermark), "commit round trip");
    }
});
