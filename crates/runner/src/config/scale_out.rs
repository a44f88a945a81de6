//! `[scale_out]`: several processes share a query through Kafka's consumer
//! group (`docs/scale-out.md`), and what that asks of the rest of the
//! configuration.

use anyhow::{Result, bail};
use serde::Deserialize;
use sluice_executor::Trigger;
use sluice_kafka::KafkaSourceConfig;

use super::checkpoint::StoreKind;
use super::processing::DeadLetters;

/// `[scale_out]`: every process runs the same configuration, and Kafka's
/// consumer group shares the partitions among them (`docs/scale-out.md`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleOutSection {
    #[serde(default)]
    pub enabled: bool,
    /// "classic" (cooperative-sticky, the default) or "consumer" (KIP-848).
    pub group_protocol: Option<String>,
}

/// Checks `[scale_out]` against the rest: what group mode needs, and what it
/// does not support yet, each with the reason.
pub(super) fn scale_out(
    section: &ScaleOutSection,
    kafka: &KafkaSourceConfig,
    checkpoint: &StoreKind,
    trigger: Trigger,
    dead_letters: &DeadLetters,
) -> Result<Option<sluice_kafka::GroupProtocol>> {
    use sluice_kafka::GroupProtocol;
    if !section.enabled {
        if section.group_protocol.is_some() {
            bail!("scale_out.group_protocol applies with scale_out.enabled = true");
        }
        return Ok(None);
    }
    let protocol = match section.group_protocol.as_deref() {
        None | Some("classic") => GroupProtocol::Classic,
        Some("consumer") => GroupProtocol::Consumer,
        Some(other) => bail!(
            "scale_out.group_protocol must be \"classic\" (cooperative-sticky) or \"consumer\" \
             (KIP-848), not {other:?}"
        ),
    };
    if kafka.group_id.is_none() {
        bail!(
            "scale_out needs source.group_id: every process of the query joins that consumer \
             group, which shares the partitions among them"
        );
    }
    sluice_kafka::GroupConfig::topics_of(&kafka.selection)
        .map_err(|e| anyhow::anyhow!("scale_out: {e}"))?;
    for key in ["group.protocol", "partition.assignment.strategy"] {
        if kafka.client_options.contains_key(key) {
            bail!(
                "[source.kafka] {key} is chosen by scale_out.group_protocol (classic with \
                 cooperative-sticky, or consumer): remove it"
            );
        }
    }
    match checkpoint {
        StoreKind::Directory(_) => bail!(
            "scale_out needs a cassandra:// checkpoint.location: a checkpoint directory cannot be \
             shared safely between processes, and every process of the query reads and writes \
             the same directory of partitions"
        ),
        StoreKind::Cassandra(location, _) if location.query.contains('/') => bail!(
            "scale_out: the query name {:?} must not contain '/', which separates the query from \
             its generations' logs",
            location.query
        ),
        StoreKind::Cassandra(..) => {}
    }
    if !matches!(trigger, Trigger::ProcessingTime(_)) {
        bail!(
            "scale_out runs until it is stopped: use [trigger] processing_time (available_now and \
             once end when one process has caught up with its own partitions, and the continuous \
             trigger is not supported in group mode yet)"
        );
    }
    if kafka.commit_progress {
        bail!(
            "source.commit_progress commits to the consumer group, which in group mode belongs to \
             its members: remove it"
        );
    }
    if let DeadLetters::Kafka(config) = dead_letters
        && config.delivery == sluice_kafka::Delivery::ExactlyOnce
    {
        bail!("[dead_letter] to Kafka is at least once with scale_out");
    }
    Ok(Some(protocol))
}
