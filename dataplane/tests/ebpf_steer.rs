//! Steering (`--steer ebpf`, case rt-05) run by the kernel on crafted Ethernet frames
//! (BPF_PROG_TEST_RUN): `kvpn_steer` rewrites a cluster-bound packet's source to the
//! tunnel IP with valid IP and L4 checksums (checked by smoltcp's parser) and asks for
//! a redirect, remembers the flow, and the TUN ingress program rewrites the reply's
//! destination back; everything else passes untouched and is counted honestly.
//! Needs root (CAP_BPF + CAP_NET_ADMIN); each test loads its own programs and maps.

use std::net::Ipv4Addr;

use kvpn_dataplane::ebpf::{Classifier, RouteKind, TcAction};
use smoltcp::wire::{
    Icmpv4Message, Icmpv4Packet, IpAddress, IpProtocol, Ipv4Packet, TcpPacket, UdpPacket,
};

const TUNNEL_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);
/// The laptop's address on the other VPN's device: the source the kernel picked.
const OTHER_VPN_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 5);
const OUTSIDE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// BPF_PROG_TEST_RUN runs TC programs on the loopback device.
const LOOPBACK_IFINDEX: u32 = 1;
const TUN_IFINDEX: u32 = 4242;

fn steering(device_listed: bool) -> Classifier {
    let mut c = Classifier::load_for_test().unwrap_or_else(|e| {
        panic!("loading the eBPF object failed (run as root; built without AYA_BUILD_SKIP?): {e:?}")
    });
    c.insert_route("10.244.0.0/16".parse().expect("cidr"), RouteKind::Pod)
        .expect("insert route");
    c.configure_steer(TUNNEL_IP, TUN_IFINDEX)
        .expect("configure");
    if device_listed {
        c.add_steer_device(LOOPBACK_IFINDEX, 14).expect("device");
    }
    c
}

/// Ethernet + IPv4 + TCP SYN, UDP datagram or ICMP echo (for ICMP `sport` is the
/// identifier and `dport` the message type, 8 request / 0 reply) with valid checksums.
fn frame(proto: IpProtocol, src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
    let mut l4 = vec![0u8; if proto == IpProtocol::Tcp { 20 } else { 8 + 4 }];
    match proto {
        IpProtocol::Tcp => {
            let mut p = TcpPacket::new_unchecked(&mut l4[..]);
            p.set_src_port(sport);
            p.set_dst_port(dport);
            p.set_header_len(20);
            p.set_seq_number(smoltcp::wire::TcpSeqNumber(1000));
            p.set_syn(true);
            p.set_window_len(64240);
            p.fill_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst));
        }
        IpProtocol::Udp => {
            let mut p = UdpPacket::new_unchecked(&mut l4[..]);
            p.set_src_port(sport);
            p.set_dst_port(dport);
            p.set_len(12);
            p.payload_mut().copy_from_slice(b"ping");
            p.fill_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst));
        }
        _ => {
            let mut p = Icmpv4Packet::new_unchecked(&mut l4[..]);
            p.set_msg_type(if dport == 8 {
                Icmpv4Message::EchoRequest
            } else {
                Icmpv4Message::EchoReply
            });
            p.set_msg_code(0);
            p.set_echo_ident(sport);
            p.set_echo_seq_no(1);
            p.fill_checksum();
        }
    }
    let mut f = vec![0u8; 14 + 20 + l4.len()];
    f[12..14].copy_from_slice(&[0x08, 0x00]);
    let mut ip = Ipv4Packet::new_unchecked(&mut f[14..]);
    ip.set_version(4);
    ip.set_header_len(20);
    ip.set_total_len((20 + l4.len()) as u16);
    ip.set_hop_limit(64);
    ip.set_next_header(proto);
    ip.set_src_addr(src);
    ip.set_dst_addr(dst);
    ip.payload_mut().copy_from_slice(&l4);
    ip.fill_checksum();
    f
}

/// Source, destination and whether both checksums verify.
fn check(f: &[u8]) -> (Ipv4Addr, Ipv4Addr, bool) {
    assert_eq!(f.get(12..14), Some(&[0x08, 0x00][..]), "IPv4 ethertype");
    let ip = Ipv4Packet::new_checked(&f[14..]).expect("ipv4");
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    let (s, d) = (IpAddress::Ipv4(src), IpAddress::Ipv4(dst));
    let l4_ok = match ip.next_header() {
        IpProtocol::Tcp => TcpPacket::new_checked(ip.payload())
            .expect("tcp")
            .verify_checksum(&s, &d),
        IpProtocol::Udp => UdpPacket::new_checked(ip.payload())
            .expect("udp")
            .verify_checksum(&s, &d),
        IpProtocol::Icmp => Icmpv4Packet::new_checked(ip.payload())
            .expect("icmp")
            .verify_checksum(),
        _ => true,
    };
    (src, dst, ip.verify_checksum() && l4_ok)
}

#[test]
fn tcp_udp_and_echo_are_steered_and_their_replies_translated_back() {
    let mut c = steering(true);
    let cases = [
        (IpProtocol::Tcp, 6u8, 40000u16, 80u16, 80u16, 40000u16),
        (IpProtocol::Udp, 17, 40001, 53, 53, 40001),
        // ICMP: `frame`'s ports are (identifier, type): request 8 out, reply 0 back.
        (IpProtocol::Icmp, 1, 7, 8, 7, 0),
    ];
    for (proto, number, sport, dport, rport, lport) in cases {
        let out_frame = frame(proto, OTHER_VPN_IP, POD, sport, dport);
        let (action, out) = c.test_run_steer(&out_frame).expect("steer run");
        assert_eq!(action, TcAction::Redirect, "{proto}");
        assert_eq!(out.len(), out_frame.len(), "{proto}");
        assert_eq!(
            check(&out),
            (TUNNEL_IP, POD, true),
            "{proto}: rewritten source"
        );
        let key_remote_port = if proto == IpProtocol::Icmp { 0 } else { dport };
        assert_eq!(
            c.steer_conntrack(number, POD, key_remote_port, sport)
                .expect("lookup"),
            Some(OTHER_VPN_IP),
            "{proto}: conntrack entry"
        );

        let reply = frame(proto, POD, TUNNEL_IP, rport, lport);
        let (action, back) = c.test_run_ingress_out(&reply).expect("ingress run");
        assert_eq!(action, TcAction::Pass, "{proto}");
        assert_eq!(
            check(&back),
            (POD, OTHER_VPN_IP, true),
            "{proto}: reply translated back"
        );
    }
    let stats = c.steer_stats().expect("stats");
    assert_eq!(stats.steered.packets, 3);
    assert_eq!(stats.reversed.packets, 3);
    assert_eq!(stats.no_conntrack.packets, 0);
    assert_eq!(stats.failed.packets, 0);
    // The same counters reach `kvpn status` through Stats.
    assert_eq!(c.stats().expect("stats").steer, stats);
}

#[test]
fn other_traffic_passes_untouched() {
    let mut c = steering(true);
    // Not to a cluster range.
    let f = frame(IpProtocol::Tcp, OTHER_VPN_IP, OUTSIDE, 40000, 443);
    assert_eq!(
        c.test_run_steer(&f).expect("run"),
        (TcAction::Pass, f.clone())
    );
    // Already from the tunnel IP: redirected as it is.
    let f = frame(IpProtocol::Udp, TUNNEL_IP, POD, 40000, 53);
    assert_eq!(
        c.test_run_steer(&f).expect("run"),
        (TcAction::Redirect, f.clone())
    );
    // A reply to the tunnel IP of a flow that was never steered: untouched.
    let f = frame(IpProtocol::Tcp, POD, TUNNEL_IP, 80, 41000);
    assert_eq!(
        c.test_run_ingress_out(&f).expect("run"),
        (TcAction::Pass, f.clone())
    );
    // An echo reply sent to the cluster (not a request): cannot be tracked.
    let f = frame(IpProtocol::Icmp, OTHER_VPN_IP, POD, 9, 0);
    assert_eq!(
        c.test_run_steer(&f).expect("run"),
        (TcAction::Pass, f.clone())
    );
    // Another protocol (GRE) to the cluster: cannot be tracked either.
    let mut f = frame(IpProtocol::Udp, OTHER_VPN_IP, POD, 1, 2);
    {
        let mut ip = Ipv4Packet::new_unchecked(&mut f[14..]);
        ip.set_next_header(IpProtocol::Unknown(47));
        ip.fill_checksum();
    }
    assert_eq!(
        c.test_run_steer(&f).expect("run"),
        (TcAction::Pass, f.clone())
    );

    let stats = c.steer_stats().expect("stats");
    assert_eq!(stats.steered.packets, 1, "only the tunnel-IP packet");
    assert_eq!(stats.no_conntrack.packets, 2, "echo reply and GRE");
    assert_eq!(stats.reversed.packets, 0);
}

#[test]
fn a_device_steering_was_not_attached_to_is_left_alone() {
    let mut c = steering(false);
    let f = frame(IpProtocol::Tcp, OTHER_VPN_IP, POD, 40000, 80);
    assert_eq!(
        c.test_run_steer(&f).expect("run"),
        (TcAction::Pass, f.clone())
    );
    assert_eq!(c.steer_stats().expect("stats").steered.packets, 0);
}
