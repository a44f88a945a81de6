//! Helpers shared by Sluice's integration tests: where the real servers are, and
//! names that no other test run uses.
//!
//! The servers default to the loopback ones that `cargo xtask up` starts. Set
//! `SLUICE_KAFKA_BOOTSTRAP` (a Kafka bootstrap list) or `SLUICE_CASSANDRA_NODES`
//! (comma-separated `host:port` pairs) to test against others.

pub mod kafka;
pub mod mount;
pub mod process;
pub mod readers;
pub mod secure;

/// Environment variable naming the Kafka bootstrap servers to test against.
pub const KAFKA_BOOTSTRAP_VAR: &str = "SLUICE_KAFKA_BOOTSTRAP";
/// Environment variable naming the Cassandra contact points to test against.
pub const CASSANDRA_NODES_VAR: &str = "SLUICE_CASSANDRA_NODES";
/// The broker that `cargo xtask up` starts.
pub const DEFAULT_KAFKA_BOOTSTRAP: &str = "127.0.0.1:9092";
/// The Cassandra node that `cargo xtask up` starts.
pub const DEFAULT_CASSANDRA_NODES: &str = "127.0.0.1:9042";

/// The Kafka bootstrap servers for this test run.
pub fn kafka_bootstrap() -> String {
    non_empty_var(KAFKA_BOOTSTRAP_VAR).unwrap_or_else(|| DEFAULT_KAFKA_BOOTSTRAP.to_owned())
}

/// A driver session to the Cassandra contact points `nodes`.
pub async fn cassandra_session(nodes: &[String]) -> scylla::client::session::Session {
    scylla::client::session_builder::SessionBuilder::new()
        .known_nodes(nodes)
        .build()
        .await
        .expect("connecting to Cassandra")
}

/// The Cassandra contact points for this test run, one `host:port` each.
pub fn cassandra_nodes() -> Vec<String> {
    let raw =
        non_empty_var(CASSANDRA_NODES_VAR).unwrap_or_else(|| DEFAULT_CASSANDRA_NODES.to_owned());
    raw.split(',')
        .map(str::trim)
        .filter(|node| !node.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The replication of the keyspaces tests create: the one dev node.
pub const TEST_REPLICATION: &str = "{'class': 'SimpleStrategy', 'replication_factor': 1}";

/// A new keyspace named after `prefix`, made by `statements` run in order
/// after it is created, each with `{keyspace}` standing for its name (`CREATE
/// TABLE {keyspace}.orders (...)`); the session and the keyspace's name.
pub async fn keyspace_with(
    prefix: &str,
    statements: &[&str],
) -> (scylla::client::session::Session, String) {
    let keyspace = unique_name(prefix);
    let session = cassandra_session(&cassandra_nodes()).await;
    let create = format!("CREATE KEYSPACE {keyspace} WITH replication = {TEST_REPLICATION}");
    for cql in std::iter::once(create).chain(
        statements
            .iter()
            .map(|statement| statement.replace("{keyspace}", &keyspace)),
    ) {
        session
            .query_unpaged(cql.as_str(), ())
            .await
            .unwrap_or_else(|e| panic!("{cql}: {e}"));
    }
    (session, keyspace)
}

/// A `cassandra://` checkpoint location for a new query in `keyspace`.
pub fn cassandra_location(keyspace: &str) -> String {
    format!(
        "cassandra://{}/{keyspace}?query={}",
        cassandra_nodes().join(","),
        unique_name("q")
    )
}

/// The `[checkpoint]` lines keeping a new query's offsets in Cassandra, in
/// `keyspace`.
pub fn cassandra_checkpoint(keyspace: &str) -> String {
    format!(
        "location = \"{}\"\nreplication = \"{TEST_REPLICATION}\"",
        cassandra_location(keyspace)
    )
}

/// A name no other test or test run has used: `prefix` followed by a random
/// suffix. It is valid both as a Kafka topic and as a Cassandra keyspace (letters,
/// digits and underscores, at most 48 characters) when `prefix` is.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

fn non_empty_var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::unique_name;

    #[test]
    fn unique_names_fit_cassandra_keyspace_rules() {
        let name = unique_name("smoke");
        assert!(name.len() <= 48, "{name} is longer than 48 characters");
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        assert_ne!(name, unique_name("smoke"));
    }
}
