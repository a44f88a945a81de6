//! One Apache Kafka 4 node in KRaft mode, broker and controller at once, bound to
//! loopback.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::tail;
use crate::service::Service;
use crate::tls::{self, Tls};

/// The broker's client port.
pub const PORT: u16 = 9092;
/// The controller's port; only the broker itself talks to it.
pub const CONTROLLER_PORT: u16 = 9093;
/// The SASL_SSL listener: SCRAM-SHA-512 over TLS, for the security tests.
pub const SECURE_PORT: u16 = 9094;

/// Writes the broker's configuration and formats its storage on first start.
pub fn prepare(service: &Service) -> Result<()> {
    let config = service.dir.join("config");
    fs::create_dir_all(&config)?;
    let data = service.dir.join("data");
    let logs = service.dir.join("logs");
    let tls = Tls::new(service.dev_env());
    tls.ensure()?;
    fs::write(
        config.join("server.properties"),
        server_properties(&data, &tls),
    )?;
    fs::write(
        config.join("log4j2.xml"),
        log4j2_config(Some(&logs.join("server.log"))),
    )?;
    fs::write(config.join("tools-log4j2.xml"), log4j2_config(None))?;

    if data.join("meta.properties").exists() {
        return Ok(());
    }
    // KRaft needs its storage formatted with a cluster id before the first start.
    let format_log = logs.join("format.log");
    let output = tool(service, "kafka.tools.StorageTool")
        .args(["format", "--standalone", "-t"])
        .arg(random_cluster_id()?)
        .arg("-c")
        .arg(config.join("server.properties"))
        .output()
        .context("running Kafka's storage tool")?;
    let mut text = output.stdout;
    text.extend_from_slice(&output.stderr);
    fs::write(&format_log, text)?;
    if !output.status.success() {
        bail!(
            "formatting Kafka's storage in {} failed; the last lines of {}:\n{}",
            data.display(),
            format_log.display(),
            tail(&format_log, 30)
        );
    }
    Ok(())
}

/// The command that runs the broker in the foreground.
pub fn command(service: &Service) -> Command {
    let config = service.dir.join("config");
    let mut java = Command::new("java");
    // ZGC rather than G1: G1's young collections paused the broker for 10-12 ms
    // about once a second under a 10,000 records/s producer (jstat), which every
    // request and every consumer waited out, so the end-to-end latency bench
    // measured the collector: a plain consumer's p99 was 10-21 ms with G1 and is
    // 4-6 ms with ZGC, whose pauses stay under a millisecond.
    java.args([
        "-Xms256m",
        "-Xmx1g",
        "-XX:+UseZGC",
        "-XX:+ExitOnOutOfMemoryError",
    ])
    .arg("-Djava.awt.headless=true")
    .arg(format!(
        "-Dlog4j2.configurationFile={}",
        config.join("log4j2.xml").display()
    ))
    .arg(format!(
        "-Dkafka.logs.dir={}",
        service.dir.join("logs").display()
    ))
    .arg(service.marker())
    .arg("-cp")
    .arg(classpath(service))
    .arg("kafka.Kafka")
    .arg(config.join("server.properties"));
    java
}

/// One of Kafka's command-line tools (`class`), logging warnings to stderr only.
fn tool(service: &Service, class: &str) -> Command {
    let mut java = Command::new("java");
    java.arg(format!(
        "-Dlog4j2.configurationFile={}",
        service
            .dir
            .join("config")
            .join("tools-log4j2.xml")
            .display()
    ))
    .arg("-cp")
    .arg(classpath(service))
    .arg(class);
    java
}

fn classpath(service: &Service) -> String {
    format!("{}/*", service.dir.join("lib").display())
}

fn server_properties(data: &Path, tls: &Tls) -> String {
    format!(
        "\
# Written by `cargo xtask up`; edits are overwritten on the next start.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{CONTROLLER_PORT}
listeners=PLAINTEXT://127.0.0.1:{PORT},CONTROLLER://127.0.0.1:{CONTROLLER_PORT},SASL_SSL://127.0.0.1:{SECURE_PORT}
advertised.listeners=PLAINTEXT://127.0.0.1:{PORT},CONTROLLER://127.0.0.1:{CONTROLLER_PORT},SASL_SSL://127.0.0.1:{SECURE_PORT}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL
# The secured listener: SCRAM-SHA-512 users (made by `up`) over TLS.
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location={store}
listener.name.sasl_ssl.ssl.keystore.password={password}
listener.name.sasl_ssl.ssl.key.password={password}
log.dirs={data}
num.partitions=1
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# One node: waiting for more consumers to join only slows every group test.
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
delete.topic.enable=true
# Tests purge data with retention and record deletion; keep the checks frequent.
log.retention.check.interval.ms=5000
",
        data = data.display(),
        store = tls.server_store().display(),
        password = tls::STORE_PASSWORD,
    )
}

/// Creates the SCRAM user of the SASL_SSL listener, or sets its password again.
/// KRaft keeps SCRAM credentials in the cluster metadata, written through the
/// plaintext listener.
pub fn provision(service: &Service) -> Result<()> {
    let output = tool(service, "kafka.admin.ConfigCommand")
        .args(["--bootstrap-server", &format!("127.0.0.1:{PORT}")])
        .args(["--alter", "--entity-type", "users", "--entity-name"])
        .arg(tls::KAFKA_USER)
        .arg("--add-config")
        .arg(format!("SCRAM-SHA-512=[password={}]", tls::KAFKA_PASSWORD))
        .output()
        .context("running Kafka's config command")?;
    if !output.status.success() {
        bail!(
            "creating the SCRAM user {} failed: {}{}",
            tls::KAFKA_USER,
            String::from_utf8_lossy(&output.stdout).trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// log4j2 configuration: INFO to `file` for the broker, WARN to stderr for tools.
fn log4j2_config(file: Option<&Path>) -> String {
    let (appender, level) = match file {
        Some(path) => (
            format!(
                "<File name=\"out\" fileName=\"{}\"><PatternLayout pattern=\"[%d] %p %m (%c)%n\"/></File>",
                path.display()
            ),
            "INFO",
        ),
        None => (
            "<Console name=\"out\" target=\"SYSTEM_ERR\"><PatternLayout pattern=\"%p %m%n\"/></Console>"
                .to_owned(),
            "WARN",
        ),
    };
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
         <Configuration status=\"WARN\">\n  <Appenders>{appender}</Appenders>\n  \
         <Loggers><Root level=\"{level}\"><AppenderRef ref=\"out\"/></Root></Loggers>\n\
         </Configuration>\n"
    )
}

/// A Kafka cluster id: 16 random bytes in unpadded URL-safe base64, drawn again
/// while it starts with `-`, as Kafka's own `Uuid.randomUuid` does: the storage
/// tool would read such an id as an option and refuse to format (one start in 64).
fn random_cluster_id() -> Result<String> {
    use std::io::Read;
    let mut urandom = fs::File::open("/dev/urandom").context("opening /dev/urandom")?;
    loop {
        let mut bytes = [0_u8; 16];
        urandom
            .read_exact(&mut bytes)
            .context("reading /dev/urandom")?;
        let id = base64_url(&bytes);
        if !id.starts_with('-') {
            return Ok(id);
        }
    }
}

fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0_u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{base64_url, random_cluster_id};

    #[test]
    fn encodes_unpadded_url_safe_base64() {
        assert_eq!(base64_url(b"Man"), "TWFu");
        assert_eq!(base64_url(b"Ma"), "TWE");
        assert_eq!(base64_url(&[0xfb, 0xff]), "-_8");
        assert_eq!(base64_url(&[0_u8; 16]).len(), 22);
    }

    #[test]
    fn a_cluster_id_never_starts_like_an_option() {
        // About one draw in 64 starts with `-`; 2,000 draws meet dozens.
        for _ in 0..2000 {
            let id = random_cluster_id().unwrap();
            assert!(!id.starts_with('-'), "{id}");
            assert_eq!(id.len(), 22);
        }
    }
}
