//! The readers our users have for the tables Sluice writes: pyarrow, DuckDB
//! and the `deltalake` package,
//! installed once per checkout into a virtual environment under `target/`, at
//! pinned versions, by the first test that needs them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Python packages, pinned, that read tables in tests.
const PACKAGES: &[&str] = &["pyarrow==20.0.0", "duckdb==1.3.2", "deltalake==1.6.6"];

/// The environment's `python`, with the pinned readers installed.
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let venv = root.join("target").join("readers-venv");
        let python = venv.join("bin").join("python");
        let stamp = venv.join(PACKAGES.join(" ").replace(['=', ' '], "_"));
        if stamp.exists() {
            return python;
        }
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .expect("python3 runs (Debian's python3 and python3-venv)");
        assert!(
            status.success(),
            "python3 -m venv {} failed",
            venv.display()
        );
        let status = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(PACKAGES)
            .status()
            .expect("the environment's pip runs");
        assert!(
            status.success(),
            "pip install {} failed",
            PACKAGES.join(" ")
        );
        std::fs::write(&stamp, b"").expect("the environment's stamp is written");
        python
    })
}

/// Runs `script` with the readers' Python and `args`; its standard output,
/// or a panic with its standard error.
pub fn run_python(script: &str, args: &[&str]) -> String {
    let output = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "the Python reader failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}
