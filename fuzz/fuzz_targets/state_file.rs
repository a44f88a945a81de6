//! A state file (Arrow IPC) as a damaged disk would hand it over: decoding
//! never panics, and a table it accepts has the expected columns and valid
//! buffers. The expected columns are those of the windowed aggregation's
//! state in the seed, a real file Sluice wrote.

#![no_main]

use std::io::Cursor;
use std::sync::LazyLock;

use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::StreamReader;
use libfuzzer_sys::fuzz_target;

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    let seed: &[u8] = include_bytes!("../seeds/state_file/window-state.delta");
    StreamReader::try_new(Cursor::new(seed), None)
        .expect("the seed is a state file")
        .schema()
});

fuzz_target!(init: {
    // libfuzzer-sys aborts in its panic hook, before `decode` can catch the
    // panics of Arrow's reader that it turns into errors; a panic nobody
    // catches still aborts, in the catch around this target.
    std::panic::set_hook(Box::new(|_| {}));
}, |data: &[u8]| {
    if let Ok(table) = sluice_state::decode(data, &SCHEMA, "fuzz input") {
        assert_eq!(table.schema().fields().len(), SCHEMA.fields().len());
        table
            .columns()
            .iter()
            .for_each(|c| c.to_data().validate_full().expect("decoded buffers are valid"));
    }
});
