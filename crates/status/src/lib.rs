//! The live view of a running query, over HTTP on one address: the status
//! page (`/`), the recent progress reports as JSON (`/api/progress?last=N`),
//! what the query is (`/api/about`) and the Prometheus metrics (`/metrics`).
//!
//! The page has no external assets: its chart library (uPlot, MIT) is
//! embedded in the binary and served from the same address, since the
//! machines a query runs on may have no internet. The crate knows nothing of
//! the stream: it keeps progress reports as the JSON text the executor wrote,
//! and renders metrics through a function the binary hands it.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderValue};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// How many progress reports the page can chart, at most.
pub const KEPT_REPORTS: usize = 600;

/// The most bytes of report text kept. A report lists every partition's
/// offsets three times, so at 1,024 partitions it is about 60 KB; this bound,
/// not the count, then decides how many are kept, and memory stays bounded
/// whatever the partition count.
pub const KEPT_BYTES: usize = 8 << 20;

const PAGE: &str = include_str!("page.html");
const UPLOT_JS: &str = include_str!("../assets/uplot.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uplot.min.css");

/// What failed in serving the status page.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The address could not be listened on (in use, not ours, not local).
    #[error("listening for the status page and metrics on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why the operating system refused.
        source: std::io::Error,
    },
}

/// What a query is, shown at the top of the page and in `/api/about`.
#[derive(Clone, Debug, Default)]
pub struct About {
    /// The query's name, if it has one.
    pub name: Option<String>,
    /// The query id, stable across restarts.
    pub id: String,
    /// This run's id.
    pub run_id: String,
    /// The trigger, as a person reads it (`processing_time = 1s`).
    pub trigger: String,
    /// The source, as its progress describes it.
    pub source: String,
    /// Where offsets are kept.
    pub store: String,
    /// The sink, as its progress describes it.
    pub sink: String,
}

/// One batch's counts that the page shows as totals since the start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchCounts {
    /// Records read.
    pub rows: u64,
    /// Offsets lost to retention or a recreated topic, and skipped.
    pub lost_offsets: u64,
    /// Records that could not be processed, and were skipped or sent aside.
    pub bad_records: u64,
}

/// The status of a running query, shared between the batch loop, which
/// records each report, and the server, which shows them.
#[derive(Clone)]
pub struct Status {
    shared: Arc<Shared>,
}

struct Shared {
    about: About,
    started: Instant,
    started_at_ms: u64,
    metrics: Box<dyn Fn() -> String + Send + Sync>,
    history: Mutex<History>,
}

#[derive(Default)]
struct History {
    reports: VecDeque<Arc<str>>,
    bytes: usize,
    batches: u64,
    totals: BatchCounts,
}

impl Status {
    /// The status of the query `about`, whose metrics `metrics` renders in
    /// Prometheus' text format.
    pub fn new(about: About, metrics: impl Fn() -> String + Send + Sync + 'static) -> Status {
        let started_at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Status {
            shared: Arc::new(Shared {
                about,
                started: Instant::now(),
                started_at_ms,
                metrics: Box::new(metrics),
                history: Mutex::new(History::default()),
            }),
        }
    }

    /// Keeps one batch's progress report (its JSON text) and adds its counts
    /// to the totals. The oldest reports go once more than
    /// [`KEPT_REPORTS`] or [`KEPT_BYTES`] are kept; the newest always stays.
    pub fn record(&self, report: String, counts: BatchCounts) {
        let mut history = self.history();
        history.bytes += report.len();
        history.reports.push_back(report.into());
        while history.reports.len() > 1
            && (history.reports.len() > KEPT_REPORTS || history.bytes > KEPT_BYTES)
        {
            if let Some(old) = history.reports.pop_front() {
                history.bytes -= old.len();
            }
        }
        history.batches += 1;
        history.totals.rows += counts.rows;
        history.totals.lost_offsets += counts.lost_offsets;
        history.totals.bad_records += counts.bad_records;
    }

    /// Listens on `addr` and serves the page there until the process ends.
    /// Returns the address listened on, which tells the port when `addr`
    /// asked for any.
    pub async fn serve(&self, addr: SocketAddr) -> Result<SocketAddr, StatusError> {
        let bind = |source| StatusError::Bind { addr, source };
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind)?;
        let local = listener.local_addr().map_err(bind)?;
        let status = self.clone();
        tokio::spawn(async move {
            loop {
                let stream = match listener.accept().await {
                    Ok((stream, _)) => stream,
                    // Out of file descriptors, say: the query goes on, and so
                    // does listening, after a pause that keeps this from spinning.
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a status page connection failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let status = status.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let status = status.clone();
                        async move { Ok::<_, Infallible>(status.respond(&request)) }
                    });
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                    {
                        tracing::debug!(error = %e, "a status page connection ended");
                    }
                });
            }
        });
        Ok(local)
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        // A panic while holding the lock leaves whole reports behind, so the
        // history stays good to show.
        self.shared
            .history
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn respond(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return text(
                StatusCode::METHOD_NOT_ALLOWED,
                "the status page takes GET only\n".to_owned(),
            );
        }
        let query = request.uri().query().unwrap_or("");
        match request.uri().path() {
            "/" | "/index.html" => body(StatusCode::OK, "text/html; charset=utf-8", PAGE.into()),
            "/assets/uplot.min.js" => body(
                StatusCode::OK,
                "text/javascript; charset=utf-8",
                UPLOT_JS.into(),
            ),
            "/assets/uplot.min.css" => {
                body(StatusCode::OK, "text/css; charset=utf-8", UPLOT_CSS.into())
            }
            "/metrics" => body(
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                (self.shared.metrics)(),
            ),
            "/api/about" => json_body(self.about_json().to_string()),
            "/api/progress" => match last_param(query) {
                Ok(last) => json_body(self.progress_json(last)),
                Err(message) => text(StatusCode::BAD_REQUEST, message),
            },
            other => text(
                StatusCode::NOT_FOUND,
                format!(
                    "{other} is not here: try /, /api/progress?last=N, /api/about or /metrics\n"
                ),
            ),
        }
    }

    fn about_json(&self) -> Value {
        let about = &self.shared.about;
        let history = self.history();
        json!({
            "name": about.name,
            "id": about.id,
            "runId": about.run_id,
            "trigger": about.trigger,
            "source": about.source,
            "store": about.store,
            "sink": about.sink,
            "startedAtMs": self.shared.started_at_ms,
            "uptimeMs": self.shared.started.elapsed().as_millis() as u64,
            "batches": history.batches,
            "rows": history.totals.rows,
            "lostOffsets": history.totals.lost_offsets,
            "badRecords": history.totals.bad_records,
            "keptReports": history.reports.len(),
        })
    }

    /// The newest `last` reports, oldest first, as one JSON array.
    fn progress_json(&self, last: usize) -> String {
        let history = self.history();
        let skip = history.reports.len().saturating_sub(last);
        let mut out = String::with_capacity(2 + history.bytes);
        out.push('[');
        for (n, report) in history.reports.iter().skip(skip).enumerate() {
            if n > 0 {
                out.push(',');
            }
            out.push_str(report);
        }
        out.push(']');
        out
    }
}

/// `last` from a query string: how many reports, 100 unless asked.
fn last_param(query: &str) -> Result<usize, String> {
    let Some(value) = query.split('&').find_map(|pair| pair.strip_prefix("last=")) else {
        return Ok(100);
    };
    match value.parse::<usize>() {
        Ok(n) if (1..=KEPT_REPORTS).contains(&n) => Ok(n),
        _ => Err(format!(
            "last={value}: give a whole number of reports from 1 to {KEPT_REPORTS}\n"
        )),
    }
}

fn body(status: StatusCode, content_type: &'static str, text: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text)));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The page polls: a cached answer would show a query standing still.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn json_body(text: String) -> Response<Full<Bytes>> {
    body(StatusCode::OK, "application/json", text)
}

fn text(status: StatusCode, message: String) -> Response<Full<Bytes>> {
    body(status, "text/plain; charset=utf-8", message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn status() -> Status {
        Status::new(
            About {
                name: Some("orders".to_owned()),
                id: "q-1".to_owned(),
                run_id: "r-1".to_owned(),
                trigger: "processing_time = 1s".to_owned(),
                source: "KafkaV2[Subscribe[orders]]".to_owned(),
                store: "/var/lib/sluice/orders".to_owned(),
                sink: "jsonl".to_owned(),
            },
            || "sluice_batches_total 3\n".to_owned(),
        )
    }

    fn report(batch: u64, padding: usize) -> String {
        json!({"batchId": batch, "pad": "x".repeat(padding)}).to_string()
    }

    /// One request over a real socket; the status line and the body.
    async fn get(addr: SocketAddr, target: &str) -> (String, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_owned(), body.to_owned())
    }

    fn batch_ids(text: &str) -> Vec<u64> {
        let reports: Vec<Value> = serde_json::from_str(text).unwrap();
        reports
            .iter()
            .map(|r| r["batchId"].as_u64().unwrap())
            .collect()
    }

    #[test]
    fn the_oldest_reports_go_past_the_count_and_the_newest_always_stays() {
        let status = status();
        for batch in 0..(KEPT_REPORTS as u64 + 5) {
            status.record(report(batch, 10), BatchCounts::default());
        }
        let ids = batch_ids(&status.progress_json(KEPT_REPORTS));
        assert_eq!(ids.len(), KEPT_REPORTS);
        assert_eq!(ids[0], 5);
        assert_eq!(*ids.last().unwrap(), KEPT_REPORTS as u64 + 4);

        // Reports too big to keep two of: only the newest is there.
        let big = KEPT_BYTES / 2 + 1;
        status.record(report(1000, big), BatchCounts::default());
        status.record(report(1001, big), BatchCounts::default());
        assert_eq!(batch_ids(&status.progress_json(10)), vec![1001]);
        assert!(status.history().bytes <= KEPT_BYTES);
    }

    #[test]
    fn totals_count_every_batch_recorded_not_only_those_kept() {
        let status = status();
        for batch in 0..(KEPT_REPORTS as u64 + 10) {
            let counts = BatchCounts {
                rows: 10,
                lost_offsets: u64::from(batch == 3) * 7,
                bad_records: 1,
            };
            status.record(report(batch, 0), counts);
        }
        let about = status.about_json();
        assert_eq!(about["batches"], KEPT_REPORTS as u64 + 10);
        assert_eq!(about["rows"], (KEPT_REPORTS as u64 + 10) * 10);
        assert_eq!(about["lostOffsets"], 7);
        assert_eq!(about["badRecords"], KEPT_REPORTS as u64 + 10);
        assert_eq!(about["keptReports"], KEPT_REPORTS);
        assert_eq!(about["name"], "orders");
        assert_eq!(about["runId"], "r-1");
    }

    #[test]
    fn last_is_a_count_within_what_is_kept() {
        assert_eq!(last_param(""), Ok(100));
        assert_eq!(last_param("last=5"), Ok(5));
        assert_eq!(last_param("x=1&last=600"), Ok(600));
        for bad in ["last=0", "last=601", "last=-1", "last=ten", "last="] {
            let said = last_param(bad).unwrap_err();
            assert!(said.contains("from 1 to 600"), "{bad}: {said}");
        }
    }

    #[tokio::test]
    async fn every_route_answers_over_a_real_socket() {
        let status = status();
        for batch in 0..3 {
            status.record(report(batch, 0), BatchCounts::default());
        }
        let addr = status.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();

        let (line, page) = get(addr, "/").await;
        assert_eq!(line, "HTTP/1.1 200 OK");
        assert!(page.contains("<title>") && page.contains("/assets/uplot.min.js"));
        assert!(
            !page.contains("http://") && !page.contains("https://"),
            "no external assets"
        );
        let (line, js) = get(addr, "/assets/uplot.min.js").await;
        assert_eq!(line, "HTTP/1.1 200 OK");
        assert!(js.contains("uPlot"));

        let (_, reports) = get(addr, "/api/progress?last=2").await;
        assert_eq!(batch_ids(&reports), vec![1, 2]);
        let (_, reports) = get(addr, "/api/progress").await;
        assert_eq!(batch_ids(&reports), vec![0, 1, 2]);
        let (line, said) = get(addr, "/api/progress?last=0").await;
        assert_eq!(line, "HTTP/1.1 400 Bad Request");
        assert!(said.contains("last=0"), "{said}");

        let (_, about) = get(addr, "/api/about").await;
        let about: Value = serde_json::from_str(&about).unwrap();
        assert_eq!(about["id"], "q-1");
        assert_eq!(about["batches"], 3);

        let (_, metrics) = get(addr, "/metrics").await;
        assert_eq!(metrics, "sluice_batches_total 3\n");
        let (line, said) = get(addr, "/nothing").await;
        assert_eq!(line, "HTTP/1.1 404 Not Found");
        assert!(said.contains("/api/progress"), "{said}");
    }

    #[tokio::test]
    async fn an_address_in_use_is_named() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let error = status().serve(addr).await.unwrap_err();
        let said = error.to_string();
        assert!(said.contains(&addr.to_string()), "{said}");
        assert!(said.contains("in use"), "{said}");
    }
}
