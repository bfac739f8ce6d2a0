//! The laptop-side TCP/IP stack of SOCKS mode: one smoltcp `Interface` that owns
//! the leased tunnel IP, the way the TUN device and the kernel own it in TUN
//! mode. SOCKS flows open TCP and UDP sockets on it; the packets it emits are the
//! ones the root daemon's pump would read from the TUN device, and they travel
//! the same data channel to the traffic manager (see [`super::channel`]).
//!
//! I/O: none. The stack is a queue device plus smoltcp's state behind a mutex;
//! [`Stack::handle_packet`] feeds packets from the manager in,
//! [`Stack::poll`] runs smoltcp and hands back the packets to send and when to
//! poll next, and [`TcpConn`] / [`UdpConn`] are tokio `AsyncRead`/`AsyncWrite`
//! views of single sockets, woken through smoltcp's socket wakers. Whoever
//! drives the stack (the data channel) waits on [`Stack::wake`] as well as on the
//! returned delay: every socket operation that may produce packets notifies it.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvpn_proto::device::QueueDevice;
use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::socket::{tcp, udp};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpEndpoint, IpListenEndpoint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// The stack's MTU: the root daemon's TUN default and the manager's stack MTU
/// ([`kvpn_proto::frame::DEFAULT_TUN_MTU`], 9000 bytes for byte-stream transports),
/// so the manager never sees a segment larger than it expects and one frame
/// carries about 8.9 KB of data.
pub const MTU: usize = kvpn_proto::frame::DEFAULT_TUN_MTU as usize;

/// Receive and send buffer of one TCP flow, bytes. 512 KiB each: with window
/// scaling the manager can keep about one bandwidth-delay product of the
/// port-forward path in flight (a few ms at Gbit/s); a flow costs 1 MiB at most.
const TCP_BUFFER: usize = 512 * 1024;

/// Datagrams and bytes one UDP flow buffers each way.
const UDP_PACKETS: usize = 64;
const UDP_BUFFER: usize = 256 * 1024;

/// How long a TCP flow the SOCKS side closed may take to finish its FIN
/// handshake before it is aborted and its port freed.
const LINGER: Duration = Duration::from_secs(30);

/// Laptop-side ports of SOCKS flows: the Linux default ephemeral range.
const PORTS: std::ops::RangeInclusive<u16> = 32768..=60999;

/// Packet counters of the stack, as `kvpn status` shows them. Outbound =
/// laptop → cluster (tx), inbound = cluster → laptop (rx).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// Packets and bytes sent to the manager.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Packets and bytes from the manager.
    pub rx_packets: u64,
    /// Bytes received.
    pub rx_bytes: u64,
}

struct Inner {
    iface: Interface,
    sockets: SocketSet<'static>,
    device: QueueDevice,
    tunnel_ip: IpAddress,
    ports_in_use: HashSet<u16>,
    next_port: u16,
    /// TCP flows the SOCKS side is done with, finishing their close.
    lingering: Vec<(SocketHandle, u16, Instant)>,
    /// TCP flows the stack ended itself, and why: their reads and writes fail
    /// with this error kind (a SOCKS client sees a reset, not an end of stream).
    ended: HashMap<SocketHandle, io::ErrorKind>,
    counters: Counters,
}

impl Inner {
    fn alloc_port(&mut self) -> io::Result<u16> {
        let span = usize::from(PORTS.end() - PORTS.start()) + 1;
        for _ in 0..span {
            let port = self.next_port;
            self.next_port = if port >= *PORTS.end() {
                *PORTS.start()
            } else {
                port + 1
            };
            if self.ports_in_use.insert(port) {
                return Ok(port);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "every laptop-side port of the SOCKS stack is in use",
        ))
    }

    fn release(&mut self, handle: SocketHandle, port: u16) {
        self.sockets.remove(handle);
        self.ports_in_use.remove(&port);
        self.ended.remove(&handle);
    }

    /// An ICMP/ICMPv6 destination unreachable from the manager (it answers a
    /// dial that timed out or failed that way, quoting the SYN): the flow
    /// still in SYN-SENT toward the quoted destination fails now, as a kernel
    /// socket does, instead of after the SOCKS connect timeout.
    fn handle_unreachable(&mut self, packet: &[u8]) {
        let Some((dst, src_port, dst_port)) = quoted_tcp_of_unreachable(packet) else {
            return;
        };
        let remote = IpEndpoint::new(IpAddress::from(dst), dst_port);
        for (handle, socket) in self.sockets.iter_mut() {
            let smoltcp::socket::Socket::Tcp(sock) = socket else {
                continue;
            };
            if sock.state() == tcp::State::SynSent
                && sock.local_endpoint().map(|l| l.port) == Some(src_port)
                && sock.remote_endpoint() == Some(remote)
            {
                sock.abort();
                self.ended.insert(handle, io::ErrorKind::HostUnreachable);
            }
        }
    }
}

/// The laptop-side stack with the leased tunnel IP.
pub struct Stack {
    inner: Mutex<Inner>,
    wake: Notify,
    epoch: Instant,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack").finish_non_exhaustive()
    }
}

fn smol_now(epoch: Instant, now: Instant) -> smoltcp::time::Instant {
    smoltcp::time::Instant::from_micros(
        i64::try_from(now.saturating_duration_since(epoch).as_micros()).unwrap_or(i64::MAX),
    )
}

impl Stack {
    /// A stack owning `tunnel_ip`. `seed` seeds smoltcp's initial sequence
    /// numbers and the first port (random in the daemon, fixed in tests).
    pub fn new(tunnel_ip: IpAddr, seed: u64, now: Instant) -> Arc<Self> {
        let mut device = QueueDevice::new(MTU);
        let mut config = Config::new(HardwareAddress::Ip);
        config.random_seed = seed;
        let mut iface = Interface::new(config, &mut device, smol_now(now, now));
        let ip = IpAddress::from(tunnel_ip);
        let prefix = match tunnel_ip {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        iface.update_ip_addrs(|addrs| {
            // One address: the table has room for it (IFACE_MAX_ADDR_COUNT >= 1).
            let _ = addrs.push(IpCidr::new(ip, prefix));
        });
        // Everything goes to the manager: a default route via our own address
        // (Medium::Ip has no neighbours, smoltcp only needs the route to exist).
        let routed = match ip {
            IpAddress::Ipv4(v4) => iface.routes_mut().add_default_ipv4_route(v4).is_ok(),
            IpAddress::Ipv6(v6) => iface.routes_mut().add_default_ipv6_route(v6).is_ok(),
        };
        if !routed {
            tracing::warn!("smoltcp route table full: the SOCKS stack has no default route");
        }
        let span = u64::from(PORTS.end() - PORTS.start()) + 1;
        let first = PORTS.start() + u16::try_from(seed % span).unwrap_or(0);
        Arc::new(Self {
            inner: Mutex::new(Inner {
                iface,
                sockets: SocketSet::new(Vec::new()),
                device,
                tunnel_ip: ip,
                ports_in_use: HashSet::new(),
                next_port: first,
                lingering: Vec::new(),
                ended: HashMap::new(),
                counters: Counters::default(),
            }),
            wake: Notify::new(),
            epoch: now,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves smoltcp's state as it was
        // between two calls, which is consistent: keep going.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Notified whenever the stack may have packets to send; the driver waits
    /// on it together with [`Stack::poll`]'s delay.
    pub fn wake(&self) -> &Notify {
        &self.wake
    }

    /// A packet from the manager (one raw IP packet of a Packet frame).
    pub fn handle_packet(&self, packet: Vec<u8>) {
        let mut inner = self.lock();
        inner.counters.rx_packets += 1;
        inner.counters.rx_bytes += packet.len() as u64;
        inner.handle_unreachable(&packet);
        inner.device.push_rx(packet);
        drop(inner);
        self.wake.notify_one();
    }

    /// Run smoltcp at `now`: process received packets, timers and socket
    /// buffers. Returns the packets to send to the manager and how long until
    /// the next poll is due (`None` = only when woken).
    pub fn poll(&self, now: Instant) -> (Vec<Vec<u8>>, Option<Duration>) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let t = smol_now(self.epoch, now);
        inner.iface.poll(t, &mut inner.device, &mut inner.sockets);
        // Reap flows whose close finished (or took too long).
        let mut i = 0;
        while i < inner.lingering.len() {
            let (handle, port, since) = inner.lingering[i];
            let sock = inner.sockets.get_mut::<tcp::Socket>(handle);
            let done = matches!(sock.state(), tcp::State::Closed | tcp::State::TimeWait);
            if done || now.saturating_duration_since(since) > LINGER {
                sock.abort();
                // The abort's RST goes out before the socket disappears.
                inner.iface.poll(t, &mut inner.device, &mut inner.sockets);
                inner.lingering.swap_remove(i);
                inner.release(handle, port);
            } else {
                i += 1;
            }
        }
        let out: Vec<Vec<u8>> = inner.device.drain_tx().collect();
        for p in &out {
            inner.counters.tx_packets += 1;
            inner.counters.tx_bytes += p.len() as u64;
        }
        let delay = inner
            .iface
            .poll_delay(t, &inner.sockets)
            .map(|d| Duration::from_micros(d.total_micros()));
        (out, delay)
    }

    /// Packet counters so far.
    pub fn counters(&self) -> Counters {
        self.lock().counters
    }

    /// Open TCP flows (established or closing).
    pub fn open_flows(&self) -> usize {
        self.lock().sockets.iter().count()
    }

    /// Reset every TCP flow that is not closed yet (the manager lost them):
    /// a RST each toward the manager, and the SOCKS side's reads and writes
    /// fail with "connection reset". Returns how many were reset.
    pub fn reset_tcp_flows(&self) -> usize {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let mut reset = Vec::new();
        for (handle, socket) in inner.sockets.iter_mut() {
            let smoltcp::socket::Socket::Tcp(sock) = socket else {
                continue;
            };
            if !matches!(sock.state(), tcp::State::Closed | tcp::State::TimeWait) {
                sock.abort();
                reset.push(handle);
            }
        }
        for h in &reset {
            inner.ended.insert(*h, io::ErrorKind::ConnectionReset);
        }
        self.wake.notify_one();
        reset.len()
    }

    /// Start a TCP connection from the tunnel IP to `remote`; wait for the
    /// handshake with [`TcpConn::established`].
    pub fn tcp_connect(self: &Arc<Self>, remote: SocketAddr) -> io::Result<TcpConn> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let port = inner.alloc_port()?;
        let mut sock = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
            tcp::SocketBuffer::new(vec![0; TCP_BUFFER]),
        );
        // Interactive flows (SSH, RPCs) must not wait for Nagle: SOCKS clients
        // write what they mean to send.
        sock.set_nagle_enabled(false);
        let local = IpEndpoint::new(inner.tunnel_ip, port);
        if let Err(e) = sock.connect(inner.iface.context(), IpEndpoint::from(remote), local) {
            inner.ports_in_use.remove(&port);
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("cannot connect to {remote}: {e}"),
            ));
        }
        let handle = inner.sockets.add(sock);
        self.wake.notify_one();
        Ok(TcpConn {
            stack: Arc::clone(self),
            handle,
            port,
            local: SocketAddr::new(IpAddr::from(inner.tunnel_ip), port),
        })
    }

    /// A UDP socket bound to the tunnel IP and a free port.
    pub fn udp_bind(self: &Arc<Self>) -> io::Result<UdpConn> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        let port = inner.alloc_port()?;
        let mut sock = udp::Socket::new(
            udp::PacketBuffer::new(
                vec![udp::PacketMetadata::EMPTY; UDP_PACKETS],
                vec![0; UDP_BUFFER],
            ),
            udp::PacketBuffer::new(
                vec![udp::PacketMetadata::EMPTY; UDP_PACKETS],
                vec![0; UDP_BUFFER],
            ),
        );
        if let Err(e) = sock.bind(IpListenEndpoint {
            addr: Some(inner.tunnel_ip),
            port,
        }) {
            inner.ports_in_use.remove(&port);
            return Err(io::Error::other(format!(
                "cannot bind a UDP socket on the tunnel IP: {e}"
            )));
        }
        let handle = inner.sockets.add(sock);
        Ok(UdpConn {
            stack: Arc::clone(self),
            handle,
            port,
            local: SocketAddr::new(IpAddr::from(inner.tunnel_ip), port),
        })
    }
}

/// The error a flow the stack ended itself reports to the SOCKS side.
fn ended_error(kind: io::ErrorKind) -> io::Error {
    let what = match kind {
        io::ErrorKind::ConnectionReset => {
            "the traffic manager lost this flow while the data channel was re-dialled; it was reset"
        }
        _ => "the destination is unreachable",
    };
    io::Error::new(kind, what)
}

/// The quoted TCP flow of an ICMPv4/ICMPv6 destination unreachable packet:
/// (the quoted packet's destination, its source port, its destination port).
/// `None` for anything else. Never panics on any input.
pub fn quoted_tcp_of_unreachable(packet: &[u8]) -> Option<(IpAddr, u16, u16)> {
    use smoltcp::wire::{
        Icmpv4Message, Icmpv4Packet, Icmpv6Message, Icmpv6Packet, IpProtocol, Ipv4Packet,
        Ipv6Packet,
    };
    const TCP: u8 = 6;
    let ports = |l4: &[u8]| -> Option<(u16, u16)> {
        let b = l4.get(..4)?;
        Some((
            u16::from_be_bytes([b[0], b[1]]),
            u16::from_be_bytes([b[2], b[3]]),
        ))
    };
    match packet.first()? >> 4 {
        4 => {
            let ip = Ipv4Packet::new_checked(packet).ok()?;
            if ip.next_header() != IpProtocol::Icmp {
                return None;
            }
            let icmp = Icmpv4Packet::new_checked(ip.payload()).ok()?;
            if icmp.msg_type() != Icmpv4Message::DstUnreachable {
                return None;
            }
            let quoted = icmp.data();
            let ihl = usize::from(quoted.first()? & 0x0f) * 4;
            if quoted.first()? >> 4 != 4 || ihl < 20 || *quoted.get(9)? != TCP {
                return None;
            }
            let d = quoted.get(16..20)?;
            let dst = IpAddr::from([d[0], d[1], d[2], d[3]]);
            let (sp, dp) = ports(quoted.get(ihl..)?)?;
            Some((dst, sp, dp))
        }
        6 => {
            let ip = Ipv6Packet::new_checked(packet).ok()?;
            if ip.next_header() != IpProtocol::Icmpv6 {
                return None;
            }
            let icmp = Icmpv6Packet::new_checked(ip.payload()).ok()?;
            if icmp.msg_type() != Icmpv6Message::DstUnreachable {
                return None;
            }
            let quoted = icmp.payload();
            if quoted.first()? >> 4 != 6 || *quoted.get(6)? != TCP {
                return None;
            }
            let d: [u8; 16] = quoted.get(24..40)?.try_into().ok()?;
            let (sp, dp) = ports(quoted.get(40..)?)?;
            Some((IpAddr::from(d), sp, dp))
        }
        _ => None,
    }
}

fn endpoint_addr(ep: IpEndpoint) -> SocketAddr {
    SocketAddr::new(IpAddr::from(ep.addr), ep.port)
}

/// One TCP flow on the stack, from the tunnel IP to a cluster address.
#[derive(Debug)]
pub struct TcpConn {
    stack: Arc<Stack>,
    handle: SocketHandle,
    port: u16,
    local: SocketAddr,
}

impl TcpConn {
    /// The laptop side of the flow: tunnel IP and port.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Wait until the handshake finished (`Ok`) or the destination refused
    /// (RST from the manager: closed port or unreachable destination).
    pub async fn established(&self) -> io::Result<()> {
        std::future::poll_fn(|cx| {
            let mut inner = self.stack.lock();
            let sock = inner.sockets.get_mut::<tcp::Socket>(self.handle);
            match sock.state() {
                tcp::State::SynSent | tcp::State::SynReceived => {
                    sock.register_send_waker(cx.waker());
                    Poll::Pending
                }
                tcp::State::Closed
                    if inner.ended.get(&self.handle) == Some(&io::ErrorKind::HostUnreachable) =>
                {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::HostUnreachable,
                        "nothing answers at that address (the traffic manager's dial timed out or was unreachable)",
                    )))
                }
                tcp::State::Closed | tcp::State::Closing | tcp::State::TimeWait => {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionRefused,
                        "the destination refused the connection (closed port, or nothing answers at that address)",
                    )))
                }
                _ => Poll::Ready(Ok(())),
            }
        })
        .await
    }
}

impl AsyncRead for TcpConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut inner = self.stack.lock();
        let sock = inner.sockets.get_mut::<tcp::Socket>(self.handle);
        if sock.can_recv() {
            let n = match sock.recv_slice(buf.initialize_unfilled()) {
                Ok(n) => n,
                Err(e) => return Poll::Ready(Err(io::Error::other(e.to_string()))),
            };
            buf.advance(n);
            drop(inner);
            // Freed receive buffer: the window update may be worth sending.
            self.stack.wake.notify_one();
            return Poll::Ready(Ok(()));
        }
        if !sock.may_recv() {
            if let Some(kind) = inner.ended.get(&self.handle) {
                return Poll::Ready(Err(ended_error(*kind)));
            }
            // FIN (end of stream) or reset: both end the read side.
            return Poll::Ready(Ok(()));
        }
        sock.register_recv_waker(cx.waker());
        Poll::Pending
    }
}

impl AsyncWrite for TcpConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut inner = self.stack.lock();
        let sock = inner.sockets.get_mut::<tcp::Socket>(self.handle);
        if !sock.may_send() {
            if let Some(kind) = inner.ended.get(&self.handle) {
                return Poll::Ready(Err(ended_error(*kind)));
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the cluster side closed the connection",
            )));
        }
        if sock.can_send() {
            let n = match sock.send_slice(data) {
                Ok(n) => n,
                Err(e) => return Poll::Ready(Err(io::Error::other(e.to_string()))),
            };
            drop(inner);
            self.stack.wake.notify_one();
            return Poll::Ready(Ok(n));
        }
        sock.register_send_waker(cx.waker());
        Poll::Pending
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut inner = self.stack.lock();
        inner.sockets.get_mut::<tcp::Socket>(self.handle).close();
        drop(inner);
        self.stack.wake.notify_one();
        Poll::Ready(Ok(()))
    }
}

impl Drop for TcpConn {
    fn drop(&mut self) {
        let mut inner = self.stack.lock();
        // FIN now; the stack reaps the socket once the close finished.
        inner.sockets.get_mut::<tcp::Socket>(self.handle).close();
        inner
            .lingering
            .push((self.handle, self.port, Instant::now()));
        drop(inner);
        self.stack.wake.notify_one();
    }
}

/// One UDP socket on the stack, bound to the tunnel IP.
#[derive(Debug)]
pub struct UdpConn {
    stack: Arc<Stack>,
    handle: SocketHandle,
    port: u16,
    local: SocketAddr,
}

impl UdpConn {
    /// The laptop side: tunnel IP and port.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Send one datagram to `to`. Waits while the send buffer is full.
    pub async fn send_to(&self, data: &[u8], to: SocketAddr) -> io::Result<()> {
        std::future::poll_fn(|cx| {
            let mut inner = self.stack.lock();
            let sock = inner.sockets.get_mut::<udp::Socket>(self.handle);
            match sock.send_slice(data, IpEndpoint::from(to)) {
                Ok(()) => {
                    drop(inner);
                    self.stack.wake.notify_one();
                    Poll::Ready(Ok(()))
                }
                Err(udp::SendError::BufferFull) => {
                    sock.register_send_waker(cx.waker());
                    Poll::Pending
                }
                Err(udp::SendError::Unaddressable) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("cannot send a datagram to {to}: not a usable address"),
                ))),
            }
        })
        .await
    }

    /// Receive one datagram into `buf`: its length and sender. A datagram larger
    /// than `buf` is truncated to it.
    pub async fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddr)> {
        std::future::poll_fn(|cx| {
            let mut inner = self.stack.lock();
            let sock = inner.sockets.get_mut::<udp::Socket>(self.handle);
            match sock.recv() {
                Ok((data, meta)) => {
                    let n = data.len().min(buf.len());
                    buf[..n].copy_from_slice(&data[..n]);
                    Poll::Ready(Ok((n, endpoint_addr(meta.endpoint))))
                }
                Err(udp::RecvError::Exhausted) => {
                    sock.register_recv_waker(cx.waker());
                    Poll::Pending
                }
                Err(e) => Poll::Ready(Err(io::Error::other(e.to_string()))),
            }
        })
        .await
    }
}

impl Drop for UdpConn {
    fn drop(&mut self) {
        let mut inner = self.stack.lock();
        inner.release(self.handle, self.port);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoltcp::wire::{IpProtocol, Ipv4Packet, TcpPacket};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    /// An ICMP host unreachable quoting `syn` (IPv4), as the manager sends
    /// when its dial of the SYN's destination timed out.
    fn host_unreachable(syn: &[u8]) -> Vec<u8> {
        let quoted = &syn[..28.min(syn.len())];
        let v4 = Ipv4Packet::new_checked(syn).unwrap_or_else(|e| panic!("{e}"));
        let total = 20 + 8 + quoted.len();
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&u16::try_from(total).unwrap_or(0).to_be_bytes());
        p[8] = 64;
        p[9] = 1; // ICMP
        p[12..16].copy_from_slice(&v4.dst_addr().octets());
        p[16..20].copy_from_slice(&v4.src_addr().octets());
        p[20] = 3; // destination unreachable
        p[21] = 1; // host unreachable
        p[28..].copy_from_slice(quoted);
        let mut ip = Ipv4Packet::new_unchecked(&mut p[..]);
        ip.fill_checksum();
        p
    }

    #[tokio::test]
    async fn an_icmp_host_unreachable_fails_the_connect_at_once() {
        let now = Instant::now();
        let stack = Stack::new(ip("100.96.0.7"), 42, now);
        let conn = stack
            .tcp_connect("10.244.1.250:80".parse().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let other = stack
            .tcp_connect("10.244.1.251:80".parse().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let (out, _) = stack.poll(now);
        assert_eq!(out.len(), 2, "two SYNs");
        let unreachable = host_unreachable(&out[0]);
        assert_eq!(
            quoted_tcp_of_unreachable(&unreachable),
            Some((ip("10.244.1.250"), conn.local_addr().port(), 80))
        );
        stack.handle_packet(unreachable);
        let e = tokio::time::timeout(Duration::from_secs(1), conn.established())
            .await
            .unwrap_or_else(|_| panic!("the connect still waits after the ICMP"))
            .expect_err("unreachable");
        assert_eq!(e.kind(), io::ErrorKind::HostUnreachable, "{e}");
        // The other flow is untouched.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), other.established())
                .await
                .is_err(),
            "the flow to another address still waits for its handshake"
        );
        // Garbage is no unreachable.
        assert_eq!(quoted_tcp_of_unreachable(&[0x45, 0, 0]), None);
        assert_eq!(quoted_tcp_of_unreachable(&out[1]), None);
    }

    #[tokio::test]
    async fn reset_tcp_flows_fails_reads_with_connection_reset() {
        let now = Instant::now();
        let stack = Stack::new(ip("100.96.0.7"), 42, now);
        let mut conn = stack
            .tcp_connect("10.96.0.100:80".parse().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = stack.poll(now);
        assert_eq!(stack.reset_tcp_flows(), 1);
        let (out, _) = stack.poll(now);
        let rst = out
            .iter()
            .filter_map(|p| {
                let v4 = Ipv4Packet::new_checked(&p[..]).ok()?;
                TcpPacket::new_checked(v4.payload()).ok().map(|t| t.rst())
            })
            .any(|r| r);
        assert!(rst, "a RST toward the manager: {out:?}");
        let mut buf = [0u8; 16];
        let e = tokio::io::AsyncReadExt::read(&mut conn, &mut buf)
            .await
            .expect_err("a reset flow is no end of stream");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}");
        assert_eq!(stack.reset_tcp_flows(), 0, "nothing left to reset");
    }

    #[tokio::test]
    async fn a_connect_sends_a_syn_from_the_tunnel_ip_and_a_rst_refuses_it() {
        let now = Instant::now();
        let stack = Stack::new(ip("100.96.0.7"), 42, now);
        let conn = stack
            .tcp_connect("10.96.0.100:80".parse().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let (out, _) = stack.poll(now);
        assert_eq!(out.len(), 1, "one SYN");
        let v4 = Ipv4Packet::new_checked(&out[0][..]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v4.src_addr().to_string(), "100.96.0.7");
        assert_eq!(v4.dst_addr().to_string(), "10.96.0.100");
        assert_eq!(v4.next_header(), IpProtocol::Tcp);
        let syn = TcpPacket::new_checked(v4.payload()).unwrap_or_else(|e| panic!("{e}"));
        assert!(syn.syn() && !syn.ack());
        assert_eq!(syn.dst_port(), 80);
        assert_eq!(syn.src_port(), conn.local_addr().port());
        assert!(PORTS.contains(&syn.src_port()));

        // The manager answers a closed port with RST+ACK.
        let mut rst = out[0].clone();
        {
            let mut v4 = Ipv4Packet::new_unchecked(&mut rst[..]);
            let (s, d) = (v4.src_addr(), v4.dst_addr());
            v4.set_src_addr(d);
            v4.set_dst_addr(s);
            v4.fill_checksum();
            let hl = usize::from(v4.header_len());
            let seq = syn.seq_number();
            let mut tcp = TcpPacket::new_unchecked(&mut rst[hl..]);
            let (sp, dp) = (tcp.src_port(), tcp.dst_port());
            tcp.set_src_port(dp);
            tcp.set_dst_port(sp);
            tcp.set_syn(false);
            tcp.set_rst(true);
            tcp.set_ack(true);
            tcp.set_ack_number(seq + 1);
            tcp.set_seq_number(smoltcp::wire::TcpSeqNumber(0));
        }
        stack.handle_packet(rst);
        let _ = stack.poll(now);
        let err = conn
            .established()
            .await
            .expect_err("a reset connect must fail");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(stack.counters().rx_packets, 1);
        assert!(stack.counters().tx_packets >= 1);
    }

    #[test]
    fn ports_are_unique_while_in_use_and_reused_after_release() {
        let now = Instant::now();
        let stack = Stack::new(ip("100.96.0.7"), 7, now);
        let a = stack.udp_bind().unwrap_or_else(|e| panic!("{e}"));
        let b = stack.udp_bind().unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(a.local_addr().port(), b.local_addr().port());
        assert_eq!(a.local_addr().ip(), ip("100.96.0.7"));
        let port = a.local_addr().port();
        drop(a);
        assert!(!stack.lock().ports_in_use.contains(&port));
        assert_eq!(stack.open_flows(), 1);
    }
}
