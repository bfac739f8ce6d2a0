//! The maps and load-time global shared by kvpn's TUN programs ([`crate::tun_egress`]
//! and [`crate::tun_ingress`]): both programs live in one object, so they use the same
//! route tries — the ranges the laptop sends into the tunnel are the ranges replies
//! may come from. Layouts and names are in `dataplane-common`.

use aya_ebpf::{
    Global,
    macros::map,
    maps::{Array, LpmTrie, PerCpuArray},
    programs::TcContext,
};
use kvpn_dataplane_common::{
    COUNTER_SLOTS, CounterValue, INGRESS_SLOTS, Ipv4Prefix, Ipv6Prefix, L2_HDR_LEN_TUN,
    MAX_ROUTE_COUNTERS, MAX_ROUTES, RouteEntry,
};
use kvpn_dataplane_ebpf::parse::PacketBytes;

/// Bytes of L2 header in front of the IP header; see `GLOBAL_L2_HDR_LEN` in
/// dataplane-common. The loader overrides it (14 for BPF_PROG_TEST_RUN).
#[unsafe(no_mangle)]
pub static KVPN_L2_HDR_LEN: Global<u32> = Global::new(L2_HDR_LEN_TUN);

#[map]
pub static KVPN_ROUTES_V4: LpmTrie<Ipv4Prefix, RouteEntry> =
    LpmTrie::with_max_entries(MAX_ROUTES, 0);

#[map]
pub static KVPN_ROUTES_V6: LpmTrie<Ipv6Prefix, RouteEntry> =
    LpmTrie::with_max_entries(MAX_ROUTES, 0);

/// Egress counters per route kind and drop reason (`COUNTER_*`).
#[map]
pub static KVPN_COUNTERS: PerCpuArray<CounterValue> =
    PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Per route entry (index: `RouteEntry::slot`), for `kvpn top`.
#[map]
pub static KVPN_ROUTE_CNT: PerCpuArray<CounterValue> =
    PerCpuArray::with_max_entries(MAX_ROUTE_COUNTERS, 0);

/// Ingress counters per verdict (`INGRESS_*`).
#[map]
pub static KVPN_INGR_CNT: PerCpuArray<CounterValue> =
    PerCpuArray::with_max_entries(INGRESS_SLOTS, 0);

/// The fwmark the ingress check sets on packets it passes (index 0; 0 = none):
/// `MAP_INGRESS_MARK` in dataplane-common.
#[map]
pub static KVPN_INGR_MARK: Array<u32> = Array::with_max_entries(1, 0);

/// The skb as bounds-checked bytes: `bpf_skb_load_bytes` fails instead of reading past
/// the packet, and also reaches non-linear (paged) data.
pub struct Skb<'a>(pub &'a TcContext);

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

/// Add one packet of `bytes` to a per-CPU counter value.
#[inline(always)]
pub fn add(counter: *mut CounterValue, bytes: u64) {
    // SAFETY: `counter` comes from `PerCpuArray::get_ptr_mut`: this CPU's value of a
    // slot, valid for the program's run; TC runs with preemption off (BH disabled), so
    // nothing else writes it meanwhile.
    unsafe {
        (*counter).packets = (*counter).packets.wrapping_add(1);
        (*counter).bytes = (*counter).bytes.wrapping_add(bytes);
    }
}

/// IP packet length: the skb length without the L2 header.
#[inline(always)]
pub fn ip_len(ctx: &TcContext) -> u64 {
    u64::from(ctx.len()).saturating_sub(u64::from(KVPN_L2_HDR_LEN.load()))
}
