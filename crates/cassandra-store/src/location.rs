//! `cassandra://host:port[,host:port]/keyspace?query=<name>`.

use crate::CassandraStoreError;

/// Where a query's offsets live in Cassandra.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CassandraLocation {
    /// Contact points, `host:port` each.
    pub nodes: Vec<String>,
    /// The keyspace holding Sluice's tables.
    pub keyspace: String,
    /// The query's name, the partition key of its rows.
    pub query: String,
}

impl CassandraLocation {
    /// Parses a location, naming what is wrong with it.
    pub fn parse(location: &str) -> Result<CassandraLocation, CassandraStoreError> {
        let bad = |why: &str| CassandraStoreError::Location {
            location: location.to_owned(),
            problem: why.to_owned(),
        };
        let rest = location
            .strip_prefix("cassandra://")
            .ok_or_else(|| bad("it must start with cassandra://"))?;
        let (hosts, rest) = rest.split_once('/').ok_or_else(|| {
            bad("the keyspace is missing: cassandra://host:port/keyspace?query=name")
        })?;
        let (keyspace, params) = rest.split_once('?').unwrap_or((rest, ""));
        let nodes: Vec<String> = hosts
            .split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .map(|h| {
                if h.contains(':') {
                    h.to_owned()
                } else {
                    format!("{h}:9042")
                }
            })
            .collect();
        if nodes.is_empty() {
            return Err(bad("no host is given"));
        }
        if !is_identifier(keyspace) {
            return Err(bad(
                "the keyspace must be letters, digits and underscores (at most 48)",
            ));
        }
        let query = params
            .split('&')
            .find_map(|p| p.strip_prefix("query="))
            .filter(|q| !q.is_empty())
            .ok_or_else(|| bad("the query name is missing: add ?query=<name>"))?;
        Ok(CassandraLocation {
            nodes,
            keyspace: keyspace.to_owned(),
            query: query.to_owned(),
        })
    }
}

fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 48
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_keyspace_and_query() {
        let l = CassandraLocation::parse("cassandra://a:9042,b/ks_1?query=orders").unwrap();
        assert_eq!(l.nodes, vec!["a:9042".to_owned(), "b:9042".to_owned()]);
        assert_eq!((l.keyspace.as_str(), l.query.as_str()), ("ks_1", "orders"));
    }

    #[test]
    fn says_what_is_missing() {
        let err = |l: &str| CassandraLocation::parse(l).unwrap_err().to_string();
        assert!(err("file:///x").contains("must start with cassandra://"));
        assert!(err("cassandra://a").contains("keyspace is missing"));
        assert!(err("cassandra://a/ks").contains("?query=<name>"));
        assert!(err("cassandra://a/k-s?query=q").contains("letters, digits"));
        assert!(err("cassandra:///ks?query=q").contains("no host"));
    }
}
