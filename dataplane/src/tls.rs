//! TLS client side of the data channel: the manager's certificate is verified
//! against exactly one CA, the one the CLI read from Secret `kvpn-manager-tls`
//! and passed in the Connect request (the root daemon itself reads no
//! Kubernetes credentials), and against the name the CLI gave. TLS 1.3 only,
//! rustls on ring. The handshake runs over whatever byte stream the session
//! dialled (TCP to the manager, or to the port-forward agent on loopback).
//!
//! I/O: none here besides the handshake on the given stream.

use std::fmt;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};

/// Why the TLS settings of a Connect request are unusable.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    /// A CA but no server name, or the reverse.
    #[error("tls_ca_pem and tls_server_name must be given together (both empty = plain TCP)")]
    Incomplete,
    /// The CA PEM holds no certificate or a malformed one.
    #[error(
        "tls_ca_pem holds no usable CA certificate: {0} — pass ca.crt of Secret kvpn-manager-tls"
    )]
    BadCa(String),
    /// The server name is neither a DNS name nor an IP address.
    #[error("tls_server_name {0:?} is not a valid DNS name or IP address")]
    BadName(String),
    /// rustls refused the configuration.
    #[error("cannot configure TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A verified-TLS client for one session: the CA it trusts and the name it checks.
#[derive(Clone)]
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// From the Connect request's fields. `Ok(None)` when both are empty (plain TCP).
    pub fn from_request(ca_pem: &str, server_name: &str) -> Result<Option<Self>, TlsConfigError> {
        match (ca_pem.trim().is_empty(), server_name.is_empty()) {
            (true, true) => Ok(None),
            (false, false) => Self::new(ca_pem.as_bytes(), server_name).map(Some),
            _ => Err(TlsConfigError::Incomplete),
        }
    }

    /// Trust only the certificates in `ca_pem`; verify the manager as `server_name`.
    pub fn new(ca_pem: &[u8], server_name: &str) -> Result<Self, TlsConfigError> {
        let mut roots = rustls::RootCertStore::empty();
        let mut found = 0;
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| TlsConfigError::BadCa(e.to_string()))?;
            roots
                .add(cert)
                .map_err(|e| TlsConfigError::BadCa(e.to_string()))?;
            found += 1;
        }
        if found == 0 {
            return Err(TlsConfigError::BadCa(
                "no \"BEGIN CERTIFICATE\" block".to_owned(),
            ));
        }
        let name = ServerName::try_from(server_name.to_owned())
            .map_err(|_| TlsConfigError::BadName(server_name.to_owned()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            server_name: name,
        })
    }

    /// The name the manager's certificate is verified against.
    pub fn server_name(&self) -> String {
        self.server_name.to_str().into_owned()
    }

    /// Run the handshake on `stream`. The error is a user-facing sentence
    /// naming `target`; a certificate problem says "certificate" and the fix.
    pub async fn handshake<S>(
        &self,
        stream: S,
        target: &str,
    ) -> Result<tokio_rustls::client::TlsStream<S>, String>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        // rustls's default 64 KiB send buffer splits a 256 KiB pump batch into
        // about four records-and-write rounds inside one vectored write call;
        // a 1 MiB limit measured no better (1.6-2.5 Gbit/s either way, release,
        // tests/tls.rs throughput test, noise larger than any difference).
        self.connector
            .connect(self.server_name.clone(), stream)
            .await
            .map_err(|e| handshake_error(target, &self.server_name(), &e))
    }
}

/// What a session's reason says when the manager's certificate does not
/// verify against the CA the session was set up with (`kvpn connect` looks for
/// it to replace such a session: its manager was replaced).
pub const CERTIFICATE_MISMATCH: &str = "presented a certificate that does not verify";

fn handshake_error(target: &str, name: &str, e: &std::io::Error) -> String {
    let rustls_error = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match rustls_error {
        Some(rustls::Error::InvalidCertificate(cause)) => format!(
            "the traffic manager at {target} {CERTIFICATE_MISMATCH} as {name}: {} — \
             the traffic manager was probably reinstalled since this session connected (a new CA \
             in Secret kvpn-manager-tls, and none of this laptop's lease): run `kvpn connect` \
             again on this laptop, which replaces this session and reads the new CA",
            certificate_cause(cause)
        ),
        Some(other) => format!(
            "TLS handshake with the traffic manager at {target} failed: {} — is it a kvpn-manager with TLS (--tls-cert/--tls-key)?",
            without_urls(&other.to_string())
        ),
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => format!(
            "TLS handshake with the traffic manager at {target} failed: the connection closed before the manager's certificate arrived — \
             is the manager serving TLS, and is it ready?"
        ),
        None => format!(
            "TLS handshake with the traffic manager at {target} failed: {}",
            without_urls(&e.to_string())
        ),
    }
}

/// Why a certificate did not verify, in words: the common causes by name, the
/// rest as the TLS library says it, without links into its documentation (a
/// status reason names the thing, the cause and the fix, not a web page).
fn certificate_cause(cause: &rustls::CertificateError) -> String {
    use rustls::CertificateError as C;
    match cause {
        C::BadSignature => {
            "its signature does not verify against the CA this session was set up with".to_owned()
        }
        C::UnknownIssuer => {
            "it is issued by a CA other than the one this session was set up with".to_owned()
        }
        C::Expired | C::ExpiredContext { .. } => {
            format!("it has expired ({})", without_urls(&cause.to_string()))
        }
        other => without_urls(&other.to_string()),
    }
}

/// `text` without URLs (and the brackets or "see" left around them).
pub fn without_urls(text: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for word in text.split_whitespace() {
        let bare = word.trim_start_matches(['(', '[', '<']);
        if bare.starts_with("http://") || bare.starts_with("https://") {
            if out
                .last()
                .is_some_and(|w| w.eq_ignore_ascii_case("see") || *w == "(see")
            {
                out.pop();
            }
            continue;
        }
        out.push(word);
    }
    out.join(" ")
        .replace("()", "")
        .replace(" ,", ",")
        .trim_end_matches([' ', ':', ';', ','])
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reasons_carry_no_documentation_urls() {
        assert_eq!(
            without_urls(
                "invalid peer certificate: Other (see https://docs.rs/rustls/latest/rustls/enum.Error.html)"
            ),
            "invalid peer certificate: Other"
        );
        assert_eq!(
            without_urls("bad thing, see <https://example.invalid/x>."),
            "bad thing"
        );
        assert_eq!(without_urls("nothing to strip"), "nothing to strip");
        let bad = certificate_cause(&rustls::CertificateError::BadSignature);
        assert!(bad.contains("does not verify against the CA"), "{bad}");
        assert!(!bad.contains("http"), "{bad}");
    }
}
