//! Stateful processing against the real broker and Cassandra: windowed counts
//! and sums exactly once through SIGKILLs with either store, against an oracle
//! that applies the same watermark rule to every produced record; the output
//! modes, sliding and session windows, grouped aggregation without a window and
//! DISTINCT; keyed deduplication (`DISTINCT ON`) exactly once through SIGKILLs
//! against its own oracle; damaged state, `offsets set` on a stateful query, retention, and bad
//! queries refused.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::Value;
use sluice_core::{PartitionOffsets, offsets_from_json};
use sluice_tests::kafka::{Out, create_topic, delete_topic, produce, producer};
use sluice_tests::process::{Lcg, run, stderr};

use crate::sql::lines;

/// 2026-01-01T00:00:00Z, where event time starts.
const BASE_MS: i64 = 1_767_225_600_000;
pub(crate) const DELAY_MS: i64 = 2_000;
const WINDOW_MS: i64 = 10_000;
const SCHEMA: &str = "n BIGINT, customer STRING, amount BIGINT, ts TIMESTAMP";
const WINDOWED: &str = "SELECT to_unixtime(window.start) AS start, to_unixtime(window.end) AS end, \
                        customer, count(*) AS n, sum(amount) AS total FROM orders \
                        GROUP BY window(ts, '10 seconds'), customer";

/// Order `n`: 10 ms of event time after order `n - 1`, except that one in 17 is
/// 40 s late, far beyond the watermark's 2 s delay.
pub(crate) fn event_ms(n: u64) -> i64 {
    let on_time = BASE_MS + n as i64 * 10;
    if n % 17 == 16 {
        on_time - 40_000
    } else {
        on_time
    }
}

pub(crate) fn order(n: u64) -> String {
    let ts = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(event_ms(n) as u64),
    );
    format!(
        r#"{{"n":{n},"customer":"c{}","amount":{},"ts":"{ts}"}}"#,
        n % 5,
        n % 100
    )
}

/// A stateful query's folder and store.
pub(crate) struct StatefulJob {
    dir: tempfile::TempDir,
    topic: String,
    /// A `cassandra://` location, or the checkpoint folder when `None`.
    cassandra: Option<String>,
    /// Where the output goes.
    output: Output,
}

/// Where a stateful job's rows go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// jsonl files under `out/`.
    Jsonl,
    /// A Parquet table under `table/`.
    Parquet,
    /// A Delta table under `table/`.
    Delta,
}

impl StatefulJob {
    pub(crate) fn new(topic: &str, cassandra: bool) -> StatefulJob {
        StatefulJob {
            dir: tempfile::tempdir().unwrap(),
            topic: topic.to_owned(),
            cassandra: cassandra.then(|| sluice_tests::cassandra_location("sluice_state_tests")),
            output: Output::Jsonl,
        }
    }

    /// The same job writing to `output`.
    pub(crate) fn into(mut self, output: Output) -> StatefulJob {
        self.output = output;
        self
    }

    /// The rows the job wrote: its jsonl files' lines, its Parquet table's
    /// rows as pyarrow reads them through Spark's file-sink log, or its Delta
    /// table's as the `deltalake` package reads them.
    pub(crate) fn output(&self) -> Vec<Value> {
        match self.output {
            Output::Jsonl => lines(&self.path("out")),
            Output::Parquet => crate::lake::parquet_rows(&self.path("table")),
            Output::Delta => crate::lake::delta_rows(&self.path("table")).0,
        }
    }

    /// The job's folder.
    pub(crate) fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub(crate) fn checkpoint(&self) -> String {
        match &self.cassandra {
            Some(location) => location.clone(),
            None => self.path("checkpoint").display().to_string(),
        }
    }

    /// A config with `source_extra` under `[source]` and `query` as
    /// `[query]`'s lines.
    fn config(&self, name: &str, source_extra: &str, trigger: &str, query: &str) -> PathBuf {
        let replication = match &self.cassandra {
            Some(_) => format!("replication = \"{}\"", sluice_tests::TEST_REPLICATION),
            None => String::new(),
        };
        let text = format!(
            r#"
[source]
bootstrap_servers = "{bootstrap}"
subscribe = ["{topic}"]
starting_offsets = "earliest"
max_offsets_per_trigger = 300
poll_timeout_ms = 20000
table = "orders"
format = "json"
schema = "{SCHEMA}"
{source_extra}

[checkpoint]
location = "{checkpoint}"
min_batches_to_retain = 100000
{replication}

[trigger]
{trigger}

[progress]
file = "{progress}"

[sink]
{sink}

[query]
{query}
"#,
            bootstrap = sluice_tests::kafka_bootstrap(),
            topic = self.topic,
            checkpoint = self.checkpoint(),
            progress = self.path("progress.jsonl").display(),
            sink = match self.output {
                Output::Jsonl => format!(
                    "type = \"jsonl\"\npath = \"{}\"",
                    self.path("out").display()
                ),
                Output::Parquet => format!(
                    "type = \"parquet\"\npath = \"{}\"",
                    self.path("table").display()
                ),
                Output::Delta => format!(
                    "type = \"delta\"\npath = \"{}\"",
                    self.path("table").display()
                ),
            },
        );
        let path = self.path(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn progress(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("progress.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// How many state partitions hold files: folders under `state/0/`, or
    /// Cassandra partitions of the state table.
    async fn state_partitions_stored(&self) -> u32 {
        match &self.cassandra {
            None => std::fs::read_dir(self.path("checkpoint").join("state").join("0"))
                .unwrap()
                .count() as u32,
            Some(location) => {
                let location = sluice_cassandra_store::CassandraLocation::parse(location).unwrap();
                let session = sluice_tests::cassandra_session(&location.nodes).await;
                let rows = session
                    .query_unpaged(
                        format!(
                            "SELECT DISTINCT query, operator, partition FROM {}.sluice_state",
                            location.keyspace
                        ),
                        (),
                    )
                    .await
                    .unwrap()
                    .into_rows_result()
                    .unwrap();
                rows.rows::<(String, i32, i32)>()
                    .unwrap()
                    .filter(|row| row.as_ref().unwrap().0 == location.query)
                    .count() as u32
            }
        }
    }

    /// Every stored plan: its start and end offsets and its watermark, by batch.
    pub(crate) async fn plans(&self) -> BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)> {
        let mut plans = BTreeMap::new();
        match &self.cassandra {
            None => {
                let dir = self.path("checkpoint").join("offsets");
                for entry in std::fs::read_dir(&dir).unwrap() {
                    let path = entry.unwrap().path();
                    let name = path.file_name().unwrap().to_string_lossy().into_owned();
                    let Ok(batch) = name.parse::<u64>() else {
                        continue;
                    };
                    let text = std::fs::read_to_string(&path).unwrap();
                    let file = sluice_checkpoint_fs::format::parse_offsets(&text).unwrap();
                    let start = file.start.expect("Sluice records each batch's start");
                    let end = file.ends.into_iter().flatten().collect();
                    plans.insert(batch, (start, end, file.metadata.watermark_ms));
                }
            }
            Some(location) => {
                let location = sluice_cassandra_store::CassandraLocation::parse(location).unwrap();
                let session = sluice_tests::cassandra_session(&location.nodes).await;
                let rows = session
                    .query_unpaged(
                        format!(
                            "SELECT batch_id, start_offsets, end_offsets, watermark_ms FROM \
                             {}.sluice_log WHERE query = ? AND kind = 'plan'",
                            location.keyspace
                        ),
                        (&location.query,),
                    )
                    .await
                    .unwrap()
                    .into_rows_result()
                    .unwrap();
                for row in rows.rows::<(i64, String, String, i64)>().unwrap() {
                    let (batch, start, end, watermark) = row.unwrap();
                    // A plan of several sources keeps a JSON object each.
                    let end = match serde_json::from_str::<Vec<Value>>(&end) {
                        Ok(lines) => lines
                            .iter()
                            .flat_map(|line| offsets_from_json(&line.to_string()).unwrap())
                            .collect(),
                        Err(_) => offsets_from_json(&end).unwrap(),
                    };
                    plans.insert(
                        batch as u64,
                        (offsets_from_json(&start).unwrap(), end, watermark),
                    );
                }
            }
        }
        plans
    }
}

/// Keeps producing orders round-robin over `partitions` until told to stop;
/// returns each partition's orders in offset order.
fn keep_producing(
    topic: String,
    partitions: i32,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<BTreeMap<i32, Vec<u64>>> {
    keep_producing_to(topic, move |n| (n % partitions as u64) as i32, stop)
}

/// Keeps producing orders, order `n` to partition `partition_of(n)`, until
/// told to stop; returns each partition's orders in offset order.
pub(crate) fn keep_producing_to(
    topic: String,
    partition_of: impl Fn(u64) -> i32 + Send + 'static,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<BTreeMap<i32, Vec<u64>>> {
    tokio::spawn(async move {
        let p = producer();
        let mut produced: BTreeMap<i32, Vec<u64>> = BTreeMap::new();
        let mut n = 0_u64;
        while !stop.load(Ordering::Relaxed) {
            let mut batch = Vec::new();
            for _ in 0..40 {
                let partition = partition_of(n);
                batch.push(Out::new(partition, format!("k{n}"), order(n)));
                produced.entry(partition).or_default().push(n);
                n += 1;
            }
            // One batch at a time, acknowledged, so that offsets follow `n`.
            produce(&p, &topic, &batch).await;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        produced
    })
}

/// What the oracle expects: each window's row, and each batch's late orders.
struct Expected {
    rows: BTreeMap<(i64, String), (i64, i64)>,
    late_per_batch: BTreeMap<u64, u64>,
}

/// Checks that the plans, read from Sluice's own files, are batches 0, 1, 2,
/// ... whose ranges tile every partition from offset 0 to the last produced
/// order, each starting where the batch before it ended: the oracle takes its
/// batch boundaries from them, and a gap that an overlap made up for would
/// otherwise go unseen.
fn assert_plans_tile(
    produced: &BTreeMap<i32, Vec<u64>>,
    plans: &BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)>,
) {
    let ids: Vec<u64> = plans.keys().copied().collect();
    assert_eq!(
        ids,
        (0..plans.len() as u64).collect::<Vec<_>>(),
        "every batch's plan from 0 on"
    );
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    for (batch, (start, end, _)) in plans {
        for (tp, until) in end {
            let from = start.get(tp).map_or(0, |o| o.value());
            let after_previous = next.get(&tp.partition).copied().unwrap_or(0);
            assert_eq!(
                from, after_previous,
                "batch {batch} starts {tp} at {from}, and the batch before ended it at \
                 {after_previous}"
            );
            assert!(
                until.value() >= from,
                "batch {batch} ends {tp} before it starts"
            );
            next.insert(tp.partition, until.value());
        }
    }
    for (partition, orders) in produced {
        assert_eq!(
            next.get(partition).copied().unwrap_or(0),
            orders.len() as i64,
            "the last plan ends partition {partition} at the last order produced"
        );
    }
}

#[test]
#[should_panic(expected = "batch 1 starts")]
fn the_plan_check_refuses_a_gap_that_an_overlap_makes_up_for() {
    // Partition 0: batch 0 reads [0, 4), batch 1 [5, 10): offset 4 is never
    // read. Partition 1: batch 0 reads [0, 6), batch 1 [5, 10): offset 5
    // twice. Ten offsets each are read in all, as produced.
    let offsets = |entries: &[(i32, i64)]| -> PartitionOffsets {
        offsets_from_json(&format!(
            "{{\"t\":{{{}}}}}",
            entries
                .iter()
                .map(|(p, o)| format!("\"{p}\":{o}"))
                .collect::<Vec<_>>()
                .join(",")
        ))
        .unwrap()
    };
    let plans = BTreeMap::from([
        (0, (PartitionOffsets::new(), offsets(&[(0, 4), (1, 6)]), 0)),
        (
            1,
            (offsets(&[(0, 5), (1, 5)]), offsets(&[(0, 10), (1, 10)]), 0),
        ),
    ]);
    let produced = BTreeMap::from([(0, vec![0; 10]), (1, vec![0; 10])]);
    assert_plans_tile(&produced, &plans);
}

/// Walks the produced orders batch by batch as the plans read them, under
/// the watermark rule: batch N runs under W(N), W(0) = 0 and W(N+1) =
/// max(W(N), latest event time of batch N - delay), which each plan must have
/// recorded; an order older than its batch's watermark is late. Calls
/// `on_time` with each order that is not, and its batch's watermark; returns
/// each batch's late orders.
fn under_the_watermark(
    produced: &BTreeMap<i32, Vec<u64>>,
    topic: &str,
    plans: &BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)>,
    mut on_time: impl FnMut(u64, i64),
) -> (BTreeMap<u64, u64>, i64) {
    assert_plans_tile(produced, plans);
    let mut watermark = 0_i64;
    let mut late_per_batch = BTreeMap::new();
    let mut read = 0_usize;
    for (batch, (start, end, recorded)) in plans {
        assert_eq!(
            *recorded, watermark,
            "batch {batch} ran under the watermark the rule gives"
        );
        let mut latest: Option<i64> = None;
        let mut late = 0;
        for (tp, until) in end {
            let from = start.get(tp).map_or(0, |o| o.value());
            let orders = &produced[&tp.partition];
            for offset in from..until.value() {
                let n = orders[offset as usize];
                read += 1;
                let ts = event_ms(n);
                latest = Some(latest.map_or(ts, |l| l.max(ts)));
                if ts < watermark {
                    late += 1;
                } else {
                    on_time(n, watermark);
                }
            }
        }
        late_per_batch.insert(*batch, late);
        if let Some(latest) = latest {
            watermark = watermark.max(latest - DELAY_MS);
        }
    }
    let total: usize = produced.values().map(Vec::len).sum();
    assert_eq!(read, total, "the plans read every order of {topic} once");
    (late_per_batch, watermark)
}

/// What the windowed query emits: each window's count and sum over its
/// orders on time, once the last watermark has passed its end.
fn oracle(
    produced: &BTreeMap<i32, Vec<u64>>,
    topic: &str,
    plans: &BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)>,
) -> Expected {
    let mut groups: BTreeMap<(i64, String), (i64, i64)> = BTreeMap::new();
    let (late_per_batch, watermark) = under_the_watermark(produced, topic, plans, |n, _| {
        let ts = event_ms(n);
        let window = ts - ts.rem_euclid(WINDOW_MS);
        let entry = groups.entry((window, format!("c{}", n % 5))).or_default();
        entry.0 += 1;
        entry.1 += (n % 100) as i64;
    });
    let rows = groups
        .into_iter()
        .filter(|((start, _), _)| start + WINDOW_MS <= watermark)
        .collect();
    Expected {
        rows,
        late_per_batch,
    }
}

/// The windowed query's output rows, keyed by window start (ms) and customer.
fn windows(out: &[Value]) -> BTreeMap<(i64, String), (i64, i64)> {
    let mut rows = BTreeMap::new();
    for row in out {
        let start = row["start"].as_i64().unwrap() * 1000;
        assert_eq!(row["end"].as_i64().unwrap() * 1000, start + WINDOW_MS);
        let key = (start, row["customer"].as_str().unwrap().to_owned());
        let value = (row["n"].as_i64().unwrap(), row["total"].as_i64().unwrap());
        assert!(
            rows.insert(key.clone(), value).is_none(),
            "window {key:?} emitted twice"
        );
    }
    rows
}

async fn exactly_once_through_sigkills(cassandra: bool, state_partitions: u32, sink: Output) {
    let topic = sluice_tests::unique_name("stateful");
    create_topic(&topic, 3).await;
    let job = StatefulJob::new(&topic, cassandra).into(sink);
    let source = format!("event_time = \"ts\"\nwatermark_delay = \"{DELAY_MS}ms\"");
    let query = format!(
        "sql = \"{WINDOWED}\"\noutput_mode = \"append\"\nstate_partitions = {state_partitions}"
    );
    let streaming = job.config(
        "streaming.toml",
        &source,
        "processing_time = \"0s\"",
        &query,
    );

    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 3, stop.clone());
    let mut random = Lcg::from_clock("stateful crash test");
    let kills = 20;
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, kills, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    let catch_up = job.config("catch_up.toml", &source, "available_now = true", &query);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let plans = job.plans().await;
    let expected = oracle(&produced, &topic, &plans);
    let got = windows(&job.output());
    let progress = job.progress();
    let mut reported = 0;
    let mut most_state = 0;
    for p in &progress {
        let batch = p["batchId"].as_u64().unwrap();
        let operator = &p["stateOperators"][0];
        assert_eq!(
            operator["numRowsDroppedByWatermark"].as_u64().unwrap(),
            expected.late_per_batch[&batch],
            "late orders of batch {batch}"
        );
        reported += 1;
        if batch >= 10 {
            most_state = most_state.max(operator["numRowsTotal"].as_u64().unwrap());
        }
    }
    let late: u64 = expected.late_per_batch.values().sum();
    println!(
        "{} orders, {} windows emitted, {late} late, {} batches ({reported} reported), at most \
         {most_state} groups held",
        produced.values().map(Vec::len).sum::<usize>(),
        got.len(),
        plans.len()
    );
    assert!(late > 0, "some orders were late");
    assert!(expected.rows.len() > 20, "several windows closed");
    assert_eq!(got.len(), expected.rows.len(), "no window lost or added");
    assert_eq!(got, expected.rows, "every window's count and sum");
    // Open windows only: the watermark trails the latest order by 2 s, and a
    // batch reads at most 300 orders (3 s), so at most a few 10 s windows of 5
    // customers each are open at any time.
    assert!(most_state <= 20, "state stays bounded: {most_state} groups");
    // A report follows its batch's commit, so a kill loses at most the report
    // of the batch it cut short; every other batch is reported, replays too.
    assert!(
        reported + kills as usize >= plans.len(),
        "progress for every batch but at most one per kill: {reported} of {} after {kills} kills",
        plans.len()
    );
    assert_eq!(
        job.state_partitions_stored().await,
        state_partitions,
        "the state is split as configured"
    );
    if sink == Output::Delta {
        let (_, txn) = crate::lake::delta_rows(&job.path("table"));
        let last = progress.last().unwrap()["batchId"].as_u64().unwrap();
        crate::lake::assert_one_txn_per_batch(&txn, last);
    }
    delete_topic(&topic).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_are_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
{
    exactly_once_through_sigkills(false, 1, Output::Jsonl).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_are_exactly_once_through_sigkills_with_the_cassandra_store() {
    // Four state partitions, so four Cassandra partitions of the state table.
    exactly_once_through_sigkills(true, 4, Output::Jsonl).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_land_in_parquet_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
 {
    exactly_once_through_sigkills(false, 1, Output::Parquet).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_land_in_parquet_exactly_once_through_sigkills_with_the_cassandra_store()
 {
    exactly_once_through_sigkills(true, 2, Output::Parquet).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_land_in_delta_exactly_once_through_sigkills_with_the_filesystem_checkpoint()
 {
    exactly_once_through_sigkills(false, 1, Output::Delta).await;
}

#[tokio::test]
async fn windowed_counts_and_sums_land_in_delta_exactly_once_through_sigkills_with_the_cassandra_store()
 {
    exactly_once_through_sigkills(true, 2, Output::Delta).await;
}

/// Order `n`'s key for the deduplication: its customer and amount, which
/// repeat every 100 orders (1 s of event time).
pub(crate) fn dedupe_key(n: u64) -> u64 {
    n % 100
}

/// What the deduplication emits: the orders that are the first of their key
/// while the watermark keeps it (until it passes the first order's event time
/// plus the delay), batch by batch as the plans read them, and each batch's
/// late orders. A key's orders all go to one partition, so which is first does
/// not depend on how a batch interleaves partitions.
fn dedupe_oracle(
    produced: &BTreeMap<i32, Vec<u64>>,
    topic: &str,
    plans: &BTreeMap<u64, (PartitionOffsets, PartitionOffsets, i64)>,
) -> (Vec<u64>, BTreeMap<u64, u64>, u64) {
    let mut held: BTreeMap<u64, i64> = BTreeMap::new();
    let mut emitted = Vec::new();
    let mut duplicates = 0;
    let (late_per_batch, _) =
        under_the_watermark(produced, topic, plans, |n, watermark| {
            match held.get(&dedupe_key(n)) {
                Some(&expires) if expires >= watermark => duplicates += 1,
                _ => {
                    held.insert(dedupe_key(n), event_ms(n) + DELAY_MS);
                    emitted.push(n);
                }
            }
        });
    emitted.sort_unstable();
    (emitted, late_per_batch, duplicates)
}

async fn dedupe_exactly_once_through_sigkills(cassandra: bool) {
    let topic = sluice_tests::unique_name("dedupe");
    create_topic(&topic, 3).await;
    let job = StatefulJob::new(&topic, cassandra);
    let source = format!("event_time = \"ts\"\nwatermark_delay = \"{DELAY_MS}ms\"");
    let query = "sql = \"SELECT DISTINCT ON (customer, amount) n, customer, amount FROM orders\"\n\
                 state_partitions = 2";
    let streaming = job.config("streaming.toml", &source, "processing_time = \"0s\"", query);
    let stop = Arc::new(AtomicBool::new(false));
    let producer_task =
        keep_producing_to(topic.clone(), |n| (dedupe_key(n) % 3) as i32, stop.clone());
    let mut random = Lcg::from_clock("dedupe crash test");
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 20, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();
    let catch_up = job.config("catch_up.toml", &source, "available_now = true", query);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let plans = job.plans().await;
    let (expected, late_per_batch, duplicates) = dedupe_oracle(&produced, &topic, &plans);
    let mut got: Vec<u64> = lines(&job.path("out"))
        .iter()
        .map(|row| {
            let n = row["n"].as_u64().unwrap();
            assert_eq!(row["customer"], format!("c{}", n % 5), "{row}");
            n
        })
        .collect();
    got.sort_unstable();
    for p in job.progress() {
        let batch = p["batchId"].as_u64().unwrap();
        let operator = &p["stateOperators"][0];
        assert_eq!(operator["operatorName"], "dedupeWithinWatermark");
        assert_eq!(
            operator["numRowsDroppedByWatermark"].as_u64().unwrap(),
            late_per_batch[&batch],
            "late orders of batch {batch}"
        );
        // At most the 100 keys, and fewer once the watermark forgets some.
        assert!(
            operator["numRowsTotal"].as_u64().unwrap() <= 100,
            "{operator}"
        );
    }
    let total: usize = produced.values().map(Vec::len).sum();
    println!(
        "{total} orders, {} first of their key, {duplicates} duplicates, {} late, {} batches",
        expected.len(),
        late_per_batch.values().sum::<u64>(),
        plans.len()
    );
    assert!(duplicates > 0 && late_per_batch.values().sum::<u64>() > 0);
    assert!(
        expected.len() > 100,
        "keys were forgotten and came again: {}",
        expected.len()
    );
    assert_eq!(got.len(), expected.len(), "no row lost or repeated");
    assert_eq!(got, expected, "exactly the first order of each key");
    assert_eq!(job.state_partitions_stored().await, 2);
    delete_topic(&topic).await;
}

#[tokio::test]
async fn distinct_on_is_exactly_once_through_sigkills_with_the_filesystem_checkpoint() {
    dedupe_exactly_once_through_sigkills(false).await;
}

#[tokio::test]
async fn distinct_on_is_exactly_once_through_sigkills_with_the_cassandra_store() {
    dedupe_exactly_once_through_sigkills(true).await;
}

/// Sets the tier of customers `<prefix>0` to `<prefix>4` in `keyspace.tiers`
/// to `<tier>-<customer>`.
pub(crate) async fn set_tiers(
    session: &scylla::client::session::Session,
    keyspace: &str,
    prefix: &str,
    tier: &str,
) {
    for c in 0..5 {
        session
            .query_unpaged(
                format!("INSERT INTO {keyspace}.tiers (name, tier) VALUES (?, ?)"),
                (format!("{prefix}{c}"), format!("{tier}-{prefix}{c}")),
            )
            .await
            .unwrap();
    }
}

/// A CSV lookup file of the segments of customers `c0` to `c4`, tagged `tag`.
pub(crate) fn segments_csv(tag: &str) -> String {
    let mut text = String::from("name,segment\n");
    for c in 0..5 {
        text.push_str(&format!("c{c},{tag}-c{c}\n"));
    }
    text
}

/// The deduplication of orders enriched from two lookup tables that change
/// while the query runs and is killed: a CSV file rewritten in place and a
/// Cassandra table read by key. The rows are exactly the deduplication's, and
/// each carries one of its customer's versions from each table.
async fn lookups_and_dedupe_exactly_once_through_sigkills(cassandra: bool) {
    let topic = sluice_tests::unique_name("lookupdedupe");
    create_topic(&topic, 3).await;
    let job = StatefulJob::new(&topic, cassandra);
    let (session, keyspace) = sluice_tests::keyspace_with(
        "lookuptiers",
        &["CREATE TABLE {keyspace}.tiers (name text PRIMARY KEY, tier text)"],
    )
    .await;
    set_tiers(&session, &keyspace, "c", "old").await;
    let segments = job.path("customers.csv");
    std::fs::write(&segments, segments_csv("one")).unwrap();
    let source = format!("event_time = \"ts\"\nwatermark_delay = \"{DELAY_MS}ms\"");
    let query = format!(
        "sql = \"SELECT DISTINCT ON (o.customer, o.amount) o.n, o.customer, o.amount, c.segment, \
         t.tier FROM orders o LEFT JOIN customers c ON o.customer = c.name \
         LEFT JOIN tiers t ON o.customer = t.name\"\nstate_partitions = 2\n\n\
         [tables.customers]\npath = \"{}\"\nformat = \"csv\"\n\
         schema = \"name STRING, segment STRING\"\n\n\
         [tables.tiers]\ntype = \"cassandra\"\ncontact_points = \"{}\"\n\
         keyspace = \"{keyspace}\"\ntable = \"tiers\"\nschema = \"name STRING, tier STRING\"\n",
        segments.display(),
        sluice_tests::cassandra_nodes().join(",")
    );
    let streaming = job.config(
        "streaming.toml",
        &source,
        "processing_time = \"0s\"",
        &query,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let producer_task =
        keep_producing_to(topic.clone(), |n| (dedupe_key(n) % 3) as i32, stop.clone());
    let mut random = Lcg::from_clock("lookups and dedupe crash test");
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 10, (300, 900), &mut random).await;
    // Both tables change between kills, the CSV file rewritten where it is.
    std::fs::write(&segments, segments_csv("two")).unwrap();
    set_tiers(&session, &keyspace, "c", "new").await;
    sluice_tests::process::kill_at_random_moments(&streaming, 10, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();
    let catch_up = job.config("catch_up.toml", &source, "available_now = true", &query);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let plans = job.plans().await;
    let (expected, _, duplicates) = dedupe_oracle(&produced, &topic, &plans);
    let mut versions = BTreeMap::<(String, String), u64>::new();
    let mut got: Vec<u64> = lines(&job.path("out"))
        .iter()
        .map(|row| {
            let n = row["n"].as_u64().unwrap();
            let customer = format!("c{}", n % 5);
            assert_eq!(row["customer"], customer.as_str(), "{row}");
            let (segment, tier) = (row["segment"].as_str(), row["tier"].as_str());
            let segment = segment.and_then(|s| s.strip_suffix(&format!("-{customer}")));
            let tier = tier.and_then(|t| t.strip_suffix(&format!("-{customer}")));
            assert!(
                matches!(segment, Some("one" | "two")) && matches!(tier, Some("old" | "new")),
                "a version of each table for its customer: {row}"
            );
            *versions
                .entry((segment.unwrap().to_owned(), tier.unwrap().to_owned()))
                .or_default() += 1;
            n
        })
        .collect();
    got.sort_unstable();
    println!(
        "{} first orders of their key, {duplicates} duplicates; rows by versions: {versions:?}",
        expected.len()
    );
    assert!(duplicates > 0);
    assert_eq!(got.len(), expected.len(), "no row lost or repeated");
    assert_eq!(got, expected, "exactly the first order of each key");
    assert!(
        versions.contains_key(&("one".into(), "old".into()))
            && versions.contains_key(&("two".into(), "new".into())),
        "rows joined before and after the tables changed: {versions:?}"
    );
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap();
    delete_topic(&topic).await;
}

#[tokio::test]
async fn lookups_and_dedupe_are_exactly_once_through_sigkills_with_the_filesystem_checkpoint() {
    lookups_and_dedupe_exactly_once_through_sigkills(false).await;
}

#[tokio::test]
async fn lookups_and_dedupe_are_exactly_once_through_sigkills_with_the_cassandra_store() {
    lookups_and_dedupe_exactly_once_through_sigkills(true).await;
}

/// Twenty orders over two partitions, their event times 1 s apart.
async fn small_topic() -> String {
    let topic = sluice_tests::unique_name("statemodes");
    create_topic(&topic, 2).await;
    let records: Vec<Out> = (0..20)
        .map(|n| {
            let ts = humantime::format_rfc3339(
                std::time::UNIX_EPOCH
                    + std::time::Duration::from_millis((BASE_MS + n * 1000) as u64),
            );
            Out::new(
                (n % 2) as i32,
                format!("k{n}"),
                format!(
                    r#"{{"n":{n},"customer":"c{}","amount":{},"ts":"{ts}"}}"#,
                    n % 3,
                    n * 10
                ),
            )
        })
        .collect();
    produce(&producer(), &topic, &records).await;
    topic
}

/// Runs `sql` in `mode` to the end of the topic, 5 orders per batch; the rows
/// written, as JSON text, sorted, and the progress.
fn run_mode(topic: &str, sql: &str, mode: &str, watermark: bool) -> (Vec<String>, Vec<Value>) {
    let job = StatefulJob::new(topic, false);
    // 3 s: the two partitions may be read a few orders apart, and none is late.
    let source = if watermark {
        "event_time = \"ts\"\nwatermark_delay = \"3s\""
    } else {
        ""
    };
    let config = job.config(
        "q.toml",
        source,
        "available_now = true",
        &format!("sql = \"{sql}\"\noutput_mode = \"{mode}\""),
    );
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "max_offsets_per_trigger = 300",
        "max_offsets_per_trigger = 5",
    );
    std::fs::write(&config, text).unwrap();
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{sql}: {}", stderr(&output));
    let mut rows: Vec<String> = lines(&job.path("out"))
        .iter()
        .map(Value::to_string)
        .collect();
    rows.sort();
    (rows, job.progress())
}

#[tokio::test]
async fn output_modes_sliding_and_session_windows_and_grouping_without_a_window() {
    let topic = small_topic().await;
    // Update mode without a window: every batch writes the customers it changed,
    // with their running totals. Batches of 5 orders, round-robin over customers.
    let (rows, progress) = run_mode(
        &topic,
        "SELECT customer, count(*) AS n, sum(amount) AS total FROM orders GROUP BY customer",
        "update",
        false,
    );
    assert_eq!(progress.len(), 4, "four batches of five");
    let finals: BTreeMap<String, (i64, i64)> = rows
        .iter()
        .map(|r| serde_json::from_str::<Value>(r).unwrap())
        .fold(BTreeMap::new(), |mut m, v| {
            let key = v["customer"].as_str().unwrap().to_owned();
            let value = (v["n"].as_i64().unwrap(), v["total"].as_i64().unwrap());
            let e = m.entry(key).or_insert(value);
            *e = (*e).max(value);
            m
        });
    // c0: n = 0, 3, ..., 18 (7 orders); c1: 1, 4, ..., 19 (7); c2: 2, ..., 17 (6).
    assert_eq!(finals["c0"], (7, 630));
    assert_eq!(finals["c1"], (7, 700));
    assert_eq!(finals["c2"], (6, 570));
    // Each batch writes exactly the customers of its own orders: order n is at
    // offset n / 2 of partition n % 2.
    for p in &progress {
        let range = |key: &str, partition: &str| {
            p["sources"][0][key][topic.as_str()][partition]
                .as_u64()
                .unwrap_or(0)
        };
        let mut customers = std::collections::BTreeSet::new();
        for partition in [0_u64, 1] {
            let (from, until) = (
                range("startOffset", &partition.to_string()),
                range("endOffset", &partition.to_string()),
            );
            customers.extend((from..until).map(|o| (o * 2 + partition) % 3));
        }
        assert_eq!(p["sink"]["numOutputRows"], customers.len(), "{p}");
    }

    // Complete: the whole result every batch; the last batch's rows are the totals.
    let (rows, progress) = run_mode(
        &topic,
        "SELECT customer, count(*) AS n FROM orders GROUP BY customer HAVING count(*) > 1",
        "complete",
        false,
    );
    assert_eq!(progress.last().unwrap()["sink"]["numOutputRows"], 3);
    assert!(
        rows.contains(&r#"{"customer":"c2","n":6}"#.to_owned()),
        "{rows:?}"
    );

    // Sliding windows of 10 s every 5 s, in append mode with a watermark of no
    // delay: each order counts in two windows; the last two windows stay open.
    let (rows, _) = run_mode(
        &topic,
        "SELECT to_unixtime(window.start) - 1767225600 AS s, count(*) AS n FROM orders \
         GROUP BY window(ts, '10 seconds', '5 seconds')",
        "append",
        true,
    );
    assert_eq!(
        rows,
        [
            r#"{"n":10,"s":0}"#,
            r#"{"n":10,"s":5}"#,
            r#"{"n":5,"s":-5}"#
        ]
    );

    // Sessions with a gap of 4 s: a customer's orders are 3 s apart, so they
    // make one session, still open at the end.
    let (rows, _) = run_mode(
        &topic,
        "SELECT customer, count(*) AS n FROM orders \
         GROUP BY session_window(ts, '4 seconds'), customer",
        "update",
        true,
    );
    let last: BTreeMap<String, i64> = rows
        .iter()
        .map(|r| serde_json::from_str::<Value>(r).unwrap())
        .fold(BTreeMap::new(), |mut m, v| {
            let e = m
                .entry(v["customer"].as_str().unwrap().to_owned())
                .or_insert(0);
            *e = (*e).max(v["n"].as_i64().unwrap());
            m
        });
    assert_eq!(last["c0"], 7, "one session of all of c0's orders: {rows:?}");

    // DISTINCT within the watermark: each (customer, 10 s bucket) once.
    let (rows, _) = run_mode(
        &topic,
        "SELECT DISTINCT customer, date_bin(INTERVAL '10' SECOND, ts) AS bucket FROM orders",
        "update",
        false,
    );
    assert_eq!(rows.len(), 6, "three customers in two buckets: {rows:?}");
    delete_topic(&topic).await;
}

#[tokio::test]
async fn damaged_state_is_named_set_needs_reset_state_and_retention_keeps_what_recovery_needs() {
    let topic = small_topic().await;
    let job = StatefulJob::new(&topic, false);
    let config = job.config(
        "q.toml",
        "event_time = \"ts\"\nwatermark_delay = \"3s\"",
        "available_now = true",
        &format!("sql = \"{WINDOWED}\""),
    );
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace(
            "max_offsets_per_trigger = 300",
            "max_offsets_per_trigger = 1",
        )
        .replace(
            "min_batches_to_retain = 100000",
            "min_batches_to_retain = 3",
        );
    std::fs::write(&config, text).unwrap();
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let state = job.path("checkpoint").join("state").join("0").join("0");
    let mut files: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort_by_key(|f| {
        (
            f.split('.').next().unwrap().parse::<u64>().unwrap(),
            f.clone(),
        )
    });
    // 20 batches and one without data (20): batches 18..=20 are kept, so version
    // 17 must rebuild: snapshot 9 is the newest at or before it, with deltas 10...
    let mut expected: Vec<String> = (10..=20).map(|v| format!("{v}.delta")).collect();
    expected.push("9.snapshot".to_owned());
    expected.push("19.snapshot".to_owned());
    expected.sort_by_key(|f| {
        (
            f.split('.').next().unwrap().parse::<u64>().unwrap(),
            f.clone(),
        )
    });
    assert_eq!(files, expected);

    // `offsets show` names the version a restart starts from.
    let shown = run(&["offsets", "show", "--checkpoint", &job.checkpoint()]);
    assert!(shown.status.success(), "{}", stderr(&shown));
    let report: Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(report["state"][0]["version"], 20, "{report}");
    assert_eq!(
        report["state"][0]["filesToRebuild"], 2,
        "snapshot 19 and delta 20"
    );
    assert!(report["state"][0]["bytesToRebuild"].as_u64().unwrap() > 0);

    // A damaged delta stops the next run with exit 4 and its path.
    std::fs::write(state.join("20.delta"), b"not a state file").unwrap();
    produce(&producer(), &topic, &[Out::new(0, "k", order(1))]).await;
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(4), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains(&state.join("20.delta").display().to_string()),
        "{err}"
    );

    // `offsets set` is refused without --reset-state, and resets with it.
    let target = format!(r#"{{"{topic}":{{"0":0,"1":0}}}}"#);
    let refused = run(&[
        "offsets",
        "set",
        "--checkpoint",
        &job.checkpoint(),
        "--offsets",
        &target,
    ]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("--reset-state"),
        "{}",
        stderr(&refused)
    );
    let reset = run(&[
        "offsets",
        "set",
        "--checkpoint",
        &job.checkpoint(),
        "--offsets",
        &target,
        "--reset-state",
    ]);
    assert!(reset.status.success(), "{}", stderr(&reset));
    std::fs::remove_dir_all(job.path("out")).unwrap();
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    // From empty state again: the window [0 s, 10 s) closes under the last
    // watermark (19 s - 3 s) with its ten orders; the order added at 1 s comes
    // last on its partition, long after the watermark passed it.
    let got = windows(&lines(&job.path("out")));
    assert!(got.keys().all(|(start, _)| *start == BASE_MS), "{got:?}");
    let orders: i64 = got.values().map(|(n, _)| n).sum();
    assert_eq!(orders, 10, "{got:?}");

    // The checkpoint keeps its state's partitions: asking for two is refused,
    // and nothing is run.
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("state_partitions = 2\n");
    std::fs::write(&config, text).unwrap();
    produce(&producer(), &topic, &[Out::new(0, "k", order(2))]).await;
    let plans = || {
        std::fs::read_dir(job.path("checkpoint").join("offsets"))
            .unwrap()
            .count()
    };
    let before = plans();
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(err.contains("state_partitions = 1"), "{err}");
    assert_eq!(plans(), before, "no batch was planned");
    delete_topic(&topic).await;
}

#[tokio::test]
async fn bad_stateful_queries_exit_2_with_one_clear_line() {
    let job = StatefulJob::new("unused", false);
    let watermark = "event_time = \"ts\"\nwatermark_delay = \"5s\"";
    let cases: [(&str, &str, &str); 12] = [
        (
            "",
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 minute')\"",
            "without a watermark",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 fortnight')\"",
            "unknown unit \\\"fortnight\\\"",
        ),
        (
            watermark,
            "sql = \"SELECT array_agg(n ORDER BY n) AS a FROM orders GROUP BY window(ts, '1 minute')\"",
            "depends on the order rows arrive in",
        ),
        (
            watermark,
            "sql = \"SELECT customer, count(*) AS n FROM orders GROUP BY customer\"\noutput_mode = \"append\"",
            "without an event-time window",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 minute')\"\noutput_mode = \"complete\"",
            "complete\\\" for a windowed aggregation",
        ),
        (
            "",
            "sql = \"SELECT n FROM orders\"\noutput_mode = \"complete\"",
            "without an aggregation",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 minute', '2 minutes')\"",
            "slide duration must not be longer",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(n, '1 minute')\"",
            "must be a TIMESTAMP",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS c FROM (SELECT customer, count(*) AS n FROM orders GROUP BY customer)\"",
            "more than one aggregation",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders\"\noutput_mode = \"sometimes\"",
            "output_mode must be",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 minute')\"\nstate_partitions = 0",
            "query.state_partitions = 0: it must be from 1 to 256",
        ),
        (
            watermark,
            "sql = \"SELECT count(*) AS n FROM orders GROUP BY window(ts, '1 minute')\"\nstate_memory_mb = 0",
            "query.state_memory_mb = 0: it must be from 1 to 1048576 (MiB)",
        ),
    ];
    for (source, query, expected) in cases {
        let config = job.config("bad.toml", source, "available_now = true", query);
        let output = run(&["validate", "--config", config.to_str().unwrap()]);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{query}: {err}");
        let expected = expected.replace("\\\"", "\"");
        let last = err.lines().last().unwrap_or_default();
        assert!(last.starts_with("sluice: "), "one line at the end: {err}");
        assert!(last.contains(&expected), "{query}: {err}");
        assert!(
            !job.path("checkpoint").exists(),
            "{query} touched the checkpoint"
        );
    }
}

/// Fills a topic of `partitions` partitions with `per_partition` orders each,
/// written by a producer with `batch_size` and `linger_ms`: order `n` of
/// partition `p` is order `n * partitions + p` of one stream, 100 ms of event
/// time after the one before in its partition, one in 17 of them late.
async fn orders_topic(
    name: &str,
    partitions: i32,
    per_partition: u64,
    batch_size: u32,
    linger_ms: u32,
) -> String {
    let topic = sluice_tests::unique_name(name);
    create_topic(&topic, partitions).await;
    // Idempotent, so that a retried request cannot reorder a partition's
    // orders: without it, 154 of 1,024 partitions came out of order.
    let p: rdkafka::producer::FutureProducer = sluice_tests::kafka::client_config()
        .set("enable.idempotence", "true")
        .set("batch.size", batch_size.to_string())
        .set("linger.ms", linger_ms.to_string())
        .set("queue.buffering.max.messages", "2000000")
        .create()
        .expect("a producer for the test broker");
    let records: Vec<Out> = (0..per_partition)
        .flat_map(|i| {
            (0..partitions as u64).map(move |p| {
                let n = i * partitions as u64 + p;
                let late = if i % 17 == 16 { 40_000 } else { 0 };
                let ms = BASE_MS + i as i64 * 100 - late;
                let ts = humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms as u64),
                );
                Out::new(
                    p as i32,
                    format!("k{n}"),
                    format!(
                        r#"{{"n":{n},"customer":"c{}","amount":{},"ts":"{ts}"}}"#,
                        n % 5,
                        n % 100
                    ),
                )
            })
        })
        .collect();
    produce(&p, &topic, &records).await;
    topic
}

/// The windowed counts and sums over `topic` at 10,000 orders per trigger, in
/// append mode: the rows written, sorted, and the rows the watermark dropped
/// as late in all.
fn windowed_at_a_rate_limit(topic: &str) -> (Vec<String>, i64) {
    let job = StatefulJob::new(topic, false);
    let config = job.config(
        "q.toml",
        &format!("event_time = \"ts\"\nwatermark_delay = \"{DELAY_MS}ms\""),
        "available_now = true",
        &format!("sql = \"{WINDOWED}\"\noutput_mode = \"append\""),
    );
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "max_offsets_per_trigger = 300",
        "max_offsets_per_trigger = 10000",
    );
    std::fs::write(&config, text).unwrap();
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{topic}: {}", stderr(&output));
    let mut rows: Vec<String> = lines(&job.path("out"))
        .iter()
        .map(Value::to_string)
        .collect();
    rows.sort();
    let dropped = job
        .progress()
        .iter()
        .flat_map(|p| p["stateOperators"].as_array().cloned().unwrap_or_default())
        .map(|op| op["numRowsDroppedByWatermark"].as_i64().unwrap_or(0))
        .sum();
    (rows, dropped)
}

#[tokio::test]
async fn a_window_over_many_partitions_drops_the_same_late_rows_whatever_the_record_batches() {
    // The same orders in the same partitions, written as the Java producer
    // writes them (16 KiB record batches) and as librdkafka's producers do
    // (up to 1,000,000 bytes: here about 40 KiB, all of a partition's orders
    // at once, more than a partition's 16 KiB share of the read-ahead).
    let (partitions, per_partition) = (1024, 400);
    let small = orders_topic("windows16k", partitions, per_partition, 16_384, 5).await;
    let large = orders_topic("windows1mb", partitions, per_partition, 1_000_000, 500).await;
    // Plans are made per offset, each partition's part of the 10,000 in
    // proportion to what it holds, so every partition moves through event time
    // at the same pace whatever the record batches: a read that drained some
    // partitions' record batches ahead of others would raise the watermark
    // past the others' orders and drop them as late.
    let (small_rows, small_dropped) = windowed_at_a_rate_limit(&small);
    let (large_rows, large_dropped) = windowed_at_a_rate_limit(&large);
    assert!(!small_rows.is_empty());
    // Every late order is 40 s behind its partition and the earliest comes in
    // the second batch, past the first batch's watermark: all of them are
    // dropped, and no order on time.
    let late = (0..per_partition).filter(|i| i % 17 == 16).count() as i64;
    assert_eq!(small_dropped, late * i64::from(partitions));
    assert_eq!(large_dropped, small_dropped);
    assert_eq!(large_rows, small_rows);
    delete_topic(&small).await;
    delete_topic(&large).await;
}
