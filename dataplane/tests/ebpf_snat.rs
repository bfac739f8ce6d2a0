//! `ebpf-snat`'s TC programs run by the kernel on crafted Ethernet frames
//! (BPF_PROG_TEST_RUN), as they would on the manager pod's `eth0`: the egress program
//! rewrites a laptop packet's source (tunnel IP:port → pod IP:allocated port) with
//! valid IP and L4 checksums, the ingress program rewrites the reply back, ports are
//! allocated per destination and run out honestly, and the sweep expires idle flows.
//! Needs root (CAP_BPF + CAP_NET_ADMIN); each test loads its own programs and maps.

use std::net::Ipv4Addr;
use std::time::Duration;

use kvpn_dataplane::ebpf::TcAction;
use kvpn_dataplane::ebpf::snat::{Snat, SnatSettings, SnatTimeouts, monotonic_ns};

const LAPTOP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 20);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const OTHER_BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;

fn snat(ports: std::ops::RangeInclusive<u16>) -> Snat {
    Snat::load(&SnatSettings {
        pod_ip: POD,
        pool: "100.96.0.0/16".parse().expect("pool"),
        ports,
    })
    .unwrap_or_else(|e| panic!("load ebpf-snat (root and a built eBPF object needed): {e:?}"))
}

fn sum(bytes: &[u8], mut acc: u32) -> u32 {
    for c in bytes.chunks(2) {
        acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// Ethernet + IPv4 + `l4` with every checksum filled in (RFC 791, 793, 768, 792).
fn frame(proto: u8, src: Ipv4Addr, dst: Ipv4Addr, mut l4: Vec<u8>) -> Vec<u8> {
    let csum_at = match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    };
    let pseudo = if proto == ICMP {
        0
    } else {
        let mut p = Vec::new();
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(&[0, proto]);
        p.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        sum(&p, 0)
    };
    let c = fold(sum(&l4, pseudo));
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip[8] = 64;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = fold(sum(&ip, 0));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend_from_slice(&ip);
    f.extend_from_slice(&l4);
    f
}

fn ports_l4(proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    let mut l4 = vec![0u8; if proto == TCP { 20 } else { 12 }];
    l4[0..2].copy_from_slice(&sport.to_be_bytes());
    l4[2..4].copy_from_slice(&dport.to_be_bytes());
    if proto == TCP {
        l4[12] = 5 << 4;
        l4[13] = 0x02;
    } else {
        l4[4..6].copy_from_slice(&12u16.to_be_bytes());
        l4[8..12].copy_from_slice(b"ping");
    }
    l4
}

fn echo(icmp_type: u8, id: u16) -> Vec<u8> {
    let mut l4 = vec![icmp_type, 0, 0, 0, 0, 0, 0, 7, 1, 2, 3, 4];
    l4[4..6].copy_from_slice(&id.to_be_bytes());
    l4
}

struct Seen {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
}

/// Addresses and ports of a frame, after checking every checksum in it.
fn check(f: &[u8]) -> Seen {
    let ip = &f[14..34];
    assert_eq!(fold(sum(ip, 0)), 0, "IPv4 header checksum");
    let l4 = &f[34..];
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let pseudo = if proto == ICMP {
        0
    } else {
        let mut p = Vec::new();
        p.extend_from_slice(&ip[12..20]);
        p.extend_from_slice(&[0, proto]);
        p.extend_from_slice(&(l4.len() as u16).to_be_bytes());
        sum(&p, 0)
    };
    // A zero UDP checksum means "none" (RFC 768).
    if !(proto == UDP && l4[6..8] == [0, 0]) {
        assert_eq!(fold(sum(l4, pseudo)), 0, "L4 checksum of protocol {proto}");
    }
    let word = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    if proto == ICMP {
        Seen {
            src,
            dst,
            sport: word(4),
            dport: 0,
        }
    } else {
        Seen {
            src,
            dst,
            sport: word(0),
            dport: word(2),
        }
    }
}

fn run(s: &Snat, ingress: bool, f: &[u8]) -> (TcAction, Vec<u8>) {
    s.test_run(ingress, f)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN: {e:?}"))
}

#[test]
fn tcp_and_udp_flows_leave_with_the_pod_ip_and_replies_come_back() {
    let s = snat(61000..=65535);
    for proto in [TCP, UDP] {
        let out = frame(proto, LAPTOP, BACKEND, ports_l4(proto, 40000, 80));
        let (action, got) = run(&s, false, &out);
        assert_eq!(action, TcAction::Pass);
        let seen = check(&got);
        assert_eq!(seen.src, POD, "protocol {proto}: source is the pod IP");
        assert_eq!(seen.dst, BACKEND);
        assert!((61000..=65535).contains(&seen.sport), "port {}", seen.sport);
        assert_eq!(seen.dport, 80);
        // The same flow keeps its port.
        let (_, again) = run(&s, false, &out);
        assert_eq!(check(&again).sport, seen.sport);

        let reply = frame(proto, BACKEND, POD, ports_l4(proto, 80, seen.sport));
        let (action, back) = run(&s, true, &reply);
        assert_eq!(action, TcAction::Pass);
        let b = check(&back);
        assert_eq!(
            (b.src, b.dst, b.sport, b.dport),
            (BACKEND, LAPTOP, 80, 40000)
        );

        // A reply to a port no flow holds is the pod's own: untouched.
        let stray = frame(proto, BACKEND, POD, ports_l4(proto, 80, 12345));
        assert_eq!(run(&s, true, &stray), (TcAction::Pass, stray.clone()));
    }
    let stats = s.stats().expect("stats");
    assert_eq!(stats.new_flows.packets, 2);
    assert_eq!(stats.translated_out.packets, 4);
    assert_eq!(stats.translated_in.packets, 2);
    assert_eq!((stats.forward_entries, stats.reverse_entries), (2, 2));
}

#[test]
fn icmp_echo_uses_the_identifier_as_port() {
    let s = snat(61000..=65535);
    let (action, got) = run(&s, false, &frame(ICMP, LAPTOP, BACKEND, echo(8, 0x1234)));
    assert_eq!(action, TcAction::Pass);
    let seen = check(&got);
    assert_eq!(seen.src, POD);
    assert!(seen.sport >= 61000, "identifier {}", seen.sport);
    let (_, back) = run(&s, true, &frame(ICMP, BACKEND, POD, echo(0, seen.sport)));
    let b = check(&back);
    assert_eq!((b.dst, b.sport), (LAPTOP, 0x1234));
    // Other ICMP from the pool (a laptop's port unreachable) must not leave with the
    // tunnel IP: dropped and counted.
    let (action, _) = run(&s, false, &frame(ICMP, LAPTOP, BACKEND, echo(3, 0)));
    assert_eq!(action, TcAction::Drop);
    assert_eq!(s.stats().expect("stats").untranslatable.packets, 1);
}

#[test]
fn the_pods_own_traffic_passes_untouched() {
    let s = snat(61000..=65535);
    let own = frame(TCP, POD, BACKEND, ports_l4(TCP, 45000, 80));
    assert_eq!(run(&s, false, &own), (TcAction::Pass, own.clone()));
    assert_eq!(s.stats().expect("stats").forward_entries, 0);
}

#[test]
fn ports_run_out_per_destination_and_expire() {
    // Two ports: two flows to one backend, the third is refused; another backend
    // still gets ports.
    let s = snat(61000..=61001);
    let mut s = s;
    let mut ports = Vec::new();
    for laptop_port in [40000, 40001] {
        let (a, got) = run(
            &s,
            false,
            &frame(UDP, LAPTOP, BACKEND, ports_l4(UDP, laptop_port, 53)),
        );
        assert_eq!(a, TcAction::Pass);
        ports.push(check(&got).sport);
    }
    ports.sort_unstable();
    assert_eq!(
        ports,
        vec![61000, 61001],
        "distinct ports for one destination"
    );
    let (a, _) = run(
        &s,
        false,
        &frame(UDP, LAPTOP, BACKEND, ports_l4(UDP, 40002, 53)),
    );
    assert_eq!(a, TcAction::Drop, "no third port for one destination");
    let (a, _) = run(
        &s,
        false,
        &frame(UDP, LAPTOP, OTHER_BACKEND, ports_l4(UDP, 40002, 53)),
    );
    assert_eq!(a, TcAction::Pass, "another destination has its own ports");
    let stats = s.stats().expect("stats");
    assert_eq!(stats.ports_exhausted.packets, 1);
    assert_eq!(stats.forward_entries, 3);

    let timeouts = SnatTimeouts {
        tcp: Duration::from_secs(3600),
        idle: Duration::from_secs(30),
    };
    let now = monotonic_ns();
    assert_eq!(
        s.sweep(now, timeouts).expect("sweep").expired,
        0,
        "not idle yet"
    );
    let later = now + Duration::from_secs(31).as_nanos() as u64;
    assert_eq!(s.sweep(later, timeouts).expect("sweep").expired, 3);
    let stats = s.stats().expect("stats");
    assert_eq!((stats.forward_entries, stats.reverse_entries), (0, 0));
    // The freed ports serve new flows.
    let (a, _) = run(
        &s,
        false,
        &frame(UDP, LAPTOP, BACKEND, ports_l4(UDP, 40002, 53)),
    );
    assert_eq!(a, TcAction::Pass);
}

/// An ICMP error `from -> POD` (type `icmp_type`, code `code`, 4 bytes `rest`) quoting
/// the IP packet of `quoted` (an Ethernet frame the egress program emitted), cut to its
/// IP header plus `quote_l4` bytes of L4 header (RFC 792 guarantees 8; Linux quotes
/// up to 576 bytes).
fn icmp_error(
    from: Ipv4Addr,
    icmp_type: u8,
    code: u8,
    rest: [u8; 4],
    quoted: &[u8],
    quote_l4: usize,
) -> Vec<u8> {
    let ip = &quoted[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let mut l4 = vec![icmp_type, code, 0, 0];
    l4.extend_from_slice(&rest);
    l4.extend_from_slice(&ip[..(ihl + quote_l4).min(ip.len())]);
    frame(ICMP, from, POD, l4)
}

/// What a rewritten ICMP error says, after checking the outer IP checksum, the ICMP
/// checksum over the whole message, the quoted IP header's checksum and — if the
/// quote holds all of it — the quoted L4 checksum (over the quoted datagram's
/// pseudo-header; the quote must hold the whole datagram for that).
struct SeenError {
    outer_src: Ipv4Addr,
    outer_dst: Ipv4Addr,
    icmp_type: u8,
    code: u8,
    rest: [u8; 4],
    inner_src: Ipv4Addr,
    inner_dst: Ipv4Addr,
    inner_sport: u16,
    inner_dport: u16,
    /// The quoted L4 checksum field, if quoted.
    inner_l4_csum: Option<u16>,
}

fn check_error(f: &[u8]) -> SeenError {
    let ip = &f[14..34];
    assert_eq!(fold(sum(ip, 0)), 0, "outer IPv4 header checksum");
    assert_eq!(ip[9], ICMP);
    let icmp = &f[34..];
    assert_eq!(
        fold(sum(icmp, 0)),
        0,
        "ICMP checksum over the whole message"
    );
    let inner = &icmp[8..];
    assert_eq!(fold(sum(&inner[..20], 0)), 0, "quoted IPv4 header checksum");
    let l4 = &inner[20..];
    let proto = inner[9];
    let word = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    let csum_at = match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    };
    let (sport, dport) = if proto == ICMP {
        (word(4), 0)
    } else {
        (word(0), word(2))
    };
    let addr = |b: &[u8]| Ipv4Addr::new(b[0], b[1], b[2], b[3]);
    SeenError {
        outer_src: addr(&ip[12..16]),
        outer_dst: addr(&ip[16..20]),
        icmp_type: icmp[0],
        code: icmp[1],
        rest: [icmp[4], icmp[5], icmp[6], icmp[7]],
        inner_src: addr(&inner[12..16]),
        inner_dst: addr(&inner[16..20]),
        inner_sport: sport,
        inner_dport: dport,
        inner_l4_csum: (l4.len() >= csum_at + 2).then(|| word(csum_at)),
    }
}

/// The checksum the laptop's own packet `f` (as it left the laptop) carries in its
/// L4 header, to compare with a fully quoted, translated-back one.
fn l4_csum_of(f: &[u8]) -> u16 {
    let l4 = &f[34..];
    let at = match f[14 + 9] {
        TCP => 16,
        UDP => 6,
        _ => 2,
    };
    u16::from_be_bytes([l4[at], l4[at + 1]])
}

/// (name, the laptop's packet, ICMP sender, type, code, the 4 type-specific bytes,
/// quoted L4 bytes).
type ErrorCase<'a> = (&'a str, &'a [u8], Ipv4Addr, u8, u8, [u8; 4], usize);

/// [preserve] issue 9, ebpf-snat: ICMP errors about a translated flow — port
/// unreachable, administratively prohibited, fragmentation needed (with its next-hop
/// MTU), time exceeded from a router on the way — come back addressed to the laptop,
/// quoting the laptop's own packet (tunnel IP and original port/identifier) with
/// every checksum valid; errors about the pod's own flows are left alone.
#[test]
fn icmp_errors_about_translated_flows_go_back_to_the_laptop() {
    let s = snat(61000..=65535);
    let router = Ipv4Addr::new(10, 244, 0, 1);
    let udp_out = frame(UDP, LAPTOP, BACKEND, ports_l4(UDP, 40000, 53));
    let tcp_out = frame(TCP, LAPTOP, BACKEND, ports_l4(TCP, 40001, 80));
    let echo_out = frame(ICMP, LAPTOP, BACKEND, echo(8, 0x1234));
    let mut udp_no_csum = ports_l4(UDP, 40002, 9);
    udp_no_csum[6..8].copy_from_slice(&[0, 0]);
    let mut udp_no_csum_out = frame(UDP, LAPTOP, BACKEND, udp_no_csum);
    // `frame` filled a checksum in; a zero one means "none" (RFC 768).
    udp_no_csum_out[34 + 6..34 + 8].copy_from_slice(&[0, 0]);
    let cases: [ErrorCase; 7] = [
        ("UDP port unreachable", &udp_out, BACKEND, 3, 3, [0; 4], 64),
        (
            "UDP admin-prohibited, 8-byte quote",
            &udp_out,
            BACKEND,
            3,
            13,
            [0; 4],
            8,
        ),
        (
            "UDP without checksum, port unreachable",
            &udp_no_csum_out,
            BACKEND,
            3,
            3,
            [0; 4],
            64,
        ),
        (
            "TCP frag needed, MTU 1400, full quote",
            &tcp_out,
            router,
            3,
            4,
            [0, 0, 0x05, 0x78],
            64,
        ),
        (
            "TCP host unreachable, 8-byte quote (no checksum quoted)",
            &tcp_out,
            BACKEND,
            3,
            1,
            [0; 4],
            8,
        ),
        ("TCP time exceeded", &tcp_out, router, 11, 0, [0; 4], 64),
        (
            "ICMP echo admin-prohibited",
            &echo_out,
            BACKEND,
            3,
            13,
            [0; 4],
            64,
        ),
    ];
    for (name, out, from, icmp_type, code, rest, quote) in cases {
        let (action, translated) = run(&s, false, out);
        assert_eq!(action, TcAction::Pass, "{name}: the flow is translated");
        let t = check(&translated);
        assert_eq!(t.src, POD);
        let err = icmp_error(from, icmp_type, code, rest, &translated, quote);
        let (action, back) = run(&s, true, &err);
        assert_eq!(action, TcAction::Pass, "{name}");
        assert_ne!(back, err, "{name}: rewritten");
        let e = check_error(&back);
        let laptop = check(out);
        assert_eq!(
            (e.outer_src, e.outer_dst, e.icmp_type, e.code, e.rest),
            (from, LAPTOP, icmp_type, code, rest),
            "{name}: outer header to the laptop, type/code/MTU unchanged"
        );
        assert_eq!(
            (e.inner_src, e.inner_dst, e.inner_sport, e.inner_dport),
            (LAPTOP, BACKEND, laptop.sport, laptop.dport),
            "{name}: the quote is the laptop's own packet"
        );
        let proto = out[14 + 9];
        let quoted_csum = if proto == TCP {
            16
        } else if proto == UDP {
            6
        } else {
            2
        };
        if quote >= quoted_csum + 2 {
            // The quote holds the checksum: it is the laptop's original one (the
            // translation is undone exactly, a zero UDP checksum stays zero).
            assert_eq!(e.inner_l4_csum, Some(l4_csum_of(out)), "{name}");
        } else {
            assert_eq!(e.inner_l4_csum, None, "{name}: not quoted");
        }
        // The quoted IP header is the laptop's own, byte for byte (TTL included).
        assert_eq!(
            &back[34 + 8..34 + 8 + 20],
            &out[14..34],
            "{name}: quoted IPv4 header"
        );
    }
    assert_eq!(
        s.stats().expect("stats").icmp_errors_in.packets,
        7,
        "every translated error is counted"
    );

    // An error about the pod's own flow (its own port, no table entry) and one
    // quoting another source pass untouched.
    let own = frame(UDP, POD, BACKEND, ports_l4(UDP, 45000, 53));
    let err = icmp_error(BACKEND, 3, 3, [0; 4], &own, 64);
    assert_eq!(run(&s, true, &err), (TcAction::Pass, err.clone()));
    let other = frame(UDP, OTHER_BACKEND, BACKEND, ports_l4(UDP, 40000, 53));
    let err = icmp_error(BACKEND, 3, 3, [0; 4], &other, 64);
    assert_eq!(run(&s, true, &err), (TcAction::Pass, err.clone()));
    // A quote cut inside the IP header cannot be matched: untouched, not dropped.
    let (_, translated) = run(&s, false, &udp_out);
    let mut short = icmp_error(BACKEND, 3, 3, [0; 4], &translated, 0);
    short.truncate(14 + 20 + 8 + 12);
    let short = frame(ICMP, BACKEND, POD, short[34..].to_vec());
    assert_eq!(run(&s, true, &short), (TcAction::Pass, short.clone()));
    assert_eq!(s.stats().expect("stats").icmp_errors_in.packets, 7);
}

/// `f` made a fragment: IP identification `id`, "more fragments" `more`, offset
/// `offset_8` (in 8-byte units), header checksum recomputed.
fn fragment(mut f: Vec<u8>, id: u16, more: bool, offset_8: u16) -> Vec<u8> {
    f[14 + 4..14 + 6].copy_from_slice(&id.to_be_bytes());
    let flags = if more { 0x2000 } else { 0 } | offset_8;
    f[14 + 6..14 + 8].copy_from_slice(&flags.to_be_bytes());
    f[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let c = fold(sum(&f[14..34], 0));
    f[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    f
}

/// A later fragment (no L4 header: `payload` follows the IP header).
fn later_fragment(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, id: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = frame(ICMP, src, dst, payload.to_vec());
    // `frame` wrote an ICMP checksum into the payload: put the payload back.
    f[34..].copy_from_slice(payload);
    f[14 + 9] = proto;
    fragment(f, id, false, 185)
}

/// [preserve] issue 9, ebpf-snat: a datagram larger than the path MTU passes in
/// fragments. Leaving, the first fragment is translated as any packet and later ones
/// from the pool get the pod IP as source; arriving, later fragments of a reply go to
/// the tunnel IP its first fragment was translated to. Fragments of other datagrams
/// are left alone; a pool fragment of another protocol is still dropped.
#[test]
fn fragments_of_translated_datagrams_follow_their_first_fragment() {
    let s = snat(61000..=65535);
    let payload: Vec<u8> = (0..64u8).collect();

    // Outbound: first fragment (MF, offset 0) with the UDP header, then the rest.
    let first = fragment(
        frame(UDP, LAPTOP, BACKEND, ports_l4(UDP, 40000, 7)),
        0x1111,
        true,
        0,
    );
    let (a, got) = run(&s, false, &first);
    assert_eq!(a, TcAction::Pass);
    let t = check(&got);
    assert_eq!(t.src, POD);
    let rest = later_fragment(LAPTOP, BACKEND, UDP, 0x1111, &payload);
    let (a, got) = run(&s, false, &rest);
    assert_eq!(a, TcAction::Pass, "a later fragment from the pool leaves");
    assert_eq!(fold(sum(&got[14..34], 0)), 0, "IPv4 header checksum");
    assert_eq!(
        &got[14 + 12..14 + 16],
        &POD.octets(),
        "source is the pod IP"
    );
    assert_eq!(&got[14 + 16..14 + 20], &BACKEND.octets());
    assert_eq!(
        &got[14 + 4..14 + 8],
        &rest[14 + 4..14 + 8],
        "id and offset kept"
    );
    assert_eq!(&got[34..], &payload[..], "payload untouched");
    let gre = later_fragment(LAPTOP, BACKEND, 47, 0x1112, &payload);
    assert_eq!(run(&s, false, &gre).0, TcAction::Drop, "other protocols");

    // Inbound: the reply's first fragment to the allocated port, then the rest.
    let reply_first = fragment(
        frame(UDP, BACKEND, POD, ports_l4(UDP, 7, t.sport)),
        0x2222,
        true,
        0,
    );
    let (a, back) = run(&s, true, &reply_first);
    assert_eq!(a, TcAction::Pass);
    let b = check(&back);
    assert_eq!((b.dst, b.dport), (LAPTOP, 40000));
    let reply_rest = later_fragment(BACKEND, POD, UDP, 0x2222, &payload);
    let (a, back) = run(&s, true, &reply_rest);
    assert_eq!(a, TcAction::Pass);
    assert_eq!(fold(sum(&back[14..34], 0)), 0, "IPv4 header checksum");
    assert_eq!(
        &back[14 + 16..14 + 20],
        &LAPTOP.octets(),
        "to the tunnel IP"
    );
    assert_eq!(&back[34..], &payload[..], "payload untouched");

    // A later fragment of another datagram (another id, or the pod's own) is the
    // pod's: untouched.
    let other = later_fragment(BACKEND, POD, UDP, 0x2223, &payload);
    assert_eq!(run(&s, true, &other), (TcAction::Pass, other.clone()));
    let not_pool = later_fragment(POD, BACKEND, UDP, 0x1111, &payload);
    assert_eq!(
        run(&s, false, &not_pool),
        (TcAction::Pass, not_pool.clone())
    );
    let stats = s.stats().expect("stats");
    assert_eq!(stats.translated_out.packets, 2);
    assert_eq!(stats.translated_in.packets, 2);
    assert_eq!(stats.untranslatable.packets, 1);
}
