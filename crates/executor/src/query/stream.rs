//! A batch streamed from the source through the processor into the sink and
//! the dead letters, chunk by chunk, begun again while the source or the sink
//! fails transiently.

use super::*;

impl<Src, Store, Snk, Proc, Dead> Query<Src, Store, Snk, Proc, Dead>
where
    Src: Source,
    Store: QueryStore,
    Proc: Processor,
    Snk: Writes<Proc::Output>,
    Dead: Writes,
{
    /// Streams the batch's records from the source through the processor into
    /// the sink, chunk by chunk. A read that fails transiently starts over, and the
    /// processor and sinks begin the batch again: reading a durable plan again is
    /// safe, because it reads the same ranges. A sink that fails transiently gets
    /// the batch again, and one that a runner which lost the query fenced on its
    /// way out is taken over again, while the store still names this runner.
    ///
    /// Without `write`, the sink and the dead letters get nothing: the batch is
    /// only processed, to rebuild state the sink already has the output of.
    pub(super) async fn stream(
        &mut self,
        plan: &BatchPlan,
        durations: &mut DurationMs,
        write: bool,
        mut early: Option<Src::Reader>,
    ) -> Result<Streamed, QueryError<Src, Store, Proc, Snk, Dead>> {
        let part = if write { Part::Sink } else { Part::Source };
        let retryable = |e: &QueryError<Src, Store, Proc, Snk, Dead>| match e {
            ExecutorError::Sink(e) => Snk::is_transient(e) || Snk::is_fenced(e),
            _ => false,
        };
        let mut fenced = false;
        let what = "writing the batch to the sink";
        retrying!(self, part, what, true, retryable, async {
            if std::mem::take(&mut fenced) {
                self.confirm_claim().await?;
                tracing::warn!(
                    "the sink was fenced, but this runner still holds the query: taking the \
                     sink over again"
                );
                self.take_over_sink().await?;
            }
            let streamed = self.read_batch(plan, durations, write, early.take()).await;
            fenced = matches!(&streamed, Err(ExecutorError::Sink(e)) if Snk::is_fenced(e));
            streamed
        })
    }

    /// Reads the batch into the processor and the sink, starting over while the
    /// source fails transiently.
    pub(super) async fn read_batch(
        &mut self,
        plan: &BatchPlan,
        durations: &mut DurationMs,
        write: bool,
        mut early: Option<Src::Reader>,
    ) -> Result<Streamed, QueryError<Src, Store, Proc, Snk, Dead>> {
        let mut processed = Processed::default();
        // A processor's transient failure (a lookup table's store timing out)
        // begins the batch again as a source's does.
        let retryable = |e: &QueryError<Src, Store, Proc, Snk, Dead>| match e {
            ExecutorError::Source(e) => Src::is_transient(e),
            ExecutorError::Process(e) => Proc::is_transient(e),
            _ => false,
        };
        retrying!(
            self,
            Part::Source,
            "reading the batch",
            true,
            retryable,
            async {
                self.read_once(plan, durations, write, early.take(), &mut processed)
                    .await
            }
        )
    }

    /// One attempt of [`Self::read_batch`]: begins the batch everywhere, reads
    /// it to its end and finishes it everywhere.
    pub(super) async fn read_once(
        &mut self,
        plan: &BatchPlan,
        durations: &mut DurationMs,
        write: bool,
        early: Option<Src::Reader>,
        processed: &mut Processed<Proc::Output>,
    ) -> Result<Streamed, QueryError<Src, Store, Proc, Snk, Dead>> {
        let batch = plan.id();
        let t = Instant::now();
        self.begin_everywhere(batch, plan.metadata(), plan.ranges(), write)
            .await?;
        let mut reader = match early {
            Some(reader) => reader,
            None => retrying!(self, Part::Source, "reading the batch", async {
                self.source
                    .read(plan.ranges())
                    .await
                    .map_err(ExecutorError::Source)
            })?,
        };
        durations.get_batch = micros(t.elapsed());
        let mut streamed = Streamed::default();
        while let Some(chunk) = reader.next_chunk().await.map_err(ExecutorError::Source)? {
            self.process_chunk(chunk, processed, &mut streamed, write)
                .await?;
        }
        streamed.losses = reader.data_loss().to_vec();
        for loss in &streamed.losses {
            tracing::warn!(
                lost_offsets = loss.lost_offsets(),
                "{loss}; skipped while reading because fail_on_data_loss is false"
            );
        }
        self.finish_everywhere(batch, &mut streamed, durations, write)
            .await?;
        Ok(streamed)
    }

    /// Begins `batch` on the processor and, when it writes, on the sink and the
    /// dead letters.
    pub(super) async fn begin_everywhere(
        &mut self,
        batch: BatchId,
        metadata: &BatchMetadata,
        ranges: &[OffsetRange],
        write: bool,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        self.processor
            .begin_batch(batch, metadata)
            .await
            .map_err(ExecutorError::Process)?;
        if write {
            self.sink
                .begin_batch(batch, ranges)
                .await
                .map_err(ExecutorError::Sink)?;
            if self.any_dead_letters() {
                self.dead_letters
                    .begin_batch(batch, ranges)
                    .await
                    .map_err(ExecutorError::DeadLetters)?;
            }
        }
        Ok(())
    }

    /// Puts one chunk read through the processor and delivers what it made.
    pub(super) async fn process_chunk(
        &mut self,
        chunk: RecordChunk,
        processed: &mut Processed<Proc::Output>,
        streamed: &mut Streamed,
        write: bool,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let source = chunk.source();
        let rows = chunk.len() as u64;
        streamed.rows += rows;
        processed.clear();
        self.processor
            .process(chunk, processed)
            .await
            .map_err(ExecutorError::Process)?;
        streamed.of_source(source).0 += rows;
        self.deliver(processed, streamed, write, source).await
    }

    /// Ends `batch` on the processor, delivering what its end emits, and, when
    /// it writes, on the sink (timed as `sinkCommit`) and the dead letters.
    pub(super) async fn finish_everywhere(
        &mut self,
        batch: BatchId,
        streamed: &mut Streamed,
        durations: &mut DurationMs,
        write: bool,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        let mut processed = Processed::default();
        self.processor
            .finish_batch(batch, &mut processed)
            .await
            .map_err(ExecutorError::Process)?;
        self.deliver(&processed, streamed, write, 0).await?;
        if write {
            let t = Instant::now();
            self.sink
                .finish_batch(batch)
                .await
                .map_err(ExecutorError::Sink)?;
            durations.sink_commit = micros(t.elapsed());
            if self.any_dead_letters() {
                self.dead_letters
                    .finish_batch(batch)
                    .await
                    .map_err(ExecutorError::DeadLetters)?;
            }
        }
        Ok(())
    }

    /// Whether a source sends its bad records to the dead letters.
    pub(super) fn any_dead_letters(&self) -> bool {
        self.options
            .sources
            .iter()
            .any(|s| s.on_bad_record == BadRecordPolicy::DeadLetter)
    }

    /// Hands what the processor made to the sink (unless the batch writes
    /// nothing), and its bad records, read by `source`, to that source's
    /// policy: stop, skip, or the dead letters.
    pub(super) async fn deliver(
        &mut self,
        processed: &Processed<Proc::Output>,
        streamed: &mut Streamed,
        write: bool,
        source: usize,
    ) -> Result<(), QueryError<Src, Store, Proc, Snk, Dead>> {
        if !processed.bad.is_empty() {
            let policy = self
                .options
                .sources
                .get(source)
                .map_or(BadRecordPolicy::default(), |s| s.on_bad_record);
            match policy {
                BadRecordPolicy::Fail => return Err(first_bad_record(&processed.bad)),
                BadRecordPolicy::Skip => {}
                BadRecordPolicy::DeadLetter if !write => {}
                BadRecordPolicy::DeadLetter => self
                    .dead_letters
                    .write(&processed.bad)
                    .await
                    .map_err(ExecutorError::DeadLetters)?,
            }
            streamed.bad_records += processed.bad.len() as u64;
            streamed.of_source(source).1 += processed.bad.len() as u64;
        }
        if write {
            for rows in &processed.rows {
                self.sink.write(rows).await.map_err(ExecutorError::Sink)?;
            }
        }
        streamed.output_rows += processed.row_count;
        Ok(())
    }
}
