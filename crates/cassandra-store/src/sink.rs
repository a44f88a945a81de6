//! The `cassandra` sink: each record becomes one upsert, its columns mapped from
//! the record by configuration; or each row of a query, its columns mapped by
//! name.
//!
//! Exactly once in effect: a batch replayed after a crash writes the same rows
//! with the same primary keys, which Cassandra upserts to the same values.

use std::collections::BTreeMap;
use std::sync::Arc;

use scylla::client::session::Session;

use scylla::statement::prepared::PreparedStatement;
use serde_json::{Map, Value};
use sluice_core::{BatchId, OffsetRange, RecordChunk, RecordRef, Sink, Writes};
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
    /// Target column → where its value comes from, for records as read.
    pub columns: BTreeMap<String, Field>,
    /// Target column → the query's output column, for rows; a column not named
    /// here takes the output column of its own name.
    pub renames: BTreeMap<String, String>,
}

/// Upserts every record, or every row of a query, into a table.
pub struct CassandraSink {
    session: Arc<Session>,
    insert: PreparedStatement,
    config: CassandraSinkConfig,
    /// For rows: per mapped table column, the output column it takes.
    rows: Vec<RowColumn>,
    /// Columns of type blob, which take key and value bytes as hex.
    blobs: Vec<String>,
    /// The primary key columns, which every record must fill.
    key_columns: Vec<String>,
    /// The batch begun last.
    batch: BatchId,
    /// Upserts of that batch not yet acknowledged.
    in_flight: JoinSet<Result<(), CassandraStoreError>>,
}

/// A table column that a query's output column fills.
#[derive(Clone, Debug)]
struct RowColumn {
    table: String,
    output: usize,
    blob: bool,
    key: bool,
}

impl CassandraSink {
    /// Connects and checks the mapping against the table: every mapped column
    /// exists, and every primary key column is mapped.
    pub async fn new(config: CassandraSinkConfig) -> Result<CassandraSink, CassandraStoreError> {
        Self::connect(config, None).await
    }

    /// Connects for the rows of a query, whose columns are `schema`'s, and
    /// checks them against the table: each output column fills the table column
    /// of its name, or the one `renames` gives it; every output column has a
    /// table column, and every primary key column an output column.
    pub async fn for_rows(
        config: CassandraSinkConfig,
        schema: &arrow::datatypes::Schema,
    ) -> Result<CassandraSink, CassandraStoreError> {
        Self::connect(config, Some(schema)).await
    }

    async fn connect(
        config: CassandraSinkConfig,
        rows_schema: Option<&arrow::datatypes::Schema>,
    ) -> Result<CassandraSink, CassandraStoreError> {
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
        let mut rows = Vec::new();
        match rows_schema {
            None => {
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
            }
            Some(schema) => {
                rows = row_columns(&config, schema, &types, &key_columns).map_err(bad)?;
            }
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
        insert.set_consistency(crate::Consistency::LocalQuorum.driver());
        Ok(CassandraSink {
            session: Arc::new(session),
            insert,
            config,
            rows,
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

    fn is_transient(error: &CassandraStoreError) -> bool {
        error.is_transient()
    }

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

    async fn finish_batch(&mut self, _batch: BatchId) -> Result<(), CassandraStoreError> {
        while !self.in_flight.is_empty() {
            join_one(&mut self.in_flight).await?;
        }
        Ok(())
    }
}

impl Writes for CassandraSink {
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
            self.upsert(row, format!("upserting {position} of batch {batch}"))
                .await?;
        }
        Ok(())
    }
}

/// Which output column fills which table column, checked both ways.
fn row_columns(
    config: &CassandraSinkConfig,
    schema: &arrow::datatypes::Schema,
    types: &BTreeMap<String, String>,
    key_columns: &[String],
) -> Result<Vec<RowColumn>, String> {
    if let Some(column) = config.renames.keys().find(|c| !types.contains_key(*c)) {
        return Err(format!(
            "[sink.columns] names column {column}, which does not exist"
        ));
    }
    let mut columns = Vec::new();
    let mut used = vec![false; schema.fields().len()];
    for column in types.keys() {
        let output = config.renames.get(column).unwrap_or(column);
        match schema.index_of(output) {
            Ok(i) => {
                used[i] = true;
                columns.push(RowColumn {
                    table: column.clone(),
                    output: i,
                    blob: types[column] == "blob",
                    key: key_columns.contains(column),
                });
            }
            Err(_) if config.renames.contains_key(column) => {
                return Err(format!(
                    "[sink.columns] fills column {column} from {output}, which the query does not output"
                ));
            }
            Err(_) if key_columns.contains(column) => {
                return Err(format!(
                    "primary key column {column} has no output column of its name; select it \
                     (AS {column}) or map it in [sink.columns]"
                ));
            }
            Err(_) => {}
        }
    }
    if let Some((i, _)) = used.iter().enumerate().find(|(_, used)| !**used) {
        return Err(format!(
            "the query outputs column {}, which the table does not have; leave it out of the \
             SELECT, or map a table column to it in [sink.columns]",
            schema.field(i).name()
        ));
    }
    Ok(columns)
}

impl CassandraSink {
    /// One JSON object per row of `rows`, as `INSERT ... JSON` takes it: blobs
    /// as `0x...`, timestamps as epoch milliseconds, nulls left out so that
    /// they write no tombstone.
    fn row_json(&self, rows: &arrow::array::RecordBatch) -> Result<Vec<String>, String> {
        use arrow::array::{Array, ArrayRef, AsArray, StringArray};
        use arrow::datatypes::{DataType, Field as ArrowField, Schema, TimeUnit};
        let mut fields = Vec::with_capacity(self.rows.len());
        let mut arrays: Vec<ArrayRef> = Vec::with_capacity(self.rows.len());
        for column in &self.rows {
            let array = rows.column(column.output);
            if column.key && array.null_count() > 0 {
                return Err(format!(
                    "primary key column {} is null in a row",
                    column.table
                ));
            }
            let (data_type, array): (DataType, ArrayRef) = match array.data_type() {
                DataType::Binary | DataType::LargeBinary => {
                    let values: Vec<Option<String>> = (0..array.len())
                        .map(|i| {
                            if array.is_null(i) {
                                return None;
                            }
                            let bytes = match array.data_type() {
                                DataType::Binary => array.as_binary::<i32>().value(i),
                                _ => array.as_binary::<i64>().value(i),
                            };
                            Some(if column.blob {
                                format!("0x{}", hex(bytes))
                            } else {
                                String::from_utf8_lossy(bytes).into_owned()
                            })
                        })
                        .collect();
                    (DataType::Utf8, Arc::new(StringArray::from(values)))
                }
                DataType::Timestamp(_, _) => {
                    let millis = arrow::compute::cast(
                        array,
                        &DataType::Timestamp(TimeUnit::Millisecond, None),
                    )
                    .and_then(|a| arrow::compute::cast(&a, &DataType::Int64))
                    .map_err(|e| e.to_string())?;
                    (DataType::Int64, millis)
                }
                other => (other.clone(), array.clone()),
            };
            fields.push(ArrowField::new(&column.table, data_type, true));
            arrays.push(array);
        }
        let batch = arrow::array::RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays)
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        let mut writer = arrow::json::LineDelimitedWriter::new(&mut out);
        writer.write(&batch).map_err(|e| e.to_string())?;
        writer.finish().map_err(|e| e.to_string())?;
        String::from_utf8(out)
            .map(|text| text.lines().map(str::to_owned).collect())
            .map_err(|e| e.to_string())
    }

    /// Sends one upsert, waiting for the oldest when enough are in flight.
    async fn upsert(&mut self, row: String, what: String) -> Result<(), CassandraStoreError> {
        if self.in_flight.len() >= CONCURRENCY {
            join_one(&mut self.in_flight).await?;
        }
        let (session, insert) = (self.session.clone(), self.insert.clone());
        self.in_flight.spawn(async move {
            session
                .execute_unpaged(&insert, (row,))
                .await
                .map(|_| ())
                .map_err(query_error(what))
        });
        Ok(())
    }
}

impl Writes<arrow::array::RecordBatch> for CassandraSink {
    async fn write(&mut self, rows: &arrow::array::RecordBatch) -> Result<(), CassandraStoreError> {
        let table = format!("{}.{}", self.config.keyspace, self.config.table);
        let batch = self.batch;
        let lines = self
            .row_json(rows)
            .map_err(|problem| CassandraStoreError::Damaged {
                entry: format!("rows of batch {batch} for {table}"),
                problem,
            })?;
        for line in lines {
            self.upsert(
                line,
                format!("upserting a row of batch {batch} into {table}"),
            )
            .await?;
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
