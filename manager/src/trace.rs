//! Source tracing for `kvpn diagnose source` (gRPC `TraceSource`): the source of
//! the next flow to one destination, seen at two points in the manager pod —
//! after decapsulation (the laptop packet as the session reads it from the data
//! channel) and at the pod's egress interface (what leaves for the node). The
//! third point, the backend's view, is the laptop's to ask.
//!
//! [`SourceTrace`] is shared by every session; while nothing is armed a laptop
//! packet costs one relaxed atomic load. [`parse_l4`] is pure; [`EgressCapture`]
//! is the I/O: one AF_PACKET socket (needs NET_RAW) bound to the egress interface,
//! keeping only outgoing packets (`PACKET_OUTGOING`, packet(7)), which the kernel
//! hands to packet sockets after the pod's netfilter hooks, so a packet an
//! nftables rule in the pod drops is never seen there.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// IP protocol numbers traced.
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// What is watched and what was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watch {
    pub protocol: u8,
    pub destination: SocketAddrV4,
    pub decapsulated: Option<SocketAddrV4>,
}

/// The armed trace of a manager (at most one).
#[derive(Debug, Default)]
pub struct SourceTrace {
    armed: AtomicBool,
    watch: Mutex<Option<Watch>>,
}

impl SourceTrace {
    /// Arms a watch for `protocol` to `destination`; false when one is armed.
    pub fn arm(&self, protocol: u8, destination: SocketAddrV4) -> bool {
        let Ok(mut w) = self.watch.lock() else {
            return false;
        };
        if w.is_some() {
            return false;
        }
        *w = Some(Watch {
            protocol,
            destination,
            decapsulated: None,
        });
        self.armed.store(true, Ordering::Release);
        true
    }

    /// Ends the watch; what it saw.
    pub fn disarm(&self) -> Option<Watch> {
        self.armed.store(false, Ordering::Release);
        self.watch.lock().ok().and_then(|mut w| w.take())
    }

    /// The decapsulated source seen so far.
    pub fn decapsulated(&self) -> Option<SocketAddrV4> {
        self.watch.lock().ok()?.as_ref()?.decapsulated
    }

    /// Called with every laptop packet a session decapsulates.
    pub fn observe_laptop_packet(&self, packet: &[u8]) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        let Some((protocol, src, dst)) = parse_l4(packet) else {
            return;
        };
        if let Ok(mut w) = self.watch.lock()
            && let Some(w) = w.as_mut()
            && w.decapsulated.is_none()
            && w.protocol == protocol
            && w.destination == dst
        {
            w.decapsulated = Some(src);
        }
    }
}

/// (protocol, source, destination) of an IPv4 TCP or UDP packet; `None` for
/// anything else, short packets and non-first fragments. Never panics.
pub fn parse_l4(packet: &[u8]) -> Option<(u8, SocketAddrV4, SocketAddrV4)> {
    let ip = smoltcp::wire::Ipv4Packet::new_checked(packet).ok()?;
    if ip.frag_offset() != 0 {
        return None;
    }
    let protocol = u8::from(ip.next_header());
    if protocol != TCP && protocol != UDP {
        return None;
    }
    let l4 = ip.payload();
    let ports = l4.get(..4)?;
    let sport = u16::from_be_bytes([ports[0], ports[1]]);
    let dport = u16::from_be_bytes([ports[2], ports[3]]);
    Some((
        protocol,
        SocketAddrV4::new(Ipv4Addr::from(ip.src_addr().octets()), sport),
        SocketAddrV4::new(Ipv4Addr::from(ip.dst_addr().octets()), dport),
    ))
}

/// `packet(7)`'s `PACKET_OUTGOING`.
const PACKET_OUTGOING: u8 = 4;

/// An AF_PACKET socket on the egress interface (see the module docs).
#[derive(Debug)]
pub struct EgressCapture {
    fd: std::os::fd::OwnedFd,
    pub interface: String,
}

impl EgressCapture {
    /// Opens the capture on `interface` (needs NET_RAW in the pod).
    pub fn open(interface: &str) -> std::io::Result<EgressCapture> {
        use std::os::fd::FromRawFd as _;
        let name = std::ffi::CString::new(interface)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: the string is NUL-terminated and lives across the call.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(std::io::Error::last_os_error());
        }
        // ETH_P_ALL: outgoing packets reach only the "all protocols" taps
        // (dev_queue_xmit_nit, net/core/dev.c); an ETH_P_IP socket sees input only.
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); ownership goes to OwnedFd below.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_DGRAM, i32::from(proto)) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: raw is a fresh descriptor nobody else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is plain old data; zero is valid.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = index as i32;
        use std::os::fd::AsRawFd as _;
        // SAFETY: the address points to a live sockaddr_ll of the given size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 50_000,
        };
        // SAFETY: tv is a live timeval of the given size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(tv).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        Ok(EgressCapture {
            fd,
            interface: interface.to_owned(),
        })
    }

    /// Blocks until an outgoing packet of `protocol` to `destination` is seen
    /// (its source) or until `deadline`, or `stop()` says so.
    pub fn first_source(
        &self,
        protocol: u8,
        destination: SocketAddrV4,
        deadline: Instant,
        stop: impl Fn() -> bool,
    ) -> Option<SocketAddrV4> {
        use std::os::fd::AsRawFd as _;
        let mut buf = [0u8; 128];
        while Instant::now() < deadline && !stop() {
            // SAFETY: sockaddr_ll is plain old data; zero is valid.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: buffer and address are live and of the given sizes.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_TRUNC,
                    std::ptr::addr_of_mut!(from).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                continue;
            }
            if from.sll_pkttype != PACKET_OUTGOING
                || from.sll_protocol != (libc::ETH_P_IP as u16).to_be()
            {
                continue;
            }
            let n = (n as usize).min(buf.len());
            if let Some((p, src, dst)) = buf.get(..n).and_then(parse_l4)
                && p == protocol
                && dst == destination
            {
                return Some(src);
            }
        }
        None
    }
}

/// How long a trace may watch at most.
pub const MAX_TRACE: Duration = Duration::from_secs(30);

#[cfg(test)]
mod tests {
    use super::*;

    fn udp(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16) -> Vec<u8> {
        let mut p = vec![0u8; 28];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&28u16.to_be_bytes());
        p[8] = 64;
        p[9] = UDP;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p[20..22].copy_from_slice(&sport.to_be_bytes());
        p[22..24].copy_from_slice(&dport.to_be_bytes());
        p[24..26].copy_from_slice(&8u16.to_be_bytes());
        p
    }

    #[test]
    fn armed_trace_records_the_first_matching_source_only() {
        let t = SourceTrace::default();
        let dst = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 102), 7);
        t.observe_laptop_packet(&udp([100, 96, 0, 2], 5000, [10, 96, 0, 102], 7));
        assert!(t.arm(UDP, dst));
        assert!(!t.arm(UDP, dst), "one trace at a time");
        assert_eq!(t.decapsulated(), None, "packets before arming do not count");
        t.observe_laptop_packet(&udp([100, 96, 0, 2], 5001, [10, 96, 0, 103], 7));
        t.observe_laptop_packet(&udp([100, 96, 0, 2], 5002, [10, 96, 0, 102], 7));
        t.observe_laptop_packet(&udp([100, 96, 0, 3], 5003, [10, 96, 0, 102], 7));
        assert_eq!(
            t.decapsulated(),
            Some(SocketAddrV4::new(Ipv4Addr::new(100, 96, 0, 2), 5002))
        );
        assert!(t.disarm().is_some());
        assert!(t.arm(TCP, dst));
    }

    #[test]
    fn parse_l4_rejects_garbage_without_panicking() {
        assert_eq!(parse_l4(&[]), None);
        assert_eq!(parse_l4(&[0x45; 20]), None);
        let p = udp([1, 2, 3, 4], 1, [5, 6, 7, 8], 2);
        assert!(parse_l4(&p).is_some());
        for n in 0..p.len() {
            let _ = parse_l4(&p[..n]);
        }
    }
}
