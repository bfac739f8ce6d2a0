//! The classifier attached (TCX egress) to a real TUN device inside a network namespace
//! created for the test (`kvpn-t<hex>`, removed on drop, also on failure): kernel
//! sockets send UDP and ICMP to a routed pod IP, a routed ClusterIP, and an address the
//! kernel routes into the TUN but kvpn has no route for. The test reads the TUN device to
//! see what got through and checks the classifier's counters. The anti-spoofing check
//! (TCX ingress) gets packets written into the TUN device's file descriptor, as the pump
//! writes them, and a UDP socket says which reached the laptop's stack. Needs root.

use std::{
    collections::BTreeSet,
    fs::{File, OpenOptions},
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, UdpSocket},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    process::Command,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use kvpn_dataplane::ebpf::{Classifier, Counter, RouteKind};
use kvpn_lab::packets::{self, drain_for};

/// A network namespace owned by the test; deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn create(name: String) -> Self {
        run("ip", &["netns", "add", &name]);
        Self { name }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!("{:08x}", (std::process::id() << 20) ^ nanos)
}

/// Opens `/dev/net/tun` and creates the TUN device `name` (IFF_TUN | IFF_NO_PI,
/// non-blocking) in the calling thread's network namespace.
fn create_tun(name: &str) -> File {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/net/tun")
        .unwrap_or_else(|e| panic!("open /dev/net/tun: {e}"));
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
    // TUNSETIFF = _IOW('T', 202, int) (include/uapi/linux/if_tun.h).
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    // SAFETY: valid fd and a properly initialised ifreq that outlives the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut ifr) };
    assert_eq!(
        rc,
        0,
        "TUNSETIFF {name}: {}",
        std::io::Error::last_os_error()
    );
    file
}

/// IPv4 destinations of the packets that reach the TUN reader within `wait`.
fn read_destinations(tun: &mut File, wait: Duration) -> Vec<(Ipv4Addr, u8, usize)> {
    drain_for(wait, |buf| tun.read(buf))
        .into_iter()
        .map(|p| match p.len() {
            n if n >= 20 && p[0] >> 4 == 4 => (Ipv4Addr::new(p[16], p[17], p[18], p[19]), p[9], n),
            n => panic!("unexpected non-IPv4 packet of {n} bytes on the TUN device"),
        })
        .collect()
}

#[test]
fn classifier_on_a_real_tun_passes_routed_and_drops_unrouted_packets() {
    let suffix = unique_suffix();
    let netns = Netns::create(format!("kvpn-t{suffix}"));
    let ns = netns.name.clone();
    let tun_name = format!("kvt{suffix}");

    // No IPv6 in the namespace: otherwise the kernel sends router solicitations and
    // MLD reports out of the TUN, which the classifier (rightly) counts as unrouted.
    run(
        "ip",
        &[
            "netns",
            "exec",
            &ns,
            "sysctl",
            "-qw",
            "net.ipv6.conf.default.disable_ipv6=1",
        ],
    );
    run(
        "ip",
        &[
            "netns",
            "exec",
            &ns,
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.disable_ipv6=1",
        ],
    );

    let worker = std::thread::spawn(move || {
        // Attaching resolves the interface name in this thread's network namespace, and
        // sockets belong to the namespace of the thread that creates them.
        let ns_file = File::open(format!("/run/netns/{ns}"))
            .unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
        nix::sched::setns(&ns_file, nix::sched::CloneFlags::CLONE_NEWNET)
            .unwrap_or_else(|e| panic!("setns {ns}: {e}"));

        let mut tun = create_tun(&tun_name);
        for args in [
            vec!["-n", &ns, "link", "set", "lo", "up"],
            vec!["-n", &ns, "addr", "add", "100.96.0.2/32", "dev", &tun_name],
            vec!["-n", &ns, "link", "set", &tun_name, "up"],
            vec!["-n", &ns, "route", "add", "10.244.0.0/16", "dev", &tun_name],
            vec!["-n", &ns, "route", "add", "10.96.0.0/12", "dev", &tun_name],
            // The kernel routes this into the TUN, but kvpn has no route for it.
            vec![
                "-n",
                &ns,
                "route",
                "add",
                "198.51.100.0/24",
                "dev",
                &tun_name,
            ],
        ] {
            run("ip", &args);
        }

        let mut classifier =
            Classifier::attach(&tun_name).unwrap_or_else(|e| panic!("attach: {e:?}"));
        assert_eq!(classifier.ifname(), Some(tun_name.as_str()));
        classifier
            .insert_route(
                "10.244.0.0/16".parse().unwrap_or_else(|e| panic!("{e}")),
                RouteKind::Pod,
            )
            .unwrap_or_else(|e| panic!("{e:?}"));
        classifier
            .insert_route(
                "10.96.0.0/12".parse().unwrap_or_else(|e| panic!("{e}")),
                RouteKind::Service,
            )
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert!(
            Classifier::is_attached_to(&tun_name).unwrap_or_else(|e| panic!("{e:?}")),
            "TCX egress should list kvpn_tun_egress"
        );

        let socket = UdpSocket::bind("0.0.0.0:0").unwrap_or_else(|e| panic!("bind: {e}"));
        socket
            .send_to(&[1u8; 100], "10.244.1.11:7007")
            .unwrap_or_else(|e| panic!("send to pod: {e}"));
        socket
            .send_to(&[2u8; 32], "10.96.0.102:7")
            .unwrap_or_else(|e| panic!("send to ClusterIP: {e}"));
        // The drop may surface as ENOBUFS or be swallowed by UDP; either is fine, the
        // counters and the TUN reader say what happened.
        let _ = socket.send_to(&[3u8; 10], "198.51.100.9:7");
        // One echo request, 56 bytes of payload = 84-byte IP packet. Nobody answers.
        let _ = Command::new("ping")
            .args(["-n", "-q", "-c", "1", "-W", "1", "-s", "56", "10.244.1.12"])
            .output()
            .unwrap_or_else(|e| panic!("run ping: {e}"));

        let seen = read_destinations(&mut tun, Duration::from_millis(500));
        let stats = classifier.stats().unwrap_or_else(|e| panic!("{e:?}"));
        drop(classifier);
        let attached_after_drop =
            Classifier::is_attached_to(&tun_name).unwrap_or_else(|e| panic!("{e:?}"));
        (seen, stats, attached_after_drop)
    });
    let (seen, stats, attached_after_drop) = match worker.join() {
        Ok(result) => result,
        Err(panic) => std::panic::resume_unwind(panic),
    };

    let destinations: BTreeSet<(Ipv4Addr, u8, usize)> = seen.iter().copied().collect();
    let expected: BTreeSet<(Ipv4Addr, u8, usize)> = [
        (Ipv4Addr::new(10, 244, 1, 11), 17, 128),
        (Ipv4Addr::new(10, 96, 0, 102), 17, 60),
        (Ipv4Addr::new(10, 244, 1, 12), 1, 84),
    ]
    .into_iter()
    .collect();
    assert_eq!(
        destinations, expected,
        "packets read from the TUN device: {seen:?}"
    );
    assert_eq!(seen.len(), 3, "each packet exactly once: {seen:?}");

    assert_eq!(
        stats.kind(RouteKind::Pod),
        Counter {
            packets: 2,
            bytes: 128 + 84
        }
    );
    assert_eq!(
        stats.kind(RouteKind::Service),
        Counter {
            packets: 1,
            bytes: 60
        }
    );
    assert_eq!(stats.kind(RouteKind::Extra), Counter::default());
    assert_eq!(
        stats.unrouted,
        Counter {
            packets: 1,
            bytes: 38
        }
    );
    assert_eq!(stats.malformed, Counter::default());
    assert!(
        !attached_after_drop,
        "dropping the Classifier must detach it"
    );
}

/// A UDP datagram `src:5000 -> dst:port` with `payload`, as a bare IP packet with
/// correct IP and UDP checksums (the kernel delivers it to a socket).
fn udp_packet(src: IpAddr, dst: IpAddr, port: u16, payload: &[u8]) -> Vec<u8> {
    packets::udp_packet(src, dst, 5000, port, payload)
}

/// Payloads `socket` received within `wait`.
fn received(socket: &UdpSocket, wait: Duration) -> BTreeSet<Vec<u8>> {
    drain_for(wait, |buf| socket.recv_from(buf).map(|(n, _)| n))
        .into_iter()
        .collect()
}

/// Which TC hook sees the packets the pump writes into the TUN device: the ingress
/// one. Packets from a routed pod CIDR (IPv4 and IPv6) reach a UDP socket on the
/// laptop; packets from the internet (8.8.8.8, 2001:db8::1) or a laptop LAN address
/// (192.168.1.50, on the laptop's own LAN veth) do not, and are counted
/// as `foreign_source`. With rp_filter off, the same spoofed packet does reach the
/// socket once the check is detached: the kernel alone would have delivered it.
#[test]
fn ingress_check_drops_packets_written_to_the_tun_from_non_cluster_sources() {
    let suffix = unique_suffix();
    let netns = Netns::create(format!("kvpn-i{suffix}"));
    let ns = netns.name.clone();
    let tun_name = format!("kvi{suffix}");
    let lan_name = format!("kvl{suffix}");
    let lan_peer = format!("kvm{suffix}");

    let worker = std::thread::spawn(move || {
        let ns_file = File::open(format!("/run/netns/{ns}"))
            .unwrap_or_else(|e| panic!("open netns {ns}: {e}"));
        nix::sched::setns(&ns_file, nix::sched::CloneFlags::CLONE_NEWNET)
            .unwrap_or_else(|e| panic!("setns {ns}: {e}"));

        let mut tun = create_tun(&tun_name);
        // rp_filter off everywhere, so that nothing but the eBPF check stops a packet.
        for key in ["all", "default", tun_name.as_str()] {
            run(
                "sysctl",
                &["-qw", &format!("net.ipv4.conf.{key}.rp_filter=0")],
            );
        }
        for args in [
            vec!["link", "set", "lo", "up"],
            vec![
                "link", "add", &lan_name, "type", "veth", "peer", "name", &lan_peer,
            ],
            vec!["addr", "add", "192.168.1.1/24", "dev", &lan_name],
            vec!["link", "set", &lan_name, "up"],
            vec!["link", "set", &lan_peer, "up"],
            vec!["addr", "add", "100.96.0.2/32", "dev", &tun_name],
            vec!["addr", "add", "fd00:96::2/128", "dev", &tun_name, "nodad"],
            vec!["link", "set", &tun_name, "up"],
            vec!["route", "add", "10.244.0.0/16", "dev", &tun_name],
            vec!["-6", "route", "add", "fd00:10:244::/64", "dev", &tun_name],
        ] {
            run("ip", &args);
        }

        let mut classifier =
            Classifier::attach(&tun_name).unwrap_or_else(|e| panic!("attach: {e:?}"));
        for (cidr, kind) in [
            ("10.244.0.0/16", RouteKind::Pod),
            ("fd00:10:244::/64", RouteKind::Pod),
        ] {
            classifier
                .insert_route(cidr.parse().unwrap_or_else(|e| panic!("{e}")), kind)
                .unwrap_or_else(|e| panic!("{e:?}"));
        }

        let v4 = UdpSocket::bind("0.0.0.0:7777").unwrap_or_else(|e| panic!("bind v4: {e}"));
        let v6 = UdpSocket::bind("[::]:7778").unwrap_or_else(|e| panic!("bind v6: {e}"));
        for s in [&v4, &v6] {
            s.set_nonblocking(true)
                .unwrap_or_else(|e| panic!("nonblocking: {e}"));
        }
        let laptop4 = IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2));
        let laptop6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 2));
        let pod4 = IpAddr::V4(Ipv4Addr::new(10, 244, 1, 11));
        let pod6 = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 5));
        let internet4 = IpAddr::V4(Ipv4Addr::new(8, 8, 8, 8));
        let lan4 = IpAddr::V4(Ipv4Addr::new(192, 168, 1, 50));
        let internet6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1));
        let packets = [
            udp_packet(pod4, laptop4, 7777, b"pod v4"),
            udp_packet(internet4, laptop4, 7777, b"internet v4"),
            udp_packet(lan4, laptop4, 7777, b"lan v4"),
            udp_packet(pod6, laptop6, 7778, b"pod v6"),
            udp_packet(internet6, laptop6, 7778, b"internet v6"),
        ];
        let before = classifier.stats().unwrap_or_else(|e| panic!("{e:?}"));
        for p in &packets {
            tun.write_all(p)
                .unwrap_or_else(|e| panic!("write to the TUN device: {e}"));
        }
        // IPv4 by its version nibble (the TUN driver refuses anything else) but cut
        // inside the header: malformed.
        let mut truncated = [0u8; 12];
        truncated[0] = 0x45;
        tun.write_all(&truncated)
            .unwrap_or_else(|e| panic!("write to the TUN device: {e}"));
        let got4 = received(&v4, Duration::from_millis(300));
        let got6 = received(&v6, Duration::from_millis(100));
        let after = classifier.stats().unwrap_or_else(|e| panic!("{e:?}"));
        let ids = Classifier::attached_program_ids(&tun_name).unwrap_or_else(|e| panic!("{e:?}"));

        // Control: without the check, the kernel delivers the spoofed packet.
        drop(classifier);
        let attached_after_drop =
            Classifier::is_attached_to(&tun_name).unwrap_or_else(|e| panic!("{e:?}"));
        tun.write_all(&packets[1])
            .unwrap_or_else(|e| panic!("write to the TUN device: {e}"));
        let unchecked = received(&v4, Duration::from_millis(300));
        (
            got4,
            got6,
            before,
            after,
            ids.len(),
            attached_after_drop,
            unchecked,
            packets.iter().map(Vec::len).collect::<Vec<_>>(),
        )
    });
    let (got4, got6, before, after, programs, attached_after_drop, unchecked, lens) =
        match worker.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        };

    let set = |items: &[&[u8]]| -> BTreeSet<Vec<u8>> { items.iter().map(|i| i.to_vec()).collect() };
    assert_eq!(got4, set(&[b"pod v4"]), "IPv4 payloads the laptop received");
    assert_eq!(got6, set(&[b"pod v6"]), "IPv6 payloads the laptop received");
    assert_eq!(programs, 2, "egress classifier and ingress check attached");
    assert_eq!(before.ingress, Default::default());
    assert_eq!(
        after.ingress.passed,
        Counter {
            packets: 2,
            bytes: (lens[0] + lens[3]) as u64
        },
        "{after:?}"
    );
    assert_eq!(
        after.ingress.foreign_source,
        Counter {
            packets: 3,
            bytes: (lens[1] + lens[2] + lens[4]) as u64
        },
        "{after:?}"
    );
    assert_eq!(
        after.ingress.malformed,
        Counter {
            packets: 1,
            bytes: 12
        }
    );
    // The egress classifier never saw them: ingress is the hook of written packets.
    assert_eq!(after.kind(RouteKind::Pod), Counter::default());
    assert!(
        !attached_after_drop,
        "dropping the Classifier detaches both programs"
    );
    assert_eq!(
        unchecked,
        set(&[b"internet v4"]),
        "without the check the kernel delivers the spoofed packet (else this test proves nothing)"
    );
}
