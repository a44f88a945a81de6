//! Connecting to Cassandra, with authentication and TLS as configured.

use std::path::PathBuf;
use std::time::Duration;

use openssl::ssl::{SslContextBuilder, SslMethod, SslVerifyMode};
use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;

use crate::CassandraStoreError;

/// How to reach a cluster: credentials, TLS and timeouts.
#[derive(Clone, Debug, PartialEq, Eq)]
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
        let mut builder = SessionBuilder::new()
            .known_nodes(&self.nodes)
            .connection_timeout(self.connect_timeout);
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
        builder
            .build()
            .await
            .map_err(|source| CassandraStoreError::Connect {
                nodes,
                source: Box::new(source),
            })
    }
}

/// Reads a consistency level as CQL writes it (`LOCAL_QUORUM`, `QUORUM`, `ONE`, ...).
pub fn parse_consistency(text: &str) -> Option<scylla::statement::Consistency> {
    use scylla::statement::Consistency as C;
    Some(match text.to_ascii_uppercase().as_str() {
        "ANY" => C::Any,
        "ONE" => C::One,
        "TWO" => C::Two,
        "THREE" => C::Three,
        "QUORUM" => C::Quorum,
        "ALL" => C::All,
        "LOCAL_QUORUM" => C::LocalQuorum,
        "EACH_QUORUM" => C::EachQuorum,
        "LOCAL_ONE" => C::LocalOne,
        _ => return None,
    })
}

/// Reads a serial consistency level: `SERIAL` or `LOCAL_SERIAL`.
pub fn parse_serial_consistency(text: &str) -> Option<scylla::statement::SerialConsistency> {
    use scylla::statement::SerialConsistency as S;
    match text.to_ascii_uppercase().as_str() {
        "SERIAL" => Some(S::Serial),
        "LOCAL_SERIAL" => Some(S::LocalSerial),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_consistency_levels_as_cql_names_them() {
        assert_eq!(
            parse_consistency("local_quorum"),
            Some(scylla::statement::Consistency::LocalQuorum)
        );
        assert_eq!(
            parse_consistency("QUORUM"),
            Some(scylla::statement::Consistency::Quorum)
        );
        assert_eq!(parse_consistency("most"), None);
        assert_eq!(
            parse_serial_consistency("SERIAL"),
            Some(scylla::statement::SerialConsistency::Serial)
        );
        assert_eq!(parse_serial_consistency("QUORUM"), None);
    }
}
