//! The packet pump: moves packets between the TUN device and the transport to
//! the traffic manager, framed with [`kvpn_proto::frame`].
//!
//! Outbound is laptop → cluster, inbound is cluster → laptop. Four tasks, two per
//! direction, joined by bounded queues of reusable buffers:
//!
//! ```text
//! outbound: TUN ──tun_reader──▶ [full batches] ──transport_writer──▶ transport
//!                    ▲                                  │ (also heartbeats)
//!                    └──────────── [free batches] ◀─────┘
//! inbound:  transport ──transport_reader──▶ [full chunks] ──tun_writer──▶ TUN
//!                    ▲      │ (heartbeat echoes, at once) │
//!                    └──────────── [free chunks]  ◀─────┘
//! ```
//!
//! - `tun_reader` waits until the TUN is readable, then reads packets without
//!   blocking until EAGAIN or until the batch holds [`BATCH_PACKETS`] packets or
//!   [`BATCH_BYTES`] bytes.
//! - `transport_writer` frames a batch (a 3-byte header per packet) and sends it
//!   with one vectored write of all headers and payloads (`writev`).
//! - `transport_reader` reads the byte stream in chunks of up to
//!   [`READ_CHUNK_BYTES`]; whole frames go on, a partial frame at the end is
//!   carried over into the next chunk.
//! - `tun_writer` decodes the frames in place (zero-copy) and writes each packet
//!   to the TUN, waiting when the TUN would block.
//!
//! Offloads (a TUN device with `IFF_VNET_HDR`, [`crate::tun`]): every TUN
//! read starts with a `virtio_net_hdr`. `tun_reader` completes a partial
//! checksum in place; a TCP super-packet (up to 64 KiB, one read) goes to the
//! manager whole in a GSO frame (frame kind 5: the frame's GSO header takes
//! the place of the 10-byte `virtio_net_hdr`, no copy) once the manager's
//! hello said it accepts them, and is cut into MSS-sized packet frames by the
//! pump itself ([`kvpn_proto::gso`]) before that, with a manager that does
//! not (an older one), or when it does not fit one frame. Every packet
//! written to the TUN gets a header without offload
//! ([`crate::tun::VNET_HDR_NONE`]).
//!
//! Backpressure, never drops: there are exactly [`QUEUE_DEPTH`] buffers per
//! direction. A reader that finds no free buffer waits, so a slow transport stops
//! the TUN reads (the kernel's TUN queue then applies its own policy) and a slow
//! TUN stops the transport reads (TCP flow control reaches the manager). All
//! buffers are allocated when the pump starts; per-packet work does not allocate
//! (dataplane/tests/pump_alloc.rs counts the pump thread's allocations).
//!
//! Failing fast (case tr-10): while the session is reconnecting
//! ([`Liveness::is_reconnecting`]), `tun_reader` does not queue packets into the
//! transport; each one is answered with an ICMP / ICMPv6 destination
//! unreachable written back to the TUN ([`crate::unreachable`], rate-limited,
//! counted). Between transports, when no pump runs, [`refuse`] does the same.
//!
//! The only I/O here goes through [`PacketIo`] (the TUN device) and the
//! transport halves; liveness logic lives in [`crate::liveness`].

use std::future::Future;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kvpn_proto::frame::{
    self, Decoder, FrameError, GSO_HEADER_LEN, GsoHeader, HEADER_LEN, Kind, ManagerHello,
    OFFLOAD_TCP_GSO, ResumeAnswer,
};
use kvpn_proto::gso::{self, GsoError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::liveness::Liveness;
use crate::redial::{self, Redial};
use crate::tun::{MAX_READ, Offload, VNET_HDR_LEN, VNET_HDR_NONE, VnetError, VnetHdr};
use crate::unreachable::{self, RateLimit};

// A GSO frame's header is written over the read's virtio_net_hdr in place.
const _: () = assert!(GSO_HEADER_LEN == VNET_HDR_LEN);

/// Most packets per outbound batch (one `writev` of 2 × 64 iovecs).
pub const BATCH_PACKETS: usize = 64;

/// Payload bytes after which an outbound batch is closed: 256 KiB, about 29
/// packets at MTU 9000, well under the 4 MiB default TCP send buffer so a batch
/// write rarely blocks half-way.
pub const BATCH_BYTES: usize = 256 * 1024;

/// Largest packet a TUN read can return without IFF_VNET_HDR (the IPv4/IPv6
/// length fields are 16 bits). Every read is given at least [`MAX_READ`]
/// bytes of room (this plus the `virtio_net_hdr` and an IPv6 header), so a
/// packet is never truncated, whatever the MTU.
pub const MAX_PACKET: usize = 65535;

/// Bytes asked for per transport read (inbound). Larger than the largest frame
/// (65537 bytes), so a chunk always holds at least one whole frame.
pub const READ_CHUNK_BYTES: usize = 256 * 1024;

/// Buffers per direction: batches in flight between a reader and a writer.
/// Bounds the memory per session to 4 × ~660 KiB outbound (TUN reads plus
/// the segments of self-segmented super-packets) and 4 × 256 KiB inbound.
pub const QUEUE_DEPTH: usize = 4;

/// A packet device: the TUN device in production, a datagram socket in tests.
///
/// Each `try_recv` returns one whole packet (after a `virtio_net_hdr` when
/// [`PacketIo::vnet_hdr`]); `send` writes one whole packet (adding the header
/// itself), waiting while the device would block.
pub trait PacketIo: Send + Sync + 'static {
    /// True when every read starts with a [`VNET_HDR_LEN`]-byte
    /// `virtio_net_hdr` (`IFF_VNET_HDR` with offloads, [`crate::tun`]).
    fn vnet_hdr(&self) -> bool {
        false
    }
    /// Wait until a `try_recv` may succeed (it may still return WouldBlock).
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send;
    /// Read one packet without blocking; `WouldBlock` when none is queued.
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize>;
    /// Write one packet, waiting while the device would block.
    fn send(&self, packet: &[u8]) -> impl Future<Output = io::Result<usize>> + Send;
    /// Write one packet after the `virtio_net_hdr` `vnet` (a TCP
    /// super-packet the kernel segments or takes whole), in one write.
    /// Devices without [`PacketIo::vnet_hdr`] cannot: `Unsupported`.
    fn send_vnet(
        &self,
        vnet: &[u8; VNET_HDR_LEN],
        packet: &[u8],
    ) -> impl Future<Output = io::Result<usize>> + Send {
        let _ = (vnet, packet);
        std::future::ready(Err(io::ErrorKind::Unsupported.into()))
    }
}

impl PacketIo for tun_rs::AsyncDevice {
    fn vnet_hdr(&self) -> bool {
        // tun-rs reports IFF_VNET_HDR as "TCP GSO".
        self.tcp_gso()
    }
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send {
        tun_rs::AsyncDevice::readable(self)
    }
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        tun_rs::AsyncDevice::try_recv(self, buf)
    }
    async fn send(&self, packet: &[u8]) -> io::Result<usize> {
        if !self.tcp_gso() {
            return tun_rs::AsyncDevice::send(self, packet).await;
        }
        self.send_vnet(&VNET_HDR_NONE, packet).await
    }
    async fn send_vnet(&self, vnet: &[u8; VNET_HDR_LEN], packet: &[u8]) -> io::Result<usize> {
        if !self.tcp_gso() {
            return Err(io::ErrorKind::Unsupported.into());
        }
        let iov = [IoSlice::new(vnet), IoSlice::new(packet)];
        let n = tun_rs::AsyncDevice::send_vectored(self, &iov).await?;
        Ok(n.saturating_sub(VNET_HDR_LEN))
    }
}

/// A Unix datagram socket keeps packet boundaries like a TUN device, so one end
/// of a socket pair stands in for the TUN in tests and benchmarks without root.
impl PacketIo for tokio::net::UnixDatagram {
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send {
        tokio::net::UnixDatagram::readable(self)
    }
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        tokio::net::UnixDatagram::try_recv(self, buf)
    }
    fn send(&self, packet: &[u8]) -> impl Future<Output = io::Result<usize>> + Send {
        tokio::net::UnixDatagram::send(self, packet)
    }
}

/// Pump counters, shared with Status. Updated once per batch or chunk.
#[derive(Debug, Default)]
pub struct Counters {
    /// The manager's latest stats frame for this session and when it arrived
    /// (protocol version 3; `None` before the first, and with older managers).
    pub manager_stats: Mutex<Option<(frame::Stats, Instant)>>,
    /// Outbound (laptop → cluster) packets written to the transport; a TCP
    /// super-packet sent whole in a GSO frame counts once.
    pub tx_packets: AtomicU64,
    /// Outbound TCP super-packets sent whole in GSO frames (frame kind 5).
    pub tx_gso_frames: AtomicU64,
    /// Outbound TCP super-packets the pump cut into packet frames itself (the
    /// manager did not accept GSO frames, yet or at all, or one did not fit a
    /// frame).
    pub tx_gso_segmented: AtomicU64,
    /// TUN reads dropped because their offload could not be carried out (a
    /// bad `virtio_net_hdr`, a super-packet that cannot be segmented, a
    /// checksum outside the packet); counted, logged at debug.
    pub tx_offload_dropped: AtomicU64,
    /// Outbound IP bytes (frame headers not counted).
    pub tx_bytes: AtomicU64,
    /// Outbound batches, i.e. vectored writes.
    pub tx_batches: AtomicU64,
    /// Inbound (cluster → laptop) packets written to the TUN.
    pub rx_packets: AtomicU64,
    /// Inbound IP bytes written to the TUN.
    pub rx_bytes: AtomicU64,
    /// Inbound GSO frames (frame kind 5, offload bit 2 accepted): TCP
    /// super-packets the manager merged, each written to the TUN with its
    /// `virtio_net_hdr` in one write (and counted once in `rx_packets`).
    pub rx_gso_frames: AtomicU64,
    /// The TCP segments those super-packets carried (the packets the
    /// laptop's stack took from them): `rx_packets - rx_gso_frames +
    /// rx_gso_segments` is the packet count.
    pub rx_gso_segments: AtomicU64,
    /// Inbound packets the TUN refused as malformed (EINVAL), empty packet
    /// frames, and GSO frames that are not a valid TCP super-packet
    /// ([`gso::check_super_packet`]). Counted, logged at debug, not fatal.
    pub rx_invalid: AtomicU64,
    /// Heartbeats sent.
    pub heartbeats_sent: AtomicU64,
    /// Heartbeat echoes accepted.
    pub heartbeats_echoed: AtomicU64,
    /// Outbound packets read from the TUN while the session was reconnecting,
    /// and therefore not sent to the manager.
    pub refused_packets: AtomicU64,
    /// ICMP / ICMPv6 destination-unreachable messages written to the TUN for them.
    pub unreachable_sent: AtomicU64,
    /// Refused packets left unanswered because of the rate limit.
    pub unreachable_rate_limited: AtomicU64,
    /// Data connections that ended after the pump ran on them (each followed by
    /// a re-dial).
    pub transports_lost: AtomicU64,
    /// Re-dials whose flows the manager resumed (it answered hello option 5
    /// with "resumed": the parked engine of the lost connection went on).
    pub resumes: AtomicU64,
    /// Re-dials after which the manager answered "new": the flows of the lost
    /// connection were gone (manager restarted, grace expired).
    pub resumes_lost: AtomicU64,
    /// TCP flows reset on the laptop because a re-dial was answered "new"
    /// ([`crate::redial`]).
    pub tcp_flows_reset: AtomicU64,
    /// Packets held during a re-dial that may resume, or forwarded on the
    /// fresh connection before its first echo, instead of refused
    /// ([`crate::redial`]).
    pub held_packets: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Read a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Why the pump stopped. The session supervisor logs it, shows it as the reason
/// in Status and re-dials.
#[derive(Debug, thiserror::Error)]
pub enum PumpExit {
    /// The manager closed the transport (EOF).
    #[error("the traffic manager closed the data connection")]
    TransportClosed,
    /// Reading or writing the transport failed.
    #[error("data connection to the traffic manager failed: {0}")]
    Transport(#[source] io::Error),
    /// The manager sent bytes that are not a valid frame; the stream cannot be
    /// resynchronised.
    #[error("the traffic manager sent an invalid frame: {0}")]
    Protocol(#[source] FrameError),
    /// Reading or writing the TUN device failed.
    #[error("TUN device failed: {0}")]
    Tun(#[source] io::Error),
    /// No heartbeat echo for too long.
    #[error("{0}")]
    Silent(String),
    /// A pump task ended unexpectedly (panic or cancellation).
    #[error("pump task ended: {0}")]
    Task(String),
}

/// How one batch entry goes on the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum EntryKind {
    /// `buf[start..end]` is one IP packet: a packet frame.
    #[default]
    Packet,
    /// `buf[start..end]` is a GSO header and a TCP super-packet: a GSO frame.
    Gso,
    /// `framed[start..end]` are whole packet frames already (the segments of a
    /// super-packet the pump cut itself).
    Framed,
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    kind: EntryKind,
    start: usize,
    end: usize,
}

/// Why a TUN read's offload could not be carried out (the read is dropped
/// and counted in [`Counters::tx_offload_dropped`]).
#[derive(Debug, thiserror::Error)]
enum OffloadError {
    #[error("{0}")]
    Vnet(#[from] VnetError),
    #[error("{0}")]
    Gso(#[from] GsoError),
    #[error("{0}")]
    Frame(#[from] FrameError),
}

/// A batch of outbound packets: TUN reads back to back in `buf`, and the
/// segments of super-packets the pump cut itself, framed, in `framed`.
struct OutBatch {
    buf: Box<[u8]>,
    /// Bytes of `buf` in use.
    buf_used: usize,
    /// Packet frames of self-segmented super-packets; keeps its capacity.
    framed: Vec<u8>,
    entries: [Entry; BATCH_PACKETS],
    count: usize,
    /// IP packets (a GSO frame's super-packet counts once) and their bytes
    /// in this batch, frame headers not counted.
    packets: u64,
    ip_bytes: u64,
    /// Super-packets sent in GSO frames / segmented here.
    gso_frames: u64,
    segmented: u64,
}

impl OutBatch {
    fn new() -> Self {
        Self {
            buf: vec![0; BATCH_BYTES + MAX_READ].into_boxed_slice(),
            buf_used: 0,
            // A full batch of segments plus their repeated headers.
            framed: Vec::with_capacity(BATCH_BYTES + MAX_READ + MAX_READ / 4),
            entries: [Entry::default(); BATCH_PACKETS],
            count: 0,
            packets: 0,
            ip_bytes: 0,
            gso_frames: 0,
            segmented: 0,
        }
    }

    fn clear(&mut self) {
        self.buf_used = 0;
        self.framed.clear();
        self.count = 0;
        self.packets = 0;
        self.ip_bytes = 0;
        self.gso_frames = 0;
        self.segmented = 0;
    }

    fn is_full(&self) -> bool {
        self.count == BATCH_PACKETS
            || self.buf_used >= BATCH_BYTES
            || self.framed.len() >= BATCH_BYTES
    }

    fn push(&mut self, kind: EntryKind, start: usize, end: usize) {
        self.entries[self.count] = Entry { kind, start, end };
        self.count += 1;
    }

    /// A read of `n` bytes at `buf[start..]` from a device without offloads.
    fn push_plain(&mut self, start: usize, n: usize) {
        self.push(EntryKind::Packet, start, start + n);
        self.buf_used = start + n;
        self.packets += 1;
        self.ip_bytes += n as u64;
    }

    /// A read of `n` bytes at `buf[start..]` that starts with a
    /// `virtio_net_hdr`. `gso_ok`: the manager accepts GSO frames.
    fn push_vnet(&mut self, start: usize, n: usize, gso_ok: bool) -> Result<(), OffloadError> {
        let end = start + n;
        let (hdr, offload, _) = VnetHdr::parse(&self.buf[start..end])?;
        let ip = start + VNET_HDR_LEN;
        match offload {
            Offload::None => {}
            Offload::Checksum { start: at, offset } => {
                gso::complete_checksum(&mut self.buf[ip..end], at, offset)?;
            }
            Offload::Tcp { .. } if gso_ok && n <= frame::MAX_PAYLOAD_LEN => {
                // The GSO frame's header takes the virtio_net_hdr's 10 bytes.
                self.buf[start..ip].copy_from_slice(&hdr.to_frame_header().encode());
                self.push(EntryKind::Gso, start, end);
                self.buf_used = end;
                self.packets += 1;
                self.ip_bytes += (end - ip) as u64;
                self.gso_frames += 1;
                return Ok(());
            }
            Offload::Tcp { kind, gso_size } => {
                let at = self.framed.len();
                let seg = gso::segment_tcp(
                    &self.buf[ip..end],
                    kind,
                    gso_size,
                    &mut self.framed,
                    HEADER_LEN,
                )?;
                for span in seg.spans() {
                    match frame::encode_header(Kind::Packet, span.len()) {
                        Ok(h) => {
                            self.framed[span.start - HEADER_LEN..span.start].copy_from_slice(&h)
                        }
                        Err(e) => {
                            self.framed.truncate(at);
                            return Err(e.into());
                        }
                    }
                }
                // The read's space in `buf` is reused by the next read.
                self.push(EntryKind::Framed, at, self.framed.len());
                self.packets += seg.count as u64;
                self.ip_bytes += (self.framed.len() - at - seg.count * HEADER_LEN) as u64;
                self.segmented += 1;
                return Ok(());
            }
        }
        self.push(EntryKind::Packet, ip, end);
        self.buf_used = end;
        self.packets += 1;
        self.ip_bytes += (end - ip) as u64;
        Ok(())
    }

    /// The bytes of entry `i` after its frame header (all of it for `Framed`).
    fn payload(&self, i: usize) -> &[u8] {
        let e = self.entries[i];
        match e.kind {
            EntryKind::Packet | EntryKind::Gso => &self.buf[e.start..e.end],
            EntryKind::Framed => &self.framed[e.start..e.end],
        }
    }

    /// The IP packet of entry `i` (a super-packet for `Gso`, the first
    /// segment for `Framed`), to answer with ICMP unreachable.
    fn ip_packet(&self, i: usize) -> &[u8] {
        let payload = self.payload(i);
        match self.entries[i].kind {
            EntryKind::Packet => payload,
            EntryKind::Gso => payload.get(GSO_HEADER_LEN..).unwrap_or_default(),
            EntryKind::Framed => Decoder::default()
                .decode(payload)
                .ok()
                .flatten()
                .map_or(&[][..], |(f, _)| f.payload),
        }
    }
}

/// An inbound chunk: `buf[..len]` holds whole frames.
struct InChunk {
    buf: Box<[u8]>,
    len: usize,
}

/// Pump settings.
#[derive(Debug, Clone)]
pub struct PumpConfig {
    /// Largest frame accepted from the manager (length field, bytes).
    pub max_frame_len: usize,
    /// The worker this pump runs for (its index in the session), for logs.
    pub worker: usize,
    /// The session is being torn down when this turns true: the writer sends
    /// [`ResumeAnswer::Leaving`] (so the manager drops this connection's
    /// engine at once instead of parking it for a resume) and the pump stops.
    pub stop: Option<watch::Receiver<bool>>,
    /// The worker's re-dial state ([`crate::redial`]): flows to reset on a
    /// "new" answer, reads held during a re-dial. `None`: neither.
    pub redial: Option<Arc<Redial>>,
}

impl Default for PumpConfig {
    fn default() -> Self {
        Self {
            max_frame_len: frame::MAX_FRAME_LEN,
            worker: 0,
            stop: None,
            redial: None,
        }
    }
}

fn lock(liveness: &Mutex<Liveness>) -> std::sync::MutexGuard<'_, Liveness> {
    // A panic while holding the lock cannot leave Liveness half-updated in a way
    // that matters more than losing the session; keep going with its state.
    liveness.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The unreachable-message rate limit of one session, shared by the pumps of
/// its transports and the [`refuse`] loop between them.
#[derive(Debug, Default)]
pub struct Refusal {
    limit: Mutex<RateLimit>,
}

impl Refusal {
    /// A session limit of `per_sec` messages per second, `burst` at once.
    pub fn new(per_sec: u32, burst: u32) -> Self {
        Self {
            limit: Mutex::new(RateLimit::new(per_sec, burst)),
        }
    }

    fn allow(&self, now: Instant) -> bool {
        self.limit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .allow(now)
    }
}

/// Answer one outbound `packet` that will not reach the manager with an ICMP
/// unreachable written to the TUN, if it is eligible and the rate limit allows.
/// `out` is scratch space. Fails only when the TUN write fails.
pub(crate) async fn refuse_packet<T: PacketIo>(
    tun: &T,
    packet: &[u8],
    refusal: &Refusal,
    counters: &Counters,
    out: &mut Vec<u8>,
) -> io::Result<()> {
    Counters::add(&counters.refused_packets, 1);
    if let Err(why) = unreachable::build(packet, out) {
        tracing::trace!(%why, len = packet.len(), "refused packet left unanswered");
        return Ok(());
    }
    if !refusal.allow(Instant::now()) {
        Counters::add(&counters.unreachable_rate_limited, 1);
        return Ok(());
    }
    match tun.send(out).await {
        Ok(_) => {
            Counters::add(&counters.unreachable_sent, 1);
            Ok(())
        }
        // Same as tun_writer: a packet the TUN refuses is not fatal.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Read the TUN while no transport is up and answer every packet with an ICMP
/// unreachable (rate-limited), so that connects toward the cluster fail at once
/// with "No route to host" instead of hanging. Runs until cancelled; returns
/// only when the TUN device fails.
pub async fn refuse<T: PacketIo>(
    tun: Arc<T>,
    refusal: Arc<Refusal>,
    counters: Arc<Counters>,
) -> io::Error {
    let mut buf = vec![0u8; MAX_READ];
    let mut out = Vec::with_capacity(unreachable::MAX_V6_ERROR);
    let skip = if tun.vnet_hdr() { VNET_HDR_LEN } else { 0 };
    loop {
        match tun.try_recv(&mut buf) {
            Ok(0) => {}
            Ok(n) => {
                let packet = buf.get(skip..n).unwrap_or_default();
                if let Err(e) = refuse_packet(&*tun, packet, &refusal, &counters, &mut out).await {
                    return e;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(e) = tun.readable().await {
                    return e;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return e,
        }
    }
}

/// Run the pump on one transport until it fails. The caller owns the session:
/// it marks the transport up in `liveness` before calling and re-dials after.
///
/// Cancel-safe: dropping the future aborts the four tasks.
pub async fn run<T, R, W>(
    tun: Arc<T>,
    transport_rx: R,
    transport_tx: W,
    liveness: Arc<Mutex<Liveness>>,
    counters: Arc<Counters>,
    refusal: Arc<Refusal>,
    config: PumpConfig,
) -> PumpExit
where
    T: PacketIo,
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (out_free_tx, out_free_rx) = mpsc::channel(QUEUE_DEPTH);
    let (out_full_tx, out_full_rx) = mpsc::channel(QUEUE_DEPTH);
    let (in_free_tx, in_free_rx) = mpsc::channel(QUEUE_DEPTH);
    let (in_full_tx, in_full_rx) = mpsc::channel(QUEUE_DEPTH);
    for _ in 0..QUEUE_DEPTH {
        // Cannot fail: the channels have room for exactly QUEUE_DEPTH buffers.
        let _ = out_free_tx.try_send(OutBatch::new());
        let _ = in_free_tx.try_send(InChunk {
            buf: vec![0; READ_CHUNK_BYTES].into_boxed_slice(),
            len: 0,
        });
    }

    // Set when the manager's hello accepts GSO frames (per transport: a
    // re-dialled manager may be another version).
    let gso_ok = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();
    tasks.spawn(tun_reader(
        tun.clone(),
        out_free_rx,
        out_full_tx,
        liveness.clone(),
        refusal,
        counters.clone(),
        gso_ok.clone(),
        config.redial.clone(),
    ));
    tasks.spawn(transport_writer(
        transport_tx,
        out_full_rx,
        out_free_tx,
        liveness.clone(),
        counters.clone(),
        config.stop.clone(),
    ));
    let redial = config.redial.clone();
    tasks.spawn(transport_reader(
        transport_rx,
        in_free_rx,
        in_full_tx,
        liveness.clone(),
        counters.clone(),
        config,
        gso_ok,
    ));
    tasks.spawn(tun_writer(tun, in_full_rx, in_free_tx, counters, redial));

    // Watchdog: a black-holed transport can block the writer forever, so the
    // silence check cannot live in the writer.
    let interval = lock(&liveness).interval();
    let mut watchdog = tokio::time::interval(interval / 4);
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let exit = loop {
        tokio::select! {
            joined = tasks.join_next() => {
                break match joined {
                    Some(Ok(exit)) => exit,
                    Some(Err(e)) => PumpExit::Task(e.to_string()),
                    None => PumpExit::Task("no pump tasks".to_owned()),
                };
            }
            _ = watchdog.tick() => {
                let now = Instant::now();
                let mut liveness = lock(&liveness);
                // Ticks come every interval/4; one a whole interval late means this
                // process did not run (stopped, starved), not that the manager was
                // silent: the echoes may be unread in the socket.
                if let Some(stall) = liveness.handle_tick(now) {
                    tracing::info!(
                        stalled_ms = stall.as_millis() as u64,
                        "the pump did not run for a while (process stopped?); giving the \
                         transport one heartbeat interval before judging its silence"
                    );
                }
                if liveness.transport_dead(now) {
                    let reason = liveness.state(now).1.unwrap_or_else(|| "no heartbeat echo".to_owned());
                    break PumpExit::Silent(reason);
                }
            }
        }
    };
    tasks.abort_all();
    exit
}

#[allow(
    clippy::too_many_arguments,
    reason = "the reader's queues and shared state, moved into one task per pump"
)]
async fn tun_reader<T: PacketIo>(
    tun: Arc<T>,
    mut free_rx: mpsc::Receiver<OutBatch>,
    full_tx: mpsc::Sender<OutBatch>,
    liveness: Arc<Mutex<Liveness>>,
    refusal: Arc<Refusal>,
    counters: Arc<Counters>,
    gso_ok: Arc<AtomicBool>,
    redial: Option<Arc<Redial>>,
) -> PumpExit {
    let mut out = Vec::with_capacity(unreachable::MAX_V6_ERROR);
    let mut held: Option<OutBatch> = None;
    let vnet = tun.vnet_hdr();
    loop {
        let mut batch = match held.take() {
            Some(batch) => batch,
            None => match free_rx.recv().await {
                Some(batch) => batch,
                None => return PumpExit::Task("outbound buffer queue closed".to_owned()),
            },
        };
        batch.clear();
        let mut dropped = 0;
        while !batch.is_full() {
            let start = batch.buf_used;
            match redial::recv(&redial, &*tun, &mut batch.buf[start..]) {
                Ok(0) => continue,
                Ok(n) if vnet => {
                    // The manager's hello may arrive while this batch fills.
                    if let Err(e) = batch.push_vnet(start, n, gso_ok.load(Ordering::Relaxed)) {
                        dropped += 1;
                        tracing::debug!(error = %e, len = n, "TUN read dropped: its offload cannot be done");
                    }
                }
                Ok(n) => batch.push_plain(start, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if batch.count > 0 {
                        break;
                    }
                    if let Err(e) = tun.readable().await {
                        return PumpExit::Tun(e);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return PumpExit::Tun(e),
            }
        }
        Counters::add(&counters.tx_offload_dropped, dropped);
        tracing::trace!(
            entries = batch.count,
            bytes = batch.ip_bytes,
            "outbound batch read"
        );
        // One lock per batch, not per packet.
        let now = Instant::now();
        if lock(&liveness).is_reconnecting(now)
            && !redial::forwards_while_reconnecting(&redial, now, &counters, batch.packets)
        {
            for i in 0..batch.count {
                if let Err(e) =
                    refuse_packet(&*tun, batch.ip_packet(i), &refusal, &counters, &mut out).await
                {
                    return PumpExit::Tun(e);
                }
            }
            // Still owned here: reuse it for the next read.
            held = Some(batch);
            continue;
        }
        redial::track_outbound(&redial, (0..batch.count).map(|i| batch.ip_packet(i)));
        if full_tx.send(batch).await.is_err() {
            return PumpExit::Task("outbound batch queue closed".to_owned());
        }
    }
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(
    writer: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = writer.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

async fn transport_writer<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut full_rx: mpsc::Receiver<OutBatch>,
    free_tx: mpsc::Sender<OutBatch>,
    liveness: Arc<Mutex<Liveness>>,
    counters: Arc<Counters>,
    mut stop: Option<watch::Receiver<bool>>,
) -> PumpExit {
    let mut headers = [[0u8; HEADER_LEN]; BATCH_PACKETS];
    let mut heartbeat = [0u8; HEADER_LEN + 8];
    loop {
        let due = lock(&liveness).poll_timeout();
        let sleep = async {
            match due {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = stopping(&mut stop) => {
                let mut bye = Vec::with_capacity(HEADER_LEN + 1);
                // Cannot fail: a 1-byte payload fits any frame.
                let _ = frame::encode_into(Kind::Resume, &[ResumeAnswer::Leaving.to_u8()], &mut bye);
                if writer.write_all(&bye).await.is_ok() {
                    let _ = writer.flush().await;
                }
                return PumpExit::Task("the session is being torn down".to_owned());
            }
            () = sleep => {
                let nonce = lock(&liveness).poll_heartbeat(Instant::now());
                if let Some(nonce) = nonce {
                    let header = match frame::encode_header(Kind::Heartbeat, nonce.len()) {
                        Ok(h) => h,
                        // Unreachable: an 8-byte payload fits any frame.
                        Err(e) => return PumpExit::Protocol(e),
                    };
                    heartbeat[..HEADER_LEN].copy_from_slice(&header);
                    heartbeat[HEADER_LEN..].copy_from_slice(&nonce);
                    if let Err(e) = writer.write_all(&heartbeat).await {
                        return PumpExit::Transport(e);
                    }
                    Counters::add(&counters.heartbeats_sent, 1);
                    tracing::trace!(nonce = u64::from_be_bytes(nonce), "heartbeat sent");
                }
            }
            batch = full_rx.recv() => {
                let Some(batch) = batch else {
                    return PumpExit::Task("outbound batch queue closed".to_owned());
                };
                for (i, header) in headers.iter_mut().enumerate().take(batch.count) {
                    let kind = match batch.entries[i].kind {
                        EntryKind::Packet => Kind::Packet,
                        EntryKind::Gso => Kind::Gso,
                        EntryKind::Framed => continue,
                    };
                    match frame::encode_header(kind, batch.payload(i).len()) {
                        Ok(h) => *header = h,
                        // A TUN packet is at most 65535 bytes; only a 65535-byte
                        // one does not fit (MTU <= 65534 is enforced at Connect);
                        // a GSO frame is sent only when it fits.
                        Err(e) => return PumpExit::Protocol(e),
                    }
                }
                let mut iov = [IoSlice::new(&[]); 2 * BATCH_PACKETS];
                for (i, pair) in iov.chunks_exact_mut(2).enumerate().take(batch.count) {
                    if batch.entries[i].kind == EntryKind::Framed {
                        pair[0] = IoSlice::new(batch.payload(i));
                    } else {
                        pair[0] = IoSlice::new(&headers[i]);
                        pair[1] = IoSlice::new(batch.payload(i));
                    }
                }
                if let Err(e) = write_all_vectored(&mut writer, &mut iov[..2 * batch.count]).await {
                    return PumpExit::Transport(e);
                }
                if let Err(e) = writer.flush().await {
                    return PumpExit::Transport(e);
                }
                Counters::add(&counters.tx_packets, batch.packets);
                Counters::add(&counters.tx_bytes, batch.ip_bytes);
                Counters::add(&counters.tx_batches, 1);
                Counters::add(&counters.tx_gso_frames, batch.gso_frames);
                Counters::add(&counters.tx_gso_segmented, batch.segmented);
                if free_tx.send(batch).await.is_err() {
                    return PumpExit::Task("outbound buffer queue closed".to_owned());
                }
            }
        }
    }
}

/// Heartbeat echoes are taken here, as soon as they are read, not in
/// `tun_writer`: they must never wait behind queued inbound packets. Any frame
/// read also proves the transport alive ([`Liveness::handle_inbound`]).
async fn transport_reader<R: AsyncRead + Unpin>(
    mut reader: R,
    mut free_rx: mpsc::Receiver<InChunk>,
    full_tx: mpsc::Sender<InChunk>,
    liveness: Arc<Mutex<Liveness>>,
    counters: Arc<Counters>,
    config: PumpConfig,
    gso_ok: Arc<AtomicBool>,
) -> PumpExit {
    let decoder = Decoder::with_max_len(config.max_frame_len);
    let Some(mut cur) = free_rx.recv().await else {
        return PumpExit::Task("inbound buffer queue closed".to_owned());
    };
    // cur.buf[..complete] holds whole frames, cur.buf[complete..filled] the
    // start of the next one.
    let mut filled = 0;
    let mut complete = 0;
    loop {
        let n = match reader.read(&mut cur.buf[filled..]).await {
            Ok(0) => return PumpExit::TransportClosed,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return PumpExit::Transport(e),
        };
        filled += n;
        let before = complete;
        let mut echoes = 0;
        loop {
            match decoder.decode(&cur.buf[complete..filled]) {
                Ok(Some((frame, used))) => {
                    if frame.kind == Kind::Stats {
                        match frame::Stats::decode(frame.payload) {
                            Ok(stats) => {
                                *counters
                                    .manager_stats
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner) =
                                    Some((stats, Instant::now()));
                            }
                            Err(e) => tracing::debug!(error = %e, "manager stats frame ignored"),
                        }
                    }
                    if frame.kind == Kind::Hello {
                        // The manager's answer to the offloads the hello offered.
                        match ManagerHello::decode(frame.payload) {
                            Ok(h) => {
                                let accepted = h.offloads & OFFLOAD_TCP_GSO != 0;
                                tracing::info!(
                                    manager_version = h.version,
                                    gso_frames = accepted,
                                    gso_frames_inbound = h.offloads & frame::OFFLOAD_TCP_GRO != 0,
                                    "manager hello read"
                                );
                                gso_ok.store(accepted, Ordering::Relaxed);
                            }
                            Err(e) => tracing::debug!(error = %e, "manager hello ignored"),
                        }
                    }
                    if frame.kind == Kind::Resume {
                        resume_answer(frame.payload, &counters, config.worker);
                    }
                    if frame.kind == Kind::Heartbeat {
                        if lock(&liveness).handle_echo(frame.payload, Instant::now()) {
                            tracing::trace!("heartbeat echo read");
                            echoes += 1;
                        } else {
                            tracing::debug!(
                                len = frame.payload.len(),
                                "unexpected heartbeat echo ignored"
                            );
                        }
                    }
                    complete += used;
                }
                Ok(None) => break,
                Err(e) => return PumpExit::Protocol(e),
            }
        }
        if complete > before {
            lock(&liveness).handle_inbound(Instant::now());
        }
        Counters::add(&counters.heartbeats_echoed, echoes);
        if complete == 0 {
            // Only part of a frame so far; the buffer has room for a whole one.
            continue;
        }
        let Some(mut next) = free_rx.recv().await else {
            return PumpExit::Task("inbound buffer queue closed".to_owned());
        };
        let tail = filled - complete;
        next.buf[..tail].copy_from_slice(&cur.buf[complete..filled]);
        cur.len = complete;
        if full_tx.send(cur).await.is_err() {
            return PumpExit::Task("inbound chunk queue closed".to_owned());
        }
        cur = next;
        filled = tail;
        complete = 0;
    }
}

/// Resolves once `stop` is true; never without one (or once its sender is
/// gone without saying so).
async fn stopping(stop: &mut Option<watch::Receiver<bool>>) {
    if let Some(rx) = stop {
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                break;
            }
        }
        if *rx.borrow() {
            return;
        }
    }
    std::future::pending().await
}

/// The manager's answer to hello option 5 (a [`Kind::Resume`] frame): count
/// and log whether this connection got the flows of the lost one back.
fn resume_answer(payload: &[u8], counters: &Counters, worker: usize) {
    let redial = Counters::get(&counters.transports_lost) > 0;
    match ResumeAnswer::decode(payload) {
        Some(ResumeAnswer::Resumed) => {
            Counters::add(&counters.resumes, 1);
            tracing::info!("worker {worker} resumed its flows after a re-dial");
        }
        Some(ResumeAnswer::New) if redial => {
            Counters::add(&counters.resumes_lost, 1);
            tracing::warn!(
                "flows of worker {worker} were lost (manager restarted or grace expired)"
            );
        }
        Some(ResumeAnswer::New) => {
            tracing::debug!("the traffic manager takes resume tokens");
        }
        Some(ResumeAnswer::Leaving) => {
            tracing::debug!("a manager's 'leaving' answer ignored (laptop to manager only)");
        }
        None => tracing::debug!(len = payload.len(), "resume answer ignored"),
    }
}

/// Write the super-packet of a GSO frame from the manager to the TUN with
/// its `virtio_net_hdr`: `Some((bytes, segments))` written, `None` when the frame is not
/// a valid TCP super-packet or the device refused it (EINVAL) or cannot take
/// one (no `IFF_VNET_HDR`); an error only when the TUN write failed.
async fn write_gso<T: PacketIo>(tun: &T, payload: &[u8]) -> io::Result<Option<(u64, u64)>> {
    let checked = GsoHeader::split(payload).ok_or(GsoError::Truncated {
        need: GSO_HEADER_LEN,
        len: payload.len(),
    });
    let (h, packet, segments) = match checked.and_then(|(h, p)| {
        gso::super_packet_segments(
            p,
            h.flags,
            h.gso_type,
            h.gso_size,
            h.csum_start,
            h.csum_offset,
        )
        .map(|(_, segments)| (h, p, segments as u64))
    }) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, len = payload.len(), "GSO frame from the manager dropped");
            return Ok(None);
        }
    };
    match tun
        .send_vnet(&VnetHdr::from_frame_header(h).encode(), packet)
        .await
    {
        Ok(_) => Ok(Some((packet.len() as u64, segments))),
        Err(e)
            if e.raw_os_error() == Some(libc::EINVAL) || e.kind() == io::ErrorKind::Unsupported =>
        {
            tracing::debug!(error = %e, len = packet.len(), "TUN refused a GSO super-packet");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Room for this many inbound packets per chunk in the writer's re-dial
/// tracking list before it grows (16 bytes each).
const TRACKED_PER_CHUNK: usize = 1024;

async fn tun_writer<T: PacketIo>(
    tun: Arc<T>,
    mut full_rx: mpsc::Receiver<InChunk>,
    free_tx: mpsc::Sender<InChunk>,
    counters: Arc<Counters>,
    redial: Option<Arc<Redial>>,
) -> PumpExit {
    // The reader validated every frame header already; this decoder only finds
    // the boundaries again.
    let decoder = Decoder::default();
    // The spans (in the chunk) of the IP packets written to the TUN and not
    // yet tracked for re-dials: tracked once per chunk, under one lock taken
    // after the TUN writes (and before a resume answer, which resets only
    // the flows before it). Allocated once; it grows only past the most
    // packets a chunk ever held.
    let mut delivered: Vec<(usize, usize)> = if redial.is_some() {
        Vec::with_capacity(TRACKED_PER_CHUNK)
    } else {
        Vec::new()
    };
    let track = |delivered: &mut Vec<(usize, usize)>, buf: &[u8]| {
        redial::track_inbound(
            &redial,
            delivered
                .drain(..)
                .filter_map(|(start, end)| buf.get(start..end)),
        );
    };
    loop {
        let Some(chunk) = full_rx.recv().await else {
            return PumpExit::Task("inbound chunk queue closed".to_owned());
        };
        let (mut packets, mut bytes, mut invalid) = (0u64, 0u64, 0u64);
        let (mut gso_frames, mut gso_segments) = (0u64, 0u64);
        let mut off = 0;
        // An error ends the pump, after the packets written so far are
        // tracked (the next re-dial may need to reset their flows).
        let exit = 'frames: {
            while off < chunk.len {
                let (frame, used) = match decoder.decode(&chunk.buf[off..chunk.len]) {
                    Ok(Some(found)) => found,
                    Ok(None) => break,
                    Err(e) => break 'frames Some(PumpExit::Protocol(e)),
                };
                off += used;
                match frame.kind {
                    Kind::Packet if frame.payload.is_empty() => invalid += 1,
                    Kind::Packet => match tun.send(frame.payload).await {
                        Ok(_) => {
                            packets += 1;
                            bytes += frame.payload.len() as u64;
                            if redial.is_some() {
                                delivered.push((off - frame.payload.len(), off));
                            }
                        }
                        // The TUN driver rejects what is not IPv4/IPv6 with EINVAL
                        // (drivers/net/tun.c, tun_get_user); one bad packet from the
                        // manager must not end the session.
                        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                            invalid += 1;
                            tracing::debug!(
                                len = frame.payload.len(),
                                "TUN refused an inbound packet"
                            );
                        }
                        Err(e) => break 'frames Some(PumpExit::Tun(e)),
                    },
                    // In order with the packets: resets only the flows before it.
                    Kind::Resume => {
                        track(&mut delivered, &chunk.buf);
                        if let Err(e) =
                            redial::resume_answer(&redial, &*tun, frame.payload, &counters).await
                        {
                            break 'frames Some(PumpExit::Tun(e));
                        }
                    }
                    // Taken by `transport_reader` already.
                    Kind::Heartbeat | Kind::Stats | Kind::Hello => {}
                    Kind::Gso => match write_gso(&*tun, frame.payload).await {
                        Ok(Some((n, segments))) => {
                            (packets, bytes) = (packets + 1, bytes + n);
                            (gso_frames, gso_segments) = (gso_frames + 1, gso_segments + segments);
                            // The super-packet's sequence end is what the laptop got.
                            if redial.is_some() && frame.payload.len() > GSO_HEADER_LEN {
                                delivered.push((off - frame.payload.len() + GSO_HEADER_LEN, off));
                            }
                        }
                        Ok(None) => invalid += 1,
                        Err(e) => break 'frames Some(PumpExit::Tun(e)),
                    },
                    Kind::Unknown(_) => {
                        tracing::debug!(
                            kind = frame.kind.to_u8(),
                            "frame of a kind the client ignores"
                        );
                    }
                }
            }
            None
        };
        track(&mut delivered, &chunk.buf);
        Counters::add(&counters.rx_packets, packets);
        Counters::add(&counters.rx_bytes, bytes);
        Counters::add(&counters.rx_invalid, invalid);
        Counters::add(&counters.rx_gso_frames, gso_frames);
        Counters::add(&counters.rx_gso_segments, gso_segments);
        if let Some(exit) = exit {
            return exit;
        }
        if free_tx.send(chunk).await.is_err() {
            return PumpExit::Task("inbound buffer queue closed".to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::UnixDatagram;

    use super::*;
    use crate::liveness::State;

    const LONG: Duration = Duration::from_secs(3600);

    /// A pump with default settings on a vnet-header TUN stand-in (`tun_side`)
    /// and the transport `pump_end`, connected (liveness up).
    fn vnet_pump(
        tun_side: UnixDatagram,
        pump_end: tokio::io::DuplexStream,
        counters: &Arc<Counters>,
    ) -> tokio::task::JoinHandle<PumpExit> {
        let (rx, tx) = tokio::io::split(pump_end);
        tokio::spawn(run(
            Arc::new(VnetDatagram(tun_side)),
            rx,
            tx,
            liveness_up(LONG),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        ))
    }

    fn liveness_up(interval: Duration) -> Arc<Mutex<Liveness>> {
        let mut l = Liveness::new(interval);
        l.handle_transport_up(Instant::now());
        Arc::new(Mutex::new(l))
    }

    /// A packet with a recognisable body: `seq` in the first 4 bytes.
    fn packet(seq: u32, len: usize) -> Vec<u8> {
        let mut p = vec![(seq % 251) as u8; len.max(4)];
        p[..4].copy_from_slice(&seq.to_be_bytes());
        p
    }

    fn len_for(seq: u32) -> usize {
        // Sizes from tiny to jumbo, so batches close on bytes as well as count.
        [20, 60, 576, 1500, 9000, 40][seq as usize % 6]
    }

    /// Read frames from the manager's end of the transport (test side).
    struct FrameReader<R> {
        inner: R,
        buf: Vec<u8>,
    }

    impl<R: AsyncRead + Unpin> FrameReader<R> {
        fn new(inner: R) -> Self {
            Self {
                inner,
                buf: Vec::new(),
            }
        }

        async fn next(&mut self) -> Option<(Kind, Vec<u8>)> {
            loop {
                if let Some((f, used)) = Decoder::default()
                    .decode(&self.buf)
                    .expect("valid frames from the pump")
                {
                    let out = (f.kind, f.payload.to_vec());
                    self.buf.drain(..used);
                    return Some(out);
                }
                let mut chunk = [0u8; 4096];
                let n = self.inner.read(&mut chunk).await.expect("transport read");
                if n == 0 {
                    return None;
                }
                self.buf.extend_from_slice(&chunk[..n]);
            }
        }

        async fn next_packet(&mut self) -> Option<Vec<u8>> {
            loop {
                match self.next().await? {
                    (Kind::Packet, p) => return Some(p),
                    (Kind::Heartbeat, _) => continue,
                    (other, _) => panic!("unexpected frame kind {other:?} from the pump"),
                }
            }
        }
    }

    #[tokio::test]
    async fn queued_packets_leave_in_one_batch_in_order() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        // A Unix datagram queue holds 10 datagrams by default
        // (net.unix.max_dgram_qlen); queue them all before the pump starts.
        for seq in 0..10 {
            app_side
                .send(&packet(seq, len_for(seq)))
                .await
                .expect("queue packet");
        }
        let (pump_end, manager_end) = tokio::io::duplex(1 << 20);
        let (rx, tx) = tokio::io::split(pump_end);
        let counters = Arc::new(Counters::default());
        let pump = tokio::spawn(run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness_up(LONG),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        ));
        let mut frames = FrameReader::new(manager_end);
        for seq in 0..10 {
            let got = frames.next_packet().await.expect("a packet frame");
            assert_eq!(got, packet(seq, len_for(seq)), "packet {seq}");
        }
        assert_eq!(Counters::get(&counters.tx_packets), 10);
        assert_eq!(
            Counters::get(&counters.tx_batches),
            1,
            "10 queued packets must leave in one vectored write"
        );
        let bytes: usize = (0..10).map(len_for).sum();
        assert_eq!(Counters::get(&counters.tx_bytes), bytes as u64);
        pump.abort();
    }

    #[tokio::test]
    async fn slow_transport_backpressures_without_loss() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        // A small pipe: the pump's writes block long before the app is done.
        let (pump_end, manager_end) = tokio::io::duplex(16 * 1024);
        let (rx, tx) = tokio::io::split(pump_end);
        let counters = Arc::new(Counters::default());
        let pump = tokio::spawn(run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness_up(LONG),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        ));
        const N: u32 = 3000;
        let app = tokio::spawn(async move {
            for seq in 0..N {
                app_side
                    .send(&packet(seq, len_for(seq)))
                    .await
                    .expect("send waits, never fails");
            }
            app_side
        });
        let mut frames = FrameReader::new(manager_end);
        for seq in 0..N {
            if seq % 500 == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let got = frames.next_packet().await.expect("a packet frame");
            assert_eq!(got, packet(seq, len_for(seq)), "packet {seq}");
        }
        let _app_side = app.await.expect("app task");
        assert_eq!(Counters::get(&counters.tx_packets), u64::from(N));
        assert!(Counters::get(&counters.tx_batches) <= u64::from(N));
        pump.abort();
    }

    #[tokio::test]
    async fn inbound_frames_split_across_reads_reach_the_tun_whole_and_in_order() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        // 7-byte pipe: every frame header and payload arrives in pieces.
        let (pump_end, mut manager_end) = tokio::io::duplex(7);
        let (rx, tx) = tokio::io::split(pump_end);
        let counters = Arc::new(Counters::default());
        let pump = tokio::spawn(run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness_up(LONG),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        ));
        const N: u32 = 300;
        let manager = tokio::spawn(async move {
            let mut wire = Vec::new();
            for seq in 0..N {
                frame::encode_into(Kind::Packet, &packet(seq, len_for(seq)), &mut wire)
                    .expect("fits");
                if seq % 7 == 0 {
                    // Frames the client must skip without losing sync.
                    frame::encode_into(Kind::Unknown(99), b"from a newer manager", &mut wire)
                        .expect("fits");
                    frame::encode_into(Kind::Heartbeat, &[9; 8], &mut wire).expect("fits");
                    // The manager's counters (version 3): kept for Status,
                    // never written to the TUN device.
                    let stats = frame::Stats {
                        counters: vec![
                            (frame::stat::REFUSED_CAP.to_owned(), u64::from(seq)),
                            ("drop_intake_full".to_owned(), 2),
                        ],
                    };
                    frame::encode_into(Kind::Stats, &stats.encode().expect("encodes"), &mut wire)
                        .expect("fits");
                }
            }
            manager_end.write_all(&wire).await.expect("write frames");
            manager_end
        });
        let mut buf = vec![0u8; 65536];
        for seq in 0..N {
            // Reading slowly now and then: the pump must wait, not drop.
            if seq % 100 == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let n = app_side
                .recv(&mut buf)
                .await
                .expect("packet on the TUN side");
            assert_eq!(&buf[..n], &packet(seq, len_for(seq))[..], "packet {seq}");
        }
        let _manager_end = manager.await.expect("manager task");
        assert_eq!(Counters::get(&counters.rx_packets), u64::from(N));
        assert_eq!(Counters::get(&counters.rx_invalid), 0);
        assert_eq!(
            Counters::get(&counters.heartbeats_echoed),
            0,
            "a nonce never sent is no echo"
        );
        let latest = counters
            .manager_stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .map(|(stats, _)| stats);
        assert_eq!(
            latest.and_then(|s| s.get(frame::stat::REFUSED_CAP)),
            Some(u64::from((N - 1) / 7 * 7)),
            "the latest stats frame is kept"
        );
        pump.abort();
    }

    #[tokio::test]
    async fn heartbeat_echo_means_connected() {
        let (tun_side, _app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, manager_end) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        let (manager_rx, mut manager_tx) = tokio::io::split(manager_end);
        let interval = Duration::from_millis(50);
        let liveness = liveness_up(interval);
        let counters = Arc::new(Counters::default());
        let pump = tokio::spawn(run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness.clone(),
            counters.clone(),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        ));
        // Test double of the manager: echo heartbeats unchanged.
        let echo = tokio::spawn(async move {
            let mut frames = FrameReader::new(manager_rx);
            while let Some((kind, payload)) = frames.next().await {
                assert_eq!(
                    kind,
                    Kind::Heartbeat,
                    "only heartbeats flow on an idle session"
                );
                assert_eq!(payload.len(), 8, "8-byte nonce");
                let mut out = Vec::new();
                frame::encode_into(Kind::Heartbeat, &payload, &mut out).expect("fits");
                manager_tx.write_all(&out).await.expect("echo");
            }
        });
        tokio::time::sleep(interval * 8).await;
        assert!(!pump.is_finished(), "an echoed session keeps pumping");
        let state = liveness.lock().expect("lock").state(Instant::now());
        assert_eq!(state, (State::Connected, None));
        assert!(
            Counters::get(&counters.heartbeats_sent) >= 5,
            "one heartbeat per interval"
        );
        assert!(Counters::get(&counters.heartbeats_echoed) >= 5);
        pump.abort();
        echo.abort();
    }

    #[tokio::test]
    async fn silent_manager_ends_the_pump_after_three_intervals() {
        let (tun_side, _app_side) = UnixDatagram::pair().expect("socketpair");
        // The manager end is kept open but never answers: a black hole.
        let (pump_end, _manager_end) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        let interval = Duration::from_millis(50);
        let liveness = liveness_up(interval);
        let started = Instant::now();
        let exit = tokio::time::timeout(
            Duration::from_secs(5),
            run(
                Arc::new(tun_side),
                rx,
                tx,
                liveness.clone(),
                Arc::new(Counters::default()),
                Arc::new(Refusal::default()),
                PumpConfig::default(),
            ),
        )
        .await
        .expect("the pump must give up on a silent manager");
        let took = started.elapsed();
        assert!(
            matches!(exit, PumpExit::Silent(ref r) if r.contains("no heartbeat echo")),
            "{exit:?}"
        );
        assert!(took >= interval * 3, "not before three intervals: {took:?}");
        assert!(took < interval * 6, "soon after three intervals: {took:?}");
        assert_eq!(
            liveness.lock().expect("lock").state(Instant::now()).0,
            State::Reconnecting
        );
    }

    #[tokio::test]
    async fn garbage_from_the_manager_is_a_protocol_error() {
        let (tun_side, _app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, mut manager_end) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        manager_end.write_all(&[0, 0, 1]).await.expect("write");
        let exit = run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness_up(LONG),
            Arc::new(Counters::default()),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        )
        .await;
        assert!(
            matches!(exit, PumpExit::Protocol(FrameError::ZeroLength)),
            "{exit:?}"
        );
    }

    #[tokio::test]
    async fn manager_eof_ends_the_pump() {
        let (tun_side, _app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, manager_end) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        drop(manager_end);
        let exit = run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness_up(LONG),
            Arc::new(Counters::default()),
            Arc::new(Refusal::default()),
            PumpConfig::default(),
        )
        .await;
        assert!(
            matches!(exit, PumpExit::TransportClosed | PumpExit::Transport(_)),
            "{exit:?}"
        );
    }

    /// An IPv4 UDP datagram from the laptop's tunnel IP to a ClusterIP.
    fn udp_to_cluster(seq: u8) -> Vec<u8> {
        use smoltcp::phy::ChecksumCapabilities;
        use smoltcp::wire::{IpProtocol, Ipv4Address, Ipv4Packet, Ipv4Repr, UdpPacket, UdpRepr};
        let (src, dst) = (
            Ipv4Address::new(100, 96, 0, 2),
            Ipv4Address::new(10, 96, 0, 102),
        );
        let body = [seq; 16];
        let ip = Ipv4Repr {
            src_addr: src,
            dst_addr: dst,
            next_header: IpProtocol::Udp,
            payload_len: 8 + body.len(),
            hop_limit: 64,
        };
        let mut buf = vec![0u8; 20 + 8 + body.len()];
        let mut p = Ipv4Packet::new_unchecked(&mut buf[..]);
        ip.emit(&mut p, &ChecksumCapabilities::default());
        UdpRepr {
            src_port: 40000 + u16::from(seq),
            dst_port: 7,
        }
        .emit(
            &mut UdpPacket::new_unchecked(p.payload_mut()),
            &src.into(),
            &dst.into(),
            body.len(),
            |b| b.copy_from_slice(&body),
            &ChecksumCapabilities::default(),
        );
        buf
    }

    /// Checks `reply` is the host-unreachable answer to `original`.
    fn assert_unreachable_for(reply: &[u8], original: &[u8]) {
        use smoltcp::wire::{Icmpv4Message, Icmpv4Packet, Ipv4Packet};
        let ip = Ipv4Packet::new_checked(reply).expect("IPv4 reply");
        let orig = Ipv4Packet::new_checked(original).expect("IPv4 original");
        assert_eq!(ip.src_addr(), orig.dst_addr());
        assert_eq!(ip.dst_addr(), orig.src_addr());
        let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("ICMP");
        assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
        assert_eq!(icmp.msg_code(), 1);
        assert_eq!(icmp.data(), original);
    }

    #[tokio::test]
    async fn reconnecting_session_answers_with_icmp_instead_of_queueing() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, manager_end) = tokio::io::duplex(1 << 16);
        let (rx, tx) = tokio::io::split(pump_end);
        // A transport re-established after a loss, no echo yet: reconnecting.
        let mut l = Liveness::new(LONG);
        l.handle_transport_up(Instant::now());
        l.handle_transport_down("no heartbeat echo from the traffic manager for 3001 ms");
        l.handle_transport_up(Instant::now());
        let liveness = Arc::new(Mutex::new(l));
        assert!(lock(&liveness).is_reconnecting(Instant::now()));
        let counters = Arc::new(Counters::default());
        let pump = tokio::spawn(run(
            Arc::new(tun_side),
            rx,
            tx,
            liveness.clone(),
            counters.clone(),
            Arc::new(Refusal::new(1000, 3)),
            PumpConfig::default(),
        ));
        let mut buf = vec![0u8; 65536];
        for seq in 0..5u8 {
            app_side.send(&udp_to_cluster(seq)).await.expect("send");
        }
        // Burst of 3: three answers, two rate-limited.
        for seq in 0..3u8 {
            let n = tokio::time::timeout(Duration::from_secs(2), app_side.recv(&mut buf))
                .await
                .expect("an answer at once")
                .expect("recv");
            assert_unreachable_for(&buf[..n], &udp_to_cluster(seq));
        }
        wait_counter(&counters.unreachable_rate_limited, 2).await;
        assert_eq!(Counters::get(&counters.refused_packets), 5);
        assert_eq!(Counters::get(&counters.unreachable_sent), 3);
        assert_eq!(
            Counters::get(&counters.tx_packets),
            0,
            "nothing into the transport"
        );

        // The echo of the first heartbeat arrives: the same pump forwards again.
        let mut frames = FrameReader::new(manager_end);
        let (kind, nonce) = frames.next().await.expect("the first heartbeat");
        assert_eq!(kind, Kind::Heartbeat, "only the heartbeat went out");
        assert!(lock(&liveness).handle_echo(&nonce, Instant::now()));
        app_side.send(&udp_to_cluster(9)).await.expect("send");
        let got = frames.next_packet().await.expect("forwarded");
        assert_eq!(got, udp_to_cluster(9));
        assert_eq!(Counters::get(&counters.refused_packets), 5);
        pump.abort();
    }

    async fn wait_counter(counter: &AtomicU64, want: u64) {
        for _ in 0..200 {
            if Counters::get(counter) >= want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("counter stuck at {}, wanted {want}", Counters::get(counter));
    }

    #[tokio::test]
    async fn refuse_answers_every_packet_between_transports() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        let counters = Arc::new(Counters::default());
        let refuser = tokio::spawn(refuse(
            Arc::new(tun_side),
            Arc::new(Refusal::default()),
            counters.clone(),
        ));
        let mut buf = vec![0u8; 65536];
        for seq in 0..4u8 {
            app_side.send(&udp_to_cluster(seq)).await.expect("send");
            let n = tokio::time::timeout(Duration::from_secs(2), app_side.recv(&mut buf))
                .await
                .expect("an answer at once")
                .expect("recv");
            assert_unreachable_for(&buf[..n], &udp_to_cluster(seq));
        }
        // Not answerable: garbage is counted as refused, not answered.
        app_side.send(&[0x45, 0, 0]).await.expect("send");
        wait_counter(&counters.refused_packets, 5).await;
        assert_eq!(Counters::get(&counters.unreachable_sent), 4);
        refuser.abort();
    }

    /// Test double of a TUN device with `IFF_VNET_HDR` offloads: a datagram
    /// socket whose reads carry the `virtio_net_hdr` the test wrote before
    /// each packet, and whose writes get the no-offload header prepended, as
    /// the TUN device's `send` does.
    struct VnetDatagram(UnixDatagram);

    impl PacketIo for VnetDatagram {
        fn vnet_hdr(&self) -> bool {
            true
        }
        fn readable(&self) -> impl Future<Output = io::Result<()>> + Send {
            self.0.readable()
        }
        fn try_recv(&self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.try_recv(buf)
        }
        async fn send(&self, packet: &[u8]) -> io::Result<usize> {
            let mut with_header = VNET_HDR_NONE.to_vec();
            with_header.extend_from_slice(packet);
            let n = self.0.send(&with_header).await?;
            Ok(n - VNET_HDR_LEN)
        }
        async fn send_vnet(&self, vnet: &[u8; VNET_HDR_LEN], packet: &[u8]) -> io::Result<usize> {
            let mut with_header = vnet.to_vec();
            with_header.extend_from_slice(packet);
            let n = self.0.send(&with_header).await?;
            Ok(n - VNET_HDR_LEN)
        }
    }

    /// Offload bit 2: a GSO frame from the manager reaches the TUN in one
    /// write, after the `virtio_net_hdr` its GSO header says (host byte
    /// order), and is counted; garbled GSO frames (from the network) are
    /// counted as invalid and dropped, never written, never a panic, and the
    /// frames after them still arrive.
    #[tokio::test]
    async fn gso_frames_from_the_manager_are_written_whole_or_dropped() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, mut manager_end) = tokio::io::duplex(1 << 20);
        let counters = Arc::new(Counters::default());
        let pump = vnet_pump(tun_side, pump_end, &counters);
        let data: Vec<u8> = (0..3500u32).map(|i| (i % 251) as u8).collect();
        // The manager's coalescer leaves the pseudo-header sum in place.
        let super_packet = partial_tcp(&data, 0x18);
        let good = GsoHeader {
            flags: gso::F_NEEDS_CSUM,
            gso_type: gso::GSO_TCPV4,
            hdr_len: 40,
            gso_size: 1000,
            csum_start: 20,
            csum_offset: 16,
        };
        let gso_frame = |h: GsoHeader, packet: &[u8]| {
            let mut payload = h.encode().to_vec();
            payload.extend_from_slice(packet);
            payload
        };
        let bad = [
            // Shorter than the GSO header.
            vec![1, 2, 3],
            // UDP_L4 (5), not a TCP super-packet.
            gso_frame(
                GsoHeader {
                    gso_type: 5,
                    ..good
                },
                &super_packet,
            ),
            // TCPv6 over an IPv4 packet.
            gso_frame(
                GsoHeader {
                    gso_type: gso::GSO_TCPV6,
                    ..good
                },
                &super_packet,
            ),
            // No NEEDS_CSUM, or the checksum elsewhere than TCP's.
            gso_frame(GsoHeader { flags: 0, ..good }, &super_packet),
            gso_frame(
                GsoHeader {
                    csum_offset: 6,
                    ..good
                },
                &super_packet,
            ),
            // gso_size 0, and one byte per segment (too many segments).
            gso_frame(
                GsoHeader {
                    gso_size: 0,
                    ..good
                },
                &super_packet,
            ),
            gso_frame(
                GsoHeader {
                    gso_size: 1,
                    ..good
                },
                &super_packet,
            ),
            // Truncated: the IP length says more.
            gso_frame(good, &super_packet[..100]),
        ];
        let mut wire = Vec::new();
        for payload in &bad {
            frame::encode_into(Kind::Gso, payload, &mut wire).expect("fits");
        }
        frame::encode_into(Kind::Gso, &gso_frame(good, &super_packet), &mut wire).expect("fits");
        frame::encode_into(Kind::Packet, &packet(7, 100), &mut wire).expect("fits");
        manager_end.write_all(&wire).await.expect("write frames");

        let mut buf = vec![0u8; 65536];
        let n = app_side.recv(&mut buf).await.expect("the super-packet");
        let (hdr, offload, written) = VnetHdr::parse(&buf[..n]).expect("virtio_net_hdr");
        assert_eq!(hdr, VnetHdr::from_frame_header(good));
        assert!(matches!(offload, Offload::Tcp { gso_size: 1000, .. }));
        assert_eq!(
            written,
            &super_packet[..],
            "one write, the whole super-packet"
        );
        let n = app_side.recv(&mut buf).await.expect("the packet after it");
        assert_eq!(&buf[VNET_HDR_LEN..n], &packet(7, 100)[..]);
        wait_counter(&counters.rx_packets, 2).await;
        assert_eq!(Counters::get(&counters.rx_gso_frames), 1);
        assert_eq!(Counters::get(&counters.rx_invalid), bad.len() as u64);
        assert_eq!(
            Counters::get(&counters.rx_bytes),
            (super_packet.len() + 100) as u64
        );
        pump.abort();
    }

    const LAPTOP_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(100, 96, 0, 2);
    const POD_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 244, 1, 20);

    /// An IPv4 TCP segment laptop -> pod with `payload`, its checksum partial
    /// (the pseudo-header sum only), as the kernel hands it over with
    /// TUN_F_CSUM / TUN_F_TSO4.
    fn partial_tcp(payload: &[u8], flags: u8) -> Vec<u8> {
        kvpn_lab::packets::tcp_partial_checksum(
            std::net::SocketAddrV4::new(LAPTOP_IP, 40000),
            std::net::SocketAddrV4::new(POD_IP, 7007),
            payload,
            flags,
        )
    }

    /// A TUN read: `virtio_net_hdr` (host byte order) + `packet`.
    fn vnet_read(flags: u8, gso_type: u8, gso_size: u16, packet: &[u8]) -> Vec<u8> {
        let mut r = vec![flags, gso_type];
        for v in [40u16, gso_size, 20, 16] {
            r.extend_from_slice(&v.to_ne_bytes());
        }
        r.extend_from_slice(packet);
        r
    }

    /// The TCP payload of `packet`, checking its IPv4 and TCP checksums.
    fn checked_tcp_payload(packet: &[u8]) -> Vec<u8> {
        use smoltcp::wire::{IpAddress, Ipv4Packet, TcpPacket};
        let ip = Ipv4Packet::new_checked(packet).expect("IPv4");
        assert!(ip.verify_checksum(), "IPv4 header checksum");
        let tcp = TcpPacket::new_checked(ip.payload()).expect("TCP");
        let (src, dst) = (
            IpAddress::Ipv4(ip.src_addr()),
            IpAddress::Ipv4(ip.dst_addr()),
        );
        assert!(tcp.verify_checksum(&src, &dst), "TCP checksum");
        tcp.payload().to_vec()
    }

    #[tokio::test]
    async fn super_packets_are_segmented_until_the_manager_accepts_gso_frames() {
        let (tun_side, app_side) = UnixDatagram::pair().expect("socketpair");
        let (pump_end, manager_end) = tokio::io::duplex(1 << 20);
        let (manager_rx, mut manager_tx) = tokio::io::split(manager_end);
        let counters = Arc::new(Counters::default());
        let pump = vnet_pump(tun_side, pump_end, &counters);
        let mut frames = FrameReader::new(manager_rx);
        let data: Vec<u8> = (0..3500u32).map(|i| (i % 251) as u8).collect();
        let super_packet = partial_tcp(&data, 0x18);

        // No manager hello yet: the pump cuts the super-packet itself.
        app_side
            .send(&vnet_read(1, gso::GSO_TCPV4, 1000, &super_packet))
            .await
            .expect("send");
        let mut joined = Vec::new();
        for i in 0..4 {
            let segment = frames.next_packet().await.expect("a segment");
            assert_eq!(segment.len(), 40 + if i < 3 { 1000 } else { 500 });
            joined.extend(checked_tcp_payload(&segment));
        }
        assert_eq!(joined, data, "segments carry the payload in order");

        // A single packet with a partial checksum leaves completed.
        let ack = partial_tcp(b"x", 0x10);
        app_side
            .send(&vnet_read(1, gso::GSO_NONE, 0, &ack))
            .await
            .expect("send");
        let got = frames.next_packet().await.expect("the packet");
        assert_eq!(checked_tcp_payload(&got), b"x");

        // The manager accepts GSO frames: the next super-packet goes whole,
        // behind the virtio_net_hdr's fields.
        let mut hello = Vec::new();
        let answer = ManagerHello {
            version: frame::PROTOCOL_VERSION,
            offloads: OFFLOAD_TCP_GSO,
        };
        frame::encode_into(Kind::Hello, &answer.encode(), &mut hello).expect("fits");
        manager_tx.write_all(&hello).await.expect("manager hello");
        tokio::time::sleep(Duration::from_millis(200)).await;
        app_side
            .send(&vnet_read(1, gso::GSO_TCPV4, 1000, &super_packet))
            .await
            .expect("send");
        let (kind, payload) = loop {
            match frames.next().await.expect("a frame") {
                (Kind::Heartbeat, _) => continue,
                other => break other,
            }
        };
        assert_eq!(kind, Kind::Gso);
        let (header, packet) = frame::GsoHeader::split(&payload).expect("GSO header");
        assert_eq!(
            (
                header.flags,
                header.gso_type,
                header.gso_size,
                header.csum_start,
                header.csum_offset
            ),
            (1, gso::GSO_TCPV4, 1000, 20, 16)
        );
        assert_eq!(packet, &super_packet[..]);
        assert_eq!(Counters::get(&counters.tx_gso_segmented), 1);
        assert_eq!(Counters::get(&counters.tx_gso_frames), 1);
        assert_eq!(Counters::get(&counters.tx_packets), 4 + 1 + 1);

        // A read the pump cannot use (UDP segmentation, never enabled) is
        // dropped and counted, and the pump goes on.
        app_side
            .send(&vnet_read(1, 5, 1000, &ack))
            .await
            .expect("send");
        app_side
            .send(&vnet_read(0, gso::GSO_NONE, 0, &ack))
            .await
            .expect("send");
        assert_eq!(frames.next_packet().await.expect("the packet"), ack);
        assert_eq!(Counters::get(&counters.tx_offload_dropped), 1);

        // Inbound packets reach the TUN behind a no-offload header.
        let mut inbound = Vec::new();
        frame::encode_into(Kind::Packet, &ack, &mut inbound).expect("fits");
        manager_tx.write_all(&inbound).await.expect("packet frame");
        let mut buf = vec![0u8; 65536];
        let n = tokio::time::timeout(Duration::from_secs(2), app_side.recv(&mut buf))
            .await
            .expect("in time")
            .expect("recv");
        assert_eq!(&buf[..VNET_HDR_LEN], &VNET_HDR_NONE);
        assert_eq!(&buf[VNET_HDR_LEN..n], &ack[..]);
        pump.abort();
    }
}
