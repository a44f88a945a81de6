//! Lookup tables in Cassandra: the rows a batch needs, read by their partition
//! key as the batch runs.

use arrow::array::ArrayRef;
use arrow::datatypes::SchemaRef;
use sluice_cassandra_store::{CassandraStoreError, Connection, KeyReader};
use sluice_sql::{Fetch, FetchError, KeyedLoader};

/// Reads at a time when a batch reads rows by key, unless told otherwise.
pub const DEFAULT_IN_FLIGHT: usize = 64;

/// A Cassandra table read by its partition key, in a declared schema.
#[derive(Debug)]
pub struct CassandraTable {
    reader: KeyReader,
    schema: SchemaRef,
    in_flight: usize,
    describe: String,
}

impl CassandraTable {
    /// Connects, and checks that `keyspace.table` has the columns of
    /// `schema`, its partition key among them.
    pub async fn open(
        connection: &Connection,
        keyspace: &str,
        table: &str,
        schema: SchemaRef,
        in_flight: usize,
    ) -> Result<CassandraTable, CassandraStoreError> {
        let columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let reader = KeyReader::open(connection, keyspace, table, &columns).await?;
        if let Some(missing) = reader.partition_key().iter().find(|k| !columns.contains(k)) {
            return Err(CassandraStoreError::Location {
                location: format!("lookup table {keyspace}.{table}"),
                problem: format!(
                    "its partition key column {missing} is not in the schema; declare it, as the \
                     table is read by it"
                ),
            });
        }
        Ok(CassandraTable {
            reader,
            schema,
            in_flight,
            describe: format!("cassandra {keyspace}.{table}"),
        })
    }
}

impl KeyedLoader for CassandraTable {
    fn key_columns(&self) -> &[String] {
        self.reader.partition_key()
    }

    fn fetch(&self, keys: Vec<ArrayRef>) -> Fetch<'_> {
        Box::pin(async move {
            self.reader
                .read(&keys, &self.schema, self.in_flight)
                .await
                .map_err(|e| FetchError {
                    transient: e.is_transient(),
                    error: Box::new(e),
                })
        })
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}
