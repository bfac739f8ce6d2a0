//! Failing fast while a session is reconnecting (case tr-10): the ICMP / ICMPv6
//! destination-unreachable message that answers a packet read from the TUN
//! device, and the rate limit on sending them. Pure: no I/O, no clock (inputs
//! carry `now`); the pump ([`crate::pump::refuse`]) writes the messages back to
//! the TUN device.
//!
//! Why ICMP and not a TCP RST: a RST says "the peer refused the connection"
//! (`ECONNREFUSED`), which is a lie about the service; ICMP host unreachable
//! says the path is down, which is the truth, works for UDP and ping too, and
//! is what a router that lost its next hop sends (RFC 1812 §5.2.7.1). Linux
//! aborts a connect in SYN-SENT on any ICMP unreachable (`tcp_v4_err`,
//! `tcp_v6_err`), so `connect()` fails at once with `EHOSTUNREACH` ("No route to
//! host"); established connections take it as a soft error and keep
//! retransmitting, so they survive a short outage.
//!
//! - IPv4: type 3 code 1 (host unreachable), quoting as much of the original
//!   datagram as fits in 576 bytes (RFC 1812 §4.3.2.3; RFC 792 requires at
//!   least the header plus 64 bits).
//! - IPv6: type 1 code 3 (address unreachable, mapped to `EHOSTUNREACH` by
//!   `icmpv6_err_convert`), quoting as much as fits in the IPv6 minimum MTU of
//!   1280 bytes (RFC 4443 §2.4 (c), §3.1).
//!
//! The message's source is the unreachable destination itself, not a router
//! address: the laptop has no address on the far side of the tunnel, and a
//! packet arriving on the TUN device with the laptop's own tunnel IP as source
//! would be dropped as a martian by the kernel's source validation
//! (`fib_validate_source` with rp_filter) and by the eBPF ingress check. The
//! destination is inside a route through the TUN device by construction, so the
//! message passes both. The kernel matches the error to the socket from the
//! quoted header only.
//!
//! Never answered (RFC 1122 §3.2.2, RFC 1812 §4.3.2.7, RFC 4443 §2.4 (e),
//! mirroring `icmp_send` / `icmp6_send`): ICMP errors and unknown ICMP types,
//! ICMPv6 errors and redirects, non-initial fragments, packets from an
//! unspecified, loopback, broadcast or multicast source, packets to a broadcast
//! or multicast destination, and anything malformed.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use smoltcp::wire::{
    Icmpv4Message, Icmpv4Packet, Icmpv6Message, Icmpv6Packet, IpProtocol, Ipv4Packet, Ipv4Repr,
    Ipv6Packet, Ipv6Repr,
};

/// ICMP (v4) destination-unreachable code "host unreachable" (RFC 792).
pub const ICMP_HOST_UNREACHABLE: u8 = 1;

/// ICMPv6 destination-unreachable code "address unreachable" (RFC 4443 §3.1).
pub const ICMPV6_ADDRESS_UNREACHABLE: u8 = 3;

/// Largest IPv4 ICMP error datagram, bytes (RFC 1812 §4.3.2.3).
pub const MAX_V4_ERROR: usize = 576;

/// Largest ICMPv6 error packet, bytes: the IPv6 minimum MTU (RFC 4443 §2.4 (c)).
pub const MAX_V6_ERROR: usize = 1280;

/// Hop limit of the generated messages (the kernel's default TTL).
const HOP_LIMIT: u8 = 64;

/// Sustained rate of unreachable messages per session, messages per second:
/// Linux's global ICMP limit (`net.ipv4.icmp_msgs_per_sec`, default 1000).
pub const UNREACHABLE_PER_SEC: u32 = 1000;

/// Burst of unreachable messages per session (`net.ipv4.icmp_msgs_burst`,
/// default 50).
pub const UNREACHABLE_BURST: u32 = 50;

/// Why a packet gets no unreachable message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Ineligible {
    /// Not a well-formed IPv4/IPv6 packet.
    #[error("malformed packet")]
    Malformed,
    /// Source or destination is not a single host.
    #[error("source or destination is not a unicast host")]
    NotUnicast,
    /// A non-initial fragment (no transport header to quote).
    #[error("non-initial fragment")]
    Fragment,
    /// An ICMP error, redirect or unknown ICMP type.
    #[error("ICMP error or unknown ICMP type")]
    IcmpError,
}

/// Build the destination-unreachable message for `packet` (one IPv4 or IPv6
/// packet as read from the TUN device) into `out`, replacing its contents.
/// Never panics, whatever `packet` holds.
pub fn build(packet: &[u8], out: &mut Vec<u8>) -> Result<(), Ineligible> {
    match packet.first().map(|b| b >> 4) {
        Some(4) => build_v4(packet, out),
        Some(6) => build_v6(packet, out),
        _ => Err(Ineligible::Malformed),
    }
}

fn v4_host(a: Ipv4Addr) -> bool {
    !(a.is_unspecified() || a.is_loopback() || a.is_broadcast() || a.is_multicast())
}

/// ICMP types that are queries or replies (RFC 792, RFC 950), i.e. may be
/// answered with an error; everything else is an error or unknown.
fn icmpv4_is_query(msg_type: u8) -> bool {
    matches!(msg_type, 0 | 8 | 13..=18)
}

fn build_v4(packet: &[u8], out: &mut Vec<u8>) -> Result<(), Ineligible> {
    let ip = Ipv4Packet::new_checked(packet).map_err(|_| Ineligible::Malformed)?;
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    if !v4_host(src) || !v4_host(dst) {
        return Err(Ineligible::NotUnicast);
    }
    if ip.frag_offset() != 0 {
        return Err(Ineligible::Fragment);
    }
    if ip.next_header() == IpProtocol::Icmp {
        let msg_type = *ip.payload().first().ok_or(Ineligible::Malformed)?;
        if !icmpv4_is_query(msg_type) {
            return Err(Ineligible::IcmpError);
        }
    }
    // new_checked guarantees total_len <= packet.len().
    let original = &packet[..usize::from(ip.total_len())];
    let quoted = &original[..original.len().min(MAX_V4_ERROR - 20 - 8)];
    let icmp_len = 8 + quoted.len();
    out.clear();
    out.resize(20 + icmp_len, 0);
    let repr = Ipv4Repr {
        src_addr: dst,
        dst_addr: src,
        next_header: IpProtocol::Icmp,
        payload_len: icmp_len,
        hop_limit: HOP_LIMIT,
    };
    let mut outer = Ipv4Packet::new_unchecked(&mut out[..]);
    repr.emit(&mut outer, &smoltcp::phy::ChecksumCapabilities::default());
    // An ICMP error may be fragmented on its way; DF stays clear like the
    // kernel's own (icmp_push_reply does not set it).
    outer.set_dont_frag(false);
    outer.fill_checksum();
    let mut icmp = Icmpv4Packet::new_unchecked(outer.payload_mut());
    icmp.set_msg_type(Icmpv4Message::DstUnreachable);
    icmp.set_msg_code(ICMP_HOST_UNREACHABLE);
    // Bytes 4..8 ("unused") are already zero; the quote follows them.
    icmp.data_mut().copy_from_slice(quoted);
    icmp.fill_checksum();
    Ok(())
}

fn v6_host(a: Ipv6Addr) -> bool {
    !(a.is_unspecified() || a.is_loopback() || a.is_multicast())
}

/// Walk the extension headers after the fixed IPv6 header. Returns the upper
/// layer protocol and its offset in `payload`, or `None` for a non-initial
/// fragment (no upper-layer header present).
fn upper_layer(
    mut next: IpProtocol,
    payload: &[u8],
) -> Result<Option<(IpProtocol, usize)>, Ineligible> {
    let mut off = 0usize;
    // A packet with more extension headers than this is treated as malformed
    // rather than walked further (nothing legitimate chains that many).
    for _ in 0..8 {
        let hdr = payload.get(off..off + 8).ok_or(Ineligible::Malformed)?;
        let len = match next {
            IpProtocol::HopByHop | IpProtocol::Ipv6Route | IpProtocol::Ipv6Opts => {
                (usize::from(hdr[1]) + 1) * 8
            }
            IpProtocol::Ipv6Frag => {
                let offset = u16::from_be_bytes([hdr[2], hdr[3]]) >> 3;
                if offset != 0 {
                    return Ok(None);
                }
                8
            }
            // Authentication header: length in 4-octet units, minus 2 (RFC 4302).
            IpProtocol::IpSecAh => (usize::from(hdr[1]) + 2) * 4,
            other => return Ok(Some((other, off))),
        };
        next = IpProtocol::from(hdr[0]);
        off += len;
    }
    Err(Ineligible::Malformed)
}

fn build_v6(packet: &[u8], out: &mut Vec<u8>) -> Result<(), Ineligible> {
    let ip = Ipv6Packet::new_checked(packet).map_err(|_| Ineligible::Malformed)?;
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    if !v6_host(src) || !v6_host(dst) {
        return Err(Ineligible::NotUnicast);
    }
    match upper_layer(ip.next_header(), ip.payload())? {
        None => return Err(Ineligible::Fragment),
        Some((IpProtocol::Icmpv6, off)) => {
            let msg_type = *ip.payload().get(off).ok_or(Ineligible::Malformed)?;
            // Errors have the high bit clear (RFC 4443 §2.1); redirects (137)
            // are never answered either (icmpv6 is_ineligible).
            if msg_type & 0x80 == 0 || msg_type == 137 {
                return Err(Ineligible::IcmpError);
            }
        }
        Some(_) => {}
    }
    // new_checked guarantees 40 + payload_len <= packet.len().
    let original = &packet[..ip.total_len()];
    let quoted = &original[..original.len().min(MAX_V6_ERROR - 40 - 8)];
    let icmp_len = 8 + quoted.len();
    out.clear();
    out.resize(40 + icmp_len, 0);
    let repr = Ipv6Repr {
        src_addr: dst,
        dst_addr: src,
        next_header: IpProtocol::Icmpv6,
        payload_len: icmp_len,
        hop_limit: HOP_LIMIT,
    };
    let mut outer = Ipv6Packet::new_unchecked(&mut out[..]);
    repr.emit(&mut outer);
    let mut icmp = Icmpv6Packet::new_unchecked(outer.payload_mut());
    icmp.set_msg_type(Icmpv6Message::DstUnreachable);
    icmp.set_msg_code(ICMPV6_ADDRESS_UNREACHABLE);
    icmp.payload_mut().copy_from_slice(quoted);
    icmp.fill_checksum(&dst, &src);
    Ok(())
}

/// A token bucket: `per_sec` messages per second sustained, `burst` at once.
#[derive(Debug, Clone)]
pub struct RateLimit {
    cost: Duration,
    cap: Duration,
    credit: Duration,
    last: Option<Instant>,
}

impl RateLimit {
    /// A full bucket. `per_sec` is clamped to at least 1.
    pub fn new(per_sec: u32, burst: u32) -> Self {
        let cost = Duration::from_secs(1) / per_sec.max(1);
        let cap = cost * burst.max(1);
        Self {
            cost,
            cap,
            credit: cap,
            last: None,
        }
    }

    /// Whether one more message may go out at `now` (and take its token).
    pub fn allow(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            self.credit = (self.credit + now.saturating_duration_since(last)).min(self.cap);
        }
        self.last = Some(now);
        if self.credit >= self.cost {
            self.credit -= self.cost;
            true
        } else {
            false
        }
    }
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new(UNREACHABLE_PER_SEC, UNREACHABLE_BURST)
    }
}

#[cfg(test)]
mod tests {
    use smoltcp::phy::ChecksumCapabilities;
    use smoltcp::wire::{
        Icmpv4Repr, Icmpv6Repr, IpAddress, TcpControl, TcpPacket, TcpRepr, TcpSeqNumber, UdpPacket,
        UdpRepr,
    };

    use super::*;

    const LAPTOP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);
    const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 100);
    const LAPTOP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 2);
    const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0x11);

    fn tcp_syn(src: IpAddress, dst: IpAddress) -> Vec<u8> {
        let tcp = TcpRepr {
            src_port: 40000,
            dst_port: 80,
            control: TcpControl::Syn,
            seq_number: TcpSeqNumber(12345),
            ack_number: None,
            window_len: 64240,
            window_scale: Some(7),
            max_seg_size: Some(8960),
            sack_permitted: true,
            sack_ranges: [None; 3],
            timestamp: None,
            payload: &[],
        };
        let mut seg = vec![0u8; tcp.buffer_len()];
        tcp.emit(
            &mut TcpPacket::new_unchecked(&mut seg[..]),
            &src,
            &dst,
            &ChecksumCapabilities::default(),
        );
        wrap(src, dst, IpProtocol::Tcp, &seg)
    }

    fn wrap(src: IpAddress, dst: IpAddress, proto: IpProtocol, payload: &[u8]) -> Vec<u8> {
        match (src, dst) {
            (IpAddress::Ipv4(s), IpAddress::Ipv4(d)) => {
                let repr = Ipv4Repr {
                    src_addr: s,
                    dst_addr: d,
                    next_header: proto,
                    payload_len: payload.len(),
                    hop_limit: 63,
                };
                let mut buf = vec![0u8; 20 + payload.len()];
                let mut p = Ipv4Packet::new_unchecked(&mut buf[..]);
                repr.emit(&mut p, &ChecksumCapabilities::default());
                p.set_ident(0x4242);
                p.fill_checksum();
                p.payload_mut().copy_from_slice(payload);
                buf
            }
            (IpAddress::Ipv6(s), IpAddress::Ipv6(d)) => {
                let repr = Ipv6Repr {
                    src_addr: s,
                    dst_addr: d,
                    next_header: proto,
                    payload_len: payload.len(),
                    hop_limit: 63,
                };
                let mut buf = vec![0u8; 40 + payload.len()];
                let mut p = Ipv6Packet::new_unchecked(&mut buf[..]);
                repr.emit(&mut p);
                p.payload_mut().copy_from_slice(payload);
                buf
            }
            _ => panic!("mixed families"),
        }
    }

    #[test]
    fn tcp_syn_gets_host_unreachable_from_the_destination_quoting_the_original() {
        let syn = tcp_syn(LAPTOP.into(), WEB.into());
        let mut out = Vec::new();
        build(&syn, &mut out).expect("a SYN is answered");

        let ip = Ipv4Packet::new_checked(&out[..]).expect("valid IPv4");
        assert!(ip.verify_checksum(), "IPv4 header checksum");
        assert_eq!(ip.src_addr(), WEB, "from the unreachable destination");
        assert_eq!(ip.dst_addr(), LAPTOP, "to the sender");
        assert_eq!(ip.next_header(), IpProtocol::Icmp);
        assert_eq!(usize::from(ip.total_len()), out.len());
        assert_eq!(ip.frag_offset(), 0);
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("valid ICMP");
        assert!(icmp.verify_checksum(), "ICMP checksum");
        assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
        assert_eq!(icmp.msg_code(), ICMP_HOST_UNREACHABLE);
        assert_eq!(&ip.payload()[4..8], &[0; 4], "unused field is zero");
        // The whole original datagram (it is short) is quoted byte for byte:
        // header with its own ID and checksum, then the TCP header with the ports.
        assert_eq!(icmp.data(), &syn[..], "RFC 1812 quote");
        // smoltcp parses it as the error the kernel will see.
        let repr = Icmpv4Repr::parse(&icmp, &ChecksumCapabilities::default()).expect("parses");
        match repr {
            Icmpv4Repr::DstUnreachable { header, .. } => {
                assert_eq!(header.src_addr, LAPTOP);
                assert_eq!(header.dst_addr, WEB);
                assert_eq!(header.next_header, IpProtocol::Tcp);
            }
            other => panic!("not a destination unreachable: {other:?}"),
        }
    }

    #[test]
    fn big_ipv4_packets_are_quoted_up_to_576_bytes() {
        let body = vec![0xab; 8000];
        let udp = UdpRepr {
            src_port: 5353,
            dst_port: 7,
        };
        let mut seg = vec![0u8; 8 + body.len()];
        udp.emit(
            &mut UdpPacket::new_unchecked(&mut seg[..]),
            &LAPTOP.into(),
            &WEB.into(),
            body.len(),
            |b| b.copy_from_slice(&body),
            &ChecksumCapabilities::default(),
        );
        let packet = wrap(LAPTOP.into(), WEB.into(), IpProtocol::Udp, &seg);
        let mut out = Vec::new();
        build(&packet, &mut out).expect("UDP is answered");
        assert_eq!(out.len(), MAX_V4_ERROR);
        let ip = Ipv4Packet::new_checked(&out[..]).expect("valid");
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("valid");
        assert!(icmp.verify_checksum());
        assert_eq!(icmp.data(), &packet[..MAX_V4_ERROR - 28]);
    }

    #[test]
    fn ipv6_gets_address_unreachable_with_a_valid_checksum_and_quote() {
        let syn = tcp_syn(LAPTOP6.into(), POD6.into());
        let mut out = Vec::new();
        build(&syn, &mut out).expect("answered");
        let ip = Ipv6Packet::new_checked(&out[..]).expect("valid IPv6");
        assert_eq!(ip.src_addr(), POD6);
        assert_eq!(ip.dst_addr(), LAPTOP6);
        assert_eq!(ip.next_header(), IpProtocol::Icmpv6);
        assert_eq!(ip.total_len(), out.len());
        let icmp = Icmpv6Packet::new_checked(ip.payload()).expect("valid ICMPv6");
        assert!(icmp.verify_checksum(&POD6, &LAPTOP6), "ICMPv6 checksum");
        assert_eq!(icmp.msg_type(), Icmpv6Message::DstUnreachable);
        assert_eq!(icmp.msg_code(), ICMPV6_ADDRESS_UNREACHABLE);
        assert_eq!(icmp.payload(), &syn[..]);
        let repr = Icmpv6Repr::parse(&POD6, &LAPTOP6, &icmp, &ChecksumCapabilities::default())
            .expect("parses");
        assert!(
            matches!(repr, Icmpv6Repr::DstUnreachable { .. }),
            "{repr:?}"
        );

        // Jumbo: quoted up to the minimum MTU.
        let big = wrap(LAPTOP6.into(), POD6.into(), IpProtocol::Udp, &[7; 9000]);
        build(&big, &mut out).expect("answered");
        assert_eq!(out.len(), MAX_V6_ERROR);
        let ip = Ipv6Packet::new_checked(&out[..]).expect("valid");
        let icmp = Icmpv6Packet::new_checked(ip.payload()).expect("valid");
        assert!(icmp.verify_checksum(&POD6, &LAPTOP6));
        assert_eq!(icmp.payload(), &big[..MAX_V6_ERROR - 48]);
    }

    #[test]
    fn echo_requests_are_answered_but_errors_never() {
        let mut out = Vec::new();
        let mut echo = vec![8, 0, 0, 0, 0, 1, 0, 1, 0xde, 0xad];
        let mut p = Icmpv4Packet::new_unchecked(&mut echo[..]);
        p.fill_checksum();
        let ping = wrap(LAPTOP.into(), WEB.into(), IpProtocol::Icmp, &echo);
        assert_eq!(build(&ping, &mut out), Ok(()));

        for error_type in [3u8, 4, 5, 11, 12, 42] {
            let msg = [error_type, 1, 0, 0, 0, 0, 0, 0];
            let packet = wrap(LAPTOP.into(), WEB.into(), IpProtocol::Icmp, &msg);
            assert_eq!(
                build(&packet, &mut out),
                Err(Ineligible::IcmpError),
                "ICMP type {error_type}"
            );
        }
        for (msg_type, verdict) in [
            (1u8, Err(Ineligible::IcmpError)),
            (137, Err(Ineligible::IcmpError)),
            (128, Ok(())),
        ] {
            let msg = [msg_type, 0, 0, 0, 0, 0, 0, 0];
            let packet = wrap(LAPTOP6.into(), POD6.into(), IpProtocol::Icmpv6, &msg);
            assert_eq!(build(&packet, &mut out), verdict, "ICMPv6 type {msg_type}");
        }
    }

    #[test]
    fn broadcast_multicast_fragments_and_garbage_are_not_answered() {
        let mut out = Vec::new();
        let cases = [
            tcp_syn(Ipv4Addr::UNSPECIFIED.into(), WEB.into()),
            tcp_syn(LAPTOP.into(), Ipv4Addr::BROADCAST.into()),
            tcp_syn(LAPTOP.into(), Ipv4Addr::new(224, 0, 0, 251).into()),
            tcp_syn(
                LAPTOP6.into(),
                Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2).into(),
            ),
            tcp_syn(Ipv6Addr::UNSPECIFIED.into(), POD6.into()),
        ];
        for packet in &cases {
            assert_eq!(build(packet, &mut out), Err(Ineligible::NotUnicast));
        }

        let mut frag = tcp_syn(LAPTOP.into(), WEB.into());
        let mut p = Ipv4Packet::new_unchecked(&mut frag[..]);
        p.set_frag_offset(1480);
        p.fill_checksum();
        assert_eq!(build(&frag, &mut out), Err(Ineligible::Fragment));

        // IPv6 fragment header with a non-zero offset, then UDP.
        let mut ext = vec![17u8, 0, 0, 0, 0, 0, 0, 1];
        ext[2..4].copy_from_slice(&(185u16 << 3).to_be_bytes());
        ext.extend_from_slice(&[0; 16]);
        let packet = wrap(LAPTOP6.into(), POD6.into(), IpProtocol::Ipv6Frag, &ext);
        assert_eq!(build(&packet, &mut out), Err(Ineligible::Fragment));
        // A first fragment (offset 0) of a UDP datagram is answered.
        ext[2..4].copy_from_slice(&1u16.to_be_bytes());
        let packet = wrap(LAPTOP6.into(), POD6.into(), IpProtocol::Ipv6Frag, &ext);
        assert_eq!(build(&packet, &mut out), Ok(()));
        // Hop-by-hop options, then an ICMPv6 error: not answered.
        let mut hbh = vec![58u8, 0, 1, 4, 0, 0, 0, 0];
        hbh.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        let packet = wrap(LAPTOP6.into(), POD6.into(), IpProtocol::HopByHop, &hbh);
        assert_eq!(build(&packet, &mut out), Err(Ineligible::IcmpError));

        for garbage in [&[][..], &[0x45][..], &[0x60; 20][..], &[0x10; 60][..]] {
            assert_eq!(build(garbage, &mut out), Err(Ineligible::Malformed));
        }
        // A truncated datagram (total length beyond the buffer).
        let syn = tcp_syn(LAPTOP.into(), WEB.into());
        assert_eq!(
            build(&syn[..syn.len() - 4], &mut out),
            Err(Ineligible::Malformed)
        );
    }

    #[test]
    fn rate_limit_allows_a_burst_then_the_sustained_rate() {
        let t0 = Instant::now();
        let mut limit = RateLimit::new(10, 5);
        let burst = (0..20).filter(|_| limit.allow(t0)).count();
        assert_eq!(burst, 5, "the burst");
        assert!(!limit.allow(t0 + Duration::from_millis(50)), "half a token");
        assert!(
            limit.allow(t0 + Duration::from_millis(100)),
            "one token per 100 ms"
        );
        assert!(!limit.allow(t0 + Duration::from_millis(100)));
        // A long pause refills to the burst, not beyond.
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..20).filter(|_| limit.allow(later)).count(), 5);
    }

    proptest::proptest! {
        #[test]
        fn never_panics_and_answers_are_valid(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut out = Vec::new();
            if build(&bytes, &mut out).is_ok() {
                match out[0] >> 4 {
                    4 => {
                        let ip = Ipv4Packet::new_checked(&out[..]).expect("valid");
                        proptest::prop_assert!(ip.verify_checksum());
                        proptest::prop_assert!(Icmpv4Packet::new_checked(ip.payload()).expect("icmp").verify_checksum());
                        proptest::prop_assert!(out.len() <= MAX_V4_ERROR);
                    }
                    6 => proptest::prop_assert!(out.len() <= MAX_V6_ERROR),
                    v => proptest::prop_assert!(false, "version {v}"),
                }
            }
        }
    }
}
