//! Small filesystems for the disk fault tests: a tmpfs of a few hundred KiB,
//! mounted on a test's own directory, that fills up for real and can be made
//! read-only and writable again while a query runs. Mounting needs root, as the
//! CI machines run the tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted on a directory of its own, unmounted when dropped.
pub struct SmallFs {
    dir: PathBuf,
}

impl SmallFs {
    /// Mounts a tmpfs of `kib` KiB on `dir`, which is created.
    pub fn mount(dir: &Path, kib: u64) -> SmallFs {
        std::fs::create_dir_all(dir).unwrap();
        let fs = SmallFs {
            dir: dir.to_owned(),
        };
        fs.mount_command(&format!("size={kib}k"), &["-t", "tmpfs", "tmpfs"]);
        fs
    }

    /// The mounted directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Fills the filesystem with a file `filler` until a write fails for want
    /// of space, so that the next write of anything fails too.
    pub fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.dir.join("filler");
        let mut file = std::fs::File::create(&path).unwrap();
        let block = [0_u8; 4096];
        loop {
            match file.write(&block) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        // Byte by byte into what the last block left.
        while let Ok(1) = file.write(&block[..1]) {}
        path
    }

    /// Makes the filesystem read-only, or writable again.
    pub fn set_read_only(&self, read_only: bool) {
        let options = if read_only {
            "remount,ro"
        } else {
            "remount,rw"
        };
        self.mount_command(options, &[]);
    }

    fn mount_command(&self, options: &str, extra: &[&str]) {
        // A remount to read-only is refused while a file on it is open for
        // writing, as the sink's batch file is for a moment in every batch: try
        // again until it lands between two such moments.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let output = loop {
            let output = Command::new("mount")
                .args(extra)
                .args(["-o", options])
                .arg(&self.dir)
                .output()
                .expect("running mount");
            let busy = String::from_utf8_lossy(&output.stderr).contains("busy");
            if output.status.success() || !busy || std::time::Instant::now() > deadline {
                break output;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert!(
            output.status.success(),
            "mount -o {options} {} failed: {}; the disk fault tests mount a small tmpfs, which \
             needs root (CI runs as root)",
            self.dir.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
