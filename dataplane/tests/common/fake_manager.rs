//! `FakeManager`: a test double of the traffic manager for the dataplane's tests.
//! It speaks the data-channel frame protocol on a TCP listener, records the
//! hellos and packets it receives, echoes heartbeats (switchable, to simulate a
//! black hole), answers ICMP echo requests and echoes UDP datagrams back with
//! addresses and ports swapped. It is not the real manager (no smoltcp stack,
//! no dialing); it only lets the tests see what the pump sends and feed packets
//! back into the TUN device. With a rustls server configuration it speaks TLS
//! like the real manager does ([`test_pki`] makes a CA and a serving certificate).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kvpn_proto::frame::{self, Decoder, Hello, Kind};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    Icmpv4Packet, Icmpv4Repr, IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr, UdpPacket, UdpRepr,
};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// What the fake manager saw, shared with the test.
#[derive(Default)]
pub struct Seen {
    pub hellos: Mutex<Vec<Hello>>,
    pub packets: Mutex<Vec<Vec<u8>>>,
    pub connections: AtomicUsize,
    pub heartbeats: AtomicUsize,
    /// Packet frames received and their payload bytes (also when not stored).
    pub packet_count: AtomicUsize,
    pub packet_bytes: AtomicUsize,
    /// Store packets in `packets` and answer them (false: count only, a sink).
    pub store: AtomicBool,
    /// Completed TLS handshakes, and failed ones (the client refused the
    /// certificate, or spoke no TLS).
    pub tls_sessions: AtomicUsize,
    pub tls_failures: AtomicUsize,
}

pub struct FakeManager {
    pub addr: SocketAddr,
    pub seen: Arc<Seen>,
    /// Echo heartbeats (true) or swallow them like a black hole (false).
    pub echo: Arc<AtomicBool>,
    /// Bumped by [`FakeManager::kick`]: every open connection closes.
    kick_tx: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeManager {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeManager {
    /// Listen on 127.0.0.1 (of the calling thread's network namespace).
    pub async fn start(echo: bool) -> Self {
        Self::start_with(echo, true).await
    }

    /// A sink for measurements: counts packets, stores and answers none.
    pub async fn start_sink() -> Self {
        Self::start_with(true, false).await
    }

    /// Like [`start`](Self::start), but every connection must be TLS with `tls`.
    pub async fn start_tls(echo: bool, tls: Arc<rustls::ServerConfig>) -> Self {
        Self::start_full(echo, true, Some(tls)).await
    }

    /// Like [`start_sink`](Self::start_sink), over TLS.
    pub async fn start_sink_tls(tls: Arc<rustls::ServerConfig>) -> Self {
        Self::start_full(true, false, Some(tls)).await
    }

    async fn start_with(echo: bool, store: bool) -> Self {
        Self::start_full(echo, store, None).await
    }

    async fn start_full(echo: bool, store: bool, tls: Option<Arc<rustls::ServerConfig>>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake manager");
        let addr = listener.local_addr().expect("local addr");
        let seen = Arc::new(Seen::default());
        seen.store.store(store, Ordering::SeqCst);
        let echo = Arc::new(AtomicBool::new(echo));
        let (kick_tx, kick_rx) = watch::channel(0u64);
        let task = tokio::spawn(accept_loop(
            listener,
            seen.clone(),
            echo.clone(),
            tls.map(tokio_rustls::TlsAcceptor::from),
            kick_rx,
        ));
        Self {
            addr,
            seen,
            echo,
            kick_tx,
            task,
        }
    }

    /// Close every open data connection (the laptop must re-dial).
    pub fn kick(&self) {
        self.kick_tx.send_modify(|n| *n += 1);
    }

    pub fn packets(&self) -> Vec<Vec<u8>> {
        self.seen.packets.lock().expect("lock").clone()
    }

    pub fn hellos(&self) -> Vec<Hello> {
        self.seen.hellos.lock().expect("lock").clone()
    }
}

async fn accept_loop(
    listener: TcpListener,
    seen: Arc<Seen>,
    echo: Arc<AtomicBool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    kick_rx: watch::Receiver<u64>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        seen.connections.fetch_add(1, Ordering::SeqCst);
        let (seen, echo, tls, mut kick_rx) =
            (seen.clone(), echo.clone(), tls.clone(), kick_rx.clone());
        kick_rx.mark_unchanged();
        tokio::spawn(async move {
            match tls {
                None => serve(stream, seen, echo, kick_rx).await,
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(tls) => {
                        seen.tls_sessions.fetch_add(1, Ordering::SeqCst);
                        serve(tls, seen, echo, kick_rx).await;
                    }
                    Err(_) => {
                        seen.tls_failures.fetch_add(1, Ordering::SeqCst);
                    }
                },
            }
        });
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    seen: Arc<Seen>,
    echo: Arc<AtomicBool>,
    mut kick_rx: watch::Receiver<u64>,
) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 256 * 1024];
    let mut out = Vec::new();
    loop {
        let read = tokio::select! {
            r = stream.read(&mut chunk) => r,
            _ = kick_rx.changed() => return,
        };
        let n = match read {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut used_total = 0;
        out.clear();
        while let Some((f, used)) = Decoder::default()
            .decode(&buf[used_total..])
            .expect("the pump sends valid frames")
        {
            used_total += used;
            match f.kind {
                Kind::Hello => {
                    let hello = Hello::decode(f.payload).expect("valid hello");
                    seen.hellos.lock().expect("lock").push(hello);
                }
                Kind::Heartbeat => {
                    seen.heartbeats.fetch_add(1, Ordering::SeqCst);
                    if echo.load(Ordering::SeqCst) {
                        frame::encode_into(Kind::Heartbeat, f.payload, &mut out).expect("fits");
                    }
                }
                Kind::Packet => {
                    seen.packet_count.fetch_add(1, Ordering::Relaxed);
                    seen.packet_bytes
                        .fetch_add(f.payload.len(), Ordering::Relaxed);
                    if !seen.store.load(Ordering::Relaxed) {
                        continue;
                    }
                    seen.packets.lock().expect("lock").push(f.payload.to_vec());
                    if let Some(reply) = answer(f.payload) {
                        frame::encode_into(Kind::Packet, &reply, &mut out).expect("fits");
                    }
                }
                Kind::Stats => panic!("the pump sent a stats frame (manager to laptop only)"),
                Kind::Resume => panic!("the pump sent a resume frame (manager to laptop only)"),
                // This test double never answers the hello's offload offer.
                Kind::Gso => {
                    panic!("the pump sent a GSO frame to a manager that did not accept them")
                }
                Kind::Unknown(k) => panic!("the pump sent an unknown frame kind {k}"),
            }
        }
        buf.drain(..used_total);
        if !out.is_empty()
            && (stream.write_all(&out).await.is_err() || stream.flush().await.is_err())
        {
            return;
        }
    }
}

/// The reply a tiny "cluster" gives: ICMP echo reply, or the UDP datagram back.
pub fn answer(packet: &[u8]) -> Option<Vec<u8>> {
    let caps = ChecksumCapabilities::default();
    let ip = Ipv4Packet::new_checked(packet).ok()?;
    let ip_repr = Ipv4Repr::parse(&ip, &caps).ok()?;
    let reply_ip = |payload_len| Ipv4Repr {
        src_addr: ip_repr.dst_addr,
        dst_addr: ip_repr.src_addr,
        next_header: ip_repr.next_header,
        payload_len,
        hop_limit: 64,
    };
    match ip_repr.next_header {
        IpProtocol::Icmp => {
            let icmp = Icmpv4Packet::new_checked(ip.payload()).ok()?;
            let Icmpv4Repr::EchoRequest {
                ident,
                seq_no,
                data,
            } = Icmpv4Repr::parse(&icmp, &caps).ok()?
            else {
                return None;
            };
            let icmp_reply = Icmpv4Repr::EchoReply {
                ident,
                seq_no,
                data,
            };
            let ip_reply = reply_ip(icmp_reply.buffer_len());
            let mut out = vec![0u8; ip_reply.buffer_len() + icmp_reply.buffer_len()];
            let mut p = Ipv4Packet::new_unchecked(&mut out[..]);
            ip_reply.emit(&mut p, &caps);
            icmp_reply.emit(&mut Icmpv4Packet::new_unchecked(p.payload_mut()), &caps);
            Some(out)
        }
        IpProtocol::Udp => {
            let src = IpAddress::Ipv4(ip_repr.src_addr);
            let dst = IpAddress::Ipv4(ip_repr.dst_addr);
            let udp = UdpPacket::new_checked(ip.payload()).ok()?;
            let repr = UdpRepr::parse(&udp, &src, &dst, &caps).ok()?;
            let data = udp.payload();
            let udp_reply = UdpRepr {
                src_port: repr.dst_port,
                dst_port: repr.src_port,
            };
            let ip_reply = reply_ip(udp_reply.header_len() + data.len());
            let mut out = vec![0u8; ip_reply.buffer_len() + udp_reply.header_len() + data.len()];
            let mut p = Ipv4Packet::new_unchecked(&mut out[..]);
            ip_reply.emit(&mut p, &caps);
            udp_reply.emit(
                &mut UdpPacket::new_unchecked(p.payload_mut()),
                &dst,
                &src,
                data.len(),
                |buf| buf.copy_from_slice(data),
                &caps,
            );
            Some(out)
        }
        _ => None,
    }
}

/// Destination address and UDP destination port of an IPv4/UDP packet.
pub fn udp_dst(packet: &[u8]) -> Option<(std::net::Ipv4Addr, u16, Vec<u8>, std::net::Ipv4Addr)> {
    let ip = Ipv4Packet::new_checked(packet).ok()?;
    if ip.next_header() != IpProtocol::Udp {
        return None;
    }
    let udp = UdpPacket::new_checked(ip.payload()).ok()?;
    Some((
        ip.dst_addr(),
        udp.dst_port(),
        udp.payload().to_vec(),
        ip.src_addr(),
    ))
}

/// A test PKI: a CA (PEM) and the rustls server configuration of a manager
/// whose certificate that CA signed for `server_name` (a DNS name or an IP).
/// The CA's name is unique per call, as two installs' CAs are.
pub fn test_pki(server_name: &str) -> (String, Arc<rustls::ServerConfig>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    static SERIAL: AtomicUsize = AtomicUsize::new(0);
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(
        DnType::CommonName,
        format!(
            "kvpn dataplane test CA {} {}",
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        ),
    );
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    let ca_pem = ca.self_signed(&ca_key).expect("CA cert").pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(vec![server_name.to_owned()]).expect("leaf params");
    let cert = leaf.signed_by(&key, &issuer).expect("leaf cert");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .expect("TLS 1.3")
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from_pem_slice(cert.pem().as_bytes()).expect("cert PEM")],
        PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).expect("key PEM"),
    )
    .expect("server config");
    (ca_pem, Arc::new(config))
}
