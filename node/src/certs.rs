//! Cluster certificates: a CA, and per node a certificate naming `node-<id>.tally`.
//!
//! `tally certs` writes them; tests and the demo make them in a temporary directory. The
//! node id a peer may speak for is the one its certificate names (see `tls`).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use tally_crdt::NodeId;

/// Why certificates could not be made or written.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused.
    #[error("certs: {0}")]
    Generate(#[from] rcgen::Error),
    /// A file could not be read or written.
    #[error("certs: {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
    /// Node ids start at 1: 0 marks an application's check ids at the region.
    #[error("certs: node id 0 is reserved; node ids are at least 1")]
    NodeZero,
}

/// The DNS name a node's certificate carries, and that peers check.
pub fn server_name(node: NodeId) -> String {
    format!("node-{}.tally", node.0)
}

/// The files of one node's identity in a certificate directory.
#[derive(Debug, Clone)]
pub struct NodeFiles {
    /// The cluster CA certificate.
    pub ca: PathBuf,
    /// The node's certificate.
    pub cert: PathBuf,
    /// The node's key.
    pub key: PathBuf,
}

impl NodeFiles {
    /// Where `node`'s files are in `dir`.
    pub fn in_dir(dir: &Path, node: NodeId) -> NodeFiles {
        NodeFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("node-{}.pem", node.0)),
            key: dir.join(format!("node-{}.key", node.0)),
        }
    }
}

/// A cluster CA able to sign node certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl Ca {
    /// A new CA named `common_name`.
    pub fn generate(common_name: &str) -> Result<Ca, CertError> {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA in `dir` (`ca.pem`, `ca.key`), or a new one written there.
    pub fn load_or_create(dir: &Path) -> Result<Ca, CertError> {
        let (cert_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        if cert_path.exists() && key_path.exists() {
            let cert_pem = read(&cert_path)?;
            let key = KeyPair::from_pem(&read(&key_path)?)?;
            let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
            return Ok(Ca { issuer, cert_pem });
        }
        let ca = Ca::generate("tally cluster CA")?;
        write(&cert_path, &ca.cert_pem)?;
        write(&key_path, &ca.issuer.key().serialize_pem())?;
        Ok(ca)
    }

    /// A certificate and key for `node`, signed by this CA: PEM texts.
    pub fn issue(&self, node: NodeId) -> Result<(String, String), CertError> {
        let name = server_name(node);
        let mut params = CertificateParams::new(vec![name.clone()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// Writes `node`'s certificate and key into `dir`, next to `ca.pem`.
    pub fn write_node(&self, dir: &Path, node: NodeId) -> Result<NodeFiles, CertError> {
        let files = NodeFiles::in_dir(dir, node);
        let (cert, key) = self.issue(node)?;
        write(&files.cert, &cert)?;
        write(&files.key, &key)?;
        if !files.ca.exists() {
            write(&files.ca, &self.cert_pem)?;
        }
        Ok(files)
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }
}

/// Makes (or reuses) the CA in `dir` and writes a certificate for each of `nodes`.
pub fn write_cluster(dir: &Path, nodes: &[NodeId]) -> Result<Vec<NodeFiles>, CertError> {
    if nodes.contains(&NodeId(0)) {
        return Err(CertError::NodeZero);
    }
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io {
        path: dir.to_owned(),
        source,
    })?;
    let ca = Ca::load_or_create(dir)?;
    nodes.iter().map(|&node| ca.write_node(dir, node)).collect()
}

fn read(path: &Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::Io {
        path: path.to_owned(),
        source,
    })
}

fn write(path: &Path, text: &str) -> Result<(), CertError> {
    std::fs::write(path, text).map_err(|source| CertError::Io {
        path: path.to_owned(),
        source,
    })
}
