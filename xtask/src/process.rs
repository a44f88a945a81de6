//! Background server processes: starting them detached, finding them again by
//! their recorded pid, and stopping only the ones we started.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Starts `command` in its own process group, with its output appended to
/// `output_log`, so that it outlives `cargo xtask` and a Ctrl-C in the terminal
/// does not reach it.
pub fn spawn_detached(mut command: Command, output_log: &Path) -> Result<Child> {
    use std::os::unix::process::CommandExt;

    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(output_log)
        .with_context(|| format!("opening {}", output_log.display()))?;
    let log_err = log.try_clone()?;
    command
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0);
    let program = command.get_program().to_string_lossy().into_owned();
    command
        .spawn()
        .with_context(|| format!("starting `{program}`"))
}

/// Whether `pid` is a live (not zombie) process whose command line contains
/// `marker`. The marker guards against a recycled pid that now belongs to
/// something else.
pub fn is_ours(pid: u32, marker: &str) -> bool {
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let zombie = fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // The state follows the parenthesised command name, which may hold spaces.
            let after = stat.rsplit_once(')')?.1;
            after.split_whitespace().next().map(|s| s == "Z")
        })
        .unwrap_or(true);
    !zombie
        && cmdline
            .split(|b| *b == 0)
            .any(|arg| arg == marker.as_bytes())
}

/// The resident set size of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Sends SIGTERM, waits up to `grace` for the process to go, then sends SIGKILL.
pub fn terminate(pid: u32, marker: &str, grace: Duration) -> Result<()> {
    signal(pid, "TERM")?;
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if !is_ours(pid, marker) {
            return Ok(());
        }
        sleep(Duration::from_millis(200));
    }
    kill(pid, marker)
}

/// Kills `pid` at once with SIGKILL, as a crash would, and waits until it is gone.
pub fn kill(pid: u32, marker: &str) -> Result<()> {
    signal(pid, "KILL")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if !is_ours(pid, marker) {
            return Ok(());
        }
        sleep(Duration::from_millis(100));
    }
    bail!("process {pid} is still alive after SIGKILL")
}

fn signal(pid: u32, name: &str) -> Result<()> {
    // `kill` from procps keeps xtask free of a libc dependency; a process that is
    // already gone is fine.
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .context("running `kill`")?;
    if !status.success() && Path::new(&format!("/proc/{pid}")).exists() {
        bail!("`kill -{name} {pid}` failed");
    }
    Ok(())
}

/// The last `lines` lines of a log file, for error messages. Java stack frames
/// are left out: the exception and its causes say what went wrong, and the frames
/// would push them out of the window.
pub fn tail(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let all: Vec<&str> = text.lines().filter(|line| !is_stack_frame(line)).collect();
            let start = all.len().saturating_sub(lines);
            all[start..]
                .iter()
                .map(|line| shorten(line))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => format!("({} could not be read: {e})", path.display()),
    }
}

/// Cuts a line to at most 300 characters: Cassandra logs its whole
/// configuration on one line, which would bury the error.
fn shorten(line: &str) -> String {
    const MAX: usize = 300;
    match line.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{} [...]", &line[..cut]),
        None => line.to_owned(),
    }
}

fn is_stack_frame(line: &str) -> bool {
    let trimmed = line.trim_start();
    line.len() != trimmed.len() && (trimmed.starts_with("at ") || trimmed.starts_with("... "))
}

#[cfg(test)]
mod tests {
    use super::is_stack_frame;

    #[test]
    fn recognises_java_stack_frames_but_not_messages() {
        assert!(is_stack_frame(
            "\tat org.apache.cassandra.Foo.bar(Foo.java:1)"
        ));
        assert!(is_stack_frame("\t... 13 more"));
        assert!(!is_stack_frame(
            "Caused by: java.io.IOException: at the end"
        ));
        assert!(!is_stack_frame("at least one broker"));
    }
}
