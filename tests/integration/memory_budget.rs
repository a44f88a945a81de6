//! A stateful query's memory budget against the real broker: a stream where
//! every event makes a group of its own is planned down to a small budget and
//! gives every closed window once, with the oracle's counts and sums; a window
//! whose groups alone outgrow the budget stops the query with exit 4, naming
//! the setting, and the same query with room enough then finishes from where
//! it stopped.

use std::collections::BTreeMap;

use serde_json::Value;
use sluice_tests::kafka::{Out, create_topic, delete_topic, produce, producer};
use sluice_tests::process::{run, stderr};

use crate::sql::lines;

/// 2026-01-01T00:00:00Z.
const BASE_MS: i64 = 1_767_225_600_000;
const USERS: u64 = 2_000;
const WINDOWS: u64 = 60;
const PARTITIONS: u64 = 4;

/// Event `n`: user `n % USERS` once in every 10-second window, in order of time.
fn event(n: u64) -> (String, i64, i64) {
    let (window, user) = (n / USERS, n % USERS);
    let ms = BASE_MS + (window * 10_000 + user * 10_000 / USERS) as i64;
    (format!("u{user:05}"), ms, (n * 37 % 1000) as i64)
}

fn json(user: &str, ms: i64, amount: i64) -> String {
    let ts = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms as u64),
    );
    format!(r#"{{"user":"{user}","ts":"{ts}","amount":{amount}}}"#)
}

fn config(dir: &std::path::Path, topic: &str, budget_mb: u64, window: &str) -> std::path::PathBuf {
    let text = format!(
        r#"
[source]
bootstrap_servers = "{bootstrap}"
subscribe = ["{topic}"]
starting_offsets = "earliest"
format = "json"
schema = "user STRING, ts TIMESTAMP, amount BIGINT"
event_time = "ts"
watermark_delay = "5s"

[checkpoint]
location = "{checkpoint}"

[trigger]
available_now = true

[progress]
file = "{progress}"

[sink]
type = "jsonl"
path = "{out}"

[query]
sql = "SELECT to_unixtime(window.start) AS start, user, count(*) AS n, sum(amount) AS total FROM source GROUP BY window(ts, '{window}'), user"
state_memory_mb = {budget_mb}
"#,
        bootstrap = sluice_tests::kafka_bootstrap(),
        checkpoint = dir.join("checkpoint").display(),
        progress = dir.join("progress.jsonl").display(),
        out = dir.join("out").display(),
    );
    let path = dir.join(format!("query-{budget_mb}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Produces `records` a slice at a time, within the producer's queue.
async fn produce_all(topic: &str, records: &[Out]) {
    let producer = producer();
    for slice in records.chunks(20_000) {
        produce(&producer, topic, slice).await;
    }
}

fn progress(dir: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("progress.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn a_group_per_event_is_planned_to_a_small_budget_and_every_window_comes_out_once() {
    let topic = sluice_tests::unique_name("budget");
    create_topic(&topic, PARTITIONS as i32).await;
    let records: Vec<Out> = (0..USERS * WINDOWS)
        .map(|n| {
            let (user, ms, amount) = event(n);
            Out::new(
                (n % PARTITIONS) as i32,
                user.clone(),
                json(&user, ms, amount),
            )
        })
        .collect();
    produce_all(&topic, &records).await;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), &topic, 16, "10 seconds");
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    let reports = progress(dir.path());
    let with_data: Vec<&Value> = reports
        .iter()
        .filter(|p| p["numInputRows"].as_u64() > Some(0))
        .collect();
    let first = &with_data[0]["memory"];
    assert_eq!(first["budgetBytes"], 16 << 20, "{first}");
    assert_eq!(first["measured"], false, "{first}");
    assert_eq!(first["limitedBy"], "memory", "{first}");
    assert_eq!(
        first["maxRecords"], 1024,
        "1 KiB a record in a sixteenth of the budget: {first}"
    );
    for p in &with_data {
        let memory = &p["memory"];
        assert!(
            p["numInputRows"].as_u64() <= memory["maxRecords"].as_u64(),
            "a batch read more than its budget let it: {p}"
        );
        assert!(memory["batchBytes"].as_u64() > Some(0), "{p}");
    }
    let measured = &with_data[1]["memory"];
    assert_eq!(measured["measured"], true, "{measured}");
    assert!(
        measured["maxRecords"].as_u64() > first["maxRecords"].as_u64(),
        "a measured record costs less than the assumed kibibyte: {measured}"
    );
    assert!(
        with_data.len() >= 5,
        "{} events in {} batches",
        USERS * WINDOWS,
        with_data.len()
    );

    // Every window the last batch's watermark closed, once, as the oracle has it.
    let last = reports.last().unwrap();
    let watermark = humantime::parse_rfc3339(last["eventTime"]["watermark"].as_str().unwrap())
        .unwrap()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut want: BTreeMap<(i64, String), (i64, i64)> = BTreeMap::new();
    for n in 0..USERS * WINDOWS {
        let (user, ms, amount) = event(n);
        let start = ms - ms.rem_euclid(10_000);
        if start + 10_000 <= watermark {
            let group = want.entry((start / 1000, user)).or_default();
            group.0 += 1;
            group.1 += amount;
        }
    }
    let mut got: BTreeMap<(i64, String), (i64, i64)> = BTreeMap::new();
    for row in lines(&dir.path().join("out")) {
        let key = (
            row["start"].as_i64().unwrap(),
            row["user"].as_str().unwrap().to_owned(),
        );
        let value = (row["n"].as_i64().unwrap(), row["total"].as_i64().unwrap());
        assert!(got.insert(key.clone(), value).is_none(), "{key:?} twice");
    }
    assert!(want.len() as u64 >= USERS * (WINDOWS - 2), "{}", want.len());
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the output differs from the oracle");
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_window_outgrowing_the_budget_stops_with_exit_4_and_finishes_with_room_enough() {
    let topic = sluice_tests::unique_name("overbudget");
    create_topic(&topic, PARTITIONS as i32).await;
    // 60,000 users in one hour-long window: no group closes.
    let records: Vec<Out> = (0..60_000_u64)
        .map(|n| {
            let user = format!("a-user-with-a-longer-name-{n:08}");
            let ms = BASE_MS + (n / 100) as i64;
            Out::new((n % PARTITIONS) as i32, user.clone(), json(&user, ms, 1))
        })
        .collect();
    produce_all(&topic, &records).await;
    let dir = tempfile::tempdir().unwrap();
    let small = config(dir.path(), &topic, 2, "1 hour");
    let output = run(&["run", "--config", small.to_str().unwrap()]);
    let said = stderr(&output);
    assert_eq!(output.status.code(), Some(4), "{said}");
    assert!(said.contains("query.state_memory_mb = 2"), "{said}");
    assert!(said.contains("MiB, more than"), "{said}");
    let stopped_at = progress(dir.path()).len();
    assert!(stopped_at > 0, "batches ran before the budget was reached");

    // Nothing stored is lost: with room enough the same query goes on from
    // its last commit and its one window holds every user.
    let roomy = config(dir.path(), &topic, 256, "1 hour");
    let output = run(&["run", "--config", roomy.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let reports = progress(dir.path());
    let read: u64 = reports
        .iter()
        .map(|p| p["numInputRows"].as_u64().unwrap())
        .sum();
    assert_eq!(read, 60_000, "every record read once over both runs");
    let groups = reports.last().unwrap()["stateOperators"][0]["numRowsTotal"].as_u64();
    assert_eq!(groups, Some(60_000));
    delete_topic(&topic).await;
}
