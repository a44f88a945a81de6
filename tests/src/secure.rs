//! The secured servers of the dev environment: the broker's SASL_SSL listener
//! (SCRAM-SHA-512 over TLS) and the Cassandra node that takes only TLS clients
//! with a password, which `cargo xtask up --secure` starts (`cargo xtask test`
//! always does). The users, passwords and certificates are the ones xtask makes
//! (`xtask/src/tls.rs`); change both together.

use std::path::PathBuf;

/// The broker's SASL_SSL listener.
pub const KAFKA_BOOTSTRAP: &str = "127.0.0.1:9094";
/// Its SCRAM-SHA-512 user.
pub const KAFKA_USER: &str = "sluice";
/// That user's password.
pub const KAFKA_PASSWORD: &str = "sluice-dev-scram";
/// The secured Cassandra node.
pub const CASSANDRA_NODES: &str = "127.0.0.1:9142";
/// Its login role for the tests.
pub const CASSANDRA_USER: &str = "sluice";
/// That role's password.
pub const CASSANDRA_PASSWORD: &str = "sluice-dev-cql";

fn tls_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("dev-env")
        .join("tls")
}

/// The CA that signed both servers' certificate (PEM).
pub fn ca() -> PathBuf {
    let ca = tls_dir().join("ca.pem");
    assert!(
        ca.exists(),
        "{} is missing: start the secured servers with `cargo xtask up --secure`",
        ca.display()
    );
    ca
}

/// A CA that signed neither server's certificate.
pub fn other_ca() -> PathBuf {
    tls_dir().join("other-ca.pem")
}

/// `[source.kafka]` lines that reach the SASL_SSL listener as the test user,
/// with `password` and the CA file `ca`.
pub fn kafka_options(password: &str, ca: &std::path::Path) -> String {
    format!(
        "\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\
         \"sasl.username\" = \"{KAFKA_USER}\"\n\"sasl.password\" = \"{password}\"\n\
         \"ssl.ca.location\" = \"{}\"\n",
        ca.display()
    )
}
