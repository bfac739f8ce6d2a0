//! The attach port (`--attach-listen`): the manager's gRPC service over TLS for
//! attached pods' tunnel containers, answering only calls that carry the attach
//! key derived from the manager's TLS key. No key, a wrong key, or plaintext
//! get no lease; the right key gets one, the same again for the same replica
//! client id; the loopback port-forward listener still needs no key.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvpn_manager::lease::LeaseTable;
use kvpn_manager::leases::Leases;
use kvpn_proto::attach::{ATTACH_KEY_HEADER, attach_key, replica_client_id};
use kvpn_proto::manager::manager_client::ManagerClient;
use kvpn_proto::manager::{LeaseRequest, LeaseResponse};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

const SERVER_NAME: &str = "kvpn-manager.kvpn-test.svc";

/// CA PEM, serving certificate PEM and key PEM for [`SERVER_NAME`].
fn material() -> (String, String, String) {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "kvpn attach test CA");
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let ca_pem = ca.self_signed(&ca_key).expect("CA cert").pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("leaf key");
    let mut leaf = CertificateParams::new(vec![SERVER_NAME.to_owned()]).expect("leaf params");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert_pem = leaf.signed_by(&key, &issuer).expect("leaf cert").pem();
    (ca_pem, cert_pem, key.serialize_pem())
}

/// The manager's gRPC service on a loopback port and an attach port; their URLs.
async fn serve(cert_pem: &str, key_pem: &str) -> (String, std::net::SocketAddr) {
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let plain_addr = plain.local_addr().expect("addr");
    let attach = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let attach_addr = attach.local_addr().expect("addr");
    let tls = kvpn_manager::tls::server_config_from_pem(cert_pem.as_bytes(), key_pem.as_bytes())
        .expect("TLS config");
    let leases = Leases::in_memory(LeaseTable::new(
        "100.96.0.0/16".parse().expect("pool"),
        Duration::from_secs(3600),
    ));
    tokio::spawn(kvpn_manager::grpc::serve(
        plain,
        Some(kvpn_manager::grpc::AttachListener {
            listener: attach,
            tls,
            attach_key: attach_key(key_pem.as_bytes()),
        }),
        leases,
        kvpn_manager::route_watch::RouteWatch::unavailable("not in a cluster (test)".into()),
        kvpn_manager::grpc::TraceConfig {
            trace: Arc::default(),
            policy: "snat".into(),
            egress: "lo".into(),
        },
        Arc::default(),
    ));
    (format!("http://{plain_addr}"), attach_addr)
}

/// One gRPC channel over one TLS connection to `addr`, trusting `ca_pem`.
async fn tls_client(
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> ManagerClient<tonic::transport::Channel> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM"))
        .expect("CA usable");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .expect("TLS 1.3")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(SERVER_NAME).expect("name"), tcp)
        .await
        .expect("TLS handshake");
    let slot = Arc::new(Mutex::new(Some(tls)));
    let channel = tonic::transport::Endpoint::from_static("http://attach.test")
        .connect_with_connector(tower::service_fn(move |_| {
            let s = slot.lock().expect("slot").take();
            async move {
                s.map(TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("used"))
            }
        }))
        .await
        .expect("HTTP/2");
    ManagerClient::new(channel)
}

async fn lease_with(
    c: &mut ManagerClient<tonic::transport::Channel>,
    client_id: &str,
    key: Option<&str>,
) -> Result<LeaseResponse, tonic::Status> {
    let mut req = tonic::Request::new(LeaseRequest {
        client_id: client_id.to_owned(),
    });
    if let Some(k) = key {
        req.metadata_mut()
            .insert(ATTACH_KEY_HEADER, k.parse().expect("metadata value"));
    }
    c.lease(req).await.map(tonic::Response::into_inner)
}

#[tokio::test]
async fn the_attach_port_leases_only_with_the_attach_key() {
    let (ca_pem, cert_pem, key_pem) = material();
    let (plain_url, attach_addr) = serve(&cert_pem, &key_pem).await;
    let key = attach_key(key_pem.as_bytes());
    let id = replica_client_id(&key, "0b1c5d2e-1111-4222-8333-444455556666");
    let mut c = tls_client(attach_addr, &ca_pem).await;

    let e = lease_with(&mut c, &id, None).await.expect_err("no key");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("no attach key"), "{e:?}");
    let wrong = attach_key(b"another manager's key");
    let e = lease_with(&mut c, &id, Some(&wrong))
        .await
        .expect_err("wrong key");
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("wrong attach key"), "{e:?}");

    let first = lease_with(&mut c, &id, Some(&key))
        .await
        .expect("lease with the key");
    assert_eq!(first.pool_cidr, "100.96.0.0/16");
    assert_eq!(first.session_token.len(), 64);
    let again = lease_with(&mut c, &id, Some(&key)).await.expect("again");
    assert_eq!(again.tunnel_ip, first.tunnel_ip, "same replica, same lease");
    let other_id = replica_client_id(&key, "0b1c5d2e-1111-4222-8333-777788889999");
    let other = lease_with(&mut c, &other_id, Some(&key))
        .await
        .expect("other replica");
    assert_ne!(
        other.tunnel_ip, first.tunnel_ip,
        "each replica its own lease"
    );

    // Plaintext HTTP/2 to the attach port gets nothing.
    let plaintext = tokio::time::timeout(Duration::from_secs(5), async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{attach_addr}"))?
            .connect()
            .await?;
        let mut p = ManagerClient::new(channel);
        p.lease(LeaseRequest {
            client_id: id.clone(),
        })
        .await
        .map_err(|s| -> Box<dyn std::error::Error + Send + Sync> { Box::new(s) })?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await;
    assert!(
        !matches!(plaintext, Ok(Ok(()))),
        "plaintext lease on the attach port"
    );

    // The port-forward listener (pod loopback) needs no attach key.
    let channel = tonic::transport::Endpoint::from_shared(plain_url)
        .expect("url")
        .connect()
        .await
        .expect("loopback gRPC");
    let mut p = ManagerClient::new(channel);
    p.lease(LeaseRequest {
        client_id: "laptop-1".into(),
    })
    .await
    .expect("a laptop's lease on the loopback port");
}
