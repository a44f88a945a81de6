//! `[tables.<name>]`: lookup tables the query joins its stream with.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use sluice_tables::FileFormat;

/// `[tables.<name>]`: a file or a directory of files.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableSection {
    /// A file, or a directory whose files are read together.
    pub path: PathBuf,
    /// "csv", "json" (one object per line) or "parquet".
    pub format: String,
    /// The columns in Spark's DDL form; a Parquet table's own by default.
    pub schema: Option<String>,
    /// Whether a CSV file's first line names its columns (true by default).
    pub header: Option<bool>,
    /// A CSV file's field delimiter, one character (`,` by default).
    pub delimiter: Option<String>,
    /// The most memory the table's rows may take, in MiB.
    pub max_memory_mb: Option<u64>,
}

/// `max_memory_mb` when it is not set.
pub const DEFAULT_TABLE_MEMORY_MB: u64 = 512;

/// A lookup table, checked.
#[derive(Debug, Clone)]
pub struct TableSpec {
    /// Its name in SQL.
    pub name: String,
    /// Its file or directory.
    pub path: PathBuf,
    /// How its files are written.
    pub format: FileFormat,
    /// Its declared columns.
    pub schema: Option<sluice_sql::arrow::datatypes::SchemaRef>,
    /// The most memory its rows may take.
    pub max_memory_bytes: u64,
}

/// The `[tables.*]` sections, checked against the stream's table name.
pub(super) fn tables(
    sections: BTreeMap<String, TableSection>,
    stream: &str,
) -> Result<Vec<TableSpec>> {
    let mut specs = Vec::with_capacity(sections.len());
    for (name, section) in sections {
        let at = format!("[tables.{name}]");
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            bail!("{at}: a table's name must be a plain name: letters, digits and underscores");
        }
        if name == stream {
            bail!(
                "{at}: the stream is the table `{stream}` ([source] table); name the lookup \
                 table otherwise"
            );
        }
        let schema = section
            .schema
            .as_deref()
            .map(|text| sluice_sql::parse_ddl(text.trim()))
            .transpose()
            .with_context(|| format!("{at} schema"))?;
        let csv_only = section.header.is_some() || section.delimiter.is_some();
        let format = match section.format.as_str() {
            "csv" => FileFormat::Csv {
                header: section.header.unwrap_or(true),
                delimiter: match section.delimiter.as_deref() {
                    None => b',',
                    Some(d) if d.len() == 1 => d.as_bytes()[0],
                    Some(d) => bail!("{at} delimiter = {d:?}: it must be one ASCII character"),
                },
            },
            "json" | "parquet" if csv_only => {
                bail!("{at}: header and delimiter apply to format = \"csv\" only")
            }
            "json" => FileFormat::Json,
            "parquet" => FileFormat::Parquet,
            other => bail!("{at} format must be \"csv\", \"json\" or \"parquet\", not {other:?}"),
        };
        if schema.is_none() && format != FileFormat::Parquet {
            bail!(
                "{at} needs schema, the columns in Spark's DDL form, like \"id BIGINT, name \
                 STRING\" (only a Parquet table may leave it out)"
            );
        }
        let max_memory_mb = section.max_memory_mb.unwrap_or(DEFAULT_TABLE_MEMORY_MB);
        if !(1..=1 << 20).contains(&max_memory_mb) {
            bail!("{at} max_memory_mb = {max_memory_mb}: it must be from 1 to 1048576 (MiB)");
        }
        specs.push(TableSpec {
            name,
            path: section.path,
            format,
            schema,
            max_memory_bytes: max_memory_mb << 20,
        });
    }
    Ok(specs)
}
