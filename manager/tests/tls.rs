//! TLS on the data channel: the listener with a serving certificate from an
//! rcgen CA completes TLS 1.3 sessions with a laptop that trusts that CA, refuses
//! laptops with another CA or expecting another name, survives plain-TCP probes
//! and plaintext clients, and the binary takes the certificate from
//! KVPN_TLS_CERT / KVPN_TLS_KEY and says so in its log.

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvpn_manager::session::SessionConfig;
use kvpn_proto::frame::{self, Hello, Kind, PROTOCOL_VERSION};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;

const SERVER_NAME: &str = "kvpn-manager.kvpn-test.svc";

/// A CA (PEM) and a serving certificate and key it signed for [`SERVER_NAME`].
struct Material {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn material() -> Material {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    // A distinct name per CA, as two installs' CAs have (another namespace, another
    // day); with equal names webpki reports BadSignature instead of UnknownIssuer.
    static SERIAL: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    dn.push(DnType::CommonName, format!("kvpn test CA {serial}"));
    ca.distinguished_name = dn;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let ca_pem = ca.self_signed(&ca_key).expect("CA cert").pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("leaf key");
    let mut leaf = CertificateParams::new(vec![SERVER_NAME.to_owned()]).expect("leaf params");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert_pem = leaf.signed_by(&key, &issuer).expect("leaf cert").pem();
    Material {
        ca_pem,
        cert_pem,
        key_pem: key.serialize_pem(),
    }
}

fn client_config(ca_pem: &str) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM"))
        .expect("CA usable");
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth(),
    )
}

async fn tls_connect(
    addr: SocketAddr,
    ca_pem: &str,
    name: &str,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(name.to_owned()).expect("valid name");
    tokio_rustls::TlsConnector::from(client_config(ca_pem))
        .connect(name, tcp)
        .await
}

/// Send a hello and a heartbeat; return the first frame the manager sends back.
async fn hello_and_heartbeat<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> (Kind, Vec<u8>) {
    let hello = Hello::new(PROTOCOL_VERSION, "100.96.0.2".parse().expect("ip"));
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &hello.encode().expect("hello"), &mut out).expect("fits");
    frame::encode_into(Kind::Heartbeat, b"tls-echo", &mut out).expect("fits");
    s.write_all(&out).await.expect("write hello");
    s.flush().await.expect("flush");
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let mut chunk = [0u8; 64];
            let n = s.read(&mut chunk).await.expect("read heartbeat echo");
            assert!(n > 0, "manager closed the session");
            buf.extend_from_slice(&chunk[..n]);
            // The manager's first stats frame may come before the echo: the
            // answer is the first frame that is not a stats frame.
            if let Some(first) = common::take_first_non_stats(&mut buf) {
                return first;
            }
        }
    })
    .await
    .expect("heartbeat echo within 5 s")
}

#[tokio::test]
async fn tls_listener_serves_trusting_laptops_and_refuses_the_rest() {
    let m = material();
    let server_config =
        kvpn_manager::tls::server_config_from_pem(m.cert_pem.as_bytes(), m.key_pem.as_bytes())
            .expect("server config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = Arc::new(SessionConfig {
        hello_timeout: Duration::from_secs(3),
        ..SessionConfig::default()
    });
    let server = tokio::spawn(kvpn_manager::server::serve(
        listener,
        config,
        Some(server_config),
    ));

    // Readiness-probe style: connect and close, several times.
    for _ in 0..3 {
        drop(TcpStream::connect(addr).await.expect("probe connects"));
    }

    // A plaintext laptop (direct mode against a TLS manager): the manager
    // reads a non-TLS record and closes; no session, no echo.
    let mut plain = TcpStream::connect(addr).await.expect("plain connects");
    let mut hello = Vec::new();
    frame::encode_into(
        Kind::Hello,
        &Hello::new(PROTOCOL_VERSION, "100.96.0.3".parse().expect("ip"))
            .encode()
            .expect("hello"),
        &mut hello,
    )
    .expect("fits");
    frame::encode_into(Kind::Heartbeat, b"12345678", &mut hello).expect("fits");
    plain.write_all(&hello).await.expect("write");
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut got))
        .await
        .expect("the manager closes a plaintext client");
    // It sends at most a TLS alert record (content type 21), never a frame.
    match read {
        Ok(_) => assert!(
            got.is_empty() || got[0] == 21,
            "plaintext client got {got:?}"
        ),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }

    // A laptop trusting another CA refuses the manager's certificate.
    let other = material();
    let err = tls_connect(addr, &other.ca_pem, SERVER_NAME)
        .await
        .expect_err("wrong CA must fail");
    let text = err.to_string();
    assert!(
        text.contains("certificate") && text.contains("UnknownIssuer"),
        "wrong CA error: {text}"
    );

    // Right CA, wrong name.
    let err = tls_connect(addr, &m.ca_pem, "kvpn-manager.elsewhere.svc")
        .await
        .expect_err("wrong name must fail");
    let text = err.to_string();
    assert!(
        text.contains("certificate not valid for name \"kvpn-manager.elsewhere.svc\""),
        "wrong name error: {text}"
    );

    // The right CA and name: a session with a heartbeat echo through TLS 1.3.
    let mut tls = tls_connect(addr, &m.ca_pem, SERVER_NAME)
        .await
        .expect("TLS handshake with the right CA");
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    assert_eq!(
        hello_and_heartbeat(&mut tls).await,
        (Kind::Heartbeat, b"tls-echo".to_vec())
    );
    assert!(
        !server.is_finished(),
        "the listener survived all of the above"
    );
    server.abort();
}

#[test]
fn tls_config_errors_name_the_problem() {
    let m = material();
    let err = kvpn_manager::tls::server_config_from_pem(b"not pem", m.key_pem.as_bytes())
        .expect_err("no certificate");
    assert!(err.to_string().contains("no certificate"), "{err}");
    let other = material();
    let err =
        kvpn_manager::tls::server_config_from_pem(m.cert_pem.as_bytes(), other.key_pem.as_bytes())
            .expect_err("key of another certificate");
    assert!(err.to_string().contains("cannot be used for TLS"), "{err}");
    let err = kvpn_manager::tls::load_server_config(
        std::path::Path::new("/nonexistent/kvpn/tls.crt"),
        std::path::Path::new("/nonexistent/kvpn/tls.key"),
    )
    .expect_err("missing file");
    assert!(
        err.to_string().contains("/nonexistent/kvpn/tls.crt"),
        "{err}"
    );
}

/// A folder under the system temp dir, removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn binary_takes_tls_from_env_logs_it_and_probes_raise_no_warning() {
    let m = material();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    let dir = TempDir(
        std::env::temp_dir().join(format!("kvpn-manager-tls-{}-{nanos}", std::process::id())),
    );
    std::fs::create_dir_all(&dir.0).expect("temp dir");
    let (cert, key) = (dir.0.join("tls.crt"), dir.0.join("tls.key"));
    std::fs::write(&cert, &m.cert_pem).expect("write cert");
    std::fs::write(&key, &m.key_pem).expect("write key");

    let manager = common::ManagerProcess::start(&[
        ("KVPN_TLS_CERT", cert.as_path()),
        ("KVPN_TLS_KEY", key.as_path()),
    ]);
    let addr = manager.addr;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        for _ in 0..5 {
            drop(TcpStream::connect(addr).await.expect("probe connects"));
        }
        let mut tls = tls_connect(addr, &m.ca_pem, SERVER_NAME)
            .await
            .expect("TLS handshake with the binary");
        assert_eq!(
            hello_and_heartbeat(&mut tls).await,
            (Kind::Heartbeat, b"tls-echo".to_vec())
        );
        tls.shutdown().await.expect("close_notify");
        // Read what the manager still sends (its stats frames) until it closes:
        // closing with unread bytes would send a RST, and the manager would log
        // the reset instead of the laptop's close.
        let mut sink = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), tls.read(&mut sink)).await {
                Ok(Ok(0)) => break,
                Ok(Ok(_)) => {}
                // The manager may close without its own close_notify.
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Ok(Err(e)) => panic!("reading until the manager closes: {e}"),
                Err(_) => panic!("the manager did not close within 5 s after close_notify"),
            }
        }
    });
    // The manager must notice the laptop's close before the SIGTERM (under load
    // the signal could beat it and the "session closed" line never came).
    manager.wait_for_line("session closed by the laptop", Duration::from_secs(10));
    let log = manager.stop();
    assert!(
        log.iter()
            .any(|l| l.contains("data channel is TLS 1.3") && l.contains("security=\"tls\"")),
        "{log:#?}"
    );
    assert!(
        log.iter()
            .any(|l| l.contains("session closed by the laptop") && l.contains("security=\"tls\"")),
        "{log:#?}"
    );
    let warnings: Vec<_> = log.iter().filter(|l| l.contains("WARN")).collect();
    assert!(
        warnings.is_empty(),
        "probes and a clean session warned: {warnings:#?}"
    );
}

#[test]
fn binary_refuses_a_certificate_without_a_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpn-manager"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            "/nonexistent/tls.crt",
        ])
        .env_remove("KVPN_TLS_KEY")
        .output()
        .expect("run kvpn-manager");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--tls-key"), "{stderr}");
}
