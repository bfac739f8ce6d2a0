//! CIDR math shared by the laptop side (cluster CIDR detection in the user daemon),
//! the root daemon and the traffic manager (pod CIDRs in `WatchRoutes`). Pure: no
//! I/O, no clock.
//!
//! Everything works on the *set of addresses* a list of prefixes covers and hands
//! back that set as the unique minimal list of aligned prefixes (the canonical
//! decomposition of a union of ranges, what ipnet's `aggregate` computes):
//!
//! - [`normalise`]: truncate host bits (`10.42.2.5/24` → `10.42.2.0/24`), drop
//!   duplicates and prefixes covered by wider ones, merge adjacent siblings
//!   (`10.244.0.0/24` + `10.244.1.0/24` → `10.244.0.0/23`). Case rt-03.
//! - [`infer_covering`]: prefixes for a cluster whose ranges are unknown, built from
//!   the pod IPs or ClusterIPs seen, never wider than [`InferPolicy`] allows.
//!   Case rt-01.
//! - [`subtract`]: the part of some prefixes that other prefixes do not cover
//!   (the routes a watch adds beyond the CIDRs a session already routes).
//! - [`exclude`]: punch single addresses (API server, nameservers, default gateways,
//!   SSH hosts) out of the cluster ranges so the kernel never routes them into the
//!   TUN device. Case rt-02.
//!
//! IPv4 and IPv6 never cover each other; results list IPv4 first, each family in
//! address order.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv4Subnets, Ipv6Net, Ipv6Subnets};

/// Normalise cluster CIDRs: the minimal sorted list of truncated prefixes covering
/// exactly the addresses of `cidrs`. Idempotent and independent of input order.
///
/// `{10.42.2.5/24, 10.96.0.0/12, 10.96.1.0/24}` → `{10.42.2.0/24, 10.96.0.0/12}`.
pub fn normalise(cidrs: &[IpNet]) -> Vec<IpNet> {
    exclude(cidrs, &[])
}

/// How wide a prefix [`infer_covering`] may put around one observed address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InferPolicy {
    /// Prefix length around each IPv4 address (24 = the /24 it lies in).
    pub v4_prefix_len: u8,
    /// Prefix length around each IPv6 address.
    pub v6_prefix_len: u8,
}

impl Default for InferPolicy {
    /// /24 around each IPv4 and /64 around each IPv6 address: the per-node pod
    /// range kube-controller-manager hands out by default (`--node-cidr-mask-size`
    /// 24 and 64), so every other pod on the node of an observed pod is inside too,
    /// while a laptop LAN next door (`192.168.0.0/24` beside pods in
    /// `192.168.64.0/24`) stays outside.
    fn default() -> Self {
        InferPolicy {
            v4_prefix_len: 24,
            v6_prefix_len: 64,
        }
    }
}

/// The tightest prefixes the policy allows around `ips`: one
/// `/policy.v4_prefix_len` (or v6) block per address, then [`normalise`]d, so
/// blocks merge only where they are adjacent siblings and never grow to cover a
/// block that holds none of `ips`. Lengths above the family's width are clamped
/// (32 / 128: one host route per address).
///
/// `{192.168.64.3, 192.168.70.9}` → `{192.168.64.0/24, 192.168.70.0/24}`, not the
/// `/21` or `/16` that would also cover both.
pub fn infer_covering(ips: &[IpAddr], policy: InferPolicy) -> Vec<IpNet> {
    let blocks: Vec<IpNet> = ips
        .iter()
        .map(|ip| match ip {
            IpAddr::V4(a) => IpNet::V4(v4_net(*a, policy.v4_prefix_len.min(32))),
            IpAddr::V6(a) => IpNet::V6(v6_net(*a, policy.v6_prefix_len.min(128))),
        })
        .collect();
    normalise(&blocks)
}

/// The addresses of `ips` that none of `cidrs` contains, in input order.
pub fn uncovered(ips: &[IpAddr], cidrs: &[IpNet]) -> Vec<IpAddr> {
    ips.iter()
        .copied()
        .filter(|ip| !cidrs.iter().any(|c| c.contains(ip)))
        .collect()
}

/// The addresses of `cidrs` minus `essentials`, as the minimal sorted list of
/// disjoint prefixes. Essentials outside every CIDR change nothing; an input with
/// no essential inside comes back [`normalise`]d.
///
/// Removing one address from a `/n` yields `width - n` prefixes (one per level of
/// the path from the `/n` down to the address), e.g. `10.0.0.0/8` minus `10.0.0.1`
/// → `10.0.0.0/32, 10.0.0.2/31, 10.0.0.4/30, …, 10.128.0.0/9`: 24 routes.
pub fn exclude(cidrs: &[IpNet], essentials: &[IpAddr]) -> Vec<IpNet> {
    let mut v4: Vec<(u128, u128)> = Vec::new();
    let mut v6: Vec<(u128, u128)> = Vec::new();
    for c in cidrs {
        match c {
            IpNet::V4(n) => v4.push((
                u128::from(u32::from(n.network())),
                u128::from(u32::from(n.broadcast())),
            )),
            IpNet::V6(n) => v6.push((u128::from(n.network()), u128::from(n.broadcast()))),
        }
    }
    let mut holes_v4: Vec<u128> = Vec::new();
    let mut holes_v6: Vec<u128> = Vec::new();
    for e in essentials {
        match e {
            IpAddr::V4(a) => holes_v4.push(u128::from(u32::from(*a))),
            IpAddr::V6(a) => holes_v6.push(u128::from(*a)),
        }
    }
    let mut out: Vec<IpNet> = Vec::new();
    for (start, end) in punch(merge(v4), holes_v4) {
        // Both ends came from u32 addresses above, so they fit.
        let (s, e) = (
            Ipv4Addr::from(u32::try_from(start).unwrap_or(u32::MAX)),
            Ipv4Addr::from(u32::try_from(end).unwrap_or(u32::MAX)),
        );
        out.extend(Ipv4Subnets::new(s, e, 0).map(IpNet::V4));
    }
    for (start, end) in punch(merge(v6), holes_v6) {
        out.extend(Ipv6Subnets::new(Ipv6Addr::from(start), Ipv6Addr::from(end), 0).map(IpNet::V6));
    }
    out
}

/// The addresses of `cidrs` that none of `minus` covers, as the minimal sorted
/// list of disjoint prefixes. IPv4 and IPv6 never cover each other.
///
/// `{10.244.0.0/16} − {10.244.1.0/24}` → `{10.244.0.0/24, 10.244.2.0/23,
/// 10.244.4.0/22, …, 10.244.128.0/17}`; `{10.244.7.0/24} − {10.244.0.0/16}` → `{}`.
pub fn subtract(cidrs: &[IpNet], minus: &[IpNet]) -> Vec<IpNet> {
    let (v4, v6) = ranges(cidrs);
    let (m4, m6) = ranges(minus);
    let mut out: Vec<IpNet> = Vec::new();
    for (start, end) in cut(merge(v4), &merge(m4)) {
        // Both ends came from u32 addresses, so they fit.
        let (s, e) = (
            Ipv4Addr::from(u32::try_from(start).unwrap_or(u32::MAX)),
            Ipv4Addr::from(u32::try_from(end).unwrap_or(u32::MAX)),
        );
        out.extend(Ipv4Subnets::new(s, e, 0).map(IpNet::V4));
    }
    for (start, end) in cut(merge(v6), &merge(m6)) {
        out.extend(Ipv6Subnets::new(Ipv6Addr::from(start), Ipv6Addr::from(end), 0).map(IpNet::V6));
    }
    out
}

/// Inclusive address ranges of `cidrs`, split by family.
type Ranges = Vec<(u128, u128)>;

fn ranges(cidrs: &[IpNet]) -> (Ranges, Ranges) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for c in cidrs {
        match c {
            IpNet::V4(n) => v4.push((
                u128::from(u32::from(n.network())),
                u128::from(u32::from(n.broadcast())),
            )),
            IpNet::V6(n) => v6.push((u128::from(n.network()), u128::from(n.broadcast()))),
        }
    }
    (v4, v6)
}

/// `ranges` minus `holes` (both sorted, disjoint, merged).
fn cut(ranges: Vec<(u128, u128)>, holes: &[(u128, u128)]) -> Vec<(u128, u128)> {
    let mut out = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        let mut cur = Some(start);
        for &(h_start, h_end) in holes {
            let Some(c) = cur else { break };
            if h_end < c || h_start > end {
                continue;
            }
            if h_start > c {
                out.push((c, h_start - 1));
            }
            // `h_end == u128::MAX` (or the range's end) closes the range.
            cur = if h_end >= end { None } else { Some(h_end + 1) };
        }
        if let Some(c) = cur {
            out.push((c, end));
        }
    }
    out
}

/// Sorted, disjoint, non-adjacent inclusive ranges covering the same addresses.
fn merge(mut ranges: Vec<(u128, u128)>) -> Vec<(u128, u128)> {
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::with_capacity(ranges.len());
    for (start, end) in ranges {
        if let Some((_, last_end)) = merged.last_mut()
            && start <= last_end.saturating_add(1)
        {
            *last_end = (*last_end).max(end);
            continue;
        }
        merged.push((start, end));
    }
    merged
}

/// `ranges` (sorted, disjoint) minus the single addresses `holes`.
fn punch(ranges: Vec<(u128, u128)>, mut holes: Vec<u128>) -> Vec<(u128, u128)> {
    holes.sort_unstable();
    holes.dedup();
    let mut out = Vec::with_capacity(ranges.len() + holes.len());
    let mut h = 0;
    for (start, end) in ranges {
        let mut cur = start;
        // Holes below this range belong to no range (ranges are sorted).
        while h < holes.len() && holes[h] < start {
            h += 1;
        }
        let mut open = true;
        while h < holes.len() && holes[h] <= end {
            let hole = holes[h];
            if hole > cur {
                out.push((cur, hole - 1));
            }
            if hole == end {
                // The range ends with this hole; `hole + 1` could overflow.
                open = false;
                h += 1;
                break;
            }
            cur = hole + 1;
            h += 1;
        }
        if open {
            out.push((cur, end));
        }
    }
    out
}

fn v4_net(addr: Ipv4Addr, len: u8) -> Ipv4Net {
    // `len` is clamped to 32 by the caller, the only way `new` fails.
    Ipv4Net::new(addr, len)
        .map(|n| n.trunc())
        .unwrap_or_else(|_| Ipv4Net::from(addr))
}

fn v6_net(addr: Ipv6Addr, len: u8) -> Ipv6Net {
    // `len` is clamped to 128 by the caller, the only way `new` fails.
    Ipv6Net::new(addr, len)
        .map(|n| n.trunc())
        .unwrap_or_else(|_| Ipv6Net::from(addr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|c| c.parse().expect("test CIDR")).collect()
    }

    #[test]
    fn subtract_keeps_only_what_is_not_covered() {
        assert_eq!(
            subtract(&nets(&["10.244.7.0/24"]), &nets(&["10.244.0.0/16"])),
            vec![]
        );
        assert_eq!(
            subtract(
                &nets(&["10.244.1.0/24", "10.244.7.0/24", "fd00::/64"]),
                &nets(&["10.244.1.0/24", "10.96.0.0/12"])
            ),
            nets(&["10.244.7.0/24", "fd00::/64"])
        );
        // A hole in the middle splits the prefix along prefix boundaries.
        assert_eq!(
            subtract(&nets(&["10.0.0.0/30"]), &nets(&["10.0.0.1/32"])),
            nets(&["10.0.0.0/32", "10.0.0.2/31"])
        );
        assert_eq!(
            subtract(&nets(&["0.0.0.0/0"]), &nets(&["0.0.0.0/0"])),
            vec![]
        );
        assert_eq!(
            subtract(&nets(&["::/0"]), &nets(&["8000::/1"])),
            nets(&["::/1"])
        );
    }

    fn arb_net() -> impl Strategy<Value = IpNet> {
        (any::<u8>(), any::<u8>(), 8u8..=32).prop_map(|(b, c, len)| {
            IpNet::new(IpAddr::V4(Ipv4Addr::new(10, b & 0x0f, c, b ^ c)), len)
                .expect("len <= 32")
                .trunc()
        })
    }

    proptest! {
        #[test]
        fn subtract_covers_exactly_the_difference(
            a in proptest::collection::vec(arb_net(), 0..8),
            m in proptest::collection::vec(arb_net(), 0..8),
            probes in proptest::collection::vec((any::<u8>(), any::<u8>(), any::<u8>()), 0..64),
        ) {
            let out = subtract(&a, &m);
            prop_assert_eq!(normalise(&out), out.clone());
            let mut ips: Vec<IpAddr> = a.iter().chain(&m).flat_map(|n| [n.network(), n.broadcast()]).collect();
            ips.extend(probes.iter().map(|(x, y, z)| IpAddr::V4(Ipv4Addr::new(10, x & 0x0f, *y, *z))));
            for ip in ips {
                let want = a.iter().any(|n| n.contains(&ip)) && !m.iter().any(|n| n.contains(&ip));
                prop_assert_eq!(out.iter().any(|n| n.contains(&ip)), want, "{}", ip);
            }
        }
    }
}
