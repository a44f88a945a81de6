//! One writer per checkpoint: an exclusive advisory lock (flock) on a lock file,
//! held for as long as the store is open. The kernel releases it when the process
//! dies, so a crash never leaves a stale lock behind.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::CheckpointError;

/// Name of the lock file in the checkpoint directory. Spark ignores files it
/// does not know at the top of a checkpoint.
pub const LOCK_FILE: &str = "sluice.lock";

/// Takes the checkpoint's lock, or says who holds it.
pub fn acquire(dir: &Path) -> Result<File, CheckpointError> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(CheckpointError::io("opening the lock file", &path))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.split_whitespace().collect::<Vec<_>>().join(" ");
            return Err(CheckpointError::Locked {
                dir: dir.to_owned(),
                holder: if holder.is_empty() {
                    "holder unknown".to_owned()
                } else {
                    holder
                },
            });
        }
        Err(TryLockError::Error(e)) => {
            return Err(CheckpointError::io("locking", &path)(e));
        }
    }
    // The lock is ours: say who holds it, for the error of the next runner that tries.
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let who = format!(
        "pid={} host={} since_ms={since}\n",
        std::process::id(),
        hostname()
    );
    file.set_len(0)
        .and_then(|()| file.seek(SeekFrom::Start(0)))
        .and_then(|_| file.write_all(who.as_bytes()))
        .map_err(CheckpointError::io("writing the lock file", &path))?;
    Ok(file)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned())
}
