//! A paced flood of new flows from a laptop netns, for the flood-fairness
//! bench row (bench/src/fairness.rs) and test (tests/tests/flood_fairness.rs):
//! TCP SYNs to closed ports from a raw socket, or 64-byte UDP datagrams to
//! closed ports, each packet a new 5-tuple, so each one is a new flow for the
//! traffic manager. The packets leave through the laptop's routes (kvpn's TUN
//! device) like any program's.
//!
//! I/O: one raw IPv4 socket or one UDP socket inside the named netns, on a
//! thread of its own.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::packets::tcp_syn;
use crate::{Result, run_in_netns};

/// What a flood sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flood {
    /// TCP SYNs (raw socket, source = the laptop's tunnel IP), a new closed
    /// port each.
    Syn,
    /// 64-byte UDP datagrams, a new closed port each.
    Udp,
}

/// Packet `i` of a flood: (the laptop's source port, the closed destination
/// port). Destination ports cycle through 20000–49999 (iperf3's 5201 and the
/// lab's 7007/8080 are not among them), the source port moves on after each
/// cycle, so no two packets of a run share a 5-tuple.
pub fn flood_ports(i: u64) -> (u16, u16) {
    // Cannot truncate: the moduli keep both below 65,535.
    let dst = 20_000 + (i % 30_000) as u16;
    let src = 1024 + (i / 30_000 % 60_000) as u16;
    (src, dst)
}

/// A running flood; [`Flooder::stop`] ends it.
#[derive(Debug)]
pub struct Flooder {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<u64>>,
}

impl Flooder {
    /// Sends `kind` from netns `netns` to `dst` (the flood's destination
    /// address; ports from [`flood_ports`]) at `pps` packets/s, packets
    /// numbered from `first`. A SYN's source address is `src` (the laptop's
    /// tunnel IP: a raw socket does not pick one).
    pub fn start(
        netns: &str,
        kind: Flood,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        pps: u64,
        first: u64,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let netns = netns.to_owned();
        let thread = std::thread::spawn(move || {
            run_in_netns(&netns, move || send(kind, src, dst, pps, first, &flag))?
        });
        Flooder { stop, thread }
    }

    /// Stops the flood; returns the packets it offered (a full socket buffer
    /// counts as offered: the flood is an offered load).
    pub fn stop(self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_else(|_| {
            Err(crate::LabError::Invalid {
                what: "flood thread",
                value: "panicked".to_owned(),
                why: "see the test output",
            })
        })
    }
}

fn send(
    kind: Flood,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    pps: u64,
    first: u64,
    stop: &AtomicBool,
) -> Result<u64> {
    let io = |e: std::io::Error| crate::LabError::Io {
        what: "flood socket".to_owned(),
        source: e,
    };
    let raw = Socket::new(
        Domain::IPV4,
        Type::RAW,
        Some(Protocol::from(libc::IPPROTO_RAW)),
    )
    .map_err(io)?;
    raw.set_nonblocking(true).map_err(io)?;
    let udp = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(io)?;
    udp.set_nonblocking(true).map_err(io)?;
    let payload = [0x66u8; 64];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let due = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX) * pps / 1_000_000;
        while sent < due {
            let (src_port, port) = flood_ports(first + sent);
            // EAGAIN (a full socket buffer) is part of the offered load.
            let _ = match kind {
                Flood::Syn => {
                    let to = SocketAddrV4::new(dst, port);
                    let syn = tcp_syn(SocketAddrV4::new(src, src_port), to);
                    raw.send_to(&syn, &SockAddr::from(SocketAddr::V4(to)))
                }
                Flood::Udp => udp.send_to(&payload, (dst, port)),
            };
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flood_ports_never_repeat_a_pair_within_a_long_run() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..200_000 {
            let (src, dst) = flood_ports(i);
            assert!((20_000..50_000).contains(&dst) && src >= 1024);
            assert!(seen.insert((src, dst)), "packet {i} repeats a 5-tuple");
        }
    }
}
