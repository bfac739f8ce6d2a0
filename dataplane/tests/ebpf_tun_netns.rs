//! The classifier attached (TCX egress) to a real TUN device inside a network namespace
//! created for the test (`kvpn-t<hex>`, removed on drop, also on failure): kernel
//! sockets send UDP and ICMP to a routed pod IP, a routed ClusterIP, and an address the
//! kernel routes into the TUN but kvpn has no route for. The test reads the TUN device to
//! see what got through and checks the classifier's counters. Needs root.

use std::{
    collections::BTreeSet,
    fs::{File, OpenOptions},
    io::Read as _,
    net::{Ipv4Addr, UdpSocket},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use kvpn_dataplane::ebpf::{Classifier, Counter, RouteKind};

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
    let deadline = Instant::now() + wait;
    let mut seen = Vec::new();
    let mut buf = [0u8; 65536];
    while Instant::now() < deadline {
        match tun.read(&mut buf) {
            Ok(n) if n >= 20 && buf[0] >> 4 == 4 => {
                seen.push((Ipv4Addr::new(buf[16], buf[17], buf[18], buf[19]), buf[9], n))
            }
            Ok(n) => panic!("unexpected non-IPv4 packet of {n} bytes on the TUN device"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("read TUN: {e}"),
        }
    }
    seen
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
