//! Lookup tables: a stream joined with a table, as Spark joins a stream with a
//! static DataFrame (inner, or keeping the stream's unmatched rows).
//!
//! A [`LookupTable`] is a table the query names beside its stream. Its rows come
//! from a [`TableLoader`] (a file, a directory, another store), which the
//! processor asks once per batch whether they changed: a batch joins with the
//! table as it is when the batch begins, so a replay after the table changed
//! may join with another version, as in Spark.
//!
//! DataFusion plans the join as a hash join, and would build its hash table
//! again every time the plan runs, that is on every chunk. [`lookup_joins`]
//! replaces each hash join between the stream and lookup tables with a
//! [`LookupJoinExec`], which builds the table's side once per version of the
//! tables under it and probes it with every chunk.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatch, RecordBatchOptions, UInt32Array, UInt32Builder,
};
use arrow::array::{DynComparator, make_comparator};
use arrow::compute::SortOptions;
use arrow::compute::{concat_batches, take};
use arrow::datatypes::SchemaRef;
use arrow::row::{RowConverter, Rows, SortField};
use datafusion::common::hash_utils::create_hashes_with_hasher;
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::common::{JoinSide, JoinType, NullEquality};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr, PhysicalExprRef};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, SortMergeJoinExec, SymmetricHashJoinExec,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
    collect_partitioned,
};
use futures::StreamExt;
use hashbrown::HashTable;
use sluice_core::LookupStats;

use crate::SqlError;
use crate::error::refused;

/// What a [`TableLoader`] read: the table's rows in its declared schema, and
/// a description of the version (file modification times, a row count) that
/// progress records.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The rows.
    pub batches: Vec<RecordBatch>,
    /// Which version this is, as the progress report shows it.
    pub version: String,
}

/// A loader's failure, as it describes it.
pub type LoadError = Box<dyn std::error::Error + Send + Sync>;

/// What [`TableLoader::refresh`] returns.
pub type Refresh<'a> = Pin<Box<dyn Future<Output = Result<Option<Loaded>, LoadError>> + Send + 'a>>;

/// Where a lookup table's rows come from. The processor calls it at the
/// beginning of every batch; it does its I/O off the async threads and says
/// whether the table changed.
pub trait TableLoader: Send {
    /// The table's rows if they changed since the last call that returned
    /// some (or if this is the first), `None` if they did not.
    fn refresh(&mut self) -> Refresh<'_>;
}

/// A keyed loader's failure: whether trying again may succeed (a timeout, a
/// node restarting), and what happened.
#[derive(Debug)]
pub struct FetchError {
    /// Whether the executor's retry policy should try the batch again.
    pub transient: bool,
    /// What the loader said.
    pub error: LoadError,
}

/// What [`KeyedLoader::fetch`] returns.
pub type Fetch<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<RecordBatch>, FetchError>> + Send + 'a>>;

/// Where a table read by key comes from (a Cassandra table): the rows a batch
/// needs are read when it needs them, never the whole table.
pub trait KeyedLoader: Send + Sync {
    /// The columns the table is read by, in the order [`KeyedLoader::fetch`]
    /// takes their values: a join must be on exactly these.
    fn key_columns(&self) -> &[String];

    /// The rows whose key columns equal one of the rows of `keys` (one array
    /// per key column, in [`KeyedLoader::key_columns`]' order), in the
    /// table's schema. One attempt: retries are the executor's.
    fn fetch(&self, keys: Vec<ArrayRef>) -> Fetch<'_>;

    /// Where the rows come from, for the progress report.
    fn describe(&self) -> String;
}

/// A lookup table a query may join its stream with: a name, a schema and the
/// version in force, shared by the query's plan and the processor that
/// replaces it.
#[derive(Clone)]
pub struct LookupTable {
    shared: Arc<Shared>,
}

struct Shared {
    name: String,
    schema: SchemaRef,
    max_bytes: u64,
    current: RwLock<Arc<Version>>,
    counters: Mutex<Counters>,
    /// For a table read by key: its loader and what the batch read so far.
    keyed: Option<Keyed>,
}

/// A table read by key, and the rows the batch in progress read of it.
struct Keyed {
    loader: Arc<dyn KeyedLoader>,
    cache: Mutex<KeyedCache>,
}

/// The rows of the keys a batch read, so that a key is read once per batch;
/// a key without rows is remembered too.
#[derive(Default)]
struct KeyedCache {
    rows: std::collections::HashMap<Box<[u8]>, Option<RecordBatch>>,
    bytes: u64,
    row_count: u64,
    /// The rows the chunk being joined needs, which the table's scan hands
    /// out.
    chunk: Vec<RecordBatch>,
}

#[derive(Default)]
struct Counters {
    reloads: u64,
    failed_reloads: u64,
    last_error: Option<String>,
}

/// One version of a table's rows.
struct Version {
    /// Counts the versions a table has had, so that a join knows when to build
    /// again.
    generation: u64,
    batches: Vec<RecordBatch>,
    description: String,
    rows: u64,
    bytes: u64,
}

impl fmt::Debug for LookupTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupTable")
            .field("name", &self.shared.name)
            .finish_non_exhaustive()
    }
}

impl LookupTable {
    /// An empty table `name` with columns `schema`, which refuses a version
    /// whose Arrow arrays take more than `max_bytes`.
    pub fn new(name: &str, schema: SchemaRef, max_bytes: u64) -> LookupTable {
        LookupTable {
            shared: Arc::new(Shared {
                name: name.to_owned(),
                schema,
                max_bytes,
                current: RwLock::new(Arc::new(Version {
                    generation: 0,
                    batches: Vec::new(),
                    description: "not loaded".to_owned(),
                    rows: 0,
                    bytes: 0,
                })),
                counters: Mutex::new(Counters::default()),
                keyed: None,
            }),
        }
    }

    /// A table `name` with columns `schema`, read by key from `loader` as
    /// batches need its rows, at most `max_bytes` of them in a batch.
    pub fn keyed(
        name: &str,
        schema: SchemaRef,
        loader: Arc<dyn KeyedLoader>,
        max_bytes: u64,
    ) -> LookupTable {
        let mut table = LookupTable::new(name, schema, max_bytes);
        let shared = Arc::get_mut(&mut table.shared).expect("a new table is not shared yet");
        shared.keyed = Some(Keyed {
            loader,
            cache: Mutex::new(KeyedCache::default()),
        });
        table
    }

    /// Starts a batch of a table read by key: what the last batch read is
    /// forgotten, so that the batch reads the rows as they are now.
    pub fn begin_batch(&self) {
        if let Some(keyed) = &self.shared.keyed {
            *keyed.cache.lock().unwrap_or_else(PoisonError::into_inner) = KeyedCache::default();
        }
    }

    /// The table's name in SQL.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The table's columns.
    pub fn schema(&self) -> SchemaRef {
        self.shared.schema.clone()
    }

    /// Makes `loaded` the version later batches join with. Refused, leaving
    /// the version in force, when its columns are not the table's or it takes
    /// more memory than the table may.
    pub fn replace(&self, loaded: Loaded) -> Result<(), SqlError> {
        let shared = &self.shared;
        let lookup_error = |reason: String| SqlError::Lookup {
            table: shared.name.clone(),
            reason,
        };
        for batch in &loaded.batches {
            if batch.schema().fields() != shared.schema.fields() {
                return Err(lookup_error(format!(
                    "its rows have the columns {}, where the table declares {}",
                    columns(&batch.schema()),
                    columns(&shared.schema)
                )));
            }
        }
        // One batch, so that the join's index refers to its rows without
        // copying them into one first.
        let batches = match loaded.batches.len() {
            0 | 1 => loaded.batches,
            _ => vec![
                concat_batches(&shared.schema, &loaded.batches)
                    .map_err(|e| lookup_error(e.to_string()))?,
            ],
        };
        let bytes: u64 = batches
            .iter()
            .map(|b| b.get_array_memory_size() as u64)
            .sum();
        if bytes > shared.max_bytes {
            return Err(lookup_error(format!(
                "its rows take {} MiB in memory, more than its max_memory_mb of {} MiB: raise \
                 max_memory_mb, or select fewer rows or columns into the file",
                bytes.div_ceil(1 << 20),
                shared.max_bytes >> 20
            )));
        }
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
        let mut current = shared
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *current = Arc::new(Version {
            generation: current.generation + 1,
            batches,
            description: loaded.version,
            rows,
            bytes,
        });
        Ok(())
    }

    /// Asks `loader` whether the table changed, and puts a new version in
    /// force. A version that cannot be read or used leaves the last good one
    /// in force, and is counted and kept as the last error; the first load
    /// failing is an error.
    pub async fn refresh(&self, loader: &mut dyn TableLoader) -> Result<(), SqlError> {
        let first = self.current().generation == 0;
        let outcome = match loader.refresh().await {
            Ok(Some(loaded)) => self.replace(loaded),
            Ok(None) => return Ok(()),
            Err(e) => Err(SqlError::Lookup {
                table: self.shared.name.clone(),
                reason: e.to_string(),
            }),
        };
        let mut counters = self
            .shared
            .counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(()) => {
                counters.reloads += u64::from(!first);
                let current = self.current();
                tracing::info!(
                    table = %self.shared.name,
                    rows = current.rows,
                    memory_bytes = current.bytes,
                    version = %current.description,
                    "lookup table loaded"
                );
                Ok(())
            }
            Err(e) if first => Err(e),
            Err(e) => {
                counters.failed_reloads += 1;
                counters.last_error = Some(e.to_string());
                tracing::warn!(
                    table = %self.shared.name,
                    error = %e,
                    kept = %self.current().description,
                    "lookup table not reloaded; the last good version stays in force"
                );
                Ok(())
            }
        }
    }

    /// The version in force and what happened to the table so far.
    pub fn stats(&self) -> LookupStats {
        if let Some(keyed) = &self.shared.keyed {
            let cache = keyed.cache.lock().unwrap_or_else(PoisonError::into_inner);
            return LookupStats {
                name: self.shared.name.clone(),
                version: format!(
                    "{}, read by key as the batch ran ({} keys)",
                    keyed.loader.describe(),
                    cache.rows.len()
                ),
                rows: cache.row_count,
                memory_bytes: cache.bytes,
                reloads: 0,
                failed_reloads: 0,
                last_error: None,
            };
        }
        let current = self.current();
        let counters = self
            .shared
            .counters
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        LookupStats {
            name: self.shared.name.clone(),
            version: current.description.clone(),
            rows: current.rows,
            memory_bytes: current.bytes,
            reloads: counters.reloads,
            failed_reloads: counters.failed_reloads,
            last_error: counters.last_error.clone(),
        }
    }

    fn current(&self) -> Arc<Version> {
        self.shared
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The table as DataFusion scans it: one partition holding the version in
    /// force when the scan runs.
    pub(crate) fn partition(&self) -> Arc<dyn PartitionStream> {
        Arc::new(LookupPartition(self.clone()))
    }
}

fn columns(schema: &SchemaRef) -> String {
    schema
        .fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Debug)]
struct LookupPartition(LookupTable);

impl PartitionStream for LookupPartition {
    fn schema(&self) -> &SchemaRef {
        &self.0.shared.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let batches: Vec<_> = match &self.0.shared.keyed {
            Some(keyed) => keyed
                .cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .chunk
                .iter()
                .cloned()
                .map(Ok)
                .collect(),
            None => self.0.current().batches.iter().cloned().map(Ok).collect(),
        };
        Box::pin(RecordBatchStreamAdapter::new(
            self.0.shared.schema.clone(),
            futures::stream::iter(batches),
        ))
    }
}

/// `plan` with each hash join between a stream (a table whose schema is one
/// of `stream`) and lookup tables replaced by a [`LookupJoinExec`]; any other join
/// of the stream refused, with what to write instead.
pub(crate) fn lookup_joins(
    plan: Arc<dyn ExecutionPlan>,
    stream: &[SchemaRef],
    tables: &[LookupTable],
) -> Result<Arc<dyn ExecutionPlan>, SqlError> {
    let mut problem = None;
    let out = plan
        .transform_up(|node| {
            let Some(join) = node.downcast_ref::<HashJoinExec>() else {
                if is_other_join(&node) && node.children().iter().any(|c| reads_stream(c, stream)) {
                    problem = Some(refused(
                        "a join with a lookup table on a condition other than equal keys",
                        "each row of the stream would be compared with every row of the table",
                        "join on equal keys (ON s.key = t.key), and put other conditions beside \
                         them with AND",
                    ));
                    return Ok(Transformed::new(node, false, TreeNodeRecursion::Stop));
                }
                return Ok(Transformed::no(node));
            };
            let left_streams = reads_stream(&join.left, stream);
            let right_streams = reads_stream(&join.right, stream);
            if left_streams == right_streams {
                // Two lookup tables joined with each other: built once per version
                // by the join above them, which runs this side as a whole.
                return Ok(Transformed::no(node));
            }
            match LookupJoinExec::try_new(join, left_streams, tables) {
                Ok(exec) => Ok(Transformed::yes(Arc::new(exec) as Arc<dyn ExecutionPlan>)),
                Err(e) => {
                    problem = Some(e);
                    Ok(Transformed::new(node, false, TreeNodeRecursion::Stop))
                }
            }
        })
        .map_err(|e| SqlError::Internal(e.to_string()))?;
    match problem {
        Some(problem) => Err(problem),
        None => Ok(out.data),
    }
}

fn is_other_join(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.is::<NestedLoopJoinExec>()
        || node.is::<CrossJoinExec>()
        || node.is::<SortMergeJoinExec>()
        || node.is::<SymmetricHashJoinExec>()
}

/// Whether `plan` scans the stream.
fn reads_stream(plan: &Arc<dyn ExecutionPlan>, streams: &[SchemaRef]) -> bool {
    let mut found = false;
    let _ = plan.apply(|node| {
        if let Some(scan) = node.downcast_ref::<StreamingTableExec>()
            && streams
                .iter()
                .any(|stream| Arc::ptr_eq(scan.partition_schema(), stream))
        {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// The lookup tables `plan` scans.
fn tables_under(plan: &Arc<dyn ExecutionPlan>, tables: &[LookupTable]) -> Vec<LookupTable> {
    let mut found = Vec::new();
    let _ = plan.apply(|node| {
        if let Some(scan) = node.downcast_ref::<StreamingTableExec>()
            && let Some(table) = tables
                .iter()
                .find(|t| Arc::ptr_eq(scan.partition_schema(), &t.shared.schema))
        {
            found.push(table.clone());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// A join of the stream with lookup tables: the tables' side is built into a
/// hash table once per version, and every chunk of the stream probes it.
pub(crate) struct LookupJoinExec {
    stream: Arc<dyn ExecutionPlan>,
    table: Arc<dyn ExecutionPlan>,
    join: Arc<JoinParts>,
    properties: Arc<PlanProperties>,
}

/// What a lookup join needs besides its inputs.
struct JoinParts {
    /// Whether the stream is the join's left input, which decides the order
    /// of the columns it makes.
    stream_is_left: bool,
    stream_keys: Vec<PhysicalExprRef>,
    table_keys: Vec<PhysicalExprRef>,
    filter: Option<JoinFilter>,
    /// A left join of the stream with the table: a row without a match is
    /// kept, with nulls for the table's columns.
    keep_unmatched: bool,
    projection: Option<Vec<usize>>,
    schema: SchemaRef,
    tables: Vec<LookupTable>,
    built: Mutex<Option<Arc<Built>>>,
    /// A table read by key: the table, and for each of its key columns the
    /// join key that matches it.
    keyed: Option<(LookupTable, Vec<usize>)>,
}

/// The tables' side of a join, hashed on its keys. The index holds row
/// numbers only: keys are hashed from their arrays and compared in them, so
/// that the table's keys are not held a second time.
struct Built {
    generations: Vec<u64>,
    batch: RecordBatch,
    /// The key columns, evaluated over `batch` (the columns themselves when
    /// the keys are plain columns).
    keys: Vec<ArrayRef>,
    /// The first row of each key.
    index: HashTable<u32>,
    /// The next row of the same key, `NO_ROW` after the last; empty when no
    /// key has two rows.
    next: Vec<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

const NO_ROW: u32 = u32::MAX;

/// Rows whose keys are hashed at a time when a table is indexed.
const HASHED_AT_ONCE: usize = 64 * 1024;

impl LookupJoinExec {
    fn try_new(
        join: &HashJoinExec,
        stream_is_left: bool,
        tables: &[LookupTable],
    ) -> Result<LookupJoinExec, SqlError> {
        let join_type = *join.join_type();
        let keep_unmatched = match (join_type, stream_is_left) {
            (JoinType::Inner, _) => false,
            (JoinType::Left, true) | (JoinType::Right, false) => true,
            (JoinType::Full, _) | (JoinType::Left, false) | (JoinType::Right, true) => {
                return Err(refused(
                    "a join that keeps the lookup table's unmatched rows (RIGHT or FULL OUTER \
                     with the table on that side)",
                    "every chunk of the stream would emit the table's rows again",
                    "write an inner join, or a LEFT JOIN with the stream on the left",
                ));
            }
            (other, _) => {
                return Err(refused(
                    &format!("a {other} join with a lookup table"),
                    "only inner joins and left outer joins of the stream with a table are \
                     supported",
                    "write JOIN or LEFT JOIN with the stream on the left",
                ));
            }
        };
        if join.null_aware || join.null_equality() == NullEquality::NullEqualsNull {
            return Err(refused(
                "a join on keys where null equals null (NOT IN, IS NOT DISTINCT FROM)",
                "a lookup matches keys that have a value",
                "join on equal keys with =",
            ));
        }
        let (stream, table) = if stream_is_left {
            (join.left.clone(), join.right.clone())
        } else {
            (join.right.clone(), join.left.clone())
        };
        let (stream_keys, table_keys): (Vec<_>, Vec<_>) = join
            .on()
            .iter()
            .map(|(l, r)| {
                if stream_is_left {
                    (l.clone(), r.clone())
                } else {
                    (r.clone(), l.clone())
                }
            })
            .unzip();
        for (s, t) in stream_keys.iter().zip(&table_keys) {
            let s_type = s
                .data_type(&stream.schema())
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            let t_type = t
                .data_type(&table.schema())
                .map_err(|e| SqlError::Internal(e.to_string()))?;
            if s_type != t_type {
                return Err(SqlError::Plan(format!(
                    "the join key {s} is {s_type} and {t} is {t_type}: cast one side so that \
                     both are of one type"
                )));
            }
        }
        let under = tables_under(&table, tables);
        let keyed = keyed_side(&under, &table_keys)?;
        let join = JoinParts {
            stream_is_left,
            stream_keys,
            table_keys,
            filter: join.filter().cloned(),
            keep_unmatched,
            projection: join.projection.as_ref().map(|p| p.to_vec()),
            schema: join.schema(),
            tables: under,
            built: Mutex::new(None),
            keyed,
        };
        let properties = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(join.schema.clone()),
            stream.output_partitioning().clone(),
            EmissionType::Incremental,
            Boundedness::Bounded,
        ));
        Ok(LookupJoinExec {
            stream,
            table,
            join: Arc::new(join),
            properties,
        })
    }
}

/// For a join with a table read by key: the table, and which join key matches
/// each of its key columns. Such a table is joined on exactly its key columns,
/// and on its own.
fn keyed_side(
    under: &[LookupTable],
    table_keys: &[PhysicalExprRef],
) -> Result<Option<(LookupTable, Vec<usize>)>, SqlError> {
    use datafusion::physical_expr::expressions::Column;
    let Some(table) = under.iter().find(|t| t.shared.keyed.is_some()) else {
        return Ok(None);
    };
    let name = table.name();
    if under.len() > 1 {
        return Err(refused(
            &format!("a join of {name} with another table"),
            &format!("{name} is read by key for each batch, so it is joined with the stream alone"),
            "join each lookup table with the stream in turn",
        ));
    }
    let loader = &table.shared.keyed.as_ref().expect("found as keyed").loader;
    let columns = loader.key_columns();
    let names: Vec<Option<&str>> = table_keys
        .iter()
        .map(|k| k.downcast_ref::<Column>().map(Column::name))
        .collect();
    let order: Option<Vec<usize>> = columns
        .iter()
        .map(|c| names.iter().position(|n| *n == Some(c.as_str())))
        .collect();
    match order {
        Some(order) if names.len() == columns.len() => Ok(Some((table.clone(), order))),
        _ => Err(SqlError::Plan(format!(
            "the lookup table {name} is read by its key ({}), so a join with it must be on \
             exactly those columns (ON s.x = {name}.{})",
            columns.join(", "),
            columns.first().map_or("key", String::as_str)
        ))),
    }
}

impl LookupJoinExec {
    /// The stream's side of the join.
    pub(crate) fn stream(&self) -> &Arc<dyn ExecutionPlan> {
        &self.stream
    }
}

impl fmt::Debug for LookupJoinExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupJoinExec")
            .field("stream_keys", &self.join.stream_keys)
            .field("table_keys", &self.join.table_keys)
            .finish_non_exhaustive()
    }
}

impl DisplayAs for LookupJoinExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let names: Vec<_> = self.join.tables.iter().map(LookupTable::name).collect();
        write!(f, "LookupJoinExec: tables=[{}]", names.join(", "))
    }
}

impl ExecutionPlan for LookupJoinExec {
    fn name(&self) -> &str {
        "LookupJoinExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.stream, &self.table]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        for expr in self.join.stream_keys.iter().chain(&self.join.table_keys) {
            if f(expr)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        match &self.join.filter {
            Some(filter) => f(filter.expression()),
            None => Ok(TreeNodeRecursion::Continue),
        }
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let [stream, table]: [Arc<dyn ExecutionPlan>; 2] = children
            .try_into()
            .map_err(|_| DataFusionError::Internal("a lookup join has two inputs".into()))?;
        Ok(Arc::new(LookupJoinExec {
            stream,
            table,
            join: self.join.clone(),
            properties: self.properties.clone(),
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> DfResult<SendableRecordBatchStream> {
        let probe = self.stream.execute(partition, context.clone())?;
        let join = self.join.clone();
        let table = self.table.clone();
        let joined = probe.then(move |batch| {
            let (join, table, context) = (join.clone(), table.clone(), context.clone());
            async move {
                let batch = batch?;
                let built = match &join.keyed {
                    Some((keyed, order)) => {
                        join.keyed_built(keyed, order, &batch, &table, context)
                            .await?
                    }
                    None => join.built(&table, context).await?,
                };
                join.probe(&built, &batch)
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.join.schema.clone(),
            joined,
        )))
    }
}

impl JoinParts {
    /// The tables' side as built for the versions in force, built again when
    /// one of them changed.
    async fn built(
        &self,
        table: &Arc<dyn ExecutionPlan>,
        context: Arc<TaskContext>,
    ) -> DfResult<Arc<Built>> {
        let generations: Vec<u64> = self.tables.iter().map(|t| t.current().generation).collect();
        if let Some(built) = self
            .built
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .filter(|b| b.generations == generations)
        {
            return Ok(built.clone());
        }
        let batches: Vec<RecordBatch> = collect_partitioned(table.clone(), context)
            .await?
            .into_iter()
            .flatten()
            .collect();
        let batch = concat_batches(&table.schema(), &batches)?;
        let built = Arc::new(self.build(generations, batch)?);
        *self.built.lock().unwrap_or_else(PoisonError::into_inner) = Some(built.clone());
        Ok(built)
    }

    /// The tables' side for the keys of one chunk of the stream: the rows of
    /// the keys the batch has not read yet are read first.
    async fn keyed_built(
        &self,
        keyed: &LookupTable,
        order: &[usize],
        stream: &RecordBatch,
        table: &Arc<dyn ExecutionPlan>,
        context: Arc<TaskContext>,
    ) -> DfResult<Arc<Built>> {
        let Some(source) = &keyed.shared.keyed else {
            return Err(DataFusionError::Internal(
                "a keyed join of a table not read by key".into(),
            ));
        };
        let keys: Vec<ArrayRef> = order
            .iter()
            .map(|&j| {
                self.stream_keys[j]
                    .evaluate(stream)?
                    .into_array(stream.num_rows())
            })
            .collect::<DfResult<_>>()?;
        let converter = RowConverter::new(
            keys.iter()
                .map(|k| SortField::new(k.data_type().clone()))
                .collect(),
        )?;
        let rows = converter.convert_columns(&keys)?;
        let valid = all_valid(&keys);
        let mut wanted: Vec<usize> = Vec::new();
        let mut missing: Vec<u32> = Vec::new();
        {
            let cache = source.cache.lock().unwrap_or_else(PoisonError::into_inner);
            let mut here = std::collections::HashSet::new();
            for row in 0..stream.num_rows() {
                let key = rows.row(row);
                if valid.as_ref().is_some_and(|v| !v.value(row)) || !here.insert(key) {
                    continue;
                }
                wanted.push(row);
                if !cache.rows.contains_key(key.as_ref()) {
                    missing.push(row as u32);
                }
            }
        }
        if !missing.is_empty() {
            let indices = UInt32Array::from(missing);
            let asked: Vec<ArrayRef> = keys
                .iter()
                .map(|k| take(k, &indices, None))
                .collect::<Result<_, _>>()?;
            let fetched = source.loader.fetch(asked).await.map_err(|e| {
                DataFusionError::External(Box::new(SqlError::LookupRead {
                    table: keyed.name().to_owned(),
                    reason: e.error.to_string(),
                    transient: e.transient,
                }))
            })?;
            let fetched = concat_batches(&keyed.schema(), &fetched)?;
            self.remember(keyed, &converter, &rows, &indices, &fetched)?;
        }
        let chunk: Vec<RecordBatch> = {
            let cache = source.cache.lock().unwrap_or_else(PoisonError::into_inner);
            wanted
                .iter()
                .filter_map(|&row| cache.rows.get(rows.row(row).as_ref()).cloned().flatten())
                .collect()
        };
        let chunk = concat_batches(&keyed.schema(), &chunk)?;
        source
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .chunk = vec![chunk];
        let batches: Vec<RecordBatch> = collect_partitioned(table.clone(), context)
            .await?
            .into_iter()
            .flatten()
            .collect();
        source
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .chunk
            .clear();
        let batch = concat_batches(&table.schema(), &batches)?;
        Ok(Arc::new(self.build(Vec::new(), batch)?))
    }

    /// Keeps the rows `fetched` for the keys at `asked` of `rows`, and that
    /// the others have none, for the rest of the batch.
    fn remember(
        &self,
        keyed: &LookupTable,
        converter: &RowConverter,
        rows: &Rows,
        asked: &UInt32Array,
        fetched: &RecordBatch,
    ) -> DfResult<()> {
        let Some(source) = &keyed.shared.keyed else {
            return Ok(());
        };
        let columns: Vec<ArrayRef> = source
            .loader
            .key_columns()
            .iter()
            .map(|c| {
                fetched.column_by_name(c).cloned().ok_or_else(|| {
                    DataFusionError::Internal(format!("the rows read by key lack the column {c}"))
                })
            })
            .collect::<DfResult<_>>()?;
        let found = converter.convert_columns(&columns)?;
        let mut by_key: std::collections::HashMap<&[u8], Vec<u32>> = Default::default();
        for row in 0..fetched.num_rows() {
            by_key
                .entry(found.row(row).data())
                .or_default()
                .push(row as u32);
        }
        let mut cache = source.cache.lock().unwrap_or_else(PoisonError::into_inner);
        for &row in asked.values() {
            let key = rows.row(row as usize);
            let kept = match by_key.get(key.as_ref()) {
                Some(indices) => {
                    let kept = arrow::compute::take_record_batch(
                        fetched,
                        &UInt32Array::from(indices.clone()),
                    )?;
                    cache.bytes += kept.get_array_memory_size() as u64;
                    cache.row_count += kept.num_rows() as u64;
                    Some(kept)
                }
                None => None,
            };
            cache.rows.insert(key.as_ref().into(), kept);
        }
        if cache.bytes > keyed.shared.max_bytes {
            return Err(DataFusionError::External(Box::new(SqlError::Lookup {
                table: keyed.name().to_owned(),
                reason: format!(
                    "the rows one batch read by key take {} MiB, more than its max_memory_mb of \
                     {} MiB: lower max_offsets_per_trigger, or raise max_memory_mb",
                    cache.bytes.div_ceil(1 << 20),
                    keyed.shared.max_bytes >> 20
                ),
            })));
        }
        Ok(())
    }

    fn build(&self, generations: Vec<u64>, batch: RecordBatch) -> DfResult<Built> {
        let keys = evaluate(&self.table_keys, &batch)?;
        let hasher = hashbrown::DefaultHashBuilder::default();
        let rows = batch.num_rows();
        let same = comparators(&keys, &keys)?;
        // Sized for every row, so that it never grows: the rehash below is
        // never called, and the hashes are made a slice of rows at a time.
        let mut index: HashTable<u32> = HashTable::with_capacity(rows);
        let rehash = |r: &u32| {
            let one: Vec<ArrayRef> = keys.iter().map(|k| k.slice(*r as usize, 1)).collect();
            let mut hash = [0_u64];
            let _ = create_hashes_with_hasher(&one, &hasher, &mut hash);
            hash[0]
        };
        // A key's later rows are chained after its first, in the table's
        // order, so that its matches come out in the same order on every
        // run: `next` and `last` (the last row of each key, by its first) are
        // made at the first repeated key, most tables having none.
        let mut next: Vec<u32> = Vec::new();
        let mut last: Vec<u32> = Vec::new();
        let valid = all_valid(&keys);
        let mut hashes = vec![0_u64; rows.min(HASHED_AT_ONCE)];
        for start in (0..rows).step_by(HASHED_AT_ONCE) {
            let len = HASHED_AT_ONCE.min(rows - start);
            let slice: Vec<ArrayRef> = keys.iter().map(|k| k.slice(start, len)).collect();
            create_hashes_with_hasher(&slice, &hasher, &mut hashes[..len])?;
            for (row, &hash) in (start..).zip(&hashes[..len]) {
                if valid.as_ref().is_some_and(|v| !v.value(row)) {
                    continue;
                }
                match index.find(hash, |&first| equal(&same, first as usize, row)) {
                    Some(&first) => {
                        if next.is_empty() {
                            next = vec![NO_ROW; rows];
                            last = (0..rows as u32).collect();
                        }
                        next[last[first as usize] as usize] = row as u32;
                        last[first as usize] = row as u32;
                    }
                    None => {
                        index.insert_unique(hash, row as u32, rehash);
                    }
                }
            }
        }
        Ok(Built {
            generations,
            batch,
            keys,
            index,
            next,
            hasher,
        })
    }

    /// The joined rows of a chunk of the stream.
    fn probe(&self, built: &Built, stream: &RecordBatch) -> DfResult<RecordBatch> {
        let keys = evaluate(&self.stream_keys, stream)?;
        let mut hashes = vec![0_u64; stream.num_rows()];
        create_hashes_with_hasher(&keys, &built.hasher, &mut hashes)?;
        let same = comparators(&keys, &built.keys)?;
        let valid = all_valid(&keys);
        let mut stream_rows = UInt32Builder::with_capacity(stream.num_rows());
        let mut table_rows = UInt32Builder::with_capacity(stream.num_rows());
        for (row, &hash) in hashes.iter().enumerate() {
            let found = valid
                .as_ref()
                .is_none_or(|v| v.value(row))
                .then(|| built.index.find(hash, |&r| equal(&same, row, r as usize)))
                .flatten();
            if let Some(&first) = found {
                let mut matched = first;
                while matched != NO_ROW {
                    stream_rows.append_value(row as u32);
                    table_rows.append_value(matched);
                    matched = built.next.get(matched as usize).copied().unwrap_or(NO_ROW);
                }
                continue;
            }
            if self.keep_unmatched && self.filter.is_none() {
                stream_rows.append_value(row as u32);
                table_rows.append_null();
            }
        }
        let (mut stream_rows, mut table_rows) = (stream_rows.finish(), table_rows.finish());
        if let Some(filter) = &self.filter {
            (stream_rows, table_rows) =
                self.filtered(filter, built, stream, stream_rows, table_rows)?;
        }
        self.output(built, stream, &stream_rows, &table_rows)
    }

    /// The pairs that pass the join's other conditions; for a left join, each
    /// stream row none of whose pairs passed, once, without a table row.
    fn filtered(
        &self,
        filter: &JoinFilter,
        built: &Built,
        stream: &RecordBatch,
        stream_rows: UInt32Array,
        table_rows: UInt32Array,
    ) -> DfResult<(UInt32Array, UInt32Array)> {
        let columns = filter
            .column_indices()
            .iter()
            .map(|c| {
                let from_stream = (c.side == JoinSide::Left) == self.stream_is_left;
                if from_stream {
                    take(stream.column(c.index), &stream_rows, None)
                } else {
                    take(built.batch.column(c.index), &table_rows, None)
                }
            })
            .collect::<Result<Vec<ArrayRef>, _>>()?;
        let options = RecordBatchOptions::new().with_row_count(Some(stream_rows.len()));
        let pairs = RecordBatch::try_new_with_options(filter.schema().clone(), columns, &options)?;
        let passed = filter
            .expression()
            .evaluate(&pairs)?
            .into_array(pairs.num_rows())?;
        let passed = passed
            .as_any()
            .downcast_ref::<BooleanArray>()
            .ok_or_else(|| DataFusionError::Internal("a join filter that is not boolean".into()))?;
        let mut kept_stream = UInt32Builder::with_capacity(stream_rows.len());
        let mut kept_table = UInt32Builder::with_capacity(stream_rows.len());
        let mut pair = 0;
        for row in 0..stream.num_rows() as u32 {
            let mut any = false;
            while pair < stream_rows.len() && stream_rows.value(pair) == row {
                if passed.is_valid(pair) && passed.value(pair) {
                    kept_stream.append_value(row);
                    kept_table.append_value(table_rows.value(pair));
                    any = true;
                }
                pair += 1;
            }
            if !any && self.keep_unmatched {
                kept_stream.append_value(row);
                kept_table.append_null();
            }
        }
        Ok((kept_stream.finish(), kept_table.finish()))
    }

    fn output(
        &self,
        built: &Built,
        stream: &RecordBatch,
        stream_rows: &UInt32Array,
        table_rows: &UInt32Array,
    ) -> DfResult<RecordBatch> {
        let take_all = |batch: &RecordBatch, rows: &UInt32Array| {
            batch
                .columns()
                .iter()
                .map(|c| take(c, rows, None))
                .collect::<Result<Vec<_>, _>>()
        };
        let stream_columns = take_all(stream, stream_rows)?;
        let table_columns = take_all(&built.batch, table_rows)?;
        let joined: Vec<ArrayRef> = if self.stream_is_left {
            stream_columns.into_iter().chain(table_columns).collect()
        } else {
            table_columns.into_iter().chain(stream_columns).collect()
        };
        let columns = match &self.projection {
            Some(projection) => projection.iter().map(|&i| joined[i].clone()).collect(),
            None => joined,
        };
        let options = RecordBatchOptions::new().with_row_count(Some(stream_rows.len()));
        Ok(RecordBatch::try_new_with_options(
            self.schema.clone(),
            columns,
            &options,
        )?)
    }
}

/// A comparator of each key column of `left` with the same of `right`.
fn comparators(left: &[ArrayRef], right: &[ArrayRef]) -> DfResult<Vec<DynComparator>> {
    left.iter()
        .zip(right)
        .map(|(l, r)| make_comparator(l.as_ref(), r.as_ref(), SortOptions::default()))
        .collect::<Result<_, _>>()
        .map_err(DataFusionError::from)
}

/// Whether row `l` of the left keys equals row `r` of the right.
fn equal(same: &[DynComparator], l: usize, r: usize) -> bool {
    same.iter().all(|compare| compare(l, r).is_eq())
}

fn evaluate(exprs: &[PhysicalExprRef], batch: &RecordBatch) -> DfResult<Vec<ArrayRef>> {
    exprs
        .iter()
        .map(|e| e.evaluate(batch)?.into_array(batch.num_rows()))
        .collect()
}

/// Which rows have a value in every key column; `None` when all do.
fn all_valid(keys: &[ArrayRef]) -> Option<BooleanArray> {
    let mut nulls = None;
    for key in keys {
        nulls = arrow::buffer::NullBuffer::union(nulls.as_ref(), key.logical_nulls().as_ref());
    }
    nulls.map(|n| BooleanArray::new(n.into_inner(), None))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;
    use crate::{QueryOptions, StreamQuery};

    fn orders() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("customer", DataType::Utf8, true),
        ]))
    }

    fn customers() -> LookupTable {
        LookupTable::new(
            "customers",
            Arc::new(Schema::new(vec![
                Field::new("name", DataType::Utf8, true),
                Field::new("segment", DataType::Utf8, true),
            ])),
            1 << 20,
        )
    }

    fn version(table: &LookupTable, rows: &[(Option<&str>, &str)], version: &str) {
        let batch = RecordBatch::try_new(
            table.schema(),
            vec![
                Arc::new(StringArray::from(
                    rows.iter().map(|r| r.0).collect::<Vec<_>>(),
                )),
                Arc::new(StringArray::from(
                    rows.iter().map(|r| r.1).collect::<Vec<_>>(),
                )),
            ],
        )
        .unwrap();
        table
            .replace(Loaded {
                batches: vec![batch],
                version: version.to_owned(),
            })
            .unwrap();
    }

    fn chunk(rows: &[(i64, Option<&str>)]) -> RecordBatch {
        RecordBatch::try_new(
            orders(),
            vec![
                Arc::new(Int64Array::from(
                    rows.iter().map(|r| r.0).collect::<Vec<_>>(),
                )),
                Arc::new(StringArray::from(
                    rows.iter().map(|r| r.1).collect::<Vec<_>>(),
                )),
            ],
        )
        .unwrap()
    }

    async fn plan(sql: &str, table: &LookupTable) -> Result<StreamQuery, SqlError> {
        let options = QueryOptions {
            lookup_tables: vec![table.clone()],
            ..QueryOptions::default()
        };
        StreamQuery::plan_with(sql, "orders", orders(), &options).await
    }

    /// The rows of `batches` as text, one line each.
    fn lines(batches: &[RecordBatch]) -> Vec<String> {
        let mut out = Vec::new();
        for batch in batches {
            for row in 0..batch.num_rows() {
                let cells: Vec<String> = batch
                    .columns()
                    .iter()
                    .map(|c| arrow::util::display::array_value_to_string(c, row).unwrap())
                    .collect();
                out.push(cells.join(","));
            }
        }
        out
    }

    #[tokio::test]
    async fn an_inner_join_enriches_each_row_and_drops_what_has_no_match() {
        let table = customers();
        version(
            &table,
            &[(Some("ann"), "gold"), (Some("bob"), "tin"), (None, "none")],
            "v1",
        );
        let query = plan(
            "SELECT o.id, c.segment FROM orders o JOIN customers c ON o.customer = c.name",
            &table,
        )
        .await
        .unwrap();
        let rows = query
            .run(chunk(&[
                (1, Some("bob")),
                (2, Some("zed")),
                (3, None),
                (4, Some("ann")),
            ]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["1,tin", "4,gold"]);
    }

    #[tokio::test]
    async fn a_left_join_keeps_every_row_of_the_stream_in_its_order() {
        let table = customers();
        version(
            &table,
            &[(Some("ann"), "gold"), (Some("ann"), "silver")],
            "v1",
        );
        let query = plan(
            "SELECT o.id, c.segment FROM orders o LEFT JOIN customers c ON o.customer = c.name",
            &table,
        )
        .await
        .unwrap();
        let rows = query
            .run(chunk(&[(1, Some("zed")), (2, Some("ann")), (3, None)]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["1,", "2,gold", "2,silver", "3,"]);
    }

    #[tokio::test]
    async fn other_conditions_of_a_left_join_leave_a_row_unmatched_not_dropped() {
        let table = customers();
        version(&table, &[(Some("ann"), "gold"), (Some("bob"), "tin")], "v1");
        let query = plan(
            "SELECT o.id, c.segment FROM orders o LEFT JOIN customers c \
             ON o.customer = c.name AND c.segment <> 'tin' AND o.id > 1",
            &table,
        )
        .await
        .unwrap();
        let rows = query
            .run(chunk(&[
                (1, Some("ann")),
                (2, Some("ann")),
                (3, Some("bob")),
            ]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["1,", "2,gold", "3,"]);
    }

    #[tokio::test]
    async fn a_new_version_is_joined_from_the_next_run_on() {
        let table = customers();
        version(&table, &[(Some("ann"), "gold")], "v1");
        let query = plan(
            "SELECT c.segment, o.id FROM customers c JOIN orders o ON o.customer = c.name",
            &table,
        )
        .await
        .unwrap();
        assert!(
            query
                .explain()
                .contains("LookupJoinExec: tables=[customers]"),
            "{}",
            query.explain()
        );
        let before = query.run(chunk(&[(1, Some("ann"))])).await.unwrap();
        version(&table, &[(Some("ann"), "platinum")], "v2");
        let after = query.run(chunk(&[(2, Some("ann"))])).await.unwrap();
        assert_eq!(lines(&before), ["gold,1"]);
        assert_eq!(lines(&after), ["platinum,2"]);
        assert_eq!(table.stats().version, "v2");
    }

    #[tokio::test]
    async fn a_join_under_an_aggregation_and_a_filter_on_the_table_plan_and_run() {
        let table = customers();
        version(
            &table,
            &[
                (Some("ann"), "gold"),
                (Some("bob"), "gold"),
                (Some("cy"), "tin"),
            ],
            "v1",
        );
        let mut query = plan(
            "SELECT c.segment, count(*) AS n FROM orders o JOIN customers c \
             ON o.customer = c.name WHERE c.segment <> 'tin' GROUP BY c.segment",
            &table,
        )
        .await
        .unwrap();
        query.begin_batch(0).unwrap();
        let rows = query
            .run(chunk(&[
                (1, Some("ann")),
                (2, Some("bob")),
                (3, Some("cy")),
            ]))
            .await
            .unwrap();
        query.update(&rows).unwrap();
        let out = query.finish_batch(0).await.unwrap();
        assert_eq!(lines(&out), ["gold,2"]);
    }

    #[tokio::test]
    async fn an_aggregate_of_the_table_is_the_tables_side_not_the_querys_state() {
        let table = customers();
        version(
            &table,
            &[
                (Some("ann"), "gold"),
                (Some("ann"), "tin"),
                (Some("bob"), "tin"),
            ],
            "v1",
        );
        let query = plan(
            "SELECT o.id, c.n FROM orders o JOIN              (SELECT name, count(*) AS n FROM customers GROUP BY name) c ON o.customer = c.name",
            &table,
        )
        .await
        .unwrap();
        assert!(!query.is_stateful());
        let rows = query
            .run(chunk(&[(1, Some("ann")), (2, Some("bob"))]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["1,2", "2,1"]);
    }

    #[tokio::test]
    async fn a_window_over_the_streams_qualified_time_groups_the_joined_rows() {
        use arrow::array::TimestampMicrosecondArray;
        use arrow::datatypes::TimeUnit;
        let stream = Arc::new(Schema::new(vec![
            Field::new("customer", DataType::Utf8, true),
            Field::new(
                "timestamp",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ]));
        let table = customers();
        version(&table, &[(Some("ann"), "gold")], "v1");
        let options = QueryOptions {
            lookup_tables: vec![table.clone()],
            watermark_column: Some("timestamp".into()),
            ..QueryOptions::default()
        };
        let mut query = StreamQuery::plan_with(
            "SELECT window.start AS start, c.segment, count(*) AS n \
             FROM orders o LEFT JOIN customers c ON o.customer = c.name \
             GROUP BY window(o.timestamp, '10 seconds'), c.segment",
            "orders",
            stream.clone(),
            &options,
        )
        .await
        .unwrap();
        let chunk = RecordBatch::try_new(
            stream,
            vec![
                Arc::new(StringArray::from(vec!["ann", "bob", "ann"])),
                Arc::new(
                    TimestampMicrosecondArray::from(vec![1_000_000, 2_000_000, 12_000_000])
                        .with_timezone("UTC"),
                ),
            ],
        )
        .unwrap();
        query.begin_batch(0).unwrap();
        let rows = query.run(chunk).await.unwrap();
        query.update(&rows).unwrap();
        assert!(query.finish_batch(0).await.unwrap().is_empty());
        query.stateful_operator().unwrap().commit();
        query.begin_batch(60_000).unwrap();
        let mut out = lines(&query.finish_batch(60_000).await.unwrap());
        out.sort();
        assert_eq!(
            out,
            [
                "1970-01-01T00:00:00Z,,1",
                "1970-01-01T00:00:00Z,gold,1",
                "1970-01-01T00:00:10Z,gold,1"
            ]
        );
    }

    #[tokio::test]
    async fn joins_that_cannot_run_on_a_stream_are_refused_with_what_to_write() {
        let table = customers();
        let refused = [
            (
                "SELECT * FROM orders a JOIN orders b ON a.id = b.id",
                "a join of the stream with itself",
            ),
            (
                "SELECT * FROM orders o RIGHT JOIN customers c ON o.customer = c.name",
                "keeps the lookup table's unmatched rows",
            ),
            (
                "SELECT * FROM orders o FULL JOIN customers c ON o.customer = c.name",
                "keeps the lookup table's unmatched rows",
            ),
            (
                "SELECT * FROM orders o JOIN customers c ON o.customer < c.name",
                "other than equal keys",
            ),
            (
                "SELECT * FROM orders o JOIN customers c ON o.id = c.name",
                "the join key o.id is BIGINT and c.name is STRING",
            ),
            (
                "SELECT * FROM orders o JOIN suppliers s ON o.id = s.id",
                "[tables.<name>]",
            ),
        ];
        for (sql, expected) in refused {
            let error = plan(sql, &table).await.unwrap_err().to_string();
            assert!(error.contains(expected), "{sql}: {error}");
        }
    }

    /// A table read by key from memory, counting the keys it is asked for.
    struct ByKey {
        rows: RecordBatch,
        keys: Vec<String>,
        asked: std::sync::atomic::AtomicUsize,
        fail: std::sync::atomic::AtomicBool,
    }

    impl KeyedLoader for ByKey {
        fn key_columns(&self) -> &[String] {
            &self.keys
        }

        fn fetch(&self, keys: Vec<ArrayRef>) -> Fetch<'_> {
            Box::pin(async move {
                use std::sync::atomic::Ordering;
                if self.fail.load(Ordering::Relaxed) {
                    return Err(FetchError {
                        transient: true,
                        error: "timed out".into(),
                    });
                }
                self.asked.fetch_add(keys[0].len(), Ordering::Relaxed);
                let wanted = keys[0].as_any().downcast_ref::<StringArray>().unwrap();
                let names = self
                    .rows
                    .column(0)
                    .as_any()
                    .downcast_ref::<StringArray>()
                    .unwrap();
                let mask: arrow::array::BooleanArray = names
                    .iter()
                    .map(|n| Some(wanted.iter().any(|w| w == n)))
                    .collect();
                Ok(vec![
                    arrow::compute::filter_record_batch(&self.rows, &mask).unwrap(),
                ])
            })
        }

        fn describe(&self) -> String {
            "memory".into()
        }
    }

    #[tokio::test]
    async fn a_table_read_by_key_reads_each_key_once_a_batch_and_fails_transiently() {
        use std::sync::atomic::Ordering;
        let plain = customers();
        version(&plain, &[(Some("ann"), "gold"), (Some("bob"), "tin")], "v1");
        let loader = Arc::new(ByKey {
            rows: plain.current().batches[0].clone(),
            keys: vec!["name".into()],
            asked: Default::default(),
            fail: Default::default(),
        });
        let table = LookupTable::keyed("customers", plain.schema(), loader.clone(), 1 << 20);
        let query = plan(
            "SELECT o.id, c.segment FROM orders o LEFT JOIN customers c ON o.customer = c.name",
            &table,
        )
        .await
        .unwrap();
        table.begin_batch();
        let rows = query
            .run(chunk(&[
                (1, Some("ann")),
                (2, Some("zed")),
                (3, Some("ann")),
            ]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["1,gold", "2,", "3,gold"]);
        assert_eq!(loader.asked.load(Ordering::Relaxed), 2, "ann and zed, once");
        let rows = query
            .run(chunk(&[(4, Some("zed")), (5, Some("bob"))]))
            .await
            .unwrap();
        assert_eq!(lines(&rows), ["4,", "5,tin"]);
        assert_eq!(
            loader.asked.load(Ordering::Relaxed),
            3,
            "bob only: zed is known to have none"
        );
        assert_eq!(table.stats().rows, 2);
        table.begin_batch();
        loader.fail.store(true, Ordering::Relaxed);
        let error = query.run(chunk(&[(6, Some("ann"))])).await.unwrap_err();
        assert!(error.is_transient(), "{error:?}");
        assert!(
            error
                .to_string()
                .contains("\"customers\" by key failed: timed out"),
            "{error}"
        );
        let wrong = plan(
            "SELECT o.id FROM orders o JOIN customers c ON o.customer = c.segment",
            &table,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(wrong.contains("is read by its key (name)"), "{wrong}");
    }

    #[test]
    fn a_version_of_other_columns_or_over_the_memory_limit_is_refused() {
        let table = LookupTable::new("customers", customers().schema(), 1024);
        let other = RecordBatch::try_new(
            orders(),
            vec![
                Arc::new(Int64Array::from(vec![1])),
                Arc::new(StringArray::from(vec!["a"])),
            ],
        )
        .unwrap();
        let error = table
            .replace(Loaded {
                batches: vec![other],
                version: "v".into(),
            })
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("its rows have the columns id Int64"),
            "{error}"
        );
        let big = RecordBatch::try_new(
            table.schema(),
            vec![
                Arc::new(StringArray::from(vec!["x".repeat(2000)])),
                Arc::new(StringArray::from(vec!["y"])),
            ],
        )
        .unwrap();
        let error = table
            .replace(Loaded {
                batches: vec![big],
                version: "v".into(),
            })
            .unwrap_err()
            .to_string();
        assert!(error.contains("more than its max_memory_mb"), "{error}");
        assert_eq!(table.stats().version, "not loaded");
    }
}
