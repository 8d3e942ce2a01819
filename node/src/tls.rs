//! Mutual TLS for QUIC between nodes: every peer presents a certificate from the cluster
//! CA, and the node id it may speak for is the one its certificate names.
//!
//! A dialing node names the peer it expects (`node-<id>.tally`), so rustls refuses a server
//! whose certificate names another node. An accepting node requires a client certificate
//! from the CA and reads the node id from it; frames claiming any other origin are dropped
//! by the gossip and close the connection (see `transport`). No 0-RTT: rustls' defaults
//! leave early data off on both sides, and nothing here turns it on.

use crate::certs::server_name;
use crate::config::TlsConfig;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tally_crdt::NodeId;

/// The ALPN protocol name of node-to-node QUIC.
pub const ALPN: &[u8] = b"tally/1";

/// How long a connection with nothing to send waits before it pings its peer.
pub const KEEP_ALIVE: Duration = Duration::from_secs(1);

/// How long a connection lives that hears nothing from its peer: three keep-alives, each
/// of which a live peer acknowledges within a round trip. While a link is cut, QUIC's
/// probes for what it lost back off, doubling, so a connection that outlives the cut can
/// stay silent after the heal for about as long as the cut lasted. Past this timeout the
/// connection ends instead, and the next frame to the peer dials a new one, which gets
/// through once the cut heals (docs/protocol.md, "After a partition heals"). It was 10 s
/// until session 45: a cut of 4 s then kept an edge's exact checks unavailable 4.6 s after
/// its heal.
///
/// The cost: a node whose runtime thread stalls this long (a paused process, or the final
/// sync of a compaction's copy on a slow disk, `compaction.rs`) loses its connections,
/// and it and its peers dial anew, at about 20 ms of CPU a connection. What was in flight
/// on them is repaired as after any broken connection: gossip by anti-entropy, exact
/// checks sent again under their request ids.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the TLS identity could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("tls: {path}: {why}")]
    File {
        /// The config key that named the file (`tls.ca`, `tls.cert` or `tls.key`): one
        /// file may be named by two (a certificate given as the CA, say).
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
    /// The node's own certificate names another node id.
    #[error("tls: {path}: the certificate is for {found}, but this node is node {node}")]
    WrongNode {
        /// The certificate file.
        path: PathBuf,
        /// What it names.
        found: String,
        /// The configured node id.
        node: u64,
    },
    /// Peers would not take the node's own certificate at one end of a connection: it does
    /// not chain to the cluster CA it was given, or is not issued for serving or for
    /// connecting. Peers would refuse its handshakes and it theirs, and it would decide
    /// alone.
    #[error(
        "tls: {cert}: peers would not take it under the CA in {ca} ({why}): this node and \
         its peers would refuse each other's handshakes; give the cluster's CA and a \
         certificate it issued for serving and connecting, as `tally certs` makes"
    )]
    NotFromCa {
        /// The certificate file.
        cert: PathBuf,
        /// The CA file.
        ca: PathBuf,
        /// The end peers would refuse it at ("for serving", "for connecting"), and what
        /// the verification said.
        why: String,
    },
    /// rustls or quinn refused the configuration.
    #[error("tls: {0}")]
    Config(String),
    /// The node's own certificate is not valid now: every peer would refuse it.
    #[error(
        "tls: {path}: the certificate is valid from {from} to {until} (unix seconds), not at \
         {now}; issue a new one with `tally certs`"
    )]
    NotValidNow {
        /// The certificate file.
        path: PathBuf,
        /// Its first valid second.
        from: i64,
        /// Its last valid second.
        until: i64,
        /// This machine's clock.
        now: i64,
    },
}

/// What one node needs for QUIC: its server and client configurations.
pub struct Identity {
    /// For accepting peers.
    pub server: quinn::ServerConfig,
    /// For dialing peers.
    pub client: quinn::ClientConfig,
    /// When the node's own certificate stops being valid, in unix seconds.
    pub expires_unix_secs: i64,
    /// The keys of the endpoint's stateless resets and of its connection ids, derived
    /// from the node's private key: the same in every life of the node, so that a life
    /// started after a crash takes the connection ids of the last one as its own and
    /// resets the connections peers still hold to it at their next packet, instead of
    /// their waiting out the idle timeout. (quinn's defaults are random keys per process:
    /// the next life drops those packets, and peers would ignore its resets.)
    pub endpoint_keys: EndpointKeys,
}

/// See [`Identity::endpoint_keys`].
#[derive(Debug, Clone, Copy)]
pub struct EndpointKeys {
    /// The HMAC key of stateless reset tokens.
    pub reset: [u8; 32],
    /// The HMAC key that signs connection ids, so that the endpoint knows its own.
    pub connection_id: [u8; 32],
}

/// Loads the node's certificate files and builds both QUIC configurations. Refuses a
/// certificate that does not name `node`.
pub fn identity(files: &TlsConfig, node: NodeId) -> Result<Identity, TlsError> {
    let Tls {
        server,
        client,
        expires_unix_secs,
        endpoint_keys,
    } = tls(files, node)?;
    let server = quinn::crypto::rustls::QuicServerConfig::try_from(server)
        .map_err(|err| TlsError::Config(err.to_string()))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(transport());
    let client = quinn::crypto::rustls::QuicClientConfig::try_from(client)
        .map_err(|err| TlsError::Config(err.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client));
    client.transport_config(transport());
    Ok(Identity {
        server,
        client,
        expires_unix_secs,
        endpoint_keys,
    })
}

/// The TLS half of an [`Identity`].
struct Tls {
    server: rustls::ServerConfig,
    client: rustls::ClientConfig,
    expires_unix_secs: i64,
    endpoint_keys: EndpointKeys,
}

/// The endpoint keys of a node whose private key is `key`: hashes of it, each under a
/// label of its own, so that the private key itself keys nothing else.
fn endpoint_keys(key: &PrivateKeyDer<'_>) -> EndpointKeys {
    let derive = |label: &[u8]| {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        context.update(label);
        context.update(key.secret_der());
        let mut out = [0; 32];
        out.copy_from_slice(context.finish().as_ref());
        out
    };
    EndpointKeys {
        reset: derive(b"tally stateless reset key 1\0"),
        connection_id: derive(b"tally connection id key 1\0"),
    }
}

/// Loads the node's certificate files and builds both TLS configurations: TLS 1.3 only,
/// peers verified against the cluster CA both ways, no session resumption.
fn tls(files: &TlsConfig, node: NodeId) -> Result<Tls, TlsError> {
    let ca = certs("tls.ca", &files.ca)?;
    let chain = certs("tls.cert", &files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|err| TlsError::File {
        key: "tls.key",
        path: files.key.clone(),
        why: err.to_string(),
    })?;
    match chain.first().map(node_of) {
        Some(Ok(found)) if found == node => {}
        Some(Ok(found)) => {
            return Err(TlsError::WrongNode {
                path: files.cert.clone(),
                found: server_name(found),
                node: node.0,
            })
        }
        Some(Err(why)) => {
            return Err(TlsError::File {
                key: "tls.cert",
                path: files.cert.clone(),
                why,
            })
        }
        None => {
            return Err(TlsError::File {
                key: "tls.cert",
                path: files.cert.clone(),
                why: "no certificate in the file".into(),
            })
        }
    }
    let expires_unix_secs = valid_now(&files.cert, &chain[0])?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in ca {
        roots.add(cert).map_err(|err| TlsError::File {
            key: "tls.ca",
            path: files.ca.clone(),
            why: format!("not a CA certificate rustls takes: {err}"),
        })?;
    }
    let roots = Arc::new(roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config_err = |err: rustls::Error| TlsError::Config(err.to_string());
    // The key is refused with the certificate it goes with: another node's key, or a kind
    // rustls does not take.
    let key_err = |err: rustls::Error| TlsError::File {
        key: "tls.key",
        path: files.key.clone(),
        why: format!(
            "does not go with the certificate in {}: {err}",
            files.cert.display()
        ),
    };

    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|err| TlsError::Config(err.to_string()))?;
    // As a peer would verify it, at either end: a certificate not issued for serving (no
    // `serverAuth` use) lets a node connect out while every connection to it is refused
    // (found in review, session 55: checked only as a client's, it was taken at start).
    let not_from_ca = |role| {
        move |err: rustls::Error| TlsError::NotFromCa {
            cert: files.cert.clone(),
            ca: files.ca.clone(),
            why: format!("for {role}: {err}"),
        }
    };
    let now = rustls::pki_types::UnixTime::now();
    verifier
        .verify_client_cert(&chain[0], &chain[1..], now)
        .map_err(not_from_ca("connecting"))?;
    let name = rustls::pki_types::ServerName::try_from(server_name(node))
        .map_err(|err| TlsError::Config(err.to_string()))?;
    rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|err| TlsError::Config(err.to_string()))?
        .verify_server_cert(&chain[0], &chain[1..], &name, &[], now)
        .map_err(not_from_ca("serving"))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(key_err)?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    no_resumption(&mut server);

    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(config_err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key.clone_key())
        .map_err(key_err)?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    client.resumption = rustls::client::Resumption::disabled();
    Ok(Tls {
        server,
        client,
        expires_unix_secs,
        endpoint_keys: endpoint_keys(&key),
    })
}

/// Turns TLS session resumption off: a resumed handshake takes the peer's certificate
/// from the session it resumes, without verifying it again, so a certificate that expired
/// since (or a CA no longer trusted) would go on being accepted for as long as the peer
/// reconnects within a ticket's life. Every handshake is a full one; connections are
/// long-lived, so that costs little.
fn no_resumption(server: &mut rustls::ServerConfig) {
    server.send_tls13_tickets = 0;
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
}

/// When `cert` (read from `path`) stops being valid, if it is valid now by this machine's
/// clock.
fn valid_now(path: &std::path::Path, cert: &CertificateDer<'_>) -> Result<i64, TlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|err| TlsError::File {
        key: "tls.cert",
        path: path.to_owned(),
        why: format!("certificate does not parse: {err}"),
    })?;
    let validity = parsed.validity();
    let (from, until) = (
        validity.not_before.timestamp(),
        validity.not_after.timestamp(),
    );
    let now = (crate::clock::wall().0 / 1_000) as i64;
    if now < from || now > until {
        return Err(TlsError::NotValidNow {
            path: path.to_owned(),
            from,
            until,
            now,
        });
    }
    Ok(until)
}

/// The node id a certificate names in its one `node-<id>.tally` DNS name, written as
/// [`server_name`] writes it (no sign, no leading zero), so that the name a dialling node
/// checks and the id an accepting node reads are the same one.
pub fn node_of(cert: &CertificateDer<'_>) -> Result<NodeId, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert)
        .map_err(|err| format!("certificate does not parse: {err}"))?;
    let names = cert
        .subject_alternative_name()
        .map_err(|err| format!("subject alternative names do not parse: {err}"))?
        .ok_or("the certificate has no subject alternative name")?;
    let mut nodes = names
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => dns
                .strip_prefix("node-")
                .and_then(|rest| rest.strip_suffix(".tally"))
                .map(|id| (*dns, id)),
            _ => None,
        });
    let (Some((dns, id)), None) = (nodes.next(), nodes.next()) else {
        return Err("the certificate must name exactly one node-<id>.tally".to_owned());
    };
    id.parse()
        .ok()
        // No node has id 0 (it marks an application's check ids at the region).
        .filter(|&id| id > 0)
        .map(NodeId)
        .filter(|&node| server_name(node) == dns)
        .ok_or_else(|| format!("{dns:?} does not name a node id of at least 1 in digits"))
}

/// Bounds on what one peer may make this node hold: a few streams, small windows.
fn transport() -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_uni_streams(4u32.into())
        // Region sessions: an edge keeps one, and opens another when one breaks.
        .max_concurrent_bidi_streams(8u32.into())
        .stream_receive_window((1u32 << 20).into())
        .receive_window((4u32 << 20).into())
        .send_window(4 << 20)
        // Nothing is sent as a datagram: a peer's would only be buffered, unread.
        .datagram_receive_buffer_size(None)
        .keep_alive_interval(Some(KEEP_ALIVE))
        .max_idle_timeout(Some(
            IDLE_TIMEOUT
                .try_into()
                .expect("invariant: IDLE_TIMEOUT is a valid QUIC idle timeout"),
        ));
    Arc::new(transport)
}

/// The certificates in `path`, the file config key `key` names.
fn certs(key: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file_err = |why: String| TlsError::File {
        key,
        path: path.to_owned(),
        why,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|err| file_err(err.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| file_err(err.to_string()))?;
    if certs.is_empty() {
        return Err(file_err("no certificate in the file".into()));
    }
    Ok(certs)
}

/// Who a peer is, by the certificate it presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// The node the certificate names.
    pub node: NodeId,
    /// When the certificate stops being valid: its `notAfter`, unix seconds.
    pub expires_unix_secs: i64,
}

/// The peer's node id and its certificate's end, from the certificate it presented on
/// `connection`.
pub fn peer(connection: &quinn::Connection) -> Result<Peer, String> {
    let identity = connection
        .peer_identity()
        .ok_or("the peer presented no certificate")?;
    let chain = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| "the peer identity is not a certificate chain")?;
    let cert = chain
        .first()
        .ok_or("the peer's certificate chain is empty")?;
    let node = node_of(cert)?;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert)
        .map_err(|err| format!("certificate does not parse: {err}"))?;
    Ok(Peer {
        node,
        expires_unix_secs: parsed.validity().not_after.timestamp(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::Ca;

    #[test]
    fn a_node_certificate_names_its_node_id() {
        let ca = Ca::generate("test").unwrap();
        let (cert, _) = ca.issue(NodeId(42)).unwrap();
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert_eq!(node_of(&der), Ok(NodeId(42)));
        // Node 0 is reserved for applications' check ids: a certificate for it names none.
        let (cert, _) = ca.issue(NodeId(0)).unwrap();
        let der = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        assert!(node_of(&der).is_err());
        let dir = std::env::temp_dir().join(format!("tally-tls-zero-{}", std::process::id()));
        assert!(matches!(
            crate::certs::write_cluster(&dir, &[NodeId(1), NodeId(0)]),
            Err(crate::certs::CertError::NodeZero)
        ));
    }

    #[test]
    fn a_certificate_must_name_exactly_one_node_as_server_name_writes_it() {
        let named = |names: &[&str]| {
            let names = names
                .iter()
                .map(|name| name.to_string())
                .collect::<Vec<_>>();
            let params = rcgen::CertificateParams::new(names).unwrap();
            let cert = params
                .self_signed(&rcgen::KeyPair::generate().unwrap())
                .unwrap();
            node_of(cert.der())
        };
        assert_eq!(named(&["node-5.tally"]), Ok(NodeId(5)));
        assert_eq!(named(&["other.example", "node-5.tally"]), Ok(NodeId(5)));
        for bad in [
            &["node-05.tally"][..],
            &["node-+5.tally"],
            &["node-.tally"],
            &["node-5.tally", "node-6.tally"],
            &["other.example"],
        ] {
            assert!(named(bad).is_err(), "{bad:?}: {:?}", named(bad));
        }
    }

    #[test]
    fn session_resumption_is_off_so_every_handshake_verifies_the_certificate() {
        let dir = std::env::temp_dir().join(format!("tally-tls-resume-{}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[NodeId(2)]).unwrap();
        let config = files[0].tls_config();
        let Tls { server, client, .. } = tls(&config, NodeId(2)).unwrap();
        assert_eq!(server.send_tls13_tickets, 0, "the server sends no tickets");
        assert!(!server.session_storage.can_cache(), "nor caches sessions");
        // rustls shows no more of a client's resumption than its Debug form.
        let resumption = |resumption: &rustls::client::Resumption| format!("{resumption:?}");
        let no_store = "NoClientSessionStorage";
        assert!(!resumption(&rustls::client::Resumption::default()).contains(no_store));
        assert!(
            resumption(&client.resumption).contains(no_store),
            "the client keeps no sessions: {:?}",
            client.resumption
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_expired_or_not_yet_valid_certificate_is_refused_at_start_naming_it() {
        let dir = std::env::temp_dir().join(format!("tally-tls-dates-{}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[NodeId(2)]).unwrap();
        let ca = crate::certs::Ca::load_or_create(&dir).unwrap();
        let config = files[0].tls_config();
        let expires = identity(&config, NodeId(2)).unwrap().expires_unix_secs;
        let now = (crate::clock::wall().0 / 1_000) as i64;
        assert!(expires > now + 700 * 86_400, "two years ahead: {expires}");
        let at = |secs: i64| time::OffsetDateTime::from_unix_timestamp(secs).unwrap();
        for (from, until) in [(now - 7_200, now - 3_600), (now + 3_600, now + 7_200)] {
            let (cert, key) = ca.issue_valid(NodeId(2), at(from), at(until)).unwrap();
            std::fs::write(&files[0].cert, cert).unwrap();
            std::fs::write(&files[0].key, key).unwrap();
            let err = identity(&config, NodeId(2)).err().unwrap().to_string();
            assert!(
                err.contains("node-2.pem") && err.contains("not at"),
                "{err}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_certificate_for_another_node_is_refused_at_start() {
        let dir = std::env::temp_dir().join(format!("tally-tls-{}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[NodeId(2)]).unwrap();
        let config = files[0].tls_config();
        assert!(identity(&config, NodeId(2)).is_ok());
        let err = identity(&config, NodeId(3)).err().unwrap().to_string();
        assert!(
            err.contains("node-2.tally") && err.contains("node 3"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_certificate_from_another_ca_is_refused_at_start_naming_both_files() {
        let dir = std::env::temp_dir().join(format!("tally-tls-ca-{}", std::process::id()));
        let ours = crate::certs::write_cluster(&dir.join("ours"), &[NodeId(1)]).unwrap();
        let theirs = crate::certs::write_cluster(&dir.join("theirs"), &[NodeId(1)]).unwrap();
        let mut config = ours[0].tls_config();
        config.ca = theirs[0].tls_config().ca;
        let err = identity(&config, NodeId(1)).err().unwrap().to_string();
        assert!(
            err.contains("ours/node-1.pem") && err.contains("theirs/ca.pem"),
            "{err}"
        );
        // A node's own certificate given as the CA is refused too.
        config.ca = ours[0].tls_config().cert;
        assert!(identity(&config, NodeId(1)).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_certificate_peers_would_not_take_for_both_ends_is_refused_at_start() {
        let dir = std::env::temp_dir().join(format!("tally-tls-usage-{}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[NodeId(3)]).unwrap();
        let config = files[0].tls_config();
        let ca_key = std::fs::read_to_string(dir.join("ca.key")).unwrap();
        let ca_pem = std::fs::read_to_string(&config.ca).unwrap();
        let issuer =
            rcgen::Issuer::from_ca_cert_pem(&ca_pem, rcgen::KeyPair::from_pem(&ca_key).unwrap())
                .unwrap();
        use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
        for (usage, missing) in [(ClientAuth, "serving"), (ServerAuth, "connecting")] {
            let mut params = rcgen::CertificateParams::new(vec![server_name(NodeId(3))]).unwrap();
            params.extended_key_usages = vec![usage];
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(&config.cert, cert.pem()).unwrap();
            std::fs::write(&config.key, key.serialize_pem()).unwrap();
            let err = identity(&config, NodeId(3)).err().unwrap().to_string();
            assert!(
                err.contains("node-3.pem") && err.contains(missing),
                "without {missing}: {err}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn another_nodes_key_is_refused_at_start_naming_the_key_file() {
        let dir = std::env::temp_dir().join(format!("tally-tls-key-{}", std::process::id()));
        let files = crate::certs::write_cluster(&dir, &[NodeId(1), NodeId(2)]).unwrap();
        let mut config = files[0].tls_config();
        config.key = files[1].key.clone();
        let err = identity(&config, NodeId(1)).err().unwrap().to_string();
        assert!(
            err.contains("node-2.key") && err.contains("node-1.pem"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
