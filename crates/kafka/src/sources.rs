//! Several Kafka sources read as one query's: each with its own consumer,
//! cluster and options, numbered in the order the query declares them, so
//! that a plan keeps a line per source and a chunk says which source read it.

use std::collections::BTreeMap;
use std::task::Poll;

use sluice_core::{
    BatchReader, DataLoss, OffsetBounds, OffsetRange, PartitionOffsets, ReadAmplification,
    RecordChunk, Source, StartingOffsets, TopicPartition,
};

use crate::{KafkaBatchReader, KafkaError, KafkaSource};

/// A query's Kafka sources. With one, it is that source; with several, each
/// topic is read by exactly one of them.
pub struct KafkaSources {
    sources: Vec<(String, KafkaSource)>,
}

impl KafkaSources {
    /// The sources, each with its name (the query's table), in the order the
    /// query declares them. Refuses none at all.
    pub fn new(sources: Vec<(String, KafkaSource)>) -> Result<KafkaSources, KafkaError> {
        if sources.is_empty() {
            return Err(KafkaError::Config(
                "a query needs at least one source".to_owned(),
            ));
        }
        Ok(KafkaSources { sources })
    }

    /// The first source: the only one of a query that reads one.
    pub fn first(&self) -> &KafkaSource {
        &self.sources[0].1
    }

    /// Every source, in order, with its name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &KafkaSource)> {
        self.sources.iter().map(|(name, s)| (name.as_str(), s))
    }

    /// The sources that select `topic`, by index.
    fn selecting(&self, topic: &str) -> Vec<usize> {
        self.sources
            .iter()
            .enumerate()
            .filter(|(_, (_, s))| s.selects(topic))
            .map(|(i, _)| i)
            .collect()
    }

    /// `items` split by the source of their partition, in source order.
    fn split<T: Clone>(
        &self,
        items: impl IntoIterator<Item = (TopicPartition, T)>,
    ) -> Vec<BTreeMap<TopicPartition, T>> {
        let mut parts = vec![BTreeMap::new(); self.sources.len()];
        for (tp, item) in items {
            let index = self.source_of(&tp.topic).unwrap_or(0);
            parts[index].insert(tp, item);
        }
        parts
    }
}

impl Source for KafkaSources {
    type Error = KafkaError;
    type Reader = KafkaSourcesReader;

    async fn partitions(&mut self) -> Result<BTreeMap<TopicPartition, OffsetBounds>, KafkaError> {
        let mut all = BTreeMap::new();
        let several = self.sources.len() > 1;
        for (_, source) in &mut self.sources {
            all.extend(source.partitions().await?);
        }
        if several {
            // A pattern may come to match another source's topic: its records
            // would be read twice, once for each table.
            for tp in all.keys() {
                let selecting = self.selecting(&tp.topic);
                if selecting.len() > 1 {
                    let names: Vec<&str> = selecting
                        .iter()
                        .map(|i| self.sources[*i].0.as_str())
                        .collect();
                    return Err(KafkaError::Config(format!(
                        "topic {} is read by the sources {}: a topic may be read by one source \
                         only; narrow their subscribe, subscribe_pattern or assign",
                        tp.topic,
                        names.join(" and ")
                    )));
                }
            }
        }
        Ok(all)
    }

    async fn starting_offsets(
        &mut self,
        starting: &StartingOffsets,
        partitions: &BTreeMap<TopicPartition, OffsetBounds>,
    ) -> Result<PartitionOffsets, KafkaError> {
        let parts = self.split(partitions.iter().map(|(tp, b)| (tp.clone(), *b)));
        let mut starts = PartitionOffsets::new();
        for ((_, source), part) in self.sources.iter_mut().zip(parts) {
            if !part.is_empty() {
                starts.extend(source.starting_offsets(starting, &part).await?);
            }
        }
        Ok(starts)
    }

    async fn read(&mut self, ranges: &[OffsetRange]) -> Result<KafkaSourcesReader, KafkaError> {
        let mut parts = vec![Vec::new(); self.sources.len()];
        for range in ranges {
            let index = self.source_of(&range.topic_partition.topic).unwrap_or(0);
            parts[index].push(range.clone());
        }
        let mut readers = Vec::new();
        for (index, ((_, source), part)) in self.sources.iter_mut().zip(parts).enumerate() {
            // A plan without ranges is read by the first source, so that a
            // query of one source reads exactly as that source alone.
            if !part.is_empty() || (index == 0 && ranges.is_empty()) {
                readers.push((index, source.read(&part).await?));
            }
        }
        Ok(KafkaSourcesReader {
            readers,
            next: 0,
            data_loss: Vec::new(),
        })
    }

    fn source_count(&self) -> usize {
        self.sources.len()
    }

    fn source_of(&self, topic: &str) -> Option<usize> {
        match self.sources.len() {
            1 => Some(0),
            _ => self.selecting(topic).first().copied(),
        }
    }

    fn is_transient(error: &KafkaError) -> bool {
        <KafkaSource as Source>::is_transient(error)
    }

    fn read_amplification(&self) -> Option<ReadAmplification> {
        let mut all: Option<ReadAmplification> = None;
        for (_, source) in &self.sources {
            let Some(one) = source.read_amplification() else {
                continue;
            };
            let sum = all.get_or_insert_default();
            sum.fetched_bytes += one.fetched_bytes;
            sum.read_bytes += one.read_bytes;
            sum.recent_fetched_bytes += one.recent_fetched_bytes;
            sum.recent_read_bytes += one.recent_read_bytes;
            sum.worst_partitions.extend(one.worst_partitions);
        }
        if let Some(all) = &mut all {
            all.worst_partitions
                .sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            all.worst_partitions.truncate(3);
        }
        all
    }

    async fn commit_progress(&mut self, offsets: &PartitionOffsets) -> Result<(), KafkaError> {
        let parts = self.split(offsets.iter().map(|(tp, o)| (tp.clone(), *o)));
        for ((_, source), part) in self.sources.iter_mut().zip(parts) {
            if !part.is_empty() {
                source.commit_progress(&part).await?;
            }
        }
        Ok(())
    }
}

/// The records of one batch from each source that has ranges in it, the
/// sources' chunks taken as they come and each marked with its source.
pub struct KafkaSourcesReader {
    readers: Vec<(usize, KafkaBatchReader)>,
    /// The reader polled first next time, so that no source waits behind
    /// another's steady stream.
    next: usize,
    data_loss: Vec<DataLoss>,
}

impl BatchReader for KafkaSourcesReader {
    type Error = KafkaError;

    async fn next_chunk(&mut self) -> Result<Option<RecordChunk>, KafkaError> {
        std::future::poll_fn(|cx| {
            while !self.readers.is_empty() {
                let count = self.readers.len();
                let mut pending = false;
                for step in 0..count {
                    let at = (self.next + step) % count;
                    let (index, reader) = &mut self.readers[at];
                    match reader.poll_chunk(cx) {
                        Poll::Pending => pending = true,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Ready(Ok(Some(mut chunk))) => {
                            chunk.set_source(*index);
                            self.next = (at + 1) % count;
                            return Poll::Ready(Ok(Some(chunk)));
                        }
                        Poll::Ready(Ok(None)) => {
                            let (_, done) = self.readers.remove(at);
                            self.data_loss.extend_from_slice(done.data_loss());
                            self.next = 0;
                            pending = false;
                            break;
                        }
                    }
                }
                if pending {
                    return Poll::Pending;
                }
            }
            Poll::Ready(Ok(None))
        })
        .await
    }

    fn data_loss(&self) -> &[DataLoss] {
        &self.data_loss
    }
}
