//! Runs of JSON values, as producers and damaged topics hand them over: the
//! one-pass decoder reads them into the same rows and the same bad records as
//! arrow's reader alone, for a table of every column type it reads and for one
//! with a `NOT NULL` column. Values are separated by a 0xFF byte, which valid
//! JSON never holds.

#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use sluice_core::{Offset, Record, RecordChunk, TimestampType};
use sluice_sql::{Decoder, Format, parse_ddl};

static DECODERS: LazyLock<Vec<(Decoder, Decoder)>> = LazyLock::new(|| {
    [
        "s STRING, i BIGINT, n INT, t TINYINT, f DOUBLE, r FLOAT, b BOOLEAN, ts TIMESTAMP, \
         nt TIMESTAMP_NTZ",
        "id STRING NOT NULL, k SMALLINT, at TIMESTAMP",
    ]
    .into_iter()
    .map(|ddl| {
        let schema = parse_ddl(ddl).expect("a valid schema");
        (
            Decoder::new(Format::Json(schema.clone()), false),
            Decoder::new(Format::Json(schema), false).arrow_json_only(),
        )
    })
    .collect()
});

fuzz_target!(|data: &[u8]| {
    let mut chunk = RecordChunk::default();
    for (i, value) in data.split(|b| *b == 0xFF).enumerate() {
        chunk.push_record(&Record {
            topic: Arc::from("events"),
            partition: 0,
            offset: Offset::new(i as i64).expect("a small offset"),
            timestamp_ms: Some(1_700_000_000_000),
            timestamp_type: TimestampType::CreateTime,
            key: None,
            value: Some(value.to_vec()),
            headers: Vec::new(),
        });
    }
    for (one_pass, arrow) in DECODERS.iter() {
        let (fast, slow) = (one_pass.decode(&chunk), arrow.decode(&chunk));
        let (fast, slow) = (fast.expect("decodes"), slow.expect("decodes"));
        assert_eq!(fast.batch, slow.batch);
        let reasons = |d: &sluice_sql::Decoded| {
            d.bad.iter().map(|b| (b.index, b.reason.clone())).collect::<Vec<_>>()
        };
        assert_eq!(reasons(&fast), reasons(&slow));
    }
});
