//! What a live group of a windowed aggregation costs in memory, counted by the
//! allocator itself: every byte the process holds after the batch that made
//! the groups, over the bytes it held before, divided by the groups. A count
//! and a sum per short string key per 10-second window, as the
//! high-cardinality workload of `cargo xtask bench` has it, must cost at most
//! 128 bytes a group, and at most 256 while the batch that made it runs; and a window the watermark closes must give its bytes
//! back. The allocator counts every thread's allocations, so this binary holds
//! one test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

use sluice_core::{
    BatchId, BatchMetadata, Offset, Processed, Processor, Record, RecordChunk, TimestampType,
};
use sluice_sql::arrow::array::RecordBatch;
use sluice_sql::{Decoder, Format, QueryOptions, SqlProcessor, StreamQuery, parse_ddl};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn grew(bytes: isize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is passed to the system allocator unchanged; the counter
// only adds up the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as isize);
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as isize - layout.size() as isize);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const USERS: u64 = 10_000;
const WINDOWS: u64 = 20;

/// Event `n`: user `n % USERS` once in every window of 10 seconds, as
/// `bench_tool events` writes them.
fn event(n: u64) -> Record {
    let (window, user) = (n / USERS, n % USERS);
    let ms = window * 10_000 + user * 10_000 / USERS;
    let value = format!(
        r#"{{"user":"u{user:05}","ts":"2026-01-01T{:02}:{:02}:{:02}.{:03}Z","amount":{}}}"#,
        ms / 3_600_000,
        ms / 60_000 % 60,
        ms / 1000 % 60,
        ms % 1000,
        n * 37 % 1000
    );
    Record {
        topic: Arc::from("events"),
        partition: 0,
        offset: Offset::new(n as i64).unwrap(),
        timestamp_ms: Some(0),
        timestamp_type: TimestampType::CreateTime,
        key: None,
        value: Some(value.into_bytes()),
        headers: Vec::new(),
    }
}

/// Runs and commits one batch of `events`; the rows it emitted.
async fn batch(p: &mut SqlProcessor, id: u64, events: std::ops::Range<u64>) -> usize {
    let metadata = BatchMetadata {
        watermark_ms: sluice_core::next_watermark_ms(p),
        timestamp_ms: 0,
        conf: Default::default(),
    };
    p.begin_batch(BatchId(id), &metadata).await.unwrap();
    let mut out = Processed::<RecordBatch>::default();
    let mut chunk = RecordChunk::default();
    for n in events {
        chunk.push_record(&event(n));
        if chunk.len() == 8192 {
            p.process(std::mem::take(&mut chunk), &mut out)
                .await
                .unwrap();
        }
    }
    if !chunk.is_empty() {
        p.process(chunk, &mut out).await.unwrap();
    }
    p.finish_batch(BatchId(id), &mut out).await.unwrap();
    for operator in p.stateful_operators() {
        operator.commit();
    }
    out.rows.iter().map(RecordBatch::num_rows).sum()
}

fn groups(p: &mut SqlProcessor) -> u64 {
    p.stateful_operators()[0].stats().rows_total
}

#[tokio::test(flavor = "current_thread")]
async fn a_live_group_of_a_count_and_a_sum_per_user_and_window_costs_at_most_128_bytes() {
    let decoder = Decoder::new(
        Format::Json(parse_ddl("user STRING, ts TIMESTAMP, amount BIGINT").unwrap()),
        false,
    );
    let options = QueryOptions {
        watermark_column: Some("ts".to_owned()),
        ..QueryOptions::default()
    };
    let sql = "SELECT window.start AS start, user, count(*) AS n, sum(amount) AS total \
               FROM source GROUP BY window(ts, '10 seconds'), user";
    let query = StreamQuery::plan_with(sql, "source", decoder.schema(), &options)
        .await
        .unwrap();
    let mut p = SqlProcessor::new(decoder, Some(query))
        .with_watermark("ts", 5_000)
        .unwrap();
    // A first batch, so that what a query allocates once is there before the count.
    batch(&mut p, 0, 0..USERS).await;
    let held = groups(&mut p);
    let before = live();
    PEAK.store(before, Ordering::Relaxed);

    // Every window still open: the batch's watermark is the one before it.
    let events = USERS..USERS * (WINDOWS + 1);
    batch(&mut p, 1, events.clone()).await;
    let made = groups(&mut p) - held;
    assert_eq!(made, events.end - events.start, "a group per event");
    let per_group = (live() - before) as f64 / made as f64;
    let peak_per_group = (PEAK.load(Ordering::Relaxed) - before) as f64 / made as f64;
    let reported =
        p.stateful_operators()[0].stats().memory_used_bytes as f64 / groups(&mut p) as f64;
    println!(
        "{made} groups: {per_group:.1} bytes a group held by the process after the batch, \
         {reported:.1} reported as the state's own, {peak_per_group:.1} at the batch's peak"
    );
    assert!(
        per_group <= 128.0,
        "{per_group:.1} bytes a live group, more than 128"
    );
    // The batch's own structures come and go; they are what the memory budget
    // plans batches by, so they must stay within a few times the state's.
    assert!(
        peak_per_group <= 256.0,
        "{peak_per_group:.1} bytes a group at the batch's peak, more than 256"
    );

    // Events far later in event time, whose watermark closes every window
    // before them in the batch after theirs.
    let later = USERS * 1000..USERS * 1000 + 10;
    let mut emitted = batch(&mut p, 2, later.clone()).await;
    emitted += batch(&mut p, 3, later.end..later.end + 10).await;
    assert_eq!(emitted as u64, held + made, "every closed group once");
    let left = live() - before;
    assert!(
        left < (made as isize) * 4,
        "closed windows gave their bytes back: {left} bytes left over {made} groups closed"
    );
}
