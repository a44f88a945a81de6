//! Keyed deduplication's state on the shape of `cargo xtask bench --only dedupe`:
//! ten batches of 100,000 rows, in chunks of 1,024 as the processor hands them
//! over, keyed by a user's number and a 10-second window of the event's time,
//! every tenth row repeating the key of the row before it, each key forgotten
//! once the watermark (5 s behind) passes its window. Beside it, a baseline:
//! a hash map of the same keys to their expiry, forgetting by the same rule,
//! with no delta and nothing kept for a batch begun again.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice_sql::arrow::array::{ArrayRef, Int64Array};
use sluice_sql::arrow::datatypes::{DataType, Field};
use sluice_state::Dedupe;

const USERS: i64 = 10_000;
const ROWS_PER_BATCH: i64 = 100_000;
const BATCHES: i64 = 10;
const CHUNK: i64 = 1_024;
const DELAY_MS: i64 = 5_000;

/// One chunk: the key columns (user, window start) and the event times.
struct Chunk {
    keys: Vec<ArrayRef>,
    users: Vec<i64>,
    windows: Vec<i64>,
    event_ms: Int64Array,
}

/// The batches' chunks, and each batch's watermark: an event a millisecond,
/// so that every user has one event in each 10-second window.
fn batches() -> Vec<(i64, Vec<Chunk>)> {
    (0..BATCHES)
        .map(|b| {
            let watermark = (b * ROWS_PER_BATCH - 1 - DELAY_MS).max(i64::MIN / 2);
            let chunks = (b * ROWS_PER_BATCH..(b + 1) * ROWS_PER_BATCH)
                .step_by(CHUNK as usize)
                .map(|from| {
                    let until = (from + CHUNK).min((b + 1) * ROWS_PER_BATCH);
                    let users: Vec<i64> = (from..until)
                        .map(|i| {
                            let user = i % USERS;
                            if i % 10 == 9 && user > 0 {
                                user - 1
                            } else {
                                user
                            }
                        })
                        .collect();
                    let windows: Vec<i64> = (from..until).map(|i| i / 10_000 * 10_000).collect();
                    Chunk {
                        keys: vec![
                            Arc::new(Int64Array::from(users.clone())) as ArrayRef,
                            Arc::new(Int64Array::from(windows.clone())),
                        ],
                        users,
                        windows,
                        event_ms: Int64Array::from((from..until).collect::<Vec<_>>()),
                    }
                })
                .collect();
            (watermark, chunks)
        })
        .collect()
}

fn dedupe(c: &mut Criterion) {
    let batches = batches();
    let mut group = c.benchmark_group("dedupe_10x100k_rows_10pct_duplicates");
    group.sample_size(20);
    group.bench_function("dedupe_keep_finish_commit", |b| {
        b.iter(|| {
            let mut d = Dedupe::new(
                vec![
                    Field::new("user", DataType::Int64, true),
                    Field::new("window", DataType::Int64, true),
                ],
                DELAY_MS,
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let mut kept = 0;
            for (watermark, chunks) in &batches {
                d.begin(*watermark);
                for chunk in chunks {
                    let mask = d
                        .keep(&chunk.keys, &chunk.event_ms)
                        .unwrap_or_else(|e| panic!("{e}"));
                    kept += mask.true_count();
                }
                d.finish().unwrap_or_else(|e| panic!("{e}"));
                d.commit();
            }
            black_box(kept)
        })
    });
    group.bench_function("baseline_hash_map_of_the_keys", |b| {
        b.iter(|| {
            let mut seen: HashMap<(i64, i64), i64> = HashMap::new();
            let mut kept = 0;
            for (watermark, chunks) in &batches {
                seen.retain(|_, expires| *expires >= *watermark);
                for chunk in chunks {
                    let rows = chunk
                        .users
                        .iter()
                        .zip(&chunk.windows)
                        .zip(chunk.event_ms.values());
                    for ((&user, &window), &at) in rows {
                        if let Entry::Vacant(room) = seen.entry((user, window)) {
                            room.insert(at + DELAY_MS);
                            kept += 1;
                        }
                    }
                }
            }
            black_box(kept)
        })
    });
    group.finish();
}

criterion_group!(benches, dedupe);
criterion_main!(benches);
