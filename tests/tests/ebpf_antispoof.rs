//! End-to-end test of the eBPF anti-spoofing check on the TUN device's ingress
//! (issue 8, item 3): packets coming out of the tunnel whose source is not a cluster
//! range of the session never reach a laptop application and are counted in
//! `kvpn status` (`ebpf.ingress.foreign_source`), while replies from pods still flow.
//!
//! The lab is the static one (network namespaces, real TUN, eBPF, root daemon and
//! traffic manager). Between the root daemon and the real manager sits
//! [`SpoofingRelay`], a test double of a compromised path: it relays the data
//! channel byte for byte (plain TCP, direct mode) and, on demand, writes extra Packet
//! frames toward the laptop, between the manager's own frames. Runs as root.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvpn_lab::packets::{self, drain_for};
use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{BACKEND_1_IP, BACKEND_1_POD, HTTP_PORT, NODE_UPLINK_IP};
use kvpn_proto::frame::{self, Decoder, Kind};
use kvpn_tests::{Fixture, text};

/// Test double: a relay on the laptop's loopback between the root daemon and the
/// lab's manager that can inject Packet frames toward the laptop, as a compromised
/// manager or path could. Relays every connection the daemon makes (re-dials too);
/// injects into the newest one.
struct SpoofingRelay {
    addr: SocketAddr,
    /// The laptop-side writer of the newest relayed connection. Its lock also
    /// serialises every write toward the laptop, relayed or injected.
    to_laptop: Arc<Mutex<Option<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for SpoofingRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self
            .to_laptop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl SpoofingRelay {
    fn start(f: &Fixture) -> Self {
        let netns = f.lab.laptop_netns().name().to_owned();
        let listener = f.in_laptop(|| {
            TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("relay bind: {e}"))
        });
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("relay address: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("relay nonblocking: {e}"));
        let to_laptop: Arc<Mutex<Option<TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let slot = to_laptop.clone();
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let laptop = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    Err(_) => break,
                };
                if laptop.set_nonblocking(false).is_err() {
                    continue;
                }
                let manager = kvpn_lab::run_in_netns(&netns, || {
                    TcpStream::connect_timeout(
                        &SocketAddr::V4(kvpn_lab::MANAGER_ADDR_FROM_LAPTOP),
                        Duration::from_secs(5),
                    )
                });
                let Ok(Ok(manager)) = manager else {
                    continue;
                };
                let (Ok(laptop_rx), Ok(laptop_tx), Ok(manager_tx)) =
                    (laptop.try_clone(), laptop.try_clone(), manager.try_clone())
                else {
                    continue;
                };
                *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(laptop_tx);
                std::thread::spawn(move || copy(laptop_rx, manager_tx));
                let slot = slot.clone();
                std::thread::spawn(move || relay_frames(manager, laptop, &slot));
            }
        });
        SpoofingRelay {
            addr,
            to_laptop,
            stop,
        }
    }

    /// Writes `packet` as one Packet frame toward the laptop, between two of the
    /// manager's frames.
    fn inject(&self, packet: &[u8]) {
        let mut out = Vec::new();
        frame::encode_into(Kind::Packet, packet, &mut out)
            .unwrap_or_else(|e| panic!("encode: {e}"));
        let mut guard = self
            .to_laptop
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let stream = guard
            .as_mut()
            .unwrap_or_else(|| panic!("the root daemon has not dialled the relay"));
        stream
            .write_all(&out)
            .unwrap_or_else(|e| panic!("inject toward the laptop: {e}"));
    }
}

/// Laptop -> manager: bytes as they come.
fn copy(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// Manager -> laptop: whole frames only, each written under the lock `inject` takes,
/// so an injected frame never lands inside one of the manager's.
fn relay_frames(mut manager: TcpStream, laptop: TcpStream, writer: &Mutex<Option<TcpStream>>) {
    let decoder = Decoder::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match manager.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&buf[..n]);
        let mut whole = 0;
        loop {
            match decoder.decode(&pending[whole..]) {
                Ok(Some((_, used))) => whole += used,
                Ok(None) => break,
                Err(_) => return,
            }
        }
        if whole == 0 {
            continue;
        }
        let guard = writer.lock().unwrap_or_else(PoisonError::into_inner);
        if (&laptop).write_all(&pending[..whole]).is_err() {
            break;
        }
        drop(guard);
        pending.drain(..whole);
    }
    let _ = laptop.shutdown(std::net::Shutdown::Both);
}

/// A UDP datagram `src:53 -> dst:port` with valid checksums.
fn udp_from_53(src: IpAddr, dst: IpAddr, port: u16, payload: &[u8]) -> Vec<u8> {
    packets::udp_packet(src, dst, 53, port, payload)
}

fn ingress(status: &serde_json::Value, reason: &str) -> (u64, u64) {
    let c = &status["sessions"][0]["ebpf"]["ingress"][reason];
    (
        c["packets"]
            .as_u64()
            .unwrap_or_else(|| panic!("no ebpf.ingress.{reason}.packets: {status}")),
        c["bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("no ebpf.ingress.{reason}.bytes: {status}")),
    )
}

/// Payloads `socket` receives within `wait`.
fn received(socket: &UdpSocket, wait: Duration) -> BTreeSet<Vec<u8>> {
    drain_for(wait, |buf| socket.recv_from(buf).map(|(n, _)| n))
        .into_iter()
        .collect()
}

fn page(f: &Fixture, url: &str) -> PageInfo {
    let out = f.laptop(&["curl", "-sS", "--max-time", "5", url]);
    assert!(
        out.status.success(),
        "curl {url} failed: {}\ndaemon log:\n{}",
        text(&out.stderr),
        f.daemon_log()
    );
    PageInfo::parse(&text(&out.stdout))
        .unwrap_or_else(|| panic!("not a lab page: {:?}", text(&out.stdout)))
}

/// Packets from the tunnel with a source outside the session's cluster ranges — the
/// internet (8.8.8.8, 2001:db8::1) or the laptop's own uplink neighbour
/// (172.31.255.1, which the kernel's loose rp_filter would accept) — never reach a
/// UDP socket on the laptop and raise `ebpf.ingress.foreign_source` by exactly their
/// number and bytes; a packet injected the same way from a pod IP is received (the
/// injection path works) and counted as passed; curl to a pod still works.
#[test]
fn spoofed_sources_from_the_tunnel_are_dropped_and_counted() {
    let f = Fixture::new();
    let relay = SpoofingRelay::start(&f);
    let relay_addr = relay.addr.to_string();
    let out = f.kvpn(&[
        "connect",
        "--manager",
        &relay_addr,
        "--pod-cidr",
        &kvpn_lab::POD_CIDR.to_string(),
        "--service-cidr",
        &kvpn_lab::SERVICE_CIDR.to_string(),
    ]);
    assert!(
        out.status.success(),
        "kvpn connect through the relay failed:\n{}\n{}\ndaemon log:\n{}",
        text(&out.stdout),
        text(&out.stderr),
        f.daemon_log()
    );
    // Pod replies flow through the relay.
    let p = page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert_eq!(p.pod, BACKEND_1_POD);

    let before = f.status_json();
    assert_eq!(before["sessions"][0]["state"], "connected", "{before}");
    let tunnel_ip: Ipv4Addr = before["sessions"][0]["tunnel_ip"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no IPv4 tunnel_ip: {before}"));

    let app = f.in_laptop(|| {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap_or_else(|e| panic!("bind: {e}"));
        s.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap_or_else(|e| panic!("timeout: {e}"));
        s
    });
    let port = app
        .local_addr()
        .unwrap_or_else(|e| panic!("local address: {e}"))
        .port();

    let spoofed = [
        udp_from_53(
            Ipv4Addr::new(8, 8, 8, 8).into(),
            tunnel_ip.into(),
            port,
            b"from 8.8.8.8",
        ),
        udp_from_53(
            NODE_UPLINK_IP.into(),
            tunnel_ip.into(),
            port,
            b"from the uplink neighbour",
        ),
        udp_from_53(
            Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).into(),
            Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2).into(),
            port,
            b"from 2001:db8::1",
        ),
    ];
    let legit = udp_from_53(BACKEND_1_IP.into(), tunnel_ip.into(), port, b"from a pod");
    for p in &spoofed {
        relay.inject(p);
    }
    relay.inject(&legit);
    let got = received(&app, Duration::from_millis(1500));
    let after = f.status_json();

    let want: BTreeSet<Vec<u8>> = [b"from a pod".to_vec()].into_iter().collect();
    assert_eq!(
        got, want,
        "what the laptop application received (only the pod's datagram may arrive)"
    );
    let (dropped0, dropped_bytes0) = ingress(&before, "foreign_source");
    let (dropped1, dropped_bytes1) = ingress(&after, "foreign_source");
    assert_eq!(
        (dropped1 - dropped0, dropped_bytes1 - dropped_bytes0),
        (
            spoofed.len() as u64,
            spoofed.iter().map(|p| p.len() as u64).sum()
        ),
        "ebpf.ingress.foreign_source before {before}\nafter {after}"
    );
    let (passed0, _) = ingress(&before, "passed");
    let (passed1, _) = ingress(&after, "passed");
    assert!(
        passed1 > passed0,
        "ebpf.ingress.passed did not rise: {after}"
    );
    assert_eq!(
        ingress(&after, "malformed").0,
        ingress(&before, "malformed").0
    );

    // And the pod path still works after the attempt.
    let p = page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert_eq!(p.pod_ip, IpAddr::V4(BACKEND_1_IP));
}
