//! `cargo xtask`: Sluice's developer tasks.
//!
//! - `up`, `down`, `status`: the dev environment, a real Kafka broker and a real
//!   Cassandra node on loopback (see `devenv`).
//! - `test [ARGS]`: `up --secure`, `cargo test --workspace ARGS`, then stop what `up` started.
//! - `ci`: the same, with `cargo fmt --check`, clippy and `cargo doc` (warnings
//!   denied) before the tests and `spark-compat` after them.
//! - `spark-compat`: fetch Spark's jars and run the tests in which Spark's own
//!   checkpoint classes read and write checkpoints beside Sluice.
//! - `demo [--seconds N] [--members N] [--sink delta]`: the main job end to
//!   end: `up`, a producer of sample orders, and `sluice run` on
//!   `examples/demo.toml` (its windows into a Delta table with `--sink delta`),
//!   or N processes of `examples/demo-scale-out.toml` sharing one query.

mod bench;
mod bench_group;
mod bench_latency;
mod bench_scale;
mod cassandra;
mod devenv;
mod fuzz;
mod kafka;
mod probe;
mod process;
mod service;
#[cfg(test)]
mod tidy;
mod tls;
mod tools;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

const USAGE: &str = "\
Usage: cargo xtask <task>

Tasks:
  up [SERVER...] [--secure]
                start Kafka (127.0.0.1:9092, and SASL_SSL on 9094) and Cassandra (127.0.0.1:9042),
                or only those named (kafka, cassandra, cassandra-secure), and wait until they
                answer; --secure adds a Cassandra node with TLS and passwords (127.0.0.1:9142);
                certificates and users are in target/dev-env/tls
  down [SERVER] stop the servers that `up` started, or only the one named
  kill [SERVER] SIGKILL them instead, as a crash would (for fault tests)
  status        show which servers run, their memory, and whether they answer
  test [ARGS]   up --secure, cargo test --workspace [ARGS], then stop what up started
  ci            up, cargo fmt --check, cargo clippy -D warnings, cargo doc, cargo test, spark-compat,
                then stop what up started
  demo [--seconds N] [--members N] [--sink delta]
                up, keep producing sample orders to demo-orders, and run sluice on
                examples/demo.toml (until Ctrl-C, or for N seconds); with --members,
                N processes share examples/demo-scale-out.toml in group mode, and
                with --seconds the last stops half way
  bench [--records N] [--partitions P] [--value-bytes B] [--runs R]
                Sluice end to end against a plain rdkafka consumer on the same topic;
                writes target/bench/results.json and docs/benchmarks.md
  bench partitions [--records N] [--partitions 8,256,1024] [--runs R]
                   [--producers 16384,1000000,1000000:lz4,1000000:zstd]
                the same over several partition counts and producers (batch.size and
                compression.type), at the default batch size and 10,000 offsets per
                trigger, with both stores: ratios, read amplification and peak RSS
  bench latency [--rates 100,10000,100000] [--seconds N] [--warm-up N] [--partitions P] [--runs N] [--only NAME]
                send-to-visible latency with processing_time = \"0s\", to jsonl and to the kafka
                sink, with both stores, beside Kafka's own latency in the same run
  bench scale-out [--records N] [--runs R] [--rebalances K]
                group mode: a CPU-bound SQL transform by 1 and by 2 processes, and the
                pause of every partition while a third member joins and leaves, per protocol
  bench soak [--batches N] [--store filesystem|cassandra]
                100,000 tiny batches: batch cost at the start and the end, checkpoint
                size and RSS over time
  fuzz [--seconds N] [TARGET...]
                run each cargo fuzz target (fuzz/) for N seconds (60) on nightly, after its
                fixed crashes; targets: checkpoint_files, spark_offsets, config_toml, state_file
  spark-compat  fetch Spark's jars (about 290 MB, once) and check that Spark and Sluice read each
                other's checkpoints
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let (task, rest) = match args.split_first() {
        Some((task, rest)) => (task.as_str(), rest),
        None => {
            print!("{USAGE}");
            return Ok(());
        }
    };
    match task {
        "up" => devenv::up_only(&root, &devenv::Kind::parse_list(rest, devenv::PLAIN)?).map(|_| ()),
        "down" => devenv::down(&root, &devenv::Kind::parse_list(rest, devenv::ALL)?),
        "kill" => devenv::kill(&root, &devenv::Kind::parse_list(rest, devenv::ALL)?),
        "status" => devenv::status(&root),
        "test" => with_dev_env(&root, devenv::ALL, || cargo_test(&root, rest)),
        "ci" => ci(&root, rest),
        "spark-compat" => spark_compat(&root),
        "fuzz" => fuzz::run(&root, &fuzz::FuzzArgs::parse(rest)?),
        "demo" => demo(&root, rest),
        "bench" => match rest.split_first() {
            Some((mode, rest)) if mode == "partitions" => {
                let args = bench_scale::SweepArgs::parse(rest)?;
                with_dev_env(&root, devenv::PLAIN, || {
                    bench_scale::partitions(&root, &args)
                })
            }
            Some((mode, rest)) if mode == "latency" => {
                let args = bench_latency::LatencyArgs::parse(rest)?;
                with_dev_env(&root, devenv::PLAIN, || {
                    bench_latency::latency(&root, &args)
                })
            }
            Some((mode, rest)) if mode == "scale-out" => {
                let args = bench_group::ScaleOutArgs::parse(rest)?;
                with_dev_env(&root, devenv::PLAIN, || {
                    bench_group::scale_out(&root, &args)
                })
            }
            Some((mode, rest)) if mode == "soak" => {
                let args = bench_scale::SoakArgs::parse(rest)?;
                with_dev_env(&root, devenv::PLAIN, || bench_scale::soak(&root, &args))
            }
            _ => {
                let args = bench::BenchArgs::parse(rest)?;
                with_dev_env(&root, devenv::PLAIN, || bench::bench(&root, &args))
            }
        },
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n\n{USAGE}"),
    }
}

/// Runs `body` with the dev environment up, then stops the servers that this call
/// started, whether `body` succeeded or not. Servers that were already running
/// are left running.
fn with_dev_env(
    root: &Path,
    kinds: &[devenv::Kind],
    body: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let started = devenv::up(root, kinds)?;
    let result = body();
    let stopped = devenv::down(root, &started);
    match (result, stopped) {
        (Err(e), Err(down)) => Err(e.context(format!("and stopping the servers failed: {down:#}"))),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        (Ok(()), Ok(())) => Ok(()),
    }
}

/// The README's main job: the dev environment, a stream of sample orders, and
/// `sluice run` on `examples/demo.toml` with its progress in the terminal.
fn demo(root: &Path, args: &[String]) -> Result<()> {
    const USAGE: &str = "usage: cargo xtask demo [--seconds N] [--members N] [--sink delta]";
    let (mut seconds, mut members, mut delta) = (None, 1, false);
    for pair in args.chunks(2) {
        let [flag, n] = pair else { bail!(USAGE) };
        if flag == "--sink" {
            match n.as_str() {
                "delta" => delta = true,
                "console" => delta = false,
                other => bail!("--sink {other:?}: give delta (or console, the default)"),
            }
            continue;
        }
        let n = n
            .parse::<u64>()
            .with_context(|| format!("{flag} {n:?} is not a number"))?;
        match flag.as_str() {
            "--seconds" => seconds = Some(n),
            "--members" if (1..=8).contains(&n) => members = n as usize,
            "--members" => bail!("--members {n}: give 1 to 8 processes"),
            _ => bail!(USAGE),
        }
    }
    if delta && members > 1 {
        bail!(
            "--sink delta runs one process: a Delta table's transaction numbers one query's batches"
        );
    }
    devenv::up(root, devenv::PLAIN)?;
    cargo(
        root,
        &[
            "build",
            "-q",
            "-p",
            "sluice-runner",
            "--bin",
            "sluice",
            "-p",
            "sluice-examples",
            "--example",
            "demo_producer",
        ],
    )?;
    let debug = root.join("target").join("debug");
    std::fs::create_dir_all(root.join("target").join("demo"))?;
    // The scale-out demo reads the orders alone: group mode shares one source.
    let mut stream = vec!["127.0.0.1:9092", "demo-orders", "500"];
    if members == 1 {
        stream.push("demo-returns");
    }
    let mut producer = Command::new(debug.join("examples").join("demo_producer"))
        .args(&stream)
        .spawn()
        .context("starting the demo producer")?;
    if members > 1 {
        let ran = demo_members(root, &debug, members, seconds);
        let _ = Command::new("kill")
            .args(["-INT", &producer.id().to_string()])
            .status();
        let _ = producer.wait();
        return ran;
    }
    let config = if delta {
        demo_delta_config(root)?
    } else {
        "examples/demo.toml".to_owned()
    };
    println!("$ sluice run --config {config}");
    let mut sluice = Command::new(debug.join("sluice"))
        .args(["run", "--config", &config])
        .current_dir(root)
        .spawn()
        .context("starting sluice")?;
    if let Some(seconds) = seconds {
        std::thread::sleep(std::time::Duration::from_secs(seconds));
        let _ = Command::new("kill")
            .args(["-INT", &sluice.id().to_string()])
            .status();
    }
    let status = sluice.wait()?;
    let _ = Command::new("kill")
        .args(["-INT", &producer.id().to_string()])
        .status();
    let _ = producer.wait();
    println!(
        "progress: target/demo/progress.jsonl, bad records: target/demo/dead-letters/, the status \
         page and metrics were on http://127.0.0.1:9464/; `cargo xtask down` stops Kafka and Cassandra"
    );
    if delta {
        println!(
            "the windows are in the Delta table target/demo/delta, one commit per batch; look at it \
             with Python (pip install deltalake pandas):\n  python3 -c \"from deltalake import \
             DeltaTable; t = DeltaTable('target/demo/delta'); print(t.to_pandas()); \
             print(t.history(3))\"\nor with DuckDB:\n  duckdb -c \"SELECT * FROM \
             delta_scan('target/demo/delta') ORDER BY window_start, customer\""
        );
    }
    if !status.success() {
        bail!("sluice run failed ({status})");
    }
    Ok(())
}

/// `examples/demo.toml` with its windows going to the Delta table
/// `target/demo/delta` instead of the console, under a checkpoint of its own;
/// written to `target/demo/demo-delta.toml`, whose path it returns.
fn demo_delta_config(root: &Path) -> Result<String> {
    let demo = std::fs::read_to_string(root.join("examples/demo.toml"))
        .context("reading examples/demo.toml")?;
    let console = "[sink]\ntype = \"console\"\nnum_rows = 8\n";
    let checkpoint = "location = \"target/demo/checkpoint\"\n";
    if !demo.contains(console) || !demo.contains(checkpoint) {
        bail!(
            "examples/demo.toml no longer has the console sink and checkpoint the delta demo replaces"
        );
    }
    let text = demo
        .replace(
            console,
            "[sink]\ntype = \"delta\"\npath = \"target/demo/delta\"\n",
        )
        .replace(checkpoint, "location = \"target/demo/checkpoint-delta\"\n");
    let path = "target/demo/demo-delta.toml";
    std::fs::write(root.join(path), text).with_context(|| format!("writing {path}"))?;
    Ok(path.to_owned())
}

/// The scale-out demo: `members` processes of `examples/demo-scale-out.toml`
/// share one query through the consumer group. With `seconds`, the last one
/// stops half way, and its partitions move to the others.
fn demo_members(root: &Path, debug: &Path, members: usize, seconds: Option<u64>) -> Result<()> {
    const CONFIG: &str = "examples/demo-scale-out.toml";
    const STORE: &str = "cassandra://127.0.0.1:9042/sluice_demo?query=demo-scale-out";
    // The producer creates the topic, which each member checks at its start.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let mut running = Vec::new();
    for member in 1..=members {
        println!("$ sluice run --config {CONFIG}    # member {member} of {members}");
        running.push(
            Command::new(debug.join("sluice"))
                .args(["run", "--config", CONFIG])
                .current_dir(root)
                .spawn()
                .context("starting sluice")?,
        );
    }
    let signal = |child: &std::process::Child, signal: &str| {
        let _ = Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status();
    };
    if let Some(seconds) = seconds {
        std::thread::sleep(std::time::Duration::from_secs(seconds / 2));
        println!(
            "stopping member {members}: it finishes its batch and hands its partitions to the others"
        );
        if let Some(last) = running.last() {
            signal(last, "-TERM");
        }
        std::thread::sleep(std::time::Duration::from_secs(seconds - seconds / 2));
        for child in &running {
            signal(child, "-INT");
        }
    }
    let mut failed = Vec::new();
    for (i, mut child) in running.into_iter().enumerate() {
        let status = child.wait()?;
        if !status.success() {
            failed.push(format!("member {} ({status})", i + 1));
        }
    }
    let (files, records) = jsonl_totals(&root.join("target/demo/scale-out"))?;
    println!(
        "output: {records} rows in {files} files in target/demo/scale-out/, named \
         batch-<member>.<generation>-<batch>.jsonl; `target/debug/sluice offsets show \
         --checkpoint {STORE}` lists who holds which partition; `cargo xtask down` stops Kafka \
         and Cassandra"
    );
    if !failed.is_empty() {
        bail!("sluice run failed: {}", failed.join(", "));
    }
    Ok(())
}

/// The jsonl files in `dir` and the rows in them.
fn jsonl_totals(dir: &Path) -> Result<(usize, usize)> {
    let (mut files, mut rows) = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok((0, 0));
    };
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "jsonl") {
            files += 1;
            rows += std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .lines()
                .count();
        }
    }
    Ok((files, rows))
}

/// `cargo xtask ci`: the checks that need no server (format, clippy, docs)
/// run while the servers start and Spark's jars download, as those wait on
/// the JVMs and the network; then the tests and the Spark compatibility
/// tests. The servers this call started are stopped whatever happened.
fn ci(root: &Path, extra: &[String]) -> Result<()> {
    let starting = {
        let root = root.to_owned();
        std::thread::spawn(move || -> Result<Vec<devenv::Kind>> {
            let started = devenv::up(&root, devenv::ALL)?;
            if let Err(e) = spark_jars(&root) {
                // The servers are up; spark-compat fetches again and fails there.
                eprintln!("xtask: fetching Spark's jars failed: {e:#}");
            }
            Ok(started)
        })
    };
    let checks = static_checks(root);
    let started = starting
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("starting the servers panicked")));
    let started = match (checks, started) {
        (Ok(()), Ok(started)) => started,
        (Err(e), Ok(started)) => {
            let _ = devenv::down(root, &started);
            return Err(e);
        }
        (_, Err(e)) => return Err(e),
    };
    let result = cargo_test(root, extra).and_then(|()| spark_compat(root));
    let stopped = devenv::down(root, &started);
    match (result, stopped) {
        (Err(e), Err(down)) => Err(e.context(format!("and stopping the servers failed: {down:#}"))),
        (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
        (Ok(()), Ok(())) => Ok(()),
    }
}

/// `cargo fmt --check`, clippy with every warning an error, and the docs.
fn static_checks(root: &Path) -> Result<()> {
    cargo(root, &["fmt", "--all", "--check"])?;
    cargo(
        root,
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    cargo_doc(root)
}

/// Fetches Spark's jars (once) into `target/spark-compat/lib`.
fn spark_jars(root: &Path) -> Result<PathBuf> {
    tools::check()?;
    let dir = root.join("target").join("spark-compat");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let lib = dir.join("lib");
    println!("fetching Spark's jars into {}", lib.display());
    tools::fetch_jars(
        &root.join("xtask").join("spark-compat").join("pom.xml"),
        &lib,
        &dir.join("maven.log"),
    )?;
    Ok(lib)
}

/// Runs the ignored tests of `tests/integration/spark_checkpoint.rs` with Spark's
/// jars on the classpath. They need no server, only Java and Maven.
fn spark_compat(root: &Path) -> Result<()> {
    let lib = spark_jars(root)?;
    let classpath = format!("{}/*", lib.display());
    ignored_tests(
        root,
        "spark_checkpoint",
        &[],
        &[("SLUICE_SPARK_CLASSPATH", classpath.as_str())],
    )
    .context("the Spark compatibility tests failed")
}

/// Runs the ignored tests whose names contain `filter`, with `extra` test
/// harness options and `env`; fails when one fails, and when the filter
/// matched no test, which a renamed test would otherwise pass silently.
/// `--workspace --tests`, as in `cargo_test`, keeps that run's build, where
/// `--test integration` would resolve other features for the proc macros and
/// build scylla and the integration binary a second time; the filter leaves
/// the other binaries with nothing to run.
fn ignored_tests(root: &Path, filter: &str, extra: &[&str], env: &[(&str, &str)]) -> Result<()> {
    use std::io::BufRead;
    let mut args = vec!["test", "--workspace", "--tests", filter, "--", "--ignored"];
    args.extend(extra);
    let shown: String = env.iter().map(|(k, _)| format!("{k}=... ")).collect();
    println!("$ {shown}cargo {}", args.join(" "));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut child = Command::new(cargo)
        .args(&args)
        .envs(env.iter().copied())
        .current_dir(root)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    let mut ran = 0u64;
    let stdout = child.stdout.take().context("cargo test's output")?;
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.context("reading cargo test's output")?;
        println!("{line}");
        ran += tests_run(&line);
    }
    let status = child.wait().context("waiting for cargo test")?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    if ran == 0 {
        bail!("no test matched `{filter}`: a test was renamed or lost its #[ignore]");
    }
    Ok(())
}

/// The tests a libtest summary line (`test result: ok. 5 passed; 1 failed;
/// ...`) says ran: those passed and failed.
fn tests_run(line: &str) -> u64 {
    let Some(summary) = line.strip_prefix("test result: ") else {
        return 0;
    };
    summary
        .split([';', '.'])
        .filter_map(|part| {
            let (count, what) = part.trim().split_once(' ')?;
            matches!(what, "passed" | "failed").then(|| count.parse::<u64>().ok())?
        })
        .sum()
}

fn cargo_test(root: &Path, extra: &[String]) -> Result<()> {
    // Every test binary runs, so one failure does not hide the others.
    let mut args = vec!["test", "--workspace", "--no-fail-fast"];
    args.extend(extra.iter().map(String::as_str));
    let all = cargo(root, &args);
    if !extra.is_empty() {
        return all;
    }
    // Tests that stop a server run alone, after everything else.
    let outage = ignored_tests(root, "outage", &["--test-threads", "1"], &[]);
    all.and(outage)
}

/// `cargo doc` for our crates, with every rustdoc warning (a broken link, an
/// unclosed tag in a doc comment) an error.
fn cargo_doc(root: &Path) -> Result<()> {
    cargo_with_env(
        root,
        &["doc", "--no-deps", "--workspace", "-q"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )
}

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_with_env(root, args, &[])
}

fn cargo_with_env(root: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let shown: String = env.iter().map(|(k, v)| format!("{k}=\"{v}\" ")).collect();
    println!("$ {shown}cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

#[cfg(test)]
mod tests {
    use super::tests_run;

    #[test]
    fn a_summary_line_counts_the_tests_that_ran() {
        let line = "test result: ok. 5 passed; 1 failed; 2 ignored; 0 measured; 96 filtered out; \
                    finished in 80.01s";
        assert_eq!(tests_run(line), 6);
        let none = "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 31 filtered out; \
                    finished in 0.00s";
        assert_eq!(tests_run(none), 0);
        assert_eq!(tests_run("test outage_x ... ok"), 0);
    }
}
