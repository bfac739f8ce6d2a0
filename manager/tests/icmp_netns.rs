//! ICMP echo through the manager, in a private network namespace (needs root,
//! as CI runs): a ping succeeds only when the target answers (tr-03), echo
//! identifier, sequence and payload come back unchanged, and without
//! `net.ipv4.ping_group_range` the manager cannot ping at all. Also TCP to an
//! address that never answers (ICMP host unreachable, tr-04).

mod common;

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::time::Duration;

use common::{LAPTOP_V4, LAPTOP_V6, Laptop};
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    Icmpv4Message, Icmpv4Packet, Icmpv4Repr, Icmpv6Message, Icmpv6Packet, Icmpv6Repr, IpProtocol,
    Ipv4Packet, Ipv4Repr, Ipv6Packet, Ipv6Repr,
};

fn require_root() {
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "this test needs root (network namespaces): run it as root, as CI does"
    );
}

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A uniquely named netns `kvpn-t<hex>`, deleted on drop (also on failure).
struct TestNetns {
    name: String,
}

impl TestNetns {
    fn new() -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let name = format!("kvpn-t{:08x}", h.finish() as u32);
        run(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        run(&["ip", "-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// Run `f` on a thread inside the netns, with its own current-thread runtime,
    /// so every socket the manager opens lives in the netns.
    fn run<F, Fut>(&self, f: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let path = format!("/run/netns/{}", self.name);
        let result = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(f());
        })
        .join();
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn echo_request_v4(src: Ipv4Addr, dst: Ipv4Addr, ident: u16, seq: u16, data: &[u8]) -> Vec<u8> {
    let icmp = Icmpv4Repr::EchoRequest {
        ident,
        seq_no: seq,
        data,
    };
    let ip = Ipv4Repr {
        src_addr: src,
        dst_addr: dst,
        next_header: IpProtocol::Icmp,
        payload_len: icmp.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip.buffer_len() + icmp.buffer_len()];
    let caps = ChecksumCapabilities::default();
    ip.emit(&mut Ipv4Packet::new_unchecked(&mut buf[..]), &caps);
    icmp.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[20..]), &caps);
    buf
}

fn echo_request_v6(src: Ipv6Addr, dst: Ipv6Addr, ident: u16, seq: u16, data: &[u8]) -> Vec<u8> {
    let icmp = Icmpv6Repr::EchoRequest {
        ident,
        seq_no: seq,
        data,
    };
    let ip = Ipv6Repr {
        src_addr: src,
        dst_addr: dst,
        next_header: IpProtocol::Icmpv6,
        payload_len: icmp.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip.buffer_len() + icmp.buffer_len()];
    ip.emit(&mut Ipv6Packet::new_unchecked(&mut buf[..]));
    icmp.emit(
        &src,
        &dst,
        &mut Icmpv6Packet::new_unchecked(&mut buf[40..]),
        &ChecksumCapabilities::default(),
    );
    buf
}

/// (source, ident, seq, payload) of an echo reply, if `p` is one.
fn echo_reply(p: &[u8]) -> Option<(IpAddr, u16, u16, Vec<u8>)> {
    if let Ok(ip) = Ipv4Packet::new_checked(p) {
        if ip.next_header() != IpProtocol::Icmp {
            return None;
        }
        let icmp = Icmpv4Packet::new_checked(ip.payload()).ok()?;
        assert!(icmp.verify_checksum(), "bad ICMP checksum");
        (icmp.msg_type() == Icmpv4Message::EchoReply).then(|| {
            (
                IpAddr::V4(ip.src_addr()),
                icmp.echo_ident(),
                icmp.echo_seq_no(),
                icmp.data().to_vec(),
            )
        })
    } else {
        let ip = Ipv6Packet::new_checked(p).ok()?;
        if ip.next_header() != IpProtocol::Icmpv6 {
            return None;
        }
        let icmp = Icmpv6Packet::new_checked(ip.payload()).ok()?;
        assert!(
            icmp.verify_checksum(&ip.src_addr(), &ip.dst_addr()),
            "bad ICMPv6 checksum"
        );
        (icmp.msg_type() == Icmpv6Message::EchoReply).then(|| {
            (
                IpAddr::V6(ip.src_addr()),
                icmp.echo_ident(),
                icmp.echo_seq_no(),
                icmp.payload().to_vec(),
            )
        })
    }
}

/// Ping `target` through a fresh session; the echo replies that came back within `wait`.
async fn ping(
    tunnel_ip: IpAddr,
    target: IpAddr,
    seqs: &[u16],
    wait: Duration,
) -> Vec<(IpAddr, u16, u16, Vec<u8>)> {
    let mut laptop = Laptop::connect(tunnel_ip).await;
    laptop.keep_packets = true;
    for &seq in seqs {
        let payload = format!("kvpn-ping-{seq}").into_bytes();
        let pkt = match (tunnel_ip, target) {
            (IpAddr::V4(s), IpAddr::V4(d)) => echo_request_v4(s, d, 0x4b56, seq, &payload),
            (IpAddr::V6(s), IpAddr::V6(d)) => echo_request_v6(s, d, 0x4b56, seq, &payload),
            _ => panic!("mixed families"),
        };
        laptop.send_packet(&pkt).await;
    }
    let n = seqs.len();
    laptop
        .run_until(wait, |l| {
            l.packets.iter().filter_map(|p| echo_reply(p)).count() >= n
        })
        .await;
    let replies = laptop
        .packets
        .iter()
        .filter_map(|p| echo_reply(p))
        .collect();
    let metrics = laptop.finish().await;
    assert_eq!(metrics.pings_sent, n as u64);
    replies
}

fn expected(target: IpAddr, seqs: &[u16]) -> Vec<(IpAddr, u16, u16, Vec<u8>)> {
    seqs.iter()
        .map(|&s| (target, 0x4b56, s, format!("kvpn-ping-{s}").into_bytes()))
        .collect()
}

#[test]
fn ping_succeeds_only_when_the_target_answers() {
    require_root();
    let ns = TestNetns::new();
    // A veth pair inside the netns: 192.0.2.1/24 on one end, nothing on the
    // other, so 192.0.2.99 is routed but never answers (like an unused pod IP).
    let (a, b) = (
        format!("kva{}", &ns.name[6..14]),
        format!("kvb{}", &ns.name[6..14]),
    );
    run(&[
        "ip", "-n", &ns.name, "link", "add", &a, "type", "veth", "peer", "name", &b,
    ]);
    run(&[
        "ip",
        "-n",
        &ns.name,
        "addr",
        "add",
        "192.0.2.1/24",
        "dev",
        &a,
    ]);
    run(&["ip", "-n", &ns.name, "link", "set", &a, "up"]);
    run(&["ip", "-n", &ns.name, "link", "set", &b, "up"]);

    // A fresh netns allows nobody to open ping sockets: no reply, even from loopback.
    ns.run(|| async {
        let got = ping(
            LAPTOP_V4,
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            &[1],
            Duration::from_secs(1),
        )
        .await;
        assert!(got.is_empty(), "reply without ping sockets: {got:?}");
    });

    run(&[
        "ip",
        "netns",
        "exec",
        &ns.name,
        "sysctl",
        "-qw",
        "net.ipv4.ping_group_range=0 2147483647",
    ]);
    ns.run(|| async {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let got = ping(LAPTOP_V4, lo, &[1, 2, 3], Duration::from_secs(5)).await;
        assert_eq!(
            got,
            expected(lo, &[1, 2, 3]),
            "echo id/seq/payload must come back unchanged"
        );

        let here = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1));
        let got = ping(LAPTOP_V4, here, &[7], Duration::from_secs(5)).await;
        assert_eq!(got, expected(here, &[7]));

        let silent = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 99));
        let got = ping(LAPTOP_V4, silent, &[1, 2], Duration::from_secs(2)).await;
        assert!(
            got.is_empty(),
            "reply from an address nobody holds: {got:?}"
        );

        let unrouted = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7));
        let got = ping(LAPTOP_V4, unrouted, &[1], Duration::from_secs(1)).await;
        assert!(got.is_empty(), "reply from an unrouted address: {got:?}");

        let lo6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
        let got = ping(LAPTOP_V6, lo6, &[5], Duration::from_secs(5)).await;
        assert_eq!(got, expected(lo6, &[5]), "ICMPv6 echo");
    });
}

/// tr-04: a SYN to an address that never answers gets ICMP host unreachable
/// (after the dial timeout or the kernel's failed neighbour resolution), never
/// a SYN-ACK; a closed port on a live address gets RST.
#[test]
fn tcp_to_a_silent_address_gets_host_unreachable() {
    require_root();
    let ns = TestNetns::new();
    let (a, b) = (
        format!("kva{}", &ns.name[6..14]),
        format!("kvb{}", &ns.name[6..14]),
    );
    run(&[
        "ip", "-n", &ns.name, "link", "add", &a, "type", "veth", "peer", "name", &b,
    ]);
    run(&[
        "ip",
        "-n",
        &ns.name,
        "addr",
        "add",
        "192.0.2.1/24",
        "dev",
        &a,
    ]);
    run(&["ip", "-n", &ns.name, "link", "set", &a, "up"]);
    run(&["ip", "-n", &ns.name, "link", "set", &b, "up"]);
    ns.run(|| async {
        let mut laptop = Laptop::connect(LAPTOP_V4).await;
        laptop.keep_packets = true;
        let silent = laptop.tcp_socket(4096, 4096);
        laptop.connect_tcp(silent, "192.0.2.99:80".parse().expect("addr"), 42000);
        let closed = laptop.tcp_socket(4096, 4096);
        laptop.connect_tcp(closed, "192.0.2.1:81".parse().expect("addr"), 42001);
        let host_unreachable = |p: &Vec<u8>| {
            let Ok(ip) = Ipv4Packet::new_checked(&p[..]) else {
                return false;
            };
            let Ok(icmp) = Icmpv4Packet::new_checked(ip.payload()) else {
                return false;
            };
            ip.next_header() == IpProtocol::Icmp
                && ip.src_addr() == Ipv4Addr::new(192, 0, 2, 99)
                && icmp.msg_type() == Icmpv4Message::DstUnreachable
                && icmp.msg_code() == 1
        };
        // The test session's dial timeout is 2 s; ARP gives up after ~3 s.
        let ok = laptop
            .run_until(Duration::from_secs(6), |l| {
                l.packets.iter().any(host_unreachable)
            })
            .await;
        assert!(ok, "no ICMP host unreachable for the silent address");
        use smoltcp::socket::tcp::State;
        assert_eq!(
            laptop.tcp(closed).state(),
            State::Closed,
            "closed port not refused"
        );
        assert_ne!(laptop.tcp(silent).state(), State::Established);
        let metrics = laptop.finish().await;
        assert_eq!(
            (
                metrics.tcp_unreachable,
                metrics.tcp_refused,
                metrics.tcp_connected
            ),
            (1, 1, 0)
        );
    });
}
