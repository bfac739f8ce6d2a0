//! `kvpn-manager node-agent`: the node side of `--source-policy preserve`
//! (docs/source-policy.md), run by `kvpn connect` as the DaemonSet
//! `kvpn-node-agent` from the manager's own image.
//!
//! Under `preserve` a backend answers the laptop's tunnel IP (100.96.0.0/16), an
//! address no CNI routes. On every node this agent keeps one route for the pool
//! in the main table, towards the manager pod that owns the session:
//! - on the manager pod's node: `POOL via <pod IP> dev <the pod's bridge>`;
//! - on any other node: `POOL via <manager's node IP>` when that address is on a
//!   link of this node (one L2 segment, as kind, k3s on VMs, most on-prem
//!   clusters), else through the gateway this node uses for it (which must then
//!   route the pool itself: a cloud route table; the agent logs that).
//!
//! With several manager replicas the pool goes to the first ready one (by name)
//! and each tunnel IP leased by another replica (a Lease object named after the
//! IP, holder = the replica's pod name) gets a /32 to that replica. The agent
//! reads pods and leases in the manager's namespace every
//! [`RESYNC`], writes only routes tagged with its own protocol number
//! ([`RTPROT_KVPN_NODE`]) and removes them all when it is stopped (the
//! DaemonSet deleted by `kvpn uninstall` or a policy change).
//!
//! Strict reverse-path filtering needs nothing more: with these routes a
//! preserved packet arrives on the interface that routes its source back. The
//! masquerade exclusion is the cluster's (docs/source-policy.md).
//!
//! The decision ([`plan`]) is pure; the shell reads the API server and writes
//! routes over rtnetlink. Privileges: host network, CAP_NET_ADMIN only.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use clap::Parser;
use futures::TryStreamExt as _;
use ipnet::Ipv4Net;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteType,
};
use tracing::{info, warn};

/// How often the agent reads the manager's pods and leases.
pub const RESYNC: Duration = Duration::from_secs(2);

/// The routing protocol number of the agent's routes (`ip route … proto 0x6c`):
/// how it finds its own routes again and never touches anyone else's.
pub const RTPROT_KVPN_NODE: u8 = 0x6c;

/// The main routing table.
const MAIN_TABLE: u32 = 254;

#[derive(Debug, Parser)]
#[command(
    name = "kvpn-manager node-agent",
    about = "the node side of --source-policy preserve: routes the tunnel pool to the manager"
)]
pub struct NodeAgentArgs {
    /// The manager's namespace.
    #[arg(long, default_value = "kvpn-system")]
    pub namespace: String,
    /// Label selector of the manager's pods.
    #[arg(long, default_value = "app.kubernetes.io/name=kvpn-manager")]
    pub selector: String,
    /// The tunnel pool (the laptops' addresses).
    #[arg(long, default_value = "100.96.0.0/16")]
    pub pool: Ipv4Net,
    /// This node's address (the downward API's status.hostIP).
    #[arg(long, env = "NODE_IP")]
    pub node_ip: Ipv4Addr,
}

/// A ready manager replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    pub name: String,
    pub pod_ip: Ipv4Addr,
    pub host_ip: Ipv4Addr,
}

/// One IPv4 route of the node's main table, as far as the plan needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MainRoute {
    pub dst: Ipv4Net,
    pub gateway: Option<Ipv4Addr>,
    pub oif: Option<u32>,
}

/// A route the agent wants.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Wanted {
    pub dst: Ipv4Net,
    pub gateway: Ipv4Addr,
    pub oif: u32,
}

/// The longest-prefix match for `ip` among `routes` (main table, unicast).
fn lookup(routes: &[MainRoute], ip: Ipv4Addr) -> Option<&MainRoute> {
    routes
        .iter()
        .filter(|r| r.dst.contains(&ip))
        .max_by_key(|r| r.dst.prefix_len())
}

/// The next hop towards `replica` from the node `node_ip`: its pod IP on the
/// pod's own node, else its node's IP when on a link of this node, else the
/// gateway this node uses for that node (with a warning text).
fn next_hop(
    replica: &Replica,
    node_ip: Ipv4Addr,
    routes: &[MainRoute],
) -> Result<(Ipv4Addr, u32, Option<String>), String> {
    let target = if replica.host_ip == node_ip {
        replica.pod_ip
    } else {
        replica.host_ip
    };
    let r = lookup(routes, target)
        .ok_or_else(|| format!("no route to {target} (replica {})", replica.name))?;
    let oif = r
        .oif
        .ok_or_else(|| format!("the route to {target} names no interface"))?;
    match r.gateway {
        None => Ok((target, oif, None)),
        Some(gw) => Ok((
            gw,
            oif,
            Some(format!(
                "{target} (replica {}'s {}) is not on a link of this node: the pool goes to \
                 gateway {gw}, which must route it to that node itself",
                replica.name,
                if target == replica.pod_ip {
                    "pod"
                } else {
                    "node"
                }
            )),
        )),
    }
}

/// The routes for `pool` on node `node_ip`: the pool to the first ready
/// replica, and a /32 for each leased tunnel IP (`leases`: IP → holder pod
/// name) whose holder is another ready replica. Warnings name what cannot be
/// routed. Pure.
pub fn plan(
    pool: Ipv4Net,
    node_ip: Ipv4Addr,
    replicas: &[Replica],
    leases: &BTreeMap<Ipv4Addr, String>,
    routes: &[MainRoute],
) -> (Vec<Wanted>, Vec<String>) {
    let mut sorted: Vec<&Replica> = replicas.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut wanted = Vec::new();
    let mut warnings = Vec::new();
    let Some(first) = sorted.first() else {
        return (
            wanted,
            vec!["no ready manager pod: the pool is not routed".to_owned()],
        );
    };
    let mut hop = |dst: Ipv4Net, replica: &Replica| match next_hop(replica, node_ip, routes) {
        Ok((gateway, oif, warning)) => {
            wanted.push(Wanted { dst, gateway, oif });
            warnings.extend(warning);
        }
        Err(why) => warnings.push(format!("cannot route {dst}: {why}")),
    };
    hop(pool, first);
    if sorted.len() > 1 {
        for (ip, holder) in leases {
            if !pool.contains(ip) || holder == &first.name {
                continue;
            }
            if let Some(r) = sorted.iter().find(|r| &r.name == holder) {
                hop(Ipv4Net::from(*ip), r);
            }
        }
    }
    wanted.sort();
    wanted.dedup();
    (wanted, warnings)
}

/// The ready manager pods: name, pod IP, node IP.
fn ready_replicas(pods: &[Pod]) -> Vec<Replica> {
    pods.iter()
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            let ready = status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            if !ready || p.metadata.deletion_timestamp.is_some() {
                return None;
            }
            Some(Replica {
                name: p.metadata.name.clone()?,
                pod_ip: status.pod_ip.as_deref()?.parse().ok()?,
                host_ip: status.host_ip.as_deref()?.parse().ok()?,
            })
        })
        .collect()
}

fn route_of(m: &RouteMessage) -> Option<(MainRoute, u8)> {
    if m.header.address_family != AddressFamily::Inet || m.header.kind != RouteType::Unicast {
        return None;
    }
    let table = m
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table));
    if table != MAIN_TABLE {
        return None;
    }
    let mut dst = Ipv4Addr::UNSPECIFIED;
    let mut gateway = None;
    let mut oif = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => dst = *ip,
            RouteAttribute::Gateway(RouteAddress::Inet(ip)) => gateway = Some(*ip),
            RouteAttribute::Oif(i) => oif = Some(*i),
            _ => {}
        }
    }
    let dst = Ipv4Net::new(dst, m.header.destination_prefix_length).ok()?;
    let protocol = u8::from(m.header.protocol);
    Some((MainRoute { dst, gateway, oif }, protocol))
}

/// The main table's IPv4 unicast routes, each with its protocol number.
async fn main_routes(handle: &rtnetlink::Handle) -> anyhow::Result<Vec<(MainRoute, u8)>> {
    let mut query = RouteMessage::default();
    query.header.address_family = AddressFamily::Inet;
    let mut stream = handle.route().get(query).execute();
    let mut out = Vec::new();
    while let Some(m) = stream
        .try_next()
        .await
        .context("cannot list the node's routes")?
    {
        out.extend(route_of(&m));
    }
    Ok(out)
}

fn message(w: &Wanted) -> RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(w.dst.network(), w.dst.prefix_len())
        .gateway(w.gateway)
        .output_interface(w.oif)
        .protocol(RouteProtocol::Other(RTPROT_KVPN_NODE))
        .build()
}

fn ours(dst: Ipv4Net) -> RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(dst.network(), dst.prefix_len())
        .protocol(RouteProtocol::Other(RTPROT_KVPN_NODE))
        .build()
}

/// Makes the node's routes tagged [`RTPROT_KVPN_NODE`] exactly `wanted`.
async fn converge(handle: &rtnetlink::Handle, wanted: &[Wanted]) -> anyhow::Result<()> {
    let current = main_routes(handle).await?;
    let mine: Vec<&MainRoute> = current
        .iter()
        .filter(|(_, p)| *p == RTPROT_KVPN_NODE)
        .map(|(r, _)| r)
        .collect();
    for w in wanted {
        let present = mine
            .iter()
            .any(|r| r.dst == w.dst && r.gateway == Some(w.gateway) && r.oif == Some(w.oif));
        if !present {
            handle
                .route()
                .add(message(w))
                .replace()
                .execute()
                .await
                .with_context(|| format!("cannot route {} via {}", w.dst, w.gateway))?;
            info!(dst = %w.dst, via = %w.gateway, oif = w.oif, "route set");
        }
    }
    for r in mine {
        if !wanted.iter().any(|w| w.dst == r.dst) {
            handle
                .route()
                .del(ours(r.dst))
                .execute()
                .await
                .with_context(|| format!("cannot remove the route for {}", r.dst))?;
            info!(dst = %r.dst, "route removed");
        }
    }
    Ok(())
}

/// Reads the replicas and leases, then converges the routes; the warnings.
async fn sync_once(
    args: &NodeAgentArgs,
    pods: &Api<Pod>,
    leases: &Api<Lease>,
    handle: &rtnetlink::Handle,
) -> anyhow::Result<Vec<String>> {
    let list = pods
        .list(&ListParams::default().labels(&args.selector))
        .await
        .with_context(|| format!("cannot list the manager's pods in {}", args.namespace))?;
    let replicas = ready_replicas(&list.items);
    let mut held = BTreeMap::new();
    if replicas.len() > 1 {
        let list = leases
            .list(&ListParams::default())
            .await
            .with_context(|| format!("cannot list the tunnel leases in {}", args.namespace))?;
        for l in list.items {
            let ip = l.metadata.name.as_deref().and_then(|n| n.parse().ok());
            let holder = l.spec.and_then(|s| s.holder_identity);
            if let (Some(ip), Some(holder)) = (ip, holder) {
                held.insert(ip, holder);
            }
        }
    }
    let routes: Vec<MainRoute> = main_routes(handle)
        .await?
        .into_iter()
        .filter(|(_, p)| *p != RTPROT_KVPN_NODE)
        .map(|(r, _)| r)
        .collect();
    let (wanted, warnings) = plan(args.pool, args.node_ip, &replicas, &held, &routes);
    converge(handle, &wanted).await?;
    Ok(warnings)
}

/// The agent: resync every [`RESYNC`] until SIGTERM/SIGINT, then remove its routes.
pub async fn run(args: NodeAgentArgs) -> anyhow::Result<()> {
    let config = kube::Config::incluster()
        .map_err(|e| anyhow!("not running in a pod (no in-cluster API config): {e}"))?;
    let client = kube::Client::try_from(config).context("cannot build the API client")?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &args.namespace);
    let leases: Api<Lease> = Api::namespaced(client, &args.namespace);
    let (connection, handle, _) =
        rtnetlink::new_connection().context("cannot open a NETLINK_ROUTE socket")?;
    tokio::spawn(connection);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot watch SIGTERM")?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot watch SIGINT")?;
    info!(node = %args.node_ip, pool = %args.pool, namespace = %args.namespace, "node agent started");
    let mut last_warnings: Vec<String> = Vec::new();
    loop {
        match sync_once(&args, &pods, &leases, &handle).await {
            Ok(warnings) => {
                if warnings != last_warnings {
                    for w in &warnings {
                        warn!("{w}");
                    }
                    last_warnings = warnings;
                }
            }
            Err(e) => warn!("{e:#}"),
        }
        tokio::select! {
            () = tokio::time::sleep(RESYNC) => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    converge(&handle, &[])
        .await
        .context("cannot remove the agent's routes")?;
    info!("node agent stopped; its routes are removed");
    Ok(())
}

/// `kvpn-manager node-agent ARGS…`.
pub fn main_from_args(args: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let args = NodeAgentArgs::parse_from(
        std::iter::once("kvpn-manager node-agent".to_owned()).chain(args),
    );
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?
        .block_on(run(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().expect("ip")
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("net")
    }

    fn replica(name: &str, pod: &str, host: &str) -> Replica {
        Replica {
            name: name.into(),
            pod_ip: ip(pod),
            host_ip: ip(host),
        }
    }

    /// A node on 10.0.0.0/24 (eth0 = 2) with its pod bridge 10.244.2.0/24
    /// (cni0 = 5), a route to another node's pods and a default route.
    fn node_routes() -> Vec<MainRoute> {
        vec![
            MainRoute {
                dst: net("10.0.0.0/24"),
                gateway: None,
                oif: Some(2),
            },
            MainRoute {
                dst: net("10.244.2.0/24"),
                gateway: None,
                oif: Some(5),
            },
            MainRoute {
                dst: net("10.244.3.0/24"),
                gateway: Some(ip("10.0.0.3")),
                oif: Some(2),
            },
            MainRoute {
                dst: net("0.0.0.0/0"),
                gateway: Some(ip("10.0.0.254")),
                oif: Some(2),
            },
        ]
    }

    #[test]
    fn the_pool_goes_to_the_pod_on_its_node_and_to_its_node_elsewhere() {
        let pool = net("100.96.0.0/16");
        let m = [replica("kvpn-manager-a", "10.244.2.7", "10.0.0.2")];
        let (here, w) = plan(pool, ip("10.0.0.2"), &m, &BTreeMap::new(), &node_routes());
        assert_eq!(
            here,
            vec![Wanted {
                dst: pool,
                gateway: ip("10.244.2.7"),
                oif: 5
            }]
        );
        assert!(w.is_empty(), "{w:?}");
        let (there, w) = plan(pool, ip("10.0.0.3"), &m, &BTreeMap::new(), &node_routes());
        assert_eq!(
            there,
            vec![Wanted {
                dst: pool,
                gateway: ip("10.0.0.2"),
                oif: 2
            }]
        );
        assert!(w.is_empty(), "{w:?}");
    }

    #[test]
    fn a_manager_node_off_link_goes_through_the_gateway_with_a_warning() {
        let pool = net("100.96.0.0/16");
        let m = [replica("kvpn-manager-a", "10.244.9.7", "192.168.5.9")];
        let (wanted, w) = plan(pool, ip("10.0.0.2"), &m, &BTreeMap::new(), &node_routes());
        assert_eq!(
            wanted,
            vec![Wanted {
                dst: pool,
                gateway: ip("10.0.0.254"),
                oif: 2
            }]
        );
        assert!(
            w[0].contains("not on a link") && w[0].contains("10.0.0.254"),
            "{w:?}"
        );
    }

    #[test]
    fn leases_of_other_replicas_get_a_host_route_and_no_replica_routes_nothing() {
        let pool = net("100.96.0.0/16");
        let m = [
            replica("kvpn-manager-b", "10.244.3.8", "10.0.0.3"),
            replica("kvpn-manager-a", "10.244.2.7", "10.0.0.2"),
        ];
        let leases: BTreeMap<Ipv4Addr, String> = [
            (ip("100.96.0.2"), "kvpn-manager-a".to_owned()),
            (ip("100.96.0.3"), "kvpn-manager-b".to_owned()),
            (ip("100.96.0.4"), "kvpn-manager-gone".to_owned()),
            (ip("10.1.1.1"), "kvpn-manager-b".to_owned()),
        ]
        .into();
        let (wanted, w) = plan(pool, ip("10.0.0.2"), &m, &leases, &node_routes());
        assert_eq!(
            wanted,
            vec![
                Wanted {
                    dst: pool,
                    gateway: ip("10.244.2.7"),
                    oif: 5
                },
                Wanted {
                    dst: net("100.96.0.3/32"),
                    gateway: ip("10.0.0.3"),
                    oif: 2
                },
            ]
        );
        assert!(w.is_empty(), "{w:?}");
        let (none, w) = plan(pool, ip("10.0.0.2"), &[], &leases, &node_routes());
        assert!(none.is_empty());
        assert!(w[0].contains("no ready manager pod"), "{w:?}");
    }
}
