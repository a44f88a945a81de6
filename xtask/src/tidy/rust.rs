//! Just enough of Rust's syntax for the tidy checks to read code instead of
//! grepping text: comments and literals blanked out, test items cut away,
//! `use` trees expanded into the paths they name, functions with their
//! lengths. A substring match let `use std::{fs}` and a path in a comment
//! fool the checks; these functions do not.

/// `text` with every comment and every string, byte-string and char literal
/// replaced by spaces, newlines kept, so that line numbers stay true.
pub fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    let blank = |out: &mut Vec<u8>, from: &[u8]| {
        out.extend(from.iter().map(|&b| if b == b'\n' { b'\n' } else { b' ' }));
    };
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let end = block_comment_end(rest);
            blank(&mut out, &rest[..end]);
            i += end;
        } else if let Some(end) = raw_string_end(rest, preceded_by_ident(bytes, i)) {
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'"' || (rest.starts_with(b"b\"") && !preceded_by_ident(bytes, i)) {
            let open = if rest[0] == b'"' { 1 } else { 2 };
            let end = quoted_end(rest, open, b'"');
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == b'\'' {
            match char_literal_end(rest) {
                Some(end) => {
                    blank(&mut out, &rest[..end]);
                    i += end;
                }
                // A lifetime or a label.
                None => {
                    out.push(b'\'');
                    i += 1;
                }
            }
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    String::from_utf8(out).expect("blanking keeps UTF-8 intact outside literals")
}

fn preceded_by_ident(bytes: &[u8], i: usize) -> bool {
    i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_')
}

fn block_comment_end(rest: &[u8]) -> usize {
    let (mut depth, mut i) = (0usize, 0);
    while i < rest.len() {
        if rest[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if rest[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    rest.len()
}

/// The length of a raw string (`r"..."`, `r#"..."#`, `br"..."`) at the start
/// of `rest`, if one starts there.
fn raw_string_end(rest: &[u8], after_ident: bool) -> Option<usize> {
    if after_ident {
        return None;
    }
    let start = if rest.starts_with(b"br") {
        2
    } else if rest.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = rest[start..].iter().take_while(|&&b| b == b'#').count();
    if rest.get(start + hashes) != Some(&b'"') {
        return None;
    }
    let body = start + hashes + 1;
    let mut closing = vec![b'"'];
    closing.extend(std::iter::repeat_n(b'#', hashes));
    let end = rest[body..]
        .windows(closing.len())
        .position(|w| w == closing.as_slice())
        .map(|p| body + p + closing.len())
        .unwrap_or(rest.len());
    Some(end)
}

/// The end of a literal opened by `open` bytes and closed by `close`, with
/// backslash escapes.
fn quoted_end(rest: &[u8], open: usize, close: u8) -> usize {
    let mut i = open;
    while i < rest.len() {
        match rest[i] {
            b'\\' => i += 2,
            b if b == close => return i + 1,
            _ => i += 1,
        }
    }
    rest.len()
}

/// The length of a char literal at the start of `rest`, or `None` for a
/// lifetime (`'a`, `'static`) or a loop label.
fn char_literal_end(rest: &[u8]) -> Option<usize> {
    match rest.get(1)? {
        b'\\' => Some(quoted_end(rest, 1, b'\'')),
        _ => {
            // One character, which may take several bytes, then the quote.
            let text = std::str::from_utf8(&rest[1..rest.len().min(6)])
                .ok()
                .or_else(|| {
                    (2..6)
                        .rev()
                        .find_map(|n| std::str::from_utf8(rest.get(1..n)?).ok())
                })?;
            let c = text.chars().next()?;
            let after = 1 + c.len_utf8();
            (rest.get(after) == Some(&b'\'')).then_some(after + 1)
        }
    }
}

/// `code` (already [`code_only`]) without the items marked `#[cfg(test)]`:
/// each is blanked from its attribute to the end of its block or its `;`.
pub fn without_tests(code: &str) -> String {
    let mut out = code.to_owned();
    let mut from = 0;
    while let Some(at) = out[from..].find("#[cfg(test)]").map(|p| from + p) {
        let after = at + "#[cfg(test)]".len();
        let end = item_end(&out, after);
        let blanked: String = out[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        out.replace_range(at..end, &blanked);
        from = end;
    }
    out
}

/// Where the item that starts at `from` ends: after its balanced `{...}`
/// block, or after the `;` that comes before any block.
fn item_end(code: &str, from: usize) -> usize {
    let bytes = code.as_bytes();
    let mut i = from;
    while i < bytes.len() && bytes[i] != b'{' && bytes[i] != b';' {
        i += 1;
    }
    if i >= bytes.len() || bytes[i] == b';' {
        return (i + 1).min(bytes.len());
    }
    matching_brace(bytes, i).map_or(bytes.len(), |close| close + 1)
}

/// The index of the `}` that closes the `{` at `open`.
fn matching_brace(bytes: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, &b) in bytes.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Every path that `code` names: each `use` tree expanded (`use std::{fs,
/// io::Read}` names `std::fs` and `std::io::Read`), and every path written
/// out in the code (`std::fs::read`), without a leading `::`.
pub fn paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for statement in use_statements(code) {
        expand_use_tree("", &statement, &mut found);
    }
    found.extend(inline_paths(code));
    found
}

/// The text of each `use` declaration between `use` and `;`, with white
/// space only where it separates words (`a::{b, c as d}` reads
/// `a::{b,c as d}`).
fn use_statements(code: &str) -> Vec<String> {
    word_starts(code, "use")
        .into_iter()
        .filter_map(|at| {
            let rest = &code[at + 3..];
            let end = rest.find(';')?;
            let words = rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
            let mut tight = words;
            for token in ["::", "{", "}", ","] {
                tight = tight
                    .replace(&format!(" {token}"), token)
                    .replace(&format!("{token} "), token);
            }
            Some(tight)
        })
        .collect()
}

/// Where `word` starts as a whole word in `code`.
fn word_starts(code: &str, word: &str) -> Vec<usize> {
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let bytes = code.as_bytes();
    code.match_indices(word)
        .map(|(at, _)| at)
        .filter(|&at| {
            (at == 0 || !is_ident(bytes[at - 1]))
                && bytes.get(at + word.len()).is_none_or(|&c| !is_ident(c))
        })
        .collect()
}

/// Whether `code` uses `word` as a word, not as part of a longer name.
pub fn has_word(code: &str, word: &str) -> bool {
    !word_starts(code, word).is_empty()
}

/// Adds the paths a `use` tree names to `out`, each after `prefix`.
fn expand_use_tree(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim_start_matches("::");
    let join = |rest: &str| match (prefix.is_empty(), rest) {
        (true, rest) => rest.to_owned(),
        (false, "self") => prefix.to_owned(),
        (false, rest) => format!("{prefix}::{rest}"),
    };
    match tree.find('{') {
        None => {
            let path = tree.split(" as ").next().unwrap_or(tree);
            if !path.is_empty() {
                out.push(join(path));
            }
        }
        Some(open) => {
            let head = tree[..open].trim_end_matches("::");
            let inner_prefix = if head.is_empty() {
                prefix.to_owned()
            } else {
                join(head)
            };
            let close = tree.rfind('}').unwrap_or(tree.len());
            for part in split_top_level(&tree[open + 1..close]) {
                expand_use_tree(&inner_prefix, part, out);
            }
        }
    }
}

/// The comma-separated parts of a brace group's inside, at its top level.
fn split_top_level(inner: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

/// Every run of identifiers joined by `::` in `code`, such as
/// `std::fs::read` or `crate::query::one_line`.
fn inline_paths(code: &str) -> Vec<String> {
    let bytes = code.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !is_ident(bytes[i]) || (i > 0 && is_ident(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let mut segments = Vec::new();
        let mut j = i;
        loop {
            let start = j;
            while j < bytes.len() && is_ident(bytes[j]) {
                j += 1;
            }
            segments.push(&code[start..j]);
            let mut k = j;
            while k < bytes.len() && bytes[k] == b' ' {
                k += 1;
            }
            if !code[k..].starts_with("::") {
                break;
            }
            k += 2;
            while k < bytes.len() && bytes[k] == b' ' {
                k += 1;
            }
            if k >= bytes.len() || !is_ident(bytes[k]) {
                break;
            }
            j = k;
        }
        if segments.len() > 1 {
            found.push(segments.join("::"));
        }
        i = j.max(i + 1);
    }
    found
}

/// Whether `path` is `prefix` or lies under it (`std::fs::read` under
/// `std::fs`, but not `std::fsx`).
pub fn is_under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with("::"))
}

/// A function in `code`: its name, the line its signature starts on (from
/// 1) and how many lines it spans, signature to closing brace.
#[derive(Debug)]
pub struct Function {
    pub name: String,
    pub line: usize,
    pub lines: usize,
    /// Where its body lies in the code, braces included.
    pub body: std::ops::Range<usize>,
}

/// Every function with a body in `code` (already [`code_only`]), nested
/// ones included.
pub fn functions(code: &str) -> Vec<Function> {
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    for at in word_starts(code, "fn") {
        let rest = &code[at + 2..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            // `fn(` is a function pointer type.
            continue;
        }
        let Some(open) = body_start(bytes, at) else {
            continue;
        };
        let Some(close) = matching_brace(bytes, open) else {
            continue;
        };
        let line = code[..at].matches('\n').count() + 1;
        let lines = code[at..=close].matches('\n').count() + 1;
        found.push(Function {
            name,
            line,
            lines,
            body: open..close + 1,
        });
    }
    found
}

/// The `{` that opens the body of the function whose `fn` is at `at`, or
/// `None` for a declaration that ends in `;` (a trait's required method).
fn body_start(bytes: &[u8], at: usize) -> Option<usize> {
    // Parentheses and angle brackets hold the parameters and the generics, a
    // `{` inside them would be a const generic block, which we do not write.
    let mut depth = 0i32;
    for (i, &b) in bytes.iter().enumerate().skip(at) {
        match b {
            b'(' | b'[' => depth += 1,
            b')' | b']' => depth -= 1,
            b';' if depth == 0 => return None,
            b'{' if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_literals_are_blanked_and_lines_kept() {
        let text = "let a = \"std::fs\"; // std::net\n/* std::process /* nested */ */ let c = 'x';\n\
                    let r = r#\"tokio::spawn\"#; fn f<'a>(x: &'a str) {}\nlet b = b\"x\";";
        let code = code_only(text);
        assert_eq!(code.lines().count(), text.lines().count());
        for hidden in [
            "std::fs",
            "std::net",
            "std::process",
            "tokio::spawn",
            "'x'",
            "b\"x\"",
        ] {
            assert!(!code.contains(hidden), "{hidden} is still in {code}");
        }
        assert!(code.contains("fn f<'a>(x: &'a str) {}"), "{code}");
    }

    #[test]
    fn use_trees_are_expanded_into_the_paths_they_name() {
        let code = code_only(
            "use std::{fs, io::{self, Read}};\nuse ::tokio::time as t;\npub(crate) use crate::x::Y as Z;\n\
             fn f() { std::net::TcpStream::connect(a); let _ = std :: process :: exit; }",
        );
        let found = paths(&code);
        for expected in [
            "std::fs",
            "std::io",
            "std::io::Read",
            "tokio::time",
            "crate::x::Y",
            "std::net::TcpStream::connect",
            "std::process::exit",
        ] {
            assert!(
                found.iter().any(|p| p == expected),
                "{expected} not in {found:?}"
            );
        }
        assert!(is_under("std::fs::read", "std::fs") && !is_under("std::fsx", "std::fs"));
    }

    #[test]
    fn test_items_are_cut_away() {
        let code = code_only(
            "fn kept() {}\n#[cfg(test)]\nmod tests {\n    fn gone() { std::fs::read(\"x\"); }\n}\n\
             #[cfg(test)]\nuse std::net;\nfn also_kept() {}\n",
        );
        let code = without_tests(&code);
        assert!(
            code.contains("fn kept") && code.contains("fn also_kept"),
            "{code}"
        );
        assert!(
            !code.contains("gone") && !code.contains("std::net"),
            "{code}"
        );
    }

    #[test]
    fn functions_are_measured_from_signature_to_closing_brace() {
        let code = code_only(
            "trait T { fn required(&self); }\nfn two(\n    a: u8,\n) -> u8 {\n    let f: fn(u8) -> u8 = |x| x;\n    f(a)\n}\n",
        );
        let found = functions(&code);
        let names: Vec<(&str, usize, usize)> = found
            .iter()
            .map(|f| (f.name.as_str(), f.line, f.lines))
            .collect();
        assert_eq!(names, [("two", 2, 6)]);
    }
}
