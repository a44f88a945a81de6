//! One server of the dev environment: which kind it is and where its jars,
//! configuration, data and logs live. The servers' own modules (`kafka`,
//! `cassandra`) and `devenv`, which starts and stops them, build on it.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// The servers of the dev environment.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Kafka,
    Cassandra,
    /// Cassandra with `PasswordAuthenticator` and client TLS, for the security tests.
    SecureCassandra,
}

/// One server of the dev environment and where its files live.
pub struct Service {
    pub kind: Kind,
    /// `target/dev-env/<name>`: jars, configuration, data and logs.
    pub dir: PathBuf,
    /// The pom whose runtime dependencies are the server's classpath.
    pub pom: PathBuf,
}

impl Service {
    pub fn new(kind: Kind, root: &Path) -> Self {
        // Both Cassandra nodes run the same jars.
        let jars = match kind {
            Kind::SecureCassandra => Kind::Cassandra.dir_name(),
            other => other.dir_name(),
        };
        Service {
            kind,
            dir: root.join("target").join("dev-env").join(kind.dir_name()),
            pom: root
                .join("xtask")
                .join("dev-env")
                .join(jars)
                .join("pom.xml"),
        }
    }

    pub fn name(&self) -> &'static str {
        match self.kind {
            Kind::Kafka => "Kafka",
            Kind::Cassandra => "Cassandra",
            Kind::SecureCassandra => "Cassandra (TLS, password)",
        }
    }

    /// `target/dev-env`, which holds every server's directory and the certificates.
    pub fn dev_env(&self) -> &Path {
        self.dir
            .parent()
            .expect("a server's directory is in target/dev-env")
    }

    /// The server's jars, which the two Cassandra nodes share.
    pub fn lib(&self) -> PathBuf {
        let owner = match self.kind {
            Kind::SecureCassandra => Kind::Cassandra.dir_name(),
            other => other.dir_name(),
        };
        self.dev_env().join(owner).join("lib")
    }

    /// A JVM system property that names this checkout's server, so that we only
    /// ever signal a process we started.
    pub fn marker(&self) -> String {
        format!("-Dsluice.devenv={}", self.dir.display())
    }

    /// The server's own log, where its start and its failures are told.
    pub fn server_log(&self) -> PathBuf {
        let file = match self.kind {
            Kind::Kafka => "server.log",
            Kind::Cassandra | Kind::SecureCassandra => "system.log",
        };
        self.dir.join("logs").join(file)
    }
}

impl Kind {
    /// The kinds named on the command line (`kafka`, `cassandra`,
    /// `cassandra-secure`), plus the secured node with `--secure`; `none` when
    /// none is named.
    pub fn parse_list(names: &[String], none: &[Kind]) -> Result<Vec<Kind>> {
        let mut kinds = Vec::new();
        let mut secure = false;
        for name in names {
            match name.as_str() {
                "--secure" => secure = true,
                "kafka" => kinds.push(Kind::Kafka),
                "cassandra" => kinds.push(Kind::Cassandra),
                "cassandra-secure" => kinds.push(Kind::SecureCassandra),
                other => bail!(
                    "unknown server `{other}`: name kafka, cassandra or cassandra-secure, or \
                     give --secure"
                ),
            }
        }
        if kinds.is_empty() {
            kinds = none.to_vec();
        }
        if secure && !kinds.contains(&Kind::SecureCassandra) {
            kinds.push(Kind::SecureCassandra);
        }
        Ok(kinds)
    }

    pub fn dir_name(self) -> &'static str {
        match self {
            Kind::Kafka => "kafka",
            Kind::Cassandra => "cassandra",
            Kind::SecureCassandra => "cassandra-secure",
        }
    }
}
