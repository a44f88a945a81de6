//! Sinks that land the stream in tables other tools read.
//!
//! [`ParquetSink`] writes each batch's rows as Parquet files under a directory,
//! optionally in Hive-style partition directories, and lists them in Spark's
//! file-sink log (`_spark_metadata/`), so that Spark reading the directory sees
//! exactly the files of committed batches, as it does for its own file sink.
//!
//! [`DeltaSink`] appends each batch's rows to a Delta Lake table as one commit
//! that records the batch id as the query's transaction version, as Spark's
//! Delta sink does, so a replayed batch is not appended twice.

mod delta_sink;
mod error;
mod parquet_sink;
mod spark_log;

pub use delta_sink::{DeltaOptions, DeltaSink, Vacuumed, vacuum};
pub use error::LakeError;
pub use parquet_sink::{Compression, ParquetOptions, ParquetSink};
pub use spark_log::{SinkFile, SparkFileLog};
