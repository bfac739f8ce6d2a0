//! TC classifier on the TUN device's egress: every packet the laptop's kernel routes into
//! the TUN (outbound, toward the cluster) is looked up by destination in the route tries
//! and counted per route kind and per route entry (`kvpn top`); packets that match no route — routed into the TUN by
//! mistake — and packets that are not parseable IP are dropped and counted.
//!
//! Verdicts. kvpn attaches this program with TCX (kernel >= 6.6), where the kernel only
//! knows TCX_NEXT (-1), TCX_PASS (0), TCX_DROP (2) and TCX_REDIRECT (7) and treats
//! every other code as TCX_NEXT. A routed packet therefore returns `TC_ACT_OK` (= TCX_PASS,
//! a final "send it"): kvpn owns the TUN device and this verdict is the decision, not a
//! hint. `TC_ACT_PIPE` (3) is a legacy action-chaining code; under TCX it would silently
//! mean "ask the next program", so the outcome would depend on whatever else is attached.
//! Drops return `TC_ACT_SHOT` (= TCX_DROP). The same codes mean the same under the legacy
//! clsact/direct-action attachment used on older kernels.

use aya_ebpf::{
    Global,
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::{classifier, map},
    maps::{LpmTrie, PerCpuArray, lpm_trie::Key},
    programs::TcContext,
};
use kvpn_dataplane_common::{
    COUNTER_MALFORMED, COUNTER_SLOTS, COUNTER_UNROUTED, CounterValue, Ipv4Prefix, Ipv6Prefix,
    L2_HDR_LEN_TUN, MAX_ROUTES, RouteEntry, counter_slot,
};
use kvpn_dataplane_ebpf::parse::{self, Destination, PacketBytes};

/// Bytes of L2 header in front of the IP header; see `GLOBAL_L2_HDR_LEN` in
/// dataplane-common. The loader overrides it (14 for BPF_PROG_TEST_RUN).
#[unsafe(no_mangle)]
static KVPN_L2_HDR_LEN: Global<u32> = Global::new(L2_HDR_LEN_TUN);

#[map]
static KVPN_ROUTES_V4: LpmTrie<Ipv4Prefix, RouteEntry> = LpmTrie::with_max_entries(MAX_ROUTES, 0);

#[map]
static KVPN_ROUTES_V6: LpmTrie<Ipv6Prefix, RouteEntry> = LpmTrie::with_max_entries(MAX_ROUTES, 0);

#[map]
static KVPN_COUNTERS: PerCpuArray<CounterValue> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Per route entry (index: `RouteEntry::slot`), for `kvpn top`.
#[map]
static KVPN_ROUTE_CNT: PerCpuArray<CounterValue> = PerCpuArray::with_max_entries(MAX_ROUTES, 0);

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

/// Why a packet could not be classified.
#[derive(Clone, Copy)]
enum Error {
    /// Not a parseable IPv4/IPv6 packet (see `parse::ParseError`).
    Malformed,
    /// A route entry whose kind is not a `ROUTE_KIND_*` (userspace never writes one).
    BadRouteKind,
    /// The counter array has no such slot (cannot happen: slots < COUNTER_SLOTS).
    CounterSlot,
}

/// The skb as bounds-checked bytes: `bpf_skb_load_bytes` fails instead of reading past
/// the packet, and also reaches non-linear (paged) data.
struct Skb<'a>(&'a TcContext);

impl PacketBytes for Skb<'_> {
    #[inline(always)]
    fn packet_len(&self) -> usize {
        self.0.len() as usize
    }

    #[inline(always)]
    fn read<const N: usize>(&self, offset: usize) -> Option<[u8; N]> {
        self.0.load::<[u8; N]>(offset).ok()
    }
}

#[classifier]
pub fn kvpn_tun_egress(ctx: TcContext) -> i32 {
    match try_kvpn_tun_egress(&ctx) {
        Ok(action) => action,
        Err(Error::Malformed | Error::BadRouteKind) => {
            // Best effort: the slot exists, and the packet is dropped either way.
            let _ = count(COUNTER_MALFORMED, ip_len(&ctx));
            DROP
        }
        Err(Error::CounterSlot) => DROP,
    }
}

#[inline(always)]
fn try_kvpn_tun_egress(ctx: &TcContext) -> Result<i32, Error> {
    let l2_len = KVPN_L2_HDR_LEN.load() as usize;
    let entry = match parse::destination(&Skb(ctx), l2_len).map_err(|_| Error::Malformed)? {
        Destination::V4(addr) => KVPN_ROUTES_V4
            .get(Key::new(32, Ipv4Prefix { addr }))
            .copied(),
        Destination::V6(addr) => KVPN_ROUTES_V6
            .get(Key::new(128, Ipv6Prefix { addr }))
            .copied(),
    };
    match entry {
        Some(entry) => {
            let slot = counter_slot(entry.kind).ok_or(Error::BadRouteKind)?;
            let len = ip_len(ctx);
            count(slot, len)?;
            // Per-entry counters are for display: a slot out of range (userspace
            // never writes one) leaves the packet counted per kind only.
            if let Some(counter) = KVPN_ROUTE_CNT.get_ptr_mut(u32::from(entry.slot)) {
                add(counter, len);
            }
            Ok(PASS)
        }
        None => {
            count(COUNTER_UNROUTED, ip_len(ctx))?;
            Ok(DROP)
        }
    }
}

/// IP packet length: the skb length without the L2 header.
#[inline(always)]
fn ip_len(ctx: &TcContext) -> u64 {
    u64::from(ctx.len()).saturating_sub(u64::from(KVPN_L2_HDR_LEN.load()))
}

#[inline(always)]
fn count(slot: u32, bytes: u64) -> Result<(), Error> {
    let counter = KVPN_COUNTERS.get_ptr_mut(slot).ok_or(Error::CounterSlot)?;
    add(counter, bytes);
    Ok(())
}

/// Add one packet of `bytes` to a per-CPU counter value.
#[inline(always)]
fn add(counter: *mut CounterValue, bytes: u64) {
    // SAFETY: `counter` comes from `PerCpuArray::get_ptr_mut`: this CPU's value of a
    // slot, valid for the program's run; TC runs with preemption off (BH disabled), so
    // nothing else writes it meanwhile.
    unsafe {
        (*counter).packets = (*counter).packets.wrapping_add(1);
        (*counter).bytes = (*counter).bytes.wrapping_add(bytes);
    }
}
