//! The status page's server and the Prometheus metrics each progress report
//! records: batch durations, phases, rows, offsets behind and state.

use super::*;

/// Installs the metrics recorder and serves the status page, the progress
/// reports and the metrics on `addr`.
pub(crate) async fn serve_status(
    about: sluice_status::About,
    addr: std::net::SocketAddr,
) -> Result<sluice_status::Status, Exit> {
    let handle = prometheus()
        .and_then(|builder| builder.install_recorder())
        .context("installing the metrics recorder")
        .map_err(Exit::runtime)?;
    let status = sluice_status::Status::new(about, move || {
        // Without the exporter's own listener nothing else drains the
        // histograms' buffers: do it as they are read.
        handle.run_upkeep();
        handle.render()
    });
    let local = status
        .serve(addr)
        .await
        .map_err(|e| Exit::runtime(e.into()))?;
    tracing::info!(addr = %local, "serving the status page on http://{local}/ and metrics on /metrics");
    Ok(status)
}

/// The recorder's settings: buckets for the one histogram that has them.
pub(crate) fn prometheus()
-> Result<metrics_exporter_prometheus::PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    metrics_exporter_prometheus::PrometheusBuilder::new().set_buckets_for_metric(
        metrics_exporter_prometheus::Matcher::Full("sluice_batch_duration_seconds".to_owned()),
        BATCH_DURATION_BUCKETS,
    )
}

/// Batch durations from a sub-millisecond batch to a minute-long one, in seconds.
pub(crate) const BATCH_DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

pub(crate) fn batch_counts(progress: &QueryProgress) -> sluice_status::BatchCounts {
    let metric = |name: &str| {
        progress
            .sources
            .iter()
            .filter_map(|s| s.metrics.get(name).and_then(|v| v.parse::<u64>().ok()))
            .sum()
    };
    sluice_status::BatchCounts {
        rows: progress.num_input_rows,
        lost_offsets: metric("dataLossOffsets"),
        bad_records: metric("badRecords"),
    }
}

pub(crate) fn describe_trigger(trigger: sluice_executor::Trigger) -> String {
    match trigger {
        sluice_executor::Trigger::ProcessingTime(every) => {
            format!("processing_time = {}", humantime::format_duration(every))
        }
        sluice_executor::Trigger::AvailableNow => "available_now".to_owned(),
        sluice_executor::Trigger::Once => "once".to_owned(),
        sluice_executor::Trigger::Continuous(epoch) => {
            format!("continuous = {}", humantime::format_duration(epoch))
        }
    }
}

pub(crate) fn record_metrics(progress: &QueryProgress) {
    metrics::counter!("sluice_batches_total").increment(1);
    metrics::counter!("sluice_input_rows_total").increment(progress.num_input_rows);
    metrics::gauge!("sluice_batch_id").set(progress.batch_id as f64);
    metrics::gauge!("sluice_processed_rows_per_second").set(progress.processed_rows_per_second);
    metrics::histogram!("sluice_trigger_execution_ms")
        .record(progress.duration_ms.trigger_execution as f64);
    metrics::histogram!("sluice_wal_commit_ms").record(progress.duration_ms.wal_commit as f64);
    metrics::histogram!("sluice_commit_offsets_ms")
        .record(progress.duration_ms.commit_offsets as f64);
    // Buckets (set where the recorder is installed), for Grafana's heatmaps and
    // quantiles across runs; the _ms summaries above are Spark's phases.
    metrics::histogram!("sluice_batch_duration_seconds")
        .record(progress.duration_micros.trigger_execution as f64 / 1e6);
    record_offsets_behind(progress);
    // One operator per stateful query, so its name is a label of bounded
    // cardinality.
    for operator in &progress.state_operators {
        let name = operator.operator_name.clone();
        metrics::gauge!("sluice_state_rows", "operator" => name.clone())
            .set(operator.num_rows_total as f64);
        metrics::gauge!("sluice_state_memory_bytes", "operator" => name.clone())
            .set(operator.memory_used_bytes as f64);
        metrics::counter!("sluice_state_rows_updated_total", "operator" => name.clone())
            .increment(operator.num_rows_updated);
        metrics::counter!("sluice_state_rows_removed_total", "operator" => name.clone())
            .increment(operator.num_rows_removed);
        metrics::counter!("sluice_late_rows_dropped_total", "operator" => name.clone())
            .increment(operator.num_rows_dropped_by_watermark);
        metrics::histogram!("sluice_state_commit_ms", "operator" => name)
            .record(operator.commit_time_ms as f64);
    }
    // The tables a configuration declares: a label of bounded cardinality.
    // The reload counts are the table's since the start, hence `absolute`.
    for table in &progress.lookup_tables {
        let name = table.name.clone();
        metrics::gauge!("sluice_lookup_table_rows", "table" => name.clone())
            .set(table.num_rows as f64);
        metrics::gauge!("sluice_lookup_table_memory_bytes", "table" => name.clone())
            .set(table.memory_used_bytes as f64);
        metrics::counter!("sluice_lookup_table_reloads_total", "table" => name.clone())
            .absolute(table.num_reloads);
        metrics::counter!("sluice_lookup_table_failed_reloads_total", "table" => name)
            .absolute(table.num_failed_reloads);
    }
    // One member per process, so the label's cardinality is one.
    if let Some(group) = &progress.group {
        let held: usize = group.partitions.values().map(Vec::len).sum();
        metrics::gauge!("sluice_group_partitions", "member" => group.member.clone())
            .set(held as f64);
        if let Some(number) = group
            .generation
            .rsplit_once('.')
            .and_then(|(_, n)| n.parse::<u64>().ok())
        {
            metrics::gauge!("sluice_group_generation", "member" => group.member.clone())
                .set(number as f64);
        }
    }
    if let Some(event_time) = &progress.event_time
        && let Some(watermark) = event_time.get("watermark")
        && let Ok(at) = humantime::parse_rfc3339(watermark)
        && let Ok(since) = at.duration_since(std::time::UNIX_EPOCH)
    {
        metrics::gauge!("sluice_watermark_ms").set(since.as_millis() as f64);
    }
    record_source_metrics(progress);
}

/// The sources' figures: their offsets behind latest, data loss and bad
/// records over all of them, and in a query of several each one's rows and
/// watermark, labelled with its description (one per configured source).
fn record_source_metrics(progress: &QueryProgress) {
    let number = |source: &sluice_executor::SourceProgress, name: &str| {
        source.metrics.get(name).and_then(|v| v.parse::<f64>().ok())
    };
    match progress.sources.as_slice() {
        [] => {}
        [one] => {
            for (name, metric) in [
                ("maxOffsetsBehindLatest", "sluice_max_offsets_behind_latest"),
                ("avgOffsetsBehindLatest", "sluice_avg_offsets_behind_latest"),
            ] {
                if let Some(value) = number(one, name) {
                    metrics::gauge!(metric).set(value);
                }
            }
        }
        several => {
            let behind: Vec<u64> = several
                .iter()
                .flat_map(|s| offsets_behind(&s.end_offset, &s.latest_offset))
                .map(|(_, _, n)| n)
                .collect();
            if let Some(max) = behind.iter().max() {
                metrics::gauge!("sluice_max_offsets_behind_latest").set(*max as f64);
                let avg = behind.iter().sum::<u64>() as f64 / behind.len() as f64;
                metrics::gauge!("sluice_avg_offsets_behind_latest").set(avg);
            }
            for source in several {
                let label = source.description.clone();
                metrics::counter!("sluice_source_input_rows_total", "source" => label.clone())
                    .increment(source.num_input_rows);
                if let Some(watermark) = &source.watermark
                    && let Ok(at) = humantime::parse_rfc3339(watermark)
                    && let Ok(since) = at.duration_since(std::time::UNIX_EPOCH)
                {
                    metrics::gauge!("sluice_source_watermark_ms", "source" => label)
                        .set(since.as_millis() as f64);
                }
            }
        }
    }
    // The sources share one reader's figures.
    if let Some(value) = progress
        .sources
        .first()
        .and_then(|s| number(s, "readAmplification"))
    {
        metrics::gauge!("sluice_read_amplification").set(value);
    }
    let total = |name: &str| -> u64 {
        progress
            .sources
            .iter()
            .filter_map(|s| s.metrics.get(name).and_then(|v| v.parse::<u64>().ok()))
            .sum()
    };
    metrics::counter!("sluice_data_loss_offsets_total").increment(total("dataLossOffsets"));
    metrics::counter!("sluice_bad_records_total").increment(total("badRecords"));
}

/// Partitions past which `sluice_offsets_behind_latest` is not labelled per
/// partition, so that a pattern subscription over a growing set of topics
/// cannot grow the series without bound; the per-topic gauge stays.
pub(crate) const MAX_PARTITION_SERIES: usize = 1024;

/// How far each partition and each topic is behind the latest offsets seen at
/// the batch's start.
pub(crate) fn record_offsets_behind(progress: &QueryProgress) {
    for source in &progress.sources {
        let behind = offsets_behind(&source.end_offset, &source.latest_offset);
        let mut per_topic: std::collections::BTreeMap<&str, u64> = Default::default();
        for (topic, _, n) in &behind {
            *per_topic.entry(topic.as_str()).or_default() += n;
        }
        for (topic, n) in per_topic {
            metrics::gauge!("sluice_topic_offsets_behind_latest", "topic" => topic.to_owned())
                .set(n as f64);
        }
        if behind.len() <= MAX_PARTITION_SERIES {
            for (topic, partition, n) in behind {
                metrics::gauge!(
                    "sluice_offsets_behind_latest",
                    "topic" => topic,
                    "partition" => partition
                )
                .set(n as f64);
            }
        }
    }
}

/// (topic, partition, latest − end) for every partition in both of Spark's
/// offset maps, `{"topic": {"0": 42}}`.
pub(crate) fn offsets_behind(
    end: &serde_json::Value,
    latest: &serde_json::Value,
) -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    let Some(latest) = latest.as_object() else {
        return out;
    };
    for (topic, partitions) in latest {
        let Some(partitions) = partitions.as_object() else {
            continue;
        };
        for (partition, at) in partitions {
            let committed = end
                .get(topic)
                .and_then(|p| p.get(partition))
                .and_then(|o| o.as_i64());
            if let (Some(at), Some(committed)) = (at.as_i64(), committed) {
                out.push((
                    topic.clone(),
                    partition.clone(),
                    at.saturating_sub(committed).max(0) as u64,
                ));
            }
        }
    }
    out
}
