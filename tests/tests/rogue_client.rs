//! Isolation between clients (issue #10 [hardening] item 2): a rogue client in
//! the static lab attacks a real `kvpn-manager` (TLS data channel, `--leases`,
//! gRPC and metrics on the manager pod's loopback) and fails, and every refusal
//! shows in the manager's real metrics output (`GET /metrics`, Prometheus
//! text). The trust model these tests pin down: docs/trust-model.md.
//!
//! Clients are in-test: they speak the real frame protocol (`kvpn_proto::frame`,
//! the root daemon's `hello_frame`) over real TLS from the laptop netns to the
//! manager pod through the node (the lab's NodePort-like forward). gRPC calls and
//! metrics reads are made inside the manager pod's netns, which is what
//! `pods/portforward` gives a client on a cluster. A backend pod runs an
//! in-test UDP echo and TCP listener that record everything they receive, so
//! "never delivered" is observed where it would land.
//!
//! - (a) `rogue_client_hello_without_the_leases_token_is_refused`
//! - (b) `rogue_client_spoofed_sources_are_dropped_and_never_reach_a_backend`
//! - (c) `rogue_client_cannot_take_over_another_clients_flows`
//! - (d) `rogue_client_grpc_surface_is_only_its_own_lease`

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpn_lab::packets::{self, PROTO_ICMP, tcp_syn};
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, BACKEND_2_IP, LAPTOP, Lab, LabOptions, MANAGER_ADDR_FROM_LAPTOP,
    MANAGER_POD, MANAGER_POD_IP, MANAGER_PORT,
};
use kvpn_proto::frame::{self, Decoder, Hello, Kind, PROTOCOL_VERSION};
use kvpn_proto::manager::manager_client::ManagerClient;
use kvpn_proto::manager::{LeaseRequest, LeaseResponse};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, TcpPacket, UdpPacket};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_rustls::client::TlsStream;

/// The namespace the manager's certificate is made for.
const NAMESPACE: &str = "kvpn-system";
/// gRPC and metrics: the manager's defaults, the pod's loopback.
const GRPC: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10802);
const METRICS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10803);
/// How long "never arrives" is watched for. The lab answers within
/// milliseconds; the same packets from the right source are answered within
/// this (each test has a positive control).
const QUIET: Duration = Duration::from_millis(1500);

/// A static lab whose manager pod runs `kvpn-manager --leases` with TLS.
struct RogueLab {
    lab: Lab,
    tls: kvpn_dataplane::tls::TlsClient,
}

impl RogueLab {
    fn up() -> Self {
        let lab = Lab::up(LabOptions::default().without_manager())
            .unwrap_or_else(|e| panic!("lab up: {e:#}"));
        let material = kvpn_control::install::certs::generate(NAMESPACE, None)
            .unwrap_or_else(|e| panic!("TLS material: {e}"));
        let dir = lab.dir().join("manager-tls");
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, &material.cert_pem).unwrap_or_else(|e| panic!("write cert: {e}"));
        std::fs::write(&key, &material.key_pem).unwrap_or_else(|e| panic!("write key: {e}"));
        let bin = kvpn_lab::bin_path("kvpn-manager").unwrap_or_else(|e| panic!("{e:#}"));
        let mut cmd = Command::new(bin);
        cmd.args(["--listen", &format!("0.0.0.0:{MANAGER_PORT}"), "--leases"])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .args(["--metrics-listen", &METRICS.to_string()])
            // Not in a cluster: leases in memory, no route watch.
            .env_remove("KUBERNETES_SERVICE_HOST");
        lab.spawn_in(MANAGER_POD, "manager", &cmd)
            .unwrap_or_else(|e| panic!("start the manager: {e:#}"));
        for port in [MANAGER_PORT, GRPC.port(), METRICS.port()] {
            lab.wait_listening(MANAGER_POD, port, Duration::from_secs(15))
                .unwrap_or_else(|e| panic!("manager port {port}: {e:#}\n{}", manager_log(&lab)));
        }
        let tls = kvpn_dataplane::tls::TlsClient::new(
            material.ca_pem.as_bytes(),
            &kvpn_control::install::objects::server_name(NAMESPACE),
        )
        .unwrap_or_else(|e| panic!("TLS client: {e}"));
        RogueLab { lab, tls }
    }

    fn log(&self) -> String {
        manager_log(&self.lab)
    }

    /// Run `make()`'s future to completion on a thread inside the manager pod's
    /// netns (where `pods/portforward` lands).
    fn in_manager_pod<T: Send, F: Future<Output = T>>(&self, make: impl FnOnce() -> F + Send) -> T {
        self.lab
            .run_in(MANAGER_POD, || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap_or_else(|e| panic!("tokio runtime: {e}"))
                    .block_on(make())
            })
            .unwrap_or_else(|e| panic!("manager pod netns: {e:#}"))
    }

    /// A gRPC client of the manager pod's `:10802`; must be used inside
    /// [`RogueLab::in_manager_pod`].
    async fn grpc() -> tonic::transport::Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{GRPC}"))
            .unwrap_or_else(|e| panic!("endpoint: {e}"))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("gRPC {GRPC} in the manager pod: {e}"))
    }

    /// `Lease(client_id)` as a client through the port-forward would call it.
    fn lease(&self, client_id: &str) -> Result<LeaseResponse, tonic::Status> {
        let id = client_id.to_owned();
        self.in_manager_pod(|| async move {
            ManagerClient::new(Self::grpc().await)
                .lease(LeaseRequest { client_id: id })
                .await
                .map(tonic::Response::into_inner)
        })
    }

    /// The manager's `GET /metrics`, as `name{labels}` -> value.
    fn metrics(&self) -> BTreeMap<String, u64> {
        let text = self
            .lab
            .run_in(MANAGER_POD, || kvpn_tests::http_get_metrics(METRICS.port()))
            .unwrap_or_else(|e| panic!("manager pod netns: {e:#}"));
        kvpn_tests::prometheus_samples(&text)
            .map(|(name, value)| (name.to_owned(), value))
            .collect()
    }

    /// Wait until metric `name` is `want` (sessions count their drops once per
    /// round), then check it stays there: more would mean packets counted twice
    /// or other refusals than the test made.
    fn expect_metric(&self, name: &str, want: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let got = self.metrics().get(name).copied();
            if got == Some(want) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "metric {name}: {got:?}, expected {want}\n{:#?}\n{}",
                self.metrics(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            self.metrics().get(name).copied(),
            Some(want),
            "metric {name} moved on"
        );
    }

    /// A TCP connection from the laptop netns to the manager's data port.
    fn dial(&self) -> tokio::net::TcpStream {
        let s = self
            .lab
            .run_in(LAPTOP, || {
                TcpStream::connect_timeout(
                    &SocketAddr::V4(MANAGER_ADDR_FROM_LAPTOP),
                    Duration::from_secs(5),
                )
            })
            .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
            .unwrap_or_else(|e| panic!("connect {MANAGER_ADDR_FROM_LAPTOP}: {e}"));
        s.set_nonblocking(true).expect("nonblocking");
        tokio::net::TcpStream::from_std(s).unwrap_or_else(|e| panic!("tokio stream: {e}"))
    }

    /// TLS to the manager, then `hello` (a whole frame) as the first bytes.
    async fn open_with(&self, name: &str, hello: &[u8]) -> Channel {
        let mut tls = self
            .tls
            .handshake(self.dial(), "the lab manager")
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        tls.write_all(hello)
            .await
            .unwrap_or_else(|e| panic!("{name}: hello: {e}"));
        tls.flush()
            .await
            .unwrap_or_else(|e| panic!("{name}: flush: {e}"));
        Channel {
            name: name.to_owned(),
            tls,
            buf: Vec::new(),
        }
    }

    /// A data channel whose hello claims `ip` with `token`.
    async fn open(&self, name: &str, ip: Ipv4Addr, token: &[u8]) -> Channel {
        let hello = kvpn_dataplane::session::hello_frame(IpAddr::V4(ip), token)
            .unwrap_or_else(|e| panic!("{name}: hello: {e}"));
        self.open_with(name, &hello).await
    }

    /// Lease `client_id` and open its data channel: a well-behaved client.
    async fn client(&self, name: &str, client_id: &str) -> Client {
        let lease = self
            .lease(client_id)
            .unwrap_or_else(|s| panic!("{name}: lease: {s}"));
        let ip: Ipv4Addr = lease.tunnel_ip.parse().expect("tunnel IP");
        let ch = self.open(name, ip, lease.session_token.as_bytes()).await;
        Client { ip, lease, ch }
    }
}

fn manager_log(lab: &Lab) -> String {
    let path = lab.dir().join("manager.log");
    std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({}: {e})", path.display()))
}

struct Client {
    ip: Ipv4Addr,
    lease: LeaseResponse,
    ch: Channel,
}

/// One data channel as the rogue (or the victim) drives it.
struct Channel {
    name: String,
    tls: TlsStream<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

#[derive(Debug)]
enum Recv {
    Packet(Vec<u8>),
    Closed,
    Timeout,
}

impl Channel {
    async fn send(&mut self, packet: &[u8]) {
        let mut out = Vec::new();
        frame::encode_into(Kind::Packet, packet, &mut out).expect("fits a frame");
        self.send_raw(&out).await;
    }

    /// Send `packet` on a channel the manager may already have closed (a
    /// refused rogue): a failed write is what refusal looks like.
    async fn send_lossy(&mut self, packet: &[u8]) {
        let mut out = Vec::new();
        frame::encode_into(Kind::Packet, packet, &mut out).expect("fits a frame");
        let _ = self.tls.write_all(&out).await;
        let _ = self.tls.flush().await;
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        let name = &self.name;
        self.tls
            .write_all(bytes)
            .await
            .unwrap_or_else(|e| panic!("{name}: send: {e}"));
        self.tls
            .flush()
            .await
            .unwrap_or_else(|e| panic!("{name}: flush: {e}"));
    }

    /// The next packet frame within `within` (other frames skipped).
    async fn recv(&mut self, within: Duration) -> Recv {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match Decoder::default().decode(&self.buf) {
                Ok(Some((f, used))) => {
                    let out = (f.kind == Kind::Packet).then(|| f.payload.to_vec());
                    self.buf.drain(..used);
                    if let Some(p) = out {
                        return Recv::Packet(p);
                    }
                    continue;
                }
                Ok(None) => {}
                Err(e) => panic!("{}: bad frame from the manager: {e}", self.name),
            }
            let mut chunk = [0u8; 16 * 1024];
            match tokio::time::timeout_at(deadline, self.tls.read(&mut chunk)).await {
                Err(_) => return Recv::Timeout,
                Ok(Ok(0)) | Ok(Err(_)) => return Recv::Closed,
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Every packet that arrives within `within`; whether the manager closed.
    async fn drain(&mut self, within: Duration) -> (Vec<Vec<u8>>, bool) {
        let deadline = tokio::time::Instant::now() + within;
        let mut got = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv(left).await {
                Recv::Packet(p) => got.push(p),
                Recv::Closed => return (got, true),
                Recv::Timeout => return (got, false),
            }
        }
    }

    /// The next UDP payload from `from` within `within`, skipping other packets.
    async fn udp_from(&mut self, from: SocketAddrV4, within: Duration) -> Option<Vec<u8>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.recv(left).await {
                Recv::Packet(p) => {
                    if let Some(u) = parse_udp(&p)
                        && u.src == from
                    {
                        return Some(u.payload);
                    }
                }
                Recv::Closed => panic!("{}: the manager closed the data channel", self.name),
                Recv::Timeout => return None,
            }
        }
    }

    /// Whether the manager ends this channel within `within` without sending
    /// any packet on it.
    async fn refused(&mut self, within: Duration) -> bool {
        let (packets, closed) = self.drain(within).await;
        assert!(
            packets.is_empty(),
            "{}: a refused channel carried {} packets",
            self.name,
            packets.len()
        );
        closed
    }
}

// ----- packets -------------------------------------------------------------

fn udp(src: SocketAddrV4, dst: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    packets::udp_packet(
        (*src.ip()).into(),
        (*dst.ip()).into(),
        src.port(),
        dst.port(),
        payload,
    )
}

fn echo_request(src: Ipv4Addr, dst: Ipv4Addr, ident: u16) -> Vec<u8> {
    let repr = Icmpv4Repr::EchoRequest {
        ident,
        seq_no: 1,
        data: b"kvpn rogue",
    };
    let mut msg = vec![0u8; repr.buffer_len()];
    repr.emit(
        &mut Icmpv4Packet::new_unchecked(&mut msg[..]),
        &ChecksumCapabilities::default(),
    );
    packets::ipv4(PROTO_ICMP, src, dst, &msg)
}

struct Udp {
    src: SocketAddrV4,
    payload: Vec<u8>,
}

fn parse_udp(packet: &[u8]) -> Option<Udp> {
    let ip = Ipv4Packet::new_checked(packet).ok()?;
    if ip.next_header() != IpProtocol::Udp {
        return None;
    }
    let u = UdpPacket::new_checked(ip.payload()).ok()?;
    Some(Udp {
        src: SocketAddrV4::new(ip.src_addr(), u.src_port()),
        payload: u.payload().to_vec(),
    })
}

/// (source, destination, SYN, ACK, RST) of a TCP packet.
fn parse_tcp(packet: &[u8]) -> Option<(SocketAddrV4, SocketAddrV4, bool, bool, bool)> {
    let ip = Ipv4Packet::new_checked(packet).ok()?;
    if ip.next_header() != IpProtocol::Tcp {
        return None;
    }
    let t = TcpPacket::new_checked(ip.payload()).ok()?;
    Some((
        SocketAddrV4::new(ip.src_addr(), t.src_port()),
        SocketAddrV4::new(ip.dst_addr(), t.dst_port()),
        t.syn(),
        t.ack(),
        t.rst(),
    ))
}

/// Whether `packet` is an ICMP echo reply.
fn is_echo_reply(packet: &[u8]) -> bool {
    Ipv4Packet::new_checked(packet)
        .ok()
        .filter(|ip| ip.next_header() == IpProtocol::Icmp)
        .and_then(|ip| {
            Icmpv4Packet::new_checked(ip.payload())
                .ok()
                .map(|i| i.msg_type() == smoltcp::wire::Icmpv4Message::EchoReply)
        })
        .unwrap_or(false)
}

// ----- the backend's view --------------------------------------------------

/// A datagram the backend received: (source, payload).
type Datagram = (SocketAddr, Vec<u8>);

/// An in-test server in backend-1's netns: a UDP echo that records every
/// datagram (source, payload) and a TCP listener that counts connections.
struct Backend {
    udp: SocketAddrV4,
    tcp: SocketAddrV4,
    socket: UdpSocket,
    seen: Arc<Mutex<Vec<Datagram>>>,
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Backend {
    fn start(lab: &Lab) -> Self {
        let (socket, listener) = lab
            .run_in(BACKEND_1_POD, || {
                (
                    UdpSocket::bind((BACKEND_1_IP, 0)).expect("UDP bind in backend-1"),
                    TcpListener::bind((BACKEND_1_IP, 0)).expect("TCP bind in backend-1"),
                )
            })
            .unwrap_or_else(|e| panic!("backend-1 netns: {e:#}"));
        let port = |a: SocketAddr| a.port();
        let udp = SocketAddrV4::new(BACKEND_1_IP, port(socket.local_addr().expect("addr")));
        let tcp = SocketAddrV4::new(BACKEND_1_IP, port(listener.local_addr().expect("addr")));
        listener.set_nonblocking(true).expect("nonblocking");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("timeout");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (socket, seen, stop) = (
                socket.try_clone().expect("clone"),
                seen.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = socket.recv_from(&mut buf) {
                        seen.lock().expect("lock").push((from, buf[..n].to_vec()));
                        let _ = socket.send_to(&buf[..n], from);
                    }
                }
            })
        };
        Backend {
            udp,
            tcp,
            socket,
            seen,
            listener,
            stop,
            thread: Some(thread),
        }
    }

    /// Every payload the backend received, with its source.
    fn seen(&self) -> Vec<Datagram> {
        self.seen.lock().expect("lock").clone()
    }

    /// Whether any received payload contains `marker`.
    fn saw(&self, marker: &[u8]) -> bool {
        self.seen()
            .iter()
            .any(|(_, p)| p.windows(marker.len()).any(|w| w == marker))
    }

    /// The source the backend saw `payload` from (the manager's socket of that flow).
    fn source_of(&self, payload: &[u8]) -> SocketAddr {
        self.seen()
            .iter()
            .find(|(_, p)| p == payload)
            .map(|(a, _)| *a)
            .unwrap_or_else(|| panic!("backend never got {:?}", String::from_utf8_lossy(payload)))
    }

    /// Send `payload` from the backend's UDP socket to `to` (unsolicited
    /// datagrams on an existing flow).
    fn send_to(&self, payload: &[u8], to: SocketAddr) {
        self.socket.send_to(payload, to).expect("backend send");
    }

    /// TCP connections accepted so far (drains the accept queue).
    fn accepted(&self) -> usize {
        let mut n = 0;
        while self.listener.accept().is_ok() {
            n += 1;
        }
        n
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("tokio runtime: {e}"))
}

fn token_guess() -> Vec<u8> {
    // Shaped like a real token (64 hex digits), but not anyone's.
    format!(
        "{:064x}",
        std::process::id() as u128 * 0x9e37_79b9_7f4a_7c15
    )
    .into_bytes()
}

// ----- the tests -----------------------------------------------------------

/// (a) Only a hello with the token of its tunnel IP's lease starts a session:
/// no TLS, no token, a guessed token, another client's token, an IP nobody
/// leased, a malformed or non-hello first frame and another protocol version
/// are refused (connection closed, nothing relayed), each counted under
/// `kvpn_manager_refused_hello_total{reason}`; the legitimate clients keep
/// working.
#[test]
fn rogue_client_hello_without_the_leases_token_is_refused() {
    let r = RogueLab::up();
    let rt = runtime();
    let pid = std::process::id();
    rt.block_on(async {
        let mut a = r.client("victim A", &format!("rogue-a-victim-{pid}")).await;
        let b = r.client("rogue B", &format!("rogue-a-rogue-{pid}")).await;
        assert_ne!(a.ip, b.ip);
        let ping_dst = BACKEND_1_IP;
        a.ch.send(&echo_request(a.ip, ping_dst, 0xa1)).await;
        let (got, _) = a.ch.drain(Duration::from_secs(2)).await;
        assert!(
            got.iter().any(|p| is_echo_reply(p)),
            "victim A's ping before the attacks"
        );

        let unleased = Ipv4Addr::new(100, 96, 0, 200);
        let a_token = a.lease.session_token.clone().into_bytes();
        let b_token = b.lease.session_token.clone().into_bytes();
        let cases: Vec<(&str, Ipv4Addr, Vec<u8>)> = vec![
            ("A's tunnel IP, no token", a.ip, Vec::new()),
            ("A's tunnel IP, a guessed token", a.ip, token_guess()),
            ("A's tunnel IP, B's token", a.ip, b_token.clone()),
            ("A's tunnel IP, A's token with one digit changed", a.ip, {
                let mut t = a_token.clone();
                t[0] = if t[0] == b'0' { b'1' } else { b'0' };
                t
            }),
            ("B's tunnel IP, A's token", b.ip, a_token.clone()),
            (
                "an unleased tunnel IP, A's token",
                unleased,
                a_token.clone(),
            ),
            (
                "the manager's own address",
                Ipv4Addr::new(100, 96, 0, 1),
                a_token.clone(),
            ),
        ];
        for (what, ip, token) in &cases {
            let mut rogue = r.open(what, *ip, token).await;
            // If the manager let it in, this ping would be answered.
            rogue.send_lossy(&echo_request(*ip, ping_dst, 0xbad)).await;
            assert!(
                rogue.refused(Duration::from_secs(5)).await,
                "{what}: not closed\n{}",
                r.log()
            );
        }

        // Malformed and foreign first frames.
        let mut heartbeat = Vec::new();
        frame::encode_into(Kind::Heartbeat, b"", &mut heartbeat).expect("frame");
        let mut truncated = Vec::new();
        frame::encode_into(Kind::Hello, &[0, 1, 4, 100], &mut truncated).expect("frame");
        let old_version = {
            let h = Hello {
                version: PROTOCOL_VERSION + 1,
                tunnel_ip: IpAddr::V4(a.ip),
                token: a_token.clone(),
                mtu: None,
                tunnel_ip_v6: None,
                offloads: None,
                shard: None,
                resume_token: None,
            }
            .encode()
            .expect("hello");
            let mut out = Vec::new();
            frame::encode_into(Kind::Hello, &h, &mut out).expect("frame");
            out
        };
        let multicast =
            kvpn_dataplane::session::hello_frame(IpAddr::V4(Ipv4Addr::new(224, 0, 0, 1)), &a_token)
                .expect("hello");
        for (what, bytes) in [
            ("a heartbeat first", &heartbeat),
            ("a truncated hello", &truncated),
            ("another protocol version", &old_version),
            ("a multicast tunnel IP", &multicast),
        ] {
            let mut rogue = r.open_with(what, bytes).await;
            assert!(
                rogue.refused(Duration::from_secs(5)).await,
                "{what}: not closed"
            );
        }

        // No TLS at all: the hello in plaintext (what a plain-TCP client sends).
        let mut plain = r.dial();
        let hello =
            kvpn_dataplane::session::hello_frame(IpAddr::V4(a.ip), &a_token).expect("hello");
        plain.write_all(&hello).await.expect("plaintext hello");
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match plain.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    // A TLS alert record, never a frame.
                    Ok(n) => assert_eq!(buf[0], 0x15, "plaintext client got {:?}", &buf[..n]),
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "plaintext client not closed");

        // The victim is undisturbed.
        a.ch.send(&echo_request(a.ip, ping_dst, 0xa2)).await;
        let (got, closed) = a.ch.drain(Duration::from_secs(2)).await;
        assert!(!closed, "victim A's channel closed");
        assert!(
            got.iter().any(|p| is_echo_reply(p)),
            "victim A's ping after the attacks"
        );
    });

    let reason = |r: &str| format!("kvpn_manager_refused_hello_total{{reason=\"{r}\"}}");
    r.expect_metric(&reason("wrong_token"), 5);
    r.expect_metric(&reason("no_lease"), 2);
    r.expect_metric(&reason("not_hello"), 1);
    r.expect_metric(&reason("malformed"), 1);
    r.expect_metric(&reason("version"), 1);
    r.expect_metric(&reason("bad_tunnel_ip"), 1);
    r.expect_metric(&reason("tls"), 1);
    r.expect_metric("kvpn_manager_sessions_accepted_total", 2);
    let log = r.log();
    assert!(
        log.contains("session token does not match the lease"),
        "{log}"
    );
}

/// (b) A valid client's packets whose source is not its tunnel IP (another
/// client's, a pod's, the manager pod's) are dropped before any socket is
/// opened: the backend never sees them, nothing comes back, each is counted in
/// `kvpn_manager_spoofed_source_dropped_total`, and the spoofed client's own
/// flows carry on. The same packets from the rogue's own tunnel IP do arrive
/// (positive control).
#[test]
fn rogue_client_spoofed_sources_are_dropped_and_never_reach_a_backend() {
    let r = RogueLab::up();
    let backend = Backend::start(&r.lab);
    let rt = runtime();
    let pid = std::process::id();
    rt.block_on(async {
        let mut a = r.client("victim A", &format!("rogue-b-victim-{pid}")).await;
        let mut b = r.client("rogue B", &format!("rogue-b-rogue-{pid}")).await;
        let a_port = SocketAddrV4::new(a.ip, 40001);

        // Positive controls: both clients reach the backend from their own IPs.
        a.ch.send(&udp(a_port, backend.udp, b"A-1")).await;
        assert_eq!(
            a.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"A-1"[..])
        );
        b.ch.send(&udp(SocketAddrV4::new(b.ip, 40002), backend.udp, b"B-own"))
            .await;
        assert_eq!(
            b.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"B-own"[..])
        );
        b.ch.send(&tcp_syn(SocketAddrV4::new(b.ip, 40003), backend.tcp))
            .await;
        let (got, _) = b.ch.drain(Duration::from_secs(2)).await;
        assert!(
            got.iter().any(|p| parse_tcp(p)
                .is_some_and(|(src, _, syn, ack, _)| src == backend.tcp && syn && ack)),
            "B's own SYN answered with SYN-ACK"
        );
        assert_eq!(
            backend.accepted(),
            1,
            "the manager dialed the backend for B's own SYN"
        );

        // The spoofs, from B's authenticated channel.
        let sources = [
            ("victim A's tunnel IP", a.ip),
            ("another pod's IP", BACKEND_2_IP),
            ("the backend's own IP", BACKEND_1_IP),
            ("the manager pod's IP", MANAGER_POD_IP),
            ("the manager stack's address", Ipv4Addr::new(100, 96, 0, 1)),
        ];
        let mut sent = 0u64;
        for (i, (_, src)) in sources.iter().enumerate() {
            let port = 40100 + i as u16;
            let spoof = SocketAddrV4::new(*src, port);
            b.ch.send(&udp(spoof, backend.udp, format!("SPOOF-{i}").as_bytes()))
                .await;
            b.ch.send(&tcp_syn(spoof, backend.tcp)).await;
            b.ch.send(&echo_request(*src, BACKEND_1_IP, 0x5000 + i as u16))
                .await;
            sent += 3;
        }
        // A's exact 5-tuple, and a large datagram as A.
        b.ch.send(&udp(a_port, backend.udp, b"SPOOF-as-A")).await;
        b.ch.send(&udp(a_port, backend.udp, &[b'S'; 1400])).await;
        sent += 2;

        let (got, closed) = b.ch.drain(QUIET).await;
        assert!(!closed, "B's channel stays up (drops are per packet)");
        // The control SYN's half-open flow retransmits its SYN-ACK; anything else
        // would be an answer to a spoof.
        let control_port = 40003;
        let answers: Vec<_> = got
            .iter()
            .filter(|p| parse_tcp(p).is_none_or(|(_, to, ..)| to.port() != control_port))
            .collect();
        assert!(
            answers.is_empty(),
            "nothing answers a spoofed packet: {} packets came back",
            answers.len()
        );
        let (got_a, _) = a.ch.drain(Duration::from_millis(200)).await;
        assert!(
            got_a.is_empty(),
            "victim A got {} packets it never asked for",
            got_a.len()
        );
        assert!(
            !backend.saw(b"SPOOF"),
            "the backend saw a spoofed datagram: {:?}",
            backend.seen()
        );
        assert!(
            !backend.saw(&[b'S'; 64]),
            "the backend saw the spoofed large datagram"
        );
        assert_eq!(
            backend.accepted(),
            0,
            "the manager dialed the backend for a spoofed SYN"
        );

        // The victim's flow is unaffected.
        a.ch.send(&udp(a_port, backend.udp, b"A-2")).await;
        assert_eq!(
            a.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"A-2"[..])
        );
        r.expect_metric("kvpn_manager_spoofed_source_dropped_total", sent);
    });
    r.expect_metric(
        "kvpn_manager_packets_dropped_total{reason=\"bad_source\"}",
        r.metrics()["kvpn_manager_spoofed_source_dropped_total"],
    );
}

/// (c) Flows belong to the session that opened them. B sending from its own
/// IP with A's ports and destination gets its own flow (each sees only its own
/// replies, also for datagrams the backend sends later); B sending with A's
/// full 5-tuple is dropped; a second session claiming A's tunnel IP without A's
/// token is refused and A keeps receiving. Decision (docs/trust-model.md): a
/// session with A's token *is* A (a redial before the manager noticed the old
/// channel died) — it is accepted, laptop-to-laptop traffic for A's IP goes to
/// the newest session, and the flows the old session opened still answer to
/// the old one.
#[test]
fn rogue_client_cannot_take_over_another_clients_flows() {
    let r = RogueLab::up();
    let backend = Backend::start(&r.lab);
    let rt = runtime();
    let pid = std::process::id();
    rt.block_on(async {
        let mut a = r.client("victim A", &format!("rogue-c-victim-{pid}")).await;
        let mut b = r.client("rogue B", &format!("rogue-c-rogue-{pid}")).await;
        let port = 40000;
        let (a_src, b_src) = (SocketAddrV4::new(a.ip, port), SocketAddrV4::new(b.ip, port));

        // Same ports, same destination, different tunnel IPs: two flows.
        a.ch.send(&udp(a_src, backend.udp, b"A-1")).await;
        assert_eq!(
            a.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"A-1"[..])
        );
        b.ch.send(&udp(b_src, backend.udp, b"B-1")).await;
        assert_eq!(
            b.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"B-1"[..])
        );
        let a_flow = backend.source_of(b"A-1");
        let b_flow = backend.source_of(b"B-1");
        assert_ne!(
            a_flow, b_flow,
            "each client's flow has its own socket at the manager"
        );

        // Later datagrams on each flow reach only that flow's client.
        backend.send_to(b"late-for-A", a_flow);
        backend.send_to(b"late-for-B", b_flow);
        assert_eq!(
            a.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"late-for-A"[..])
        );
        assert_eq!(
            b.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"late-for-B"[..])
        );

        // B with A's full 5-tuple: dropped, A's flow untouched.
        b.ch.send(&udp(a_src, backend.udp, b"B-as-A")).await;
        let (got_b, _) = b.ch.drain(QUIET).await;
        let (got_a, _) = a.ch.drain(Duration::from_millis(200)).await;
        assert!(
            got_b.is_empty() && got_a.is_empty(),
            "B-as-A answered: B {got_b:?} A {got_a:?}"
        );
        assert!(!backend.saw(b"B-as-A"), "the backend saw B-as-A");

        // Sessions claiming A's lease without A's token: refused, A keeps its traffic.
        for (what, token) in [
            ("A's IP, guessed token", token_guess()),
            (
                "A's IP, B's token",
                b.lease.session_token.clone().into_bytes(),
            ),
        ] {
            let mut rogue = r.open(what, a.ip, &token).await;
            backend.send_to(b"during-takeover", a_flow);
            assert!(
                rogue.refused(Duration::from_secs(5)).await,
                "{what}: not closed"
            );
            assert_eq!(
                a.ch.udp_from(backend.udp, Duration::from_secs(5))
                    .await
                    .as_deref(),
                Some(&b"during-takeover"[..]),
                "{what}: A's reply went elsewhere"
            );
        }
        // Laptop to laptop still reaches A.
        b.ch.send(&udp(b_src, SocketAddrV4::new(a.ip, 41000), b"peer-1"))
            .await;
        assert_eq!(
            a.ch.udp_from(b_src, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"peer-1"[..])
        );

        // A's own redial (same token) while the old channel is still up: accepted.
        let mut a2 = r
            .open("victim A redialed", a.ip, a.lease.session_token.as_bytes())
            .await;
        a2.send(&echo_request(a.ip, BACKEND_1_IP, 0xa2)).await;
        let (got, closed) = a2.drain(Duration::from_secs(2)).await;
        assert!(
            !closed && got.iter().any(|p| is_echo_reply(p)),
            "A's redial works"
        );
        // Laptop-to-laptop goes to the newest session of A's IP ...
        b.ch.send(&udp(b_src, SocketAddrV4::new(a.ip, 41000), b"peer-2"))
            .await;
        assert_eq!(
            a2.udp_from(b_src, Duration::from_secs(5)).await.as_deref(),
            Some(&b"peer-2"[..])
        );
        // ... and the flow the first session opened still answers to it.
        backend.send_to(b"late-for-A-1", a_flow);
        assert_eq!(
            a.ch.udp_from(backend.udp, Duration::from_secs(5))
                .await
                .as_deref(),
            Some(&b"late-for-A-1"[..])
        );
        let (got_a2, _) = a2.drain(Duration::from_millis(300)).await;
        assert!(
            got_a2
                .iter()
                .all(|p| parse_udp(p).is_none_or(|u| u.payload != b"late-for-A-1"))
        );
        r.expect_metric("kvpn_manager_sessions_active", 3);
    });
    r.expect_metric(
        "kvpn_manager_refused_hello_total{reason=\"wrong_token\"}",
        2,
    );
    r.expect_metric("kvpn_manager_spoofed_source_dropped_total", 1);
    r.expect_metric("kvpn_manager_sessions_accepted_total", 3);
}

/// (d) The gRPC surface a client reaches (through `pods/portforward`, here:
/// from inside the manager pod's netns) is `Lease` for a client id it names
/// and `WatchRoutes`: another client id gets another lease (never A's IP or
/// token), invalid ids are refused and counted in
/// `kvpn_manager_lease_denied_total`, and there is no RPC to list, release or
/// edit leases, nor reflection. From the tunnel, the manager's loopback
/// (gRPC, metrics) is unreachable: dropped as a forbidden destination, and the
/// pod IP's ports 10802/10803 refuse (they listen on loopback only), while its
/// data port answers (positive control).
#[test]
fn rogue_client_grpc_surface_is_only_its_own_lease() {
    let r = RogueLab::up();
    let pid = std::process::id();
    let a_id = format!("rogue-d-victim-{pid}");
    let a = r.lease(&a_id).unwrap_or_else(|s| panic!("lease A: {s}"));
    let b = r
        .lease(&format!("rogue-d-rogue-{pid}"))
        .unwrap_or_else(|s| panic!("lease B: {s}"));
    assert_ne!(a.tunnel_ip, b.tunnel_ip);
    assert_ne!(a.session_token, b.session_token);
    assert_eq!(a.session_token.len(), 64, "32 random bytes");
    // Guessing ids near A's gets fresh leases, never A's.
    for guess in [
        format!("rogue-d-victim-{}", pid + 1),
        "rogue-d-victim".to_owned(),
    ] {
        let g = r
            .lease(&guess)
            .unwrap_or_else(|s| panic!("lease {guess}: {s}"));
        assert_ne!(g.tunnel_ip, a.tunnel_ip);
        assert_ne!(g.session_token, a.session_token);
    }
    let granted = 4;
    // Invalid ids: refused, not echoed into the log.
    let bad_ids = ["", "a b", &"x".repeat(129), "../../leases"];
    for id in bad_ids {
        let e = r.lease(id).expect_err("invalid id refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{id:?}: {e}");
    }
    assert!(
        !r.log().contains("../../leases"),
        "an invalid id was logged"
    );
    assert!(
        !r.log().contains(&a_id),
        "client ids are credentials: only fingerprints in the log"
    );

    // No other RPCs: calls to admin-like paths are UNIMPLEMENTED.
    let paths = [
        "/kvpn.manager.v1.Manager/ListLeases",
        "/kvpn.manager.v1.Manager/Release",
        "/kvpn.manager.v1.Manager/ReleaseLease",
        "/kvpn.manager.v1.Manager/RenewLease",
        "/kvpn.manager.v1.Admin/ListLeases",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ];
    let codes = r.in_manager_pod(|| async move {
        let mut grpc = tonic::client::Grpc::new(RogueLab::grpc().await);
        let mut codes = Vec::new();
        for path in paths {
            grpc.ready()
                .await
                .unwrap_or_else(|e| panic!("gRPC ready: {e}"));
            let codec = tonic_prost::ProstCodec::<LeaseRequest, LeaseResponse>::default();
            let req = tonic::Request::new(LeaseRequest {
                client_id: "rogue".into(),
            });
            let res = grpc
                .unary(req, http::uri::PathAndQuery::from_static(path), codec)
                .await;
            codes.push((path, res.map(|_| ()).map_err(|s| s.code())));
        }
        codes
    });
    for (path, code) in codes {
        assert_eq!(code, Err(tonic::Code::Unimplemented), "{path}");
    }

    // From the tunnel: the manager's own admin ports are out of reach.
    let rt = runtime();
    rt.block_on(async {
        let b_ip: Ipv4Addr = b.tunnel_ip.parse().expect("ip");
        let mut ch = r.open("rogue B", b_ip, b.session_token.as_bytes()).await;
        let targets = [
            (
                SocketAddrV4::new(Ipv4Addr::LOCALHOST, GRPC.port()),
                "dropped",
            ),
            (
                SocketAddrV4::new(Ipv4Addr::LOCALHOST, METRICS.port()),
                "dropped",
            ),
            (SocketAddrV4::new(MANAGER_POD_IP, GRPC.port()), "reset"),
            (SocketAddrV4::new(MANAGER_POD_IP, METRICS.port()), "reset"),
            (SocketAddrV4::new(MANAGER_POD_IP, MANAGER_PORT), "open"),
        ];
        for (i, (dst, want)) in targets.iter().enumerate() {
            let src = SocketAddrV4::new(b_ip, 42000 + i as u16);
            ch.send(&tcp_syn(src, *dst)).await;
            let (got, closed) = ch.drain(Duration::from_secs(2)).await;
            assert!(!closed, "B's channel closed");
            let answers: Vec<_> = got
                .iter()
                .filter_map(|p| parse_tcp(p))
                .filter(|(from, to, ..)| from == dst && *to == src)
                .collect();
            let syn_ack = answers.iter().any(|(_, _, syn, ack, _)| *syn && *ack);
            let rst = answers.iter().any(|(.., rst)| *rst);
            match *want {
                "dropped" => assert!(answers.is_empty(), "{dst}: answered {answers:?}"),
                "reset" => assert!(rst && !syn_ack, "{dst}: {answers:?}"),
                _ => assert!(
                    syn_ack,
                    "{dst}: the data port answers the tunnel: {answers:?}"
                ),
            }
        }
    });
    r.expect_metric(
        "kvpn_manager_lease_denied_total{reason=\"bad_client_id\"}",
        bad_ids.len() as u64,
    );
    r.expect_metric("kvpn_manager_leases_granted_total", granted);
    r.expect_metric(
        "kvpn_manager_packets_dropped_total{reason=\"forbidden_destination\"}",
        2,
    );
    r.expect_metric(
        "kvpn_manager_refused_hello_total{reason=\"wrong_token\"}",
        0,
    );
}
