//! The root daemon's DNS forwarder: UDP and TCP on one address of the laptop
//! ([`super::DEFAULT_LISTEN_IP`] port 53 unless configured), answering cluster
//! names through the cluster DNS and forwarding everything else, unchanged, to the
//! laptop's own nameservers. [`super::names`] decides where a question goes,
//! [`super::message`] builds the answers; this module does the I/O.
//!
//! - Names under the cluster domain and the rest of DNS are *relayed*: the client's
//!   query bytes go out as they came (id, flags, EDNS OPT with the client's UDP size
//!   and options) over the transport the client used, and the answer comes back as
//!   it came, so EDNS, DNSSEC bits and TC pass through. A UDP answer larger than the
//!   client accepts is replaced by an empty one with TC (case dns-08).
//! - Cluster-relative spellings are expanded: each search-list expansion is asked
//!   of the cluster DNS (in parallel, gated by its anchor, [`super::names`]), and
//!   the first in search-list order that exists answers, as a CNAME from the asked
//!   name plus the cluster's records. When none exists and the cluster said
//!   NXDOMAIN for a `svc.ns` spelling (`go.dev` with a namespace `dev`), the
//!   question goes on to the laptop's upstream, whose answer stands; the
//!   cluster's NXDOMAIN is answered when the upstream refuses the name, SERVFAIL
//!   when it fails (no answer, SERVFAIL).
//! - The cluster DNS is plain UDP/TCP to its ClusterIP: the TUN device's routes
//!   carry it, with the tunnel IP as source. UDP to the cluster DNS goes over one
//!   long-lived socket per server ([`UdpMux`], queries told apart by a message id
//!   of the forwarder's choosing): a fresh socket per question would be a new UDP
//!   flow in the traffic manager each time, and a burst of questions (10,000 in a
//!   minute, measured) filled the manager's flow table (4096 flows, 60 s idle
//!   timeout), so questions were dropped. The laptop's upstreams get a fresh socket
//!   (random source port) per question, as before.
//!
//! - While a cluster's session is not connected ([`Reach`]), its names are
//!   answered SERVFAIL here, at once, with the RFC 8914 extended error 22 "No
//!   Reachable Authority" when the client sent EDNS; nothing goes into the tunnel
//!   (the root daemon answers packets toward the cluster with ICMP unreachable
//!   then, so a question would only wait out the resends and
//!   [`EXCHANGE_TIMEOUT`]). [`super::names::while_unreachable`] decides which.
//!
//! Bounds: at most [`MAX_IN_FLIGHT`] questions at once (more UDP questions are
//! dropped and counted; the client retries), [`MAX_TCP_CONNECTIONS`] TCP clients,
//! idle TCP clients closed after [`TCP_IDLE_TIMEOUT`], each exchange with a server
//! bounded by [`EXCHANGE_TIMEOUT`]. Nothing here panics on a packet: bytes that are
//! not a query are dropped or answered FORMERR.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::Name;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::message::{self, Reject};
use super::names::{self, Candidate, ClusterDns, ExistenceCache, Otherwise, Plan};
use super::port_holder;

/// Questions handled at once; beyond this UDP questions are dropped (counted).
pub const MAX_IN_FLIGHT: usize = 1024;
/// TCP clients at once; more are closed at accept.
pub const MAX_TCP_CONNECTIONS: usize = 128;
/// An idle TCP client is closed after this long (RFC 7766 suggests seconds).
pub const TCP_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// One exchange with one server (cluster or upstream). glibc's default per-try
/// timeout is 5 s; answering SERVFAIL earlier lets it try again in time.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);
/// UDP questions to the cluster DNS are sent again after these delays (from the
/// first send) while unanswered, within [`EXCHANGE_TIMEOUT`]. A burst of
/// questions (dnsperf, 100 outstanding, each name expanded up to three times)
/// lost a few datagrams in 10,000 on the way (socket buffers of the cluster
/// path), which without a second send became SERVFAIL.
const CLUSTER_UDP_RESEND: [Duration; 2] = [Duration::from_millis(300), Duration::from_millis(900)];
/// Receive buffer of a cluster DNS socket: answers to a burst arrive together.
const CLUSTER_UDP_RCVBUF: usize = 1 << 20;
/// Anchors remembered (see [`names::ExistenceCache`]).
const ANCHOR_CACHE_SIZE: usize = 4096;

/// Errors starting the forwarder.
#[derive(Debug, thiserror::Error)]
pub enum ForwarderError {
    /// The listen address is taken or not local.
    #[error("cannot listen for DNS on {addr} ({proto}): {source} — {hint}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// "udp" or "tcp".
        proto: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
        /// Why and what to do: for a port in use, the process that holds it
        /// ([`super::port_holder`]).
        hint: String,
    },
    /// The socket filter that keeps callers without the run's mark out could
    /// not be attached.
    #[error(
        "cannot restrict the DNS forwarder on {addr} to packets with mark {mark:#x} \
         (SO_ATTACH_FILTER): {source} — the kernel needs CONFIG_BPF (socket filters)"
    )]
    Filter {
        /// The address.
        addr: SocketAddr,
        /// The mark its callers' packets must carry.
        mark: u32,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl ForwarderError {
    fn bind(addr: SocketAddr, proto: port_holder::Proto, source: std::io::Error) -> Self {
        const FIX: &str = "stop it, or set KVPN_DNS_IP to a free loopback address";
        let hint = match source.kind() {
            std::io::ErrorKind::AddrInUse => port_holder::describe(addr, proto, FIX),
            std::io::ErrorKind::AddrNotAvailable => format!(
                "{} is no address of this laptop — set KVPN_DNS_IP to a loopback address such as {}",
                addr.ip(),
                super::DEFAULT_LISTEN_IP
            ),
            std::io::ErrorKind::PermissionDenied => format!(
                "port {} needs root or CAP_NET_BIND_SERVICE — run the root daemon as root",
                addr.port()
            ),
            _ => "set KVPN_DNS_IP to a free loopback address".to_owned(),
        };
        ForwarderError::Bind {
            addr,
            proto: match proto {
                port_holder::Proto::Udp => "udp",
                port_holder::Proto::Tcp => "tcp",
            },
            source,
            hint,
        }
    }
}

/// Counters of the forwarder (monotonic).
#[derive(Debug, Default)]
pub struct Counters {
    /// Queries received over UDP.
    pub udp_queries: AtomicU64,
    /// Queries received over TCP.
    pub tcp_queries: AtomicU64,
    /// Relayed to the cluster DNS unchanged.
    pub cluster: AtomicU64,
    /// Answered from a search-list expansion.
    pub expanded: AtomicU64,
    /// Relayed to the laptop's upstream nameservers.
    pub upstream: AtomicU64,
    /// NXDOMAIN answered here: a single label that exists nowhere in the
    /// cluster, a missing `….svc` name, or a `svc.ns` name the cluster denied
    /// and the laptop's upstream gave no answer for.
    pub local_nxdomain: AtomicU64,
    /// AAAA answered NOERROR/empty for an IPv4-only cluster.
    pub empty_aaaa: AtomicU64,
    /// FORMERR/NOTIMP answers, and dropped non-queries.
    pub malformed: AtomicU64,
    /// UDP answers cut to TC.
    pub truncated: AtomicU64,
    /// SERVFAIL answers (no server answered, or the cluster's session is not
    /// connected).
    pub servfail: AtomicU64,
    /// SERVFAIL answered at once because the cluster's session was not connected
    /// (also counted in `servfail`).
    pub unreachable: AtomicU64,
    /// UDP questions dropped because [`MAX_IN_FLIGHT`] were in flight.
    pub dropped: AtomicU64,
}

/// A copy of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// See [`Counters`].
    pub udp_queries: u64,
    /// See [`Counters`].
    pub tcp_queries: u64,
    /// See [`Counters`].
    pub cluster: u64,
    /// See [`Counters`].
    pub expanded: u64,
    /// See [`Counters`].
    pub upstream: u64,
    /// See [`Counters`].
    pub local_nxdomain: u64,
    /// See [`Counters`].
    pub empty_aaaa: u64,
    /// See [`Counters`].
    pub malformed: u64,
    /// See [`Counters`].
    pub truncated: u64,
    /// See [`Counters`].
    pub servfail: u64,
    /// See [`Counters`].
    pub unreachable: u64,
    /// See [`Counters`].
    pub dropped: u64,
    /// UDP sockets to the cluster DNS opened again because the route's source
    /// address changed since they were opened ([`route_source`]).
    pub cluster_socket_reopened: u64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Counters {
    /// A copy of the current values.
    pub fn snapshot(&self) -> CounterSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            udp_queries: g(&self.udp_queries),
            tcp_queries: g(&self.tcp_queries),
            cluster: g(&self.cluster),
            expanded: g(&self.expanded),
            upstream: g(&self.upstream),
            local_nxdomain: g(&self.local_nxdomain),
            empty_aaaa: g(&self.empty_aaaa),
            malformed: g(&self.malformed),
            truncated: g(&self.truncated),
            servfail: g(&self.servfail),
            unreachable: g(&self.unreachable),
            dropped: g(&self.dropped),
            cluster_socket_reopened: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

/// Whether a session's data channel to its cluster is connected, asked once per
/// question that would go to that cluster. The root daemon's sessions answer
/// from their liveness state (the same test the pump uses to answer packets with
/// ICMP unreachable), so DNS and TCP fail fast from the same instant, with no
/// task or timer in between.
#[derive(Clone)]
pub struct Reach(Arc<dyn Fn() -> bool + Send + Sync>);

impl Reach {
    /// Connected whenever `connected` says so.
    pub fn new(connected: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Reach(Arc::new(connected))
    }

    /// Always connected (sessions without liveness, tests).
    pub fn always() -> Self {
        Reach::new(|| true)
    }

    /// Whether the cluster can be reached now.
    pub fn connected(&self) -> bool {
        (self.0)()
    }
}

impl std::fmt::Debug for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Reach").field(&self.connected()).finish()
    }
}

/// The text of the extended DNS error in answers for a cluster whose session is
/// not connected.
pub const UNREACHABLE_TEXT: &str =
    "kvpn: the session to this cluster is reconnecting; the cluster DNS was not asked";

struct Shared {
    /// Most recent session first, each with whether its cluster is reachable.
    clusters: RwLock<Vec<(ClusterDns, Reach)>>,
    upstreams: RwLock<Vec<SocketAddr>>,
    anchors: Mutex<ExistenceCache>,
    counters: Counters,
    in_flight: Arc<Semaphore>,
    cluster_udp: UdpMux,
    /// SO_MARK of every socket towards a DNS server (a `kvpn run` session's
    /// forwarder: its routes live in a table only that mark reaches).
    mark: Option<u32>,
}

/// One connected UDP socket to one server, with the questions waiting on it.
struct MuxSocket {
    socket: UdpSocket,
    /// The source address the kernel gave it at `connect` (fixed from then on).
    source: IpAddr,
    /// Its reader task.
    reader: Mutex<Option<JoinHandle<()>>>,
    /// Our message id → the original id and who waits.
    pending: Mutex<std::collections::HashMap<u16, oneshot::Sender<Vec<u8>>>>,
}

/// UDP exchanges with the cluster DNS servers over one long-lived socket each
/// (see the module header). The id of each query is replaced by the next free
/// one of a sequence with a random start, and the client's id is put back into
/// the answer. Sequential ids keep an id from coming back for 65,536 questions,
/// so a late duplicate answer (to a resent question) never meets a newer
/// question with the same id; guessing them needs a place on the cluster path,
/// inside the authenticated tunnel.
///
/// A connected UDP socket keeps the source address the routes gave it at
/// `connect`, also after the routes change (issue 29 item 1: with
/// `--allow-route-conflict` the first question went out before the cluster
/// DNS's /32 through the TUN device existed, the socket kept the laptop's LAN
/// address, and the manager dropped every later question as a bad source for
/// the whole session). So before each question the source the routes give
/// *now* is looked up ([`route_source`]: a throwaway socket's `connect`, no
/// packet sent) and a socket whose source differs is replaced
/// ([`reopen_needed`]); questions in flight on the old one may still be
/// answered there until [`EXCHANGE_TIMEOUT`].
struct UdpMux {
    /// SO_MARK of its sockets ([`Shared::mark`]).
    mark: Option<u32>,
    sockets: Mutex<std::collections::HashMap<SocketAddr, Arc<MuxSocket>>>,
    next_id: std::sync::atomic::AtomicU16,
    /// Sockets replaced because the route's source changed.
    reopened: AtomicU64,
    /// Readers of replaced sockets, ended [`EXCHANGE_TIMEOUT`] after (or at stop).
    retired: Mutex<Vec<JoinHandle<()>>>,
}

impl UdpMux {
    fn marked(mark: Option<u32>) -> Self {
        UdpMux {
            mark,
            sockets: Mutex::default(),
            next_id: std::sync::atomic::AtomicU16::new(random_u16()),
            reopened: AtomicU64::new(0),
            retired: Mutex::default(),
        }
    }
}

impl Drop for UdpMux {
    fn drop(&mut self) {
        for r in self.take_readers() {
            r.abort();
        }
    }
}

/// The source address the laptop's routes give a datagram to `server` now:
/// `connect` of a throwaway UDP socket (a route lookup, nothing is sent).
/// `None` when there is no route.
pub fn route_source(server: SocketAddr) -> Option<IpAddr> {
    route_source_marked(server, None)
}

/// [`route_source`] for a socket with SO_MARK `mark`.
fn route_source_marked(server: SocketAddr, mark: Option<u32>) -> Option<IpAddr> {
    let probe = std::net::UdpSocket::bind(unspecified_for(server)).ok()?;
    set_mark(&probe, mark).ok()?;
    probe.connect(server).ok()?;
    Some(probe.local_addr().ok()?.ip())
}

/// Whether a socket connected with source `bound` must be replaced, the
/// routes giving `now` (pure). Without a route now, the old socket stays: a
/// new one could not be connected either.
pub fn reopen_needed(bound: IpAddr, now: Option<IpAddr>) -> bool {
    now.is_some_and(|now| now != bound)
}

/// SO_MARK `mark` on `socket` (nothing for `None`).
fn set_mark(socket: &impl std::os::fd::AsFd, mark: Option<u32>) -> std::io::Result<()> {
    if let Some(mark) = mark {
        nix::sys::socket::setsockopt(socket, nix::sys::socket::sockopt::Mark, &mark)
            .map_err(std::io::Error::from)?;
    }
    Ok(())
}

fn random_u16() -> u16 {
    use std::hash::{BuildHasher as _, Hasher as _};
    // RandomState is seeded from the OS once per process and stepped per instance.
    let mut h = std::hash::RandomState::new().build_hasher();
    h.write_u8(0);
    (h.finish() >> 48) as u16
}

impl UdpMux {
    /// Every reader task, current and retired (at stop), leaving none behind.
    fn take_readers(&self) -> Vec<JoinHandle<()>> {
        let mut all =
            std::mem::take(&mut *self.retired.lock().unwrap_or_else(PoisonError::into_inner));
        for s in self
            .sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            all.extend(
                s.reader
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(),
            );
        }
        all
    }

    async fn socket(&self, server: SocketAddr) -> std::io::Result<Arc<MuxSocket>> {
        let cached = self
            .sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&server)
            .cloned();
        if let Some(s) = cached {
            let now = route_source_marked(server, self.mark);
            if !reopen_needed(s.source, now) {
                return Ok(s);
            }
            tracing::warn!(
                %server,
                old_source = %s.source,
                new_source = ?now,
                "the route to the cluster DNS changed since its socket was opened (a route \
                 through the TUN device added after the first question, e.g. a ClusterIP \
                 pinned with --allow-route-conflict); the old source would be refused by \
                 the manager, so the socket is opened again"
            );
            self.reopened.fetch_add(1, Ordering::Relaxed);
            let mut sockets = self.sockets.lock().unwrap_or_else(PoisonError::into_inner);
            if sockets.get(&server).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                sockets.remove(&server);
            }
            drop(sockets);
            // Answers to questions already sent may still come on the old one.
            if let Some(reader) = s
                .reader
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
            {
                let abort = reader.abort_handle();
                let mut retired = self.retired.lock().unwrap_or_else(PoisonError::into_inner);
                retired.retain(|r| !r.is_finished());
                retired.push(reader);
                drop(retired);
                tokio::spawn(async move {
                    tokio::time::sleep(EXCHANGE_TIMEOUT).await;
                    abort.abort();
                });
            }
        }
        let socket = UdpSocket::bind(unspecified_for(server)).await?;
        set_mark(&socket, self.mark)?;
        socket.connect(server).await?;
        let source = socket.local_addr()?.ip();
        if let Err(e) = nix::sys::socket::setsockopt(
            &socket,
            nix::sys::socket::sockopt::RcvBuf,
            &CLUSTER_UDP_RCVBUF,
        ) {
            tracing::debug!(error = %e, "cannot enlarge the cluster DNS socket's receive buffer");
        }
        let mux = Arc::new(MuxSocket {
            socket,
            source,
            reader: Mutex::new(None),
            pending: Mutex::new(std::collections::HashMap::new()),
        });
        let mut sockets = self.sockets.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = sockets.get(&server) {
            // Another question made one meanwhile; ours goes unused.
            return Ok(s.clone());
        }
        sockets.insert(server, mux.clone());
        drop(sockets);
        // The task holds the socket; it is aborted (closing the socket) when the
        // mux is dropped, or EXCHANGE_TIMEOUT after the socket was replaced.
        let reader = mux.clone();
        *mux.reader.lock().unwrap_or_else(PoisonError::into_inner) = Some(tokio::spawn(
            async move {
                let mut buf = vec![0u8; 65535];
                loop {
                    let n = match reader.socket.recv(&mut buf).await {
                        Ok(n) => n,
                        Err(e) => {
                            // ICMP errors of earlier sends (port unreachable) land
                            // here; the questions time out on their own.
                            tracing::debug!(%server, error = %e, "cluster DNS socket receive error");
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                    };
                    let Some(id) = message::message_id(&buf[..n]) else {
                        continue;
                    };
                    let waiter = reader
                        .pending
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&id);
                    if let Some(tx) = waiter {
                        let _ = tx.send(buf[..n].to_vec());
                    }
                }
            },
        ));
        Ok(mux)
    }

    /// One UDP exchange with `server`; the answer carries `raw`'s id.
    async fn exchange(&self, server: SocketAddr, raw: &[u8]) -> std::io::Result<Vec<u8>> {
        if raw.len() < 2 {
            return Err(std::io::Error::other("query too short"));
        }
        let mux = self.socket(server).await?;
        let (tx, rx) = oneshot::channel();
        let ours = {
            let mut pending = mux.pending.lock().unwrap_or_else(PoisonError::into_inner);
            // At most MAX_IN_FLIGHT questions (times their expansions) wait: a free
            // id is found within a few steps.
            let mut id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let mut steps = 0;
            while pending.contains_key(&id) {
                id = self.next_id.fetch_add(1, Ordering::Relaxed);
                steps += 1;
                if steps > 4096 {
                    return Err(std::io::Error::other("no free DNS message id"));
                }
            }
            pending.insert(id, tx);
            id
        };
        let mut query = raw.to_vec();
        query[..2].copy_from_slice(&ours.to_be_bytes());
        let send = || async {
            match mux.socket.send(&query).await {
                // An ICMP error of an earlier datagram surfaces on the next send
                // of a connected socket; this datagram was not sent yet.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    mux.socket.send(&query).await
                }
                other => other,
            }
        };
        let result = async {
            let start = tokio::time::Instant::now();
            send().await?;
            let mut rx = rx;
            for delay in CLUSTER_UDP_RESEND {
                match tokio::time::timeout_at(start + delay, &mut rx).await {
                    Ok(answer) => {
                        return answer
                            .map_err(|_| std::io::Error::other("cluster DNS socket closed"));
                    }
                    Err(_) => {
                        tracing::trace!(%server, "no answer from the cluster DNS yet; sending again");
                        send().await?;
                    }
                }
            }
            rx.await
                .map_err(|_| std::io::Error::other("cluster DNS socket closed"))
        };
        let result = tokio::time::timeout(EXCHANGE_TIMEOUT, result).await;
        mux.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ours);
        let mut answer = result.map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time")
        })??;
        if answer.len() >= 2 {
            answer[..2].copy_from_slice(&raw[..2]);
        }
        Ok(answer)
    }
}

/// A running forwarder. [`Forwarder::stop`] ends it; dropping it aborts its tasks.
pub struct Forwarder {
    shared: Arc<Shared>,
    local: SocketAddr,
    stop_tx: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Forwarder {
    /// Listen on `listen` (UDP and TCP; port 0 picks one, the same for both) and
    /// forward non-cluster names to `upstreams`.
    pub async fn start(
        listen: SocketAddr,
        upstreams: Vec<SocketAddr>,
    ) -> Result<Forwarder, ForwarderError> {
        Self::start_marked(listen, upstreams, None).await
    }

    /// [`Forwarder::start`] for a `kvpn run` session whose sockets carry fwmark
    /// `mark`: its own sockets towards DNS servers carry SO_MARK `mark` (the
    /// run's cluster routes are in a table only that mark reaches), and it takes
    /// questions only in packets that carry `mark` ([`attach_mark_filter`]), so
    /// only the run's processes (whose sockets the run's eBPF program marks)
    /// can use it; anyone else's question is dropped unanswered.
    pub async fn start_marked(
        listen: SocketAddr,
        upstreams: Vec<SocketAddr>,
        mark: Option<u32>,
    ) -> Result<Forwarder, ForwarderError> {
        // UDP and TCP on the same port. With port 0 (tests) the kernel picks the
        // UDP port, and that TCP port may be taken (e.g. as the local port of some
        // connection): pick again a few times.
        let mut tries = if listen.port() == 0 { 16 } else { 1 };
        let (udp, local, tcp) = loop {
            tries -= 1;
            let udp = UdpSocket::bind(listen)
                .await
                .map_err(|e| ForwarderError::bind(listen, port_holder::Proto::Udp, e))?;
            let local = udp
                .local_addr()
                .map_err(|e| ForwarderError::bind(listen, port_holder::Proto::Udp, e))?;
            match TcpListener::bind(local).await {
                Ok(tcp) => {
                    if let Some(mark) = mark {
                        for fd in [udp.as_fd(), tcp.as_fd()] {
                            attach_mark_filter(fd, mark).map_err(|source| {
                                ForwarderError::Filter {
                                    addr: local,
                                    mark,
                                    source,
                                }
                            })?;
                        }
                    }
                    break (udp, local, tcp);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries > 0 => {}
                Err(e) => return Err(ForwarderError::bind(local, port_holder::Proto::Tcp, e)),
            }
        };
        let shared = Arc::new(Shared {
            clusters: RwLock::new(Vec::new()),
            upstreams: RwLock::new(upstreams),
            anchors: Mutex::new(ExistenceCache::new(ANCHOR_CACHE_SIZE)),
            counters: Counters::default(),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            cluster_udp: UdpMux::marked(mark),
            mark,
        });
        let (stop_tx, stop_rx) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(serve_udp(Arc::new(udp), shared.clone(), stop_rx.clone())),
            tokio::spawn(serve_tcp(tcp, shared.clone(), stop_rx)),
        ];
        tracing::info!(%local, upstreams = ?shared.upstreams.read().unwrap_or_else(PoisonError::into_inner), "DNS forwarder listening");
        Ok(Forwarder {
            shared,
            local,
            stop_tx,
            tasks,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The clusters whose names it answers, most recent session first, each with
    /// whether its session is connected: questions for a cluster that is not are
    /// answered SERVFAIL at once ([`names::while_unreachable`]).
    pub fn set_clusters(&self, clusters: Vec<(ClusterDns, Reach)>) {
        *self
            .shared
            .clusters
            .write()
            .unwrap_or_else(PoisonError::into_inner) = clusters;
    }

    /// The laptop's own nameservers.
    pub fn set_upstreams(&self, upstreams: Vec<SocketAddr>) {
        *self
            .shared
            .upstreams
            .write()
            .unwrap_or_else(PoisonError::into_inner) = upstreams;
    }

    /// The laptop's nameservers it forwards other names to.
    pub fn upstreams(&self) -> Vec<SocketAddr> {
        self.shared
            .upstreams
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Its counters.
    pub fn counters(&self) -> CounterSnapshot {
        CounterSnapshot {
            cluster_socket_reopened: self.shared.cluster_udp.reopened.load(Ordering::Relaxed),
            ..self.shared.counters.snapshot()
        }
    }

    /// Stop listening; questions in flight are abandoned. When this returns,
    /// every socket of the forwarder is closed, the listening ones included, so
    /// a new forwarder can bind the same address at once (issue 29 item 4: a
    /// question still in flight kept the UDP socket open for seconds, and the
    /// next `kvpn connect` failed with "Address already in use").
    pub async fn stop(mut self) {
        let _ = self.stop_tx.send(true);
        for mut t in self.tasks.drain(..) {
            // The listeners end their questions' tasks before they return.
            if tokio::time::timeout(Duration::from_secs(1), &mut t)
                .await
                .is_err()
            {
                tracing::debug!("DNS listener did not stop within 1 s; aborting it");
                t.abort();
                // Returns once the task is dropped, with its sockets.
                let _ = t.await;
            }
        }
        for r in self.shared.cluster_udp.take_readers() {
            r.abort();
            let _ = r.await;
        }
        self.shared
            .cluster_udp
            .sockets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        tracing::info!(local = %self.local, counters = ?self.counters(), "DNS forwarder stopped");
    }
}

/// Attach a classic BPF socket filter to `fd` that keeps only packets whose
/// skb mark is `mark` and drops the rest (`SO_ATTACH_FILTER`,
/// Documentation/networking/filter.rst; `SKF_AD_MARK` loads `skb->mark`).
///
/// Why the mark: a `kvpn run` session's eBPF `sock_create` program sets `mark`
/// on every socket its processes make, a local packet keeps its socket's mark
/// across the loopback device, and only a process with CAP_NET_ADMIN or
/// CAP_NET_RAW can give its own socket a mark (SO_MARK). UDP has no peer
/// credentials to check, and TCP's SO_PEERCRED is for Unix sockets only; a
/// filter works for both: on a UDP socket each datagram is checked, on a TCP
/// listener the SYN and every segment of an accepted connection (accepted
/// sockets inherit it), so an unmarked caller's TCP handshake never completes.
pub fn attach_mark_filter(fd: std::os::fd::BorrowedFd<'_>, mark: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    // linux/filter.h and linux/bpf_common.h.
    // BPF_LD (0x00) | BPF_W (0x00) | BPF_ABS (0x20).
    const BPF_LD_W_ABS: u16 = 0x20;
    // BPF_JMP (0x05) | BPF_JEQ (0x10) | BPF_K (0x00).
    const BPF_JMP_JEQ_K: u16 = 0x15;
    // BPF_RET (0x06) | BPF_K (0x00).
    const BPF_RET_K: u16 = 0x06;
    // SKF_AD_OFF (-0x1000) + SKF_AD_MARK (20), as the u32 the load takes.
    const LOAD_MARK: u32 = (libc::SKF_AD_OFF + libc::SKF_AD_MARK) as u32;
    let program = [
        libc::sock_filter {
            code: BPF_LD_W_ABS,
            jt: 0,
            jf: 0,
            k: LOAD_MARK,
        },
        // Equal: go on to the next instruction (keep); else skip it (drop).
        libc::sock_filter {
            code: BPF_JMP_JEQ_K,
            jt: 0,
            jf: 1,
            k: mark,
        },
        libc::sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: u32::MAX,
        },
        libc::sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: 0,
        },
    ];
    let fprog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr().cast_mut(),
    };
    // SAFETY: `fprog` points at `program`, both alive for the call; the kernel
    // copies the program.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&raw const fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

async fn serve_udp(
    socket: Arc<UdpSocket>,
    shared: Arc<Shared>,
    mut stop_rx: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 65535];
    // The questions in flight hold the socket (to answer on it): they end
    // with the listener, so the socket is closed when this returns.
    let mut questions = JoinSet::new();
    loop {
        let (n, src) = tokio::select! {
            _ = stop_rx.changed() => break,
            Some(_) = questions.join_next(), if !questions.is_empty() => continue,
            r = socket.recv_from(&mut buf) => match r {
                Ok(x) => x,
                Err(e) => {
                    // ICMP errors from earlier sends surface here; keep serving.
                    tracing::debug!(error = %e, "DNS UDP receive error");
                    continue;
                }
            },
        };
        bump(&shared.counters.udp_queries);
        let Ok(permit) = shared.in_flight.clone().try_acquire_owned() else {
            bump(&shared.counters.dropped);
            continue;
        };
        let raw = buf[..n].to_vec();
        let (socket, shared) = (socket.clone(), shared.clone());
        questions.spawn(async move {
            let _permit = permit;
            if let Some(answer) = handle(&shared, &raw, Transport::Udp).await
                && let Err(e) = socket.send_to(&answer, src).await
            {
                tracing::debug!(%src, error = %e, "cannot send DNS answer");
            }
        });
    }
    // Aborts them and waits until each is dropped.
    questions.shutdown().await;
}

async fn serve_tcp(listener: TcpListener, shared: Arc<Shared>, mut stop_rx: watch::Receiver<bool>) {
    let connections = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
    // Each client's connection ends with the listener (see serve_udp).
    let mut clients = JoinSet::new();
    loop {
        let (stream, src) = tokio::select! {
            _ = stop_rx.changed() => break,
            Some(_) = clients.join_next(), if !clients.is_empty() => continue,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "DNS TCP accept error");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::debug!(%src, "too many DNS TCP clients; closing");
            continue;
        };
        let shared = shared.clone();
        let stop_rx = stop_rx.clone();
        clients.spawn(async move {
            let _permit = permit;
            serve_tcp_client(stream, &shared, stop_rx).await;
        });
    }
    drop(listener);
    clients.shutdown().await;
}

/// RFC 1035 §4.2.2 / RFC 7766: two-byte length, then the message; several queries
/// per connection, answered in order.
async fn serve_tcp_client(
    mut stream: TcpStream,
    shared: &Shared,
    mut stop_rx: watch::Receiver<bool>,
) {
    loop {
        let mut len = [0u8; 2];
        let read = async {
            stream.read_exact(&mut len).await?;
            let mut raw = vec![0u8; usize::from(u16::from_be_bytes(len))];
            stream.read_exact(&mut raw).await?;
            Ok::<_, std::io::Error>(raw)
        };
        let raw = tokio::select! {
            _ = stop_rx.changed() => return,
            r = tokio::time::timeout(TCP_IDLE_TIMEOUT, read) => match r {
                Ok(Ok(raw)) => raw,
                _ => return,
            },
        };
        bump(&shared.counters.tcp_queries);
        let Some(answer) = handle(shared, &raw, Transport::Tcp).await else {
            continue;
        };
        let Ok(n) = u16::try_from(answer.len()) else {
            tracing::debug!(bytes = answer.len(), "DNS answer too large for TCP framing");
            return;
        };
        let mut out = Vec::with_capacity(answer.len() + 2);
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&answer);
        if stream.write_all(&out).await.is_err() {
            return;
        }
    }
}

fn encode(shared: &Shared, msg: &Message, limit: Option<usize>) -> Option<Vec<u8>> {
    match message::encode_fitting(msg, limit) {
        Ok((bytes, truncated)) => {
            if truncated {
                bump(&shared.counters.truncated);
            }
            Some(bytes)
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot encode a DNS answer");
            None
        }
    }
}

/// Answer one query (raw bytes); `None` = say nothing.
async fn handle(shared: &Shared, raw: &[u8], transport: Transport) -> Option<Vec<u8>> {
    let query = match message::decode_query(raw) {
        Ok(q) => q,
        Err(Reject::Drop) => {
            bump(&shared.counters.malformed);
            return None;
        }
        Err(Reject::Respond(bytes)) => {
            bump(&shared.counters.malformed);
            return Some(bytes);
        }
    };
    let limit = match transport {
        Transport::Udp => Some(message::udp_limit(&query)),
        Transport::Tcp => None,
    };
    let question = query.queries.first()?.clone();
    let clusters = shared
        .clusters
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let planned =
        names::classify_all(&question, clusters.iter().map(|(c, _)| c)).map(|(plan, cluster)| {
            let connected = clusters
                .iter()
                .find(|(c, _)| std::ptr::eq(c, cluster))
                .is_none_or(|(_, reach)| reach.connected());
            if connected {
                (plan, cluster)
            } else {
                let anchors = shared
                    .anchors
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                (
                    names::while_unreachable(plan, cluster, |a| anchors.last_known(a)),
                    cluster,
                )
            }
        });
    tracing::trace!(name = %question.name(), qtype = %question.query_type(), plan = ?planned.as_ref().map(|p| &p.0), "DNS question");
    match planned {
        Some((Plan::Unreachable, _)) => {
            bump(&shared.counters.servfail);
            bump(&shared.counters.unreachable);
            encode(
                shared,
                &message::servfail_with_ede(
                    &query,
                    message::EDE_NO_REACHABLE_AUTHORITY,
                    UNREACHABLE_TEXT,
                ),
                limit,
            )
        }
        None | Some((Plan::Upstream, _)) => upstream(shared, raw, &query, transport, limit).await,
        Some((Plan::Cluster, cluster)) => {
            bump(&shared.counters.cluster);
            relay(
                shared,
                &cluster.servers,
                raw,
                &query,
                transport,
                limit,
                true,
            )
            .await
        }
        Some((Plan::EmptyAaaa, _)) => {
            bump(&shared.counters.empty_aaaa);
            encode(
                shared,
                &message::local_answer(&query, ResponseCode::NoError),
                limit,
            )
        }
        Some((
            Plan::Search {
                candidates,
                otherwise,
            },
            cluster,
        )) => {
            let cluster = cluster.clone();
            match search(shared, &cluster, &query, &candidates, transport).await {
                Found::Answer(expanded, answer) => {
                    bump(&shared.counters.expanded);
                    encode(
                        shared,
                        &message::expanded_answer(&query, &expanded, &answer),
                        limit,
                    )
                }
                Found::Failed => {
                    bump(&shared.counters.servfail);
                    encode(
                        shared,
                        &message::local_answer(&query, ResponseCode::ServFail),
                        limit,
                    )
                }
                // The cluster says a `….svc` expansion does not exist while its
                // anchor `svc.<domain>` does: a cluster name that does not exist,
                // NXDOMAIN — never the laptop's upstream, which would leak it
                // and, silent, turn it into SERVFAIL.
                Found::Nothing {
                    in_cluster_zone: true,
                    ..
                } => {
                    bump(&shared.counters.local_nxdomain);
                    encode(
                        shared,
                        &message::local_answer(&query, ResponseCode::NXDomain),
                        limit,
                    )
                }
                Found::Nothing {
                    in_cluster_zone: false,
                    cluster_nxdomain,
                } => match otherwise {
                    Otherwise::NxDomain => {
                        bump(&shared.counters.local_nxdomain);
                        encode(
                            shared,
                            &message::local_answer(&query, ResponseCode::NXDomain),
                            limit,
                        )
                    }
                    // The cluster said NXDOMAIN for the `svc.ns` form (`go.dev`
                    // with a namespace `dev`): the laptop's resolvers decide.
                    Otherwise::Upstream if cluster_nxdomain => {
                        upstream_after_cluster_nxdomain(shared, raw, &query, transport, limit).await
                    }
                    Otherwise::Upstream => upstream(shared, raw, &query, transport, limit).await,
                },
            }
        }
    }
}

/// The laptop's upstream nameservers as they are now (a resolv.conf rewrite
/// replaces them while connected).
fn upstream_servers(shared: &Shared) -> Vec<SocketAddr> {
    shared
        .upstreams
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

async fn upstream(
    shared: &Shared,
    raw: &[u8],
    query: &Message,
    transport: Transport,
    limit: Option<usize>,
) -> Option<Vec<u8>> {
    bump(&shared.counters.upstream);
    let servers = upstream_servers(shared);
    relay(shared, &servers, raw, query, transport, limit, false).await
}

/// A name the cluster said NXDOMAIN for in its `svc.ns` form goes to the
/// laptop's upstream nameservers (issue 29 item 2: a public `go.dev` with a
/// namespace `dev`), whose answer stands when they give one (NOERROR or
/// NXDOMAIN). When they refuse it (REFUSED: a resolver that only serves its own
/// zones), the cluster's NXDOMAIN is the only word anyone said about the name
/// and the client gets it. When they fail (no answer, SERVFAIL: the laptop's
/// resolver is down), the client gets SERVFAIL: a cacheable NXDOMAIN would cost
/// a public name its answer until the resolver is back.
async fn upstream_after_cluster_nxdomain(
    shared: &Shared,
    raw: &[u8],
    query: &Message,
    transport: Transport,
    limit: Option<usize>,
) -> Option<Vec<u8>> {
    bump(&shared.counters.upstream);
    let servers = upstream_servers(shared);
    let answer = first_answer(shared, &servers, raw, transport, false).await;
    match answer {
        Some(answer)
            if !matches!(
                message::response_code(&answer),
                Some(ResponseCode::ServFail | ResponseCode::Refused) | None
            ) =>
        {
            sized(shared, answer, query, limit)
        }
        Some(answer) if message::response_code(&answer) == Some(ResponseCode::Refused) => {
            tracing::debug!(name = ?query.queries.first().map(|q| q.name().to_string()), "the laptop's upstream refused the name; the cluster's NXDOMAIN stands");
            bump(&shared.counters.local_nxdomain);
            encode(
                shared,
                &message::local_answer(query, ResponseCode::NXDomain),
                limit,
            )
        }
        _ => {
            tracing::debug!(name = ?query.queries.first().map(|q| q.name().to_string()), "the laptop's upstream failed (no answer or SERVFAIL): SERVFAIL, not the cluster's NXDOMAIN");
            bump(&shared.counters.servfail);
            encode(
                shared,
                &message::local_answer(query, ResponseCode::ServFail),
                limit,
            )
        }
    }
}

/// Send `raw` to each server in turn until one answers; its answer unchanged, or
/// TC when it exceeds `limit`, or SERVFAIL when nobody answered.
async fn relay(
    shared: &Shared,
    servers: &[SocketAddr],
    raw: &[u8],
    query: &Message,
    transport: Transport,
    limit: Option<usize>,
    to_cluster: bool,
) -> Option<Vec<u8>> {
    if let Some(answer) = first_answer(shared, servers, raw, transport, to_cluster).await {
        return sized(shared, answer, query, limit);
    }
    bump(&shared.counters.servfail);
    encode(
        shared,
        &message::local_answer(query, ResponseCode::ServFail),
        limit,
    )
}

/// `answer` unchanged, or an empty answer with TC when it exceeds `limit`.
fn sized(
    shared: &Shared,
    answer: Vec<u8>,
    query: &Message,
    limit: Option<usize>,
) -> Option<Vec<u8>> {
    if let Some(limit) = limit
        && answer.len() > limit
    {
        return encode(shared, &message::truncated_for(query), Some(limit));
    }
    Some(answer)
}

/// Send `raw` to each server in turn until one answers; that answer, or `None`
/// when nobody did.
async fn first_answer(
    shared: &Shared,
    servers: &[SocketAddr],
    raw: &[u8],
    transport: Transport,
    to_cluster: bool,
) -> Option<Vec<u8>> {
    // One server: a second try, as a stub resolver would.
    let tries = servers.len().max(2).min(servers.len() * 2);
    for server in servers.iter().cycle().take(tries) {
        let answer = if to_cluster && transport == Transport::Udp {
            shared.cluster_udp.exchange(*server, raw).await
        } else {
            exchange(*server, raw, transport, shared.mark).await
        };
        match answer {
            Ok(answer) => return Some(answer),
            Err(e) => tracing::debug!(%server, error = %e, "DNS server did not answer"),
        }
    }
    None
}

fn unspecified_for(server: SocketAddr) -> SocketAddr {
    match server.ip() {
        IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    }
}

/// One query to one server within [`EXCHANGE_TIMEOUT`]: a fresh socket (random
/// source port), the answer whose id matches.
async fn exchange(
    server: SocketAddr,
    raw: &[u8],
    transport: Transport,
    mark: Option<u32>,
) -> std::io::Result<Vec<u8>> {
    let id = message::message_id(raw);
    let attempt = async {
        match transport {
            Transport::Udp => {
                let socket = UdpSocket::bind(unspecified_for(server)).await?;
                set_mark(&socket, mark)?;
                socket.connect(server).await?;
                socket.send(raw).await?;
                let mut buf = vec![0u8; 65535];
                loop {
                    let n = socket.recv(&mut buf).await?;
                    if message::message_id(&buf[..n]) == id {
                        buf.truncate(n);
                        return Ok(buf);
                    }
                }
            }
            Transport::Tcp => {
                let socket = match server {
                    SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
                    SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
                };
                set_mark(&socket, mark)?;
                let mut stream = socket.connect(server).await?;
                let len = u16::try_from(raw.len())
                    .map_err(|_| std::io::Error::other("query too large for TCP"))?;
                let mut out = Vec::with_capacity(raw.len() + 2);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(raw);
                stream.write_all(&out).await?;
                let mut len = [0u8; 2];
                stream.read_exact(&mut len).await?;
                let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
                stream.read_exact(&mut buf).await?;
                if message::message_id(&buf) != id {
                    return Err(std::io::Error::other("answer with another id"));
                }
                Ok(buf)
            }
        }
    };
    tokio::time::timeout(EXCHANGE_TIMEOUT, attempt)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"))?
}

/// A query of ours to the cluster DNS, decoded; `None` when no server answered
/// with a parsable message of the same id.
async fn ask_cluster(
    shared: &Shared,
    cluster: &ClusterDns,
    query: &Message,
    transport: Transport,
) -> Option<Message> {
    let raw = query.to_vec().ok()?;
    for server in &cluster.servers {
        let answer = match transport {
            Transport::Udp => shared.cluster_udp.exchange(*server, &raw).await,
            Transport::Tcp => exchange(*server, &raw, transport, shared.mark).await,
        };
        match answer {
            Ok(answer) => match Message::from_vec(&answer) {
                Ok(m) => return Some(m),
                Err(e) => {
                    tracing::debug!(%server, error = %e, "unparsable answer from the cluster DNS")
                }
            },
            Err(e) => tracing::debug!(%server, error = %e, "cluster DNS did not answer"),
        }
    }
    None
}

/// Whether `anchor` exists in the cluster: cached, else asked. `None`: unknown
/// (no answer, or SERVFAIL/REFUSED).
async fn anchor_exists(shared: &Shared, cluster: &ClusterDns, anchor: &Name) -> Option<bool> {
    if let Some(known) = shared
        .anchors
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(anchor, Instant::now())
    {
        return Some(known);
    }
    let answer = ask_cluster(
        shared,
        cluster,
        &message::existence_query(anchor),
        Transport::Udp,
    )
    .await?;
    let exists = message::name_exists(answer.metadata.response_code)?;
    shared
        .anchors
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(anchor, exists, message::cache_ttl(&answer), Instant::now());
    Some(exists)
}

enum Tried {
    /// The expansion cannot exist (its anchor does not, or NXDOMAIN).
    Absent,
    /// NXDOMAIN for the expansion while its anchor exists: the name is in a zone
    /// of the cluster (an existing namespace) and does not exist there.
    Missing,
    /// The cluster's answer (NOERROR).
    Present(Message),
    /// No usable answer.
    Failed,
}

async fn try_candidate(
    shared: &Shared,
    cluster: &ClusterDns,
    query: &Message,
    candidate: &Candidate,
    transport: Transport,
) -> Tried {
    let anchored = match &candidate.anchor {
        Some(anchor) => match anchor_exists(shared, cluster, anchor).await {
            Some(false) => return Tried::Absent,
            known => known == Some(true),
        },
        None => false,
    };
    let Some(qtype) = query.queries.first().map(|q| q.query_type()) else {
        return Tried::Failed;
    };
    let ours = message::cluster_query(query, &candidate.name, qtype);
    match ask_cluster(shared, cluster, &ours, transport).await {
        Some(answer) => match message::name_exists(answer.metadata.response_code) {
            Some(true) => Tried::Present(answer),
            Some(false) if anchored => Tried::Missing,
            Some(false) => Tried::Absent,
            None => Tried::Failed,
        },
        None => Tried::Failed,
    }
}

enum Found {
    Answer(Name, Box<Message>),
    /// No expansion exists; `in_cluster_zone`: one of them whose NXDOMAIN is
    /// final ([`Candidate::if_missing`]) is under an anchor that exists
    /// ([`Tried::Missing`]); `cluster_nxdomain`: one whose NXDOMAIN falls
    /// through to the laptop's upstream is.
    Nothing {
        in_cluster_zone: bool,
        cluster_nxdomain: bool,
    },
    Failed,
}

/// Ask every expansion at once; the first in search-list order decides. An
/// expansion that failed before any existing one means SERVFAIL: answering from a
/// later search domain could pick the wrong namespace's Service.
async fn search(
    shared: &Shared,
    cluster: &ClusterDns,
    query: &Message,
    candidates: &[Candidate],
    transport: Transport,
) -> Found {
    let tried = futures::future::join_all(
        candidates
            .iter()
            .map(|c| try_candidate(shared, cluster, query, c, transport)),
    )
    .await;
    let mut in_cluster_zone = false;
    let mut cluster_nxdomain = false;
    for (candidate, result) in candidates.iter().zip(tried) {
        match result {
            Tried::Absent => continue,
            Tried::Missing => match candidate.if_missing {
                Otherwise::NxDomain => in_cluster_zone = true,
                Otherwise::Upstream => cluster_nxdomain = true,
            },
            Tried::Present(answer) => {
                return Found::Answer(candidate.name.clone(), Box::new(answer));
            }
            Tried::Failed => return Found::Failed,
        }
    }
    Found::Nothing {
        in_cluster_zone,
        cluster_nxdomain,
    }
}
