//! The one error a client call returns.

use std::time::Duration;

use crate::wire::Refusal;

/// Why a call failed, and whether the sidecar's state may have changed.
///
/// Each variant says what is known about the request: [`Error::Connect`],
/// [`Error::NotSent`] and most refusals mean nothing was counted, but the region may have
/// counted an exact check refused with `RegionUnavailable`, `Storage` or `Forgotten`, or
/// with `BadField { field: "id" }` (its `CheckId` taken meanwhile by another request);
/// [`Error::Timeout`], [`Error::Disconnected`] and [`Error::Protocol`] mean the outcome is
/// unknown.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The sidecar answered no. Nothing was counted here, except that the region may have
    /// counted an exact check refused with `RegionUnavailable`, `Storage` or `Forgotten`,
    /// or with `BadField { field: "id" }` when another request of another kind under the
    /// same `CheckId` was answered at the sidecar while the region decided it (see
    /// [`Refusal`]): a check sent again after such a refusal goes under its own id, not a new
    /// one (sent again, `Forgotten` and `BadField` get the same answer).
    ///
    /// The client gives the same answer, [`Refusal::BadField`], without sending, for a
    /// request whose rule and subject would not fit in one frame
    /// ([`CLIENT_FRAME_BYTES_MAX`](crate::wire::CLIENT_FRAME_BYTES_MAX)).
    #[error("refused: {0}")]
    Refused(Refusal),
    /// No answer came within [`Options::timeout`](crate::Options::timeout). The request may
    /// have been applied; a late answer is dropped.
    #[error("timeout: no answer within {after:?}; the request may have been applied")]
    Timeout {
        /// The timeout that ran out.
        after: Duration,
    },
    /// The connection closed before the answer came. The request may have been applied; the
    /// next call reconnects.
    #[error("connection: closed before the answer came; the request may have been applied")]
    Disconnected,
    /// The request was never sent, so nothing was counted: the client's outbox had no room
    /// for it within [`Options::timeout`](crate::Options::timeout) (the sidecar is not
    /// reading what this client sends), or the connection closed before it was queued or
    /// while it still waited in the outbox, never written, or its own write found the
    /// connection broken and wrote nothing (the next call reconnects).
    #[error("not sent: {why}; nothing was counted")]
    NotSent {
        /// Which of these.
        why: String,
    },
    /// No connection could be made within
    /// [`Options::connect_timeout`](crate::Options::connect_timeout). Nothing was sent.
    #[error("connect: no connection to {endpoint}")]
    Connect {
        /// The endpoint, as given.
        endpoint: String,
        /// What failed (`TimedOut` when the connect timeout ran out).
        source: std::io::Error,
    },
    /// The sidecar sent something this client does not understand: a frame that does not
    /// decode as far as its request id (the connection is closed and every request written
    /// on it fails with this; one still in the outbox fails [`Error::NotSent`]), or, under a request's id, an answer that does not decode (one
    /// newer than this build) or a reply of the wrong kind for the request (that call alone
    /// fails, and the connection stays open). The outcome is unknown.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The tokio runtime this client connected on has shut down, and with it the tasks
    /// that serve its connection: no call on this client can succeed. Nothing was sent.
    /// Make a new client on a running runtime.
    #[error("runtime: the runtime this client connected on has shut down; make a new client")]
    RuntimeStopped,
}

impl Error {
    /// Whether the same call may succeed if made again.
    ///
    /// True for [`Error::Timeout`], [`Error::Disconnected`], [`Error::NotSent`] and
    /// [`Error::Connect`] (but for a Unix socket path no socket can have, too long or with
    /// a NUL byte: its source `InvalidInput`), and for refusals that name a passing
    /// condition ([`Refusal::RegionUnavailable`], [`Refusal::Storage`]). False for other refusals,
    /// for [`Error::Protocol`] and for [`Error::RuntimeStopped`]: asking again gets the
    /// same answer. (When the sidecar refuses one frame of a connection, every request
    /// written on it fails with `Protocol`, the well-formed ones beside it too: those may
    /// have counted, and sent again may succeed.)
    ///
    /// Retryable does not mean safe to retry. After a `Timeout` or a `Disconnected` the
    /// first request may have been applied, and after a refusal `RegionUnavailable` or
    /// `Storage` the region may still have counted the exact check, so retrying an `incr`,
    /// `decr` or `check` may count twice. Retry those only where an overcount is
    /// acceptable, except a request sent again under its [`CheckId`](crate::CheckId)
    /// ([`Client::check_with_id`](crate::Client::check_with_id),
    /// [`Client::incr_with_id`](crate::Client::incr_with_id),
    /// [`Client::decr_with_id`](crate::Client::decr_with_id)): that counts once (for an
    /// exact check, while the region remembers the id, or the sidecar that relayed the
    /// region's decision or counted a fallback does; otherwise while the same sidecar
    /// does).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Timeout { .. } | Error::Disconnected | Error::NotSent { .. } => true,
            // A Unix path no socket can have (too long for `sun_path`, or with a NUL byte)
            // is refused the same way at every attempt. Over TCP, `InvalidInput` can be
            // passing (`TCP_NODELAY` on a socket the peer just reset, off Linux).
            Error::Connect { endpoint, source } => {
                !(endpoint.starts_with("unix:")
                    && source.kind() == std::io::ErrorKind::InvalidInput)
            }
            Error::Refused(refusal) => matches!(
                refusal,
                Refusal::RegionUnavailable { .. } | Refusal::Storage { .. }
            ),
            Error::Protocol(_) | Error::RuntimeStopped => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_passing_refusals_are_retryable() {
        let retryable = [
            Refusal::RegionUnavailable {
                rule: "login".into(),
                why: "no quorum".into(),
            },
            Refusal::Storage {
                why: "disk full".into(),
            },
        ];
        let final_ = [
            Refusal::UnknownRule {
                rule: "login".into(),
            },
            Refusal::BadField {
                field: "subject".into(),
                why: "empty".into(),
            },
            Refusal::Overflow,
            Refusal::KeysFull { keys_max: 10 },
            Refusal::Malformed { why: "bad".into() },
            Refusal::Forgotten {
                rule: "quota".into(),
            },
        ];
        for refusal in retryable {
            assert!(Error::Refused(refusal).is_retryable());
        }
        for refusal in final_ {
            assert!(!Error::Refused(refusal).is_retryable());
        }
    }

    #[test]
    fn transport_failures_are_retryable_and_protocol_errors_are_not() {
        assert!(Error::Timeout {
            after: Duration::from_secs(1)
        }
        .is_retryable());
        assert!(Error::Disconnected.is_retryable());
        assert!(Error::NotSent {
            why: "no room".into()
        }
        .is_retryable());
        assert!(Error::Connect {
            endpoint: "127.0.0.1:7100".into(),
            source: std::io::ErrorKind::ConnectionRefused.into(),
        }
        .is_retryable());
        assert!(Error::Connect {
            endpoint: "127.0.0.1:7100".into(),
            source: std::io::ErrorKind::InvalidInput.into(),
        }
        .is_retryable());
        assert!(!Error::Connect {
            endpoint: format!("unix:/{}", "s".repeat(200)),
            source: std::io::ErrorKind::InvalidInput.into(),
        }
        .is_retryable());
        assert!(!Error::Protocol("frame: empty".into()).is_retryable());
    }

    #[test]
    fn messages_are_lowercase_and_name_what_failed() {
        let err = Error::Refused(Refusal::UnknownRule {
            rule: "login".into(),
        });
        assert_eq!(
            err.to_string(),
            "refused: rule: no rule named \"login\" is configured"
        );
        let err = Error::Connect {
            endpoint: "unix:/run/t.sock".into(),
            source: std::io::ErrorKind::NotFound.into(),
        };
        assert_eq!(
            err.to_string(),
            "connect: no connection to unix:/run/t.sock"
        );
        assert!(std::error::Error::source(&err).is_some());
    }
}
