//! Apache Cassandra 5.0 nodes bound to loopback: the plain one most tests use, and
//! a secured one (password authentication, client TLS) for the security tests.
//! They are separate single-node clusters sharing one set of jars.

use std::fs;
use std::process::Command;

use anyhow::Result;

use crate::service::{Kind, Service};
use crate::tls::{self, Tls};

/// The CQL native transport port.
pub const PORT: u16 = 9042;
/// The inter-node storage port; a single node still binds it.
pub const STORAGE_PORT: u16 = 7000;
/// The secured node's CQL port: TLS only, password authentication.
pub const SECURE_PORT: u16 = 9142;
/// The secured node's storage port.
pub const SECURE_STORAGE_PORT: u16 = 7010;

/// Java 17 module options that Cassandra 5.0 needs, as its `jvm17-server.options` lists them.
const JAVA17_OPTIONS: &[&str] = &[
    "--add-exports=java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports=java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.server=ALL-UNNAMED",
    "--add-exports=java.sql/java.sql=ALL-UNNAMED",
    "--add-exports=java.base/java.lang.ref=ALL-UNNAMED",
    "--add-exports=jdk.unsupported/sun.misc=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.module=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.loader=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.reflect=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.math=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.module=ALL-UNNAMED",
    "--add-opens=java.base/jdk.internal.util.jar=ALL-UNNAMED",
    "--add-opens=jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "-Djdk.attach.allowAttachSelf=true",
    "-Dio.netty.tryReflectionSetAccessible=true",
];

/// Writes `cassandra.yaml` and `logback.xml`.
pub fn prepare(service: &Service) -> Result<()> {
    let conf = service.dir.join("conf");
    fs::create_dir_all(&conf)?;
    fs::create_dir_all(service.dir.join("data"))?;
    let secured = if service.kind == Kind::SecureCassandra {
        let tls = Tls::new(service.dev_env());
        tls.ensure()?;
        secured_yaml(&tls)
    } else {
        String::new()
    };
    fs::write(
        conf.join("cassandra.yaml"),
        cassandra_yaml(service) + &secured,
    )?;
    fs::write(conf.join("logback.xml"), logback_xml(service))?;
    Ok(())
}

/// The command that runs the node in the foreground.
pub fn command(service: &Service) -> Command {
    let conf = service.dir.join("conf");
    let mut java = Command::new("java");
    java.args([
        "-Xms1g",
        "-Xmx1g",
        "-Xss256k",
        "-XX:+UseG1GC",
        "-XX:+ExitOnOutOfMemoryError",
    ])
    .args(JAVA17_OPTIONS)
    .arg(format!(
        "-Dcassandra.config=file://{}",
        conf.join("cassandra.yaml").display()
    ))
    .arg(format!(
        "-Dcassandra.storagedir={}",
        service.dir.join("data").display()
    ))
    .arg(format!(
        "-Dcassandra.logdir={}",
        service.dir.join("logs").display()
    ))
    .arg(format!(
        "-Dlogback.configurationFile={}",
        conf.join("logback.xml").display()
    ))
    // Without it Cassandra closes stdout and stderr, and a failed start says nothing.
    .arg("-Dcassandra-foreground=yes")
    // A single node has no gossip to wait for.
    .arg("-Dcassandra.skip_wait_for_gossip_to_settle=0")
    .arg("-Dcassandra.ring_delay_ms=1000")
    .arg("-Dcassandra.libjemalloc=-")
    // The default superuser, which creates the tests' role, exists 10 s after
    // the start unless told otherwise.
    .arg("-Dcassandra.superuser_setup_delay_ms=0")
    .arg(service.marker())
    .arg("-cp")
    .arg(format!("{}:{}/*", conf.display(), service.lib().display()))
    .arg("org.apache.cassandra.service.CassandraDaemon");
    java
}

fn cassandra_yaml(service: &Service) -> String {
    let (cluster, port, storage_port) = match service.kind {
        Kind::SecureCassandra => ("sluice-dev-secure", SECURE_PORT, SECURE_STORAGE_PORT),
        _ => ("sluice-dev", PORT, STORAGE_PORT),
    };
    let data = service.dir.join("data");
    let dir = |name: &str| data.join(name).display().to_string();
    format!(
        "\
# Written by `cargo xtask up`; edits are overwritten on the next start.
cluster_name: {cluster}
num_tokens: 1
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
endpoint_snitch: SimpleSnitch
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: \"127.0.0.1:{storage_port}\"
listen_address: 127.0.0.1
rpc_address: 127.0.0.1
storage_port: {storage_port}
start_native_transport: true
native_transport_port: {port}
# An offset store must not lose a write it acknowledged: with periodic sync, a
# single node SIGKILLed loses the last seconds of acknowledged writes (seen in
# the outage test: a plan and a commit gone). Replication covers that in a
# cluster; a single node needs each write synced before it is acknowledged.
commitlog_sync: batch
# Synced through the page cache (mmap, the default), a write of more than a few
# KiB took 1.5-2 ms longer than a small one here, and a lightweight transaction
# writes its update three times: a plan at 1,024 partitions (22 KiB) took 7-8 ms
# against 2 ms for an empty one. With direct I/O it takes 2.6-3.4 ms.
commitlog_disk_access_mode: direct
data_file_directories:
  - {data_files}
commitlog_directory: {commitlog}
saved_caches_directory: {saved_caches}
hints_directory: {hints}
cdc_raw_directory: {cdc_raw}
# Tests create and drop many keyspaces; snapshots of them only fill the disk.
auto_snapshot: false
",
        data_files = dir("data"),
        commitlog = dir("commitlog"),
        saved_caches = dir("saved_caches"),
        hints = dir("hints"),
        cdc_raw = dir("cdc_raw"),
    )
}

/// What makes the secured node secure: only TLS clients, and only with a password.
fn secured_yaml(tls: &Tls) -> String {
    format!(
        "\
authenticator: PasswordAuthenticator
authorizer: AllowAllAuthorizer
role_manager: CassandraRoleManager
client_encryption_options:
  enabled: true
  optional: false
  keystore: {store}
  keystore_password: {password}
  store_type: PKCS12
  require_client_auth: false
",
        store = tls.server_store().display(),
        password = tls::STORE_PASSWORD,
    )
}

/// Creates the tests' login role on the secured node, as the default superuser.
pub fn provision(service: &Service) -> Result<()> {
    let tls = Tls::new(service.dev_env());
    let create = format!(
        "CREATE ROLE IF NOT EXISTS {} WITH PASSWORD = '{}' AND LOGIN = true",
        tls::CASSANDRA_USER,
        tls::CASSANDRA_PASSWORD
    );
    crate::probe::cql_secure(
        std::net::SocketAddr::from(([127, 0, 0, 1], SECURE_PORT)),
        &tls.ca(),
        tls::CASSANDRA_SUPERUSER,
        &[&create],
        std::time::Duration::from_secs(20),
    )
    .map(|_| ())
}

fn logback_xml(service: &Service) -> String {
    format!(
        "<configuration scan=\"false\">\n\
         \x20 <appender name=\"FILE\" class=\"ch.qos.logback.core.FileAppender\">\n\
         \x20   <file>{}</file>\n\
         \x20   <encoder><pattern>%-5level [%thread] %date{{ISO8601}} %F:%L - %msg%n</pattern></encoder>\n\
         \x20 </appender>\n\
         \x20 <root level=\"INFO\"><appender-ref ref=\"FILE\"/></root>\n\
         </configuration>\n",
        service.dir.join("logs").join("system.log").display()
    )
}
