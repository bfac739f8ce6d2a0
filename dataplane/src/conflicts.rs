//! Route conflicts (case rt-05): cluster ranges that overlap routes the laptop
//! already has (a docker bridge owning 172.20.0.0/16 while the cluster's
//! service CIDR is 172.20.0.0/16, a VPN's 10.0.0.0/8, ...). Pure: the routes come
//! in as [`LaptopRoute`]s read by [`crate::netlink::Netlink::laptop_routes`].
//!
//! Which laptop routes count: every table the kernel holds (main, local and any
//! table a policy rule may select; kvpn does not evaluate the rules, so a route
//! in a table no rule selects is reported too — better a false alarm than a
//! silent hijack), except routes through the session's own TUN device and
//! default routes (`/0`: every laptop has one and a more specific cluster route
//! is what it is for). Routes of kvpn's protocol ([`crate::netlink::RTPROT_KVPN`])
//! through another device belong to another kvpn session — of this root daemon
//! or of a second one (another `--runtime-dir`) — and do conflict: the messages
//! name that session's TUN device and say to check it there rather than
//! blaming a foreign owner.
//!
//! A `kvpn run` session's TUN device is no conflict at all: its routes live in the
//! run's own table ([`crate::run_scope`]), which only that run's marked sockets
//! consult, so every route through such a device (its table's, and the local
//! table's entry for its tunnel IP) is left out.
//!
//! With the override (`kvpn connect --allow-route-conflict`), cluster-bound
//! traffic is steered without touching the laptop's route:
//! - a cluster range *inside* (or wider than) the laptop route but not equal to
//!   it is installed as usual: the kernel's longest-prefix match gives the more
//!   specific one its addresses, so the laptop's more specific subnet stays the
//!   laptop's and a more specific cluster range is the cluster's;
//! - a cluster range *equal* to a laptop route in the main table is not
//!   installed (the kernel refuses a second route with the same prefix and
//!   metric, and a lower metric would take the laptop's whole subnet);
//! - the known ClusterIPs (the route watch's Services) inside the laptop route
//!   get `/32` (`/128`) host routes through the TUN device ([`pinned_hosts`]), so
//!   they win over the laptop route by prefix length while every other address
//!   of the laptop's subnet still goes to the laptop's device.
//!
//! Routes cannot win over a laptop route in a table that a policy rule consults
//! before main (another VPN: `ip rule add to 10.244.0.0/16 lookup 100 pref 100`):
//! kvpn's main-table routes are then never looked at. With `--steer ebpf` the
//! devices of such routes ([`steer_targets`]: IPv4 conflicts outside the main and
//! local tables) get the eBPF steering program (`crate::ebpf::steer`), which
//! redirects their cluster-bound packets into the TUN device.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ebpf::RouteKind;

/// `rtm_table` of the main table (include/uapi/linux/rtnetlink.h RT_TABLE_MAIN).
pub const TABLE_MAIN: u32 = 254;
/// `rtm_table` of the local table (RT_TABLE_LOCAL).
pub const TABLE_LOCAL: u32 = 255;

/// A route of the laptop as read from the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaptopRoute {
    /// Destination prefix.
    pub dst: IpNet,
    /// Output device name (empty for routes without one, e.g. blackhole).
    pub dev: String,
    /// Output interface index (0 = none).
    pub oif: u32,
    /// `rtm_protocol`.
    pub protocol: u8,
    /// Routing table id.
    pub table: u32,
    /// `rtm_type` (1 unicast, 2 local, 3 broadcast, 6 blackhole, ...).
    pub kind: u8,
}

impl LaptopRoute {
    /// How `ip route` would name it: `172.20.0.0/16 dev br0 (proto kernel, table main)`.
    pub fn describe(&self) -> String {
        let ty = match self.kind {
            1 => "",
            2 => "local ",
            3 => "broadcast ",
            6 => "blackhole ",
            7 => "unreachable ",
            8 => "prohibit ",
            _ => "",
        };
        let dev = if self.dev.is_empty() {
            String::new()
        } else {
            format!(" dev {}", self.dev)
        };
        format!(
            "{ty}{}{dev} (proto {}, table {})",
            self.dst,
            protocol_name(self.protocol),
            table_name(self.table)
        )
    }
}

/// iproute2's name of a route protocol (/etc/iproute2/rt_protos).
pub fn protocol_name(p: u8) -> String {
    match p {
        0 => "unspec".into(),
        1 => "redirect".into(),
        2 => "kernel".into(),
        3 => "boot".into(),
        4 => "static".into(),
        8 => "gated".into(),
        9 => "ra".into(),
        11 => "zebra".into(),
        12 => "bird".into(),
        16 => "dhcp".into(),
        18 => "keepalived".into(),
        42 => "babel".into(),
        186 => "bgp".into(),
        187 => "isis".into(),
        188 => "ospf".into(),
        189 => "rip".into(),
        crate::netlink::RTPROT_KVPN => "kvpn".into(),
        other => other.to_string(),
    }
}

/// iproute2's name of a routing table.
pub fn table_name(t: u32) -> String {
    match t {
        253 => "default".into(),
        TABLE_MAIN => "main".into(),
        TABLE_LOCAL => "local".into(),
        other => other.to_string(),
    }
}

/// The word for a route kind in messages.
pub fn kind_name(kind: RouteKind) -> &'static str {
    match kind {
        RouteKind::Pod => "pod CIDR",
        RouteKind::Service => "service CIDR",
        RouteKind::Extra => "extra CIDR",
    }
}

/// One cluster range overlapping one laptop route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    /// The cluster range (truncated).
    pub cluster: IpNet,
    /// Its kind.
    pub kind: RouteKind,
    /// The laptop's route.
    pub laptop: LaptopRoute,
    /// The route's device is another kvpn session's TUN device (it carries
    /// routes of kvpn's protocol), not something else on the laptop.
    pub other_kvpn: bool,
}

impl Conflict {
    /// Whether both are the same prefix in the main table, where kvpn's route
    /// cannot be added next to the laptop's.
    pub fn exact_in_main(&self) -> bool {
        self.cluster == self.laptop.dst && self.laptop.table == TABLE_MAIN
    }

    /// The addresses the laptop route claims among the cluster range's: the
    /// more specific of the two prefixes.
    pub fn contested(&self) -> IpNet {
        if self.cluster.prefix_len() >= self.laptop.dst.prefix_len() {
            self.cluster
        } else {
            self.laptop.dst
        }
    }
}

impl fmt::Display for Conflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} overlaps {}",
            kind_name(self.kind),
            self.cluster,
            self.laptop.describe()
        )?;
        if self.other_kvpn {
            write!(
                f,
                ", the TUN device of another kvpn session (this root daemon's or another one's)"
            )?;
        }
        Ok(())
    }
}

fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The conflicts between cluster `ranges` and the laptop's `routes`, leaving out
/// routes through `own_oif` (the session's TUN device, if it exists yet) and
/// default routes. A device carrying routes of `kvpn_protocol` is another kvpn
/// session's TUN device ([`Conflict::other_kvpn`]). Sorted by cluster range,
/// then laptop route.
pub fn find(
    ranges: &[(IpNet, RouteKind)],
    routes: &[LaptopRoute],
    kvpn_protocol: u8,
    own_oif: Option<u32>,
) -> Vec<Conflict> {
    let run_tables = crate::run_scope::RUN_TABLE_BASE
        ..crate::run_scope::RUN_TABLE_BASE + u32::from(crate::run_scope::MAX_RUN_SESSIONS);
    let run_devs: BTreeSet<&str> = routes
        .iter()
        .filter(|r| {
            r.protocol == kvpn_protocol && run_tables.contains(&r.table) && !r.dev.is_empty()
        })
        .map(|r| r.dev.as_str())
        .collect();
    let is_own = |r: &LaptopRoute| {
        (own_oif.is_some_and(|o| o == r.oif) && r.oif != 0) || run_devs.contains(r.dev.as_str())
    };
    let kvpn_devs: BTreeSet<&str> = routes
        .iter()
        .filter(|r| r.protocol == kvpn_protocol && !r.dev.is_empty() && !is_own(r))
        .map(|r| r.dev.as_str())
        .collect();
    let mut out = Vec::new();
    for (cluster, kind) in ranges {
        let cluster = cluster.trunc();
        for r in routes {
            if r.dst.prefix_len() == 0 || is_own(r) || !overlaps(&cluster, &r.dst) {
                continue;
            }
            let c = Conflict {
                cluster,
                kind: *kind,
                laptop: r.clone(),
                other_kvpn: kvpn_devs.contains(r.dev.as_str()),
            };
            if !out.contains(&c) {
                out.push(c);
            }
        }
    }
    // The local table's entries for a device's own addresses (local,
    // broadcast) add nothing when the same device's prefix route conflicts
    // already: one line per owner.
    let prefix_routes: Vec<(IpNet, IpNet, String)> = out
        .iter()
        .filter(|c| c.laptop.table != TABLE_LOCAL)
        .map(|c| (c.cluster, c.laptop.dst, c.laptop.dev.clone()))
        .collect();
    out.retain(|c| {
        c.laptop.table != TABLE_LOCAL
            || !prefix_routes.iter().any(|(cluster, dst, dev)| {
                *cluster == c.cluster && *dev == c.laptop.dev && dst.contains(&c.laptop.dst)
            })
    });
    out.sort_by(|a, b| {
        (a.cluster, a.laptop.dst, a.laptop.table, &a.laptop.dev).cmp(&(
            b.cluster,
            b.laptop.dst,
            b.laptop.table,
            &b.laptop.dev,
        ))
    });
    out
}

/// The refusal message for `conflicts` (non-empty), naming both owners of each
/// and the override.
pub fn refusal(conflicts: &[Conflict]) -> String {
    let list: Vec<String> = conflicts.iter().map(ToString::to_string).collect();
    let kvpn_devs: BTreeSet<&str> = conflicts
        .iter()
        .filter(|c| c.other_kvpn)
        .map(|c| c.laptop.dev.as_str())
        .collect();
    if !kvpn_devs.is_empty() {
        let devs: Vec<&str> = kvpn_devs.into_iter().collect();
        return format!(
            "{} — another kvpn session already routes these addresses through {}; nothing was \
             installed. Find it with `kvpn status` (with the other root daemon's \
             --runtime-dir if it runs in another one) and `kvpn disconnect` it there, or pass \
             --allow-route-conflict to keep it and steer only cluster-bound traffic (known \
             ClusterIPs as /32 routes) through this session",
            list.join("; "),
            devs.join(", ")
        );
    }
    format!(
        "{} — the laptop already routes these addresses elsewhere; nothing was installed. \
         Remove or renumber the laptop's route (e.g. the docker network owning it), or pass \
         --allow-route-conflict to keep the laptop's route and steer only cluster-bound \
         traffic (known ClusterIPs as /32 routes) through kvpn",
        list.join("; ")
    )
}

/// Host routes (`/32`, `/128`) that steer the known cluster addresses `ips`
/// (ClusterIPs) past the laptop routes of `conflicts`: each address inside a
/// conflict's cluster range and inside its laptop route.
pub fn pinned_hosts<'a>(
    conflicts: &[Conflict],
    ips: impl IntoIterator<Item = &'a IpAddr>,
) -> BTreeSet<IpNet> {
    let mut out = BTreeSet::new();
    for ip in ips {
        if conflicts
            .iter()
            .any(|c| c.cluster.contains(ip) && c.laptop.dst.contains(ip))
        {
            out.insert(IpNet::from(*ip));
        }
    }
    out
}

/// The laptop devices `--steer ebpf` attaches to: those of conflicting routes outside
/// the main and local tables (a table a policy rule may consult before main, where
/// kvpn's routes cannot win), each once, as (name, ifindex). Main-table conflicts are
/// left to routes (they win there by prefix length, and the laptop's own subnet
/// stays the laptop's). An IPv6 conflict outside main/local is an error: steering is
/// IPv4 only. Connect refuses on the first error; the steering watch
/// ([`crate::steer_watch`]) steers the devices it can and reports the errors.
pub fn steer_targets(conflicts: &[Conflict]) -> Result<Vec<(String, u32)>, String> {
    let plan = steer_plan(conflicts);
    match plan.errors.into_iter().next() {
        Some(error) => Err(error),
        None => Ok(plan.devices),
    }
}

/// What [`steer_targets`]' rules make of `conflicts`, every error kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SteerPlan {
    /// Devices to steer, each once, as (name, ifindex), in conflict order.
    pub devices: Vec<(String, u32)>,
    /// Conflicts steering cannot handle (IPv6 outside main/local), as messages.
    pub errors: Vec<String>,
}

/// [`steer_targets`] without stopping at the first error.
pub fn steer_plan(conflicts: &[Conflict]) -> SteerPlan {
    let mut plan = SteerPlan::default();
    for c in conflicts {
        if matches!(c.laptop.table, TABLE_MAIN | TABLE_LOCAL) || c.laptop.oif == 0 {
            continue;
        }
        if c.cluster.addr().is_ipv6() {
            plan.errors.push(format!(
                "{c}: --steer ebpf steers IPv4 only and routes cannot win over a route \
                 in table {} — leave out --steer ebpf (and handle this range yourself) \
                 or remove the IPv6 range from the session",
                table_name(c.laptop.table)
            ));
            continue;
        }
        if !plan.devices.iter().any(|(_, oif)| *oif == c.laptop.oif) {
            plan.devices.push((c.laptop.dev.clone(), c.laptop.oif));
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test CIDR")
    }

    fn route(dst: &str, dev: &str, protocol: u8, table: u32) -> LaptopRoute {
        LaptopRoute {
            dst: net(dst),
            dev: dev.into(),
            oif: 7,
            protocol,
            table,
            kind: 1,
        }
    }

    #[test]
    fn rt_05_exact_inside_and_wider_routes_conflict_kvpn_and_default_do_not() {
        let ranges = [
            (net("172.20.0.0/16"), RouteKind::Service),
            (net("10.244.0.0/16"), RouteKind::Pod),
        ];
        let routes = [
            route("172.20.0.0/16", "br-kvpnx", 2, TABLE_MAIN),
            route("172.20.5.0/24", "br-inner", 4, TABLE_MAIN),
            route("10.0.0.0/8", "wg0", 3, 52),
            route("0.0.0.0/0", "eth0", 16, TABLE_MAIN),
            route("172.21.0.0/16", "br-other", 2, TABLE_MAIN),
        ];
        let got = find(&ranges, &routes, 107, Some(99));
        let text: Vec<String> = got.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            vec![
                "pod CIDR 10.244.0.0/16 overlaps 10.0.0.0/8 dev wg0 (proto boot, table 52)",
                "service CIDR 172.20.0.0/16 overlaps 172.20.0.0/16 dev br-kvpnx (proto kernel, table main)",
                "service CIDR 172.20.0.0/16 overlaps 172.20.5.0/24 dev br-inner (proto static, table main)",
            ]
        );
        assert!(!got[0].exact_in_main());
        assert!(got[1].exact_in_main());
        assert_eq!(got[0].contested(), net("10.244.0.0/16"));
        assert_eq!(got[2].contested(), net("172.20.5.0/24"));
        let msg = refusal(&got);
        assert!(msg.contains("--allow-route-conflict"), "{msg}");
        assert!(msg.contains("br-kvpnx"), "{msg}");
    }

    /// A `kvpn run` session's TUN device (routes in a run table) is nobody's
    /// conflict: not its table's routes, not the local entry of its tunnel IP
    /// (trial F6: a connect listed them as unhandled conflicts).
    #[test]
    fn a_run_sessions_tun_device_is_no_conflict() {
        let run_table = crate::run_scope::RUN_TABLE_BASE + 3;
        let ranges = [
            (net("10.96.0.0/12"), RouteKind::Service),
            (net("100.96.0.0/16"), RouteKind::Extra),
        ];
        let mut local = route("100.96.0.2/32", "kvpn1", 2, TABLE_LOCAL);
        local.oif = 8;
        let mut in_run = route("10.96.0.0/12", "kvpn1", 107, run_table);
        in_run.oif = 8;
        let other = route("10.96.0.0/12", "kvpn5", 107, TABLE_MAIN);
        let got = find(&ranges, &[local, in_run, other], 107, Some(99));
        let text: Vec<String> = got.iter().map(ToString::to_string).collect();
        assert_eq!(text.len(), 1, "{text:?}");
        assert!(text[0].contains("dev kvpn5"), "{text:?}");
    }

    #[test]
    fn local_entries_of_a_conflicting_device_collapse_into_its_prefix_route() {
        let ranges = [(net("10.96.0.0/12"), RouteKind::Service)];
        let mut local = route("10.96.255.1/32", "br", 2, TABLE_LOCAL);
        local.kind = 2;
        let mut other = route("10.100.0.1/32", "eth9", 2, TABLE_LOCAL);
        other.kind = 2;
        let routes = [route("10.96.0.0/12", "br", 2, TABLE_MAIN), local, other];
        let got: Vec<String> = find(&ranges, &routes, 107, None)
            .iter()
            .map(|c| c.laptop.describe())
            .collect();
        assert_eq!(
            got,
            vec![
                "10.96.0.0/12 dev br (proto kernel, table main)",
                "local 10.100.0.1/32 dev eth9 (proto kernel, table local)",
            ]
        );
    }

    /// A second root daemon (another --runtime-dir) owns kvpn0 with the same
    /// service CIDR: the conflict names kvpn0 as another kvpn session's TUN
    /// device, and the fix is `kvpn status` / `kvpn disconnect` there — not the
    /// "docker network" advice for foreign owners.
    #[test]
    fn rt_05_another_kvpn_sessions_tun_is_named_as_such() {
        let ranges = [(net("10.96.0.0/12"), RouteKind::Service)];
        let mut other = route("10.96.0.0/12", "kvpn0", 107, TABLE_MAIN);
        other.oif = 31;
        let mut tun_ip = route("100.96.0.2/32", "kvpn0", 2, TABLE_LOCAL);
        tun_ip.oif = 31;
        tun_ip.kind = 2;
        let foreign = route("10.100.0.0/16", "br-x", 2, TABLE_MAIN);
        let got = find(&ranges, &[other, tun_ip, foreign.clone()], 107, None);
        assert_eq!(got.len(), 2, "{got:#?}");
        assert!(got[0].other_kvpn && got[0].exact_in_main(), "{got:#?}");
        assert!(!got[1].other_kvpn, "br-x is no kvpn device: {got:#?}");
        assert_eq!(
            got[0].to_string(),
            "service CIDR 10.96.0.0/12 overlaps 10.96.0.0/12 dev kvpn0 (proto kvpn, table main), \
             the TUN device of another kvpn session (this root daemon's or another one's)"
        );
        let msg = refusal(&got);
        assert!(
            msg.contains("another kvpn session already routes these addresses through kvpn0"),
            "{msg}"
        );
        assert!(
            msg.contains("kvpn status") && msg.contains("kvpn disconnect"),
            "{msg}"
        );
        assert!(!msg.contains("docker"), "{msg}");
        // Only foreign owners: the old advice.
        let only_foreign = find(&ranges, &[foreign], 107, None);
        assert!(refusal(&only_foreign).contains("docker network"));
    }

    #[test]
    fn own_tun_routes_are_not_conflicts() {
        let mut r = route("10.96.0.0/12", "kvpn3", 2, 255);
        r.oif = 42;
        let mut kvpn_route = route("10.96.0.0/12", "kvpn3", 107, TABLE_MAIN);
        kvpn_route.oif = 42;
        assert!(
            find(
                &[(net("10.96.0.0/12"), RouteKind::Service)],
                &[r, kvpn_route],
                107,
                Some(42)
            )
            .is_empty()
        );
    }

    #[test]
    fn cluster_ips_inside_conflicting_routes_are_pinned() {
        let ranges = [(net("172.20.0.0/16"), RouteKind::Service)];
        let routes = [route("172.20.5.0/24", "br", 2, TABLE_MAIN)];
        let c = find(&ranges, &routes, 107, None);
        let ips: Vec<IpAddr> = ["172.20.5.9", "172.20.9.9", "10.1.1.1"]
            .iter()
            .map(|s| s.parse().expect("ip"))
            .collect();
        assert_eq!(
            pinned_hosts(&c, ips.iter()).into_iter().collect::<Vec<_>>(),
            vec![net("172.20.5.9/32")]
        );
    }

    #[test]
    fn rt_05_steer_targets_are_devices_of_non_main_conflicts_ipv4_only() {
        let ranges = [
            (net("172.20.0.0/16"), RouteKind::Service),
            (net("10.244.0.0/16"), RouteKind::Pod),
        ];
        let routes = [
            route("172.20.0.0/16", "br-kvpnx", 2, TABLE_MAIN),
            route("10.244.0.0/16", "vpn0", 4, 100),
            route("10.0.0.0/8", "vpn0", 4, 100),
        ];
        let found = find(&ranges, &routes, 107, Some(99));
        assert_eq!(steer_targets(&found), Ok(vec![("vpn0".to_owned(), 7)]));

        let v6 = [(net("fd00:10::/64"), RouteKind::Pod)];
        let found = find(&v6, &[route("fd00::/8", "vpn0", 4, 100)], 107, Some(99));
        let err = steer_targets(&found).expect_err("IPv6 refused");
        assert!(err.contains("IPv4 only"), "{err}");
        // In the main table routes do the job: nothing to steer, nothing refused.
        let found = find(
            &v6,
            &[route("fd00::/8", "br0", 4, TABLE_MAIN)],
            107,
            Some(99),
        );
        assert_eq!(steer_targets(&found), Ok(Vec::new()));
    }

    /// The steering watch keeps steering what it can beside an IPv6 conflict that
    /// connect would refuse.
    #[test]
    fn rt_05_steer_plan_keeps_the_ipv4_devices_beside_an_ipv6_error() {
        let ranges = [
            (net("10.244.0.0/16"), RouteKind::Pod),
            (net("fd00:10::/64"), RouteKind::Pod),
        ];
        let mut v6 = route("fd00::/8", "vpn6", 4, 100);
        v6.oif = 8;
        let routes = [route("10.244.0.0/16", "vpn0", 4, 100), v6];
        let plan = steer_plan(&find(&ranges, &routes, 107, Some(99)));
        assert_eq!(plan.devices, vec![("vpn0".to_owned(), 7)]);
        assert_eq!(plan.errors.len(), 1, "{plan:?}");
        assert!(plan.errors[0].contains("vpn6"), "{plan:?}");
        assert!(steer_targets(&find(&ranges, &routes, 107, Some(99))).is_err());
    }
}
