//! Group mode in the runner (`docs/scale-out.md`): joins the query's consumer
//! group and runs each generation as a query of its own, built like any other
//! from the configuration, over the partitions the group assigned.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use sluice_cassandra_store::{
    CassandraDirectory, CassandraLocation, CassandraOptions, CassandraStore, CassandraStoreError,
};
use sluice_core::{
    Generation, OffsetStore, PartitionOffsets, Recovery, Source, SpecificOffset, StartingOffsets,
    StartingOptions, StoredBatches, TopicPartition,
};
use sluice_executor::{Generations, GroupQuery, GroupQueryError};
use sluice_kafka::{
    GroupConfig, GroupProtocol, KafkaError, KafkaMembership, KafkaSink, KafkaSource, TopicSelection,
};
use tokio::sync::watch;

use crate::config::{Settings, SinkKind};
use crate::exit::{Classify, Exit};

/// A run that is a generation of a query in group mode.
pub(crate) struct InGroup {
    /// The generation, which names the sink's output.
    pub(crate) generation: Generation,
    /// Whether the run only recovers: it replays what the generation planned
    /// and did not commit, and stops (settling it).
    pub(crate) recovery_only: bool,
    /// The process's status page, served from the first generation on and
    /// shared by all of them, since the address and the metrics recorder can
    /// be taken only once.
    pub(crate) status: Arc<tokio::sync::OnceCell<sluice_status::Status>>,
    /// The member's store, as its status page names it.
    pub(crate) store: String,
}

/// A generation that failed, with the exit code it ends the process with.
pub(crate) struct GenerationFailed {
    exit: Exit,
    /// Whether trying again may help (Kafka or Cassandra away for a moment).
    transient: bool,
}

impl std::fmt::Debug for GenerationFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.exit.error)
    }
}

impl std::fmt::Display for GenerationFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#}", self.exit.error)
    }
}

impl std::error::Error for GenerationFailed {}

impl From<Exit> for GenerationFailed {
    fn from(exit: Exit) -> Self {
        GenerationFailed {
            exit,
            transient: false,
        }
    }
}

fn from_cassandra(error: CassandraStoreError) -> GenerationFailed {
    GenerationFailed {
        transient: error.is_transient(),
        exit: Exit::cassandra(error),
    }
}

fn from_kafka(error: KafkaError) -> GenerationFailed {
    GenerationFailed {
        transient: <KafkaSource as Source>::is_transient(&error),
        exit: error.exit(),
    }
}

/// Runs this process's part of the query until it is stopped.
pub(crate) async fn run(
    settings: Settings,
    location: CassandraLocation,
    options: CassandraOptions,
    protocol: GroupProtocol,
) -> Result<(), Exit> {
    let group_id = settings
        .kafka()
        .group_id
        .clone()
        .expect("the configuration refuses scale_out without a group_id");
    let topics = GroupConfig::topics_of(&settings.kafka().selection).map_err(Classify::exit)?;
    let member = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let directory = CassandraDirectory::open(location.clone(), options.clone())
        .await
        .map_err(Exit::cassandra)?;
    let membership = KafkaMembership::join(
        &GroupConfig {
            bootstrap_servers: settings.kafka().bootstrap_servers.clone(),
            group_id: group_id.clone(),
            topics,
            protocol,
            client_options: settings.kafka().client_options.clone(),
        },
        &member,
    )
    .map_err(Classify::exit)?;
    tracing::info!(
        member,
        group = group_id,
        query = location.query,
        "joined the query's consumer group"
    );
    let retry = settings.retry;
    let generations = RunnerGenerations {
        settings: Arc::new(settings),
        location: location.clone(),
        options,
        status: Arc::default(),
    };
    let mut query = GroupQuery::new(
        location.query.clone(),
        membership,
        directory,
        generations,
        retry,
    );
    let result = query.run(crate::stop_on_signals()).await;
    query.into_membership().leave().await;
    match result {
        Ok(summary) => {
            tracing::info!(
                generations = summary.generations,
                settled = summary.settled,
                "left the query's consumer group"
            );
            Ok(())
        }
        Err(GroupQueryError::Generation(failed)) => Err(failed.exit),
        Err(GroupQueryError::Directory(error)) => Err(Exit::cassandra(error)),
        Err(GroupQueryError::Membership(error)) => Err(error.exit()),
        Err(error @ GroupQueryError::Unsettled(_)) => {
            Err(Exit::checkpoint_state(anyhow::Error::new(error)))
        }
        Err(GroupQueryError::Stopped { what }) => {
            tracing::info!("stopped while retrying {what}");
            Ok(())
        }
        Err(error) => Err(Exit::runtime(anyhow::Error::new(error))),
    }
}

/// Builds and runs each generation from the configuration.
struct RunnerGenerations {
    settings: Arc<Settings>,
    /// The query's own location: each generation's log is a query beside it.
    location: CassandraLocation,
    options: CassandraOptions,
    /// The status page, once the first generation serves it.
    status: Arc<tokio::sync::OnceCell<sluice_status::Status>>,
}

impl RunnerGenerations {
    /// Where `generation`'s log lives, and how a brand-new log gets the query id.
    fn log_of(
        &self,
        query_id: &str,
        generation: &Generation,
    ) -> (CassandraLocation, CassandraOptions) {
        let location = CassandraLocation {
            query: generation.log_name(&self.location.query),
            ..self.location.clone()
        };
        let options = CassandraOptions {
            query_id: Some(query_id.to_owned()),
            ..self.options.clone()
        };
        (location, options)
    }

    /// The configuration of a run over exactly `partitions`.
    fn settings_over(&self, partitions: impl Iterator<Item = TopicPartition>) -> Settings {
        let mut assign: BTreeMap<String, Vec<i32>> = BTreeMap::new();
        for tp in partitions {
            assign
                .entry(tp.topic.to_string())
                .or_default()
                .push(tp.partition);
        }
        let mut settings = (*self.settings).clone();
        settings.first_mut().source.kafka.selection = TopicSelection::Assign(assign);
        settings
    }

    /// The source over the query's whole subscription, for lookups.
    fn subscription(&self) -> Result<KafkaSource, GenerationFailed> {
        KafkaSource::new(self.settings.kafka().clone(), "lookups").map_err(from_kafka)
    }

    /// Runs the query of `generation` with `store` until `stop` turns true.
    async fn run_with(
        &self,
        settings: Settings,
        query_id: &str,
        generation: &Generation,
        store: CassandraStore,
        stop: watch::Receiver<bool>,
        recovery_only: bool,
    ) -> Result<(), GenerationFailed> {
        let processor = match settings.processing.is_pass_through() {
            true => None,
            false => Some(crate::processor(&settings).await?),
        };
        let shown = format!(
            "cassandra {}/{}",
            self.location.keyspace,
            generation.log_name(&self.location.query)
        );
        crate::with_store(
            settings,
            processor,
            query_id.to_owned(),
            store,
            shown,
            stop,
            Some(InGroup {
                generation: generation.clone(),
                recovery_only,
                status: self.status.clone(),
                store: format!(
                    "cassandra {}/{}, group mode as member {}",
                    self.location.keyspace,
                    self.location.query,
                    generation.member()
                ),
            }),
        )
        .await?;
        Ok(())
    }

    /// The log as it is now, read without claiming it.
    async fn log(
        &self,
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<StoredBatches, GenerationFailed> {
        Ok(CassandraStore::inspect(location, options)
            .await
            .map_err(from_cassandra)?
            .map(|(_, stored)| stored)
            .unwrap_or_default())
    }
}

impl Generations for RunnerGenerations {
    type Error = GenerationFailed;

    async fn initial_offsets(&mut self) -> Result<PartitionOffsets, GenerationFailed> {
        let mut source = self.subscription()?;
        let partitions = source.partitions().await.map_err(from_kafka)?;
        source
            .starting_offsets(
                &self.settings.first().source.starting.resolve(),
                &partitions,
            )
            .await
            .map_err(from_kafka)
    }

    async fn earliest(
        &mut self,
        partitions: &BTreeSet<TopicPartition>,
    ) -> Result<PartitionOffsets, GenerationFailed> {
        let mut source = self.subscription()?;
        let bounds = source.partitions().await.map_err(from_kafka)?;
        Ok(partitions
            .iter()
            .map(|tp| {
                let low = bounds.get(tp).map_or(sluice_core::Offset::ZERO, |b| b.low);
                (tp.clone(), low)
            })
            .collect())
    }

    async fn run(
        &mut self,
        query_id: &str,
        generation: &Generation,
        starts: &PartitionOffsets,
        stop: watch::Receiver<bool>,
    ) -> Result<StoredBatches, GenerationFailed> {
        let mut settings = self.settings_over(starts.keys().cloned());
        settings.first_mut().source.starting = StartingOptions {
            starting_offsets: Some(StartingOffsets::Specific(
                starts
                    .iter()
                    .map(|(tp, offset)| (tp.clone(), SpecificOffset::At(*offset)))
                    .collect(),
            )),
            ..StartingOptions::default()
        };
        let (location, options) = self.log_of(query_id, generation);
        let store = CassandraStore::open(location.clone(), options.clone())
            .await
            .map_err(from_cassandra)?;
        self.run_with(settings, query_id, generation, store, stop, false)
            .await?;
        self.log(location, options).await
    }

    async fn settle(
        &mut self,
        query_id: &str,
        generation: &Generation,
    ) -> Result<StoredBatches, GenerationFailed> {
        let (location, options) = self.log_of(query_id, generation);
        // The claim fences the generation, should it still run.
        let mut store = CassandraStore::open(location.clone(), options.clone())
            .await
            .map_err(from_cassandra)?;
        let stored = store.load().await.map_err(from_cassandra)?;
        if let (Ok(Recovery::Replay { batch }), Some(plan)) =
            (stored.recovery(), &stored.latest_plan)
        {
            tracing::info!(
                %generation,
                batch = batch.0,
                "replaying the batch the generation planned and did not commit"
            );
            let settings =
                self.settings_over(plan.ranges().iter().map(|r| r.topic_partition.clone()));
            // Never asked to stop: a stop would cut the recovery short.
            let (_never, stop) = watch::channel(false);
            self.run_with(settings, query_id, generation, store, stop, true)
                .await?;
        }
        self.log(location, options).await
    }

    async fn remove(
        &mut self,
        query_id: &str,
        generation: &Generation,
    ) -> Result<(), GenerationFailed> {
        if let SinkKind::Kafka(sink) = &self.settings.sink {
            KafkaSink::forget_generation(sink, query_id, generation.as_str())
                .await
                .map_err(from_kafka)?;
        }
        let (location, options) = self.log_of(query_id, generation);
        CassandraStore::open(location, options)
            .await
            .map_err(from_cassandra)?
            .remove()
            .await
            .map_err(from_cassandra)
    }

    fn is_transient(error: &GenerationFailed) -> bool {
        error.transient
    }
}
