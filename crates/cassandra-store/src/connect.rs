//! Connecting to Cassandra, with authentication and TLS as configured.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use openssl::ssl::{SslContextBuilder, SslMethod, SslVerifyMode};
use scylla::client::execution_profile::ExecutionProfile;
use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;
use scylla::errors::{
    ConnectionError, ConnectionPoolError, ConnectionSetupRequestErrorKind, DbError, MetadataError,
    NewSessionError,
};
use scylla::policies::retry::FallthroughRetryPolicy;

use crate::CassandraStoreError;

/// How to reach a cluster: credentials, TLS and timeouts. Its `Debug` hides
/// the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Connection {
    /// Contact points, `host:port` each.
    pub nodes: Vec<String>,
    /// Password authentication: the user name.
    pub username: Option<String>,
    /// Password authentication: the password.
    pub password: Option<String>,
    /// Connect with TLS, verifying the nodes against this CA certificate (PEM).
    pub tls_ca_file: Option<PathBuf>,
    /// How long connecting may take.
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("nodes", &self.nodes)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl Connection {
    /// Plain connections to `nodes`.
    pub fn new(nodes: Vec<String>) -> Connection {
        Connection {
            nodes,
            username: None,
            password: None,
            tls_ca_file: None,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// Opens a session, naming the nodes in any error.
    pub async fn session(&self) -> Result<Session, CassandraStoreError> {
        let nodes = self.nodes.join(",");
        let fail = |problem: String| CassandraStoreError::Connect {
            nodes: nodes.clone(),
            source: problem.into(),
        };
        // One attempt per request: the executor's retry policy owns retries,
        // and the driver's default policy would retry some inside them.
        let profile = ExecutionProfile::builder()
            .retry_policy(Arc::new(FallthroughRetryPolicy::new()))
            .build();
        // The store and the sink read the schema they need from
        // `system_schema` themselves; the driver's copy of every keyspace's
        // tables and columns, refreshed each minute, would only cost memory and
        // start-up time, the more so on a cluster with many keyspaces.
        let mut builder = SessionBuilder::new()
            .known_nodes(&self.nodes)
            .fetch_schema_metadata(false)
            .connection_timeout(self.connect_timeout)
            .default_execution_profile_handle(profile.into_handle());
        match (&self.username, &self.password) {
            (Some(user), Some(password)) => builder = builder.user(user, password),
            (None, None) => {}
            _ => {
                return Err(fail(
                    "give both username and password, or neither".to_owned(),
                ));
            }
        }
        if let Some(ca) = &self.tls_ca_file {
            let mut tls = SslContextBuilder::new(SslMethod::tls())
                .map_err(|e| fail(format!("setting up TLS: {e}")))?;
            tls.set_ca_file(ca)
                .map_err(|e| fail(format!("reading the CA certificate {}: {e}", ca.display())))?;
            tls.set_verify(SslVerifyMode::PEER);
            builder = builder.tls_context(Some(tls.build()));
        }
        let tls = self.tls_ca_file.is_some();
        builder
            .build()
            .await
            .map_err(|source| match refusal(&source) {
                Some(why) => CassandraStoreError::Refused {
                    nodes,
                    why,
                    source: Box::new(source),
                },
                None if !tls && reset_at_setup(&source) => CassandraStoreError::Connect {
                    nodes,
                    source: format!(
                        "{source}; a node that resets every connection at the first request may \
                     take only TLS clients: set tls_ca_file"
                    )
                    .into(),
                },
                None => CassandraStoreError::Connect {
                    nodes,
                    source: Box::new(source),
                },
            })
    }
}

/// The last connection error of a session that could not be opened.
fn last_connection_error(error: &NewSessionError) -> Option<&ConnectionError> {
    match error {
        NewSessionError::MetadataError(MetadataError::ConnectionPoolError(
            ConnectionPoolError::Broken {
                last_connection_error,
            },
        )) => Some(last_connection_error),
        _ => None,
    }
}

/// Why the nodes turned the client away, when they did: a login refused or
/// missing, or a TLS handshake that failed. Connecting again changes none of it.
fn refusal(error: &NewSessionError) -> Option<String> {
    match last_connection_error(error)? {
        ConnectionError::ConnectionSetupRequestError(e) => match &e.error {
            ConnectionSetupRequestErrorKind::DbError(DbError::AuthenticationError, message) => {
                Some(format!("the login was refused: {message}"))
            }
            ConnectionSetupRequestErrorKind::MissingAuthentication => Some(
                "the nodes require a login: set username and password (or password_env)".to_owned(),
            ),
            _ => None,
        },
        ConnectionError::IoError(io) => {
            let tls = io.get_ref()?.downcast_ref::<openssl::ssl::Error>()?;
            Some(format!(
                "the TLS handshake failed ({tls}): is tls_ca_file the CA that signed the nodes' \
                 certificates, and do the nodes take TLS clients?"
            ))
        }
        _ => None,
    }
}

/// Whether the connection broke at its first request, as a TLS-only node
/// answers a plaintext client.
fn reset_at_setup(error: &NewSessionError) -> bool {
    matches!(
        last_connection_error(error),
        Some(ConnectionError::ConnectionSetupRequestError(e))
            if matches!(e.error, ConnectionSetupRequestErrorKind::BrokenConnection(_))
    )
}

/// A consistency level of reads and writes, as CQL names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    /// `ANY`.
    Any,
    /// `ONE`.
    One,
    /// `TWO`.
    Two,
    /// `THREE`.
    Three,
    /// `QUORUM`.
    Quorum,
    /// `ALL`.
    All,
    /// `LOCAL_QUORUM`, the default.
    LocalQuorum,
    /// `EACH_QUORUM`.
    EachQuorum,
    /// `LOCAL_ONE`.
    LocalOne,
}

impl Consistency {
    pub(crate) fn driver(self) -> scylla::statement::Consistency {
        use scylla::statement::Consistency as C;
        match self {
            Consistency::Any => C::Any,
            Consistency::One => C::One,
            Consistency::Two => C::Two,
            Consistency::Three => C::Three,
            Consistency::Quorum => C::Quorum,
            Consistency::All => C::All,
            Consistency::LocalQuorum => C::LocalQuorum,
            Consistency::EachQuorum => C::EachQuorum,
            Consistency::LocalOne => C::LocalOne,
        }
    }
}

/// The consistency of lightweight transactions' Paxos phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SerialConsistency {
    /// `SERIAL`: across data centres.
    Serial,
    /// `LOCAL_SERIAL`, the default.
    LocalSerial,
}

impl SerialConsistency {
    pub(crate) fn driver(self) -> scylla::statement::SerialConsistency {
        match self {
            SerialConsistency::Serial => scylla::statement::SerialConsistency::Serial,
            SerialConsistency::LocalSerial => scylla::statement::SerialConsistency::LocalSerial,
        }
    }
}

/// Reads a consistency level as CQL writes it (`LOCAL_QUORUM`, `QUORUM`, `ONE`, ...).
pub fn parse_consistency(text: &str) -> Option<Consistency> {
    Some(match text.to_ascii_uppercase().as_str() {
        "ANY" => Consistency::Any,
        "ONE" => Consistency::One,
        "TWO" => Consistency::Two,
        "THREE" => Consistency::Three,
        "QUORUM" => Consistency::Quorum,
        "ALL" => Consistency::All,
        "LOCAL_QUORUM" => Consistency::LocalQuorum,
        "EACH_QUORUM" => Consistency::EachQuorum,
        "LOCAL_ONE" => Consistency::LocalOne,
        _ => return None,
    })
}

/// Reads a serial consistency level: `SERIAL` or `LOCAL_SERIAL`.
pub fn parse_serial_consistency(text: &str) -> Option<SerialConsistency> {
    match text.to_ascii_uppercase().as_str() {
        "SERIAL" => Some(SerialConsistency::Serial),
        "LOCAL_SERIAL" => Some(SerialConsistency::LocalSerial),
        _ => None,
    }
}

/// Reads the offsets a table of yours holds, with columns `topic`, `partition`
/// and `offset` (the next offset to read), as the usual Spark-to-Cassandra
/// recipe keeps them; `table` is `keyspace.table`.
pub async fn read_offsets_table(
    nodes: &[String],
    table: &str,
) -> Result<sluice_core::PartitionOffsets, CassandraStoreError> {
    let session = Connection::new(nodes.to_vec()).session().await?;
    let what = || format!("reading topic, partition, offset from {table}");
    let rows = session
        .query_unpaged(format!("SELECT topic, partition, offset FROM {table}"), ())
        .await
        .map_err(crate::error::query_error(what()))?
        .into_rows_result()
        .map_err(crate::error::query_error(what()))?;
    let mut offsets = sluice_core::PartitionOffsets::new();
    let typed = rows
        .rows::<(String, i32, i64)>()
        .map_err(|e| CassandraStoreError::Damaged {
            entry: table.to_owned(),
            problem: format!("it must have columns topic text, partition int, offset bigint: {e}"),
        })?;
    for row in typed {
        let (topic, partition, offset) = row.map_err(crate::error::query_error(what()))?;
        let offset =
            sluice_core::Offset::new(offset).ok_or_else(|| CassandraStoreError::Damaged {
                entry: table.to_owned(),
                problem: format!("{topic}-{partition} has a negative offset {offset}"),
            })?;
        offsets.insert(sluice_core::TopicPartition::new(topic, partition), offset);
    }
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_consistency_levels_as_cql_names_them() {
        assert_eq!(
            parse_consistency("local_quorum"),
            Some(Consistency::LocalQuorum)
        );
        assert_eq!(parse_consistency("QUORUM"), Some(Consistency::Quorum));
        assert_eq!(parse_consistency("most"), None);
        assert_eq!(
            parse_serial_consistency("SERIAL"),
            Some(SerialConsistency::Serial)
        );
        assert_eq!(parse_serial_consistency("QUORUM"), None);
    }
}
