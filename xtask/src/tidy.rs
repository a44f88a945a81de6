//! Tidy checks that keep the workspace's layering true. They run as ordinary
//! tests with `cargo test --workspace`, so a change that breaks a rule of
//! `docs/architecture.md` fails CI instead of slowly eroding it.

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

/// The names in `[dependencies]` (not dev- or build-dependencies).
fn dependencies(manifest: &Table) -> Vec<String> {
    manifest
        .get("dependencies")
        .and_then(|d| d.as_table())
        .map(|d| d.keys().cloned().collect())
        .unwrap_or_default()
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
    for dep in dependencies(&manifest_of("sluice-offsets")) {
        assert!(
            !forbidden.contains(&dep.as_str()) && !dep.starts_with("sluice-"),
            "sluice-offsets is the pure model and must not depend on {dep}"
        );
    }
}

#[test]
fn offsets_source_does_no_io() {
    let src = root().join("crates/offsets/src");
    for file in rust_files(&src) {
        let text = fs::read_to_string(&file).expect("readable source");
        for needle in [
            "std::fs",
            "std::net",
            "std::process",
            "tokio::",
            "std::thread::sleep",
        ] {
            assert!(
                !text.contains(needle),
                "{} uses {needle}, but sluice-offsets does no I/O",
                file.display()
            );
        }
    }
}

#[test]
fn executor_knows_only_the_traits() {
    let concrete = [
        "sluice-kafka-source",
        "sluice-checkpoint-fs",
        "sluice-cassandra-store",
        "sluice-sql",
        "sluice-state",
        "sluice-runner",
        "rdkafka",
        "scylla",
        "datafusion",
    ];
    for dep in dependencies(&manifest_of("sluice-executor")) {
        assert!(
            !concrete.contains(&dep.as_str()),
            "sluice-executor must work through the traits of sluice-offsets, not depend on {dep}"
        );
    }
}

#[test]
fn implementations_depend_only_on_the_model_among_our_crates() {
    for name in [
        "sluice-kafka-source",
        "sluice-checkpoint-fs",
        "sluice-cassandra-store",
    ] {
        for dep in dependencies(&manifest_of(name)) {
            assert!(
                !dep.starts_with("sluice-") || dep == "sluice-offsets",
                "{name} may depend on sluice-offsets only among our crates, not on {dep}"
            );
        }
    }
}

#[test]
fn state_computes_does_no_io_and_depends_on_none_of_our_crates() {
    for dep in dependencies(&manifest_of("sluice-state")) {
        assert!(
            !dep.starts_with("sluice-"),
            "sluice-state keeps DataFusion's states and knows nothing of the stream, so it must \
             not depend on {dep}"
        );
        assert!(
            !["tokio", "rdkafka", "scylla", "object_store", "futures"].contains(&dep.as_str()),
            "sluice-state computes and does no I/O, so it must not depend on {dep}"
        );
    }
    for file in rust_files(&root().join("crates/state/src")) {
        let text = fs::read_to_string(&file).expect("readable source");
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for needle in ["std::fs", "std::net", "std::process", "tokio::"] {
            assert!(
                !code.contains(needle),
                "{} uses {needle}, but sluice-state does no I/O",
                file.display()
            );
        }
    }
}

#[test]
fn the_sql_engine_computes_and_does_no_io() {
    for dep in dependencies(&manifest_of("sluice-sql")) {
        assert!(
            !dep.starts_with("sluice-") || dep == "sluice-offsets" || dep == "sluice-state",
            "sluice-sql may depend on sluice-offsets and sluice-state only among our crates, not \
             on {dep}"
        );
        assert!(
            !["tokio", "rdkafka", "scylla", "object_store"].contains(&dep.as_str()),
            "sluice-sql computes and does no I/O, so it must not depend on {dep}"
        );
    }
    for file in rust_files(&root().join("crates/sql/src")) {
        let text = fs::read_to_string(&file).expect("readable source");
        for needle in [
            "std::fs",
            "std::net",
            "std::process",
            "tokio::",
            "register_csv",
            "register_json",
            "register_parquet",
            "read_csv",
            "read_json",
        ] {
            // Tests may name tokio for their runtime.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            assert!(
                !code.contains(needle),
                "{} uses {needle}, but sluice-sql does no I/O",
                file.display()
            );
        }
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
    for file in rust_files(&root().join("crates/status/src")) {
        let text = fs::read_to_string(&file).expect("readable source");
        // The page is embedded: no file is read when it is served.
        assert!(
            !text.contains("std::fs"),
            "{} reads files, but the status page's assets are in the binary",
            file.display()
        );
    }
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
        for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
            let Some(deps) = manifest.get(section).and_then(|d| d.as_table()) else {
                continue;
            };
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
    for krate in ["kafka-source", "checkpoint-fs", "cassandra-store"] {
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
