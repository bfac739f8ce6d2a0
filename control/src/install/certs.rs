//! The manager's TLS material: a CA of its own and a serving certificate signed by
//! it, generated with rcgen (ECDSA P-256), and the check that a stored set still
//! serves the current Service (verified with rustls' WebPKI verifier, the same code
//! the client's TLS handshake runs). Pure: no I/O; the Secret is read and written by
//! the install shell.
//!
//! Why a CA and not a self-signed leaf: the client pins `ca.crt` from the Secret,
//! and a CA-signed leaf is what rustls' WebPKI verifier accepts (it refuses a
//! self-signed end-entity certificate as its own trust anchor). The CA key is not
//! kept: when the certificate must change (a new ClusterIP), kvpn makes a new CA,
//! and clients read the new `ca.crt` from the Secret anyway.
//!
//! Validity: rcgen's defaults (1975 – 4096). The CA is private to one manager and
//! pinned by clients that read it from the cluster, so expiry would only add an
//! outage without adding safety; rotation is "delete the Secret".

use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{RootCertStore, sign::CertifiedKey};

use super::objects;

/// CA certificate, serving certificate and its key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsMaterial {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the private key.
        f.debug_struct("TlsMaterial")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

/// A fresh CA and a serving certificate for the manager Service in `namespace`:
/// SANs = [`objects::service_dns_names`] plus `cluster_ip` when known.
pub fn generate(namespace: &str, cluster_ip: Option<IpAddr>) -> Result<TlsMaterial, rcgen::Error> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kvpn manager CA ({namespace})"));
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_pem = ca.self_signed(&ca_key)?.pem();
    let issuer = Issuer::new(ca, ca_key);

    let mut sans = objects::service_dns_names(namespace);
    if let Some(ip) = cluster_ip {
        sans.push(ip.to_string());
    }
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(sans)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, objects::server_name(namespace));
    leaf.distinguished_name = dn;
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    let cert_pem = leaf.signed_by(&key, &issuer)?.pem();
    Ok(TlsMaterial {
        ca_pem,
        cert_pem,
        key_pem: key.serialize_pem(),
    })
}

/// The material stored in a Secret (`ca.crt`, `tls.crt`, `tls.key`).
pub fn from_secret(secret: &Secret) -> Result<TlsMaterial, String> {
    let data = secret.data.as_ref().ok_or("the Secret has no data")?;
    let field = |k: &str| -> Result<String, String> {
        let v = data.get(k).ok_or_else(|| format!("no {k}"))?;
        String::from_utf8(v.0.clone()).map_err(|_| format!("{k} is not PEM text"))
    };
    Ok(TlsMaterial {
        ca_pem: field("ca.crt")?,
        cert_pem: field("tls.crt")?,
        key_pem: field("tls.key")?,
    })
}

/// Checks that `m` is usable for the manager in `namespace`: the key belongs to the
/// certificate, and the certificate chains to `ca.crt` and is valid now for the
/// Service's DNS name and for each of `ips` (the ClusterIP). Err says why not.
pub fn check(m: &TlsMaterial, namespace: &str, ips: &[IpAddr]) -> Result<(), String> {
    let ca = CertificateDer::from_pem_slice(m.ca_pem.as_bytes())
        .map_err(|e| format!("ca.crt is not a PEM certificate: {e}"))?;
    let leaf = CertificateDer::from_pem_slice(m.cert_pem.as_bytes())
        .map_err(|e| format!("tls.crt is not a PEM certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(m.key_pem.as_bytes())
        .map_err(|e| format!("tls.key is not a PEM private key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    CertifiedKey::from_der(vec![leaf.clone()], key, &provider)
        .map_err(|e| format!("tls.key does not belong to tls.crt: {e}"))?;
    let mut roots = RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| format!("ca.crt is not a usable CA certificate: {e}"))?;
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| format!("cannot build a verifier for ca.crt: {e}"))?;
    let mut names = vec![
        ServerName::try_from(objects::server_name(namespace))
            .map_err(|e| format!("namespace {namespace:?} gives no valid DNS name: {e}"))?,
    ];
    names.extend(ips.iter().map(|ip| ServerName::IpAddress((*ip).into())));
    for name in names {
        verifier
            .verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
            .map_err(|e| format!("tls.crt is not valid for {}: {e}", name.to_str()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_material_verifies_for_service_names_and_cluster_ip() {
        let ip: IpAddr = "10.96.0.42".parse().expect("ip");
        let m = generate("kvpn-system", Some(ip)).expect("generate");
        check(&m, "kvpn-system", &[ip]).expect("valid");
        // Another ClusterIP or namespace is not covered.
        let other: IpAddr = "10.96.0.43".parse().expect("ip");
        let err = check(&m, "kvpn-system", &[other]).expect_err("other IP");
        assert!(err.contains("10.96.0.43"), "{err}");
        check(&m, "elsewhere", &[]).expect_err("other namespace");
    }

    #[test]
    fn mismatched_key_or_foreign_ca_is_refused() {
        let a = generate("ns", None).expect("a");
        let b = generate("ns", None).expect("b");
        let mixed_key = TlsMaterial {
            key_pem: b.key_pem.clone(),
            ..a.clone()
        };
        let err = check(&mixed_key, "ns", &[]).expect_err("foreign key");
        assert!(err.contains("does not belong"), "{err}");
        let foreign_ca = TlsMaterial {
            ca_pem: b.ca_pem.clone(),
            ..a.clone()
        };
        check(&foreign_ca, "ns", &[]).expect_err("foreign CA");
        let garbage = TlsMaterial {
            cert_pem: "not pem".into(),
            ..a
        };
        let err = check(&garbage, "ns", &[]).expect_err("garbage");
        assert!(err.contains("tls.crt"), "{err}");
    }
}
