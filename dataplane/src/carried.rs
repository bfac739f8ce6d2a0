//! The TCP flows one pump worker carried, so that they can be reset on the
//! laptop when the traffic manager lost them. Pure: no I/O, no clock; the
//! pump feeds it the packets it moves ([`crate::redial`] is the glue).
//!
//! Why: when a re-dial of a worker's data connection cannot resume (the
//! manager restarted, or the resume grace was over: its resume answer is
//! "new"), the manager's engine and every flow in it are gone. A laptop
//! socket that sends (an upload) reaches the new engine, which answers with
//! a RST at once; a socket that only receives (curl waiting for a download)
//! sends nothing that would draw one and hangs until the application's own
//! timeout. So on "new" after a re-dial the pump writes into the TUN, for
//! every flow in this table, a RST from the remote end (cluster address and
//! port → laptop), then clears the table.
//!
//! The RST's sequence number. Linux accepts a RST only when its sequence
//! number is exactly RCV.NXT (RFC 5961 §3.2; `tcp_validate_incoming` in
//! net/ipv4/tcp_input.c, then `tcp_reset`); an in-window but inexact one
//! draws a challenge ACK, an out-of-window one is dropped. PAWS does not
//! apply to a segment without a timestamp option, and a RST is checked
//! before its ACK field. The laptop's RCV.NXT is the end of the highest
//! in-order segment the manager delivered to it: the table keeps the
//! highest sequence end (`seq + len + SYN + FIN`) of the inbound segments
//! and the last ACK number the laptop sent. The RST goes out at the first;
//! when the second differs (the laptop has not acknowledged all, or an
//! inbound packet never reached the socket), a second RST goes out at it.
//! Should neither be exact, the challenge ACK goes to the new engine, which
//! knows no such flow and answers it with a RST at that ACK number, which
//! is RCV.NXT exactly.
//!
//! UDP and ICMP need nothing: they have no connection state that could wait
//! for a peer that forgot them (a UDP socket's next datagram reaches the new
//! engine, which opens a new flow for it).
//!
//! Bounds: [`CAPACITY`] flows per worker, in a table allocated once; a
//! packet of a known flow updates it in place, no allocation per packet.
//! When the table is full, the least recently seen half is dropped (counted
//! in [`CarriedFlows::evicted`]): a flow not seen for that long is the one
//! least likely to hang a user.
//!
//! Only live flows are reset (and counted in `tcp_flows_reset`). A flow ends
//! in the table when:
//! - a RST is seen either way, or a FIN both ways: it becomes a tombstone
//!   for [`CLOSED_LINGER`] (never reset; the stragglers of the close, e.g.
//!   the last ACK, a retransmitted FIN, data in flight behind a RST, find it
//!   and do not open the flow again), then leaves;
//! - the cluster end sent a FIN and the flow then stays idle for
//!   [`FIN_IN_LINGER`] (the laptop's application read EOF; if it still
//!   sends, the new engine answers that with a RST itself);
//! - the laptop sent a FIN (and the cluster end did not) and the flow stays
//!   idle for [`FIN_OUT_LINGER`];
//! - it is idle for [`IDLE_TIMEOUT`].
//!
//! A segment of an unknown flow opens an entry only when it carries data or
//! is a SYN-ACK: a bare ACK, FIN or RST of a flow not in the table is the
//! tail of a connection that ended (or left the table) and would otherwise
//! sit there, never closed, until the idle timeout.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use smoltcp::wire::{
    IpAddress, IpProtocol, Ipv4Packet, Ipv4Repr, Ipv6Packet, Ipv6Repr, TcpPacket, TcpSeqNumber,
};

/// Flows tracked per worker. A laptop rarely has more than a few hundred TCP
/// connections into a cluster; 4096 keeps the table (~300 KiB) small.
pub const CAPACITY: usize = 4096;

/// How long a closed flow (RST either way, FIN both ways) stays as a
/// tombstone: Linux's TIME-WAIT (`TCP_TIMEWAIT_LEN`, 60 s), the longest
/// either end still sends segments of a closed connection (a lost last ACK
/// draws a retransmitted FIN that the laptop answers), so none of them opens
/// the flow again.
pub const CLOSED_LINGER: Duration = Duration::from_secs(60);

/// How long a flow whose cluster end sent a FIN (the laptop's application
/// read EOF) stays once idle: the laptop closes within a round trip as a
/// rule, and a laptop that keeps its end open and sends later draws a RST
/// from the new engine without help, so a reset is never needed here.
pub const FIN_IN_LINGER: Duration = Duration::from_secs(5);

/// How long a flow whose laptop end sent a FIN (and the cluster end not yet)
/// stays once idle: Linux's `tcp_fin_timeout` (60 s), after which a closed
/// socket in FIN-WAIT-2 is forgotten without a segment. A half-closed socket
/// that still waits for its answer keeps its entry while data comes.
pub const FIN_OUT_LINGER: Duration = Duration::from_secs(60);

/// How long an open flow stays without a segment either way. The reset is
/// useful only for a flow whose application still waits on the cluster end;
/// such a flow rarely stays silent for 10 minutes (HTTP clients time out,
/// Kubernetes watches get bookmarks or events, HTTP/2 and SSH clients send
/// pings, kernel keep-alives of long-lived connections are usually tuned
/// below that), while a flow that ended without its close passing this
/// worker (the application's namespace went away, the laptop's kernel gave
/// up on its retransmissions, the close went over another worker after a
/// steering change) would otherwise be counted as "reset" at every "new"
/// answer. A flow silent longer than this that still waits loses the
/// early reset only: the application's own timeout applies, as without
/// this table.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// How often at most the table is swept for ended flows (a pass over at
/// most [`CAPACITY`] entries).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// A flow, from the laptop's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The laptop's address and port (the tunnel IP).
    pub laptop: (IpAddr, u16),
    /// The cluster's address and port.
    pub remote: (IpAddr, u16),
}

#[derive(Debug, Clone, Copy)]
struct FlowState {
    /// The ACK number of the laptop's latest segment with ACK set.
    laptop_ack: Option<TcpSeqNumber>,
    /// The highest sequence end of the segments delivered to the laptop.
    delivered_end: Option<TcpSeqNumber>,
    fin_out: bool,
    fin_in: bool,
    /// A RST was seen, or a FIN both ways: a tombstone, never reset.
    closed: bool,
    /// [`CarriedFlows::clock`] when last seen.
    seen: u64,
    /// When last seen (a tombstone: when it closed).
    last: Instant,
}

impl FlowState {
    fn new(seen: u64, now: Instant) -> Self {
        Self {
            laptop_ack: None,
            delivered_end: None,
            fin_out: false,
            fin_in: false,
            closed: false,
            seen,
            last: now,
        }
    }

    /// Whether the flow has ended by `now` ([module docs](self)): it can go.
    fn ended(&self, now: Instant) -> bool {
        let linger = if self.closed {
            CLOSED_LINGER
        } else if self.fin_in {
            FIN_IN_LINGER
        } else if self.fin_out {
            FIN_OUT_LINGER
        } else {
            IDLE_TIMEOUT
        };
        now.saturating_duration_since(self.last) >= linger
    }

    /// Whether the flow is live at `now`: worth a RST when the manager lost it.
    fn live(&self, now: Instant) -> bool {
        !self.closed && !self.ended(now)
    }
}

/// One TCP segment's fields the table needs.
struct Segment {
    key: FlowKey,
    seq: TcpSeqNumber,
    ack: Option<TcpSeqNumber>,
    /// Sequence space taken: payload + SYN + FIN.
    len: usize,
    syn: bool,
    fin: bool,
    rst: bool,
}

/// The TCP flows of one worker ([module docs](self)).
#[derive(Debug)]
pub struct CarriedFlows {
    flows: HashMap<FlowKey, FlowState>,
    capacity: usize,
    /// Counts packets; orders the flows by when last seen.
    clock: u64,
    /// When the table is next swept for ended flows.
    next_sweep: Option<Instant>,
    /// Flows dropped because the table was full.
    pub evicted: u64,
}

impl Default for CarriedFlows {
    fn default() -> Self {
        Self::with_capacity(CAPACITY)
    }
}

impl CarriedFlows {
    /// A table of at most `capacity` flows (at least 2), allocated now.
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(2);
        Self {
            flows: HashMap::with_capacity(capacity),
            capacity,
            clock: 0,
            next_sweep: None,
            evicted: 0,
        }
    }

    /// Entries in the table (live flows and those about to leave).
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    /// Flows live at `now`: the ones a "new" answer would reset.
    pub fn live(&self, now: Instant) -> usize {
        self.flows.values().filter(|s| s.live(now)).count()
    }

    /// An outbound packet (laptop → cluster, as read from the TUN) the
    /// worker sends to the manager at `now`. Anything but TCP, or
    /// malformed, is ignored.
    pub fn handle_outbound(&mut self, packet: &[u8], now: Instant) {
        let Some(seg) = parse(packet, false) else {
            return;
        };
        self.sweep(now);
        // A bare SYN opens nothing the manager could forget yet: the new
        // engine takes its retransmission. It starts a new connection on
        // the 4-tuple, so a tombstone of the old one goes.
        if seg.syn && seg.ack.is_none() {
            if self.flows.get(&seg.key).is_some_and(|s| s.closed) {
                self.flows.remove(&seg.key);
            }
            return;
        }
        let Some(state) = self.entry(&seg, now) else {
            return;
        };
        if seg.rst {
            state.closed = true;
            return;
        }
        if let Some(ack) = seg.ack {
            state.laptop_ack = Some(ack);
        }
        state.fin_out |= seg.fin;
        state.closed = state.fin_out && state.fin_in;
    }

    /// An inbound packet (cluster → laptop) the worker writes to the TUN at
    /// `now`.
    pub fn handle_inbound(&mut self, packet: &[u8], now: Instant) {
        let Some(seg) = parse(packet, true) else {
            return;
        };
        self.sweep(now);
        let Some(state) = self.entry(&seg, now) else {
            return;
        };
        if seg.rst {
            state.closed = true;
            return;
        }
        let end = seg.seq + seg.len;
        state.delivered_end = Some(match state.delivered_end {
            Some(old) if old > end => old,
            _ => end,
        });
        if seg.syn {
            // A SYN-ACK starts the sequence space: nothing before it counts.
            state.delivered_end = Some(end);
        }
        state.fin_in |= seg.fin;
        state.closed = state.fin_out && state.fin_in;
    }

    /// The state of `seg`'s flow, to update; `None` when the segment is a
    /// straggler of a closed flow (a tombstone) or opens nothing ([module
    /// docs](self)). A SYN-ACK on a tombstone starts the flow afresh.
    fn entry(&mut self, seg: &Segment, now: Instant) -> Option<&mut FlowState> {
        self.clock += 1;
        let clock = self.clock;
        let opens = seg.syn || (seg.len > usize::from(seg.fin) && !seg.rst);
        match self.flows.get(&seg.key) {
            Some(s) if s.closed && !seg.syn => return None,
            Some(_) => {}
            None if !opens => return None,
            None => {
                if self.flows.len() >= self.capacity {
                    self.sweep_now(now);
                }
                if self.flows.len() >= self.capacity {
                    self.evict_older_half();
                }
            }
        }
        let state = self
            .flows
            .entry(seg.key)
            .or_insert_with(|| FlowState::new(clock, now));
        if state.closed {
            // A SYN-ACK: a new connection on the old 4-tuple.
            *state = FlowState::new(clock, now);
        }
        state.seen = clock;
        state.last = now;
        Some(state)
    }

    /// Drop the ended flows, at most every [`SWEEP_EVERY`].
    fn sweep(&mut self, now: Instant) {
        match self.next_sweep {
            Some(at) if now < at => {}
            _ => self.sweep_now(now),
        }
    }

    fn sweep_now(&mut self, now: Instant) {
        self.next_sweep = Some(now + SWEEP_EVERY);
        self.flows.retain(|_, s| !s.ended(now));
    }

    /// Drop the flows seen before the midpoint of the oldest and newest: one
    /// pass for (about) half the table, so a stream of new flows costs O(1)
    /// per flow on average.
    fn evict_older_half(&mut self) {
        let (min, max) = self.flows.values().fold((u64::MAX, 0), |(lo, hi), s| {
            (lo.min(s.seen), hi.max(s.seen))
        });
        let cut = min + (max - min) / 2;
        let before = self.flows.len();
        self.flows.retain(|_, s| s.seen > cut);
        if self.flows.len() == before {
            // All seen at the same tick (cannot happen: each packet ticks);
            // keep the bound anyway.
            self.flows.clear();
        }
        self.evicted += (before - self.flows.len()) as u64;
    }

    /// The manager lost every flow at `now`: the RSTs of the live flows to
    /// write into the TUN (into `out`, each a whole IP packet, appended),
    /// and the table cleared. Returns the number of flows reset.
    pub fn take_resets(&mut self, out: &mut Vec<Vec<u8>>, now: Instant) -> usize {
        let mut flows = 0;
        for (key, state) in self.flows.drain() {
            if !state.live(now) {
                continue;
            }
            let mut seqs = [state.delivered_end, state.laptop_ack];
            if seqs[0] == seqs[1] {
                seqs[1] = None;
            }
            let mut any = false;
            for seq in seqs.into_iter().flatten() {
                if let Some(rst) = build_rst(&key, seq) {
                    out.push(rst);
                    any = true;
                }
            }
            flows += usize::from(any);
        }
        flows
    }
}

/// The TCP segment in `packet`; `inbound`: cluster → laptop (the key is
/// flipped so that both directions of a flow meet). `None` for anything but
/// a whole, unfragmented TCP segment.
fn parse(packet: &[u8], inbound: bool) -> Option<Segment> {
    let (src, dst, payload) = match packet.first()? >> 4 {
        4 => {
            let ip = Ipv4Packet::new_checked(packet).ok()?;
            if ip.next_header() != IpProtocol::Tcp || ip.more_frags() || ip.frag_offset() != 0 {
                return None;
            }
            let total = usize::from(ip.total_len());
            let header = usize::from(ip.header_len());
            (
                IpAddr::V4(ip.src_addr()),
                IpAddr::V4(ip.dst_addr()),
                packet.get(header..total)?,
            )
        }
        6 => {
            let ip = Ipv6Packet::new_checked(packet).ok()?;
            // Extension headers are not followed: a flow whose packets carry
            // them is not tracked (none of the laptop's kernel TCP does).
            if ip.next_header() != IpProtocol::Tcp {
                return None;
            }
            let len = usize::from(ip.payload_len());
            (
                IpAddr::V6(ip.src_addr()),
                IpAddr::V6(ip.dst_addr()),
                packet.get(40..40 + len)?,
            )
        }
        _ => return None,
    };
    let tcp = TcpPacket::new_checked(payload).ok()?;
    let (src_end, dst_end) = ((src, tcp.src_port()), (dst, tcp.dst_port()));
    let key = if inbound {
        FlowKey {
            laptop: dst_end,
            remote: src_end,
        }
    } else {
        FlowKey {
            laptop: src_end,
            remote: dst_end,
        }
    };
    Some(Segment {
        key,
        seq: tcp.seq_number(),
        ack: tcp.ack().then(|| tcp.ack_number()),
        len: tcp.segment_len(),
        syn: tcp.syn(),
        fin: tcp.fin(),
        rst: tcp.rst(),
    })
}

/// A RST from `key.remote` to `key.laptop` with sequence number `seq`, no ACK,
/// window 0, checksums filled. `None` for mixed address families.
pub fn build_rst(key: &FlowKey, seq: TcpSeqNumber) -> Option<Vec<u8>> {
    let caps = smoltcp::phy::ChecksumCapabilities::default();
    let (mut out, ip_len, src, dst) = match (key.remote.0, key.laptop.0) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut out = vec![0u8; 20 + 20];
            let repr = Ipv4Repr {
                src_addr: s,
                dst_addr: d,
                next_header: IpProtocol::Tcp,
                payload_len: 20,
                hop_limit: 64,
            };
            repr.emit(&mut Ipv4Packet::new_unchecked(&mut out[..]), &caps);
            (out, 20, IpAddress::Ipv4(s), IpAddress::Ipv4(d))
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut out = vec![0u8; 40 + 20];
            let repr = Ipv6Repr {
                src_addr: s,
                dst_addr: d,
                next_header: IpProtocol::Tcp,
                payload_len: 20,
                hop_limit: 64,
            };
            repr.emit(&mut Ipv6Packet::new_unchecked(&mut out[..]));
            (out, 40, IpAddress::Ipv6(s), IpAddress::Ipv6(d))
        }
        _ => return None,
    };
    let mut tcp = TcpPacket::new_unchecked(&mut out[ip_len..]);
    tcp.set_src_port(key.remote.1);
    tcp.set_dst_port(key.laptop.1);
    tcp.set_seq_number(seq);
    tcp.set_ack_number(TcpSeqNumber(0));
    tcp.set_header_len(20);
    tcp.clear_flags();
    tcp.set_rst(true);
    tcp.set_window_len(0);
    tcp.set_urgent_at(0);
    tcp.fill_checksum(&src, &dst);
    Some(out)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const LAPTOP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);
    const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);

    /// An IPv4 TCP segment with checksums filled.
    fn segment(
        src: (Ipv4Addr, u16),
        dst: (Ipv4Addr, u16),
        seq: u32,
        ack: Option<u32>,
        flags: &[&str],
        payload: usize,
    ) -> Vec<u8> {
        let mut tcp = vec![0u8; 20 + payload];
        {
            let mut t = TcpPacket::new_unchecked(&mut tcp[..]);
            t.set_src_port(src.1);
            t.set_dst_port(dst.1);
            t.set_seq_number(TcpSeqNumber(seq as i32));
            t.set_header_len(20);
            t.clear_flags();
            if let Some(a) = ack {
                t.set_ack(true);
                t.set_ack_number(TcpSeqNumber(a as i32));
            }
            for f in flags {
                match *f {
                    "syn" => t.set_syn(true),
                    "fin" => t.set_fin(true),
                    "rst" => t.set_rst(true),
                    other => panic!("flag {other}"),
                }
            }
            t.fill_checksum(&IpAddress::Ipv4(src.0), &IpAddress::Ipv4(dst.0));
        }
        kvpn_lab::packets::ipv4(6, src.0, dst.0, &tcp)
    }

    /// A fixed instant plus `secs` (the table's clock is its caller's).
    fn at(secs: u64) -> Instant {
        static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *BASE.get_or_init(Instant::now) + Duration::from_secs(secs)
    }

    impl CarriedFlows {
        fn out(&mut self, packet: &[u8]) {
            self.handle_outbound(packet, at(0));
        }
        fn inb(&mut self, packet: &[u8]) {
            self.handle_inbound(packet, at(0));
        }
    }

    fn key() -> FlowKey {
        FlowKey {
            laptop: (IpAddr::V4(LAPTOP), 40000),
            remote: (IpAddr::V4(POD), 8080),
        }
    }

    fn rst_seqs(out: &[Vec<u8>]) -> Vec<u32> {
        out.iter()
            .map(|p| {
                let ip = Ipv4Packet::new_checked(&p[..]).expect("IPv4");
                assert!(ip.verify_checksum());
                assert_eq!(ip.src_addr(), POD);
                assert_eq!(ip.dst_addr(), LAPTOP);
                let t = TcpPacket::new_checked(ip.payload()).expect("TCP");
                assert!(t.verify_checksum(&IpAddress::Ipv4(POD), &IpAddress::Ipv4(LAPTOP)));
                assert!(t.rst() && !t.ack() && !t.syn() && !t.fin());
                assert_eq!((t.src_port(), t.dst_port()), (8080, 40000));
                t.seq_number().0 as u32
            })
            .collect()
    }

    #[test]
    fn a_download_is_reset_at_the_end_of_what_was_delivered() {
        let mut t = CarriedFlows::default();
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        t.out(&segment(l, r, 100, None, &["syn"], 0));
        assert!(t.is_empty(), "a bare SYN is not tracked");
        t.inb(&segment(r, l, 5000, Some(101), &["syn"], 0));
        t.out(&segment(l, r, 101, Some(5001), &[], 0));
        t.inb(&segment(r, l, 5001, Some(101), &[], 1000));
        t.inb(&segment(r, l, 6001, Some(101), &[], 1000));
        // The laptop acknowledged up to 6001 so far (a delayed ACK).
        t.out(&segment(l, r, 101, Some(6001), &[], 0));
        assert_eq!(t.len(), 1);
        let mut out = Vec::new();
        assert_eq!(t.take_resets(&mut out, at(0)), 1);
        assert_eq!(rst_seqs(&out), vec![7001, 6001]);
        assert!(t.is_empty(), "cleared");
    }

    #[test]
    fn sequence_numbers_wrap_and_old_segments_do_not_move_the_end_back() {
        let mut t = CarriedFlows::default();
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        t.inb(&segment(r, l, u32::MAX - 10, Some(1), &[], 100));
        // A retransmission of an older segment.
        t.inb(&segment(r, l, u32::MAX - 10, Some(1), &[], 20));
        t.out(&segment(l, r, 1, Some(89), &[], 0));
        let mut out = Vec::new();
        t.take_resets(&mut out, at(0));
        assert_eq!(rst_seqs(&out), vec![89]);
    }

    #[test]
    fn reset_or_closed_flows_are_not_reset_and_leave_the_table() {
        let mut t = CarriedFlows::default();
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        t.inb(&segment(r, l, 1, Some(1), &[], 10));
        t.out(&segment(l, r, 1, None, &["rst"], 0));
        assert_eq!(t.live(at(0)), 0, "a RST from the laptop ends the flow");
        // Data in flight behind the RST does not open it again.
        t.inb(&segment(r, l, 11, Some(1), &[], 10));
        assert_eq!(t.live(at(0)), 0);
        // Another flow: a RST from the cluster end.
        t.inb(&segment(r, (LAPTOP, 40001), 1, Some(1), &[], 10));
        t.inb(&segment(r, (LAPTOP, 40001), 11, None, &["rst"], 0));
        t.out(&segment((LAPTOP, 40001), r, 1, Some(11), &[], 0));
        assert_eq!(t.live(at(0)), 0, "a RST from the cluster ends the flow");
        // UDP and garbage are ignored.
        t.out(&kvpn_lab::packets::ipv4(17, LAPTOP, POD, &[0u8; 12]));
        t.inb(&[0x45, 0, 0]);
        t.inb(&[]);
        let mut out = Vec::new();
        assert_eq!(t.take_resets(&mut out, at(1)), 0);
        assert!(out.is_empty() && t.is_empty());
        assert_eq!(
            build_rst(&key(), TcpSeqNumber(5)).map(|p| p.len()),
            Some(40)
        );
    }

    /// A connection the laptop closes first, then one the cluster end closes
    /// first: the last ACK (and a retransmitted FIN) after both FINs used to
    /// open the flow again, for good; 364 such flows were "reset" once.
    #[test]
    fn the_stragglers_of_a_close_do_not_open_the_flow_again() {
        let mut t = CarriedFlows::default();
        let r = (POD, 8080);
        let (a, b) = ((LAPTOP, 40000), (LAPTOP, 40001));
        // a: the laptop closes first (it then sits in TIME-WAIT).
        t.inb(&segment(r, a, 1, Some(1), &[], 100));
        t.out(&segment(a, r, 1, Some(101), &["fin"], 0));
        t.inb(&segment(r, a, 101, Some(2), &["fin"], 0));
        t.out(&segment(a, r, 2, Some(102), &[], 0));
        // The last ACK was lost: the FIN comes again and is answered again.
        t.inb(&segment(r, a, 101, Some(2), &["fin"], 0));
        t.out(&segment(a, r, 2, Some(102), &[], 0));
        // b: the cluster end closes first.
        t.inb(&segment(r, b, 1, Some(1), &["fin"], 100));
        t.out(&segment(b, r, 1, Some(102), &["fin"], 0));
        t.inb(&segment(r, b, 102, Some(2), &[], 0));
        assert_eq!(t.live(at(0)), 0);
        // Tombstones until TIME-WAIT is over, then gone.
        assert_eq!(t.len(), 2);
        t.handle_inbound(
            &segment(r, (LAPTOP, 40009), 1, Some(1), &[], 1),
            at(CLOSED_LINGER.as_secs()),
        );
        assert_eq!(t.len(), 1, "swept: only the new flow is left");
        let mut out = Vec::new();
        assert_eq!(t.take_resets(&mut out, at(CLOSED_LINGER.as_secs())), 1);
    }

    #[test]
    fn bare_acks_fins_and_resets_of_unknown_flows_open_nothing() {
        let mut t = CarriedFlows::default();
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        t.out(&segment(l, r, 1, Some(1), &[], 0));
        t.inb(&segment(r, l, 1, Some(1), &[], 0));
        t.inb(&segment(r, l, 1, Some(1), &["fin"], 0));
        t.out(&segment(l, r, 1, Some(2), &["fin"], 0));
        t.out(&segment(l, r, 1, None, &["rst"], 0));
        assert!(t.is_empty());
        // Data does, either way.
        t.out(&segment(l, r, 1, Some(1), &[], 10));
        t.inb(&segment(r, (LAPTOP, 40001), 1, Some(1), &[], 10));
        assert_eq!(t.live(at(0)), 2);
    }

    #[test]
    fn a_new_connection_on_a_closed_flows_ports_is_tracked_afresh() {
        let mut t = CarriedFlows::default();
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        t.inb(&segment(r, l, 1, Some(1), &[], 10));
        t.out(&segment(l, r, 1, None, &["rst"], 0));
        t.out(&segment(l, r, 500, None, &["syn"], 0));
        assert!(t.is_empty(), "the SYN took the tombstone away");
        t.inb(&segment(r, l, 9000, Some(501), &["syn"], 0));
        t.out(&segment(l, r, 501, Some(9001), &[], 0));
        let mut out = Vec::new();
        assert_eq!(t.take_resets(&mut out, at(0)), 1);
        assert_eq!(rst_seqs(&out), vec![9001]);
    }

    #[test]
    fn half_closed_and_idle_flows_age_out() {
        let (l, r) = ((LAPTOP, 40000), (POD, 8080));
        // The cluster end sent its FIN: gone after FIN_IN_LINGER idle.
        let mut t = CarriedFlows::default();
        t.inb(&segment(r, l, 1, Some(1), &["fin"], 10));
        let just_before = at(FIN_IN_LINGER.as_secs()) - Duration::from_millis(1);
        assert_eq!(t.live(just_before), 1);
        assert_eq!(t.live(at(FIN_IN_LINGER.as_secs())), 0);
        // The laptop half-closed and still receives: live while data comes,
        // gone FIN_OUT_LINGER after the last segment.
        let mut t = CarriedFlows::default();
        t.out(&segment(l, r, 1, Some(1), &["fin"], 10));
        let later = FIN_OUT_LINGER.as_secs() - 1;
        t.handle_inbound(&segment(r, l, 1, Some(12), &[], 1000), at(later));
        assert_eq!(t.live(at(later + FIN_OUT_LINGER.as_secs() - 1)), 1);
        assert_eq!(t.live(at(later + FIN_OUT_LINGER.as_secs())), 0);
        // An open flow: gone after IDLE_TIMEOUT without a segment.
        let mut t = CarriedFlows::default();
        t.inb(&segment(r, l, 1, Some(1), &[], 10));
        let idle = IDLE_TIMEOUT.as_secs();
        assert_eq!(t.live(at(idle - 1)), 1);
        let mut out = Vec::new();
        assert_eq!(t.take_resets(&mut out, at(idle)), 0, "idle: not reset");
        assert!(out.is_empty());
        // An idle flow leaves at the first sweep past its timeout.
        t.inb(&segment(r, l, 11, Some(1), &[], 10));
        t.handle_inbound(&segment(r, (LAPTOP, 1), 1, Some(1), &[], 1), at(idle));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_full_table_drops_the_least_recently_seen_half() {
        let mut t = CarriedFlows::with_capacity(8);
        for port in 0..8u16 {
            t.inb(&segment(
                (POD, 8080),
                (LAPTOP, 1000 + port),
                1,
                Some(1),
                &[],
                1,
            ));
        }
        // Flow 0 is seen again: it is now the newest.
        t.inb(&segment((POD, 8080), (LAPTOP, 1000), 2, Some(1), &[], 1));
        t.inb(&segment((POD, 8080), (LAPTOP, 2000), 1, Some(1), &[], 1));
        assert!(t.len() <= 8 && t.len() >= 4, "{}", t.len());
        assert!(t.evicted >= 4, "{}", t.evicted);
        let kept: Vec<u16> = t.flows.keys().map(|k| k.laptop.1).collect();
        assert!(kept.contains(&1000) && kept.contains(&2000), "{kept:?}");
        assert!(!kept.contains(&1001), "{kept:?}");
    }
}
