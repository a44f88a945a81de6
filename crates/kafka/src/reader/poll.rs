//! Taking records from the partition queues: into the batch being read or
//! into a partition's read-ahead buffer, pausing a partition whose buffer is
//! full and resuming it at half, and starting over a partition that stalled.

use super::*;

/// How many bytes a buffer holding `bytes` may hold after taking what its
/// queue holds: its `share`, and past it its `cap` while the read memory has
/// `spare` bytes; `None` when it is to take nothing more.
///
/// What is left queued is dropped at the pause and fetched again, whole record
/// batches at a time. Taking only what fitted the share made the broker send
/// 1,024 partitions at 10,000 records per trigger 1.9 times the topic with
/// 16 KiB record batches, and with 170 KiB ones, fetched whole again for every
/// few batches' records, read at a tenth of the raw consumer's rate.
fn room(bytes: usize, share: usize, cap: usize, spare: usize) -> Option<usize> {
    if bytes < share {
        Some(share)
    } else if spare > 0 && bytes < cap {
        Some(cap.min(bytes + spare))
    } else {
        None
    }
}

/// A number from 0 to `bytes`, the same for the same `index`, spread evenly
/// over indexes that follow each other (Fibonacci hashing).
fn spread(index: usize, bytes: usize) -> usize {
    let fraction = (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    ((fraction * bytes as u64) >> 32) as usize
}

/// The least time between two log lines about the read memory being full.
const CUT_REPORT_EVERY: Duration = Duration::from_secs(60);

impl ReaderState {
    /// Polls the queue of every partition that is fetching and has messages,
    /// and the consumer's own queue for librdkafka's events. Returns whether
    /// anything arrived.
    pub(super) fn poll_queues(&mut self, consumer: &BaseConsumer<SourceContext>) -> bool {
        let include_headers = self.client.config.include_headers;
        let share = self.share();
        let budget = self.client.config.read_memory_bytes;
        let mut held: usize = self.parts.iter().map(|p| p.buffer.bytes).sum();
        // Each partition's part of the read memory. With every partition read at
        // the same pace, equal parts fetch the record batches the fewest times in
        // all: taken first come, first served, the partitions left out fetched
        // their 170 KiB record batches again for every share of them (1,024
        // partitions at 10,000 per trigger: 2.75 times the records' bytes, 129
        // MiB; in equal parts 2.15 times, 111 MiB).
        let cap = share.max(budget / self.parts.len().max(1));
        let cut_before = self.stats.cut;
        let fetch_bytes = self.fetch_bytes(self.parts.len());
        let mut polled = false;
        let mut now = None;
        let mut restart = Vec::new();
        let ReaderState {
            parts,
            queues,
            read,
            stats,
            sizing,
            ..
        } = self;
        for (i, (part, queue)) in parts.iter_mut().zip(queues.iter_mut()).enumerate() {
            // Spread between a half and the whole of it, so that partitions read at
            // one pace run low at different batches: run low all at once, they
            // waited together for a round of fetches that serves a few partitions
            // each (in equal parts, 21.8 s; spread, 13.5 s at 90 MiB).
            let cap = share.max(cap / 2 + spread(i, cap / 2));
            // A full partition is polled only for what librdkafka already
            // queued for it, and only while the read memory has room: what is
            // left queued is dropped at its pause and fetched again.
            if part.fetch != Fetch::Fetching
                || part.out_of_range
                || (part.full && (held >= budget || part.buffer.bytes >= cap))
                || !queue.ready.swap(false, Ordering::Acquire)
            {
                continue;
            }
            let mut taken = 0;
            loop {
                if taken >= BURST {
                    // More to come: this queue's turn comes again next step.
                    queue.ready.store(true, Ordering::Release);
                    break;
                }
                let spare = budget.saturating_sub(held);
                let Some(room) = room(part.buffer.bytes, share, cap, spare) else {
                    stats.cut += 1;
                    queue.ready.store(true, Ordering::Release);
                    // What it kept of the run and what the pause will drop.
                    let left = queue.batch.len() * part.buffer.record_bytes;
                    sizing.run_ended(part, part.run + left, fetch_bytes);
                    part.run = 0;
                    break;
                };
                let want = part.buffer.room_in_records(room).min(BURST - taken);
                let before = part.buffer.bytes;
                let taken_before = part.taken;
                // What one call took is all kept, but after an offset out of
                // range, where the partition starts over from `next`.
                let mut failed = false;
                let n = queue.batch.take(want, |result| match result {
                    _ if part.out_of_range => {}
                    Ok(message) => {
                        part.last_message = *now.get_or_insert_with(Instant::now);
                        take(part, read.as_mut(), message, include_headers, share);
                        // While the batch's reader is behind, what the batch
                        // wants waits in the partition's buffer, within its
                        // share, like what later batches want: left in
                        // librdkafka's queues, it cost up to a fetch per
                        // partition, four times over (256 partitions in one
                        // batch into Cassandra: 432 MiB).
                        if read.as_ref().is_some_and(|r| r.out.ready.is_some()) {
                            hand_over(read);
                        }
                    }
                    Err(RDKafkaErrorCode::AutoOffsetReset | RDKafkaErrorCode::OffsetOutOfRange) => {
                        // Judged when a read needs the partition: the records
                        // buffered before it come first.
                        part.out_of_range = true;
                    }
                    Err(code) => {
                        // librdkafka retries transient broker errors itself and
                        // reports them here too; the stall and poll timeouts
                        // catch a partition that never recovers.
                        tracing::warn!(
                            error = %RdKafkaError::MessageConsumption(code),
                            "Kafka reported an error while reading; continuing"
                        );
                        failed = true;
                    }
                });
                held = (held + part.buffer.bytes).saturating_sub(before);
                part.run += (part.taken - taken_before) as usize;
                if n == 0 {
                    sizing.run_ended(part, part.run, fetch_bytes);
                    part.run = 0;
                    break;
                }
                polled = true;
                stats.polled += n as u64;
                taken += n;
                if part.out_of_range {
                    break;
                }
                if failed {
                    // Taken in a batch, an error moves librdkafka's position
                    // past the offset it names (`rd_kafka_q_serve_rkmessages`),
                    // where the next pause would resume, so a record could be
                    // skipped: the partition is assigned afresh at `next`.
                    restart.push((part.key(), false));
                    part.fetch = Fetch::Stopping;
                    break;
                }
            }
        }
        if !restart.is_empty() {
            self.unassign(restart);
        }
        if self.stats.cut > cut_before {
            self.report_cut(budget);
        }
        // Messages arrive here only for a partition whose queue was not split yet,
        // which `plan_parts` prevents by splitting before it assigns.
        while let Some(result) = consumer.poll(Duration::ZERO) {
            match result {
                Ok(message) => tracing::debug!(
                    topic = message.topic(),
                    partition = message.partition(),
                    offset = message.offset(),
                    "a message outside the partition queues"
                ),
                Err(e) => tracing::debug!(error = %e, "Kafka event outside the partition queues"),
            }
        }
        // Statistics arrive while that queue is served.
        if let Some(figures) = self.tally.update(&self.shared.statistics, &mut self.parts) {
            *lock(&self.shared.amplification) = Some(figures);
        }
        polled
    }

    /// Says, at most once a minute, that the read memory made partitions drop
    /// records they had fetched, to fetch them again, once that costs: when the
    /// latest statistics show records fetched half again as often as read. A
    /// query reading everything in one batch drops a little at the pauses and
    /// fetches about 1.06 times what it reads, which is not worth a warning.
    fn report_cut(&mut self, budget: usize) {
        let costly = lock(&self.shared.amplification)
            .as_ref()
            .is_some_and(|a| a.recent() >= 1.5);
        if !costly
            || self
                .last_cut_report
                .is_some_and(|at| at.elapsed() < CUT_REPORT_EVERY)
        {
            return;
        }
        self.last_cut_report = Some(Instant::now());
        let mib = |bytes: usize| bytes.div_ceil(1024 * 1024);
        tracing::warn!(
            read_memory_mb = mib(budget),
            partitions = self.parts.len(),
            times = self.stats.cut,
            "the read memory is full, so records that fetches brought beyond a partition's \
             share of the read-ahead are dropped and fetched again: the producers' record \
             batches are larger than {} KiB per partition, what read_memory_mb = {} holds over \
             {} partitions; raise read_memory_mb to read each record once (the progress \
             report's readAmplification says how often records are fetched)",
            budget / self.parts.len().max(1) / 1024,
            mib(budget),
            self.parts.len()
        );
    }

    /// Pauses the partitions whose buffers are full and resumes those whose
    /// buffers drained to half; stops those whose offsets are out of range, and
    /// assigns the others that need it at their next offsets.
    pub(super) fn flow(&mut self) {
        let low_water = self.share() / 2;
        let mut stop = Vec::new();
        let mut start = Vec::new();
        let mut pause = TopicPartitionList::new();
        let mut resume = TopicPartitionList::new();
        for (part, PartQueue { ready, .. }) in self.parts.iter_mut().zip(&self.queues) {
            match part.fetch {
                Fetch::Fetching | Fetch::Paused if part.out_of_range => {
                    stop.push((part.key(), part.fetch == Fetch::Paused));
                    part.fetch = Fetch::Stopping;
                    part.full = false;
                }
                Fetch::Fetching if part.full => {
                    pause.add_partition(&part.topic, part.partition);
                    part.fetch = Fetch::Paused;
                }
                Fetch::Paused if part.buffer.bytes <= low_water => {
                    resume.add_partition(&part.topic, part.partition);
                    part.fetch = Fetch::Fetching;
                    part.full = false;
                    part.last_message = Instant::now();
                    // The pause emptied the queue without librdkafka noting that
                    // it was polled, so the queue may not announce new messages.
                    ready.store(true, Ordering::Release);
                }
                Fetch::Idle if !part.out_of_range && part.buffer.bytes <= low_water => {
                    start.push((part.key(), part.next));
                    part.fetch = Fetch::Fetching;
                    part.last_message = Instant::now();
                }
                _ => {}
            }
        }
        if let Some(consumer) = &self.consumer {
            if pause.count() > 0 {
                self.stats.paused += pause.count() as u64;
                self.shared
                    .pauses
                    .fetch_add(pause.count() as u64, Ordering::Relaxed);
                if let Err(e) = consumer.pause(&pause) {
                    tracing::warn!(error = %e, "pausing {} partitions", pause.count());
                }
            }
            // A pause outdates what the partition queued, and a fetch answered
            // after it queues more: polling drops it now, instead of when the
            // partition resumes. Only queues that librdkafka filled since they
            // were last polled empty are polled: polling every paused queue at
            // every pause was an eighth of this thread's CPU at 1,024 partitions.
            for (part, PartQueue { split, ready, .. }) in self.parts.iter().zip(&self.queues) {
                if part.fetch == Fetch::Paused
                    && part.full
                    && ready.load(Ordering::Relaxed)
                    && ready.swap(false, Ordering::Acquire)
                {
                    while split.poll(Duration::ZERO).is_some() {
                        self.stats.dropped += 1;
                    }
                }
            }
            if resume.count() > 0 {
                self.stats.resumed += resume.count() as u64;
                if let Err(e) = consumer.resume(&resume) {
                    tracing::warn!(error = %e, "resuming {} partitions", resume.count());
                }
                // Wakes the broker thread (see the module's documentation).
                if let Some(first) = resume.elements().first() {
                    self.poke = Some((Arc::from(first.topic()), first.partition()));
                }
            }
        }
        // One poke at a time; one more after it if partitions resumed meanwhile.
        if !self.poking
            && let (Some(assigner), Some(key)) = (&self.assigner, self.poke.take())
        {
            self.poking = true;
            assigner.send(Change::Poke(key));
        }
        self.unassign(stop);
        if !start.is_empty() {
            self.stats.assigned += start.len() as u64;
            if let Some(assigner) = &self.assigner {
                assigner.send(Change::Assign(start));
            }
        }
    }

    /// With nothing arriving: takes positions past transaction markers, judges
    /// out-of-range offsets, restarts stalled partitions, and times a read out
    /// that makes no progress.
    pub(super) fn when_idle(
        &mut self,
        consumer: &BaseConsumer<SourceContext>,
    ) -> Result<(), KafkaError> {
        let Some(read) = &mut self.read else {
            return Ok(());
        };
        if read.remaining == 0 {
            return Ok(());
        }
        // Positions past markers, for unfinished partitions with nothing queued.
        let mut waiting = vec![false; self.parts.len()];
        for range in read.ranges.iter().filter(|r| !r.done) {
            let p = &self.parts[range.part];
            waiting[range.part] =
                p.fetch == Fetch::Fetching && !p.full && !p.out_of_range && p.buffer.is_empty();
        }
        if waiting.contains(&true) {
            let positions = consumer.position().map_err(|source| KafkaError::Kafka {
                what: "reading consumer positions".to_owned(),
                source: Box::new(source),
            })?;
            for elem in positions.elements() {
                let KafkaOffset::Offset(position) = elem.offset() else {
                    continue;
                };
                let Some(&i) = self
                    .by_name
                    .get(&(Arc::from(elem.topic()), elem.partition()))
                else {
                    continue;
                };
                let part = &mut self.parts[i];
                if !waiting[i] || position <= part.next {
                    continue;
                }
                part.next = position;
                if let Some(r) = part.range {
                    let range = &mut read.ranges[r];
                    part.start = part.start.max(position.min(range.until));
                    if finish_if_complete(range, part, &mut read.remaining) {
                        read.last_progress = Instant::now();
                    }
                }
            }
        }
        self.judge_data_loss()?;
        self.restart_stalled();
        let Some(read) = &self.read else {
            return Ok(());
        };
        let timeout = self.client.config.poll_timeout;
        if read.remaining > 0
            && read.last_progress.elapsed() > timeout
            && let Some(range) = read.ranges.iter().find(|r| !r.done)
        {
            let part = &self.parts[range.part];
            return Err(KafkaError::PollTimeout {
                topic_partition: part.topic_partition(),
                from: offset(range.from),
                until: offset(range.until),
                reached: offset(part.start),
                timeout_ms: timeout.as_millis(),
            });
        }
        Ok(())
    }

    /// Assigns afresh, at their next offsets, the partitions a read has waited for
    /// longer than [`STALL`] that delivered nothing meanwhile.
    pub(super) fn restart_stalled(&mut self) {
        let Some(read) = &self.read else {
            return;
        };
        if read.last_progress.elapsed() < STALL {
            return;
        }
        let mut stop = Vec::new();
        for range in read.ranges.iter().filter(|r| !r.done) {
            let part = &mut self.parts[range.part];
            if part.fetch == Fetch::Fetching
                && part.buffer.is_empty()
                && !part.out_of_range
                && part.last_message.elapsed() >= STALL
            {
                stop.push((part.key(), false));
                part.fetch = Fetch::Stopping;
            }
        }
        if stop.is_empty() {
            return;
        }
        tracing::debug!(
            partitions = stop.len(),
            "assigning partitions afresh that a read waited for in vain"
        );
        self.stats.stalled += stop.len() as u64;
        self.unassign(stop);
    }
}

#[cfg(test)]
mod tests {
    use super::{room, spread};

    #[test]
    fn a_buffer_takes_its_share_always_and_its_cap_while_the_read_memory_has_room() {
        let (share, cap) = (16, 64);
        assert_eq!(
            room(0, share, cap, 0),
            Some(16),
            "the share, whatever else holds"
        );
        assert_eq!(room(20, share, cap, 1000), Some(64), "up to the cap");
        assert_eq!(
            room(20, share, cap, 10),
            Some(30),
            "within what the memory has"
        );
        assert_eq!(room(20, share, cap, 0), None, "the read memory is full");
        assert_eq!(room(64, share, cap, 1000), None, "the cap is reached");
    }

    #[test]
    fn parts_of_the_read_memory_are_spread_evenly_from_nothing_to_all() {
        let bytes = 64 * 1024;
        let parts: Vec<usize> = (0..1024).map(|i| spread(i, bytes)).collect();
        assert!(parts.iter().all(|p| *p <= bytes));
        assert_eq!(
            spread(7, bytes),
            parts[7],
            "the same for the same partition"
        );
        // Every eighth of the range holds about an eighth of the partitions.
        for eighth in 0..8 {
            let (low, high) = (eighth * bytes / 8, (eighth + 1) * bytes / 8);
            let n = parts.iter().filter(|p| (low..high).contains(*p)).count();
            assert!(
                (120..=136).contains(&n),
                "{n} partitions in eighth {eighth}"
            );
        }
        // Partitions that follow each other differ, so they run low apart.
        assert!(parts.windows(2).all(|w| w[0] != w[1]));
    }
}
