//! Tidy checks that keep the workspace's layering true. They run as ordinary
//! tests with `cargo test --workspace`, so a change that breaks a rule of
//! `docs/architecture.md` fails CI instead of slowly eroding it.

mod rust;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use toml::Table;

fn root() -> PathBuf {
    crate::workspace_root()
}

/// Every member of the workspace: its folder and its parsed manifest.
fn members() -> Vec<(PathBuf, Table)> {
    let manifest: Table = read_toml(&root().join("Cargo.toml"));
    let members = manifest["workspace"]["members"]
        .as_array()
        .expect("workspace.members is a list");
    members
        .iter()
        .map(|m| {
            let dir = root().join(m.as_str().expect("member paths are strings"));
            let table = read_toml(&dir.join("Cargo.toml"));
            (dir, table)
        })
        .collect()
}

fn read_toml(path: &Path) -> Table {
    let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{} is not valid TOML: {e}", path.display()))
}

fn package_name(manifest: &Table) -> &str {
    manifest["package"]["name"].as_str().expect("package.name")
}

/// The names in `[dependencies]` and in every target-specific
/// `[target.'cfg(...)'.dependencies]` (not dev- or build-dependencies).
fn dependencies(manifest: &Table) -> Vec<String> {
    let targets = manifest
        .get("target")
        .and_then(|t| t.as_table())
        .into_iter()
        .flat_map(|t| t.values())
        .filter_map(|target| target.get("dependencies"));
    manifest
        .get("dependencies")
        .into_iter()
        .chain(targets)
        .filter_map(|d| d.as_table())
        .flat_map(|d| d.keys().cloned())
        .collect()
}

fn manifest_of(name: &str) -> Table {
    members()
        .into_iter()
        .find(|(_, m)| package_name(m) == name)
        .unwrap_or_else(|| panic!("no workspace member is named {name}"))
        .1
}

#[test]
fn offsets_depends_on_no_io_runtime_or_client() {
    let forbidden = [
        "tokio",
        "rdkafka",
        "scylla",
        "futures",
        "async-std",
        "reqwest",
        "anyhow",
    ];
    for dep in dependencies(&manifest_of("sluice-core")) {
        assert!(
            !forbidden.contains(&dep.as_str()) && !dep.starts_with("sluice-"),
            "sluice-core is the pure model and must not depend on {dep}"
        );
    }
}

#[test]
fn offsets_source_does_no_io() {
    let io = [
        "std::fs",
        "std::net",
        "std::process",
        "tokio",
        "std::thread::sleep",
    ];
    assert_names_none(
        &root().join("crates/core/src"),
        &io,
        true,
        "but sluice-core does no I/O",
    );
}

#[test]
fn executor_knows_only_the_traits() {
    let concrete = [
        "sluice-kafka",
        "sluice-checkpoint-fs",
        "sluice-cassandra-store",
        "sluice-sql",
        "sluice-state",
        "sluice-tables",
        "sluice-lake",
        "sluice-runner",
        "rdkafka",
        "scylla",
        "datafusion",
        "deltalake",
    ];
    for dep in dependencies(&manifest_of("sluice-executor")) {
        assert!(
            !concrete.contains(&dep.as_str()),
            "sluice-executor must work through the traits of sluice-core, not depend on {dep}"
        );
    }
}

#[test]
fn delta_lake_is_the_lake_crates_alone() {
    // delta-rs brings its own object-store clients and TLS stack; one crate
    // keeps them, and the runner reaches the table through it.
    for (_, manifest) in members() {
        let name = package_name(&manifest);
        if name != "sluice-lake" {
            assert!(
                !dependencies(&manifest).iter().any(|d| d == "deltalake"),
                "{name} depends on deltalake; Delta tables are sluice-lake's"
            );
        }
    }
}

#[test]
fn implementations_depend_only_on_the_model_among_our_crates() {
    for name in [
        "sluice-kafka",
        "sluice-checkpoint-fs",
        "sluice-cassandra-store",
        "sluice-lake",
    ] {
        for dep in dependencies(&manifest_of(name)) {
            assert!(
                !dep.starts_with("sluice-") || dep == "sluice-core",
                "{name} may depend on sluice-core only among our crates, not on {dep}"
            );
        }
    }
}

#[test]
fn state_computes_does_no_io_and_depends_on_the_core_only() {
    for dep in dependencies(&manifest_of("sluice-state")) {
        assert!(
            !dep.starts_with("sluice-") || dep == "sluice-core",
            "sluice-state keeps operators' state and implements the core's `StatefulOperator`; \
             it knows nothing of SQL, the stream's edges or the executor, so it must not depend \
             on {dep}"
        );
        assert!(
            !["tokio", "rdkafka", "scylla", "object_store", "futures"].contains(&dep.as_str()),
            "sluice-state computes and does no I/O, so it must not depend on {dep}"
        );
    }
    let io = ["std::fs", "std::net", "std::process", "tokio"];
    assert_names_none(
        &root().join("crates/state/src"),
        &io,
        false,
        "but sluice-state does no I/O",
    );
}

#[test]
fn the_sql_engine_computes_and_does_no_io() {
    for dep in dependencies(&manifest_of("sluice-sql")) {
        assert!(
            !dep.starts_with("sluice-") || dep == "sluice-core" || dep == "sluice-state",
            "sluice-sql may depend on sluice-core and sluice-state only among our crates, not \
             on {dep}"
        );
        assert!(
            !["tokio", "rdkafka", "scylla", "object_store"].contains(&dep.as_str()),
            "sluice-sql computes and does no I/O, so it must not depend on {dep}"
        );
    }
    // Tests may name tokio for their runtime.
    let io = ["std::fs", "std::net", "std::process", "tokio"];
    assert_names_none(
        &root().join("crates/sql/src"),
        &io,
        false,
        "but sluice-sql does no I/O",
    );
    // DataFusion's own readers of files, called as methods.
    let readers = [
        "register_csv",
        "register_json",
        "register_parquet",
        "read_csv",
        "read_json",
    ];
    for file in rust_files(&root().join("crates/sql/src")) {
        let code = non_test_code(&file);
        for reader in readers {
            assert!(
                !rust::paths(&code).iter().any(|p| p.ends_with(reader))
                    && !code.contains(&format!(".{reader}(")),
                "{} calls {reader}, but sluice-sql registers no file table",
                file.display()
            );
        }
    }
}

#[test]
fn lookup_tables_are_read_by_their_own_edge_for_the_sql_engine() {
    // The engine defines what a loader is and never reads a file or a
    // database; the tables' crate implements its loaders, reading files
    // itself and Cassandra through the crate that speaks Cassandra.
    for dep in dependencies(&manifest_of("sluice-tables")) {
        assert!(
            !dep.starts_with("sluice-") || dep == "sluice-sql" || dep == "sluice-cassandra-store",
            "sluice-tables implements sluice-sql's loaders, over files and sluice-cassandra-store; \
             it must not depend on {dep}"
        );
        assert!(
            !["rdkafka", "scylla", "datafusion"].contains(&dep.as_str()),
            "sluice-tables reads files into Arrow and Cassandra through sluice-cassandra-store, \
             so it must not depend on {dep}"
        );
    }
    for dep in dependencies(&manifest_of("sluice-sql")) {
        assert_ne!(
            dep, "parquet",
            "sluice-sql reads no file, so it needs no Parquet reader"
        );
    }
}

#[test]
fn the_status_page_knows_nothing_of_the_stream() {
    // It shows progress as the executor's JSON and metrics as the binary
    // renders them, so that the page can change without touching the batch
    // loop, and no client library or engine is built into it.
    for dep in dependencies(&manifest_of("sluice-status")) {
        assert!(
            !dep.starts_with("sluice-"),
            "sluice-status takes progress reports as JSON text, so it must not depend on {dep}"
        );
        assert!(
            !["rdkafka", "scylla", "datafusion", "arrow"].contains(&dep.as_str()),
            "sluice-status serves a page, so it must not depend on {dep}"
        );
    }
    // The page is embedded: no file is read when it is served.
    assert_names_none(
        &root().join("crates/status/src"),
        &["std::fs"],
        true,
        "but the status page's assets are in the binary",
    );
}

#[test]
fn the_runner_talks_to_stores_through_their_crates() {
    for dep in dependencies(&manifest_of("sluice-runner")) {
        assert!(
            !["scylla", "rdkafka", "datafusion"].contains(&dep.as_str()),
            "sluice-runner wires our crates together and names their options in our own types, \
             so it must not depend on {dep}"
        );
    }
}

#[test]
fn library_crates_use_typed_errors_not_anyhow() {
    for (dir, manifest) in members() {
        let name = package_name(&manifest);
        if !dir.starts_with(root().join("crates")) || name == "sluice-runner" {
            continue;
        }
        assert!(
            !dependencies(&manifest).iter().any(|d| d == "anyhow"),
            "{name} is a library crate: its errors are thiserror types, anyhow is for the binary"
        );
    }
}

#[test]
fn only_the_binaries_choose_the_allocator() {
    for (dir, manifest) in members() {
        let name = package_name(&manifest);
        if !dir.starts_with(root().join("crates")) || name == "sluice-runner" {
            continue;
        }
        assert!(
            !dependencies(&manifest)
                .iter()
                .any(|d| d == "mimalloc" || d == "libmimalloc-sys"),
            "{name} is a library crate: the binary chooses the allocator"
        );
        for file in rust_files(&dir.join("src")) {
            let text = fs::read_to_string(&file).expect("readable source");
            assert!(
                !text.contains("#[global_allocator]"),
                "{} declares a global allocator; only the binary does",
                file.display()
            );
        }
    }
}

#[test]
fn dependency_versions_are_pinned_once_in_the_workspace() {
    for (_, manifest) in members() {
        let name = package_name(&manifest);
        let sections = ["dependencies", "dev-dependencies", "build-dependencies"];
        let targets: Vec<(String, &Table)> = manifest
            .get("target")
            .and_then(|t| t.as_table())
            .into_iter()
            .flat_map(|t| t.iter())
            .flat_map(|(cfg, target)| {
                sections.iter().filter_map(move |section| {
                    let deps = target.get(*section)?.as_table()?;
                    Some((format!("target.{cfg}.{section}"), deps))
                })
            })
            .collect();
        let plain = sections
            .iter()
            .filter_map(|section| Some((section.to_string(), manifest.get(*section)?.as_table()?)));
        for (section, deps) in plain.chain(targets) {
            for (dep, spec) in deps {
                let inherited = spec
                    .as_table()
                    .and_then(|t| t.get("workspace"))
                    .and_then(|w| w.as_bool())
                    == Some(true);
                assert!(
                    inherited,
                    "{name} names {dep} in [{section}] without `workspace = true`; \
                     pin its version in the root [workspace.dependencies]"
                );
            }
        }
    }
}

#[test]
fn every_crate_says_its_job_in_a_doc_comment() {
    for (dir, manifest) in members() {
        let name = package_name(&manifest);
        let declared = manifest
            .get("lib")
            .and_then(|lib| lib.get("path"))
            .and_then(|path| path.as_str())
            .map(|path| dir.join(path));
        let entry = declared
            .into_iter()
            .chain(["src/lib.rs", "src/main.rs"].iter().map(|f| dir.join(f)))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{name} has no library or binary source to check"));
        let text = fs::read_to_string(&entry).expect("readable source");
        assert!(
            text.trim_start().starts_with("//!"),
            "{} must open with a //! comment that says what {name} is for",
            entry.display()
        );
    }
}

#[test]
fn the_edges_make_one_attempt_per_call_and_leave_retries_to_the_executor() {
    // A client that retries inside the executor's retry multiplies the waits:
    // the source's own retries once made an unreachable cluster take 23
    // minutes to give up. A wait in an edge crate is backpressure, said so.
    for krate in [
        "kafka",
        "checkpoint-fs",
        "cassandra-store",
        "tables",
        "lake",
    ] {
        for file in rust_files(&root().join("crates").join(krate).join("src")) {
            let text = fs::read_to_string(&file).expect("readable source");
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                if !line.contains("sleep(") || line.trim_start().starts_with("//") {
                    continue;
                }
                let context = lines[i.saturating_sub(3)..i].join("\n");
                assert!(
                    context.contains("Backpressure, not a retry"),
                    "{}:{} waits ({}); retries belong to the executor's policy \
                     (crates/executor/src/retry.rs), and backpressure says so in a comment",
                    file.display(),
                    i + 1,
                    line.trim()
                );
            }
        }
    }
}

#[test]
fn every_retry_goes_through_the_executors_one_driver() {
    // A retry is a loop around a call whose error it judges worth another
    // attempt. The executor's driver (`retry.rs`) is the one place that does
    // both; anywhere else, a function that loops and calls `is_transient(` or
    // `is_fenced(` is a retry of its own, with or without a wait in it. Handing
    // the judgement to the driver (`D::is_transient` as a value) is not a call.
    let driver = root().join("crates/executor/src/retry.rs");
    let mut own = Vec::new();
    for dir in checked_crates() {
        if !dir.starts_with(root().join("crates")) {
            continue;
        }
        for file in rust_files(&dir.join("src")) {
            if file == driver {
                continue;
            }
            let code = non_test_code(&file);
            for function in rust::functions(&code) {
                let body = &code[function.body.clone()];
                let loops = ["loop", "while", "for"]
                    .iter()
                    .any(|word| rust::has_word(body, word));
                let judges = body.contains("is_transient(") || body.contains("is_fenced(");
                if loops && judges {
                    own.push(format!(
                        "{}:{} fn {}",
                        file.strip_prefix(root()).unwrap_or(&file).display(),
                        function.line,
                        function.name
                    ));
                }
            }
        }
    }
    assert!(
        own.is_empty(),
        "functions that loop over a call and judge its errors, a retry outside the executor's \
         driver (crates/executor/src/retry.rs: `drive!`, or `retrying!` in a query):\n{}",
        own.join("\n")
    );
}

/// The crates whose module graph and sizes the structure checks read: every
/// library and binary under `crates/`, and xtask.
fn checked_crates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root().join("crates"))
        .expect("crates/ is readable")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|dir| dir.join("src").is_dir())
        .collect();
    dirs.push(root().join("xtask"));
    dirs.sort();
    dirs
}

/// The modules of the crate in `dir`, by their path from the crate's root
/// (`query::continuous`; the root itself is ""), each with its file.
fn modules_of(dir: &Path) -> BTreeMap<String, PathBuf> {
    let src = dir.join("src");
    rust_files(&src)
        .into_iter()
        .filter_map(|file| {
            let relative = file.strip_prefix(&src).ok()?.with_extension("");
            let mut segments: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                segments.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                segments.pop();
            }
            // Only modules of the library or the binary: `src/bin/` would be
            // crates of their own.
            (segments.first().map(String::as_str) != Some("bin"))
                .then(|| (segments.join("::"), file))
        })
        .collect()
}

/// The module that `path`, named in `module`, refers to, among `modules`,
/// with the crate root's re-exports (`pub use error::SqlError`) followed to
/// where they come from; `None` for another crate or the root's own items.
fn target_module(
    path: &str,
    module: &str,
    modules: &BTreeMap<String, PathBuf>,
    reexports: &BTreeMap<String, String>,
) -> Option<String> {
    let mut segments: Vec<&str> = path.split("::").collect();
    let mut base: Vec<&str> = match segments.first()? {
        &"crate" => {
            segments.remove(0);
            Vec::new()
        }
        &"self" => {
            segments.remove(0);
            module.split("::").filter(|s| !s.is_empty()).collect()
        }
        &"super" => {
            let mut base: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            while segments.first() == Some(&"super") {
                segments.remove(0);
                base.pop();
            }
            base
        }
        // In the root, a module's name starts a path to it.
        first if module.is_empty() && modules.contains_key(*first) => Vec::new(),
        _ => return None,
    };
    let resolved_from = base.len();
    base.extend(segments);
    let longest = (0..=base.len())
        .rev()
        .map(|n| base[..n].join("::"))
        .find(|candidate| modules.contains_key(candidate))?;
    if longest.is_empty() && base.len() > resolved_from {
        let name = base[0];
        let source = reexports.get(name)?;
        return target_module(source, "", modules, &BTreeMap::new());
    }
    Some(longest)
}

/// The crate root's `use` paths by the name they bring in, so that
/// `crate::SqlError` can be followed to `error::SqlError`.
fn root_reexports(modules: &BTreeMap<String, PathBuf>) -> BTreeMap<String, String> {
    let Some(root_file) = modules.get("") else {
        return BTreeMap::new();
    };
    rust::paths(&non_test_code(root_file))
        .into_iter()
        .filter_map(|path| {
            let name = path.rsplit("::").next()?.to_owned();
            Some((name, path))
        })
        .collect()
}

/// The edges between the top-level modules of the crate in `dir` (a child
/// module counts as its top-level ancestor; the root, a facade, is left
/// out): who names whom, outside `#[cfg(test)]` items.
fn module_edges(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules_of(dir);
    let reexports = root_reexports(&modules);
    let top = |module: &str| module.split("::").next().unwrap_or_default().to_owned();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, file) in &modules {
        if module.is_empty() {
            continue;
        }
        for path in rust::paths(&non_test_code(file)) {
            let Some(target) = target_module(&path, module, &modules, &reexports) else {
                continue;
            };
            let (from, to) = (top(module), top(&target));
            if !to.is_empty() && from != to {
                edges.entry(from).or_default().insert(to);
            }
        }
    }
    edges
}

/// A cycle in `edges`, as the modules along it, if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_two_modules_of_a_crate_depend_on_each_other() {
    // A circle between modules means neither can be read, tested or moved
    // alone; what both need belongs in a third module below them.
    let circles: Vec<String> = checked_crates()
        .into_iter()
        .filter_map(|dir| {
            let cycle = find_cycle(&module_edges(&dir))?;
            Some(format!(
                "{}: {}",
                dir.strip_prefix(root()).unwrap_or(&dir).display(),
                cycle.join(" -> ")
            ))
        })
        .collect();
    assert!(
        circles.is_empty(),
        "modules that name each other, through `use` or a path (move what they share into a \
         module of its own):\n{}",
        circles.join("\n")
    );
}

/// The most lines a function outside tests may span in `crates/`.
const MAX_FUNCTION_LINES: usize = 150;
/// The most lines a source file in `crates/` may have outside its tests.
const MAX_FILE_LINES: usize = 1200;

/// What was longer than the limits when they came in, each with its length
/// then (a file has no function name): each may shrink but not grow, and
/// leaves this list once it is within the limit. Nothing else may pass it;
/// it is empty since every file and function came within the limits.
const OVER_THE_LIMITS: &[(&str, &str, usize)] = &[];

/// Every function and file in `crates/` longer than the limits, outside
/// tests: (file from the root, function name or "", lines).
fn over_the_limits() -> Vec<(String, String, usize)> {
    let mut found = Vec::new();
    for dir in checked_crates() {
        if !dir.starts_with(root().join("crates")) {
            continue;
        }
        for file in rust_files(&dir.join("src")) {
            let shown = file
                .strip_prefix(root())
                .unwrap_or(&file)
                .display()
                .to_string();
            let text = fs::read_to_string(&file).expect("readable source");
            let code = rust::code_only(&text);
            let kept = rust::without_tests(&code);
            let test_lines = code
                .lines()
                .zip(kept.lines())
                .filter(|(all, kept)| !all.trim().is_empty() && kept.trim().is_empty())
                .count();
            let lines = text.lines().count() - test_lines;
            if lines > MAX_FILE_LINES {
                found.push((shown.clone(), String::new(), lines));
            }
            for function in rust::functions(&kept) {
                if function.lines > MAX_FUNCTION_LINES {
                    found.push((shown.clone(), function.name, function.lines));
                }
            }
        }
    }
    found
}

#[test]
fn functions_and_files_stay_short_enough_to_read() {
    let found = over_the_limits();
    let mut problems = Vec::new();
    for (file, function, lines) in &found {
        let what = match function.is_empty() {
            true => {
                format!("{file} has {lines} lines outside its tests (at most {MAX_FILE_LINES})")
            }
            false => {
                format!("{file}: fn {function} spans {lines} lines (at most {MAX_FUNCTION_LINES})")
            }
        };
        match OVER_THE_LIMITS
            .iter()
            .find(|(f, name, _)| f == file && name == function)
        {
            None => problems.push(format!("{what}: split it")),
            Some((_, _, then)) if lines > then => {
                problems.push(format!("{what}, more than the {then} it had: shrink it"))
            }
            Some(_) => {}
        }
    }
    for (file, function, _) in OVER_THE_LIMITS {
        if !found
            .iter()
            .any(|(f, name, _)| f == file && name == function)
        {
            problems.push(format!(
                "{file} {function} is within the limits now: take it off OVER_THE_LIMITS"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A source file's code without comments, literals and `#[cfg(test)]`
/// items.
fn non_test_code(file: &Path) -> String {
    let text = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    rust::without_tests(&rust::code_only(&text))
}

/// The files under `dir` that name a path under one of `prefixes`, in a
/// `use` tree or written out, with the path; in every item when `with_tests`,
/// else outside `#[cfg(test)]` items only.
fn named_paths(dir: &Path, prefixes: &[&str], with_tests: bool) -> Vec<(PathBuf, String)> {
    let mut found = Vec::new();
    for file in rust_files(dir) {
        let code = match with_tests {
            true => rust::code_only(&fs::read_to_string(&file).expect("readable source")),
            false => non_test_code(&file),
        };
        for path in rust::paths(&code) {
            if prefixes.iter().any(|prefix| rust::is_under(&path, prefix)) {
                found.push((file.clone(), path));
            }
        }
    }
    found
}

/// Fails, naming each file and path, when a file under `dir` names a path
/// under one of `prefixes` (see [`named_paths`]); `why` ends the message.
fn assert_names_none(dir: &Path, prefixes: &[&str], with_tests: bool, why: &str) {
    let found = named_paths(dir, prefixes, with_tests);
    assert!(
        found.is_empty(),
        "{}",
        found
            .iter()
            .map(|(file, path)| format!("{} uses {path}, {why}", file.display()))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}
