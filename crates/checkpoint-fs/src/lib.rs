//! The filesystem offset store of Sluice: an offsets log, a commit log and the
//! query metadata in a checkpoint directory laid out as Spark Structured Streaming
//! lays it out, written durably and atomically.
