//! Entry points of the cargo-fuzz targets (fuzz/) that reach the manager's
//! input from the network: packets from the laptop (classification, ICMP
//! error building, fragment reassembly, the whole smoltcp engine), lease
//! requests and hellos. The corpus replay test in `kvpn-tests` calls the same
//! functions, so CI replays exactly what the fuzzers run. Pure: no I/O (the
//! engine is driven with made-up kernel-side events and a virtual clock).
//! Each function panics only on a bug.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use kvpn_proto::frame::Hello;
use kvpn_proto::fuzzing::chunks;
use kvpn_proto::manager::{LeaseRequest, WatchRoutesRequest};
use prost::Message as _;

use crate::engine::{DialError, Engine, EngineConfig, Event, Request};
use crate::frag::{self, Reassembler, Reassembly};
use crate::lease::LeaseTable;
use crate::packet::{self, Offending, Parsed, Unreachable};

/// The laptop's tunnel IP in every target here (the first client's, so seed
/// packets from 100.96.0.2 pass the source check).
pub const TUNNEL_IP: Ipv4Addr = Ipv4Addr::new(100, 96, 0, 2);

/// One raw packet from the laptop through the classifier and every builder
/// that quotes or answers it.
pub fn packet_parse(data: &[u8]) {
    if let Ok(parsed) = packet::parse(data) {
        let (src, dst) = parsed.addrs();
        assert_eq!(src.is_ipv4(), dst.is_ipv4(), "mixed address families");
        match parsed {
            Parsed::Tcp(meta) => {
                if meta.is_initial_syn()
                    && let Ok(rst) = packet::tcp_rst_for_syn(&meta)
                {
                    assert!(packet::parse(&rst).is_ok(), "our RST does not parse");
                }
            }
            Parsed::Udp { src, dst, payload } => {
                let _ = packet::udp_datagram(dst, src, payload);
            }
            Parsed::EchoRequest {
                src,
                dst,
                ident,
                seq,
                data,
            } => {
                let _ = packet::echo_reply(dst, src, ident, seq, data);
                let req = packet::ping_socket_request(src.is_ipv6(), seq, data);
                let _ = packet::ping_socket_reply(src.is_ipv6(), &req);
            }
        }
    }
    if let Some(off) = Offending::from_packet(data) {
        for kind in [Unreachable::Host, Unreachable::Port] {
            let _ = packet::dst_unreachable(&off, kind);
        }
    }
    let _ = packet::too_big(data, 1280);
    let _ = packet::reassembly_time_exceeded(data);
    let _ = packet::ping_socket_reply(false, data);
    let _ = packet::ping_socket_reply(true, data);
    let _ = frag::source(data);
    let _ = frag::must_not_fragment(data);
}

/// A sequence of packets ([`chunks`] shape) through one session's fragment
/// reassembler, 1 s apart, then a timeout sweep; completed datagrams are
/// classified and fragmented again.
pub fn frag_reassembly(data: &[u8]) {
    let start = Instant::now();
    let mut now = start;
    let mut r = Reassembler::default();
    for (i, pkt) in chunks(data).into_iter().enumerate() {
        match r.push(pkt, now) {
            Reassembly::Complete(whole) => {
                assert!(whole.len() <= 65_535, "reassembled {} bytes", whole.len());
                let _ = packet::parse(&whole);
                let ident = u32::try_from(i).unwrap_or(u32::MAX);
                for f in frag::fragment(whole, 1280, ident) {
                    assert!(f.len() <= 1280, "fragment of {} bytes over 1280", f.len());
                }
            }
            Reassembly::Whole | Reassembly::Pending | Reassembly::Dropped(_) => {}
        }
        assert!(
            r.buffered_bytes() <= frag::MAX_BUFFERED_BYTES + frag::MAX_REASSEMBLIES * 65_535,
            "reassembler holds {} bytes",
            r.buffered_bytes()
        );
        assert!(r.in_progress() <= frag::MAX_REASSEMBLIES);
        now += Duration::from_secs(1);
    }
    let _ = r.poll_timeout();
    for expired in r.handle_timeout(now + Duration::from_secs(120)) {
        let _ = expired;
    }
    assert_eq!(r.in_progress(), 0, "datagrams left after every timeout");
}

/// A sequence of packets ([`chunks`] shape) from the laptop into one
/// session's engine; every request the engine makes is answered at once by a
/// made-up kernel side (success, failure, EOF or reset, picked by the
/// packet's length), then time runs past every idle timeout.
pub fn engine_ingest(data: &[u8]) {
    let start = Instant::now();
    let mut now = start;
    let mut e = Engine::new(EngineConfig::new(IpAddr::V4(TUNNEL_IP), 7), now);
    for pkt in chunks(data) {
        e.handle_laptop_packet(pkt, now);
        e.poll(now);
        answer_requests(&mut e, pkt.len() % 4, now);
        while e.poll_transmit().is_some() {}
        now += Duration::from_millis(10);
        e.handle_timeout(now);
    }
    for _ in 0..3 {
        now += Duration::from_secs(3 * 24 * 3600);
        e.handle_timeout(now);
        e.poll(now);
        answer_requests(&mut e, 0, now);
        while e.poll_transmit().is_some() {}
    }
    let _ = e.poll_timeout(now);
}

fn answer_requests(e: &mut Engine, mode: usize, now: Instant) {
    // Bounded: each answer may cause new requests (a write after data, …).
    for _ in 0..64 {
        let Some(req) = e.poll_request() else { return };
        let events = match req {
            Request::TcpDial { flow, .. } => vec![Event::TcpDialed {
                flow,
                result: match mode {
                    1 => Err(DialError::Refused),
                    3 => Err(DialError::TimedOut),
                    _ => Ok(()),
                },
            }],
            Request::TcpWrite { flow, data } => {
                let mut ev = vec![Event::TcpWritten {
                    flow,
                    bytes: data.len(),
                }];
                match mode {
                    2 => ev.push(Event::TcpEof { flow }),
                    3 => ev.push(Event::TcpReset { flow }),
                    _ => {}
                }
                ev
            }
            Request::TcpGrant { flow, bytes } => vec![Event::TcpData {
                flow,
                data: vec![0x5a; bytes.min(300)],
            }],
            Request::UdpSend { flow, payload } => vec![match mode {
                1 => Event::UdpRefused { flow },
                2 => Event::UdpUnreachable { flow },
                3 => Event::SendFailed { flow },
                _ => Event::UdpReply {
                    flow,
                    data: payload,
                },
            }],
            Request::PingSend { flow, seq, data } => vec![match mode {
                1 => Event::SocketFailed { flow },
                _ => Event::PingReply { flow, seq, data },
            }],
            Request::TcpShutdownWrite { .. }
            | Request::TcpClose { .. }
            | Request::UdpOpen { .. }
            | Request::UdpClose { .. }
            | Request::PingOpen { .. }
            | Request::PingClose { .. } => Vec::new(),
        };
        for ev in events {
            e.handle_event(ev, now);
        }
        e.poll(now);
    }
}

/// A sequence of messages ([`chunks`] shape) at the manager's lease surface:
/// a chunk starting with an even byte is a prost-encoded `LeaseRequest` (the
/// rest of it), an odd one a hello payload checked against the leases
/// granted so far; `WatchRoutesRequest` is decoded from every chunk too.
pub fn lease_hello(data: &[u8]) {
    // Cannot fail: a constant /16.
    let pool = Ipv4Net::new(Ipv4Addr::new(100, 96, 0, 0), 16).unwrap_or_default();
    let mut table = LeaseTable::new(pool, Duration::from_secs(600));
    let mut now_s = 1_000_000u64;
    for (i, chunk) in chunks(data).into_iter().enumerate() {
        let Some((tag, body)) = chunk.split_first() else {
            continue;
        };
        let _ = WatchRoutesRequest::decode(body);
        if tag % 2 == 0 {
            if let Ok(req) = LeaseRequest::decode(body)
                && let Ok(rec) = table.lease(&req.client_id, &format!("token-{i}"), now_s)
            {
                assert!(table.leasable(rec.ip), "leased {} outside the pool", rec.ip);
                assert_eq!(
                    table.check(IpAddr::V4(rec.ip), rec.token.as_bytes(), now_s),
                    Ok(req.client_id.clone()),
                    "a fresh lease does not check"
                );
            }
        } else if let Ok(hello) = Hello::decode(body)
            && let Ok(client) = table.check(hello.tunnel_ip, &hello.token, now_s)
        {
            table.activate(hello.tunnel_ip);
            assert!(!client.is_empty(), "a hello matched a lease with no client");
        }
        now_s += u64::from(*tag) * 10;
        let _ = table.expire(now_s);
    }
}
