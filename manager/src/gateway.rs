//! The manager as egress gateway (`kvpn attach --via gateway`,
//! docs/tunnel-ownership.md): pods of an attached workload reach the laptops'
//! tunnel IPs through the manager, under one translated source, the manager's
//! own tunnel address ([`crate::engine::MANAGER_STACK_V4`]).
//!
//! Steering: an init container in each pod (`kvpn-manager gateway-route`)
//! makes a VXLAN device whose remote is the manager Service's ClusterIP on
//! [`GATEWAY_PORT`] (UDP, so kube-proxy's Service rules carry it to whichever
//! manager pod is live), a permanent neighbour [`GATEWAY_NEXT_HOP`] →
//! [`GATEWAY_MAC`] and the route `pool via GATEWAY_NEXT_HOP dev kvpn-gw onlink`,
//! then exits: kernel state only, nothing runs beside the app.
//!
//! Here: one UDP socket (unprivileged, no TUN, no capability). A datagram is a
//! VXLAN header and an Ethernet frame carrying the pod's IPv4 packet; TCP, UDP
//! and ICMP echo are translated (source address to the manager's tunnel
//! address, source port or echo id to one of [`NAT_PORTS`]) and handed to the
//! live session of the destination tunnel IP ([`Peers`]). A laptop's packet to
//! the manager's tunnel address whose destination port is a live mapping comes
//! back through [`Gateway::laptop_packet`]: translated back and sent to the pod's
//! VXLAN socket. Packets for a tunnel IP without a live session, fragments and
//! other protocols are dropped and counted.
//!
//! I/O: the UDP socket.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use kvpn_proto::attach::{GATEWAY_MAC, GATEWAY_VNI};
use tokio::net::UdpSocket;
use tracing::{debug, info, warn};

use crate::peers::Peers;

pub use kvpn_proto::attach::{GATEWAY_NEXT_HOP, GATEWAY_PORT};

/// Ports (and ICMP echo ids) of translated flows on the manager's tunnel
/// address: above the ports smoltcp's own sockets there use.
pub const NAT_PORTS: std::ops::RangeInclusive<u16> = 40000..=49999;

/// A TCP mapping idle this long is freed.
const TCP_IDLE: Duration = Duration::from_secs(600);
/// A UDP or ICMP mapping idle this long is freed.
const OTHER_IDLE: Duration = Duration::from_secs(60);
/// How often idle mappings are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

const VXLAN_HEADER: usize = 8;
const ETHERNET_HEADER: usize = 14;
const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;

/// What the gateway counted (logged, and in `kvpn diagnose`'s manager log).
#[derive(Debug, Default)]
pub struct GatewayCounters {
    /// Pod packets handed to a laptop's session.
    pub to_laptop: AtomicU64,
    /// Laptop packets sent back to a pod.
    pub to_pod: AtomicU64,
    /// Dropped: not VXLAN/IPv4, a fragment, another protocol, no session for
    /// the destination, a full session queue, no free port.
    pub dropped: AtomicU64,
}

#[derive(Debug, Clone)]
struct Mapping {
    pod: Ipv4Addr,
    pod_port: u16,
    /// Where the pod's datagrams came from (the pod's VXLAN socket, as the
    /// Service's conntrack shows it).
    outer: SocketAddr,
    /// The pod's VXLAN device (the inner frame's destination on the way back).
    pod_mac: [u8; 6],
    last: Instant,
}

/// The translation table: (protocol, pod IP, pod port) ↔ (protocol, port).
#[derive(Debug, Default)]
struct Nat {
    by_pod: HashMap<(u8, Ipv4Addr, u16), u16>,
    by_port: HashMap<(u8, u16), Mapping>,
    next: u16,
}

impl Nat {
    /// The translated port of a pod flow, allocating one (`None`: all taken).
    fn map(
        &mut self,
        proto: u8,
        pod: Ipv4Addr,
        pod_port: u16,
        outer: SocketAddr,
        pod_mac: [u8; 6],
        now: Instant,
    ) -> Option<u16> {
        if let Some(&port) = self.by_pod.get(&(proto, pod, pod_port))
            && let Some(m) = self.by_port.get_mut(&(proto, port))
        {
            m.outer = outer;
            m.pod_mac = pod_mac;
            m.last = now;
            return Some(port);
        }
        let span = u32::from(NAT_PORTS.end() - NAT_PORTS.start()) + 1;
        for _ in 0..span {
            let port = NAT_PORTS.start() + (self.next % span as u16);
            self.next = self.next.wrapping_add(1) % span as u16;
            if let std::collections::hash_map::Entry::Vacant(e) = self.by_port.entry((proto, port))
            {
                e.insert(Mapping {
                    pod,
                    pod_port,
                    outer,
                    pod_mac,
                    last: now,
                });
                self.by_pod.insert((proto, pod, pod_port), port);
                return Some(port);
            }
        }
        None
    }

    fn reverse(&mut self, proto: u8, port: u16, now: Instant) -> Option<Mapping> {
        let m = self.by_port.get_mut(&(proto, port))?;
        m.last = now;
        Some(m.clone())
    }

    fn sweep(&mut self, now: Instant) {
        let by_pod = &mut self.by_pod;
        self.by_port.retain(|&(proto, _), m| {
            let idle = if proto == TCP { TCP_IDLE } else { OTHER_IDLE };
            let keep = now.duration_since(m.last) < idle;
            if !keep {
                by_pod.remove(&(proto, m.pod, m.pod_port));
            }
            keep
        });
    }

    fn len(&self) -> usize {
        self.by_port.len()
    }
}

/// The gateway: its socket, the translation table, the sessions.
#[derive(Debug)]
pub struct Gateway {
    socket: UdpSocket,
    /// The same socket for sends from the sessions' synchronous code (a
    /// non-blocking `send_to` needs no tokio readiness).
    sender: std::net::UdpSocket,
    /// The translated source: the manager's tunnel address.
    source: Ipv4Addr,
    pool: Ipv4Net,
    peers: Peers,
    nat: Mutex<Nat>,
    pub counters: GatewayCounters,
}

impl Gateway {
    /// Bind the gateway's UDP socket.
    pub async fn bind(
        listen: SocketAddr,
        source: Ipv4Addr,
        pool: Ipv4Net,
        peers: Peers,
    ) -> anyhow::Result<Self> {
        let bound = std::net::UdpSocket::bind(listen).map_err(|e| {
            anyhow::anyhow!(
                "cannot bind the gateway's UDP socket {listen}: {e} — is another process using the port? (give --gateway-listen off to run without the gateway)"
            )
        })?;
        bound.set_nonblocking(true)?;
        let sender = bound.try_clone()?;
        let socket = UdpSocket::from_std(bound)?;
        info!(listen = %listen, source = %source, pool = %pool, "gateway listening (kvpn attach --via gateway)");
        Ok(Self {
            socket,
            sender,
            source,
            pool,
            peers,
            nat: Mutex::new(Nat::default()),
            counters: GatewayCounters::default(),
        })
    }

    /// The manager's tunnel address: the source laptops see.
    pub fn source(&self) -> Ipv4Addr {
        self.source
    }

    /// Receive pods' datagrams until the socket fails.
    pub async fn run(self: std::sync::Arc<Self>) {
        let mut buf = vec![0u8; 65536];
        let mut last_sweep = Instant::now();
        loop {
            let (n, from) = match self.socket.recv_from(&mut buf).await {
                Ok(x) => x,
                Err(e) => {
                    warn!(error = %e, "gateway socket failed; the gateway stops");
                    return;
                }
            };
            let now = Instant::now();
            if let Some(d) = buf.get_mut(..n) {
                self.pod_datagram(d, from, now);
            }
            if now.duration_since(last_sweep) >= SWEEP_EVERY {
                last_sweep = now;
                if let Ok(mut nat) = self.nat.lock() {
                    nat.sweep(now);
                    debug!(
                        mappings = nat.len(),
                        to_laptop = self.counters.to_laptop.load(Ordering::Relaxed),
                        to_pod = self.counters.to_pod.load(Ordering::Relaxed),
                        dropped = self.counters.dropped.load(Ordering::Relaxed),
                        "gateway"
                    );
                }
            }
        }
    }

    fn drop_one(&self, why: &str) {
        let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        // The first few at info (a misrouted setup shows at once), then debug.
        if n < 20 {
            info!(why, dropped = n + 1, "gateway dropped a packet");
        } else {
            debug!(why, "gateway dropped a packet");
        }
    }

    /// One datagram from a pod.
    fn pod_datagram(&self, datagram: &mut [u8], from: SocketAddr, now: Instant) {
        let ethertype = datagram
            .get(VXLAN_HEADER + 12..VXLAN_HEADER + 14)
            .map(|b| u16::from_be_bytes([b[0], b[1]]));
        if ethertype.is_some_and(|t| t != 0x0800) {
            // IPv6 neighbour discovery and MLD of the pod's VXLAN device, ARP:
            // not the gateway's, not worth a line.
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Some((pod_mac, packet)) = decap(datagram) else {
            if self.counters.dropped.load(Ordering::Relaxed) < 20 {
                info!(from = %from, head = ?datagram.get(..VXLAN_HEADER + ETHERNET_HEADER), "gateway: not a VXLAN frame with IPv4 for it");
            }
            return self.drop_one("not a VXLAN frame with IPv4 for the gateway");
        };
        let Some(h) = Header::parse(packet) else {
            if self.counters.dropped.load(Ordering::Relaxed) < 20 {
                info!(from = %from, head = ?packet.get(..24), "gateway: not a translatable IPv4 packet");
            }
            return self.drop_one("not a translatable IPv4 packet");
        };
        if !self.pool.contains(&h.dst) || h.dst == self.source {
            return self.drop_one("destination outside the tunnel pool");
        }
        let Some(pod_port) = h.src_port(packet) else {
            return self.drop_one("not TCP, UDP or ICMP echo request");
        };
        let port = match self.nat.lock() {
            Ok(mut nat) => {
                let before = nat.len();
                let port = nat.map(h.proto, h.src, pod_port, from, pod_mac, now);
                if nat.len() > before {
                    info!(
                        proto = h.proto,
                        pod = %h.src,
                        pod_port,
                        outer = %from,
                        to = %h.dst,
                        port = port.unwrap_or(0),
                        "gateway: new translated flow"
                    );
                }
                port
            }
            Err(_) => None,
        };
        let Some(port) = port else {
            return self.drop_one("no free gateway port");
        };
        rewrite(packet, &h, Some(self.source), Some(port), None, None);
        match self.peers.try_send(h.dst.into(), packet) {
            Some(true) => {
                self.counters.to_laptop.fetch_add(1, Ordering::Relaxed);
            }
            Some(false) => self.drop_one("the laptop's session queue is full"),
            None => self.drop_one("no live session for the destination tunnel IP"),
        }
    }

    /// A laptop's packet to the manager's tunnel address: true when it belongs
    /// to a translated flow (and was sent back to its pod, or dropped), false
    /// when it is the engine's.
    pub fn laptop_packet(&self, packet: &[u8]) -> bool {
        let Some(h) = Header::parse(packet) else {
            return false;
        };
        if h.dst != self.source {
            return false;
        }
        let Some(port) = h.dst_port(packet) else {
            return false;
        };
        if !NAT_PORTS.contains(&port) {
            return false;
        }
        let m = match self.nat.lock() {
            Ok(mut nat) => nat.reverse(h.proto, port, Instant::now()),
            Err(_) => None,
        };
        let Some(m) = m else {
            return false;
        };
        let mut out = Vec::with_capacity(VXLAN_HEADER + ETHERNET_HEADER + packet.len());
        out.extend_from_slice(&vxlan_header());
        out.extend_from_slice(&m.pod_mac);
        out.extend_from_slice(&GATEWAY_MAC);
        out.extend_from_slice(&ETHERTYPE_IPV4);
        let at = out.len();
        out.extend_from_slice(packet);
        if let Some(p) = out.get_mut(at..) {
            rewrite(p, &h, None, None, Some(m.pod), Some(m.pod_port));
        }
        match self.sender.send_to(&out, m.outer) {
            Ok(_) => {
                self.counters.to_pod.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.drop_one("the gateway socket refused the send");
                debug!(error = %e, to = %m.outer, "gateway send failed");
            }
        }
        true
    }
}

fn vxlan_header() -> [u8; VXLAN_HEADER] {
    let vni = GATEWAY_VNI.to_be_bytes();
    [0x08, 0, 0, 0, vni[1], vni[2], vni[3], 0]
}

/// The pod's MAC and the IPv4 packet of a VXLAN datagram for the gateway.
fn decap(d: &mut [u8]) -> Option<([u8; 6], &mut [u8])> {
    let vx = d.get(..VXLAN_HEADER)?;
    if vx.first()? & 0x08 == 0 || vx.get(4..7)? != &vxlan_header()[4..7] {
        return None;
    }
    let eth = d.get(VXLAN_HEADER..VXLAN_HEADER + ETHERNET_HEADER)?;
    if eth.get(..6)? != GATEWAY_MAC || eth.get(12..14)? != ETHERTYPE_IPV4 {
        return None;
    }
    let mac: [u8; 6] = eth.get(6..12)?.try_into().ok()?;
    Some((mac, d.get_mut(VXLAN_HEADER + ETHERNET_HEADER..)?))
}

/// The fields of an IPv4 packet the gateway reads.
#[derive(Debug, Clone, Copy)]
struct Header {
    ihl: usize,
    total: usize,
    proto: u8,
    src: Ipv4Addr,
    dst: Ipv4Addr,
}

impl Header {
    /// An unfragmented IPv4 TCP, UDP or ICMP packet with its whole L4 header.
    fn parse(p: &[u8]) -> Option<Self> {
        let b0 = *p.first()?;
        if b0 >> 4 != 4 {
            return None;
        }
        let ihl = usize::from(b0 & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([*p.get(2)?, *p.get(3)?]));
        if ihl < 20 || total < ihl || total > p.len() {
            return None;
        }
        let frag = u16::from_be_bytes([*p.get(6)?, *p.get(7)?]);
        if frag & 0x3fff != 0 {
            // More fragments or an offset: not translatable without reassembly.
            return None;
        }
        let proto = *p.get(9)?;
        let l4 = total - ihl;
        let need = match proto {
            TCP => 20,
            UDP => 8,
            ICMP => 8,
            _ => return None,
        };
        if l4 < need {
            return None;
        }
        let src: [u8; 4] = p.get(12..16)?.try_into().ok()?;
        let dst: [u8; 4] = p.get(16..20)?.try_into().ok()?;
        Some(Self {
            ihl,
            total,
            proto,
            src: src.into(),
            dst: dst.into(),
        })
    }

    fn u16_at(p: &[u8], at: usize) -> Option<u16> {
        Some(u16::from_be_bytes([*p.get(at)?, *p.get(at + 1)?]))
    }

    /// TCP/UDP source port, or the id of an ICMP echo request.
    fn src_port(&self, p: &[u8]) -> Option<u16> {
        match self.proto {
            TCP | UDP => Self::u16_at(p, self.ihl),
            ICMP if p.get(self.ihl) == Some(&8) => Self::u16_at(p, self.ihl + 4),
            _ => None,
        }
    }

    /// TCP/UDP destination port, or the id of an ICMP echo reply.
    fn dst_port(&self, p: &[u8]) -> Option<u16> {
        match self.proto {
            TCP | UDP => Self::u16_at(p, self.ihl + 2),
            ICMP if p.get(self.ihl) == Some(&0) => Self::u16_at(p, self.ihl + 4),
            _ => None,
        }
    }
}

/// Rewrite the source and/or destination (address, port or echo id) of `p`
/// and recompute its checksums (the pod's kernel may have left the L4
/// checksum to an offload that VXLAN over veth never completed).
fn rewrite(
    p: &mut [u8],
    h: &Header,
    src: Option<Ipv4Addr>,
    src_port: Option<u16>,
    dst: Option<Ipv4Addr>,
    dst_port: Option<u16>,
) {
    let Some(p) = p.get_mut(..h.total) else {
        return;
    };
    if let (Some(a), Some(f)) = (src, p.get_mut(12..16)) {
        f.copy_from_slice(&a.octets());
    }
    if let (Some(a), Some(f)) = (dst, p.get_mut(16..20)) {
        f.copy_from_slice(&a.octets());
    }
    let l4 = h.ihl;
    let (sp_at, dp_at, csum_at) = match h.proto {
        TCP => (l4, l4 + 2, l4 + 16),
        UDP => (l4, l4 + 2, l4 + 6),
        // Echo id for both directions.
        _ => (l4 + 4, l4 + 4, l4 + 2),
    };
    if let (Some(v), Some(f)) = (src_port, p.get_mut(sp_at..sp_at + 2)) {
        f.copy_from_slice(&v.to_be_bytes());
    }
    if let (Some(v), Some(f)) = (dst_port, p.get_mut(dp_at..dp_at + 2)) {
        f.copy_from_slice(&v.to_be_bytes());
    }
    // IPv4 header checksum.
    if let Some(f) = p.get_mut(10..12) {
        f.copy_from_slice(&[0, 0]);
    }
    let c = checksum(0, p.get(..h.ihl).unwrap_or_default());
    if let Some(f) = p.get_mut(10..12) {
        f.copy_from_slice(&c.to_be_bytes());
    }
    // L4 checksum over the whole segment (and the pseudo-header for TCP/UDP).
    if let Some(f) = p.get_mut(csum_at..csum_at + 2) {
        f.copy_from_slice(&[0, 0]);
    }
    let seg = p.get(l4..).unwrap_or_default();
    let mut sum = 0u32;
    if h.proto != ICMP {
        for w in p.get(12..20).unwrap_or_default().chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
        }
        sum += u32::from(h.proto);
        sum += seg.len() as u32;
    }
    let mut c = checksum(sum, seg);
    if h.proto == UDP && c == 0 {
        c = 0xffff;
    }
    if let Some(f) = p.get_mut(csum_at..csum_at + 2) {
        f.copy_from_slice(&c.to_be_bytes());
    }
}

/// The Internet checksum of `data` with `sum` already added.
fn checksum(mut sum: u32, data: &[u8]) -> u16 {
    let mut chunks = data.chunks_exact(2);
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let Some(&b) = chunks.remainder().first() {
        sum += u32::from(b) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A UDP packet src:sp → dst:dp with `payload`, checksums valid.
    fn udp(src: [u8; 4], sp: u16, dst: [u8; 4], dp: u16, payload: &[u8]) -> Vec<u8> {
        let total = 28 + payload.len();
        let mut p = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, UDP, 0, 0];
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p.extend_from_slice(&src);
        p.extend_from_slice(&dst);
        p.extend_from_slice(&sp.to_be_bytes());
        p.extend_from_slice(&dp.to_be_bytes());
        p.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(payload);
        let h = Header::parse(&p).expect("parse");
        rewrite(&mut p, &h, None, None, None, None);
        p
    }

    fn valid(p: &[u8]) -> bool {
        let h = Header::parse(p).expect("parse");
        let ip_ok = checksum(0, &p[..h.ihl]) == 0;
        let seg = &p[h.ihl..h.total];
        let mut sum = 0u32;
        for w in p[12..20].chunks(2) {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        sum += u32::from(h.proto) + seg.len() as u32;
        ip_ok && checksum(sum, seg) == 0
    }

    fn framed(mac: [u8; 6], packet: &[u8]) -> Vec<u8> {
        let mut d = vxlan_header().to_vec();
        d.extend_from_slice(&GATEWAY_MAC);
        d.extend_from_slice(&mac);
        d.extend_from_slice(&ETHERTYPE_IPV4);
        d.extend_from_slice(packet);
        d
    }

    /// Two pods' packets to one laptop leave with one source (the manager's
    /// tunnel address) and distinct ports; the laptop's replies go back to
    /// each pod's own address and port, with valid checksums.
    #[tokio::test]
    async fn two_pods_one_source_and_back() {
        let peers = Peers::default();
        let laptop: Ipv4Addr = "100.96.0.7".parse().expect("ip");
        let (tx, mut rx) = mpsc::channel(16);
        let _reg = peers.register(laptop.into(), 0, tx);
        let gw = Gateway::bind(
            "127.0.0.1:0".parse().expect("addr"),
            "100.96.0.1".parse().expect("ip"),
            "100.96.0.0/16".parse().expect("net"),
            peers,
        )
        .await
        .expect("bind");
        // Two "pods": UDP sockets standing for their VXLAN sockets.
        let pod_a = UdpSocket::bind("127.0.0.1:0").await.expect("bind a");
        let pod_b = UdpSocket::bind("127.0.0.1:0").await.expect("bind b");
        let now = Instant::now();
        let mut sources = Vec::new();
        for (pod, ip, mac) in [
            (&pod_a, [10, 244, 0, 5], [2, 0, 0, 0, 0, 0xa]),
            (&pod_b, [10, 244, 1, 6], [2, 0, 0, 0, 0, 0xb]),
        ] {
            let mut d = framed(mac, &udp(ip, 5353, laptop.octets(), 8080, b"hi"));
            gw.pod_datagram(&mut d, pod.local_addr().expect("addr"), now);
            let frame = rx.try_recv().expect("handed to the laptop's session");
            let packet = &frame[kvpn_proto::frame::HEADER_LEN..];
            assert!(valid(packet), "checksums after translation");
            let h = Header::parse(packet).expect("parse");
            assert_eq!(h.src, gw.source());
            assert_eq!(h.dst, laptop);
            let port = h.src_port(packet).expect("port");
            assert!(NAT_PORTS.contains(&port));
            sources.push((h.src, port));
            // The laptop answers the translated address.
            let reply = udp(laptop.octets(), 8080, gw.source().octets(), port, b"ok");
            assert!(gw.laptop_packet(&reply), "a mapped flow is the gateway's");
            let mut buf = [0u8; 2048];
            let (n, _) = tokio::time::timeout(Duration::from_secs(2), pod.recv_from(&mut buf))
                .await
                .expect("reply in time")
                .expect("recv");
            let (dst_mac, back) = {
                let d = &buf[..n];
                assert_eq!(&d[..VXLAN_HEADER], &vxlan_header());
                let e = &d[VXLAN_HEADER..VXLAN_HEADER + ETHERNET_HEADER];
                (
                    e[..6].to_vec(),
                    d[VXLAN_HEADER + ETHERNET_HEADER..].to_vec(),
                )
            };
            assert_eq!(dst_mac, mac, "the pod's own VXLAN device");
            assert!(valid(&back));
            let hb = Header::parse(&back).expect("parse");
            assert_eq!(hb.dst, Ipv4Addr::from(ip));
            assert_eq!(hb.dst_port(&back), Some(5353));
            assert_eq!(hb.src, laptop);
        }
        assert_eq!(sources[0].0, sources[1].0, "one source for both pods");
        assert_ne!(sources[0].1, sources[1].1, "distinct ports");
        assert_eq!(gw.counters.to_laptop.load(Ordering::Relaxed), 2);
        assert_eq!(gw.counters.to_pod.load(Ordering::Relaxed), 2);
        // Not the gateway's: an unmapped port, another destination.
        let other = udp(laptop.octets(), 8080, gw.source().octets(), 53, b"");
        assert!(!gw.laptop_packet(&other));
        let peer = udp(laptop.octets(), 8080, [100, 96, 0, 9], 40000, b"");
        assert!(!gw.laptop_packet(&peer));
    }

    /// A pod packet for a tunnel IP without a session, outside the pool, or
    /// without the gateway's VXLAN framing is dropped and counted.
    #[tokio::test]
    async fn drops_are_counted() {
        let gw = Gateway::bind(
            "127.0.0.1:0".parse().expect("addr"),
            "100.96.0.1".parse().expect("ip"),
            "100.96.0.0/16".parse().expect("net"),
            Peers::default(),
        )
        .await
        .expect("bind");
        let from: SocketAddr = "127.0.0.1:9".parse().expect("addr");
        let now = Instant::now();
        let mac = [2, 0, 0, 0, 0, 1];
        let mut no_session = framed(mac, &udp([10, 0, 0, 1], 1, [100, 96, 3, 3], 2, b""));
        gw.pod_datagram(&mut no_session, from, now);
        let mut outside = framed(mac, &udp([10, 0, 0, 1], 1, [10, 96, 3, 3], 2, b""));
        gw.pod_datagram(&mut outside, from, now);
        let mut garbage = vec![0u8; 40];
        gw.pod_datagram(&mut garbage, from, now);
        assert_eq!(gw.counters.dropped.load(Ordering::Relaxed), 3);
        assert_eq!(gw.counters.to_laptop.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn idle_mappings_are_swept_and_ports_reused() {
        let mut nat = Nat::default();
        let t0 = Instant::now();
        let outer: SocketAddr = "10.0.0.1:10805".parse().expect("addr");
        let ip: Ipv4Addr = "10.244.0.5".parse().expect("ip");
        let p = nat.map(UDP, ip, 1000, outer, [0; 6], t0).expect("port");
        assert_eq!(
            nat.map(UDP, ip, 1000, outer, [0; 6], t0),
            Some(p),
            "same flow, same port"
        );
        let t = nat.map(TCP, ip, 1000, outer, [0; 6], t0).expect("tcp port");
        nat.sweep(t0 + OTHER_IDLE + Duration::from_secs(1));
        assert!(nat.reverse(UDP, p, t0).is_none(), "idle UDP swept");
        assert!(nat.reverse(TCP, t, t0).is_some(), "TCP kept longer");
        assert_eq!(nat.len(), 1);
    }
}
