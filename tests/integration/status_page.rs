//! The status page in a real headless Chromium, while a query runs.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::kafka::{create_topic, delete_topic, numbered, produce, producer};
use sluice_tests::process::{Running, stderr};

use crate::runner::Job;

/// Debian's package, which `.ci/run` installs.
const CHROMIUM: &str = "/usr/bin/chromium";

/// One GET over a fresh connection: the status code and the body.
pub(crate) fn get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_owned())
}

pub(crate) fn get_json(addr: &str, path: &str) -> Value {
    let (code, body) = get(addr, path);
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// Runs headless Chromium on `url` with `what` (`--dump-dom`, or
/// `--screenshot=<file>`), letting the page's scripts run for 5 s of virtual
/// time; returns what it printed.
fn chromium(url: &str, what: &str, profile: &Path) -> String {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: install Debian's chromium package (.ci/run does)"
    );
    // coreutils' timeout: a Chromium that hangs fails the test instead of
    // holding the run.
    let output = Command::new("timeout")
        .args(["120", CHROMIUM])
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1280,1500",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(what)
        .arg(url)
        .output()
        .expect("running chromium");
    assert!(
        output.status.success(),
        "chromium {what} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The text of the element with `id`, in the DOM Chromium dumped.
fn text_of(dom: &str, id: &str) -> String {
    let open = format!("id=\"{id}\">");
    let from = dom
        .find(&open)
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let rest = &dom[from + open.len()..];
    rest[..rest.find('<').unwrap()].to_owned()
}

/// The attribute `name` of the element with `id`.
fn attribute_of(dom: &str, id: &str, name: &str) -> String {
    let from = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let tag = &dom[dom[..from].rfind('<').unwrap()..from + dom[from..].find('>').unwrap()];
    let key = format!("{name}=\"");
    let at = tag
        .find(&key)
        .unwrap_or_else(|| panic!("#{id} has no {name}: {tag}"));
    let value = &tag[at + key.len()..];
    value[..value.find('"').unwrap()].to_owned()
}

/// Thousands separated by commas, as the page shows them.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Waits until the query serving its page on `addr` has read `rows` rows.
async fn wait_until_read(addr: &str, rows: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let about = std::net::TcpStream::connect(addr)
            .ok()
            .map(|_| get_json(addr, "/api/about"));
        if about.as_ref().is_some_and(|a| a["rows"] == rows) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the query did not read {rows} rows: {about:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn artifacts() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test]
async fn the_status_page_renders_the_running_query_and_agrees_with_the_progress_api() {
    let topic = sluice_tests::unique_name("status");
    create_topic(&topic, 2).await;
    let p = producer();
    for partition in 0..2 {
        produce(
            &p,
            &topic,
            &numbered(partition, &format!("p{partition}"), 300),
        )
        .await;
    }

    let job = Job::new(&topic);
    let config = job.config_with(
        "max_offsets_per_trigger = 100",
        "processing_time = \"200ms\"",
    );
    let addr = format!("127.0.0.1:{}", free_port());
    // The records' keys joined with a lookup table, which the page lists.
    let keys = config.with_file_name("keys.csv");
    std::fs::write(&keys, "name,label\nk0,zero\nk1,one\n").unwrap();
    let lookup = format!(
        "[tables.keys]\npath = \"{}\"\nformat = \"csv\"\nschema = \"name STRING, label STRING\"\n\n\
         [query]\nsql = \"SELECT CAST(s.value AS STRING) AS v, k.label FROM source s \
         LEFT JOIN keys k ON CAST(s.key AS STRING) = k.name\"\n\n[progress]",
        keys.display()
    );
    // [progress] is the file's last table. The rows land in a Parquet table,
    // whose sink says what it wrote.
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("type = \"jsonl\"", "type = \"parquet\"")
        .replace("[progress]", &lookup)
        + &format!("metrics_addr = \"{addr}\"\n");
    std::fs::write(&config, text).unwrap();
    let runner = Running::spawn(&["run", "--config", config.to_str().unwrap()]);

    // Six batches of 100 read the 600 records; then the query idles, and what
    // the page shows stays still.
    wait_until_read(&addr, 600).await;
    let reports = get_json(&addr, "/api/progress?last=120");
    let about = get_json(&addr, "/api/about");

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}/");
    let dom = tokio::task::spawn_blocking({
        let (url, profile) = (url.clone(), profile.path().to_owned());
        move || chromium(&url, "--dump-dom", &profile)
    })
    .await
    .unwrap();
    let screenshot = artifacts().join("status-page.png");
    let _ = std::fs::remove_file(&screenshot);
    tokio::task::spawn_blocking({
        let (shot, profile) = (screenshot.clone(), profile.path().to_owned());
        move || chromium(&url, &format!("--screenshot={}", shot.display()), &profile)
    })
    .await
    .unwrap();
    // Nothing moved while Chromium looked.
    assert_eq!(get_json(&addr, "/api/progress?last=120"), reports);

    let reports = reports.as_array().unwrap();
    let last = reports.last().unwrap();
    assert!(reports.len() >= 6, "{reports:?}");
    assert!(
        dom.contains(&format!("data-last-batch=\"{}\"", last["batchId"])),
        "the page shows the last batch"
    );
    assert_eq!(text_of(&dom, "last-batch"), last["batchId"].to_string());
    assert_eq!(
        text_of(&dom, "last-rows"),
        grouped(last["numInputRows"].as_u64().unwrap())
    );
    assert_eq!(text_of(&dom, "query-id"), about["id"].as_str().unwrap());
    assert_eq!(text_of(&dom, "run-id"), about["runId"].as_str().unwrap());
    assert_eq!(text_of(&dom, "name"), "runner-test");
    assert_eq!(text_of(&dom, "total-rows"), "600");
    assert_eq!(
        text_of(&dom, "total-batches"),
        grouped(reports.len() as u64)
    );
    assert_eq!(text_of(&dom, "charted"), reports.len().to_string());
    assert_eq!(text_of(&dom, "trigger"), "processing_time = 200ms");
    // The read amplification as the last report gives it, once librdkafka's
    // first statistics (a second in) came.
    let metrics = &last["sources"][0]["metrics"];
    let shown = text_of(&dom, "last-amplification");
    match metrics["readAmplification"].as_str() {
        Some(recent) => assert!(
            shown.starts_with(&format!(
                "{recent}× (since the start {}×",
                metrics["readAmplificationTotal"].as_str().unwrap()
            )),
            "{shown} for {metrics}"
        ),
        None => assert_eq!(shown, "–", "{metrics}"),
    }

    // Every chart drew every report, on a canvas of uPlot's.
    for chart in [
        "chart-rates",
        "chart-duration",
        "chart-rows",
        "chart-behind",
    ] {
        assert_eq!(
            attribute_of(&dom, chart, "data-points"),
            reports.len().to_string(),
            "{chart}"
        );
        let from = dom.find(&format!("id=\"{chart}\"")).unwrap();
        let inside = &dom[from..from
            + dom[from..]
                .find("class=\"chart\"")
                .unwrap_or(dom.len() - from)];
        assert!(inside.contains("<canvas"), "{chart} has no canvas");
    }

    // The partition table: each partition's committed offset is the last
    // batch's end, 300, with nothing behind.
    for partition in 0..2 {
        let row = format!("data-partition=\"{topic}-{partition}\"");
        let at = dom
            .find(&row)
            .unwrap_or_else(|| panic!("no row for partition {partition}"));
        let tag = &dom[at..at + dom[at..].find('>').unwrap()];
        let end = &last["sources"][0]["endOffset"][&topic][partition.to_string()];
        assert_eq!(end, 300);
        assert!(tag.contains(&format!("data-committed=\"{end}\"")), "{tag}");
        assert!(tag.contains("data-latest=\"300\""), "{tag}");
    }
    // The lookup table as the last report has it.
    let table = &last["lookupTables"][0];
    assert_eq!(table["numRows"], 2, "{table}");
    let at = dom
        .find("data-table=\"keys\"")
        .expect("a row for the lookup table");
    let row = &dom[at..at + dom[at..].find("</tr>").unwrap()];
    assert!(row.contains("data-rows=\"2\""), "{row}");
    assert!(
        row.contains(table["version"].as_str().unwrap()),
        "the version the batch joined: {row}"
    );
    // What the sink wrote in the last batch, as its report says.
    let written = &last["sink"]["metrics"];
    assert_eq!(written["rowsWritten"], "100", "{written}");
    for metric in ["filesWritten", "bytesWritten", "rowsWritten"] {
        let at = dom
            .find(&format!("data-metric=\"{metric}\""))
            .unwrap_or_else(|| panic!("no row for the sink's {metric}"));
        let row = &dom[at..at + dom[at..].find("</tr>").unwrap()];
        let value: u64 = written[metric].as_str().unwrap().parse().unwrap();
        assert!(row.contains(&grouped(value)), "{metric}: {row}");
    }
    let png = std::fs::read(&screenshot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "a screenshot of the page"
    );

    runner.signal("-TERM");
    let output = tokio::task::spawn_blocking(move || runner.wait())
        .await
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stderr(&output).contains(&format!("serving the status page on http://{addr}/")),
        "{}",
        stderr(&output)
    );
    delete_topic(&topic).await;
}

#[tokio::test]
async fn a_query_of_two_sources_shows_each_ones_part_of_the_last_batch() {
    let orders = sluice_tests::unique_name("statusorders");
    let payments = sluice_tests::unique_name("statuspayments");
    create_topic(&orders, 2).await;
    create_topic(&payments, 1).await;
    let p = producer();
    let batch: Vec<sluice_tests::kafka::Out> = (0..20_u64)
        .map(|i| {
            sluice_tests::kafka::Out::new(
                (i % 2) as i32,
                format!("k{i}"),
                format!(r#"{{"order":{i},"customer":"c{i}"}}"#),
            )
        })
        .collect();
    produce(&p, &orders, &batch).await;
    let values: Vec<(i32, Option<Vec<u8>>)> = (0..5_u64)
        .map(|n| (0, Some(crate::sql::avro_order(12, n))))
        .collect();
    sluice_tests::kafka::produce_values(&p, &payments, &values).await;

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("order.avsc"), crate::sources::ORDER_AVSC).unwrap();
    let sources = crate::sources::sources(dir.path(), &orders, &payments, false);
    let config = crate::sources::config(dir.path(), "query.toml", &sources);
    let addr = format!("127.0.0.1:{}", free_port());
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("available_now = true", "processing_time = \"200ms\"")
        .replace(
            "[progress]\n",
            &format!("[progress]\nmetrics_addr = \"{addr}\"\n"),
        );
    std::fs::write(&config, text).unwrap();
    let runner = Running::spawn(&["run", "--config", config.to_str().unwrap()]);
    wait_until_read(&addr, 25).await;
    let reports = get_json(&addr, "/api/progress?last=120");
    let last = reports.as_array().unwrap().last().unwrap().clone();
    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}/");
    let dom = tokio::task::spawn_blocking({
        let profile = profile.path().to_owned();
        move || chromium(&url, "--dump-dom", &profile)
    })
    .await
    .unwrap();

    let from = dom
        .find("id=\"sources\"")
        .expect("a section for the sources");
    let tag = &dom[from..from + dom[from..].find('>').unwrap()];
    assert!(!tag.contains("hidden"), "shown for two sources: {tag}");
    let section = &dom[from..from + dom[from..].find("</section>").unwrap()];
    let rows: Vec<&str> = section.split("<tr data-rows=").skip(1).collect();
    assert_eq!(rows.len(), 2, "{section}");
    for (row, (source, topic)) in rows.iter().zip(
        last["sources"]
            .as_array()
            .unwrap()
            .iter()
            .zip([&orders, &payments]),
    ) {
        let read = source["numInputRows"].as_u64().unwrap();
        assert!(
            row.starts_with(&format!("\"{read}\"")),
            "{row} for {source}"
        );
        assert!(row.contains(topic.as_str()), "{row}");
    }

    // Each source's rows since the start, as /metrics counts them.
    let (code, metrics) = get(&addr, "/metrics");
    assert_eq!(code, 200);
    for (topic, rows) in [(&orders, 20), (&payments, 5)] {
        let line = metrics
            .lines()
            .find(|l| l.starts_with("sluice_source_input_rows_total") && l.contains(topic.as_str()))
            .unwrap_or_else(|| panic!("no rows of {topic}: {metrics}"));
        assert!(line.ends_with(&format!(" {rows}")), "{line}");
    }

    runner.signal("-TERM");
    let output = tokio::task::spawn_blocking(move || runner.wait())
        .await
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    delete_topic(&orders).await;
    delete_topic(&payments).await;
}
