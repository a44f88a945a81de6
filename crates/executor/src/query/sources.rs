//! A query's several sources: each its own rate limit, its line in every
//! plan, checked against the checkpoint's, and its part of progress.

use super::*;

impl<Src, Store, Snk, Proc, Dead> Query<Src, Store, Snk, Proc, Dead>
where
    Src: Source,
    Store: QueryStore,
    Proc: Processor,
    Snk: Writes<Proc::Output>,
    Dead: Writes,
{
    /// Each source's part of a batch's progress: its offsets, rows and rates,
    /// and its watermark when the query has event time.
    pub(super) fn source_progress(
        &mut self,
        planned: &Planned,
        end: &PartitionOffsets,
        since_last: Option<f64>,
        execution: f64,
        by_source: &[(u64, u64)],
    ) -> Vec<SourceProgress> {
        let amplification = self.source.read_amplification();
        let count = self.options.sources.len().max(1);
        let watermarks = self
            .processor
            .event_time()
            .map(|clock| clock.stats().source_watermarks_ms)
            .unwrap_or_default();
        let starts = planned.plan.start_offsets();
        (0..count)
            .map(|index| {
                let mine = |offsets: &PartitionOffsets| -> PartitionOffsets {
                    offsets
                        .iter()
                        .filter(|(tp, _)| {
                            count == 1 || self.source.source_of(&tp.topic) == Some(index)
                        })
                        .map(|(tp, at)| (tp.clone(), *at))
                        .collect()
                };
                let (rows, bad) = by_source.get(index).copied().unwrap_or_default();
                let (end, latest) = (mine(end), mine(&planned.latest));
                let losses: Vec<DataLoss> = planned
                    .losses
                    .iter()
                    .filter(|loss| {
                        count == 1
                            || self.source.source_of(&loss.topic_partition().topic) == Some(index)
                    })
                    .cloned()
                    .collect();
                SourceProgress {
                    description: self
                        .options
                        .sources
                        .get(index)
                        .map_or_else(|| "source".to_owned(), |s| s.description.clone()),
                    start_offset: offsets_value(&mine(&starts)),
                    end_offset: offsets_value(&end),
                    latest_offset: offsets_value(&latest),
                    num_input_rows: rows,
                    input_rows_per_second: since_last.map_or(0.0, |s| rows as f64 / s),
                    processed_rows_per_second: rows as f64 / execution,
                    metrics: source_metrics(&end, &latest, &losses, bad, amplification.as_ref()),
                    watermark: watermarks
                        .get(index)
                        .copied()
                        .flatten()
                        .map(format_event_time),
                }
            })
            .collect()
    }

    /// How far each partition of `from` may go under its source's
    /// `max_offsets_per_trigger`, shared over that source's partitions.
    pub(super) fn source_limits(
        &self,
        from: &PartitionOffsets,
        reachable: &PartitionOffsets,
    ) -> PartitionOffsets {
        if let [one] = self.options.sources.as_slice() {
            return rate_limit(from, reachable, one.max_offsets_per_trigger);
        }
        let mut end = rate_limit(from, reachable, None);
        for (index, options) in self.options.sources.iter().enumerate() {
            let Some(most) = options.max_offsets_per_trigger else {
                continue;
            };
            let of_source = |offsets: &PartitionOffsets| -> PartitionOffsets {
                offsets
                    .iter()
                    .filter(|(tp, _)| self.source.source_of(&tp.topic) == Some(index))
                    .map(|(tp, at)| (tp.clone(), *at))
                    .collect()
            };
            end.extend(rate_limit(
                &of_source(from),
                &of_source(reachable),
                Some(most),
            ));
        }
        end
    }

    /// `plan` with each range given to the source that reads its topic.
    pub(super) fn with_sources(
        &self,
        plan: Result<BatchPlan, sluice_core::PlanError>,
    ) -> Result<BatchPlan, sluice_core::PlanError> {
        let count = self.source.source_count();
        plan?.with_sources(count, |tp| self.source.source_of(&tp.topic))
    }

    /// Refuses a stored plan whose sources are not the query's: another
    /// number of lines, or a line whose topics another source reads now.
    pub(super) fn check_sources(
        &self,
        plan: &BatchPlan,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let count = self.source.source_count();
        let moved = plan.range_sources().any(|(line, range)| {
            self.source
                .source_of(&range.topic_partition.topic)
                .is_some_and(|now| now != line)
        });
        if plan.source_count() == count && !moved {
            return Ok(());
        }
        let lines: Vec<String> = plan
            .end_offsets_by_source()
            .iter()
            .map(|line| {
                let topics: std::collections::BTreeSet<&str> =
                    line.keys().map(|tp| &*tp.topic).collect();
                format!("[{}]", topics.into_iter().collect::<Vec<_>>().join(", "))
            })
            .collect();
        let names: Vec<&str> = self
            .options
            .sources
            .iter()
            .map(|s| s.description.as_str())
            .collect();
        Err(ExecutorError::SourcesDiffer {
            checkpoint: format!(
                "{} source(s) (batch {}, by their topics: {})",
                plan.source_count(),
                plan.id(),
                lines.join(" ")
            ),
            config: format!("{count} ({})", names.join(", ")),
        })
    }

    /// Gives the processor's event time back its sources' own watermarks as
    /// `plan` recorded them: the batches before it left them.
    pub(super) fn restore_source_watermarks(
        &mut self,
        plan: &BatchPlan,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let Some(recorded) = source_watermarks_of(&plan.metadata().conf) else {
            return Ok(());
        };
        let watermarks = recorded.map_err(|reason| ExecutorError::Plan {
            batch: plan.id().0,
            reason,
        })?;
        if let Some(clock) = self.processor.event_time() {
            clock.restore_source_watermarks(&watermarks);
        }
        Ok(())
    }
}
