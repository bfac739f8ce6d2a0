//! `ebpf-snat`: source NAT of the laptops' packets on the manager pod's egress
//! interface (`eth0`, Ethernet framing), with its own connection table.
//!
//! The manager writes laptop packets into its pool TUN; the pod's kernel forwards
//! them out of `eth0`, where [`kvpn_snat_out`] (TC egress) rewrites the source
//! tunnel IP → pod IP and the source port (ICMP echo: the identifier) → a port from
//! the configured range, allocated per destination so two laptops' flows never share
//! one. Replies come to the pod IP; [`kvpn_snat_in`] (TC ingress) looks up the
//! reverse table and rewrites destination pod IP:port → tunnel IP:original port; the
//! kernel then routes them by its `pool dev kvpn-pool` route into the TUN, where the
//! manager reads them and hands them to their session.
//!
//! Tables (`dataplane-common`): forward (laptop 5-tuple → allocated port) and reverse
//! (reply 5-tuple → tunnel IP and original port), both LRU hashes. A new flow claims
//! its reverse entry with `BPF_NOEXIST`, which makes the port allocation atomic across
//! CPUs; then it writes the forward entry. Each packet stamps `last_ns`; the manager's
//! sweeper deletes pairs idle past their timeout (TCP after FIN/RST and UDP/ICMP: the
//! short one). Checksums are updated incrementally: the IPv4 header with
//! `bpf_l3_csum_replace`, TCP/UDP with `bpf_l4_csum_replace` (the address as part of
//! the pseudo-header, `BPF_F_PSEUDO_HDR`; a zero UDP checksum stays zero,
//! `BPF_F_MARK_MANGLED_0`), ICMP without pseudo-header (RFC 792).
//!
//! ICMP errors about a translated flow (port unreachable, admin-prohibited,
//! fragmentation needed, time exceeded, parameter problem) come to the pod IP and
//! quote the translated header; [`kvpn_snat_in`] finds the flow by that quote and
//! rewrites both the outer destination and the quote back (`translate_icmp_error`),
//! so the laptop's socket gets its ECONNREFUSED / EHOSTUNREACH / PMTU update.
//!
//! IP fragments: the first fragment carries the L4 header and is translated like any
//! packet. Later fragments have no ports: leaving, one from the pool only gets the pod
//! IP as source; arriving, one to the pod IP gets the tunnel IP its first fragment
//! was translated to, remembered by (source, identification, protocol) in
//! `KVPN_SNAT_FRAG` (RFC 791 §3.2). A later fragment that overtakes its first one is
//! not translated (it goes to the pod's stack and is lost with its datagram); and as
//! with any SNAT, two laptops' datagrams to one backend that happen to share an
//! identification collide in the backend's reassembly.
//!
//! Packets from the pool that cannot be translated (other protocols, ICMP other than
//! echo) are dropped and counted: none leaves with a tunnel IP.
//! Everything else (the pod's own traffic) passes untouched. IPv4 only.
//! Header layouts: IPv4 RFC 791 §3.1, TCP RFC 9293 §3.1 (flags byte 13, checksum at
//! 16), UDP RFC 768 (checksum at 6), ICMP echo RFC 792 (checksum at 2, identifier at 4).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_NOEXIST, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::{classifier, map},
    maps::{Array, LruHashMap, PerCpuArray},
    programs::TcContext,
};
use kvpn_dataplane_common::{
    CounterValue, SNAT_ICMP_ERRORS_IN, SNAT_MAX_FLOWS, SNAT_MAX_FRAGMENTED, SNAT_NEW_FLOWS,
    SNAT_PORT_TRIES, SNAT_PORTS_EXHAUSTED, SNAT_SLOTS, SNAT_STATE_CLOSING, SNAT_TRANSLATED_IN,
    SNAT_TRANSLATED_OUT, SNAT_UNTRANSLATABLE, SnatConfig, SnatForward, SnatFragKey, SnatKey,
    SnatReverse,
};

use crate::csum::{l4_checksum, rewrite_ipv4_addr};
use crate::maps::add;

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

const ETH_HDR_LEN: usize = 14;
const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];
const IP_CSUM: usize = ETH_HDR_LEN + 10;
const IP_SRC: usize = ETH_HDR_LEN + 12;
const IP_DST: usize = ETH_HDR_LEN + 16;
const PROTO_ICMP: u8 = 1;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_DEST_UNREACHABLE: u8 = 3;
const ICMP_ECHO_REQUEST: u8 = 8;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETER_PROBLEM: u8 = 12;
/// ICMP error header (type, code, checksum, 4 bytes of type-specific data) before the
/// quoted datagram (RFC 792).
const ICMP_ERROR_HDR_LEN: usize = 8;
/// "More fragments" in the first byte of the flags/offset field (RFC 791).
const IP_MF: u8 = 0x20;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;

#[map]
pub static KVPN_SNAT_FWD: LruHashMap<SnatKey, SnatForward> =
    LruHashMap::with_max_entries(SNAT_MAX_FLOWS, 0);

#[map]
pub static KVPN_SNAT_REV: LruHashMap<SnatKey, SnatReverse> =
    LruHashMap::with_max_entries(SNAT_MAX_FLOWS, 0);

#[map]
pub static KVPN_SNAT_FRAG: LruHashMap<SnatFragKey, [u8; 4]> =
    LruHashMap::with_max_entries(SNAT_MAX_FRAGMENTED, 0);

#[map]
pub static KVPN_SNAT_CFG: Array<SnatConfig> = Array::with_max_entries(1, 0);

#[map]
pub static KVPN_SNAT_CNT: PerCpuArray<CounterValue> = PerCpuArray::with_max_entries(SNAT_SLOTS, 0);

/// The parts of a packet the programs translate.
struct Parsed {
    protocol: u8,
    src: [u8; 4],
    dst: [u8; 4],
    /// Offset of the L4 header.
    l4: usize,
    /// TCP/UDP source port, ICMP identifier (network order as loaded).
    src_port: u16,
    /// TCP/UDP destination port; 0 for ICMP.
    dst_port: u16,
    /// ICMP type; 0 otherwise.
    icmp_type: u8,
    /// TCP FIN or RST set.
    closing: bool,
    /// The first fragment of a fragmented datagram (MF set, offset 0).
    first_fragment: bool,
    /// IP identification (network order as loaded).
    ip_id: u16,
}

/// Why a packet is not translated.
enum Skip {
    /// Not IPv4, or not for the tables: pass untouched.
    Pass,
    /// Cannot be translated (truncated, other protocol).
    Untranslatable,
    /// A non-first fragment: no L4 header; translated by addresses only.
    Fragment {
        src: [u8; 4],
        dst: [u8; 4],
        id: u16,
        protocol: u8,
    },
}

#[inline(always)]
fn parse(ctx: &TcContext) -> Result<Parsed, Skip> {
    let ethertype: [u8; 2] = ctx.load(ETH_HDR_LEN - 2).map_err(|_| Skip::Pass)?;
    if ethertype != ETHERTYPE_IPV4 {
        return Err(Skip::Pass);
    }
    let [vihl, _tos, _l0, _l1, id0, id1, frag0, frag1, _ttl, protocol] =
        ctx.load::<[u8; 10]>(ETH_HDR_LEN).map_err(|_| Skip::Pass)?;
    let src: [u8; 4] = ctx.load(IP_SRC).map_err(|_| Skip::Pass)?;
    let dst: [u8; 4] = ctx.load(IP_DST).map_err(|_| Skip::Pass)?;
    if vihl >> 4 != 4 {
        return Err(Skip::Pass);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    if ihl < 20 {
        return Err(Skip::Untranslatable);
    }
    let ip_id = u16::from_ne_bytes([id0, id1]);
    // Fragment offset (13 bits) non-zero: no L4 header to translate by.
    if (u16::from(frag0 & 0x1f) << 8 | u16::from(frag1)) != 0 {
        return Err(Skip::Fragment {
            src,
            dst,
            id: ip_id,
            protocol,
        });
    }
    let l4 = ETH_HDR_LEN + ihl;
    let mut p = Parsed {
        protocol,
        src,
        dst,
        l4,
        src_port: 0,
        dst_port: 0,
        icmp_type: 0,
        closing: false,
        first_fragment: frag0 & IP_MF != 0,
        ip_id,
    };
    match protocol {
        PROTO_TCP | PROTO_UDP => {
            let ports: [u8; 4] = ctx.load(l4).map_err(|_| Skip::Untranslatable)?;
            p.src_port = u16::from_ne_bytes([ports[0], ports[1]]);
            p.dst_port = u16::from_ne_bytes([ports[2], ports[3]]);
            if protocol == PROTO_TCP {
                let flags: u8 = ctx.load(l4 + 13).map_err(|_| Skip::Untranslatable)?;
                p.closing = flags & (TCP_FIN | TCP_RST) != 0;
            }
        }
        PROTO_ICMP => {
            let h: [u8; 6] = ctx.load(l4).map_err(|_| Skip::Untranslatable)?;
            p.icmp_type = h[0];
            p.src_port = u16::from_ne_bytes([h[4], h[5]]);
        }
        _ => return Err(Skip::Untranslatable),
    }
    Ok(p)
}

#[inline(always)]
fn count(slot: u32, ctx: &TcContext) {
    if let Some(counter) = KVPN_SNAT_CNT.get_ptr_mut(slot) {
        add(
            counter,
            u64::from(ctx.len()).saturating_sub(ETH_HDR_LEN as u64),
        );
    }
}

#[inline(always)]
fn in_pool(cfg: &SnatConfig, addr: [u8; 4]) -> bool {
    let a = u32::from_ne_bytes(addr);
    a & u32::from_ne_bytes(cfg.pool_mask) == u32::from_ne_bytes(cfg.pool_addr)
}

/// Rewrites the address at `ip_off` and the port at `port_off` (both already known
/// to lie in the packet) and fixes the checksums.
#[inline(always)]
#[allow(
    clippy::too_many_arguments,
    reason = "one call per direction; a struct would only rename them"
)]
fn rewrite(
    ctx: &TcContext,
    p: &Parsed,
    ip_off: usize,
    old_ip: [u8; 4],
    new_ip: [u8; 4],
    port_off: usize,
    old_port: u16,
    new_port: u16,
) -> Result<(), i64> {
    rewrite_ipv4_addr(ctx, IP_CSUM, ip_off, p.protocol, Some(p.l4), old_ip, new_ip)?;
    let (csum_off, base) = l4_checksum(p.protocol, p.l4);
    if old_port != new_port {
        ctx.store(port_off, &new_port, 0)?;
        ctx.l4_csum_replace(csum_off, u64::from(old_port), u64::from(new_port), base | 2)?;
    }
    Ok(())
}

#[classifier]
pub fn kvpn_snat_out(ctx: TcContext) -> i32 {
    let Some(cfg) = KVPN_SNAT_CFG.get(0) else {
        return PASS;
    };
    let p = match parse(&ctx) {
        Ok(p) => p,
        Err(Skip::Pass) => return PASS,
        // A later fragment of a laptop datagram: its first fragment carried the
        // ports (and got the flow's port); this one needs only the pod IP as source.
        Err(Skip::Fragment { src, protocol, .. })
            if in_pool(cfg, src) && matches!(protocol, PROTO_TCP | PROTO_UDP | PROTO_ICMP) =>
        {
            if ctx.store(IP_SRC, &cfg.pod_ip, 0).is_err()
                || ctx
                    .l3_csum_replace(
                        IP_CSUM,
                        u64::from(u32::from_ne_bytes(src)),
                        u64::from(u32::from_ne_bytes(cfg.pod_ip)),
                        4,
                    )
                    .is_err()
            {
                count(SNAT_UNTRANSLATABLE, &ctx);
                return DROP;
            }
            count(SNAT_TRANSLATED_OUT, &ctx);
            return PASS;
        }
        Err(Skip::Untranslatable | Skip::Fragment { .. }) => {
            // Only the pool's packets must not leave untranslated.
            let src: Result<[u8; 4], _> = ctx.load(IP_SRC);
            return match src {
                Ok(src) if in_pool(cfg, src) => {
                    count(SNAT_UNTRANSLATABLE, &ctx);
                    DROP
                }
                _ => PASS,
            };
        }
    };
    if !in_pool(cfg, p.src) {
        return PASS;
    }
    if p.protocol == PROTO_ICMP && p.icmp_type != ICMP_ECHO_REQUEST {
        count(SNAT_UNTRANSLATABLE, &ctx);
        return DROP;
    }
    let key = snat_key(p.protocol, p.src, p.dst, p.src_port, p.dst_port);
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let state = if p.closing { SNAT_STATE_CLOSING } else { 0 };
    let port = match KVPN_SNAT_FWD.get_ptr_mut(&key) {
        // The reverse entry may have been evicted (LRU) or swept: then allocate anew.
        Some(fwd) if reverse_exists(&p, cfg, unsafe { (*fwd).port }) => {
            // SAFETY: a map value pointer, valid during the program; concurrent writers
            // only store timestamps and state bits, where a lost update is harmless.
            unsafe {
                (*fwd).last_ns = now;
                (*fwd).state |= state;
                (*fwd).port
            }
        }
        _ => match allocate(&p, cfg, now, state) {
            Some(port) => {
                let fwd = snat_forward(now, port, state);
                if KVPN_SNAT_FWD.insert(&key, &fwd, 0).is_err() {
                    count(SNAT_PORTS_EXHAUSTED, &ctx);
                    return DROP;
                }
                count(SNAT_NEW_FLOWS, &ctx);
                port
            }
            None => {
                count(SNAT_PORTS_EXHAUSTED, &ctx);
                return DROP;
            }
        },
    };
    let port_off = if p.protocol == PROTO_ICMP {
        p.l4 + 4
    } else {
        p.l4
    };
    if rewrite(
        &ctx, &p, IP_SRC, p.src, cfg.pod_ip, port_off, p.src_port, port,
    )
    .is_err()
    {
        count(SNAT_UNTRANSLATABLE, &ctx);
        return DROP;
    }
    count(SNAT_TRANSLATED_OUT, &ctx);
    PASS
}

/// A [`SnatKey`] (`reserved` zero) built from whole 32-bit words. A struct literal
/// with `reserved: [0; 3]` at byte 1 compiles to an out-of-line memset whose loop
/// walks the stack with a variable offset; the verifier accepts that only from a
/// loader with CAP_PERFMON ("pointer arithmetic with it prohibited for !root"), which
/// the manager pod should not need.
#[inline(always)]
fn snat_key(protocol: u8, src: [u8; 4], dst: [u8; 4], src_port: u16, dst_port: u16) -> SnatKey {
    let [s0, s1] = src_port.to_ne_bytes();
    let [d0, d1] = dst_port.to_ne_bytes();
    let words: [u32; 4] = [
        u32::from_ne_bytes([protocol, 0, 0, 0]),
        u32::from_ne_bytes(src),
        u32::from_ne_bytes(dst),
        u32::from_ne_bytes([s0, s1, d0, d1]),
    ];
    // SAFETY: SnatKey is repr(C), 16 bytes with no padding (protocol, reserved[3],
    // src[4], dst[4], src_port, dst_port) and every bit pattern is valid; the words
    // lay those bytes out in memory order.
    unsafe { core::mem::transmute::<[u32; 4], SnatKey>(words) }
}

/// A [`SnatForward`] (`reserved` zero) from two 64-bit words, for the reason
/// [`snat_key`] gives (`reserved: [0; 5]` at byte 11).
#[inline(always)]
fn snat_forward(last_ns: u64, port: u16, state: u8) -> SnatForward {
    let [p0, p1] = port.to_ne_bytes();
    let words: [u64; 2] = [last_ns, u64::from_ne_bytes([p0, p1, state, 0, 0, 0, 0, 0])];
    // SAFETY: SnatForward is repr(C), 16 bytes with no padding (last_ns, port, state,
    // reserved[5]) and every bit pattern is valid.
    unsafe { core::mem::transmute::<[u64; 2], SnatForward>(words) }
}

/// The reverse key of a laptop packet's flow leaving with `port`.
#[inline(always)]
fn reverse_key(p: &Parsed, cfg: &SnatConfig, port: u16) -> SnatKey {
    snat_key(p.protocol, p.dst, cfg.pod_ip, p.dst_port, port)
}

#[inline(always)]
fn reverse_exists(p: &Parsed, cfg: &SnatConfig, port: u16) -> bool {
    KVPN_SNAT_REV.get_ptr(&reverse_key(p, cfg, port)).is_some()
}

/// Claims a free port of the range for a new flow: its reverse entry, inserted with
/// BPF_NOEXIST, so two CPUs never get the same port for one destination.
#[inline(always)]
fn allocate(p: &Parsed, cfg: &SnatConfig, now: u64, state: u8) -> Option<u16> {
    let min = u32::from(cfg.port_min);
    let max = u32::from(cfg.port_max);
    if max < min {
        return None;
    }
    let range = max - min + 1;
    // SAFETY: bpf_get_prandom_u32 has no preconditions.
    let start = unsafe { bpf_get_prandom_u32() } % range;
    let rev = SnatReverse {
        last_ns: now,
        addr: p.src,
        port: p.src_port,
        state,
        reserved: 0,
    };
    let mut i = 0;
    while i < SNAT_PORT_TRIES {
        let host = min + (start + i) % range;
        let port = (host as u16).to_be();
        if KVPN_SNAT_REV
            .insert(&reverse_key(p, cfg, port), &rev, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Some(port);
        }
        i += 1;
    }
    None
}

#[classifier]
pub fn kvpn_snat_in(ctx: TcContext) -> i32 {
    let Some(cfg) = KVPN_SNAT_CFG.get(0) else {
        return PASS;
    };
    let p = match parse(&ctx) {
        Ok(p) => p,
        Err(Skip::Fragment {
            src,
            dst,
            id,
            protocol,
        }) if dst == cfg.pod_ip => return translate_fragment_in(&ctx, src, id, protocol),
        Err(_) => return PASS,
    };
    if p.dst != cfg.pod_ip {
        return PASS;
    }
    let (key_src_port, key_dst_port, port_off) = match p.protocol {
        PROTO_ICMP if p.icmp_type == ICMP_ECHO_REPLY => (0, p.src_port, p.l4 + 4),
        PROTO_ICMP
            if matches!(
                p.icmp_type,
                ICMP_DEST_UNREACHABLE | ICMP_TIME_EXCEEDED | ICMP_PARAMETER_PROBLEM
            ) =>
        {
            return match translate_icmp_error(&ctx, cfg, &p) {
                Ok(true) => {
                    count(SNAT_ICMP_ERRORS_IN, &ctx);
                    PASS
                }
                Ok(false) => PASS,
                Err(_) => {
                    count(SNAT_UNTRANSLATABLE, &ctx);
                    DROP
                }
            };
        }
        PROTO_ICMP => return PASS,
        _ => (p.src_port, p.dst_port, p.l4 + 2),
    };
    let key = snat_key(p.protocol, p.src, p.dst, key_src_port, key_dst_port);
    let Some(rev) = KVPN_SNAT_REV.get_ptr_mut(&key) else {
        return PASS;
    };
    // SAFETY: as in the egress program.
    let (addr, port) = unsafe {
        (*rev).last_ns = bpf_ktime_get_ns();
        if p.closing {
            (*rev).state |= SNAT_STATE_CLOSING;
        }
        ((*rev).addr, (*rev).port)
    };
    if rewrite(&ctx, &p, IP_DST, p.dst, addr, port_off, key_dst_port, port).is_err() {
        count(SNAT_UNTRANSLATABLE, &ctx);
        return DROP;
    }
    if p.first_fragment {
        // The later fragments carry no ports: remember where this datagram goes.
        let key = SnatFragKey {
            src: p.src,
            id: p.ip_id,
            protocol: p.protocol,
            reserved: 0,
        };
        let _ = KVPN_SNAT_FRAG.insert(&key, &addr, 0);
    }
    count(SNAT_TRANSLATED_IN, &ctx);
    PASS
}

/// A later fragment of a reply to the pod IP: if its first fragment was translated
/// (recorded in `KVPN_SNAT_FRAG` by source, identification and protocol), its
/// destination becomes that tunnel IP too (IP checksum only: no L4 header here).
/// A fragment that overtakes its first one is not found and goes to the pod's own
/// stack, where it is dropped with the unfinished datagram.
#[inline(always)]
fn translate_fragment_in(ctx: &TcContext, src: [u8; 4], id: u16, protocol: u8) -> i32 {
    let key = SnatFragKey {
        src,
        id,
        protocol,
        reserved: 0,
    };
    // SAFETY: a map value pointer, valid during the program; read once.
    let Some(addr) = KVPN_SNAT_FRAG.get_ptr(&key).map(|a| unsafe { *a }) else {
        return PASS;
    };
    let Ok(old) = ctx.load::<[u8; 4]>(IP_DST) else {
        return PASS;
    };
    if ctx.store(IP_DST, &addr, 0).is_err()
        || ctx
            .l3_csum_replace(
                IP_CSUM,
                u64::from(u32::from_ne_bytes(old)),
                u64::from(u32::from_ne_bytes(addr)),
                4,
            )
            .is_err()
    {
        count(SNAT_UNTRANSLATABLE, ctx);
        return DROP;
    }
    count(SNAT_TRANSLATED_IN, ctx);
    PASS
}

/// An ICMP error to the pod IP about a translated flow (RFC 792: destination
/// unreachable — port unreachable, fragmentation needed, administratively prohibited
/// (RFC 1812 5.2.7.1) —, time exceeded, parameter problem), sent by the backend or
/// a router on the way. It quotes the datagram as it left the pod: inner source pod
/// IP:allocated port (ICMP echo: identifier), inner destination the backend; that
/// inner header is the flow's reverse key read backwards. Rewritten like the pod
/// had never been there, as the laptop's kernel must see it to match its socket
/// (`icmp_err_convert` in net/ipv4/icmp.c, `__udp4_lib_err`, `tcp_v4_err`):
/// - outer destination pod IP → tunnel IP (outer IP checksum; the ICMP checksum has
///   no pseudo-header);
/// - inner source pod IP → tunnel IP (inner IP checksum), inner source port or echo
///   identifier → the laptop's;
/// - the inner L4 checksum where the quote reaches it: UDP's and ICMP echo's sit in
///   the first 8 bytes RFC 792 guarantees; TCP's (offset 16) only when the quote is
///   longer (Linux quotes up to 576 bytes), otherwise it is not in the packet and
///   nobody can check it. A zero UDP checksum (none) stays zero;
/// - the ICMP checksum, which covers the whole quote: every 16-bit word changed
///   above is folded into it incrementally (RFC 1624).
///
/// `Ok(false)`: not about a translated flow (the pod's own, or a quote too short
/// to read): left untouched. `Err`: a rewrite helper failed half-way.
#[inline(always)]
fn translate_icmp_error(ctx: &TcContext, cfg: &SnatConfig, p: &Parsed) -> Result<bool, i64> {
    let inner = p.l4 + ICMP_ERROR_HDR_LEN;
    let Ok(
        [
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
        ],
    ) = ctx.load::<[u8; 10]>(inner)
    else {
        return Ok(false);
    };
    let (Ok(inner_src), Ok(inner_dst)) = (
        ctx.load::<[u8; 4]>(inner + 12),
        ctx.load::<[u8; 4]>(inner + 16),
    ) else {
        return Ok(false);
    };
    let ihl = usize::from(vihl & 0x0f) * 4;
    // A quoted non-first fragment has no ports to find the flow by.
    if vihl >> 4 != 4
        || ihl < 20
        || inner_src != cfg.pod_ip
        || (u16::from(frag0 & 0x1f) << 8 | u16::from(frag1)) != 0
    {
        return Ok(false);
    }
    let il4 = inner + ihl;
    // Where the quoted source port (echo: identifier) and L4 checksum sit, and the
    // reverse key's ports (the reply's view: backend port → allocated port).
    let (port_off, csum_off, key_src_port) = match protocol {
        PROTO_TCP | PROTO_UDP => {
            let Ok(dport) = ctx.load::<u16>(il4 + 2) else {
                return Ok(false);
            };
            (il4, il4 + if protocol == PROTO_TCP { 16 } else { 6 }, dport)
        }
        PROTO_ICMP => {
            let Ok(t) = ctx.load::<u8>(il4) else {
                return Ok(false);
            };
            if t != ICMP_ECHO_REQUEST {
                return Ok(false);
            }
            (il4 + 4, il4 + 2, 0)
        }
        _ => return Ok(false),
    };
    let Ok(old_port) = ctx.load::<u16>(port_off) else {
        return Ok(false);
    };
    let key = snat_key(protocol, inner_dst, cfg.pod_ip, key_src_port, old_port);
    let Some(rev) = KVPN_SNAT_REV.get_ptr(&key) else {
        return Ok(false);
    };
    // SAFETY: a map value pointer, valid during the program; read once. An error does
    // not refresh the flow's stamp: only traffic keeps a flow alive.
    let (addr, new_port) = unsafe { ((*rev).addr, (*rev).port) };
    let old_ip = u64::from(u32::from_ne_bytes(cfg.pod_ip));
    let new_ip = u64::from(u32::from_ne_bytes(addr));
    let icmp_csum = p.l4 + 2;

    // Inner IP header: source and its checksum.
    let inner_csum_off = inner + 10;
    let old_inner_csum: u16 = ctx.load(inner_csum_off)?;
    ctx.store(inner + 12, &addr, 0)?;
    ctx.l3_csum_replace(inner_csum_off, old_ip, new_ip, 4)?;
    let new_inner_csum: u16 = ctx.load(inner_csum_off)?;
    ctx.l4_csum_replace(icmp_csum, old_ip, new_ip, 4)?;
    ctx.l4_csum_replace(
        icmp_csum,
        u64::from(old_inner_csum),
        u64::from(new_inner_csum),
        2,
    )?;

    // Inner L4: the port, and its checksum if quoted (and, for UDP, in use).
    ctx.store(port_off, &new_port, 0)?;
    ctx.l4_csum_replace(icmp_csum, u64::from(old_port), u64::from(new_port), 2)?;
    if let Ok(old_l4_csum) = ctx.load::<u16>(csum_off)
        && !(protocol == PROTO_UDP && old_l4_csum == 0)
    {
        let mangled = if protocol == PROTO_UDP {
            u64::from(BPF_F_MARK_MANGLED_0)
        } else {
            0
        };
        // The inner checksum field is plain data to the skb's own checksum state
        // (no BPF_F_PSEUDO_HDR): the pseudo-header it covers is the quoted one.
        if protocol != PROTO_ICMP {
            ctx.l4_csum_replace(csum_off, old_ip, new_ip, mangled | 4)?;
        }
        ctx.l4_csum_replace(
            csum_off,
            u64::from(old_port),
            u64::from(new_port),
            mangled | 2,
        )?;
        let new_l4_csum: u16 = ctx.load(csum_off)?;
        ctx.l4_csum_replace(icmp_csum, u64::from(old_l4_csum), u64::from(new_l4_csum), 2)?;
    }

    // Outer destination: the laptop's tunnel IP.
    ctx.store(IP_DST, &addr, 0)?;
    ctx.l3_csum_replace(IP_CSUM, old_ip, new_ip, 4)?;
    Ok(true)
}
