//! The configuration's checks, each with the message a user sees.

use super::*;

fn parse(text: &str) -> Result<Settings> {
    super::parse(text, "query.toml")
}

const MINIMAL: &str = r#"
        [source]
        bootstrap_servers = "127.0.0.1:9092"
        subscribe = ["events"]
        [checkpoint]
        location = "/tmp/q"
        [sink]
        type = "console"
    "#;

#[test]
fn kafka_secrets_come_from_the_environment_and_are_never_shown() {
    let config = |source: &str, sink: &str| {
        format!(
            "[source]\nbootstrap_servers = \"h:9094\"\nsubscribe = [\"events\"]\n\
                 [source.kafka]\n{source}\n[checkpoint]\nlocation = \"/tmp/q\"\n\
                 [sink]\ntype = \"kafka\"\ntopic = \"out\"\n{sink}"
        )
    };
    // SAFETY: no other test reads or writes this variable.
    unsafe { std::env::set_var("SLUICE_TEST_SASL_SECRET", "from-the-environment") };
    let source = "\"security.protocol\" = \"SASL_SSL\"\n\"sasl.username\" = \"u\"\n\
                      \"sasl.password_env\" = \"SLUICE_TEST_SASL_SECRET\"\nlinger = 1";
    let settings = parse(&config(source, "")).unwrap();
    assert_eq!(
        settings.kafka().client_options["sasl.password"],
        "from-the-environment"
    );
    assert!(
        !settings
            .kafka()
            .client_options
            .contains_key("sasl.password_env")
    );
    // The sink on the source's cluster reaches it as the source does, and
    // takes none of the source's other options.
    let SinkKind::Kafka(sink) = &settings.sink else {
        panic!("a kafka sink")
    };
    assert_eq!(sink.client_options["sasl.password"], "from-the-environment");
    assert_eq!(sink.client_options["security.protocol"], "SASL_SSL");
    assert!(!sink.client_options.contains_key("linger"));
    assert!(!format!("{:?}", settings.kafka()).contains("from-the-environment"));
    assert!(!format!("{sink:?}").contains("from-the-environment"));
    // Another cluster: the sink's own options only.
    let other = parse(&config(source, "bootstrap_servers = \"other:9092\"")).unwrap();
    let SinkKind::Kafka(sink) = &other.sink else {
        panic!("a kafka sink")
    };
    assert!(sink.client_options.is_empty());

    let err = |source: &str| format!("{:#}", parse(&config(source, "")).unwrap_err());
    assert!(err("\"sasl.password_env\" = \"SLUICE_TEST_UNSET_VAR\"").contains("which is not set"));
    assert!(
        err("\"sasl.password\" = \"a\"\n\"sasl.password_env\" = \"SLUICE_TEST_SASL_SECRET\"")
            .contains("not both")
    );
    let shown = err("\"sasl.password\" = [\"hunter2-in-a-list\"]");
    assert!(shown.contains("sasl.password must be a string"), "{shown}");
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[test]
fn a_metrics_port_alone_listens_on_loopback_only() {
    for text in ["9464", ":9464", "127.0.0.1:9464"] {
        assert_eq!(metrics_listen(text).unwrap().to_string(), "127.0.0.1:9464");
    }
    assert_eq!(
        metrics_listen("0.0.0.0:9464").unwrap().to_string(),
        "0.0.0.0:9464"
    );
    let err = format!("{:#}", metrics_listen("localhost").unwrap_err());
    assert!(err.contains("neither host:port"), "{err}");
}

#[test]
fn a_minimal_config_gets_sparks_defaults() {
    let s = parse(MINIMAL).unwrap();
    assert_eq!(s.trigger, Trigger::ProcessingTime(Duration::ZERO));
    assert!(s.kafka().fail_on_data_loss);
    assert_eq!(s.min_batches_to_retain, 100);
    assert_eq!(s.first().source.description, "KafkaV2[Subscribe[events]]");
    assert_eq!(
        s.first().source.starting.resolve(),
        sluice_core::StartingOffsets::Latest
    );
    assert_eq!(s.kafka().read_memory_bytes, 128 * 1024 * 1024);
}

#[test]
fn the_read_memory_holds_at_least_the_read_ahead() {
    let with = |lines: &str| {
        parse(&MINIMAL.replacen(
            "subscribe = [\"events\"]",
            &format!("subscribe = [\"events\"]\n{lines}"),
            1,
        ))
        .unwrap()
        .kafka()
        .clone()
    };
    let mib = 1024 * 1024;
    // Unset, it grows with a larger read-ahead.
    let kafka = with("read_ahead_mb = 256");
    assert_eq!(
        (kafka.read_ahead_bytes, kafka.read_memory_bytes),
        (256 * mib, 256 * mib)
    );
    let kafka = with("read_memory_mb = 200");
    assert_eq!(
        (kafka.read_ahead_bytes, kafka.read_memory_bytes),
        (16 * mib, 200 * mib)
    );
    let kafka = with("read_ahead_mb = 8\nread_memory_mb = 8");
    assert_eq!(kafka.read_memory_bytes, 8 * mib);
}

#[test]
fn bad_configs_are_refused_with_the_reason() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "subscribe = [\"events\"]",
            "subscibe = [\"events\"]",
            "did you mean `subscribe`?",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nsubscribe_pattern = \"e.*\"",
            "exactly one of subscribe",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nmax_offsets_per_trigger = 0",
            "at least 1",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nstarting_offsets = \"earliestt\"",
            "starting_offsets",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nevent_time = \"ts\"",
            "set source.watermark_delay too",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nwatermark_delay = \"ten seconds\"",
            "source.watermark_delay = \"ten seconds\" is not a duration",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nmax_trigger_delay = \"5m\"",
            "needs min_offsets_per_trigger",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\n[source.kafka]\n\"enable.auto.commit\" = true",
            "`enable.auto.commit` is set by Sluice",
        ),
        (
            "type = \"console\"",
            "type = \"kafkaa\"",
            "sink.type must be",
        ),
        ("type = \"console\"", "type = \"jsonl\"", "needs sink.path"),
        (
            "location = \"/tmp/q\"",
            "location = \"cassandra://h:9042/ks\"",
            "?query=<name>",
        ),
        (
            "location = \"/tmp/q\"",
            "location = \"s3://bucket/q\"",
            "use a directory path",
        ),
        (
            "location = \"/tmp/q\"",
            "location = \"/tmp/q\"\nreplication = \"x\"",
            "apply to cassandra:// locations only",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nmin_offsets_per_trigger = 5000\nmax_offsets_per_trigger = 1000",
            "min_offsets_per_trigger (5000) is above max_offsets_per_trigger (1000)",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nmin_offsets_per_trigger = 0",
            "min_offsets_per_trigger must be at least 1",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nfetch_offset_num_retries = 3",
            "every request is retried under [retry]",
        ),
        (
            "type = \"console\"",
            "type = \"console\"\ntopic = \"out\"",
            "sink.topic is an option of the kafka sink, and sink.type is \"console\"",
        ),
        (
            "type = \"console\"",
            "type = \"jsonl\"\npath = \"/tmp/out\"\nnum_rows = 5",
            "sink.num_rows is an option of the console sink",
        ),
        (
            "type = \"console\"",
            "type = \"discard\"\n[sink.kafka]\n\"linger.ms\" = 5",
            "sink.kafka is an option of the kafka sink",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nstarting_offsets = \"earliest\"\nstarting_timestamp = 1000",
            "sets starting_timestamp and starting_offsets: each says where a new query starts",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nstarting_offsets_by_timestamp_strategy = \"latest\"",
            "neither starting_timestamp nor starting_offsets_by_timestamp is set",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nrequest_timeout_ms = 0",
            "source.request_timeout_ms must be at least 1",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\npoll_timeout_ms = 0",
            "source.poll_timeout_ms must be at least 1",
        ),
        (
            "subscribe = [\"events\"]",
            "subscribe = [\"events\"]\nread_ahead_mb = 32\nread_memory_mb = 16",
            "read_memory_mb (16 MiB) is less than read_ahead_mb (32 MiB)",
        ),
        (
            "location = \"/tmp/q\"",
            "location = \"/tmp/q\"\nmin_batches_to_retain = 0",
            "checkpoint.min_batches_to_retain must be at least 1",
        ),
        (
            "location = \"/tmp/q\"",
            "location = \"cassandra://h:9042/ks?query=q\"\nrequest_timeout_ms = 0",
            "checkpoint.request_timeout_ms must be at least 1",
        ),
    ];
    for (from, to, expected) in cases {
        let text = MINIMAL.replacen(from, to, 1);
        let err = format!("{:#}", parse(&text).unwrap_err());
        assert!(
            err.contains(expected),
            "{to}: expected {expected:?} in {err}"
        );
    }
}

#[tokio::test]
async fn the_readme_example_is_a_valid_config() {
    let readme = include_str!("../../../../README.md");
    let start = readme
        .find("```toml\n")
        .expect("a toml block in the README")
        + 8;
    let end = start + readme[start..].find("```").expect("the end of the block");
    let settings = parse(&readme[start..end]).unwrap();
    assert_eq!(settings.name.as_deref(), Some("orders-to-files"));
    assert_eq!(
        settings.trigger,
        Trigger::ProcessingTime(Duration::from_secs(10))
    );
    let processing = &settings.processing;
    let decoder = sluice_sql::Decoder::new(settings.first().format.clone(), false);
    sluice_sql::StreamQuery::plan(
        processing
            .sql
            .as_deref()
            .expect("the README's example has a query"),
        &settings.first().table,
        decoder.schema(),
    )
    .await
    .unwrap();
}

#[test]
fn the_scale_out_demo_config_is_group_mode_over_cassandra() {
    let settings = parse(include_str!("../../../../examples/demo-scale-out.toml")).unwrap();
    assert!(settings.scale_out.is_some());
    assert!(matches!(settings.checkpoint, StoreKind::Cassandra(..)));
    assert!(settings.progress.metrics_addr.is_some());
}

#[tokio::test]
async fn the_demo_config_reads_json_orders_and_csv_returns_and_plans_its_query() {
    let settings = parse(include_str!("../../../../examples/demo.toml")).unwrap();
    let processing = &settings.processing;
    let [orders, returns] = settings.sources.as_slice() else {
        panic!("the demo reads two streams: {:?}", settings.sources);
    };
    assert_eq!(
        (orders.table.as_str(), returns.table.as_str()),
        ("orders", "returns")
    );
    assert!(matches!(orders.format, sluice_sql::Format::Json(_)));
    assert!(matches!(returns.format, sluice_sql::Format::Csv(_)));
    let [customers] = processing.tables.as_slice() else {
        panic!("the demo joins one lookup table: {:?}", processing.tables);
    };
    assert!(matches!(
        &customers.source,
        TableSource::File { path, .. } if path.to_str() == Some("examples/demo-customers.csv")
    ));
    let mut options = processing.query_options();
    options.lookup_tables = vec![sluice_sql::LookupTable::new(
        &customers.name,
        customers
            .schema
            .clone()
            .expect("the demo declares its columns"),
        customers.max_memory_bytes,
    )];
    let streams: Vec<_> = settings
        .sources
        .iter()
        .map(|s| {
            let decoder = sluice_sql::Decoder::new(s.format.clone(), false);
            (s.table.clone(), decoder.schema())
        })
        .collect();
    let query = sluice_sql::StreamQuery::plan_streams(
        processing.sql.as_deref().expect("the demo has a query"),
        &streams,
        &options,
    )
    .await
    .unwrap();
    assert!(query.is_stateful());
    assert_eq!(query.output_mode(), Some(sluice_sql::OutputMode::Append));
    let columns: Vec<String> = query
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    assert_eq!(
        columns,
        [
            "window_start",
            "window_end",
            "customer",
            "country",
            "tier",
            "orders",
            "returns",
            "revenue"
        ]
    );
}

#[test]
fn scale_out_needs_a_group_subscribe_and_cassandra_and_refuses_what_it_cannot_share() {
    let config = |source: &str, checkpoint: &str, rest: &str| {
        format!(
            "[source]\nbootstrap_servers = \"h:9092\"\n{source}\n[checkpoint]\n{checkpoint}\n\
                 [sink]\ntype = \"jsonl\"\npath = \"/tmp/out\"\n{rest}\n[scale_out]\nenabled = true\n"
        )
    };
    let group = "subscribe = [\"events\"]\ngroup_id = \"g\"";
    let cassandra = "location = \"cassandra://h:9042/ks?query=q\"";
    let settings = parse(&config(group, cassandra, "")).unwrap();
    assert_eq!(
        settings.scale_out,
        Some(sluice_kafka::GroupProtocol::Classic)
    );
    let consumer = config(group, cassandra, "").replace(
        "enabled = true",
        "enabled = true\ngroup_protocol = \"consumer\"",
    );
    assert_eq!(
        parse(&consumer).unwrap().scale_out,
        Some(sluice_kafka::GroupProtocol::Consumer)
    );
    let err = |text: String| format!("{:#}", parse(&text).unwrap_err());
    for (text, expected) in [
        (
            config(group, "location = \"/tmp/q\"", ""),
            "needs a cassandra:// checkpoint.location",
        ),
        (
            config("subscribe = [\"events\"]", cassandra, ""),
            "scale_out needs source.group_id",
        ),
        (
            config("assign = { events = [0] }\ngroup_id = \"g\"", cassandra, ""),
            "use `subscribe`",
        ),
        (
            config(group, "location = \"cassandra://h:9042/ks?query=a/b\"", ""),
            "must not contain '/'",
        ),
        (
            config(group, cassandra, "[trigger]\navailable_now = true"),
            "use [trigger] processing_time",
        ),
        (
            config(
                &format!("{group}\n[source.kafka]\n\"partition.assignment.strategy\" = \"range\""),
                cassandra,
                "",
            ),
            "chosen by scale_out.group_protocol",
        ),
        (
            config(group, cassandra, "").replace(
                "enabled = true",
                "enabled = true\ngroup_protocol = \"eager\"",
            ),
            "must be \"classic\"",
        ),
    ] {
        let shown = err(text);
        assert!(shown.contains(expected), "{expected:?} not in {shown}");
    }
    let exactly_once = config(group, cassandra, "").replace(
        "type = \"jsonl\"\npath = \"/tmp/out\"",
        "type = \"kafka\"\ntopic = \"out\"\ndelivery = \"exactly_once\"",
    );
    // Each generation has a transactional id of its own (docs/scale-out.md).
    assert!(parse(&exactly_once).is_ok());
    // Each member serves its own page; on one host, port 0 gives each its own port.
    let served = parse(&config(
        group,
        cassandra,
        "[progress]\nmetrics_addr = \"0\"",
    ));
    assert!(served.is_ok(), "{:?}", served.err());
}

#[test]
fn cassandra_options_are_read_and_checked() {
    let with = |extra: &str| {
        parse(&MINIMAL.replacen(
            "location = \"/tmp/q\"",
            &format!("location = \"cassandra://h:9042/ks?query=q\"\n{extra}"),
            1,
        ))
    };
    let settings = with(
            "consistency = \"QUORUM\"\nserial_consistency = \"SERIAL\"\nusername = \"sluice\"\npassword = \"s3cret\"\nrequest_timeout_ms = 2500",
        )
        .unwrap();
    let StoreKind::Cassandra(location, options) = settings.checkpoint else {
        panic!("expected a Cassandra store");
    };
    assert_eq!(location.query, "q");
    assert_eq!(
        options.consistency,
        sluice_cassandra_store::Consistency::Quorum
    );
    assert_eq!(options.username.as_deref(), Some("sluice"));
    assert_eq!(options.request_timeout, Duration::from_millis(2500));
    let err = |extra: &str| format!("{:#}", with(extra).unwrap_err());
    assert!(err("consistency = \"MOST\"").contains("not a consistency level"));
    assert!(err("username = \"u\"").contains("needs both username and a password"));
    assert!(err("password_env = \"SLUICE_TEST_UNSET_VAR\"").contains("which is not set"));
    assert!(err("password = \"a\"\npassword_env = \"B\"").contains("not both"));
}

#[test]
fn rate_limits_that_a_trigger_cannot_honour_are_refused() {
    let with = |source: &str, trigger: &str| {
        let text = MINIMAL
            .replacen(
                "subscribe = [\"events\"]",
                &format!("subscribe = [\"events\"]\n{source}"),
                1,
            )
            .replacen(
                "type = \"console\"",
                &format!("type = \"console\"\n[trigger]\n{trigger}"),
                1,
            );
        parse(&text).map(|_| ()).map_err(|e| format!("{e:#}"))
    };
    let err = with("max_offsets_per_trigger = 100", "once = true").unwrap_err();
    assert!(err.contains("use available_now = true"), "{err}");
    assert!(with("max_offsets_per_trigger = 100", "available_now = true").is_ok());
    for trigger in ["once = true", "available_now = true"] {
        let err = with("min_offsets_per_trigger = 100", trigger).unwrap_err();
        assert!(
            err.contains("stops when it has caught up"),
            "{trigger}: {err}"
        );
        assert!(err.contains(trigger), "{err}");
    }
    assert!(with("min_offsets_per_trigger = 100", "processing_time = \"1s\"").is_ok());
}

#[test]
fn a_polling_delay_is_for_processing_time_zero_and_at_least_a_millisecond() {
    let with = |t: &str| {
        parse(&format!("{MINIMAL}\n[trigger]\n{t}"))
            .map(|s| s.polling_delay)
            .map_err(|e| format!("{e:#}"))
    };
    assert_eq!(
        parse(MINIMAL).unwrap().polling_delay,
        sluice_executor::DEFAULT_POLLING_DELAY
    );
    assert_eq!(
        with("polling_delay = \"20ms\"").unwrap(),
        Duration::from_millis(20)
    );
    assert_eq!(
        with("processing_time = \"0s\"\npolling_delay = \"1s\"").unwrap(),
        Duration::from_secs(1)
    );
    for (trigger, named) in [
        ("processing_time = \"10s\"", "a processing_time interval"),
        ("available_now = true", "available_now = true"),
        ("once = true", "once = true"),
    ] {
        let err = with(&format!("{trigger}\npolling_delay = \"5ms\"")).unwrap_err();
        assert!(err.contains(named) && err.contains("remove it"), "{err}");
    }
    let err = with("polling_delay = \"500us\"").unwrap_err();
    assert!(err.contains("below 1 ms"), "{err}");
    let err = with("polling_delay = \"often\"").unwrap_err();
    assert!(
        err.contains("trigger.polling_delay") && err.contains("not a duration"),
        "{err}"
    );
}

#[test]
fn the_continuous_trigger_takes_an_epoch_and_refuses_what_it_cannot_keep() {
    let with = |source: &str, trigger: &str, sink: &str| {
        let text = MINIMAL
            .replace(
                "subscribe = [\"events\"]",
                &format!("subscribe = [\"events\"]\n{source}"),
            )
            .replace(
                "type = \"console\"",
                &format!("{sink}\n[trigger]\n{trigger}"),
            );
        parse(&text).map_err(|e| format!("{e:#}"))
    };
    let console = "type = \"console\"";
    let settings = with("", "continuous = \"1s\"", console).unwrap();
    assert_eq!(
        settings.trigger,
        Trigger::Continuous(Duration::from_secs(1))
    );
    assert_eq!(settings.kafka().client_options["fetch.wait.max.ms"], "5");
    let settings = with(
        "[source.kafka]\n\"fetch.wait.max.ms\" = 50",
        "continuous = \"1s\"",
        console,
    )
    .unwrap();
    assert_eq!(settings.kafka().client_options["fetch.wait.max.ms"], "50");
    let settings = with("", "processing_time = \"0s\"", console).unwrap();
    assert!(
        !settings
            .kafka()
            .client_options
            .contains_key("fetch.wait.max.ms")
    );
    let settings = with(
        "max_offsets_per_trigger = 1000",
        "continuous = \"500ms\"\npolling_delay = \"10ms\"",
        console,
    )
    .unwrap();
    assert_eq!(settings.polling_delay, Duration::from_millis(10));
    let err = with("", "continuous = \"1ms\"", console).unwrap_err();
    assert!(err.contains("below 10 ms"), "{err}");
    let err = with("", "continuous = \"often\"", console).unwrap_err();
    assert!(
        err.contains("trigger.continuous") && err.contains("not a duration"),
        "{err}"
    );
    let err = with("", "continuous = \"1s\"\nonce = true", console).unwrap_err();
    assert!(
        err.contains("one of") && err.contains("continuous"),
        "{err}"
    );
    let err = with(
        "min_offsets_per_trigger = 10",
        "continuous = \"1s\"",
        console,
    )
    .unwrap_err();
    assert!(
        err.contains("min_offsets_per_trigger") && err.contains("remove it"),
        "{err}"
    );
    let kafka =
        |delivery: &str| format!("type = \"kafka\"\ntopic = \"out\"\ndelivery = \"{delivery}\"");
    let err = with("", "continuous = \"1s\"", &kafka("exactly_once")).unwrap_err();
    assert!(
        err.contains("exactly_once") && err.contains("at_least_once") && err.contains("0s"),
        "{err}"
    );
    assert!(with("", "continuous = \"1s\"", &kafka("at_least_once")).is_ok());
    assert!(with("", "processing_time = \"0s\"", &kafka("exactly_once")).is_ok());
}

#[test]
fn triggers_and_durations() {
    let with = |t: &str| parse(&format!("{MINIMAL}\n[trigger]\n{t}")).map(|s| s.trigger);
    assert_eq!(
        with("processing_time = \"10s\"").unwrap(),
        Trigger::ProcessingTime(Duration::from_secs(10))
    );
    assert_eq!(with("available_now = true").unwrap(), Trigger::AvailableNow);
    assert_eq!(with("once = true").unwrap(), Trigger::Once);
    assert!(with("once = true\navailable_now = true").is_err());
    assert!(
        format!("{:#}", with("processing_time = \"soon\"").unwrap_err()).contains("not a duration")
    );
}

#[test]
fn a_watermark_delay_tracks_kafkas_timestamp_unless_event_time_names_a_column() {
    let with = |extra: &str| {
        let text = MINIMAL.replace(
            "subscribe = [\"events\"]",
            &format!("subscribe = [\"events\"]\n{extra}"),
        );
        parse(&text).unwrap().processing
    };
    let kafka_time = with("watermark_delay = \"10s\"");
    assert_eq!(kafka_time.watermark, Some(("timestamp".to_owned(), 10_000)));
    assert!(
        !kafka_time.is_pass_through(),
        "the watermark needs the rows"
    );
    let column = with(
        "format = \"json\"\nschema = \"ts TIMESTAMP\"\nevent_time = \"ts\"\nwatermark_delay = \"2 minutes\"",
    );
    assert_eq!(column.watermark, Some(("ts".to_owned(), 120_000)));
    assert_eq!(with("").watermark, None);
}

#[test]
fn lookup_tables_are_checked_section_by_section() {
    let query = "[query]\nsql = \"SELECT 1 AS one FROM source\"\n";
    let table = |body: &str, query: &str| {
        parse(&format!("{MINIMAL}\n[tables.customers]\n{body}\n{query}"))
            .map(|s| s.processing.tables)
            .map_err(|e| format!("{e:#}"))
    };
    let csv = table(
        "path = \"c.psv\"\nformat = \"csv\"\nschema = \"name STRING\"\nheader = false\n\
         delimiter = \"|\"\nmax_memory_mb = 8",
        query,
    )
    .unwrap();
    assert!(matches!(
        csv[0].source,
        TableSource::File {
            format: sluice_tables::FileFormat::Csv {
                header: false,
                delimiter: b'|'
            },
            ..
        }
    ));
    assert_eq!(csv[0].max_memory_bytes, 8 << 20);
    let cassandra = table(
        "type = \"cassandra\"\ncontact_points = \"h1:9042, h2:9042\"\nkeyspace = \"k\"\n\
         table = \"t\"\nschema = \"a INT\"\nin_flight = 8",
        query,
    )
    .unwrap();
    assert!(matches!(
        &cassandra[0].source,
        TableSource::Cassandra { connection, keyspace, table, in_flight: 8 }
            if connection.nodes == ["h1:9042", "h2:9042"] && keyspace == "k" && table == "t"
    ));
    let parquet = table("path = \"d\"\nformat = \"parquet\"", query).unwrap();
    assert!(parquet[0].schema.is_none());
    assert_eq!(parquet[0].max_memory_bytes, DEFAULT_TABLE_MEMORY_MB << 20);
    for (body, query, expected) in [
        (
            "path = \"c\"\nformat = \"xml\"",
            query,
            "[tables.customers] format must be \"csv\", \"json\" or \"parquet\", not \"xml\"",
        ),
        (
            "path = \"c\"\nformat = \"json\"\nschema = \"a INT\"\nheader = true",
            query,
            "header and delimiter apply to format = \"csv\" only",
        ),
        (
            "path = \"c\"\nformat = \"csv\"\nschema = \"a INT\"\ndelimiter = \"||\"",
            query,
            "delimiter = \"||\": it must be one ASCII character",
        ),
        (
            "path = \"c\"\nformat = \"csv\"\nschema = \"a INT\"",
            "",
            "[tables.customers] is declared, but there is no [query] sql",
        ),
        (
            "path = \"c\"\nformat = \"csv\"\nschema = \"a NUMBER\"",
            query,
            "[tables.customers] schema",
        ),
        (
            "path = \"c\"\nformat = \"csv\"\nschema = \"a INT\"\nsheet = 1",
            query,
            "unknown field `sheet`",
        ),
        (
            "path = \"c\"\nformat = \"csv\"\nschema = \"a INT\"\nkeyspace = \"k\"",
            query,
            "[tables.customers] keyspace applies to type = \"cassandra\" only",
        ),
        (
            "type = \"cassandra\"\ncontact_points = \"h:9042\"\nkeyspace = \"k\"\n\
             table = \"t\"",
            query,
            "[tables.customers] needs schema, the columns to read",
        ),
        (
            "type = \"cassandra\"\nkeyspace = \"k\"\ntable = \"t\"\nschema = \"a INT\"",
            query,
            "type = \"cassandra\" needs contact_points",
        ),
        (
            "type = \"cassandra\"\ncontact_points = \"h:9042\"\nkeyspace = \"k\"\n\
             table = \"t\"\nschema = \"a INT\"\npath = \"x\"",
            query,
            "path applies to files, not to type = \"cassandra\"",
        ),
        (
            "type = \"cassandra\"\ncontact_points = \"h:9042\"\nkeyspace = \"k\"\n\
             table = \"t\"\nschema = \"a INT\"\nusername = \"u\"",
            query,
            "needs both username and a password",
        ),
        (
            "type = \"sheet\"\npath = \"c\"",
            query,
            "type must be \"file\" or \"cassandra\", not \"sheet\"",
        ),
    ] {
        let error = table(body, query).unwrap_err();
        assert!(error.contains(expected), "{expected}: {error}");
    }
}

#[test]
fn sources_keep_the_order_the_file_declares_them_in() {
    let text = r#"
[sources.zebras]
bootstrap_servers = "k:9092"
subscribe = ["z"]
format = "json"
schema = "a INT, ts TIMESTAMP"
event_time = "ts"
watermark_delay = "5s"
max_offsets_per_trigger = 10

[sources.antelopes]
bootstrap_servers = "k:9092"
subscribe_pattern = "a-.*"
on_bad_record = "skip"
format = "csv"
schema = "b INT, ts TIMESTAMP"
event_time = "ts"
watermark_delay = "9s"

[sources.antelopes.kafka]
"fetch.min.bytes" = "1000"

[checkpoint]
location = "/tmp/x"

[sink]
type = "discard"

[query]
sql = "SELECT a FROM zebras UNION ALL SELECT b FROM antelopes"
"#;
    let settings = parse(text).unwrap();
    let names: Vec<&str> = settings.sources.iter().map(|s| s.table.as_str()).collect();
    assert_eq!(
        names,
        ["zebras", "antelopes"],
        "the file's order, not sorted"
    );
    let [zebras, antelopes] = settings.sources.as_slice() else {
        unreachable!()
    };
    assert_eq!(
        zebras.source.max_offsets_per_trigger.map(|n| n.get()),
        Some(10)
    );
    assert_eq!(antelopes.source.max_offsets_per_trigger, None);
    assert_eq!(antelopes.on_bad_record, sluice_core::BadRecordPolicy::Skip);
    assert!(matches!(antelopes.format, sluice_sql::Format::Csv(_)));
    assert_eq!(
        antelopes.source.kafka.client_options["fetch.min.bytes"],
        "1000"
    );
    assert_eq!(
        antelopes.source.description,
        "KafkaV2[SubscribePattern[a-.*]]"
    );
    // State keeps keys and windows by the first column with event time and
    // the longest delay.
    assert_eq!(
        settings.processing.watermark,
        Some(("ts".to_owned(), 9_000))
    );
    assert_eq!(settings.kafka().selection, zebras.source.kafka.selection);
}
