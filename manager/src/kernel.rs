//! The kernel side of a session: real sockets towards the cluster, driven by
//! the engine's [`Request`]s and reporting [`Event`]s back over one channel.
//!
//! All of the manager's I/O towards destinations lives here:
//! - TCP: one task per flow dials (tokio `TcpStream`, with a timeout), then
//!   runs the writer side (writes, `shutdown(SHUT_WR)`, orderly or reset
//!   close); a second task reads, never more than the engine granted.
//! - UDP: one connected kernel UDP socket per flow plus a reader task.
//! - ICMP echo: one unprivileged ping socket (`socket(AF_INET, SOCK_DGRAM,
//!   IPPROTO_ICMP)`, allowed by `net.ipv4.ping_group_range`) per flow, connected
//!   to the pinged address, plus a reader task. The kernel owns the echo
//!   identifier on these sockets; the engine maps replies back to the laptop's.
//!
//! TCP events go over a bounded channel ([`TCP_EVENT_QUEUE`]) whose volume the
//! engine bounds already: inbound bytes by the grants (at most one smoltcp send
//! buffer per flow), write confirmations by the write window. When it is full
//! a flow's task waits (its destination socket's buffers fill and TCP flow
//! control reaches the destination); each such wait is counted
//! ([`TcpEventSender::full_waits`]). An event is never dropped: a lost
//! `TcpData` would corrupt the stream. Datagram readers (UDP, ping) use a
//! bounded channel as well: when the session falls behind they wait, their
//! socket buffers fill and the kernel drops, as it would for any slow reader.
//! Events that [`KernelSide::apply`] itself produces (a UDP or ping socket that
//! failed) are queued in the [`KernelSide`] and taken with
//! [`KernelSide::poll_event`], never on a channel the session loop could be
//! the one to fill.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, trace, warn};

use crate::engine::{DialError, Event, FlowId, Request};
use crate::packet;

/// Largest single read from a destination TCP socket, bytes.
const TCP_READ_CHUNK: usize = 64 * 1024;

/// Receive buffer for one datagram (the largest UDP payload over IPv4/IPv6).
const DATAGRAM_BUFFER: usize = 65_536;

/// Datagram events (UDP replies, echo replies) queued for the session loop.
pub const DATAGRAM_QUEUE: usize = 1024;

/// TCP events (dial results, data, EOF, resets, write confirmations) queued for
/// one session loop. Far more than the engine's credit lets flows queue in a
/// round (one dial result per flow dialing, data only against grants, one
/// write confirmation per write command), and more than tr-12's 3000 flows'
/// dial results at once; a hard bound so that a fault in that accounting
/// waits, counted, instead of growing memory.
pub const TCP_EVENT_QUEUE: usize = 4096;

/// The sending side of a session's TCP event queue, cloned into each TCP flow's
/// tasks. Sends wait while the queue is full, and those waits are counted.
#[derive(Debug, Clone)]
pub struct TcpEventSender {
    tx: mpsc::Sender<Event>,
    full_waits: Arc<AtomicU64>,
}

impl TcpEventSender {
    /// A queue of `capacity` events and its receiver.
    pub fn channel(capacity: usize) -> (Self, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(capacity);
        let sender = Self {
            tx,
            full_waits: Arc::new(AtomicU64::new(0)),
        };
        (sender, rx)
    }

    /// Queue `event`, waiting (counted) while the queue is full; false when
    /// the session loop is gone.
    pub async fn send(&self, event: Event) -> bool {
        match self.tx.try_send(event) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(event)) => {
                self.full_waits.fetch_add(1, Ordering::Relaxed);
                trace!("TCP event queue full, waiting");
                self.tx.send(event).await.is_ok()
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// How many sends found the queue full and waited, since it was made.
    pub fn full_waits(&self) -> u64 {
        self.full_waits.load(Ordering::Relaxed)
    }
}

/// Aborts a task when dropped.
#[derive(Debug)]
pub(crate) struct AbortOnDrop<T>(pub(crate) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Debug)]
enum TcpCmd {
    Write(Vec<u8>),
    ShutdownWrite,
    /// Orderly close after the queued writes.
    Close,
}

#[derive(Debug)]
struct TcpHandle {
    cmd_tx: mpsc::UnboundedSender<TcpCmd>,
    grant_tx: mpsc::UnboundedSender<usize>,
    /// Sending (or dropping) it resets the connection at once, also mid-write
    /// or mid-dial.
    abort_tx: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

#[derive(Debug)]
struct DatagramFlow {
    socket: Arc<UdpSocket>,
    v6: bool,
    _reader: AbortOnDrop<()>,
}

/// Kernel sockets of one session. Dropping it resets every TCP connection and
/// closes every UDP and ping socket.
#[derive(Debug)]
pub struct KernelSide {
    events_tx: TcpEventSender,
    /// Events produced by [`KernelSide::apply`] itself, for
    /// [`KernelSide::poll_event`].
    local_events: VecDeque<Event>,
    datagrams_tx: mpsc::Sender<Event>,
    dial_timeout: Duration,
    tcp: HashMap<FlowId, TcpHandle>,
    /// Flows closing in order, still writing their last bytes.
    tcp_closing: Vec<TcpHandle>,
    udp: HashMap<FlowId, DatagramFlow>,
    ping: HashMap<FlowId, DatagramFlow>,
    ping_denied_logged: bool,
}

impl KernelSide {
    /// Report TCP events on `events_tx` (bounded, see [`TCP_EVENT_QUEUE`]),
    /// received datagrams on `datagrams_tx` (bounded, see [`DATAGRAM_QUEUE`]);
    /// give up dials after `dial_timeout`.
    pub fn new(
        events_tx: TcpEventSender,
        datagrams_tx: mpsc::Sender<Event>,
        dial_timeout: Duration,
    ) -> Self {
        Self {
            events_tx,
            local_events: VecDeque::new(),
            datagrams_tx,
            dial_timeout,
            tcp: HashMap::new(),
            tcp_closing: Vec::new(),
            udp: HashMap::new(),
            ping: HashMap::new(),
            ping_denied_logged: false,
        }
    }

    /// Kernel objects alive: (TCP incl. closing, UDP, ping).
    pub fn counts(&self) -> (usize, usize, usize) {
        (
            self.tcp.len() + self.tcp_closing.len(),
            self.udp.len(),
            self.ping.len(),
        )
    }

    /// Forget TCP flows whose orderly close finished.
    pub fn reap(&mut self) {
        self.tcp_closing.retain(|h| !h.task.is_finished());
    }

    /// The next event [`KernelSide::apply`] produced itself (a UDP or ping
    /// socket that could not be opened, a send that failed, an ICMP error
    /// pending on a UDP socket). The session loop takes them after applying
    /// requests.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.local_events.pop_front()
    }

    /// Sends of this session's TCP flows that found the TCP event queue full
    /// and waited.
    pub fn tcp_events_full(&self) -> u64 {
        self.events_tx.full_waits()
    }

    /// Carry out one engine request.
    pub fn apply(&mut self, request: Request) {
        match request {
            Request::TcpDial { flow, dst } => {
                let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
                let (grant_tx, grant_rx) = mpsc::unbounded_channel();
                let (abort_tx, abort_rx) = oneshot::channel();
                let task = tokio::spawn(tcp_flow(
                    flow,
                    dst,
                    self.dial_timeout,
                    cmd_rx,
                    grant_rx,
                    abort_rx,
                    self.events_tx.clone(),
                ));
                self.tcp.insert(
                    flow,
                    TcpHandle {
                        cmd_tx,
                        grant_tx,
                        abort_tx,
                        task,
                    },
                );
            }
            Request::TcpWrite { flow, data } => {
                if let Some(h) = self.tcp.get(&flow) {
                    let _ = h.cmd_tx.send(TcpCmd::Write(data));
                }
            }
            Request::TcpShutdownWrite { flow } => {
                if let Some(h) = self.tcp.get(&flow) {
                    let _ = h.cmd_tx.send(TcpCmd::ShutdownWrite);
                }
            }
            Request::TcpGrant { flow, bytes } => {
                if let Some(h) = self.tcp.get(&flow) {
                    let _ = h.grant_tx.send(bytes);
                }
            }
            Request::TcpClose { flow, reset } => {
                if let Some(h) = self.tcp.remove(&flow) {
                    if reset {
                        let _ = h.abort_tx.send(());
                    } else {
                        let _ = h.cmd_tx.send(TcpCmd::Close);
                        self.tcp_closing.push(h);
                    }
                }
            }
            Request::UdpOpen { flow, dst } => match open_udp(dst) {
                Ok(socket) => {
                    let socket = Arc::new(socket);
                    let reader =
                        tokio::spawn(udp_reader(flow, socket.clone(), self.datagrams_tx.clone()));
                    self.udp.insert(
                        flow,
                        DatagramFlow {
                            socket,
                            v6: dst.is_ipv6(),
                            _reader: AbortOnDrop(reader),
                        },
                    );
                }
                Err(e) => {
                    debug!(%flow, %dst, error = %e, "cannot open UDP socket");
                    self.local_events.push_back(Event::SocketFailed { flow });
                }
            },
            Request::UdpSend { flow, payload } => {
                let Some(f) = self.udp.get(&flow) else { return };
                let mut result = send_now(&f.socket, &payload);
                if let Err(e) = &result {
                    // A pending ICMP error from an earlier datagram: report it
                    // (if the laptop should hear of it) and retry.
                    match udp_error(flow, e) {
                        UdpError::Relay(event) => {
                            drain_error_queue(&f.socket);
                            self.local_events.push_back(event);
                            result = send_now(&f.socket, &payload);
                        }
                        UdpError::Ignore => {
                            drain_error_queue(&f.socket);
                            result = send_now(&f.socket, &payload);
                        }
                        UdpError::Fatal => {}
                    }
                }
                if let Err(e) = result {
                    trace!(%flow, error = %e, "UDP send failed");
                    self.local_events.push_back(Event::SendFailed { flow });
                }
            }
            Request::UdpClose { flow } => {
                self.udp.remove(&flow);
            }
            Request::PingOpen { flow, dst } => match open_ping(dst) {
                Ok(socket) => {
                    let socket = Arc::new(socket);
                    let v6 = dst.is_ipv6();
                    let reader = tokio::spawn(ping_reader(
                        flow,
                        socket.clone(),
                        v6,
                        self.datagrams_tx.clone(),
                    ));
                    self.ping.insert(
                        flow,
                        DatagramFlow {
                            socket,
                            v6,
                            _reader: AbortOnDrop(reader),
                        },
                    );
                }
                Err(e) => {
                    if e.kind() == io::ErrorKind::PermissionDenied && !self.ping_denied_logged {
                        self.ping_denied_logged = true;
                        warn!(
                            error = %e,
                            "cannot open an ICMP echo socket: the manager's group is outside \
                             net.ipv4.ping_group_range; set it (e.g. \"0 2147483647\") in the pod's netns"
                        );
                    } else {
                        debug!(%flow, %dst, error = %e, "cannot open ping socket");
                    }
                    self.local_events.push_back(Event::SocketFailed { flow });
                }
            },
            Request::PingSend { flow, seq, data } => {
                let Some(f) = self.ping.get(&flow) else {
                    return;
                };
                let msg = packet::ping_socket_request(f.v6, seq, &data);
                if let Err(e) = send_now(&f.socket, &msg) {
                    trace!(%flow, error = %e, "echo request send failed");
                    self.local_events.push_back(Event::SendFailed { flow });
                }
            }
            Request::PingClose { flow } => {
                self.ping.remove(&flow);
            }
        }
    }
}

/// One non-blocking send(2) on a connected datagram socket. Bypasses tokio's
/// cached write readiness (unknown on a fresh socket, so `try_send` would
/// report WouldBlock); a full socket buffer still fails with WouldBlock and
/// the datagram is dropped, as a router would.
fn send_now(socket: &UdpSocket, msg: &[u8]) -> io::Result<usize> {
    socket2::SockRef::from(socket).send(msg)
}

/// What an error on a connected UDP socket means for the flow.
#[derive(Debug, PartialEq, Eq)]
enum UdpError {
    /// An ICMP error to relay to the laptop.
    Relay(Event),
    /// An ICMP error with no unreachable counterpart for the laptop (too big:
    /// the kernel fragments our datagrams itself; source route failed;
    /// protocol unreachable): the flow lives on.
    Ignore,
    /// The socket is broken.
    Fatal,
}

/// The meaning of error `e` from a send or recv on the connected UDP socket of
/// `flow`. With IP_RECVERR ([`open_udp`]) the kernel reports every ICMP error
/// about our datagrams once as the socket error (`__udp4_lib_err`), with the
/// errno of `icmp_err_convert` (net/ipv4/icmp.c) or `icmpv6_err_convert`.
fn udp_error(flow: FlowId, e: &io::Error) -> UdpError {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => UdpError::Relay(Event::UdpRefused { flow }),
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
            UdpError::Relay(Event::UdpUnreachable { flow })
        }
        _ => match e.raw_os_error() {
            // ICMP host unknown / ICMPv6 address unreachable.
            Some(libc::EHOSTDOWN) => UdpError::Relay(Event::UdpUnreachable { flow }),
            Some(libc::EMSGSIZE | libc::EOPNOTSUPP | libc::ENOPROTOOPT | libc::EPROTO) => {
                UdpError::Ignore
            }
            _ => UdpError::Fatal,
        },
    }
}

fn dial_error(e: &io::Error) -> DialError {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => DialError::Refused,
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
            DialError::Unreachable
        }
        io::ErrorKind::TimedOut => DialError::TimedOut,
        _ => DialError::Other,
    }
}

/// Close the connection with RST: SO_LINGER 0, and no FIN from the write half.
fn reset(flow: FlowId, wr: OwnedWriteHalf) {
    if let Err(e) = wr.as_ref().set_zero_linger() {
        debug!(%flow, error = %e, "cannot set SO_LINGER 0; closing with FIN");
    }
    // The socket closes (with RST) when the read half is dropped as well.
    wr.forget();
}

async fn tcp_flow(
    flow: FlowId,
    dst: SocketAddr,
    dial_timeout: Duration,
    mut cmd_rx: mpsc::UnboundedReceiver<TcpCmd>,
    grant_rx: mpsc::UnboundedReceiver<usize>,
    mut abort_rx: oneshot::Receiver<()>,
    events: TcpEventSender,
) {
    let connect = tokio::time::timeout(dial_timeout, TcpStream::connect(dst));
    let result = tokio::select! {
        r = connect => r,
        _ = &mut abort_rx => {
            trace!(%flow, %dst, "dial abandoned");
            return;
        }
    };
    let stream = match result {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            debug!(%flow, %dst, error = %e, "dial failed");
            let _ = events
                .send(Event::TcpDialed {
                    flow,
                    result: Err(dial_error(&e)),
                })
                .await;
            return;
        }
        Err(_) => {
            debug!(%flow, %dst, timeout = ?dial_timeout, "dial timed out");
            let _ = events
                .send(Event::TcpDialed {
                    flow,
                    result: Err(DialError::TimedOut),
                })
                .await;
            return;
        }
    };
    if let Err(e) = stream.set_nodelay(true) {
        debug!(%flow, error = %e, "cannot set TCP_NODELAY");
    }
    let _ = events
        .send(Event::TcpDialed {
            flow,
            result: Ok(()),
        })
        .await;
    let (rd, mut wr) = stream.into_split();
    let _reader = AbortOnDrop(tokio::spawn(tcp_reader(flow, rd, grant_rx, events.clone())));
    let mut broken = false;
    loop {
        let cmd = tokio::select! {
            biased;
            _ = &mut abort_rx => return reset(flow, wr),
            cmd = cmd_rx.recv() => cmd,
        };
        match cmd {
            // The session is gone: its abort sender went with it, so this arm
            // is only reached if commands end first; treat it the same.
            None => return reset(flow, wr),
            Some(TcpCmd::Write(data)) => {
                if broken {
                    continue;
                }
                let n = data.len();
                let written = tokio::select! {
                    biased;
                    _ = &mut abort_rx => return reset(flow, wr),
                    r = wr.write_all(&data) => r,
                };
                match written {
                    Ok(()) => {
                        let _ = events.send(Event::TcpWritten { flow, bytes: n }).await;
                    }
                    Err(e) => {
                        debug!(%flow, error = %e, "write to destination failed");
                        broken = true;
                        let _ = events.send(Event::TcpReset { flow }).await;
                    }
                }
            }
            Some(TcpCmd::ShutdownWrite) => {
                if let Err(e) = wr.shutdown().await {
                    debug!(%flow, error = %e, "shutdown(SHUT_WR) failed");
                }
            }
            Some(TcpCmd::Close) => return,
        }
    }
}

async fn tcp_reader(
    flow: FlowId,
    rd: OwnedReadHalf,
    mut grant_rx: mpsc::UnboundedReceiver<usize>,
    events: TcpEventSender,
) {
    let mut credit = 0usize;
    loop {
        while credit == 0 {
            match grant_rx.recv().await {
                Some(n) => credit += n,
                None => return,
            }
        }
        while let Ok(n) = grant_rx.try_recv() {
            credit += n;
        }
        // Wait for data before allocating: an idle flow holds no read buffer
        // (3000 idle flows would otherwise pin 3000 x 64 KiB).
        if let Err(e) = rd.readable().await {
            debug!(%flow, error = %e, "read from destination failed");
            let _ = events.send(Event::TcpReset { flow }).await;
            return;
        }
        let mut data = Vec::with_capacity(credit.min(TCP_READ_CHUNK));
        match rd.try_read_buf(&mut data) {
            Ok(0) => {
                let _ = events.send(Event::TcpEof { flow }).await;
                return;
            }
            Ok(n) => {
                credit -= n;
                let _ = events.send(Event::TcpData { flow, data }).await;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                debug!(%flow, error = %e, "read from destination failed");
                let _ = events.send(Event::TcpReset { flow }).await;
                return;
            }
        }
    }
}

fn unspecified_for(dst: IpAddr) -> SocketAddr {
    match dst {
        IpAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        IpAddr::V6(_) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0),
    }
}

/// A UDP socket connected to `dst`, with IP_RECVERR (IPV6_RECVERR): without
/// it Linux reports only "fatal" ICMP errors (port unreachable, prohibited) on
/// a UDP socket and drops host and network unreachable (`icmp_err_convert`),
/// so the laptop's application would wait for a timeout instead of getting
/// EHOSTUNREACH.
fn open_udp(dst: SocketAddr) -> io::Result<UdpSocket> {
    use nix::sys::socket::{setsockopt, sockopt};
    let socket = std::net::UdpSocket::bind(unspecified_for(dst.ip()))?;
    let recverr = match dst {
        SocketAddr::V4(_) => setsockopt(&socket, sockopt::Ipv4RecvErr, &true),
        SocketAddr::V6(_) => setsockopt(&socket, sockopt::Ipv6RecvErr, &true),
    };
    recverr.map_err(io::Error::from)?;
    socket.connect(dst)?;
    socket.set_nonblocking(true)?;
    UdpSocket::from_std(socket)
}

/// Empty the error queue IP_RECVERR fills (one entry per ICMP error; the
/// socket error already told us what happened), so it holds no receive
/// buffer memory and no EPOLLERR stays raised.
fn drain_error_queue(socket: &UdpSocket) {
    let sock = socket2::SockRef::from(socket);
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 64];
    // Bounded: the queue is limited by the receive buffer anyway.
    for _ in 0..64 {
        if sock
            .recv_with_flags(&mut buf, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT)
            .is_err()
        {
            break;
        }
    }
}

async fn udp_reader(flow: FlowId, socket: Arc<UdpSocket>, events: mpsc::Sender<Event>) {
    let mut buf = vec![0u8; DATAGRAM_BUFFER];
    loop {
        let event = match socket.recv(&mut buf).await {
            Ok(n) => Event::UdpReply {
                flow,
                data: buf[..n].to_vec(),
            },
            Err(e) => {
                drain_error_queue(&socket);
                match udp_error(flow, &e) {
                    UdpError::Relay(event) => event,
                    UdpError::Ignore => {
                        trace!(%flow, error = %e, "ICMP error on UDP socket, not relayed");
                        continue;
                    }
                    UdpError::Fatal => {
                        debug!(%flow, error = %e, "UDP receive failed");
                        let _ = events.send(Event::SocketFailed { flow }).await;
                        return;
                    }
                }
            }
        };
        if events.send(event).await.is_err() {
            return;
        }
    }
}

fn open_ping(dst: IpAddr) -> io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let (domain, protocol) = match dst {
        IpAddr::V4(_) => (Domain::IPV4, Protocol::ICMPV4),
        IpAddr::V6(_) => (Domain::IPV6, Protocol::ICMPV6),
    };
    let socket = Socket::new(domain, Type::DGRAM, Some(protocol))?;
    socket.set_nonblocking(true)?;
    socket.connect(&SocketAddr::new(dst, 0).into())?;
    // A ping socket speaks datagrams like UDP (send/recv of one ICMP message),
    // so tokio's UdpSocket drives it.
    UdpSocket::from_std(socket.into())
}

async fn ping_reader(flow: FlowId, socket: Arc<UdpSocket>, v6: bool, events: mpsc::Sender<Event>) {
    let mut buf = vec![0u8; DATAGRAM_BUFFER];
    loop {
        match socket.recv(&mut buf).await {
            Ok(n) => {
                if let Some((seq, data)) = packet::ping_socket_reply(v6, &buf[..n]) {
                    let event = Event::PingReply {
                        flow,
                        seq,
                        data: data.to_vec(),
                    };
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
            }
            // ICMP errors about earlier requests (the target is unreachable):
            // no reply for the laptop, keep listening.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::HostUnreachable
                        | io::ErrorKind::NetworkUnreachable
                        | io::ErrorKind::ConnectionRefused
                ) =>
            {
                trace!(%flow, error = %e, "ICMP error on ping socket");
            }
            Err(e) => {
                debug!(%flow, error = %e, "ping receive failed");
                let _ = events.send(Event::SocketFailed { flow }).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_errors_from_icmp_are_relayed_ignored_or_fatal() {
        let flow = FlowId(3);
        let err = |errno| udp_error(flow, &io::Error::from_raw_os_error(errno));
        assert_eq!(
            err(libc::ECONNREFUSED),
            UdpError::Relay(Event::UdpRefused { flow })
        );
        for errno in [libc::EHOSTUNREACH, libc::ENETUNREACH, libc::EHOSTDOWN] {
            assert_eq!(
                err(errno),
                UdpError::Relay(Event::UdpUnreachable { flow }),
                "errno {errno}"
            );
        }
        assert_eq!(err(libc::EMSGSIZE), UdpError::Ignore);
        assert_eq!(err(libc::EBADF), UdpError::Fatal);
    }

    /// Overflowing the TCP event queue: the queue never holds more than its
    /// bound, the sender beyond it waits (counted once per wait) instead of
    /// dropping, and every event arrives in order once the session loop reads.
    #[tokio::test]
    async fn full_tcp_event_queue_makes_senders_wait_counted_and_loses_nothing() {
        const CAP: usize = 4;
        let (tx, mut rx) = TcpEventSender::channel(CAP);
        let mut senders = Vec::new();
        for i in 0..CAP as u64 + 3 {
            let tx = tx.clone();
            // One task per event, started in order: the ones past the bound wait.
            senders.push(tokio::spawn(async move {
                tx.send(Event::TcpEof { flow: FlowId(i) }).await
            }));
            tokio::task::yield_now().await;
        }
        for _ in 0..100 {
            if tx.full_waits() == 3 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(rx.len(), CAP, "the queue holds its bound, no more");
        assert_eq!(tx.full_waits(), 3, "each sender past the bound waited once");
        assert!(
            senders.iter().filter(|s| s.is_finished()).count() == CAP,
            "the senders past the bound are still waiting"
        );
        let mut got = Vec::new();
        while got.len() < CAP + 3 {
            match rx.recv().await {
                Some(Event::TcpEof { flow }) => got.push(flow.0),
                other => panic!("unexpected {other:?}"),
            }
        }
        for s in senders {
            assert!(s.await.expect("sender task"), "every send delivered");
        }
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..CAP as u64 + 3).collect::<Vec<_>>(),
            "nothing lost"
        );
        drop(rx);
        assert!(
            !tx.send(Event::TcpEof { flow: FlowId(99) }).await,
            "a send after the session loop ended reports it"
        );
    }
}
