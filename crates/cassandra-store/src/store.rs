//! The offset store: one Cassandra partition per query holds its epoch (static
//! columns) and its plans and commits (rows), so that every write can be
//! conditional on the epoch in one lightweight transaction.

use std::time::{Duration, Instant};

use scylla::client::session::Session;
use scylla::statement::Consistency as DriverConsistency;
use scylla::statement::batch::{Batch, BatchType};
use scylla::statement::prepared::PreparedStatement;

use crate::connect::{Consistency, SerialConsistency};
use scylla::value::{CqlValue, Row};
use sluice_core::{
    BatchCommit, BatchId, BatchMetadata, BatchPlan, Log, OffsetStore, PartitionOffsets,
    StoredBatches, offsets_from_json, offsets_to_json,
};

use crate::error::query_error;
use crate::{CassandraLocation, CassandraStoreError};

// The state files, which reach into the store's session and claim.
mod state;

/// How the store talks to Cassandra. Its `Debug` hides the password.
#[derive(Clone, PartialEq, Eq)]
pub struct CassandraOptions {
    /// Create the keyspace (with this replication) when it is missing.
    pub replication: Option<String>,
    /// Create Sluice's tables when they are missing (default true).
    pub create_schema: bool,
    /// Consistency of reads and writes (default LOCAL_QUORUM).
    pub consistency: Consistency,
    /// Serial consistency of the conditional writes (default LOCAL_SERIAL).
    pub serial_consistency: SerialConsistency,
    /// Timeout of one request.
    pub request_timeout: Duration,
    /// Who this runner is, recorded with its claim (host and pid by default).
    pub owner: String,
    /// The query id a brand-new query gets (as when it is migrated here); a new
    /// random one when unset. An existing query keeps its own.
    pub query_id: Option<String>,
    /// Password authentication: the user name.
    pub username: Option<String>,
    /// Password authentication: the password.
    pub password: Option<String>,
    /// TLS, verifying the nodes against this CA certificate (PEM).
    pub tls_ca_file: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for CassandraOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CassandraOptions")
            .field("replication", &self.replication)
            .field("create_schema", &self.create_schema)
            .field("consistency", &self.consistency)
            .field("serial_consistency", &self.serial_consistency)
            .field("request_timeout", &self.request_timeout)
            .field("owner", &self.owner)
            .field("query_id", &self.query_id)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("tls_ca_file", &self.tls_ca_file)
            .finish()
    }
}

impl Default for CassandraOptions {
    fn default() -> Self {
        CassandraOptions {
            replication: None,
            create_schema: true,
            consistency: Consistency::LocalQuorum,
            serial_consistency: SerialConsistency::LocalSerial,
            request_timeout: Duration::from_secs(10),
            owner: default_owner(),
            query_id: None,
            username: None,
            password: None,
            tls_ca_file: None,
        }
    }
}

impl CassandraOptions {
    /// A session to the location's nodes with these credentials.
    pub(crate) async fn session(
        &self,
        location: &CassandraLocation,
    ) -> Result<Session, CassandraStoreError> {
        crate::Connection {
            nodes: location.nodes.clone(),
            username: self.username.clone(),
            password: self.password.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
            connect_timeout: self.request_timeout,
        }
        .session()
        .await
    }

    /// `cql` prepared with these consistencies and timeout.
    pub(crate) async fn prepare(
        &self,
        session: &Session,
        cql: String,
    ) -> Result<PreparedStatement, CassandraStoreError> {
        let mut statement = session
            .prepare(cql.clone())
            .await
            .map_err(query_error(format!("preparing {cql}")))?;
        statement.set_consistency(self.consistency.driver());
        statement.set_serial_consistency(Some(self.serial_consistency.driver()));
        statement.set_request_timeout(Some(self.request_timeout));
        Ok(statement)
    }
}

fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "unknown-host".to_owned());
    format!("pid={} host={host}", std::process::id())
}

/// The table of plans, commits and the claim.
pub const LOG_TABLE: &str = "sluice_log";
/// The latest committed offsets, one plain row per partition, for anyone to read.
pub const OFFSETS_TABLE: &str = "sluice_core";

/// How often at most the offsets table is written. It is a row per partition,
/// so writing it with every commit cost most of a batch at many partitions
/// (1,024 partitions at 10,000 offsets per trigger: 11 ms of a 23 ms batch);
/// the people and lag monitors that read it are served by once a second.
const OFFSETS_TABLE_INTERVAL: Duration = Duration::from_secs(1);

/// Stateful operators' state: one Cassandra partition per query, operator and
/// state partition (a range of the operator's key hashes), a version per batch,
/// in chunks.
pub const STATE_TABLE: &str = "sluice_state";

/// The largest piece of a state file in one row, well under Cassandra's
/// default largest mutation (half of `commitlog_segment_size`, 16 MiB).
const STATE_CHUNK_BYTES: usize = 1 << 20;

/// The chunk number of the row that says a state file is complete, written
/// after its chunks: a file cut short by a crash has chunks but no marker.
const STATE_COMPLETE: i32 = -1;

/// A query's log as read without claiming it.
#[derive(Clone, Debug)]
pub struct InspectedLog {
    /// The query id.
    pub query_id: String,
    /// The epoch of the query's last claim: raised by every runner that
    /// claims it, and by whoever settles a generation.
    pub epoch: i64,
    /// Its plans and commits.
    pub stored: StoredBatches,
}

/// The Cassandra offset store of one query, holding its claim (epoch).
pub struct CassandraStore {
    session: Session,
    location: CassandraLocation,
    options: CassandraOptions,
    query_id: String,
    epoch: i64,
    write_plan: PreparedStatement,
    write_commit: PreparedStatement,
    /// `write_commit` and `write_plan` as one conditional batch.
    commit_and_plan: Batch,
    write_initial: PreparedStatement,
    write_offset: PreparedStatement,
    load: PreparedStatement,
    read_claim: PreparedStatement,
    insert_claim: PreparedStatement,
    raise_claim: PreparedStatement,
    last_plan: Option<BatchPlan>,
    /// The committed offsets not yet in the offsets table, with their batch.
    unmirrored: Option<(BatchId, PartitionOffsets)>,
    /// When the offsets table was last written.
    mirrored_at: Option<Instant>,
    /// A conditional write whose outcome is unknown (it timed out, or Cassandra
    /// went away): if it did apply, its retry finds the entry already there.
    uncertain: Option<(&'static str, BatchId)>,
    /// A commit held to be written with the next plan
    /// ([`OffsetStore::hold_commit`]).
    held: Option<BatchCommit>,
}

impl CassandraStore {
    /// One conditional batch: Cassandra runs both updates in one lightweight
    /// transaction, since they share the query's partition, and applies both
    /// or neither.
    async fn write_joined(
        &mut self,
        commit: &BatchCommit,
        plan: &BatchPlan,
    ) -> Result<(), CassandraStoreError> {
        let (batch, next) = (commit.id, plan.id());
        if next != batch.next() {
            return Err(CassandraStoreError::NotConsecutive {
                query: self.location.query.clone(),
                commit: batch.0,
                plan: next.0,
            });
        }
        if self.uncertain == Some(("commit and plan", next)) {
            let stored = self.load().await?;
            if stored.latest_plan.as_ref() == Some(plan) && stored.committed.contains(&batch) {
                // The write whose answer was lost did apply. The offsets table
                // waits for the next commit: the committed plan is no longer the
                // newest, so the log does not hand it back whole.
                self.uncertain = None;
                self.last_plan = Some(plan.clone());
                return Ok(());
            }
        }
        let committed_plan = self.plan_to_commit(batch, false).await?;
        let values = (self.commit_values(commit), self.plan_values(plan));
        let result = match self.session.batch(&self.commit_and_plan, values).await {
            Ok(result) => result,
            Err(e) => {
                let entries = format!(
                    "{} with {}",
                    self.entry("commit", batch),
                    self.entry("plan", next)
                );
                return Err(self.unanswered(("commit and plan", next), entries, e));
            }
        };
        let (done, epoch) = applied(result)?;
        let retried = self.uncertain.take() == Some(("commit and plan", next));
        if !done {
            // A retry of a write that did apply finds both entries: that is success.
            let ours = epoch.is_none_or(|e| e == self.epoch);
            let found = if retried && ours {
                let stored = self.load().await?;
                stored.latest_plan.as_ref() == Some(plan)
                    && stored.latest_commit.as_ref().map(|c| c.id) == Some(batch)
            } else {
                false
            };
            if !found {
                return Err(self.refused("commit", batch, epoch).await);
            }
        }
        self.last_plan = Some(plan.clone());
        self.committed(batch, &committed_plan).await;
        Ok(())
    }

    /// Connects, checks or creates the schema, and claims the query by raising
    /// its epoch. From then on, a runner that claims it later fences this one out.
    pub async fn open(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<CassandraStore, CassandraStoreError> {
        let mut store = CassandraStore::connect(location, options).await?;
        let (insert, raise) = (store.insert_claim.clone(), store.raise_claim.clone());
        store.claim(&insert, &raise).await?;
        Ok(store)
    }

    /// Writes the committed offsets not yet in the plain latest-offsets table,
    /// for people and tools reading with CQL: one unlogged batch, since every
    /// row is in the query's partition, so one mutation, to which Cassandra's
    /// batch size limits do not apply.
    async fn mirror_offsets(&mut self) -> Result<(), CassandraStoreError> {
        let Some((batch, end)) = &self.unmirrored else {
            return Ok(());
        };
        let batch = *batch;
        self.mirrored_at = Some(Instant::now());
        let mut rows = Batch::new(BatchType::Unlogged);
        rows.set_consistency(self.options.consistency.driver());
        rows.set_request_timeout(Some(self.options.request_timeout));
        let batch_id = i64::try_from(batch.0).unwrap_or(i64::MAX);
        let values: Vec<_> = end
            .iter()
            .map(|(tp, offset)| {
                rows.append_statement(self.write_offset.clone());
                (
                    offset.value(),
                    batch_id,
                    &self.location.query,
                    &tp.topic,
                    tp.partition,
                )
            })
            .collect();
        if !values.is_empty() {
            self.session
                .batch(&rows, values)
                .await
                .map_err(query_error(format!(
                    "recording the offsets of batch {batch} in {}.{OFFSETS_TABLE}",
                    self.location.keyspace
                )))?;
        }
        self.unmirrored = None;
        Ok(())
    }

    /// Connects, checks the schema and prepares the statements, without a claim.
    async fn connect(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<CassandraStore, CassandraStoreError> {
        let session = options.session(&location).await?;
        ensure_schema(&session, &location, &options).await?;

        let ks = &location.keyspace;
        let prepare = |cql: String| options.prepare(&session, cql);
        let write_plan = prepare(format!(
            "UPDATE {ks}.{LOG_TABLE} SET start_offsets = ?, end_offsets = ?, watermark_ms = ?, \
             timestamp_ms = ?, conf = ? WHERE query = ? AND kind = 'plan' AND batch_id = ? \
             IF epoch = ? AND end_offsets = null"
        ))
        .await?;
        let write_commit = prepare(format!(
            "UPDATE {ks}.{LOG_TABLE} SET watermark_ms = ? WHERE query = ? AND kind = 'commit' \
             AND batch_id = ? IF epoch = ? AND watermark_ms = null"
        ))
        .await?;
        let mut commit_and_plan = Batch::new(BatchType::Logged);
        commit_and_plan.append_statement(write_commit.clone());
        commit_and_plan.append_statement(write_plan.clone());
        commit_and_plan.set_consistency(options.consistency.driver());
        commit_and_plan.set_serial_consistency(Some(options.serial_consistency.driver()));
        commit_and_plan.set_request_timeout(Some(options.request_timeout));
        let write_initial = prepare(format!(
            "UPDATE {ks}.{LOG_TABLE} SET end_offsets = ? WHERE query = ? AND kind = 'initial' \
             AND batch_id = 0 IF epoch = ? AND end_offsets = null"
        ))
        .await?;
        let write_offset = prepare(format!(
            "UPDATE {ks}.{OFFSETS_TABLE} SET offset = ?, batch_id = ? WHERE query = ? AND topic = ? \
             AND partition = ?"
        ))
        .await?;
        let load = prepare(format!(
            "SELECT kind, batch_id, start_offsets, end_offsets, watermark_ms, timestamp_ms, conf, \
             epoch, owner FROM {ks}.{LOG_TABLE} WHERE query = ?"
        ))
        .await?;
        let mut read_claim = prepare(format!(
            "SELECT query_id, epoch, owner FROM {ks}.{LOG_TABLE} WHERE query = ? LIMIT 1"
        ))
        .await?;
        // The claim must see every completed conditional write.
        read_claim.set_consistency(match options.serial_consistency {
            SerialConsistency::Serial => DriverConsistency::Serial,
            SerialConsistency::LocalSerial => DriverConsistency::LocalSerial,
        });
        let insert_claim = prepare(format!(
            "INSERT INTO {ks}.{LOG_TABLE} (query, query_id, epoch, owner) VALUES (?, ?, 1, ?) \
             IF NOT EXISTS"
        ))
        .await?;
        let raise_claim = prepare(format!(
            "UPDATE {ks}.{LOG_TABLE} SET epoch = ?, owner = ? WHERE query = ? IF epoch = ?"
        ))
        .await?;

        Ok(CassandraStore {
            session,
            location,
            options,
            query_id: String::new(),
            epoch: 0,
            write_plan,
            commit_and_plan,
            write_commit,
            write_initial,
            write_offset,
            load,
            read_claim,
            insert_claim,
            raise_claim,
            last_plan: None,
            unmirrored: None,
            mirrored_at: None,
            uncertain: None,
            held: None,
        })
    }

    /// Reads a query's stored batches without claiming it, so that a running
    /// query is not disturbed. `None` when the query has never been claimed.
    pub async fn inspect(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<Option<(String, StoredBatches)>, CassandraStoreError> {
        Ok(CassandraStore::inspect_log(location, options)
            .await?
            .map(|log| (log.query_id, log.stored)))
    }

    /// [`CassandraStore::inspect`], with the epoch of the query's last claim.
    pub async fn inspect_log(
        location: CassandraLocation,
        options: CassandraOptions,
    ) -> Result<Option<InspectedLog>, CassandraStoreError> {
        let inspect_options = CassandraOptions {
            create_schema: false,
            replication: None,
            ..options
        };
        let mut store = CassandraStore::connect(location, inspect_options).await?;
        let Some((id, epoch, _)) = store.read_claim().await? else {
            return Ok(None);
        };
        // Loading as the current holder: this store writes nothing.
        store.epoch = epoch;
        store.query_id = id.clone();
        Ok(Some(InspectedLog {
            query_id: id,
            epoch,
            stored: store.load().await?,
        }))
    }

    /// Deletes this query's log and its offsets mirror, unless another runner
    /// claimed it since. A generation's log goes once its partitions are handed
    /// back (`docs/scale-out.md`): nothing reads it any more.
    pub async fn remove(self) -> Result<(), CassandraStoreError> {
        let ks = &self.location.keyspace;
        let query = &self.location.query;
        let what = format!("removing query {query} from {ks}.{LOG_TABLE}");
        // Cassandra deletes a partition only unconditionally: the epoch is
        // checked, and raised so that no write of an older holder lands
        // meanwhile, first.
        let result = self
            .session
            .execute_unpaged(
                &self.raise_claim,
                (self.epoch + 1, "removed", query, self.epoch),
            )
            .await
            .map_err(query_error(what.clone()))?;
        let (done, epoch) = applied(result)?;
        if !done {
            return Err(self.refused("claim", BatchId::FIRST, epoch).await);
        }
        self.session
            .query_unpaged(
                format!("DELETE FROM {ks}.{LOG_TABLE} WHERE query = ?"),
                (query,),
            )
            .await
            .map_err(query_error(what))?;
        self.session
            .query_unpaged(
                format!("DELETE FROM {ks}.{OFFSETS_TABLE} WHERE query = ?"),
                (query,),
            )
            .await
            .map_err(query_error(format!(
                "removing query {query} from {ks}.{OFFSETS_TABLE}"
            )))?;
        Ok(())
    }

    /// The query id, created with the query's first claim.
    pub fn id(&self) -> &str {
        &self.query_id
    }

    /// This runner's epoch.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Raises the query's epoch by one with a conditional write, retrying when
    /// another runner claims at the same moment.
    async fn claim(
        &mut self,
        insert: &PreparedStatement,
        raise: &PreparedStatement,
    ) -> Result<(), CassandraStoreError> {
        let query = self.location.query.clone();
        for _ in 0..10 {
            let current = self.read_claim().await?;
            let applied = match current {
                None => {
                    let id = self
                        .options
                        .query_id
                        .clone()
                        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
                    let result = self
                        .session
                        .execute_unpaged(insert, (&query, &id, &self.options.owner))
                        .await
                        .map_err(query_error(format!("claiming query {query}")))?;
                    applied(result)?.0.then_some((id, 1))
                }
                Some((id, epoch, _)) => {
                    let next = epoch + 1;
                    let result = self
                        .session
                        .execute_unpaged(raise, (next, &self.options.owner, &query, epoch))
                        .await
                        .map_err(query_error(format!("claiming query {query}")))?;
                    applied(result)?.0.then_some((id, next))
                }
            };
            if let Some((id, epoch)) = applied {
                tracing::info!(query = %query, epoch, "claimed the query");
                self.query_id = id;
                self.epoch = epoch;
                return Ok(());
            }
        }
        Err(CassandraStoreError::Query {
            what: format!("claiming query {query}"),
            source: "other runners kept claiming it at the same time".into(),
        })
    }

    /// The claim as stored: query id, epoch and owner.
    async fn read_claim(&self) -> Result<Option<(String, i64, String)>, CassandraStoreError> {
        let what = || format!("reading the claim of query {}", self.location.query);
        let result = self
            .session
            .execute_unpaged(&self.read_claim, (&self.location.query,))
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let row = result
            .maybe_first_row::<(Option<String>, Option<i64>, Option<String>)>()
            .map_err(query_error(what()))?;
        Ok(match row {
            Some((Some(id), Some(epoch), owner)) => Some((id, epoch, owner.unwrap_or_default())),
            _ => None,
        })
    }

    /// A conditional write that got no answer, so may have applied: its retry
    /// counts finding it as success, and since a node that failed may come back
    /// without what it acknowledged last, the next commit reads the log again
    /// instead of trusting the plan this store wrote.
    fn unanswered(
        &mut self,
        write: (&'static str, BatchId),
        entries: String,
        error: scylla::errors::ExecutionError,
    ) -> CassandraStoreError {
        self.uncertain = Some(write);
        self.last_plan = None;
        query_error(format!("writing {entries}"))(error)
    }

    /// `write_plan`'s bound values.
    fn plan_values(
        &self,
        plan: &BatchPlan,
    ) -> (String, String, i64, i64, String, String, i64, i64) {
        let metadata = plan.metadata();
        (
            offsets_to_json(&plan.start_offsets()),
            ends_to_json(plan),
            metadata.watermark_ms,
            metadata.timestamp_ms,
            serde_json::to_string(&metadata.conf).unwrap_or_default(),
            self.location.query.clone(),
            i64::try_from(plan.id().0).unwrap_or(i64::MAX),
            self.epoch,
        )
    }

    /// `write_commit`'s bound values.
    fn commit_values(&self, commit: &BatchCommit) -> (i64, String, i64, i64) {
        (
            commit.next_watermark_ms,
            self.location.query.clone(),
            i64::try_from(commit.id.0).unwrap_or(i64::MAX),
            self.epoch,
        )
    }

    /// The plan of the batch about to be committed: the one this store wrote
    /// last, or else the newest stored, which must be that batch's. A commit
    /// already stored is refused as such, unless this is the retry of a write
    /// whose answer was lost (which may have stored it).
    async fn plan_to_commit(
        &mut self,
        batch: BatchId,
        retry: bool,
    ) -> Result<BatchPlan, CassandraStoreError> {
        if let Some(plan) = self.last_plan.as_ref().filter(|p| p.id() == batch) {
            return Ok(plan.clone());
        }
        let stored = self.load().await?;
        if !retry && stored.committed.contains(&batch) {
            return Err(CassandraStoreError::AlreadyExists {
                entry: self.entry("commit", batch),
            });
        }
        match stored.latest_plan {
            Some(plan) if plan.id() == batch => Ok(plan),
            _ => Err(CassandraStoreError::CommitWithoutPlan {
                query: self.location.query.clone(),
                batch: batch.0,
            }),
        }
    }

    /// Notes a durable commit for the latest-offsets table, and refreshes the
    /// table when it is due.
    async fn committed(&mut self, batch: BatchId, plan: &BatchPlan) {
        self.unmirrored = Some((batch, plan.end_offsets()));
        if self
            .mirrored_at
            .is_none_or(|at| at.elapsed() >= OFFSETS_TABLE_INTERVAL)
            && let Err(e) = self.mirror_offsets().await
        {
            // Derived data that recovery never reads: the batch is committed, and
            // the next commit or the end of the run writes the table again.
            tracing::warn!(error = %e, "the offsets table was not updated");
        }
    }

    fn entry(&self, kind: &str, batch: BatchId) -> String {
        format!(
            "{}.{LOG_TABLE} query={} kind={kind} batch_id={batch}",
            self.location.keyspace, self.location.query
        )
    }

    /// Turns a refused conditional write into the reason: fenced, or the entry exists.
    async fn refused(
        &self,
        kind: &str,
        batch: BatchId,
        current_epoch: Option<i64>,
    ) -> CassandraStoreError {
        // Our own epoch in the answer means the entry exists; otherwise read the
        // claim once, for the epoch and the owner to name.
        if current_epoch == Some(self.epoch) {
            return CassandraStoreError::AlreadyExists {
                entry: self.entry(kind, batch),
            };
        }
        match self.read_claim().await {
            Ok(Some((_, epoch, owner))) if epoch != self.epoch => CassandraStoreError::Fenced {
                query: self.location.query.clone(),
                epoch: self.epoch,
                current_epoch: epoch,
                owner,
            },
            // A generation's log is removed once whoever settled it handed its
            // partitions back (`docs/scale-out.md`).
            Ok(None) => CassandraStoreError::Fenced {
                query: self.location.query.clone(),
                epoch: self.epoch,
                current_epoch: 0,
                owner: "nobody: the query's log was removed".to_owned(),
            },
            _ => CassandraStoreError::AlreadyExists {
                entry: self.entry(kind, batch),
            },
        }
    }

    fn fenced_if_moved(&self, epoch: i64, owner: &str) -> Result<(), CassandraStoreError> {
        if epoch != self.epoch {
            return Err(CassandraStoreError::Fenced {
                query: self.location.query.clone(),
                epoch: self.epoch,
                current_epoch: epoch,
                owner: owner.to_owned(),
            });
        }
        Ok(())
    }
}

/// Reads `[applied]` and the current epoch from a conditional write's result.
fn applied(
    result: scylla::response::query_result::QueryResult,
) -> Result<(bool, Option<i64>), CassandraStoreError> {
    let rows = result
        .into_rows_result()
        .map_err(query_error("reading a conditional write's result"))?;
    let epoch_index = rows.column_specs().get_by_name("epoch").map(|(i, _)| i);
    let row = rows
        .maybe_first_row::<Row>()
        .map_err(query_error("reading a conditional write's result"))?;
    let Some(row) = row else {
        return Ok((false, None));
    };
    let applied = matches!(row.columns.first(), Some(Some(CqlValue::Boolean(true))));
    let epoch = epoch_index
        .and_then(|i| row.columns.get(i).cloned().flatten())
        .and_then(|v| match v {
            CqlValue::BigInt(e) => Some(e),
            _ => None,
        });
    Ok((applied, epoch))
}

/// Whether a lookup in Cassandra's schema tables finds a row.
pub(crate) async fn exists(
    session: &Session,
    what: String,
    cql: &'static str,
    values: Vec<String>,
) -> Result<bool, CassandraStoreError> {
    let result = session
        .query_unpaged(cql, values)
        .await
        .map_err(query_error(what.clone()))?
        .into_rows_result()
        .map_err(query_error(what))?;
    Ok(result.rows_num() > 0)
}

/// Creates the keyspace (when given its replication) and the tables every
/// query uses, or checks that they exist when `create_schema` is false.
pub(crate) async fn ensure_schema(
    session: &Session,
    location: &CassandraLocation,
    options: &CassandraOptions,
) -> Result<(), CassandraStoreError> {
    let ks = &location.keyspace;
    let exists =
        |what: String, cql: &'static str, values: Vec<String>| exists(session, what, cql, values);
    let keyspace_exists = exists(
        format!("looking for keyspace {ks}"),
        "SELECT keyspace_name FROM system_schema.keyspaces WHERE keyspace_name = ?",
        vec![ks.clone()],
    )
    .await?;
    if !keyspace_exists {
        let Some(replication) = &options.replication else {
            return Err(CassandraStoreError::MissingKeyspace {
                keyspace: ks.clone(),
            });
        };
        session
            .query_unpaged(
                format!("CREATE KEYSPACE IF NOT EXISTS {ks} WITH replication = {replication}"),
                (),
            )
            .await
            .map_err(query_error(format!("creating keyspace {ks}")))?;
    }
    let tables = [
        (
            LOG_TABLE,
            format!(
                "CREATE TABLE IF NOT EXISTS {ks}.{LOG_TABLE} (query text, kind text, batch_id bigint, \
                 query_id text static, epoch bigint static, owner text static, start_offsets text, \
                 end_offsets text, watermark_ms bigint, timestamp_ms bigint, conf text, \
                 PRIMARY KEY (query, kind, batch_id))"
            ),
        ),
        (
            OFFSETS_TABLE,
            format!(
                "CREATE TABLE IF NOT EXISTS {ks}.{OFFSETS_TABLE} (query text, topic text, \
                 partition int, offset bigint, batch_id bigint, PRIMARY KEY (query, topic, partition))"
            ),
        ),
        (
            STATE_TABLE,
            format!(
                "CREATE TABLE IF NOT EXISTS {ks}.{STATE_TABLE} (query text, operator int, \
                 partition int, version bigint, kind text, chunk int, bytes blob, epoch bigint, \
                 PRIMARY KEY ((query, operator, partition), version, kind, chunk))"
            ),
        ),
    ];
    for (table, create) in tables {
        if options.create_schema {
            session
                .query_unpaged(create, ())
                .await
                .map_err(query_error(format!("creating table {ks}.{table}")))?;
        } else {
            let present = exists(
                format!("looking for table {ks}.{table}"),
                "SELECT table_name FROM system_schema.tables WHERE keyspace_name = ? AND table_name = ?",
                vec![ks.clone(), table.to_owned()],
            )
            .await?;
            if !present {
                return Err(CassandraStoreError::MissingTable {
                    table: format!("{ks}.{table}"),
                });
            }
        }
    }
    // `CREATE TABLE IF NOT EXISTS` keeps a table of another layout as it is:
    // the state table from before state partitions has no `partition` column.
    let partitioned = exists(
        format!("looking at the columns of {ks}.{STATE_TABLE}"),
        "SELECT column_name FROM system_schema.columns WHERE keyspace_name = ? AND table_name = ? \
         AND column_name = 'partition'",
        vec![ks.clone(), STATE_TABLE.to_owned()],
    )
    .await?;
    if !partitioned {
        return Err(CassandraStoreError::OldTable {
            table: format!("{ks}.{STATE_TABLE}"),
            problem: "it has no `partition` column: it was created by a Sluice from before state \
                      partitions, whose state this one does not read"
                .to_owned(),
        });
    }
    Ok(())
}

/// One row of the log, as loaded.
type LogRow = (
    Option<String>,
    Option<i64>,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<String>,
    Option<i64>,
    Option<String>,
);

impl OffsetStore for CassandraStore {
    type Error = CassandraStoreError;

    async fn check_claim(&mut self) -> Result<(), CassandraStoreError> {
        match self.read_claim().await? {
            Some((_, epoch, owner)) => self.fenced_if_moved(epoch, &owner),
            None => Err(CassandraStoreError::Fenced {
                query: self.location.query.clone(),
                epoch: self.epoch,
                current_epoch: 0,
                owner: "nobody: the claim is gone".to_owned(),
            }),
        }
    }

    async fn load(&mut self) -> Result<StoredBatches, CassandraStoreError> {
        let what = || format!("loading query {}", self.location.query);
        let result = self
            .session
            .execute_unpaged(&self.load, (&self.location.query,))
            .await
            .map_err(query_error(what()))?
            .into_rows_result()
            .map_err(query_error(what()))?;
        let mut stored = StoredBatches::default();
        let mut plans = Vec::new();
        let mut commits = Vec::new();
        for row in result.rows::<LogRow>().map_err(query_error(what()))? {
            let (kind, batch, start, end, watermark, timestamp, conf, epoch, owner) =
                row.map_err(query_error(what()))?;
            if let Some(epoch) = epoch {
                self.fenced_if_moved(epoch, owner.as_deref().unwrap_or_default())?;
            }
            let (Some(kind), Some(batch)) = (kind, batch) else {
                continue;
            };
            let batch = BatchId(u64::try_from(batch).unwrap_or_default());
            let entry = self.entry(&kind, batch);
            let parse = |json: Option<String>, field: &str| {
                let json = json.ok_or_else(|| CassandraStoreError::Damaged {
                    entry: entry.clone(),
                    problem: format!("{field} is null"),
                })?;
                offsets_from_json(&json).map_err(|e| CassandraStoreError::Damaged {
                    entry: entry.clone(),
                    problem: format!("{field}: {e}"),
                })
            };
            match kind.as_str() {
                "plan" => {
                    let start = parse(start, "start_offsets")?;
                    let ends =
                        match end.as_deref().map(str::trim_start) {
                            Some(lines) if lines.starts_with('[') => ends_from_json(lines)
                                .map_err(|problem| CassandraStoreError::Damaged {
                                    entry: entry.clone(),
                                    problem: format!("end_offsets: {problem}"),
                                })?,
                            _ => vec![parse(end, "end_offsets")?],
                        };
                    let conf = match conf.as_deref() {
                        None | Some("") => Default::default(),
                        Some(text) => serde_json::from_str(text).map_err(|e| {
                            CassandraStoreError::Damaged {
                                entry: entry.clone(),
                                problem: format!("conf: {e}"),
                            }
                        })?,
                    };
                    let metadata = BatchMetadata {
                        watermark_ms: watermark.unwrap_or_default(),
                        timestamp_ms: timestamp.unwrap_or_default(),
                        conf,
                    };
                    let plan =
                        BatchPlan::from_lines(batch, &start, &ends, metadata).map_err(|e| {
                            CassandraStoreError::Damaged {
                                entry: entry.clone(),
                                problem: e.to_string(),
                            }
                        })?;
                    plans.push(plan);
                }
                "commit" => commits.push(BatchCommit {
                    id: batch,
                    next_watermark_ms: watermark.unwrap_or_default(),
                }),
                "initial" => stored.initial_offsets = Some(parse(end, "end_offsets")?),
                _ => {}
            }
        }
        plans.sort_by_key(BatchPlan::id);
        commits.sort_by_key(|c| c.id);
        stored.planned = plans.iter().map(BatchPlan::id).collect();
        stored.committed = commits.iter().map(|c| c.id).collect();
        stored.latest_plan = plans.pop();
        stored.latest_commit = commits.pop();
        self.last_plan = stored.latest_plan.clone();
        Ok(stored)
    }

    async fn write_plan(&mut self, plan: &BatchPlan) -> Result<(), CassandraStoreError> {
        if let Some(commit) = self.held.clone() {
            self.write_joined(&commit, plan).await?;
            self.held = None;
            return Ok(());
        }
        let batch = plan.id();
        let values = self.plan_values(plan);
        if batch == BatchId::FIRST {
            let result = self
                .session
                .execute_unpaged(
                    &self.write_initial,
                    (&values.0, &self.location.query, self.epoch),
                )
                .await
                .map_err(query_error(format!(
                    "writing {}",
                    self.entry("initial", batch)
                )))?;
            let (done, epoch) = applied(result)?;
            if !done && epoch.is_some_and(|e| e != self.epoch) {
                return Err(self.refused("initial", batch, epoch).await);
            }
        }
        let result = match self.session.execute_unpaged(&self.write_plan, values).await {
            Ok(result) => result,
            Err(e) => {
                let entry = self.entry("plan", batch);
                return Err(self.unanswered(("plan", batch), entry, e));
            }
        };
        let (done, epoch) = applied(result)?;
        let retried = self.uncertain.take() == Some(("plan", batch));
        if !done {
            // A retry of a write that did apply finds our own plan: that is success.
            let ours = epoch.is_none_or(|e| e == self.epoch);
            if !(retried && ours && self.load().await?.latest_plan.as_ref() == Some(plan)) {
                return Err(self.refused("plan", batch, epoch).await);
            }
        }
        self.last_plan = Some(plan.clone());
        Ok(())
    }

    async fn write_commit(&mut self, commit: &BatchCommit) -> Result<(), CassandraStoreError> {
        let batch = commit.id;
        let retry = self.uncertain == Some(("commit", batch));
        let plan = self.plan_to_commit(batch, retry).await?;
        let values = self.commit_values(commit);
        let result = match self
            .session
            .execute_unpaged(&self.write_commit, values)
            .await
        {
            Ok(result) => result,
            Err(e) => {
                let entry = self.entry("commit", batch);
                return Err(self.unanswered(("commit", batch), entry, e));
            }
        };
        let (done, epoch) = applied(result)?;
        let retried = self.uncertain.take() == Some(("commit", batch));
        // A retry of a commit that did apply finds our own commit: that is success.
        let our_retry = retried && epoch.is_none_or(|e| e == self.epoch);
        if !(done || our_retry) {
            return Err(self.refused("commit", batch, epoch).await);
        }
        self.committed(batch, &plan).await;
        Ok(())
    }

    /// Holds the commit for the next plan: writing both costs one lightweight
    /// transaction instead of two.
    fn hold_commit(&mut self, commit: &BatchCommit) -> bool {
        self.held = Some(commit.clone());
        true
    }

    async fn settle(&mut self) -> Result<(), CassandraStoreError> {
        if let Some(commit) = self.held.clone() {
            OffsetStore::write_commit(self, &commit).await?;
            self.held = None;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), CassandraStoreError> {
        if self.unmirrored.is_none() {
            return Ok(());
        }
        // Unconditional rows: a runner that lost the query leaves them to the
        // one that took it, whose offsets are newer.
        if let Some((_, epoch, owner)) = self.read_claim().await? {
            self.fenced_if_moved(epoch, &owner)?;
        }
        self.mirror_offsets().await
    }

    async fn purge(&mut self, keep_from: BatchId) -> Result<(), CassandraStoreError> {
        if let Some((_, epoch, owner)) = self.read_claim().await? {
            self.fenced_if_moved(epoch, &owner)?;
        }
        let ks = &self.location.keyspace;
        for kind in ["plan", "commit"] {
            self.session
                .query_unpaged(
                    format!(
                        "DELETE FROM {ks}.{LOG_TABLE} WHERE query = ? AND kind = ? AND batch_id < ?"
                    ),
                    (
                        &self.location.query,
                        kind,
                        i64::try_from(keep_from.0).unwrap_or(i64::MAX),
                    ),
                )
                .await
                .map_err(query_error(format!(
                    "purging {kind}s before batch {keep_from}"
                )))?;
        }
        Ok(())
    }

    fn is_transient(error: &CassandraStoreError) -> bool {
        error.is_transient()
    }

    fn describe(&self, log: Log, batch: BatchId) -> String {
        let kind = match log {
            Log::Plans => "plan",
            Log::Commits => "commit",
        };
        self.entry(kind, batch)
    }
}

/// A plan's end offsets as stored: Spark's JSON for a query of one source,
/// and a JSON array of it, a source each in order, for one of several.
fn ends_to_json(plan: &BatchPlan) -> String {
    if plan.source_count() == 1 {
        return offsets_to_json(&plan.end_offsets());
    }
    let lines: Vec<String> = plan
        .end_offsets_by_source()
        .iter()
        .map(offsets_to_json)
        .collect();
    format!("[{}]", lines.join(","))
}

/// The end offsets of each source from [`ends_to_json`]'s array.
fn ends_from_json(text: &str) -> Result<Vec<PartitionOffsets>, String> {
    let lines: Vec<serde_json::Value> =
        serde_json::from_str(text).map_err(|e| format!("not a JSON array: {e}"))?;
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            offsets_from_json(&line.to_string()).map_err(|e| format!("source {i}: {e}"))
        })
        .collect()
}
