//! The `kafka` sink with `delivery = "exactly_once"` against the real broker:
//! Kafka to Kafka through SIGKILLs (and once, deterministically, between the
//! transaction's commit and the store's), a paused runner fenced by its
//! successor, the transaction timeout checked against the broker's, and
//! transactions upstream.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::producer::{FutureRecord, Producer};
use sluice_tests::kafka::{TIMEOUT, create_topic, delete_topic};
use sluice_tests::process::{Lcg, Running, run, sluice, stderr, wait_until};

use crate::runner::{Job, keep_producing};

/// Points a job's config at `out_topic` through the exactly-once kafka sink.
pub(crate) fn to_kafka(config: &Path, job: &Job, out_topic: &str, extra: &str) {
    let text = std::fs::read_to_string(config).unwrap();
    let jsonl = format!("type = \"jsonl\"\npath = \"{}\"", job.out().display());
    assert!(text.contains(&jsonl), "{text}");
    let kafka =
        format!("type = \"kafka\"\ntopic = \"{out_topic}\"\ndelivery = \"exactly_once\"\n{extra}");
    std::fs::write(config, text.replace(&jsonl, &kafka)).unwrap();
}

/// The value `keep_producing` writes at `offset` of `partition`.
pub(crate) fn produced_value(partition: i32, offset: i64) -> String {
    format!("p{partition}-{offset}")
}

/// Everything a `read_committed` consumer finds in `topic`, as a count per
/// `sluice.position` header, read until `want` records came or nothing new
/// came for a few seconds; each record's value is checked against
/// `value_at(partition, offset)`, what the producer wrote at its position.
pub(crate) async fn committed_positions(
    topic: &str,
    want: usize,
    value_at: fn(i32, i64) -> String,
) -> BTreeMap<String, usize> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = sluice_tests::kafka::client_config()
            .set("group.id", sluice_tests::unique_name("eos-reader"))
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed")
            .create()
            .unwrap();
        consumer.subscribe(&[&topic]).unwrap();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        let mut seen = 0;
        let mut quiet_since = Instant::now();
        let deadline = Instant::now() + TIMEOUT * 4;
        while Instant::now() < deadline
            && !(seen >= want && quiet_since.elapsed() > Duration::from_secs(2))
            && quiet_since.elapsed() < Duration::from_secs(8)
        {
            let Some(message) = consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = message.unwrap();
            quiet_since = Instant::now();
            seen += 1;
            let headers = message.headers().expect("sluice headers");
            let position = (0..headers.count())
                .map(|i| headers.get(i))
                .find(|h| h.key == "sluice.position")
                .and_then(|h| h.value)
                .map(|v| String::from_utf8(v.to_vec()).unwrap())
                .expect("a sluice.position header");
            // The header is Sluice's own word; the payload must be what the
            // producer wrote at that position.
            let (partition, offset) = position
                .rsplit_once('@')
                .and_then(|(tp, offset)| Some((tp.rsplit_once('-')?.1, offset)))
                .and_then(|(p, o)| Some((p.parse::<i32>().ok()?, o.parse::<i64>().ok()?)))
                .unwrap_or_else(|| panic!("a position topic-partition@offset: {position}"));
            let value = message.payload().map(String::from_utf8_lossy);
            assert_eq!(
                value.as_deref(),
                Some(value_at(partition, offset).as_str()),
                "the record at {position} carries another record's value"
            );
            *counts.entry(position).or_default() += 1;
        }
        counts
    })
    .await
    .unwrap()
}

/// Every input position of `partitions` partitions with `count` records each.
pub(crate) fn positions(topic: &str, partitions: i32, count: usize) -> Vec<String> {
    (0..partitions)
        .flat_map(|p| (0..count).map(move |o| format!("{topic}-{p}@{o}")))
        .collect()
}

/// Asserts that the output holds each input position exactly once.
pub(crate) fn assert_exactly_once(got: &BTreeMap<String, usize>, want: &[String]) {
    let twice: Vec<&String> = got
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(p, _)| p)
        .collect();
    assert!(
        twice.is_empty(),
        "{} positions written more than once, such as {:?}",
        twice.len(),
        twice.first()
    );
    let missing: Vec<&String> = want.iter().filter(|p| !got.contains_key(*p)).collect();
    assert!(
        missing.is_empty(),
        "{} positions missing, such as {:?}",
        missing.len(),
        missing.first()
    );
    assert_eq!(got.len(), want.len(), "nothing else in the output");
}

/// Runs the job once more with `available_now` into `out_topic`, checks that
/// the output holds each of the `produced` records of every partition exactly
/// once, and deletes both topics; the records in and out.
async fn catch_up_and_check(
    job: &Job,
    out_topic: &str,
    partitions: i32,
    produced: usize,
) -> (usize, usize) {
    let catch_up = job.config("");
    to_kafka(&catch_up, job, out_topic, "");
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let want = positions(&job.topic, partitions, produced);
    let got = committed_positions(out_topic, want.len(), produced_value).await;
    assert_exactly_once(&got, &want);
    delete_topic(&job.topic).await;
    delete_topic(out_topic).await;
    (want.len(), got.values().sum())
}

async fn kafka_to_kafka_through_sigkills(job: Job) {
    let topic = job.topic.clone();
    let out_topic = sluice_tests::unique_name("eosout");
    create_topic(&topic, 4).await;
    create_topic(&out_topic, 3).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 4, stop.clone());

    let streaming = job.config_with("", "processing_time = \"0s\"");
    to_kafka(&streaming, &job, &out_topic, "");
    // The window between the transaction's commit and the store's, forced: the
    // process aborts right after Kafka committed batch 2, and the next runner
    // finds batch 2 in Kafka and writes only the store's commit.
    sluice_tests::process::crash_after_sink_commit_and_resume(&streaming, 2).await;

    let mut random = Lcg::from_clock("exactly-once kafka sink");
    let before = sluice_tests::process::committed_batches(&job.progress_file());
    sluice_tests::process::kill_at_random_moments(&streaming, 20, (200, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&job.progress_file(), before, "20 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    let (records_in, records_out) = catch_up_and_check(&job, &out_topic, 4, produced).await;
    println!(
        "{records_in} records in, {records_out} read_committed out, after a forced crash and 20 kills"
    );
}

#[tokio::test]
async fn kafka_to_kafka_is_exactly_once_through_sigkills_with_the_filesystem_checkpoint() {
    kafka_to_kafka_through_sigkills(Job::new(&sluice_tests::unique_name("eosin"))).await;
}

#[tokio::test]
async fn kafka_to_kafka_is_exactly_once_through_sigkills_with_the_cassandra_store() {
    kafka_to_kafka_through_sigkills(Job::with_cassandra(&sluice_tests::unique_name("eosinc")))
        .await;
}

#[tokio::test]
async fn a_paused_runner_is_fenced_by_the_one_that_took_over() {
    let job = Job::with_cassandra(&sluice_tests::unique_name("zombie"));
    let topic = job.topic.clone();
    let out_topic = sluice_tests::unique_name("zombieout");
    create_topic(&topic, 2).await;
    create_topic(&out_topic, 2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 2, stop.clone());
    let streaming = job.config_with("", "processing_time = \"0s\"");
    to_kafka(&streaming, &job, &out_topic, "");

    let zombie = Running::spawn(&["run", "--config", streaming.to_str().unwrap()]);
    // Paused before its claim, the first runner would claim after the second
    // and be the one left running, which is not what this test is about.
    wait_for_a_reported_batch(&job.progress_file()).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    zombie.signal("-STOP");
    let successor = Running::spawn(&["run", "--config", streaming.to_str().unwrap()]);
    tokio::time::sleep(Duration::from_millis(4000)).await;
    zombie.signal("-CONT");
    let zombie = zombie.wait();
    let said = stderr(&zombie);
    assert_eq!(zombie.status.code(), Some(4), "{said}");
    assert!(
        said.contains("taken over by") || said.contains("was taken over"),
        "the message names the takeover: {said}"
    );
    successor.signal("-TERM");
    let successor = successor.wait();
    assert_eq!(successor.status.code(), Some(0), "{}", stderr(&successor));
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    catch_up_and_check(&job, &out_topic, 2, produced).await;
}

/// Waits until a runner has reported a batch in `progress`: it has claimed the
/// query by then, since the claim comes before the first plan.
async fn wait_for_a_reported_batch(progress: &Path) {
    wait_until(
        &format!("a batch reported in {}", progress.display()),
        Duration::from_secs(90),
        || std::fs::read_to_string(progress).is_ok_and(|text| text.contains('\n')),
    )
    .await;
}

/// Waits until process `pid` is stopped (state `T` in `/proc/<pid>/stat`).
async fn wait_until_stopped(pid: u32) {
    let stat = || std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    let stopped = || stat().rsplit_once(") ").map(|(_, rest)| &rest[..1] == "T") == Some(true);
    let what = format!("process {pid} stopped at its failpoint");
    wait_until(&what, Duration::from_secs(90), stopped).await;
}

#[tokio::test]
async fn a_runner_paused_before_its_sink_take_over_writes_nothing_when_it_wakes() {
    // The runner claimed the query and stopped before fencing earlier producers;
    // its successor claims the query and runs. Woken, the old runner's take-over
    // fences the successor's producer, but its claim check then stops it before
    // it writes anything, and the successor takes its sink back and goes on.
    let job = Job::with_cassandra(&sluice_tests::unique_name("sleeper"));
    let topic = job.topic.clone();
    let out_topic = sluice_tests::unique_name("sleeperout");
    create_topic(&topic, 2).await;
    create_topic(&out_topic, 2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 2, stop.clone());
    let streaming = job.config_with("", "processing_time = \"0s\"");
    to_kafka(&streaming, &job, &out_topic, "");

    let mut paused = Command::new(sluice());
    paused
        .args(["run", "--config", streaming.to_str().unwrap()])
        .env("SLUICE_FAILPOINT", "before_sink_take_over");
    let sleeper = Running::spawn_command(paused);
    wait_until_stopped(sleeper.id()).await;
    let successor = Running::spawn(&["run", "--config", streaming.to_str().unwrap()]);
    tokio::time::sleep(Duration::from_millis(4000)).await;
    sleeper.signal("-CONT");
    let sleeper = sleeper.wait();
    let said = stderr(&sleeper);
    assert_eq!(sleeper.status.code(), Some(4), "{said}");
    assert!(said.contains("was taken over by"), "{said}");
    assert!(
        !said.contains("batch 0:"),
        "the woken runner ran no batch: {said}"
    );
    tokio::time::sleep(Duration::from_millis(2000)).await;
    successor.signal("-TERM");
    let successor = successor.wait();
    let said = stderr(&successor);
    assert_eq!(successor.status.code(), Some(0), "{said}");
    assert!(said.contains("taking the sink over again"), "{said}");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    catch_up_and_check(&job, &out_topic, 2, produced).await;
}

#[tokio::test]
async fn a_transaction_timeout_above_the_brokers_maximum_is_refused_by_validate() {
    let job = Job::new(&sluice_tests::unique_name("txtimeout"));
    create_topic(&job.topic, 1).await;
    let config = job.config("");
    // The broker's transaction.max.timeout.ms is 900000 unless configured.
    to_kafka(
        &config,
        &job,
        "unused",
        "[sink.kafka]\n\"transaction.timeout.ms\" = \"3600000\"",
    );
    let output = run(&["validate", "--config", config.to_str().unwrap()]);
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("transaction.timeout.ms\" = 3600000 is above the broker's"),
        "{err}"
    );
    let owned = job.config("");
    to_kafka(
        &owned,
        &job,
        "unused",
        "[sink.kafka]\n\"transactional.id\" = \"mine\"",
    );
    let output = run(&["validate", "--config", owned.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    delete_topic(&job.topic).await;
}

#[tokio::test]
async fn aborted_transactions_upstream_are_skipped_and_an_open_one_holds_the_batch_end() {
    let job = Job::new(&sluice_tests::unique_name("upstream"));
    let topic = job.topic.clone();
    create_topic(&topic, 1).await;
    let producer: rdkafka::producer::FutureProducer = sluice_tests::kafka::client_config()
        .set("transactional.id", sluice_tests::unique_name("upstream-tx"))
        .create()
        .unwrap();
    let send = |producer: &rdkafka::producer::FutureProducer, value: String| {
        let producer = producer.clone();
        let topic = topic.clone();
        async move {
            producer
                .send(
                    FutureRecord::<str, str>::to(&topic)
                        .payload(&value)
                        .partition(0),
                    TIMEOUT,
                )
                .await
                .unwrap();
        }
    };
    producer.init_transactions(TIMEOUT).unwrap();
    for (n, commit) in [(0, true), (1, false), (2, true)] {
        producer.begin_transaction().unwrap();
        for i in 0..5 {
            send(&producer, format!("tx{n}-{i}")).await;
        }
        if commit {
            producer.commit_transaction(TIMEOUT).unwrap();
        } else {
            producer.abort_transaction(TIMEOUT).unwrap();
        }
    }
    // A transaction left open: its records are past the last stable offset.
    producer.begin_transaction().unwrap();
    for i in 0..5 {
        send(&producer, format!("open-{i}")).await;
    }
    producer.flush(TIMEOUT).unwrap();

    let started = Instant::now();
    let output = job.run("");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "an open transaction does not hold the run to its poll_timeout_ms: {:?}",
        started.elapsed()
    );
    let values: Vec<String> = job.output().into_iter().map(|(_, _, v)| v).collect();
    let committed: Vec<String> = (0..5)
        .map(|i| format!("tx0-{i}"))
        .chain((0..5).map(|i| format!("tx2-{i}")))
        .collect();
    let mut sorted = values.clone();
    sorted.sort();
    assert_eq!(
        sorted, committed,
        "the aborted and the open transaction are not read"
    );

    // Once it commits, the next run reads it.
    producer.commit_transaction(TIMEOUT).unwrap();
    let output = job.run("");
    assert!(output.status.success(), "{}", stderr(&output));
    let values: Vec<String> = job.output().into_iter().map(|(_, _, v)| v).collect();
    assert_eq!(values.len(), 15, "{values:?}");
    assert!(values.iter().any(|v| v == "open-4"));
    delete_topic(&topic).await;
}
