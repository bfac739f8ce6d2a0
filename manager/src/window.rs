//! The advertised receive window of a data connection's TCP flows, from the
//! connection's round trip (docs/queues.md, "Small packets behind bulk data").
//!
//! smoltcp advertises the free space of a flow's receive buffer, and the
//! tunnel loses nothing, so a laptop's bulk upload keeps the whole buffer in
//! flight; on a short path most of it waits in the tunnel's queues (the
//! laptop's TUN queue and pump, the data connection's socket buffers, the
//! session's intake), where every other packet of the same worker — a ping,
//! an RPC — waits behind it. smoltcp 0.14 cannot shrink a live socket's
//! buffer, so the window is chosen when a flow is made: each data connection
//! sizes its flows' buffers for the bandwidth-delay product of
//! [`WINDOW_RATE_BYTES_PER_US`] at the connection's round trip, measured by
//! the kernel on the accepted socket (TCP_INFO, the SYN-ACK's sample), at
//! least [`MIN_TCP_WINDOW`] and at most the manager's `--tcp-window`.
//!
//! A connection from loopback came through `kubectl port-forward` (the API
//! server, often over SSH): the round trip the manager sees is the pod's
//! loopback, not the laptop's, so those flows keep the full `--tcp-window`.
//! Pure but for [`connection_rtt`].

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

/// The smallest window [`flow_window`] chooses, bytes. It covers the time a
/// packet spends in the processes of a short path (the pump, the session's
/// engine, the destination socket's write) rather than the wire, which on a
/// busy machine is hundreds of µs: through the lab's veth path one flow
/// uploads as fast with 256 KiB as with 512 KiB, but 10–25% slower and at
/// 15–40% more CPU per Gbit with 64 KiB (docs/queues.md).
pub const MIN_TCP_WINDOW: usize = 256 * 1024;

/// The per-flow rate the window is sized for, bytes per µs: 1250, i.e.
/// 10 Gbit/s, above what one flow through kvpn reaches.
pub const WINDOW_RATE_BYTES_PER_US: usize = 1250;

/// The receive buffer for the TCP flows of a data connection from `peer`
/// whose kernel-measured round trip is `rtt` (`None`: unknown), given the
/// manager's `--tcp-window` `max`: `max` for loopback peers (port-forward)
/// and unknown round trips, else the bandwidth-delay product of
/// [`WINDOW_RATE_BYTES_PER_US`] clamped to [`MIN_TCP_WINDOW`]`..=max`.
pub fn flow_window(peer: IpAddr, rtt: Option<Duration>, max: usize) -> usize {
    if peer.to_canonical().is_loopback() {
        return max;
    }
    let Some(rtt) = rtt.filter(|r| !r.is_zero()) else {
        return max;
    };
    let micros = usize::try_from(rtt.as_micros()).unwrap_or(usize::MAX);
    micros
        .saturating_mul(WINDOW_RATE_BYTES_PER_US)
        .clamp(MIN_TCP_WINDOW.min(max), max)
}

/// The kernel's smoothed round trip of a connected TCP socket (TCP_INFO
/// `tcpi_rtt`); `None` before the kernel took a sample.
pub fn connection_rtt(socket: &impl AsFd) -> io::Result<Option<Duration>> {
    // SAFETY: tcp_info is plain old data; zero is valid.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: info is a live tcp_info of `len` bytes; the kernel writes at
    // most `len` bytes and stores the length it wrote.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::addr_of_mut!(info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(Duration::from_micros(u64::from(info.tcpi_rtt))).filter(|r| !r.is_zero()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const MAX: usize = crate::engine::TCP_RX_BUFFER;
    const REMOTE: IpAddr = IpAddr::V4(Ipv4Addr::new(172, 31, 255, 2));

    fn us(n: u64) -> Option<Duration> {
        Some(Duration::from_micros(n))
    }

    #[test]
    fn short_paths_get_the_floor() {
        assert_eq!(flow_window(REMOTE, us(6), MAX), MIN_TCP_WINDOW);
        assert_eq!(flow_window(REMOTE, us(200), MAX), MIN_TCP_WINDOW);
    }

    #[test]
    fn the_window_follows_the_round_trip_between_floor_and_max() {
        assert_eq!(flow_window(REMOTE, us(300), MAX), 375_000);
        assert_eq!(flow_window(REMOTE, us(400), MAX), 500_000);
        assert_eq!(flow_window(REMOTE, us(420), MAX), MAX);
        // Real clusters: 10-100 ms; never below what --tcp-window gave before.
        assert_eq!(flow_window(REMOTE, us(10_000), MAX), MAX);
        assert_eq!(flow_window(REMOTE, us(100_000), MAX), MAX);
        assert_eq!(flow_window(REMOTE, Some(Duration::MAX), MAX), MAX);
    }

    #[test]
    fn port_forward_and_unknown_round_trips_keep_the_maximum() {
        for peer in [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped()),
        ] {
            assert_eq!(flow_window(peer, us(6), MAX), MAX, "{peer}");
        }
        assert_eq!(flow_window(REMOTE, None, MAX), MAX);
        assert_eq!(flow_window(REMOTE, Some(Duration::ZERO), MAX), MAX);
    }

    #[test]
    fn a_maximum_below_the_floor_wins() {
        assert_eq!(flow_window(REMOTE, us(6), 16 * 1024), 16 * 1024);
    }

    #[test]
    fn an_accepted_socket_has_a_round_trip_at_once() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let client = std::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .expect("connect loopback");
        let (accepted, _) = listener.accept().expect("accept");
        let rtt = connection_rtt(&accepted)
            .expect("TCP_INFO")
            .expect("the SYN-ACK gave a sample");
        assert!(rtt < Duration::from_secs(1), "{rtt:?}");
        drop(client);
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
        assert!(connection_rtt(&udp).is_err(), "TCP_INFO on UDP");
    }
}
