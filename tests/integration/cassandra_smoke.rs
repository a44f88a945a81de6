//! The Cassandra node answers as Sluice needs: keyspaces and tables can be
//! created, a row written with a prepared statement reads back, and the keyspace
//! can be dropped again.

use scylla::client::session::Session;
use scylla::client::session_builder::SessionBuilder;

async fn connect() -> Session {
    let nodes = sluice_tests::cassandra_nodes();
    SessionBuilder::new()
        .known_nodes(&nodes)
        .build()
        .await
        .unwrap_or_else(|e| {
            panic!("connecting to Cassandra at {nodes:?} failed: {e}; is it up (cargo xtask up)?")
        })
}

#[tokio::test]
async fn writes_and_reads_back_a_row_in_a_fresh_keyspace() {
    let session = connect().await;
    let keyspace = sluice_tests::unique_name("smoke");

    session
        .query_unpaged(
            format!(
                "CREATE KEYSPACE {keyspace} WITH replication = {}",
                sluice_tests::TEST_REPLICATION
            ),
            (),
        )
        .await
        .unwrap_or_else(|e| panic!("creating keyspace {keyspace} failed: {e}"));
    session
        .query_unpaged(
            format!(
                "CREATE TABLE {keyspace}.kafka_offsets \
                 (topic text, partition int, offset bigint, PRIMARY KEY (topic, partition))"
            ),
            (),
        )
        .await
        .unwrap_or_else(|e| panic!("creating {keyspace}.kafka_offsets failed: {e}"));

    let insert = session
        .prepare(format!(
            "INSERT INTO {keyspace}.kafka_offsets (topic, partition, offset) VALUES (?, ?, ?)"
        ))
        .await
        .expect("preparing the insert");
    session
        .execute_unpaged(&insert, ("events", 4_i32, 23_456_i64))
        .await
        .expect("inserting a row");

    let rows = session
        .query_unpaged(
            format!("SELECT topic, partition, offset FROM {keyspace}.kafka_offsets"),
            (),
        )
        .await
        .expect("selecting the rows")
        .into_rows_result()
        .expect("a result with rows");
    let read: Vec<(String, i32, i64)> = rows
        .rows::<(String, i32, i64)>()
        .expect("rows of (text, int, bigint)")
        .collect::<Result<_, _>>()
        .expect("rows that deserialize");
    assert_eq!(read, vec![("events".to_owned(), 4, 23_456)]);

    session
        .query_unpaged(format!("DROP KEYSPACE {keyspace}"), ())
        .await
        .unwrap_or_else(|e| panic!("dropping keyspace {keyspace} failed: {e}"));
    let remaining = session
        .query_unpaged(
            "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = ?",
            (keyspace.as_str(),),
        )
        .await
        .expect("reading the schema")
        .into_rows_result()
        .expect("a result with rows")
        .rows_num();
    assert_eq!(remaining, 0, "keyspace {keyspace} still exists after DROP");
}
