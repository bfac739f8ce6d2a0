//! The laptop's essentials: addresses that must keep their current route even when a
//! cluster CIDR covers them (case rt-02) — the API server, the SSH jump hosts, the
//! laptop's nameservers, its default gateways and other VPNs' endpoints
//! ([`super::vpn`]). [`super::exclude`] punches them out
//! of the cluster ranges before routes are installed.
//!
//! I/O: reads `/etc/resolv.conf` (and systemd-resolved's upstream list when the
//! former only names its loopback stub), dumps routes over rtnetlink (no privileges
//! needed), and resolves host names with the system resolver. The parsers are pure.

use std::net::IpAddr;
use std::path::Path;

use futures::TryStreamExt as _;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteType, RouteVia,
};

/// The system resolver's configuration.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";
/// systemd-resolved's list of upstream servers, used when [`RESOLV_CONF`] names only
/// its stub (127.0.0.53): the stub forwards there, so those must stay off the tunnel.
pub const RESOLVED_UPSTREAM_CONF: &str = "/run/systemd/resolve/resolv.conf";

/// Addresses to keep out of the tunnel, by why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Essentials {
    pub api_servers: Vec<IpAddr>,
    pub ssh_hosts: Vec<IpAddr>,
    pub nameservers: Vec<IpAddr>,
    pub gateways: Vec<IpAddr>,
    /// Other VPNs' endpoints, each with how it was found ([`super::vpn`]).
    pub vpn_endpoints: Vec<(IpAddr, String)>,
    /// What could not be found out (unreadable file, netlink error, unresolvable
    /// host), for progress output; the lists above then miss those addresses.
    pub problems: Vec<String>,
}

impl Essentials {
    /// Every address with what it is ("the API server", "a nameserver", …), in
    /// the order api servers, SSH hosts, nameservers, gateways; an address that
    /// is two things appears twice.
    pub fn labelled(&self) -> Vec<(IpAddr, String)> {
        [
            (&self.api_servers, "the API server"),
            (&self.ssh_hosts, "an SSH jump host"),
            (&self.nameservers, "a nameserver"),
            (&self.gateways, "a default gateway"),
        ]
        .into_iter()
        .flat_map(|(ips, what)| ips.iter().map(move |ip| (*ip, what.to_owned())))
        .chain(self.vpn_endpoints.iter().cloned())
        .collect()
    }

    /// Every address, sorted, without duplicates.
    pub fn addresses(&self) -> Vec<IpAddr> {
        let mut all: Vec<IpAddr> = self
            .api_servers
            .iter()
            .chain(&self.ssh_hosts)
            .chain(&self.nameservers)
            .chain(&self.gateways)
            .copied()
            .chain(self.vpn_endpoints.iter().map(|(ip, _)| *ip))
            .collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// Something the essentials could not be read from.
#[derive(Debug, thiserror::Error)]
pub enum EssentialsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot list the laptop's routes over rtnetlink: {0}")]
    Netlink(String),
    #[error("cannot resolve host {host:?}: {source}")]
    Resolve {
        host: String,
        #[source]
        source: std::io::Error,
    },
}

/// The `nameserver` addresses of a resolv.conf text, in file order. Lenient like
/// glibc: a bad line is skipped (and logged), the rest still counts. IPv6 zone ids
/// (`fe80::1%eth0`) are dropped: a route exclusion works on the address.
pub fn nameservers_from_resolv_conf(text: &[u8]) -> Vec<IpAddr> {
    let (config, errors) = resolv_conf::Config::parse_with_errors(text);
    for e in errors {
        tracing::debug!(error = %e, "skipping a resolv.conf line");
    }
    config.nameservers.iter().map(IpAddr::from).collect()
}

/// The laptop's nameservers from `resolv_conf`; when one of them is a loopback stub
/// and `upstream_conf` exists, its nameservers too.
pub fn laptop_nameservers(
    resolv_conf: &Path,
    upstream_conf: &Path,
) -> Result<Vec<IpAddr>, EssentialsError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|source| EssentialsError::Read {
            path: p.display().to_string(),
            source,
        })
    };
    let mut out = nameservers_from_resolv_conf(&read(resolv_conf)?);
    if out.iter().any(IpAddr::is_loopback) && upstream_conf.exists() {
        out.extend(nameservers_from_resolv_conf(&read(upstream_conf)?));
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|ip| seen.insert(*ip));
    Ok(out)
}

/// The gateways of the default routes among `routes` (an RTM_GETROUTE dump): every
/// unicast route with prefix length 0, in any table, its `RTA_GATEWAY`, its
/// `RTA_VIA` (an IPv4 route through an IPv6 next hop) and the gateways of each
/// multipath next hop. A default route straight onto a link has no gateway and adds
/// nothing.
pub fn default_gateways_of(routes: &[RouteMessage]) -> Vec<IpAddr> {
    fn gateway(attr: &RouteAttribute) -> Option<IpAddr> {
        match attr {
            RouteAttribute::Gateway(RouteAddress::Inet(a)) => Some(IpAddr::V4(*a)),
            RouteAttribute::Gateway(RouteAddress::Inet6(a)) => Some(IpAddr::V6(*a)),
            RouteAttribute::Via(RouteVia::Inet(a)) => Some(IpAddr::V4(*a)),
            RouteAttribute::Via(RouteVia::Inet6(a)) => Some(IpAddr::V6(*a)),
            _ => None,
        }
    }
    let mut out = Vec::new();
    for route in routes {
        if route.header.destination_prefix_length != 0 || route.header.kind != RouteType::Unicast {
            continue;
        }
        for attr in &route.attributes {
            match attr {
                RouteAttribute::MultiPath(hops) => {
                    out.extend(
                        hops.iter()
                            .flat_map(|h| h.attributes.iter().filter_map(gateway)),
                    );
                }
                other => out.extend(gateway(other)),
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The default gateways of the calling thread's network namespace, both families.
/// Needs a tokio runtime (the netlink connection is spawned on it).
pub async fn default_gateways() -> Result<Vec<IpAddr>, EssentialsError> {
    dump_routes().await.map(|r| default_gateways_of(&r))
}

/// Every route of the calling thread's network namespace (all tables), both
/// families. Needs a tokio runtime.
pub async fn dump_routes() -> Result<Vec<RouteMessage>, EssentialsError> {
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(|e| EssentialsError::Netlink(e.to_string()))?;
    let task = tokio::spawn(connection);
    let mut routes = Vec::new();
    let mut result = Ok(());
    for family in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut query = RouteMessage::default();
        query.header.address_family = family;
        let mut stream = handle.route().get(query).execute();
        loop {
            match stream.try_next().await {
                Ok(Some(r)) => routes.push(r),
                Ok(None) => break,
                // IPv6 disabled (case rt-08): no IPv6 routes to list.
                Err(_) if family == AddressFamily::Inet6 => break,
                Err(e) => {
                    result = Err(EssentialsError::Netlink(e.to_string()));
                    break;
                }
            }
        }
    }
    task.abort();
    result.map(|()| routes)
}

/// The addresses of `host`: an IP literal (IPv6 possibly in brackets, as in a URL)
/// as is, else the system resolver's answer.
pub async fn resolve_host(host: &str) -> Result<Vec<IpAddr>, EssentialsError> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Ok(vec![ip]);
    }
    let addrs =
        tokio::net::lookup_host((bare, 0))
            .await
            .map_err(|source| EssentialsError::Resolve {
                host: host.to_owned(),
                source,
            })?;
    let mut ips: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
    ips.sort_unstable();
    ips.dedup();
    Ok(ips)
}

/// Gather the essentials: `api_server_hosts` (the kubeconfig server's host, and a
/// proxy's if one is used) and `ssh_hosts` (every jump host) resolved, the laptop's
/// nameservers and default gateways. Never fails: what cannot be found out goes to
/// [`Essentials::problems`].
pub async fn gather(api_server_hosts: &[&str], ssh_hosts: &[&str]) -> Essentials {
    let mut e = Essentials::default();
    for (hosts, into_api) in [(api_server_hosts, true), (ssh_hosts, false)] {
        for host in hosts {
            match resolve_host(host).await {
                Ok(ips) if into_api => e.api_servers.extend(ips),
                Ok(ips) => e.ssh_hosts.extend(ips),
                Err(err) => e.problems.push(err.to_string()),
            }
        }
    }
    match laptop_nameservers(Path::new(RESOLV_CONF), Path::new(RESOLVED_UPSTREAM_CONF)) {
        Ok(ns) => e.nameservers = ns,
        Err(err) => e.problems.push(err.to_string()),
    }
    let routes = match dump_routes().await {
        Ok(r) => r,
        Err(err) => {
            e.problems.push(err.to_string());
            Vec::new()
        }
    };
    e.gateways = default_gateways_of(&routes);
    let (endpoints, problems) = vpn_endpoints(&routes).await;
    e.vpn_endpoints = endpoints;
    e.problems.extend(problems);
    for p in &e.problems {
        tracing::warn!(problem = %p, "an address to keep out of the tunnel is unknown");
    }
    e
}

/// Other VPNs' endpoints ([`super::vpn`]) from `routes` (a dump of every table),
/// the policy rules and the sockets; and what could not be found out.
pub async fn vpn_endpoints(routes: &[RouteMessage]) -> (Vec<(IpAddr, String)>, Vec<String>) {
    use super::vpn;
    let mut found = vpn::gateway_host_routes(routes);
    let mut problems = Vec::new();
    let rules = match vpn::dump_rules().await {
        Ok(r) => r,
        Err(err) => {
            problems.push(format!(
                "cannot list the laptop's policy rules over rtnetlink: {err} — another VPN's \
                 endpoint inside a cluster range may be captured; keep it off with --never-proxy"
            ));
            Vec::new()
        }
    };
    found.extend(vpn::host_rules(&rules));
    let marks = vpn::mark_rules(&rules);
    if !marks.is_empty() {
        match tokio::task::spawn_blocking(vpn::dump_sockets).await {
            Ok(Ok(sockets)) => {
                if !sockets.is_empty() && sockets.iter().all(|s| s.mark.is_none()) {
                    problems.push(format!(
                        "the laptop routes by firewall mark ({}), as VPNs such as wg-quick do, but \
                         socket marks are visible only with CAP_NET_ADMIN (run connect as root): \
                         that VPN's endpoint is unknown and, if inside a cluster range, would be \
                         captured — keep it off with --never-proxy <endpoint>/32",
                        marks
                            .iter()
                            .map(vpn::MarkRule::describe)
                            .collect::<Vec<_>>()
                            .join("; ")
                    ));
                }
                found.extend(vpn::marked_endpoints(&sockets, &marks));
            }
            Ok(Err(err)) => problems.push(format!(
                "{err} — the endpoint of the VPN behind {} is unknown; keep it off with \
                 --never-proxy",
                marks[0].describe()
            )),
            Err(err) => problems.push(format!("socket listing task failed: {err}")),
        }
    }
    let mut seen = std::collections::HashSet::new();
    found.retain(|(ip, _)| seen.insert(*ip));
    (found, problems)
}
