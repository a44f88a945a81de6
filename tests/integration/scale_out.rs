//! Group mode end to end (`docs/scale-out.md`): several `sluice run` processes
//! share a query through Kafka's consumer group and the Cassandra store, and
//! the jsonl output holds every record exactly once while they are killed,
//! paused past their session, added and stopped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_tests::kafka::{create_topic, delete_topic};
use sluice_tests::process::{Running, run, stderr};

use crate::runner::{Job, keep_producing_at};

/// The `[source]` lines of a query in group mode.
fn group_mode(group: &str) -> String {
    format!(
        "group_id = \"{group}\"\n\n[source.kafka]\n\"session.timeout.ms\" = 10000\n\
         \"heartbeat.interval.ms\" = 1000\n\n[scale_out]\nenabled = true\n"
    )
}

/// Waits until the output holds `per_partition` records of each of
/// `partitions`, or 120 s have passed.
async fn wait_for_output(job: &Job, partitions: i64, per_partition: i64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if job.output().len() as i64 >= partitions * per_partition {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Every record of every partition once, in order: no gap, no duplicate.
fn assert_exactly_once(job: &Job, partitions: i64, per_partition: i64) {
    let got = job.output();
    let mut seen: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (partition, offset, value) in &got {
        assert_eq!(value, &format!("p{partition}-{offset}"));
        seen.entry(*partition).or_default().push(*offset);
    }
    for partition in 0..partitions {
        let offsets = seen.remove(&partition).unwrap_or_default();
        let duplicates = offsets.windows(2).filter(|w| w[0] == w[1]).count();
        assert_eq!(duplicates, 0, "partition {partition} has duplicates");
        assert_eq!(
            offsets,
            (0..per_partition).collect::<Vec<_>>(),
            "partition {partition} holds {} of {per_partition} records",
            offsets.len()
        );
    }
    assert!(seen.is_empty(), "records of unknown partitions: {seen:?}");
}

#[tokio::test]
async fn members_killed_paused_added_and_removed_keep_the_output_exactly_once() {
    let topic = sluice_tests::unique_name("scale_out");
    create_topic(&topic, 12).await;
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode(&sluice_tests::unique_name("scale_out")),
        "processing_time = \"100ms\"",
    );
    let args = ["run", "--config", config.to_str().unwrap()];
    let stop = Arc::new(AtomicBool::new(false));
    // About 2,400 records/s, which debug builds on a loaded machine keep up with.
    let producer = keep_producing_at(
        topic.clone(),
        12,
        10,
        Duration::from_millis(50),
        stop.clone(),
    );

    let began = Instant::now();
    let step = |what: &str| println!("{:>6.1} s: {what}", began.elapsed().as_secs_f64());
    let mut members: Vec<Running> = (0..3).map(|_| Running::spawn(&args)).collect();
    tokio::time::sleep(Duration::from_secs(8)).await;

    // One dies: after its session its partitions go to the others, which
    // settle what it left.
    step("killing member 0");
    members[0].signal("-KILL");
    tokio::time::sleep(Duration::from_secs(14)).await;
    // A fourth joins a running query.
    step("starting member 3");
    members.push(Running::spawn(&args));
    tokio::time::sleep(Duration::from_secs(8)).await;
    // One is paused past its session and woken.
    step("pausing member 1");
    members[1].signal("-STOP");
    tokio::time::sleep(Duration::from_secs(16)).await;
    members[1].signal("-CONT");
    tokio::time::sleep(Duration::from_secs(5)).await;
    step("down to one");
    for member in [1, 2] {
        if members[member].has_exited().is_none() {
            members[member].signal("-TERM");
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    let per_partition = producer.await.unwrap() as i64;
    step(&format!("{per_partition} records per partition produced"));
    wait_for_output(&job, 12, per_partition).await;
    step("caught up; stopping the last member");
    members[3].signal("-TERM");

    let outputs: Vec<_> = members
        .into_iter()
        .enumerate()
        .map(|(i, member)| {
            let output = member.wait();
            step(&format!("member {i} exited: {:?}", output.status));
            output
        })
        .collect();
    let logs: Vec<String> = outputs.iter().map(stderr).collect();
    // Kept beside the output for whoever looks into a failure.
    for (i, log) in logs.iter().enumerate() {
        std::fs::write(job.out().with_file_name(format!("member-{i}.log")), log).unwrap();
    }
    let mut failed = Vec::new();
    for (i, (output, log)) in outputs.iter().zip(&logs).enumerate() {
        let fine = match i {
            0 => true,
            // Woken after its partitions moved: it either found nothing of
            // them in flight, or was refused its commit and stopped.
            1 => {
                output.status.success()
                    || (output.status.code() == Some(4) && log.contains("taken over"))
            }
            _ => output.status.success(),
        };
        if !fine {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            failed.push(format!(
                "member {i}: {:?}\n{}",
                output.status,
                tail.join("\n")
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
    assert!(
        logs.iter().any(|log| log.contains("settling it")),
        "some member settled the killed member's generation"
    );
    // Every member wrote batches of its own: the partitions were shared.
    let writers: std::collections::BTreeSet<String> = std::fs::read_dir(job.out())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let generation = name.strip_prefix("batch-")?.split('-').next()?.to_owned();
            Some(generation.split('.').next()?.to_owned())
        })
        .collect();
    assert!(
        writers.len() >= 4,
        "each of the 4 members wrote output: {writers:?}"
    );
    assert_exactly_once(&job, 12, per_partition);
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_member_that_died_between_its_sink_and_its_commit_is_replayed_by_the_next() {
    let topic = sluice_tests::unique_name("scale_out_replay");
    create_topic(&topic, 4).await;
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode(&sluice_tests::unique_name("scale_out_replay")),
        "processing_time = \"100ms\"",
    );
    let args = ["run", "--config", config.to_str().unwrap()];
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing_at(
        topic.clone(),
        4,
        10,
        Duration::from_millis(50),
        stop.clone(),
    );

    // The first member dies right after batch 3 reached the jsonl files and
    // before its commit: its plan is left uncommitted.
    let mut command = std::process::Command::new(sluice_tests::process::sluice());
    command
        .args(args)
        .env("SLUICE_FAILPOINT", "after_sink_commit:3");
    let mut first = Running::spawn_command(command);
    // Waited for without blocking the producer, which runs on this thread.
    let deadline = Instant::now() + Duration::from_secs(60);
    while first.has_exited().is_none() {
        assert!(
            Instant::now() < deadline,
            "the failpoint did not end the first member"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = first.wait();
    assert!(
        stderr(&first).contains("aborting after the sink committed batch 3"),
        "{}",
        stderr(&first)
    );

    // The next member settles its generation by replaying that batch, which
    // rewrites the same file with the same records.
    let second = Running::spawn(&args);
    tokio::time::sleep(Duration::from_secs(15)).await;
    stop.store(true, Ordering::Relaxed);
    let per_partition = producer.await.unwrap() as i64;
    wait_for_output(&job, 4, per_partition).await;
    second.signal("-TERM");
    let second = second.wait();
    let log = stderr(&second);
    assert!(second.status.success(), "{log}");
    assert!(
        log.contains("replaying the batch the generation planned and did not commit"),
        "{log}"
    );
    assert_exactly_once(&job, 4, per_partition);
    delete_topic(&topic).await;
}

#[test]
fn group_mode_needs_the_cassandra_store_and_a_group() {
    let job = Job::new("scale_out_refused");
    let config = job.config_with(&group_mode("g"), "processing_time = \"1s\"");
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("scale_out needs a cassandra:// checkpoint.location"),
        "{}",
        stderr(&output)
    );

    let job = Job::with_cassandra("scale_out_refused");
    let config = job.config_with("[scale_out]\nenabled = true\n", "processing_time = \"1s\"");
    let output = run(&["validate", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("scale_out needs source.group_id"),
        "{}",
        stderr(&output)
    );
}
