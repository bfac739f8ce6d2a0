//! Leases and laptop-to-laptop, in process: the `Lease` gRPC service on a
//! loopback port (20 concurrent clients), hello token enforcement on real
//! sessions, and two scripted laptops (smoltcp stacks over frame pipes) pinging
//! and talking TCP to each other's tunnel IPs through the manager.

mod common;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use common::{Laptop, session_config, spawn_session};
use kvpn_manager::lease::{AttachError, LeaseTable};
use kvpn_manager::leases::Leases;
use kvpn_manager::packet::DropReason;
use kvpn_manager::session::{SessionConfig, SessionError};
use kvpn_proto::frame::{self, Hello, Kind, PROTOCOL_VERSION};
use kvpn_proto::manager::LeaseRequest;
use kvpn_proto::manager::manager_client::ManagerClient;
use smoltcp::phy::ChecksumCapabilities;
use smoltcp::wire::{Icmpv4Packet, Icmpv4Repr, IpProtocol, Ipv4Packet, Ipv4Repr};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn leases() -> Arc<Leases> {
    Leases::in_memory(LeaseTable::new(
        "100.96.0.0/16".parse().expect("pool"),
        Duration::from_secs(3600),
    ))
}

async fn grpc_server(leases: Arc<Leases>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(kvpn_manager::grpc::serve(
        listener,
        None,
        leases,
        kvpn_manager::route_watch::RouteWatch::unavailable("not in a cluster (test)".into()),
        kvpn_manager::grpc::TraceConfig {
            trace: Arc::default(),
            policy: "snat".into(),
            egress: "lo".into(),
        },
        Arc::default(),
    ));
    format!("http://{addr}")
}

#[tokio::test]
async fn twenty_concurrent_leases_are_distinct_and_stable() {
    let url = grpc_server(leases()).await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = client(url).await;
            let r = c
                .lease(LeaseRequest {
                    client_id: format!("laptop-{i}"),
                })
                .await
                .expect("lease")
                .into_inner();
            (i, r)
        }));
    }
    let mut by_client = HashMap::new();
    for t in tasks {
        let (i, r) = t.await.expect("task");
        assert_eq!(r.manager_ip, "100.96.0.1");
        assert_eq!(r.pool_cidr, "100.96.0.0/16");
        assert_eq!(r.expires_in_s, 3600);
        assert_eq!(r.session_token.len(), 64, "32 random bytes, hex");
        by_client.insert(i, r);
    }
    let ips: HashSet<_> = by_client.values().map(|r| r.tunnel_ip.clone()).collect();
    assert_eq!(ips.len(), 20, "20 distinct tunnel IPs: {ips:?}");
    assert!(!ips.contains("100.96.0.0") && !ips.contains("100.96.0.1"));
    let tokens: HashSet<_> = by_client
        .values()
        .map(|r| r.session_token.clone())
        .collect();
    assert_eq!(tokens.len(), 20);

    // Reconnecting clients (new gRPC connection) get their old IP and token.
    let mut c = client(url).await;
    for i in [0, 7, 19] {
        let again = c
            .lease(LeaseRequest {
                client_id: format!("laptop-{i}"),
            })
            .await
            .expect("lease")
            .into_inner();
        assert_eq!(again.tunnel_ip, by_client[&i].tunnel_ip);
        assert_eq!(again.session_token, by_client[&i].session_token);
    }
    let bad = c
        .lease(LeaseRequest {
            client_id: "no spaces allowed".into(),
        })
        .await
        .expect_err("bad id");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
}

async fn client(url: String) -> ManagerClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(url)
        .expect("url")
        .connect()
        .await
        .expect("connect");
    ManagerClient::new(channel)
}

fn hello(ip: IpAddr, token: &[u8]) -> Vec<u8> {
    let h = Hello {
        version: PROTOCOL_VERSION,
        tunnel_ip: ip,
        token: token.to_vec(),
        mtu: None,
        tunnel_ip_v6: None,
        offloads: None,
        shard: None,
        resume_token: None,
    }
    .encode()
    .expect("encodes");
    let mut out = Vec::new();
    frame::encode_into(Kind::Hello, &h, &mut out).expect("fits");
    out
}

fn leased_config(leases: &Arc<Leases>) -> SessionConfig {
    SessionConfig {
        leases: Some(leases.clone()),
        tunnel_pool: Some("100.96.0.0/16".parse().expect("pool")),
        ..session_config()
    }
}

#[tokio::test]
async fn hello_needs_the_leases_token() {
    let leases = leases();
    let (a, _) = leases.lease("client-a").await.expect("lease a");
    let (b, _) = leases.lease("client-b").await.expect("lease b");
    let a_ip = IpAddr::V4(a.ip);

    // Unknown token, another client's token, an IP nobody leased: refused.
    let cases = [
        (
            a_ip,
            b"not-the-token".to_vec(),
            AttachError::WrongToken(a_ip),
        ),
        (
            a_ip,
            b.token.as_bytes().to_vec(),
            AttachError::WrongToken(a_ip),
        ),
        (a_ip, Vec::new(), AttachError::WrongToken(a_ip)),
        (
            IpAddr::V4(Ipv4Addr::new(100, 96, 9, 9)),
            a.token.as_bytes().to_vec(),
            AttachError::NoLease(IpAddr::V4(Ipv4Addr::new(100, 96, 9, 9))),
        ),
    ];
    for (ip, token, want) in cases {
        let (mut pipe, session) = spawn_session(leased_config(&leases));
        pipe.write_all(&hello(ip, &token)).await.expect("write");
        let r = tokio::time::timeout(Duration::from_secs(5), session)
            .await
            .expect("rejected at once")
            .expect("no panic");
        match r {
            Err(SessionError::Lease(e)) => assert_eq!(e, want),
            other => panic!("expected {want:?}, got {other:?}"),
        }
        let mut rest = Vec::new();
        let _ = pipe.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "nothing sent to a refused laptop");
    }

    // The right token: the session runs (heartbeat echoed); a packet whose
    // source is not the leased IP is dropped and counted.
    let (mut pipe, session) = spawn_session(leased_config(&leases));
    pipe.write_all(&hello(a_ip, a.token.as_bytes()))
        .await
        .expect("write");
    let mut out = Vec::new();
    frame::encode_into(Kind::Heartbeat, b"12345678", &mut out).expect("fits");
    let spoofed = echo_request(Ipv4Addr::new(100, 96, 0, 3), Ipv4Addr::new(127, 0, 0, 1), 1);
    frame::encode_into(Kind::Packet, &spoofed, &mut out).expect("fits");
    pipe.write_all(&out).await.expect("write");
    // The first frame that is not a stats frame (the manager's first stats
    // frame may come before the echo).
    let mut buf = Vec::new();
    let echo = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let mut chunk = [0u8; 256];
            let n = pipe.read(&mut chunk).await.expect("read");
            assert!(n > 0, "the manager closed the session");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(first) = common::take_first_non_stats(&mut buf) {
                return first;
            }
        }
    })
    .await
    .expect("heartbeat echo in time");
    assert_eq!(echo, (Kind::Heartbeat, b"12345678".to_vec()));
    pipe.shutdown().await.expect("hang up");
    let metrics = tokio::time::timeout(Duration::from_secs(5), session)
        .await
        .expect("ends")
        .expect("no panic")
        .expect("clean end");
    assert_eq!(metrics.dropped(DropReason::BadSource), 1);
    assert_eq!(metrics.heartbeats, 1);
}

/// An ICMP echo request `src` -> `dst` (identifier 0x4b56, 8 data bytes).
fn echo_request(src: Ipv4Addr, dst: Ipv4Addr, seq: u16) -> Vec<u8> {
    let data = *b"kvpn-l2l";
    let icmp = Icmpv4Repr::EchoRequest {
        ident: 0x4b56,
        seq_no: seq,
        data: &data,
    };
    let ip = Ipv4Repr {
        src_addr: src,
        dst_addr: dst,
        next_header: IpProtocol::Icmp,
        payload_len: icmp.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip.buffer_len() + icmp.buffer_len()];
    let caps = ChecksumCapabilities::default();
    let mut p = Ipv4Packet::new_unchecked(&mut buf);
    ip.emit(&mut p, &caps);
    icmp.emit(&mut Icmpv4Packet::new_unchecked(p.payload_mut()), &caps);
    buf
}

/// The echo reply to `packet` if it is an echo request.
fn echo_reply_to(packet: &[u8]) -> Option<Vec<u8>> {
    let ip = Ipv4Packet::new_checked(packet).ok()?;
    let icmp = Icmpv4Packet::new_checked(ip.payload()).ok()?;
    let Icmpv4Repr::EchoRequest {
        ident,
        seq_no,
        data,
    } = Icmpv4Repr::parse(&icmp, &ChecksumCapabilities::default()).ok()?
    else {
        return None;
    };
    let reply = Icmpv4Repr::EchoReply {
        ident,
        seq_no,
        data,
    };
    let ip_repr = Ipv4Repr {
        src_addr: ip.dst_addr(),
        dst_addr: ip.src_addr(),
        next_header: IpProtocol::Icmp,
        payload_len: reply.buffer_len(),
        hop_limit: 64,
    };
    let mut buf = vec![0u8; ip_repr.buffer_len() + reply.buffer_len()];
    let caps = ChecksumCapabilities::default();
    let mut p = Ipv4Packet::new_unchecked(&mut buf);
    ip_repr.emit(&mut p, &caps);
    reply.emit(&mut Icmpv4Packet::new_unchecked(p.payload_mut()), &caps);
    Some(buf)
}

fn is_echo_reply(packet: &[u8], from: Ipv4Addr, seq: u16) -> bool {
    let Ok(ip) = Ipv4Packet::new_checked(packet) else {
        return false;
    };
    if ip.src_addr() != from || ip.next_header() != IpProtocol::Icmp {
        return false;
    }
    let Ok(icmp) = Icmpv4Packet::new_checked(ip.payload()) else {
        return false;
    };
    matches!(
        Icmpv4Repr::parse(&icmp, &ChecksumCapabilities::default()),
        Ok(Icmpv4Repr::EchoReply { ident: 0x4b56, seq_no, data }) if seq_no == seq && data == b"kvpn-l2l"
    )
}

/// Step both laptops (so each one's manager session keeps draining) until
/// `done`; false on timeout.
async fn run_both(
    a: &mut Laptop,
    b: &mut Laptop,
    timeout: Duration,
    mut done: impl FnMut(&mut Laptop, &mut Laptop) -> bool,
) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        if done(a, b) {
            return true;
        }
        a.step(Duration::from_millis(1)).await;
        b.step(Duration::from_millis(1)).await;
    }
    done(a, b)
}

#[tokio::test]
async fn two_laptops_ping_and_talk_tcp_through_the_manager() {
    // One manager: both sessions share the config (and so its live-session table).
    let config = SessionConfig {
        tunnel_pool: Some("100.96.0.0/16".parse().expect("pool")),
        ..session_config()
    };
    let ip_a = Ipv4Addr::new(100, 96, 0, 2);
    let ip_b = Ipv4Addr::new(100, 96, 0, 3);
    let (pipe_a, session_a) = spawn_session(config.clone());
    let mut a = Laptop::with_pipe(IpAddr::V4(ip_a), pipe_a, Some(session_a)).await;
    let (pipe_b, session_b) = spawn_session(config.clone());
    let mut b = Laptop::with_pipe(IpAddr::V4(ip_b), pipe_b, Some(session_b)).await;
    a.keep_packets = true;
    b.keep_packets = true;
    // Both hellos handled: both registered.
    assert!(
        run_both(&mut a, &mut b, Duration::from_secs(5), |_, _| config
            .peers
            .len()
            == 2)
        .await,
        "both sessions live"
    );

    // Ping both ways. smoltcp is built without automatic echo replies (the
    // manager must never answer for the cluster), so each scripted laptop
    // answers the echo requests for its tunnel IP itself, like a kernel would.
    a.send_packet(&echo_request(ip_a, ip_b, 1)).await;
    b.send_packet(&echo_request(ip_b, ip_a, 2)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let (mut answered_a, mut answered_b) = (0, 0);
    let pinged = loop {
        if a.packets.iter().any(|p| is_echo_reply(p, ip_b, 1))
            && b.packets.iter().any(|p| is_echo_reply(p, ip_a, 2))
        {
            break true;
        }
        if std::time::Instant::now() > deadline {
            break false;
        }
        a.step(Duration::from_millis(1)).await;
        b.step(Duration::from_millis(1)).await;
        for (laptop, answered) in [(&mut a, &mut answered_a), (&mut b, &mut answered_b)] {
            let new: Vec<Vec<u8>> = laptop.packets[*answered..].to_vec();
            *answered = laptop.packets.len();
            for p in new {
                if let Some(reply) = echo_reply_to(&p) {
                    laptop.send_packet(&reply).await;
                }
            }
        }
    };
    assert!(
        pinged,
        "A pinged B and B pinged A; A got {:?}, B got {:?}",
        a.packets.iter().map(|p| p.len()).collect::<Vec<_>>(),
        b.packets.iter().map(|p| p.len()).collect::<Vec<_>>()
    );

    // TCP: B listens on its tunnel IP, A connects and both send 200 KB.
    let lb = b.tcp_socket(256 * 1024, 256 * 1024);
    b.tcp(lb).listen(7000).expect("listen");
    let ca = a.tcp_socket(256 * 1024, 256 * 1024);
    a.connect_tcp(ca, (IpAddr::V4(ip_b), 7000).into(), 40000);
    let to_b = common::pattern(200_000, 3);
    let to_a = common::pattern(200_000, 9);
    let (mut sent_a, mut sent_b) = (0, 0);
    let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
    let done = run_both(&mut a, &mut b, Duration::from_secs(20), |a, b| {
        let sa = a.tcp(ca);
        if sa.can_send() && sent_a < to_b.len() {
            sent_a += sa.send_slice(&to_b[sent_a..]).expect("send");
        }
        while sa.can_recv() {
            sa.recv(|d| {
                got_a.extend_from_slice(d);
                (d.len(), ())
            })
            .expect("recv");
        }
        let sb = b.tcp(lb);
        if sb.can_send() && sent_b < to_a.len() {
            sent_b += sb.send_slice(&to_a[sent_b..]).expect("send");
        }
        while sb.can_recv() {
            sb.recv(|d| {
                got_b.extend_from_slice(d);
                (d.len(), ())
            })
            .expect("recv");
        }
        got_a.len() == to_a.len() && got_b.len() == to_b.len()
    })
    .await;
    assert!(
        done,
        "TCP A<->B: A got {} B got {}",
        got_a.len(),
        got_b.len()
    );
    assert_eq!(got_b, to_b);
    assert_eq!(got_a, to_a);

    // A tunnel IP in the pool that nobody holds: dropped, not dialed.
    a.send_packet(&echo_request(ip_a, Ipv4Addr::new(100, 96, 7, 7), 3))
        .await;
    run_both(&mut a, &mut b, Duration::from_millis(200), |_, _| false).await;

    let ma = a.finish().await;
    let mb = b.finish().await;
    // 200 KB each way in MTU-9000 segments, plus the pings.
    assert!(ma.peer_bytes > 200_000, "A's packets forwarded: {ma}");
    assert!(mb.peer_bytes > 200_000, "B's packets forwarded: {mb}");
    assert_eq!(ma.dropped(DropReason::NoSuchPeer), 1, "{ma}");
    assert_eq!(
        ma.tcp_dials + mb.tcp_dials,
        0,
        "nothing was terminated in smoltcp: {ma} / {mb}"
    );
    assert_eq!(
        ma.pings_sent + mb.pings_sent,
        0,
        "pings went laptop to laptop"
    );
    assert!(config.peers.is_empty(), "sessions unregistered");
}
