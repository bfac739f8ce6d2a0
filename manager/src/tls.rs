//! TLS on the data channel: the manager's serving configuration (TLS 1.3 only,
//! rustls on ring, no client certificates) built from the PEM files the
//! client's install puts in Secret `kvpn-manager-tls` (mounted at
//! /etc/kvpn/tls). The only I/O here is reading those two files; the handshake
//! itself runs in [`crate::server`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why the TLS configuration cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A PEM file cannot be read.
    #[error(
        "cannot read {what} {path}: {source} — check --tls-cert/--tls-key (KVPN_TLS_CERT/KVPN_TLS_KEY) and the mounted Secret"
    )]
    Read {
        /// "certificate" or "private key".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The certificate PEM holds no usable certificate.
    #[error("no certificate in the certificate PEM{0} — expected a \"BEGIN CERTIFICATE\" block")]
    NoCertificate(String),
    /// The key PEM holds no usable private key.
    #[error(
        "no private key in the key PEM: {0} — expected a PKCS#8, PKCS#1 or SEC1 \"PRIVATE KEY\" block"
    )]
    NoKey(String),
    /// rustls refused the pair (key does not match the certificate, unsupported key type).
    #[error("the certificate and key cannot be used for TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Build the manager's TLS 1.3 server configuration from a PEM certificate
/// chain (the serving certificate first) and a PEM private key.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::NoCertificate(format!(": {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(String::new()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::NoKey(e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    // Laptops keep one long-lived connection and never resume: no tickets.
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// [`server_config_from_pem`] from the files `cert` and `key`.
pub fn load_server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let read = |what, path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            what,
            path: path.to_owned(),
            source,
        })
    };
    server_config_from_pem(&read("certificate", cert)?, &read("private key", key)?)
}
