//! Which partitions a query reads, from the cluster's metadata.

use std::collections::BTreeSet;
use std::sync::Arc;

use rdkafka::metadata::Metadata;
use regex::Regex;
use sluice_core::TopicPartition;

use crate::TopicSelection;

/// Whether `selection` reads `topic`, whatever partitions the cluster has.
pub(crate) fn selects(selection: &TopicSelection, pattern: Option<&Regex>, topic: &str) -> bool {
    match selection {
        TopicSelection::Assign(assigned) => assigned.contains_key(topic),
        TopicSelection::Subscribe(topics) => topics.iter().any(|t| t == topic),
        TopicSelection::SubscribePattern(_) => {
            !topic.starts_with("__") && pattern.is_some_and(|p| p.is_match(topic))
        }
    }
}

/// The partitions of `selection` that `metadata` knows. An assigned partition the
/// cluster does not have is left out: the data-loss classification reports it.
/// Topic names are taken from `names`, and added to it, so that the partitions
/// of every discovery share them and compare them by address.
pub(crate) fn select(
    selection: &TopicSelection,
    pattern: Option<&Regex>,
    metadata: &Metadata,
    names: &mut BTreeSet<Arc<str>>,
) -> BTreeSet<TopicPartition> {
    let mut selected = BTreeSet::new();
    for topic in metadata.topics() {
        if topic.error().is_some() {
            continue;
        }
        let name = topic.name();
        let wanted: Box<dyn Fn(i32) -> bool> = match selection {
            TopicSelection::Assign(assigned) => match assigned.get(name) {
                Some(partitions) => {
                    let partitions = partitions.clone();
                    Box::new(move |p| partitions.contains(&p))
                }
                None => continue,
            },
            TopicSelection::Subscribe(topics) => {
                if !topics.iter().any(|t| t == name) {
                    continue;
                }
                Box::new(|_| true)
            }
            TopicSelection::SubscribePattern(_) => {
                let matches = pattern.is_some_and(|p| p.is_match(name));
                if !matches || name.starts_with("__") {
                    continue;
                }
                Box::new(|_| true)
            }
        };
        let shared = match names.get(name) {
            Some(shared) => shared.clone(),
            None => {
                let shared: Arc<str> = Arc::from(name);
                names.insert(shared.clone());
                shared
            }
        };
        for partition in topic.partitions() {
            if wanted(partition.id()) {
                selected.insert(TopicPartition::new(shared.clone(), partition.id()));
            }
        }
    }
    selected
}
