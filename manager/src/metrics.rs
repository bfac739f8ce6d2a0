//! Per-session counters, kept by the engine (pure) and logged by the shell at
//! session end.

use std::fmt;

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
             reset_by_laptop={} reset_by_remote={} closed={} idle_expired={} bytes_out={} bytes_in={} \
             udp: flows={} expired={} out={} in={} icmp_errors={} icmp: sent={} replies={} \
             mtu: reassembled={} fragmented={} too_big={} heartbeats={} \
             peer: {}p/{}B limits: refused_cap={} rate_limited={} icmp_rate_limited={} \
             write_queue_full={} drops={}",
            self.packets_from_laptop,
            self.bytes_from_laptop,
            self.packets_to_laptop,
            self.bytes_to_laptop,
            self.tcp_dials,
            self.tcp_connected,
            self.tcp_refused,
            self.tcp_unreachable,
            self.tcp_reset_by_laptop,
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
}
