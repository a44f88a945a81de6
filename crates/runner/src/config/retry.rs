//! `[retry]`: how patiently a transient failure is retried, under the
//! executor's one retry policy.

use anyhow::{Result, bail};
use serde::Deserialize;
use sluice_executor::RetryPolicy;

use super::values::parse_duration;

/// `[retry]`: transient failures (a broker restarting, timeouts) are retried with
/// exponential backoff before the query stops.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySection {
    pub max_attempts: Option<u32>,
    pub initial_backoff: Option<String>,
    pub max_backoff: Option<String>,
    pub startup_timeout: Option<String>,
}

impl TryFrom<&RetrySection> for RetryPolicy {
    type Error = anyhow::Error;

    fn try_from(section: &RetrySection) -> Result<RetryPolicy> {
        let mut retry = RetryPolicy::default();
        if let Some(n) = section.max_attempts {
            if n == 0 {
                bail!("retry.max_attempts must be at least 1");
            }
            retry.max_attempts = n;
        }
        if let Some(text) = &section.initial_backoff {
            retry.initial_backoff = parse_duration("retry.initial_backoff", text)?;
        }
        if let Some(text) = &section.max_backoff {
            retry.max_backoff = parse_duration("retry.max_backoff", text)?;
        }
        if retry.initial_backoff > retry.max_backoff {
            bail!(
                "retry.initial_backoff ({}) is longer than retry.max_backoff ({}): the first wait \
                 cannot exceed the longest",
                humantime::format_duration(retry.initial_backoff),
                humantime::format_duration(retry.max_backoff)
            );
        }
        if let Some(text) = &section.startup_timeout {
            retry.startup_timeout = parse_duration("retry.startup_timeout", text)?;
            if retry.startup_timeout.is_zero() {
                bail!("retry.startup_timeout must be longer than 0s");
            }
        }
        Ok(retry)
    }
}
