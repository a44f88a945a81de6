//! The continuous trigger ([`Trigger::Continuous`]): an epoch reads records as
//! they arrive and hands them to the sink at once, and when its interval is
//! over it plans and commits what it read as one batch.
//!
//! The plan is written after the records reached the sink, the reverse of a
//! micro-batch: that is what lets a record through within a millisecond or two
//! of its arrival without a durable write for every look at the source. A
//! crash before the plan is durable leaves records in the sink that no plan
//! covers, and the restart reads them again from the last commit; a crash
//! after it replays the batch with its recorded ranges, as a micro-batch's
//! recovery does. So every sink is at least once, and one that publishes a
//! batch only when it finishes it (a `jsonl` file, renamed into place) stays
//! exactly once, with the epoch as its latency.

use super::*;

/// An epoch's output before its plan is written.
struct EpochRead {
    from: PartitionOffsets,
    end: PartitionOffsets,
    latest: PartitionOffsets,
    metadata: BatchMetadata,
    losses: Vec<DataLoss>,
    streamed: Streamed,
    durations: DurationMs,
}

enum Epoch {
    /// Nothing arrived: no batch, and the next epoch starts here.
    Empty(PartitionOffsets),
    Read(Box<EpochRead>),
}

impl<Src, Store, Snk, Proc, Dead> Query<Src, Store, Snk, Proc, Dead>
where
    Src: Source,
    Store: QueryStore,
    Proc: Processor,
    Snk: Writes<Proc::Output>,
    Dead: Writes,
{
    /// Runs epochs of `interval` from batch `next`, which starts at `start`
    /// (or where a fresh query starts), until asked to stop.
    pub(super) async fn run_epochs(
        &mut self,
        interval: Duration,
        mut next: BatchId,
        mut start: Option<PartitionOffsets>,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let operators = self.processor.stateful_operators().len() as u32;
        if operators > 0 {
            return Err(ExecutorError::ContinuousWithState { operators });
        }
        let mut idle = IdleBackoff::new(self.options.polling_delay);
        while !*self.stop.borrow() {
            let trigger_start = Instant::now();
            let timestamp = SystemTime::now();
            let span = tracing::info_span!("batch", id = next.0, epoch = true);
            let epoch = self
                .read_epoch(next, start.take(), trigger_start + interval, &mut idle)
                .instrument(span.clone())
                .await?;
            match epoch {
                Epoch::Empty(from) => start = Some(from),
                Epoch::Read(read) => {
                    let end = read.end.clone();
                    self.commit_epoch(next, *read, trigger_start, timestamp, summary, on_progress)
                        .instrument(span)
                        .await?;
                    start = Some(end);
                    next = next.next();
                }
            }
        }
        Ok(())
    }

    /// Reads one epoch into the sink. A read or a sink that fails transiently
    /// starts the epoch over: the sink begins the batch again, dropping what it
    /// had not published, and the records are read again from the epoch's start.
    async fn read_epoch(
        &mut self,
        batch: BatchId,
        start: Option<PartitionOffsets>,
        deadline: Instant,
        idle: &mut IdleBackoff,
    ) -> Result<Epoch, QueryError<Src, Store, Proc, Snk, Dead>> {
        let retryable = |e: &QueryError<Src, Store, Proc, Snk, Dead>| match e {
            ExecutorError::Source(e) => Src::is_transient(e),
            ExecutorError::Sink(e) => Snk::is_transient(e),
            _ => false,
        };
        let what = "reading the epoch";
        let epoch = retrying!(self, Part::Source, what, true, retryable, async {
            self.read_epoch_once(batch, start.clone(), deadline, idle)
                .await
        })?;
        if matches!(epoch, Epoch::Read(_)) {
            self.reached.mark(Part::Sink);
        }
        Ok(epoch)
    }

    async fn read_epoch_once(
        &mut self,
        batch: BatchId,
        start: Option<PartitionOffsets>,
        deadline: Instant,
        idle: &mut IdleBackoff,
    ) -> Result<Epoch, QueryError<Src, Store, Proc, Snk, Dead>> {
        let epoch_start = Instant::now();
        let mut durations = DurationMs::default();
        let mut partitions = self.discover().await?;
        let mut from = match start {
            Some(from) => from,
            None => self.starting_offsets(&partitions).await?,
        };
        let mut losses = data_loss(&mut from, &partitions, self.options.fail_on_data_loss)?;
        for (tp, marks) in &partitions {
            from.entry(tp.clone()).or_insert(marks.low);
        }
        durations.latest_offset = micros(epoch_start.elapsed());
        let metadata = BatchMetadata {
            watermark_ms: next_watermark_ms(&mut self.processor),
            timestamp_ms: epoch_ms(SystemTime::now()),
            conf: event_time_conf(&mut self.processor),
        };
        let mut position = from.clone();
        let mut streamed = Streamed::default();
        let mut processed = Processed::default();
        let mut begun = false;
        let streaming = Instant::now();
        let latest = loop {
            let latest: PartitionOffsets = partitions
                .iter()
                .map(|(tp, marks)| (tp.clone(), marks.high))
                .collect();
            let end = self.source_limits(&position, &latest);
            let ranges: Vec<OffsetRange> = position
                .iter()
                .filter_map(|(tp, from)| {
                    let until = *end.get(tp)?;
                    (until > *from).then(|| OffsetRange {
                        topic_partition: tp.clone(),
                        from: *from,
                        until,
                    })
                })
                .collect();
            if !ranges.is_empty() {
                if !begun {
                    // Its end is decided when the epoch closes, so the batch
                    // begins without ranges.
                    self.in_batch = true;
                    self.begin_everywhere(batch, &metadata, &[], true).await?;
                    begun = true;
                }
                let t = Instant::now();
                let mut reader = retrying!(self, Part::Source, "reading the epoch", async {
                    self.source
                        .read(&ranges)
                        .await
                        .map_err(ExecutorError::Source)
                })?;
                durations.get_batch += micros(t.elapsed());
                while let Some(chunk) = reader.next_chunk().await.map_err(ExecutorError::Source)? {
                    self.process_chunk(chunk, &mut processed, &mut streamed, true)
                        .await?;
                }
                for loss in reader.data_loss() {
                    tracing::warn!(
                        lost_offsets = loss.lost_offsets(),
                        "{loss}; skipped while reading because fail_on_data_loss is false"
                    );
                    losses.push(loss.clone());
                }
                position.extend(end);
                idle.reset();
            }
            if Instant::now() >= deadline || *self.stop.borrow() {
                break latest;
            }
            if ranges.is_empty() {
                let wait = idle
                    .next_wait()
                    .min(deadline.saturating_duration_since(Instant::now()));
                if wait_for_next_trigger(
                    self.options.trigger,
                    Instant::now(),
                    Some(wait),
                    &mut self.stop,
                )
                .await
                    || Instant::now() >= deadline
                {
                    break latest;
                }
            }
            let t = Instant::now();
            partitions = self.discover().await?;
            durations.latest_offset += micros(t.elapsed());
            // A partition added during the epoch is read from its first offset.
            for (tp, marks) in &partitions {
                if !position.contains_key(tp) {
                    from.insert(tp.clone(), marks.low);
                    position.insert(tp.clone(), marks.low);
                }
            }
            losses.extend(data_loss(
                &mut position,
                &partitions,
                self.options.fail_on_data_loss,
            )?);
        };
        if !begun {
            return Ok(Epoch::Empty(from));
        }
        durations.add_batch = micros(streaming.elapsed()).saturating_sub(durations.get_batch);
        Ok(Epoch::Read(Box::new(EpochRead {
            from,
            end: position,
            latest,
            metadata,
            losses,
            streamed,
            durations,
        })))
    }

    /// Writes the epoch's plan, has the sink finish the batch and commits it.
    /// A sink that fails transiently at its finish gets the batch again from
    /// its plan, as a replay after a crash would.
    async fn commit_epoch(
        &mut self,
        batch: BatchId,
        read: EpochRead,
        trigger_start: Instant,
        timestamp: SystemTime,
        summary: &mut RunSummary,
        on_progress: &mut (impl FnMut(&QueryProgress) + Send),
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let EpochRead {
            from,
            end,
            latest,
            metadata,
            losses,
            mut streamed,
            mut durations,
        } = read;
        let plan = self
            .with_sources(BatchPlan::from_offsets(batch, &from, &end, metadata))
            .map_err(|e| ExecutorError::Plan {
                batch: batch.0,
                reason: e.to_string(),
            })?;
        let t = Instant::now();
        retrying!(self, Part::Store, "writing the plan", async {
            self.store
                .write_plan(&plan)
                .await
                .map_err(ExecutorError::Store)
        })?;
        durations.wal_commit = micros(t.elapsed());
        match self
            .finish_everywhere(batch, &mut streamed, &mut durations, true)
            .await
        {
            Ok(()) => {}
            Err(ExecutorError::Sink(e)) if Snk::is_transient(&e) => {
                tracing::warn!(
                    batch = batch.0,
                    error = %e,
                    "the sink could not finish the epoch; writing the batch again from its plan"
                );
                let planned = Planned {
                    plan,
                    replay: true,
                    latest,
                    losses,
                    durations: DurationMs::default(),
                    trigger_start,
                    timestamp,
                    sizing: None,
                };
                return self.execute(planned, summary, on_progress).await;
            }
            Err(other) => return Err(other),
        }
        let planned = Planned {
            plan,
            replay: false,
            latest,
            losses,
            durations,
            trigger_start,
            timestamp,
            sizing: None,
        };
        self.commit_batch(planned, streamed, summary, on_progress)
            .await
    }
}
