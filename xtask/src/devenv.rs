//! `cargo xtask up`, `down` and `status`: a real Kafka broker and a real Cassandra
//! node on loopback, run from jars that Maven fetches, with everything they write
//! kept under `target/dev-env/`; with `--secure`, a second Cassandra node that
//! takes only TLS clients with a password. The broker always has a SASL_SSL
//! listener besides its plaintext one.

use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub use crate::service::Kind;
use crate::service::Service;
use crate::{cassandra, kafka, probe, process, tls, tools};

impl Service {
    /// Ports that must be free before the server starts; the client port first.
    fn ports(&self) -> &'static [u16] {
        match self.kind {
            Kind::Kafka => &[kafka::PORT, kafka::CONTROLLER_PORT, kafka::SECURE_PORT],
            Kind::Cassandra => &[cassandra::PORT, cassandra::STORAGE_PORT],
            Kind::SecureCassandra => &[cassandra::SECURE_PORT, cassandra::SECURE_STORAGE_PORT],
        }
    }

    fn client_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.ports()[0]))
    }

    /// How long a cold start may take on a busy two-core machine.
    fn start_timeout(&self) -> Duration {
        match self.kind {
            Kind::Kafka => Duration::from_secs(120),
            Kind::Cassandra | Kind::SecureCassandra => Duration::from_secs(240),
        }
    }

    fn pid_file(&self) -> PathBuf {
        self.dir.join("pid")
    }

    fn output_log(&self) -> PathBuf {
        self.dir.join("logs").join("stdout.log")
    }

    /// The pid of the server we started, when it is still running.
    fn running_pid(&self) -> Option<u32> {
        let pid = fs::read_to_string(self.pid_file())
            .ok()?
            .trim()
            .parse()
            .ok()?;
        process::is_ours(pid, &self.marker()).then_some(pid)
    }

    /// Asks the server a real question: Kafka a Metadata request, Cassandra a CQL query.
    fn probe(&self, timeout: Duration) -> Result<String> {
        let addr = self.client_addr();
        match self.kind {
            Kind::Kafka => {
                let cluster = probe::kafka_metadata(addr, timeout)?;
                if cluster.brokers.is_empty() {
                    bail!("Kafka at {addr} knows no brokers yet");
                }
                Ok(format!(
                    "cluster {}, brokers {}",
                    cluster.cluster_id.unwrap_or_default(),
                    cluster.brokers.join(",")
                ))
            }
            Kind::Cassandra => Ok(format!(
                "release {}",
                probe::cql_release_version(addr, timeout)?
            )),
            Kind::SecureCassandra => Ok(format!(
                "release {}, TLS, logged in as {}",
                probe::cql_secure(
                    addr,
                    &tls::Tls::new(self.dev_env()).ca(),
                    tls::CASSANDRA_SUPERUSER,
                    &[],
                    timeout
                )?,
                tls::CASSANDRA_SUPERUSER.0
            )),
        }
    }

    /// Creates the users the security tests log in as, once the server answers.
    fn provision(&self) -> Result<()> {
        match self.kind {
            Kind::Kafka => kafka::provision(self),
            Kind::Cassandra => Ok(()),
            Kind::SecureCassandra => cassandra::provision(self),
        }
        .with_context(|| format!("provisioning {}", self.name()))
    }

    fn check_ports_free(&self) -> Result<()> {
        for &port in self.ports() {
            if let Err(e) = TcpListener::bind(("127.0.0.1", port)) {
                bail!(
                    "cannot start {}: port 127.0.0.1:{port} is already taken by a process that \
                     `cargo xtask up` did not start ({e}); stop it, or point the tests at it with \
                     SLUICE_KAFKA_BOOTSTRAP / SLUICE_CASSANDRA_NODES and skip `up`",
                    self.name()
                );
            }
        }
        Ok(())
    }

    fn prepare(&self) -> Result<()> {
        let logs = self.dir.join("logs");
        fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        tools::fetch_jars(&self.pom, &self.lib(), &logs.join("maven.log"))?;
        match self.kind {
            Kind::Kafka => kafka::prepare(self),
            Kind::Cassandra | Kind::SecureCassandra => cassandra::prepare(self),
        }
    }

    fn command(&self) -> Command {
        match self.kind {
            Kind::Kafka => kafka::command(self),
            Kind::Cassandra | Kind::SecureCassandra => cassandra::command(self),
        }
    }

    fn start(&self) -> Result<Child> {
        let child = process::spawn_detached(self.command(), &self.output_log())?;
        fs::write(self.pid_file(), child.id().to_string())
            .with_context(|| format!("writing {}", self.pid_file().display()))?;
        Ok(child)
    }

    fn failure_report(&self) -> String {
        format!(
            "the last lines of {}:\n{}\n\nthe last lines of {}:\n{}",
            self.server_log().display(),
            process::tail(&self.server_log(), 25),
            self.output_log().display(),
            process::tail(&self.output_log(), 15)
        )
    }

    /// Stops the server if we started it and it runs. Returns whether it ran.
    fn stop(&self) -> Result<bool> {
        let Some(pid) = self.running_pid() else {
            let _ = fs::remove_file(self.pid_file());
            return Ok(false);
        };
        // Cassandra flushes its memtables on SIGTERM; give it time.
        process::terminate(pid, &self.marker(), Duration::from_secs(60))
            .with_context(|| format!("stopping {} (pid {pid})", self.name()))?;
        let _ = fs::remove_file(self.pid_file());
        Ok(true)
    }

    /// Kills the server with SIGKILL, as a crash would. Returns whether it ran.
    fn kill(&self) -> Result<bool> {
        let Some(pid) = self.running_pid() else {
            return Ok(false);
        };
        process::kill(pid, &self.marker())
            .with_context(|| format!("killing {} (pid {pid})", self.name()))?;
        let _ = fs::remove_file(self.pid_file());
        Ok(true)
    }
}

fn services(root: &Path) -> [Service; 3] {
    [
        Service::new(Kind::Kafka, root),
        Service::new(Kind::Cassandra, root),
        Service::new(Kind::SecureCassandra, root),
    ]
}

/// Starts whichever servers of `kinds` are not running yet and waits until all
/// answer. Returns the kinds this call started, so that a caller can stop
/// exactly those.
pub fn up(root: &Path, kinds: &[Kind]) -> Result<Vec<Kind>> {
    up_only(root, kinds)
}

/// Like [`up`], for the servers of `kinds` only.
pub fn up_only(root: &Path, kinds: &[Kind]) -> Result<Vec<Kind>> {
    let started_at = Instant::now();
    let services: Vec<Service> = services(root)
        .into_iter()
        .filter(|s| kinds.contains(&s.kind))
        .collect();
    let mut to_start = Vec::new();
    for service in &services {
        match service.running_pid() {
            Some(pid) => println!("{} is already running (pid {pid})", service.name()),
            None => {
                service.check_ports_free()?;
                to_start.push(service);
            }
        }
    }
    if !to_start.is_empty() {
        tools::check()?;
        for service in &to_start {
            println!("preparing {} in {}", service.name(), service.dir.display());
            service.prepare()?;
        }
    }

    let mut children = Vec::new();
    let result = (|| {
        for service in &to_start {
            children.push((service.kind, service.start()?));
        }
        wait_until_ready(&services, &mut children)?;
        for service in &to_start {
            service.provision()?;
        }
        Ok(())
    })();
    let started: Vec<Kind> = children.iter().map(|(kind, _)| *kind).collect();
    if let Err(e) = result {
        // Leave nothing half-started behind; the logs stay for reading.
        for service in services.iter().filter(|s| started.contains(&s.kind)) {
            let _ = service.stop();
        }
        return Err(e);
    }

    for service in &services {
        println!(
            "{:<9} logs: {}",
            service.name(),
            service.server_log().display()
        );
    }
    if !started.is_empty() {
        println!(
            "dev environment up in {:.1} s",
            started_at.elapsed().as_secs_f64()
        );
    }
    Ok(started)
}

fn wait_until_ready(services: &[Service], children: &mut [(Kind, Child)]) -> Result<()> {
    for service in services {
        let deadline = Instant::now() + service.start_timeout();
        let mut child = children
            .iter_mut()
            .find(|(kind, _)| *kind == service.kind)
            .map(|(_, child)| child);
        loop {
            let last_error = match service.probe(Duration::from_secs(2)) {
                Ok(answer) => {
                    println!(
                        "{:<9} ready on {} ({answer})",
                        service.name(),
                        service.client_addr()
                    );
                    break;
                }
                Err(e) => format!("{e:#}"),
            };
            let exited = match child.as_mut() {
                Some(child) => child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                bail!(
                    "{} exited during start ({status}); {}",
                    service.name(),
                    service.failure_report()
                );
            }
            if child.is_none() && service.running_pid().is_none() {
                bail!("{} stopped while we waited for it", service.name());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not answer on {} within {:?} (last: {last_error}); {}",
                    service.name(),
                    service.client_addr(),
                    service.start_timeout(),
                    service.failure_report()
                );
            }
            sleep(Duration::from_millis(500));
        }
    }
    Ok(())
}

/// Stops the servers of `kinds` that `up` started and that still run.
pub fn down(root: &Path, kinds: &[Kind]) -> Result<()> {
    let mut failures = Vec::new();
    for service in services(root).iter().filter(|s| kinds.contains(&s.kind)) {
        match service.stop() {
            Ok(true) => println!("{} stopped", service.name()),
            Ok(false) => println!("{} was not running", service.name()),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}

/// Kills the servers of `kinds` with SIGKILL, for fault tests: no flush, no
/// clean shutdown, as a crash of the machine's process would leave them.
pub fn kill(root: &Path, kinds: &[Kind]) -> Result<()> {
    for service in services(root).iter().filter(|s| kinds.contains(&s.kind)) {
        match service.kill()? {
            true => println!("{} killed", service.name()),
            false => println!("{} was not running", service.name()),
        }
    }
    Ok(())
}

/// Every kind of server, for `down`, `kill`, the tests and CI.
pub const ALL: &[Kind] = &[Kind::Kafka, Kind::Cassandra, Kind::SecureCassandra];

/// What `up`, the demo and the benchmarks start: the plain servers.
pub const PLAIN: &[Kind] = &[Kind::Kafka, Kind::Cassandra];

/// Prints, per server, whether it runs, its pid and memory, and whether it answers.
pub fn status(root: &Path) -> Result<()> {
    for service in &services(root) {
        match service.running_pid() {
            Some(pid) => {
                let rss = process::rss_kib(pid)
                    .map(|kib| format!("{} MiB RSS", kib / 1024))
                    .unwrap_or_else(|| "RSS unknown".to_owned());
                let answer = match service.probe(Duration::from_secs(2)) {
                    Ok(answer) => format!("answering on {} ({answer})", service.client_addr()),
                    Err(e) => format!("not answering on {}: {e:#}", service.client_addr()),
                };
                println!("{:<9} running, pid {pid}, {rss}, {answer}", service.name());
            }
            None => println!("{:<9} stopped", service.name()),
        }
        println!("{:<9} logs: {}", "", service.server_log().display());
    }
    Ok(())
}
