//! `[trigger]`: when batches run, and how an idle query looks for new data.

use std::time::Duration;

use anyhow::{Result, bail};
use serde::Deserialize;
use sluice_executor::Trigger;

use super::source::SourceSettings;
use super::values::parse_duration;

/// The source's `fetch.wait.max.ms` under the continuous trigger, unless
/// `[source.kafka]` sets it.
const CONTINUOUS_FETCH_WAIT_MAX_MS: &str = "5";

/// `[trigger]`: exactly one of the four.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerSection {
    pub processing_time: Option<String>,
    #[serde(default)]
    pub available_now: bool,
    #[serde(default)]
    pub once: bool,
    /// Continuous processing, with an epoch of this interval.
    pub continuous: Option<String>,
    /// The longest wait between looks for new data of an idle
    /// `processing_time = "0s"` query.
    pub polling_delay: Option<String>,
}

/// `[trigger]`, checked.
#[derive(Debug, Clone, Copy)]
pub struct TriggerSettings {
    /// Spark's trigger.
    pub trigger: Trigger,
    /// The longest wait between looks of an idle query.
    pub polling_delay: Duration,
}

impl TryFrom<&TriggerSection> for TriggerSettings {
    type Error = anyhow::Error;

    fn try_from(section: &TriggerSection) -> Result<TriggerSettings> {
        let trigger = match (
            section.processing_time.clone(),
            section.available_now,
            section.once,
            section.continuous.clone(),
        ) {
            (None, false, false, None) => Trigger::ProcessingTime(Duration::ZERO),
            (Some(interval), false, false, None) => {
                Trigger::ProcessingTime(parse_duration("trigger.processing_time", &interval)?)
            }
            (None, true, false, None) => Trigger::AvailableNow,
            (None, false, true, None) => Trigger::Once,
            (None, false, false, Some(epoch)) => {
                let interval = parse_duration("trigger.continuous", &epoch)?;
                if interval < Duration::from_millis(10) {
                    bail!(
                        "trigger.continuous = {epoch:?} is below 10 ms: each epoch writes a plan and \
                         a commit, and records reach the sink as they arrive whatever the epoch, \
                         so a longer one costs no latency; \"1s\" is usual"
                    );
                }
                Trigger::Continuous(interval)
            }
            _ => bail!(
                "[trigger] takes one of processing_time, available_now = true, once = true or \
                 continuous"
            ),
        };
        let polling_delay = match section.polling_delay.clone() {
            None => sluice_executor::DEFAULT_POLLING_DELAY,
            Some(_)
                if !matches!(
                    trigger,
                    Trigger::ProcessingTime(Duration::ZERO) | Trigger::Continuous(_)
                ) =>
            {
                bail!(
                    "trigger.polling_delay is how long an idle processing_time = \"0s\" or \
                     continuous query waits between looks for new data, and this query's trigger \
                     is {}: remove it",
                    match trigger {
                        Trigger::AvailableNow => "available_now = true",
                        Trigger::Once => "once = true",
                        _ => "a processing_time interval",
                    }
                )
            }
            Some(text) => {
                let delay = parse_duration("trigger.polling_delay", &text)?;
                if delay < Duration::from_millis(1) {
                    bail!(
                        "trigger.polling_delay = {text:?} is below 1 ms: an idle query would ask the \
                         brokers for their offsets without pause"
                    );
                }
                delay
            }
        };
        Ok(TriggerSettings {
            trigger,
            polling_delay,
        })
    }
}

/// What the trigger asks of the source's options: the continuous trigger's
/// short fetch wait, and no rate limit that the trigger would contradict.
pub(super) fn fit_source(trigger: Trigger, source: &mut SourceSettings) -> Result<()> {
    // The reader long-polls partitions at their end for fetch.wait.max.ms, and a
    // continuous epoch's next look waits behind that poll. At 100 records/s the
    // source's 20 ms made the median latency 34.5 ms, and 5 ms made it 12.9 ms
    // (runs of `latency_probe` as `cargo xtask bench latency` drives it); the
    // cost is more fetch requests while idle.
    if matches!(trigger, Trigger::Continuous(_)) {
        source
            .kafka
            .client_options
            .entry("fetch.wait.max.ms".to_owned())
            .or_insert_with(|| CONTINUOUS_FETCH_WAIT_MAX_MS.to_owned());
    }
    if trigger == Trigger::Once && source.max_offsets_per_trigger.is_some() {
        bail!(
            "max_offsets_per_trigger limits each batch, and trigger once = true reads everything \
             in one batch: use available_now = true, which reads the same in batches of that size"
        );
    }
    if matches!(trigger, Trigger::Continuous(_)) && source.min_offsets_per_trigger.is_some() {
        bail!(
            "min_offsets_per_trigger makes a batch wait for new offsets, and the continuous \
             trigger hands every record to the sink as it arrives: remove it, or use \
             processing_time"
        );
    }
    if matches!(trigger, Trigger::Once | Trigger::AvailableNow)
        && source.min_offsets_per_trigger.is_some()
    {
        bail!(
            "min_offsets_per_trigger makes a batch wait for new offsets, and a run with {} stops \
             when it has caught up: remove it, or use processing_time",
            if trigger == Trigger::Once {
                "once = true"
            } else {
                "available_now = true"
            }
        );
    }

    Ok(())
}
