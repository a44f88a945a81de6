//! Errors of the Cassandra store, naming the keyspace, table, query and batch.

/// A boxed driver error.
pub type DriverError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error of the Cassandra offset store.
#[derive(Debug, thiserror::Error)]
pub enum CassandraStoreError {
    /// The location is not `cassandra://host:port/keyspace?query=name`.
    #[error("invalid Cassandra location {location:?}: {problem}")]
    Location {
        /// The location as given.
        location: String,
        /// What is wrong with it.
        problem: String,
    },
    /// No node could be reached.
    #[error("cannot connect to Cassandra at {nodes}: {source}")]
    Connect {
        /// The contact points.
        nodes: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The nodes turned the client away: a login refused or missing, or a TLS
    /// handshake that failed. Not retried.
    #[error("Cassandra at {nodes} refused this client: {why}")]
    Refused {
        /// The contact points.
        nodes: String,
        /// What was refused, and what to check.
        why: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The keyspace does not exist and no replication was given to create it.
    #[error(
        "keyspace {keyspace} does not exist; create it, or set replication (for example \
         \"{{'class': 'SimpleStrategy', 'replication_factor': 1}}\") so that Sluice creates it"
    )]
    MissingKeyspace {
        /// The keyspace.
        keyspace: String,
    },
    /// A table is missing and `create_schema = false`.
    #[error(
        "table {table} does not exist and create_schema is false; create it (see docs/cassandra-store.md) or allow Sluice to"
    )]
    MissingTable {
        /// `keyspace.table`.
        table: String,
    },
    /// A table of ours has another layout than this version writes.
    #[error(
        "table {table} has an older layout: {problem}; drop it (the state of the queries in it is \
         lost: restart them with `sluice offsets set --reset-state`) or use another keyspace"
    )]
    OldTable {
        /// `keyspace.table`.
        table: String,
        /// What differs.
        problem: String,
    },
    /// A newer runner has claimed the query: this one must never write again.
    #[error(
        "query {query} was taken over by {owner} (epoch {current_epoch}, ours was {epoch}); this \
         runner stops and writes nothing more"
    )]
    Fenced {
        /// The query.
        query: String,
        /// This runner's epoch.
        epoch: i64,
        /// The epoch now in force.
        current_epoch: i64,
        /// Who holds it.
        owner: String,
    },
    /// A batch entry that would be overwritten.
    #[error("{entry} already exists; a batch entry is never overwritten")]
    AlreadyExists {
        /// The entry, as `describe` names it.
        entry: String,
    },
    /// A commit for a batch without a plan.
    #[error("refusing to commit batch {batch} of query {query}: it has no plan")]
    CommitWithoutPlan {
        /// The query.
        query: String,
        /// The batch.
        batch: u64,
    },
    /// A commit and a plan to write together that are not of consecutive batches.
    #[error(
        "refusing to write the commit of batch {commit} of query {query} with the plan of batch {plan}: only the next batch's plan goes with a commit"
    )]
    NotConsecutive {
        /// The query.
        query: String,
        /// The committed batch.
        commit: u64,
        /// The planned batch.
        plan: u64,
    },
    /// A stored entry that cannot be read back.
    #[error("damaged entry {entry}: {problem}")]
    Damaged {
        /// The entry.
        entry: String,
        /// What is wrong.
        problem: String,
    },
    /// A statement failed.
    #[error("{what} failed: {source}")]
    Query {
        /// What was being done.
        what: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
}

/// Wraps a driver error with what was being done.
pub(crate) fn query_error<E: std::error::Error + Send + Sync + 'static>(
    what: impl Into<String>,
) -> impl FnOnce(E) -> CassandraStoreError {
    let what = what.into();
    move |source| CassandraStoreError::Query {
        what,
        source: Box::new(source),
    }
}

impl CassandraStoreError {
    /// Whether the error may go away by itself (a node restarting, a timeout),
    /// so that the call is worth trying again: the store's writes and the
    /// sink's upserts are idempotent, so a retried write that had in fact
    /// landed does no harm.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            CassandraStoreError::Connect { .. } | CassandraStoreError::Query { .. }
        )
    }
}
