//! SIGINT and SIGTERM: the first stops the query after the batch in flight, a
//! second exits at once.

use super::*;

/// The first SIGINT or SIGTERM asks the query to stop after the batch in flight;
/// a second one exits at once (the write-ahead plan makes that safe too).
pub(crate) fn stop_on_signals() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut interrupt), Ok(mut terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::warn!("cannot listen for signals; stop the query with SIGKILL");
            return;
        };
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        tracing::info!("stopping after the batch in flight; a second signal exits at once");
        let _ = tx.send(true);
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        eprintln!(
            "sluice: second signal, exiting at once; the batch in flight is replayed on restart"
        );
        std::process::exit(130);
    });
    rx
}
