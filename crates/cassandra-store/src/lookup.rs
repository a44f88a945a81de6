//! A table's rows read by their partition key, for lookup tables: each key one
//! `SELECT JSON` of the columns asked for, up to a bound in flight, decoded
//! into Arrow by the table's declared schema.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use scylla::client::session::Session;
use scylla::statement::prepared::PreparedStatement;
use scylla::value::CqlValue;
use tokio::task::JoinSet;

use crate::error::query_error;
use crate::{CassandraStoreError, Connection, Consistency};

/// Reads rows of one table by partition key, as JSON objects.
pub struct KeyReader {
    session: Arc<Session>,
    select: PreparedStatement,
    table: String,
    partition_key: Vec<String>,
}

impl std::fmt::Debug for KeyReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyReader")
            .field("table", &self.table)
            .field("partition_key", &self.partition_key)
            .finish_non_exhaustive()
    }
}

impl KeyReader {
    /// Connects and prepares the read of `columns` of `keyspace.table` by its
    /// partition key; every column must exist.
    pub async fn open(
        connection: &Connection,
        keyspace: &str,
        table: &str,
        columns: &[String],
    ) -> Result<KeyReader, CassandraStoreError> {
        let session = connection.session().await?;
        let name = format!("{keyspace}.{table}");
        let what = || format!("reading the columns of {name}");
        let rows = session
            .query_unpaged(
                "SELECT column_name, kind, position FROM system_schema.columns \
                 WHERE keyspace_name = ? AND table_name = ?",
                (keyspace, table),
            )
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut all = Vec::new();
        let mut partition_key = Vec::new();
        for row in rows
            .rows::<(String, String, i32)>()
            .map_err(query_error(what()))?
        {
            let (column, kind, position) = row.map_err(query_error(what()))?;
            if kind == "partition_key" {
                partition_key.push((position, column.clone()));
            }
            all.push(column);
        }
        if all.is_empty() {
            return Err(CassandraStoreError::MissingTable { table: name });
        }
        partition_key.sort();
        let partition_key: Vec<String> = partition_key.into_iter().map(|(_, c)| c).collect();
        if let Some(missing) = columns.iter().find(|c| !all.contains(c)) {
            return Err(CassandraStoreError::Location {
                location: format!("lookup table {name}"),
                problem: format!(
                    "it has no column {missing}; its columns are {}",
                    all.join(", ")
                ),
            });
        }
        let quoted = |c: &String| format!("\"{}\"", c.replace('"', "\"\""));
        let condition = partition_key
            .iter()
            .map(|c| format!("{} = ?", quoted(c)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let selected = columns.iter().map(quoted).collect::<Vec<_>>().join(", ");
        let mut select = session
            .prepare(format!(
                "SELECT JSON {selected} FROM {name} WHERE {condition}"
            ))
            .await
            .map_err(query_error(format!("preparing the read of {name} by key")))?;
        select.set_consistency(Consistency::LocalQuorum.driver());
        Ok(KeyReader {
            session: Arc::new(session),
            select,
            table: name,
            partition_key,
        })
    }

    /// The table's partition key columns, in their order.
    pub fn partition_key(&self) -> &[String] {
        &self.partition_key
    }

    /// The rows of the keys in `keys` (one array per partition key column, in
    /// their order), in `schema`; at most `in_flight` reads at a time, each one
    /// attempt.
    pub async fn read(
        &self,
        keys: &[ArrayRef],
        schema: &SchemaRef,
        in_flight: usize,
    ) -> Result<Vec<RecordBatch>, CassandraStoreError> {
        let rows = keys.first().map_or(0, |k| k.len());
        let mut values = Vec::with_capacity(rows);
        for row in 0..rows {
            let key = keys
                .iter()
                .zip(&self.partition_key)
                .map(|(array, column)| {
                    key_value(array.as_ref(), row).ok_or_else(|| CassandraStoreError::Location {
                        location: format!("lookup table {}", self.table),
                        problem: format!(
                            "its key column {column} is joined with a value of type {}, which \
                             Sluice does not read by: use text, bigint, int, smallint, tinyint, \
                             boolean, double or float keys",
                            array.data_type()
                        ),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            values.push(key);
        }
        let json = self.read_json(values, in_flight).await?;
        let decode = |e: arrow::error::ArrowError| CassandraStoreError::Location {
            location: format!("lookup table {}", self.table),
            problem: format!("a row does not fit the declared schema: {e}"),
        };
        let text = json.join("\n");
        let reader = arrow::json::ReaderBuilder::new(schema.clone())
            .with_batch_size(json.len().max(1))
            .build(std::io::Cursor::new(text.into_bytes()))
            .map_err(decode)?;
        reader.collect::<Result<Vec<_>, _>>().map_err(decode)
    }

    /// The rows of each key, as JSON objects.
    async fn read_json(
        &self,
        keys: Vec<Vec<CqlValue>>,
        in_flight: usize,
    ) -> Result<Vec<String>, CassandraStoreError> {
        let mut rows = Vec::with_capacity(keys.len());
        let mut reads = JoinSet::new();
        let mut keys = keys.into_iter();
        loop {
            while reads.len() < in_flight.max(1) {
                let Some(key) = keys.next() else { break };
                let session = self.session.clone();
                let select = self.select.clone();
                let table = self.table.clone();
                reads.spawn(async move {
                    let what = || format!("reading {table} by key");
                    let result = session
                        .execute_unpaged(&select, key)
                        .await
                        .map_err(query_error(what()))?
                        .into_rows_result()
                        .map_err(query_error(what()))?;
                    result
                        .rows::<(String,)>()
                        .map_err(query_error(what()))?
                        .map(|row| row.map(|(json,)| json).map_err(query_error(what())))
                        .collect::<Result<Vec<String>, _>>()
                });
            }
            let Some(done) = reads.join_next().await else {
                break;
            };
            let found = done.map_err(|e| CassandraStoreError::Query {
                what: format!("reading {} by key", self.table),
                source: Box::new(e),
            })??;
            rows.extend(found);
        }
        Ok(rows)
    }
}

/// Row `row` of a key column as the driver binds it; `None` for a type keys
/// are not read by.
fn key_value(array: &dyn Array, row: usize) -> Option<CqlValue> {
    use arrow::datatypes::{Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type};
    Some(match array.data_type() {
        DataType::Utf8 => CqlValue::Text(array.as_string::<i32>().value(row).to_owned()),
        DataType::LargeUtf8 => CqlValue::Text(array.as_string::<i64>().value(row).to_owned()),
        DataType::Utf8View => CqlValue::Text(array.as_string_view().value(row).to_owned()),
        DataType::Int64 => CqlValue::BigInt(array.as_primitive::<Int64Type>().value(row)),
        DataType::Int32 => CqlValue::Int(array.as_primitive::<Int32Type>().value(row)),
        DataType::Int16 => CqlValue::SmallInt(array.as_primitive::<Int16Type>().value(row)),
        DataType::Int8 => CqlValue::TinyInt(array.as_primitive::<Int8Type>().value(row)),
        DataType::Boolean => CqlValue::Boolean(array.as_boolean().value(row)),
        DataType::Float64 => CqlValue::Double(array.as_primitive::<Float64Type>().value(row)),
        DataType::Float32 => CqlValue::Float(array.as_primitive::<Float32Type>().value(row)),
        _ => return None,
    })
}
