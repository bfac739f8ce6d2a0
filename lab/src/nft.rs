//! ClusterIPs and NodePorts as nftables DNAT rules, the way kube-proxy's nftables mode
//! builds them: a `services` dispatch chain matched on destination address and port,
//! one chain per service that picks an endpoint with `numgen random mod N vmap`, and
//! one chain per endpoint that DNATs to `pod-ip:target-port`.
//!
//! [`render_ruleset`] (the static lab's services) and [`render_rules`] (the kube-proxy
//! stand-in's [`ServiceRule`]s: per-endpoint target ports, reject for services without
//! endpoints) are pure (rules in, `nft -f` script out), so the kube-proxy stand-in of the
//! Kubernetes lab can re-render on every change; [`apply`] loads a script inside a netns
//! in one transaction (delete + re-create of the table), so updates are atomic and
//! established connections keep their conntrack entries; [`delete_table`] removes it.
//!
//! Services without endpoints: kube-proxy rejects their traffic instead of letting it
//! time out (TCP reset, ICMP port unreachable for UDP). [`render_rules`] does the same in
//! a `filter` chain on the prerouting and output hooks (priority dstnat-10, before any
//! DNAT), since the node has no route for the service CIDR and a packet would otherwise
//! die in the routing decision with "network unreachable".
//!
//! Hairpin: a pod that reaches its own ClusterIP and gets itself as the endpoint is
//! masqueraded to the node's bridge address (mark 0x4000, as kube-proxy), otherwise
//! its reply would never pass the node and never be un-DNATed. This needs hairpin
//! mode on the bridge port (see `topology`).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};

use crate::Result;
use crate::netns::{Netns, run_checked, run_with_stdin};

/// Transport protocol of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// One ClusterIP service port: `cluster_ip:port/protocol` → `endpoint:target_port`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Service {
    /// Human name (`web`, `ns/name:port`), written into rule comments.
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: u16,
    /// Ready endpoints (pod IPs). With none, no DNAT rule is emitted and packets to the
    /// ClusterIP meet the node's routing table, which has no route for the service
    /// CIDR: the sender gets an ICMP "network unreachable".
    pub endpoints: Vec<Ipv4Addr>,
}

/// A NodePort-like forward: `node_ip:port/protocol` → `pod_ip:target_port`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodePort {
    pub name: String,
    pub node_ip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
    pub pod_ip: Ipv4Addr,
    pub target_port: u16,
}

/// Packet mark bit that asks the postrouting chain to masquerade (kube-proxy's value).
pub const MASQUERADE_MARK: u32 = 0x4000;

/// What a [`ServiceRule`] stands for; decides its chain names (`svc-<i>`,
/// `nodeport-<i>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RuleKind {
    /// A ClusterIP:port.
    ClusterIp,
    /// A node address:port forwarded to pods (NodePort).
    NodePort,
}

/// One frontend `ip:port/protocol` balanced over `backends` (pod IP and target port
/// each, so endpoints with different target ports behind one service port work, as
/// with named target ports). No backends: the frontend is rejected (TCP reset, ICMP
/// port unreachable), like kube-proxy does for a service without ready endpoints.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ServiceRule {
    /// Human name (`ns/name:port`), written into rule comments.
    pub name: String,
    pub kind: RuleKind,
    /// The frontend: an IPv4 or IPv6 ClusterIP, or a node address. Its
    /// backends are of the same family.
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub backends: Vec<SocketAddr>,
}

impl From<&Service> for ServiceRule {
    fn from(svc: &Service) -> Self {
        ServiceRule {
            name: svc.name.clone(),
            kind: RuleKind::ClusterIp,
            ip: IpAddr::V4(svc.cluster_ip),
            port: svc.port,
            protocol: svc.protocol,
            backends: svc
                .endpoints
                .iter()
                .map(|ip| SocketAddr::V4(SocketAddrV4::new(*ip, svc.target_port)))
                .collect(),
        }
    }
}

impl From<&NodePort> for ServiceRule {
    fn from(np: &NodePort) -> Self {
        ServiceRule {
            name: np.name.clone(),
            kind: RuleKind::NodePort,
            ip: IpAddr::V4(np.node_ip),
            port: np.port,
            protocol: np.protocol,
            backends: vec![SocketAddr::V4(SocketAddrV4::new(np.pod_ip, np.target_port))],
        }
    }
}

/// Renders an `nft -f` script that atomically replaces `table ip <table>` with DNAT
/// rules for `services` and `node_ports`. Names are only used in comments (quotes
/// stripped), chain names are derived from positions. A service without endpoints gets
/// no rule at all (see [`Service::endpoints`]).
pub fn render_ruleset(table: &str, services: &[Service], node_ports: &[NodePort]) -> String {
    let rules: Vec<(usize, ServiceRule)> = services
        .iter()
        .enumerate()
        .filter(|(_, svc)| !svc.endpoints.is_empty())
        .map(|(i, svc)| (i, ServiceRule::from(svc)))
        .chain(
            node_ports
                .iter()
                .enumerate()
                .map(|(i, np)| (i, ServiceRule::from(np))),
        )
        .collect();
    render_indexed(table, &rules)
}

/// Renders an `nft -f` script that atomically replaces `table ip <table>` with `rules`:
/// DNAT balanced over each rule's backends, and a reject for rules without backends.
/// Chain names are `svc-<i>` / `nodeport-<i>`, numbered per kind in order.
pub fn render_rules(table: &str, rules: &[ServiceRule]) -> String {
    let (mut svc_i, mut np_i) = (0, 0);
    let indexed: Vec<(usize, ServiceRule)> = rules
        .iter()
        .map(|r| {
            let counter = match r.kind {
                RuleKind::ClusterIp => &mut svc_i,
                RuleKind::NodePort => &mut np_i,
            };
            let i = *counter;
            *counter += 1;
            (i, r.clone())
        })
        .collect();
    render_indexed(table, &indexed)
}

fn chain_prefix(kind: RuleKind) -> &'static str {
    match kind {
        RuleKind::ClusterIp => "svc",
        RuleKind::NodePort => "nodeport",
    }
}

/// `table ip <table>` with the IPv4 rules, then `table ip6 <table>` with the
/// IPv6 ones (dual-stack labs). Both tables are always replaced, so an IPv6
/// table whose last rule went away is deleted.
fn render_indexed(table: &str, rules: &[(usize, ServiceRule)]) -> String {
    let (v4, v6): (Vec<_>, Vec<_>) = rules.iter().cloned().partition(|(_, r)| r.ip.is_ipv4());
    let mut s = render_family(table, Family::Ipv4, &v4);
    if v6.is_empty() {
        let _ = writeln!(s, "table ip6 {table} {{}}\ndelete table ip6 {table}");
    } else {
        s.push_str(&render_family(table, Family::Ipv6, &v6));
    }
    s
}

/// The nftables family of one table of rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    /// Table family and address match keyword (`ip daddr`, `ip6 daddr`).
    fn keyword(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }

    fn udp_reject(self) -> &'static str {
        match self {
            Family::Ipv4 => "reject with icmp type port-unreachable",
            Family::Ipv6 => "reject with icmpv6 type port-unreachable",
        }
    }
}

fn render_family(table: &str, family: Family, rules: &[(usize, ServiceRule)]) -> String {
    let fam = family.keyword();
    let mut s = String::new();
    // Declaring then deleting makes the delete succeed whether or not the table exists;
    // the whole file is one transaction.
    let _ = writeln!(
        s,
        "table {fam} {table} {{}}\ndelete table {fam} {table}\ntable {fam} {table} {{"
    );
    let _ = writeln!(
        s,
        "  chain prerouting {{ type nat hook prerouting priority -100; policy accept; jump services; }}"
    );
    let _ = writeln!(
        s,
        "  chain output {{ type nat hook output priority -100; policy accept; jump services; }}"
    );
    let _ = writeln!(
        s,
        "  chain postrouting {{ type nat hook postrouting priority 100; policy accept; meta mark & {MASQUERADE_MARK:#x} == {MASQUERADE_MARK:#x} masquerade; }}"
    );
    let _ = writeln!(s, "  chain services {{");
    // Services first, then node ports (a node port never shares an address with a
    // ClusterIP, so the order only matters for reading).
    for kind in [RuleKind::ClusterIp, RuleKind::NodePort] {
        for (i, r) in rules
            .iter()
            .filter(|(_, r)| r.kind == kind && !r.backends.is_empty())
        {
            let _ = writeln!(
                s,
                "    {fam} daddr {} {} dport {} jump {}-{i} comment \"{}\"",
                r.ip,
                r.protocol.as_str(),
                r.port,
                chain_prefix(kind),
                comment(&r.name)
            );
        }
    }
    let _ = writeln!(s, "  }}");
    let rejected: Vec<&ServiceRule> = rules
        .iter()
        .map(|(_, r)| r)
        .filter(|r| r.backends.is_empty())
        .collect();
    if !rejected.is_empty() {
        let _ = writeln!(
            s,
            "  chain filter-prerouting {{ type filter hook prerouting priority -110; policy accept; jump no-endpoints; }}"
        );
        let _ = writeln!(
            s,
            "  chain filter-output {{ type filter hook output priority -110; policy accept; jump no-endpoints; }}"
        );
        let _ = writeln!(s, "  chain no-endpoints {{");
        for r in rejected {
            let how = match r.protocol {
                Protocol::Tcp => "reject with tcp reset",
                Protocol::Udp => family.udp_reject(),
            };
            let _ = writeln!(
                s,
                "    {fam} daddr {} {} dport {} {how} comment \"{} has no endpoints\"",
                r.ip,
                r.protocol.as_str(),
                r.port,
                comment(&r.name)
            );
        }
        let _ = writeln!(s, "  }}");
    }
    // One chain per frontend picking a backend at random, one per backend DNATing to
    // it and marking hairpin traffic (a pod reaching itself) for masquerade.
    for (i, r) in rules.iter().filter(|(_, r)| !r.backends.is_empty()) {
        let prefix = chain_prefix(r.kind);
        let arms: Vec<String> = (0..r.backends.len())
            .map(|j| format!("{j} : jump {prefix}-{i}-ep-{j}"))
            .collect();
        let _ = writeln!(
            s,
            "  chain {prefix}-{i} {{\n    numgen random mod {} vmap {{ {} }}\n  }}",
            r.backends.len(),
            arms.join(", ")
        );
        for (j, ep) in r.backends.iter().enumerate() {
            let _ = writeln!(
                s,
                "  chain {prefix}-{i}-ep-{j} {{\n    {fam} saddr {} meta mark set meta mark | {MASQUERADE_MARK:#x}\n    meta l4proto {} dnat to {ep}\n  }}",
                ep.ip(),
                r.protocol.as_str(),
            );
        }
    }
    s.push_str("}\n");
    s
}

/// Loads an `nft -f` script inside `netns` (`ip netns exec <netns> nft -f -`).
pub fn apply(netns: &Netns, script: &str) -> Result<()> {
    let mut cmd = netns.command("nft");
    cmd.args(["-f", "-"]);
    run_with_stdin(&mut cmd, script.as_bytes())
}

/// Deletes `table ip <table>` inside `netns`; a missing table (or netns) is fine.
pub fn delete_table(netns: &Netns, table: &str) -> Result<()> {
    if !netns.exists() {
        return Ok(());
    }
    // Declare-then-delete in one transaction: succeeds whether or not the table exists.
    let mut cmd = netns.command("nft");
    cmd.args(["-f", "-"]);
    run_with_stdin(
        &mut cmd,
        format!(
            "table ip {table} {{}}\ndelete table ip {table}\ntable ip6 {table} {{}}\ndelete table ip6 {table}\n"
        )
        .as_bytes(),
    )
}

/// Whether `table ip <table>` exists inside `netns`.
pub fn table_exists(netns: &Netns, table: &str) -> bool {
    run_checked(netns.command("nft").args(["list", "table", "ip", table])).is_ok()
}

fn comment(name: &str) -> String {
    name.chars()
        .filter(|c| *c != '"' && *c != '\\' && !c.is_control())
        .take(120)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web(endpoints: Vec<Ipv4Addr>) -> Service {
        Service {
            name: "web".into(),
            cluster_ip: Ipv4Addr::new(10, 96, 0, 100),
            port: 80,
            protocol: Protocol::Tcp,
            target_port: 8080,
            endpoints,
        }
    }

    #[test]
    fn balances_over_every_endpoint() {
        let script = render_ruleset(
            "t",
            &[web(vec![
                Ipv4Addr::new(10, 244, 1, 11),
                Ipv4Addr::new(10, 244, 1, 12),
            ])],
            &[],
        );
        assert!(
            script.contains("ip daddr 10.96.0.100 tcp dport 80 jump svc-0"),
            "{script}"
        );
        assert!(
            script
                .contains("numgen random mod 2 vmap { 0 : jump svc-0-ep-0, 1 : jump svc-0-ep-1 }"),
            "{script}"
        );
        assert!(
            script.contains("meta l4proto tcp dnat to 10.244.1.11:8080"),
            "{script}"
        );
        assert!(
            script.contains("meta l4proto tcp dnat to 10.244.1.12:8080"),
            "{script}"
        );
        assert!(
            script.contains("ip saddr 10.244.1.12 meta mark set meta mark | 0x4000"),
            "{script}"
        );
        assert!(
            script.starts_with("table ip t {}\ndelete table ip t\n"),
            "{script}"
        );
    }

    #[test]
    fn service_without_endpoints_gets_no_dnat() {
        let script = render_ruleset("t", &[web(vec![])], &[]);
        assert!(!script.contains("10.96.0.100"), "{script}");
        assert!(!script.contains("svc-0"), "{script}");
    }

    #[test]
    fn node_port_forwards_to_the_pod() {
        let script = render_ruleset(
            "t",
            &[],
            &[NodePort {
                name: "manager \"x\"".into(),
                node_ip: Ipv4Addr::new(172, 31, 255, 1),
                port: 10801,
                protocol: Protocol::Tcp,
                pod_ip: Ipv4Addr::new(10, 244, 1, 10),
                target_port: 10801,
            }],
        );
        assert!(
            script.contains(
                "ip daddr 172.31.255.1 tcp dport 10801 jump nodeport-0 comment \"manager x\""
            ),
            "{script}"
        );
        assert!(
            script.contains("meta l4proto tcp dnat to 10.244.1.10:10801"),
            "{script}"
        );
    }

    fn rule(
        name: &str,
        kind: RuleKind,
        ip: [u8; 4],
        port: u16,
        protocol: Protocol,
        backends: &[([u8; 4], u16)],
    ) -> ServiceRule {
        ServiceRule {
            name: name.into(),
            kind,
            ip: IpAddr::V4(Ipv4Addr::from(ip)),
            port,
            protocol,
            backends: backends
                .iter()
                .map(|(ip, port)| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(*ip), *port)))
                .collect(),
        }
    }

    #[test]
    fn rules_dnat_each_backend_to_its_own_port() {
        let script = render_rules(
            "t",
            &[rule(
                "demo/web:http",
                RuleKind::ClusterIp,
                [10, 96, 1, 100],
                80,
                Protocol::Tcp,
                &[([10, 244, 1, 11], 8080), ([10, 244, 1, 12], 9090)],
            )],
        );
        assert!(
            script
                .contains("ip daddr 10.96.1.100 tcp dport 80 jump svc-0 comment \"demo/web:http\""),
            "{script}"
        );
        assert!(script.contains("dnat to 10.244.1.11:8080"), "{script}");
        assert!(script.contains("dnat to 10.244.1.12:9090"), "{script}");
        assert!(!script.contains("reject"), "{script}");
    }

    #[test]
    fn rules_without_backends_are_rejected_not_dnated() {
        let script = render_rules(
            "t",
            &[
                rule(
                    "a/tcp:x",
                    RuleKind::ClusterIp,
                    [10, 96, 1, 1],
                    80,
                    Protocol::Tcp,
                    &[],
                ),
                rule(
                    "a/udp:y",
                    RuleKind::ClusterIp,
                    [10, 96, 1, 1],
                    53,
                    Protocol::Udp,
                    &[],
                ),
                rule(
                    "a/np",
                    RuleKind::NodePort,
                    [172, 31, 255, 1],
                    30080,
                    Protocol::Tcp,
                    &[],
                ),
            ],
        );
        assert!(
            script.contains("ip daddr 10.96.1.1 tcp dport 80 reject with tcp reset"),
            "{script}"
        );
        assert!(
            script
                .contains("ip daddr 10.96.1.1 udp dport 53 reject with icmp type port-unreachable"),
            "{script}"
        );
        assert!(
            script.contains("ip daddr 172.31.255.1 tcp dport 30080 reject with tcp reset"),
            "{script}"
        );
        assert!(!script.contains("jump svc-"), "{script}");
        assert!(!script.contains("dnat"), "{script}");
        assert!(
            script.contains("type filter hook prerouting priority -110"),
            "{script}"
        );
        assert!(
            script.contains("type filter hook output priority -110"),
            "{script}"
        );
    }

    #[test]
    fn rules_number_chains_per_kind() {
        let script = render_rules(
            "t",
            &[
                rule(
                    "n",
                    RuleKind::NodePort,
                    [172, 31, 255, 1],
                    30080,
                    Protocol::Tcp,
                    &[([10, 244, 1, 11], 8080)],
                ),
                rule(
                    "s0",
                    RuleKind::ClusterIp,
                    [10, 96, 1, 1],
                    80,
                    Protocol::Tcp,
                    &[([10, 244, 1, 11], 8080)],
                ),
                rule(
                    "s1",
                    RuleKind::ClusterIp,
                    [10, 96, 1, 2],
                    7,
                    Protocol::Udp,
                    &[([10, 244, 1, 12], 7007)],
                ),
            ],
        );
        assert!(
            script.contains("tcp dport 30080 jump nodeport-0"),
            "{script}"
        );
        assert!(script.contains("tcp dport 80 jump svc-0"), "{script}");
        assert!(script.contains("udp dport 7 jump svc-1"), "{script}");
        assert!(script.contains("chain svc-1-ep-0 {"), "{script}");
        assert!(
            script.contains("meta l4proto udp dnat to 10.244.1.12:7007"),
            "{script}"
        );
    }
}
