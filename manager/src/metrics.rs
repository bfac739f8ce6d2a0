//! Counters. [`Metrics`]: one client session's, kept by the engine (pure) and
//! logged by the shell at session end. [`ManagerCounters`]: the manager's own,
//! over all sessions and the gRPC API (atomics shared by every task), served
//! in the Prometheus text format by [`crate::metrics_server`]; among them the
//! refusals of the isolation checks (docs/trust-model.md).

use std::fmt;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::packet::DropReason;

/// Counters of one client session. Packets and bytes are IP packets (frame
/// headers excluded); "from the laptop" is outbound (towards the cluster).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metrics {
    /// IP packets received from the laptop.
    pub packets_from_laptop: u64,
    /// Bytes of those packets.
    pub bytes_from_laptop: u64,
    /// IP packets sent to the laptop.
    pub packets_to_laptop: u64,
    /// Bytes of those packets.
    pub bytes_to_laptop: u64,
    /// Packets dropped, by reason (indexed like [`DropReason::ALL`]).
    pub drops: [u64; DropReason::ALL.len()],
    /// TCP dials started (one per new SYN).
    pub tcp_dials: u64,
    /// TCP dials that connected.
    pub tcp_connected: u64,
    /// TCP dials refused (answered with RST).
    pub tcp_refused: u64,
    /// TCP dials that timed out or had no route (answered with ICMP host unreachable).
    pub tcp_unreachable: u64,
    /// TCP flows reset by the laptop.
    pub tcp_reset_by_laptop: u64,
    /// TCP flows a laptop SYN for a new connection on the same 4-tuple replaced
    /// (the laptop's RST for the old one never arrived).
    pub tcp_replaced_by_syn: u64,
    /// TCP flows reset by the real destination.
    pub tcp_reset_by_remote: u64,
    /// TCP flows that ended with FIN both ways.
    pub tcp_closed: u64,
    /// TCP payload bytes relayed laptop -> destination.
    pub tcp_bytes_out: u64,
    /// TCP payload bytes relayed destination -> laptop.
    pub tcp_bytes_in: u64,
    /// UDP flows opened.
    pub udp_flows: u64,
    /// UDP flows closed after the idle timeout.
    pub udp_expired: u64,
    /// UDP datagrams relayed laptop -> destination.
    pub udp_datagrams_out: u64,
    /// UDP datagrams relayed destination -> laptop.
    pub udp_datagrams_in: u64,
    /// ICMP echo requests sent to real destinations.
    pub pings_sent: u64,
    /// ICMP echo replies relayed to the laptop.
    pub ping_replies: u64,
    /// Fragmented datagrams from the laptop reassembled.
    pub datagrams_reassembled: u64,
    /// Packets to the laptop that were fragmented (over the stack MTU).
    pub packets_fragmented: u64,
    /// ICMP "fragmentation needed" / "packet too big" sent to the laptop.
    pub too_big_sent: u64,
    /// ICMP unreachable errors from the cluster relayed for UDP flows.
    pub udp_icmp_errors: u64,
    /// TCP flows reset after the idle timeout.
    pub tcp_idle_expired: u64,
    /// Heartbeat frames echoed (counted by the shell).
    pub heartbeats: u64,
    /// Packets forwarded to another laptop's session (laptop-to-laptop,
    /// counted by the shell; not in `packets_from_laptop`).
    pub peer_packets: u64,
    /// Bytes of those packets.
    pub peer_bytes: u64,
    /// New flows refused because the session was at its flow cap (also
    /// counted as `drop_too_many_flows`).
    pub flows_refused_cap: u64,
    /// New flows dropped by the new-flow rate limit (first packet dropped;
    /// TCP retransmits its SYN).
    pub flows_rate_limited: u64,
    /// ICMP errors (and flow-cap RSTs) not sent because of the ICMP error
    /// rate limit.
    pub icmp_rate_limited: u64,
    /// Times the session loop waited because the writer's queue towards the
    /// laptop was full (backpressure; counted by the shell).
    pub write_queue_full: u64,
    /// Heartbeat echoes dropped because the control queue towards the laptop
    /// was full (the laptop stopped reading; counted by the shell).
    pub echoes_dropped: u64,
    /// Most kernel TCP events queued for the engine at once (the channel's
    /// high-water mark; see docs/queues.md; measured by the shell).
    pub tcp_events_peak: u64,
    /// Times a TCP flow's task found the session's TCP event queue full
    /// (`kernel::TCP_EVENT_QUEUE` events) and waited (counted by the shell's
    /// kernel side).
    pub tcp_events_full: u64,
    /// Flows admitted into the pod's kernel (source policies `preserve`,
    /// `ebpf-snat`; see [`crate::forwarded`]).
    pub forwarded_flows: u64,
    /// GSO frames (frame kind 5: TCP super-packets) from the laptop that were
    /// segmented (counted by the shell).
    pub gso_frames: u64,
    /// Packets those GSO frames were segmented into (each also counted in
    /// `packets_from_laptop` or as a peer / pool-TUN packet).
    pub gso_segments: u64,
    /// GSO frames (frame kind 5) sent to a laptop that accepted offload bit 2
    /// (`OFFLOAD_TCP_GRO`): runs of one TCP flow's segments merged.
    pub gro_frames: u64,
    /// Packets merged into those GSO frames (each also counted in
    /// `packets_to_laptop`).
    pub gro_segments: u64,
}

impl Metrics {
    /// Count one dropped packet.
    pub fn drop_packet(&mut self, reason: DropReason) {
        if let Some(i) = DropReason::ALL.iter().position(|r| *r == reason) {
            self.drops[i] += 1;
        }
    }

    /// Packets dropped for `reason`.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.drops[i])
    }

    /// All dropped packets.
    pub fn dropped_total(&self) -> u64 {
        self.drops.iter().sum()
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "from_laptop={}p/{}B to_laptop={}p/{}B tcp: dials={} connected={} refused={} unreachable={} \
             reset_by_laptop={} replaced_by_syn={} reset_by_remote={} closed={} idle_expired={} bytes_out={} bytes_in={} \
             udp: flows={} expired={} out={} in={} icmp_errors={} icmp: sent={} replies={} \
             forwarded: flows={} \
             mtu: reassembled={} fragmented={} too_big={} heartbeats={} \
             peer: {}p/{}B limits: refused_cap={} rate_limited={} icmp_rate_limited={} \
             write_queue_full={} echoes_dropped={} tcp_events_peak={} tcp_events_full={} gso: frames={} segments={} gro: frames={} segments={} drops={}",
            self.packets_from_laptop,
            self.bytes_from_laptop,
            self.packets_to_laptop,
            self.bytes_to_laptop,
            self.tcp_dials,
            self.tcp_connected,
            self.tcp_refused,
            self.tcp_unreachable,
            self.tcp_reset_by_laptop,
            self.tcp_replaced_by_syn,
            self.tcp_reset_by_remote,
            self.tcp_closed,
            self.tcp_idle_expired,
            self.tcp_bytes_out,
            self.tcp_bytes_in,
            self.udp_flows,
            self.udp_expired,
            self.udp_datagrams_out,
            self.udp_datagrams_in,
            self.udp_icmp_errors,
            self.pings_sent,
            self.ping_replies,
            self.forwarded_flows,
            self.datagrams_reassembled,
            self.packets_fragmented,
            self.too_big_sent,
            self.heartbeats,
            self.peer_packets,
            self.peer_bytes,
            self.flows_refused_cap,
            self.flows_rate_limited,
            self.icmp_rate_limited,
            self.write_queue_full,
            self.echoes_dropped,
            self.tcp_events_peak,
            self.tcp_events_full,
            self.gso_frames,
            self.gso_segments,
            self.gro_frames,
            self.gro_segments,
            self.dropped_total(),
        )?;
        for (reason, n) in DropReason::ALL.iter().zip(self.drops) {
            if n > 0 {
                write!(f, " drop_{}={}", reason.as_str(), n)?;
            }
        }
        Ok(())
    }
}

/// Why a data channel was refused before its session started (label `reason`
/// of `kvpn_manager_refused_hello_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloRefusal {
    /// The TLS handshake failed (wrong CA, a plaintext client) or timed out.
    Tls,
    /// No hello within the hello timeout.
    Timeout,
    /// The first frame was not a hello.
    NotHello,
    /// The first frame or the hello payload could not be decoded.
    Malformed,
    /// Another data-channel protocol version.
    Version,
    /// The hello's tunnel IP cannot be a laptop's (multicast, loopback, ...).
    BadTunnelIp,
    /// No unexpired lease for the hello's tunnel IP.
    NoLease,
    /// The hello's session token is not its tunnel IP's lease's token
    /// (missing, guessed, or another client's).
    WrongToken,
}

impl HelloRefusal {
    /// Every reason, for iterating counters.
    pub const ALL: [HelloRefusal; 8] = [
        HelloRefusal::Tls,
        HelloRefusal::Timeout,
        HelloRefusal::NotHello,
        HelloRefusal::Malformed,
        HelloRefusal::Version,
        HelloRefusal::BadTunnelIp,
        HelloRefusal::NoLease,
        HelloRefusal::WrongToken,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            HelloRefusal::Tls => "tls",
            HelloRefusal::Timeout => "timeout",
            HelloRefusal::NotHello => "not_hello",
            HelloRefusal::Malformed => "malformed",
            HelloRefusal::Version => "version",
            HelloRefusal::BadTunnelIp => "bad_tunnel_ip",
            HelloRefusal::NoLease => "no_lease",
            HelloRefusal::WrongToken => "wrong_token",
        }
    }
}

/// Why a `Lease` call was refused (label `reason` of
/// `kvpn_manager_lease_denied_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseDenial {
    /// The client id is not 1..=128 characters of `[A-Za-z0-9._-]`.
    BadClientId,
    /// Every address of the tunnel pool is leased.
    PoolExhausted,
    /// The lease store (ConfigMap) failed.
    StoreUnavailable,
}

impl LeaseDenial {
    /// Every reason, for iterating counters.
    pub const ALL: [LeaseDenial; 3] = [
        LeaseDenial::BadClientId,
        LeaseDenial::PoolExhausted,
        LeaseDenial::StoreUnavailable,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            LeaseDenial::BadClientId => "bad_client_id",
            LeaseDenial::PoolExhausted => "pool_exhausted",
            LeaseDenial::StoreUnavailable => "store_unavailable",
        }
    }
}

/// The manager's counters over all sessions (monotonic unless noted).
/// Updated with relaxed atomics: each is an independent count.
#[derive(Debug, Default)]
pub struct ManagerCounters {
    sessions_accepted: AtomicU64,
    sessions_active: AtomicU64,
    refused_hello: [AtomicU64; HelloRefusal::ALL.len()],
    drops: [AtomicU64; DropReason::ALL.len()],
    echoes_dropped: AtomicU64,
    tcp_events_full: AtomicU64,
    gso_frames: AtomicU64,
    gso_segments: AtomicU64,
    gro_frames: AtomicU64,
    gro_segments: AtomicU64,
    leases_granted: AtomicU64,
    lease_denied: [AtomicU64; LeaseDenial::ALL.len()],
    /// Engines parked now, waiting for their connection to resume.
    engines_parked: AtomicU64,
    /// Connections that ended and parked their engine (total).
    engines_parked_total: AtomicU64,
    /// Connections that re-attached a parked engine (total).
    engines_resumed: AtomicU64,
    /// Parked engines dropped unresumed: grace over, replaced, or over the cap.
    engines_expired: AtomicU64,
    /// Parked engines dropped because a newer session of their lease's
    /// tunnel IP came for the same worker (also in `engines_expired`).
    engines_replaced: AtomicU64,
    /// `ebpf-snat` is on: its metrics are rendered.
    snat_on: std::sync::atomic::AtomicBool,
    /// `ebpf-snat`, as of the sweeper's last round: flows in the forward table,
    /// entries in the reverse table, packets out/in, flows, exhausted, untranslatable,
    /// expired (total), ICMP errors translated back.
    snat: [AtomicU64; 9],
}

fn index_of<T: PartialEq>(all: &[T], x: &T) -> usize {
    // Cannot miss: every enum value is in its ALL list (unit tests check).
    all.iter().position(|y| y == x).unwrap_or(0)
}

/// A session's drops (and dropped echoes) already added to
/// [`ManagerCounters`]; see [`ManagerCounters::add_drops`].
#[derive(Debug, Clone, Default)]
pub struct DropsSynced {
    drops: [u64; DropReason::ALL.len()],
    echoes_dropped: u64,
    tcp_events_full: u64,
    gso_frames: u64,
    gso_segments: u64,
    gro_frames: u64,
    gro_segments: u64,
}

impl ManagerCounters {
    /// A hello (and its token) was accepted: a session starts.
    pub fn session_started(&self) {
        self.sessions_accepted.fetch_add(1, Ordering::Relaxed);
        self.sessions_active.fetch_add(1, Ordering::Relaxed);
    }

    /// A session that [`ManagerCounters::session_started`] ended.
    pub fn session_ended(&self) {
        // Never below zero, even if a caller pairs them wrongly.
        let _ = self
            .sessions_active
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// A connection that ended parked its engine for a resume.
    pub fn engine_parked(&self) {
        self.engines_parked_total.fetch_add(1, Ordering::Relaxed);
        self.engines_parked.fetch_add(1, Ordering::Relaxed);
    }

    /// A parked engine left the park: re-attached (`resumed`) or dropped.
    pub fn engine_unparked(&self, resumed: bool) {
        let _ = self
            .engines_parked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if resumed {
            self.engines_resumed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.engines_expired.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A parked engine was dropped for a newer session of its tunnel IP
    /// ([`crate::resume`]); [`ManagerCounters::engine_unparked`] counts it too.
    pub fn engine_replaced(&self) {
        self.engines_replaced.fetch_add(1, Ordering::Relaxed);
    }

    /// A data channel was refused before its session started.
    pub fn refuse_hello(&self, why: HelloRefusal) {
        self.refused_hello[index_of(&HelloRefusal::ALL, &why)].fetch_add(1, Ordering::Relaxed);
    }

    /// A `Lease` call was granted.
    pub fn lease_granted(&self) {
        self.leases_granted.fetch_add(1, Ordering::Relaxed);
    }

    /// A `Lease` call was refused.
    pub fn deny_lease(&self, why: LeaseDenial) {
        self.lease_denied[index_of(&LeaseDenial::ALL, &why)].fetch_add(1, Ordering::Relaxed);
    }

    /// Add the drops `session` counted since the last call with the same
    /// `synced` (the session shell calls this every round, so the manager's
    /// totals lag a session's by at most one round).
    pub fn add_drops(&self, session: &Metrics, synced: &mut DropsSynced) {
        for (i, (now, before)) in session
            .drops
            .iter()
            .zip(synced.drops.iter_mut())
            .enumerate()
        {
            if *now > *before {
                self.drops[i].fetch_add(*now - *before, Ordering::Relaxed);
                *before = *now;
            }
        }
        let sync = |total: &AtomicU64, now: u64, before: &mut u64| {
            if now > *before {
                total.fetch_add(now - *before, Ordering::Relaxed);
                *before = now;
            }
        };
        sync(
            &self.echoes_dropped,
            session.echoes_dropped,
            &mut synced.echoes_dropped,
        );
        sync(
            &self.tcp_events_full,
            session.tcp_events_full,
            &mut synced.tcp_events_full,
        );
        sync(&self.gso_frames, session.gso_frames, &mut synced.gso_frames);
        sync(
            &self.gso_segments,
            session.gso_segments,
            &mut synced.gso_segments,
        );
        sync(&self.gro_frames, session.gro_frames, &mut synced.gro_frames);
        sync(
            &self.gro_segments,
            session.gro_segments,
            &mut synced.gro_segments,
        );
    }

    /// Waits on a full TCP event queue, all sessions.
    pub fn tcp_events_full(&self) -> u64 {
        self.tcp_events_full.load(Ordering::Relaxed)
    }

    /// GSO frames segmented and the packets they became, all sessions.
    pub fn gso(&self) -> (u64, u64) {
        (
            self.gso_frames.load(Ordering::Relaxed),
            self.gso_segments.load(Ordering::Relaxed),
        )
    }

    /// Heartbeat echoes dropped, all sessions.
    pub fn echoes_dropped(&self) -> u64 {
        self.echoes_dropped.load(Ordering::Relaxed)
    }

    /// Refused data channels for `why`.
    pub fn refused_hello(&self, why: HelloRefusal) -> u64 {
        self.refused_hello[index_of(&HelloRefusal::ALL, &why)].load(Ordering::Relaxed)
    }

    /// Packets dropped for `why`, all sessions.
    pub fn dropped(&self, why: DropReason) -> u64 {
        self.drops[index_of(&DropReason::ALL, &why)].load(Ordering::Relaxed)
    }

    /// Refused `Lease` calls for `why`.
    pub fn lease_denied(&self, why: LeaseDenial) -> u64 {
        self.lease_denied[index_of(&LeaseDenial::ALL, &why)].load(Ordering::Relaxed)
    }

    /// `ebpf-snat` is attached: render its metrics from now on.
    pub fn snat_enable(&self) {
        self.snat_on.store(true, Ordering::Relaxed);
    }

    /// The ebpf-snat sweeper's round: the kernel's counters and table sizes, and
    /// `expired` more flows removed.
    pub fn snat_update(&self, stats: &kvpn_ebpf::snat::SnatStats, expired: u64) {
        let values = [
            stats.forward_entries as u64,
            stats.reverse_entries as u64,
            stats.translated_out.packets,
            stats.translated_in.packets,
            stats.new_flows.packets,
            stats.ports_exhausted.packets,
            stats.untranslatable.packets,
        ];
        for (slot, v) in self.snat.iter().zip(values) {
            slot.store(v, Ordering::Relaxed);
        }
        self.snat[7].fetch_add(expired, Ordering::Relaxed);
        self.snat[8].store(stats.icmp_errors_in.packets, Ordering::Relaxed);
    }

    /// The counters in the Prometheus text exposition format (version 0.0.4):
    /// each metric's HELP and TYPE lines, then its samples.
    pub fn render_prometheus(&self) -> String {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(Option<&str>, u64)]| {
            let _ = writeln!(out, "# HELP kvpn_manager_{name} {help}");
            let _ = writeln!(out, "# TYPE kvpn_manager_{name} {kind}");
            for (reason, n) in samples {
                match reason {
                    Some(r) => {
                        let _ = writeln!(out, "kvpn_manager_{name}{{reason=\"{r}\"}} {n}");
                    }
                    None => {
                        let _ = writeln!(out, "kvpn_manager_{name} {n}");
                    }
                }
            }
        };
        metric(
            "sessions_accepted_total",
            "counter",
            "Data channels whose hello (and session token) were accepted.",
            &[(None, load(&self.sessions_accepted))],
        );
        metric(
            "sessions_active",
            "gauge",
            "Data-channel sessions running now.",
            &[(None, load(&self.sessions_active))],
        );
        metric(
            "engines_parked",
            "gauge",
            "Engines of ended data connections kept for a resume now.",
            &[(None, load(&self.engines_parked))],
        );
        metric(
            "engines_parked_total",
            "counter",
            "Data connections that ended and parked their engine for a resume.",
            &[(None, load(&self.engines_parked_total))],
        );
        metric(
            "engines_resumed_total",
            "counter",
            "Data connections that re-attached a parked engine (their flows survived the re-dial).",
            &[(None, load(&self.engines_resumed))],
        );
        metric(
            "engines_expired_total",
            "counter",
            "Parked engines dropped without a resume (grace over, replaced, or over the cap).",
            &[(None, load(&self.engines_expired))],
        );
        metric(
            "engines_replaced_total",
            "counter",
            "Parked engines dropped because a newer session of their tunnel IP (another lease token, or the same lease with another resume token) connected the same worker.",
            &[(None, load(&self.engines_replaced))],
        );
        let refused: Vec<_> = HelloRefusal::ALL
            .iter()
            .zip(&self.refused_hello)
            .map(|(why, n)| (Some(why.as_str()), load(n)))
            .collect();
        metric(
            "refused_hello_total",
            "counter",
            "Data channels refused before their session started, by reason.",
            &refused,
        );
        metric(
            "spoofed_source_dropped_total",
            "counter",
            "Packets from a laptop whose source is not its session's tunnel IP, dropped (also in packets_dropped_total{reason=\"bad_source\"}).",
            &[(None, self.dropped(DropReason::BadSource))],
        );
        let drops: Vec<_> = DropReason::ALL
            .iter()
            .zip(&self.drops)
            .map(|(why, n)| (Some(why.as_str()), load(n)))
            .collect();
        metric(
            "packets_dropped_total",
            "counter",
            "Packets from laptops dropped by the manager, all sessions, by reason.",
            &drops,
        );
        metric(
            "heartbeat_echoes_dropped_total",
            "counter",
            "Heartbeat echoes not sent because a session's control queue towards its laptop was full (the laptop stopped reading), all sessions.",
            &[(None, load(&self.echoes_dropped))],
        );
        metric(
            "tcp_event_queue_full_total",
            "counter",
            "Times a destination TCP socket's task found its session's TCP event queue full and waited, all sessions.",
            &[(None, load(&self.tcp_events_full))],
        );
        metric(
            "gso_frames_total",
            "counter",
            "GSO frames (TCP super-packets, frame kind 5) from laptops that the manager segmented, all sessions.",
            &[(None, load(&self.gso_frames))],
        );
        metric(
            "gso_segments_total",
            "counter",
            "Packets the manager cut those GSO frames into, all sessions.",
            &[(None, load(&self.gso_segments))],
        );
        metric(
            "gro_frames_total",
            "counter",
            "GSO frames (runs of one TCP flow's segments merged) the manager sent to laptops that accepted them, all sessions.",
            &[(None, load(&self.gro_frames))],
        );
        metric(
            "gro_segments_total",
            "counter",
            "Packets merged into those GSO frames, all sessions.",
            &[(None, load(&self.gro_segments))],
        );
        metric(
            "leases_granted_total",
            "counter",
            "Lease calls answered with a lease (new or existing).",
            &[(None, load(&self.leases_granted))],
        );
        let denied: Vec<_> = LeaseDenial::ALL
            .iter()
            .zip(&self.lease_denied)
            .map(|(why, n)| (Some(why.as_str()), load(n)))
            .collect();
        metric(
            "lease_denied_total",
            "counter",
            "Lease calls refused, by reason.",
            &denied,
        );
        if self.snat_on.load(Ordering::Relaxed) {
            let snat = |i: usize| load(&self.snat[i]);
            for (i, name, kind, help) in [
                (
                    0,
                    "ebpf_snat_flows",
                    "gauge",
                    "ebpf-snat: flows in the forward connection table (as of the last sweep).",
                ),
                (
                    1,
                    "ebpf_snat_reverse_entries",
                    "gauge",
                    "ebpf-snat: entries in the reverse connection table (as of the last sweep).",
                ),
                (
                    2,
                    "ebpf_snat_translated_out_total",
                    "counter",
                    "ebpf-snat: laptop packets whose source was rewritten to the pod IP.",
                ),
                (
                    3,
                    "ebpf_snat_translated_in_total",
                    "counter",
                    "ebpf-snat: replies rewritten back to a tunnel IP.",
                ),
                (
                    4,
                    "ebpf_snat_new_flows_total",
                    "counter",
                    "ebpf-snat: flows that were allocated a port.",
                ),
                (
                    5,
                    "ebpf_snat_ports_exhausted_total",
                    "counter",
                    "ebpf-snat: new flows dropped because no port was free for their destination.",
                ),
                (
                    6,
                    "ebpf_snat_untranslatable_total",
                    "counter",
                    "ebpf-snat: packets from the tunnel pool dropped as untranslatable (protocols other than TCP, UDP, ICMP echo; ICMP errors from a laptop; fragments of other protocols).",
                ),
                (
                    7,
                    "ebpf_snat_expired_total",
                    "counter",
                    "ebpf-snat: idle flows the sweeper removed.",
                ),
                (
                    8,
                    "ebpf_snat_icmp_errors_in_total",
                    "counter",
                    "ebpf-snat: ICMP errors (unreachable, time exceeded, parameter problem) about a translated flow, rewritten back to the laptop.",
                ),
            ] {
                metric(name, kind, help, &[(None, snat(i))]);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_are_counted_by_reason() {
        let mut m = Metrics::default();
        m.drop_packet(DropReason::BadSource);
        m.drop_packet(DropReason::BadSource);
        m.drop_packet(DropReason::Fragment);
        assert_eq!(m.dropped(DropReason::BadSource), 2);
        assert_eq!(m.dropped(DropReason::Fragment), 1);
        assert_eq!(m.dropped(DropReason::Malformed), 0);
        assert_eq!(m.dropped_total(), 3);
        let s = m.to_string();
        assert!(s.contains("drop_bad_source=2"), "{s}");
        assert!(!s.contains("drop_malformed"), "{s}");
    }

    #[test]
    fn manager_counters_render_every_reason() {
        let c = ManagerCounters::default();
        c.session_started();
        c.session_started();
        c.session_ended();
        c.refuse_hello(HelloRefusal::WrongToken);
        c.refuse_hello(HelloRefusal::WrongToken);
        c.refuse_hello(HelloRefusal::Tls);
        c.deny_lease(LeaseDenial::BadClientId);
        c.lease_granted();
        let mut session = Metrics::default();
        let mut synced = DropsSynced::default();
        session.drop_packet(DropReason::BadSource);
        c.add_drops(&session, &mut synced);
        session.drop_packet(DropReason::BadSource);
        session.drop_packet(DropReason::ForbiddenDestination);
        session.echoes_dropped = 3;
        session.tcp_events_full = 4;
        session.gso_frames = 2;
        session.gso_segments = 14;
        session.gro_frames = 5;
        session.gro_segments = 40;
        c.add_drops(&session, &mut synced);
        c.add_drops(&session, &mut synced);
        assert_eq!(c.dropped(DropReason::BadSource), 2, "each drop added once");
        assert_eq!(c.echoes_dropped(), 3, "each dropped echo added once");
        assert_eq!(c.tcp_events_full(), 4, "each wait added once");
        let text = c.render_prometheus();
        for line in [
            "kvpn_manager_sessions_accepted_total 2",
            "kvpn_manager_sessions_active 1",
            "kvpn_manager_refused_hello_total{reason=\"wrong_token\"} 2",
            "kvpn_manager_refused_hello_total{reason=\"tls\"} 1",
            "kvpn_manager_refused_hello_total{reason=\"no_lease\"} 0",
            "kvpn_manager_spoofed_source_dropped_total 2",
            "kvpn_manager_packets_dropped_total{reason=\"bad_source\"} 2",
            "kvpn_manager_packets_dropped_total{reason=\"forbidden_destination\"} 1",
            "kvpn_manager_leases_granted_total 1",
            "kvpn_manager_heartbeat_echoes_dropped_total 3",
            "kvpn_manager_tcp_event_queue_full_total 4",
            "kvpn_manager_gso_frames_total 2",
            "kvpn_manager_gso_segments_total 14",
            "kvpn_manager_gro_frames_total 5",
            "kvpn_manager_gro_segments_total 40",
            "kvpn_manager_lease_denied_total{reason=\"bad_client_id\"} 1",
            "# TYPE kvpn_manager_sessions_active gauge",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        c.session_ended();
        c.session_ended();
        assert!(
            c.render_prometheus()
                .contains("kvpn_manager_sessions_active 0\n")
        );
    }

    /// docs/metrics.md documents every metric the endpoint emits — name, type and
    /// each `reason` value — and nothing it no longer emits, so the page cannot drift.
    #[test]
    fn every_emitted_metric_is_documented_in_docs_metrics_md() {
        let doc = include_str!("../../docs/metrics.md");
        let c = ManagerCounters::default();
        c.snat_enable();
        let text = c.render_prometheus();
        let mut emitted = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
                let row = doc
                    .lines()
                    .find(|l| l.starts_with(&format!("| `{name}` |")))
                    .unwrap_or_else(|| panic!("{name} is not a row of docs/metrics.md"));
                assert!(
                    row.contains(&format!("| {kind} |")),
                    "docs/metrics.md: {name} must say its type {kind}: {row}"
                );
                emitted.push(name.to_owned());
            } else if let Some((name, label)) = line
                .split_once("{reason=\"")
                .filter(|_| !line.starts_with('#'))
            {
                let reason = label.split('"').next().unwrap_or_default();
                let row = doc
                    .lines()
                    .find(|l| l.starts_with(&format!("| `{name}` |")))
                    .unwrap_or_else(|| panic!("{name} is not a row of docs/metrics.md"));
                assert!(
                    row.contains("| `reason` |") && row.contains(&format!("`{reason}`")),
                    "docs/metrics.md: {name} must list reason {reason:?}: {row}"
                );
            }
        }
        assert!(emitted.len() >= 16, "rendered: {emitted:?}");
        for row in doc.lines().filter(|l| l.starts_with("| `kvpn_manager_")) {
            let name = row.split('`').nth(1).unwrap_or_default();
            assert!(
                emitted.iter().any(|e| e == name),
                "docs/metrics.md documents {name}, which the manager no longer emits"
            );
        }
    }
}
