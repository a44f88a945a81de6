//! Minimal wire-protocol probes that tell whether a server really answers: a Kafka
//! Metadata request and a CQL query, the latter also over TLS with a login.
//! Hand-written so that xtask needs neither librdkafka, nor an async runtime, nor
//! a TLS library, and builds in seconds.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

/// What a Kafka broker said about its cluster.
pub struct KafkaCluster {
    pub brokers: Vec<String>,
    pub cluster_id: Option<String>,
}

/// Sends a Metadata request (v4, for no topics) and reads the broker list.
pub fn kafka_metadata(addr: SocketAddr, timeout: Duration) -> Result<KafkaCluster> {
    let mut stream = connect(addr, timeout)?;
    let mut request = Vec::new();
    request.extend_from_slice(&3_i16.to_be_bytes()); // api key: Metadata
    request.extend_from_slice(&4_i16.to_be_bytes()); // api version
    request.extend_from_slice(&1_i32.to_be_bytes()); // correlation id
    put_string(&mut request, "sluice-xtask");
    request.extend_from_slice(&0_i32.to_be_bytes()); // topics: none
    request.push(0); // allow_auto_topic_creation: false
    let mut frame = (request.len() as i32).to_be_bytes().to_vec();
    frame.extend_from_slice(&request);
    stream
        .write_all(&frame)
        .context("sending a Kafka Metadata request")?;

    let body = read_sized(&mut stream, 4).context("reading the Kafka Metadata response")?;
    let mut r = Reader::new(&body);
    ensure!(
        r.i32()? == 1,
        "Kafka answered with a foreign correlation id"
    );
    let _throttle_ms = r.i32()?;
    let count = r.i32()?;
    ensure!(count >= 0, "Kafka sent a null broker list");
    let mut brokers = Vec::new();
    for _ in 0..count {
        let node = r.i32()?;
        let host = r.string()?.unwrap_or_default();
        let port = r.i32()?;
        let _rack = r.string()?;
        brokers.push(format!("{node}@{host}:{port}"));
    }
    let cluster_id = r.string()?;
    Ok(KafkaCluster {
        brokers,
        cluster_id,
    })
}

/// Sends STARTUP and `SELECT release_version FROM system.local` over plain TCP.
pub fn cql_release_version(addr: SocketAddr, timeout: Duration) -> Result<String> {
    let mut stream = connect(addr, timeout)?;
    cql_startup(&mut stream, None)?;
    cql_release(&mut stream)
}

/// The same over TLS, verifying the node against `ca`, logged in as `login`
/// (user, password), after running `statements`. TLS comes from the `openssl`
/// command, so that xtask links no TLS library.
pub fn cql_secure(
    addr: SocketAddr,
    ca: &Path,
    login: (&str, &str),
    statements: &[&str],
    timeout: Duration,
) -> Result<String> {
    let mut stream = TlsPipe::open(addr, ca, timeout)?;
    let result = (|| {
        cql_startup(&mut stream, Some(login))?;
        for statement in statements {
            cql_query(&mut stream, statement).with_context(|| format!("running {statement:?}"))?;
        }
        cql_release(&mut stream)
    })();
    result.map_err(|e| match stream.failure() {
        Some(why) => e.context(why),
        None => e,
    })
}

/// STARTUP, and the SASL PLAIN exchange when the node asks for a password.
fn cql_startup(stream: &mut impl ReadWrite, login: Option<(&str, &str)>) -> Result<()> {
    let mut startup = 1_u16.to_be_bytes().to_vec();
    put_string(&mut startup, "CQL_VERSION");
    put_string(&mut startup, "3.0.0");
    let (opcode, body) = cql_exchange(stream, 0x01, &startup).context("CQL STARTUP")?;
    match (opcode, login) {
        (0x02, _) => Ok(()),
        (0x03, None) => bail!("the CQL server asks for authentication"),
        (0x03, Some((user, password))) => {
            let token = format!("\0{user}\0{password}");
            let mut response = (token.len() as i32).to_be_bytes().to_vec();
            response.extend_from_slice(token.as_bytes());
            let (opcode, body) =
                cql_exchange(stream, 0x0F, &response).context("CQL AUTH_RESPONSE")?;
            ensure!(
                opcode == 0x10,
                "logging in as {user} failed: {}",
                cql_error(opcode, &body)
            );
            Ok(())
        }
        _ => bail!(
            "unexpected CQL answer to STARTUP: {}",
            cql_error(opcode, &body)
        ),
    }
}

/// Runs one statement at consistency ONE; returns the RESULT body.
fn cql_query(stream: &mut impl ReadWrite, text: &str) -> Result<Vec<u8>> {
    let mut query = Vec::new();
    query.extend_from_slice(&(text.len() as i32).to_be_bytes());
    query.extend_from_slice(text.as_bytes());
    query.extend_from_slice(&1_u16.to_be_bytes()); // consistency ONE
    query.push(0); // no flags
    let (opcode, body) = cql_exchange(stream, 0x07, &query).context("CQL QUERY")?;
    ensure!(
        opcode == 0x08,
        "CQL query failed: {}",
        cql_error(opcode, &body)
    );
    Ok(body)
}

fn cql_release(stream: &mut impl ReadWrite) -> Result<String> {
    let body = cql_query(stream, "SELECT release_version FROM system.local")?;
    let mut r = Reader::new(&body);
    ensure!(r.i32()? == 2, "the CQL result holds no rows");
    let flags = r.i32()?;
    let columns = r.i32()?;
    ensure!(flags & 0x0004 == 0, "the CQL result came without metadata");
    if flags & 0x0002 != 0 {
        r.bytes()?; // paging state
    }
    let global_spec = flags & 0x0001 != 0;
    if global_spec {
        r.string()?;
        r.string()?;
    }
    for _ in 0..columns {
        if !global_spec {
            r.string()?;
            r.string()?;
        }
        r.string()?; // column name
        ensure!(
            r.u16()? == 0x000D,
            "release_version is not a varchar column"
        );
    }
    ensure!(r.i32()? >= 1, "system.local has no row");
    let value = r.bytes()?.unwrap_or_default();
    Ok(String::from_utf8_lossy(value).into_owned())
}

/// A byte stream both ways: a TCP connection or the TLS pipe.
trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A TLS connection through `openssl s_client`: bytes written go to the server
/// encrypted, bytes read are the server's, decrypted. A watchdog kills the
/// client at the timeout, which ends any read that waits.
struct TlsPipe {
    child: std::sync::Arc<std::sync::Mutex<std::process::Child>>,
    stdin: std::process::ChildStdin,
    stdout: std::process::ChildStdout,
    done: Option<std::sync::mpsc::Sender<()>>,
}

impl TlsPipe {
    fn open(addr: SocketAddr, ca: &Path, timeout: Duration) -> Result<TlsPipe> {
        use std::process::{Command, Stdio};
        let mut child = Command::new("openssl")
            .args(["s_client", "-quiet", "-verify_return_error", "-connect"])
            .arg(addr.to_string())
            .arg("-verify_ip")
            .arg(addr.ip().to_string())
            .arg("-CAfile")
            .arg(ca)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running `openssl s_client`")?;
        let stdin = child.stdin.take().context("openssl's stdin")?;
        let stdout = child.stdout.take().context("openssl's stdout")?;
        let child = std::sync::Arc::new(std::sync::Mutex::new(child));
        let (done, watch) = std::sync::mpsc::channel::<()>();
        let watched = child.clone();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = watch.recv_timeout(timeout) {
                let _ = watched.lock().map(|mut c| c.kill());
            }
        });
        Ok(TlsPipe {
            child,
            stdin,
            stdout,
            done: Some(done),
        })
    }

    /// What `openssl` said when it ended, for instance a failed verification.
    fn failure(&mut self) -> Option<String> {
        let mut child = self.child.lock().ok()?;
        let _ = child.kill();
        let _ = child.wait();
        let mut text = String::new();
        child.stderr.take()?.read_to_string(&mut text).ok()?;
        let text = text.trim();
        (!text.is_empty()).then(|| format!("openssl s_client: {text}"))
    }
}

impl Read for TlsPipe {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stdout.read(buf)
    }
}

impl Write for TlsPipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stdin.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stdin.flush()
    }
}

impl Drop for TlsPipe {
    fn drop(&mut self) {
        self.done.take();
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn cql_exchange(stream: &mut impl ReadWrite, opcode: u8, body: &[u8]) -> Result<(u8, Vec<u8>)> {
    let mut frame = vec![0x04, 0x00, 0x00, 0x01, opcode];
    frame.extend_from_slice(&(body.len() as i32).to_be_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)?;
    stream.flush()?;
    let mut header = [0_u8; 9];
    stream.read_exact(&mut header)?;
    ensure!(
        header[0] == 0x84,
        "not a CQL v4 response (version byte {:#x})",
        header[0]
    );
    let len = i32::from_be_bytes([header[5], header[6], header[7], header[8]]);
    ensure!(
        (0..1 << 24).contains(&len),
        "implausible CQL frame length {len}"
    );
    let mut body = vec![0_u8; len as usize];
    stream.read_exact(&mut body)?;
    Ok((header[4], body))
}

fn cql_error(opcode: u8, body: &[u8]) -> String {
    if opcode != 0x00 {
        return format!("opcode {opcode:#x}");
    }
    let mut r = Reader::new(body);
    match (r.i32(), r.string()) {
        (Ok(code), Ok(Some(message))) => format!("error {code:#x}: {message}"),
        _ => "an unreadable error".to_owned(),
    }
}

fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(stream)
}

/// Reads one frame whose length is a big-endian i32 prefix.
fn read_sized(stream: &mut TcpStream, prefix: usize) -> Result<Vec<u8>> {
    let mut len = [0_u8; 4];
    stream.read_exact(&mut len[..prefix])?;
    let len = i32::from_be_bytes(len);
    ensure!(
        (0..1 << 24).contains(&len),
        "implausible frame length {len}"
    );
    let mut body = vec![0_u8; len as usize];
    stream.read_exact(&mut body)?;
    Ok(body)
}

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u16).to_be_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// Big-endian reader over a response body; every read checks the length.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(self.buf.len() >= n, "response ends early");
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Result<i32> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A string with an i16 length; -1 is null.
    fn string(&mut self) -> Result<Option<String>> {
        let len = self.u16()? as i16;
        if len < 0 {
            return Ok(None);
        }
        let b = self.take(len as usize)?;
        Ok(Some(String::from_utf8_lossy(b).into_owned()))
    }

    /// Bytes with an i32 length; a negative length is null.
    fn bytes(&mut self) -> Result<Option<&'a [u8]>> {
        let len = self.i32()?;
        if len < 0 {
            return Ok(None);
        }
        self.take(len as usize).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::Reader;

    #[test]
    fn reader_refuses_to_read_past_the_end() {
        let mut r = Reader::new(&[0, 5, b'a']);
        assert!(r.string().is_err());
    }

    #[test]
    fn reader_reads_null_strings_and_bytes() {
        let mut r = Reader::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(r.string().unwrap(), None);
        assert_eq!(r.bytes().unwrap(), None);
    }
}
