//! Unit tests of the engine: a scripted laptop (packets built with
//! `smoltcp::wire`) and a scripted kernel side (events), virtual clock.

use super::*;
use crate::packet::test_support::*;
use proptest::prelude::*;
use smoltcp::wire::{Icmpv4Message, Icmpv4Packet, Ipv4Packet, TcpControl, UdpPacket};

const LAPTOP: [u8; 4] = [100, 96, 0, 2];

fn laptop(port: u16) -> SocketAddr {
    v4(LAPTOP, port)
}

fn backend() -> SocketAddr {
    v4([10, 244, 1, 11], 7007)
}

struct Harness {
    e: Engine,
    now: Instant,
}

/// State of the scripted laptop's side of one TCP connection.
struct Conn {
    flow: FlowId,
    port: u16,
    dst: SocketAddr,
    /// Next sequence number the laptop sends.
    snd_nxt: u32,
    /// Next sequence number the laptop expects.
    rcv_nxt: u32,
}

impl Harness {
    fn new() -> Self {
        let now = Instant::now();
        let config = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 7);
        Self {
            e: Engine::new(config, now),
            now,
        }
    }

    fn with_tcp_window(bytes: usize) -> Self {
        let now = Instant::now();
        let mut config = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 7);
        config.tcp_window = bytes;
        Self {
            e: Engine::new(config, now),
            now,
        }
    }

    fn send(&mut self, pkt: Vec<u8>) {
        self.e.handle_laptop_packet(&pkt, self.now);
        self.e.poll(self.now);
    }

    fn event(&mut self, ev: Event) {
        self.e.handle_event(ev, self.now);
        self.e.poll(self.now);
    }

    fn out(&mut self) -> Vec<Vec<u8>> {
        std::iter::from_fn(|| self.e.poll_transmit()).collect()
    }

    fn reqs(&mut self) -> Vec<Request> {
        std::iter::from_fn(|| self.e.poll_request()).collect()
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.e.handle_timeout(self.now);
    }

    /// SYN, dial success, SYN-ACK, ACK. Returns the connection and the first grant.
    fn open(&mut self, port: u16, dst: SocketAddr) -> (Conn, usize) {
        self.send(tcp_segment(
            laptop(port),
            dst,
            TcpControl::Syn,
            1000,
            None,
            &[],
        ));
        assert!(
            self.out().is_empty(),
            "SYN must be held until the dial finished"
        );
        let reqs = self.reqs();
        let [Request::TcpDial { flow, dst: d }] = reqs[..] else {
            panic!("expected one dial, got {reqs:?}");
        };
        assert_eq!(d, dst);
        self.event(Event::TcpDialed {
            flow,
            result: Ok(()),
        });
        let out = self.out();
        assert_eq!(out.len(), 1, "one SYN-ACK");
        let synack = seg(&out[0]);
        assert!(synack.syn && synack.ack, "{synack:?}");
        assert_eq!((synack.src, synack.dst), (dst, laptop(port)));
        assert_eq!(synack.ack_number, 1001);
        let mut conn = Conn {
            flow,
            port,
            dst,
            snd_nxt: 1001,
            rcv_nxt: synack.seq.wrapping_add(1),
        };
        self.ack(&mut conn);
        let reqs = self.reqs();
        let [Request::TcpGrant { flow: f, bytes }] = reqs[..] else {
            panic!("expected a grant once established, got {reqs:?}");
        };
        assert_eq!(f, flow);
        (conn, bytes)
    }

    fn ack(&mut self, c: &mut Conn) {
        self.send(tcp_segment(
            laptop(c.port),
            c.dst,
            TcpControl::None,
            c.snd_nxt,
            Some(c.rcv_nxt),
            &[],
        ));
    }

    fn data(&mut self, c: &mut Conn, payload: &[u8]) {
        self.send(tcp_segment(
            laptop(c.port),
            c.dst,
            TcpControl::Psh,
            c.snd_nxt,
            Some(c.rcv_nxt),
            payload,
        ));
        c.snd_nxt = c.snd_nxt.wrapping_add(payload.len() as u32);
    }

    fn fin(&mut self, c: &mut Conn) {
        self.send(tcp_segment(
            laptop(c.port),
            c.dst,
            TcpControl::Fin,
            c.snd_nxt,
            Some(c.rcv_nxt),
            &[],
        ));
        c.snd_nxt = c.snd_nxt.wrapping_add(1);
    }

    /// Collect in-order segments for `c` from the engine's output, advancing
    /// rcv_nxt (no ACK sent). Returns (payload, fin seen, rst seen).
    fn receive(&mut self, c: &mut Conn) -> (Vec<u8>, bool, bool) {
        let mut data = Vec::new();
        let (mut fin, mut rst) = (false, false);
        for p in self.out() {
            let s = seg(&p);
            assert_eq!((s.src, s.dst), (c.dst, laptop(c.port)));
            rst |= s.rst;
            if s.seq == c.rcv_nxt {
                data.extend_from_slice(&s.payload);
                c.rcv_nxt = c.rcv_nxt.wrapping_add(s.payload.len() as u32);
                if s.fin {
                    fin = true;
                    c.rcv_nxt = c.rcv_nxt.wrapping_add(1);
                }
            }
        }
        (data, fin, rst)
    }
}

fn writes(reqs: &[Request], flow: FlowId) -> Vec<u8> {
    reqs.iter()
        .filter_map(|r| match r {
            Request::TcpWrite { flow: f, data } if *f == flow => Some(data.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn retransmitted_syn_is_absorbed_while_dialing() {
    let mut h = Harness::new();
    let syn = tcp_segment(laptop(40000), backend(), TcpControl::Syn, 1000, None, &[]);
    h.send(syn.clone());
    h.send(syn);
    assert!(h.out().is_empty());
    let reqs = h.reqs();
    assert_eq!(reqs.len(), 1, "one dial for two SYNs: {reqs:?}");
    assert_eq!(h.e.metrics().tcp_dials, 1);
}

#[test]
fn refused_dial_answers_rst_and_closes_the_flow() {
    let mut h = Harness::new();
    h.send(tcp_segment(
        laptop(40000),
        backend(),
        TcpControl::Syn,
        1000,
        None,
        &[],
    ));
    let flow = match h.reqs()[..] {
        [Request::TcpDial { flow, .. }] => flow,
        ref r => panic!("{r:?}"),
    };
    h.event(Event::TcpDialed {
        flow,
        result: Err(DialError::Refused),
    });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let rst = seg(&out[0]);
    assert!(rst.rst && rst.ack && !rst.syn, "{rst:?}");
    assert_eq!((rst.src, rst.dst), (backend(), laptop(40000)));
    assert_eq!(rst.ack_number, 1001);
    assert_eq!(h.reqs(), [Request::TcpClose { flow, reset: true }]);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
    assert_eq!(h.e.metrics().tcp_refused, 1);
}

#[test]
fn timed_out_dial_answers_host_unreachable() {
    let mut h = Harness::new();
    h.send(tcp_segment(
        laptop(40001),
        backend(),
        TcpControl::Syn,
        5,
        None,
        &[],
    ));
    let flow = match h.reqs()[..] {
        [Request::TcpDial { flow, .. }] => flow,
        ref r => panic!("{r:?}"),
    };
    h.event(Event::TcpDialed {
        flow,
        result: Err(DialError::TimedOut),
    });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    assert_eq!(ip.src_addr(), backend().ip());
    let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
    assert_eq!(
        (icmp.msg_type(), icmp.msg_code()),
        (Icmpv4Message::DstUnreachable, 1)
    );
    assert_eq!(h.e.metrics().tcp_unreachable, 1);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

#[test]
fn laptop_reset_during_dial_cancels_it() {
    let mut h = Harness::new();
    h.send(tcp_segment(
        laptop(40002),
        backend(),
        TcpControl::Syn,
        1000,
        None,
        &[],
    ));
    let flow = match h.reqs()[..] {
        [Request::TcpDial { flow, .. }] => flow,
        ref r => panic!("{r:?}"),
    };
    h.send(tcp_segment(
        laptop(40002),
        backend(),
        TcpControl::Rst,
        1001,
        None,
        &[],
    ));
    assert_eq!(h.reqs(), [Request::TcpClose { flow, reset: true }]);
    // A late dial result changes nothing.
    h.event(Event::TcpDialed {
        flow,
        result: Ok(()),
    });
    assert!(h.out().is_empty());
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

#[test]
fn relays_both_ways_and_closes_in_order() {
    let mut h = Harness::new();
    let (mut c, grant) = h.open(40003, backend());
    assert_eq!(grant, TCP_TX_BUFFER);

    // Outbound: laptop data becomes a write to the destination.
    h.data(&mut c, b"ping");
    assert_eq!(writes(&h.reqs(), c.flow), b"ping");
    h.event(Event::TcpWritten {
        flow: c.flow,
        bytes: 4,
    });

    // Inbound: destination data reaches the laptop.
    h.event(Event::TcpData {
        flow: c.flow,
        data: b"pong".to_vec(),
    });
    let (got, fin, _) = h.receive(&mut c);
    assert_eq!(got, b"pong");
    assert!(!fin);
    h.ack(&mut c);

    // Laptop half-closes: shutdown(SHUT_WR) after its data.
    h.data(&mut c, b"last");
    h.fin(&mut c);
    let reqs = h.reqs();
    let pos_write = reqs
        .iter()
        .position(|r| matches!(r, Request::TcpWrite { .. }));
    let pos_shut = reqs
        .iter()
        .position(|r| matches!(r, Request::TcpShutdownWrite { .. }));
    assert!(pos_write < pos_shut && pos_shut.is_some(), "{reqs:?}");
    assert_eq!(writes(&reqs, c.flow), b"last");

    // The destination still answers after the half-close, then closes.
    h.event(Event::TcpData {
        flow: c.flow,
        data: b"reply".to_vec(),
    });
    h.event(Event::TcpEof { flow: c.flow });
    let (got, fin, _) = h.receive(&mut c);
    assert_eq!(got, b"reply");
    // In CLOSE-WAIT the FIN waits until the data is acknowledged (see service_tcp).
    assert!(!fin, "FIN before the data was acknowledged");
    h.ack(&mut c);
    let (got, fin, _) = h.receive(&mut c);
    assert!(got.is_empty() && fin, "FIN once the data was acknowledged");
    h.ack(&mut c);
    assert!(h.reqs().contains(&Request::TcpClose {
        flow: c.flow,
        reset: false
    }));
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
    assert_eq!(h.e.metrics().tcp_closed, 1);
}

#[test]
fn destination_close_delivers_all_data_then_fin() {
    let mut h = Harness::new();
    let (mut c, mut credit) = h.open(40004, backend());
    let total = 3 * TCP_TX_BUFFER + 12345;
    let source: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
    let mut sent = 0;
    let mut received = Vec::new();
    let mut fin = false;
    for _ in 0..10_000 {
        // Kernel side: read as much as granted.
        let n = credit.min(total - sent).min(64 * 1024);
        if n > 0 {
            credit -= n;
            h.event(Event::TcpData {
                flow: c.flow,
                data: source[sent..sent + n].to_vec(),
            });
            sent += n;
            if sent == total {
                h.event(Event::TcpEof { flow: c.flow });
            }
        }
        let (d, f, rst) = h.receive(&mut c);
        assert!(!rst);
        received.extend_from_slice(&d);
        fin |= f;
        h.ack(&mut c);
        for r in h.reqs() {
            if let Request::TcpGrant { bytes, .. } = r {
                credit += bytes;
            }
        }
        if let Some(TcpFlow {
            state: TcpState::Open(o),
            ..
        }) = h.e.tcp.get(&c.flow)
        {
            assert!(o.overflow.is_empty(), "a grant exceeded the send buffer");
        }
        if fin {
            break;
        }
    }
    assert!(fin, "no FIN after {} of {total} bytes", received.len());
    assert_eq!(received.len(), total);
    assert!(received == source, "bytes differ");
}

#[test]
fn grants_never_exceed_free_send_buffer() {
    let mut h = Harness::new();
    let (c, first) = h.open(40005, backend());
    // The laptop never acknowledges: the credit stays at one buffer in total.
    let mut delivered = 0;
    let mut credit = first;
    for _ in 0..50 {
        if credit > 0 {
            let n = credit.min(64 * 1024);
            credit -= n;
            delivered += n;
            h.event(Event::TcpData {
                flow: c.flow,
                data: vec![7; n],
            });
        }
        h.out();
        for r in h.reqs() {
            if let Request::TcpGrant { bytes, .. } = r {
                credit += bytes;
            }
        }
    }
    assert_eq!(
        delivered, TCP_TX_BUFFER,
        "credit beyond the unacknowledged buffer"
    );
    assert_eq!(credit, 0);
}

/// The SYN-ACK's window (the laptop's SYN offers no scaling, so the field is
/// the window in bytes, at most 65,535) after a dial, for an engine whose
/// flows get `tcp_window` bytes of receive buffer.
fn synack_window(tcp_window: usize) -> u16 {
    let mut h = Harness::with_tcp_window(tcp_window);
    h.send(tcp_segment(
        laptop(40020),
        backend(),
        TcpControl::Syn,
        1000,
        None,
        &[],
    ));
    let reqs = h.reqs();
    let [Request::TcpDial { flow, .. }] = reqs[..] else {
        panic!("expected one dial, got {reqs:?}");
    };
    h.event(Event::TcpDialed {
        flow,
        result: Ok(()),
    });
    let out = h.out();
    let synack = seg(&out[0]);
    assert!(synack.syn && synack.ack, "{synack:?}");
    synack.window
}

#[test]
fn tcp_window_sizes_the_advertised_receive_window() {
    assert_eq!(synack_window(16 * 1024), 16 * 1024);
    assert_eq!(synack_window(40_000), 40_000);
    assert_eq!(synack_window(TCP_RX_BUFFER), u16::MAX);
}

#[test]
fn write_window_bounds_outbound_reads() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40006, backend());
    // Without window scaling the laptop may have 64 KiB in flight; smoltcp
    // acknowledges each segment, so keep sending into its window.
    let chunk = vec![3u8; 8000];
    let mut written = 0;
    for _ in 0..50 {
        h.data(&mut c, &chunk);
        let out = h.out();
        if let Some(last) = out.last() {
            c.rcv_nxt = seg(last).ack_number.max(c.rcv_nxt);
        }
        written += writes(&h.reqs(), c.flow).len();
    }
    assert_eq!(written, TCP_WRITE_WINDOW, "reads beyond the write window");
    h.event(Event::TcpWritten {
        flow: c.flow,
        bytes: TCP_WRITE_WINDOW,
    });
    let more = writes(&h.reqs(), c.flow).len();
    assert_eq!(
        written + more,
        50 * 8000,
        "buffered bytes released after the write"
    );
}

#[test]
fn laptop_reset_resets_the_destination() {
    let mut h = Harness::new();
    let (c, _) = h.open(40007, backend());
    h.send(tcp_segment(
        laptop(c.port),
        c.dst,
        TcpControl::Rst,
        c.snd_nxt,
        None,
        &[],
    ));
    assert_eq!(
        h.reqs(),
        [Request::TcpClose {
            flow: c.flow,
            reset: true
        }]
    );
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
    assert_eq!(h.e.metrics().tcp_reset_by_laptop, 1);
}

#[test]
fn destination_reset_resets_the_laptop() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40008, backend());
    h.event(Event::TcpReset { flow: c.flow });
    let (_, _, rst) = h.receive(&mut c);
    assert!(rst, "RST to the laptop");
    assert_eq!(
        h.reqs(),
        [Request::TcpClose {
            flow: c.flow,
            reset: true
        }]
    );
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
    assert_eq!(h.e.metrics().tcp_reset_by_remote, 1);
}

#[test]
fn one_reset_leaves_other_flows_alone() {
    let mut h = Harness::new();
    let (a, _) = h.open(40009, backend());
    let (mut b, _) = h.open(40010, backend());
    h.event(Event::TcpReset { flow: a.flow });
    h.out();
    h.reqs();
    h.data(&mut b, b"still");
    assert_eq!(writes(&h.reqs(), b.flow), b"still");
    assert_eq!(h.e.flow_counts(), (1, 0, 0));
}

#[test]
fn time_wait_lingers_then_frees_and_allows_reuse() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40011, backend());
    // Destination closes first: the manager's FIN; then the laptop's FIN.
    h.event(Event::TcpEof { flow: c.flow });
    let (_, fin, _) = h.receive(&mut c);
    assert!(fin);
    h.fin(&mut c);
    let reqs = h.reqs();
    assert!(
        reqs.contains(&Request::TcpShutdownWrite { flow: c.flow }),
        "{reqs:?}"
    );
    assert!(
        reqs.contains(&Request::TcpClose {
            flow: c.flow,
            reset: false
        }),
        "{reqs:?}"
    );
    let out = h.out();
    assert!(
        out.iter().any(|p| seg(p).ack_number == c.snd_nxt),
        "FIN acknowledged"
    );
    assert_eq!(h.e.flow_counts(), (1, 0, 0), "TIME-WAIT socket lingers");
    // The same 4-tuple opens again: a new dial, the old socket goes.
    let (c2, _) = h.open(40011, backend());
    assert_ne!(c2.flow, c.flow);
    assert_eq!(h.e.flow_counts(), (1, 0, 0));
    h.advance(Duration::from_secs(30));
    assert_eq!(
        h.e.flow_counts(),
        (1, 0, 0),
        "the open flow stays while idle"
    );
}

#[test]
fn lingering_socket_expires() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40012, backend());
    h.event(Event::TcpEof { flow: c.flow });
    h.receive(&mut c);
    h.fin(&mut c);
    h.reqs();
    assert_eq!(h.e.flow_counts(), (1, 0, 0));
    let deadline = h.e.poll_timeout(h.now).expect("TIME-WAIT timer");
    h.advance(deadline.saturating_duration_since(h.now) + Duration::from_millis(1));
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

#[test]
fn stray_segment_gets_rst() {
    let mut h = Harness::new();
    h.send(tcp_segment(
        laptop(40013),
        backend(),
        TcpControl::None,
        55,
        Some(77),
        b"x",
    ));
    let out = h.out();
    assert_eq!(out.len(), 1);
    assert!(seg(&out[0]).rst);
    assert!(h.reqs().is_empty());
}

#[test]
fn bad_source_and_forbidden_destinations_are_dropped() {
    let mut h = Harness::new();
    h.send(tcp_segment(
        v4([100, 96, 0, 3], 1),
        backend(),
        TcpControl::Syn,
        1,
        None,
        &[],
    ));
    h.send(tcp_segment(
        laptop(1),
        v4([127, 0, 0, 1], 22),
        TcpControl::Syn,
        1,
        None,
        &[],
    ));
    h.send(udp_datagram(laptop(1), v4([255, 255, 255, 255], 67), b"x").expect("builds"));
    assert!(h.reqs().is_empty());
    assert!(h.out().is_empty());
    assert_eq!(h.e.metrics().dropped(DropReason::BadSource), 1);
    assert_eq!(h.e.metrics().dropped(DropReason::ForbiddenDestination), 2);
}

#[test]
fn flow_limit_refuses_with_rst() {
    let now = Instant::now();
    let mut config = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 1);
    config.max_tcp_flows = 1;
    let mut h = Harness {
        e: Engine::new(config, now),
        now,
    };
    h.send(tcp_segment(
        laptop(1),
        backend(),
        TcpControl::Syn,
        1,
        None,
        &[],
    ));
    h.send(tcp_segment(
        laptop(2),
        backend(),
        TcpControl::Syn,
        1,
        None,
        &[],
    ));
    assert_eq!(h.reqs().len(), 1);
    let out = h.out();
    assert_eq!(out.len(), 1);
    assert!(seg(&out[0]).rst);
    assert_eq!(h.e.metrics().dropped(DropReason::TooManyFlows), 1);
}

use crate::packet::udp_datagram;

#[test]
fn udp_flow_relays_and_expires() {
    let mut h = Harness::new();
    let dst = v4([10, 96, 0, 102], 7);
    h.send(udp_datagram(laptop(5353), dst, b"one").expect("builds"));
    h.send(udp_datagram(laptop(5353), dst, b"two").expect("builds"));
    let reqs = h.reqs();
    let flow = match reqs[..] {
        [
            Request::UdpOpen { flow, dst: d },
            Request::UdpSend {
                flow: f1,
                ref payload,
            },
            Request::UdpSend {
                flow: f2,
                payload: ref p2,
            },
        ] => {
            assert_eq!((d, f1, f2), (dst, flow, flow));
            assert_eq!((&payload[..], &p2[..]), (&b"one"[..], &b"two"[..]));
            flow
        }
        _ => panic!("{reqs:?}"),
    };
    h.event(Event::UdpReply {
        flow,
        data: b"ONE".to_vec(),
    });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    assert_eq!(ip.src_addr(), dst.ip());
    assert_eq!(ip.dst_addr(), laptop(5353).ip());
    let udp = UdpPacket::new_checked(ip.payload()).expect("udp");
    assert_eq!(
        (udp.src_port(), udp.dst_port(), udp.payload()),
        (7, 5353, &b"ONE"[..])
    );

    // The reply refreshed the flow; it expires 60 s after the last traffic.
    assert_eq!(h.e.poll_timeout(h.now), Some(h.now + UDP_IDLE_TIMEOUT));
    h.advance(UDP_IDLE_TIMEOUT - Duration::from_secs(1));
    assert!(h.reqs().is_empty());
    h.advance(Duration::from_secs(1));
    assert_eq!(h.reqs(), [Request::UdpClose { flow }]);
    assert_eq!(h.e.metrics().udp_expired, 1);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

/// Idle UDP flows are found by a scan that runs at the earliest idle deadline
/// but at most once per IDLE_SCAN_MIN (flood fairness: the scan is O(flows)),
/// so a flow is closed at most IDLE_SCAN_MIN after its timeout, and the
/// engine's timer needs no per-round look at every flow.
#[test]
fn idle_udp_flows_are_scanned_at_most_once_per_interval() {
    let mut h = Harness::new();
    let t0 = h.now;
    let dst = v4([10, 96, 0, 102], 7);
    h.send(udp_datagram(laptop(5001), dst, b"a").expect("builds"));
    let first = match h.reqs()[..] {
        [Request::UdpOpen { flow, .. }, Request::UdpSend { .. }] => flow,
        ref r => panic!("{r:?}"),
    };
    assert_eq!(h.e.poll_timeout(h.now), Some(t0 + UDP_IDLE_TIMEOUT));
    h.now += Duration::from_millis(200);
    h.send(udp_datagram(laptop(5002), dst, b"b").expect("builds"));
    let second = match h.reqs()[..] {
        [Request::UdpOpen { flow, .. }, Request::UdpSend { .. }] => flow,
        ref r => panic!("{r:?}"),
    };
    // The first flow's deadline is still the earliest.
    assert_eq!(h.e.poll_timeout(h.now), Some(t0 + UDP_IDLE_TIMEOUT));
    h.advance(UDP_IDLE_TIMEOUT - Duration::from_millis(200));
    assert_eq!(h.reqs(), [Request::UdpClose { flow: first }]);
    // The second is due 200 ms later, but the next scan waits IDLE_SCAN_MIN.
    let next = t0 + UDP_IDLE_TIMEOUT + IDLE_SCAN_MIN;
    assert_eq!(h.e.poll_timeout(h.now), Some(next));
    h.advance(IDLE_SCAN_MIN - Duration::from_millis(1));
    assert!(h.reqs().is_empty(), "no scan before the interval");
    h.advance(Duration::from_millis(1));
    assert_eq!(h.reqs(), [Request::UdpClose { flow: second }]);
    assert_eq!(h.e.metrics().udp_expired, 2);
    assert_eq!(h.e.poll_timeout(h.now), None, "no flows, no idle timer");
}

#[test]
fn udp_refused_answers_port_unreachable() {
    let mut h = Harness::new();
    let dst = v4([10, 244, 1, 11], 9);
    h.send(udp_datagram(laptop(6000), dst, b"x").expect("builds"));
    let flow = match h.reqs()[0] {
        Request::UdpOpen { flow, .. } => flow,
        ref r => panic!("{r:?}"),
    };
    h.event(Event::UdpRefused { flow });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
    assert_eq!(
        (icmp.msg_type(), icmp.msg_code()),
        (Icmpv4Message::DstUnreachable, 3)
    );
    let quoted = Ipv4Packet::new_checked(icmp.data()).expect("quoted header");
    assert_eq!(quoted.dst_addr(), dst.ip());
    assert_eq!(&icmp.data()[20..24], &[0x17, 0x70, 0, 9]);
}

#[test]
fn echo_reply_only_when_the_target_answers() {
    let mut h = Harness::new();
    let laptop_ip = laptop(0).ip();
    let target = v4([10, 244, 1, 11], 0).ip();
    h.send(echo_request(laptop_ip, target, 0xbeef, 1, b"abc"));
    let reqs = h.reqs();
    let flow = match reqs[..] {
        [
            Request::PingOpen { flow, dst },
            Request::PingSend {
                flow: f,
                seq: 1,
                ref data,
            },
        ] => {
            assert_eq!((dst, f, &data[..]), (target, flow, &b"abc"[..]));
            flow
        }
        _ => panic!("{reqs:?}"),
    };
    assert!(h.out().is_empty(), "no reply before the target answered");
    h.event(Event::PingReply {
        flow,
        seq: 1,
        data: b"abc".to_vec(),
    });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    assert_eq!(
        (ip.src_addr(), ip.dst_addr()),
        (v4([10, 244, 1, 11], 0).ip(), laptop_ip).into_v4()
    );
    let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
    assert_eq!(icmp.msg_type(), Icmpv4Message::EchoReply);
    assert_eq!(
        (icmp.echo_ident(), icmp.echo_seq_no(), icmp.data()),
        (0xbeef, 1, &b"abc"[..])
    );
    // A second ping with another identifier is another flow.
    h.send(echo_request(laptop_ip, target, 0xcafe, 1, b""));
    assert!(matches!(h.reqs()[0], Request::PingOpen { .. }));
    assert_eq!(h.e.flow_counts(), (0, 0, 2));
    h.advance(PING_IDLE_TIMEOUT);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

trait IntoV4 {
    fn into_v4(self) -> (std::net::Ipv4Addr, std::net::Ipv4Addr);
}

impl IntoV4 for (IpAddr, IpAddr) {
    fn into_v4(self) -> (std::net::Ipv4Addr, std::net::Ipv4Addr) {
        match self {
            (IpAddr::V4(a), IpAddr::V4(b)) => (a, b),
            other => panic!("not IPv4: {other:?}"),
        }
    }
}

#[test]
fn failed_socket_closes_the_flow() {
    let mut h = Harness::new();
    h.send(echo_request(
        laptop(0).ip(),
        v4([10, 244, 1, 99], 0).ip(),
        1,
        1,
        b"",
    ));
    let flow = match h.reqs()[0] {
        Request::PingOpen { flow, .. } => flow,
        ref r => panic!("{r:?}"),
    };
    h.event(Event::SocketFailed { flow });
    assert_eq!(h.reqs(), [Request::PingClose { flow }]);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

fn arbitrary_event() -> impl Strategy<Value = Event> {
    let flow = (0u64..6).prop_map(FlowId);
    let data = proptest::collection::vec(any::<u8>(), 0..2000);
    prop_oneof![
        (
            flow.clone(),
            prop_oneof![
                Just(Ok(())),
                Just(Err(DialError::Refused)),
                Just(Err(DialError::TimedOut))
            ]
        )
            .prop_map(|(flow, result)| Event::TcpDialed { flow, result }),
        (flow.clone(), data.clone()).prop_map(|(flow, data)| Event::TcpData { flow, data }),
        flow.clone().prop_map(|flow| Event::TcpEof { flow }),
        flow.clone().prop_map(|flow| Event::TcpReset { flow }),
        (flow.clone(), 0usize..100_000).prop_map(|(flow, bytes)| Event::TcpWritten { flow, bytes }),
        (flow.clone(), data.clone()).prop_map(|(flow, data)| Event::UdpReply { flow, data }),
        flow.clone().prop_map(|flow| Event::UdpRefused { flow }),
        flow.clone().prop_map(|flow| Event::UdpUnreachable { flow }),
        flow.clone().prop_map(|flow| Event::SocketFailed { flow }),
        (flow, any::<u16>(), data).prop_map(|(flow, seq, data)| Event::PingReply {
            flow,
            seq,
            data
        }),
    ]
}

/// A laptop packet: valid TCP/UDP/ICMP to a few endpoints, possibly mutated.
fn arbitrary_packet() -> impl Strategy<Value = Vec<u8>> {
    let port = 1u16..4;
    let control = prop_oneof![
        Just(TcpControl::Syn),
        Just(TcpControl::None),
        Just(TcpControl::Fin),
        Just(TcpControl::Rst),
        Just(TcpControl::Psh)
    ];
    let valid = prop_oneof![
        (
            port.clone(),
            control,
            any::<u32>(),
            any::<Option<u32>>(),
            proptest::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(p, c, seq, ack, payload)| tcp_segment(
                laptop(p),
                backend(),
                c,
                seq,
                ack,
                &payload
            )),
        (port, proptest::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(p, payload)| udp_datagram(laptop(p), backend(), &payload).expect("builds")),
        (any::<u16>(), any::<u16>()).prop_map(|(id, seq)| echo_request(
            laptop(0).ip(),
            backend().ip(),
            id % 3,
            seq,
            b"x"
        )),
        // One fragment of a 3000-byte datagram (of two possible ones).
        (0usize..3, any::<u32>()).prop_map(|(i, id)| {
            let whole = udp_datagram(laptop(1), backend(), &[5u8; 3000]).expect("builds");
            crate::frag::fragment(whole, 1500, id % 2).swap_remove(i)
        }),
        // Over the stack MTU, with DF.
        (0usize..100).prop_map(|n| udp_datagram(laptop(2), backend(), &vec![6u8; 9000 + n])
            .expect("builds")),
    ];
    (
        valid,
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        any::<bool>(),
    )
        .prop_map(|(mut pkt, flips, truncate)| {
            for (i, b) in flips {
                let len = pkt.len();
                pkt[i % len] ^= b;
            }
            if truncate {
                pkt.truncate(pkt.len() / 2);
            }
            pkt
        })
}

#[derive(Debug, Clone)]
enum Step {
    Packet(Vec<u8>),
    Random(Vec<u8>),
    Event(Event),
    Advance(u64),
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any mix of laptop packets (valid, mutated, random), kernel events for
    /// live or stale flows and time steps never panics, and every flow opened
    /// towards the kernel side is closed by the end of the session's traffic.
    #[test]
    fn engine_never_panics(steps in proptest::collection::vec(prop_oneof![
        arbitrary_packet().prop_map(Step::Packet),
        proptest::collection::vec(any::<u8>(), 0..80).prop_map(Step::Random),
        arbitrary_event().prop_map(Step::Event),
        (0u64..200_000).prop_map(Step::Advance),
    ], 0..60)) {
        let mut h = Harness::new();
        let mut open = std::collections::BTreeSet::new();
        for step in steps {
            match step {
                Step::Packet(p) | Step::Random(p) => h.send(p),
                Step::Event(e) => h.event(e),
                Step::Advance(ms) => h.advance(Duration::from_millis(ms)),
            }
            h.out();
            for r in h.reqs() {
                match r {
                    Request::TcpDial { flow, .. } | Request::UdpOpen { flow, .. } | Request::PingOpen { flow, .. } => {
                        prop_assert!(open.insert(flow), "{flow} opened twice");
                    }
                    Request::TcpClose { flow, .. } | Request::UdpClose { flow } | Request::PingClose { flow } => {
                        prop_assert!(open.remove(&flow), "{flow} closed but not open");
                    }
                    Request::TcpWrite { flow, .. } | Request::TcpShutdownWrite { flow } | Request::TcpGrant { flow, .. }
                    | Request::UdpSend { flow, .. } | Request::PingSend { flow, .. } => {
                        prop_assert!(open.contains(&flow), "request for {flow}, which is not open");
                    }
                }
            }
        }
        // Flows the engine still tracks with a live kernel side are exactly the open ones.
        let mut live: std::collections::BTreeSet<FlowId> = h.e.udp.keys().chain(h.e.ping.keys()).copied().collect();
        for (id, f) in &h.e.tcp {
            match &f.state {
                TcpState::Dialing { .. } => { live.insert(*id); }
                TcpState::Open(o) if !o.kernel_closed => { live.insert(*id); }
                _ => {}
            }
        }
        prop_assert_eq!(live, open);
    }
}

/// A laptop that half-closed and reads slowly (zero window) is served by its
/// window updates, not by 1 s zero-window probes, also after the destination
/// closed (smoltcp ignores window updates in LAST-ACK, so the FIN is held).
#[test]
fn window_updates_after_destination_eof_resume_at_once() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40014, backend());
    h.fin(&mut c);
    h.reqs();
    h.out();
    h.event(Event::TcpData {
        flow: c.flow,
        data: vec![1; 100_000],
    });
    h.event(Event::TcpEof { flow: c.flow });
    let mut received = 0;
    let mut fin = false;
    // The laptop advertises a zero window after each burst, then opens it.
    for _ in 0..100 {
        let (d, f, _) = h.receive(&mut c);
        received += d.len();
        fin |= f;
        if fin {
            break;
        }
        // Zero window...
        h.send(tcp_segment_win(
            laptop(c.port),
            c.dst,
            c.snd_nxt,
            c.rcv_nxt,
            0,
        ));
        let sent: Vec<_> = h.out().iter().map(|p| seg(p)).collect();
        assert!(
            sent.iter().all(|s| s.payload.is_empty()),
            "data into a zero window: {sent:?}"
        );
        if sent.iter().any(|s| s.fin) {
            fin = true;
            break;
        }
        // ...then a pure window update, no time passes.
        h.send(tcp_segment_win(
            laptop(c.port),
            c.dst,
            c.snd_nxt,
            c.rcv_nxt,
            20_000,
        ));
    }
    let last: Vec<_> = h.out().iter().map(|p| seg(p)).collect();
    assert!(
        fin,
        "no FIN; received {received}; then {last:?}; flows {:?}; reqs {:?}",
        h.e.flow_counts(),
        h.reqs()
    );
    assert_eq!(received, 100_000);
}

/// tr-09: an idle TCP flow still relays after 11 minutes without a segment.
#[test]
fn idle_tcp_flow_survives_eleven_minutes() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40015, backend());
    h.data(&mut c, b"before");
    let _ = h.reqs();
    h.event(Event::TcpWritten {
        flow: c.flow,
        bytes: 6,
    });
    h.out();
    for _ in 0..(11 * 60 / 5) {
        h.advance(Duration::from_secs(5));
        for p in h.out() {
            let s = seg(&p);
            assert!(!s.rst, "idle flow reset after {:?}", h.now);
        }
        assert!(h.reqs().is_empty(), "idle flow produced requests");
    }
    h.data(&mut c, b"after");
    assert_eq!(writes(&h.reqs(), c.flow), b"after");
    h.event(Event::TcpData {
        flow: c.flow,
        data: b"reply".to_vec(),
    });
    let (got, _, rst) = h.receive(&mut c);
    assert!(!rst);
    assert_eq!(got, b"reply");
}

// ----- MTU, MSS, fragments (tr-01, tr-02) ---------------------------------

fn icmp_v4(pkt: &[u8]) -> (u8, u8, [u8; 4], Vec<u8>) {
    let ip = Ipv4Packet::new_checked(pkt).expect("ipv4");
    let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
    assert!(icmp.verify_checksum(), "ICMP checksum");
    let raw = ip.payload();
    (
        raw[0],
        raw[1],
        [raw[4], raw[5], raw[6], raw[7]],
        raw[8..].to_vec(),
    )
}

/// tr-02: a 20000-byte datagram the laptop's kernel fragmented reaches the
/// kernel side whole; fragments alone send nothing.
#[test]
fn fragmented_udp_from_the_laptop_is_sent_whole() {
    let mut h = Harness::new();
    let dst = v4([10, 96, 0, 102], 7);
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
    let whole = udp_datagram(laptop(7000), dst, &data).expect("builds");
    let frags = crate::frag::fragment(whole, 1500, 42);
    let (last, rest) = frags.split_last().expect("fragments");
    for f in rest {
        h.send(f.clone());
    }
    assert!(
        h.reqs().is_empty(),
        "nothing before the datagram is complete"
    );
    h.send(last.clone());
    let reqs = h.reqs();
    let [
        Request::UdpOpen { dst: d, .. },
        Request::UdpSend { payload, .. },
    ] = &reqs[..]
    else {
        panic!("{reqs:?}");
    };
    assert_eq!(*d, dst);
    assert_eq!(payload, &data);
    assert_eq!(h.e.metrics().datagrams_reassembled, 1);
}

/// A fragmented datagram that never completes is answered with ICMP
/// "fragment reassembly time exceeded" quoting its first fragment.
#[test]
fn incomplete_datagram_times_out_with_icmp() {
    let mut h = Harness::new();
    let dst = v4([10, 96, 0, 102], 7);
    let whole = udp_datagram(laptop(7001), dst, &[7u8; 4000]).expect("builds");
    let frags = crate::frag::fragment(whole, 1500, 43);
    h.send(frags[0].clone());
    assert_eq!(
        h.e.poll_timeout(h.now),
        Some(h.now + crate::frag::REASSEMBLY_TIMEOUT_V4)
    );
    h.advance(crate::frag::REASSEMBLY_TIMEOUT_V4);
    let out = h.out();
    assert_eq!(out.len(), 1, "{out:?}");
    let (ty, code, _, quote) = icmp_v4(&out[0]);
    assert_eq!((ty, code), (11, 1));
    assert_eq!(
        &quote[20..22],
        &7001u16.to_be_bytes(),
        "quotes the UDP ports"
    );
    assert!(h.reqs().is_empty());
}

/// PMTUD: a DF packet over the stack MTU gets "fragmentation needed" with
/// next-hop MTU 9000 (RFC 1191) and is not relayed; without DF it is.
#[test]
fn oversize_df_packet_gets_fragmentation_needed() {
    let mut h = Harness::new();
    let dst = v4([10, 96, 0, 102], 7);
    let big = udp_datagram(laptop(7002), dst, &[1u8; 12_000]).expect("builds");
    assert!(Ipv4Packet::new_checked(&big[..]).expect("ipv4").dont_frag());
    h.send(big.clone());
    assert!(h.reqs().is_empty(), "a too-big DF packet is not relayed");
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    assert_eq!(
        (ip.src_addr(), ip.dst_addr()),
        (ip_v4(dst), ip_v4(laptop(0)))
    );
    assert!(out[0].len() <= crate::packet::MAX_ICMPV4_ERROR);
    let (ty, code, rest, quote) = icmp_v4(&out[0]);
    assert_eq!((ty, code), (3, 4));
    assert_eq!(u16::from_be_bytes([rest[2], rest[3]]), 9000, "next-hop MTU");
    assert_eq!(
        &quote[..],
        &big[..quote.len()],
        "quotes the offending packet"
    );
    assert_eq!(h.e.metrics().too_big_sent, 1);

    let mut no_df = big;
    let mut ip = Ipv4Packet::new_unchecked(&mut no_df[..]);
    ip.set_dont_frag(false);
    ip.fill_checksum();
    h.send(no_df);
    let reqs = h.reqs();
    assert!(
        matches!(&reqs[..], [Request::UdpOpen { .. }, Request::UdpSend { payload, .. }] if payload.len() == 12_000),
        "{reqs:?}"
    );
}

/// RFC 8201: an IPv6 packet over the stack MTU gets "Packet Too Big".
#[test]
fn oversize_v6_packet_gets_packet_too_big() {
    let me = std::net::Ipv6Addr::new(0xfd6b, 0x7670, 0x6e00, 0, 0, 0, 0, 2);
    let pod = std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 9);
    let mut h = Harness::new();
    h.e = Engine::new(EngineConfig::new(IpAddr::V6(me), 7), h.now);
    let big = udp_datagram(
        SocketAddr::new(IpAddr::V6(me), 7003),
        SocketAddr::new(IpAddr::V6(pod), 7),
        &[2u8; 10_000],
    )
    .expect("builds");
    h.send(big);
    assert!(h.reqs().is_empty());
    let out = h.out();
    assert_eq!(out.len(), 1);
    assert!(out[0].len() <= crate::packet::MAX_ICMPV6_ERROR);
    let ip = smoltcp::wire::Ipv6Packet::new_checked(&out[0][..]).expect("ipv6");
    assert_eq!((ip.src_addr(), ip.dst_addr()), (pod, me));
    let icmp = smoltcp::wire::Icmpv6Packet::new_checked(ip.payload()).expect("icmpv6");
    assert!(icmp.verify_checksum(&pod, &me));
    assert_eq!(icmp.msg_type(), smoltcp::wire::Icmpv6Message::PktTooBig);
    assert_eq!(icmp.pkt_too_big_mtu(), 9000);
}

/// tr-02 inbound: a reply over the laptop's TUN MTU reaches the laptop as
/// fragments of at most that size that reassemble to it, up to the largest
/// datagram: 9000 bytes for a version-1 hello (no MTU), 1400 for a laptop
/// that said `--mtu 1400` in its hello.
#[test]
fn large_udp_reply_is_fragmented_to_the_mtu() {
    for laptop_mtu in [None, Some(1400usize)] {
        let now = Instant::now();
        let mut config = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 7);
        if let Some(m) = laptop_mtu {
            config.laptop_mtu = m;
        }
        let mtu = laptop_mtu.unwrap_or(DEFAULT_MTU);
        let mut h = Harness {
            e: Engine::new(config, now),
            now,
        };
        large_udp_replies_fragment_to(&mut h, mtu);
    }
}

fn large_udp_replies_fragment_to(h: &mut Harness, mtu: usize) {
    let dst = v4([10, 96, 0, 102], 7);
    h.send(udp_datagram(laptop(7004), dst, b"q").expect("builds"));
    let Request::UdpOpen { flow, .. } = h.reqs()[0] else {
        panic!("no open");
    };
    // Payload bytes per fragment: the MTU less the 20-byte header, in 8s.
    let per = (mtu - 20) & !7;
    for n in [1000usize, 4000, 20_000, 65_507] {
        let data: Vec<u8> = (0..n).map(|i| (i % 249) as u8).collect();
        h.event(Event::UdpReply {
            flow,
            data: data.clone(),
        });
        let out = h.out();
        assert!(
            out.iter().all(|p| p.len() <= mtu),
            "fragment sizes for MTU {mtu}: {:?}",
            out.iter().map(Vec::len).collect::<Vec<_>>()
        );
        assert_eq!(
            out.len(),
            (n + 8).div_ceil(per).max(1),
            "{n} bytes, MTU {mtu}"
        );
        let mut r = crate::frag::Reassembler::default();
        let whole: Vec<Vec<u8>> = out
            .iter()
            .filter_map(|p| match r.push(p, h.now) {
                crate::frag::Reassembly::Complete(w) => Some(w),
                crate::frag::Reassembly::Whole => Some(p.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(whole.len(), 1);
        let Ok(crate::packet::Parsed::Udp { src, payload, .. }) = crate::packet::parse(&whole[0])
        else {
            panic!("not UDP");
        };
        assert_eq!(src, dst);
        assert_eq!(payload, &data[..]);
    }
    assert_eq!(h.e.metrics().dropped(DropReason::ReplyTooLarge), 0);
}

/// MSS: the SYN-ACK advertises the stack's MTU minus 40, and segments to the
/// laptop respect the laptop's smaller MSS (a TUN with a smaller MTU).
#[test]
fn mss_is_clamped_both_ways() {
    let mut h = Harness::new();
    let dst = backend();
    h.send(tcp_syn_mss(laptop(7005), dst, 5000, 1360));
    let Request::TcpDial { flow, .. } = h.reqs()[0] else {
        panic!("no dial");
    };
    h.event(Event::TcpDialed {
        flow,
        result: Ok(()),
    });
    let out = h.out();
    assert_eq!(mss_option(&out[0]), Some(9000 - 40), "SYN-ACK MSS");
    let synack = seg(&out[0]);
    let mut c = Conn {
        flow,
        port: 7005,
        dst,
        snd_nxt: 5001,
        rcv_nxt: synack.seq.wrapping_add(1),
    };
    h.ack(&mut c);
    h.reqs();
    h.event(Event::TcpData {
        flow,
        data: vec![9u8; 20_000],
    });
    let mut got = 0;
    for p in h.out() {
        let s = seg(&p);
        assert!(
            s.payload.len() <= 1360,
            "segment of {} bytes",
            s.payload.len()
        );
        got += s.payload.len();
    }
    assert!(got > 0);
}

// ----- idle TCP flows (tr-09) ---------------------------------------------

/// tr-09's 11-minute case, and more: an established flow idle for 2 h 15 min
/// (past TCP keep-alive's first probe) and then 4 days after fresh traffic
/// still relays; only 5 days of silence (conntrack's established timeout)
/// reset it, both ways, and free it.
#[test]
fn idle_tcp_timeout_is_conntracks_five_days() {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40016, backend());
    h.out();
    h.reqs();
    // 2 h 15 min of silence, in 1-minute steps so every sweep runs.
    for _ in 0..135 {
        h.advance(Duration::from_secs(60));
    }
    assert!(h.reqs().is_empty(), "an idle flow must not be closed");
    assert!(h.out().iter().all(|p| !seg(p).rst));
    h.data(&mut c, b"still there");
    assert_eq!(writes(&h.reqs(), c.flow), b"still there");
    // Traffic restarted the clock: 4 days later it still works.
    h.advance(Duration::from_secs(4 * 24 * 3600));
    assert!(h.reqs().is_empty());
    h.event(Event::TcpData {
        flow: c.flow,
        data: b"reply".to_vec(),
    });
    let (got, _, rst) = h.receive(&mut c);
    assert!(!rst);
    assert_eq!(got, b"reply");
    h.ack(&mut c);
    h.reqs();
    // 5 days of silence: reset both ways.
    h.advance(TCP_IDLE_TIMEOUT - Duration::from_secs(60));
    assert!(h.reqs().is_empty(), "not before the timeout");
    h.advance(Duration::from_secs(120));
    assert_eq!(
        h.reqs(),
        [Request::TcpClose {
            flow: c.flow,
            reset: true
        }]
    );
    let (_, _, rst) = h.receive(&mut c);
    assert!(rst, "the laptop gets an RST");
    assert_eq!(h.e.metrics().tcp_idle_expired, 1);
    assert_eq!(h.e.flow_counts(), (0, 0, 0));
}

/// ICMP host unreachable from the cluster for a UDP flow reaches the laptop
/// as ICMP host unreachable (EHOSTUNREACH on its connected socket).
#[test]
fn udp_host_unreachable_is_relayed() {
    let mut h = Harness::new();
    let dst = v4([10, 244, 1, 99], 53);
    h.send(udp_datagram(laptop(7006), dst, b"x").expect("builds"));
    let Request::UdpOpen { flow, .. } = h.reqs()[0] else {
        panic!("no open");
    };
    h.event(Event::UdpUnreachable { flow });
    let out = h.out();
    assert_eq!(out.len(), 1);
    let (ty, code, _, quote) = icmp_v4(&out[0]);
    assert_eq!((ty, code), (3, 1));
    assert_eq!(&quote[20..24], &[0x1b, 0x5e, 0, 53]);
    assert_eq!(h.e.metrics().udp_icmp_errors, 1);
}

fn ip_v4(a: SocketAddr) -> std::net::Ipv4Addr {
    match a.ip() {
        IpAddr::V4(v) => v,
        IpAddr::V6(_) => panic!("not IPv4"),
    }
}

fn harness_with(config: impl FnOnce(&mut EngineConfig)) -> Harness {
    let now = Instant::now();
    let mut c = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 1);
    config(&mut c);
    Harness {
        e: Engine::new(c, now),
        now,
    }
}

fn syn(port: u16) -> Vec<u8> {
    tcp_segment(laptop(port), backend(), TcpControl::Syn, 1, None, &[])
}

#[test]
fn flow_cap_counts_every_kind_and_refuses_udp_with_admin_prohibited() {
    let mut h = harness_with(|c| c.max_flows = 2);
    h.send(syn(1));
    h.send(udp_datagram(laptop(53), v4([10, 96, 0, 10], 53), b"q").expect("builds"));
    assert_eq!(h.e.flows(), 2);
    let reqs = h.reqs();
    assert_eq!(reqs.len(), 3, "dial, UDP open, UDP send: {reqs:?}");
    assert!(h.out().is_empty());

    // Third flow of either kind: refused with an answer, counted.
    h.send(syn(2));
    let out = h.out();
    assert_eq!(out.len(), 1);
    assert!(seg(&out[0]).rst, "SYN over the cap gets RST");
    h.send(udp_datagram(laptop(54), v4([10, 96, 0, 10], 53), b"q").expect("builds"));
    let out = h.out();
    assert_eq!(out.len(), 1);
    let ip = Ipv4Packet::new_checked(&out[0][..]).expect("ipv4");
    let icmp = Icmpv4Packet::new_checked(ip.payload()).expect("icmp");
    assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
    assert_eq!(
        icmp.msg_code(),
        13,
        "communication administratively prohibited"
    );
    assert!(h.reqs().is_empty(), "nothing dialed or opened over the cap");
    let m = h.e.metrics();
    assert_eq!(m.flows_refused_cap, 2);
    assert_eq!(m.dropped(DropReason::TooManyFlows), 2);
    assert_eq!(h.e.max_flows(), 2);

    // Datagrams of the existing UDP flow still pass.
    h.send(udp_datagram(laptop(53), v4([10, 96, 0, 10], 53), b"again").expect("builds"));
    assert!(matches!(h.reqs()[..], [Request::UdpSend { .. }]));
}

#[test]
fn new_flow_rate_limit_drops_beyond_the_burst_and_refills() {
    let mut h = harness_with(|c| {
        c.new_flows_per_sec = 10;
        c.new_flow_burst = 5;
    });
    for port in 1..=8 {
        h.send(syn(port));
    }
    let dials = h
        .reqs()
        .iter()
        .filter(|r| matches!(r, Request::TcpDial { .. }))
        .count();
    assert_eq!(dials, 5, "the burst");
    assert!(h.out().is_empty(), "rate-limited SYNs are dropped silently");
    assert_eq!(h.e.metrics().flows_rate_limited, 3);
    // A retransmitted SYN of a dialing flow is not a new flow.
    h.send(syn(1));
    assert!(h.reqs().is_empty());
    assert_eq!(h.e.metrics().flows_rate_limited, 3);

    // UDP to many ports: same bucket. 100 ms refills one token.
    h.now += Duration::from_millis(100);
    h.send(udp_datagram(laptop(9), v4([10, 244, 1, 11], 1), b"x").expect("builds"));
    h.send(udp_datagram(laptop(9), v4([10, 244, 1, 11], 2), b"x").expect("builds"));
    let opens = h
        .reqs()
        .iter()
        .filter(|r| matches!(r, Request::UdpOpen { .. }))
        .count();
    assert_eq!(opens, 1);
    assert_eq!(h.e.metrics().flows_rate_limited, 4);

    // The SYN the laptop retransmits a second later gets through.
    h.now += Duration::from_secs(1);
    h.send(syn(6));
    assert!(matches!(h.reqs()[..], [Request::TcpDial { .. }]));
}

/// A port scan: once the failed-flow burst is spent by refused dials, new
/// flows are admitted only as fast as that bucket refills, however full the
/// new-flow bucket is; dials that succeed never take from it.
#[test]
fn refused_dials_hold_new_flows_to_the_failed_flow_rate() {
    let mut h = harness_with(|c| {
        c.failed_flows_per_sec = 10;
        c.failed_flow_burst = 3;
    });
    // Successful dials spend nothing of the failed-flow bucket.
    for port in 100..110 {
        h.open(port, backend());
    }
    let mut refused = 0;
    for port in 1..=3 {
        h.send(syn(port));
        // (The previous refused dial's close comes along.)
        let reqs = h.reqs();
        let flow = reqs
            .iter()
            .find_map(|r| match r {
                Request::TcpDial { flow, .. } => Some(*flow),
                _ => None,
            })
            .unwrap_or_else(|| panic!("SYN {port}: expected a dial, got {reqs:?}"));
        h.event(Event::TcpDialed {
            flow,
            result: Err(DialError::Refused),
        });
        refused += h.out().len();
    }
    assert_eq!(refused, 3, "each refused dial answered (RST)");
    // The burst of failures is spent: the next SYNs are dropped, counted.
    for port in 4..=6 {
        h.send(syn(port));
    }
    let dials = |reqs: Vec<Request>| {
        reqs.iter()
            .filter(|r| matches!(r, Request::TcpDial { .. }))
            .count()
    };
    assert_eq!(dials(h.reqs()), 0, "no dial after the failure burst");
    assert_eq!(h.e.metrics().flows_rate_limited, 3);
    // 100 ms refills one failure token: one more dial, then none.
    h.now += Duration::from_millis(100);
    h.send(syn(7));
    h.send(syn(8));
    assert_eq!(dials(h.reqs()), 1);
    assert_eq!(h.e.metrics().flows_rate_limited, 4);
}

/// `preserve` / `ebpf-snat`: flows handed to the pod's kernel count against
/// the same cap as terminated ones; over it a SYN gets RST and a datagram ICMP
/// "administratively prohibited", nothing goes to the kernel, and a laptop RST
/// frees the flow's place. Packets of admitted flows keep passing.
#[test]
fn forwarded_flows_count_against_the_flow_cap() {
    let mut h = harness_with(|c| c.max_flows = 2);
    let (now, e) = (h.now, &mut h.e);
    assert!(e.admit_forwarded(&syn(1), now), "first flow");
    assert!(e.admit_forwarded(&syn(1), now), "its retransmitted SYN");
    let dns = udp_datagram(laptop(53), v4([10, 96, 0, 10], 53), b"q").expect("builds");
    assert!(e.admit_forwarded(&dns, now), "second flow");
    assert_eq!((e.flows(), e.forwarded_flows()), (2, 2));
    assert!(
        !e.admit_forwarded(&syn(2), now),
        "a third flow is over the cap"
    );
    let other = udp_datagram(laptop(54), v4([10, 96, 0, 10], 53), b"q").expect("builds");
    assert!(!e.admit_forwarded(&other, now));
    let answers: Vec<Vec<u8>> = std::iter::from_fn(|| e.poll_transmit()).collect();
    assert_eq!(answers.len(), 2, "RST for the SYN, ICMP for the datagram");
    assert!(seg(&answers[0]).rst, "the refused SYN is answered with RST");
    let icmp = Ipv4Packet::new_checked(&answers[1][..]).expect("IPv4");
    let icmp = Icmpv4Packet::new_checked(icmp.payload()).expect("ICMP");
    assert_eq!(icmp.msg_type(), Icmpv4Message::DstUnreachable);
    assert!(
        e.admit_forwarded(&dns, now),
        "the admitted flow still passes"
    );
    // A terminated flow is refused as well: the cap is shared.
    h.send(syn(3));
    assert!(h.reqs().is_empty(), "no dial over the shared cap");
    // The laptop resets its TCP flow: a new one fits again.
    let (now, e) = (h.now, &mut h.e);
    let rst = tcp_segment(laptop(1), backend(), TcpControl::Rst, 2, None, &[]);
    assert!(e.admit_forwarded(&rst, now));
    assert_eq!(e.forwarded_flows(), 1);
    assert!(e.admit_forwarded(&syn(4), now));
    let m = e.metrics();
    assert_eq!((m.forwarded_flows, m.flows_refused_cap), (3, 3));
    assert_eq!(m.dropped(DropReason::TooManyFlows), 3);
}

/// Forwarded flows take new-flow tokens like terminated ones, and idle ones
/// are forgotten by the engine's idle scan.
#[test]
fn forwarded_flows_are_rate_limited_and_expire() {
    let mut h = harness_with(|c| {
        c.new_flows_per_sec = 10;
        c.new_flow_burst = 2;
        c.udp_idle_timeout = Duration::from_secs(5);
    });
    let dgram = |port| udp_datagram(laptop(port), backend(), b"x").expect("builds");
    let (now, e) = (h.now, &mut h.e);
    assert!(e.admit_forwarded(&dgram(1), now));
    assert!(e.admit_forwarded(&dgram(2), now));
    assert!(!e.admit_forwarded(&dgram(3), now), "over the burst");
    assert_eq!(e.metrics().flows_rate_limited, 1);
    assert!(
        e.poll_transmit().is_none(),
        "rate-limited: dropped silently"
    );
    h.advance(Duration::from_secs(6));
    assert_eq!(h.e.forwarded_flows(), 0, "idle flows forgotten");
}

#[test]
fn icmp_errors_to_the_laptop_are_rate_limited() {
    let mut h = harness_with(|c| {
        c.icmp_errors_per_sec = 10;
        c.icmp_error_burst = 3;
    });
    let mut flows = Vec::new();
    for port in 1..=6 {
        h.send(udp_datagram(laptop(7000), v4([10, 244, 1, 11], port), b"x").expect("builds"));
        for r in h.reqs() {
            if let Request::UdpOpen { flow, .. } = r {
                flows.push(flow);
            }
        }
    }
    assert_eq!(flows.len(), 6);
    for flow in flows {
        h.event(Event::UdpRefused { flow });
    }
    assert_eq!(h.out().len(), 3, "the ICMP burst");
    let m = h.e.metrics();
    assert_eq!((m.udp_icmp_errors, m.icmp_rate_limited), (6, 3));
}

/// Dual stack: an engine with an IPv4 and an IPv6 tunnel IP terminates IPv6
/// TCP and UDP from the IPv6 one, answers it at that address, keeps IPv4
/// working, and drops IPv6 packets from any other source.
#[test]
fn dual_stack_session_accepts_both_tunnel_ips_and_answers_each_in_its_family() {
    use smoltcp::wire::{Ipv6Packet, TcpPacket};
    let me6 = kvpn_proto::tunnel::ipv6_tunnel_ip(LAPTOP.into());
    let pod6 = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0xb);
    let now = Instant::now();
    let mut config = EngineConfig::new(IpAddr::V4(LAPTOP.into()), 7);
    config.tunnel_ip_v6 = Some(me6);
    let mut h = Harness {
        e: Engine::new(config, now),
        now,
    };
    let laptop6 = SocketAddr::new(IpAddr::V6(me6), 40000);
    let dst6 = SocketAddr::new(IpAddr::V6(pod6), 8080);

    // TCP over IPv6: the SYN becomes a dial to the IPv6 pod, the SYN-ACK goes
    // back to the IPv6 tunnel IP.
    h.send(tcp_segment(laptop6, dst6, TcpControl::Syn, 1000, None, &[]));
    let reqs = h.reqs();
    let [Request::TcpDial { flow, dst }] = reqs[..] else {
        panic!("expected one dial, got {reqs:?}");
    };
    assert_eq!(dst, dst6);
    h.event(Event::TcpDialed {
        flow,
        result: Ok(()),
    });
    let out = h.out();
    assert_eq!(out.len(), 1, "one SYN-ACK");
    let ip = Ipv6Packet::new_checked(&out[0][..]).expect("ipv6");
    assert_eq!((ip.src_addr(), ip.dst_addr()), (pod6, me6));
    let tcp = TcpPacket::new_checked(ip.payload()).expect("tcp");
    assert!(tcp.syn() && tcp.ack() && tcp.ack_number().0 == 1001);

    // UDP over IPv6: the reply is built for the IPv6 tunnel IP.
    let udp6 = SocketAddr::new(
        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x66)),
        7,
    );
    h.send(udp_datagram(SocketAddr::new(IpAddr::V6(me6), 5353), udp6, b"q").expect("builds"));
    let reqs = h.reqs();
    let Some(Request::UdpOpen { flow: uflow, dst }) = reqs.first().cloned() else {
        panic!("expected a UDP open, got {reqs:?}");
    };
    assert_eq!(dst, udp6);
    h.event(Event::UdpReply {
        flow: uflow,
        data: b"A".to_vec(),
    });
    let out = h.out();
    let ip = Ipv6Packet::new_checked(&out[0][..]).expect("ipv6");
    assert_eq!(ip.dst_addr(), me6);
    let udp = UdpPacket::new_checked(ip.payload()).expect("udp");
    assert_eq!((udp.dst_port(), udp.payload()), (5353, &b"A"[..]));

    // IPv4 still works in the same session.
    h.send(udp_datagram(laptop(5353), v4([10, 96, 0, 102], 7), b"q").expect("builds"));
    assert!(matches!(
        h.reqs()[..],
        [Request::UdpOpen { .. }, Request::UdpSend { .. }]
    ));

    // Another IPv6 source is not this session's.
    let other = SocketAddr::new(
        IpAddr::V6(kvpn_proto::tunnel::ipv6_tunnel_ip([100, 96, 0, 3].into())),
        1,
    );
    h.send(tcp_segment(other, dst6, TcpControl::Syn, 1, None, &[]));
    assert!(h.reqs().is_empty());
    assert_eq!(h.e.metrics().dropped(DropReason::BadSource), 1);
}

/// A steady flow reuses the device's packet buffers: after the first round
/// trips, relaying more data in both directions allocates no packet buffers
/// (the session recycles every transmitted packet once it is framed).
#[test]
fn steady_flow_allocates_no_packet_buffers() {
    steady_flow(false);
}

/// The same with every upload a GSO frame's super-packet, its segments
/// written straight into the engine's receive buffers (the manager's
/// `gso_frame`): still no packet buffer allocated after the first rounds.
#[test]
fn steady_gso_upload_allocates_no_packet_buffers() {
    steady_flow(true);
}

/// The laptop sends `payload` as one TCP super-packet cut into `mss`-byte
/// segments the way the manager's session does for a GSO frame.
fn data_gso(h: &mut Harness, c: &mut Conn, payload: &[u8], mss: usize) {
    let sp = tcp_segment(
        laptop(c.port),
        c.dst,
        TcpControl::Psh,
        c.snd_nxt,
        Some(c.rcv_nxt),
        payload,
    );
    let seg = kvpn_proto::gso::Segmenter::new(&sp, kvpn_proto::gso::GsoKind::TcpV4, mss)
        .expect("a super-packet");
    assert!(seg.count() > 1);
    for i in 0..seg.count() {
        let mut buf = h.e.rx_buffer();
        seg.write(i, &mut buf);
        h.e.handle_laptop_packet_pooled(buf, h.now);
    }
    h.e.poll(h.now);
    c.snd_nxt = c.snd_nxt.wrapping_add(payload.len() as u32);
}

fn steady_flow(gso: bool) {
    let mut h = Harness::new();
    let (mut c, _) = h.open(40009, backend());
    let mut warm = 0;
    let mut received = Vec::new();
    for round in 0..400u32 {
        if round == 20 {
            warm = h.e.packet_buffers_allocated();
        }
        let up = round.to_be_bytes().repeat(250);
        if gso {
            data_gso(&mut h, &mut c, &up, 300);
        } else {
            h.data(&mut c, &up);
        }
        assert_eq!(writes(&h.reqs(), c.flow), up, "round {round}: upload");
        h.event(Event::TcpWritten {
            flow: c.flow,
            bytes: up.len(),
        });
        let down = (round ^ 0xffff_ffff).to_be_bytes().repeat(250);
        h.event(Event::TcpData {
            flow: c.flow,
            data: down.clone(),
        });
        while let Some(p) = h.e.poll_transmit() {
            let s = seg(&p);
            if s.seq == c.rcv_nxt && !s.payload.is_empty() {
                received.extend_from_slice(&s.payload);
                c.rcv_nxt = c.rcv_nxt.wrapping_add(s.payload.len() as u32);
            }
            h.e.recycle(p);
        }
        h.ack(&mut c);
        let _ = h.reqs();
        while let Some(p) = h.e.poll_transmit() {
            h.e.recycle(p);
        }
    }
    let expected: Vec<u8> = (0..400u32)
        .flat_map(|r| (r ^ 0xffff_ffff).to_be_bytes().repeat(250))
        .collect();
    assert!(received == expected, "download differs");
    assert!(warm > 0, "the first rounds allocate");
    assert_eq!(
        h.e.packet_buffers_allocated(),
        warm,
        "380 more round trips allocated packet buffers"
    );
}

/// smoltcp's own segments of one download (MSS 536: the laptop's SYN had no
/// MSS option) merge into GSO frames (offload bit 2) that segment back into
/// exactly the packets smoltcp sent.
#[test]
fn smoltcp_download_segments_coalesce_and_segment_back() {
    let mut h = Harness::new();
    let (c, _) = h.open(40010, backend());
    let down: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    h.event(Event::TcpData {
        flow: c.flow,
        data: down,
    });
    let packets = h.out();
    assert!(packets.len() > 10, "{} packets", packets.len());
    let mut wire = Vec::new();
    let mut coalescer = kvpn_proto::gso::Coalescer::default();
    let (done, too_large) =
        kvpn_proto::frame::encode_coalesced(&mut coalescer, &packets, &mut wire);
    assert_eq!(too_large, 0);
    assert_eq!(
        done.merged,
        packets.len(),
        "every data segment merged: {done:?}"
    );
    let decoder = kvpn_proto::frame::Decoder::default();
    let (mut off, mut again, mut frames) = (0, Vec::new(), 0);
    while let Some((f, used)) = decoder.decode(&wire[off..]).expect("valid frames") {
        off += used;
        assert_eq!(f.kind, kvpn_proto::frame::Kind::Gso);
        frames += 1;
        let (gh, sp) = kvpn_proto::frame::GsoHeader::split(f.payload).expect("GSO header");
        let kind = kvpn_proto::gso::check_super_packet(
            sp,
            gh.flags,
            gh.gso_type,
            gh.gso_size,
            gh.csum_start,
            gh.csum_offset,
        )
        .expect("valid super-packet");
        let mut out = Vec::new();
        let seg = kvpn_proto::gso::segment_tcp(sp, kind, usize::from(gh.gso_size), &mut out, 0)
            .expect("segments");
        again.extend(seg.spans().map(|r| out[r].to_vec()));
    }
    assert_eq!(off, wire.len());
    assert_eq!(frames, done.super_packets);
    // smoltcp sends every packet with IPv4 identification 0 and DF; the
    // segments get the first one's plus their index (RFC 6864 §4.1: an
    // atomic datagram's identification means nothing). All else is equal.
    let without_id = |p: &Vec<u8>| {
        let mut p = p.clone();
        p[4..6].copy_from_slice(&[0, 0]);
        p[10..12].copy_from_slice(&[0, 0]);
        p
    };
    assert!(
        again
            .iter()
            .map(without_id)
            .eq(packets.iter().map(without_id)),
        "segmenting the GSO frames gives smoltcp's packets back"
    );
}
