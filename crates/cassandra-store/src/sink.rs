//! The `cassandra` sink: each record becomes one upsert, its columns mapped from
//! the record by configuration.
//!
//! Exactly once in effect: a batch replayed after a crash writes the same rows
//! with the same primary keys, which Cassandra upserts to the same values.

use std::collections::BTreeMap;
use std::sync::Arc;

use scylla::client::session::Session;
use scylla::statement::Consistency;
use scylla::statement::prepared::PreparedStatement;
use serde_json::{Map, Value};
use sluice_offsets::{BatchId, OffsetRange, RecordChunk, RecordRef, Sink};
use tokio::task::JoinSet;

use crate::CassandraStoreError;
use crate::error::query_error;

/// Upserts in flight at once.
const CONCURRENCY: usize = 64;

/// Where a column's value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Field {
    /// The record's topic.
    Topic,
    /// Its partition.
    Partition,
    /// Its offset.
    Offset,
    /// Its timestamp, in epoch milliseconds.
    Timestamp,
    /// Its key, as text (or hex for a blob column).
    Key,
    /// Its value, as text (or hex for a blob column).
    Value,
    /// A field of the value parsed as JSON, by path (`value.order.id`).
    ValueField(Vec<String>),
}

impl Field {
    /// Reads `topic`, `partition`, `offset`, `timestamp`, `key`, `value` or
    /// `value.<path>`.
    pub fn parse(text: &str) -> Option<Field> {
        Some(match text {
            "topic" => Field::Topic,
            "partition" => Field::Partition,
            "offset" => Field::Offset,
            "timestamp" => Field::Timestamp,
            "key" => Field::Key,
            "value" => Field::Value,
            other => {
                let path = other.strip_prefix("value.")?;
                if path.is_empty() || path.split('.').any(str::is_empty) {
                    return None;
                }
                Field::ValueField(path.split('.').map(str::to_owned).collect())
            }
        })
    }
}

/// Where the `cassandra` sink writes, and how records map to columns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CassandraSinkConfig {
    /// How to reach the cluster.
    pub connection: crate::Connection,
    /// The keyspace.
    pub keyspace: String,
    /// The table, whose primary key the user chose.
    pub table: String,
    /// Target column → where its value comes from.
    pub columns: BTreeMap<String, Field>,
}

/// Upserts every record into a table.
pub struct CassandraSink {
    session: Arc<Session>,
    insert: PreparedStatement,
    config: CassandraSinkConfig,
    /// Columns of type blob, which take key and value bytes as hex.
    blobs: Vec<String>,
    /// The primary key columns, which every record must fill.
    key_columns: Vec<String>,
    /// The batch begun last.
    batch: BatchId,
    /// Upserts of that batch not yet acknowledged.
    in_flight: JoinSet<Result<(), CassandraStoreError>>,
}

impl CassandraSink {
    /// Connects and checks the mapping against the table: every mapped column
    /// exists, and every primary key column is mapped.
    pub async fn new(config: CassandraSinkConfig) -> Result<CassandraSink, CassandraStoreError> {
        let session = config.connection.session().await?;
        let table = format!("{}.{}", config.keyspace, config.table);
        let what = || format!("reading the columns of {table}");
        let rows = session
            .query_unpaged(
                "SELECT column_name, kind, type FROM system_schema.columns WHERE keyspace_name = ? AND table_name = ?",
                (&config.keyspace, &config.table),
            )
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut types = BTreeMap::new();
        let mut key_columns = Vec::new();
        for row in rows
            .rows::<(String, String, String)>()
            .map_err(query_error(what()))?
        {
            let (name, kind, kind_of_type) = row.map_err(query_error(what()))?;
            if kind == "partition_key" || kind == "clustering" {
                key_columns.push(name.clone());
            }
            types.insert(name, kind_of_type);
        }
        if types.is_empty() {
            return Err(CassandraStoreError::MissingTable { table });
        }
        let bad = |problem: String| CassandraStoreError::Location {
            location: format!("sink table {table}"),
            problem,
        };
        if let Some(column) = config.columns.keys().find(|c| !types.contains_key(*c)) {
            return Err(bad(format!("column {column} does not exist")));
        }
        if let Some(column) = key_columns
            .iter()
            .find(|c| !config.columns.contains_key(*c))
        {
            return Err(bad(format!(
                "primary key column {column} is not mapped; map every primary key column"
            )));
        }
        let blobs = types
            .iter()
            .filter(|(_, t)| t.as_str() == "blob")
            .map(|(c, _)| c.clone())
            .collect();
        let mut insert = session
            .prepare(format!("INSERT INTO {table} JSON ? DEFAULT UNSET"))
            .await
            .map_err(query_error(format!("preparing the insert into {table}")))?;
        insert.set_consistency(Consistency::LocalQuorum);
        Ok(CassandraSink {
            session: Arc::new(session),
            insert,
            config,
            blobs,
            key_columns,
            batch: BatchId::FIRST,
            in_flight: JoinSet::new(),
        })
    }

    /// The row of one record, as the JSON Cassandra's `INSERT ... JSON` takes.
    fn row(&self, record: RecordRef<'_>) -> Result<String, String> {
        let mut row = Map::new();
        let mut parsed: Option<Option<Value>> = None;
        for (column, field) in &self.config.columns {
            let blob = self.blobs.contains(column);
            let bytes = |b: Option<&[u8]>| match b {
                None => Value::Null,
                Some(b) if blob => Value::from(format!("0x{}", hex(b))),
                Some(b) => Value::from(String::from_utf8_lossy(b).into_owned()),
            };
            let value = match field {
                Field::Topic => Value::from(record.topic()),
                Field::Partition => Value::from(record.partition()),
                Field::Offset => Value::from(record.offset().value()),
                Field::Timestamp => record.timestamp_ms().map_or(Value::Null, Value::from),
                Field::Key => bytes(record.key()),
                Field::Value => bytes(record.value()),
                Field::ValueField(path) => {
                    let document = parsed.get_or_insert_with(|| {
                        record
                            .value()
                            .and_then(|v| serde_json::from_slice::<Value>(v).ok())
                    });
                    path.iter()
                        .try_fold(document.as_ref(), |v, step| {
                            v.and_then(|v| v.get(step)).map(Some)
                        })
                        .flatten()
                        .cloned()
                        .unwrap_or(Value::Null)
                }
            };
            if value.is_null() {
                if self.key_columns.contains(column) {
                    return Err(format!(
                        "primary key column {column} has no value ({field:?})"
                    ));
                }
                // Left unset, so that a missing field does not write a tombstone.
                continue;
            }
            row.insert(column.clone(), value);
        }
        Ok(Value::Object(row).to_string())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Sink for CassandraSink {
    type Error = CassandraStoreError;

    async fn begin_batch(
        &mut self,
        batch: BatchId,
        _ranges: &[OffsetRange],
    ) -> Result<(), CassandraStoreError> {
        // Upserts are idempotent, so a batch begun again needs no clean-up; what an
        // abandoned attempt still has in flight is not waited for.
        self.in_flight.abort_all();
        self.in_flight = JoinSet::new();
        self.batch = batch;
        Ok(())
    }

    async fn write(&mut self, records: &RecordChunk) -> Result<(), CassandraStoreError> {
        let table = format!("{}.{}", self.config.keyspace, self.config.table);
        let batch = self.batch;
        for record in records {
            let position = format!(
                "{}-{}@{}",
                record.topic(),
                record.partition(),
                record.offset()
            );
            let row = self
                .row(record)
                .map_err(|problem| CassandraStoreError::Damaged {
                    entry: format!("record {position} for {table}"),
                    problem,
                })?;
            if self.in_flight.len() >= CONCURRENCY {
                join_one(&mut self.in_flight).await?;
            }
            let (session, insert) = (self.session.clone(), self.insert.clone());
            self.in_flight.spawn(async move {
                session
                    .execute_unpaged(&insert, (row,))
                    .await
                    .map(|_| ())
                    .map_err(query_error(format!(
                        "upserting {position} of batch {batch}"
                    )))
            });
        }
        Ok(())
    }

    async fn finish_batch(&mut self, _batch: BatchId) -> Result<(), CassandraStoreError> {
        while !self.in_flight.is_empty() {
            join_one(&mut self.in_flight).await?;
        }
        Ok(())
    }
}

async fn join_one(
    set: &mut JoinSet<Result<(), CassandraStoreError>>,
) -> Result<(), CassandraStoreError> {
    match set.join_next().await {
        Some(Ok(result)) => result,
        Some(Err(e)) => Err(CassandraStoreError::Query {
            what: "an upsert task".to_owned(),
            source: Box::new(e),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::Field;

    #[test]
    fn parses_fields_and_value_paths() {
        assert_eq!(Field::parse("offset"), Some(Field::Offset));
        assert_eq!(
            Field::parse("value.order.id"),
            Some(Field::ValueField(vec!["order".into(), "id".into()]))
        );
        assert_eq!(Field::parse("value."), None);
        assert_eq!(Field::parse("value..x"), None);
        assert_eq!(Field::parse("headers"), None);
    }
}
