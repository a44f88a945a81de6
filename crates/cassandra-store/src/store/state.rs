//! The state files of a query's stateful operators in `sluice_state`: one row
//! per file, in a Cassandra partition per operator and state partition, each
//! write conditional on the runner's claim as the offset log's writes are.

use sluice_core::{StateFile, StateFileId, StateFileKind, StateStore};

use super::*;

impl CassandraStore {
    /// The state files of `operator` of a query and their sizes in bytes, read
    /// without claiming the query.
    pub async fn inspect_state(
        location: CassandraLocation,
        options: CassandraOptions,
        operator: u32,
    ) -> Result<Vec<(StateFileId, u64)>, CassandraStoreError> {
        let inspect_options = CassandraOptions {
            create_schema: false,
            replication: None,
            ..options
        };
        let mut store = CassandraStore::connect(location, inspect_options).await?;
        let files = store.list_state(operator).await?;
        let mut sized = Vec::new();
        for id in files {
            let file = store.read_state(operator, id).await?;
            sized.push((id, file.bytes.len() as u64));
        }
        Ok(sized)
    }

    /// The complete state files of one state partition of `operator`; `None`
    /// when it has no rows at all.
    async fn list_state_partition(
        &self,
        operator: u32,
        partition: u32,
    ) -> Result<Option<Vec<StateFileId>>, CassandraStoreError> {
        let ks = &self.location.keyspace;
        let what = || format!("listing the state of operator {operator}, partition {partition}");
        let rows = self
            .session
            .query_unpaged(
                format!(
                    "SELECT version, kind, chunk FROM {ks}.{STATE_TABLE} WHERE query = ? AND \
                     operator = ? AND partition = ?"
                ),
                (&self.location.query, operator as i32, partition as i32),
            )
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut files = Vec::new();
        let mut rows_seen = false;
        for row in rows
            .rows::<(i64, String, i32)>()
            .map_err(query_error(what()))?
        {
            let (version, kind, chunk) = row.map_err(query_error(what()))?;
            rows_seen = true;
            if chunk != STATE_COMPLETE {
                continue;
            }
            if let (Ok(version), Some(kind)) =
                (u64::try_from(version), StateFileKind::from_extension(&kind))
            {
                files.push(StateFileId {
                    partition,
                    version: BatchId(version),
                    kind,
                });
            }
        }
        Ok(rows_seen.then_some(files))
    }
}

impl StateStore for CassandraStore {
    type Error = CassandraStoreError;

    async fn write_state(&mut self, file: &StateFile) -> Result<(), CassandraStoreError> {
        // State rows are not conditional on the epoch (they are in a partition of
        // their own), so the claim is checked first: a fenced runner writes no state.
        if let Some((_, epoch, owner)) = self.read_claim().await? {
            self.fenced_if_moved(epoch, &owner)?;
        }
        let ks = &self.location.keyspace;
        let version = i64::try_from(file.version.0).unwrap_or(i64::MAX);
        let kind = file.kind.extension();
        let entry = self.describe_state(file.operator, file.id());
        let key = (
            &self.location.query,
            file.operator as i32,
            file.partition as i32,
            version,
            kind,
        );
        let complete = self
            .session
            .query_unpaged(
                format!(
                    "SELECT chunk FROM {ks}.{STATE_TABLE} WHERE query = ? AND operator = ? AND \
                     partition = ? AND version = ? AND kind = ? AND chunk = {STATE_COMPLETE}"
                ),
                key,
            )
            .await
            .map_err(query_error(format!("looking for {entry}")))?
            .into_rows_result()
            .map_err(query_error(format!("looking for {entry}")))?
            .rows_num()
            > 0;
        if complete {
            // A replayed batch: its state is stored already, and stays as it is.
            return Ok(());
        }
        let chunks: Vec<&[u8]> = if file.bytes.is_empty() {
            Vec::new()
        } else {
            file.bytes.chunks(STATE_CHUNK_BYTES).collect()
        };
        let insert = format!(
            "INSERT INTO {ks}.{STATE_TABLE} (query, operator, partition, version, kind, chunk, \
             bytes, epoch) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        );
        for (i, chunk) in chunks.iter().enumerate() {
            self.session
                .query_unpaged(
                    insert.clone(),
                    (
                        key.0,
                        key.1,
                        key.2,
                        key.3,
                        key.4,
                        i as i32,
                        chunk.to_vec(),
                        self.epoch,
                    ),
                )
                .await
                .map_err(query_error(format!("writing {entry}")))?;
        }
        let count = i32::try_from(chunks.len())
            .unwrap_or(i32::MAX)
            .to_be_bytes();
        self.session
            .query_unpaged(
                insert,
                (
                    key.0,
                    key.1,
                    key.2,
                    key.3,
                    key.4,
                    STATE_COMPLETE,
                    count.to_vec(),
                    self.epoch,
                ),
            )
            .await
            .map_err(query_error(format!("writing {entry}")))?;
        Ok(())
    }

    async fn list_state(&mut self, operator: u32) -> Result<Vec<StateFileId>, CassandraStoreError> {
        // Every batch writes every partition, so the partitions in use are 0, 1,
        // ... up to the first empty one; listing them one by one keeps to
        // single-partition reads.
        let mut files = Vec::new();
        for partition in 0.. {
            match self.list_state_partition(operator, partition).await? {
                Some(found) => files.extend(found),
                None => break,
            }
        }
        files.sort_unstable();
        Ok(files)
    }

    async fn read_state(
        &mut self,
        operator: u32,
        file: StateFileId,
    ) -> Result<StateFile, CassandraStoreError> {
        let ks = &self.location.keyspace;
        let entry = self.describe_state(operator, file);
        let what = || format!("reading {entry}");
        let rows = self
            .session
            .query_unpaged(
                format!(
                    "SELECT chunk, bytes FROM {ks}.{STATE_TABLE} WHERE query = ? AND operator = ? \
                     AND partition = ? AND version = ? AND kind = ?"
                ),
                (
                    &self.location.query,
                    operator as i32,
                    file.partition as i32,
                    i64::try_from(file.version.0).unwrap_or(i64::MAX),
                    file.kind.extension(),
                ),
            )
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut count = None;
        let mut chunks = std::collections::BTreeMap::new();
        for row in rows
            .rows::<(i32, Option<Vec<u8>>)>()
            .map_err(query_error(what()))?
        {
            let (chunk, bytes) = row.map_err(query_error(what()))?;
            let bytes = bytes.unwrap_or_default();
            if chunk == STATE_COMPLETE {
                count = <[u8; 4]>::try_from(bytes.as_slice())
                    .ok()
                    .map(i32::from_be_bytes);
            } else {
                chunks.insert(chunk, bytes);
            }
        }
        let damaged = |problem: String| CassandraStoreError::Damaged {
            entry: entry.clone(),
            problem,
        };
        let count =
            count.ok_or_else(|| damaged("missing, or cut short while written".to_owned()))?;
        if chunks.len() != usize::try_from(count).unwrap_or(usize::MAX)
            || chunks.keys().enumerate().any(|(i, c)| *c != i as i32)
        {
            return Err(damaged(format!(
                "holds {} of its {count} chunks",
                chunks.len()
            )));
        }
        Ok(StateFile {
            operator,
            partition: file.partition,
            version: file.version,
            kind: file.kind,
            bytes: chunks.into_values().flatten().collect(),
            location: entry.clone(),
        })
    }

    async fn remove_state(
        &mut self,
        operator: u32,
        files: &[StateFileId],
    ) -> Result<(), CassandraStoreError> {
        let ks = &self.location.keyspace;
        for file in files {
            self.session
                .query_unpaged(
                    format!(
                        "DELETE FROM {ks}.{STATE_TABLE} WHERE query = ? AND operator = ? AND \
                         partition = ? AND version = ? AND kind = ?"
                    ),
                    (
                        &self.location.query,
                        operator as i32,
                        file.partition as i32,
                        i64::try_from(file.version.0).unwrap_or(i64::MAX),
                        file.kind.extension(),
                    ),
                )
                .await
                .map_err(query_error(format!(
                    "removing {}",
                    self.describe_state(operator, *file)
                )))?;
        }
        Ok(())
    }

    fn describe_state(&self, operator: u32, file: StateFileId) -> String {
        format!(
            "{}.{STATE_TABLE} query={} operator={operator} partition={} version={} kind={}",
            self.location.keyspace,
            self.location.query,
            file.partition,
            file.version,
            file.kind.extension()
        )
    }

    fn is_transient(error: &CassandraStoreError) -> bool {
        error.is_transient()
    }
}
