//! Answers of a cluster that turns this client away for good: a failed login, a
//! failed TLS handshake, a listener that speaks another security protocol.
//!
//! librdkafka reports them only to the error callback and keeps reconnecting, so
//! a request would wait out its timeout as if the broker were down, and the
//! executor would retry it until `startup_timeout`. A request that fails after
//! such an answer fails with the broker's reason instead, which no retry changes.

use std::sync::{Arc, Mutex, PoisonError};

use rdkafka::error::KafkaError as RdKafkaError;
use rdkafka::types::RDKafkaErrorCode;

/// The last refusal the client's callbacks saw, shared by its contexts.
#[derive(Clone, Debug, Default)]
pub(crate) struct Refusals(Arc<Mutex<Seen>>);

#[derive(Debug, Default)]
struct Seen {
    refusal: Option<String>,
    /// A request of this client has been answered: the cluster takes it.
    answered: bool,
    /// The broker connection whose connections were closed at the first
    /// request, and how many times in a row.
    closed_at_first_request: Option<(String, u32)>,
}

/// How many connections to one broker closed at the first request make a
/// refusal: one may be a broker that was stopping, a second one in a row with
/// no refused connection between them is the listener's answer. (librdkafka
/// logs an identical failure at most twice in 30 s.)
const CLOSED_AT_FIRST_REQUEST: u32 = 2;

impl Refusals {
    /// Keeps `reason` when `error` is a refusal; says whether it was.
    pub(crate) fn observe(&self, error: &RdKafkaError, reason: &str) -> bool {
        is_refusal(error, reason) && self.keep(reason)
    }

    /// Keeps a broker failure that librdkafka logged (facility `FAIL`) when its
    /// text is a refusal's; says whether it was.
    pub(crate) fn observe_log(&self, facility: &str, message: &str) -> bool {
        if facility != "FAIL" {
            return false;
        }
        if refusal_text(message) {
            return self.keep(message);
        }
        // A plaintext client at a TLS listener: the broker closes the connection
        // at the first request, every time, and never answers one. A broker that
        // is stopping closes or resets connections too, but then refuses the
        // next ones, and a client it answered before is not refused by it.
        let mut seen = self.seen();
        if message.contains("Connection refused") {
            seen.closed_at_first_request = None;
            return false;
        }
        let text = without_thread(message);
        let Some((broker, _)) = text.split_once(": Disconnected: connection closed by peer") else {
            return false;
        };
        if seen.answered || !text.contains("in state APIVERSION_QUERY") {
            return false;
        }
        let times = match &seen.closed_at_first_request {
            Some((same, times)) if same == broker => times + 1,
            _ => 1,
        };
        seen.closed_at_first_request = Some((broker.to_owned(), times));
        if times < CLOSED_AT_FIRST_REQUEST {
            return false;
        }
        seen.refusal = Some(format!(
            "{text}; a broker that closes every connection at the first request expects another \
             security protocol (TLS or SASL)"
        ));
        true
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `reason`, unless the cluster answered this client before and it
    /// is not a login refused: a TLS connection to a broker that is stopping
    /// may fail its handshake once, and the retries then find the broker back.
    fn keep(&self, reason: &str) -> bool {
        let mut seen = self.seen();
        if seen.answered && !reason.contains("SASL authentication") {
            return false;
        }
        seen.refusal = Some(without_thread(reason).to_owned());
        true
    }

    /// Forgets what was seen, after a request that succeeded.
    pub(crate) fn clear(&self) {
        *self.seen() = Seen {
            answered: true,
            ..Seen::default()
        };
    }

    /// The last refusal since [`Refusals::clear`].
    pub(crate) fn last(&self) -> Option<String> {
        self.seen().refusal.clone()
    }
}

/// librdkafka's words for a broker failure that happens again on every
/// connection: a login refused, a handshake that fails (an untrusted
/// certificate, a plaintext listener), and its own diagnosis of a disconnect at
/// the first request (a plaintext client at a TLS listener, or one without SASL
/// at a SASL listener). A TLS connection that breaks once established is not one.
const REFUSALS: [&str; 7] = [
    "SASL authentication error",
    "SASL authentication failure",
    "mechanism handshake failed",
    "Failed to initialize SASL authentication",
    "SSL handshake failed",
    "incorrect security.protocol",
    "verify that security.protocol",
];

/// A log line without librdkafka's `[thrd:...]: ` prefix, which names its
/// thread and repeats the broker.
fn without_thread(message: &str) -> &str {
    match message.strip_prefix("[thrd:") {
        Some(rest) => rest.split_once("]: ").map_or(message, |(_, text)| text),
        None => message,
    }
}

fn refusal_text(text: &str) -> bool {
    REFUSALS.iter().any(|sign| text.contains(sign))
}

fn is_refusal(error: &RdKafkaError, reason: &str) -> bool {
    let code = match error {
        RdKafkaError::Global(code) => Some(*code),
        other => other.rdkafka_error_code(),
    };
    match code {
        Some(
            RDKafkaErrorCode::Authentication
            | RDKafkaErrorCode::SaslAuthenticationFailed
            | RDKafkaErrorCode::UnsupportedSASLMechanism
            | RDKafkaErrorCode::IllegalSASLState,
        ) => true,
        _ => refusal_text(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logins_handshakes_and_protocol_mismatches_only() {
        let refusals = Refusals::default();
        let global = RdKafkaError::Global;
        assert!(!refusals.observe(
            &global(RDKafkaErrorCode::BrokerTransportFailure),
            "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused"
        ));
        assert!(!refusals.observe(
            &global(RDKafkaErrorCode::SSL),
            "127.0.0.1:9094/1: SSL transport error: Connection reset by peer"
        ));
        assert_eq!(refusals.last(), None);
        assert!(refusals.observe(
            &global(RDKafkaErrorCode::BrokerTransportFailure),
            "127.0.0.1:9094/bootstrap: Disconnected while requesting ApiVersion: might be caused \
             by incorrect security.protocol configuration (connecting to a SSL listener?)"
        ));
        assert!(refusals.observe(
            &global(RDKafkaErrorCode::SSL),
            "127.0.0.1:9094/bootstrap: SSL handshake failed: certificate verify failed"
        ));
        assert!(refusals.observe(
            &global(RDKafkaErrorCode::Authentication),
            "SASL authentication error: Authentication failed during authentication due to \
             invalid credentials with SASL mechanism SCRAM-SHA-512"
        ));
        assert!(refusals.last().unwrap().contains("invalid credentials"));
        refusals.clear();
        assert!(!refusals.observe_log(
            "FAIL",
            "127.0.0.1:9092/1: Connect to ipv4#127.0.0.1:9092 failed: Connection refused"
        ));
        assert!(!refusals.observe_log("SASL", "SSL handshake failed"));
        assert_eq!(refusals.last(), None);
        let closed = "127.0.0.1:9094/bootstrap: Disconnected: connection closed by peer: receive 0 \
                      after POLLIN (after 1ms in state APIVERSION_QUERY)";
        let fresh = Refusals::default();
        assert!(
            !fresh.observe_log("FAIL", closed),
            "once may be a broker stopping"
        );
        assert!(fresh.observe_log("FAIL", closed));
        assert!(fresh.last().unwrap().contains("another security protocol"));
        // A broker stopping (seen in CI): two of its connections reset at the
        // first request, then refused; or closed after a client it answered.
        let stopping = Refusals::default();
        for line in [
            "127.0.0.1:9092/1: Disconnected: connection reset by peer (after 0ms in state \
             APIVERSION_QUERY)",
            "GroupCoordinator: 127.0.0.1:9092: Disconnected: connection closed by peer: receive 0 \
             after POLLIN (after 3109ms in state UP)",
            "GroupCoordinator: 127.0.0.1:9092: Disconnected: connection reset by peer (after 0ms \
             in state APIVERSION_QUERY)",
        ] {
            assert!(!stopping.observe_log("FAIL", line), "{line}");
        }
        let once = "GroupCoordinator: 127.0.0.1:9092: Disconnected: connection closed by peer: \
                    receive 0 after POLLIN (after 0ms in state APIVERSION_QUERY)";
        assert!(!stopping.observe_log("FAIL", once));
        let refused = "GroupCoordinator: 127.0.0.1:9092: Connect to ipv4#127.0.0.1:9092 failed: \
                       Connection refused (after 0ms in state CONNECT)";
        assert!(!stopping.observe_log("FAIL", refused));
        assert!(
            !stopping.observe_log("FAIL", once),
            "the refusal started the count again"
        );
        assert_eq!(stopping.last(), None);
        let answered = Refusals::default();
        answered.clear();
        assert!(!answered.observe_log("FAIL", closed));
        assert!(
            !answered.observe_log("FAIL", closed),
            "a broker that answered before"
        );
        let untrusted = "sasl_ssl://127.0.0.1:9094/bootstrap: SSL handshake failed: \
                         error:0A000086:SSL routines::certificate verify failed: broker \
                         certificate could not be verified";
        assert!(Refusals::default().observe_log("FAIL", untrusted));
        // Once answered, only a refused login is still final.
        assert!(!answered.observe_log("FAIL", untrusted));
        assert!(answered.observe_log(
            "FAIL",
            "sasl_ssl://127.0.0.1:9094/1: SASL authentication error: Authentication failed"
        ));
    }
}
