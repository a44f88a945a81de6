//! Where a batch's reads begin: which partitions of the plan are assigned,
//! at which offsets, and which are let go, as the reading thread decides them
//! when a batch begins and when the assigning thread reports back.

use super::*;

impl ReaderState {
    /// Starts reading `ranges`: partitions whose range starts where they stand go
    /// on from their buffers; the others start over at their range's start.
    pub(super) fn begin(&mut self, ranges: Vec<OffsetRange>, events: Events) {
        self.read = None;
        let fresh = self
            .consumer(ranges.len())
            .and_then(|consumer| self.plan_parts(&consumer, &ranges));
        match fresh {
            Ok(true) => {
                self.shared.assignments.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {}
            Err(e) => {
                self.forget_all();
                let _ = events.try_send(Err(e));
                return;
            }
        }
        let read = BatchRead {
            events,
            ranges: Vec::with_capacity(ranges.len()),
            remaining: 0,
            out: Out {
                chunk: new_chunk(),
                ready: None,
            },
            losses: Vec::new(),
            last_progress: Instant::now(),
            progressed: false,
        };
        self.track(&ranges, read);
    }

    /// Goes on with `read` over `ranges`, the rest of its ranges, after the
    /// consumer was made again: what it handed over and the data loss it met
    /// stay with it.
    pub(super) fn begin_carrying(&mut self, ranges: Vec<OffsetRange>, mut read: BatchRead) {
        let planned = self
            .consumer(ranges.len())
            .and_then(|consumer| self.plan_parts(&consumer, &ranges));
        if let Err(e) = planned {
            self.forget_all();
            let _ = read.events.try_send(Err(e));
            return;
        }
        read.ranges.clear();
        read.remaining = 0;
        read.last_progress = Instant::now();
        self.track(&ranges, read);
    }

    /// Makes `read` the read in progress, over `ranges`.
    fn track(&mut self, ranges: &[OffsetRange], mut read: BatchRead) {
        for (i, r) in ranges.iter().enumerate() {
            let part = match self.parts.get(i) {
                Some(p) if p.is(&r.topic_partition) => i,
                _ => self.by_name[&(r.topic_partition.topic.clone(), r.topic_partition.partition)],
            };
            self.parts[part].range = Some(i);
            let mut range = Range {
                part,
                from: r.from.value(),
                until: r.until.value(),
                done: false,
            };
            read.remaining += 1;
            finish_if_complete(&mut range, &mut self.parts[part], &mut read.remaining);
            read.ranges.push(range);
        }
        self.read = Some(read);
    }

    /// Makes the known partitions those of `ranges`, each standing at its
    /// range's start. Returns whether any partition started over.
    pub(super) fn plan_parts(
        &mut self,
        consumer: &Arc<BaseConsumer<SourceContext>>,
        ranges: &[OffsetRange],
    ) -> Result<bool, KafkaError> {
        // The usual read continues the last one over the same partitions, which
        // plans list in the same order: then nothing changes, and the keyed
        // matching below, an allocation and a hashed lookup per partition, was
        // a twentieth of the process's CPU at 1,024 partitions (`perf`).
        if continues(&self.parts, ranges) {
            for part in &mut self.parts {
                part.range = None;
            }
            self.flow();
            return Ok(false);
        }
        let wanted: HashMap<Key, i64> = ranges
            .iter()
            .map(|r| {
                (
                    (r.topic_partition.topic.clone(), r.topic_partition.partition),
                    r.from.value(),
                )
            })
            .collect();
        // Partitions no longer planned go, and those that do not continue stop
        // fetching and start over.
        let mut fresh = false;
        let mut stop = Vec::new();
        let mut keep = Vec::with_capacity(self.parts.len());
        let queues = std::mem::take(&mut self.queues);
        for (mut part, queue) in std::mem::take(&mut self.parts).into_iter().zip(queues) {
            part.range = None;
            let from = wanted.get(&part.key()).copied();
            if from == Some(part.start) {
                keep.push((part, queue));
                continue;
            }
            fresh = true;
            if matches!(part.fetch, Fetch::Fetching | Fetch::Paused) {
                stop.push((part.key(), part.fetch == Fetch::Paused));
            }
            let Some(from) = from else {
                continue;
            };
            part.discard_buffer();
            part.start = from;
            part.next = from;
            part.full = false;
            part.out_of_range = false;
            if matches!(part.fetch, Fetch::Fetching | Fetch::Paused) {
                part.fetch = Fetch::Stopping;
            }
            keep.push((part, queue));
        }
        (self.parts, self.queues) = keep.into_iter().unzip();
        self.unassign(stop);
        self.by_name = self
            .parts
            .iter()
            .enumerate()
            .map(|(i, p)| (p.key(), i))
            .collect();
        for (key, from) in wanted {
            if self.by_name.contains_key(&key) {
                continue;
            }
            fresh = true;
            let no_queue = |what: String| KafkaError::Kafka {
                what,
                source: Box::new(RdKafkaError::Subscription(
                    "librdkafka has no queue for this partition".to_owned(),
                )),
            };
            let mut queue = consumer
                .split_partition_queue(&key.0, key.1)
                .ok_or_else(|| {
                    no_queue(format!("giving {}-{} a queue of its own", key.0, key.1))
                })?;
            let batch = BatchQueue::of(consumer.client(), &key.0, key.1).ok_or_else(|| {
                no_queue(format!("taking {}-{}'s queue in batches", key.0, key.1))
            })?;
            // Polling a thousand empty queues per step cost most of a read
            // (`perf`: clock reads and locks inside the poll), so only queues that
            // librdkafka filled are polled.
            let shared = self.shared.clone();
            let ready = Arc::new(AtomicBool::new(true));
            let flag = ready.clone();
            queue.set_nonempty_callback(move || {
                flag.store(true, Ordering::Release);
                shared.signal.notify();
            });
            // Still being unassigned after an earlier read: wait for that.
            let fetch = if self.stopping.contains_key(&key) {
                Fetch::Stopping
            } else {
                Fetch::Idle
            };
            self.by_name.insert(key.clone(), self.parts.len());
            self.queues.push(PartQueue {
                split: queue,
                batch,
                ready,
            });
            let mut part = Part::new(key.0, key.1);
            part.fetch = fetch;
            part.start = from;
            part.next = from;
            self.parts.push(part);
        }
        // Partitions with empty ranges are assigned too, so that they read ahead
        // for the batches to come.
        self.flow();
        Ok(fresh)
    }

    /// Asks the assigner to unassign `parts`, given with whether they are paused.
    /// Those paused are resumed first, here, as librdkafka keeps a pause across
    /// assignments; a partition's operations are served in order, so the
    /// resumption takes effect before the unassignment.
    pub(super) fn unassign(&mut self, parts: Vec<(Key, bool)>) {
        if parts.is_empty() {
            return;
        }
        self.stats.stopped += parts.len() as u64;
        let mut paused = TopicPartitionList::new();
        for ((topic, partition), was_paused) in &parts {
            if *was_paused {
                paused.add_partition(topic, *partition);
            }
        }
        if paused.count() > 0
            && let Some(consumer) = &self.consumer
            && let Err(e) = consumer.resume(&paused)
        {
            tracing::debug!(error = %e, "resuming partitions before unassigning them");
        }
        let keys: Vec<Key> = parts.into_iter().map(|(key, _)| key).collect();
        for key in &keys {
            *self.stopping.entry(key.clone()).or_default() += 1;
        }
        if let Some(assigner) = &self.assigner {
            assigner.send(Change::Unassign(keys));
        }
    }

    /// Takes in the changes the assigner made: a partition whose unassignment is
    /// made has nothing current queued, and may be assigned again.
    pub(super) fn take_changes(&mut self) -> Result<(), KafkaError> {
        let changed = std::mem::take(&mut *lock(&self.shared.changed));
        for change in changed {
            let keys = match change? {
                Change::Unassign(keys) => keys,
                Change::Poke(_) => {
                    self.poking = false;
                    continue;
                }
                Change::Assign(_) => continue,
            };
            for key in keys {
                let left = match self.stopping.get_mut(&key) {
                    Some(count) => {
                        *count = count.saturating_sub(1);
                        *count
                    }
                    None => 0,
                };
                if left > 0 {
                    continue;
                }
                self.stopping.remove(&key);
                if let Some(&i) = self.by_name.get(&key)
                    && self.parts[i].fetch == Fetch::Stopping
                {
                    // Outdated by the unassignment: the poll drops them.
                    while self.queues[i].split.poll(Duration::ZERO).is_some() {}
                    self.parts[i].fetch = Fetch::Idle;
                }
            }
        }
        Ok(())
    }
}
