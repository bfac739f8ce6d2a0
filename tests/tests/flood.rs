//! Floods through one session ([hardening] item 3) on the static lab (direct
//! TCP transport, real TUN, eBPF, root daemon and traffic manager):
//!
//! - a 100 Mbit/s flood of 64-byte UDP datagrams (iperf3 `-u -l 64 -b 100M`,
//!   ~195,000 packets/s offered, more than the tunnel carries on this machine)
//!   must not cost the session its transport: heartbeats and their echoes never
//!   wait behind the flood, so the session stays `connected` (no transport
//!   lost, no re-dial), iperf3's own TCP control connection survives (the bench
//!   saw "unable to send control message: Broken pipe"), and a TCP connection
//!   opened before the flood keeps echoing through it and afterwards.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, ECHO_CLUSTER_IP, ECHO_SERVICE_PORT, MANAGER_POD_IP, NODE,
};
use kvpn_tests::{Fixture, text};

/// iperf3 server port in the backend pod.
const IPERF_PORT: u16 = 5201;
/// Seconds of flood: longer than the 3 s liveness window.
const FLOOD_SECS: u32 = 6;

fn liveness(f: &Fixture) -> serde_json::Value {
    let s = f.status_json();
    s["sessions"][0].clone()
}

fn counter(session: &serde_json::Value, key: &str) -> u64 {
    session["liveness"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("no liveness.{key} in status: {session}"))
}

#[test]
fn udp_flood_keeps_session_and_tcp_flows() {
    let f = Fixture::connected();
    let mut iperf = std::process::Command::new("iperf3");
    iperf.args(["-s", "-p", &IPERF_PORT.to_string()]);
    let server = f
        .lab
        .spawn_in(BACKEND_1_POD, "iperf3-flood", &iperf)
        .unwrap_or_else(|e| panic!("iperf3 server: {e:#}"));
    let iperf_addr = SocketAddr::from((BACKEND_1_IP, IPERF_PORT));
    f.lab
        .wait_tcp(BACKEND_1_POD, iperf_addr, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("iperf3 server not listening: {e:#}"));

    // Wait until the session has echoed a heartbeat.
    let t0 = Instant::now();
    while liveness(&f)["state"] != "connected" {
        assert!(t0.elapsed() < Duration::from_secs(10), "never connected");
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = liveness(&f);

    // A TCP connection opened before the flood echoes a message every 100 ms
    // while the flood runs; every round trip must succeed.
    let echo = SocketAddr::from((ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
    let stop = Arc::new(AtomicBool::new(false));
    let stop_echo = stop.clone();
    let (echo_tx, echo_rx) = std::sync::mpsc::channel();
    let netns = f.lab.laptop_netns().name().to_owned();
    let echoer = std::thread::spawn(move || {
        kvpn_lab::run_in_netns(&netns, move || {
            let result = (|| -> Result<(u32, Duration), String> {
                let mut s = TcpStream::connect_timeout(&echo, Duration::from_secs(5))
                    .map_err(|e| format!("connect {echo}: {e}"))?;
                // Under the flood the manager drops what its intake cannot
                // hold, TCP segments included: the connection must survive
                // (retransmits), not answer within a deadline.
                s.set_read_timeout(Some(Duration::from_secs(20)))
                    .map_err(|e| e.to_string())?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                let (mut rounds, mut worst) = (0u32, Duration::ZERO);
                while !stop_echo.load(Ordering::Relaxed) {
                    let msg = format!("round {rounds} of the flood echo\n");
                    let t = Instant::now();
                    s.write_all(msg.as_bytes())
                        .map_err(|e| format!("round {rounds}: write: {e}"))?;
                    let mut got = vec![0u8; msg.len()];
                    s.read_exact(&mut got)
                        .map_err(|e| format!("round {rounds}: read: {e}"))?;
                    if got != msg.as_bytes() {
                        return Err(format!("round {rounds}: echo differs"));
                    }
                    worst = worst.max(t.elapsed());
                    rounds += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                // After the flood: 4 MiB through the same connection.
                let big = vec![0x6bu8; 4 << 20];
                let mut rd = s.try_clone().map_err(|e| e.to_string())?;
                let reader = std::thread::spawn(move || {
                    let mut got = vec![0u8; 4 << 20];
                    rd.set_read_timeout(Some(Duration::from_secs(20)))
                        .map_err(|e| e.to_string())?;
                    rd.read_exact(&mut got)
                        .map_err(|e| format!("4 MiB echo: read: {e}"))?;
                    Ok::<_, String>(got.iter().all(|b| *b == 0x6b))
                });
                s.write_all(&big)
                    .map_err(|e| format!("4 MiB echo: write: {e}"))?;
                match reader.join() {
                    Ok(Ok(true)) => Ok((rounds, worst)),
                    Ok(Ok(false)) => Err("4 MiB echo: bytes differ".into()),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err("4 MiB echo reader panicked".into()),
                }
            })();
            let _ = echo_tx.send(result);
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"));
    });
    std::thread::sleep(Duration::from_millis(500));

    // Every 500 ms during the flood: the data connection's queues on both
    // ends (the laptop's unsent backlog, the manager's unread bytes).
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        let laptop = f
            .lab
            .netns(kvpn_lab::LAPTOP)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let manager = f
            .lab
            .netns(kvpn_lab::MANAGER_POD)
            .unwrap_or_else(|e| panic!("{e:#}"));
        std::thread::spawn(move || {
            let mut lines = Vec::new();
            while sampling.load(Ordering::Relaxed) {
                for (who, ns, filter) in [
                    ("laptop", &laptop, "dport = :10801"),
                    ("manager", &manager, "sport = :10801"),
                ] {
                    let out = std::process::Command::new("ip")
                        .args(["netns", "exec", ns.name(), "ss", "-Htn", filter])
                        .output();
                    if let Ok(out) = out {
                        lines.push(format!("{who}: {}", text(&out.stdout).trim()));
                    }
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            lines
        })
    };

    // The flood, with its own TCP control connection.
    let out = f.laptop(&[
        "iperf3",
        "-J",
        "-c",
        &BACKEND_1_IP.to_string(),
        "-p",
        &IPERF_PORT.to_string(),
        "-u",
        "-l",
        "64",
        "-b",
        "100M",
        "-t",
        &FLOOD_SECS.to_string(),
    ]);
    let during = liveness(&f);
    sampling.store(false, Ordering::Relaxed);
    for line in sampler.join().unwrap_or_default() {
        eprintln!("flood: ss {line}");
    }
    stop.store(true, Ordering::Relaxed);
    let echoed = echo_rx.recv_timeout(Duration::from_secs(40));
    let _ = echoer.join();
    let _ = f.lab.stop_process(server, Duration::from_secs(2));
    let json = text(&out.stdout);
    let udp = serde_json::from_str::<serde_json::Value>(&json)
        .ok()
        .map(|v| v["end"]["sum"].clone());
    eprintln!(
        "flood: iperf3 exit {:?}, UDP summary {udp:?}\nliveness before {}\nliveness after {}",
        out.status.code(),
        before["liveness"],
        during["liveness"]
    );
    let diag = || {
        format!(
            "daemon log:\n{}\nmanager log tail:\n{}",
            f.daemon_log(),
            f.manager_log()
                .lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    assert!(
        out.status.success(),
        "iperf3 UDP flood failed (its TCP control connection broke?): {json}\n{}\n{}",
        text(&out.stderr),
        diag()
    );
    let sent = udp
        .as_ref()
        .and_then(|s| s["packets"].as_u64())
        .unwrap_or(0);
    assert!(
        sent > 10_000,
        "the flood sent only {sent} packets: {json}\n{}",
        diag()
    );
    match echoed {
        Ok(Ok((rounds, worst))) => {
            eprintln!("flood: TCP echo {rounds} round trips during the flood, slowest {worst:?}");
            assert!(rounds >= 5, "only {rounds} echo rounds during the flood");
        }
        Ok(Err(e)) => panic!("TCP connection through the flood: {e}\n{}", diag()),
        Err(_) => panic!("TCP echo thread did not finish\n{}", diag()),
    }
    // The session never lost its transport and stayed connected.
    assert_eq!(
        during["state"],
        "connected",
        "session state after the flood: {during}\n{}",
        diag()
    );
    assert_eq!(
        counter(&during, "transports_lost"),
        counter(&before, "transports_lost"),
        "the flood cost the session its transport (re-dial)\n{}",
        diag()
    );
    assert!(
        counter(&during, "heartbeats_echoed")
            >= counter(&before, "heartbeats_echoed") + FLOOD_SECS as u64 - 1,
        "heartbeats were not echoed during the flood: before {} after {}",
        before["liveness"],
        during["liveness"]
    );
    assert!(
        !f.daemon_log().contains("transport lost"),
        "root daemon log reports a lost transport\n{}",
        diag()
    );
}

/// The manager's flow cap in `kvpn status` ([hardening] item 3: "caps flows
/// per client and says so in status when the cap bites"): with
/// `--max-flows-per-client 8`, the laptop holds 8 TCP connections open and
/// tries 12 more; those are refused (RST: connection refused), and within a
/// few seconds `kvpn status -o json` shows the manager's counters from its
/// stats frames (flows 8 of cap 8, 12 refused, drop reason `too_many_flows`)
/// and the table says the cap was reached.
#[test]
fn flow_cap_refusals_show_in_status() {
    let f = Fixture::with_manager_args(&["--max-flows-per-client", &CAP.to_string()]);
    f.connect();
    flow_cap_refusals_show(&f);
}

/// The same with `--source-policy preserve`, where the manager hands the
/// laptop's packets to the pod's kernel (pool TUN) instead of terminating
/// them: the flows it forwards count against the same cap, over it a SYN is
/// refused with RST, and `kvpn status` says so alike. `ebpf-snat` takes the
/// same path in the manager (the pool TUN); its TC programs need the
/// Kubernetes lab (tests/tests/kube_source.rs).
#[test]
fn flow_cap_bites_under_source_policy_preserve() {
    let f = Fixture::with_manager_args(&[
        "--max-flows-per-client",
        &CAP.to_string(),
        "--source-policy",
        "preserve",
        // The test routes the pool itself (below): nothing to claim.
        "--preserve-gateway",
        "none",
    ]);
    // Replies for the tunnel pool go back through the manager pod, as a
    // cluster's node route `POOL via <gateway>` does.
    let route = format!("route add 100.96.0.0/16 via {MANAGER_POD_IP}");
    f.lab
        .netns(NODE)
        .and_then(|n| n.ip_batch(&[route]))
        .unwrap_or_else(|e| panic!("node route for the tunnel pool: {e:#}"));
    f.connect();
    flow_cap_refusals_show(&f);
    assert!(
        f.manager_log().contains("pool TUN ready"),
        "the manager did not forward through the pool TUN:\n{}",
        f.manager_log()
    );
}

/// Flow cap of [`flow_cap_refusals_show`].
const CAP: usize = 8;
/// Connections tried beyond the cap.
const EXTRA: usize = 12;

fn flow_cap_refusals_show(f: &Fixture) {
    let echo = SocketAddr::from((ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
    let (held, refused) = f.in_laptop(|| {
        let mut held = Vec::new();
        let mut refused = 0;
        for i in 0..CAP + EXTRA {
            match TcpStream::connect_timeout(&echo, Duration::from_secs(5)) {
                Ok(mut s) => {
                    // Prove the flow carries data, then keep it open.
                    let msg = format!("flow {i}\n");
                    s.set_read_timeout(Some(Duration::from_secs(5)))
                        .unwrap_or_else(|e| panic!("{e}"));
                    s.write_all(msg.as_bytes())
                        .unwrap_or_else(|e| panic!("flow {i}: write: {e}"));
                    let mut got = vec![0u8; msg.len()];
                    s.read_exact(&mut got)
                        .unwrap_or_else(|e| panic!("flow {i}: echo: {e}"));
                    held.push(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused += 1,
                Err(e) => panic!("connect {i} to {echo}: {e}"),
            }
        }
        (held, refused)
    });
    assert_eq!(
        (held.len(), refused),
        (CAP, EXTRA),
        "with a cap of {CAP} flows, {} connections opened and {refused} were refused\n{}",
        held.len(),
        f.manager_log()
    );
    // Stats frames come about once a second.
    let t0 = Instant::now();
    let stats = loop {
        let s = f.status_json();
        let m = s["sessions"][0]["manager_stats"].clone();
        if m["refused_cap"].as_u64() >= Some(EXTRA as u64) {
            break m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "kvpn status shows no flow-cap refusals after 5 s: {:#}",
            s["sessions"][0]
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("flow cap: manager_stats {stats}");
    assert_eq!(stats["flow_cap"], CAP as u64, "{stats}");
    assert_eq!(stats["flows"], CAP as u64, "{stats}");
    assert_eq!(stats["refused_cap"], EXTRA as u64, "{stats}");
    let drops = stats["drops"].as_array().cloned().unwrap_or_default();
    assert!(
        drops
            .iter()
            .any(|d| d["reason"] == "too_many_flows" && d["packets"].as_u64() >= Some(EXTRA as u64)),
        "no too_many_flows drops: {stats}"
    );
    let table = text(&f.kvpn(&["status"]).stdout);
    assert!(
        table.contains(&format!(
            "flow cap reached: {EXTRA} new flows refused ({CAP} of {CAP} flows open)"
        )),
        "the status table does not say the cap bit:\n{table}"
    );
    drop(held);
}
