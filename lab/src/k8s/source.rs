//! What the node does to client sources: a CNI-like masquerade rule, and the node's
//! half of the manager's `preserve` source policy (lab-only code).
//!
//! - [`masquerade_script`] / [`install_masquerade`]: nftables table [`MASQ_TABLE`] in
//!   the node netns. Traffic that comes from the pods' bridge and leaves the node for
//!   an address outside the cluster ranges (pod CIDR, service CIDR) is masqueraded to
//!   the node's address, the way flannel, kindnet or ip-masq-agent do it. Sources in
//!   the set `no_masquerade` are left alone: that is where the tunnel pool goes, so
//!   preserved client sources survive the node (seed 003: "the masquerade rule on the
//!   VPN node must exclude the tunnel range").
//! - [`install_pool_return`]: what a small node agent does for `preserve`, over
//!   rtnetlink in the node netns: the route `pool via <stable gateway> dev <bridge>
//!   onlink` (replies to tunnel IPs go to whichever manager pod currently holds the
//!   gateway address, so the route survives a manager reschedule untouched), loose
//!   rp_filter (2) on the bridge (without the route the node's reverse path for a
//!   tunnel source is the default route, and strict mode drops it), and the pool in
//!   the masquerade exclusion set.
//!
//! I/O: `nft` inside the node netns, one rtnetlink socket opened on a thread that
//! entered the node netns.

use std::net::Ipv4Addr;

use futures::TryStreamExt as _;
use ipnet::Ipv4Net;
use rtnetlink::packet_route::link::{AfSpecInet, AfSpecUnspec, InetDevConf, LinkAttribute};
use rtnetlink::packet_route::route::RouteProtocol;
use rtnetlink::{LinkUnspec, RouteMessageBuilder};

use crate::netns::{Netns, run_checked};
use crate::{LabError, Result};

/// nftables table of the node's masquerade rule (`table ip kvpn_masq`, node netns).
pub const MASQ_TABLE: &str = "kvpn_masq";

/// The manager's default tunnel pool (`kvpn-manager --tunnel-pool`).
pub const TUNNEL_POOL: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(100, 96, 0, 0), 16);

/// The stable gateway of the tunnel pool: an on-link address the live manager pod in
/// `preserve` mode claims on its `eth0` (`kvpn-manager --preserve-gateway`, the
/// default). Link-local, so no pod IP allocation can hand it out; the node's route
/// points at it instead of at a pod IP, which moves on every reschedule.
pub const STABLE_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 96, 1);

/// `rtm_protocol` of the lab's pool route (kvpn's value, see the dataplane).
const RTPROT_KVPN: u8 = 0x6b;

/// The `nft -f` script of the masquerade table: `bridge` is the pods' bridge,
/// `cluster` the ranges that are not masqueraded as destinations, `excluded` the
/// sources never masqueraded. Replaces the table in one transaction.
pub fn masquerade_script(bridge: &str, cluster: &[Ipv4Net], excluded: &[Ipv4Net]) -> String {
    let list = |nets: &[Ipv4Net]| {
        nets.iter()
            .map(|n| n.trunc().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let elements = if excluded.is_empty() {
        String::new()
    } else {
        format!(" elements = {{ {} }};", list(excluded))
    };
    format!(
        "table ip {MASQ_TABLE} {{}}\n\
         delete table ip {MASQ_TABLE}\n\
         table ip {MASQ_TABLE} {{\n\
         \x20 set no_masquerade {{ type ipv4_addr; flags interval;{elements} }}\n\
         \x20 chain postrouting {{\n\
         \x20   type nat hook postrouting priority srcnat; policy accept;\n\
         \x20   ip saddr @no_masquerade return comment \"tunnel pool: sources kept (preserve)\"\n\
         \x20   iifname \"{bridge}\" oifname != \"{bridge}\" ip daddr != {{ {} }} masquerade comment \"pods to outside the cluster\"\n\
         \x20 }}\n\
         }}\n",
        list(cluster)
    )
}

/// Loads [`masquerade_script`] in `node` (no source excluded yet).
pub fn install_masquerade(node: &Netns, bridge: &str, cluster: &[Ipv4Net]) -> Result<()> {
    crate::nft::apply(node, &masquerade_script(bridge, cluster, &[]))
}

/// Adds `pool` to the masquerade exclusion set of [`MASQ_TABLE`] in `node`.
pub fn exclude_from_masquerade(node: &Netns, pool: Ipv4Net) -> Result<()> {
    let mut cmd = node.command("nft");
    cmd.args([
        "add",
        "element",
        "ip",
        MASQ_TABLE,
        "no_masquerade",
        &format!("{{ {} }}", pool.trunc()),
    ]);
    run_checked(&mut cmd).map(|_| ())
}

fn netlink_err(what: String) -> impl FnOnce(rtnetlink::Error) -> LabError {
    move |e| LabError::Io {
        what,
        source: std::io::Error::other(e.to_string()),
    }
}

/// The node agent's `preserve` step (see the module docs): route `pool via gateway dev
/// bridge onlink` (replaced if present), rp_filter 2 on the bridge, and `pool` kept
/// out of the masquerade. Idempotent; nothing here names a pod, so a rescheduled
/// manager needs no new step.
pub fn install_pool_return(
    node: &Netns,
    bridge: &str,
    pool: Ipv4Net,
    gateway: Ipv4Addr,
) -> Result<()> {
    let bridge_name = bridge.to_owned();
    node.run(move || -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| LabError::Io {
                what: "tokio runtime for rtnetlink".into(),
                source,
            })?;
        rt.block_on(async move {
            let (connection, handle, _) =
                rtnetlink::new_connection().map_err(|source| LabError::Io {
                    what: "cannot open a NETLINK_ROUTE socket in the node netns".into(),
                    source,
                })?;
            tokio::spawn(connection);
            let mut links = handle
                .link()
                .get()
                .match_name(bridge_name.clone())
                .execute();
            let index = links
                .try_next()
                .await
                .map_err(netlink_err(format!("find the bridge {bridge_name}")))?
                .map(|l| l.header.index)
                .ok_or_else(|| LabError::Io {
                    what: format!("the node has no bridge {bridge_name}"),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                })?;
            let route = RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(pool.network(), pool.prefix_len())
                .gateway(gateway)
                .output_interface(index)
                .onlink()
                .protocol(RouteProtocol::Other(RTPROT_KVPN))
                .build();
            handle
                .route()
                .add(route)
                .replace()
                .execute()
                .await
                .map_err(netlink_err(format!(
                    "route {pool} via {gateway} dev {bridge_name} onlink"
                )))?;
            let mut conf = InetDevConf::default();
            conf.rp_filter = 2;
            let msg = LinkUnspec::new_with_index(index)
                .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(
                    vec![AfSpecInet::DevConfRequest(conf)],
                )]))
                .build();
            handle
                .link()
                .set(msg)
                .execute()
                .await
                .map_err(netlink_err(format!("rp_filter=2 on {bridge_name}")))?;
            Ok(())
        })
    })??;
    exclude_from_masquerade(node, pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_masquerades_pods_to_outside_and_keeps_excluded_sources() {
        let s = masquerade_script(
            "kvbr",
            &[
                "10.244.0.0/16".parse().expect("net"),
                "10.96.0.0/12".parse().expect("net"),
            ],
            &[TUNNEL_POOL],
        );
        assert!(s.contains("elements = { 100.96.0.0/16 }"), "{s}");
        assert!(
            s.contains(
                "iifname \"kvbr\" oifname != \"kvbr\" ip daddr != { 10.244.0.0/16, 10.96.0.0/12 } masquerade"
            ),
            "{s}"
        );
        let before_masq = s.find("@no_masquerade return").expect("exclusion");
        assert!(before_masq < s.find(" masquerade comment").expect("rule"));
        assert!(!masquerade_script("kvbr", &[], &[]).contains("elements"));
    }
}
