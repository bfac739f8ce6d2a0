//! The port-forward transport's small-packet behaviour end to end on the
//! Kubernetes lab on two real nodes (issue [fastpath], #23): every packet rides
//! `pods/portforward` through the real kube-apiserver, a real kubelet 1.20 and
//! containerd's streaming server into the manager's runc container.
//!
//! - Connection setup: sequential short TCP connections (connect, 1-byte echo,
//!   close) to the echo Service. A socket without TCP_NODELAY anywhere on the path
//!   (the data connection, the session agent's relay, the kubelet's stream to the
//!   pod) holds the second of two back-to-back small frames until the peer's
//!   delayed ACK, 40 ms: one such stall per connection (the SYN-ACK's ACK and the
//!   request go out together) capped the rate at ~25 connections/s. No single
//!   connection may take 35 ms or more: that is a stall, a functional defect, not a
//!   throughput figure (the lab does one in about 1–5 ms). [`SCHEDULING_SLACK`]
//!   connections may, for a runner so overloaded that a thread waits that long for
//!   a core (seen: 2 of 200 in a debug build next to another lab's iperf3); the
//!   defect stalled 117–167 of 200. The load test of this file does not run at
//!   the same time ([`SERIAL`]).
//!
//! Needs the workspace binaries (`cargo build --bins`, then `KVPN_BIN_DIR`) and the
//! Kubernetes binaries of `scripts/build-kubernetes.sh`.

use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::time::{Duration, Instant};

use kvpn_lab::k8s::workloads::DEV_NAMESPACE;
use kvpn_lab::{ECHO_CLUSTER_IP, ECHO_SERVICE_PORT};
use kvpn_tests::kube_lab::{KubeFixture, pod_ip};

/// Sequential connections of the setup test.
const CONNECTIONS: usize = 200;

/// A connection that takes this long has met a delayed-ACK/Nagle stall (40 ms).
const STALL: Duration = Duration::from_millis(35);

/// Connections of [`CONNECTIONS`] allowed to reach [`STALL`] anyway (5 %): an
/// overloaded machine's scheduling, not the path. A socket with Nagle on any hop
/// stalls more than 40 % of them (84 of 200 with only the kube client's left on).
const SCHEDULING_SLACK: usize = 10;

/// The two tests of this file one at a time: the load test's iperf3 would take
/// the cores the setup test's connections wait for.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// [`SERIAL`], also after the other test failed while holding it.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

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
    let _serial = one_at_a_time();
    let f = KubeFixture::real_nodes(2);
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
        stalled.len() <= SCHEDULING_SLACK,
        "{} of {CONNECTIONS} connections through the port-forward took {STALL:?} or more \
         (a delayed-ACK/Nagle stall on the path): {:?}",
        stalled.len(),
        &stalled[..stalled.len().min(20)]
    );
}

/// The iperf3 server of the load test, in a web pod's netns; killed on drop.
struct Iperf3Server(std::process::Child);

impl Drop for Iperf3Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Port of the load test's iperf3 server (the web pods listen on 80 only).
const IPERF_PORT: u16 = 5201;

/// `sessions[0].liveness.transports_lost` of `kvpn status`.
fn transports_lost(f: &KubeFixture) -> u64 {
    let s = f.session();
    s["liveness"]["transports_lost"]
        .as_u64()
        .unwrap_or_else(|| panic!("no liveness.transports_lost in {s:#}"))
}

/// iperf3 down (`-R`) with 1, 4 and 8 streams and up with 4 and 8 (the bench's
/// runs) through the port-forward, back to back for `KVPN_PF_LOAD_SECS` seconds
/// (default 30): every
/// run completes (a data connection that broke under load re-dials, which by design
/// ends the SNAT flows: iperf3's control connection then dies with "Connection
/// reset by peer", the failure a bench run met), and no data connection was lost.
#[test]
fn iperf3_under_load_through_port_forward_keeps_the_data_connection() {
    let _serial = one_at_a_time();
    let f = KubeFixture::real_nodes(2);
    let web = f
        .pods(DEV_NAMESPACE, "app=web")
        .into_iter()
        .find(|p| p.status.as_ref().is_some_and(|s| s.pod_ip.is_some()))
        .unwrap_or_else(|| panic!("no web pod with an IP"));
    let ip = pod_ip(&web).to_string();
    let netns = f.pod_netns(&web);
    let mut cmd = netns.command("iperf3");
    cmd.args(["-s", "-p", &IPERF_PORT.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _server = Iperf3Server(
        cmd.spawn()
            .unwrap_or_else(|e| panic!("iperf3 server in {}: {e}", netns.name())),
    );
    f.connect_restricted();
    f.wait_state("connected", Duration::from_secs(20));
    let secs: u64 = std::env::var("KVPN_PF_LOAD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let port = IPERF_PORT.to_string();
    let runs: [&[&str]; 6] = [
        &["-u", "-l", "64", "-b", "100M"],
        &["-R"],
        &["-R", "-P", "4"],
        &["-R", "-P", "8"],
        &["-P", "4"],
        &["-P", "8"],
    ];
    let t0 = Instant::now();
    let mut n = 0;
    while t0.elapsed() < Duration::from_secs(secs) {
        let extra = runs[n % runs.len()];
        n += 1;
        let mut args = vec!["iperf3", "-c", &ip, "-p", &port, "-t", "5"];
        args.extend_from_slice(extra);
        // The server may still be closing the previous test: "busy", retried.
        let mut tries = 0;
        let out = loop {
            tries += 1;
            let out = f.laptop(&args);
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if !out.status.success() && text.contains("server is busy") && tries < 10 {
                std::thread::sleep(Duration::from_millis(300));
                continue;
            }
            break (out.status.success(), text);
        };
        let last = out
            .1
            .lines()
            .rev()
            .find(|l| l.contains("receiver"))
            .unwrap_or("");
        eprintln!(
            "run {n} {extra:?} at {:.0} s: {last}",
            t0.elapsed().as_secs_f64()
        );
        assert!(
            out.0,
            "iperf3 {extra:?} (run {n}, after {:.0} s) failed: {}\nstatus: {:#}\n{}",
            t0.elapsed().as_secs_f64(),
            out.1,
            f.session(),
            f.diagnostics()
        );
    }
    // Where the UDP flood's losses happened (manager intake, flow caps), for the log.
    let session = f.session();
    eprintln!(
        "manager drops: {}, liveness: {}",
        session["manager_stats"]["drops"], session["liveness"]
    );
    assert_eq!(
        transports_lost(&f),
        0,
        "data connections lost during {n} iperf3 runs: {:#}\n{}",
        f.session(),
        f.diagnostics()
    );
}
