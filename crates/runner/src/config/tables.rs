//! `[tables.<name>]`: lookup tables the query joins its stream with.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_tables::FileFormat;

/// `[tables.<name>]`: a file or a directory of files, or a Cassandra table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableSection {
    /// "file" (the default) or "cassandra".
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// A file, or a directory whose files are read together.
    pub path: Option<PathBuf>,
    /// "csv", "json" (one object per line) or "parquet".
    pub format: Option<String>,
    /// Cassandra: the contact points, `host:port` separated by commas.
    pub contact_points: Option<String>,
    /// Cassandra: the keyspace.
    pub keyspace: Option<String>,
    /// Cassandra: the table.
    pub table: Option<String>,
    /// Cassandra: reads by key at a time.
    pub in_flight: Option<usize>,
    /// Cassandra: the login and TLS, as `[checkpoint]` takes them.
    pub username: Option<String>,
    /// See `username`.
    pub password: Option<String>,
    /// See `username`.
    pub password_env: Option<String>,
    /// See `username`.
    pub tls_ca_file: Option<PathBuf>,
    /// The columns in Spark's DDL form; a Parquet table's own by default.
    pub schema: Option<String>,
    /// Whether a CSV file's first line names its columns (true by default).
    pub header: Option<bool>,
    /// A CSV file's field delimiter, one character (`,` by default).
    pub delimiter: Option<String>,
    /// The most memory the table's rows may take, in MiB.
    pub max_memory_mb: Option<u64>,
}

impl std::fmt::Debug for TableSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableSection")
            .field("type", &self.kind)
            .field("path", &self.path)
            .field("keyspace", &self.keyspace)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

/// `max_memory_mb` when it is not set.
pub const DEFAULT_TABLE_MEMORY_MB: u64 = 512;

/// A lookup table, checked.
#[derive(Debug, Clone)]
pub struct TableSpec {
    /// Its name in SQL.
    pub name: String,
    /// Where its rows are.
    pub source: TableSource,
    /// Its declared columns.
    pub schema: Option<sluice_sql::arrow::datatypes::SchemaRef>,
    /// The most memory its rows may take (for a table read by key: the rows
    /// a batch read).
    pub max_memory_bytes: u64,
}

/// Where a lookup table's rows are.
#[derive(Debug, Clone)]
pub enum TableSource {
    /// A file or a directory of files, read whole and again when they change.
    File {
        /// The file or directory.
        path: PathBuf,
        /// How the files are written.
        format: FileFormat,
    },
    /// A Cassandra table, read by partition key as batches need its rows.
    Cassandra {
        /// How to reach the cluster.
        connection: sluice_cassandra_store::Connection,
        /// The keyspace.
        keyspace: String,
        /// The table.
        table: String,
        /// Reads at a time.
        in_flight: usize,
    },
}

/// The `[tables.*]` sections, checked against the stream's table name.
pub(super) fn tables(
    sections: BTreeMap<String, TableSection>,
    streams: &[super::StreamSettings],
) -> Result<Vec<TableSpec>> {
    let mut specs = Vec::with_capacity(sections.len());
    for (name, section) in sections {
        let at = format!("[tables.{name}]");
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            bail!("{at}: a table's name must be a plain name: letters, digits and underscores");
        }
        if let Some(stream) = streams.iter().find(|s| s.table == name) {
            let (which, section) = match streams.len() {
                1 => ("the stream", "[source] table".to_owned()),
                _ => ("a stream", format!("[sources.{name}]")),
            };
            bail!(
                "{at}: {which} is the table `{}` ({section}); name the lookup table otherwise",
                stream.table
            );
        }
        let schema = section
            .schema
            .as_deref()
            .map(|text| sluice_sql::parse_ddl(text.trim()))
            .transpose()
            .with_context(|| format!("{at} schema"))?;
        let source = match section.kind.as_deref() {
            None | Some("file") => file_source(&at, &section, schema.is_some())?,
            Some("cassandra") => {
                if schema.is_none() {
                    bail!(
                        "{at} needs schema, the columns to read in Spark's DDL form, like \
                         \"name STRING, segment STRING\" (the partition key among them)"
                    );
                }
                cassandra_source(&at, &section)?
            }
            Some(other) => bail!("{at} type must be \"file\" or \"cassandra\", not {other:?}"),
        };
        let max_memory_mb = section.max_memory_mb.unwrap_or(DEFAULT_TABLE_MEMORY_MB);
        if !(1..=1 << 20).contains(&max_memory_mb) {
            bail!("{at} max_memory_mb = {max_memory_mb}: it must be from 1 to 1048576 (MiB)");
        }
        specs.push(TableSpec {
            name,
            source,
            schema,
            max_memory_bytes: max_memory_mb << 20,
        });
    }
    Ok(specs)
}

/// A file table's path and format.
fn file_source(at: &str, section: &TableSection, declared: bool) -> Result<TableSource> {
    if let Some(key) = [
        ("contact_points", section.contact_points.is_some()),
        ("keyspace", section.keyspace.is_some()),
        ("table", section.table.is_some()),
        ("in_flight", section.in_flight.is_some()),
        ("username", section.username.is_some()),
        ("password", section.password.is_some()),
        ("password_env", section.password_env.is_some()),
        ("tls_ca_file", section.tls_ca_file.is_some()),
    ]
    .iter()
    .find_map(|(key, set)| set.then_some(key))
    {
        bail!("{at} {key} applies to type = \"cassandra\" only");
    }
    let Some(path) = section.path.clone() else {
        bail!("{at} needs path, a file or a directory of files (or type = \"cassandra\")");
    };
    let csv_only = section.header.is_some() || section.delimiter.is_some();
    let format = match section.format.as_deref() {
        Some("csv") => FileFormat::Csv {
            header: section.header.unwrap_or(true),
            delimiter: match section.delimiter.as_deref() {
                None => b',',
                Some(d) if d.len() == 1 => d.as_bytes()[0],
                Some(d) => bail!("{at} delimiter = {d:?}: it must be one ASCII character"),
            },
        },
        Some("json" | "parquet") if csv_only => {
            bail!("{at}: header and delimiter apply to format = \"csv\" only")
        }
        Some("json") => FileFormat::Json,
        Some("parquet") => FileFormat::Parquet,
        Some(other) => {
            bail!("{at} format must be \"csv\", \"json\" or \"parquet\", not {other:?}")
        }
        None => bail!("{at} needs format: \"csv\", \"json\" or \"parquet\""),
    };
    if !declared && format != FileFormat::Parquet {
        bail!(
            "{at} needs schema, the columns in Spark's DDL form, like \"id BIGINT, name \
             STRING\" (only a Parquet table may leave it out)"
        );
    }
    Ok(TableSource::File { path, format })
}

/// A Cassandra table's connection and name.
fn cassandra_source(at: &str, section: &TableSection) -> Result<TableSource> {
    if let Some(key) = [
        ("path", section.path.is_some()),
        ("format", section.format.is_some()),
        ("header", section.header.is_some()),
        ("delimiter", section.delimiter.is_some()),
    ]
    .iter()
    .find_map(|(key, set)| set.then_some(key))
    {
        bail!("{at} {key} applies to files, not to type = \"cassandra\"");
    }
    let need = |value: &Option<String>, key: &str| {
        value
            .clone()
            .filter(|v| !v.trim().is_empty())
            .with_context(|| format!("{at} type = \"cassandra\" needs {key}"))
    };
    let nodes: Vec<String> = need(&section.contact_points, "contact_points")?
        .split(',')
        .map(|n| n.trim().to_owned())
        .collect();
    let auth = super::CassandraAuth {
        username: section.username.clone(),
        password: section.password.clone(),
        password_env: section.password_env.clone(),
        tls_ca_file: section.tls_ca_file.clone(),
    };
    let in_flight = section
        .in_flight
        .unwrap_or(sluice_tables::DEFAULT_IN_FLIGHT);
    if !(1..=1024).contains(&in_flight) {
        bail!("{at} in_flight = {in_flight}: it must be from 1 to 1024");
    }
    Ok(TableSource::Cassandra {
        connection: auth.connection(nodes, &at[1..at.len() - 1])?,
        keyspace: need(&section.keyspace, "keyspace")?,
        table: need(&section.table, "table")?,
        in_flight,
    })
}
