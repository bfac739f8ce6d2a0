//! IPv4 packets built with `smoltcp::wire` for tests that inject traffic
//! (in-test data-channel clients, raw sockets): a header with a valid
//! checksum around any payload, and a TCP SYN.

use std::net::{Ipv4Addr, SocketAddrV4};

use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{
    IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr, TcpControl, TcpPacket, TcpRepr, TcpSeqNumber,
};

/// An IPv4 packet (TTL 64, valid header checksum) carrying `payload`.
pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, proto: IpProtocol, payload: &[u8]) -> Vec<u8> {
    let ip = Ipv4Repr {
        src_addr: src,
        dst_addr: dst,
        next_header: proto,
        payload_len: payload.len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip.buffer_len() + payload.len()];
    let mut p = Ipv4Packet::new_unchecked(&mut buf[..]);
    ip.emit(&mut p, &ChecksumCapabilities::default());
    p.payload_mut().copy_from_slice(payload);
    buf
}

/// A TCP SYN from `src` to `dst` (MSS 1360, window scale 7, valid checksums).
pub fn tcp_syn(src: SocketAddrV4, dst: SocketAddrV4) -> Vec<u8> {
    let repr = TcpRepr {
        src_port: src.port(),
        dst_port: dst.port(),
        control: TcpControl::Syn,
        seq_number: TcpSeqNumber(0x1000),
        ack_number: None,
        window_len: 64240,
        window_scale: Some(7),
        max_seg_size: Some(1360),
        sack_permitted: false,
        sack_ranges: [None; 3],
        timestamp: None,
        payload: &[],
    };
    let mut seg = vec![0u8; repr.buffer_len()];
    repr.emit(
        &mut TcpPacket::new_unchecked(&mut seg[..]),
        &IpAddress::Ipv4(*src.ip()),
        &IpAddress::Ipv4(*dst.ip()),
        &ChecksumCapabilities::default(),
    );
    ipv4(*src.ip(), *dst.ip(), IpProtocol::Tcp, &seg)
}
