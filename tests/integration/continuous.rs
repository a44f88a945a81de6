//! The continuous trigger against the real broker: records reach the sink
//! while their epoch is still open, and SIGKILLs at random moments lose
//! nothing, with the `jsonl` sink exactly once and the `kafka` sink at least
//! once, as docs/delivery.md says.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_tests::kafka::{create_topic, delete_topic};
use sluice_tests::process::{Lcg, Running, run, stderr};

use crate::exactly_once::{committed_positions, positions, produced_value};
use crate::runner::{Job, crash_repeatedly, keep_producing};

/// Points a job's config at `out_topic` through the at-least-once kafka sink.
fn to_kafka_at_least_once(config: &Path, job: &Job, out_topic: &str) {
    let text = std::fs::read_to_string(config).unwrap();
    let jsonl = format!("type = \"jsonl\"\npath = \"{}\"", job.out().display());
    assert!(text.contains(&jsonl), "{text}");
    let kafka = format!("type = \"kafka\"\ntopic = \"{out_topic}\"");
    std::fs::write(config, text.replace(&jsonl, &kafka)).unwrap();
}

#[tokio::test]
async fn continuous_epochs_keep_jsonl_exactly_once_through_sigkills() {
    crash_repeatedly(
        Job::new(&sluice_tests::unique_name("contcrash")),
        "continuous = \"300ms\"",
    )
    .await;
}

#[tokio::test]
async fn records_reach_kafka_while_their_epoch_is_open() {
    let job = Job::new(&sluice_tests::unique_name("contflow"));
    let out_topic = sluice_tests::unique_name("contflowout");
    create_topic(&job.topic, 2).await;
    create_topic(&out_topic, 2).await;
    // An epoch far longer than the test: nothing is planned while it runs.
    let config = job.config_with("", "continuous = \"10min\"");
    to_kafka_at_least_once(&config, &job, &out_topic);
    let running = Running::spawn(&["run", "--config", config.to_str().unwrap()]);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing(job.topic.clone(), 2, stop.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let produced = producer.await.unwrap();
    let want = positions(&job.topic, 2, produced);
    let started = Instant::now();
    let got = committed_positions(&out_topic, want.len(), produced_value).await;
    let offsets = job.checkpoint().join("offsets");
    let planned = std::fs::read_dir(&offsets).map_or(0, |d| d.count());
    assert_eq!(
        planned,
        0,
        "no epoch was planned in {}, yet the records are in Kafka",
        offsets.display()
    );
    let missing: Vec<&String> = want.iter().filter(|p| !got.contains_key(*p)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} records did not reach Kafka within {:?} while the epoch was open, such as {:?}",
        missing.len(),
        want.len(),
        started.elapsed(),
        missing.first()
    );
    // A stop closes the epoch: its plan and commit are written.
    running.signal("-TERM");
    let output = running.wait();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        job.checkpoint().join("commits").join("0").exists(),
        "the stop committed the epoch as batch 0: {}",
        stderr(&output)
    );
    delete_topic(&job.topic).await;
    delete_topic(&out_topic).await;
}

#[tokio::test]
async fn continuous_into_kafka_loses_nothing_through_sigkills() {
    let job = Job::new(&sluice_tests::unique_name("contkafka"));
    let out_topic = sluice_tests::unique_name("contkafkaout");
    create_topic(&job.topic, 4).await;
    create_topic(&out_topic, 3).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing(job.topic.clone(), 4, stop.clone());
    let streaming = job.config_with("", "continuous = \"300ms\"");
    to_kafka_at_least_once(&streaming, &job, &out_topic);
    let mut random = Lcg::from_clock("continuous into kafka");
    let before = sluice_tests::process::committed_batches(&job.progress_file());
    sluice_tests::process::kill_at_random_moments(&streaming, 12, (150, 700), &mut random).await;
    sluice_tests::process::assert_committed_since(&job.progress_file(), before, "12 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer.await.unwrap();

    let catch_up = job.config("");
    to_kafka_at_least_once(&catch_up, &job, &out_topic);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let want = positions(&job.topic, 4, produced);
    let got = committed_positions(&out_topic, want.len(), produced_value).await;
    let missing: Vec<&String> = want.iter().filter(|p| !got.contains_key(*p)).collect();
    assert!(
        missing.is_empty(),
        "{} positions lost, such as {:?}",
        missing.len(),
        missing.first()
    );
    let extra: Vec<&String> = got.keys().filter(|p| !want.contains(p)).collect();
    assert!(
        extra.is_empty(),
        "records that were never produced: {extra:?}"
    );
    let duplicates: usize = got.values().map(|n| n - 1).sum();
    println!(
        "{} records in, {} out after 12 kills: {duplicates} duplicates, as at least once allows",
        want.len(),
        got.values().sum::<usize>()
    );
    delete_topic(&job.topic).await;
    delete_topic(&out_topic).await;
}
