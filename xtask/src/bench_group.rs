//! `cargo xtask bench scale-out`: group mode (`docs/scale-out.md`) measured
//! against itself on this machine.
//!
//! - **Scaling**: a CPU-bound SQL transform over a filled 12-partition topic,
//!   run by one process and by two processes of one group, alternately, each
//!   run a fresh query and group. The rate is taken while every process runs
//!   its last generation, from the batches' own times in their progress
//!   reports, so joining the group and the last stragglers do not count.
//! - **Rebalance pause**: two members over a backlog that no batch catches up
//!   with, and a third that joins and leaves (SIGTERM) again and again, for
//!   each group protocol. A partition's pause in a rebalance is the longest
//!   time between two of its batches reaching the sink; outside rebalances
//!   that is the trigger interval.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::{build_release, median, percentile, replace_section, uuid_like};
use crate::bench_scale::progress_lines;

const BOOTSTRAP: &str = "127.0.0.1:9092";
const PARTITIONS: u32 = 12;
/// The transform of the scaling runs: hashing 64 copies of each value costs
/// far more than reading it, as a parsing or scoring step would.
const CPU_BOUND_SQL: &str =
    "SELECT partition, offset, sha512(repeat(CAST(value AS STRING), 64)) AS digest FROM source";

/// What `bench scale-out` measures.
pub struct ScaleOutArgs {
    /// Records in the scaling topic.
    pub records: u64,
    /// Scaling runs per process count.
    pub runs: usize,
    /// Joins and leaves of the third member, per protocol.
    pub rebalances: usize,
}

impl ScaleOutArgs {
    pub fn parse(args: &[String]) -> Result<ScaleOutArgs> {
        let mut parsed = ScaleOutArgs {
            records: 2_000_000,
            runs: 3,
            rebalances: 10,
        };
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let value = it.next().with_context(|| format!("{flag} needs a value"))?;
            let number = value
                .parse::<u64>()
                .with_context(|| format!("{flag} {value:?} is not a number"))?;
            match flag.as_str() {
                "--records" => parsed.records = number,
                "--runs" => parsed.runs = usize::try_from(number)?.max(1),
                "--rebalances" => parsed.rebalances = usize::try_from(number)?.max(1),
                other => bail!("unknown option {other}: use --records, --runs, --rebalances"),
            }
        }
        Ok(parsed)
    }
}

/// One member's configuration: the same for every member of a run but for
/// its progress file, which keeps each member's reports apart.
struct Member<'a> {
    topic: &'a str,
    query: &'a str,
    protocol: &'a str,
    sql: Option<&'a str>,
    max_per_trigger: u64,
}

impl Member<'_> {
    fn write(&self, dir: &Path, index: usize) -> Result<PathBuf> {
        let config = dir.join(format!("member-{index}.toml"));
        // The classic protocol learns of a rebalance at its next heartbeat;
        // KIP-848's heartbeat interval is the broker's to set.
        let kafka = match self.protocol {
            "classic" => "\"session.timeout.ms\" = 10000\n\"heartbeat.interval.ms\" = 1000\n",
            _ => "",
        };
        let sql = self
            .sql
            .map(|sql| format!("[query]\nsql = \"{sql}\"\n\n"))
            .unwrap_or_default();
        fs::write(
            &config,
            format!(
                "[source]\nbootstrap_servers = \"{BOOTSTRAP}\"\nsubscribe = [\"{topic}\"]\n\
                 starting_offsets = \"earliest\"\ngroup_id = \"{query}\"\n\
                 max_offsets_per_trigger = {max}\n\n[source.kafka]\n{kafka}\n\
                 [scale_out]\nenabled = true\ngroup_protocol = \"{protocol}\"\n\n{sql}\
                 [checkpoint]\nlocation = \"cassandra://127.0.0.1:9042/sluice_bench?query={query}\"\n\
                 replication = \"{{'class': 'SimpleStrategy', 'replication_factor': 1}}\"\n\n\
                 [trigger]\nprocessing_time = \"100ms\"\n\n[sink]\ntype = \"discard\"\n\n\
                 [progress]\nfile = \"{progress}\"\n",
                topic = self.topic,
                query = self.query,
                max = self.max_per_trigger,
                protocol = self.protocol,
                progress = dir
                    .join(format!("member-{index}"))
                    .join("progress.jsonl")
                    .display(),
            ),
        )?;
        fs::create_dir_all(dir.join(format!("member-{index}")))?;
        Ok(config)
    }
}

fn spawn(sluice: &Path, config: &Path, log: &Path) -> Result<Child> {
    Command::new(sluice)
        .args(["run", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(fs::File::create(log)?)
        .spawn()
        .context("starting sluice run")
}

/// Asks `child` to stop as a supervisor would, and waits for it.
fn stop(child: &mut Child, what: &str) -> Result<()> {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    let status = child.wait()?;
    if !status.success() {
        bail!("{what} exited with {status}");
    }
    Ok(())
}

/// Milliseconds since the epoch of a progress report's `timestamp`, such as
/// `2026-12-04T05:04:01.299Z`.
fn epoch_millis(timestamp: &str) -> Option<i64> {
    let (date, time) = timestamp.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, min, s) = (t.next()??, t.next()??, t.next()??);
    let millis: i64 = format!("{fraction:0<3}")[..3].parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + min) * 60_000 + s * 1000 + millis)
}

/// A batch as its progress report tells it.
struct Batch {
    /// When its trigger ended: its output had reached the sink.
    end_ms: i64,
    /// The run (a generation) it belongs to.
    run: String,
    rows: u64,
    /// The partitions it read records of.
    partitions: Vec<u32>,
}

fn batches(dirs: &[PathBuf]) -> Vec<Batch> {
    let mut all = Vec::new();
    for dir in dirs {
        for report in progress_lines(dir) {
            let Some(start) = report["timestamp"].as_str().and_then(epoch_millis) else {
                continue;
            };
            let took = report["durationMs"]["triggerExecution"]
                .as_i64()
                .unwrap_or(0);
            let mut partitions = Vec::new();
            for source in report["sources"].as_array().into_iter().flatten() {
                let starts = source["startOffset"].as_object().into_iter().flatten();
                for (topic, offsets) in starts {
                    for (p, from) in offsets.as_object().into_iter().flatten() {
                        let to = &source["endOffset"][topic][p];
                        if to.as_i64() > from.as_i64() {
                            partitions.extend(p.parse::<u32>());
                        }
                    }
                }
            }
            all.push(Batch {
                end_ms: start + took,
                run: report["runId"].as_str().unwrap_or_default().to_owned(),
                rows: report["numInputRows"].as_u64().unwrap_or(0),
                partitions,
            });
        }
    }
    all.sort_by_key(|b| b.end_ms);
    all
}

/// Records per second while every member ran its last generation: from the
/// first batch of the last of them to start, to the last batch of the first
/// of them to run dry. Joining the group, the rebalances as members join and
/// the stragglers at the end do not count.
fn steady_rate(members: &[Vec<Batch>]) -> Option<f64> {
    let t0 = members
        .iter()
        .map(|m| {
            let last = &m.last()?.run;
            m.iter().find(|b| &b.run == last).map(|b| b.end_ms)
        })
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .max()?;
    let t1 = members.iter().map(|m| m.last().map(|b| b.end_ms)).min()??;
    let rows: u64 = members
        .iter()
        .flatten()
        .filter(|b| b.end_ms > t0 && b.end_ms <= t1)
        .map(|b| b.rows)
        .sum();
    (t1 > t0).then(|| rows as f64 * 1000.0 / (t1 - t0) as f64)
}

fn fill(tool: &Path, topic: &str, records: u64) -> Result<()> {
    let status = Command::new(tool)
        .args(["fill", BOOTSTRAP, topic])
        .arg(PARTITIONS.to_string())
        .arg(records.to_string())
        .arg("100")
        .status()
        .context("running bench_tool fill")?;
    if !status.success() {
        bail!("filling {topic} failed");
    }
    Ok(())
}

fn fresh(dir: PathBuf) -> Result<PathBuf> {
    if dir.exists() {
        fs::remove_dir_all(&dir)?;
    }
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// One scaling run of `members` processes over `topic`: its rate.
fn scaling_run(
    sluice: &Path,
    dir: &Path,
    topic: &str,
    records: u64,
    members: usize,
) -> Result<f64> {
    let query = format!("scale{}", uuid_like().replace('-', ""));
    let member = Member {
        topic,
        query: &query,
        protocol: "classic",
        sql: Some(CPU_BOUND_SQL),
        max_per_trigger: 20_000,
    };
    let mut children = Vec::new();
    let mut dirs = Vec::new();
    for i in 0..members {
        let config = member.write(dir, i)?;
        children.push(spawn(
            sluice,
            &config,
            &dir.join(format!("member-{i}.log")),
        )?);
        dirs.push(dir.join(format!("member-{i}")));
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    let read = loop {
        let read: u64 = batches(&dirs).iter().map(|b| b.rows).sum();
        if read >= records {
            break read;
        }
        for child in &mut children {
            if let Some(status) = child.try_wait()? {
                bail!("a member exited early with {status}; see {}", dir.display());
            }
        }
        if Instant::now() > deadline {
            bail!("{members} member(s) read {read} of {records} records in 600 s");
        }
        sleep(Duration::from_millis(200));
    };
    for (i, child) in children.iter_mut().enumerate() {
        stop(child, &format!("member {i} of {}", dir.display()))?;
    }
    if read != records {
        bail!("{members} member(s) read {read} records of {records}: a batch ran twice");
    }
    let each: Vec<Vec<Batch>> = dirs
        .iter()
        .map(|d| batches(std::slice::from_ref(d)))
        .collect();
    steady_rate(&each).with_context(|| format!("no rate from the progress in {}", dir.display()))
}

/// A partition's longest pause per rebalance: for each event, the longest
/// time between two batches over the partition where the second ended before
/// the next event.
fn pauses(batches: &[Batch], events: &[i64]) -> Vec<f64> {
    let mut last: BTreeMap<u32, i64> = BTreeMap::new();
    // (event, partition) -> longest pause
    let mut longest: BTreeMap<(usize, u32), i64> = BTreeMap::new();
    for batch in batches {
        let event = events.partition_point(|&e| e <= batch.end_ms);
        for &p in &batch.partitions {
            if let Some(previous) = last.insert(p, batch.end_ms)
                && event > 0
            {
                let pause = longest.entry((event - 1, p)).or_default();
                *pause = (*pause).max(batch.end_ms - previous);
            }
        }
    }
    longest.into_values().map(|ms| ms as f64 / 1000.0).collect()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Two members over `topic`'s backlog and a third that joins and leaves
/// `rebalances` times: every partition's pause per rebalance.
fn rebalance_run(
    sluice: &Path,
    dir: &Path,
    topic: &str,
    protocol: &str,
    rebalances: usize,
) -> Result<Vec<f64>> {
    let query = format!("pause{}", uuid_like().replace('-', ""));
    // 24,000 records/s for the two: the backlog outlasts the run.
    let member = Member {
        topic,
        query: &query,
        protocol,
        sql: None,
        max_per_trigger: 1_200,
    };
    let dirs: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("member-{i}"))).collect();
    let configs: Vec<PathBuf> = (0..3)
        .map(|i| member.write(dir, i))
        .collect::<Result<_>>()?;
    let log = |i: usize, n: usize| dir.join(format!("member-{i}.{n}.log"));
    let mut steady = vec![
        spawn(sluice, &configs[0], &log(0, 0))?,
        spawn(sluice, &configs[1], &log(1, 0))?,
    ];
    sleep(Duration::from_secs(10));
    let mut events = Vec::new();
    for n in 0..rebalances {
        events.push(now_ms());
        let mut third = spawn(sluice, &configs[2], &log(2, n))?;
        sleep(Duration::from_secs(8));
        events.push(now_ms());
        stop(
            &mut third,
            &format!("the joining member ({})", log(2, n).display()),
        )?;
        sleep(Duration::from_secs(8));
        for child in &mut steady {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "a steady member exited with {status}; see {}",
                    dir.display()
                );
            }
        }
    }
    for (i, child) in steady.iter_mut().enumerate() {
        stop(child, &format!("member {i} ({})", log(i, 0).display()))?;
    }
    Ok(pauses(&batches(&dirs), &events))
}

pub fn scale_out(root: &Path, args: &ScaleOutArgs) -> Result<()> {
    let (sluice, tool) = build_release(root)?;
    let work = root.join("target").join("bench").join("scale-out");
    let scaling_topic = format!("sluice-scale-{}", uuid_like());
    fill(&tool, &scaling_topic, args.records)?;
    let mut rates: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut ratios = Vec::new();
    for run in 0..args.runs {
        let mut pair = BTreeMap::new();
        for members in [1, 2] {
            let dir = fresh(work.join(format!("scaling-{members}-{run}")))?;
            let rate = scaling_run(&sluice, &dir, &scaling_topic, args.records, members)?;
            println!("run {run}: {members} process(es): {rate:.0} records/s");
            rates.entry(members).or_default().push(rate);
            pair.insert(members, rate);
        }
        ratios.push(pair[&2] / pair[&1]);
        println!("run {run}: 2 over 1: {:.2}", pair[&2] / pair[&1]);
    }

    // A backlog for 24,000 records/s through every rebalance run.
    let seconds = 20 + 16 * args.rebalances as u64;
    let pause_topic = format!("sluice-pause-{}", uuid_like());
    fill(&tool, &pause_topic, 2 * 24_000 * seconds)?;
    let mut rebalance = Vec::new();
    for protocol in ["classic", "consumer"] {
        let dir = fresh(work.join(format!("pause-{protocol}")))?;
        let pauses = rebalance_run(&sluice, &dir, &pause_topic, protocol, args.rebalances)?;
        let (p50, p99) = (
            percentile(pauses.clone(), 0.5),
            percentile(pauses.clone(), 0.99),
        );
        let max = pauses.iter().copied().fold(0.0, f64::max);
        println!("{protocol}: pause p50 {p50:.2} s, p99 {p99:.2} s, max {max:.2} s");
        rebalance.push(json!({
            "protocol": protocol, "p50_s": p50, "p99_s": p99, "max_s": max,
            "samples": pauses.len(),
        }));
    }

    let command = format!(
        "cargo xtask bench scale-out --records {} --runs {} --rebalances {}",
        args.records, args.runs, args.rebalances
    );
    let report = json!({
        "command": command,
        "sql": CPU_BOUND_SQL,
        "rates": rates.iter().map(|(m, r)| (m.to_string(), json!(r))).collect::<serde_json::Map<_, _>>(),
        "ratios": ratios,
        "rebalance": rebalance,
    });
    fs::write(
        work.join("results.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    replace_section(
        &root.join("docs").join("benchmarks.md"),
        "scale-out",
        &table(&command, args, &rates, &ratios, &rebalance),
    )
}

fn table(
    command: &str,
    args: &ScaleOutArgs,
    rates: &BTreeMap<usize, Vec<f64>>,
    ratios: &[f64],
    rebalance: &[Value],
) -> String {
    let rate = |m: usize| median(rates.get(&m).cloned().unwrap_or_default());
    let list = |v: &[f64]| {
        v.iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut text = format!(
        "Measured with `{command}`, group mode over the Cassandra store, the discard sink.\n\n\
         **Scaling.** {records} records of 100 bytes in {PARTITIONS} partitions, transformed by \
         `{CPU_BOUND_SQL}`, read by one process and by two of one group, alternately, each run a \
         fresh query; the rate while every process ran its last generation (from the first batch of \
         the last to start to the last batch of the first to run dry), from the batches' own times.\n\n\
         | processes | records/s (median) |\n| --- | --- |\n\
         | 1 | {one:.0} |\n| 2 | {two:.0} |\n\n\
         Two over one, per pair of runs: {ratios} (median **{ratio:.2}**).\n\n\
         **Rebalance pause.** Two members over a backlog, 1,200 records per 100 ms trigger each, \
         and a third that joins and leaves (SIGTERM) {rebalances} times: {events} rebalances. A \
         partition's pause is the longest time between two of its batches reaching the sink \
         around a rebalance (outside one, the 100 ms trigger). The classic protocol runs with \
         `heartbeat.interval.ms` 1000; KIP-848's heartbeat is the broker's default.\n\n\
         | protocol | p50 s | p99 s | max s | partition pauses |\n| --- | --- | --- | --- | --- |\n",
        records = args.records,
        one = rate(1),
        two = rate(2),
        ratios = list(ratios),
        ratio = median(ratios.to_vec()),
        rebalances = args.rebalances,
        events = 2 * args.rebalances,
    );
    for row in rebalance {
        let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        text.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {} |\n",
            row["protocol"].as_str().unwrap_or_default(),
            f("p50_s"),
            f("p99_s"),
            f("max_s"),
            row["samples"]
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_timestamps_are_read_as_epoch_milliseconds() {
        assert_eq!(epoch_millis("1970-01-01T00:00:00.000Z"), Some(0));
        assert_eq!(
            epoch_millis("2026-12-04T05:04:01.299Z"),
            Some(1_796_360_641_299)
        );
        assert_eq!(epoch_millis("2000-03-01T00:00:01Z"), Some(951_868_801_000));
        assert_eq!(epoch_millis("yesterday"), None);
    }

    #[test]
    fn a_pause_is_the_longest_gap_of_a_partition_after_each_event() {
        let batch = |end_ms, partitions: &[u32]| Batch {
            end_ms,
            run: String::new(),
            rows: 1,
            partitions: partitions.to_vec(),
        };
        let batches = [
            batch(100, &[0, 1]),
            batch(200, &[0, 1]),
            // Event at 250: partition 1 moves and pauses 1.3 s.
            batch(300, &[0]),
            batch(1500, &[1]),
            batch(1600, &[0, 1]),
        ];
        let mut got = pauses(&batches, &[250]);
        got.sort_by(f64::total_cmp);
        assert_eq!(got, vec![1.3, 1.3]);
    }
}
