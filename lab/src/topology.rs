//! The lab's network building blocks: a [`Node`] (netns + bridge for the node's pod
//! range), its [`Pod`]s (one netns each, a veth to the bridge) and the laptop↔node
//! [`Uplink`]. Used by the static pods of [`crate::Lab`] and by the kubelet stand-in of
//! the Kubernetes lab, which adds and removes pods at run time.
//!
//! [`Addressing`] is the lab cluster's address plan (pod CIDR, service CIDR, uplink):
//! the default is the shared brief's; [`Addressing::second`] gives a second cluster
//! that can run next to the first, even with its uplink in the first lab's laptop netns.
//!
//! I/O: `ip` commands and `/proc/sys` writes inside the lab's netns (see
//! [`crate::netns`]). Nothing is created in the machine's root netns: veths are created
//! from inside the node netns with their peer placed directly into the pod's netns.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Mutex;

use ipnet::{Ipv4Net, Ipv6Net};
use serde::{Deserialize, Serialize};

use crate::netns::Netns;
use crate::{LabError, Result};

/// The address plan of one lab cluster. Every address the lab hands out derives from
/// these four ranges: ClusterIPs are fixed offsets into the service CIDR (like
/// kubeadm's `kubernetes` = first address and kube-dns = `.10`), the node and laptop
/// uplink addresses are the first two hosts of the uplink /30, extra laptops
/// ([`Addressing::extra_laptop_uplink`]) take the following /30s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Addressing {
    /// The cluster's pod CIDR.
    pub pod_cidr: Ipv4Net,
    /// The node's share of the pod CIDR (its bridge; the gateway is the first host).
    pub node_pod_cidr: Ipv4Net,
    /// The service CIDR (`--service-cluster-ip-range`).
    pub service_cidr: Ipv4Net,
    /// The laptop↔node uplink (a /30: node = first host, laptop = second).
    pub uplink: Ipv4Net,
    /// The IPv6 ranges of a dual-stack lab ([`Addressing::dual_stack`]); `None`
    /// (the default, and in older state files) = an IPv4-only lab.
    #[serde(default)]
    pub ipv6: Option<Ipv6Addressing>,
}

/// The IPv6 half of a dual-stack lab's address plan. Every pod gets the IPv6
/// address at its IPv4 address's offset into the node's pod range: pod
/// 10.244.1.7 of node range 10.244.1.0/24 is fd00:10:244:1::7 of
/// fd00:10:244:1::/64 (so the bridge gateway is `::1`, like `.1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ipv6Addressing {
    /// The cluster's IPv6 pod CIDR.
    pub pod_cidr: Ipv6Net,
    /// The node's IPv6 share of it (a /64 on its bridge).
    pub node_pod_cidr: Ipv6Net,
    /// The IPv6 service CIDR (second `--service-cluster-ip-range`).
    pub service_cidr: Ipv6Net,
}

impl Default for Ipv6Addressing {
    /// Pod CIDR fd00:10:244::/56 (node fd00:10:244:1::/64), service CIDR
    /// fd00:10:96::/112 (a /112 or narrower: the apiserver's IPv6 allocator
    /// refuses wider ranges).
    fn default() -> Self {
        Ipv6Addressing {
            pod_cidr: Ipv6Net::new_assert(Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, 0, 0, 0, 0), 56),
            node_pod_cidr: Ipv6Net::new_assert(
                Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 0),
                64,
            ),
            service_cidr: Ipv6Net::new_assert(
                Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0),
                112,
            ),
        }
    }
}

/// The IPv6 address at `v4`'s offset into `v4_net`, inside `v6_net`.
pub fn ipv6_at_offset(v4_net: Ipv4Net, v6_net: Ipv6Net, v4: Ipv4Addr) -> Ipv6Addr {
    let offset = u32::from(v4).wrapping_sub(u32::from(v4_net.network()));
    Ipv6Addr::from(u128::from(v6_net.network()) | u128::from(offset))
}

impl Default for Addressing {
    /// The shared brief's plan: pod CIDR 10.244.0.0/16 (node 10.244.1.0/24), service
    /// CIDR 10.96.0.0/12, uplink 172.31.255.0/30.
    fn default() -> Self {
        Addressing {
            pod_cidr: crate::POD_CIDR,
            node_pod_cidr: crate::NODE_POD_CIDR,
            service_cidr: crate::SERVICE_CIDR,
            uplink: Ipv4Net::new_assert(Ipv4Addr::new(172, 31, 255, 0), crate::UPLINK_PREFIX_LEN),
            ipv6: None,
        }
    }
}

/// Offset of a ClusterIP into the service CIDR.
fn offset(net: Ipv4Net, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.network()).saturating_add(n))
}

impl Addressing {
    /// A second cluster disjoint from the default one: pod CIDR 10.248.0.0/16 (node
    /// 10.248.1.0/24), service CIDR 10.112.0.0/12, uplink 172.31.254.0/30.
    pub fn second() -> Self {
        Addressing {
            pod_cidr: Ipv4Net::new_assert(Ipv4Addr::new(10, 248, 0, 0), 16),
            node_pod_cidr: Ipv4Net::new_assert(Ipv4Addr::new(10, 248, 1, 0), 24),
            service_cidr: Ipv4Net::new_assert(Ipv4Addr::new(10, 112, 0, 0), 12),
            uplink: Ipv4Net::new_assert(Ipv4Addr::new(172, 31, 254, 0), crate::UPLINK_PREFIX_LEN),
            ipv6: None,
        }
    }

    /// A second cluster with the default one's pod and service CIDRs (as every
    /// kind or k3d cluster has) but its own uplink 172.31.254.0/30, so that both can
    /// hang off one laptop netns ([`crate::k8s::K8sLabOptions::laptop_of`]): the
    /// same pod IPs and ClusterIPs lead to different pods in each (`kvpn run`).
    pub fn overlapping() -> Self {
        Addressing {
            uplink: Self::second().uplink,
            ..Self::default()
        }
    }

    /// This plan plus the default IPv6 ranges ([`Ipv6Addressing::default`]): pods
    /// get an IPv6 address too, the apiserver a second service range.
    pub fn dual_stack(mut self) -> Self {
        self.ipv6 = Some(Ipv6Addressing::default());
        self
    }

    /// The IPv6 ClusterIP at offset `n` of the IPv6 service CIDR (dual stack).
    pub fn ipv6_service_ip(&self, n: u16) -> Option<Ipv6Addr> {
        self.ipv6
            .map(|v6| Ipv6Addr::from(u128::from(v6.service_cidr.network()) | u128::from(n)))
    }

    /// The IPv6 address of the pod holding `v4` (dual stack).
    pub fn pod_ipv6(&self, v4: Ipv4Addr) -> Option<Ipv6Addr> {
        self.ipv6
            .map(|v6| ipv6_at_offset(self.node_pod_cidr, v6.node_pod_cidr, v4))
    }

    /// Checks the plan: the node range inside the pod CIDR, pod and service CIDRs
    /// disjoint, the uplink a /30 outside both.
    pub fn validate(&self) -> Result<()> {
        let invalid = |why: &'static str| LabError::Invalid {
            what: "lab addressing",
            value: format!("{self:?}"),
            why,
        };
        if !self.pod_cidr.contains(&self.node_pod_cidr) {
            return Err(invalid("the node's pod range must lie inside the pod CIDR"));
        }
        if self.pod_cidr.contains(&self.service_cidr) || self.service_cidr.contains(&self.pod_cidr)
        {
            return Err(invalid("the pod and service CIDRs must be disjoint"));
        }
        if self.uplink.prefix_len() != crate::UPLINK_PREFIX_LEN
            || self.pod_cidr.contains(&self.uplink)
            || self.service_cidr.contains(&self.uplink)
        {
            return Err(invalid(
                "the uplink must be a /30 outside the pod and service CIDRs",
            ));
        }
        if let Some(v6) = self.ipv6
            && (!v6.pod_cidr.contains(&v6.node_pod_cidr)
                || v6.node_pod_cidr.prefix_len() != 64
                || v6.pod_cidr.contains(&v6.service_cidr)
                || v6.service_cidr.contains(&v6.pod_cidr)
                || v6.service_cidr.prefix_len() < 108)
        {
            return Err(invalid(
                "IPv6: the node's /64 must lie inside the pod CIDR, the service CIDR (/108 or narrower) outside it",
            ));
        }
        if self.service_cidr.prefix_len() > 24 {
            return Err(invalid(
                "the service CIDR must be a /24 or wider (fixed ClusterIPs up to .102)",
            ));
        }
        Ok(())
    }

    /// The node's uplink address (API relay :6443, NodePorts).
    pub fn node_uplink_ip(&self) -> Ipv4Addr {
        offset(self.uplink, 1)
    }

    /// The laptop's uplink address.
    pub fn laptop_uplink_ip(&self) -> Ipv4Addr {
        offset(self.uplink, 2)
    }

    /// The `kubernetes` Service's ClusterIP: the service CIDR's first host.
    pub fn kubernetes_service_ip(&self) -> Ipv4Addr {
        offset(self.service_cidr, 1)
    }

    /// The `kube-system/kube-dns` ClusterIP (`.10`).
    pub fn dns_service_ip(&self) -> Ipv4Addr {
        offset(self.service_cidr, 10)
    }

    /// ClusterIP of `default/web` (`.100`, TCP 80 → 8080).
    pub fn web_cluster_ip(&self) -> Ipv4Addr {
        offset(self.service_cidr, 100)
    }

    /// ClusterIP of `default/echo` (`.101`, TCP 7 → 7007).
    pub fn echo_cluster_ip(&self) -> Ipv4Addr {
        offset(self.service_cidr, 101)
    }

    /// ClusterIP of `default/udp-echo` (`.102`, UDP 7 → 7007).
    pub fn udp_echo_cluster_ip(&self) -> Ipv4Addr {
        offset(self.service_cidr, 102)
    }

    /// The uplink /30 of extra laptop number `n` (1 = the first extra laptop): the
    /// `n`-th /30 after [`Addressing::uplink`].
    pub fn extra_laptop_uplink(&self, n: u8) -> Ipv4Net {
        let step = 1u32 << (32 - u32::from(crate::UPLINK_PREFIX_LEN));
        let base = u32::from(self.uplink.network()).saturating_add(step * u32::from(n));
        Ipv4Net::new_assert(Ipv4Addr::from(base), crate::UPLINK_PREFIX_LEN)
    }
}

/// Name of the pod's interface inside its netns, as in Kubernetes.
pub const POD_INTERFACE: &str = "eth0";

/// Lets unprivileged processes (the manager) open ICMP echo sockets.
const PING_GROUP_RANGE: (&str, &str) = ("net.ipv4.ping_group_range", "0 2147483647");

/// The MAC of the interface holding `ip`: `0a:58` + the four address bytes, the
/// convention of the Kubernetes bridge CNI plugin. A pod re-created with the same IP
/// gets the same MAC, so neighbours' ARP entries for it stay right (a random MAC would
/// leave them pointing at the old pod until they expire, up to ~45 s).
pub fn mac_for(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("0a:58:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// `kvpn-<id>-<role>`.
pub fn netns_name(lab_id: &str, role: &str) -> String {
    format!("kvpn-{lab_id}-{role}")
}

/// A node: a netns holding a bridge whose address is the pods' default gateway, IP
/// forwarding on, and `br_netfilter` on so bridged pod-to-pod replies pass conntrack
/// (that is what makes ClusterIP DNAT work between two pods on the same bridge).
#[derive(Debug)]
pub struct Node {
    lab_id: String,
    netns: Netns,
    bridge: String,
    pod_cidr: Ipv4Net,
    gateway: Ipv4Addr,
    /// The node's IPv6 pod range of a dual-stack lab ([`Node::with_ipv6`]).
    pod_cidr_v6: Option<Ipv6Net>,
    /// Pod name → pod IP, for address allocation and duplicate checks.
    pods: Mutex<BTreeMap<String, Ipv4Addr>>,
}

/// A pod: its own netns with `eth0` (veth to the node's bridge), a pod IP, a default
/// route via the bridge, `lo` up and `ping_group_range` open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// The pod's IPv6 address in a dual-stack lab ([`Node::pod_ipv6`]).
    pub ip_v6: Option<Ipv6Addr>,
    pub netns: Netns,
    /// The node-side end of the pod's veth (a bridge port), `kv<id>p<hex>`.
    pub host_veth: String,
}

/// The laptop↔node veth pair: the laptop's only link to the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uplink {
    /// Interface in the node netns.
    pub node_if: String,
    pub node_ip: Ipv4Addr,
    /// Interface in the laptop netns.
    pub laptop_if: String,
    pub laptop_ip: Ipv4Addr,
    pub prefix_len: u8,
}

impl Node {
    /// Creates the node netns `kvpn-<lab_id>-<role>` with bridge `kv<lab_id>br`
    /// holding the first address of `pod_cidr`.
    pub fn create(lab_id: &str, role: &str, pod_cidr: Ipv4Net) -> Result<Node> {
        Node::existing(lab_id, role, pod_cidr).create_netns()
    }

    /// [`Node::create`] for a handle from [`Node::existing`] (e.g. with
    /// [`Node::with_ipv6`]): creates its netns and plumbs it.
    pub fn create_netns(self) -> Result<Node> {
        Netns::create(self.netns.name())?;
        self.plumb()?;
        Ok(self)
    }

    /// [`Node::create_in_existing`] for a handle from [`Node::existing`].
    pub fn plumb_existing_netns(self) -> Result<Node> {
        self.plumb()?;
        Ok(self)
    }

    /// Like [`Node::create`] in a netns `kvpn-<lab_id>-<role>` that already exists
    /// (created by the caller to claim the lab id) and is still empty.
    pub fn create_in_existing(lab_id: &str, role: &str, pod_cidr: Ipv4Net) -> Result<Node> {
        let node = Node::existing(lab_id, role, pod_cidr);
        node.plumb()?;
        Ok(node)
    }

    fn plumb(&self) -> Result<()> {
        let node = self;
        let pod_cidr = self.pod_cidr;
        let gw = format!("{}/{}", node.gateway, pod_cidr.prefix_len());
        node.netns.ip_batch(&[
            "link set lo up".to_owned(),
            // A fixed bridge MAC: by default a bridge takes the lowest MAC of its ports
            // and changes it when that port leaves, which would make every pod's ARP
            // entry for the gateway stale when a pod is deleted.
            format!(
                "link add {} address {} type bridge",
                node.bridge,
                mac_for(node.gateway)
            ),
            format!("addr add {gw} dev {}", node.bridge),
            format!("link set {} up", node.bridge),
        ])?;
        if let Some(gw6) = node.gateway_v6() {
            // nodad: no second of "tentative" before pods can use the gateway.
            node.netns
                .ip_batch(&[format!("addr add {gw6}/64 dev {} nodad", node.bridge)])?;
            node.netns.set_sysctls(&[
                ("net.ipv6.conf.all.forwarding", "1"),
                ("net.bridge.bridge-nf-call-ip6tables", "1"),
            ])?;
        }
        node.netns
            .set_sysctls(&[
                ("net.ipv4.ip_forward", "1"),
                ("net.bridge.bridge-nf-call-iptables", "1"),
            ])
            .map_err(|e| match e {
                LabError::Io { what, source } if source.kind() == std::io::ErrorKind::NotFound => {
                    LabError::Io {
                        what: format!("{what} — load br_netfilter (modprobe br_netfilter)"),
                        source,
                    }
                }
                other => other,
            })?;
        Ok(())
    }

    /// A handle to a node created earlier (e.g. by another process), without touching
    /// the system. Pods must be registered with [`Node::adopt_pod`].
    pub fn existing(lab_id: &str, role: &str, pod_cidr: Ipv4Net) -> Node {
        let gateway = pod_cidr.hosts().next().unwrap_or(pod_cidr.addr());
        Node {
            lab_id: lab_id.to_owned(),
            netns: Netns::from_name(&netns_name(lab_id, role)),
            bridge: format!("kv{lab_id}br"),
            pod_cidr,
            gateway,
            pod_cidr_v6: None,
            pods: Mutex::new(BTreeMap::new()),
        }
    }

    /// The same node with an IPv6 pod range (a /64; dual-stack labs): its
    /// bridge gets the range's `::1`, every pod the IPv6 address at its IPv4
    /// address's offset ([`Node::pod_ipv6`]). Call before [`Node::create`]'s
    /// plumbing, i.e. on handles made with [`Node::existing`].
    pub fn with_ipv6(mut self, pod_cidr_v6: Option<Ipv6Net>) -> Node {
        self.pod_cidr_v6 = pod_cidr_v6;
        self
    }

    /// The node's IPv6 pod range (dual-stack labs).
    pub fn pod_cidr_v6(&self) -> Option<Ipv6Net> {
        self.pod_cidr_v6
    }

    /// The IPv6 address of the pod holding `ip` (dual-stack labs).
    pub fn pod_ipv6(&self, ip: Ipv4Addr) -> Option<Ipv6Addr> {
        self.pod_cidr_v6
            .map(|v6| ipv6_at_offset(self.pod_cidr, v6, ip))
    }

    /// The bridge's IPv6 address, every pod's IPv6 default gateway.
    pub fn gateway_v6(&self) -> Option<Ipv6Addr> {
        self.pod_ipv6(self.gateway)
    }

    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    pub fn pod_cidr(&self) -> Ipv4Net {
        self.pod_cidr
    }

    /// The bridge address: every pod's default gateway.
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The lowest address of the pod range that is neither the gateway nor held by a
    /// pod of this node.
    pub fn free_pod_ip(&self) -> Option<Ipv4Addr> {
        let pods = self.lock_pods();
        self.pod_cidr
            .hosts()
            .find(|ip| *ip != self.gateway && !pods.values().any(|p| p == ip))
    }

    /// Creates pod `name` with `ip`: netns `kvpn-<id>-<name>`, veth `kv<id>p<hex>` on the
    /// bridge (hairpin on, so a pod can reach itself through its ClusterIP) ↔ `eth0` in
    /// the pod, address, default route via the bridge, `lo` up, `ping_group_range` open.
    /// On failure, whatever was created is removed again.
    pub fn add_pod(&self, name: &str, ip: Ipv4Addr) -> Result<Pod> {
        validate_pod_name(name)?;
        if !self.pod_cidr.contains(&ip)
            || ip == self.gateway
            || ip == self.pod_cidr.network()
            || ip == self.pod_cidr.broadcast()
        {
            return Err(LabError::Invalid {
                what: "pod IP",
                value: ip.to_string(),
                why: "must be a host address of the node's pod range other than the gateway",
            });
        }
        {
            let mut pods = self.lock_pods();
            if pods.contains_key(name) {
                return Err(LabError::Invalid {
                    what: "pod name",
                    value: name.to_owned(),
                    why: "already used on this node",
                });
            }
            if pods.values().any(|p| *p == ip) {
                return Err(LabError::Invalid {
                    what: "pod IP",
                    value: ip.to_string(),
                    why: "already held by another pod",
                });
            }
            pods.insert(name.to_owned(), ip);
        }
        let pod = self.pod_handle(name, ip);
        let result = self.plumb_pod(&pod);
        if let Err(e) = result {
            let _ = self.remove_pod(&pod);
            return Err(e);
        }
        tracing::debug!(pod = name, %ip, netns = pod.netns.name(), "pod added");
        Ok(pod)
    }

    fn plumb_pod(&self, pod: &Pod) -> Result<()> {
        pod.netns.create_in_place()?;
        self.netns.ip_batch(&[
            format!(
                "link add {} type veth peer name {POD_INTERFACE} address {} netns {}",
                pod.host_veth,
                mac_for(pod.ip),
                pod.netns.name()
            ),
            format!("link set {} master {}", pod.host_veth, self.bridge),
            format!("link set {} type bridge_slave hairpin on", pod.host_veth),
            format!("link set {} up", pod.host_veth),
        ])?;
        pod.netns.set_sysctls(&[PING_GROUP_RANGE])?;
        pod.netns.ip_batch(&[
            "link set lo up".to_owned(),
            format!(
                "addr add {}/{} dev {POD_INTERFACE}",
                pod.ip,
                self.pod_cidr.prefix_len()
            ),
            format!("link set {POD_INTERFACE} up"),
            format!("route add default via {}", self.gateway),
        ])?;
        if let (Some(ip6), Some(gw6)) = (pod.ip_v6, self.gateway_v6()) {
            pod.netns.ip_batch(&[
                format!("addr add {ip6}/64 dev {POD_INTERFACE} nodad"),
                format!("route add ::/0 via {gw6}"),
            ])?;
        }
        Ok(())
    }

    /// Registers a pod that already exists (created by an earlier process) so address
    /// allocation and [`Node::remove_pod`] know it.
    pub fn adopt_pod(&self, name: &str, ip: Ipv4Addr) -> Pod {
        self.lock_pods().insert(name.to_owned(), ip);
        self.pod_handle(name, ip)
    }

    /// Removes the pod's veth and netns. Idempotent. Processes still inside the netns
    /// keep it alive in the kernel: stop them first.
    pub fn remove_pod(&self, pod: &Pod) -> Result<()> {
        self.lock_pods().remove(&pod.name);
        // Deleting the veth explicitly (rather than letting the netns teardown do it
        // asynchronously) frees its name at once for a new pod with the same IP.
        if self.netns.exists() {
            let _ = self.netns.ip(&["link", "del", &pod.host_veth]);
        }
        pod.netns.delete()
    }

    /// Connects the laptop netns to this node with a veth pair `kv<id>up` (node) ↔
    /// `kv<id>lp` (laptop) addressed `node_ip`/`laptop_ip` in a /`prefix_len`. The laptop
    /// gets no other route: it reaches only the node's uplink address.
    pub fn connect_laptop(
        &self,
        laptop: &Netns,
        node_ip: Ipv4Addr,
        laptop_ip: Ipv4Addr,
        prefix_len: u8,
    ) -> Result<Uplink> {
        let uplink = self.uplink(laptop_ip, node_ip, prefix_len);
        self.plumb_uplink(laptop, &uplink, &[])?;
        Ok(uplink)
    }

    /// Connects an extra laptop netns (number `n` ≥ 1, see
    /// [`Addressing::extra_laptop_uplink`]) with its own veth pair `kv<id>u<n>` (node)
    /// ↔ `kv<id>l<n>` (laptop) in `net` (node = first host, laptop = second), plus one
    /// host route on the laptop to `main_node_ip` (the node's main uplink address, where
    /// the API relay and the NodePorts listen) through its own node address. Nothing
    /// else: this laptop, too, reaches no pod or service CIDR.
    pub fn connect_extra_laptop(
        &self,
        laptop: &Netns,
        n: u8,
        net: Ipv4Net,
        main_node_ip: Ipv4Addr,
    ) -> Result<Uplink> {
        let node_ip = Ipv4Addr::from(u32::from(net.network()).saturating_add(1));
        let laptop_ip = Ipv4Addr::from(u32::from(net.network()).saturating_add(2));
        let uplink = Uplink {
            node_if: format!("kv{}u{n}", self.lab_id),
            node_ip,
            laptop_if: format!("kv{}l{n}", self.lab_id),
            laptop_ip,
            prefix_len: net.prefix_len(),
        };
        self.plumb_uplink(
            laptop,
            &uplink,
            &[format!(
                "route add {main_node_ip}/32 via {node_ip} dev {}",
                uplink.laptop_if
            )],
        )?;
        Ok(uplink)
    }

    /// Creates the veth pair of `uplink` (node side in this node's netns, peer moved
    /// into `laptop`), addresses it, brings it up, then runs `laptop_extra` (`ip` lines)
    /// in the laptop netns. On failure the pair is deleted again.
    fn plumb_uplink(&self, laptop: &Netns, uplink: &Uplink, laptop_extra: &[String]) -> Result<()> {
        let prefix_len = uplink.prefix_len;
        self.netns.ip_batch(&[
            format!(
                "link add {} type veth peer name {} netns {}",
                uplink.node_if,
                uplink.laptop_if,
                laptop.name()
            ),
            format!(
                "addr add {}/{prefix_len} dev {}",
                uplink.node_ip, uplink.node_if
            ),
            format!("link set {} up", uplink.node_if),
        ])?;
        let mut lines = vec![
            "link set lo up".to_owned(),
            format!(
                "addr add {}/{prefix_len} dev {}",
                uplink.laptop_ip, uplink.laptop_if
            ),
            format!("link set {} up", uplink.laptop_if),
        ];
        lines.extend(laptop_extra.iter().cloned());
        if let Err(e) = laptop.ip_batch(&lines) {
            let _ = self.remove_uplink(uplink);
            return Err(e);
        }
        Ok(())
    }

    /// Deletes the uplink's veth pair from the node side (which removes the laptop's
    /// end too, at once). Idempotent; needs the node netns.
    pub fn remove_uplink(&self, uplink: &Uplink) -> Result<()> {
        if !self.netns.exists() {
            return Ok(());
        }
        match self.netns.ip(&["link", "del", &uplink.node_if]) {
            Err(LabError::CommandFailed { stderr, .. })
                if stderr.contains("Cannot find device") =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// The uplink's names and addresses, without touching the system.
    pub fn uplink(&self, laptop_ip: Ipv4Addr, node_ip: Ipv4Addr, prefix_len: u8) -> Uplink {
        Uplink {
            node_if: format!("kv{}up", self.lab_id),
            node_ip,
            laptop_if: format!("kv{}lp", self.lab_id),
            laptop_ip,
            prefix_len,
        }
    }

    fn pod_handle(&self, name: &str, ip: Ipv4Addr) -> Pod {
        let [_, _, c, d] = ip.octets();
        Pod {
            name: name.to_owned(),
            ip,
            ip_v6: self.pod_ipv6(ip),
            netns: Netns::from_name(&netns_name(&self.lab_id, name)),
            // kv + 5 + p + 4 = 12 bytes, within IFNAMSIZ-1 = 15; unique per pod IP.
            host_veth: format!("kv{}p{c:02x}{d:02x}", self.lab_id),
        }
    }

    fn lock_pods(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Ipv4Addr>> {
        // A panic while holding this lock leaves a plain map behind; it stays usable.
        self.pods
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Netns {
    /// `ip netns add` for a handle made with [`Netns::from_name`].
    fn create_in_place(&self) -> Result<()> {
        Netns::create(self.name()).map(drop)
    }
}

fn validate_pod_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 100
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && name != "laptop"
        && name != "node";
    if ok {
        Ok(())
    } else {
        Err(LabError::Invalid {
            what: "pod name",
            value: name.to_owned(),
            why: "use 1-100 of a-z, 0-9 and `-` (not starting with `-`, not `laptop` or `node`)",
        })
    }
}
