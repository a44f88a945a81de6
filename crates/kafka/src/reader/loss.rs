//! Out-of-range offsets, judged against fresh watermarks and named as data
//! loss.

use super::*;

impl ReaderState {
    /// Judges the partitions a read needs whose next offsets librdkafka found out
    /// of range, once their buffered records are taken: stops the read, or skips
    /// ahead as `fail_on_data_loss` says.
    pub(super) fn judge_data_loss(&mut self) -> Result<(), KafkaError> {
        let Some(read) = &mut self.read else {
            return Ok(());
        };
        let lost: Vec<usize> = read
            .ranges
            .iter()
            .filter(|r| !r.done)
            .map(|r| r.part)
            .filter(|&i| self.parts[i].out_of_range && self.parts[i].buffer.is_empty())
            .collect();
        if lost.is_empty() {
            return Ok(());
        }
        let partitions = lost
            .iter()
            .map(|&i| self.parts[i].topic_partition())
            .collect();
        let earliest = self.client.list_offsets(&partitions, Position::Earliest)?;
        let latest = self.client.list_offsets(&partitions, Position::Latest)?;
        let mut found = Vec::new();
        for &i in &lost {
            let part = &mut self.parts[i];
            let tp = part.topic_partition();
            let marks = match (
                earliest.get(&tp).copied().flatten(),
                latest.get(&tp).copied().flatten(),
            ) {
                (Some(low), Some(high)) => Some(sluice_core::OffsetBounds {
                    low,
                    high: high.max(low),
                }),
                _ => None,
            };
            match classify_data_loss(&tp, Some(offset(part.next)), marks) {
                Some(loss) => found.push((i, loss)),
                // Not lost after all (a leader change): fetch again.
                None => part.out_of_range = false,
            }
        }
        if self.client.config.fail_on_data_loss && !found.is_empty() {
            return Err(KafkaError::DataLoss(
                found.into_iter().map(|(_, loss)| loss).collect(),
            ));
        }
        for (i, loss) in found {
            tracing::warn!(
                lost_offsets = loss.lost_offsets(),
                "{loss}; skipping ahead because fail_on_data_loss is false"
            );
            let part = &mut self.parts[i];
            part.out_of_range = false;
            if let Some(r) = part.range {
                let range = &mut read.ranges[r];
                match (&loss, loss.resume_at()) {
                    (DataLoss::Purged { .. }, Some(resume)) if resume.value() < range.until => {
                        part.next = resume.value();
                        part.start = resume.value();
                    }
                    _ => {
                        // Nothing of the range is left; the partition goes on
                        // from wherever the next plan says.
                        part.next = part.next.max(range.until);
                        part.start = range.until;
                        finish_if_complete(range, part, &mut read.remaining);
                    }
                }
            }
            read.losses.push(loss);
            read.last_progress = Instant::now();
        }
        Ok(())
    }
}
