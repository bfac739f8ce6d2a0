//! Privileged tests of TLS on the data channel, in a network namespace of their
//! own: a session verifies the (fake) manager's certificate against the CA from
//! its parameters, pings cross the TUN through TLS, a re-dial after a lost
//! transport is TLS again, a wrong CA or name fails Connect with a message
//! naming the manager and the certificate problem (and leaves nothing behind),
//! and the outbound throughput over TLS is measured against plain TCP in the
//! same run.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::fake_manager::{FakeManager, test_pki};
use common::{TestNetns, require_root};
use ipnet::IpNet;
use kvpn_dataplane::ebpf::{RouteKind, Stats};
use kvpn_dataplane::liveness::State;
use kvpn_dataplane::netlink::Netlink;
use kvpn_dataplane::pump::Counters;
use kvpn_dataplane::session::{
    AttachedClassifier, BoxError, ClassifierAttach, ConnectError, Session, SessionParams, Step,
};
use kvpn_dataplane::tls::TlsClient;

const SERVER_NAME: &str = "kvpn-manager.kvpn-test.svc";
const TUNNEL_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(100, 96, 0, 2));

/// Test double of the eBPF classifier (eBPF is tested elsewhere).
struct NoClassifier;
struct NoStats;
impl AttachedClassifier for NoStats {
    fn stats(&self) -> Result<Stats, BoxError> {
        Ok(Stats::default())
    }
}
impl ClassifierAttach for NoClassifier {
    fn attach(
        &self,
        _: &str,
        _: &[(IpNet, RouteKind)],
    ) -> Result<Box<dyn AttachedClassifier>, BoxError> {
        Ok(Box::new(NoStats))
    }
}

fn params(manager: SocketAddr, tls: Option<TlsClient>, heartbeat: Duration) -> SessionParams {
    SessionParams {
        manager: manager.to_string(),
        routes: vec![("10.244.0.0/16".parse().expect("cidr"), RouteKind::Pod)],
        tunnel_ip: TUNNEL_IP,
        tunnel_ip_v6: None,
        tun_name: None,
        mtu: kvpn_dataplane::DEFAULT_MTU,
        heartbeat_interval: heartbeat,
        tls,
        session_token: Vec::new(),
        allow_route_conflict: false,
        steer_ebpf: false,
        workers: 1,
        data_peer: Default::default(),
        run_table: None,
        run_mark: None,
    }
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

#[test]
fn tls_session_pings_through_the_fake_manager_and_redials_with_tls() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let (ca_pem, server) = test_pki(SERVER_NAME);
        let manager = FakeManager::start_tls(true, server).await;
        let tls = TlsClient::new(ca_pem.as_bytes(), SERVER_NAME).expect("TLS client");
        let netlink = Netlink::new().expect("netlink");
        let session = Session::start(
            "tls1".into(),
            params(manager.addr, Some(tls), Duration::from_millis(200)),
            &netlink,
            &NoClassifier,
        )
        .await
        .expect("connect over TLS");
        assert_eq!(manager.seen.tls_sessions.load(Ordering::SeqCst), 1);
        // The fake manager records the hello on its own task: wait for it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while manager.hellos().is_empty() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(manager.hellos().len(), 1, "the hello arrived inside TLS");
        assert_eq!(session.status().data_channel, "tls");

        let ping = ns
            .exec_async(&["ping", "-c", "3", "-i", "0.2", "-W", "2", "10.244.1.11"])
            .await;
        let out = String::from_utf8_lossy(&ping.stdout);
        assert!(
            ping.status.success() && out.contains("3 received"),
            "ping through TLS: {out}"
        );
        wait_for("connected", Duration::from_secs(2), || {
            session.state().0 == State::Connected
        })
        .await;

        // Lose the transport: the supervisor re-dials, with TLS again, and
        // traffic flows on the same TUN device.
        manager.kick();
        wait_for("TLS re-dial", Duration::from_secs(5), || {
            manager.seen.tls_sessions.load(Ordering::SeqCst) == 2
        })
        .await;
        assert_eq!(manager.seen.tls_failures.load(Ordering::SeqCst), 0);
        assert_eq!(manager.hellos().len(), 2);
        // Until the new transport's first heartbeat echo the session is
        // reconnecting and refuses packets with ICMP unreachable (tr-10).
        wait_for("connected again", Duration::from_secs(5), || {
            session.state().0 == State::Connected
        })
        .await;
        let ping = ns
            .exec_async(&["ping", "-c", "2", "-i", "0.2", "-W", "2", "10.244.1.11"])
            .await;
        let out = String::from_utf8_lossy(&ping.stdout);
        assert!(
            ping.status.success() && out.contains("2 received"),
            "ping after re-dial: {out}"
        );
        assert_eq!(session.status().data_channel, "tls");

        let report = session.teardown(&netlink).await;
        assert!(report.leftovers.is_empty(), "{:?}", report.leftovers);
    });
}

#[test]
fn wrong_ca_or_name_fails_connect_naming_the_manager_and_the_certificate() {
    require_root();
    let netns = TestNetns::new();
    let ns = netns.handle();
    netns.block_on(move || async move {
        let (_, server) = test_pki(SERVER_NAME);
        let manager = FakeManager::start_tls(true, server).await;
        let netlink = Netlink::new().expect("netlink");
        let addr = manager.addr.to_string();

        // Another install's CA.
        let (other_ca, _) = test_pki(SERVER_NAME);
        let tls = TlsClient::new(other_ca.as_bytes(), SERVER_NAME).expect("TLS client");
        let err = Session::start(
            "tls2".into(),
            params(manager.addr, Some(tls), Duration::from_secs(2)),
            &netlink,
            &NoClassifier,
        )
        .await
        .expect_err("a manager certificate from another CA must be refused");
        assert_eq!(err.step(), Step::TlsHandshake);
        let text = err.to_string();
        assert!(
            text.contains(&addr)
                && text.contains("certificate")
                && text.contains("issued by a CA other than the one this session was set up with"),
            "{text}"
        );
        assert!(matches!(err, ConnectError::Step { ref rollback, .. } if rollback.is_empty()));

        // The right CA, expecting another name (another namespace's manager).
        let (ca, server) = test_pki(SERVER_NAME);
        let right = FakeManager::start_tls(true, server).await;
        let tls = TlsClient::new(ca.as_bytes(), "kvpn-manager.elsewhere.svc").expect("TLS client");
        let err = Session::start(
            "tls3".into(),
            params(right.addr, Some(tls), Duration::from_secs(2)),
            &netlink,
            &NoClassifier,
        )
        .await
        .expect_err("a certificate for another name must be refused");
        let text = err.to_string();
        assert!(
            text.contains(&right.addr.to_string())
                && text.contains("certificate not valid for name \"kvpn-manager.elsewhere.svc\""),
            "{text}"
        );

        // A plain-TCP manager when TLS is expected: a clear handshake error.
        let plain = FakeManager::start(true).await;
        let tls = TlsClient::new(ca.as_bytes(), SERVER_NAME).expect("TLS client");
        let err = Session::start(
            "tls4".into(),
            params(plain.addr, Some(tls), Duration::from_secs(2)),
            &netlink,
            &NoClassifier,
        )
        .await
        .expect_err("a plain manager must not pass for TLS");
        assert_eq!(err.step(), Step::TlsHandshake);
        assert!(err.to_string().contains(&plain.addr.to_string()), "{err}");

        // None of them got a hello, and nothing was set up.
        assert!(manager.hellos().is_empty() && right.hellos().is_empty());
        assert_eq!(manager.seen.tls_failures.load(Ordering::SeqCst), 1);
        assert_eq!(ns.kvpn_links(), Vec::<String>::new());
    });
}

#[test]
fn tls_request_fields_are_validated() {
    let (ca, _) = test_pki(SERVER_NAME);
    assert!(TlsClient::from_request("", "").expect("plain").is_none());
    let err = TlsClient::from_request(&ca, "").expect_err("name missing");
    assert!(err.to_string().contains("together"), "{err}");
    let err = TlsClient::from_request("not a PEM", SERVER_NAME).expect_err("bad CA");
    assert!(
        err.to_string().contains("no usable CA certificate"),
        "{err}"
    );
    let err = TlsClient::from_request(&ca, "not a name!").expect_err("bad name");
    assert!(err.to_string().contains("not a valid DNS name"), "{err}");
    let ok = TlsClient::from_request(&ca, "10.96.0.10").expect("an IP is a valid name");
    assert_eq!(ok.map(|t| t.server_name()), Some("10.96.0.10".to_owned()));
}

/// Outbound throughput through a real TUN device into a sink manager, plain TCP
/// and TLS in the same run, and every counted packet arrives either way. Numbers
/// worth comparing come from release builds:
/// `cargo test -p kvpn-dataplane --release --test tls -- throughput --nocapture`.
#[test]
fn tls_throughput_against_plain_in_the_same_run() {
    require_root();
    let mut rates = Vec::new();
    for secure in [false, true] {
        let netns = TestNetns::new();
        let rate = netns.block_on(move || async move {
            let (ca, server) = test_pki(SERVER_NAME);
            let manager = if secure {
                FakeManager::start_sink_tls(server).await
            } else {
                FakeManager::start_sink().await
            };
            let tls =
                secure.then(|| TlsClient::new(ca.as_bytes(), SERVER_NAME).expect("TLS client"));
            let netlink = Netlink::new().expect("netlink");
            let session = Session::start(
                "tp".into(),
                params(manager.addr, tls, Duration::from_secs(2)),
                &netlink,
                &NoClassifier,
            )
            .await
            .expect("connect");
            let per_sender: usize = if cfg!(debug_assertions) {
                10_000
            } else {
                100_000
            };
            let payload = 8972;
            let started = Instant::now();
            let senders: Vec<_> = (0..2u16)
                .map(|i| {
                    std::thread::spawn(move || {
                        let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("udp");
                        let data = vec![0x5a; payload];
                        for _ in 0..per_sender {
                            // ENOBUFS when the TUN queue is full: dropped before the pump.
                            let _ = sock.send_to(&data, ("10.244.1.11", 7000 + i));
                        }
                    })
                })
                .collect();
            for s in senders {
                s.join().expect("sender");
            }
            // A snapshot per read: the workers' counters summed.
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let tx = Counters::get(&session.counters().tx_packets) as usize;
                tokio::time::sleep(Duration::from_millis(200)).await;
                let got = manager.seen.packet_count.load(Ordering::Relaxed);
                if got == tx && Counters::get(&session.counters().tx_packets) as usize == tx {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "manager got {got} of {tx} packets"
                );
            }
            let c = session.counters();
            let secs = started.elapsed().as_secs_f64();
            let bytes = Counters::get(&c.tx_bytes);
            assert_eq!(
                manager.seen.packet_bytes.load(Ordering::Relaxed) as u64,
                bytes
            );
            assert!(bytes > 0);
            let gbps = bytes as f64 * 8.0 / secs / 1e9;
            eprintln!(
                "{}: {} packets, {:.2} Gbit/s IP, {:.1} packets/batch",
                if secure { "tls  " } else { "plain" },
                Counters::get(&c.tx_packets),
                gbps,
                Counters::get(&c.tx_packets) as f64 / Counters::get(&c.tx_batches).max(1) as f64
            );
            assert!(session.teardown(&netlink).await.leftovers.is_empty());
            gbps
        });
        rates.push(rate);
    }
    eprintln!("TLS / plain throughput ratio: {:.2}", rates[1] / rates[0]);
}
