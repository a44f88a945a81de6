//! Running the `sluice` binary from tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The `sluice` binary, built once per test run.
pub fn sluice() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let status = Command::new(cargo)
            .args(["build", "-q", "-p", "sluice-runner", "--bin", "sluice"])
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
