//! One client session: dial the traffic manager, set up the TUN device, tunnel
//! IP, routes, rp_filter and eBPF classifier, run the pump under a supervisor that
//! re-dials a lost transport, and tear everything down again.
//!
//! I/O: TCP (plain, or TLS via [`crate::tls`]) to the manager, `/dev/net/tun`, rtnetlink ([`crate::netlink`]) and
//! the classifier ([`ClassifierAttach`]); state decisions live in
//! [`crate::liveness`] and [`crate::routes`].
//!
//! Setup order: dial, TLS handshake (when asked), hello, TUN device (down), tunnel IP, rp_filter, eBPF
//! classifier, link up, routes, pump; then the daemon configures DNS
//! ([`Step::ConfigureDns`]).
//!
//! Setup is all-or-nothing (case lc-03): when a step fails, the steps before it
//! are undone (routes, TUN device) and the error names the failed step.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use kvpn_proto::frame::{self, Hello, Kind, PROTOCOL_VERSION};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument as _;
use tun_rs::AsyncDevice;

use crate::conflicts::{self, LaptopRoute};
use crate::ebpf::{self, RouteKind, Stats};
use crate::liveness::{Liveness, State};
use crate::netlink::{Netlink, RP_FILTER_LOOSE, RTPROT_KVPN};
use crate::pump::{self, Counters, PumpConfig, Refusal};
use crate::redial::{self, Redial};
use crate::route_guard::{self, RouteGuard};
use crate::routes::{self, RoutePlan};
use crate::stale_tcp;
use crate::steer_watch::{self, SteerWatch};
use crate::tls::TlsClient;
use crate::tun;
use crate::watched::{ClassifierSlot, WatchHandle, Watched};

/// How long dialling the manager may take before Connect gives up.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// First and longest pause between re-dials after the transport is lost. Short,
/// so that traffic recovers within 3 s of a transport restart (case tr-08), and
/// within about [`DIAL_TIMEOUT`] + 2 s of a black hole healing (tr-10: a re-dial
/// into the hole waits out the TLS handshake timeout, then at most 2 s).
const REDIAL_BACKOFF: (Duration, Duration) = (Duration::from_millis(250), Duration::from_secs(2));

/// Attaches the eBPF classifier to a TUN device. Production uses
/// [`EbpfClassifiers`]; the trait exists so that TUN, route and pump tests can run
/// without eBPF (they pass a test double), never to skip eBPF in the daemon.
pub trait ClassifierAttach: Send + Sync + 'static {
    /// Attach to `ifname` and insert `entries`.
    fn attach(
        &self,
        ifname: &str,
        entries: &[(IpNet, RouteKind)],
    ) -> Result<Box<dyn AttachedClassifier>, BoxError>;
}

/// An attached classifier; dropping it detaches it.
pub trait AttachedClassifier: Send {
    /// Its counters.
    fn stats(&self) -> Result<Stats, BoxError>;
    /// Add (or replace) the entry `cidr -> kind` (watched routes, UpdateRoutes).
    fn insert_route(&mut self, cidr: IpNet, kind: RouteKind) -> Result<(), BoxError> {
        let _ = kind;
        Err(format!("this classifier cannot add {cidr}").into())
    }
    /// Remove the entry for exactly `cidr`.
    fn remove_route(&mut self, cidr: IpNet) -> Result<(), BoxError> {
        Err(format!("this classifier cannot remove {cidr}").into())
    }
    /// Counters of each entry (`kvpn top`); none for classifiers without them.
    fn route_stats(&self) -> Result<Vec<(IpNet, RouteKind, ebpf::Counter)>, BoxError> {
        Ok(Vec::new())
    }
    /// Steer the cluster-bound IPv4 packets leaving laptop device `ifname` into the
    /// TUN device `tun_ifindex` (`--steer ebpf`, [`ebpf::Classifier::steer`]).
    fn steer(
        &mut self,
        ifname: &str,
        ifindex: u32,
        l2_hdr_len: u32,
        tunnel_ip: std::net::Ipv4Addr,
        tun_ifindex: u32,
    ) -> Result<(), BoxError> {
        let _ = (ifindex, l2_hdr_len, tunnel_ip, tun_ifindex);
        Err(format!("this classifier cannot steer {ifname}").into())
    }
    /// Stop steering laptop interface `ifindex` ([`ebpf::Classifier::unsteer`]).
    fn unsteer(&mut self, ifindex: u32) -> Result<(), BoxError> {
        Err(format!("this classifier cannot unsteer #{ifindex}").into())
    }
    /// Mark the packets the ingress check passes with `mark`
    /// ([`ebpf::Classifier::set_ingress_mark`]; a `kvpn run` session).
    fn set_ingress_mark(&mut self, mark: u32) -> Result<(), BoxError> {
        Err(format!("this classifier cannot mark its ingress with {mark:#x}").into())
    }
    /// The laptop devices steered, as (name, ifindex).
    fn steered_devices(&self) -> Vec<(String, u32)> {
        Vec::new()
    }
}

/// A boxed error from a classifier.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The real eBPF TC classifier ([`ebpf::Classifier`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct EbpfClassifiers;

impl ClassifierAttach for EbpfClassifiers {
    fn attach(
        &self,
        ifname: &str,
        entries: &[(IpNet, RouteKind)],
    ) -> Result<Box<dyn AttachedClassifier>, BoxError> {
        let mut classifier = ebpf::Classifier::attach(ifname)?;
        for (cidr, kind) in entries {
            classifier.insert_route(*cidr, *kind)?;
        }
        Ok(Box::new(classifier))
    }
}

impl AttachedClassifier for ebpf::Classifier {
    fn stats(&self) -> Result<Stats, BoxError> {
        Ok(ebpf::Classifier::stats(self)?)
    }
    fn insert_route(&mut self, cidr: IpNet, kind: RouteKind) -> Result<(), BoxError> {
        Ok(ebpf::Classifier::insert_route(self, cidr, kind)?)
    }
    fn remove_route(&mut self, cidr: IpNet) -> Result<(), BoxError> {
        Ok(ebpf::Classifier::remove_route(self, cidr)?)
    }
    fn route_stats(&self) -> Result<Vec<(IpNet, RouteKind, ebpf::Counter)>, BoxError> {
        Ok(ebpf::Classifier::route_stats(self)?)
    }
    fn steer(
        &mut self,
        ifname: &str,
        ifindex: u32,
        l2_hdr_len: u32,
        tunnel_ip: std::net::Ipv4Addr,
        tun_ifindex: u32,
    ) -> Result<(), BoxError> {
        Ok(ebpf::Classifier::steer(
            self,
            ifname,
            ifindex,
            l2_hdr_len,
            tunnel_ip,
            tun_ifindex,
        )?)
    }
    fn unsteer(&mut self, ifindex: u32) -> Result<(), BoxError> {
        Ok(ebpf::Classifier::unsteer(self, ifindex)?)
    }
    fn set_ingress_mark(&mut self, mark: u32) -> Result<(), BoxError> {
        Ok(ebpf::Classifier::set_ingress_mark(self, mark)?)
    }
    fn steered_devices(&self) -> Vec<(String, u32)> {
        ebpf::Classifier::steered_devices(self)
    }
}

/// What a session needs.
#[derive(Debug, Clone)]
pub struct SessionParams {
    /// Manager data address, `host:port`.
    pub manager: String,
    /// Cluster routes as requested (normalised by [`routes::plan`]).
    pub routes: Vec<(IpNet, RouteKind)>,
    /// The client's tunnel IP.
    pub tunnel_ip: IpAddr,
    /// The client's IPv6 tunnel IP (dual stack); `None` = IPv4 only.
    pub tunnel_ip_v6: Option<Ipv6Addr>,
    /// TUN device name; `None` = first free `kvpnN`.
    pub tun_name: Option<String>,
    /// TUN MTU, bytes.
    pub mtu: u16,
    /// Heartbeat interval ([`crate::liveness::HEARTBEAT_INTERVAL`] in the daemon;
    /// shorter in tests).
    pub heartbeat_interval: Duration,
    /// TLS on the data channel (the CA and name from the Connect request);
    /// `None` = plain TCP.
    pub tls: Option<TlsClient>,
    /// Session token of the tunnel IP's lease, sent in the hello (empty for
    /// managers without leases).
    pub session_token: Vec<u8>,
    /// Connect despite route conflicts with the laptop (case rt-05,
    /// [`crate::conflicts`]); `false` = refuse them.
    pub allow_route_conflict: bool,
    /// With `allow_route_conflict`: steer with eBPF on the devices of conflicting
    /// IPv4 routes outside the main and local tables (`--steer ebpf`).
    pub steer_ebpf: bool,
    /// Pump workers asked for (1..=[`frame::MAX_WORKERS`]): TUN queues, each
    /// with its own data connection. 1 = a single-queue TUN and a hello
    /// without option 3, exactly as before workers existed.
    pub workers: u16,
    /// Who listens on `manager`: the manager itself, or the user daemon's
    /// port-forward listener. Only the wording of errors and Status reasons
    /// depends on it.
    pub data_peer: DataPeer,
    /// A `kvpn run` session ([`crate::run_scope`]): its routes go into this
    /// routing table instead of main, and neither route conflicts nor stale TCP
    /// sockets of other sessions concern it (another run session may route the
    /// very same CIDRs from the very same tunnel IP). `None` = laptop-wide.
    pub run_table: Option<u32>,
    /// A `kvpn run` session's fwmark: the ingress check marks the replies with it
    /// and the TUN device gets `src_valid_mark`, so a strict reverse-path check
    /// (`net.ipv4.conf.all.rp_filter=1`) finds their source in the run's table.
    pub run_mark: Option<u32>,
}

impl SessionParams {
    /// The tunnel IPs on the TUN device: IPv4, then IPv6 for dual stack.
    pub fn tunnel_ips(&self) -> Vec<IpAddr> {
        let mut ips = vec![self.tunnel_ip];
        ips.extend(self.tunnel_ip_v6.map(IpAddr::V6));
        ips
    }
}

/// Who the root daemon dials for a session's data connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataPeer {
    /// The traffic manager (`kvpn connect --manager HOST:PORT`).
    #[default]
    Manager,
    /// The user daemon's loopback listener of a port-forward session, which
    /// carries the connection through the API server to the manager pod.
    UserDaemon,
}

impl DataPeer {
    /// The peer of a Connect request's origin transport (`"port-forward"` is
    /// the user daemon's listener; anything else the manager).
    pub fn from_transport(transport: &str) -> Self {
        if transport == TRANSPORT_PORT_FORWARD {
            DataPeer::UserDaemon
        } else {
            DataPeer::Manager
        }
    }

    /// Why the data connection ended, for logs and Status: the pump's reason,
    /// worded for the party that actually held the other end.
    pub fn loss_reason(self, target: &str, exit: &pump::PumpExit) -> String {
        match (self, exit) {
            (DataPeer::UserDaemon, pump::PumpExit::TransportClosed) => format!(
                "the user daemon's listener at {target} closed the data connection \
                 (the user daemon or its port-forward or SSH path to the manager pod ended)"
            ),
            (DataPeer::UserDaemon, pump::PumpExit::Transport(e)) => format!(
                "data connection to the user daemon's listener at {target} (its port-forward or SSH \
                 path to the manager pod) failed: {e}"
            ),
            _ => exit.to_string(),
        }
    }
}

/// `Origin.transport` of sessions whose data connection goes through the user
/// daemon's port-forward listener (proto/dataplane.proto).
pub const TRANSPORT_PORT_FORWARD: &str = "port-forward";

/// A setup step of Connect, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Comparing the cluster ranges with the laptop's routes (case rt-05).
    CheckRouteConflicts,
    /// TCP to the manager.
    DialManager,
    /// The TLS handshake and the manager's certificate check.
    TlsHandshake,
    /// The hello frame.
    SendHello,
    /// `/dev/net/tun`.
    CreateTun,
    /// The tunnel IP on the TUN device.
    AddAddress,
    /// Kernel routes.
    AddRoutes,
    /// rp_filter on the TUN device.
    SetRpFilter,
    /// The eBPF classifier.
    AttachClassifier,
    /// Bringing the TUN device up.
    LinkUp,
    /// Split DNS for the cluster (resolv.conf and the forwarder, or
    /// systemd-resolved); run by the daemon after the session is up.
    ConfigureDns,
    /// A `kvpn run` session's cgroup, eBPF programs, policy rule and DNS
    /// forwarder ([`crate::run_scope`]); run by the daemon after the session is up.
    RunScope,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::CheckRouteConflicts => "check route conflicts",
            Step::DialManager => "dial the traffic manager",
            Step::TlsHandshake => "TLS handshake with the traffic manager",
            Step::SendHello => "send hello to the traffic manager",
            Step::CreateTun => "create TUN device",
            Step::AddAddress => "add the tunnel IP to the TUN device",
            Step::AddRoutes => "install routes",
            Step::SetRpFilter => "set rp_filter on the TUN device",
            Step::AttachClassifier => "attach the eBPF classifier",
            Step::LinkUp => "bring the TUN device up",
            Step::ConfigureDns => "configure DNS",
            Step::RunScope => "set up the run's cgroup, eBPF programs, rule and DNS forwarder",
        })
    }
}

/// Why Connect failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The manager cannot be reached; the message names the address, the cause
    /// and the fix. Nothing was set up.
    #[error("{0}")]
    Unreachable(String),
    /// A setup step failed; the earlier steps were rolled back.
    #[error("connect failed at step \"{step}\": {message}{rollback}")]
    Step {
        /// The step.
        step: Step,
        /// What went wrong.
        message: String,
        /// Empty when the rollback was complete, else what was left behind.
        rollback: String,
    },
}

impl ConnectError {
    /// The failed step.
    pub fn step(&self) -> Step {
        match self {
            ConnectError::Unreachable(_) => Step::DialManager,
            ConnectError::Step { step, .. } => *step,
        }
    }
}

/// What teardown removed and what it could not.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TeardownReport {
    /// Routes deleted explicitly.
    pub routes_removed: usize,
    /// Things still present afterwards (empty = clean).
    pub leftovers: Vec<String>,
    /// The laptop's TCP sockets through the session destroyed before it went
    /// ([`stale_tcp`]): their applications got ECONNABORTED.
    pub tcp_reset: u64,
}

/// How long a stopping worker waits for its pump to tell the manager it is
/// leaving ([`frame::ResumeAnswer::Leaving`]) before the connection is dropped.
const LEAVING_WAIT: Duration = Duration::from_millis(500);

/// How long Connect waits for the manager's answer to hello option 3 before it
/// falls back to one worker. Every manager that accepts the hello answers at
/// once (its first Stats frame), so this only bounds a broken path.
pub const SHARD_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// One pump worker's state, shared by its supervisor, its pump and Status.
#[derive(Debug)]
struct Worker {
    /// Heartbeats and connected / reconnecting of this worker's connection.
    liveness: Arc<Mutex<Liveness>>,
    /// This worker's pump counters (Status sums the workers').
    counters: Arc<Counters>,
    /// Flows it carried and reads held across its re-dials.
    redial: Arc<Redial>,
}

/// State the pumps and Status share.
#[derive(Debug)]
struct Shared {
    /// One per TUN queue; worker `i` reads and writes queue `i`.
    workers: Vec<Worker>,
    /// Rate limit of the ICMP unreachable answers while reconnecting (shared by
    /// all workers: it bounds what the session writes to the TUN device).
    refusal: Arc<Refusal>,
}

impl Shared {
    /// Each worker's (state, reason) now.
    fn states(&self, now: Instant) -> Vec<(State, Option<String>)> {
        self.workers
            .iter()
            .map(|w| {
                w.liveness
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .state(now)
            })
            .collect()
    }
}

/// The session's state from its workers' (one worker: its state as is). With
/// several, the worst wins: failed while any worker is (its TUN queue is
/// gone, nothing brings it back), else reconnecting while any worker is (its
/// flows get ICMP unreachable), else connecting while any is, else connected;
/// the reason names the worker.
fn combine_states(states: Vec<(State, Option<String>)>) -> (State, Option<String>) {
    let n = states.len();
    if n <= 1 {
        return states
            .into_iter()
            .next()
            .unwrap_or((State::Connecting, None));
    }
    for want in [State::Failed, State::Reconnecting, State::Connecting] {
        if let Some((i, (state, reason))) = states
            .iter()
            .enumerate()
            .find(|(_, (state, _))| *state == want)
        {
            let reason = reason.as_deref().unwrap_or(state.as_str());
            return (*state, Some(format!("worker {i} of {n}: {reason}")));
        }
    }
    (State::Connected, None)
}

/// A running session.
pub struct Session {
    id: String,
    params: SessionParams,
    plan: RoutePlan,
    tun_name: String,
    ifindex: u32,
    started: Instant,
    shared: Arc<Shared>,
    classifier: ClassifierSlot,
    /// Watched routes and cluster information (UpdateRoutes).
    watched: Arc<Mutex<Watched>>,
    watched_update: Arc<tokio::sync::Mutex<()>>,
    stop_tx: watch::Sender<bool>,
    /// One supervisor per worker.
    supervisors: Vec<JoinHandle<()>>,
    tun: Option<Arc<AsyncDevice>>,
    /// Which cluster this session leads to, as the client said (reported only).
    origin: Option<kvpn_proto::dataplane::Origin>,
    /// `--steer ebpf`: keeps steering on the devices of conflicting routes.
    steer_watch: Option<SteerWatch>,
    /// TCP sockets of an earlier session that Connect destroyed ([`stale_tcp`]).
    stale_tcp_flows_reset: u64,
    /// Re-adds the session's routes deleted from outside kvpn; stopped first
    /// in teardown.
    route_guard: RouteGuard,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("tun_name", &self.tun_name)
            .field("ifindex", &self.ifindex)
            .finish_non_exhaustive()
    }
}

fn dial_error(target: &str, cause: &std::io::Error, peer: DataPeer) -> String {
    let fix = if peer == DataPeer::UserDaemon {
        // Nothing answers on the user daemon's loopback port: the user daemon is
        // gone (killed, crashed) or has not restored the session yet.
        "the user daemon (`kvpn daemon`) that carries this session to the cluster is not \
         running or has not restored it yet; `kvpn status` restarts it and restores the session"
    } else {
        match cause.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "is kvpn-manager running and the address right?"
            }
            std::io::ErrorKind::TimedOut => "is the address right and the path to the cluster up?",
            _ => match cause.raw_os_error() {
                Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => {
                    "check the address and that the laptop has a route to it"
                }
                _ => "check the address and that kvpn-manager is running",
            },
        }
    };
    let cause = match cause.raw_os_error() {
        Some(libc::ECONNREFUSED) => "connection refused".to_owned(),
        Some(libc::EHOSTUNREACH) => "no route to host".to_owned(),
        Some(libc::ENETUNREACH) => "network unreachable".to_owned(),
        _ => cause.to_string(),
    };
    match peer {
        DataPeer::Manager => {
            format!("cannot reach the traffic manager at {target}: {cause} — {fix}")
        }
        DataPeer::UserDaemon => format!(
            "cannot reach the user daemon's listener at {target} (its port-forward or SSH path to \
             the manager pod): {cause} — {fix}"
        ),
    }
}

/// Connect TCP to the manager at `target` (`host:port`) within `timeout`.
/// Errors are user-facing sentences naming the address, the cause and the fix.
pub async fn dial_manager(target: &str, timeout: Duration) -> Result<TcpStream, String> {
    dial_peer(target, DataPeer::Manager, timeout).await
}

/// [`dial_manager`] for a session's data peer: errors name `peer`.
pub async fn dial_peer(
    target: &str,
    peer: DataPeer,
    timeout: Duration,
) -> Result<TcpStream, String> {
    let attempt = async {
        let addrs: Vec<_> = tokio::net::lookup_host(target).await.map_err(|e| {
            format!("cannot resolve the traffic manager address {target}: {e} — give it as HOST:PORT, e.g. 172.31.255.1:10801")
        })?.collect();
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(stream) => return Ok(stream),
                Err(e) => last = Some(dial_error(&addr.to_string(), &e, peer)),
            }
        }
        Err(last.unwrap_or_else(|| {
            format!(
                "the traffic manager address {target} resolved to no address — give it as HOST:PORT"
            )
        }))
    };
    let stream = match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result?,
        Err(_) => {
            return Err(format!(
                "cannot reach the traffic manager at {target}: no answer within {} s — is the address right and the path to the cluster up?",
                timeout.as_secs()
            ));
        }
    };
    // Interactive traffic (ping, RPCs) must not wait for Nagle; the pump
    // batches by itself.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "cannot set TCP_NODELAY on the data connection");
    }
    // Keep the kernel's unsent backlog small, so that a heartbeat written after
    // a burst of data does not wait behind megabytes of it on a slow path.
    if let Err(e) =
        kvpn_proto::channel::set_notsent_lowat(&stream, kvpn_proto::channel::NOTSENT_LOWAT)
    {
        tracing::debug!(error = %e, "cannot set TCP_NOTSENT_LOWAT on the data connection");
    }
    Ok(stream)
}

/// The hello frame a session sends first on every data connection: protocol
/// version, the client's tunnel IP and its lease's session token. Public for
/// lightweight clients in tests (tr-11); the error names what did not encode.
pub fn hello_frame(tunnel_ip: IpAddr, token: &[u8]) -> Result<Vec<u8>, String> {
    hello_frame_with_mtu(tunnel_ip, token, None, None, None)
}

/// [`hello_frame`] that also tells the manager the TUN MTU (bytes), so the
/// packets it builds for the laptop are fragmented to fit it, the IPv6
/// tunnel IP of a dual-stack session, and the offloads the pump offers (hello
/// option 4, [`kvpn_proto::frame::OFFLOAD_TCP_GSO`]).
pub fn hello_frame_with_mtu(
    tunnel_ip: IpAddr,
    token: &[u8],
    mtu: Option<u16>,
    tunnel_ip_v6: Option<Ipv6Addr>,
    offloads: Option<u8>,
) -> Result<Vec<u8>, String> {
    hello_frame_for_worker(tunnel_ip, token, mtu, tunnel_ip_v6, offloads, None, None)
}

/// [`hello_frame_with_mtu`] of one worker connection: `shard` is hello option
/// 3, sent only when the session has more than one worker; `resume_token` is
/// hello option 5, the worker's resume token (the same on every dial of the
/// worker, so the manager can give a re-dial the flows of the connection it
/// replaces).
pub fn hello_frame_for_worker(
    tunnel_ip: IpAddr,
    token: &[u8],
    mtu: Option<u16>,
    tunnel_ip_v6: Option<Ipv6Addr>,
    offloads: Option<u8>,
    shard: Option<frame::Shard>,
    resume_token: Option<[u8; frame::RESUME_TOKEN_LEN]>,
) -> Result<Vec<u8>, String> {
    let payload = Hello {
        version: PROTOCOL_VERSION,
        tunnel_ip,
        token: token.to_vec(),
        mtu,
        tunnel_ip_v6,
        offloads,
        shard,
        resume_token,
    }
    .encode()
    .map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(frame::HEADER_LEN + payload.len());
    frame::encode_into(Kind::Hello, &payload, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// The byte stream to the manager: plain TCP, or TLS over TCP.
pub enum DataStream {
    /// Unencrypted (direct mode, the static lab).
    Plain(TcpStream),
    /// TLS 1.3, the manager's certificate verified.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl fmt::Debug for DataStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DataStream::Plain(_) => "DataStream::Plain",
            DataStream::Tls(_) => "DataStream::Tls",
        })
    }
}

impl DataStream {
    /// Wrap a dialled TCP stream in TLS when `tls` is given, within [`DIAL_TIMEOUT`].
    /// Errors are user-facing sentences naming `target` (and "certificate" when
    /// the manager's certificate does not verify).
    pub async fn secure(
        tcp: TcpStream,
        tls: Option<&TlsClient>,
        target: &str,
    ) -> Result<DataStream, String> {
        let Some(tls) = tls else {
            return Ok(DataStream::Plain(tcp));
        };
        match tokio::time::timeout(DIAL_TIMEOUT, tls.handshake(tcp, target)).await {
            Ok(Ok(stream)) => Ok(DataStream::Tls(Box::new(stream))),
            Ok(Err(message)) => Err(message),
            Err(_) => Err(format!(
                "TLS handshake with the traffic manager at {target} did not finish within {} s — is the manager serving TLS?",
                DIAL_TIMEOUT.as_secs()
            )),
        }
    }

    /// Send the hello frame (flushed through TLS).
    async fn send_hello(&mut self, hello: &[u8], target: &str) -> Result<(), String> {
        let result = match self {
            DataStream::Plain(s) => s.write_all(hello).await,
            DataStream::Tls(s) => match s.write_all(hello).await {
                Ok(()) => s.flush().await,
                Err(e) => Err(e),
            },
        };
        result.map_err(|e| format!("cannot send hello to the traffic manager at {target}: {e}"))
    }

    /// Read exactly one frame (header, then payload into `payload`), never a
    /// byte more: the pump reads the stream from the next frame on.
    async fn read_frame(&mut self, payload: &mut Vec<u8>) -> std::io::Result<Kind> {
        use tokio::io::AsyncReadExt as _;
        let mut header = [0u8; frame::HEADER_LEN];
        match self {
            DataStream::Plain(s) => s.read_exact(&mut header).await?,
            DataStream::Tls(s) => s.read_exact(&mut header).await?,
        };
        let header = frame::Decoder::default()
            .header(&header)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        payload.resize(header.payload_len, 0);
        match self {
            DataStream::Plain(s) => s.read_exact(&mut payload[..]).await?,
            DataStream::Tls(s) => s.read_exact(&mut payload[..]).await?,
        };
        Ok(header.kind)
    }

    /// After a hello with option 3: whether the manager answered it, i.e. sent
    /// a [`Kind::Stats`] frame with [`frame::stat::WORKERS`] before any other
    /// Stats frame, within `timeout`. Every manager that accepts this laptop's
    /// protocol version sends a Stats frame at once (its first tick); an older
    /// one's lacks the counter. Other frames read meanwhile are dropped (only a
    /// packet from another laptop can come this early; TCP retransmits it).
    async fn manager_takes_shards(&mut self, timeout: Duration) -> Result<bool, String> {
        let wait = async {
            let mut payload = Vec::new();
            loop {
                let kind = self.read_frame(&mut payload).await?;
                if kind == Kind::Stats {
                    let workers = frame::Stats::decode(&payload)
                        .ok()
                        .and_then(|s| s.get(frame::stat::WORKERS));
                    return Ok::<bool, std::io::Error>(workers.is_some());
                }
                tracing::debug!(kind = kind.to_u8(), "frame before the shard answer dropped");
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(known)) => Ok(known),
            Ok(Err(e)) => Err(format!(
                "the traffic manager closed the data connection after the hello: {e}"
            )),
            Err(_) => Ok(false),
        }
    }

    /// "tls" or "plain", as Status reports it.
    pub fn security(&self) -> &'static str {
        match self {
            DataStream::Plain(_) => "plain",
            DataStream::Tls(_) => "tls",
        }
    }
}

async fn dial_and_hello(
    target: &str,
    peer: DataPeer,
    hello: &[u8],
    tls: Option<&TlsClient>,
) -> Result<DataStream, String> {
    let tcp = dial_peer(target, peer, DIAL_TIMEOUT).await?;
    let mut stream = DataStream::secure(tcp, tls, target).await?;
    stream.send_hello(hello, target).await?;
    Ok(stream)
}

/// Run the pump of `worker` on `stream` until it stops. TCP splits into owned
/// halves; a TLS stream is shared by its halves through `tokio::io::split` (the
/// TLS state is one object for both directions).
async fn pump_on(
    stream: DataStream,
    tun: Arc<AsyncDevice>,
    worker: &Worker,
    index: usize,
    refusal: &Arc<Refusal>,
    stop: watch::Receiver<bool>,
) -> pump::PumpExit {
    let config = PumpConfig {
        worker: index,
        stop: Some(stop),
        redial: Some(worker.redial.clone()),
        ..PumpConfig::default()
    };
    match stream {
        DataStream::Plain(tcp) => {
            let (rx, tx) = tcp.into_split();
            pump::run(
                tun,
                rx,
                tx,
                worker.liveness.clone(),
                worker.counters.clone(),
                refusal.clone(),
                config,
            )
            .await
        }
        DataStream::Tls(tls) => {
            let (rx, tx) = tokio::io::split(*tls);
            pump::run(
                tun,
                rx,
                tx,
                worker.liveness.clone(),
                worker.counters.clone(),
                refusal.clone(),
                config,
            )
            .await
        }
    }
}

/// The hello frame of each of `workers` worker connections (option 3 only when
/// there is more than one worker). Never empty. Worker `i` offers
/// `resume_tokens[i]` (hello option 5) on every dial.
fn worker_hellos(
    params: &SessionParams,
    workers: u16,
    resume_tokens: &[[u8; frame::RESUME_TOKEN_LEN]],
) -> Result<Vec<Vec<u8>>, String> {
    let workers = workers.max(1);
    (0..workers)
        .map(|index| {
            hello_frame_for_worker(
                params.tunnel_ip,
                &params.session_token,
                Some(params.mtu),
                params.tunnel_ip_v6,
                // The TUN device always has IFF_VNET_HDR offloads (crate::tun):
                // offer GSO frames both ways; the pump segments itself until
                // the manager accepts them, and writes the manager's
                // super-packets with their virtio_net_hdr.
                Some(frame::OFFLOAD_TCP_GSO | frame::OFFLOAD_TCP_GRO),
                (workers > 1).then_some(frame::Shard {
                    index,
                    count: workers,
                }),
                resume_tokens.get(usize::from(index)).copied(),
            )
        })
        .collect()
}

/// Resources created so far during Connect, removed again on failure.
struct Undo<'a> {
    netlink: &'a Netlink,
    tun: Option<(Arc<AsyncDevice>, u32, String)>,
    /// Queues 1.. of a multi-queue TUN device (closed with the Undo).
    extra_queues: Vec<AsyncDevice>,
    routes: Vec<IpNet>,
}

impl Undo<'_> {
    async fn rollback(self) -> String {
        let Some((device, ifindex, name)) = self.tun else {
            return String::new();
        };
        let report = remove_device(self.netlink, device, ifindex, &name, &self.routes).await;
        if report.leftovers.is_empty() {
            " (rolled back: TUN device and routes removed)".to_owned()
        } else {
            format!(" (rollback incomplete: {})", report.leftovers.join("; "))
        }
    }
}

/// Delete `routes` and the TUN device `ifindex` explicitly, close it, and check
/// that neither the device nor any kvpn route through it remains.
async fn remove_device(
    netlink: &Netlink,
    device: Arc<AsyncDevice>,
    ifindex: u32,
    name: &str,
    routes: &[IpNet],
) -> TeardownReport {
    let mut report = TeardownReport::default();
    for route in routes {
        match netlink.del_route(ifindex, *route).await {
            Ok(()) => report.routes_removed += 1,
            // Already gone (ESRCH): nothing to do.
            Err(e) if e.errno == Some(libc::ESRCH) => {}
            Err(e) => tracing::warn!(error = %e, "cannot delete route"),
        }
    }
    if let Err(e) = netlink.delete_link(ifindex).await {
        tracing::warn!(error = %e, "cannot delete TUN device");
    }
    drop(device);
    // RTM_DELLINK is synchronous, but poll briefly in case a descriptor close
    // is what finally removes the device.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let link = netlink.link_exists(ifindex).await;
        let left = netlink.kvpn_routes(Some(ifindex)).await;
        let clean = matches!(link, Ok(false)) && matches!(&left, Ok(r) if r.is_empty());
        if clean || Instant::now() >= deadline {
            match link {
                Ok(true) => report
                    .leftovers
                    .push(format!("TUN device {name} (#{ifindex}) still exists")),
                Ok(false) => {}
                Err(e) => report
                    .leftovers
                    .push(format!("cannot check TUN device {name}: {e}")),
            }
            match left {
                Ok(r) => report.leftovers.extend(
                    r.iter()
                        .map(|r| format!("route {} dev #{} still installed", r.dst, r.oif)),
                ),
                Err(e) => report.leftovers.push(format!("cannot list routes: {e}")),
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report
}

fn step_err(step: Step, message: impl fmt::Display) -> (Step, String) {
    (step, message.to_string())
}

impl Session {
    /// Run Connect: dial, hello, TUN (down), address, rp_filter, classifier,
    /// link up, routes, pump. Must run on a runtime whose threads are in the laptop's network
    /// namespace.
    pub async fn start(
        id: String,
        params: SessionParams,
        netlink: &Netlink,
        classifiers: &dyn ClassifierAttach,
    ) -> Result<Session, ConnectError> {
        let span = tracing::info_span!("session", %id, manager = %params.manager);
        Self::start_inner(id, params, netlink, classifiers)
            .instrument(span)
            .await
    }

    async fn start_inner(
        id: String,
        params: SessionParams,
        netlink: &Netlink,
        classifiers: &dyn ClassifierAttach,
    ) -> Result<Session, ConnectError> {
        // A run session's routes live in a table of their own.
        let scoped = params.run_table.map(|t| netlink.in_table(t));
        let netlink = scoped.as_ref().unwrap_or(netlink);
        // Before anything else, so that a refusal leaves nothing behind.
        let laptop = if params.run_table.is_some() {
            Vec::new()
        } else {
            netlink
                .laptop_routes()
                .await
                .map_err(|e| ConnectError::Step {
                    step: Step::CheckRouteConflicts,
                    message: format!("cannot read the laptop's routes: {e}"),
                    rollback: String::new(),
                })?
        };
        let found = conflicts::find(&params.routes, &laptop, RTPROT_KVPN, None);
        if !found.is_empty() {
            if !params.allow_route_conflict {
                return Err(ConnectError::Step {
                    step: Step::CheckRouteConflicts,
                    message: conflicts::refusal(&found),
                    rollback: String::new(),
                });
            }
            for c in &found {
                // kvpn's routes win over main- and local-table routes by prefix
                // length only; a table a policy rule consults first stays ahead
                // of them unless `--steer ebpf` steers its device.
                if matches!(
                    c.laptop.table,
                    conflicts::TABLE_MAIN | conflicts::TABLE_LOCAL
                ) {
                    tracing::warn!(conflict = %c, "route conflict allowed: kvpn's more specific routes take the cluster-bound traffic");
                } else if params.steer_ebpf {
                    tracing::warn!(conflict = %c, table = %conflicts::table_name(c.laptop.table), "route conflict allowed: --steer ebpf steers the cluster-bound traffic past it");
                } else {
                    tracing::warn!(conflict = %c, table = %conflicts::table_name(c.laptop.table), "route conflict allowed but not handled: the table is consulted before kvpn's routes, so these cluster addresses stay unreachable (--steer ebpf would steer them)");
                }
            }
        }
        // `--steer ebpf`: the devices of conflicting routes routes cannot win over.
        let steer = if params.allow_route_conflict && params.steer_ebpf {
            conflicts::steer_targets(&found).map_err(|message| ConnectError::Step {
                step: Step::CheckRouteConflicts,
                message,
                rollback: String::new(),
            })?
        } else {
            Vec::new()
        };
        if !steer.is_empty() && !params.tunnel_ip.is_ipv4() {
            return Err(ConnectError::Step {
                step: Step::CheckRouteConflicts,
                message: "--steer ebpf needs an IPv4 tunnel IP (it steers IPv4 only)".to_owned(),
                rollback: String::new(),
            });
        }
        // Each worker's resume token: 128 random bits per worker per session,
        // offered on every dial of that worker (hello option 5). Only this
        // process knows them, so only its re-dials get the flows back.
        let resume_tokens: Vec<[u8; frame::RESUME_TOKEN_LEN]> =
            (0..params.workers.max(1)).map(|_| rand::random()).collect();
        // Worker 0's hello; with more workers asked for, it carries option 3
        // and the manager's answer decides how many run.
        let hello = worker_hellos(&params, params.workers.max(1), &resume_tokens)
            .map(|mut hellos| hellos.swap_remove(0))
            .map_err(|message| ConnectError::Step {
                step: Step::SendHello,
                message,
                rollback: String::new(),
            })?;
        let tcp = dial_peer(&params.manager, params.data_peer, DIAL_TIMEOUT)
            .await
            .map_err(ConnectError::Unreachable)?;
        let mut stream = DataStream::secure(tcp, params.tls.as_ref(), &params.manager)
            .await
            .map_err(|message| ConnectError::Step {
                step: Step::TlsHandshake,
                message,
                rollback: String::new(),
            })?;
        if let Err(message) = stream.send_hello(&hello, &params.manager).await {
            return Err(ConnectError::Step {
                step: Step::SendHello,
                message,
                rollback: String::new(),
            });
        }
        tracing::info!(
            security = stream.security(),
            "data connection to the traffic manager open, hello sent"
        );
        let mut workers = params.workers.max(1);
        if workers > 1 {
            match stream.manager_takes_shards(SHARD_ANSWER_TIMEOUT).await {
                Ok(true) => tracing::info!(workers, "the traffic manager takes worker shards"),
                Ok(false) => {
                    tracing::warn!(
                        asked = workers,
                        "the traffic manager does not understand worker shards (hello option 3; \
                         upgrade kvpn-manager): running 1 worker"
                    );
                    workers = 1;
                }
                Err(message) => {
                    return Err(ConnectError::Step {
                        step: Step::SendHello,
                        message,
                        rollback: String::new(),
                    });
                }
            }
        }
        let hellos = worker_hellos(&params, workers, &resume_tokens).map_err(|message| {
            ConnectError::Step {
                step: Step::SendHello,
                message,
                rollback: String::new(),
            }
        })?;

        let plan = routes::plan(&params.routes);
        // Equal to a main-table laptop route: the laptop keeps it (override only).
        let not_installed: Vec<(IpNet, RouteKind)> = plan
            .kernel
            .iter()
            .filter(|(net, _)| found.iter().any(|c| c.cluster == *net && c.exact_in_main()))
            .copied()
            .collect();
        // Before the TUN device has the tunnel IP: the sockets a dead root
        // daemon's session left are the ones into these routes from an address
        // no interface but a TUN device has (another cluster's session may
        // hold the same tunnel IP; see stale_tcp).
        let kernel_routes: Vec<IpNet> = plan.kernel.iter().map(|(net, _)| *net).collect();
        let stale_tcp_flows_reset = if params.run_table.is_some() {
            0
        } else {
            stale_tcp::reset(&kernel_routes, stale_tcp::Why::EarlierSession)
        };
        let mut undo = Undo {
            netlink,
            tun: None,
            extra_queues: Vec::new(),
            routes: Vec::new(),
        };
        let skip: Vec<IpNet> = not_installed.iter().map(|(n, _)| *n).collect();
        match Self::setup(
            &params,
            workers,
            &plan,
            &skip,
            &steer,
            netlink,
            classifiers,
            &mut undo,
        )
        .await
        {
            Ok(classifier) => {
                let Some((device, ifindex, tun_name)) = undo.tun.take() else {
                    return Err(ConnectError::Step {
                        step: Step::CreateTun,
                        message: "internal error: no TUN device after setup".to_owned(),
                        rollback: String::new(),
                    });
                };
                let shared = Arc::new(Shared {
                    workers: (0..workers)
                        .map(|_| Worker {
                            liveness: Arc::new(Mutex::new(Liveness::new(
                                params.heartbeat_interval,
                            ))),
                            counters: Arc::new(Counters::default()),
                            redial: Arc::new(Redial::default()),
                        })
                        .collect(),
                    refusal: Arc::new(Refusal::default()),
                });
                let (stop_tx, stop_rx) = watch::channel(false);
                let queues = std::iter::once(device.clone()).chain(
                    std::mem::take(&mut undo.extra_queues)
                        .into_iter()
                        .map(Arc::new),
                );
                let mut first = Some(stream);
                let supervisors = queues
                    .zip(hellos)
                    .enumerate()
                    .map(|(index, (queue, hello))| {
                        let span = if workers > 1 {
                            tracing::info_span!("session", %id, worker = index)
                        } else {
                            tracing::info_span!("session", %id)
                        };
                        tokio::spawn(
                            supervise(
                                queue,
                                TunDevice {
                                    session: id.clone(),
                                    name: tun_name.clone(),
                                    ifindex,
                                },
                                first.take(),
                                params.manager.clone(),
                                params.data_peer,
                                hello,
                                params.tls.clone(),
                                shared.clone(),
                                index,
                                stop_rx.clone(),
                            )
                            .instrument(span),
                        )
                    })
                    .collect();
                let classifier: ClassifierSlot = Arc::new(Mutex::new(classifier));
                let watched = Arc::new(Mutex::new(Watched {
                    not_installed: not_installed.into_iter().collect(),
                    ..Watched::default()
                }));
                let steer_watch = match (
                    params.steer_ebpf && params.allow_route_conflict,
                    params.tunnel_ip,
                ) {
                    (true, IpAddr::V4(tunnel_ip)) => {
                        match steer_watch::spawn(steer_watch::Inputs {
                            netlink: netlink.clone(),
                            classifier: classifier.clone(),
                            watched: watched.clone(),
                            connect: plan.kernel.clone(),
                            tun_ifindex: ifindex,
                            tunnel_ip,
                        }) {
                            Ok(watch) => Some(watch),
                            Err(e) => {
                                // Steering as found at connect still works; only
                                // following the laptop's devices does not.
                                tracing::warn!(error = %e, "cannot watch the laptop's links and routes: eBPF steering stays on the devices found at connect");
                                None
                            }
                        }
                    }
                    _ => None,
                };
                let watched_update: Arc<tokio::sync::Mutex<()>> = Arc::default();
                let route_guard = RouteGuard::spawn(route_guard::Inputs {
                    netlink: netlink.clone(),
                    ifindex,
                    tun_name: tun_name.clone(),
                    tunnel_ips: params.tunnel_ips(),
                    connect: plan.kernel.iter().map(|(n, _)| *n).collect(),
                    watched: watched.clone(),
                    update_lock: watched_update.clone(),
                });
                tracing::info!(tun = %tun_name, ifindex, routes = plan.kernel.len(), workers, "session up");
                Ok(Session {
                    id,
                    params,
                    plan,
                    tun_name,
                    ifindex,
                    started: Instant::now(),
                    shared,
                    classifier,
                    watched,
                    watched_update,
                    stop_tx,
                    supervisors,
                    tun: Some(device),
                    origin: None,
                    steer_watch,
                    stale_tcp_flows_reset,
                    route_guard,
                })
            }
            Err((step, message)) => {
                drop(stream);
                let rollback = undo.rollback().await;
                tracing::warn!(%step, %message, %rollback, "connect failed");
                Err(ConnectError::Step {
                    step,
                    message,
                    rollback,
                })
            }
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the session's parts setup borrows, each used once; a struct would only rename them"
    )]
    async fn setup(
        params: &SessionParams,
        workers: u16,
        plan: &RoutePlan,
        not_installed: &[IpNet],
        steer: &[(String, u32)],
        netlink: &Netlink,
        classifiers: &dyn ClassifierAttach,
        undo: &mut Undo<'_>,
    ) -> Result<Option<Box<dyn AttachedClassifier>>, (Step, String)> {
        if let Some(name) = &params.tun_name {
            tun::validate_name(name).map_err(|e| step_err(Step::CreateTun, e))?;
            if netlink
                .link_index(name)
                .await
                .map_err(|e| step_err(Step::CreateTun, e))?
                .is_some()
            {
                return Err(step_err(
                    Step::CreateTun,
                    format!(
                        "an interface named {name} already exists — choose another --tun-name \
                         (or leave it out for the first free kvpnN)"
                    ),
                ));
            }
        }
        let created = tun::create_with_queues(params.tun_name.as_deref(), params.mtu, workers)
            .map_err(|e| step_err(Step::CreateTun, e))?;
        let ifindex = created.ifindex;
        let name = created.name.clone();
        undo.tun = Some((Arc::new(created.device), ifindex, created.name));
        undo.extra_queues = created.extra_queues;

        // Order matters: the device stays down until the classifier is attached,
        // so that nothing (not even the kernel's own IPv6 router solicitations
        // and MLD reports on a new device) reaches the tunnel unclassified.
        // Routes need the device up (fib_check_nh: -ENETDOWN), so they go last.
        for ip in params.tunnel_ips() {
            netlink
                .add_host_address(ifindex, ip)
                .await
                .map_err(|e| step_err(Step::AddAddress, e))?;
        }
        // A run session's replies come from addresses no unmarked lookup routes
        // into this device (crate::run_scope): loose mode would need a default
        // route, so the check is off on its own TUN device.
        let rp_filter = if params.run_table.is_some() {
            0
        } else {
            RP_FILTER_LOOSE
        };
        netlink
            .set_rp_filter(ifindex, rp_filter)
            .await
            .map_err(|e| step_err(Step::SetRpFilter, e))?;
        match netlink.rp_filter(ifindex).await {
            Ok(Some(v)) if v == rp_filter => {}
            Ok(other) => {
                return Err(step_err(
                    Step::SetRpFilter,
                    format!("rp_filter on {name} reads {other:?} after setting {rp_filter}"),
                ));
            }
            Err(e) => return Err(step_err(Step::SetRpFilter, e)),
        }
        // Dropped (detached) on an error return below, before the rollback.
        let mut classifier = classifiers
            .attach(&name, &plan.classifier)
            .map_err(|e| step_err(Step::AttachClassifier, error_chain(&*e)))?;
        if let Some(mark) = params.run_mark {
            classifier
                .set_ingress_mark(mark)
                .map_err(|e| step_err(Step::AttachClassifier, error_chain(&*e)))?;
            let path = format!("/proc/sys/net/ipv4/conf/{name}/src_valid_mark");
            std::fs::write(&path, "1").map_err(|e| {
                step_err(
                    Step::SetRpFilter,
                    format!("cannot set {path} to 1 (the run's replies carry its mark): {e}"),
                )
            })?;
        }
        // `--steer ebpf` (case rt-05). The TUN's rp_filter is loose (above), which the
        // steered flows' replies need: their source is a cluster IP whose reverse
        // route points at the steered device, not the TUN; strict mode would drop
        // them (`__fib_validate_source`, net/ipv4/fib_frontend.c: a lookup result
        // through another device fails `rpf == 1`, loose mode only needs a route).
        if let IpAddr::V4(tunnel_ip) = params.tunnel_ip {
            for (dev, oif) in steer {
                let l2 = netlink
                    .l2_hdr_len(*oif)
                    .await
                    .map_err(|e| step_err(Step::AttachClassifier, e))?
                    .ok_or_else(|| {
                        step_err(
                            Step::AttachClassifier,
                            format!(
                                "cannot steer {dev}: gone, or a link type other than \
                                 Ethernet, TUN/WireGuard, PPP or raw IP"
                            ),
                        )
                    })?;
                classifier
                    .steer(dev, *oif, l2, tunnel_ip, ifindex)
                    .map_err(|e| step_err(Step::AttachClassifier, error_chain(&*e)))?;
            }
        }
        netlink
            .set_link_up(ifindex)
            .await
            .map_err(|e| step_err(Step::LinkUp, e))?;
        for (cidr, _) in &plan.kernel {
            if not_installed.contains(cidr) {
                continue;
            }
            netlink
                .add_route(ifindex, *cidr, &params.tunnel_ips())
                .await
                .map_err(|e| step_err(Step::AddRoutes, e))?;
            undo.routes.push(*cidr);
        }
        Ok(Some(classifier))
    }

    /// `base` working on this session's routing table (its own for a `kvpn run`
    /// session, else main).
    pub fn route_netlink(&self, base: &Netlink) -> Netlink {
        match self.params.run_table {
            Some(t) => base.in_table(t),
            None => base.clone(),
        }
    }

    /// The routing table of a `kvpn run` session (`None`: laptop-wide).
    pub fn run_table(&self) -> Option<u32> {
        self.params.run_table
    }

    /// Record which cluster the session leads to (from the Connect request);
    /// Status reports it, nothing else reads it.
    pub fn set_origin(&mut self, origin: Option<kvpn_proto::dataplane::Origin>) {
        self.origin = origin;
    }

    /// The session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The TUN device's name.
    pub fn tun_name(&self) -> &str {
        &self.tun_name
    }

    /// The tunnel IPs on its TUN device.
    pub fn tunnel_ips(&self) -> Vec<IpAddr> {
        self.params.tunnel_ips()
    }

    /// The TUN device's interface index.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// The kernel routes installed, with their kinds.
    pub fn routes(&self) -> &[(IpNet, RouteKind)] {
        &self.plan.kernel
    }

    /// What UpdateRoutes needs of this session (shared handles, no lock held).
    pub fn watch_handle(&self) -> WatchHandle {
        WatchHandle {
            ifindex: self.ifindex,
            tunnel_ips: self.params.tunnel_ips(),
            connect: self.plan.kernel.clone(),
            allow_route_conflict: self.params.allow_route_conflict,
            classifier: self.classifier.clone(),
            state: self.watched.clone(),
            update_lock: self.watched_update.clone(),
        }
    }

    fn watched(&self) -> Watched {
        self.watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The state and, unless connected, why (with several workers: see
    /// [`combine_states`]).
    pub fn state(&self) -> (State, Option<String>) {
        combine_states(self.shared.states(Instant::now()))
    }

    /// Pump workers running (TUN queues, data connections).
    pub fn workers(&self) -> usize {
        self.shared.workers.len()
    }

    /// Whether the session is connected now, for split DNS: the opposite of
    /// [`Liveness::is_reconnecting`], the test by which the pump answers packets
    /// toward the cluster with ICMP unreachable, read at each call (no task, no
    /// timer), so DNS and TCP fail fast from the same instant. It holds the
    /// liveness state, not the session.
    pub fn dns_reach(&self) -> crate::dns::Reach {
        let workers: Vec<_> = self
            .shared
            .workers
            .iter()
            .map(|w| w.liveness.clone())
            .collect();
        crate::dns::Reach::new(move || {
            let now = Instant::now();
            !workers.iter().any(|l| {
                l.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .is_reconnecting(now)
            })
        })
    }

    /// Pump counters, summed over the workers (a snapshot; the manager's
    /// stats are in [`Session::status`]).
    pub fn counters(&self) -> Counters {
        let sum = Counters::default();
        for w in &self.shared.workers {
            let c = &w.counters;
            for (to, from) in [
                (&sum.tx_packets, &c.tx_packets),
                (&sum.tx_bytes, &c.tx_bytes),
                (&sum.tx_batches, &c.tx_batches),
                (&sum.tx_gso_frames, &c.tx_gso_frames),
                (&sum.tx_gso_segmented, &c.tx_gso_segmented),
                (&sum.tx_offload_dropped, &c.tx_offload_dropped),
                (&sum.rx_packets, &c.rx_packets),
                (&sum.rx_bytes, &c.rx_bytes),
                (&sum.rx_invalid, &c.rx_invalid),
                (&sum.rx_gso_frames, &c.rx_gso_frames),
                (&sum.rx_gso_segments, &c.rx_gso_segments),
                (&sum.heartbeats_sent, &c.heartbeats_sent),
                (&sum.heartbeats_echoed, &c.heartbeats_echoed),
                (&sum.refused_packets, &c.refused_packets),
                (&sum.unreachable_sent, &c.unreachable_sent),
                (&sum.unreachable_rate_limited, &c.unreachable_rate_limited),
                (&sum.transports_lost, &c.transports_lost),
                (&sum.resumes, &c.resumes),
                (&sum.resumes_lost, &c.resumes_lost),
                (&sum.tcp_flows_reset, &c.tcp_flows_reset),
                (&sum.held_packets, &c.held_packets),
            ] {
                Counters::add(to, Counters::get(from));
            }
        }
        sum
    }

    /// The classifier's counters (`None` without a classifier).
    pub fn classifier_stats(&self) -> Option<Result<Stats, BoxError>> {
        let guard = self
            .classifier
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().map(|c| c.stats())
    }

    /// The laptop devices eBPF steering is attached to (`--steer ebpf`), as (name,
    /// ifindex).
    pub fn steered_devices(&self) -> Vec<(String, u32)> {
        self.classifier
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|c| c.steered_devices())
            .unwrap_or_default()
    }

    /// The session as the Status API shows it.
    pub fn status(&self) -> kvpn_proto::dataplane::Session {
        use kvpn_proto::dataplane as api;
        let (state, reason) = self.state();
        let c = self.counters();
        let counter = |c: ebpf::Counter| api::Counter {
            packets: c.packets,
            bytes: c.bytes,
        };
        let steered_devices = self.steered_devices();
        let mut steer = None;
        let (ebpf, unrouted, ingress) = match self.classifier_stats() {
            Some(Ok(stats)) => {
                // With the watch, also while no device is steered: its count and
                // errors stay visible.
                if !steered_devices.is_empty() || self.steer_watch.is_some() {
                    let watch = self
                        .steer_watch
                        .as_ref()
                        .map(SteerWatch::state)
                        .unwrap_or_default();
                    steer = Some(api::SteerCounters {
                        devices: steered_devices.iter().map(|(d, _)| d.clone()).collect(),
                        steered: Some(counter(stats.steer.steered)),
                        reverse_translated: Some(counter(stats.steer.reversed)),
                        no_conntrack: Some(counter(stats.steer.no_conntrack)),
                        failed: Some(counter(stats.steer.failed)),
                        attached: steered_devices
                            .iter()
                            .map(|(name, ifindex)| api::SteeredDevice {
                                name: name.clone(),
                                ifindex: *ifindex,
                            })
                            .collect(),
                        reattachments: watch.reattachments,
                        errors: watch.errors.into_values().collect(),
                    });
                }
                (
                    stats
                        .per_kind
                        .iter()
                        .map(|(kind, counter)| api::KindCounters {
                            kind: kind_to_api(*kind) as i32,
                            packets: counter.packets,
                            bytes: counter.bytes,
                        })
                        .collect(),
                    stats.unrouted,
                    Some(api::IngressCounters {
                        passed: Some(counter(stats.ingress.passed)),
                        foreign_source: Some(counter(stats.ingress.foreign_source)),
                        malformed: Some(counter(stats.ingress.malformed)),
                    }),
                )
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot read eBPF counters");
                (Vec::new(), ebpf::Counter::default(), None)
            }
            None => (Vec::new(), ebpf::Counter::default(), None),
        };
        let watched = self.watched();
        api::Session {
            id: self.id.clone(),
            manager: self.params.manager.clone(),
            tunnel_ip: self.params.tunnel_ip.to_string(),
            tunnel_ip_v6: self
                .params
                .tunnel_ip_v6
                .map(|a| a.to_string())
                .unwrap_or_default(),
            tun_name: self.tun_name.clone(),
            state: state.as_str().to_owned(),
            reason: reason.unwrap_or_default(),
            routes: self
                .plan
                .kernel
                .iter()
                .map(|(cidr, kind)| (cidr, kind, false))
                .chain(watched.routes.iter().map(|(cidr, kind)| (cidr, kind, true)))
                .map(|(cidr, kind, watched)| api::Route {
                    cidr: cidr.to_string(),
                    kind: kind_to_api(*kind) as i32,
                    watched,
                })
                .collect(),
            uptime_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            tx_packets: Counters::get(&c.tx_packets),
            tx_bytes: Counters::get(&c.tx_bytes),
            tx_gso_frames: Counters::get(&c.tx_gso_frames),
            tx_gso_segmented: Counters::get(&c.tx_gso_segmented),
            tx_offload_dropped: Counters::get(&c.tx_offload_dropped),
            resumes: Counters::get(&c.resumes),
            resumes_lost: Counters::get(&c.resumes_lost),
            tcp_flows_reset: Counters::get(&c.tcp_flows_reset),
            held_packets: Counters::get(&c.held_packets),
            stale_tcp_flows_reset: self.stale_tcp_flows_reset,
            routes_repaired: self.route_guard.repaired(),
            // Filled in by the daemon, which owns the run scope.
            run_cgroup: String::new(),
            run_table: 0,
            run_mark: 0,
            run_dns: String::new(),
            rx_packets: Counters::get(&c.rx_packets),
            rx_bytes: Counters::get(&c.rx_bytes),
            rx_gso_frames: Counters::get(&c.rx_gso_frames),
            rx_gso_segments: Counters::get(&c.rx_gso_segments),
            ebpf,
            ebpf_unrouted_packets: unrouted.packets,
            ebpf_unrouted_bytes: unrouted.bytes,
            ebpf_ingress: ingress,
            ebpf_steer: steer,
            mtu: u32::from(self.params.mtu),
            data_channel: if self.params.tls.is_some() {
                "tls"
            } else {
                "plain"
            }
            .to_owned(),
            origin: self.origin.clone(),
            liveness: Some(self.liveness_status()),
            manager_stats: self.manager_stats(),
            workers: u32::try_from(self.workers()).unwrap_or(u32::MAX),
            workers_connected: u32::try_from(
                self.shared
                    .states(Instant::now())
                    .iter()
                    .filter(|(state, _)| *state == State::Connected)
                    .count(),
            )
            .unwrap_or(u32::MAX),
            route_source: watched.source,
            dns: watched.dns,
            services: watched.services.into_values().collect(),
            // Filled in by the daemon (the forwarder is shared by all sessions).
            dns_counters: None,
            // Filled in by the daemon (it reads the laptop's routes once for all).
            conflicts: Vec::new(),
        }
    }

    /// The session's cluster ranges that overlap `laptop` routes now (case
    /// rt-05), as Status shows them.
    pub fn conflict_status(
        &self,
        laptop: &[LaptopRoute],
    ) -> Vec<kvpn_proto::dataplane::RouteConflict> {
        let watched = self.watched();
        let steered_devices = self.steered_devices();
        let ranges: Vec<(IpNet, RouteKind)> = self
            .plan
            .kernel
            .iter()
            .copied()
            .chain(watched.routes.iter().map(|(n, k)| (*n, *k)))
            .chain(watched.refused.iter().map(|(n, k)| (*n, *k)))
            .chain(watched.not_installed.iter().map(|(n, k)| (*n, *k)))
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        conflicts::find(&ranges, laptop, RTPROT_KVPN, Some(self.ifindex))
            .into_iter()
            .filter(|c| {
                seen.insert((
                    c.cluster,
                    c.laptop.clone().dst,
                    c.laptop.table,
                    c.laptop.dev.clone(),
                ))
            })
            .map(|c| {
                let handling = if watched.refused.contains_key(&c.cluster) {
                    "refused"
                } else if watched.not_installed.contains_key(&c.cluster) {
                    "not installed"
                } else if !matches!(
                    c.laptop.table,
                    conflicts::TABLE_MAIN | conflicts::TABLE_LOCAL
                ) && steered_devices
                    .iter()
                    .any(|(dev, ifindex)| *dev == c.laptop.dev && *ifindex == c.laptop.oif)
                {
                    "steered (ebpf)"
                } else if self.params.allow_route_conflict
                    && matches!(
                        c.laptop.table,
                        conflicts::TABLE_MAIN | conflicts::TABLE_LOCAL
                    )
                {
                    // Routes win over main- and local-table routes by prefix
                    // length; a table a policy rule consults before main is
                    // out of their reach (`--steer ebpf` is for that).
                    "steered"
                } else {
                    "unhandled"
                };
                let contested = c.contested();
                kvpn_proto::dataplane::RouteConflict {
                    cidr: c.cluster.to_string(),
                    kind: kind_to_api(c.kind) as i32,
                    laptop_cidr: c.laptop.dst.to_string(),
                    laptop_dev: c.laptop.dev.clone(),
                    laptop_proto: conflicts::protocol_name(c.laptop.protocol),
                    laptop_table: conflicts::table_name(c.laptop.table),
                    message: c.to_string(),
                    handling: handling.to_owned(),
                    pinned: watched
                        .pinned
                        .iter()
                        .filter(|p| contested.contains(*p))
                        .map(ToString::to_string)
                        .collect(),
                }
            })
            .collect()
    }

    /// The session's classifier entries with their counters (`kvpn top`).
    pub fn top(&self) -> kvpn_proto::dataplane::TopSession {
        use kvpn_proto::dataplane as api;
        let watched = self.watched();
        let stats = {
            let guard = self
                .classifier
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            guard.as_ref().map(|c| (c.route_stats(), c.stats()))
        };
        let (entries, unrouted) = match stats {
            Some((Ok(entries), kinds)) => (entries, kinds.map(|k| k.unrouted).unwrap_or_default()),
            Some((Err(e), _)) => {
                tracing::warn!(error = %e, "cannot read the per-route eBPF counters");
                (Vec::new(), ebpf::Counter::default())
            }
            None => (Vec::new(), ebpf::Counter::default()),
        };
        let routes: Vec<(IpNet, bool)> = self
            .plan
            .classifier
            .iter()
            .map(|(c, _)| (*c, false))
            .chain(watched.routes.keys().map(|c| (*c, true)))
            .collect();
        let entries = entries
            .into_iter()
            .map(|(cidr, kind, counter)| {
                let (source, services, parent) = match watched.service_entries.get(&cidr) {
                    Some(names) => (
                        "service",
                        names.clone(),
                        routes
                            .iter()
                            .filter(|(r, _)| *r != cidr && r.contains(&cidr))
                            .max_by_key(|(r, _)| r.prefix_len())
                            .map(|(r, _)| r.to_string())
                            .unwrap_or_default(),
                    ),
                    None if watched.routes.contains_key(&cidr) => {
                        ("watch", Vec::new(), String::new())
                    }
                    None => ("connect", Vec::new(), String::new()),
                };
                api::TopEntry {
                    cidr: cidr.to_string(),
                    kind: kind_to_api(kind) as i32,
                    source: source.to_owned(),
                    services,
                    parent,
                    packets: counter.packets,
                    bytes: counter.bytes,
                }
            })
            .collect();
        let c = self.counters();
        api::TopSession {
            id: self.id.clone(),
            tun_name: self.tun_name.clone(),
            origin: self.origin.clone(),
            entries,
            unrouted_packets: unrouted.packets,
            unrouted_bytes: unrouted.bytes,
            tx_packets: Counters::get(&c.tx_packets),
            tx_bytes: Counters::get(&c.tx_bytes),
            rx_packets: Counters::get(&c.rx_packets),
            rx_bytes: Counters::get(&c.rx_bytes),
        }
    }

    /// The manager's latest stats frame of each worker connection, summed (each
    /// worker connection has its own engine, flow table and share of the flow
    /// cap on the manager), for Status. The age is the oldest frame's.
    fn manager_stats(&self) -> Option<kvpn_proto::dataplane::ManagerStats> {
        use kvpn_proto::frame::stat;
        let mut sum: Option<(frame::Stats, Instant)> = None;
        for w in &self.shared.workers {
            let guard = w
                .counters
                .manager_stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let Some((stats, at)) = guard.as_ref() else {
                continue;
            };
            let (total, oldest) = sum.get_or_insert_with(|| (frame::Stats::default(), *at));
            *oldest = (*oldest).min(*at);
            for (name, n) in &stats.counters {
                match total.counters.iter_mut().find(|(have, _)| have == name) {
                    Some((_, v)) => *v = v.saturating_add(*n),
                    None => total.counters.push((name.clone(), *n)),
                }
            }
        }
        let (stats, at) = sum.as_ref()?;
        let get = |name: &str| stats.get(name).unwrap_or(0);
        Some(kvpn_proto::dataplane::ManagerStats {
            flows: get(stat::FLOWS),
            flow_cap: get(stat::FLOW_CAP),
            refused_cap: get(stat::REFUSED_CAP),
            rate_limited: get(stat::RATE_LIMITED),
            icmp_rate_limited: get(stat::ICMP_RATE_LIMITED),
            echoes_dropped: get(stat::ECHOES_DROPPED),
            gso_frames: get(stat::GSO_FRAMES),
            gso_segments: get(stat::GSO_SEGMENTS),
            drops: stats
                .counters
                .iter()
                .filter_map(|(name, n)| {
                    Some(kvpn_proto::dataplane::ManagerDrop {
                        reason: name.strip_prefix(stat::DROP_PREFIX)?.to_owned(),
                        packets: *n,
                    })
                })
                .collect(),
            age_ms: u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Heartbeat settings and worker 0's RTT; counters summed over workers.
    fn liveness_status(&self) -> kvpn_proto::dataplane::Liveness {
        let (interval, window, rtt) = match self.shared.workers.first() {
            Some(w) => {
                let l = w.liveness.lock().unwrap_or_else(PoisonError::into_inner);
                (l.interval(), l.window(), l.last_rtt())
            }
            None => (Duration::ZERO, Duration::ZERO, None),
        };
        let ms = |d: Duration| u32::try_from(d.as_millis()).unwrap_or(u32::MAX);
        let c = self.counters();
        kvpn_proto::dataplane::Liveness {
            heartbeat_interval_ms: ms(interval),
            window_ms: ms(window),
            heartbeats_sent: Counters::get(&c.heartbeats_sent),
            heartbeats_echoed: Counters::get(&c.heartbeats_echoed),
            last_rtt_us: rtt.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            refused_packets: Counters::get(&c.refused_packets),
            unreachable_sent: Counters::get(&c.unreachable_sent),
            unreachable_rate_limited: Counters::get(&c.unreachable_rate_limited),
            transports_lost: Counters::get(&c.transports_lost),
        }
    }

    /// Stop the pump, detach the classifier, delete the routes and the TUN
    /// device, and verify that none of them remains.
    pub async fn teardown(mut self, netlink: &Netlink) -> TeardownReport {
        let netlink = &self.route_netlink(netlink);
        // First: the routes deleted below must not be put back.
        self.route_guard.stop().await;
        // While the TUN device, its routes and the pump are still there: the
        // sockets through the session would hang once they are gone, and the
        // aborts' RSTs still reach the manager through the tunnel. A run
        // session's processes are killed with its cgroup instead, and its routes
        // may be another run session's too.
        let tcp_reset = if self.params.run_table.is_some() {
            0
        } else {
            self.reset_tcp_through()
        };
        let _ = self.stop_tx.send(true);
        // Before the classifier goes: the watch attaches through it.
        if let Some(watch) = self.steer_watch.as_mut() {
            watch.stop().await;
        }
        for mut supervisor in std::mem::take(&mut self.supervisors) {
            if tokio::time::timeout(Duration::from_secs(2), &mut supervisor)
                .await
                .is_err()
            {
                supervisor.abort();
                let _ = supervisor.await;
            }
        }
        // Detach before the device goes, so the link is released cleanly.
        drop(
            self.classifier
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        // Verified while the device still exists: afterwards there is nothing
        // to query. A failed query (no TCX before Linux 6.6) proves nothing
        // either way and is only logged.
        // The kernel may release the TCX link a moment after its last fd closes
        // (seen once under heavy load), so poll briefly before calling it a leftover.
        let detach_deadline = Instant::now() + Duration::from_secs(1);
        let still_attached = loop {
            let attached = match ebpf::Classifier::is_attached_to(&self.tun_name) {
                Ok(attached) => attached,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot query TCX attachments");
                    false
                }
            };
            if !attached || Instant::now() >= detach_deadline {
                break attached;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let routes = self.all_routes();
        let mut report = match self.tun.take() {
            Some(device) => {
                remove_device(netlink, device, self.ifindex, &self.tun_name, &routes).await
            }
            None => TeardownReport::default(),
        };
        if still_attached {
            report.leftovers.push(format!(
                "eBPF classifier still attached to {} after detaching",
                self.tun_name
            ));
        }
        report.tcp_reset = tcp_reset;
        let c = self.counters();
        tracing::info!(
            id = %self.id,
            tun = %self.tun_name,
            routes_removed = report.routes_removed,
            tcp_reset,
            leftovers = report.leftovers.len(),
            tx_packets = Counters::get(&c.tx_packets),
            tx_batches = Counters::get(&c.tx_batches),
            tx_gso_frames = Counters::get(&c.tx_gso_frames),
            tx_gso_segmented = Counters::get(&c.tx_gso_segmented),
            tx_offload_dropped = Counters::get(&c.tx_offload_dropped),
            rx_packets = Counters::get(&c.rx_packets),
            rx_invalid = Counters::get(&c.rx_invalid),
            rx_gso_frames = Counters::get(&c.rx_gso_frames),
            rx_gso_segments = Counters::get(&c.rx_gso_segments),
            "session torn down"
        );
        report
    }
}

impl Session {
    /// The session's routes: planned (less those the laptop kept), watched and
    /// pinned.
    fn all_routes(&self) -> Vec<IpNet> {
        let connect: Vec<IpNet> = self.plan.kernel.iter().map(|(n, _)| *n).collect();
        route_guard::expected(&connect, &self.watched())
    }

    /// Destroy the laptop's TCP sockets through this session ([`stale_tcp`]:
    /// into its routes, from its tunnel IP or another address no interface
    /// but a TUN device has); how many.
    fn reset_tcp_through(&self) -> u64 {
        stale_tcp::reset(&self.all_routes(), stale_tcp::Why::Disconnecting(&self.id))
    }
}

/// Map a route kind to the API enum.
pub fn kind_to_api(kind: RouteKind) -> kvpn_proto::dataplane::RouteKind {
    use kvpn_proto::dataplane::RouteKind as Api;
    match kind {
        RouteKind::Pod => Api::Pod,
        RouteKind::Service => Api::Service,
        RouteKind::Extra => Api::Extra,
    }
}

/// Map an API route kind; `None` for UNSPECIFIED or unknown values.
pub fn kind_from_api(raw: i32) -> Option<RouteKind> {
    use kvpn_proto::dataplane::RouteKind as Api;
    match Api::try_from(raw).ok()? {
        Api::Pod => Some(RouteKind::Pod),
        Api::Service => Some(RouteKind::Service),
        Api::Extra => Some(RouteKind::Extra),
        Api::Unspecified => None,
    }
}

/// `err` and its sources, joined with ": " (a source whose text is already in
/// the message left out).
pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// The TUN device a session's workers read and write (one queue each), as
/// the reason of a worker whose device was deleted names it.
#[derive(Debug, Clone)]
struct TunDevice {
    /// The session's id (the reason says `kvpn disconnect ID`).
    session: String,
    /// The device's name.
    name: String,
    /// Its interface index.
    ifindex: u32,
}

impl TunDevice {
    /// After a read or write on a queue failed with `error`: the worker's
    /// failure reason when the device is gone ([`tun::device_gone`]), else
    /// `None` (the pump's usual exit: re-dial).
    fn deleted(&self, error: &std::io::Error) -> Option<String> {
        tun::device_gone(self.ifindex).then(|| tun_deleted_reason(&self.name, &self.session, error))
    }
}

/// Status reason of a worker whose TUN device `name` was deleted from outside
/// kvpn while session `session` ran: the device, the cause and the fix.
fn tun_deleted_reason(name: &str, session: &str, error: &std::io::Error) -> String {
    format!(
        "TUN device {name} was deleted from outside kvpn while the session ran (e.g. \
         `ip link del {name}`; its queue fails with: {error}); kvpn does not recreate it and \
         closed the data connection: run `kvpn disconnect {session}`, then `kvpn connect` again"
    )
}

/// The [`pump::refuse`] task that answers the TUN while no pump runs; aborted
/// (and awaited, so that only one reader touches the TUN) before the next pump.
struct Refuser(Option<JoinHandle<std::io::Error>>);

impl Refuser {
    fn start(&mut self, tun: &Arc<AsyncDevice>, worker: &Worker, refusal: &Arc<Refusal>) {
        if self.0.is_some() {
            return;
        }
        let (tun, refusal, counters) = (tun.clone(), refusal.clone(), worker.counters.clone());
        let held = worker.redial.clone();
        self.0 = Some(tokio::spawn(
            async move {
                let e = redial::refuse_or_hold(tun, refusal, counters, held).await;
                tracing::warn!(error = %e, "cannot read the TUN device while reconnecting");
                e
            }
            .in_current_span(),
        ));
    }

    /// The TUN error the running refuser ended with; pending while it runs
    /// or when none runs (cancel-safe: the task is kept until it ends).
    async fn ended(&mut self) -> std::io::Error {
        let Some(task) = self.0.as_mut() else {
            return std::future::pending().await;
        };
        let joined = task.await;
        self.0 = None;
        match joined {
            Ok(e) => e,
            // Aborted or panicked: no TUN error to judge; wait as if running.
            Err(_) => std::future::pending().await,
        }
    }

    async fn stop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Refuser {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Run `until` (a dial, a pause) while no pump runs, watching the stop signal
/// and the [`Refuser`]: `None` when the session stops or the refuser's TUN
/// error shows the device gone (`failed` marked the worker failed), else
/// `until`'s output. A refuser that ends for another reason is only logged (by
/// itself); `until` goes on.
async fn watching<F: std::future::Future>(
    until: F,
    stop_rx: &mut watch::Receiver<bool>,
    refuser: &mut Refuser,
    failed: &impl Fn(&std::io::Error) -> bool,
) -> Option<F::Output> {
    tokio::pin!(until);
    loop {
        tokio::select! {
            _ = stop_rx.changed() => return None,
            e = refuser.ended() => {
                if failed(&e) {
                    return None;
                }
            }
            out = &mut until => return Some(out),
        }
    }
}

/// Keep the transport up: run the pump, and when it stops, re-dial with backoff
/// and run it again on the same TUN device, until told to stop. While no pump
/// runs, [`Refuser`] answers packets toward the cluster with ICMP unreachable.
///
/// A transport that ends before the manager echoed a heartbeat on it counts as a
/// failed dial: the next dial waits the backoff. Relays accept first and reach the
/// manager afterwards (the port-forward agent on loopback accepts, then finds no
/// ready manager pod and closes); re-dialling those at once would spin, and make
/// the agent list pods hundreds of times a second. A transport that had proved
/// itself (an echo, or one that lived to the silence watchdog) is re-dialled at
/// once, so a killed transport recovers in well under tr-08's 3 s.
///
/// A TUN read or write (pump or refuser) that fails because the device is gone
/// (deleted from outside kvpn, `ip link del`) ends the worker as failed
/// ([`TunDevice::deleted`]) and drops its data connection: a re-dial could never
/// carry traffic again (every queue of the device is detached for good), and the
/// device is not recreated, since its addresses, routes, rp_filter and
/// classifier went with it and only a new Connect sets all of them up. Whether
/// the device is gone is asked only then, never per packet.
#[allow(
    clippy::too_many_arguments,
    reason = "the supervisor's whole state, moved into one task once per session"
)]
async fn supervise(
    tun: Arc<AsyncDevice>,
    device: TunDevice,
    first: Option<DataStream>,
    target: String,
    peer: DataPeer,
    hello: Vec<u8>,
    tls: Option<TlsClient>,
    shared: Arc<Shared>,
    index: usize,
    mut stop_rx: watch::Receiver<bool>,
) {
    let Some(worker) = shared.workers.get(index) else {
        tracing::error!(index, "internal error: no such worker");
        return;
    };
    let refusal = &shared.refusal;
    let mut next = first;
    let mut backoff = REDIAL_BACKOFF.0;
    let mut refuser = Refuser(None);
    // Workers 1.. dial their first connection in this loop: not a re-dial.
    let mut ever_connected = next.is_some();
    let set_down = |reason: String| {
        worker
            .liveness
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .handle_transport_down(reason);
    };
    // Only after a TUN read or write failed: is the device gone? Then the
    // worker fails for good (its data connection is dropped on return).
    let failed = |error: &std::io::Error| match device.deleted(error) {
        Some(reason) => {
            tracing::error!(%reason, tun = %device.name, "TUN device deleted from outside kvpn: worker failed, its data connection closed and not dialled again");
            worker
                .liveness
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .handle_failed(reason);
            true
        }
        None => false,
    };
    loop {
        let stream = match next.take() {
            Some(s) => s,
            None => {
                // Workers 1.. start here, without a connection: their TUN
                // queue is answered until the first dial succeeds.
                refuser.start(&tun, worker, refusal);
                let dial = dial_and_hello(&target, peer, &hello, tls.as_ref());
                let Some(dialled) = watching(dial, &mut stop_rx, &mut refuser, &failed).await
                else {
                    return;
                };
                match dialled {
                    Ok(s) => {
                        if ever_connected {
                            tracing::info!(manager = %target, "data connection re-established");
                        } else {
                            tracing::info!(manager = %target, "data connection established");
                        }
                        s
                    }
                    Err(reason) => {
                        tracing::warn!(%reason, retry_in_ms = backoff.as_millis(), "re-dial failed");
                        set_down(reason);
                        let pause = tokio::time::sleep(backoff);
                        if watching(pause, &mut stop_rx, &mut refuser, &failed)
                            .await
                            .is_none()
                        {
                            return;
                        }
                        backoff = (backoff * 2).min(REDIAL_BACKOFF.1);
                        continue;
                    }
                }
            }
        };
        refuser.stop().await;
        ever_connected = true;
        worker
            .liveness
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .handle_transport_up(Instant::now());
        let pump = pump_on(stream, tun.clone(), worker, index, refusal, stop_rx.clone());
        tokio::pin!(pump);
        let exit = tokio::select! {
            _ = stop_rx.changed() => {
                // The pump's writer tells the manager this worker is leaving
                // (so it does not park the engine for a resume); give it a
                // moment to.
                let _ = tokio::time::timeout(LEAVING_WAIT, &mut pump).await;
                return;
            }
            exit = &mut pump => exit,
        };
        if let pump::PumpExit::Tun(e) = &exit
            && failed(e)
        {
            return;
        }
        let proven = matches!(exit, pump::PumpExit::Silent(_))
            || worker
                .liveness
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .state(Instant::now())
                .0
                == State::Connected;
        let reason = peer.loss_reason(&target, &exit);
        set_down(reason.clone());
        Counters::add(&worker.counters.transports_lost, 1);
        // A connection that went silent (a black hole, tr-10) is not worth
        // holding packets for: its re-dial most likely waits out a timeout.
        if !matches!(exit, pump::PumpExit::Silent(_)) {
            worker.redial.transport_lost(Instant::now());
        }
        refuser.start(&tun, worker, refusal);
        if proven {
            tracing::warn!(%reason, "transport lost, re-dialling");
            backoff = REDIAL_BACKOFF.0;
        } else {
            tracing::warn!(
                %reason,
                retry_in_ms = backoff.as_millis(),
                "transport ended before the traffic manager answered; re-dialling after a pause"
            );
            let pause = tokio::time::sleep(backoff);
            if watching(pause, &mut stop_rx, &mut refuser, &failed)
                .await
                .is_none()
            {
                return;
            }
            backoff = (backoff * 2).min(REDIAL_BACKOFF.1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The port a listener had a moment ago: nothing listens there now.
    fn closed_loopback_port() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        drop(listener);
        addr.to_string()
    }

    /// After the user daemon is SIGKILLed, nothing listens on its loopback
    /// port-forward port: the re-dial error names the user daemon and how to
    /// bring it back, not the traffic manager.
    #[tokio::test]
    async fn redial_of_a_dead_user_daemon_names_the_user_daemon() {
        let target = closed_loopback_port();
        let err = dial_peer(&target, DataPeer::UserDaemon, DIAL_TIMEOUT)
            .await
            .expect_err("nothing listens there");
        assert!(err.contains("user daemon's listener at"), "{err}");
        assert!(err.contains(&target), "{err}");
        assert!(err.contains("connection refused"), "{err}");
        assert!(err.contains("kvpn status"), "{err}");
        assert!(
            !err.contains("traffic manager") && !err.contains("kvpn-manager"),
            "{err}"
        );

        let err = dial_manager(&target, DIAL_TIMEOUT)
            .await
            .expect_err("nothing listens there");
        assert!(err.contains("cannot reach the traffic manager at"), "{err}");
    }

    /// A loopback TCP pair: (laptop end as a DataStream, manager end).
    async fn stream_pair() -> (DataStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local address");
        let (laptop, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (
            DataStream::Plain(laptop.expect("connect")),
            accepted.expect("accept").0,
        )
    }

    fn stats_frame(counters: &[(&str, u64)]) -> Vec<u8> {
        let stats = frame::Stats {
            counters: counters
                .iter()
                .map(|(n, v)| ((*n).to_owned(), *v))
                .collect(),
        };
        let mut out = Vec::new();
        frame::encode_into(Kind::Stats, &stats.encode().expect("encodes"), &mut out).expect("fits");
        out
    }

    /// The shard answer: a Stats frame with `workers` (after a packet frame,
    /// which is dropped) means yes, and the frame after it is left for the
    /// pump; a Stats frame without it (a manager older than option 3) or
    /// silence means no.
    #[tokio::test]
    async fn shard_answer_is_read_exactly_and_old_managers_mean_one_worker() {
        let (mut laptop, mut manager) = stream_pair().await;
        let mut wire = Vec::new();
        frame::encode_into(Kind::Packet, &[0x45; 20], &mut wire).expect("fits");
        wire.extend(stats_frame(&[
            (frame::stat::FLOWS, 0),
            (frame::stat::WORKERS, 2),
        ]));
        frame::encode_into(Kind::Heartbeat, &[7; 8], &mut wire).expect("fits");
        manager.write_all(&wire).await.expect("write");
        assert_eq!(
            laptop.manager_takes_shards(Duration::from_secs(2)).await,
            Ok(true)
        );
        let mut payload = Vec::new();
        assert_eq!(
            laptop.read_frame(&mut payload).await.expect("next frame"),
            Kind::Heartbeat,
            "the frame after the answer is still in the stream"
        );
        assert_eq!(payload, [7; 8]);

        let (mut laptop, mut manager) = stream_pair().await;
        manager
            .write_all(&stats_frame(&[(frame::stat::FLOWS, 0)]))
            .await
            .expect("write");
        assert_eq!(
            laptop.manager_takes_shards(Duration::from_secs(2)).await,
            Ok(false),
            "a manager without option 3 sends stats without `workers`"
        );

        let (mut laptop, _silent) = stream_pair().await;
        assert_eq!(
            laptop
                .manager_takes_shards(Duration::from_millis(100))
                .await,
            Ok(false)
        );

        let (mut laptop, manager) = stream_pair().await;
        drop(manager);
        let err = laptop
            .manager_takes_shards(Duration::from_secs(2))
            .await
            .expect_err("closed after the hello");
        assert!(err.contains("closed the data connection"), "{err}");
    }

    #[test]
    fn session_state_is_the_worst_workers() {
        let up = (State::Connected, None);
        let down = (State::Reconnecting, Some("connection reset".to_owned()));
        let dialling = (State::Connecting, Some("dialling".to_owned()));
        assert_eq!(
            combine_states(vec![down.clone()]),
            down,
            "one worker: as is"
        );
        assert_eq!(combine_states(vec![up.clone(), up.clone()]), up);
        assert_eq!(
            combine_states(vec![up.clone(), dialling.clone(), down.clone()]),
            (
                State::Reconnecting,
                Some("worker 2 of 3: connection reset".to_owned())
            )
        );
        assert_eq!(
            combine_states(vec![dialling, up.clone()]).0,
            State::Connecting
        );
        let gone = (
            State::Failed,
            Some("TUN device kvpn0 was deleted".to_owned()),
        );
        assert_eq!(
            combine_states(vec![up, down, gone]),
            (
                State::Failed,
                Some("worker 2 of 3: TUN device kvpn0 was deleted".to_owned())
            ),
            "failed wins over reconnecting"
        );
    }

    #[test]
    fn deleted_tun_reason_names_device_cause_and_fix() {
        let reason = tun_deleted_reason(
            "kvpn0",
            "s1",
            &std::io::Error::from_raw_os_error(libc::EBADFD),
        );
        assert!(!reason.contains("  "), "{reason}");
        for part in [
            "TUN device kvpn0 was deleted",
            "ip link del kvpn0",
            "File descriptor in bad state",
            "`kvpn disconnect s1`, then `kvpn connect`",
        ] {
            assert!(reason.contains(part), "{part:?} missing: {reason}");
        }
    }

    #[test]
    fn loss_through_the_user_daemon_names_its_listener() {
        let target = "127.0.0.1:40000";
        let closed = DataPeer::UserDaemon.loss_reason(target, &pump::PumpExit::TransportClosed);
        assert!(
            closed.contains("user daemon's listener at 127.0.0.1:40000"),
            "{closed}"
        );
        assert!(!closed.contains("traffic manager closed"), "{closed}");
        let reset = DataPeer::UserDaemon.loss_reason(
            target,
            &pump::PumpExit::Transport(std::io::Error::from_raw_os_error(libc::ECONNRESET)),
        );
        assert!(
            reset.contains("user daemon's listener at 127.0.0.1:40000 (its port-forward or SSH"),
            "{reset}"
        );
        let direct = DataPeer::Manager.loss_reason(target, &pump::PumpExit::TransportClosed);
        assert_eq!(direct, "the traffic manager closed the data connection");
        assert_eq!(
            DataPeer::from_transport("port-forward"),
            DataPeer::UserDaemon
        );
        assert_eq!(DataPeer::from_transport("direct"), DataPeer::Manager);
        assert_eq!(DataPeer::from_transport(""), DataPeer::Manager);
    }
}
