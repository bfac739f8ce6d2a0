//! Address rewriting with incremental checksum updates, shared by the SNAT programs
//! ([`crate::snat`]) and steering ([`crate::steer`]): `bpf_l3_csum_replace` for the
//! IPv4 header checksum and `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR` for the
//! TCP/UDP checksum's pseudo-header part (RFC 1624 incremental update, done by the
//! kernel helpers). A zero UDP checksum ("none", RFC 768) stays zero
//! (`BPF_F_MARK_MANGLED_0`); ICMP has no pseudo-header (RFC 792), so an address
//! change leaves its checksum alone.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};

const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;

/// Offset of the L4 checksum for a header at `l4`, and the `bpf_l4_csum_replace` flags
/// every update of it needs: TCP at 16, UDP at 6 (zero stays zero), anything else (the
/// ICMP checksum) at 2.
#[inline(always)]
pub fn l4_checksum(protocol: u8, l4: usize) -> (usize, u64) {
    match protocol {
        PROTO_TCP => (l4 + 16, 0),
        PROTO_UDP => (l4 + 6, u64::from(BPF_F_MARK_MANGLED_0)),
        _ => (l4 + 2, 0),
    }
}

/// Stores `new` over the IPv4 address at `addr_off` (which holds `old`, both known to
/// lie in the packet) and updates the IPv4 header checksum at `ip_csum_off` and, for
/// TCP/UDP whose header is in this packet (`l4` is `None` for a later fragment), the L4
/// checksum.
#[inline(always)]
pub fn rewrite_ipv4_addr(
    ctx: &TcContext,
    ip_csum_off: usize,
    addr_off: usize,
    protocol: u8,
    l4: Option<usize>,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), i64> {
    let old_v = u64::from(u32::from_ne_bytes(old));
    let new_v = u64::from(u32::from_ne_bytes(new));
    ctx.store(addr_off, &new, 0)?;
    ctx.l3_csum_replace(ip_csum_off, old_v, new_v, 4)?;
    match (protocol, l4) {
        (PROTO_TCP | PROTO_UDP, Some(l4)) => {
            let (csum_off, flags) = l4_checksum(protocol, l4);
            ctx.l4_csum_replace(
                csum_off,
                old_v,
                new_v,
                flags | u64::from(BPF_F_PSEUDO_HDR) | 4,
            )
        }
        _ => Ok(()),
    }
}
