//! Case tr-10 (black hole detection) end to end on the Kubernetes lab: the
//! port-forward transport rides the laptop's TCP connections to the API server
//! (172.31.255.1:6443); an nftables table in the laptop netns drops them in
//! both directions (no RST, no FIN), which silences the data channel without
//! closing anything. Removing the table heals the path.
//!
//! Bounds (see dataplane/src/liveness.rs): a heartbeat every 1 s, reconnecting
//! after 3 s without an echo, so status must say `reconnecting` within
//! 3 s + one heartbeat interval = 4 s of the hole opening. While reconnecting, the
//! root daemon answers packets to cluster routes with ICMP host unreachable, so
//! a new connection fails at once ("No route to host").
//!
//! The case asks for a 5-minute hole; this test holds it for [`HOLE`] (30 s),
//! long enough for several re-dials into the hole (each waits out the 5 s TLS
//! handshake timeout) and for the kernel's SYN retransmissions to the API
//! server to back off, and short enough for CI.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvpn_lab::LAPTOP;
use kvpn_tests::kube_lab::{BlackHole, KubeFixture, web};
use kvpn_tests::text;

/// How long the path stays black-holed.
const HOLE: Duration = Duration::from_secs(30);

/// Status must show reconnecting within this long after the hole opened: the
/// liveness window (3 s) plus one heartbeat interval (1 s).
const RECONNECTING_WITHIN: Duration = Duration::from_secs(4);

/// A new connection to a ClusterIP must fail within this long while reconnecting.
const FAIL_FAST_WITHIN: Duration = Duration::from_secs(2);

/// After the path heals: the re-dial in flight may wait out its 5 s TLS
/// handshake timeout, then at most the 2 s backoff cap, then a port-forward.
const RECOVER_WITHIN: Duration = Duration::from_secs(15);

/// `curl` to the web ClusterIP from the laptop, bounded by `max` seconds: (exit
/// code, stderr, how long it took).
fn curl_web(f: &KubeFixture, max: u32) -> (Option<i32>, String, Duration) {
    let t0 = Instant::now();
    let out = f.laptop(&[
        "curl",
        "-sS",
        "-o",
        "/dev/null",
        "--max-time",
        &max.to_string(),
        &format!("http://{}/", web()),
    ]);
    (
        out.status.code(),
        text(&out.stderr).trim().to_owned(),
        t0.elapsed(),
    )
}

/// A plain TCP connect to the web ClusterIP from the laptop: the error and how
/// long it took.
fn connect_web(f: &KubeFixture) -> (Result<(), std::io::Error>, Duration) {
    f.lab()
        .netns_lab()
        .run_in(LAPTOP, || {
            let t0 = Instant::now();
            let r = TcpStream::connect_timeout(&web(), Duration::from_secs(20)).map(drop);
            (r, t0.elapsed())
        })
        .unwrap_or_else(|e| panic!("laptop netns: {e:#}"))
}

fn liveness(f: &KubeFixture) -> serde_json::Value {
    f.session()["liveness"].clone()
}

#[test]
fn tr_10_black_hole_detection() {
    let f = KubeFixture::new();
    let out = f.connect_restricted();
    assert!(
        out.contains("Waiting for the traffic manager's first heartbeat echo"),
        "{out}"
    );
    assert!(out.contains("Connected to"), "{out}");
    // "Connected" is printed only after the first echo, so the state agrees at once.
    let session = f.session();
    assert_eq!(session["state"], "connected", "{session:#}");
    let l = &session["liveness"];
    assert_eq!(l["heartbeat_interval_ms"], 1000, "{l:#}");
    assert_eq!(l["window_ms"], 3000, "{l:#}");
    assert!(l["heartbeats_echoed"].as_u64() >= Some(1), "{l:#}");
    let tun = session["tun_name"].as_str().unwrap_or_default().to_owned();
    let tunnel_ip = session["tunnel_ip"].clone();
    let before = f.tun_state(&tun);
    f.wait_http(web(), Instant::now(), Duration::from_secs(10));

    // --- the hole opens
    let mut hole = BlackHole::open(&f);
    let t_hole = Instant::now();
    // A connection started the moment the hole opens: its SYN goes into the
    // hole; a retransmission after detection gets the ICMP answer.
    let early = std::thread::scope(|s| {
        let early = s.spawn(|| curl_web(&f, 30));
        f.wait_state("reconnecting", Duration::from_secs(20));
        let detected = t_hole.elapsed();
        eprintln!(
            "tr-10: status shows reconnecting {:.2} s after the hole opened (bound {} s)",
            detected.as_secs_f64(),
            RECONNECTING_WITHIN.as_secs()
        );
        assert!(
            detected <= RECONNECTING_WITHIN,
            "reconnecting after {detected:?}, bound {RECONNECTING_WITHIN:?}\n{}",
            f.diagnostics()
        );
        let reason = f.session()["reason"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        eprintln!("tr-10: reason: {reason}");
        early
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    });
    eprintln!(
        "tr-10: curl started with the hole: exit {:?} after {:.2} s: {}",
        early.0,
        early.2.as_secs_f64(),
        early.1
    );
    assert_eq!(
        early.0,
        Some(7),
        "curl started with the hole fails to connect (7), not by its 30 s timeout (28): {}",
        early.1
    );

    // New connections while reconnecting fail at once.
    let (code, err, took) = curl_web(&f, 20);
    eprintln!(
        "tr-10: curl while reconnecting: exit {code:?} after {:.3} s: {err}",
        took.as_secs_f64()
    );
    assert_eq!(code, Some(7), "curl cannot connect: {err}");
    assert!(took < FAIL_FAST_WITHIN, "curl took {took:?}: {err}");
    let (result, took) = connect_web(&f);
    let e = result.expect_err("no connection through the hole");
    eprintln!(
        "tr-10: connect() while reconnecting: {e} after {:.3} ms",
        took.as_secs_f64() * 1000.0
    );
    assert_eq!(e.raw_os_error(), Some(libc::EHOSTUNREACH), "{e}");
    assert!(took < FAIL_FAST_WITHIN, "{took:?}");

    // The hole holds: still reconnecting, the ICMP answers are counted, the
    // table drops what the agent keeps trying.
    let rest = HOLE.saturating_sub(t_hole.elapsed());
    std::thread::sleep(rest);
    let s = f.session();
    assert_eq!(s["state"], "reconnecting", "{s:#}");
    let l = liveness(&f);
    eprintln!("tr-10: after {} s of hole: liveness {l}", HOLE.as_secs());
    assert!(l["unreachable_sent"].as_u64() >= Some(3), "{l:#}");
    assert!(
        l["refused_packets"].as_u64() >= l["unreachable_sent"].as_u64(),
        "{l:#}"
    );
    let dropped = hole.dropped();
    eprintln!("tr-10: nftables dropped {dropped} packets laptop <-> API server");
    assert!(dropped > 0, "the hole dropped the port-forward's packets");

    // --- the path heals
    hole.heal();
    let t_heal = Instant::now();
    let back = f.wait_state("connected", RECOVER_WITHIN);
    let (http_back, _) = f.wait_http(web(), t_heal, RECOVER_WITHIN);
    eprintln!(
        "tr-10: after healing: connected in {:.2} s, HTTP through the ClusterIP in {:.2} s (bound {} s)",
        back.as_secs_f64(),
        http_back.as_secs_f64(),
        RECOVER_WITHIN.as_secs()
    );
    let (code, err, _) = curl_web(&f, 10);
    assert_eq!(code, Some(0), "curl works again: {err}");
    let after = f.session();
    assert_eq!(after["tunnel_ip"], tunnel_ip, "same tunnel IP");
    assert_eq!(after["tun_name"], tun.as_str(), "same TUN device");
    assert_eq!(
        f.tun_state(&tun),
        before,
        "same TUN ifindex, addresses and routes"
    );
}
