//! `sluice`: reads the configuration and the command line, builds the source, the
//! offset store and the sink, and hands them to the executor.

use std::process::ExitCode;

const USAGE: &str = "\
sluice: exactly-once micro-batches from Apache Kafka

Usage: sluice <command>

Commands:
  help        print this message
  version     print the version
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some("version" | "-V" | "--version") => {
            println!("sluice {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("sluice: unknown command `{other}`\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
