//! Which packets take the small-packet lane of the data channel (pure, no I/O).
//!
//! A ping, a pure TCP ACK or a small UDP datagram should not wait behind a
//! bulk flow's queued data in the laptop's pump or the manager's intake
//! (docs/queues.md). Both ends pick them with [`is_small`]: such packets are
//! moved ahead of queued bulk packets, so they may overtake earlier packets
//! of other flows, and of their own flow only where that is harmless:
//! TCP segments with payload, FIN or RST never take the lane (a data segment
//! overtaking its own flow's data would look like loss to the receiver), nor
//! do IP fragments. A pure ACK overtaking its flow's data segments carries a
//! newer acknowledgement than they do, which TCP takes as it comes.

/// Largest IP packet that takes the small-packet lane, in bytes.
pub const SMALL_PACKET_MAX: usize = 256;

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;

/// True when the IP packet `ip` takes the small-packet lane: at most
/// [`SMALL_PACKET_MAX`] bytes, not a fragment, and ICMP/ICMPv6, UDP, or TCP
/// without payload, FIN or RST. Anything malformed or unknown is false (it
/// keeps its place in the bulk queue, where the receiver drops it as before).
pub fn is_small(ip: &[u8]) -> bool {
    if ip.is_empty() || ip.len() > SMALL_PACKET_MAX {
        return false;
    }
    let (proto, l4) = match ip[0] >> 4 {
        4 => {
            if ip.len() < 20 {
                return false;
            }
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            // More fragments, or a fragment offset: a fragment.
            let frag = u16::from_be_bytes([ip[6], ip[7]]) & 0x3fff;
            if ihl < 20 || total < ihl || total > ip.len() || frag != 0 {
                return false;
            }
            (ip[9], &ip[ihl..total])
        }
        6 => {
            if ip.len() < 40 {
                return false;
            }
            let payload = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let Some(l4) = ip.get(40..40 + payload) else {
                return false;
            };
            // Extension headers (fragments among them) are not looked into.
            (ip[6], l4)
        }
        _ => return false,
    };
    match proto {
        ICMP | ICMPV6 | UDP => true,
        TCP => {
            if l4.len() < 20 {
                return false;
            }
            let data_offset = usize::from(l4[12] >> 4) * 4;
            data_offset >= 20 && l4.len() == data_offset && l4[13] & (TCP_FIN | TCP_RST) == 0
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(proto: u8, l4: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 20];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
        p[6] = 0x40; // DF
        p[8] = 64;
        p[9] = proto;
        p.extend_from_slice(l4);
        p
    }

    fn v6(next: u8, l4: &[u8]) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x60;
        p[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
        p[6] = next;
        p[7] = 64;
        p.extend_from_slice(l4);
        p
    }

    fn tcp(flags: u8, payload: usize) -> Vec<u8> {
        let mut t = vec![0u8; 20 + payload];
        t[12] = 5 << 4;
        t[13] = flags;
        t
    }

    #[test]
    fn pings_small_datagrams_and_pure_acks_take_the_lane() {
        assert!(is_small(&v4(ICMP, &[8, 0, 0, 0, 0, 1, 0, 1])));
        assert!(is_small(&v4(UDP, &[0u8; 8 + 64])));
        assert!(is_small(&v4(TCP, &tcp(0x10, 0))));
        assert!(is_small(&v4(TCP, &tcp(0x02, 0))), "a SYN");
        assert!(is_small(&v6(ICMPV6, &[128, 0, 0, 0, 0, 1, 0, 1])));
        assert!(is_small(&v6(TCP, &tcp(0x10, 0))));
    }

    #[test]
    fn data_fin_rst_fragments_and_large_packets_keep_their_place() {
        assert!(!is_small(&v4(TCP, &tcp(0x18, 1))), "one byte of data");
        assert!(!is_small(&v4(TCP, &tcp(0x11, 0))), "FIN");
        assert!(!is_small(&v4(TCP, &tcp(0x14, 0))), "RST");
        assert!(!is_small(&v6(TCP, &tcp(0x18, 10))));
        let mut frag = v4(UDP, &[0u8; 16]);
        frag[6] = 0x20; // more fragments
        assert!(!is_small(&frag));
        assert!(!is_small(&v4(UDP, &[0u8; SMALL_PACKET_MAX])), "too large");
        assert!(!is_small(&v4(47, &[0u8; 8])), "GRE: unknown");
    }

    #[test]
    fn malformed_packets_are_not_small() {
        assert!(!is_small(&[]));
        assert!(!is_small(&[0x45; 10]));
        let mut short = v4(TCP, &tcp(0x10, 0));
        short[2..4].copy_from_slice(&200u16.to_be_bytes());
        assert!(!is_small(&short), "total length beyond the packet");
        assert!(!is_small(&v4(TCP, &[0u8; 10])), "truncated TCP header");
        let mut v6_short = v6(UDP, &[0u8; 8]);
        v6_short[4..6].copy_from_slice(&100u16.to_be_bytes());
        assert!(!is_small(&v6_short));
        assert!(!is_small(&[0x75; 60]), "IP version 7");
    }
}
