//! Log lines on standard error, as text or JSON, filtered by `SLUICE_LOG`.

use clap::ValueEnum;

/// How log lines look.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    /// One line per event, for people.
    Text,
    /// One JSON object per event, for log collectors.
    Json,
}

/// How logs look: chosen once for the process, as the log subscriber is.
pub(crate) static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// Installs the log subscriber for the process, in `format`.
pub(crate) fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG")
        // The Cassandra driver logs every connection it opens at info, which
        // says nothing a user acts on; its warnings still show.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,scylla=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes are for a terminal, not for a file or a pipe; NO_COLOR
        // (no-color.org) turns them off there too.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        );
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
