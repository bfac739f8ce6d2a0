//! Route and DNS discovery for `WatchRoutes`: the pure core. No I/O, no clock.
//!
//! [`Discovery`] takes the events of three Kubernetes watches (nodes, pods and
//! Services in all namespaces, as [`WatchEvent`]s with the objects already reduced
//! to what routing needs: [`NodeInfo`], [`PodInfo`], [`ServiceInfo`]) and answers
//! with a [`View`]: the cluster's pod CIDRs, its Services and its DNS settings.
//! [`delta`] turns two views into the `RoutesUpdate` a client gets (a snapshot
//! when it has seen nothing yet), with the DNS search list for the client's
//! namespace ([`search_list`]).
//!
//! Pod CIDRs: node `spec.podCIDRs` where nodes are readable, plus a /24 (IPv6:
//! /64) around every pod IP that no node podCIDR covers
//! ([`kvpn_proto::cidr::infer_covering`]: merged only where blocks are adjacent
//! siblings, never wider); hostNetwork pods and finished pods (Succeeded,
//! Failed) are left out, their IPs are node addresses or free for reuse.
//!
//! Re-lists: a watch that restarts (`Init`, `InitApply`…, `InitDone`) replaces
//! its whole table at `InitDone`, so objects deleted while the watch was down
//! disappear; until then the old table stays in force. The view exists once
//! every watched resource finished its first list ([`Discovery::view`] is
//! `None` before).
//!
//! The tokio shell that runs the watches, debounces and serves subscribers is
//! [`crate::route_watch`].

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use kvpn_proto::cidr::{self, InferPolicy};
use kvpn_proto::manager as api;

/// `namespace/name` of an object (`namespace` empty for cluster-scoped ones).
pub type Key = (String, String);

/// An event of one watch, on reduced objects (`T`), in kube-runtime's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent<T> {
    /// An object was added or changed.
    Apply(T),
    /// An object was deleted.
    Delete(Key),
    /// The watch (re)starts listing: `InitApply`s follow, then `InitDone`.
    Init,
    /// An object of the (re)list.
    InitApply(T),
    /// The (re)list is complete: its objects replace the table.
    InitDone,
}

/// What routing needs of a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `spec.podCIDRs` (or `spec.podCIDR`), unparsable entries dropped.
    pub pod_cidrs: Vec<IpNet>,
}

/// What routing needs of a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    /// `status.podIPs` (or `status.podIP`); empty for hostNetwork pods, pods
    /// without an IP yet and finished pods (see the module docs).
    pub ips: Vec<IpAddr>,
}

/// A Service port.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PortInfo {
    /// Empty for a single unnamed port.
    pub name: String,
    pub port: u16,
    /// "TCP", "UDP", "SCTP".
    pub protocol: String,
}

/// What routing and DNS need of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    pub namespace: String,
    pub name: String,
    /// `spec.clusterIPs` (or `spec.clusterIP`); empty for headless Services
    /// ("None") and ExternalName Services.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<PortInfo>,
}

/// Settings of the discovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// The cluster domain, e.g. "cluster.local" (manager flag `--cluster-domain`).
    pub cluster_domain: String,
    /// The Service whose ClusterIPs are the cluster DNS servers
    /// (`kube-system/kube-dns` on kubeadm, kind, k3s, GKE, EKS…).
    pub dns_service: Key,
    /// How wide a block goes around a pod IP no node podCIDR covers.
    pub infer: InferPolicy,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            cluster_domain: "cluster.local".to_owned(),
            dns_service: ("kube-system".to_owned(), "kube-dns".to_owned()),
            infer: InferPolicy::default(),
        }
    }
}

/// The cluster as the watches see it: what every subscriber's deltas are
/// computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// Normalised pod CIDRs.
    pub pod_cidrs: Vec<IpNet>,
    /// Where they come from, for people.
    pub pod_cidr_source: String,
    /// Services by `namespace/name`.
    pub services: BTreeMap<Key, ServiceInfo>,
    /// ClusterIPs of the DNS Service (empty while it does not exist).
    pub dns_servers: Vec<IpAddr>,
    /// The cluster domain.
    pub domain: String,
}

/// One watched resource's objects.
#[derive(Debug)]
struct Table<T> {
    items: BTreeMap<Key, T>,
    /// Objects of a re-list in progress (`Init` seen, `InitDone` not yet).
    relist: Option<BTreeMap<Key, T>>,
    /// A list completed at least once.
    listed: bool,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Self {
            items: BTreeMap::new(),
            relist: None,
            listed: false,
        }
    }
}

impl<T: PartialEq> Table<T> {
    /// Apply `event`; whether the table (as the view sees it) changed.
    fn handle(&mut self, event: WatchEvent<T>, key_of: impl Fn(&T) -> Key) -> bool {
        match event {
            WatchEvent::Apply(obj) => {
                let key = key_of(&obj);
                if let Some(relist) = &mut self.relist {
                    // kube-runtime sends no Apply during a list; keep both tables right anyway.
                    relist.remove(&key);
                }
                let same = self.items.get(&key) == Some(&obj);
                self.items.insert(key, obj);
                !same
            }
            WatchEvent::Delete(key) => {
                if let Some(relist) = &mut self.relist {
                    relist.remove(&key);
                }
                self.items.remove(&key).is_some()
            }
            WatchEvent::Init => {
                self.relist = Some(BTreeMap::new());
                false
            }
            WatchEvent::InitApply(obj) => {
                let key = key_of(&obj);
                self.relist
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, obj);
                false
            }
            WatchEvent::InitDone => {
                let fresh = self.relist.take().unwrap_or_default();
                let changed = fresh != self.items || !self.listed;
                self.items = fresh;
                self.listed = true;
                changed
            }
        }
    }
}

/// Whether nodes are watched, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NodeSource {
    /// The node watch runs (or is about to list).
    Watched,
    /// Nodes cannot be read (RBAC); the reason, for `pod_cidr_source`.
    Unreadable(String),
}

/// The discovery state: one table per watched resource.
#[derive(Debug)]
pub struct Discovery {
    config: DiscoveryConfig,
    nodes: Table<NodeInfo>,
    node_source: NodeSource,
    pods: Table<PodInfo>,
    services: Table<ServiceInfo>,
}

impl Discovery {
    /// Nothing known yet; nodes count as watched until
    /// [`Self::handle_nodes_unreadable`] says otherwise.
    pub fn new(config: DiscoveryConfig) -> Self {
        Self {
            config,
            nodes: Table::default(),
            node_source: NodeSource::Watched,
            pods: Table::default(),
            services: Table::default(),
        }
    }

    /// A node watch event; whether the view changed.
    pub fn handle_node(&mut self, event: WatchEvent<NodeInfo>) -> bool {
        self.nodes
            .handle(event, |n| (String::new(), n.name.clone()))
    }

    /// Nodes cannot be read (e.g. 403): pod CIDRs come from pod IPs alone.
    pub fn handle_nodes_unreadable(&mut self, reason: String) -> bool {
        let changed = self.node_source != NodeSource::Unreadable(reason.clone());
        self.node_source = NodeSource::Unreadable(reason);
        self.nodes = Table::default();
        changed
    }

    /// A pod watch event; whether the view changed.
    pub fn handle_pod(&mut self, event: WatchEvent<PodInfo>) -> bool {
        self.pods
            .handle(event, |p| (p.namespace.clone(), p.name.clone()))
    }

    /// A Service watch event; whether the view changed.
    pub fn handle_service(&mut self, event: WatchEvent<ServiceInfo>) -> bool {
        self.services
            .handle(event, |s| (s.namespace.clone(), s.name.clone()))
    }

    /// Whether every watched resource finished its first list.
    pub fn ready(&self) -> bool {
        let nodes = match self.node_source {
            NodeSource::Watched => self.nodes.listed,
            NodeSource::Unreadable(_) => true,
        };
        nodes && self.pods.listed && self.services.listed
    }

    /// The current view; `None` until [`Self::ready`].
    pub fn view(&self) -> Option<View> {
        if !self.ready() {
            return None;
        }
        let node_cidrs: Vec<IpNet> = self
            .nodes
            .items
            .values()
            .flat_map(|n| n.pod_cidrs.iter().copied())
            .collect();
        let pod_ips: Vec<IpAddr> = self
            .pods
            .items
            .values()
            .flat_map(|p| p.ips.iter().copied())
            .collect();
        let stray = cidr::uncovered(&pod_ips, &node_cidrs);
        let mut all = node_cidrs.clone();
        all.extend(cidr::infer_covering(&stray, self.config.infer));
        let pod_cidr_source = match &self.node_source {
            NodeSource::Watched if stray.is_empty() => "node podCIDRs".to_owned(),
            NodeSource::Watched => format!(
                "node podCIDRs, and /{} blocks around {} pod IP(s) outside them",
                self.config.infer.v4_prefix_len,
                stray.len()
            ),
            NodeSource::Unreadable(why) => format!(
                "pod IPs (/{} blocks around each; nodes not readable: {why})",
                self.config.infer.v4_prefix_len
            ),
        };
        let dns_servers = self
            .services
            .items
            .get(&self.config.dns_service)
            .map(|s| s.cluster_ips.clone())
            .unwrap_or_default();
        Some(View {
            pod_cidrs: cidr::normalise(&all),
            pod_cidr_source,
            services: self.services.items.clone(),
            dns_servers,
            domain: self.config.cluster_domain.clone(),
        })
    }
}

/// The DNS search list of a pod in `namespace` (empty = "default"), as the
/// kubelet writes it into resolv.conf: `<ns>.svc.<domain> svc.<domain> <domain>`.
pub fn search_list(namespace: &str, domain: &str) -> Vec<String> {
    let ns = if namespace.is_empty() {
        "default"
    } else {
        namespace
    };
    vec![
        format!("{ns}.svc.{domain}"),
        format!("svc.{domain}"),
        domain.to_owned(),
    ]
}

fn service_record(s: &ServiceInfo) -> api::ServiceRecord {
    api::ServiceRecord {
        namespace: s.namespace.clone(),
        name: s.name.clone(),
        cluster_ips: s.cluster_ips.iter().map(ToString::to_string).collect(),
        ports: s
            .ports
            .iter()
            .map(|p| api::ServicePort {
                name: p.name.clone(),
                port: u32::from(p.port),
                protocol: p.protocol.clone(),
            })
            .collect(),
    }
}

fn dns(view: &View, namespace: &str) -> api::ClusterDns {
    api::ClusterDns {
        servers: view.dns_servers.iter().map(ToString::to_string).collect(),
        domain: view.domain.clone(),
        search: search_list(namespace, &view.domain),
    }
}

/// The update that takes a client who has seen `old` (`None`: nothing yet) to
/// `new`, for a client in `namespace`; `None` when nothing changed.
pub fn delta(old: Option<&View>, new: &View, namespace: &str) -> Option<api::RoutesUpdate> {
    let Some(old) = old else {
        return Some(api::RoutesUpdate {
            snapshot: true,
            pod_cidrs_added: new.pod_cidrs.iter().map(ToString::to_string).collect(),
            pod_cidrs_removed: Vec::new(),
            services_upserted: new.services.values().map(service_record).collect(),
            services_removed: Vec::new(),
            dns: Some(dns(new, namespace)),
            pod_cidr_source: new.pod_cidr_source.clone(),
        });
    };
    let added: Vec<String> = new
        .pod_cidrs
        .iter()
        .filter(|c| !old.pod_cidrs.contains(c))
        .map(ToString::to_string)
        .collect();
    let removed: Vec<String> = old
        .pod_cidrs
        .iter()
        .filter(|c| !new.pod_cidrs.contains(c))
        .map(ToString::to_string)
        .collect();
    let upserted: Vec<api::ServiceRecord> = new
        .services
        .iter()
        .filter(|(k, s)| old.services.get(*k) != Some(*s))
        .map(|(_, s)| service_record(s))
        .collect();
    let gone: Vec<api::ServiceKey> = old
        .services
        .keys()
        .filter(|k| !new.services.contains_key(*k))
        .map(|(namespace, name)| api::ServiceKey {
            namespace: namespace.clone(),
            name: name.clone(),
        })
        .collect();
    let dns_changed = old.dns_servers != new.dns_servers || old.domain != new.domain;
    let source_changed = old.pod_cidr_source != new.pod_cidr_source;
    if added.is_empty()
        && removed.is_empty()
        && upserted.is_empty()
        && gone.is_empty()
        && !dns_changed
        && !source_changed
    {
        return None;
    }
    Some(api::RoutesUpdate {
        snapshot: false,
        pod_cidrs_added: added,
        pod_cidrs_removed: removed,
        services_upserted: upserted,
        services_removed: gone,
        dns: dns_changed.then(|| dns(new, namespace)),
        pod_cidr_source: if source_changed {
            new.pod_cidr_source.clone()
        } else {
            String::new()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn net(s: &str) -> IpNet {
        s.parse().expect("test CIDR")
    }

    fn pod(ns: &str, name: &str, ips: &[&str]) -> PodInfo {
        PodInfo {
            namespace: ns.into(),
            name: name.into(),
            ips: ips.iter().map(|s| ip(s)).collect(),
        }
    }

    fn svc(ns: &str, name: &str, ips: &[&str], port: u16) -> ServiceInfo {
        ServiceInfo {
            namespace: ns.into(),
            name: name.into(),
            cluster_ips: ips.iter().map(|s| ip(s)).collect(),
            ports: vec![PortInfo {
                name: String::new(),
                port,
                protocol: "TCP".into(),
            }],
        }
    }

    fn node(name: &str, cidrs: &[&str]) -> NodeInfo {
        NodeInfo {
            name: name.into(),
            pod_cidrs: cidrs.iter().map(|s| net(s)).collect(),
        }
    }

    /// A discovery whose three watches each listed `pods`/`services`/`nodes`.
    fn listed(
        nodes: Option<Vec<NodeInfo>>,
        pods: Vec<PodInfo>,
        services: Vec<ServiceInfo>,
    ) -> Discovery {
        let mut d = Discovery::new(DiscoveryConfig::default());
        match nodes {
            Some(nodes) => {
                d.handle_node(WatchEvent::Init);
                for n in nodes {
                    d.handle_node(WatchEvent::InitApply(n));
                }
                d.handle_node(WatchEvent::InitDone);
            }
            None => {
                d.handle_nodes_unreadable("nodes is forbidden".into());
            }
        }
        d.handle_pod(WatchEvent::Init);
        for p in pods {
            d.handle_pod(WatchEvent::InitApply(p));
        }
        d.handle_pod(WatchEvent::InitDone);
        d.handle_service(WatchEvent::Init);
        for s in services {
            d.handle_service(WatchEvent::InitApply(s));
        }
        d.handle_service(WatchEvent::InitDone);
        d
    }

    #[test]
    fn no_view_until_every_watch_listed_once() {
        let mut d = Discovery::new(DiscoveryConfig::default());
        assert!(d.view().is_none());
        d.handle_pod(WatchEvent::Init);
        d.handle_pod(WatchEvent::InitDone);
        d.handle_service(WatchEvent::Init);
        assert!(d.handle_service(WatchEvent::InitDone));
        assert!(d.view().is_none(), "nodes are still listing");
        d.handle_nodes_unreadable("forbidden".into());
        let v = d.view().expect("view once nodes are known unreadable");
        assert!(v.pod_cidrs.is_empty());
        assert!(v.dns_servers.is_empty());
    }

    #[test]
    fn pod_cidrs_from_pod_ips_are_never_wider_than_a_24() {
        let d = listed(
            None,
            vec![
                pod("default", "a", &["10.244.1.11"]),
                pod("default", "b", &["10.244.1.12"]),
                pod("other", "c", &["10.244.7.5", "fd00:10:244::5"]),
                pod("default", "host", &[]),
            ],
            vec![],
        );
        let v = d.view().expect("view");
        assert_eq!(
            v.pod_cidrs,
            vec![
                net("10.244.1.0/24"),
                net("10.244.7.0/24"),
                net("fd00:10:244::/64")
            ]
        );
        assert!(
            v.pod_cidr_source.starts_with("pod IPs"),
            "{}",
            v.pod_cidr_source
        );
        assert!(
            v.pod_cidr_source.contains("forbidden"),
            "{}",
            v.pod_cidr_source
        );
    }

    #[test]
    fn node_pod_cidrs_win_and_only_stray_pod_ips_are_inferred() {
        let d = listed(
            Some(vec![
                node("n1", &["10.244.0.0/24"]),
                node("n2", &["10.244.1.0/24"]),
            ]),
            vec![
                pod("default", "a", &["10.244.1.11"]),
                pod("default", "stray", &["10.250.3.3"]),
            ],
            vec![],
        );
        let v = d.view().expect("view");
        // The two sibling node ranges merge; the stray pod gets its own /24.
        assert_eq!(
            v.pod_cidrs,
            vec![net("10.244.0.0/23"), net("10.250.3.0/24")]
        );
        assert!(
            v.pod_cidr_source.contains("1 pod IP"),
            "{}",
            v.pod_cidr_source
        );
    }

    #[test]
    fn dns_servers_follow_the_kube_dns_service() {
        let mut d = listed(
            None,
            vec![],
            vec![svc("default", "web", &["10.96.0.100"], 80)],
        );
        assert!(d.view().expect("view").dns_servers.is_empty());
        assert!(d.handle_service(WatchEvent::Apply(svc(
            "kube-system",
            "kube-dns",
            &["10.96.0.10"],
            53
        ))));
        let v = d.view().expect("view");
        assert_eq!(v.dns_servers, vec![ip("10.96.0.10")]);
        assert_eq!(v.domain, "cluster.local");
        let u = delta(None, &v, "team-a").expect("snapshot");
        let dns = u.dns.expect("dns in a snapshot");
        assert_eq!(dns.servers, vec!["10.96.0.10"]);
        assert_eq!(
            dns.search,
            vec![
                "team-a.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ]
        );
        assert_eq!(
            search_list("", "corp.example")[0],
            "default.svc.corp.example"
        );
    }

    #[test]
    fn snapshot_then_deltas() {
        let mut d = listed(
            None,
            vec![pod("default", "a", &["10.244.1.11"])],
            vec![svc("default", "web", &["10.96.0.100"], 80)],
        );
        let v1 = d.view().expect("view");
        let snap = delta(None, &v1, "default").expect("snapshot");
        assert!(snap.snapshot);
        assert_eq!(snap.pod_cidrs_added, vec!["10.244.1.0/24"]);
        assert_eq!(snap.services_upserted.len(), 1);
        assert_eq!(snap.services_upserted[0].cluster_ips, vec!["10.96.0.100"]);
        assert_eq!(snap.services_upserted[0].ports[0].port, 80);
        assert_eq!(
            delta(Some(&v1), &v1, "default"),
            None,
            "no change, no message"
        );

        // A pod on another node's range, a new Service, the old one gone.
        assert!(d.handle_pod(WatchEvent::Apply(pod("team", "x", &["10.244.7.5"]))));
        assert!(d.handle_service(WatchEvent::Apply(svc("team", "late", &["10.96.5.5"], 8181))));
        assert!(d.handle_service(WatchEvent::Delete(("default".into(), "web".into()))));
        let v2 = d.view().expect("view");
        let u = delta(Some(&v1), &v2, "default").expect("delta");
        assert!(!u.snapshot);
        assert_eq!(u.pod_cidrs_added, vec!["10.244.7.0/24"]);
        assert!(u.pod_cidrs_removed.is_empty());
        assert_eq!(u.services_upserted.len(), 1);
        assert_eq!(u.services_upserted[0].name, "late");
        assert_eq!(u.services_removed.len(), 1);
        assert_eq!(u.services_removed[0].name, "web");
        assert!(u.dns.is_none(), "DNS did not change");

        // The pod goes: its block goes with it.
        assert!(d.handle_pod(WatchEvent::Delete(("team".into(), "x".into()))));
        let v3 = d.view().expect("view");
        let u = delta(Some(&v2), &v3, "default").expect("delta");
        assert_eq!(u.pod_cidrs_removed, vec!["10.244.7.0/24"]);
        assert!(u.pod_cidrs_added.is_empty());
    }

    #[test]
    fn a_relist_replaces_the_table_at_init_done_only() {
        let mut d = listed(
            None,
            vec![
                pod("default", "a", &["10.244.1.11"]),
                pod("default", "gone", &["10.244.9.9"]),
            ],
            vec![],
        );
        let before = d.view().expect("view");
        assert_eq!(
            before.pod_cidrs,
            vec![net("10.244.1.0/24"), net("10.244.9.0/24")]
        );
        // The watch restarts; "gone" was deleted while it was down.
        assert!(!d.handle_pod(WatchEvent::Init));
        assert!(!d.handle_pod(WatchEvent::InitApply(pod("default", "a", &["10.244.1.11"]))));
        assert_eq!(
            d.view().expect("view"),
            before,
            "the old table holds until InitDone"
        );
        assert!(d.handle_pod(WatchEvent::InitDone));
        assert_eq!(
            d.view().expect("view").pod_cidrs,
            vec![net("10.244.1.0/24")]
        );
        // An identical re-list changes nothing.
        d.handle_pod(WatchEvent::Init);
        d.handle_pod(WatchEvent::InitApply(pod("default", "a", &["10.244.1.11"])));
        assert!(!d.handle_pod(WatchEvent::InitDone));
    }

    #[test]
    fn unchanged_apply_is_not_a_change() {
        let mut d = listed(None, vec![pod("default", "a", &["10.244.1.11"])], vec![]);
        assert!(!d.handle_pod(WatchEvent::Apply(pod("default", "a", &["10.244.1.11"]))));
        assert!(!d.handle_pod(WatchEvent::Delete(("default".into(), "nope".into()))));
        // A pod IP moving inside the same /24 changes no CIDR, so no delta either.
        let v1 = d.view().expect("view");
        assert!(d.handle_pod(WatchEvent::Apply(pod("default", "a", &["10.244.1.99"]))));
        assert_eq!(delta(Some(&v1), &d.view().expect("view"), "default"), None);
    }
}
