//! End-to-end tests of the walking skeleton (issue [skeleton]): a laptop netns
//! reaches pods and ClusterIPs over TCP, UDP and ICMP through the real TUN
//! device, the real eBPF classifier, the real root daemon and the real smoltcp
//! traffic manager. Each test has its own lab; all run as root.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use kvpn_lab::protocol::PageInfo;
use kvpn_lab::{
    BACKEND_1_IP, BACKEND_1_POD, BACKEND_2_POD, ECHO_PORT, ECHO_SERVICE_PORT, HTTP_PORT,
    UDP_ECHO_CLUSTER_IP, UNUSED_POD_IP, WEB_CLUSTER_IP,
};
use kvpn_tests::{Fixture, text};

fn curl(f: &Fixture, url: &str) -> std::process::Output {
    f.laptop(&["curl", "-sS", "--max-time", "5", url])
}

fn page(f: &Fixture, url: &str) -> PageInfo {
    let out = curl(f, url);
    assert!(
        out.status.success(),
        "curl {url} failed: {}\ndaemon log:\n{}\nmanager log:\n{}",
        text(&out.stderr),
        f.daemon_log(),
        f.manager_log()
    );
    PageInfo::parse(&text(&out.stdout))
        .unwrap_or_else(|| panic!("not a lab page: {:?}", text(&out.stdout)))
}

#[test]
fn pod_ip_and_cluster_ip_return_the_backend_page() {
    let f = Fixture::connected();
    let p = page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert_eq!(p.pod, BACKEND_1_POD);
    assert_eq!(p.pod_ip, std::net::IpAddr::V4(BACKEND_1_IP));
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let p = page(&f, &format!("http://{WEB_CLUSTER_IP}/"));
        seen.insert(p.pod);
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![BACKEND_1_POD.to_string(), BACKEND_2_POD.to_string()],
        "the ClusterIP should balance over both backends"
    );
}

#[test]
fn download_50mb_matches_sha256() {
    let f = Fixture::connected();
    let len: u64 = 50 * 1024 * 1024;
    let url = format!("http://{BACKEND_1_IP}:{HTTP_PORT}/big?bytes={len}");
    let out = f.laptop(&[
        "bash",
        "-c",
        &format!("curl -sS --max-time 120 {url} | sha256sum"),
    ]);
    assert!(
        out.status.success(),
        "download failed: {}",
        text(&out.stderr)
    );
    let got = text(&out.stdout);
    let got = got.split_whitespace().next().unwrap_or_default();
    assert_eq!(
        got,
        kvpn_lab::payload::sha256_hex(len),
        "sha256 of the 50 MB download"
    );
}

#[test]
fn udp_echo_round_trips() {
    let f = Fixture::connected();
    let echoed = f.in_laptop(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").expect("bind");
        sock.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let target = SocketAddr::from((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT));
        let mut results = Vec::new();
        for (i, size) in [16usize, 1200, 4000].into_iter().enumerate() {
            let msg: Vec<u8> = (0..size).map(|j| (i * 31 + j) as u8).collect();
            sock.send_to(&msg, target).expect("send");
            let mut buf = vec![0u8; 65536];
            let got = sock
                .recv_from(&mut buf)
                .map(|(n, from)| (buf[..n].to_vec(), from));
            results.push((msg, got.map_err(|e| e.to_string())));
        }
        results
    });
    for (sent, got) in echoed {
        let (data, from) = got.unwrap_or_else(|e| panic!("no echo for {} bytes: {e}", sent.len()));
        assert_eq!(data, sent, "echo of {} bytes", sent.len());
        assert_eq!(
            from,
            SocketAddr::from((UDP_ECHO_CLUSTER_IP, ECHO_SERVICE_PORT)),
            "reply source"
        );
    }
}

#[test]
fn tr_03_ping_means_the_target_answered() {
    let f = Fixture::connected();
    let ok = f.laptop(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "2",
        &BACKEND_1_IP.to_string(),
    ]);
    assert!(
        ok.status.success(),
        "ping to a pod failed: {}",
        text(&ok.stdout)
    );
    assert!(
        text(&ok.stdout).contains("3 received"),
        "{}",
        text(&ok.stdout)
    );
    let unused = f.laptop(&[
        "ping",
        "-c",
        "2",
        "-i",
        "0.2",
        "-W",
        "2",
        &UNUSED_POD_IP.to_string(),
    ]);
    assert!(
        !unused.status.success(),
        "ping to an unused pod IP must fail: {}",
        text(&unused.stdout)
    );
    assert!(
        text(&unused.stdout).contains("0 received"),
        "{}",
        text(&unused.stdout)
    );
}

#[test]
fn tr_04_closed_port_is_refused() {
    let f = Fixture::connected();
    let err = f.in_laptop(|| {
        let start = Instant::now();
        let r = TcpStream::connect_timeout(
            &SocketAddr::from((BACKEND_1_IP, 9)),
            Duration::from_secs(5),
        );
        (r.err().map(|e| e.kind()), start.elapsed())
    });
    assert_eq!(
        err.0,
        Some(std::io::ErrorKind::ConnectionRefused),
        "connect to a closed port"
    );
    assert!(err.1 < Duration::from_secs(3), "refusal took {:?}", err.1);
}

#[test]
fn tr_05_fin_with_data_in_flight_and_half_close() {
    let f = Fixture::connected();
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    // The server writes 5 MB then closes: all 5 MB arrive, then EOF within 1 s.
    let (n, eof_after_last) = f.in_laptop(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(b"WRITE 5000000 CLOSE\n").expect("command");
        let mut buf = vec![0u8; 65536];
        let mut total = 0usize;
        let mut last = Instant::now();
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    total += k;
                    last = Instant::now();
                }
                Err(e) => panic!("read after {total} bytes: {e}"),
            }
        }
        (total, last.elapsed())
    });
    assert_eq!(n, 5_000_000, "bytes before EOF");
    assert!(
        eof_after_last < Duration::from_secs(1),
        "EOF came {eof_after_last:?} after the last byte"
    );

    // Half-close: the client sends 1 MB and SHUT_WR, then reads slowly; the whole echo arrives.
    let echoed = f.in_laptop(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut w = s.try_clone().expect("clone");
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&sent).expect("write");
            w.shutdown(Shutdown::Write).expect("shutdown");
        });
        let mut got = Vec::new();
        let mut buf = vec![0u8; 16384];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    got.extend_from_slice(&buf[..k]);
                    // Read slowly for a while so the window closes (zero window).
                    if got.len() < 300_000 {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                Err(e) => panic!("read after {} bytes: {e}", got.len()),
            }
        }
        writer.join().expect("writer");
        (data, got)
    });
    assert_eq!(
        echoed.1.len(),
        echoed.0.len(),
        "echoed length after half-close"
    );
    assert!(echoed.1 == echoed.0, "echoed bytes differ");
}

fn ebpf_packets(status: &serde_json::Value, kind: &str) -> u64 {
    status["sessions"][0]["ebpf"]["per_kind"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|k| k["kind"] == kind)
        .filter_map(|k| k["packets"].as_u64())
        .sum()
}

#[test]
fn ebpf_counters_show_pod_and_service_packets() {
    let f = Fixture::connected();
    let before = f.status_json();
    assert_eq!(before["sessions"][0]["state"], "connected", "{before}");
    let pod0 = ebpf_packets(&before, "pod");
    let svc0 = ebpf_packets(&before, "service");
    page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    page(&f, &format!("http://{WEB_CLUSTER_IP}/"));
    let after = f.status_json();
    let pod1 = ebpf_packets(&after, "pod");
    let svc1 = ebpf_packets(&after, "service");
    // One HTTP exchange is at least SYN, ACK, request, FIN from the laptop.
    assert!(pod1 >= pod0 + 4, "pod packets {pod0} -> {pod1}: {after}");
    assert!(
        svc1 >= svc0 + 4,
        "service packets {svc0} -> {svc1}: {after}"
    );
}

fn tun_links(f: &Fixture) -> String {
    text(
        &f.laptop(&["ip", "-o", "link", "show", "type", "tun"])
            .stdout,
    )
}

fn cluster_routes(f: &Fixture) -> String {
    let mut s = text(&f.laptop(&["ip", "route", "show", "10.244.0.0/16"]).stdout);
    s += &text(&f.laptop(&["ip", "route", "show", "10.96.0.0/12"]).stdout);
    s
}

#[test]
fn cluster_unreachable_before_connect_and_after_disconnect_with_nothing_left() {
    let f = Fixture::new();
    let before = curl(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert!(
        !before.status.success(),
        "the pod CIDR must be unreachable before connect"
    );
    assert!(
        tun_links(&f).is_empty(),
        "a TUN device before connect: {}",
        tun_links(&f)
    );

    f.connect();
    page(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert!(
        tun_links(&f).contains("kvpn"),
        "no kvpn TUN device while connected"
    );
    assert!(
        !cluster_routes(&f).is_empty(),
        "no cluster routes while connected"
    );
    let tun = f.status_json()["sessions"][0]["tun_name"]
        .as_str()
        .expect("tun name")
        .to_string();
    let tun2 = tun.clone();
    let prog_ids = f
        .in_laptop(move || kvpn_dataplane::ebpf::Classifier::attached_program_ids(&tun2))
        .unwrap_or_else(|e| panic!("query TCX on {tun}: {e}"));
    assert!(
        !prog_ids.is_empty(),
        "no kvpn classifier attached to {tun} while connected"
    );

    f.disconnect();
    let after = curl(&f, &format!("http://{BACKEND_1_IP}:{HTTP_PORT}/"));
    assert!(
        !after.status.success(),
        "the pod CIDR must be unreachable after disconnect"
    );
    assert!(
        tun_links(&f).is_empty(),
        "TUN device left after disconnect: {}",
        tun_links(&f)
    );
    assert!(
        cluster_routes(&f).is_empty(),
        "routes left after disconnect: {}",
        cluster_routes(&f)
    );
    // The classifier program itself is unloaded, not just detached (ids are global).
    for id in prog_ids {
        let out = f.laptop(&["bpftool", "prog", "show", "id", &id.to_string()]);
        assert!(
            !out.status.success(),
            "eBPF program {id} still loaded after disconnect: {}",
            text(&out.stdout)
        );
    }
    let status = f.status_json();
    assert_eq!(
        status["sessions"].as_array().map(Vec::len),
        Some(0),
        "{status}"
    );
}

#[test]
fn bad_manager_address_is_named_in_the_error() {
    let f = Fixture::new();
    // Nothing listens on this port of the node: connect must fail fast and say why.
    let out = f.kvpn(&[
        "connect",
        "--manager",
        "172.31.255.1:10999",
        "--pod-cidr",
        "10.244.0.0/16",
    ]);
    assert!(
        !out.status.success(),
        "connect to a closed manager port must fail"
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("172.31.255.1:10999"),
        "error should name the address: {err}"
    );
    assert!(
        tun_links(&f).is_empty(),
        "a failed connect must leave no TUN device: {}",
        tun_links(&f)
    );
}

/// The manager's `/metrics` value of counter `name` (`--metrics-listen` on the
/// manager pod's loopback).
fn manager_counter(f: &Fixture, name: &str) -> u64 {
    f.manager_metric(GSO_METRICS_PORT, name)
}

const GSO_METRICS_PORT: u16 = 10803;

/// Issue [fastpath] offloads: the laptop's TUN hands the pump TCP
/// super-packets (IFF_VNET_HDR, TSO), the manager accepts GSO frames (hello
/// option 4 and its answer), and segments them for smoltcp. A 20 MB upload
/// through the TCP echo comes back intact, and the manager counted GSO frames
/// and more segments than frames.
#[test]
fn upload_20mb_in_gso_frames_echoes_intact() {
    let f =
        Fixture::with_manager_args(&["--metrics-listen", &format!("127.0.0.1:{GSO_METRICS_PORT}")]);
    f.lab
        .wait_listening(
            kvpn_lab::MANAGER_POD,
            GSO_METRICS_PORT,
            Duration::from_secs(15),
        )
        .unwrap_or_else(|e| panic!("manager metrics port: {e:#}\n{}", f.manager_log()));
    f.connect();
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    const LEN: usize = 20 * 1024 * 1024;
    let (sent, echoed, n) = f.in_laptop(move || {
        use sha2::{Digest, Sha256};
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut w = s.try_clone().expect("clone");
        // Never starts with an echo-server command line ("WRITE", "RESET").
        let data: Vec<u8> = (0..LEN as u32).map(|i| (i % 253) as u8).collect();
        let sent = hex(&Sha256::digest(&data));
        let writer = std::thread::spawn(move || {
            for chunk in data.chunks(256 * 1024) {
                w.write_all(chunk).expect("upload");
            }
            w.shutdown(Shutdown::Write).expect("shutdown");
        });
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut n = 0usize;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    hasher.update(&buf[..k]);
                    n += k;
                }
                Err(e) => panic!("read after {n} bytes: {e}"),
            }
        }
        writer.join().expect("writer");
        (sent, hex(&hasher.finalize()), n)
    });
    assert_eq!(n, LEN, "echoed bytes\nmanager log:\n{}", f.manager_log());
    assert_eq!(echoed, sent, "sha256 of the echoed 20 MB");
    // The manager syncs a session's counters every engine round.
    let frames = manager_counter(&f, "gso_frames_total");
    let segments = manager_counter(&f, "gso_segments_total");
    assert!(
        frames > 0,
        "no GSO frames reached the manager\ndaemon log:\n{}\nmanager log:\n{}",
        f.daemon_log(),
        f.manager_log()
    );
    assert!(
        segments > frames,
        "{segments} segments from {frames} GSO frames: super-packets were not cut"
    );
    assert_eq!(
        manager_counter(&f, "packets_dropped_total{reason=\"gso\"}"),
        0,
        "GSO frames dropped by the manager"
    );
    // `kvpn status` tells the same: the pump's GSO frames, and the manager's
    // count in its stats frames (about once a second).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = f.status_json();
        let s = &status["sessions"][0];
        let tx = s["tx"]["gso_frames"].as_u64().unwrap_or(0);
        let m = s["manager_stats"]["gso_frames"].as_u64().unwrap_or(0);
        let m_segments = s["manager_stats"]["gso_segments"].as_u64().unwrap_or(0);
        if tx > 0 && m > 0 && m_segments > m {
            assert!(
                m <= tx,
                "the manager segmented more GSO frames than the pump sent: {s}"
            );
            assert_eq!(s["tx"]["offload_dropped"], 0, "{s}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "status shows no GSO frames (pump {tx}, manager {m} / {m_segments} segments): {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One data connection of the laptop to the manager, as `ss -i` in the laptop
/// netns shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DataConn {
    /// The laptop's local port (tells the worker connections apart).
    port: u16,
    /// Bytes the laptop received on it (cluster → laptop).
    received: u64,
    /// Bytes the manager acknowledged (laptop → cluster).
    acked: u64,
}

fn data_connections(f: &Fixture) -> Vec<DataConn> {
    let manager = kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string();
    let out = f.laptop(&["ss", "-Htni", "state", "established", "dst", &manager]);
    let mut conns: Vec<DataConn> = Vec::new();
    for token in text(&out.stdout).split_whitespace() {
        if let Ok(addr) = token.parse::<SocketAddr>() {
            if addr.port() != kvpn_lab::MANAGER_PORT {
                conns.push(DataConn {
                    port: addr.port(),
                    received: 0,
                    acked: 0,
                });
            }
        } else if let (Some(v), Some(c)) = (token.strip_prefix("bytes_received:"), conns.last_mut())
        {
            c.received = v.parse().unwrap_or(0);
        } else if let (Some(v), Some(c)) = (token.strip_prefix("bytes_acked:"), conns.last_mut()) {
            c.acked = v.parse().unwrap_or(0);
        }
    }
    conns.sort_by_key(|c| c.port);
    conns
}

/// `kvpn connect --workers 2`, then wait until status shows both workers connected.
fn connected_with_two_workers() -> Fixture {
    let f = Fixture::new();
    f.connect_with(&["--workers", "2"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = f.status_json();
        let session = &s["sessions"][0];
        if session["state"] == "connected" && session["workers_connected"] == 2 {
            assert_eq!(session["workers"], 2, "{session}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "both workers not connected within 10 s: {session}\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    f
}

/// Echo `len` bytes (a pattern seeded by `seed`) on `s` and check them.
fn echo_round(s: &mut TcpStream, len: usize, seed: u8) -> Result<(), String> {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect();
    let mut w = s.try_clone().map_err(|e| e.to_string())?;
    let sent = data.clone();
    let writer = std::thread::spawn(move || w.write_all(&sent).map_err(|e| e.to_string()));
    let mut got = vec![0u8; len];
    s.read_exact(&mut got).map_err(|e| e.to_string())?;
    writer.join().map_err(|_| "writer panicked".to_owned())??;
    if got != data {
        return Err(format!("{len} echoed bytes differ"));
    }
    Ok(())
}

/// `kvpn connect --workers 2`: two TUN queues, two data connections; 16 TCP
/// flows land on both (each connection's received bytes grow by at least one
/// flow's download), a 20 MB upload comes back through the echo server with
/// the same sha256, ping answers, and the manager ran a sharded session per
/// connection.
#[test]
fn workers_2_spread_flows_over_two_connections() {
    let f = connected_with_two_workers();
    let before = data_connections(&f);
    assert_eq!(before.len(), 2, "two data connections: {before:?}");
    let queues = text(
        &f.laptop(&["ip", "-d", "link", "show", "type", "tun"])
            .stdout,
    );
    assert!(
        queues.contains("multi_queue"),
        "a multi-queue TUN: {queues}"
    );

    const FLOWS: usize = 16;
    const EACH: usize = 2_000_000;
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    let got = f.in_laptop(move || {
        let threads: Vec<_> = (0..FLOWS)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                        .map_err(|e| e.to_string())?;
                    s.set_read_timeout(Some(Duration::from_secs(20)))
                        .map_err(|e| e.to_string())?;
                    s.write_all(format!("WRITE {EACH} CLOSE\n").as_bytes())
                        .map_err(|e| e.to_string())?;
                    let mut all = Vec::new();
                    s.read_to_end(&mut all).map_err(|e| e.to_string())?;
                    Ok::<usize, String>(all.len())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err("flow thread panicked".into()))
            })
            .collect::<Vec<_>>()
    });
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.as_ref().ok(), Some(&EACH), "flow {i}: {r:?}");
    }
    let after = data_connections(&f);
    assert_eq!(
        after.iter().map(|c| c.port).collect::<Vec<_>>(),
        before.iter().map(|c| c.port).collect::<Vec<_>>(),
        "the same two data connections"
    );
    let grew: Vec<u64> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.received - b.received)
        .collect();
    eprintln!("bytes received per data connection for {FLOWS} flows: {grew:?}");
    assert!(
        grew.iter().sum::<u64>() >= (FLOWS * EACH) as u64,
        "all downloads came over the data connections: {grew:?}"
    );
    for (i, g) in grew.iter().enumerate() {
        assert!(
            *g >= EACH as u64,
            "data connection {i} carried no whole flow ({g} bytes): flows not spread {grew:?}"
        );
    }

    // 20 MB up and back through the echo server, hashed on both ends.
    let (sent, echoed) = f.in_laptop(move || {
        let len = 20 * 1024 * 1024;
        let data: Vec<u8> = (0..len)
            .map(|i: usize| (i % 253) as u8 ^ (i >> 16) as u8)
            .collect();
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut w = s.try_clone().expect("clone");
        let up = data.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&up).expect("upload");
            w.shutdown(Shutdown::Write).expect("shutdown");
        });
        let mut back = Vec::with_capacity(len);
        s.read_to_end(&mut back).expect("echo");
        writer.join().expect("writer");
        (
            kvpn_lab::payload::sha256_hex_of(&data),
            (back.len(), kvpn_lab::payload::sha256_hex_of(&back)),
        )
    });
    assert_eq!(echoed.0, 20 * 1024 * 1024, "echoed length");
    assert_eq!(echoed.1, sent, "sha256 of the 20 MB echo");

    let ping = f.laptop(&[
        "ping",
        "-c",
        "3",
        "-i",
        "0.2",
        "-W",
        "2",
        &BACKEND_1_IP.to_string(),
    ]);
    assert!(
        text(&ping.stdout).contains("3 received"),
        "{}",
        text(&ping.stdout)
    );
    let log = f.manager_log();
    assert_eq!(
        log.matches("worker connection of a sharded session")
            .count(),
        2,
        "one sharded engine per worker connection:\n{log}"
    );
    // Offloads on both workers: each pump read the manager's hello (which a
    // sharded connection sends after its stats answer) and sends GSO frames.
    let daemon = f.daemon_log();
    assert_eq!(
        daemon
            .lines()
            .filter(|l| l.contains("manager hello read") && l.contains("true"))
            .count(),
        2,
        "both workers' pumps saw the manager accept GSO frames:\n{daemon}"
    );
    let status = f.status_json();
    let session = &status["sessions"][0];
    assert_eq!(session["workers"], 2, "{session}");
    assert!(
        session["manager_stats"]["flow_cap"].as_u64().unwrap_or(0) > 0,
        "the workers' stats are summed: {session}"
    );
}

/// `--workers 2` with one worker's data connection killed (`ss -K` of that
/// connection only): the flows of the other worker keep echoing at once, the
/// killed worker re-dials alone and both are connected again, with new flows
/// on the re-dialled connection.
#[test]
fn workers_2_one_connection_killed_the_other_keeps_its_flows() {
    let f = connected_with_two_workers();
    let conns = data_connections(&f);
    assert_eq!(conns.len(), 2, "{conns:?}");
    let addr = SocketAddr::from((BACKEND_1_IP, ECHO_PORT));
    const FLOWS: usize = 12;
    const ROUND: usize = 512 * 1024;
    let mut flows: Vec<TcpStream> = f.in_laptop(move || {
        (0..FLOWS)
            .map(|_| {
                let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                s
            })
            .collect()
    });
    // Which connection carries which flow: the one whose received bytes grow by
    // the echoed round.
    let mut on_port = Vec::with_capacity(FLOWS);
    for (i, s) in flows.iter_mut().enumerate() {
        let before = data_connections(&f);
        echo_round(s, ROUND, i as u8).unwrap_or_else(|e| panic!("flow {i}: {e}"));
        let after = data_connections(&f);
        let port = after
            .iter()
            .zip(&before)
            .find(|(a, b)| a.received - b.received >= ROUND as u64)
            .map(|(a, _)| a.port)
            .unwrap_or_else(|| panic!("flow {i} on no data connection: {before:?} {after:?}"));
        on_port.push(port);
    }
    let victim = conns[0].port;
    let survivor = conns[1].port;
    assert!(
        on_port.contains(&victim) && on_port.contains(&survivor),
        "{FLOWS} flows all on one connection: {on_port:?}"
    );
    let manager = kvpn_lab::MANAGER_ADDR_FROM_LAPTOP.to_string();
    let sport = format!(":{victim}");
    let killed = f.laptop(&[
        "ss",
        "-K",
        "-Htn",
        "state",
        "established",
        "dst",
        &manager,
        "sport",
        "=",
        &sport,
    ]);
    assert!(
        killed.status.success() && text(&killed.stdout).lines().count() == 1,
        "ss -K killed not exactly one connection: {} {}",
        text(&killed.stdout),
        text(&killed.stderr)
    );
    // The other worker's flows go on at once.
    let t0 = Instant::now();
    for (i, s) in flows.iter_mut().enumerate() {
        if on_port[i] == survivor {
            echo_round(s, ROUND, 100 + i as u8)
                .unwrap_or_else(|e| panic!("flow {i} of the surviving worker: {e}"));
        }
    }
    let survived_in = t0.elapsed();
    assert!(
        data_connections(&f).iter().any(|c| c.port == survivor),
        "the surviving connection was not touched"
    );
    // The killed worker comes back alone.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = data_connections(&f);
        let session = f.status_json()["sessions"][0].clone();
        if now.len() == 2
            && !now.iter().any(|c| c.port == victim)
            && session["state"] == "connected"
            && session["workers_connected"] == 2
        {
            assert_eq!(session["liveness"]["transports_lost"], 1, "{session}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the killed worker did not come back within 10 s: {now:?} {session}\n{}",
            f.daemon_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let restored = data_connections(&f)
        .into_iter()
        .find(|c| c.port != survivor)
        .expect("the re-dialled connection");
    // New flows work on both workers, some on the re-dialled connection.
    let before = restored.received;
    let mut fresh: Vec<TcpStream> = f.in_laptop(move || {
        (0..FLOWS)
            .map(|_| {
                let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(5)))
                    .expect("timeout");
                s
            })
            .collect()
    });
    for (i, s) in fresh.iter_mut().enumerate() {
        echo_round(s, ROUND, 200 + i as u8).unwrap_or_else(|e| panic!("new flow {i}: {e}"));
    }
    let after = data_connections(&f)
        .into_iter()
        .find(|c| c.port == restored.port)
        .map_or(0, |c| c.received);
    assert!(
        after - before >= ROUND as u64,
        "no new flow on the re-dialled connection: {before} -> {after}"
    );
    eprintln!(
        "workers: flows per connection {on_port:?}; survivor's flows echoed {survived_in:?} after the kill"
    );
}
