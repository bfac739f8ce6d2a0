//! The pure core of one client session: a smoltcp any-IP interface plus the
//! flow tables for TCP, UDP and ICMP echo.
//!
//! No I/O, no clock, no randomness: inputs are [`Engine::handle_laptop_packet`],
//! [`Engine::handle_event`] (what the kernel side reported) and
//! [`Engine::handle_timeout`], each with `now`; outputs are packets for the
//! laptop ([`Engine::poll_transmit`]), requests for the kernel side
//! ([`Engine::poll_request`]: dial, write, grant, close, ...) and
//! [`Engine::poll_timeout`]. The tokio shell in [`crate::session`] drives it.
//!
//! "Outbound" is laptop -> cluster, "inbound" is cluster -> laptop.
//!
//! # TCP
//! - A laptop SYN to a new `(laptop port, destination)` is held, not given to
//!   smoltcp, and a [`Request::TcpDial`] goes out. Retransmitted SYNs are
//!   absorbed while the dial runs. Only when the dial succeeded does the
//!   engine create a smoltcp socket listening on the destination endpoint
//!   (any-IP) and feed it the held SYN, so the SYN-ACK means "the destination
//!   accepted". A refused dial answers with RST|ACK (the laptop's connect()
//!   fails with ECONNREFUSED); a timed-out or unroutable one with ICMP host
//!   unreachable (EHOSTUNREACH).
//! - Outbound data: read from the smoltcp socket only while fewer than
//!   [`TCP_WRITE_WINDOW`] bytes are queued towards the kernel socket
//!   ([`Event::TcpWritten`] frees them), so a slow destination closes the
//!   laptop's window instead of growing a queue.
//! - Inbound data: the kernel side may read from the destination only as many
//!   bytes as it was granted ([`Request::TcpGrant`]); grants never exceed the
//!   free space of the smoltcp send buffer, so every [`Event::TcpData`] fits
//!   and nothing is dropped.
//! - FIN: the laptop's FIN becomes `shutdown(SHUT_WR)` on the kernel socket
//!   after all of the laptop's data was handed over; the destination's EOF
//!   becomes `close()` on the smoltcp socket, whose FIN follows all queued data.
//!   Either side can half-close and keep receiving.
//! - RST: a laptop RST closes the kernel socket with SO_LINGER 0 (RST); a
//!   destination RST aborts the smoltcp socket (RST to the laptop).
//!
//! - Idle flows: an established flow without a segment or kernel event in
//!   either direction for [`TCP_IDLE_TIMEOUT`] (5 days, Linux conntrack's
//!   `nf_conntrack_tcp_timeout_established`) is reset both ways. Nothing
//!   shorter: smoltcp's own timeout and keep-alive stay off, so a flow idle
//!   for hours (a database shell left open) lives on (tr-09).
//!
//! # MTU, MSS and fragments
//! The manager's stack MTU is [`DEFAULT_MTU`], equal to the laptop's default
//! TUN MTU. Every transport is a byte stream (TCP, TLS, port-forward, SSH),
//! which segments the frames by its own path MTU, so the inner MTU does not
//! depend on the path between laptop and manager (tr-01): it only bounds the
//! packet size, and a large one cuts per-packet work.
//! - TCP MSS: smoltcp advertises `DEFAULT_MTU - 40` in its SYN-ACK and sends
//!   segments no larger than the laptop's advertised MSS (RFC 6691), so a
//!   laptop with a smaller TUN MTU is served with smaller segments. The far
//!   side is a separate kernel TCP connection with its own MSS and PMTUD.
//! - Fragments from the laptop (its kernel fragments UDP/ICMP larger than the
//!   TUN MTU) are reassembled with bounded memory and time ([`crate::frag`])
//!   before they are classified; the kernel side then sends the whole
//!   datagram, fragmenting it for the pod's path as its own kernel does.
//! - A laptop packet larger than [`DEFAULT_MTU`] that must not be fragmented
//!   (IPv4 with DF, or IPv6) is answered with ICMP "fragmentation needed" /
//!   ICMPv6 "Packet Too Big" carrying [`DEFAULT_MTU`] (RFC 1191, RFC 8201),
//!   so PMTUD on the laptop converges (a TUN configured larger than the
//!   manager's stack).
//! - Replies the manager builds (UDP, echo) larger than the laptop's TUN MTU
//!   ([`EngineConfig::laptop_mtu`], from the hello; [`DEFAULT_MTU`] for a
//!   version-1 hello) are fragmented to it, as the sending host would; the
//!   laptop reassembles. Its kernel would take a packet over the TUN MTU as
//!   well, but a packet that fits the laptop's link is what a router would
//!   deliver.
//!
//! # UDP and ICMP echo
//! One kernel socket per `(laptop port, destination)` UDP flow and per
//! `(destination, echo identifier)` ping flow, closed after an idle timeout.
//! Replies are built with `smoltcp::wire` ([`crate::packet`]) with the
//! destination as source; echo replies carry the laptop's own identifier (the
//! kernel rewrites it on ping sockets). UDP and ICMP never reach smoltcp: its
//! UDP sockets bind one port each (any-IP would need a socket per destination
//! port before the first datagram), and for unknown ports or pings it would
//! answer itself (port unreachable, echo reply), which would lie about the
//! cluster. ICMP errors the kernel socket reports for a UDP flow (port or
//! host unreachable from the cluster) are answered to the laptop with the
//! same ICMP error, so its connected socket sees ECONNREFUSED / EHOSTUNREACH.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpListenEndpoint, IpProtocol};
use tracing::{debug, trace};

use crate::forwarded::{self, ForwardedFlows, Segment};
use crate::frag::{self, Reassembler, Reassembly};
use crate::limit::{self, TokenBucket};
use crate::metrics::Metrics;
use crate::packet::{self, DropReason, Offending, Parsed, TcpMeta, Unreachable};
use kvpn_proto::device::QueueDevice;

/// IP MTU of the manager's stack, bytes. Equal to the laptop's default TUN MTU
/// ([`kvpn_proto::frame::DEFAULT_TUN_MTU`]): the transport is a byte stream, so
/// large packets cost nothing extra and cut per-packet work.
pub const DEFAULT_MTU: usize = kvpn_proto::frame::DEFAULT_TUN_MTU as usize;

/// Smallest laptop TUN MTU the manager fragments to (bytes): the IPv6 minimum
/// link MTU (RFC 8200 §5), also the laptop's smallest TUN MTU
/// ([`kvpn_proto::frame::MIN_TUN_MTU`]).
pub const MIN_LAPTOP_MTU: usize = kvpn_proto::frame::MIN_TUN_MTU as usize;

/// The manager stack's own IPv4 address (first address of the tunnel pool
/// 100.96.0.0/16); the default route points at it for any-IP.
pub const MANAGER_STACK_V4: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 1);

/// The manager stack's own IPv6 address (a ULA; "kvpn" in the global ID), used
/// the same way for sessions whose tunnel IP is IPv6.
pub const MANAGER_STACK_V6: Ipv6Addr = Ipv6Addr::new(0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, 1);

/// smoltcp receive buffer per TCP flow, bytes: the window the laptop may fill.
/// 512 KiB is the bandwidth-delay product of ~4 Gbit/s at 1 ms RTT (the lab's
/// tunnel RTT is ~0.2 ms; port-forward or SSH paths are slower). Buffers are
/// zero-filled allocations the kernel maps lazily, so idle flows cost little
/// resident memory.
pub const TCP_RX_BUFFER: usize = 512 * 1024;

/// smoltcp send buffer per TCP flow, bytes (inbound data not yet acknowledged
/// by the laptop). Same reasoning as [`TCP_RX_BUFFER`].
pub const TCP_TX_BUFFER: usize = 512 * 1024;

/// Outbound bytes handed to the kernel side but not yet written to the
/// destination socket, per flow. Half the receive buffer: enough to keep the
/// kernel socket busy while the next chunk is read.
pub const TCP_WRITE_WINDOW: usize = 256 * 1024;

/// Largest single outbound write request, bytes.
pub const TCP_WRITE_CHUNK: usize = 64 * 1024;

/// Smallest inbound credit worth a grant message, bytes (except the first).
pub const TCP_GRANT_MIN: usize = 16 * 1024;

/// UDP flows without traffic in either direction for this long are closed.
pub const UDP_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Ping flows without traffic for this long are closed.
pub const PING_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// TCP flows without a segment or kernel event in either direction for this
/// long are reset: Linux conntrack's established timeout
/// (`nf_conntrack_tcp_timeout_established`, 432000 s), far above the 2 h
/// after which TCP keep-alive starts probing.
pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(5 * 24 * 3600);

/// How often idle TCP flows are looked for: the timeout is days, so a minute
/// of slack costs nothing and keeps the per-round timer work constant.
pub const TCP_IDLE_SWEEP: Duration = Duration::from_secs(60);

/// Least time between two scans of the UDP and ping flows for idle ones. The
/// scan is O(flows); without a floor, a laptop opening a new flow every
/// millisecond (a UDP sweep of closed ports, each datagram a new flow up to the
/// 4096-flow cap) made every engine round scan thousands of flows and cost the
/// manager's CPU that other sessions needed (the flood-fairness measurement: `kvpn-bench --fairness-only`, bench/src/fairness.rs). An
/// idle flow is closed at most this much after its timeout.
pub const IDLE_SCAN_MIN: Duration = Duration::from_secs(1);

/// Default per-client flow cap (all kinds): 16384 TCP flows at the smoltcp
/// buffers' worst case (1 MiB each, only touched pages resident) is far more
/// than a pod should give one laptop, but a laptop running a test suite or a
/// crawler against the cluster stays well under it.
pub const DEFAULT_MAX_FLOWS: usize = 16_384;

/// Bound on smoltcp poll/service rounds per [`Engine::poll`]; each round either
/// makes progress or stops, this only guards against a livelock.
const MAX_POLL_ROUNDS: usize = 16;

/// Settings of one session's engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The laptop's tunnel IP from the hello: an accepted source address.
    pub tunnel_ip: IpAddr,
    /// The laptop's IPv6 tunnel IP of a dual-stack session (hello option 2):
    /// the other accepted source address, for IPv6 flows.
    pub tunnel_ip_v6: Option<Ipv6Addr>,
    /// Seed for smoltcp's initial sequence numbers and ports.
    pub random_seed: u64,
    /// Relay to loopback destinations (tests only; never in a cluster).
    pub allow_loopback: bool,
    /// Idle timeout of UDP flows.
    pub udp_idle_timeout: Duration,
    /// Idle timeout of ping flows.
    pub ping_idle_timeout: Duration,
    /// Idle timeout of TCP flows (no segment or event either way).
    pub tcp_idle_timeout: Duration,
    /// Most concurrent flows of all kinds (TCP including dials and TIME-WAIT,
    /// UDP, ping): the per-client flow cap (`kvpn-manager --max-flows-per-client`).
    /// A new flow beyond it is refused: TCP with RST, UDP with ICMP
    /// "communication administratively prohibited", ping dropped; counted in
    /// [`Metrics::flows_refused_cap`].
    pub max_flows: usize,
    /// Most concurrent TCP flows (including dials in progress).
    pub max_tcp_flows: usize,
    /// Most concurrent UDP flows.
    pub max_udp_flows: usize,
    /// Most concurrent ping flows.
    pub max_ping_flows: usize,
    /// New flows per second, sustained (0: unlimited); see [`crate::limit`].
    pub new_flows_per_sec: u32,
    /// New flows at once (token bucket size).
    pub new_flow_burst: u32,
    /// New flows per second that may fail (TCP dials refused, unreachable or
    /// timed out), sustained (0: unlimited); see [`limit::FAILED_FLOWS_PER_SEC`].
    pub failed_flows_per_sec: u32,
    /// Failed new flows at once (token bucket size).
    pub failed_flow_burst: u32,
    /// ICMP errors to the laptop per second, sustained (0: unlimited).
    pub icmp_errors_per_sec: u32,
    /// ICMP errors at once.
    pub icmp_error_burst: u32,
    /// The laptop's TUN MTU (bytes, from the hello): packets the manager builds
    /// for the laptop are fragmented to it. [`MIN_LAPTOP_MTU`]..=[`DEFAULT_MTU`].
    pub laptop_mtu: usize,
    /// smoltcp receive buffer per TCP flow, bytes: the window the laptop's
    /// sender may fill ([`TCP_RX_BUFFER`] unless the manager's `--tcp-window`).
    pub tcp_window: usize,
}

impl EngineConfig {
    /// Whether `ip` is one of the laptop's tunnel IPs (the accepted sources).
    pub fn is_tunnel_ip(&self, ip: IpAddr) -> bool {
        ip == self.tunnel_ip || matches!(ip, IpAddr::V6(v6) if Some(v6) == self.tunnel_ip_v6)
    }

    /// The laptop's tunnel IP of `peer`'s address family: the destination of
    /// what the manager builds for a flow with the cluster address `peer`.
    pub fn laptop_ip_for(&self, peer: IpAddr) -> IpAddr {
        match (peer, self.tunnel_ip_v6) {
            (IpAddr::V6(_), Some(v6)) => IpAddr::V6(v6),
            _ => self.tunnel_ip,
        }
    }

    /// Defaults for a laptop with `tunnel_ip`.
    pub fn new(tunnel_ip: IpAddr, random_seed: u64) -> Self {
        Self {
            tunnel_ip,
            tunnel_ip_v6: None,
            random_seed,
            allow_loopback: false,
            udp_idle_timeout: UDP_IDLE_TIMEOUT,
            ping_idle_timeout: PING_IDLE_TIMEOUT,
            tcp_idle_timeout: TCP_IDLE_TIMEOUT,
            max_flows: DEFAULT_MAX_FLOWS,
            max_tcp_flows: DEFAULT_MAX_FLOWS,
            max_udp_flows: 4096,
            max_ping_flows: 1024,
            new_flows_per_sec: limit::NEW_FLOWS_PER_SEC,
            new_flow_burst: limit::NEW_FLOW_BURST,
            failed_flows_per_sec: limit::FAILED_FLOWS_PER_SEC,
            failed_flow_burst: limit::FAILED_FLOW_BURST,
            icmp_errors_per_sec: limit::ICMP_ERRORS_PER_SEC,
            icmp_error_burst: limit::ICMP_ERROR_BURST,
            laptop_mtu: DEFAULT_MTU,
            tcp_window: TCP_RX_BUFFER,
        }
    }
}

/// Identifies one flow (TCP, UDP or ping) of a session in requests and events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowId(pub u64);

impl fmt::Display for FlowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "f{}", self.0)
    }
}

/// Why a dial of the real destination failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialError {
    /// ECONNREFUSED: the destination answered RST.
    Refused,
    /// EHOSTUNREACH / ENETUNREACH.
    Unreachable,
    /// No answer within the dial timeout.
    TimedOut,
    /// Anything else (answered like a refusal).
    Other,
}

/// Work for the kernel side. Every `TcpDial`, `UdpOpen` and `PingOpen` is
/// eventually followed by exactly one `TcpClose`, `UdpClose` or `PingClose`
/// for the same flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Connect a kernel TCP socket to `dst`; answer with [`Event::TcpDialed`].
    TcpDial {
        /// The flow.
        flow: FlowId,
        /// The real destination.
        dst: SocketAddr,
    },
    /// Write outbound bytes to the flow's kernel socket, in order; answer with
    /// [`Event::TcpWritten`] once written.
    TcpWrite {
        /// The flow.
        flow: FlowId,
        /// The bytes.
        data: Vec<u8>,
    },
    /// `shutdown(SHUT_WR)` the kernel socket after all earlier writes.
    TcpShutdownWrite {
        /// The flow.
        flow: FlowId,
    },
    /// Allow reading `bytes` more inbound bytes from the kernel socket.
    TcpGrant {
        /// The flow.
        flow: FlowId,
        /// Credit, bytes.
        bytes: usize,
    },
    /// Close the kernel socket: after earlier writes, or at once with RST
    /// (SO_LINGER 0) if `reset`. Also ends a dial in progress.
    TcpClose {
        /// The flow.
        flow: FlowId,
        /// Reset instead of an orderly close.
        reset: bool,
    },
    /// Open a connected kernel UDP socket to `dst`.
    UdpOpen {
        /// The flow.
        flow: FlowId,
        /// The real destination.
        dst: SocketAddr,
    },
    /// Send one datagram on the flow's socket.
    UdpSend {
        /// The flow.
        flow: FlowId,
        /// The datagram's payload.
        payload: Vec<u8>,
    },
    /// Close the flow's UDP socket.
    UdpClose {
        /// The flow.
        flow: FlowId,
    },
    /// Open an unprivileged ICMP echo socket connected to `dst`.
    PingOpen {
        /// The flow.
        flow: FlowId,
        /// The pinged address.
        dst: IpAddr,
    },
    /// Send one echo request on the flow's ping socket.
    PingSend {
        /// The flow.
        flow: FlowId,
        /// Sequence number.
        seq: u16,
        /// Payload.
        data: Vec<u8>,
    },
    /// Close the flow's ping socket.
    PingClose {
        /// The flow.
        flow: FlowId,
    },
}

/// What the kernel side reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The dial of a [`Request::TcpDial`] finished.
    TcpDialed {
        /// The flow.
        flow: FlowId,
        /// Success or why not.
        result: Result<(), DialError>,
    },
    /// Inbound bytes read from the kernel socket (never more than granted).
    TcpData {
        /// The flow.
        flow: FlowId,
        /// The bytes.
        data: Vec<u8>,
    },
    /// The destination closed its sending side (read returned 0).
    TcpEof {
        /// The flow.
        flow: FlowId,
    },
    /// The destination reset the connection, or reading/writing failed.
    TcpReset {
        /// The flow.
        flow: FlowId,
    },
    /// Bytes of earlier [`Request::TcpWrite`]s are written.
    TcpWritten {
        /// The flow.
        flow: FlowId,
        /// Bytes.
        bytes: usize,
    },
    /// A datagram arrived on a UDP flow's socket.
    UdpReply {
        /// The flow.
        flow: FlowId,
        /// Its payload.
        data: Vec<u8>,
    },
    /// The UDP destination answered "port unreachable" (ECONNREFUSED).
    UdpRefused {
        /// The flow.
        flow: FlowId,
    },
    /// The UDP destination is unreachable (EHOSTUNREACH / ENETUNREACH: ICMP
    /// host or net unreachable from the cluster, or no neighbour answered).
    UdpUnreachable {
        /// The flow.
        flow: FlowId,
    },
    /// The UDP or ping socket could not be opened or failed.
    SocketFailed {
        /// The flow.
        flow: FlowId,
    },
    /// A datagram or echo request could not be sent (socket buffer full).
    SendFailed {
        /// The flow.
        flow: FlowId,
    },
    /// An echo reply arrived on a ping flow's socket.
    PingReply {
        /// The flow.
        flow: FlowId,
        /// Sequence number of the reply.
        seq: u16,
        /// Its payload.
        data: Vec<u8>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct TcpKey {
    laptop_port: u16,
    dst: SocketAddr,
}

#[derive(Debug)]
struct TcpFlow {
    key: TcpKey,
    state: TcpState,
    /// Last segment from the laptop or event from the kernel side.
    last_active: Instant,
}

#[derive(Debug)]
enum TcpState {
    /// The SYN is held until the dial finishes.
    Dialing { syn: Vec<u8>, meta: TcpMeta },
    /// The smoltcp socket exists and the kernel socket is connected.
    Open(OpenTcp),
    /// The kernel side is closed; the smoltcp socket sits in TIME-WAIT (it
    /// still acknowledges a retransmitted FIN).
    Lingering { handle: SocketHandle },
}

#[derive(Debug)]
struct OpenTcp {
    handle: SocketHandle,
    /// The laptop's initial sequence number (of the SYN that opened the flow):
    /// a SYN with another one is a new connection on the same 4-tuple.
    syn_seq: u32,
    /// Inbound credit granted but not yet used.
    granted: usize,
    /// Outbound bytes requested to be written but not yet confirmed.
    write_inflight: usize,
    /// Inbound bytes that did not fit the smoltcp buffer (only if the grant
    /// invariant were broken; kept instead of dropped).
    overflow: Vec<u8>,
    remote_eof: bool,
    fin_queued: bool,
    laptop_fin_seen: bool,
    shutdown_sent: bool,
    kernel_closed: bool,
    reset_by_remote: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct UdpKey {
    laptop_port: u16,
    dst: SocketAddr,
}

#[derive(Debug)]
struct UdpFlow {
    key: UdpKey,
    last_active: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PingKey {
    dst: IpAddr,
    ident: u16,
}

#[derive(Debug)]
struct PingFlow {
    key: PingKey,
    last_active: Instant,
}

/// The per-session core. See the module documentation.
pub struct Engine {
    config: EngineConfig,
    epoch: Instant,
    iface: Interface,
    device: QueueDevice,
    sockets: SocketSet<'static>,
    next_flow: u64,
    tcp: HashMap<FlowId, TcpFlow>,
    tcp_by_key: HashMap<TcpKey, FlowId>,
    udp: HashMap<FlowId, UdpFlow>,
    udp_by_key: HashMap<UdpKey, FlowId>,
    ping: HashMap<FlowId, PingFlow>,
    ping_by_key: HashMap<PingKey, FlowId>,
    /// Flows the pod's kernel carries (source policies `preserve`,
    /// `ebpf-snat`), counted against the same cap and limits.
    forwarded: ForwardedFlows,
    requests: VecDeque<Request>,
    metrics: Metrics,
    frags: Reassembler,
    /// Identification of the next fragmented packet to the laptop.
    next_frag_ident: u32,
    /// When idle TCP flows are looked for next.
    next_tcp_sweep: Instant,
    /// When idle UDP and ping flows are looked for next (the earliest idle
    /// deadline of the last scan or of a flow opened since, not earlier than
    /// [`IDLE_SCAN_MIN`] after the last scan); `None` without such flows.
    /// Traffic only moves deadlines later, so this is never late.
    next_idle_scan: Option<Instant>,
    /// New flows (TCP dials, UDP and ping sockets) this laptop may open.
    new_flows: TokenBucket,
    /// TCP dials of this laptop that may still fail: each dial takes a
    /// token, a dial that succeeds gives it back.
    failed_flows: TokenBucket,
    /// ICMP errors the manager may send this laptop.
    icmp_errors: TokenBucket,
}

/// Whether a new flow may be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    Yes,
    /// Over the flow cap (refused with an answer).
    Cap,
    /// Over the new-flow rate (dropped silently; TCP retransmits its SYN).
    RateLimited,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("tunnel_ip", &self.config.tunnel_ip)
            .field("tunnel_ip_v6", &self.config.tunnel_ip_v6)
            .field("tcp_flows", &self.tcp.len())
            .field("udp_flows", &self.udp.len())
            .field("ping_flows", &self.ping.len())
            .finish_non_exhaustive()
    }
}

fn to_smol(epoch: Instant, now: Instant) -> smoltcp::time::Instant {
    let micros = now.saturating_duration_since(epoch).as_micros();
    smoltcp::time::Instant::from_micros(i64::try_from(micros).unwrap_or(i64::MAX))
}

fn from_smol(epoch: Instant, t: smoltcp::time::Instant) -> Instant {
    epoch + Duration::from_micros(u64::try_from(t.total_micros()).unwrap_or(0))
}

impl Engine {
    /// A new session core; `now` is the session's start.
    pub fn new(config: EngineConfig, now: Instant) -> Self {
        let mut device = QueueDevice::new(DEFAULT_MTU);
        let mut iface_config = Config::new(HardwareAddress::Ip);
        iface_config.random_seed = config.random_seed;
        let mut iface = Interface::new(iface_config, &mut device, to_smol(now, now));
        iface.update_ip_addrs(|addrs| {
            // Two addresses fit IFACE_MAX_ADDR_COUNT (default 2 with both protocols).
            for cidr in [
                IpCidr::new(IpAddress::Ipv4(MANAGER_STACK_V4), 16),
                IpCidr::new(IpAddress::Ipv6(MANAGER_STACK_V6), 64),
            ] {
                if addrs.push(cidr).is_err() {
                    debug!(%cidr, "smoltcp address table full");
                }
            }
        });
        // any-IP: accept every destination, and reach the laptop through the
        // default routes (smoltcp only transmits to routable addresses).
        iface.set_any_ip(true);
        if iface
            .routes_mut()
            .add_default_ipv4_route(MANAGER_STACK_V4)
            .is_err()
        {
            debug!("smoltcp route table full (ipv4 default)");
        }
        if iface
            .routes_mut()
            .add_default_ipv6_route(MANAGER_STACK_V6)
            .is_err()
        {
            debug!("smoltcp route table full (ipv6 default)");
        }
        Self {
            epoch: now,
            iface,
            device,
            sockets: SocketSet::new(Vec::new()),
            next_flow: 1,
            tcp: HashMap::new(),
            tcp_by_key: HashMap::new(),
            udp: HashMap::new(),
            udp_by_key: HashMap::new(),
            ping: HashMap::new(),
            ping_by_key: HashMap::new(),
            forwarded: ForwardedFlows::default(),
            requests: VecDeque::new(),
            metrics: Metrics::default(),
            frags: Reassembler::default(),
            next_frag_ident: 1,
            next_tcp_sweep: now + TCP_IDLE_SWEEP,
            next_idle_scan: None,
            new_flows: TokenBucket::new(config.new_flows_per_sec, config.new_flow_burst, now),
            failed_flows: TokenBucket::new(
                config.failed_flows_per_sec,
                config.failed_flow_burst,
                now,
            ),
            icmp_errors: TokenBucket::new(config.icmp_errors_per_sec, config.icmp_error_burst, now),
            config,
        }
    }

    /// The session's counters.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Mutable counters (the shell counts heartbeats).
    pub fn metrics_mut(&mut self) -> &mut Metrics {
        &mut self.metrics
    }

    /// The (primary) tunnel IP this session accepts as source.
    pub fn tunnel_ip(&self) -> IpAddr {
        self.config.tunnel_ip
    }

    /// Whether `ip` is one of this session's tunnel IPs (IPv4, and IPv6 for a
    /// dual-stack session).
    pub fn is_tunnel_ip(&self, ip: IpAddr) -> bool {
        self.config.is_tunnel_ip(ip)
    }

    /// Live flows: (TCP, UDP, ping). TCP includes dials and TIME-WAIT sockets.
    pub fn flow_counts(&self) -> (usize, usize, usize) {
        (self.tcp.len(), self.udp.len(), self.ping.len())
    }

    /// Live flows of all kinds (what the flow cap counts), forwarded ones
    /// included.
    pub fn flows(&self) -> usize {
        self.tcp.len() + self.udp.len() + self.ping.len() + self.forwarded.len()
    }

    /// Live flows the pod's kernel carries (`preserve`, `ebpf-snat`).
    pub fn forwarded_flows(&self) -> usize {
        self.forwarded.len()
    }

    /// The per-client flow cap.
    pub fn max_flows(&self) -> usize {
        self.config.max_flows
    }

    /// Admission of a new flow whose kind has `kind_len` of `kind_max` flows;
    /// a TCP `dial` also needs a failed-flow token (given back when it
    /// succeeds, [`limit::FAILED_FLOWS_PER_SEC`]).
    fn admit(&mut self, kind_len: usize, kind_max: usize, dial: bool, now: Instant) -> Admit {
        if self.flows() >= self.config.max_flows || kind_len >= kind_max {
            self.metrics.flows_refused_cap += 1;
            self.drop_packet(DropReason::TooManyFlows);
            return Admit::Cap;
        }
        // A laptop whose recent dials failed (a scan of closed ports) may dial
        // more only as fast as the failed-flow bucket refills.
        if (dial && !self.failed_flows.has_token(now)) || !self.new_flows.take(now) {
            self.metrics.flows_rate_limited += 1;
            return Admit::RateLimited;
        }
        if dial {
            self.failed_flows.take(now);
        }
        Admit::Yes
    }

    /// Answer a UDP datagram refused by the flow cap with ICMP "communication
    /// administratively prohibited" (RFC 1812 §5.2.7.1), rate-limited.
    fn refuse_udp(&mut self, src: SocketAddr, dst: SocketAddr, payload_len: usize, now: Instant) {
        let mut head = [0u8; 8];
        head[0..2].copy_from_slice(&src.port().to_be_bytes());
        head[2..4].copy_from_slice(&dst.port().to_be_bytes());
        let len = u16::try_from(8 + payload_len).unwrap_or(u16::MAX);
        head[4..6].copy_from_slice(&len.to_be_bytes());
        let offending = Offending {
            src: src.ip(),
            dst: dst.ip(),
            protocol: IpProtocol::Udp,
            payload_len: 8,
            payload_head: &head,
        };
        let err = packet::dst_unreachable(&offending, Unreachable::AdminProhibited);
        self.send_icmp_error(err, now);
    }

    /// A laptop packet the pod's kernel carries (source policies `preserve`
    /// and `ebpf-snat`, see [`crate::forwarded`]): whether it may go into the
    /// pool TUN. The first packet of a flow is admitted like a terminated
    /// flow's: within the flow cap (beyond it a SYN is answered with RST and
    /// a UDP datagram with ICMP "administratively prohibited", counted in
    /// [`Metrics::flows_refused_cap`]) and the new-flow rate limit (dropped,
    /// [`Metrics::flows_rate_limited`]). Packets the engine cannot classify
    /// (fragments, other protocols) pass: they open no flow of their own.
    pub fn admit_forwarded(&mut self, buf: &[u8], now: Instant) -> bool {
        let Ok(parsed) = packet::parse(buf) else {
            return true;
        };
        let (key, seg) = forwarded::classify(&parsed);
        if !self.forwarded.contains(&key) {
            if seg == Segment::TcpRst {
                // Ends nothing the table knows; the kernel answers or ignores it.
                return true;
            }
            match self.admit(self.forwarded.len(), self.config.max_flows, false, now) {
                Admit::Yes => {}
                Admit::Cap => {
                    match parsed {
                        Parsed::Tcp(meta) if seg == Segment::TcpSyn => {
                            let rst = packet::tcp_rst_for_syn(&meta);
                            self.send_icmp_error(rst, now);
                        }
                        Parsed::Udp { src, dst, payload } => {
                            self.refuse_udp(src, dst, payload.len(), now);
                        }
                        _ => {}
                    }
                    return false;
                }
                Admit::RateLimited => return false,
            }
            self.metrics.forwarded_flows += 1;
            let idle = match seg {
                Segment::Udp => self.config.udp_idle_timeout,
                Segment::Echo => self.config.ping_idle_timeout,
                _ => forwarded::TCP_SYN_TIMEOUT,
            };
            self.idle_deadline(now + idle);
        } else if seg == Segment::TcpFin {
            self.idle_deadline(now + forwarded::TCP_CLOSING_TIMEOUT);
        }
        self.forwarded.seen(key, seg, now);
        true
    }

    /// Send an ICMP error to the laptop unless the ICMP error bucket is empty.
    fn send_icmp_error(&mut self, packet: Result<Vec<u8>, packet::BuildError>, now: Instant) {
        if self.icmp_errors.take(now) {
            self.send_to_laptop(packet);
        } else {
            self.metrics.icmp_rate_limited += 1;
        }
    }

    fn next_id(&mut self) -> FlowId {
        let id = FlowId(self.next_flow);
        self.next_flow += 1;
        id
    }

    fn drop_packet(&mut self, reason: DropReason) {
        trace!(reason = reason.as_str(), "dropped packet");
        self.metrics.drop_packet(reason);
    }

    fn send_to_laptop(&mut self, packet: Result<Vec<u8>, packet::BuildError>) {
        match packet {
            Ok(p) if p.len() > self.config.laptop_mtu => {
                let ident = self.next_frag_ident;
                self.next_frag_ident = self.next_frag_ident.wrapping_add(1);
                self.metrics.packets_fragmented += 1;
                for f in frag::fragment(p, self.config.laptop_mtu, ident) {
                    self.device.push_tx(f);
                }
            }
            Ok(p) => self.device.push_tx(p),
            Err(e) => {
                trace!(error = %e, "reply not built");
                self.metrics.drop_packet(DropReason::ReplyTooLarge);
            }
        }
    }

    // ----- inputs ---------------------------------------------------------

    /// One raw IP packet from the laptop. Call [`Engine::poll`] after a batch.
    pub fn handle_laptop_packet(&mut self, buf: &[u8], now: Instant) {
        self.handle_laptop(LaptopPacket::Borrowed(buf), now);
    }

    /// One raw IP packet from the laptop in a buffer from
    /// [`Engine::rx_buffer`] (a GSO frame's segment written straight into
    /// it): smoltcp gets the buffer itself, no copy. Otherwise as
    /// [`Engine::handle_laptop_packet`].
    pub fn handle_laptop_packet_pooled(&mut self, buf: Vec<u8>, now: Instant) {
        self.handle_laptop(LaptopPacket::Owned(buf), now);
    }

    /// An empty buffer from the engine's receive pool, for
    /// [`Engine::handle_laptop_packet_pooled`]; give it back with
    /// [`Engine::recycle_rx`] when it is not handed over.
    pub fn rx_buffer(&mut self) -> Vec<u8> {
        self.device.take_rx_buffer()
    }

    /// Give back a buffer from [`Engine::rx_buffer`] that was not handed to
    /// [`Engine::handle_laptop_packet_pooled`].
    pub fn recycle_rx(&mut self, buf: Vec<u8>) {
        self.device.recycle_rx(buf);
    }

    fn handle_laptop(&mut self, packet: LaptopPacket<'_>, now: Instant) {
        let buf = packet.bytes();
        self.metrics.packets_from_laptop += 1;
        self.metrics.bytes_from_laptop += buf.len() as u64;
        // Checked before reassembly so nobody else's fragments are buffered.
        if frag::source(buf).is_some_and(|src| !self.config.is_tunnel_ip(src)) {
            return self.drop_packet(DropReason::BadSource);
        }
        if buf.len() > DEFAULT_MTU && frag::must_not_fragment(buf) {
            // Cannot fail: DEFAULT_MTU is a u16 constant.
            let mtu = u16::try_from(DEFAULT_MTU).unwrap_or(u16::MAX);
            trace!(bytes = buf.len(), mtu, "packet over the stack MTU: too big");
            if let Some(icmp) = packet::too_big(buf, mtu) {
                self.metrics.too_big_sent += 1;
                self.device.push_tx(icmp);
            }
            return;
        }
        let packet = match self.frags.push(buf, now) {
            Reassembly::Whole => packet,
            Reassembly::Pending => return,
            Reassembly::Complete(p) => {
                self.metrics.datagrams_reassembled += 1;
                LaptopPacket::Owned(p)
            }
            Reassembly::Dropped(why) => {
                trace!(?why, "fragment discarded");
                return self.drop_packet(DropReason::Fragment);
            }
        };
        let buf = packet.bytes();
        let parsed = match packet::parse(buf) {
            Ok(p) => p,
            Err(reason) => return self.drop_packet(reason),
        };
        let (src, dst) = parsed.addrs();
        if !self.config.is_tunnel_ip(src) {
            return self.drop_packet(DropReason::BadSource);
        }
        if !packet::destination_allowed(dst, self.config.allow_loopback) {
            return self.drop_packet(DropReason::ForbiddenDestination);
        }
        match parsed {
            Parsed::Tcp(meta) => self.laptop_tcp(meta, packet, now),
            Parsed::Udp { src, dst, payload } => self.laptop_udp(src, dst, payload, now),
            Parsed::EchoRequest {
                dst,
                ident,
                seq,
                data,
                ..
            } => self.laptop_echo(dst, ident, seq, data, now),
        }
    }

    fn laptop_tcp(&mut self, meta: TcpMeta, buf: LaptopPacket<'_>, now: Instant) {
        let key = TcpKey {
            laptop_port: meta.src.port(),
            dst: meta.dst,
        };
        if let Some(&id) = self.tcp_by_key.get(&key) {
            if let Some(flow) = self.tcp.get_mut(&id) {
                flow.last_active = now;
            }
            let replace = match self.tcp.get(&id).map(|f| &f.state) {
                Some(TcpState::Dialing { .. }) => {
                    if meta.rst {
                        // The laptop gave up on connect(): end the dial.
                        debug!(flow = %id, dst = %meta.dst, "laptop reset during dial");
                        self.requests.push_back(Request::TcpClose {
                            flow: id,
                            reset: true,
                        });
                        self.remove_tcp(id);
                    } else if !meta.is_initial_syn() {
                        self.drop_packet(DropReason::TcpWhileDialing);
                    } else if let Some(TcpFlow {
                        state: TcpState::Dialing { syn, meta: held },
                        ..
                    }) = self.tcp.get_mut(&id)
                        && held.seq != meta.seq
                    {
                        // A new connection on the 4-tuple (the laptop gave up
                        // on the first and its RST was lost): the dial answers
                        // this one.
                        *syn = buf.into_vec();
                        *held = meta;
                    }
                    // A retransmitted SYN is answered by the held one.
                    return;
                }
                Some(TcpState::Open(o)) if meta.is_initial_syn() => {
                    let st = self.sockets.get::<tcp::Socket>(o.handle).state();
                    if matches!(st, tcp::State::Closed | tcp::State::TimeWait) {
                        true
                    } else if meta.seq != o.syn_seq {
                        // A SYN with another initial sequence number: the laptop
                        // has no connection on this 4-tuple any more (its RST
                        // for the old one was lost, e.g. dropped from a full
                        // TUN queue in a burst of resets) and reuses the port.
                        // smoltcp drops a SYN without ACK in a synchronized
                        // state without an answer, so feeding it there would
                        // make the 4-tuple unusable until the idle timeout.
                        // The laptop is the only sender into its session, so
                        // the new connection wins, as a kernel's TIME-WAIT
                        // lets a new SYN take over.
                        debug!(flow = %id, dst = %meta.dst, laptop_port = meta.src.port(), state = %st, "SYN for a new connection on a live flow's 4-tuple: replacing the flow");
                        self.metrics.tcp_replaced_by_syn += 1;
                        true
                    } else {
                        // A retransmission of this flow's own SYN.
                        false
                    }
                }
                Some(TcpState::Open(_)) => false,
                Some(TcpState::Lingering { .. }) => meta.is_initial_syn(),
                None => true,
            };
            if !replace {
                return buf.push_rx(&mut self.device);
            }
            // A new connection reuses the 4-tuple of a finished one.
            if let Some(TcpFlow {
                state: TcpState::Open(o),
                ..
            }) = self.tcp.get(&id)
                && !o.kernel_closed
            {
                self.requests.push_back(Request::TcpClose {
                    flow: id,
                    reset: true,
                });
            }
            self.remove_tcp(id);
        }
        if !meta.is_initial_syn() {
            // No flow: smoltcp answers with RST (and ignores a stray RST).
            return buf.push_rx(&mut self.device);
        }
        match self.admit(self.tcp.len(), self.config.max_tcp_flows, true, now) {
            Admit::Yes => {}
            Admit::Cap => {
                debug!(dst = %meta.dst, flows = self.flows(), cap = self.config.max_flows, "flow cap reached, refusing SYN with RST");
                let rst = packet::tcp_rst_for_syn(&meta);
                // An answer per refused SYN, but no faster than ICMP errors.
                return self.send_icmp_error(rst, now);
            }
            Admit::RateLimited => {
                trace!(dst = %meta.dst, "new-flow rate exceeded, SYN dropped");
                return;
            }
        }
        let id = self.next_id();
        debug!(flow = %id, dst = %meta.dst, laptop_port = meta.src.port(), "SYN held, dialing");
        self.tcp.insert(
            id,
            TcpFlow {
                key,
                state: TcpState::Dialing {
                    syn: buf.into_vec(),
                    meta,
                },
                last_active: now,
            },
        );
        self.tcp_by_key.insert(key, id);
        self.metrics.tcp_dials += 1;
        self.requests.push_back(Request::TcpDial {
            flow: id,
            dst: meta.dst,
        });
    }

    fn laptop_udp(&mut self, src: SocketAddr, dst: SocketAddr, payload: &[u8], now: Instant) {
        let key = UdpKey {
            laptop_port: src.port(),
            dst,
        };
        let id = match self.udp_by_key.get(&key) {
            Some(&id) => id,
            None => {
                match self.admit(self.udp.len(), self.config.max_udp_flows, false, now) {
                    Admit::Yes => {}
                    Admit::Cap => return self.refuse_udp(src, dst, payload.len(), now),
                    Admit::RateLimited => return,
                }
                let id = self.next_id();
                debug!(flow = %id, %dst, laptop_port = src.port(), "UDP flow opened");
                self.udp.insert(
                    id,
                    UdpFlow {
                        key,
                        last_active: now,
                    },
                );
                self.udp_by_key.insert(key, id);
                self.idle_deadline(now + self.config.udp_idle_timeout);
                self.metrics.udp_flows += 1;
                self.requests.push_back(Request::UdpOpen { flow: id, dst });
                id
            }
        };
        if let Some(flow) = self.udp.get_mut(&id) {
            flow.last_active = now;
        }
        self.metrics.udp_datagrams_out += 1;
        self.requests.push_back(Request::UdpSend {
            flow: id,
            payload: payload.to_vec(),
        });
    }

    fn laptop_echo(&mut self, dst: IpAddr, ident: u16, seq: u16, data: &[u8], now: Instant) {
        let key = PingKey { dst, ident };
        let id = match self.ping_by_key.get(&key) {
            Some(&id) => id,
            None => {
                if self.admit(self.ping.len(), self.config.max_ping_flows, false, now) != Admit::Yes
                {
                    return;
                }
                let id = self.next_id();
                debug!(flow = %id, %dst, ident, "ping flow opened");
                self.ping.insert(
                    id,
                    PingFlow {
                        key,
                        last_active: now,
                    },
                );
                self.ping_by_key.insert(key, id);
                self.idle_deadline(now + self.config.ping_idle_timeout);
                self.requests.push_back(Request::PingOpen { flow: id, dst });
                id
            }
        };
        if let Some(flow) = self.ping.get_mut(&id) {
            flow.last_active = now;
        }
        self.metrics.pings_sent += 1;
        self.requests.push_back(Request::PingSend {
            flow: id,
            seq,
            data: data.to_vec(),
        });
    }

    /// A report from the kernel side. Events for flows that no longer exist
    /// are ignored. Call [`Engine::poll`] after a batch.
    pub fn handle_event(&mut self, event: Event, now: Instant) {
        if let Event::TcpData { flow, .. } | Event::TcpEof { flow } | Event::TcpWritten { flow, .. } =
            &event
            && let Some(f) = self.tcp.get_mut(flow)
        {
            f.last_active = now;
        }
        match event {
            Event::TcpDialed { flow, result } => self.tcp_dialed(flow, result),
            Event::TcpData { flow, data } => self.tcp_data(flow, &data),
            Event::TcpEof { flow } => {
                if let Some(o) = self.open_tcp(flow) {
                    debug!(%flow, "destination sent FIN");
                    o.remote_eof = true;
                }
            }
            Event::TcpReset { flow } => self.tcp_remote_reset(flow),
            Event::TcpWritten { flow, bytes } => {
                if let Some(o) = self.open_tcp(flow) {
                    o.write_inflight = o.write_inflight.saturating_sub(bytes);
                }
            }
            Event::UdpReply { flow, data } => {
                let Some(f) = self.udp.get_mut(&flow) else {
                    return;
                };
                f.last_active = now;
                let dst = f.key.dst;
                let laptop =
                    SocketAddr::new(self.config.laptop_ip_for(dst.ip()), f.key.laptop_port);
                self.metrics.udp_datagrams_in += 1;
                let reply = packet::udp_datagram(dst, laptop, &data);
                self.send_to_laptop(reply);
            }
            Event::UdpRefused { flow } => self.udp_icmp_error(flow, Unreachable::Port, now),
            Event::UdpUnreachable { flow } => self.udp_icmp_error(flow, Unreachable::Host, now),
            Event::SocketFailed { flow } => {
                if self.udp.contains_key(&flow) {
                    self.remove_udp(flow);
                    self.requests.push_back(Request::UdpClose { flow });
                } else if self.ping.contains_key(&flow) {
                    self.remove_ping(flow);
                    self.requests.push_back(Request::PingClose { flow });
                }
            }
            Event::SendFailed { .. } => self.drop_packet(DropReason::KernelSendFailed),
            Event::PingReply { flow, seq, data } => {
                let Some(f) = self.ping.get_mut(&flow) else {
                    return;
                };
                f.last_active = now;
                let (dst, ident) = (f.key.dst, f.key.ident);
                self.metrics.ping_replies += 1;
                let laptop = self.config.laptop_ip_for(dst);
                let reply = packet::echo_reply(dst, laptop, ident, seq, &data);
                self.send_to_laptop(reply);
            }
        }
    }

    /// The cluster answered a UDP flow with an ICMP error: the same error to
    /// the laptop, quoting a UDP header with the flow's ports.
    fn udp_icmp_error(&mut self, flow: FlowId, kind: Unreachable, now: Instant) {
        let Some(f) = self.udp.get(&flow) else { return };
        let (laptop_port, dst) = (f.key.laptop_port, f.key.dst);
        let mut head = [0u8; 8];
        head[0..2].copy_from_slice(&laptop_port.to_be_bytes());
        head[2..4].copy_from_slice(&dst.port().to_be_bytes());
        head[4..6].copy_from_slice(&8u16.to_be_bytes());
        let offending = Offending {
            src: self.config.laptop_ip_for(dst.ip()),
            dst: dst.ip(),
            protocol: IpProtocol::Udp,
            payload_len: 8,
            payload_head: &head,
        };
        self.metrics.udp_icmp_errors += 1;
        let err = packet::dst_unreachable(&offending, kind);
        self.send_icmp_error(err, now);
    }

    fn open_tcp(&mut self, flow: FlowId) -> Option<&mut OpenTcp> {
        match self.tcp.get_mut(&flow) {
            Some(TcpFlow {
                state: TcpState::Open(o),
                ..
            }) => Some(o),
            _ => None,
        }
    }

    fn tcp_dialed(&mut self, id: FlowId, result: Result<(), DialError>) {
        let (syn, meta) = match self.tcp.get_mut(&id) {
            Some(TcpFlow {
                state: TcpState::Dialing { syn, meta },
                ..
            }) => (std::mem::take(syn), *meta),
            _ => return,
        };
        match result {
            Ok(()) => {
                // The dial's failed-flow token was not needed.
                self.failed_flows.give_back();
                let mut socket = tcp::Socket::new(
                    tcp::SocketBuffer::new(vec![0u8; self.config.tcp_window]),
                    tcp::SocketBuffer::new(vec![0u8; TCP_TX_BUFFER]),
                );
                // The laptop's kernel does its own Nagle; delaying here only adds latency.
                socket.set_nagle_enabled(false);
                // No smoltcp timeout: despite its documentation it also fires on
                // idle connections (after `timeout` without any segment), which
                // would kill idle flows (tr-09). A laptop that vanishes ends its
                // session (heartbeats), which resets its flows.
                let endpoint = IpListenEndpoint {
                    addr: Some(IpAddress::from(meta.dst.ip())),
                    port: meta.dst.port(),
                };
                if let Err(e) = socket.listen(endpoint) {
                    debug!(flow = %id, dst = %meta.dst, error = ?e, "cannot listen on destination endpoint");
                    self.requests.push_back(Request::TcpClose {
                        flow: id,
                        reset: true,
                    });
                    self.remove_tcp(id);
                    self.metrics.tcp_refused += 1;
                    let rst = packet::tcp_rst_for_syn(&meta);
                    self.send_to_laptop(rst);
                    return;
                }
                let handle = self.sockets.add(socket);
                let Some(flow) = self.tcp.get_mut(&id) else {
                    return;
                };
                flow.state = TcpState::Open(OpenTcp {
                    handle,
                    syn_seq: meta.seq,
                    granted: 0,
                    write_inflight: 0,
                    overflow: Vec::new(),
                    remote_eof: false,
                    fin_queued: false,
                    laptop_fin_seen: false,
                    shutdown_sent: false,
                    kernel_closed: false,
                    reset_by_remote: false,
                });
                self.metrics.tcp_connected += 1;
                debug!(flow = %id, dst = %meta.dst, "dial connected, answering SYN");
                self.device.push_rx(syn);
            }
            Err(e) => {
                debug!(flow = %id, dst = %meta.dst, error = ?e, "dial failed");
                self.requests.push_back(Request::TcpClose {
                    flow: id,
                    reset: true,
                });
                self.remove_tcp(id);
                let answer = match e {
                    DialError::Refused | DialError::Other => {
                        self.metrics.tcp_refused += 1;
                        packet::tcp_rst_for_syn(&meta)
                    }
                    DialError::Unreachable | DialError::TimedOut => {
                        self.metrics.tcp_unreachable += 1;
                        match Offending::from_packet(&syn) {
                            Some(o) => packet::dst_unreachable(&o, Unreachable::Host),
                            None => return,
                        }
                    }
                };
                self.send_to_laptop(answer);
            }
        }
    }

    fn tcp_data(&mut self, id: FlowId, data: &[u8]) {
        let Some(TcpFlow {
            state: TcpState::Open(o),
            ..
        }) = self.tcp.get_mut(&id)
        else {
            return;
        };
        o.granted = o.granted.saturating_sub(data.len());
        self.metrics.tcp_bytes_in += data.len() as u64;
        let socket = self.sockets.get_mut::<tcp::Socket>(o.handle);
        if !socket.may_send() {
            // The laptop reset or finished the flow; nobody can receive this.
            trace!(flow = %id, bytes = data.len(), "inbound data after laptop close discarded");
            return;
        }
        if !o.overflow.is_empty() {
            o.overflow.extend_from_slice(data);
            return;
        }
        let n = socket.send_slice(data).unwrap_or(0);
        if n < data.len() {
            debug!(flow = %id, bytes = data.len() - n, "inbound data beyond the grant kept in overflow");
            o.overflow.extend_from_slice(&data[n..]);
        }
    }

    /// Reset an idle flow both ways (RST to the laptop, RST to the destination).
    fn tcp_expire(&mut self, id: FlowId) {
        let Some(TcpFlow {
            state: TcpState::Open(o),
            ..
        }) = self.tcp.get_mut(&id)
        else {
            return;
        };
        debug!(flow = %id, "TCP flow idle too long, resetting it");
        self.metrics.tcp_idle_expired += 1;
        // Handled like a destination reset from here on.
        o.reset_by_remote = true;
        self.sockets.get_mut::<tcp::Socket>(o.handle).abort();
        if !o.kernel_closed {
            o.kernel_closed = true;
            self.requests.push_back(Request::TcpClose {
                flow: id,
                reset: true,
            });
        }
    }

    fn tcp_remote_reset(&mut self, id: FlowId) {
        let Some(TcpFlow {
            state: TcpState::Open(o),
            ..
        }) = self.tcp.get_mut(&id)
        else {
            return;
        };
        if o.reset_by_remote {
            return;
        }
        debug!(flow = %id, "destination reset the connection");
        o.reset_by_remote = true;
        self.metrics.tcp_reset_by_remote += 1;
        self.sockets.get_mut::<tcp::Socket>(o.handle).abort();
        if !o.kernel_closed {
            o.kernel_closed = true;
            self.requests.push_back(Request::TcpClose {
                flow: id,
                reset: true,
            });
        }
    }

    /// Expire idle flows and incomplete fragmented datagrams, and run the
    /// stack's timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        for expired in self.frags.handle_timeout(now) {
            self.metrics.drop_packet(DropReason::Fragment);
            if let Some(icmp) = expired
                .first
                .as_deref()
                .and_then(packet::reassembly_time_exceeded)
            {
                self.device.push_tx(icmp);
            }
        }
        if now >= self.next_tcp_sweep {
            self.next_tcp_sweep = now + TCP_IDLE_SWEEP;
            let idle = self.config.tcp_idle_timeout;
            let expired: Vec<FlowId> = self
                .tcp
                .iter()
                .filter(|(_, f)| matches!(f.state, TcpState::Open(_)))
                .filter(|(_, f)| now.saturating_duration_since(f.last_active) >= idle)
                .map(|(id, _)| *id)
                .collect();
            for id in expired {
                self.tcp_expire(id);
            }
        }
        if self.next_idle_scan.is_some_and(|t| now >= t) {
            self.expire_idle(now);
        }
        self.poll(now);
    }

    /// A UDP, ping or forwarded flow's idle deadline: the next scan is no later.
    fn idle_deadline(&mut self, deadline: Instant) {
        self.next_idle_scan = Some(self.next_idle_scan.map_or(deadline, |t| t.min(deadline)));
    }

    /// Close the UDP and ping flows idle at `now`, forget idle forwarded
    /// flows; schedule the next scan.
    fn expire_idle(&mut self, now: Instant) {
        let udp_idle = self.config.udp_idle_timeout;
        let ping_idle = self.config.ping_idle_timeout;
        let (gone, mut next) = self.forwarded.expire(
            now,
            forwarded::Timeouts {
                tcp: self.config.tcp_idle_timeout,
                udp: udp_idle,
                echo: ping_idle,
            },
        );
        if gone > 0 {
            debug!(flows = gone, "forwarded flows idle, forgotten");
        }
        let mut expired: Vec<FlowId> = Vec::new();
        for (id, f) in &self.udp {
            let deadline = f.last_active + udp_idle;
            if now >= deadline {
                expired.push(*id);
            } else {
                next = Some(next.map_or(deadline, |t| t.min(deadline)));
            }
        }
        for id in expired.drain(..) {
            debug!(flow = %id, "UDP flow idle, closing");
            self.remove_udp(id);
            self.metrics.udp_expired += 1;
            self.requests.push_back(Request::UdpClose { flow: id });
        }
        for (id, f) in &self.ping {
            let deadline = f.last_active + ping_idle;
            if now >= deadline {
                expired.push(*id);
            } else {
                next = Some(next.map_or(deadline, |t| t.min(deadline)));
            }
        }
        for id in expired {
            debug!(flow = %id, "ping flow idle, closing");
            self.remove_ping(id);
            self.requests.push_back(Request::PingClose { flow: id });
        }
        self.next_idle_scan = next.map(|t| t.max(now + IDLE_SCAN_MIN));
    }

    // ----- outputs --------------------------------------------------------

    /// Run smoltcp on the queued laptop packets and move data between the
    /// smoltcp sockets and the kernel side (requests).
    pub fn poll(&mut self, now: Instant) {
        let ts = to_smol(self.epoch, now);
        for _ in 0..MAX_POLL_ROUNDS {
            self.iface.poll(ts, &mut self.device, &mut self.sockets);
            if !self.service_tcp() {
                break;
            }
        }
    }

    /// The next packet for the laptop.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        let p = self.device.pop_tx()?;
        self.metrics.packets_to_laptop += 1;
        self.metrics.bytes_to_laptop += p.len() as u64;
        Some(p)
    }

    /// Give back the buffer of a packet [`Engine::poll_transmit`] returned, once it
    /// is framed: the engine reuses it, so a steady flow allocates no packet buffers.
    pub fn recycle(&mut self, packet: Vec<u8>) {
        self.device.recycle(packet);
    }

    /// Packet buffers the engine's device allocated so far (a steady flow reuses
    /// them; see [`kvpn_proto::device`]).
    pub fn packet_buffers_allocated(&self) -> u64 {
        self.device.buffers_allocated()
    }

    /// The next request for the kernel side.
    pub fn poll_request(&mut self) -> Option<Request> {
        self.requests.pop_front()
    }

    /// When [`Engine::handle_timeout`] must run next (smoltcp retransmissions,
    /// delayed ACKs, TIME-WAIT, idle flows, fragment reassembly), if ever.
    pub fn poll_timeout(&mut self, now: Instant) -> Option<Instant> {
        let stack = self
            .iface
            .poll_at(to_smol(self.epoch, now), &self.sockets)
            .map(|t| from_smol(self.epoch, t));
        // O(1) in the flows: this runs every engine round.
        let idle = self.next_idle_scan;
        let tcp_sweep = (!self.tcp.is_empty()).then_some(self.next_tcp_sweep);
        let frags = self.frags.poll_timeout();
        [stack, idle, tcp_sweep, frags].into_iter().flatten().min()
    }

    // ----- TCP service ----------------------------------------------------

    /// Move data and close/reset signals between smoltcp sockets and the
    /// kernel side. Returns whether smoltcp needs another poll.
    fn service_tcp(&mut self) -> bool {
        let mut again = false;
        let mut finished: Vec<FlowId> = Vec::new();
        let Self {
            tcp,
            sockets,
            requests,
            metrics,
            ..
        } = self;
        for (&id, flow) in tcp.iter_mut() {
            let o = match &mut flow.state {
                TcpState::Dialing { .. } => continue,
                TcpState::Lingering { handle } => {
                    if sockets.get::<tcp::Socket>(*handle).state() == tcp::State::Closed {
                        finished.push(id);
                    }
                    continue;
                }
                TcpState::Open(o) => o,
            };
            let socket = sockets.get_mut::<tcp::Socket>(o.handle);
            let state = socket.state();
            if matches!(
                state,
                tcp::State::CloseWait
                    | tcp::State::LastAck
                    | tcp::State::Closing
                    | tcp::State::TimeWait
            ) {
                o.laptop_fin_seen = true;
            }

            // Resets: by the destination (already aborted), or by the laptop
            // (an RST in SYN-RECEIVED sends a listening socket back to LISTEN;
            // elsewhere it goes to CLOSED without both FINs), or the stall timeout.
            let graceful_closed = o.fin_queued && o.laptop_fin_seen;
            let laptop_reset = !o.reset_by_remote
                && (state == tcp::State::Listen
                    || (state == tcp::State::Closed && !graceful_closed));
            if laptop_reset || (o.reset_by_remote && state == tcp::State::Closed) {
                if laptop_reset {
                    debug!(flow = %id, ?state, "laptop reset the connection");
                    metrics.tcp_reset_by_laptop += 1;
                    if state == tcp::State::Listen {
                        socket.abort();
                    }
                }
                if !o.kernel_closed {
                    o.kernel_closed = true;
                    requests.push_back(Request::TcpClose {
                        flow: id,
                        reset: true,
                    });
                }
                // Keep the socket until smoltcp has sent its RST (if any).
                if socket.remote_endpoint().is_none() {
                    finished.push(id);
                } else {
                    again = true;
                }
                continue;
            }

            // Outbound: laptop -> destination, bounded by the write window.
            while o.write_inflight < TCP_WRITE_WINDOW && socket.can_recv() {
                let room = (TCP_WRITE_WINDOW - o.write_inflight).min(TCP_WRITE_CHUNK);
                let data = socket
                    .recv(|buf| {
                        let n = buf.len().min(room);
                        (n, buf[..n].to_vec())
                    })
                    .unwrap_or_default();
                if data.is_empty() {
                    break;
                }
                o.write_inflight += data.len();
                metrics.tcp_bytes_out += data.len() as u64;
                requests.push_back(Request::TcpWrite { flow: id, data });
                again = true; // the receive window opened
            }
            if o.laptop_fin_seen && !o.shutdown_sent && !socket.can_recv() {
                debug!(flow = %id, "laptop sent FIN, shutting down the destination's write side");
                o.shutdown_sent = true;
                requests.push_back(Request::TcpShutdownWrite { flow: id });
            }

            // Inbound: destination -> laptop.
            if !o.overflow.is_empty() && socket.may_send() {
                let n = socket.send_slice(&o.overflow).unwrap_or(0);
                o.overflow.drain(..n);
                again |= n > 0;
            }
            if socket.may_send() && !o.remote_eof {
                let free = socket
                    .send_capacity()
                    .saturating_sub(socket.send_queue())
                    .saturating_sub(o.overflow.len());
                let grant = free.saturating_sub(o.granted);
                if grant >= TCP_GRANT_MIN || (grant > 0 && o.granted == 0) {
                    o.granted += grant;
                    requests.push_back(Request::TcpGrant {
                        flow: id,
                        bytes: grant,
                    });
                }
            }
            // In CLOSE-WAIT, hold the FIN until the laptop acknowledged all data:
            // smoltcp 0.14 treats a pure window update in LAST-ACK as a
            // duplicate ACK and ignores its window, so a slowly reading laptop
            // would only be served by 1 s zero-window probes. In ESTABLISHED,
            // close() leads to FIN-WAIT-1, which handles window updates.
            let fin_may_go = state != tcp::State::CloseWait || socket.send_queue() == 0;
            if o.remote_eof && !o.fin_queued && o.overflow.is_empty() && fin_may_go {
                o.fin_queued = true;
                socket.close();
                again = true;
            }

            // Orderly end: both FINs exchanged and the laptop's data handed over.
            let done = o.shutdown_sent
                && o.fin_queued
                && matches!(state, tcp::State::TimeWait | tcp::State::Closed);
            if done {
                debug!(flow = %id, "flow closed");
                metrics.tcp_closed += 1;
                if !o.kernel_closed {
                    o.kernel_closed = true;
                    requests.push_back(Request::TcpClose {
                        flow: id,
                        reset: false,
                    });
                }
                let handle = o.handle;
                if state == tcp::State::Closed {
                    finished.push(id);
                } else {
                    flow.state = TcpState::Lingering { handle };
                }
            }
        }
        for id in finished {
            self.remove_tcp(id);
        }
        again
    }

    fn remove_tcp(&mut self, id: FlowId) {
        let Some(flow) = self.tcp.remove(&id) else {
            return;
        };
        if self.tcp_by_key.get(&flow.key) == Some(&id) {
            self.tcp_by_key.remove(&flow.key);
        }
        match flow.state {
            TcpState::Open(OpenTcp { handle, .. }) | TcpState::Lingering { handle } => {
                self.sockets.remove(handle);
            }
            TcpState::Dialing { .. } => {}
        }
    }

    fn remove_udp(&mut self, id: FlowId) {
        if let Some(flow) = self.udp.remove(&id)
            && self.udp_by_key.get(&flow.key) == Some(&id)
        {
            self.udp_by_key.remove(&flow.key);
        }
    }

    fn remove_ping(&mut self, id: FlowId) {
        if let Some(flow) = self.ping.remove(&id)
            && self.ping_by_key.get(&flow.key) == Some(&id)
        {
            self.ping_by_key.remove(&flow.key);
        }
    }

    /// Packets queued for smoltcp but not yet polled (tests).
    pub fn pending_laptop_packets(&self) -> usize {
        self.device.rx_len()
    }
}

/// A laptop packet for [`Engine::handle_laptop_packet`] (borrowed: copied
/// into a pooled buffer if smoltcp takes it) or
/// [`Engine::handle_laptop_packet_pooled`] and reassembly (owned: handed over
/// as it is).
enum LaptopPacket<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl LaptopPacket<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            LaptopPacket::Borrowed(b) => b,
            LaptopPacket::Owned(v) => v,
        }
    }

    fn into_vec(self) -> Vec<u8> {
        match self {
            LaptopPacket::Borrowed(b) => b.to_vec(),
            LaptopPacket::Owned(v) => v,
        }
    }

    /// Queue the packet for smoltcp: a copy of a borrowed one, an owned one as it is.
    fn push_rx(self, device: &mut QueueDevice) {
        match self {
            LaptopPacket::Borrowed(b) => device.push_rx_copy(b),
            LaptopPacket::Owned(v) => device.push_rx(v),
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
