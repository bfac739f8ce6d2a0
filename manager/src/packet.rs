//! Client packets the manager handles outside smoltcp: classification of what
//! the laptop sends (TCP segment, UDP datagram, ICMP echo request, or a drop
//! reason) and construction of what the manager answers itself (RST for a
//! refused dial, ICMP destination unreachable, UDP datagrams and ICMP echo
//! replies carrying what the real destination sent).
//!
//! Pure: no I/O, no clock. Parsing uses `smoltcp::wire`'s checked readers and
//! never panics on any input. Checksums are not verified on receive: packets
//! arrive over a reliable byte stream (TCP, later TLS), and the laptop's TUN may
//! hand over packets whose checksum is left to offload.

use std::net::{IpAddr, SocketAddr};

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    Icmpv4DstUnreachable, Icmpv4Message, Icmpv4Packet, Icmpv4Repr, Icmpv6DstUnreachable,
    Icmpv6Message, Icmpv6Packet, Icmpv6Repr, IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr,
    Ipv6Packet, Ipv6Repr, TcpControl, TcpPacket, TcpRepr, TcpSeqNumber, UdpPacket, UdpRepr,
};

/// Hop limit (TTL) of packets the manager builds, as a Linux host would.
pub const HOP_LIMIT: u8 = 64;

/// Largest IP packet the manager builds for the client, bytes: the IP limit.
/// Packets over the stack MTU are fragmented before they are framed
/// ([`crate::frag::fragment`]), so each fits a frame (at most 65534 bytes).
pub const MAX_BUILT_PACKET: usize = 65_535;

/// Most bytes of an ICMPv4 error (IP header included): RFC 1812 §4.3.2.3
/// quotes as much of the offending packet as fits in 576 bytes.
pub const MAX_ICMPV4_ERROR: usize = 576;

/// Most bytes of an ICMPv6 error (IP header included): the IPv6 minimum MTU
/// (RFC 4443 §2.4 (c)).
pub const MAX_ICMPV6_ERROR: usize = 1280;

/// Why a client packet was not handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// Not a well-formed IPv4/IPv6 packet, or a truncated TCP/UDP/ICMP header.
    Malformed,
    /// An IPv4/IPv6 fragment that was discarded: overlapping, malformed, or
    /// beyond the reassembly limits ([`crate::frag`]).
    Fragment,
    /// Neither TCP, UDP nor an ICMP echo request (e.g. IPv6 extension headers,
    /// SCTP, ICMP errors from the laptop).
    UnsupportedProtocol,
    /// The source address is not the session's tunnel IP.
    BadSource,
    /// The destination is unspecified, multicast, broadcast, or loopback (the
    /// manager pod's own loopback is not part of the cluster network).
    ForbiddenDestination,
    /// A TCP segment for a flow whose dial is still in progress (not a SYN).
    TcpWhileDialing,
    /// The session's flow table is full.
    TooManyFlows,
    /// A UDP datagram or echo request could not be handed to the kernel socket.
    KernelSendFailed,
    /// A reply from the real destination is too large for one frame.
    ReplyTooLarge,
    /// The destination is in the tunnel pool but no laptop with that tunnel IP
    /// is connected (laptop-to-laptop).
    NoSuchPeer,
    /// The destination laptop's frame queue is full (laptop-to-laptop).
    PeerQueueFull,
    /// The session's intake (packet frames read from the laptop, not yet
    /// handled) was full: the laptop sends faster than the manager processes,
    /// e.g. a flood of small datagrams ([`crate::session::INTAKE_BYTES`]).
    IntakeFull,
    /// A GSO frame (frame kind 5) the manager could not segment (malformed
    /// super-packet, a kind other than TCPv4/TCPv6), or one from a laptop
    /// whose hello did not offer offloads (hello option 4).
    Gso,
}

impl DropReason {
    /// Every reason, for iterating counters.
    pub const ALL: [DropReason; 13] = [
        DropReason::Malformed,
        DropReason::Fragment,
        DropReason::UnsupportedProtocol,
        DropReason::BadSource,
        DropReason::ForbiddenDestination,
        DropReason::TcpWhileDialing,
        DropReason::TooManyFlows,
        DropReason::KernelSendFailed,
        DropReason::ReplyTooLarge,
        DropReason::NoSuchPeer,
        DropReason::PeerQueueFull,
        DropReason::IntakeFull,
        DropReason::Gso,
    ];

    /// A short snake_case name for logs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Fragment => "fragment",
            DropReason::UnsupportedProtocol => "unsupported_protocol",
            DropReason::BadSource => "bad_source",
            DropReason::ForbiddenDestination => "forbidden_destination",
            DropReason::TcpWhileDialing => "tcp_while_dialing",
            DropReason::TooManyFlows => "too_many_flows",
            DropReason::KernelSendFailed => "kernel_send_failed",
            DropReason::ReplyTooLarge => "reply_too_large",
            DropReason::NoSuchPeer => "no_such_peer",
            DropReason::PeerQueueFull => "peer_queue_full",
            DropReason::IntakeFull => "intake_full",
            DropReason::Gso => "gso",
        }
    }
}

/// The parts of a TCP segment the flow table needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpMeta {
    /// The laptop's end (tunnel IP, ephemeral port).
    pub src: SocketAddr,
    /// The real destination (pod IP or ClusterIP, port).
    pub dst: SocketAddr,
    /// SYN flag.
    pub syn: bool,
    /// ACK flag.
    pub ack: bool,
    /// RST flag.
    pub rst: bool,
    /// FIN flag.
    pub fin: bool,
    /// Sequence number.
    pub seq: u32,
    /// Payload bytes after the TCP header.
    pub payload_len: usize,
}

impl TcpMeta {
    /// A connection-opening segment: SYN without ACK or RST.
    pub fn is_initial_syn(&self) -> bool {
        self.syn && !self.ack && !self.rst
    }
}

/// A classified client packet, borrowing from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A TCP segment (terminated in smoltcp).
    Tcp(TcpMeta),
    /// A UDP datagram (relayed through a kernel UDP socket).
    Udp {
        /// The laptop's end.
        src: SocketAddr,
        /// The real destination.
        dst: SocketAddr,
        /// Datagram payload.
        payload: &'a [u8],
    },
    /// An ICMP or ICMPv6 echo request (relayed through a kernel ping socket).
    EchoRequest {
        /// The laptop's tunnel IP.
        src: IpAddr,
        /// The pinged address.
        dst: IpAddr,
        /// Echo identifier chosen by the laptop's ping.
        ident: u16,
        /// Echo sequence number.
        seq: u16,
        /// Echo payload.
        data: &'a [u8],
    },
}

impl Parsed<'_> {
    /// Source and destination addresses of the packet.
    pub fn addrs(&self) -> (IpAddr, IpAddr) {
        match *self {
            Parsed::Tcp(m) => (m.src.ip(), m.dst.ip()),
            Parsed::Udp { src, dst, .. } => (src.ip(), dst.ip()),
            Parsed::EchoRequest { src, dst, .. } => (src, dst),
        }
    }
}

/// Classify one raw IP packet from the laptop. Never panics.
pub fn parse(buf: &[u8]) -> Result<Parsed<'_>, DropReason> {
    match buf.first().map(|b| b >> 4) {
        Some(4) => parse_v4(buf),
        Some(6) => parse_v6(buf),
        _ => Err(DropReason::Malformed),
    }
}

fn parse_v4(buf: &[u8]) -> Result<Parsed<'_>, DropReason> {
    let pkt = Ipv4Packet::new_checked(buf).map_err(|_| DropReason::Malformed)?;
    // Fragments are reassembled before parsing (crate::frag); one here is a bug
    // or a packet the reassembler gave up on.
    if pkt.more_frags() || pkt.frag_offset() != 0 {
        return Err(DropReason::Fragment);
    }
    let src = IpAddr::V4(pkt.src_addr());
    let dst = IpAddr::V4(pkt.dst_addr());
    let payload: &[u8] = pkt.payload();
    match pkt.next_header() {
        IpProtocol::Icmp => {
            let icmp = Icmpv4Packet::new_checked(payload).map_err(|_| DropReason::Malformed)?;
            if icmp.msg_type() != Icmpv4Message::EchoRequest || icmp.msg_code() != 0 {
                return Err(DropReason::UnsupportedProtocol);
            }
            Ok(Parsed::EchoRequest {
                src,
                dst,
                ident: icmp.echo_ident(),
                seq: icmp.echo_seq_no(),
                data: icmp.data(),
            })
        }
        proto => parse_transport(src, dst, proto, payload),
    }
}

fn parse_v6(buf: &[u8]) -> Result<Parsed<'_>, DropReason> {
    let pkt = Ipv6Packet::new_checked(buf).map_err(|_| DropReason::Malformed)?;
    let src = IpAddr::V6(pkt.src_addr());
    let dst = IpAddr::V6(pkt.dst_addr());
    let payload: &[u8] = pkt.payload();
    match pkt.next_header() {
        IpProtocol::Icmpv6 => {
            let icmp = Icmpv6Packet::new_checked(payload).map_err(|_| DropReason::Malformed)?;
            if icmp.msg_type() != Icmpv6Message::EchoRequest || icmp.msg_code() != 0 {
                return Err(DropReason::UnsupportedProtocol);
            }
            Ok(Parsed::EchoRequest {
                src,
                dst,
                ident: icmp.echo_ident(),
                seq: icmp.echo_seq_no(),
                data: icmp.payload(),
            })
        }
        proto => parse_transport(src, dst, proto, payload),
    }
}

fn parse_transport(
    src: IpAddr,
    dst: IpAddr,
    proto: IpProtocol,
    payload: &[u8],
) -> Result<Parsed<'_>, DropReason> {
    match proto {
        IpProtocol::Tcp => {
            let tcp = TcpPacket::new_checked(payload).map_err(|_| DropReason::Malformed)?;
            Ok(Parsed::Tcp(TcpMeta {
                src: SocketAddr::new(src, tcp.src_port()),
                dst: SocketAddr::new(dst, tcp.dst_port()),
                syn: tcp.syn(),
                ack: tcp.ack(),
                rst: tcp.rst(),
                fin: tcp.fin(),
                seq: tcp.seq_number().0 as u32,
                payload_len: tcp.payload().len(),
            }))
        }
        IpProtocol::Udp => {
            let udp = UdpPacket::new_checked(payload).map_err(|_| DropReason::Malformed)?;
            Ok(Parsed::Udp {
                src: SocketAddr::new(src, udp.src_port()),
                dst: SocketAddr::new(dst, udp.dst_port()),
                payload: udp.payload(),
            })
        }
        _ => Err(DropReason::UnsupportedProtocol),
    }
}

/// Whether the manager may relay traffic to `dst` at all. Loopback is allowed
/// only when `allow_loopback` (in-process tests dial servers on 127.0.0.1).
pub fn destination_allowed(dst: IpAddr, allow_loopback: bool) -> bool {
    if dst.is_unspecified() || dst.is_multicast() {
        return false;
    }
    if dst.is_loopback() && !allow_loopback {
        return false;
    }
    match dst {
        IpAddr::V4(a) => !a.is_broadcast(),
        IpAddr::V6(_) => true,
    }
}

/// Why a packet could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// Source and destination are of different IP families.
    #[error("source and destination address families differ")]
    FamilyMismatch,
    /// The packet would exceed [`MAX_BUILT_PACKET`] bytes.
    #[error("packet of {0} bytes exceeds the frame limit")]
    TooLarge(usize),
}

/// Kind of ICMP destination-unreachable error sent to the laptop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreachable {
    /// The dial timed out or the kernel reported no route: the laptop's
    /// connect() fails with EHOSTUNREACH (RFC 1122 §4.2.3.9 lets TCP abort a
    /// connection attempt on this error while in SYN-SENT).
    Host,
    /// A UDP destination answered "port unreachable" (the kernel socket saw
    /// ECONNREFUSED): the laptop's connected UDP socket sees ECONNREFUSED.
    Port,
    /// The manager refuses the flow by policy (the per-client flow cap):
    /// ICMP type 3 code 13 / ICMPv6 type 1 code 1 (RFC 1812 §5.2.7.1, RFC 4443).
    AdminProhibited,
}

/// The IP header and first transport bytes of a packet an ICMP error refers to.
#[derive(Debug, Clone, Copy)]
pub struct Offending<'a> {
    /// Source of the offending packet (the laptop's tunnel IP).
    pub src: IpAddr,
    /// Destination of the offending packet.
    pub dst: IpAddr,
    /// Its transport protocol.
    pub protocol: IpProtocol,
    /// Its IP payload length, bytes.
    pub payload_len: usize,
    /// The first bytes of its IP payload (RFC 792: at least 8; carries the ports).
    pub payload_head: &'a [u8],
}

impl<'a> Offending<'a> {
    /// The offending packet from its raw bytes (as the laptop sent it).
    pub fn from_packet(buf: &'a [u8]) -> Option<Self> {
        match buf.first().map(|b| b >> 4) {
            Some(4) => {
                let pkt = Ipv4Packet::new_checked(buf).ok()?;
                let payload: &[u8] = pkt.payload();
                Some(Self {
                    src: IpAddr::V4(pkt.src_addr()),
                    dst: IpAddr::V4(pkt.dst_addr()),
                    protocol: pkt.next_header(),
                    payload_len: payload.len(),
                    payload_head: payload.get(..8).unwrap_or(payload),
                })
            }
            Some(6) => {
                let pkt = Ipv6Packet::new_checked(buf).ok()?;
                let payload: &[u8] = pkt.payload();
                Some(Self {
                    src: IpAddr::V6(pkt.src_addr()),
                    dst: IpAddr::V6(pkt.dst_addr()),
                    protocol: pkt.next_header(),
                    payload_len: payload.len(),
                    payload_head: payload.get(..8).unwrap_or(payload),
                })
            }
            _ => None,
        }
    }
}

fn ip_header_len(ip: IpAddr) -> usize {
    match ip {
        IpAddr::V4(_) => 20,
        IpAddr::V6(_) => 40,
    }
}

/// Emit an IP header for `src -> dst` carrying `payload_len` bytes of `proto`
/// into a fresh buffer and return it with the payload offset.
fn ip_packet(
    src: IpAddr,
    dst: IpAddr,
    proto: IpProtocol,
    payload_len: usize,
) -> Result<(Vec<u8>, usize), BuildError> {
    let header_len = ip_header_len(src);
    let total = header_len + payload_len;
    if total > MAX_BUILT_PACKET {
        return Err(BuildError::TooLarge(total));
    }
    let mut buf = vec![0u8; total];
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let repr = Ipv4Repr {
                src_addr: s,
                dst_addr: d,
                next_header: proto,
                payload_len,
                hop_limit: HOP_LIMIT,
            };
            repr.emit(
                &mut Ipv4Packet::new_unchecked(&mut buf[..]),
                &ChecksumCapabilities::default(),
            );
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let repr = Ipv6Repr {
                src_addr: s,
                dst_addr: d,
                next_header: proto,
                payload_len,
                hop_limit: HOP_LIMIT,
            };
            repr.emit(&mut Ipv6Packet::new_unchecked(&mut buf[..]));
        }
        _ => return Err(BuildError::FamilyMismatch),
    }
    Ok((buf, header_len))
}

/// The RST|ACK that refuses the laptop's SYN `syn` (from the SYN's destination
/// back to its source), as a closed port on a Linux host answers: SEQ 0, ACK =
/// SYN's SEQ + 1 + payload (RFC 9293 §3.10.7.1), so the laptop's connect()
/// fails with ECONNREFUSED.
pub fn tcp_rst_for_syn(syn: &TcpMeta) -> Result<Vec<u8>, BuildError> {
    let ack = syn
        .seq
        .wrapping_add(1)
        .wrapping_add(syn.payload_len as u32)
        .wrapping_add(u32::from(syn.fin));
    let repr = TcpRepr {
        src_port: syn.dst.port(),
        dst_port: syn.src.port(),
        control: TcpControl::Rst,
        seq_number: TcpSeqNumber(0),
        ack_number: Some(TcpSeqNumber(ack as i32)),
        window_len: 0,
        window_scale: None,
        max_seg_size: None,
        sack_permitted: false,
        sack_ranges: [None, None, None],
        timestamp: None,
        payload: &[],
    };
    let (mut buf, off) = ip_packet(
        syn.dst.ip(),
        syn.src.ip(),
        IpProtocol::Tcp,
        repr.buffer_len(),
    )?;
    repr.emit(
        &mut TcpPacket::new_unchecked(&mut buf[off..]),
        &IpAddress::from(syn.dst.ip()),
        &IpAddress::from(syn.src.ip()),
        &ChecksumCapabilities::default(),
    );
    Ok(buf)
}

/// An ICMP (or ICMPv6) destination-unreachable error about `offending`, sent
/// from the offending packet's destination to its source.
pub fn dst_unreachable(
    offending: &Offending<'_>,
    kind: Unreachable,
) -> Result<Vec<u8>, BuildError> {
    let caps = ChecksumCapabilities::default();
    match (offending.src, offending.dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let repr = Icmpv4Repr::DstUnreachable {
                reason: match kind {
                    Unreachable::Host => Icmpv4DstUnreachable::HostUnreachable,
                    Unreachable::Port => Icmpv4DstUnreachable::PortUnreachable,
                    Unreachable::AdminProhibited => Icmpv4DstUnreachable::CommProhibited,
                },
                header: Ipv4Repr {
                    src_addr: s,
                    dst_addr: d,
                    next_header: offending.protocol,
                    payload_len: offending.payload_len,
                    hop_limit: HOP_LIMIT,
                },
                data: offending.payload_head,
            };
            let (mut buf, off) = ip_packet(
                offending.dst,
                offending.src,
                IpProtocol::Icmp,
                repr.buffer_len(),
            )?;
            repr.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[off..]), &caps);
            Ok(buf)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let repr = Icmpv6Repr::DstUnreachable {
                reason: match kind {
                    Unreachable::Host => Icmpv6DstUnreachable::AddrUnreachable,
                    Unreachable::Port => Icmpv6DstUnreachable::PortUnreachable,
                    Unreachable::AdminProhibited => Icmpv6DstUnreachable::AdminProhibit,
                },
                header: Ipv6Repr {
                    src_addr: s,
                    dst_addr: d,
                    next_header: offending.protocol,
                    payload_len: offending.payload_len,
                    hop_limit: HOP_LIMIT,
                },
                data: offending.payload_head,
            };
            let (mut buf, off) = ip_packet(
                offending.dst,
                offending.src,
                IpProtocol::Icmpv6,
                repr.buffer_len(),
            )?;
            repr.emit(
                &d,
                &s,
                &mut Icmpv6Packet::new_unchecked(&mut buf[off..]),
                &caps,
            );
            Ok(buf)
        }
        _ => Err(BuildError::FamilyMismatch),
    }
}

/// An ICMP error about the raw packet `offending`, from its destination to
/// its source: `v4_type_code` or `v6_type_code` by family, the 4 bytes after
/// the checksum (`rest`: unused, next-hop MTU or MTU), then as much of the
/// offending packet as the family's error size allows. `None` if `offending`
/// is not an IPv4/IPv6 packet.
fn icmp_error_raw(
    offending: &[u8],
    v4_type_code: (u8, u8),
    v6_type_code: (u8, u8),
    rest: [u8; 4],
) -> Option<Vec<u8>> {
    // Only the addresses are read: the quote may be a truncated packet (the
    // head of a first fragment), whose length fields point past its end.
    let (src, dst) = crate::peers::addrs(offending)?;
    let (max, proto, (ty, code)) = match src {
        IpAddr::V4(_) => (MAX_ICMPV4_ERROR, IpProtocol::Icmp, v4_type_code),
        IpAddr::V6(_) => (MAX_ICMPV6_ERROR, IpProtocol::Icmpv6, v6_type_code),
    };
    let quote = &offending[..offending.len().min(max - ip_header_len(src) - 8)];
    let (mut buf, off) = ip_packet(dst, src, proto, 8 + quote.len()).ok()?;
    let icmp = &mut buf[off..];
    icmp[0] = ty;
    icmp[1] = code;
    icmp[4..8].copy_from_slice(&rest);
    icmp[8..].copy_from_slice(quote);
    match (dst, src) {
        (IpAddr::V4(_), _) => Icmpv4Packet::new_unchecked(icmp).fill_checksum(),
        (IpAddr::V6(d), IpAddr::V6(s)) => Icmpv6Packet::new_unchecked(icmp).fill_checksum(&d, &s),
        _ => return None,
    }
    Some(buf)
}

/// "Fragmentation needed and DF set" (ICMP type 3 code 4 with the next-hop
/// MTU, RFC 1191 §4) or ICMPv6 "Packet Too Big" (RFC 4443 §3.2, RFC 8201)
/// about `offending`, a packet larger than `mtu` bytes that must not be
/// fragmented on the way. The laptop's kernel lowers its path MTU towards the
/// destination and TCP there resends smaller segments.
pub fn too_big(offending: &[u8], mtu: u16) -> Option<Vec<u8>> {
    // IPv4: 16 unused bits, then the 16-bit next-hop MTU; IPv6: a 32-bit MTU.
    let rest = if offending.first().map(|b| b >> 4) == Some(6) {
        u32::from(mtu).to_be_bytes()
    } else {
        let [hi, lo] = mtu.to_be_bytes();
        [0, 0, hi, lo]
    };
    icmp_error_raw(offending, (3, 4), (2, 0), rest)
}

/// "Fragment reassembly time exceeded" (ICMP type 11 code 1, ICMPv6 type 3
/// code 1; RFC 792, RFC 4443 §3.3) quoting the first fragment `first` of a
/// datagram that never completed.
pub fn reassembly_time_exceeded(first: &[u8]) -> Option<Vec<u8>> {
    icmp_error_raw(first, (11, 1), (3, 1), [0; 4])
}

/// A UDP datagram `src -> dst` carrying `payload` (a reply from the real
/// destination `src`, to the laptop's `dst`).
pub fn udp_datagram(
    src: SocketAddr,
    dst: SocketAddr,
    payload: &[u8],
) -> Result<Vec<u8>, BuildError> {
    let udp_len = 8 + payload.len();
    if udp_len > usize::from(u16::MAX) {
        return Err(BuildError::TooLarge(udp_len));
    }
    let (mut buf, off) = ip_packet(src.ip(), dst.ip(), IpProtocol::Udp, udp_len)?;
    let repr = UdpRepr {
        src_port: src.port(),
        dst_port: dst.port(),
    };
    repr.emit(
        &mut UdpPacket::new_unchecked(&mut buf[off..]),
        &IpAddress::from(src.ip()),
        &IpAddress::from(dst.ip()),
        payload.len(),
        |p| p.copy_from_slice(payload),
        &ChecksumCapabilities::default(),
    );
    Ok(buf)
}

/// An ICMP (or ICMPv6) echo reply `src -> dst` with the laptop's identifier.
pub fn echo_reply(
    src: IpAddr,
    dst: IpAddr,
    ident: u16,
    seq: u16,
    data: &[u8],
) -> Result<Vec<u8>, BuildError> {
    let caps = ChecksumCapabilities::default();
    match (src, dst) {
        (IpAddr::V4(_), IpAddr::V4(_)) => {
            let repr = Icmpv4Repr::EchoReply {
                ident,
                seq_no: seq,
                data,
            };
            let (mut buf, off) = ip_packet(src, dst, IpProtocol::Icmp, repr.buffer_len())?;
            repr.emit(&mut Icmpv4Packet::new_unchecked(&mut buf[off..]), &caps);
            Ok(buf)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let repr = Icmpv6Repr::EchoReply {
                ident,
                seq_no: seq,
                data,
            };
            let (mut buf, off) = ip_packet(src, dst, IpProtocol::Icmpv6, repr.buffer_len())?;
            repr.emit(
                &s,
                &d,
                &mut Icmpv6Packet::new_unchecked(&mut buf[off..]),
                &caps,
            );
            Ok(buf)
        }
        _ => Err(BuildError::FamilyMismatch),
    }
}

/// The ICMP message a kernel ping socket expects in send(): an echo request
/// header (type, code, checksum and identifier are filled in by the kernel,
/// which also rewrites the identifier to the socket's own) plus `data`.
pub fn ping_socket_request(v6: bool, seq: u16, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + data.len());
    out.push(if v6 { 128 } else { 8 });
    out.extend_from_slice(&[0, 0, 0, 0, 0]);
    out.extend_from_slice(&seq.to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Parse what a kernel ping socket returned from recv(): `(seq, data)` of an
/// echo reply, or `None` for anything else.
pub fn ping_socket_reply(v6: bool, msg: &[u8]) -> Option<(u16, &[u8])> {
    let reply_type = if v6 { 129 } else { 0 };
    if msg.len() < 8 || msg[0] != reply_type || msg[1] != 0 {
        return None;
    }
    Some((u16::from_be_bytes([msg[6], msg[7]]), &msg[8..]))
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Packet builders for tests (the laptop's side of a conversation).
    use super::*;
    use std::net::Ipv4Addr;

    pub fn v4(a: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::from(a)), port)
    }

    /// A TCP segment built with smoltcp's emitters, for tests.
    pub fn tcp_segment(
        src: SocketAddr,
        dst: SocketAddr,
        control: TcpControl,
        seq: u32,
        ack: Option<u32>,
        payload: &[u8],
    ) -> Vec<u8> {
        let repr = TcpRepr {
            src_port: src.port(),
            dst_port: dst.port(),
            control,
            seq_number: TcpSeqNumber(seq as i32),
            ack_number: ack.map(|a| TcpSeqNumber(a as i32)),
            window_len: 65535,
            window_scale: None,
            max_seg_size: None,
            sack_permitted: false,
            sack_ranges: [None, None, None],
            timestamp: None,
            payload,
        };
        let (mut buf, off) =
            ip_packet(src.ip(), dst.ip(), IpProtocol::Tcp, repr.buffer_len()).expect("fits");
        repr.emit(
            &mut TcpPacket::new_unchecked(&mut buf[off..]),
            &IpAddress::from(src.ip()),
            &IpAddress::from(dst.ip()),
            &ChecksumCapabilities::default(),
        );
        buf
    }

    /// A SYN carrying an MSS option.
    pub fn tcp_syn_mss(src: SocketAddr, dst: SocketAddr, seq: u32, mss: u16) -> Vec<u8> {
        let repr = TcpRepr {
            src_port: src.port(),
            dst_port: dst.port(),
            control: TcpControl::Syn,
            seq_number: TcpSeqNumber(seq as i32),
            ack_number: None,
            window_len: 65535,
            window_scale: None,
            max_seg_size: Some(mss),
            sack_permitted: false,
            sack_ranges: [None, None, None],
            timestamp: None,
            payload: &[],
        };
        let (mut buf, off) =
            ip_packet(src.ip(), dst.ip(), IpProtocol::Tcp, repr.buffer_len()).expect("fits");
        repr.emit(
            &mut TcpPacket::new_unchecked(&mut buf[off..]),
            &IpAddress::from(src.ip()),
            &IpAddress::from(dst.ip()),
            &ChecksumCapabilities::default(),
        );
        buf
    }

    /// The MSS option of a TCP/IPv4 segment, if any.
    pub fn mss_option(buf: &[u8]) -> Option<u16> {
        let ip = Ipv4Packet::new_checked(buf).expect("ipv4");
        let tcp = TcpPacket::new_checked(ip.payload()).expect("tcp");
        let repr = TcpRepr::parse(
            &tcp,
            &IpAddress::from(ip.src_addr()),
            &IpAddress::from(ip.dst_addr()),
            &ChecksumCapabilities::ignored(),
        )
        .expect("valid TCP");
        repr.max_seg_size
    }

    /// An ICMP echo request `src -> dst`.
    pub fn echo_request(src: IpAddr, dst: IpAddr, ident: u16, seq: u16, data: &[u8]) -> Vec<u8> {
        let (IpAddr::V4(_), IpAddr::V4(_)) = (src, dst) else {
            panic!("echo_request builds IPv4 only");
        };
        let repr = Icmpv4Repr::EchoRequest {
            ident,
            seq_no: seq,
            data,
        };
        let (mut buf, off) =
            ip_packet(src, dst, IpProtocol::Icmp, repr.buffer_len()).expect("fits");
        repr.emit(
            &mut Icmpv4Packet::new_unchecked(&mut buf[off..]),
            &ChecksumCapabilities::default(),
        );
        buf
    }

    /// A pure ACK from the laptop advertising `window` bytes (no scaling).
    pub fn tcp_segment_win(
        src: SocketAddr,
        dst: SocketAddr,
        seq: u32,
        ack: u32,
        window: u16,
    ) -> Vec<u8> {
        let mut pkt = tcp_segment(src, dst, TcpControl::None, seq, Some(ack), &[]);
        let off = ip_header_len(src.ip());
        let mut tcp = TcpPacket::new_unchecked(&mut pkt[off..]);
        tcp.set_window_len(window);
        tcp.fill_checksum(&IpAddress::from(src.ip()), &IpAddress::from(dst.ip()));
        pkt
    }

    /// A parsed TCP segment the manager sent.
    #[derive(Debug, Clone)]
    pub struct Seg {
        pub src: SocketAddr,
        pub dst: SocketAddr,
        pub syn: bool,
        pub ack: bool,
        pub fin: bool,
        pub rst: bool,
        pub seq: u32,
        pub ack_number: u32,
        /// The window field as sent (not scaled).
        pub window: u16,
        pub payload: Vec<u8>,
    }

    /// Parse a TCP/IPv4 segment (panics on anything else).
    pub fn seg(buf: &[u8]) -> Seg {
        let ip = Ipv4Packet::new_checked(buf).expect("ipv4");
        assert_eq!(ip.next_header(), IpProtocol::Tcp, "not TCP");
        let tcp = TcpPacket::new_checked(ip.payload()).expect("tcp");
        Seg {
            src: SocketAddr::new(IpAddr::V4(ip.src_addr()), tcp.src_port()),
            dst: SocketAddr::new(IpAddr::V4(ip.dst_addr()), tcp.dst_port()),
            syn: tcp.syn(),
            ack: tcp.ack(),
            fin: tcp.fin(),
            rst: tcp.rst(),
            seq: tcp.seq_number().0 as u32,
            ack_number: tcp.ack_number().0 as u32,
            window: tcp.window_len(),
            payload: tcp.payload().to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn classifies_tcp_syn() {
        let pkt = tcp_segment(
            v4([100, 96, 0, 2], 40000),
            v4([10, 244, 1, 11], 80),
            TcpControl::Syn,
            1000,
            None,
            &[],
        );
        let Ok(Parsed::Tcp(meta)) = parse(&pkt) else {
            panic!("not TCP: {:?}", parse(&pkt));
        };
        assert!(meta.is_initial_syn());
        assert_eq!(meta.seq, 1000);
        assert_eq!(meta.dst, v4([10, 244, 1, 11], 80));
    }

    #[test]
    fn rst_for_syn_acknowledges_the_syn() {
        let syn = TcpMeta {
            src: v4([100, 96, 0, 2], 40000),
            dst: v4([10, 244, 1, 11], 81),
            syn: true,
            ack: false,
            rst: false,
            fin: false,
            seq: u32::MAX,
            payload_len: 0,
        };
        let rst = tcp_rst_for_syn(&syn).expect("builds");
        let ip = Ipv4Packet::new_checked(&rst[..]).expect("ipv4");
        assert!(ip.verify_checksum());
        assert_eq!(ip.src_addr(), Ipv4Addr::new(10, 244, 1, 11));
        assert_eq!(ip.dst_addr(), Ipv4Addr::new(100, 96, 0, 2));
        let tcp = TcpPacket::new_checked(ip.payload()).expect("tcp");
        assert!(tcp.verify_checksum(&ip.src_addr().into(), &ip.dst_addr().into()));
        assert!(tcp.rst() && tcp.ack() && !tcp.syn());
        assert_eq!((tcp.src_port(), tcp.dst_port()), (81, 40000));
        // SEQ u32::MAX + 1 wraps to 0.
        assert_eq!(tcp.ack_number(), TcpSeqNumber(0));
    }

    #[test]
    fn udp_round_trip_v4_and_v6() {
        for (src, dst) in [
            (v4([10, 244, 1, 12], 7007), v4([100, 96, 0, 2], 5353)),
            (
                SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 7)), 53),
                SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
                    40001,
                ),
            ),
        ] {
            let pkt = udp_datagram(src, dst, b"hello").expect("builds");
            assert_eq!(
                parse(&pkt),
                Ok(Parsed::Udp {
                    src,
                    dst,
                    payload: b"hello"
                })
            );
        }
        assert_eq!(
            udp_datagram(
                v4([1, 2, 3, 4], 1),
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 1),
                b""
            ),
            Err(BuildError::FamilyMismatch)
        );
        assert!(matches!(
            udp_datagram(v4([1, 2, 3, 4], 1), v4([1, 2, 3, 5], 1), &vec![0; 65535]),
            Err(BuildError::TooLarge(_))
        ));
    }

    #[test]
    fn echo_reply_parses_back_as_reply() {
        let pkt = echo_reply(
            IpAddr::V4(Ipv4Addr::new(10, 244, 1, 11)),
            IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)),
            0x1234,
            7,
            b"abc",
        )
        .expect("builds");
        let ip = Ipv4Packet::new_checked(&pkt[..]).expect("ipv4");
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
        assert!(icmp.verify_checksum());
        assert_eq!(icmp.msg_type(), Icmpv4Message::EchoReply);
        assert_eq!(
            (icmp.echo_ident(), icmp.echo_seq_no(), icmp.data()),
            (0x1234, 7, &b"abc"[..])
        );
    }

    #[test]
    fn echo_request_v6_is_classified() {
        let s = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
        let d = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 9);
        let repr = Icmpv6Repr::EchoRequest {
            ident: 9,
            seq_no: 3,
            data: b"xy",
        };
        let (mut buf, off) = ip_packet(
            IpAddr::V6(s),
            IpAddr::V6(d),
            IpProtocol::Icmpv6,
            repr.buffer_len(),
        )
        .expect("fits");
        repr.emit(
            &s,
            &d,
            &mut Icmpv6Packet::new_unchecked(&mut buf[off..]),
            &ChecksumCapabilities::default(),
        );
        assert_eq!(
            parse(&buf),
            Ok(Parsed::EchoRequest {
                src: IpAddr::V6(s),
                dst: IpAddr::V6(d),
                ident: 9,
                seq: 3,
                data: b"xy"
            })
        );
    }

    #[test]
    fn host_unreachable_quotes_the_syn() {
        let syn = tcp_segment(
            v4([100, 96, 0, 2], 40000),
            v4([10, 244, 1, 99], 80),
            TcpControl::Syn,
            5,
            None,
            &[],
        );
        let off = Offending::from_packet(&syn).expect("parses");
        let err = dst_unreachable(&off, Unreachable::Host).expect("builds");
        let ip = Ipv4Packet::new_checked(&err[..]).expect("ipv4");
        assert_eq!(ip.src_addr(), Ipv4Addr::new(10, 244, 1, 99));
        assert_eq!(ip.dst_addr(), Ipv4Addr::new(100, 96, 0, 2));
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
        assert!(icmp.verify_checksum());
        assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
        assert_eq!(icmp.msg_code(), 1);
        // The quoted header carries the laptop's ports, which Linux uses to find the socket.
        // The quote is the header plus 8 bytes, shorter than its total length.
        let inner = Ipv4Packet::new_unchecked(icmp.data());
        assert_eq!(icmp.data().len(), 28);
        assert_eq!(inner.src_addr(), Ipv4Addr::new(100, 96, 0, 2));
        assert_eq!(&icmp.data()[20..22], &40000u16.to_be_bytes());
    }

    #[test]
    fn fragments_and_garbage_are_dropped() {
        let mut pkt =
            udp_datagram(v4([100, 96, 0, 2], 1), v4([10, 0, 0, 1], 2), b"x").expect("builds");
        assert!(parse(&pkt).is_ok());
        pkt[6] |= 0x20; // more fragments
        assert_eq!(parse(&pkt), Err(DropReason::Fragment));
        assert_eq!(parse(&[]), Err(DropReason::Malformed));
        assert_eq!(parse(&[0x45]), Err(DropReason::Malformed));
        assert_eq!(parse(&[0x70, 0, 0, 0]), Err(DropReason::Malformed));
    }

    #[test]
    fn destinations() {
        assert!(destination_allowed(
            "10.244.1.11".parse().expect("ip"),
            false
        ));
        assert!(!destination_allowed(
            "127.0.0.1".parse().expect("ip"),
            false
        ));
        assert!(destination_allowed("127.0.0.1".parse().expect("ip"), true));
        assert!(!destination_allowed("0.0.0.0".parse().expect("ip"), true));
        assert!(!destination_allowed(
            "255.255.255.255".parse().expect("ip"),
            true
        ));
        assert!(!destination_allowed("224.0.0.1".parse().expect("ip"), true));
        assert!(!destination_allowed("::1".parse().expect("ip"), false));
    }

    #[test]
    fn ping_socket_messages() {
        let req = ping_socket_request(false, 0x0102, b"hi");
        assert_eq!(req, [8, 0, 0, 0, 0, 0, 1, 2, b'h', b'i']);
        let mut reply = req.clone();
        reply[0] = 0;
        assert_eq!(ping_socket_reply(false, &reply), Some((0x0102, &b"hi"[..])));
        assert_eq!(ping_socket_reply(true, &reply), None);
        assert_eq!(ping_socket_reply(false, &reply[..7]), None);
    }

    proptest! {
        #[test]
        fn parse_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&buf);
            let _ = Offending::from_packet(&buf);
            let _ = too_big(&buf, 9000);
            let _ = reassembly_time_exceeded(&buf);
        }

        /// Valid IPv4/IPv6 headers with arbitrary transport bytes reach the
        /// transport parsers (random bytes rarely get past the IP header).
        #[test]
        fn parse_never_panics_behind_valid_ip(
            proto in prop_oneof![Just(1u8), Just(6u8), Just(17u8), Just(58u8), any::<u8>()],
            six in any::<bool>(),
            body in proptest::collection::vec(any::<u8>(), 0..120),
        ) {
            let (src, dst) = if six {
                (IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)), IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 3)))
            } else {
                (IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2)), IpAddr::V4(Ipv4Addr::new(10, 0, 0, 3)))
            };
            let (mut buf, off) = ip_packet(src, dst, IpProtocol::from(proto), body.len()).expect("fits");
            buf[off..].copy_from_slice(&body);
            if let Ok(p) = parse(&buf) {
                prop_assert_eq!(p.addrs(), (src, dst));
            }
            if let Some(o) = Offending::from_packet(&buf) {
                let _ = dst_unreachable(&o, Unreachable::Host);
            }
            let err = too_big(&buf, 1280).expect("a valid IP header can be quoted");
            let max = if six { MAX_ICMPV6_ERROR } else { MAX_ICMPV4_ERROR };
            prop_assert!(err.len() <= max);
            let _ = reassembly_time_exceeded(&buf[..buf.len().min(off + 8)]);
        }
    }
}
