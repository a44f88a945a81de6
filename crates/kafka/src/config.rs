//! The source's configuration, and the Kafka client options Sluice owns.

use std::collections::BTreeMap;
use std::time::Duration;

use regex::Regex;

use crate::KafkaError;

/// Which partitions a query reads: exactly one of Spark's three ways.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopicSelection {
    /// Explicit partitions per topic (Spark's `assign`).
    Assign(BTreeMap<String, Vec<i32>>),
    /// Every partition of these topics (Spark's `subscribe`).
    Subscribe(Vec<String>),
    /// Every partition of every topic whose whole name matches this regular
    /// expression (Spark's `subscribePattern`). Internal topics (`__...`) are left out.
    SubscribePattern(String),
}

/// How the source talks to Kafka and what it does when data is lost. Its
/// `Debug` hides the values of secret client options.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSourceConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// The partitions to read.
    pub selection: TopicSelection,
    /// The consumer group used for committed offsets and progress commits;
    /// `sluice-<query id>` when unset.
    pub group_id: Option<String>,
    /// Further librdkafka options (security, SASL/SSL, timeouts), passed through.
    pub client_options: BTreeMap<String, String>,
    /// Stop when offsets a batch needs are gone (default), or skip ahead and report.
    pub fail_on_data_loss: bool,
    /// How long a read may go without progress while records are still owed
    /// (default 120 s, Spark's `kafkaConsumer.pollTimeoutMs`).
    pub poll_timeout: Duration,
    /// The timeout of one metadata or offset request (default 30 s). A failed
    /// request is not retried here: the executor's retry policy does that.
    pub request_timeout: Duration,
    /// Whether records carry their headers.
    pub include_headers: bool,
    /// Whether to commit each committed batch's end offsets to the consumer group,
    /// so that lag monitors see progress.
    pub commit_progress: bool,
    /// How many bytes of records the reader may hold ahead of the batches, over
    /// all partitions (default [`DEFAULT_READ_AHEAD_BYTES`]). Each partition gets
    /// an equal share, at most 2 MiB, and at least one record.
    pub read_ahead_bytes: usize,
    /// How many bytes of records the reader may hold in all (default
    /// [`DEFAULT_READ_MEMORY_BYTES`]): the read-ahead, and beyond a partition's
    /// share the rest of a record batch that a fetch brought whole, which is
    /// otherwise dropped and fetched again. At least `read_ahead_bytes`.
    pub read_memory_bytes: usize,
}

impl std::fmt::Debug for KafkaSourceConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSourceConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("selection", &self.selection)
            .field("group_id", &self.group_id)
            .field("client_options", &Redacted(&self.client_options))
            .field("fail_on_data_loss", &self.fail_on_data_loss)
            .field("poll_timeout", &self.poll_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("include_headers", &self.include_headers)
            .field("commit_progress", &self.commit_progress)
            .field("read_ahead_bytes", &self.read_ahead_bytes)
            .field("read_memory_bytes", &self.read_memory_bytes)
            .finish()
    }
}

/// Whether a librdkafka option is about reaching a secured cluster: the
/// security protocol, TLS and SASL. The clients a query makes besides its main
/// one (a sink's helpers, a dead-letter producer on the same cluster) take these.
pub fn is_security_option(key: &str) -> bool {
    key == "security.protocol"
        || key == "enable.ssl.certificate.verification"
        || key.starts_with("ssl.")
        || key.starts_with("ssl_")
        || key.starts_with("sasl.")
}

/// Whether a librdkafka option's value is a secret (a password, a private key,
/// a client secret), never to be shown.
pub fn is_secret_option(key: &str) -> bool {
    key.contains("password")
        || key.contains("secret")
        || key == "ssl.key.pem"
        || key == "ssl_key"
        || key == "sasl.oauthbearer.config"
}

/// Client options for `Debug`, with the values of secret ones hidden.
pub(crate) struct Redacted<'a>(pub(crate) &'a BTreeMap<String, String>);

impl std::fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(key, value)| {
                let shown = if is_secret_option(key) {
                    "<redacted>"
                } else {
                    value.as_str()
                };
                (key, shown)
            }))
            .finish()
    }
}

/// The default of [`KafkaSourceConfig::read_ahead_bytes`]. A partition's
/// buffer keeps what it had queued when it filled, up to two fetches beyond its
/// share, so at 1,024 partitions and 10,000 records per trigger 24 MiB peaked
/// at 100-101 MiB and 16 MiB at 79-90, both as fast (docs/benchmarks.md).
pub const DEFAULT_READ_AHEAD_BYTES: usize = 16 * 1024 * 1024;

/// The default of [`KafkaSourceConfig::read_memory_bytes`]. librdkafka's
/// producers write record batches of up to 1,000,000 bytes; over 1,024
/// partitions at 10,000 records per trigger, 64 MiB fetched each record about
/// 3 times and read at about half the raw consumer's pace (101-106 MiB peak), 128 MiB
/// about 2 times at 0.6-0.7 (154-159 MiB), while topics of 16 KiB record
/// batches peak where they did (docs/benchmarks.md).
pub const DEFAULT_READ_MEMORY_BYTES: usize = 128 * 1024 * 1024;

/// The default of librdkafka's `fetch.max.bytes` for a read-ahead of
/// `read_ahead_bytes`: an eighth of it, 1 to 8 MiB (2 MiB by default).
///
/// A fetch response lives until its last record is polled, and librdkafka
/// keeps about 300 bytes per message besides, so a response of small records
/// costs about three times its size while the reading thread copies it out.
/// With a fixed 8 MiB, that burst rose over the read-ahead: at 1,024
/// partitions and 10,000 records per trigger the process peaked at 91-105 MiB,
/// and at 84-95 with 3 MiB, on either store. Smaller fetches also read 8
/// partitions in one batch faster (1.40-1.75 s against 1.61-1.89 s for
/// 5,000,000 records), as the reading thread starts on each sooner
/// (docs/benchmarks.md).
pub fn default_fetch_max_bytes(read_ahead_bytes: usize) -> usize {
    (read_ahead_bytes / 8).clamp(1024 * 1024, 8 * 1024 * 1024)
}

impl KafkaSourceConfig {
    /// The `fetch.max.bytes` a reader uses: the configuration's, or the default
    /// for its read-ahead raised to `message.max.bytes` where that is larger, as
    /// librdkafka refuses a consumer whose fetch cannot hold its largest message.
    pub(crate) fn fetch_max_bytes(&self) -> usize {
        let option = |key: &str| {
            self.client_options
                .get(key)
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        option("fetch.max.bytes").unwrap_or_else(|| {
            default_fetch_max_bytes(self.read_ahead_bytes)
                .max(option("message.max.bytes").unwrap_or(0))
        })
    }

    /// A configuration with Sluice's defaults.
    pub fn new(bootstrap_servers: impl Into<String>, selection: TopicSelection) -> Self {
        KafkaSourceConfig {
            bootstrap_servers: bootstrap_servers.into(),
            selection,
            group_id: None,
            client_options: BTreeMap::new(),
            fail_on_data_loss: true,
            poll_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(30),
            include_headers: false,
            commit_progress: false,
            read_ahead_bytes: DEFAULT_READ_AHEAD_BYTES,
            read_memory_bytes: DEFAULT_READ_MEMORY_BYTES,
        }
    }

    /// Checks what can be checked without a broker.
    pub fn validate(&self) -> Result<(), KafkaError> {
        if self.bootstrap_servers.trim().is_empty() {
            return Err(KafkaError::Config(
                "bootstrap_servers is empty: name at least one broker as host:port".to_owned(),
            ));
        }
        match &self.selection {
            TopicSelection::Assign(topics) => {
                if topics.is_empty() || topics.values().any(Vec::is_empty) {
                    return Err(KafkaError::Config(
                        "assign names no partitions: give at least one partition per topic"
                            .to_owned(),
                    ));
                }
                if let Some((topic, p)) = topics
                    .iter()
                    .find_map(|(t, ps)| ps.iter().find(|p| **p < 0).map(|p| (t, p)))
                {
                    return Err(KafkaError::Config(format!(
                        "assign: partition {p} of topic {topic} is negative"
                    )));
                }
            }
            TopicSelection::Subscribe(topics) => {
                if topics.is_empty() || topics.iter().any(|t| t.trim().is_empty()) {
                    return Err(KafkaError::Config(
                        "subscribe names no topic, or an empty one".to_owned(),
                    ));
                }
            }
            TopicSelection::SubscribePattern(pattern) => {
                compile_pattern(pattern)?;
            }
        }
        for key in self.client_options.keys() {
            if let Some(reason) = owned_option(key) {
                return Err(KafkaError::OwnedOption {
                    option: key.clone(),
                    reason,
                });
            }
        }
        Ok(())
    }
}

/// Why Sluice refuses a client option, if it does.
fn owned_option(key: &str) -> Option<&'static str> {
    Some(match key {
        "enable.auto.commit" => {
            "Sluice keeps offsets in its offset store; set commit_progress = true to also commit \
             them to the consumer group for lag monitors"
        }
        "auto.offset.reset" => {
            "Sluice decides where reading starts (starting_offsets) and what happens to purged \
             offsets (fail_on_data_loss); a reset policy would skip data silently"
        }
        "group.id" => {
            "set group_id in the source configuration instead; without it Sluice uses \
             sluice-<query id>"
        }
        "bootstrap.servers" | "metadata.broker.list" => {
            "set bootstrap_servers in the source configuration instead"
        }
        "enable.auto.offset.store" | "enable.partition.eof" => {
            "Sluice reads exact offset ranges and sets it itself"
        }
        _ => return None,
    })
}

/// Compiles a subscribe pattern so that it must match a whole topic name, as
/// Java's `Pattern.matcher(topic).matches()` does for Spark.
pub(crate) fn compile_pattern(pattern: &str) -> Result<Regex, KafkaError> {
    Regex::new(&format!("^(?:{pattern})$")).map_err(|source| KafkaError::Pattern {
        pattern: pattern.to_owned(),
        source: Box::new(source),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> KafkaSourceConfig {
        KafkaSourceConfig::new(
            "127.0.0.1:9092",
            TopicSelection::Subscribe(vec!["t".into()]),
        )
    }

    #[test]
    fn refuses_options_sluice_owns_and_says_why() {
        for key in [
            "enable.auto.commit",
            "auto.offset.reset",
            "group.id",
            "bootstrap.servers",
        ] {
            let mut c = config();
            c.client_options.insert(key.to_owned(), "x".to_owned());
            let err = c.validate().unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("Kafka option `{key}` is set by Sluice")),
                "{err}"
            );
        }
        let mut c = config();
        c.client_options
            .insert("security.protocol".to_owned(), "SASL_SSL".to_owned());
        c.client_options
            .insert("sasl.mechanism".to_owned(), "SCRAM-SHA-512".to_owned());
        assert!(c.validate().is_ok(), "security options pass through");
    }

    #[test]
    fn a_fetch_follows_the_read_ahead_unless_configured() {
        let mut c = config();
        assert_eq!(c.fetch_max_bytes(), 2 * 1024 * 1024, "an eighth of 16 MiB");
        c.read_ahead_bytes = 1024 * 1024;
        assert_eq!(c.fetch_max_bytes(), 1024 * 1024, "at least 1 MiB");
        c.read_ahead_bytes = 256 * 1024 * 1024;
        assert_eq!(c.fetch_max_bytes(), 8 * 1024 * 1024, "at most 8 MiB");
        c.read_ahead_bytes = DEFAULT_READ_AHEAD_BYTES;
        c.client_options
            .insert("message.max.bytes".to_owned(), "5000000".to_owned());
        assert_eq!(c.fetch_max_bytes(), 5_000_000, "holds the largest message");
        c.client_options
            .insert("fetch.max.bytes".to_owned(), "4194304".to_owned());
        assert_eq!(c.fetch_max_bytes(), 4_194_304, "the configuration wins");
    }

    #[test]
    fn debug_output_hides_secret_options() {
        let mut c = config();
        for (key, value) in [
            ("sasl.password", "hunter2-sasl"),
            ("ssl.key.password", "hunter2-key"),
            ("sasl.username", "sluice"),
        ] {
            c.client_options.insert(key.to_owned(), value.to_owned());
        }
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("\"sasl.username\": \"sluice\""), "{shown}");
        assert!(
            shown.contains("\"sasl.password\": \"<redacted>\""),
            "{shown}"
        );
        assert!(is_security_option("ssl.ca.location") && !is_security_option("linger.ms"));
    }

    #[test]
    fn refuses_empty_selections_and_bad_patterns() {
        let mut c = config();
        c.selection = TopicSelection::Subscribe(vec![]);
        assert!(c.validate().is_err());
        c.selection = TopicSelection::Assign(BTreeMap::from([("t".to_owned(), vec![])]));
        assert!(c.validate().is_err());
        c.selection = TopicSelection::Assign(BTreeMap::from([("t".to_owned(), vec![-1])]));
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("partition -1 of topic t")
        );
        c.selection = TopicSelection::SubscribePattern("events-(".to_owned());
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("subscribe_pattern")
        );
        c.selection = TopicSelection::SubscribePattern("events-.*".to_owned());
        assert!(c.validate().is_ok());
        c.bootstrap_servers = " ".to_owned();
        assert!(c.validate().is_err());
    }

    #[test]
    fn patterns_match_whole_topic_names() {
        let p = compile_pattern("events-.*").unwrap();
        assert!(p.is_match("events-eu"));
        assert!(!p.is_match("old-events-eu"));
        let p = compile_pattern("a|b").unwrap();
        assert!(p.is_match("a") && p.is_match("b") && !p.is_match("ab"));
    }
}
