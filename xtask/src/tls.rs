//! Certificates and credentials of the dev environment's secured listeners: a
//! SASL_SSL listener of the Kafka broker and the secured Cassandra node. All of
//! it is made once with the `openssl` command under `target/dev-env/tls/`.
//!
//! The integration tests know the same names and passwords
//! (`sluice-test-support`'s `secure` module); change both together.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The password of the PKCS#12 key stores the servers read.
pub const STORE_PASSWORD: &str = "sluice-dev-store";
/// The SCRAM-SHA-512 user of the Kafka SASL_SSL listener.
pub const KAFKA_USER: &str = "sluice";
/// Its password.
pub const KAFKA_PASSWORD: &str = "sluice-dev-scram";
/// Cassandra's default superuser, which creates [`CASSANDRA_USER`].
pub const CASSANDRA_SUPERUSER: (&str, &str) = ("cassandra", "cassandra");
/// The login role the tests use on the secured Cassandra node.
pub const CASSANDRA_USER: &str = "sluice";
/// Its password.
pub const CASSANDRA_PASSWORD: &str = "sluice-dev-cql";

/// Where the certificates live.
pub struct Tls {
    /// `target/dev-env/tls`.
    pub dir: PathBuf,
}

impl Tls {
    /// The certificates of the dev environment in `dev_env` (`target/dev-env`).
    pub fn new(dev_env: &Path) -> Self {
        Tls {
            dir: dev_env.join("tls"),
        }
    }

    /// The CA that signed the servers' certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The servers' key and certificate chain as a PKCS#12 key store.
    pub fn server_store(&self) -> PathBuf {
        self.dir.join("server.p12")
    }

    /// Makes what is missing: a CA, a server certificate for 127.0.0.1 and
    /// localhost signed by it, the key store, and a second CA that signed
    /// nothing, for tests of an untrusted server.
    pub fn ensure(&self) -> Result<()> {
        if self.server_store().exists() && self.dir.join("other-ca.pem").exists() {
            return Ok(());
        }
        fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        for name in ["ca", "other-ca"] {
            openssl(
                &self.dir,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "3650",
                    "-subj",
                    &format!("/CN=Sluice dev {name}"),
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                    "-keyout",
                    &format!("{name}.key"),
                    "-out",
                    &format!("{name}.pem"),
                ],
            )?;
        }
        openssl(
            &self.dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-subj",
                "/CN=localhost",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
            ],
        )?;
        fs::write(
            self.dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )?;
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "3650",
                "-extfile",
                "server.ext",
                "-out",
                "server.pem",
            ],
        )?;
        openssl(
            &self.dir,
            &[
                "pkcs12",
                "-export",
                "-in",
                "server.pem",
                "-inkey",
                "server.key",
                "-certfile",
                "ca.pem",
                "-name",
                "server",
                "-passout",
                &format!("pass:{STORE_PASSWORD}"),
                "-out",
                "server.p12",
            ],
        )?;
        Ok(())
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running `openssl` (Debian: apt-get install openssl)")?;
    if !output.status.success() {
        bail!(
            "`openssl {}` in {} failed: {}",
            args.join(" "),
            dir.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}
