//! Values that several sections share the form of: librdkafka options, the
//! source's security options for another client of its cluster, and
//! durations.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// librdkafka options from a TOML table: strings, numbers and booleans as text.
/// `KEY_env = "VAR"` takes the value of `KEY` from the environment variable
/// `VAR` (`"sasl.password_env"`), to keep secrets out of the file. A secret's
/// value is never shown in an error.
pub(super) fn client_options(
    table: &str,
    values: BTreeMap<String, toml::Value>,
) -> Result<BTreeMap<String, String>> {
    let mut options = BTreeMap::new();
    for (key, value) in &values {
        if let Some(option) = key.strip_suffix("_env") {
            let toml::Value::String(var) = value else {
                bail!("[{table}] {key} names an environment variable: give its name as a string");
            };
            if values.contains_key(option) {
                bail!("[{table}] takes {option} or {key}, not both");
            }
            let text = std::env::var(var)
                .with_context(|| format!("[{table}] {key} names {var}, which is not set"))?;
            options.insert(option.to_owned(), text);
            continue;
        }
        let text = match value {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Float(f) => f.to_string(),
            _ if sluice_kafka::is_secret_option(key) => {
                bail!("[{table}] {key} must be a string")
            }
            other => bail!("[{table}] {key} must be a string, number or boolean, not {other}"),
        };
        options.insert(key.clone(), text);
    }
    Ok(options)
}

/// The source's security options (protocol, TLS, SASL) under `own`, for another
/// client of the source's cluster: what it sets itself wins.
pub(super) fn with_source_security(
    source: &BTreeMap<String, String>,
    own: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut options: BTreeMap<String, String> = source
        .iter()
        .filter(|(key, _)| sluice_kafka::is_security_option(key))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    options.extend(own);
    options
}

/// `text` as a duration ("10s", "15m"); errors name `key`.
pub(super) fn parse_duration(key: &str, text: &str) -> Result<Duration> {
    humantime::parse_duration(text.trim())
        .with_context(|| format!("{key} = {text:?} is not a duration like \"10s\" or \"15m\""))
}
