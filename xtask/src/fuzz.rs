//! `cargo xtask fuzz`: runs every `cargo fuzz` target of `fuzz/` for a bounded
//! time on the nightly toolchain, from its seeds (real files Sluice wrote) and
//! the corpus earlier runs grew, after replaying the crashes already fixed.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The targets, each named after what it reads.
pub const TARGETS: &[&str] = &[
    "checkpoint_files",
    "spark_offsets",
    "config_toml",
    "state_file",
    "json_values",
];

/// Options of `cargo xtask fuzz`.
pub struct FuzzArgs {
    /// How long each target runs.
    pub seconds: u64,
    /// Only these targets; all when empty.
    pub only: Vec<String>,
}

impl FuzzArgs {
    /// `[--seconds N] [TARGET...]`.
    pub fn parse(args: &[String]) -> Result<FuzzArgs> {
        let mut parsed = FuzzArgs {
            seconds: 60,
            only: Vec::new(),
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--seconds" => {
                    let value = args.next().context("--seconds needs a number")?;
                    parsed.seconds = value
                        .parse()
                        .with_context(|| format!("--seconds {value:?} is not a number"))?;
                }
                target if TARGETS.contains(&target) => parsed.only.push(target.to_owned()),
                other => bail!(
                    "unknown fuzz argument {other:?}: give --seconds N and target names from {}",
                    TARGETS.join(", ")
                ),
            }
        }
        Ok(parsed)
    }
}

/// Whether `cargo fuzz` can run here, or why not.
pub fn available() -> Result<()> {
    let nightly = Command::new("cargo")
        .args(["+nightly", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !nightly.is_ok_and(|s| s.success()) {
        bail!(
            "the nightly toolchain is missing (rustup toolchain list): cargo fuzz needs it, and \
             it cannot be downloaded on a machine without internet"
        );
    }
    let fuzz = Command::new("cargo")
        .args(["+nightly", "fuzz", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !fuzz.is_ok_and(|s| s.success()) {
        bail!("cargo-fuzz is missing: cargo install cargo-fuzz --locked");
    }
    Ok(())
}

/// Runs the targets one after another, each for `args.seconds`.
pub fn run(root: &Path, args: &FuzzArgs) -> Result<()> {
    available()?;
    let dir = root.join("fuzz");
    let targets: Vec<&str> = TARGETS
        .iter()
        .copied()
        .filter(|t| args.only.is_empty() || args.only.iter().any(|o| o == t))
        .collect();
    let mut report = Vec::new();
    for target in targets {
        let corpus = dir.join("corpus").join(target);
        fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
        // Fixed crashes first: each must pass again.
        let regressions = dir.join("regressions").join(target);
        if regressions.is_dir() {
            fuzz(
                &dir,
                target,
                &[regressions.as_path()],
                &["-runs=0".to_owned()],
            )
            .with_context(|| format!("a fixed crash of {target} fails again"))?;
        }
        let seeds = dir.join("seeds").join(target);
        let log = fuzz(
            &dir,
            target,
            &[corpus.as_path(), seeds.as_path()],
            &[
                format!("-max_total_time={}", args.seconds),
                "-rss_limit_mb=2048".to_owned(),
                "-print_final_stats=1".to_owned(),
            ],
        )
        .with_context(|| {
            format!(
                "{target} found a crash: the input is in fuzz/artifacts/{target}/; fix it and \
                 keep the input in fuzz/regressions/{target}/"
            )
        })?;
        let runs = log
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .map(|n| n.trim().to_owned())
            .unwrap_or_else(|| "?".to_owned());
        let inputs = fs::read_dir(&corpus).map(|d| d.count()).unwrap_or(0);
        report.push(format!(
            "{target}: {runs} inputs run in {} s, corpus {inputs} files, no crash",
            args.seconds
        ));
    }
    for line in &report {
        println!("{line}");
    }
    Ok(())
}

/// `cargo +nightly fuzz run` of one target; returns libFuzzer's log.
fn fuzz(dir: &Path, target: &str, corpora: &[&Path], options: &[String]) -> Result<String> {
    // No sanitizer: the code under test is safe Rust, whose faults are panics
    // and overflows, which libFuzzer catches with the dev profile's debug
    // assertions. The dev profile, not release: optimising DataFusion and
    // librdkafka on nightly took 21 of CI's minutes, and unoptimised the
    // parsers still run hundreds of thousands of inputs in 30 s.
    let mut command = Command::new("cargo");
    command.current_dir(dir).args([
        "+nightly",
        "fuzz",
        "run",
        "--sanitizer",
        "none",
        "--dev",
        target,
    ]);
    command.args(corpora).arg("--").args(options);
    let output = command
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running cargo fuzz run {target}"))?;
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "cargo fuzz run {target} failed ({}):\n{}",
            output.status,
            tail.join("\n")
        );
    }
    Ok(log)
}
