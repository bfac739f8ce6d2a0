//! Hand-made IP packets for the eBPF tests (dataplane/tests/ebpf_classifier.rs,
//! ebpf_tun_netns.rs, tests/tests/ebpf_antispoof.rs), the rogue client
//! (tests/tests/rogue_client.rs), the pump's offload tests (dataplane/src/pump.rs,
//! dataplane/tests/pump_alloc.rs) and the bench's SYN flood: header layouts the
//! classifier must parse, built byte by byte so a test controls every field
//! (RFC 791, RFC 8200, RFC 768, RFC 9293, checksums per RFC 1071), and draining
//! a non-blocking reader for a while. Pure apart from [`drain_for`].

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4};
use std::time::{Duration, Instant};

/// `IPPROTO_ICMP`.
pub const PROTO_ICMP: u8 = 1;
/// `IPPROTO_TCP`.
pub const PROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
pub const PROTO_UDP: u8 = 17;

/// RFC 1071 Internet checksum over `parts`, concatenated.
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let bytes: Vec<u8> = parts.concat();
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // The loop folded `sum` into 16 bits.
    !(sum as u16)
}

/// An IPv4 packet `src -> dst` of protocol `proto` around `l4`: 20-byte header,
/// TTL 64, valid header checksum.
pub fn ipv4(proto: u8, src: Ipv4Addr, dst: Ipv4Addr, l4: &[u8]) -> Vec<u8> {
    let total = 20 + l4.len();
    let mut p = vec![0u8; 20];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = proto;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let sum = checksum(&[&p]);
    p[10..12].copy_from_slice(&sum.to_be_bytes());
    p.extend_from_slice(l4);
    p
}

/// An IPv6 packet `src -> dst` with next header `next` around `l4`: 40-byte
/// header, hop limit 64, no extension headers.
pub fn ipv6(next: u8, src: Ipv6Addr, dst: Ipv6Addr, l4: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 40];
    p[0] = 0x60;
    p[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
    p[6] = next;
    p[7] = 64;
    p[8..24].copy_from_slice(&src.octets());
    p[24..40].copy_from_slice(&dst.octets());
    p.extend_from_slice(l4);
    p
}

/// A UDP datagram `src:src_port -> dst:dst_port` carrying `payload`, as a bare IP
/// packet (IPv4 or IPv6 by the addresses) with valid IP and UDP checksums, so
/// the kernel delivers it to a socket. Panics on mixed address families.
pub fn udp_packet(
    src: IpAddr,
    dst: IpAddr,
    src_port: u16,
    dst_port: u16,
    payload: &[u8],
) -> Vec<u8> {
    let udp_len = 8 + payload.len();
    let mut udp = vec![0u8; 8];
    udp[0..2].copy_from_slice(&src_port.to_be_bytes());
    udp[2..4].copy_from_slice(&dst_port.to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    udp.extend_from_slice(payload);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let pseudo = [
                &s.octets()[..],
                &d.octets()[..],
                &[0, PROTO_UDP],
                &(udp_len as u16).to_be_bytes(),
            ]
            .concat();
            let sum = checksum(&[&pseudo, &udp]);
            udp[6..8].copy_from_slice(&sum.to_be_bytes());
            ipv4(PROTO_UDP, s, d, &udp)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let pseudo = [
                &s.octets()[..],
                &d.octets()[..],
                &(udp_len as u32).to_be_bytes(),
                &[0, 0, 0, PROTO_UDP],
            ]
            .concat();
            let sum = checksum(&[&pseudo, &udp]);
            udp[6..8].copy_from_slice(&sum.to_be_bytes());
            ipv6(PROTO_UDP, s, d, &udp)
        }
        _ => panic!("mixed address families {src} -> {dst}"),
    }
}

/// A TCP SYN `src -> dst` as a bare IPv4 packet: sequence number 0x1000,
/// window 64240, options MSS 1360 and window scale 7 (RFC 7323), valid IP and
/// TCP checksums, so a kernel or the manager takes it as a connection attempt.
pub fn tcp_syn(src: SocketAddrV4, dst: SocketAddrV4) -> Vec<u8> {
    const LEN: usize = 28; // 20-byte header + 8 bytes of options
    let mut tcp = vec![0u8; LEN];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&0x1000u32.to_be_bytes());
    tcp[12] = ((LEN / 4) as u8) << 4; // data offset in 32-bit words
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&64240u16.to_be_bytes());
    // MSS (kind 2, length 4), NOP, window scale (kind 3, length 3).
    tcp[20..24].copy_from_slice(&[2, 4, 0, 0]);
    tcp[22..24].copy_from_slice(&1360u16.to_be_bytes());
    tcp[24..28].copy_from_slice(&[1, 3, 3, 7]);
    let pseudo = [
        &src.ip().octets()[..],
        &dst.ip().octets()[..],
        &[0, PROTO_TCP],
        &(LEN as u16).to_be_bytes(),
    ]
    .concat();
    let sum = checksum(&[&pseudo, &tcp]);
    tcp[16..18].copy_from_slice(&sum.to_be_bytes());
    ipv4(PROTO_TCP, *src.ip(), *dst.ip(), &tcp)
}

/// An IPv4 TCP segment `src -> dst` (sequence number 5000, window 512, no
/// options) carrying `payload` with TCP `flags`, its checksum partial: the
/// pseudo-header sum only, as the kernel hands a segment to a TUN device with
/// `TUN_F_CSUM` / `TUN_F_TSO4` (a super-packet when `payload` is longer than
/// one MSS). Valid IPv4 header checksum.
pub fn tcp_partial_checksum(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    payload: &[u8],
    flags: u8,
) -> Vec<u8> {
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&5000u32.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = flags;
    tcp[14..16].copy_from_slice(&512u16.to_be_bytes());
    tcp.extend_from_slice(payload);
    let len = (tcp.len() as u16).to_be_bytes();
    let pseudo = [
        &src.ip().octets()[..],
        &dst.ip().octets()[..],
        &[0, PROTO_TCP],
        &len,
    ]
    .concat();
    let partial = !checksum(&[&pseudo]);
    tcp[16..18].copy_from_slice(&partial.to_be_bytes());
    ipv4(PROTO_TCP, *src.ip(), *dst.ip(), &tcp)
}

/// Everything `read` returns within `wait`, one entry per successful read. `read`
/// is a non-blocking read (or one with a read timeout): `WouldBlock` and
/// `TimedOut` mean "nothing yet"; any other error fails the test.
pub fn drain_for(
    wait: Duration,
    mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 65536];
    while Instant::now() < deadline {
        match read(&mut buf) {
            Ok(n) => got.push(buf[..n].to_vec()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
            Err(e) => panic!("read: {e}"),
        }
    }
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A known IPv4 header (RFC 1071 example style): the checksum over a header
    /// with its checksum field filled in is zero, and so is the UDP one over the
    /// pseudo header.
    #[test]
    fn checksums_verify_to_zero() {
        let p = udp_packet(
            "10.244.1.5".parse().expect("ip"),
            "100.96.0.2".parse().expect("ip"),
            53,
            4000,
            b"abc",
        );
        assert_eq!(p.len(), 20 + 8 + 3);
        assert_eq!(checksum(&[&p[..20]]), 0, "IPv4 header checksum");
        let pseudo = [&p[12..20], &[0, PROTO_UDP], &p[24..26]].concat();
        assert_eq!(checksum(&[&pseudo, &p[20..]]), 0, "UDP checksum");

        let p6 = udp_packet(
            "fd00::5".parse().expect("ip"),
            "fd00::2".parse().expect("ip"),
            53,
            4000,
            b"abcd",
        );
        assert_eq!(p6.len(), 40 + 8 + 4);
        assert_eq!(p6[6], PROTO_UDP);
        let len = (p6.len() as u32 - 40).to_be_bytes();
        let pseudo = [&p6[8..40], &len, &[0, 0, 0, PROTO_UDP]].concat();
        assert_eq!(checksum(&[&pseudo, &p6[40..]]), 0, "UDP/IPv6 checksum");
    }
}
