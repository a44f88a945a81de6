//! Sluice against secured servers: the broker's SASL_SSL listener (SCRAM-SHA-512
//! over TLS) and a Cassandra node that takes only TLS clients with a password
//! (`cargo xtask up --secure`). A query runs end to end through both; wrong
//! credentials, an untrusted certificate and a plaintext client each fail at
//! once with the server's reason; no password is ever shown; the metrics
//! endpoint listens on loopback unless told otherwise.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use sluice_tests::kafka::{create_topic, delete_topic, numbered, produce, producer};
use sluice_tests::process::{Running, sluice, stderr};
use sluice_tests::secure;

use crate::exactly_once::{assert_exactly_once, committed_positions, positions};

/// Environment variables the configs name with `password_env` and
/// `"sasl.password_env"`.
const CQL_PASSWORD_VAR: &str = "SLUICE_TEST_CQL_PASSWORD";
const SASL_PASSWORD_VAR: &str = "SLUICE_TEST_SASL_PASSWORD";

/// A query's folder and config.
struct Secured {
    dir: tempfile::TempDir,
}

impl Secured {
    fn new() -> Secured {
        Secured {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn progress(&self) -> PathBuf {
        self.dir.path().join("progress.jsonl")
    }

    /// Writes `query.toml`: `source` and `checkpoint` are the tables' extra lines.
    fn config(
        &self,
        bootstrap: &str,
        topic: &str,
        source: &str,
        checkpoint: &str,
        sink: &str,
    ) -> PathBuf {
        let text = format!(
            r#"
name = "secured"

[source]
bootstrap_servers = "{bootstrap}"
subscribe = ["{topic}"]
starting_offsets = "earliest"
max_offsets_per_trigger = 250

[source.kafka]
{source}

[checkpoint]
{checkpoint}

[trigger]
available_now = true

[sink]
{sink}

[progress]
file = "{progress}"
"#,
            progress = self.progress().display(),
        );
        let path = self.dir.path().join("query.toml");
        std::fs::write(&path, text).unwrap();
        path
    }
}

/// `[checkpoint]` lines for a new query on the secured node, as the test role,
/// with the given password lines and CA.
fn cassandra_checkpoint(password_lines: &str, ca: &Path) -> String {
    format!(
        "location = \"cassandra://{}/sluice_secure_tests?query={}\"\n\
         replication = \"{}\"\nusername = \"{}\"\n{password_lines}\ntls_ca_file = \"{}\"",
        secure::CASSANDRA_NODES,
        sluice_tests::unique_name("q"),
        sluice_tests::TEST_REPLICATION,
        secure::CASSANDRA_USER,
        ca.display()
    )
}

/// Runs `sluice` with `args`, the password variables set, and debug logs.
fn sluice_with_secrets(args: &[&str]) -> Output {
    Command::new(sluice())
        .args(args)
        .env(CQL_PASSWORD_VAR, secure::CASSANDRA_PASSWORD)
        .env(SASL_PASSWORD_VAR, secure::KAFKA_PASSWORD)
        .env("SLUICE_LOG", "debug")
        .output()
        .expect("running sluice")
}

/// Everything a run showed: its standard output and error.
fn shown(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_no_password(text: &str, passwords: &[&str], what: &str) {
    for password in passwords {
        assert!(
            !text.contains(password),
            "{what} shows the password {password:?}:\n{text}"
        );
    }
}

#[tokio::test]
async fn a_query_runs_through_sasl_ssl_and_a_password_protected_tls_cassandra_and_shows_no_password()
 {
    let topic = sluice_tests::unique_name("secured");
    let out_topic = sluice_tests::unique_name("securedout");
    create_topic(&topic, 3).await;
    create_topic(&out_topic, 3).await;
    let producer = producer();
    for partition in 0..3 {
        produce(&producer, &topic, &numbered(partition, "v", 300)).await;
    }
    let ca = secure::ca();
    let job = Secured::new();
    let passwords = [secure::KAFKA_PASSWORD, secure::CASSANDRA_PASSWORD];

    // Inline passwords, as validate reads them.
    let inline = job.config(
        secure::KAFKA_BOOTSTRAP,
        &topic,
        &secure::kafka_options(secure::KAFKA_PASSWORD, &ca),
        &cassandra_checkpoint(
            &format!("password = \"{}\"", secure::CASSANDRA_PASSWORD),
            &ca,
        ),
        &format!("type = \"kafka\"\ntopic = \"{out_topic}\"\ndelivery = \"exactly_once\""),
    );
    let validated = sluice_with_secrets(&["validate", "--config", inline.to_str().unwrap()]);
    assert_eq!(validated.status.code(), Some(0), "{}", shown(&validated));
    assert!(shown(&validated).contains("valid"), "{}", shown(&validated));
    assert_no_password(&shown(&validated), &passwords, "validate");

    // The passwords from the environment, for the run itself. The sink is on the
    // source's cluster, so it reaches it as the source does.
    let source = secure::kafka_options("unused", &ca).replace(
        "\"sasl.password\" = \"unused\"",
        &format!("\"sasl.password_env\" = \"{SASL_PASSWORD_VAR}\""),
    );
    let from_env = job.config(
        secure::KAFKA_BOOTSTRAP,
        &topic,
        &source,
        &cassandra_checkpoint(&format!("password_env = \"{CQL_PASSWORD_VAR}\""), &ca),
        &format!("type = \"kafka\"\ntopic = \"{out_topic}\"\ndelivery = \"exactly_once\""),
    );
    let ran = sluice_with_secrets(&["run", "--config", from_env.to_str().unwrap()]);
    assert_eq!(ran.status.code(), Some(0), "{}", shown(&ran));
    assert!(
        shown(&ran).contains(" DEBUG "),
        "the run logs at debug level, so that the check below sees the most: {}",
        shown(&ran)
    );
    assert_no_password(&shown(&ran), &passwords, "the run's log");
    let progress = std::fs::read_to_string(job.progress()).unwrap();
    assert_eq!(progress.lines().count(), 4, "900 records at 250 a batch");
    assert_no_password(&progress, &passwords, "the progress file");
    assert_no_password(
        &std::fs::read_to_string(&from_env).unwrap(),
        &passwords,
        "the config that names variables",
    );

    let got = committed_positions(&out_topic, 900, |_, offset| format!("v-{offset}")).await;
    assert_exactly_once(&got, &positions(&topic, 3, 300));
    delete_topic(&topic).await;
    delete_topic(&out_topic).await;
}

/// Runs `sluice validate` on a config whose source is `bootstrap` with the
/// `[source.kafka]` lines `options`; checks that it ended at once, with exit 2,
/// naming the refusal and `reason`, and without `password`.
fn assert_kafka_refuses(bootstrap: &str, options: &str, reason: &str, password: &str) {
    let job = Secured::new();
    let config = job.config(
        bootstrap,
        "any-topic",
        options,
        &format!(
            "location = \"{}\"",
            job.dir.path().join("checkpoint").display()
        ),
        "type = \"discard\"",
    );
    let started = Instant::now();
    let output = sluice_with_secrets(&["validate", "--config", config.to_str().unwrap()]);
    let elapsed = started.elapsed();
    let said = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(said.contains("refused this client"), "{said}");
    assert!(said.contains(reason), "{said}");
    assert_no_password(&said, &[password], "the refusal");
    // Far within the request timeout (30 s), which a refusal used to wait out.
    assert!(
        elapsed < Duration::from_secs(20),
        "took {elapsed:?}: {said}"
    );

    // A run stops as fast, with no retry: no other answer would come.
    let output = sluice_with_secrets(&["run", "--config", config.to_str().unwrap()]);
    let said = stderr(&output);
    assert_eq!(output.status.code(), Some(2), "{said}");
    assert!(said.contains("refused this client"), "{said}");
    assert!(
        !said.contains("giving up"),
        "a refusal is not retried: {said}"
    );
    assert_no_password(&said, &[password], "the refusal");
}

#[test]
fn kafka_refuses_a_wrong_password_an_untrusted_certificate_and_plaintext_at_once() {
    let ca = secure::ca();
    let wrong = "not-the-scram-password";
    assert_kafka_refuses(
        secure::KAFKA_BOOTSTRAP,
        &secure::kafka_options(wrong, &ca),
        "invalid credentials",
        wrong,
    );
    assert_kafka_refuses(
        secure::KAFKA_BOOTSTRAP,
        &secure::kafka_options(secure::KAFKA_PASSWORD, &secure::other_ca()),
        "certificate verify failed",
        secure::KAFKA_PASSWORD,
    );
    assert_kafka_refuses(
        secure::KAFKA_BOOTSTRAP,
        "",
        "expects another security protocol",
        secure::KAFKA_PASSWORD,
    );
}

/// Runs a query whose checkpoint is on the secured node with `checkpoint`
/// lines; checks that it ended at once with `code`, saying `reason`, without
/// `password`.
fn assert_cassandra_refuses(checkpoint: &str, code: i32, reason: &str, password: &str) {
    let job = Secured::new();
    let topic = sluice_tests::unique_name("unread");
    let config = job.config(
        &sluice_tests::kafka_bootstrap(),
        &topic,
        "",
        checkpoint,
        "type = \"discard\"",
    );
    let started = Instant::now();
    let output = sluice_with_secrets(&["run", "--config", config.to_str().unwrap()]);
    let elapsed = started.elapsed();
    let said = stderr(&output);
    assert_eq!(output.status.code(), Some(code), "{said}");
    assert!(said.contains(reason), "{said}");
    assert_no_password(&said, &[password], "the refusal");
    assert!(
        elapsed < Duration::from_secs(20),
        "took {elapsed:?}: {said}"
    );
}

#[test]
fn cassandra_refuses_a_wrong_password_an_untrusted_certificate_no_login_and_plaintext_at_once() {
    let ca = secure::ca();
    let location = format!(
        "location = \"cassandra://{}/sluice_secure_tests?query={}\"",
        secure::CASSANDRA_NODES,
        sluice_tests::unique_name("q")
    );
    let wrong = "not-the-cql-password";
    assert_cassandra_refuses(
        &cassandra_checkpoint(&format!("password = \"{wrong}\""), &ca),
        2,
        "the login was refused",
        wrong,
    );
    assert_cassandra_refuses(
        &cassandra_checkpoint(
            &format!("password_env = \"{CQL_PASSWORD_VAR}\""),
            &secure::other_ca(),
        ),
        2,
        "certificate verify failed",
        secure::CASSANDRA_PASSWORD,
    );
    assert_cassandra_refuses(
        &format!("{location}\ntls_ca_file = \"{}\"", ca.display()),
        2,
        "the nodes require a login",
        secure::CASSANDRA_PASSWORD,
    );
    assert_cassandra_refuses(
        &format!(
            "{location}\nusername = \"{}\"\npassword_env = \"{CQL_PASSWORD_VAR}\"",
            secure::CASSANDRA_USER
        ),
        1,
        "may take only TLS clients: set tls_ca_file",
        secure::CASSANDRA_PASSWORD,
    );
}

/// The local addresses of the listening TCP sockets on `port`, from
/// `/proc/net/tcp` (IPv4) and `/proc/net/tcp6`, as the kernel writes them.
fn listeners_on(port: u16) -> Vec<String> {
    let port = format!("{port:04X}");
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // 0A is LISTEN.
            if let [_, local, _, state, ..] = fields[..]
                && state == "0A"
                && local.ends_with(&format!(":{port}"))
            {
                found.push(local.to_owned());
            }
        }
    }
    found
}

#[tokio::test]
async fn the_metrics_endpoint_given_only_a_port_listens_on_loopback_only() {
    let topic = sluice_tests::unique_name("metricsbind");
    create_topic(&topic, 1).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let job = Secured::new();
    let config = job.config(
        &sluice_tests::kafka_bootstrap(),
        &topic,
        "",
        &format!(
            "location = \"{}\"",
            job.dir.path().join("checkpoint").display()
        ),
        "type = \"discard\"",
    );
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("available_now = true", "processing_time = \"1s\"")
        .replace(
            "[progress]",
            &format!("[progress]\nmetrics_addr = \":{port}\""),
        );
    std::fs::write(&config, text).unwrap();
    let running = Running::spawn(&["run", "--config", config.to_str().unwrap()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut listening = listeners_on(port);
    while listening.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        listening = listeners_on(port);
    }
    running.signal("-TERM");
    let output = running.wait();
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    // 127.0.0.1 in the kernel's byte order, and nothing on another address.
    assert_eq!(
        listening,
        vec![format!("0100007F:{port:04X}")],
        "{}",
        stderr(&output)
    );
    delete_topic(&topic).await;
}
