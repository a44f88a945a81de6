//! Links the `sluice` binary with packed relative relocations (DT_RELR) on
//! GNU/Linux.
//!
//! The binary carries about 200,000 relative relocations (DataFusion's and
//! Arrow's tables of functions, mostly). As `.rela.dyn` entries they take
//! 5.2 MiB, which the loader reads at every start and which then stay mapped:
//! at 1,024 partitions that was 5.5 MiB of the process's peak RSS for nothing.
//! Packed, they take 64 KiB. glibc reads them since 2.36, and the binary then
//! asks the loader for that ability (`GLIBC_ABI_DT_RELR`), so it runs where it
//! was built; GNU ld packs them since 2.38, and an older ld ignores the option
//! with a warning.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
