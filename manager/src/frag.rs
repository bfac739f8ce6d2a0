//! Reassembly of IPv4 and IPv6 fragments from the laptop, and fragmentation
//! of packets the manager builds for the laptop.
//!
//! Why fragments reach the manager at all: the laptop's kernel fragments a
//! UDP datagram (or an ICMP echo) larger than the TUN MTU before it enters
//! the TUN device (`ip_fragment`, `ip6_fragment`), e.g. a 20000-byte datagram
//! over the default 9000-byte TUN. UDP and ICMP never pass through smoltcp
//! (see [`crate::engine`]), so smoltcp's own reassembly (`proto-ipv4-
//! fragmentation`) would not see them; its assembler is also private and
//! sized by crate features for the whole build. This module is the
//! manager's own, bounded like the Linux one:
//! - at most [`MAX_REASSEMBLIES`] datagrams in progress and
//!   [`MAX_BUFFERED_BYTES`] fragment bytes buffered per session (Linux:
//!   `net.ipv4.ipfrag_high_thresh` = 4 MiB per netns); the oldest datagram
//!   in progress is discarded to make room;
//! - a datagram not complete [`REASSEMBLY_TIMEOUT_V4`] / [`REASSEMBLY_TIMEOUT_V6`]
//!   after its first fragment is discarded (Linux `ipfrag_time` 30 s, RFC 8200
//!   §4.5 60 s) and, if its first fragment had arrived, reported so the engine
//!   can answer ICMP "fragment reassembly time exceeded" (RFC 792, RFC 4443
//!   §3.3);
//! - overlapping fragments discard the whole datagram (RFC 5722 for IPv6;
//!   Linux does the same for IPv4); exact duplicates are ignored;
//! - a datagram longer than 65535 bytes is discarded (the "ping of death").
//!
//! Pure: no I/O, no clock (times come in as arguments). Parsing uses
//! `smoltcp::wire`'s checked readers and never panics on any input.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use smoltcp::wire::{IpProtocol, Ipv4Packet, Ipv6ExtHeader, Ipv6FragmentHeader, Ipv6Packet};

/// Most datagrams in reassembly at once, per session.
pub const MAX_REASSEMBLIES: usize = 64;

/// Most bytes buffered at once, per session (Linux's default
/// `ipfrag_high_thresh`). Each fragment is charged its payload plus
/// [`FRAGMENT_OVERHEAD`], so tiny fragments cannot pin more memory than this
/// suggests.
pub const MAX_BUFFERED_BYTES: usize = 4 * 1024 * 1024;

/// Bytes charged per buffered fragment on top of its payload (bookkeeping and
/// allocator overhead; Linux charges an skb's truesize, several hundred bytes).
pub const FRAGMENT_OVERHEAD: usize = 256;

/// Most fragments of one datagram: 65535 bytes in 64-byte fragments. Bounds
/// the overlap check, which is linear in the fragments held.
pub const MAX_FRAGMENTS_PER_DATAGRAM: usize = 1024;

/// IPv4 datagrams incomplete this long after their first fragment are
/// discarded (Linux `net.ipv4.ipfrag_time`).
pub const REASSEMBLY_TIMEOUT_V4: Duration = Duration::from_secs(30);

/// IPv6 datagrams incomplete this long are discarded (RFC 8200 §4.5; Linux
/// `net.ipv6.ip6frag_time`).
pub const REASSEMBLY_TIMEOUT_V6: Duration = Duration::from_secs(60);

/// Largest IP datagram (IPv4 total length; IPv6 header plus payload length).
const MAX_DATAGRAM: usize = 65_535;

const IPV6_HEADER_LEN: usize = 40;
const IPV6_FRAG_HEADER_LEN: usize = 8;

/// What became of one packet handed to [`Reassembler::push`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reassembly {
    /// Not a fragment: handle the packet as it is.
    Whole,
    /// A fragment, buffered; the datagram is not complete yet.
    Pending,
    /// This fragment completed a datagram: the reassembled packet, without
    /// fragmentation fields (IPv4) or Fragment header (IPv6).
    Complete(Vec<u8>),
    /// The fragment (and possibly its datagram) was discarded.
    Dropped(FragDrop),
}

/// Why a fragment was discarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FragDrop {
    /// Not parseable, or fields that contradict each other (a non-last
    /// fragment whose length is not a multiple of 8, a length beyond the end
    /// the last fragment announced, a datagram over 65535 bytes, more than
    /// [`MAX_FRAGMENTS_PER_DATAGRAM`] fragments).
    Malformed,
    /// It overlaps another fragment of its datagram with different bounds:
    /// the whole datagram is discarded (RFC 5722).
    Overlap,
    /// IPv6 extension headers before the Fragment header (not supported).
    Unsupported,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    V4 {
        src: Ipv4Addr,
        dst: Ipv4Addr,
        protocol: u8,
        ident: u16,
    },
    V6 {
        src: Ipv6Addr,
        dst: Ipv6Addr,
        ident: u32,
    },
}

/// One fragment, parsed.
struct Fragment<'a> {
    key: Key,
    /// Offset of `data` in the datagram's payload, bytes.
    offset: usize,
    more: bool,
    data: &'a [u8],
    /// For the first fragment: the header of the reassembled packet (IPv4:
    /// this fragment's header; IPv6: the fixed header with the Fragment
    /// header's next header), payload length not yet set.
    head: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Datagram {
    head: Option<Vec<u8>>,
    /// (offset, data), disjoint.
    pieces: Vec<(usize, Vec<u8>)>,
    /// Payload length, once the last fragment arrived.
    total: Option<usize>,
    /// Payload bytes held.
    bytes: usize,
    /// Bytes charged against [`MAX_BUFFERED_BYTES`].
    cost: usize,
    started: Instant,
    expires: Instant,
}

/// A datagram given up after its reassembly timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// The first fragment's IP header followed by up to 8 bytes of its
    /// payload (to quote in ICMP time exceeded), if it had arrived.
    pub first: Option<Vec<u8>>,
}

/// Reassembly state of one session. See the module documentation.
#[derive(Debug, Default)]
pub struct Reassembler {
    datagrams: HashMap<Key, Datagram>,
    cost: usize,
}

impl Reassembler {
    /// Datagrams in progress.
    pub fn in_progress(&self) -> usize {
        self.datagrams.len()
    }

    /// Bytes charged for buffered fragments (payload plus
    /// [`FRAGMENT_OVERHEAD`] each).
    pub fn buffered_bytes(&self) -> usize {
        self.cost
    }

    /// Handle one packet from the laptop. Never panics.
    pub fn push(&mut self, buf: &[u8], now: Instant) -> Reassembly {
        let frag = match parse_fragment(buf) {
            Ok(Some(f)) => f,
            Ok(None) => return Reassembly::Whole,
            Err(e) => return Reassembly::Dropped(e),
        };
        // An IPv6 "atomic fragment" (offset 0, no more) is a whole packet
        // (RFC 6946): rebuild it without the Fragment header.
        if frag.offset == 0 && !frag.more {
            return match frag.head {
                Some(head) => build(head, &[(0, frag.data.to_vec())], frag.data.len()).map_or(
                    Reassembly::Dropped(FragDrop::Malformed),
                    Reassembly::Complete,
                ),
                None => Reassembly::Dropped(FragDrop::Malformed),
            };
        }
        let end = frag.offset + frag.data.len();
        // IPv4's total length counts the header (at least 20 bytes); IPv6's
        // payload length does not.
        let limit = match frag.key {
            Key::V4 { .. } => MAX_DATAGRAM - frag.head.as_ref().map_or(20, Vec::len),
            Key::V6 { .. } => MAX_DATAGRAM,
        };
        let too_many = self
            .datagrams
            .get(&frag.key)
            .is_some_and(|d| d.pieces.len() >= MAX_FRAGMENTS_PER_DATAGRAM);
        if (frag.more && frag.data.len() % 8 != 0) || end > limit || too_many {
            self.discard(frag.key);
            return Reassembly::Dropped(FragDrop::Malformed);
        }
        if frag.data.is_empty() && frag.more {
            return Reassembly::Dropped(FragDrop::Malformed);
        }
        let cost = frag.data.len() + FRAGMENT_OVERHEAD;
        // Make room before buffering.
        if !self.datagrams.contains_key(&frag.key) {
            while self.datagrams.len() >= MAX_REASSEMBLIES {
                self.evict_oldest();
            }
        }
        while self.cost + cost > MAX_BUFFERED_BYTES && !self.datagrams.is_empty() {
            self.evict_oldest();
        }
        let timeout = match frag.key {
            Key::V4 { .. } => REASSEMBLY_TIMEOUT_V4,
            Key::V6 { .. } => REASSEMBLY_TIMEOUT_V6,
        };
        let d = self.datagrams.entry(frag.key).or_insert_with(|| Datagram {
            head: None,
            pieces: Vec::new(),
            total: None,
            bytes: 0,
            cost: 0,
            started: now,
            expires: now + timeout,
        });
        // Consistency of the announced end.
        let bad_end = match d.total {
            Some(total) => end > total || (!frag.more && end != total),
            None => !frag.more && d.pieces.iter().any(|(o, p)| o + p.len() > end),
        };
        if bad_end {
            self.discard(frag.key);
            return Reassembly::Dropped(FragDrop::Malformed);
        }
        // Duplicates are ignored; any other overlap discards the datagram.
        let mut duplicate = false;
        for (o, p) in &d.pieces {
            let (s, e) = (*o, o + p.len());
            if frag.offset < e && s < end {
                if s == frag.offset && e == end && p[..] == *frag.data {
                    duplicate = true;
                } else {
                    self.discard(frag.key);
                    return Reassembly::Dropped(FragDrop::Overlap);
                }
            }
        }
        if duplicate {
            return Reassembly::Pending;
        }
        if !frag.more {
            d.total = Some(end);
        }
        if frag.head.is_some() {
            d.head = frag.head;
        }
        d.pieces.push((frag.offset, frag.data.to_vec()));
        d.bytes += frag.data.len();
        d.cost += cost;
        self.cost += cost;
        let complete = match (d.total, &d.head) {
            (Some(total), Some(_)) => d.bytes == total,
            _ => false,
        };
        if !complete {
            return Reassembly::Pending;
        }
        let Some(mut d) = self.datagrams.remove(&frag.key) else {
            return Reassembly::Pending;
        };
        self.cost -= d.cost;
        d.pieces.sort_by_key(|(o, _)| *o);
        match (d.head, d.total) {
            (Some(head), Some(total)) => build(head, &d.pieces, total).map_or(
                Reassembly::Dropped(FragDrop::Malformed),
                Reassembly::Complete,
            ),
            _ => Reassembly::Dropped(FragDrop::Malformed),
        }
    }

    /// When the oldest datagram in progress expires, if any.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.datagrams.values().map(|d| d.expires).min()
    }

    /// Discard datagrams whose reassembly timed out.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<Expired> {
        let keys: Vec<Key> = self
            .datagrams
            .iter()
            .filter(|(_, d)| d.expires <= now)
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::new();
        for key in keys {
            let Some(d) = self.datagrams.remove(&key) else {
                continue;
            };
            self.cost -= d.cost;
            let first = d.head.map(|mut head| {
                if let Some((_, data)) = d.pieces.iter().find(|(o, _)| *o == 0) {
                    head.extend_from_slice(&data[..data.len().min(8)]);
                }
                head
            });
            out.push(Expired { first });
        }
        out
    }

    fn discard(&mut self, key: Key) {
        if let Some(d) = self.datagrams.remove(&key) {
            self.cost -= d.cost;
        }
    }

    fn evict_oldest(&mut self) {
        let oldest = self
            .datagrams
            .iter()
            .min_by_key(|(_, d)| d.started)
            .map(|(k, _)| *k);
        if let Some(k) = oldest {
            self.discard(k);
        }
    }
}

/// `Ok(None)`: not a fragment (or not parseable as IP at all: the caller's
/// parser reports that).
fn parse_fragment(buf: &[u8]) -> Result<Option<Fragment<'_>>, FragDrop> {
    match buf.first().map(|b| b >> 4) {
        Some(4) => {
            let Ok(pkt) = Ipv4Packet::new_checked(buf) else {
                return Ok(None);
            };
            if !pkt.more_frags() && pkt.frag_offset() == 0 {
                return Ok(None);
            }
            let header_len = usize::from(pkt.header_len());
            let key = Key::V4 {
                src: pkt.src_addr(),
                dst: pkt.dst_addr(),
                protocol: u8::from(pkt.next_header()),
                ident: pkt.ident(),
            };
            let offset = usize::from(pkt.frag_offset());
            let head = (offset == 0).then(|| buf[..header_len].to_vec());
            Ok(Some(Fragment {
                key,
                offset,
                more: pkt.more_frags(),
                data: pkt.payload(),
                head,
            }))
        }
        Some(6) => {
            let Ok(pkt) = Ipv6Packet::new_checked(buf) else {
                return Ok(None);
            };
            match pkt.next_header() {
                IpProtocol::Ipv6Frag => {}
                IpProtocol::HopByHop | IpProtocol::Ipv6Route | IpProtocol::Ipv6Opts => {
                    return Err(FragDrop::Unsupported);
                }
                _ => return Ok(None),
            }
            let payload: &[u8] = pkt.payload();
            let ext = Ipv6ExtHeader::new_checked(payload).map_err(|_| FragDrop::Malformed)?;
            let fh =
                Ipv6FragmentHeader::new_checked(ext.payload()).map_err(|_| FragDrop::Malformed)?;
            let data = payload
                .get(IPV6_FRAG_HEADER_LEN..)
                .ok_or(FragDrop::Malformed)?;
            let offset = usize::from(fh.frag_offset()) * 8;
            let head = (offset == 0).then(|| {
                let mut h = buf[..IPV6_HEADER_LEN].to_vec();
                h[6] = u8::from(ext.next_header());
                h
            });
            Ok(Some(Fragment {
                key: Key::V6 {
                    src: pkt.src_addr(),
                    dst: pkt.dst_addr(),
                    ident: fh.ident(),
                },
                offset,
                more: fh.more_frags(),
                data,
                head,
            }))
        }
        _ => Ok(None),
    }
}

/// The reassembled packet: `head` with its length fields set, then the
/// contiguous `pieces` (sorted, disjoint, covering `0..total`).
fn build(head: Vec<u8>, pieces: &[(usize, Vec<u8>)], total: usize) -> Option<Vec<u8>> {
    let mut out = head;
    let header_len = out.len();
    out.reserve(total);
    for (offset, data) in pieces {
        if *offset != out.len() - header_len {
            return None;
        }
        out.extend_from_slice(data);
    }
    if out.len() - header_len != total {
        return None;
    }
    match out.first().map(|b| b >> 4) {
        Some(4) => {
            let len = u16::try_from(out.len()).ok()?;
            let mut pkt = Ipv4Packet::new_unchecked(&mut out[..]);
            pkt.set_total_len(len);
            pkt.set_more_frags(false);
            pkt.set_frag_offset(0);
            pkt.fill_checksum();
        }
        Some(6) => {
            let len = u16::try_from(total).ok()?;
            Ipv6Packet::new_unchecked(&mut out[..]).set_payload_len(len);
        }
        _ => return None,
    }
    Some(out)
}

/// Split `packet` (a whole IPv4 or IPv6 packet the manager built) into
/// fragments of at most `mtu` bytes each, as the sending host would
/// (`ip_fragment` / `ip6_fragment`): IPv4 fragments carry `ident` (its low
/// 16 bits) in the header, IPv6 ones a Fragment header with `ident`. A packet within `mtu` is
/// returned as it is; so is anything that is not an IPv4/IPv6 packet or an
/// `mtu` too small to carry 8 payload bytes per fragment.
pub fn fragment(packet: Vec<u8>, mtu: usize, ident: u32) -> Vec<Vec<u8>> {
    if packet.len() <= mtu {
        return vec![packet];
    }
    match packet.first().map(|b| b >> 4) {
        Some(4) => fragment_v4(packet, mtu, ident as u16),
        Some(6) => fragment_v6(packet, mtu, ident),
        _ => vec![packet],
    }
}

fn fragment_v4(packet: Vec<u8>, mtu: usize, ident: u16) -> Vec<Vec<u8>> {
    let Ok(pkt) = Ipv4Packet::new_checked(&packet[..]) else {
        return vec![packet];
    };
    let header_len = usize::from(pkt.header_len());
    let payload: &[u8] = pkt.payload();
    let per = (mtu.saturating_sub(header_len)) & !7;
    if per == 0 {
        return vec![packet];
    }
    payload
        .chunks(per)
        .enumerate()
        .map(|(i, chunk)| {
            let mut out = Vec::with_capacity(header_len + chunk.len());
            out.extend_from_slice(&packet[..header_len]);
            out.extend_from_slice(chunk);
            let offset = i * per;
            let more = offset + chunk.len() < payload.len();
            let mut f = Ipv4Packet::new_unchecked(&mut out[..]);
            // Both fit: the packet was at most 65535 bytes.
            f.set_total_len((header_len + chunk.len()) as u16);
            f.set_ident(ident);
            // The manager is this packet's source host, so it may fragment
            // it even though smoltcp's emitter sets DF.
            f.set_dont_frag(false);
            f.set_more_frags(more);
            f.set_frag_offset(offset as u16);
            f.fill_checksum();
            out
        })
        .collect()
}

fn fragment_v6(packet: Vec<u8>, mtu: usize, ident: u32) -> Vec<Vec<u8>> {
    let Ok(pkt) = Ipv6Packet::new_checked(&packet[..]) else {
        return vec![packet];
    };
    let next = u8::from(pkt.next_header());
    let payload: &[u8] = pkt.payload();
    let per = mtu.saturating_sub(IPV6_HEADER_LEN + IPV6_FRAG_HEADER_LEN) & !7;
    if per == 0 {
        return vec![packet];
    }
    payload
        .chunks(per)
        .enumerate()
        .map(|(i, chunk)| {
            let offset = i * per;
            let more = offset + chunk.len() < payload.len();
            let mut out = Vec::with_capacity(IPV6_HEADER_LEN + IPV6_FRAG_HEADER_LEN + chunk.len());
            out.extend_from_slice(&packet[..IPV6_HEADER_LEN]);
            out[6] = u8::from(IpProtocol::Ipv6Frag);
            // Payload length: fragment header plus chunk, at most the mtu.
            let len = (IPV6_FRAG_HEADER_LEN + chunk.len()) as u16;
            out[4..6].copy_from_slice(&len.to_be_bytes());
            let off_m = ((offset / 8) as u16) << 3 | u16::from(more);
            out.push(next);
            out.push(0);
            out.extend_from_slice(&off_m.to_be_bytes());
            out.extend_from_slice(&ident.to_be_bytes());
            out.extend_from_slice(chunk);
            out
        })
        .collect()
}

/// Whether `buf` is an IPv4 packet with DF set (or any IPv6 packet, which
/// routers never fragment), i.e. one a too-small link must refuse with ICMP
/// instead of fragmenting.
pub fn must_not_fragment(buf: &[u8]) -> bool {
    match buf.first().map(|b| b >> 4) {
        Some(4) => Ipv4Packet::new_checked(buf).is_ok_and(|p| p.dont_frag()),
        Some(6) => true,
        _ => false,
    }
}

/// Source address of an IPv4/IPv6 packet, if it has a whole header.
pub fn source(buf: &[u8]) -> Option<IpAddr> {
    match buf.first().map(|b| b >> 4) {
        Some(4) => Ipv4Packet::new_checked(buf)
            .ok()
            .map(|p| IpAddr::V4(p.src_addr())),
        Some(6) => Ipv6Packet::new_checked(buf)
            .ok()
            .map(|p| IpAddr::V6(p.src_addr())),
        _ => None,
    }
}

#[cfg(test)]
#[path = "frag_tests.rs"]
mod tests;
