//! What one pump worker does around a re-dial of its data connection, kept
//! across its pumps: the TCP flows it carried ([`crate::carried`]), reset on
//! the laptop when the manager answers a re-dial with "new"; and the packets
//! held while a re-dial that may resume is under way ([`Hold`]).
//!
//! Holding. Between the loss of a data connection and the first heartbeat
//! echo on the next one (about 50 ms in the lab: a re-dial plus a round
//! trip), the worker used to answer every packet with ICMP unreachable
//! ([`crate::pump::refuse`]), so connects that fell into that gap failed with
//! "No route to host". When the lost connection had been answered with a
//! resume answer (the manager takes resume tokens, so it may keep the
//! engine) and ended abruptly (closed, reset; not silent, which points to a
//! black hole whose re-dial waits out a timeout), the worker now holds the TUN reads instead, for at most
//! [`HOLD_WINDOW`] after the loss and at most [`HOLD_PACKETS`] reads /
//! [`HOLD_BYTES`] bytes, and the next pump sends them first, in order,
//! through its normal offload path ([`recv`]). While the window is open the
//! new pump also forwards what it reads before the first echo, instead of
//! refusing it. Beyond either bound the old behaviour applies: a read that
//! does not fit is refused at once, and reads still held when the window
//! closes are refused then.
//!
//! Everything here is bounded and allocated once per worker; the per-packet
//! hooks take an uncontended lock at most.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kvpn_proto::frame::ResumeAnswer;

use crate::carried::CarriedFlows;
use crate::pump::{Counters, PacketIo, Refusal};
use crate::tun::{MAX_READ, VNET_HDR_LEN};
use crate::unreachable;

/// Longest time after a data connection's loss during which the worker's
/// packets are held (and forwarded before the first echo) rather than
/// refused. A re-dial that resumes takes ~50 ms in the lab (connect, hello,
/// answer); 500 ms covers a slower path (port-forward, TLS) and is still
/// well under a connect's first SYN retransmission (1 s), so a held SYN
/// costs less than a lost one.
pub const HOLD_WINDOW: Duration = Duration::from_millis(500);

/// Most TUN reads held.
pub const HOLD_PACKETS: usize = 256;

/// Most bytes held (TUN reads with their `virtio_net_hdr`).
pub const HOLD_BYTES: usize = 256 * 1024;

/// The held TUN reads, back to back in one buffer allocated once. Pure.
#[derive(Debug)]
pub struct Hold {
    buf: Vec<u8>,
    /// `(start, end)` of each read in `buf`, oldest first from `next`.
    reads: Vec<(usize, usize)>,
    next: usize,
    /// The window's end while one is open.
    until: Option<Instant>,
}

impl Default for Hold {
    fn default() -> Self {
        Self {
            buf: Vec::with_capacity(HOLD_BYTES),
            reads: Vec::with_capacity(HOLD_PACKETS),
            next: 0,
            until: None,
        }
    }
}

impl Hold {
    /// Open a window of [`HOLD_WINDOW`] from `now`.
    pub fn open(&mut self, now: Instant) {
        self.until = Some(now + HOLD_WINDOW);
    }

    /// Whether the window is open at `now`.
    pub fn is_open(&self, now: Instant) -> bool {
        self.until.is_some_and(|t| now < t)
    }

    /// When the open window ends.
    pub fn deadline(&self) -> Option<Instant> {
        self.until
    }

    /// Hold `read` if the window is open and it fits; false otherwise.
    pub fn push(&mut self, read: &[u8], now: Instant) -> bool {
        if !self.is_open(now)
            || self.reads.len() >= HOLD_PACKETS
            || self.buf.len() + read.len() > HOLD_BYTES
        {
            return false;
        }
        let start = self.buf.len();
        self.buf.extend_from_slice(read);
        self.reads.push((start, self.buf.len()));
        true
    }

    /// Copy the oldest held read into `out`; its length, or `None` when none
    /// is held. A read larger than `out` (cannot happen: reads are at most
    /// [`MAX_READ`]) is dropped.
    pub fn pop_into(&mut self, out: &mut [u8]) -> Option<usize> {
        let (start, end) = *self.reads.get(self.next)?;
        self.next += 1;
        let n = end - start;
        let copied = match (out.get_mut(..n), self.buf.get(start..end)) {
            (Some(to), Some(from)) => {
                to.copy_from_slice(from);
                true
            }
            _ => false,
        };
        if self.next == self.reads.len() {
            // Empty again; the capacity stays.
            self.reads.clear();
            self.buf.clear();
            self.next = 0;
        }
        copied.then_some(n)
    }

    /// Reads held now.
    pub fn len(&self) -> usize {
        self.reads.len() - self.next
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One worker's re-dial state, shared by its supervisor and its pumps.
#[derive(Debug, Default)]
pub struct Redial {
    flows: Mutex<CarriedFlows>,
    hold: Mutex<Hold>,
    /// Reads are held: lets the pump's per-read hook skip the lock.
    holding: AtomicBool,
    /// The current connection got a resume answer (the manager takes
    /// resume tokens; the next re-dial may resume).
    resume_offered: AtomicBool,
    /// Times the inbound hook took the flow table's lock.
    #[cfg(test)]
    inbound_locks: std::sync::atomic::AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Both tables stay consistent at every await-free step; keep going with
    // what a panicking holder left.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Redial {
    /// The supervisor saw the data connection end at `now`: hold from now
    /// on, for [`HOLD_WINDOW`], if the manager took the resume token.
    pub fn transport_lost(&self, now: Instant) {
        if self.resume_offered.swap(false, Ordering::Relaxed) {
            lock(&self.hold).open(now);
        }
    }

    /// Whether packets read now are held or forwarded rather than refused.
    pub fn window_open(&self, now: Instant) -> bool {
        lock(&self.hold).is_open(now)
    }

    /// Flows in the table (for tests and logs).
    pub fn flows(&self) -> usize {
        lock(&self.flows).len()
    }
}

/// Pump hook: the outbound packets of a batch that goes to the manager
/// (one lock and one clock read per batch).
pub fn track_outbound<'a>(redial: &Option<Arc<Redial>>, packets: impl Iterator<Item = &'a [u8]>) {
    track(redial, packets, CarriedFlows::handle_outbound);
}

/// Pump hook: the inbound packets of a chunk written to the TUN (one lock
/// and one clock read per call; the caller calls it after its TUN writes,
/// so the outbound side never waits on one).
pub fn track_inbound<'a>(redial: &Option<Arc<Redial>>, packets: impl Iterator<Item = &'a [u8]>) {
    let _locked = track(redial, packets, CarriedFlows::handle_inbound);
    #[cfg(test)]
    if let Some(r) = redial.as_ref().filter(|_| _locked) {
        r.inbound_locks.fetch_add(1, Ordering::Relaxed);
    }
}

/// Feed `packets` to the flow table under one lock; whether it was taken
/// (not for an empty batch).
fn track<'a>(
    redial: &Option<Arc<Redial>>,
    packets: impl Iterator<Item = &'a [u8]>,
    handle: fn(&mut CarriedFlows, &[u8], Instant),
) -> bool {
    let Some(r) = redial else {
        return false;
    };
    let mut packets = packets.peekable();
    if packets.peek().is_none() {
        return false;
    }
    let now = Instant::now();
    let mut flows = lock(&r.flows);
    for p in packets {
        handle(&mut flows, p, now);
    }
    true
}

/// Pump hook, for a batch of `packets` read while the session is
/// reconnecting: whether the pump forwards it on the fresh connection (a
/// re-dial inside its hold window; counted in [`Counters::held_packets`])
/// instead of refusing it.
pub fn forwards_while_reconnecting(
    redial: &Option<Arc<Redial>>,
    now: Instant,
    counters: &Counters,
    packets: u64,
) -> bool {
    let forwards = redial.as_ref().is_some_and(|r| r.window_open(now));
    if forwards {
        Counters::add(&counters.held_packets, packets);
    }
    forwards
}

/// Pump hook, in place of `tun.try_recv`: a held read first (oldest first),
/// then the TUN.
pub fn recv<T: PacketIo>(
    redial: &Option<Arc<Redial>>,
    tun: &T,
    buf: &mut [u8],
) -> io::Result<usize> {
    if let Some(r) = redial
        && r.holding.load(Ordering::Relaxed)
    {
        let mut hold = lock(&r.hold);
        if let Some(n) = hold.pop_into(buf) {
            if hold.is_empty() {
                r.holding.store(false, Ordering::Relaxed);
            }
            return Ok(n);
        }
        r.holding.store(false, Ordering::Relaxed);
    }
    tun.try_recv(buf)
}

/// Pump hook: the manager's resume answer (frame kind 6), met in order
/// with the inbound packets. Marks the connection as resumable; on "new"
/// after a re-dial, writes a RST for every flow the worker carried into the
/// TUN and clears the table (counted in [`Counters::tcp_flows_reset`]).
pub async fn resume_answer<T: PacketIo>(
    redial: &Option<Arc<Redial>>,
    tun: &T,
    payload: &[u8],
    counters: &Counters,
) -> io::Result<()> {
    let Some(r) = redial else {
        return Ok(());
    };
    let answer = ResumeAnswer::decode(payload);
    if matches!(answer, Some(ResumeAnswer::New | ResumeAnswer::Resumed)) {
        r.resume_offered.store(true, Ordering::Relaxed);
    }
    let redial = Counters::get(&counters.transports_lost) > 0;
    if answer != Some(ResumeAnswer::New) || !redial {
        return Ok(());
    }
    let mut resets = Vec::new();
    let flows = lock(&r.flows).take_resets(&mut resets, Instant::now());
    for rst in &resets {
        match tun.send(rst).await {
            Ok(_) => {}
            // As for any packet: one the TUN refuses is not fatal.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Counters::add(&counters.tcp_flows_reset, flows as u64);
    if flows > 0 {
        tracing::warn!(
            flows,
            "reset the TCP flows the lost data connection carried on the laptop (the manager lost them)"
        );
    }
    Ok(())
}

/// Read the TUN while this worker has no transport: hold what fits while a
/// hold window is open ([module docs](self)), answer everything else with
/// ICMP unreachable as [`crate::pump::refuse`] does, and answer what is
/// still held when the window closes. Runs until cancelled; returns only
/// when the TUN device fails.
pub async fn refuse_or_hold<T: PacketIo>(
    tun: Arc<T>,
    refusal: Arc<Refusal>,
    counters: Arc<Counters>,
    redial: Arc<Redial>,
) -> io::Error {
    let mut buf = vec![0u8; MAX_READ];
    let mut out = Vec::with_capacity(unreachable::MAX_V6_ERROR);
    let skip = if tun.vnet_hdr() { VNET_HDR_LEN } else { 0 };
    loop {
        // Only while reads are held does the window's end matter here.
        let deadline = lock(&redial.hold)
            .deadline()
            .filter(|_| redial.holding.load(Ordering::Relaxed));
        let expiry = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = expiry => {
                // The window closed with reads still held: refuse them now.
                while let Some(n) = {
                    let mut hold = lock(&redial.hold);
                    let n = hold.pop_into(&mut buf);
                    if n.is_none() {
                        redial.holding.store(false, Ordering::Relaxed);
                    }
                    n
                } {
                    let packet = buf.get(skip..n).unwrap_or_default();
                    if let Err(e) = crate::pump::refuse_packet(&*tun, packet, &refusal, &counters, &mut out).await {
                        return e;
                    }
                }
            }
            readable = tun.readable() => {
                if let Err(e) = readable {
                    return e;
                }
                loop {
                    match tun.try_recv(&mut buf) {
                        Ok(0) => {}
                        Ok(n) => {
                            let held = lock(&redial.hold).push(&buf[..n], Instant::now());
                            if held {
                                redial.holding.store(true, Ordering::Relaxed);
                                Counters::add(&counters.held_packets, 1);
                                continue;
                            }
                            let packet = buf.get(skip..n).unwrap_or_default();
                            if let Err(e) = crate::pump::refuse_packet(&*tun, packet, &refusal, &counters, &mut out).await {
                                return e;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return e,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use kvpn_proto::frame::{self, Kind};
    use smoltcp::wire::{IpAddress, Ipv4Packet, TcpPacket, TcpSeqNumber};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::UnixDatagram;

    use super::*;
    use crate::liveness::Liveness;
    use crate::pump::{self, PumpConfig};

    const LAPTOP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);
    const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);

    /// A TCP segment pod:8080 -> laptop:40000 (`inbound`) or back, ACK set.
    fn tcp(inbound: bool, seq: u32, ack: u32, payload: usize) -> Vec<u8> {
        tcp_port(40000, inbound, seq, ack, payload)
    }

    /// [`tcp`] with laptop port `port`.
    fn tcp_port(port: u16, inbound: bool, seq: u32, ack: u32, payload: usize) -> Vec<u8> {
        let (src, dst, sp, dp) = if inbound {
            (POD, LAPTOP, 8080, port)
        } else {
            (LAPTOP, POD, port, 8080)
        };
        let mut seg = vec![0u8; 20 + payload];
        let mut t = TcpPacket::new_unchecked(&mut seg[..]);
        t.set_src_port(sp);
        t.set_dst_port(dp);
        t.set_seq_number(TcpSeqNumber(seq as i32));
        t.set_ack_number(TcpSeqNumber(ack as i32));
        t.set_header_len(20);
        t.clear_flags();
        t.set_ack(true);
        t.set_window_len(1000);
        t.fill_checksum(&IpAddress::Ipv4(src), &IpAddress::Ipv4(dst));
        kvpn_lab::packets::ipv4(6, src, dst, &seg)
    }

    fn frame_of(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame::encode_into(kind, payload, &mut out).expect("fits");
        out
    }

    /// A pump with `redial` on `tun`; returns it and the manager's end.
    fn start_pump(
        tun: Arc<UnixDatagram>,
        liveness: Liveness,
        counters: &Arc<Counters>,
        redial: &Arc<Redial>,
    ) -> (
        tokio::task::JoinHandle<pump::PumpExit>,
        tokio::io::DuplexStream,
    ) {
        let (pump_end, manager) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        let pump = tokio::spawn(pump::run(
            tun,
            rx,
            tx,
            Arc::new(Mutex::new(liveness)),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig {
                redial: Some(redial.clone()),
                ..PumpConfig::default()
            },
        ));
        (pump, manager)
    }

    async fn recv(app: &UnixDatagram) -> Vec<u8> {
        let mut buf = vec![0u8; 65536];
        let n = tokio::time::timeout(Duration::from_secs(2), app.recv(&mut buf))
            .await
            .expect("a packet in time")
            .expect("recv");
        buf.truncate(n);
        buf
    }

    /// The pump's hooks end to end without root: a flow the worker carried
    /// is reset in the TUN when the re-dialled connection is answered "new",
    /// at the end of what was delivered; a flow opened after the answer is
    /// not.
    #[tokio::test]
    async fn a_new_answer_after_a_redial_resets_the_carried_flows() {
        let (tun_side, app) = UnixDatagram::pair().expect("socketpair");
        let redial = Arc::new(Redial::default());
        let counters = Arc::new(Counters::default());
        Counters::add(&counters.transports_lost, 1);
        let mut l = Liveness::new(Duration::from_secs(3600));
        l.handle_transport_up(Instant::now());
        let (pump, mut manager) = start_pump(Arc::new(tun_side), l, &counters, &redial);
        // The old connection delivered 100 bytes at 5000; the laptop acked 5050.
        let data = tcp(true, 5000, 1, 100);
        manager
            .write_all(&frame_of(Kind::Packet, &data))
            .await
            .expect("write");
        assert_eq!(recv(&app).await, data);
        app.send(&tcp(false, 1, 5050, 0)).await.expect("send");
        // The pump forwards the laptop's ACK (and a heartbeat).
        let mut sink = vec![0u8; 4096];
        let _ = manager.read(&mut sink).await.expect("pump output");
        for _ in 0..100 {
            if redial.flows() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(redial.flows(), 1);

        manager
            .write_all(&frame_of(Kind::Resume, &[ResumeAnswer::New.to_u8()]))
            .await
            .expect("write");
        let mut seqs = Vec::new();
        for _ in 0..2 {
            let rst = recv(&app).await;
            let ip = Ipv4Packet::new_checked(&rst[..]).expect("IPv4");
            assert_eq!((ip.src_addr(), ip.dst_addr()), (POD, LAPTOP));
            let t = TcpPacket::new_checked(ip.payload()).expect("TCP");
            assert!(t.rst());
            assert!(t.verify_checksum(&IpAddress::Ipv4(POD), &IpAddress::Ipv4(LAPTOP)));
            seqs.push(t.seq_number().0 as u32);
        }
        assert_eq!(seqs, vec![5100, 5050]);
        assert_eq!(Counters::get(&counters.tcp_flows_reset), 1);
        assert_eq!(redial.flows(), 0);
        pump.abort();
    }

    /// The inbound packets of a chunk are tracked under one lock, not one
    /// per packet (on main: one lock per packet, 64 here), and in order with
    /// a resume answer in the same chunk: the flow before a "new" answer is
    /// reset at the end of what it delivered, the one after it is not.
    #[tokio::test]
    async fn inbound_packets_are_tracked_per_chunk_in_order_with_the_answer() {
        let (tun_side, app) = UnixDatagram::pair().expect("socketpair");
        let redial = Arc::new(Redial::default());
        let counters = Arc::new(Counters::default());
        Counters::add(&counters.transports_lost, 1);
        let mut l = Liveness::new(Duration::from_secs(3600));
        l.handle_transport_up(Instant::now());
        let (pump, mut manager) = start_pump(Arc::new(tun_side), l, &counters, &redial);
        let mut wire = Vec::new();
        for i in 0..32 {
            wire.extend(frame_of(
                Kind::Packet,
                &tcp_port(40000, true, 5000 + i * 100, 1, 100),
            ));
        }
        wire.extend(frame_of(Kind::Resume, &[ResumeAnswer::New.to_u8()]));
        for i in 0..32 {
            wire.extend(frame_of(
                Kind::Packet,
                &tcp_port(40001, true, 9000 + i * 100, 1, 100),
            ));
        }
        manager.write_all(&wire).await.expect("write");
        let mut got = Vec::new();
        for _ in 0..65 {
            got.push(recv(&app).await);
        }
        let rst = Ipv4Packet::new_checked(&got[32][..]).expect("IPv4");
        let t = TcpPacket::new_checked(rst.payload()).expect("TCP");
        assert!(t.rst(), "the answer's RST comes right after the first flow");
        assert_eq!((t.dst_port(), t.seq_number().0 as u32), (40000, 8200));
        assert_eq!(got[33], tcp_port(40001, true, 9000, 1, 100));
        for _ in 0..100 {
            if redial.flows() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(redial.flows(), 1, "the flow after the answer is tracked");
        assert_eq!(Counters::get(&counters.tcp_flows_reset), 1);
        let locks = redial.inbound_locks.load(Ordering::Relaxed);
        assert!(
            (1..16).contains(&locks),
            "64 inbound packets took the lock {locks} times"
        );
        pump.abort();
    }

    /// Between transports, reads are held while the window is open and the
    /// next pump sends them first; without a window they are refused.
    #[tokio::test]
    async fn held_reads_go_out_first_on_the_next_pump() {
        let (tun_side, app) = UnixDatagram::pair().expect("socketpair");
        let tun = Arc::new(tun_side);
        let redial = Arc::new(Redial::default());
        let counters = Arc::new(Counters::default());
        // The manager answered a resume token; the connection ends.
        redial.resume_offered.store(true, Ordering::Relaxed);
        redial.transport_lost(Instant::now());
        let refuser = tokio::spawn(refuse_or_hold(
            tun.clone(),
            Arc::new(Refusal::default()),
            counters.clone(),
            redial.clone(),
        ));
        let syn = tcp(false, 1, 0, 0);
        app.send(&syn).await.expect("send");
        for _ in 0..100 {
            if Counters::get(&counters.held_packets) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(Counters::get(&counters.held_packets), 1);
        assert_eq!(Counters::get(&counters.refused_packets), 0);
        refuser.abort();
        let _ = refuser.await;

        let mut l = Liveness::new(Duration::from_secs(3600));
        l.handle_transport_up(Instant::now());
        l.handle_transport_down("killed");
        l.handle_transport_up(Instant::now());
        let (pump, mut manager) = start_pump(tun, l, &counters, &redial);
        // Reconnecting (no echo yet), inside the window: the held SYN goes out.
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(2);
        let packet = loop {
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout_at(deadline.into(), manager.read(&mut chunk))
                .await
                .expect("the held packet in time")
                .expect("read");
            got.extend_from_slice(&chunk[..n]);
            let mut off = 0;
            let mut found = None;
            while let Ok(Some((f, used))) = frame::Decoder::default().decode(&got[off..]) {
                if f.kind == Kind::Packet {
                    found = Some(f.payload.to_vec());
                    break;
                }
                off += used;
            }
            if let Some(p) = found {
                break p;
            }
        };
        assert_eq!(packet, syn);
        assert_eq!(Counters::get(&counters.refused_packets), 0);
        pump.abort();
    }

    #[test]
    fn the_hold_keeps_reads_in_order_within_its_bounds() {
        let now = Instant::now();
        let mut h = Hold::default();
        assert!(!h.push(b"early", now), "no window open");
        h.open(now);
        assert!(h.push(b"one", now));
        assert!(h.push(b"two!", now));
        let mut out = [0u8; 16];
        assert_eq!(h.pop_into(&mut out), Some(3));
        assert_eq!(&out[..3], b"one");
        assert!(h.push(b"three", now));
        assert_eq!(h.pop_into(&mut out), Some(4));
        assert_eq!(&out[..4], b"two!");
        assert_eq!(h.pop_into(&mut out), Some(5));
        assert_eq!(&out[..5], b"three");
        assert_eq!(h.pop_into(&mut out), None);
        assert!(h.is_empty());
        // Bounds: count, bytes, time.
        for _ in 0..HOLD_PACKETS {
            assert!(h.push(b"x", now));
        }
        assert!(!h.push(b"x", now), "packet bound");
        while h.pop_into(&mut out).is_some() {}
        assert!(h.push(&vec![0u8; HOLD_BYTES], now));
        assert!(!h.push(b"x", now), "byte bound");
        while h.pop_into(&mut out).is_some() {}
        assert!(!h.push(b"x", now + HOLD_WINDOW), "time bound");
    }
}
