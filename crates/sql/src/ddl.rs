//! Schemas in Spark's DDL form (`"order BIGINT, customer STRING, amount DOUBLE"`),
//! as Arrow schemas.
//!
//! The grammar is Spark's `StructType.fromDDL`: comma-separated columns, each a
//! name (backquoted when it needs to be) and a type, optionally `NOT NULL` and
//! `COMMENT '...'`. Types: `BOOLEAN`, `TINYINT`/`BYTE`, `SMALLINT`/`SHORT`,
//! `INT`/`INTEGER`, `BIGINT`/`LONG`, `FLOAT`/`REAL`, `DOUBLE`,
//! `DECIMAL(p, s)`/`DEC`/`NUMERIC`, `STRING`, `VARCHAR(n)`, `CHAR(n)`, `BINARY`,
//! `DATE`, `TIMESTAMP`/`TIMESTAMP_LTZ` (UTC), `TIMESTAMP_NTZ`, `ARRAY<T>`,
//! `MAP<K, V>` and `STRUCT<name: T, ...>`.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};

use crate::SqlError;

/// The type names this parser knows, for suggestions.
const TYPE_NAMES: &[&str] = &[
    "BOOLEAN",
    "TINYINT",
    "BYTE",
    "SMALLINT",
    "SHORT",
    "INT",
    "INTEGER",
    "BIGINT",
    "LONG",
    "FLOAT",
    "REAL",
    "DOUBLE",
    "DECIMAL",
    "DEC",
    "NUMERIC",
    "STRING",
    "VARCHAR",
    "CHAR",
    "BINARY",
    "DATE",
    "TIMESTAMP",
    "TIMESTAMP_LTZ",
    "TIMESTAMP_NTZ",
    "ARRAY",
    "MAP",
    "STRUCT",
];

/// Parses a schema in Spark's DDL form.
///
/// ```
/// use arrow::datatypes::DataType;
/// let schema = sluice_sql::parse_ddl("order BIGINT, customer STRING, amount DECIMAL(10, 2)").unwrap();
/// assert_eq!(schema.field(0).name(), "order");
/// assert_eq!(schema.field(2).data_type(), &DataType::Decimal128(10, 2));
/// ```
pub fn parse_ddl(text: &str) -> Result<SchemaRef, SqlError> {
    let mut parser = Parser {
        text,
        tokens: tokenize(text)?,
        at: 0,
    };
    let fields = parser.columns(None)?;
    if let Some(token) = parser.peek() {
        return Err(parser.error(token.start, format!("unexpected `{}`", token.text)));
    }
    if fields.is_empty() {
        return Err(SqlError::Schema {
            schema: text.to_owned(),
            position: 0,
            reason: "it declares no column".to_owned(),
        });
    }
    let mut seen = std::collections::HashSet::new();
    for field in &fields {
        if !seen.insert(field.name().to_lowercase()) {
            return Err(SqlError::Schema {
                schema: text.to_owned(),
                position: text.find(field.name().as_str()).unwrap_or(0),
                reason: format!("column `{}` is declared twice", field.name()),
            });
        }
    }
    Ok(Arc::new(Schema::new(fields)))
}

#[derive(Clone, Debug)]
struct Token<'a> {
    text: &'a str,
    start: usize,
    /// A backquoted identifier: never a keyword.
    quoted: bool,
}

fn tokenize(text: &str) -> Result<Vec<Token<'_>>, SqlError> {
    let mut tokens = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'`' {
            let start = i + 1;
            let end =
                text[start..]
                    .find('`')
                    .map(|n| start + n)
                    .ok_or_else(|| SqlError::Schema {
                        schema: text.to_owned(),
                        position: i,
                        reason: "a backquoted name is not closed".to_owned(),
                    })?;
            tokens.push(Token {
                text: &text[start..end],
                start: i,
                quoted: true,
            });
            i = end + 1;
        } else if c == b'\'' {
            let start = i;
            let end =
                text[i + 1..]
                    .find('\'')
                    .map(|n| i + 1 + n)
                    .ok_or_else(|| SqlError::Schema {
                        schema: text.to_owned(),
                        position: i,
                        reason: "a quoted comment is not closed".to_owned(),
                    })?;
            tokens.push(Token {
                text: &text[start..=end],
                start,
                quoted: false,
            });
            i = end + 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            tokens.push(Token {
                text: &text[start..i],
                start,
                quoted: false,
            });
        } else if b"<>(),:".contains(&c) {
            tokens.push(Token {
                text: &text[i..=i],
                start: i,
                quoted: false,
            });
            i += 1;
        } else {
            let ch = text[i..].chars().next().unwrap_or('?');
            return Err(SqlError::Schema {
                schema: text.to_owned(),
                position: i,
                reason: format!("unexpected character `{ch}`"),
            });
        }
    }
    Ok(tokens)
}

struct Parser<'a> {
    text: &'a str,
    tokens: Vec<Token<'a>>,
    at: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<Token<'a>> {
        self.tokens.get(self.at).cloned()
    }

    fn next(&mut self) -> Option<Token<'a>> {
        let token = self.peek();
        self.at += 1;
        token
    }

    fn error(&self, position: usize, reason: String) -> SqlError {
        SqlError::Schema {
            schema: self.text.to_owned(),
            position,
            reason,
        }
    }

    fn end_position(&self) -> usize {
        self.text.len()
    }

    /// Whether the next token is `symbol` (or the keyword, case-insensitively);
    /// takes it if so.
    fn eat(&mut self, symbol: &str) -> bool {
        match self.peek() {
            Some(t) if !t.quoted && t.text.eq_ignore_ascii_case(symbol) => {
                self.at += 1;
                true
            }
            _ => false,
        }
    }

    fn expect(&mut self, symbol: &str, after: &str) -> Result<(), SqlError> {
        if self.eat(symbol) {
            return Ok(());
        }
        let (position, found) = match self.peek() {
            Some(t) => (t.start, format!("`{}`", t.text)),
            None => (self.end_position(), "the end".to_owned()),
        };
        Err(self.error(
            position,
            format!("expected `{symbol}` after {after}, found {found}"),
        ))
    }

    /// Columns up to the end, or up to `close` inside a `STRUCT<...>`, where a
    /// colon may follow each name.
    fn columns(&mut self, close: Option<&str>) -> Result<Vec<Field>, SqlError> {
        let mut fields = Vec::new();
        loop {
            if let Some(close) = close
                && self.peek().is_some_and(|t| t.text == close)
            {
                break;
            }
            let Some(name) = self.next() else {
                if fields.is_empty() && close.is_none() {
                    break;
                }
                return Err(self.error(self.end_position(), "expected a column name".into()));
            };
            if !name.quoted && !is_identifier(name.text) {
                return Err(self.error(
                    name.start,
                    format!("expected a column name, found `{}`", name.text),
                ));
            }
            if close.is_some() {
                self.eat(":");
            }
            let data_type = self.data_type(name.text)?;
            let mut nullable = true;
            if self.eat("NOT") {
                self.expect("NULL", "NOT")?;
                nullable = false;
            }
            if self.eat("COMMENT") {
                match self.next() {
                    Some(t) if t.text.starts_with('\'') => {}
                    Some(t) => {
                        return Err(self.error(
                            t.start,
                            format!(
                                "expected a quoted comment after COMMENT, found `{}`",
                                t.text
                            ),
                        ));
                    }
                    None => {
                        return Err(self.error(
                            self.end_position(),
                            "expected a quoted comment after COMMENT".into(),
                        ));
                    }
                }
            }
            fields.push(Field::new(name.text, data_type, nullable));
            if !self.eat(",") {
                break;
            }
        }
        Ok(fields)
    }

    fn data_type(&mut self, column: &str) -> Result<DataType, SqlError> {
        let Some(token) = self.next() else {
            return Err(self.error(
                self.end_position(),
                format!("expected a type after `{column}`"),
            ));
        };
        let name = token.text.to_ascii_uppercase();
        let data_type = match name.as_str() {
            "BOOLEAN" => DataType::Boolean,
            "TINYINT" | "BYTE" => DataType::Int8,
            "SMALLINT" | "SHORT" => DataType::Int16,
            "INT" | "INTEGER" => DataType::Int32,
            "BIGINT" | "LONG" => DataType::Int64,
            "FLOAT" | "REAL" => DataType::Float32,
            "DOUBLE" => DataType::Float64,
            "STRING" => DataType::Utf8,
            "VARCHAR" | "CHAR" => {
                self.expect("(", &name)?;
                self.number(&name)?;
                self.expect(")", "the length")?;
                DataType::Utf8
            }
            "BINARY" => DataType::Binary,
            "DATE" => DataType::Date32,
            "TIMESTAMP" | "TIMESTAMP_LTZ" => {
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
            }
            "TIMESTAMP_NTZ" => DataType::Timestamp(TimeUnit::Microsecond, None),
            "DECIMAL" | "DEC" | "NUMERIC" => {
                let (mut precision, mut scale) = (10_u64, 0_u64);
                if self.eat("(") {
                    precision = self.number("DECIMAL")?;
                    if self.eat(",") {
                        scale = self.number("the precision")?;
                    }
                    self.expect(")", "the precision and scale")?;
                }
                if !(1..=38).contains(&precision) || scale > precision {
                    return Err(self.error(
                        token.start,
                        format!(
                            "DECIMAL({precision}, {scale}) is not valid: the precision is 1 to 38 \
                             and the scale at most the precision"
                        ),
                    ));
                }
                DataType::Decimal128(precision as u8, scale as i8)
            }
            "ARRAY" => {
                self.expect("<", "ARRAY")?;
                let item = self.data_type("ARRAY<")?;
                self.expect(">", "the element type")?;
                DataType::List(Arc::new(Field::new("item", item, true)))
            }
            "MAP" => {
                self.expect("<", "MAP")?;
                let key = self.data_type("MAP<")?;
                self.expect(",", "the key type")?;
                let value = self.data_type("the key type")?;
                self.expect(">", "the value type")?;
                let entries = Field::new(
                    "entries",
                    DataType::Struct(Fields::from(vec![
                        Field::new("key", key, false),
                        Field::new("value", value, true),
                    ])),
                    false,
                );
                DataType::Map(Arc::new(entries), false)
            }
            "STRUCT" => {
                self.expect("<", "STRUCT")?;
                let fields = self.columns(Some(">"))?;
                self.expect(">", "the fields")?;
                DataType::Struct(Fields::from(fields))
            }
            _ => {
                let suggestion = TYPE_NAMES
                    .iter()
                    .map(|t| (strsim::jaro_winkler(&name, t), t))
                    .filter(|(score, _)| *score > 0.8)
                    .max_by(|a, b| a.0.total_cmp(&b.0))
                    .map(|(_, t)| format!("; did you mean `{t}`?"))
                    .unwrap_or_default();
                return Err(self.error(
                    token.start,
                    format!(
                        "`{}` is not a type (column `{column}`){suggestion}",
                        token.text
                    ),
                ));
            }
        };
        Ok(data_type)
    }

    fn number(&mut self, after: &str) -> Result<u64, SqlError> {
        match self.next() {
            Some(t) => t.text.parse().map_err(|_| {
                self.error(
                    t.start,
                    format!("expected a number after {after}, found `{}`", t.text),
                )
            }),
            None => Err(self.error(
                self.end_position(),
                format!("expected a number after {after}"),
            )),
        }
    }
}

fn is_identifier(text: &str) -> bool {
    text.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// A column type as Spark's DDL names it, for messages; Arrow's name for a
/// type the DDL has no word for.
pub(crate) fn sql_type(data_type: &DataType) -> String {
    match data_type {
        DataType::Boolean => "BOOLEAN".to_owned(),
        DataType::Int8 => "TINYINT".to_owned(),
        DataType::Int16 => "SMALLINT".to_owned(),
        DataType::Int32 => "INT".to_owned(),
        DataType::Int64 => "BIGINT".to_owned(),
        DataType::Float32 => "FLOAT".to_owned(),
        DataType::Float64 => "DOUBLE".to_owned(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "STRING".to_owned(),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => "BINARY".to_owned(),
        DataType::Date32 => "DATE".to_owned(),
        DataType::Timestamp(_, Some(_)) => "TIMESTAMP".to_owned(),
        DataType::Timestamp(_, None) => "TIMESTAMP_NTZ".to_owned(),
        DataType::Decimal128(p, s) => format!("DECIMAL({p}, {s})"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sparks_types() {
        let schema = parse_ddl(
            "`order` BIGINT NOT NULL, customer STRING COMMENT 'who', amount DOUBLE, ts TIMESTAMP, \
             tags ARRAY<STRING>, attrs MAP<STRING, INT>, address STRUCT<city: STRING, zip INT>, \
             price DECIMAL(10,2), day DATE, raw BINARY, flag BOOLEAN, small TINYINT, code VARCHAR(3)",
        )
        .unwrap();
        let types: Vec<String> = schema
            .fields()
            .iter()
            .map(|f| format!("{}:{}", f.name(), f.data_type()))
            .collect();
        assert_eq!(schema.field(0).name(), "order");
        assert!(!schema.field(0).is_nullable());
        assert_eq!(
            schema.field(3).data_type(),
            &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
        );
        assert_eq!(schema.field(7).data_type(), &DataType::Decimal128(10, 2));
        assert!(matches!(schema.field(6).data_type(), DataType::Struct(f) if f.len() == 2));
        assert!(matches!(
            schema.field(5).data_type(),
            DataType::Map(_, false)
        ));
        assert_eq!(types.len(), 13);
    }

    #[test]
    fn bad_schemas_name_the_place_and_the_reason() {
        let cases = [
            (
                "order BIGINT, amount DOUBEL",
                "`DOUBEL` is not a type (column `amount`); did you mean `DOUBLE`?",
            ),
            ("order BIGINT,", "expected a column name"),
            ("order", "expected a type after `order`"),
            (
                "a ARRAY<INT",
                "expected `>` after the element type, found the end",
            ),
            ("a DECIMAL(40, 2)", "DECIMAL(40, 2) is not valid"),
            ("a INT, A STRING", "column `A` is declared twice"),
            ("a INT; b INT", "unexpected character `;`"),
            ("", "it declares no column"),
            ("a INT b", "unexpected `b`"),
        ];
        for (text, expected) in cases {
            let err = parse_ddl(text).unwrap_err().to_string();
            assert!(err.contains(expected), "{text:?}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }
}
