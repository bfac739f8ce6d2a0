//! Steering for the route-conflict override (case rt-05, `kvpn connect
//! --allow-route-conflict --steer ebpf`): when a laptop route the kernel consults
//! before kvpn's (another VPN's `ip rule ... lookup 100` ahead of the main table)
//! sends cluster-bound packets out of another device, [`kvpn_steer`] on that device's
//! TC egress takes back the IPv4 packets whose destination is in the session's route
//! trie ([`crate::maps::KVPN_ROUTES_V4`], the classifier's): it rewrites the source
//! to the session's tunnel IP (the traffic manager accepts no other source), remembers
//! the original source in [`KVPN_STEER_CT`] by the reply's view of the flow, and
//! `bpf_redirect`s the packet to the TUN device's egress, where the pump reads it.
//! The reply arrives on the TUN's ingress, where the anti-spoofing check
//! ([`crate::tun_ingress`]) calls [`reverse`] to rewrite its destination (tunnel IP)
//! back to the original source.
//!
//! Only the source address changes, never a port, so the key of a flow is (protocol,
//! cluster address, cluster port, laptop port; ICMP echo: the identifier). Two
//! laptop addresses using one port toward one cluster endpoint at once share a key:
//! the later one wins. Entries are evicted by the LRU, never swept: a stale one only
//! matters to a reply nobody waits for.
//!
//! Packets it cannot track (not TCP, UDP or ICMP echo request; a non-first fragment;
//! a full insert) are left to the laptop's route and counted as `STEER_NO_CONNTRACK`;
//! a packet whose source already is the tunnel IP is redirected without rewrite.
//! IPv6 is not steered (passes untouched).
//!
//! Checksums by [`crate::csum`] (shared with [`crate::snat`]): `bpf_l3_csum_replace` for the IPv4 header,
//! `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR` for TCP/UDP (a zero UDP checksum
//! stays zero, `BPF_F_MARK_MANGLED_0`), nothing for ICMP (no pseudo-header, RFC 792).
//! A locally generated packet may still carry CHECKSUM_PARTIAL here; the pseudo-header
//! update is what the kernel expects of it then, and the TUN device (no checksum
//! offload) completes it in `validate_xmit_skb`.
//!
//! Redirect: `bpf_redirect(tun_ifindex, 0)` returns `TC_ACT_REDIRECT` (= TCX_REDIRECT);
//! the kernel pulls an Ethernet header off when the target (the TUN, ARPHRD_NONE) has
//! none (`__bpf_redirect_no_mac`, net/core/filter.c) and transmits on the TUN, where
//! the classifier counts the packet like any other.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_redirect,
    macros::{classifier, map},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, lpm_trie::Key},
    programs::TcContext,
};
use kvpn_dataplane_common::{
    CounterValue, Ipv4Prefix, STEER_FAILED, STEER_MAX_DEVICES, STEER_MAX_FLOWS, STEER_NO_CONNTRACK,
    STEER_REVERSED, STEER_SLOTS, STEER_STEERED, SteerConfig, SteerKey,
};

use crate::csum::rewrite_ipv4_addr;
use crate::maps::{KVPN_ROUTES_V4, add};

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];
const PROTO_ICMP: u8 = 1;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

#[map]
pub static KVPN_STEER_CFG: Array<SteerConfig> = Array::with_max_entries(1, 0);

#[map]
pub static KVPN_STEER_DEV: HashMap<u32, u32> = HashMap::with_max_entries(STEER_MAX_DEVICES, 0);

#[map]
pub static KVPN_STEER_CT: LruHashMap<SteerKey, [u8; 4]> =
    LruHashMap::with_max_entries(STEER_MAX_FLOWS, 0);

#[map]
pub static KVPN_STEER_CNT: PerCpuArray<CounterValue> =
    PerCpuArray::with_max_entries(STEER_SLOTS, 0);

/// Why a packet is not steered (or not translated back).
#[derive(Clone, Copy)]
enum Error {
    /// Not for steering (not IPv4, not to a cluster range, steering off): untouched.
    Pass,
    /// Cluster-bound but no connection entry possible: left to the laptop's route.
    NoConntrack,
    /// A rewrite helper failed half-way: the packet is inconsistent, drop it.
    Rewrite,
}

/// The IPv4 packet's fields steering needs.
struct Flow {
    protocol: u8,
    src: [u8; 4],
    dst: [u8; 4],
    /// Offset of the IPv4 header.
    l3: usize,
    /// Offset of the L4 header.
    l4: usize,
    /// TCP/UDP source port, ICMP echo identifier (network order as loaded).
    src_port: u16,
    /// TCP/UDP destination port; 0 for ICMP.
    dst_port: u16,
    /// ICMP type; 0 otherwise.
    icmp_type: u8,
    /// Fragment offset non-zero: no L4 header.
    later_fragment: bool,
}

/// Parses the IPv4 packet at `l3`; `Err(Pass)` for anything else (IPv6 included).
#[inline(always)]
fn flow(ctx: &TcContext, l3: usize) -> Result<Flow, Error> {
    let [
        vihl,
        _tos,
        _l0,
        _l1,
        _id0,
        _id1,
        frag0,
        frag1,
        _ttl,
        protocol,
    ] = ctx.load::<[u8; 10]>(l3).map_err(|_| Error::Pass)?;
    if vihl >> 4 != 4 {
        return Err(Error::Pass);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    if ihl < 20 {
        return Err(Error::Pass);
    }
    let src: [u8; 4] = ctx.load(l3 + 12).map_err(|_| Error::Pass)?;
    let dst: [u8; 4] = ctx.load(l3 + 16).map_err(|_| Error::Pass)?;
    let l4 = l3 + ihl;
    let mut f = Flow {
        protocol,
        src,
        dst,
        l3,
        l4,
        src_port: 0,
        dst_port: 0,
        icmp_type: 0,
        later_fragment: (u16::from(frag0 & 0x1f) << 8 | u16::from(frag1)) != 0,
    };
    if f.later_fragment {
        return Ok(f);
    }
    match protocol {
        PROTO_TCP | PROTO_UDP => {
            if let Ok(ports) = ctx.load::<[u8; 4]>(l4) {
                f.src_port = u16::from_ne_bytes([ports[0], ports[1]]);
                f.dst_port = u16::from_ne_bytes([ports[2], ports[3]]);
            } else {
                f.later_fragment = true;
            }
        }
        PROTO_ICMP => {
            if let Ok(h) = ctx.load::<[u8; 6]>(l4) {
                f.icmp_type = h[0];
                f.src_port = u16::from_ne_bytes([h[4], h[5]]);
            } else {
                f.later_fragment = true;
            }
        }
        _ => {}
    }
    Ok(f)
}

#[inline(always)]
fn count(slot: u32, ctx: &TcContext) {
    if let Some(counter) = KVPN_STEER_CNT.get_ptr_mut(slot) {
        add(counter, u64::from(ctx.len()));
    }
}

/// Rewrites the IPv4 address at `off` (source 12 or destination 16 past the IP header)
/// from `old` to `new` and fixes the IP and L4 checksums.
#[inline(always)]
fn rewrite(ctx: &TcContext, f: &Flow, off: usize, old: [u8; 4], new: [u8; 4]) -> Result<(), Error> {
    let l4 = if f.later_fragment { None } else { Some(f.l4) };
    rewrite_ipv4_addr(ctx, f.l3 + 10, f.l3 + off, f.protocol, l4, old, new)
        .map_err(|_| Error::Rewrite)
}

#[classifier]
pub fn kvpn_steer(ctx: TcContext) -> i32 {
    match try_kvpn_steer(&ctx) {
        Ok(action) => {
            count(STEER_STEERED, &ctx);
            action
        }
        Err(Error::Pass) => PASS,
        Err(Error::NoConntrack) => {
            count(STEER_NO_CONNTRACK, &ctx);
            PASS
        }
        Err(Error::Rewrite) => {
            count(STEER_FAILED, &ctx);
            DROP
        }
    }
}

#[inline(always)]
fn try_kvpn_steer(ctx: &TcContext) -> Result<i32, Error> {
    let cfg = *KVPN_STEER_CFG.get(0).ok_or(Error::Pass)?;
    if cfg.tun_ifindex == 0 {
        return Err(Error::Pass);
    }
    // SAFETY: the context's __sk_buff, valid for the program's run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: a map value read once.
    let l2 = unsafe { KVPN_STEER_DEV.get(&ifindex) }
        .copied()
        .ok_or(Error::Pass)? as usize;
    if l2 >= 2 {
        let ethertype: [u8; 2] = ctx.load(l2 - 2).map_err(|_| Error::Pass)?;
        if ethertype != ETHERTYPE_IPV4 {
            return Err(Error::Pass);
        }
    }
    let f = flow(ctx, l2)?;
    if KVPN_ROUTES_V4
        .get(Key::new(32, Ipv4Prefix { addr: f.dst }))
        .is_none()
    {
        return Err(Error::Pass);
    }
    if f.src != cfg.tunnel_ip {
        let local_port = match f.protocol {
            _ if f.later_fragment => return Err(Error::NoConntrack),
            PROTO_TCP | PROTO_UDP => f.src_port,
            PROTO_ICMP if f.icmp_type == ICMP_ECHO_REQUEST => f.src_port,
            _ => return Err(Error::NoConntrack),
        };
        let key = SteerKey {
            protocol: f.protocol,
            reserved: [0; 3],
            remote: f.dst,
            remote_port: f.dst_port,
            local_port,
        };
        KVPN_STEER_CT
            .insert(&key, &f.src, 0)
            .map_err(|_| Error::NoConntrack)?;
        rewrite(ctx, &f, 12, f.src, cfg.tunnel_ip)?;
    }
    // SAFETY: bpf_redirect has no memory arguments.
    Ok(unsafe { bpf_redirect(cfg.tun_ifindex, 0) } as i32)
}

/// On the TUN's ingress, after the anti-spoofing check passed the packet (IPv4 at
/// `l3`): a reply to the tunnel IP of a steered flow gets its destination rewritten
/// back to the flow's original source. Returns the verdict: `TC_ACT_OK`, or
/// `TC_ACT_SHOT` when a rewrite failed half-way.
#[inline(always)]
pub fn reverse(ctx: &TcContext, l3: usize) -> i32 {
    match try_reverse(ctx, l3) {
        Ok(()) => {
            count(STEER_REVERSED, ctx);
            PASS
        }
        Err(Error::Pass | Error::NoConntrack) => PASS,
        Err(Error::Rewrite) => {
            count(STEER_FAILED, ctx);
            DROP
        }
    }
}

#[inline(always)]
fn try_reverse(ctx: &TcContext, l3: usize) -> Result<(), Error> {
    let cfg = *KVPN_STEER_CFG.get(0).ok_or(Error::Pass)?;
    if cfg.tun_ifindex == 0 {
        return Err(Error::Pass);
    }
    let f = flow(ctx, l3)?;
    if f.dst != cfg.tunnel_ip || f.later_fragment {
        return Err(Error::Pass);
    }
    let (remote_port, local_port) = match f.protocol {
        PROTO_TCP | PROTO_UDP => (f.src_port, f.dst_port),
        PROTO_ICMP if f.icmp_type == ICMP_ECHO_REPLY => (0, f.src_port),
        _ => return Err(Error::Pass),
    };
    let key = SteerKey {
        protocol: f.protocol,
        reserved: [0; 3],
        remote: f.src,
        remote_port,
        local_port,
    };
    // SAFETY: a map value pointer, valid during the program; read once.
    let orig = KVPN_STEER_CT
        .get_ptr(&key)
        .map(|a| unsafe { *a })
        .ok_or(Error::Pass)?;
    rewrite(ctx, &f, 16, f.dst, orig)
}
