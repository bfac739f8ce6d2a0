//! The lab cluster's certificates, made with rcgen (ECDSA P-256, PEM): one CA that
//! signs every serving and client certificate, and the service-account key pair.
//! Pure: builds PEM strings; [`super::control_plane`] writes them to `pki/`.
//!
//! Go's TLS stack checks extended key usages, so serving certificates carry
//! `serverAuth` and client certificates `clientAuth`. Kubernetes reads a client
//! certificate's CN as the user name and its O entries as groups.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// What a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// A TLS server (apiserver, later the kubelet stand-in).
    Server,
    /// A TLS client (users, controller-manager, the apiserver towards kubelets).
    Client,
}

/// What to put into an issued certificate.
#[derive(Debug, Clone)]
pub struct CertSpec {
    /// Subject CN: the user name for client certificates.
    pub common_name: String,
    /// Subject O entries: the groups for client certificates.
    pub organizations: Vec<String>,
    /// Subject alternative names: IP addresses or DNS names (servers).
    pub sans: Vec<String>,
    pub usage: Usage,
}

impl CertSpec {
    /// A client certificate for `user` in `groups`.
    pub fn client(user: &str, groups: &[&str]) -> Self {
        CertSpec {
            common_name: user.to_owned(),
            organizations: groups.iter().map(|g| (*g).to_owned()).collect(),
            sans: Vec::new(),
            usage: Usage::Client,
        }
    }

    /// A serving certificate named `cn` valid for `sans` (IPs or DNS names).
    pub fn server(cn: &str, sans: &[String]) -> Self {
        CertSpec {
            common_name: cn.to_owned(),
            organizations: Vec::new(),
            sans: sans.to_vec(),
            usage: Usage::Server,
        }
    }
}

/// A certificate and its private key, PEM encoded.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

/// The lab cluster's CA.
pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

impl CertificateAuthority {
    /// A new self-signed CA named `common_name`.
    pub fn generate(common_name: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::generate()?;
        let params = ca_params(common_name);
        let cert_pem = params.self_signed(&key)?.pem();
        Ok(CertificateAuthority {
            issuer: Issuer::new(params, key),
            cert_pem,
        })
    }

    /// The CA written earlier by [`Self::generate`] with the same `common_name`:
    /// the issuer name and key identifier follow from the name and the key, so
    /// certificates issued now chain to the stored `cert_pem`.
    pub fn load(common_name: &str, cert_pem: &str, key_pem: &str) -> Result<Self, rcgen::Error> {
        let key = KeyPair::from_pem(key_pem)?;
        Ok(CertificateAuthority {
            issuer: Issuer::new(ca_params(common_name), key),
            cert_pem: cert_pem.to_owned(),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// Issues a certificate with a fresh key.
    pub fn issue(&self, spec: &CertSpec) -> Result<IssuedCert, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(spec.sans.clone())?;
        let mut dn = DistinguishedName::new();
        for org in &spec.organizations {
            dn.push(DnType::OrganizationName, org.as_str());
        }
        dn.push(DnType::CommonName, spec.common_name.as_str());
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![match spec.usage {
            Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// The service-account token signing key pair: (private key PEM, public key PEM).
pub fn service_account_key_pair() -> Result<(String, String), rcgen::Error> {
    let key = KeyPair::generate()?;
    Ok((key.serialize_pem(), key.public_key_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_cert_is_pem_and_differs_from_the_ca() {
        let ca = CertificateAuthority::generate("kvpn-lab-ca test").expect("ca");
        let leaf = ca
            .issue(&CertSpec::server(
                "kube-apiserver",
                &["127.0.0.1".into(), "localhost".into()],
            ))
            .expect("leaf");
        assert!(leaf.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(leaf.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        assert_ne!(leaf.cert_pem, ca.cert_pem());
    }

    #[test]
    fn reloaded_ca_keeps_its_key() {
        let ca = CertificateAuthority::generate("kvpn-lab-ca reload").expect("ca");
        let again = CertificateAuthority::load("kvpn-lab-ca reload", ca.cert_pem(), &ca.key_pem())
            .expect("load");
        assert_eq!(again.key_pem(), ca.key_pem());
        again
            .issue(&CertSpec::client("someone", &["a"]))
            .expect("issue");
    }
}
