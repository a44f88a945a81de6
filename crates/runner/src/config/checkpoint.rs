//! `[checkpoint]`: where the offsets and the state live, a directory in
//! Spark's layout or Cassandra, and how many batches are kept.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use super::CHECKPOINT_ENV;

/// `[checkpoint]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    pub location: Option<String>,
    pub min_batches_to_retain: Option<u64>,
    /// Cassandra only: the keyspace's replication, to create it when missing.
    pub replication: Option<String>,
    /// Cassandra only: create Sluice's tables when missing (default true).
    pub create_schema: Option<bool>,
    /// Cassandra only: `LOCAL_QUORUM` by default.
    pub consistency: Option<String>,
    /// Cassandra only: `LOCAL_SERIAL` by default.
    pub serial_consistency: Option<String>,
    /// Cassandra only: the timeout of one request.
    pub request_timeout_ms: Option<u64>,
    /// Cassandra only: authentication and TLS.
    #[serde(flatten)]
    pub auth: CassandraAuth,
}

/// Authentication and TLS for Cassandra, in `[checkpoint]` and `[sink]`. Its
/// `Debug` hides the password.
#[derive(Default, Deserialize, Clone)]
pub struct CassandraAuth {
    pub username: Option<String>,
    pub password: Option<String>,
    /// The name of an environment variable holding the password, to keep it out of the file.
    pub password_env: Option<String>,
    /// Connect with TLS, verifying the nodes against this CA certificate (PEM).
    pub tls_ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for CassandraAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CassandraAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("password_env", &self.password_env)
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl CassandraAuth {
    pub(super) fn is_set(&self) -> bool {
        self.username.is_some()
            || self.password.is_some()
            || self.password_env.is_some()
            || self.tls_ca_file.is_some()
    }

    /// The connection to `nodes` with these credentials.
    pub(super) fn connection(
        &self,
        nodes: Vec<String>,
        table: &str,
    ) -> Result<sluice_cassandra_store::Connection> {
        let password = match (&self.password, &self.password_env) {
            (Some(_), Some(_)) => bail!("[{table}] takes password or password_env, not both"),
            (Some(p), None) => Some(p.clone()),
            (None, Some(var)) => Some(std::env::var(var).with_context(|| {
                format!("[{table}] password_env names {var}, which is not set")
            })?),
            (None, None) => None,
        };
        if self.username.is_some() != password.is_some() {
            bail!(
                "[{table}] needs both username and a password (password or password_env), or neither"
            );
        }
        Ok(sluice_cassandra_store::Connection {
            username: self.username.clone(),
            password,
            tls_ca_file: self.tls_ca_file.clone(),
            ..sluice_cassandra_store::Connection::new(nodes)
        })
    }
}

/// Where the offsets live.
#[derive(Debug, Clone)]
pub enum StoreKind {
    /// A checkpoint directory in Spark's layout.
    Directory(PathBuf),
    /// Cassandra tables.
    Cassandra(
        sluice_cassandra_store::CassandraLocation,
        Box<sluice_cassandra_store::CassandraOptions>,
    ),
}

impl TryFrom<&CheckpointSection> for StoreKind {
    type Error = anyhow::Error;

    /// The location (the environment's first) and the options that go
    /// with it; Cassandra's options refused for a directory.
    fn try_from(section: &CheckpointSection) -> Result<StoreKind> {
        let checkpoint = std::env::var(CHECKPOINT_ENV)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .or(section.location.clone())
            .context("checkpoint.location is missing (or set SLUICE_CHECKPOINT_LOCATION)")?;
        Ok(if checkpoint.starts_with("cassandra://") {
            let location = sluice_cassandra_store::CassandraLocation::parse(&checkpoint)?;
            let connection = section
                .auth
                .connection(location.nodes.clone(), "checkpoint")?;
            let mut options = sluice_cassandra_store::CassandraOptions {
                replication: section.replication.clone(),
                create_schema: section.create_schema.unwrap_or(true),
                username: connection.username,
                password: connection.password,
                tls_ca_file: connection.tls_ca_file,
                ..Default::default()
            };
            if let Some(text) = &section.consistency {
                options.consistency = sluice_cassandra_store::parse_consistency(text).with_context(|| {
                    format!("checkpoint.consistency {text:?} is not a consistency level like LOCAL_QUORUM")
                })?;
            }
            if let Some(text) = &section.serial_consistency {
                options.serial_consistency = sluice_cassandra_store::parse_serial_consistency(text)
                    .with_context(|| {
                        format!(
                            "checkpoint.serial_consistency {text:?} must be SERIAL or LOCAL_SERIAL"
                        )
                    })?;
            }
            if let Some(ms) = section.request_timeout_ms {
                if ms == 0 {
                    bail!(
                        "checkpoint.request_timeout_ms must be at least 1: every request would time out"
                    );
                }
                options.request_timeout = Duration::from_millis(ms);
            }
            StoreKind::Cassandra(location, Box::new(options))
        } else if checkpoint.contains("://") && !checkpoint.starts_with("file://") {
            bail!(
                "checkpoint.location {checkpoint:?}: use a directory path, file:///path, or \
                 cassandra://host:port/keyspace?query=<name>"
            );
        } else {
            let c = section;
            if c.replication.is_some()
                || c.create_schema.is_some()
                || c.consistency.is_some()
                || c.serial_consistency.is_some()
                || c.request_timeout_ms.is_some()
                || c.auth.is_set()
            {
                bail!(
                    "checkpoint.replication, create_schema, consistency, serial_consistency, \
                     request_timeout_ms and the credentials apply to cassandra:// locations only"
                );
            }
            StoreKind::Directory(PathBuf::from(checkpoint.trim_start_matches("file://")))
        })
    }
}

impl CheckpointSection {
    /// How many batches are kept, at least the newest.
    pub(super) fn min_batches_to_retain(&self) -> Result<u64> {
        match self.min_batches_to_retain {
            // The newest batch is the one a restart continues from.
            Some(0) => bail!(
                "checkpoint.min_batches_to_retain must be at least 1: a restart continues from \
                 the newest batch"
            ),
            Some(n) => Ok(n),
            None => Ok(sluice_core::DEFAULT_MIN_BATCHES_TO_RETAIN),
        }
    }
}
