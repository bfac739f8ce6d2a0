//! The flows of one laptop that the pod's kernel carries (source policies
//! `preserve` and `ebpf-snat`: the manager writes the laptop's packets into
//! the pool TUN instead of terminating them), tracked only so the per-client
//! flow cap and new-flow rate limit apply to them as they do under `snat`.
//! Pure: no I/O, `now` is passed in.
//!
//! A flow is a 5-tuple as seen from the laptop: protocol, destination address,
//! the laptop's port and the destination port (TCP, UDP) or the echo
//! identifier (ICMP echo). The kernel keeps its own connection state
//! (conntrack, or the ebpf-snat table); this table only needs to know when a
//! flow is new and when it is gone, so it follows the laptop's side alone,
//! like a stateful firewall that sees one direction (replies reach the laptop
//! through the pool TUN reader, not through the session's engine):
//! - TCP: a flow whose only segments so far are SYNs expires after
//!   [`TCP_SYN_TIMEOUT`] (a SYN to a closed port is answered by RST from the
//!   destination, which this table never sees); once the laptop sends any
//!   other segment it is established and expires after the engine's TCP idle
//!   timeout; a laptop FIN shortens that to [`TCP_CLOSING_TIMEOUT`], a laptop
//!   RST ends the flow at once.
//! - UDP and ICMP echo: idle timeouts, as the engine's own UDP and ping flows.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::packet::Parsed;

/// A forwarded TCP flow that has seen only SYNs from the laptop is forgotten
/// after this long. Linux conntrack keeps SYN_SENT 120 s
/// (`nf_conntrack_tcp_timeout_syn_sent`); shorter here because a SYN flood
/// against closed ports would otherwise hold the flow cap for two minutes,
/// and a laptop's connect() gives up its retransmitted SYNs after ~2 minutes
/// too, so a late retransmit is simply admitted again.
pub const TCP_SYN_TIMEOUT: Duration = Duration::from_secs(30);

/// A forwarded TCP flow after the laptop's FIN is forgotten after this long
/// idle (Linux conntrack: FIN_WAIT 120 s, TIME_WAIT 120 s; the table only
/// needs the flow until its last segments have passed).
pub const TCP_CLOSING_TIMEOUT: Duration = Duration::from_secs(10);

/// Transport of a forwarded flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Proto {
    Tcp,
    Udp,
    Echo,
}

/// One forwarded flow, from the laptop's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub proto: Proto,
    pub dst: IpAddr,
    /// The laptop's port (TCP, UDP) or echo identifier.
    pub laptop_port: u16,
    /// The destination port (0 for echo).
    pub dst_port: u16,
}

/// What a laptop packet means for its forwarded flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// A TCP SYN without ACK (a connection attempt).
    TcpSyn,
    /// A TCP segment with FIN.
    TcpFin,
    /// A TCP segment with RST.
    TcpRst,
    /// Any other TCP segment.
    TcpOther,
    /// A UDP datagram.
    Udp,
    /// An ICMP echo request.
    Echo,
}

impl Segment {
    fn proto(self) -> Proto {
        match self {
            Segment::TcpSyn | Segment::TcpFin | Segment::TcpRst | Segment::TcpOther => Proto::Tcp,
            Segment::Udp => Proto::Udp,
            Segment::Echo => Proto::Echo,
        }
    }
}

/// The key and meaning of a parsed laptop packet.
pub fn classify(parsed: &Parsed<'_>) -> (FlowKey, Segment) {
    match *parsed {
        Parsed::Tcp(m) => {
            let seg = if m.rst {
                Segment::TcpRst
            } else if m.is_initial_syn() {
                Segment::TcpSyn
            } else if m.fin {
                Segment::TcpFin
            } else {
                Segment::TcpOther
            };
            let key = FlowKey {
                proto: Proto::Tcp,
                dst: m.dst.ip(),
                laptop_port: m.src.port(),
                dst_port: m.dst.port(),
            };
            (key, seg)
        }
        Parsed::Udp { src, dst, .. } => (
            FlowKey {
                proto: Proto::Udp,
                dst: dst.ip(),
                laptop_port: src.port(),
                dst_port: dst.port(),
            },
            Segment::Udp,
        ),
        Parsed::EchoRequest { dst, ident, .. } => (
            FlowKey {
                proto: Proto::Echo,
                dst,
                laptop_port: ident,
                dst_port: 0,
            },
            Segment::Echo,
        ),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TcpPhase {
    Syn,
    Established,
    Closing,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    last_active: Instant,
    /// TCP only.
    phase: TcpPhase,
}

/// Idle timeouts of forwarded flows.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Established TCP flows.
    pub tcp: Duration,
    pub udp: Duration,
    pub echo: Duration,
}

/// The table of one session's forwarded flows.
#[derive(Debug, Default)]
pub struct ForwardedFlows {
    flows: HashMap<FlowKey, Entry>,
}

impl ForwardedFlows {
    /// Live forwarded flows.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// No live forwarded flow.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    /// Whether `key` is a live flow.
    pub fn contains(&self, key: &FlowKey) -> bool {
        self.flows.contains_key(key)
    }

    /// A packet of the live flow `key` (see [`ForwardedFlows::contains`]) or
    /// the first packet of a flow just admitted: refresh it, advance its TCP
    /// phase; a laptop RST ends it.
    pub fn seen(&mut self, key: FlowKey, seg: Segment, now: Instant) {
        debug_assert_eq!(key.proto, seg.proto());
        if seg == Segment::TcpRst {
            self.flows.remove(&key);
            return;
        }
        let entry = self.flows.entry(key).or_insert(Entry {
            last_active: now,
            phase: TcpPhase::Syn,
        });
        entry.last_active = now;
        entry.phase = match (entry.phase, seg) {
            (_, Segment::TcpFin) | (TcpPhase::Closing, _) => TcpPhase::Closing,
            (TcpPhase::Syn, Segment::TcpSyn) => TcpPhase::Syn,
            _ => TcpPhase::Established,
        };
    }

    /// Forget the flows idle at `now`; returns how many, and the earliest
    /// deadline of those left.
    pub fn expire(&mut self, now: Instant, t: Timeouts) -> (usize, Option<Instant>) {
        let before = self.flows.len();
        let mut next: Option<Instant> = None;
        self.flows.retain(|key, e| {
            let idle = match (key.proto, e.phase) {
                (Proto::Tcp, TcpPhase::Syn) => TCP_SYN_TIMEOUT,
                (Proto::Tcp, TcpPhase::Closing) => TCP_CLOSING_TIMEOUT,
                (Proto::Tcp, TcpPhase::Established) => t.tcp,
                (Proto::Udp, _) => t.udp,
                (Proto::Echo, _) => t.echo,
            };
            let deadline = e.last_active + idle;
            let keep = now < deadline;
            if keep {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
            keep
        });
        (before - self.flows.len(), next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts = Timeouts {
        tcp: Duration::from_secs(3600),
        udp: Duration::from_secs(60),
        echo: Duration::from_secs(20),
    };

    fn key(proto: Proto, port: u16) -> FlowKey {
        FlowKey {
            proto,
            dst: IpAddr::from([10, 244, 1, 11]),
            laptop_port: port,
            dst_port: 7,
        }
    }

    #[test]
    fn tcp_phases_set_the_timeout_and_rst_ends_the_flow() {
        let t0 = Instant::now();
        let mut f = ForwardedFlows::default();
        let (syn_only, est, closing, reset) = (
            key(Proto::Tcp, 1),
            key(Proto::Tcp, 2),
            key(Proto::Tcp, 3),
            key(Proto::Tcp, 4),
        );
        for k in [syn_only, est, closing, reset] {
            f.seen(k, Segment::TcpSyn, t0);
        }
        f.seen(syn_only, Segment::TcpSyn, t0); // a retransmit
        f.seen(est, Segment::TcpOther, t0);
        f.seen(closing, Segment::TcpOther, t0);
        f.seen(closing, Segment::TcpFin, t0);
        f.seen(reset, Segment::TcpRst, t0);
        assert_eq!(f.len(), 3, "an RST ends its flow at once");
        let (gone, next) = f.expire(t0 + TCP_CLOSING_TIMEOUT, T);
        assert_eq!(gone, 1, "the closing flow");
        assert!(!f.contains(&closing));
        assert_eq!(next, Some(t0 + TCP_SYN_TIMEOUT));
        assert_eq!(f.expire(t0 + TCP_SYN_TIMEOUT, T).0, 1, "the SYN-only flow");
        assert!(f.contains(&est));
        assert_eq!(f.expire(t0 + T.tcp, T), (1, None), "the established flow");
        assert!(f.is_empty());
    }

    #[test]
    fn datagram_flows_expire_when_idle_and_traffic_refreshes_them() {
        let t0 = Instant::now();
        let mut f = ForwardedFlows::default();
        let (udp, echo) = (key(Proto::Udp, 5000), key(Proto::Echo, 77));
        f.seen(udp, Segment::Udp, t0);
        f.seen(echo, Segment::Echo, t0);
        f.seen(udp, Segment::Udp, t0 + Duration::from_secs(30));
        assert_eq!(f.expire(t0 + T.echo, T).0, 1);
        assert!(f.contains(&udp) && !f.contains(&echo));
        assert_eq!(f.expire(t0 + T.udp, T).0, 0, "refreshed at 30 s");
        assert_eq!(f.expire(t0 + Duration::from_secs(90), T), (1, None));
    }
}
