//! One client session: the tokio shell around [`Engine`].
//!
//! Reads frames from the laptop's data channel (any `AsyncRead + AsyncWrite`
//! byte stream: TLS or plain TCP, see [`crate::server`]), checks the hello, feeds packets to
//! the engine, echoes heartbeats, carries out the engine's requests through
//! [`KernelSide`] and writes the engine's packets back as frames.
//!
//! Two tasks per session, so that control frames never wait behind data:
//!
//! ```text
//! laptop ──engine loop: read, [intake: packet frames, ≤ INTAKE_BYTES], engine──▶ [out: ≤ 64 batches] ──writer──▶ laptop
//!             └─ heartbeats ──▶ [control: ≤ 64 echoes] ────────────────────────────────────────────────┘ (first)
//! ```
//!
//! The engine loop reads the laptop's stream itself ([`LaptopReader`]: no
//! reader task, so a packet from the laptop wakes one task, not two) whenever
//! it waits and between the slices of a long intake, so the socket is drained
//! all the time: a heartbeat is echoed as soon as it is read, and packet frames
//! go to a byte-bounded intake. When the engine
//! falls behind (a flood of small datagrams costs far more to process than to
//! read), packet frames beyond the intake's bound are dropped and counted
//! ([`DropReason::IntakeFull`]) instead of piling up in the kernel's socket
//! buffers, where they would delay the next heartbeat by seconds and make the
//! laptop re-dial (the bench's 100 Mbit/s 64-byte UDP flood did, and lost every
//! flow of the session). The writer sends queued echoes before any data batch.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;

use kvpn_proto::frame::{
    self, Decoder, FrameError, GsoHeader, Hello, HelloError, Kind, MIN_PROTOCOL_VERSION,
    ManagerHello, OFFLOAD_TCP_GRO, OFFLOAD_TCP_GSO, PROTOCOL_VERSION, ResumeAnswer, STATS_VERSION,
    Stats, stat,
};
use kvpn_proto::gso::{self, GsoKind};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info, trace, warn};

use crate::engine::{Engine, EngineConfig, MANAGER_STACK_V4};
use crate::kernel::{AbortOnDrop, DATAGRAM_QUEUE, KernelSide, TCP_EVENT_QUEUE, TcpEventSender};
use crate::lease::AttachError;
use crate::leases::Leases;
use crate::metrics::{DropsSynced, HelloRefusal, ManagerCounters, Metrics};
use crate::packet::DropReason;
use crate::peers::{self, Peers};
use crate::resume::{Credentials, Resumes};

/// Bytes read from the laptop per read call.
const READ_CHUNK: usize = 256 * 1024;

/// Batches of frames queued for the laptop writer. Each batch is one engine
/// round's output (typically one to a few dozen packets).
const WRITE_QUEUE_BATCHES: usize = 64;

/// The writer merges queued batches up to this many bytes into one write.
const WRITE_COALESCE: usize = 1024 * 1024;

/// Kernel events handled per round before the engine polls again.
const EVENTS_PER_ROUND: usize = 1024;

/// Bytes of packet frames read from the laptop and not yet handled by the
/// engine: 2 MiB. Large enough for the windows of the TCP flows in flight
/// (smoltcp advertises at most 256 KiB per flow, so eight bulk flows fit
/// without a drop), small enough that an engine busy with a flood of 64-byte
/// datagrams (~31,000 of them) catches up within a fraction of a second.
pub const INTAKE_BYTES: usize = 2 * 1024 * 1024;

/// Bytes of packet frames the engine handles between two yields to the
/// scheduler (see the engine loop in `run_established`).
const ROUND_BYTES: usize = 64 * 1024;

/// Packet frames the engine handles between two yields, whatever their size:
/// the cost of a round is per packet more than per byte, and 64 KiB of
/// 64-byte frames (a flood's) is a thousand packets, a round long enough to
/// hold the worker thread away from other laptops' sessions
/// (the flood-fairness measurement: `kvpn-bench --fairness-only`, bench/src/fairness.rs). 256 is still several bulk-TCP windows'
/// worth of 9000-byte segments per round.
const ROUND_FRAMES: usize = 256;

/// Heartbeat echoes queued for the writer; the laptop sends one a second, so
/// this only fills when the laptop stops reading (further echoes are dropped:
/// a laptop that does not read would not see them anyway).
const CONTROL_QUEUE: usize = 64;

/// How often the session's counters go to the laptop in a [`Kind::Stats`]
/// frame (laptops of protocol version 3 or later; `kvpn status` shows them).
const STATS_FRAME_INTERVAL: Duration = Duration::from_secs(1);

/// Settings shared by all sessions of a manager.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Give up dialing a TCP destination after this long (the laptop then
    /// gets ICMP host unreachable).
    pub dial_timeout: Duration,
    /// The hello must arrive within this long after the connection opened.
    pub hello_timeout: Duration,
    /// End the session when no frame arrived for this long (the laptop sends
    /// a heartbeat every 1 s).
    pub idle_timeout: Duration,
    /// Relay to loopback destinations (tests only).
    pub allow_loopback: bool,
    /// Leases: when set, a hello must carry the session token of its tunnel
    /// IP's lease, and the lease is renewed while the session lives. `None`:
    /// any unicast tunnel IP is accepted (static lab, `--listen` only).
    pub leases: Option<Arc<Leases>>,
    /// The tunnel pool: a laptop's packet to an address in it that is no live
    /// session is dropped ([`DropReason::NoSuchPeer`]) instead of dialed.
    pub tunnel_pool: Option<Ipv4Net>,
    /// The live sessions, for laptop-to-laptop forwarding. Sessions sharing a
    /// `SessionConfig` (clones) share it.
    pub peers: Peers,
    /// Source policy `preserve`: laptop packets for the cluster go into this TUN
    /// device (the pod's kernel forwards them with the tunnel IP as source) instead
    /// of smoltcp. `None`: `snat`.
    pub pool_tun: Option<Arc<crate::preserve::PoolTun>>,
    /// The egress gateway of `kvpn attach --via gateway`: a laptop's packet to
    /// the manager's tunnel address that answers a translated pod flow goes
    /// back to the pod through it ([`crate::gateway`]).
    pub gateway: Option<Arc<crate::gateway::Gateway>>,
    /// The `kvpn diagnose source` trace, shared with the gRPC service.
    pub trace: Arc<crate::trace::SourceTrace>,
    /// Per-client flow cap (all kinds), see [`EngineConfig::max_flows`].
    pub max_flows: usize,
    /// New flows per second per client (0: unlimited), see [`crate::limit`].
    pub new_flows_per_sec: u32,
    /// New flows at once per client.
    pub new_flow_burst: u32,
    /// Failed TCP dials per second per client (0: unlimited), see
    /// [`crate::limit::FAILED_FLOWS_PER_SEC`].
    pub failed_dials_per_sec: u32,
    /// How often a live session logs its flow counts, limits and the
    /// manager's memory (the manager's metrics log, `session stats`).
    pub stats_interval: Duration,
    /// smoltcp receive buffer per TCP flow ([`EngineConfig::tcp_window`]); with
    /// `auto_tcp_window`, the most the listener gives a connection's flows.
    pub tcp_window: usize,
    /// Size each data connection's flow windows from its round trip
    /// ([`crate::window::flow_window`], done by [`crate::server::serve`]);
    /// false: every flow gets `tcp_window` (`kvpn-manager --fixed-tcp-window`).
    pub auto_tcp_window: bool,
    /// The manager-wide counters (refused hellos, drops of every session),
    /// served by [`crate::metrics_server`]. Clones share them.
    pub counters: Arc<ManagerCounters>,
    /// Engines of ended connections kept for a resume (hello option 5), see
    /// [`crate::resume`]. Clones share them. Default: off.
    pub resumes: Arc<Resumes<ParkedEngine>>,
}

/// What a worker connection's session keeps while parked for a resume: its
/// engine (the smoltcp sockets) and kernel side (the connections it dialed)
/// with their event queues, and the session's running counts.
pub struct ParkedEngine {
    engine: Engine,
    kernel: KernelSide,
    events_rx: mpsc::Receiver<crate::engine::Event>,
    datagrams_rx: mpsc::Receiver<crate::engine::Event>,
    peak_flows: usize,
    drops_synced: DropsSynced,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            dial_timeout: Duration::from_secs(5),
            hello_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            allow_loopback: false,
            leases: None,
            tunnel_pool: None,
            peers: Peers::default(),
            pool_tun: None,
            gateway: None,
            trace: Arc::default(),
            max_flows: crate::engine::DEFAULT_MAX_FLOWS,
            new_flows_per_sec: crate::limit::NEW_FLOWS_PER_SEC,
            new_flow_burst: crate::limit::NEW_FLOW_BURST,
            failed_dials_per_sec: crate::limit::FAILED_FLOWS_PER_SEC,
            stats_interval: Duration::from_secs(10),
            tcp_window: crate::engine::TCP_RX_BUFFER,
            auto_tcp_window: true,
            counters: Arc::default(),
            resumes: Resumes::off(),
        }
    }
}

/// Why a session ended other than by the laptop closing the stream.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Reading the data channel failed.
    #[error("reading from the laptop failed: {0}")]
    Read(#[source] io::Error),
    /// The writer task stopped (the laptop closed or the write failed).
    #[error("writing to the laptop failed (connection closed or broken)")]
    Write,
    /// The byte stream holds an invalid frame header.
    #[error("invalid frame from the laptop: {0}")]
    Frame(#[from] FrameError),
    /// The laptop closed the stream before sending its hello.
    #[error("the laptop closed the connection before sending a hello")]
    ClosedBeforeHello,
    /// No hello in time.
    #[error("no hello from the laptop within {0:?}")]
    HelloTimeout(Duration),
    /// The first frame was not a hello.
    #[error("first frame is {0:?}, expected a hello; is the client a kvpn data channel?")]
    NotHello(Kind),
    /// The hello payload is invalid.
    #[error("invalid hello: {0}")]
    BadHello(#[from] HelloError),
    /// The laptop speaks another protocol version.
    #[error(
        "laptop speaks data-channel protocol version {got}, this manager speaks {want}; upgrade the older side"
    )]
    Version {
        /// The laptop's version.
        got: u16,
        /// Ours.
        want: u16,
    },
    /// The hello's tunnel IP cannot be a laptop's address.
    #[error(
        "hello carries tunnel IP {0}, which is not a unicast address; the laptop's lease is broken"
    )]
    BadTunnelIp(IpAddr),
    /// The hello's IPv6 tunnel IP is not the one its IPv4 tunnel IP maps to.
    #[error(
        "hello carries IPv6 tunnel IP {v6}, which is not tunnel IP {primary} embedded in the IPv6 pool fd6b:7670:6e00::/96; the laptop's lease is broken — reconnect"
    )]
    BadTunnelIpV6 {
        /// The hello's IPv6 tunnel IP.
        v6: std::net::Ipv6Addr,
        /// Its primary tunnel IP.
        primary: IpAddr,
    },
    /// The hello's token is not valid for its tunnel IP.
    #[error("hello refused: {0}")]
    Lease(#[from] AttachError),
    /// No frame (not even a heartbeat) for too long.
    #[error("no frame from the laptop for {0:?} (heartbeats stopped)")]
    Silent(Duration),
    /// A newer connection of the same laptop worker, with the same resume
    /// token, took over (the laptop re-dialed before this one was seen dead).
    #[error("a newer connection of this laptop worker took over (re-dial)")]
    Superseded,
}

impl SessionError {
    /// The `refused_hello_total` reason of an error that ends a data channel
    /// before its session started; `None` for ends that refuse nothing (the
    /// readiness probe's connect-and-close, a broken connection).
    pub fn refusal(&self) -> Option<HelloRefusal> {
        match self {
            SessionError::HelloTimeout(_) => Some(HelloRefusal::Timeout),
            SessionError::NotHello(_) => Some(HelloRefusal::NotHello),
            SessionError::BadHello(_) | SessionError::Frame(_) => Some(HelloRefusal::Malformed),
            SessionError::Version { .. } => Some(HelloRefusal::Version),
            SessionError::BadTunnelIp(_) | SessionError::BadTunnelIpV6 { .. } => {
                Some(HelloRefusal::BadTunnelIp)
            }
            SessionError::Lease(AttachError::NoLease(_)) => Some(HelloRefusal::NoLease),
            SessionError::Lease(AttachError::WrongToken(_)) => Some(HelloRefusal::WrongToken),
            SessionError::Read(_)
            | SessionError::Write
            | SessionError::ClosedBeforeHello
            | SessionError::Silent(_)
            | SessionError::Superseded => None,
        }
    }
}

fn random_seed() -> u64 {
    // RandomState is seeded from the OS's randomness once per process and
    // varied per instance: enough for smoltcp's ISNs and ports.
    let mut h = RandomState::new().build_hasher();
    h.write_u64(0x6b76_706e);
    h.finish()
}

/// Read into `buf` until it holds one whole frame; return its kind and payload.
async fn read_first_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut Vec<u8>,
) -> Result<(Kind, Vec<u8>), SessionError> {
    loop {
        if let Some((f, used)) = Decoder::default().decode(buf)? {
            let out = (f.kind, f.payload.to_vec());
            buf.drain(..used);
            return Ok(out);
        }
        buf.reserve(READ_CHUNK);
        let n = rd.read_buf(buf).await.map_err(SessionError::Read)?;
        if n == 0 {
            return Err(SessionError::ClosedBeforeHello);
        }
    }
}

/// Validate the hello; returns it.
async fn handshake<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut Vec<u8>,
    timeout: Duration,
) -> Result<Hello, SessionError> {
    let (kind, payload) = tokio::time::timeout(timeout, read_first_frame(rd, buf))
        .await
        .map_err(|_| SessionError::HelloTimeout(timeout))??;
    if kind != Kind::Hello {
        return Err(SessionError::NotHello(kind));
    }
    let hello = Hello::decode(&payload)?;
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&hello.version) {
        return Err(SessionError::Version {
            got: hello.version,
            want: PROTOCOL_VERSION,
        });
    }
    let ip = hello.tunnel_ip;
    let broadcast = matches!(ip, IpAddr::V4(a) if a.is_broadcast());
    if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() || broadcast {
        return Err(SessionError::BadTunnelIp(ip));
    }
    // The IPv6 tunnel IP is the IPv4 one embedded in the IPv6 pool
    // (kvpn_proto::tunnel), so the IPv4 lease's token covers it too.
    if let Some(v6) = hello.tunnel_ip_v6 {
        let derived = match ip {
            IpAddr::V4(v4) => Some(kvpn_proto::tunnel::ipv6_tunnel_ip(v4)),
            IpAddr::V6(_) => None,
        };
        if derived != Some(v6) {
            return Err(SessionError::BadTunnelIpV6 { v6, primary: ip });
        }
    }
    Ok(hello)
}

async fn write_frames<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut control_rx: mpsc::Receiver<Vec<u8>>,
    mut rx: mpsc::Receiver<Vec<u8>>,
) {
    loop {
        let mut batch = tokio::select! {
            biased;
            Some(control) = control_rx.recv() => control,
            data = rx.recv() => match data {
                Some(data) => data,
                None => break,
            },
        };
        trace!(bytes = batch.len(), "writer woke");
        // Echoes first: they go before (or with) the data batch.
        while let Ok(control) = control_rx.try_recv() {
            batch.extend_from_slice(&control);
        }
        while batch.len() < WRITE_COALESCE {
            match rx.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if let Err(e) = wr.write_all(&batch).await {
            debug!(error = %e, "write to laptop failed");
            return;
        }
        if let Err(e) = wr.flush().await {
            debug!(error = %e, "flush to laptop failed");
            return;
        }
    }
    let _ = wr.shutdown().await;
}

/// Laptop-to-laptop: hand `packet` to the session whose tunnel IP is its
/// destination. True when the packet was handled (forwarded or dropped), false
/// when it is for the cluster (the engine's).
fn forward_to_peer(packet: &[u8], engine: &mut Engine, config: &SessionConfig) -> bool {
    let Some((src, dst)) = peers::addrs(packet) else {
        return false;
    };
    // Wrong sources are the engine's to drop and count.
    if !engine.is_tunnel_ip(src) || dst == src {
        return false;
    }
    if dst == IpAddr::V4(MANAGER_STACK_V4)
        && let Some(gw) = &config.gateway
        && gw.laptop_packet(packet)
    {
        return true;
    }
    let in_pool = match (config.tunnel_pool, dst) {
        (Some(pool), IpAddr::V4(v4)) => {
            if !pool.contains(&v4) {
                return false;
            }
            v4 != MANAGER_STACK_V4
        }
        (Some(_), IpAddr::V6(_)) => false,
        (None, _) => false,
    };
    match config.peers.try_send(dst, packet) {
        Some(true) => {
            let m = engine.metrics_mut();
            m.peer_packets += 1;
            m.peer_bytes += packet.len() as u64;
            trace!(%dst, bytes = packet.len(), "packet forwarded to another laptop");
            true
        }
        Some(false) => {
            engine.metrics_mut().drop_packet(DropReason::PeerQueueFull);
            true
        }
        None if in_pool => {
            engine.metrics_mut().drop_packet(DropReason::NoSuchPeer);
            true
        }
        None => false,
    }
}

/// One packet from the laptop, from a packet frame or a segment of a GSO
/// frame: to another laptop, into the pool TUN (`preserve`, `ebpf-snat`) or
/// to the engine.
fn laptop_packet(packet: &[u8], engine: &mut Engine, now: Instant, config: &SessionConfig) {
    if !outside_engine(packet, engine, now, config) {
        engine.handle_laptop_packet(packet, now);
    }
}

/// [`laptop_packet`] for a packet in a buffer from [`Engine::rx_buffer`]:
/// the engine keeps the buffer itself (no copy), or gets it back.
fn laptop_packet_pooled(buf: Vec<u8>, engine: &mut Engine, now: Instant, config: &SessionConfig) {
    if outside_engine(&buf, engine, now, config) {
        engine.recycle_rx(buf);
    } else {
        engine.handle_laptop_packet_pooled(buf, now);
    }
}

/// The part of [`laptop_packet`] before the engine: true when `packet` went
/// to another laptop or into the pool TUN (or was dropped there).
fn outside_engine(
    packet: &[u8],
    engine: &mut Engine,
    now: Instant,
    config: &SessionConfig,
) -> bool {
    config.trace.observe_laptop_packet(packet);
    if forward_to_peer(packet, engine, config) {
        // Another laptop's.
        return true;
    }
    let Some(tun) = config
        .pool_tun
        .as_ref()
        .filter(|t| t.takes(packet, engine.tunnel_ip()))
    else {
        return false;
    };
    // The flow cap and new-flow limits apply here too.
    if engine.admit_forwarded(packet, now) {
        tun.write(packet);
    }
    true
}

/// GSO frames of one session: whether its hello offered them, and a
/// reusable buffer for a frame without segmentation (a checksum to complete).
/// Segments go straight into the engine's receive buffers ([`gso_frame`]).
#[derive(Debug, Default)]
struct GsoIntake {
    /// The laptop's hello offered [`OFFLOAD_TCP_GSO`] (and the manager
    /// answered that it accepts them).
    accepted: bool,
    /// The packet of a `GSO_NONE` frame being handled; keeps its capacity.
    segments: Vec<u8>,
}

/// Merging the engine's TCP segments into [`Kind::Gso`] frames for a laptop
/// that accepted [`OFFLOAD_TCP_GRO`]: the coalescer's scratch space and the
/// packets of one transmit round, both reused.
#[derive(Debug, Default)]
struct GroOutput {
    coalescer: gso::Coalescer,
    packets: Vec<Vec<u8>>,
}

/// Frame everything the engine has for the laptop into `out`: one packet
/// frame per packet, or, with `gro`, runs of one TCP flow merged into GSO
/// frames ([`frame::encode_coalesced`]). Every buffer goes back to the
/// engine.
fn transmit(engine: &mut Engine, out: &mut Vec<u8>, gro: Option<&mut GroOutput>) {
    let Some(gro) = gro else {
        while let Some(packet) = engine.poll_transmit() {
            if frame::encode_into(Kind::Packet, &packet, out).is_err() {
                // The engine builds packets within the frame limit; smoltcp's are MTU-sized.
                debug!(bytes = packet.len(), "packet too large for a frame");
            }
            engine.recycle(packet);
        }
        return;
    };
    gro.packets
        .extend(std::iter::from_fn(|| engine.poll_transmit()));
    let (merged, too_large) = frame::encode_coalesced(&mut gro.coalescer, &gro.packets, out);
    if too_large > 0 {
        debug!(too_large, "packets too large for a frame");
    }
    let m = engine.metrics_mut();
    m.gro_frames += merged.super_packets as u64;
    m.gro_segments += merged.merged as u64;
    for packet in gro.packets.drain(..) {
        engine.recycle(packet);
    }
}

/// Bytes reserved for [`GsoIntake::segments`] up front: the largest packet.
const GSO_SEGMENTS_CAPACITY: usize = 64 * 1024;

/// A [`Kind::Gso`] frame: segment the TCP super-packet (or complete the
/// checksum of a single packet) and hand each packet to [`laptop_packet`],
/// exactly like packet frames. Frames from a laptop that did not offer them,
/// and frames that cannot be segmented, are dropped and counted
/// ([`DropReason::Gso`]).
fn gso_frame(
    payload: &[u8],
    engine: &mut Engine,
    now: Instant,
    config: &SessionConfig,
    gso: &mut GsoIntake,
) {
    let Some((header, packet)) = GsoHeader::split(payload).filter(|_| gso.accepted) else {
        trace!(accepted = gso.accepted, "GSO frame dropped");
        return engine.metrics_mut().drop_packet(DropReason::Gso);
    };
    gso.segments.clear();
    let count = match GsoKind::from_gso_type(header.gso_type) {
        Some(kind) => {
            match gso::Segmenter::new(packet, kind, usize::from(header.gso_size)) {
                Ok(seg) => {
                    // Each segment straight into a smoltcp receive buffer:
                    // its payload is copied once.
                    for i in 0..seg.count() {
                        let mut buf = engine.rx_buffer();
                        seg.write(i, &mut buf);
                        laptop_packet_pooled(buf, engine, now, config);
                    }
                    seg.count()
                }
                Err(e) => {
                    debug!(error = %e, gso_type = header.gso_type, "GSO frame not segmented");
                    return engine.metrics_mut().drop_packet(DropReason::Gso);
                }
            }
        }
        None if header.gso_type == gso::GSO_NONE => {
            gso.segments.extend_from_slice(packet);
            if header.flags & gso::F_NEEDS_CSUM != 0
                && let Err(e) = gso::complete_checksum(
                    &mut gso.segments,
                    usize::from(header.csum_start),
                    usize::from(header.csum_offset),
                )
            {
                debug!(error = %e, "GSO frame's checksum not completed");
                return engine.metrics_mut().drop_packet(DropReason::Gso);
            }
            laptop_packet(&gso.segments, engine, now, config);
            1
        }
        None => {
            debug!(
                gso_type = header.gso_type,
                "GSO frame of a kind not segmented here"
            );
            return engine.metrics_mut().drop_packet(DropReason::Gso);
        }
    };
    let m = engine.metrics_mut();
    m.gso_frames += 1;
    m.gso_segments += count as u64;
}

/// Handle the whole frames at the front of `buf`, stopping after the frame
/// that reaches `limit` bytes or after [`ROUND_FRAMES`] frames; returns the
/// bytes used.
fn handle_frames(
    buf: &[u8],
    engine: &mut Engine,
    out: &mut Vec<u8>,
    now: Instant,
    config: &SessionConfig,
    limit: usize,
    gso: &mut GsoIntake,
) -> Result<usize, SessionError> {
    let decoder = Decoder::default();
    let mut used = 0;
    let mut frames = 0;
    while used < limit
        && frames < ROUND_FRAMES
        && let Some((f, n)) = decoder.decode(&buf[used..])?
    {
        used += n;
        frames += 1;
        match f.kind {
            Kind::Packet => laptop_packet(f.payload, engine, now, config),
            Kind::Gso => gso_frame(f.payload, engine, now, config, gso),
            Kind::Heartbeat => {
                engine.metrics_mut().heartbeats += 1;
                // Cannot fail: the payload came in a frame, so it fits one.
                let _ = frame::encode_into(Kind::Heartbeat, f.payload, out);
            }
            Kind::Hello => trace!("repeated hello ignored"),
            Kind::Stats | Kind::Resume | Kind::Unknown(_) => {
                trace!(kind = f.kind.to_u8(), "frame of a kind the manager ignores");
            }
        }
    }
    Ok(used)
}

/// Packet frames read from the laptop, waiting for the engine, and how the
/// stream ended.
#[derive(Default)]
struct Intake {
    /// Whole packet and GSO frames (headers included), at most [`INTAKE_BYTES`].
    frames: Vec<u8>,
    /// Packet frames dropped because `frames` was full.
    dropped: u64,
    /// Heartbeats read (and echoed) since the engine last looked.
    heartbeats: u64,
    /// Heartbeat echoes dropped (control queue full) since the engine last
    /// looked.
    echoes_dropped: u64,
    /// Why reading stopped: `Ok` when the laptop closed the stream.
    end: Option<Result<(), SessionError>>,
    /// The laptop said it is leaving ([`ResumeAnswer::Leaving`]): its
    /// engine is not parked when the connection ends.
    leaving: bool,
}

/// Sort the whole frames at the front of `buf` into the intake (packets) and
/// the control queue (heartbeat echoes); returns the bytes used.
fn sort_frames(
    buf: &[u8],
    intake: &mut Intake,
    control_tx: &mpsc::Sender<Vec<u8>>,
) -> Result<usize, SessionError> {
    let decoder = Decoder::default();
    let mut used = 0;
    while let Some((f, n)) = decoder.decode(&buf[used..])? {
        let whole = &buf[used..used + n];
        used += n;
        match f.kind {
            Kind::Heartbeat => {
                intake.heartbeats += 1;
                trace!("heartbeat read, echo queued");
                // Same bytes back: the echo of a heartbeat is the heartbeat.
                if control_tx.try_send(whole.to_vec()).is_err() {
                    intake.echoes_dropped += 1;
                    debug!(
                        "heartbeat echo dropped: the control queue is full (the laptop does not read)"
                    );
                }
            }
            Kind::Packet | Kind::Gso => {
                if intake.frames.len() + n <= INTAKE_BYTES {
                    intake.frames.extend_from_slice(whole);
                } else {
                    intake.dropped += 1;
                }
            }
            Kind::Hello => trace!("repeated hello ignored"),
            Kind::Resume if ResumeAnswer::decode(f.payload) == Some(ResumeAnswer::Leaving) => {
                debug!("the laptop is leaving: its engine will not be parked");
                intake.leaving = true;
            }
            Kind::Stats | Kind::Resume | Kind::Unknown(_) => {
                trace!(kind = f.kind.to_u8(), "frame of a kind the manager ignores");
            }
        }
    }
    Ok(used)
}

/// Reads the laptop's stream inside the engine loop's task (no reader task
/// of its own: a hand-off less per packet). Heartbeats are echoed through
/// `control_tx` as soon as they are read, packet frames queue in the intake
/// (dropped when it is full). The engine loop reads whenever it waits (for
/// the laptop, a kernel event, a timer or room in the write queue) and
/// between the slices of a long intake, so the socket is drained about as
/// often as a reader task of its own drained it.
struct LaptopReader<R> {
    rd: R,
    rbuf: Vec<u8>,
    intake: Intake,
    control_tx: mpsc::Sender<Vec<u8>>,
    idle_timeout: Duration,
    /// When the last byte came; `idle_timeout` after it the session ends.
    last_read: tokio::time::Instant,
}

/// Reads of the laptop's stream between two slices of the intake, at most:
/// bounds the time a flood's reads take from the engine.
const DRAIN_READS: usize = INTAKE_BYTES / READ_CHUNK + 1;

impl<R: AsyncRead + Unpin> LaptopReader<R> {
    fn new(
        rd: R,
        rbuf: Vec<u8>,
        control_tx: mpsc::Sender<Vec<u8>>,
        idle_timeout: Duration,
    ) -> Self {
        let mut reader = LaptopReader {
            rd,
            rbuf,
            intake: Intake::default(),
            control_tx,
            idle_timeout,
            last_read: tokio::time::Instant::now(),
        };
        // Frames that came with the hello.
        reader.sort();
        reader
    }

    /// Whether reading goes on (no EOF, error or timeout yet).
    fn open(&self) -> bool {
        self.intake.end.is_none()
    }

    fn sort(&mut self) {
        match sort_frames(&self.rbuf, &mut self.intake, &self.control_tx) {
            Ok(used) => {
                self.rbuf.drain(..used);
            }
            Err(e) => self.intake.end = Some(Err(e)),
        }
    }

    /// Wait for bytes from the laptop. Cancel-safe: nothing is read unless
    /// it completes.
    async fn readable(&mut self) -> io::Result<usize> {
        self.rbuf.reserve(READ_CHUNK);
        self.rd.read_buf(&mut self.rbuf).await
    }

    /// When the session ends for the laptop's silence, unless a byte comes.
    fn silent_at(&self) -> tokio::time::Instant {
        self.last_read + self.idle_timeout
    }

    /// `silence` fired: end the session if nothing came for `idle_timeout`,
    /// else set it again for the new deadline (one timer for the whole
    /// session, not one per read or engine round).
    fn check_silence(&mut self, silence: std::pin::Pin<&mut tokio::time::Sleep>) {
        let at = self.silent_at();
        if at <= tokio::time::Instant::now() {
            self.intake.end = Some(Err(SessionError::Silent(self.idle_timeout)));
        } else {
            silence.reset(at);
        }
    }

    /// Take the outcome of [`LaptopReader::readable`].
    fn handle_read(&mut self, read: io::Result<usize>) {
        match read {
            Ok(0) => {
                if !self.rbuf.is_empty() {
                    debug!(
                        bytes = self.rbuf.len(),
                        "laptop closed the stream inside a frame"
                    );
                }
                self.intake.end = Some(Ok(()));
            }
            Ok(_) => {
                self.last_read = tokio::time::Instant::now();
                self.sort();
            }
            Err(e) => self.intake.end = Some(Err(SessionError::Read(e))),
        }
    }

    /// Read what the laptop sent so far without waiting (at most
    /// [`DRAIN_READS`] reads).
    async fn drain(&mut self) {
        for _ in 0..DRAIN_READS {
            if !self.open() {
                return;
            }
            self.rbuf.reserve(READ_CHUNK);
            let (rd, rbuf) = (&mut self.rd, &mut self.rbuf);
            // One poll: ready data or nothing (the task's waker stays
            // registered, a spurious wake-up at worst).
            let read = std::future::poll_fn(|cx| {
                let mut read = std::pin::pin!(rd.read_buf(rbuf));
                std::task::Poll::Ready(read.as_mut().poll(cx))
            })
            .await;
            match read {
                std::task::Poll::Ready(read) => self.handle_read(read),
                std::task::Poll::Pending => return,
            }
        }
    }
}

/// The manager's memory from `/proc/self/status`: (resident, peak resident),
/// bytes. None off Linux or when unreadable.
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// One `session stats` line: the flow table against the cap, the limits that
/// bit, the kernel side's sockets and the manager process's memory. This is
/// the manager's metrics log (`kubectl logs` of the manager pod).
fn log_stats(engine: &Engine, kernel: &KernelSide, peak_flows: usize) {
    let (tcp, udp, ping) = engine.flow_counts();
    let (k_tcp, k_udp, k_ping) = kernel.counts();
    let m = engine.metrics();
    let (rss, peak_rss) = process_memory().unwrap_or_default();
    info!(
        flows = engine.flows(),
        max_flows = engine.max_flows(),
        peak_flows,
        tcp,
        udp,
        ping,
        forwarded = engine.forwarded_flows(),
        kernel_tcp = k_tcp,
        kernel_udp = k_udp,
        kernel_ping = k_ping,
        refused_cap = m.flows_refused_cap,
        rate_limited = m.flows_rate_limited,
        icmp_rate_limited = m.icmp_rate_limited,
        write_queue_full = m.write_queue_full,
        echoes_dropped = m.echoes_dropped,
        tcp_events_peak = m.tcp_events_peak,
        tcp_events_full = m.tcp_events_full,
        tcp_dials = m.tcp_dials,
        tcp_closed = m.tcp_closed,
        gso_frames = m.gso_frames,
        gso_segments = m.gso_segments,
        gro_frames = m.gro_frames,
        gro_segments = m.gro_segments,
        manager_rss_bytes = rss,
        manager_peak_rss_bytes = peak_rss,
        "session stats"
    );
}

/// The session's counters for the laptop ([`Kind::Stats`]): flows against
/// the cap, the limits, dropped echoes and the packet drops by reason (only
/// reasons that happened, to keep the frame small).
///
/// A worker connection of a sharded session (hello option 3) also sends
/// [`stat::WORKERS`]; the first stats frame goes out as soon as the session
/// starts, and is the laptop's proof that the manager took the option.
fn stats_frame(engine: &Engine, shard: Option<frame::Shard>) -> Option<Vec<u8>> {
    let m = engine.metrics();
    let as_u64 = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let mut counters = vec![
        (stat::FLOWS.to_owned(), as_u64(engine.flows())),
        (stat::FLOW_CAP.to_owned(), as_u64(engine.max_flows())),
        (stat::REFUSED_CAP.to_owned(), m.flows_refused_cap),
        (stat::RATE_LIMITED.to_owned(), m.flows_rate_limited),
        (stat::ICMP_RATE_LIMITED.to_owned(), m.icmp_rate_limited),
        (stat::ECHOES_DROPPED.to_owned(), m.echoes_dropped),
        (stat::GSO_FRAMES.to_owned(), m.gso_frames),
        (stat::GSO_SEGMENTS.to_owned(), m.gso_segments),
    ];
    if let Some(s) = shard {
        counters.push((stat::WORKERS.to_owned(), u64::from(s.count)));
    }
    for reason in DropReason::ALL {
        let n = m.dropped(reason);
        if n > 0 {
            counters.push((format!("{}{}", stat::DROP_PREFIX, reason.as_str()), n));
        }
    }
    let payload = Stats { counters }.encode().ok()?;
    let mut out = Vec::with_capacity(frame::HEADER_LEN + payload.len());
    frame::encode_into(Kind::Stats, &payload, &mut out).ok()?;
    Some(out)
}

/// The per-client limits one worker connection's engine gets: the session's
/// [`SessionConfig`] limits split evenly over `workers` connections (at least
/// one flow, and one new flow per second when the limit is on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShardLimits {
    max_flows: usize,
    new_flows_per_sec: u32,
    new_flow_burst: u32,
    /// The failed-dial limit; `--new-flows-per-sec 0` turns it off too.
    failed_flows_per_sec: u32,
}

impl ShardLimits {
    fn new(config: &SessionConfig, workers: u16) -> Self {
        let n = workers.max(1);
        let split = |v: u32| if v == 0 { 0 } else { (v / u32::from(n)).max(1) };
        Self {
            max_flows: (config.max_flows / usize::from(n)).max(1),
            new_flows_per_sec: split(config.new_flows_per_sec),
            new_flow_burst: split(config.new_flow_burst),
            failed_flows_per_sec: if config.new_flows_per_sec == 0 {
                0
            } else {
                split(config.failed_dials_per_sec)
            },
        }
    }
}

/// Run one client session on `stream` until the laptop closes it or it fails.
///
/// Returns the session's counters when the laptop closed the stream; logs a
/// summary either way. Never panics on input from the network.
pub async fn run_session<S>(stream: S, config: &SessionConfig) -> Result<Metrics, SessionError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, wr) = tokio::io::split(stream);
    let mut rbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    let hello = match handshake(&mut rd, &mut rbuf, config.hello_timeout).await {
        Ok(h) => h,
        // A bare TCP connect-and-close is the readiness probe: not worth a warning.
        Err(e @ SessionError::ClosedBeforeHello) => {
            debug!(error = %e, "connection closed before a hello");
            return Err(e);
        }
        Err(e) => {
            warn!(error = %e, "rejecting session");
            if let Some(why) = e.refusal() {
                config.counters.refuse_hello(why);
            }
            return Err(e);
        }
    };
    let span = tracing::info_span!("session", tunnel_ip = %hello.tunnel_ip, tunnel_ip_v6 = ?hello.tunnel_ip_v6);
    let tunnel_ip = hello.tunnel_ip;
    async move {
        if let Some(leases) = &config.leases {
            match leases.attach(tunnel_ip, &hello.token).await {
                Ok(client_id) => debug!(client = %crate::lease::client_fingerprint(&client_id), "hello carries the lease's token"),
                Err(e) => {
                    warn!(error = %e, token_bytes = hello.token.len(), "rejecting session: the hello's session token is not valid for its tunnel IP");
                    let e = SessionError::Lease(e);
                    if let Some(why) = e.refusal() {
                        config.counters.refuse_hello(why);
                    }
                    return Err(e);
                }
            }
        }
        config.counters.session_started();
        let result = run_established(rd, wr, rbuf, &hello, config).await;
        config.counters.session_ended();
        if let Some(leases) = &config.leases {
            leases.detach(tunnel_ip).await;
        }
        result
    }
    .instrument(span)
    .await
}

async fn run_established<R, W>(
    rd: R,
    wr: W,
    rbuf: Vec<u8>,
    hello: &Hello,
    config: &SessionConfig,
) -> Result<Metrics, SessionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let tunnel_ip = hello.tunnel_ip;
    let mut engine_config = EngineConfig::new(tunnel_ip, random_seed());
    engine_config.tunnel_ip_v6 = hello.tunnel_ip_v6;
    // A version-1 hello has no MTU: that version's laptops used the default.
    engine_config.laptop_mtu = hello
        .mtu
        .map_or(crate::engine::DEFAULT_MTU, usize::from)
        .clamp(crate::engine::MIN_LAPTOP_MTU, crate::engine::DEFAULT_MTU);
    info!(
        laptop_mtu = engine_config.laptop_mtu,
        tcp_window = config.tcp_window,
        "session started"
    );
    engine_config.allow_loopback = config.allow_loopback;
    engine_config.tcp_window = config.tcp_window;
    // A laptop with N worker connections (hello option 3) gets one engine (one
    // smoltcp interface) per connection, so one worker's flows never wait on
    // another's; the per-client limits are split evenly over them (a fixed
    // share each: no lock or atomic between the engines on the packet path).
    let shard = hello.shard.filter(|s| s.count > 1);
    let limits = ShardLimits::new(config, shard.map_or(1, |s| s.count));
    if let Some(s) = shard {
        info!(
            worker = s.index,
            workers = s.count,
            max_flows = limits.max_flows,
            new_flows_per_sec = limits.new_flows_per_sec,
            "worker connection of a sharded session"
        );
    }
    engine_config.max_flows = limits.max_flows;
    engine_config.max_tcp_flows = limits.max_flows;
    engine_config.max_udp_flows = engine_config.max_udp_flows.min(limits.max_flows);
    engine_config.max_ping_flows = engine_config.max_ping_flows.min(limits.max_flows);
    engine_config.new_flows_per_sec = limits.new_flows_per_sec;
    engine_config.new_flow_burst = limits.new_flow_burst;
    engine_config.failed_flows_per_sec = limits.failed_flows_per_sec;
    // Hello option 5: the engine parked by this worker's earlier connection
    // with the same resume token (and lease token), if there is one.
    let key = (tunnel_ip, shard.map_or(0, |s| s.index));
    let (resumed, claim) = match hello.resume_token {
        Some(resume_token) => {
            let credentials = Credentials {
                resume_token,
                lease_token: hello.token.clone(),
            };
            let a = config
                .resumes
                .attach(key, credentials, config.leases.is_some(), &config.counters)
                .await;
            (a.state, a.claim)
        }
        None => (None, None),
    };
    let resume_answer = hello.resume_token.map(|_| {
        if resumed.is_some() {
            ResumeAnswer::Resumed
        } else {
            ResumeAnswer::New
        }
    });
    let ParkedEngine {
        mut engine,
        mut kernel,
        mut events_rx,
        mut datagrams_rx,
        mut peak_flows,
        mut drops_synced,
    } = match resumed {
        Some(parked) => {
            let (tcp, udp, ping) = parked.engine.flow_counts();
            info!(
                tcp,
                udp, ping, "engine resumed: the flows of this worker's earlier connection go on"
            );
            parked
        }
        None => {
            let (events_tx, events_rx) = TcpEventSender::channel(TCP_EVENT_QUEUE);
            let (datagrams_tx, datagrams_rx) = mpsc::channel(DATAGRAM_QUEUE);
            ParkedEngine {
                engine: Engine::new(engine_config, Instant::now()),
                kernel: KernelSide::new(events_tx, datagrams_tx, config.dial_timeout),
                events_rx,
                datagrams_rx,
                peak_flows: 0,
                drops_synced: DropsSynced::default(),
            }
        }
    };
    let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(WRITE_QUEUE_BATCHES);
    let (control_tx, control_rx) = mpsc::channel::<Vec<u8>>(CONTROL_QUEUE);
    // Offloads: a laptop that offered GSO frames (hello option 4) gets the
    // manager's hello, first on the stream, saying they are accepted; until it
    // reads it, the laptop segments super-packets itself.
    let mut gso = GsoIntake::default();
    // And one that offered to take them gets its TCP segments merged.
    let mut gro: Option<GroOutput> = None;
    // A worker connection of a sharded session: the first stats frame, with
    // the worker count, goes out before the manager's hello, because the
    // laptop reads frames up to that answer before its pump starts (and the
    // pump must see the manager's hello).
    if let Some(s) = shard.filter(|_| hello.version >= STATS_VERSION)
        && let Some(answer) = stats_frame(&engine, Some(s))
    {
        // Cannot fail: the control queue is new and empty.
        let _ = control_tx.try_send(answer);
    }
    if let Some(offered) = hello.offloads {
        let accepted = offered & (OFFLOAD_TCP_GSO | OFFLOAD_TCP_GRO);
        if accepted & OFFLOAD_TCP_GRO != 0 {
            gro = Some(GroOutput::default());
        }
        let answer = ManagerHello {
            version: PROTOCOL_VERSION,
            offloads: accepted,
        };
        let mut wire = Vec::new();
        // Cannot fail: a 5-byte payload fits any frame.
        let _ = frame::encode_into(Kind::Hello, &answer.encode(), &mut wire);
        // Cannot fail: the control queue is new and empty.
        let _ = control_tx.try_send(wire);
        gso.accepted = accepted & OFFLOAD_TCP_GSO != 0;
        if gso.accepted {
            gso.segments.reserve(GSO_SEGMENTS_CAPACITY);
        }
        info!(offered, accepted, "offloads negotiated");
    }
    // The answer to hello option 5, after the shard and offload answers (the
    // laptop's Connect reads frames up to the shard answer itself; the pump
    // reads from there on).
    if let Some(answer) = resume_answer {
        let mut wire = Vec::new();
        // Cannot fail: a 1-byte payload fits any frame.
        let _ = frame::encode_into(Kind::Resume, &[answer.to_u8()], &mut wire);
        // Cannot fail: the control queue holds at most two frames so far.
        let _ = control_tx.try_send(wire);
    }
    // Stats frames take the control queue too: they go before data.
    let stats_tx = (hello.version >= STATS_VERSION).then(|| control_tx.clone());
    let _writer = AbortOnDrop(tokio::spawn(
        write_frames(wr, control_rx, out_rx).in_current_span(),
    ));
    let mut reader = LaptopReader::new(rd, rbuf, control_tx, config.idle_timeout);
    // The engine loop swaps its spent buffer for the intake's frames.
    let mut frames: Vec<u8> = Vec::new();
    // Other laptops' packets for this tunnel IP go straight to the writer.
    let _peer = config
        .peers
        .register(tunnel_ip, shard.map_or(0, |s| s.index), out_tx.clone());
    let mut out: Vec<u8> = Vec::new();
    let mut stats = tokio::time::interval_at(
        tokio::time::Instant::now() + config.stats_interval,
        config.stats_interval,
    );
    stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let silence = tokio::time::sleep_until(reader.silent_at());
    tokio::pin!(silence);
    let mut stats_frames = tokio::time::interval(STATS_FRAME_INTERVAL);
    stats_frames.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let result: Result<(), SessionError> = loop {
        let now = Instant::now();
        frames.clear();
        let end = {
            let intake = &mut reader.intake;
            std::mem::swap(&mut frames, &mut intake.frames);
            let m = engine.metrics_mut();
            m.heartbeats += std::mem::take(&mut intake.heartbeats);
            m.echoes_dropped += std::mem::take(&mut intake.echoes_dropped);
            for _ in 0..std::mem::take(&mut intake.dropped) {
                m.drop_packet(DropReason::IntakeFull);
            }
            intake.end.take()
        };
        // Only whole packet frames reach the intake. The engine works through
        // them a slice at a time and yields between slices: a flood's 2 MiB
        // of 64-byte datagrams takes this task long enough that the writer,
        // woken onto this worker thread (tokio's LIFO slot is not stolen by
        // the other worker), would otherwise not send a heartbeat echo for
        // seconds. Seen in tests/tests/flood.rs: echoes queued, no write.
        // Between slices it also reads what the laptop sent meanwhile (echoing
        // heartbeats at once, dropping packets beyond the intake's bound), as
        // a reader task of its own would. No yield after the last slice: the
        // loop goes on to wait below, which lets the writer run.
        let mut off = 0;
        let mut failed = None;
        while off < frames.len() {
            if off > 0 {
                tokio::task::yield_now().await;
                reader.drain().await;
            }
            match handle_frames(
                &frames[off..],
                &mut engine,
                &mut out,
                now,
                config,
                ROUND_BYTES,
                &mut gso,
            ) {
                Ok(0) => break,
                Ok(used) => off += used,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            break Err(e);
        }
        if let Some(end) = end {
            break end;
        }
        engine.poll(now);
        // Requests, and the events applying them produced (a socket that
        // failed), until neither is left.
        loop {
            while let Some(request) = engine.poll_request() {
                kernel.apply(request);
            }
            let mut reported = false;
            while let Some(event) = kernel.poll_event() {
                engine.handle_event(event, now);
                reported = true;
            }
            if !reported {
                break;
            }
            engine.poll(now);
        }
        engine.metrics_mut().tcp_events_full = kernel.tcp_events_full();
        kernel.reap();
        transmit(&mut engine, &mut out, gro.as_mut());
        peak_flows = peak_flows.max(engine.flows());
        config
            .counters
            .add_drops(engine.metrics(), &mut drops_synced);
        if !out.is_empty() {
            let batch = std::mem::take(&mut out);
            let sent = match out_tx.try_send(batch) {
                Ok(()) => Ok(()),
                Err(mpsc::error::TrySendError::Full(batch)) => {
                    // Backpressure: the engine waits until the writer drains;
                    // the laptop is still read meanwhile (echoes go out,
                    // packets beyond the intake's bound are dropped).
                    engine.metrics_mut().write_queue_full += 1;
                    loop {
                        tokio::select! {
                            biased;
                            permit = out_tx.reserve() => break permit.map(|p| p.send(batch)).map_err(|_| ()),
                            read = reader.readable(), if reader.open() => reader.handle_read(read),
                        }
                    }
                }
                Err(mpsc::error::TrySendError::Closed(_)) => Err(()),
            };
            if sent.is_err() {
                break Err(SessionError::Write);
            }
        }

        let timer = engine
            .poll_timeout(now)
            .map(|t| tokio::time::Instant::now() + t.saturating_duration_since(Instant::now()));
        tokio::select! {
            read = reader.readable(), if reader.open() => reader.handle_read(read),
            () = &mut silence, if reader.open() => reader.check_silence(silence.as_mut()),
            Some(event) = events_rx.recv() => {
                let queued = u64::try_from(events_rx.len() + 1).unwrap_or(u64::MAX);
                let m = engine.metrics_mut();
                m.tcp_events_peak = m.tcp_events_peak.max(queued);
                let now = Instant::now();
                engine.handle_event(event, now);
                for _ in 0..EVENTS_PER_ROUND {
                    match events_rx.try_recv() {
                        Ok(event) => engine.handle_event(event, now),
                        Err(_) => break,
                    }
                }
            }
            Some(event) = datagrams_rx.recv() => {
                let now = Instant::now();
                engine.handle_event(event, now);
                for _ in 0..EVENTS_PER_ROUND {
                    match datagrams_rx.try_recv() {
                        Ok(event) => engine.handle_event(event, now),
                        Err(_) => break,
                    }
                }
            }
            _ = tokio::time::sleep_until(timer.unwrap_or_else(tokio::time::Instant::now)), if timer.is_some() => {
                engine.handle_timeout(Instant::now());
            }
            () = superseded(claim.as_ref()) => break Err(SessionError::Superseded),
            _ = stats.tick() => log_stats(&engine, &kernel, peak_flows),
            _ = stats_frames.tick(), if stats_tx.is_some() => {
                if let (Some(tx), Some(frame)) = (&stats_tx, stats_frame(&engine, shard))
                    && tx.try_send(frame).is_err()
                {
                    trace!("stats frame skipped: the control queue is full");
                }
            }
        }
    };
    log_stats(&engine, &kernel, peak_flows);
    config
        .counters
        .add_drops(engine.metrics(), &mut drops_synced);
    let (tcp, udp, ping) = engine.flow_counts();
    let metrics = engine.metrics().clone();
    match &result {
        Ok(()) => info!(%metrics, tcp, udp, ping, "session closed by the laptop"),
        Err(e) => warn!(error = %e, %metrics, tcp, udp, ping, "session ended"),
    }
    // A connection that offered a resume token parks its engine for the
    // grace period (dropped at once when resuming is off); otherwise dropping
    // the kernel side resets the remaining connections.
    let leaving = reader.intake.leaving;
    if let Some(claim) = claim.filter(|_| !leaving) {
        claim.park(ParkedEngine {
            engine,
            kernel,
            events_rx,
            datagrams_rx,
            peak_flows,
            drops_synced,
        });
    } else {
        drop(kernel);
    }
    result.map(|()| metrics)
}

/// Resolves when a newer connection with the same resume token takes over
/// `claim`'s worker; never without a claim.
async fn superseded(claim: Option<&crate::resume::Claim<ParkedEngine>>) {
    match claim {
        Some(c) => c.superseded().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    async fn next_frame(rd: &mut tokio::io::DuplexStream, buf: &mut Vec<u8>) -> (Kind, Vec<u8>) {
        loop {
            if let Some((f, n)) = Decoder::default().decode(buf).expect("valid frames") {
                let found = (f.kind, f.payload.to_vec());
                buf.drain(..n);
                return found;
            }
            assert!(rd.read_buf(buf).await.expect("read") > 0, "manager closed");
        }
    }

    /// The engine loop reads the laptop's stream itself: heartbeats are echoed,
    /// every read puts the silence deadline off, and `idle_timeout` without a
    /// byte ends the session.
    #[tokio::test]
    async fn heartbeats_are_echoed_and_silence_ends_the_session() {
        let config = SessionConfig {
            idle_timeout: Duration::from_millis(400),
            ..SessionConfig::default()
        };
        let (mut laptop, manager) = tokio::io::duplex(1 << 16);
        let session = tokio::spawn(async move { run_session(manager, &config).await });
        let hello = Hello::new(PROTOCOL_VERSION, LAPTOP.into())
            .encode()
            .expect("hello encodes");
        let mut wire = Vec::new();
        frame::encode_into(Kind::Hello, &hello, &mut wire).expect("fits");
        laptop.write_all(&wire).await.expect("hello sent");
        let start = tokio::time::Instant::now();
        let mut rbuf = Vec::new();
        // Four heartbeats 250 ms apart: a session of 1 s, over twice the
        // idle timeout, kept up by the reads alone.
        for nonce in 1u64..=4 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let mut heartbeat = Vec::new();
            frame::encode_into(Kind::Heartbeat, &nonce.to_be_bytes(), &mut heartbeat)
                .expect("fits");
            laptop.write_all(&heartbeat).await.expect("heartbeat sent");
            loop {
                match next_frame(&mut laptop, &mut rbuf).await {
                    (Kind::Heartbeat, echo) => {
                        assert_eq!(echo, nonce.to_be_bytes());
                        break;
                    }
                    (Kind::Stats, _) => {}
                    (kind, _) => panic!("unexpected frame {kind:?}"),
                }
            }
        }
        let ended = tokio::time::timeout(Duration::from_secs(10), session)
            .await
            .expect("the silent session ends")
            .expect("session task");
        assert!(
            matches!(ended, Err(SessionError::Silent(_))),
            "ended with {ended:?}"
        );
        assert!(start.elapsed() >= Duration::from_millis(1400));
    }

    const LAPTOP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);

    /// An IPv4 TCP ACK with `payload` from the laptop to a pod, as a TSO
    /// super-packet (the segmenter computes every checksum itself).
    fn super_packet(payload: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((40 + payload.len()) as u16).to_be_bytes());
        p[6] = 0x40;
        p[8] = 64;
        p[9] = 6;
        p[12..16].copy_from_slice(&LAPTOP.octets());
        p[16..20].copy_from_slice(&[10, 244, 1, 20]);
        p[20..22].copy_from_slice(&40000u16.to_be_bytes());
        p[22..24].copy_from_slice(&7007u16.to_be_bytes());
        p[24..28].copy_from_slice(&1000u32.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = 0x10;
        p[34..36].copy_from_slice(&512u16.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }

    fn gso_payload(gso_type: u8, gso_size: u16, packet: &[u8]) -> Vec<u8> {
        let header = GsoHeader {
            flags: gso::F_NEEDS_CSUM,
            gso_type,
            hdr_len: 40,
            gso_size,
            csum_start: 20,
            csum_offset: 16,
        };
        let mut payload = header.encode().to_vec();
        payload.extend_from_slice(packet);
        payload
    }

    #[test]
    fn gso_frames_are_segmented_into_the_packet_path_only_when_offered() {
        let config = SessionConfig::default();
        let now = Instant::now();
        let mut engine = Engine::new(EngineConfig::new(IpAddr::V4(LAPTOP), 1), now);
        let mut gso = GsoIntake::default();
        let mut out = Vec::new();
        let packet = super_packet(&[7u8; 3500]);
        let mut wire = Vec::new();
        frame::encode_into(
            Kind::Gso,
            &gso_payload(gso::GSO_TCPV4, 1000, &packet),
            &mut wire,
        )
        .expect("fits");

        // The whole frame through the session's frame dispatch.
        let mut feed = |engine: &mut Engine, gso: &mut GsoIntake| {
            let used = handle_frames(&wire, engine, &mut out, now, &config, usize::MAX, gso)
                .expect("valid frames");
            assert_eq!(used, wire.len());
        };

        // The hello did not offer offloads: dropped, counted, nothing segmented.
        feed(&mut engine, &mut gso);
        assert_eq!(engine.metrics().dropped(DropReason::Gso), 1);
        assert_eq!(engine.metrics().packets_from_laptop, 0);

        // Offered: 4 segments, each handled like a packet frame.
        gso.accepted = true;
        feed(&mut engine, &mut gso);
        let m = engine.metrics();
        assert_eq!((m.gso_frames, m.gso_segments), (1, 4));
        assert_eq!(m.packets_from_laptop, 4);
        assert_eq!(
            m.bytes_from_laptop,
            3500 + 4 * 40,
            "headers repeated per segment"
        );

        // Malformed super-packet, unknown gso_type: dropped and counted.
        gso_frame(
            &gso_payload(gso::GSO_TCPV4, 1000, &packet[..30]),
            &mut engine,
            now,
            &config,
            &mut gso,
        );
        gso_frame(
            &gso_payload(5, 1000, &packet),
            &mut engine,
            now,
            &config,
            &mut gso,
        );
        gso_frame(&[1, 2, 3], &mut engine, now, &config, &mut gso);
        assert_eq!(engine.metrics().dropped(DropReason::Gso), 4);
        assert_eq!(engine.metrics().packets_from_laptop, 4);

        // Not a super-packet, checksum partial: completed, one packet.
        gso_frame(
            &gso_payload(gso::GSO_NONE, 0, &super_packet(&[1; 10])),
            &mut engine,
            now,
            &config,
            &mut gso,
        );
        let m = engine.metrics();
        assert_eq!(
            (m.gso_frames, m.gso_segments, m.packets_from_laptop),
            (2, 5, 5)
        );
    }

    #[test]
    fn limits_are_split_over_worker_connections() {
        let config = SessionConfig {
            max_flows: 1000,
            new_flows_per_sec: 200,
            new_flow_burst: 50,
            failed_dials_per_sec: 100,
            ..SessionConfig::default()
        };
        let one = ShardLimits::new(&config, 1);
        assert_eq!(
            one,
            ShardLimits {
                max_flows: 1000,
                new_flows_per_sec: 200,
                new_flow_burst: 50,
                failed_flows_per_sec: 100,
            },
            "one worker: the configured limits as they are"
        );
        let four = ShardLimits::new(&config, 4);
        assert_eq!(four.max_flows * 4, 1000);
        assert_eq!(four.new_flows_per_sec * 4, 200);
        assert_eq!(four.new_flow_burst, 12);
        assert_eq!(four.failed_flows_per_sec, 25);
        // Tiny limits never become 0 (which would refuse every flow), and an
        // unlimited rate stays unlimited.
        let tiny = SessionConfig {
            max_flows: 3,
            new_flows_per_sec: 0,
            new_flow_burst: 2,
            ..SessionConfig::default()
        };
        let split = ShardLimits::new(&tiny, 16);
        assert_eq!(split.max_flows, 1);
        assert_eq!(split.new_flows_per_sec, 0);
        assert_eq!(split.new_flow_burst, 1);
        assert_eq!(
            split.failed_flows_per_sec, 0,
            "--new-flows-per-sec 0 turns the failed-dial limit off too"
        );
    }
}
