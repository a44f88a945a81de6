//! Group mode end to end (`docs/scale-out.md`): several `sluice run` processes
//! share a query through Kafka's consumer group and the Cassandra store, and
//! the jsonl output holds every record exactly once while they are killed,
//! paused past their session, added and stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_tests::kafka::{create_topic, delete_topic, numbered, produce, producer};
use sluice_tests::process::{Lcg, Running, eventually, run, sluice, stderr, wait_until};

use crate::exactly_once::{committed_positions, positions, produced_value, to_kafka};
use crate::runner::{Job, keep_producing_at, keep_producing_from};
use crate::status_page::{get, get_json};

/// The `[source]` lines of a query in group mode.
fn group_mode(group: &str) -> String {
    group_mode_with(group, "classic")
}

/// [`group_mode`] with the group protocol `protocol`. KIP-848's `consumer`
/// protocol takes its session and heartbeat from the broker, and librdkafka
/// refuses them in the client's configuration.
fn group_mode_with(group: &str, protocol: &str) -> String {
    let session = match protocol {
        "classic" => {
            "[source.kafka]\n\"session.timeout.ms\" = 10000\n\"heartbeat.interval.ms\" = 1000\n\n"
        }
        _ => "",
    };
    format!(
        "group_id = \"{group}\"\n\n{session}[scale_out]\nenabled = true\n\
         group_protocol = \"{protocol}\"\n"
    )
}

/// Waits until the output holds `records` records, or 120 s have passed.
async fn wait_for_output(job: &Job, records: i64) {
    eventually(Duration::from_secs(120), || {
        job.output().len() as i64 >= records
    })
    .await;
}

/// Every record of every partition once, in order, at exactly `offsets`: no
/// gap, no duplicate, nothing from before.
fn assert_exactly_once(job: &Job, partitions: i64, offsets: Range<i64>) {
    let got = job.output();
    let mut seen: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for (partition, offset, value) in &got {
        assert_eq!(value, &format!("p{partition}-{offset}"));
        seen.entry(*partition).or_default().push(*offset);
    }
    for partition in 0..partitions {
        let got = seen.remove(&partition).unwrap_or_default();
        let duplicates = got.windows(2).filter(|w| w[0] == w[1]).count();
        assert_eq!(duplicates, 0, "partition {partition} has duplicates");
        assert_eq!(
            got,
            offsets.clone().collect::<Vec<_>>(),
            "partition {partition} holds {} records, of offsets {offsets:?}",
            got.len()
        );
    }
    assert!(seen.is_empty(), "records of unknown partitions: {seen:?}");
}

/// The members that wrote output: jsonl files are `batch-<member>.<n>-<id>`.
fn writers(job: &Job) -> BTreeSet<String> {
    std::fs::read_dir(job.out())
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let generation = name.strip_prefix("batch-")?.split('-').next()?.to_owned();
            Some(generation.split('.').next()?.to_owned())
        })
        .collect()
}

/// Where `needle` first occurs in `log` from `from` on, failing the test
/// with the log if it does not.
fn position(log: &str, needle: &str, from: usize) -> usize {
    log[from..]
        .find(needle)
        .map(|at| from + at)
        .unwrap_or_else(|| panic!("no {needle:?} after byte {from} of the log:\n{log}"))
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
    wait_for_output(&job, 12 * per_partition).await;
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
    let writers = writers(&job);
    assert!(
        writers.len() >= 4,
        "each of the 4 members wrote output: {writers:?}"
    );
    assert_exactly_once(&job, 12, 0..per_partition);
    delete_topic(&topic).await;
}

#[tokio::test]
async fn group_mode_into_kafka_is_exactly_once_through_kills_and_a_pause() {
    let topic = sluice_tests::unique_name("scale_out_eos");
    let out_topic = sluice_tests::unique_name("scale_out_eosout");
    create_topic(&topic, 6).await;
    create_topic(&out_topic, 3).await;
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode(&sluice_tests::unique_name("scale_out_eos")),
        "processing_time = \"100ms\"",
    );
    to_kafka(&config, &job, &out_topic, "");
    let args = ["run", "--config", config.to_str().unwrap()];
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing_at(
        topic.clone(),
        6,
        10,
        Duration::from_millis(50),
        stop.clone(),
    );
    let began = Instant::now();
    let step = |what: &str| println!("{:>6.1} s: {what}", began.elapsed().as_secs_f64());
    let mut steady: Vec<Running> = (0..2).map(|_| Running::spawn(&args)).collect();
    tokio::time::sleep(Duration::from_secs(8)).await;
    // Members that join and die at random moments: each leaves a generation,
    // often with a transaction open or a batch planned, for the others to
    // settle under that generation's transactional id.
    let mut random = Lcg::from_clock("group mode into kafka");
    let mut killed = Vec::new();
    for kill in 0..5 {
        let mut member = Running::spawn(&args);
        // Long enough, mostly, to have joined and begun a generation.
        let lifetime = 4_000 + random.next_below(8_000);
        tokio::time::sleep(Duration::from_millis(lifetime)).await;
        assert!(member.has_exited().is_none(), "member {kill} exited early");
        step(&format!("killing joined member {kill} after {lifetime} ms"));
        member.signal("-KILL");
        killed.push(stderr(&member.wait()));
    }
    // A steady member paused past its session: the other settles its
    // generation, which fences its producer and its log.
    step("pausing steady member 0");
    steady[0].signal("-STOP");
    tokio::time::sleep(Duration::from_secs(16)).await;
    steady[0].signal("-CONT");
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    let produced = producer.await.unwrap();
    step(&format!("{produced} records per partition produced"));
    let want = positions(&topic, 6, produced);
    let mut got = committed_positions(&out_topic, want.len(), produced_value).await;
    for _ in 0..6 {
        if got.len() >= want.len() {
            break;
        }
        got = committed_positions(&out_topic, want.len(), produced_value).await;
    }
    step("caught up; stopping the members");
    for member in &mut steady {
        if member.has_exited().is_none() {
            member.signal("-TERM");
        }
    }
    let logs: Vec<(std::process::Output, String)> = steady
        .drain(..)
        .map(|member| {
            let output = member.wait();
            let log = stderr(&output);
            (output, log)
        })
        .collect();
    for (i, (_, log)) in logs.iter().enumerate() {
        std::fs::write(job.out().with_file_name(format!("member-{i}.log")), log).unwrap();
    }
    let count = |needle: &str| {
        logs.iter()
            .map(|(_, log)| log)
            .chain(&killed)
            .map(|log| log.matches(needle).count())
            .sum::<usize>()
    };
    step(&format!(
        "woken member {:?}; {} generations settled, {} pending batches replayed, {} found in Kafka",
        logs[0].0.status,
        count("settling it"),
        count("replaying the batch the generation planned"),
        count("the sink already has this batch"),
    ));
    let (paused, paused_log) = &logs[0];
    assert!(
        paused.status.success()
            || (paused.status.code() == Some(4) && paused_log.contains("taken over")),
        "the woken member: {:?}\n{paused_log}",
        paused.status
    );
    assert!(logs[1].0.status.success(), "{}", logs[1].1);
    assert!(
        logs.iter().any(|(_, log)| log.contains("settling it")),
        "a steady member settled a killed member's generation"
    );
    crate::exactly_once::assert_exactly_once(&got, &want);
    let left = generation_groups(&out_topic).await;
    assert!(left.is_empty(), "offsets groups left behind: {left:?}");
    delete_topic(&topic).await;
    delete_topic(&out_topic).await;
}

/// Runs a member of `config` that aborts right after its sink has batch 3 and
/// before its commit, then starts a second member, which settles what the
/// first left, while a producer writes 15 s more to the job's 4 partitions;
/// returns the records produced per partition and the running second member.
async fn die_after_sink_then_settle(job: &Job, config: &std::path::Path) -> (usize, Running) {
    let args = ["run", "--config", config.to_str().unwrap()];
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing_at(
        job.topic.clone(),
        4,
        10,
        Duration::from_millis(50),
        stop.clone(),
    );
    let mut command = std::process::Command::new(sluice());
    command
        .args(args)
        .env("SLUICE_FAILPOINT", "after_sink_commit:3");
    let mut first = Running::spawn_command(command);
    wait_until(
        "the failpoint ended the first member",
        Duration::from_secs(60),
        || first.has_exited().is_some(),
    )
    .await;
    let first = first.wait();
    assert!(
        stderr(&first).contains("aborting after the sink committed batch 3"),
        "{}",
        stderr(&first)
    );
    let second = Running::spawn(&args);
    tokio::time::sleep(Duration::from_secs(15)).await;
    stop.store(true, Ordering::Relaxed);
    (producer.await.unwrap(), second)
}

/// The offsets groups of generations whose exactly-once sink writes to `out_topic`.
async fn generation_groups(out_topic: &str) -> Vec<String> {
    let infix = format!("-{out_topic}-");
    tokio::task::spawn_blocking(move || {
        let client: rdkafka::consumer::BaseConsumer =
            sluice_tests::kafka::client_config().create().unwrap();
        let list =
            rdkafka::consumer::Consumer::fetch_group_list(&client, None, Duration::from_secs(10))
                .unwrap();
        list.groups()
            .iter()
            .map(|g| g.name().to_owned())
            .filter(|name| name.contains(&infix))
            .collect()
    })
    .await
    .unwrap()
}

/// Stops the member that settled a dead one, checks that it replayed the
/// dead one's pending batch, and returns its log.
fn stop_the_settler(second: Running) -> String {
    second.signal("-TERM");
    let second = second.wait();
    let log = stderr(&second);
    assert!(second.status.success(), "{log}");
    assert!(
        log.contains("replaying the batch the generation planned and did not commit"),
        "{log}"
    );
    log
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
    // The replay rewrites batch 3's file with the same records.
    let (per_partition, second) = die_after_sink_then_settle(&job, &config).await;
    wait_for_output(&job, 4 * per_partition as i64).await;
    stop_the_settler(second);
    assert_exactly_once(&job, 4, 0..per_partition as i64);
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_member_that_died_after_its_kafka_transaction_is_settled_with_its_commit_only() {
    let topic = sluice_tests::unique_name("scale_out_txn");
    let out_topic = sluice_tests::unique_name("scale_out_txnout");
    create_topic(&topic, 4).await;
    create_topic(&out_topic, 2).await;
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode(&sluice_tests::unique_name("scale_out_txn")),
        "processing_time = \"100ms\"",
    );
    to_kafka(&config, &job, &out_topic, "");
    // The settling member finds batch 3 in the generation's offsets group, so
    // it writes the store's commit only, under the dead generation's
    // transactional id, instead of producing the batch a second time.
    let (per_partition, second) = die_after_sink_then_settle(&job, &config).await;
    let want = positions(&topic, 4, per_partition);
    let got = committed_positions(&out_topic, want.len(), produced_value).await;
    assert!(
        !generation_groups(&out_topic).await.is_empty(),
        "the live generation's sink commits offsets to a group of its own"
    );
    let log = stop_the_settler(second);
    // The dead generation's group went when it was settled, the live one's
    // when it handed its partitions back at the stop.
    let left = generation_groups(&out_topic).await;
    assert!(left.is_empty(), "offsets groups left behind: {left:?}");
    assert!(
        log.contains("the sink already has this batch; writing its commit only"),
        "{log}"
    );
    crate::exactly_once::assert_exactly_once(&got, &want);
    delete_topic(&topic).await;
    delete_topic(&out_topic).await;
}

#[tokio::test]
async fn a_rebalance_during_a_long_batch_waits_for_the_batch_and_loses_nothing() {
    let topic = sluice_tests::unique_name("scale_out_long");
    create_topic(&topic, 4).await;
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode(&sluice_tests::unique_name("scale_out_long")),
        "processing_time = \"100ms\"",
    );
    let args = ["run", "--config", config.to_str().unwrap()];
    let stop = Arc::new(AtomicBool::new(false));
    // 100 records/s: the slow member keeps up with its half of them.
    let producer = keep_producing_at(
        topic.clone(),
        4,
        5,
        Duration::from_millis(200),
        stop.clone(),
    );

    // Each of this member's batches spends 4 s between its read and its sink.
    let mut command = std::process::Command::new(sluice());
    command.args(args).env("SLUICE_FAILPOINT", "slow_sink:4000");
    let mut slow = Running::spawn_command(command);
    slow.wait_for_log("is in flight for 4000 ms more", Duration::from_secs(90))
        .await;
    // A second member joins while a batch is in flight: the group takes half
    // of the partitions away from the first in the middle of it.
    let mut joining = Running::spawn(&args);
    joining
        .wait_for_log("generation starts over", Duration::from_secs(90))
        .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    stop.store(true, Ordering::Relaxed);
    let per_partition = producer.await.unwrap() as i64;
    wait_for_output(&job, 4 * per_partition).await;
    slow.signal("-TERM");
    joining.signal("-TERM");
    let (slow, joining) = (slow.wait(), joining.wait());
    let log = stderr(&slow);
    assert!(slow.status.success(), "{log}");
    assert!(joining.status.success(), "{}", stderr(&joining));

    // The revocation came inside a batch, which reached its sink and its
    // commit before the partitions were handed back.
    let revoked = position(&log, "the group takes partitions away", 0);
    let began = log[..revoked]
        .rfind("is in flight for")
        .expect("a batch began before the revocation");
    let batch = log[..began]
        .rsplit_once("batch ")
        .map(|(_, id)| id.split_whitespace().next().unwrap().to_owned())
        .unwrap();
    assert!(
        !log[began..revoked].contains("reaches its sink"),
        "batch {batch} was still in flight when the revocation came:\n{log}"
    );
    let sunk = position(&log, &format!("batch {batch} reaches its sink"), revoked);
    position(
        &log,
        "generation ended and handed its partitions back",
        sunk,
    );
    assert_eq!(writers(&job).len(), 2, "both members wrote output");
    assert_exactly_once(&job, 4, 0..per_partition);
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_member_joining_a_running_query_starts_nothing_from_earliest() {
    a_member_joins_a_running_query("classic").await;
}

#[tokio::test]
async fn a_member_joining_under_the_consumer_protocol_starts_nothing_from_earliest() {
    a_member_joins_a_running_query("consumer").await;
}

/// A second member joins a query that started at latest, under `protocol`:
/// nothing before the start is read, and the first member's page and metrics
/// follow it into its next generation over half the partitions.
async fn a_member_joins_a_running_query(protocol: &str) {
    let topic = sluice_tests::unique_name("scale_out_fresh");
    create_topic(&topic, 4).await;
    // Records from before the query began, which it is told to skip.
    let before = producer();
    for partition in 0..4 {
        produce(&before, &topic, &numbered(partition, "before", 30)).await;
    }
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &format!(
            "starting_offsets = \"latest\"\n{}",
            group_mode_with(&sluice_tests::unique_name("scale_out_fresh"), protocol)
        ),
        "processing_time = \"100ms\"",
    );
    // Each member serves its own status page, on a port of its own.
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("metrics_addr = \"127.0.0.1:0\"\n");
    std::fs::write(&config, text).unwrap();
    let args = ["run", "--config", config.to_str().unwrap()];
    let mut first = Running::spawn(&args);
    // By now the first member resolved "latest" for the query: offset 30.
    first
        .wait_for_log("generation starts over", Duration::from_secs(90))
        .await;
    let page = status_address(&mut first).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = keep_producing_from(
        topic.clone(),
        4,
        30,
        10,
        Duration::from_millis(100),
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut second = Running::spawn(&args);
    second
        .wait_for_log("generation starts over", Duration::from_secs(90))
        .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    // The first member's page outlived its first generation and shows its
    // newest one, over half the partitions.
    let member = get_json(&page, "/api/about")["runId"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_until(
        "the first member reports a batch over 2 partitions",
        Duration::from_secs(30),
        || {
            let newest = get_json(&page, "/api/progress?last=1");
            let group = &newest[0]["group"];
            group["member"] == member.as_str()
                && group["partitions"][&topic].as_array().map(Vec::len) == Some(2)
        },
    )
    .await;
    let (code, metrics) = get(&page, "/metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains(&format!("sluice_group_partitions{{member=\"{member}\"}} 2")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("sluice_group_generation{{member=\"{member}\"}}")),
        "{metrics}"
    );
    stop.store(true, Ordering::Relaxed);
    let end = producer.await.unwrap() as i64;
    wait_for_output(&job, 4 * (end - 30)).await;
    first.signal("-TERM");
    second.signal("-TERM");
    for member in [first.wait(), second.wait()] {
        assert!(member.status.success(), "{}", stderr(&member));
    }
    assert_eq!(writers(&job).len(), 2, "both members wrote output");
    // Nothing before offset 30 in any partition, the joining member's included.
    assert_exactly_once(&job, 4, 30..end);
    assert_reports_name_their_member(&job, 2);
    delete_topic(&topic).await;
}

/// The address `member` serves its status page on, from its log.
async fn status_address(member: &mut Running) -> String {
    let needle = "serving the status page on http://";
    member.wait_for_log(needle, Duration::from_secs(30)).await;
    let log = member.log_so_far();
    let from = log.find(needle).unwrap() + needle.len();
    log[from..from + log[from..].find('/').unwrap()].to_owned()
}

/// Checks that every progress report of `job` names its member, its
/// generation and the partitions it holds, that a report covers only those
/// partitions, and that `members` members reported.
fn assert_reports_name_their_member(job: &Job, members: usize) {
    let reports = job.progress();
    let mut reporting = BTreeSet::new();
    for report in &reports {
        let group = &report["group"];
        let member = group["member"].as_str().expect("a member in every report");
        let generation = group["generation"].as_str().unwrap();
        assert!(
            generation.starts_with(&format!("{member}.")),
            "{generation} is a generation of {member}"
        );
        let held: BTreeSet<(String, i64)> = group["partitions"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(topic, ps)| {
                ps.as_array()
                    .unwrap()
                    .iter()
                    .map(|p| (topic.clone(), p.as_i64().unwrap()))
            })
            .collect();
        let read: BTreeSet<(String, i64)> = report["sources"][0]["endOffset"]
            .as_object()
            .unwrap()
            .iter()
            .flat_map(|(topic, ps)| {
                ps.as_object()
                    .unwrap()
                    .keys()
                    .map(|p| (topic.clone(), p.parse().unwrap()))
            })
            .collect();
        assert_eq!(
            read, held,
            "a report covers its generation's partitions: {report}"
        );
        if report["numInputRows"].as_u64() > Some(0) {
            reporting.insert(member.to_owned());
        }
    }
    assert_eq!(
        reporting.len(),
        members,
        "members that reported rows: {reporting:?}"
    );
}

/// `sluice offsets show` of a query, as JSON; `None` while it holds no query.
fn try_show(location: &str) -> Option<serde_json::Value> {
    let output = run(&["offsets", "show", "--checkpoint", location]);
    output
        .status
        .success()
        .then(|| serde_json::from_slice(&output.stdout).unwrap())
}

/// `sluice offsets show` of a group-mode query, as JSON.
fn show(location: &str) -> serde_json::Value {
    try_show(location).unwrap_or_else(|| panic!("sluice offsets show {location} failed"))
}

/// The `partitions` of a report as (state, committed offset, owner, epoch).
fn rows(report: &serde_json::Value) -> Vec<(String, i64, Option<String>, Option<i64>)> {
    report["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            (
                row["state"].as_str().unwrap().to_owned(),
                row["committedOffset"].as_i64().unwrap(),
                row["owner"].as_str().map(str::to_owned),
                row["epoch"].as_i64(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_group_mode_query_shows_every_partition_and_moves_only_once_stopped() {
    shows_every_partition_and_moves_only_once_stopped("classic").await;
}

#[tokio::test]
async fn under_the_consumer_protocol_offsets_set_also_waits_for_no_live_member() {
    shows_every_partition_and_moves_only_once_stopped("consumer").await;
}

/// `offsets show` and `offsets set` on a group-mode query under `protocol`:
/// set is refused while a member is live or holds a partition.
async fn shows_every_partition_and_moves_only_once_stopped(protocol: &str) {
    let topic = sluice_tests::unique_name("scale_out_offsets");
    create_topic(&topic, 3).await;
    let records = producer();
    for partition in 0..3 {
        produce(
            &records,
            &topic,
            &numbered(partition, &format!("p{partition}"), 20),
        )
        .await;
    }
    let job = Job::with_cassandra(&topic);
    let config = job.config_with(
        &group_mode_with(&sluice_tests::unique_name("scale_out_offsets"), protocol),
        "processing_time = \"100ms\"",
    );
    let config = config.to_str().unwrap();
    let location = job.store_location();
    let member = Running::spawn(&["run", "--config", config]);

    // While it runs: every partition held by its generation, under the epoch
    // of that generation's log, committed to the end.
    wait_until(
        "every partition committed at 20",
        Duration::from_secs(90),
        || try_show(&location).is_some_and(|r| rows(&r).iter().all(|(_, at, _, _)| *at == 20)),
    )
    .await;
    let report = show(&location);
    assert_eq!(report["mode"], "group", "{report:#}");
    let held = rows(&report);
    assert_eq!(held.len(), 3, "{report:#}");
    for (state, _, owner, epoch) in &held {
        assert_eq!(state, "held", "{report:#}");
        assert_eq!(owner, &held[0].2, "one generation holds all: {report:#}");
        assert!(epoch.is_some_and(|e| e >= 1), "{report:#}");
    }
    let offsets = format!("{{\"{topic}\":{{\"0\":5}}}}");
    let set = |config: Option<&str>| {
        let mut args = vec![
            "offsets",
            "set",
            "--checkpoint",
            &location,
            "--offsets",
            &offsets,
        ];
        if let Some(config) = config {
            args.extend(["--config", config]);
        }
        run(&args)
    };
    let without_config = set(None);
    assert_eq!(
        without_config.status.code(),
        Some(2),
        "{}",
        stderr(&without_config)
    );
    assert!(
        stderr(&without_config).contains("add --config"),
        "{}",
        stderr(&without_config)
    );
    let running = set(Some(config));
    assert_eq!(running.status.code(), Some(4), "{}", stderr(&running));
    assert!(
        stderr(&running).contains("1 live member(s)"),
        "{}",
        stderr(&running)
    );

    // Stopped: handed back where it committed, and movable.
    member.signal("-TERM");
    let stopped = member.wait();
    assert!(stopped.status.success(), "{}", stderr(&stopped));
    let handed_back = rows(&show(&location));
    assert!(
        handed_back
            .iter()
            .all(|row| row == &("handed back".to_owned(), 20, None, None)),
        "{handed_back:?}"
    );
    let moved = set(Some(config));
    assert!(moved.status.success(), "{}", stderr(&moved));
    let after = rows(&show(&location));
    assert_eq!(after[0].1, 5, "{after:?}");
    assert_eq!((after[1].1, after[2].1), (20, 20), "{after:?}");

    // The next member reads partition 0 again from offset 5.
    let again = Running::spawn(&["run", "--config", config]);
    wait_for_output(&job, 60 + 15).await;
    again.signal("-TERM");
    let again = again.wait();
    assert!(again.status.success(), "{}", stderr(&again));
    let output = job.output();
    let twice = |p: i64, o: i64| {
        output
            .iter()
            .filter(|(q, at, _)| (*q, *at) == (p, o))
            .count()
    };
    assert_eq!(output.len(), 75, "{output:?}");
    assert!((5..20).all(|o| twice(0, o) == 2) && (0..5).all(|o| twice(0, o) == 1));
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

#[test]
fn validate_refuses_a_stateful_query_with_scale_out_as_run_does() {
    let job = Job::with_cassandra("scale_out_stateful");
    let config = job.config_with(&group_mode("g"), "processing_time = \"1s\"");
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str("\n[query]\nsql = \"SELECT key, count(*) AS n FROM source GROUP BY key\"\n");
    std::fs::write(&config, text).unwrap();
    for command in ["validate", "run"] {
        let output = run(&[command, "--config", config.to_str().unwrap()]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{command}: {}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains("stateful queries are not supported with scale_out"),
            "{command}: {}",
            stderr(&output)
        );
    }
}
