//! TC anti-spoofing check on the TUN device's ingress: every packet the pump writes into
//! the TUN device (inbound, from the tunnel to the laptop) must come from an address
//! the session routes into the tunnel — a pod or service CIDR, an extra CIDR, the
//! tunnel pool of the other laptops (an extra route) or a watched ClusterIP entry. The
//! source is looked up in the same route tries the egress classifier uses, so the
//! check follows every route change. A packet from any other source (the traffic
//! manager, or anything on the path, claiming to be a laptop-local address or the
//! internet) is dropped and counted; so is a packet that is not parseable IP.
//!
//! Hook: a packet written to a TUN file descriptor enters the stack through
//! `tun_get_user` → `netif_receive_skb`, which runs the device's TC ingress (TCX)
//! programs before IP input; `dataplane/tests/ebpf_tun_netns.rs` checks this on a real
//! TUN device. Verdicts as in [`crate::tun_egress`]: `TC_ACT_OK` (= TCX_PASS) and
//! `TC_ACT_SHOT` (= TCX_DROP).

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    maps::lpm_trie::Key,
    programs::TcContext,
};
use kvpn_dataplane_common::{
    INGRESS_FOREIGN_SOURCE, INGRESS_MALFORMED, INGRESS_PASSED, Ipv4Prefix, Ipv6Prefix,
};
use kvpn_dataplane_ebpf::parse::{self, Source};

use crate::maps::{
    KVPN_INGR_CNT, KVPN_INGR_MARK, KVPN_L2_HDR_LEN, KVPN_ROUTES_V4, KVPN_ROUTES_V6, Skb, add,
    ip_len,
};
use crate::steer;

const PASS: i32 = TC_ACT_OK as i32;
const DROP: i32 = TC_ACT_SHOT as i32;

#[classifier]
pub fn kvpn_antispoof(ctx: TcContext) -> i32 {
    let l2_len = KVPN_L2_HDR_LEN.load() as usize;
    let mut v4 = false;
    let (slot, action) = match parse::source(&Skb(&ctx), l2_len) {
        Ok(Source::V4(addr)) => {
            v4 = true;
            verdict(
                KVPN_ROUTES_V4
                    .get(Key::new(32, Ipv4Prefix { addr }))
                    .is_some(),
            )
        }
        Ok(Source::V6(addr)) => verdict(
            KVPN_ROUTES_V6
                .get(Key::new(128, Ipv6Prefix { addr }))
                .is_some(),
        ),
        Err(_) => (INGRESS_MALFORMED, DROP),
    };
    // The slots exist (< INGRESS_SLOTS); the verdict stands either way.
    if let Some(counter) = KVPN_INGR_CNT.get_ptr_mut(slot) {
        add(counter, ip_len(&ctx));
    }
    if action == PASS
        && let Some(mark) = KVPN_INGR_MARK.get(0)
        && *mark != 0
    {
        // A run session's replies: its rp_filter lookup (src_valid_mark) and
        // anything else routing on the mark see the run's table.
        ctx.set_mark(*mark);
    }
    if v4 && action == PASS {
        return steer::reverse(&ctx, l2_len);
    }
    action
}

#[inline(always)]
fn verdict(source_routed: bool) -> (u32, i32) {
    if source_routed {
        (INGRESS_PASSED, PASS)
    } else {
        (INGRESS_FOREIGN_SOURCE, DROP)
    }
}
