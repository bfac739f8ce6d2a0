//! Split DNS through systemd-resolved (case dns-04): where resolved manages the
//! laptop's DNS, the TUN link gets the cluster nameserver, the cluster domain as
//! a routing domain (so `.local` questions go to the cluster, not to mDNS), the
//! search domains (connected namespace first), is not a default route for other
//! names, and does no LLMNR or mDNS. Cluster questions are plain DNS: a global
//! `DNSOverTLS=yes`/`opportunistic` would otherwise send them over TLS to port
//! 853 of the cluster DNS, which no cluster DNS serves, and a global `DNSSEC=yes`
//! would fail the unsigned cluster zone, so the link gets `dnsovertls no` and
//! `dnssec no`. The cluster domain is usually in the search
//! list already (`cluster.local`), and a search domain routes too: then
//! `resolvectl domain` shows it without `~`; otherwise it is added as
//! `~<cluster domain>`. resolved drops all of it when the TUN device goes;
//! disconnect also reverts it explicitly. tests/tests/kube_dns_resolved.rs runs
//! this against a real systemd-resolved.
//!
//! Detection and command construction are pure ([`uses_stub`], [`link_commands`],
//! [`revert_command`]); [`available`] and [`run`] start `resolvectl`.
//!
//! resolved applies search domains to single-label names only, so `svc` and
//! `svc.ns.svc.cluster.local` resolve, but `svc.ns` does not on this path (pods'
//! ndots:5 makes it work in a cluster; the forwarder path expands it too).

use std::net::{IpAddr, Ipv4Addr};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

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

/// How long one `resolvectl` call may take (it waits on D-Bus; the daemon must
/// not wait on a stuck bus for long).
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `resolvectl` runs and reaches resolved (over D-Bus) within [`TIMEOUT`].
pub async fn available() -> bool {
    resolvectl(&["status".to_owned()])
        .await
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
    // A search domain is a routing domain too, and resolved keeps one entry per
    // name (the search one): `~cluster.local` only when the search list lacks
    // the cluster domain itself, which resolv.conf readers of resolved's stub
    // file still need as a search suffix (`svc.ns.svc`).
    let domain_text = cluster.domain_text();
    let search = cluster.search_text();
    let mut domain = vec!["domain".to_owned(), link.to_owned()];
    if !search.contains(&domain_text) {
        domain.push(format!("~{domain_text}"));
    }
    domain.extend(search);
    let set = |what: &str, value: &str| vec![what.to_owned(), link.to_owned(), value.to_owned()];
    vec![
        dns,
        domain,
        set("default-route", "false"),
        // The TUN is no local segment: no LLMNR or mDNS questions into the
        // tunnel (and none answered from it).
        set("llmnr", "no"),
        set("mdns", "no"),
        set("dnsovertls", "no"),
        set("dnssec", "no"),
    ]
}

/// The `resolvectl` invocation that drops everything set on `link`.
pub fn revert_command(link: &str) -> Vec<String> {
    vec!["revert".to_owned(), link.to_owned()]
}

/// Run `resolvectl` with each argument list, in order; the first failure names
/// the command.
pub async fn run(commands: &[Vec<String>]) -> Result<(), String> {
    for args in commands {
        let out = resolvectl(args).await.map_err(|e| {
            format!(
                "resolvectl {}: {e} — is systemd-resolved installed and running? \
                 KVPN_DNS_MODE=forwarder uses kvpn's own DNS forwarder instead",
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

/// One `resolvectl` run, killed after [`TIMEOUT`].
async fn resolvectl(args: &[String]) -> std::io::Result<std::process::Output> {
    let child = Command::new("resolvectl")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {} s", TIMEOUT.as_secs()),
            ))
        })
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
                "domain kvpn0 dev.svc.cluster.local svc.cluster.local cluster.local",
                "default-route kvpn0 false",
                "llmnr kvpn0 no",
                "mdns kvpn0 no",
                "dnsovertls kvpn0 no",
                "dnssec kvpn0 no",
            ]
        );
        // Without the cluster domain in the search list it is a routing domain.
        let c = ClusterDns::new(
            &["10.96.0.10".into()],
            "cluster.local",
            &["dev.svc.cluster.local".into()],
            false,
        )
        .expect("valid");
        assert_eq!(
            link_commands("kvpn0", &c)[1].join(" "),
            "domain kvpn0 ~cluster.local dev.svc.cluster.local"
        );
        assert_eq!(revert_command("kvpn0").join(" "), "revert kvpn0");
    }
}
