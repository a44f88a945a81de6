//! SQL over the stream against the real broker: a JSON topic filtered and
//! projected exactly once through SIGKILLs, bad records under each policy, the
//! Kafka and Cassandra sinks fed by a query's columns, and bad SQL refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use datafusion::arrow::array::RecordBatch;
use datafusion::prelude::SessionContext;
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use serde_json::Value;
use sluice_tests::kafka::{
    Out, TIMEOUT, create_topic, delete_topic, produce, produce_values, producer,
};
use sluice_tests::process::{Lcg, run, stderr};

/// The order numbered `n`, as JSON: its customer and amount follow from `n`.
fn order(n: u64) -> String {
    format!(
        r#"{{"order":{n},"customer":"c{}","amount":{},"note":"n{n}"}}"#,
        n % 7,
        n * 37 % 1000
    )
}

pub(crate) const SCHEMA: &str = "order BIGINT, customer STRING, amount BIGINT";
pub(crate) const SQL: &str = "SELECT order, upper(customer) AS customer, amount * 2 AS doubled, \
                   CASE WHEN amount > 900 THEN 'big' ELSE 'small' END AS size, partition \
                   FROM orders WHERE amount > 500 AND customer <> 'c3'";

/// A query's folder: its config, checkpoint, output and progress.
pub(crate) struct Job {
    dir: tempfile::TempDir,
    /// `[checkpoint]`'s lines: a folder of the job's, or a Cassandra query.
    checkpoint: Option<String>,
}

impl Job {
    pub(crate) fn new() -> Job {
        Job {
            dir: tempfile::tempdir().unwrap(),
            checkpoint: None,
        }
    }

    /// A job whose offsets are kept in Cassandra when `cassandra`.
    pub(crate) fn with_store(cassandra: bool) -> Job {
        let mut job = Job::new();
        if cassandra {
            job.checkpoint = Some(sluice_tests::cassandra_checkpoint("sluice_state_tests"));
        }
        job
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes a config reading `topic` with `source_extra` under `[source]`,
    /// and `rest` (`[sink]`, `[query]`, ...) after the checkpoint.
    pub(crate) fn config(
        &self,
        topic: &str,
        source_extra: &str,
        trigger: &str,
        rest: &str,
    ) -> PathBuf {
        let text = format!(
            r#"
[source]
bootstrap_servers = "{bootstrap}"
subscribe = ["{topic}"]
starting_offsets = "earliest"
max_offsets_per_trigger = 300
poll_timeout_ms = 20000
{source_extra}

[checkpoint]
{checkpoint}

[trigger]
{trigger}

[progress]
file = "{progress}"

{rest}
"#,
            bootstrap = sluice_tests::kafka_bootstrap(),
            checkpoint = self
                .checkpoint
                .clone()
                .unwrap_or_else(|| format!("location = \"{}\"", self.path("checkpoint").display())),
            progress = self.path("progress.jsonl").display(),
        );
        let path = self.path("query.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    /// The bad records the progress reports counted, over all batches.
    fn bad_records(&self) -> u64 {
        self.progress()
            .iter()
            .map(|p| {
                p["sources"][0]["metrics"]["badRecords"]
                    .as_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
            .sum()
    }

    pub(crate) fn progress(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("progress.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// Every JSON line of the `.jsonl` files in `dir`.
pub(crate) fn lines(dir: &Path) -> Vec<Value> {
    let mut all = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return all;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "jsonl") {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                all.push(serde_json::from_str(line).unwrap());
            }
        }
    }
    all
}

/// Rows as JSON values, sorted, to compare as multisets.
pub(crate) fn sorted(mut rows: Vec<Value>) -> Vec<Value> {
    rows.sort_by_key(|v| v.to_string());
    rows
}

/// The oracle: the same SQL run by DataFusion once over all the records, decoded
/// by DataFusion's own JSON reader, with the Kafka column the query uses.
pub(crate) async fn oracle(records: &[(i32, String)]) -> Vec<Value> {
    let mut text = String::new();
    for (partition, value) in records {
        let mut object: serde_json::Map<String, Value> = serde_json::from_str(value).unwrap();
        object.insert("partition".into(), Value::from(*partition));
        text.push_str(&Value::Object(object).to_string());
        text.push('\n');
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), text).unwrap();
    let ctx = SessionContext::new();
    let schema = datafusion::arrow::datatypes::Schema::new(vec![
        datafusion::arrow::datatypes::Field::new(
            "order",
            datafusion::arrow::datatypes::DataType::Int64,
            true,
        ),
        datafusion::arrow::datatypes::Field::new(
            "customer",
            datafusion::arrow::datatypes::DataType::Utf8,
            true,
        ),
        datafusion::arrow::datatypes::Field::new(
            "amount",
            datafusion::arrow::datatypes::DataType::Int64,
            true,
        ),
        datafusion::arrow::datatypes::Field::new(
            "partition",
            datafusion::arrow::datatypes::DataType::Int32,
            false,
        ),
    ]);
    let options = datafusion::prelude::JsonReadOptions::default()
        .schema(&schema)
        .file_extension("");
    ctx.register_json("orders", file.path().to_str().unwrap(), options)
        .await
        .unwrap();
    let batches: Vec<RecordBatch> = ctx.sql(SQL).await.unwrap().collect().await.unwrap();
    let mut out = Vec::new();
    let mut writer = datafusion::arrow::json::LineDelimitedWriter::new(&mut out);
    for batch in &batches {
        writer.write(batch).unwrap();
    }
    writer.finish().unwrap();
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Keeps producing orders over `partitions` partitions until told to stop;
/// returns every (partition, value) produced.
pub(crate) fn keep_producing(
    topic: String,
    partitions: i32,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(i32, String)>> {
    tokio::spawn(async move {
        let p = producer();
        let mut produced = Vec::new();
        let mut n = 0_u64;
        while !stop.load(Ordering::Relaxed) {
            let mut batch = Vec::new();
            for _ in 0..40 {
                let partition = (n % partitions as u64) as i32;
                batch.push(Out::new(partition, format!("k{n}"), order(n)));
                produced.push((partition, order(n)));
                n += 1;
            }
            produce(&p, &topic, &batch).await;
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        produced
    })
}

#[tokio::test]
async fn a_json_topic_filtered_by_sql_reaches_jsonl_exactly_once_through_sigkills() {
    let topic = sluice_tests::unique_name("sqlcrash");
    create_topic(&topic, 3).await;
    let job = Job::new();
    let out = job.path("out");
    let rest = format!(
        "[sink]\ntype = \"jsonl\"\npath = \"{}\"\n\n[query]\nsql = \"{SQL}\"\n",
        out.display()
    );
    let source = format!("table = \"orders\"\nformat = \"json\"\nschema = \"{SCHEMA}\"");
    let streaming = job.config(&topic, &source, "processing_time = \"0s\"", &rest);

    let stop = Arc::new(AtomicBool::new(false));
    let producer_task = keep_producing(topic.clone(), 3, stop.clone());
    let mut random = Lcg::from_clock("sql crash test");
    let progress = job.path("progress.jsonl");
    let before = sluice_tests::process::committed_batches(&progress);
    sluice_tests::process::kill_at_random_moments(&streaming, 10, (300, 900), &mut random).await;
    sluice_tests::process::assert_committed_since(&progress, before, "10 killed runs");
    stop.store(true, Ordering::Relaxed);
    let produced = producer_task.await.unwrap();

    let catch_up = job.config(&topic, &source, "available_now = true", &rest);
    let output = run(&["run", "--config", catch_up.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let got = sorted(lines(&out));
    let want = sorted(oracle(&produced).await);
    println!(
        "{} orders produced, {} rows out, {} batches",
        produced.len(),
        got.len(),
        job.progress().len()
    );
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len(), "no row lost or duplicated");
    assert_eq!(
        got, want,
        "the rows DataFusion makes of all the records at once"
    );
    delete_topic(&topic).await;
}

/// Ten records on one partition, of which offsets 2, 5 and 7 do not decode.
async fn topic_with_bad_records() -> String {
    let topic = sluice_tests::unique_name("sqlbad");
    create_topic(&topic, 1).await;
    let values: Vec<String> = (0..10)
        .map(|n| match n {
            2 => "not json".to_owned(),
            5 => r#"{"order":"five"}"#.to_owned(),
            7 => r#"{"order":7}{"order":8}"#.to_owned(),
            n => order(n),
        })
        .collect();
    let records: Vec<Out> = values.iter().map(|v| Out::new(0, "k", v.clone())).collect();
    produce(&producer(), &topic, &records).await;
    topic
}

#[tokio::test]
async fn bad_records_stop_the_query_or_are_skipped_or_go_to_the_dead_letters() {
    let topic = topic_with_bad_records().await;
    let source = |policy: &str| {
        format!("format = \"json\"\nschema = \"{SCHEMA}\"\non_bad_record = \"{policy}\"")
    };
    let sink = |job: &Job| {
        format!(
            "[sink]\ntype = \"jsonl\"\npath = \"{}\"\n",
            job.path("out").display()
        )
    };

    // fail: the position and the decoder's reason; nothing committed.
    let job = Job::new();
    let config = job.config(&topic, &source("fail"), "available_now = true", &sink(&job));
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(5), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains(&format!("record {topic}-0@2 cannot be processed:")),
        "{err}"
    );
    assert!(err.contains("on_bad_record"), "{err}");
    assert!(job.progress().is_empty(), "no batch committed");

    // skip: counted exactly in the progress reports.
    let job = Job::new();
    let config = job.config(&topic, &source("skip"), "available_now = true", &sink(&job));
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let bad = job.bad_records();
    assert_eq!(bad, 3);
    let orders: Vec<i64> = lines(&job.path("out"))
        .iter()
        .map(|v| v["order"].as_i64().unwrap())
        .collect();
    assert_eq!(orders, [0, 1, 3, 4, 6, 8, 9]);

    // dead_letter to a directory: the records as read, with the reason.
    let job = Job::new();
    let dead = job.path("dead");
    let rest = format!(
        "{}\n[dead_letter]\npath = \"{}\"\n",
        sink(&job),
        dead.display()
    );
    let config = job.config(
        &topic,
        &source("dead_letter"),
        "available_now = true",
        &rest,
    );
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let letters = lines(&dead);
    let offsets: Vec<i64> = letters
        .iter()
        .map(|v| v["offset"].as_i64().unwrap())
        .collect();
    assert_eq!(offsets, [2, 5, 7]);
    assert_eq!(letters[0]["value"], "not json");
    let reason = letters[1]["headers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["key"] == "sluice.error")
        .unwrap()["value"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(reason.contains("order"), "{reason}");

    // dead_letter to a Kafka topic.
    let dead_topic = sluice_tests::unique_name("sqldead");
    create_topic(&dead_topic, 1).await;
    let job = Job::new();
    let rest = format!("{}\n[dead_letter]\ntopic = \"{dead_topic}\"\n", sink(&job));
    let config = job.config(
        &topic,
        &source("dead_letter"),
        "available_now = true",
        &rest,
    );
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let read = read_topic(&dead_topic, 3).await;
    let positions: Vec<String> = read
        .iter()
        .map(|m| m.headers["sluice.position"].clone())
        .collect();
    assert_eq!(
        positions,
        [2, 5, 7].map(|o| format!("{topic}-0@{o}")),
        "each bad record once"
    );
    assert!(read.iter().all(|m| m.headers.contains_key("sluice.error")));
    delete_topic(&topic).await;
    delete_topic(&dead_topic).await;
}

/// An Avro long: zig-zag encoded, then as a variable-length integer.
pub(crate) fn avro_long(out: &mut Vec<u8>, n: i64) {
    let mut z = ((n << 1) ^ (n >> 63)) as u64;
    while z >= 0x80 {
        out.push((z as u8) | 0x80);
        z >>= 7;
    }
    out.push(z as u8);
}

/// The order numbered `n` as Confluent's serializer frames it: a zero byte, the
/// schema id, then the datum of `{order: long, customer: string, amount: long}`.
pub(crate) fn avro_order(schema_id: u32, n: u64) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&schema_id.to_be_bytes());
    avro_long(&mut out, n as i64);
    let customer = format!("c{}", n % 7);
    avro_long(&mut out, customer.len() as i64);
    out.extend_from_slice(customer.as_bytes());
    avro_long(&mut out, (n * 37 % 1000) as i64);
    out
}

#[tokio::test]
async fn an_avro_topic_in_confluents_framing_is_decoded_and_queried() {
    let topic = sluice_tests::unique_name("sqlavro");
    create_topic(&topic, 2).await;
    // 40 orders, a tombstone, and one written with another schema id.
    let mut values: Vec<(i32, Option<Vec<u8>>)> = (0..40)
        .map(|n| ((n % 2) as i32, Some(avro_order(12, n))))
        .collect();
    values.push((0, None));
    values.push((1, Some(avro_order(13, 99))));
    produce_values(&producer(), &topic, &values).await;
    let job = Job::new();
    std::fs::write(
        job.path("order.avsc"),
        r#"{"type": "record", "name": "Order", "namespace": "shop", "fields": [
            {"name": "order", "type": "long"},
            {"name": "customer", "type": "string"},
            {"name": "amount", "type": "long"}]}"#,
    )
    .unwrap();
    let source = format!(
        "format = \"avro\"\nschema_file = \"{}\"\navro_wire_format = \"confluent\"\n\
         avro_schema_id = 12\non_bad_record = \"skip\"",
        job.path("order.avsc").display()
    );
    let rest = format!(
        "[sink]\ntype = \"jsonl\"\npath = \"{}\"\n\n[query]\nsql = \"SELECT order, upper(customer) AS \
         customer, amount FROM source WHERE amount > 500 OR order IS NULL\"\n",
        job.path("out").display()
    );
    let config = job.config(&topic, &source, "available_now = true", &rest);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let mut want: Vec<Value> = (0..40_u64)
        .filter(|n| n * 37 % 1000 > 500)
        .map(|n| serde_json::json!({"order": n, "customer": format!("C{}", n % 7), "amount": n * 37 % 1000}))
        .collect();
    // The tombstone is a row of nulls.
    want.push(serde_json::json!({"order": null, "customer": null, "amount": null}));
    assert_eq!(sorted(lines(&job.path("out"))), sorted(want));
    let bad = job.bad_records();
    assert_eq!(bad, 1, "the record with schema id 13");
    delete_topic(&topic).await;
}

/// A message read back: key, value and headers.
struct Read {
    key: Option<String>,
    value: Option<String>,
    headers: BTreeMap<String, String>,
}

async fn read_topic(topic: &str, count: usize) -> Vec<Read> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = sluice_tests::kafka::client_config()
            .set("group.id", sluice_tests::unique_name("g"))
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        consumer.subscribe(&[&topic]).unwrap();
        let mut read = Vec::new();
        let deadline = std::time::Instant::now() + TIMEOUT;
        while read.len() < count && std::time::Instant::now() < deadline {
            let Some(message) = consumer.poll(std::time::Duration::from_millis(200)) else {
                continue;
            };
            let message = message.unwrap();
            let text = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
            let headers = message
                .headers()
                .map(|h| {
                    (0..h.count())
                        .map(|i| h.get(i))
                        .map(|h| (h.key.to_owned(), text(h.value).unwrap_or_default()))
                        .collect()
                })
                .unwrap_or_default();
            read.push(Read {
                key: text(message.key()),
                value: text(message.payload()),
                headers,
            });
        }
        read
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn the_kafka_sink_takes_key_value_and_headers_from_the_query() {
    let topic = sluice_tests::unique_name("sqlkin");
    let out_topic = sluice_tests::unique_name("sqlkout");
    create_topic(&topic, 2).await;
    create_topic(&out_topic, 1).await;
    let records: Vec<Out> = (0..50)
        .map(|n| Out::new((n % 2) as i32, "k", order(n)))
        .collect();
    produce(&producer(), &topic, &records).await;
    let job = Job::new();
    let rest = format!(
        "[sink]\ntype = \"kafka\"\ntopic = \"{out_topic}\"\n\n[query]\nsql = \"SELECT customer AS key, \
         CAST(order AS STRING) AS value, [named_struct('key', 'amount', 'value', CAST(CAST(amount AS STRING) AS BYTEA))] AS headers \
         FROM source WHERE amount >= 500\"\n"
    );
    let source = format!("format = \"json\"\nschema = \"{SCHEMA}\"");
    let config = job.config(&topic, &source, "available_now = true", &rest);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let want: Vec<u64> = (0..50).filter(|n| n * 37 % 1000 >= 500).collect();
    let read = read_topic(&out_topic, want.len()).await;
    let mut got: Vec<(u64, String, String)> = read
        .iter()
        .map(|m| {
            (
                m.value.as_deref().unwrap().parse().unwrap(),
                m.key.clone().unwrap(),
                m.headers["amount"].clone(),
            )
        })
        .collect();
    got.sort();
    let want: Vec<(u64, String, String)> = want
        .iter()
        .map(|n| (*n, format!("c{}", n % 7), (n * 37 % 1000).to_string()))
        .collect();
    assert_eq!(got, want);
    assert!(
        read.iter()
            .all(|m| m.headers.contains_key("sluice.position"))
    );
    delete_topic(&topic).await;
    delete_topic(&out_topic).await;
}

#[tokio::test]
async fn the_cassandra_sink_maps_a_querys_columns_by_name() {
    let topic = sluice_tests::unique_name("sqlcass");
    create_topic(&topic, 2).await;
    let records: Vec<Out> = (0..40)
        .map(|n| Out::new((n % 2) as i32, "k", order(n)))
        .collect();
    produce(&producer(), &topic, &records).await;
    let (session, keyspace) = sluice_tests::keyspace_with(
        "sqlshop",
        &["CREATE TABLE {keyspace}.orders (order_id bigint PRIMARY KEY, customer text, amount bigint, seen timestamp)"],
    )
    .await;
    let job = Job::new();
    let rest = format!(
        "[sink]\ntype = \"cassandra\"\nnodes = \"{}\"\nkeyspace = \"{keyspace}\"\ntable = \"orders\"\n\
         [sink.columns]\norder_id = \"order\"\n\n[query]\nsql = \"SELECT order, customer, amount, timestamp AS seen FROM source\"\n",
        sluice_tests::cassandra_nodes().join(",")
    );
    let source = format!("format = \"json\"\nschema = \"{SCHEMA}\"");
    let config = job.config(&topic, &source, "available_now = true", &rest);
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    let rows = session
        .query_unpaged(
            format!("SELECT order_id, customer, amount FROM {keyspace}.orders"),
            (),
        )
        .await
        .unwrap()
        .into_rows_result()
        .unwrap();
    let mut got: Vec<(i64, String, i64)> = rows
        .rows::<(i64, String, i64)>()
        .unwrap()
        .map(Result::unwrap)
        .collect();
    got.sort();
    let want: Vec<(i64, String, i64)> = (0..40)
        .map(|n| (n as i64, format!("c{}", n % 7), (n * 37 % 1000) as i64))
        .collect();
    assert_eq!(got, want);

    // An output column the table lacks is refused before anything runs.
    let bad = job.config(
        &topic,
        &source,
        "available_now = true",
        &rest.replace("timestamp AS seen", "timestamp AS when_seen"),
    );
    let output = run(&["run", "--config", bad.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("when_seen"), "{}", stderr(&output));
    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap();
    delete_topic(&topic).await;
}

#[test]
fn bad_sql_exits_2_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = |source_extra: &str, sql: &str| {
        let text = format!(
            r#"
[source]
bootstrap_servers = "127.0.0.1:9092"
subscribe = ["t"]
table = "orders"
{source_extra}
[checkpoint]
location = "{}"
[sink]
type = "console"
[query]
sql = """{sql}"""
"#,
            dir.path().join("cp").display()
        );
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, text).unwrap();
        path
    };
    let json = format!("format = \"json\"\nschema = \"{SCHEMA}\"");
    let cases: Vec<(String, &str, &str)> = vec![
        (json.clone(), "SELEC order FROM orders", "SQL syntax error"),
        (
            json.clone(),
            "SELECT amout FROM orders",
            "Did you mean 'orders.amount'?",
        ),
        (
            json.clone(),
            "SELECT order FROM shipments",
            "the stream is the table `orders`",
        ),
        (json.clone(), "SELECT customer + 1 FROM orders", "Utf8"),
        (
            json.clone(),
            "SELECT now() AS t FROM orders",
            "now() cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT random() FROM orders",
            "random() cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT order FROM orders ORDER BY order",
            "ORDER BY cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT order FROM orders LIMIT 5",
            "LIMIT cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT a.order FROM orders a JOIN orders b ON a.order = b.order",
            "a join of the stream with itself cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT count(*) AS n FROM orders GROUP BY window(timestamp, '1 minute')",
            "for an aggregation without a watermark cannot run on a stream",
        ),
        (
            json.clone(),
            "SELECT order, row_number() OVER (ORDER BY order) FROM orders",
            "OVER",
        ),
        (
            json.clone(),
            "SELECT order FROM orders WHERE amount > (SELECT 1)",
            "a subquery cannot run on a stream",
        ),
        (
            json.clone(),
            "INSERT INTO orders VALUES (1, 'a', 2)",
            "other than SELECT",
        ),
        (
            "format = \"json\"\nschema = \"order BIGINT, amount DOUBEL\"".to_owned(),
            "SELECT order FROM orders",
            "did you mean `DOUBLE`?",
        ),
        (
            "format = \"json\"".to_owned(),
            "SELECT order FROM orders",
            "needs source.schema",
        ),
        (
            "format = \"avro\"\nschema = \"a INT\"".to_owned(),
            "SELECT a FROM orders",
            "source.schema is not a usable Avro schema: it is not JSON",
        ),
        (
            "format = \"avro\"\nschema = '{\"type\": \"record\", \"name\": \"R\", \"fields\": [{\"name\": \"a\", \"type\": \"int\"}]}'\navro_wire_format = \"protobuf\"".to_owned(),
            "SELECT a FROM orders",
            "avro_wire_format must be \"raw\" or \"confluent\"",
        ),
    ];
    for (source, sql, expected) in &cases {
        for command in ["run", "validate"] {
            let path = config(source, sql);
            let output = run(&[command, "--config", path.to_str().unwrap()]);
            let err = stderr(&output);
            assert_eq!(output.status.code(), Some(2), "{command} {sql}: {err}");
            assert!(
                err.contains(expected),
                "{command} {sql}: expected {expected:?} in {err}"
            );
            assert!(!err.contains("panicked"), "{sql}: {err}");
            let last = err.lines().last().unwrap_or_default();
            assert!(last.starts_with("sluice: "), "one line at the end: {err}");
            assert!(
                !dir.path().join("cp").exists(),
                "{sql}: bad SQL touched the checkpoint"
            );
        }
    }
}

/// `batchWatermarkMs` in the checkpoint's plan of `batch`.
fn planned_watermark(job: &Job, batch: u64) -> i64 {
    let text = std::fs::read_to_string(
        job.path("checkpoint")
            .join("offsets")
            .join(batch.to_string()),
    )
    .unwrap();
    let metadata: Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
    metadata["batchWatermarkMs"].as_i64().unwrap()
}

#[tokio::test]
async fn the_watermark_trails_event_time_is_stored_with_each_plan_and_survives_a_restart() {
    watermark_through_a_restart(false).await;
}

#[tokio::test]
async fn the_watermark_survives_a_restart_with_the_cassandra_store() {
    watermark_through_a_restart(true).await;
}

/// Runs a watermarked query over 900 records in three batches, then over 300
/// more after a restart, checking each batch's watermark; with `cassandra`, the
/// offsets are kept there instead of in the checkpoint directory.
async fn watermark_through_a_restart(cassandra: bool) {
    let topic = sluice_tests::unique_name("watermark");
    create_topic(&topic, 1).await;
    // Record n happened n seconds after `base`.
    let base: i64 = 1_780_000_000_000;
    let time = |ms: i64| {
        let when = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms as u64);
        humantime::format_rfc3339_millis(when).to_string()
    };
    let at = |n: i64| time(base + n * 1000);
    let values = |range: std::ops::Range<i64>| -> Vec<(i32, Option<Vec<u8>>)> {
        range
            .map(|n| {
                let value = format!(r#"{{"n":{n},"ts":"{}"}}"#, at(n));
                (0, Some(value.into_bytes()))
            })
            .collect()
    };
    produce_values(&producer(), &topic, &values(0..900)).await;

    let job = Job::new();
    let source = "format = \"json\"\nschema = \"n BIGINT, ts TIMESTAMP\"\n\
                  event_time = \"ts\"\nwatermark_delay = \"10s\"";
    let sink = "[sink]\ntype = \"discard\"\n";
    let config = job.config(&topic, source, "available_now = true", sink);
    if cassandra {
        let text = std::fs::read_to_string(&config).unwrap();
        let directory = format!("location = \"{}\"", job.path("checkpoint").display());
        let store = sluice_tests::cassandra_checkpoint("sluice_sql_tests");
        assert!(text.contains(&directory), "{text}");
        std::fs::write(&config, text.replace(&directory, &store)).unwrap();
    }
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));

    // Three batches of 300: each runs under the latest event time before it,
    // less the delay.
    if !cassandra {
        assert_eq!(planned_watermark(&job, 0), 0);
        assert_eq!(planned_watermark(&job, 1), base + 299_000 - 10_000);
        assert_eq!(planned_watermark(&job, 2), base + 599_000 - 10_000);
    }
    let progress = job.progress();
    assert_eq!(progress.len(), 3);
    assert_eq!(progress[0]["eventTime"]["watermark"], time(0).as_str());
    assert_eq!(progress[2]["eventTime"]["watermark"], at(589).as_str());
    let event_time = &progress[1]["eventTime"];
    assert_eq!(event_time["watermark"], at(289).as_str(), "{event_time}");
    assert_eq!(event_time["min"], at(300).as_str(), "{event_time}");
    assert_eq!(event_time["max"], at(599).as_str(), "{event_time}");
    assert_eq!(
        event_time["avg"],
        time(base + 449_500).as_str(),
        "{event_time}"
    );

    // A restart continues from the last commit's next watermark.
    produce_values(&producer(), &topic, &values(900..1200)).await;
    let output = run(&["run", "--config", config.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr(&output));
    if !cassandra {
        assert_eq!(planned_watermark(&job, 3), base + 899_000 - 10_000);
    }
    let progress = job.progress();
    assert_eq!(progress.len(), 4);
    assert_eq!(
        progress[3]["eventTime"]["watermark"],
        at(889).as_str(),
        "the restart continued from the last commit's watermark"
    );
    if !cassandra {
        // Moved to Cassandra, the query goes on under the same watermark.
        let from = job.path("checkpoint").display().to_string();
        let to = sluice_tests::cassandra_location("sluice_sql_tests");
        let replication = sluice_tests::TEST_REPLICATION;
        let migrated = run(&[
            "offsets",
            "migrate",
            "--from",
            &from,
            "--to",
            &to,
            "--replication",
            replication,
        ]);
        assert!(migrated.status.success(), "{}", stderr(&migrated));
        let text = std::fs::read_to_string(&config).unwrap();
        let moved = text.replace(
            &format!("location = \"{from}\""),
            &format!("location = \"{to}\"\nreplication = \"{replication}\""),
        );
        assert_ne!(moved, text);
        std::fs::write(&config, moved).unwrap();
        produce_values(&producer(), &topic, &values(1200..1500)).await;
        let output = run(&["run", "--config", config.to_str().unwrap()]);
        assert!(output.status.success(), "{}", stderr(&output));
        let progress = job.progress();
        assert_eq!(progress.len(), 5);
        assert_eq!(progress[4]["batchId"], 4);
        assert_eq!(
            progress[4]["eventTime"]["watermark"],
            at(1189).as_str(),
            "the migrated query kept its watermark"
        );
    }

    // The column must be a timestamp: configuration error, exit 2.
    let bad = job.config(
        &topic,
        "format = \"json\"\nschema = \"n BIGINT, ts TIMESTAMP\"\nevent_time = \"n\"\n\
         watermark_delay = \"10s\"",
        "available_now = true",
        sink,
    );
    let output = run(&["validate", "--config", bad.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("source.event_time \"n\""),
        "{}",
        stderr(&output)
    );
    delete_topic(&topic).await;
}
