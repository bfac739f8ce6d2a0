//! Split DNS through systemd-resolved (case dns-04): where resolved manages the
//! laptop's DNS, the TUN link gets the cluster nameserver, the routing domain
//! `~<cluster domain>` (so `.local` questions go to the cluster, not to mDNS), the
//! search domains (connected namespace first), and is not a default route for
//! other names. resolved drops all of it when the TUN device goes; disconnect also
//! reverts it explicitly.
//!
//! Detection and command construction are pure ([`uses_stub`], [`link_commands`],
//! [`revert_command`]); [`available`] and [`run`] start `resolvectl`.
//!
//! resolved applies search domains to single-label names only, so `svc` and
//! `svc.ns.svc.cluster.local` resolve, but `svc.ns` does not on this path (pods'
//! ndots:5 makes it work in a cluster; the forwarder path expands it too).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use super::names::ClusterDns;
use super::resolv_conf::Resolv;

/// Addresses of resolved's stub listeners (`127.0.0.53` and, since v247, the
/// proxy-only `127.0.0.54`).
pub const STUB_ADDRESSES: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)),
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 54)),
];

/// Whether a resolv.conf sends everything to resolved's stub.
pub fn uses_stub(resolv: &Resolv) -> bool {
    !resolv.nameservers.is_empty()
        && resolv
            .nameservers
            .iter()
            .all(|ns| STUB_ADDRESSES.contains(ns))
}

/// Whether `resolvectl` runs and reaches resolved (over D-Bus).
pub fn available() -> bool {
    Command::new("resolvectl")
        .arg("status")
        .stdin(std::process::Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The `resolvectl` invocations that make `link` carry `cluster`'s names.
pub fn link_commands(link: &str, cluster: &ClusterDns) -> Vec<Vec<String>> {
    let mut dns = vec!["dns".to_owned(), link.to_owned()];
    dns.extend(cluster.servers.iter().map(|s| {
        if s.port() == 53 {
            s.ip().to_string()
        } else {
            s.to_string()
        }
    }));
    let mut domain = vec![
        "domain".to_owned(),
        link.to_owned(),
        format!("~{}", cluster.domain_text()),
    ];
    domain.extend(cluster.search_text());
    vec![
        dns,
        domain,
        vec![
            "default-route".to_owned(),
            link.to_owned(),
            "false".to_owned(),
        ],
    ]
}

/// The `resolvectl` invocation that drops everything set on `link`.
pub fn revert_command(link: &str) -> Vec<String> {
    vec!["revert".to_owned(), link.to_owned()]
}

/// Run `resolvectl` with each argument list; the first failure names the command.
pub fn run(commands: &[Vec<String>]) -> Result<(), String> {
    for args in commands {
        let out = Command::new("resolvectl")
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| {
                format!(
                    "cannot run resolvectl {}: {e} — is systemd-resolved installed?",
                    args.join(" ")
                )
            })?;
        if !out.status.success() {
            return Err(format!(
                "resolvectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::resolv_conf::parse;
    use super::*;

    #[test]
    fn detects_the_stub_only() {
        assert!(uses_stub(&parse(
            b"nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .\n"
        )));
        assert!(!uses_stub(&parse(
            b"nameserver 127.0.0.53\nnameserver 1.1.1.1\n"
        )));
        assert!(!uses_stub(&parse(b"nameserver 192.168.1.1\n")));
        assert!(!uses_stub(&parse(b"")));
    }

    #[test]
    fn link_commands_route_the_cluster_domain_and_search_the_namespace_first() {
        let c = ClusterDns::new(
            &["10.96.0.10".into(), "10.96.0.11:5353".into()],
            "cluster.local",
            &[
                "dev.svc.cluster.local".into(),
                "svc.cluster.local".into(),
                "cluster.local".into(),
            ],
            false,
        )
        .expect("valid");
        let cmds = link_commands("kvpn0", &c);
        let text: Vec<String> = cmds.iter().map(|c| c.join(" ")).collect();
        assert_eq!(
            text,
            vec![
                "dns kvpn0 10.96.0.10 10.96.0.11:5353",
                "domain kvpn0 ~cluster.local dev.svc.cluster.local svc.cluster.local cluster.local",
                "default-route kvpn0 false",
            ]
        );
        assert_eq!(revert_command("kvpn0").join(" "), "revert kvpn0");
    }
}
