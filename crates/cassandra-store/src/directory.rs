//! The directory of a query in group mode (`docs/scale-out.md`): one Cassandra
//! partition per query with a row per Kafka partition, naming the generation
//! that holds it and where it starts, so that every change of holder is one
//! lightweight transaction conditional on the row as last read.

use scylla::client::session::Session;
use scylla::statement::Consistency as DriverConsistency;
use scylla::statement::prepared::PreparedStatement;
use scylla::value::{CqlValue, Row};
use sluice_core::{
    Directory, DirectoryEntry, Generation, Offset, Origin, PartitionDirectory, PartitionOffsets,
    TopicPartition, offsets_from_json, offsets_to_json,
};

use crate::error::query_error;
use crate::store::{CassandraOptions, ensure_schema, exists};
use crate::{CassandraLocation, CassandraStoreError, SerialConsistency};

/// The table of the directories of queries in group mode.
pub const PARTITIONS_TABLE: &str = "sluice_partitions";

/// The directory of one query, in `sluice_partitions`.
pub struct CassandraDirectory {
    session: Session,
    location: CassandraLocation,
    read: PreparedStatement,
    originate: PreparedStatement,
    take_new: PreparedStatement,
    take_released: PreparedStatement,
    take_held: PreparedStatement,
    hand_back: PreparedStatement,
    move_released: PreparedStatement,
}

/// One row as read: topic, partition, owner, start, query id, initial offsets.
type DirectoryRow = (
    Option<String>,
    Option<i32>,
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
);

impl CassandraDirectory {
    /// Connects, checks or creates the schema (the generations' logs are
    /// `sluice_log` queries, so that table too) and prepares the statements.
    pub async fn open(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<CassandraDirectory, CassandraStoreError> {
        let session = options.session(&location).await?;
        ensure_schema(&session, &location, &options).await?;
        let ks = &location.keyspace;
        if options.create_schema {
            session
                .query_unpaged(
                    format!(
                        "CREATE TABLE IF NOT EXISTS {ks}.{PARTITIONS_TABLE} (query text, topic text, \
                         partition int, owner text, start_offset bigint, query_id text static, \
                         initial_offsets text static, PRIMARY KEY (query, topic, partition))"
                    ),
                    (),
                )
                .await
                .map_err(query_error(format!(
                    "creating table {ks}.{PARTITIONS_TABLE}"
                )))?;
        } else if !exists(
            &session,
            format!("looking for table {ks}.{PARTITIONS_TABLE}"),
            "SELECT table_name FROM system_schema.tables WHERE keyspace_name = ? AND table_name = ?",
            vec![ks.clone(), PARTITIONS_TABLE.to_owned()],
        )
        .await?
        {
            return Err(CassandraStoreError::MissingTable {
                table: format!("{ks}.{PARTITIONS_TABLE}"),
            });
        }

        let prepare = |cql: String| options.prepare(&session, cql);
        let mut read = prepare(format!(
            "SELECT topic, partition, owner, start_offset, query_id, initial_offsets FROM \
             {ks}.{PARTITIONS_TABLE} WHERE query = ?"
        ))
        .await?;
        // A member decides from what it read: it must see every completed
        // conditional write.
        read.set_consistency(match options.serial_consistency {
            SerialConsistency::Serial => DriverConsistency::Serial,
            SerialConsistency::LocalSerial => DriverConsistency::LocalSerial,
        });
        let originate = prepare(format!(
            "UPDATE {ks}.{PARTITIONS_TABLE} SET query_id = ?, initial_offsets = ? WHERE query = ? \
             IF query_id = null"
        ))
        .await?;
        let take_new = prepare(format!(
            "INSERT INTO {ks}.{PARTITIONS_TABLE} (query, topic, partition, owner, start_offset) \
             VALUES (?, ?, ?, ?, ?) IF NOT EXISTS"
        ))
        .await?;
        let take_released = prepare(format!(
            "UPDATE {ks}.{PARTITIONS_TABLE} SET owner = ?, start_offset = ? WHERE query = ? AND \
             topic = ? AND partition = ? IF owner = null AND start_offset = ?"
        ))
        .await?;
        let take_held = prepare(format!(
            "UPDATE {ks}.{PARTITIONS_TABLE} SET owner = ?, start_offset = ? WHERE query = ? AND \
             topic = ? AND partition = ? IF owner = ? AND start_offset = ?"
        ))
        .await?;
        let hand_back = prepare(format!(
            "UPDATE {ks}.{PARTITIONS_TABLE} SET owner = null, start_offset = ? WHERE query = ? AND \
             topic = ? AND partition = ? IF owner = ?"
        ))
        .await?;
        let move_released = prepare(format!(
            "UPDATE {ks}.{PARTITIONS_TABLE} SET start_offset = ? WHERE query = ? AND topic = ? AND \
             partition = ? IF owner = null AND start_offset = ?"
        ))
        .await?;
        Ok(CassandraDirectory {
            session,
            location,
            read,
            originate,
            take_new,
            take_released,
            take_held,
            hand_back,
            move_released,
        })
    }

    /// The directory of a query as it is now, read without creating any
    /// schema; `None` when the query never ran in group mode.
    pub async fn inspect(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<Option<Directory>, CassandraStoreError> {
        let options = CassandraOptions {
            create_schema: false,
            replication: None,
            ..options
        };
        let directory = CassandraDirectory::open(location, options)
            .await?
            .read()
            .await?;
        Ok(directory.origin.is_some().then_some(directory))
    }

    /// Makes the next holder of `partition` start at `to`, for an operator
    /// moving a stopped query. Only a partition nobody holds moves: `expected`
    /// is its row as read, `None` for a partition never held. False when the
    /// row changed since it was read (a member started).
    pub async fn move_released(
        &mut self,
        partition: &TopicPartition,
        expected: Option<&DirectoryEntry>,
        to: Offset,
    ) -> Result<bool, CassandraStoreError> {
        let what = format!("moving {} to offset {to}", self.entry(partition));
        let (query, topic, number) = (&self.location.query, &partition.topic, partition.partition);
        let result = match expected {
            None => {
                self.session
                    .execute_unpaged(
                        &self.take_new,
                        (query, topic, number, None::<&str>, to.value()),
                    )
                    .await
            }
            Some(DirectoryEntry {
                owner: None,
                start: was,
            }) => {
                self.session
                    .execute_unpaged(
                        &self.move_released,
                        (to.value(), query, topic, number, was.value()),
                    )
                    .await
            }
            Some(DirectoryEntry { owner: Some(_), .. }) => return Ok(false),
        }
        .map_err(query_error(what.clone()))?;
        was_applied(result, &what)
    }

    fn entry(&self, partition: &TopicPartition) -> String {
        format!(
            "{}.{PARTITIONS_TABLE} query={} topic={} partition={}",
            self.location.keyspace, self.location.query, partition.topic, partition.partition
        )
    }

    fn damaged(&self, entry: String, problem: impl Into<String>) -> CassandraStoreError {
        CassandraStoreError::Damaged {
            entry,
            problem: problem.into(),
        }
    }
}

/// Whether a conditional write applied.
fn was_applied(
    result: scylla::response::query_result::QueryResult,
    what: &str,
) -> Result<bool, CassandraStoreError> {
    let rows = result
        .into_rows_result()
        .map_err(query_error(format!("reading the result of {what}")))?;
    let row = rows
        .maybe_first_row::<Row>()
        .map_err(query_error(format!("reading the result of {what}")))?;
    Ok(row.is_some_and(|row| matches!(row.columns.first(), Some(Some(CqlValue::Boolean(true))))))
}

impl PartitionDirectory for CassandraDirectory {
    type Error = CassandraStoreError;

    async fn read(&mut self) -> Result<Directory, CassandraStoreError> {
        let what = || format!("reading the directory of query {}", self.location.query);
        let result = self
            .session
            .execute_unpaged(&self.read, (&self.location.query,))
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut directory = Directory::default();
        for row in result.rows::<DirectoryRow>().map_err(query_error(what()))? {
            let (topic, partition, owner, start, query_id, initial) =
                row.map_err(query_error(what()))?;
            if directory.origin.is_none()
                && let (Some(query_id), Some(initial)) = (query_id, initial)
            {
                let initial = offsets_from_json(&initial).map_err(|e| {
                    self.damaged(
                        format!(
                            "{}.{PARTITIONS_TABLE} query={}",
                            self.location.keyspace, self.location.query
                        ),
                        format!("initial_offsets: {e}"),
                    )
                })?;
                directory.origin = Some(Origin { query_id, initial });
            }
            // The static columns alone come back as a row without a partition.
            let (Some(topic), Some(partition)) = (topic, partition) else {
                continue;
            };
            let tp = TopicPartition::new(topic, partition);
            let start = start
                .and_then(Offset::new)
                .ok_or_else(|| self.damaged(self.entry(&tp), "start_offset is null or negative"))?;
            directory.entries.insert(
                tp,
                DirectoryEntry {
                    owner: owner.map(Generation::from_name),
                    start,
                },
            );
        }
        Ok(directory)
    }

    async fn originate(&mut self, origin: &Origin) -> Result<Origin, CassandraStoreError> {
        let what = format!("recording the origin of query {}", self.location.query);
        let initial = offsets_to_json(&origin.initial);
        let result = self
            .session
            .execute_unpaged(
                &self.originate,
                (&origin.query_id, &initial, &self.location.query),
            )
            .await
            .map_err(query_error(what.clone()))?;
        if was_applied(result, &what)? {
            return Ok(origin.clone());
        }
        // Another member was first: use what it recorded.
        self.read()
            .await?
            .origin
            .ok_or_else(|| CassandraStoreError::Damaged {
                entry: format!(
                    "{}.{PARTITIONS_TABLE} query={}",
                    self.location.keyspace, self.location.query
                ),
                problem: "query_id is set but initial_offsets is not".to_owned(),
            })
    }

    async fn take(
        &mut self,
        partition: &TopicPartition,
        expected: Option<&DirectoryEntry>,
        generation: &Generation,
        start: Offset,
    ) -> Result<bool, CassandraStoreError> {
        let what = format!(
            "taking {} for generation {generation}",
            self.entry(partition)
        );
        let (query, topic, number) = (&self.location.query, &partition.topic, partition.partition);
        let result = match expected {
            None => {
                self.session
                    .execute_unpaged(
                        &self.take_new,
                        (query, topic, number, generation.as_str(), start.value()),
                    )
                    .await
            }
            Some(DirectoryEntry {
                owner: None,
                start: was,
            }) => {
                self.session
                    .execute_unpaged(
                        &self.take_released,
                        (
                            generation.as_str(),
                            start.value(),
                            query,
                            topic,
                            number,
                            was.value(),
                        ),
                    )
                    .await
            }
            Some(DirectoryEntry {
                owner: Some(owner),
                start: was,
            }) => {
                self.session
                    .execute_unpaged(
                        &self.take_held,
                        (
                            generation.as_str(),
                            start.value(),
                            query,
                            topic,
                            number,
                            owner.as_str(),
                            was.value(),
                        ),
                    )
                    .await
            }
        }
        .map_err(query_error(what.clone()))?;
        was_applied(result, &what)
    }

    async fn hand_back(
        &mut self,
        generation: &Generation,
        ends: &PartitionOffsets,
    ) -> Result<(), CassandraStoreError> {
        for (partition, end) in ends {
            let what = format!("handing back {}", self.entry(partition));
            let result = self
                .session
                .execute_unpaged(
                    &self.hand_back,
                    (
                        end.value(),
                        &self.location.query,
                        &partition.topic,
                        partition.partition,
                        generation.as_str(),
                    ),
                )
                .await
                .map_err(query_error(what.clone()))?;
            if !was_applied(result, &what)? {
                // Taken by a member that found this generation gone: its log
                // settles that partition, not this hand-back.
                tracing::warn!(
                    %generation,
                    topic = %partition.topic,
                    partition = partition.partition,
                    "a partition this generation held was taken over before it was handed back"
                );
            }
        }
        Ok(())
    }

    fn is_transient(error: &CassandraStoreError) -> bool {
        error.is_transient()
    }
}
