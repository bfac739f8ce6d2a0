//! Address parser of the TUN programs: finds the IPv4/IPv6 destination (egress
//! classifier) or source (ingress check) of a packet that may sit behind an L2 header,
//! without ever reading past the packet.
//!
//! Header layouts: IPv4 RFC 791 §3.1 (version/IHL in byte 0, source at offset 12,
//! destination at offset 16), IPv6 RFC 8200 §3 (40-byte fixed header, source at
//! offset 8, destination at offset 24), Ethernet II
//! (ethertype in the last two bytes of the 14-byte header; 0x0800 IPv4, 0x86DD IPv6).

/// Bounds-checked read access to a packet.
pub trait PacketBytes {
    /// Packet length in bytes, including any L2 header (`skb->len`).
    fn packet_len(&self) -> usize;
    /// The `N` bytes at `offset`, or `None` if any of them lies outside the packet.
    fn read<const N: usize>(&self, offset: usize) -> Option<[u8; N]>;
}

impl PacketBytes for [u8] {
    fn packet_len(&self) -> usize {
        self.len()
    }

    fn read<const N: usize>(&self, offset: usize) -> Option<[u8; N]> {
        let end = offset.checked_add(N)?;
        let bytes = self.get(offset..end)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Some(out)
    }
}

/// A packet's destination (or source) address, network byte order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Destination {
    /// IPv4 address.
    V4([u8; 4]),
    /// IPv6 address.
    V6([u8; 16]),
}

/// A packet's source address: the same shape as [`Destination`].
pub type Source = Destination;

/// Why a packet has no usable address. Every variant means "drop and count as
/// malformed"; the variants exist for tests and debugging.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParseError {
    /// The packet ends inside the L2 header or the IP header.
    Truncated,
    /// The ethertype or the IP version nibble is neither IPv4 nor IPv6.
    NotIp,
    /// IPv4 IHL below 5 words (RFC 791: the minimum header is 20 bytes).
    BadIhl,
    /// The ethertype says one IP version, the header's version nibble another.
    VersionMismatch,
}

const ETHERTYPE_IPV4: u16 = 0x0800;
const ETHERTYPE_IPV6: u16 = 0x86DD;
const IPV4_MIN_HDR_LEN: usize = 20;
const IPV4_SRC_OFFSET: usize = 12;
const IPV4_DST_OFFSET: usize = 16;
const IPV6_HDR_LEN: usize = 40;
const IPV6_SRC_OFFSET: usize = 8;
const IPV6_DST_OFFSET: usize = 24;

/// The destination of the IP packet that starts `l2_len` bytes into `pkt`.
///
/// `l2_len` is 0 for a TUN device (the packet starts at the IP header) or the length of
/// an Ethernet-like header whose last two bytes are the ethertype (14 for Ethernet).
/// The whole IP header (IHL words for IPv4, 40 bytes for IPv6) must be present; the
/// IPv4 total-length field is not checked against the packet length, because a GSO
/// super-packet on the TUN carries more bytes than one segment's header announces.
#[inline(always)]
pub fn destination<P: PacketBytes + ?Sized>(
    pkt: &P,
    l2_len: usize,
) -> Result<Destination, ParseError> {
    address(pkt, l2_len, IPV4_DST_OFFSET, IPV6_DST_OFFSET)
}

/// The source of the IP packet that starts `l2_len` bytes into `pkt`; the same rules
/// as [`destination`].
#[inline(always)]
pub fn source<P: PacketBytes + ?Sized>(pkt: &P, l2_len: usize) -> Result<Source, ParseError> {
    address(pkt, l2_len, IPV4_SRC_OFFSET, IPV6_SRC_OFFSET)
}

#[inline(always)]
fn address<P: PacketBytes + ?Sized>(
    pkt: &P,
    l2_len: usize,
    v4_offset: usize,
    v6_offset: usize,
) -> Result<Destination, ParseError> {
    let expected_version = if l2_len >= 2 {
        let ethertype = pkt.read::<2>(l2_len - 2).ok_or(ParseError::Truncated)?;
        match u16::from_be_bytes(ethertype) {
            ETHERTYPE_IPV4 => Some(4),
            ETHERTYPE_IPV6 => Some(6),
            _ => return Err(ParseError::NotIp),
        }
    } else {
        None
    };

    let [first] = pkt.read::<1>(l2_len).ok_or(ParseError::Truncated)?;
    let version = first >> 4;
    if let Some(expected) = expected_version
        && expected != version
    {
        return Err(ParseError::VersionMismatch);
    }
    let available = pkt.packet_len().saturating_sub(l2_len);
    match version {
        4 => {
            let header_len = usize::from(first & 0x0f) * 4;
            if header_len < IPV4_MIN_HDR_LEN {
                return Err(ParseError::BadIhl);
            }
            if available < header_len {
                return Err(ParseError::Truncated);
            }
            let dst = pkt
                .read::<4>(l2_len.saturating_add(v4_offset))
                .ok_or(ParseError::Truncated)?;
            Ok(Destination::V4(dst))
        }
        6 => {
            if available < IPV6_HDR_LEN {
                return Err(ParseError::Truncated);
            }
            let dst = pkt
                .read::<16>(l2_len.saturating_add(v6_offset))
                .ok_or(ParseError::Truncated)?;
            Ok(Destination::V6(dst))
        }
        _ => Err(ParseError::NotIp),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4(dst: [u8; 4], ihl_words: u8, len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[0] = 0x40 | ihl_words;
        p[16..20].copy_from_slice(&dst);
        p
    }

    fn ipv6(dst: [u8; 16], len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[0] = 0x60;
        p[24..40].copy_from_slice(&dst);
        p
    }

    fn ethernet(ethertype: u16, ip: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(ip);
        f
    }

    #[test]
    fn ipv4_destination_on_tun_and_behind_ethernet() {
        let pkt = ipv4([10, 244, 1, 11], 5, 20);
        assert_eq!(
            destination(pkt.as_slice(), 0),
            Ok(Destination::V4([10, 244, 1, 11]))
        );
        let frame = ethernet(ETHERTYPE_IPV4, &pkt);
        assert_eq!(
            destination(frame.as_slice(), 14),
            Ok(Destination::V4([10, 244, 1, 11]))
        );
    }

    #[test]
    fn ipv4_with_options_needs_the_whole_header() {
        let mut pkt = ipv4([10, 96, 0, 100], 6, 24);
        assert_eq!(
            destination(pkt.as_slice(), 0),
            Ok(Destination::V4([10, 96, 0, 100]))
        );
        pkt.truncate(23);
        assert_eq!(destination(pkt.as_slice(), 0), Err(ParseError::Truncated));
    }

    #[test]
    fn sources_of_ipv4_and_ipv6() {
        let mut v4 = ipv4([10, 244, 1, 11], 5, 20);
        v4[12..16].copy_from_slice(&[8, 8, 8, 8]);
        assert_eq!(source(v4.as_slice(), 0), Ok(Source::V4([8, 8, 8, 8])));
        let frame = ethernet(ETHERTYPE_IPV4, &v4);
        assert_eq!(source(frame.as_slice(), 14), Ok(Source::V4([8, 8, 8, 8])));
        v4.truncate(19);
        assert_eq!(source(v4.as_slice(), 0), Err(ParseError::Truncated));

        let src = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let mut v6 = ipv6([0xfd; 16], 40);
        v6[8..24].copy_from_slice(&src);
        assert_eq!(source(v6.as_slice(), 0), Ok(Source::V6(src)));
        assert_eq!(
            destination(v6.as_slice(), 0),
            Ok(Destination::V6([0xfd; 16]))
        );
        v6.truncate(39);
        assert_eq!(source(v6.as_slice(), 0), Err(ParseError::Truncated));
    }

    #[test]
    fn ipv6_destination() {
        let dst = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];
        let pkt = ipv6(dst, 40);
        assert_eq!(destination(pkt.as_slice(), 0), Ok(Destination::V6(dst)));
        let frame = ethernet(ETHERTYPE_IPV6, &pkt);
        assert_eq!(destination(frame.as_slice(), 14), Ok(Destination::V6(dst)));
    }

    #[test]
    fn truncated_and_garbage_packets_are_errors() {
        assert_eq!(destination([].as_slice(), 0), Err(ParseError::Truncated));
        assert_eq!(
            destination(ipv4([1, 2, 3, 4], 5, 20)[..19].as_ref(), 0),
            Err(ParseError::Truncated)
        );
        assert_eq!(
            destination(ipv6([1; 16], 40)[..39].as_ref(), 0),
            Err(ParseError::Truncated)
        );
        assert_eq!(
            destination(ipv4([1, 2, 3, 4], 4, 20).as_slice(), 0),
            Err(ParseError::BadIhl)
        );
        assert_eq!(
            destination([0x00u8; 40].as_slice(), 0),
            Err(ParseError::NotIp)
        );
        assert_eq!(
            destination([0xffu8; 40].as_slice(), 0),
            Err(ParseError::NotIp)
        );
        // Ethernet header cut short, ARP ethertype, version disagreeing with ethertype.
        assert_eq!(
            destination([0u8; 13].as_slice(), 14),
            Err(ParseError::Truncated)
        );
        assert_eq!(
            destination(ethernet(0x0806, &[0u8; 28]).as_slice(), 14),
            Err(ParseError::NotIp)
        );
        assert_eq!(
            destination(
                ethernet(ETHERTYPE_IPV6, &ipv4([1, 2, 3, 4], 5, 40)).as_slice(),
                14
            ),
            Err(ParseError::VersionMismatch)
        );
    }

    #[test]
    fn no_input_panics() {
        // Every prefix of a few packets and every first byte: the parser must return,
        // never panic or read out of range.
        let samples = [
            ipv4([10, 0, 0, 1], 15, 60),
            ipv6([2; 16], 60),
            ethernet(ETHERTYPE_IPV4, &ipv4([10, 0, 0, 1], 5, 20)),
        ];
        for sample in &samples {
            for len in 0..=sample.len() {
                for l2 in [0usize, 1, 14, 1000, usize::MAX] {
                    let _ = destination(&sample[..len], l2);
                    let _ = source(&sample[..len], l2);
                }
            }
        }
        for first in 0..=u8::MAX {
            let mut p = [0u8; 60];
            p[0] = first;
            let _ = destination(p.as_slice(), 0);
        }
    }
}
