//! Privileged tests of a session in a network namespace of their own: real TUN
//! device, real rtnetlink routes and rp_filter, the real pump, and a test double
//! of the traffic manager (`FakeManager`) on the namespace's loopback.
//!
//! The classifier here is a test double ([`RecordingClassifier`]) except in
//! `real_ebpf_classifier_attaches_or_rolls_back`, so that TUN, route and pump
//! behaviour is checked whatever state the eBPF build is in.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fake_manager::{FakeManager, udp_dst};
use common::{Ns, TestNetns, require_root};
use ipnet::IpNet;
use kvpn_dataplane::ebpf::{RouteKind, Stats};
use kvpn_dataplane::liveness::State;
use kvpn_dataplane::netlink::Netlink;
use kvpn_dataplane::pump::Counters;
use kvpn_dataplane::session::{
    AttachedClassifier, BoxError, ClassifierAttach, ConnectError, EbpfClassifiers, Session,
    SessionParams, Step,
};

/// One attach call: the interface and the entries.
type Attached = (String, Vec<(IpNet, RouteKind)>);

/// Test double of the eBPF classifier: records what it was asked to install.
#[derive(Default, Clone)]
struct RecordingClassifier {
    attached: Arc<Mutex<Vec<Attached>>>,
}

struct NoStats;
impl AttachedClassifier for NoStats {
    fn stats(&self) -> Result<Stats, BoxError> {
        Ok(Stats::default())
    }
}

impl ClassifierAttach for RecordingClassifier {
    fn attach(
        &self,
        ifname: &str,
        entries: &[(IpNet, RouteKind)],
    ) -> Result<Box<dyn AttachedClassifier>, BoxError> {
        self.attached
            .lock()
            .expect("lock")
            .push((ifname.to_owned(), entries.to_vec()));
        Ok(Box::new(NoStats))
    }
}

/// Test double of a classifier that cannot attach (to test rollback, lc-03).
struct FailingClassifier;
impl ClassifierAttach for FailingClassifier {
    fn attach(
        &self,
        _: &str,
        _: &[(IpNet, RouteKind)],
    ) -> Result<Box<dyn AttachedClassifier>, BoxError> {
        Err("simulated attach failure".into())
    }
}

fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR")
}

const TUNNEL_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2));

fn params(
    manager: SocketAddr,
    routes: Vec<(IpNet, RouteKind)>,
    heartbeat: Duration,
) -> SessionParams {
    SessionParams {
        manager: manager.to_string(),
        routes,
        tunnel_ip: TUNNEL_IP,
        tunnel_ip_v6: None,
        tun_name: None,
        mtu: kvpn_dataplane::DEFAULT_MTU,
        heartbeat_interval: heartbeat,
        tls: None,
        session_token: Vec::new(),
        allow_route_conflict: false,
        steer_ebpf: false,
        workers: 1,
        data_peer: Default::default(),
        run_table: None,
        run_mark: None,
    }
}

fn lab_routes() -> Vec<(IpNet, RouteKind)> {
    vec![
        (net("10.244.0.0/16"), RouteKind::Pod),
        (net("10.96.0.0/12"), RouteKind::Service),
        // rt-03 shapes: host bits set, and a CIDR covered by a wider one.
        (net("10.42.2.5/24"), RouteKind::Pod),
        (net("10.96.1.0/24"), RouteKind::Extra),
    ]
}

async fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn assert_nothing_left(ns: &Ns) {
    assert_eq!(
        ns.kvpn_links(),
        Vec::<String>::new(),
        "no kvpn link may remain"
    );
    assert_eq!(
        ns.kvpn_routes(),
        "",
        "no route with kvpn's protocol may remain"
    );
}

#[test]
fn session_installs_normalised_routes_address_mtu_and_loose_rp_filter() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        let classifier = RecordingClassifier::default();
        let mut routes = lab_routes();
        // An IPv6 CIDR with host bits: installed truncated, without a source hint.
        routes.push((net("fd00:10::1/64"), RouteKind::Extra));
        let session = Session::start(
            "t1".into(),
            params(manager.addr, routes, Duration::from_secs(2)),
            &netlink,
            &classifier,
        )
        .await
        .expect("connect");
        let tun = session.tun_name().to_owned();
        assert_eq!(tun, "kvpn0", "first free kvpnN in a fresh namespace");

        // Routes: exactly the normalised set, tagged, through the TUN, preferring the tunnel IP.
        let routes = ns.routes_via(&tun);
        let mut dsts: Vec<&str> = routes.iter().filter_map(|r| r["dst"].as_str()).collect();
        dsts.sort_unstable();
        assert_eq!(
            dsts,
            ["10.244.0.0/16", "10.42.2.0/24", "10.96.0.0/12"],
            "{routes:?}"
        );
        for r in &routes {
            assert_eq!(
                r["protocol"].as_str(),
                Some("107"),
                "route tagged with kvpn's protocol: {r}"
            );
            assert_eq!(r["prefsrc"].as_str(), Some("100.96.0.2"), "{r}");
            assert_eq!(r["scope"].as_str(), Some("link"), "{r}");
        }
        let v6: Vec<serde_json::Value> = serde_json::from_str(&ns.exec_ok(&[
            "ip", "-6", "-j", "route", "show", "table", "main", "dev", &tun, "proto", "107",
        ]))
        .expect("JSON");
        let v6: Vec<&str> = v6.iter().filter_map(|r| r["dst"].as_str()).collect();
        assert_eq!(v6, ["fd00:10::/64"]);
        // The classifier gets every distinct prefix with its kind, covered ones too.
        let attached = classifier.attached.lock().expect("lock").clone();
        assert_eq!(attached.len(), 1);
        assert_eq!(attached[0].0, tun);
        assert!(
            attached[0]
                .1
                .contains(&(net("10.96.1.0/24"), RouteKind::Extra)),
            "{:?}",
            attached[0].1
        );
        assert_eq!(attached[0].1.len(), 5);

        // Address /32, MTU, up.
        let link: serde_json::Value =
            serde_json::from_str(&ns.exec_ok(&["ip", "-j", "addr", "show", "dev", &tun]))
                .expect("JSON");
        let link = &link[0];
        assert_eq!(link["mtu"].as_u64(), Some(9000));
        assert!(
            link["flags"]
                .as_array()
                .expect("flags")
                .iter()
                .any(|f| f == "UP"),
            "{link}"
        );
        let addrs: Vec<(String, u64)> = link["addr_info"]
            .as_array()
            .expect("addr_info")
            .iter()
            .map(|a| {
                (
                    a["local"].as_str().unwrap_or_default().to_owned(),
                    a["prefixlen"].as_u64().unwrap_or_default(),
                )
            })
            .collect();
        assert!(addrs.contains(&("100.96.0.2".to_owned(), 32)), "{addrs:?}");

        // rp_filter loose, as the kernel shows it.
        let rp = ns.exec_ok(&["cat", &format!("/proc/sys/net/ipv4/conf/{tun}/rp_filter")]);
        assert_eq!(rp.trim(), "2");

        // The manager got the hello first.
        wait_for("hello", Duration::from_secs(2), || {
            !manager.hellos().is_empty()
        })
        .await;
        let hello = &manager.hellos()[0];
        assert_eq!(hello.version, kvpn_proto::frame::PROTOCOL_VERSION);
        assert_eq!(hello.tunnel_ip, TUNNEL_IP);
        assert!(hello.token.is_empty());

        let report = session.teardown(&netlink).await;
        assert_eq!(report.routes_removed, 4);
        assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
        assert!(ns.routes_via(&tun).is_empty());
        assert_nothing_left(&ns);
    });
}

#[test]
fn ping_and_udp_cross_the_tun_through_the_fake_manager() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        let session = Session::start(
            "t2".into(),
            params(manager.addr, lab_routes(), Duration::from_millis(200)),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect("connect");

        // ICMP: the kernel routes the echo request into the TUN, the fake manager
        // answers, the reply comes back through the TUN to ping.
        let ping = ns
            .exec_async(&["ping", "-c", "3", "-i", "0.2", "-W", "2", "10.244.1.11"])
            .await;
        assert!(
            ping.status.success(),
            "ping through the tunnel: {}",
            String::from_utf8_lossy(&ping.stdout)
        );
        assert!(String::from_utf8_lossy(&ping.stdout).contains("3 received"));

        // UDP both ways.
        let sock = tokio::net::UdpSocket::bind("0.0.0.0:0")
            .await
            .expect("udp socket");
        sock.send_to(b"hello through kvpn", "10.244.1.12:7007")
            .await
            .expect("send");
        let mut buf = [0u8; 64];
        let (n, from) = tokio::time::timeout(Duration::from_secs(2), sock.recv_from(&mut buf))
            .await
            .expect("UDP reply within 2 s")
            .expect("recv");
        assert_eq!(&buf[..n], b"hello through kvpn");
        assert_eq!(
            from,
            "10.244.1.12:7007".parse::<SocketAddr>().expect("addr")
        );
        let seen_udp: Vec<_> = manager
            .packets()
            .iter()
            .filter_map(|p| udp_dst(p))
            .collect();
        assert!(
            seen_udp.iter().any(
                |(dst, port, data, src)| *dst == Ipv4Addr::new(10, 244, 1, 12)
                    && *port == 7007
                    && data == b"hello through kvpn"
                    && *src == Ipv4Addr::new(100, 96, 0, 2)
            ),
            "manager saw {seen_udp:?}"
        );

        // Heartbeats echoed: connected. Counters moved both ways.
        wait_for("state connected", Duration::from_secs(2), || {
            session.state().0 == State::Connected
        })
        .await;
        let c = session.counters();
        assert!(Counters::get(&c.tx_packets) >= 4, "3 pings + 1 UDP out");
        assert!(Counters::get(&c.rx_packets) >= 4, "3 replies + 1 UDP in");
        assert!(Counters::get(&c.tx_bytes) > 0 && Counters::get(&c.rx_bytes) > 0);
        let status = session.status();
        assert_eq!(status.state, "connected");
        assert_eq!(status.tx_packets, Counters::get(&c.tx_packets));
        assert_eq!(status.routes.len(), 3);
        assert_eq!(status.mtu, 9000);

        // An address in a routed CIDR that nobody answers: the fake manager
        // ignores TCP, so a connect must not succeed.
        let tcp = tokio::time::timeout(
            Duration::from_millis(500),
            tokio::net::TcpStream::connect("10.96.0.100:80"),
        )
        .await;
        assert!(
            !matches!(tcp, Ok(Ok(_))),
            "TCP must not connect without a manager that answers it"
        );

        let report = session.teardown(&netlink).await;
        assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
        // After teardown the pod CIDR is unreachable again.
        let ping = ns
            .exec_async(&["ping", "-c", "1", "-W", "1", "10.244.1.11"])
            .await;
        assert!(
            !ping.status.success(),
            "ping must fail once the session is gone"
        );
        assert_nothing_left(&ns);
    });
}

#[test]
fn silent_manager_turns_reconnecting_and_recovers_when_echoes_return() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        // A black hole: accepts, reads, never echoes.
        let manager = FakeManager::start(false).await;
        let netlink = Netlink::new().expect("netlink");
        let interval = Duration::from_millis(100);
        let session = Session::start(
            "t3".into(),
            params(
                manager.addr,
                vec![(net("10.244.0.0/16"), RouteKind::Pod)],
                interval,
            ),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect("connect");
        assert_eq!(session.state().0, State::Connecting);
        let ifindex = session.ifindex();

        wait_for("state reconnecting", Duration::from_secs(3), || {
            session.state().0 == State::Reconnecting
        })
        .await;
        let (_, reason) = session.state();
        assert!(
            reason
                .as_deref()
                .unwrap_or_default()
                .contains("no heartbeat echo"),
            "{reason:?}"
        );
        // The supervisor drops the silent transport and dials again, with a hello each time.
        wait_for("a re-dial", Duration::from_secs(3), || {
            manager.seen.connections.load(Ordering::SeqCst) >= 2
        })
        .await;
        wait_for("a second hello", Duration::from_secs(2), || {
            manager.hellos().len() >= 2
        })
        .await;

        // The path heals: echoes come back, the session is connected again on
        // the same TUN device.
        manager.echo.store(true, Ordering::SeqCst);
        wait_for("state connected", Duration::from_secs(5), || {
            session.state().0 == State::Connected
        })
        .await;
        assert_eq!(session.ifindex(), ifindex);
        let ping = ns
            .exec_async(&["ping", "-c", "1", "-W", "2", "10.244.7.7"])
            .await;
        assert!(ping.status.success(), "traffic flows after recovery");

        let report = session.teardown(&netlink).await;
        assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
        assert_nothing_left(&ns);
    });
}

/// tr-10 at the netns level: behind a black-holed manager (accepts, never
/// echoes), a reconnecting session answers connects toward the cluster with
/// ICMP host unreachable through the real TUN, so `connect()` fails at once
/// with EHOSTUNREACH instead of hanging; the kernel accepts the message (source
/// = the unreachable destination, loose rp_filter) and Status counts it.
#[test]
fn tr_10_reconnecting_session_fails_connects_fast_with_host_unreachable() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(false).await;
        let netlink = Netlink::new().expect("netlink");
        let interval = Duration::from_millis(100);
        let session = Session::start(
            "t10".into(),
            params(
                manager.addr,
                vec![(net("10.244.0.0/16"), RouteKind::Pod)],
                interval,
            ),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect("connect");
        wait_for("state reconnecting", Duration::from_secs(3), || {
            session.state().0 == State::Reconnecting
        })
        .await;

        for attempt in 0..3 {
            let t0 = Instant::now();
            let result = tokio::time::timeout(
                Duration::from_secs(10),
                tokio::net::TcpStream::connect("10.244.7.7:80"),
            )
            .await
            .expect("connect must not hang while reconnecting");
            let took = t0.elapsed();
            let err = result.expect_err("no connection while the manager is silent");
            eprintln!("attempt {attempt}: connect failed after {took:?}: {err}");
            assert_eq!(
                err.raw_os_error(),
                Some(libc::EHOSTUNREACH),
                "No route to host: {err}"
            );
            assert!(took < Duration::from_secs(1), "fails fast: {took:?}");
        }
        let ping = ns
            .exec_async(&["ping", "-c", "1", "-W", "5", "10.244.7.7"])
            .await;
        let out = String::from_utf8_lossy(&ping.stdout);
        assert!(!ping.status.success(), "{out}");
        assert!(out.contains("Destination Host Unreachable"), "{out}");

        let status = session.status();
        let liveness = status.liveness.expect("liveness in Status");
        assert_eq!(liveness.heartbeat_interval_ms, 100);
        assert_eq!(liveness.window_ms, 300);
        assert!(liveness.unreachable_sent >= 4, "{liveness:?}");
        assert!(
            liveness.refused_packets >= liveness.unreachable_sent,
            "{liveness:?}"
        );
        let to_pod = manager
            .packets()
            .iter()
            .filter(|p| p.len() >= 20 && p[0] >> 4 == 4 && p[16..20] == [10, 244, 7, 7])
            .count();
        assert_eq!(to_pod, 0, "nothing reached the manager while reconnecting");

        let report = session.teardown(&netlink).await;
        assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
        assert_nothing_left(&ns);
    });
}

#[test]
fn lc_03_a_failing_step_rolls_back_tun_and_routes() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        let err = Session::start(
            "t4".into(),
            params(manager.addr, lab_routes(), Duration::from_secs(2)),
            &netlink,
            &FailingClassifier,
        )
        .await
        .expect_err("the classifier step fails");
        assert_eq!(err.step(), Step::AttachClassifier);
        let msg = err.to_string();
        assert!(msg.contains("attach the eBPF classifier"), "{msg}");
        assert!(msg.contains("simulated attach failure"), "{msg}");
        assert!(msg.contains("rolled back"), "{msg}");
        assert_nothing_left(&ns);
    });
}

#[test]
fn lc_03_a_route_conflict_is_refused_before_anything_is_installed() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    // Somebody else's route for the pod CIDR (rt-05's shape): refused at the
    // conflict check, before the TUN device or any route exists.
    ns.exec_ok(&["ip", "route", "add", "10.244.0.0/16", "dev", "lo"]);
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        let err = Session::start(
            "t9".into(),
            params(manager.addr, lab_routes(), Duration::from_secs(2)),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect_err("the pod CIDR route collides");
        assert_eq!(err.step(), Step::CheckRouteConflicts, "{err}");
        let msg = err.to_string();
        assert!(msg.contains("check route conflicts"), "{msg}");
        assert!(
            msg.contains(
                "pod CIDR 10.244.0.0/16 overlaps 10.244.0.0/16 dev lo (proto boot, table main)"
            ),
            "{msg}"
        );
        assert!(msg.contains("--allow-route-conflict"), "{msg}");
        assert_nothing_left(&ns);
        // The other owner's route is untouched.
        let theirs = ns.exec_ok(&["ip", "route", "show", "10.244.0.0/16"]);
        assert!(theirs.contains("dev lo"), "{theirs}");
    });
}

#[test]
fn explicit_tun_name_is_used_and_a_taken_name_is_refused() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        let mut p = params(
            manager.addr,
            vec![(net("10.244.0.0/16"), RouteKind::Pod)],
            Duration::from_secs(2),
        );
        p.tun_name = Some("kvpn-test7".into());
        p.mtu = 1400;
        let first = Session::start(
            "a".into(),
            p.clone(),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect("first session");
        assert_eq!(first.tun_name(), "kvpn-test7");
        let mtu = ns.exec_ok(&["cat", "/sys/class/net/kvpn-test7/mtu"]);
        assert_eq!(mtu.trim(), "1400");

        // Same name again: refused before anything is created, first session intact.
        p.routes = vec![(net("10.50.0.0/16"), RouteKind::Extra)];
        let err = Session::start("b".into(), p, &netlink, &RecordingClassifier::default())
            .await
            .expect_err("name taken");
        assert_eq!(err.step(), Step::CreateTun);
        assert!(err.to_string().contains("already exists"), "{err}");
        assert_eq!(
            ns.routes_via("kvpn-test7").len(),
            1,
            "first session's route untouched"
        );
        assert_eq!(ns.kvpn_links(), vec!["kvpn-test7".to_owned()]);

        assert!(first.teardown(&netlink).await.leftovers.is_empty());
        assert_nothing_left(&ns);
    });
}

#[test]
fn unreachable_manager_names_address_cause_and_fix() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        // A port nobody listens on in a fresh namespace: connection refused.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        let netlink = Netlink::new().expect("netlink");
        let err = Session::start("t6".into(), params(closed, lab_routes(), Duration::from_secs(2)), &netlink, &RecordingClassifier::default())
            .await
            .expect_err("nobody listens");
        assert!(matches!(err, ConnectError::Unreachable(_)));
        assert_eq!(
            err.to_string(),
            format!("cannot reach the traffic manager at {closed}: connection refused — is kvpn-manager running and the address right?")
        );
        // An address without a route: fails fast, names the cause.
        let err = Session::start(
            "t7".into(),
            params("192.0.2.1:10801".parse().expect("addr"), lab_routes(), Duration::from_secs(2)),
            &netlink,
            &RecordingClassifier::default(),
        )
        .await
        .expect_err("no route");
        assert!(err.to_string().starts_with("cannot reach the traffic manager at 192.0.2.1:10801: network unreachable"), "{err}");
        assert_nothing_left(&ns);
    });
}

#[test]
fn real_ebpf_classifier_attaches_or_rolls_back() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let manager = FakeManager::start(true).await;
        let netlink = Netlink::new().expect("netlink");
        match Session::start(
            "t8".into(),
            params(manager.addr, lab_routes(), Duration::from_secs(2)),
            &netlink,
            &EbpfClassifiers,
        )
        .await
        {
            Ok(session) => {
                eprintln!("eBPF classifier built in: checking it counts");
                // Built with the eBPF object: the classifier passes and counts pod traffic.
                let ping = ns
                    .exec_async(&["ping", "-c", "2", "-i", "0.2", "-W", "2", "10.244.1.11"])
                    .await;
                assert!(ping.status.success(), "ping through the classified TUN");
                let stats = session
                    .classifier_stats()
                    .expect("a classifier")
                    .expect("stats");
                assert!(stats.kind(RouteKind::Pod).packets >= 2, "{stats:?}");
                // Nothing reached the tunnel unclassified: every packet the pump
                // sent passed the classifier (the kernel's own IPv6 chatter on a
                // new device, MLD and router solicitations, must not slip in
                // before the classifier is attached).
                let passed: u64 = stats.per_kind.iter().map(|(_, c)| c.packets).sum();
                assert_eq!(
                    Counters::get(&session.counters().tx_packets),
                    passed,
                    "{stats:?}"
                );
                let status = session.status();
                assert!(!status.ebpf.is_empty());
                let report = session.teardown(&netlink).await;
                assert!(
                    report.leftovers.is_empty(),
                    "leftovers: {:?}",
                    report.leftovers
                );
            }
            Err(err) => {
                eprintln!("eBPF classifier not built in: checking the rollback");
                // Built with AYA_BUILD_SKIP: Connect must fail at this step, say
                // why, and leave nothing behind.
                assert_eq!(err.step(), Step::AttachClassifier, "{err}");
                assert!(err.to_string().contains("AYA_BUILD_SKIP"), "{err}");
                assert!(err.to_string().contains("rolled back"), "{err}");
            }
        }
        assert_nothing_left(&ns);
    });
}

/// Under load from two senders on a real TUN device, every packet the pump counts
/// as sent reaches the (sink) `FakeManager`. It also prints throughput and batch
/// sizes; for numbers worth comparing run it in release with
/// `cargo test -p kvpn-dataplane --release --test netns -- outbound_pump --nocapture`
/// (debug builds send fewer packets to stay quick). Speed is judged in bench/, not here.
#[test]
fn outbound_pump_delivers_every_packet_it_counts() {
    require_root();
    for payload in [1400usize, 8972] {
        let netns = TestNetns::new();
        let ns = netns.handle();
        netns.block_on(move || async move {
            let manager = FakeManager::start_sink().await;
            let netlink = Netlink::new().expect("netlink");
            let session = Session::start(
                "m".into(),
                params(manager.addr, vec![(net("10.244.0.0/16"), RouteKind::Pod)], Duration::from_secs(2)),
                &netlink,
                &RecordingClassifier::default(),
            )
            .await
            .expect("connect");
            // Two blocking senders on their own threads (in the namespace: they
            // are spawned from a runtime thread that entered it).
            let per_sender: usize = if cfg!(debug_assertions) { 20_000 } else { 200_000 };
            let started = Instant::now();
            let senders: Vec<_> = (0..2)
                .map(|i| {
                    std::thread::spawn(move || {
                        let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp");
                        let data = vec![0x5a; payload];
                        let mut sent = 0usize;
                        for _ in 0..per_sender {
                            // ENOBUFS when the TUN queue is full: the kernel's drop,
                            // before the pump; count only what the kernel accepted.
                            if sock.send_to(&data, ("10.244.1.11", 7000 + i)).is_ok() {
                                sent += 1;
                            }
                        }
                        sent
                    })
                })
                .collect();
            let accepted: usize = senders.into_iter().map(|s| s.join().expect("sender")).sum();
            // A snapshot per read: the workers' counters summed.
            // Drain: wait until the counts are stable and the manager has
            // everything the pump wrote.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let tx = Counters::get(&session.counters().tx_packets) as usize;
                tokio::time::sleep(Duration::from_millis(200)).await;
                let got = manager.seen.packet_count.load(Ordering::Relaxed);
                if got == tx && Counters::get(&session.counters().tx_packets) as usize == tx {
                    break;
                }
                assert!(Instant::now() < deadline, "manager got {got} of {tx} packets");
            }
            let c = session.counters();
            let secs = started.elapsed().as_secs_f64();
            let tx = Counters::get(&c.tx_packets);
            let batches = Counters::get(&c.tx_batches);
            let bytes = Counters::get(&c.tx_bytes);
            assert_eq!(manager.seen.packet_count.load(Ordering::Relaxed) as u64, tx, "every packet the pump sent arrived");
            assert_eq!(manager.seen.packet_bytes.load(Ordering::Relaxed) as u64, bytes);
            eprintln!(
                "payload {payload} B: {accepted} datagrams accepted by the kernel, {tx} through the pump in {secs:.2} s = {:.0} packets/s, {:.2} Gbit/s IP; {batches} writev batches, {:.1} packets/batch",
                tx as f64 / secs,
                bytes as f64 * 8.0 / secs / 1e9,
                tx as f64 / batches.max(1) as f64,
            );
            let dropped = ns.exec_ok(&["cat", &format!("/sys/class/net/{}/statistics/tx_dropped", session.tun_name())]);
            let dropped: u64 = dropped.trim().parse().expect("tx_dropped is a number");
            eprintln!("  the TUN device's own queue dropped {dropped} packets before the pump (tx_dropped)");
            // Every datagram the kernel accepted either crossed the pump or was
            // dropped by the kernel's TUN queue: none vanished inside the pump.
            assert!(tx + dropped >= accepted as u64, "{tx} + {dropped} < {accepted}");
            assert!(session.teardown(&netlink).await.leftovers.is_empty());
        });
    }
}
