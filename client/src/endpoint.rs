//! Where a sidecar listens: a TCP address or a Unix socket path.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// Where a sidecar listens.
///
/// Parsed from `unix:/path/to.sock` (a path of at most 107 bytes, 103 off Linux, without a
/// NUL byte) or `ip:port` (`127.0.0.1:7100`, `[::1]:7100`), and
/// displayed the same way, so `endpoint.to_string().parse()` gives the endpoint back (for a
/// Unix socket, when its path is UTF-8 and one that parses: an `Endpoint::Unix` built with
/// a longer path, or one with a NUL byte, displays as text that is refused).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A TCP address. Host names are not resolved: a sidecar is local.
    Tcp(SocketAddr),
    /// A Unix domain socket at this path.
    Unix(PathBuf),
}

/// The prefix that marks a Unix socket path.
const UNIX_PREFIX: &str = "unix:";

/// The longest Unix socket path a socket address holds (`sun_path` less its NUL): 107
/// bytes on Linux, 103 on the BSDs and macOS. tallyd refuses a `client_socket` over 107
/// bytes.
const UNIX_PATH_BYTES_MAX: usize = if cfg!(any(target_os = "linux", target_os = "android")) {
    107
} else {
    103
};

impl FromStr for Endpoint {
    type Err = ParseEndpointError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || ParseEndpointError {
            text: text.to_string(),
        };
        match text.strip_prefix(UNIX_PREFIX) {
            // No socket can have it: every connect would fail the same way.
            Some(path) if path.is_empty() || path.len() > UNIX_PATH_BYTES_MAX => Err(error()),
            Some(path) if path.contains('\0') => Err(error()),
            Some(path) => Ok(Endpoint::Unix(PathBuf::from(path))),
            None => text.parse().map(Endpoint::Tcp).map_err(|_| error()),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(addr) => write!(f, "{addr}"),
            Endpoint::Unix(path) => write!(f, "{UNIX_PREFIX}{}", path.display()),
        }
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Endpoint::Tcp(addr)
    }
}

/// Why a text is not an [`Endpoint`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint: {text:?} is neither `unix:/path/to.sock` nor `ip:port`")]
#[non_exhaustive]
pub struct ParseEndpointError {
    /// The text that did not parse.
    pub text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_display_back_to_the_same_text() {
        for text in [
            "127.0.0.1:7100",
            "[::1]:7100",
            "unix:/run/tally/client.sock",
            "unix:relative.sock",
        ] {
            let endpoint: Endpoint = text.parse().unwrap();
            assert_eq!(endpoint.to_string(), text);
        }
        assert_eq!(
            "127.0.0.1:7100".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp(SocketAddr::from(([127, 0, 0, 1], 7100)))
        );
        assert_eq!(
            "unix:/tmp/t.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix(PathBuf::from("/tmp/t.sock"))
        );
    }

    /// (Review of 52e1a60.) The round trip holds for the paths that parse, and an
    /// `Endpoint::Unix` built with a longer one displays as text that is refused.
    #[test]
    fn a_unix_endpoint_with_a_utf8_path_displays_to_text_that_parses_back() {
        let longest = Endpoint::Unix(PathBuf::from(format!(
            "/{}",
            "s".repeat(UNIX_PATH_BYTES_MAX - 1)
        )));
        assert_eq!(longest.to_string().parse::<Endpoint>().ok(), Some(longest));
        let longer = Endpoint::Unix(PathBuf::from(format!(
            "/{}",
            "s".repeat(UNIX_PATH_BYTES_MAX)
        )));
        assert!(longer.to_string().parse::<Endpoint>().is_err());
    }

    #[test]
    fn bad_endpoints_are_refused_naming_the_text() {
        for text in [
            "",
            "unix:",
            "unix:/tmp/a\0b.sock",
            &format!("unix:/{}", "s".repeat(UNIX_PATH_BYTES_MAX)),
            "localhost:7100",
            "127.0.0.1",
            "127.0.0.1:99999",
        ] {
            let err = text.parse::<Endpoint>().unwrap_err();
            assert_eq!(err.text, text);
            assert!(
                err.to_string().starts_with(&format!("endpoint: {text:?}")),
                "{err}"
            );
        }
    }
}
