//! TCP segmentation offload in software (pure, no I/O): cut a TCP
//! super-packet into MSS-sized packets, and complete a partial checksum.
//!
//! A TUN device opened with `IFF_VNET_HDR` and `TUNSETOFFLOAD TUN_F_CSUM |
//! TUN_F_TSO4 | TUN_F_TSO6` (drivers/net/tun.c) hands the laptop's TCP
//! segments to the reader before the kernel segmented them: one read is one
//! *super-packet* of up to 64 KiB, IP and TCP headers once, then the payload of
//! several segments, described by a `virtio_net_hdr`
//! (include/uapi/linux/virtio_net.h): `gso_type` (TCPv4 / TCPv6, plus the ECN
//! bit), `gso_size` (the MSS: payload bytes per segment) and, for every packet
//! with `VIRTIO_NET_HDR_F_NEEDS_CSUM`, `csum_start`/`csum_offset` (the L4
//! checksum is left partial: only the pseudo-header sum is in place).
//!
//! [`segment_tcp`] does what the kernel's `tcp_gso_segment`
//! (net/ipv4/tcp_offload.c) and `inet_gso_segment` / `ipv6_gso_segment` do:
//! each segment gets the headers with its sequence number (advanced by
//! `gso_size` per segment), IPv4 total length / IPv6 payload length of its own
//! size, an IPv4 identification incremented per segment, FIN and PSH only on
//! the last segment, CWR only on the first, and full IPv4 header and TCP
//! checksums. [`complete_checksum`] finishes a `NEEDS_CSUM` packet that is not
//! a super-packet (`skb_checksum_help`, net/core/dev.c).
//!
//! Both read only validated offsets and never panic on any input: malformed
//! packets are a typed [`GsoError`].

use std::ops::Range;

/// `virtio_net_hdr.flags` bit: the L4 checksum is partial, complete it from
/// `csum_start` and store it at `csum_start + csum_offset`.
pub const F_NEEDS_CSUM: u8 = 1;

/// `virtio_net_hdr.gso_type`: not a super-packet.
pub const GSO_NONE: u8 = 0;
/// `virtio_net_hdr.gso_type`: a TCP over IPv4 super-packet.
pub const GSO_TCPV4: u8 = 1;
/// `virtio_net_hdr.gso_type`: a TCP over IPv6 super-packet.
pub const GSO_TCPV6: u8 = 4;
/// `virtio_net_hdr.gso_type` bit: the super-packet carries CWR (ECN), which
/// goes on the first segment only.
pub const GSO_ECN: u8 = 0x80;

/// Most segments one super-packet may be cut into. A 64 KiB super-packet at
/// the smallest MSS Linux sends (48 bytes of payload, `TCP_MIN_SND_MSS`) is
/// 1366 segments; the bound keeps the output of a hostile frame (1-byte
/// segments) at a few MiB instead of ~8 MiB.
pub const MAX_SEGMENTS: usize = 2048;

/// The kind of a super-packet (`gso_type` without the ECN bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GsoKind {
    /// TCP over IPv4 ([`GSO_TCPV4`]).
    TcpV4,
    /// TCP over IPv6 ([`GSO_TCPV6`]).
    TcpV6,
}

impl GsoKind {
    /// The kind of a `virtio_net_hdr.gso_type` (ECN bit ignored); `None` for
    /// [`GSO_NONE`] and for kinds this module does not segment (UDP_L4, ...).
    pub fn from_gso_type(gso_type: u8) -> Option<Self> {
        match gso_type & !GSO_ECN {
            GSO_TCPV4 => Some(GsoKind::TcpV4),
            GSO_TCPV6 => Some(GsoKind::TcpV6),
            _ => None,
        }
    }
}

/// Why a packet cannot be segmented or its checksum completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GsoError {
    /// The packet ends inside a header, or before the length its IP header
    /// declares.
    #[error("packet of {len} bytes truncated: need {need}")]
    Truncated {
        /// Bytes the headers or the IP length field need.
        need: usize,
        /// Bytes there are.
        len: usize,
    },
    /// The IP version nibble does not match the super-packet's kind.
    #[error("IP version {version} does not match GSO kind {kind:?}")]
    WrongVersion {
        /// The version nibble.
        version: u8,
        /// The kind from `gso_type`.
        kind: GsoKind,
    },
    /// A header length field is below its minimum (IPv4 IHL < 5, TCP data
    /// offset < 5).
    #[error("bad {what} header length {len} bytes")]
    BadHeaderLength {
        /// "IPv4" or "TCP".
        what: &'static str,
        /// The length the field says, bytes.
        len: usize,
    },
    /// The super-packet is not TCP right after the IP header (IPv6 extension
    /// headers are not segmented; the kernel's TCP does not send them).
    #[error("GSO super-packet carries IP protocol {0}, not TCP directly after the IP header")]
    NotTcp(u8),
    /// An IPv4 fragment cannot be a super-packet.
    #[error("GSO super-packet is an IPv4 fragment")]
    Fragment,
    /// `gso_size` is 0.
    #[error("GSO segment size is 0")]
    ZeroSegmentSize,
    /// A segment (headers + `gso_size`) would not fit the 16-bit IP length.
    #[error("GSO segment of {0} bytes exceeds the IP length field")]
    SegmentTooLarge(usize),
    /// More than [`MAX_SEGMENTS`] segments.
    #[error("GSO super-packet would make {0} segments (max {MAX_SEGMENTS})")]
    TooManySegments(usize),
    /// A `gso_type` that is not TCPv4/TCPv6 where a super-packet is expected.
    #[error("gso_type {0} is not a TCP super-packet")]
    NotTcpGso(u8),
    /// A super-packet whose checksum offload is not `NEEDS_CSUM` at the TCP
    /// checksum field.
    #[error(
        "super-packet checksum offload flags {flags:#x} at {start}+{offset}, want NEEDS_CSUM at the TCP checksum"
    )]
    ChecksumNotTcp {
        /// `virtio_net_hdr.flags`.
        flags: u8,
        /// `csum_start`, bytes.
        start: u16,
        /// `csum_offset`, bytes.
        offset: u16,
    },
    /// `csum_start`/`csum_offset` point outside the packet.
    #[error("checksum at {start}+{offset} lies outside the {len}-byte packet")]
    ChecksumOutOfRange {
        /// `csum_start`, bytes from the packet start.
        start: usize,
        /// `csum_offset`, bytes from `csum_start`.
        offset: usize,
        /// Packet length, bytes.
        len: usize,
    },
}

/// Where [`segment_tcp`] put the segments in its output buffer: `count`
/// segments, each after `headroom` bytes left for the caller (e.g. a frame
/// header), all of `full_len` bytes except the last (`last_len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segmented {
    /// Number of segments (at least 1).
    pub count: usize,
    /// Bytes before each segment left for the caller (zeroed).
    pub headroom: usize,
    /// Offset of the first segment's headroom in the output buffer.
    base: usize,
    /// Length of every segment but the last, bytes.
    full_len: usize,
    /// Length of the last segment, bytes.
    last_len: usize,
}

impl Segmented {
    /// The byte ranges of the segments in the output buffer (headroom not
    /// included: it is the `headroom` bytes before each range).
    pub fn spans(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.count).map(move |i| {
            let start = self.base + i * (self.headroom + self.full_len) + self.headroom;
            let len = if i + 1 == self.count {
                self.last_len
            } else {
                self.full_len
            };
            start..start + len
        })
    }

    /// Total bytes appended to the output buffer, headroom included.
    pub fn total_len(&self) -> usize {
        (self.count - 1) * (self.headroom + self.full_len) + self.headroom + self.last_len
    }
}

/// The IP and TCP header layout of a super-packet.
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// Bytes of the IP header (IPv4 with options, IPv6 fixed header).
    l4: usize,
    /// Bytes of IP + TCP headers.
    hdr_len: usize,
    /// End of the IP packet (its length field), bytes.
    end: usize,
    v4: bool,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn layout(packet: &[u8], kind: GsoKind) -> Result<Layout, GsoError> {
    let len = packet.len();
    let trunc = |need| GsoError::Truncated { need, len };
    let first = *packet.first().ok_or(trunc(1))?;
    let version = first >> 4;
    let (l4, end, protocol, v4) = match (kind, version) {
        (GsoKind::TcpV4, 4) => {
            if len < 20 {
                return Err(trunc(20));
            }
            let ihl = usize::from(first & 0x0f) * 4;
            if ihl < 20 {
                return Err(GsoError::BadHeaderLength {
                    what: "IPv4",
                    len: ihl,
                });
            }
            let total = usize::from(be16(packet, 2));
            if total > len || ihl > len {
                return Err(trunc(total.max(ihl)));
            }
            // More fragments, or a fragment offset.
            if be16(packet, 6) & 0x3fff != 0 {
                return Err(GsoError::Fragment);
            }
            (ihl, total, packet[9], true)
        }
        (GsoKind::TcpV6, 6) => {
            if len < 40 {
                return Err(trunc(40));
            }
            let end = 40 + usize::from(be16(packet, 4));
            if end > len {
                return Err(trunc(end));
            }
            (40, end, packet[6], false)
        }
        (kind, version) => return Err(GsoError::WrongVersion { version, kind }),
    };
    if protocol != 6 {
        return Err(GsoError::NotTcp(protocol));
    }
    if end < l4 + 20 {
        return Err(trunc(l4 + 20));
    }
    let doff = usize::from(packet[l4 + 12] >> 4) * 4;
    if doff < 20 {
        return Err(GsoError::BadHeaderLength {
            what: "TCP",
            len: doff,
        });
    }
    let hdr_len = l4 + doff;
    if hdr_len > end {
        return Err(trunc(hdr_len));
    }
    Ok(Layout {
        l4,
        hdr_len,
        end,
        v4,
    })
}

/// Segment the TCP super-packet `packet` (an IPv4 or IPv6 packet as the TUN
/// read returned it, without the `virtio_net_hdr`) into packets of at most
/// `gso_size` payload bytes, appended to `out` back to back, each after
/// `headroom` zero bytes for the caller. Every segment carries complete IPv4
/// header and TCP checksums (the partial checksum in `packet` is ignored).
/// A packet without payload becomes one segment (its headers, checksummed).
///
/// Bytes after the length the IP header declares are ignored. On error
/// nothing is appended. Allocates only when `out` must grow.
pub fn segment_tcp(
    packet: &[u8],
    kind: GsoKind,
    gso_size: usize,
    out: &mut Vec<u8>,
    headroom: usize,
) -> Result<Segmented, GsoError> {
    let seg = Segmenter::new(packet, kind, gso_size)?;
    let base = out.len();
    out.reserve(seg.count * (headroom + seg.full_len));
    for i in 0..seg.count {
        out.resize(out.len() + headroom, 0);
        seg.write(i, out);
    }
    Ok(Segmented {
        count: seg.count,
        headroom,
        base,
        full_len: seg.full_len,
        last_len: seg.last_len(),
    })
}

/// A validated TCP super-packet, ready to be cut: [`Segmenter::write`]
/// appends one segment at a time wherever the caller wants it (the
/// manager writes each straight into a smoltcp receive buffer, so the
/// payload is copied once). What [`segment_tcp`] does, one segment at a time.
#[derive(Debug, Clone, Copy)]
pub struct Segmenter<'a> {
    packet: &'a [u8],
    l: Layout,
    gso_size: usize,
    count: usize,
    full_len: usize,
    seq0: u32,
    id0: u16,
    flags0: u8,
}

impl<'a> Segmenter<'a> {
    /// Check `packet` (as [`segment_tcp`] takes it) and count its segments.
    pub fn new(packet: &'a [u8], kind: GsoKind, gso_size: usize) -> Result<Self, GsoError> {
        let l = layout(packet, kind)?;
        if gso_size == 0 {
            return Err(GsoError::ZeroSegmentSize);
        }
        let full_len = l.hdr_len + gso_size;
        if full_len > usize::from(u16::MAX) {
            return Err(GsoError::SegmentTooLarge(full_len));
        }
        let count = (l.end - l.hdr_len).div_ceil(gso_size).max(1);
        if count > MAX_SEGMENTS {
            return Err(GsoError::TooManySegments(count));
        }
        Ok(Self {
            packet,
            l,
            gso_size,
            count,
            full_len,
            seq0: u32::from_be_bytes([
                packet[l.l4 + 4],
                packet[l.l4 + 5],
                packet[l.l4 + 6],
                packet[l.l4 + 7],
            ]),
            id0: if l.v4 { be16(packet, 4) } else { 0 },
            flags0: packet[l.l4 + 13],
        })
    }

    /// Number of segments (at least 1).
    pub fn count(&self) -> usize {
        self.count
    }

    fn last_len(&self) -> usize {
        let payload = self.l.end - self.l.hdr_len;
        self.l.hdr_len + (payload - (self.count - 1) * self.gso_size)
    }

    /// Append segment `i` (`0..count`; others append nothing) to `out`:
    /// its headers with complete checksums, then its payload.
    pub fn write(&self, i: usize, out: &mut Vec<u8>) {
        if i >= self.count {
            return;
        }
        let l = self.l;
        let payload = &self.packet[l.hdr_len..l.end];
        let chunk = payload
            .get(i * self.gso_size..)
            .map(|rest| &rest[..rest.len().min(self.gso_size)])
            .unwrap_or(&[]);
        let start = out.len();
        out.extend_from_slice(&self.packet[..l.hdr_len]);
        out.extend_from_slice(chunk);
        let seg = &mut out[start..];
        let seg_len = seg.len();
        // Lengths fit: seg_len <= full_len <= u16::MAX (checked in `new`).
        if l.v4 {
            seg[2..4].copy_from_slice(&(seg_len as u16).to_be_bytes());
            seg[4..6].copy_from_slice(&self.id0.wrapping_add(i as u16).to_be_bytes());
            seg[10..12].copy_from_slice(&[0, 0]);
            let c = !fold(sum(&seg[..l.l4], 0));
            seg[10..12].copy_from_slice(&c.to_be_bytes());
        } else {
            seg[4..6].copy_from_slice(&((seg_len - 40) as u16).to_be_bytes());
        }
        let t = l.l4;
        let seq = self.seq0.wrapping_add((i * self.gso_size) as u32);
        seg[t + 4..t + 8].copy_from_slice(&seq.to_be_bytes());
        let mut flags = self.flags0;
        if i + 1 < self.count {
            flags &= !(TCP_FIN | TCP_PSH);
        }
        if i > 0 {
            flags &= !TCP_CWR;
        }
        seg[t + 13] = flags;
        seg[t + 16..t + 18].copy_from_slice(&[0, 0]);
        let tcp_len = seg_len - t;
        let pseudo = pseudo_sum(&seg[..t], l.v4, tcp_len);
        let c = !fold(sum(&seg[t..], pseudo));
        seg[t + 16..t + 18].copy_from_slice(&c.to_be_bytes());
    }
}

/// What a [`Coalescer`] emits for each run of packets it merged: the
/// `virtio_net_hdr` fields of the super-packet it wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuperPacket {
    /// [`GSO_TCPV4`] or [`GSO_TCPV6`].
    pub gso_type: u8,
    /// IP + TCP header bytes (`virtio_net_hdr.hdr_len`).
    pub hdr_len: u16,
    /// Payload bytes of every segment but the last (the MSS).
    pub gso_size: u16,
    /// Offset of the TCP header (`csum_start`); the flags are always
    /// [`F_NEEDS_CSUM`] and `csum_offset` is 16 (the TCP checksum field).
    pub csum_start: u16,
    /// Packets merged (at least 2).
    pub segments: usize,
}

/// `csum_offset` of a TCP super-packet: the checksum field's place in the
/// TCP header (RFC 9293 §3.1).
pub const TCP_CSUM_OFFSET: u16 = 16;

/// Most flows a [`Coalescer`] keeps a super-packet open for at once; a
/// packet of one more flow closes the oldest. smoltcp sends one segment per
/// socket per pass, so the flows of one poll interleave. Not tuned by a
/// measurement: enough for the 1-8 stream bench rows, and the linear scan
/// per packet stays short.
pub const MAX_OPEN_FLOWS: usize = 16;

/// A TCP segment the coalescer may merge: offsets into its packet.
#[derive(Debug, Clone, Copy)]
struct Mergeable {
    v4: bool,
    l4: usize,
    hdr_len: usize,
    end: usize,
    seq: u32,
    flags: u8,
}

impl Mergeable {
    fn payload_len(&self) -> usize {
        self.end - self.hdr_len
    }
}

/// A run of packets being merged: `first`..`last` are indices into the
/// caller's packets, chained through [`Coalescer::next`].
#[derive(Debug, Clone, Copy)]
struct Run {
    first: usize,
    last: usize,
    count: usize,
    /// IP packet bytes so far (headers once, all payloads).
    len: usize,
    /// Still open: the last member was a full segment without PSH.
    open: bool,
}

/// One item of the output, in order: a packet sent alone, or a run.
#[derive(Debug, Clone, Copy)]
enum Item {
    Single(usize),
    Run(usize),
}

/// Generic receive offload for the manager's output (the reverse of
/// [`segment_tcp`]): merges consecutive TCP segments of one flow into one
/// super-packet that the laptop's kernel accepts from a TUN write with a
/// `virtio_net_hdr` (`virtio_net_hdr_to_skb`, include/linux/virtio_net.h,
/// called from `tun_get_user`, drivers/net/tun.c).
///
/// The merge rules follow the kernel's `tcp_gro_receive`
/// (net/ipv4/tcp_offload.c): same IP version and addresses, same TCP ports,
/// ack number, window, data offset and option bytes; the IP headers equal
/// apart from the lengths, the IPv4 identification and header checksum;
/// flags exactly ACK, with PSH allowed on the last segment; the sequence
/// numbers contiguous; every segment but the last of the same payload
/// length (`gso_size`), the last one no longer. No SYN, FIN, RST, URG, ECE,
/// CWR and no empty segments: those go alone. IPv4 fragments and IPv6
/// extension headers go alone. The IPv4 identification of a merged segment
/// must be the previous one's plus 1, unless both have DF set: an atomic
/// datagram's identification carries no meaning (RFC 6864 §4.1) and
/// segmenting gives the first one's plus the index ([`segment_tcp`]).
///
/// Packets of different flows may leave in another order than they came
/// (each run goes where its first packet was); a flow's own packets never
/// change order. Scratch space is kept between calls, so a steady flow does
/// not allocate.
#[derive(Debug, Default)]
pub struct Coalescer {
    info: Vec<Option<Mergeable>>,
    next: Vec<usize>,
    runs: Vec<Run>,
    items: Vec<Item>,
    /// Indices into `runs` of the runs still open, oldest first.
    open: Vec<usize>,
}

/// `next` link of the last member of a run.
const END: usize = usize::MAX;

/// What [`Coalescer::coalesce`] wrote: runs merged and packets in them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coalesced {
    /// Super-packets written.
    pub super_packets: usize,
    /// Packets merged into them.
    pub merged: usize,
}

impl Coalescer {
    /// Merge `packets` (IPv4/IPv6 packets with complete checksums, in the
    /// order they are to be sent) into super-packets of at most `max_len`
    /// IP bytes, appending to `out`:
    ///
    /// - a packet that goes alone: `single(out, packet)`;
    /// - a super-packet: `headroom` zero bytes, the IP packet (the first
    ///   segment's headers with the total length, the payloads of all), then
    ///   `finish(headroom bytes, &SuperPacket, super-packet bytes)` to fill
    ///   the headroom in. The TCP checksum field holds the pseudo-header sum
    ///   over the total length, not inverted, as `NEEDS_CSUM` wants it
    ///   (`tcp_v4_send_check` / `tcp_v6_send_check`); the IPv4 header
    ///   checksum is complete (the laptop's `ip_rcv` checks it).
    ///
    /// Never panics on any input: what cannot be parsed goes alone.
    pub fn coalesce<P: AsRef<[u8]>>(
        &mut self,
        packets: &[P],
        max_len: usize,
        out: &mut Vec<u8>,
        headroom: usize,
        mut single: impl FnMut(&mut Vec<u8>, &[u8]),
        mut finish: impl FnMut(&mut [u8], &SuperPacket, &[u8]),
    ) -> Coalesced {
        self.plan(packets, max_len);
        let mut done = Coalesced::default();
        for &item in &self.items {
            let run = match item {
                Item::Single(i) => {
                    single(out, packets[i].as_ref());
                    continue;
                }
                Item::Run(r) => self.runs[r],
            };
            let first = packets[run.first].as_ref();
            let Some(m) = self.info[run.first] else {
                // Cannot happen: runs start at mergeable packets.
                single(out, first);
                continue;
            };
            if run.count == 1 {
                single(out, first);
                continue;
            }
            let at = out.len();
            out.resize(at + headroom, 0);
            let ip = out.len();
            out.reserve(run.len);
            out.extend_from_slice(&first[..m.end]);
            let mut flags = m.flags;
            let mut i = self.next[run.first];
            while i != END {
                let p = packets[i].as_ref();
                if let Some(s) = self.info[i] {
                    out.extend_from_slice(&p[s.hdr_len..s.end]);
                    flags = s.flags;
                }
                i = self.next[i];
            }
            let sp = &mut out[ip..];
            let total = sp.len();
            // Fits: run.len <= max_len and the caller's bound is the IP
            // length limit or below (checked in `plan`).
            if m.v4 {
                sp[2..4].copy_from_slice(&(total as u16).to_be_bytes());
                sp[10..12].copy_from_slice(&[0, 0]);
                let c = !fold(sum(&sp[..m.l4], 0));
                sp[10..12].copy_from_slice(&c.to_be_bytes());
            } else {
                sp[4..6].copy_from_slice(&((total - 40) as u16).to_be_bytes());
            }
            sp[m.l4 + 13] = flags;
            let pseudo = fold(pseudo_sum(&sp[..m.l4], m.v4, total - m.l4));
            sp[m.l4 + 16..m.l4 + 18].copy_from_slice(&pseudo.to_be_bytes());
            let header = SuperPacket {
                gso_type: if m.v4 { GSO_TCPV4 } else { GSO_TCPV6 },
                hdr_len: m.hdr_len as u16,
                gso_size: m.payload_len() as u16,
                csum_start: m.l4 as u16,
                segments: run.count,
            };
            let (head, sp) = out[at..].split_at_mut(headroom);
            finish(head, &header, sp);
            done.super_packets += 1;
            done.merged += run.count;
        }
        done
    }

    /// Fill `items` (what to emit, in order) and `runs`.
    fn plan<P: AsRef<[u8]>>(&mut self, packets: &[P], max_len: usize) {
        let max_len = max_len.min(usize::from(u16::MAX));
        self.info.clear();
        self.next.clear();
        self.runs.clear();
        self.items.clear();
        self.open.clear();
        for (i, p) in packets.iter().enumerate() {
            let p = p.as_ref();
            let m = mergeable(p);
            self.info.push(m);
            self.next.push(END);
            // The open run of this packet's flow, if any.
            let found = self
                .open
                .iter()
                .position(|&r| same_flow(packets[self.runs[r].last].as_ref(), p));
            let Some(m) = m else {
                // Goes alone, after everything of its flow so far.
                if let Some(k) = found {
                    self.open.remove(k);
                }
                self.items.push(Item::Single(i));
                continue;
            };
            if let Some(k) = found {
                let r = self.open[k];
                let run = self.runs[r];
                let last = packets[run.last].as_ref();
                let joins = self.info[run.last].is_some_and(|l| {
                    let first_len = self.info[run.first].map_or(0, |f| f.payload_len());
                    run.open
                        && m.payload_len() <= first_len
                        && run.len + m.payload_len() <= max_len
                        && run.count < MAX_SEGMENTS
                        && m.seq == l.seq.wrapping_add(l.payload_len() as u32)
                        && headers_match(last, &l, p, &m)
                });
                if joins {
                    let first_len = self.info[run.first].map_or(0, |f| f.payload_len());
                    self.next[run.last] = i;
                    let run = &mut self.runs[r];
                    run.last = i;
                    run.count += 1;
                    run.len += m.payload_len();
                    run.open = m.flags & TCP_PSH == 0 && m.payload_len() == first_len;
                    continue;
                }
                self.open.remove(k);
            }
            if self.open.len() == MAX_OPEN_FLOWS {
                self.open.remove(0);
            }
            let r = self.runs.len();
            self.runs.push(Run {
                first: i,
                last: i,
                count: 1,
                len: m.end,
                open: m.flags & TCP_PSH == 0 && m.end <= max_len,
            });
            self.open.push(r);
            self.items.push(Item::Run(r));
        }
    }
}

/// The TCP segment in `p` when the coalescer may merge it (see
/// [`Coalescer`]); `None` for anything else, including what does not parse.
fn mergeable(p: &[u8]) -> Option<Mergeable> {
    let kind = match p.first()? >> 4 {
        4 => GsoKind::TcpV4,
        6 => GsoKind::TcpV6,
        _ => return None,
    };
    let l = layout(p, kind).ok()?;
    let flags = p[l.l4 + 13];
    if flags & !TCP_PSH != TCP_ACK || l.end <= l.hdr_len {
        return None;
    }
    Some(Mergeable {
        v4: l.v4,
        l4: l.l4,
        hdr_len: l.hdr_len,
        end: l.end,
        seq: u32::from_be_bytes([p[l.l4 + 4], p[l.l4 + 5], p[l.l4 + 6], p[l.l4 + 7]]),
        flags,
    })
}

/// Same IP version, addresses and TCP ports (for a `p` that may not parse:
/// false then).
fn same_flow(a: &[u8], b: &[u8]) -> bool {
    let (Some(ma), Some(mb)) = (flow_bytes(a), flow_bytes(b)) else {
        return false;
    };
    ma == mb
}

/// Addresses and ports of a TCP packet, for comparing flows.
fn flow_bytes(p: &[u8]) -> Option<(&[u8], &[u8])> {
    match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if *p.get(9)? != 6 || ihl < 20 {
                return None;
            }
            Some((p.get(12..20)?, p.get(ihl..ihl + 4)?))
        }
        6 => {
            if *p.get(6)? != 6 {
                return None;
            }
            Some((p.get(8..40)?, p.get(40..44)?))
        }
        _ => None,
    }
}

/// `b` may follow `a` in one super-packet: the headers agree on everything
/// segmentation copies from the first segment (see [`Coalescer`]).
fn headers_match(a: &[u8], ma: &Mergeable, b: &[u8], mb: &Mergeable) -> bool {
    if ma.v4 != mb.v4 || ma.l4 != mb.l4 || ma.hdr_len != mb.hdr_len {
        return false;
    }
    let ip_same = if ma.v4 {
        let df = be16(a, 6) & 0x4000 != 0 && be16(b, 6) & 0x4000 != 0;
        a[..2] == b[..2]
            && a[6..10] == b[6..10]
            && a[12..ma.l4] == b[12..mb.l4]
            && (df || be16(b, 4) == be16(a, 4).wrapping_add(1))
    } else {
        a[..4] == b[..4] && a[6..40] == b[6..40]
    };
    let (ta, tb) = (&a[ma.l4..ma.hdr_len], &b[mb.l4..mb.hdr_len]);
    ip_same
        && ta[..4] == tb[..4]
        && ta[8..13] == tb[8..13]
        && ta[14..16] == tb[14..16]
        && ta[18..] == tb[18..]
        // The earlier one has no PSH (else its run is closed), so the flags
        // differ at most in PSH on `b`.
        && ta[13] & !TCP_PSH == tb[13] & !TCP_PSH
}

/// Checks a super-packet before it is written to a TUN device with its
/// `virtio_net_hdr` (what `virtio_net_hdr_to_skb` and `tcp_gso_segment` will
/// rely on): TCP in the IP version `gso_type` says, `NEEDS_CSUM` at the TCP
/// checksum, a non-zero `gso_size` and at most [`MAX_SEGMENTS`] segments.
pub fn check_super_packet(
    packet: &[u8],
    flags: u8,
    gso_type: u8,
    gso_size: u16,
    csum_start: u16,
    csum_offset: u16,
) -> Result<GsoKind, GsoError> {
    super_packet_segments(packet, flags, gso_type, gso_size, csum_start, csum_offset)
        .map(|(kind, _)| kind)
}

/// [`check_super_packet`], also returning how many TCP segments the
/// super-packet carries (what the receiving stack takes from it).
pub fn super_packet_segments(
    packet: &[u8],
    flags: u8,
    gso_type: u8,
    gso_size: u16,
    csum_start: u16,
    csum_offset: u16,
) -> Result<(GsoKind, usize), GsoError> {
    let kind = GsoKind::from_gso_type(gso_type).ok_or(GsoError::NotTcpGso(gso_type))?;
    let l = layout(packet, kind)?;
    if gso_size == 0 {
        return Err(GsoError::ZeroSegmentSize);
    }
    if flags & F_NEEDS_CSUM == 0
        || usize::from(csum_start) != l.l4
        || csum_offset != TCP_CSUM_OFFSET
    {
        return Err(GsoError::ChecksumNotTcp {
            flags,
            start: csum_start,
            offset: csum_offset,
        });
    }
    let count = (l.end - l.hdr_len).div_ceil(usize::from(gso_size));
    if count > MAX_SEGMENTS {
        return Err(GsoError::TooManySegments(count));
    }
    Ok((kind, count.max(1)))
}

const TCP_FIN: u8 = 0x01;
const TCP_ACK: u8 = 0x10;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;

/// Complete the partial L4 checksum of a `NEEDS_CSUM` packet in place: the
/// one's-complement sum of `packet[csum_start..]` (the field holds the
/// pseudo-header sum already), stored at `csum_start + csum_offset`. A sum of
/// 0 is stored as 0xffff, which means the same to TCP and is the only valid
/// form for UDP (`skb_checksum_help`, net/core/dev.c).
pub fn complete_checksum(
    packet: &mut [u8],
    csum_start: usize,
    csum_offset: usize,
) -> Result<(), GsoError> {
    let len = packet.len();
    let at = csum_start.saturating_add(csum_offset);
    if csum_start > len || at.saturating_add(2) > len {
        return Err(GsoError::ChecksumOutOfRange {
            start: csum_start,
            offset: csum_offset,
            len,
        });
    }
    let c = !fold(sum(&packet[csum_start..], 0));
    let c = if c == 0 { 0xffff } else { c };
    packet[at..at + 2].copy_from_slice(&c.to_be_bytes());
    Ok(())
}

/// The pseudo-header sum (RFC 793 §3.1, RFC 8200 §8.1) of a TCP segment of
/// `tcp_len` bytes under the IP header `ip`.
fn pseudo_sum(ip: &[u8], v4: bool, tcp_len: usize) -> u64 {
    let addrs = if v4 { &ip[12..20] } else { &ip[8..40] };
    sum(addrs, 6 + tcp_len as u64)
}

/// One's-complement sum (RFC 1071) of `data` as big-endian 16-bit words
/// (an odd last byte padded with zero), added to `init`, not yet folded.
fn sum(data: &[u8], init: u64) -> u64 {
    let mut acc = init;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    let rest = words.remainder();
    let mut pairs = rest.chunks_exact(2);
    for p in &mut pairs {
        acc += u64::from(u16::from_be_bytes([p[0], p[1]]));
    }
    if let [b] = pairs.remainder() {
        acc += u64::from(*b) << 8;
    }
    acc
}

/// Fold a 64-bit one's-complement accumulator to 16 bits.
fn fold(mut acc: u64) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use smoltcp::wire::{IpAddress, Ipv4Packet, Ipv6Packet, TcpPacket};

    const SRC4: [u8; 4] = [100, 96, 0, 2];
    const DST4: [u8; 4] = [10, 244, 1, 20];
    const SRC6: [u8; 16] = [
        0xfd, 0x6b, 0x76, 0x70, 0x6e, 0, 0, 0, 0, 0, 0, 0, 100, 96, 0, 2,
    ];
    const DST6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20];

    /// A super-packet as the kernel hands it over with TSO: headers once, the
    /// TCP checksum partial (pseudo-header only), `flags` on the TCP header.
    fn super_packet(v6: bool, payload: &[u8], seq: u32, flags: u8, options: usize) -> Vec<u8> {
        let tcp_hdr = 20 + options;
        let mut tcp = vec![0u8; tcp_hdr];
        tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&7007u16.to_be_bytes());
        tcp[4..8].copy_from_slice(&seq.to_be_bytes());
        tcp[8..12].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        tcp[12] = ((tcp_hdr / 4) as u8) << 4;
        tcp[13] = flags;
        tcp[14..16].copy_from_slice(&512u16.to_be_bytes());
        for (i, b) in tcp[20..].iter_mut().enumerate() {
            *b = if i % 4 == 3 { 0 } else { 1 }; // NOPs and EOLs
        }
        tcp.extend_from_slice(payload);
        let mut p = if v6 {
            let mut ip = vec![0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(tcp.len() as u16).to_be_bytes());
            ip[6] = 6;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&SRC6);
            ip[24..40].copy_from_slice(&DST6);
            ip
        } else {
            let mut ip = vec![0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + tcp.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&0xfffeu16.to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = 6;
            ip[12..16].copy_from_slice(&SRC4);
            ip[16..20].copy_from_slice(&DST4);
            ip
        };
        let l4 = p.len();
        p.extend_from_slice(&tcp);
        // The partial checksum: the folded pseudo-header sum, not inverted.
        let partial = fold(pseudo_sum(&p[..l4], !v6, tcp.len()));
        p[l4 + 16..l4 + 18].copy_from_slice(&partial.to_be_bytes());
        p
    }

    fn body(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Checks every segment with smoltcp and returns (seq, flags, id, payload) of each.
    fn check(out: &[u8], seg: &Segmented, v6: bool) -> Vec<(u32, u8, u16, Vec<u8>)> {
        seg.spans()
            .map(|r| {
                let s = &out[r];
                if v6 {
                    let ip = Ipv6Packet::new_checked(s).expect("IPv6 segment");
                    assert_eq!(usize::from(ip.payload_len()) + 40, s.len());
                    let tcp = TcpPacket::new_checked(ip.payload()).expect("TCP");
                    let (src, dst) = (
                        IpAddress::Ipv6(ip.src_addr()),
                        IpAddress::Ipv6(ip.dst_addr()),
                    );
                    assert!(tcp.verify_checksum(&src, &dst), "TCP checksum (IPv6)");
                    (
                        tcp.seq_number().0 as u32,
                        s[40 + 13],
                        0,
                        tcp.payload().to_vec(),
                    )
                } else {
                    let ip = Ipv4Packet::new_checked(s).expect("IPv4 segment");
                    assert!(ip.verify_checksum(), "IPv4 header checksum");
                    assert_eq!(usize::from(ip.total_len()), s.len());
                    let tcp = TcpPacket::new_checked(ip.payload()).expect("TCP");
                    let (src, dst) = (
                        IpAddress::Ipv4(ip.src_addr()),
                        IpAddress::Ipv4(ip.dst_addr()),
                    );
                    assert!(tcp.verify_checksum(&src, &dst), "TCP checksum (IPv4)");
                    (
                        tcp.seq_number().0 as u32,
                        s[20 + 13],
                        ip.ident(),
                        tcp.payload().to_vec(),
                    )
                }
            })
            .collect()
    }

    #[test]
    fn ipv4_super_packet_becomes_mss_segments() {
        let data = body(10_000);
        // ACK|PSH|FIN|CWR on the super-packet.
        let p = super_packet(false, &data, 0xffff_f000, 0x10 | 0x08 | 0x01 | 0x80, 12);
        let mut out = vec![0xaa; 5]; // appended after what is there
        let seg = segment_tcp(&p, GsoKind::TcpV4, 1448, &mut out, 3).expect("segments");
        assert_eq!(seg.count, 7);
        assert_eq!(out.len(), 5 + seg.total_len());
        assert_eq!(&out[..5], &[0xaa; 5], "earlier bytes untouched");
        let got = check(&out, &seg, false);
        for (i, (seq, flags, id, payload)) in got.iter().enumerate() {
            assert_eq!(
                *seq,
                0xffff_f000u32.wrapping_add(i as u32 * 1448),
                "seq wraps"
            );
            assert_eq!(*id, 0xfffeu16.wrapping_add(i as u16), "IPv4 id increments");
            let last = i == 6;
            assert_eq!(flags & 0x09 != 0, last, "FIN/PSH only on the last");
            assert_eq!(flags & 0x80 != 0, i == 0, "CWR only on the first");
            assert_eq!(flags & 0x10, 0x10, "ACK on all");
            assert_eq!(payload.len(), if last { 10_000 - 6 * 1448 } else { 1448 });
        }
        let joined: Vec<u8> = got.into_iter().flat_map(|g| g.3).collect();
        assert_eq!(joined, data);
    }

    #[test]
    fn ipv6_super_packet_becomes_mss_segments() {
        let data = body(20_000);
        let p = super_packet(true, &data, 1, 0x18, 0);
        let mut out = Vec::new();
        let seg = segment_tcp(&p, GsoKind::TcpV6, 8940, &mut out, 0).expect("segments");
        assert_eq!(seg.count, 3);
        let got = check(&out, &seg, true);
        assert_eq!(got[0].0, 1);
        assert_eq!(got[2].0, 1 + 2 * 8940);
        assert_eq!(got[0].1 & 0x08, 0, "PSH cleared before the last");
        assert_eq!(got[2].1 & 0x08, 0x08);
        let joined: Vec<u8> = got.into_iter().flat_map(|g| g.3).collect();
        assert_eq!(joined, data);
    }

    #[test]
    fn complete_checksum_matches_smoltcp() {
        for v6 in [false, true] {
            for n in [0usize, 1, 7, 1000] {
                let mut p = super_packet(v6, &body(n), 42, 0x18, 4);
                let l4 = if v6 { 40 } else { 20 };
                complete_checksum(&mut p, l4, 16).expect("in range");
                let (src, dst, tcp) = if v6 {
                    let ip = Ipv6Packet::new_checked(&p[..]).expect("IPv6");
                    (
                        IpAddress::Ipv6(ip.src_addr()),
                        IpAddress::Ipv6(ip.dst_addr()),
                        &p[40..],
                    )
                } else {
                    let ip = Ipv4Packet::new_checked(&p[..]).expect("IPv4");
                    (
                        IpAddress::Ipv4(ip.src_addr()),
                        IpAddress::Ipv4(ip.dst_addr()),
                        &p[20..],
                    )
                };
                let tcp = TcpPacket::new_checked(tcp).expect("TCP");
                assert!(tcp.verify_checksum(&src, &dst), "v6={v6} n={n}");
            }
        }
        assert_eq!(
            complete_checksum(&mut [0u8; 10], 4, 5),
            Err(GsoError::ChecksumOutOfRange {
                start: 4,
                offset: 5,
                len: 10
            })
        );
        assert!(complete_checksum(&mut [0u8; 10], usize::MAX, usize::MAX).is_err());
    }

    #[test]
    fn malformed_super_packets_are_typed_errors() {
        let p = super_packet(false, &body(100), 1, 0x10, 0);
        let mut out = Vec::new();
        assert!(matches!(
            segment_tcp(&p, GsoKind::TcpV6, 10, &mut out, 0),
            Err(GsoError::WrongVersion { version: 4, .. })
        ));
        assert_eq!(
            segment_tcp(&p, GsoKind::TcpV4, 0, &mut out, 0),
            Err(GsoError::ZeroSegmentSize)
        );
        assert_eq!(
            segment_tcp(&p[..30], GsoKind::TcpV4, 10, &mut out, 0),
            Err(GsoError::Truncated { need: 140, len: 30 })
        );
        let mut udp = p.clone();
        udp[9] = 17;
        assert_eq!(
            segment_tcp(&udp, GsoKind::TcpV4, 10, &mut out, 0),
            Err(GsoError::NotTcp(17))
        );
        let mut frag = p.clone();
        frag[6] = 0x20; // MF
        assert_eq!(
            segment_tcp(&frag, GsoKind::TcpV4, 10, &mut out, 0),
            Err(GsoError::Fragment)
        );
        assert_eq!(
            segment_tcp(&p, GsoKind::TcpV4, 65535, &mut out, 0),
            Err(GsoError::SegmentTooLarge(65535 + 40))
        );
        let big = super_packet(false, &body(60_000), 1, 0x10, 0);
        assert_eq!(
            segment_tcp(&big, GsoKind::TcpV4, 1, &mut out, 0),
            Err(GsoError::TooManySegments(60_000))
        );
        assert!(out.is_empty(), "nothing appended on errors");
        // No payload: one segment, checksummed.
        let bare = super_packet(true, &[], 9, 0x11, 0);
        let seg = segment_tcp(&bare, GsoKind::TcpV6, 1000, &mut out, 0).expect("one");
        assert_eq!(seg.count, 1);
        assert_eq!(
            check(&out, &seg, true)[0].1,
            0x11,
            "FIN kept on the only segment"
        );
        assert_eq!(
            GsoKind::from_gso_type(GSO_TCPV4 | GSO_ECN),
            Some(GsoKind::TcpV4)
        );
        assert_eq!(
            GsoKind::from_gso_type(5),
            None,
            "UDP_L4 is not segmented here"
        );
    }

    /// A packet as smoltcp sends it: complete IPv4 header and TCP checksums,
    /// DF set on IPv4, `port` the laptop-side port (tells flows apart).
    fn tcp_packet(v6: bool, port: u16, seq: u32, flags: u8, payload: &[u8], id: u16) -> Vec<u8> {
        let mut p = super_packet(v6, payload, seq, flags, 12);
        let l4 = if v6 { 40 } else { 20 };
        p[l4..l4 + 2].copy_from_slice(&port.to_be_bytes());
        if !v6 {
            p[4..6].copy_from_slice(&id.to_be_bytes());
            p[10..12].copy_from_slice(&[0, 0]);
            let c = !fold(sum(&p[..20], 0));
            p[10..12].copy_from_slice(&c.to_be_bytes());
        }
        complete_checksum(&mut p, l4, 16).expect("in range");
        p
    }

    /// What the coalescer emitted, in order.
    #[derive(Debug)]
    enum Emitted {
        Single(Vec<u8>),
        Super(SuperPacket, Vec<u8>),
    }

    fn coalesce_all(packets: &[Vec<u8>], max_len: usize) -> (Vec<Emitted>, Coalesced) {
        let mut c = Coalescer::default();
        let mut out = Vec::new();
        let emitted = std::cell::RefCell::new(Vec::new());
        let done = c.coalesce(
            packets,
            max_len,
            &mut out,
            4,
            |_, p| emitted.borrow_mut().push(Emitted::Single(p.to_vec())),
            |head, sp, p| {
                assert_eq!(head, &[0; 4], "headroom is zeroed");
                assert!(p.len() <= max_len, "super-packet of {} bytes", p.len());
                emitted.borrow_mut().push(Emitted::Super(*sp, p.to_vec()));
            },
        );
        (emitted.into_inner(), done)
    }

    /// Segment the coalescer's output again, checking every super-packet's
    /// partial checksum and header the way the laptop's kernel relies on.
    fn resegment(emitted: &[Emitted]) -> Vec<Vec<u8>> {
        let mut all = Vec::new();
        for e in emitted {
            match e {
                Emitted::Single(p) => all.push(p.clone()),
                Emitted::Super(sp, p) => {
                    let kind = check_super_packet(
                        p,
                        F_NEEDS_CSUM,
                        sp.gso_type,
                        sp.gso_size,
                        sp.csum_start,
                        TCP_CSUM_OFFSET,
                    )
                    .expect("a valid super-packet");
                    let v4 = kind == GsoKind::TcpV4;
                    if v4 {
                        let ip = Ipv4Packet::new_checked(&p[..]).expect("IPv4");
                        assert!(ip.verify_checksum(), "super-packet IPv4 header checksum");
                    }
                    // The partial sum completes to a valid TCP checksum.
                    let mut full = p.clone();
                    complete_checksum(&mut full, usize::from(sp.csum_start), 16).expect("range");
                    let l4 = usize::from(sp.csum_start);
                    let tcp_len = full.len() - l4;
                    let pseudo = pseudo_sum(&full[..l4], v4, tcp_len);
                    assert_eq!(fold(sum(&full[l4..], pseudo)), 0xffff, "TCP checksum");
                    let mut out = Vec::new();
                    let seg = segment_tcp(p, kind, usize::from(sp.gso_size), &mut out, 0)
                        .expect("segments");
                    assert_eq!(seg.count, sp.segments);
                    all.extend(seg.spans().map(|r| out[r].to_vec()));
                }
            }
        }
        all
    }

    /// IPv4 identification and header checksum zeroed: the coalescer may
    /// renumber atomic datagrams (DF set, RFC 6864).
    fn without_ipv4_id(p: &[u8]) -> Vec<u8> {
        let mut p = p.to_vec();
        if p[0] >> 4 == 4 {
            p[4..6].copy_from_slice(&[0, 0]);
            p[10..12].copy_from_slice(&[0, 0]);
        }
        p
    }

    /// The packets of each flow (by laptop port), in order.
    fn by_flow(packets: &[Vec<u8>]) -> std::collections::BTreeMap<u16, Vec<Vec<u8>>> {
        let mut m = std::collections::BTreeMap::<u16, Vec<Vec<u8>>>::new();
        for p in packets {
            let l4 = if p[0] >> 4 == 4 { 20 } else { 40 };
            let port = u16::from_be_bytes([p[l4], p[l4 + 1]]);
            m.entry(port).or_default().push(without_ipv4_id(p));
        }
        m
    }

    const ACK: u8 = 0x10;
    const PSH: u8 = 0x08;

    /// `n` full segments of `mss` and a last one of `last` bytes with PSH.
    fn stream(v6: bool, port: u16, seq: u32, mss: usize, n: usize, last: usize) -> Vec<Vec<u8>> {
        let data = body(n * mss + last);
        data.chunks(mss)
            .enumerate()
            .map(|(i, chunk)| {
                let end = (i + 1) * mss >= data.len();
                let flags = if end { ACK | PSH } else { ACK };
                tcp_packet(
                    v6,
                    port,
                    seq.wrapping_add((i * mss) as u32),
                    flags,
                    chunk,
                    100 + i as u16,
                )
            })
            .collect()
    }

    #[test]
    fn one_flow_becomes_one_super_packet_and_segments_back_exactly() {
        for v6 in [false, true] {
            let packets = stream(v6, 40000, 0xffff_f000, 1448, 6, 500);
            let (emitted, done) = coalesce_all(&packets, 65_000);
            assert_eq!(
                done,
                Coalesced {
                    super_packets: 1,
                    merged: 7
                },
                "v6={v6}"
            );
            let Emitted::Super(sp, p) = &emitted[0] else {
                panic!("not merged: {emitted:?}");
            };
            assert_eq!(sp.gso_size, 1448);
            assert_eq!(sp.gso_type, if v6 { GSO_TCPV6 } else { GSO_TCPV4 });
            assert_eq!(usize::from(sp.hdr_len), if v6 { 40 } else { 20 } + 32);
            assert_eq!(p.len(), usize::from(sp.hdr_len) + 6 * 1448 + 500);
            // IDs were contiguous: the segments are the input, byte for byte.
            assert_eq!(resegment(&emitted), packets, "v6={v6}");
        }
    }

    #[test]
    fn interleaved_flows_are_merged_per_flow_in_order() {
        let a = stream(false, 40001, 1, 1000, 4, 10);
        let b = stream(false, 40002, 9, 1000, 4, 0);
        let c = stream(true, 40003, 5, 1000, 2, 7);
        let mut mixed = Vec::new();
        for i in 0..5 {
            for s in [&a, &b, &c] {
                if let Some(p) = s.get(i) {
                    mixed.push(p.clone());
                }
            }
        }
        let (emitted, done) = coalesce_all(&mixed, 65_000);
        assert_eq!(done.super_packets, 3);
        assert_eq!(done.merged, mixed.len());
        assert_eq!(by_flow(&resegment(&emitted)), by_flow(&mixed));
    }

    #[test]
    fn gaps_other_acks_psh_and_control_segments_split_runs() {
        let d = body(4000);
        let p = |seq: u32, flags: u8, len: usize, id: u16| {
            tcp_packet(false, 40000, seq, flags, &d[..len], id)
        };
        let mut other_ack = p(3000, ACK, 1000, 4);
        other_ack[20 + 8] ^= 1;
        // Fix the checksums after the edit.
        complete_checksum(&mut other_ack, 20, 16).expect("range");
        let packets = vec![
            p(1000, ACK, 1000, 1),
            p(2000, ACK | PSH, 1000, 2), // run 1 ends at PSH
            p(3000, ACK, 1000, 3),
            other_ack,                    // another ack number: run 2 ends
            p(5000, ACK, 1000, 5),        // a gap (4000 missing): run 3 starts
            p(6000, ACK, 500, 6),         // short: run 3 ends with it
            p(6500, ACK, 500, 7),         // starts run 4, alone
            p(6000, 0x01 | ACK, 1000, 8), // FIN
            p(7000, 0x04 | ACK, 0, 9),    // RST
            p(0, 0x02, 0, 10),            // SYN
        ];
        let (emitted, done) = coalesce_all(&packets, 65_000);
        let shape: Vec<usize> = emitted
            .iter()
            .map(|e| match e {
                Emitted::Single(_) => 1,
                Emitted::Super(sp, _) => sp.segments,
            })
            .collect();
        assert_eq!(shape, vec![2, 1, 1, 2, 1, 1, 1, 1], "{emitted:?}");
        assert_eq!(
            done,
            Coalesced {
                super_packets: 2,
                merged: 4
            }
        );
        // In order: nothing of the flow moved.
        assert_eq!(resegment(&emitted), packets);
    }

    #[test]
    fn super_packets_stay_within_the_length_bound() {
        let packets = stream(true, 40000, 77, 8940, 20, 100);
        let (emitted, done) = coalesce_all(&packets, MAX_LEN_FOR_TEST);
        assert!(done.super_packets >= 3, "{done:?}");
        assert_eq!(resegment(&emitted), packets);
        // Not TCP or not parseable: alone, never a panic.
        let odd = vec![vec![], vec![0x45], vec![0x60; 50], body(100)];
        let (emitted, done) = coalesce_all(&odd, MAX_LEN_FOR_TEST);
        assert_eq!(done, Coalesced::default());
        assert_eq!(emitted.len(), 4);
    }

    const MAX_LEN_FOR_TEST: usize = 65_524;

    proptest! {
        #[test]
        fn coalesce_then_segment_gives_each_flows_packets_back(
            plan in proptest::collection::vec((0u16..3, 0usize..3, any::<bool>(), 0u8..8), 0..60),
            v6 in any::<bool>(),
            max_len in 2000usize..65_524,
        ) {
            // Three flows; each step sends a full, short or empty segment,
            // sometimes PSH, sometimes with another flag.
            let d = body(1200);
            let mut seq = [1000u32, 2000, 3000];
            let mut packets = Vec::new();
            for (i, (flow, size, psh, extra)) in plan.into_iter().enumerate() {
                let len = [1200, 300, 0][size];
                let mut flags = ACK | if psh { PSH } else { 0 };
                if extra == 0 { flags |= 0x01 } // FIN
                if extra == 1 { flags = 0x04 } // RST
                let s = &mut seq[usize::from(flow)];
                packets.push(tcp_packet(v6, 40000 + flow, *s, flags, &d[..len], i as u16));
                *s = s.wrapping_add(len as u32);
            }
            let (emitted, _) = coalesce_all(&packets, max_len);
            prop_assert_eq!(by_flow(&resegment(&emitted)), by_flow(&packets));
        }

        #[test]
        fn coalescing_arbitrary_bytes_never_panics(
            packets in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..20),
        ) {
            let mut c = Coalescer::default();
            let mut out = Vec::new();
            let _ = c.coalesce(&packets, 65_000, &mut out, 3, |o, p| o.extend_from_slice(p), |_, _, _| {});
        }
    }

    proptest! {
        #[test]
        fn segments_reassemble_to_the_payload(
            v6 in any::<bool>(),
            n in 0usize..20_000,
            gso in 1usize..9000,
            seq in any::<u32>(),
            flags in any::<u8>(),
            opt_words in 0usize..10,
        ) {
            prop_assume!(n.div_ceil(gso) <= MAX_SEGMENTS);
            let data = body(n);
            let p = super_packet(v6, &data, seq, flags, opt_words * 4);
            let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
            let mut out = Vec::new();
            let seg = segment_tcp(&p, kind, gso, &mut out, 3).expect("valid super-packet");
            prop_assert_eq!(out.len(), seg.total_len());
            let got = check(&out, &seg, v6);
            let mut expect_seq = seq;
            for (s, _, _, payload) in &got {
                prop_assert_eq!(*s, expect_seq);
                prop_assert!(payload.len() <= gso);
                expect_seq = expect_seq.wrapping_add(payload.len() as u32);
            }
            let joined: Vec<u8> = got.into_iter().flat_map(|g| g.3).collect();
            prop_assert_eq!(joined, data);
        }

        #[test]
        fn arbitrary_input_never_panics(
            buf in proptest::collection::vec(any::<u8>(), 0..3000),
            gso in any::<u16>(),
            v6 in any::<bool>(),
            start in any::<u16>(),
            offset in any::<u16>(),
        ) {
            let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
            let mut out = Vec::new();
            if let Ok(seg) = segment_tcp(&buf, kind, usize::from(gso), &mut out, 2) {
                prop_assert_eq!(out.len(), seg.total_len());
                for r in seg.spans() {
                    prop_assert!(r.end <= out.len());
                }
            }
            let mut b = buf.clone();
            let _ = complete_checksum(&mut b, usize::from(start), usize::from(offset));
        }
    }
}
