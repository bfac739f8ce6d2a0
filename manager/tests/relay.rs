//! In-process relay tests, no root needed: a laptop smoltcp stack talks
//! through a real manager session (frames over an in-memory pipe) to real
//! servers on 127.0.0.1 that the manager dials with kernel sockets.

mod common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use common::{LAPTOP_V4, LAPTOP_V6, Laptop, hello_frame, pattern, session_config, spawn_session};
use kvpn_manager::session::SessionError;
use kvpn_proto::frame::{self, Kind, PROTOCOL_VERSION};
use smoltcp::socket::tcp;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

async fn echo_server(ip: IpAddr) -> SocketAddr {
    let listener = TcpListener::bind((ip, 0)).await.expect("bind echo server");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Send `data` on `h` and read as much back; returns what came back.
async fn echo_through(
    laptop: &mut Laptop,
    h: smoltcp::iface::SocketHandle,
    data: &[u8],
) -> Vec<u8> {
    let mut sent = 0;
    let mut got = Vec::new();
    let ok = laptop
        .run_until(Duration::from_secs(20), |l| {
            let s = l.tcp(h);
            if sent < data.len() && s.can_send() {
                sent += s.send_slice(&data[sent..]).expect("send");
            }
            common::drain(s, &mut got);
            got.len() >= data.len()
        })
        .await;
    assert!(
        ok,
        "echo incomplete: sent {sent}, got {} of {}",
        got.len(),
        data.len()
    );
    got
}

async fn established(laptop: &mut Laptop, h: smoltcp::iface::SocketHandle) {
    let ok = laptop
        .run_until(Duration::from_secs(5), |l| {
            l.tcp(h).state() == tcp::State::Established
        })
        .await;
    assert!(ok, "not established: {}", laptop.tcp(h).state());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_echo() {
    let server = echo_server(LOOPBACK).await;
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let h = laptop.tcp_socket(256 * 1024, 256 * 1024);
    laptop.connect_tcp(h, server, 41000);
    established(&mut laptop, h).await;
    let data = pattern(1 << 20, 1);
    let got = echo_through(&mut laptop, h, &data).await;
    assert!(got == data, "echoed bytes differ");
    let metrics = laptop.finish().await;
    assert_eq!(metrics.tcp_connected, 1);
    assert_eq!(metrics.tcp_bytes_out, 1 << 20);
    assert_eq!(metrics.tcp_bytes_in, 1 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_echo_ipv6() {
    let server = echo_server(IpAddr::V6(Ipv6Addr::LOCALHOST)).await;
    let mut laptop = Laptop::connect(LAPTOP_V6).await;
    let h = laptop.tcp_socket(64 * 1024, 64 * 1024);
    laptop.connect_tcp(h, server, 41001);
    established(&mut laptop, h).await;
    let data = pattern(100_000, 2);
    assert!(echo_through(&mut laptop, h, &data).await == data);
}

/// tr-05: the server writes 5 MB then closes; the laptop gets every byte, then EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_writes_then_closes_all_bytes_then_eof() {
    const LEN: usize = 5 * 1024 * 1024;
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
    let server = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        s.write_all(&pattern(LEN, 3)).await.expect("server write");
        // Dropping closes: FIN right behind the data.
    });
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let h = laptop.tcp_socket(1024 * 1024, 64 * 1024);
    laptop.connect_tcp(h, server, 41002);
    established(&mut laptop, h).await;
    let start = Instant::now();
    let mut got = Vec::with_capacity(LEN);
    let mut eof_at = None;
    let ok = laptop
        .run_until(Duration::from_secs(30), |l| {
            let s = l.tcp(h);
            common::drain(s, &mut got);
            // EOF: the manager's FIN arrived and everything before it was read.
            if !s.may_recv() && eof_at.is_none() {
                eof_at = Some(Instant::now());
            }
            eof_at.is_some()
        })
        .await;
    let elapsed = start.elapsed();
    assert!(ok, "no EOF; got {} of {LEN} bytes", got.len());
    assert_eq!(laptop.tcp(h).state(), tcp::State::CloseWait, "FIN, not RST");
    assert_eq!(got.len(), LEN);
    assert!(got == pattern(LEN, 3), "bytes differ");
    eprintln!(
        "5 MB download through the in-process manager: {:.1} ms, {:.0} Mbit/s",
        elapsed.as_secs_f64() * 1e3,
        LEN as f64 * 8.0 / elapsed.as_secs_f64() / 1e6
    );
    laptop.tcp(h).close();
    let metrics = laptop.finish().await;
    assert_eq!(metrics.tcp_bytes_in, LEN as u64);
}

/// Offload bit 2 (manager → laptop GSO frames): a laptop that offers it gets
/// the manager's hello accepting it and the download in GSO frames (each
/// checked and segmented as the laptop's kernel would, every byte intact);
/// a laptop that offers only bit 1 gets one packet frame per packet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn download_in_gso_frames_only_when_offered() {
    const LEN: usize = 4 * 1024 * 1024;
    for offered in [
        frame::OFFLOAD_TCP_GSO | frame::OFFLOAD_TCP_GRO,
        frame::OFFLOAD_TCP_GSO,
    ] {
        let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
        let server = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            s.write_all(&pattern(LEN, 5)).await.expect("server write");
        });
        let hello = common::hello_frame_offloads(LAPTOP_V4, offered);
        let mut laptop = Laptop::connect_with(LAPTOP_V4, session_config(), &hello).await;
        let h = laptop.tcp_socket(1024 * 1024, 64 * 1024);
        laptop.connect_tcp(h, server, 41003);
        established(&mut laptop, h).await;
        let mut got = Vec::with_capacity(LEN);
        let ok = laptop
            .run_until(Duration::from_secs(30), |l| {
                let s = l.tcp(h);
                common::drain(s, &mut got);
                !s.may_recv()
            })
            .await;
        assert!(ok, "offered {offered}: got {} of {LEN} bytes", got.len());
        assert!(got == pattern(LEN, 5), "offered {offered}: bytes differ");
        let answer = laptop
            .other_frames
            .iter()
            .find(|(k, _)| *k == Kind::Hello)
            .map(|(_, p)| frame::ManagerHello::decode(p).expect("manager hello"))
            .expect("the manager answers an offer");
        assert_eq!(answer.offloads, offered, "accepted what was offered");
        let (frames, segments) = (laptop.gso_frames, laptop.gso_segments);
        laptop.tcp(h).close();
        let metrics = laptop.finish().await;
        if offered & frame::OFFLOAD_TCP_GRO != 0 {
            assert!(frames > 0, "no GSO frames in a {LEN}-byte download");
            assert_eq!(
                (metrics.gro_frames, metrics.gro_segments),
                (frames, segments)
            );
        } else {
            assert_eq!(
                (frames, metrics.gro_frames),
                (0, 0),
                "not offered, not sent"
            );
        }
    }
}

/// tr-05: the laptop half-closes; the server reads to EOF, then replies; the
/// laptop reads the whole reply slowly (zero windows) and then EOF.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_then_reply_with_slow_reader() {
    const REQUEST: usize = 300_000;
    const REPLY: usize = 2 * 1024 * 1024;
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
    let server = listener.local_addr().expect("addr");
    let server_task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.expect("accept");
        let mut request = Vec::new();
        // Returns only once the laptop's FIN became shutdown(SHUT_WR).
        s.read_to_end(&mut request).await.expect("server read");
        s.write_all(&pattern(REPLY, 5)).await.expect("server write");
        request
    });
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    // A small receive buffer read only every few steps forces zero windows.
    let h = laptop.tcp_socket(16 * 1024, 64 * 1024);
    laptop.connect_tcp(h, server, 41003);
    established(&mut laptop, h).await;
    let request = pattern(REQUEST, 4);
    let mut sent = 0;
    let mut closed = false;
    let mut got = Vec::new();
    let mut steps = 0u64;
    let ok = laptop
        .run_until(Duration::from_secs(60), |l| {
            steps += 1;
            let s = l.tcp(h);
            if sent < REQUEST && s.can_send() {
                sent += s.send_slice(&request[sent..]).expect("send");
            }
            if sent == REQUEST && !closed {
                s.close();
                closed = true;
            }
            if steps.is_multiple_of(4) {
                common::drain(s, &mut got);
            }
            closed && !s.may_recv() && !s.can_recv()
        })
        .await;
    assert!(
        ok,
        "reply incomplete: {} of {REPLY} bytes, state {}",
        got.len(),
        laptop.tcp(h).state()
    );
    assert_eq!(got.len(), REPLY);
    assert!(got == pattern(REPLY, 5), "reply bytes differ");
    let seen = server_task.await.expect("server task");
    assert!(
        seen == request,
        "server saw {} of {REQUEST} request bytes",
        seen.len()
    );
    let metrics = laptop.finish().await;
    assert_eq!(metrics.tcp_reset_by_laptop + metrics.tcp_reset_by_remote, 0);
}

/// tr-04: a closed port refuses: the laptop sees RST, never ESTABLISHED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_is_refused_with_rst() {
    let closed = {
        let l = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
        l.local_addr().expect("addr")
    };
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let h = laptop.tcp_socket(4096, 4096);
    laptop.connect_tcp(h, closed, 41004);
    let start = Instant::now();
    let mut ever_established = false;
    let ok = laptop
        .run_until(Duration::from_secs(5), |l| {
            let st = l.tcp(h).state();
            ever_established |= st == tcp::State::Established;
            st == tcp::State::Closed
        })
        .await;
    assert!(
        ok,
        "connect neither refused nor failed: {}",
        laptop.tcp(h).state()
    );
    assert!(!ever_established, "connected before being refused");
    // smoltcp's first SYN retransmission is after 1 s; the RST must answer the first SYN.
    assert!(
        start.elapsed() < Duration::from_millis(900),
        "refusal took {:?}",
        start.elapsed()
    );
    let metrics = laptop.finish().await;
    assert_eq!(metrics.tcp_refused, 1);
    assert_eq!(metrics.tcp_connected, 0);
}

/// tr-06: the server resets connection A; B and a new connection C keep
/// working. A laptop abort reaches the server as a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets_propagate_and_stay_per_connection() {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
    let server = listener.local_addr().expect("addr");
    let (reset_tx, mut reset_rx) = tokio::sync::mpsc::unbounded_channel::<std::io::Result<usize>>();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((mut s, _)) = listener.accept().await {
            n += 1;
            let reset_tx = reset_tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let r = s.read(&mut buf).await;
                    match r {
                        Ok(0) => return,
                        Ok(k) if &buf[..k] == b"reset-me" => {
                            s.set_zero_linger().expect("linger");
                            return; // drop: RST
                        }
                        Ok(k) => {
                            if s.write_all(&buf[..k]).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = reset_tx.send(Err(e));
                            return;
                        }
                    }
                }
            });
            let _ = n;
        }
    });
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let a = laptop.tcp_socket(65536, 65536);
    let b = laptop.tcp_socket(65536, 65536);
    laptop.connect_tcp(a, server, 41005);
    laptop.connect_tcp(b, server, 41006);
    established(&mut laptop, a).await;
    established(&mut laptop, b).await;
    assert!(echo_through(&mut laptop, b, b"hello-b").await == b"hello-b");

    laptop.tcp(a).send_slice(b"reset-me").expect("send");
    let ok = laptop
        .run_until(Duration::from_secs(5), |l| {
            l.tcp(a).state() == tcp::State::Closed
        })
        .await;
    assert!(ok, "A not reset: {}", laptop.tcp(a).state());
    assert_eq!(
        laptop.tcp(a).recv(|b| (b.len(), ())),
        Err(tcp::RecvError::InvalidState),
        "RST, not FIN"
    );

    assert!(echo_through(&mut laptop, b, b"b-still-works").await == b"b-still-works");
    let c = laptop.tcp_socket(65536, 65536);
    laptop.connect_tcp(c, server, 41007);
    established(&mut laptop, c).await;
    assert!(echo_through(&mut laptop, c, b"new-c").await == b"new-c");

    // Laptop aborts C: the server's read fails with a reset.
    laptop.tcp(c).abort();
    laptop
        .run_until(Duration::from_millis(200), |_| false)
        .await;
    let r = tokio::time::timeout(Duration::from_secs(5), reset_rx.recv())
        .await
        .expect("server saw the reset")
        .expect("channel");
    let err = r.expect_err("an error");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    let metrics = laptop.finish().await;
    assert_eq!(metrics.tcp_reset_by_remote, 1);
    assert_eq!(metrics.tcp_reset_by_laptop, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_echo() {
    let server = UdpSocket::bind((LOOPBACK, 0)).await.expect("bind");
    let server_addr = server.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65536];
        while let Ok((n, from)) = server.recv_from(&mut buf).await {
            let _ = server.send_to(&buf[..n], from).await;
        }
    });
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let h = laptop.udp_socket(5353);
    let big = pattern(4000, 9); // tr-02: a 4000-byte datagram comes back whole
    for msg in [&b"one"[..], &big[..], &b"three"[..]] {
        laptop
            .udp(h)
            .send_slice(msg, server_addr)
            .expect("udp send");
        let mut reply = None;
        let ok = laptop
            .run_until(Duration::from_secs(5), |l| {
                if let Ok((data, meta)) = l.udp(h).recv() {
                    reply = Some((data.to_vec(), meta.endpoint));
                }
                reply.is_some()
            })
            .await;
        assert!(ok, "no UDP echo for a {}-byte datagram", msg.len());
        let (data, from) = reply.expect("reply");
        assert_eq!(data, msg);
        assert_eq!(
            SocketAddr::new(from.addr.into(), from.port),
            server_addr,
            "reply from the original destination"
        );
    }
    let metrics = laptop.finish().await;
    assert_eq!(
        (
            metrics.udp_flows,
            metrics.udp_datagrams_out,
            metrics.udp_datagrams_in
        ),
        (1, 3, 3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_to_closed_port_gets_port_unreachable() {
    let closed = {
        let s = std::net::UdpSocket::bind((LOOPBACK, 0)).expect("bind");
        s.local_addr().expect("addr")
    };
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    laptop.keep_packets = true;
    let h = laptop.udp_socket(5354);
    laptop
        .udp(h)
        .send_slice(b"anyone?", closed)
        .expect("udp send");
    let ok = laptop
        .run_until(Duration::from_secs(3), |l| {
            l.packets.iter().any(|p| {
                // IPv4 + ICMP type 3 code 3
                p.len() >= 28 && p[9] == 1 && p[20] == 3 && p[21] == 3
            })
        })
        .await;
    assert!(ok, "no ICMP port unreachable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_are_echoed() {
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    let mut hb = Vec::new();
    frame::encode_into(Kind::Heartbeat, &[1, 2, 3, 4, 5, 6, 7, 8], &mut hb).expect("fits");
    laptop.send_raw(&hb).await;
    let ok = laptop
        .run_until(Duration::from_secs(3), |l| !l.other_frames.is_empty())
        .await;
    assert!(ok, "no heartbeat echo");
    assert_eq!(
        laptop.other_frames[0],
        (Kind::Heartbeat, vec![1, 2, 3, 4, 5, 6, 7, 8])
    );
    assert_eq!(laptop.finish().await.heartbeats, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_version_and_missing_hello_are_rejected() {
    let (mut pipe, session) = spawn_session(session_config());
    pipe.write_all(&hello_frame(LAPTOP_V4, PROTOCOL_VERSION + 1))
        .await
        .expect("write");
    let r = session.await.expect("no panic");
    assert!(
        matches!(r, Err(SessionError::Version { got, .. }) if got == PROTOCOL_VERSION + 1),
        "{r:?}"
    );

    let (mut pipe, session) = spawn_session(session_config());
    let mut f = Vec::new();
    frame::encode_into(Kind::Packet, &[0x45, 0], &mut f).expect("fits");
    pipe.write_all(&f).await.expect("write");
    let r = session.await.expect("no panic");
    assert!(
        matches!(r, Err(SessionError::NotHello(Kind::Packet))),
        "{r:?}"
    );

    let (mut pipe, session) = spawn_session(session_config());
    pipe.write_all(&hello_frame(
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        PROTOCOL_VERSION,
    ))
    .await
    .expect("write");
    let r = session.await.expect("no panic");
    assert!(matches!(r, Err(SessionError::BadTunnelIp(_))), "{r:?}");

    // Dual stack: an IPv6 tunnel IP other than the IPv4 one embedded in the
    // IPv6 pool is not this lease's.
    let (mut pipe, session) = spawn_session(session_config());
    let payload = kvpn_proto::frame::Hello {
        version: PROTOCOL_VERSION,
        tunnel_ip: LAPTOP_V4,
        token: Vec::new(),
        mtu: None,
        tunnel_ip_v6: Some("fd6b:7670:6e00::6460:99".parse().expect("v6")),
        offloads: None,
        shard: None,
        resume_token: None,
    }
    .encode()
    .expect("encodes");
    let mut f = Vec::new();
    frame::encode_into(Kind::Hello, &payload, &mut f).expect("fits");
    pipe.write_all(&f).await.expect("write");
    let r = session.await.expect("no panic");
    assert!(
        matches!(r, Err(SessionError::BadTunnelIpV6 { .. })),
        "{r:?}"
    );

    let (mut pipe, session) = spawn_session(session_config());
    pipe.write_all(&[0, 0, 2]).await.expect("write");
    let r = session.await.expect("no panic");
    assert!(matches!(r, Err(SessionError::Frame(_))), "{r:?}");
}

/// Deterministic pseudo-random bytes (xorshift), so failures reproduce.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Garbage packets and unknown frames never panic the session, and it keeps
/// relaying afterwards. Packets claim the laptop's source so they reach the
/// flow table and smoltcp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_frames_never_panic() {
    let server = echo_server(LOOPBACK).await;
    let mut laptop = Laptop::connect(LAPTOP_V4).await;
    for i in 0..3000u64 {
        let len = (i as usize * 37) % 200;
        let mut p = noise(i, len);
        if p.len() >= 20 && i % 2 == 0 {
            // A plausible IPv4 header from the laptop to loopback, random rest.
            p[0] = 0x45;
            let total = (p.len() as u16).to_be_bytes();
            p[2..4].copy_from_slice(&total);
            p[6] = 0;
            p[7] = 0;
            p[9] = [1u8, 6, 17][(i / 2 % 3) as usize];
            p[12..16].copy_from_slice(&[100, 96, 0, 2]);
            p[16..20].copy_from_slice(&[127, 0, 0, 1]);
        }
        if i % 100 == 0 {
            let mut f = Vec::new();
            frame::encode_into(Kind::Unknown(200), &p, &mut f).expect("fits");
            laptop.send_raw(&f).await;
        } else {
            laptop.send_packet(&p).await;
        }
        if i % 500 == 0 {
            laptop.step(Duration::from_millis(1)).await;
        }
    }
    let h = laptop.tcp_socket(65536, 65536);
    laptop.connect_tcp(h, server, 41008);
    established(&mut laptop, h).await;
    assert!(echo_through(&mut laptop, h, b"alive").await == b"alive");
    let metrics = laptop.finish().await;
    assert!(
        metrics.dropped_total() > 0,
        "garbage was not counted as dropped: {metrics}"
    );
}
