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
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    maps::lpm_trie::Key,
    programs::TcContext,
};
use kvpn_dataplane_common::{
    COUNTER_MALFORMED, COUNTER_UNROUTED, Ipv4Prefix, Ipv6Prefix, counter_slot,
};
use kvpn_dataplane_ebpf::parse::{self, Destination};

use crate::maps::{
    KVPN_COUNTERS, KVPN_L2_HDR_LEN, KVPN_ROUTE_CNT, KVPN_ROUTES_V4, KVPN_ROUTES_V6, Skb, add,
    ip_len,
};

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
            // Per-entry counters are for display: an entry without a slot
            // (NO_ROUTE_SLOT, past MAX_ROUTE_COUNTERS) is counted per kind only.
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

#[inline(always)]
fn count(slot: u32, bytes: u64) -> Result<(), Error> {
    let counter = KVPN_COUNTERS.get_ptr_mut(slot).ok_or(Error::CounterSlot)?;
    add(counter, bytes);
    Ok(())
}
