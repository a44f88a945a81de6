//! The common JSON value decoded in one pass: a flat object whose declared
//! columns are strings, integers, floats, booleans or timestamps.
//!
//! arrow's JSON reader first writes every value onto a tape and then walks the
//! tape once per column; on small values (about 100 bytes) that is most of a
//! query's CPU. This decoder reads each value once, straight into the columns.
//! It is a fast path only: it declines a value at the first thing it does not
//! read exactly as arrow's reader does (an escaped key, a number in a string,
//! `1.0` for an integer, a duplicate key, a missing `NOT NULL` column, anything
//! malformed), and that value is decoded by arrow's reader alone, which also
//! names what is wrong ([`crate::decode`]). So every row it makes is the row
//! arrow's reader would make; the unit tests and the `json_values` fuzz target
//! compare the two.

use std::sync::Arc;

use arrow::array::timezone::Tz;
use arrow::array::{
    ArrayRef, BooleanArray, Float32Array, Float64Array, Int64Array, PrimitiveArray, RecordBatch,
    StringArray,
};
use arrow::buffer::{BooleanBuffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow::compute::kernels::cast_utils::string_to_datetime;
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Int8Type, Int16Type, Int32Type, SchemaRef, TimeUnit,
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType,
    TimestampSecondType,
};

/// Nested values deeper than this in an undeclared field are left to arrow.
const MAX_DEPTH: u32 = 64;

/// A declared column's type, as this decoder reads it.
#[derive(Clone, Debug)]
enum Kind {
    Utf8,
    /// A signed integer of the given bounds.
    Int {
        min: i64,
        max: i64,
    },
    Float32,
    Float64,
    Boolean,
    Timestamp(TimeUnit, Zone),
}

/// Decodes runs of flat JSON objects into a schema's columns, or declines.
#[derive(Debug)]
pub(crate) struct FlatJson {
    schema: SchemaRef,
    kinds: Vec<Kind>,
    names: Vec<Box<[u8]>>,
    required: u64,
}

impl FlatJson {
    /// A decoder for `schema`, if every column is of a type it reads.
    pub(crate) fn new(schema: &SchemaRef) -> Option<FlatJson> {
        let fields = schema.fields();
        if fields.is_empty() || fields.len() > 64 {
            return None;
        }
        let mut kinds = Vec::with_capacity(fields.len());
        let mut required = 0_u64;
        for (index, field) in fields.iter().enumerate() {
            let kind = match field.data_type() {
                DataType::Utf8 => Kind::Utf8,
                DataType::Int8 => Kind::Int {
                    min: i8::MIN.into(),
                    max: i8::MAX.into(),
                },
                DataType::Int16 => Kind::Int {
                    min: i16::MIN.into(),
                    max: i16::MAX.into(),
                },
                DataType::Int32 => Kind::Int {
                    min: i32::MIN.into(),
                    max: i32::MAX.into(),
                },
                DataType::Int64 => Kind::Int {
                    min: i64::MIN,
                    max: i64::MAX,
                },
                DataType::Float32 => Kind::Float32,
                DataType::Float64 => Kind::Float64,
                DataType::Boolean => Kind::Boolean,
                DataType::Timestamp(unit, tz) => {
                    // The zone arrow's reader reads strings in: UTC without one.
                    let name = tz.as_deref().unwrap_or("+00:00");
                    let zone = Zone {
                        tz: name.parse::<Tz>().ok()?,
                        naive_is_utc: matches!(name, "UTC" | "+00:00"),
                    };
                    Kind::Timestamp(*unit, zone)
                }
                _ => return None,
            };
            kinds.push(kind);
            if !field.is_nullable() {
                required |= 1 << index;
            }
        }
        Some(FlatJson {
            schema: schema.clone(),
            kinds,
            names: fields
                .iter()
                .map(|f| f.name().as_bytes().to_vec().into_boxed_slice())
                .collect(),
            required,
        })
    }

    /// The rows of the values up to the first one this decoder does not read
    /// exactly as arrow's reader does, one row each, and how many values that
    /// is: all of them, or the index of the one it declined.
    pub(crate) fn decode<'v>(
        &self,
        values: impl ExactSizeIterator<Item = &'v [u8]>,
    ) -> (Option<RecordBatch>, usize) {
        let capacity = values.len();
        let mut columns: Vec<Column> = self
            .kinds
            .iter()
            .map(|k| Column::new(k, capacity))
            .collect();
        let mut rows = 0;
        for value in values {
            if self.row(value, &mut columns).is_none() {
                // Undone, so that every column holds the rows before it.
                columns.iter_mut().for_each(|c| c.truncate(rows));
                break;
            }
            rows += 1;
        }
        if rows == 0 {
            return (None, 0);
        }
        let batch = columns
            .into_iter()
            .zip(&self.kinds)
            .zip(self.schema.fields())
            .map(|((column, kind), field)| column.finish(kind, field.data_type()))
            .collect::<Option<Vec<ArrayRef>>>()
            .and_then(|arrays| RecordBatch::try_new(self.schema.clone(), arrays).ok());
        match batch {
            Some(batch) => (Some(batch), rows),
            None => (None, 0),
        }
    }

    fn row(&self, value: &[u8], columns: &mut [Column]) -> Option<()> {
        // arrow's reader refuses a value whose strings are not UTF-8; most
        // values are ASCII, which is quicker to tell.
        if !value.is_ascii() {
            std::str::from_utf8(value).ok()?;
        }
        let mut p = Cursor {
            bytes: value,
            at: 0,
        };
        p.space();
        p.eat(b'{')?;
        p.space();
        let mut seen = 0_u64;
        let mut hint = 0;
        if p.peek() == Some(b'}') {
            p.at += 1;
        } else {
            loop {
                p.eat(b'"')?;
                let key = p.plain_string()?;
                p.space();
                p.eat(b':')?;
                p.space();
                match self.field(key, hint) {
                    Some(index) => {
                        let bit = 1 << index;
                        if seen & bit != 0 {
                            return None;
                        }
                        seen |= bit;
                        hint = index + 1;
                        columns[index].push(&self.kinds[index], &mut p)?;
                    }
                    None => p.skip_value(0)?,
                }
                p.space();
                match p.next()? {
                    b',' => p.space(),
                    b'}' => break,
                    _ => return None,
                }
            }
        }
        p.space();
        if p.at != value.len() || self.required & !seen != 0 {
            return None;
        }
        if seen.count_ones() as usize != columns.len() {
            for (index, column) in columns.iter_mut().enumerate() {
                if seen & (1 << index) == 0 {
                    column.push_null();
                }
            }
        }
        Some(())
    }

    /// The declared column named `key`, looked for first where the last one's
    /// successor is, as producers mostly write a schema's fields in order.
    fn field(&self, key: &[u8], hint: usize) -> Option<usize> {
        if self.names.get(hint).is_some_and(|n| same(n, key)) {
            return Some(hint);
        }
        self.names.iter().position(|n| same(n, key))
    }
}

/// Whether two short byte strings are equal, without the call `==` makes to
/// `memcmp`, which costs more than the comparison for a column's name.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// A column being built: one value per row, and whether it is valid.
struct Column {
    values: Values,
    valid: Vec<bool>,
}

/// A column's values; a null row's is a placeholder.
enum Values {
    Utf8 { offsets: Vec<i32>, data: Vec<u8> },
    Int(Vec<i64>),
    Float32(Vec<f32>),
    Float64(Vec<f64>),
    Boolean(Vec<bool>),
}

impl Column {
    fn new(kind: &Kind, rows: usize) -> Column {
        let values = match kind {
            Kind::Utf8 => {
                let mut offsets = Vec::with_capacity(rows + 1);
                offsets.push(0);
                Values::Utf8 {
                    offsets,
                    data: Vec::with_capacity(rows * 8),
                }
            }
            Kind::Int { .. } | Kind::Timestamp(..) => Values::Int(Vec::with_capacity(rows)),
            Kind::Float32 => Values::Float32(Vec::with_capacity(rows)),
            Kind::Float64 => Values::Float64(Vec::with_capacity(rows)),
            Kind::Boolean => Values::Boolean(Vec::with_capacity(rows)),
        };
        Column {
            values,
            valid: Vec::with_capacity(rows),
        }
    }

    /// Keeps the first `rows` rows.
    fn truncate(&mut self, rows: usize) {
        self.valid.truncate(rows);
        match &mut self.values {
            Values::Utf8 { offsets, data } => {
                offsets.truncate(rows + 1);
                data.truncate(offsets[rows] as usize);
            }
            Values::Int(v) => v.truncate(rows),
            Values::Float32(v) => v.truncate(rows),
            Values::Float64(v) => v.truncate(rows),
            Values::Boolean(v) => v.truncate(rows),
        }
    }

    fn push_null(&mut self) {
        self.valid.push(false);
        match &mut self.values {
            Values::Utf8 { offsets, data } => offsets.push(data.len() as i32),
            Values::Int(v) => v.push(0),
            Values::Float32(v) => v.push(0.0),
            Values::Float64(v) => v.push(0.0),
            Values::Boolean(v) => v.push(false),
        }
    }

    /// Reads the value at `p` into the column.
    fn push(&mut self, kind: &Kind, p: &mut Cursor<'_>) -> Option<()> {
        if p.peek()? == b'n' {
            p.literal(b"null")?;
            self.push_null();
            return Some(());
        }
        match (&mut self.values, kind) {
            (Values::Utf8 { offsets, data }, Kind::Utf8) => {
                p.eat(b'"')?;
                p.string(Some(data))?;
                offsets.push(i32::try_from(data.len()).ok()?);
            }
            (Values::Int(v), Kind::Int { min, max }) => {
                let n = p.integer()?;
                if n < *min || n > *max {
                    return None;
                }
                v.push(n);
            }
            (Values::Int(v), Kind::Timestamp(unit, tz)) => {
                let n = if p.peek()? == b'"' {
                    p.at += 1;
                    let text = std::str::from_utf8(p.plain_string()?).ok()?;
                    timestamp(text, *unit, tz)?
                } else {
                    p.integer()?
                };
                v.push(n);
            }
            (Values::Float32(v), Kind::Float32) => v.push(p.float::<f32>()?),
            (Values::Float64(v), Kind::Float64) => v.push(p.float::<f64>()?),
            (Values::Boolean(v), Kind::Boolean) => {
                let b = match p.peek()? {
                    b't' => p.literal(b"true").map(|()| true)?,
                    b'f' => p.literal(b"false").map(|()| false)?,
                    _ => return None,
                };
                v.push(b);
            }
            _ => return None,
        }
        self.valid.push(true);
        Some(())
    }

    fn finish(self, kind: &Kind, data_type: &DataType) -> Option<ArrayRef> {
        let nulls = if self.valid.iter().all(|v| *v) {
            None
        } else {
            Some(NullBuffer::from(self.valid))
        };
        fn ints<T: ArrowPrimitiveType>(
            v: Vec<i64>,
            nulls: Option<NullBuffer>,
            cast: impl Fn(i64) -> T::Native,
        ) -> ArrayRef {
            Arc::new(PrimitiveArray::<T>::new(
                v.into_iter().map(cast).collect(),
                nulls,
            ))
        }
        Some(match (self.values, kind) {
            (Values::Utf8 { offsets, data }, _) => {
                let offsets = OffsetBuffer::new(ScalarBuffer::from(offsets));
                // Every string was checked to be UTF-8 as it was read.
                Arc::new(StringArray::try_new(offsets, data.into(), nulls).ok()?)
            }
            (Values::Int(v), Kind::Int { max, .. }) => match *max {
                // Each value was checked against the type's bounds as it was read.
                m if m == i8::MAX as i64 => ints::<Int8Type>(v, nulls, |n| n as i8),
                m if m == i16::MAX as i64 => ints::<Int16Type>(v, nulls, |n| n as i16),
                m if m == i32::MAX as i64 => ints::<Int32Type>(v, nulls, |n| n as i32),
                _ => Arc::new(Int64Array::new(v.into(), nulls)),
            },
            (Values::Int(v), Kind::Timestamp(..)) => timestamp_array(v, nulls, data_type),
            (Values::Float32(v), _) => Arc::new(Float32Array::new(v.into(), nulls)),
            (Values::Float64(v), _) => Arc::new(Float64Array::new(v.into(), nulls)),
            (Values::Boolean(v), _) => Arc::new(BooleanArray::new(BooleanBuffer::from(v), nulls)),
            _ => return None,
        })
    }
}

/// A timestamp column of `data_type`, its zone included.
fn timestamp_array(v: Vec<i64>, nulls: Option<NullBuffer>, data_type: &DataType) -> ArrayRef {
    fn of<T: ArrowPrimitiveType<Native = i64>>(
        v: Vec<i64>,
        nulls: Option<NullBuffer>,
        data_type: &DataType,
    ) -> ArrayRef {
        Arc::new(PrimitiveArray::<T>::new(v.into(), nulls).with_data_type(data_type.clone()))
    }
    match data_type {
        DataType::Timestamp(TimeUnit::Second, _) => of::<TimestampSecondType>(v, nulls, data_type),
        DataType::Timestamp(TimeUnit::Millisecond, _) => {
            of::<TimestampMillisecondType>(v, nulls, data_type)
        }
        DataType::Timestamp(TimeUnit::Microsecond, _) => {
            of::<TimestampMicrosecondType>(v, nulls, data_type)
        }
        _ => of::<TimestampNanosecondType>(v, nulls, data_type),
    }
}

/// A timestamp string read as arrow's reader reads it, in the column's zone.
fn timestamp(text: &str, unit: TimeUnit, zone: &Zone) -> Option<i64> {
    let (seconds, nanos) = match rfc3339(text.as_bytes(), zone.naive_is_utc) {
        Some(instant) => instant,
        None => {
            let date = string_to_datetime(&zone.tz, text).ok()?;
            (date.timestamp(), date.timestamp_subsec_nanos())
        }
    };
    // As chrono counts each unit: whole seconds, then the part of one; wide,
    // so that the earliest nanosecond (i64::MIN) is not an overflow.
    let (seconds, nanos) = (i128::from(seconds), i128::from(nanos));
    let value = match unit {
        TimeUnit::Second => seconds,
        TimeUnit::Millisecond => seconds * 1_000 + nanos / 1_000_000,
        TimeUnit::Microsecond => seconds * 1_000_000 + nanos / 1_000,
        TimeUnit::Nanosecond => seconds * 1_000_000_000 + nanos,
    };
    i64::try_from(value).ok()
}

/// The seconds since the epoch and the nanoseconds past them of the commonest
/// timestamp texts, `2026-12-07T10:00:00.123456Z` with `T`, `t` or a space,
/// up to nine digits of fraction, and `Z`, `z`, `+HH:MM`, `-HH:MM`, or nothing
/// when the column's zone is UTC; `None` for anything else, which
/// `string_to_datetime` then reads, about five times slower.
fn rfc3339(b: &[u8], naive_is_utc: bool) -> Option<(i64, u32)> {
    if b.len() < 19 {
        return None;
    }
    let digit = |i: usize| {
        let d = b[i].wrapping_sub(b'0');
        (d < 10).then_some(u32::from(d))
    };
    let two = |i: usize| Some(digit(i)? * 10 + digit(i + 1)?);
    let year = two(0)? * 100 + two(2)?;
    if b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (month, day) = (two(5)?, two(8)?);
    let (hour, minute, second) = (two(11)?, two(14)?, two(17)?);
    if !(1..=12).contains(&month)
        || day == 0
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 59
    {
        return None;
    }
    let mut at = 19;
    let mut nanos = 0;
    if b.get(at) == Some(&b'.') {
        at += 1;
        let start = at;
        while let Some(d) = b.get(at).and_then(|_| digit(at)) {
            if at - start == 9 {
                return None;
            }
            nanos = nanos * 10 + d;
            at += 1;
        }
        if at == start {
            return None;
        }
        nanos *= 10_u32.pow((9 - (at - start)) as u32);
    }
    let offset = match &b[at..] {
        [] if naive_is_utc => 0,
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), _, _, b':', _, _] => {
            let (hours, minutes) = (two(at + 1)?, two(at + 4)?);
            if hours > 23 || minutes > 59 {
                return None;
            }
            let offset = i64::from(hours * 3_600 + minutes * 60);
            if *sign == b'-' { -offset } else { offset }
        }
        _ => return None,
    };
    let days = days_from_civil(i64::from(year), month, day);
    let seconds = days * 86_400 + i64::from(hour * 3_600 + minute * 60 + second) - offset;
    Some((seconds, nanos))
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (Howard
/// Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * i64::from((month + 9) % 12) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// A timestamp column's zone, in which texts without an offset are read.
#[derive(Clone, Debug)]
struct Zone {
    tz: Tz,
    naive_is_utc: bool,
}

/// A position in one value's bytes.
struct Cursor<'v> {
    bytes: &'v [u8],
    at: usize,
}

impl<'v> Cursor<'v> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    fn space(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.bytes.get(self.at..end)? == word).then(|| self.at = end)
    }

    /// The rest of a string without escapes, its opening quote read.
    fn plain_string(&mut self) -> Option<&'v [u8]> {
        let start = self.at;
        let rest = &self.bytes[start..];
        let len = memchr::memchr2(b'"', b'\\', rest)?;
        if rest[len] != b'"' {
            return None;
        }
        self.at += len + 1;
        Some(&rest[..len])
    }

    /// The rest of a string, its opening quote read, unescaped into `out`, or
    /// only checked without one.
    fn string(&mut self, mut out: Option<&mut Vec<u8>>) -> Option<()> {
        loop {
            let rest = &self.bytes[self.at..];
            let len = memchr::memchr2(b'"', b'\\', rest)?;
            if let Some(out) = out.as_deref_mut() {
                out.extend_from_slice(&rest[..len]);
            }
            self.at += len + 1;
            if rest[len] == b'"' {
                return Some(());
            }
            let c = match self.next()? {
                b'"' => '"',
                b'\\' => '\\',
                b'/' => '/',
                b'b' => '\u{8}',
                b'f' => '\u{c}',
                b'n' => '\n',
                b'r' => '\r',
                b't' => '\t',
                b'u' => {
                    let high = self.hex4()?;
                    match char::from_u32(high.into()) {
                        Some(c) => c,
                        None => {
                            // A surrogate: arrow's reader wants its pair next.
                            self.literal(b"\\u")?;
                            let low = self.hex4()?;
                            if !(0xD800..=0xDBFF).contains(&high)
                                || !(0xDC00..=0xDFFF).contains(&low)
                            {
                                return None;
                            }
                            let n = (u32::from(high - 0xD800) << 10) + u32::from(low - 0xDC00);
                            char::from_u32(n + 0x1_0000)?
                        }
                    }
                }
                _ => return None,
            };
            if let Some(out) = out.as_deref_mut() {
                let mut buf = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }

    fn hex4(&mut self) -> Option<u16> {
        let digits = self.bytes.get(self.at..self.at + 4)?;
        let mut n = 0_u16;
        for d in digits {
            n = (n << 4) | char::from(*d).to_digit(16)? as u16;
        }
        self.at += 4;
        Some(n)
    }

    /// A JSON number with neither fraction nor exponent, in `i64`.
    fn integer(&mut self) -> Option<i64> {
        let negative = self.peek()? == b'-';
        if negative {
            self.at += 1;
        }
        let start = self.at;
        let mut n: i64 = 0;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            let d = i64::from(d - b'0');
            // Built negative, so that i64::MIN fits.
            n = n.checked_mul(10)?.checked_sub(d)?;
            self.at += 1;
        }
        let digits = self.at - start;
        if digits == 0 || (digits > 1 && self.bytes[start] == b'0') {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.peek() {
            return None;
        }
        if negative { Some(n) } else { n.checked_neg() }
    }

    /// The extent of a JSON number, by its grammar.
    fn number(&mut self) -> Option<&'v [u8]> {
        let start = self.at;
        if self.peek()? == b'-' {
            self.at += 1;
        }
        match self.next()? {
            b'0' => {}
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.at += 1;
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.some_digits()?;
        }
        Some(&self.bytes[start..self.at])
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.at;
        self.digits();
        (self.at > start).then_some(())
    }

    /// A JSON number read as a float. A valid JSON number is valid for Rust's
    /// parser, and both it and arrow's round correctly, so they agree.
    fn float<F: std::str::FromStr>(&mut self) -> Option<F> {
        let text = self.number()?;
        std::str::from_utf8(text).ok()?.parse().ok()
    }

    /// Steps over any JSON value, checking it as arrow's reader would.
    fn skip_value(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => {
                self.at += 1;
                self.string(None)
            }
            b'{' => {
                self.at += 1;
                self.space();
                if self.peek()? == b'}' {
                    self.at += 1;
                    return Some(());
                }
                loop {
                    self.eat(b'"')?;
                    self.string(None)?;
                    self.space();
                    self.eat(b':')?;
                    self.space();
                    self.skip_value(depth + 1)?;
                    self.space();
                    match self.next()? {
                        b',' => self.space(),
                        b'}' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.at += 1;
                self.space();
                if self.peek()? == b']' {
                    self.at += 1;
                    return Some(());
                }
                loop {
                    self.skip_value(depth + 1)?;
                    self.space();
                    match self.next()? {
                        b',' => self.space(),
                        b']' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number().map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::AsArray;
    use proptest::prelude::*;
    use sluice_core::{Offset, Record, RecordChunk, TimestampType};

    use super::*;
    use crate::{Decoder, Format, parse_ddl};

    const SCHEMA: &str = "s STRING, i BIGINT, n INT, t TINYINT, f DOUBLE, r FLOAT, b BOOLEAN, \
                          ts TIMESTAMP, nt TIMESTAMP_NTZ";

    fn chunk(values: &[&[u8]]) -> RecordChunk {
        let mut chunk = RecordChunk::default();
        for (i, value) in values.iter().enumerate() {
            chunk.push_record(&Record {
                topic: Arc::from("events"),
                partition: 0,
                offset: Offset::new(i as i64).unwrap(),
                timestamp_ms: Some(1_700_000_000_000),
                timestamp_type: TimestampType::CreateTime,
                key: None,
                value: Some(value.to_vec()),
                headers: Vec::new(),
            });
        }
        chunk
    }

    /// Whether the one-pass decoder reads `values` itself, and, either way,
    /// that the table's rows and bad records are those of arrow's reader.
    fn same_as_arrow(ddl: &str, values: &[&[u8]]) -> bool {
        let schema = parse_ddl(ddl).unwrap();
        let flat = FlatJson::new(&schema).expect("a schema the decoder reads");
        let read = flat.decode(values.iter().copied()).1 == values.len();
        let chunk = chunk(values);
        let fast = Decoder::new(Format::Json(schema.clone()), false);
        let arrow = Decoder::new(Format::Json(schema), false).arrow_json_only();
        let (fast, arrow) = (fast.decode(&chunk).unwrap(), arrow.decode(&chunk).unwrap());
        assert_eq!(fast.batch, arrow.batch, "{values:?}");
        assert_eq!(
            fast.bad
                .iter()
                .map(|b| (b.index, &b.reason))
                .collect::<Vec<_>>(),
            arrow
                .bad
                .iter()
                .map(|b| (b.index, &b.reason))
                .collect::<Vec<_>>(),
            "{values:?}"
        );
        read
    }

    #[test]
    fn common_values_are_read_in_one_pass_as_arrow_reads_them() {
        let values: &[&[u8]] = &[
            br#"{"s":"a","i":1,"n":-2,"t":127,"f":1.5,"r":-0.25,"b":true,"ts":"2026-12-07T10:00:00Z","nt":"2026-12-07 10:00:00.123"}"#,
            br#" { "ts" : 1700000000000000 , "s" : "\"q\\u00e9\n\ud83d\ude00/" , "extra" : [1, {"x": [true, null, "y"]}, -3e-2] } "#,
            br#"{}"#,
            br#"{"s":"\"\\\/\b\f\n\r\t\u0000\u00e9\u20ac\ud83d\ude00","t":0}"#,
            br#"{"s":null,"i":null,"f":2,"b":false,"ts":null,"other":"\t"}"#,
            br#"{"i":-9223372036854775808,"f":1e308,"r":3.4028235e38,"ts":"2026-12-07T10:00:00+02:00"}"#,
            br#"{"i":9223372036854775807,"n":-2147483648,"t":-128,"f":-0,"r":0.1}"#,
            "{\"s\":\"raw control \u{1} and \u{e9} bytes\"}".as_bytes(),
        ];
        assert!(same_as_arrow(SCHEMA, values));
        for value in values {
            assert!(same_as_arrow(SCHEMA, &[value]), "{value:?}");
        }
        assert!(same_as_arrow(
            "id STRING NOT NULL, x BIGINT",
            &[br#"{"id":"a"}"#]
        ));
    }

    #[test]
    fn what_arrow_reads_otherwise_or_refuses_is_left_to_arrow() {
        let declined: &[&[u8]] = &[
            // Read by arrow, differently than a plain number or string.
            br#"{"i":"12"}"#,
            br#"{"i":1.0}"#,
            br#"{"i":1e3}"#,
            br#"{"i":01}"#,
            br#"{"n":2147483648}"#,
            br#"{"t":128}"#,
            br#"{"i":9223372036854775808}"#,
            br#"{"f":"1.5"}"#,
            br#"{"ts":1.5}"#,
            br#"{"\u0073":"escaped key"}"#,
            br#"{"ts":"2026-12-07T10:00:00\u005a"}"#,
            br#"{"s":"a","s":"b"}"#,
            // Refused by arrow.
            br#"{"s":1}"#,
            br#"{"b":"true"}"#,
            br#"{"ts":"yesterday"}"#,
            br#"{"s":"\ud83d"}"#,
            br#"{"s":"\x"}"#,
            br#"{"x":[1,}"#,
            br#"{"x":tru}"#,
            br#"{"x":.5}"#,
            br#"{"s":"a"} {"s":"b"}"#,
            br#"{"s":"a"}x"#,
            br#"{"s":"a""#,
            br#"[1]"#,
            br#"null"#,
            b"",
            b"{\"s\":\"\xff\"}",
        ];
        for value in declined {
            assert!(!same_as_arrow(SCHEMA, &[value]), "{value:?}");
            // A run holding it is read by arrow as a whole, rows in order.
            assert!(!same_as_arrow(
                SCHEMA,
                &[br#"{"i":1}"#, value, br#"{"i":2}"#]
            ));
        }
        assert!(!same_as_arrow(
            "id STRING NOT NULL, x BIGINT",
            &[br#"{"x":1}"#]
        ));
        assert!(!same_as_arrow("id STRING NOT NULL", &[br#"{"id":null}"#]));
    }

    #[test]
    fn escaped_pairs_of_every_plane_make_their_characters() {
        // U+1F600, U+23600 and U+10FFFF: arrow's reader alone makes U+13600 of
        // the second; both decoders make each character, as its UTF-8 does.
        let escaped: &[u8] = br#"{"s":"\ud83d\ude00 \ud84d\ude00 \udbff\udfff \\ud84d\\ude00"}"#;
        let literal = "{\"s\":\"\u{1F600} \u{23600} \u{10FFFF} \\\\ud84d\\\\ude00\"}";
        assert!(same_as_arrow(SCHEMA, &[escaped]));
        let schema = parse_ddl(SCHEMA).unwrap();
        let rows = |value: &[u8]| {
            let decoded = Decoder::new(Format::Json(schema.clone()), false)
                .arrow_json_only()
                .decode(&chunk(&[value]))
                .unwrap();
            decoded
                .batch
                .column(0)
                .as_string::<i32>()
                .value(0)
                .to_owned()
        };
        assert_eq!(
            rows(escaped),
            "\u{1F600} \u{23600} \u{10FFFF} \\ud84d\\ude00"
        );
        assert_eq!(rows(escaped), rows(literal.as_bytes()));
        // A value declined for another reason is read the same by arrow's reader.
        let declined: &[u8] = br#"{"s":"\ud84d\ude00","i":"1"}"#;
        assert!(!same_as_arrow(SCHEMA, &[declined]));
        assert_eq!(rows(declined), "\u{23600}");
    }

    #[test]
    fn schemas_with_other_types_are_left_to_arrow() {
        for ddl in [
            "a DATE",
            "a DECIMAL(10,2)",
            "a ARRAY<INT>",
            "a BINARY",
            "a STRUCT<b: INT>",
        ] {
            assert!(FlatJson::new(&parse_ddl(ddl).unwrap()).is_none(), "{ddl}");
        }
    }

    /// Pieces of JSON values, well formed or nearly so.
    fn piece() -> impl Strategy<Value = String> {
        let key = prop_oneof![
            Just("s"),
            Just("i"),
            Just("n"),
            Just("t"),
            Just("f"),
            Just("r"),
            Just("b"),
            Just("ts"),
            Just("nt"),
            Just("other"),
            Just("\\u0069"),
        ];
        let scalar = prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            (-300_i64..300).prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|f| format!("{f:e}")),
            any::<f32>().prop_map(|f| f.to_string()),
            Just("-0".to_owned()),
            Just("01".to_owned()),
            Just("1.".to_owned()),
            Just("2.50".to_owned()),
            Just("true".to_owned()),
            Just("false".to_owned()),
            Just("null".to_owned()),
            Just("nul".to_owned()),
            "[a-z\u{e9}\u{1F600} ]{0,8}".prop_map(|s| format!("\"{s}\"")),
            Just(r#""\n\"\\\/\b\f\r\t\u00e9\ud83d\ude00""#.to_owned()),
            Just(r#""\ud83d""#.to_owned()),
            Just(r#""\udc00\ud83d""#.to_owned()),
            Just(r#""2026-12-07T10:00:00Z""#.to_owned()),
            Just(r#""2026-12-07 10:00:00.123456""#.to_owned()),
            Just(r#""2026-12-07T10:00:00-05:30""#.to_owned()),
            Just(r#""2026-12-07""#.to_owned()),
            Just(r#""2026-13-07T10:00:00Z""#.to_owned()),
            Just(r#""12""#.to_owned()),
            Just(r#"[1, "a", {"b": null}]"#.to_owned()),
            Just(r#"{"nested": {"x": [[]]}}"#.to_owned()),
        ];
        let space = prop_oneof![Just(""), Just(" "), Just("\n\t ")];
        (key, space.clone(), scalar, space)
            .prop_map(|(k, a, v, b)| format!("{a}\"{k}\"{b}:{a}{v}{b}"))
    }

    fn value() -> impl Strategy<Value = Vec<u8>> {
        (
            prop::collection::vec(piece(), 0..6),
            any::<bool>(),
            any::<Option<(prop::sample::Index, u8)>>(),
        )
            .prop_map(|(pieces, trailing, damage)| {
                let mut value = format!("{{{}}}", pieces.join(",")).into_bytes();
                if trailing {
                    value.extend_from_slice(b" \n");
                }
                if let Some((at, byte)) = damage {
                    let at = at.index(value.len());
                    match byte % 3 {
                        0 => value.truncate(at),
                        1 => value[at] = byte,
                        _ => value.insert(at, byte),
                    }
                }
                value
            })
    }

    /// A timestamp text's value as arrow's JSON reader computes it.
    fn arrow_timestamp(text: &str, unit: TimeUnit, tz: &Tz) -> Option<i64> {
        let date = string_to_datetime(tz, text).ok()?;
        match unit {
            TimeUnit::Second => Some(date.timestamp()),
            TimeUnit::Millisecond => Some(date.timestamp_millis()),
            TimeUnit::Microsecond => Some(date.timestamp_micros()),
            TimeUnit::Nanosecond => date.timestamp_nanos_opt(),
        }
    }

    fn timestamp_text() -> impl Strategy<Value = String> {
        (
            (0_u32..10_000, 0_u32..14, 0_u32..33),
            (0_u32..25, 0_u32..61, 0_u32..62),
            prop::sample::select(vec!["T", "t", " ", "x"]),
            "[0-9]{0,11}",
            prop::sample::select(vec![
                "", "Z", "z", "+", "-", "+05:30", "-08:00", "+00:00", "+24:00", "+0530", " +01:00",
                "UTC",
            ]),
            any::<bool>(),
        )
            .prop_map(|((y, mo, d), (h, mi, s), sep, fraction, zone, dot)| {
                let dot = if dot || !fraction.is_empty() { "." } else { "" };
                format!("{y:04}-{mo:02}-{d:02}{sep}{h:02}:{mi:02}:{s:02}{dot}{fraction}{zone}")
            })
    }

    #[test]
    fn timestamp_texts_are_read_as_arrow_reads_them() {
        let utc: Tz = "+00:00".parse().unwrap();
        for text in [
            "2026-12-07T10:00:00Z",
            "1970-01-01T00:00:00.000000001Z",
            "1969-12-31T23:59:59.999999999Z",
            "0000-03-01 00:00:00",
            "9999-12-31t23:59:59.5-23:59",
            "2024-02-29T12:00:00+05:30",
            "1677-09-21T00:12:43.145224192Z",
            "2262-04-11T23:47:16.854775807Z",
        ] {
            assert!(rfc3339(text.as_bytes(), true).is_some(), "{text}");
            for unit in [
                TimeUnit::Second,
                TimeUnit::Millisecond,
                TimeUnit::Microsecond,
                TimeUnit::Nanosecond,
            ] {
                let zone = Zone {
                    tz: utc,
                    naive_is_utc: true,
                };
                assert_eq!(
                    timestamp(text, unit, &zone),
                    arrow_timestamp(text, unit, &utc),
                    "{text} {unit:?}"
                );
            }
        }
        for text in [
            "2023-02-29T00:00:00Z",
            "2026-12-07T24:00:00Z",
            "2026-12-07T10:00:60Z",
            "2026-12-07T10:00:00.Z",
            "2026-12-07T10:00:00.1234567890Z",
            "2026-12-07",
        ] {
            assert!(rfc3339(text.as_bytes(), true).is_none(), "{text}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]
        #[test]
        fn any_timestamp_text_is_read_as_arrow_reads_it(text in timestamp_text()) {
            for name in ["+00:00", "UTC", "+02:00", "America/New_York"] {
                let tz: Tz = name.parse().unwrap();
                let zone = Zone { tz, naive_is_utc: matches!(name, "UTC" | "+00:00") };
                for unit in [TimeUnit::Second, TimeUnit::Millisecond, TimeUnit::Microsecond, TimeUnit::Nanosecond] {
                    prop_assert_eq!(
                        timestamp(&text, unit, &zone),
                        arrow_timestamp(&text, unit, &tz),
                        "{} in {} as {:?}", text, name, unit
                    );
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn runs_of_values_decode_as_arrow_decodes_them(
            values in prop::collection::vec(value(), 1..5),
        ) {
            let values: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
            same_as_arrow(SCHEMA, &values);
        }
    }
}
