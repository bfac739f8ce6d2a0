//! ClusterIPs and NodePorts as nftables DNAT rules, the way kube-proxy's nftables mode
//! builds them: a `services` dispatch chain matched on destination address and port,
//! one chain per service that picks an endpoint with `numgen random mod N vmap`, and
//! one chain per endpoint that DNATs to `pod-ip:target-port`.
//!
//! [`render_ruleset`] is pure (services in, `nft -f` script out) so the kube-proxy
//! stand-in of the Kubernetes lab can re-render on every change; [`apply`] loads a
//! script inside a netns in one transaction (delete + re-create of the table), so
//! updates are atomic and established connections keep their conntrack entries.
//!
//! Hairpin: a pod that reaches its own ClusterIP and gets itself as the endpoint is
//! masqueraded to the node's bridge address (mark 0x4000, as kube-proxy), otherwise
//! its reply would never pass the node and never be un-DNATed. This needs hairpin
//! mode on the bridge port (see `topology`).

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use crate::Result;
use crate::netns::{Netns, run_with_stdin};

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

/// Renders an `nft -f` script that atomically replaces `table ip <table>` with DNAT
/// rules for `services` and `node_ports`. Names are only used in comments (quotes
/// stripped), chain names are derived from positions.
pub fn render_ruleset(table: &str, services: &[Service], node_ports: &[NodePort]) -> String {
    let mut s = String::new();
    // Declaring then deleting makes the delete succeed whether or not the table exists;
    // the whole file is one transaction.
    let _ = writeln!(
        s,
        "table ip {table} {{}}\ndelete table ip {table}\ntable ip {table} {{"
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
    for (i, svc) in services.iter().enumerate() {
        if svc.endpoints.is_empty() {
            continue;
        }
        let _ = writeln!(
            s,
            "    ip daddr {} {} dport {} jump svc-{i} comment \"{}\"",
            svc.cluster_ip,
            svc.protocol.as_str(),
            svc.port,
            comment(&svc.name)
        );
    }
    for (i, np) in node_ports.iter().enumerate() {
        let _ = writeln!(
            s,
            "    ip daddr {} {} dport {} jump nodeport-{i} comment \"{}\"",
            np.node_ip,
            np.protocol.as_str(),
            np.port,
            comment(&np.name)
        );
    }
    let _ = writeln!(s, "  }}");
    for (i, svc) in services.iter().enumerate() {
        if svc.endpoints.is_empty() {
            continue;
        }
        let arms: Vec<String> = (0..svc.endpoints.len())
            .map(|j| format!("{j} : jump svc-{i}-ep-{j}"))
            .collect();
        let _ = writeln!(
            s,
            "  chain svc-{i} {{\n    numgen random mod {} vmap {{ {} }}\n  }}",
            svc.endpoints.len(),
            arms.join(", ")
        );
        for (j, ep) in svc.endpoints.iter().enumerate() {
            let _ = writeln!(
                s,
                "  chain svc-{i}-ep-{j} {{\n    ip saddr {ep} meta mark set meta mark | {MASQUERADE_MARK:#x}\n    meta l4proto {} dnat to {ep}:{}\n  }}",
                svc.protocol.as_str(),
                svc.target_port
            );
        }
    }
    for (i, np) in node_ports.iter().enumerate() {
        let _ = writeln!(
            s,
            "  chain nodeport-{i} {{\n    meta l4proto {} dnat to {}:{}\n  }}",
            np.protocol.as_str(),
            np.pod_ip,
            np.target_port
        );
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
}
