//! The forwarder against two real DNS servers on loopback sockets (a cluster DNS
//! and the laptop's upstream, both small hickory-proto responders that log every
//! question), without root.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Edns, Message, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, SOA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::forwarder::{Forwarder, Reach};
use super::names::ClusterDns;

type Zone = fn(&Query) -> (ResponseCode, Vec<Record>);

fn name(s: &str) -> Name {
    Name::from_ascii(s).expect("name")
}

fn a(owner: &Name, ip: Ipv4Addr) -> Record {
    Record::from_rdata(owner.clone(), 5, RData::A(A(ip)))
}

/// The cluster: web in dev and default, big (300 endpoints) in dev.
fn cluster_zone(q: &Query) -> (ResponseCode, Vec<Record>) {
    let n = q.name().to_lowercase().to_ascii();
    let exists_empty = [
        "dev.svc.cluster.local.",
        "default.svc.cluster.local.",
        "svc.cluster.local.",
        "cluster.local.",
    ];
    if !name("cluster.local.").zone_of(q.name()) {
        return (ResponseCode::Refused, Vec::new());
    }
    let ip = match n.as_str() {
        "web.dev.svc.cluster.local." => Some(Ipv4Addr::new(10, 96, 0, 200)),
        "web.default.svc.cluster.local." => Some(Ipv4Addr::new(10, 96, 0, 100)),
        "big.dev.svc.cluster.local." => {
            if q.query_type() != RecordType::A {
                return (ResponseCode::NoError, Vec::new());
            }
            let all = (0..300u32)
                .map(|i| a(q.name(), Ipv4Addr::from(0x0af4_0000 + i)))
                .collect();
            return (ResponseCode::NoError, all);
        }
        _ if exists_empty.contains(&n.as_str()) => return (ResponseCode::NoError, Vec::new()),
        _ => return (ResponseCode::NXDomain, Vec::new()),
    };
    match (ip, q.query_type()) {
        (Some(ip), RecordType::A) => (ResponseCode::NoError, vec![a(q.name(), ip)]),
        _ => (ResponseCode::NoError, Vec::new()),
    }
}

/// The laptop's own DNS: corp.test and a public-looking name.
fn upstream_zone(q: &Query) -> (ResponseCode, Vec<Record>) {
    match (q.name().to_lowercase().to_ascii().as_str(), q.query_type()) {
        ("host.corp.test.", RecordType::A) => (
            ResponseCode::NoError,
            vec![a(q.name(), Ipv4Addr::new(192, 0, 2, 10))],
        ),
        ("www.example.com.", RecordType::A) => (
            ResponseCode::NoError,
            vec![a(q.name(), Ipv4Addr::new(192, 0, 2, 20))],
        ),
        // Public names under a top-level domain that is also a namespace of the
        // cluster (`dev`), issue 29 item 2.
        ("go.dev.", RecordType::A) => (
            ResponseCode::NoError,
            vec![a(q.name(), Ipv4Addr::new(192, 0, 2, 30))],
        ),
        ("pkg.go.dev.", RecordType::A) => (
            ResponseCode::NoError,
            vec![a(q.name(), Ipv4Addr::new(192, 0, 2, 31))],
        ),
        ("mycorp.dev.", RecordType::A) => (
            ResponseCode::NoError,
            vec![a(q.name(), Ipv4Addr::new(192, 0, 2, 32))],
        ),
        _ => (ResponseCode::NXDomain, Vec::new()),
    }
}

fn answer(raw: &[u8], zone: Zone, log: &Mutex<Vec<String>>, udp: bool) -> Option<Vec<u8>> {
    let q = Message::from_vec(raw).ok()?;
    let question = q.queries.first()?.clone();
    log.lock()
        .expect("log")
        .push(question.name().to_lowercase().to_ascii());
    let (rcode, records) = zone(&question);
    let mut m = Message::response(q.metadata.id, OpCode::Query);
    m.metadata.response_code = rcode;
    m.add_query(question);
    m.add_answers(records);
    if rcode == ResponseCode::NXDomain {
        m.add_authority(Record::from_rdata(
            name("cluster.local."),
            5,
            RData::SOA(SOA::new(
                name("ns.cluster.local."),
                name("h.cluster.local."),
                1,
                1,
                1,
                1,
                5,
            )),
        ));
    }
    if let Some(e) = &q.edns {
        let mut ours = Edns::new();
        ours.set_max_payload(1232);
        m.set_edns(ours);
        let _ = e;
    }
    let bytes = m.to_vec().ok()?;
    let limit = q
        .edns
        .as_ref()
        .map_or(512, |e| usize::from(e.max_payload()));
    if udp && bytes.len() > limit {
        return m.truncate().to_vec().ok();
    }
    Some(bytes)
}

/// A DNS server on 127.0.0.1 (UDP and TCP, same port) answering from `zone`.
async fn server(zone: Zone) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    // The same port for UDP and TCP: the kernel's pick for UDP may be taken for
    // TCP, so pick again until both fit.
    let mut tries = 0;
    let (udp, addr, tcp) = loop {
        let udp = UdpSocket::bind("127.0.0.1:0").await.expect("udp");
        let addr = udp.local_addr().expect("addr");
        match TcpListener::bind(addr).await {
            Ok(tcp) => break (udp, addr, tcp),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 16 => tries += 1,
            Err(e) => panic!("tcp: {e}"),
        }
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65535];
        while let Ok((n, src)) = udp.recv_from(&mut buf).await {
            if let Some(out) = answer(&buf[..n], zone, &l, true) {
                let _ = udp.send_to(&out, src).await;
            }
        }
    });
    let l = log.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = tcp.accept().await {
            let l = l.clone();
            tokio::spawn(async move {
                let mut len = [0u8; 2];
                while s.read_exact(&mut len).await.is_ok() {
                    let mut raw = vec![0u8; usize::from(u16::from_be_bytes(len))];
                    if s.read_exact(&mut raw).await.is_err() {
                        return;
                    }
                    let Some(out) = answer(&raw, zone, &l, false) else {
                        return;
                    };
                    let n = u16::try_from(out.len()).expect("fits");
                    let _ = s.write_all(&n.to_be_bytes()).await;
                    let _ = s.write_all(&out).await;
                }
            });
        }
    });
    (addr, log)
}

async fn ask_raw(server: SocketAddr, raw: &[u8], tcp: bool) -> Option<Vec<u8>> {
    if tcp {
        let mut s = TcpStream::connect(server).await.expect("connect");
        let n = u16::try_from(raw.len()).expect("small");
        s.write_all(&n.to_be_bytes()).await.expect("write");
        s.write_all(raw).await.expect("write");
        let mut len = [0u8; 2];
        s.read_exact(&mut len).await.ok()?;
        let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
        s.read_exact(&mut buf).await.ok()?;
        Some(buf)
    } else {
        // Like a stub resolver (glibc: `attempts:2`, `timeout:5`): resend after a
        // second without an answer, three tries in all, so a loaded machine does
        // not turn a slow answer into a lost one.
        let s = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let mut buf = vec![0u8; 65535];
        for _ in 0..3 {
            s.send_to(raw, server).await.expect("send");
            if let Ok(Ok((n, _))) =
                tokio::time::timeout(Duration::from_secs(1), s.recv_from(&mut buf)).await
            {
                return Some(buf[..n].to_vec());
            }
        }
        None
    }
}

async fn ask(server: SocketAddr, q: &str, t: RecordType, edns: Option<u16>, tcp: bool) -> Message {
    let mut m = Message::query();
    m.metadata.recursion_desired = true;
    let mut n = name(q);
    n.set_fqdn(true);
    m.add_query(Query::query(n, t));
    if let Some(size) = edns {
        let mut e = Edns::new();
        e.set_max_payload(size);
        m.set_edns(e);
    }
    let raw = ask_raw(server, &m.to_vec().expect("encode"), tcp)
        .await
        .unwrap_or_else(|| panic!("no answer to {q} {t}"));
    let answer = Message::from_vec(&raw).expect("decode");
    assert_eq!(answer.metadata.id, m.metadata.id);
    assert_eq!(answer.queries, m.queries, "question echoed as asked");
    answer
}

fn a_records(m: &Message) -> Vec<Ipv4Addr> {
    m.answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

async fn setup() -> (Forwarder, Arc<Mutex<Vec<String>>>, Arc<Mutex<Vec<String>>>) {
    setup_with(Reach::always()).await
}

async fn setup_with(reach: Reach) -> (Forwarder, Arc<Mutex<Vec<String>>>, Arc<Mutex<Vec<String>>>) {
    let (cluster_addr, cluster_log) = server(cluster_zone).await;
    let (upstream_addr, upstream_log) = server(upstream_zone).await;
    let f = Forwarder::start("127.0.0.1:0".parse().expect("addr"), vec![upstream_addr])
        .await
        .expect("forwarder");
    let cluster = ClusterDns::new(
        &[cluster_addr.to_string()],
        "cluster.local",
        &[
            "dev.svc.cluster.local".into(),
            "svc.cluster.local".into(),
            "cluster.local".into(),
        ],
        false,
    )
    .expect("config");
    f.set_clusters(vec![(cluster, reach)]);
    (f, cluster_log, upstream_log)
}

#[tokio::test]
async fn every_spelling_resolves_connected_namespace_first_and_never_leaks() {
    let (f, cluster_log, upstream_log) = setup().await;
    let fwd = f.local_addr();
    let dev = Ipv4Addr::new(10, 96, 0, 200);
    for spelling in [
        "web",
        "web.",
        "web.dev",
        "web.dev.",
        "web.dev.svc",
        "web.dev.svc.",
        "web.dev.svc.cluster.local",
        "web.dev.svc.cluster.local.",
        "WEB.Dev",
    ] {
        for edns in [None, Some(1232)] {
            let m = ask(fwd, spelling, RecordType::A, edns, false).await;
            assert_eq!(
                m.metadata.response_code,
                ResponseCode::NoError,
                "{spelling}"
            );
            assert_eq!(a_records(&m), vec![dev], "{spelling} {edns:?}");
            assert_eq!(m.edns.is_some(), edns.is_some(), "EDNS answered with EDNS");
            let m = ask(fwd, spelling, RecordType::AAAA, edns, false).await;
            assert_eq!(
                m.metadata.response_code,
                ResponseCode::NoError,
                "{spelling} AAAA"
            );
            assert!(m.answers.is_empty(), "{spelling} AAAA: {:?}", m.answers);
        }
    }
    // The other namespace by its svc.ns spelling.
    let m = ask(fwd, "web.default", RecordType::A, None, false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(10, 96, 0, 100)]);
    // A short name: the CNAME says which Service answered.
    let m = ask(fwd, "web", RecordType::A, None, false).await;
    assert_eq!(
        m.answers[0].data,
        RData::CNAME(hickory_proto::rr::rdata::CNAME(name(
            "web.dev.svc.cluster.local."
        )))
    );
    // dns-01: a missing short name is NXDOMAIN, fast, and never asked upstream.
    let t0 = Instant::now();
    let m = ask(fwd, "fluent", RecordType::A, None, false).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert!(
        t0.elapsed() < Duration::from_millis(200),
        "{:?}",
        t0.elapsed()
    );
    let upstream = upstream_log.lock().expect("log").clone();
    assert!(
        upstream.is_empty(),
        "cluster names leaked upstream: {upstream:?}"
    );

    // dns-05: the laptop's names go upstream unchanged, the cluster sees at most
    // the anchors of their last label.
    let m = ask(fwd, "host.corp.test", RecordType::A, None, false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(192, 0, 2, 10)]);
    let m = ask(fwd, "www.example.com", RecordType::A, Some(4096), true).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(192, 0, 2, 20)]);
    let m = ask(fwd, "nope.corp.test", RecordType::A, None, false).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    let upstream = upstream_log.lock().expect("log").clone();
    assert_eq!(
        upstream,
        vec!["host.corp.test.", "www.example.com.", "nope.corp.test."]
    );
    let cluster = cluster_log.lock().expect("log").clone();
    assert!(
        cluster.iter().all(|n| n.ends_with(".cluster.local.")
            && !n.contains("corp.test")
            && !n.contains("example.com")),
        "{cluster:?}"
    );
    // The anchor cache: a second corp.test name costs the cluster nothing.
    let before = cluster_log.lock().expect("log").len();
    let _ = ask(fwd, "other.corp.test", RecordType::A, None, false).await;
    assert_eq!(cluster_log.lock().expect("log").len(), before);
    let c = f.counters();
    assert!(
        c.expanded > 0 && c.upstream == 4 && c.local_nxdomain == 1,
        "{c:?}"
    );
    f.stop().await;
}

#[tokio::test]
async fn aaaa_of_cluster_names_is_empty_at_once_on_ipv4_clusters() {
    let (f, cluster_log, _) = setup().await;
    let before = cluster_log.lock().expect("log").len();
    let m = ask(
        f.local_addr(),
        "web.dev.svc.cluster.local.",
        RecordType::AAAA,
        None,
        false,
    )
    .await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert!(m.answers.is_empty());
    assert_eq!(
        cluster_log.lock().expect("log").len(),
        before,
        "not even asked"
    );
    f.stop().await;
}

#[tokio::test]
async fn big_answers_carry_tc_over_udp_and_everything_over_tcp() {
    let (f, _, _) = setup().await;
    let fwd = f.local_addr();
    for spelling in ["big.dev.svc.cluster.local.", "big"] {
        for edns in [None, Some(1232)] {
            let m = ask(fwd, spelling, RecordType::A, edns, false).await;
            assert!(m.metadata.truncation, "{spelling} {edns:?} over UDP");
            assert!(a_records(&m).len() < 300);
        }
        let m = ask(fwd, spelling, RecordType::A, None, true).await;
        assert!(!m.metadata.truncation);
        assert_eq!(a_records(&m).len(), 300, "{spelling} over TCP");
    }
    f.stop().await;
}

#[tokio::test]
async fn malformed_queries_get_formerr_and_the_forwarder_keeps_serving() {
    let (f, _, _) = setup().await;
    let fwd = f.local_addr();
    let raw = [0xbe, 0xef, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0];
    let answer = ask_raw(fwd, &raw, false).await.expect("FORMERR");
    let m = Message::from_vec(&answer).expect("decode");
    assert_eq!(m.metadata.id, 0xbeef);
    assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
    let tcp = ask_raw(fwd, &raw, true).await.expect("FORMERR over TCP");
    assert_eq!(
        Message::from_vec(&tcp)
            .expect("decode")
            .metadata
            .response_code,
        ResponseCode::FormErr
    );
    assert!(
        ask_raw(fwd, &[1, 2, 3], false).await.is_none(),
        "too short: dropped"
    );
    let m = ask(fwd, "web", RecordType::A, None, false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(10, 96, 0, 200)]);
    // The FORMERR query over UDP and TCP, and the runt three times (the client's
    // tries, each dropped).
    assert_eq!(f.counters().malformed, 5);
    f.stop().await;
}

#[tokio::test]
async fn no_upstream_answer_is_servfail_not_a_hang() {
    // An upstream that accepts TCP (the kernel's backlog) and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let f = Forwarder::start(
        "127.0.0.1:0".parse().expect("addr"),
        vec![silent.local_addr().expect("addr")],
    )
    .await
    .expect("forwarder");
    let t0 = Instant::now();
    let m = ask(f.local_addr(), "www.example.com", RecordType::A, None, true).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
    assert!(t0.elapsed() < Duration::from_secs(6));
    f.stop().await;
}

/// A missing Service of an existing namespace is NXDOMAIN. Its `….svc`
/// spelling (`nosuch.dev.svc`) is the cluster's alone and never reaches the
/// laptop's upstream; its `svc.ns` spellings (`nosuch.default`, `nosuch.dev`)
/// have the shape of public names (`go.dev`), so after the cluster's NXDOMAIN
/// they do (issue 29 item 2), and the upstream's NXDOMAIN is the answer. A name
/// whose last label is no namespace (`nope.corp.test`) goes upstream as before.
#[tokio::test]
async fn a_missing_service_is_nxdomain_and_only_its_svc_ns_spellings_ask_upstream() {
    let (f, cluster_log, upstream_log) = setup().await;
    for spelling in [
        "nosuch.default",
        "nosuch.dev",
        "nosuch.dev.svc",
        "Nosuch.Default.",
    ] {
        let m = ask(f.local_addr(), spelling, RecordType::A, None, false).await;
        assert_eq!(
            m.metadata.response_code,
            ResponseCode::NXDomain,
            "{spelling}"
        );
    }
    let m = ask(f.local_addr(), "nope.corp.test", RecordType::A, None, false).await;
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(
        upstream_log.lock().expect("log").clone(),
        vec![
            "nosuch.default.",
            "nosuch.dev.",
            "nosuch.default.",
            "nope.corp.test."
        ],
        "the svc.ns spellings after the cluster's NXDOMAIN, and the laptop's name; never nosuch.dev.svc"
    );
    let cluster = cluster_log.lock().expect("log").clone();
    for asked in [
        "nosuch.default.svc.cluster.local.",
        "nosuch.dev.svc.cluster.local.",
    ] {
        assert!(
            cluster.iter().any(|n| n == asked),
            "the cluster is asked first: {asked} not in {cluster:?}"
        );
    }
    f.stop().await;
}

/// A public `svc.ns`-shaped name (`go.dev`, namespace `dev`) the cluster has no
/// Service for, while the laptop's resolver is down (nothing listens): SERVFAIL,
/// never the cluster's cacheable NXDOMAIN (new-user trial F5).
#[tokio::test]
async fn a_dead_upstream_after_the_clusters_nxdomain_is_servfail() {
    let (cluster_addr, _cluster_log) = server(cluster_zone).await;
    let cluster = || {
        ClusterDns::new(
            &[cluster_addr.to_string()],
            "cluster.local",
            &["dev.svc.cluster.local".into(), "svc.cluster.local".into()],
            false,
        )
        .expect("config")
    };
    // Down: nothing listens (a port bound, then released).
    let dead = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("free port");
    let f = Forwarder::start("127.0.0.1:0".parse().expect("addr"), vec![dead])
        .await
        .expect("forwarder");
    f.set_clusters(vec![(cluster(), Reach::always())]);
    let m = ask(f.local_addr(), "go.dev", RecordType::A, None, false).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
    f.stop().await;
    // A refusing or silent upstream: the_cluster_nxdomain_stands_when_the_upstream_refuses_and_servfail_when_silent.
}

/// Issue 29 item 2: with a namespace `dev`, public names under `.dev` get the
/// laptop's upstream answer (they were NXDOMAIN without reaching it), over UDP
/// and TCP, after the cluster said it has no such Service; a Service that does
/// exist (`web.dev`) still answers from the cluster and never goes upstream.
#[tokio::test]
async fn public_names_under_a_namespace_named_like_their_tld_get_the_upstream_answer() {
    let (f, cluster_log, upstream_log) = setup().await;
    let fwd = f.local_addr();
    for (n, ip) in [
        ("go.dev", Ipv4Addr::new(192, 0, 2, 30)),
        ("pkg.go.dev", Ipv4Addr::new(192, 0, 2, 31)),
        ("mycorp.dev", Ipv4Addr::new(192, 0, 2, 32)),
        ("go.dev.", Ipv4Addr::new(192, 0, 2, 30)),
    ] {
        for tcp in [false, true] {
            let m = ask(fwd, n, RecordType::A, Some(1232), tcp).await;
            assert_eq!(
                m.metadata.response_code,
                ResponseCode::NoError,
                "{n} tcp={tcp}"
            );
            assert_eq!(a_records(&m), vec![ip], "{n} tcp={tcp}");
            assert!(
                m.answers.iter().all(|r| r.record_type() == RecordType::A
                    && r.name.to_lowercase().to_ascii().trim_end_matches('.')
                        == n.trim_end_matches('.')),
                "the upstream's answer unchanged, no CNAME into the cluster: {m:?}"
            );
        }
    }
    let m = ask(fwd, "web.dev", RecordType::A, None, false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(10, 96, 0, 200)]);
    let upstream = upstream_log.lock().expect("log").clone();
    assert!(
        !upstream.iter().any(|n| n == "web.dev."),
        "a Service of the cluster leaked upstream: {upstream:?}"
    );
    assert!(upstream.iter().any(|n| n == "pkg.go.dev."), "{upstream:?}");
    let cluster = cluster_log.lock().expect("log").clone();
    assert!(
        cluster.iter().any(|n| n == "go.dev.svc.cluster.local."),
        "the cluster is asked first (a Service go in dev would win): {cluster:?}"
    );
    f.stop().await;
}

/// When the laptop's upstream refuses a name (REFUSED from a resolver that
/// only serves its own zones), a name the cluster said NXDOMAIN for gets that
/// NXDOMAIN; when it gives no answer at all, SERVFAIL (a cacheable NXDOMAIN
/// would cost a public name its answer while the resolver is away); other
/// names get the upstream's answer unchanged, as before.
#[tokio::test]
async fn the_cluster_nxdomain_stands_when_the_upstream_refuses_and_servfail_when_silent() {
    fn refuse(_: &Query) -> (ResponseCode, Vec<Record>) {
        (ResponseCode::Refused, Vec::new())
    }
    let (cluster_addr, _) = server(cluster_zone).await;
    let (refusing, refusing_log) = server(refuse).await;
    // Bound, never read: questions to it time out.
    let silent = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let cluster = ClusterDns::new(
        &[cluster_addr.to_string()],
        "cluster.local",
        &[
            "dev.svc.cluster.local".into(),
            "svc.cluster.local".into(),
            "cluster.local".into(),
        ],
        false,
    )
    .expect("config");
    for upstream in [refusing, silent.local_addr().expect("addr")] {
        let f = Forwarder::start("127.0.0.1:0".parse().expect("addr"), vec![upstream])
            .await
            .expect("forwarder");
        f.set_clusters(vec![(cluster.clone(), Reach::always())]);
        let fwd = f.local_addr();
        let names = ["nosuch.default", "go.dev"];
        let answers = futures::future::join_all(
            names.map(|n| async move { ask(fwd, n, RecordType::A, None, true).await }),
        )
        .await;
        let want = if upstream == refusing {
            ResponseCode::NXDomain
        } else {
            ResponseCode::ServFail
        };
        for (n, m) in names.iter().zip(answers) {
            assert_eq!(m.metadata.response_code, want, "{n} via {upstream}");
        }
        if upstream == refusing {
            let m = ask(fwd, "www.example.com", RecordType::A, None, false).await;
            assert_eq!(m.metadata.response_code, ResponseCode::Refused);
            assert!(
                refusing_log
                    .lock()
                    .expect("log")
                    .iter()
                    .any(|n| n == "go.dev."),
                "go.dev was asked upstream"
            );
        }
        f.stop().await;
    }
}

/// Issue 29 item 4: `kvpn disconnect && kvpn connect` failed with "Address
/// already in use" while a question was in flight (its task held the UDP
/// socket for the seconds of an upstream timeout). After `stop`, the same
/// address binds at once, whatever was in flight; repeated.
#[tokio::test]
async fn stop_closes_the_listening_sockets_even_with_questions_in_flight() {
    // An upstream that never answers, over UDP or TCP: every question waits
    // out EXCHANGE_TIMEOUT, twice.
    let silent_udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let silent = silent_udp.local_addr().expect("addr");
    let _silent_tcp = TcpListener::bind(silent).await;
    let mut f = Forwarder::start("127.0.0.1:0".parse().expect("addr"), vec![silent])
        .await
        .expect("forwarder");
    let at = f.local_addr();
    for round in 0..5 {
        // Questions over UDP and TCP, left in flight.
        let udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let mut q = Message::query();
        q.add_query(Query::query(name("www.example.com."), RecordType::A));
        let raw = q.to_vec().expect("encode");
        for _ in 0..20 {
            udp.send_to(&raw, at).await.expect("send");
        }
        let mut tcp = TcpStream::connect(at).await.expect("connect");
        let n = u16::try_from(raw.len()).expect("small");
        tcp.write_all(&n.to_be_bytes()).await.expect("write");
        tcp.write_all(&raw).await.expect("write");
        // Received and waiting for the upstream.
        let t0 = Instant::now();
        while f.counters().udp_queries < 20 || f.counters().tcp_queries < 1 {
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", f.counters());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t0 = Instant::now();
        f.stop().await;
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(1), "stop took {took:?}");
        f = match Forwarder::start(at, vec![silent]).await {
            Ok(f) => f,
            Err(e) => panic!("round {round}: the same address right after stop: {e}"),
        };
        // The TCP client's connection was closed, not left hanging.
        let mut buf = [0u8; 2];
        let read = tokio::time::timeout(Duration::from_secs(1), tcp.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "round {round}: TCP client not closed by stop: {read:?}"
        );
    }
    f.stop().await;
}

/// An address that is taken: the error names the process that holds it (here
/// this test process, which is what a forwarder of the same daemon looks
/// like), not "another DNS server may use it".
#[tokio::test]
async fn a_taken_address_names_its_holder() {
    let holder = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let at = holder.local_addr().expect("addr");
    let e = Forwarder::start(at, Vec::new())
        .await
        .expect_err("the address is taken");
    let text = e.to_string();
    assert!(
        text.contains(&format!("cannot listen for DNS on {at} (udp)")),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "held by this kvpn root daemon itself (pid {})",
            std::process::id()
        )),
        "{text}"
    );
    assert!(!text.contains("another DNS server"), "{text}");
}

/// A cluster DNS on UDP that ignores the first copy of every datagram (a lossy
/// path) and records the source ports it heard from.
async fn lossy_cluster() -> (SocketAddr, Arc<Mutex<Vec<u16>>>) {
    let udp = UdpSocket::bind("127.0.0.1:0").await.expect("udp");
    let addr = udp.local_addr().expect("addr");
    let ports = Arc::new(Mutex::new(Vec::new()));
    let p = ports.clone();
    tokio::spawn(async move {
        let log = Mutex::new(Vec::new());
        let mut seen = std::collections::HashSet::new();
        let mut buf = vec![0u8; 65535];
        while let Ok((n, src)) = udp.recv_from(&mut buf).await {
            p.lock().expect("ports").push(src.port());
            if seen.insert(buf[..n].to_vec()) {
                continue;
            }
            if let Some(out) = answer(&buf[..n], cluster_zone, &log, true) {
                let _ = udp.send_to(&out, src).await;
            }
        }
    });
    (addr, ports)
}

#[tokio::test]
async fn cluster_questions_share_one_socket_keep_their_ids_and_survive_loss() {
    let (cluster_addr, ports) = lossy_cluster().await;
    let (upstream_addr, _upstream_log) = server(upstream_zone).await;
    let f = Forwarder::start("127.0.0.1:0".parse().expect("addr"), vec![upstream_addr])
        .await
        .expect("forwarder");
    let cluster = ClusterDns::new(
        &[cluster_addr.to_string()],
        "cluster.local",
        &[
            "dev.svc.cluster.local".into(),
            "svc.cluster.local".into(),
            "cluster.local".into(),
        ],
        false,
    )
    .expect("config");
    f.set_clusters(vec![(cluster, Reach::always())]);
    let fwd = f.local_addr();
    // 200 questions at once, all with the same message id (`ask` checks that the
    // answer carries it and the question as asked).
    let asks = (0..200).map(|i| async move {
        let q = if i % 2 == 0 {
            "web.dev.svc.cluster.local."
        } else {
            "web"
        };
        let m = ask(fwd, q, RecordType::A, None, false).await;
        (q, m.metadata.response_code, a_records(&m))
    });
    for (q, rcode, a) in futures::future::join_all(asks).await {
        assert_eq!(rcode, ResponseCode::NoError, "{q}");
        assert_eq!(a, vec![Ipv4Addr::new(10, 96, 0, 200)], "{q}");
    }
    let mut heard: Vec<u16> = ports.lock().expect("ports").clone();
    heard.sort_unstable();
    heard.dedup();
    assert_eq!(
        heard.len(),
        1,
        "one socket toward the cluster DNS: {heard:?}"
    );
    assert!(f.counters().servfail == 0, "{:?}", f.counters());
}

#[tokio::test]
async fn while_the_session_is_down_cluster_names_fail_at_once_and_upstream_names_resolve() {
    let connected = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = connected.clone();
    let (f, cluster_log, upstream_log) = setup_with(Reach::new(move || {
        flag.load(std::sync::atomic::Ordering::Relaxed)
    }))
    .await;
    let fwd = f.local_addr();
    let dev = Ipv4Addr::new(10, 96, 0, 200);
    // Connected: the cluster answers, and says that namespace dev exists.
    assert_eq!(
        a_records(&ask(fwd, "web.dev", RecordType::A, None, false).await),
        vec![dev]
    );

    connected.store(false, std::sync::atomic::Ordering::Relaxed);
    let asked_before = cluster_log.lock().expect("log").len();
    let upstream_before = upstream_log.lock().expect("log").len();
    let t0 = Instant::now();
    let mut answered = 0;
    for name in [
        "web.dev.svc.cluster.local",
        "nosuch.dev.svc.cluster.local",
        "web",
        "nosuchsvc",
        // Namespace dev existed when the cluster was last asked.
        "web.dev",
    ] {
        for edns in [None, Some(1232)] {
            for tcp in [false, true] {
                let m = ask(fwd, name, RecordType::A, edns, tcp).await;
                assert_eq!(
                    m.metadata.response_code,
                    ResponseCode::ServFail,
                    "{name} {edns:?} tcp={tcp}"
                );
                assert!(m.answers.is_empty());
                let ede = super::message::extended_errors(&m);
                if edns.is_some() {
                    assert_eq!(ede.len(), 1, "{name}: {m:?}");
                    assert_eq!(ede[0].0, super::message::EDE_NO_REACHABLE_AUTHORITY);
                    assert!(ede[0].1.contains("reconnecting"), "{ede:?}");
                } else {
                    assert!(m.edns.is_none() && ede.is_empty(), "no OPT without EDNS");
                }
                answered += 1;
            }
        }
    }
    // AAAA of an IPv4-only cluster never needed the cluster.
    let m = ask(
        fwd,
        "web.dev.svc.cluster.local",
        RecordType::AAAA,
        None,
        false,
    )
    .await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    let took = t0.elapsed();
    eprintln!("{answered} cluster questions answered SERVFAIL in {took:?} while down");
    assert_eq!(
        cluster_log.lock().expect("log").len(),
        asked_before,
        "nothing sent to the cluster DNS while its session is down"
    );
    // Without a cluster round trip the answers are local; far below the 300 ms
    // first resend of a cluster question.
    assert!(took < Duration::from_secs(2), "{took:?}");
    // The laptop's names are not affected.
    let m = ask(fwd, "host.corp.test", RecordType::A, None, false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(192, 0, 2, 10)]);
    let m = ask(fwd, "www.example.com", RecordType::A, Some(1232), false).await;
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(192, 0, 2, 20)]);
    assert_eq!(
        upstream_log.lock().expect("log")[upstream_before..],
        ["host.corp.test.".to_owned(), "www.example.com.".to_owned()],
        "only the laptop's names went upstream"
    );
    let c = f.counters();
    assert_eq!(c.unreachable, answered, "{c:?}");
    assert_eq!(c.servfail, answered, "{c:?}");

    // Connected again: cluster names resolve at once.
    connected.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        a_records(&ask(fwd, "web", RecordType::A, None, false).await),
        vec![dev]
    );
    assert_eq!(
        a_records(
            &ask(
                fwd,
                "web.dev.svc.cluster.local",
                RecordType::A,
                Some(1232),
                true
            )
            .await
        ),
        vec![dev]
    );
    assert_eq!(f.counters().unreachable, answered);
    f.stop().await;
}

/// Issue 29 item 1: a cluster DNS socket is replaced when the routes give its
/// server another source address, kept otherwise (also without a route).
#[test]
fn a_cluster_dns_socket_is_reopened_only_when_the_route_source_changed() {
    use super::forwarder::{reopen_needed, route_source};
    let lan: std::net::IpAddr = "192.168.1.20".parse().expect("ip");
    let tunnel: std::net::IpAddr = "100.96.0.2".parse().expect("ip");
    assert!(reopen_needed(lan, Some(tunnel)));
    assert!(!reopen_needed(tunnel, Some(tunnel)));
    assert!(
        !reopen_needed(tunnel, None),
        "no route now: keep the old socket"
    );
    // The lookup is the kernel's: loopback's source is loopback; nothing is sent.
    assert_eq!(
        route_source("127.0.0.1:53".parse().expect("addr")),
        Some("127.0.0.1".parse().expect("ip"))
    );
}

/// A `kvpn run` session's forwarder (#27 F22) answers only questions in packets
/// that carry the run's fwmark (its processes' sockets do, set by the run's
/// eBPF program), over UDP and TCP; anyone else gets no answer. Needs root
/// (SO_MARK), as the root daemon that runs it.
#[tokio::test]
async fn a_run_forwarder_answers_only_packets_with_the_runs_mark() {
    use std::os::fd::AsFd as _;
    const MARK: u32 = 0x6b76_00fe;
    assert!(
        nix::unistd::Uid::effective().is_root(),
        "this test needs root: SO_MARK (run it as the root daemon runs)"
    );
    let mark = |fd: std::os::fd::BorrowedFd<'_>| {
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::Mark, &MARK).expect("SO_MARK");
    };
    let (cluster_addr, cluster_log) = server(cluster_zone).await;
    let (upstream_addr, _) = server(upstream_zone).await;
    let f = Forwarder::start_marked(
        "127.0.0.1:0".parse().expect("addr"),
        vec![upstream_addr],
        Some(MARK),
    )
    .await
    .expect("forwarder");
    let cluster = ClusterDns::new(
        &[cluster_addr.to_string()],
        "cluster.local",
        &["default.svc.cluster.local".into()],
        false,
    )
    .expect("config");
    f.set_clusters(vec![(cluster, Reach::always())]);
    let fwd = f.local_addr();
    let mut q = Message::query();
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(
        name("web.default.svc.cluster.local."),
        RecordType::A,
    ));
    let raw = q.to_vec().expect("encode");

    // Outside the run: UDP is dropped unanswered, TCP never connects.
    assert_eq!(
        ask_raw(fwd, &raw, false).await,
        None,
        "unmarked UDP answered"
    );
    let tcp = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(fwd)).await;
    assert!(
        !matches!(tcp, Ok(Ok(_))),
        "an unmarked TCP connection to the run's forwarder was accepted"
    );
    assert!(
        cluster_log.lock().expect("log").is_empty(),
        "an outsider's question reached the cluster DNS"
    );
    assert_eq!(
        f.counters().udp_queries,
        0,
        "an outsider's question was counted"
    );

    // Inside the run (the mark): answered over UDP and TCP.
    let udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    mark(udp.as_fd());
    udp.send_to(&raw, fwd).await.expect("send");
    let mut buf = vec![0u8; 4096];
    let (n, _) = tokio::time::timeout(Duration::from_secs(3), udp.recv_from(&mut buf))
        .await
        .expect("no answer to a marked UDP question")
        .expect("recv");
    let m = Message::from_vec(&buf[..n]).expect("decode");
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(10, 96, 0, 100)]);
    let sock = tokio::net::TcpSocket::new_v4().expect("tcp socket");
    mark(sock.as_fd());
    let mut s = tokio::time::timeout(Duration::from_secs(3), sock.connect(fwd))
        .await
        .expect("marked TCP connect timed out")
        .expect("marked TCP connect");
    let len = u16::try_from(raw.len()).expect("small");
    s.write_all(&len.to_be_bytes()).await.expect("write");
    s.write_all(&raw).await.expect("write");
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await.expect("answer length");
    let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut answer).await.expect("answer");
    let m = Message::from_vec(&answer).expect("decode");
    assert_eq!(a_records(&m), vec![Ipv4Addr::new(10, 96, 0, 100)]);
    f.stop().await;
}
