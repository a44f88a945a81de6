//! Running the `sluice` binary from tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The `sluice` binary, built once per test run.
pub fn sluice() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        // The same selection as `cargo test --workspace` (every package's tests,
        // so every package's dev-dependencies): `-p sluice-runner` alone resolves
        // other features (serde's `alloc`, which criterion turns on) and builds
        // DataFusion and 70 other crates a second time.
        let status = Command::new(cargo)
            .args(["build", "-q", "--workspace", "--bins", "--tests"])
            .current_dir(&root)
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building sluice failed");
        let target = std::env::var("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root.join("target"));
        target.join("debug").join("sluice")
    })
}

/// Runs `sluice` with `args`, without the environment's overrides.
pub fn run(args: &[&str]) -> Output {
    Command::new(sluice())
        .args(args)
        .env_remove("SLUICE_BOOTSTRAP_SERVERS")
        .env_remove("SLUICE_CHECKPOINT_LOCATION")
        .output()
        .expect("running sluice")
}

/// A `sluice run` in the background whose standard error is read while it runs: a
/// pipe nobody reads fills after 64 KiB of log and then blocks the process on its
/// next log line, which would stop it from doing what the test waits for.
pub struct Running {
    child: std::process::Child,
    /// What the process wrote to standard error so far.
    log: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    /// Starts `sluice` with `args`.
    pub fn spawn(args: &[&str]) -> Running {
        let mut command = Command::new(sluice());
        command.args(args);
        Running::spawn_command(command)
    }

    /// Starts `command` (a `sluice` command with its arguments and
    /// environment), reading its standard error.
    pub fn spawn_command(mut command: Command) -> Running {
        let mut child = command
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting sluice");
        let mut pipe = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let written = log.clone();
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            // A read error ends the log; what came before it is kept.
            while let Ok(n @ 1..) = std::io::Read::read(&mut pipe, &mut chunk) {
                written.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Running {
            child,
            log,
            reader: Some(reader),
        }
    }

    /// What the process wrote to standard error so far.
    pub fn log_so_far(&self) -> String {
        String::from_utf8_lossy(&self.log.lock().unwrap()).into_owned()
    }

    /// Waits until the process has logged `needle`, failing the test after
    /// `timeout` or if the process exits first.
    pub async fn wait_for_log(&mut self, needle: &str, timeout: Duration) {
        let found = eventually(timeout, || {
            self.log_so_far().contains(needle) || self.has_exited().is_some()
        })
        .await;
        let log = self.log_so_far();
        assert!(
            found && log.contains(needle),
            "sluice did not log {needle:?} within {timeout:?} ({:?}):\n{log}",
            self.has_exited()
        );
    }

    /// The process id, for signals.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (such as `-TERM`) to the process.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.id().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill {signal} {} failed", self.id());
    }

    /// Whether the process has exited, and how, without waiting.
    pub fn has_exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("polling sluice")
    }

    /// Waits for the process to exit; its stdout is not captured.
    pub fn wait(mut self) -> Output {
        let status = self.child.wait().expect("waiting for sluice");
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the log reader panicked");
        }
        let stderr = std::mem::take(&mut *self.log.lock().unwrap());
        Output {
            status,
            stdout: Vec::new(),
            stderr,
        }
    }
}

/// A test that fails while its process runs must not leave the process behind:
/// it would go on reading and writing beside the tests that follow.
impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Polls `done` every 50 ms, without blocking other tasks of the test's
/// runtime (its producer), until it holds or `timeout` passed; whether it held.
pub async fn eventually(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `done` as [`eventually`] does and fails the test, naming `what`, if
/// it does not hold within `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, done: impl FnMut() -> bool) {
    assert!(eventually(timeout, done).await, "{what} within {timeout:?}");
}

/// What a run wrote to standard error.
pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A small deterministic generator, so a failing run can be repeated from its seed.
pub struct Lcg(pub u64);

impl Lcg {
    /// A generator seeded from the clock; prints the seed.
    pub fn from_clock(what: &str) -> Lcg {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        println!("{what} seed {seed}");
        Lcg(seed)
    }

    /// A number below `bound`.
    pub fn next_below(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

/// Starts `sluice run --config <config>` `kills` times, and kills each run with
/// SIGKILL after `min_ms` plus a random part of `spread_ms`, checking that it
/// was still running: the crash of an exactly-once test.
pub async fn kill_at_random_moments(
    config: &Path,
    kills: u32,
    (min_ms, spread_ms): (u64, u64),
    random: &mut Lcg,
) {
    for kill in 0..kills {
        let mut child = Command::new(sluice())
            .args(["run", "--config"])
            .arg(config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting sluice run");
        let wait = min_ms + random.next_below(spread_ms);
        tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
        assert!(
            child.try_wait().expect("polling sluice run").is_none(),
            "run {kill} exited early"
        );
        child.kill().expect("SIGKILL");
        child.wait().expect("reaping sluice run");
    }
}

/// How many batches that read records the progress file `progress` reports:
/// each was committed before its report. A line a SIGKILL cut short is not
/// one.
pub fn committed_batches(progress: &Path) -> usize {
    std::fs::read_to_string(progress)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|report| report["numInputRows"].as_u64().is_some_and(|n| n > 0))
        .count()
}

/// Asserts that the runs since `before` (what [`committed_batches`] said
/// then) committed batches of records: a crash test whose killed runs did
/// nothing would otherwise pass on its final catch-up alone.
pub fn assert_committed_since(progress: &Path, before: usize, runs: &str) {
    let now = committed_batches(progress);
    assert!(
        now > before,
        "the {runs} committed no batch of records ({before} reported before them, {now} after): \
         the final catch-up alone would have made the output"
    );
    println!("the {runs} committed {} batches of records", now - before);
}

/// Runs the query of `config` until it aborts right after its sink finished
/// `batch` (the `after_sink_commit` failpoint), before the store's commit;
/// then runs it again for 2.5 s and checks that the second run found the batch
/// in the sink and wrote its commit only. Blocking waits run off the test's
/// runtime threads, which a producer may need meanwhile.
pub async fn crash_after_sink_commit_and_resume(config: &Path, batch: u64) {
    let crashing = config.to_owned();
    let crashed = tokio::task::spawn_blocking(move || {
        Command::new(sluice())
            .args(["run", "--config", crashing.to_str().unwrap()])
            .env("SLUICE_FAILPOINT", format!("after_sink_commit:{batch}"))
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(crashed.status.code(), None, "{}", stderr(&crashed));
    let said = stderr(&crashed);
    assert!(
        said.contains(&format!("aborting after the sink committed batch {batch}")),
        "{said}"
    );
    let resumed = Running::spawn(&["run", "--config", config.to_str().unwrap()]);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    resumed.signal("-TERM");
    let resumed = tokio::task::spawn_blocking(move || resumed.wait())
        .await
        .unwrap();
    let said = stderr(&resumed);
    assert_eq!(resumed.status.code(), Some(0), "{said}");
    assert!(
        said.contains("the sink already has this batch; writing its commit only"),
        "{said}"
    );
}
