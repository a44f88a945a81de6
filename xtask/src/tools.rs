//! The external programs the dev environment needs: Java 17 or newer and Maven.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::tail;

/// Checks that `java` (17 or newer) and `mvn` are on the PATH.
pub fn check() -> Result<()> {
    let java = Command::new("java").arg("-version").output();
    let java = match java {
        Ok(output) if output.status.success() => output,
        Ok(output) => bail!(
            "`java -version` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(_) => bail!(
            "`java` was not found on the PATH: install Java 17 or newer \
             (Debian: apt-get install openjdk-17-jdk-headless)"
        ),
    };
    let banner = String::from_utf8_lossy(&java.stderr);
    let major = java_major(&banner);
    match major {
        Some(major) if major >= 17 => {}
        Some(major) => {
            bail!("Kafka 4 and Cassandra 5 need Java 17 or newer, but `java` is Java {major}")
        }
        None => bail!(
            "could not read the version from `java -version`: {}",
            banner.trim()
        ),
    }
    match Command::new("mvn").arg("--version").output() {
        Ok(output) if output.status.success() => Ok(()),
        Ok(output) => bail!(
            "`mvn --version` failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(_) => {
            bail!("`mvn` was not found on the PATH: install Maven (Debian: apt-get install maven)")
        }
    }
}

/// The major version in a `java -version` banner: `"17.0.15"` gives 17, `"1.8.0"` gives 8.
fn java_major(banner: &str) -> Option<u32> {
    let quoted = banner.split('"').nth(1)?;
    let mut parts = quoted.split(['.', '-', '+']);
    let first: u32 = parts.next()?.parse().ok()?;
    if first == 1 {
        parts.next()?.parse().ok()
    } else {
        Some(first)
    }
}

/// Copies the runtime dependencies of `pom` into `lib` with Maven, unless `lib`
/// already holds them for this exact pom. Jars come from Maven Central through
/// the local repository (`~/.m2`), so a warm cache makes this a copy.
pub fn fetch_jars(pom: &Path, lib: &Path, log: &Path) -> Result<()> {
    let pom_text =
        std::fs::read_to_string(pom).with_context(|| format!("reading {}", pom.display()))?;
    let stamp = lib.join(".pom");
    if std::fs::read_to_string(&stamp).is_ok_and(|fetched| fetched == pom_text) {
        return Ok(());
    }
    let partial = lib.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial)?;
    }
    let output = Command::new("mvn")
        .args(["-B", "-q", "-f"])
        .arg(pom)
        .arg("org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies")
        .arg("-DincludeScope=runtime")
        .arg(format!("-DoutputDirectory={}", partial.display()))
        .output()
        .context("running mvn")?;
    let mut text = output.stdout.clone();
    text.extend_from_slice(&output.stderr);
    std::fs::write(log, &text)?;
    if !output.status.success() {
        bail!(
            "Maven could not fetch the jars of {}; the last lines of {}:\n{}",
            pom.display(),
            log.display(),
            tail(log, 30)
        );
    }
    std::fs::write(partial.join(".pom"), pom_text)?;
    if lib.exists() {
        std::fs::remove_dir_all(lib)?;
    }
    std::fs::rename(&partial, lib)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::java_major;

    #[test]
    fn reads_java_major_versions_old_and_new() {
        assert_eq!(
            java_major("openjdk version \"17.0.15\" 2025-04-15"),
            Some(17)
        );
        assert_eq!(java_major("java version \"1.8.0_392\""), Some(8));
        assert_eq!(java_major("openjdk version \"25\" 2025-09-16"), Some(25));
        assert_eq!(java_major("no version here"), None);
    }
}
