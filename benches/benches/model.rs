//! The pure model: offset JSON for 1,000 partitions, rate-limit planning for
//! 10,000 partitions, and the recovery decision.

use std::collections::HashMap;
use std::hint::black_box;
use std::num::NonZeroU64;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice_benches::sample_offsets;
use sluice_core::{BatchId, decide_recovery, offsets_from_json, offsets_to_json, rate_limit};

fn offset_json(c: &mut Criterion) {
    let offsets = sample_offsets(1_000, 0);
    let json = offsets_to_json(&offsets);
    // Baseline: serde_json on a plain nested map of the same content, the obvious
    // alternative to our writer and parser.
    let nested: HashMap<String, HashMap<String, i64>> =
        offsets
            .iter()
            .fold(HashMap::new(), |mut acc, (tp, offset)| {
                acc.entry(tp.topic.to_string())
                    .or_default()
                    .insert(tp.partition.to_string(), offset.value());
                acc
            });

    let mut group = c.benchmark_group("offset_json_1000_partitions");
    group.bench_function("encode", |b| {
        b.iter(|| offsets_to_json(black_box(&offsets)))
    });
    group.bench_function("encode_baseline_serde_map", |b| {
        b.iter(|| serde_json::to_string(black_box(&nested)))
    });
    group.bench_function("decode", |b| b.iter(|| offsets_from_json(black_box(&json))));
    group.bench_function("decode_baseline_serde_map", |b| {
        b.iter(|| serde_json::from_str::<HashMap<String, HashMap<String, i64>>>(black_box(&json)))
    });
    group.finish();
}

fn rate_limiting(c: &mut Criterion) {
    let start = sample_offsets(10_000, 0);
    let latest = sample_offsets(10_000, 5_000_000);
    let budget = NonZeroU64::new(1_000_000);
    let mut group = c.benchmark_group("rate_limit_10000_partitions");
    group.bench_function("proportional_budget", |b| {
        b.iter(|| rate_limit(black_box(&start), black_box(&latest), budget))
    });
    // Baseline: no budget, which only walks the partitions and copies the ends.
    group.bench_function("baseline_unlimited", |b| {
        b.iter(|| rate_limit(black_box(&start), black_box(&latest), None))
    });
    group.finish();
}

fn recovery(c: &mut Criterion) {
    let planned: Vec<BatchId> = (1_000..1_101).map(BatchId).collect();
    let committed: Vec<BatchId> = (1_000..1_100).map(BatchId).collect();
    c.bench_function("recovery_decision_100_retained", |b| {
        b.iter(|| decide_recovery(black_box(&planned), black_box(&committed)))
    });
}

criterion_group!(benches, offset_json, rate_limiting, recovery);
criterion_main!(benches);
