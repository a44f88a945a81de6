//! The SQL layer on one chunk of 1,024 records with 100-byte JSON values: records
//! as Arrow, values decoded, and a filter with a projection, each beside a
//! baseline.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice_core::{Offset, Record, RecordChunk, TimestampType};
use sluice_sql::arrow::json::ReaderBuilder;
use sluice_sql::{Decoder, Format, StreamQuery, parse_ddl};

const SCHEMA: &str = "order BIGINT, customer STRING, amount DOUBLE, note STRING";

/// A chunk as the Kafka reader fills one: 1,024 records of 100-byte JSON orders,
/// of which those numbered in `bad` are cut short.
fn orders_with_bad(bad: &[i64]) -> RecordChunk {
    let mut chunk = RecordChunk::default();
    for n in 0..1_024_i64 {
        let mut value = format!(
            r#"{{"order":{n},"customer":"c{}","amount":{}.5,"note":""#,
            n % 7,
            n * 37 % 1000
        );
        let pad = 100 - value.len() - 2;
        value.extend(std::iter::repeat_n('x', pad));
        value.push_str("\"}");
        if bad.contains(&n) {
            value.truncate(40);
        }
        chunk.push_record(&Record {
            topic: Arc::from("orders"),
            partition: (n % 8) as i32,
            offset: Offset::new(n).unwrap_or(Offset::ZERO),
            timestamp_ms: Some(1_700_000_000_000 + n),
            timestamp_type: TimestampType::CreateTime,
            key: Some(format!("k{n}").into_bytes()),
            value: Some(value.into_bytes()),
            headers: Vec::new(),
        });
    }
    chunk
}

fn orders() -> RecordChunk {
    orders_with_bad(&[])
}

fn records_as_arrow(c: &mut Criterion) {
    let chunk = orders();
    let raw = Decoder::new(Format::Raw, false);
    let mut group = c.benchmark_group("records_as_arrow_1024x100b");
    group.bench_function("spark_columns", |b| {
        b.iter(|| raw.decode(black_box(&chunk)))
    });
    // Baseline: the least any conversion does, one copy of every key and value.
    group.bench_function("baseline_copy_keys_and_values", |b| {
        b.iter(|| {
            let mut bytes = Vec::with_capacity(chunk.byte_len());
            for record in black_box(&chunk) {
                bytes.extend_from_slice(record.key().unwrap_or_default());
                bytes.extend_from_slice(record.value().unwrap_or_default());
            }
            bytes
        })
    });
    group.finish();
}

fn json_values(c: &mut Criterion) {
    let chunk = orders();
    let declared = parse_ddl(SCHEMA).unwrap_or_else(|e| panic!("{e}"));
    let decoder = Decoder::new(Format::Json(declared.clone()), false);
    let mut text = Vec::new();
    for record in &chunk {
        text.extend_from_slice(record.value().unwrap_or_default());
        text.push(b'\n');
    }
    let mut group = c.benchmark_group("json_values_1024x100b");
    group.bench_function("decode_with_kafka_columns", |b| {
        b.iter(|| decoder.decode(black_box(&chunk)))
    });
    // The same values through arrow's reader, one value at a time, as every
    // value was read before the one-pass decoder.
    let arrow_only = Decoder::new(Format::Json(declared.clone()), false).arrow_json_only();
    group.bench_function("decode_with_kafka_columns_arrow_reader", |b| {
        b.iter(|| arrow_only.decode(black_box(&chunk)))
    });
    // A bad value is found by decoding halves again, down to it.
    let one_bad = orders_with_bad(&[500]);
    group.bench_function("decode_one_bad_value", |b| {
        b.iter(|| decoder.decode(black_box(&one_bad)))
    });
    let four_bad = orders_with_bad(&[10, 300, 600, 1000]);
    group.bench_function("decode_four_bad_values", |b| {
        b.iter(|| decoder.decode(black_box(&four_bad)))
    });
    // Baseline: arrow's JSON reader on the values as one text, the reader alone,
    // which cannot tell which value made which row.
    group.bench_function("baseline_arrow_reader_on_one_text", |b| {
        b.iter(|| {
            let mut reader = ReaderBuilder::new(declared.clone())
                .with_batch_size(2_048)
                .build_decoder()
                .unwrap_or_else(|e| panic!("{e}"));
            let mut at = 0;
            while at < text.len() {
                at += reader.decode(&text[at..]).unwrap_or_else(|e| panic!("{e}"));
            }
            reader.flush()
        })
    });
    group.finish();
}

/// Events as the dedupe and lookup benchmarks of `cargo xtask bench` write
/// them: a user, an ISO timestamp and an amount.
fn json_events(c: &mut Criterion) {
    let mut chunk = RecordChunk::default();
    for n in 0..1_024_i64 {
        let value = format!(
            r#"{{"user":"u{:05}","ts":"2026-01-01T00:{:02}:{:02}.{:03}Z","amount":{}}}"#,
            n * 7919 % 10_000,
            n / 60 % 60,
            n % 60,
            n % 1000,
            n * 37 % 1000
        );
        chunk.push_record(&Record {
            topic: Arc::from("events"),
            partition: (n % 8) as i32,
            offset: Offset::new(n).unwrap_or(Offset::ZERO),
            timestamp_ms: Some(1_700_000_000_000 + n),
            timestamp_type: TimestampType::CreateTime,
            key: None,
            value: Some(value.into_bytes()),
            headers: Vec::new(),
        });
    }
    let declared =
        parse_ddl("user STRING, ts TIMESTAMP, amount BIGINT").unwrap_or_else(|e| panic!("{e}"));
    let one_pass = Decoder::new(Format::Json(declared.clone()), false);
    let arrow_only = Decoder::new(Format::Json(declared), false).arrow_json_only();
    let mut group = c.benchmark_group("json_events_1024");
    group.bench_function("decode", |b| b.iter(|| one_pass.decode(black_box(&chunk))));
    // Baseline: arrow's reader, one value at a time.
    group.bench_function("baseline_arrow_reader", |b| {
        b.iter(|| arrow_only.decode(black_box(&chunk)))
    });
    group.finish();
}

fn query(c: &mut Criterion) {
    let chunk = orders();
    let declared = parse_ddl(SCHEMA).unwrap_or_else(|e| panic!("{e}"));
    let decoder = Decoder::new(Format::Json(declared), false);
    let rows = decoder
        .decode(&chunk)
        .unwrap_or_else(|e| panic!("{e}"))
        .batch;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    let plan = |sql: &str| {
        runtime
            .block_on(StreamQuery::plan(sql, "orders", decoder.schema()))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let filter = plan(
        "SELECT order, upper(customer) AS customer, amount * 2 AS doubled, partition \
         FROM orders WHERE amount > 500",
    );
    // Baseline: the plan's fixed cost per chunk, a query that passes the rows on.
    let select_all = plan("SELECT * FROM orders");
    let mut group = c.benchmark_group("query_1024_rows");
    group.bench_function("filter_and_projection", |b| {
        b.iter(|| runtime.block_on(filter.run(black_box(rows.clone()))))
    });
    group.bench_function("baseline_select_all", |b| {
        b.iter(|| runtime.block_on(select_all.run(black_box(rows.clone()))))
    });
    group.finish();
}

criterion_group!(benches, records_as_arrow, json_values, json_events, query);
criterion_main!(benches);
