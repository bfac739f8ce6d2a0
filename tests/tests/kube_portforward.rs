//! The port-forward transport's small-packet behaviour end to end on the
//! Kubernetes lab (issue [fastpath]): every packet rides `pods/portforward`
//! through the real kube-apiserver and the lab's kubelet stand-in.
//!
//! - Connection setup: sequential short TCP connections (connect, 1-byte echo,
//!   close) to the echo Service. A socket without TCP_NODELAY anywhere on the path
//!   (the data connection, the session agent's relay, the kubelet's stream to the
//!   pod) holds the second of two back-to-back small frames until the peer's
//!   delayed ACK, 40 ms: one such stall per connection (the SYN-ACK's ACK and the
//!   request go out together) capped the rate at ~25 connections/s. No single
//!   connection may take 35 ms or more: that is a stall, a functional defect, not a
//!   throughput figure (the lab does one in about 1–3 ms).
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use kvpn_lab::{ECHO_CLUSTER_IP, ECHO_SERVICE_PORT};
use kvpn_tests::kube_lab::KubeFixture;

/// Sequential connections of the setup test.
const CONNECTIONS: usize = 200;

/// A connection that takes this long has met a delayed-ACK/Nagle stall (40 ms).
const STALL: Duration = Duration::from_millis(35);

/// One short connection: connect, 1 byte out, 1 byte echoed, close. Its duration.
fn short_connection(to: SocketAddr) -> Result<Duration, String> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))
        .map_err(|e| format!("connect: {e}"))?;
    s.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| format!("read timeout: {e}"))?;
    s.write_all(b"x").map_err(|e| format!("write: {e}"))?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).map_err(|e| format!("read: {e}"))?;
    if &b != b"x" {
        return Err(format!("echoed {b:?}"));
    }
    Ok(t0.elapsed())
}

#[test]
fn short_connections_through_port_forward_never_stall() {
    let f = KubeFixture::new();
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(20));
    let echo = SocketAddr::V4(SocketAddrV4::new(ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
    // The first connection may wait for the flow table, ARP and the like.
    f.lab()
        .netns_lab()
        .run_in(kvpn_lab::LAPTOP, || short_connection(echo))
        .unwrap_or_else(|e| panic!("laptop netns: {e}"))
        .unwrap_or_else(|e| panic!("first connection: {e}\n{}", f.diagnostics()));
    let times: Vec<Result<Duration, String>> = f
        .lab()
        .netns_lab()
        .run_in(kvpn_lab::LAPTOP, || {
            (0..CONNECTIONS).map(|_| short_connection(echo)).collect()
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e}"));
    let mut ok = Vec::with_capacity(CONNECTIONS);
    for (i, t) in times.into_iter().enumerate() {
        match t {
            Ok(t) => ok.push(t),
            Err(e) => panic!("connection {i}: {e}\n{}", f.diagnostics()),
        }
    }
    let stalled: Vec<(usize, Duration)> = ok
        .iter()
        .copied()
        .enumerate()
        .filter(|(_, t)| *t >= STALL)
        .collect();
    let mut sorted = ok.clone();
    sorted.sort();
    let total: Duration = ok.iter().sum();
    eprintln!(
        "{CONNECTIONS} connections in {:.3} s ({:.1}/s): p50 {:?}, p99 {:?}, max {:?}, {} at or above {STALL:?}",
        total.as_secs_f64(),
        CONNECTIONS as f64 / total.as_secs_f64(),
        sorted[CONNECTIONS / 2],
        sorted[CONNECTIONS * 99 / 100],
        sorted[CONNECTIONS - 1],
        stalled.len()
    );
    assert!(
        stalled.is_empty(),
        "{} of {CONNECTIONS} connections through the port-forward took {STALL:?} or more \
         (a delayed-ACK/Nagle stall on the path): {:?}",
        stalled.len(),
        &stalled[..stalled.len().min(20)]
    );
}
